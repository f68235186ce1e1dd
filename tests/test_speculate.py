"""Speculation, row by row of SPECULATION.md's outcomes table, against the serial loop.

Each test runs one step on the same inputs through :func:`sofx.speculate.speculative_step`
and :func:`sofx.serial.serial_step` and checks the report and the result:
bitwise for blocks that were not undone and for every block without donation,
float32 rounding (relative 1e-6 of the tensor's largest value) for undone ones
with donation (an algebraic undo). The engine-style test drives the block
protocol by hand on flat 1-d blocks with donation, as the offload engine does.
"""

from __future__ import annotations

import copy
import math
import os
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import sofx
from sofx import AdamHParams, loss_scale, tree
from sofx import speculate as sp
from sofx.kernels.base import FINITE_CHUNK
from sofx.serial import serial_step

from helpers import script_prints_ok

S16 = 2.0 ** 16


def _params(gen: torch.Generator, n: int = 4, size: int = 6) -> list[torch.Tensor]:
    return [torch.randn(size, generator=gen) for _ in range(n)]


def _grads(gen: torch.Generator, n: int = 4, size: int = 6, scale: float = S16, mult=0.02) -> list[torch.Tensor]:
    mults = mult if isinstance(mult, (list, tuple)) else [mult] * n
    return [torch.randn(size, generator=gen) * m * scale for m in mults]


def _warm(opt, params, gen, steps: int = 2):
    """A few plain steps so that the moments are not zero."""
    state = opt.init(params)
    for _ in range(steps):
        grads = [(torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype) for p in params]
        params, state, _ = opt.update(params, grads, state)
    return params, state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _compare(spec, ser, actions=None, donated: bool = False):
    """Bitwise for blocks not undone, and for undone ones without donation (the undone block is its input, the
    redo a step from it); <= 1e-6 relative (of the tensor's largest value) for donated undone ones."""
    undone = [a in ("undo", "undo_redo") and donated for a in actions] if actions else [donated] * len(spec.params)
    for i, (p1, p2) in enumerate(zip(spec.params, ser.params)):
        pairs = [(p1, p2), (spec.state.mu[i], ser.state.mu[i]), (spec.state.nu[i], ser.state.nu[i])]
        assert int(spec.state.count[i]) == int(ser.state.count[i]), i
        for a, b in pairs:
            assert not (torch.isnan(a) & ~torch.isnan(b)).any(), f"block {i}: a nan the serial loop does not have"
            if undone[i]:
                assert _rel(a, b) <= 1e-6, (i, _rel(a, b))
            else:
                assert torch.equal(a, b), f"block {i} ({actions[i]}) is not bitwise equal to the serial loop"


def _both(opt, params, grads, state, *, config, scaler=None, sstate=None, hparams=None, **kw):
    scaler = scaler or loss_scale.grad_scaler()
    sstate = sstate if sstate is not None else scaler.init()
    spec = sp.speculative_step(opt, params, grads, state, config=config, scaler=scaler, scaler_state=sstate,
                               hparams=hparams, **kw)
    final_grads = list(grads)
    for i, extra in (kw.get("late_grads") or {}).items():
        final_grads[i] = final_grads[i] + extra
    ser = serial_step(opt, params, final_grads, state, scaler=scaler, scaler_state=sstate,
                      hparams=kw.get("validation_hparams", hparams), max_norm=config.max_norm,
                      profile=config.profile, missing_grad=config.missing_grad)
    assert spec.scaler_state == ser.scaler_state
    return spec, ser


def _snapshot(params, state) -> list[torch.Tensor]:
    """Copies of every tensor a step may write: params, moments, counts."""
    return [t.clone() for t in [*params, *state.mu, *state.nu, *state.count]]


def _unchanged(before: list[torch.Tensor], params, state) -> bool:
    """Bitwise the values of :func:`_snapshot` (dtypes included)."""
    after = [*params, *state.mu, *state.nu, *state.count]
    return len(after) == len(before) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(after, before))


def test_commit_when_nothing_changes(rng):
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    spec, ser = _both(opt, params, _grads(rng), state, config=sp.SpeculationConfig(max_norm=10.0))
    r = spec.report
    assert (r.speculated, r.committed, r.undone, r.redone, r.vetoed, r.stepped_late) == (4, 4, 0, 0, 0, 0)
    assert r.actions == ("commit",) * 4 and not r.clipped and not r.skipped
    _compare(spec, ser, r.actions)
    assert "spec 4 commit 4" in r.summary()


def test_clipping_undoes_and_redoes_and_early_veto_stops_speculation(rng):
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    # arrival order is 3, 2, 1, 0; blocks 3 and 2 are small, block 1 pushes the sum past (max_norm*S)^2
    grads = _grads(rng, mult=[5.0, 5.0, 0.01, 0.01])
    spec, ser = _both(opt, params, grads, state, config=sp.SpeculationConfig(max_norm=1.0))
    r = spec.report
    assert r.clipped and r.clip_coef < 1
    assert (r.speculated, r.undone, r.redone, r.vetoed, r.stepped_late) == (2, 2, 2, 2, 2)
    assert r.actions == ("step", "step", "undo_redo", "undo_redo")
    assert "clipping is certain from block 1" in r.veto_reason
    assert [a.reason for a in spec.plan.actions][2].startswith("clipping fired")
    _compare(spec, ser, r.actions)


def test_clipping_without_veto_when_certainty_comes_late(rng):
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    # each block alone is below max_norm; the veto never fires, but the total clips
    grads = [torch.full((6,), 0.3 * S16 / math.sqrt(6)) * (1 + 0.01 * torch.randn(6, generator=rng))
             for _ in range(4)]
    spec, ser = _both(opt, params, grads, state, config=sp.SpeculationConfig(max_norm=0.59))
    r = spec.report
    assert r.clipped and r.vetoed == 1 and r.speculated == 3 and r.redone == 3
    _compare(spec, ser, r.actions)


@pytest.mark.parametrize("undo", ["auto", "exact"])
def test_overflow_undoes_only_what_was_stepped_and_skips(rng, undo: str):
    opt = sofx.adamw(lr=1e-2, undo=undo)
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng)
    grads[1][2] = float("inf")  # block 1 arrives third: blocks 3 and 2 were speculated already
    spec, ser = _both(opt, params, grads, state, config=sp.SpeculationConfig(max_norm=1.0))
    r = spec.report
    assert r.skipped and r.overflow
    assert (r.speculated, r.undone, r.redone, r.vetoed, r.stepped_late) == (2, 2, 0, 2, 0)
    assert r.actions == ("skip", "skip", "undo", "undo")
    assert "non-finite" in r.veto_reason
    assert r.next_scale == S16 / 2
    assert [int(c) for c in spec.state.count] == [int(c) for c in state.count]  # counts do not advance
    if undo == "exact":
        for a, b in zip(spec.params, params):
            assert torch.equal(a, b)
    _compare(spec, ser, r.actions)


def test_scale_assumed_wrong_is_undone_and_redone(rng):
    opt = sofx.adam(lr=1e-2, weight_decay=0.01)
    params, state = _warm(opt, _params(rng), rng)
    spec, ser = _both(opt, params, _grads(rng), state, config=sp.SpeculationConfig(), backward_scale=S16 * 2)
    r = spec.report
    assert r.actions == ("undo_redo",) * 4 and not r.clipped
    assert "not the assumed" in spec.plan.actions[0].reason
    _compare(spec, ser, r.actions)


@pytest.mark.parametrize("predict", [True, False])
def test_deepspeed_scale_growth(rng, predict: bool):
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    rule = loss_scale.deepspeed_scaler(init_scale=S16, scale_window=1)  # every clean step grows the scale
    sstate = rule.update(rule.init(), False)  # (from the second iteration on)
    assert rule.scale(sstate) == S16
    spec, ser = _both(opt, params, _grads(rng), state, scaler=rule, sstate=sstate,
                      config=sp.SpeculationConfig(profile="deepspeed", predict_scale=predict))
    r = spec.report
    assert r.scale == 2 * S16
    assert r.actions == (("commit",) if predict else ("undo_redo",)) * 4
    _compare(spec, ser, r.actions)


def test_hparams_changed_between_speculation_and_validation(rng):
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    new_hp = [AdamHParams(), AdamHParams(lr=5e-3), AdamHParams(), AdamHParams(beta2=0.99)]
    spec, ser = _both(opt, params, _grads(rng), state, config=sp.SpeculationConfig(), hparams=AdamHParams(),
                      validation_hparams=new_hp)
    r = spec.report
    assert r.actions == ("commit", "undo_redo", "commit", "undo_redo")
    assert "hparams changed" in spec.plan.actions[1].reason
    _compare(spec, ser, r.actions)


@pytest.mark.parametrize("assumed, final", [(0.0, -0.0), (-0.0, 0.0)])
def test_an_lr_whose_zero_changed_sign_is_redone_as_the_serial_loop_steps(assumed, final):
    """An ``lr`` of ``0.0`` at speculation and ``-0.0`` at validation compare equal, but the step's
    zeros differ in sign (``p - 0.0*u`` and ``p - (-0.0)*u`` of ``p = -0.0``): the block is undone and redone, so
    that the result is the serial loop's bit for bit, sign of zero included."""
    opt = sofx.adamw(lr=1e-2, weight_decay=0.05, backend="reference")
    params = [torch.tensor([-0.0, 0.0, 1.0, -0.0])]
    grads = [torch.tensor([0.0, -0.0, 1.0, -0.0])]
    state = opt.init(params)
    spec, ser = _both(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=loss_scale.static_scale(),
                      hparams=AdamHParams(lr=assumed), validation_hparams=AdamHParams(lr=final))
    assert spec.report.actions == ("undo_redo",)
    for a, b in zip(spec.params + spec.state.mu + spec.state.nu, ser.params + ser.state.mu + ser.state.nu):
        assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b)), (a, b)


def test_an_hparam_tensor_changed_in_place_after_speculation_is_seen_as_a_change(rng):
    """A schedule that moves a tensor lr in place (``lr.fill_``) between speculation and validation: the
    speculative step was taken with the old value, so validation must undo and redo it with the new one."""
    opt = sofx.adamw(backend="cpu")
    p = torch.randn(100, generator=rng)
    g = torch.randn(100, generator=rng) * 0.01
    state = opt.init(p)
    rule = loss_scale.static_scale()
    lr = torch.tensor(1e-2)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1,
                               hparams=[AdamHParams(lr=lr)])
    tally, d = sp.on_block_ready(ctx, tally, 0, sp.grad_sumsq(g), lambda: sp.block_eligibility(
        opt, p, g, state, ctx.hparams[0], ctx.grad_scale))
    p1, s1, rec = sp.speculative_block_step(opt, p, g, state, d)
    lr.fill_(5e-2)
    plan = sp.plan_validation(ctx, tally, [sp.grad_sumsq(g)], hparams=[AdamHParams(lr=lr)])
    assert plan.actions[0].kind == "undo_redo"
    p2, _ = sp.apply_block_action(opt, plan.actions[0], p1, g, s1, rec)
    want = opt.update(p, g, state, AdamHParams(lr=5e-2))[0]
    assert _rel(p2, want) <= 1e-6


def test_late_second_gradient_is_summed_and_the_block_redone(rng):
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    late = {2: torch.randn(6, generator=rng) * 0.01 * S16}
    spec, ser = _both(opt, params, _grads(rng), state, config=sp.SpeculationConfig(), late_grads=late)
    r = spec.report
    assert r.actions == ("commit", "commit", "undo_redo", "commit")
    assert "late gradient" in spec.plan.actions[2].reason
    _compare(spec, ser, r.actions)


@pytest.mark.parametrize("missing", ["skip", "zero"])
def test_missing_gradient(rng, missing: str):
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng)
    grads[1] = None
    spec, ser = _both(opt, params, grads, state, config=sp.SpeculationConfig(missing_grad=missing))
    r = spec.report
    assert r.actions[1] == ("skip" if missing == "skip" else "step")
    assert r.committed == 3
    assert int(spec.state.count[1]) == int(state.count[1]) + (missing == "zero")
    if missing == "skip":
        assert spec.params[1] is params[1]
    _compare(spec, ser, r.actions)


@pytest.mark.parametrize("missing", ["skip", "zero"])
def test_a_step_without_any_gradient_is_not_counted_by_the_scaler(rng, missing: str):
    """Every gradient None: nothing is stepped (``missing_grad="skip"``) and the loss scaler does not count the
    step (GradScaler refuses one without gradients), in both loops; with zeros filled in it is a step."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    scaler = loss_scale.grad_scaler(init_scale=S16, growth_interval=1)
    sstate = scaler.init()
    spec, ser = _both(opt, params, [None] * len(params), state, scaler=scaler, sstate=sstate,
                      config=sp.SpeculationConfig(missing_grad=missing))
    grown = scaler.scale(ser.scaler_state) > scaler.scale(sstate)
    assert grown == (missing == "zero")
    # the facts' next scale is the kept state's (the serial loop's was the scale of the update it dropped)
    assert ser.facts.next_scale == spec.report.next_scale == scaler.scale(ser.scaler_state)
    assert spec.report.actions == (("skip",) if missing == "skip" else ("step",)) * len(params)
    _compare(spec, ser, spec.report.actions)


def test_earlier_micro_steps_do_not_speculate(rng):
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    spec, ser = _both(opt, params, _grads(rng), state, config=sp.SpeculationConfig(), last_micro_step=False)
    r = spec.report
    assert r.speculated == 0 and r.stepped_late == 4 and not r.speculating
    assert "micro-step" in spec.plan.actions[0].reason
    _compare(spec, ser, r.actions)


def test_ineligible_blocks_are_stepped_late(rng):
    # beta1 == 0: only a snapshot can undo; with no snapshot budget the blocks are not speculated
    opt = sofx.adamw(lr=1e-2, betas=(0.0, 0.999))
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng)
    spec, ser = _both(opt, params, grads, state, config=sp.SpeculationConfig(snapshot_budget_bytes=0))
    r = spec.report
    assert r.speculated == 0 and r.ineligible == 4 and r.stepped_late == 4
    assert "budget" in spec.plan.actions[0].reason and "beta of 0" in spec.plan.actions[0].reason
    _compare(spec, ser, r.actions)
    # a budget for two blocks' snapshots (p, m, v in float32): two speculated, exact undo on clipping
    budget = 2 * 3 * 6 * 4
    grads = _grads(rng, mult=5.0)
    spec, ser = _both(opt, params, grads, state, config=sp.SpeculationConfig(snapshot_budget_bytes=budget,
                                                                           max_norm=1e9))
    assert spec.report.speculated == 2 and spec.report.ineligible == 2


def test_block_eligibility_reports_refusal_and_snapshot_cost(rng):
    p, g = torch.randn(6, generator=rng), torch.randn(6, generator=rng)
    strict = sofx.adamw(betas=(0.0, 0.999), undo="algebraic")
    el = sp.block_eligibility(strict, p, g, strict.init(p), AdamHParams(), 1.0)
    assert not el.eligible and "impossible" in el.reason
    auto = sofx.adamw(betas=(0.0, 0.999))
    el = sp.block_eligibility(auto, p, g, auto.init(p), AdamHParams(), 1.0)
    assert el.eligible and el.strategy == "snapshot" and el.snapshot_bytes == 3 * 6 * 4
    plain = sofx.adamw()
    el = sp.block_eligibility(plain, p, g, plain.init(p), AdamHParams(), 1.0)
    assert el == sp.Eligibility(True, "algebraic", "", 0)
    with pytest.raises(sofx.LeafError, match="shape"):
        sp.block_eligibility(plain, p, torch.randn(5), plain.init(p), AdamHParams(), 1.0)


def test_combine_eligibilities_ranks_every_strategy_and_refuses_one_of_no_undo_record():
    """A tree block's Eligibility names its costliest leaf's strategy: "chunk_snapshot" was missing from the ranking
    and counted as "algebraic" (the block's strategy then depended on its leaves' order), an unknown string was
    taken and hidden the same way, and eligible leaves all of strategy None (a step that cannot be undone) came back
    as None, which the offload engine took for an eligible "algebraic" block. Every strategy of an undo record is
    ranked; an eligible leaf's strategy that is none of them is refused, naming the leaf."""
    from sofx.speculation.apply import combine_eligibilities

    alg, chunk = sp.Eligibility(True, "algebraic", "", 0), sp.Eligibility(True, "chunk_snapshot", "", 0)
    param, snap = sp.Eligibility(True, "param_snapshot", "", 8), sp.Eligibility(True, "snapshot", "", 24)
    assert combine_eligibilities([chunk, alg]).strategy == combine_eligibilities([alg, chunk]).strategy \
        == "chunk_snapshot"
    assert combine_eligibilities([param, chunk]).strategy == combine_eligibilities([chunk, param]).strategy \
        == "param_snapshot"
    assert combine_eligibilities([alg, snap, param]) == sp.Eligibility(True, "snapshot", "", 32)
    assert combine_eligibilities([]) is None
    for bad in (None, "none", "snapshots", 2):
        with pytest.raises(sofx.SofxError, match=rf"^combine_eligibilities: leaf 1: an eligible leaf's strategy = "
                                                 rf"{re.escape(repr(bad))} is none of \('algebraic', "):
            combine_eligibilities([alg, sp.Eligibility(True, bad, "", 0)])
    refused = sp.Eligibility(False, "none", "cannot be undone", 0)
    assert combine_eligibilities([alg, refused, sp.Eligibility(True, None, "", 0)]) is refused


def test_bf16_states_use_snapshots_and_redo_bitwise(rng):
    opt = sofx.adamw(lr=1e-2, state_dtype=torch.bfloat16)
    params, state = _warm(opt, _params(rng), rng)
    spec, ser = _both(opt, params, _grads(rng, mult=5.0), state, config=sp.SpeculationConfig(max_norm=1e6),
                      backward_scale=S16 / 2)
    assert spec.report.redone == 4
    for a, b in zip(spec.params, ser.params):
        assert torch.equal(a, b)  # snapshot undo is exact, so undo+redo is the serial step


@pytest.mark.parametrize("paused", [False, True])
def test_an_overflow_step_leaves_the_policy_as_it_was(rng, paused: bool):
    """A skipped step carries no clip information (policy.py): an overflow neither counts as a quiet step
    towards resuming nor as an unclipped one in the window."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    policy = sp.AdaptivePolicy(window=4, pause_fraction=0.5, quiet_steps=1)
    pstate = (sp.PolicyState((True, True, True), True, 0, "paused") if paused
              else sp.PolicyState((True, True), False, 0, ""))
    grads = _grads(rng)
    grads[0][1] = float("inf")
    spec = sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(max_norm=1.0, policy=policy),
                               scaler=loss_scale.grad_scaler(), scaler_state=loss_scale.grad_scaler().init(),
                               policy_state=pstate)
    assert spec.report.overflow
    assert spec.policy_state == pstate
    assert spec.report.policy_paused == paused


def test_adaptive_policy_pauses_while_clipping_and_resumes(rng):
    opt = sofx.adamw(lr=1e-3)
    params, state = _warm(opt, _params(rng), rng)
    cfg = sp.SpeculationConfig(max_norm=1.0, policy=sp.AdaptivePolicy(window=4, pause_fraction=0.5,
                                                                       quiet_steps=2))
    rule = loss_scale.grad_scaler()
    sstate, pstate = rule.init(), None
    reports = []
    for mult in [3.0, 3.0, 3.0, 3.0, 3.0, 0.001, 0.001, 0.001]:
        grads = _grads(rng, mult=[mult, 0.001, 0.001, 0.001])  # block 0 arrives last: no early veto
        res = sp.speculative_step(opt, params, grads, state, config=cfg, scaler=rule, scaler_state=sstate,
                                  policy_state=pstate)
        params, state, sstate, pstate = res.params, res.state, res.scaler_state, res.policy_state
        reports.append(res.report)
    assert [r.speculating for r in reports] == [True, True, True, False, False, False, False, True]
    assert [r.policy_paused for r in reports] == [False, False, True, True, True, True, False, False]
    assert "clipping fired on 3 of the last 3 steps" in reports[2].policy_reason
    assert reports[3].speculated == 0 and reports[3].stepped_late == 4
    assert "paused" in reports[3].policy_reason
    assert reports[6].policy_reason.startswith("resumed")
    assert reports[7].committed == 4


def test_min_loss_scale_error_undoes_every_speculative_step(rng):
    opt = sofx.adamw(lr=1e-2, undo="exact")
    params, state = _warm(opt, _params(rng), rng)
    rule = loss_scale.deepspeed_scaler(init_scale=1.0, hysteresis=1)
    grads = _grads(rng, scale=1.0)
    grads[0][0] = float("nan")
    with pytest.raises(loss_scale.MinLossScaleError):
        sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(profile="deepspeed"),
                            scaler=rule, scaler_state=rule.init(), donate=True)
    for i in range(4):  # donated buffers are back to their values before the step
        assert int(state.count[i]) == 2


class _BrokenUpdate:
    """grad_scaler's rule whose update raises a ValueError (a custom rule's bug)."""

    def __init__(self) -> None:
        self.rule = loss_scale.grad_scaler(init_scale=1.0)

    def init(self):
        return self.rule.init()

    def scale(self, state):
        return self.rule.scale(state)

    def update(self, state, overflow):
        raise ValueError("the rule broke")


@pytest.mark.parametrize("profile", ["torch", "deepspeed"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_loss_scale_rule_that_raises_leaves_both_loops_state_as_it_was(rng, donate, profile):
    """A custom rule whose update raises at validation: both loops raise a LossScaleRuleError naming the rule's
    failure (its exception the cause; the bare ValueError before), and change nothing: the speculative step's
    blocks written in place (donate=True) are undone (bitwise with undo='exact'), as serial_step, which asks the rule
    before it steps, writes none. Under "deepspeed" (predict_scale) begin_step asks the rule's update for the scale
    to speculate with, before any block: its ValueError escaped there as it was; now no block is speculated, and
    validation raises as the serial loop."""
    from sofx.serial import init_loop, serial_loop_step

    opt = sofx.adamw(lr=1e-2, undo="exact")
    params, state = _warm(opt, _params(rng), rng)
    rule = _BrokenUpdate()
    grads = _grads(rng, scale=1.0)
    before = [t.clone() for t in (*params, *state.mu, *state.nu)]
    match = (r"the loss-scale rule's update\(\) \(_BrokenUpdate\) raised ValueError: the rule broke; the step is "
             r"not taken")
    with pytest.raises(loss_scale.LossScaleRuleError, match=match) as info:
        sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(profile=profile), scaler=rule,
                            scaler_state=rule.init(), donate=donate)
    assert isinstance(info.value.__cause__, ValueError)
    assert all(torch.equal(a, b) for a, b in zip((*params, *state.mu, *state.nu), before))
    assert [int(c) for c in state.count] == [2] * 4
    loop = init_loop(opt, params, rule)._replace(opt_state=state)
    with pytest.raises(loss_scale.LossScaleRuleError, match=match):
        serial_loop_step(opt, loop, grads, scaler=rule, donate=donate, profile=profile)
    assert all(torch.equal(a, b) for a, b in zip((*params, *state.mu, *state.nu), before))
    assert [int(c) for c in state.count] == [2] * 4


def test_the_report_of_a_step_whose_rule_failed_says_overflow_only_where_a_gradient_overflowed():
    """A validation whose loss-scale rule raised (the step not taken, plan.error a LossScaleRuleError) reported
    overflow=True on a clean step too; the report's overflow is whether the gradients overflowed (a sum of squares
    that is not finite), skipped True either way."""
    opt = sofx.adamw(lr=1e-2)
    rule = _BrokenUpdate()
    for sumsq, overflow in ((1.0, False), (math.inf, True)):
        ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1)
        plan = sp.plan_validation(ctx, tally, [sumsq])
        assert isinstance(plan.error, loss_scale.LossScaleRuleError)
        assert plan.report.skipped and plan.report.overflow is overflow


class _CleanUpdateBroken(_BrokenUpdate):
    """A rule whose update raises on a clean step only (an overflow backs the scale off)."""

    def update(self, state, overflow):
        if not overflow:
            raise ValueError("the rule broke")
        return self.rule.update(state, overflow)


def test_a_deepspeed_step_whose_rule_cannot_predict_the_clean_scale_follows_the_serial_loop(rng):
    """predict_scale asks the rule's update(state, False) in begin_step: a rule failing there raised its ValueError
    out of begin_step, also on a step that overflows, which the serial loop skips without a clean update. Now the
    step speculates no block (vetoed, saying why) and follows the serial loop: skipped on overflow, a
    LossScaleRuleError on a clean step."""
    from sofx.serial import init_loop, serial_loop_step

    opt = sofx.adamw(lr=1e-2)
    rule = _CleanUpdateBroken()
    config = sp.SpeculationConfig(profile="deepspeed")
    loop = init_loop(opt, _params(rng), rule)
    grads = _grads(rng, scale=1.0)
    grads[1][2] = float("inf")
    ser, facts = serial_loop_step(opt, loop, grads, scaler=rule, profile="deepspeed")
    spec, report = sp.speculative_loop_step(opt, loop, grads, config=config, scaler=rule, donate=True)
    assert facts.skipped and report.skipped and spec.scaler_state == ser.scaler_state and spec.step == ser.step == 0
    assert report.speculated == 0 and not report.speculating
    assert re.search(r"the scale of a clean step cannot be predicted: the loss-scale rule's update\(\) "
                     r"\(_CleanUpdateBroken\) raised ValueError", report.not_speculating_reason)
    assert all(torch.equal(a, b) for a, b in zip(spec.params, ser.params))
    for step in (lambda: serial_loop_step(opt, loop, _grads(rng, scale=1.0), scaler=rule, profile="deepspeed"),
                 lambda: sp.speculative_loop_step(opt, loop, _grads(rng, scale=1.0), config=config, scaler=rule)):
        with pytest.raises(loss_scale.LossScaleRuleError, match=r"update\(\) \(_CleanUpdateBroken\) raised"):
            step()


class _NoneUpdate(_BrokenUpdate):
    """A rule whose update returns None (a custom rule's forgotten return)."""

    def update(self, state, overflow):
        return None


@pytest.mark.parametrize("profile", ["torch", "deepspeed"])
def test_a_loss_scale_rule_whose_update_returns_no_state_is_refused_at_that_step(rng, profile):
    """A rule whose update returns None: its state was read first by the step's report (a scale() that checks it
    raised there, past validation, where the offload engine undid nothing; one that does not committed None and the
    next backward failed). It is refused where update returned it, saying so, and the step undone."""
    opt = sofx.adamw(lr=1e-2, undo="exact")
    params, state = _warm(opt, _params(rng), rng)
    rule = _NoneUpdate()
    before = [t.clone() for t in (*params, *state.mu, *state.nu)]
    with pytest.raises(loss_scale.LossScaleRuleError, match=r"the loss-scale rule's update\(\) \(_NoneUpdate\) "
                                                            r"returned a state that cannot be taken: scaler_state is "
                                                            r"a NoneType"):
        sp.speculative_step(opt, params, _grads(rng, scale=1.0), state, config=sp.SpeculationConfig(profile=profile),
                            scaler=rule, scaler_state=rule.init(), donate=True)
    assert all(torch.equal(a, b) for a, b in zip((*params, *state.mu, *state.nu), before))


@pytest.mark.parametrize("undo", ["exact", "auto"])
def test_a_failing_reduce_sumsq_leaves_the_state_as_it_was(rng, undo):
    """The all-reduce of the sum of squares fails (a timeout, another rank gone) or returns something that is not
    a number, or a negative one (a math domain error before): the call raises, and with donation the speculative
    steps already written in place are undone (bitwise with snapshots, to a few ulps algebraically), as
    serial_step changes nothing. Before, they stayed: moved parameters and moments under unchanged step counts,
    which a retry would step again."""
    from sofx.errors import HParamError
    from sofx.serial import serial_loop_step

    opt = sofx.adamw(lr=1e-2, undo=undo)
    params, state = _warm(opt, _params(rng), rng)
    rule = loss_scale.grad_scaler(init_scale=1.0)

    def timed_out(total):
        raise RuntimeError("all_reduce timed out")

    for reduce, error in ((timed_out, RuntimeError), (lambda total: None, HParamError),
                          (lambda total: -1.0, HParamError)):
        before = [t.clone() for t in (*params, *state.mu, *state.nu)]
        with pytest.raises(error):
            sp.speculative_step(opt, params, _grads(rng, scale=1.0), state, config=sp.SpeculationConfig(),
                                scaler=rule, scaler_state=rule.init(), reduce_sumsq=reduce, donate=True)
        after = (*params, *state.mu, *state.nu)
        for a, b in zip(after, before):
            assert torch.equal(a, b) if undo == "exact" else (a - b).abs().max() <= 1e-6 * b.abs().max()
        assert [int(c) for c in state.count] == [2] * 4
        loop = sofx.serial.init_loop(opt, params, rule)
        with pytest.raises(error):
            serial_loop_step(opt, loop, _grads(rng, scale=1.0), scaler=rule, reduce_sumsq=reduce, donate=True)


def test_a_reduce_sumsq_that_loses_this_ranks_overflow_is_refused(rng):
    """This rank's gradients hold an inf (its sum of squares is inf) but the hook returns a finite total (a MAX or
    nansum reduction, a hook that ignores its argument): the step was taken as a clean one, writing nan into the
    parameters. Refused (an HParamError naming both sums), nothing changed, serial and speculative alike; a
    non-finite total from a finite local sum is another rank's overflow, as before."""
    from sofx.errors import HParamError
    from sofx.serial import serial_loop_step

    opt = sofx.adamw(lr=1e-2, undo="exact")  # (the blocks speculated before the reduction undone bitwise)
    params, state = _warm(opt, _params(rng), rng)
    rule = loss_scale.grad_scaler(init_scale=1.0)
    grads = _grads(rng, scale=1.0)
    grads[1][0] = math.inf
    before = [t.clone() for t in (*params, *state.mu, *state.nu)]
    with pytest.raises(HParamError, match=r"reduce_sumsq returned 1\.0 where this rank's sum of squares is inf"):
        sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=rule,
                            scaler_state=rule.init(), reduce_sumsq=lambda total: 1.0, donate=True)
    assert all(torch.equal(a, b) for a, b in zip((*params, *state.mu, *state.nu), before))
    loop = sofx.serial.init_loop(opt, params, rule)
    with pytest.raises(HParamError, match="where this rank's sum of squares is inf"):
        serial_loop_step(opt, loop, grads, scaler=rule, reduce_sumsq=lambda total: 1.0, donate=True)
    assert all(torch.equal(a, b) for a, b in zip((*params, *state.mu, *state.nu), before))


