"""Skipping the optimizer steps whose gradients are not finite: optax's ``apply_if_finite`` over a sofx optimizer.

``opt = apply_if_finite(sofx.adamw(), max_consecutive_errors=5)`` is an optimizer with ``init``, ``update`` and
``undo`` as :class:`sofx.Adam`'s whose step leaves the params and the inner state as they are where a gradient
holds an inf or a nan, counting those steps (:class:`ApplyIfFiniteState`); the rule is :func:`apply_if_finite`'s.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch

from sofx import tree
from sofx.adam import Adam, AdamState, validate_grads_finite
from sofx.errors import LeafError, SofxError, UndoError, UnsupportedError
from sofx.kernels.base import is_traced, vmapped
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.kernels.user_numbers import flag, integer, is_bool
from sofx.transforms import GradientTransformation, _check_state
from sofx.undo_record import UndoRecord

__all__ = ["ApplyIfFiniteState", "ApplyIfFiniteRecord", "ApplyIfFinite", "apply_if_finite"]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`: optax's counters and the inner optimizer's state.

    ``notfinite_count``: consecutive steps whose gradients had an inf or a nan (0 after a finite one);
    ``last_finite``: whether the last step's gradients were all finite; ``total_notfinite``: steps with a
    non-finite gradient since ``init``, never reset; ``inner_state``: the wrapped optimizer's state, advanced
    only by the steps that were applied. The counters are 0-d tensors (int64, int64, bool), so that the state
    can be ``vmap``-ped over an ensemble (per member) and saved as the inner state is.
    """

    notfinite_count: Any
    last_finite: Any
    total_notfinite: Any
    inner_state: Any


class ApplyIfFiniteRecord(NamedTuple):
    """The undo record of one :meth:`ApplyIfFinite.update`.

    ``inner``: the wrapped optimizer's record (of no leaf where an eager step was skipped: its undo changes
    nothing). ``applied``: whether the inner step was applied, a 0-d bool tensor (so that the record can come
    back from ``vmap`` as a whole); one whose value could not be read (``vmap``: per member; ``compile``) was
    the inner step taken for every member and selected. The three counters are those of the state before the
    step, which the undo restores.
    """

    inner: UndoRecord
    applied: Any
    notfinite_count: Any
    last_finite: Any
    total_notfinite: Any


