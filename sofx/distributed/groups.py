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


# Words of a backend error where a rank is missing: gloo's ("Timed out waiting 2000ms for recv operation to complete",
# "Application timeout caused pair closure", "Connection closed by peer [addr]", "Connection reset by peer", a broken
# pipe), NCCL's (a watchdog's timeout, an aborted communicator, "remote process exited or there was a network error")
_LOST_RANK_WORDS = ("timed out", "timeout", "connection", "closed by peer", "reset by peer", "broken pipe", "abort",
                    "network error", "remote process")


def _lost_rank(exc: BaseException) -> bool:
    """Whether the backend error ``exc`` of a collective says that a rank is missing (a timeout, a connection closed
    or reset: torch's ``DistNetworkError``, or gloo's and NCCL's words for it), not an error every rank meets at the
    call (gloo's ``Invalid scalar type`` for a dtype it cannot send, say)."""
    network = getattr(dist, "DistNetworkError", None) if dist is not None else None
    if network is not None and isinstance(exc, network):
        return True
    text = str(exc).lower()
    return any(word in text for word in _LOST_RANK_WORDS)


def _collective_failure(what: str, exc: BaseException, stage: str, unchanged: str) -> SofxError:
    """The error of collective ``what`` whose backend call of ``stage`` failed with ``exc``, an error that names no
    missing rank (no timeout, no closed connection: :func:`_lost_rank`): torch's words, no rank blamed."""
    return SofxError(f"{what}: the collective failed in {stage} ({type(exc).__name__}: {exc}); {unchanged}; torch "
                     "raised it on this rank, and it names no missing rank (no timeout or closed connection): an "
                     "error that every rank meets at the call (a dtype or device the process group's backend does "
                     "not support) leaves the group usable")


def _data_failure(what: str, exc: BaseException, stage: str, unchanged: str) -> SofxError:
    """The error of collective ``what`` whose backend call of ``stage`` (after the ranks' first agreement) failed
    with ``exc``: gloo's bare ``RuntimeError`` (NCCL's ``DistBackendError`` is one too), where a rank exited or
    failed since that agreement, or stayed in a call of its own past the group's timeout. ``unchanged``: what of
    this rank's is as it was before the call (nothing was half-written). An error that names no missing rank (an
    unsupported dtype, every rank's at the call) is torch's words, no rank blamed (:func:`_collective_failure`)."""
    if not _lost_rank(exc):
        return _collective_failure(what, exc, stage, unchanged)
    return SofxError(f"{what}: a rank did not take part in {stage} ({type(exc).__name__}: {exc}) within the process "
                     "group's timeout (it exited or failed after the ranks' agreement, or a call of its own took "
                     f"longer than the timeout); {unchanged}; the process group may be unusable now (gloo closes its "
                     "connections on a timeout)")