@pytest.mark.parametrize("order", [None, [1, 2, 0]])
def test_a_leaf_its_backend_cannot_step_is_refused_before_any_block_is_stepped(rng, order):
    """backend='cpu' steps no float64 leaf: the speculative step refused it only when it reached its block,
    after stepping (and, with donation, undoing to a few ulps) the blocks before it, and named no leaf. Now
    check_inputs chooses every leaf's backend first: refused naming the leaf, nothing written."""
    opt = sofx.adamw(lr=1e-2, backend="cpu")
    warm = sofx.adamw(lr=1e-2)
    params, state = _warm(warm, [torch.randn(3, dtype=torch.float64), *_params(rng, 2)], rng)
    grads = [torch.randn(3, dtype=torch.float64), *_grads(rng, 2, scale=1.0)]
    rule = loss_scale.static_scale()
    before = [t.clone() for t in (*params, *state.mu, *state.nu)]
    with pytest.raises(sofx.UnsupportedError, match=r"params\[0\]: backend 'cpu' does not support"):
        sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=rule,
                            scaler_state=rule.init(), donate=True, order=order)
    assert all(torch.equal(a, b) for a, b in zip((*params, *state.mu, *state.nu), before))
    with pytest.raises(sofx.UnsupportedError, match=r"params\[0\]: backend 'cpu'"):  # also a zero-filled leaf
        opt.check_inputs(params, [None, *grads[1:]], state, zero_missing=True)


@pytest.mark.parametrize("scale", [-1.0, math.nan, math.inf])
def test_an_invalid_loss_scale_is_refused_by_both_loops(rng, scale):
    """A scaler state whose scale is negative, nan or inf: both loops raise the same HParamError (the serial one
    took every step as an overflow and skipped it forever)."""
    from sofx.errors import HParamError
    from sofx.serial import init_loop, serial_loop_step

    opt = sofx.adamw(lr=1e-2)
    rule = loss_scale.grad_scaler()
    loop = init_loop(opt, _params(rng), rule)._replace(scaler_state=loss_scale.GradScalerState(scale, 0))
    for step in (lambda: serial_loop_step(opt, loop, _grads(rng), scaler=rule),
                 lambda: sp.speculative_loop_step(opt, loop, _grads(rng), config=sp.SpeculationConfig(), scaler=rule)):
        with pytest.raises(HParamError, match=r"scaler.scale\(scaler_state\) = .* is invalid"):
            step()


def test_states_of_another_kind_are_refused_by_both_loops(rng):
    """A scaler state that is not the scaler's kind (a plain tuple, another scaler's state) or a policy state that
    is not the policy's: an HParamError saying what was expected (an AttributeError before)."""
    from sofx.errors import HParamError
    from sofx.serial import init_loop, serial_loop_step

    opt = sofx.adamw(lr=1e-2)
    rule = loss_scale.grad_scaler()
    loop = init_loop(opt, _params(rng), rule)
    for state in ((65536.0, 0), loss_scale.deepspeed_scaler().init()):
        bad = loop._replace(scaler_state=state)
        for step in (lambda: serial_loop_step(opt, bad, _grads(rng), scaler=rule),
                     lambda: sp.speculative_loop_step(opt, bad, _grads(rng), config=sp.SpeculationConfig(),
                                                      scaler=rule)):
            with pytest.raises(HParamError, match=r"scaler_state is a \w+; this scaler's state is a GradScalerState"):
                step()
    with pytest.raises(HParamError, match=r"policy_state is a tuple; the policy's state is a"):
        sp.speculative_loop_step(opt, loop._replace(policy_state=(1, 2)), _grads(rng), config=sp.SpeculationConfig(),
                                 scaler=rule)


@pytest.mark.parametrize("bad, field", [
    (sp.PolicyState(paused="no"), r"policy_state.paused = 'no'"),
    (sp.PolicyState(recent=(True, 2, False)), r"policy_state.recent\[1\] = 2"),
    (sp.PolicyState(recent=None), r"policy_state.recent = None"),
    (sp.PolicyState(paused=True, quiet=-1), r"policy_state.quiet = -1"),
    (sp.PolicyState(reason=5), r"policy_state.reason = 5"),
])
def test_a_policy_state_with_fields_the_policy_cannot_read_is_refused_naming_the_field(rng, bad, field):
    """A PolicyState made by hand with fields of other kinds was taken as it was (paused="no" as paused, a recent
    entry 2 as two clipped steps), or raised Python's bare TypeError from the validation after the speculative
    steps (recent=None); now an HParamError naming the field, before any block is stepped (the donated inputs
    unchanged). A list of Python or numpy bools is taken as its tuple."""
    from sofx.errors import HParamError

    opt = sofx.adamw(lr=1e-2)
    rule = loss_scale.grad_scaler()
    params, grads = _params(rng), _grads(rng)
    state = opt.init(params)
    before = [p.clone() for p in params]
    with pytest.raises(HParamError, match=field):
        sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(max_norm=1.0), scaler=rule,
                            scaler_state=rule.init(), policy_state=bad, donate=True)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(int(c) == 0 for c in state.count)
    ctx, _ = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(),
                           sp.PolicyState(recent=[True, np.bool_(False)]), n_blocks=2)
    assert ctx.policy_state.recent == (True, False) and type(ctx.policy_state.recent[1]) is bool


class _RecordingHook:
    """A reduce_sumsq hook with ``refuse``, as all_reduce_sumsq's: records what the loop told it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, local: float) -> float:
        self.calls.append("reduce")
        return local

    def refuse(self, error: BaseException | None = None) -> None:
        self.calls.append(f"refuse: {error}")


def _argument_refusal_setup(rng: torch.Generator, undo: str) -> tuple:
    """What the tests of refused step arguments call the steps with: ``(opt, rule, params, state, loop, grads,
    before, scheduled, schedule)``: an AdamW (``undo``), a GradScaler rule, params, their fresh state and loop
    state, gradients, a copy of the params (nothing may be written) and a schedule that records in ``scheduled``
    each step it was evaluated at (nothing may run)."""
    from sofx.serial import init_loop

    opt = sofx.adamw(lr=1e-2, undo=undo)
    rule = loss_scale.grad_scaler()
    params = _params(rng)
    state = opt.init(params)
    loop = init_loop(opt, params, rule)
    grads = _grads(rng)
    scheduled: list[int] = []

    def schedule(step: int) -> AdamHParams:
        scheduled.append(step)
        return AdamHParams(lr=1e-2)

    return opt, rule, params, state, loop, grads, [t.clone() for t in params], scheduled, schedule


def test_an_unknown_keyword_is_refused_by_both_loops_before_anything_runs(rng):
    """A misspelt keyword (max_nrom=), or one the loop takes from its LoopState (scaler_state=): serial_loop_step
    raised Python's TypeError at the call, speculative_loop_step one from speculative_step, after the schedule
    ran; neither told the reduction hook, so on the other ranks all_reduce_sumsq waited for this rank forever.
    Now both raise naming the keyword and those they take, before the schedule runs, and tell the hook."""
    from sofx.serial import serial_loop_step

    opt, rule, params, _, loop, grads, before, scheduled, schedule = _argument_refusal_setup(rng, "auto")

    serial_takes = "scaler, hparams, max_norm, profile, missing_grad, reduce_sumsq, donate"
    spec_takes = ("config, scaler, hparams, validation_hparams, backward_scale, order, late_grads, last_micro_step, "
                  "reduce_sumsq, donate")
    for what, takes, step in (
            ("serial_loop_step", serial_takes, lambda hook, kw: serial_loop_step(
                opt, loop, grads, scaler=rule, hparams=schedule, reduce_sumsq=hook, **kw)),
            ("speculative_loop_step", spec_takes, lambda hook, kw: sp.speculative_loop_step(
                opt, loop, grads, config=sp.SpeculationConfig(), scaler=rule, hparams=schedule, reduce_sumsq=hook,
                **kw))):
        for kw, words in (({"max_nrom": 1.0}, f"unknown keyword argument 'max_nrom'; it takes {takes}"),
                          ({"scaler_state": loop.scaler_state, "donat": True},
                           f"unknown keyword arguments 'donat', 'scaler_state'; it takes {takes} (scaler_state is "
                           "loop.scaler_state: pass the loop with it replaced)")):
            hook = _RecordingHook()
            with pytest.raises(sofx.SofxError) as info:
                step(hook, kw)
            assert str(info.value) == f"{what}: {words}"
            assert hook.calls == [f"refuse: {what}: {words}"], hook.calls
    assert scheduled == []
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_an_unknown_keyword_is_refused_by_the_steps_before_anything_runs(rng):
    """A misspelt keyword (max_nrom=) to serial_step, speculative_step (donating) or plan_validation: before,
    Python's TypeError at the call, which did not tell the reduction hook (the other ranks waited for this
    rank's sum forever). Now each raises a SofxError naming the keyword and those it takes, tells the hook, and
    writes nothing; a keyword its loop step takes from the LoopState is not named as the loop's there."""
    opt = sofx.adamw(lr=1e-2, undo="exact")
    rule = loss_scale.grad_scaler()
    params = _params(rng)
    state = opt.init(params)
    grads = _grads(rng)
    before = [t.clone() for t in params]
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=len(params))
    for what, takes, step in (
            ("serial_step", "scaler, scaler_state, hparams, max_norm, profile, missing_grad, reduce_sumsq, donate",
             lambda hook, kw: serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init(),
                                          reduce_sumsq=hook, donate=True, **kw)),
            ("speculative_step", "config, scaler, scaler_state, policy_state, hparams, validation_hparams, "
                                 "backward_scale, order, late_grads, last_micro_step, reduce_sumsq, donate",
             lambda hook, kw: sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(),
                                                  scaler=rule, scaler_state=rule.init(), reduce_sumsq=hook,
                                                  donate=True, **kw)),
            ("plan_validation", "hparams, taken, reduce_sumsq, stepped",
             lambda hook, kw: sp.plan_validation(ctx, tally, [1.0] * len(params), reduce_sumsq=hook, **kw))):
        other = {"loop": None, "policy_state": None} if what == "serial_step" else {"loop": None}
        for kw, words in (({"max_nrom": 1.0}, "argument 'max_nrom'"),
                          (other, f"argument{'s' if len(other) > 1 else ''} {', '.join(map(repr, sorted(other)))}")):
            hook = _RecordingHook()
            with pytest.raises(sofx.SofxError) as info:
                step(hook, kw)
            assert str(info.value) == f"{what}: unknown keyword {words}; it takes {takes}"
            assert hook.calls == [f"refuse: {info.value}"], hook.calls
            assert all(torch.equal(a, b) for a, b in zip(params, before))
            assert all(not m.any() for m in state.mu)


def test_a_missing_required_keyword_is_refused_naming_the_misspelt_one_before_anything_runs(rng):
    """A required keyword misspelt (scalr=, scaler_sate=, confg=) or left out, to either loop step or either step:
    before, Python's "missing required keyword-only argument" TypeError at the call, before any code ran, so the
    reduction hook was never told and the other ranks waited for this rank's sum forever. Now each raises a
    SofxError naming the missing keyword and the misspelt one that was given in its place, after telling the hook
    (also one passed under a misspelt keyword), and runs nothing: no schedule, no write."""
    from sofx.serial import serial_loop_step

    opt, rule, params, state, loop, grads, before, scheduled, schedule = _argument_refusal_setup(rng, "exact")

    cfg = sp.SpeculationConfig()
    serial_takes = "scaler, hparams, max_norm, profile, missing_grad, reduce_sumsq, donate"
    spec_loop_takes = ("config, scaler, hparams, validation_hparams, backward_scale, order, late_grads, "
                       "last_micro_step, reduce_sumsq, donate")
    step_takes = "scaler, scaler_state, hparams, max_norm, profile, missing_grad, reduce_sumsq, donate"
    spec_takes = ("config, scaler, scaler_state, policy_state, hparams, validation_hparams, backward_scale, order, "
                  "late_grads, last_micro_step, reduce_sumsq, donate")
    calls = {
        "serial_loop_step": (serial_takes, lambda kw: serial_loop_step(opt, loop, grads, hparams=schedule,
                                                                       donate=True, **kw)),
        "speculative_loop_step": (spec_loop_takes, lambda kw: sp.speculative_loop_step(
            opt, loop, grads, hparams=schedule, donate=True, **kw)),
        "serial_step": (step_takes, lambda kw: serial_step(opt, params, grads, state, donate=True, **kw)),
        "speculative_step": (spec_takes, lambda kw: sp.speculative_step(opt, params, grads, state, donate=True,
                                                                        **kw)),
    }
    cases = {
        "serial_loop_step": [({"scalr": rule}, "argument 'scaler' (scalr= given, did you mean scaler=?)"),
                             ({}, "argument 'scaler'")],
        "speculative_loop_step": [({"confg": cfg, "scaler": rule},
                                   "argument 'config' (confg= given, did you mean config=?)"),
                                  ({"confg": cfg, "scalr": rule, "max_nrom": 1.0},
                                   "arguments 'config', 'scaler' (confg= given, did you mean config=?; scalr= given, "
                                   "did you mean scaler=?); unknown keyword argument 'max_nrom'")],
        "serial_step": [({"scaler": rule, "scaler_sate": rule.init()},
                         "argument 'scaler_state' (scaler_sate= given, did you mean scaler_state=?)"),
                        ({"scalr": rule}, "arguments 'scaler', 'scaler_state' (scalr= given, did you mean "
                                          "scaler=?)")],
        "speculative_step": [({"config": cfg, "scaler": rule, "scaler_sate": rule.init()},
                              "argument 'scaler_state' (scaler_sate= given, did you mean scaler_state=?)"),
                             ({"confg": cfg, "scaler": rule, "scaler_state": rule.init()},
                              "argument 'config' (confg= given, did you mean config=?)")],
    }
    for what, (takes, step) in calls.items():
        for kw, words in cases[what]:
            for under in ("reduce_sumsq", "reduce_sumq"):
                hook = _RecordingHook()
                with pytest.raises(sofx.SofxError) as info:
                    step({**kw, under: hook})
                msg = str(info.value)
                if under == "reduce_sumsq":
                    assert msg == f"{what}: missing required keyword {words}; it takes {takes}", msg
                else:
                    assert msg.startswith(f"{what}: missing required keyword argument"), msg
                    assert msg.endswith(" (reduce_sumq is a reduce_sumsq hook: pass it as reduce_sumsq=)"), msg
                assert hook.calls == [f"refuse: {msg}"], hook.calls
    assert scheduled == []
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(not m.any() for m in state.mu)


def test_a_misspelt_or_extra_positional_argument_is_refused_through_the_hook_before_anything_runs(rng):
    """A positional argument given under a misspelt keyword (stat=, lop=, sumsqs=) or one positional argument
    too many, to either step, either loop step or plan_validation: before, Python's TypeError at the call, before
    any code ran, so the reduction hook was never told and the other ranks waited for this rank's sum forever.
    Now each raises a SofxError naming the missing argument (and the misspelt keyword given in its place) or the
    extra one, and what it takes, after telling the hook (also one given as the extra positional argument), and
    runs nothing: no schedule, no write."""
    from sofx.serial import serial_loop_step

    opt, rule, params, state, loop, grads, before, scheduled, schedule = _argument_refusal_setup(rng, "exact")

    cfg = sp.SpeculationConfig()
    ctx, tally = sp.begin_step(opt, cfg, rule, rule.init(), n_blocks=len(params))
    takes = {"serial_step": "opt, params, grads, state, then only the keywords scaler, scaler_state, hparams, "
                            "max_norm, profile, missing_grad, reduce_sumsq, donate",
             "serial_loop_step": "opt, loop, grads, then only the keywords scaler, hparams, max_norm, profile, "
                                 "missing_grad, reduce_sumsq, donate",
             "speculative_step": "opt, params, grads, state, then only the keywords config, scaler, scaler_state, "
                                 "policy_state, hparams, validation_hparams, backward_scale, order, late_grads, "
                                 "last_micro_step, reduce_sumsq, donate",
             "speculative_loop_step": "opt, loop, grads, then only the keywords config, scaler, hparams, "
                                      "validation_hparams, backward_scale, order, late_grads, last_micro_step, "
                                      "reduce_sumsq, donate",
             "plan_validation": "ctx, tally, sumsq, then only the keywords hparams, taken, reduce_sumsq, stepped"}
    serial = {"scaler": rule, "scaler_state": rule.init(), "donate": True}
    spec = {**serial, "config": cfg}
    loop_kw = {"scaler": rule, "hparams": schedule, "donate": True}
    misspelt = {  # what -> (the call, given the hook's keywords and the misspelt argument, its words)
        "serial_step": (lambda kw: serial_step(opt, params, grads, **serial, **kw), "state", "stat", state),
        "serial_loop_step": (lambda kw: serial_loop_step(opt, grads=grads, **loop_kw, **kw), "loop", "lop", loop),
        "speculative_step": (lambda kw: sp.speculative_step(opt, params, grads, **spec, **kw), "state", "stat",
                             state),
        "speculative_loop_step": (lambda kw: sp.speculative_loop_step(opt, grads=grads, config=cfg, **loop_kw, **kw),
                                  "loop", "lop", loop),
        "plan_validation": (lambda kw: sp.plan_validation(ctx, tally, **kw), "sumsq", "sumsqs", [1.0] * 4)}
    for what, (call, name, wrong, value) in misspelt.items():
        hook = _RecordingHook()
        with pytest.raises(sofx.SofxError) as info:
            call({wrong: value, "reduce_sumsq": hook})
        assert str(info.value) == (f"{what}: missing required argument '{name}' ({wrong}= given, did you mean "
                                   f"{name}=?); it takes {takes[what]}"), str(info.value)
        assert hook.calls == [f"refuse: {info.value}"], hook.calls
    too_many = {  # what -> the call with one positional argument too many (extra), given the hook's keywords
        "serial_step": lambda extra, kw: serial_step(opt, params, grads, state, extra, **serial, **kw),
        "serial_loop_step": lambda extra, kw: serial_loop_step(opt, loop, grads, extra, **loop_kw, **kw),
        "speculative_step": lambda extra, kw: sp.speculative_step(opt, params, grads, state, extra, **spec, **kw),
        "speculative_loop_step": lambda extra, kw: sp.speculative_loop_step(opt, loop, grads, extra, config=cfg,
                                                                            **loop_kw, **kw),
        "plan_validation": lambda extra, kw: sp.plan_validation(ctx, tally, [1.0] * 4, extra, **kw)}
    for what, call in too_many.items():
        hook = _RecordingHook()
        with pytest.raises(sofx.SofxError) as info:
            call(True, {"reduce_sumsq": hook})
        assert str(info.value) == f"{what}: 1 positional argument too many (bool); it takes {takes[what]}"
        assert hook.calls == [f"refuse: {info.value}"], hook.calls
        hook = _RecordingHook()  # the hook given as the extra argument: it is the one the other ranks wait in
        with pytest.raises(sofx.SofxError) as info:
            call(hook, {})
        place = takes[what].split(", then")[0].count(",") + 2  # (after the last it takes)
        assert str(info.value) == (f"{what}: 1 positional argument too many (_RecordingHook); it takes "
                                   f"{takes[what]} (positional argument {place} is a reduce_sumsq hook: pass it as "
                                   "reduce_sumsq=)"), str(info.value)
        assert hook.calls == [f"refuse: {info.value}"], hook.calls
    assert scheduled == []
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(not m.any() for m in state.mu)


def test_the_required_arguments_of_the_steps_show_as_required(rng):
    """The required arguments, positional and keyword, have a private default (so that leaving one out is refused
    through the hook, not by Python at the call): the signature help() shows says <required> for each, and the
    docstring says which."""
    import inspect

    from sofx.serial import serial_loop_step

    step, loop = ("opt", "params", "grads", "state"), ("opt", "loop", "grads")
    for fn, required in ((serial_step, (*step, "scaler", "scaler_state")), (serial_loop_step, (*loop, "scaler")),
                         (sp.speculative_step, (*step, "config", "scaler", "scaler_state")),
                         (sp.speculative_loop_step, (*loop, "config", "scaler")),
                         (sp.plan_validation, ("ctx", "tally", "sumsq"))):
        sig = inspect.signature(fn)
        shown = [n for n, p in sig.parameters.items() if repr(p.default) == "<required>"]
        assert shown == list(required), (fn.__name__, str(sig))
        assert "required" in fn.__doc__, fn.__name__


def test_the_hooks_required_argument_shows_as_required():
    """all_reduce_sumsq's hook takes ``local`` with a private default (refused inside the collective when left
    out): help() showed it as ``<object object at 0x...>``."""
    import inspect

    from sofx.distributed import SumsqReduce

    for method in (SumsqReduce.__call__, SumsqReduce.agreed_sum):
        assert repr(inspect.signature(method).parameters["local"].default) == "<required>", method.__name__


def test_plan_validation_refuses_its_bad_input_through_the_hook():
    """plan_validation's own refusals (sumsq or taken of another length than the blocks, taken True for a block
    not speculated, a speculated block without gradient, hparams or a sum of squares it cannot read): before, it
    raised without telling the reduction hook, so the other ranks waited for this rank's sum forever. Now it
    tells the hook first (refuse), and does not reduce."""
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    for kw, words in (({"sumsq": [1.0]}, "sumsq has 1 entries, the step has 2 blocks"),
                      ({"sumsq": [1.0, 1.0], "taken": [True]}, "taken has 1 entries, the step has 2 blocks"),
                      ({"sumsq": [1.0, 1.0], "taken": [False, True]},
                       "block 1: taken[1] is True but the block was not speculated"),
                      ({"sumsq": [None, 1.0]}, "block 0 was speculated but has no gradient at validation"),
                      ({"sumsq": [1.0, 1.0], "hparams": "lr"}, "hparams: expected an AdamHParams or a sequence"),
                      ({"sumsq": [1.0, "x"]}, "plan_validation: sumsq[1] is 'x' (str); expected")):
        hook = _RecordingHook()
        with pytest.raises(ValueError) as info:
            sp.plan_validation(ctx, tally, reduce_sumsq=hook, **kw)
        assert words in str(info.value), str(info.value)
        assert hook.calls == [f"refuse: {info.value}"], hook.calls


def test_a_sum_of_squares_that_is_not_a_number_is_refused_by_plan_validation_naming_it():
    """A block's sum of squares that is not a real number >= 0 (a string, a tensor of two, a bool, a negative
    number): before, float()'s ValueError or TypeError ("could not convert string to float: 'x'", "only one
    element tensors can be converted"), or a bool or negative taken as a sum; now a SofxError naming the entry and
    what was given, after telling the hook, which is not asked to reduce. A number, a numpy number or a 1-element
    tensor, inf and nan (a gradient not finite: an overflow) are sums of squares."""
    import numpy as np

    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2)
    expected = ("expected block 1's sum of squares, a real number >= 0 (inf or nan where its gradient is not "
                "finite), or None for no gradient")
    for value, given in (("x", "'x' (str)"), (torch.ones(2), "tensor([1., 1.]) (a torch.float32 tensor of shape "
                                                             "(2,))"),
                         (True, "True (bool)"), (-1.0, "-1.0 (float)"), (1j, "1j (complex)"), ([1.0], "[1.0] (list)")):
        hook = _RecordingHook()
        with pytest.raises(sofx.SofxError) as info:
            sp.plan_validation(ctx, tally, [1.0, value], reduce_sumsq=hook)
        assert str(info.value) == f"plan_validation: sumsq[1] is {given}; {expected}", str(info.value)
        assert hook.calls == [f"refuse: {info.value}"], hook.calls
    for value in (2.0, 2, np.float32(2.0), torch.tensor(2.0), torch.tensor([2.0], dtype=torch.float64)):
        plan = sp.plan_validation(ctx, tally, [2.0, value])
        assert plan.report.grad_norm == 2.0 / S16, value
    for value in (math.inf, math.nan):
        assert sp.plan_validation(ctx, tally, [2.0, value]).report.skipped


