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
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import sofx
from sofx import AdamHParams, loss_scale, schedules
from sofx import speculate as sp
from sofx import transforms as tx
from sofx.kernels.base import FINITE_CHUNK
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


# ----------------------------------------------------------------------------------------------------------
# Long trajectories over blocks of several FINITE_CHUNKs: the checked kernels' chunk snapshots (a spike, an inf
# or a nan in a few chunks only), bf16 parameters with fp32 states, the cpu, cpu_fast and reference backends,
# every hparam changed between speculation and validation, per-group and 0-d tensor hparams, moments starting
# at zero, counts where the bias corrections are at their edges (t = 1; beta^t underflowing to 0).

CHUNKED_SIZES = ((3 * FINITE_CHUNK + 100, 50), (FINITE_CHUNK, 2 * FINITE_CHUNK + 1, 7), (9000, (70, 90), 0))


def _chunked_params(gen: torch.Generator, sizes: tuple, dtype: torch.dtype, transposed: bool) -> list[torch.Tensor]:
    """One leaf per size (an int: 1-d; a pair: 2-d, transposed where asked: a non-contiguous leaf)."""
    out = []
    for n in sizes:
        t = torch.randn(n, generator=gen).to(dtype)
        out.append(t.t() if transposed and t.dim() == 2 else t)
    return out


def _chunked_grads(gen: torch.Generator, params: list[torch.Tensor], mult: float, spike: float, spikes: list,
                   bad: list, missing: int | None) -> list[torch.Tensor | None]:
    """Random gradients of ``params`` (``mult`` times normal); ``spikes``/``bad``: ``(leaf, fraction)`` where an
    element is ``spike`` (an algebraic inverse too lossy there) or not finite (its chunk only)."""
    grads: list[torch.Tensor | None] = []
    for p in params:
        grads.append((torch.randn(p.shape, generator=gen) * mult).to(p.dtype))
    for (leaf, at), value in [(s, spike) for s in spikes] + [((b[0], b[1]), b[2]) for b in bad]:
        g = grads[leaf % len(grads)]
        if g is not None and g.numel():
            g.view(-1)[int(at * g.numel())] = value  # (a transposed leaf's gradient is contiguous)
    if missing is not None:
        grads[missing % len(grads)] = None
    return grads


_EVENT = st.fixed_dictionaries({
    "clip": st.sampled_from([False, False, True]),
    # (often in the first and last chunks of leaf 0: two runs of kept chunks)
    "spikes": st.one_of(st.just([(0, 0.0), (0, 0.999)]),
                        st.lists(st.tuples(st.sampled_from([0, 0, 1, 2]), st.floats(0, 0.999)), min_size=1,
                                 max_size=3)),
    "bad": st.sampled_from([[]] * 9 + [[(0, 0.3, math.inf)], [(1, 0.9, -math.inf)], [(2, 0.0, math.nan)]]),
    "missing": st.sampled_from([None, None, None, 0, 1, 2]),
    "late": st.sampled_from([None, None, 0, 1, 2]),
    "late_spike": st.booleans(),
    "wrong_scale": st.sampled_from([None, None, 0.5, 2.0]),
    "final_hp": st.sampled_from([None, None, "lr", "betas", "eps", "wd", "groups"]),
    "tensor_hp": st.booleans(),
    "order": st.sampled_from(["reverse", "forward", "shuffle"]),
    "seed": st.integers(0, 2 ** 16),
})


@settings(max_examples=20, deadline=None)
@given(backend=st.sampled_from(["cpu", "cpu", "cpu_fast", "reference"]), decoupled=st.booleans(),
       bias_correction=st.sampled_from([True, True, False]), bf16_params=st.booleans(),
       undo=st.sampled_from(["auto", "auto", "exact"]), beta1=st.sampled_from([0.9, 0.9, 0.5, 0.0]),
       donate=st.booleans(), profile=st.sampled_from(["torch", "deepspeed"]), predict=st.booleans(),
       max_norm=st.sampled_from([None, 1.0, 1.0]), missing_grad=st.sampled_from(["skip", "zero"]),
       budget=st.sampled_from([None, None, 0, 3 * 4 * FINITE_CHUNK]), sizes=st.sampled_from(CHUNKED_SIZES),
       transposed=st.booleans(), start=st.sampled_from(["zero moments", "warm", "warm at t = 2^31"]),
       events=st.lists(_EVENT, min_size=4, max_size=6), seed=st.integers(0, 2 ** 16))
