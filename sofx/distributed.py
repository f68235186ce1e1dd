"""torch.distributed collectives for the serial and speculative loops.

Plain functions over an optional process group (``None``: the default group);
nothing here holds global state. Every function raises :class:`SofxError`
with a clear message when ``torch.distributed`` is unavailable or not
initialized, or when this process is not a member of ``group``.

What the loops need
-------------------

The global facts of a step (SPECULATION.md sections 3-4) are the overflow flag
and the global gradient norm; both derive from one number, the sum of squares
``s = sum_r s_r`` of the raw gradients over every block of every rank ``r``:
``overflow = not isfinite(s)`` and ``norm = sqrt(s) / S``.
:func:`all_reduce_sumsq` returns the ``reduce_sumsq`` hook of
:func:`sofx.serial.serial_loop_step` and
:func:`sofx.speculate.speculative_loop_step` /
:func:`sofx.speculate.plan_validation`::

    reduce = sofx.distributed.all_reduce_sumsq(group)
    loop, report = speculative_loop_step(opt, loop, local_grads, config=cfg, scaler=scaler,
                                         hparams=local_hparams, reduce_sumsq=reduce)

It all-gathers the ``world_size`` local float64 sums and adds them in rank
order, ``s = (((s_0 + s_1) + s_2) + ...)``, on every rank: every rank gets the
same bits whatever the backend's reduction algorithm, so every rank takes the
same decisions (overflow, clip coefficient, loss-scale update). A nan or inf on
any rank makes ``s`` non-finite on every rank (IEEE addition: ``inf + x = inf``
for ``x >= 0``, ``nan + x = nan``; sums of squares are never negative), so
every rank skips the step. (gloo's ``all_reduce(SUM)`` propagates inf and nan
as well -- the tests check both -- but the association of its additions is the
backend's and depends on its algorithm and the world size; the all-gather makes
it explicit and the same for every backend.)
Every rank must call the hook once per step, also a rank that owns no block
or got no gradient: its local sum is then ``-0.0``
(:func:`sofx.serial.local_sumsq`), IEEE addition's identity, so ``s`` is
``-0.0`` exactly when no rank has a gradient, and such a step is not counted
by the loss scaler or the speculation policy, as in one process
(:func:`sofx.serial.without_gradients`). A hook of one's own that adds the
ranks' values (``dist.all_reduce(SUM)`` of a float64 tensor will do) keeps
that; one that returns ``+0.0`` there makes the step count as a step with zero
gradients.

ZeRO-style sharding: each rank owns a subset of the blocks (the leaves of the
params pytree) and keeps their master weights and Adam state; :class:`Shard`
says which (by default :func:`partition_blocks`: contiguous, balanced by
element count), selects a rank's leaves from a full tree (params, gradients,
per-leaf hparams or a schedule of them), averages a data-parallel rank's full
gradients onto their owners (:meth:`Shard.reduce_mean`, ZeRO-2's
reduce-scatter) and gathers the updated leaves back from their owners
(:meth:`Shard.gather`, one broadcast per owner and dtype). Each rank runs the
ordinary loop on its local list of leaves with ``reduce_sumsq``::

    shard = sofx.distributed.shard_blocks(params)            # every rank; checks their params agree
    reduce = sofx.distributed.all_reduce_sumsq(opt=opt, scaler=scaler, config=cfg, hparams=schedule)
    loop = sofx.serial.init_loop(opt, shard.local(params), scaler)
    hp = shard.local_hparams(opt, schedule)                  # a prefix tree or a schedule of one
    for batch in data:
        local_grads = shard.reduce_mean(grads)               # or shard.local(grads) if already averaged
        loop, report = speculative_loop_step(opt, loop, local_grads, config=cfg, scaler=scaler,
                                             hparams=hp, reduce_sumsq=reduce)
    full_params = shard.gather(loop.params, like=params)

``shard_blocks`` and ``all_reduce_sumsq`` are collectives of the setup: each
checks, with one all-reduce of 16 bytes, that every rank passed the same
(params' structure, dtypes and shapes and the owners; the optimizer, loss
scaler, speculation config and the full hparams or schedule), and where not,
every rank raises naming what differs (:func:`check_same_setup` checks the
same for a loop without the hook). Build them first: a rank that fails
before them alone leaves the others waiting there.

The result, gathered, equals the single-process loop over the whole tree:
bitwise on every step until one clips (the clip coefficient comes from ``s``,
whose float64 rounding depends on how the blocks are split across ranks) or
undoes a speculative step algebraically (snapshot undo, ``undo="exact"``, is
bitwise); to float32 rounding (<= 1e-6 relative) after that. Overflow and loss
scale decisions are identical on every rank and equal to the single process's.

Data parallelism: :func:`all_reduce_mean_` averages a gradient pytree in place
across ranks, ``g <- (sum_r g_r) / world_size`` (summed by the backend's
all-reduce, then divided once; fp16 and bf16 gradients in float32, divided
first as ``DistributedDataParallel`` does, so that finite gradients never sum
to inf), so replicated parameters stay identical.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from sofx import tree
from sofx.errors import SofxError
from sofx.kernels.user_numbers import as_integer, integer
from sofx.kernels.donation import unwritable

__all__ = [
    "is_ready",
    "require_initialized",
    "group_rank",
    "group_size",
    "all_reduce_sumsq",
    "check_same_setup",
    "SumsqReduce",
    "RankRefusedError",
    "all_reduce_mean_",
    "partition_blocks",
    "Shard",
    "shard_blocks",
]

try:  # a build of torch without distributed support still imports sofx
    import torch.distributed as dist
except ImportError:  # pragma: no cover - every supported build has it
    dist = None  # type: ignore[assignment]


def is_ready() -> bool:
    """``True`` when ``torch.distributed`` is available and a default process group is initialized."""
    return dist is not None and dist.is_available() and dist.is_initialized()


def require_initialized(group: Any = None, what: str = "sofx.distributed") -> None:
    """Raise :class:`SofxError` unless collectives on ``group`` can run in this process."""
    if dist is None or not dist.is_available():
        raise SofxError(f"{what}: this build of torch has no torch.distributed support")
    if not dist.is_initialized():
        single = " (or pass reduce_sumsq=None for a single process)" if what == "all_reduce_sumsq" else ""
        raise SofxError(f"{what}: torch.distributed is not initialized; call "
                        f"torch.distributed.init_process_group(...) on every rank first{single}")
    if group is not None and dist.get_rank(group) < 0:
        raise SofxError(f"{what}: this process (global rank {dist.get_rank()}) is not a member of the given "
                        "process group")


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


@functools.lru_cache(maxsize=256)
def _structure_digest(spec: tree.TreeSpec) -> bytes:
    """A digest of a tree structure (its leaf paths), memoized: a loop passes the same structure every step."""
    return hashlib.blake2b("\n".join(tree.leaf_paths(spec)).encode(), digest_size=16).digest()


def _layout(spec: tree.TreeSpec, leaves: Sequence[Any]) -> tuple[bytes, tuple[Any, ...]]:
    """What must agree between ranks for a packed collective: the structure and every leaf's dtype and shape
    (``None`` where a leaf has no tensor)."""
    return _structure_digest(spec), tuple((x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else None
                                          for x in leaves)


def _digests_agree(text: str, group: Any, dev: torch.device) -> bool:
    """Whether every rank of ``group`` passed the same ``text``: one all-reduce (MAX) of two int64, a 56-bit
    digest of it and minus that digest (the max and minus the min agree exactly where every digest does)."""
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")
    bounds = torch.tensor([digest, -digest], dtype=torch.int64, device=dev)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    return int(bounds[0]) == digest and -int(bounds[1]) == digest


def _agree(what: str, entries: dict[str, str], group: Any, dev: torch.device, refused: SofxError | None,
           hint: str) -> None:
    """Raise on every rank of ``group`` unless every rank passed the same ``entries`` (name -> text: a leaf
    path and its dtype and shape, a setting and its value) and none refused; the setup's agreement.

    ``refused``: this rank's own check of its input failed; it still takes part (the others would wait for it),
    then raises that error, and every other rank says which rank refused what. One all-reduce of a digest
    (:func:`_digests_agree`); only where they differ an ``all_gather_object`` of the entries, to name the first
    entry that differs with every rank's value (``absent``: a rank without that entry)."""
    if _digests_agree(repr((sorted(entries.items()), refused is None)), group, dev):
        if refused is not None:  # every rank refused its input
            raise refused
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (entries, None if refused is None else str(refused)), group=group)
    if refused is not None:
        raise refused
    refusing = [(r, text) for r, (_, text) in enumerate(gathered) if text is not None]
    if refusing:
        ranks = ", ".join(str(r) for r, _ in refusing)
        raise SofxError(f"{what}: rank{'s' if len(refusing) > 1 else ''} {ranks} refused its input "
                        f"({refusing[0][1]}); nothing was set up")
    position: dict[str, int] = {}  # an entry's latest place in any rank's order: a leaf that only one rank has
    for theirs, _ in gathered:     # comes before the entries that follow the leaves (owners, say)
        for i, name in enumerate(theirs):
            position[name] = max(i, position.get(name, i))
    differ = sorted((n for n in position if len({theirs.get(n) for theirs, _ in gathered}) > 1),
                    key=position.__getitem__)
    values: dict[str | None, list[int]] = {}
    for r, (theirs, _) in enumerate(gathered):
        values.setdefault(theirs.get(differ[0]), []).append(r)
    said = "; ".join(f"{'absent' if v is None else _shortened(v)} on rank{'s' if len(rs) > 1 else ''} "
                     f"{', '.join(map(str, rs))}" for v, rs in values.items())
    more = "" if len(differ) == 1 else (f" (and {len(differ) - 1} more: {', '.join(differ[1:4])}"
                                        f"{', ...' if len(differ) > 4 else ''})")
    raise SofxError(f"{what}: {differ[0]} differs between ranks: {said}{more}; {hint}")