def test_the_loop_steps_pass_their_step_count_to_a_hook_that_compares_settings(rng):
    """A hook with agreed_sum (all_reduce_sumsq's) gets the loop's step count first in the settings of both loop
    steps (so that ranks at different steps raise), and a refusal inside the step still reaches its refuse; a hook
    without agreed_sum is called with the local sum alone, as before."""
    from sofx.serial import init_loop, serial_loop_step

    class Comparing(_RecordingHook):
        def agreed_sum(self, local: float, settings) -> float:
            self.calls.append(f"agreed_sum: {list(settings)[:2]} step={settings['step']}")
            return local

    opt, rule = sofx.adamw(lr=1e-2), loss_scale.grad_scaler()
    loop = init_loop(opt, _params(rng), rule)._replace(step=3)
    cfg = sp.SpeculationConfig()
    steps = {"serial": lambda hook, grads: serial_loop_step(opt, loop, grads, scaler=rule, reduce_sumsq=hook),
             "speculative": lambda hook, grads: sp.speculative_loop_step(opt, loop, grads, config=cfg, scaler=rule,
                                                                         reduce_sumsq=hook)}
    for what, step in steps.items():
        hook = Comparing()
        assert step(hook, _grads(rng))[0].step == 4
        assert hook.calls == ["agreed_sum: ['step', 'profile'] step=3"], (what, hook.calls)
        plain = _RecordingHook()
        step(plain, _grads(rng))
        assert plain.calls == ["reduce"], (what, plain.calls)
        hook = Comparing()
        bad = _grads(rng)
        bad[1] = bad[1][:2]
        with pytest.raises(sofx.SofxError) as info:
            step(hook, bad)
        assert hook.calls == [f"refuse: {info.value}"], (what, hook.calls)


def test_an_optimizer_or_loop_state_of_another_kind_is_refused_by_both_loops(rng):
    """A torch.optim optimizer given as ``opt``, or an optax-style ``(params, opt_state)`` tuple given as the loop,
    raised AttributeErrors ("'AdamW' object has no attribute 'check_inputs'", "'tuple' object has no attribute
    'step'"). Every step refuses them naming what was given and what it takes, tells the reduction hook (the
    other ranks wait for this rank's sum otherwise) and changes nothing."""
    from sofx.serial import init_loop, serial_loop_step

    opt, rule = sofx.adamw(lr=1e-2), loss_scale.grad_scaler()
    params, grads = _params(rng), _grads(rng)
    loop = init_loop(opt, params, rule)
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(p.clone()) for p in params])
    wrong_opt = r"opt is an AdamW; expected a sofx\.Adam \(sofx\.adamw\(\.\.\.\) or sofx\.adam\(\.\.\.\)\)"
    wrong_loop = (r"loop is a tuple; expected a sofx\.serial\.LoopState \(sofx\.serial\.init_loop\(opt, params, "
                  r"scaler\) makes it\)")
    config = sp.SpeculationConfig()
    for k, (call, pattern) in enumerate((
            (lambda hook: init_loop(torch_opt, params, rule), wrong_opt),
            (lambda hook: serial_step(torch_opt, params, grads, loop.opt_state, scaler=rule,
                                      scaler_state=loop.scaler_state, reduce_sumsq=hook), wrong_opt),
            (lambda hook: serial_loop_step(torch_opt, loop, grads, scaler=rule, reduce_sumsq=hook), wrong_opt),
            (lambda hook: serial_loop_step(opt, (params, loop.opt_state), grads, scaler=rule, reduce_sumsq=hook),
             wrong_loop),
            (lambda hook: sp.speculative_step(torch_opt, params, grads, loop.opt_state, config=config, scaler=rule,
                                              scaler_state=loop.scaler_state, reduce_sumsq=hook), wrong_opt),
            (lambda hook: sp.speculative_loop_step(torch_opt, loop, grads, config=config, scaler=rule,
                                                   reduce_sumsq=hook), wrong_opt),
            (lambda hook: sp.speculative_loop_step(opt, (params, loop.opt_state), grads, config=config, scaler=rule,
                                                   reduce_sumsq=hook), wrong_loop))):
        hook = _RecordingHook()
        with pytest.raises(sofx.SofxError, match="^" + pattern) as info:
            call(hook)
        assert hook.calls == ([] if k == 0 else [f"refuse: {info.value}"])  # (init_loop takes no hook)
    assert all(int(c) == 0 for c in loop.opt_state.count)


def test_engine_style_block_protocol_with_donation(rng):
    """Flat 1-d blocks, gradients block by block in reverse order, steps donated, validation applied."""
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1)
    params, state = _warm(opt, _params(rng, 3, 10), rng)
    grads = _grads(rng, 3, 10, mult=[2.0, 0.001, 0.001])
    ser = serial_step(opt, params, grads, state, scaler=loss_scale.grad_scaler(),
                      scaler_state=loss_scale.grad_scaler().init(), max_norm=1.0)
    blocks = [p.clone() for p in params]
    states = [sofx.AdamState(state.count[i].clone(), state.mu[i].clone(), state.nu[i].clone()) for i in range(3)]
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(max_norm=1.0), rule, rule.init(), n_blocks=3,
                               hparams=AdamHParams())
    records = [None] * 3
    for i in (2, 1, 0):
        tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]),
                                     lambda i=i: sp.block_eligibility(opt, blocks[i], grads[i], states[i],
                                                                      ctx.hparams[i], ctx.grad_scale))
        if d.speculate:
            p_before = blocks[i]
            blocks[i], states[i], records[i] = sp.speculative_block_step(opt, blocks[i], grads[i], states[i], d,
                                                                         donate=True)
            assert blocks[i] is p_before  # in place
    plan = sp.plan_validation(ctx, tally, [tally.block_sumsq[i] for i in range(3)])
    assert [a.kind for a in plan.actions] == ["step", "undo_redo", "undo_redo"]  # block 0 vetoed
    for i, a in enumerate(plan.actions):
        blocks[i], states[i] = sp.apply_block_action(opt, a, blocks[i], grads[i], states[i], records[i],
                                                     donate=True)
    for i in range(3):
        assert _rel(blocks[i], ser.params[i]) <= 1e-6
        assert int(states[i].count) == int(ser.state.count[i])


def test_a_speculated_block_validated_with_another_sum_of_squares_is_undone_and_redone(rng):
    """plan_validation did not compare a speculated block's validated sum of squares with the one it was
    speculated with (on_block_ready's, or on_late_gradient's): a gradient replaced after the speculative step
    without on_late_gradient was committed, the block stepped with the old gradient while the global norm counted
    the new one. Such a block is undone and redone with the final gradient, the reason naming both sums: the
    result is the serial step's on the final gradients."""
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1)
    params, state = _warm(opt, _params(rng, 2, 10), rng)
    grads = _grads(rng, 2, 10)
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2)
    blocks, states, records = list(params), [sofx.AdamState(state.count[i], state.mu[i], state.nu[i])
                                             for i in range(2)], [None, None]
    for i in (1, 0):
        tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]),
                                     sp.block_eligibility(opt, blocks[i], grads[i], states[i], ctx.hparams[i],
                                                          ctx.grad_scale))
        blocks[i], states[i], records[i] = sp.speculative_block_step(opt, blocks[i], grads[i], states[i], d)
    final = [grads[0], grads[1] * 1.5]  # (out of place: the record keeps the gradient its step took)
    plan = sp.plan_validation(ctx, tally, [sp.grad_sumsq(g) for g in final])
    assert [a.kind for a in plan.actions] == ["commit", "undo_redo"]
    assert re.search(r"sum of squares .* differs from the .* it was speculated with", plan.actions[1].reason)
    assert plan.report.undone == plan.report.redone == 1
    for i, a in enumerate(plan.actions):
        blocks[i], states[i] = sp.apply_block_action(opt, a, blocks[i], final[i], states[i], records[i])
    ser = serial_step(opt, params, final, state, scaler=rule, scaler_state=rule.init())
    for i in range(2):  # (block 1 undone algebraically: to float32 rounding)
        for a, b in ((blocks[i], ser.params[i]), (states[i].mu, ser.state.mu[i]), (states[i].nu, ser.state.nu[i])):
            assert torch.equal(a, b) if i == 0 else _rel(a, b) <= 1e-6


def test_protocol_errors_are_clear(rng):
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2)
    el = sp.Eligibility(True, "algebraic", "", 0)
    tally2, _ = sp.on_block_ready(ctx, tally, 0, 1.0, el)
    with pytest.raises(sofx.SofxError, match="already ready"):
        sp.on_block_ready(ctx, tally2, 0, 1.0, el)
    with pytest.raises(sofx.SofxError, match="not ready yet"):
        sp.on_late_gradient(ctx, tally2, 1, 1.0)
    for bad in (2, -1, 0.0, True, "0"):
        with pytest.raises(sofx.SofxError, match=rf"block {re.escape(repr(bad))} is out of range: expected an "
                                                 rf"integer in \[0, 2\)"):
            sp.on_block_ready(ctx, tally2, bad, 1.0, el)
    np = pytest.importorskip("numpy")  # a numpy block index (from an array) was refused
    t, d = sp.on_block_ready(ctx, tally2, np.int64(1), 1.0, el)
    assert type(d.block) is int and d.block == 1 and t.decisions[1] == d
    assert sp.on_late_gradient(ctx, t, np.int64(1), 4.0).late == frozenset({1})
    with pytest.raises(sofx.SofxError, match="2 blocks"):
        sp.plan_validation(ctx, tally2, [1.0])
    with pytest.raises(sofx.SofxError, match="no gradient"):
        sp.plan_validation(ctx, tally2, [None, None])
    with pytest.raises(sofx.SofxError, match="taken"):
        sp.plan_validation(ctx, tally2, [1.0, 1.0], taken=[False, True])
    # a speculative step that did not run is not undone
    plan = sp.plan_validation(ctx, tally2, [1.0, 1.0], taken=[False, False])
    assert [a.kind for a in plan.actions] == ["step", "step"]
    with pytest.raises(sofx.HParamError, match="missing_grad"):
        sp.SpeculationConfig(missing_grad="drop")
    with pytest.raises(sofx.HParamError, match="snapshot_budget_bytes"):
        sp.SpeculationConfig(snapshot_budget_bytes=-1)
    with pytest.raises(sofx.StructureError, match="hparams is not a prefix"):
        sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2, hparams=[AdamHParams()] * 3)


def test_a_tally_of_another_step_or_a_context_that_is_not_one_is_refused_by_the_protocol():
    """Each protocol function takes the context and the tally :func:`begin_step` made together. Before, a tally of
    a step with more blocks than the context was validated without its extra blocks (a speculative step there was
    neither committed nor undone), one with fewer raised a bare IndexError, a tally of an earlier step was
    validated against a new step's context (its blocks undone and redone with the new hparams), and ``None`` or the
    two swapped raised an AttributeError. Now a SofxError says what was given, and the tally is not changed."""
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    config = sp.SpeculationConfig()
    el = sp.Eligibility(True, "algebraic", "", 0)
    ctx3, tally3 = sp.begin_step(opt, config, rule, rule.init(), n_blocks=3)
    ctx2, tally2 = sp.begin_step(opt, config, rule, rule.init(), n_blocks=2)
    ready3, _ = sp.on_block_ready(ctx3, tally3, 2, 1.0, el)
    ready2, _ = sp.on_block_ready(ctx2, tally2, 1, 1.0, el)
    new3, _ = sp.begin_step(opt, config, rule, rule.init(), n_blocks=3, hparams=AdamHParams(lr=0.5))
    other = "the tally is not of this context's step: begin_step makes a context and its tally together"
    calls = {
        "on_block_ready": lambda c, t: sp.on_block_ready(c, t, 1, 1.0, el),
        "on_late_gradient": lambda c, t: sp.on_late_gradient(c, t, 1, 1.0),
        "on_speculation_held": lambda c, t: sp.on_speculation_held(c, t, 1, 0),
        "on_speculation_refused": lambda c, t: sp.on_speculation_refused(c, t, 1, "x"),
        "plan_validation": lambda c, t: sp.plan_validation(c, t, [1.0] * getattr(c, "n_blocks", 3)),
    }
    for name, call in calls.items():
        for ctx, tally in ((ctx2, ready3), (ctx3, ready2), (new3, ready3)):
            with pytest.raises(sofx.SofxError, match=f"^{name}: {re.escape(other)}"):
                call(ctx, tally)
        with pytest.raises(sofx.SofxError, match=f"^{name}: tally is a NoneType; expected the BackwardTally"):
            call(ctx3, None)
        with pytest.raises(sofx.SofxError, match=f"^{name}: ctx is a BackwardTally; expected the StepContext"):
            call(ready3, ctx3)
    hook = _RecordingHook()  # (plan_validation tells the reduction hook before it raises)
    with pytest.raises(sofx.SofxError, match=re.escape(other)) as info:
        sp.plan_validation(new3, ready3, [1.0] * 3, reduce_sumsq=hook)
    assert hook.calls == [f"refuse: {info.value}"]
    # the pairs begin_step made still work together
    assert [a.kind for a in sp.plan_validation(ctx3, ready3, [None, None, 1.0]).actions] == ["skip", "skip", "commit"]


def test_reports_of_a_step_undone_for_a_late_gradient_are_refused_keeping_the_budget():
    """on_speculation_held / on_speculation_refused for a block whose step the caller already undid for a late
    gradient (on_late_gradient(undone=True), which released its bytes): before, the bytes were taken off the held
    total a second time, which went negative, and the blocks after it were speculated with snapshots beyond
    snapshot_budget_bytes. Now both refuse it, saying to report before the undo (as on_late_gradient says)."""
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(snapshot_budget_bytes=100), rule, rule.init(), n_blocks=2)
    tally, d = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "snapshot", "", 60))
    assert d.speculate and tally.snapshot_bytes == 60
    tally = sp.on_late_gradient(ctx, tally, 0, 2.0, undone=True)
    assert tally.snapshot_bytes == 0
    for call in (lambda: sp.on_speculation_held(ctx, tally, 0, 30),
                 lambda: sp.on_speculation_refused(ctx, tally, 0, "beyond the budget")):
        with pytest.raises(sofx.SofxError, match=r"block 0's speculative step was undone for a late gradient "
                                                 r"\(on_late_gradient\(undone=True\)\), which released its snapshot"):
            call()
    # the budget is whole: a block needing more than it is not speculated
    _, d1 = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "snapshot", "", 120))
    assert d1.kind == "budget"
    # reported before the undo, as on_late_gradient says: counted once
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(snapshot_budget_bytes=100), rule, rule.init(), n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "snapshot", "", 60))
    tally = sp.on_speculation_held(ctx, tally, 0, 30)
    assert sp.on_late_gradient(ctx, tally, 0, 2.0, undone=True).snapshot_bytes == 0


@pytest.mark.parametrize("bad", ["no", None, 0, 1.0])
def test_the_protocols_flags_that_are_not_bools_are_refused(rng, bad):
    """begin_step's last_micro_step and on_late_gradient's undone are bools (as SpeculationConfig's flags). Before,
    they were read by their truth: last_micro_step="no" speculated during an earlier micro-step's backward, and
    undone="no" marked a standing speculative step as undone, so that validation stepped the block again from its
    speculated state (two steps). Now an HParamError names the argument, and nothing is recorded."""
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    with pytest.raises(sofx.HParamError, match=r"^last_micro_step = .* is invalid; expected a bool"):
        sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1, last_micro_step=bad)
    param, grad = torch.randn(4, generator=rng), torch.randn(4, generator=rng)
    with pytest.raises(sofx.HParamError, match=r"^last_micro_step = .* is invalid; expected a bool"):
        sp.speculative_step(opt, [param], [grad], opt.init([param]), config=sp.SpeculationConfig(), scaler=rule,
                            scaler_state=rule.init(), last_micro_step=bad)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1)
    tally, _ = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    with pytest.raises(sofx.HParamError, match=r"^on_late_gradient: undone = .* is invalid; expected a bool"):
        sp.on_late_gradient(ctx, tally, 0, 4.0, undone=bad)
    np = pytest.importorskip("numpy")  # (numpy bools are bools)
    assert sp.on_late_gradient(ctx, tally, 0, 4.0, undone=np.bool_(False)).undone == frozenset()
    assert not sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1,
                             last_micro_step=np.bool_(False))[0].speculating


@pytest.mark.parametrize("bad, words", [
    (sp.Eligibility("no", "snapshot", "", 8), r"eligible = 'no' is invalid; expected a bool"),
    (sp.Eligibility(True, "snapshot", "", -64), r"snapshot_bytes = -64 is invalid; expected an integer >= 0"),
    (sp.Eligibility(True, "snapshot", "", "8"), r"snapshot_bytes = '8' is invalid; expected an integer >= 0"),
    (sp.Eligibility(True, 2, "", 8), r"strategy = 2 is invalid; expected None or one of \('algebraic', "),
    (sp.Eligibility(True, "snapshots", "", 8), r"strategy = 'snapshots' is invalid; expected None or one of "),
    (sp.Eligibility(False, None, 42, 0), r"reason = 42 is invalid; expected a str \(why\), got int"),
    (sp.Eligibility(True, "snapshot", None, 8), r"reason = None is invalid; expected a str \(why\), got NoneType"),
    (sp.Eligibility(True, "none", "", 0), r"eligible = True with strategy = 'none' is a contradiction"),
    (sp.Eligibility(True, None, "", 0), r"eligible = True with strategy = None is a contradiction"),
])
def test_an_eligibility_with_fields_of_other_kinds_is_refused_by_on_block_ready(bad, words):
    """on_block_ready reads an Eligibility's ``eligible``, ``strategy``, ``reason`` and ``snapshot_bytes``
    (block_eligibility makes one; an engine may make its own). Before, eligible="no" speculated the block, a
    negative snapshot_bytes lowered the snapshot held, so that later blocks were speculated beyond
    snapshot_budget_bytes, and a string raised a bare TypeError; a strategy of no undo record and a reason that is
    no str were taken without a word, the reason into the decision's (and the plan's action's), and so was an
    eligible block whose strategy is "none" or None (a step that cannot be undone, speculated). Now a SofxError
    names the block and the field."""
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(snapshot_budget_bytes=100), rule, rule.init(), n_blocks=2)
    with pytest.raises(sofx.SofxError, match=rf"^on_block_ready: block 0: the eligibility's {words}"):
        sp.on_block_ready(ctx, tally, 0, 1.0, bad)
    with pytest.raises(sofx.SofxError, match=rf"^on_block_ready: block 0: the eligibility's {words}"):
        sp.on_block_ready(ctx, tally, 0, 1.0, lambda: bad)
    np = pytest.importorskip("numpy")  # (numpy bools and integers are read as such)
    tally, d = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(np.bool_(True), "snapshot", "", np.int64(60)))
    assert d.speculate and type(d.snapshot_bytes) is int and tally.snapshot_bytes == 60
    assert sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "snapshot", "", 60))[1].kind == "budget"


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_taken_entries_that_are_not_bools_are_refused_through_the_hook(bad):
    """plan_validation's ``taken[i]`` says whether block i's speculative step ran. Before, it was read by its
    truth: taken=["no"] for a speculated block whose step did not run committed it (the block was never stepped),
    and for one not speculated the error said "taken[0] is True". Now a SofxError names the entry, after telling
    the reduction hook."""
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    hook = _RecordingHook()
    with pytest.raises(sofx.SofxError, match=rf"^taken\[0\] = {re.escape(repr(bad))} is invalid; expected a bool"):
        sp.plan_validation(ctx, tally, [1.0, 1.0], taken=[bad, False], reduce_sumsq=hook)
    assert len(hook.calls) == 1 and hook.calls[0].startswith("refuse: taken[0]"), hook.calls
    np = pytest.importorskip("numpy")  # (numpy bools, as an array of them, are bools)
    plan = sp.plan_validation(ctx, tally, [1.0, 1.0], taken=np.array([False, False]))
    assert [a.kind for a in plan.actions] == ["step", "step"]


def _one_speculated_block_not_taken(opt, rng):
    """A step of one block of 4 random elements through the block protocol: ready and chosen for speculation, its
    speculative step not taken (``taken=[False]``). Returns the loss-scale rule, the block's param, grad and
    fresh state, its decision and the validation plan."""
    rule, param, grad, state, ctx, tally, decision = _one_ready_block(opt, rng)
    return rule, param, grad, state, decision, sp.plan_validation(ctx, tally, [sp.grad_sumsq(grad)], taken=[False])


def _one_ready_block(opt, rng):
    """One block of 4 random elements through the block protocol (a GradScaler) up to its decision: ready and
    chosen for speculation. Returns the rule, the block's param, grad and fresh state, the step's context, the tally
    and the decision."""
    rule = loss_scale.grad_scaler()
    param, grad = torch.randn(4, generator=rng), torch.randn(4, generator=rng)
    state = opt.init(param)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1)
    tally, decision = sp.on_block_ready(ctx, tally, 0, sp.grad_sumsq(grad), sp.Eligibility(True, "algebraic", "", 0))
    return rule, param, grad, state, ctx, tally, decision


def test_a_decision_used_for_a_speculative_step_already_is_refused_before_anything_is_written(rng):
    """A BlockDecision is one block's speculative step of one step. speculative_block_step took it again (a loop that
    kept last step's decision, a retry) and stepped the block a second time; only apply_block_action refused the
    record afterwards (another step's), the block already written. A decision (or a copy: _replace, copy.copy,
    copy.deepcopy) whose speculative step was taken is refused, naming the block, nothing written; one whose step
    was taken back (SnapshotLimitError, nothing written) was not used."""
    opt = sofx.adamw(lr=1e-2)
    rule, param, grad, state, decision, _ = _one_speculated_block_not_taken(opt, rng)
    p1, s1, record = sp.speculative_block_step(opt, param, grad, state, decision, donate=True)
    stepped, mu = p1.clone(), s1.mu.clone()
    for again in (decision, decision._replace(reason="again"), copy.copy(decision), copy.deepcopy(decision)):
        with pytest.raises(sofx.SofxError, match=r"^speculative_block_step: block 0: its decision was used "
                                                 r"already"):
            sp.speculative_block_step(opt, p1, grad, s1, again, donate=True)
    assert torch.equal(p1, stepped) and torch.equal(s1.mu, mu) and int(s1.count) == 1
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(snapshot_budget_bytes=0), rule, rule.init(), n_blocks=1)
    tally, d = sp.on_block_ready(ctx, tally, 0, sp.grad_sumsq(grad), sp.Eligibility(True, "snapshot", "", 0))
    with pytest.raises(sofx.SnapshotLimitError):  # (undo="exact": a snapshot, beyond a budget of 0)
        sp.speculative_block_step(sofx.adamw(lr=1e-2, undo="exact"), p1, grad, s1, d, donate=True)
    assert torch.equal(p1, stepped) and int(s1.count) == 1
    assert int(sp.speculative_block_step(opt, p1, grad, s1, d, donate=True)[1].count) == 2  # (taken back: not used)


@pytest.mark.parametrize("bad", ["x", 1.5, -3, True])
def test_a_decision_made_by_hand_with_a_budget_that_is_no_count_is_refused_naming_it(rng, bad):
    """speculative_block_step read a decision's snapshot_budget_bytes as it was: a str raised Python's bare
    TypeError, 1.5 an error naming snapshot_limit_bytes (which the caller did not pass), -3 and True were taken as
    budgets of 0 and 1 byte. A SofxError names the decision's field, before anything is written."""
    opt = sofx.adamw(lr=1e-2)
    param, grad = torch.randn(4, generator=rng), torch.randn(4, generator=rng)
    state, before = opt.init(param), param.clone()
    decision = sp.BlockDecision(0, True, "speculate", "", AdamHParams(), 1.0, snapshot_budget_bytes=bad)
    with pytest.raises(sofx.SofxError, match=r"^speculative_block_step: decision.snapshot_budget_bytes = .* is "
                                             r"invalid; expected an integer >= 0"):
        sp.speculative_block_step(opt, param, grad, state, decision, donate=True)
    assert torch.equal(param, before) and int(state.count) == 0


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_a_decision_made_by_hand_whose_speculate_is_no_bool_is_refused_naming_it(rng, bad):
    """speculative_block_step read a decision's speculate by its truth: a decision made by hand (or its _replace)
    with speculate="no" took the speculative step without a word (None was refused as 'not chosen', 1 taken). A
    SofxError names the block and the field, nothing written, the decision unused; numpy bools are bools."""
    opt = sofx.adamw(lr=1e-2)
    param, grad = torch.randn(4, generator=rng), torch.randn(4, generator=rng)
    state, before = opt.init(param), param.clone()
    decision = sp.BlockDecision(0, bad, "speculate", "", AdamHParams(), 1.0)
    with pytest.raises(sofx.SofxError, match=rf"^speculative_block_step: block 0: decision\.speculate = {bad!r} is "
                                             r"invalid; expected a bool"):
        sp.speculative_block_step(opt, param, grad, state, decision, donate=True)
    assert torch.equal(param, before) and int(state.count) == 0 and not decision.used_cell()[0]
    ok = sp.BlockDecision(0, np.bool_(True), "speculate", "", AdamHParams(), 1.0)
    assert int(sp.speculative_block_step(opt, param, grad, state, ok)[1].count) == 1


def test_an_opt_that_is_not_a_sofx_adam_is_refused_by_the_block_protocol(rng):
    """begin_step, block_eligibility, speculative_block_step and apply_block_action take a sofx.Adam, as the loops
    do (sofx.serial.check_opt). Before, an apply_if_finite wrapper raised "AttributeError: 'ApplyIfFinite' object
    has no attribute 'defaults'", and a torch.optim.Adam made a context whose hparams were its defaults' keys
    (lr='lr', beta1='betas', ...). Now a SofxError names what was given and what to pass."""
    inner = sofx.adamw()
    rule, param, grad, state, decision, plan = _one_speculated_block_not_taken(inner, rng)
    (action,) = plan.actions
    assert decision.speculate and action.kind == "step"  # (its reason said "not speculated", of a block that was)
    assert action.reason == "its speculative step did not run (taken[0] is False): stepped now"
    before = param.clone()
    for bad, words in ((sofx.apply_if_finite(inner, 3), "opt is an apply_if_finite(...) wrapper"),
                       (torch.optim.Adam([torch.nn.Parameter(torch.randn(2))]),
                        "opt is an Adam; expected a sofx.Adam")):
        for call in (lambda: sp.begin_step(bad, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1),
                     lambda: sp.block_eligibility(bad, param, grad, state, AdamHParams(), 1.0),
                     lambda: sp.speculative_block_step(bad, param, grad, state, decision, donate=True),
                     lambda: sp.apply_block_action(bad, action, param, grad, state, donate=True)):
            with pytest.raises(sofx.SofxError, match=re.escape(words)):
                call()
    assert torch.equal(param, before) and int(state.count) == 0


def test_an_action_or_decision_that_is_not_one_is_refused_by_the_apply_functions_changing_nothing(rng):
    """apply_block_action takes one BlockAction (``plan.actions[i]``) and speculative_block_step one BlockDecision.
    Before, the plan itself, its actions tuple, an action kind as a string or the other function's value raised
    an AttributeError ("'ValidationPlan' object has no attribute 'kind'"); now a SofxError says what was given,
    before any tensor is touched."""
    opt = sofx.adamw()
    _, param, grad, state, decision, plan = _one_speculated_block_not_taken(opt, rng)
    before = param.clone()
    for bad in (plan, plan.actions, "step", decision, None):
        with pytest.raises(sofx.SofxError, match=rf"^apply_block_action: action is a {type(bad).__name__}; expected "
                                                 r"one BlockAction of a ValidationPlan \(plan\.actions\[i\]\)"):
            sp.apply_block_action(opt, bad, param, grad, state, donate=True)
    for bad in (plan.actions[0], plan, "speculate", None):
        with pytest.raises(sofx.SofxError, match=rf"^speculative_block_step: decision is a {type(bad).__name__}; "
                                                 r"expected the BlockDecision on_block_ready returned"):
            sp.speculative_block_step(opt, param, grad, state, bad, donate=True)
    assert torch.equal(param, before) and int(state.count) == 0 and not state.mu.any()


