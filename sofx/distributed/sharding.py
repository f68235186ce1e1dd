"""Block sharding (ZeRO-style): which rank owns which leaf, its local leaves, the gradient mean onto the
owners and the gather of the updated leaves from them.

:func:`partition_blocks` (the default owners), :class:`Shard`, and
:func:`shard_blocks`, which builds a rank's shard and checks that the ranks'
shards agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from sofx import tree
from sofx.adam import Adam, AdamHParams, hparams_at
from sofx.distributed.agreement import _agree, _check_same_layout, _dtype_shape
from sofx.distributed.groups import (_collective_device, _data_failure, _global_rank, dist, is_ready,
                                     require_initialized)
from sofx.distributed.mean import _mean_from_sum, _summands
from sofx.distributed.refusals import _as_refusal, _check_arguments, _check_floating_tensors, _no_data
from sofx.distributed.setup import _params_entries
from sofx.errors import SofxError
from sofx.kernels.user_numbers import as_integer, integer
from sofx.required import REQUIRED

__all__ = ["partition_blocks", "Shard", "shard_blocks"]


def partition_blocks(sizes: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The owner rank of every block: contiguous runs of blocks, balanced by element count.

    Block ``i`` (of ``sizes[i]`` elements) goes to rank
    ``min(world_size - 1, floor(world_size * c_i / N))`` with ``c_i`` the number
    of elements before the block's midpoint and ``N`` the total; owners never
    decrease with ``i``. A rank may own no block (more ranks than blocks).
    """
    world_size = integer("partition_blocks: world_size", world_size, 1, SofxError)  # numpy's too, as an int
    # Python ints (numpy's too): int() truncated a float size (sizes [2.5, 1.9] balanced as [2, 1])
    sizes = [integer(f"partition_blocks: sizes[{i}]", s, 0, SofxError)
             for i, s in enumerate(_items_of(sizes, "partition_blocks: sizes", "element counts"))]
    total = sum(sizes)
    if total == 0:  # nothing to balance: split by count
        n = len(sizes)
        return tuple(min(world_size - 1, (i * world_size) // max(n, 1)) for i in range(n))
    owners = []
    before = 0
    for s in sizes:
        mid2 = 2 * before + s  # twice the element offset of the block's midpoint
        owners.append(min(world_size - 1, (world_size * mid2) // (2 * total)))
        before += s
    return tuple(owners)


@dataclass(frozen=True)
class Shard:
    """Which leaves (blocks) of a params pytree this rank owns.

    ``owners[i]`` is the rank (within the group) owning leaf ``i`` of ``spec``,
    leaves numbered in :func:`sofx.tree.flatten` order (dict keys sorted).
    A rank's local tree is the list of its owned leaves in leaf order
    (:meth:`local`, or :meth:`reduce_mean` for data-parallel gradients); run
    the loops on it and gather with :meth:`gather`. Every rank must build its
    ``Shard`` from a params tree of the same structure and shapes, with the
    same owners (:meth:`gather` and :meth:`reduce_mean` check it first, with
    the layout). Immutable; build one with :func:`shard_blocks`.
    """

    rank: int
    world_size: int
    owners: tuple[int, ...]
    spec: tree.TreeSpec

    def __post_init__(self) -> None:
        # Python ints (numpy's too): a float rank or world size was taken (0.5 as rank 0 by shard_blocks' int())
        world_size = integer("Shard: world_size", self.world_size, 1, SofxError)
        rank = integer("Shard: rank", self.rank, 0, SofxError)
        if not rank < world_size:
            raise SofxError(f"rank {self.rank} is not in [0, {self.world_size})")
        if not isinstance(self.spec, tree.TreeSpec):  # (a bare AttributeError: no attribute 'num_leaves')
            raise SofxError(f"Shard: spec is {tree.article(type(self.spec).__name__)}; expected the params' tree "
                            "structure (sofx.tree.flatten(params)[1]); shard_blocks(params) builds a Shard")
        given = _items_of(self.owners, "Shard: owners", "ranks, one per leaf")
        if len(given) != self.spec.num_leaves:
            raise SofxError(f"owners has {len(given)} entries, the params tree has {self.spec.num_leaves} leaves")
        owners = [as_integer(o) for o in given]
        bad = [o for o, r in zip(given, owners) if r is None or not 0 <= r < world_size]
        if bad:
            raise SofxError(f"owners must be ranks in [0, {self.world_size}), got {bad[0]!r}")
        # one form on every rank (a list or a tuple of the same ranks describe the same shard: the ranks compare
        # their owners in the layout check)
        for name, value in (("rank", rank), ("world_size", world_size), ("owners", tuple(owners))):
            object.__setattr__(self, name, value)

    @property
    def owned(self) -> tuple[int, ...]:
        """The leaf indices this rank owns, in leaf order."""
        return tuple(i for i, o in enumerate(self.owners) if o == self.rank)

    def owned_by(self, rank: int) -> tuple[int, ...]:
        """The leaf indices rank ``rank`` owns; a rank outside ``[0, world_size)`` is refused (it owned ``()``)."""
        rank = integer("Shard.owned_by: rank", rank, 0, SofxError)
        if not rank < self.world_size:
            raise SofxError(f"Shard.owned_by: rank {rank} is not in [0, {self.world_size}) (the shard's world_size "
                            f"is {self.world_size})")
        return tuple(i for i, o in enumerate(self.owners) if o == rank)

    def local(self, full: Any, what: str = "tree") -> list[Any]:
        """This rank's leaves of ``full`` (a tree of the params' structure; ``None`` leaves allowed)."""
        leaves = tree.flatten_up_to(self.spec, full, what)
        return [leaves[i] for i in self.owned]

    def local_hparams(self, opt: Any, hparams: Any) -> Any:
        """This rank's per-leaf hparams: a list of complete ``AdamHParams`` for the local leaves.

        ``hparams`` is an ``AdamHParams`` prefix tree of the full params (or
        ``None``), or a schedule ``step -> hparams``, which gives a schedule.
        A field left ``None`` takes ``opt``'s default. A 0-d tensor (given or
        default) is kept, not read: each step reads it, as a step of the full
        tree does, so that changing it in place (``lr.fill_()``) between steps
        moves every rank's steps alike.
        """
        if not isinstance(opt, Adam):  # (Python's bare AttributeError from resolve_hparams; a schedule's at a step)
            inner = getattr(opt, "inner", None)
            wrapper = " (of an apply_if_finite wrapper, pass its inner sofx.Adam: opt.inner)" \
                if isinstance(inner, Adam) else ""
            raise SofxError(f"Shard.local_hparams: opt is {tree.article(type(opt).__name__)}; expected the sofx.Adam "
                            "the loops step with (sofx.adamw(...) or sofx.adam(...)), whose defaults fill the fields "
                            f"left None{wrapper}")
        if callable(hparams):  # evaluated as the loops do (hparams_at: what it returned, refused in their words)
            return lambda step: self.local_hparams(opt, hparams_at(hparams, step))
        per_leaf = opt.resolve_hparams(hparams, self.spec)  # checked; defaults filled in, tensors read
        given = tree.broadcast_prefix(AdamHParams() if hparams is None else hparams, self.spec,
                                      is_leaf=lambda x: isinstance(x, AdamHParams), what="hparams")
        return [_keeping_tensors(given[i], per_leaf[i], opt.defaults) for i in self.owned]

    def _check_group(self, group: Any, what: str) -> None:
        """Refuse a shard built for another rank or world size than ``group`` gives this process (a hand-built
        :class:`Shard`, or one built for another group); ``torch.distributed`` is initialized (checked before)."""
        if dist.get_world_size(group) != self.world_size or dist.get_rank(group) != self.rank:
            raise SofxError(f"{what}: the shard is rank {self.rank} of {self.world_size}, the group has this "
                            f"process as rank {dist.get_rank(group)} of {dist.get_world_size(group)}")

    def _gather_inputs(self, local: list[Any], like: Any) -> list[Any]:
        """``like``'s leaves (the templates), checked against this rank's ``local`` leaves."""
        owned = self.owned
        if len(local) != len(owned):
            raise SofxError(f"Shard.gather: {len(local)} local leaves, rank {self.rank} owns {len(owned)}")
        templates = tree.flatten_up_to(self.spec, like, "like")
        for path, t in zip(tree.leaf_paths(self.spec, "like"), templates):
            if not isinstance(t, torch.Tensor):
                raise SofxError(f"Shard.gather: {path} is {type(t).__name__}; like's leaves must be tensors (meta "
                                "tensors will do) giving each leaf's shape and dtype")
        paths = tree.leaf_paths(self.spec)
        for i, x in zip(owned, local):
            t = templates[i]
            why = _no_data(x) if isinstance(x, torch.Tensor) else None  # (a nested tensor has no shape)
            if why is not None:
                raise SofxError(f"Shard.gather: this rank's local leaf for {paths[i]} is {why}; the owner sends "
                                "its leaves' data (only like's leaves may be meta tensors)")
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(t.shape) or x.dtype != t.dtype:
                got = _dtype_shape(x.dtype, x.shape) if isinstance(x, torch.Tensor) else f"of type {type(x).__name__}"
                raise SofxError(f"Shard.gather: this rank's local leaf for {paths[i]} is {got}; like says "
                                f"{_dtype_shape(t.dtype, t.shape)}")
        return templates

    def _reduce_inputs(self, grads: Any) -> list[Any]:
        """``grads``' leaves in the shard's structure, checked: dense tensors of a floating-point dtype, or None."""
        g_leaves = tree.flatten_up_to(self.spec, grads, "grads")
        _check_floating_tensors("Shard.reduce_mean", tree.leaf_paths(self.spec, "grads"), g_leaves)
        return g_leaves

    def gather(self, local: Sequence[torch.Tensor], like: Any = REQUIRED, group: Any = None, *extra: Any,
               check_layout: bool = True, **unknown: Any) -> Any:
        """The full tree, every leaf sent by its owner: ``local`` from each rank, assembled on every rank.

        ``local``: this rank's leaves (as :meth:`local` orders them, e.g. the
        ``params``, ``opt_state.mu`` or ``opt_state.count`` of a loop state).
        ``like``: a tree of the full structure whose leaves give each leaf's
        shape and dtype (meta tensors are fine); required (left out on one
        rank, it is that rank's refusal, raised on every rank). The leaves of one owner and
        dtype travel as one flat buffer: one broadcast per (owner, dtype).
        Every rank of ``group`` must call it, with ``like`` of the same dtypes and
        shapes (checked first, as in :func:`all_reduce_mean_`). The returned leaves are
        non-overlapping views of those buffers, bit-identical to the owners' (a buffer
        travels as its bytes: leaves of any dtype, float8 ones included, which gloo
        broadcasts as no dtype of theirs).
        """
        require_initialized(group, "Shard.gather")
        refused = None
        try:
            _check_arguments("Shard.gather", "local, like, group", extra, unknown, ("check_layout",))
            if like is REQUIRED:  # (Python's TypeError at the call left the other ranks waiting)
                raise SofxError("Shard.gather: missing required argument 'like', a tree of the full structure "
                                "whose leaves give each leaf's shape and dtype (the full params, meta tensors "
                                "are fine): shard.gather(local, like=params)")
            self._check_group(group, "Shard.gather")
            local = list(local)  # (a TypeError for None: refused below, as the checks' errors)
            templates = self._gather_inputs(local, like)
        except Exception as e:  # told to the other ranks by the layout check, which they are waiting in
            if not check_layout:
                raise
            refused, templates = _as_refusal("Shard.gather", e), [None] * self.spec.num_leaves
        mine = dict(zip(self.owned, local)) if refused is None else {}
        dev = _collective_device(group, None)
        if check_layout:
            _check_same_layout("Shard.gather", self.spec, templates, "like", group, dev, refused, self.owners)
        out: list[Any] = [None] * len(templates)
        for (owner, dtype), leaves in _buckets(self.owners, templates).items():
            sizes = [math.prod(templates[i].shape) for i in leaves]
            if owner == self.rank:
                flat = torch.cat([mine[i].detach().reshape(-1).to(dev) for i in leaves])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=dev)
            if flat.numel():
                try:  # (as bytes: gloo broadcasts no float8, int16 or uint16 tensor, its "Invalid scalar type")
                    dist.broadcast(flat.view(torch.uint8), src=_global_rank(group, owner), group=group)
                except RuntimeError as exc:  # (gloo's timeout, or its peer gone; NCCL's DistBackendError too)
                    raise _data_failure("Shard.gather", exc, "the broadcast of the owners' leaves",
                                        "this rank's local leaves are unchanged") from exc
            for i, part in zip(leaves, flat.split(sizes)):
                out[i] = part.view(templates[i].shape)
        return tree.unflatten(self.spec, out)

    def reduce_mean(self, grads: Any, group: Any = None, *extra: Any, check_layout: bool = True,
                    **unknown: Any) -> list[Any]:
        """Data parallel + sharding: every leaf's gradient averaged onto its owner only.

        ``grads``: this rank's full gradient tree (``None`` leaves: no
        gradient, the same on every rank). Returns this rank's local gradient
        list, ``g_i = (sum_r g_{r,i}) / world_size`` for each owned leaf ``i``
        (``None`` where the leaf had none): the reduce-scatter of ZeRO-2, one
        ``reduce(SUM)`` per (owner, dtype) of the leaves with a gradient (fp16
        and bf16 ones in float32, divided first, as in :func:`all_reduce_mean_`).
        With two ranks the sum is exact to order: the mean has the bits of
        :func:`all_reduce_mean_`'s, and of ``DistributedDataParallel``'s but
        where DDP halves an fp16 subnormal with a rounding
        (tests/test_distributed_dtypes.py). With more, the order of the
        additions is the backend's and follows the buffer (gloo's depends on
        its size and on each element's place in it); the leaves travel in one
        buffer per (owner, dtype) here, per (dtype, device) there, so the mean
        may differ from :func:`all_reduce_mean_`'s in the last bit (seen on 3
        gloo ranks), and a ZeRO-2 run from a data-parallel one by float32
        rounding.
        ``grads`` is not modified. Non-finite elements reach the owner (and,
        through :func:`all_reduce_sumsq`, every rank). The ranks' trees must
        agree in structure, ``None`` leaves, dtypes and shapes (checked first,
        as in :func:`all_reduce_mean_`).
        """
        require_initialized(group, "Shard.reduce_mean")
        refused = None
        try:
            _check_arguments("Shard.reduce_mean", "grads, group", extra, unknown, ("check_layout",))
            self._check_group(group, "Shard.reduce_mean")
            g_leaves = self._reduce_inputs(grads)
        except Exception as e:  # told to the other ranks by the layout check, which they are waiting in
            if not check_layout:
                raise
            refused, g_leaves = _as_refusal("Shard.reduce_mean", e), [None] * self.spec.num_leaves
        present = [i for i, g in enumerate(g_leaves) if g is not None]
        dev = _collective_device(group, None)
        if check_layout:
            _check_same_layout("Shard.reduce_mean", self.spec, g_leaves, "grads", group, dev, refused,
                               self.owners)
        world = self.world_size
        result: dict[int, torch.Tensor] = {}
        owners = [self.owners[i] for i in present]
        for (owner, dtype), idx in _buckets(owners, [g_leaves[i] for i in present]).items():
            leaves = [present[j] for j in idx]
            sizes = [g_leaves[i].numel() for i in leaves]
            flat = _summands(torch.cat([g_leaves[i].detach().reshape(-1).to(dev) for i in leaves]), world)
            if flat.numel():
                try:
                    dist.reduce(flat, dst=_global_rank(group, owner), op=dist.ReduceOp.SUM, group=group)
                except RuntimeError as exc:  # (gloo's timeout, or its peer gone; NCCL's DistBackendError too)
                    raise _data_failure("Shard.reduce_mean", exc, "the reduction of the gradients onto their owners",
                                        "grads is unchanged (reduce_mean never writes it)") from exc
            if owner == self.rank:
                flat = _mean_from_sum(flat, world, dtype)
                for i, part in zip(leaves, flat.split(sizes)):
                    result[i] = part.view(g_leaves[i].shape).to(g_leaves[i].device)
        return [result.get(i) for i in self.owned]


def _keeping_tensors(given: Any, full: AdamHParams, defaults: AdamHParams) -> AdamHParams:
    """``full`` (a leaf's hparams, complete, as numbers) with the fields that ``given`` (its hparams as passed,
    ``None`` in a field: the default) or ``defaults`` hold as tensors put back as those tensors."""
    given = AdamHParams() if given is None else given
    fields = [d if x is None else x for x, d in zip(given, defaults)]
    return AdamHParams(*(x if isinstance(x, torch.Tensor) else f for x, f in zip(fields, full)))


def _buckets(owners: Sequence[int], templates: Sequence[Any]) -> dict[tuple[int, torch.dtype], list[int]]:
    """Positions grouped by (owner, dtype), in a fixed order (owner, then first position) on every rank."""
    out: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, (owner, t) in enumerate(zip(owners, templates)):
        out.setdefault((owner, t.dtype), []).append(i)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], kv[1][0])))


