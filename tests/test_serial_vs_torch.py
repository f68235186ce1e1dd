"""The serial loop equals torch.optim + clip_grad_norm_ + GradScaler ("torch") and ZeRO's step ("deepspeed").

Driven on CPU with loss-scaled float32 gradients, forced clipping, injected
infs (overflow), scale growth, a parameter that sometimes gets no gradient,
and an lr schedule, for 60 steps. sofx folds unscale and clip into one
multiplier and accumulates the norm in float64, so the comparison is at
float32 rounding (relative 1e-6), not bitwise.
"""

from __future__ import annotations

import collections
import math
import random

import pytest
import torch

import sofx
from sofx import AdamHParams, loss_scale, schedules
from sofx.serial import serial_step, step_facts

from helpers import script_prints_ok

STEPS = 60
SHAPES = {"w1": (8, 6), "b1": (6,), "w2": (6, 3), "rare": (5,)}


def _events(step: int) -> dict:
    """Deterministic event pattern: overflow every 9th step, big gradients (clip) on some steps,
    no gradient for "rare" on every 4th step."""
    return {"overflow": step % 9 == 4, "big": step % 5 in (0, 1) or step < 3, "rare_missing": step % 4 == 2}


def _grads(gen: torch.Generator, step: int, S: float) -> dict:
    ev = _events(step)
    mult = 4.0 if ev["big"] else 0.05
    g = {k: torch.randn(s, generator=gen) * mult * S for k, s in SHAPES.items()}
    if ev["overflow"]:
        g["w2"][1, 2] = float("inf") if step % 2 else float("nan")
    if ev["rare_missing"]:
        g["rare"] = None
    return g


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("decoupled", [True, False])
def test_torch_profile_equals_torch_optim_gradscaler_clip(decoupled: bool):
    gen = torch.Generator().manual_seed(11)
    init = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    lr_at = schedules.warmup_cosine(3e-2, warmup_steps=5, decay_steps=STEPS)
    wd, max_norm = 0.05, 1.0
    opt = (sofx.adamw if decoupled else sofx.adam)(lr=lr_at(0), weight_decay=wd)
    rule = loss_scale.grad_scaler(init_scale=2.0 ** 10, growth_interval=4)

    tparams = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    topt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        list(tparams.values()), lr=lr_at(0), weight_decay=wd, foreach=False)
    tscaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=4)

    params, state, sstate = {k: v.clone() for k, v in init.items()}, opt.init(init), rule.init()
    pos = 0  # schedule position: steps actually taken
    seen = {"overflow": 0, "clip": 0, "growth": 0, "missing": 0}
    for step in range(STEPS):
        S = rule.scale(sstate)
        tscaler.scale(torch.ones(()))  # initialises the scale lazily, as scaler.scale(loss) would
        assert tscaler.get_scale() == S
        grads = _grads(gen, step, S)
        lr = lr_at(pos)

        for k, p in tparams.items():
            p.grad = None if grads[k] is None else grads[k].clone()
        for group in topt.param_groups:
            group["lr"] = lr
        tscaler.unscale_(topt)
        torch.nn.utils.clip_grad_norm_(list(p for p in tparams.values() if p.grad is not None), max_norm)
        tscaler.step(topt)
        tscaler.update()

        params, state, sstate, facts = serial_step(opt, params, grads, state, scaler=rule, scaler_state=sstate,
                                                   hparams=AdamHParams(lr=lr), max_norm=max_norm, profile="torch")
        assert facts.overflow == _events(step)["overflow"]
        assert rule.scale(sstate) == tscaler.get_scale()
        seen["overflow"] += facts.overflow
        seen["clip"] += facts.clipped
        seen["growth"] += rule.scale(sstate) > S
        seen["missing"] += grads["rare"] is None and not facts.overflow
        if not facts.skipped:
            pos += 1
        for k, p in tparams.items():
            _close(params[k], p.detach(), f"step {step} params[{k!r}]")
            tstate = topt.state.get(p, {})
            count = int(tstate["step"]) if tstate else 0
            assert int(state.count[k]) == count, (step, k)
            if tstate:
                _close(state.mu[k], tstate["exp_avg"], f"step {step} mu[{k!r}]")
                _close(state.nu[k], tstate["exp_avg_sq"], f"step {step} nu[{k!r}]")
    assert min(seen.values()) >= 2, seen  # every event actually happened
    assert seen["clip"] < STEPS - seen["overflow"]  # and unclipped steps too


def _zero3_reference_step(params: list[torch.Tensor], grads: list[torch.Tensor | None], topt, rule, sstate,
                          max_norm: float):
    """ZeRO-3's step() on flat fp32 partitions, written from its description with torch ops."""
    flat = [torch.zeros_like(p) if g is None else g.clone() for p, g in zip(params, grads)]  # missing -> zeros
    overflow = not all(bool(torch.isfinite(g).all()) for g in flat)
    sstate = rule.update(sstate, overflow)  # the scale is updated before unscaling
    if overflow:
        return sstate, True
    loss_scale_ = rule.scale(sstate)
    norms = torch.stack([torch.linalg.vector_norm(g) for g in flat])
    total_norm = torch.linalg.vector_norm(norms)  # norm of the *scaled* gradients
    clip = ((total_norm / loss_scale_) + 1e-6) / max_norm
    clip = torch.clamp(clip, min=1.0)
    combined = clip * loss_scale_
    for p, g in zip(params, flat):
        p.grad = g.mul_(1.0 / combined)
    topt.step()
    return sstate, False


