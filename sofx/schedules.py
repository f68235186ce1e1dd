"""Hyperparameter schedules: pure functions ``step -> value`` or ``step -> AdamHParams``.

``step`` is the number of optimizer steps already taken (0 for the first
step), as in optax and as ``torch.optim.lr_scheduler`` after ``step`` calls to
``scheduler.step()``. A skipped step (overflow) does not advance it.
Schedules are small frozen dataclasses: callable, comparable, printable and
picklable (a worker process can receive them).

=====================  ==========================================================
:func:`constant`       ``v``
:func:`linear_warmup`  ``init + (peak - init) * min(step, W) / W``
:func:`linear`         ``init + (end - init) * min(step, N) / N`` (``torch LinearLR``-like)
:func:`cosine_decay`   ``init * ((1 - alpha) * (1 + cos(pi * min(step, N)/N)) / 2 + alpha)``
:func:`warmup_cosine`  linear warm-up to ``peak`` over ``W`` steps, then cosine from
                       ``peak`` to ``end`` over the remaining ``N - W`` steps
:func:`step_decay`     ``init * gamma ** (step // every)`` (``torch StepLR``)
:func:`one_cycle`      ``torch OneCycleLR``: lr up then down, beta1 down then up
:func:`join`           schedule ``k`` on ``[b_{k-1}, b_k)``, called with ``step - b_{k-1}``
:func:`hparams_schedule`  one schedule (or constant) per field -> ``AdamHParams``
=====================  ==========================================================

Against ``torch.optim.lr_scheduler``: :func:`one_cycle` is ``OneCycleLR`` bit for bit (torch computes each value
from the step, with the same operations), :func:`step_decay` is ``StepLR``'s closed form bit for bit (what
``scheduler.step(epoch)`` sets). Stepped as usual, ``StepLR``, ``LinearLR`` and ``CosineAnnealingLR`` set each lr
from the previous one, which drifts from the closed form by an ulp or so per step (up to a relative 5e-13
after 10^4 steps): with those the values agree to that rounding, not bit for bit (far below float32's).

Under ``torch.compile(fullgraph=True)`` a schedule may be called inside the compiled step with the step as a Python
int (symbolic from the second call): its checks are comparisons, guards, and its messages do not format the step.
One graph for the first step, then one per phase of the schedule (a phase's end is a guard), bitwise the eager steps.

A schedule whose value leaves the float range is refused (:class:`~sofx.errors.HParamError`): at construction
where that is certain (``linear(-1e308, 1e308, n)``: ``end - init`` is inf), else at the step where it happens
(``step_decay`` with ``|gamma| > 1``, where torch's StepLR gives an inf lr). So is, at construction, a schedule
whose first value is >= 0 and whose arguments take it below 0 later (``cosine_decay(0.1, n, alpha=-0.1)``,
``linear(0.1, -0.1, n)``: no hparam takes a negative value, and the optimizer refused it mid-run), naming the
argument; and a :func:`join` starting >= 0 with a later schedule below 0 at its own first step, naming that schedule.
"""

from __future__ import annotations

import difflib
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch

from sofx.adam import AdamHParams, check_hparam_value, shown_step
from sofx.errors import HParamError
from sofx.kernels.base import as_number, is_numpy_real, is_traced
from sofx.kernels.storage import in_storage
from sofx.kernels.user_numbers import finite_number, flag, integer
from sofx.tree import article

__all__ = [
    "Schedule",
    "Constant",
    "Linear",
    "CosineDecay",
    "WarmupCosine",
    "StepDecay",
    "OneCycle",
    "Join",
    "HParamsSchedule",
    "constant",
    "linear",
    "linear_warmup",
    "cosine_decay",
    "warmup_cosine",
    "step_decay",
    "one_cycle",
    "join",
    "hparams_schedule",
]

Schedule = Callable[[int], Any]


def _step(step: Any) -> int:
    """The step a schedule is called with as a Python int >= 0 (a numpy integer or a 1-element integer tensor
    too: :func:`~sofx.kernels.user_numbers.integer`)."""
    if type(step) is int and step >= 0:  # the common case, every step
        return step
    return integer("schedule step", step, 0)