class ApplyIfFinite:
    """An optimizer that skips the steps whose gradients are not finite: optax's ``apply_if_finite`` over a
    sofx optimizer. Build it with :func:`apply_if_finite`, which documents the rule.

    ``init(params) -> ApplyIfFiniteState``, ``update(params, grads, state, hparams) -> (params, state,
    record)`` and ``undo(params, state, record) -> (params, state)``, as :class:`~sofx.Adam`'s, whose keyword
    options they take and pass on.
    """

    def __init__(self, inner: Adam, max_consecutive_errors: int) -> None:
        self.inner = inner
        self.max_consecutive_errors = max_consecutive_errors

    def __repr__(self) -> str:
        return f"sofx.apply_if_finite({self.inner!r}, max_consecutive_errors={self.max_consecutive_errors})"

    def init(self, params: Any) -> ApplyIfFiniteState:
        """No non-finite step yet (``last_finite`` True) and the inner optimizer's fresh state."""
        inner_state = self.inner.init(params)
        zero = torch.zeros((), dtype=torch.int64)
        return ApplyIfFiniteState(zero, torch.ones((), dtype=torch.bool), zero.clone(), inner_state)

    def update(self, params: Any, grads: Any, state: ApplyIfFiniteState, hparams: Any = None, *,
               grad_scale: Any = 1.0, donate: bool = False, grads_finite: bool | None = None,
               param_copies: Any = None, undoable: bool = True,
               snapshot_limit_bytes: int | None = None) -> tuple[Any, ApplyIfFiniteState, ApplyIfFiniteRecord]:
        """The inner optimizer's step where the gradients are finite (or after too many skips in a row), else
        ``params`` and the inner state as they are; the counters updated either way (see :func:`apply_if_finite`).

        The keyword options are :meth:`sofx.Adam.update`'s. ``grads_finite=True`` is the caller's word that
        every gradient is finite: no gradient is read, the step is applied. A skipped step checks its inputs as
        the inner step would and raises the same errors; its ``param_copies`` receive the unchanged parameters.
        Where the decision cannot be read on the host (``vmap``: one per member; ``compile``) the inner step is
        taken and its results selected per member with ``torch.where``; there ``donate`` is not used (a
        skipped member keeps its inputs) and ``param_copies`` is refused."""
        donate = flag("apply_if_finite: donate", donate, UnsupportedError)
        grads_finite = validate_grads_finite(grads_finite)  # (the inner update's reading: a numpy or 0-d tensor bool)
        before = _finite_counters(state, params)
        finite = True if grads_finite is True else _grads_all_finite(grads)
        opts = dict(grad_scale=grad_scale, grads_finite=grads_finite, undoable=undoable,
                    snapshot_limit_bytes=snapshot_limit_bytes)
        if not all(_readable(x) for x in (finite, *before)):
            return self._update_selected(params, grads, state, hparams, before, finite, param_copies, opts)
        finite = bool(finite)
        count = 0 if finite else min(int(before[0]) + 1, _COUNT_MAX)  # (saturating, as optax's safe_increment)
        total = min(int(before[2]) + (0 if finite else 1), _COUNT_MAX)
        applied = finite or count > self.max_consecutive_errors
        if applied:
            new_params, inner_state, rec = self.inner.update(params, grads, state.inner_state, hparams,
                                                             donate=donate, param_copies=param_copies, **opts)
        else:  # skipped: checked as the step would be; a step of no gradient changes nothing, and its record neither
            self.inner.check_inputs(params, grads, state.inner_state, hparams, donate=donate,
                                    param_copies=param_copies)
            new_params, inner_state, rec = self.inner.update(params, None, state.inner_state, hparams,
                                                             donate=donate, param_copies=param_copies, **opts)
        counters = (torch.tensor(count, dtype=torch.int64), torch.tensor(finite),
                    torch.tensor(total, dtype=torch.int64))
        return (new_params, ApplyIfFiniteState(*counters, inner_state),
                ApplyIfFiniteRecord(rec, torch.tensor(applied), *before))

    def _update_selected(self, params: Any, grads: Any, state: ApplyIfFiniteState, hparams: Any,
                         before: tuple[Any, Any, Any], finite: Any, param_copies: Any,
                         opts: dict[str, Any]) -> tuple[Any, ApplyIfFiniteState, ApplyIfFiniteRecord]:
        """:meth:`update` where the decision is a tensor whose value cannot be read: the inner step taken,
        then ``torch.where(applied, stepped, old)`` for every leaf of the params and the inner state."""
        if param_copies is not None:
            raise UnsupportedError("apply_if_finite: param_copies cannot be given where the decision to apply the step "
                                   "cannot be read (vmap, compile): a skipped member's copy would receive the step")
        finite = torch.as_tensor(finite, dtype=torch.bool)
        count, _, total = before
        count = torch.where(finite, torch.zeros_like(torch.as_tensor(count)), _incremented(count))
        total = torch.where(finite, torch.as_tensor(total), _incremented(total))
        applied = finite | (count > self.max_consecutive_errors)
        # A skipped member's inner step runs on zeros: on its inf/nan gradient the step's derivatives were nan,
        # which the backward of torch.where multiplied by 0 (nan) where the hypergradients are taken.
        safe = tree.tree_map(lambda g: torch.where(applied, g, torch.zeros_like(g)) if isinstance(g, torch.Tensor)
                             and g.is_floating_point() else g, grads) if grads is not None else None
        new_params, inner_state, rec = self.inner.update(params, safe, state.inner_state, hparams, donate=False,
                                                         **opts)
        return (_select(applied, new_params, params),
                ApplyIfFiniteState(count, finite, total, _select(applied, inner_state, state.inner_state)),
                ApplyIfFiniteRecord(rec, applied, *before))

    def undo(self, params: Any, state: ApplyIfFiniteState, record: ApplyIfFiniteRecord, *, donate: bool = False,
             param_copies: Any = None) -> tuple[Any, ApplyIfFiniteState]:
        """Invert the :meth:`update` that produced ``(params, state)`` and ``record``: the inner optimizer's
        undo where that step was applied (nothing changes where it was skipped), and the counters before it.

        A record can be used once, as the inner optimizer's (:class:`~sofx.errors.UndoError` naming why, changing
        nothing); ``donate`` and ``param_copies`` as in :meth:`sofx.Adam.undo`, but where the decision cannot be
        read (``vmap`` of the step's per-member decision, ``compile``): there the inner undo is selected per member
        with ``torch.where``, ``donate`` is not used and ``param_copies`` refused."""
        donate = flag("apply_if_finite: donate", donate, UnsupportedError)
        if not isinstance(record, ApplyIfFiniteRecord):
            raise UndoError(f"apply_if_finite: expected an ApplyIfFiniteRecord (what its update returns), got "
                            f"{type(record).__name__}")
        counters = _finite_counters(state, params)
        if not (isinstance(record.inner, UndoRecord) and record.inner.used):  # (a second undo: the inner one says so)
            _check_counters_left(record, counters)
        if not is_traced(record.applied):  # a skipped step's inner record is of no leaf: its undo changes nothing
            new_params, inner_state = self.inner.undo(params, state.inner_state, record.inner, donate=donate,
                                                      param_copies=param_copies)
        elif param_copies is not None:
            raise UnsupportedError("apply_if_finite: param_copies cannot be given to the undo of a step whose decision "
                                   "cannot be read (vmap, compile): a skipped member's copy would receive the undo")
        else:
            back, inner_back = self.inner.undo(params, state.inner_state, record.inner)
            new_params = _select(record.applied, back, params)
            inner_state = _select(record.applied, inner_back, state.inner_state)
        return new_params, ApplyIfFiniteState(record.notfinite_count, record.last_finite, record.total_notfinite,
                                              inner_state)