def test_deepspeed_profile_equals_zero3_step():
    gen = torch.Generator().manual_seed(5)
    init = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    lr_at = schedules.step_decay(2e-2, step_size=15, gamma=0.5)
    opt = sofx.adamw(lr=2e-2, weight_decay=0.01)
    rule = loss_scale.deepspeed_scaler(init_scale=2.0 ** 12, scale_window=6, hysteresis=2)
    tparams = [torch.nn.Parameter(init[k].clone()) for k in SHAPES]
    topt = torch.optim.AdamW(tparams, lr=2e-2, weight_decay=0.01, foreach=False)
    ref_state = rule.init()
    params, state, sstate = {k: v.clone() for k, v in init.items()}, opt.init(init), rule.init()
    pos, clipped, grew = 0, 0, 0
    for step in range(STEPS):
        S = rule.scale(sstate)
        grads = _grads(gen, step, S)
        lr = lr_at(pos)
        for group in topt.param_groups:
            group["lr"] = lr
        with torch.no_grad():
            ref_state, ref_skipped = _zero3_reference_step(tparams, [grads[k] for k in SHAPES], topt, rule,
                                                           ref_state, 1.0)
        params, state, sstate, facts = serial_step(opt, params, grads, state, scaler=rule, scaler_state=sstate,
                                                   hparams=AdamHParams(lr=lr), max_norm=1.0, profile="deepspeed",
                                                   missing_grad="zero")
        assert facts.skipped == ref_skipped == _events(step)["overflow"]
        assert sstate == ref_state
        clipped += facts.clipped
        grew += facts.scale > S
        pos += not facts.skipped
        for k, p in zip(SHAPES, tparams):
            _close(params[k], p.detach(), f"step {step} params[{k!r}]")
    assert clipped >= 2 and grew >= 1 and clipped < STEPS - 7


def test_step_facts_profiles_differ_on_a_growth_step():
    rule = loss_scale.deepspeed_scaler(init_scale=4.0, scale_window=1)
    s = rule.update(rule.init(), False)  # one clean iteration: the next clean one grows the scale
    assert rule.scale(s) == 4.0
    sumsq = (3.0 * 4.0) ** 2  # unscaled norm 3 with the backward's scale 4
    torch_facts = step_facts("torch", rule, s, sumsq, max_norm=None)
    ds_facts = step_facts("deepspeed", rule, s, sumsq, max_norm=None)
    assert torch_facts.scale == 4.0 and torch_facts.grad_scale == 0.25 and torch_facts.grad_norm == 3.0
    assert ds_facts.scale == 8.0 and ds_facts.grad_scale == 0.125 and ds_facts.grad_norm == 1.5
    clipped = step_facts("deepspeed", rule, s, sumsq, max_norm=1.0)
    assert clipped.clipped and clipped.grad_scale == pytest.approx(1.0 / ((1.5 + 1e-6) / 1.0 * 8.0))
    over = step_facts("torch", loss_scale.grad_scaler(), loss_scale.grad_scaler().init(), math.inf, 1.0)
    assert over.overflow and over.skipped and over.scaler_state.scale == 2.0 ** 15
    # a skipped step's (unused) multiplier is the profile's, as an unskipped one's: GradScaler's float32(1/S) under
    # "torch" (it was the double 1/S there)
    third = step_facts("torch", loss_scale.grad_scaler(init_scale=3.0), loss_scale.grad_scaler(init_scale=3.0).init(),
                       math.inf, None)
    assert third.skipped and third.grad_scale == loss_scale.inverse_scale(3.0) != 1.0 / 3.0


@pytest.mark.parametrize("profile", ["torch", "deepspeed"])
def test_step_facts_at_a_loss_scale_that_cannot_unscale(profile: str):
    """A scale of 0 (GradScaler's after ~166 overflows in a row) or one whose inverse is beyond float32 makes the
    step an overflow: skipped, the scaler backs off; never a division by zero, never a nan multiplier. (A static
    rule's state loaded with such a scale: static_scale itself refuses one.)"""
    for rule, state in [(loss_scale.grad_scaler(), loss_scale.GradScalerState(0.0, 3)),
                        (loss_scale.grad_scaler(), loss_scale.GradScalerState(2.0 ** -128, 3)),
                        (loss_scale.static_scale(), loss_scale.StaticScaleState(2.0 ** -140))]:
        for max_norm in (None, 1.0):
            facts = step_facts(profile, rule, state, 4.0, max_norm)
            assert facts.overflow and facts.skipped and not facts.clipped, (state, max_norm)
            assert facts.scaler_state == rule.update(state, True)
    ok = step_facts(profile, loss_scale.grad_scaler(), loss_scale.GradScalerState(2.0 ** -126, 3), 4.0, 1.0)
    assert not ok.overflow and ok.clipped  # 2**126 is a float32: unscaled (and clipped) as usual


@pytest.mark.parametrize("bad, kind", [(-1.0, "float"), ("4.0", "str"), (None, "NoneType"), (True, "bool")])
def test_step_facts_refuses_what_is_no_sum_of_squares_naming_it(bad, kind):
    """step_facts of a negative sum of squares raised Python's bare "math domain error" from its square root, of a
    str "must be real number, not str", of None a TypeError; True was taken as 1. Refused, an HParamError naming
    sumsq_total, its value and type, before the rule is asked anything; a numpy number or a 1-element tensor is
    read as its float, inf and nan are an overflow, and an int beyond the float range is inf (as total_sumsq reads
    a block's)."""
    np = pytest.importorskip("numpy")
    rule = loss_scale.grad_scaler()
    with pytest.raises(sofx.HParamError, match=rf"^step_facts: sumsq_total = .* is invalid; expected a sum of "
                                               rf"squares >= 0 .*got {kind}"):
        step_facts("torch", rule, rule.init(), bad, None)
    want = step_facts("torch", rule, rule.init(), 4.0, 1.0)
    for same in (np.float32(4.0), torch.tensor([4.0]), 4):
        assert step_facts("torch", rule, rule.init(), same, 1.0) == want
    assert step_facts("torch", rule, rule.init(), 10 ** 400, 1.0) == step_facts("torch", rule, rule.init(), math.inf,
                                                                                1.0)