def _shortened(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_same_layout(what: str, spec: tree.TreeSpec, leaves: Sequence[Any], root: str, group: Any,
                       dev: torch.device, refused: SofxError | None = None, owners: tuple[int, ...] = ()) -> None:
    """Raise on every rank, before any data moves, if the ranks' trees differ in structure, in which leaves
    are ``None``, or in a leaf's dtype or shape, or their shards in a leaf's owner (``owners``, one per leaf;
    empty without a shard): the packed buffers would otherwise be summed or sent element by element between
    unrelated leaves (silently, when the totals agree), reduced onto or broadcast from different ranks (a
    leaf swapped with another), or break inside the backend. (A shard of another rank or world size than the
    group's is its rank's refusal: :meth:`Shard._check_group`.) One all-reduce of two int64 (a digest of the
    layout: its max and minus its min); only when they differ does an ``all_gather_object`` fetch the layouts
    to name the first leaf that differs.

    ``refused``: this rank's own check of its input failed (a gradient that is not floating point, a tree of
    another structure than the shard's): it still takes part, so that the others do not wait in the
    collective for it; it raises that error, and every other rank says which rank refused what."""
    mine = _layout(spec, leaves)
    if _digests_agree(repr((mine, owners, refused is None)), group, dev):
        if refused is not None:  # every rank refused its input
            raise refused
        return
    paths = tree.leaf_paths(spec, root)
    layouts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, (paths, mine[1], owners, None if refused is None else str(refused)),
                           group=group)
    if refused is not None:
        raise refused
    me = dist.get_rank(group)
    first_refusal = next(((r, text) for r, (*_, text) in enumerate(layouts) if text is not None), None)
    if first_refusal is not None:
        r, text = first_refusal
        raise SofxError(f"{what}: rank {r} refused its input ({text}); no data was sent")
    for r, (other_paths, other, other_owners, _) in enumerate(layouts):
        if r == me or (other_paths, other, other_owners) == (paths, mine[1], owners):
            continue
        if other_paths != paths:
            theirs, ours = sorted(set(other_paths) - set(paths)), sorted(set(paths) - set(other_paths))
            raise SofxError(f"{what}: the {root} tree of rank {r} has another structure than rank {me}'s "
                            f"(only on rank {r}: {theirs[:3]}; only on rank {me}: {ours[:3]})")
        if other_owners != owners:
            i = next(i for i, (a, b) in enumerate(zip(owners, other_owners)) if a != b)
            raise SofxError(f"{what}: {paths[i]} is owned by rank {other_owners[i]} in rank {r}'s shard, by rank "
                            f"{owners[i]} in rank {me}'s; every rank must build its Shard with the same owners "
                            "(shard_blocks with the same params sizes, or the same owners=)")
        i = next(i for i, (a, b) in enumerate(zip(mine[1], other)) if a != b)

        def said(x: Any) -> str:
            return "no tensor" if x is None else f"{x[0]} {x[1]}"

        raise SofxError(f"{what}: {paths[i]} is {said(other[i])} on rank {r}, {said(mine[1][i])} on rank {me}; "
                        "every rank must pass the same structure, dtypes and shapes")
    raise SofxError(f"{what}: the ranks' {root} trees differ (their digests do)")