def shard_blocks(params: Any, group: Any = None, *extra: Any, owners: Sequence[int] | None = None,
                 rank: int | None = None, world_size: int | None = None, **unknown: Any) -> Shard:
    """The :class:`Shard` of this rank for the full ``params`` tree.

    ``owners``: the owner rank of every leaf (default:
    :func:`partition_blocks` of the leaves' sizes). ``rank``/``world_size``
    default to ``group``'s (then ``torch.distributed`` must be initialized);
    pass both to describe a shard without a process group.

    With ``group``'s rank and world size it is a collective, every rank calls
    it at setup: the ranks check (one all-reduce of 16 bytes) that their
    params agree in structure, dtypes and shapes and their shards in owners.
    Where not, or where a rank refuses its own input (a leaf that is not a
    tensor, two leaves of one path, bad owners, an unknown keyword, a
    positional argument too many),
    every rank raises naming the rank, or the first leaf that differs with
    each rank's dtype and shape.
    Unchecked, such shards step leaves of other shapes, or other leaves, side
    by side until a gather finds it (or, without one, never).
    """
    if (rank is not None and world_size is not None) or not is_ready():  # no process group to agree with
        _check_arguments("shard_blocks", "params, group", extra, unknown, _SHARD_KEYWORDS)
        if rank is None or world_size is None:
            if rank is not None or world_size is not None:
                raise SofxError("shard_blocks: pass both rank and world_size, or neither")
            require_initialized(group, "shard_blocks")
        return _build_shard(params, owners, rank, world_size)
    require_initialized(group, "shard_blocks")
    refused, shard, entries = None, None, {}
    try:
        _check_arguments("shard_blocks", "params, group", extra, unknown, _SHARD_KEYWORDS)
        if rank is not None or world_size is not None:
            raise SofxError("shard_blocks: pass both rank and world_size, or neither")
        shard = _build_shard(params, owners, dist.get_rank(group), dist.get_world_size(group))
        entries = _shard_entries(shard, params)  # (refuses two leaves of one path)
    except Exception as e:  # told to the other ranks by the agreement, which they are waiting in
        refused = _as_refusal("shard_blocks", e)
    _agree("shard_blocks", entries, group, _collective_device(group, None), refused,
           "every rank must build its shard from params of the same structure, dtypes and shapes, with the "
           "same owners")
    return shard