@pytest.mark.parametrize("held", ["5", None, 5.5, -5, True])
def test_speculative_block_step_refuses_held_bytes_that_are_no_count_changing_nothing(rng, held):
    """held_bytes, the snapshot bytes the step's speculative steps hold: a str or None raised Python's bare TypeError
    where a snapshot budget is set, a float an UnsupportedError naming snapshot_limit_bytes (which the caller did
    not pass), and a negative count raised the limit past the budget without a word. A SofxError names it,
    before any tensor is touched."""
    opt = sofx.adamw()
    param, grad = _params(rng, 1)[0], _grads(rng, 1, scale=1.0)[0]
    state = opt.init(param)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(snapshot_budget_bytes=100), loss_scale.static_scale(),
                               loss_scale.static_scale().init(), n_blocks=1)
    _, decision = sp.on_block_ready(ctx, tally, 0, sp.grad_sumsq(grad),
                                    lambda: sp.block_eligibility(opt, param, grad, state, ctx.hparams[0],
                                                                 ctx.grad_scale))
    assert decision.speculate
    before = param.clone()
    with pytest.raises(sofx.SofxError, match=rf"^speculative_block_step: held_bytes = {re.escape(repr(held))} is "
                                             r"invalid; expected an integer >= 0"):
        sp.speculative_block_step(opt, param, grad, state, decision, donate=True, held_bytes=held)
    assert torch.equal(param, before) and int(state.count) == 0 and not state.mu.any()


@pytest.mark.parametrize("bad, pattern", [
    (AdamHParams(lr=-1.0), r"hparams for blocks\[1\]: lr = -1\.0 is invalid; expected"),
    (AdamHParams(beta1=1.5), r"hparams for blocks\[1\]: beta1 = 1\.5 is invalid; expected"),
    (AdamHParams(lr="fast"), r"hparams for blocks\[1\]: lr must be a float or a 0-d tensor, got str"),
    (AdamHParams(lr=sofx.schedules.cosine_decay(1e-3, 10)), r"hparams for blocks\[1\]: lr is a schedule"),
], ids=["negative lr", "beta1 above 1", "a string", "a schedule"])
def test_validation_hparams_a_step_cannot_take_are_refused_before_anything_is_planned(rng, bad, pattern):
    """plan_validation planned with any hparams values, so that an engine applying the plan block by block had
    undone and redone the blocks before the bad one when the bad one raised. It refuses the hparams of a block
    it would step first, naming the block, as serial_step checks its leaves' (also on an overflow step): the
    refused call changes nothing, and one with good hparams then gives the serial step's result. The hparams of
    a block without gradient are not read (missing_grad='skip'), as serial_step does not read them."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng, 2), rng)
    grads = _grads(rng, 2)
    rule = loss_scale.grad_scaler()
    good, changed = AdamHParams(lr=1e-2), AdamHParams(lr=5e-3)
    blocks = [p.clone() for p in params]
    states = [sofx.AdamState(state.count[i].clone(), state.mu[i].clone(), state.nu[i].clone()) for i in range(2)]
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2, hparams=good)
    records = [None] * 2
    for i in (1, 0):
        tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]), lambda i=i: sp.block_eligibility(
            opt, blocks[i], grads[i], states[i], ctx.hparams[i], ctx.grad_scale))
        assert d.speculate
        blocks[i], states[i], records[i] = sp.speculative_block_step(opt, blocks[i], grads[i], states[i], d,
                                                                     donate=True)
    with pytest.raises(sofx.HParamError, match=pattern):
        sp.plan_validation(ctx, tally, list(tally.block_sumsq), hparams=[changed, bad])
    with pytest.raises(sofx.HParamError, match=pattern):  # an overflow step checks them too
        sp.plan_validation(ctx, tally, [tally.block_sumsq[0], math.inf], hparams=[changed, bad])
    unstepped = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2, hparams=[good, bad])
    assert [a.kind for a in sp.plan_validation(*unstepped, [1.0, None]).actions] == ["step", "skip"]
    plan = sp.plan_validation(ctx, tally, list(tally.block_sumsq), hparams=[changed, changed])
    assert [a.kind for a in plan.actions] == ["undo_redo", "undo_redo"]
    for i, a in enumerate(plan.actions):
        blocks[i], states[i] = sp.apply_block_action(opt, a, blocks[i], grads[i], states[i], records[i],
                                                     donate=True)
    ser = serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init(), hparams=changed)
    for i in range(2):
        assert _rel(blocks[i], ser.params[i]) <= 1e-6 and int(states[i].count) == int(ser.state.count[i])


@pytest.mark.parametrize("bad, pattern", [
    (AdamHParams(lr=-1.0), r"lr = -1\.0 is invalid"),
    (lambda t: AdamHParams(), r"is a schedule \(function\)"),
    (1e-3, r"a number is not taken as the lr"),
    ({"lr": 1e-3}, r"not a prefix of the structure of params"),
], ids=["negative lr", "a schedule", "a number", "a dict of fields"])
def test_speculative_step_names_validation_hparams_where_they_are_refused(rng, bad, pattern):
    """speculative_step checks its validation_hparams as serial_step checks its hparams, before anything runs;
    the error named them "hparams" (``hparams for params[0]: lr = -1.0 is invalid``) where the hparams given as
    hparams= were good, and nothing said the validation_hparams were meant. It names them; nothing changes."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng, 2), rng)
    grads = _grads(rng, 2)
    before = [p.clone() for p in params]
    rule = loss_scale.grad_scaler()
    with pytest.raises(sofx.SofxError, match=rf"^validation_hparams: .*{pattern}"):
        sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=rule,
                            scaler_state=rule.init(), hparams=AdamHParams(lr=1e-2), validation_hparams=bad,
                            donate=True)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


_REFUSED_HPARAMS = {
    "negative lr": AdamHParams(lr=-1.0), "nan lr": AdamHParams(lr=math.nan), "inf lr": AdamHParams(lr=math.inf),
    "beta1 of 1": AdamHParams(beta1=1.0), "negative beta1": AdamHParams(beta1=-0.1),
    "nan beta2": AdamHParams(beta2=math.nan), "beta2 above 1": AdamHParams(beta2=1.5),
    "eps of 0": AdamHParams(eps=0.0), "negative eps": AdamHParams(eps=-1e-8), "nan eps": AdamHParams(eps=math.nan),
    "negative weight_decay": AdamHParams(weight_decay=-0.1), "nan weight_decay": AdamHParams(weight_decay=math.nan),
    "a string": AdamHParams(lr="fast"), "a tensor of 2 elements": AdamHParams(lr=torch.tensor([1e-3, 2e-3])),
}


@pytest.mark.parametrize("per_block", [False, True], ids=["one for all blocks", "one bad block"])
@pytest.mark.parametrize("bad", _REFUSED_HPARAMS.values(), ids=_REFUSED_HPARAMS.keys())
def test_hparams_a_step_cannot_take_speculate_no_block_and_validation_refuses_them_before_anything_is_written(
        rng, bad, per_block):
    """begin_step took hparams sofx.Adam's update refuses (a negative or nan lr, a beta outside [0, 1), ...) and
    the step speculated: the blocks arriving before the bad one were stepped in place (donated), then the bad
    block's eligibility raised out of on_block_ready naming ``params``, not the block, half-way through backward.
    Now no block is speculated (the context says why, with update's words, naming the block), and
    plan_validation refuses them as update does, naming the block and telling the hook, before anything is
    written; with good validation hparams the step is then serial_step's, bit for bit."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng, 3), rng)
    grads = _grads(rng, 3)
    rule = loss_scale.grad_scaler()
    hp, first = ([AdamHParams(), bad, AdamHParams()], 1) if per_block else (bad, 0)
    with pytest.raises(sofx.HParamError) as update_error:
        opt.update(params[first], grads[first], opt.init(params[first]), bad)
    expected = str(update_error.value).replace("hparams for params:", f"hparams for blocks[{first}]:")
    blocks = [p.clone() for p in params]
    states = [sofx.AdamState(state.count[i].clone(), state.mu[i].clone(), state.nu[i].clone()) for i in range(3)]
    before = _snapshot(params, state)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=3, hparams=hp)
    assert not ctx.speculating and ctx.kind == "vetoed" and expected in ctx.reason, ctx.reason
    for i in (2, 1, 0):
        tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]), lambda i=i: sp.block_eligibility(
            opt, blocks[i], grads[i], states[i], ctx.hparams[i], ctx.grad_scale))
        assert not d.speculate and d.kind == "vetoed", d
    hook = _RecordingHook()
    with pytest.raises(sofx.HParamError) as info:
        sp.plan_validation(ctx, tally, list(tally.block_sumsq), reduce_sumsq=hook)
    assert str(info.value) == expected and hook.calls == [f"refuse: {expected}"]
    assert _unchanged(before, blocks, sofx.AdamState([s.count for s in states], [s.mu for s in states],
                                                     [s.nu for s in states]))
    plan = sp.plan_validation(ctx, tally, list(tally.block_sumsq), hparams=AdamHParams())
    assert [a.kind for a in plan.actions] == ["step"] * 3
    for i, a in enumerate(plan.actions):
        blocks[i], states[i] = sp.apply_block_action(opt, a, blocks[i], grads[i], states[i], donate=True)
    ser = serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init(), hparams=AdamHParams())
    assert all(torch.equal(b, p) for b, p in zip(blocks, ser.params))


@pytest.mark.parametrize("field, value", [("lr", 1e39), ("eps", 1e-50), ("weight_decay", 1e39)])
def test_hparams_beyond_float32s_range_speculate_no_block(rng, field, value):
    """An lr or weight_decay beyond float32's largest value, or an eps that is 0 there: sofx.Adam's update
    refuses them for a leaf stepped in float32, and the speculation steps of begin_step cannot know the blocks'
    dtype. They were speculated: the first float32 block's eligibility raised out of on_block_ready, the blocks
    before it stepped in place. No block is speculated now (the context says why, naming the block)."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng, 3), rng)
    grads = _grads(rng, 3)
    rule = loss_scale.grad_scaler()
    bad = AdamHParams(**{field: value})
    with pytest.raises(sofx.HParamError) as update_error:
        opt.update(params[1], grads[1], opt.init(params[1]), bad)
    expected = str(update_error.value).replace("hparams for params:", "hparams for blocks[1]:")
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=3,
                               hparams=[AdamHParams(), bad, AdamHParams()])
    assert not ctx.speculating and ctx.kind == "vetoed" and expected in ctx.reason, ctx.reason
    for i in (2, 1, 0):
        tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]), lambda i=i: sp.block_eligibility(
            opt, params[i], grads[i], sofx.AdamState(state.count[i], state.mu[i], state.nu[i]), ctx.hparams[i],
            ctx.grad_scale))
        assert not d.speculate and d.kind == "vetoed", d


@pytest.mark.parametrize("field, value", [("lr", 1e39), ("eps", 1e-50), ("weight_decay", 1e39)])
def test_float64_leaves_with_hparams_beyond_float32s_range_are_speculated(field, value):
    """float64 leaves are stepped in float64, where an lr or weight_decay of 1e39 and an eps of 1e-50 are legal
    (sofx.Adam's update takes them; validation steps them). speculative_step knows the leaves' dtypes, yet
    begin_step held every block to float32's range: no block was speculated, the report saying the hparams were
    refused. They are speculated now, and the step is serial_step's bit for bit."""
    gen = torch.Generator().manual_seed(0)
    opt = sofx.adam(lr=1e-3)
    params = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(3)]
    grads = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(3)]
    hp = AdamHParams(lr=1e-3)._replace(**{field: value})
    rule = loss_scale.static_scale()
    spec = sp.speculative_step(opt, params, grads, opt.init(params), config=sp.SpeculationConfig(), scaler=rule,
                               scaler_state=rule.init(), hparams=hp)
    assert spec.report.speculating and spec.report.speculated == 3, spec.report
    ser = serial_step(opt, params, grads, opt.init(params), scaler=rule, scaler_state=rule.init(), hparams=hp)
    assert all(torch.equal(a, b) for a, b in zip(spec.params, ser.params))



@pytest.mark.parametrize("field, value", [("lr", 1e39), ("eps", 1e-50), ("weight_decay", 1e39)])
def test_plan_validation_refuses_hparams_beyond_float32s_range_before_a_block_is_written(field, value):
    """Validation-time hparams that float32 cannot hold (an lr set to 1e39 between backward and step()) were
    planned: the plan's first action with them raised in opt.update, the block API's caller left with the
    speculative steps before it undone and redone, those after it standing. plan_validation refuses them now,
    naming the block, before any action is taken; a block begin_step was told is float64 takes them, and the
    applied plan is serial_step's bit for bit."""
    gen = torch.Generator().manual_seed(0)
    opt = sofx.adam(lr=1e-3)
    rule = loss_scale.static_scale()
    late = AdamHParams(lr=1e-3)._replace(**{field: value})
    for dtype in (torch.float32, torch.float64):
        params = [torch.randn(6, generator=gen, dtype=dtype) for _ in range(2)]
        grads = [torch.randn(6, generator=gen, dtype=dtype) for _ in range(2)]
        state = opt.init(params)
        ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2,
                                   hparams=AdamHParams(lr=1e-3), float64=[dtype == torch.float64] * 2)
        new_p, states, records = list(params), [sofx.AdamState(c, m, v) for c, m, v in zip(*state)], [None] * 2
        for i in (1, 0):
            tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]), lambda i=i: sp.block_eligibility(
                opt, new_p[i], grads[i], states[i], ctx.hparams[i], ctx.grad_scale))
            assert d.speculate, d
            new_p[i], states[i], records[i] = sp.speculative_block_step(opt, new_p[i], grads[i], states[i], d)
        sumsq = list(tally.block_sumsq)
        if dtype == torch.float32:
            with pytest.raises(sofx.HParamError, match=rf"^hparams for blocks\[0\]: {field} = .* is beyond float32"):
                sp.plan_validation(ctx, tally, sumsq, hparams=late)
            continue
        plan = sp.plan_validation(ctx, tally, sumsq, hparams=late)
        assert [a.kind for a in plan.actions] == ["undo_redo", "undo_redo"], plan.actions
        for i, action in enumerate(plan.actions):
            new_p[i], states[i] = sp.apply_block_action(opt, action, new_p[i], grads[i], states[i], records[i])
        ser = serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init(), hparams=late)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(new_p, ser.params))

@pytest.mark.parametrize("missing_grad", ["skip", "zero"])
def test_refused_hparams_of_a_leaf_without_gradient_leave_the_others_speculated(missing_grad):
    """A leaf that gets no gradient is not stepped (missing_grad="skip") and its hparams are not read, as
    serial_step does: an lr of -1 there is taken. begin_step yet vetoed every block for it, each step of the run,
    the report's reason alone saying so. speculative_step tells begin_step which leaves it steps: the others are
    speculated, and the step is serial_step's bit for bit. With missing_grad="zero" the leaf is stepped with a
    zero gradient, and its lr is refused before anything is stepped, as before."""
    gen = torch.Generator().manual_seed(0)
    opt = sofx.adam(lr=1e-3)
    params = [torch.randn(6, generator=gen) for _ in range(3)]
    grads = [torch.randn(6, generator=gen), None, torch.randn(6, generator=gen)]
    hp = [AdamHParams(), AdamHParams(lr=-1.0), AdamHParams()]
    rule = loss_scale.static_scale()
    config = sp.SpeculationConfig(missing_grad=missing_grad)
    if missing_grad == "zero":
        with pytest.raises(sofx.HParamError, match=r"lr = -1.0 is invalid"):
            sp.speculative_step(opt, params, grads, opt.init(params), config=config, scaler=rule,
                                scaler_state=rule.init(), hparams=hp)
        return
    spec = sp.speculative_step(opt, params, grads, opt.init(params), config=config, scaler=rule,
                               scaler_state=rule.init(), hparams=hp)
    assert spec.report.speculating and spec.report.speculated == 2, spec.report
    ser = serial_step(opt, params, grads, opt.init(params), scaler=rule, scaler_state=rule.init(), hparams=hp)
    assert all(torch.equal(a, b) for a, b in zip(spec.params, ser.params))


def test_begin_step_vetoes_only_for_the_hparams_of_blocks_it_is_told_are_stepped():
    """begin_step's ``stepped[i]``: block ``i`` may be stepped this step. Refused hparams of a block that is not
    (it gets no gradient) leave the others speculated; those of one that is veto every block, as with no
    ``stepped`` given (every block). A ``stepped`` of another length, or not of bools, is refused."""
    opt = sofx.adam(lr=1e-3)
    rule = loss_scale.static_scale()
    hp = [AdamHParams(), AdamHParams(lr=-1.0)]
    config = sp.SpeculationConfig()
    ctx, _ = sp.begin_step(opt, config, rule, rule.init(), n_blocks=2, hparams=hp, stepped=[True, False])
    assert ctx.speculating and ctx.kind == "speculate", ctx.reason
    for stepped in ([True, True], None):
        ctx, _ = sp.begin_step(opt, config, rule, rule.init(), n_blocks=2, hparams=hp, stepped=stepped)
        assert not ctx.speculating and ctx.kind == "vetoed" and "blocks[1]" in ctx.reason, ctx.reason
    with pytest.raises(sofx.HParamError, match=r"stepped has 1 entries, the step has 2 blocks"):
        sp.begin_step(opt, config, rule, rule.init(), n_blocks=2, hparams=hp, stepped=[True])
    with pytest.raises(sofx.HParamError, match=r"stepped\[1\] must be a bool, got int"):
        sp.begin_step(opt, config, rule, rule.init(), n_blocks=2, hparams=hp, stepped=[True, 0])


def test_plan_validation_reads_the_hparams_only_of_the_blocks_it_is_told_are_stepped():
    """plan_validation's ``stepped[i]``: the caller steps block ``i``. With missing_grad="zero" every block
    without gradient counts as stepped (with zeros), but a caller that steps none of a block's elements (the
    offload engine's frozen parameters) says so: that block's refused hparams are not read. By default, and for a
    block said to be stepped, they are refused naming the block; a ``stepped`` not of one bool per block is
    refused."""
    opt = sofx.adam(lr=1e-3)
    rule = loss_scale.static_scale()
    config = sp.SpeculationConfig(missing_grad="zero")
    hp = [AdamHParams(), AdamHParams(lr=-1.0)]
    ctx, tally = sp.begin_step(opt, config, rule, rule.init(), n_blocks=2, hparams=hp, stepped=[True, False])
    tally, _ = sp.on_block_ready(ctx, tally, 0, 4.0, lambda: sp.Eligibility(False, None, "not asked"))
    plan = sp.plan_validation(ctx, tally, [4.0, None], stepped=[True, False])
    assert [a.kind for a in plan.actions] == ["step", "step"]
    for stepped in (None, [True, True]):
        with pytest.raises(sofx.HParamError, match=r"^hparams for blocks\[1\]: lr = -1.0 is invalid"):
            sp.plan_validation(ctx, tally, [4.0, None], stepped=stepped)
    with pytest.raises(sofx.HParamError, match=r"stepped has 3 entries, the step has 2 blocks"):
        sp.plan_validation(ctx, tally, [4.0, None], stepped=[True, False, True])


@pytest.mark.parametrize("bad_grad, pattern", [
    (torch.randn(2, 6), r"grads\[0\]: expected shape \(6,\), got \(2, 6\)"),
    (torch.randn(6).double(), r"grads\[0\]: expected dtype torch.float32, got torch.float64"),
    (torch.ones(6, dtype=torch.int64), r"grads\[0\]: expected dtype torch.float32, got torch.int64"),
    ([1.0] * 6, r"grads\[0\]: expected a tensor, got list"),
])
def test_a_bad_leaf_is_refused_before_any_leaf_is_stepped(rng, bad_grad, pattern):
    """The leaves arrive last to first: a bad first leaf must not leave the others stepped in place (donated),
    and the serial step refuses it before reading any gradient."""
    opt = sofx.adamw()
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng)
    grads[0] = bad_grad
    before = [t.clone() for t in [*params, *state.mu, *state.nu, *state.count]]
    rule = loss_scale.grad_scaler()
    with pytest.raises(sofx.LeafError, match=pattern):
        sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=rule,
                            scaler_state=rule.init(), donate=True)
    with pytest.raises(sofx.LeafError, match=pattern):
        serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init(), donate=True)
    after = [*params, *state.mu, *state.nu, *state.count]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(sofx.LeafError, match=r"late_grads\[1\]: expected a tensor like the leaf's gradient"):
        sp.speculative_step(opt, params, _grads(rng), state, config=sp.SpeculationConfig(), scaler=rule,
                            scaler_state=rule.init(), late_grads={1: torch.randn(2, 6)}, donate=True)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("case", ["beta1_zero", "bf16_master", "lr_times_wd_one", "validation_hparams"])
def test_an_algebraic_refusal_is_raised_before_any_leaf_is_stepped(rng, case):
    """undo='algebraic' refuses some leaves outright (SPECULATION.md section 2). Block 0 arrives first and is
    speculated in place (donated): the refusal of block 1 must come before, naming params[1], as serial_step's
    does -- also on a step that overflows (the speculation cannot know that yet)."""
    opt = sofx.adamw(lr=1e-2, undo="algebraic")
    params, grads = _params(rng, 2), _grads(rng, 2)
    hp, kw = [AdamHParams(), AdamHParams()], {}
    if case == "beta1_zero":
        hp[1] = AdamHParams(beta1=0.0)
    elif case == "bf16_master":
        params[1], grads[1] = params[1].bfloat16(), grads[1].bfloat16()
    elif case == "lr_times_wd_one":
        hp[1] = AdamHParams(weight_decay=100.0)  # lr * wd == 1: the decay cannot be divided out
    else:
        kw["validation_hparams"] = [AdamHParams(), AdamHParams(beta1=0.0)]  # a schedule moved since backward
    params, state = _warm(sofx.adamw(lr=1e-2), params, rng)
    before = _snapshot(params, state)
    rule = loss_scale.grad_scaler()
    pattern = r"params\[1\]: undo='algebraic' is impossible"
    for g in (grads, [grads[0] * math.nan, grads[1]]):
        with pytest.raises(sofx.UnsupportedError, match=pattern):
            sp.speculative_step(opt, params, g, state, config=sp.SpeculationConfig(), scaler=rule,
                                scaler_state=rule.init(), hparams=hp, order=[0, 1], donate=True, **kw)
        with pytest.raises(sofx.UnsupportedError, match=pattern):
            serial_step(opt, params, g, state, scaler=rule, scaler_state=rule.init(),
                        hparams=kw.get("validation_hparams", hp), donate=True)
        assert _unchanged(before, params, state)


def test_a_leaf_refused_only_with_the_speculation_hparams_is_stepped_late(rng):
    """With the validation hparams the leaf is fine: it is not speculated (no undo is needed), and the step
    is serial_step's with the validation hparams."""
    opt = sofx.adamw(lr=1e-2, undo="algebraic")
    params, state = _warm(opt, _params(rng), rng)
    spec, ser = _both(opt, params, _grads(rng), state, config=sp.SpeculationConfig(),
                      hparams=[AdamHParams()] * 3 + [AdamHParams(beta1=0.0)], validation_hparams=AdamHParams())
    assert spec.report.actions == ("commit", "commit", "commit", "step") and spec.report.ineligible == 1
    assert "impossible" in spec.plan.actions[3].reason
    _compare(spec, ser, spec.report.actions)


@pytest.mark.parametrize("undo, bad, error, pattern", [
    ("auto", AdamHParams(lr=-1.0), sofx.HParamError, r"hparams for params\[1\]: lr = -1.0 is invalid"),
    ("algebraic", AdamHParams(beta1=0.0), sofx.UnsupportedError, r"params\[1\]: undo='algebraic' is impossible"),
])
def test_a_missing_gradient_stepped_with_zeros_is_checked_before_any_leaf_is_stepped(rng, undo, bad, error,
                                                                                     pattern):
    """missing_grad='zero' steps leaf 1 (no gradient) with zeros in validation: its hparams are checked with the
    others, before blocks 3 and 2 (arriving first) are speculated in place."""
    opt = sofx.adamw(lr=1e-2, undo=undo)
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng)
    grads[1] = None
    hp = [AdamHParams(), bad, AdamHParams(), AdamHParams()]
    before = _snapshot(params, state)
    rule = loss_scale.grad_scaler()
    kw = dict(config=sp.SpeculationConfig(missing_grad="zero"), scaler=rule, scaler_state=rule.init(), donate=True)
    with pytest.raises(error, match=pattern):
        sp.speculative_step(opt, params, grads, state, hparams=hp, **kw)
    with pytest.raises(error, match=pattern):
        sp.speculative_step(opt, params, grads, state, hparams=AdamHParams(), validation_hparams=hp, **kw)
    with pytest.raises(error, match=pattern):
        serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init(), hparams=hp,
                    missing_grad="zero", donate=True)
    assert _unchanged(before, params, state)
    # missing_grad='skip': the leaf is not stepped, its hparams are not used
    spec, ser = _both(opt, params, grads, state, config=sp.SpeculationConfig(), hparams=hp)
    assert spec.report.actions[1] == "skip"
    _compare(spec, ser, spec.report.actions)


