"""The decision logic of speculation: pure functions on numbers, no tensor touched.

An engine calls :func:`begin_step` when the backward of the last micro-step
starts, :func:`on_block_ready` when a block's gradient is final,
:func:`on_late_gradient` when a second gradient arrives for a block that was
already ready, and :func:`plan_validation` in ``step()``. Each returns new
immutable values; the engine carries the tensor work out with
:mod:`sofx.speculation.apply` wherever it likes (inline, a thread, a process).

Decisions (SPECULATION.md section 3):

* a ready block is speculated iff the step may speculate (enabled, last
  micro-step, adaptive policy not paused, every block's hparams ones
  ``Adam.update`` takes), speculation was not vetoed, its
  gradient is finite, and it is eligible (its undo strategy exists and its
  snapshot fits in the remaining budget); a speculative step that finds in
  itself a need for more snapshot than is left (``undo="auto"``'s test of the
  inverse's precision) is taken back and reported with
  :func:`on_speculation_refused`; one that keeps another amount than planned
  reports it with :func:`on_speculation_held`;
* early veto: once the running sum of squares of the ready blocks exceeds
  ``(max_norm * S)**2`` (``S`` the scale the speculative steps unscale with),
  clipping is certain: no further block is speculated this step. A
  non-finite gradient vetoes too;
* validation derives the global facts exactly as the serial loop does
  (:func:`sofx.serial.step_facts`) and, per block: overflow -> ``undo`` what
  was speculated, ``skip`` the rest; otherwise a speculated block is
  ``commit``-ted iff its multiplier, hparams and gradient (no late one, the same
  sum of squares) are the final ones,
  else ``undo_redo``; a block that was not speculated is stepped (``step``);
  a block with no gradient is ``skip``-ped (``missing_grad="skip"``) or
  stepped with zeros (``"zero"``).
"""

from __future__ import annotations

import copy
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence, Union

from sofx import tree
from sofx.adam import Adam, AdamHParams, check_float32_range, check_hparam_value, check_step_hparams
from sofx.errors import HParamError, SofxError
from sofx.kernels.base import as_number
from sofx.kernels.user_numbers import _described, as_integer, fact_value, flag, integer, is_bool, real_number
from sofx.loss_scale import LossScaler, LossScaleRuleError, LossScaleState, MinLossScaleError, inverse_scale
from sofx.required import REQUIRED
from sofx.serial import (StepFacts, _facts_without_gradients, _keyword_names, _missing, _positional_names,
                         _scale_after, can_unscale, check_max_norm, check_opt, check_profile, check_scale,
                         clip_max_norm, loss_scale_of, local_sumsq, reduced_sumsq, refuse_reduce,
                         refuse_unknown_keywords, step_facts, step_settings, without_gradients)
from sofx.speculation.policy import AdaptivePolicy, PolicyState, checked_policy_state
from sofx.step_report import StepReport
from sofx.transforms import MISSING_GRAD_MODES, total_sumsq
from sofx.undo_record import STRATEGIES

__all__ = [
    "SpeculationConfig",
    "StepContext",
    "Eligibility",
    "BlockDecision",
    "BackwardTally",
    "BlockAction",
    "ValidationPlan",
    "DECISION_KINDS",
    "ACTION_KINDS",
    "begin_step",
    "on_block_ready",
    "on_late_gradient",
    "on_speculation_refused",
    "on_speculation_held",
    "plan_validation",
    "resolve_block_hparams",
]

# A block whose unscaled gradient norm exceeds this is not speculated: g*g may overflow
# float32 in the step, and a step with non-finite moments cannot be undone.
UNDO_SAFE_NORM = 1e18

# Why a ready block was or was not speculated.
# ("refused": speculated, then taken back as it ran, see on_speculation_refused)
DECISION_KINDS = ("speculate", "disabled", "micro_step", "policy", "vetoed", "ineligible", "budget", "refused")
ACTION_KINDS = ("commit", "undo_redo", "undo", "step", "skip")


