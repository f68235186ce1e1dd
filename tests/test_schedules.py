"""Schedules against torch.optim.lr_scheduler and against their formulas."""

from __future__ import annotations

import dataclasses
import math
import pickle
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sofx
from sofx import AdamHParams, schedules
from sofx.errors import HParamError


def _torch_lrs(make_scheduler, steps: int, lr: float = 0.1, last: bool = False, **opt_kwargs):
    """lr (and beta1) that torch uses for steps 0..steps-1 (``last``: the final value is the one the scheduler set
    after the last step, where stepping it once more would raise)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=lr, **opt_kwargs)
    sched = make_scheduler(opt)
    out = []
    for t in range(steps):
        g = opt.param_groups[0]
        out.append((g["lr"], g["betas"][0]))
        opt.step()
        if not (last and t == steps - 1):
            sched.step()
    return out


def test_step_decay_equals_steplr():
    ours = schedules.step_decay(0.1, step_size=7, gamma=0.5)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.StepLR(o, 7, gamma=0.5), 40)
    for t, (lr, _) in enumerate(ref):
        assert ours(t) == pytest.approx(lr, rel=1e-12)


def test_cosine_decay_equals_cosine_annealing():
    ours = schedules.cosine_decay(0.1, decay_steps=30, alpha=0.01)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30, eta_min=0.001), 31)
    for t, (lr, _) in enumerate(ref):
        assert ours(t) == pytest.approx(lr, rel=1e-9, abs=1e-15)
    assert ours(1000) == pytest.approx(0.001)


def test_linear_equals_linearlr():
    ours = schedules.linear(0.1 * 0.25, 0.1, steps=10)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=10), 20)
    for t, (lr, _) in enumerate(ref):
        assert ours(t) == pytest.approx(lr, rel=1e-9)


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("anneal", ["cos", "linear"])
def test_one_cycle_equals_onecyclelr(three_phase: bool, anneal: str):
    total = 50
    ours = schedules.one_cycle(0.3, total, pct_start=0.25, anneal=anneal, three_phase=three_phase)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.3, total_steps=total, pct_start=0.25, anneal_strategy=anneal, three_phase=three_phase), total)
    for t, (lr, b1) in enumerate(ref):
        hp = ours(t)
        assert hp.lr == pytest.approx(lr, rel=1e-9), t
        assert hp.beta1 == pytest.approx(b1, rel=1e-9), t
        assert ours.lr(t) == hp.lr and ours.beta1(t) == hp.beta1
    with pytest.raises(HParamError, match="past total_steps"):
        ours(total + 1)


@pytest.mark.parametrize("total, pct_start, three_phase", [
    (10, 0.1, False), (4, 0.25, False), (2, 0.5, False), (10, 0.1, True), (3, 2 / 3, True)])
def test_one_cycle_with_a_phase_of_no_steps_is_refused_at_construction(total, pct_start, three_phase):
    """Where a phase that a step reaches has no steps (pct_start * total_steps = 1, or, in three phases,
    2 * pct_start * total_steps = total_steps + 1) torch's OneCycleLR divides by zero at that step; sofx
    refuses the schedule when it is made."""
    with pytest.raises(HParamError, match="no steps"):
        schedules.one_cycle(0.3, total, pct_start=pct_start, three_phase=three_phase)
    with pytest.raises(ZeroDivisionError):
        _torch_lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.3, total_steps=total, pct_start=pct_start, three_phase=three_phase), total + 1)


@pytest.mark.parametrize("total, pct_start, three_phase", [(10, 0.05, False), (10, 0.05, True), (3, 0.5, True)])
def test_one_cycle_with_a_phase_before_step_0_equals_onecyclelr(total, pct_start, three_phase):
    """A first phase that ends before step 0 (pct_start * total_steps < 1) is not refused: no step reaches it."""
    ours = schedules.one_cycle(0.3, total, pct_start=pct_start, three_phase=three_phase)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.3, total_steps=total, pct_start=pct_start, three_phase=three_phase), total)
    for t, (lr, b1) in enumerate(ref):
        assert ours(t).lr == pytest.approx(lr, rel=1e-9) and ours(t).beta1 == pytest.approx(b1, rel=1e-9), t


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("anneal", ["cos", "linear"])
def test_one_cycle_is_onecyclelr_bit_for_bit_through_step_total_steps(three_phase: bool, anneal: str):
    """OneCycleLR computes each value from the step (no recursion), with the same operations: lr and beta1 are
    torch's bit for bit at every step, including step total_steps (the value torch's scheduler sets after the
    last step of the cycle: the last phase's anneal carried past its end, a negative lr under "linear")."""
    total = 23
    ours = schedules.one_cycle(0.3, total, pct_start=0.3, anneal=anneal, three_phase=three_phase,
                               base_beta1=0.8, max_beta1=0.97, div_factor=7.0, final_div_factor=300.0)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.3, total_steps=total, pct_start=0.3, anneal_strategy=anneal, three_phase=three_phase,
        base_momentum=0.8, max_momentum=0.97, div_factor=7.0, final_div_factor=300.0), total + 1, last=True)
    assert len(ref) == total + 1
    assert [(ours(t).lr, ours(t).beta1) for t in range(total + 1)] == ref
    assert (ours(total).lr < 0) == (anneal == "linear")


def test_step_decay_is_steplrs_closed_form_bit_for_bit():
    """StepLR's closed form (what ``scheduler.step(epoch)`` sets) is ``base_lr * gamma ** (epoch // step_size)``:
    step_decay's value, bit for bit."""
    ours = schedules.step_decay(0.1, 7, 0.3)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.3)
    for t in range(200):
        opt.step()
        with pytest.warns(UserWarning, match="epoch"):
            sched.step(t)
        assert ours(t) == opt.param_groups[0]["lr"], t


@pytest.mark.parametrize("make, make_ref", [
    (lambda n: schedules.cosine_decay(0.1, n), lambda o, n: torch.optim.lr_scheduler.CosineAnnealingLR(o, n)),
    (lambda n: schedules.cosine_decay(0.1, n, 1e-3),
     lambda o, n: torch.optim.lr_scheduler.CosineAnnealingLR(o, n, eta_min=1e-4)),
    (lambda n: schedules.linear(0.1 * 0.01, 0.1, n),
     lambda o, n: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.01, total_iters=n)),
    (lambda n: schedules.linear(0.1, 0.0, n),
     lambda o, n: torch.optim.lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.0, total_iters=n)),
    (lambda n: schedules.step_decay(0.1, 3, 0.99), lambda o, n: torch.optim.lr_scheduler.StepLR(o, 3, 0.99))],
    ids=["cosine", "cosine eta_min", "linear warm-up", "linear decay", "step"])
def test_closed_form_schedules_stay_within_rounding_of_torchs_chainable_schedulers_over_long_runs(make, make_ref):
    """torch's CosineAnnealingLR, LinearLR and StepLR set each lr from the previous one (``scheduler.step()``),
    so theirs drift from the closed form by an ulp or so per step; sofx's are the closed form. The two agree to a
    relative 1e-12 over 10^4 steps (far below float32 rounding), not bit for bit: the module's docstring said 1e-13,
    where LinearLR's decay to 0 and CosineAnnealingLR reach 4e-13 near their ends."""
    n = 10 ** 4
    ours = make(n)
    ref = _torch_lrs(lambda o: make_ref(o, n), n + 1)
    got = [ours(t) for t in range(n + 1)]
    assert got == pytest.approx([lr for lr, _ in ref], rel=1e-12, abs=1e-18)


def test_one_cycle_without_beta1_cycling_leaves_beta1_default():
    assert schedules.one_cycle(1.0, 10, cycle_beta1=False)(3).beta1 is None


