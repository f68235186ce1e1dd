"""The non-speculative step: the semantics speculation must reproduce.

:func:`serial_step` is one iteration of the plain training loop on a params
pytree: check for overflow, update the loss scale, compute the global norm and
the clip coefficient, and take one Adam step with the single gradient
multiplier that unscaling and clipping fold into (applied inside the kernel).
:func:`step_facts` is the part that only needs numbers -- it is shared with
:func:`sofx.speculate.plan_validation`, so both paths compute the same bits.

Profiles (SPECULATION.md section 4), with ``s = sum of squares of the raw
(scaled) gradients``, ``S`` the loss scale and ``c`` the max norm:

``"torch"`` -- ``torch.amp.GradScaler`` + ``clip_grad_norm_`` + ``torch.optim``:
    overflow = ``s`` not finite; unscale with the scale of this backward,
    ``S = scale(state)``; then ``state <- update(state, overflow)`` (the new
    scale applies from the next step). ``norm = sqrt(s)/S``,
    ``coef = c/(norm + 1e-6)`` if ``< 1`` else 1; multiplier ``coef * inv``
    (``inv`` exactly when not clipped), ``inv = float32(1/S)``: GradScaler's
    ``inv_scale``, a float32 tensor, by which it unscales float64 gradients too.

``"deepspeed"`` -- ZeRO-3's ``step()``: ``state <- update(state, overflow)``
    first, then unscale with the *new* scale ``S = scale(state)`` (on the step
    where the scale grows, gradients are divided by the grown scale).
    ``clip = max((sqrt(s)/S + 1e-6)/c, 1)``, multiplier ``1/(clip*S)``,
    ``norm = sqrt(s)/S``.

``max_norm`` is ``None`` (no clipping) or a number >= 0: inf never clips; 0
zeroes every gradient under ``"torch"`` (``coef = 0``, as ``clip_grad_norm_``)
and does not clip under ``"deepspeed"`` (ZeRO clips only where its
``clip_grad > 0``), :func:`clip_max_norm`.

In both, an overflow skips the step: no parameter, moment or count changes,
and the schedule position does not advance (``facts.skipped``). Without a
dynamic scaler (``static_scale()``) a non-finite gradient still skips the
step rather than writing nan (``torch.optim`` alone would write nan).

Known differences from ``torch``: ``torch`` multiplies by ``1/S`` and by
``coef`` as two float32 roundings and computes the norm in float32; sofx
folds them into one multiplier and sums the squares in rows of 1024 elements in
float32 and the rows' sums in float64 (:func:`sofx.transforms.sumsq`), so a
clipped step differs from ``torch.optim`` by float32 rounding (<= 1e-6
relative), never more, for float32 gradients. For bfloat16/float16 gradients
torch computes the norm and the coefficient in their dtype (8/11 significant
bits, up to 2**-9/2**-12 relative); sofx still takes them in float32/float64:
it equals ``clip_grad_norm_`` of float32 copies of the gradients, not of the
bf16 ones (see :func:`sofx.transforms.clip_by_global_norm`). Overflow is decided on the raw gradients; with a loss
scale below 1 (only there can unscaling make an inf) and a step that is not clipped (no
``max_norm``, or one above the norm), an unscaled norm beyond float32's range also
counts as an overflow (torch would turn such elements into inf, or, when
clipping, compute an inf norm and zero every gradient; sofx clips them).
A loss scale that cannot unscale (:func:`can_unscale`: 0, which
``GradScaler`` reaches after about 166 overflows in a row, or one whose
inverse is beyond float32) makes every step an overflow, skipped with the
scale backed off; torch skips such a step only when the raw gradients are not
finite, and otherwise writes the nan of ``0 * inf`` into the parameters.
"""

from __future__ import annotations

import collections.abc
import difflib
import inspect
import math
import numbers
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from sofx import tree
from sofx.adam import Adam, AdamState, hparams_at
from sofx.apply_if_finite import ApplyIfFinite
from sofx.errors import HParamError, SofxError
from sofx.kernels.base import as_number
from sofx.kernels.user_numbers import fact_value, integer, is_bool, real_number
from sofx.loss_scale import (FLOAT32_MAX, LossScaler, LossScaleRuleError, LossScaleState, call_rule, check_scaler,
                             check_state_kind, inverse_scale)
from sofx.required import REQUIRED
from sofx.transforms import (MISSING_GRAD_MODES, _nonnegative_float, _sumsq, clip_coefficient, max_norm_value,
                             total_sumsq, zero_clip_factor)

__all__ = ["PROFILES", "StepFacts", "SerialStepResult", "LoopState", "init_loop", "hparams_at", "step_facts",
           "serial_step", "serial_loop_step", "check_opt", "check_loop", "check_profile", "check_max_norm",
           "clip_max_norm", "check_scale",
           "can_unscale",
           "loss_scale_of", "call_reduce", "reduced_sumsq", "step_settings", "with_loop_settings", "refuse_reduce",
           "refuse_unknown_keywords", "local_sumsq", "without_gradients"]

PROFILES = ("torch", "deepspeed")