def test_long_trajectories_over_chunked_blocks_follow_the_serial_loop(
        backend, decoupled, bias_correction, bf16_params, undo, beta1, donate, profile, predict, max_norm,
        missing_grad, budget, sizes, transposed, start, events, seed):
    """speculative_step against serial_step over a random sequence of steps. Without donation the two
    trajectories are never re-synchronised: bitwise at every step, whatever was undone, redone or refused.
    With donation (undone blocks are algebraic inverses) every block is within DESIGN.md's float32 tolerance
    (bf16 parameters: 1e-2) of the serial loop's at every step, then re-synchronised; counts, loss-scaler
    states and skips equal, and never a nan the serial loop lacks."""
    gen = torch.Generator().manual_seed(seed)
    pdt = torch.bfloat16 if bf16_params else torch.float32
    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-2, betas=(beta1, 0.999), weight_decay=0.05, bias_correction=bias_correction,
               state_dtype=torch.float32 if bf16_params else None, undo=undo, backend=backend)
    config = sp.SpeculationConfig(max_norm=max_norm, profile=profile, missing_grad=missing_grad,
                                  snapshot_budget_bytes=budget, predict_scale=predict,
                                  policy=sp.AdaptivePolicy(window=3, quiet_steps=2))
    scaler = (loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=3) if profile == "torch" else
              loss_scale.deepspeed_scaler(init_scale=2.0 ** 8, scale_window=3, hysteresis=2))
    params = _chunked_params(gen, sizes, pdt, transposed)
    state = opt.init(params)
    if start != "zero moments":  # (zero moments: every leaf's first step, undone to exact zeros)
        if start == "warm at t = 2^31":  # beta^t is 0 in float64: both bias corrections are 1
            state = state._replace(count=[torch.tensor(2 ** 31) for _ in params])
        for _ in range(20):  # (moments no longer small by chance anywhere: only a spike's chunks are kept)
            params, state, _ = opt.update(params, [(torch.randn(p.shape, generator=gen) * 0.01).to(pdt)
                                                   for p in params], state, undoable=False)
    n = len(params)
    ser = sloop = sofx.serial.LoopState(params, state, scaler.init(), 0, None)
    spec = sloop
    for k, ev in enumerate(events):
        egen = torch.Generator().manual_seed(ev["seed"])
        S = scaler.scale(sloop.scaler_state)
        # (a spike's norm alone stays below max_norm: it does not veto speculation, its step keeps chunks)
        mult = (0.5 if ev["clip"] else 0.002) * S
        grads = _chunked_grads(egen, sloop.params, mult, 0.3 * S, ev["spikes"], ev["bad"], ev["missing"])
        late = {}
        if ev["late"] is not None and grads[ev["late"] % n] is not None:
            i = ev["late"] % n
            late[i] = (torch.randn(grads[i].shape, generator=egen) * mult).to(pdt)
            if ev["late_spike"] and late[i].numel():
                late[i].view(-1)[0] = 0.3 * S
        lr = 1e-2 * (1 + 0.1 * k)
        hp = AdamHParams(lr=torch.tensor(lr, dtype=torch.float64), eps=torch.tensor(1e-8)) if ev["tensor_hp"] \
            else AdamHParams(lr=lr)
        final_hp = {None: hp, "lr": AdamHParams(lr=lr * 0.5), "eps": AdamHParams(lr=lr, eps=1e-6),
                    "betas": AdamHParams(lr=lr, beta1=beta1 * 0.9, beta2=0.99),
                    "wd": AdamHParams(lr=lr, weight_decay=0.0 if decoupled else 0.1),
                    "groups": [AdamHParams(lr=lr)] + [AdamHParams(lr=lr * 0.3, weight_decay=0.0)] * (n - 1),
                    }[ev["final_hp"]]
        order = {"reverse": list(range(n - 1, -1, -1)), "forward": list(range(n)),
                 "shuffle": torch.randperm(n, generator=egen).tolist()}[ev["order"]]
        final = [g + late[i] if i in late else g for i, g in enumerate(grads)]
        ser, facts = sofx.serial.serial_loop_step(opt, sloop, final, scaler=scaler, hparams=final_hp,
                                                  max_norm=max_norm, profile=profile, missing_grad=missing_grad)
        spec_in = spec._replace(params=[p.clone() for p in spec.params], opt_state=_clone_state(spec.opt_state)) \
            if donate else spec
        spec, report = sp.speculative_loop_step(opt, spec_in, grads, config=config, scaler=scaler, hparams=hp,
                                                validation_hparams=final_hp, order=order, late_grads=late,
                                                backward_scale=S * ev["wrong_scale"] if ev["wrong_scale"] else None,
                                                donate=donate)
        assert spec.scaler_state == ser.scaler_state and spec.step == ser.step
        assert report.skipped == facts.skipped == any(
            grads[b[0] % n] is not None and grads[b[0] % n].numel() for b in ev["bad"])
        assert report.speculated == report.committed + report.undone
        # with donation, a block undone (or a step taken back: refused) is an algebraic inverse
        inverted = [donate and (a in ("undo", "undo_redo") or report.refused > 0) for a in report.actions]
        for i in range(n):
            assert int(spec.opt_state.count[i]) == int(ser.opt_state.count[i])
            for a, b in ((spec.params[i], ser.params[i]), (spec.opt_state.mu[i], ser.opt_state.mu[i]),
                         (spec.opt_state.nu[i], ser.opt_state.nu[i])):
                assert not (torch.isnan(a) & ~torch.isnan(b)).any(), (k, i, report.actions[i])
                if inverted[i] and b.numel():
                    tol = 1e-6 if a.dtype == torch.float32 else 1e-2
                    assert _rel(a, b) <= tol, (k, i, report.actions[i], _rel(a, b))
                else:
                    assert torch.equal(a, b), (k, i, report.actions[i], donate)
        if donate:  # re-synchronised: each step is checked at the per-step tolerance
            spec = ser._replace(policy_state=spec.policy_state)
        sloop = ser


