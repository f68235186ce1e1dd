"""Schedules in the real optimizer loop, side by side with ``torch.optim`` + ``torch.optim.lr_scheduler``.

The sofx side is :func:`sofx.serial.serial_loop_step` with a schedule (evaluated at the number of steps taken),
the torch side ``torch.optim.AdamW`` (or ``Adam``) with the equivalent scheduler stepped once per step, both in
float64 so that the comparison is about the schedule, not float32 rounding. A step skipped for overflow advances
neither the sofx schedule (SPECULATION.md: "the scheduler does not step") nor, on the torch side, the scheduler
(DeepSpeed's engine does not step its scheduler on overflow; with ``GradScaler`` this is the loop that calls
``scheduler.step()`` only where ``scaler.step`` stepped).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sofx
from sofx import AdamHParams, loss_scale, schedules, serial, speculate
from sofx import transforms as tx

LR = torch.optim.lr_scheduler
BASE_LR = 0.05
WD = 0.01
SHAPES = {"w": (4, 3), "b": (3,)}
loop_settings = settings(max_examples=25, deadline=None)


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(shape, generator=gen, dtype=torch.float64) for k, shape in SHAPES.items()}


def _grads(t: int, bad: bool = False) -> dict[str, torch.Tensor]:
    """Step ``t``'s gradients (an inf in ``w`` where ``bad``: an overflow)."""
    gen = torch.Generator().manual_seed(1000 + t)
    g = {k: torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + t % 3) for k, shape in SHAPES.items()}
    if bad:
        g["w"][1, 2] = math.inf
    return g


def _torch_loop(make_scheduler: Callable[[torch.optim.Optimizer], Any], steps: int, *, groups: bool = False,
                decoupled: bool = True, max_norm: float | None = None, overflow: frozenset[int] = frozenset(),
                before_step: Callable[[torch.optim.Optimizer, int], None] | None = None,
                empty: frozenset[int] = frozenset()) -> tuple[dict[str, torch.Tensor], list[float]]:
    """torch's loop: the params after ``steps`` iterations and the lr of ``w``'s group at each step taken (at a
    step of ``empty`` no parameter has a gradient: ``opt.step()`` steps none, the scheduler steps)."""
    named = {k: torch.nn.Parameter(v) for k, v in _params().items()}
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    if groups:  # "b" without weight decay, as no_decay_labels would have it
        opt = cls([{"params": [named["w"]]}, {"params": [named["b"]], "weight_decay": 0.0}], lr=BASE_LR,
                  weight_decay=WD, foreach=False)
    else:
        opt = cls(list(named.values()), lr=BASE_LR, weight_decay=WD, foreach=False)
    sched = make_scheduler(opt)
    lrs, taken = [], 0
    for t in range(steps):
        grads = _grads(t, t in overflow)
        for k, p in named.items():
            p.grad = None if t in empty else grads[k]
        if t in empty:
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            taken += 1
            continue
        if not all(bool(torch.isfinite(p.grad).all()) for p in named.values()):
            continue  # skipped: neither the optimizer nor the scheduler steps
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(named.values()), max_norm, foreach=False)
        if before_step is not None:
            before_step(opt, taken)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        taken += 1
    return {k: p.detach() for k, p in named.items()}, lrs


def _sofx_loop(schedule: Any, steps: int, *, decoupled: bool = True, max_norm: float | None = None,
               overflow: frozenset[int] = frozenset(), speculative: bool = False, empty: frozenset[int] = frozenset()
               ) -> tuple[dict[str, torch.Tensor], serial.LoopState]:
    """The serial loop (or its speculative twin, each leaf a block) over the same gradients (none at a step of
    ``empty``)."""
    opt = sofx.adamw() if decoupled else sofx.adam()
    scaler = loss_scale.static_scale()
    loop = serial.init_loop(opt, _params(), scaler)
    config = sofx.SpeculationConfig(max_norm=max_norm)
    for t in range(steps):
        grads = {k: None for k in SHAPES} if t in empty else _grads(t, t in overflow)
        if speculative:
            loop, report = speculate.speculative_loop_step(opt, loop, grads, config=config, scaler=scaler,
                                                           hparams=schedule)
            assert report.skipped == (t in overflow)
        else:
            loop, facts = serial.serial_loop_step(opt, loop, grads, scaler=scaler, hparams=schedule,
                                                  max_norm=max_norm)
            assert facts.skipped == (t in overflow)
    return loop.params, loop