class RankRefusedError(SofxError):
    """Another rank refused this step before its sum of squares was reduced (bad input there, say).

    Raised by :func:`all_reduce_sumsq`'s hook on every rank that did not refuse, in place of the sum:
    nothing was stepped on this rank either (the loops call the hook before they write), so every rank
    stays at the same step. ``ranks``: those that refused (their own errors say why).
    """

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.ranks)


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


def all_reduce_sumsq(group: Any = None, *, device: torch.device | str | None = None, params: Any = None,
                     opt: Any = None, scaler: Any = None, config: Any = None, hparams: Any = None,
                     settings: Mapping[str, Any] | None = None, **unknown: Any) -> SumsqReduce:
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

    _agree_setup("all_reduce_sumsq", group, ("device", *_SETUP_KEYWORDS), unknown, entries,
                 _setup_hint("the hook's device"))
    return SumsqReduce(group, device)


_SETUP_KEYWORDS = ("params", "opt", "scaler", "config", "hparams", "settings")


def _setup_hint(*more: str) -> str:
    """What a setup's error asks for: the same of everything it compared, on every rank."""
    compared = ("params' structure, dtypes and shapes", "optimizer", "loss scaler", "speculation config", "hparams",
                "settings", *more)
    return f"every rank must be set up the same ({'; '.join(compared)})"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def check_same_setup(group: Any = None, *, params: Any = None, opt: Any = None, scaler: Any = None,
                     config: Any = None, hparams: Any = None, settings: Mapping[str, Any] | None = None,
                     **unknown: Any) -> None:
    """Raise on every rank of ``group`` unless every rank passed the same setup: a collective, at setup.

    ``params``: the full params tree (structure, dtypes and shapes are
    compared, not values); ``opt``: the optimizer (its static configuration
    and kernel backend, by ``repr``); ``scaler``: the loss scaler (its
    settings); ``config``: a :class:`~sofx.speculate.SpeculationConfig`;
    ``hparams``: the full hparams (an ``AdamHParams`` prefix tree, not a
    rank's :meth:`Shard.local_hparams`), or a schedule of them, compared by
    its fields (a dataclass) or ``repr`` and by its value at step 0;
    ``settings``: anything else that must agree (``{"max_norm": 1.0,
    "profile": "torch"}`` for the serial loop, say). Dataclasses,
    NamedTuples, dicts, lists and tuples are compared field by field; floats
    and one-element tensors by their exact value; anything else by ``repr``
    (object addresses left out). A keyword left ``None`` is not compared, but
    a rank that passes it where another does not differs.

    One all-reduce of 16 bytes (a digest); where the ranks differ, every rank
    raises naming the first entry that differs (``config.max_norm``,
    ``params['w']``, ``hparams(0)['head'].lr``) with each rank's value; where
    a rank refuses its own input (an unknown keyword, a schedule that raises
    at step 0), it raises its error and every other rank names it. Without
    the check such ranks step side by side, differently, and their gathered
    results silently mix. (:func:`all_reduce_sumsq` takes the same keywords
    and checks them as it builds the hook; :func:`shard_blocks` checks the
    params of a shard.)
    """
    require_initialized(group, "check_same_setup")
    _agree_setup("check_same_setup", group, _SETUP_KEYWORDS, unknown,
                 lambda: _setup_entries(params, opt, scaler, config, hparams, settings), _setup_hint())