def test_one_cycle_without_beta1_cycling_gives_no_beta1_field_alone_either():
    """``lr`` and ``beta1`` give one field of ``__call__``'s hparams: with cycle_beta1=False that beta1 is None (the
    optimizer's own, as OneCycleLR(cycle_momentum=False) leaves the betas as they are), but ``beta1`` returned a
    cycling value, so hparams_schedule(lr=s.lr, beta1=s.beta1) cycled beta1 after all."""
    total = 12
    s = schedules.one_cycle(0.3, total, cycle_beta1=False)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.3, total_steps=total,
                                                                   cycle_momentum=False), total + 1, last=True,
                     betas=(0.87, 0.999))
    assert [b1 for _, b1 in ref] == [0.87] * (total + 1)
    by_field = schedules.hparams_schedule(lr=s.lr, beta1=s.beta1)
    for t, (lr, _) in enumerate(ref):
        assert s.beta1(t) is None and s(t).beta1 is None and by_field(t) == s(t), t
        assert s.lr(t) == s(t).lr == lr, t
    with pytest.raises(HParamError, match="past total_steps"):
        s.beta1(total + 1)


def test_linear_warmup_and_constant():
    s = schedules.linear_warmup(1.0, warmup_steps=4, init=0.2)
    assert [s(t) for t in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert schedules.constant(3e-4)(123) == 3e-4
    none = schedules.linear_warmup(1.0, warmup_steps=0, init=0.2)  # no warm-up: the peak from the first step
    assert [none(t) for t in range(3)] == [1.0, 1.0, 1.0]
    with pytest.raises(HParamError, match="steps = -1"):
        schedules.linear_warmup(1.0, warmup_steps=-1)


@given(peak=st.floats(1e-5, 1.0), warmup=st.integers(0, 20), extra=st.integers(1, 50), end=st.floats(0, 1e-5),
       t=st.integers(0, 100))
def test_warmup_cosine_formula(peak: float, warmup: int, extra: int, end: float, t: int):
    steps = warmup + extra
    s = schedules.warmup_cosine(peak, warmup, steps, init=0.0, end=end)
    v = s(t)
    if t < warmup:
        assert v == pytest.approx(peak * t / warmup)
    else:
        frac = min(t - warmup, extra) / extra
        assert v == pytest.approx(end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac)))
    assert min(end, 0.0) - 1e-12 <= v <= peak + 1e-12
    assert s(warmup) == pytest.approx(peak)
    assert s(steps + 5) == pytest.approx(end)


@given(b=st.lists(st.integers(1, 10), min_size=1, max_size=4), t=st.integers(0, 60))
def test_join_restarts_each_schedule(b: list[int], t: int):
    boundaries = [sum(b[:i + 1]) for i in range(len(b))]
    parts = [schedules.linear(float(k), float(k) + 1.0, 100) for k in range(len(b) + 1)]
    s = schedules.join(parts, boundaries)
    starts = [0] + boundaries
    k = sum(1 for x in boundaries if t >= x)
    assert s(t) == parts[k](t - starts[k])


def test_hparams_schedule_combines_fields_and_base():
    s = schedules.hparams_schedule(lr=schedules.linear_warmup(1.0, 2), weight_decay=0.1,
                                   base=schedules.one_cycle(5.0, 10))
    hp = s(1)
    assert isinstance(hp, AdamHParams)
    assert hp.lr == 0.5 and hp.weight_decay == 0.1
    assert hp.beta1 == schedules.one_cycle(5.0, 10).beta1(1)
    assert hp.beta2 is None and hp.eps is None


def test_schedules_pickle_and_reject_bad_input():
    s = schedules.warmup_cosine(1.0, 3, 10)
    assert pickle.loads(pickle.dumps(s)) == s
    assert s(torch.tensor(4)) == s(4)
    with pytest.raises(HParamError, match="step"):
        s(-1)
    with pytest.raises(HParamError, match="decay_steps"):
        schedules.warmup_cosine(1.0, 10, 10)
    with pytest.raises(HParamError, match="boundaries"):
        schedules.join([schedules.constant(1.0)], [3])
    with pytest.raises(HParamError, match="value"):
        schedules.constant(float("nan"))
    with pytest.raises(HParamError, match="pct_start = 1 leaves the two-phase cycle no annealing phase"):
        schedules.one_cycle(0.1, 10, pct_start=1.0)  # (a ZeroDivisionError at the last step; torch's at once)
    assert schedules.one_cycle(0.1, 10, pct_start=1.0, three_phase=True).lr(10) > 0


def test_one_cycle_flags_are_python_or_numpy_bools():
    """one_cycle(three_phase="no") was taken as three phases and cycle_beta1="no" as cycling: a numpy bool is
    stored as a Python bool, anything else is refused naming the argument."""
    np = pytest.importorskip("numpy")
    got = schedules.one_cycle(0.1, 10, cycle_beta1=np.bool_(False), three_phase=np.bool_(True))
    assert got == schedules.one_cycle(0.1, 10, cycle_beta1=False, three_phase=True)
    assert (type(got.cycle_beta1), type(got.three_phase)) == (bool, bool)
    for name in ("cycle_beta1", "three_phase"):
        for bad, kind in (("no", "str"), (1, "int")):
            with pytest.raises(HParamError, match=rf"{name} = .* is invalid; expected a bool .*got {kind}"):
                schedules.one_cycle(0.1, 10, **{name: bad})


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(div_factor=0.0), r"div_factor = 0.0 is invalid; expected a number > 0"),
    (dict(div_factor=-25.0), r"div_factor = -25.0"),
    (dict(final_div_factor=0.0), r"final_div_factor = 0.0"),
    (dict(max_lr=-0.1), r"max_lr = -0.1 is invalid"),
])
def test_one_cycle_factors_that_divide_by_zero_or_flip_the_lr_are_refused_at_construction(kwargs, pattern):
    """(They raised ZeroDivisionError at every step, or gave a negative lr that update refused later.)"""
    args = dict(max_lr=0.1, total_steps=10) | kwargs
    with pytest.raises(HParamError, match=pattern):
        schedules.one_cycle(**args)


@pytest.mark.parametrize("gamma", [-0.5, -1.0, -2.0])
def test_step_decay_with_a_negative_gamma_is_refused_at_construction_naming_it(gamma: float):
    """A negative gamma flips the value's sign every step_size steps (torch's StepLR sets a negative lr there): it
    was taken, and the optimizer refused the negative lr mid-run, step_size steps in. A gamma of 0 (the value
    drops to 0 after step_size steps) is StepLR's closed form as any other."""
    with pytest.raises(HParamError, match=rf"step_decay: gamma = {gamma!r} is invalid; expected gamma >= 0"):
        schedules.step_decay(0.1, 3, gamma=gamma)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=gamma), 7)
    assert [lr < 0 for lr, _ in ref] == [False] * 3 + [True] * 3 + [False]
    sched = schedules.step_decay(0.1, 3, gamma=0.0)
    assert [sched(t) for t in range(7)] == [0.1] * 3 + [0.0] * 4
    assert [sched(t) for t in range(7)] == [lr for lr, _ in _torch_lrs(lambda o: torch.optim.lr_scheduler.StepLR(
        o, 3, gamma=0.0), 7)]


def test_step_decay_refuses_the_step_where_its_value_leaves_the_float_range():
    """gamma = 1e308: Python's ** raised a raw OverflowError at step 3 (init * gamma ** k overflowing silently to inf
    for a large init); torch's StepLR gives an inf lr there. The steps before stay as they were."""
    sched = schedules.step_decay(1.0, 1, gamma=1e308)
    assert sched(1) == 1e308
    with pytest.raises(HParamError, match=r"step_decay .* = 1.0 \* 1e\+308 \*\* 3\): the value at step 3 is inf"):
        sched(3)
    with pytest.raises(HParamError, match=r"step_decay .*: the value at step 1 is inf"):
        schedules.step_decay(1e300, 1, gamma=1e10)(1)


