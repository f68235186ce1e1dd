"""The offload runtime: fp32 master blocks, gradient hooks, executors and the torch.optim facade.

Public API::

    sofx.offload.SpeculativeAdamW(params, lr=..., max_grad_norm=..., loss_scale=..., executor="thread", ...)
    sofx.offload.SpeculativeAdam(...)                 # L2 weight decay
    sofx.offload.OffloadEngine                        # the engine behind them
    sofx.offload.EngineStepReport                     # what step() returns

Errors: :class:`ExecutorError`, :class:`ExecutorTimeout`, :class:`WorkerDiedError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sofx.lazy_imports import lazy_attribute

if TYPE_CHECKING:
    from sofx.offload.engine import EXECUTORS, EngineStepReport, OffloadEngine
    from sofx.offload.executor import ExecutorError, ExecutorTimeout, WorkerDiedError
    from sofx.offload.facade import SpeculativeAdam, SpeculativeAdamW, resolve_loss_scale

#: The module each public name is defined in (imported where the name is first used, see :func:`__getattr__`).
_HOMES = {
    "SpeculativeAdamW": "facade",
    "SpeculativeAdam": "facade",
    "resolve_loss_scale": "facade",
    "OffloadEngine": "engine",
    "EngineStepReport": "engine",
    "EXECUTORS": "engine",
    "ExecutorError": "executor",
    "ExecutorTimeout": "executor",
    "WorkerDiedError": "executor",
}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    """``sofx.offload.<name>`` (and ``from sofx.offload import <name>``) for a public name, or a submodule, that
    is not imported yet: the facade and the engine are imported where first used, not by ``import sofx`` nor by
    a process executor's worker (``sofx.offload.process_worker``), which needs neither."""
    return lazy_attribute(__name__, _HOMES, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

