"""Hypothesis state machine: random steps with random events; speculation == the serial loop.

Each run picks an optimizer configuration (AdamW / Adam-L2, beta1 0 or not,
float32 or bfloat16 states, undo auto/exact, snapshot budget), a profile
(torch / deepspeed, scale prediction on or off), clipping, missing-gradient
mode and donation. Each step draws events: clipping, overflow (inf or nan in
one block), a changed loss scale, hparams changed between speculation and
validation, a late second gradient, a missing gradient, micro-steps, an
earlier micro-step's backward (no speculation) and the arrival order.

After every step the speculative path must equal the serial loop: the same
loss-scaler state and step counts (or both raise DeepSpeed's error for an
overflow at the minimum loss scale, the speculative path having undone what it
speculated: nothing changed); bitwise for every block that was not
undone, and for every block without donation; within float32 rounding (1e-6
of the tensor's largest value) for undone ones with donation; never a nan
that the serial loop does not have. The paths are
then re-synchronised (the serial values copied), so that every step is
checked at the per-step tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import sofx
from sofx import AdamHParams, loss_scale, schedules
from sofx import speculate as sp
from sofx import transforms as tx
from sofx.serial import serial_step

SIZES = (5, 7, 3, 6)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _clone_state(state: sofx.AdamState) -> sofx.AdamState:
    return sofx.AdamState(*(sofx.tree.tree_map(lambda t: t.clone(), part) for part in state))


class SpeculationMachine(RuleBasedStateMachine):
    @initialize(decoupled=st.booleans(), beta1=st.sampled_from([0.9, 0.9, 0.0]),
                bf16_states=st.booleans(), undo=st.sampled_from(["auto", "auto", "exact"]),
                budget=st.sampled_from([None, None, 0, 2 * 7 * 3 * 4]), profile=st.sampled_from(["torch", "deepspeed"]),
                predict=st.booleans(), max_norm=st.sampled_from([None, 1.0, 1.0]),
                missing=st.sampled_from(["skip", "zero"]), donate=st.booleans(), n=st.integers(2, 4),
                seed=st.integers(0, 2 ** 16), low_scale=st.sampled_from([False, False, True]))
    def setup(self, decoupled, beta1, bf16_states, undo, budget, profile, predict, max_norm, missing, donate, n,
              seed, low_scale):
        self.gen = torch.Generator().manual_seed(seed)
        make = sofx.adamw if decoupled else sofx.adam
        self.opt = make(lr=1e-2, betas=(beta1, 0.999), weight_decay=0.05,
                        state_dtype=torch.bfloat16 if bf16_states else None, undo=undo)
        self.config = sp.SpeculationConfig(max_norm=max_norm, profile=profile, missing_grad=missing,
                                           snapshot_budget_bytes=budget, predict_scale=predict,
                                           policy=sp.AdaptivePolicy(window=3, quiet_steps=2))
        # low_scale: DeepSpeed's scaler starts near its minimum (1), where an overflow raises MinLossScaleError
        init_scale = 2.0 if low_scale else 2.0 ** 8
        self.scaler = (loss_scale.grad_scaler(init_scale=init_scale, growth_interval=3) if profile == "torch" else
                       loss_scale.deepspeed_scaler(init_scale=init_scale, scale_window=3, hysteresis=2))
        self.schedule = schedules.warmup_cosine(1e-2, warmup_steps=3, decay_steps=40, init=1e-3)
        self.donate = donate
        params = [torch.randn(SIZES[i], generator=self.gen) for i in range(n)]
        state = self.opt.init(params)
        for _ in range(3):  # warm moments, as in a real run
            params, state, _ = self.opt.update(params, [torch.randn(p.shape, generator=self.gen) * 0.3
                                                        for p in params], state)
        self.params, self.state, self.sstate = params, state, self.scaler.init()
        self.policy = None
        self.pos = 0
        self.steps = 0

    def _micro_grads(self, S: float, mult: float, missing: int | None, missing_every: bool) -> list:
        grads = []
        for i, p in enumerate(self.params):
            if missing == i and missing_every:
                grads.append(None)
            else:
                grads.append(torch.randn(p.shape, generator=self.gen) * mult * S)
        return grads

    @rule(clip=st.booleans(), overflow=st.sampled_from([None, None, None, "inf", "nan"]),
          overflow_block=st.integers(0, 3), wrong_scale=st.sampled_from([None, None, None, 0.5, 2.0]),
          hparams_change=st.booleans(), late=st.sampled_from([None, None, 0, 1, 2, 3]),
          missing=st.sampled_from([None, None, 0, 1, 2, 3]), micro_steps=st.integers(1, 3),
          not_last=st.sampled_from([False, False, False, True]), reverse=st.booleans(), data=st.data())
    def step(self, clip, overflow, overflow_block, wrong_scale, hparams_change, late, missing, micro_steps,
             not_last, reverse, data):
        n = len(self.params)
        missing = missing if missing is not None and missing < n else None
        S = self.scaler.scale(self.sstate)
        per_elem = 0.25 if clip else 0.02  # clipped norms are ~1.5-3x max_norm: coefficients >= 0.3
        acc = tx.accumulation_init(self.params)
        for k in range(micro_steps):
            # a missing leaf gets no gradient in the last micro-step (and in all of them half of the time)
            g = self._micro_grads(S, per_elem / math.sqrt(micro_steps), missing,
                                  missing_every=(k == micro_steps - 1) or data.draw(st.booleans()))
            acc = tx.accumulate(acc, g, self.params)
        grads = list(tx.accumulated(acc, self.params, "skip"))
        if overflow and grads[overflow_block % n] is not None:
            grads[overflow_block % n] = grads[overflow_block % n].clone()
            grads[overflow_block % n][1] = math.inf if overflow == "inf" else math.nan
        late_grads = {}
        if late is not None and late < n and grads[late] is not None:
            late_grads[late] = torch.randn(self.params[late].shape, generator=self.gen) * per_elem * S
        order = list(range(n)) if not reverse else list(range(n - 1, -1, -1))
        order = data.draw(st.permutations(order)) if data.draw(st.booleans()) else order
        hp = AdamHParams(lr=self.schedule(self.pos))
        final_hp = AdamHParams(lr=hp.lr * 0.5, weight_decay=0.01) if hparams_change else hp
        backward_scale = S * wrong_scale if wrong_scale else None

        spec_params = [p.clone() for p in self.params] if self.donate else self.params
        spec_state = _clone_state(self.state) if self.donate else self.state
        final_grads = list(grads)
        for i, extra in late_grads.items():
            final_grads[i] = final_grads[i] + extra

        def serial():
            return serial_step(self.opt, self.params, final_grads, self.state, scaler=self.scaler,
                               scaler_state=self.sstate, hparams=final_hp, max_norm=self.config.max_norm,
                               profile=self.config.profile, missing_grad=self.config.missing_grad)

        try:
            res = sp.speculative_step(self.opt, spec_params, grads, spec_state, config=self.config,
                                      scaler=self.scaler, scaler_state=self.sstate, policy_state=self.policy,
                                      hparams=hp, validation_hparams=final_hp, backward_scale=backward_scale,
                                      order=order, late_grads=late_grads, last_micro_step=not not_last,
                                      donate=self.donate)
        except loss_scale.MinLossScaleError:
            with pytest.raises(loss_scale.MinLossScaleError):
                serial()
            # The blocks speculated were undone before the error: the (donated) inputs hold the old values
            # again, to float32 rounding where an algebraic inverse ran.
            for i in range(n):
                assert int(spec_state.count[i]) == int(self.state.count[i])
                for a, b in ((spec_params[i], self.params[i]), (spec_state.mu[i], self.state.mu[i]),
                             (spec_state.nu[i], self.state.nu[i])):
                    assert _rel(a, b) <= 1e-6, (i, _rel(a, b))
            self.steps += 1
            return
        ser = serial()

        r = res.report
        assert res.scaler_state == ser.scaler_state
        assert r.skipped == ser.facts.skipped == (overflow is not None and grads[overflow_block % n] is not None)
        assert r.speculated == r.committed + r.undone
        assert r.blocks == n == len(r.actions)
        if not_last:
            assert r.speculated == 0
        if r.skipped:
            assert r.committed == r.redone == r.stepped_late == 0
        for i in range(n):
            undone = r.actions[i] in ("undo", "undo_redo")
            assert int(res.state.count[i]) == int(ser.state.count[i])
            for a, b in ((res.params[i], ser.params[i]), (res.state.mu[i], ser.state.mu[i]),
                         (res.state.nu[i], ser.state.nu[i])):
                assert not (torch.isnan(a) & ~torch.isnan(b)).any(), f"block {i}: a nan the serial loop lacks"
                if undone and self.donate:  # an algebraic inverse (without donation: the untouched input)
                    assert _rel(a, b) <= 1e-6, (i, r.actions[i], _rel(a, b), res.plan.actions[i].reason)
                else:
                    assert torch.equal(a, b), (i, r.actions[i], self.donate)
        # re-synchronise on the serial loop's values (the serial loop never writes into its inputs)
        self.params, self.state, self.sstate = ser.params, ser.state, ser.scaler_state
        self.policy = res.policy_state
        self.pos += not ser.facts.skipped
        self.steps += 1

    @invariant()
    def no_nan_ever(self):
        if hasattr(self, "params"):
            for p in self.params:
                assert not torch.isnan(p).any()


SpeculationMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=8, deadline=None)
TestSpeculationMachine = SpeculationMachine.TestCase