@pytest.mark.parametrize("make, pattern", [
    (lambda np: schedules.linear(-1e308, 1e308, 10), r"linear: end - init = 1e\+308 - -1e\+308 is beyond the float"),
    (lambda np: schedules.linear_warmup(1e308, 10, init=-1e308), r"linear_warmup: peak - init = 1e\+308 - -1e"),
    (lambda np: schedules.warmup_cosine(1e308, 2, 10, init=-1e308), r"warmup_cosine: peak - init"),
    (lambda np: schedules.warmup_cosine(1e308, 2, 10, end=-1e308), r"warmup_cosine: peak - end")])
def test_interpolations_beyond_the_float_range_are_refused_at_construction(make, pattern):
    """linear(-1e308, 1e308, 10) gave nan at step 0 (inf * 0) and inf after it."""
    np = pytest.importorskip("numpy")
    with pytest.raises(HParamError, match=pattern):
        make(np)


@pytest.mark.parametrize("make, pattern", [
    (lambda: schedules.linear(-2 ** 1023, 2 ** 1023, 10), r"linear: end - init = 8988\d+ - -8988\d+ is beyond"),
    (lambda: schedules.linear_warmup(2 ** 1023, 10, init=-2 ** 1023), r"linear_warmup: peak - init"),
    (lambda: schedules.warmup_cosine(2 ** 1023, 2, 10, init=-2 ** 1023), r"warmup_cosine: peak - init"),
    (lambda: schedules.warmup_cosine(2 ** 1023, 2, 10, end=-2 ** 1023), r"warmup_cosine: peak - end")])
def test_interpolations_of_integer_arguments_beyond_the_float_range_are_refused_at_construction(make, pattern):
    """Integers within the float range whose difference is not (2**1023 - -2**1023 = 2**1024, an exact int): the
    check of the span raised a raw OverflowError converting it to a float."""
    with pytest.raises(HParamError, match=pattern):
        make()
    assert schedules.linear(-2 ** 1022, 2 ** 1022, 4)(1) == float(-2 ** 1022) + float(2 ** 1023) * 0.25


@pytest.mark.parametrize("make, pattern", [
    (lambda: schedules.cosine_decay(1e200, 10, alpha=1e200),
     r"^cosine_decay: alpha \* init = 1e\+200 \* 1e\+200 is beyond the float range"),
    (lambda: schedules.one_cycle(1e10, 10, div_factor=1e-300),
     r"^div_factor = 1e-300 is invalid with max_lr = 10000000000.0: the lr max_lr / div_factor is inf"),
    (lambda: schedules.one_cycle(1.0, 10, final_div_factor=1e-310),
     r"^final_div_factor = 1e-310 is invalid with max_lr = 1.0: the lr max_lr / \(div_factor \* final_div_factor\) "
     r"is inf")])
def test_schedule_values_certain_to_leave_the_float_range_are_refused_at_construction(make, pattern):
    """An inf learning rate was returned silently; then it was refused at the step that reached it (the last of a
    cosine decay, of a one-cycle), though the arguments made it certain: refused at construction, naming them."""
    with pytest.raises(HParamError, match=pattern):
        make()


@pytest.mark.parametrize("make, pattern", [
    (lambda: schedules.cosine_decay(0.1, 10, alpha=-0.1),
     r"^cosine_decay: alpha = -0.1 is invalid; expected alpha >= 0"),
    (lambda: schedules.linear(0.1, -0.1, 10), r"^linear: end = -0.1 is invalid with init = 0.1: the value starts >= 0 "
                                              r"and goes below 0 mid-run"),
    (lambda: schedules.linear_warmup(-0.1, 10), r"^linear_warmup: peak = -0.1 is invalid with init = 0.0"),
    (lambda: schedules.warmup_cosine(0.1, 2, 10, end=-0.01), r"^warmup_cosine: end = -0.01 is invalid with init = 0.0"),
    (lambda: schedules.warmup_cosine(0.1, 0, 10, end=-0.01), r"^warmup_cosine: end = -0.01 is invalid with peak = 0.1"),
    (lambda: schedules.warmup_cosine(-0.1, 2, 10), r"^warmup_cosine: peak = -0.1 is invalid with init = 0.0")])
def test_schedules_that_go_below_zero_mid_run_are_refused_at_construction_naming_the_argument(make, pattern):
    """cosine_decay(0.1, 10, alpha=-0.1) went from 0.1 to -0.01: the first steps were taken and the optimizer refused
    the negative lr mid-run, where it got there (no hparam takes a negative value). As torch refuses a bad lr at
    construction (and as step_decay refuses a negative gamma), such arguments are refused at once. A schedule
    negative from its first step (refused at that step) and one that stays >= 0 are taken as before."""
    with pytest.raises(HParamError, match=pattern):
        make()
    assert schedules.linear(-1.0, 1.0, 4)(0) == -1.0 and schedules.linear(0.1, -0.1, 0)(0) == -0.1
    assert schedules.cosine_decay(0.1, 10, alpha=0.0)(10) == 0.0
    assert schedules.warmup_cosine(0.1, 2, 10, init=0.0, end=0.0)(10) == 0.0


@pytest.mark.parametrize("kwargs, pattern", [
    ({"lr": "x"}, r"lr must be a float or a 0-d tensor, got str"),
    ({"beta1": True}, r"beta1 must be a float or a 0-d tensor, got bool"),
    ({"eps": [1e-8]}, r"eps must be a float or a 0-d tensor, got list"),
    ({"weight_decay": torch.ones(2)}, r"weight_decay must be a float or a 0-d tensor, got shape \(2,\)"),
    ({"weight_decay": torch.ones(1)}, r"weight_decay must be a float or a 0-d tensor, got shape \(1,\)"),
    ({"lr": math.nan}, r"lr = nan is invalid; expected lr >= 0"),
    ({"lr": 2 ** 1100}, r"lr = \d+ is invalid; expected lr >= 0"),
    ({"beta2": 1.0}, r"beta2 = 1.0 is invalid; expected 0 <= beta2 < 1"),
    ({"base": 3.0}, r"base = 3.0 \(float\) is invalid; expected a schedule step -> AdamHParams")])
def test_hparams_schedule_refuses_fields_that_are_neither_numbers_nor_schedules(kwargs, pattern):
    """hparams_schedule(lr="x") was taken and handed "x" to the optimizer as the lr; base=3.0 raised a TypeError
    at the first call. A constant is checked as the optimizer checks it (sofx.adam.check_hparam_value): a
    1-element tensor of shape (1,) is not a 0-d one, and an int beyond the float range is no OverflowError."""
    with pytest.raises(HParamError, match=r"hparams_schedule: " + pattern):
        schedules.hparams_schedule(**kwargs)


@pytest.mark.parametrize("kwargs, hint", [
    ({"learning_rate": 1e-3}, r" \(learning_rate= given, did you mean lr=\? optax's name\)$"),
    ({"b1": 0.9}, r" \(b1= given, did you mean beta1=\? optax's name\)$"),
    ({"b2": 0.99}, r" \(b2= given, did you mean beta2=\? optax's name\)$"),
    ({"betas": (0.9, 0.99)}, r" \(betas= given, did you mean beta1= and beta2=\? torch's pair, a field each\)$"),
    ({"weight_dacay": 0.1}, r" \(weight_dacay= given, did you mean weight_decay=\?\)$"),
    ({"lr": 1e-3, "momentum": 0.9}, r" \(momentum= given, did you mean beta1=\? torch's name in OneCycleLR\)$"),
    ({"foo": 1}, r"$")])