def _set(schedule: Any, **fields: Any) -> None:
    """Set a frozen schedule's ``fields`` to their checked Python values, once, in ``__post_init__`` (kept as
    given, a numpy or tensor field made every value a numpy number or a tensor)."""
    for name, value in fields.items():
        object.__setattr__(schedule, name, value)


def _finite(schedule: Any, *names: str) -> None:
    """Read each of ``schedule``'s fields ``names`` once as a finite Python int or float (numpy numbers and
    1-element tensors too: :func:`~sofx.kernels.user_numbers.finite_number`)."""
    _set(schedule, **{name: finite_number(name, getattr(schedule, name)) for name in names})


def _span(who: str, name: str, a: float, b: float) -> None:
    """``b - a`` (a schedule interpolates over it) must be a finite float: ``-1e308 -> 1e308`` gave nan (and
    ``-2**1023 -> 2**1023``, integers, a raw OverflowError: their difference is an int beyond the float range)."""
    try:
        finite = math.isfinite(b - a)
    except OverflowError:
        finite = False
    if not finite:
        raise HParamError(f"{who}: {name} = {b!r} - {a!r} is beyond the float range; expected values whose "
                          "difference is a finite float")


def _stays_nonnegative(who: str, first_name: str, first: float, name: str, value: float) -> None:
    """A schedule whose first value ``first`` (its argument ``first_name``) is >= 0 must not reach ``value`` (its
    argument ``name``) below 0: the optimizer took its first steps and refused the negative hparam mid-run, where it
    got there (no hparam takes a negative value). A schedule negative from its first step is refused at that step."""
    if first >= 0 > value:
        raise HParamError(f"{who}: {name} = {value!r} is invalid with {first_name} = {first!r}: the value starts >= 0 "
                          f"and goes below 0 mid-run (a negative hparam, refused at that step); expected {name} >= 0")


def _finite_product(who: str, name: str, a: float, b: float) -> None:
    """The value ``a * b`` (called ``name``) that a schedule reaches mid-run must be a finite float: it returned inf
    there (refused at that step), where it is certain from the arguments."""
    try:
        finite = -math.inf < float(a) * float(b) < math.inf
    except OverflowError:  # an int beyond the float range
        finite = False
    if not finite:
        raise HParamError(f"{who}: {name} = {a!r} * {b!r} is beyond the float range; expected arguments whose "
                          "schedule stays finite")


def _value(who: str | Callable[[], str], step: int, value: float) -> float:
    """A schedule's value at ``step``, refused where it left the float range (inf, or nan from inf - inf).

    ``who`` names the schedule (a function making the name where it shows values of the step). A comparison, not
    ``math.isfinite``: under ``torch.compile`` with a symbolic step the value is a symbolic float, which
    ``math.isfinite`` does not take (a graph break); the comparison is a guard, true at every finite value."""
    if not -math.inf < value < math.inf:
        raise HParamError(f"{who if isinstance(who, str) else who()}: the value at step {shown_step(step)} is "
                          f"{value!r}, beyond the float range; expected hyperparameters whose schedule stays finite")
    return value


def _items(name: str, value: Any, expected: str) -> tuple:
    """``join``'s argument ``name`` as a tuple where it is a sequence (any iterable but a string), else an
    :class:`HParamError` naming it (one boundary or one schedule given without a list: a raw TypeError)."""
    if not isinstance(value, (str, bytes)):
        try:
            return tuple(value)
        except TypeError:
            pass
    raise HParamError(f"join: {name} = {value!r:.60} ({type(value).__name__}) is invalid; expected {expected}")


def _steps(schedule: Any, field: str, name: str, minimum: int = 1) -> None:
    """Read ``schedule``'s field ``field`` (called ``name``, as the constructor function's argument) once as a
    Python int >= ``minimum`` (:func:`~sofx.kernels.user_numbers.integer`: a numpy integer or a 1-element integer tensor
    too; a float, even a whole one, is refused)."""
    _set(schedule, **{field: integer(name, getattr(schedule, field), minimum)})


@dataclass(frozen=True)
class Constant:
    """``step -> value``."""

    value: float

    def __post_init__(self) -> None:
        _finite(self, "value")

    def __call__(self, step: int) -> float:
        _step(step)
        return self.value