def _assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


def _lr_only(lr: Callable[[int], float]) -> schedules.HParamsSchedule:
    return schedules.hparams_schedule(lr=lr, weight_decay=WD)


# (torch scheduler, the sofx schedule of the lr, the number of steps over which the two agree)
@st.composite
def _schedule_pairs(draw: st.DrawFn) -> tuple[str, Callable, Callable[[int], float], int]:
    kind = draw(st.sampled_from(["linear", "cosine", "step", "sequential", "lambda", "constant_then_step"]))
    if kind == "linear":
        start, end = draw(st.floats(0.05, 1.0)), draw(st.floats(0.05, 1.0))
        n = draw(st.integers(1, 12))
        return (kind, lambda o: LR.LinearLR(o, start_factor=start, end_factor=end, total_iters=n),
                schedules.linear(BASE_LR * start, BASE_LR * end, n), 30)
    if kind == "cosine":
        n, alpha = draw(st.integers(1, 20)), draw(st.floats(0.0, 0.5))
        return (kind, lambda o: LR.CosineAnnealingLR(o, T_max=n, eta_min=BASE_LR * alpha),
                schedules.cosine_decay(BASE_LR, n, alpha), n + 1)  # (torch's rises again after T_max)
    if kind == "step":
        every, gamma = draw(st.integers(1, 6)), draw(st.floats(0.1, 1.0))
        return kind, lambda o: LR.StepLR(o, every, gamma), schedules.step_decay(BASE_LR, every, gamma), 30
    if kind == "sequential":  # linear warm-up, then cosine: SequentialLR restarts the second at the milestone
        w, n, start = draw(st.integers(1, 8)), draw(st.integers(1, 15)), draw(st.floats(0.01, 1.0))
        return (kind, lambda o: LR.SequentialLR(o, [LR.LinearLR(o, start_factor=start, total_iters=w),
                                                    LR.CosineAnnealingLR(o, T_max=n)], milestones=[w]),
                schedules.join([schedules.linear(BASE_LR * start, BASE_LR, w), schedules.cosine_decay(BASE_LR, n)],
                               [w]), w + n + 1)
    if kind == "constant_then_step":
        k, factor, every = draw(st.integers(1, 6)), draw(st.floats(0.1, 1.0)), draw(st.integers(1, 5))
        return (kind, lambda o: LR.SequentialLR(o, [LR.ConstantLR(o, factor=factor, total_iters=k),
                                                    LR.StepLR(o, every, 0.5)], milestones=[k]),
                schedules.join([schedules.constant(BASE_LR * factor), schedules.step_decay(BASE_LR, every, 0.5)],
                               [k]), 30)
    w = draw(st.integers(1, 10))  # LambdaLR: any function of the step, times the base lr
    return (kind, lambda o: LR.LambdaLR(o, lambda t: min(1.0, (t + 1) / w) * 0.9 ** t),
            lambda t: BASE_LR * (min(1.0, (t + 1) / w) * 0.9 ** t), 30)


@loop_settings
@given(pair=_schedule_pairs(), steps=st.integers(1, 30), max_norm=st.sampled_from([None, 2.0]),
       speculative=st.booleans())
def test_lr_schedules_in_the_loop_equal_torch_schedulers(pair, steps: int, max_norm: float | None,
                                                         speculative: bool):
    """Every step's lr and the parameters after the loop are torch's (clipped or not; serial or speculative), at
    step 0, at every step of the schedule, at a SequentialLR milestone, and past the end where the two agree."""
    kind, make_scheduler, lr, agree = pair
    steps = min(steps, agree)
    want, lrs = _torch_loop(make_scheduler, steps, max_norm=max_norm)
    assert [lr(t) for t in range(steps)] == pytest.approx(lrs, rel=1e-12, abs=1e-18), kind
    got, loop = _sofx_loop(_lr_only(lr), steps, max_norm=max_norm, speculative=speculative)
    assert loop.step == steps
    _assert_params_close(got, want)



@loop_settings
@given(pair=_schedule_pairs(), steps=st.integers(2, 25), empty=st.frozensets(st.integers(0, 24), max_size=4),
       speculative=st.booleans())
