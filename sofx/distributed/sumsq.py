"""The sum-of-squares all-reduce: the ``reduce_sumsq`` hook of the serial and speculative loops.

:func:`all_reduce_sumsq` checks the setup and builds a :class:`SumsqReduce`:
the ranks' local sums gathered and added in rank order, the same bits on every
rank; a rank that refuses the step says so in the same collective.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from sofx.distributed.agreement import _shortened
from sofx.distributed.groups import _collective_device, dist, require_initialized
from sofx.distributed.refusals import RankRefusedError
from sofx.distributed.setup import _SETUP_KEYWORDS, _agree_setup, _setup_entries, _setup_hint
from sofx.errors import SofxError

__all__ = ["SumsqReduce", "all_reduce_sumsq"]


class SumsqReduce:
    """The ``reduce_sumsq`` hook :func:`all_reduce_sumsq` returns (see there): callable as
    ``s_local -> s``, and :meth:`refuse` for a rank that cannot take part in the step."""

    def __init__(self, group: Any = None, device: torch.device | str | None = None) -> None:
        require_initialized(group, "all_reduce_sumsq")
        self.group = group
        self.device = device

    def __call__(self, local: float) -> float:
        try:
            value = float(local)
        except Exception as e:  # refused in the collective: raised before it, the others would wait for this rank
            error = SofxError(f"all_reduce_sumsq: this rank's local sum of squares is {_shortened(repr(local), 80)} "
                              f"({type(local).__name__}); expected a real number")
            self.refuse(error)
            raise error from e
        return self._gather(value, refused=False)

    def refuse(self, error: BaseException | None = None) -> None:
        """Take part in this step's collective as a rank that refuses the step (``error``: why, for the
        record; this rank raises it itself): every other rank's call raises :class:`RankRefusedError`
        instead of waiting for this rank forever. The serial and speculative loops call it when they raise
        before reducing."""
        self._gather(math.nan, refused=True)

    def _gather(self, local: float, refused: bool) -> float:
        group = self.group
        require_initialized(group, "all_reduce_sumsq")
        dev = _collective_device(group, self.device)
        world = dist.get_world_size(group)
        mine = torch.tensor([local, 1.0 if refused else 0.0], dtype=torch.float64, device=dev)
        parts = [torch.empty(2, dtype=torch.float64, device=dev) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        gathered = torch.stack(parts).tolist()
        refusing = [r for r, (_, flag) in enumerate(gathered) if flag != 0.0]
        if refused:
            return math.nan
        if refusing:
            raise RankRefusedError(f"rank{'s' if len(refusing) > 1 else ''} {', '.join(map(str, refusing))} of the "
                                   "process group refused this step before the sum of squares was reduced (see "
                                   "the error raised there); nothing was stepped on this rank", refusing)
        total = -0.0  # IEEE addition's identity: -0.0 (no gradient) on every rank sums to -0.0, as it should
        for value, _ in gathered:
            total += value
        return total


def all_reduce_sumsq(group: Any = None, *extra: Any, device: torch.device | str | None = None,
                     params: Any = None, opt: Any = None, scaler: Any = None, config: Any = None,
                     hparams: Any = None, settings: Mapping[str, Any] | None = None,
                     **unknown: Any) -> SumsqReduce:
    """The ``reduce_sumsq`` hook: ``s_local -> sum over ranks of s_local`` (float64, rank order).

    ``s = (((s_0 + s_1) + s_2) + ...)`` with ``s_r`` rank ``r``'s local sum of
    squares, computed identically on every rank from one ``all_gather`` of
    ``world_size`` float64 values, so every rank sees the same bits. A nan or
    inf on any rank gives a non-finite ``s`` on every rank (an overflow: every
    rank skips). ``device``: where the gathered buffer lives (default: the
    current CUDA device for NCCL, else the CPU). Every rank of ``group`` must
    call the hook the same number of times (once per step). The sum starts
    from ``-0.0`` (``-0.0 + x = x`` for every ``x``): ``-0.0`` from every rank
    (no gradient anywhere) gives ``-0.0``; every other sum is unchanged.

    A rank that refuses the step before reducing (its inputs fail the checks)
    calls ``hook.refuse(error)`` in its place, as :func:`sofx.serial.serial_step`
    and :func:`sofx.speculate.speculative_step` do, and raises its own error; the
    hook then raises :class:`RankRefusedError` on the other ranks, which step
    nothing either, instead of leaving them waiting in the collective.

    Building the hook is a collective too, every rank builds it once at
    setup: it checks, as :func:`check_same_setup` (``params``, ``opt``,
    ``scaler``, ``config``, ``hparams``, ``settings``: the same keywords),
    that the ranks agree in their setup and in where the sums travel
    (``device``'s type), so that no rank steps differently configured.
    """
    require_initialized(group, "all_reduce_sumsq")

    def entries() -> dict[str, str]:
        return {"device": _device_type(group, device),
                **_setup_entries(params, opt, scaler, config, hparams, settings)}

    _agree_setup("all_reduce_sumsq", group, extra, ("device", *_SETUP_KEYWORDS), unknown, entries,
                 _setup_hint("the hook's device"))
    return SumsqReduce(group, device)


def _device_type(group: Any, device: torch.device | str | None) -> str:
    """The type of the device the hook's sums travel on, refused where this process cannot hold a tensor there
    (the hook would fail on this rank alone at the first step)."""
    dev = _collective_device(group, device)
    try:
        torch.empty(0, device=dev)
    except Exception as e:
        raise SofxError(f"all_reduce_sumsq: device={device!r}: this process cannot hold a tensor there ({e})") from e
    return dev.type