def apply_if_finite(inner: Adam, max_consecutive_errors: int) -> ApplyIfFinite:
    """Wrap the optimizer ``inner`` (:func:`sofx.adam`, :func:`sofx.adamw`) so that a step whose gradients hold an
    inf or a nan is skipped, as optax's ``apply_if_finite``; after ``max_consecutive_errors`` skips in a row the
    next non-finite step is applied anyway.

    Per step, with ``f`` = every element of every gradient finite (the gradients as given, before the inner
    step's ``grad_scale``; ``None`` leaves have none) and ``N`` = ``max_consecutive_errors``::

        notfinite_count <- 0 if f else notfinite_count + 1
        total_notfinite <- total_notfinite + (0 if f else 1)
        last_finite     <- f
        applied          = f or notfinite_count > N      (the new count)
        params, inner   <- inner.update(...) if applied else (params, inner)

    (the counts saturating at int64's largest value, as optax's ``safe_increment``).

    A skipped step leaves the params and the inner state (moments, step counts) bitwise as they were and its
    undo changes nothing; an applied one is the inner step, bit for bit, and its undo the inner undo. Either
    undo restores the counters. ``N = 0`` applies every step (a non-finite one too, as optax). The decision is
    a Python bool where it can be read; under ``torch.func.vmap`` it is a tensor, one per ensemble member,
    and the step is selected with ``torch.where`` (no branch on a traced value).

    ``max_consecutive_errors``: an integer >= 0 (a Python or numpy integer, or a 1-element integer tensor);
    anything else is refused with an :class:`HParamError` naming the value. ``inner`` must be a
    :class:`sofx.Adam`, else an :class:`UnsupportedError`. The serial and speculative loops take a
    :class:`sofx.Adam` and skip a non-finite step themselves (their loss scaler); this wrapper is for
    functional loops that call ``update`` themselves.
    """
    if not isinstance(inner, Adam):
        what = ("a GradientTransformation: wrap the optimizer instead (sofx.adamw(...)), whose state a skipped "
                "step must keep, and apply the transformation to the gradients before its update"
                if isinstance(inner, GradientTransformation) else tree.article(type(inner).__name__))
        raise UnsupportedError(f"apply_if_finite: inner is {what}; expected a sofx optimizer (sofx.adam(...) or "
                               "sofx.adamw(...))")
    n = integer("apply_if_finite: max_consecutive_errors", max_consecutive_errors, 0)
    return ApplyIfFinite(inner, n)


