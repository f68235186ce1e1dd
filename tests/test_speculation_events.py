"""Random sequences of the events speculation must absorb, from a fresh optimizer state: speculation == serial.

Each run draws an optimizer (AdamW / Adam-L2, bias correction on or off, float32 or bfloat16 parameters,
moments of the parameters' dtype, float32 or bfloat16, undo auto / exact), a profile (torch / deepspeed with or
without scale prediction), a loss scaler with a short growth interval (so that growth and backoff land on the
steps drawn), a ``max_norm`` among ``None``, 0, inf and finite ones, ``missing_grad`` and donation. It then runs
both loops from ``opt.init`` (the first step is at ``t = 1``, the bias corrections' boundary, and may overflow)
on one schedule whose lr and weight decay move between steps. Each step draws: clipping or not, an overflow (inf or
nan in one block), a backward at another scale than the scaler's, hparams changed between speculation and
validation (lr, weight decay, betas, eps, per-group), a missing gradient (on that step only), a late second
gradient, an earlier micro-step's backward and the arrival order.

Promised (SPECULATION.md section 3, DESIGN.md's tolerances): the same loss-scaler states, schedule positions,
skips and step counts at every step; without donation the two trajectories are bitwise equal at every step,
never re-synchronised; with donation a block undone (an algebraic inverse) is within 1e-6 (float32) or 1e-2
(bfloat16) of the serial loop's, the others bitwise, and the paths are then re-synchronised. Never a nan the
serial loop lacks. The report's counts add up.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sofx
from sofx import AdamHParams, loss_scale
from sofx import speculate as sp
from sofx.errors import SnapshotLimitError
from sofx.serial import init_loop, serial_loop_step, serial_step

SIZES = (6, 9, 4)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _clone_state(state: sofx.AdamState) -> sofx.AdamState:
    return sofx.AdamState(*(sofx.tree.tree_map(lambda t: t.clone(), part) for part in state))


def _scaler(profile: str, kind: str, init_scale: float, interval: int):
    if kind == "static":
        return loss_scale.static_scale(init_scale)
    if profile == "torch":
        return loss_scale.grad_scaler(init_scale=init_scale, growth_interval=interval)
    return loss_scale.deepspeed_scaler(init_scale=max(init_scale, 2.0), scale_window=interval, hysteresis=1)


_EVENT = st.fixed_dictionaries({
    "clip": st.sampled_from([False, False, True]),
    "overflow": st.sampled_from([None] * 5 + [math.inf, -math.inf, math.nan]),
    "overflow_leaf": st.integers(0, 2),
    "wrong_scale": st.sampled_from([None] * 4 + [0.5, 2.0]),
    "final_hp": st.sampled_from([None, None, None, "lr", "wd", "betas", "eps", "groups"]),
    "missing": st.sampled_from([None, None, None, 0, 1, 2]),
    "late": st.sampled_from([None, None, None, 0, 1, 2]),
    "not_last": st.sampled_from([False] * 5 + [True]),
    "order": st.sampled_from(["reverse", "forward", "shuffle"]),
    "seed": st.integers(0, 2 ** 16),
})


@settings(max_examples=40, deadline=None)
@given(decoupled=st.booleans(), bias_correction=st.sampled_from([True, True, False]),
       param_dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
       state_dtype=st.sampled_from([None, torch.float32, torch.bfloat16]),
       undo=st.sampled_from(["auto", "auto", "exact"]),
       donate=st.booleans(), profile=st.sampled_from(["torch", "deepspeed"]), predict=st.booleans(),
       max_norm=st.sampled_from([None, 0.0, math.inf, 1.0, 1.0, 0.05]),
       missing_grad=st.sampled_from(["skip", "zero"]), scaler_kind=st.sampled_from(["dynamic", "dynamic", "static"]),
       init_scale=st.sampled_from([2.0 ** 8, 4.0, 1.0]), interval=st.integers(1, 3),
       events=st.lists(_EVENT, min_size=3, max_size=7), seed=st.integers(0, 2 ** 16))
def test_random_event_sequences_from_a_fresh_state_follow_the_serial_loop(
        decoupled, bias_correction, param_dtype, state_dtype, undo, donate, profile, predict, max_norm,
        missing_grad, scaler_kind, init_scale, interval, events, seed):
    gen = torch.Generator().manual_seed(seed)
    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.05, bias_correction=bias_correction,
               state_dtype=state_dtype, undo=undo)
    config = sp.SpeculationConfig(max_norm=max_norm, profile=profile, missing_grad=missing_grad,
                                  predict_scale=predict, policy=sp.AdaptivePolicy(window=3, quiet_steps=1))
    scaler = _scaler(profile, scaler_kind, init_scale, interval)

    def schedule(t: int) -> AdamHParams:
        return AdamHParams(lr=1e-2 * (1 + 0.5 * math.sin(t)), weight_decay=(0.05, 0.0, 0.2)[t % 3])

    params = [torch.randn(k, generator=gen).to(param_dtype) for k in SIZES]
    n = len(params)
    ser = spec = init_loop(opt, params, scaler)
    for k, ev in enumerate(events):
        egen = torch.Generator().manual_seed(ev["seed"])
        S = scaler.scale(ser.scaler_state)
        mult = 0.5 if ev["clip"] else 0.01  # a norm of ~2 against max_norm 1 where clipped
        grads = [(torch.randn(p.shape, generator=egen) * mult * S).to(param_dtype) for p in params]
        if ev["overflow"] is not None:
            grads[ev["overflow_leaf"]][1] = ev["overflow"]
        if ev["missing"] is not None:
            grads[ev["missing"]] = None
        late = {}
        if ev["late"] is not None and grads[ev["late"]] is not None:
            i = ev["late"]
            late[i] = (torch.randn(params[i].shape, generator=egen) * mult * S).to(param_dtype)
        final = [g + late[i] if i in late else g for i, g in enumerate(grads)]
        hp = schedule(ser.step)
        final_hp = {None: hp, "lr": hp._replace(lr=hp.lr * 0.5),
                    "wd": hp._replace(weight_decay=0.0 if hp.weight_decay else 0.1),
                    "betas": hp._replace(beta1=0.8, beta2=0.99), "eps": hp._replace(eps=1e-6),
                    "groups": [hp, hp._replace(lr=hp.lr * 0.3, weight_decay=0.0), hp]}[ev["final_hp"]]
        order = {"reverse": [2, 1, 0], "forward": [0, 1, 2],
                 "shuffle": torch.randperm(n, generator=egen).tolist()}[ev["order"]]
        spec_in = spec._replace(params=[p.clone() for p in spec.params], opt_state=_clone_state(spec.opt_state)) \
            if donate else spec
        kw = dict(validation_hparams=final_hp, order=order, late_grads=late, donate=donate,
                  last_micro_step=not ev["not_last"],
                  backward_scale=S * ev["wrong_scale"] if ev["wrong_scale"] else None)
        try:
            ser_next, facts = serial_loop_step(opt, ser, final, scaler=scaler, hparams=final_hp, max_norm=max_norm,
                                               profile=profile, missing_grad=missing_grad)
        except loss_scale.MinLossScaleError:
            with pytest.raises(loss_scale.MinLossScaleError):
                sp.speculative_loop_step(opt, spec_in, grads, config=config, scaler=scaler, hparams=schedule, **kw)
            return
        spec, report = sp.speculative_loop_step(opt, spec_in, grads, config=config, scaler=scaler, hparams=schedule,
                                                **kw)
        assert spec.scaler_state == ser_next.scaler_state and spec.step == ser_next.step, k
        assert report.skipped == facts.skipped == (ev["overflow"] is not None and ev["missing"] != ev["overflow_leaf"])
        assert report.speculated == report.committed + report.undone
        assert report.blocks == n == len(report.actions)
        if ev["not_last"]:
            assert report.speculated == 0
        for i in range(n):
            assert int(spec.opt_state.count[i]) == int(ser_next.opt_state.count[i]), (k, i)
            for a, b in ((spec.params[i], ser_next.params[i]), (spec.opt_state.mu[i], ser_next.opt_state.mu[i]),
                         (spec.opt_state.nu[i], ser_next.opt_state.nu[i])):
                assert a.dtype == b.dtype, (k, i)
                assert not (torch.isnan(a) & ~torch.isnan(b)).any(), (k, i, report.actions[i])
                if donate and report.actions[i] in ("undo", "undo_redo"):
                    tol = 1e-6 if a.dtype == torch.float32 else 1e-2
                    assert _rel(a, b) <= tol, (k, i, report.actions[i], _rel(a, b))
                else:
                    assert torch.equal(a, b), (k, i, report.actions[i], donate)
        ser = ser_next
        if donate:  # re-synchronised: each step is checked at the per-step tolerance
            spec = ser._replace(policy_state=spec.policy_state)


# ----------------------------------------------------------------------------------------------------------
# The block protocol driven by hand, as an engine drives it: steps that did not run (taken False), steps taken
# back for the snapshot budget, late gradients summed out of place or after the caller undid the step (either
# first, in any order), ``taken`` given or left at its default.

_PROTOCOL_EVENT = st.fixed_dictionaries({
    "clip": st.booleans(), "overflow": st.sampled_from([None, None, None, 0, 1, 2]),
    "late": st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=3),  # (block, undone first)
    "not_run": st.lists(st.integers(0, 2), max_size=2), "missing": st.sampled_from([None, None, 0, 1, 2]),
    "spike": st.sampled_from([None, None, 0, 1]), "give_taken": st.sampled_from([False, False, True]),
    "final_lr": st.sampled_from([None, None, 0.5]), "seed": st.integers(0, 2 ** 16)})


_OVERFLOW_AT_0 = {"clip": False, "overflow": 0, "late": [(0, False)], "not_run": [], "missing": None, "spike": None,
                  "give_taken": False, "final_lr": None, "seed": 0}


@settings(max_examples=30, deadline=None)
@example(decoupled=False, undo="auto", donate=False, profile="deepspeed", max_norm=None, missing_grad="skip",
         budget=None, param_dtype=torch.float32, events=[_OVERFLOW_AT_0] * 4, seed=0)  # (the third: at scale 1)
@given(decoupled=st.booleans(), undo=st.sampled_from(["auto", "exact"]), donate=st.booleans(),
       profile=st.sampled_from(["torch", "deepspeed"]), max_norm=st.sampled_from([None, 1.0, 0.05]),
       missing_grad=st.sampled_from(["skip", "zero"]), budget=st.sampled_from([None, 0, 40, 200]),
       param_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       events=st.lists(_PROTOCOL_EVENT, min_size=1, max_size=4), seed=st.integers(0, 2 ** 16))
def test_the_block_protocol_with_late_gradients_undone_first_or_not_follows_the_serial_loop(
        decoupled, undo, donate, profile, max_norm, missing_grad, budget, param_dtype, events, seed):
    """Each step's validation, applied block by block, gives serial_step's result: bitwise for blocks neither
    undone nor taken back, within DESIGN.md's tolerance for the others; the same loss-scaler state; the report's
    counts add up."""
    gen = torch.Generator().manual_seed(seed)
    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-2, weight_decay=0.05, undo=undo, state_dtype=torch.float32)
    config = sp.SpeculationConfig(max_norm=max_norm, profile=profile, missing_grad=missing_grad,
                                  snapshot_budget_bytes=budget)
    scaler = loss_scale.grad_scaler(init_scale=4.0, growth_interval=2) if profile == "torch" else \
        loss_scale.deepspeed_scaler(init_scale=4.0, scale_window=2)
    params = [torch.randn(k, generator=gen).to(param_dtype) for k in (5, 8, 3)]
    state, sstate = opt.init(params), scaler.init()
    for ev in events:
        egen = torch.Generator().manual_seed(ev["seed"])
        S = scaler.scale(sstate)
        mult = 0.5 if ev["clip"] else 0.01
        grads = [(torch.randn(p.shape, generator=egen) * mult * S).to(param_dtype) for p in params]
        if ev["spike"] is not None:  # (undo="auto" keeps a snapshot: a step the budget may take back)
            grads[ev["spike"]][0] = 1e3 * S
        if ev["overflow"] is not None:
            grads[ev["overflow"]][1] = math.inf
        if ev["missing"] is not None:
            grads[ev["missing"]] = None
        hp = AdamHParams(lr=1e-2)
        final_hp = hp if ev["final_lr"] is None else AdamHParams(lr=1e-2 * ev["final_lr"])
        ps = [p.clone() for p in params] if donate else list(params)
        blocks = [sofx.AdamState(*(t.clone() if donate else t for t in (state.count[i], state.mu[i], state.nu[i])))
                  for i in range(3)]
        ctx, tally = sp.begin_step(opt, config, scaler, sstate, n_blocks=3, hparams=hp)
        records, taken, held = [None] * 3, [False] * 3, 0
        for i in (2, 1, 0):
            if grads[i] is None:
                continue

            def eligibility(i: int = i) -> sp.Eligibility:
                return sp.block_eligibility(opt, ps[i], grads[i], blocks[i], ctx.hparams[i], ctx.grad_scale)

            tally, d = sp.on_block_ready(ctx, tally, i, sp.grad_sumsq(grads[i]), eligibility)
            if d.speculate and i not in ev["not_run"]:
                try:
                    ps[i], blocks[i], records[i] = sp.speculative_block_step(opt, ps[i], grads[i], blocks[i], d,
                                                                             donate=donate, held_bytes=held)
                except SnapshotLimitError as exc:
                    tally = sp.on_speculation_refused(ctx, tally, i, str(exc))
                    continue
                held += records[i].snapshot_bytes()
                tally = sp.on_speculation_held(ctx, tally, i, records[i].snapshot_bytes())
                taken[i] = True
        inverted = [False] * 3  # an algebraic inverse ran on the block: DESIGN.md's tolerance
        for i, undo_first in ev["late"]:
            if grads[i] is None:
                continue
            undone = undo_first and taken[i]
            if undone:
                ps[i], blocks[i] = opt.undo(ps[i], blocks[i], records[i], donate=donate)
                records[i], taken[i], inverted[i] = None, False, True
            grads[i] = grads[i] + (torch.randn(params[i].shape, generator=egen) * mult * S).to(param_dtype)
            tally = sp.on_late_gradient(ctx, tally, i, sp.grad_sumsq(grads[i]), undone=undone)
        final = [None if g is None else tally.block_sumsq[i] for i, g in enumerate(grads)]
        standing = [d is not None and d.speculate and i not in tally.undone for i, d in enumerate(tally.decisions)]
        default = not ev["give_taken"] and all(t for t, s in zip(taken, standing) if s)
        plan = sp.plan_validation(ctx, tally, final, hparams=final_hp, taken=None if default else taken)
        for i, action in enumerate(plan.actions):
            inverted[i] |= action.kind in ("undo", "undo_redo")
            ps[i], blocks[i] = sp.apply_block_action(opt, action, ps[i], grads[i], blocks[i], records[i],
                                                     donate=donate)
        try:
            ser = serial_step(opt, params, grads, state, scaler=scaler, scaler_state=sstate, hparams=final_hp,
                              max_norm=max_norm, profile=profile, missing_grad=missing_grad)
        except loss_scale.MinLossScaleError as exc:  # (DeepSpeed's rule: an overflow at the minimum scale)
            assert isinstance(plan.error, loss_scale.MinLossScaleError) and str(plan.error) == str(exc)
            assert all(a.kind in ("undo", "skip") for a in plan.actions), plan.actions
            for i in range(3):  # every block as it was before the step (an undone one within the tolerance)
                assert int(blocks[i].count) == int(state.count[i]), i
                for a, b in ((ps[i], params[i]), (blocks[i].mu, state.mu[i]), (blocks[i].nu, state.nu[i])):
                    assert _rel(a, b) <= (1e-6 if a.dtype == torch.float32 else 1e-2), (i, plan.actions[i])
            return
        assert plan.error is None and plan.scaler_state == ser.scaler_state
        r = plan.report
        assert r.speculated == r.committed + r.undone and r.skipped == ser.facts.skipped
        for i in range(3):
            assert int(blocks[i].count) == int(ser.state.count[i]), i
            for a, b in ((ps[i], ser.params[i]), (blocks[i].mu, ser.state.mu[i]), (blocks[i].nu, ser.state.nu[i])):
                refused = tally.decisions[i] is not None and tally.decisions[i].kind == "refused"
                if inverted[i] or (refused and donate):  # (a step taken back under donation: an inverse)
                    assert _rel(a, b) <= (1e-6 if a.dtype == torch.float32 else 1e-2), (i, plan.actions[i])
                else:
                    assert torch.equal(a, b), (i, plan.actions[i], donate)
        params, state, sstate = ser.params, ser.state, ser.scaler_state
