"""L2 weight decay (``sofx.adam``, ``gh = g + wd * p``) where its terms matter: speculation == serial.

The algebraic inverse recovers p about an ulp off, and in L2 mode the recovered moments (and a redo's step)
take ``wd`` times that error through ``gh``; base.py's lossy check (see ``LOSSY_V_RATIO``) flags the chunks where
that could exceed the tolerance. These properties run the hparams where it matters: lr 1e-2..1e-1, weight
decay 0.1..0.5, a few steps in (second moments still small), a share of the gradient elements near the balance
L2 training tends to (``g = -wd p (1 + 1e-3 noise)``: ``gh`` small beside ``wd p``), on leaves small enough that
some are undone algebraically and others are kept (the check's flags), through:

- the record alone: ``update`` then ``undo`` (and ``undo_redo``) with ``undo="auto"`` on the reference, cpu and
  cpu_fast backends: the tolerance of tests/test_lossy_undo.py (v within 1e-6 relative, m within 2e-6 of
  sqrt(v), p within 1e-6 of the tensor's largest value);
- the functional speculative loop (``speculative_loop_step`` against ``serial_loop_step``) over random sequences
  of clips, overflows, loss-scale changes and hparam changes;
- the offload facade (``SpeculativeAdam``, thread executor) against the same facade not speculating.

DESIGN.md's "Same trajectory": bitwise where nothing was undone, within 1e-6 per step where something was (then
re-synchronised, so that every step is checked at the per-step tolerance); undone moments also element by
element at the record's tolerance above.
"""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from test_offload_support import MODELS, one_torch_thread, tensor_deviation  # noqa: F401 (autouse fixture)

import sofx
import sofx.offload
from sofx import AdamHParams, loss_scale
from sofx import speculate as sp
from sofx.kernels import cpu
from sofx.serial import init_loop, serial_loop_step

LR = st.floats(-2.0, -1.0).map(lambda e: 10.0 ** e)  # lr 1e-2..1e-1
WD = st.floats(0.1, 0.5)
NEAR = st.sampled_from([0.05, 0.3, 0.7, 0.95])  # the share of gradient elements near -wd p
SIZES = (16, 40, 7, 100)  # one chunk each: some kept by the check, some undone algebraically


def _no_native(backend: str) -> bool:
    """Whether ``backend`` needs the native build, which is not there (no C compiler): the example passes."""
    return backend != "reference" and not cpu.native_available()


def near_balance(p: torch.Tensor, wd: float, near: float, gen: torch.Generator, mult: float = 1e-2) -> torch.Tensor:
    """A gradient for ``p`` of random elements of size ``mult``, a share ``near`` of them (random places) at the
    L2 balance instead: ``-wd p (1 + 1e-3 noise)``, whose effective gradient ``g + wd p`` is ~1e-3 of ``wd p``."""
    g = torch.randn(p.shape, generator=gen) * mult
    balanced = -wd * p * (1 + 1e-3 * torch.randn(p.shape, generator=gen))
    return torch.where(torch.rand(p.shape, generator=gen) < near, balanced, g)