def test_a_step_without_any_gradient_advances_the_schedule_as_torchs_scheduler(pair, steps: int,
                                                                               empty: frozenset[int],
                                                                               speculative: bool):
    """A step where no leaf has a gradient steps nothing but is taken: the schedule advances, as a torch loop's
    ``scheduler.step()`` after an ``optimizer.step()`` that found no gradient (serial_loop_step's docstring)."""
    kind, make_scheduler, lr, agree = pair
    steps = min(steps, agree)
    empty = frozenset(t for t in empty if t < steps)
    want, lrs = _torch_loop(make_scheduler, steps, empty=empty)
    got, loop = _sofx_loop(_lr_only(lr), steps, speculative=speculative, empty=empty)
    assert loop.step == steps == len(lrs)
    assert [lr(t) for t in range(loop.step)] == pytest.approx(lrs, rel=1e-12, abs=1e-18), kind
    _assert_params_close(got, want)


@loop_settings
@given(pair=_schedule_pairs(), steps=st.integers(2, 25), overflow=st.frozensets(st.integers(0, 24), max_size=4),
       speculative=st.booleans())
def test_a_step_skipped_for_overflow_does_not_advance_the_schedule(pair, steps: int, overflow: frozenset[int],
                                                                   speculative: bool):
    """An overflow step changes nothing, and the next step takes the lr the skipped one would have taken: the
    schedule counts steps taken (torch: a scheduler stepped only where the optimizer stepped)."""
    kind, make_scheduler, lr, agree = pair
    taken = min(steps, agree)
    steps = taken
    for t in sorted(overflow):  # each overflow within the loop adds an iteration
        steps += t < steps
    overflow = frozenset(t for t in overflow if t < steps)
    want, lrs = _torch_loop(make_scheduler, steps, overflow=overflow)
    got, loop = _sofx_loop(_lr_only(lr), steps, overflow=overflow, speculative=speculative)
    assert loop.step == taken == len(lrs)
    assert [lr(t) for t in range(loop.step)] == pytest.approx(lrs, rel=1e-12, abs=1e-18), kind
    _assert_params_close(got, want)


@loop_settings
@given(w=st.integers(1, 8), gamma=st.floats(0.5, 1.0), steps=st.integers(1, 20))
def test_per_group_schedules_equal_lambdalr_with_one_lambda_per_group(w: int, gamma: float, steps: int):
    """torch's LambdaLR with one lambda per param group (and a group without weight decay) is a schedule that
    returns a per-group hparams tree built by group_hparams."""
    f_w = lambda t: min(1.0, (t + 1) / w)  # noqa: E731
    f_b = lambda t: gamma ** t  # noqa: E731
    want, _ = _torch_loop(lambda o: LR.LambdaLR(o, [f_w, f_b]), steps, groups=True)
    labels = {"w": "decay", "b": "no_decay"}

    def schedule(t: int) -> Any:
        return tx.group_hparams(labels, {"decay": AdamHParams(lr=BASE_LR * f_w(t)),
                                         "no_decay": AdamHParams(lr=BASE_LR * f_b(t), weight_decay=0.0)},
                                base=AdamHParams(weight_decay=WD))

    got, _ = _sofx_loop(schedule, steps)
    _assert_params_close(got, want)


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("three_phase", [False, True])
def test_one_cycle_lr_and_beta1_in_the_loop_equal_onecyclelr(decoupled: bool, three_phase: bool):
    """OneCycleLR moves betas[0] too: torch's Adam takes its bias correction from the current beta1, as sofx."""
    total = 24
    want, _ = _torch_loop(lambda o: LR.OneCycleLR(o, max_lr=0.3, total_steps=total, pct_start=0.25,
                                                  three_phase=three_phase), total, decoupled=decoupled)
    sched = schedules.hparams_schedule(weight_decay=WD, base=schedules.one_cycle(0.3, total, pct_start=0.25,
                                                                                 three_phase=three_phase))
    got, _ = _sofx_loop(sched, total, decoupled=decoupled)
    _assert_params_close(got, want)


@loop_settings
@given(steps=st.integers(1, 20), b2_end=st.floats(0.9, 0.9999), wd_gamma=st.floats(0.0, 1.0),
       eps=st.sampled_from([1e-8, 1e-3]))