def test_block_indices_that_are_not_ints_are_refused_before_any_leaf_is_stepped(rng):
    """True and False are ints to isinstance and to sorted(), not to the block protocol: refused up front,
    not after the first blocks were speculated in place."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    before = _snapshot(params, state)
    rule = loss_scale.grad_scaler()
    kw = dict(config=sp.SpeculationConfig(), scaler=rule, scaler_state=rule.init(), donate=True)
    for order in ([3, 2, 1, False], [3, 2, 1, 0.0]):
        with pytest.raises(sofx.SofxError, match="order must be a permutation of the 4 leaf indices"):
            sp.speculative_step(opt, params, _grads(rng), state, order=order, **kw)
    for key in (True, 1.0):
        with pytest.raises(sofx.SofxError, match=rf"late_grads\[{key}\]: a late gradient needs a leaf"):
            sp.speculative_step(opt, params, _grads(rng), state, late_grads={key: torch.ones(6)}, **kw)
    assert _unchanged(before, params, state)


def test_late_grads_that_are_not_a_mapping_are_refused_naming_it(rng):
    """speculative_step's late_grads maps a leaf index to its further gradient. Before, a list of them (one per
    leaf, as the grads) went through dict(): "TypeError: cannot convert dictionary update sequence element #0 to a
    sequence", a ValueError about an element's length, or, for tensors of two elements, each tensor taken as an
    (index, gradient) pair; a tensor raised "Boolean value of Tensor ... is ambiguous". Now a SofxError says a
    mapping {leaf index: tensor} is expected, before anything runs."""
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    params, grads = _params(rng, 2, 2), _grads(rng, 2, 2)
    state = opt.init(params)
    for bad in ([None, torch.randn(2)], [torch.randn(2), torch.randn(2)], torch.randn(2), "ab", ((0, torch.randn(2)),)):
        with pytest.raises(sofx.SofxError, match=rf"^late_grads is a {type(bad).__name__}; expected a mapping "
                                                 r"\{leaf index or path: tensor\}"):
            sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=rule,
                                scaler_state=rule.init(), late_grads=bad)
    res = sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=rule,
                              scaler_state=rule.init(), late_grads={1: grads[0].clone()})
    assert res.report.actions == ("commit", "undo_redo")


@pytest.mark.parametrize("donate", [False, True])
def test_an_order_or_reduce_sumsq_of_another_kind_is_refused_before_anything_runs(rng, donate):
    """``order=5`` raised Python's "'int' object is not iterable"; a ``reduce_sumsq`` that is not callable (5, a
    string) raised "'int' object is not callable" from the reduction, in speculative_step after its speculative
    steps had run (undone again) and in serial_step after the local sum. Both steps now refuse it by name
    before anything runs, and nothing changes."""
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    params, grads = _params(rng, 2, 2), _grads(rng, 2, 2)
    state = opt.init(params)
    before = ([p.clone() for p in params], [m.clone() for m in state.mu], [v.clone() for v in state.nu])
    for bad in (5, 2.5):
        with pytest.raises(sofx.SofxError, match=rf"^order must be a permutation of the 2 leaf indices \(ints\), "
                                                 rf"got {bad}$"):
            sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=rule,
                                scaler_state=rule.init(), order=bad, donate=donate)
    one = {"w": params[0]}  # (order=0 is no sequence of one leaf's index)
    with pytest.raises(sofx.SofxError, match=r"^order must be a permutation of the 1 leaf indices \(ints\), got 0$"):
        sp.speculative_step(opt, one, {"w": grads[0]}, opt.init(one), config=sp.SpeculationConfig(), scaler=rule,
                            scaler_state=rule.init(), order=0, donate=donate)
    for bad in (5, "sum"):
        kind = sofx.tree.article(type(bad).__name__)
        with pytest.raises(sofx.HParamError, match=rf"^reduce_sumsq is {kind}; expected a "
                                                   r"function of this rank's sum of squares"):
            sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=rule,
                                scaler_state=rule.init(), reduce_sumsq=bad, donate=donate)
        with pytest.raises(sofx.HParamError, match=rf"^reduce_sumsq is {kind}; expected"):
            serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init(), reduce_sumsq=bad,
                        donate=donate)
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1] + before[2],
                                                 list(params) + list(state.mu) + list(state.nu)))


def test_numpy_integer_leaf_indices_in_order_and_late_grads_are_read_as_ints(rng):
    """Leaf indices taken from a numpy array (``np.argsort``, ``np.int64``) in ``order`` and as ``late_grads`` keys
    are indices, as the block protocol's ``on_block_ready`` takes them: the step equals the one given Python ints
    (bitwise, reports included); numpy bools stay refused as Python bools are."""
    import numpy as np

    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng)
    late = torch.randn(6, generator=rng) * 0.01 * S16
    rule = loss_scale.grad_scaler()
    kw = dict(config=sp.SpeculationConfig(), scaler=rule, scaler_state=rule.init())
    want = sp.speculative_step(opt, params, grads, state, order=[3, 1, 2, 0], late_grads={2: late}, **kw)
    for kind in (np.int64, np.int32, np.uint8):
        order = list(np.array([3, 1, 2, 0], dtype=kind))
        got = sp.speculative_step(opt, params, grads, state, order=order, late_grads={kind(2): late}, **kw)
        assert got.report == want.report and got.report.actions[2] == "undo_redo"
        for a, b in zip([*got.params, *got.state.mu, *got.state.nu, *got.state.count],
                        [*want.params, *want.state.mu, *want.state.nu, *want.state.count]):
            assert torch.equal(a, b)
    before = _snapshot(params, state)
    with pytest.raises(sofx.SofxError, match="order must be a permutation of the 4 leaf indices"):
        sp.speculative_step(opt, params, _grads(rng), state, order=[3, 2, 1, np.False_], donate=True, **kw)
    with pytest.raises(sofx.SofxError, match=r"late_grads\[(np\.)?True_?\]: a late gradient needs a leaf"):
        sp.speculative_step(opt, params, _grads(rng), state, late_grads={np.True_: torch.ones(6)}, donate=True, **kw)
    assert _unchanged(before, params, state)


def test_speculative_step_does_not_read_finite_gradients_again(rng, monkeypatch):
    """The speculation layer took each block's sum of squares: it tells Adam the gradients are finite
    (eligibility, speculative step and validation), so Adam does not pass over them again."""
    import importlib

    opt = sofx.adamw(lr=3e-3, weight_decay=0.01)
    params, state = _warm(opt, _params(rng, 3, 16), rng)
    cfg = sp.SpeculationConfig(max_norm=1.0, policy=sp.AdaptivePolicy(enabled=False))
    rule = loss_scale.grad_scaler()
    kw = dict(config=cfg, scaler=rule, scaler_state=rule.init())
    for mult in ([0.01, 0.01, 0.01], [10.0, 0.01, 0.01]):  # all committed; then a late clip: undo_redo
        grads = _grads(rng, 3, 16, scale=rule.scale(rule.init()), mult=mult)
        want = sp.speculative_step(opt, params, grads, state, **kw)
        adam_module = importlib.import_module("sofx.adam")
        monkeypatch.setattr(adam_module, "_all_finite", lambda x, *_: pytest.fail("gradients read again"))
        got = sp.speculative_step(opt, params, grads, state, **kw)
        monkeypatch.undo()
        clipped = mult[0] == 10.0  # block 0 arrives last: the blocks before it were speculated, then redone
        assert got.report.speculated == (2 if clipped else 3) and got.report.redone == (2 if clipped else 0)
        assert all(torch.equal(a, b) for a, b in zip(got.params, want.params))


def test_long_trajectory_does_not_drift(rng):
    """100 steps, clipping on about half of them, no resynchronisation: the speculative path stays
    within float32 rounding of the serial loop."""
    opt = sofx.adamw(lr=3e-3, weight_decay=0.01)
    params, state = _warm(opt, _params(rng, 3, 16), rng)
    rule = loss_scale.grad_scaler(growth_interval=10)
    cfg = sp.SpeculationConfig(max_norm=1.0, policy=sp.AdaptivePolicy(enabled=False))
    sp_p, sp_s, sp_ss = params, state, rule.init()
    se_p, se_s, se_ss = params, state, rule.init()
    undone = 0
    for step in range(100):
        mult = [0.5 if step % 2 else 0.01, 0.01, 0.01]
        grads = _grads(rng, 3, 16, scale=rule.scale(se_ss), mult=mult)
        res = sp.speculative_step(opt, sp_p, grads, sp_s, config=cfg, scaler=rule, scaler_state=sp_ss)
        ser = serial_step(opt, se_p, grads, se_s, scaler=rule, scaler_state=se_ss, max_norm=1.0)
        sp_p, sp_s, sp_ss = res.params, res.state, res.scaler_state
        se_p, se_s, se_ss = ser.params, ser.state, ser.scaler_state
        assert sp_ss == se_ss
        undone += res.report.undone
    assert undone > 50
    for a, b in zip(sp_p, se_p):
        assert _rel(a, b) <= 1e-6


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
def test_never_used_rows_and_a_heavy_late_clip_stay_within_the_tolerance(backend):
    """Rows of an embedding no token has used yet (m = v = 0 at step 1000) get their first gradient in a
    speculative step, and a later block's gradient makes the global norm 100x max_norm: the undo+redo of the
    donated step must equal the serial loop within 1e-6. An algebraic inverse of those rows (a zero v was
    exempt from the lossy test) left v 1.2e-3 off there and p 3.6e-6 (of the tensor's largest value)."""
    gen = torch.Generator().manual_seed(0)
    n = 2 * FINITE_CHUNK
    opt = sofx.adamw(lr=1e-2, weight_decay=0.0, backend=backend)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.01
    v = torch.rand(n, generator=gen) * 1e-4 + 1e-5
    m[:100] = v[:100] = 0.0  # never used
    g = torch.randn(n, generator=gen) * 0.01
    g *= 0.5 / g.norm()  # the embedding's gradient arrives first, below max_norm
    h = torch.randn(64, generator=gen)
    h *= 100.0 / h.norm()  # the first layer's arrives last: clipping by 100x
    params = [torch.randn(64, generator=gen), p]
    state = sofx.AdamState([torch.tensor(1000)] * 2, [torch.zeros(64), m], [torch.zeros(64), v])
    cfg = sp.SpeculationConfig(max_norm=1.0, policy=sp.AdaptivePolicy(enabled=False))
    scaler = loss_scale.static_scale(1.0)
    spec = sp.speculative_step(opt, [q.clone() for q in params], [h, g], sofx.tree.tree_map(torch.clone, state),
                               config=cfg, scaler=scaler, scaler_state=scaler.init(), donate=True)
    ser = serial_step(opt, params, [h, g], state, scaler=scaler, scaler_state=scaler.init(), max_norm=1.0)
    assert spec.report.actions == ("step", "undo_redo")
    _compare(spec, ser, spec.report.actions, donated=True)
    rows = [(a[:100].double(), b[:100].double()) for a, b in ((spec.state.mu[1], ser.state.mu[1]),
                                                              (spec.state.nu[1], ser.state.nu[1]))]
    assert all(float(((a - b).abs() / b.abs()).max()) <= 1e-6 for a, b in rows)


def test_loop_helpers_follow_the_schedule_and_skip_overflow_steps(rng):
    from sofx import schedules
    from sofx.serial import init_loop, serial_loop_step

    opt = sofx.adam(lr=1e-2, weight_decay=0.01)
    params = _params(rng, 3, 8)
    rule = loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=5)
    schedule = schedules.hparams_schedule(lr=schedules.warmup_cosine(1e-2, 4, 30))
    cfg = sp.SpeculationConfig(max_norm=1.0)
    spec_loop, ser_loop = init_loop(opt, params, rule), init_loop(opt, params, rule)
    skipped = 0
    for step in range(30):
        S = rule.scale(ser_loop.scaler_state)
        grads = _grads(rng, 3, 8, scale=S, mult=[0.3 if step % 3 == 0 else 0.02, 0.02, 0.02])
        if step % 7 == 3:
            grads[2][0] = float("nan")
        spec_loop, report = sp.speculative_loop_step(opt, spec_loop, grads, config=cfg, scaler=rule,
                                                     hparams=schedule)
        ser_loop, facts = serial_loop_step(opt, ser_loop, grads, scaler=rule, hparams=schedule, max_norm=1.0)
        assert report.skipped == facts.skipped == (step % 7 == 3)
        skipped += facts.skipped
        assert spec_loop.step == ser_loop.step == step + 1 - skipped
        assert spec_loop.scaler_state == ser_loop.scaler_state
        for a, b in zip(spec_loop.params, ser_loop.params):
            assert _rel(a, b) <= 1e-6
    assert skipped == 4 and ser_loop.policy_state is None and spec_loop.policy_state is not None


def test_huge_unscaled_gradients_are_never_speculated(rng):
    """A loss scale below 1 can make finite gradients huge once unscaled: never speculate those."""
    opt = sofx.adamw(lr=1e-2, undo="exact")  # the blocks before it are undone exactly (gradients 250x the moments)
    params, state = _warm(opt, _params(rng), rng)
    rule = loss_scale.grad_scaler(init_scale=2.0 ** -8)
    grads = _grads(rng, scale=1.0)
    grads[2] = torch.randn(6, generator=rng) * 1e37  # finite, but beyond float32 once unscaled
    spec, ser = _both(opt, params, grads, state, scaler=rule, config=sp.SpeculationConfig())
    assert "beyond" in spec.report.veto_reason
    assert spec.report.skipped and ser.facts.overflow  # unscaled norm beyond float32: an overflow
    for p in spec.params:
        assert torch.isfinite(p).all()
    _compare(spec, ser, spec.report.actions)


@pytest.mark.parametrize("scale", [0.0, 2.0 ** -128, 2.0 ** -149])
def test_a_loss_scale_that_cannot_unscale_is_an_overflow(rng, scale):
    """GradScaler's float32 scale reaches 0 after ~166 overflows in a row; 1/S is inf from 2**-128 down.
    Such a step is skipped (scale backed off), never speculated, and writes nothing, even with finite
    gradients (torch would step them to the nan of 0 * inf)."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    before = _snapshot(params, state)
    rule = loss_scale.grad_scaler()
    sstate = loss_scale.GradScalerState(scale, 7)
    for max_norm in (None, 1.0):
        spec, ser = _both(opt, params, _grads(rng, scale=1.0), state, config=sp.SpeculationConfig(max_norm=max_norm),
                          scaler=rule, sstate=sstate, donate=True)
        r = spec.report
        assert r.skipped and ser.facts.skipped and r.actions == ("skip",) * 4
        assert r.speculated == 0 and not r.speculating and "cannot unscale" in r.not_speculating_reason
        assert spec.scaler_state == rule.update(sstate, True) and r.next_scale == rule.update(sstate, True).scale
        assert _unchanged(before, spec.params, spec.state) and _unchanged(before, params, state)


def test_loops_keep_skipping_at_a_loss_scale_of_zero_as_torch(rng):
    """A run whose gradients are never finite (a nan loss): torch's GradScaler halves its scale down to 0 and
    keeps skipping; so do both loops, with torch's scale at every step (they raised at 0)."""
    from sofx.serial import init_loop, serial_loop_step

    opt = sofx.adamw(lr=1e-2)
    rule = loss_scale.grad_scaler()
    ser = spec = init_loop(opt, _params(rng, 2), rule)
    before = _snapshot(ser.params, ser.opt_state)
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.scale(torch.ones(()))  # creates its scale tensor
    p = torch.nn.Parameter(torch.zeros(6))
    torch_opt = torch.optim.AdamW([p])
    cfg = sp.SpeculationConfig(max_norm=1.0)
    for _ in range(170):
        p.grad = torch.full((6,), math.nan)
        torch_scaler.unscale_(torch_opt)
        torch_scaler.step(torch_opt)
        torch_scaler.update()
        nan = [torch.full((6,), math.nan)] * 2
        ser, facts = serial_loop_step(opt, ser, nan, scaler=rule, max_norm=1.0, donate=True)
        spec, report = sp.speculative_loop_step(opt, spec, nan, config=cfg, scaler=rule, donate=True)
        assert facts.skipped and report.skipped
        assert ser.scaler_state.scale == spec.scaler_state.scale == torch_scaler.get_scale()
    assert torch_scaler.get_scale() == 0.0 and ser.step == spec.step == 0
    grads = _grads(rng, 2, scale=1.0)  # finite gradients at scale 0: still skipped
    ser, facts = serial_loop_step(opt, ser, grads, scaler=rule, max_norm=1.0, donate=True)
    spec, report = sp.speculative_loop_step(opt, spec, grads, config=cfg, scaler=rule, donate=True)
    assert facts.skipped and report.skipped and ser.step == spec.step == 0 and spec.scaler_state.scale == 0.0
    assert _unchanged(before, ser.params, ser.opt_state) and _unchanged(before, spec.params, spec.opt_state)


@given(outcomes=st.lists(st.booleans(), max_size=40), window=st.integers(1, 6),
       fraction=st.sampled_from([0.0, 0.25, 0.5, 0.75]), quiet=st.integers(1, 4))
def test_adaptive_policy_matches_its_rule(outcomes, window, fraction, quiet):
    policy = sp.AdaptivePolicy(window=window, pause_fraction=fraction, quiet_steps=quiet)
    state = policy.init()
    recent, paused, quiet_run = [], False, 0
    for clipped in outcomes:
        assert policy.allows(state)[0] == (not paused)
        state = policy.update(state, clipped)
        if paused:
            quiet_run = 0 if clipped else quiet_run + 1
            if quiet_run >= quiet:
                paused, recent, quiet_run = False, [], 0
        else:
            recent = (recent + [clipped])[-window:]
            paused = sum(recent) > fraction * window
        assert state.paused == paused
        state = policy.update(state, None)  # a skipped step changes nothing
        assert state.paused == paused
    assert sp.AdaptivePolicy(enabled=False).update(sp.PolicyState(paused=True), True).paused  # disabled: frozen
    assert sp.AdaptivePolicy(enabled=False).allows(sp.PolicyState(paused=True))[0]


def test_a_disabled_policy_reports_no_pause_and_keeps_the_state_it_was_given(rng):
    """A disabled policy never pauses, but a paused state it was given (a checkpoint of a run with the policy on)
    showed in every report: policy_paused True and "policy: paused: ..." in the summary of a step that speculated
    every block. The report says what the policy did (no pause, no reason); the state is carried as it was given
    (the disabled policy neither reads nor writes it: a checkpoint round-trips it)."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    loaded = sp.PolicyState((True,) * 8, True, 1, "paused: clipping fired on 8 of the last 8 steps")
    cfg = sp.SpeculationConfig(max_norm=1e9, policy=sp.AdaptivePolicy(enabled=False))
    spec, ser = _both(opt, params, _grads(rng), state, config=cfg, policy_state=loaded)
    _compare(spec, ser)
    report = spec.report
    assert report.speculating and report.speculated == report.committed == 4
    assert not report.policy_paused and report.policy_reason == "" and "policy" not in report.summary()
    assert spec.policy_state == loaded


@pytest.mark.parametrize("window, fraction, at", [(90, 0.7, 63), (50, 0.58, 29), (100, 0.29, 29), (8, 0.5, 4)])
def test_adaptive_policy_does_not_pause_on_exactly_its_fraction_of_the_window(window, fraction, at):
    """"More than pause_fraction * window": pause_fraction * window rounded below the whole number it is (0.7 * 90
    is 62.99999999999999), and 63 clipped steps of 90, exactly 70%, paused. n / window is compared: at steps that
    clipped of the window do not pause, one more does."""
    policy = sp.AdaptivePolicy(window=window, pause_fraction=fraction)
    state = policy.init()
    for k in range(window):
        state = policy.update(state, k < at)
    assert not state.paused and sum(state.recent) == at
    state = policy.update(state, True)  # the oldest step (clipped) leaves the window: still `at` of `window`
    assert not state.paused and sum(state.recent) == at
    state = policy.init()
    for k in range(at + 1):
        assert not state.paused
        state = policy.update(state, True)
    assert state.paused


@pytest.mark.parametrize("bad, field", [
    (sp.PolicyState(paused="no"), r"state.paused = 'no'"),
    (sp.PolicyState(recent=(True, 2, False)), r"state.recent\[1\] = 2"),
    (sp.PolicyState(recent=None), r"state.recent = None"),
    (sp.PolicyState(paused=True, quiet="x"), r"state.quiet = 'x'"),
    (sp.PolicyState(reason=5), r"state.reason = 5"),
    ((True, False), r"state is a tuple; expected a PolicyState"),
])
def test_adaptive_policy_allows_and_update_refuse_a_policy_state_they_cannot_read(bad, field):
    """AdaptivePolicy.allows and update, called by hand, took a PolicyState made by hand as it was (begin_step
    checks it, they did not): allows(paused="no") said the step may not speculate, update raised Python's bare
    TypeError for recent=None or a str quiet, and a tuple raised a bare AttributeError. An HParamError names the
    method and the field; a list of Python or numpy bools is taken as its tuple, as begin_step takes it."""
    from sofx.errors import HParamError

    policy = sp.AdaptivePolicy(window=2, pause_fraction=0.0)
    for call, name in ((lambda: policy.allows(bad), "allows"), (lambda: policy.update(bad, True), "update"),
                       (lambda: policy.update(bad, None), "update")):
        with pytest.raises(HParamError, match=rf"^AdaptivePolicy.{name}: {field}"):
            call()
    assert policy.allows(sp.PolicyState(recent=[True, np.bool_(False)], paused=np.bool_(False))) == (True, "")
    assert policy.update(sp.PolicyState(recent=[np.bool_(True)]), False) == policy.update(
        sp.PolicyState(recent=(True,)), False)


@pytest.mark.parametrize("enabled", [True, False])
def test_adaptive_policy_update_refuses_a_clip_outcome_that_is_no_bool(enabled):
    """AdaptivePolicy.update took clipped by its truth: "no" and 1.0 as a clipped step (a pause with
    pause_fraction=0), and a bool tensor of several elements raised torch's bare RuntimeError. An HParamError names
    it; a Python or numpy bool, a 0-d bool tensor and None (a skipped step) are taken."""
    from sofx.errors import HParamError

    policy = sp.AdaptivePolicy(enabled=enabled, window=2, pause_fraction=0.0)
    for bad in ("no", 1.0, 0, torch.tensor([True, False])):
        with pytest.raises(HParamError, match=r"^AdaptivePolicy.update: clipped = .* is invalid; expected a bool"):
            policy.update(policy.init(), bad)
    for clipped, paused in ((np.bool_(False), False), (torch.tensor(True), enabled), (None, False), (True, enabled)):
        assert policy.update(policy.init(), clipped).paused == paused


def test_report_as_dict_and_summary(rng):
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng)
    grads[0][0] = float("inf")
    spec, _ = _both(opt, params, grads, state, config=sp.SpeculationConfig(max_norm=1.0))
    d = spec.report.as_dict()
    assert d["skipped"] and d["speculated"] == 3 and d["undone"] == 3 and d["next_scale"] == S16 / 2
    assert spec.report.summary().startswith("SKIPPED (overflow) spec 3")


def test_a_deepspeed_report_shows_the_scale_the_backward_used(rng):
    """Under the "deepspeed" profile the scale is updated before unscaling, so a report's scale and next_scale are
    both the scale after the update: an overflow step whose backward used 65536 showed "scale 32768", nothing of
    the 65536 its gradients were scaled by. backward_scale is the scale the backward used, and the summary shows
    the change from it: "scale 65536 -> 32768" (and a growth "scale 65536 -> 131072")."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    cfg = sp.SpeculationConfig(profile="deepspeed")
    grads = _grads(rng)
    grads[0][0] = float("inf")
    rule = loss_scale.deepspeed_scaler(hysteresis=1)
    spec, _ = _both(opt, params, grads, state, config=cfg, scaler=rule)
    r = spec.report
    assert r.skipped and (r.backward_scale, r.scale, r.next_scale) == (S16, S16 / 2, S16 / 2)
    assert "scale 65536 -> 32768" in r.summary() and r.as_dict()["backward_scale"] == S16
    rule = loss_scale.deepspeed_scaler(scale_window=1)
    spec, _ = _both(opt, params, _grads(rng), state, config=cfg, scaler=rule, sstate=rule.update(rule.init(), False))
    r = spec.report
    assert not r.skipped and (r.backward_scale, r.scale, r.next_scale) == (S16, 2 * S16, 2 * S16)
    assert "scale 65536 -> 131072" in r.summary()
    spec, _ = _both(opt, params, _grads(rng), state, config=sp.SpeculationConfig())  # (torch: unchanged)
    assert spec.report.backward_scale == spec.report.scale == S16 and spec.report.summary().endswith("scale 65536")


@pytest.mark.parametrize("scale, next_scale, tail", [(math.nan, math.nan, "scale nan"), (2.0, 2.0, "scale 2"),
                                                     (2.0, 1.0, "scale 2 -> 1"), (math.nan, 1.0, "scale nan -> 1"),
                                                     (65536.0, 65536.01, "scale 65536.0 -> 65536.01")])
def test_report_summary_names_a_scale_change_only_where_the_scale_changed(scale, next_scale, tail):
    """A nan scale kept (nan != nan) was printed as the change ``scale nan -> nan``; a change below 6 digits as
    ``scale 65536 -> 65536``."""
    assert sp.StepReport(blocks=2, scale=scale, next_scale=next_scale).summary().endswith(tail)


def test_reduce_sumsq_makes_other_ranks_count(rng):
    """Another rank's overflow skips this rank's step; another rank's large norm clips it."""
    opt = sofx.adamw(lr=1e-2, undo="exact")
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng)
    cfg = sp.SpeculationConfig(max_norm=1.0)
    rule = loss_scale.grad_scaler()
    overflow = sp.speculative_step(opt, params, grads, state, config=cfg, scaler=rule, scaler_state=rule.init(),
                                   reduce_sumsq=lambda s: s + math.inf)
    assert overflow.report.skipped and overflow.report.actions == ("undo",) * 4
    for a, b in zip(overflow.params, params):
        assert torch.equal(a, b)
    other = (3.0 * S16) ** 2  # the other rank's gradients have norm 3
    res = sp.speculative_step(opt, params, grads, state, config=cfg, scaler=rule, scaler_state=rule.init(),
                              reduce_sumsq=lambda s: s + other)
    ser = serial_step(opt, params, grads, state, scaler=rule, scaler_state=rule.init(), max_norm=1.0,
                      reduce_sumsq=lambda s: s + other)
    assert res.report.clipped and res.report.actions == ("undo_redo",) * 4 and res.report.vetoed == 0
    assert res.report.grad_norm == pytest.approx(ser.facts.grad_norm) and res.report.grad_norm > 3.0
    _compare(res, ser, res.report.actions)


@settings(max_examples=15, deadline=None)
@given(backend=st.sampled_from(["cpu", "cpu", "cpu_fast", "reference"]), decoupled=st.booleans(),
       undo=st.sampled_from(["auto", "auto", "exact"]), profile=st.sampled_from(["torch", "deepspeed"]),
       predict=st.booleans(), max_norm=st.sampled_from([None, 1.0]),
       budget=st.sampled_from([None, 0, 12 * FINITE_CHUNK + 8, 10 ** 5]), warm=st.booleans(),
       steps=st.lists(st.fixed_dictionaries({
           "clip": st.sampled_from([False, False, True]), "spikes": st.lists(st.integers(0, 2), max_size=3),
           "overflow": st.sampled_from([None] * 8 + [0, 2]), "late": st.sampled_from([None, None, 0, 1, 2]),
           "late_spike": st.booleans(), "new_hparams": st.sampled_from([False, False, True]),
           "seed": st.integers(0, 2 ** 16)}), min_size=3, max_size=6))