@pytest.mark.parametrize("bad, kind", [("x", "str"), (None, "NoneType"), (True, "bool"), (-1.0, "float")])
def test_local_sumsq_refuses_what_is_no_sum_of_squares_naming_it(bad, kind):
    """sofx.serial.local_sumsq (what a rank passes to reduce_sumsq) returned its total unchecked: "x" came back as
    "x" (a hook then summed strings), a negative one lowered the ranks' sum; a ``present`` of no bools was read by
    its truth ("no" as a gradient), an int Python's bare "'int' object is not iterable". Refused, an HParamError
    naming local_sumsq and what was given; numpy numbers and 1-element tensors are read as their float, a -0.0
    total of a rank with gradients is +0.0 (-0.0 says the rank has none: without_gradients)."""
    np = pytest.importorskip("numpy")
    with pytest.raises(sofx.HParamError, match=rf"^local_sumsq: total = .* is invalid; expected a sum of squares "
                                               rf">= 0 .*got {kind}"):
        sofx.serial.local_sumsq(bad, [True])
    for present, words in (("no", r"present = 'no' is invalid; expected a sequence of bools"),
                           (3, r"present = 3 is invalid; expected a sequence of bools"),
                           ([True, "no"], r"present\[1\] = 'no' is invalid; expected a bool")):
        with pytest.raises(sofx.HParamError, match=rf"^local_sumsq: {words}"):
            sofx.serial.local_sumsq(4.0, present)
    for same in (np.float32(4.0), torch.tensor([4.0]), 4):
        got = sofx.serial.local_sumsq(same, [np.bool_(False), True])
        assert type(got) is float and got == 4.0
    assert math.copysign(1.0, sofx.serial.local_sumsq(-0.0, (True,))) == 1.0
    assert sofx.serial.without_gradients(sofx.serial.local_sumsq(0.0, [False, False]))
    assert math.isnan(sofx.serial.local_sumsq(math.nan, [True]))


def test_can_unscale_refuses_what_is_no_scale_and_reads_numbers_as_floats():
    """sofx.serial.can_unscale("x") raised Python's bare TypeError ("'>' not supported between instances of 'str'
    and 'int'"), can_unscale(None) too; a tensor scale gave a tensor, not a bool. An HParamError names can_unscale
    and what was given; numpy numbers and 1-element tensors are read as their float."""
    np = pytest.importorskip("numpy")
    for bad, kind in (("x", "str"), (None, "NoneType"), (True, "bool")):
        with pytest.raises(sofx.HParamError, match=rf"^can_unscale: scale = .* is invalid; expected a loss scale, a "
                                                   rf"real number .*got {kind}"):
            sofx.serial.can_unscale(bad)
    for scale, want in ((np.float32(2.0), True), (torch.tensor(2.0), True), (0, False), (torch.tensor([0.0]), False),
                        (2.0 ** -128, False), (-1.0, False)):
        got = sofx.serial.can_unscale(scale)
        assert type(got) is bool and got is want, scale


def test_call_reduce_names_a_hook_that_is_not_callable():
    """sofx.serial.call_reduce (public) with a hook that is not callable raised Python's bare TypeError ("'int'
    object is not callable", None's too: reduced_sumsq takes None as no hook, call_reduce has one to call); an
    HParamError names call_reduce and what was given. A function, or a hook with agreed_sum, is still called."""
    assert sofx.serial.call_reduce(lambda x: 2 * x, 1.5, None) == 3.0
    for bad, kind in ((5, "an int"), (None, "a NoneType"), ("sum", "a str")):
        with pytest.raises(sofx.HParamError, match=rf"^call_reduce: reduce_sumsq is {kind}; expected a function"):
            sofx.serial.call_reduce(bad, 1.0, None)


def test_a_reduce_sumsq_returning_an_int_beyond_the_float_range_is_an_overflow():
    """A reduce_sumsq hook that returned an int beyond the float range (a sum over ranks kept in Python ints)
    raised Python's bare OverflowError ("int too large to convert to float"); it is the float inf, as total_sumsq
    reads such a block sum: the step is an overflow, skipped."""
    opt, rule = sofx.adamw(), loss_scale.grad_scaler()
    params, grads = {"w": torch.ones(3)}, {"w": torch.ones(3)}
    res = serial_step(opt, params, grads, opt.init(params), scaler=rule, scaler_state=rule.init(),
                      reduce_sumsq=lambda local: 10 ** 400)
    assert res.facts.overflow and res.facts.sumsq == math.inf and torch.equal(res.params["w"], params["w"])


@pytest.mark.parametrize("profile", ["torch", "deepspeed"])
def test_finite_gradients_whose_norm_is_beyond_float32_overflow_only_below_a_scale_of_1(profile: str):
    """Two gradient elements of 3e38 (finite float32; their norm 4.2e38 is not): at a scale of 1 unscaling
    cannot make an inf, and torch's GradScaler and DeepSpeed step (sofx skipped the step); below 1 it may,
    and without clipping sofx counts that as an overflow (documented: the norm stands for the elements)."""
    sumsq = 2 * 3e38 ** 2
    rule = loss_scale.static_scale(1.0)
    assert not step_facts(profile, rule, rule.init(), sumsq, None).overflow
    ds = loss_scale.deepspeed_scaler(init_scale=1.0, hysteresis=1, raise_error_at_min_scale=False)
    assert not step_facts(profile, ds, ds.init(), sumsq, None).overflow
    half = loss_scale.static_scale(0.5)
    assert step_facts(profile, half, half.init(), sumsq, None).overflow
    # torch: the same gradients at scale 1 are stepped
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w], lr=1e-3)
    scaler.scale(w.sum()).backward()  # the scale is set up; the gradients are then the huge ones
    w.grad = torch.tensor([3e38, 3e38])
    scaler.step(opt)
    assert int(opt.state[w]["step"]) == 1