@dataclass(frozen=True)
class Linear:
    """``init + (end - init) * min(step, steps) / steps``; ``end`` from the first step when ``steps`` is 0
    (a warm-up of no steps starts at its peak, as optax's warm-up schedules do; optax's ``linear_schedule`` of 0
    transition steps holds ``init_value``). Otherwise optax's ``linear_schedule``, to rounding."""

    init: float
    end: float
    steps: int

    def __post_init__(self) -> None:
        _finite(self, "init", "end")
        _steps(self, "steps", "steps", minimum=0)
        _span("linear", "end - init", self.init, self.end)
        if self.steps:  # (of no steps: end from the first step)
            _stays_nonnegative("linear", "init", self.init, "end", self.end)

    def __call__(self, step: int) -> float:
        step = _step(step)
        if self.steps == 0:
            return self.end
        frac = min(step, self.steps) / self.steps
        return self.init + (self.end - self.init) * frac


@dataclass(frozen=True)
class CosineDecay:
    """``init * ((1 - alpha) * 0.5 * (1 + cos(pi * min(step, steps) / steps)) + alpha)``.

    ``torch.optim.lr_scheduler.CosineAnnealingLR(T_max=steps, eta_min=alpha*init)`` up to ``steps``; past it
    this holds ``alpha * init`` where torch's cosine rises again (it is periodic), as optax's
    ``cosine_decay_schedule(init, steps, alpha)`` does (the same values, to rounding)."""

    init: float
    steps: int
    alpha: float = 0.0

    def __post_init__(self) -> None:
        _finite(self, "init", "alpha")
        _steps(self, "steps", "decay_steps")
        if self.alpha < 0:  # from init through 0 to alpha * init: a negative lr mid-run, refused at that step
            raise HParamError(f"cosine_decay: alpha = {self.alpha!r} is invalid; expected alpha >= 0 (the value goes "
                              "from init to alpha * init: a negative alpha takes it through 0 to the other sign "
                              "mid-run)")
        _finite_product("cosine_decay", "alpha * init", self.alpha, self.init)

    def __call__(self, step: int) -> float:
        step = _step(step)
        frac = min(step, self.steps) / self.steps
        return _value("cosine_decay", step,
                      self.init * ((1.0 - self.alpha) * 0.5 * (1.0 + math.cos(math.pi * frac)) + self.alpha))


@dataclass(frozen=True)
class WarmupCosine:
    """Linear ``init -> peak`` over ``warmup`` steps, then cosine ``peak -> end`` until ``steps``."""

    peak: float
    warmup: int
    steps: int
    init: float = 0.0
    end: float = 0.0

    def __post_init__(self) -> None:
        _finite(self, "peak", "init", "end")
        _steps(self, "warmup", "warmup_steps", 0)
        _steps(self, "steps", "decay_steps", self.warmup + 1)
        _span("warmup_cosine", "peak - init", self.init, self.peak)
        _span("warmup_cosine", "peak - end", self.end, self.peak)
        first, first_name = (self.init, "init") if self.warmup else (self.peak, "peak")
        for name in ("peak", "end"):  # the warm-up reaches peak, the decay end
            _stays_nonnegative("warmup_cosine", first_name, first, name, getattr(self, name))

    def __call__(self, step: int) -> float:
        step = _step(step)
        if step < self.warmup:  # linear_warmup's value: the fraction first ((peak - init) * step overflowed)
            return self.init + (self.peak - self.init) * (step / self.warmup)
        frac = min(step - self.warmup, self.steps - self.warmup) / (self.steps - self.warmup)
        return _value("warmup_cosine", step,
                      self.end + (self.peak - self.end) * 0.5 * (1.0 + math.cos(math.pi * frac)))


@dataclass(frozen=True)
class StepDecay:
    """``init * gamma ** (step // every)`` (``torch.optim.lr_scheduler.StepLR``'s closed form, bit for bit)."""

    init: float
    every: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _finite(self, "init", "gamma")
        _steps(self, "every", "step_size")
        if self.gamma < 0:  # the sign flipped every step_size steps: a negative lr, refused mid-run by the optimizer
            raise HParamError(f"step_decay: gamma = {self.gamma!r} is invalid; expected gamma >= 0 (a negative gamma "
                              "flips the value's sign every step_size steps)")

    def __call__(self, step: int) -> float:
        """``init * gamma ** (step // every)``; a step where that leaves the float range (``|gamma| > 1``) is refused
        (torch's StepLR gives an inf lr there, Python's ``**`` an OverflowError)."""
        step = _step(step)
        k = step // self.every
        try:  # in floats: an int init and gamma made it an int, 2 ** 2000 no float (and k bits long to build)
            value = self.init * float(self.gamma) ** k
        except OverflowError:
            value = math.inf
        return _value(lambda: f"step_decay (init * gamma ** (step // step_size) = {self.init!r} * {self.gamma!r} ** "
                      f"{shown_step(k)})", step, value)


