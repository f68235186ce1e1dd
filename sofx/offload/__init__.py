"""The offload runtime: fp32 master blocks, gradient hooks, executors and the torch.optim facade.

Public API::

    sofx.offload.SpeculativeAdamW(params, lr=..., max_grad_norm=..., loss_scale=..., executor="thread", ...)
    sofx.offload.SpeculativeAdam(...)                 # L2 weight decay
    sofx.offload.OffloadEngine                        # the engine behind them
    sofx.offload.EngineStepReport                     # what step() returns

Errors: :class:`ExecutorError`, :class:`ExecutorTimeout`, :class:`WorkerDiedError`.
"""

from sofx.offload.engine import EXECUTORS, EngineStepReport, OffloadEngine
from sofx.offload.executor import ExecutorError, ExecutorTimeout, WorkerDiedError
from sofx.offload.facade import SpeculativeAdam, SpeculativeAdamW, resolve_loss_scale

__all__ = [
    "SpeculativeAdamW",
    "SpeculativeAdam",
    "OffloadEngine",
    "EngineStepReport",
    "EXECUTORS",
    "ExecutorError",
    "ExecutorTimeout",
    "WorkerDiedError",
    "resolve_loss_scale",
]