class StepFacts(NamedTuple):
    """The global facts of one step, derived from numbers only.

    ``grad_scale`` is the one multiplier Adam applies to the raw gradients
    (unscale and clip folded); ``scale`` the loss scale they were unscaled
    with; ``clip_coef`` the multiplier applied to the unscaled gradients (1.0
    when not clipped); ``grad_norm`` the unscaled global norm (not finite on
    overflow); ``scaler_state`` the loss-scaler state for the next step; ``next_scale`` its scale (the rule's, read
    once, as a float: the scale the next backward multiplies the loss by).
    """

    overflow: bool
    sumsq: float
    scale: float
    grad_norm: float
    clipped: bool
    clip_coef: float
    grad_scale: float
    scaler_state: Any
    next_scale: float = math.nan

    @property
    def skipped(self) -> bool:
        """An overflow skips the step."""
        return self.overflow


class SerialStepResult(NamedTuple):
    params: Any
    state: AdamState
    scaler_state: Any
    facts: StepFacts


class LoopState(NamedTuple):
    """Everything a training loop carries from step to step.

    ``step`` counts the steps actually taken (a skipped overflow step does
    not): it is the schedule position. ``policy_state`` is the adaptive
    speculation policy's (``None`` for the serial loop).
    """

    params: Any
    opt_state: AdamState
    scaler_state: Any
    step: int = 0
    policy_state: Any = None


def check_opt(opt: Any) -> None:
    """Refuse (a :class:`~sofx.errors.SofxError` naming its type) an ``opt`` that is not a :class:`sofx.Adam`: a
    torch.optim optimizer raised "AttributeError: 'AdamW' object has no attribute 'check_inputs'"."""
    if isinstance(opt, ApplyIfFinite):
        raise SofxError("opt is an apply_if_finite(...) wrapper; the loops take its inner sofx.Adam (opt.inner) and "
                        "skip a step whose gradients are not finite themselves, through their loss scaler")
    if not isinstance(opt, Adam):
        raise SofxError(f"opt is {tree.article(type(opt).__name__)}; expected a sofx.Adam (sofx.adamw(...) or "
                        "sofx.adam(...))")


def check_loop(loop: Any) -> int:
    """Refuse (a :class:`~sofx.errors.SofxError` naming its type) a ``loop`` that is not a :class:`LoopState`: an
    optax-style ``(params, opt_state)`` tuple raised "AttributeError: 'tuple' object has no attribute 'step'".

    Returns ``loop.step`` (the steps taken: the schedule position) as a Python int >= 0 (a numpy or 1-element
    integer tensor count read as its int); any other step is refused naming ``loop.step`` (-1 became 0 and True
    2 without a word, and a string raised a TypeError after the step, with ``donate=True`` on overwritten
    parameters)."""
    if not isinstance(loop, LoopState):
        raise SofxError(f"loop is {tree.article(type(loop).__name__)}; expected a sofx.serial.LoopState "
                        "(sofx.serial.init_loop(opt, params, scaler) makes it)")
    if type(loop.step) is int and loop.step >= 0:  # the common case, every step
        return loop.step
    return integer("loop.step", loop.step, 0, error=SofxError)


def init_loop(opt: Adam, params: Any, scaler: LossScaler) -> LoopState:
    """The loop state before the first step (``scaler``: a loss-scale rule, :func:`~sofx.loss_scale.check_scaler`).
    A custom rule's ``init()`` that raises (not a refusal of sofx's own) is raised as a
    :class:`~sofx.loss_scale.LossScaleRuleError` naming the rule, its exception the cause, as the steps raise it
    (:func:`~sofx.loss_scale.call_rule`)."""
    check_opt(opt)
    check_scaler(scaler)
    opt_state = opt.init(params)
    scaler_state = call_rule(scaler, "init", where="init_loop: ", after="no loop state is made")
    return LoopState(params, opt_state, scaler_state, 0, None)


def local_sumsq(total: float, present: Sequence[bool]) -> float:
    """What this rank passes to ``reduce_sumsq``: its sum of squares ``total``, or ``-0.0`` where it has no
    gradient at all (``present``: per leaf or block, after ``missing_grad="zero"`` filled them in).

    ``-0.0`` is IEEE addition's identity (``-0.0 + x = x`` for every ``x``, ``+0.0`` included), and a sum of
    squares of gradients is otherwise ``+0.0`` or more: a hook that adds the ranks' values returns ``-0.0``
    exactly where no rank has a gradient (:func:`without_gradients`); every other sum keeps its bits.

    ``total`` is a sum of squares (a Python or numpy number >= 0, inf or nan, or a 1-element tensor: read as its
    float; a ``-0.0`` is ``+0.0``, which says the rank has gradients), ``present`` a sequence of bools (Python's or
    numpy's, or 0-d bool tensors); anything else is refused, an :class:`HParamError` naming it (``"x"`` came back as
    ``"x"``, a negative total lowered the ranks' sum, ``present="no"`` was read as a gradient).
    """
    if type(total) is not float or total < 0:
        f = _nonnegative_float(total, "local_sumsq: total")
        if f is None:
            raise HParamError(f"local_sumsq: total = {total!r:.80} is invalid; expected a sum of squares >= 0 (inf "
                              "or nan where a gradient is not finite: a Python or numpy number, or a 1-element "
                              f"tensor), got {type(total).__name__}")
        total = f
    return total + 0.0 if _any_present(present) else -0.0  # (+ 0.0: a -0.0 total is +0.0)


