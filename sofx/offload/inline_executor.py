"""The inline executor: runs each operation at once, in the caller's thread (tests, debugging)."""

from __future__ import annotations

from sofx.offload.block_ops import BlockOp, OpResult
from sofx.offload.block_runner import BlockRunner
from sofx.offload.executor import BlockNamer, Executor, block_number, raise_failures

__all__ = ["InlineExecutor"]


class InlineExecutor(Executor):
    """Runs operations synchronously on ``runner`` (no overlap with backward, same results)."""

    name = "inline"

    def __init__(self, runner: BlockRunner, describe: BlockNamer = block_number) -> None:
        super().__init__(describe)
        self.runner = runner
        self._results: list[OpResult] = []

    def submit(self, op: BlockOp) -> None:
        self._check_open()
        self._submitted += 1
        self._results.append(self.runner.run(op))

    def poll(self) -> list[OpResult]:
        out, self._results = self._results, []
        self._done += len(out)
        return out

    def wait(self, timeout: float) -> list[OpResult]:
        return raise_failures(self.poll(), "inline executor", self.describe)