def _rel_elements(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / |b|, element by element (0 where both are 0)."""
    a, b = a.double(), b.double()
    return float(((a - b).abs() / b.abs().clamp_min(1e-300)).max())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: DESIGN.md's relative error of a tensor."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_moments_close(p, m, v, want_p, want_m, want_v, where) -> None:
    """The tolerance of tests/test_lossy_undo.py: v within 1e-6 relative element by element, m within 2e-6 of
    sqrt(v), p within 1e-6 of the tensor's largest value."""
    assert _rel_elements(v, want_v) <= 1e-6, (where, "v", _rel_elements(v, want_v))
    m_err = float(((m.double() - want_m.double()).abs() / want_v.double().sqrt().clamp_min(1e-300)).max())
    assert m_err <= 2e-6, (where, "m", m_err)
    assert _rel(p, want_p) <= 1e-6, (where, "p", _rel(p, want_p))


def _warm_l2(opt, gen: torch.Generator, steps: int, wd: float, near: float) -> tuple[list, sofx.AdamState]:
    """Parameters of SIZES ~ N(0, 1) after ``steps`` plain steps of near_balance gradients."""
    params = [torch.randn(k, generator=gen) for k in SIZES]
    state = opt.init(params)
    for _ in range(steps):
        params, state, _ = opt.update(params, [near_balance(p, wd, near, gen) for p in params], state,
                                      undoable=False)
    return params, state


def _l2_case(backend: str, lr: float, wd: float, near: float, steps: int, seed: int) -> tuple:
    """``(opt, params, state, before, grads)``: an ``undo="auto"`` L2 optimizer, its parameters and state after
    ``steps`` plain steps (:func:`_warm_l2`), a copy of both, and the next step's near_balance gradients."""
    gen = torch.Generator().manual_seed(seed)
    opt = sofx.adam(lr=lr, weight_decay=wd, backend=backend, undo="auto")
    params, state = _warm_l2(opt, gen, steps, wd, 0.0)
    before = sofx.tree.tree_map(torch.clone, (params, state))
    return opt, params, state, before, [near_balance(p, wd, near, gen) for p in params]


# ---------------------------------------------------------------------------------------- the record alone


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(backend=st.sampled_from(["reference", "cpu", "cpu_fast"]), lr=LR, wd=WD, near=NEAR,
       steps=st.integers(0, 3), donate=st.booleans(), seed=st.integers(0, 2 ** 16))
@example(backend="reference", lr=0.1, wd=0.5, near=0.95, steps=1, donate=False, seed=3)  # m 1e-5 off without
@example(backend="cpu", lr=0.1, wd=0.5, near=0.95, steps=1, donate=True, seed=3)  # base.py's L2 terms
def test_l2_update_then_undo_restores_the_state_within_the_tolerance(backend, lr, wd, near, steps, donate, seed):
    """update then undo (``undo="auto"``) a few steps in: every leaf comes back within the record's tolerance,
    whether the check kept it or it was undone algebraically; a first step's moments exactly 0."""
    if _no_native(backend):
        return
    opt, params, state, before, grads = _l2_case(backend, lr, wd, near, steps, seed)
    p2, s2, rec = opt.update(params, grads, state, donate=donate)
    p3, s3 = opt.undo(p2, s2, rec, donate=donate)
    p0, s0 = before
    for i in range(len(SIZES)):
        assert_moments_close(p3[i], s3.mu[i], s3.nu[i], p0[i], s0.mu[i], s0.nu[i], (i, rec.leaves[i].strategy))
        assert int(s3.count[i]) == steps


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(backend=st.sampled_from(["reference", "cpu", "cpu_fast"]), lr=LR, wd=WD, near=NEAR,
       steps=st.integers(0, 3), change=st.sampled_from(["lr", "eps", "betas", "scale", "clip", "wd"]),
       donate=st.booleans(), seed=st.integers(0, 2 ** 16))
@example(backend="reference", lr=0.1, wd=0.5, near=0.05, steps=0, change="lr", donate=False, seed=0)  # first steps:
@example(backend="cpu", lr=0.1, wd=0.5, near=0.95, steps=0, change="clip", donate=True, seed=0)  # v 5e-5 off
def test_l2_undo_redo_equals_the_redone_step_within_the_tolerance(backend, lr, wd, near, steps, change, donate,
                                                                  seed):
    """update, then undo_redo with the same gradient and other hparams or another grad_scale (what validation
    redoes), equals the step taken with those from the state before, within the record's tolerance."""
    if _no_native(backend):
        return
    opt, params, state, before, grads = _l2_case(backend, lr, wd, near, steps, seed)
    hp = AdamHParams(lr=lr, weight_decay=wd)
    new_hp = {"lr": hp._replace(lr=lr * 0.5), "eps": hp._replace(eps=1e-6), "betas": hp._replace(beta1=0.8, beta2=0.99),
              "wd": hp._replace(weight_decay=wd * 0.5)}.get(change, hp)
    grad_scale = {"scale": 0.5, "clip": 0.3}.get(change, 1.0)
    p2, s2, rec = opt.update(params, grads, state, hparams=hp, donate=donate)
    p3, s3, _ = opt.undo_redo(p2, s2, rec, grads, grad_scale=grad_scale, hparams=new_hp, donate=donate)
    want_p, want_s, _ = opt.update(before[0], grads, before[1], grad_scale=grad_scale, hparams=new_hp)
    for i in range(len(SIZES)):
        assert_moments_close(p3[i], s3.mu[i], s3.nu[i], want_p[i], want_s.mu[i], want_s.nu[i],
                             (i, rec.leaves[i].strategy))


# ------------------------------------------------------------------------- the functional speculative loop

MAX_NORM = 30.0  # above the norm of the balanced gradients (wd |p| each): clipped only where a spike is drawn

_EVENT = st.fixed_dictionaries({
    "kind": st.sampled_from(["none", "clip", "heavy_clip", "overflow", "wrong_scale", "lr", "wd", "betas", "eps"]),
    "leaf": st.integers(0, len(SIZES) - 1),
    "order": st.sampled_from(["reverse", "forward", "shuffle"]),
    "seed": st.integers(0, 2 ** 16),
})


def _ev(kind: str) -> dict:
    """An event of _EVENT (leaf 0, backward order, seed 0)."""
    return {"kind": kind, "leaf": 0, "order": "reverse", "seed": 0}


def _clone_loop(loop):
    """``loop`` with copies of its params and moments (the speculative step donates them)."""
    state = sofx.AdamState(*(sofx.tree.tree_map(torch.clone, part) for part in loop.opt_state))
    return loop._replace(params=[p.clone() for p in loop.params], opt_state=state)


def _event_grads(params, hp: AdamHParams, ev: dict, near: float, scale: float) -> list[torch.Tensor]:
    """near_balance gradients (at the schedule's weight decay) times the loss scale, with the event's spike
    (a global norm ~2x or ~100x MAX_NORM) or inf."""
    egen = torch.Generator().manual_seed(ev["seed"])
    grads = [near_balance(p, hp.weight_decay, near, egen) * scale for p in params]
    at = int(torch.randint(SIZES[ev["leaf"]], (1,), generator=egen))
    if ev["kind"] in ("clip", "heavy_clip"):
        grads[ev["leaf"]][at] = (60.0 if ev["kind"] == "clip" else 3000.0) * scale
    elif ev["kind"] == "overflow":
        grads[ev["leaf"]][at] = math.inf
    return grads


@settings(max_examples=15, deadline=None)
@given(backend=st.sampled_from(["reference", "cpu", "cpu_fast"]), lr=LR, wd=WD, near=NEAR,
       profile=st.sampled_from(["torch", "deepspeed"]), predict=st.booleans(),
       events=st.lists(_EVENT, min_size=3, max_size=6), seed=st.integers(0, 2 ** 16))
@example(backend="reference", lr=0.1, wd=0.5, near=0.05, profile="torch", predict=False, seed=0,  # v 6e-4 off
         events=[_ev("none"), _ev("none"), _ev("overflow")])  # without base.py's L2 terms
@example(backend="reference", lr=0.1, wd=0.25, near=0.05, profile="torch", predict=False, seed=0,  # a first step
         events=[_ev("eps"), _ev("none"), _ev("none")])  # redone: p 1.6e-6 off the tensor's largest
def test_l2_speculative_loop_follows_the_serial_loop(backend, lr, wd, near, profile, predict, events, seed):
    """speculative_loop_step (donating) against serial_loop_step from ``opt.init``, on one schedule (lr and weight
    decay moving): the same loss-scaler states, steps and skips; blocks not undone bitwise, undone ones within 1e-6
    of the tensor (DESIGN.md) and element by element at the record's tolerance; then re-synchronised."""
    if _no_native(backend):
        return
    gen = torch.Generator().manual_seed(seed)
    opt = sofx.adam(lr=lr, weight_decay=wd, backend=backend, undo="auto")
    config = sp.SpeculationConfig(max_norm=MAX_NORM, profile=profile, predict_scale=predict,
                                  policy=sp.AdaptivePolicy(enabled=False))
    scaler = (loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=2) if profile == "torch" else
              loss_scale.deepspeed_scaler(init_scale=2.0 ** 8, scale_window=2, hysteresis=1))

    def schedule(t: int) -> AdamHParams:
        return AdamHParams(lr=lr * (1 + 0.3 * math.sin(t)), weight_decay=wd * (1.0, 0.7)[t % 2])

    ser = spec = init_loop(opt, [torch.randn(k, generator=gen) for k in SIZES], scaler)
    for k, ev in enumerate(events):
        S = scaler.scale(ser.scaler_state)
        hp = schedule(ser.step)
        grads = _event_grads(ser.params, hp, ev, near, S)
        final_hp = {"lr": hp._replace(lr=hp.lr * 0.5), "wd": hp._replace(weight_decay=hp.weight_decay * 0.5),
                    "betas": hp._replace(beta1=0.8, beta2=0.99), "eps": hp._replace(eps=1e-6)}.get(ev["kind"], hp)
        n = len(SIZES)
        shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(ev["seed"])).tolist()
        order = {"reverse": list(reversed(range(n))), "forward": list(range(n)), "shuffle": shuffled}[ev["order"]]
        ser_next, facts = serial_loop_step(opt, ser, grads, scaler=scaler, hparams=final_hp, max_norm=MAX_NORM,
                                           profile=profile)
        spec, report = sp.speculative_loop_step(
            opt, _clone_loop(spec), grads, config=config, scaler=scaler, hparams=schedule,
            validation_hparams=final_hp, order=order, donate=True,
            backward_scale=2 * S if ev["kind"] == "wrong_scale" else None)
        assert spec.scaler_state == ser_next.scaler_state and spec.step == ser_next.step, k
        assert report.skipped == facts.skipped == (ev["kind"] == "overflow")
        for i in range(n):
            where = (k, i, ev["kind"], report.actions[i])
            assert int(spec.opt_state.count[i]) == int(ser_next.opt_state.count[i]), where
            got = (spec.params[i], spec.opt_state.mu[i], spec.opt_state.nu[i])
            want = (ser_next.params[i], ser_next.opt_state.mu[i], ser_next.opt_state.nu[i])
            if report.actions[i] in ("undo", "undo_redo"):
                assert max(_rel(a, b) for a, b in zip(got, want)) <= 1e-6, (where, [_rel(a, b) for a, b in
                                                                                   zip(got, want)])
                assert_moments_close(*got, *want, where)
            else:
                assert all(torch.equal(a, b) for a, b in zip(got, want)), where
        ser = ser_next
        spec = ser._replace(policy_state=spec.policy_state)  # re-synchronised: each step at the per-step tolerance


