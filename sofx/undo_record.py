"""Undo records: what :meth:`sofx.Adam.update` returns so that the step can be inverted.

A record holds, per parameter leaf, the undo strategy chosen for it, the
gradient bits the step used, the step's scalars (hparams, ``t``,
gradient multiplier) and, where the strategy needs them, snapshots of the
pre-step values. Records are pytrees (registered with ``torch.utils._pytree``)
whose children are tensors only, so they can be returned from
``torch.func.vmap`` and traced by ``torch.compile``; Python numbers and the
strategy names travel as static context.

Strategies:

``"algebraic"``       nothing stored; ``p, m, v`` recomputed from ``p', m', v'``
``"param_snapshot"``  the old parameter is kept (low-precision masters,
                      ``lr*wd`` near 1, an L2-decay leaf's first step); the
                      moments are recomputed
``"snapshot"``        old ``p, m, v`` kept; restored bit for bit
``"chunk_snapshot"``  algebraic, but for the chunks of ``FINITE_CHUNK`` elements
                      (``chunks``: their indices) whose old ``p, m, v`` are kept,
                      one after the other, in ``p_old, m_old, v_old`` and restored
                      bit for bit: those a checked step flagged (an inf or a nan
                      in the gradient, or a spike an inverse would restore too
                      lossily there, see :mod:`sofx.skipped_chunks`)
``"none"``            the step cannot be undone (``reason`` says why)

``moments_were_zero`` marks the first step of a leaf from freshly initialised
(all-zero) moments: its undo restores those zeros exactly instead of the
ulp-sized leftovers an algebraic inverse leaves in L2 mode or with bfloat16
moments (float32 moments without L2 decay come back exactly 0 anyway:
:func:`sofx.kernels.base.zeros_come_back`), which a redo with a much smaller
gradient (a clipped first step) would magnify.

``owns_kept`` says whether a record's kept tensors are its own: no caller holds
them (copies made under donation, those an undo_redo made or took over from the
record it used, a chunk snapshot's gathered chunks). Where it is False they may
be its caller's (an update without donation keeps the params and moments passed
in, which that caller may reuse once the record is used): an undo_redo of the
record copies what it keeps of them, and takes over owned ones as they are
(nothing writes into a record's tensors, and the record it used cannot be used
again).

A record refers to tensors it does not copy: the gradient the step took (``grad``; read by every undo but a
``"snapshot"``'s, which is not checked) and, where its kept values are not its own, the caller's (``owns_kept``).
Each tensor's version (torch's count of the in-place writes to it, ``Tensor._version``) is taken when the record is
made, and an undo or undo_redo whose tensor was written in place since (a ``p.grad.zero_()``,
``zero_grad(set_to_none=False)``, the next backward accumulating into ``.grad``, a ``copy_`` into the params an
update without donation kept) is refused (:meth:`LeafUndo.changed_in_place`): it
would invert the step with the values written since, without a word. Not for tensors whose version is not theirs to
read (a ``torch.func`` transform's, an inference tensor's) nor under ``torch.compile``; a write through ``.data``
(which torch does not count) goes unseen.

A record can be used once, and so can every copy of it: whether a leaf's step was undone is state the
:class:`LeafUndo` shares with its copies (``copy.copy``; ``copy.deepcopy`` too, whose kept tensors are copies but
whose step is the same one; a pytree map or unflatten), and a record is used once any of its leaves is, so one
re-wrapped from another record's leaves (``UndoRecord(rec.leaves, ...)``) is used with it. A second undo of a step
would read kept tensors its first one handed back to the caller (an undo without donation returns a snapshot's kept
tensors as the restored values, which a donated update then writes into; an undo_redo's record takes over owned
ones), or invert a state stepped since with another gradient: wrong values, silently. For the same reason records
cannot be pickled (nor ``torch.save``-d): a loaded copy could not know whether its step was undone since.
"""

from __future__ import annotations

import copy
import numbers
import weakref
from typing import Any, Sequence

import optree
import torch
import torch.utils._pytree as torch_pytree

from sofx import tree
from sofx.errors import UndoError
from sofx.kernels.base import FINITE_CHUNK, AdamScalars, AdamVariant
from sofx.kernels.chunked import listed_elements

STRATEGIES = ("algebraic", "param_snapshot", "snapshot", "chunk_snapshot", "none")