def test_engine_protocol_with_bf16_copies_and_late_gradients_undone_first(backend, decoupled, undo, profile, predict,
                                                                          max_norm, budget, warm, steps):
    """The block protocol as the offload engine drives it: flat fp32 master blocks of several chunks stepped in
    place, each step also writing the model's bf16 weights (``param_copies``); a snapshot budget (steps taken
    back, ``on_speculation_held``); a late gradient undoes the block's speculative step at once and is summed
    in place (``on_late_gradient(undone=True)``, ``taken``). Every step equals serial_step within DESIGN.md's
    1e-6 (then re-synchronised), with the same counts and loss-scaler state, and the bf16 weights are the
    masters' rounding after every step whatever the validation did (commit, undo+redo, undo, step late)."""
    gen = torch.Generator().manual_seed(len(steps))
    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-2, weight_decay=0.05, backend=backend, undo=undo)
    config = sp.SpeculationConfig(max_norm=max_norm, profile=profile, snapshot_budget_bytes=budget,
                                  predict_scale=predict, policy=sp.AdaptivePolicy(window=3, quiet_steps=2))
    scaler = (loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=3) if profile == "torch" else
              loss_scale.deepspeed_scaler(init_scale=2.0 ** 8, scale_window=3, hysteresis=2))
    sizes = (2 * FINITE_CHUNK + 10, 3000, FINITE_CHUNK)
    n = len(sizes)
    masters = [torch.randn(k, generator=gen) for k in sizes]
    state = opt.init(masters)
    for _ in range(20 if warm else 0):
        masters, state, _ = opt.update(masters, [torch.randn(k, generator=gen) * 0.01 for k in sizes], state,
                                       undoable=False)
    blocks = [p.clone() for p in masters]
    states = [sofx.AdamState(state.count[i].clone(), state.mu[i].clone(), state.nu[i].clone()) for i in range(n)]
    copies = [p.to(torch.bfloat16) for p in blocks]
    sstate, policy = scaler.init(), None
    for k, ev in enumerate(steps):
        egen = torch.Generator().manual_seed(ev["seed"])
        S = scaler.scale(sstate)
        mult = (0.3 if ev["clip"] else 0.002) * S
        grads = [torch.randn(size, generator=egen) * mult for size in sizes]
        for i in ev["spikes"]:
            grads[i][int(torch.randint(sizes[i], (1,), generator=egen))] = 0.3 * S
        if ev["overflow"] is not None:
            grads[ev["overflow"]][7] = math.inf
        late = {}
        if ev["late"] is not None:
            late[ev["late"]] = torch.randn(sizes[ev["late"]], generator=egen) * mult
            if ev["late_spike"]:
                late[ev["late"]][3] = 0.3 * S
        hp = AdamHParams(lr=1e-2 * (1 + k / 10))
        final_hp = AdamHParams(lr=hp.lr * 0.5, beta2=0.99) if ev["new_hparams"] else hp
        ser = serial_step(opt, masters, [g + late[i] if i in late else g for i, g in enumerate(grads)], state,
                          scaler=scaler, scaler_state=sstate, hparams=final_hp, max_norm=max_norm, profile=profile)

        ctx, tally = sp.begin_step(opt, config, scaler, sstate, policy, n_blocks=n, hparams=hp)
        records, held = [None] * n, 0
        for i in reversed(range(n)):  # backward: the last block first
            g = grads[i]
            tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(g), lambda i=i, g=g: sp.block_eligibility(
                opt, blocks[i], g, states[i], ctx.hparams[i], ctx.grad_scale, grads_finite=True))
            if not d.speculate:
                continue
            try:
                blocks[i], states[i], records[i] = sp.speculative_block_step(
                    opt, blocks[i], g, states[i], d, donate=True, grads_finite=True, param_copies=copies[i],
                    held_bytes=held)
            except sofx.SnapshotLimitError as exc:  # taken back: nothing changed (copies included)
                tally = sp.on_speculation_refused(ctx, tally, i, str(exc))
                assert torch.equal(copies[i], blocks[i].to(torch.bfloat16))
                continue
            held += records[i].snapshot_bytes()
            tally = sp.on_speculation_held(ctx, tally, i, records[i].snapshot_bytes())
        taken = [records[i] is not None for i in range(n)]
        for i, extra in late.items():  # the engine's way: undo first, then sum in place
            if records[i] is not None:
                blocks[i], states[i] = opt.undo(blocks[i], states[i], records[i], donate=True,
                                                param_copies=copies[i])
                held -= records[i].snapshot_bytes()
                records[i], taken[i] = None, False
            grads[i].add_(extra)
            tally = sp.on_late_gradient(ctx, tally, i, sp.grad_sumsq(grads[i]), undone=not taken[i])
        plan = sp.plan_validation(ctx, tally, list(tally.block_sumsq), hparams=final_hp, taken=taken)
        for i, a in enumerate(plan.actions):
            blocks[i], states[i] = sp.apply_block_action(
                opt, a, blocks[i], grads[i], states[i], records[i], donate=True,
                grads_finite=math.isfinite(tally.block_sumsq[i]) or None, param_copies=copies[i])
        assert plan.scaler_state == ser.scaler_state
        for i in range(n):
            assert int(states[i].count) == int(ser.state.count[i]), (k, i, plan.report.actions)
            for a, b in ((blocks[i], ser.params[i]), (states[i].mu, ser.state.mu[i]), (states[i].nu, ser.state.nu[i])):
                assert _rel(a, b) <= 1e-6, (k, i, plan.report.actions[i], plan.actions[i].reason, _rel(a, b))
            assert torch.equal(copies[i], blocks[i].to(torch.bfloat16)), (k, i, plan.report.actions[i])
            blocks[i].copy_(ser.params[i])  # re-synchronised: each step is checked at the per-step tolerance
            states[i].mu.copy_(ser.state.mu[i])
            states[i].nu.copy_(ser.state.nu[i])
            copies[i].copy_(blocks[i])
        masters, state, sstate, policy = ser.params, ser.state, plan.scaler_state, plan.policy_state


def test_speculation_config_reads_a_numpy_or_tensor_max_norm_as_a_float(rng):
    """SpeculationConfig(max_norm=np.float32(1.0)) was refused as invalid; and stored as given, a tensor made the
    veto threshold a tensor. It is stored as the float, and speculation runs as with that float."""
    np = pytest.importorskip("numpy")
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng, mult=[5.0, 5.0, 0.01, 0.01])
    want = sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(max_norm=1.0),
                               scaler=loss_scale.grad_scaler(), scaler_state=loss_scale.grad_scaler().init())
    for m in (np.float32(1.0), torch.tensor(1.0), torch.tensor([1.0])):
        cfg = sp.SpeculationConfig(max_norm=m)
        assert type(cfg.max_norm) is float and cfg.max_norm == 1.0
        rule = loss_scale.grad_scaler()
        ctx, _ = sp.begin_step(opt, cfg, rule, rule.init(), n_blocks=4)
        assert type(ctx.veto_sumsq) is float
        spec, _ = _both(opt, params, grads, state, config=cfg)
        assert spec.report == want.report
        assert all(torch.equal(a, b) for a, b in zip(spec.params, want.params))
    with pytest.raises(sofx.HParamError, match=r"max_norm = 'x' is invalid; .* got str"):
        sp.SpeculationConfig(max_norm="x")


def test_policy_and_config_counts_given_as_numpy_or_tensors_are_read_as_python_numbers():
    """AdaptivePolicy(window=np.int64(4)), quiet_steps and SpeculationConfig(snapshot_budget_bytes=np.int64(10))
    were refused as "expected an integer"; a numpy pause_fraction was kept as given. Each is read once as a Python
    int (a float) and behaves as it; a float count (even a whole one), a bool or a string is refused, naming it."""
    np = pytest.importorskip("numpy")
    want = sp.AdaptivePolicy(window=4, pause_fraction=0.25, quiet_steps=2)
    for count, frac in ((np.int64, np.float64), (np.int32, np.float32), (torch.tensor, torch.tensor),
                        (lambda x: torch.tensor([x]), lambda x: torch.tensor([x]))):
        policy = sp.AdaptivePolicy(window=count(4), pause_fraction=frac(0.25), quiet_steps=count(2))
        assert policy == want and (type(policy.window), type(policy.pause_fraction), type(policy.quiet_steps)) == (
            int, float, int)
        state, want_state = policy.init(), want.init()
        for clipped in (True, True, False, False, False, True):
            state, want_state = policy.update(state, clipped), want.update(want_state, clipped)
            assert state == want_state
        cfg = sp.SpeculationConfig(snapshot_budget_bytes=count(10), policy=policy)
        assert cfg == sp.SpeculationConfig(snapshot_budget_bytes=10, policy=want)
        assert type(cfg.snapshot_budget_bytes) is int
        rule = loss_scale.grad_scaler()
        ctx, tally = sp.begin_step(sofx.adamw(lr=1e-2), cfg, rule, rule.init(), n_blocks=count(3))
        assert type(ctx.n_blocks) is int and ctx.n_blocks == 3 and len(tally.decisions) == 3
    for kwargs, pattern in (({"window": 4.0}, r"AdaptivePolicy.window = 4.0 is invalid; expected an integer >= 1 "
                                              r".*got float \(a float is refused here"),
                            ({"quiet_steps": True}, r"AdaptivePolicy.quiet_steps = True is invalid; .*got bool"),
                            ({"quiet_steps": np.int64(0)}, r"AdaptivePolicy.quiet_steps = .*0.* is invalid; expected "
                                                           r"an integer >= 1 .*got int64"),
                            ({"pause_fraction": "0.5"}, r"AdaptivePolicy.pause_fraction = '0.5' is invalid; "
                                                        r"expected a finite number .*got str"),
                            ({"pause_fraction": np.float32(1.0)}, r"pause_fraction = .*1.0.* is invalid; expected 0 "
                                                                  r"<= pause_fraction < 1")):
        with pytest.raises(sofx.HParamError, match=pattern):
            sp.AdaptivePolicy(**kwargs)
    for budget, kind in ((1.5, "float"), (True, "bool"), (-1, "int"), (torch.ones(2, dtype=torch.int64),
                                                                       r"a torch.int64 tensor of shape \(2,\)")):
        with pytest.raises(sofx.HParamError, match=r"snapshot_budget_bytes = .* is invalid; expected an integer >= 0 "
                                                   r".*got " + kind):
            sp.SpeculationConfig(snapshot_budget_bytes=budget)


def test_speculation_flags_are_python_or_numpy_bools():
    """SpeculationConfig(enabled="no") was stored as "no" and read as true (so were predict_scale and
    AdaptivePolicy.enabled). A numpy bool is stored as a Python bool; anything else is refused, naming the field."""
    np = pytest.importorskip("numpy")
    cfg = sp.SpeculationConfig(enabled=np.bool_(False), predict_scale=np.bool_(True),
                               policy=sp.AdaptivePolicy(enabled=np.bool_(False)))
    assert cfg == sp.SpeculationConfig(enabled=False, policy=sp.AdaptivePolicy(enabled=False))
    assert (type(cfg.enabled), type(cfg.predict_scale), type(cfg.policy.enabled)) == (bool, bool, bool)
    for bad, kind in (("no", "str"), (0, "int"), (None, "NoneType"), (torch.tensor(False), "a torch.bool tensor")):
        for name in ("enabled", "predict_scale"):
            with pytest.raises(sofx.HParamError, match=rf"SpeculationConfig.{name} = .* is invalid; expected a bool "
                                                       rf".*got {kind}"):
                sp.SpeculationConfig(**{name: bad})
        with pytest.raises(sofx.HParamError, match=rf"AdaptivePolicy.enabled = .* is invalid; .*got {kind}"):
            sp.AdaptivePolicy(enabled=bad)


def test_a_numpy_or_tensor_backward_scale_is_its_number(rng):
    """backward_scale=np.float32(2 ** 17) was refused as "backward_scale = 131072.0 is invalid; expected a finite
    number >= 0" (a valid value, refused for its type), and so was a 1-element tensor; both are read as the float,
    and speculation runs as with it. A bool, a string, an int beyond the float range or a negative scale is
    refused naming the value and its type."""
    np = pytest.importorskip("numpy")
    opt = sofx.adam(lr=1e-2, weight_decay=0.01)
    params, state = _warm(opt, _params(rng), rng)
    grads = _grads(rng)
    want, _ = _both(opt, params, grads, state, config=sp.SpeculationConfig(), backward_scale=S16 * 2)
    for scale in (np.float32(S16 * 2), torch.tensor([S16 * 2]), np.int64(S16 * 2)):
        spec, _ = _both(opt, params, grads, state, config=sp.SpeculationConfig(), backward_scale=scale)
        assert spec.report == want.report and all(torch.equal(a, b) for a, b in zip(spec.params, want.params))
    rule = loss_scale.grad_scaler()
    for bad, kind in ((True, "bool"), ("2", "str"), (10 ** 400, "int"), (np.float32(-1.0), "float32"),
                      (torch.ones(2), "Tensor")):
        with pytest.raises(sofx.HParamError, match=r"backward_scale = .* is invalid; expected a finite number >= 0, "
                                                   r"got " + kind):
            sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=4, backward_scale=bad)


@pytest.mark.parametrize("overflow", [False, True])
def test_a_block_undone_by_the_caller_for_a_late_gradient_is_reported_speculated_and_undone(overflow):
    """A caller that undoes a block's speculative step as its late gradient comes (the engine's way:
    on_late_gradient(undone=True), then taken[i]=False at validation) gets the block stepped with the sum; the
    report counted it as stepped late, never speculated. SPECULATION.md's late-gradient row (undo and redo the
    block) and StepReport (stepped_late: blocks stepped without a speculative step): speculated, undone and
    redone; with an overflow, speculated, undone and not stepped."""
    scaler = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(sofx.adamw(), sp.SpeculationConfig(), scaler, scaler.init(), n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    tally, _ = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    tally = sp.on_late_gradient(ctx, tally, 0, math.inf if overflow else 4.0, undone=True)
    plan = sp.plan_validation(ctx, tally, list(tally.block_sumsq), taken=[False, True])
    r = plan.report
    assert plan.actions[0].kind == ("skip" if overflow else "step")
    assert (r.speculated, r.undone, r.redone, r.stepped_late) == ((2, 2, 0, 0) if overflow else (2, 1, 1, 0))
    assert r.committed == (0 if overflow else 1) and r.not_stepped == (2 if overflow else 0)


@pytest.mark.parametrize("missing_grad", ["skip", "zero"])
def test_a_block_undone_whose_gradient_was_withdrawn_is_planned_as_a_block_without_gradient(missing_grad):
    """A caller that undoes a block's speculative step because what arrived was no gradient after all (the offload
    engine under DistributedDataParallel: a parameter found unused on every rank) gives the block no sum of squares
    at validation. It was planned as the step of a late gradient ("step", reported redone) although nothing was
    left to step; it is what a block without gradient is ("skip": not stepped; zeros with missing_grad="zero"),
    reported speculated and undone."""
    scaler = loss_scale.grad_scaler()
    cfg = sp.SpeculationConfig(missing_grad=missing_grad)
    ctx, tally = sp.begin_step(sofx.adamw(), cfg, scaler, scaler.init(), n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 0, 0.0, sp.Eligibility(True, "algebraic", "", 0))
    tally, _ = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    tally = sp.on_late_gradient(ctx, tally, 0, 0.0, undone=True)
    plan = sp.plan_validation(ctx, tally, [None, 1.0], taken=[False, True])
    r = plan.report
    if missing_grad == "skip":
        assert plan.actions[0].kind == "skip" and plan.actions[0].speculated
        assert (r.speculated, r.committed, r.undone, r.redone, r.stepped_late, r.not_stepped) == (2, 1, 1, 0, 0, 1)
    else:
        assert plan.actions[0].kind == "step" and plan.actions[0].zero_grad
        assert (r.speculated, r.committed, r.undone, r.redone, r.stepped_late, r.not_stepped) == (2, 1, 1, 1, 0, 0)


def test_a_max_norm_whose_veto_threshold_is_beyond_float64_speculates_every_block_and_commits(rng):
    """begin_step's veto threshold ``(max_norm * S)**2`` of a max_norm of 1e300 is beyond float64: Python's ``**``
    raised an OverflowError (``*`` gives inf); the threshold is inf and nothing is vetoed, as without clipping."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng), rng)
    rule = loss_scale.grad_scaler()
    ctx, _ = sp.begin_step(opt, sp.SpeculationConfig(max_norm=1e300), rule, rule.init(), n_blocks=4)
    assert ctx.veto_sumsq == math.inf
    spec, ser = _both(opt, params, _grads(rng), state, config=sp.SpeculationConfig(max_norm=1e300))
    assert spec.report.actions == ("commit",) * 4 and not spec.report.clipped
    _compare(spec, ser, spec.report.actions)


@pytest.mark.parametrize("profile, max_norm", [("torch", 0.0), ("torch", math.inf), ("deepspeed", 0.0),
                                               ("deepspeed", math.inf)])
def test_max_norm_0_or_inf_speculate_as_the_serial_loop_steps(rng, profile: str, max_norm: float):
    """A max_norm of 0 under the torch profile clips every step to zero gradients (clip_grad_norm_'s
    ``coef = 0``): no speculative step could stand, and none is taken; the blocks are stepped in validation with
    zero gradients. Under the deepspeed profile 0 means no clipping (ZeRO's ``clip_grad > 0`` test), and inf
    never clips under either: every block is speculated and committed. Each equals the serial loop bit for bit
    (SpeculationConfig refused both values)."""
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1)
    params, state = _warm(opt, _params(rng), rng)
    rule = loss_scale.grad_scaler() if profile == "torch" else loss_scale.deepspeed_scaler()
    cfg = sp.SpeculationConfig(max_norm=max_norm, profile=profile)
    spec, ser = _both(opt, params, _grads(rng, mult=[5.0, 5.0, 0.01, 0.01]), state, config=cfg, scaler=rule)
    r = spec.report
    zeroed = profile == "torch" and max_norm == 0.0
    assert r.clipped == zeroed and (r.clip_coef == 0.0 if zeroed else r.clip_coef == 1.0)
    assert r.actions == (("step",) * 4 if zeroed else ("commit",) * 4) and r.speculated == (0 if zeroed else 4)
    if zeroed:
        assert not r.speculating and "max_norm = 0" in r.not_speculating_reason and r.vetoed == 4
    _compare(spec, ser, r.actions)
    assert not any(torch.equal(a, b) for a, b in zip(spec.params, params))  # momentum and decay moved them


def test_numpy_hparams_are_read_as_python_numbers_and_validate_as_the_values_they_hold(rng):
    """Numpy hparams (torch.optim takes them) were refused ("lr must be a float or a 0-d tensor, got float32"); a
    numpy float64 was kept as given. begin_step reads them as the Python numbers they hold, and validation hparams
    given as numpy numbers of the speculated values commit (the same values: no undo and redo)."""
    np = pytest.importorskip("numpy")
    opt = sofx.adamw(lr=1e-2)
    params, state = _warm(opt, _params(rng, 2), rng)
    grads = _grads(rng, 2)
    rule = loss_scale.grad_scaler()
    given = AdamHParams(lr=np.float32(1e-2), beta2=np.float64(0.99), weight_decay=np.int64(0))
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2, hparams=given)
    assert all(type(x) in (float, int) for hp in ctx.hparams for x in hp)
    blocks = [p.clone() for p in params]
    states = [sofx.AdamState(state.count[i].clone(), state.mu[i].clone(), state.nu[i].clone()) for i in range(2)]
    for i in (1, 0):
        tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]), lambda i=i: sp.block_eligibility(
            opt, blocks[i], grads[i], states[i], ctx.hparams[i], ctx.grad_scale))
        assert d.speculate
        blocks[i], states[i], _ = sp.speculative_block_step(opt, blocks[i], grads[i], states[i], d, donate=True)
    same = AdamHParams(lr=float(np.float32(1e-2)), beta2=0.99, weight_decay=0)
    plan = sp.plan_validation(ctx, tally, list(tally.block_sumsq), hparams=[given, same])
    assert [a.kind for a in plan.actions] == ["commit", "commit"]


def test_the_default_taken_leaves_out_a_block_the_caller_undid_for_a_late_gradient(rng):
    """plan_validation's ``taken`` defaults to the speculative steps that stand: a block whose step the caller
    undid as its late gradient came (``on_late_gradient(undone=True)``) is stepped with the sum, not undone and
    redone a second time (its record is used: the undo_redo planned for it raised an UndoError), and the
    result is the serial loop's; ``taken[i] = True`` for such a block is refused before anything is planned."""
    opt = sofx.adamw(lr=1e-2, weight_decay=0.05)
    params, state = _warm(opt, _params(rng, n=2), rng)
    grads, extra = _grads(rng, n=2, scale=1.0), _grads(rng, n=2, scale=1.0)[0]
    rule = loss_scale.grad_scaler(init_scale=1.0)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2)
    ps = list(params)
    blocks = [sofx.AdamState(state.count[i], state.mu[i], state.nu[i]) for i in range(2)]
    records = [None, None]
    for i in (1, 0):
        el = sp.block_eligibility(opt, ps[i], grads[i], blocks[i], ctx.hparams[i], ctx.grad_scale)
        tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]), el)
        ps[i], blocks[i], records[i] = sp.speculative_block_step(opt, ps[i], grads[i], blocks[i], d)
    ps[0], blocks[0] = opt.undo(ps[0], blocks[0], records[0])  # the caller undoes block 0 as its late gradient comes
    final = [grads[0] + extra, grads[1]]
    tally = sp.on_late_gradient(ctx, tally, 0, sp.grad_sumsq(final[0]), undone=True)
    with pytest.raises(sofx.SofxError, match=r"block 0: taken\[0\] is True but its speculative step was undone"):
        sp.plan_validation(ctx, tally, list(tally.block_sumsq), taken=[True, True])
    plan = sp.plan_validation(ctx, tally, list(tally.block_sumsq))
    assert [a.kind for a in plan.actions] == ["step", "commit"]
    assert (plan.report.speculated, plan.report.undone, plan.report.redone) == (2, 1, 1)
    for i, action in enumerate(plan.actions):
        ps[i], blocks[i] = sp.apply_block_action(opt, action, ps[i], final[i], blocks[i], records[i])
    ser = serial_step(opt, params, final, state, scaler=rule, scaler_state=rule.init())
    for i in range(2):
        assert int(blocks[i].count) == int(ser.state.count[i])
        for a, b in ((ps[i], ser.params[i]), (blocks[i].mu, ser.state.mu[i]), (blocks[i].nu, ser.state.nu[i])):
            assert _rel(a, b) <= 1e-6 if i == 0 else torch.equal(a, b), (i, _rel(a, b))


def test_a_block_undone_at_its_second_late_gradient_is_planned_as_undone_and_releases_its_snapshot():
    """A caller that sums a block's first late gradient out of place (its speculative step stands) and undoes the
    step as a second one comes (``on_late_gradient(undone=True)``) has no step of it left: the tally releases its
    snapshot bytes and counts it undone, and validation steps it with the sum, reported speculated, undone and
    redone, as where the first late gradient undid it."""
    scaler = loss_scale.grad_scaler()
    cfg = sp.SpeculationConfig(snapshot_budget_bytes=1000)
    ctx, tally = sp.begin_step(sofx.adamw(), cfg, scaler, scaler.init(), n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "snapshot", "", 100))
    tally, _ = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    assert tally.snapshot_bytes == 100
    tally = sp.on_late_gradient(ctx, tally, 0, 4.0)
    assert tally.snapshot_bytes == 100 and tally.undone == frozenset()
    tally = sp.on_late_gradient(ctx, tally, 0, 9.0, undone=True)
    assert tally.snapshot_bytes == 0 and tally.undone == {0}
    tally = sp.on_late_gradient(ctx, tally, 0, 16.0, undone=True)  # (nothing more to undo: released once)
    assert tally.snapshot_bytes == 0 and tally.undone == {0}
    plan = sp.plan_validation(ctx, tally, list(tally.block_sumsq), taken=[False, True])
    r = plan.report
    assert [a.kind for a in plan.actions] == ["step", "commit"] and plan.actions[0].speculated
    assert (r.speculated, r.committed, r.undone, r.redone, r.stepped_late) == (2, 1, 1, 1, 0)


@pytest.mark.parametrize("bad", [-1.0, -math.inf, "x", True, torch.ones(2)])
def test_a_sum_of_squares_that_is_not_a_number_at_least_0_is_refused_by_the_block_protocol(bad):
    """A block's sum of squares is a number >= 0 (inf or nan where its gradient is not finite). A negative one
    was taken by plan_validation (-1 beside 1: a norm of 0, the step taken unclipped) and raised "math domain
    error" in on_block_ready; a string or a bool a bare ValueError or TypeError. Each is refused, naming the
    block and what was expected, before the tally or the plan changes; a 1-element tensor or numpy number is
    read as its value."""
    np = pytest.importorskip("numpy")
    scaler = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(sofx.adamw(), sp.SpeculationConfig(max_norm=1.0), scaler, scaler.init(), n_blocks=2)
    eligible = sp.Eligibility(True, "algebraic", "", 0)
    pattern = (r"\(.*\); expected (a block's|block 0's) sum of squares, a real number >= 0 \(inf or nan where "
               r"its gradient is not finite\)")
    with pytest.raises(sofx.SofxError, match=r"on_block_ready: block 0: sumsq is .* " + pattern):
        sp.on_block_ready(ctx, tally, 0, bad, eligible)
    tally, _ = sp.on_block_ready(ctx, tally, 0, torch.tensor([0.25]), eligible)
    tally, _ = sp.on_block_ready(ctx, tally, 1, np.float32(0.5), eligible)
    assert tally.block_sumsq == (0.25, 0.5) and tally.sumsq == 0.75
    with pytest.raises(sofx.SofxError, match=r"on_late_gradient: block 1: sumsq is .* " + pattern):
        sp.on_late_gradient(ctx, tally, 1, bad)
    hook = _RecordingHook()
    with pytest.raises(sofx.SofxError, match=r"plan_validation: sumsq\[0\] is .* " + pattern) as info:
        sp.plan_validation(ctx, tally, [bad, 1.0], reduce_sumsq=hook)
    assert hook.calls == [f"refuse: {info.value}"]
    plan = sp.plan_validation(ctx, tally, [math.nan, 1.0])
    assert plan.report.skipped and [a.kind for a in plan.actions] == ["undo", "undo"]


def test_the_speculative_loop_step_evaluates_a_validation_schedule_at_the_loop_step(rng):
    """speculative_loop_step evaluates ``validation_hparams`` given as a schedule at ``loop.step``, as it does
    ``hparams``: the blocks speculated with the backward's hparams are undone and redone with the schedule's, and
    the loop follows serial_loop_step on that schedule. It was passed on unevaluated and refused, the error telling
    the caller to take loop steps, which evaluate schedules: the very call refused. A schedule returning a number
    is refused naming validation_hparams."""
    from sofx.serial import init_loop, serial_loop_step

    opt = sofx.adamw(lr=1e-2, weight_decay=0.05)
    params = _params(rng, 3, 8)
    rule = loss_scale.grad_scaler(init_scale=1.0)

    def backward_hp(t: int) -> AdamHParams:
        return AdamHParams(lr=1e-2 / (t + 1))

    def schedule(t: int) -> AdamHParams:
        return AdamHParams(lr=1e-2 / (t + 1), weight_decay=0.05 if t % 2 else 0.0)

    spec_loop = ser_loop = init_loop(opt, params, rule)
    for step in range(4):
        grads = _grads(rng, 3, 8, scale=1.0)
        spec_loop, report = sp.speculative_loop_step(opt, spec_loop, grads, config=sp.SpeculationConfig(),
                                                     scaler=rule, hparams=backward_hp, validation_hparams=schedule)
        ser_loop, _ = serial_loop_step(opt, ser_loop, grads, scaler=rule, hparams=schedule)
        assert report.actions == ("undo_redo" if step % 2 == 0 else "commit",) * 3, (step, report.actions)
        assert spec_loop.step == ser_loop.step == step + 1
        for i in range(3):  # (without donation an undone block is its input: the redo is the serial step's bits)
            assert torch.equal(spec_loop.params[i], ser_loop.params[i])
            assert torch.equal(spec_loop.opt_state.mu[i], ser_loop.opt_state.mu[i])
    with pytest.raises(sofx.HParamError, match=r"validation_hparams: the schedule .* returned 0.001 \(float\) at "
                                               r"step 4"):
        sp.speculative_loop_step(opt, spec_loop, grads, config=sp.SpeculationConfig(), scaler=rule,
                                 hparams=backward_hp, validation_hparams=lambda t: 1e-3)