def _anneal_cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def _anneal_linear(start: float, end: float, pct: float) -> float:
    return (end - start) * pct + start


@dataclass(frozen=True)
class OneCycle:
    """``torch.optim.lr_scheduler.OneCycleLR`` for lr and beta1 (its "momentum").

    Phase ends (in steps): ``pct_start * total - 1`` and ``total - 1`` (three
    phases: ``pct_start*total - 1``, ``2*pct_start*total - 2``, ``total - 1``).
    lr goes ``max_lr/div_factor -> max_lr -> max_lr/(div_factor*final_div_factor)``
    while beta1 goes ``max_beta1 -> base_beta1 -> max_beta1``, annealed by
    cosine (or linearly). ``__call__`` returns ``AdamHParams(lr=..., beta1=...)``
    (beta1 ``None`` when ``cycle_beta1=False``); :meth:`lr` and :meth:`beta1` give one field.

    Both are torch's bit for bit at every step up to ``total_steps``. Step ``total_steps`` is past the
    cycle (the value torch's scheduler sets after its last step): the last anneal carried past its end, an lr
    above the final one under ``"cos"``, below it under ``"linear"``: ``final - (start - final) / L`` for a last
    phase of ``L`` steps from ``start`` (``max_lr``; three phases: ``max_lr / div_factor``), negative (which the
    optimizer refuses) unless ``L`` reaches ``start / final - 1`` (``div_factor * final_div_factor - 1``, 249999 with
    the defaults; three phases: ``final_div_factor - 1``). A later step is refused, where torch's scheduler raises.
    """

    max_lr: float
    total_steps: int
    pct_start: float = 0.3
    anneal: str = "cos"
    cycle_beta1: bool = True
    base_beta1: float = 0.85
    max_beta1: float = 0.95
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False

    def __post_init__(self) -> None:
        _finite(self, "max_lr", "pct_start", "base_beta1", "max_beta1", "div_factor", "final_div_factor")
        _steps(self, "total_steps", "total_steps")
        if self.total_steps > sys.float_info.max:  # the phase ends are floats: float(total_steps) overflowed
            raise HParamError(f"total_steps = {self.total_steps!r:.40}... is invalid; expected an integer within "
                              "the float range (the phase ends are floats, pct_start * total_steps - 1)")
        # Python bools (three_phase="no" was taken as three phases)
        _set(self, **{name: flag(name, getattr(self, name)) for name in ("cycle_beta1", "three_phase")})
        if not 0 <= self.pct_start <= 1:
            raise HParamError(f"pct_start = {self.pct_start!r} is invalid; expected 0 <= pct_start <= 1")
        if self.pct_start == 1 and not self.three_phase:
            # the annealing phase would have no steps (torch's OneCycleLR divides by zero)
            raise HParamError("pct_start = 1 leaves the two-phase cycle no annealing phase; expected pct_start < 1 "
                              "(or three_phase=True)")
        if self.anneal not in ("cos", "linear"):
            raise HParamError(f"anneal = {self.anneal!r}; expected 'cos' or 'linear'")
        if self.max_lr < 0:
            raise HParamError(f"max_lr = {self.max_lr!r} is invalid; expected a learning rate >= 0")
        if self.cycle_beta1:  # beta1 runs between them: one outside [0, 1) was refused mid-run, where reached
            for name in ("base_beta1", "max_beta1"):
                if not 0 <= getattr(self, name) < 1:
                    raise HParamError(f"{name} = {getattr(self, name)!r} is invalid; expected 0 <= {name} < 1 "
                                      "(beta1 cycles between base_beta1 and max_beta1)")
        for name in ("div_factor", "final_div_factor"):  # lr is divided by them: 0 divides by zero, < 0 flips it
            if not getattr(self, name) > 0:
                raise HParamError(f"{name} = {getattr(self, name)!r} is invalid; expected a number > 0")
        initial = self.max_lr / self.div_factor  # the first lr, and the last: inf at a step mid-run where certain here
        for name, lr, text in (("div_factor", initial, "max_lr / div_factor"),
                               ("final_div_factor", initial / self.final_div_factor,
                                "max_lr / (div_factor * final_div_factor)")):
            if not lr < math.inf:
                raise HParamError(f"{name} = {getattr(self, name)!r} is invalid with max_lr = {self.max_lr!r}: the lr "
                                  f"{text} is {lr!r}, beyond the float range; expected a larger {name}")
        # A phase of no steps that a step still reaches (torch's OneCycleLR divides by zero there): the first
        # where it ends at step 0, the last where it ends where the one before it ends.
        ends = [end for end, _, _ in self._phases()]
        if ends[0] == 0:
            raise HParamError(f"pct_start * total_steps = {self.pct_start!r} * {self.total_steps} = 1 leaves the "
                              "warm-up phase no steps (it ends at step 0); expected a product other than 1")
        if ends[-1] - ends[-2] == 0:  # (int - float: torch's divisor, float(total_steps - 1) - the end before)
            raise HParamError(f"pct_start = {self.pct_start!r} with total_steps = {self.total_steps} leaves the "
                              "three-phase cycle's last phase no steps (2 * pct_start * total_steps = "
                              "total_steps + 1)")

    def _phases(self) -> list[tuple[float, str, str]]:
        """(end step, start value, end value) of each phase, as OneCycleLR's: the last ends at the int
        ``total_steps - 1`` (``float(total_steps) - 1`` is another float for an odd total_steps above 2**53)."""
        n, p = self.total_steps, self.pct_start
        if self.three_phase:
            return [(float(p * n) - 1, "initial", "max"), (float(2 * p * n) - 2, "max", "initial"),
                    (n - 1, "initial", "min")]
        return [(float(p * n) - 1, "initial", "max"), (n - 1, "max", "min")]

    def _at(self, step: int) -> tuple[float, float]:
        step = _step(step)
        if step > self.total_steps:
            raise HParamError(f"one_cycle: step {step} is past total_steps = {self.total_steps} "
                              "(torch's OneCycleLR raises here too)")
        initial = self.max_lr / self.div_factor
        lrs = {"initial": initial, "max": self.max_lr, "min": initial / self.final_div_factor}
        # beta1 moves opposite to lr: max_beta1 where lr is low, base_beta1 where lr peaks
        betas = {"initial": self.max_beta1, "max": self.base_beta1, "min": self.max_beta1}
        anneal = _anneal_cos if self.anneal == "cos" else _anneal_linear
        phases = self._phases()
        start = 0.0
        for k, (end, a, b) in enumerate(phases):
            if step <= end or k == len(phases) - 1:
                pct = (step - start) / (end - start)
                return (_value("one_cycle lr", step, anneal(lrs[a], lrs[b], pct)),
                        _value("one_cycle beta1", step, anneal(betas[a], betas[b], pct)))
            start = end
        raise AssertionError("unreachable")  # pragma: no cover

    def lr(self, step: int) -> float:
        """The learning rate after ``step`` steps (as ``OneCycleLR`` after ``step`` scheduler steps)."""
        return self._at(step)[0]

    def beta1(self, step: int) -> float | None:
        """beta1 after ``step`` steps: it cycles opposite to the learning rate (``cycle_momentum``); ``None`` (the
        optimizer's own, as in ``__call__``) when ``cycle_beta1=False``."""
        b1 = self._at(step)[1]
        return b1 if self.cycle_beta1 else None

    def __call__(self, step: int) -> AdamHParams:
        lr, b1 = self._at(step)
        return AdamHParams(lr=lr, beta1=b1 if self.cycle_beta1 else None)


