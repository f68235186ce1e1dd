"""The gradient mean across ranks: :func:`all_reduce_mean_`, and the summands and mean it (and
:meth:`sofx.distributed.Shard.reduce_mean`) reduce with (fp16 and bf16 in float32, divided first)."""

from __future__ import annotations

from typing import Any

import torch

from sofx import tree
from sofx.distributed.agreement import _check_same_layout, _device_kinds
from sofx.distributed.groups import _collective_device, _data_failure, dist, require_initialized
from sofx.distributed.refusals import _as_refusal, _check_arguments, _check_floating_tensors, _check_writable

__all__ = ["all_reduce_mean_"]


def all_reduce_mean_(grads: Any, group: Any = None, *extra: Any, check_layout: bool = True, **unknown: Any) -> Any:
    """Average a gradient pytree across ranks, in place: ``g <- (sum_r g_r) / world_size``; returns ``grads``.

    Leaves of one dtype and device are packed into one flat buffer, summed by
    one ``all_reduce(SUM)`` and divided by the world size once (the division is
    exact for a power-of-two world size). fp16 and bf16 leaves are summed in
    float32, each divided by the world size first, and rounded back once:
    ``g <- cast(sum_r fp32(g_r) / world_size)``, finite wherever every ``g_r``
    is (in fp16, two gradients of 40000 would sum to inf). ``None`` leaves (no
    gradient) are left out and must be ``None`` on every rank, in the same
    structure, with the same dtypes, shapes and kinds of device (the device's
    type, and which leaves share one: each rank sends one buffer per dtype and
    device; a device's index may differ) (checked first by one all-reduce of 16 bytes,
    ``check_layout=False`` skips it: where they differ every rank raises naming
    the first leaf, before any gradient moves; a rank whose own gradients are
    refused, not tensors, not floating point, or not writable in place
    (elements that overlap in memory, as an ``expand()``-ed tensor's; a leaf
    that requires grad, or a view of one; an inference tensor), raises that
    error and every other rank names it, before any gradient is written: none
    waits in a collective for a rank that left; with ``check_layout=False`` a
    rank raises alone, and the others wait for it until the group's timeout). A
    non-finite element on any rank makes the same element non-finite on every
    rank, so the overflow check skips the step everywhere. Every rank gets the
    same bits (gloo's and NCCL's all-reduce reduce each element once and send
    the result to every rank -- what ``DistributedDataParallel`` relies on; the
    tests check it on 2 and 3 ranks), so replicated parameters stay bitwise
    identical. With two ranks the sum ``g_0 + g_1`` is exactly what one
    process computes (for fp16/bf16: ``cast((fp32(g_0) + fp32(g_1)) / 2)``);
    with more, the order of the additions is the backend's. A keyword it
    does not take, or a positional argument too many, is refused as the
    rank's own input too (a ``TypeError`` at the call would leave the other
    ranks waiting). Every bucket is reduced before any gradient is written (the
    reduced buffers, one flat copy of the gradients, live until then): where
    an all-reduce fails (a rank exited or failed after the layout check, or
    stayed past the group's timeout) it raises a :class:`SofxError` naming
    it, the backend's error as its cause, and every gradient is as it was.
    """
    require_initialized(group, "all_reduce_mean_")
    world = dist.get_world_size(group)
    refused = None
    try:
        _check_arguments("all_reduce_mean_", "grads, group", extra, unknown, ("check_layout",))
        leaves, with_none, spec_with_none = _checked_gradients(grads)
    except Exception as e:  # told to the other ranks by the layout check, which they are waiting in
        if not check_layout:
            raise
        refused, leaves = _as_refusal("all_reduce_mean_", e), []
        with_none, spec_with_none = tree.flatten(None)  # nothing of this rank's to compare
    if check_layout:  # also where this rank refused: the others learn it instead of waiting for it
        _check_same_layout("all_reduce_mean_", spec_with_none, with_none, "grads", group,
                           _collective_device(group, None), refused, devices=_device_kinds(with_none))
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in leaves:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    sums = []  # every bucket reduced before any is written: a failed all-reduce leaves every gradient as it was
    for (dtype, _), group_leaves in buckets.items():
        flat = _summands(torch.cat([g.reshape(-1) for g in group_leaves]), world)
        if flat.numel() == 0:
            continue
        try:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        except RuntimeError as exc:  # (gloo's timeout, or its peer gone; NCCL's DistBackendError is one too)
            raise _data_failure("all_reduce_mean_", exc, "the all-reduce of the gradients",
                                "no gradient was written on this rank") from exc
        sums.append((dtype, group_leaves, flat))
    for dtype, group_leaves, flat in sums:
        flat = _mean_from_sum(flat, world, dtype)
        offset = 0
        for g in group_leaves:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
    return grads


def _checked_gradients(grads: Any) -> tuple[list[torch.Tensor], list[Any], tree.TreeSpec]:
    """:func:`all_reduce_mean_`'s gradients (``None`` leaves left out: empty subtrees), checked, and ``grads``'
    leaves with ``None`` kept and their structure (what the layout check compares, to name a ``None`` leaf). Any
    exception here, also one the checks did not foresee (a tree that cannot be flattened), is this rank's
    refusal."""
    leaves, spec = tree.flatten(grads)
    paths = tree.leaf_paths(spec, "grads")
    _check_floating_tensors("all_reduce_mean_", paths, leaves)
    _check_writable("all_reduce_mean_", paths, leaves)
    with_none, spec_with_none = tree.flatten(grads, is_leaf=lambda x: x is None)
    return leaves, with_none, spec_with_none


def _summands(flat: torch.Tensor, world: int) -> torch.Tensor:
    """What this rank adds to the sum over ranks of a bucket of gradients ``flat`` (a buffer of its own, which
    the collective overwrites).

    float32 and wider: ``flat`` itself; the mean is then ``(sum_r g_r) / world``
    (:func:`_mean_from_sum`). Narrower (fp16, bf16): a float32 copy divided by
    ``world`` first, as ``DistributedDataParallel`` divides before its
    all-reduce, so the mean is ``cast(sum_r (fp32(g_r) / world))``. Summed in
    fp16, two finite gradients of 40000 make inf (fp16's largest is 65504)
    though their mean is finite; in float32, pre-divided, the sum of finite
    values is at most ``max_r |g_r| * (1 + 2^-24)`` (one rounding per
    division, exact for a power-of-two world size), below float32's largest
    and, cast back, never beyond the gradients' own largest finite value
    (bf16's is below float32's by far more than that rounding). An inf or nan
    stays one (``inf / w = inf``, ``inf + x = inf``, ``nan + x = nan``), so
    overflow detection sees it. The float32 sum is also more accurate than
    an fp16 or bf16 one (the gradients travel as float32: twice the bytes).
    """
    if flat.dtype.itemsize >= 4:
        return flat
    wide = flat.to(torch.float32)
    return wide.div_(world) if world != 1 else wide


def _mean_from_sum(total: torch.Tensor, world: int, dtype: torch.dtype) -> torch.Tensor:
    """The mean from the sum over ranks of :func:`_summands` (``total``, written in place): divided by ``world``
    where the gradients' ``dtype`` is float32 or wider, else (pre-divided) rounded back to ``dtype`` once."""
    if dtype.itemsize >= 4:
        return total.div_(world) if world != 1 else total
    return total.to(dtype)