def _any_present(present: Any) -> bool:
    """:func:`local_sumsq`'s ``any(present)``, each entry a bool (a Python or numpy one, or a 0-d bool tensor)."""
    if type(present) not in (list, tuple):
        if isinstance(present, (str, bytes, Mapping)) or not isinstance(present, collections.abc.Iterable):
            raise HParamError(f"local_sumsq: present = {present!r:.80} is invalid; expected a sequence of bools "
                              f"(whether each leaf or block has a gradient), got {type(present).__name__}")
        present = list(present)
    found = False
    for x in present:  # (~20 ns an entry: the common case, Python bools)
        if x is True:
            found = True
        elif x is not False:
            break
    else:
        return found
    found = False
    for i, x in enumerate(present):
        if x is not True and x is not False:
            x = fact_value(x, f"local_sumsq: present[{i}]")
            if not is_bool(x):
                raise HParamError(f"local_sumsq: present[{i}] = {x!r:.80} is invalid; expected a bool (whether the "
                                  f"leaf or block has a gradient), got {type(x).__name__}")
        found = found or bool(x)
    return found


def without_gradients(total: float) -> bool:
    """Whether a step has no gradient on any rank: ``total``, the sum of :func:`local_sumsq` over ranks (this
    rank's own without ``reduce_sumsq``), is ``-0.0``. Nothing is stepped, and the loss scaler does not count
    the step (GradScaler refuses one without gradients; a count would move every later scale off torch's).
    A ``reduce_sumsq`` hook that returns ``+0.0`` there makes the step count as one with zero gradients."""
    return total == 0.0 and math.copysign(1.0, total) < 0.0


def _facts_without_gradients(facts: StepFacts, scaler: LossScaler, scaler_state: LossScaleState) -> StepFacts:
    """``facts`` of a step without gradients on any rank (:func:`without_gradients`): the loss scaler does not
    count it, so its state is kept, and with it the scale of the next backward (``next_scale``: the kept state's,
    not that of the update dropped)."""
    return facts._replace(scaler_state=scaler_state, next_scale=loss_scale_of(scaler, scaler_state))


def check_profile(profile: str) -> str:
    """``profile`` if it is one of ``PROFILES`` (``"torch"``, ``"deepspeed"``), else an :class:`HParamError`."""
    if profile not in PROFILES:
        raise HParamError(f"profile={profile!r}; expected one of {PROFILES}")
    return profile


def check_max_norm(max_norm: Any) -> float | None:
    """``max_norm`` as a float if it is a number >= 0, inf included (Python, numpy or a 1-element tensor:
    :func:`~sofx.transforms.max_norm_value`), ``None`` (no clipping) as is, else an :class:`HParamError` (a
    negative max_norm, nan). Under the ``"torch"`` profile 0 zeroes every gradient (``clip_grad_norm_``); under
    ``"deepspeed"`` it does not clip (:func:`clip_max_norm`); inf never clips."""
    return None if max_norm is None else max_norm_value(max_norm)


def clip_max_norm(profile: str, max_norm: float | None) -> float | None:
    """The max norm a step of ``profile`` clips at: ``None`` where it does not clip -- ``max_norm`` ``None``, or 0
    under ``"deepspeed"`` (ZeRO clips only where ``clip_grad > 0``: DeepSpeed's ``gradient_clipping`` of 0, its
    default, is "off"); ``"torch"`` clips at 0 as ``clip_grad_norm_`` does (every gradient zeroed)."""
    return None if max_norm is None or (profile == "deepspeed" and max_norm == 0) else max_norm


def check_scale(name: str, s: Any) -> float:
    """A loss scale as a float: finite and >= 0 (a scale of 0, which GradScaler reaches after many
    overflows in a row, is not refused: the step is an overflow, see :func:`can_unscale`). A numpy number or a
    1-element tensor is read as its number (:func:`~sofx.kernels.user_numbers.real_number`)."""
    x = real_number(s, name)
    try:
        f = float(x) if isinstance(x, numbers.Real) and not is_bool(x) else math.nan
    except OverflowError:  # an int beyond the float range
        f = math.inf
    if not (math.isfinite(f) and f >= 0):
        raise HParamError(f"{name} = {s!r:.80} is invalid; expected a finite number >= 0, got {type(s).__name__}")
    return f


def loss_scale_of(scaler: LossScaler, scaler_state: Any) -> float:
    """``scaler.scale(scaler_state)``, checked (:func:`check_scale`); what is not a loss-scale rule
    (:func:`~sofx.loss_scale.check_scaler`: torch's GradScaler, say) and a state of another kind than the scaler's
    own (what ``scaler.init()`` makes) are refused first, as an :class:`HParamError` naming them."""
    check_scaler(scaler)
    check_state_kind(scaler_state, type(call_rule(scaler, "init")))
    return check_scale("scaler.scale(scaler_state)", call_rule(scaler, "scale", scaler_state))


