"""The thread executor: one worker thread runs operations in order (torch kernels release the GIL)."""

from __future__ import annotations

import queue
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
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._results: list[OpResult] = []
        self._cond = threading.Condition()
        self._finished = 0
        self._crash: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="sofx-offload-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is thread-local: the worker never records autograd
        while True:
            op = self._queue.get()
            if op is _STOP:
                return
            try:
                result = self.runner.run(op)
            except BaseException as exc:  # runner.run reports ordinary errors itself
                with self._cond:
                    self._crash = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._results.append(result)
                self._finished += 1
                self._cond.notify_all()

    def submit(self, op: BlockOp) -> None:
        self._check_open()
        self._submitted += 1
        self._queue.put(op)

    def poll(self) -> list[OpResult]:
        with self._cond:
            out, self._results = self._results, []
        self._done += len(out)
        return out

    def wait(self, timeout: float) -> list[OpResult]:
        deadline = time.monotonic() + timeout
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
            self._queue.put(_STOP)
            self._thread.join(timeout=30)