@dataclass(frozen=True)
class Join:
    """Schedule ``k`` on ``[boundaries[k-1], boundaries[k])``, called with ``step - boundaries[k-1]`` (optax's
    ``join_schedules``). Where the join's first value is >= 0, a later schedule below 0 at its own first step is
    refused at construction, naming it (:meth:`_refuse_negative_starts`: each schedule a step reaches is called
    once, at its step 0)."""

    schedules: tuple[Schedule, ...]
    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        schedules = _items("schedules", self.schedules, "a sequence of schedules")
        given = _items("boundaries", self.boundaries, "a sequence of step counts (one fewer than the schedules)")
        if not schedules:
            raise HParamError("join: expected at least one schedule, got 0")
        if len(schedules) != len(given) + 1:
            raise HParamError(f"join: {len(schedules)} schedules need {len(schedules) - 1} boundaries, "
                              f"got {len(given)}")
        boundaries = [integer(f"join: boundaries[{i}]", b, 0) for i, b in enumerate(given)]
        for i in range(1, len(boundaries)):
            if boundaries[i] < boundaries[i - 1]:
                raise HParamError(f"join: boundaries[{i}] = {boundaries[i]} is invalid; expected an integer >= "
                                  f"{boundaries[i - 1]} (boundaries[{i - 1}]: boundaries do not decrease)")
        for i, s in enumerate(schedules):
            if not callable(s):
                raise HParamError(f"join: schedule {i} is {article(type(s).__name__)}, not callable")
        _set(self, schedules=schedules, boundaries=tuple(boundaries))
        self._refuse_negative_starts()

    def _refuse_negative_starts(self) -> None:
        """As :func:`_stays_nonnegative` for one schedule: where the join's first value is >= 0 (per field of an
        :class:`AdamHParams`; ``None``, the optimizer's default, counts as >= 0), a later schedule whose value at
        its own first step is below 0 made a negative hparam mid-run, refused only at that step. Each schedule a
        step reaches is called once at its step 0 (schedules are pure: cheap); values that cannot be read
        (traced tensors) are not compared. A join negative from its first step is refused at that step."""
        starts = [0, *self.boundaries]
        ends = [*self.boundaries, math.inf]
        reached = [k for k in range(len(self.schedules)) if starts[k] < ends[k]]
        first = _start_numbers(self.schedules[reached[0]](0))
        for k in reached[1:]:
            for name, value in _start_numbers(self.schedules[k](0)).items():
                if value is not None and value < 0 and (name not in first or first[name] is not None
                                                        and first[name] >= 0):
                    what = f"its {name}" if name else "its value"
                    was = f"{first[name]!r}" if name in first else "the optimizer's default"
                    raise HParamError(f"join: schedule {k} ({type(self.schedules[k]).__name__}) starts below 0: "
                                      f"{what} at its step 0 (the join's step {starts[k]}) is {value!r}, where the "
                                      f"join starts at {was} (schedule {reached[0]}): a negative hparam mid-run, "
                                      "refused at that step; expected schedules whose values stay >= 0")

    def __call__(self, step: int) -> Any:
        step = _step(step)
        start = 0
        for sched, b in zip(self.schedules, self.boundaries):
            if step < b:
                return sched(step - start)
            start = b
        return self.schedules[-1](step - start)


