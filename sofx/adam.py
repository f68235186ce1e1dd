"""The Adam family as pure, undoable transforms over pytrees.

``sofx.adam(...)`` (L2 weight decay) and ``sofx.adamw(...)`` (decoupled weight
decay) return an :class:`Adam` with three pure functions::

    state = opt.init(params)                                  # AdamState(count, mu, nu)
    params, state, record = opt.update(params, grads, state, hparams)
    params, state = opt.undo(params, state, record)           # the state before update

Per element, for a leaf stepped for the ``t``-th time (``t`` counted per leaf,
from 1), with the hparams of that step (DESIGN.md "Numerics reference")::

    L2:        g <- g + wd * p                decoupled: p <- p * (1 - lr * wd)
    m <- b1 * m + (1 - b1) * g                v <- b2 * v + (1 - b2) * g^2
    p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

(without bias correction both ``1 - b^t`` are 1). This is ``torch.optim.Adam``
/ ``AdamW`` exactly, operation by operation.

Hyperparameters are data: an :class:`AdamHParams` (floats or 0-d tensors,
``None`` fields take the optimizer's defaults), or a pytree of them that is a
prefix of the params tree (param groups; ``None`` in it: the defaults for
that subtree). A ``None`` gradient leaf is not
stepped: its parameter, moments and count stay as they are.

Undo (SPECULATION.md section 2) is chosen per leaf and step by ``undo=``:
``"auto"`` (algebraic where sound, snapshots where not), ``"algebraic"``
(never snapshot; refuses the configurations where the inverse does not exist
or divides by less than ``ALGEBRAIC_MIN_DIVISOR``, 2^-12: a beta, ``1 - lr*wd``;
a leaf's step whose ``g * grad_scale``, or with L2 decay ``weight_decay * p``, is
not finite or beyond ``GRADIENT_LIMIT`` is taken, its record saying it cannot be undone)
or ``"exact"`` (always snapshot: bitwise identity). See :mod:`sofx.undo_record`.
Under ``torch.func`` transforms and ``torch.compile`` the hyperparameters'
(and ``grad_scale``'s) values cannot be read: ``"auto"`` keeps snapshots there, and ``"algebraic"``
checks only the dtypes, so a traced beta of 0 or ``lr * weight_decay`` of 1
(no inverse) gives an undo of nan where eager refuses it.

``donate=True`` lets ``update``/``undo`` write their results into the storage
of the params and state passed in (the caller must not use those inputs
again); by default nothing passed in is modified. The record keeps a
reference to the gradient tensors, and a snapshot of an update without
donation refers to the params and state passed in instead of copying them:
do not modify those in place while the record may still be undone.
"""

from __future__ import annotations

import collections.abc
import math
import numbers
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from sofx import memory_order_leaves, skipped_chunks, tree
from sofx.errors import HParamError, LeafError, SnapshotLimitError, StructureError, UndoError, UnsupportedError
from sofx.kernels import reference as reference_kernels
from sofx.kernels import check_backend_name, load_backend, select_backend
from sofx.kernels.base import (F32_ROUNDS_TO_0, FINITE_CHUNK, FLOAT32_MAX, GRADIENT_LIMIT, AdamScalars,
                               AdamVariant, MemoryOverlapError, Scalar, StepCall, UndoCall, UndoRedoCall, as_number,
                               calls_checked, is_number, is_numpy_real, is_traced, leaf_tracer, any_lossy,
                               storage_checked, write_param_copy, zeros_come_back)
from sofx.kernels.base import check_hparam_range
from sofx.kernels.base import check_step_size as kernel_check_step_size
from sofx.kernels.chunked import ascending_chunks, listed_elements
from sofx.kernels.layout import in_memory_order, is_dense, one_dense_layout, same_layout
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.kernels.user_numbers import _described, as_integer, fact_value, flag, integer, is_bool
from sofx.kernels.donation import MemorySpans, check_writable, overlap_message, shared_memory_message
from sofx.undo_record import LOSSY_REASON, NOT_FINITE_REASON, LeafUndo, UndoRecord, strategy_snapshot_bytes

__all__ = ["AdamHParams", "AdamState", "Adam", "adam", "adamw", "ALGEBRAIC_MIN_BETA", "ALGEBRAIC_MIN_DIVISOR",
           "check_hparam_value", "check_float32_range", "check_step_size", "TORCH_MATH_OPTIONS", "refused_torch_option",
           "TORCH_FLAG_OPTIONS", "torch_non_flag", "torch_flag_values", "torch_betas", "hparams_at",
           "validate_grads_finite"]

# Below this beta the algebraic inverse divides by a small number and loses
# more than float32 rounding; ``undo="auto"`` snapshots instead.
ALGEBRAIC_MIN_BETA = 0.5
# ``undo="algebraic"`` refuses a beta or a decay factor ``1 - lr*wd`` below this: the inverse divides by it,
# which multiplies float32's rounding by up to its inverse (2^12: half of float32's 24 bits lost), and 0 (a
# beta of 0 leaves no trace of the old moment) or a subnormal divisor turns it into inf or nan.
ALGEBRAIC_MIN_DIVISOR = 2.0 ** -12
# Decoupled decay: restoring p divides by (1 - lr*wd); below this the division
# amplifies rounding, and ``undo="auto"`` keeps a snapshot of the parameter.
ALGEBRAIC_MIN_DECAY_FACTOR = 0.5
# L2 decay, a leaf's first step (t = 1, from zero moments): its undo zeroes the moments exactly, but a redo from them
# (a clip, a loss scale or hparams changed) takes gh = g + wd * p from the recovered p, an ulp off, and its moments
# are made of that gh alone (no earlier v bounds the error, as base.py's lossy check bounds it on later steps):
# where g is near -wd * p (gh ~1e-3 of wd * p) they came back ~5e-5 off the serial step's element by element
# (without bound as gh goes to 0), and a leaf made of such elements up to 1e-4 of its largest (lr 1e-2..1e-1, wd
# 0.1..0.5: tests/test_l2_decay_trajectories.py). So ``undo="auto"`` keeps the parameter (``"param_snapshot"``, a
# copy of p on the first step only): its undo, and a redo from it, are then the serial loop's bits. Also where the
# step's own weight decay is 0 (a schedule starting at 0, a group's decay set between backward and step()): its redo,
# or the first step taken again after its undo (an overflow), may have a nonzero one, taking ``gh`` from an undone p
# (v 13% off element by element: tests/test_l2_first_step_interop.py).
L2_FIRST_STEP_REASON = ("L2 decay's first step: a redo from its zero moments takes gh = g + weight_decay * p from "
                        "the parameter (also where this step's weight decay is 0: the redo's may not be), which an "
                        "algebraic inverse restores only to an ulp")

# undo='algebraic', L2 decay: the parameter enters the step's effective gradient (see _decay_term_finite).
L2_PARAM_NOT_FINITE_REASON = ("L2 decay: the parameter is not finite, or so large that weight_decay * parameter could "
                              "overflow the second moment (see GRADIENT_LIMIT)")

_UNDO_MODES = ("auto", "algebraic", "exact")
_NOT_UNDOABLE = "stepped with undoable=False"
_INVERTED = ("algebraic", "param_snapshot")  # strategies whose undo inverts m and v (needs a finite gradient)
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class AdamHParams(NamedTuple):
    """Dynamic Adam hyperparameters, passed at every step (``None``: the optimizer's default): Python or numpy
    numbers (read as the Python numbers they hold) or 0-d tensors (read as the Python number they hold, where
    their value can be read: a step with ``lr=torch.tensor(1e-3)`` is ``torch.optim``'s with ``lr=float(that
    tensor)``, bit for bit; torch's for-loop Adam(W) given the tensor itself computes ``lr * weight_decay`` and
    ``lr / bias_correction1`` in float32 tensor arithmetic, and differs from its own float-lr step by that
    rounding, ~1e-7 relative per step; given a numpy float32 lr it does too, numpy keeping ``lr /
    bias_correction1`` in float32: an ulp or two from sofx's step in about half of 3-step runs, measured). A
    float16 lr, beta1, beta2 or weight_decay (numpy's, or a float16 or bfloat16 tensor) is refused: torch's
    for-loop and foreach AdamW compute in that precision with it (an lr * weight_decay below 2**-12 in float16
    leaves ``1 - lr * weight_decay`` at 1: no decay), its fused one in float64; an eps of these is taken as the
    number it holds, as torch adds it)."""

    lr: Scalar | None = None
    beta1: Scalar | None = None
    beta2: Scalar | None = None
    eps: Scalar | None = None
    weight_decay: Scalar | None = None


class AdamState(NamedTuple):
    """Adam's state: per-leaf step counts (0-d int64 tensors) and the two moments."""

    count: Any
    mu: Any
    nu: Any


_NO_HPARAMS = AdamHParams()  # a leaf whose group gives none: the optimizer's defaults


def _is_hparams(x: Any) -> bool:
    return isinstance(x, AdamHParams)


# How to give a step's hparams where a number or a schedule was given: the refusals of hparams_at
# (loop steps) and of the steps that take one step's hparams (check_step_hparams).
WRAP_HINT = ("a schedule of one number (lr, beta1, beta2, eps or weight_decay) is wrapped into hparams with "
             "sofx.schedules.hparams_schedule(lr=schedule)")
TREE_HINT = ("only the whole hparams may be a schedule: give one callable returning the whole tree, e.g. "
             "lambda t: {'w': schedule_w(t), 'b': schedule_b(t)} or lambda t: group_hparams(labels, groups, "
             "base=schedule(t)) (sofx.transforms.group_hparams), each schedule returning an AdamHParams (one of a "
             "number wrapped: sofx.schedules.hparams_schedule(lr=schedule))")
_EVALUATE_HINT = ("this step takes the hparams of one step: give the schedule's value at the step "
                  "(sofx.serial.hparams_at(hparams, step)), or take loop steps (sofx.serial.serial_loop_step, "
                  "sofx.speculate.speculative_loop_step), which evaluate it")


def is_hparams_number(x: Any) -> bool:
    """A Python or numpy number, or a tensor (where an AdamHParams is expected: an lr given alone)."""
    return isinstance(x, torch.Tensor) or (isinstance(x, numbers.Number) and not is_bool(x))


def check_step_hparams(hparams: Any, root: str, evaluated: bool = True) -> None:
    """Refuse a number or a schedule (a callable) where a step's hparams tree has an :class:`AdamHParams`,
    naming its path under ``root`` and how to give it (other wrong leaves are the optimizer's to refuse).

    ``evaluated=False``: for a step that takes one step's hparams (``update``, ``serial_step``, ``begin_step``),
    not a schedule of the whole hparams as a loop step (:func:`hparams_at`) does: only a schedule is
    refused here, saying how to give its value at the step."""
    if hparams is None or isinstance(hparams, AdamHParams):
        return
    fields_hint = _fields_dict_hint(hparams)
    if fields_hint:
        raise HParamError(f"{root} has the keys {sorted(hparams)}{fields_hint}")
    leaves, spec = tree.flatten(hparams, is_leaf=_is_hparams)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, AdamHParams) or not (callable(leaf) or (evaluated and is_hparams_number(leaf))):
            continue
        path = tree.leaf_paths(spec, root=root)[i]
        if callable(leaf) and not evaluated:
            raise HParamError(f"{path} is a schedule ({type(leaf).__name__}), which is not evaluated here: "
                              f"{_EVALUATE_HINT}; {WRAP_HINT if leaf is hparams else TREE_HINT}")
        if callable(leaf):
            raise HParamError(f"{path} is a schedule ({type(leaf).__name__}) inside an hparams tree, which is not "
                              f"evaluated; {TREE_HINT}")
        example = f"AdamHParams(lr={leaf!r:.40})" if not isinstance(leaf, torch.Tensor) else "AdamHParams(lr=...)"
        raise HParamError(f"{path} = {leaf!r:.40} ({type(leaf).__name__}) is a number; expected an AdamHParams "
                          f"({example}), a tree of them, or a schedule step -> hparams ({WRAP_HINT})")


class _Leaf(NamedTuple):
    """Everything ``update``/``undo`` need about one leaf, checked."""

    path: str
    p: torch.Tensor
    g: torch.Tensor | None
    count: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    hp: AdamHParams
    traced: bool  # a tensor or hparam of the leaf is traced (vmap, grad, compile): values cannot be read
    steps: Any  # the count as a Python int where it can be read (else the tensor itself)
    # _gather's proof that p, m, v (and g where given) are what the cpu kernels' promise (kernels.base.CALLS_CHECKED)
    # says: plain tensors alike (g of p's dtype, m and v of one), contiguous, each in its storage, untraced. False
    # in a leaf made from another with other tensors (_replace).
    plain: bool = False


