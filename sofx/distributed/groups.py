"""Process groups: whether collectives can run here, a group's rank and size, where its buffers live.

The bottom of :mod:`sofx.distributed`: ``dist`` (``torch.distributed``, or
``None`` in a build of torch without it) and the checks every collective
makes first (:func:`require_initialized`).
"""

from __future__ import annotations

from typing import Any

import torch

from sofx.errors import SofxError

__all__ = ["is_ready", "require_initialized", "group_rank", "group_size"]


try:  # a build of torch without distributed support still imports sofx
    import torch.distributed as dist
except ImportError:  # pragma: no cover - every supported build has it
    dist = None  # type: ignore[assignment]


def is_ready() -> bool:
    """``True`` when ``torch.distributed`` is available and a default process group is initialized."""
    return dist is not None and dist.is_available() and dist.is_initialized()


def require_initialized(group: Any = None, what: str = "sofx.distributed") -> None:
    """Raise :class:`SofxError` unless collectives on ``group`` can run in this process (``group``: ``None``, the
    default group, or a process group of ``torch.distributed`` that has this process)."""
    if dist is None or not dist.is_available():
        raise SofxError(f"{what}: this build of torch has no torch.distributed support")
    if not dist.is_initialized():
        single = " (or pass reduce_sumsq=None for a single process)" if what == "all_reduce_sumsq" else ""
        raise SofxError(f"{what}: torch.distributed is not initialized; call "
                        f"torch.distributed.init_process_group(...) on every rank first{single}")
    if group is None:
        return
    try:
        rank = dist.get_rank(group)
    except (ValueError, TypeError, RuntimeError) as e:  # (torch's bare "Group 1 is not registered, ...")
        raise SofxError(f"{what}: group={_shortened(repr(group))} is no process group of torch.distributed "
                        f"({type(e).__name__}: {e}); pass None (the default group) or a group that "
                        "torch.distributed.new_group made") from e
    if rank < 0:
        raise SofxError(f"{what}: this process (global rank {dist.get_rank()}) is not a member of the given "
                        "process group")


def _shortened(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def group_rank(group: Any = None) -> int:
    """This process's rank within ``group``."""
    require_initialized(group)
    return dist.get_rank(group)


def group_size(group: Any = None) -> int:
    """The number of ranks in ``group``."""
    require_initialized(group)
    return dist.get_world_size(group)


def _collective_device(group: Any, device: torch.device | str | None) -> torch.device:
    """Where the collectives' buffers live: ``device``, else CUDA for NCCL groups, else the CPU."""
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_rank(group: Any, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (the ``src`` that ``broadcast`` expects)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _data_failure(what: str, exc: BaseException, stage: str, unchanged: str) -> SofxError:
    """The error of collective ``what`` whose backend call of ``stage`` (after the ranks' first agreement) failed
    with ``exc``: gloo's bare ``RuntimeError`` (NCCL's ``DistBackendError`` is one too), where a rank exited or
    failed since that agreement, or stayed in a call of its own past the group's timeout. ``unchanged``: what of
    this rank's is as it was before the call (nothing was half-written)."""
    return SofxError(f"{what}: a rank did not take part in {stage} ({type(exc).__name__}: {exc}) within the process "
                     "group's timeout (it exited or failed after the ranks' agreement, or a call of its own took "
                     f"longer than the timeout); {unchanged}; the process group may be unusable now (gloo closes its "
                     "connections on a timeout)")
