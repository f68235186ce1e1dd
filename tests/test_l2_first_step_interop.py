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