def _new_context_id() -> int:
    """A fresh context's id, which its tally carries (one of another step is refused): 63 random bits from the
    system (no counter kept in the module, and the user's ``random`` stream left alone)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


@dataclass(frozen=True)
class SpeculationConfig:
    """Static configuration of speculation for a training run.

    ``max_norm``: global-norm clipping (``None``: none; a number >= 0, inf
    included, numpy or a 1-element tensor, stored as a float: 0 zeroes every
    gradient under the ``"torch"`` profile, where nothing is speculated, and
    does not clip under ``"deepspeed"``, :func:`sofx.serial.clip_max_norm`).
    ``profile``: ``"torch"``
    or ``"deepspeed"`` (:mod:`sofx.serial`). ``missing_grad``: ``"skip"`` or
    ``"zero"``. ``snapshot_budget_bytes``: the most snapshot memory the
    speculative steps of one step may hold (``None``: unlimited; ``0``: only
    algebraically undoable blocks are speculated). A block is not speculated
    where its undo strategy says beforehand that its snapshot would not fit; a
    speculative step that finds the need itself (``Adam.update``'s test of the
    inverse's precision: a gradient that dominates the moments) is taken back
    (:func:`on_speculation_refused`) and stepped in validation. ``policy``: the
    :class:`AdaptivePolicy`. ``predict_scale``: with the deepspeed profile,
    speculate with the scale the loss scaler will have after a clean step
    (which is what ZeRO unscales with), so that a scale growth costs no
    undo+redo; ``False`` speculates with the scale of the backward.
    ``enabled=False`` never speculates (every block is stepped in validation).
    """

    max_norm: float | None = None
    profile: str = "torch"
    missing_grad: str = "skip"
    snapshot_budget_bytes: int | None = None
    policy: AdaptivePolicy = field(default_factory=AdaptivePolicy)
    predict_scale: bool = True
    enabled: bool = True

    def __post_init__(self) -> None:
        check_profile(self.profile)
        # read once as a float (a numpy or tensor max_norm made the veto threshold a tensor)
        object.__setattr__(self, "max_norm", check_max_norm(self.max_norm))
        if self.missing_grad not in MISSING_GRAD_MODES:
            raise HParamError(f"missing_grad={self.missing_grad!r}; expected one of {MISSING_GRAD_MODES}")
        if self.snapshot_budget_bytes is not None:  # read once as a Python int (numpy's was refused)
            object.__setattr__(self, "snapshot_budget_bytes",
                               integer("snapshot_budget_bytes", self.snapshot_budget_bytes, 0))
        if not isinstance(self.policy, AdaptivePolicy):
            raise HParamError(f"policy must be an AdaptivePolicy, got {type(self.policy).__name__}")
        for name in ("predict_scale", "enabled"):  # Python bools ("no" was stored, and read as true)
            object.__setattr__(self, name, flag(f"SpeculationConfig.{name}", getattr(self, name)))


@dataclass(frozen=True)
class StepContext:
    """The facts assumed while the backward of one step runs (made by :func:`begin_step`).

    ``hparams[i]``: block ``i``'s complete hparams for speculative steps.
    ``backward_scale``: the loss scale of this backward. ``assumed_scale``: the
    scale speculative steps unscale with; ``grad_scale = 1/assumed_scale`` is
    their Adam multiplier, as validation's for an unclipped step (under ``"torch"`` GradScaler's ``float32(1/S)``,
    :func:`~sofx.loss_scale.inverse_scale`; inf for a scale of 0, which never speculates).
    ``veto_sumsq = (max_norm * assumed_scale)**2`` (inf without clipping).
    ``speculating``/``reason``: whether this step may speculate, and why not.
    ``float64[i]``: block ``i`` is stepped in float64, so its hparams are not held to float32's range (here and
    in validation; :func:`begin_step`'s ``float64``). ``context_id``: this context's random id, which its
    tally carries (a tally of another step is refused). ``applied_cells[i]``: whether block ``i``'s action of this
    step was carried out, the one marker the actions of every plan of this step share for that block
    (:class:`BlockAction`: a plan made again applies nothing a first one applied).
    """

    n_blocks: int
    config: SpeculationConfig
    scaler: LossScaler
    scaler_state: LossScaleState
    policy_state: PolicyState
    defaults: AdamHParams
    hparams: tuple[AdamHParams, ...]
    backward_scale: float
    assumed_scale: float
    grad_scale: float
    veto_sumsq: float
    speculating: bool
    kind: str
    reason: str
    float64: tuple[bool, ...] = ()
    context_id: int = 0
    applied_cells: dict[int, list[bool]] = field(default_factory=dict, compare=False, repr=False)


class Eligibility(NamedTuple):
    """Whether a block's speculative step could be undone: the strategy ``Adam.update``
    would choose, why, and the snapshot bytes it would hold."""

    eligible: bool
    strategy: str | None
    reason: str
    snapshot_bytes: int = 0


class _OfStep:
    """The step a decision or action is of: its :class:`StepContext`'s ``context_id``, kept with it (not one of its
    fields, so that decisions and actions compare by their fields, as before) and carried to its copies (its
    ``_replace``, ``copy.copy``, a pickled copy). ``0``: not known (one made by hand)."""

    __slots__ = ()

    @property
    def context_id(self) -> int:
        """The ``context_id`` of the step (:func:`begin_step`'s context) it is of; ``0``: not known."""
        return self.__dict__.get("_context_id", 0)  # type: ignore[attr-defined]

    def _of_step(self, context_id: int) -> Any:
        self.__dict__["_context_id"] = context_id  # type: ignore[attr-defined]
        return self


class _OnceOfStep(_OfStep):
    """A decision or action of a step that is carried out once: whether it was is a one-element list ``[done]`` kept
    with it (in its ``__dict__`` under ``_CELL``, not one of its fields, so that they compare by their fields), made
    with it (torch.compile guards a cell it finds, not one made while it traces the first application, whose
    compiled code then applied the action again) and shared with its copies (``_replace``, ``copy.copy``,
    ``copy.deepcopy``: a deep copy carried out after the original would step its block again).

    A pickled copy cannot share the cell: it notes the process that pickled it first (``_PICKLED_IN``, the id of the
    process where the original lives), and :meth:`pickled_here` tells the functions that carry it out to refuse it
    there (carried out after the original, it stepped its block again); in another process (the offload engine's
    worker) it is the one carried out."""

    __slots__ = ()
    _CELL = ""  # the subclass's key of the cell in __dict__
    _PICKLED_IN = "_pickled_in"

    def __getstate__(self) -> dict[str, Any]:
        # (pickle's state: the cell as it is now, and the first pickling process, kept through copies of copies)
        self._once_cell()
        state = dict(self.__dict__)  # type: ignore[attr-defined]
        state.setdefault(self._PICKLED_IN, os.getpid())
        return state

    def __copy__(self) -> Any:
        # (copy.copy shares the cell, as before __getstate__ marked what pickle and copy.copy's reduction make)
        self._once_cell()
        new = type(self).__new__(type(self), *tuple(self))  # type: ignore[arg-type]
        new.__dict__.update(self.__dict__)  # type: ignore[attr-defined]
        return new

    def pickled_here(self) -> bool:
        """Whether this is a pickled copy loaded in the process that pickled it (where the original it shares no
        marker with lives): refused where it would be carried out."""
        pickled_in = self.__dict__.get(self._PICKLED_IN)  # type: ignore[attr-defined]
        return pickled_in is not None and pickled_in == os.getpid()  # (no getpid traced where not: torch.compile)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        new = super().__new__(cls, *args, **kwargs)  # type: ignore[call-arg]
        new.__dict__[cls._CELL] = [False]
        return new

    def _replace(self, **changes: Any) -> Any:
        new = super()._replace(**changes)  # type: ignore[misc]
        self._once_cell()
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # (fields and context_id deep-copied, the cell shared)
        cell = self._once_cell()
        new = type(self).__new__(type(self), *copy.deepcopy(tuple(self), memo))  # type: ignore[arg-type]
        memo[id(self)] = new
        for key, value in self.__dict__.items():  # type: ignore[attr-defined]
            new.__dict__[key] = cell if key == self._CELL else copy.deepcopy(value, memo)
        return new

    def _once_cell(self) -> list[bool]:
        """The ``[done]`` cell (one made by ``_make``, which bypasses ``__new__``, gets it here)."""
        return self.__dict__.setdefault(self._CELL, [False])  # type: ignore[attr-defined]


class _BlockDecisionFields(NamedTuple):
    """:class:`BlockDecision`'s fields."""

    block: int
    speculate: bool
    kind: str
    reason: str
    hparams: AdamHParams
    grad_scale: float
    strategy: str | None = None
    snapshot_bytes: int = 0
    snapshot_budget_bytes: int | None = None


class BlockDecision(_OnceOfStep, _BlockDecisionFields):
    """What :func:`on_block_ready` decided for one block.

    ``speculate``: take the speculative step now, with ``hparams`` and
    ``grad_scale``. ``kind`` is one of :data:`DECISION_KINDS`; ``reason`` says why.
    ``snapshot_bytes``: what the block's undo strategy says its snapshot holds.
    ``snapshot_budget_bytes``: the configuration's. The speculative step may keep
    what is left of it once the steps before it have kept theirs (``Adam.update``'s
    ``snapshot_limit_bytes``); a step that finds in itself a need for more (a
    gradient that dominates the moments) is taken back, and
    :func:`on_speculation_refused` records that.

    ``context_id`` (not a field: :class:`_OfStep`): that of the step's :class:`StepContext`; its speculative step's
    record notes it, and :func:`~sofx.speculation.apply.apply_block_action` refuses the record with an action of
    another step (validation checked this step's decision, not the one the block was stepped with).

    A decision is one block's speculative step of one step: whether that step was taken is kept with the decision
    (not one of its fields), shared with its copies (``_replace``, ``copy.copy``, ``copy.deepcopy``), and
    :func:`~sofx.speculation.apply.speculative_block_step` refuses a second one (a decision kept from an earlier
    step, a retry), before anything is written. A pickled copy (the offload engine's process executor sends the
    decision to its worker) carries whether the step was taken when it was pickled, and is its own from then on in
    another process; in the process that pickled it (where the original lives, sharing nothing with it) it is
    refused.
    """

    # (no __slots__: each decision's __dict__ holds its step's "_context_id" and its "_used" cell, a one-element
    # list shared with its copies)

    _CELL = "_used"

    def used_cell(self) -> list[bool]:
        """``[used]``: whether the decision's speculative step (of it or a copy) was taken, shared with its copies."""
        return self._once_cell()


class BackwardTally(NamedTuple):
    """The immutable running record of one backward.

    ``sumsq``: running sum of squares of the ready blocks (arrival order; for
    the veto only). ``block_sumsq[i]``/``decisions[i]``: block ``i``'s sum of
    squares and decision (``None`` until ready). ``late``: blocks that got a
    gradient after being ready. ``snapshot_bytes``: snapshot memory held by the
    speculative steps so far. ``undone``: speculated blocks whose step the caller
    undid when a late gradient came (``on_late_gradient(undone=True)``). ``context_id``: that of the
    :class:`StepContext` :func:`begin_step` made with it.
    """

    sumsq: float
    vetoed: bool
    veto_reason: str
    block_sumsq: tuple[float | None, ...]
    decisions: tuple[BlockDecision | None, ...]
    late: frozenset[int]
    snapshot_bytes: int
    undone: frozenset[int] = frozenset()
    context_id: int = 0


class _BlockActionFields(NamedTuple):
    """:class:`BlockAction`'s fields."""

    block: int
    kind: str
    reason: str
    grad_scale: float
    hparams: AdamHParams
    zero_grad: bool = False
    speculated: bool = False


class BlockAction(_OnceOfStep, _BlockActionFields):
    """What validation does to one block; ``kind`` is one of :data:`ACTION_KINDS`.

    ``grad_scale``/``hparams``: the final multiplier and hparams for ``step``
    and ``undo_redo``. ``zero_grad``: step with a zero gradient (missing
    gradient, ``missing_grad="zero"``). ``speculated``: a speculative step was taken. ``context_id`` (not a
    field, :class:`_OfStep`): that of the step's :class:`StepContext`, as its decisions'.

    An action that writes (``step``, ``undo``, ``undo_redo``) is carried out once, as a record is used once
    (one step per block per step): whether it was is kept with the action (not one of its fields, so that
    actions compare by their fields), shared with its copies (``_replace``, ``copy.copy``, ``copy.deepcopy``: as an
    undo record's deep copy shares whether it was used), and :func:`~sofx.speculation.apply.apply_block_action`
    refuses a second application. The actions of one block in every plan of one step share it too (the step's
    :class:`StepContext` keeps it: :func:`plan_validation` called again makes actions that are applied once with the
    first's). A pickled copy (the offload engine's process executor sends the action to its worker) carries whether
    the action was applied when it was pickled, and is its own from then on: nothing ties it to the original in
    another process, so the action is applied where it was sent, and the original is not (an ``undo`` or
    ``undo_redo`` is guarded by its record too, which cannot be pickled; a ``step`` is not). In the process that
    pickled it, where the original lives, a copy that writes is refused (applied after the original, it stepped the
    block again).
    """

    # (no __slots__: each action's __dict__ holds its "_applied" cell, a one-element list shared with its copies,
    # and its step's "_context_id")

    _CELL = "_applied"

    def applied_cell(self) -> list[bool]:
        """``[applied]``: whether the action (or a copy of it) was carried out, shared with its copies."""
        return self._once_cell()


class ValidationPlan(NamedTuple):
    """The outcome of :func:`plan_validation`.

    Apply ``actions`` (one per block), then carry ``scaler_state`` and
    ``policy_state`` to the next step. If ``error`` is not ``None`` (an
    overflow at DeepSpeed's minimum loss scale; the loss-scale rule failed, a
    :class:`~sofx.loss_scale.LossScaleRuleError`), ``actions`` undo every
    speculative step: apply them, then raise ``error`` (``scaler_state`` and
    ``policy_state`` are the step's own: nothing moved).
    """

    facts: StepFacts | None
    actions: tuple[BlockAction, ...]
    scaler_state: LossScaleState
    policy_state: PolicyState
    report: StepReport
    error: Exception | None = None


EligibilityLike = Union[Eligibility, Callable[[], Eligibility]]


def _is_hparams(x: Any) -> bool:
    return isinstance(x, AdamHParams)


def resolve_block_hparams(defaults: AdamHParams, hparams: Any, n_blocks: int) -> tuple[AdamHParams, ...]:
    """One complete :class:`AdamHParams` per block from ``None``, one ``AdamHParams`` for
    all blocks, or a sequence of ``n_blocks`` of them (``None`` fields take ``defaults``). ``n_blocks`` no integer
    >= 0: an :class:`HParamError` naming it (a str's, a float's, None's bare TypeError; -1 gave no block, True one)."""
    if type(n_blocks) is not int or n_blocks < 0:  # (an int, begin_step's already checked one, read as is)
        n_blocks = integer("n_blocks", n_blocks, 0)
    if hparams is None:
        hparams = AdamHParams()
    if not _is_hparams(hparams):
        if not isinstance(hparams, Sequence) or isinstance(hparams, (str, bytes)):
            check_step_hparams(hparams, "hparams", evaluated=False)  # a schedule: how to give its value
            raise HParamError(f"hparams: expected an AdamHParams or a sequence of {n_blocks} of them, "
                              f"got {type(hparams).__name__}")
        hparams = list(hparams)
    spec = tree.flatten(list(range(n_blocks)))[1]
    per_block = tree.broadcast_prefix(hparams, spec, is_leaf=_is_hparams, what="hparams", root="blocks")
    out = []
    for i, hp in enumerate(per_block):
        hp = AdamHParams() if hp is None else hp
        if not _is_hparams(hp):
            check_step_hparams(hparams, "hparams", evaluated=False)
            raise HParamError(f"hparams for blocks[{i}]: expected an AdamHParams, got {type(hp).__name__}")
        # concrete tensors read now: validation compares these values, not tensors changed in place since
        out.append(AdamHParams(*(as_number(d if x is None else x, lambda f=f: f"hparams for blocks[{i}]: {f}")
                                 for f, x, d in zip(AdamHParams._fields, hp, defaults))))
    return tuple(out)


def begin_step(opt: Adam, config: SpeculationConfig, scaler: LossScaler, scaler_state: LossScaleState,
               policy_state: PolicyState | None = None, *, n_blocks: int, hparams: Any = None,
               backward_scale: float | None = None, last_micro_step: bool = True,
               float64: Sequence[bool] | None = None,
               stepped: Sequence[bool] | None = None) -> tuple[StepContext, BackwardTally]:
    """The context and an empty tally for the backward that is about to run.

    ``opt`` supplies the hparams defaults; ``hparams`` are this step's
    (``None``, one :class:`AdamHParams`, or one per block). ``backward_scale``
    is the loss scale this backward multiplies the loss by (default:
    ``scaler.scale(scaler_state)``). Speculation only happens in the backward
    of the last micro-step (``last_micro_step=True``), and not where a block's
    hparams are ones :meth:`sofx.Adam.update` refuses (:func:`_refused_block_hparams`:
    the context's ``reason`` gives its error, naming ``blocks[i]``; validation
    refuses them for a block it steps). ``float64[i]``: block ``i`` is stepped in
    float64 (its parameter is float64), so its hparams are not held to float32's
    range, here nor in :func:`plan_validation` (default: every block is stepped in
    float32, as the offload engine's masters). ``stepped[i]``: block ``i`` may be stepped this step (it may get a
    gradient, or is stepped with a zero one under ``missing_grad="zero"``); the
    hparams of a block that is not (a frozen group's) are not read, as
    :func:`sofx.serial.serial_step` does not read them, and veto nothing
    (default: every block may be stepped).
    """
    check_opt(opt)  # (a torch.optim optimizer's defaults were read as hparams)
    if not isinstance(config, SpeculationConfig):
        raise HParamError(f"config must be a SpeculationConfig, got {type(config).__name__}")
    n_blocks = integer("n_blocks", n_blocks, 0)
    # a Python bool ("no" was read as true: speculation during an earlier micro-step's backward)
    last_micro_step = flag("last_micro_step", fact_value(last_micro_step, "last_micro_step"))
    policy_state = config.policy.init() if policy_state is None else policy_state
    if type(policy_state) is not type(config.policy.init()):
        raise HParamError(f"policy_state is {tree.article(type(policy_state).__name__)}; the policy's state is a "
                          f"{type(config.policy.init()).__name__} (as config.policy.init() makes it)")
    policy_state = checked_policy_state(policy_state)
    hps = resolve_block_hparams(opt.defaults, hparams, n_blocks)
    current = loss_scale_of(scaler, scaler_state)
    s_back = current if backward_scale is None else check_scale("backward_scale", backward_scale)
    unpredicted = None
    if config.profile == "deepspeed" and config.predict_scale:
        # (through the rule's calls as a step makes them: a custom rule's failure is a LossScaleRuleError; its own
        # ValueError escaped begin_step, where the serial loop raises on a clean step only, at validation)
        try:
            assumed = _scale_after("deepspeed", scaler, scaler_state, False)[1]
        except LossScaleRuleError as exc:
            assumed, unpredicted = s_back, exc
    elif config.profile == "deepspeed":
        assumed = s_back
    else:
        assumed = s_back  # GradScaler unscales with the scale of this backward
    max_norm = clip_max_norm(config.profile, config.max_norm)
    veto = _veto_sumsq(max_norm, assumed)
    allowed, why = config.policy.allows(policy_state)
    wide = tuple(_block_flags("float64", float64, len(hps), False))
    refused = _refused_block_hparams(hps, wide, _block_flags("stepped", stepped, len(hps), True))
    if not config.enabled:
        speculating, kind, reason = False, "disabled", "speculation is disabled"
    elif not last_micro_step:
        speculating, kind, reason = False, "micro_step", "not the last micro-step (gradients are still accumulating)"
    elif not allowed:
        speculating, kind, reason = False, "policy", why
    elif unpredicted is not None:
        speculating, kind = False, "vetoed"
        reason = (f"the scale of a clean step cannot be predicted: {unpredicted}; no block is speculated (validation "
                  "asks the rule again: a clean step raises there, an overflow is skipped)")
    elif refused is not None:
        speculating, kind = False, "vetoed"
        reason = (f"{refused}: a speculative step cannot take these hparams, so no block is speculated; "
                  "validation refuses them for a block it steps")
    elif not can_unscale(assumed):
        speculating, kind = False, "vetoed"
        reason = (f"the loss scale {assumed:g} cannot unscale the gradients (1/S is not a finite float32): "
                  "the step will be skipped as an overflow")
    elif max_norm == 0:
        speculating, kind = False, "vetoed"
        reason = ("max_norm = 0 clips every step to zero gradients (clip_grad_norm_'s coef = 0): no speculative "
                  "step could stand; the blocks are stepped in validation")
    else:
        speculating, kind, reason = True, "speculate", ""
    context_id = _new_context_id()
    ctx = StepContext(n_blocks, config, scaler, scaler_state, policy_state, opt.defaults, hps, s_back, assumed,
                      _assumed_multiplier(config.profile, assumed), veto, speculating, kind, reason, wide, context_id)
    tally = BackwardTally(0.0, False, "", (None,) * n_blocks, (None,) * n_blocks, frozenset(), 0, frozenset(),
                          context_id)
    return ctx, tally


def _block_flags(name: str, flags: Sequence[bool] | None, n: int, default: bool) -> list[bool]:
    """:func:`begin_step`'s ``float64`` or ``stepped`` (``name``), checked: one bool per block (``None``:
    ``default`` for every block), a sequence (a list, a tuple, an array, a tensor: block ``i`` at ``[i]``, as
    :func:`plan_validation`'s ``taken``) of Python or numpy bools or 0-d bool tensors
    (:func:`~sofx.kernels.user_numbers.fact_value`)."""
    if flags is None:
        return [default] * n
    if not _is_per_block(flags):
        raise HParamError(f"{name} must be a sequence of one bool per block (a list, a tuple, an array, a tensor), "
                          f"got {_kind_of(flags)}")
    if len(flags) != n:
        raise HParamError(f"{name} has {len(flags)} entries, the step has {n} blocks")
    out = []
    for i in range(n):
        x = fact_value(flags[i], f"{name}[{i}]")
        if not is_bool(x):
            raise HParamError(f"{name}[{i}] must be a bool, got {_described(x)}")
        out.append(bool(x))
    return out


def _refused_block_hparams(hps: Sequence[AdamHParams], float64: Sequence[bool],
                           stepped: Sequence[bool]) -> HParamError | None:
    """The error :meth:`sofx.Adam.update` would raise for the first block that may be stepped (``stepped[i]``)
    whose hparams it refuses, naming
    ``blocks[i]`` (:func:`~sofx.adam.check_hparam_value`: not a number, or out of its range, nan included;
    :func:`~sofx.adam.check_float32_range`: beyond float32's, in which every block but a float64 one,
    ``float64[i]``, is stepped), else ``None``. Such hparams speculate no block (:func:`begin_step`): a
    speculative step raised in the middle of backward, the blocks before it stepped in place. They are not
    refused here: a block that gets no gradient is not stepped, and its hparams are not read (as
    :func:`sofx.serial.serial_step`); validation refuses them for a block it steps
    (:func:`_check_stepped_block_hparams`). Nor do they veto where the block cannot be stepped this step (a
    frozen group's): its hparams would stop every other block from speculating for the whole run."""
    try:
        _check_stepped_block_hparams(hps, float64, stepped)
    except HParamError as exc:
        return exc
    return None


def _veto_sumsq(max_norm: float | None, assumed: float) -> float:
    """``(max_norm * S)**2``, the running sum of squares of raw gradients past which clipping is certain (inf
    without clipping, and where it is beyond float64: multiplied, not raised to a power, which raises an
    OverflowError there)."""
    if max_norm is None:
        return math.inf
    threshold = max_norm * assumed
    return threshold * threshold


def _check_tally(what: str, ctx: Any, tally: Any) -> None:
    """Refuse (a :class:`SofxError` naming ``what``, the protocol function) a ``ctx`` that is not a
    :class:`StepContext`, a ``tally`` that is not a :class:`BackwardTally`, and a tally that is not of ``ctx``'s
    step (:func:`begin_step` makes them together; a tally carries its context's ``context_id`` and has one entry
    per block). A tally of a step with more blocks was validated without its extra blocks (a speculative step
    there neither committed nor undone), one with fewer raised an IndexError, and one of an earlier step was
    validated against a later step's context."""
    for name, x, kind in (("ctx", ctx, StepContext), ("tally", tally, BackwardTally)):
        if not isinstance(x, kind):
            raise SofxError(f"{what}: {name} is {tree.article(type(x).__name__)}; expected the {kind.__name__} "
                            "begin_step made (ctx, tally = begin_step(...))")
    if (tally.context_id != ctx.context_id or len(tally.decisions) != ctx.n_blocks
            or len(tally.block_sumsq) != ctx.n_blocks):
        raise SofxError(f"{what}: the tally is not of this context's step: begin_step makes a context and its tally "
                        f"together (the context has {ctx.n_blocks} blocks; the tally, of another begin_step, "
                        f"{len(tally.decisions)})")


def _check_block(ctx: StepContext, block: int) -> int:
    """``block`` as a Python int (:func:`~sofx.kernels.user_numbers.as_integer`: a numpy integer too, such as an index
    taken from an array) in ``[0, n_blocks)``, else a :class:`SofxError` naming it."""
    i = as_integer(block)
    if i is None or not 0 <= i < ctx.n_blocks:
        raise SofxError(f"block {block!r} is out of range: expected an integer in [0, {ctx.n_blocks}) (the step has "
                        f"{ctx.n_blocks} blocks), got {type(block).__name__}")
    return i


def _sumsq_value(where: str, value: Any, block: int | None = None) -> float:
    """A block's sum of squares as a Python float: a real number >= 0, inf and nan included (a gradient that is not
    finite); a numpy number or a 1-element tensor as its value (:func:`~sofx.kernels.user_numbers.real_number`).
    Anything else (a string, a bool, a tensor of several elements, a negative number) is refused, a
    :class:`SofxError` naming ``where`` and what was given (a negative sum was taken by the plan as a smaller norm;
    ``float()`` read ``"1.5"`` and ``True`` as sums and raised a bare ValueError for ``"x"``). ``block``: the
    block of an entry of :func:`plan_validation`'s ``sumsq``, where ``None`` (no gradient) is taken too."""
    if type(value) is float and not value < 0:  # (the common case, once per block and step)
        return value
    x = real_number(value, where, SofxError)
    if isinstance(x, numbers.Real) and not is_bool(x):
        try:
            f = float(x)
        except OverflowError:  # an int beyond the float range
            f = math.inf
        if not f < 0:  # (nan is not < 0: a gradient that is not finite)
            return f
    whose = "a block's" if block is None else f"block {block}'s"
    none = "" if block is None else ", or None for no gradient"
    raise SofxError(f"{where} is {value!r:.80} ({_described(value)}); expected {whose} sum of squares, a real number "
                    f">= 0 (inf or nan where its gradient is not finite){none}")


def _replace(t: tuple[Any, ...], i: int, value: Any) -> tuple[Any, ...]:
    return t[:i] + (value,) + t[i + 1:]


def on_block_ready(ctx: StepContext, tally: BackwardTally, block: int, sumsq: float,
                   eligibility: EligibilityLike) -> tuple[BackwardTally, BlockDecision]:
    """Decide whether to speculate block ``block``, whose final gradient has sum of squares ``sumsq``.

    ``sumsq`` is of the raw (loss-scaled) gradient, accumulated in float64
    (:func:`sofx.speculation.apply.grad_sumsq`); non-finite means the gradient
    is. ``eligibility`` is an :class:`Eligibility` or a callable returning one,
    called only when everything else allows speculation. Returns the new tally
    and the decision.
    """
    _check_tally("on_block_ready", ctx, tally)
    block = _check_block(ctx, block)
    if tally.decisions[block] is not None:
        raise SofxError(f"block {block} was already ready this step; a further gradient for it is a late "
                        "gradient: call on_late_gradient")
    sumsq = _sumsq_value(f"on_block_ready: block {block}: sumsq", sumsq)
    running = tally.sumsq + sumsq
    hp = ctx.hparams[block]
    vetoed, veto_reason, snap = tally.vetoed, tally.veto_reason, tally.snapshot_bytes
    strategy, nbytes = None, 0
    if not ctx.speculating:
        kind, reason = ctx.kind, ctx.reason
    elif vetoed:
        kind, reason = "vetoed", veto_reason
    elif not math.isfinite(sumsq):
        vetoed, veto_reason = True, f"block {block} has a non-finite gradient (overflow: the step will be skipped)"
        kind, reason = "vetoed", veto_reason
    elif math.sqrt(sumsq) * ctx.grad_scale > UNDO_SAFE_NORM:
        vetoed = True
        veto_reason = (f"block {block}'s unscaled gradient norm {math.sqrt(sumsq) * ctx.grad_scale:.3g} is beyond "
                       f"{UNDO_SAFE_NORM:g}: its squares may overflow float32, and the step could not be undone")
        kind, reason = "vetoed", veto_reason
    elif running > ctx.veto_sumsq:
        vetoed = True
        veto_reason = (f"clipping is certain from block {block} on: the running sum of squares {running:.6g} "
                       f"exceeds (max_norm * S)^2 = {ctx.veto_sumsq:.6g}")
        kind, reason = "vetoed", veto_reason
    else:
        el = eligibility() if callable(eligibility) else eligibility
        if not isinstance(el, Eligibility):
            raise SofxError(f"eligibility must be an Eligibility, got {type(el).__name__}")
        # read as a Python bool and int (eligible="no" speculated; a negative size lowered the snapshot held)
        where = f"on_block_ready: block {block}: the eligibility's"
        eligible = flag(f"{where} eligible", fact_value(el.eligible, f"{where} eligible", SofxError), SofxError)
        el_bytes = integer(f"{where} snapshot_bytes", el.snapshot_bytes, 0, SofxError)
        strategy = el.strategy
        if not (strategy is None or (type(strategy) is str and strategy in STRATEGIES)):  # (taken into the decision)
            raise SofxError(f"{where} strategy = {strategy!r:.80} is invalid; expected None or one of {STRATEGIES} "
                            f"(an undo record's), got {_described(strategy)}")
        if eligible and (strategy is None or strategy == "none"):  # (a step that cannot be undone was speculated)
            raise SofxError(f"{where} eligible = True with strategy = {strategy!r} is a contradiction: a block whose "
                            "step has no undo strategy is ineligible (Eligibility(False, ...)); an eligible one names "
                            "the strategy its undo would use")
        if type(el.reason) is not str:  # (a number or None became the decision's reason, and the plan's action's)
            raise SofxError(f"{where} reason = {el.reason!r:.80} is invalid; expected a str (why), got "
                            f"{_described(el.reason)}")
        budget = ctx.config.snapshot_budget_bytes
        if not eligible:
            kind, reason = "ineligible", el.reason
        elif budget is not None and snap + el_bytes > budget:
            kind = "budget"
            # (planned bytes are reserved at a decision, what a step held beyond its plan is learnt later: the
            # steps so far may hold or reserve more than the budget for a while, one of them taken back then)
            left = (f"{budget - snap} of the budget of {budget} bytes are left" if snap <= budget else
                    f"none of the budget of {budget} bytes is left (the speculative steps so far hold or reserve "
                    f"{snap})")
            reason = f"its {el.strategy} undo needs {el_bytes} bytes of snapshot ({el.reason}); {left}"
        else:
            kind, reason, nbytes = "speculate", "", el_bytes
            snap += el_bytes
    decision = BlockDecision(block, kind == "speculate", kind, reason, hp, ctx.grad_scale, strategy, nbytes,
                             ctx.config.snapshot_budget_bytes)._of_step(ctx.context_id)
    new = BackwardTally(running, vetoed, veto_reason, _replace(tally.block_sumsq, block, sumsq),
                        _replace(tally.decisions, block, decision), tally.late, snap, tally.undone, tally.context_id)
    return new, decision


def on_speculation_refused(ctx: StepContext, tally: BackwardTally, block: int, reason: str) -> BackwardTally:
    """Record that block ``block``'s speculative step was taken back as soon as it ran: it found that its
    snapshot would go beyond the budget (:class:`~sofx.errors.SnapshotLimitError`, ``reason`` its message).

    Its decision becomes ``"refused"``: validation steps it, the report counts it as ``refused`` (a
    speculative step undone at once, then stepped late), and its snapshot bytes are no longer held.
    """
    _check_tally("on_speculation_refused", ctx, tally)
    block = _check_block(ctx, block)
    d = tally.decisions[block]
    if d is None or not d.speculate:
        raise SofxError(f"block {block} was not speculated: there is no speculative step to refuse")
    _refuse_undone_report(tally, block)
    refused = d._replace(speculate=False, kind="refused", reason=f"taken back as it ran: {reason}",
                         snapshot_bytes=0)
    return tally._replace(decisions=_replace(tally.decisions, block, refused),
                          snapshot_bytes=tally.snapshot_bytes - d.snapshot_bytes)


def on_speculation_held(ctx: StepContext, tally: BackwardTally, block: int, snapshot_bytes: int) -> BackwardTally:
    """Record the snapshot bytes block ``block``'s speculative step actually holds (its record's
    ``snapshot_bytes()``), in place of the bytes its decision planned for: ``undo="auto"``'s step may find
    in itself that it keeps chunks (:mod:`sofx.skipped_chunks`). The blocks decided after this see what is
    really left of the budget, rather than have their steps taken back for it. A count beyond
    ``snapshot_budget_bytes`` is refused (a :class:`SofxError`): a speculative step keeps at most the budget
    (:func:`~sofx.speculation.apply.speculative_block_step`'s limit), so it is no step's count (it was taken, and
    every block decided after it was refused for the budget).
    """
    _check_tally("on_speculation_held", ctx, tally)
    block = _check_block(ctx, block)
    d = tally.decisions[block]
    if d is None or not d.speculate:
        raise SofxError(f"block {block} was not speculated: there is no speculative step holding a snapshot")
    _refuse_undone_report(tally, block)
    snapshot_bytes = integer("on_speculation_held: snapshot_bytes", snapshot_bytes, 0, SofxError)
    budget = ctx.config.snapshot_budget_bytes
    if budget is not None and snapshot_bytes > budget:
        raise SofxError(f"on_speculation_held: block {block}'s step holds {snapshot_bytes} bytes of snapshot, beyond "
                        f"the snapshot_budget_bytes of {budget}: a speculative step keeps at most the budget "
                        "(speculative_block_step's limit); report its record's snapshot_bytes()")
    held = d._replace(snapshot_bytes=snapshot_bytes)
    return tally._replace(decisions=_replace(tally.decisions, block, held),
                          snapshot_bytes=tally.snapshot_bytes - d.snapshot_bytes + snapshot_bytes)


def _refuse_undone_report(tally: BackwardTally, block: int) -> None:
    """Refuse (a :class:`SofxError`) a report of what block ``block``'s speculative step holds, or that it was
    taken back, after the caller undid that step for a late gradient (``on_late_gradient(undone=True)``, which
    released its bytes): taken off the held total a second time, the total went below what the steps hold, and the
    blocks after it were speculated with snapshots beyond ``snapshot_budget_bytes``."""
    if block in tally.undone:
        raise SofxError(f"block {block}'s speculative step was undone for a late gradient (on_late_gradient("
                        "undone=True)), which released its snapshot: report what the step held "
                        "(on_speculation_held, on_speculation_refused) before that undo")


def on_late_gradient(ctx: StepContext, tally: BackwardTally, block: int, sumsq: float, *,
                     undone: bool = False) -> BackwardTally:
    """Record that block ``block`` got a further gradient after it was ready.

    ``sumsq`` is that of the summed gradient. Validation undoes and redoes
    the block with it (the speculative step's record references the old
    gradient: sum out of place, or undo first and sum in place, as the offload
    engine does). ``undone``: the caller has undone the block's speculative step
    already; its snapshot no longer counts against ``snapshot_budget_bytes``
    for the blocks decided after it (its decision keeps the bytes the step held:
    report them, :func:`on_speculation_held`, before). A non-finite sum vetoes
    speculation of the blocks still to come.
    """
    _check_tally("on_late_gradient", ctx, tally)
    block = _check_block(ctx, block)
    d = tally.decisions[block]
    if d is None:
        raise SofxError(f"block {block} was not ready yet: a gradient before on_block_ready is not late")
    sumsq = _sumsq_value(f"on_late_gradient: block {block}: sumsq", sumsq)
    # a Python bool ("no" was read as true: a standing step taken as undone, and the block stepped a second time)
    undone = flag("on_late_gradient: undone", fact_value(undone, "on_late_gradient: undone"))
    old = tally.block_sumsq[block]
    running = tally.sumsq + (sumsq - old if math.isfinite(sumsq) and old is not None and math.isfinite(old)
                             else sumsq)
    vetoed, veto_reason = tally.vetoed, tally.veto_reason
    if not vetoed and not math.isfinite(sumsq):
        vetoed, veto_reason = True, f"block {block} got a non-finite late gradient"
    held, taken_back = tally.snapshot_bytes, tally.undone
    if undone and d.kind == "speculate" and block not in tally.undone:
        # released once (a later arrival finds nothing more to undo), also where an earlier late gradient was
        # summed out of place and the step stood until now
        held -= d.snapshot_bytes
        taken_back = taken_back | {block}
    return BackwardTally(running, vetoed, veto_reason, _replace(tally.block_sumsq, block, sumsq), tally.decisions,
                         tally.late | {block}, held, taken_back, tally.context_id)


def _same_number(a: Any, b: Any) -> bool:
    """Whether two hparam values step identically: equal and, for zeros, of the same sign (an ``lr`` of
    ``0.0`` and one of ``-0.0`` compare equal, but ``p - lr*u`` differs in the sign of a zero ``p``)."""
    a, b = as_number(a), as_number(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return False  # tensors that cannot be read: assume changed (undo+redo is always correct)


def _same_hparams(a: AdamHParams, b: AdamHParams) -> bool:
    return all(_same_number(x, y) for x, y in zip(a, b))


def _assumed_multiplier(profile: str, assumed: float) -> float:
    """The gradient multiplier of a speculative step, the one validation gives an unclipped step of the assumed
    scale (:func:`sofx.serial.step_facts`): GradScaler's ``float32(1/S)`` under ``"torch"``
    (:func:`~sofx.loss_scale.inverse_scale`), ``1/S`` under ``"deepspeed"``; inf for a scale of 0."""
    if not assumed > 0:
        return math.inf
    return inverse_scale(assumed) if profile == "torch" else 1.0 / assumed


def _changes(d: BlockDecision, late: bool, grad_scale: float, hp: AdamHParams, facts: StepFacts,
             ctx: StepContext, final_sumsq: float | None, speculated_sumsq: float | None) -> list[str]:
    """Why a speculated block's step cannot stand as it was taken (empty: it is committed): a late gradient, another
    multiplier or hparams, or a sum of squares at validation (``final_sumsq``) other than the one the block was
    speculated with (``speculated_sumsq``, its tally's: a gradient changed without :func:`on_late_gradient`)."""
    why = []
    if late:
        why.append("a late gradient was summed in")
    elif final_sumsq != speculated_sumsq:
        why.append(f"its gradient's sum of squares at validation, {final_sumsq!r}, differs from the "
                   f"{speculated_sumsq!r} it was speculated with (a gradient changed since on_block_ready, without "
                   "on_late_gradient)")
    if d.grad_scale != grad_scale:
        if facts.clipped:
            why.append(f"clipping fired (norm {facts.grad_norm:.6g})")
        if facts.scale != ctx.assumed_scale:
            why.append(f"the gradients are unscaled with {facts.scale:g}, not the assumed {ctx.assumed_scale:g}")
        if not why:
            why.append("the gradient multiplier changed")
    if not _same_hparams(d.hparams, hp):
        why.append("the hparams changed since speculation")
    return why


def plan_validation(ctx: StepContext = REQUIRED, tally: BackwardTally = REQUIRED,
                    sumsq: Sequence[float | None] = REQUIRED, *extra: Any, hparams: Any = None,
                    taken: Sequence[bool] | None = None,
                    reduce_sumsq: Callable[[float], float] | None = None, stepped: Sequence[bool] | None = None,
                    **unknown: Any) -> ValidationPlan:
    """Validate the step: global facts, one :class:`BlockAction` per block, the next states and the report.

    ``sumsq[i]``: the sum of squares of block ``i``'s final raw gradient
    (``None``: no gradient this step; also for a block the caller undid,
    ``on_late_gradient(undone=True)``, as what arrived was no gradient after
    all: it is planned as a block without gradient; a speculated block's sum other than the one it was speculated
    with, ``tally.block_sumsq[i]``, is a gradient changed since, and the block is undone and redone with the final
    one). ``hparams``: the validation-time hparams
    (default: those of the context); blocks speculated with other hparams are
    undone and redone. ``taken[i]``: whether block ``i``'s speculative step
    actually ran and stands (default: every speculated block but those the caller
    undid for a late gradient, ``on_late_gradient(undone=True)``; ``True`` for
    one of those is refused). ``stepped[i]``: the caller steps block ``i``, so that its hparams are
    checked (default: a block with a gradient, every block with ``missing_grad="zero"``; the offload engine
    steps no frozen parameter with zeros). ``reduce_sumsq``: the
    all-reduce (sum) of the local sum of squares across ranks (``-0.0`` where
    this rank has no gradient, :func:`sofx.serial.local_sumsq`; a step without
    gradient on any rank moves neither the loss scaler nor the policy); a hook
    that compares the ranks' step settings gets them (``config.profile``,
    ``max_norm``, ``missing_grad``, ``ctx.scaler_state``:
    :func:`sofx.serial.reduced_sumsq`). A keyword it does not take, a required argument (``ctx``, ``tally``,
    ``sumsq``: ``<required>``) left out or misspelt, or a positional argument too many, is refused, after telling
    the hook (:func:`sofx.serial.refuse_unknown_keywords`); so is input it refuses (:func:`_validation_inputs`),
    through :func:`sofx.serial.refuse_reduce`, before it reduces.
    """
    missing = _missing(ctx=ctx, tally=tally, sumsq=sumsq)
    if unknown or missing or extra:
        refuse_unknown_keywords("plan_validation", unknown, _keyword_names(plan_validation), reduce_sumsq,
                                loop=False, missing=missing, extra=extra, positional=_positional_names(plan_validation))
    try:  # everything this rank may refuse, before the reduction (the other ranks wait in it for this one)
        hps, spec_taken, local, values = _validation_inputs(ctx, tally, sumsq, hparams, taken, stepped)
    except Exception as exc:
        refuse_reduce(reduce_sumsq, exc)
        raise
    n = ctx.n_blocks
    cfg = ctx.config
    zero = cfg.missing_grad == "zero"

    def action(*fields: Any) -> BlockAction:  # (of this step: apply_block_action checks it against the record's)
        new = BlockAction(*fields)._of_step(ctx.context_id)
        # (the block's marker of this step: a second plan of the step, plan_validation called again, made actions
        # of their own, and a block stepped by the first plan's was stepped again by the second's)
        new.__dict__["_applied"] = ctx.applied_cells.setdefault(new.block, [False])
        return new

    total = reduced_sumsq(reduce_sumsq, local, step_settings(cfg.profile, cfg.max_norm, cfg.missing_grad,
                                                             ctx.scaler_state))
    empty = without_gradients(total)  # no gradient on any rank: the policy skips the step too
    try:
        facts = step_facts(cfg.profile, ctx.scaler, ctx.scaler_state, 0.0 if empty else total, cfg.max_norm)
        if empty:  # (the state kept: its scale read here, where a rule's failure undoes the step)
            facts = _facts_without_gradients(facts, ctx.scaler, ctx.scaler_state)
    except Exception as exc:
        # DeepSpeed's rule at its minimum scale, or the loss-scale rule failed (a LossScaleRuleError: a custom
        # rule's exception): the step is not taken, its speculative steps are undone (they escaped standing)
        why = ("the run stops: " if isinstance(exc, MinLossScaleError) else "the step is not taken: ") + str(exc)
        actions = tuple(action(i, "undo" if spec_taken[i] else "skip", why, 1.0,
                               hps[i], False, spec_taken[i] or _undone_before(tally, i, spec_taken[i]))
                        for i in range(n))
        report = _report(ctx, tally, None, actions, ctx.policy_state,
                         overflow=isinstance(exc, MinLossScaleError) or not math.isfinite(total))
        return ValidationPlan(None, actions, ctx.scaler_state, ctx.policy_state, report, exc)
    actions = []
    for i in range(n):
        d, s, hp, was = tally.decisions[i], sumsq[i], hps[i], spec_taken[i]
        undone_before = _undone_before(tally, i, was)
        if facts.overflow:
            if was:
                actions.append(action(i, "undo", "overflow: the step is skipped", facts.grad_scale, hp,
                                      False, True))
            else:
                actions.append(action(i, "skip", "overflow: the step is skipped", facts.grad_scale, hp,
                                      False, undone_before))
            continue
        if was:
            why = _changes(d, i in tally.late, facts.grad_scale, hp, facts, ctx, values[i], tally.block_sumsq[i])
            if why:
                actions.append(action(i, "undo_redo", "; ".join(why), facts.grad_scale, hp, False, True))
            else:
                actions.append(action(i, "commit", "as speculated", facts.grad_scale, hp, False, True))
        elif undone_before and s is None:
            # undone by the caller as what arrived was no gradient after all (the offload engine under DDP: a
            # parameter unused on every rank): a block without gradient, whose speculative step is gone
            if zero:
                actions.append(action(i, "step", "its speculative step was undone: no gradient is left; "
                                      "stepped with zeros (missing_grad='zero')", facts.grad_scale, hp, True,
                                      True))
            else:
                actions.append(action(i, "skip", "its speculative step was undone: no gradient is left; not "
                                      "stepped (missing_grad='skip')", facts.grad_scale, hp, False, True))
        elif undone_before:
            actions.append(action(i, "step", "its speculative step was undone when a late gradient came; "
                                  "stepped with the sum", facts.grad_scale, hp, False, True))
        elif s is not None:
            why = d.reason if d is not None and d.reason else (
                "the block was not reported ready during backward" if d is None
                else f"its speculative step did not run (taken[{i}] is False): stepped now" if d.speculate
                else "not speculated")
            actions.append(action(i, "step", why, facts.grad_scale, hp))
        elif zero:
            actions.append(action(i, "step", "no gradient: stepped with zeros (missing_grad='zero')",
                                  facts.grad_scale, hp, True))
        else:
            actions.append(action(i, "skip", "no gradient: not stepped (missing_grad='skip')",
                                  facts.grad_scale, hp))
    policy_state = ctx.policy_state if empty else cfg.policy.update(ctx.policy_state,
                                                                    None if facts.overflow else facts.clipped)
    actions = tuple(actions)
    report = _report(ctx, tally, facts, actions, policy_state)
    return ValidationPlan(facts, actions, facts.scaler_state, policy_state, report)


def _validation_inputs(ctx: StepContext, tally: BackwardTally, sumsq: Sequence[float | None], hparams: Any,
                       taken: Sequence[bool] | None,
                       stepped: Sequence[bool] | None = None,
                       ) -> tuple[tuple[AdamHParams, ...], list[bool], float, list[float | None]]:
    """:func:`plan_validation`'s input, checked: each block's validation hparams, whether its speculative step
    was taken (speculated, not undone by the caller for a late gradient, and ``taken[i]``), and this rank's local
    sum of squares (:func:`sofx.serial.local_sumsq`; a block without gradient counts as zeros under
    ``missing_grad="zero"``), and each block's sum of squares as a float (``None``: no gradient). Refused (a
    :class:`SofxError`): ``sumsq`` or ``taken`` of another length than the step's blocks, ``taken[i]`` for a block
    not speculated or undone for a late gradient, a speculated block without gradient; (an :class:`HParamError`)
    hparams a block it would step (``stepped``, by default one with a gradient or every block with
    ``missing_grad="zero"``) cannot take (:func:`_check_stepped_block_hparams`), and a ``stepped`` that is not one
    bool per block."""
    _check_tally("plan_validation", ctx, tally)
    n = ctx.n_blocks
    _check_per_block("sumsq", sumsq, "sum of squares (or None)")
    if taken is not None:
        _check_per_block("taken", taken, "bool")
    if len(sumsq) != n:
        raise SofxError(f"sumsq has {len(sumsq)} entries, the step has {n} blocks")
    if taken is not None and len(taken) != n:
        raise SofxError(f"taken has {len(taken)} entries, the step has {n} blocks")
    if taken is not None:  # Python bools ("no" was read as true: a step that did not run was committed)
        taken = [flag(f"taken[{i}]", fact_value(x, f"taken[{i}]", SofxError), SofxError) for i, x in enumerate(taken)]
    hps = ctx.hparams if hparams is None else resolve_block_hparams(ctx.defaults, hparams, n)
    spec_taken = []
    for i in range(n):
        d = tally.decisions[i]
        # (a step the caller undid for a late gradient, on_late_gradient(undone=True), no longer stands)
        was = d is not None and d.speculate and i not in tally.undone and (taken is None or bool(taken[i]))
        if d is not None and d.context_id != ctx.context_id:
            raise SofxError(f"plan_validation: the tally's decisions[{i}] is of another step (on_block_ready made it "
                            "with another begin_step's context): the tally holds the decisions of its own step")
        if taken is not None and taken[i] and not (d is not None and d.speculate):
            raise SofxError(f"block {i}: taken[{i}] is True but the block was not speculated")
        if taken is not None and taken[i] and i in tally.undone:
            raise SofxError(f"block {i}: taken[{i}] is True but its speculative step was undone for a late gradient "
                            "(on_late_gradient(undone=True)): nothing of it is left to validate")
        if was and sumsq[i] is None:
            raise SofxError(f"block {i} was speculated but has no gradient at validation")
        spec_taken.append(was)
    values = [None if s is None else _sumsq_value(f"plan_validation: sumsq[{i}]", s, i)
              for i, s in enumerate(sumsq)]
    zero = ctx.config.missing_grad == "zero"
    with_gradient = [zero or s is not None for s in sumsq]  # (a zero one with missing_grad="zero")
    _check_stepped_block_hparams(hps, ctx.float64 or (False,) * n,
                                 with_gradient if stepped is None else _block_flags("stepped", stepped, n, True))
    local = local_sumsq(total_sumsq([(0.0 if zero else None) if s is None else s for s in values]), with_gradient)
    return hps, spec_taken, local, values


def _check_per_block(name: str, x: Any, item: str) -> None:
    """Refuse (a :class:`SofxError` naming ``name``, an argument of :func:`plan_validation`) an ``x`` that is not
    a sequence of one ``item`` per block, block ``i`` at ``x[i]`` (a list, a tuple, a tensor or an array): a
    mapping (by block name or id: its keys were read as the entries, or ``x[0]`` raised a bare KeyError), a str,
    or what has no length or index (a generator, a number: a bare TypeError)."""
    if not _is_per_block(x):
        hint = " (a mapping is not taken: list its values in block order)" if isinstance(x, Mapping) else ""
        raise SofxError(f"plan_validation: {name} is {tree.article(_kind_of(x))}; expected a sequence of one {item} "
                        f"per block, block i at [i] (a list, a tuple, a tensor){hint}")


def _is_per_block(x: Any) -> bool:
    """Whether ``x`` can hold one entry per block, block ``i`` at ``x[i]``: a list, a tuple, or a tensor or array
    of one dimension or more; not a mapping (its keys would be read as the entries), a str, what has no length or
    index (a generator, a number), nor a 0-d tensor or array (its ``len()`` raises a bare TypeError)."""
    if isinstance(x, (Mapping, str, bytes)) or not (hasattr(x, "__len__") and hasattr(x, "__getitem__")):
        return False
    return getattr(x, "ndim", 1) != 0


def _kind_of(x: Any) -> str:
    """``x``'s type name for :func:`_is_per_block`'s refusals, with ``(0-d)`` for a 0-d tensor or array."""
    return type(x).__name__ + (" (0-d)" if getattr(x, "ndim", None) == 0 else "")


def _check_stepped_block_hparams(hps: Sequence[AdamHParams], float64: Sequence[bool],
                                 stepped: Sequence[bool]) -> None:
    """Refuse (an :class:`HParamError` naming ``blocks[i]``) a value that :meth:`sofx.Adam.update` would refuse
    (:func:`~sofx.adam.check_hparam_value`; :func:`~sofx.adam.check_float32_range` but for a float64 block,
    ``float64[i]``) in the hparams of a block the step would step (``stepped``: it has a gradient, or
    ``missing_grad="zero"``), as :func:`sofx.serial.serial_step` checks its leaves' before anything, also on a
    step that will overflow. A plan with them was applied block by block, the blocks before the bad one undone
    and redone when it raised; a block without gradient is not stepped, and its hparams are not read."""
    checked: set[tuple[Any, ...]] = set()  # (the blocks of one group hold the same values: checked once)
    for i, (hp, wide, used) in enumerate(zip(hps, float64, stepped)):
        key = (*map(id, hp), wide)
        if used and key not in checked:
            for name, value in zip(AdamHParams._fields, hp):
                check_hparam_value(name, value, "hparams for ", f"blocks[{i}]")
            if not wide:
                check_float32_range(hp, "hparams for ", f"blocks[{i}]")
            checked.add(key)


def _undone_before(tally: BackwardTally, block: int, taken: bool) -> bool:
    """Whether ``block``'s speculative step was undone by the caller before validation (a late gradient,
    ``on_late_gradient(undone=True)``), so that validation finds it not taken."""
    return not taken and block in tally.undone


def _report(ctx: StepContext, tally: BackwardTally, facts: StepFacts | None, actions: Sequence[BlockAction],
            policy_state: PolicyState, overflow: bool = True) -> StepReport:
    """The step's report (``facts`` ``None``: validation failed, nothing taken; ``overflow`` then: whether the
    gradients overflowed, or DeepSpeed's rule reached its minimum scale)."""
    kinds = [a.kind for a in actions]
    decisions = [d.kind for d in tally.decisions if d is not None]
    if facts is not None:
        scale = facts.scale
    else:  # (a failed validation: where the rule's scale() is what failed, the report's scale is nan)
        try:
            scale = check_scale("scaler.scale(scaler_state)", ctx.scaler.scale(ctx.scaler_state))  # (a tensor's float)
        except Exception:
            scale = math.nan
    # speculated, then undone by the caller before validation: a step (redone) or a skip (an overflow)
    redone_before = sum(a.speculated and a.kind == "step" for a in actions)
    undone_before = redone_before + sum(a.speculated and a.kind == "skip" for a in actions)
    return StepReport(
        blocks=ctx.n_blocks,
        speculated=sum(a.speculated for a in actions),
        committed=kinds.count("commit"),
        undone=kinds.count("undo") + kinds.count("undo_redo") + undone_before,
        redone=kinds.count("undo_redo") + redone_before,
        vetoed=decisions.count("vetoed"),
        ineligible=decisions.count("ineligible") + decisions.count("budget"),
        refused=decisions.count("refused"),
        stepped_late=kinds.count("step") - redone_before,
        not_stepped=kinds.count("skip") + kinds.count("undo"),
        skipped=facts is None or facts.overflow,
        overflow=overflow if facts is None else facts.overflow,
        clipped=facts is not None and facts.clipped,
        clip_coef=1.0 if facts is None else facts.clip_coef,
        grad_norm=math.nan if facts is None else facts.grad_norm,
        scale=scale,
        next_scale=scale if facts is None else facts.next_scale,
        backward_scale=ctx.backward_scale,
        grad_scale=1.0 if facts is None else facts.grad_scale,
        speculating=ctx.speculating,
        not_speculating_reason=ctx.reason,
        # (a disabled policy never pauses: a paused state it was given, and carries, is not what it did)
        policy_paused=ctx.config.policy.enabled and policy_state.paused,
        policy_reason=policy_state.reason if ctx.config.policy.enabled else "",
        veto_reason=tally.veto_reason,
        actions=tuple(kinds),
    )