# A late gradient (or any leaf's gradient) whose memory was freed (untyped_storage().resize_(0), as FSDP frees
# tensors) or shrunk: the step added the late one to the leaf's gradient with torch after the leaves were
# speculated (a segmentation fault for a freed one). Refused naming it before any leaf is stepped, the inputs
# unchanged even with donation; run in a subprocess so that a crash fails the test.
_FREED_LATE_GRADIENT = """
import re
import torch
import sofx
from sofx import loss_scale
from sofx import speculate as sp
from sofx.errors import LeafError
from refusal_script import clones, expect_refused

for keep in (0, 11996):  # freed; one element short
    for donate in (False, True):
        for role in ("grads", "late_grads"):
            gen = torch.Generator().manual_seed(0)
            params = [torch.randn(6, generator=gen), torch.randn(3000, generator=gen)]
            grads = [torch.randn(6, generator=gen), torch.randn(3000, generator=gen)]
            late = {1: torch.randn(3000, generator=gen)}
            opt = sofx.adamw(lr=1e-2)
            state = opt.init(params)
            kept = [params[0], params[1], grads[0], state.mu[0], state.mu[1], state.nu[1]]
            (grads[1] if role == "grads" else late[1]).untyped_storage().resize_(keep)
            step = lambda: sp.speculative_step(  # noqa: E731
                opt, params, grads, state, config=sp.SpeculationConfig(max_norm=100.0),
                scaler=loss_scale.static_scale(), scaler_state=loss_scale.static_scale().init(), late_grads=late,
                donate=donate)
            expect_refused(f"{keep} {donate} {role}", step, LeafError,
                           rf"{re.escape(role)}\\[1\\]: its storage holds {keep} bytes.*reach byte 12000", clones(kept))
print("ok")
"""


def test_a_late_gradient_whose_storage_was_freed_or_shrunk_is_refused_before_any_leaf_is_stepped():
    script_prints_ok(_FREED_LATE_GRADIENT)


def test_leaf_paths_name_leaves_in_order_and_late_grads(rng):
    """Leaf indices are optree's flatten order: a dict's keys sorted, not inserted (``{"w": .., "b": ..}``: leaf 0
    is ``b``), so an index counted as ``model.named_parameters()`` lists the parameters names another leaf -- for
    a late gradient of the same shape, without a word. ``order`` and ``late_grads`` take the leaf paths
    ``sofx.tree.leaf_paths(params)`` writes (``"params['w']"``) as well: the step equals the one given the right
    indices, bitwise; a path that is not one of params', and two keys naming one leaf, are refused naming them."""
    opt = sofx.adamw(lr=1e-2)
    w, b = _warm(opt, _params(rng, 2), rng)[0]
    params = {"w": w, "b": b}  # inserted w, b; flattened b, w
    state = opt.init(params)
    grads = dict(zip(("w", "b"), _grads(rng, 2)))
    late = torch.randn(6, generator=rng) * 0.01 * S16
    rule = loss_scale.grad_scaler()
    kw = dict(config=sp.SpeculationConfig(), scaler=rule, scaler_state=rule.init())
    assert sofx.tree.leaf_paths(params) == ["params['b']", "params['w']"]
    want = sp.speculative_step(opt, params, grads, state, order=[0, 1], late_grads={1: late}, **kw)
    got = sp.speculative_step(opt, params, grads, state, order=["params['b']", "params['w']"],
                              late_grads={"params['w']": late}, **kw)
    assert got.report == want.report and got.report.actions == ("commit", "undo_redo")
    assert torch.equal(got.params["w"], want.params["w"]) and torch.equal(got.params["b"], want.params["b"])
    assert not torch.equal(got.params["w"], sp.speculative_step(opt, params, grads, state, **kw).params["w"])
    mixed = sp.speculative_step(opt, params, grads, state, order=[0, "params['w']"], late_grads={"params['w']": late},
                                **kw)
    assert torch.equal(mixed.params["w"], want.params["w"])
    # a top-level dict key alone names its leaf too (as checkpoint groups name leaves: "0.weight" of a flat dict of
    # model.named_parameters()); a key that is also another leaf's path is refused
    by_key = sp.speculative_step(opt, params, grads, state, order=["b", "w"], late_grads={"w": late}, **kw)
    assert torch.equal(by_key.params["w"], want.params["w"]) and by_key.report == want.report
    odd = {"w": params["w"], "params['w']": params["b"]}
    with pytest.raises(sofx.SofxError, match=r"late_grads\[\"params\['w'\]\"\]: .* names 2 leaves of params"):
        sp.speculative_step(opt, odd, odd, opt.init(odd), late_grads={"params['w']": late}, **kw)
    leaves = lambda: [t.clone() for t in sofx.tree.flatten((params, state))[0]]  # noqa: E731
    before = leaves()
    with pytest.raises(sofx.SofxError, match=r"late_grads\['W'\]: 'W' is not a leaf path of params .*"
                                             r"\"params\['b'\]\", \"params\['w'\]\"\)$"):
        sp.speculative_step(opt, params, grads, state, late_grads={"W": late}, donate=True, **kw)
    with pytest.raises(sofx.SofxError, match=r"late_grads\[\"grads\['w'\]\"\]: .* is not a leaf path of params .*"
                                             r"did you mean \"params\['w'\]\"\?"):
        sp.speculative_step(opt, params, grads, state, late_grads={"grads['w']": late}, donate=True, **kw)
    with pytest.raises(sofx.SofxError, match=r"late_grads\[1\] and late_grads\[\"params\['w'\]\"\] both name "
                                             r"params\['w'\]"):
        sp.speculative_step(opt, params, grads, state, late_grads={1: late, "params['w']": late}, donate=True, **kw)
    with pytest.raises(sofx.SofxError, match=r"order\[1\]: 'params\[\"w\"\]' is not a leaf path of params"):
        sp.speculative_step(opt, params, grads, state, order=[0, 'params["w"]'], donate=True, **kw)
    with pytest.raises(sofx.SofxError, match="order must be a permutation of the 2 leaf indices"):
        sp.speculative_step(opt, params, grads, state, order=[1, "params['w']"], donate=True, **kw)
    with pytest.raises(sofx.LeafError, match=r"late_grads\[\"params\['w'\]\"\]: expected a tensor like the leaf's "
                                             r"gradient \(grads of params\['w'\]: shape \(6,\)"):
        sp.speculative_step(opt, params, grads, state, late_grads={"params['w']": torch.ones(5)}, donate=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, leaves()))


class _CountedPath(str):
    """A leaf path whose comparisons are counted (a str subclass's ``__eq__`` is asked first, either side)."""

    compared = 0

    def __eq__(self, other):
        type(self).compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_leaf_paths_are_found_without_a_pass_over_the_leaves_per_path(rng):
    """``order`` and ``late_grads`` given as leaf paths were each looked up by comparing it with every leaf's path:
    a pass over the leaves per path, quadratic in the leaves for an order of paths (measured: 2000 leaves, 1.07 s
    a step against 0.34 s with indices). A path is looked up at once; the step is the one of indices."""
    opt = sofx.adamw(lr=1e-2)
    n = 48
    params = {f"w{i:02d}": t for i, t in enumerate(_params(rng, n, 2))}
    grads = dict(zip(params, _grads(rng, n, 2)))
    state = opt.init(params)
    rule = loss_scale.grad_scaler()
    kw = dict(config=sp.SpeculationConfig(), scaler=rule, scaler_state=rule.init())
    paths = sofx.tree.leaf_paths(params)
    _CountedPath.compared = 0
    got = sp.speculative_step(opt, params, grads, state, order=[_CountedPath(p) for p in reversed(paths)],
                              late_grads={_CountedPath(paths[3]): grads["w03"] * 0.5}, **kw)
    assert _CountedPath.compared <= 4 * (n + 1)
    want = sp.speculative_step(opt, params, grads, state, late_grads={3: grads["w03"] * 0.5}, **kw)
    assert got.report == want.report
    assert all(torch.equal(got.params[k], want.params[k]) for k in params)
    # two leaves whose paths read the same (keys of equal repr) are both named by that path: refused as before
    first, second = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    same = {first: params["w00"], second: params["w01"]}
    path = sofx.tree.leaf_paths(same)[0]
    with pytest.raises(sofx.SofxError, match=r"order\[0\]: .* names 2 leaves of params"):
        sp.speculative_step(opt, same, {first: grads["w00"], second: grads["w01"]}, opt.init(same), order=[path, 1],
                            **kw)


def test_plan_validation_refuses_sums_or_taken_that_are_not_one_entry_per_block_in_order():
    """plan_validation's sumsq and taken hold one entry per block, block i at [i]. A dict by block name raised a
    bare KeyError (0) from sumsq[0], or was read by its keys (taken: "taken[0] = 'w' is invalid"); a generator or
    a number a bare TypeError ("object of type 'generator' has no len()"). Now a SofxError names the argument and
    says what it takes, after telling the hook; a tensor or an array of sums is still taken."""
    import numpy as np

    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2)
    for kw, name, kind in (({"sumsq": {"w": 1.0, "b": 1.0}}, "sumsq", "dict"),
                           ({"sumsq": (s for s in (1.0, 1.0))}, "sumsq", "generator"),
                           ({"sumsq": 5.0}, "sumsq", "float"), ({"sumsq": "ab"}, "sumsq", "str"),
                           ({"sumsq": 5}, "sumsq", "int"),  # ('is a int': sofx.tree.article now)
                           ({"sumsq": [1.0, 1.0], "taken": {"w": False, "b": False}}, "taken", "dict"),
                           ({"sumsq": [1.0, 1.0], "taken": (t for t in (False, False))}, "taken", "generator")):
        hook = _RecordingHook()
        with pytest.raises(sofx.SofxError, match=rf"^plan_validation: {name} is {tree.article(kind)}; expected a "
                                                 r"sequence of "
                                                 r"one .* per block, block i at \[i\]"):
            sp.plan_validation(ctx, tally, reduce_sumsq=hook, **kw)
        assert hook.calls and hook.calls[0].startswith("refuse: "), hook.calls
    for sums in (torch.tensor([1.0, 2.0]), np.array([1.0, 2.0]), (1.0, 2.0)):
        assert sp.plan_validation(ctx, tally, sums, taken=np.array([False, False])).report.grad_norm == 3 ** 0.5 / S16


def test_an_int_that_is_a_dict_key_of_another_leaf_than_its_index_is_refused_in_late_grads_and_order(rng):
    """An int in ``late_grads`` (or ``order``) is a leaf index, optree's flatten order. Where params are a dict
    with int keys (``dict(enumerate(layers, 1))``, an ``OrderedDict`` in another order), the int that is one leaf's
    key is another leaf's index: ``late_grads={1: g}`` for ``{1: a, 2: b}`` was summed into ``params[2]``'s
    gradient (leaf 1), a late gradient of the same shape given to the wrong leaf without a word. Such an int is
    refused naming both leaves and their paths, which name the leaf without doubt; an int that is its own key's
    index (``{0: a, 1: b}``) is taken."""
    from collections import OrderedDict

    opt = sofx.adamw(lr=1e-2)
    (a, b), _ = _warm(opt, _params(rng, 2), rng)
    late = torch.randn(6, generator=rng) * 0.01 * S16
    rule = loss_scale.grad_scaler()
    kw = dict(config=sp.SpeculationConfig(), scaler=rule, scaler_state=rule.init())
    for params, key, other in (({1: a, 2: b}, 1, 1), (OrderedDict([(1, a), (0, b)]), 0, 0),
                               ({5: a, 7: b}, 5, None)):
        grads = type(params)((k, torch.randn(6, generator=rng) * 0.02 * S16) for k in params)
        state = opt.init(params)
        before = _snapshot(list(params.values()), sofx.AdamState(*(list(x.values()) for x in state)))
        meant = f"params[{key}]"
        read = (rf"is no leaf index \(params has 2 leaves\) but" if other is None else
                rf"is a leaf index \(leaf {other}: {re.escape(sofx.tree.leaf_paths(params)[other])}\) and")
        with pytest.raises(sofx.SofxError, match=rf"^late_grads\[{key}\]: {key} {read} the key of "
                                                 rf"{re.escape(meant)} .*name the leaf by its path"):
            sp.speculative_step(opt, params, grads, state, late_grads={key: late}, donate=True, **kw)
        with pytest.raises(sofx.SofxError, match=rf"^order\[0\]: {key} {read} the key of "):
            sp.speculative_step(opt, params, grads, state, order=[key, 1 - key if key < 2 else 0], donate=True,
                                **kw)
        assert _unchanged(before, list(params.values()), sofx.AdamState(*(list(x.values()) for x in state)))
        # the path names the leaf meant: its gradient gets the late one
        got = sp.speculative_step(opt, params, grads, state, late_grads={meant: late}, **kw)
        want = sp.speculative_step(opt, params, {k: g + late if k == key else g for k, g in grads.items()}, state,
                                   **kw)
        assert all(torch.equal(got.params[k], want.params[k]) for k in params)
    params = {0: a, 1: b}  # each int key is its own leaf's index: taken
    grads = {k: torch.randn(6, generator=rng) * 0.02 * S16 for k in params}
    got = sp.speculative_step(opt, params, grads, opt.init(params), order=[1, 0], late_grads={1: late}, **kw)
    want = sp.speculative_step(opt, params, grads, opt.init(params), late_grads={"params[1]": late}, **kw)
    assert torch.equal(got.params[1], want.params[1]) and got.report.actions == ("commit", "undo_redo")


def _two_speculated_blocks(opt, rng, late_block: int = 1, donate: bool = True):
    """Two blocks of 6 elements, both speculated with donation through the block protocol, a late gradient for
    ``late_block``: block 0's action is commit, block 1's undo_redo (or the other way); ``donate=False``: the
    speculative steps without donation. Returns the blocks,
    their gradients (final), states, records and the plan."""
    params, state = _warm(opt, _params(rng, 2), rng)
    blocks = [p.clone() for p in params]
    states = [sofx.AdamState(state.count[i].clone(), state.mu[i].clone(), state.nu[i].clone()) for i in range(2)]
    grads = _grads(rng, 2)
    rule = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=2)
    records = [None, None]
    for i in (1, 0):
        tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]),
                                     sp.block_eligibility(opt, blocks[i], grads[i], states[i], ctx.hparams[i],
                                                          ctx.grad_scale))
        blocks[i], states[i], records[i] = sp.speculative_block_step(opt, blocks[i], grads[i], states[i], d,
                                                                     donate=donate)
    grads[late_block] = grads[late_block] + torch.randn(6, generator=rng) * 0.01 * S16
    tally = sp.on_late_gradient(ctx, tally, late_block, sp.grad_sumsq(grads[late_block]))
    plan = sp.plan_validation(ctx, tally, list(tally.block_sumsq))
    return blocks, grads, states, records, plan


def test_apply_block_action_refuses_the_tensors_and_record_of_another_block(rng):
    """apply_block_action carries one block's action out on the tensors given. Given another block's tensors and
    record (a list in arrival order zipped with plan.actions, in block order), it carried the action out on them:
    block 1's undo_redo on block 0 (block 1's speculative step left standing), block 0's commit on block 1 (its
    stale step kept), without a word. The record of a speculative step says whose block it is: another block's is
    refused naming both, before anything is written; the right pairing steps on."""
    opt = sofx.adamw(lr=1e-2)
    blocks, grads, states, records, plan = _two_speculated_blocks(opt, rng)
    assert [a.kind for a in plan.actions] == ["commit", "undo_redo"]
    before = [t.clone() for t in (*blocks, *(s.mu for s in states), *(s.nu for s in states))]
    for i, j in ((1, 0), (0, 1)):
        with pytest.raises(sofx.SofxError, match=rf"^apply_block_action: plan\.actions\[{i}\] is block {i}'s; the "
                                                 rf"record given is of block {j}'s speculative step"):
            sp.apply_block_action(opt, plan.actions[i], blocks[j], grads[j], states[j], records[j], donate=True)
    after = [*blocks, *(s.mu for s in states), *(s.nu for s in states)]
    assert all(torch.equal(a, b) for a, b in zip(after, before)) and not any(r.used for r in records)
    for i, a in enumerate(plan.actions):
        blocks[i], states[i] = sp.apply_block_action(opt, a, blocks[i], grads[i], states[i], records[i], donate=True)
    assert records[1].used and [int(s.count) for s in states] == [3, 3]



def test_a_step_or_undo_action_applied_a_second_time_is_refused(rng):
    """A plan's action is one block's step for this step (SPECULATION.md: one step per block per step). A ``step``
    action applied again (a loop over plan.actions run twice, a retry) stepped the block a second time, counted
    twice, without a word; an undo_redo's second application raised the record's "already used". Each action that
    writes (step, undo, undo_redo) can be applied once, as a record can be used once: a second application is
    refused naming the block, changing nothing; commit and skip, which write nothing, may be applied again."""
    opt = sofx.adamw(lr=1e-2)
    rule, param, grad, state, decision, plan = _one_speculated_block_not_taken(opt, rng)
    (action,) = plan.actions
    assert action.kind == "step"
    p1, s1 = sp.apply_block_action(opt, action, param, grad, state, donate=True)
    stepped = p1.clone()
    for again in (action, action._replace(reason="again")):  # (a copy made by _replace is the same action)
        with pytest.raises(sofx.SofxError, match=r"^apply_block_action: block 0: plan\.actions\[0\] \(step\) was "
                                                 r"applied already"):
            sp.apply_block_action(opt, again, p1, grad, s1, donate=True)
    assert torch.equal(p1, stepped) and int(s1.count) == 1
    blocks, grads, states, records, plan = _two_speculated_blocks(opt, rng)
    for i, a in enumerate(plan.actions):
        blocks[i], states[i] = sp.apply_block_action(opt, a, blocks[i], grads[i], states[i], records[i], donate=True)
    with pytest.raises(sofx.SofxError, match=r"block 1: plan\.actions\[1\] \(undo_redo\) was applied already"):
        sp.apply_block_action(opt, plan.actions[1], blocks[1], grads[1], states[1], records[1], donate=True)
    assert sp.apply_block_action(opt, plan.actions[0], blocks[0], grads[0], states[0], records[0])[0] is blocks[0]


def test_a_deep_copied_action_shares_whether_it_was_applied_as_a_copy_does(rng):
    """An action's "applied" cell was shared with its _replace and copy.copy copies but not with copy.deepcopy's
    (nor a deep-copied plan's), which got a cell of their own: a deep copy of a step action applied after the
    original stepped the block a second time, counted twice. A deep copy shares the cell, as an undo record's
    deep copy shares whether it was used; its fields and context_id are the original's."""
    opt = sofx.adamw(lr=1e-2)
    rule, param, grad, state, decision, plan = _one_speculated_block_not_taken(opt, rng)
    (action,) = plan.actions
    deep, deep_plan = copy.deepcopy(action), copy.deepcopy(plan)
    assert deep == action and deep.context_id == action.context_id != 0 and deep_plan.actions == plan.actions
    p1, s1 = sp.apply_block_action(opt, action, param, grad, state, donate=True)
    stepped = p1.clone()
    for again in (copy.copy(action), deep, deep_plan.actions[0], copy.deepcopy(action)):
        with pytest.raises(sofx.SofxError, match=r"^apply_block_action: block 0: plan\.actions\[0\] \(step\) was "
                                                 r"applied already"):
            sp.apply_block_action(opt, again, p1, grad, s1, donate=True)
    assert torch.equal(p1, stepped) and int(s1.count) == 1


def test_a_commit_given_a_record_whose_step_was_undone_is_refused(rng):
    """A commit keeps the block's speculative step as it stands. Given the record of a step the caller undid since
    (opt.undo, without telling plan_validation, taken=[False]), it returned the block as it was, without the step,
    and the report counted it committed. Refused, naming the block: the plan was made for a step that stands (as a
    step given a record that was not used is refused)."""
    opt = sofx.adamw(lr=1e-2)
    rule, param, grad, state, decision, _ = _one_speculated_block_not_taken(opt, rng)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1)
    tally, decision = sp.on_block_ready(ctx, tally, 0, sp.grad_sumsq(grad), sp.Eligibility(True, "algebraic", "", 0))
    p1, s1, record = sp.speculative_block_step(opt, param, grad, state, decision)
    plan = sp.plan_validation(ctx, tally, [sp.grad_sumsq(grad)])
    assert plan.actions[0].kind == "commit"
    assert sp.apply_block_action(opt, plan.actions[0], p1, grad, s1, record)[0] is p1  # (a step that stands)
    p0, s0 = opt.undo(p1, s1, record)
    with pytest.raises(sofx.SofxError, match=r"^apply_block_action: block 0: a commit, but the record given was "
                                             r"used \(its speculative step was undone\)"):
        sp.apply_block_action(opt, plan.actions[0], p0, grad, s0, record)


def test_a_skip_given_the_record_of_a_speculative_step_that_stands_is_refused(rng):
    """A skip leaves the block as it is. Given the record of a speculative step that stands (not undone: the plan was
    told taken=[False] though the step ran), it kept that step on an overflow step that is skipped (the block
    stepped, its count advanced, the report saying not stepped). Refused, naming the block, as a step given such
    a record is."""
    opt = sofx.adamw(lr=1e-2)
    rule = loss_scale.grad_scaler()
    param, grad = torch.randn(4, generator=rng), torch.randn(4, generator=rng)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1)
    tally, decision = sp.on_block_ready(ctx, tally, 0, sp.grad_sumsq(grad), sp.Eligibility(True, "algebraic", "", 0))
    p1, s1, record = sp.speculative_block_step(opt, param, grad, opt.init(param), decision)
    plan = sp.plan_validation(ctx, tally, [math.inf], taken=[False])  # (an overflow elsewhere)
    assert plan.actions[0].kind == "skip" and plan.report.skipped
    with pytest.raises(sofx.SofxError, match=r"^apply_block_action: block 0: a skip, but the record given is of the "
                                             r"block's speculative step, which stands"):
        sp.apply_block_action(opt, plan.actions[0], p1, grad, s1, record)
    assert sp.apply_block_action(opt, plan.actions[0], param, grad, opt.init(param))[0] is param


def test_the_actions_of_a_step_validated_twice_are_applied_once_per_block(rng):
    """plan_validation called twice on one step's tally (a retry, a plan made again to inspect it) made actions of
    their own: a block stepped by the first plan's step action was stepped again by the second's, counted twice.
    The actions of one step's plans share each block's applied marker: the second is refused, naming the block,
    nothing written; a plan made again but not applied changes nothing."""
    opt = sofx.adamw(lr=1e-2)
    rule = loss_scale.grad_scaler()
    param, grad = torch.randn(4, generator=rng), torch.randn(4, generator=rng)
    state = opt.init(param)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(enabled=False), rule, rule.init(), n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 0, sp.grad_sumsq(grad), sp.Eligibility(True, "algebraic", "", 0))
    first, again = (sp.plan_validation(ctx, tally, [sp.grad_sumsq(grad), None]) for _ in range(2))
    assert [a.kind for a in first.actions] == [a.kind for a in again.actions] == ["step", "skip"]
    p1, s1 = sp.apply_block_action(opt, again.actions[0], param, grad, state, donate=True)
    stepped = p1.clone()
    with pytest.raises(sofx.SofxError, match=r"^apply_block_action: block 0: plan\.actions\[0\] \(step\) was "
                                             r"applied already"):
        sp.apply_block_action(opt, first.actions[0], p1, grad, s1, donate=True)
    assert torch.equal(p1, stepped) and int(s1.count) == 1
    ctx2, tally2 = sp.begin_step(opt, sp.SpeculationConfig(enabled=False), rule, rule.init(), n_blocks=2)
    tally2, _ = sp.on_block_ready(ctx2, tally2, 0, sp.grad_sumsq(grad), sp.Eligibility(True, "algebraic", "", 0))
    plan = sp.plan_validation(ctx2, tally2, [sp.grad_sumsq(grad), None])  # (another step: its own markers)
    assert int(sp.apply_block_action(opt, plan.actions[0], p1, grad, s1, donate=True)[1].count) == 2


def test_a_pickled_copy_of_an_action_carries_whether_it_was_applied_when_pickled(rng):
    """BlockAction's docstring: a pickled copy (the process executor's worker gets one) carries the applied marker as
    it was when pickled, and is its own from then on in another process (in the one that pickled it, it is refused:
    test_a_pickled_copy_of_an_action_or_decision_is_refused_in_the_process_that_pickled_it)."""
    import pickle

    opt = sofx.adamw(lr=1e-2)
    rule, param, grad, state, decision, plan = _one_speculated_block_not_taken(opt, rng)
    (action,) = plan.actions
    before = pickle.loads(pickle.dumps(action))
    assert before == action and before.context_id == action.context_id and not before.applied_cell()[0]
    p1, s1 = sp.apply_block_action(opt, action, param, grad, state, donate=True)
    after = pickle.loads(pickle.dumps(action))
    with pytest.raises(sofx.SofxError, match=r"plan\.actions\[0\] \(step\) was applied already"):
        sp.apply_block_action(opt, after, p1, grad, s1, donate=True)
    assert not before.applied_cell()[0] and int(s1.count) == 1


def test_a_pickled_copy_of_an_action_or_decision_is_refused_in_the_process_that_pickled_it(rng, monkeypatch):
    """A pickled copy of a BlockAction made before the original was applied carried a fresh marker of its own: applied
    after the original in the same process (a plan pickled to a log, a queue in-process), it stepped the block a
    second time without a word (count 2); so did a pickled copy of a BlockDecision with its speculative step. Such a
    copy is refused in the process that pickled it, naming the block, nothing written; in another process (the
    process executor's worker) it is the one applied there."""
    import pickle

    from sofx.speculation import decisions

    opt = sofx.adamw(lr=1e-2)
    rule, param, grad, state, decision, plan = _one_speculated_block_not_taken(opt, rng)
    (action,) = plan.actions
    copied = pickle.loads(pickle.dumps(action))
    p1, s1 = sp.apply_block_action(opt, action, param.clone(), grad, state, donate=True)
    stepped = p1.clone()
    with pytest.raises(sofx.SofxError, match=r"^apply_block_action: block 0: plan\.actions\[0\] \(step\) is a "
                                             r"pickled copy, loaded in the process that pickled it"):
        sp.apply_block_action(opt, copied, p1, grad, s1, donate=True)
    assert torch.equal(p1, stepped) and int(s1.count) == 1
    again = pickle.loads(pickle.dumps(copied))  # (and a copy of the copy, pickled again here)
    with pytest.raises(sofx.SofxError, match=r"is a pickled copy, loaded in the process that pickled it"):
        sp.apply_block_action(opt, again, p1, grad, s1, donate=True)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1)
    _, d = sp.on_block_ready(ctx, tally, 0, sp.grad_sumsq(grad), sp.Eligibility(True, "algebraic", "", 0))
    d_copy = pickle.loads(pickle.dumps(d))
    assert d_copy == d and copy.copy(d_copy).used_cell() is d_copy.used_cell()
    with pytest.raises(sofx.SofxError, match=r"^speculative_block_step: block 0: the decision is a pickled copy, "
                                             r"loaded in the process that pickled it.*Nothing was written"):
        sp.speculative_block_step(opt, p1, grad, s1, d_copy, donate=True)
    assert torch.equal(p1, stepped) and int(s1.count) == 1
    assert copy.copy(action).applied_cell() is action.applied_cell()  # (copy.copy shares the marker, as before)
    pid = os.getpid()
    monkeypatch.setattr(decisions.os, "getpid", lambda: pid + 1)  # (as the worker process loads it)
    assert int(sp.speculative_block_step(opt, param.clone(), grad, state, d_copy)[1].count) == 1


