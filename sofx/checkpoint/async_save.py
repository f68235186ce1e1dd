"""Asynchronous saves: snapshot now, write in a background thread.

:func:`save_async` copies every tensor of the tree (to contiguous CPU memory; a
dense layout's memory in memory order, so that it loads back in that layout)
before it returns, then writes the file in a background thread. The caller
may therefore modify the tree in place, e.g. with a donated
``opt.update(..., donate=True)`` or a speculative step, as soon as
``save_async`` returns: the file holds the values of the moment of the call.
The snapshot costs one copy of the tree's tensors in host memory until the
write finishes.

Call it when no update is in flight on the tree (after ``step()``/``update``
returned): the snapshot reads the buffers while it copies them.

Saves to the same path complete in the order they were issued only when
chained: pass ``after=`` the previous handle, or use one :class:`AsyncSaver`,
which does that for you.

A failed write is logged when it fails (an ERROR on the ``sofx.checkpoint``
logger) and raised by the handle's ``wait()`` (or the :class:`AsyncSaver`'s
next ``save``/``wait``); one that nobody waits for is reported by that log
line only. The interpreter waits for saves still running at its exit. A save
issued by the main thread while the interpreter exits (in an ``atexit``
handler: the interpreter joined its threads before it runs them, and would
not wait for a thread started there) is written in the call, as
:func:`sofx.checkpoint.save` writes (its handle is done when it returns; a
failed write is logged and raised by ``wait()``, as an asynchronous one).
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import traceback
import time
from typing import Any

from sofx.checkpoint import io
from sofx.checkpoint.codec import EncodedTree
from sofx.checkpoint.errors import CheckpointError, check_path
from sofx.kernels.user_numbers import integer, is_bool, real_number

__all__ = ["SaveHandle", "save_async", "AsyncSaver"]

_log = logging.getLogger("sofx.checkpoint")


class SaveHandle:
    """A save in progress. ``wait()`` returns the path or re-raises the save's error."""

    def __init__(self, path: str, encoded: EncodedTree, after: SaveHandle | None) -> None:
        self.path = path
        self.nbytes = io.nbytes(encoded)
        self._encoded: EncodedTree | None = encoded
        self._after = after
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._error_traceback: Any = None  # the save's own: every raise of the error starts from it
        self._waited = False
        self._pid = os.getpid()  # (a forked child has no thread of this save: see _refuse_in_child)
        self._thread: threading.Thread | None = None
        if _exiting():
            self._run()  # (a thread started now would be frozen when the interpreter finalizes: the save lost)
            if self._error is not None and not isinstance(self._error, Exception):
                raise self._failure()  # type: ignore[misc]  # an interrupt (Ctrl-C) of the caller: raised at once
            return
        self._thread = threading.Thread(target=self._run, name=f"sofx-save:{os.path.basename(path)}", daemon=False)
        try:
            self._thread.start()
        except RuntimeError as exc:  # (at the process's limit on threads; a thread at interpreter shutdown)
            self._encoded = self._after = None
            raise CheckpointError(f"cannot save {path} asynchronously: its writing thread did not start "
                                  f"({type(exc).__name__}: {exc}); save it with sofx.checkpoint.save (the process "
                                  "is at its limit on threads, or its interpreter shuts down)") from exc

    def _run(self) -> None:
        try:
            if self._after is not None:
                self._after._done.wait()  # keep the order of saves; its own error is its own business
            self._after = None
            io.write(self.path, self._encoded)
        except BaseException as exc:  # noqa: BLE001 - re-raised in wait()
            _drop_locals(exc)
            self._error, self._error_traceback = exc, exc.__traceback__
            _log.error("asynchronous checkpoint save to %s failed: %s", self.path, exc)
        finally:
            self._encoded = None  # free the snapshot
            self._done.set()

    def done(self) -> bool:
        """True once the file is committed or the save failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the save finished; return the path, or raise its error (``TimeoutError`` on timeout:
        ``timeout`` seconds, ``None`` or inf for no limit). In a process forked while it ran, a
        :class:`CheckpointError` (its thread is in the parent only)."""
        timeout = _seconds("SaveHandle.wait", timeout)
        self._refuse_in_child("wait for it")
        if not self._done.wait(timeout):
            raise TimeoutError(f"the checkpoint save to {self.path} did not finish within {timeout} s")
        if self._thread is not None:
            self._thread.join()
        self._waited = True
        error = self._failure()
        if error is not None:
            raise error
        return self.path

    def _refuse_in_child(self, what: str) -> None:
        """Refuse (a :class:`CheckpointError`) to ``what`` with this save in a process forked while it ran (a
        fork-based DataLoader worker): its thread runs in the parent only, and nothing would ever finish it here."""
        if not self._done.is_set() and os.getpid() != self._pid:
            raise CheckpointError(f"the checkpoint save to {self.path} runs in process {self._pid}, which forked "
                                  f"this one ({os.getpid()}) while it ran: its thread is not here; {what} in that "
                                  "process")

    def exception(self) -> BaseException | None:
        """The error of a finished save (``None`` if it succeeded or is still running)."""
        return self._failure() if self._done.is_set() else None

    def _failure(self) -> BaseException | None:
        """The save's error with the save's own traceback: each raise of one exception object adds the raising
        frames to its traceback, which grew with every wait() of a failed save."""
        return None if self._error is None else self._error.with_traceback(self._error_traceback)

    def __repr__(self) -> str:
        status = "running" if not self.done() else ("failed" if self._error else "done")
        return f"SaveHandle({self.path!r}, {self.nbytes} bytes, {status})"