@pytest.mark.parametrize("make", [schedules.hparams_schedule, schedules.HParamsSchedule],
                         ids=["hparams_schedule", "HParamsSchedule"])
def test_hparams_schedule_and_its_class_refuse_an_unknown_field_naming_those_they_take(kwargs, hint, make):
    """hparams_schedule(learning_rate=...) (optax's name), b1=/b2=, torch's betas= or a misspelt field raised
    Python's bare "unexpected keyword argument" TypeError: it is an HParamError naming the fields it takes and the
    one meant; the same from the public dataclass HParamsSchedule, called directly."""
    unknown = next(k for k in kwargs if k != "lr")
    with pytest.raises(HParamError, match=rf"^hparams_schedule: unknown field '{unknown}'; it takes the fields lr, "
                                          r"beta1, beta2, eps, weight_decay and base" + hint):
        make(**kwargs)
    with pytest.raises(HParamError, match=r"unknown fields 'b1', 'learning_rate'; .* \(b1= given, did you mean "
                                          r"beta1=\? optax's name; learning_rate= given, did you mean lr=\? optax's"):
        make(learning_rate=1e-3, b1=0.9)
    with pytest.raises(TypeError):  # (a positional argument too many is Python's, as for every function)
        make(1e-3, 0.9, 0.99, 1e-8, 0.0, None, 1)
    made = make(lr=1e-3, beta1=0.9)  # the fields it takes, as before; still a picklable, comparable dataclass
    assert pickle.loads(pickle.dumps(made)) == made == schedules.HParamsSchedule(1e-3, 0.9)
    assert dataclasses.replace(made, eps=1e-6)(0).eps == 1e-6


def test_hparams_schedule_refuses_a_field_schedule_returning_a_non_number():
    sched = schedules.hparams_schedule(lr=lambda step: "x")
    with pytest.raises(HParamError, match=r"hparams_schedule at step 2: lr must be a float or a 0-d tensor, got str"):
        sched(2)
    # what the optimizer takes, the schedule takes: 0-d tensors of any real dtype, ints, floats
    ok = schedules.hparams_schedule(lr=torch.tensor(0.1), beta1=0.9, eps=lambda step: None,
                                    weight_decay=lambda step: torch.tensor(0))(2)
    assert ok.beta1 == 0.9 and ok.eps is None and float(ok.lr) == pytest.approx(0.1) and int(ok.weight_decay) == 0
    assert schedules.hparams_schedule(weight_decay=torch.tensor(0))(0).weight_decay == 0
    sofx.adamw().check_inputs({"w": torch.zeros(2)}, {"w": torch.zeros(2)}, sofx.adamw().init({"w": torch.zeros(2)}),
                              ok)


def test_hparams_schedule_reads_numpy_numbers_as_python_numbers():
    """hparams_schedule(lr=lambda t: np.float32(...)) was refused at its first step ("lr must be a float or a 0-d
    tensor, got float32"), and so was a numpy float32 constant, while the schedules' constructors take numpy
    numbers (and torch.optim does); a numpy float64 was handed on as given. The constants and what a field schedule
    returns are read as the Python numbers they hold (an integer stays an int): the hparams of a step hold no numpy
    number. A numpy bool is no number."""
    np = pytest.importorskip("numpy")
    sched = schedules.hparams_schedule(lr=lambda step: np.float32(1e-3) * step, beta1=np.float64(0.85),
                                       beta2=lambda step: np.float64(0.98), eps=np.float32(1e-6),
                                       weight_decay=lambda step: np.int64(step))
    got = sched(3)
    assert got == AdamHParams(float(np.float32(1e-3) * 3), 0.85, 0.98, float(np.float32(1e-6)), 3)
    assert [type(x) for x in got] == [float, float, float, float, int]
    assert [type(x) for x in sofx.serial.hparams_at(sched, 2)] == [float, float, float, float, int]
    with pytest.raises(HParamError, match=r"hparams_schedule: beta1 must be a float or a 0-d tensor, got bool"):
        schedules.hparams_schedule(beta1=np.bool_(False))
    with pytest.raises(HParamError, match=r"hparams_schedule at step 1: lr = -1\.0 is invalid; expected lr >= 0"):
        schedules.hparams_schedule(lr=lambda step: np.float32(-1.0))(1)


@pytest.mark.parametrize("make", [
    lambda n, c: schedules.constant(n(1e-3)),
    lambda n, c: schedules.linear(n(0.1), n(0.2), c(5)),
    lambda n, c: schedules.cosine_decay(n(0.1), c(5), n(0.1)),
    lambda n, c: schedules.warmup_cosine(n(0.1), c(2), c(6), n(0.01), n(0.001)),
    lambda n, c: schedules.step_decay(n(0.1), c(2), n(0.5)),
    lambda n, c: schedules.one_cycle(n(0.1), c(9), n(0.25), base_beta1=n(0.85), max_beta1=n(0.95),
                                     div_factor=n(25.0), final_div_factor=n(1e4)),
    lambda n, c: schedules.join([schedules.constant(0.1), schedules.constant(0.2)], [c(3)])],
    ids=["constant", "linear", "cosine_decay", "warmup_cosine", "step_decay", "one_cycle", "join"])
def test_schedule_arguments_given_as_numpy_or_tensors_are_read_as_python_numbers(make):
    """constant(np.float32(1e-3)) was refused ("expected a finite number"), and so were numpy step counts; a
    numpy float64 was kept as given, and the values were numpy numbers. Every argument is read once as a Python
    number (a count stays an int) and the schedule is the one of the Python numbers."""
    np = pytest.importorskip("numpy")
    for n, c in ((np.float32, np.int64), (np.float64, np.int32), (torch.tensor, torch.tensor),
                 (lambda x: torch.tensor([x]), lambda x: torch.tensor([x]))):
        sched, want = make(n, c), make(lambda x: n(x).item(), int)  # (np.float32(1e-3).item() != 1e-3)
        assert sched == want and all(type(getattr(sched, f)) in (int, float, bool, str, tuple)
                                     for f in sched.__dataclass_fields__)
        for step in (0, 1, 4, np.int64(5), torch.tensor(6)):
            assert sched(step) == want(int(step))


@pytest.mark.parametrize("make, pattern", [
    (lambda np: schedules.linear_warmup(1.0, 4.0),
     r"steps = 4.0 is invalid; expected an integer >= 0 .*, got float \(a float is refused here"),
    (lambda np: schedules.step_decay(1.0, np.float64(2.5)), r"step_size = .*2.5.* is invalid; .*got float64"),
    (lambda np: schedules.cosine_decay(1.0, True), r"decay_steps = True is invalid; expected an integer >= 1"),
    (lambda np: schedules.constant(np.bool_(True)),
     r"value = .*True.* is invalid; expected a finite number .*got bool"),
    (lambda np: schedules.constant(torch.ones(2)),
     r"value = tensor.* is invalid; .*got a torch.float32 tensor of shape \(2,\)"),
    (lambda np: schedules.constant(10 ** 400), r"value = \d+ is invalid; expected a finite number"),
    (lambda np: schedules.one_cycle(0.1, 10, pct_start="0.3"),
     r"pct_start = '0.3' is invalid; expected a finite number"),
    (lambda np: schedules.join([schedules.constant(1.0)] * 3, [np.int64(4), np.int64(2)]),
     r"join: boundaries\[1\] = 2 is invalid; expected an integer >= 4"),
    (lambda np: schedules.constant(1.0)(2.0), r"schedule step = 2.0 is invalid; expected an integer >= 0 .*float"),
    (lambda np: schedules.constant(1.0)(torch.tensor([1, 2])), r"schedule step = tensor.* is invalid; .*shape \(2,\)")])