# ------------------------------------------------------------------------------------ the offload facade

FACADE_MAX_NORM = 20.0

_FACADE_EVENT = st.fixed_dictionaries({
    "kind": st.sampled_from(["none", "none", "clip", "heavy_clip", "overflow", "lr", "wd", "betas", "eps",
                             "discard"]),
    "param": st.integers(0, 7),
    "seed": st.integers(0, 2 ** 16),
})


def _fev(kind: str) -> dict:
    """An event of _FACADE_EVENT (parameter 0, seed 0)."""
    return {"kind": kind, "param": 0, "seed": 0}


def _balancing_hook(p: nn.Parameter, opt, mask: torch.Tensor, noise: torch.Tensor):
    """A gradient hook putting the masked elements of ``p``'s (loss-scaled) gradient at the L2 balance of
    ``opt``'s weight decay: ``-wd p (1 + 1e-3 noise)`` times the loss scale of this backward."""
    def hook(g: torch.Tensor) -> torch.Tensor:
        wd, scale = opt.param_groups[0]["weight_decay"], opt.engine.loss_scale
        return torch.where(mask, -wd * p.detach() * (1 + 1e-3 * noise) * scale, g)
    return hook


def _event_hooks(model: nn.Module, opt, ev: dict, near: float) -> list:
    """The step's gradient hooks on ``model``'s trainable parameters: near_balance's share at the balance, and the
    event's spike (a global norm ~5x or ~100x FACADE_MAX_NORM) or inf on one parameter."""
    gen = torch.Generator().manual_seed(ev["seed"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    hooks = []
    for p in trainable:
        mask, noise = torch.rand(p.shape, generator=gen) < near, torch.randn(p.shape, generator=gen)
        hooks.append(p.register_hook(_balancing_hook(p, opt, mask, noise)))
    victim = trainable[ev["param"] % len(trainable)]
    if ev["kind"] in ("clip", "heavy_clip", "overflow"):
        size = {"clip": 100.0, "heavy_clip": 2000.0, "overflow": math.inf}[ev["kind"]]

        def spike(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g.view(-1)[0] = size * opt.engine.loss_scale
            return g
        hooks.append(victim.register_hook(spike))
    return hooks


def _facade(model: nn.Module, lr: float, wd: float, profile: str, backend: str, block_numel: int, speculate: bool):
    scaler = (loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=2) if profile == "torch" else
              loss_scale.deepspeed_scaler(init_scale=2.0 ** 8, scale_window=2, hysteresis=1))
    return sofx.offload.SpeculativeAdam(model.parameters(), lr=lr, weight_decay=wd, max_grad_norm=FACADE_MAX_NORM,
                                        loss_scale=scaler, profile=profile, executor="thread", backend=backend,
                                        block_numel=block_numel, speculate=speculate, timeout=60.0,
                                        policy=sp.AdaptivePolicy(enabled=False))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lr=LR, wd=WD, near=NEAR, profile=st.sampled_from(["torch", "deepspeed"]),
       backend=st.sampled_from(["auto", "cpu_fast", "reference"]), block_numel=st.sampled_from([40, 200]),
       events=st.lists(_FACADE_EVENT, min_size=3, max_size=5), seed=st.integers(0, 2 ** 16))
@example(lr=0.1, wd=0.25, near=0.7, profile="torch", backend="auto", block_numel=40, seed=0,  # v 1e-5 off without
         events=[_fev("none"), _fev("none"), _fev("overflow")])  # base.py's L2 terms
@example(lr=0.1, wd=0.25, near=0.05, profile="torch", backend="auto", block_numel=40, seed=0,  # a first step
         events=[_fev("lr"), _fev("none"), _fev("none")])  # redone
def test_l2_offload_facade_follows_the_facade_not_speculating(lr, wd, near, profile, backend, block_numel, events,
                                                              seed):
    """``SpeculativeAdam`` (thread executor) on the harness's MLP (a shared and a frozen parameter) against the same
    facade with ``speculate=False``, from the first step: the same skips and loss scales; each parameter of a block
    neither undone nor redone bitwise (master, moments, count, the model's value), one of an undone block within
    1e-6 of the tensor and its moments at the record's tolerance; then re-synchronised. Events: a spike clipped
    (mildly or heavily), an inf, lr / weight decay / betas / eps changed between backward and step(), the
    gradients thrown away (zero_grad: the speculated steps undone)."""
    make_model, make_batch, loss_fn = MODELS["mlp"]
    torch.manual_seed(seed)
    model = make_model()
    ref = copy.deepcopy(model)
    opt = _facade(model, lr, wd, profile, backend, block_numel, speculate=True)
    ropt = _facade(ref, lr, wd, profile, backend, block_numel, speculate=False)
    gen = torch.Generator().manual_seed(seed + 1)
    try:
        for k, ev in enumerate(events):
            batch = make_batch(gen)
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                handles = _event_hooks(m, o, ev, near)
                o.backward(loss_fn(m, batch))
                for h in handles:
                    h.remove()
            if ev["kind"] == "discard":  # nothing changes: what was speculated is undone
                opt.zero_grad()
                ropt.zero_grad()
                _compare_facades(opt, ropt, None, k)
                _resync(opt, ropt)
                continue
            for o in (opt, ropt):
                group = o.param_groups[0]
                if ev["kind"] == "lr":
                    group["lr"] = group["lr"] * 0.5
                elif ev["kind"] == "wd":
                    group["weight_decay"] = group["weight_decay"] * 0.5
                elif ev["kind"] == "betas":
                    group["betas"] = (0.8, 0.99)
                elif ev["kind"] == "eps":
                    group["eps"] = 1e-6
            report, ref_report = opt.step(), ropt.step()
            assert (report.skipped, report.scale) == (ref_report.skipped, ref_report.scale), (k, report.summary())
            assert report.skipped == (ev["kind"] == "overflow")
            _compare_facades(opt, ropt, report.actions, k)
            _resync(opt, ropt)
    finally:
        opt.close()
        ropt.close()


def _compare_facades(opt, ropt, actions: tuple[str, ...] | None, k: int) -> None:
    """``opt``'s parameters against ``ropt``'s, one by one (engine state and the model's value): bitwise where the
    block was neither undone nor redone (``actions``: the step report's; None: gradients thrown away, every
    speculated block undone), else within 1e-6 of the tensor and the record's tolerance."""
    engine, ref_engine = opt.engine, ropt.engine
    for i, (p, q) in enumerate(zip(engine.params, ref_engine.params)):
        got, want = engine.param_state(i), ref_engine.param_state(i)
        block = engine.tracker.where[i][0]
        action = None if actions is None else actions[block]
        where = (k, i, action)
        assert int(got["step"]) == int(want["step"]), where
        if action is None or action in ("undo", "undo_redo"):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert tensor_deviation(got[key], want[key]) <= 1e-6, (where, key)
            assert tensor_deviation(p, q) <= 1e-6, where
            assert_moments_close(got["master"], got["exp_avg"], got["exp_avg_sq"], want["master"], want["exp_avg"],
                                 want["exp_avg_sq"], where)
        else:
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got[key], want[key]), (where, key)
            assert torch.equal(p.detach(), q.detach()), where


def _resync(opt, ropt) -> None:
    """Give ``opt``'s engine (masters, moments) and model the values of ``ropt``'s."""
    with torch.no_grad():
        for i, (p, q) in enumerate(zip(opt.engine.params, ropt.engine.params)):
            got, want = opt.engine.param_state(i), ropt.engine.param_state(i)
            for key in ("master", "exp_avg", "exp_avg_sq"):
                got[key].copy_(want[key])
            p.copy_(q)
