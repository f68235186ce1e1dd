"""L2 decay's first-step rule (``sofx.adam``'s ``L2_FIRST_STEP_REASON``: a leaf's first step keeps its parameter) where
it meets the rest of the library: weight decay that is 0 on the first step and not on its redo, a snapshot budget too
small for the first step's copy of the parameter, param groups with and without decay, gradient accumulation,
checkpoints taken around the first step (loop state, the offload facade, its process executor), torch.optim state
dicts imported and exported.

DESIGN.md's "Same trajectory": bitwise where nothing was undone, within 1e-6 of the tensor per step where something
was; undone moments also element by element at the record's tolerance (tests/test_l2_decay_trajectories.py).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from test_l2_decay_trajectories import SIZES, _compare_facades, _resync, assert_moments_close, near_balance
from test_offload_support import MODELS, one_torch_thread, tensor_deviation  # noqa: F401 (autouse fixture)

import sofx
import sofx.offload
from sofx import AdamHParams, loss_scale
from sofx import speculate as sp
from sofx.kernels import cpu
from sofx.serial import init_loop, serial_loop_step

LR, WD = 0.1, 0.5
BACKENDS = ["reference", "cpu", "cpu_fast"]
MAX_NORM = 30.0  # the functional loops' (a spike of 60 clips)


def _skip_without_native(backend: str) -> None:
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no native build")


def _first_step_case(seed: int) -> tuple[list, list]:
    """Parameters of SIZES ~ N(0, 1) and gradients with 95% of their elements at the L2 balance of WD."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(k, generator=gen) for k in SIZES]
    return params, [near_balance(p, WD, 0.95, gen) for p in params]


def _per_leaf(wd_of_leaf) -> list[AdamHParams]:
    """A hparams prefix of the params list: leaf ``i`` at lr LR and weight decay ``wd_of_leaf(i)``."""
    return [AdamHParams(lr=LR, weight_decay=wd_of_leaf(i)) for i in range(len(SIZES))]


def _clone_loop(loop):
    """``loop`` with copies of its tensors (the speculative step donates them)."""
    return sofx.tree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, loop)


def _start_loop(opt):
    scaler = loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=2)
    return init_loop(opt, [torch.randn(k, generator=torch.Generator().manual_seed(k)) for k in SIZES], scaler)


def _loop_grads(params, wds, call: int, event: str, scale: float) -> list[torch.Tensor]:
    """near_balance gradients (70% at each leaf's balance of its weight decay ``wds[i]``, or of WD where that is 0)
    times the loss scale; ``event``: "clip" (one element of 60: ~2x MAX_NORM), "overflow" (an inf), "none"."""
    gen = torch.Generator().manual_seed(100 + call)
    grads = [near_balance(p, wd or WD, 0.7, gen) * scale for p, wd in zip(params, wds)]
    if event == "clip":
        grads[0][3] = 60.0 * scale
    elif event == "overflow":
        grads[1][0] = math.inf
    return grads


def _assert_loops_agree(spec, ser, actions, where) -> None:
    """``spec``'s leaves against ``ser``'s: bitwise where the leaf was neither undone nor redone, else within 1e-6
    of the tensor and the record's tolerance; the same counts."""
    for i, a in enumerate(actions):
        got = (spec.params[i], spec.opt_state.mu[i], spec.opt_state.nu[i])
        want = (ser.params[i], ser.opt_state.mu[i], ser.opt_state.nu[i])
        assert int(spec.opt_state.count[i]) == int(ser.opt_state.count[i]), (where, i)
        if a in ("undo", "undo_redo"):
            assert max(tensor_deviation(x, y) for x, y in zip(got, want)) <= 1e-6, (where, i, a)
            assert_moments_close(*got, *want, (where, i, a))
        else:
            assert all(torch.equal(x, y) for x, y in zip(got, want)), (where, i, a)