def _start_numbers(value: Any) -> dict[str, float | None]:
    """The numbers a schedule's ``value`` holds, by hparam name (``""`` for a value that is a number; an
    :class:`AdamHParams`, its fields that are not ``None``): a Python or numpy real, or a 1-element real tensor
    whose value can be read; ``None`` for anything else (not read here: checked where a step takes it)."""
    def number(x: Any) -> float | None:
        if isinstance(x, bool):
            return None
        if isinstance(x, (int, float)) or is_numpy_real(x):
            try:
                return float(x)
            except OverflowError:  # (an int beyond the float range: refused where a step takes it)
                return None
        if isinstance(x, torch.Tensor) and x.numel() == 1 and not is_traced(x) and not x.is_complex() \
                and x.dtype != torch.bool and in_storage(x):
            return float(x.reshape(()).item())
        return None

    if isinstance(value, AdamHParams):
        return {name: number(x) for name, x in zip(AdamHParams._fields, value) if x is not None}
    return {"": number(value)}


FieldSchedule = Union[None, float, Schedule]


@dataclass(frozen=True)
class HParamsSchedule:
    """``step -> AdamHParams`` from one schedule, constant or ``None`` per field.

    ``base`` (a schedule returning :class:`AdamHParams`, e.g. :func:`one_cycle`)
    is evaluated first; the per-field entries that are not ``None`` override it.
    A keyword that is no field is refused as :func:`hparams_schedule` refuses it. Every value a step returns, from
    a field's schedule or from ``base``, is checked as the optimizer checks it (``check_hparam_value``).
    """

    lr: FieldSchedule = None
    beta1: FieldSchedule = None
    beta2: FieldSchedule = None
    eps: FieldSchedule = None
    weight_decay: FieldSchedule = None
    base: Schedule | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> HParamsSchedule:
        """Refuse a keyword that is no field (optax's ``learning_rate``, ...) with :func:`_refuse_unknown_fields`'s
        :class:`HParamError` before the generated ``__init__`` gives Python's bare TypeError."""
        unknown = {name: value for name, value in kwargs.items() if name not in cls.__dataclass_fields__}
        if unknown:
            _refuse_unknown_fields(unknown)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name in AdamHParams._fields:
            f = getattr(self, name)
            if f is not None and not callable(f):  # a constant: what the optimizer takes (else a schedule, None)
                check_hparam_value(name, f, "hparams_schedule")
                _set(self, **{name: as_number(f) if is_numpy_real(f) else f})  # (a tensor: the caller's, as given)
        if self.base is not None and not callable(self.base):
            raise HParamError(f"hparams_schedule: base = {self.base!r:.60} ({type(self.base).__name__}) is invalid; "
                              "expected a schedule step -> AdamHParams (e.g. one_cycle(...)) or None")

    def __call__(self, step: int) -> AdamHParams:
        step = _step(step)
        out = self.base(step) if self.base is not None else AdamHParams()
        if not isinstance(out, AdamHParams):
            raise HParamError(f"hparams_schedule: base returned {article(type(out).__name__)}, expected an AdamHParams")
        values = []
        for name, current in zip(AdamHParams._fields, out):
            f = getattr(self, name)
            value = current if f is None else f(step) if callable(f) else f
            if callable(f) and isinstance(value, AdamHParams):  # one_cycle(...) given as lr=
                raise HParamError(f"hparams_schedule at step {shown_step(step)}: the schedule given as {name} "
                                  f"({type(f).__name__}) returned an AdamHParams, the whole hparams; give it as "
                                  f"base=... (hparams_schedule(base=schedule)), or a schedule of {name} alone"
                                  + (f" ({name}=one_cycle(...).{name})" if name in ("lr", "beta1") else ""))
            if value is not None and (callable(f) or f is None and self.base is not None):
                # (base's too: a numpy float16 lr of it was read below as the Python number it holds, taken where the
                # optimizer refuses it, and a negative one went on to the step)
                check_hparam_value(name, value, "hparams_schedule", f" at step {shown_step(step)}"
                                   + ("" if callable(f) else " (from base)"))
            values.append(as_number(value) if is_numpy_real(value) else value)
        return AdamHParams(*values)