def test_serial_step_errors_change_nothing(rng):
    opt = sofx.adamw()
    params = {"a": torch.randn(3, generator=rng)}
    state = opt.init(params)
    rule = loss_scale.grad_scaler()
    with pytest.raises(sofx.LeafError, match=r"grads\['a'\]"):
        serial_step(opt, params, {"a": torch.randn(4)}, state, scaler=rule, scaler_state=rule.init())
    with pytest.raises(sofx.HParamError, match="profile"):
        serial_step(opt, params, {"a": torch.randn(3)}, state, scaler=rule, scaler_state=rule.init(), profile="x")
    with pytest.raises(sofx.HParamError, match="max_norm"):
        serial_step(opt, params, {"a": torch.randn(3)}, state, scaler=rule, scaler_state=rule.init(), max_norm=-1.0)
    assert int(state.count["a"]) == 0


# A gradient whose memory was freed (untyped_storage().resize_(0), as FSDP frees tensors) or shrunk: serial_step
# refuses it through opt.check_inputs, naming its leaf, before the sum of squares reads it (which does not check
# each leaf's storage again) and before the reduction (the hook is told through its refuse); in a subprocess, so
# that a crash fails the test.
_FREED_GRADIENT = """
import re
import torch
import sofx
from sofx import loss_scale
from sofx.errors import LeafError
from sofx.serial import serial_step


class Hook:
    def __init__(self):
        self.refused, self.called = [], False

    def __call__(self, local):
        self.called = True
        return local

    def refuse(self, error):
        self.refused.append(error)


for keep in (0, 11996):  # freed; one element short
    for missing_grad in ("skip", "zero"):
        gen = torch.Generator().manual_seed(0)
        params = {"w": torch.randn(6, generator=gen), "head": torch.randn(3000, generator=gen)}
        grads = {"w": None, "head": torch.randn(3000, generator=gen)}
        opt = sofx.adamw(lr=1e-2)
        state = opt.init(params)
        grads["head"].untyped_storage().resize_(keep)
        rule, hook = loss_scale.static_scale(), Hook()
        print(keep, missing_grad, flush=True)  # (a crash names the case it crashed in)
        try:
            serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init(), missing_grad=missing_grad,
                        reduce_sumsq=hook)
        except LeafError as e:
            want = rf"^grads\\['head'\\]: its storage holds {keep} bytes.*reach byte 12000"
            assert re.search(want, str(e)), str(e)
            assert hook.refused == [e] and not hook.called, "the other ranks are told, the sum is not reduced"
        else:
            raise AssertionError("not refused")
        assert int(state.count["head"]) == 0
print("ok")
"""


def test_serial_step_refuses_a_gradient_whose_storage_was_freed_naming_its_leaf_before_the_reduction():
    script_prints_ok(_FREED_GRADIENT)


def test_serial_step_reads_each_gradient_once(rng, monkeypatch):
    """The sum of squares decides overflow and finiteness at once: the update is told the gradients are
    finite and does not read them again; the step is the checked update's, bit for bit."""
    import importlib
    adam_module = importlib.import_module("sofx.adam")
    opt = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(30, generator=rng), "b": torch.randn(4, 5, generator=rng)}
    grads = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    state = opt.init(params)
    rule = loss_scale.grad_scaler(init_scale=8.0)
    assert opt.undo_strategies(params, grads, state, grad_scale=1 / 8.0) == [("algebraic", "")] * 2
    want_params, want_state, _ = opt.update(params, grads, state, grad_scale=1 / 8.0)

    def no_pass(x, *_):
        raise AssertionError("a gradient was read again to check its finiteness")

    monkeypatch.setattr(adam_module, "_all_finite", no_pass)
    out = serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init())
    assert not out.facts.overflow and out.facts.grad_scale == 1 / 8.0
    for k in params:
        assert torch.equal(out.params[k], want_params[k]) and torch.equal(out.state.nu[k], want_state.nu[k])
    grads["b"][1, 2] = float("inf")  # an overflow: skipped before any update
    skipped = serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init())
    assert skipped.facts.overflow and int(skipped.state.count["a"]) == 0


def test_serial_step_takes_a_numpy_or_tensor_max_norm_as_its_float(rng):
    """max_norm=np.float32(1.0) (or a 1-element tensor) was refused as invalid; it clips as the float 1.0."""
    np = pytest.importorskip("numpy")
    opt = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(6, generator=rng), "b": torch.randn(2, 3, generator=rng)}
    grads = {k: torch.randn(v.shape, generator=rng) * 5.0 * 1024 for k, v in params.items()}
    rule = loss_scale.grad_scaler(init_scale=1024.0)
    kw = dict(scaler=rule, scaler_state=rule.init())
    want = serial_step(opt, params, grads, opt.init(params), max_norm=1.0, **kw)
    assert want.facts.clipped
    for m in (np.float32(1.0), torch.tensor(1.0), torch.tensor([1.0])):
        got = serial_step(opt, params, grads, opt.init(params), max_norm=m, **kw)
        assert got.facts == want.facts and type(got.facts.clip_coef) is float
        assert all(torch.equal(got.params[k], want.params[k]) for k in params)
    with pytest.raises(sofx.HParamError, match=r"max_norm = tensor\(\[1., 1.\]\) is invalid; .* got a torch.float32 "
                                               r"tensor of shape \(2,\)"):
        serial_step(opt, params, grads, opt.init(params), max_norm=torch.ones(2), **kw)