def _loop_beside_serial(opt, schedule, final, events: list[str]) -> list:
    """``speculative_loop_step`` (``schedule`` at speculation, ``final`` at validation) beside ``serial_loop_step``
    (``final``) over ``events``, each step checked by :func:`_assert_loops_agree`, then re-synchronised (every step
    at the per-step tolerance); returns the serial loop and the reports."""
    scaler = loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=2)
    config = sp.SpeculationConfig(max_norm=MAX_NORM, policy=sp.AdaptivePolicy(enabled=False))
    ser = spec = _start_loop(opt)
    reports = []
    for k, ev in enumerate(events):
        wds = [float(h.weight_decay) for h in final(ser.step)]
        grads = _loop_grads(ser.params, wds, k, ev, scaler.scale(ser.scaler_state))
        ser_next, _ = serial_loop_step(opt, ser, grads, scaler=scaler, hparams=final, max_norm=MAX_NORM)
        spec, report = sp.speculative_loop_step(opt, _clone_loop(spec), grads, config=config, scaler=scaler,
                                                hparams=schedule, validation_hparams=final, donate=True)
        assert spec.step == ser_next.step and spec.scaler_state == ser_next.scaler_state, k
        _assert_loops_agree(spec, ser_next, report.actions, (k, ev))
        reports.append(report)
        ser = ser_next
        spec = ser._replace(policy_state=spec.policy_state)
    return ser, reports


def _balance_hooks(model: nn.Module, opt, wd: float, seed: int) -> list:
    """Gradient hooks putting 70% of each trainable parameter's (loss-scaled) gradient elements at the L2 balance
    of weight decay ``wd``: ``-wd p (1 + 1e-3 noise)``."""
    gen = torch.Generator().manual_seed(seed)
    hooks = []
    for p in (p for p in model.parameters() if p.requires_grad):
        mask, noise = torch.rand(p.shape, generator=gen) < 0.7, torch.randn(p.shape, generator=gen)

        def hook(g, p=p, mask=mask, noise=noise):
            return torch.where(mask, -wd * p.detach() * (1 + 1e-3 * noise) * opt.engine.loss_scale, g)
        hooks.append(p.register_hook(hook))
    return hooks


def _facade(model: nn.Module, speculate: bool, **kw):
    """SpeculativeAdam (L2) over ``model``: lr LR, weight decay WD, max norm 20, blocks of 40, a GradScaler rule,
    thread executor, no adaptive policy; ``kw`` overrides."""
    kw = {"lr": LR, "weight_decay": WD, "max_grad_norm": 20.0, "executor": "thread", "block_numel": 40,
          "timeout": 60.0, "policy": sp.AdaptivePolicy(enabled=False), "speculate": speculate,
          "loss_scale": loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=2), **kw}
    return sofx.offload.SpeculativeAdam(model.parameters(), **kw)


# ------------------------------------------------------------------ weight decay 0 at the step, not at its redo


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_first_step_without_decay_redone_with_l2_decay_equals_that_step(backend, seed):
    """A leaf's first step taken at weight decay 0 (a schedule starting at 0), then undo_redo at weight decay WD
    (set before validation), equals the first step taken at WD: the redo's ``gh = g + wd * p`` takes the parameter
    the undo restored, which must be the step's own (the record's tolerance; it was v 13% off)."""
    _skip_without_native(backend)
    opt = sofx.adam(lr=LR, weight_decay=WD, backend=backend, undo="auto")
    params, grads = _first_step_case(seed)
    state = opt.init(params)
    before = sofx.tree.tree_map(torch.clone, (params, state))
    p2, s2, rec = opt.update(params, grads, state, hparams=AdamHParams(lr=LR, weight_decay=0.0))
    p3, s3, _ = opt.undo_redo(p2, s2, rec, grads, hparams=AdamHParams(lr=LR, weight_decay=WD))
    want_p, want_s, _ = opt.update(before[0], grads, before[1], hparams=AdamHParams(lr=LR, weight_decay=WD))
    for i in range(len(SIZES)):
        assert_moments_close(p3[i], s3.mu[i], s3.nu[i], want_p[i], want_s.mu[i], want_s.nu[i],
                             (i, rec.leaves[i].strategy))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_first_step_without_decay_undone_then_taken_at_l2_decay_equals_that_step(backend):
    """A first step at weight decay 0 undone (an overflow elsewhere skipped it), then the first step taken again at
    WD (the decay set meanwhile), equals the step at WD from the parameters the run started from."""
    _skip_without_native(backend)
    opt = sofx.adam(lr=LR, weight_decay=WD, backend=backend, undo="auto")
    params, grads = _first_step_case(3)
    state = opt.init(params)
    before = sofx.tree.tree_map(torch.clone, (params, state))
    p2, s2, rec = opt.update(params, [g * 1.5 for g in grads], state, hparams=AdamHParams(lr=LR, weight_decay=0.0))
    p3, s3 = opt.undo(p2, s2, rec)
    got_p, got_s, _ = opt.update(p3, grads, s3, hparams=AdamHParams(lr=LR, weight_decay=WD))
    want_p, want_s, _ = opt.update(before[0], grads, before[1], hparams=AdamHParams(lr=LR, weight_decay=WD))
    for i in range(len(SIZES)):
        assert_moments_close(got_p[i], got_s.mu[i], got_s.nu[i], want_p[i], want_s.mu[i], want_s.nu[i], i)