def test_the_protocols_per_block_flags_take_bool_tensors_and_arrays_as_taken_does():
    """The block protocol's flags state facts of the step (a step that ran, a block stepped in float64, one that may
    be stepped, an undone step, an eligible block), which an engine may compute with torch or numpy: plan_validation
    took ``taken`` as a numpy array, and said it takes a tensor ("a list, a tuple, a tensor"), but refused each
    entry of a bool tensor ("taken[0] = tensor(False) is invalid"); begin_step refused ``stepped``/``float64`` as an
    array or tensor ("must be a sequence"), and undone, last_micro_step and an Eligibility's eligible refused
    a 0-d bool tensor. Each takes a 0-d bool tensor as its value (and the per-block ones an array or tensor of
    them), as loss_scale takes its overflow flag, the plan and report equal to those of Python bools; a number,
    a string or a tensor of another dtype or shape stays refused naming the entry."""
    np = pytest.importorskip("numpy")
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    cfg = sp.SpeculationConfig()
    T, F = torch.tensor(True), torch.tensor(False)

    def run(flags):
        ctx, tally = sp.begin_step(opt, cfg, rule, rule.init(), n_blocks=3, last_micro_step=flags(True),
                                   stepped=flags([True, True, False]), float64=flags([False, True, False]))
        tally, _ = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(flags(True), "algebraic", "", 0))
        tally, _ = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(flags(True), "algebraic", "", 0))
        tally = sp.on_late_gradient(ctx, tally, 1, 2.0, undone=flags(True))
        return ctx.speculating, ctx.float64, tally.undone, sp.plan_validation(
            ctx, tally, [1.0, 2.0, None], taken=flags([False, False, False]), stepped=flags([True, True, False]))

    def as_tensor(x):
        return torch.tensor(x)

    def as_array(x):
        return np.array(x) if isinstance(x, list) else np.bool_(x)

    want = run(lambda x: x)
    assert [a.kind for a in want[3].actions] == ["step", "step", "skip"]
    for flags in (as_tensor, as_array, lambda x: [T if y else F for y in x] if isinstance(x, list) else x):
        got = run(flags)
        assert got[:3] == want[:3] and got[3].actions == want[3].actions and got[3].report == want[3].report
    ctx, tally = sp.begin_step(opt, cfg, rule, rule.init(), n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    for bad in (torch.tensor(1), torch.tensor([True]), torch.tensor(1.0)):
        with pytest.raises(sofx.SofxError, match=r"^taken\[0\] = .* is invalid; expected a bool"):
            sp.plan_validation(ctx, tally, [1.0, 1.0], taken=[bad, False])
        with pytest.raises(sofx.HParamError, match=r"^stepped\[1\] must be a bool, got a torch\.\w+ tensor"):
            sp.begin_step(opt, cfg, rule, rule.init(), n_blocks=2, stepped=[True, bad])
        with pytest.raises(sofx.HParamError, match=r"^on_late_gradient: undone = .* is invalid; expected a bool"):
            sp.on_late_gradient(ctx, tally, 0, 4.0, undone=bad)
    for bad in ({0: True, 1: True}, "ab", 3):
        with pytest.raises(sofx.HParamError, match=r"^float64 must be a sequence of one bool per block"):
            sp.begin_step(opt, cfg, rule, rule.init(), n_blocks=2, float64=bad)


def test_a_step_action_given_the_standing_record_of_the_blocks_speculative_step_is_refused(rng):
    """A ``step`` action is planned for a block whose speculative step did not run or was undone. Given the
    record of a speculative step of the block that still stands (not undone: ``taken=[False]`` said of a step that
    ran), apply_block_action stepped the block from its speculated values: two steps, counted twice, without a
    word. It is refused naming the block and ``taken``, nothing written; the record stays usable (its undo brings
    the block back)."""
    opt = sofx.adamw(lr=1e-2)
    _, param, grad, state, ctx, tally, decision = _one_ready_block(opt, rng)
    p1, s1, record = sp.speculative_block_step(opt, param.clone(), grad, state, decision, donate=True)
    (action,) = sp.plan_validation(ctx, tally, [sp.grad_sumsq(grad)], taken=[False]).actions
    assert action.kind == "step"
    before = [t.clone() for t in (p1, s1.mu, s1.nu)]
    with pytest.raises(sofx.SofxError, match=r"^apply_block_action: block 0: a step action, but the record given is "
                                             r"of the block's speculative step, which stands"):
        sp.apply_block_action(opt, action, p1, grad, s1, record, donate=True)
    assert all(torch.equal(a, b) for a, b in zip((p1, s1.mu, s1.nu), before)) and int(s1.count) == 1
    back, s0 = opt.undo(p1, s1, record)
    assert int(s0.count) == 0 and _rel(back, param) <= 1e-6
    p2, s2 = sp.apply_block_action(opt, action, back, grad, s0, record)  # (a used record: the step from the undone)
    assert int(s2.count) == 1


def _a_kept_decision_and_this_steps(rng, hparams=None):
    """One block's decision of an earlier step (kept, never used there) and this step's (its hparams ``hparams``),
    for adamw(lr=1e-2) and a GradScaler: ``(opt, param, grad, state, ctx1, old, ctx, tally, decision)``."""
    opt = sofx.adamw(lr=1e-2)
    rule = loss_scale.grad_scaler()
    param, grad = torch.randn(4, generator=rng), torch.randn(4, generator=rng) * S16
    state = opt.init(param)
    el = sp.Eligibility(True, "algebraic", "", 0)
    ctx1, tally1 = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1)
    _, old = sp.on_block_ready(ctx1, tally1, 0, sp.grad_sumsq(grad), el)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(), rule, rule.init(), n_blocks=1, hparams=hparams)
    tally, decision = sp.on_block_ready(ctx, tally, 0, sp.grad_sumsq(grad), el)
    return opt, param, grad, state, ctx1, old, ctx, tally, decision


def test_a_decision_of_another_step_is_refused_where_its_record_meets_this_steps_action(rng):
    """A BlockDecision did not say which step it is of: speculative_block_step took one of an earlier step (an
    engine that kept a stale decision) and stepped with its hparams (lr 1e-2 where this step's is 3e-2), and
    validation, comparing this step's tally's decision, committed that step without a word. A decision carries its
    step's context_id, and so do the record of its speculative step and the plan's actions: apply_block_action
    refuses a record of another step's decision (commit included) naming both steps, before anything is written;
    the record still undoes the block. A tally whose decision is of another step is refused by plan_validation."""
    hp = sofx.AdamHParams(lr=3e-2)
    opt, param, grad, state, ctx1, old, ctx, tally, decision = _a_kept_decision_and_this_steps(rng, hp)
    assert old.context_id == ctx1.context_id != decision.context_id == ctx.context_id
    p1, s1, record = sp.speculative_block_step(opt, param.clone(), grad, state, old)
    (action,) = sp.plan_validation(ctx, tally, [sp.grad_sumsq(grad)]).actions
    assert action.kind == "commit" and action.context_id == ctx.context_id
    with pytest.raises(sofx.SofxError, match=r"^apply_block_action: block 0: the record given is of a speculative "
                                             r"step of another step's decision"):
        sp.apply_block_action(opt, action, p1, grad, s1, record)
    back, s0 = opt.undo(p1, s1, record)
    assert int(s0.count) == 0 and _rel(back, param) <= 1e-6
    p2, s2, record = sp.speculative_block_step(opt, back, grad, s0, decision)
    assert sp.apply_block_action(opt, action, p2, grad, s2, record)[0] is p2
    want, _, _ = opt.update(param, grad, state, hp, grad_scale=ctx.grad_scale)
    assert torch.equal(p2, want)
    mixed = tally._replace(decisions=(old,))
    with pytest.raises(sofx.SofxError, match=r"^plan_validation: the tally's decisions\[0\] is of another step"):
        sp.plan_validation(ctx, mixed, [sp.grad_sumsq(grad)])


def test_block_eligibility_refuses_a_bad_grads_finite_rather_than_call_the_block_ineligible(rng):
    """block_eligibility says bad inputs raise as Adam.update would; a ``grads_finite`` it refuses ("no", a number)
    came back as an Eligibility(False, reason="grads_finite = 'no' is invalid ..."): the caller's own argument
    reported as the block's undo strategy, the block stepped late without a raise. It raises, naming it; a numpy or
    0-d tensor bool is read as before."""
    opt = sofx.adamw(lr=1e-2)
    param, grad = torch.randn(4, generator=rng), torch.randn(4, generator=rng)
    state = opt.init(param)
    for bad in ("no", 1.0):
        with pytest.raises(sofx.UnsupportedError, match=r"^grads_finite = .* is invalid"):
            sp.block_eligibility(opt, param, grad, state, sofx.AdamHParams(), 1.0, grads_finite=bad)
    for good in (np.bool_(True), torch.tensor(True), None):
        assert sp.block_eligibility(opt, param, grad, state, sofx.AdamHParams(), 1.0, grads_finite=good).eligible


def test_block_eligibility_of_a_tree_block_combines_its_leaves(rng):
    """A block may be a pytree (speculative_block_step and apply_block_action take one); block_eligibility raised
    Python's bare ValueError ("too many values to unpack") for a block of two leaves, and a bare AttributeError
    ("'list' object has no attribute 'numel'") for one of a single leaf that needs a snapshot. It combines the
    leaves: ineligible where one is, else the costliest strategy, the leaves' reasons and the sum of their snapshot
    bytes (what Adam.update's record of the block keeps); a leaf without gradient counts for nothing."""
    opt = sofx.adamw(lr=1e-2)
    ps = [torch.randn(4, generator=rng), torch.randn(3, generator=rng)]
    gs = [torch.randn(4, generator=rng), torch.randn(3, generator=rng)]
    state = opt.init(ps)
    el = sp.block_eligibility(opt, ps, gs, state, sofx.AdamHParams(), 1.0)
    assert el == sp.Eligibility(True, "algebraic", "", 0)
    el = sp.block_eligibility(opt, ps, gs, state, sofx.AdamHParams(beta1=0.0), 1.0)
    assert el.eligible and el.strategy == "snapshot" and "beta1 = 0.0" in el.reason
    _, _, record = opt.update(ps, gs, state, sofx.AdamHParams(beta1=0.0))
    assert el.snapshot_bytes == record.snapshot_bytes() == 3 * 4 * (4 + 3)
    one = sp.block_eligibility(opt, [ps[0]], [gs[0]], opt.init([ps[0]]), sofx.AdamHParams(beta1=0.0), 1.0)
    assert one.snapshot_bytes == 3 * 4 * 4
    half = sp.block_eligibility(opt, ps, [gs[0], None], state, sofx.AdamHParams(beta1=0.0), 1.0)
    assert half.snapshot_bytes == 3 * 4 * 4
    assert not sp.block_eligibility(opt, ps, [None, None], state, sofx.AdamHParams(), 1.0).eligible


def test_snapshot_bytes_of_names_what_it_refuses_and_sums_a_tree_block(rng):
    """sofx.speculation.apply.snapshot_bytes_of raised Python's bare AttributeError for a state that is no AdamState
    ("'NoneType' object has no attribute 'mu'") or a tree block ("'list' object has no attribute 'numel'"), and
    counted an unknown strategy ("snapshots") as 0 bytes. The state is refused as Adam's calls refuse it, an unknown
    strategy named, and a tree block's leaves summed."""
    from sofx.speculation.apply import snapshot_bytes_of

    opt = sofx.adamw()
    ps = [torch.randn(4, generator=rng), torch.randn(3, generator=rng)]
    state = opt.init(ps)
    assert snapshot_bytes_of("snapshot", ps, state) == 3 * 4 * 7
    assert snapshot_bytes_of("param_snapshot", ps, state) == 4 * 7
    assert snapshot_bytes_of("algebraic", ps[0], opt.init(ps[0])) == 0
    with pytest.raises(sofx.LeafError, match=r"^state: expected an AdamState, got NoneType"):
        snapshot_bytes_of("snapshot", ps, None)
    with pytest.raises(sofx.SofxError, match=r"^snapshot_bytes_of: strategy 'snapshots' is none of"):
        snapshot_bytes_of("snapshots", ps, state)


def test_snapshot_bytes_of_refuses_a_state_of_another_structure_and_a_chunk_snapshot(rng):
    """snapshot_bytes_of zipped the param's, mu's and nu's leaves unchecked: a state of fewer leaves than the block
    was summed over the shortest (a truncated count), and a "chunk_snapshot" counted 0 bytes (its record keeps the
    flagged chunks' elements and indices, which the strategy alone does not say). The state's structure is checked
    as Adam's calls check it (a StructureError naming state.mu), and a chunk_snapshot refused, naming what counts it;
    "none" keeps nothing (0 bytes)."""
    from sofx.speculation.apply import snapshot_bytes_of

    opt = sofx.adamw()
    ps = [torch.randn(4, generator=rng), torch.randn(3, generator=rng)]
    one = opt.init([ps[0]])
    with pytest.raises(sofx.StructureError, match=r"^state.mu does not have the structure of param"):
        snapshot_bytes_of("snapshot", ps, one)
    with pytest.raises(sofx.StructureError, match=r"^state.nu does not have the structure of param"):
        snapshot_bytes_of("snapshot", ps, opt.init(ps)._replace(nu=[ps[0]]))
    with pytest.raises(sofx.SofxError, match=r"^snapshot_bytes_of: a 'chunk_snapshot' record's bytes depend on"):
        snapshot_bytes_of("chunk_snapshot", ps, opt.init(ps))
    with pytest.raises(sofx.LeafError, match=r"^snapshot_bytes_of: state.mu\[1\]: expected a tensor, got NoneType"):
        snapshot_bytes_of("snapshot", ps, opt.init(ps)._replace(mu=[ps[0], None]))
    assert snapshot_bytes_of("none", ps, opt.init(ps)) == 0


def test_resolve_block_hparams_refuses_an_n_blocks_that_is_no_count():
    """sofx.speculation.decisions.resolve_block_hparams (public) with an n_blocks of "3", 2.0 or None raised
    Python's bare TypeError ("'str' object cannot be interpreted as an integer"), and -1 gave no block, True one,
    without a word. An HParamError names n_blocks and what was given, as begin_step refuses it; numpy ints count."""
    np = pytest.importorskip("numpy")
    from sofx.speculation.decisions import resolve_block_hparams

    defaults = sofx.adamw().defaults
    assert len(resolve_block_hparams(defaults, None, 2)) == 2
    assert len(resolve_block_hparams(defaults, None, np.int64(3))) == 3
    for bad in ("3", 2.0, None, -1, True):
        with pytest.raises(sofx.HParamError, match=r"^n_blocks = .* is invalid; expected an integer >= 0"):
            resolve_block_hparams(defaults, None, bad)


def test_a_zero_grad_step_of_a_tree_block_steps_each_leaf_with_zeros(rng):
    """A block may be a pytree (speculative_step's leaves, the offload engine's per-parameter lists): a ``step``
    action with ``zero_grad`` (missing_grad="zero") raised torch's bare TypeError ("zeros_like(): argument 'input'
    must be Tensor, not list") for a list block, the action unapplied. Each leaf is stepped with zeros, as a
    tensor block is."""
    opt = sofx.adamw(lr=1e-2)
    rule = loss_scale.grad_scaler()
    pair = [torch.randn(4, generator=rng), torch.randn(3, generator=rng)]
    state = opt.init(pair)
    ctx, _ = sp.begin_step(opt, sp.SpeculationConfig(missing_grad="zero"), rule, rule.init(), n_blocks=1)
    (action,) = sp.plan_validation(ctx, _, [None]).actions
    assert action.kind == "step" and action.zero_grad
    p1, s1 = sp.apply_block_action(opt, action, pair, None, state)
    want, w_state, _ = opt.update(pair, [torch.zeros(4), torch.zeros(3)], state, action.hparams,
                                  grad_scale=action.grad_scale)
    assert all(torch.equal(a, b) for a, b in zip(p1, want)) and [int(c) for c in s1.count] == [1, 1]


@pytest.mark.parametrize("zero_grad", ["no", 0, None])
def test_a_step_action_whose_zero_grad_is_no_bool_is_refused_and_writes_nothing(rng, zero_grad):
    """A step action made by hand (or its ``_replace``) with ``zero_grad="no"`` was read by its truth: the block
    was stepped with zeros in place of its gradient, without a word (0 and None as False). A SofxError names the
    block, the field and its value, nothing written and the action still to apply; numpy bools are bools."""
    opt = sofx.adamw(lr=1e-2)
    param, grad = torch.randn(4, generator=rng), torch.randn(4, generator=rng)
    state = opt.init(param)
    action = sp.BlockAction(0, "step", "stepped late", 1.0, opt.defaults, zero_grad=zero_grad)
    p = param.clone()
    with pytest.raises(sofx.SofxError, match=rf"^apply_block_action: block 0: action\.zero_grad = {zero_grad!r} is "
                                             r"invalid; expected a bool"):
        sp.apply_block_action(opt, action, p, grad, state, donate=True)
    assert torch.equal(p, param) and int(state.count) == 0 and not action.applied_cell()[0]
    p1, s1 = sp.apply_block_action(opt, action._replace(zero_grad=np.bool_(False)), p, grad, state)
    assert torch.equal(p1, opt.update(param, grad, state)[0]) and int(s1.count) == 1


def test_speculative_block_step_without_a_gradient_is_refused_before_the_decision_is_used(rng):
    """A speculative step given ``grad=None`` (or a tree of Nones: no gradient at all) took no step -- Adam leaves a
    leaf without gradient as it is -- yet used the decision and returned a record: validation then committed a step
    that never happened (count 0, the report saying committed). It is refused naming the block, nothing written, the
    decision still usable; a tree block with a gradient for some of its leaves is stepped as before."""
    opt = sofx.adamw(lr=1e-2)
    _, param, grad, _, _, _, d = _one_ready_block(opt, rng)
    for none in (None, [None]):
        p = [param.clone()] if isinstance(none, list) else param.clone()
        s = opt.init(p)
        with pytest.raises(sofx.SofxError, match=r"^speculative_block_step: block 0: grad has no gradient \(no "
                                                 r"tensor in it: .*Nothing was written"):
            sp.speculative_block_step(opt, p, none, s, d)
    assert not d.used_cell()[0]
    pair, pair_grads = [param.clone(), param.clone()], [grad, None]
    _, s1, _ = sp.speculative_block_step(opt, pair, pair_grads, opt.init(pair), d)
    assert [int(c) for c in s1.count] == [1, 0]


def test_an_undo_redo_action_of_a_tree_block_without_a_gradient_is_refused(rng):
    """apply_block_action refused grad=None for an undo_redo, but a tree block's grad with no tensor in it
    ([None, None]) was taken: the undo_redo only undid the speculative step (Adam leaves a leaf without gradient as
    it is: counts back to 0), marked applied while the plan and its report said redone (as speculative_block_step
    before 4a30c79). Refused as grad=None is, nothing written, the action still usable with the gradient. A step
    action given [None, None] is taken, as update takes it (the offload engine steps a frozen group's block so:
    test_offload_misuse.py's frozen groups), each leaf left as it is."""
    opt = sofx.adamw(lr=1e-2)
    rule = loss_scale.static_scale(1.0)
    pair = [torch.randn(4, generator=rng), torch.randn(3, generator=rng)]
    grads = [torch.randn(4, generator=rng) * 10, torch.randn(3, generator=rng) * 10]
    total = sum(sp.grad_sumsq(g) for g in grads)
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(max_norm=1.0), rule, rule.init(), n_blocks=1)
    tally, d = sp.on_block_ready(ctx, tally, 0, 0.5, sp.Eligibility(True, "algebraic", "", 0))  # (clipped later)
    p1, s1, rec = sp.speculative_block_step(opt, [p.clone() for p in pair], grads, opt.init(pair), d, ctx=ctx)
    (redo,) = sp.plan_validation(ctx, tally, [total]).actions
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(max_norm=1.0), rule, rule.init(), n_blocks=1)
    (step,) = sp.plan_validation(ctx, tally, [total]).actions
    assert (redo.kind, step.kind) == ("undo_redo", "step")
    before = [p.clone() for p in p1]
    with pytest.raises(sofx.SofxError, match=r"^block 0: undo_redo needs the block's final gradient \(grad has no "
                                             r"tensor in it: list\)"):
        sp.apply_block_action(opt, redo, p1, [None, None], s1, rec)
    assert all(torch.equal(a, b) for a, b in zip(p1, before)) and not redo.applied_cell()[0]
    _, new_state = sp.apply_block_action(opt, redo, p1, grads, s1, rec)
    assert [int(c) for c in new_state.count] == [1, 1]
    stepped, new_state = sp.apply_block_action(opt, step, [p.clone() for p in pair], [None, None], opt.init(pair), None)
    assert all(torch.equal(a, b) for a, b in zip(stepped, pair)) and [int(c) for c in new_state.count] == [0, 0]


def test_speculative_block_step_given_this_steps_context_refuses_a_decision_of_an_earlier_step(rng):
    """A decision of an earlier step never used in its own step (an engine that kept it) was taken by
    speculative_block_step, which wrote its step (the earlier step's lr) in place; only apply_block_action refused its
    record later. Given the step's context (ctx=), the call refuses it, naming both steps' context ids, before
    anything is written; this step's decision passes (and one made by hand, context_id 0, is not checked)."""
    opt, param, grad, state, ctx1, old, ctx, _, decision = _a_kept_decision_and_this_steps(rng)
    p = param.clone()
    with pytest.raises(sofx.SofxError, match=rf"^speculative_block_step: block 0: the decision is of another step "
                                             rf"\(context_id {ctx1.context_id}\) than ctx's \(context_id "
                                             rf"{ctx.context_id}\).*Nothing was written"):
        sp.speculative_block_step(opt, p, grad, state, old, donate=True, ctx=ctx)
    assert torch.equal(p, param) and int(state.count) == 0 and not old.used_cell()[0]
    p1, s1, _ = sp.speculative_block_step(opt, p, grad, state, decision, donate=True, ctx=ctx)
    assert int(s1.count) == 1
    by_hand = sp.BlockDecision(0, True, "speculate", "", decision.hparams, decision.grad_scale)
    assert int(sp.speculative_block_step(opt, param.clone(), grad, state, by_hand, ctx=ctx)[1].count) == 1
    with pytest.raises(sofx.SofxError, match=r"^speculative_block_step: ctx is a dict; expected the StepContext"):
        sp.speculative_block_step(opt, param.clone(), grad, state, old, ctx={})


def test_apply_block_action_refuses_a_blocks_record_with_another_blocks_tensors(rng):
    """The record and action of block i given with the tensors of block j of the same shape (tensors listed in
    arrival order, records in block order): block 1's undo_redo undid block 1's step on block 0's values (block 0's
    step and a stray inverse mixed, block 1's step left standing), and block 0's commit handed block 1's tensors back
    as block 0's, without a word. The record notes where its block's params are (their data pointers, as the
    speculative step left them; none for a traced tensor): other tensors are refused naming the block, nothing
    written. Views of the same memory pass (the offload engine builds its block views anew); with donation or
    without it."""
    opt = sofx.adamw(lr=1e-2)
    for donate in (True, False):
        blocks, grads, states, records, plan = _two_speculated_blocks(opt, rng, donate=donate)
        assert [a.kind for a in plan.actions] == ["commit", "undo_redo"]
        before = [t.clone() for t in (*blocks, *(s.mu for s in states), *(s.nu for s in states))]
        for i, j in ((1, 0), (0, 1)):
            with pytest.raises(sofx.SofxError, match=rf"^apply_block_action: block {i}: the params given are not "
                                                     rf"those its speculative step left"):
                sp.apply_block_action(opt, plan.actions[i], blocks[j], grads[j], states[j], records[i])
        after = [*blocks, *(s.mu for s in states), *(s.nu for s in states)]
        assert all(torch.equal(a, b) for a, b in zip(after, before)) and not any(r.used for r in records)
        for i, a in enumerate(plan.actions):
            view = blocks[i].view(2, 3).view(6)  # (the same memory)
            blocks[i], states[i] = sp.apply_block_action(opt, a, view, grads[i], states[i], records[i])
        assert records[1].used and [int(s.count) for s in states] == [3, 3]


def test_an_int_is_a_leaf_index_over_a_list_or_tuple_whose_positions_are_no_keys(rng):
    """Only a dict's int keys are keys (see the test above): over a list or tuple with a nested sequence at the top
    (``[a, [b, c], d]``: leaf 2 is ``params[1][1]``, ``params[2]`` is leaf 3), an int is the leaf index it always
    was. ``order=[3, 2, 1, 0]`` (the default order, given) and ``late_grads={2: g}`` were refused as 'the key of
    params[2]': a list's position called a key, a valid permutation of the leaves refused."""
    opt = sofx.adamw(lr=1e-2)
    a, b, c, d = _params(rng, 4)
    late = torch.randn(6, generator=rng) * 0.01 * S16
    rule = loss_scale.grad_scaler()
    kw = dict(config=sp.SpeculationConfig(), scaler=rule, scaler_state=rule.init())
    for params in ([a, [b, c], d], (a, (b, c), d)):
        grads = sofx.tree.unflatten(sofx.tree.flatten(params)[1],
                                    [torch.randn(6, generator=rng) * 0.02 * S16 for _ in range(4)])
        state = opt.init(params)
        got = sp.speculative_step(opt, params, grads, state, order=[3, 2, 1, 0], late_grads={2: late}, **kw)
        want = sp.speculative_step(opt, params, grads, state, late_grads={"params[1][1]": late}, **kw)
        assert torch.equal(got.params[1][1], want.params[1][1]) and torch.equal(got.params[2], want.params[2])
        assert got.report.actions == want.report.actions


def test_a_0d_tensor_or_array_given_for_the_per_block_flags_or_sums_is_refused_naming_it():
    """begin_step's ``stepped``/``float64`` and plan_validation's ``sumsq``/``taken`` take a sequence, a tensor or
    an array of one entry per block. A 0-d tensor or array (``stepped=torch.tensor(True)``, ``sumsq=x.sum()``)
    passed the check (it has ``__len__`` and ``__getitem__``) and raised Python's bare TypeError ("len() of a 0-d
    tensor", "len() of unsized object"); it is refused as the other non-sequences are, naming the argument."""
    np = pytest.importorskip("numpy")
    opt = sofx.adamw()
    rule = loss_scale.grad_scaler()
    cfg = sp.SpeculationConfig()
    ctx, tally = sp.begin_step(opt, cfg, rule, rule.init(), n_blocks=1)
    for zero_d in (torch.tensor(True), np.array(True)):
        for name in ("stepped", "float64"):
            with pytest.raises(sofx.HParamError, match=rf"^{name} must be a sequence of one bool per block .*0-d"):
                sp.begin_step(opt, cfg, rule, rule.init(), n_blocks=1, **{name: zero_d})
        with pytest.raises(sofx.SofxError, match=r"^plan_validation: taken is a .*0-d"):
            sp.plan_validation(ctx, tally, [1.0], taken=zero_d)
        with pytest.raises(sofx.SofxError, match=r"^plan_validation: sumsq is a .*0-d"):
            sp.plan_validation(ctx, tally, zero_d.float() if isinstance(zero_d, torch.Tensor) else np.array(1.0))
    assert sp.plan_validation(ctx, tally, torch.tensor([1.0]), taken=torch.tensor([False])).actions[0].kind == "step"
