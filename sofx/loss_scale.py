"""Loss scaling as immutable state with a pure update.

A *loss scaler* is a small frozen rule object with three pure functions::

    state = scaler.init()
    S     = scaler.scale(state)             # multiply the loss by S before backward
    state = scaler.update(state, overflow)  # after the step: overflow = a non-finite gradient

Nothing is mutated; ``update`` returns a new state (or raises, changing nothing).
Three rules exist:

:func:`grad_scaler` -- ``torch.amp.GradScaler`` exactly. Initial ``2**16``. On
overflow ``S <- S * backoff_factor`` (0.5) and the clean-step counter resets;
otherwise the counter grows and, when it reaches ``growth_interval`` (2000),
``S <- S * growth_factor`` (2) unless that is not a finite float32, and the
counter resets. The new scale is used from the next step on.

:func:`deepspeed_scaler` -- DeepSpeed's ``DynamicLossScaler`` exactly, with the
ZeRO defaults (initial ``2**16``, ``scale_window=1000``, hysteresis
(``delayed_shift``) 2, not consecutive, factor 2, ``min_scale=1``). With
``it`` the iteration counter and ``last`` the iteration of the last overflow
(``-1`` at start)::

    overflow:  if hysteresis == 1 (or delayed_shift == 1):
                   error if S == min_scale (and raise_error_at_min_scale)
                   else S <- max(S / factor, min_scale)
               else hysteresis <- hysteresis - 1
               last <- it
    clean:     if consecutive_hysteresis: hysteresis <- delayed_shift
               if window_complete(it, last):
                   if not consecutive_hysteresis: hysteresis <- delayed_shift
                   S <- S * factor
    it <- it + 1

``window_complete`` is, with ``growth_rule="stable_interval"`` (default; the
pinned DeepSpeed 0.19.8): ``k > 0 and k % scale_window == 0`` where
``k = it - last - 1`` counts the clean iterations between the last overflow
and this one -- the scale grows on the clean iteration that follows
``scale_window`` clean iterations. With ``growth_rule="legacy"`` (older
DeepSpeed, Megatron): ``(it - last) % scale_window == 0`` -- it grows on the
``scale_window``-th clean iteration itself, one iteration earlier.

:func:`static_scale` -- a constant scale (``1.0``: no loss scaling, bf16/fp32).

A ``torch.amp.GradScaler`` run goes on here from :func:`from_torch_grad_scaler` (its rule and state) and back
through :func:`to_torch_grad_scaler_state` (``GradScaler.load_state_dict``'s input). A custom rule is any object
with these three methods; what its ``scale`` or ``update`` raises in a step is a :class:`LossScaleRuleError` (the
step not taken, see :func:`call_rule`).
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Protocol, Union

import torch

from sofx.errors import HParamError, SofxError
from sofx.kernels.base import FLOAT32_MAX, as_number, is_traced, vmapped
from sofx.kernels.user_numbers import (as_integer, flag, integer, is_bool, nonnegative_number, positive_number,
                                      real_number)
from sofx.tree import article

__all__ = [
    "LossScaler",
    "GradScalerState",
    "GradScalerRule",
    "DynamicLossScaleState",
    "DynamicLossScaleRule",
    "StaticScaleState",
    "StaticScaleRule",
    "MinLossScaleError",
    "LossScaleRuleError",
    "call_rule",
    "grad_scaler",
    "from_torch_grad_scaler",
    "to_torch_grad_scaler_state",
    "deepspeed_scaler",
    "static_scale",
    "check_scaler",
    "is_torch_grad_scaler",
    "check_state",
    "check_state_kind",
    "plain_state",
    "inverse_scale",
    "FLOAT32_MAX",
]

GROWTH_RULES = ("stable_interval", "legacy")


class MinLossScaleError(RuntimeError):
    """An overflow happened while the loss scale was already at its minimum (DeepSpeed semantics)."""


class LossScaleRuleError(SofxError):
    """A loss-scale rule's ``init``, ``scale`` or ``update`` raised (a custom rule's failure, its exception the
    ``__cause__``), or its ``update`` returned a state that cannot be taken, as a step read it (:func:`call_rule`):
    the step is not taken; a speculative one is undone (the offload engine, :func:`sofx.speculate.speculative_step`)
    and parameters, moments, step counts and the loss-scaler state are left as before it."""


def call_rule(scaler: Any, method: str, *args: Any, where: str = "",
              after: str = "the step is not taken (parameters, moments, step counts and the loss-scaler state are "
                           "as before it)") -> Any:
    """``scaler.<method>(*args)`` for a step: an exception it raises that is not sofx's own (a refusal of the state,
    an :class:`HParamError`; DeepSpeed's :class:`MinLossScaleError`) is raised as a :class:`LossScaleRuleError`
    naming the rule, the method and the exception (its cause): a custom rule's ``ValueError`` escaped the offload
    engine's validation as it was, with the step's speculative block steps standing. ``where`` starts the message
    (the caller's name and ": "), ``after`` ends it: what the failure left (a step's default; a constructor's ``init()``
    says that nothing is made)."""
    try:
        return getattr(scaler, method)(*args)
    except (SofxError, MinLossScaleError):
        raise
    except Exception as exc:
        raise LossScaleRuleError(f"{where}the loss-scale rule's {method}() ({type(scaler).__name__}) raised "
                                 f"{type(exc).__name__}: {exc}; {after}") from exc


class GradScalerState(NamedTuple):
    """State of :class:`GradScalerRule`: the scale and the number of clean steps since the last change."""

    scale: float
    growth_tracker: int = 0


class DynamicLossScaleState(NamedTuple):
    """State of :class:`DynamicLossScaleRule` (DeepSpeed's ``cur_scale``, ``cur_iter``,
    ``last_overflow_iter``, ``cur_hysteresis``)."""

    scale: float
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 2


class StaticScaleState(NamedTuple):
    """State of :class:`StaticScaleRule`: the constant scale."""

    scale: float


LossScaleState = Union[GradScalerState, DynamicLossScaleState, StaticScaleState]


class LossScaler(Protocol):
    """What every loss-scale rule provides (all pure)."""

    def init(self) -> LossScaleState:
        """The state before the first step."""
        ...

    def scale(self, state: LossScaleState) -> float:
        """The scale ``S`` the loss is multiplied by in this state (gradients are unscaled by ``1/S``)."""
        ...

    def update(self, state: LossScaleState, overflow: bool) -> LossScaleState:
        """The state after a step whose gradients did (``overflow=True``) or did not hold an inf or a nan."""
        ...


def _float32_scale(name: str, value: float) -> float:
    """``value`` (:func:`~sofx.kernels.user_numbers.positive_number`) as a float, refused where float32 cannot hold it:
    beyond its largest value or rounding to 0 there (torch's GradScaler keeps its scale in a float32 tensor; it
    fails with "value cannot be converted to type float without overflow" at its first ``scale``)."""
    x = positive_number(name, value)
    # torch's checked conversion overflows beyond the largest value, also where rounding would give that value
    rounded = math.inf if x > FLOAT32_MAX else _f32(x)
    if not math.isfinite(rounded) or rounded == 0:
        raise HParamError(f"{name} = {value!r} is invalid; expected a scale float32 can hold (GradScaler keeps it "
                          f"in a float32 tensor): at most {FLOAT32_MAX!r} and not rounding to 0 there, got "
                          f"{rounded!r} in float32")
    return x


_RULE_HINT = "sofx.loss_scale.grad_scaler(...), deepspeed_scaler(...), static_scale(...)"


def is_torch_grad_scaler(x: Any) -> bool:
    """Whether ``x`` is a ``torch.amp.GradScaler``: of that class or another (``torch.cuda.amp.GradScaler``, FSDP's
    ``ShardedGradScaler``, a user's subclass; a check of the class's name refused those)."""
    return isinstance(x, torch.amp.GradScaler)


def check_scaler(scaler: Any, name: str = "scaler") -> None:
    """Refuse (an :class:`HParamError` naming ``name``) what is not a loss-scale rule, an object whose ``init``,
    ``scale`` and ``update`` are callable (:class:`LossScaler`), saying what to give: for torch's
    ``GradScaler`` (a mutable object that scales tensors) the rule that equals it, for a rule's factory given
    uncalled (``grad_scaler``) the call. (The loops raised "AttributeError: 'GradScaler' object has no attribute
    'init'".)"""
    if all(callable(getattr(scaler, method, None)) for method in ("init", "scale", "update")):
        return
    kind = type(scaler)
    if is_torch_grad_scaler(scaler):
        raise HParamError(f"{name} is a torch.amp.GradScaler ({kind.__name__}); sofx keeps the loss scale as immutable "
                          "state beside a rule: sofx.loss_scale.grad_scaler(init_scale=..., growth_factor=..., "
                          "backoff_factor=..., growth_interval=...) is its rule; sofx.loss_scale."
                          "from_torch_grad_scaler(scaler) gives a used one's rule and state (the loop's "
                          "scaler_state)")
    if any(scaler is factory for factory in (grad_scaler, deepspeed_scaler, static_scale)):
        raise HParamError(f"{name} is the function {scaler.__name__}; call it for a rule: {scaler.__name__}(...)")
    raise HParamError(f"{name} is {article(kind.__name__)}; expected a loss-scale rule (init, scale and update: "
                      f"{_RULE_HINT}; static_scale(1.0) is no loss scaling)")


def check_state_kind(state: Any, expected: type) -> None:
    """A state of another kind than the rule's own (what ``init()`` makes) is refused, naming both (the rules'
    ``scale`` and ``update``, and :func:`sofx.serial.loss_scale_of` for a loop's ``scaler_state``). An ``expected``
    that is no type: a ``TypeError`` naming it (isinstance's bare one)."""
    if type(expected) is not type and not isinstance(expected, type):
        raise TypeError(f"check_state_kind: expected is {article(type(expected).__name__)} ({expected!r:.80}), "
                        "expected a type (the rule's state class)")
    if not isinstance(state, expected):
        raise HParamError(f"scaler_state is {article(type(state).__name__)}; this scaler's state is a "
                          f"{expected.__name__} (as scaler.init() makes it)")


def _store(rule: Any, **fields: Any) -> None:
    """Set a frozen rule's ``fields`` to their checked Python values, once, in ``__post_init__`` (kept as given, a
    tensor factor made the state's scale a tensor after the first update)."""
    for name, value in fields.items():
        object.__setattr__(rule, name, value)


def _overflow(value: Any) -> bool:
    """``overflow`` as a bool: a Python or numpy bool, or a 0-d bool tensor; a string, a number or ``None`` is
    refused (any non-empty string was taken as an overflow).

    A 0-d bool tensor that :func:`~sofx.kernels.base.is_traced` counts as unreadable is read all the same where
    torch can read it: under ``torch.compile`` (a graph break; with ``fullgraph=True`` Dynamo refuses it) and
    under ``torch.func.grad`` (a bool carries no gradient). Under ``vmap`` (one flag per member) it cannot be
    read, and the rules compute on the host: an :class:`HParamError` says so."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 0:
        value = _host_value(value, "overflow")
    x = as_number(value, "overflow")  # a concrete 0-d tensor as its Python value
    if is_bool(x):
        return bool(x)
    raise HParamError(f"overflow = {value!r:.80} is invalid; expected a bool (whether a gradient held an inf or a "
                      f"nan), got {type(value).__name__}")


def _host_value(x: Any, name: str) -> Any:
    """A 1-element tensor that :func:`~sofx.kernels.base.is_traced` counts as unreadable, read all the same where
    torch can read it (its Python value): under ``torch.compile`` (a graph break; with ``fullgraph=True`` Dynamo
    refuses it) and under ``torch.func.grad``. Under ``vmap`` (one value per member) it cannot be read, and the
    rules compute on the host: an :class:`HParamError` naming ``name`` says so. Anything else as it is."""
    if not (isinstance(x, torch.Tensor) and x.numel() == 1 and is_traced(x)) or x.is_meta:
        return x  # (a meta tensor holds no value: the caller's checks refuse it)
    if vmapped(x):
        raise HParamError(f"{name} is a tensor that torch.func.vmap batches, whose value cannot be read: a loss "
                          "scaler's rule computes on the host, one run at a time; update each member's scaler state "
                          "outside vmap (or keep one scale for the ensemble)")
    return x.item()


# The least value of each count of the states of the rules here (DeepSpeed's last_overflow_iter is -1 before the
# first overflow; its hysteresis counts down to 1, where the next overflow lowers the scale).
_LEAST_COUNTS: dict[type, dict[str, int]] = {
    GradScalerState: {"growth_tracker": 0},
    DynamicLossScaleState: {"cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": 1},
    StaticScaleState: {},
}


def check_state(state: LossScaleState, where: str = "scaler_state") -> None:
    """Refuse (an :class:`HParamError` naming ``where`` and the field) a state of one of the rules here that no
    run reaches, whatever the rule's settings: a scale that is not a finite number >= 0 (GradScaler's reaches 0
    after many overflows in a row; DeepSpeed's stays at or above its ``min_scale > 0``: > 0 there), a count
    that is not an integer or is below its least value, a DeepSpeed ``last_overflow_iter`` at or after
    ``cur_iter`` (an overflow is recorded at the iteration it happens, and the count then moves past it).
    Another kind (a custom rule's state) is not inspected. What depends on the rule's settings is the rule's
    to refuse (:meth:`DynamicLossScaleRule.scale`)."""
    least = _LEAST_COUNTS.get(type(state))
    if least is None:
        return
    # (torch's GradScaler keeps a 0-d tensor; numpy: files)
    scale = real_number(_host_value(state.scale, f"{where}['scale']"), f"{where}['scale']")
    try:
        ok = isinstance(scale, numbers.Real) and not is_bool(scale) and math.isfinite(scale) and scale >= 0
    except OverflowError:  # an int beyond the float range
        ok = False
    if not ok:
        raise HParamError(f"{where}['scale'] = {state.scale!r} is invalid; expected a finite number >= 0, got "
                          f"{type(state.scale).__name__}")
    counts = {name: integer(f"{where}[{name!r}]", _host_value(getattr(state, name), f"{where}[{name!r}]"), low)
              for name, low in least.items()}  # (torch's GradScaler keeps its growth tracker in a 0-d tensor too)
    if isinstance(state, DynamicLossScaleState):
        _check_deepspeed_state(state, scale, counts["cur_iter"], counts["last_overflow_iter"], where)


def _check_deepspeed_state(state: DynamicLossScaleState, scale: float, it: int, last: int, where: str) -> None:
    """What no DeepSpeed run holds under any settings (``it``, ``last``: its counts, checked integers): a scale of 0
    (it stays at or above ``min_scale > 0``), a ``last_overflow_iter`` at or after ``cur_iter``."""
    if scale == 0:
        raise HParamError(f"{where}['scale'] = {state.scale!r} is invalid; expected a finite number > 0 (DeepSpeed's "
                          "scale stays at or above its min_scale, > 0)")
    if last >= it:
        raise HParamError(f"{where}['last_overflow_iter'] = {last} is invalid with cur_iter = {it}; expected "
                          "-1 <= last_overflow_iter < cur_iter (DeepSpeed records an overflow at the iteration it "
                          "happens, then counts on past it)")


def plain_state(state: LossScaleState, where: str = "scaler_state") -> LossScaleState:
    """``state`` checked (:func:`check_state`), with its scale a Python float and its counts Python ints.

    A 0-d tensor (torch's GradScaler keeps its scale in one) or a numpy number (from a file) is read as its
    value: the rules compute in Python floats, as DeepSpeed does (a float32 tensor scale was rounded at each
    growth), and every state they return, and the offload facade loads, holds Python numbers whatever it was
    given (a tensor scale was kept until the scale changed: the facade's state dict held a tensor, and a
    checkpoint template taken before did not fit one saved after). Another kind (a custom rule's state) is
    returned as is."""
    check_state(state, where)
    least = _LEAST_COUNTS.get(type(state))
    if least is None:
        return state
    return state._replace(scale=float(real_number(_host_value(state.scale, f"{where}['scale']"), f"{where}['scale']")),
                          **{name: int(_host_value(getattr(state, name), f"{where}[{name!r}]")) for name in least})


@dataclass(frozen=True)
class GradScalerRule:
    """``torch.amp.GradScaler``'s update rule (see the module docstring)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        init_scale = _float32_scale("init_scale", self.init_scale)
        growth_factor = positive_number("growth_factor", self.growth_factor)
        if not growth_factor > 1:
            raise HParamError(f"growth_factor = {self.growth_factor!r} is invalid; expected > 1")
        backoff_factor = positive_number("backoff_factor", self.backoff_factor)
        if not backoff_factor < 1:
            raise HParamError(f"backoff_factor = {self.backoff_factor!r} is invalid; expected 0 < backoff < 1")
        _store(self, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
               growth_interval=integer("growth_interval", self.growth_interval, 1))

    def init(self) -> GradScalerState:
        """``S = init_scale`` rounded to float32, no clean step counted yet."""
        return GradScalerState(_f32(self.init_scale), 0)  # torch keeps its scale in a float32 tensor

    def scale(self, state: GradScalerState) -> float:
        """The current scale ``S`` as torch's GradScaler holds it, in float32 (:func:`_as_float32_scale`: a state
        whose scale is no float32 value, set by hand or read from a file, scales as torch's loaded with it); a state
        counting ``growth_interval`` clean steps or more, or whose scale is beyond float32's largest value, is
        refused."""
        check_state_kind(state, GradScalerState)
        self._check_tracker(state.growth_tracker)
        _check_float32_scale(state.scale)
        return _as_float32_scale(state.scale)

    def update(self, state: GradScalerState, overflow: bool) -> GradScalerState:
        """``torch._amp_update_scale_``: back off on overflow, grow after ``growth_interval`` clean steps (from the
        scale in float32, as :meth:`scale` takes it)."""
        check_state_kind(state, GradScalerState)
        state = plain_state(state)
        self._check_tracker(state.growth_tracker)
        _check_float32_scale(state.scale)
        state = state._replace(scale=_f32(state.scale))
        if _overflow(overflow):
            return GradScalerState(_f32(state.scale * self.backoff_factor), 0)
        successful = state.growth_tracker + 1
        if successful == self.growth_interval:
            grown = _f32(state.scale * self.growth_factor)
            return GradScalerState(grown if math.isfinite(grown) else state.scale, 0)
        return GradScalerState(state.scale, successful)

    def _check_tracker(self, tracker: Any) -> None:
        """Refuse a clean-step count ``>= growth_interval`` (an :class:`HParamError` naming both): the rule grows
        the scale when the count *reaches* the interval, so from past it the scale never grew again. No run of
        this rule gets there; a state saved by a scaler with a longer ``growth_interval`` does (torch's state
        dict carries its interval, this state does not). Other invalid counts are :func:`check_state`'s."""
        count = as_integer(_host_value(tracker, "scaler_state['growth_tracker']"))
        if count is not None and count >= self.growth_interval:
            raise HParamError(f"scaler_state['growth_tracker'] = {count} is invalid for growth_interval = "
                              f"{self.growth_interval}; expected 0 <= growth_tracker < {self.growth_interval} (a "
                              "state saved with a longer growth_interval: set its growth_tracker below this one's)")


def _as_float32_scale(scale: Any) -> Any:
    """A GradScaler state's scale rounded to float32, as torch's ``GradScaler.load_state_dict`` fills its float32
    scale tensor with it: a number as a float (:func:`_f32`), a tensor wider than float32 rounded in its own dtype
    (a traced one too), a float32 (or narrower) tensor or anything else as it is (the callers check it)."""
    if isinstance(scale, numbers.Real) and not is_bool(scale):
        try:
            return _f32(float(scale))
        except OverflowError:  # (an int no float holds: the callers' refusal)
            return scale
    if isinstance(scale, torch.Tensor) and scale.is_floating_point() and scale.dtype.itemsize > 4:
        return scale.to(torch.float32).to(scale.dtype)
    return scale


def _check_float32_scale(scale: Any) -> None:
    """Refuse (an :class:`HParamError` naming ``scaler_state['scale']``) a GradScaler state whose scale is a finite
    number beyond float32's largest value: no run of the rule gets there (growth stops at that value), torch's
    GradScaler keeps its scale in a float32 tensor and refuses to load a larger one, and an overflow backed it off
    to ``float32(S * backoff_factor)``, inf, a state the rule then refused. Other invalid scales (nan, a negative
    one, an int no float holds) are :func:`check_state`'s and :func:`sofx.serial.check_scale`'s."""
    try:
        x = real_number(_host_value(scale, "scaler_state['scale']"), "scaler_state['scale']")
        beyond = isinstance(x, numbers.Real) and not is_bool(x) and FLOAT32_MAX < float(x) < math.inf
    except (HParamError, OverflowError):  # (an int no float holds, a tensor without its memory: the callers' refusal)
        return
    if beyond:
        raise HParamError(f"scaler_state['scale'] = {scale!r:.80} is invalid for GradScaler's rule: beyond float32's "
                          f"largest value {FLOAT32_MAX!r} (torch's GradScaler keeps its scale in a float32 tensor and "
                          "refuses to load a larger one; an overflow would back it off to inf); expected a scale <= "
                          f"{FLOAT32_MAX!r}")


@dataclass(frozen=True)
class DynamicLossScaleRule:
    """DeepSpeed's ``DynamicLossScaler`` update rule (see the module docstring)."""

    init_scale: float = 2.0 ** 16
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1.0
    delayed_shift: int = 2
    consecutive_hysteresis: bool = False
    raise_error_at_min_scale: bool = True
    growth_rule: str = "stable_interval"

    def __post_init__(self) -> None:
        init_scale = positive_number("init_scale", self.init_scale)
        min_scale = positive_number("min_scale", self.min_scale)
        if min_scale > init_scale:
            # DeepSpeed accepts it, and its first overflow past the hysteresis *raises* the scale to min_scale
            raise HParamError(f"min_scale = {self.min_scale!r} is above init_scale = {self.init_scale!r}; expected "
                              "min_scale <= init_scale (DeepSpeed takes it, and an overflow then raises the scale "
                              "to min_scale)")
        if self.growth_rule not in GROWTH_RULES:
            raise HParamError(f"growth_rule = {self.growth_rule!r}; expected one of {GROWTH_RULES}")
        scale_factor = positive_number("scale_factor", self.scale_factor)
        if not scale_factor > 1:
            raise HParamError(f"scale_factor = {self.scale_factor!r} is invalid; expected > 1")
        _store(self, init_scale=init_scale, min_scale=min_scale, scale_factor=scale_factor,
               scale_window=integer("scale_window", self.scale_window, 1),
               delayed_shift=integer("delayed_shift (hysteresis)", self.delayed_shift, 1),
               consecutive_hysteresis=flag("consecutive_hysteresis", self.consecutive_hysteresis),
               raise_error_at_min_scale=flag("raise_error_at_min_scale", self.raise_error_at_min_scale))

    def init(self) -> DynamicLossScaleState:
        """``S = init_scale``, iteration 0, no overflow yet (``last = -1``), full hysteresis."""
        return DynamicLossScaleState(self.init_scale, 0, -1, self.delayed_shift)

    def scale(self, state: DynamicLossScaleState) -> float:
        """The current scale ``S`` (a state beyond this rule's settings is refused: :meth:`_check_settings`)."""
        check_state_kind(state, DynamicLossScaleState)
        self._check_settings(plain_state(state))
        return state.scale

    def update(self, state: DynamicLossScaleState, overflow: bool) -> DynamicLossScaleState:
        """One ``update_scale(overflow)``; raises :class:`MinLossScaleError` (state unchanged) at the minimum."""
        check_state_kind(state, DynamicLossScaleState)
        scale, it, last, hyst = self._check_settings(plain_state(state))
        if _overflow(overflow):
            if self.delayed_shift == 1 or hyst == 1:
                if scale == self.min_scale and self.raise_error_at_min_scale:
                    raise MinLossScaleError(
                        f"gradient overflow with the loss scale already at its minimum ({self.min_scale:g}): "
                        "cannot decrease the scale further (DeepSpeed stops the run here)")
                scale = max(scale / self.scale_factor, self.min_scale)
            else:
                hyst -= 1
            last = it
        else:
            if self.consecutive_hysteresis:
                hyst = self.delayed_shift
            if self._window_complete(it, last):
                if not self.consecutive_hysteresis:
                    hyst = self.delayed_shift
                scale = scale * self.scale_factor
        return DynamicLossScaleState(scale, it + 1, last, hyst)

    def _check_settings(self, state: DynamicLossScaleState, where: str = "scaler_state") -> DynamicLossScaleState:
        """``state`` (checked by :func:`check_state`), refused (an :class:`HParamError` naming the field) where it is
        beyond this rule's settings, on which the rule misbehaves: a ``cur_hysteresis`` above ``delayed_shift``
        (it counts down from there: more overflows than configured before the scale backs off), a scale below
        ``min_scale`` (the next overflow *raises* it to ``min_scale``). No run of the rule gets there; a state
        saved under other settings does (the state does not carry them)."""
        if state.cur_hysteresis > self.delayed_shift:
            raise HParamError(f"{where}['cur_hysteresis'] = {state.cur_hysteresis} is invalid for delayed_shift "
                              f"(hysteresis) = {self.delayed_shift}; expected 1 <= cur_hysteresis <= "
                              f"{self.delayed_shift} (a state saved with a larger hysteresis: set its cur_hysteresis "
                              "to at most this one's)")
        if state.scale < self.min_scale:
            raise HParamError(f"{where}['scale'] = {state.scale!r} is below min_scale = {self.min_scale!r}; "
                              "expected a scale >= min_scale (DeepSpeed's never goes below it, and an overflow would "
                              "raise it to min_scale; a state saved with a smaller min_scale: set its scale to at "
                              "least this one's)")
        return state

    def check_reachable(self, state: DynamicLossScaleState, where: str = "scaler_state") -> None:
        """Refuse (an :class:`HParamError` naming ``where`` and the field) a state no run of this very rule reaches
        from :meth:`init`: what :func:`check_state` and :meth:`scale` refuse, and a ``cur_hysteresis`` that
        ``cur_iter`` and ``last_overflow_iter`` cannot leave (:meth:`_reachable_hysteresis`). For a rule and a
        state from one source (a DeepSpeed checkpoint holds both); a state saved under other settings (an offload
        optimizer state dict without its rule's settings, loaded with the constructor's rule, or one whose saved
        settings were edited before loading, as its ``load_state_dict`` allows: a wider ``scale_window`` after a
        growth) may hold another hysteresis, and :meth:`scale` takes it: the offload load does not apply this."""
        check_state_kind(state, DynamicLossScaleState)
        scale, it, last, hyst = self._check_settings(plain_state(state, where), where)
        low, high, why = self._reachable_hysteresis(it, last)
        if not low <= hyst <= high:
            expected = f"cur_hysteresis = {low}" if low == high else f"{low} <= cur_hysteresis <= {high}"
            raise HParamError(f"{where}['cur_hysteresis'] = {hyst} is invalid with cur_iter = {it}, "
                              f"last_overflow_iter = {last}: no run of this rule reaches it ({why}); expected "
                              f"{expected}")

    def _reachable_hysteresis(self, it: int, last: int) -> tuple[int, int, str]:
        """The least and the largest ``cur_hysteresis`` a run of this rule holds at iteration ``it`` with its last
        overflow at ``last`` (``-1 <= last < it``), and why. It starts at ``delayed_shift`` (``D``) and only an
        overflow lowers it, by one down to 1, so after ``last + 1`` iterations it is at least ``D - last - 1``;
        right after an overflow it is below ``D`` (for ``D > 1``); a clean iteration restores ``D`` with
        ``consecutive_hysteresis``, a scale growth without (the first one ``scale_window`` clean iterations after
        the overflow, ``scale_window + 1`` with ``growth_rule="stable_interval"``)."""
        d = self.delayed_shift
        if last == -1:
            return d, d, f"no overflow yet: it is still delayed_shift = {d}"
        if d == 1:
            return 1, 1, "delayed_shift = 1"
        low = max(1, d - last - 1)
        lowered = (f"an overflow lowers it below delayed_shift = {d}, by one per overflow: at least {low} with at "
                   f"most {last + 1} overflows, in iterations 0 to {last}")
        if last == it - 1:
            return low, d - 1, lowered + ", and the last iteration overflowed"
        if self.consecutive_hysteresis:
            return d, d, "with consecutive_hysteresis the clean iteration after an overflow restores delayed_shift"
        clean = it - 1 - last
        first = self.scale_window + (self.growth_rule == "stable_interval")
        if clean >= first:
            return d, d, (f"the scale grew {first} clean iterations after the last overflow ({clean} since, "
                          f"scale_window = {self.scale_window}), which restores delayed_shift")
        return low, d - 1, (lowered + f"; the scale has not grown since ({clean} clean iterations, it grows after "
                            f"{first}), which would restore delayed_shift")

    def _window_complete(self, it: int, last: int) -> bool:
        if self.growth_rule == "legacy":
            return (it - last) % self.scale_window == 0
        stable = it - last - 1
        return stable > 0 and stable % self.scale_window == 0


@dataclass(frozen=True)
class StaticScaleRule:
    """A constant loss scale (``1.0`` means no loss scaling).

    As every rule's, its state carries the scale: ``value`` is the scale :meth:`init` gives, and a state made
    elsewhere -- loaded from a checkpoint saved with another value -- keeps its own (``scale(state)`` is
    ``state.scale``), as ``GradScaler.load_state_dict`` and DeepSpeed's checkpoint load take the saved scale
    over the constructor's (see :meth:`sofx.offload.SpeculativeAdamW.load_state_dict`)."""

    value: float = 1.0

    def __post_init__(self) -> None:
        value = positive_number("scale", self.value)
        if value > FLOAT32_MAX or 1.0 / value > FLOAT32_MAX:
            # (a scale that never changes: every step of the run would be skipped as an overflow)
            raise HParamError(f"scale = {self.value!r:.80} is invalid for a static scale: "
                              + ("a float32 loss times it is inf" if value > FLOAT32_MAX else
                                 "the gradients cannot be unscaled in float32 (1/scale is beyond its range)")
                              + f", so every step would be skipped as an overflow; expected a scale within "
                              f"[{1.0 / FLOAT32_MAX!r}, {FLOAT32_MAX!r}]")
        _store(self, value=value)

    def init(self) -> StaticScaleState:
        """``S = value``."""
        return StaticScaleState(self.value)

    def scale(self, state: StaticScaleState) -> float:
        """The constant scale ``S``: the state's (``value`` where the state is :meth:`init`'s)."""
        check_state_kind(state, StaticScaleState)
        return state.scale

    def update(self, state: StaticScaleState, overflow: bool) -> StaticScaleState:
        """Unchanged (its scale as a Python float): a static scale ignores overflow (the step is still skipped
        by the loop)."""
        check_state_kind(state, StaticScaleState)
        _overflow(overflow)
        return plain_state(state)


# Where rounding to float32 overflows: float32's largest value plus half an ulp (2**104), a tie rounding to even
# (to 2**128, inf); a value below it rounds down to the largest value, as torch's cast of a scale does.
_F32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103


def _f32(x: float) -> float:
    """``x`` rounded to float32 (GradScaler keeps its scale in a float32 tensor), to nearest as torch's cast: inf
    from float32's largest value plus half an ulp on (a value just above the largest value rounds down to it)."""
    if not math.isfinite(x) or abs(x) >= _F32_OVERFLOW:
        return math.copysign(math.inf, x) if not math.isnan(x) else x
    return struct.unpack("f", struct.pack("f", x))[0]


def inverse_scale(scale: float) -> float:
    """``1/S`` as ``torch.amp.GradScaler`` unscales the gradients with it: its ``inv_scale`` is a float32 tensor,
    ``_scale.double().reciprocal().float()`` (``1/S`` in double rounded once to float32), and float64 gradients
    are multiplied by that float32 value too. For every other dtype the kernels round the multiplier to float32
    anyway: the same bits as the double ``1/S``; float64 ones differed where ``S`` is no power of two.

    ``scale``: a number >= 0 (a Python or numpy number, or a 1-element tensor; 0 gives inf, inf gives 0), else an
    :class:`HParamError` naming it (a str raised Python's bare "unsupported operand type(s) for /", a bool was
    taken as 1 or 0, a negative or nan scale gave a negative or nan multiplier)."""
    s = nonnegative_number("inverse_scale: scale", scale)
    return _f32(1.0 / s) if s != 0 else math.inf


def grad_scaler(init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                growth_interval: int = 2000) -> GradScalerRule:
    """A ``torch.amp.GradScaler``-equivalent loss scaler (same arguments and defaults).

    ``init_scale`` is held in float32, as GradScaler holds it: one beyond float32's largest value (torch fails
    at the first ``scale``) or rounding to 0 there is refused (:class:`~sofx.errors.HParamError`)."""
    return GradScalerRule(init_scale, growth_factor, backoff_factor, growth_interval)


# GradScaler.state_dict()'s entries (an enabled scaler's; a disabled one's is empty)
_TORCH_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def from_torch_grad_scaler(scaler: Any) -> tuple[GradScalerRule, GradScalerState]:
    """The rule and state that go on from a ``torch.amp.GradScaler`` (or its ``state_dict()``): the rule with its
    growth and backoff factors and growth interval, the state with its scale (in float32, as GradScaler holds it)
    and growth tracker. The rule's ``init_scale`` is that scale, as ``GradScaler.load_state_dict`` makes it the
    scaler's (2**16, torch's default, where the scale backed off to 0, which no ``init_scale`` may be)::

        rule, state = sofx.loss_scale.from_torch_grad_scaler(scaler)   # after scaler.update()
        loop = sofx.serial.init_loop(opt, params, rule)._replace(scaler_state=state)

    For the offload optimizer: ``SpeculativeAdamW(..., loss_scale=rule)`` starts at ``rule.init()``, the scale
    with no clean step counted; where ``state.growth_tracker`` is not 0, put it in through ``load_state_dict``
    (:class:`~sofx.offload.SpeculativeAdamW`'s docstring). :func:`to_torch_grad_scaler_state` goes back.

    A scaler that was never used carries its ``init_scale`` (torch makes its float32 scale tensor at the first
    ``scale()``; the state dict gives the number it will hold). Refused (an :class:`HParamError` saying why):
    a disabled scaler (``enabled=False``, whose state dict is empty: no loss scaling, ``static_scale(1.0)``), a
    scaler between ``unscale_``/``step`` and ``update()`` (its state dict is not yet the step's; not one whose step
    recorded no inf check, ``scaler.step(opt)`` that the offload optimizer refused, which owes no update and whose
    ``update()`` torch refuses: its scale is carried over), a mapping without
    GradScaler's entries or with others, and values the rule refuses (a scale beyond float32, a growth tracker at
    or past the interval), each named."""
    kind = type(scaler)
    if is_torch_grad_scaler(scaler):
        if not scaler.is_enabled():
            raise HParamError("from_torch_grad_scaler: the GradScaler is disabled (enabled=False), which does no "
                              "loss scaling: use sofx.loss_scale.static_scale(1.0) (loss_scale=None)")
        if _update_owed(scaler):
            raise HParamError("from_torch_grad_scaler: the GradScaler is between unscale_()/step() and update(): "
                              "its scale is not yet the step's; call scaler.update() first")
        saved, where = scaler.state_dict(), "GradScaler.state_dict()"
    elif isinstance(scaler, Mapping):
        saved, where = dict(scaler), "the GradScaler state dict"
    else:
        raise HParamError(f"from_torch_grad_scaler: expected a torch.amp.GradScaler or its state_dict(), got a "
                          f"{kind.__name__}")
    if not saved:
        raise HParamError(f"from_torch_grad_scaler: {where} is empty: a disabled GradScaler's (enabled=False), which "
                          "does no loss scaling: use sofx.loss_scale.static_scale(1.0) (loss_scale=None)")
    missing = [k for k in _TORCH_SCALER_KEYS if k not in saved]
    unknown = [k for k in saved if k not in _TORCH_SCALER_KEYS]
    if missing or unknown:
        raise HParamError(f"from_torch_grad_scaler: {where} has " + "; ".join(
            part for part in (f"no {', '.join(map(repr, missing))}" if missing else "",
                              f"entries GradScaler has not: {', '.join(map(repr, unknown))}" if unknown else "")
            if part) + f" (GradScaler.state_dict()'s entries: {', '.join(_TORCH_SCALER_KEYS)})")
    try:
        state = plain_state(GradScalerState(saved["scale"], saved["_growth_tracker"]), "scaler_state")
        _check_float32_scale(state.scale)
        state = state._replace(scale=_f32(state.scale))  # (torch's fill_ of its float32 scale tensor)
        start = state.scale if state.scale > 0 else 2.0 ** 16
        rule = GradScalerRule(start, saved["growth_factor"], saved["backoff_factor"], saved["growth_interval"])
        rule.scale(state)  # (a growth tracker at or past the interval: refused, naming both)
    except HParamError as exc:
        raise HParamError(f"from_torch_grad_scaler: {where} cannot be carried over: {exc}") from None
    return rule, state


def _update_owed(scaler: Any) -> bool:
    """Whether the GradScaler ``scaler`` is between an ``unscale_()``/``step()`` of this iteration that checked
    gradients for infs and its ``update()``, which its scale still waits for. One whose steps recorded no inf check
    (``scaler.step(opt)`` of the offload optimizer, which refuses it before anything is stepped; a step without
    gradients) owes none: its ``update()`` raises "No inf checks were recorded prior to update", and its scale and
    growth tracker are still the iteration's."""
    states = getattr(scaler, "_per_optimizer_states", None) or {}
    return any(isinstance(s, Mapping) and s.get("found_inf_per_device") for s in states.values())


def to_torch_grad_scaler_state(rule: GradScalerRule, state: Any) -> dict[str, Any]:
    """``GradScaler.state_dict()`` of a scaler that goes on as ``rule`` from ``state`` (a :class:`GradScalerState`,
    or the offload optimizer's saved ``opt.state_dict()["state"]["scaler_state"]``): load it with
    ``torch.amp.GradScaler(device).load_state_dict(...)`` (an enabled scaler; a disabled one ignores it). The
    inverse of :func:`from_torch_grad_scaler`. Another rule than :func:`grad_scaler`'s (DeepSpeed's, a static
    scale: GradScaler has no equivalent) and a state the rule refuses are refused (an :class:`HParamError`)."""
    if not isinstance(rule, GradScalerRule):
        raise HParamError(f"to_torch_grad_scaler_state: rule is {article(type(rule).__name__)}; GradScaler's rule is "
                          "sofx.loss_scale.grad_scaler(...) (GradScaler has no equivalent of another)")
    if isinstance(state, Mapping) and not isinstance(state, tuple):
        fields = {k: v for k, v in state.items() if k != "type"}
        if state.get("type", "GradScalerState") != "GradScalerState" or set(fields) != set(GradScalerState._fields):
            raise HParamError(f"to_torch_grad_scaler_state: state {dict(state)!r:.200} is no GradScalerState (scale, "
                              "growth_tracker: both, a missing one's default is not the run's value)")
        state = GradScalerState(**fields)
    check_state_kind(state, GradScalerState)
    state = plain_state(state)
    rule.scale(state)  # (checked: the tracker below the interval, the scale a float32's)
    return {"scale": _f32(state.scale), "growth_factor": rule.growth_factor, "backoff_factor": rule.backoff_factor,
            "growth_interval": rule.growth_interval, "_growth_tracker": state.growth_tracker}


def deepspeed_scaler(init_scale: float = 2.0 ** 16, scale_window: int = 1000, hysteresis: int = 2,
                     min_scale: float = 1.0, scale_factor: float = 2.0, consecutive_hysteresis: bool = False,
                     raise_error_at_min_scale: bool = True,
                     growth_rule: str = "stable_interval") -> DynamicLossScaleRule:
    """A DeepSpeed ``DynamicLossScaler``-equivalent loss scaler with ZeRO's defaults.

    ``growth_rule="legacy"`` reproduces DeepSpeed versions before the
    ``stable_interval`` window count (growth one iteration earlier).
    ``min_scale`` above ``init_scale`` is refused (:class:`~sofx.errors.HParamError`): DeepSpeed accepts it,
    and there an overflow past the hysteresis raises the scale to ``min_scale`` instead of lowering it.
    """
    return DynamicLossScaleRule(init_scale, scale_factor, scale_window, min_scale, hysteresis,
                                consecutive_hysteresis, raise_error_at_min_scale, growth_rule)


def static_scale(value: float = 1.0) -> StaticScaleRule:
    """A constant loss scale; ``static_scale()`` is "no loss scaling"."""
    return StaticScaleRule(value)