def test_the_speculative_loop_whose_weight_decay_is_set_after_speculating_the_first_step_follows_the_serial_loop():
    """Leaves speculated at weight decay 0 on their first step, 0 and 2 given WD before validation (1 and 3 kept
    at 0), then a clip: every step within the tolerance of the serial loop at the validation hparams."""
    opt = sofx.adam(lr=LR, weight_decay=WD, backend="reference")
    spec_hp, final = _per_leaf(lambda i: 0.0), _per_leaf(lambda i: WD if i % 2 == 0 else 0.0)
    _, reports = _loop_beside_serial(opt, lambda t: spec_hp if t == 0 else final, lambda t: final,
                                     ["none", "clip", "none"])
    assert reports[0].undone == 2  # (leaves 0 and 2: their hparams changed, redone)


def test_the_facade_whose_weight_decay_is_set_between_backward_and_the_first_step_follows_the_facade_not_speculating():
    """SpeculativeAdam at weight decay 0, set to WD after the first backward (before step()): the first step's
    blocks, speculated without decay, are redone with it, within the tolerance of the same facade not
    speculating; the next steps bitwise."""
    make_model, make_batch, loss_fn = MODELS["mlp"]
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    opt, ropt = _facade(model, True, weight_decay=0.0), _facade(ref, False, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    try:
        for k in range(3):
            batch = make_batch(gen)
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                handles = _balance_hooks(m, o, WD, k)
                o.backward(loss_fn(m, batch))
                for h in handles:
                    h.remove()
                o.param_groups[0]["weight_decay"] = WD
            report = opt.step()
            ropt.step()
            assert (report.undone > 0) == (k == 0), report.summary()
            _compare_facades(opt, ropt, report.actions, k)
            _resync(opt, ropt)
    finally:
        opt.close()
        ropt.close()


# ----------------------------------------------------------------------------------- a snapshot budget


def _facade_state(model: nn.Module, opt) -> dict:
    """Copies of the model's and the optimizer's state dicts."""
    return sofx.tree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
                              {"model": model.state_dict(), "opt": opt.state_dict()})


BUDGET_RUN = {"loss_scale": None, "lr": 1e-2, "weight_decay": 0.01, "snapshot_budget_bytes": 4}


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_a_snapshot_budget_too_small_for_the_first_steps_parameter_copy_steps_it_in_validation_then_speculates(
        executor):
    """SpeculativeAdam (L2) with a snapshot budget of 4 bytes: on the first step every block needs its parameter
    kept (the first-step rule), so none is speculated (decided "budget") and each is stepped in validation; from
    the second step on the steps need no copy of the parameter, and blocks are speculated again (the engine's
    eligibility is not the first step's, reused). Every step bitwise the facade not speculating (nothing undone)."""
    make_model, make_batch, loss_fn = MODELS["mlp"]
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    opt = _facade(model, True, executor=executor, **BUDGET_RUN)
    ropt = _facade(ref, False, executor=executor, **{**BUDGET_RUN, "snapshot_budget_bytes": None})
    batch = make_batch(torch.Generator().manual_seed(1))  # (one batch: few elements the lossy check flags)
    reports = []
    try:
        for k in range(6):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                o.backward(loss_fn(m, batch))
            reports.append(opt.step())
            ropt.step()
            _compare_facades(opt, ropt, reports[-1].actions, k)
    finally:
        opt.close()
        ropt.close()
    first = reports[0]
    assert first.speculated == 0 and first.ineligible == first.stepped_late == first.blocks, first.summary()
    assert sum(r.speculated for r in reports[1:]) > 0, [r.summary() for r in reports]
    assert all(r.undone == 0 for r in reports)