def constant(value: float) -> Constant:
    """``step -> value``."""
    return Constant(value)


def linear(init: float, end: float, steps: int) -> Linear:
    """Linear from ``init`` to ``end`` over ``steps`` steps, then ``end``."""
    return Linear(init, end, steps)


def linear_warmup(peak: float, warmup_steps: int, init: float = 0.0) -> Linear:
    """Linear warm-up from ``init`` to ``peak`` over ``warmup_steps``, then ``peak`` (:class:`Linear`)::

        init + (peak - init) * min(step, warmup_steps) / warmup_steps     (peak from step 0 if warmup_steps == 0)

    Its arguments are read and refused under their own names (:class:`Linear`'s are ``end`` and ``steps``).
    """
    peak, init = finite_number("peak", peak), finite_number("init", init)
    warmup_steps = integer("warmup_steps", warmup_steps, 0)
    _span("linear_warmup", "peak - init", init, peak)
    if warmup_steps:
        _stays_nonnegative("linear_warmup", "init", init, "peak", peak)
    return Linear(init, peak, warmup_steps)


def cosine_decay(init: float, decay_steps: int, alpha: float = 0.0) -> CosineDecay:
    """Cosine from ``init`` to ``alpha * init`` over ``decay_steps``, then held there (``CosineAnnealingLR``
    with ``eta_min = alpha*init`` up to ``decay_steps``; torch's rises again after it). ``alpha >= 0``, with
    ``alpha * init`` a finite float."""
    return CosineDecay(init, decay_steps, alpha)


