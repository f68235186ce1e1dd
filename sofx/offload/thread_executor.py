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
"""

from __future__ import annotations

import collections
import threading
import time
from contextlib import AbstractContextManager
from typing import Any

import torch

from sofx.offload.block_ops import BlockOp, OpResult
from sofx.offload.block_runner import BlockRunner
from sofx.offload.executor import Executor, ExecutorError, ExecutorTimeout, raise_failures
from sofx.offload.interrupts import NO_GATE

__all__ = ["ThreadExecutor"]

_STOP = object()
_HELPABLE = ("ready", "apply")  # operations on one block each, which a helper may run (see _may_start)


class ThreadExecutor(Executor):
    """Runs operations on ``runner`` in a daemon thread, in submission order."""

    name = "thread"

    def __init__(self, runner: BlockRunner, interrupts: AbstractContextManager[Any] = NO_GATE) -> None:
        super().__init__()
        self.runner = runner
        self._interrupts = interrupts  # `with` it: Ctrl-C waits (sofx.offload.interrupts)
        self._queue: collections.deque = collections.deque()
        self._results: list[OpResult] = []
        self._cond = threading.Condition()
        self._finished = 0
        # seq -> (kind, block) of the operations taken from the queue and not finished (worker and helper)
        self._active: dict[int, tuple[str, int]] = {}
        self._crash: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="sofx-offload-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
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
                    raise ExecutorTimeout(f"thread executor: {self._submitted - self._finished} block operations "
                                          f"did not finish within {timeout:g} s")
                self._cond.wait(left)
            if self._crash is not None:
                raise ExecutorError(f"thread executor: the worker thread died: {self._crash!r}") from self._crash
        return raise_failures(self.poll(), "thread executor")

    def close(self) -> None:
        if not self._closed:
            super().close()
            with self._cond:
                self._queue.append(_STOP)
                self._cond.notify_all()
            self._thread.join(timeout=30)