def test_a_state_saved_before_the_first_step_loaded_into_a_used_facade_is_decided_on_its_first_step():
    """A facade with a 4-byte snapshot budget, past its first steps (speculating again), loads a state_dict saved
    before any step: the next step is every block's first again, decided "budget" (not speculated, rather than
    taken back as it runs) and stepped in validation: bitwise the run from the loaded state."""
    make_model, make_batch, loss_fn = MODELS["mlp"]
    torch.manual_seed(0)
    model = make_model()
    opt = _facade(model, True, executor="inline", **BUDGET_RUN)
    saved = _facade_state(model, opt)
    torch.manual_seed(0)
    ref = make_model()
    ropt = _facade(ref, False, executor="inline", **{**BUDGET_RUN, "snapshot_budget_bytes": None})
    batch = make_batch(torch.Generator().manual_seed(1))
    try:
        for _ in range(6):
            opt.zero_grad()
            opt.backward(loss_fn(model, batch))
            report = opt.step()
        assert report.speculated > 0, report.summary()
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            o.backward(loss_fn(m, batch))
        report = opt.step()
        ropt.step()
        assert report.speculated == report.refused == 0 and report.ineligible == report.blocks, report.summary()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    finally:
        opt.close()
        ropt.close()


def test_a_first_l2_step_over_the_snapshot_budget_is_decided_budget_naming_the_first_step_rule():
    """speculative_step on a first step whose parameter copies do not fit the budget: each leaf stepped in
    validation, its reason the budget and the first-step rule; the result is serial_step's, bit for bit."""
    from sofx.serial import serial_step
    opt = sofx.adam(lr=LR, weight_decay=WD)
    params, grads = _first_step_case(0)
    scaler = loss_scale.grad_scaler(init_scale=1.0)
    config = sp.SpeculationConfig(snapshot_budget_bytes=4 * min(SIZES) - 1)
    spec = sp.speculative_step(opt, [p.clone() for p in params], grads, opt.init(params), config=config,
                               scaler=scaler, scaler_state=scaler.init())
    ser = serial_step(opt, params, grads, opt.init(params), scaler=scaler, scaler_state=scaler.init())
    assert spec.report.speculated == 0 and spec.report.stepped_late == len(SIZES)
    for a in spec.plan.actions:
        assert a.kind == "step" and "of the budget" in a.reason and "L2 decay's first step" in a.reason, a.reason
    for got, want in ((spec.params, ser.params), (spec.state.mu, ser.state.mu), (spec.state.nu, ser.state.nu)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


# ------------------------------------------------------------------- param groups, gradient accumulation


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("event", ["clip", "overflow", "hparams"])
def test_a_group_whose_weight_decay_turns_on_after_the_first_step_follows_the_serial_loop(k, event):
    """Param groups (a prefix per leaf): leaves 1 and 3 without decay throughout, 0 and 2 at weight decay 0 until
    step ``k`` and WD from it. At step ``k`` a clip, an overflow, or WD set only at validation: the undone steps
    within the tolerance of the serial loop, the others bitwise (the lossy check bounds a redo from moments that
    are not 0). The first-step rule is about the count: step ``k`` keeps no copy of the parameter for it."""
    opt = sofx.adam(lr=LR, weight_decay=WD, backend="reference")
    before, after = _per_leaf(lambda i: 0.0), _per_leaf(lambda i: WD if i % 2 == 0 else 0.0)
    final = lambda t: after if t >= k - 1 else before  # noqa: E731  (t: steps taken, so step t + 1 is taken)
    schedule = (lambda t: after if t >= k else before) if event == "hparams" else final
    events = ["none"] * (k - 1) + [event if event != "hparams" else "none", "none"]
    ser, reports = _loop_beside_serial(opt, schedule, final, events)
    assert reports[k - 1].undone > 0 and ser.step == k + 1 - (event == "overflow")
    params, _ = _first_step_case(0)
    state = opt.init(params)._replace(count=[torch.tensor(k - 1)] * len(SIZES))
    assert [s for s, _ in opt.undo_strategies(params, params, state, after)] == ["algebraic"] * len(SIZES)


@pytest.mark.parametrize("boost_at", [0, -1])
def test_l2_gradient_accumulation_with_a_clip_on_the_first_step_follows_torch_adam(boost_at):
    """SpeculativeAdam (groups with decay 0.05 and 0) with two micro-steps per step and a clip on steps 1 and 2
    (the spike on the parameter that arrives last in backward: the first step's speculated blocks undone; or
    first: the early veto) against torch.optim.Adam + clip_grad_norm_ + GradScaler: within 1e-6 every step."""
    from test_offload_support import run_side_by_side
    r = run_side_by_side("mlp", "thread", steps=4, accumulate=2, inf_every=0, make_opt=sofx.offload.SpeculativeAdam,
                         ref_cls=torch.optim.Adam, boost_at=boost_at, boost_when=lambda s: s < 2,
                         opt_kwargs={"policy": sp.AdaptivePolicy(enabled=False)})
    first = r.reports[0]
    assert first.clipped and (first.undone > 0 if boost_at == 0 else first.vetoed > 0), first.summary()
    assert max(r.deviations) <= 1e-6, r.deviations



class _LateHead(nn.Module):
    """``b(tanh(a(x)))``, plus ``c(tanh(a(x)))`` once ``use_c``: ``c`` gets its first gradient a step late."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_c: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if use_c else self.b(h)


@pytest.mark.parametrize("missing_grad", ["skip", "zero"])
def test_a_parameter_whose_first_step_comes_a_step_late_beside_stepped_ones_follows_the_facade_not_speculating(
        missing_grad):
    """A block holding ``b`` (stepped from step 1) and ``c`` (no gradient on step 1: skipped, or stepped with a
    zero one): on step 2 ``c`` (``"skip"``) takes its first step beside ``b``'s second, speculated, then a clip
    undoes it: within the tolerance of the facade not speculating, every other step bitwise."""
    torch.manual_seed(0)
    model = _LateHead()
    ref = copy.deepcopy(model)
    opt, ropt = (_facade(m, s, missing_grad=missing_grad, block_numel=60, executor="inline")
                 for m, s in ((model, True), (ref, False)))
    try:
        for k in range(3):
            gen = torch.Generator().manual_seed(k)
            x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                handles = _balance_hooks(m, o, WD, k)
                if k == 1:
                    handles.append(m.a.weight.register_hook(lambda g: g * 100.0))  # (arrives last: a clip)
                o.backward(((m(x, k >= 1) - y) ** 2).mean())
                for h in handles:
                    h.remove()
            report = opt.step()
            ropt.step()
            assert (report.undone > 0) == (k == 1), report.summary()
            _compare_facades(opt, ropt, report.actions, k)
            _resync(opt, ropt)
        assert int(opt.state[model.c.weight]["step"]) == (2 if missing_grad == "skip" else 3)
    finally:
        opt.close()
        ropt.close()

# ------------------------------------------------------------------------- checkpoints around the first step

EVENTS = ["none", "clip", "overflow", "none"]  # steps 1, 2 (clipped), 3 (skipped), 3
GROUPS = _per_leaf(lambda i: WD if i % 2 == 0 else 0.0)  # decay WD on leaves 0 and 2, none on 1 and 3


def _spec_loop_run(opt, loop, start: int, stop: int):
    """``speculative_loop_step`` over calls ``start`` to ``stop`` of EVENTS at GROUPS; returns the loop."""
    scaler = loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=2)
    config = sp.SpeculationConfig(max_norm=MAX_NORM, policy=sp.AdaptivePolicy(enabled=False))
    for call in range(start, stop):
        grads = _loop_grads(loop.params, [WD] * 4, call, EVENTS[call], scaler.scale(loop.scaler_state))
        loop, report = sp.speculative_loop_step(opt, loop, grads, config=config, scaler=scaler, hparams=GROUPS)
        assert report.undone > 0 or EVENTS[call] == "none", (call, report.summary())
    return loop


@pytest.mark.parametrize("saved_after", [0, 1, 2])
def test_the_l2_speculative_loop_resumed_around_its_first_step_is_bitwise_the_uninterrupted_run(tmp_path,
                                                                                              saved_after):
    """A loop state saved after 0, 1 or 2 calls (sofx.checkpoint, loaded without a template, a fresh optimizer),
    continued with speculation through a clip on step 2 and an overflow: bitwise the uninterrupted run. The loaded
    counts say where the leaves are: the first-step rule keeps the parameter on a leaf's first step only."""
    from helpers import assert_trees_bitwise
    import sofx.checkpoint as ck
    opt = sofx.adam(lr=LR, weight_decay=WD, backend="reference")
    expected = _spec_loop_run(opt, _start_loop(opt), 0, len(EVENTS))
    assert expected.step == len(EVENTS) - 1
    saved = _spec_loop_run(opt, _start_loop(opt), 0, saved_after)
    loaded = ck.load(ck.save(tmp_path / "loop.ckpt", {"loop": saved, "calls": saved_after}))["loop"]
    fresh = sofx.adam(lr=LR, weight_decay=WD, backend="reference")
    plans = fresh.undo_strategies(loaded.params, loaded.params, loaded.opt_state, GROUPS)
    assert [s for s, _ in plans] == ["param_snapshot" if saved_after == 0 else "algebraic"] * len(SIZES)
    assert_trees_bitwise(_spec_loop_run(fresh, loaded, saved_after, len(EVENTS)), expected)


def _facade_run(model: nn.Module, opt, start: int, stop: int) -> None:
    """Steps ``start`` to ``stop`` of EVENTS on the MLP (70% of its gradient elements at the L2 balance of WD; at a
    clip a spike of 100 on the first parameter, at an overflow an inf)."""
    _, make_batch, loss_fn = MODELS["mlp"]
    for k in range(start, stop):
        opt.zero_grad()
        handles = _balance_hooks(model, opt, WD, k)
        if EVENTS[k] != "none":
            def spike(g, size=100.0 if EVENTS[k] == "clip" else math.inf):
                g = g.clone()
                g.view(-1)[0] = size * opt.engine.loss_scale
                return g
            handles.append(next(p for p in model.parameters() if p.requires_grad).register_hook(spike))
        opt.backward(loss_fn(model, make_batch(torch.Generator().manual_seed(k))))
        for h in handles:
            h.remove()
        report = opt.step()
        assert report.skipped == (EVENTS[k] == "overflow"), (k, report.summary())
        assert report.undone > 0 or EVENTS[k] == "none", (k, report.summary())


@pytest.mark.parametrize("executor,saved_after", [("thread", 0), ("thread", 1), ("thread", 2), ("process", 1)])
def test_the_l2_facade_resumed_around_its_first_step_is_bitwise_the_uninterrupted_run(tmp_path, executor,
                                                                                     saved_after):
    """SpeculativeAdam (two param groups: decay WD and 0) saved after 0, 1 or 2 steps (state_dict through
    sofx.checkpoint), loaded into a fresh model and optimizer, continued through a clip on step 2 and an overflow:
    bitwise the uninterrupted run (engine state, counts, the model); the loaded counts are the saved ones."""
    from helpers import assert_trees_bitwise
    import sofx.checkpoint as ck

    def build():
        torch.manual_seed(0)
        model = MODELS["mlp"][0]()
        decayed = [model.inp.weight, model.mid.weight]
        groups = [{"params": decayed},
                  {"params": [p for p in model.parameters() if all(p is not q for q in decayed)], "weight_decay": 0.0}]
        return model, sofx.offload.SpeculativeAdam(
            groups, lr=LR, weight_decay=WD, max_grad_norm=20.0, executor=executor, block_numel=40, timeout=60.0,
            policy=sp.AdaptivePolicy(enabled=False), backend="reference",
            loss_scale=loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=2))

    def counts(opt):
        return [int(opt.engine.param_state(i)["step"]) for i in range(len(opt.engine.params))]

    model, opt = build()
    with opt:
        _facade_run(model, opt, 0, len(EVENTS))
        expected = _facade_state(model, opt)
    model, opt = build()
    with opt:
        _facade_run(model, opt, 0, saved_after)
        path = ck.save(tmp_path / "facade.ckpt", _facade_state(model, opt))
        saved_counts = counts(opt)
    assert max(saved_counts) == saved_after  # (the frozen head bias: 0)
    model, opt = build()
    with opt:
        saved = ck.load(path)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        assert counts(opt) == saved_counts
        _facade_run(model, opt, saved_after, len(EVENTS))
        assert_trees_bitwise(_facade_state(model, opt), expected)