def _agree_setup(what: str, group: Any, known: Sequence[str], unknown: dict[str, Any],
                 entries: Callable[[], dict[str, str]], hint: str) -> None:
    """:func:`_agree` on ``entries()``, where an unknown keyword or a failure of ``entries`` is this rank's
    refusal."""
    refused, mine = None, {}
    try:
        _check_keywords(what, unknown, known)
        mine = entries()
    except Exception as e:  # told to the other ranks by the agreement, which they are waiting in
        refused = _as_refusal(what, e)
    _agree(what, mine, group, _collective_device(group, None), refused, hint)


def _device_type(group: Any, device: torch.device | str | None) -> str:
    """The type of the device the hook's sums travel on, refused where this process cannot hold a tensor there
    (the hook would fail on this rank alone at the first step)."""
    dev = _collective_device(group, device)
    try:
        torch.empty(0, device=dev)
    except Exception as e:
        raise SofxError(f"all_reduce_sumsq: device={device!r}: this process cannot hold a tensor there ({e})") from e
    return dev.type


def _setup_entries(params: Any, opt: Any, scaler: Any, config: Any, hparams: Any,
                   settings: Mapping[str, Any] | None) -> dict[str, str]:
    """The setup as entries (name -> text) that are equal on every rank where the setup is."""
    out: dict[str, str] = {}
    if params is not None:
        leaves, spec = tree.flatten(params)
        for path, x in zip(tree.leaf_paths(spec), leaves):
            out[path] = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else _text(x)
    for name, value in (("opt", opt), ("scaler", scaler), ("config", config), ("hparams", hparams)):
        if value is not None:
            _entries(name, value, out)
    if callable(hparams):
        _entries("hparams(0)", hparams(0), out)
    if settings is not None:
        if not isinstance(settings, Mapping):
            raise SofxError(f"settings is a {type(settings).__name__}; expected a mapping of names to settings")
        _entries("settings", dict(settings), out)
    return out