def _readable(x: Any) -> bool:
    """Whether the decision (or a counter) ``x`` can be read on the host: not traced (:func:`is_traced`), or traced
    only by ``torch.func.grad``/autograd, where torch reads a value (a bool or a count carries no gradient). Not while
    ``torch.compile`` traces (reading is a graph break) nor under ``vmap`` (a value per member). (Selecting with
    ``torch.where`` under ``grad`` gave a nan derivative through a skipped step: its nan gradient's step times 0.)"""
    if not is_traced(x):
        return True
    if torch.compiler.is_compiling() or x.is_meta:  # (a meta tensor holds no value)
        return False
    return not vmapped(x)


def _grads_all_finite(grads: Any) -> bool | torch.Tensor:
    """Whether every element of every floating-point leaf of ``grads`` is finite: a 0-d bool tensor (one read
    back where it is read), True without such a leaf. Other leaves are left to the inner optimizer to refuse; a
    leaf whose elements reach past the end of its storage (freed or shrunk: torch's test would read outside any
    allocation) is refused before any is read, a :class:`~sofx.errors.LeafError` naming its path
    (:func:`~sofx.kernels.storage.refuse_short_storage`), as the inner optimizer would; so is a nested tensor, and
    a meta leaf beside one with data (whose flags cannot be read together)."""
    all_leaves, spec = tree.flatten(grads)
    leaves = [g for g in all_leaves if isinstance(g, torch.Tensor) and g.is_floating_point()]
    if not leaves:
        return True
    if not torch.compiler.is_compiling():  # (no storage to check: Dynamo traces fake tensors)
        for i, g in enumerate(all_leaves):
            if isinstance(g, torch.Tensor) and g.is_floating_point() and g.is_nested:  # (torch.isfinite raised)
                raise LeafError(f"{tree.leaf_paths(spec, root='grads')[i]}: expected a dense (strided) tensor, got "
                                f"a nested tensor ({g.layout})")
            if isinstance(g, torch.Tensor) and g.is_floating_point() and not in_storage(g):
                refuse_short_storage(g, lambda: tree.leaf_paths(spec, root="grads")[i])
    meta = [g.is_meta for g in leaves]
    if any(meta) and not all(meta):  # (reading a meta flag raised torch's bare "Cannot copy out of meta tensor")
        paths = tree.leaf_paths(spec, root="grads")
        index = [i for i, g in enumerate(all_leaves) if isinstance(g, torch.Tensor) and g.is_floating_point()]
        m, d = meta.index(True), meta.index(False)
        raise LeafError(f"apply_if_finite: {paths[index[m]]} is a meta tensor, which holds no value, beside "
                        f"{paths[index[d]]} on {leaves[d].device}: whether the gradients are finite cannot be read; "
                        "give every gradient with its data (meta gradients go with meta params only)")
    flags = [torch.isfinite(g).all() for g in leaves]
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


def _finite_counters(state: Any, params: Any) -> tuple[Any, Any, Any]:
    """``(notfinite_count, last_finite, total_notfinite)`` of ``state``, checked: an :class:`ApplyIfFiniteState`
    whose counts are integers >= 0 and whose ``last_finite`` is a bool (Python values or 0-d tensors; a tensor
    whose value cannot be read, as ``vmap`` gives, of an integer or bool dtype; a meta one only where no leaf of
    ``params`` has data: it holds no value, and ``torch.where`` with those leaves raised a bare device mismatch);
    else a :class:`SofxError` naming the field (an ``inner_state`` that is no :class:`~sofx.AdamState`, a
    :class:`~sofx.errors.LeafError`, as the inner optimizer's refusal)."""
    _check_state("apply_if_finite", state, ApplyIfFiniteState, "apply_if_finite(opt).init(params)")
    if not isinstance(state.inner_state, AdamState):  # (the inner step's refusal named it "state", an AdamState)
        raise LeafError(f"apply_if_finite: state.inner_state is {tree.article(type(state.inner_state).__name__)}; "
                        "expected the inner optimizer's AdamState (apply_if_finite(opt).init(params) makes the state)")
    meta = [name for name in ("notfinite_count", "last_finite", "total_notfinite")
            if isinstance(getattr(state, name), torch.Tensor) and getattr(state, name).is_meta]
    if meta and not torch.compiler.is_compiling() and any(
            isinstance(p, torch.Tensor) and not p.is_meta for p in tree.flatten(params)[0]):
        raise SofxError(f"apply_if_finite: state.{meta[0]} is a meta tensor, which holds no value, beside params "
                        "with data (a state made by init under torch.device('meta')?); give the counters with their "
                        "values (meta counters go with meta params only)")
    for name in ("notfinite_count", "total_notfinite"):
        value = getattr(state, name)
        if isinstance(value, torch.Tensor) and is_traced(value):
            if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.dim() != 0:
                raise SofxError(f"apply_if_finite: state.{name} is a {value.dtype} tensor of shape "
                                f"{tuple(value.shape)}; expected a 0-d integer tensor")
        elif integer(f"apply_if_finite: state.{name}", value, 0, SofxError) > _COUNT_MAX:
            raise SofxError(f"apply_if_finite: state.{name} = {value!r:.80} is beyond int64's largest value, "
                            f"{_COUNT_MAX}, which the state stores its counters as (they saturate there)")
    last = state.last_finite
    ok = (isinstance(last, bool) or isinstance(last, torch.Tensor) and last.dtype == torch.bool
          and (last.numel() == 1 if not is_traced(last) else last.dim() == 0))
    if not ok:
        raise SofxError(f"apply_if_finite: state.last_finite = {last!r:.60} ({type(last).__name__}); expected a bool "
                        "or a 0-d bool tensor")
    return state.notfinite_count, last, state.total_notfinite