# ------------------------------------------------------------------------------ torch.optim state dicts


def _torch_start(opt):
    """``(params, torch.optim.Adam over them in GROUPS, GradScaler)`` as _start_loop's parameters."""
    import sofx.checkpoint as ck
    params = [torch.randn(k, generator=torch.Generator().manual_seed(k)) for k in SIZES]
    topt = torch.optim.Adam(ck.torch_param_groups(opt, params, GROUPS), foreach=False)
    return params, topt, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)


def _torch_run(topt, params, scaler, start: int, stop: int, trace: list) -> None:
    """torch.optim + GradScaler + clip_grad_norm_ (DESIGN.md's reference loop) over calls ``start`` to ``stop`` of
    EVENTS on :func:`_loop_grads`' gradients; appends each call's parameters and moments to ``trace``."""
    for call in range(start, stop):
        for p, g in zip(params, _loop_grads(params, [WD] * 4, call, EVENTS[call], scaler.get_scale())):
            p.grad = g
        scaler.scale(torch.zeros(()))  # (GradScaler makes its scale tensor at its first scale())
        scaler.unscale_(topt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        scaler.step(topt)
        scaler.update()
        topt.zero_grad()
        state = topt.state_dict()["state"]
        trace.append([(p.detach().clone(), state[i]["exp_avg"].clone(), state[i]["exp_avg_sq"].clone())
                      for i, p in enumerate(params)])


@pytest.mark.parametrize("saved_after", [0, 1, 2])
def test_a_torch_adam_l2_state_imported_around_its_first_step_continues_with_speculation_as_torch_does(saved_after):
    """torch.optim.Adam (L2, GROUPS) with GradScaler and clip_grad_norm_ for 0, 1 or 2 calls, imported
    (from_torch_optim; the scaler's scale and growth tracker), continued by speculative_loop_step through a clip on
    step 2 and an overflow: every call bitwise torch's until a speculated step is undone, within 1e-6 of the tensor
    after (and the moments at the record's tolerance)."""
    import sofx.checkpoint as ck
    opt = sofx.adam(lr=LR, weight_decay=WD)
    params, topt, scaler = _torch_start(opt)
    trace: list = []
    _torch_run(topt, params, scaler, 0, len(EVENTS), trace)
    params, topt, scaler = _torch_start(opt)
    _torch_run(topt, params, scaler, 0, saved_after, [])
    state, hparams = ck.from_torch_optim(opt, topt.state_dict(), params, GROUPS)
    assert [int(c) for c in state.count] == [saved_after] * len(SIZES)
    rule = loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=2)
    loop = init_loop(opt, [p.detach().clone() for p in params], rule)._replace(
        opt_state=state, step=saved_after,
        scaler_state=loss_scale.GradScalerState(scaler.get_scale(), scaler._get_growth_tracker()))
    config = sp.SpeculationConfig(max_norm=MAX_NORM, policy=sp.AdaptivePolicy(enabled=False))
    exact = True
    for call in range(saved_after, len(EVENTS)):
        grads = _loop_grads(loop.params, [WD] * 4, call, EVENTS[call], rule.scale(loop.scaler_state))
        loop, report = sp.speculative_loop_step(opt, loop, grads, config=config, scaler=rule, hparams=hparams)
        exact = exact and report.undone == 0
        assert report.undone > 0 or EVENTS[call] == "none", (call, report.summary())
        for i, want in enumerate(trace[call]):
            got = (loop.params[i], loop.opt_state.mu[i], loop.opt_state.nu[i])
            if exact:
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (call, i)
            else:
                assert max(tensor_deviation(a, b) for a, b in zip(got, want)) <= 1e-6, (call, i)
                assert_moments_close(*got, *want, (call, i))