# Why a record keeps snapshots (``LeafUndo.reason``): the gradient, or the inverse's precision.
NOT_FINITE_REASON = "the gradient is not finite, or so large that its square could overflow (see GRADIENT_LIMIT)"
LOSSY_REASON = ("the gradient dominates the second moment somewhere (a spike, a rarely updated row): an algebraic "
                "inverse would restore it less exactly than 1e-6 (see sofx.kernels.base.lossy_factor)")
#: A checked step's flagged chunks: either.
CHECKED_CHUNKS_REASON = f"{NOT_FINITE_REASON}, or {LOSSY_REASON}"


def strategy_snapshot_bytes(strategy: str, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> int:
    """Bytes a leaf's record of ``strategy`` keeps (its :meth:`LeafUndo.snapshot_bytes`): ``p`` for a
    ``"param_snapshot"``, ``p, m, v`` for a ``"snapshot"``, nothing otherwise."""
    if strategy == "snapshot":
        return sum(t.numel() * t.element_size() for t in (p, m, v))
    if strategy == "param_snapshot":
        return p.numel() * p.element_size()
    return 0


def chunk_snapshot_bytes(chunks: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> int:
    """Bytes a ``"chunk_snapshot"`` record keeps for the chunks ``chunks`` (ascending indices, int64) of a leaf
    (its :meth:`LeafUndo.snapshot_bytes`): their elements of ``p, m, v`` and one int64 index per chunk."""
    elements = listed_elements(chunks, p.numel())
    return elements * (p.element_size() + m.element_size() + v.element_size()) + 8 * chunks.numel()


_TENSOR_FIELDS = ("grad", "count_before", "p_old", "m_old", "v_old", "chunks")

# The fields whose tensors' versions a record takes (LeafUndo._versions, in this order), and how a refusal names them.
_VERSIONED = {"grad": "the gradient the step took", "p_old": "the old parameter the record keeps",
              "m_old": "the old first moment the record keeps", "v_old": "the old second moment the record keeps",
              "chunks": "the indices of the chunks the record keeps",
              "count_before": "the step count tensor of the state the step was taken from"}
_CHANGED_HINT = {
    "grad": ("its undo would invert the step with the values written since; a p.grad.zero_(), an optimizer's "
             "zero_grad(set_to_none=False), the next backward accumulating into .grad or an in-place clip_grad_norm_ "
             "writes it: undo before that, set .grad to None instead, or give update a gradient nothing writes (a "
             "clone); to redo the step clipped or unscaled, pass undo_redo a grad_scale"),
    "kept": ("its undo would restore the values written since; the record of an update without donation keeps the "
             "params and moments passed in, not copies: leave them unchanged while the record may be undone (copy "
             "the new values elsewhere), or update with donate=True (its record keeps copies)"),
    "count_before": ("its undo would return the count written since as the state's count (not the step's count "
                     "before it); the record keeps the old state's count tensor, not a copy: leave it unchanged while "
                     "the record may be undone (make a new count instead: state.count + 1, not += 1)"),
}

_NOT_PICKLED = ("cannot be pickled (pickle, torch.save): a loaded copy could not know whether its step was "
                "undone since, and would undo it a second time; undo the step or drop the record before saving "
                "(copies in memory, copy.copy and copy.deepcopy, share whether it was used)")


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def tensor_version(t: Any) -> int | None:
    """``t._version`` (torch's count of the in-place writes to ``t``'s memory through it or a view of it), or None
    where ``t`` has none to read: not a tensor, a tensor of a ``torch.func`` transform (vmap, grad: its wrapper's,
    not the values'), an inference tensor (which keeps none). The caller asks ``torch.compiler.is_compiling()``
    (under ``torch.compile`` none is read)."""
    if t is None or not isinstance(t, torch.Tensor) or _wrapped(t) or t.is_inference():
        return None
    return t._version


class _FlatVersions:
    """A flattened :class:`LeafUndo`'s versions (``LeafUndo._versions``) with weak references to the tensors they
    are of, for its unflatten: a version is kept for a child that is the very tensor (an identity map, a
    flatten and unflatten), not for another (a tree_map to clones, a transform's output: unchecked there, as a new
    tensor's version tells nothing of the record's). Any two are equal (a pytree context): the versions are no part
    of a record's structure, and records of one layout whose tensors were written a different number of times
    before their steps are one structure (a tree_map over both; its output keeps the first tree's versions for
    that tree's very tensors)."""

    __slots__ = ("versions", "refs")

    def __init__(self, versions: tuple[int | None, ...], tensors: Sequence[Any]) -> None:
        self.versions = versions
        self.refs = tuple(None if v is None else weakref.ref(t) for v, t in zip(versions, tensors))

    def of(self, tensors: Sequence[Any]) -> tuple[int | None, ...]:
        """The versions of ``tensors`` (the unflattened leaf's) that are those flattened."""
        return tuple(None if r is None or r() is not t else v for v, r, t in zip(self.versions, self.refs, tensors))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _FlatVersions)

    def __hash__(self) -> int:
        return hash(_FlatVersions)

    def __repr__(self) -> str:
        return f"_FlatVersions({self.versions})"


class _UsedOnce:
    """Copies (``copy.copy``, ``copy.deepcopy``) share the used state (``_used``) of the original, their other
    fields shared or deep-copied; pickling is refused (:data:`_NOT_PICKLED`). ``_what``: the class, as errors
    name it."""

    __slots__ = ()
    _what = "a record"

    def __copy__(self) -> Any:
        return self._copied(None)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self._copied(memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UndoError(f"{self._what} {_NOT_PICKLED}")

    def _copied(self, memo: dict[int, Any] | None) -> Any:
        new = type(self).__new__(type(self))
        if memo is not None:
            memo[id(self)] = new
        for field in type(self).__slots__:
            value = getattr(self, field)
            setattr(new, field, value if memo is None or field == "_used" else copy.deepcopy(value, memo))
        return new


class LeafUndo(_UsedOnce):
    """How to undo the step of one leaf.

    ``count_before`` is the step count tensor of the state the step was taken from, not a copy (an undo
    returns it as the state's count; an undo_redo's record keeps it). That is safe because nothing in sofx
    writes a count tensor in place: ``update``/``undo``/``undo_redo`` make new counts even with donation
    (which covers the params and moments only), the offload engine passes Adam clones of its block counts
    (``set_param_state``, ``reset_state`` and ``load_state_dict`` write the block counts, never those), and
    checkpoint loads and imports make new tensors. A caller writing into that count tensor by hand while the
    record may still be undone (``count[...] += 1``, ``zero_()``: the undo returned the count written since, without
    a word) has the undo refused, as for the tensors below.

    ``owns_kept``: whether ``p_old, m_old, v_old`` are the record's own (see the module docstring; False, the
    default, is always safe: an undo_redo of the record then copies what its new record keeps of them).

    The versions of ``grad, p_old, m_old, v_old, chunks, count_before`` (``Tensor._version``) are taken when the
    record is made (the library takes them again after its own writes into a record's kept values:
    :meth:`note_versions`); an undo or undo_redo of a record whose tensor was written in place since is refused,
    an :class:`~sofx.errors.UndoError` naming the leaf and the tensor, before anything is written
    (:meth:`changed_in_place`; see the module docstring). A copy shares them (``copy.copy``), a deep copy carries
    what was written before it into its own tensors' versions, a pytree unflatten keeps them for the very tensors
    flattened.

    Whether the step was undone (``used``) is shared with every copy (see the module docstring). A LeafUndo
    built here is a new record of its step: one built from another record's tensors could undo that step a
    second time; re-wrap a record's own LeafUndo objects (or copies of them) instead. Fields no step makes (an
    unknown strategy, a gradient or count that is not a tensor, scalars that are not :class:`AdamScalars`) are
    refused when made, an :class:`~sofx.errors.UndoError` naming the field.
    """

    __slots__ = ("strategy", "grad", "scalars", "count_before", "p_old", "m_old", "v_old", "reason",
                 "moments_were_zero", "chunks", "owns_kept", "_layout", "_used", "_versions")
    _what = "a LeafUndo"

    def __init__(self, strategy: str, grad: torch.Tensor, scalars: AdamScalars, count_before: torch.Tensor,
                 p_old: torch.Tensor | None = None, m_old: torch.Tensor | None = None,
                 v_old: torch.Tensor | None = None, reason: str = "", moments_were_zero: bool = False,
                 chunks: torch.Tensor | None = None, owns_kept: bool = False) -> None:
        _check_fields(strategy, grad, scalars, count_before, (p_old, m_old, v_old, chunks))
        self._assign(strategy, grad, scalars, count_before, p_old, m_old, v_old, reason, moments_were_zero, chunks,
                     owns_kept)
        self._used = [False]
        self.note_versions()

    def _assign(self, strategy: str, grad: Any, scalars: AdamScalars, count_before: Any, p_old: Any, m_old: Any,
                v_old: Any, reason: str, moments_were_zero: bool, chunks: Any, owns_kept: bool) -> None:
        self.strategy = strategy
        self.grad = grad
        self.scalars = scalars
        self.count_before = count_before
        self.p_old = p_old
        self.m_old = m_old
        self.v_old = v_old
        self.reason = reason
        self.moments_were_zero = moments_were_zero
        self.chunks = chunks  # chunk_snapshot: the int64 indices of the kept chunks (ascending)
        self.owns_kept = owns_kept  # p_old, m_old, v_old are no caller's tensors
        # Which fields are pytree children (tensors); fixed once made, so that the
        # structure survives an unflatten with non-tensor leaves (torch.func does that).
        self._layout: tuple[bool, ...] | None = None
        # The versions of the _VERSIONED fields' tensors when the record was made (None: not taken, torch.compile).
        self._versions: tuple[int | None, ...] | None = None

    def note_versions(self) -> None:
        """Take the versions of the record's tensors as they are now: when it is made, and where the library
        itself writes into a record's kept values after making it (:mod:`sofx.skipped_chunks` copies the old
        values of a checked step's flagged chunks out into them), never for a write of its caller's."""
        # (under torch.compile none is read: no graph break. The fields spelt out: this runs for every leaf of
        # every step, ~1 us)
        self._versions = None if torch.compiler.is_compiling() else (
            tensor_version(self.grad), tensor_version(self.p_old), tensor_version(self.m_old),
            tensor_version(self.v_old), tensor_version(self.chunks), tensor_version(self.count_before))

    def changed_in_place(self) -> str | None:
        """Why an undo of this record is refused, or None: the first of its tensors written in place since the
        record was made (its version moved; see :meth:`note_versions`), named, with both versions. Not under
        ``torch.compile``, nor for a tensor whose version was not taken or cannot be read now, nor for the gradient
        of a ``"snapshot"`` (its undo restores the kept values and its undo_redo steps from them: neither reads it)."""
        if self._versions is None or torch.compiler.is_compiling():
            return None
        for (field, what), was in zip(_VERSIONED.items(), self._versions):  # (in note_versions' order)
            if field == "grad" and self.strategy == "snapshot":
                continue
            now = None if was is None else tensor_version(getattr(self, field))
            if now is not None and now != was:
                hint = _CHANGED_HINT[field if field in ("grad", "count_before") else "kept"]
                return (f"{what} was changed in place since the step (its version {now}, {was} at the step): "
                        f"{hint}")
        return None

    def _copied(self, memo: dict[int, Any] | None) -> Any:
        new = super()._copied(memo)
        if memo is not None and self._versions is not None:
            # A deep copy's tensors are new, of their own versions: what was written into this record's before the
            # copy is carried into the copy's (its own versions less the writes since the record was made).
            shifted = []
            for field, was in zip(_VERSIONED, self._versions):
                now, theirs = tensor_version(getattr(self, field)), tensor_version(getattr(new, field))
                shifted.append(None if was is None or now is None or theirs is None else theirs - (now - was))
            new._versions = tuple(shifted)
        return new

    @property
    def step(self) -> Any:
        """``t`` of the step this record undoes."""
        return self.scalars.step

    @property
    def used(self) -> bool:
        """True once the step was undone (by a record holding this leaf or a copy of it)."""
        return self._used[0]

    def snapshot_bytes(self) -> int:
        """Bytes held by the snapshots of this leaf (0 for an algebraic undo; a chunk_snapshot's indices
        included)."""
        return sum(t.numel() * t.element_size() for t in (self.p_old, self.m_old, self.v_old, self.chunks)
                   if t is not None)

    def __repr__(self) -> str:
        return f"LeafUndo({self.strategy}, t={self.scalars.step}{', ' + self.reason if self.reason else ''})"


def _check_fields(strategy: Any, grad: Any, scalars: Any, count_before: Any, kept: Sequence[Any]) -> None:
    """Refuse :class:`LeafUndo` fields that no step makes, an :class:`UndoError` naming the field (a None gradient
    or a tuple of scalars failed deep in undo, a None ``count_before`` was restored as the state's count)."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise UndoError(f"LeafUndo: strategy: expected one of {STRATEGIES}, got {strategy!r:.60}")
    if not isinstance(grad, torch.Tensor):
        raise UndoError(f"LeafUndo: grad: expected a tensor (the step's gradient), got {type(grad).__name__}")
    if not isinstance(scalars, AdamScalars):
        raise UndoError(f"LeafUndo: scalars: expected a sofx.AdamScalars (the step's), got {type(scalars).__name__}")
    # (a Python int where a transform rebuilt the step's record with numbers, which undo takes: its redo's too)
    if not (isinstance(count_before, torch.Tensor)
            or (isinstance(count_before, numbers.Integral) and not isinstance(count_before, bool))):
        raise UndoError("LeafUndo: count_before: expected a tensor or an int (the step count before the step), got "
                        f"{type(count_before).__name__}")
    for name, t in zip(("p_old", "m_old", "v_old", "chunks"), kept):
        if t is not None and not isinstance(t, torch.Tensor):
            raise UndoError(f"LeafUndo: {name}: expected a tensor or None, got {type(t).__name__}")
    if (strategy == "chunk_snapshot") != (kept[3] is not None):
        raise UndoError(f"LeafUndo: chunks: a chunk_snapshot record, and only one, has the indices of its kept "
                        f"chunks (strategy {strategy!r}, chunks {'given' if kept[3] is not None else 'None'})")


def _flatten_leaf(leaf: LeafUndo) -> tuple[list[Any], Any]:
    values = [getattr(leaf, f) for f in _TENSOR_FIELDS] + list(leaf.scalars)
    is_tensor = leaf._layout or tuple(isinstance(x, torch.Tensor) for x in values)
    children = [x for x, t in zip(values, is_tensor) if t]
    static = tuple(None if t else x for x, t in zip(values, is_tensor))
    versions = None if leaf._versions is None or torch.compiler.is_compiling() else \
        _FlatVersions(leaf._versions, [getattr(leaf, f) for f in _VERSIONED])
    return children, (leaf.strategy, leaf.reason, leaf.moments_were_zero, leaf.owns_kept, is_tensor, static,
                      leaf._used, versions)


def _unflatten_leaf(children: Sequence[Any], context: Any) -> LeafUndo:
    strategy, reason, moments_were_zero, owns_kept, is_tensor, static, used, versions = context
    it = iter(children)
    values = [next(it) if t else s for t, s in zip(is_tensor, static)]
    n = len(_TENSOR_FIELDS)
    fields = dict(zip(_TENSOR_FIELDS, values[:n]))
    # Not checked as the constructor checks: a transform may unflatten any values in place of the tensors
    # (tree_map to None, say), a chunk snapshot's indices included.
    leaf = LeafUndo.__new__(LeafUndo)
    leaf._assign(strategy, scalars=AdamScalars(*values[n:]), reason=reason, moments_were_zero=moments_were_zero,
                 owns_kept=owns_kept, **fields)
    leaf._layout = is_tensor
    leaf._used = used  # the step's, shared
    # (the versions of the very tensors flattened; none for others: a new tensor's tells nothing of the record's)
    leaf._versions = None if versions is None else versions.of([fields[f] for f in _VERSIONED])
    return leaf


class UndoRecord(_UsedOnce):
    """The undo record of one :meth:`update` over a whole params tree.

    ``leaves[i]`` is the :class:`LeafUndo` of leaf ``i`` (``None`` where the
    leaf had no gradient and was not stepped). ``spec``: the structure of
    the params tree it undoes. ``block``: the speculation layer's block whose
    speculative step this is (set by :func:`sofx.speculate.speculative_block_step`,
    which :func:`sofx.speculate.apply_block_action` checks against its action's block),
    else ``None``; ``context_id``: that of its decision's step (checked against its action's likewise);
    ``param_ptrs``: the sorted data pointers of the params the speculative step left (``None`` where one cannot be
    read, a tensor of a ``torch.func`` transform), which ``apply_block_action`` checks against the params it is given.
    ``variant``: the stepping optimizer's (decoupled decay, bias correction), which the inverse must
    share (a spec that is not one, or of another number of leaves, is refused when made, an
    :class:`~sofx.errors.UndoError`). A record can be used once: it is used once any of its leaves is,
    so a record re-wrapped from another's leaves, or a copy of one, is used
    with it (see the module docstring).
    """

    __slots__ = ("leaves", "spec", "variant", "block", "context_id", "param_ptrs", "_used")
    _what = "an UndoRecord"

    def __init__(self, leaves: Sequence[LeafUndo | None], spec: Any, variant: AdamVariant) -> None:
        if not isinstance(variant, AdamVariant):
            raise UndoError(f"variant: expected an AdamVariant, got {type(variant).__name__} (whether a leaf's kept "
                            "tensors are the record's own is its LeafUndo.owns_kept; a record takes no 'donated')")
        try:
            self.leaves = tuple(leaves)
        except TypeError:  # (None, a LeafUndo alone: Python's bare "'NoneType' object is not iterable")
            raise UndoError(f"leaves: expected a sequence of LeafUndo (or None), one per leaf of the params, got "
                            f"{type(leaves).__name__}") from None
        for i, leaf in enumerate(self.leaves):
            if leaf is not None and not isinstance(leaf, LeafUndo):
                raise UndoError(f"leaves[{i}]: expected a LeafUndo or None, got {type(leaf).__name__}")
        if not tree._is_treespec(spec):  # (None: its undo ran as an update, without the structure check)
            raise UndoError(f"spec: expected the structure of the params (an optree PyTreeSpec), got "
                            f"{type(spec).__name__}")
        if isinstance(spec, optree.PyTreeSpec) and spec.num_leaves != len(self.leaves):
            raise UndoError(f"spec has {spec.num_leaves} leaves, the record {len(self.leaves)}: one LeafUndo (or "
                            "None) per leaf of the params")
        self.spec = spec
        self.variant = variant
        self.block: int | None = None
        self.context_id: int | None = None
        self.param_ptrs: tuple[int, ...] | None = None
        self._used = [False]

    @property
    def used(self) -> bool:
        """True once the record, a copy of it, or a record holding one of its leaves has been undone."""
        return self._used[0] or any(leaf.used for leaf in self.leaves if leaf is not None)

    def mark_used(self) -> None:
        """Mark the record and its leaves consumed (by an undo or undo+redo): a second use of the record, of
        a copy, or of a record re-wrapped from its leaves raises :class:`UndoError`."""
        self._used[0] = True
        for leaf in self.leaves:
            if leaf is not None:
                leaf._used[0] = True

    def laid_out_as(self, spec: Any) -> "UndoRecord":
        """This record for params of structure ``spec``, which is its own but for mappings of another dict type or
        key order (:func:`sofx.tree.leaf_order_by_key`): its leaves in ``spec``'s order, whether it was used
        shared with this record (an undo of it uses this one). Itself where ``spec`` is its own or another
        structure (an undo refuses that, naming the difference)."""
        order = tree.leaf_order_by_key(self.spec, spec)
        if order is None:
            return self
        view = UndoRecord.__new__(UndoRecord)
        view.leaves = tuple(self.leaves[j] for j in order)
        view.spec, view.variant, view.block, view.context_id = spec, self.variant, self.block, self.context_id
        view.param_ptrs = self.param_ptrs
        view._used = self._used  # the record's, shared
        return view

    def strategies(self) -> list[str | None]:
        """The strategy of every leaf (``None`` for leaves that were not stepped)."""
        return [None if leaf is None else leaf.strategy for leaf in self.leaves]

    def snapshot_bytes(self) -> int:
        """Bytes of snapshot memory this record holds."""
        return sum(leaf.snapshot_bytes() for leaf in self.leaves if leaf is not None)

    def __repr__(self) -> str:
        return f"UndoRecord({list(self.leaves)}, used={self.used})"


def _flatten_record(rec: UndoRecord) -> tuple[list[Any], Any]:
    # Leaves that were not stepped (None) travel in the context: a None child is a pytree leaf that
    # torch.func.vmap refuses to return.
    present = tuple(leaf is not None for leaf in rec.leaves)
    return [leaf for leaf in rec.leaves if leaf is not None], (rec.spec, rec.variant, rec._used, present, rec.block,
                                                               rec.context_id, rec.param_ptrs)


def _unflatten_record(children: Sequence[Any], context: Any) -> UndoRecord:
    spec, variant, used, present, block, context_id, param_ptrs = context
    it = iter(children)
    # Not checked as the constructor checks (as a leaf's record: a transform may unflatten any values).
    rec = UndoRecord.__new__(UndoRecord)
    rec.leaves = tuple(next(it) if has else None for has in present)
    rec.spec, rec.variant, rec.block, rec.context_id, rec.param_ptrs = spec, variant, block, context_id, param_ptrs
    rec._used = used  # the record's, shared
    return rec


torch_pytree.register_pytree_node(LeafUndo, _flatten_leaf, _unflatten_leaf,
                                  serialized_type_name="sofx.LeafUndo")
torch_pytree.register_pytree_node(UndoRecord, _flatten_record, _unflatten_record,
                                  serialized_type_name="sofx.UndoRecord")
