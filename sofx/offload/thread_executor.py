"""The thread executor: one worker thread runs operations in order (torch kernels release the GIL).

While the caller waits in ``step()`` it may *help* (:meth:`ThreadExecutor.wait` with
``help=True``): it takes queued operations that touch one block each from the head
of the queue and runs them itself, so that blocks are stepped on two cores:
``"ready"`` operations (speculative steps of different blocks, whose decisions the
engine keeps in arrival order; they may start beside anything but ``"commit_all"``) and ``"apply"``
operations (``step()``'s actions: commit, undo+redo, a late step, of a block each;
they may start beside other ``"apply"`` operations on other blocks). Every other
operation runs on the worker, in submission order, after everything submitted
before it has finished.

:meth:`ThreadExecutor.close` lets the worker run what was queued and stop, waiting at most
its timeout (the engine's ``timeout``), and not at all after a :meth:`~ThreadExecutor.wait`
that timed out or was interrupted (a second Ctrl-C); a thread still running an operation then
cannot be stopped: it is left to finish that one alone (the queued ones are dropped), with a
warning that says so.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch

from sofx.offload.block_ops import BlockOp, OpResult
from sofx.offload.block_runner import BlockRunner
from sofx.offload.executor import BlockNamer, Executor, ExecutorError, ExecutorTimeout, block_number, raise_failures
from sofx.offload.interrupts import NO_GATE
from sofx.warn import caller_stacklevel

__all__ = ["ThreadExecutor", "CLOSE_TIMEOUT_S"]

#: How long :meth:`ThreadExecutor.close` lets the worker finish what was queued, by default.
CLOSE_TIMEOUT_S = 30.0

_STOP = object()
_HELPABLE = ("ready", "apply")  # operations on one block each, which a helper may run (see _may_start)


class ThreadExecutor(Executor):
    """Runs operations on ``runner`` in a daemon thread, in submission order; :meth:`close` waits up to
    ``close_timeout`` seconds for them."""

    name = "thread"

    def __init__(self, runner: BlockRunner, interrupts: AbstractContextManager[Any] = NO_GATE,
                 close_timeout: float = CLOSE_TIMEOUT_S, describe: BlockNamer = block_number) -> None:
        super().__init__(describe)
        self.runner = runner
        self.close_timeout = close_timeout
        # Why close() does not wait for the worker again (the last wait() timed out or was interrupted), or None
        self._unanswered: str | None = None
        self._close_done = False  # close() finished (one broken into by a second Ctrl-C is finished by the next)
        self._interrupts = interrupts  # `with` it: Ctrl-C waits (sofx.offload.interrupts)
        self._queue: collections.deque = collections.deque()
        self._results: list[OpResult] = []
        self._cond = threading.Condition()
        self._finished = 0
        # seq -> (kind, block) of the operations taken from the queue and not finished (worker and helper)
        self._active: dict[int, tuple[str, int]] = {}
        self._crash: BaseException | None = None
        # Set as the worker's loop ends; close() waits for it, not for the thread's join: a join broken into by a
        # KeyboardInterrupt marks a thread that still runs as stopped (CPython's bpo-45274 fix releases its lock),
        # and a close resumed after it found no thread running. (Nothing else joins the thread, so is_alive() is
        # right: False in a forked child, where the thread does not run and the event is never set.)
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sofx-offload-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            self._ended.set()

    def _serve(self) -> None:
        """The worker's loop: run the queued operations until the stop message (or a crash)."""
        torch.set_grad_enabled(False)  # grad mode is thread-local: the worker never records autograd
        while True:
            with self._cond:
                # An operation waits until it may run beside those running (maybe run by a helper).
                while not self._queue or (self._queue[0] is not _STOP and not self._may_start(self._queue[0])):
                    self._cond.wait()
                op = self._queue.popleft()
                if op is _STOP:
                    return
                self._start(op)
            try:
                result = self.runner.run(op)
            except BaseException as exc:  # runner.run reports ordinary errors itself
                with self._cond:
                    self._crash = exc
                    self._cond.notify_all()
                return
            seq = op.seq
            del op  # its references (gradients) are released here, not when the next operation arrives
            self._finish(seq, result)

    def _may_start(self, op: BlockOp) -> bool:
        """Whether ``op`` (the head of the queue) may start now (``self._cond`` held): with nothing running;
        a "ready" operation beside anything but "commit_all" (the last step's end, which clears the kept
        records: it would drop the one the ready operation stores); an "apply" operation beside "apply"
        operations on other blocks."""
        if not self._active:
            return True
        if op.kind == "ready":
            return all(kind != "commit_all" for kind, _ in self._active.values())
        return op.kind == "apply" and all(kind == "apply" and block != op.block
                                          for kind, block in self._active.values())

    def _start(self, op: BlockOp) -> None:
        self._active[op.seq] = (op.kind, op.block)

    def _finish(self, seq: int, result: OpResult) -> None:
        """Operation ``seq`` (taken with :meth:`_start`) finished with ``result``."""
        with self._cond:
            self._results.append(result)
            self._finished += 1
            del self._active[seq]
            self._cond.notify_all()

    def submit(self, op: BlockOp) -> None:
        self._check_open()
        with self._interrupts, self._cond:  # counted and queued together
            self._submitted += 1
            self._queue.append(op)
            self._cond.notify_all()

    def poll(self) -> list[OpResult]:
        with self._interrupts:  # results taken and counted together
            with self._cond:
                out, self._results = self._results, []
            self._done += len(out)
        return out

    def _steal(self) -> BlockOp | None:
        """The head of the queue for a helper, if it is a one-block operation that may start now."""
        with self._cond:
            head = self._queue[0] if self._queue else None
            if self._crash is None and head is not None and head is not _STOP and head.kind in _HELPABLE \
                    and self._may_start(head):
                self._start(head)
                return self._queue.popleft()
        return None

    def wait(self, timeout: float, help: bool = False) -> list[OpResult]:
        """See :meth:`Executor.wait`; ``help``: run queued one-block operations (``"ready"``, ``"apply"``) on this
        thread meanwhile."""
        self._unanswered = None
        deadline = time.monotonic() + timeout
        if help:
            with torch.no_grad():
                while True:
                    with self._interrupts:  # an operation taken is run whole: Ctrl-C waits for its end
                        op = self._steal()
                        if op is None:
                            break
                        try:
                            result = self.runner.run(op)
                        except BaseException as exc:  # runner.run reports ordinary errors itself: account, raise
                            self._finish(op.seq, OpResult(op.seq, op.kind, op.block, f"{type(exc).__name__}: {exc}"))
                            raise
                        self._finish(op.seq, result)
        with self._cond:
            while self._finished < self._submitted and self._crash is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._unanswered = "the last wait for it timed out"
                    raise ExecutorTimeout(f"thread executor: {self._submitted - self._finished} block operations "
                                          f"did not finish within {timeout:g} s")
                try:
                    self._cond.wait(left)
                except BaseException:  # (a second Ctrl-C: the caller gave up waiting for it)
                    self._unanswered = "the last wait for it was interrupted"
                    raise
            if self._crash is not None:
                raise ExecutorError(f"thread executor: the worker thread died: {self._crash!r}") from self._crash
        return raise_failures(self.poll(), "thread executor", self.describe)

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker thread (idempotent) once it has run what was queued, waiting up to ``timeout`` seconds
        (``close_timeout`` by default), at once where the last :meth:`wait` timed out or was interrupted (an
        operation that does not finish is not waited for twice). A thread cannot be stopped: one still running an
        operation then is left to finish it alone (a daemon thread), the queued ones are dropped, and a
        ``RuntimeWarning`` names what runs (it may still change those blocks' tensors). A close broken into as it
        waited (a second Ctrl-C) is finished by the next, which does not wait again."""
        if self._close_done:
            return
        resumed = self._closed
        super().close()
        if not resumed:
            with self._cond:
                self._queue.append(_STOP)
                self._cond.notify_all()
        if threading.current_thread() is self._thread:  # (an engine collected on its worker, which ran the operation
            # that held the last reference to it: its loop ends after that operation, on the stop message)
            self._close_done = True
            return
        waited = 0.0 if self._unanswered or resumed else self.close_timeout if timeout is None else timeout
        # (not alive: in a child forked from the process that started it, where it does not run)
        if not self._thread.is_alive() or self._ended.wait(timeout=min(waited, threading.TIMEOUT_MAX)):
            self._thread.join()  # (its loop has ended: it returns)
        else:
            self._abandon(waited, resumed)
        self._close_done = True

    def _abandon(self, waited: float, resumed: bool = False) -> None:
        """The worker thread did not stop within ``waited`` seconds (``resumed``: not waited for again, by the close
        that finished one broken into): drop the queued operations (it stops after the one it runs) and say so."""
        with self._cond:
            dropped = sum(op is not _STOP for op in self._queue)
            self._queue.clear()
            self._queue.append(_STOP)
            running = sorted(self._active.values(), key=lambda kb: kb[1])
        what = ", ".join(f"the {kind!r} operation on {self.describe(block)}" for kind, block in running) \
            or "an operation"
        why = ("did not wait for it again (a close was interrupted)" if resumed
               else f"did not wait for it again ({self._unanswered})" if self._unanswered
               else f"waited {waited:g} s")
        warnings.warn(f"sofx.offload: close() {why}, and the thread executor's worker is still running {what}; a "
                      f"thread cannot be stopped: it is left to finish alone and may still change those blocks' "
                      f"optimizer state"
                      f"{f'; {dropped} queued operation(s) were dropped' if dropped else ''}", RuntimeWarning,
                      stacklevel=caller_stacklevel())