@pytest.mark.parametrize("saved_after", [0, 1, 2])
def test_an_l2_speculative_run_exported_around_its_first_step_continues_in_torch_as_torch_does(saved_after):
    """speculative_loop_step for 0, 1 or 2 calls (the second clipped: undone and redone), exported (to_torch_optim;
    the loss scale into a GradScaler), continued by torch.optim.Adam: torch's uninterrupted run, bitwise where
    nothing was undone before the export, else within 1e-6 of the tensor."""
    import sofx.checkpoint as ck
    opt = sofx.adam(lr=LR, weight_decay=WD)
    params, topt, scaler = _torch_start(opt)
    trace: list = []
    _torch_run(topt, params, scaler, 0, len(EVENTS), trace)
    loop = _spec_loop_run(opt, _start_loop(opt), 0, saved_after)
    sd = ck.to_torch_optim(opt, loop.opt_state, GROUPS)
    assert sorted(sd["state"]) == ([] if saved_after == 0 else [0, 1, 2, 3])
    params = [p.clone() for p in loop.params]
    topt = torch.optim.Adam(ck.torch_param_groups(opt, params, GROUPS), foreach=False)
    topt.load_state_dict(sd)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    scaler.load_state_dict({**scaler.state_dict(), "scale": loop.scaler_state.scale,
                            "_growth_tracker": loop.scaler_state.growth_tracker})
    got: list = [None] * saved_after
    _torch_run(topt, params, scaler, saved_after, len(EVENTS), got)
    for call in range(saved_after, len(EVENTS)):
        for i, (a, b) in enumerate(zip(got[call], trace[call])):
            if saved_after < 2:
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (call, i)
            else:
                assert max(tensor_deviation(x, y) for x, y in zip(a, b)) <= 1e-6, (call, i)