@pytest.mark.parametrize("rule, plain", [
    (loss_scale.grad_scaler(), loss_scale.GradScalerState(3.0, 0)),
    (loss_scale.static_scale(), loss_scale.StaticScaleState(3.0)),
    (loss_scale.deepspeed_scaler(), loss_scale.DynamicLossScaleState(3.0, 5, 2, 2))], ids=lambda x: type(x).__name__)
def test_a_tensor_scale_in_the_scaler_state_steps_as_its_float(rng, rule, plain):
    """A scaler state whose scale is a 0-d tensor (torch's GradScaler keeps one; the rules take it as its number):
    the "torch" profile unscaled and clipped with the tensor itself, in float32 tensor arithmetic, so a clipped step
    differed from the one of the float scale (and the facts' and the report's scale, norm and multiplier were
    tensors). Both loops step as with the float, bit for bit, and the facts hold floats."""
    opt = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(6, generator=rng), "b": torch.randn(2, 3, generator=rng)}
    grads = {k: torch.randn(v.shape, generator=rng) * 300.0 for k, v in params.items()}
    state = plain._replace(scale=torch.tensor(plain.scale))
    config = sofx.speculate.SpeculationConfig(max_norm=1.0)
    want = serial_step(opt, params, grads, opt.init(params), scaler=rule, scaler_state=plain, max_norm=1.0)
    got = serial_step(opt, params, grads, opt.init(params), scaler=rule, scaler_state=state, max_norm=1.0)
    spec = sofx.speculate.speculative_step(opt, params, grads, opt.init(params), config=config, scaler=rule,
                                           scaler_state=state)
    assert want.facts.clipped and got.facts == want.facts
    assert all(type(x) is float for x in (got.facts.scale, got.facts.grad_norm, got.facts.grad_scale))
    assert type(spec.report.scale) is float and type(spec.report.grad_norm) is float
    for k in params:
        assert torch.equal(got.params[k], want.params[k]) and torch.equal(spec.params[k], want.params[k]), k


GROUPS = {  # torch param-group options per subtree of params
    "enc": dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-6),
    "head": dict(lr=3e-2, weight_decay=0.0, betas=(0.8, 0.95), eps=1e-8),
    "rare": dict(lr=5e-3, weight_decay=0.3, betas=(0.5, 0.9), eps=1e-4),
}
GROUP_SHAPES = {"enc": {"w": (5, 4), "b": (4,)}, "head": {"w": (3, 3)}, "rare": {"w": (6,)}}


def _lr_factor(t: int) -> float:
    """A warm-up then step decay, as a torch LambdaLR factor and as the sofx schedule's."""
    return min(1.0, (t + 1) / 5) * 0.5 ** (t // 10)


@pytest.mark.parametrize("decoupled", [True, False])
def test_param_groups_and_gradient_accumulation_equal_torch_groups_lambdalr_and_gradscaler(decoupled: bool):
    """torch's usual recipe -- param groups with their own lr, weight decay, betas and eps under a LambdaLR,
    three micro-batches accumulated into ``.grad`` (one of them with an inf on some steps), GradScaler with
    non-default factors, ``unscale_`` + ``clip_grad_norm_`` + ``step`` + ``update``, the scheduler stepped only
    when the optimizer was -- against ``accumulate`` + ``serial_loop_step`` with a per-group hparams schedule.
    A group that gets no gradient on a step (torch: ``.grad`` None) keeps its parameters, moments and count."""
    gen, rnd = torch.Generator().manual_seed(3), random.Random(3)
    init = {g: {k: torch.randn(s, generator=gen) for k, s in d.items()} for g, d in GROUP_SHAPES.items()}
    scaling = dict(init_scale=2.0 ** 8, growth_factor=1.5, backoff_factor=0.3, growth_interval=3)
    tparams = {g: {k: torch.nn.Parameter(v.clone()) for k, v in d.items()} for g, d in init.items()}
    topt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        [dict(params=list(tparams[g].values()), **GROUPS[g]) for g in GROUP_SHAPES], foreach=False)
    tsched = torch.optim.lr_scheduler.LambdaLR(topt, _lr_factor)
    tscaler = torch.amp.GradScaler("cpu", **scaling)

    def hparams_at(t: int) -> dict:
        return {g: AdamHParams(lr=o["lr"] * _lr_factor(t), beta1=o["betas"][0], beta2=o["betas"][1], eps=o["eps"],
                               weight_decay=o["weight_decay"]) for g, o in GROUPS.items()}

    opt, rule = (sofx.adamw if decoupled else sofx.adam)(), loss_scale.grad_scaler(**scaling)
    loop = sofx.serial.init_loop(opt, {g: {k: v.clone() for k, v in d.items()} for g, d in init.items()}, rule)
    seen = {"overflow": 0, "clip": 0, "missing": 0, "growth": 0}
    for step in range(30):
        S = rule.scale(loop.scaler_state)
        tscaler.scale(torch.ones(()))  # initialises the scale lazily, as scaler.scale(loss) would
        assert tscaler.get_scale() == S
        overflow, missing, big = rnd.random() < 0.15, rnd.random() < 0.4, rnd.random() < 0.5
        acc = sofx.transforms.accumulation_init(loop.params)
        for p in (p for d in tparams.values() for p in d.values()):
            p.grad = None
        for micro in range(3):
            size = (3.0 if big else 0.02) * S
            grads = {g: {k: None if g == "rare" and missing else torch.randn(s, generator=gen) * size
                         for k, s in d.items()} for g, d in GROUP_SHAPES.items()}
            if overflow and micro == 1:
                grads["enc"]["w"][0, 0] = float("inf")
            acc = sofx.transforms.accumulate(acc, grads, loop.params)
            for g, d in grads.items():  # backward: autograd accumulates into .grad
                for k, x in d.items():
                    if x is not None:
                        (tparams[g][k] * x).sum().backward()
        tscaler.unscale_(topt)
        torch.nn.utils.clip_grad_norm_([p for d in tparams.values() for p in d.values() if p.grad is not None], 1.0)
        tscaler.step(topt)
        tscaler.update()
        if tscaler.get_scale() >= S:  # the optimizer stepped: so does the scheduler
            tsched.step()

        loop, facts = sofx.serial.serial_loop_step(opt, loop, sofx.transforms.accumulated(acc, loop.params),
                                                   scaler=rule, hparams=hparams_at, max_norm=1.0)
        assert facts.overflow == overflow and rule.scale(loop.scaler_state) == tscaler.get_scale()
        seen["overflow"] += overflow
        seen["clip"] += facts.clipped
        seen["missing"] += missing and not overflow
        seen["growth"] += rule.scale(loop.scaler_state) > S
        for g, d in tparams.items():
            for k, p in d.items():
                _close(loop.params[g][k], p.detach(), f"step {step} params[{g!r}][{k!r}]")
                tstate = topt.state.get(p, {})
                assert int(loop.opt_state.count[g][k]) == (int(tstate["step"]) if tstate else 0), (step, g, k)
                if tstate:
                    _close(loop.opt_state.nu[g][k], tstate["exp_avg_sq"], f"step {step} nu[{g!r}][{k!r}]")
    assert min(seen.values()) >= 2 and seen["clip"] < 30 - seen["overflow"], seen