def test_schedule_arguments_that_are_no_numbers_or_no_counts_are_refused_naming_them(make, pattern):
    """A float step count (even a whole one), a bool, a string pct_start (a TypeError from its comparison) and
    an int beyond the float range (an OverflowError) are refused naming the argument, its value and its type."""
    np = pytest.importorskip("numpy")
    with pytest.raises(HParamError, match=pattern):
        make(np)


@pytest.mark.parametrize("step, pattern", [
    (-1, r"^hparams: step = -1 is invalid; expected an integer >= 0"),
    (2.0, r"^hparams: step = 2.0 is invalid; expected an integer >= 0 .*float \(a float is refused here"),
    (True, r"^hparams: step = True is invalid; .*got bool"),
    ("3", r"^hparams: step = '3' is invalid; .*got str"),
    (torch.tensor([1, 2]), r"^hparams: step = tensor.* is invalid; .*shape \(2,\)")])
def test_hparams_at_refuses_a_step_that_is_no_count_naming_it(step, pattern):
    """hparams_at handed any step to the schedule: a custom one (a function of the step) took -1, 2.0 or True
    without a word (a torch.optim LambdaLR's lambda gets counts), sofx's refused it in their own words ("schedule
    step"). Refused as the schedules refuse it, naming hparams_at's argument, before the schedule runs; a numpy or
    1-element integer tensor step is read as its int."""
    np = pytest.importorskip("numpy")
    seen = []
    sched = lambda t: seen.append(t) or AdamHParams(lr=1e-3)  # noqa: E731
    for hparams in (sched, AdamHParams(lr=1e-3)):
        with pytest.raises(HParamError, match=pattern):
            sofx.serial.hparams_at(hparams, step)
    assert seen == []
    for ok in (np.int64(3), torch.tensor(3), 3):
        assert sofx.serial.hparams_at(sched, ok) == AdamHParams(lr=1e-3)
    assert seen == [3, 3, 3] and all(type(t) is int for t in seen)


@pytest.mark.parametrize("make, pattern", [
    (lambda: schedules.linear_warmup(math.nan, 10), r"^peak = nan is invalid; expected a finite number"),
    (lambda: schedules.linear_warmup(math.inf, 10, init=0.1), r"^peak = inf is invalid"),
    (lambda: schedules.linear_warmup(1.0, 10, init=-math.inf), r"^init = -inf is invalid"),
    (lambda: schedules.linear_warmup(1.0, -1), r"^warmup_steps = -1 is invalid; expected an integer >= 0"),
    (lambda: schedules.linear_warmup(1.0, 4.0), r"^warmup_steps = 4.0 is invalid; expected an integer >= 0"),
    (lambda: schedules.linear_warmup(1.0, warmup_steps=True), r"^warmup_steps = True is invalid")])
def test_linear_warmup_refuses_bad_arguments_naming_them_as_it_takes_them(make, pattern):
    """linear_warmup(peak, warmup_steps, init) is a Linear(init, peak, warmup_steps): its refusals named Linear's
    fields, ``end = nan`` for a nan peak and ``steps = -1`` for warmup_steps=-1, arguments it does not take."""
    with pytest.raises(HParamError, match=pattern):
        make()


@given(peak=st.floats(1e-6, 1e308), init=st.floats(0.0, 1e-3), warmup=st.integers(1, 200), data=st.data())
def test_warmup_cosine_warms_up_as_linear_warmup_and_stays_finite_for_large_peaks(peak, init, warmup, data):
    """warmup_cosine's warm-up is linear_warmup's, bit for bit (it computed ``(peak - init) * step / warmup``,
    an ulp off in about a third of the steps, and inf where ``(peak - init) * step`` overflowed: the value at
    step 5 of warmup_cosine(1e308, 10, 20) is 5e307, it returned inf)."""
    t = data.draw(st.integers(0, warmup - 1))
    got = schedules.warmup_cosine(peak, warmup, warmup + 10, init=init)(t)
    assert got == schedules.linear_warmup(peak, warmup, init=init)(t)
    assert math.isfinite(got) and min(init, peak) <= got <= max(init, peak)
    assert schedules.warmup_cosine(1e308, 10, 20)(5) == 5e307


@pytest.mark.parametrize("schedules_, boundaries, pattern", [
    ([], [], r"join: expected at least one schedule, got 0"),
    ([schedules.constant(1.0)] * 2, 3, r"join: boundaries = 3 \(int\) is invalid; expected a sequence of step "
                                       r"counts \(one fewer than the schedules\)"),
    (schedules.constant(1.0), [3], r"join: schedules = Constant\(value=1.0\) \(Constant\) is invalid; expected a "
                                   r"sequence of schedules"),
    ([schedules.constant(1.0)] * 3, [4, 2], r"join: boundaries\[1\] = 2 is invalid; expected an integer >= 4 "
                                            r"\(boundaries\[0\]: boundaries do not decrease\)"),
    ([schedules.constant(1.0)] * 2, [-1], r"join: boundaries\[0\] = -1 is invalid; expected an integer >= 0")])
def test_join_refuses_arguments_that_are_no_sequences_or_no_schedule_naming_them(schedules_, boundaries, pattern):
    """join([], []) said "0 schedules need -1 boundaries"; a single boundary or schedule given without a list
    raised a raw TypeError ("'int' object is not iterable"); a decreasing boundary was "boundary = 2" without
    saying which one, nor why."""
    with pytest.raises(HParamError, match=pattern):
        schedules.join(schedules_, boundaries)


@pytest.mark.parametrize("later, name, value", [
    (lambda s: -0.1, "its value", "-0.1"),
    (schedules.linear(-0.1, 0.2, 5), "its value", "-0.1"),
    (lambda s: torch.tensor(-1.0), "its value", "-1.0"),
    (lambda s: AdamHParams(weight_decay=-0.5), "its weight_decay", "-0.5")])
def test_join_refuses_a_later_schedule_negative_from_its_first_step_naming_it(later, name, value):
    """join([constant(0.1), a schedule negative at its step 0], [10]) was taken and made a negative lr at step 10,
    which the optimizer refused only then, mid-run (each of sofx's schedules refuses such arguments at
    construction). Refused at construction naming the schedule, the step and the value; a join negative from its
    first step, a schedule no step reaches and values that stay >= 0 are taken as before."""
    with pytest.raises(HParamError, match=rf"^join: schedule 1 \(\w+\) starts below 0: {name} at its step 0 \(the "
                                          rf"join's step 10\) is {value}"):
        schedules.join([schedules.constant(0.1), later], [10])
    schedules.join([later, later], [10])
    schedules.join([schedules.constant(0.1), later, schedules.constant(0.2)], [10, 10])
    assert schedules.join([schedules.constant(0.1), schedules.linear(0.1, 0.0, 3)], [10])(12) == pytest.approx(0.1 / 3)


@pytest.mark.parametrize("value, pattern", [
    ("float16", r"lr = np.float16\(0.1\) is a float16 number"),
    (-1.0, r"lr = -1.0 is invalid; expected lr >= 0"),
    ("a", r"lr must be a float or a 0-d tensor, got str")])
def test_hparams_schedule_checks_the_values_its_base_returns_as_its_fields(value, pattern):
    """The values a field's schedule returns are checked (a numpy float16 lr refused, as the optimizer refuses it);
    those of ``base`` were not: its numpy float16 lr was read as the Python number it holds (0.0999755859375), taken
    where the optimizer refuses it, and a negative or str lr went on to the step. Checked alike, naming the step and
    base; a field given overrides base's value, which is then not read."""
    np = pytest.importorskip("numpy")
    lr = np.float16(0.1) if value == "float16" else value
    sched = schedules.hparams_schedule(base=lambda t: AdamHParams(lr=lr, beta1=0.9))
    with pytest.raises(HParamError, match=rf"^hparams_schedule at step 3 \(from base\): {pattern}"):
        sched(3)
    assert schedules.hparams_schedule(lr=0.2, base=lambda t: AdamHParams(lr=lr, beta1=0.9))(3) == \
        AdamHParams(lr=0.2, beta1=0.9)