# ----------------------------------------------------------------------------------------------------------
# The two loop helpers driven by the same schedule (a callable of the steps taken: lr, betas and weight decay
# moving between steps), over mixed-dtype leaves (an empty one included), every scaler kind (GradScaler,
# DeepSpeed's with consecutive or not hysteresis, static), extreme gradient sizes and loss scales.

_LOOP_EVENT = st.fixed_dictionaries({
    "mult": st.sampled_from([0.001, 0.3, 3.0, 1e3, 1e19, 1e30, 0.0]),
    "bad": st.sampled_from([None] * 6 + [math.inf, -math.inf, math.nan]), "bad_leaf": st.integers(0, 3),
    "missing": st.sampled_from([None, None, 0, 1, 3]), "late": st.sampled_from([None, None, 0, 1, 3]),
    "late_bad": st.sampled_from([None] * 5 + [math.inf, math.nan]), "wrong_scale": st.sampled_from([None] * 4 + [0.5]),
    "final_hp": st.sampled_from([None, None, "lr", "wd", "lr0"]), "not_last": st.sampled_from([False] * 3 + [True]),
    "order": st.sampled_from(["reverse", "forward", "shuffle"]), "seed": st.integers(0, 2 ** 16),
})


@settings(max_examples=25, deadline=None)
@given(backend=st.sampled_from(["cpu", "cpu_fast", "reference"]), decoupled=st.booleans(),
       bias_correction=st.booleans(), low_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       undo=st.sampled_from(["auto", "exact"]), beta1=st.sampled_from([0.9, 0.5, 0.0]), donate=st.booleans(),
       profile=st.sampled_from(["torch", "deepspeed"]), predict=st.booleans(),
       max_norm=st.sampled_from([None, 1.0, 1e-3]), missing_grad=st.sampled_from(["skip", "zero"]),
       budget=st.sampled_from([None, 0, 40]), init_scale=st.sampled_from([1.0, 2.0 ** 8, 2.0 ** -20]),
       interval=st.integers(1, 3), hysteresis=st.integers(1, 3), consecutive=st.booleans(),
       static=st.sampled_from([False, False, True]), moving=st.sampled_from(["lr", "betas", "wd", "all"]),
       events=st.lists(_LOOP_EVENT, min_size=3, max_size=6), seed=st.integers(0, 2 ** 16))