def _entries(path: str, x: Any, out: dict[str, str], depth: int = 0) -> None:
    """``x`` as ``out[path] = text``, and one entry per compared field of a dataclass or NamedTuple and per item
    of a dict, list or tuple (so that a message names the field that differs, ``config.max_norm``)."""
    items = _items(x) if depth < 8 else None
    if items is None:
        out[path] = _text(x)
        return
    out[path] = type(x).__qualname__
    for suffix, value in items:
        _entries(path + suffix, value, out, depth + 1)


def _items(x: Any) -> list[tuple[str, Any]] | None:
    """The named parts of a container or record ``x`` (``None`` for anything else)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [(f".{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x) if f.compare]
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return [(f".{name}", value) for name, value in zip(x._fields, x)]
    if isinstance(x, Mapping):
        return [(f"[{k!r}]", x[k]) for k in sorted(x, key=repr)]
    if isinstance(x, (list, tuple)):
        return [(f"[{i}]", value) for i, value in enumerate(x)]
    return None


def _text(x: Any) -> str:
    """``x`` as text that is the same on every rank where ``x`` is: a one-element tensor by its exact value,
    another by its dtype and shape, anything else by ``repr`` without object addresses (floats are exact)."""
    if isinstance(x, torch.Tensor):
        if x.numel() == 1 and x.layout == torch.strided and not x.is_meta:
            return f"tensor({x.item()!r}, dtype={x.dtype})"
        return f"tensor of {x.dtype} {tuple(x.shape)}"
    return _ADDRESS.sub("", repr(x))


def all_reduce_mean_(grads: Any, group: Any = None, *, check_layout: bool = True, **unknown: Any) -> Any:
    """Average a gradient pytree across ranks, in place: ``g <- (sum_r g_r) / world_size``; returns ``grads``.

    Leaves of one dtype and device are packed into one flat buffer, summed by
    one ``all_reduce(SUM)`` and divided by the world size once (the division is
    exact for a power-of-two world size). fp16 and bf16 leaves are summed in
    float32, each divided by the world size first, and rounded back once:
    ``g <- cast(sum_r fp32(g_r) / world_size)``, finite wherever every ``g_r``
    is (in fp16, two gradients of 40000 would sum to inf). ``None`` leaves (no
    gradient) are left out and must be ``None`` on every rank, in the same
    structure (checked first by one all-reduce of 16 bytes,
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
    does not take is refused as the rank's own input too (a ``TypeError``
    at the call would leave the other ranks waiting).
    """
    require_initialized(group, "all_reduce_mean_")
    world = dist.get_world_size(group)
    leaves, spec = tree.flatten(grads)  # None leaves: empty subtrees, left out
    refused = None
    try:
        _check_keywords("all_reduce_mean_", unknown, ("check_layout",))
        paths = tree.leaf_paths(spec, "grads")
        _check_floating_tensors("all_reduce_mean_", paths, leaves)
        _check_writable("all_reduce_mean_", paths, leaves)
    except SofxError as e:  # told to the other ranks by the layout check, which they are waiting in
        refused = e
    if check_layout:  # also where this rank refused: the others learn it instead of waiting for it
        with_none, spec_with_none = tree.flatten(grads, is_leaf=lambda x: x is None)  # to name a None leaf
        _check_same_layout("all_reduce_mean_", spec_with_none, with_none, "grads", group,
                           _collective_device(group, None), refused)
    elif refused is not None:
        raise refused
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in leaves:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for (dtype, _), group_leaves in buckets.items():
        flat = _summands(torch.cat([g.reshape(-1) for g in group_leaves]), world)
        if flat.numel() == 0:
            continue
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat = _mean_from_sum(flat, world, dtype)
        offset = 0
        for g in group_leaves:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
    return grads


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


def partition_blocks(sizes: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The owner rank of every block: contiguous runs of blocks, balanced by element count.

    Block ``i`` (of ``sizes[i]`` elements) goes to rank
    ``min(world_size - 1, floor(world_size * c_i / N))`` with ``c_i`` the number
    of elements before the block's midpoint and ``N`` the total; owners never
    decrease with ``i``. A rank may own no block (more ranks than blocks).
    """
    world_size = integer("partition_blocks: world_size", world_size, 1, SofxError)  # numpy's too, as an int
    # Python ints (numpy's too): int() truncated a float size (sizes [2.5, 1.9] balanced as [2, 1])
    sizes = [integer(f"partition_blocks: sizes[{i}]", s, 0, SofxError) for i, s in enumerate(sizes)]
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
        if len(self.owners) != self.spec.num_leaves:
            raise SofxError(f"owners has {len(self.owners)} entries, the params tree has {self.spec.num_leaves} leaves")
        owners = [as_integer(o) for o in self.owners]
        bad = [o for o, r in zip(self.owners, owners) if r is None or not 0 <= r < world_size]
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
        """The leaf indices rank ``rank`` owns."""
        return tuple(i for i, o in enumerate(self.owners) if o == rank)

    def local(self, full: Any, what: str = "tree") -> list[Any]:
        """This rank's leaves of ``full`` (a tree of the params' structure; ``None`` leaves allowed)."""
        leaves = tree.flatten_up_to(self.spec, full, what)
        return [leaves[i] for i in self.owned]

    def local_hparams(self, opt: Any, hparams: Any) -> Any:
        """This rank's per-leaf hparams: a list of complete ``AdamHParams`` for the local leaves.

        ``hparams`` is an ``AdamHParams`` prefix tree of the full params (or
        ``None``), or a schedule ``step -> hparams``, which gives a schedule.
        """
        if callable(hparams):
            return lambda step: self.local_hparams(opt, hparams(step))
        per_leaf = opt.resolve_hparams(hparams, self.spec)
        return [per_leaf[i] for i in self.owned]

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
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(t.shape) or x.dtype != t.dtype:
                got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise SofxError(f"Shard.gather: leaf {i} is {got}, like says {tuple(t.shape)} {t.dtype}")
            why = _no_data(x)
            if why is not None:
                raise SofxError(f"Shard.gather: this rank's local leaf for {paths[i]} is {why}; the owner sends "
                                "its leaves' data (only like's leaves may be meta tensors)")
        return templates

    def _reduce_inputs(self, grads: Any) -> list[Any]:
        """``grads``' leaves in the shard's structure, checked: dense tensors of a floating-point dtype, or None."""
        g_leaves = tree.flatten_up_to(self.spec, grads, "grads")
        for i, g in enumerate(g_leaves):
            if g is not None and (not isinstance(g, torch.Tensor) or not g.is_floating_point()):
                raise SofxError(f"Shard.reduce_mean: gradient {i} must be a floating-point tensor")
            if g is not None and g.layout != torch.strided:
                raise SofxError(f"Shard.reduce_mean: gradient {i} must be a dense (strided) tensor, got {g.layout}")
            if g is not None and g.is_meta:
                raise SofxError(f"Shard.reduce_mean: {tree.leaf_paths(self.spec, 'grads')[i]} is a meta tensor, "
                                "without data to average")
        return g_leaves

    def gather(self, local: Sequence[torch.Tensor], like: Any, group: Any = None, *,
               check_layout: bool = True, **unknown: Any) -> Any:
        """The full tree, every leaf sent by its owner: ``local`` from each rank, assembled on every rank.

        ``local``: this rank's leaves (as :meth:`local` orders them, e.g. the
        ``params``, ``opt_state.mu`` or ``opt_state.count`` of a loop state).
        ``like``: a tree of the full structure whose leaves give each leaf's
        shape and dtype (meta tensors are fine). The leaves of one owner and
        dtype travel as one flat buffer: one broadcast per (owner, dtype).
        Every rank of ``group`` must call it, with ``like`` of the same dtypes and
        shapes (checked first, as in :func:`all_reduce_mean_`). The returned leaves are
        non-overlapping views of those buffers, bit-identical to the owners'.
        """
        require_initialized(group, "Shard.gather")
        refused = None
        try:
            _check_keywords("Shard.gather", unknown, ("check_layout",))
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
                dist.broadcast(flat, src=_global_rank(group, owner), group=group)
            for i, part in zip(leaves, flat.split(sizes)):
                out[i] = part.view(templates[i].shape)
        return tree.unflatten(self.spec, out)

    def reduce_mean(self, grads: Any, group: Any = None, *, check_layout: bool = True,
                    **unknown: Any) -> list[Any]:
        """Data parallel + sharding: every leaf's gradient averaged onto its owner only.

        ``grads``: this rank's full gradient tree (``None`` leaves: no
        gradient, the same on every rank). Returns this rank's local gradient
        list, ``g_i = (sum_r g_{r,i}) / world_size`` for each owned leaf ``i``
        (``None`` where the leaf had none): the reduce-scatter of ZeRO-2, one
        ``reduce(SUM)`` per (owner, dtype) of the leaves with a gradient (fp16
        and bf16 ones in float32, divided first, as in :func:`all_reduce_mean_`).
        ``grads`` is not modified. Non-finite elements reach the owner (and,
        through :func:`all_reduce_sumsq`, every rank). The ranks' trees must
        agree in structure, ``None`` leaves, dtypes and shapes (checked first,
        as in :func:`all_reduce_mean_`).
        """
        require_initialized(group, "Shard.reduce_mean")
        refused = None
        try:
            _check_keywords("Shard.reduce_mean", unknown, ("check_layout",))
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
                dist.reduce(flat, dst=_global_rank(group, owner), op=dist.ReduceOp.SUM, group=group)
            if owner == self.rank:
                flat = _mean_from_sum(flat, world, dtype)
                for i, part in zip(leaves, flat.split(sizes)):
                    result[i] = part.view(g_leaves[i].shape).to(g_leaves[i].device)
        return [result.get(i) for i in self.owned]