def warmup_cosine(peak: float, warmup_steps: int, decay_steps: int, init: float = 0.0,
                  end: float = 0.0) -> WarmupCosine:
    """Linear warm-up to ``peak`` then cosine to ``end``; ``decay_steps`` counts the warm-up too: optax's
    ``warmup_cosine_decay_schedule(init, peak, warmup_steps, decay_steps, end)``, to rounding (where ``peak`` is 0,
    optax holds 0 after the warm-up whatever ``end``; this goes to ``end``).

    With ``W = warmup_steps``, ``N = decay_steps`` (:class:`WarmupCosine`)::

        step < W:  init + (peak - init) * (step / W)           (linear_warmup's value)
        else:      end + (peak - end) * (1 + cos(pi * min(step - W, N - W) / (N - W))) / 2
    """
    return WarmupCosine(peak, warmup_steps, decay_steps, init, end)


def step_decay(init: float, step_size: int, gamma: float = 0.1) -> StepDecay:
    """Multiply by ``gamma >= 0`` every ``step_size`` steps (``StepLR``): ``init * gamma ** (step // step_size)``
    (:class:`StepDecay`)."""
    return StepDecay(init, step_size, gamma)


def one_cycle(max_lr: float, total_steps: int, pct_start: float = 0.3, anneal: str = "cos",
              cycle_beta1: bool = True, base_beta1: float = 0.85, max_beta1: float = 0.95,
              div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False) -> OneCycle:
    """``OneCycleLR`` for lr and beta1 (same arguments, ``momentum`` -> ``beta1``)."""
    return OneCycle(max_lr, total_steps, pct_start, anneal, cycle_beta1, base_beta1, max_beta1, div_factor,
                    final_div_factor, three_phase)


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Join:
    """Concatenate schedules at ``boundaries`` (each restarts its own step count at 0; :class:`Join`)::

        schedules[k](step - s[k])   for s[k] <= step < s[k + 1],   with s = (0, *boundaries, inf)
    """
    return Join(schedules, boundaries)


def hparams_schedule(lr: FieldSchedule = None, beta1: FieldSchedule = None, beta2: FieldSchedule = None,
                     eps: FieldSchedule = None, weight_decay: FieldSchedule = None,
                     base: Schedule | None = None, **unknown: Any) -> HParamsSchedule:
    """``step -> AdamHParams`` with one schedule or constant per field (``None``: the optimizer's default).

    Another keyword (optax's ``learning_rate``, ``b1``, ``b2``; torch's ``betas``; a misspelt field) is refused
    naming the fields taken and the one meant (:func:`_refuse_unknown_fields`)."""
    if unknown:
        _refuse_unknown_fields(unknown)
    return HParamsSchedule(lr, beta1, beta2, eps, weight_decay, base)


# Other libraries' names of hparams_schedule's fields: what each means here, and whose name it is.
_OTHER_NAMES = {"learning_rate": ("lr", "optax's name"), "b1": ("beta1", "optax's name"),
                "b2": ("beta2", "optax's name"), "betas": ("beta1= and beta2", "torch's pair, a field each"),
                "momentum": ("beta1", "torch's name in OneCycleLR")}


def _refuse_unknown_fields(unknown: dict[str, Any]) -> None:
    """Refuse the keywords :func:`hparams_schedule` caught in ``**unknown`` (Python's bare TypeError named neither
    the fields taken nor the one meant): an :class:`HParamError` naming them all, with ``name= given, did you mean
    field=?`` for another library's name (:data:`_OTHER_NAMES`) or a close spelling (``difflib``)."""
    fields = [*AdamHParams._fields, "base"]
    hints = []
    for name in sorted(unknown):
        meant, why = _OTHER_NAMES.get(name, (None, ""))
        if meant is None:
            close = difflib.get_close_matches(name, fields, n=1)
            meant = close[0] if close else None
        if meant is not None:
            hints.append(f"{name}= given, did you mean {meant}=?{f' {why}' if why else ''}")
    names = ", ".join(map(repr, sorted(unknown)))
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise HParamError(f"hparams_schedule: unknown field{'s' if len(unknown) > 1 else ''} {names}; it takes the "
                      f"fields {', '.join(fields[:-1])} and {fields[-1]}{hint}")