def test_join_made_from_lists_is_the_one_of_tuples():
    """Join([...], [...]) kept its lists: it was unhashable and unequal to join(...)'s (tuples)."""
    c = schedules.constant(1.0)
    made = schedules.Join([c, c], [3])
    assert made == schedules.join([c, c], [3]) and hash(made) == hash(schedules.join((c, c), (3,)))
    assert made.schedules == (c, c) and made.boundaries == (3,)


def _loop_step(hparams):
    """One serial loop step of a two-leaf model with ``hparams``."""
    from sofx.loss_scale import static_scale
    from sofx.serial import init_loop, serial_loop_step

    opt, scaler = sofx.adamw(), static_scale(1.0)
    params = {"w": torch.ones(3, 3), "b": torch.ones(3)}
    loop = init_loop(opt, params, scaler)
    return serial_loop_step(opt, loop, {"w": torch.ones(3, 3), "b": torch.ones(3)}, scaler=scaler,
                            hparams=hparams)[0]


@pytest.mark.parametrize("hparams, pattern", [
    (schedules.cosine_decay(1e-3, 10),
     r"hparams: the schedule CosineDecay\(.*\) returned 0\.001 \(float\) at step 0, a number; .*"
     r"hparams_schedule\(lr=schedule\)"),
    (1e-3, r"hparams = 0\.001 \(float\) is a number; expected an AdamHParams \(AdamHParams\(lr=0\.001\)\).*"
           r"hparams_schedule\(lr=schedule\)"),
    ({"w": schedules.hparams_schedule(lr=1e-3), "b": schedules.hparams_schedule(lr=1e-3, weight_decay=0.0)},
     r"hparams\['b'\] is a schedule \(HParamsSchedule\) inside an hparams tree, which is not evaluated; .*"
     r"lambda t: group_hparams\(labels, groups, base=schedule\(t\)\)"),
    ({"w": schedules.cosine_decay(1e-3, 10), "b": AdamHParams()},
     r"hparams\['w'\] is a schedule \(CosineDecay\) inside an hparams tree.*hparams_schedule\(lr="),
    (lambda t: {"w": schedules.hparams_schedule(lr=1e-3), "b": None},
     r"hparams\(step=0\)\['w'\] is a schedule \(HParamsSchedule\) inside an hparams tree"),
    (lambda t: {"w": AdamHParams(), "b": 0.0}, r"hparams\(step=0\)\['b'\] = 0\.0 \(float\) is a number; expected an "
                                                r"AdamHParams")],
    ids=["float schedule", "float", "a schedule per group", "a float schedule in a group", "schedule returns "
         "schedules", "schedule returns a number in a group"])
def test_a_loop_step_given_a_number_schedule_or_schedules_per_group_says_how_to_give_them(hparams, pattern):
    """A float schedule passed as the loop's hparams (``hparams=cosine_decay(...)``) or one schedule per group
    (``{"w": hparams_schedule(...), ...}``) was refused with "expected an AdamHParams, got float" (or
    HParamsSchedule): now the message says how to give them (hparams_schedule(lr=...), a callable returning the
    whole tree)."""
    with pytest.raises(HParamError, match=pattern):
        _loop_step(hparams)


def test_a_loop_step_takes_the_ways_its_refusals_suggest():
    """What the messages above suggest works: a field schedule wrapped, a callable returning the groups."""
    lr = schedules.cosine_decay(1e-3, 10)
    _loop_step(schedules.hparams_schedule(lr=lr))
    wrapped = schedules.hparams_schedule(lr=lr)
    labels = {"w": "decay", "b": "no_decay"}
    groups = {"decay": AdamHParams(), "no_decay": AdamHParams(weight_decay=0.0)}
    _loop_step(lambda t: sofx.transforms.group_hparams(labels, groups, base=wrapped(t)))
    _loop_step(lambda t: {"w": wrapped(t), "b": None})


def _direct_steps():
    """The steps that take one step's hparams (no schedule): Adam.update, serial_step, begin_step (per block)."""
    from sofx import speculate
    from sofx.loss_scale import static_scale
    from sofx.serial import serial_step

    opt, scaler = sofx.adamw(), static_scale(1.0)
    params = {"w": torch.ones(3, 3), "b": torch.ones(3)}
    grads = {"w": torch.ones(3, 3), "b": torch.ones(3)}
    return {"update": lambda hp: opt.update(params, grads, opt.init(params), hp),
            "serial_step": lambda hp: serial_step(opt, params, grads, opt.init(params), scaler=scaler,
                                                  scaler_state=scaler.init(), hparams=hp),
            "begin_step": lambda hp: speculate.begin_step(opt, speculate.SpeculationConfig(), scaler, scaler.init(),
                                                          n_blocks=2, hparams=hp)}


@pytest.mark.parametrize("step", ["update", "serial_step", "begin_step"])
@pytest.mark.parametrize("hparams, pattern", [
    (schedules.cosine_decay(1e-3, 10),
     r"^hparams is a schedule \(CosineDecay\), which is not evaluated here: .*sofx\.serial\.hparams_at\(hparams, "
     r"step\).*hparams_schedule\(lr=schedule\)"),
    (schedules.hparams_schedule(lr=1e-3),
     r"^hparams is a schedule \(HParamsSchedule\), which is not evaluated here: .*serial_loop_step"),
    ([schedules.hparams_schedule(lr=1e-3), AdamHParams()],
     r"^hparams\[0\] is a schedule \(HParamsSchedule\), which is not evaluated here: .*only the whole hparams may "
     r"be a schedule")],
    ids=["float schedule", "hparams schedule", "a schedule per group"])
def test_a_step_given_a_schedule_as_its_hparams_says_how_to_evaluate_it(step, hparams, pattern):
    """Adam.update, serial_step and begin_step take one step's hparams; a schedule given to them was refused
    with "expected an AdamHParams, got CosineDecay": now the message says, in hparams_at's words, how to give
    its value at the step (or to take loop steps, which evaluate it)."""
    if step != "begin_step" and isinstance(hparams, list):
        hparams = {"b": hparams[0], "w": hparams[1]}
        pattern = pattern.replace(r"hparams\[0\]", r"hparams\['b'\]")
    with pytest.raises(HParamError, match=pattern):
        _direct_steps()[step](hparams)


@pytest.mark.parametrize("where", ["sofx.adamw", "update", "serial_loop_step", "speculative_loop_step", "a group"])
def test_a_schedule_given_as_an_hparam_field_says_how_to_give_it(where):
    """optax takes ``adam(learning_rate=schedule)``; sofx's fields take a step's value and a schedule is the whole
    hparams of the loop steps. ``AdamHParams(lr=schedule)`` and ``sofx.adamw(lr=schedule)`` were refused with "lr
    must be a float or a 0-d tensor, got CosineDecay": now the message says the field is a schedule and how to give
    it (hparams_schedule(lr=schedule) to the loop steps, or its value at the step), naming the leaf."""
    from sofx import speculate
    from sofx.loss_scale import static_scale
    from sofx.serial import init_loop, serial_loop_step

    lr = schedules.cosine_decay(1e-3, 10)
    hint = (r"lr is a schedule \(CosineDecay\), where a value is taken \(a float or a 0-d tensor\): .*"
            r"hparams=sofx\.schedules\.hparams_schedule\(lr=schedule\).*AdamHParams\(lr=schedule\(step\)\)")
    if where == "sofx.adamw":
        with pytest.raises(HParamError, match=r"^defaults: " + hint):
            sofx.adamw(lr=lr)
        return
    opt, scaler = sofx.adamw(), static_scale(1.0)
    params = {"w": torch.ones(3, 3), "b": torch.ones(3)}
    grads = {"w": torch.ones(3, 3), "b": torch.ones(3)}
    loop = init_loop(opt, params, scaler)
    hp = AdamHParams(lr=lr)
    calls = {
        "update": lambda: opt.update(params, grads, opt.init(params), hp),
        "serial_loop_step": lambda: serial_loop_step(opt, loop, grads, scaler=scaler, hparams=hp),
        "speculative_loop_step": lambda: speculate.speculative_loop_step(
            opt, loop, grads, config=speculate.SpeculationConfig(), scaler=scaler, hparams=hp),
        "a group": lambda: opt.update(params, grads, opt.init(params), sofx.transforms.group_hparams(
            {"w": "decay", "b": "no_decay"}, {"decay": AdamHParams(lr=lr), "no_decay": AdamHParams(lr=0.0)})),
    }
    path = r"params\['w'\]" if where == "a group" else r"params\['b'\]"
    with pytest.raises(HParamError, match=r"^hparams for " + path + r": " + hint):
        calls[where]()
    assert loop.params["w"].eq(1).all()  # nothing stepped