def _check_floating_tensors(what: str, paths: Sequence[str], grads: Sequence[Any]) -> None:
    """Refuse a gradient that is not a dense floating-point tensor with data (a meta tensor has none)."""
    for path, g in zip(paths, grads):
        if not isinstance(g, torch.Tensor):
            raise SofxError(f"{what}: gradients must be tensors, got {type(g).__name__}")
        if not g.is_floating_point():
            raise SofxError(f"{what}: gradients must be floating point, got {g.dtype}")
        if g.layout != torch.strided:
            raise SofxError(f"{what}: gradients must be dense (strided) tensors, got {g.layout}")
        if g.is_meta:
            raise SofxError(f"{what}: {path} is a meta tensor, without data to average")


def _check_writable(what: str, paths: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
    """Refuse a gradient the mean cannot be written into in place, before any is written (``copy_`` would
    raise on it after the leaves before it were overwritten): :func:`sofx.kernels.donation.unwritable`."""
    for path, g in zip(paths, grads):
        why = unwritable(path, g)
        if why is not None:
            raise SofxError(f"{what}: {why} (the mean is written into the gradients)")


def _check_keywords(what: str, unknown: dict[str, Any], known: Sequence[str]) -> None:
    """Refuse the keyword arguments a collective caught in ``**unknown``: a misspelt one on one rank is that
    rank's refusal, told to the others inside the collective, where Python's ``TypeError`` at the call left them
    waiting for it."""
    if unknown:
        names = ", ".join(map(repr, sorted(unknown)))
        raise SofxError(f"{what}: unknown keyword argument{'s' if len(unknown) > 1 else ''} {names}; it takes "
                        f"{', '.join(known)}")


def _no_data(x: torch.Tensor) -> str | None:
    """Why a collective cannot pack tensor ``x`` into a flat buffer (``None`` where it can): a meta tensor has no
    data, a sparse or other non-strided one has no flat view of its elements."""
    if x.layout != torch.strided:
        return f"a {x.layout} tensor; expected a dense (strided) one"
    if x.is_meta:
        return "a meta tensor, without data"
    return None


def _as_refusal(what: str, error: Exception) -> SofxError:
    """``error``, raised by this rank's check of its own input, as the refusal it raises after telling the others
    (a :class:`SofxError` as it is; anything else, an input the checks did not foresee, wrapped)."""
    if isinstance(error, SofxError):
        return error
    refusal = SofxError(f"{what}: this rank's input could not be read ({type(error).__name__}: {error})")
    refusal.__cause__ = error
    return refusal


def _buckets(owners: Sequence[int], templates: Sequence[Any]) -> dict[tuple[int, torch.dtype], list[int]]:
    """Positions grouped by (owner, dtype), in a fixed order (owner, then first position) on every rank."""
    out: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, (owner, t) in enumerate(zip(owners, templates)):
        out.setdefault((owner, t.dtype), []).append(i)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], kv[1][0])))


