"""The thread executor: one worker thread runs operations in order (torch kernels release the GIL).

While the caller waits in ``step()`` it may *help* (:meth:`ThreadExecutor.wait` with
``help=True``): it takes queued ``"ready"`` operations (speculative steps of
different blocks) from the head of the queue and runs them itself, so that the
blocks whose gradients arrived last are stepped on two cores. Only ``"ready"``
operations are taken this way; they touch disjoint blocks, and the engine keeps
their decisions in arrival order. Every other operation runs on the worker, in
submission order, after everything submitted before it.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from sofx.offload.block_ops import BlockOp, OpResult
from sofx.offload.block_runner import BlockRunner
from sofx.offload.executor import Executor, ExecutorError, ExecutorTimeout, raise_failures

__all__ = ["ThreadExecutor"]

_STOP = object()


class ThreadExecutor(Executor):
    """Runs operations on ``runner`` in a daemon thread, in submission order."""

    name = "thread"

    def __init__(self, runner: BlockRunner) -> None:
        super().__init__()
        self.runner = runner
        self._queue: collections.deque = collections.deque()
        self._results: list[OpResult] = []
        self._cond = threading.Condition()
        self._finished = 0
        self._running = 0  # operations taken from the queue and not finished (worker and helper)
        self._crash: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="sofx-offload-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is thread-local: the worker never records autograd
        while True:
            with self._cond:
                # An operation that is not "ready" waits until every earlier one (maybe run by a helper) is done.
                while not self._queue or (self._running and self._queue[0] is not _STOP
                                          and self._queue[0].kind != "ready"):
                    self._cond.wait()
                op = self._queue.popleft()
                if op is _STOP:
                    return
                self._running += 1
            try:
                result = self.runner.run(op)
            except BaseException as exc:  # runner.run reports ordinary errors itself
                with self._cond:
                    self._crash = exc
                    self._cond.notify_all()
                return
            del op  # its references (gradients) are released here, not when the next operation arrives
            self._finish(result)

    def _finish(self, result: OpResult) -> None:
        with self._cond:
            self._results.append(result)
            self._finished += 1
            self._running -= 1
            self._cond.notify_all()

    def submit(self, op: BlockOp) -> None:
        self._check_open()
        with self._cond:
            self._submitted += 1
            self._queue.append(op)
            self._cond.notify_all()

    def poll(self) -> list[OpResult]:
        with self._cond:
            out, self._results = self._results, []
        self._done += len(out)
        return out

    def _steal(self) -> BlockOp | None:
        with self._cond:
            if self._crash is None and self._queue and self._queue[0] is not _STOP and self._queue[0].kind == "ready":
                self._running += 1
                return self._queue.popleft()
        return None

    def wait(self, timeout: float, help: bool = False) -> list[OpResult]:
        """See :meth:`Executor.wait`; ``help``: run queued ``"ready"`` operations on this thread meanwhile."""
        deadline = time.monotonic() + timeout
        if help:
            with torch.no_grad():
                while (op := self._steal()) is not None:
                    try:
                        result = self.runner.run(op)
                    except BaseException as exc:  # e.g. KeyboardInterrupt: account for the operation, then raise
                        self._finish(OpResult(op.seq, op.kind, op.block, f"{type(exc).__name__}: {exc}"))
                        raise
                    self._finish(result)
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