@pytest.mark.parametrize("where", ["lr=", "a group's lr", "param_groups after construction"])
def test_a_schedule_given_as_the_offload_optimizers_lr_says_to_use_an_lr_scheduler(where):
    """``SpeculativeAdamW(params, lr=cosine_decay(...))`` (optax's ``learning_rate=schedule``) was refused with
    "defaults['lr'] = CosineDecay(...) is invalid; expected a finite number": now the message says that the
    facade's lr follows torch.optim's schedulers, and how to run a sofx schedule there (LambdaLR over lr=1.0),
    which then gives the schedule's values step by step."""
    import sofx.offload
    model = torch.nn.Linear(3, 2)
    lr = schedules.warmup_cosine(1e-2, 3, 10)
    hint = (r"is a schedule \(WarmupCosine\), where the offload optimizer takes a number: its lr follows a "
            r"torch\.optim\.lr_scheduler; for a sofx schedule, lr=1\.0 and "
            r"torch\.optim\.lr_scheduler\.LambdaLR\(opt, schedule\)")
    if where == "lr=":
        with pytest.raises(HParamError, match=r"^defaults\['lr'\] " + hint):
            sofx.offload.SpeculativeAdamW(model.parameters(), lr=lr)
    elif where == "a group's lr":
        with pytest.raises(HParamError, match=r"^param_groups\[0\]\['lr'\] " + hint):
            sofx.offload.SpeculativeAdamW([{"params": model.parameters(), "lr": lr}])
    else:
        with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
            opt.param_groups[0]["lr"] = lr
            opt.zero_grad()
            with pytest.raises(HParamError, match=r"^param_groups\[0\]\['lr'\] " + hint):
                opt.backward(model(torch.ones(1, 3)).sum())  # (the step's hparams are read as it begins)
            opt.zero_grad()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1.0, executor="inline") as opt:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr)
        for step in range(6):
            assert opt.param_groups[0]["lr"] == lr(step)
            opt.zero_grad()
            opt.backward(model(torch.ones(1, 3)).sum())
            opt.step()
            sched.step()
    whole = schedules.hparams_schedule(lr=lr)  # values are AdamHParams: their .lr
    with pytest.raises(HParamError, match=r"LambdaLR\(opt, lambda t: schedule\(t\)\.lr\) make the group's lr "
                                          r"schedule\(step\)\.lr \(its values are AdamHParams\)$"):
        sofx.offload.SpeculativeAdamW(model.parameters(), lr=whole)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1.0, executor="inline") as opt:
        torch.optim.lr_scheduler.LambdaLR(opt, lambda t: whole(t).lr)
        assert opt.param_groups[0]["lr"] == lr(0) != 1.0


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(base_beta1=-0.5), r"base_beta1 = -0.5 is invalid; expected 0 <= base_beta1 < 1"),
    (dict(base_beta1=1.0), r"base_beta1 = 1.0 is invalid; expected 0 <= base_beta1 < 1"),
    (dict(max_beta1=1.0), r"max_beta1 = 1.0 is invalid; expected 0 <= max_beta1 < 1"),
    (dict(max_beta1=1.5, base_beta1=0.9), r"max_beta1 = 1.5 is invalid")])
def test_one_cycle_betas_outside_0_1_are_refused_at_construction(kwargs, pattern):
    """beta1 cycles between max_beta1 and base_beta1: one outside [0, 1) was taken, and the optimizer refused the
    step where beta1 first left the range -- for base_beta1 the peak of the cycle, mid-run. Without cycling
    (cycle_beta1=False) the betas are not used and are not read."""
    with pytest.raises(HParamError, match=pattern):
        schedules.one_cycle(0.1, 10, **kwargs)
    assert schedules.one_cycle(0.1, 10, cycle_beta1=False, **kwargs)(3).beta1 is None


def test_one_cycle_total_steps_beyond_the_float_range_is_refused_naming_it():
    """The phase ends are floats (``pct_start * total_steps - 1``, as OneCycleLR's): a total_steps no float holds
    raised a raw OverflowError ("int too large to convert to float") when the schedule was made."""
    with pytest.raises(HParamError, match=r"total_steps = 1000000\d*\.\.\. is invalid; expected an integer within the "
                                          r"float range"):
        schedules.one_cycle(0.1, 10 ** 400)
    big = schedules.one_cycle(0.1, 2 ** 60)  # large but a float: taken, as torch's
    assert big.lr(0) == pytest.approx(0.1 / 25)


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("anneal", ["cos", "linear"])
@pytest.mark.parametrize("total", [2 ** 31 + 7, 2 ** 53 + 1, 2 ** 53 + 3, 2 ** 60 + 5])
def test_one_cycle_is_onecyclelr_bit_for_bit_near_the_end_of_huge_cycles(total: int, anneal: str, three_phase: bool):
    """OneCycleLR's last phase ends at the int ``total_steps - 1``; sofx's ended at ``float(total_steps) - 1``,
    another float where total_steps is an odd number above 2**53 (2**53 + 1: 2**53 - 1 against 2**53), so the
    last steps' lr and beta1 were not torch's bit for bit. Torch's values come from its scheduler moved to each
    step (``last_epoch``), as it computes them from the step alone."""
    ours = schedules.one_cycle(0.1, total, pct_start=0.3, anneal=anneal, three_phase=three_phase)
    p = torch.nn.Parameter(torch.randn(1))
    opt = torch.optim.Adam([p], lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total, pct_start=0.3,
                                                anneal_strategy=anneal, three_phase=three_phase)
    ends = [int(0.3 * total) - 1, int(2 * 0.3 * total) - 2] if three_phase else [int(0.3 * total) - 1]
    steps = sorted({t for t in [0, 1, total - 3, total - 2, total - 1, total, *[e + d for e in ends
                                                                                  for d in (-2, -1, 0, 1, 2)]]
                    if 0 <= t <= total})
    for t in steps:
        sched.last_epoch = t
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # get_lr() outside step()
            lr = sched.get_lr()[0]
        assert (ours.lr(t), ours.beta1(t)) == (lr, opt.param_groups[0]["betas"][0]), t


# optax's schedules as its source and docs define them (optax/schedules/_schedule.py, _join.py; optax is not
# installed here), in float64: optax evaluates in float32 under JAX's defaults, so agreement is to rounding.
def _optax_linear_schedule(init_value, end_value, transition_steps):
    """optax.linear_schedule: polynomial_schedule(power=1); ``transition_steps <= 0`` holds ``init_value``."""
    if transition_steps <= 0:
        return lambda count: init_value

    def schedule(count):
        frac = 1 - min(max(count, 0), transition_steps) / transition_steps
        return (init_value - end_value) * frac + end_value
    return schedule