# The counters are stored as int64 (ApplyIfFiniteState): they saturate at its largest value, as optax's
# safe_increment (a count beyond it raised Python's overflow error, or wrapped to -2^63 under vmap).
_COUNT_MAX = torch.iinfo(torch.int64).max


def _incremented(count: Any) -> torch.Tensor:
    """``count + 1`` as a tensor, saturating at the largest value of its dtype (a readable or traced counter)."""
    count = torch.as_tensor(count)
    return torch.where(count == torch.iinfo(count.dtype).max, count, count + 1)


def _check_counters_left(record: ApplyIfFiniteRecord, counters: tuple[Any, Any, Any]) -> None:
    """Raise :class:`UndoError` where ``counters`` (the state's ``notfinite_count, last_finite, total_notfinite``)
    are not those the step of ``record`` left from its counters before, by the rule of :func:`apply_if_finite` (a
    skipped step's gradients were not finite; whether a non-finite one was applied depends on the
    ``max_consecutive_errors`` of the optimizer that stepped, not asked): the record does not belong to this state.
    A skipped step's inner record has no leaf whose step count the inner undo could compare, and an applied one's
    counts may agree with a later state's (a skipped step after it): undone, the counters went back to another
    step's, without a word.
    Not where a value cannot be read (``vmap``, ``compile``)."""
    values = (*counters, *record[1:])
    if any(isinstance(x, torch.Tensor) and (is_traced(x) or x.numel() != 1) for x in values):
        return
    count, last, total, applied, count0, _, total0 = (x.item() if isinstance(x, torch.Tensor) else x for x in values)
    # (Python or numpy integers, as update takes the counters and records them; a record made by hand: no counts)
    if not all(isinstance(x, numbers.Integral) and not is_bool(x) for x in (count0, total0)):
        raise UndoError(f"apply_if_finite: the record's counters (notfinite_count={count0!r:.40}, total_notfinite="
                        f"{total0!r:.40}) are not the counts of a step (integers, as update records them)")
    count0, total0 = int(count0), int(total0)
    want = (0, total0) if last else (min(count0 + 1, _COUNT_MAX), min(total0 + 1, _COUNT_MAX))
    if (count, total) == want and (bool(applied) or not last):
        return
    raise UndoError(f"apply_if_finite: the state's counters (notfinite_count={count}, last_finite={bool(last)}, "
                    f"total_notfinite={total}) are not those the record's step left (from notfinite_count={count0}, "
                    f"total_notfinite={total0}, the step {'applied' if applied else 'skipped'}): the record does not "
                    "belong to this state")


def _select(applied: torch.Tensor, new: Any, old: Any) -> Any:
    """``torch.where(applied, n, o)`` for every pair of leaves of two trees of one structure: ``old`` matched to
    ``new``'s as the optimizer matched it (:func:`sofx.tree.flatten_up_to`: a mapping of another dict type key by
    key, ``None`` for an empty subtree)."""
    leaves, spec = tree.flatten(new)
    olds = tree.flatten_up_to(spec, old, "state")
    return tree.unflatten(spec, [torch.where(applied, n, o) for n, o in zip(leaves, olds)])