def test_loop_helpers_on_one_schedule_follow_each_other_over_mixed_dtype_leaves(
        backend, decoupled, bias_correction, low_dtype, undo, beta1, donate, profile, predict, max_norm, missing_grad,
        budget, init_scale, interval, hysteresis, consecutive, static, moving, events, seed):
    """speculative_loop_step against serial_loop_step, both given the same schedule: the same loss-scaler
    states, schedule positions, skips and counts; bitwise for every block but those undone with donation
    (DESIGN.md's 1e-6 for float32, 1e-2 for 16-bit leaves; then re-synchronised), never a nan the serial loop
    lacks; where one loop raises, the other raises the same error."""
    gen = torch.Generator().manual_seed(seed)
    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-2, betas=(beta1, 0.999), weight_decay=0.05, bias_correction=bias_correction,
               state_dtype=torch.float32, undo=undo, backend=backend)
    config = sp.SpeculationConfig(max_norm=max_norm, profile=profile, missing_grad=missing_grad,
                                  snapshot_budget_bytes=budget, predict_scale=predict,
                                  policy=sp.AdaptivePolicy(window=2, quiet_steps=1))
    if static:
        scaler = loss_scale.static_scale(init_scale)
    elif profile == "torch":
        scaler = loss_scale.grad_scaler(init_scale=init_scale, growth_interval=interval)
    else:
        scaler = loss_scale.deepspeed_scaler(init_scale=max(init_scale, 1.0), scale_window=interval,
                                             hysteresis=hysteresis, consecutive_hysteresis=consecutive)

    def schedule(t: int) -> AdamHParams:
        return AdamHParams(lr=1e-2 * (1 + 0.3 * math.sin(t)) if moving in ("lr", "all") else 1e-2,
                           beta1=beta1 * (0.9 + 0.1 * (t % 2)) if moving in ("betas", "all") else beta1,
                           beta2=0.999 - 0.01 * (t % 3) if moving in ("betas", "all") else 0.999,
                           weight_decay=(0.05, 0.0, 0.2)[t % 3] if moving in ("wd", "all") else 0.05)

    sizes, dtypes = (5, 7, 0, 6), (torch.float32, low_dtype, low_dtype, torch.float32)
    params = [torch.randn(k, generator=gen).to(d) for k, d in zip(sizes, dtypes)]
    ser = spec = sofx.serial.init_loop(opt, params, scaler)
    for k, ev in enumerate(events):
        egen = torch.Generator().manual_seed(ev["seed"])
        S = scaler.scale(ser.scaler_state)
        grads = [(torch.randn(n, generator=egen) * ev["mult"] * S).to(d) for n, d in zip(sizes, dtypes)]
        if ev["bad"] is not None and grads[ev["bad_leaf"]].numel():
            grads[ev["bad_leaf"]][0] = ev["bad"]
        if ev["missing"] is not None:
            grads[ev["missing"]] = None
        late = {}
        if ev["late"] is not None and grads[ev["late"]] is not None:
            i = ev["late"]
            late[i] = (torch.randn(sizes[i], generator=egen) * ev["mult"] * S).to(dtypes[i])
            if ev["late_bad"] is not None:
                late[i][1] = ev["late_bad"]
        final = [g + late[i] if i in late else g for i, g in enumerate(grads)]
        hp = schedule(ser.step)
        final_hp = {None: hp, "lr": hp._replace(lr=hp.lr * 0.5), "lr0": hp._replace(lr=0.0),
                    "wd": hp._replace(weight_decay=0.0 if hp.weight_decay else 0.1)}[ev["final_hp"]]
        order = {"reverse": [3, 2, 1, 0], "forward": [0, 1, 2, 3],
                 "shuffle": torch.randperm(4, generator=egen).tolist()}[ev["order"]]
        spec_in = spec._replace(params=[p.clone() for p in spec.params], opt_state=_clone_state(spec.opt_state)) \
            if donate else spec
        try:
            ser_next, facts = sofx.serial.serial_loop_step(opt, ser, final, scaler=scaler, hparams=final_hp,
                                                           max_norm=max_norm, profile=profile,
                                                           missing_grad=missing_grad)
        except loss_scale.MinLossScaleError:
            with pytest.raises(loss_scale.MinLossScaleError):
                sp.speculative_loop_step(opt, spec_in, grads, config=config, scaler=scaler, hparams=schedule,
                                         validation_hparams=final_hp, order=order, late_grads=late, donate=donate)
            return
        spec, report = sp.speculative_loop_step(
            opt, spec_in, grads, config=config, scaler=scaler, hparams=schedule, validation_hparams=final_hp,
            order=order, late_grads=late, donate=donate, last_micro_step=not ev["not_last"],
            backward_scale=S * ev["wrong_scale"] if ev["wrong_scale"] else None)
        assert spec.scaler_state == ser_next.scaler_state and spec.step == ser_next.step
        assert report.skipped == facts.skipped
        for i in range(4):
            assert int(spec.opt_state.count[i]) == int(ser_next.opt_state.count[i]), (k, i)
            for a, b in ((spec.params[i], ser_next.params[i]), (spec.opt_state.mu[i], ser_next.opt_state.mu[i]),
                         (spec.opt_state.nu[i], ser_next.opt_state.nu[i])):
                assert a.dtype == b.dtype and not (torch.isnan(a) & ~torch.isnan(b)).any(), (k, i, report.actions)
                if donate and report.actions[i] in ("undo", "undo_redo") and not torch.equal(a, b):
                    assert _rel(a, b) <= (1e-6 if a.dtype == torch.float32 else 1e-2), (k, i, report.actions[i])
                else:
                    assert torch.equal(a, b), (k, i, report.actions[i], donate)
        ser = ser_next
        if donate:  # re-synchronised: each step is checked at the per-step tolerance
            spec = ser._replace(policy_state=spec.policy_state)