class Adam:
    """Adam / AdamW as a pure transform. Build it with :func:`adam` or :func:`adamw`.

    Static configuration: ``decoupled`` weight decay (AdamW) or L2,
    ``bias_correction``, ``state_dtype`` (``None``: the parameter's dtype),
    ``undo`` strategy and kernel ``backend``. ``defaults`` are the
    hyperparameters used where a step's :class:`AdamHParams` leaves a field
    ``None``.
    """

    def __init__(self, defaults: AdamHParams, *, decoupled: bool, bias_correction: bool = True,
                 state_dtype: torch.dtype | None = None, undo: str = "auto", backend: str = "auto") -> None:
        if undo not in _UNDO_MODES:
            raise UnsupportedError(f"undo={undo!r}; expected one of {_UNDO_MODES}")
        if state_dtype is not None and not isinstance(state_dtype, torch.dtype):  # ("bfloat16" raised AttributeError)
            raise UnsupportedError(f"state_dtype={state_dtype!r} is {tree.article(type(state_dtype).__name__)}; "
                                   "expected a floating torch.dtype (torch.float32, torch.bfloat16, torch.float16, "
                                   "torch.float64) or None")
        if state_dtype is not None and not state_dtype.is_floating_point:
            raise UnsupportedError(f"state_dtype={state_dtype} is not a floating dtype")
        check_backend_name(backend)  # (an unknown name failed only at the first step)
        # Python bools (bias_correction="no" was taken as on)
        decoupled = flag("decoupled", decoupled, UnsupportedError)
        bias_correction = flag("bias_correction", bias_correction, UnsupportedError)
        self.defaults = defaults
        self.variant = AdamVariant(decoupled=decoupled, bias_correction=bias_correction)
        self.state_dtype = state_dtype
        self.undo_mode = undo
        self.backend = backend
        self._selected: dict[tuple, str] = {}  # (traced, device, param dtype, state dtype) -> backend name
        _check_defaults(defaults)
        if undo == "algebraic" and state_dtype in _LOW_PRECISION:
            raise UnsupportedError(f"undo='algebraic' is impossible with state_dtype={state_dtype}: the stored "
                                   "moments are rounded; use undo='auto' or 'exact'")

    def __repr__(self) -> str:
        kind = "adamw" if self.variant.decoupled else "adam"
        return (f"sofx.{kind}({self.defaults}, bias_correction={self.variant.bias_correction}, "
                f"state_dtype={self.state_dtype}, undo={self.undo_mode!r}, backend={self.backend!r})")

    # ------------------------------------------------------------------ init
    def init(self, params: Any) -> AdamState:
        """Zero moments (in ``state_dtype``) and zero counts for every leaf of ``params``."""
        leaves, spec = tree.flatten(params)
        for path, p in zip(tree.leaf_paths(spec), leaves):
            _check_param(path, p)
        count = [torch.zeros((), dtype=torch.int64) for _ in leaves]
        mu = [torch.zeros_like(p, dtype=self.state_dtype or p.dtype) for p in leaves]
        nu = [torch.zeros_like(p, dtype=self.state_dtype or p.dtype) for p in leaves]
        return AdamState(tree.unflatten(spec, count), tree.unflatten(spec, mu), tree.unflatten(spec, nu))

    # ---------------------------------------------------------------- update
    def update(self, params: Any, grads: Any, state: AdamState, hparams: Any = None, *,
               grad_scale: Scalar = 1.0, donate: bool = False, grads_finite: bool | None = None,
               param_copies: Any = None, undoable: bool = True,
               snapshot_limit_bytes: int | None = None) -> tuple[Any, AdamState, UndoRecord]:
        """One Adam step for every leaf that has a gradient; returns ``(params, state, record)``.

        The gradient used is ``grads * grad_scale`` (unscaling and clipping
        folded into one multiplier, applied inside the kernel; a finite number
        >= 0, where 0 is the step with zero gradients that ``clip_grad_norm_``
        at ``max_norm=0`` gives: momentum and weight decay still move the
        parameters). Everything is
        checked before anything is computed: a bad input raises a
        :class:`~sofx.errors.SofxError` naming the leaf path and modifies nothing.

        ``grads_finite=True``: the caller guarantees that every element of
        ``grads`` is finite and ``|g * grad_scale| <= GRADIENT_LIMIT`` (e.g. it
        took their sum of squares), so the undo strategy is chosen without
        reading the gradients again; otherwise the record would be wrong (a Python or numpy bool, or a readable
        0-d bool tensor such as ``torch.isfinite(g).all()``, read once as its value; ``donate`` and ``undoable``
        are Python or numpy bools). ``None``/``False``
        (default): each gradient is checked. The CPU and Triton kernels check a leaf's
        gradient in the step's own pass, a chunk at a time (leaves whose
        tensors share one dense layout, with ``undo="auto"``; a chunk is a
        range of the leaf's memory, in memory order where the layout is not
        contiguous: :mod:`sofx.memory_order_leaves`; a chunk with an inf or a nan is kept, then
        stepped, and the leaf's record a ``"chunk_snapshot"``: the old values
        of those chunks, the algebraic inverse elsewhere, see
        :mod:`sofx.skipped_chunks`); elsewhere each gradient is read once
        before the step (on a GPU, all of a device's in one pass) and such a
        leaf's record is a whole snapshot.

        With ``undo="auto"`` a leaf's record also keeps old values where its
        gradient dominates its second moment somewhere (a spike, a rarely
        updated row of an embedding), a second moment of 0 included (a row
        no token has used yet, given its first gradient, in L2 mode, with
        bfloat16 moments or beside a first moment that is not 0): the algebraic
        inverse would restore ``v`` and ``m`` less exactly than DESIGN.md's
        1e-6 there (a gradient 1000x the ones before it left ``v`` 62% off).
        Not on a leaf's first step from all-zero moments, whose undo restores
        the zeros exactly (nothing kept for it; in L2 mode, whatever the step's
        decay, its parameter, ``"param_snapshot"``: a redo's ``gh = g + wd * p`` would
        take the undone p, an ulp off, see ``L2_FIRST_STEP_REASON``), nor where both moments are
        exactly 0 in float32 without L2 decay: the inverse gives them back
        exactly (:func:`sofx.kernels.base.zeros_come_back`). The test,
        :func:`sofx.kernels.base.lossy_elements`, runs in the CPU and Triton kernels'
        checked step (a chunk at a time, as above, also with
        ``grads_finite=True``), elsewhere as a pass before the step.

        ``undoable=False``: the caller will not undo this step (a plain
        training loop); nothing is read or copied to choose an undo strategy,
        and every leaf's record says it cannot be undone.

        ``snapshot_limit_bytes``: the most snapshot memory the record may hold
        (:meth:`UndoRecord.snapshot_bytes`; ``None``: no limit). An update that
        would keep more raises :class:`~sofx.errors.SnapshotLimitError`: before
        anything is computed where the strategies chosen beforehand need more,
        and after the step where its own test flagged leaves (above), which is
        then taken back (see the error). A speculation uses it to leave a block
        unspeculated rather than go beyond its ``snapshot_budget_bytes``.

        ``param_copies``: a tree with the structure of ``params`` whose leaves
        are ``None`` or tensors of the parameter's shape and device in any
        float dtype; each receives the leaf's new parameters, cast to its dtype
        (e.g. a model's bf16 weights beside fp32 masters). The CPU and Triton
        kernels write it in the same pass as the step.
        """
        donate = _validate_donate(donate)
        undoable = _validate_undoable(undoable)
        snapshot_limit_bytes = _validate_snapshot_limit(snapshot_limit_bytes)
        spec, leaves = self._gather(params, grads, state, hparams)
        copies = _param_copies(spec, leaves, param_copies)
        grad_scale = _checked_grad_scale(grad_scale, leaves)
        grads_finite = validate_grads_finite(grads_finite)
        kernels = self._kernels(leaves)
        covered = _kernel_checks_memory(kernels, [True] * len(leaves), leaves, copies, donate)
        if not covered:
            _check_writes(leaves, copies, donate, grad_scale=grad_scale)
        memo: dict = {}
        shapes: dict[int, _Leaf] = {}  # the caller's leaves of those stepped as their memory
        if undoable:
            in_step = self._checked_in_step(leaves, kernels, copies, grad_scale)
            # (a dense layout that is not contiguous: stepped as its memory)
            leaves, copies, _, shapes = memory_order_leaves.flat_checked(leaves, copies, in_step)
            finite = self._gradients_finite(leaves, grads_finite, grad_scale, skip=in_step)
            plans = [self._plan(leaf, grad_scale, True if chk else f, memo) if leaf.g is not None else None
                     for leaf, f, chk in zip(leaves, finite, in_step)]
            plans = self._snapshot_lossy(leaves, plans, in_step)
            if snapshot_limit_bytes is not None:
                _check_snapshot_limit(leaves, plans, {}, snapshot_limit_bytes)
        else:
            in_step = [False] * len(leaves)
            plans = [self._plan(leaf, grad_scale, True, memo, undoable=False) if leaf.g is not None else None
                     for leaf in leaves]
        flags = _chunk_flags(leaves, [chk and plan is not None and plan[1] in _INVERTED
                                      for plan, chk in zip(plans, in_step)])
        new_p = [leaf.p for leaf in leaves]
        new_m = [leaf.m for leaf in leaves]
        new_v = [leaf.v for leaf in leaves]
        new_c = [leaf.count for leaf in leaves]
        records: list[LeafUndo | None] = [None] * len(leaves)
        pending = []  # (leaf index, backend, call): the kernels run per backend, many leaves per call
        for k, (leaf, plan, copy, skip) in enumerate(zip(leaves, plans, copies, flags.views)):
            if plan is None:
                write_param_copy(copy, leaf.p)
                continue
            call, records[k] = self._prepare_step(leaf, plan, donate, copy, skip)
            new_c[k] = leaf.count + 1
            pending.append((k, kernels[k], call))
        calls = {k: call for k, _, call in pending}
        plain = all(leaves[k].plain for k, _, _ in pending)
        for k, (p2, m2, v2) in _run_by_backend(pending, lambda b, calls: b.step_many(calls, self.variant),
                                               leaves if covered else None, checked="step" if plain else None):
            new_p[k], new_m[k], new_v[k] = p2, m2, v2
        flagged = flags.flagged()  # leaves with a chunk the step left alone (see skipped_chunks)
        if flagged and snapshot_limit_bytes is not None:
            try:
                _check_snapshot_limit(leaves, plans, {k: flags.views[k] for k in flagged}, snapshot_limit_bytes)
            except SnapshotLimitError:
                self._take_back(leaves, records, calls, kernels, copies, flagged, donate)
                raise
        finishing: skipped_chunks.Pending = []  # every flagged leaf's chunk step, in one call per kernel
        for k in flagged:
            leaf = leaves[k]
            records[k] = skipped_chunks.finish_step(kernels[k], self.variant, (leaf.p, leaf.m, leaf.v), calls[k],
                                                    records[k], (new_p[k], new_m[k], new_v[k]), donate, finishing)
        skipped_chunks.run_chunked(self.variant, finishing)
        for k in flagged:  # (the chunk steps just run wrote their kept values: the library's own writes)
            records[k].note_versions()
        memory_order_leaves.put_back(shapes, new_p, new_m, new_v, records)
        new_state = AdamState(tree.unflatten(spec, new_c), tree.unflatten(spec, new_m), tree.unflatten(spec, new_v))
        return tree.unflatten(spec, new_p), new_state, UndoRecord(records, spec, self.variant)

    def _take_back(self, leaves: Sequence[_Leaf], records: Sequence[LeafUndo | None], calls: dict[int, StepCall],
                   kernels: Sequence[Any], copies: Sequence[torch.Tensor | None], flagged: Sequence[int],
                   donate: bool) -> None:
        """Undo a checked update before its flagged leaves are finished (their snapshots would not fit):
        the inputs and the parameter copies as they were (see :class:`~sofx.errors.SnapshotLimitError`)."""
        flagged = set(flagged)
        for k, rec in enumerate(records):
            if rec is None:
                continue
            leaf, copy = leaves[k], copies[k]
            if k in flagged:
                skipped_chunks.roll_back_step(kernels[k], self.variant, (leaf.p, leaf.m, leaf.v), calls[k], rec,
                                              donate)
            elif donate:
                self._undo_leaf(leaf, rec, True, copy)  # in place: leaf's tensors hold the step's results
            else:
                write_param_copy(copy, leaf.p)

    def _checked_in_step(self, leaves: Sequence[_Leaf], kernels: Sequence[Any],
                         copies: Sequence[torch.Tensor | None], grad_scale: Scalar) -> list[bool]:
        """Per leaf: whether its kernel checks its step in the step itself (``StepCall.skip``: the gradient's
        finiteness and :func:`~sofx.kernels.base.lossy_elements`) instead of a pass before: backends with
        ``CHECKS_FINITE``, tensors of one dense layout (contiguous, or stepped as their memory's 1-d views:
        :mod:`sofx.memory_order_leaves`), ``undo="auto"``, moments whose undo depends on it (not rounded:
        those are kept whole anyway). Not with a ``grad_scale`` that cannot be read (a ``torch.func``
        transform's): the test needs its value (:meth:`_snapshot_lossy` keeps a snapshot instead)."""
        if self.undo_mode != "auto" or not is_number(grad_scale):
            return [False] * len(leaves)
        # (a plain leaf's tensors are contiguous alike, _gather proved it: one dense layout where it has an element)
        return [leaf.g is not None and not leaf.traced and leaf.m.dtype not in _LOW_PRECISION and kernel.CHECKS_FINITE
                and ((leaf.plain and copy is None and leaf.p.numel() > 0)
                     or one_dense_layout(leaf.p, (leaf.g, leaf.m, leaf.v, copy)))
                for leaf, kernel, copy in zip(leaves, kernels, copies)]

    def _snapshot_lossy(self, leaves: Sequence[_Leaf], plans: list, in_step: Sequence[bool],
                        old: Sequence[LeafUndo | None] | None = None) -> list:
        """``plans`` with a snapshot for each leaf whose step would be undone algebraically
        (``undo="auto"``, not checked in its kernel: ``in_step``) where
        :func:`~sofx.kernels.base.lossy_elements` finds an element (the pass before the step; on a GPU one
        read back per device). ``old``: the records of an undo+redo's undone steps, whose redo (``leaves``:
        the state before the undo; fused, :func:`_fusable`) is tested against the undone second moment, but for
        a redo from zero moments that the pass provably finds nothing in (:func:`_fused_from_exact_zeros`)."""
        if self.undo_mode != "auto":
            return plans
        out = list(plans)
        tests: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for k, (leaf, plan) in enumerate(zip(leaves, plans)):
            if plan is None or plan[1] not in _INVERTED or in_step[k] or leaf.traced or leaf.p.numel() == 0:
                continue
            rec = old[k] if old is not None else None
            if not (is_number(plan[0].grad_scale) and (rec is None or is_number(rec.scalars.grad_scale))):
                out[k] = (plan[0], "snapshot", "")  # a grad_scale that cannot be read (vmap, grad): untested, kept
                continue
            if rec is None and _is_fresh(leaf, plan[0]):
                continue  # from zero moments: undone to exact zeros
            if rec is not None and _fused_from_exact_zeros(leaf, rec, plan, self.variant.decoupled):
                continue  # (as above: the fused undo gives the exact zeros)
            if rec is not None:
                p = rec.p_old if rec.p_old is not None else leaf.p
                bad = any_lossy(p, leaf.g, leaf.v, plan[0], self.variant.decoupled, rec.grad, rec.scalars,
                                m=leaf.m, p_kept=plan[1] == "param_snapshot",
                                bias_correction=self.variant.bias_correction, p_old_given=rec.p_old is not None)
            else:
                bad = any_lossy(leaf.p, leaf.g, leaf.v, plan[0], self.variant.decoupled, m=leaf.m,
                                p_kept=plan[1] == "param_snapshot")
            tests.setdefault(leaf.p.device, []).append((k, bad))
        for found in tests.values():
            for (k, _), lossy in zip(found, torch.stack([t for _, t in found]).tolist()):
                if lossy:
                    out[k] = (out[k][0], "snapshot", LOSSY_REASON)
        return out

    def _redo_plan(self, leaf: _Leaf, rec: LeafUndo | None, grad_scale: Scalar,
                   finite: bool | None, memo: dict | None = None,
                   undoable: bool = True) -> tuple[AdamScalars, str, str] | None:
        """The plan of an undo_redo's new step of ``leaf`` (taken from the undone count; None: no gradient;
        ``memo``, ``undoable``: see :meth:`_plan`)."""
        if leaf.g is None:
            return None
        if rec is None:
            return self._plan(leaf, grad_scale, finite, memo, undoable=undoable)
        t = rec.scalars.step  # the undone step's t: count_before + 1 (read from the record, not the tensor)
        steps = t - 1 if type(t) is int else as_number(rec.count_before)
        return self._plan(leaf, grad_scale, finite, memo, steps, undoable)

    def _prepare_step(self, leaf: _Leaf, plan: tuple[AdamScalars, str, str], donate: bool,
                      copy: torch.Tensor | None = None, skip: torch.Tensor | None = None, *,
                      copy_snapshots: bool | None = None, leaf_owned: bool = False) -> tuple[StepCall, LeafUndo]:
        """The kernel call of one leaf's step and its undo record (snapshots taken now, before any kernel
        overwrites the leaf under donation). ``copy_snapshots``: whether the record's snapshots are copies
        (default: under donation) or the leaf's tensors themselves. The record owns its snapshots
        (``LeafUndo.owns_kept``) where they are copies or ``leaf_owned``: the leaf's tensors are no caller's
        (an undo_redo's undone values: new tensors, or those a used record owned)."""
        scalars, strategy, reason = plan
        own = donate if copy_snapshots is None else copy_snapshots
        p_old = m_old = v_old = None
        if strategy in ("snapshot", "param_snapshot"):
            p_old = leaf.p.clone() if own else leaf.p
        if strategy == "snapshot":
            m_old = leaf.m.clone() if own else leaf.m
            v_old = leaf.v.clone() if own else leaf.v
        # Before the step: with donation the kernel overwrites leaf.m and leaf.v with the new moments.
        fresh = strategy in ("algebraic", "param_snapshot") and _is_fresh(leaf, scalars)
        out = (leaf.p, leaf.m, leaf.v) if donate else None
        rec = LeafUndo(strategy, leaf.g, scalars, leaf.count, p_old, m_old, v_old, reason, moments_were_zero=fresh,
                       owns_kept=own or leaf_owned)
        return StepCall(leaf.p, leaf.g, leaf.m, leaf.v, scalars, out, copy, skip, zero_moments=fresh,
                        p_kept=strategy == "param_snapshot"), rec

    def _step_leaf(self, leaf: _Leaf, plan: tuple[AdamScalars, str, str], donate: bool,
                   copy: torch.Tensor | None = None, *, copy_snapshots: bool | None = None, leaf_owned: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LeafUndo]:
        call, rec = self._prepare_step(leaf, plan, donate, copy, copy_snapshots=copy_snapshots, leaf_owned=leaf_owned)
        p2, m2, v2 = self._kernel(leaf).step_many([call], self.variant)[0]
        return p2, m2, v2, leaf.count + 1, rec

    # ------------------------------------------------------------------ undo
    def undo(self, params: Any, state: AdamState, record: UndoRecord, *,
             donate: bool = False, param_copies: Any = None) -> tuple[Any, AdamState]:
        """Invert the :meth:`update` that produced ``(params, state)`` and ``record``.

        Per leaf, by the record's strategy. ``"snapshot"``: the kept ``p, m, v``
        restored bit for bit (but for one case: a donated checked step that flagged
        some chunks of a leaf planned ``"param_snapshot"`` keeps a whole snapshot whose
        stepped chunks' moments were recovered by the inverse below, within its error;
        see :func:`sofx.skipped_chunks.finish_step`). ``"algebraic"``: from the stepped ``p', m', v'``,
        the gradient ``g`` the step used (times its ``grad_scale``) and that
        step's hparams and ``t`` (never the current ones)::

            u  = (lr / bc1) * m' / (sqrt(v') / sqrt(bc2) + eps)    # the step's own u, bit for bit
            p  = p' + u                   decoupled: p = (p' + u) / (1 - lr * wd)
            gh = g                        L2:        gh = g + wd * p
            m  = (m' - (1 - b1) * gh) / b1
            v  = max((v' - (1 - b2) * gh^2) / b2, 0)    (nan kept as nan)

        (``bc1 = 1 - b1^t``, ``bc2 = 1 - b2^t``; 1 without bias correction;
        no decay term where ``wd == 0``): exact in real arithmetic, a few ulps
        in float32. ``"param_snapshot"``: ``p`` restored from the record, ``m``
        and ``v`` as above. ``"chunk_snapshot"``: algebraic, then the kept
        chunks' ``p, m, v`` restored bit for bit. The step count goes back to ``t - 1``, and the
        moments of a leaf's first step from init back to exact zeros.

        Raises :class:`~sofx.errors.UndoError` (changing nothing) when the
        record was used already, belongs to another state (structure or step
        counts differ), or a leaf's step cannot be undone. Also where a tensor
        the record refers to without a copy was written in place since the step
        (its ``Tensor._version`` moved, :meth:`sofx.LeafUndo.changed_in_place`):
        the gradient the step took (a ``p.grad.zero_()``, an optimizer's
        ``zero_grad(set_to_none=False)`` or the next backward accumulating into
        the ``.grad`` given to :meth:`update`; not a ``"snapshot"``'s, whose undo
        does not read it), or the params and moments that a
        snapshot record of an update without donation keeps (a ``copy_`` of the
        new values into them): the undo would use the values written since,
        the error names the leaf and the tensor. Undo before reusing them, set
        ``.grad`` to None instead of zeroing it, or give :meth:`update` tensors
        nothing writes (a write through ``.data``, which torch does not count,
        goes unseen; not checked under ``torch.compile`` nor for a
        ``torch.func`` transform's or an inference tensor). Params whose
        mappings are of another dict type or key order than the record's (a
        dict where it was an ``OrderedDict``) are matched to it key by key, as
        :meth:`update` matches grads and state to params; the result has the
        params' structure. ``param_copies``:
        as in :meth:`update` (they receive the restored parameters).
        """
        donate = _validate_donate(donate)
        spec, leaves, plain, record = self._check_record(params, state, record)
        copies = _param_copies(spec, leaves, param_copies)
        # every leaf's kernel chosen (or refused) before any snapshot is restored; once per kind of leaf
        kernels = self._kernels(leaves, [rec is not None and rec.strategy != "snapshot" for rec in record.leaves])
        # (the memory of the call is its kernel's to check where that has every tensor: each leaf inverted in it,
        # nothing restored from kept values around it; plain leaves, which cannot overlap themselves: the pass names
        # such a one as before)
        covered = _kernel_checks_memory(kernels, [rec is not None and rec.strategy in _INVERTED and leaf.plain
                                                  for leaf, rec in zip(leaves, record.leaves)],
                                        leaves, copies, donate, record)
        if not covered:
            _check_writes(leaves, copies, donate, record)
        new_p = [leaf.p for leaf in leaves]
        new_m = [leaf.m for leaf in leaves]
        new_v = [leaf.v for leaf in leaves]
        new_c = [leaf.count for leaf in leaves]
        pending = []
        for k, (leaf, rec, copy) in enumerate(zip(leaves, record.leaves, copies)):
            if rec is None:
                write_param_copy(copy, leaf.p)
            elif rec.strategy == "snapshot":
                new_p[k], new_m[k], new_v[k], new_c[k] = _restore_snapshot(leaf, rec, donate, copy)
            else:
                new_c[k] = _count_before(rec)
                pending.append((k, kernels[k], _undo_call(leaf, rec, donate, copy)))
        checked = "undo" if all(plain[k] for k, _, _ in pending) else None  # (the kernels' promise: see there)
        for k, (p0, m0, v0) in _run_by_backend(pending, lambda b, calls: b.undo_many(calls, self.variant),
                                               leaves if covered else None, checked, _UNDO_KERNEL_ROLES):
            if record.leaves[k].strategy == "chunk_snapshot":
                skipped_chunks.restore_chunks(record.leaves[k], (p0, m0, v0), copies[k])
            m0, v0 = _zero_if_fresh(record.leaves[k], m0, v0, donate)
            new_p[k], new_m[k], new_v[k] = p0, m0, v0
        record.mark_used()
        new_state = AdamState(tree.unflatten(spec, new_c), tree.unflatten(spec, new_m), tree.unflatten(spec, new_v))
        return tree.unflatten(spec, new_p), new_state

    def undo_redo(self, params: Any, state: AdamState, record: UndoRecord, grads: Any, hparams: Any = None, *,
                  grad_scale: Scalar = 1.0, donate: bool = False, grads_finite: bool | None = None,
                  param_copies: Any = None, undoable: bool = True) -> tuple[Any, AdamState, UndoRecord]:
        """``update(*undo(params, state, record), grads, hparams)`` as one call.

        Leaves whose step was algebraically undoable and whose redone step
        needs no snapshot go through the backend's fused ``undo_redo`` kernel
        (one pass over memory), as do those whose record and redo both keep
        only the old parameter (``"param_snapshot"``: bf16/fp16 masters,
        ``lr * weight_decay`` near 1; the redo's record keeps the undone
        record's, the parameter it starts from); the others are undone and
        stepped separately.
        A leaf's first step from zero moments is fused where its inverse gives
        them back exactly (float32 moments without L2 decay:
        :func:`sofx.kernels.base.zeros_come_back`), else undone to exact zeros,
        then stepped; either way its redo's record is again one from zero moments.
        A leaf with no new gradient is only undone. Returns the new record.
        ``grads_finite`` is the hint of :meth:`update` for the new ``grads``.
        Without it a new gradient is not read again where it is the very
        tensor the undone step used and found finite, at a ``grad_scale`` no
        larger in magnitude than that step's (a late clip or a new loss scale
        redoes with the same gradient and a new ``grad_scale``; a larger one may
        take ``g * grad_scale`` beyond ``GRADIENT_LIMIT``: read again);
        the CPU and Triton kernels check the others in the fused pass, as :meth:`update`
        does (a leaf whose new gradient has an inf or a nan gets a chunk
        snapshot record of the undone values there); elsewhere they are read before. ``param_copies`` and
        ``undoable`` as in :meth:`update` (the redone step's record is a
        snapshot where its new gradient dominates the undone second moment).
        ``record`` is refused as :meth:`undo` refuses it, a tensor it refers to
        written in place since its step included (the gradient that step took,
        the caller's tensors a snapshot keeps), before anything is written.
        The new record refers to no tensor that ``record`` kept from its own
        caller (the params and state of an update without donation, which
        that caller may reuse once ``record`` is used): a snapshot of those
        is copied, with or without donation. Those ``record`` owns
        (``LeafUndo.owns_kept``: copies made under donation or by an earlier
        undo_redo) the new record keeps as they are, not copied again.
        """
        donate = _validate_donate(donate)
        undoable = _validate_undoable(undoable)
        # (also checks grads and hparams; the record laid out as the params, matched to its own key by key)
        spec, leaves, plain, record = self._check_record(params, state, record, grads, hparams)
        copies = _param_copies(spec, leaves, param_copies)
        grad_scale = _checked_grad_scale(grad_scale, leaves)
        grads_finite = validate_grads_finite(grads_finite)
        # The record's own gradient: its strategy says it was finite (the tensor must not have been modified
        # since, as the module docstring asks), and within GRADIENT_LIMIT at the undone step's grad_scale: so at
        # a grad_scale no larger in magnitude (a larger one, checked again, may take it beyond).
        known = [rec is not None and leaf.g is not None and leaf.g is rec.grad and rec.strategy in _INVERTED
                 and _scale_no_larger(grad_scale, rec.scalars.grad_scale)
                 for leaf, rec in zip(leaves, record.leaves)]
        # The others are checked in the fused kernel where it runs them (redone algebraically, were the gradient
        # finite), else read before.
        kernels = self._kernels(leaves)
        decoupled = self.variant.decoupled
        memo: dict = {}
        recs = list(record.leaves)
        shapes: dict[int, _Leaf] = {}  # the caller's leaves of those stepped as their memory (with their records)
        if undoable:
            candidates = self._checked_in_step(leaves, kernels, copies, grad_scale)
            # (a dense layout that is not contiguous: redone as its memory; not checked in the kernel where its
            # record has another layout)
            leaves, copies, recs, shapes = memory_order_leaves.flat_checked(leaves, copies, candidates, recs)
            assumed = [self._redo_plan(leaf, rec, grad_scale, True, memo) if k or c else None  # planned as if finite
                       for leaf, rec, k, c in zip(leaves, recs, known, candidates)]
            # (a known gradient too: the kernel also tests the redo against the undone moments)
            in_kernel = [c and ((_fusable(leaf, rec, plan, decoupled) and rec.grad.is_contiguous()
                                 and (rec.p_old is None or rec.p_old.is_contiguous()))
                                or _chunks_fusable(leaf, rec, plan, copy, decoupled))
                         for leaf, rec, plan, c, copy in zip(leaves, recs, assumed, candidates, copies)]
            # a chunk snapshot's redo in one pass where its kernel checks it (else undone, then stepped)
            by_chunks = [ik and rec.strategy == "chunk_snapshot" for ik, rec in zip(in_kernel, recs)]
            skip = [k or c for k, c in zip(known, in_kernel)]
            finite = self._gradients_finite(leaves, grads_finite, grad_scale, skip=skip)
            plans = [plan if sk else self._redo_plan(leaf, rec, grad_scale, f, memo)
                     for leaf, rec, plan, sk, f in zip(leaves, recs, assumed, skip, finite)]
            # fused ones not checked in a kernel: against the undone second moment (the others after their undo)
            plans = self._snapshot_lossy(leaves, plans, [ik or not _fusable(leaf, rec, plan, decoupled)
                                                         for leaf, ik, rec, plan
                                                         in zip(leaves, in_kernel, recs, plans)],
                                         recs)
        else:
            in_kernel = [False] * len(leaves)
            # (strategy "none": nothing chosen nor refused; still fused where the undone step was inverted)
            plans = [self._redo_plan(leaf, rec, grad_scale, True, memo, undoable=False)
                     for leaf, rec in zip(leaves, recs)]
            by_chunks = [_chunks_fusable(leaf, rec, plan, copy, decoupled)
                         for leaf, rec, plan, copy in zip(leaves, recs, plans, copies)]
        # Nothing is written before this: the kernel checks the memory of the call where it has every tensor
        # (each leaf fused into one undo_redo_many call of a backend that checks), else here.
        covered = _kernel_checks_memory(kernels, [_fusable(leaf, rec, plan, decoupled)
                                                  for leaf, rec, plan in zip(leaves, recs, plans)],
                                        leaves, copies, donate, record)
        if not covered:
            _check_writes(leaves, copies, donate, record, grad_scale)
        flags = _chunk_flags(leaves, in_kernel)
        new_p = [leaf.p for leaf in leaves]
        new_m = [leaf.m for leaf in leaves]
        new_v = [leaf.v for leaf in leaves]
        new_c = [leaf.count for leaf in leaves]
        records: list[LeafUndo | None] = [None] * len(leaves)
        pending = []  # the fused undo+redo calls
        chunked = []  # (kernel, call): chunk snapshots' leaves, undone and redone by chunks
        whole: dict[int, UndoRedoCall] = {}  # the leaves redone by chunks, each as one call (for the finish)
        from_kept = []  # (leaf index, backend, call): the steps from whole snapshots' kept values
        for k, (leaf, rec, plan, copy) in enumerate(zip(leaves, recs, plans, copies)):
            fused = by_chunks[k] or _fusable(leaf, rec, plan, decoupled)
            if by_chunks[k]:
                out = (leaf.p, leaf.m, leaf.v) if donate else (torch.empty_like(leaf.p), torch.empty_like(leaf.m),
                                                               torch.empty_like(leaf.v))
                whole[k] = UndoRedoCall(leaf.p, leaf.m, leaf.v, rec.grad, rec.scalars, leaf.g, plan[0], None, out,
                                        copy, flags.views[k], plan[1] == "param_snapshot")
                chunked += [(kernels[k], c) for c in skipped_chunks.split_by_kept_chunks(whole[k], rec)]
            elif fused:
                out = (leaf.p, leaf.m, leaf.v) if donate else None
                pending.append((k, kernels[k], UndoRedoCall(leaf.p, leaf.m, leaf.v, rec.grad, rec.scalars, leaf.g,
                                                            plan[0], rec.p_old, out, copy, flags.views[k],
                                                            plan[1] == "param_snapshot")))
            if fused:
                new_c[k] = _count_before(rec) + 1
                records[k] = _fused_record(leaf, rec, plan) if undoable else \
                    LeafUndo("none", leaf.g, plan[0], rec.count_before, reason=_NOT_UNDOABLE)
                continue
            if rec is not None and rec.strategy == "snapshot" and plan is not None:
                # stepped from the kept values into the leaf's tensors (one pass; no copy back first)
                undone = leaf._replace(p=rec.p_old, count=rec.count_before, m=rec.m_old, v=rec.v_old,
                                       steps=as_number(rec.count_before), plain=False)
                if undoable:
                    plan = self._snapshot_lossy([undone], [plan], [False])[0]
                # (kept values read, not written.) A new snapshot shares them where the used record owns them
                # (copies made under donation or by an undo_redo); a record of an update without donation kept the
                # caller's own tensors, which the caller may reuse once it is used: this call's record keeps its
                # own copy of those, donated or not.
                call, records[k] = self._prepare_step(undone, plan, donate, copy,
                                                      copy_snapshots=_keeps_callers(undone, rec), leaf_owned=True)
                out = (leaf.p, leaf.m, leaf.v) if donate else None
                from_kept.append((k, kernels[k], call._replace(out=out)))
                new_c[k] = _count_before(rec) + 1
                continue
            p0, m0, v0, c0 = (leaf.p, leaf.m, leaf.v, leaf.count) if rec is None else \
                self._undo_leaf(leaf, rec, donate)
            if plan is None:
                new_p[k], new_m[k], new_v[k], new_c[k] = p0, m0, v0, c0
                write_param_copy(copy, p0)
            else:
                undone = leaf._replace(p=p0, count=c0, m=m0, v=v0, steps=as_number(c0), plain=False)
                if undoable:
                    plan = self._snapshot_lossy([undone], [plan], [False])[0]
                # (without donation an undo passes a kept old parameter on as the undone one: copied, as above.
                # The undone values of a stepped leaf are new tensors or those: no caller's; a leaf the used record
                # did not step is stepped from the caller's tensors, which a record without donation keeps.)
                new_p[k], new_m[k], new_v[k], new_c[k], records[k] = self._step_leaf(
                    undone, plan, donate, copy, copy_snapshots=donate or _keeps_callers(undone, rec),
                    leaf_owned=rec is not None)
        calls = {k: call for k, _, call in pending}
        # (a leaf stepped as its memory is another, not plain: its record's gradient is another too)
        checked = "undo_redo" if all(plain[k] and leaves[k].plain for k, _, _ in pending) else None
        for k, (p2, m2, v2) in _run_by_backend(pending, lambda b, calls: b.undo_redo_many(calls, self.variant),
                                               leaves if covered else None, checked=checked):
            new_p[k], new_m[k], new_v[k] = p2, m2, v2
        for k, (p2, m2, v2) in _run_by_backend(from_kept, lambda b, calls: b.step_many(calls, self.variant)):
            new_p[k], new_m[k], new_v[k] = p2, m2, v2
        skipped_chunks.run_chunked(self.variant, chunked)
        for k, call in whole.items():
            calls[k] = call
            new_p[k], new_m[k], new_v[k] = call.out
        finishing: skipped_chunks.Pending = []
        for k in flags.flagged():  # a chunk of the new step is not finite or too lossy to invert
            leaf = leaves[k]
            records[k] = skipped_chunks.finish_undo_redo(kernels[k], self.variant, (leaf.p, leaf.m, leaf.v), calls[k],
                                                         records[k], (new_p[k], new_m[k], new_v[k]), donate,
                                                         recs[k], finishing)
        skipped_chunks.run_chunked(self.variant, finishing)
        for k in flags.flagged():  # (as update's: the kept values the chunk steps just wrote)
            records[k].note_versions()
        memory_order_leaves.put_back(shapes, new_p, new_m, new_v, records)
        record.mark_used()
        new_state = AdamState(tree.unflatten(spec, new_c), tree.unflatten(spec, new_m), tree.unflatten(spec, new_v))
        return tree.unflatten(spec, new_p), new_state, UndoRecord(records, spec, self.variant)

    def _check_record(self, params: Any, state: AdamState, record: UndoRecord, grads: Any = None,
                      hparams: Any = None) -> tuple[tree.TreeSpec, list[_Leaf], list[bool], UndoRecord]:
        """Check that ``record`` can undo ``(params, state)`` (and, for a redo, the new ``grads`` and
        ``hparams``, gathered into the leaves); raise :class:`UndoError` otherwise. Also returns, per leaf,
        whether it and its record's gradient are what the kernels' promise says (``checked`` of
        :func:`_run_by_backend`): a :attr:`_Leaf.plain` leaf whose record keeps nothing (an algebraic one) and
        whose gradient is a plain tensor of its shape, dtype and device, contiguous in its storage, untraced;
        and the record laid out as the params (:meth:`UndoRecord.laid_out_as`: params whose mappings are of
        another dict type or key order than the record's are matched to it key by key, as :meth:`update`
        matches grads and state to params), which the caller uses in its place."""
        if not isinstance(record, UndoRecord):
            raise UndoError(f"expected an UndoRecord, got {type(record).__name__}")
        if record.used:
            raise UndoError("this undo record was already used: a step can be undone once")
        if record.variant != self.variant:
            raise UndoError(f"the record is of a step by an optimizer with {_variant_words(record.variant)}, this "
                            f"one has {_variant_words(self.variant)}: its inverse would restore other values")
        spec, leaves = self._gather(params, grads, state, hparams, expect_spec=record.spec)
        record = record.laid_out_as(spec)
        if len(record.leaves) != len(leaves):
            raise UndoError(f"the record covers {len(record.leaves)} leaves, params have {len(leaves)}")
        compiling = torch.compiler.is_compiling()  # (no storage to check: Dynamo traces fake tensors)
        traced = leaf_tracer()
        plain = [False] * len(leaves)
        for k, (leaf, rec) in enumerate(zip(leaves, record.leaves)):
            if rec is None:
                continue
            if rec.strategy == "none":
                raise UndoError(f"{leaf.path}: this step cannot be undone ({rec.reason})")
            if not isinstance(rec.grad, torch.Tensor):  # (a record is a pytree: a tree_map may replace its tensors)
                raise UndoError(f"{leaf.path}: the record's gradient is {tree.article(type(rec.grad).__name__)}, not a "
                                "tensor: the record's tensors were replaced (a tree_map over it); undo the record the "
                                "step returned")
            count = rec.count_before  # (a number where a transform rebuilt the record with non-tensor leaves)
            if not (isinstance(count, torch.Tensor) or (isinstance(count, numbers.Integral) and not is_bool(count))):
                raise UndoError(f"{leaf.path}: the record's count_before is {tree.article(type(count).__name__)}, "
                                "expected the step count before the step (a 0-d int64 tensor, or a number): the "
                                "record's tensors were replaced (a tree_map over it); undo the record the step "
                                "returned")
            if not compiling:  # (versions are not read under torch.compile: no graph break)
                changed = rec.changed_in_place()
                if changed is not None:
                    raise UndoError(f"{leaf.path}: {changed}")
            if not leaf.traced and traced(rec.grad):
                # (a gradient that requires grad, stepped under no_grad, undone in grad mode: the undo is autograd's,
                # as a step of it is; a native kernel refused it naming its own call, not the leaf)
                leaf = leaves[k] = leaf._replace(traced=True, plain=False)
            if not compiling:
                # (a plain leaf's own gradient, the record's, is plain: a late clip's redo)
                plain[k] = _check_record_storage(leaf, rec) and leaf.plain and (
                    rec.grad is leaf.g or (type(rec.grad) is torch.Tensor and not traced(rec.grad)))
            have, want = leaf.steps, as_number(rec.step)
            if is_number(have) and is_number(want) and have != want:
                raise UndoError(f"{leaf.path}: the state's step count is {have}, the record undoes step {want}: "
                                "the record does not belong to this state")
            if rec.grad.shape != leaf.p.shape:
                raise UndoError(f"{leaf.path}: the record's gradient has shape {tuple(rec.grad.shape)}, "
                                f"the parameter {tuple(leaf.p.shape)}")
            if rec.strategy != "snapshot" and leaf.m.dtype in _LOW_PRECISION:
                # (no step of rounded moments inverts them: _no_inverse, _checked_in_step)
                raise UndoError(f"{leaf.path}: the record inverts the step's moments ({rec.strategy}), which are "
                                f"{leaf.m.dtype} here: rounded, they have no inverse, and a step of them keeps a "
                                "snapshot; the record is of another optimizer's state (another state_dtype)")
            if rec.strategy == "chunk_snapshot":
                _check_kept_chunks(leaf, rec)
            elif rec.strategy in ("snapshot", "param_snapshot"):
                _check_kept_whole(leaf, rec)
            if rec.grad.dtype != leaf.p.dtype or rec.grad.device != leaf.p.device:
                # (an algebraic record keeps nothing else to tell: of fp32 params, it inverted bf16 ones silently)
                raise UndoError(f"{leaf.path}: the record's gradient is {rec.grad.dtype} on {rec.grad.device}, the "
                                f"parameter {leaf.p.dtype} on {leaf.p.device}: the record is not of these params")
        if grads is not None:
            self._check_redo_counts(leaves, record)
        return spec, leaves, plain, record

    def _check_redo_counts(self, leaves: Sequence[_Leaf], record: UndoRecord) -> None:
        """The count checks of an undo_redo's redo, per leaf with a new gradient, from the count its step starts
        from: the undone step's count before where ``record`` stepped the leaf (its t again), else the state's (a
        leaf the undone step did not step: its next count, :func:`_check_next_count`); the step size
        (:func:`check_step_size`) at that step's t. (Checked at the undone step's t for every leaf, such a leaf's
        step size beyond float32 was refused by the kernel, naming no leaf, after other leaves were written under
        donation, and one beyond it only at that t was refused though its own step is taken.) Once per hparams
        object, start count and dtype."""
        done: set[tuple[int, int, torch.dtype]] = set()
        for leaf, rec in zip(leaves, record.leaves):
            if leaf.g is None or type(leaf.steps) is not int:
                continue
            start = leaf.steps - 1 if rec is not None else leaf.steps
            key = (id(leaf.hp), start, leaf.p.dtype)
            if key in done:
                continue
            if rec is None:
                _check_next_count(leaf.path, start)
            if self.variant.bias_correction:
                check_step_size(leaf.path, leaf.hp, start, leaf.p.dtype)
            done.add(key)

    def _undo_leaf(self, leaf: _Leaf, rec: LeafUndo, donate: bool, copy: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if rec.strategy == "snapshot":
            return _restore_snapshot(leaf, rec, donate, copy)
        p0, m0, v0 = self._kernel(leaf).undo_many([_undo_call(leaf, rec, donate, copy)], self.variant)[0]
        if rec.strategy == "chunk_snapshot":
            skipped_chunks.restore_chunks(rec, (p0, m0, v0), copy)
        return (p0, *_zero_if_fresh(rec, m0, v0, donate), _count_before(rec))

    def _gradients_finite(self, leaves: Sequence[_Leaf], grads_finite: bool | None, grad_scale: Scalar,
                          skip: Sequence[bool] | None = None) -> list[bool | None]:
        """Per leaf: whether its gradient is finite, where the undo strategy will ask (``None``: not
        looked at; ``skip[k]``: leaf k is not looked at, its step checks it). ``grads_finite=True`` is the
        caller's word; otherwise the gradients of each device are checked together
        (:func:`_finite_flags`): one wait for a GPU instead of one per leaf. None is looked at where
        ``grad_scale`` cannot be read (a ``torch.func`` transform's or autograd's: ``g * grad_scale`` has no
        value on the host; :meth:`_choose_strategy` takes that step as one of values it cannot read)."""
        if grads_finite is True:
            return [True] * len(leaves)
        flags: list[bool | None] = [None] * len(leaves)
        if self.undo_mode == "exact" or not is_number(grad_scale):
            return flags
        by_device: dict[torch.device, list[int]] = {}
        for k, leaf in enumerate(leaves):
            if leaf.g is not None and leaf.m.dtype not in _LOW_PRECISION and not leaf.traced \
                    and not (skip and skip[k]):
                by_device.setdefault(leaf.g.device, []).append(k)
        for device, ks in by_device.items():
            for k, ok in zip(ks, _finite_flags([leaves[k].g for k in ks], grad_scale, batched=device.type == "cuda")):
                flags[k] = ok
        return flags

    # -------------------------------------------------------------- helpers
    def check_inputs(self, params: Any, grads: Any, state: AdamState, hparams: Any = None, *,
                     donate: bool = False, param_copies: Any = None, zero_missing: bool = False,
                     check_undo: bool = True) -> None:
        """Raise the :class:`~sofx.errors.SofxError` that :meth:`update` would raise for these inputs
        (structure, shapes, dtypes, devices, hparams, a backend that does not support a leaf,
        ``undo='algebraic'`` where the inverse does not exist, in-place writes), reading no gradient and
        changing nothing. For callers that step the leaves of one
        tree in several calls (the speculation layer), so that a bad leaf is refused before any other leaf
        is stepped.

        ``zero_missing=True``: a leaf without a gradient is checked as one stepped with a zero gradient
        (``missing_grad="zero"``: its hparams and its undo). ``check_undo=False``: the refusals of
        ``undo='algebraic'`` are not checked (a speculation layer does not speculate such a leaf).
        """
        donate = _validate_donate(donate)
        # (options, read by their truth before: zero_missing="no" checked the leaves without gradient as stepped)
        zero_missing = flag("zero_missing", zero_missing, UnsupportedError)
        check_undo = flag("check_undo", check_undo, UnsupportedError)
        spec, leaves = self._gather(params, grads, state, hparams)
        stepped = [leaf for leaf in leaves if leaf.g is not None or zero_missing]
        checked = {_hparams_key(leaf.hp, leaf.p.dtype, leaf.p.is_meta)  # by _gather
                   for leaf in leaves if leaf.g is not None}
        for leaf in stepped:  # and those of the leaves stepped with a zero gradient (zero_missing)
            _check_stepped_hparams(leaf.hp, leaf.path, leaf.p.dtype, checked, leaf.p.is_meta)
            _check_next_count(leaf.path, leaf.steps)
            if self.variant.bias_correction:
                check_step_size(leaf.path, leaf.hp, leaf.steps, leaf.p.dtype)
        # each stepped leaf's backend chosen, or refused (a dtype or device it does not support); a leaf stepped
        # with a zero gradient (zero_missing) as one with a gradient
        self._kernels([leaf if leaf.g is not None else leaf._replace(g=leaf.p) for leaf in stepped])
        _check_writes(leaves, _param_copies(spec, leaves, param_copies), donate)
        if check_undo and self.undo_mode == "algebraic":
            memo: dict = {}
            for leaf in stepped:
                self._plan(leaf, 1.0, True, memo)  # raises where update refuses; the gradient is not read

    def strategy_reads_params(self, weight_decay: Any) -> bool:
        """Whether the undo strategy of a leaf stepped with ``weight_decay`` depends on its parameter's values, not
        only on the hparams, counts, dtypes and gradients: ``undo='algebraic'`` with an L2 decay not known to be 0
        (a step of a parameter whose ``weight_decay * p`` is not finite or beyond ``GRADIENT_LIMIT`` cannot be
        undone: :data:`L2_PARAM_NOT_FINITE_REASON`). Planning shared between leaves or steps must not be reused
        then."""
        return (self.undo_mode == "algebraic" and not self.variant.decoupled
                and not (is_number(weight_decay) and weight_decay == 0))

    def undo_strategies(self, params: Any, grads: Any, state: AdamState, hparams: Any = None, *,
                        grad_scale: Scalar = 1.0, grads_finite: bool | None = None) -> list[tuple[str, str] | None]:
        """``(strategy, reason)`` that :meth:`update` would choose per leaf, without stepping.

        ``None`` for a leaf without a gradient. Checks the inputs as
        :meth:`update` does and raises the same errors (e.g.
        :class:`~sofx.errors.UnsupportedError` for ``undo='algebraic'`` where
        the inverse does not exist). Speculation uses it to decide eligibility.
        Not the lossy-inverse test of ``undo='auto'`` (it needs the step's
        values, and the CPU and Triton kernels run it in the step): where it finds an
        element, :meth:`update` keeps a snapshot of a leaf said algebraic here.
        ``grads_finite``: as in :meth:`update` (True: the gradients are not read).
        """
        grads_finite = validate_grads_finite(grads_finite)
        _, leaves = self._gather(params, grads, state, hparams)
        grad_scale = _checked_grad_scale(grad_scale, leaves)
        self._kernels(leaves)  # a leaf the backend does not support refused, as update refuses it
        finite = self._gradients_finite(leaves, grads_finite, grad_scale)
        return [None if leaf.g is None else self._plan(leaf, grad_scale, f)[1:] for leaf, f in zip(leaves, finite)]

    def resolve_hparams(self, hparams: Any, spec: tree.TreeSpec, paths: list[str] | None = None,
                        params: Any = None) -> list[AdamHParams]:
        """One complete :class:`AdamHParams` per leaf of ``spec`` (defaults filled in); ``paths``: the
        leaves' paths if the caller has them; ``params``: the tree ``spec`` is the structure of, where the caller
        has it (under ``torch.compile`` a per-group hparams tree is broadcast over it:
        :func:`~sofx.tree.broadcast_prefix`)."""
        if hparams is None:
            hparams = AdamHParams()
        try:
            per_leaf = tree.broadcast_prefix(hparams, spec, is_leaf=_is_hparams, what="hparams", full_tree=params)
        except StructureError as exc:
            raise StructureError(f"{exc}{_fields_dict_hint(hparams)}") from exc.__cause__
        if paths is None:
            paths = tree.leaf_paths(spec)
        out = []
        # Per group (the leaves of a group share one AdamHParams), by identity; while compiling by ``is``, not
        # ``id()``, which Dynamo guards on the caller's object (hparams made outside a compiled step recompiled it
        # every step); else by ``id()`` (a search by ``is`` costs a pass over the groups per leaf).
        filled: dict[int, AdamHParams] = {}
        traced_filled: list[tuple[AdamHParams, AdamHParams]] = []
        compiling = torch.compiler.is_compiling()
        for path, hp in zip(paths, per_leaf):
            if hp is None:
                hp = _NO_HPARAMS
            if not isinstance(hp, AdamHParams):
                check_step_hparams(hparams, "hparams", evaluated=False)  # a schedule: how to give its value
                hint = f"; a number is not taken as the lr: AdamHParams(lr={hp!r:.40})" if is_hparams_number(hp) \
                    else tree.unwalked_hint(hp)
                raise HParamError(f"hparams for {path}: expected an AdamHParams, got {type(hp).__name__}{hint}")
            full = next((f for h, f in traced_filled if h is hp), None) if compiling else filled.get(id(hp))
            if full is None:  # (a group that gives every number, as the offload engine's, is taken as it is)
                # A concrete tensor is read now: the step (and its undo record) must not see later in-place
                # changes of it (a schedule's lr.fill_()).
                # A numpy number is read as the Python number it holds (the kernels take Python numbers).
                # While compiling always a new object: the step takes ids of its leaves' hparams.
                full = hp if not compiling and all(type(x) is float or type(x) is int for x in hp) else \
                    _read_hparams(hp, self.defaults, f"hparams for {path}")
                if compiling:
                    traced_filled.append((hp, full))
                else:
                    filled[id(hp)] = full
            out.append(full)
        return out

    def _gather(self, params: Any, grads: Any, state: AdamState, hparams: Any,
                expect_spec: tree.TreeSpec | None = None) -> tuple[tree.TreeSpec, list[_Leaf]]:
        """Flatten and check params, grads, state and hparams against each other."""
        p_leaves, spec = tree.flatten(params)
        if expect_spec is not None and spec != expect_spec and tree.leaf_order_by_key(expect_spec, spec) is None:
            # (a mapping of another dict type or key order with the same keys is matched key by key, as update
            # matches grads and state to params: _check_record lays the record out as these params)
            raise UndoError(f"the record was made for params of another structure: "
                            f"{tree.structure_difference(expect_spec, params)} (the record's: "
                            f"{tree.spec_text(expect_spec)}, params: {tree.spec_text(spec)})")
        if not isinstance(state, AdamState):
            raise LeafError(not_an_adam_state(state))
        paths = tree.leaf_paths(spec)
        g_leaves = tree.flatten_up_to(spec, grads, "grads") if grads is not None else [None] * len(p_leaves)
        counts = tree.flatten_up_to(spec, state.count, "state.count")
        mus = tree.flatten_up_to(spec, state.mu, "state.mu")
        nus = tree.flatten_up_to(spec, state.nu, "state.nu")
        stepping = expect_spec is None or grads is not None  # an update, or the redo of an undo_redo
        hps = self.resolve_hparams(hparams, spec, paths, params) if stepping else [self.defaults] * len(p_leaves)
        leaves = []
        checked: set[tuple[int, bool, bool]] = set()  # hparams objects checked already (a group's leaves share one)
        stepped: set[tuple[int, int, torch.dtype, bool]] = set()  # (hparams, count, dtype, meta) checked already
        traced = leaf_tracer()
        compiling = torch.compiler.is_compiling()  # (no storage to check: Dynamo traces fake tensors)
        hp_traced: dict[int, bool] = {}  # per hparams object
        for path, p, g, c, m, v, hp in zip(paths, p_leaves, g_leaves, counts, mus, nus, hps):
            _check_param(path, p)
            want_state = self.state_dtype or p.dtype
            alike = _leaf_alike(p, g, m, v, want_state)
            if alike:  # the common case: what the three checks below accept
                steps = _check_count(path, c, traced, p)
            else:
                if g is not None:
                    _check_like("grads", path, g, p, p.dtype)
                steps = _check_count(path, c, traced, p)
                _check_like("state.mu", path, m, p, want_state)
                _check_like("state.nu", path, v, p, want_state)
            contiguous = not compiling and _in_storage(p, g, m, v)  # (then each contiguous, in its storage)
            if not (compiling or contiguous):
                _check_storage(path, p, g, m, v)  # (a strided view, a wrapper: checked whole; names a bad one)
            if g is not None:
                # (these checks depend on the hparams object, the count, the dtype and meta only, and the path
                # they name: once per such key, the first leaf in order named; a traced count per leaf)
                key = (id(hp), steps, p.dtype, p.is_meta) if type(steps) is int else None
                if key is None or key not in stepped:
                    _check_stepped_hparams(hp, path, p.dtype, checked, p.is_meta)
                    # (an undo_redo's redo counts from the undone count where the record stepped the leaf, else from
                    # this one: its record knows, _check_redo_counts)
                    if expect_spec is None:
                        _check_next_count(path, steps)
                        if self.variant.bias_correction:
                            check_step_size(path, hp, steps, p.dtype)
                    if key is not None:
                        stepped.add(key)
            if id(hp) not in hp_traced:
                hp_traced[id(hp)] = traced(*hp)
            leaf_traced = hp_traced[id(hp)] or traced(p, g, m, v)
            leaves.append(_Leaf(path, p, g, c, m, v, hp, leaf_traced, steps,
                                alike and contiguous and not leaf_traced and type(p) is torch.Tensor))
        return spec, leaves

    def _kernel(self, leaf: _Leaf) -> Any:
        if leaf.traced:
            if self.backend not in ("auto", "reference"):
                raise UnsupportedError(f"{leaf.path}: backend {self.backend!r} cannot run under torch.func "
                                       "transforms, autograd (a tensor that requires grad, in grad mode: call "
                                       "under torch.no_grad() to step its value) or torch.compile; use "
                                       "backend='reference' or 'auto'")
            return reference_kernels  # runs anywhere; no import machinery for torch.compile to trace
        try:
            return select_backend(self.backend, leaf.p.device, leaf.p.dtype, leaf.m.dtype)
        except UnsupportedError as e:
            raise UnsupportedError(f"{leaf.path}: {e}") from None

    def _plan(self, leaf: _Leaf, grad_scale: Scalar = 1.0, finite: bool | None = None,
              memo: dict | None = None, steps: Any = None, undoable: bool = True) -> tuple[AdamScalars, str, str]:
        """The step's scalars and the undo strategy for this leaf (raises where refused).

        ``finite``: whether the gradient is finite, if known (``None``: read it where the strategy asks).
        ``memo``: a dict shared by the leaves of one call (one ``grad_scale``): leaves that agree on
        everything the plan depends on (hparams object, count, finiteness, dtypes) share one plan.
        ``steps``: the count the step starts from, if not ``leaf.steps`` (an undo_redo's redo).
        ``undoable=False``: strategy ``"none"`` (nothing chosen, nothing refused: see :meth:`update`).
        """
        if steps is None:
            steps = leaf.steps
        key = None
        # (not shared where the strategy reads the leaf's parameter)
        if memo is not None and finite is not None and not leaf.traced and not (
                undoable and self.strategy_reads_params(leaf.hp.weight_decay)):
            key = (id(leaf.hp), steps, finite, leaf.p.dtype, leaf.m.dtype, undoable)  # the leaves hold the hparams
            plan = memo.get(key)
            if plan is not None:
                return plan
        hp = leaf.hp
        t = steps + 1
        scalars = AdamScalars(hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, t, grad_scale)
        strategy, reason = self._choose_strategy(leaf, scalars, finite) if undoable else ("none", _NOT_UNDOABLE)
        if key is not None:
            memo[key] = scalars, strategy, reason
        return scalars, strategy, reason

    def _kernels(self, leaves: Sequence[_Leaf], wanted: Sequence[bool] | None = None) -> list[Any]:
        """:meth:`_kernel` of each leaf with a gradient (``wanted``: of each leaf it flags; an undo's, whose leaves
        have none), None for the others, chosen once per kind of leaf (untraced kinds once per optimizer: the
        choice depends on nothing else); a refusal names the first leaf of its kind, as :meth:`_kernel`."""
        chosen: dict[tuple, Any] = {}
        out = []
        for k, leaf in enumerate(leaves):
            if (leaf.g is None) if wanted is None else not wanted[k]:
                out.append(None)
                continue
            key = (leaf.traced, leaf.p.device, leaf.p.dtype, leaf.m.dtype)
            kernel = chosen.get(key)
            if kernel is None:
                name = self._selected.get(key) if not leaf.traced else None
                kernel = chosen[key] = load_backend(name) if name is not None else self._kernel(leaf)
                name = getattr(kernel, "NAME", None)
                if not leaf.traced and name is not None and load_backend(name) is kernel:  # a registered backend
                    self._selected[key] = name
            out.append(kernel)
        return out

    def _no_inverse(self, lr: float, b1: float, b2: float, wd: float, param_dtype: torch.dtype,
                    state_dtype: torch.dtype) -> tuple[list[str], list[str]]:
        """Why a step has no algebraic inverse: (reasons the moments cannot be recomputed, reasons only the
        parameter cannot)."""
        full_reasons = []
        for name, beta in (("beta1", b1), ("beta2", b2)):
            if abs(beta) < ALGEBRAIC_MIN_DIVISOR:
                full_reasons.append(f"{name} = {beta!r}: a beta of 0 leaves no trace of the old moment, and dividing "
                                    "by one below 2^-12 loses more than half of float32's bits")
        full_reasons += _rounded(state_dtype, "optimizer states")
        param_reasons = _rounded(param_dtype, "master weights")
        if self.variant.decoupled and wd != 0 and abs(1 - lr * wd) < ALGEBRAIC_MIN_DIVISOR:
            param_reasons.append(f"lr * weight_decay == 1 or near it (decoupled decay; |1 - lr * weight_decay| = "
                                 f"{abs(1 - lr * wd):.3g} is below 2^-12: dividing by it loses more than half of "
                                 "float32's bits)")
        if self.variant.decoupled and abs(1 - lr * wd) > 1 / ALGEBRAIC_MIN_DIVISOR:
            param_reasons.append(f"1 - lr * weight_decay = {1 - lr * wd:.3g} is beyond 2^12 in magnitude (decoupled "
                                 "decay): the decayed parameter p * (1 - lr * weight_decay), or the factor itself, "
                                 "may leave the float range, where dividing by the factor gives inf or nan, not p")
        return full_reasons, param_reasons

    def algebraic_refusal(self, hparams: AdamHParams, param_dtype: torch.dtype = torch.float32) -> str | None:
        """Why ``undo='algebraic'`` would refuse a step of a ``param_dtype`` leaf with these hparams (a ``None``
        field: the optimizer's default): a beta of 0, ``lr * weight_decay == 1`` with decoupled decay, rounded
        masters or states; or ``None``. What :meth:`update` raises, for callers that know the hparams before the
        tensors (the offload facade checks its param groups with it before backward steps any block). Values that
        cannot be read (tensors of a ``torch.func`` transform or that autograd records) are not: only the dtypes
        are checked, as :meth:`update` checks them. Hparams that :meth:`update` refuses (out of range, no number)
        are refused as it refuses them, an :class:`HParamError` naming ``algebraic_refusal`` (``None`` was returned
        for them: "algebraic undo is possible")."""
        if not isinstance(hparams, AdamHParams):  # (a bare AttributeError)
            raise HParamError(f"algebraic_refusal: expected an AdamHParams, got {_described(hparams)}")
        _validate_hparams(hparams, "algebraic_refusal")  # (its None fields: the defaults, checked at construction)
        if self.undo_mode != "algebraic":
            return None
        hparams = _read_hparams(hparams, self.defaults, "algebraic_refusal")  # (a None field: the default's)
        state_dtype = self.state_dtype or param_dtype
        values = [as_number(x) for x in (hparams.lr, hparams.beta1, hparams.beta2, hparams.weight_decay)]
        if all(is_number(x) for x in values):
            full, param = self._no_inverse(*(float(x) for x in values), param_dtype, state_dtype)
        else:
            full, param = _rounded(state_dtype, "optimizer states"), _rounded(param_dtype, "master weights")
        reasons = full + param
        return f"undo='algebraic' is impossible: {'; '.join(reasons)}; use undo='auto' or 'exact'" if reasons else None

    def _choose_strategy(self, leaf: _Leaf, s: AdamScalars, finite: bool | None = None) -> tuple[str, str]:
        if self.undo_mode == "exact":
            return "snapshot", ""
        values = [as_number(x) for x in (s.lr, s.beta1, s.beta2, s.weight_decay)]
        if leaf.traced or not all(is_number(x) for x in values) or not is_number(s.grad_scale):
            # Values cannot be inspected (vmap, grad, compile, meta; a grad_scale of those: the finiteness of
            # g * grad_scale): keep the inputs (exact, no copy when pure).
            if self.undo_mode == "algebraic":
                # (the dtypes are known, the values not)
                rounded = _rounded(leaf.m.dtype, "optimizer states") + _rounded(leaf.p.dtype, "master weights")
                if rounded:
                    raise UnsupportedError(f"{leaf.path}: undo='algebraic' is impossible: {'; '.join(rounded)}; "
                                           "use undo='auto' or 'exact'")
                return "algebraic", ""
            return "snapshot", ""
        lr, b1, b2, wd = values
        full_reasons, param_reasons = self._no_inverse(lr, b1, b2, wd, leaf.p.dtype, leaf.m.dtype)
        decay_factor = 1 - lr * wd
        if self.undo_mode == "algebraic":
            if full_reasons or param_reasons:
                raise UnsupportedError(f"{leaf.path}: undo='algebraic' is impossible: "
                                       f"{'; '.join(full_reasons + param_reasons)}; use undo='auto' or 'exact'")
            if not (finite if finite is not None else _all_finite(leaf.g, s.grad_scale)):
                return "none", NOT_FINITE_REASON
            if not self.variant.decoupled and wd != 0 and not _decay_term_finite(leaf.p, wd):
                return "none", L2_PARAM_NOT_FINITE_REASON
            return "algebraic", ""
        # auto: also avoid the cases that are possible but too lossy.
        if 0 < min(b1, b2) < ALGEBRAIC_MIN_BETA:
            full_reasons.append(f"a beta below {ALGEBRAIC_MIN_BETA} amplifies rounding")
        if full_reasons or not (finite if finite is not None else _all_finite(leaf.g, s.grad_scale)):
            return "snapshot", "; ".join(full_reasons) or NOT_FINITE_REASON
        if self.variant.decoupled and wd != 0 and abs(decay_factor) < ALGEBRAIC_MIN_DECAY_FACTOR:
            param_reasons.append(f"1 - lr*weight_decay = {decay_factor:g} amplifies rounding")
        if not self.variant.decoupled and is_number(s.step) and s.step == 1:
            param_reasons.append(L2_FIRST_STEP_REASON)
        if param_reasons:
            return "param_snapshot", "; ".join(param_reasons)
        return "algebraic", ""


def _read_hparams(hp: AdamHParams, defaults: AdamHParams, where: str) -> AdamHParams:
    """``hp`` with its ``None`` fields from ``defaults``, each value read (:func:`~sofx.kernels.base.as_number`: a
    concrete 0-d tensor or a numpy number as its Python number); a tensor outside its storage (freed or shrunk) is
    refused, an :class:`HParamError` naming ``where`` and the field (``hparams for params['w']: lr``), or the
    default's field where it came from ``defaults`` (``defaults: lr``, as the optimizer's construction names it)."""
    for f, x in zip(AdamHParams._fields, hp):  # (read as a Python number, its precision was no longer seen)
        if x is not None:
            refuse_half_precision(f, x, where)
            refuse_unreal_tensor(f, x, where)  # (read as a Python bool or complex, its refusal said "got bool")
    read = AdamHParams(*(as_number(d, lambda f=f: f"defaults: {f}") if x is None else
                         as_number(x, lambda f=f: f"{where}: {f}")
                         for f, x, d in zip(AdamHParams._fields, hp, defaults)))
    # (read as 0.0, refused as no value the caller wrote; asked only then, a tensor eps read again being a second
    # device sync a step; a traced one is not read)
    if hp.eps is not None and type(read.eps) in (float, int) and read.eps == 0:
        refuse_eps_held_as_0(hp.eps, where)
    return read


def _checked_grad_scale(grad_scale: Any, leaves: Sequence[_Leaf]) -> Scalar:
    """``grad_scale`` as a number where it can be read (the record keeps this step's value), checked: a real
    number (a numpy one read as the Python number it holds) or a 0-d floating-point tensor (not a meta one
    beside leaves with data), >= 0, and at most float32's largest value where a leaf with a
    gradient is stepped in float32 (every dtype but float64: the kernels multiply its gradient by it in
    float32, where a larger one is inf; the step's values would be nan, and no finiteness check sees it). 0
    steps with zero gradients (``clip_grad_norm_`` at ``max_norm=0`` multiplies them by 0), and so does one so
    small that it is 0 in float32 there, as torch's unscaling and clipping underflow would; a gradient that is
    not finite stays one (``0 * inf`` is nan)."""
    if type(grad_scale) is float or type(grad_scale) is int:
        value = grad_scale
    elif is_numpy_real(grad_scale):  # (np.float32 was refused as no number; np.float64, a float, passed)
        value = as_number(grad_scale, "grad_scale")
    elif isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float, torch.Tensor)):
        raise HParamError(f"grad_scale must be a number or a 0-d floating-point tensor, got "
                          f"{type(grad_scale).__name__}")
    elif isinstance(grad_scale, torch.Tensor) and (grad_scale.dim() != 0 or not grad_scale.dtype.is_floating_point):
        raise HParamError(f"grad_scale must be a number or a 0-d floating-point tensor, got a tensor of shape "
                          f"{tuple(grad_scale.shape)} and dtype {grad_scale.dtype}")
    else:
        value = as_number(grad_scale, "grad_scale")
        if isinstance(value, torch.Tensor) and value.is_meta and any(leaf.g is not None and not leaf.p.is_meta
                                                                     for leaf in leaves):
            raise HParamError("grad_scale is a meta tensor, which holds no value, for leaves with data; give a float "
                              "or a 0-d tensor with its value")
    if is_number(value) and not 0 <= value < math.inf:  # a comparison traces for symbolic floats
        raise HParamError(f"grad_scale = {value!r} is invalid; expected a finite value >= 0")
    if is_number(value) and value > FLOAT32_MAX:
        in_f32 = next((leaf.path for leaf in leaves if leaf.g is not None and leaf.p.dtype != torch.float64), None)
        if in_f32 is not None:
            raise HParamError(f"grad_scale = {value!r} is beyond float32's range (largest {FLOAT32_MAX!r}); {in_f32} "
                              "is stepped in float32, where the gradient times it is inf")
    return value