def step_settings(profile: str, max_norm: float | None, missing_grad: str, scaler_state: Any) -> dict[str, Any]:
    """What every rank of a step must share beyond its setup, as a hook with ``agreed_sum`` compares it
    (:func:`reduced_sumsq`): the profile, the clipping threshold ``max_norm`` (checked, a float or ``None``),
    the ``missing_grad`` mode and the loss-scaler state (its scale, growth count, ...). A rank that differs in
    one of them takes other global decisions than the others from the same sum of squares (clips at another
    threshold, unscales with another scale, grows the scale at another step): the replicas diverge."""
    return {"profile": profile, "max_norm": max_norm, "missing_grad": missing_grad, "scaler_state": scaler_state}


class _LoopReduce:
    """The ``reduce_sumsq`` hook as a loop step passes it on to its step (:func:`with_loop_settings`): the step's
    settings, compared where the hook has ``agreed_sum``, with the loop's own first."""

    def __init__(self, hook: Callable[[float], float], settings: Mapping[str, Any]) -> None:
        self.hook = hook
        self.settings = dict(settings)

    def __call__(self, local: float) -> Any:
        return self.agreed_sum(local, None)

    def agreed_sum(self, local: float, settings: Mapping[str, Any] | None) -> Any:
        return call_reduce(self.hook, local, {**self.settings, **(settings or {})})

    def refuse(self, error: BaseException | None = None) -> None:
        refuse_reduce(self.hook, error)


def with_loop_settings(reduce_sumsq: Callable[[float], float] | None,
                       step: int) -> Callable[[float], float] | None:
    """``reduce_sumsq`` as a loop step passes it to its step: where the hook compares the ranks' step settings
    (it has ``agreed_sum``: :func:`call_reduce`), one that adds the loop's step count ``step`` (``loop.step`` as
    :func:`check_loop` read it) to them, first; else the hook itself. ``loop.step`` is the schedule position: a
    rank at another one (resumed from another checkpoint, or a loop state of another run) evaluates the schedule
    elsewhere and steps with other hparams than the others (the schedule itself is compared at setup,
    :func:`sofx.distributed.all_reduce_sumsq`), and
    every rank of a group, sharded or not, takes the same steps: they all skip an overflow together."""
    if not callable(getattr(reduce_sumsq, "agreed_sum", None)):
        return reduce_sumsq
    return _LoopReduce(reduce_sumsq, {"step": step})


def call_reduce(reduce_sumsq: Callable[[float], float], local: float, settings: Mapping[str, Any] | None) -> Any:
    """``reduce_sumsq.agreed_sum(local, settings)`` where the hook has that method, else ``reduce_sumsq(local)``:
    what the hook returns, unchecked (:func:`reduced_sumsq` checks it). A hook that is not callable, None too (there
    is no hook to skip here: :func:`reduced_sumsq` takes None as none): an :class:`HParamError` naming it (Python's
    bare "'int' object is not callable")."""
    agreed_sum = getattr(reduce_sumsq, "agreed_sum", None)
    if agreed_sum is not None:
        return agreed_sum(local, settings)
    if not callable(reduce_sumsq):
        raise HParamError(f"call_reduce: reduce_sumsq is {tree.article(type(reduce_sumsq).__name__)}; expected a "
                          "function of this rank's sum of squares that returns the sum over ranks "
                          "(sofx.distributed.all_reduce_sumsq(group))")
    return reduce_sumsq(local)


def reduced_sumsq(reduce_sumsq: Callable[[float], float] | None, local: float,
                  settings: Mapping[str, Any] | None = None) -> float:
    """``reduce_sumsq(local)`` (the sum of squares over ranks) as a float, ``local`` without a hook; a hook that
    returns something other than a real number, or a negative one (a sum of squares is not; inf and nan are:
    an overflow somewhere), is refused (an :class:`HParamError`, not a TypeError or a math domain error later).

    A hook with an ``agreed_sum`` method (:func:`sofx.distributed.all_reduce_sumsq`'s) is called through it
    with the step's ``settings`` (:func:`step_settings`): in the same collective it checks that every rank
    passed the same, and raises on every rank where not, before any rank steps. A hook without it (a user's
    function) is called as ``reduce_sumsq(local)``."""
    if reduce_sumsq is None:
        return local
    check_reduce_sumsq(reduce_sumsq)
    total = as_number(call_reduce(reduce_sumsq, local, settings))
    if isinstance(total, bool) or not isinstance(total, numbers.Real) or total < 0:
        raise HParamError(f"reduce_sumsq returned {total!r}; expected the sum of squares over ranks, a number >= 0 "
                          "(inf or nan where a gradient is not finite)")
    try:
        total = float(total)
    except OverflowError:  # an int beyond the float range (Python's bare OverflowError): inf, as total_sumsq reads it
        total = math.inf
    if not math.isfinite(local) and math.isfinite(total):  # (the step taken as a clean one: nan written)
        raise HParamError(f"reduce_sumsq returned {total!r} where this rank's sum of squares is {local!r}: a sum over "
                          "ranks that holds a non-finite gradient is not finite (a MAX or nansum reduction, or a "
                          "hook that does not add this rank's sum, loses this rank's overflow)")
    return total