def save_async(path: str | os.PathLike, tree: Any, *, after: SaveHandle | None = None) -> SaveHandle:
    """Snapshot ``tree`` now and write it to ``path`` in a background thread.

    Bad input raises here, before anything is written or copied: a tree that
    cannot be saved (also one whose structure is too large for a file's
    header), a destination :func:`sofx.checkpoint.save` refuses up front (a
    directory that does not exist or is a file, or that this process may not
    write; a path that is a directory), and an ``after`` that is not a handle.
    ``after``: a previous handle whose save must be committed first (to keep
    the order of saves to one path). The returned handle's
    ``wait()`` re-raises a failed write (a full disk, the directory removed
    meanwhile).
    """
    path = check_path("save_async", path)
    if after is not None and not isinstance(after, SaveHandle):
        raise CheckpointError(f"save_async: after= must be a SaveHandle (a previous save_async's) or None, got "
                              f"{type(after).__name__} {after!r:.80}")
    if after is not None:
        after._refuse_in_child("chain a save after it")
    path = io.check_writable(path)
    encoded = io.snapshot(tree, path)
    return SaveHandle(path, encoded, after)


class AsyncSaver:
    """Issues asynchronous saves that commit in the order they were requested.

    >>> saver = AsyncSaver()
    >>> saver.save("ckpt.safetensors", {"params": params, "state": state})  # returns at once
    >>> saver.wait()                                                       # all saves committed

    ``max_pending``: at most this many saves unfinished at once, also where threads call ``save`` at the same
    time; ``save`` first waits for the oldest (each holds a snapshot of its tree: saves issued faster than the
    disk writes them would hold one each). ``None``: no bound.

    A failed save's error is raised by the next ``save`` (before it snapshots anything: nothing is issued) or
    ``wait``, whichever comes first, once: a loop that saves every so often learns of a full disk at its next
    save, not at the end of the run. Leaving a ``with AsyncSaver() as saver:`` block waits for every save; where
    the block raised, its exception propagates, with a save's error as a note on it.
    """

    def __init__(self, max_pending: int | None = None) -> None:
        # a Python int (numpy's was refused)
        self.max_pending = None if max_pending is None else integer("AsyncSaver: max_pending", max_pending, 1,
                                                                    CheckpointError)
        self._pending: list[SaveHandle] = []
        self._lock = threading.Lock()  # guards _pending (wait() takes it too)
        # One save at a time counts the running ones and starts its own: two threads' saves both passed a
        # count of max_pending - 1 when it was taken apart from the start.
        self._admission = threading.Lock()

    def save(self, path: str | os.PathLike, tree: Any) -> SaveHandle:
        """Snapshot ``tree`` now (after waiting for a save to finish where ``max_pending`` are running); write
        it after every save issued before by this saver. Where an earlier save has failed, raise its error
        instead (as :meth:`wait` would: the first, each once), before anything is snapshotted or written."""
        path = check_path("AsyncSaver.save", path)
        with self._admission:
            while True:
                self._raise_failed()
                if self.max_pending is None:
                    break
                with self._lock:
                    running = [h for h in self._pending if not h.done()]
                if len(running) < self.max_pending:
                    break
                running[0]._refuse_in_child("wait for it")
                running[0]._done.wait()  # its error, if any, is raised above
            with self._lock:
                last = self._pending[-1] if self._pending else None
                handle = save_async(path, tree, after=last)
                self._pending = [h for h in self._pending if not h.done() or h.exception() is not None] + [handle]
        return handle

    def _raise_failed(self) -> None:
        """Raise the error of the first save that has failed, forgetting every failed one (as :meth:`wait`
        reports them); the saves still running or committed stay."""
        with self._lock:
            failed = [h for h in self._pending if h.done() and h.exception() is not None]
            self._pending = [h for h in self._pending if not any(h is f for f in failed)]
        if failed:
            raise failed[0]._failure()  # type: ignore[misc]  # (set: it failed)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every save issued so far (``timeout``: for all of them together); re-raise the first error
        (each error once). On a timeout, or an interrupt (Ctrl-C, raised at once), nothing is forgotten but the
        saves committed: a later ``wait`` waits for the saves still running and reports every error not yet
        reported (also of saves that had failed before the wait was cut short)."""
        timeout = _seconds("AsyncSaver.wait", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._pending)
        committed: list[SaveHandle] = []
        failed: list[SaveHandle] = []
        reported = False
        try:
            for h in pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    h.wait(left)
                except BaseException as exc:  # noqa: BLE001 - the first is re-raised below
                    if exc is not h.exception():
                        raise  # a timeout or an interrupt (Ctrl-C) of this wait, not the save's error
                    failed.append(h)
                    continue
                committed.append(h)
            reported = True
        finally:
            forget = committed + failed if reported else committed
            with self._lock:  # (saves issued meanwhile stay)
                self._pending = [h for h in self._pending if not any(h is f for f in forget)]
        if failed:
            raise failed[0]._failure()  # type: ignore[misc]  # (set: it failed)

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """Wait for every save (:meth:`wait`). Where the ``with`` body raised, its exception propagates: a save's
        error is added to it as a note (Python 3.11+; logged before 3.11, as when the save failed), never raised in
        its place."""
        if exc is None:
            self.wait()
            return
        try:
            self.wait()
        except Exception as failure:  # noqa: BLE001 - the body's exception is the one raised (an interrupt is not)
            note = (f"while it propagated, AsyncSaver's wait for its saves failed too: {type(failure).__name__}: "
                    f"{failure}")
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:
                _log.error("%s: %s", type(exc).__name__, note)


def _exiting() -> bool:
    """Whether a save issued now would not be waited for: the main thread calls while the interpreter exits (it
    runs the ``atexit`` handlers after joining the non-daemon threads, and a thread started then is frozen when it
    finalizes; Python 3.12 refuses to start one). A thread that another non-daemon thread starts meanwhile is
    joined, as the interpreter joins threads until none is left."""
    return bool(getattr(threading, "_SHUTTING_DOWN", False)) and threading.current_thread() is threading.main_thread()


def _seconds(who: str, timeout: Any) -> float | None:
    """``timeout`` of ``who`` as a Python float of seconds, or ``None`` (no limit): for ``None``, inf and anything
    beyond ``threading.TIMEOUT_MAX`` (an inf wait raised threading's bare OverflowError); a negative number is 0,
    as threading takes it. A numpy number or a 1-element tensor is read; anything else (a bool, a nan, a str) is a
    :class:`CheckpointError` naming ``who``."""
    if timeout is None:
        return None
    t = real_number(timeout, "timeout", CheckpointError)
    if not isinstance(t, numbers.Real) or is_bool(t) or t != t:  # (t != t: a nan)
        raise CheckpointError(f"{who}: timeout must be None or a number of seconds (inf: no limit), got "
                              f"{type(timeout).__name__} {timeout!r:.80}")
    return None if t > threading.TIMEOUT_MAX else max(0.0, float(t))


def _drop_locals(exc: BaseException) -> None:
    """Clear the local variables of the finished frames in the tracebacks of ``exc`` and of the exceptions it
    chains: a failed save keeps its error until ``wait()``, and a frame of the writer holds the whole snapshot
    (a loop saving to a full disk grew by a model's copy per save). The tracebacks still show where."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
