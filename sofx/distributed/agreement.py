"""Whether every rank passed the same: a digest all-reduced, and where they differ, what differs.

:func:`_agree` compares named entries (the setup, :mod:`sofx.distributed.setup`;
a shard's leaves and owners, :func:`sofx.distributed.shard_blocks`);
:func:`_check_same_layout` compares the trees a packed collective sends
(structure, ``None`` leaves, dtypes, shapes, owners, devices). Both take part
as a rank that refuses where this rank's own input failed its checks, and raise
on every rank, before any data moves.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Sequence

import torch

from sofx import tree
from sofx.distributed.groups import _collective_failure, _data_failure, _lost_rank, dist
from sofx.errors import SofxError


@functools.lru_cache(maxsize=256)
def _structure_digest(spec: tree.TreeSpec) -> bytes:
    """A digest of a tree structure (its leaf paths), memoized: a loop passes the same structure every step."""
    return hashlib.blake2b("\n".join(tree.leaf_paths(spec)).encode(), digest_size=16).digest()


def _dtype_shape(dtype: torch.dtype, shape: Sequence[int]) -> str:
    """A leaf's dtype and shape as the ranks compare and the errors name them: ``"torch.float32 (3, 4)"``."""
    return f"{dtype} {tuple(shape)}"


def _layout(spec: tree.TreeSpec, leaves: Sequence[Any]) -> tuple[bytes, tuple[Any, ...]]:
    """What must agree between ranks for a packed collective: the structure and every leaf's dtype and shape
    (``None`` where a leaf has no tensor)."""
    return _structure_digest(spec), tuple((x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else None
                                          for x in leaves)


def _device_kinds(leaves: Sequence[Any]) -> tuple[str | None, ...]:
    """Each leaf's device as the ranks compare it (``None`` where a leaf has no tensor): its type (``"cpu"``,
    ``"cuda"``), and where this rank's leaves use several devices of that type, which one in the order the
    leaves first use them (``"cuda #2 of 2"``). Not the device's index, which differs between ranks (rank 1
    trains on ``cuda:1``): the leaves a rank packs into one buffer per dtype and device are the same on every
    rank exactly where these and the dtypes agree."""
    used: dict[str, list[torch.device]] = {}
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.device not in used.setdefault(x.device.type, []):
            used[x.device.type].append(x.device)

    def kind(x: Any) -> str | None:
        if not isinstance(x, torch.Tensor):
            return None
        same_type = used[x.device.type]
        if len(same_type) == 1:
            return x.device.type
        return f"{x.device.type} #{same_type.index(x.device) + 1} of {len(same_type)}"

    return tuple(kind(x) for x in leaves)


def _digests_agree(text: str, group: Any, dev: torch.device, what: str = "sofx.distributed",
                   refused: SofxError | None = None) -> bool:
    """Whether every rank of ``group`` passed the same ``text``: one all-reduce (MAX) of two int64, a 56-bit
    digest of it and minus that digest (the max and minus the min agree exactly where every digest does).

    Where the all-reduce fails (a rank that never came to the call ``what``: the group's timeout, or its
    connections closed by an earlier one), a :class:`SofxError` naming ``what``, with the backend's words (its
    bare ``RuntimeError`` named neither), or this rank's own ``refused``, the cause of its call's failure."""
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")
    bounds = torch.tensor([digest, -digest], dtype=torch.int64, device=dev)
    try:
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:  # (gloo's timeout, or its peer gone; NCCL's DistBackendError is one too)
        if refused is not None:
            raise refused from exc
        if not _lost_rank(exc):
            raise _collective_failure(what, exc, "this call's agreement", "no data moved") from exc
        raise SofxError(f"{what}: a rank did not take part in this call's agreement ({type(exc).__name__}: {exc}) "
                        "within the process group's timeout (or it exited, or an earlier timeout closed the group): "
                        "a rank that raised in its own code before it, or skipped it; every rank must make the same "
                        "calls in the same order; no data moved, and the process group may be unusable now (gloo "
                        "closes its connections on a timeout)") from exc
    return int(bounds[0]) == digest and -int(bounds[1]) == digest


def _agree(what: str, entries: dict[str, str], group: Any, dev: torch.device, refused: SofxError | None,
           hint: str) -> None:
    """Raise on every rank of ``group`` unless every rank passed the same ``entries`` (name -> text: a leaf
    path and its dtype and shape, a setting and its value), in the same order (a rank's leaf ``i`` is another
    leaf where the orders differ), and none refused; the setup's agreement.

    ``refused``: this rank's own check of its input failed; it still takes part (the others would wait for it),
    then raises that error, and every other rank says which rank refused what. One all-reduce of a digest
    (:func:`_digests_agree`); only where they differ an ``all_gather_object`` of the entries, to name the first
    entry that differs with every rank's value (``absent``: a rank without that entry), or where none does, the
    first place where their orders differ."""
    if _digests_agree(repr((list(entries.items()), refused is None)), group, dev, what, refused):
        if refused is not None:  # every rank refused its input
            raise refused
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    _gather_objects(what, gathered, (entries, None if refused is None else str(refused)), group, refused,
                    "this call changed nothing on this rank")
    if refused is not None:
        raise refused
    refusing = [(r, text) for r, (_, text) in enumerate(gathered) if text is not None]
    if refusing:
        ranks = ", ".join(str(r) for r, _ in refusing)
        raise SofxError(f"{what}: rank{'s' if len(refusing) > 1 else ''} {ranks} refused its input "
                        f"({refusing[0][1]}); nothing was set up")
    raise SofxError(_difference(what, [theirs for theirs, _ in gathered], hint))


def _gather_objects(what: str, out: list[Any], mine: Any, group: Any, refused: SofxError | None,
                    unchanged: str) -> None:
    """``all_gather_object`` of ``mine`` into ``out``: the exchange, after the ranks' digests differed, that names
    what differs. Where it fails (a rank exited or failed since the digests' all-reduce), this rank's own
    ``refused``, the cause of its call's failure, or a :class:`SofxError` naming ``what`` (``unchanged``: what
    was left as it was), with the backend's error as its cause, not the backend's bare ``RuntimeError``."""
    try:
        dist.all_gather_object(out, mine, group=group)
    except RuntimeError as exc:  # (gloo's timeout, or its peer gone; NCCL's DistBackendError is one too)
        if refused is not None:
            raise refused from exc
        raise _data_failure(what, exc, "the exchange that names what differs between the ranks", unchanged) from exc


def _difference(what: str, gathered: list[dict[str, str]], hint: str, where: str = "between ranks") -> str:
    """The error for ranks whose entries differ (``gathered``: each rank's entries, name -> text): the first
    entry that differs with every rank's value (``absent``: a rank without that entry) and how many more do,
    or where none does, the first place where their orders differ."""
    position: dict[str, int] = {}  # an entry's latest place in any rank's order: a leaf that only one rank has
    for theirs in gathered:        # comes before the entries that follow the leaves (owners, say)
        for i, name in enumerate(theirs):
            position[name] = max(i, position.get(name, i))
    differ = sorted((n for n in position if len({theirs.get(n) for theirs in gathered}) > 1),
                    key=position.__getitem__)
    if not differ:  # the same entries on every rank, in another order
        return _out_of_order(what, [list(theirs) for theirs in gathered], hint)
    values: dict[str | None, list[int]] = {}
    for r, theirs in enumerate(gathered):
        values.setdefault(theirs.get(differ[0]), []).append(r)
    more = "" if len(differ) == 1 else (f" (and {len(differ) - 1} more: {', '.join(differ[1:4])}"
                                        f"{', ...' if len(differ) > 4 else ''})")
    return f"{what}: {differ[0]} differs {where}: {_ranks_said(values)}{more}; {hint}"


def _ranks_said(values: dict[str | None, list[int]]) -> str:
    """Each value with the ranks that have it (``values``: value -> ranks), ``"a on rank 0; b on ranks 1, 2"``
    (``absent``: ``None``, a rank without the entry)."""
    return "; ".join(f"{'absent' if v is None else _shortened(v)} on rank{'s' if len(rs) > 1 else ''} "
                     f"{', '.join(map(str, rs))}" for v, rs in values.items())


def _out_of_order(what: str, orders: list[list[str]], hint: str) -> str:
    """The error for ranks with the same entries in other orders (``orders``: each rank's entry names): the
    first place where they differ, with each rank's entry there."""
    i = next(i for i, names in enumerate(zip(*orders)) if len(set(names)) > 1)
    at: dict[str | None, list[int]] = {}
    for r, order in enumerate(orders):
        at.setdefault(order[i], []).append(r)
    return (f"{what}: the ranks list the same leaves and settings in another order (an OrderedDict's leaves come "
            f"in its keys' order): in place {i}, {_ranks_said(at)}; {hint}")


def _shortened(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_same_layout(what: str, spec: tree.TreeSpec, leaves: Sequence[Any], root: str, group: Any,
                       dev: torch.device, refused: SofxError | None = None, owners: tuple[int, ...] = (),
                       devices: tuple[str | None, ...] = ()) -> None:
    """Raise on every rank, before any data moves, if the ranks' trees differ in structure, in which leaves
    are ``None``, or in a leaf's dtype or shape, or their shards in a leaf's owner (``owners``, one per leaf;
    empty without a shard), or in a leaf's device (``devices``, one per leaf, as :func:`_device_kinds` reads
    them; empty where the collective packs every leaf on one device): the packed buffers would otherwise be
    summed or sent element by element between unrelated leaves (silently, when the totals agree), reduced onto
    or broadcast from different ranks (a leaf swapped with another), or break inside the backend. (A shard of
    another rank or world size than the group's is its rank's refusal: :meth:`Shard._check_group`.) One
    all-reduce of two int64 (a digest of the layout: its max and minus its min); only when they differ does an
    ``all_gather_object`` fetch the layouts to name the first leaf that differs.

    ``refused``: this rank's own check of its input failed (a gradient that is not floating point, a tree of
    another structure than the shard's): it still takes part, so that the others do not wait in the
    collective for it; it raises that error, and every other rank says which rank refused what."""
    mine = _layout(spec, leaves)
    if _digests_agree(repr((mine, owners, devices, refused is None)), group, dev, what, refused):
        if refused is not None:  # every rank refused its input
            raise refused
        return
    paths = tree.leaf_paths(spec, root)
    layouts: list[Any] = [None] * dist.get_world_size(group)
    _gather_objects(what, layouts, (paths, mine[1], owners, devices, None if refused is None else str(refused)),
                    group, refused, "no data was sent")
    if refused is not None:
        raise refused
    me = dist.get_rank(group)
    first_refusal = next(((r, text) for r, (*_, text) in enumerate(layouts) if text is not None), None)
    if first_refusal is not None:
        r, text = first_refusal
        raise SofxError(f"{what}: rank {r} refused its input ({text}); no data was sent")
    for r, (other_paths, other, other_owners, other_devices, _) in enumerate(layouts):
        if r == me or (other_paths, other, other_owners, other_devices) == (paths, mine[1], owners, devices):
            continue
        if other_paths != paths:
            theirs, ours = sorted(set(other_paths) - set(paths)), sorted(set(paths) - set(other_paths))
            if not theirs and not ours:  # the same leaves in another order
                i = next(i for i, (a, b) in enumerate(zip(paths, other_paths)) if a != b)
                raise SofxError(f"{what}: the {root} tree of rank {r} lists its leaves in another order than rank "
                                f"{me}'s (an OrderedDict's leaves come in its keys' order): leaf {i} is "
                                f"{other_paths[i]} on rank {r}, {paths[i]} on rank {me}")
            raise SofxError(f"{what}: the {root} tree of rank {r} has another structure than rank {me}'s "
                            f"(only on rank {r}: {theirs[:3]}; only on rank {me}: {ours[:3]})")
        if other_owners != owners:
            i = next(i for i, (a, b) in enumerate(zip(owners, other_owners)) if a != b)
            raise SofxError(f"{what}: {paths[i]} is owned by rank {other_owners[i]} in rank {r}'s shard, by rank "
                            f"{owners[i]} in rank {me}'s; every rank must build its Shard with the same owners "
                            "(shard_blocks with the same params sizes, or the same owners=)")
        if other == mine[1]:
            i = next(i for i, (a, b) in enumerate(zip(devices, other_devices)) if a != b)
            numbered = "#" in f"{devices[i]}{other_devices[i]}"
            note = "; #k of n: the kth of the n devices of that type a rank's gradients use" if numbered else ""
            raise SofxError(f"{what}: {paths[i]} is on {other_devices[i]} on rank {r}, on {devices[i]} on rank {me}; "
                            "every rank must keep its gradients on the same kind of device (the leaves of one dtype "
                            f"and device are summed as one buffer{note})")
        i = next(i for i, (a, b) in enumerate(zip(mine[1], other)) if a != b)

        def said(x: Any) -> str:
            return "no tensor" if x is None else _dtype_shape(*x)

        raise SofxError(f"{what}: {paths[i]} is {said(other[i])} on rank {r}, {said(mine[1][i])} on rank {me}; "
                        "every rank must pass the same structure, dtypes and shapes")
    raise SofxError(f"{what}: the ranks' {root} trees differ (their digests do)")