@pytest.mark.parametrize("profile", ["torch", "deepspeed"])
def test_a_max_norm_above_a_norm_beyond_float32_does_not_clip_and_below_a_scale_of_1_overflows(profile: str):
    """A max_norm that does not clip (1e300, above the unscaled norm 8.5e38) leaves the gradients unscaled only:
    below a scale of 1 their elements 6e38 are inf in float32, an overflow as without max_norm (sofx stepped with
    them and wrote nan into the parameters). torch's GradScaler checks the raw gradients and steps, writing that
    nan (the documented difference: sofx skips such a step, with or without max_norm)."""
    half = loss_scale.static_scale(0.5)
    facts = step_facts(profile, half, half.init(), 2 * 3e38 ** 2, 1e300)
    assert facts.overflow and not facts.clipped
    opt = sofx.adamw(lr=1e-3)
    params = {"w": torch.zeros(2)}
    out = serial_step(opt, params, {"w": torch.tensor([3e38, 3e38])}, opt.init(params), scaler=half,
                      scaler_state=half.init(), max_norm=1e300, profile=profile)
    assert out.facts.overflow and torch.equal(out.params["w"], params["w"]) and int(out.state.count["w"]) == 0
    scaler = torch.amp.GradScaler("cpu", init_scale=0.5)
    w = torch.nn.Parameter(torch.zeros(2))
    topt = torch.optim.AdamW([w], lr=1e-3)
    scaler.scale(w.sum()).backward()
    w.grad = torch.tensor([3e38, 3e38])
    scaler.unscale_(topt)
    torch.nn.utils.clip_grad_norm_([w], 1e300)
    scaler.step(topt)
    assert torch.isnan(w.detach()).all()


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("max_norm", [0.0, math.inf])
def test_torch_profile_with_max_norm_0_or_inf_equals_torch_bitwise(decoupled: bool, max_norm: float):
    """clip_grad_norm_ takes max_norm=0 (every gradient zeroed: Adam still moves the parameters through its
    momentum and weight decay) and inf (nothing clipped); serial_step refused both. Over steps with overflows,
    scale growth and a missing gradient, it now equals torch.optim + clip_grad_norm_ + GradScaler bit for bit (the
    reference backend, which follows torch.optim operation by operation)."""
    gen = torch.Generator().manual_seed(5)
    init = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    opt = (sofx.adamw if decoupled else sofx.adam)(lr=3e-2, weight_decay=0.05, backend="reference")
    rule = loss_scale.grad_scaler(init_scale=2.0 ** 10, growth_interval=4)
    tparams = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    topt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(list(tparams.values()), lr=3e-2,
                                                                   weight_decay=0.05, foreach=False)
    tscaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=4)
    params, state, sstate = {k: v.clone() for k, v in init.items()}, opt.init(init), rule.init()
    seen = {"overflow": 0, "moved": 0, "growth": 0}
    for step in range(20):
        S = rule.scale(sstate)
        tscaler.scale(torch.ones(()))
        grads = _grads(gen, step, S)
        for k, p in tparams.items():
            p.grad = None if grads[k] is None else grads[k].clone()
        tscaler.unscale_(topt)
        torch.nn.utils.clip_grad_norm_([p for p in tparams.values() if p.grad is not None], max_norm)
        tscaler.step(topt)
        tscaler.update()
        before = params["w1"]
        params, state, sstate, facts = serial_step(opt, params, grads, state, scaler=rule, scaler_state=sstate,
                                                   max_norm=max_norm)
        assert facts.clipped == (max_norm == 0.0 and not facts.overflow)
        assert facts.clip_coef == (0.0 if facts.clipped else 1.0) and rule.scale(sstate) == tscaler.get_scale()
        seen["overflow"] += facts.overflow
        seen["moved"] += not torch.equal(params["w1"], before)
        seen["growth"] += rule.scale(sstate) > S
        for k, p in tparams.items():
            assert torch.equal(params[k], p.detach()), (step, k)
            tstate = topt.state.get(p, {})
            assert int(state.count[k]) == (int(tstate["step"]) if tstate else 0), (step, k)
            if tstate:
                assert torch.equal(state.mu[k], tstate["exp_avg"]) and torch.equal(state.nu[k], tstate["exp_avg_sq"])
    assert seen["overflow"] >= 2 and seen["growth"] >= 1 and seen["moved"] >= 10, seen