def _optax_cosine_decay_schedule(init_value, decay_steps, alpha=0.0):
    """optax.cosine_decay_schedule (exponent 1)."""
    def schedule(count):
        count = min(count, decay_steps)
        return init_value * ((1 - alpha) * (0.5 * (1 + math.cos(math.pi * count / decay_steps))) + alpha)
    return schedule


def _optax_join_schedules(schedules_, boundaries):
    """optax.join_schedules: schedule k from boundary k-1 on, called with ``step - boundary``."""
    def schedule(step):
        output = schedules_[0](step)
        for boundary, s in zip(boundaries, schedules_[1:]):
            output = output if step < boundary else s(step - boundary)
        return output
    return schedule


def _optax_warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    """optax.warmup_cosine_decay_schedule: linear_schedule joined at warmup_steps with a cosine of
    ``decay_steps - warmup_steps`` steps from peak_value to ``alpha * peak_value = end_value``."""
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return _optax_join_schedules([_optax_linear_schedule(init_value, peak_value, warmup_steps),
                                  _optax_cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha)],
                                 [warmup_steps])


@given(peak=st.floats(1e-6, 10.0), init=st.floats(0.0, 1.0), end=st.floats(0.0, 1.0), warmup=st.integers(0, 30),
       extra=st.integers(1, 60), t=st.integers(0, 120))
def test_warmup_cosine_equals_optaxs_warmup_cosine_decay_schedule(peak, init, end, warmup, extra, t):
    """decay_steps counts the warm-up (optax's); a warm-up of no steps starts at the peak, as optax's join of a
    linear_schedule of 0 steps at boundary 0 does; past decay_steps the value holds at end."""
    ours = schedules.warmup_cosine(peak, warmup, warmup + extra, init=init, end=end)
    want = _optax_warmup_cosine_decay_schedule(init, peak, warmup, warmup + extra, end)(t)
    assert ours(t) == pytest.approx(want, rel=1e-12, abs=1e-15)


@given(init=st.floats(1e-6, 10.0), n=st.integers(1, 100), alpha=st.floats(0.0, 1.0), t=st.integers(0, 200))
def test_cosine_decay_equals_optaxs_cosine_decay_schedule(init, n, alpha, t):
    assert schedules.cosine_decay(init, n, alpha)(t) == pytest.approx(
        _optax_cosine_decay_schedule(init, n, alpha)(t), rel=1e-12, abs=1e-15)


@given(init=st.floats(0.0, 1.0), end=st.floats(0.0, 1.0), n=st.integers(0, 50), t=st.integers(0, 100))
def test_linear_equals_optaxs_linear_schedule_but_for_zero_steps(init, end, n, t):
    """optax's linear_schedule of 0 transition steps holds init_value; sofx's linear takes end from the first step
    (a warm-up of no steps starts at its peak, as optax's warm-up schedules do: they join at boundary 0)."""
    want = _optax_linear_schedule(init, end, n)(t) if n > 0 else end
    assert schedules.linear(init, end, n)(t) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert schedules.linear_warmup(end, n, init)(t) == schedules.linear(init, end, n)(t)


@given(b=st.lists(st.integers(0, 10), min_size=1, max_size=4), t=st.integers(0, 60))
def test_join_equals_optaxs_join_schedules(b, t):
    """Equal boundaries included (the schedule between them is never used)."""
    boundaries = [sum(b[:i + 1]) for i in range(len(b))]
    parts = [schedules.linear(float(k), float(k) + 1.0, 7) for k in range(len(b) + 1)]
    assert schedules.join(parts, boundaries)(t) == _optax_join_schedules(parts, boundaries)(t)


def test_step_decay_of_integer_arguments_refuses_the_step_where_its_value_leaves_the_float_range():
    """step_decay(1, 1, gamma=2) computed in Python ints (an int init and gamma stay ints): at step 2000 its value
    2 ** 2000 is no float, and the range check raised a raw OverflowError ("int too large to convert to float")
    instead of the HParamError a float gamma gets; a step of 10 ** 9 built an int of 10 ** 9 bits first."""
    np = pytest.importorskip("numpy")
    for init, gamma in ((1, 2), (np.int64(1), np.int64(2)), (1, 2.0)):
        sched = schedules.step_decay(init, 1, gamma)
        assert sched(3) == 8.0 and type(sched(3)) is float
        with pytest.raises(HParamError, match=r"step_decay .*: the value at step 2000 is inf"):
            sched(2000)
    with pytest.raises(HParamError, match=r"the value at step 1000000000 is inf"):
        schedules.step_decay(1, 1, 2)(10 ** 9)


def test_hparams_schedule_given_a_schedule_of_whole_hparams_as_a_field_says_to_give_it_as_base():
    """hparams_schedule(lr=one_cycle(...)) was refused at its first step with "lr must be a float or a 0-d tensor,
    got AdamHParams": one_cycle returns the whole hparams (lr and beta1); the message now says so and how to give
    it (base=, or its field alone: one_cycle(...).lr)."""
    sched = schedules.hparams_schedule(lr=schedules.one_cycle(0.1, 10), weight_decay=0.0)
    with pytest.raises(HParamError, match=r"^hparams_schedule at step 0: the schedule given as lr \(OneCycle\) "
                                          r"returned an AdamHParams, the whole hparams; give it as base=\.\.\. "
                                          r"\(hparams_schedule\(base=schedule\)\), or a schedule of lr alone"):
        sched(0)
    ok = schedules.hparams_schedule(lr=schedules.one_cycle(0.1, 10).lr, weight_decay=0.0)(0)
    assert ok == schedules.hparams_schedule(base=schedules.one_cycle(0.1, 10, cycle_beta1=False),
                                            weight_decay=0.0)(0)


@pytest.mark.parametrize("loop_step", ["serial_loop_step", "speculative_loop_step"])
@pytest.mark.parametrize("step, kind", [("x", "str"), (None, "NoneType"), (-1, "int"), (1.5, "float"), (True, "bool")])
def test_a_loop_whose_step_is_no_count_is_refused_before_anything_changes(loop_step, step, kind):
    """loop.step is the schedule position. A LoopState built or loaded with a step that is no count was taken: -1
    became 0 and True 2 without a word, and "x" or None raised a raw TypeError after the step, with donate=True
    after the parameters had been overwritten. Refused naming loop.step, before anything runs; a numpy or
    1-element tensor count is read as the int."""
    np = pytest.importorskip("numpy")
    from sofx import speculate
    from sofx.loss_scale import static_scale
    from sofx.serial import init_loop, serial_loop_step

    opt, scaler = sofx.adamw(), static_scale(1.0)
    run = {"serial_loop_step": lambda loop: serial_loop_step(opt, loop, {"w": torch.ones(3)}, scaler=scaler,
                                                             hparams=schedules.hparams_schedule(lr=0.1), donate=True),
           "speculative_loop_step": lambda loop: speculate.speculative_loop_step(
               opt, loop, {"w": torch.ones(3)}, config=speculate.SpeculationConfig(), scaler=scaler,
               hparams=schedules.hparams_schedule(lr=0.1), donate=True)}[loop_step]
    loop = init_loop(opt, {"w": torch.ones(3)}, scaler)._replace(step=step)
    with pytest.raises(sofx.SofxError, match=rf"^loop\.step = .* is invalid; expected an integer >= 0 .*got {kind}"):
        run(loop)
    assert loop.params["w"].eq(1).all() and int(loop.opt_state.count["w"]) == 0
    for count in (np.int64(4), torch.tensor(4)):
        new, _ = run(init_loop(opt, {"w": torch.ones(3)}, scaler)._replace(step=count))
        assert type(new.step) is int and new.step == 5