def check_reduce_sumsq(reduce_sumsq: Any) -> None:
    """Refuse (an :class:`HParamError`) a ``reduce_sumsq`` that is neither ``None`` nor callable (``5`` raised
    "'int' object is not callable" from the reduction, after a speculative step's blocks had run)."""
    if reduce_sumsq is not None and not callable(reduce_sumsq):
        raise HParamError(f"reduce_sumsq is {tree.article(type(reduce_sumsq).__name__)}; expected a function of this "
                          "rank's sum of squares that returns the sum over ranks "
                          "(sofx.distributed.all_reduce_sumsq(group)), or None")


def refuse_reduce(reduce_sumsq: Callable[[float], float] | None, error: BaseException) -> None:
    """Take part in the step's reduction as a rank that refuses the step (``error``: why; the caller raises
    it), through the hook's ``refuse`` where it has one (:func:`sofx.distributed.all_reduce_sumsq`'s does):
    the other ranks' hooks then raise instead of waiting for this rank's sum forever. A loop calls it when
    it raises before it calls ``reduce_sumsq``; a hook without ``refuse`` (a user's) is left alone."""
    refuse = getattr(reduce_sumsq, "refuse", None)
    if refuse is not None:
        refuse(error)


def _missing(**given: Any) -> list[str]:
    """The names of ``given`` (the step's required arguments and their values), in order, left at ``REQUIRED``."""
    return [name for name, value in given.items() if value is REQUIRED]


# the keywords of the steps that a loop step takes from its LoopState instead
_FROM_LOOP = {"params": "loop.params", "state": "loop.opt_state", "scaler_state": "loop.scaler_state",
              "policy_state": "loop.policy_state"}


def _keyword_names(fn: Callable[..., Any], leave_out: Sequence[str] = ()) -> tuple[str, ...]:
    """The keyword-only parameters of ``fn``, in order, but ``leave_out``."""
    return tuple(n for n, p in inspect.signature(fn).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in leave_out)