def _variant_words(variant: AdamVariant) -> str:
    """``variant`` in words, for an error."""
    decay = "decoupled weight decay (AdamW)" if variant.decoupled else "L2 weight decay (Adam)"
    return f"{decay} and bias correction {'on' if variant.bias_correction else 'off'}"


def _check_writes(leaves: Sequence[_Leaf], copies: Sequence[torch.Tensor | None], donate: bool,
                  record: UndoRecord | None = None, grad_scale: Any = None) -> None:
    """Refuse a call whose in-place writes (``donate``, parameter copies) cannot be done or would overwrite
    what it still reads (:mod:`sofx.kernels.donation`); nothing is written before. A ``torch.func``
    wrapper's memory is the tensor it wraps; under ``torch.compile`` the checks are by identity."""
    has_copies = any(c is not None for c in copies)
    if not (donate or has_copies):
        return
    if torch.compiler.is_compiling():
        _check_distinct_writes(leaves, copies, donate, record)
        return
    copied = _writable_copies(leaves, copies)
    if donate:
        _writable_leaves(leaves, record)
    _check_transform_levels(leaves, copies, donate, record, grad_scale)
    real = [leaf for leaf in leaves if not leaf.p.is_meta]  # meta tensors have no memory
    spans = MemorySpans()
    spans.add([_memory(t) if leaf.traced else t for leaf in real for t in (leaf.p, leaf.m, leaf.v)], donate,
              lambda i: (real[i // 3], i % 3))
    with_grad = [leaf for leaf in real if leaf.g is not None]
    spans.add([_memory(leaf.g) if leaf.traced else leaf.g for leaf in with_grad], False,
              lambda i: (with_grad[i], _GRAD))
    if has_copies:
        copied = [(leaf, c) for leaf, c in copied if not c.is_meta]
        spans.add([_memory(c) for _, c in copied], True, lambda i: (copied[i][0], _COPY))
    if record is not None:
        kept = [(leaf, role, t) for leaf, rec in zip(leaves, record.leaves) if rec is not None and not leaf.p.is_meta
                for role, t in enumerate((rec.grad, rec.p_old, rec.m_old, rec.v_old), _COPY + 1) if t is not None]
        spans.add([_memory(t) if leaf.traced else t for leaf, _, t in kept], False, lambda i: kept[i][:2])
    spans.check_disjoint(lambda tag: _role_name(*tag))


def _functorch_layers(x: Any) -> tuple[set[int], Any]:
    """The ``torch.func`` levels (vmap, grad) that wrap ``x`` (none for a plain tensor or a number), and what
    they wrap at the bottom (the tensor whose memory ``x`` is)."""
    levels = set()
    while isinstance(x, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(x):
        levels.add(torch._C._functorch.maybe_get_level(x))
        x = torch._C._functorch.get_unwrapped(x)
    return levels, x


def _memory(t: torch.Tensor) -> torch.Tensor:
    return _functorch_layers(t)[1]


def _transform_levels(x: Any) -> set[int]:
    return _functorch_layers(x)[0]


def _check_transform_levels(leaves: Sequence[_Leaf], copies: Sequence[torch.Tensor | None], donate: bool,
                            record: UndoRecord | None, grad_scale: Any) -> None:
    """Under ``torch.func`` transforms: refuse a written tensor that a level of the transforms which wraps
    the values it receives does not wrap (an unbatched state given to a vmap whose parameters or gradients
    are batched, ``in_dims=None``): torch would refuse that write after the call had written others."""
    recs = list(record.leaves) if record is not None else [None] * len(leaves)
    shared = _transform_levels(grad_scale)
    for leaf, copy, rec in zip(leaves, copies, recs):
        if not leaf.traced:
            continue
        written = [(role, t) for role, t in enumerate((leaf.p, leaf.m, leaf.v)) if donate]
        if copy is not None:
            written.append((_COPY, copy))
        if not written:
            continue
        inputs = [leaf.p, leaf.g, leaf.m, leaf.v, *leaf.hp]
        if rec is not None:
            inputs += [rec.grad, rec.p_old, rec.m_old, rec.v_old, *rec.scalars]
        need = set(shared)
        for x in inputs:
            need |= _transform_levels(x)
        for role, t in written:
            missing = need - _transform_levels(t)
            if missing:
                raise LeafError(f"{_role_name(leaf, role)} is written in place, but its new values are transformed "
                                f"by torch.func level(s) {sorted(missing)} that it is not (e.g. a state that vmap "
                                "does not batch, in_dims=None, for batched parameters or gradients); pass it "
                                "transformed as the others are, or do not donate")


def _check_distinct_writes(leaves: Sequence[_Leaf], copies: Sequence[torch.Tensor | None], donate: bool,
                           record: UndoRecord | None) -> None:
    """:func:`_check_writes` while ``torch.compile`` traces, where memory cannot be read: a tensor written
    twice (tied weights as two leaves) or written and read by the call (a gradient that is the parameter) is
    refused by identity; views of one buffer are not seen. Identity is a dict keyed by the tensors themselves (a
    tensor hashes by identity; Dynamo hashes a traced one without a guard): not ``id()``, on which Dynamo guards every
    tensor it is taken of (each step's new tensors recompiled the step), nor a search by ``is`` through the tensors
    written so far, which Dynamo traces element by element (quadratic in the leaves)."""
    written: dict[torch.Tensor, tuple[_Leaf, int]] = {}
    for leaf, copy in zip(leaves, copies):
        for role, t in [*((r, t) for r, t in enumerate((leaf.p, leaf.m, leaf.v)) if donate), (_COPY, copy)]:
            if t is None:
                continue
            first = written.get(t)
            if first is not None:
                raise LeafError(shared_memory_message(_role_name(*first), _role_name(leaf, role)))
            written[t] = (leaf, role)
    recs = list(record.leaves) if record is not None else [None] * len(leaves)
    for leaf, rec in zip(leaves, recs):
        read = [(_GRAD, leaf.g)]
        if rec is not None:
            read += list(enumerate((rec.grad, rec.p_old, rec.m_old, rec.v_old), _COPY + 1))
        if not donate:  # the moments and the parameter are read; param copies are written
            read += list(enumerate((leaf.p, leaf.m, leaf.v)))
        for role, t in read:
            first = written.get(t) if t is not None else None
            if first is not None:
                raise LeafError(shared_memory_message(_role_name(*first), _role_name(leaf, role)))


# The tensors of a leaf a call may read or write, by role (_check_writes)
_GRAD, _COPY = 3, 4
_ROLES = ("params", "state.mu", "state.nu", "grads", "param_copies", "the undo record's gradient of",
          "the undo record's saved parameters of", "the undo record's saved first moments of",
          "the undo record's saved second moments of", "the finiteness flags of")
# A kernel call's roles (base.MemoryOverlapError) as a leaf's
_KERNEL_ROLES = {"p": 0, "out[0]": 0, "m": 1, "out[1]": 1, "v": 2, "out[2]": 2, "g": _GRAD, "g_new": _GRAD,
                 "g_old": 5, "p_old": 6, "p_copy": _COPY, "skip": 9}
# An undo call's (its g is the record's gradient)
_UNDO_KERNEL_ROLES = {**_KERNEL_ROLES, "g": 5}


def _role_name(leaf: _Leaf, role: int) -> str:
    if role <= _COPY:
        return _ROLES[role] + leaf.path[len("params"):]
    return f"{_ROLES[role]} {leaf.path}"


def _validate_undoable(undoable: Any) -> bool:
    """``undoable`` as a Python bool: a Python or numpy bool (an option, :func:`~sofx.kernels.user_numbers.flag`)."""
    return flag("undoable", undoable, UnsupportedError)


def _validate_snapshot_limit(limit: Any) -> int | None:
    """``limit`` as a Python int (numpy's and 1-element integer tensors too), or None; a bool, a float or a
    negative number is refused."""
    if limit is None:
        return None
    n = as_integer(limit)
    if n is None or n < 0:
        raise UnsupportedError(f"snapshot_limit_bytes = {limit!r}; expected None or an integer >= 0")
    return n


def _check_snapshot_limit(leaves: Sequence[_Leaf], plans: Sequence[tuple[AdamScalars, str, str] | None],
                          flagged: dict[int, torch.Tensor], limit: int) -> None:
    """Raise :class:`SnapshotLimitError` where the record of ``plans`` would hold more than ``limit`` bytes
    (``flagged``: the flags of the leaves whose checked step flagged chunks, whose records
    :func:`skipped_chunks.finish_step` makes: the snapshot of those chunks, or a whole one)."""

    def need_of(k: int, leaf: _Leaf, strategy: str) -> int:
        if k not in flagged:
            return strategy_snapshot_bytes(strategy, leaf.p, leaf.m, leaf.v)
        return skipped_chunks.finished_bytes(strategy, flagged[k], leaf.p, leaf.m, leaf.v)

    need = sum(need_of(k, leaf, plan[1]) for k, (leaf, plan) in enumerate(zip(leaves, plans)) if plan is not None)
    if need > limit:
        found_in = list(flagged)
        names = ", ".join(leaves[k].path for k in found_in[:3]) + (", ..." if len(found_in) > 3 else "")
        found = (f"; the step found {len(found_in)} {'leaf' if len(found_in) == 1 else 'leaves'} ({names}) where "
                 "an algebraic inverse would be too lossy or the gradient is not finite" if found_in else "")
        raise SnapshotLimitError(f"the undo record would hold {need} bytes of snapshot, more than "
                                 f"snapshot_limit_bytes = {limit}{found}; "
                                 f"{'the step was taken back' if flagged else 'nothing was changed'}", need, limit)


def _count_before(rec: LeafUndo) -> torch.Tensor:
    """The step count ``rec`` restores, as the state holds counts (a 0-d int64 tensor): a record a transform rebuilt
    with numbers holds a Python int there, which restored as it was gave a state the next step refuses."""
    count = rec.count_before
    return count if isinstance(count, torch.Tensor) else torch.tensor(int(count), dtype=torch.int64)


def _check_record_storage(leaf: _Leaf, rec: LeafUndo) -> bool:
    """Raise :class:`UndoError` where a tensor ``rec`` holds (its gradient and the step count it restores, the
    caller's own tensors unless copied; its kept values and chunk list) reaches past the end of its storage
    (:func:`~sofx.kernels.storage.storage_shortfall`: freed since the step, as FSDP frees gradients). The common
    case, an algebraic record's gradient and count contiguous in their storage, is a test each (not under
    ``torch.compile``); returns whether it was that case (the gradient contiguous in its storage, nothing kept)."""
    count = rec.count_before  # (a number where torch.func rebuilt the record with non-tensor leaves)
    if (rec.p_old is None and rec.m_old is None and rec.v_old is None and rec.chunks is None
            and in_storage(rec.grad) and (not isinstance(count, torch.Tensor) or in_storage(count))):
        return True
    for name, t in (("gradient", rec.grad), ("count_before", count), ("kept p", rec.p_old),
                    ("kept m", rec.m_old), ("kept v", rec.v_old), ("kept chunks", rec.chunks)):
        if isinstance(t, torch.Tensor):
            refuse_short_storage(t, lambda: f"{leaf.path}: the record's {name}", UndoError)
    return False


def _check_kept_whole(leaf: _Leaf, rec: LeafUndo) -> None:
    """Raise :class:`UndoError` unless ``rec``'s whole snapshots (``p`` of a ``"param_snapshot"``; ``p, m, v``
    of a ``"snapshot"``) have ``leaf``'s shapes, dtypes and devices: a record of another tree of the same
    structure and step counts (bf16 parameters where these are fp32, say) would be cast into it silently."""
    kept = [("p", rec.p_old, leaf.p)]
    if rec.strategy == "snapshot":
        kept += [("m", rec.m_old, leaf.m), ("v", rec.v_old, leaf.v)]
    for name, old, t in kept:
        if not (isinstance(old, torch.Tensor) and old.shape == t.shape and old.dtype == t.dtype
                and old.device == t.device):
            got = (f"{tuple(old.shape)} {old.dtype} on {old.device}" if isinstance(old, torch.Tensor)
                   else type(old).__name__)
            raise UndoError(f"{leaf.path}: the record keeps {got} of {name}; this leaf's {name} is "
                            f"{tuple(t.shape)} {t.dtype} on {t.device}: the record is not of these params")


def _check_kept_chunks(leaf: _Leaf, rec: LeafUndo) -> None:
    """Raise :class:`UndoError` unless ``rec``'s kept chunks fit ``leaf``: ascending chunk indices within it
    (int64, 1-d, on its device), and as many kept elements of ``p, m, v``, in their dtypes, as they cover;
    ``p, m, v`` of the layout of the record's gradient, dense (the chunks are ranges of their memory in memory
    order: :mod:`sofx.memory_order_leaves`)."""
    layout = "contiguous" if rec.grad.is_contiguous() else f"of strides {rec.grad.stride()}"
    for role, t in enumerate((leaf.p, leaf.m, leaf.v)):
        if not (is_dense(t) and same_layout(t, rec.grad)):
            raise UndoError(f"{_role_name(leaf, role)} is not {layout} (its strides: {t.stride()}): the record keeps "
                            f"chunks of the memory of a leaf {layout}, like the gradient of the step it undoes")
    chunks, n = rec.chunks, leaf.p.numel()
    last = -(-n // FINITE_CHUNK)
    if not (isinstance(chunks, torch.Tensor) and chunks.dtype == torch.int64 and chunks.dim() == 1
            and chunks.device == leaf.p.device and chunks.numel() > 0):
        raise UndoError(f"{leaf.path}: the record's kept chunks are not a non-empty 1-d int64 tensor on "
                        f"{leaf.p.device}")
    if not ascending_chunks(chunks, n):
        raise UndoError(f"{leaf.path}: the record's kept chunks {chunks[:8].tolist()} are not ascending chunk "
                        f"indices of a leaf of {last} chunks")
    want = listed_elements(chunks, n)
    for name, kept, t in (("p", rec.p_old, leaf.p), ("m", rec.m_old, leaf.m), ("v", rec.v_old, leaf.v)):
        if not isinstance(kept, torch.Tensor) or kept.dim() != 1 or kept.numel() != want or kept.dtype != t.dtype \
                or kept.device != t.device:
            got = (f"{tuple(kept.shape)} {kept.dtype} on {kept.device}" if isinstance(kept, torch.Tensor)
                   else type(kept).__name__)
            raise UndoError(f"{leaf.path}: the record keeps {got} of {name} for its chunks; expected ({want},) "
                            f"{t.dtype} on {t.device}")


def validate_grads_finite(grads_finite: Any) -> bool | None:
    """``grads_finite`` as ``None`` or a Python bool: a fact of the gradients the caller may have computed with
    numpy or torch, so a numpy bool or a readable 0-d bool tensor (``torch.isfinite(g).all()``,
    :func:`~sofx.kernels.user_numbers.fact_value`) too; a string, a number or another tensor is refused."""
    if grads_finite is None or grads_finite is True or grads_finite is False:
        return grads_finite
    value = fact_value(grads_finite, "grads_finite", UnsupportedError)
    if is_bool(value):
        return bool(value)
    raise UnsupportedError(f"grads_finite = {grads_finite!r:.80} is invalid; expected None, True or False (a Python "
                           f"or numpy bool, or a 0-d bool tensor whose value can be read), got "
                           f"{_described(grads_finite)}")


def _validate_donate(donate: Any) -> bool:
    """``donate`` as a Python bool: a Python or numpy bool (a string such as ``"no"`` is true, and would donate)."""
    return flag("donate", donate, UnsupportedError)


def _rounded(dtype: torch.dtype, what: str) -> list[str]:
    """``[why]`` when ``what`` (master weights, optimizer states) of ``dtype`` round what an algebraic inverse
    would need exactly, else ``[]``."""
    return [f"{dtype} {what} are rounded"] if dtype in _LOW_PRECISION else []


def _is_fresh(leaf: _Leaf, s: AdamScalars) -> bool:
    """The leaf's first step from all-zero moments (checked on that step only)."""
    if not (is_number(s.step) and s.step == 1) or leaf.traced:
        return False
    return leaf.m.count_nonzero().item() == 0 and leaf.v.count_nonzero().item() == 0


def _all_finite(x: torch.Tensor, grad_scale: Scalar) -> bool:
    """Whether the step of gradient ``x`` can be undone algebraically as far as the gradient goes: every
    element finite and ``|x * grad_scale| <= GRADIENT_LIMIT`` (a larger one's square could overflow the
    second moment, whose inverse would then be nan; the checked kernels flag the same elements). One pass:
    the smallest and largest values (nan if any element is; ``vector_norm(ord=inf)`` was ~15x slower on CPU)."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(in_memory_order(x) if is_dense(x) else x)  # (a transposed one: ~15x faster)
    return bool(torch.maximum(low.neg(), high).float() * abs(grad_scale) <= GRADIENT_LIMIT)


def _decay_term_finite(p: torch.Tensor, weight_decay: float) -> bool:
    """Whether L2 decay's term ``weight_decay * p`` of ``gh = g + weight_decay * p`` is finite and within
    ``GRADIENT_LIMIT`` in every element (as :func:`_all_finite` tests ``g * grad_scale``): with a gradient within
    it, ``gh^2`` cannot overflow the second moment, whose inverse would then be nan (inf - inf). One pass over
    ``p`` (not :func:`_all_finite`'s: a parameter, not a gradient, is read)."""
    if p.numel() == 0:
        return True
    low, high = torch.aminmax(in_memory_order(p) if is_dense(p) else p)
    return bool(torch.maximum(low.neg(), high).float() * abs(weight_decay) <= GRADIENT_LIMIT)


def _scale_no_larger(grad_scale: Scalar, undone: Scalar) -> bool:
    """Whether ``|grad_scale| <= |undone|`` (an undone step's ``grad_scale``), both numbers: a gradient found
    finite and within GRADIENT_LIMIT at ``undone`` is so at ``grad_scale``. False where either cannot be read."""
    return is_number(grad_scale) and is_number(undone) and abs(grad_scale) <= abs(undone)


def _finite_flags(gs: Sequence[torch.Tensor], grad_scale: Scalar, batched: bool) -> list[bool]:
    """``[_all_finite(g, grad_scale) for g in gs]``; ``batched`` (for GPUs): with one read back to the host
    instead of one per tensor (the multi-tensor largest magnitudes: a launch or a few)."""
    if not batched:
        return [_all_finite(g, grad_scale) for g in gs]
    full = [k for k, g in enumerate(gs) if g.numel()]  # (an empty tensor has no largest magnitude)
    out = [True] * len(gs)
    if full:
        tops = torch._foreach_norm([gs[k] for k in full], math.inf)
        for k, ok in zip(full, (torch.stack([x.float() for x in tops]) * abs(grad_scale) <= GRADIENT_LIMIT).tolist()):
            out[k] = ok
    return out


def _chunks_fusable(leaf: _Leaf, rec: LeafUndo | None, plan: tuple[AdamScalars, str, str] | None,
                    copy: torch.Tensor | None, decoupled: bool) -> bool:
    """Whether an undo_redo redoes a ``"chunk_snapshot"`` leaf in one pass (fused undo+redo calls over the
    chunks its record did not keep, step calls from the kept ones: :func:`skipped_chunks.split_by_kept_chunks`),
    as :func:`_fusable` a leaf undone algebraically: the first step from zero moments only where
    :func:`_fused_from_zeros`, a new step needing no snapshot; contiguous memory (the calls are ranges of it)."""
    return (rec is not None and rec.strategy == "chunk_snapshot" and plan is not None
            and (plan[1] == "algebraic" or plan[2] == _NOT_UNDOABLE) and leaf.g is not None and not leaf.traced
            and leaf.g.is_contiguous() and rec.grad.is_contiguous() and (copy is None or copy.is_contiguous())
            and _fused_from_zeros(leaf, rec, plan, decoupled))


def _fusable(leaf: _Leaf, rec: LeafUndo | None, plan: tuple[AdamScalars, str, str] | None, decoupled: bool) -> bool:
    """Whether an undo_redo runs a leaf's undo and redo as one kernel call: the step to undo was inverted
    algebraically (the first from zero moments only where :func:`_fused_from_zeros`) and the new one needs no
    snapshot (undone algebraically, or not to be undone at all: ``undoable=False``) or keeps only the parameter
    it starts from where the undone record kept it whole (``"param_snapshot"`` to ``"param_snapshot"``:
    low-precision masters, ``lr * weight_decay`` near 1): the undone parameter is that tensor exactly, which the
    new record keeps (:func:`_fused_record`). (An algebraic record's undone parameter exists only inside the
    fused kernel, which does not store it: that redo is undone, then stepped.)"""
    return (rec is not None and plan is not None and rec.strategy in _INVERTED
            and (plan[1] == "algebraic" or plan[2] == _NOT_UNDOABLE
                 or (plan[1] == "param_snapshot" and rec.strategy == "param_snapshot"))
            and _fused_from_zeros(leaf, rec, plan, decoupled))


def _fused_record(leaf: _Leaf, rec: LeafUndo, plan: tuple[AdamScalars, str, str]) -> LeafUndo:
    """The record of the redo of a leaf that :func:`_fusable` runs fused (``rec``: the undone step's record),
    undoable: algebraic, or a ``"param_snapshot"`` keeping the undone parameter, ``rec``'s old parameter: that
    very tensor where ``rec`` owns it (``LeafUndo.owns_kept``: a copy made under donation or by an earlier
    undo_redo; nothing writes into it, and ``rec`` is used up), a copy where it may be its caller's tensor (an
    update without donation keeps the caller's own, which the caller may reuse once ``rec`` is used: see
    :meth:`Adam.undo_redo`); either way the new record owns it. The redo of a first step from zero moments is one
    too: its undo zeroes them, as update's. A checked call whose kernel flags chunks finishes it
    (:func:`skipped_chunks.finish_undo_redo`)."""
    p_old = None
    if plan[1] == "param_snapshot":
        p_old = rec.p_old if rec.owns_kept else rec.p_old.clone()
    return LeafUndo(plan[1], leaf.g, plan[0], rec.count_before, p_old, reason=plan[2],
                    moments_were_zero=rec.moments_were_zero, owns_kept=True)


def _fused_from_zeros(leaf: _Leaf, rec: LeafUndo, plan: tuple[AdamScalars, str, str], decoupled: bool) -> bool:
    """Whether the fused undo+redo of ``rec``'s step gives the bits of its undo, then the step ``plan``: always,
    but for a leaf's first step from zero moments (``moments_were_zero``), whose undo zeroes them
    (:func:`_zero_if_fresh`): there only where the inverse gives those zeros back exactly and the fused
    kernel's check of the redo exempts them, as a step from them is exempt (``StepCall.zero_moments``):
    :func:`~sofx.kernels.base.zeros_come_back` of both steps (moments in the compute dtype, float32 for
    float32 and lower-precision parameters; no L2 decay). Elsewhere (L2 decay, bfloat16 moments) the inverse
    leaves a rounding there that a redo with a much smaller gradient (a clip) would magnify."""
    return not rec.moments_were_zero or zeros_come_back(leaf.p, leaf.m, leaf.v, plan[0], decoupled, rec.scalars)


def _fused_from_exact_zeros(leaf: _Leaf, rec: LeafUndo, plan: tuple[AdamScalars, str, str], decoupled: bool) -> bool:
    """Whether the lossiness test of the fused redo (:func:`_fusable`) of ``rec``'s step finds nothing for sure, so
    that :meth:`Adam._snapshot_lossy` leaves it out, as update leaves out a step from zero moments (which undo then
    update, the definition, takes here): ``rec``'s step was a leaf's first from zero moments, fused where its
    inverse gives them back exactly (:func:`_fused_from_zeros`), so the undone ``m`` and ``v`` are exactly 0, and
    :func:`~sofx.kernels.base.lossy_elements` flags such an element only where ``gh^2 * lossy_factor`` (at most
    1/3: betas of at least ``ALGEBRAIC_MIN_BETA``, or the plan would keep a snapshot) is not finite, or ``m'``
    (``(1 - b1)`` times the undone step's effective gradient) sums to a non-finite value. Neither happens where
    ``|gh| <= GRADIENT_LIMIT``: the new gradient read at its ``grad_scale`` (or the caller's ``grads_finite``
    word), or the undone step's own (read then: within the limit at that ``grad_scale``; not again, see
    :meth:`Adam.undo_redo`) at a ``grad_scale`` no larger (a late clip; a loss scale grown). The same gradient at a
    larger one is tested (it may be beyond the limit now)."""
    if not (rec.moments_were_zero and zeros_come_back(leaf.p, leaf.m, leaf.v, plan[0], decoupled, rec.scalars)):
        return False
    return leaf.g is not rec.grad or abs(plan[0].grad_scale) <= abs(rec.scalars.grad_scale)


class _ChunkFlags(NamedTuple):
    """The flags of a checked update (``skip``): one uint8 buffer per device, a view of it per checked leaf."""

    buffers: list[torch.Tensor]
    views: list[torch.Tensor | None]

    def flagged(self) -> list[int]:
        """The leaves with a flagged chunk (one read of each device's buffer when none is)."""
        if not any(bool(b.any()) for b in self.buffers):
            return []
        return [k for k, view in enumerate(self.views) if view is not None and bool(view.any())]


def _chunk_flags(leaves: Sequence[_Leaf], wanted: Sequence[bool]) -> _ChunkFlags:
    """Zeroed flags (``skip`` of a checked step) for the ``wanted`` leaves, None for the others: on each
    leaf's device, one buffer per device, read once after the kernels. A leaf's view is the next
    ``ceil(numel / FINITE_CHUNK)`` flags of its device's buffer, in leaf order (one ``torch.split`` per device:
    a slice per leaf costs a torch call each)."""
    by_device: dict[torch.device, tuple[list[int], list[int]]] = {}  # (leaf indices, sizes) per device
    for k, (leaf, w) in enumerate(zip(leaves, wanted)):
        if w:
            ks, sizes = by_device.setdefault(leaf.p.device, ([], []))
            ks.append(k)
            sizes.append(-(-leaf.p.numel() // FINITE_CHUNK))
    views: list[torch.Tensor | None] = [None] * len(leaves)
    buffers = []
    for device, (ks, sizes) in by_device.items():
        buffer = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
        buffers.append(buffer)
        for k, view in zip(ks, torch.split(buffer, sizes)):
            views[k] = view
    return _ChunkFlags(buffers, views)


def _run_by_backend(pending: Sequence[tuple[int, Any, Any]],
                    run: Callable[[Any, list], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
                    leaves: Sequence[_Leaf] | None = None, checked: str | None = None,
                    roles: Mapping[str, int] = _KERNEL_ROLES,
                    ) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """``(leaf index, results)`` for every ``(leaf index, backend, call)`` of ``pending``: one
    ``run(backend, calls)`` per backend (its ``*_many`` function, which runs many leaves per launch
    where it can). ``leaves``: a backend's refusal of shared memory is named by leaf paths (the call's
    memory was left to the kernel, see :func:`_kernel_checks_memory`; ``roles``: the leaf's role of each of the
    calls' arguments, :data:`_UNDO_KERNEL_ROLES` for undo calls). Every tensor of the calls lies in its
    storage (the caller's, checked by :meth:`Adam._gather`, :func:`_check_record_storage` and
    :func:`_param_copies`; the others made here): the kernels run under
    :func:`~sofx.kernels.base.storage_checked`. ``checked``: the operation (``"step"``, ``"undo"``,
    ``"undo_redo"``) of calls whose every tensor the promise covers Adam checked: :meth:`Adam.update`'s steps,
    :meth:`Adam.undo`'s undos and :meth:`Adam.undo_redo`'s fused calls of :attr:`_Leaf.plain` leaves, the
    undone records' gradients plain too (:meth:`Adam._check_record`), those written checked by
    :func:`_writable_leaves`, ``skip`` flags :func:`_chunk_flags`': run under
    :func:`~sofx.kernels.base.calls_checked` of that operation instead, which promises it."""
    by_backend: dict[int, list[int]] = {}
    for i, (_, backend, _) in enumerate(pending):
        by_backend.setdefault(id(backend), []).append(i)
    out = []
    for members in by_backend.values():
        try:
            with calls_checked(checked) if checked is not None else storage_checked():
                results = run(pending[members[0]][1], [pending[i][2] for i in members])
        except MemoryOverlapError as e:
            if leaves is None:
                raise
            a, b = (_role_name(leaves[pending[members[i]][0]], roles[role]) for i, role in (e.first, e.second))
            raise LeafError(overlap_message(a) if e.first == e.second else shared_memory_message(a, b)) from None
        out += [(pending[i][0], r) for i, r in zip(members, results)]
    return out


def _kernel_checks_memory(kernels: Sequence[Any], in_call: Sequence[bool], leaves: Sequence[_Leaf],
                          copies: Sequence[torch.Tensor | None], donate: bool,
                          record: UndoRecord | None = None) -> bool:
    """Whether the memory of a call is left to its kernel: every leaf goes to it (``in_call``: in its list
    call; a leaf without a gradient has no kernel), one backend, which checks (``CHECKS_OVERLAP``), and the
    call's tensors are each the kernel's to check against the others. A parameter copy that requires grad, or a
    donated inference tensor, is refused here (the kernel writes raw memory; a leaf that requires grad is
    traced, stepped by the reference)."""
    first = kernels[0] if kernels else None
    if not (first is not None and getattr(first, "CHECKS_OVERLAP", False) and all(in_call)
            and all(k is first for k in kernels)):
        return False
    _writable_copies(leaves, copies)
    if donate:
        _writable_leaves(leaves, record)
    return True


def _writable_leaves(leaves: Sequence[_Leaf], record: UndoRecord | None) -> None:
    """The parameter and moments of each leaf the call writes (stepped: it has a gradient; undone: ``record``
    has it) checked writable in place (:func:`check_writable`: not a leaf that requires grad or a view of one,
    not an inference tensor outside inference mode, no overlapping elements). A plain leaf (untraced: it does
    not require grad) is checked whole only where one of its tensors is an inference tensor (a cheap test per
    tensor: this runs for every leaf of every donated call); the overlap of its tensors is its kernel's or
    :class:`MemorySpans`' to refuse."""
    outside_inference = not torch.is_inference_mode_enabled()
    for k, leaf in enumerate(leaves):
        if leaf.g is None and (record is None or record.leaves[k] is None):
            continue  # not written
        if leaf.traced or (outside_inference and (leaf.p.is_inference() or leaf.m.is_inference()
                                                  or leaf.v.is_inference())):
            for role, t in enumerate((leaf.p, leaf.m, leaf.v)):
                check_writable(_role_name(leaf, role), t)


def _writable_copies(leaves: Sequence[_Leaf], copies: Sequence[torch.Tensor | None],
                     ) -> list[tuple[_Leaf, torch.Tensor]]:
    """The ``(leaf, copy)`` pairs that have a parameter copy, each checked writable (a copy may require grad
    while its leaf does not)."""
    copied = [(leaf, c) for leaf, c in zip(leaves, copies) if c is not None]
    for leaf, c in copied:
        check_writable(_role_name(leaf, _COPY), c)
    return copied


def _keeps_callers(undone: _Leaf, rec: LeafUndo | None) -> bool:
    """Whether the undone ``p, m, v`` of a leaf include a tensor that ``rec`` (None: not stepped) may have kept
    from its caller: a record that does not own its kept tensors (``LeafUndo.owns_kept``: an update's without
    donation keeps the caller's own) may hold tensors the caller reuses once the record is used, so a new record
    must copy them (owned ones it takes over)."""
    if rec is None or rec.owns_kept:
        return False
    kept = [t for t in (rec.p_old, rec.m_old, rec.v_old) if t is not None]
    return any(x is t for x in (undone.p, undone.m, undone.v) for t in kept)


def _undo_call(leaf: _Leaf, rec: LeafUndo, donate: bool, copy: torch.Tensor | None) -> UndoCall:
    """The kernel call that inverts ``rec``'s step of ``leaf`` (not a full snapshot; a chunk snapshot's
    kept chunks are put back after it, :func:`skipped_chunks.restore_chunks`)."""
    out = (leaf.p, leaf.m, leaf.v) if donate else None
    p_old = rec.p_old if rec.strategy == "param_snapshot" else None
    return UndoCall(leaf.p, rec.grad, leaf.m, leaf.v, rec.scalars, p_old, out, copy)


def _restore_snapshot(leaf: _Leaf, rec: LeafUndo, donate: bool, copy: torch.Tensor | None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    write_param_copy(copy, rec.p_old)
    if donate:
        return leaf.p.copy_(rec.p_old), leaf.m.copy_(rec.m_old), leaf.v.copy_(rec.v_old), _count_before(rec)
    return rec.p_old, rec.m_old, rec.v_old, _count_before(rec)


def _zero_if_fresh(rec: LeafUndo, m0: torch.Tensor, v0: torch.Tensor, donate: bool,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The undone moments; exactly zero where the step was the first from init."""
    if rec.moments_were_zero:
        m0 = m0.zero_() if donate else torch.zeros_like(m0)
        v0 = v0.zero_() if donate else torch.zeros_like(v0)
    return m0, v0


def _param_copies(spec: tree.TreeSpec, leaves: list[_Leaf], param_copies: Any) -> list[torch.Tensor | None]:
    """One copy target (or None) per leaf, checked: a float tensor of the parameter's shape and device."""
    if param_copies is None:
        return [None] * len(leaves)
    copies = tree.flatten_up_to(spec, param_copies, "param_copies")
    for leaf, c in zip(leaves, copies):
        if c is None:
            continue
        path = f"param_copies{leaf.path[len('params'):]}"
        if not isinstance(c, torch.Tensor):
            raise LeafError(f"{path}: expected a tensor or None, got {type(c).__name__}")
        if not c.dtype.is_floating_point:
            raise LeafError(f"{path}: expected a floating-point tensor, got dtype {c.dtype}")
        _check_dense(path, c)
        if c.shape != leaf.p.shape:
            raise LeafError(f"{path}: expected shape {tuple(leaf.p.shape)}, got {tuple(c.shape)}")
        if c.device != leaf.p.device:
            raise LeafError(f"{path}: expected device {leaf.p.device}, got {c.device}")
        refuse_short_storage(c, path)
    return copies


def _fields_dict_hint(hparams: Any) -> str:
    """Where ``hparams`` is a dict of AdamHParams fields (``{"lr": 1e-3}``, a torch param group's keys), the
    AdamHParams it means, as a hint to append to its refusal; else ''."""
    fields = set(AdamHParams._fields) | {"betas"}
    if not isinstance(hparams, Mapping) or not hparams or not all(isinstance(k, str) and k in fields
                                                                  for k in hparams):
        return ""
    if any(v is None or _is_hparams(v) or isinstance(v, Mapping) for v in hparams.values()):
        return ""  # (a tree of hparams whose keys happen to be field names: a params dict keyed so)
    given = dict(hparams)
    betas = given.pop("betas", None)
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        given.setdefault("beta1", betas[0])
        given.setdefault("beta2", betas[1])
    args = ", ".join(f"{f}={given[f]!r:.40}" for f in AdamHParams._fields if f in given)
    return f"; a dict of AdamHParams fields is not the hparams: sofx.AdamHParams({args})"


def not_an_adam_state(state: Any) -> str:
    """The refusal of ``state`` where an :class:`AdamState` is taken, saying where the Adam state comes from."""
    got = f"state: expected an AdamState, got {type(state).__name__}"
    if isinstance(getattr(state, "opt_state", None), AdamState):
        return f"{got} (a LoopState: its Adam state is loop.opt_state)"
    if isinstance(getattr(state, "inner_state", None), AdamState):
        return (f"{got} (an ApplyIfFiniteState: step it with the apply_if_finite optimizer that made it; the Adam "
                f"state inside is state.inner_state)")
    if isinstance(state, Mapping) and "state" in state and "param_groups" in state:
        return (f"{got} (a torch.optim state_dict(): sofx.checkpoint.from_torch_optim(opt, state_dict, params) "
                f"converts it to (state, hparams))")
    return f"{got} (opt.init(params) makes it)"


_MODULE_PARAMS_HINT = ("sofx steps a pytree of tensors, e.g. {name: p.detach() for name, p in "
                       "model.named_parameters()} with torch.func.functional_call; sofx.offload.SpeculativeAdamW "
                       "takes model.parameters() as torch.optim does")


def _check_param(path: str, p: Any) -> None:
    if not isinstance(p, torch.Tensor):
        raise LeafError(f"{path}: expected a tensor, got {type(p).__name__}{_module_params_hint(p)}")
    if isinstance(p, torch.nn.parameter.UninitializedTensorMixin):  # (~50 ns; torch's ValueError at its first use)
        raise LeafError(tree.uninitialized_refusal(path))
    if not p.dtype.is_floating_point:
        raise LeafError(f"{path}: expected a floating-point tensor, got dtype {p.dtype}")
    _check_dense(path, p)


def _module_params_hint(x: Any) -> str:
    """What to pass instead of a module or an iterator (``model.parameters()``) given as a params leaf, or of a
    container optree takes as one leaf (a dict subclass: :func:`sofx.tree.unwalked_hint`), or ''."""
    if isinstance(x, torch.nn.Module):
        return f" (a module: {_MODULE_PARAMS_HINT})"
    if isinstance(x, collections.abc.Iterator):
        return f" (an iterator, as model.parameters() gives: {_MODULE_PARAMS_HINT})"
    return tree.unwalked_hint(x)


def _check_dense(path: str, x: torch.Tensor) -> None:
    if x.is_nested:  # (of strided layout too: it has no shape, which torch's "Internal error" said)
        raise LeafError(f"{path}: expected a dense (strided) tensor, got a nested tensor ({x.layout}); nested "
                        "tensors are not supported")
    if x.layout != torch.strided:
        raise LeafError(f"{path}: expected a dense (strided) tensor, got layout {x.layout}; sparse tensors are "
                        "not supported (e.g. nn.Embedding(sparse=True) gives sparse gradients)")


def _check_like(tree_name: str, param_path: str, x: Any, p: torch.Tensor, dtype: torch.dtype) -> None:
    """``x`` (the leaf of ``tree_name`` at the parameter's ``param_path``) is a tensor like ``p`` of ``dtype``."""
    if type(x) is torch.Tensor and not x.is_nested and x.shape == p.shape and x.dtype == dtype \
            and x.device == p.device and x.layout is torch.strided:
        return  # the common case, three times per leaf and step
    path = tree_name + param_path[len("params"):]
    if not isinstance(x, torch.Tensor):
        raise LeafError(f"{path}: expected a tensor, got {type(x).__name__}")
    _check_dense(path, x)
    if x.shape != p.shape:
        raise LeafError(f"{path}: expected shape {tuple(p.shape)}, got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise LeafError(f"{path}: expected dtype {dtype}, got {x.dtype}")
    if x.device != p.device:
        raise LeafError(f"{path}: expected device {p.device}, got {x.device}")


def _leaf_alike(p: torch.Tensor, g: Any, m: Any, v: Any, state_dtype: torch.dtype) -> bool:
    """Whether :func:`_check_like` accepts all of a leaf's ``g`` (None where absent; of ``p``'s dtype), ``m`` and
    ``v`` (of ``state_dtype``) by its common case: plain strided tensors of ``p``'s shape and device. One call
    per leaf, ``p``'s shape and device read once (each read builds an object); False: ask :func:`_check_like`,
    which names what is wrong."""
    shape, device, strided = p.shape, p.device, torch.strided
    try:
        return ((g is None or (type(g) is torch.Tensor and g.shape == shape and g.dtype == p.dtype
                               and g.device == device and g.layout is strided))
                and type(m) is torch.Tensor and m.shape == shape and m.dtype == state_dtype and m.device == device
                and m.layout is strided
                and type(v) is torch.Tensor and v.shape == shape and v.dtype == state_dtype and v.device == device
                and v.layout is strided)
    except RuntimeError:  # a nested tensor's shape cannot be read: _check_like names it
        return False


def _in_storage(p: torch.Tensor, g: torch.Tensor | None, m: torch.Tensor, v: torch.Tensor) -> bool:
    """The common case of :func:`_check_storage`, ~1 us a leaf: a leaf's tensors (checked alike: ``g`` of ``p``'s
    shape and dtype, ``m`` and ``v`` of one) contiguous, each in its storage
    (:func:`~sofx.kernels.storage.in_storage`); where all start their storage (offset 0, tensors that own theirs)
    that is ``nbytes`` bytes each, no element size read. False where it cannot tell (one not contiguous, a
    ``torch.func`` wrapper, which has no storage to look at) or one is not."""
    try:
        if p.storage_offset() or m.storage_offset() or v.storage_offset() or (g is not None and g.storage_offset()):
            return in_storage(p) and in_storage(m) and in_storage(v) and (g is None or in_storage(g))
        p_bytes, m_bytes = p.nbytes, m.nbytes
        return (p.is_contiguous() and p.untyped_storage().nbytes() >= p_bytes
                and m.is_contiguous() and m.untyped_storage().nbytes() >= m_bytes
                and v.is_contiguous() and v.untyped_storage().nbytes() >= m_bytes
                and (g is None or (g.is_contiguous() and g.untyped_storage().nbytes() >= p_bytes)))
    except (NotImplementedError, RuntimeError):
        return False


def _check_storage(param_path: str, *leaf: torch.Tensor | None) -> None:
    """Refuse a tensor of the leaf at ``param_path`` (its ``p, g, m, v``, the gradient None where absent) whose
    elements reach past the end of its storage (:func:`~sofx.kernels.storage.storage_shortfall`: its memory freed
    with ``untyped_storage().resize_(0)``, as FSDP frees tensors, or shrunk; the kernels, and torch's own
    operations, would read and write outside any allocation), named by its tree's path (``grads['w']``)."""
    for tree_name, t in zip(_LEAF_TREES, leaf):
        if t is not None:
            refuse_short_storage(t, lambda: tree_name + param_path[len("params"):])


_LEAF_TREES = ("params", "grads", "state.mu", "state.nu")


def _check_count(param_path: str, c: Any, traced: Callable[..., bool], p: torch.Tensor) -> Any:
    """The step count ``c`` (of the parameter ``p`` at ``param_path``) checked, in its storage too
    (:func:`~sofx.kernels.storage.refuse_short_storage`); its value as an int where it can be read (``traced``:
    :func:`~sofx.kernels.base.leaf_tracer`'s function, true of every tensor under ``torch.compile``), else ``c``.
    A meta count of a parameter with data is refused (it holds no value: torch's arithmetic raised a device
    mismatch in the kernel, naming no leaf; an undo restored the record's count without a word)."""
    if not isinstance(c, torch.Tensor) or c.dtype != torch.int64 or c.dim() != 0:
        desc = f"a tensor of dtype {c.dtype} and shape {tuple(c.shape)}" if isinstance(c, torch.Tensor) \
            else type(c).__name__
        raise LeafError(f"state.count{param_path[len('params'):]}: expected a 0-d int64 tensor, got {desc}")
    if traced(c):
        if c.is_meta and not p.is_meta and not torch.compiler.is_compiling():
            raise LeafError(f"state.count{param_path[len('params'):]}: a meta tensor, which holds no value, for a "
                            "parameter with data (a state made by init under torch.device('meta')?); give the step "
                            "count as a 0-d int64 tensor with its value (meta counts go with meta parameters only)")
        return c
    if not in_storage(c):  # (read as a number below: a freed one by torch's error, a shrunk one past its end)
        refuse_short_storage(c, lambda: f"state.count{param_path[len('params'):]}")
    n = c.item()
    if n < 0:
        raise LeafError(f"state.count{param_path[len('params'):]}: step count {n} is negative")
    return n


# The largest step count a state holds (its 0-d int64 tensors): the step from it would count 2^63, no int64.
COUNT_MAX = torch.iinfo(torch.int64).max


def _check_next_count(param_path: str, steps: Any) -> None:
    """Refuse to step the leaf at ``param_path`` from the count ``steps`` (its value, as :func:`_check_count` gives
    it; a traced count is not read) where the step's count ``steps + 1`` is beyond int64: stored, it would wrap to
    ``-2^63``, a count every later call refuses (the step could not even be undone)."""
    if type(steps) is int and steps >= COUNT_MAX:
        raise LeafError(f"state.count{param_path[len('params'):]}: step count {steps} is int64's largest; the next "
                        f"step's count, {steps + 1}, cannot be stored (it would wrap to a negative count)")


def check_step_size(param_path: str, hp: AdamHParams, steps: Any, dtype: torch.dtype) -> None:
    """Refuse (an :class:`HParamError` naming the leaf at ``param_path``, or the offload engine's parameter) a step
    ``t = steps + 1`` with bias correction
    whose step size ``lr / (1 - beta1**t)`` (computed in double precision, as torch.optim's) is beyond the range of
    the dtype the leaf is stepped in (float32, but for float64 leaves): a large lr with a beta1 near 1 at a small
    ``t``. The kernels take it as a number of that dtype: inf there, every parameter stepped to inf or nan (torch.optim
    refuses such a step: "value cannot be converted to type float without overflow"). Values that cannot be read
    (traced) are not. (:func:`sofx.kernels.base.check_step_size`, which every backend's entries check too.)"""
    if type(steps) is not int or steps < 0:
        return  # (a negative count: an undo_redo's record of no step, which its checks refuse)
    # (lr and beta1: numbers where they can be read, resolve_hparams read them; the kernels refuse the same)
    kernel_check_step_size(f"hparams for {param_path}", hp.lr, hp.beta1, steps + 1, dtype == torch.float64, "leaf")


def _hparams_key(hp: AdamHParams, dtype: torch.dtype, meta: bool = False) -> tuple[int, bool, bool]:
    """What :func:`_check_stepped_hparams` checks once: the hparams object, whether its leaf is stepped in
    float32 (every dtype but float64), and whether the leaf is a meta tensor."""
    return id(hp), dtype != torch.float64, meta


def _check_stepped_hparams(hp: AdamHParams, path: str, dtype: torch.dtype, checked: set[tuple[int, bool, bool]],
                           meta: bool = False) -> None:
    """The hparams of a leaf of ``dtype`` that is stepped: their values (:func:`_validate_hparams`), stepped in
    float32 its range (:func:`check_float32_range`), and for a leaf with data (not ``meta``) no meta tensor
    among them (it holds no value: torch's arithmetic raised a device mismatch naming neither); once per
    :func:`_hparams_key` in ``checked``."""
    key = _hparams_key(hp, dtype, meta)
    if key in checked:
        return
    _validate_hparams(hp, "hparams for ", path)
    if key[1]:
        check_float32_range(hp, "hparams for ", path)
    if not meta:
        for name, value in zip(AdamHParams._fields, hp):
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise HParamError(f"hparams for {path}: {name} is a meta tensor, which holds no value, for a leaf "
                                  "with data; give a float or a 0-d tensor with its value (meta hparams go with "
                                  "meta parameters only)")
    checked.add(key)


def _check_defaults(defaults: Any) -> None:
    """The optimizer's defaults: an :class:`AdamHParams` of values :func:`check_hparam_value` takes, none ``None``
    (a step's ``None`` fields fall back to them: ``weight_decay=None`` here reached the kernels as None)."""
    if not isinstance(defaults, AdamHParams):
        raise HParamError(f"defaults: expected an AdamHParams, got {type(defaults).__name__}")
    _validate_hparams(defaults, "defaults")  # (the values given first: it passes None)
    for name, value in zip(AdamHParams._fields, defaults):
        if value is None:
            raise HParamError(f"defaults: {name} = None is invalid; the optimizer's defaults are numbers (a float or "
                              f"a 0-d tensor), which a step's None fields fall back to: None in a step's AdamHParams "
                              f"means the default, not here")


def _validate_hparams(hp: AdamHParams, where: str, path: str = "") -> None:
    """Check every hparam value (:func:`check_hparam_value`); of traced tensors (vmap, grad, compile) only the
    shape. Errors name ``where + path`` (joined only then: this runs for every group of every step)."""
    for name, value in zip(AdamHParams._fields, hp):
        if value is not None:
            check_hparam_value(name, value, where, path)


def check_hparam_value(name: str, value: Any, where: str, path: str = "") -> None:
    """Refuse a value of hparam ``name`` that :meth:`Adam.update` cannot take (an :class:`HParamError` naming
    ``where + path``): not a real number or a 0-d tensor (a bool, a string, a tensor of another shape), or out
    of its range (``lr >= 0``, ``0 <= beta < 1``, ``eps > 0``, ``weight_decay >= 0``, all finite). A numpy
    number is taken, as ``torch.optim`` takes it, and checked as the Python number it holds (what a step reads:
    :meth:`Adam.resolve_hparams` and the kernels' scalars read it so, :func:`~sofx.kernels.base.as_number`). A
    traced tensor's value is not read, its shape is (vmap's per-member shape: 0-d too). Schedules check their
    constants and results with it too."""
    if type(value) is not float:  # a float (the common case, every leaf of every step) needs the range only
        if callable(value) and not isinstance(value, torch.Tensor):  # optax's adam(learning_rate=schedule)
            raise HParamError(f"{where}{path}: {name} is a schedule ({type(value).__name__}), where a value is taken "
                              f"(a float or a 0-d tensor): {_field_schedule_hint(name)}")
        refuse_half_precision(name, value, where, path)
        refuse_unreal_tensor(name, value, where, path)
        given = value
        if is_numpy_real(value):  # (read as the Python number it holds where hparams are read: as_number)
            value = as_number(value, lambda: f"{where}{path}: {name}")
        if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
            raise HParamError(f"{where}{path}: {name} must be a float or a 0-d tensor, got {type(value).__name__}")
        if isinstance(value, torch.Tensor):
            if value.dim() != 0:
                raise HParamError(f"{where}{path}: {name} must be a float or a 0-d tensor, "
                                  f"got shape {tuple(value.shape)}")
            if is_traced(value):
                return
            value = as_number(value, lambda: f"{where}{path}: {name}")
        if name == "eps" and value == 0:
            refuse_eps_held_as_0(given, where, path)
    check_hparam_range(name, value, where, path)


def refuse_eps_held_as_0(given: Any, where: str, path: str = "", label: str | None = None) -> None:
    """Refuse (an :class:`HParamError` naming ``where + path``) an eps ``given`` as a float16, bfloat16 or float32
    number (a numpy one or a concrete 0-d tensor) that holds 0: ``np.float16(1e-8)`` is 0, below half of float16's
    least positive value ``2**-24``, and was refused as "eps = 0.0 ... expected eps > 0", a value the caller never
    wrote. Says it holds 0 in that dtype, and why; another value (a Python 0.0) is left to the range check.
    ``label``: how the value is named instead of ``where + path: eps`` (the offload facade's
    ``param_groups[0]['eps']``, as :func:`refuse_half_precision`'s)."""
    if type(given) is float:  # (the common case, once per group and step)
        return
    tensor = isinstance(given, torch.Tensor)
    # (a numpy scalar, not an array: one of several elements raised numpy's bare "truth value ... is ambiguous")
    kind = str(given.dtype).removeprefix("torch.") if tensor or is_numpy_real(given) else ""
    if kind not in ("float16", "bfloat16", "float32") or (tensor and (given.dim() != 0 or is_traced(given))):
        return
    label = f"{where}{path}: eps" if label is None else label
    value = as_number(given, label)
    if value != 0:
        return
    info = torch.finfo(getattr(torch, kind))
    raise HParamError(f"{label} = {value!r} is invalid; expected eps > 0: given as a {kind} number "
                      f"({given!r:.60}), which holds 0 (an eps below half of {kind}'s least positive value "
                      f"{info.tiny * info.eps!r} rounds to 0 in {kind}); give eps as a Python float")


def refuse_unreal_tensor(name: str, value: Any, where: str, path: str = "") -> None:
    """Refuse (an :class:`HParamError` naming ``where + path``) a tensor of a bool or complex dtype as the value of
    hparam ``name``, naming its dtype and shape (traced too: its dtype is known). Read as its Python value it was
    refused as "got bool" (a 0-d bool tensor taken at construction, its True in range) or raised a bare TypeError
    from a comparison (complex)."""
    if isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.is_complex()):
        raise HParamError(f"{where}{path}: {name} must be a float or a 0-d tensor of a real dtype, got a "
                          f"{value.dtype} tensor of shape {tuple(value.shape)}")


# The hparams torch.optim's for-loop and foreach Adam(W) compute with (1 - beta, beta ** t, lr / bias_correction,
# 1 - lr * weight_decay): numpy arithmetic keeps a float16 number's precision (NEP 50), a tensor's its dtype.
# eps is only added (torch converts it to a double): a half-precision eps steps as the number it holds there too.
_HALF_REFUSED = ("lr", "beta1", "beta2", "weight_decay")


def _half_precision(value: Any) -> str:
    """``"float16"`` or ``"bfloat16"`` for a numpy float16 or a 0-d tensor of either dtype, else ``""``."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.") if value.dtype in _LOW_PRECISION else ""
    return "float16" if type(value).__module__ == "numpy" and type(value).__name__ == "float16" else ""


def refuse_half_precision(name: str, value: Any, where: str, path: str = "", label: str | None = None) -> None:
    """Refuse (an :class:`HParamError` naming ``where + path``) a value of hparam ``name`` of :data:`_HALF_REFUSED`
    that is :func:`_half_precision`. ``label``: how the value is named instead of ``where + path: name`` (the offload
    facade's ``param_groups[0]['betas'][0]``, whose groups torch.optim steps with it). A tensor whose storage does not
    hold its element (freed, shrunk) is refused as that first (:func:`~sofx.kernels.storage.refuse_short_storage`):
    its repr read the freed memory (a segmentation fault)."""
    kind = _half_precision(value) if name in _HALF_REFUSED else ""
    if kind:
        label = f"{where}{path}: {name}" if label is None else label
        if isinstance(value, torch.Tensor) and not in_storage(value):
            refuse_short_storage(value, label, HParamError)
        if name.startswith("beta"):
            example = f"1 - {name} and the bias correction 1 - {name} ** t, rounded to {kind}'s precision"
        else:
            example = (f"1 - lr * weight_decay rounds to 1 below lr * weight_decay = "
                       f"{2 ** -12 if kind == 'float16' else 2 ** -9!r}: no decay")
        raise HParamError(f"{label} = {value!r:.60} is a {kind} number: torch.optim's for-loop and "
                          f"foreach AdamW compute with it in {kind} ({example}), its "
                          f"fused AdamW in float64 as sofx does; give a Python float, float({name}), or a "
                          "float32/float64 number")


def _field_schedule_hint(name: str) -> str:
    """How to give a schedule of hparam ``name``, where it was given as the field's value (``AdamHParams(lr=s)``,
    ``sofx.adamw(lr=s)``: optax's habit)."""
    return (f"a schedule of {name} is given as the whole hparams of the loop steps, "
            f"hparams=sofx.schedules.hparams_schedule({name}=schedule) (sofx.serial.serial_loop_step and "
            f"sofx.speculate.speculative_loop_step evaluate it at each step), or a step takes its value, "
            f"AdamHParams({name}=schedule(step))")


def check_float32_range(hp: AdamHParams, where: str, path: str = "") -> None:
    """Refuse (an :class:`HParamError` naming ``where + path``) hparams that float32, in which the kernels
    step every leaf but float64 ones, cannot hold: an lr or weight_decay beyond its largest value (inf there:
    nan steps), an eps that rounds to 0 (0/0 where a moment is 0). Traced values are not read."""
    for name in ("lr", "weight_decay", "eps"):
        value = as_number(getattr(hp, name))
        if not is_number(value):
            continue
        if value > FLOAT32_MAX or (name == "eps" and value <= F32_ROUNDS_TO_0):
            limit = f"largest {FLOAT32_MAX!r}" if value > FLOAT32_MAX else "an eps this small is 0 there"
            raise HParamError(f"{where}{path}: {name} = {value!r} is beyond float32's range ({limit}); it is "
                              "stepped in float32")


# torch.optim.Adam/AdamW's options that change the math: sofx implements only their default, False (AMSGrad's
# running maximum of v has no algebraic inverse).
TORCH_MATH_OPTIONS = ("amsgrad", "maximize")


def refused_torch_option(options: Mapping[str, Any], refused: Sequence[str] = TORCH_MATH_OPTIONS) -> str | None:
    """The first of ``refused`` that ``options`` (torch.optim's keyword arguments, a param group) sets to a true
    value, or None: the rule :func:`adam`, :func:`adamw` and the offload facade refuse torch's options by."""
    return next((name for name in refused if option_truth(options.get(name)) is not False), None)


# torch.optim.Adam/AdamW's on/off options (foreach and fused: None for "torch picks")
TORCH_FLAG_OPTIONS = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable",
                      "decoupled_weight_decay")


def is_torch_flag(name: str, value: Any) -> bool:
    """Whether ``value`` is a value of torch.optim's on/off option ``name`` (:data:`TORCH_FLAG_OPTIONS`) that
    says on or off: a bool (Python's or numpy's), the int 0 or 1, or None (off, or torch's choice) -- but for
    ``differentiable``, which torch's step hands to ``torch.set_grad_enabled``: a Python bool only (a TypeError
    there for any other, ``np.False_`` too). A str (``"False"``, true to ``if group[name]:``), another number, a
    tensor or a container is none."""
    if name == "differentiable":
        return type(value) is bool
    return is_bool(value) or value is None or (type(value) is int and value in (0, 1))


def torch_non_flag(options: Mapping[str, Any]) -> str | None:
    """The first of torch.optim's on/off options (:data:`TORCH_FLAG_OPTIONS`) that ``options`` (keyword arguments,
    a param group) holds with a value that is no flag (:func:`is_torch_flag`), or None: the rule :func:`adam`,
    :func:`adamw` and the offload facade refuse such a value by, naming the option (torch takes a str ``"False"``
    as on without a word)."""
    return next((name for name in TORCH_FLAG_OPTIONS if name in options and not is_torch_flag(name, options[name])),
                None)


def torch_flag_values(name: str) -> str:
    """The values torch.optim's on/off option ``name`` takes (:func:`is_torch_flag`), as a refusal of a value that is
    no flag says them: True or False for ``differentiable`` (a Python bool), True, False or None for the others (None:
    off, or torch picks; 0 and 1 are taken too, as torch takes them)."""
    return "True or False" if name == "differentiable" else "True, False or None"


def option_truth(value: Any) -> bool | None:
    """``bool(value)``, the truth torch.optim takes an on/off option by (``if group["amsgrad"]:``), or None where
    ``value`` has none (a tensor or numpy array of several elements: torch's bare RuntimeError, numpy's ValueError),
    which the callers refuse naming the option (:func:`refused_torch_option` counts it as set: not the default)."""
    try:
        return bool(value)
    except (RuntimeError, TypeError, ValueError):
        return None


def torch_betas(betas: Any, name: str = "betas") -> tuple[Any, Any]:
    """``betas`` as ``torch.optim.Adam``'s constructor stores them, ``tuple(map(_to_scalar, betas))``: the two
    items of a pair (a tuple or list, or a tensor or numpy array of 2 rows: ``torch.tensor([0.9, 0.999])``
    gives two 0-d tensors, ``np.array([0.9, 0.999])`` two numpy floats), each tensor of 1 element squeezed to
    0-d (``tensor([0.9])`` -> ``tensor(0.9)``). Their values are the caller's to check; anything but 2 items is
    an :class:`HParamError` naming ``name``, and so is a tensor taken apart or squeezed here whose storage does not
    hold its elements (:func:`~sofx.kernels.storage.refuse_short_storage`; torch raised a bare RuntimeError)."""
    if isinstance(betas, (tuple, list)) or getattr(betas, "ndim", 0) >= 1:
        if isinstance(betas, torch.Tensor) and not in_storage(betas):
            refuse_short_storage(betas, name, HParamError)
        items = tuple(betas)
        if len(items) == 2:
            return tuple(_squeezed(b, f"{name}[{i}]") for i, b in enumerate(items))  # type: ignore[return-value]
    raise HParamError(f"{name} must be a pair (beta1, beta2): a tuple or list, or a tensor or numpy array of 2 "
                      f"elements; got {betas!r:.80}")


def _squeezed(x: Any, name: str) -> Any:
    """A tensor of 1 element and more dimensions as its 0-d view (torch.optim's ``_to_scalar``); else ``x``. Such a
    tensor whose storage does not hold its element is refused naming it ``name``."""
    if not (isinstance(x, torch.Tensor) and x.dim() != 0 and x.numel() == 1):
        return x
    if not in_storage(x):
        refuse_short_storage(x, name, HParamError)
    return x.squeeze()


def _refuse_torch_options(who: str, options: Mapping[str, Any], decoupled: bool) -> None:
    """Refuse the options of ``torch.optim.Adam/AdamW`` (taken so that torch's arguments carry over) that sofx
    does not implement, as the offload facade does: ``amsgrad`` or ``maximize`` set (:func:`refused_torch_option`)
    and a ``decoupled_weight_decay`` other than ``decoupled`` (sofx.adam's True is AdamW). Their other options
    are refused where they are no flag (:func:`torch_non_flag`), else ignored (see :func:`adam`)."""
    odd = torch_non_flag(options)
    if odd is not None:
        raise UnsupportedError(f"{who}: {odd}={options[odd]!r:.80} is no flag; expected {torch_flag_values(odd)}")
    name = refused_torch_option(options)
    if name is not None:
        raise UnsupportedError(f"{who}: {name}={options[name]!r} is not supported (only torch.optim's default, "
                               "False)")
    if bool(options.get("decoupled_weight_decay", decoupled)) != decoupled:
        raise UnsupportedError(f"{who}: decoupled_weight_decay={options['decoupled_weight_decay']!r} is AdamW's "
                               "decoupled weight decay; use sofx.adamw")


def _make(decoupled: bool, lr: Scalar, betas: tuple[Scalar, Scalar], eps: Scalar, weight_decay: Scalar,
          bias_correction: bool, state_dtype: torch.dtype | None, undo: str, backend: str) -> Adam:
    beta1, beta2 = torch_betas(betas)
    defaults = AdamHParams(lr, beta1, beta2, eps, weight_decay)
    return Adam(defaults, decoupled=decoupled, bias_correction=bias_correction, state_dtype=state_dtype,
                undo=undo, backend=backend)


def adam(lr: Scalar = 1e-3, betas: tuple[Scalar, Scalar] = (0.9, 0.999), eps: Scalar = 1e-8,
         weight_decay: Scalar = 0.0, amsgrad: bool = False, *, foreach: bool | None = None, maximize: bool = False,
         capturable: bool = False, differentiable: bool = False, fused: bool | None = None,
         decoupled_weight_decay: bool = False, bias_correction: bool = True,
         state_dtype: torch.dtype | None = None, undo: str = "auto", backend: str = "auto") -> Adam:
    """Adam with L2 weight decay, as ``torch.optim.Adam``. Per element, at a leaf's ``t``-th step::

        g <- g + wd * p
        m <- b1 * m + (1 - b1) * g                v <- b2 * v + (1 - b2) * g^2
        p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    (``bias_correction=False``: both ``1 - b^t`` are 1). ``state_dtype``: the moments' dtype (default: the
    parameter's); ``undo``: ``"auto" | "algebraic" | "exact"``; ``backend``: ``"auto" | "reference" | "cpu"
    | "cpu_fast" | "triton"``. The hparams given here are the defaults of every :class:`AdamHParams`;
    ``betas`` as ``torch.optim.Adam`` takes them (:func:`torch_betas`: a pair, or a tensor or numpy array of 2
    elements; a 1-element tensor squeezed to 0-d).
    ``torch.optim.Adam``'s other options carry over: ``amsgrad``, ``maximize`` and ``decoupled_weight_decay``
    are accepted at their default (False) only (True raises :class:`~sofx.errors.UnsupportedError`);
    ``foreach``, ``fused``, ``capturable`` (torch's implementation) and ``differentiable`` (the update is
    differentiable wherever its inputs are traced) take any flag and are ignored. A value of any of torch's options that
    is no flag (a str such as ``"False"``, which torch takes as on; a number but 0 and 1; a tensor; ``differentiable``
    not a bool, as torch's step requires) is refused naming the option (:func:`torch_non_flag`).
    """
    _refuse_torch_options("sofx.adam", {"amsgrad": amsgrad, "maximize": maximize, "foreach": foreach, "fused": fused,
                                        "capturable": capturable, "differentiable": differentiable,
                                        "decoupled_weight_decay": decoupled_weight_decay}, decoupled=False)
    return _make(False, lr, betas, eps, weight_decay, bias_correction, state_dtype, undo, backend)


def adamw(lr: Scalar = 1e-3, betas: tuple[Scalar, Scalar] = (0.9, 0.999), eps: Scalar = 1e-8,
          weight_decay: Scalar = 1e-2, amsgrad: bool = False, *, maximize: bool = False, foreach: bool | None = None,
          capturable: bool = False, differentiable: bool = False, fused: bool | None = None,
          bias_correction: bool = True, state_dtype: torch.dtype | None = None, undo: str = "auto",
          backend: str = "auto") -> Adam:
    """AdamW: decoupled weight decay, as ``torch.optim.AdamW``. Per element, at a leaf's ``t``-th step::

        p <- p * (1 - lr * wd)
        m <- b1 * m + (1 - b1) * g                v <- b2 * v + (1 - b2) * g^2
        p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    Arguments as :func:`adam` (``torch.optim.AdamW`` has no ``decoupled_weight_decay``).
    """
    _refuse_torch_options("sofx.adamw", {"amsgrad": amsgrad, "maximize": maximize, "foreach": foreach,
                                         "fused": fused, "capturable": capturable, "differentiable": differentiable},
                          decoupled=True)
    return _make(True, lr, betas, eps, weight_decay, bias_correction, state_dtype, undo, backend)


def shown_step(step: int) -> int | str:
    """``step`` as an error message shows it: under ``torch.compile`` a step that changes from call to call is a
    symbolic int, which no f-string takes (dynamo's "BUILD_STRING type error", or a recompile per value), shown as
    ``"<traced>"``."""
    return "<traced>" if torch.compiler.is_compiling() else step


def hparams_at(hparams: Any, step: int, name: str = "hparams") -> Any:
    """``hparams(step)`` for a schedule (any callable), ``hparams`` itself otherwise (``name``: the argument's, in
    the errors).

    Only the whole hparams may be a schedule. A number where hparams are expected (a float schedule such as
    ``cosine_decay(...)`` given as the hparams, or what a schedule returned) and a schedule inside an hparams tree
    (one per group: never evaluated) are refused, an :class:`HParamError` saying how to give them:
    ``hparams_schedule(lr=schedule)``, or one callable returning the whole tree
    (``lambda t: group_hparams(labels, groups, base=schedule(t))``).

    ``step`` (the steps taken so far) is an integer >= 0: a Python int, or a numpy or 1-element integer tensor
    read as its int, as the schedules read theirs; anything else (-1, 2.0, True, a string) is refused before a
    schedule runs, an :class:`HParamError` naming ``name: step`` (a custom schedule took it without a word)."""
    if not (type(step) is int and step >= 0):  # (the common case, every step: a Python int; a guard under compile)
        step = integer(f"{name}: step", step, 0)
    if not callable(hparams):
        check_step_hparams(hparams, name)
        return hparams
    value = hparams(step)
    shown = shown_step(step)
    if is_hparams_number(value):
        raise HParamError(f"{name}: the schedule {hparams!r:.80} returned {value!r:.40} ({type(value).__name__}) at "
                          f"step {shown}, a number; the hparams of a step are an AdamHParams or a tree of them (one "
                          f"per param group): {WRAP_HINT}")
    check_step_hparams(value, f"{name}(step={shown})")
    return value
