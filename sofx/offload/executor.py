"""The executor interface: run block operations in order, somewhere, and report back.

An executor receives :class:`~sofx.offload.block_ops.BlockOp` messages with
:meth:`Executor.submit` (never blocking the caller, which is usually a
backward hook), runs them in submission order on a
:class:`~sofx.offload.block_runner.BlockRunner`, and hands back their
:class:`~sofx.offload.block_ops.OpResult` through :meth:`Executor.poll`
(what finished so far) and :meth:`Executor.wait` (block until everything
submitted finished, or raise). A failing operation is reported, not raised,
where it ran; :meth:`wait` raises it in the caller as an
:class:`ExecutorError` with the original traceback.

Implementations: :mod:`~sofx.offload.inline_executor`,
:mod:`~sofx.offload.thread_executor`, :mod:`~sofx.offload.process_executor`.
"""

from __future__ import annotations

import abc
from typing import Callable

from sofx.errors import SofxError
from sofx.offload.block_ops import BlockOp, OpResult

__all__ = ["Executor", "ExecutorError", "ExecutorTimeout", "WorkerDiedError", "raise_failures", "failure_message",
           "block_number"]

#: How an error names block ``b`` (the engine names its parameters: :meth:`OffloadEngine.describe_block`).
BlockNamer = Callable[[int], str]


def block_number(b: int) -> str:
    """Block ``b`` by its number ("every block" for -1, an operation on all of them)."""
    return f"block {b}" if b >= 0 else "every block"


class ExecutorError(SofxError, RuntimeError):
    """An operation failed in the executor (the message carries the worker's traceback)."""


class ExecutorTimeout(ExecutorError):
    """Operations did not finish within the timeout."""


class WorkerDiedError(ExecutorError):
    """The worker process is gone (killed, crashed); the shared state it worked on is still readable."""


class Executor(abc.ABC):
    """Runs block operations in submission order; ``describe`` names a block in its errors."""

    #: "inline", "thread" or "process"
    name: str = ""

    def __init__(self, describe: BlockNamer = block_number) -> None:
        self.describe = describe
        self._submitted = 0
        self._done = 0
        self._closed = False

    @property
    def pending(self) -> int:
        """Operations submitted and not yet collected."""
        return self._submitted - self._done

    @abc.abstractmethod
    def submit(self, op: BlockOp) -> None:
        """Queue ``op``; returns at once (the inline executor runs it right away)."""

    @abc.abstractmethod
    def poll(self) -> list[OpResult]:
        """Results of operations that finished since the last poll/wait (never blocks)."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> list[OpResult]:
        """Block until every submitted operation finished; return the results not yet collected.

        Raises :class:`ExecutorTimeout` after ``timeout`` seconds,
        :class:`WorkerDiedError` when a worker is gone, and
        :class:`ExecutorError` when an operation failed.
        """

    def run(self, op: BlockOp, timeout: float) -> list[OpResult]:
        """Submit ``op`` and wait for it (and everything before it)."""
        self.submit(op)
        return self.wait(timeout)

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutorError(f"the {self.name} executor is closed")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pending={self.pending}{' closed' if self._closed else ''}>"


def raise_failures(results: list[OpResult], where: str, describe: BlockNamer = block_number) -> list[OpResult]:
    """Raise :class:`ExecutorError` for the first failed result (its block named by ``describe``); return
    ``results`` otherwise."""
    for r in results:
        if not r.ok:
            raise ExecutorError(failure_message(r, where, describe))
    return results


def failure_message(result: OpResult, where: str, describe: BlockNamer = block_number) -> str:
    """What failed (failed ``result`` of an operation run by ``where``), its block named by ``describe``."""
    return f"{where}: the {result.kind!r} operation on {describe(result.block)} failed: {result.error}"