@pytest.mark.parametrize("stepped", [0, 1, 2])
def test_torch_adam_moments_assigned_to_the_facade_around_the_first_step_continue_as_torch_does(stepped):
    """torch.optim.Adam (L2) with clip_grad_norm_ for 0, 1 or 2 steps, its moments and steps assigned to a
    SpeculativeAdam (``opt.state[p][key] = value``), both continued with a clip on step 2: bitwise torch's until
    the clip undoes speculated steps, within 1e-6 after."""
    make_model, make_batch, loss_fn = MODELS["mlp"]

    def hooks(m, k, opt):
        handles = _balance_hooks(m, opt, WD, k)
        if k == 1:
            handles.append(next(p for p in m.parameters() if p.requires_grad).register_hook(lambda g: g * 30.0))
        return handles

    class _Unscaled:  # _balance_hooks' view of torch's run: no loss scale
        class engine:
            loss_scale = 1.0

    def torch_step(k):
        topt.zero_grad()
        handles = hooks(ref, k, _Unscaled)
        loss_fn(ref, make_batch(torch.Generator().manual_seed(k))).backward()
        for h in handles:
            h.remove()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 20.0)
        topt.step()

    torch.manual_seed(0)
    ref = make_model()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    topt = torch.optim.Adam(trainable, lr=LR, weight_decay=WD, foreach=False)
    for k in range(stepped):
        torch_step(k)
    model = copy.deepcopy(ref)
    opt = _facade(model, True, loss_scale=None, executor="inline")
    try:
        for p, q in zip((p for p in model.parameters() if p.requires_grad), trainable):
            for key, value in topt.state.get(q, {}).items():
                opt.state[p][key] = value
        for k in range(stepped, 4):
            opt.zero_grad()
            handles = hooks(model, k, opt)
            opt.backward(loss_fn(model, make_batch(torch.Generator().manual_seed(k))))
            for h in handles:
                h.remove()
            report = opt.step()
            torch_step(k)
            assert (report.undone > 0) == (k == 1), report.summary()
            deviation = max(tensor_deviation(p, q) for p, q in zip(model.parameters(), ref.parameters()))
            assert deviation == 0.0 if k < 1 or stepped >= 2 else deviation <= 1e-6, (k, deviation)
    finally:
        opt.close()