@pytest.mark.parametrize("max_norm", [0.0, math.inf])
def test_deepspeed_profile_with_max_norm_0_or_inf_does_not_clip_as_zero3(rng, max_norm: float):
    """ZeRO clips only where ``clip_grad > 0`` (DeepSpeed's gradient_clipping 0.0 is its "off"), and a clip_grad of
    inf never clips: the step is the unclipped one, bit for bit (serial_step refused both values)."""
    opt = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(6, generator=rng), "b": torch.randn(2, 3, generator=rng)}
    grads = {k: torch.randn(v.shape, generator=rng) * 50.0 * 1024 for k, v in params.items()}
    rule = loss_scale.deepspeed_scaler(init_scale=1024.0)
    kw = dict(scaler=rule, scaler_state=rule.init(), profile="deepspeed")
    want = serial_step(opt, params, grads, opt.init(params), max_norm=None, **kw)
    got = serial_step(opt, params, grads, opt.init(params), max_norm=max_norm, **kw)
    assert got.facts == want.facts and not got.facts.clipped
    assert all(torch.equal(got.params[k], want.params[k]) for k in params)
    assert serial_step(opt, params, grads, opt.init(params), max_norm=1.0, **kw).facts.clipped  # they would clip


@pytest.mark.parametrize("bad", [-1.0, -math.inf, math.nan])
def test_a_negative_or_nan_max_norm_is_refused_naming_what_torch_would_do(rng, bad: float):
    """torch's clip_grad_norm_ multiplies the gradients by a negative max_norm/norm (every gradient reversed: the
    step climbs the loss) or by nan (every gradient nan): refused, saying so, nothing changed."""
    opt = sofx.adamw()
    params = {"a": torch.randn(3, generator=rng)}
    state = opt.init(params)
    rule = loss_scale.grad_scaler()
    with pytest.raises(sofx.HParamError, match=r"max_norm = .* is invalid; expected a number >= 0.*, got float "
                                               r"\(as clip_grad_norm_ .*None: no clipping; there a negative "
                                               r"max_norm would reverse every gradient, and nan make them nan\)"):
        serial_step(opt, params, {"a": torch.randn(3)}, state, scaler=rule, scaler_state=rule.init(), max_norm=bad)
    assert int(state.count["a"]) == 0
    with pytest.raises(sofx.HParamError, match=r"max_norm = .* is invalid; expected a number >= 0"):
        sofx.speculate.SpeculationConfig(max_norm=bad)  # (the offload engine's and facade's max_grad_norm)