def shard_blocks(params: Any, group: Any = None, *, owners: Sequence[int] | None = None,
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
    tensor, bad owners, an unknown keyword), every rank raises naming the
    rank, or the first leaf that differs with each rank's dtype and shape.
    Unchecked, such shards step leaves of other shapes, or other leaves, side
    by side until a gather finds it (or, without one, never).
    """
    if (rank is not None and world_size is not None) or not is_ready():  # no process group to agree with
        _check_keywords("shard_blocks", unknown, _SHARD_KEYWORDS)
        if rank is None or world_size is None:
            if rank is not None or world_size is not None:
                raise SofxError("shard_blocks: pass both rank and world_size, or neither")
            require_initialized(group, "shard_blocks")
        return _build_shard(params, owners, rank, world_size)
    require_initialized(group, "shard_blocks")
    refused, shard = None, None
    try:
        _check_keywords("shard_blocks", unknown, _SHARD_KEYWORDS)
        if rank is not None or world_size is not None:
            raise SofxError("shard_blocks: pass both rank and world_size, or neither")
        shard = _build_shard(params, owners, dist.get_rank(group), dist.get_world_size(group))
    except Exception as e:  # told to the other ranks by the agreement, which they are waiting in
        refused = _as_refusal("shard_blocks", e)
    entries = {} if shard is None else _shard_entries(shard, params)
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
            raise SofxError(f"shard_blocks: {path} is a {type(x).__name__}; expected a tensor (a meta tensor "
                            "describes a leaf without its data)")
    # checked before they are used (int() took rank=0.5 as 0, world_size="2" as 2)
    world_size = integer("shard_blocks: world_size", world_size, 1, SofxError)
    rank = integer("shard_blocks: rank", rank, 0, SofxError)
    if owners is None:
        owners = partition_blocks([math.prod(x.shape) for x in leaves], world_size)
    bad = [o for o in owners if as_integer(o) is None]
    if bad:
        raise SofxError(f"shard_blocks: owners must be ranks (ints), got {bad[0]!r}")
    return Shard(rank, world_size, tuple(owners), spec)


def _shard_entries(shard: Shard, params: Any) -> dict[str, str]:
    """What the ranks' shards must agree in: every leaf's path with its dtype and shape, and the owners."""
    leaves = tree.flatten(params)[0]
    entries = {path: f"{x.dtype} {tuple(x.shape)}" for path, x in zip(tree.leaf_paths(shard.spec), leaves)}
    entries["owners"] = repr(shard.owners)
    return entries