def test_schedules_of_beta2_eps_and_weight_decay_equal_torch_groups_changed_every_step(
        steps: int, b2_end: float, wd_gamma: float, eps: float):
    """Schedules of hparams other than lr: torch reads betas, eps and weight_decay from the param groups at
    every step, so a loop that sets them before each step is the reference."""
    b2 = schedules.linear(0.999, b2_end, 10)
    wd = schedules.step_decay(0.1, 3, wd_gamma)
    eps_s = schedules.join([schedules.constant(eps), schedules.constant(1e-8)], [5])

    def set_groups(opt: torch.optim.Optimizer, t: int) -> None:
        for g in opt.param_groups:
            g["betas"], g["weight_decay"], g["eps"] = (0.9, b2(t)), wd(t), eps_s(t)

    want, _ = _torch_loop(lambda o: LR.LambdaLR(o, lambda t: 1.0), steps, before_step=set_groups)
    got, _ = _sofx_loop(schedules.hparams_schedule(lr=BASE_LR, beta2=b2, eps=eps_s, weight_decay=wd), steps)
    _assert_params_close(got, want)


# ----------------------------------------------------------------------------------- gradient accumulation
def _model_and_batch(gen: torch.Generator, n: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    x = torch.randn(n, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    return model, x, y


def _grads_of(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [k for k, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 6), per=st.integers(1, 5), scale=st.sampled_from([1.0, 2.0 ** 10, 2.0 ** -3]),
       max_norm=st.sampled_from([None, 0.05, 100.0]), seed=st.integers(0, 2 ** 16))
def test_accumulating_k_micro_steps_equals_one_big_batch_unscaled_and_clipped(k, per, scale, max_norm, seed):
    """k micro-batches of a mean loss divided by k (each scaled by S), summed by accumulate, then unscaled and
    clipped, are the big batch's gradients clipped by clip_grad_norm_ (the torch recipe for accumulation)."""
    gen = torch.Generator().manual_seed(seed)
    model, x, y = _model_and_batch(gen, k * per)
    params = {n: p.detach() for n, p in model.named_parameters()}
    loss = lambda xb, yb: torch.nn.functional.mse_loss(model(xb), yb)  # noqa: E731
    big = _grads_of(model, loss(x, y))
    if max_norm is not None:
        holders = [torch.nn.Parameter(torch.empty_like(g)) for g in big.values()]
        for h, g in zip(holders, big.values()):
            h.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(holders, max_norm, foreach=False)
        big = {n: h.grad for n, h in zip(big, holders)}
    acc = tx.accumulation_init(params)
    for i in range(k):
        sl = slice(i * per, (i + 1) * per)
        acc = tx.accumulate(acc, _grads_of(model, loss(x[sl], y[sl]) / k * scale), params)
    assert acc.micro_steps == k
    chain = tx.chain(tx.unscale(), tx.check_finite(),
                     tx.identity() if max_norm is None else tx.clip_by_global_norm(max_norm))
    out, (_, finite, _) = chain.update(tx.accumulated(acc, params), chain.init(params), loss_scale=scale)
    assert finite.all_finite
    for n in big:
        torch.testing.assert_close(out[n], big[n], rtol=1e-12, atol=1e-15, msg=n)


def test_an_overflow_in_one_micro_step_skips_the_accumulated_step_and_holds_the_schedule():
    """One non-finite micro-step makes the sum non-finite: check_finite says so, the serial step skips it (no
    parameter, moment or count changes) and the schedule position stays, as with GradScaler's skipped step."""
    params = _params()
    acc = tx.accumulation_init(params)
    for i, bad in enumerate((False, True, False)):
        acc = tx.accumulate(acc, _grads(i, bad), params)
    grads = tx.accumulated(acc, params)
    _, (finite,) = tx.chain(tx.check_finite()).update(grads, (tx.FiniteState(),))
    assert not finite.all_finite and finite.nonfinite_steps == 1
    opt, scaler = sofx.adamw(), loss_scale.grad_scaler(init_scale=2.0 ** 8)
    loop = serial.init_loop(opt, params, scaler)
    seen = []
    new, facts = serial.serial_loop_step(opt, loop, grads, scaler=scaler, max_norm=1.0,
                                         hparams=lambda t: seen.append(t) or AdamHParams(lr=0.1 / (t + 1)))
    assert facts.skipped and new.step == 0 and new.params is loop.params and new.opt_state is loop.opt_state
    assert scaler.scale(new.scaler_state) == 2.0 ** 7  # backed off
    new, facts = serial.serial_loop_step(opt, new, _grads(5), scaler=scaler, max_norm=1.0,
                                         hparams=lambda t: seen.append(t) or AdamHParams(lr=0.1 / (t + 1)))
    assert not facts.skipped and new.step == 1 and seen == [0, 0]