def test_a_nested_tree_of_mixed_leaves_in_label_groups_steps_as_torch_groups_serially_and_speculatively():
    """An optax user's tree -- dicts, a list, a NamedTuple, a 0-d, a 0-element and a float64 leaf beside float32
    ones in one group, an empty subtree (None in the gradients) -- in label groups built by ``label_params`` +
    ``group_hparams`` with a scheduled group, a group of lr 0 and a label without leaves; two micro-steps
    accumulated per step (an inf in one of them on some steps, a leaf without gradient in one of them on others),
    clipping on some steps, GradScaler's scale backing off and growing. serial_loop_step equals torch.optim's
    param groups + LambdaLR + GradScaler + clip_grad_norm_ (float32 rounding; counts and scales exactly), and
    speculative_loop_step equals serial_loop_step bit for bit (without donation) at every step."""
    pair = collections.namedtuple("pair", "a b")
    gen, rnd = torch.Generator().manual_seed(7), random.Random(7)
    init = {"enc": {"w": torch.randn(4, 3, generator=gen), "scale": torch.randn((), generator=gen)},
            "head": [pair(torch.randn(0, generator=gen), torch.randn(2, 2, generator=gen, dtype=torch.float64)),
                     torch.randn(3, generator=gen)],
            "frozen": []}
    leaves, spec = sofx.tree.flatten(init)
    paths = sofx.tree.leaf_paths(spec)
    labels = sofx.transforms.label_params(init, lambda path, p: "enc" if "'enc'" in path else "head")
    groups = {"enc": dict(lr=1e-2, weight_decay=0.1), "head": dict(lr=0.0, weight_decay=0.3)}
    factor = lambda t: min(1.0, (t + 1) / 3) * 0.5 ** (t // 6)  # noqa: E731

    def hparams_at(t: int):
        return sofx.transforms.group_hparams(labels, {
            "enc": AdamHParams(lr=groups["enc"]["lr"] * factor(t), weight_decay=0.1),
            "head": AdamHParams(lr=0.0, weight_decay=0.3), "unused": AdamHParams(lr=1.0)})

    scaling = dict(init_scale=2.0 ** 8, growth_interval=3)
    tparams = [torch.nn.Parameter(x.clone()) for x in leaves]
    by_label = {g: [p for p, path in zip(tparams, paths) if ("'enc'" in path) == (g == "enc")] for g in groups}
    topt = torch.optim.AdamW([dict(params=by_label[g], **o) for g, o in groups.items()], foreach=False)
    tsched = torch.optim.lr_scheduler.LambdaLR(topt, [factor, lambda t: 1.0])
    tscaler = torch.amp.GradScaler("cpu", **scaling)
    opt, rule = sofx.adamw(), loss_scale.grad_scaler(**scaling)
    ser = spec_loop = sofx.serial.init_loop(opt, init, rule)
    config = sofx.speculate.SpeculationConfig(max_norm=1.0)
    seen = {"overflow": 0, "clip": 0, "missing": 0, "growth": 0, "undone": 0}
    for step in range(24):
        S = rule.scale(ser.scaler_state)
        tscaler.scale(torch.ones(()))
        assert tscaler.get_scale() == S
        overflow, missing = rnd.random() < 0.15, rnd.randrange(len(leaves)) if rnd.random() < 0.3 else None
        size = rnd.choice([0.02, 0.02, 0.2, 2.0])  # 0.2: clipped, yet no block alone vetoes speculation
        for p in tparams:
            p.grad = None
        acc = sofx.transforms.accumulation_init(ser.params)
        for micro in range(2):
            g = [torch.randn(x.shape, generator=gen, dtype=x.dtype) * size * S for x in leaves]
            if missing is not None and micro == 1:
                g[missing] = None
            if overflow and micro == 0:
                g[1][0] = math.inf  # (enc's w, in sorted key order: enc.scale, enc.w)
            grads = sofx.tree.unflatten(spec, g)
            grads["frozen"] = None  # no gradient for the empty subtree
            acc = sofx.transforms.accumulate(acc, grads, ser.params)
            for p, x in zip(tparams, g):
                if x is not None:
                    (p * x).sum().backward()
        tscaler.unscale_(topt)
        torch.nn.utils.clip_grad_norm_([p for p in tparams if p.grad is not None], 1.0)
        tscaler.step(topt)
        tscaler.update()
        if tscaler.get_scale() >= S:
            tsched.step()
        total = sofx.transforms.accumulated(acc, ser.params)
        ser_next, facts = sofx.serial.serial_loop_step(opt, ser, total, scaler=rule, hparams=hparams_at, max_norm=1.0)
        spec_loop, report = sofx.speculate.speculative_loop_step(opt, spec_loop, total, config=config, scaler=rule,
                                                                 hparams=hparams_at)
        ser = ser_next
        assert facts.overflow == overflow and rule.scale(ser.scaler_state) == tscaler.get_scale()
        assert spec_loop.scaler_state == ser.scaler_state and spec_loop.step == ser.step
        seen["overflow"] += overflow
        seen["clip"] += facts.clipped
        seen["missing"] += missing is not None and not overflow
        seen["growth"] += rule.scale(ser.scaler_state) > S
        seen["undone"] += report.undone
        ours = [sofx.tree.flatten(t)[0] for t in (ser.params, *ser.opt_state)]
        theirs = [sofx.tree.flatten(t)[0] for t in (spec_loop.params, *spec_loop.opt_state)]
        for a, b in zip(sum(ours, []), sum(theirs, [])):
            assert a.dtype == b.dtype and torch.equal(a, b), step
        for path, mine, count, mu, nu, p in zip(paths, ours[0], ours[1], ours[2], ours[3], tparams):
            _close(mine, p.detach(), f"step {step} {path}")
            tstate = topt.state.get(p, {})
            assert int(count) == (int(tstate["step"]) if tstate else 0), (step, path)
            if tstate:
                _close(mu, tstate["exp_avg"], f"step {step} mu of {path}")
                _close(nu, tstate["exp_avg_sq"], f"step {step} nu of {path}")
    assert min(seen.values()) >= 1 and seen["clip"] < 24 - seen["overflow"], seen


@pytest.mark.parametrize("decoupled", [True, False])
def test_float64_gradients_are_unscaled_by_grad_scalers_float32_inverse_as_torch(decoupled: bool):
    """torch's GradScaler unscales with ``inv_scale``, a float32 tensor (``float32(1/S)``), float64 gradients too;
    sofx multiplied float64 gradients by the double ``1/S``: with a scale that is no power of two (an init_scale of
    3, a growth factor of 1.5) a float64 run drifted from torch's (1e-9 after a few steps). Unclipped, the serial
    loop, the speculative loop (committing its speculative steps) and ``transforms.unscale`` equal torch.optim +
    GradScaler on float64 parameters bit for bit, and the float32 leaf beside them stays bitwise too."""
    gen = torch.Generator().manual_seed(3)
    init = {"w": torch.randn(7, 5, generator=gen, dtype=torch.float64), "b": torch.randn(5, generator=gen)}
    scaling = dict(init_scale=3.0, growth_factor=1.5, backoff_factor=0.3, growth_interval=2)
    tparams = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    topt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(tparams.values(), lr=1e-2, weight_decay=0.1,
                                                                  foreach=False)
    tscaler = torch.amp.GradScaler("cpu", **scaling)
    opt, rule = (sofx.adamw if decoupled else sofx.adam)(lr=1e-2, weight_decay=0.1), loss_scale.grad_scaler(**scaling)
    ser = spec_loop = sofx.serial.init_loop(opt, init, rule)
    unscale = sofx.transforms.unscale()
    scales = set()
    for step in range(6):
        S = rule.scale(ser.scaler_state)
        scales.add(S)
        grads = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) * S for k, v in init.items()}
        for k, p in tparams.items():
            p.grad = grads[k].clone()
        tscaler.scale(torch.ones(()))
        assert tscaler.get_scale() == S
        tscaler.unscale_(topt)
        unscaled, _ = unscale.update(grads, unscale.init(init), loss_scale=S)
        assert all(torch.equal(unscaled[k], p.grad) for k, p in tparams.items())
        tscaler.step(topt)
        tscaler.update()
        ser, facts = sofx.serial.serial_loop_step(opt, ser, grads, scaler=rule)
        spec_loop, report = sofx.speculate.speculative_loop_step(opt, spec_loop, grads, scaler=rule,
                                                                 config=sofx.speculate.SpeculationConfig())
        assert not facts.clipped and report.undone == 0 and report.committed == 2, report
        for k, p in tparams.items():
            assert torch.equal(ser.params[k], p.detach()), (step, k)
            assert torch.equal(spec_loop.params[k], p.detach()), (step, k)
    assert len(scales) >= 3 and all(math.frexp(s)[0] != 0.5 for s in scales)
