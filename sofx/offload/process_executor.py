"""The process executor: a worker process steps blocks that live in shared memory.

The block tensors are allocated in a
:class:`~sofx.offload.shared_memory.SharedMemoryArena` by the engine; this
executor starts one worker (:mod:`sofx.offload.process_worker` in a fresh interpreter, which imports it from this
process's ``sys.path``: see :data:`_WORKER_CODE`; it maps the same files through the descriptors it inherits) and
talks to it over a unix
socket in a private temporary directory (mutually authenticated with a random
key). Submitting never blocks the caller (a backward hook): a sender thread
writes the operations, and a receiver thread reads the results into a queue,
so an interrupt of the main thread (Ctrl-C in a backward hook or in
:meth:`wait`; Python delivers signals to the main thread only) can never lose
a result or leave a message half read. The worker uses ``num_threads`` torch
threads and ignores Ctrl-C (the main process decides what it means).

Failures are clear and bounded in time: a worker that cannot be started (``sys.executable`` empty or not runnable, a
socket that cannot be made) is an :class:`~sofx.offload.executor.ExecutorError` naming what failed and the thread
executor, which needs none of it; a failing operation is raised by
:meth:`wait` with the worker's traceback; a worker that died (killed, out of
memory, crashed) is detected by :meth:`wait` within a fraction of a second
and raised as :class:`~sofx.offload.executor.WorkerDiedError`, with its exit status (once its connection broke,
its exit is waited for within the timeout: a loaded machine took seconds for it) and the last
lines the worker wrote to its stderr (a Python traceback where it raised; a
reader thread passes that stream on to this process's ``sys.stderr``, where a
notebook shows it); an operation that cannot be pickled fails alone (:meth:`wait`
raises it, the worker goes on with the next ones); a worker that
hangs makes :meth:`wait` raise :class:`~sofx.offload.executor.ExecutorTimeout`
after the timeout, and :meth:`ProcessExecutor.close` kills it at once then (else
after its close timeout: the engine's ``timeout``, as the thread executor's close waits, and
:data:`CLOSE_TIMEOUT_S` by default; one that does not exit within
:data:`KILL_WAIT_S` of that is left to the system with a warning). The shared tensors stay mapped in the main process in
every case, so the state is still readable (and checkpointable) after a
failure.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from contextlib import AbstractContextManager
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from multiprocessing.reduction import ForkingPickler
from typing import IO, Any, NoReturn, Sequence

from sofx.errors import UnsupportedError
from sofx.offload.block_ops import BlockOp, OpResult
from sofx.offload.executor import (
    BlockNamer,
    Executor,
    ExecutorError,
    ExecutorTimeout,
    WorkerDiedError,
    block_number,
    raise_failures,
)
from sofx.offload.interrupts import NO_GATE
from sofx.warn import caller_stacklevel

__all__ = ["ProcessExecutor", "CLOSE_TIMEOUT_S", "KILL_WAIT_S"]

_POLL_S = 0.05
#: How long :meth:`ProcessExecutor.close` lets the worker finish what was queued and exit before killing it, by
#: default (the engine gives its ``timeout``).
CLOSE_TIMEOUT_S = 10.0
#: How long a killed worker may take to exit before it is left to the system (see ``ProcessExecutor._kill``).
KILL_WAIT_S = 10.0
#: How long, at least, a worker whose connection ended may take to exit before its end is reported without its exit
#: code (a failure path only): :meth:`ProcessExecutor.wait` gives it what is left of its timeout where that is longer,
#: the constructor its startup timeout (a worker printing its traceback took over 5 s to exit on a loaded machine).
EXIT_WAIT_S = 5.0
#: How long, once the worker exited, the end of its stderr is waited for (for its last lines, in an error or passed
#: on by close()): the reader thread reads what is left in the pipe, then ends (on a loaded machine it may wait
#: seconds for a core; close() waited 1 s, and returned with it still running).
#: Only a process the worker started and left running holds the stream open longer; its reader thread ends with it.
OUTPUT_WAIT_S = 30.0
_STOP = object()
#: What the worker's interpreter runs (``python -c``; its argument: the socket's address; the first line of its stdin:
#: this process's ``sys.path`` as JSON, which an argument could not hold where longer than 128 KiB, Linux's
#: MAX_ARG_STRLEN; none where this process died before writing it: the worker, with its own path, goes on to find
#: nobody to connect to and removes the socket's directory): it imports sofx (and torch) from this process's import
#: path, as ``multiprocessing``'s "spawn" does. ``python -m sofx.offload.process_worker`` imported from the worker's
#: own (its working directory, PYTHONPATH, site-packages): a main process that imported sofx from a directory added
#: to its ``sys.path`` (a checkout beside an installed release, a notebook's ``sys.path.append``) got a worker running
#: another sofx, or none.
_WORKER_CODE = ("import json, sys; sys.path[:0] = json.loads(sys.stdin.readline() or '[]'); "
                "from sofx.offload.process_worker import main; sys.exit(main(sys.argv))")
#: The worker's last stderr lines kept for the error that reports its end (each cut to _TAIL_LINE_CHARS).
_TAIL_LINES = 40
_TAIL_LINE_CHARS = 2000


class ProcessExecutor(Executor):
    """Runs operations in a worker process over shared-memory block tensors.

    ``config`` is the JSON-able description the worker needs (see
    :func:`sofx.offload.process_worker.build_runner`); ``pass_fds``: the
    descriptors of the shared tensors' files, which the worker inherits at the
    same numbers (see :mod:`sofx.offload.shared_memory`); ``describe`` names a
    block in errors. The constructor waits
    up to ``startup_timeout`` seconds for the worker to map the tensors; :meth:`close` waits up to
    ``close_timeout`` seconds for it to finish what was queued and exit.
    """

    name = "process"

    def __init__(self, config: dict[str, Any], startup_timeout: float = 120.0,
                 interrupts: AbstractContextManager[Any] = NO_GATE, pass_fds: Sequence[int] = (),
                 describe: BlockNamer = block_number, close_timeout: float = CLOSE_TIMEOUT_S) -> None:
        super().__init__(describe)
        self.close_timeout = close_timeout
        self._interrupts = interrupts  # `with` it: Ctrl-C waits (sofx.offload.interrupts)
        self._collected: list[OpResult] = []
        self._send_error: BaseException | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # results, then _STOP once the connection ends
        self._received_all = False
        self._unanswered = False  # the last wait() timed out (or its exit): the worker does not answer
        self._close_done = False  # close() finished (one broken into by a second Ctrl-C is finished by the next)
        self.conn: Connection | None = None
        self.process: subprocess.Popen | None = None
        self._stderr: _StderrTail | None = None
        executable = sys.executable
        if not isinstance(executable, str) or not executable:  # (Popen raised a bare PermissionError or TypeError)
            raise _unstartable(f"sys.executable is {executable!r} (Python could not tell its own interpreter, as "
                               "in some embedded or frozen Pythons), and the worker is run by it")
        try:
            self._dir = _socket_dir()  # mode 0700: only this user can connect
        except OSError as exc:
            raise _unstartable(f"making a private directory for its unix socket (in {tempfile.gettempdir()!r}) "
                               f"failed: {type(exc).__name__}: {exc}", "or set TMPDIR to a writable directory") \
                from exc
        address = os.path.join(self._dir, "socket")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                server.bind(address)
            except OSError as exc:
                raise _unstartable(f"binding its unix socket {address} failed: {type(exc).__name__}: {exc}",
                                   "or set TMPDIR to another directory (a short path, on a local file system)") from exc
            server.listen(1)
            server.settimeout(_POLL_S)
            authkey = os.urandom(32)
            try:
                self.process = subprocess.Popen([executable, "-c", _WORKER_CODE, address],
                                                stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                errors="replace", close_fds=True, pass_fds=tuple(pass_fds))
            except OSError as exc:
                raise _unstartable(f"running sys.executable ({executable!r}) failed: {type(exc).__name__}: "
                                   f"{exc}") from exc
            self.pid = self.process.pid
            self._stderr = _StderrTail(self.process.stderr)
            try:
                # (JSON: one line of ASCII, whatever the entries hold)
                self.process.stdin.write(json.dumps(_worker_path()) + "\n" + authkey.hex() + "\n")
                self.process.stdin.close()
                self.conn = self._accept(server, authkey, startup_timeout)
                # connected: the socket's path is not needed any more, so a process group killed at once (SIGKILL,
                # SIGTERM: neither process gets to clean up) leaves nothing in /tmp
                shutil.rmtree(self._dir, ignore_errors=True)
                self.conn.send(config)
                self._wait_ready(startup_timeout)
            except (OSError, EOFError) as exc:
                self._raise_broken(exc, startup_timeout)
        except BaseException:
            server.close()
            self._kill()
            try:
                self.process.stdin.close()  # (a write that failed left it open, its data unflushed)
            except (AttributeError, OSError, ValueError):
                pass
            self._join_stderr()
            if self.conn is not None:  # (connected, then the worker refused its config or never got ready)
                self.conn.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        server.close()
        self._sender = threading.Thread(target=self._send_loop, name="sofx-offload-sender", daemon=True)
        self._sender.start()
        self._receiver = threading.Thread(target=self._receive_loop, name="sofx-offload-receiver", daemon=True)
        self._receiver.start()

    # ------------------------------------------------------------ startup
    def _accept(self, server: socket.socket, authkey: bytes, timeout: float) -> Connection:
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock, _ = server.accept()
                break
            except socket.timeout:
                self._check_alive("while starting")
                if time.monotonic() > deadline:
                    raise ExecutorTimeout(f"the offload worker process did not connect within {timeout:g} s")
        sock.settimeout(None)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        except BaseException:
            conn.close()
            raise
        return conn

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(_POLL_S):
            self._check_alive("while starting")
            if time.monotonic() > deadline:
                raise ExecutorTimeout(f"the offload worker process did not start within {timeout:g} s")
        msg = self.conn.recv()
        if msg[0] != "ready":
            raise ExecutorError(f"the offload worker process failed to start:\n{msg[1]}")

    def _check_alive(self, when: str) -> None:
        code = self.process.poll()
        if code is not None:
            raise WorkerDiedError(f"the offload worker process (pid {self.pid}) died ({_exit_description(code)}) "
                                  f"{when}{self._last_output(code)}")

    def _raise_broken(self, exc: BaseException, timeout: float) -> NoReturn:
        """Raise ``exc`` (a broken pipe or connection while starting) as what it means: a :class:`WorkerDiedError`
        with the exit status where the worker exits within ``max(timeout, EXIT_WAIT_S)`` seconds (the connection
        breaks as it exits, and its exit took seconds on a loaded machine), else an :class:`ExecutorError` saying
        both facts."""
        waited = max(timeout, EXIT_WAIT_S)
        code = self._exit_code(waited)
        if code is not None:
            raise WorkerDiedError(f"the offload worker process (pid {self.pid}) died ({_exit_description(code)}) "
                                  f"while starting{self._last_output(code)}") from exc
        raise ExecutorError(f"the connection to the offload worker process (pid {self.pid}) broke while starting "
                            f"({type(exc).__name__}: {exc}), and it had not exited {waited:g} s later"
                            f"{self._last_output(None)}") from exc

    def _exit_code(self, timeout: float) -> int | None:
        """The worker's exit status, waiting up to ``timeout`` seconds for its exit; None where it still runs."""
        try:
            return self.process.wait(timeout=min(timeout, threading.TIMEOUT_MAX))
        except subprocess.TimeoutExpired:
            return None

    def _last_output(self, code: int | None) -> str:
        """What the worker wrote to stderr last, for an error reporting its end (exit ``code``: the stream's end is
        waited for up to :data:`OUTPUT_WAIT_S`; None: it may still run, and its output so far is taken); said so
        where the stream had not ended (later lines may be missing)."""
        if self._stderr is None:
            return ""
        ended = self._stderr.join(OUTPUT_WAIT_S if code is not None else 0.0)
        text = self._stderr.tail().rstrip()
        if not text:
            return ""
        return f"; its last output{'' if ended else ' so far (its stderr had not ended)'}:\n{text}"

    def _join_stderr(self) -> None:
        """Wait for the end of the worker's stderr where the worker exited (up to :data:`OUTPUT_WAIT_S`: the reader
        thread reads the rest, passes it on and ends); a worker left running is not waited for."""
        if self._stderr is not None:
            self._stderr.join(OUTPUT_WAIT_S if self.process.poll() is not None else 0.0)

    # ------------------------------------------------------------ operations
    def _send_loop(self) -> None:
        while True:
            op = self._outbox.get()
            if op is _STOP:
                return
            try:
                data = ForkingPickler.dumps(op)  # (what Connection.send does, in two parts)
            except BaseException as exc:  # nothing was written: the stream stays whole, the next operations go
                self._inbox.put(_unsent(op, exc))
                continue
            try:
                self.conn.send_bytes(data)
            except BaseException as exc:  # the worker is gone: wait() reports it
                self._send_error = exc
                return

    def _receive_loop(self) -> None:
        while True:
            try:
                result = self.conn.recv()
            except BaseException:  # (EOFError, OSError) the worker is gone or the connection closed
                self._inbox.put(_STOP)
                return
            self._inbox.put(result)

    def submit(self, op: BlockOp) -> None:
        self._check_open()
        with self._interrupts:  # sent and counted together
            self._outbox.put(op)
            self._submitted += 1

    def _drain(self, block_s: float | None) -> bool:
        """Move received results into ``_collected``, waiting up to ``block_s`` for the first; True if any."""
        got = False
        while not self._received_all:
            with self._interrupts:  # a result taken from the queue is kept (Ctrl-C waits out block_s at most)
                try:
                    item = self._inbox.get(timeout=block_s) if block_s and not got else self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._received_all = True  # the worker is gone; wait() reports it
                    break
                self._collected.append(item)
            got = True
        return got

    def poll(self) -> list[OpResult]:
        self._drain(None)
        with self._interrupts:  # results handed out and counted together
            out, self._collected = self._collected, []
            self._done += len(out)
        return out

    def _outstanding(self) -> int:
        return self._submitted - self._done - len(self._collected)

    def wait(self, timeout: float) -> list[OpResult]:
        self._unanswered = False
        try:
            return self._wait(timeout)
        except ExecutorError:
            raise
        except BaseException:  # (a second Ctrl-C: the caller gave up waiting for it; close() does not wait again)
            self._unanswered = True
            raise

    def _wait(self, timeout: float) -> list[OpResult]:
        """:meth:`wait`, but for its handling of an interruption."""
        deadline = time.monotonic() + timeout
        while self._outstanding() > 0:
            if self._drain(_POLL_S):
                continue
            code = self.process.poll()
            ended = self._received_all or self._send_error is not None
            waited = max(EXIT_WAIT_S, _left(deadline))
            if code is None and ended:  # the connection ended: the worker is exiting or gone (within the timeout)
                code = self._exit_code(waited)
            if code is not None or ended:
                self._drain(None)  # results it sent before dying
                if self._outstanding() == 0:
                    break
                self._unanswered = code is None  # (waited for already: close() kills it at once)
                how = _exit_description(code) if code is not None else \
                    f"the connection to it broke, and it had not exited {waited:g} s later"
                raise WorkerDiedError(
                    f"the offload worker process (pid {self.pid}) died ({how}) with "
                    f"{self._outstanding()} block operation(s) unfinished. The optimizer state in shared memory is "
                    "intact and readable (state_dict() still works), but blocks of the current step may be partly "
                    "stepped: load a checkpoint saved between steps into a new optimizer to continue training "
                    f"(this one cannot step any more: close() it){self._last_output(code)}")
            if time.monotonic() > deadline:
                self._unanswered = True  # close() does not wait for it again
                raise ExecutorTimeout(f"process executor: {self._outstanding()} block operations did not finish "
                                      f"within {timeout:g} s (worker pid {self.pid} is alive but not answering)")
        return raise_failures(self.poll(), f"process executor (worker pid {self.pid})", self.describe)

    # ------------------------------------------------------------ shutdown
    def close(self, timeout: float | None = None) -> None:
        """Stop the worker (idempotent): it finishes what was queued and exits, or is killed once ``timeout``
        seconds (``close_timeout`` by default) have passed in all, at once where the last :meth:`wait` timed out or
        was interrupted (a worker that does not answer is not waited for twice). A close broken into as it waited
        (a second Ctrl-C) is finished by the next, which does not wait again: the worker is killed."""
        if self._close_done:
            return
        if timeout is None:
            timeout = self.close_timeout
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout >= 0):
            raise UnsupportedError(f"process executor: close timeout must be a number of seconds >= 0, got "
                                   f"{timeout!r}")
        resumed = self._closed
        super().close()
        deadline = time.monotonic() + (0.0 if self._unanswered or resumed else timeout)
        if not resumed:
            self._outbox.put(None)  # tells the worker to stop, after everything queued
            self._outbox.put(_STOP)
        self._sender.join(timeout=_left(deadline))
        if self.process is not None:
            try:
                self.process.wait(timeout=_left(deadline))
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        if self.conn is not None:
            self.conn.close()
        if getattr(self, "_receiver", None) is not None:
            self._receiver.join(timeout=_left(deadline))  # (ends with the connection; a daemon thread anyway)
        self._join_stderr()
        self._close_done = True

    def _kill(self) -> None:
        """SIGKILL the worker where it still runs and reap it. One that does not exit within :data:`KILL_WAIT_S`
        (in uninterruptible sleep: a driver call, a hung file system; or tearing down a large address space) is left
        to the system with a ``RuntimeWarning``, not raised: this runs in close() (``finally`` blocks, ``with``,
        exit) and where the start failed, and an error here hid the one being handled, and left the rest of the
        executor open."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.kill()
        try:
            self.process.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            warnings.warn(f"sofx.offload: the offload worker process (pid {self.pid}) did not exit within "
                          f"{KILL_WAIT_S:g} s of SIGKILL (uninterruptible sleep, e.g. in a driver or on a hung file "
                          "system, or freeing a large address space); it is left to the system and exits when the "
                          "kernel lets it (its memory is released then)", RuntimeWarning,
                          stacklevel=caller_stacklevel())


class _StderrTail:
    """Reads the worker's stderr: passes each line on to this process's ``sys.stderr`` (a notebook shows it, where
    the worker's own stderr went to the server's terminal) and keeps the last :data:`_TAIL_LINES` lines for the
    error that reports the worker's end. The reader thread ends, closing the stream, at the stream's end: when the
    worker is gone (and any process it started that inherited the stream)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lines: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._thread = threading.Thread(target=self._read, name="sofx-offload-stderr", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self._stream:
                self._lines.append(line[:_TAIL_LINE_CHARS])
                out = sys.stderr
                if out is not None:
                    try:
                        out.write(line)
                        out.flush()
                    except Exception:  # (a closed or replaced stream: the line is kept all the same)
                        pass
        except (OSError, ValueError):
            pass
        finally:
            self._stream.close()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the end of the stream (the worker gone); whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def tail(self) -> str:
        """The last lines read so far (all of them once :meth:`join` said the stream ended)."""
        return "".join(list(self._lines))


def _unstartable(what: str, remedy: str = "") -> ExecutorError:
    """The error of a worker process that could not be started (``what`` failed, said whole); ``remedy``: what else
    the user may do but use the thread executor."""
    return ExecutorError(f"the process executor could not start its worker: {what}. Use executor=\"thread\" (a "
                         f"worker thread in this process, which needs none of this){f', {remedy}' if remedy else ''}")


def _unsent(op: Any, exc: BaseException) -> OpResult:
    """The failed result of operation ``op``, which could not be pickled (``exc``) and so never reached the
    worker: :meth:`ProcessExecutor.wait` raises it as it raises the worker's failures."""
    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return OpResult(getattr(op, "seq", -1), getattr(op, "kind", type(op).__name__), getattr(op, "block", -1),
                    f"it could not be sent to the worker process (pickling it failed): {type(exc).__name__}: "
                    f"{exc}\n{detail}")


def _worker_path() -> list[str]:
    """This process's ``sys.path`` as text, for the worker (:data:`_WORKER_CODE`), each relative entry (but ``''``,
    the working directory at each import, which the worker inherits) as the directory this process's import system
    resolved it to (its finder's, made where the entry was first used: a ``sys.path.append("..")`` and then an
    ``os.chdir`` named another directory in the worker, which imported another sofx, or none), else as it names
    now."""
    path = []
    for entry in sys.path:
        if not isinstance(entry, (str, bytes, os.PathLike)):
            continue
        text = entry if isinstance(entry, str) else os.fsdecode(entry)
        if text and not os.path.isabs(text):
            resolved = getattr(sys.path_importer_cache.get(text), "path", None)
            text = resolved if isinstance(resolved, str) and os.path.isabs(resolved) else os.path.abspath(text)
        path.append(text)
    return path


#: The longest path a unix socket may be bound to, in bytes: its address holds 108 on Linux, 104 on BSDs and macOS,
#: with the terminating NUL.
_MAX_SOCKET_PATH = 103


def _socket_dir() -> str:
    """A new private directory (mode 0700) for the worker's socket: in the temporary directory, or in /tmp where the
    socket's path there would be too long to bind (a long ``TMPDIR``, a job's scratch directory: the constructor
    raised ``OSError: AF_UNIX path too long``)."""
    path = tempfile.mkdtemp(prefix="sofx-worker-")
    if len(os.fsencode(os.path.join(path, "socket"))) <= _MAX_SOCKET_PATH or not os.path.isdir("/tmp"):
        return path
    os.rmdir(path)
    return tempfile.mkdtemp(prefix="sofx-worker-", dir="/tmp")


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0, at most what a thread's join takes
    (``threading.TIMEOUT_MAX``: a ``close(timeout=math.inf)`` waits as long as that)."""
    return min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)


def _exit_description(code: int) -> str:
    """How a process ended, from its exit status ``code`` (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