def _positional_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters of ``fn`` that may be given by position, in order (``opt, params, grads, state``)."""
    return tuple(n for n, p in inspect.signature(fn).parameters.items()
                 if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def refuse_unknown_keywords(what: str, unknown: Mapping[str, Any], known: Sequence[str],
                            reduce_sumsq: Callable[[float], float] | None, loop: bool = True,
                            missing: Sequence[str] = (), extra: Sequence[Any] = (),
                            positional: Sequence[str] = ()) -> None:
    """Refuse a call of step ``what`` that Python would have refused at the call: the keywords ``unknown`` it does
    not take (it takes ``known``, keyword-only), the required arguments ``missing`` it was not given and the
    positional arguments ``extra`` beyond its own (``positional``: those it takes by position, ``opt, params,
    grads, state``). A :class:`~sofx.errors.SofxError` names them and what it takes (for a loop step, ``loop``, a
    keyword the loop takes from its :class:`LoopState`, ``scaler_state=``, named as such; for a missing one, the
    unknown keyword given in its place, :func:`_misspelt`: ``scalr= given, did you mean scaler=?``,
    ``stat= given, did you mean state=?``; where a positional argument is missing or one too many, the positional
    ones before the keywords), raised before the step evaluates or steps anything, after telling the reduction
    (:func:`refuse_reduce`) through ``reduce_sumsq``, or without it, through a hook passed under an unknown
    keyword (``reduce_sumq=``) or as a positional argument too many, named as such in the error. Python's
    ``TypeError`` at the call (an unknown keyword, a required argument left out or misspelt, a positional argument
    too many), or from the step it calls, left the other ranks waiting for this rank's sum of squares forever; so
    did a refusal that did not find the hook where it was given."""
    if not unknown and not missing and not extra:
        return
    guesses = _misspelt(missing, unknown)
    names = sorted(n for n in unknown if n not in guesses.values())
    said = []
    if extra:
        said.append(f"{len(extra)} positional argument{'s' if len(extra) > 1 else ''} too many "
                    f"({', '.join(type(a).__name__ for a in extra)})")
    if missing:
        hint = "; ".join(f"{guesses[m]}= given, did you mean {m}=?" for m in missing if m in guesses)
        kind = "argument" if any(m in positional for m in missing) else "keyword argument"
        said.append(f"missing required {kind}{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(repr, missing))}{f' ({hint})' if hint else ''}")
    if names:
        said.append(f"unknown keyword argument{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))}")
    takes = ", ".join(known)
    if extra or any(m in positional for m in missing):
        takes = f"{', '.join(positional)}, then only the keywords {takes}"
    from_loop = [f"{n} is {_FROM_LOOP[n]}" for n in names if n in _FROM_LOOP and loop]
    hint = f" ({'; '.join(from_loop)}: pass the loop with it replaced)" if from_loop else ""
    misspelt = [n for n in sorted(unknown) if _is_hook(unknown[n])]
    if misspelt:
        hint += f" ({misspelt[0]} is a reduce_sumsq hook: pass it as reduce_sumsq=)"
    placed = next((k for k, a in enumerate(extra) if _is_hook(a)), None)
    if placed is not None:
        hint += (f" (positional argument {len(positional) + placed + 1} is a reduce_sumsq hook: pass it as "
                 "reduce_sumsq=)")
    error = SofxError(f"{what}: {'; '.join(said)}; it takes {takes}{hint}")
    # the hook passed under a misspelt keyword (reduce_sumq=) or by position is the one the other ranks wait in
    if reduce_sumsq is None and misspelt:
        reduce_sumsq = unknown[misspelt[0]]
    elif reduce_sumsq is None and placed is not None:
        reduce_sumsq = extra[placed]
    refuse_reduce(reduce_sumsq, error)
    raise error


def _misspelt(missing: Sequence[str], unknown: Mapping[str, Any]) -> dict[str, str]:
    """For each required keyword in ``missing``, the unknown keyword closest to it (``difflib``'s
    ``get_close_matches``, each unknown one used once), where one is close: ``{"scaler": "scalr"}``."""
    left = sorted(unknown)
    out = {}
    for name in missing:
        close = difflib.get_close_matches(name, left, n=1)
        if close:
            out[name] = close[0]
            left.remove(close[0])
    return out


def _is_hook(x: Any) -> bool:
    """Whether ``x`` is a ``reduce_sumsq`` hook that can refuse a step (:func:`refuse_reduce`):
    :func:`sofx.distributed.all_reduce_sumsq`'s, or one of the user's with a ``refuse`` method."""
    return callable(x) and callable(getattr(x, "refuse", None))


def can_unscale(scale: float) -> bool:
    """Whether gradients can be unscaled with ``1/scale`` in float32: ``scale > 0`` and ``1/scale`` finite there.

    ``torch.amp.GradScaler``'s scale reaches 0 after about 166 overflows in a row (it halves a float32);
    a step at such a scale is an overflow (:func:`step_facts`): skipped, and the scale backs off again.
    A numpy number or a 1-element tensor is read as its float; what is no real number is refused, an
    :class:`HParamError` naming it (a str raised Python's bare TypeError, a tensor gave a tensor).
    """
    if type(scale) is not float:
        x = real_number(scale, "can_unscale: scale")
        if not isinstance(x, numbers.Real) or is_bool(x):
            raise HParamError(f"can_unscale: scale = {scale!r:.80} is invalid; expected a loss scale, a real number (a "
                              f"Python or numpy number, or a 1-element tensor), got {type(scale).__name__}")
        try:
            scale = float(x)
        except OverflowError:  # an int beyond the float range
            scale = math.inf
    return scale > 0 and 1.0 / scale <= FLOAT32_MAX


def _scale_after(profile: str, scaler: LossScaler, scaler_state: LossScaleState,
                 overflow: bool) -> tuple[LossScaleState, float, float]:
    """The scaler's next state, the scale the gradients are unscaled with, in the profile's order, and the next
    state's scale, as floats
    (:func:`check_scale`: a state's 0-d tensor scale, which ``scale`` returns as it is, unscaled and clipped in
    float32 tensor arithmetic, off the float scale's step)."""
    next_state = call_rule(scaler, "update", scaler_state, overflow)
    try:  # (the state the next backward scales with: its scale read, as the report and the next step read it)
        next_scale = loss_scale_of(scaler, next_state)
    except SofxError as exc:
        raise LossScaleRuleError(f"the loss-scale rule's update() ({type(scaler).__name__}) returned a state that "
                                 f"cannot be taken: {exc}; the step is not taken (parameters, moments, step counts "
                                 "and the loss-scaler state are as before it)") from exc
    if profile != "torch":  # (DeepSpeed's order unscales with the next state's scale, read just above)
        return next_state, next_scale, next_scale
    return next_state, check_scale("scaler.scale(scaler_state)", call_rule(scaler, "scale", scaler_state)), next_scale


def step_facts(profile: str, scaler: LossScaler, scaler_state: LossScaleState, sumsq_total: float,
               max_norm: float | None) -> StepFacts:
    """Overflow, loss-scale update, norm and multiplier of one step (see the module docstring).

    Raises :class:`~sofx.loss_scale.MinLossScaleError` (DeepSpeed rule, overflow at the minimum scale), and a
    :class:`~sofx.loss_scale.LossScaleRuleError` where the rule's ``scale`` or ``update`` raises something else (a
    custom rule's failure, the cause) or ``update`` returns a state whose scale cannot be read.
    """
    check_profile(profile)
    if not (type(sumsq_total) is float and not sumsq_total < 0):  # (the common case, every step: a float >= 0 or nan)
        sumsq_total = _checked_sumsq_total(sumsq_total)
    max_norm = clip_max_norm(profile, check_max_norm(max_norm))
    loss_scale_of(scaler, scaler_state)  # checked before it decides anything
    overflow = not math.isfinite(sumsq_total)
    next_state, scale, next_scale = _scale_after(profile, scaler, scaler_state, overflow)
    if not overflow and not can_unscale(scale):
        # a loss scale of 0 (or so small that 1/S is beyond float32) cannot unscale: an overflow
        overflow = True
        next_state, scale, next_scale = _scale_after(profile, scaler, scaler_state, True)
    scaled_norm = math.sqrt(sumsq_total) if not math.isnan(sumsq_total) else math.nan
    norm = scaled_norm / scale if scale > 0 else scaled_norm * math.inf  # x/0 as IEEE: inf, or nan for 0
    if not overflow:
        clipped, coef, grad_scale = _clip_and_multiplier(profile, scaled_norm, scale, norm, max_norm)
        if not clipped and scale < 1 and norm > FLOAT32_MAX:
            # not clipped, unscaling by a loss scale below 1 may turn finite gradients into inf: an overflow (at 1
            # and above unscaling cannot, and torch and DeepSpeed step with such gradients; a clipped step
            # multiplies them by a coefficient that brings the norm down to max_norm)
            overflow = True
            next_state, scale, next_scale = _scale_after(profile, scaler, scaler_state, True)
    if overflow:
        # (the unclipped multiplier, as the profile gives it: unused, a skipped step's report shows it)
        unclipped = _clip_and_multiplier(profile, scaled_norm, scale, norm, None)[2] if scale > 0 else math.inf
        return StepFacts(True, sumsq_total, scale, norm, False, 1.0, unclipped, next_state, next_scale)
    return StepFacts(False, sumsq_total, scale, norm, clipped, coef, grad_scale, next_state, next_scale)


def _checked_sumsq_total(s: Any) -> float:
    """:func:`step_facts`' ``sumsq_total`` as a Python float where it is a sum of squares: a number >= 0, inf or nan
    (a Python or numpy number, or a 1-element tensor; an int beyond the float range is inf), as
    :func:`~sofx.transforms.total_sumsq` reads a block's; else an :class:`HParamError` naming it (a negative one
    raised Python's bare "math domain error" from its square root, a str or None a TypeError, True was 1)."""
    f = _nonnegative_float(s, "step_facts: sumsq_total")
    if f is None:
        raise HParamError(f"step_facts: sumsq_total = {s!r:.80} is invalid; expected a sum of squares >= 0 (inf or "
                          "nan where a gradient is not finite: a Python or numpy number, or a 1-element tensor), got "
                          f"{type(s).__name__}")
    return f


def _clip_and_multiplier(profile: str, scaled_norm: float, scale: float, norm: float,
                         max_norm: float | None) -> tuple[bool, float, float]:
    """Whether the step is clipped, the clip coefficient applied to the unscaled gradients (1.0: not clipped)
    and the one multiplier of the raw gradients, in the profile's form: ``"torch"``
    ``coef = clip_coefficient(norm, max_norm)``, multiplier ``inv * coef`` (``inv`` exactly when not clipped),
    ``inv = float32(1/S)``, GradScaler's (:func:`~sofx.loss_scale.inverse_scale`); ``"deepspeed"``
    ``clip = zero_clip_factor(...)``, coefficient ``1/clip``, multiplier ``1/(clip*S)``."""
    if profile == "torch":
        coef = 1.0 if max_norm is None else clip_coefficient(norm, max_norm)
        return coef != 1.0, coef, inverse_scale(scale) * coef  # (exactly inv where not clipped: coef 1.0)
    clip = 1.0 if max_norm is None else zero_clip_factor(scaled_norm, scale, max_norm)
    return clip > 1.0, 1.0 / clip, 1.0 / (clip * scale)


def serial_step(opt: Adam = REQUIRED, params: Any = REQUIRED, grads: Any = REQUIRED, state: AdamState = REQUIRED,
                *extra: Any, scaler: LossScaler = REQUIRED,
                scaler_state: LossScaleState = REQUIRED, hparams: Any = None, max_norm: float | None = None,
                profile: str = "torch", missing_grad: str = "skip",
                reduce_sumsq: Callable[[float], float] | None = None,
                donate: bool = False, **unknown: Any) -> SerialStepResult:
    """One non-speculative step on raw (loss-scaled) gradients; see the module docstring.

    ``grads`` has the structure of ``params``; a ``None`` leaf had no gradient:
    ``missing_grad="skip"`` leaves its parameter, moments and count alone,
    ``"zero"`` steps it with a zero gradient. ``reduce_sumsq`` all-reduces the
    local sum of squares across ranks (a nan/inf anywhere makes every rank skip;
    a rank without any gradient passes ``-0.0``, :func:`local_sumsq`, and a
    step without gradient on any rank is not counted by the loss scaler,
    :func:`without_gradients`); a hook that compares the ranks' step settings
    (profile, ``max_norm``, ``missing_grad``, ``scaler_state``) gets them
    (:func:`reduced_sumsq`). A rank whose inputs are refused tells the
    others through the hook (:func:`refuse_reduce`) before it raises.
    Returns the new params, state, loss-scaler state and the step's
    :class:`StepFacts`; on overflow params and state are returned unchanged.
    ``opt``, ``params``, ``grads``, ``state``, ``scaler`` and ``scaler_state`` are required (``<required>``). A
    keyword it does not take, a required argument left out or misspelt (``stat=``) or a positional argument too
    many is refused (:func:`refuse_unknown_keywords`) before anything runs.
    """
    missing = _missing(opt=opt, params=params, grads=grads, state=state, scaler=scaler, scaler_state=scaler_state)
    if unknown or missing or extra:
        refuse_unknown_keywords("serial_step", unknown, _keyword_names(serial_step), reduce_sumsq, loop=False,
                                missing=missing, extra=extra, positional=_positional_names(serial_step))
    try:  # everything this rank may refuse, before the reduction (see refuse_reduce)
        check_opt(opt)
        check_reduce_sumsq(reduce_sumsq)
        check_profile(profile)
        if missing_grad not in MISSING_GRAD_MODES:
            raise HParamError(f"missing_grad={missing_grad!r}; expected one of {MISSING_GRAD_MODES}")
        check_max_norm(max_norm)
        loss_scale_of(scaler, scaler_state)
        # before any gradient is read; also on a step that will overflow (speculation checks before it knows)
        opt.check_inputs(params, grads, state, hparams, donate=donate, zero_missing=missing_grad == "zero")
        p_leaves, spec = tree.flatten(params)
        g_leaves = tree.flatten_up_to(spec, grads, "grads") if grads is not None else [None] * len(p_leaves)
        if missing_grad == "zero":
            g_leaves = [torch.zeros_like(p) if g is None else g for p, g in zip(p_leaves, g_leaves)]
        # (each gradient's storage checked by check_inputs, a zero one new: transforms.sumsq would check it again)
        local = local_sumsq(total_sumsq([None if g is None else _sumsq(g) for g in g_leaves]),
                            [g is not None for g in g_leaves])
    except Exception as exc:
        refuse_reduce(reduce_sumsq, exc)
        raise
    total = reduced_sumsq(reduce_sumsq, local, step_settings(profile, check_max_norm(max_norm), missing_grad,
                                                             scaler_state))
    empty = without_gradients(total)
    facts = step_facts(profile, scaler, scaler_state, 0.0 if empty else total, max_norm)
    if empty:
        facts = _facts_without_gradients(facts, scaler, scaler_state)
    if facts.overflow:
        return SerialStepResult(params, state, facts.scaler_state, facts)
    # No overflow: the sum of squares is finite, so is every gradient element (transforms.sumsq); the
    # update need not read the gradients again to choose its undo strategies.
    new_params, new_state, _ = opt.update(params, tree.unflatten(spec, g_leaves), state, hparams,
                                          grad_scale=facts.grad_scale, donate=donate, grads_finite=True,
                                          undoable=False)
    return SerialStepResult(new_params, new_state, facts.scaler_state, facts)


def serial_loop_step(opt: Adam = REQUIRED, loop: LoopState = REQUIRED, grads: Any = REQUIRED, *extra: Any,
                     scaler: LossScaler = REQUIRED,
                     hparams: Any = None,
                     max_norm: float | None = None, profile: str = "torch", missing_grad: str = "skip",
                     reduce_sumsq: Callable[[float], float] | None = None,
                     donate: bool = False, **unknown: Any) -> tuple[LoopState, StepFacts]:
    """:func:`serial_step` on a :class:`LoopState`; ``hparams`` may be a schedule ``step -> hparams``.

    The schedule is evaluated at ``loop.step`` (steps taken so far), and
    ``loop.step`` advances only when the step was not skipped::

        loop = init_loop(opt, params, scaler)
        for batch in data:
            grads = ...                        # gradients of loss * scaler.scale(loop.scaler_state)
            loop, facts = serial_loop_step(opt, loop, grads, scaler=scaler, hparams=schedule, max_norm=1.0)

    A step without any gradient (every leaf ``None``, ``missing_grad="skip"``) is not skipped: nothing is stepped
    and the loss scaler does not count it, but ``loop.step`` advances, as a torch loop's ``scheduler.step()``
    after an ``optimizer.step()`` that found no gradient (torch's ``GradScaler.step`` refuses such a step).
    A hook that compares the ranks' step settings also compares ``loop.step`` (:func:`with_loop_settings`).
    ``opt``, ``loop``, ``grads`` and ``scaler`` are required (``<required>``). A keyword it does not take, a
    required argument left out or misspelt (``lop=``) or a positional argument too many is refused
    (:func:`refuse_unknown_keywords`) before anything runs.
    """
    missing = _missing(opt=opt, loop=loop, grads=grads, scaler=scaler)
    if unknown or missing or extra:
        refuse_unknown_keywords("serial_loop_step", unknown, _keyword_names(serial_loop_step), reduce_sumsq,
                                missing=missing, extra=extra, positional=_positional_names(serial_loop_step))
    try:
        step = check_loop(loop)
        check_opt(opt)  # (before the schedule runs)
        hp = hparams_at(hparams, step)
    except Exception as exc:  # a schedule's failure: refused before the reduction, as serial_step's
        refuse_reduce(reduce_sumsq, exc)
        raise
    res = serial_step(opt, loop.params, grads, loop.opt_state, scaler=scaler, scaler_state=loop.scaler_state,
                      hparams=hp, max_norm=max_norm, profile=profile, missing_grad=missing_grad,
                      reduce_sumsq=with_loop_settings(reduce_sumsq, step), donate=donate)
    new = LoopState(res.params, res.state, res.scaler_state, step + (not res.facts.skipped), loop.policy_state)
    return new, res.facts