_SHARD_KEYWORDS = ("owners", "rank", "world_size")


def _build_shard(params: Any, owners: Sequence[int] | None, rank: int, world_size: int) -> Shard:
    """The shard of ``rank`` of ``world_size`` for ``params``, its leaves and ``owners`` checked."""
    leaves, spec = tree.flatten(params)
    for path, x in zip(tree.leaf_paths(spec), leaves):
        if not isinstance(x, torch.Tensor):
            raise SofxError(f"shard_blocks: {path} is {tree.article(type(x).__name__)}; expected a tensor (a meta "
                            "tensor describes a leaf without its data)")
    # checked before they are used (int() took rank=0.5 as 0, world_size="2" as 2)
    world_size = integer("shard_blocks: world_size", world_size, 1, SofxError)
    rank = integer("shard_blocks: rank", rank, 0, SofxError)
    if owners is None:
        owners = partition_blocks([math.prod(x.shape) for x in leaves], world_size)
    owners = _items_of(owners, "shard_blocks: owners", "ranks, one per leaf")
    bad = [o for o in owners if as_integer(o) is None]
    if bad:
        raise SofxError(f"shard_blocks: owners must be ranks (ints), got {bad[0]!r}")
    return Shard(rank, world_size, owners, spec)


def _items_of(x: Any, what: str, items: str) -> tuple[Any, ...]:
    """``x``'s items, read once (a generator's too); :class:`SofxError` naming ``what`` where ``x`` is not
    iterable (a bare ``TypeError`` before, or, for a generator read twice, no items at all)."""
    try:
        return tuple(x)
    except TypeError:
        raise SofxError(f"{what} must be a sequence of {items}, got {type(x).__name__}") from None


def _shard_entries(shard: Shard, params: Any) -> dict[str, str]:
    """What the ranks' shards must agree in: every leaf's path with its dtype and shape, and the owners."""
    return {**_params_entries(params), "owners": repr(shard.owners)}
