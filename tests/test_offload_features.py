"""Offload engine features, each against torch.optim run side by side on fresh random inputs.

bf16 models with fp32 masters, partial offload (device blocks), speculation
during backward (event order), a hook firing twice (late gradient), hparams
changed between backward and step, missing gradients ("skip" / "zero"),
OneCycleLR changing betas, gradients set by hand, the DeepSpeed profile,
state_dict round trips, bad input and clean shutdown.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

from test_offload_support import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    SharedMLP,
    mlp_batch,
    mlp_loss,
    mlp_step_side_by_side,
    one_torch_thread,
    relative_deviation,
    run_side_by_side,
)

import sofx.offload
from sofx.errors import HParamError, LeafError, StructureError, UnsupportedError
from sofx.loss_scale import deepspeed_scaler, grad_scaler
from sofx.speculate import AdaptivePolicy

TOL = 1e-6


def _models(seed: int = 0, cls: type = SharedMLP) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = cls()
    return model, copy.deepcopy(model)


def _trainable(m: nn.Module) -> list[torch.Tensor]:
    return [p for p in m.parameters() if p.requires_grad]


# ---------------------------------------------------------------- mixed precision
def test_bf16_model_with_fp32_master_equals_torch_on_fp32_copy() -> None:
    torch.manual_seed(0)
    model = SharedMLP().to(torch.bfloat16)
    ref = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in model.parameters()]
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=3.0,
                                        executor="thread", block_numel=100)
    ropt = torch.optim.AdamW(ref, lr=3e-3, weight_decay=0.01, foreach=False)
    gen = torch.Generator().manual_seed(1)
    params = list(model.parameters())
    with opt:
        for _ in range(30):
            x, y = mlp_batch(gen)
            loss = mlp_loss(model, (x.bfloat16(), y.bfloat16()))
            grads = torch.autograd.grad(loss, _trainable(model), retain_graph=True)
            opt.backward(loss)
            report = opt.step()
            for p, g in zip([r for r in ref if r.requires_grad], grads):
                p.grad = g.float()
            torch.nn.utils.clip_grad_norm_([r for r in ref if r.requires_grad], 3.0)
            ropt.step()
            for p, r in zip(params, ref):
                master = opt.state[p]["master"]
                assert master.dtype == torch.float32
                assert (master - r.detach()).abs().max() <= TOL * max(r.abs().max().item(), 1e-3)
                assert torch.equal(p.detach(), master.to(torch.bfloat16)), "the model gets its master, rounded"
                # the rounded reference: equal, but for a master that sits on a bf16 rounding boundary (1 ulp)
                rounded = r.detach().bfloat16()
                assert bool(((p.detach().float() - rounded.float()).abs() <= r.detach().abs() * 2 ** -7).all())
                assert (p.detach() == rounded).float().mean() >= 0.99
        assert report.committed > 0


def test_fp16_model_with_dynamic_loss_scale_equals_grad_scaler_on_fp32_copy() -> None:
    """fp16 model, fp32 masters, GradScaler semantics: scaled fp16 gradients, injected inf -> skip + backoff."""
    torch.manual_seed(0)
    model = SharedMLP().half()
    ref = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in model.parameters()]
    ref_train = [r for r in ref if r.requires_grad]
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=3e-3, max_grad_norm=3.0, executor="thread",
                                        block_numel=100, loss_scale=grad_scaler(init_scale=2.0 ** 8,
                                                                                growth_interval=3))
    ropt = torch.optim.AdamW(ref, lr=3e-3, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    params = list(model.parameters())
    scales, skipped = set(), 0
    with opt:
        for step in range(20):
            x, y = mlp_batch(gen)
            loss = mlp_loss(model, (x.half(), y.half())).float()
            assert opt.loss_scale == scaler.get_scale()
            scaled = opt.scale_loss(loss)
            assert torch.equal(scaled, scaler.scale(loss))
            grads = torch.autograd.grad(scaled, _trainable(model), retain_graph=True)
            if step % 6 == 4:  # an fp16 overflow
                grads = list(grads)
                grads[1] = grads[1].clone()
                grads[1].view(-1)[0] = float("inf")
                handle = _trainable(model)[1].register_hook(lambda g: grads[1])
            else:
                handle = None
            scaled.backward()
            if handle is not None:
                handle.remove()
            report = opt.step()
            for r, g in zip(ref_train, grads):
                r.grad = g.float()
            scaler.unscale_(ropt)
            torch.nn.utils.clip_grad_norm_(ref_train, 3.0)
            scaler.step(ropt)
            scaler.update()
            scales.add(report.scale)
            skipped += report.skipped
            assert report.next_scale == scaler.get_scale()
            for p, r in zip(params, ref):
                master = opt.state[p]["master"]
                assert (master - r.detach()).abs().max() <= TOL * max(r.abs().max().item(), 1e-3)
                assert torch.equal(p.detach(), master.half())
    assert skipped == 3 and len(scales) >= 2  # grows after 3 clean steps, backs off on overflow


def test_a_grad_scaler_carried_over_into_the_offload_optimizer_scales_and_skips_as_torchs() -> None:
    """A torch run's GradScaler, after 3 steps (an overflow among them, its growth tracker at 1), carried into
    SpeculativeAdamW as the facade's docs say (from_torch_grad_scaler: loss_scale=rule, the state through
    load_state_dict's scaler_state), and back into a GradScaler (to_torch_grad_scaler_state) after 6 more: each
    step's scale (the loss's and the unscaling one), the next scale and the skipped steps are the uninterrupted
    GradScaler's, bit for bit (loss_scale=rule alone starts the growth tracker at 0: the scale grows a step late)."""
    from sofx.loss_scale import from_torch_grad_scaler, to_torch_grad_scaler_state

    overflow_at = {1, 5, 10}
    kw = dict(init_scale=1000.3, growth_factor=1.5, backoff_factor=0.3, growth_interval=3)
    model, twin = _models()
    ref = torch.amp.GradScaler("cpu", **kw)
    ropt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def torch_step(scaler: torch.amp.GradScaler, step: int) -> tuple[float, float, bool]:
        before = [p.detach().clone() for p in twin.parameters()]
        scaled = scaler.scale(mlp_loss(twin, mlp_batch(gen)))
        scaled.backward()
        if step in overflow_at:
            twin.inp.weight.grad.view(-1)[0] = float("inf")
        scale = scaler.get_scale()
        scaler.step(ropt)
        scaler.update()
        ropt.zero_grad()
        return scale, scaler.get_scale(), all(torch.equal(p, q) for p, q in zip(twin.parameters(), before))

    scaler = torch.amp.GradScaler("cpu", **kw)
    for step in range(3):
        torch_step(scaler, step)
    rule, state = from_torch_grad_scaler(scaler)
    assert state.growth_tracker == 1
    steps = range(3, 9)
    reference = copy.deepcopy(scaler)  # (the uninterrupted run from the handover on)
    expected = [torch_step(reference, step) for step in steps]
    got = []
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-3, executor="inline", block_numel=100,
                                       loss_scale=rule) as opt:
        saved = opt.state_dict()
        saved["state"]["scaler_state"].update(state._asdict())
        opt.load_state_dict(saved)
        for step in steps:
            handle = model.inp.weight.register_hook(lambda g: g * float("inf")) if step in overflow_at else None
            opt.backward(mlp_loss(model, mlp_batch(gen)))
            if handle is not None:
                handle.remove()
            report = opt.step()
            opt.zero_grad()
            got.append((report.scale, report.next_scale, report.skipped))
        back = torch.amp.GradScaler("cpu")
        back.load_state_dict(to_torch_grad_scaler_state(rule, opt.state_dict()["state"]["scaler_state"]))
    assert got == expected and sum(skipped for *_, skipped in got) == 1
    assert back.state_dict() == reference.state_dict()
    assert [torch_step(back, step) for step in range(9, 12)] == [torch_step(reference, step) for step in range(9, 12)]


def test_deepspeed_overflow_at_the_minimum_scale_raises_and_changes_nothing() -> None:
    from sofx.loss_scale import MinLossScaleError

    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="thread", block_numel=100, profile="deepspeed",
                                       loss_scale=deepspeed_scaler(init_scale=1.0, hysteresis=1)) as opt:
        before = [p.detach().clone() for p in model.parameters()]
        handle = model.inp.weight.register_hook(lambda g: g * float("inf"))
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        handle.remove()
        with pytest.raises(MinLossScaleError, match="minimum"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert all(int(opt.state[p]["step"]) == 0 for p in model.parameters())


def test_a_loss_scale_that_cannot_unscale_skips_every_step() -> None:
    """GradScaler's scale below 2**-127 (1/S beyond float32), then 0 after a backoff: every step is skipped
    and the model is left alone (begin_step refused a scale of 0; at 2**-149 the step wrote nan)."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", block_numel=100,
                                       loss_scale=grad_scaler(init_scale=2.0 ** -149)) as opt:
        before = [p.detach().clone() for p in model.parameters()]
        for scale in (2.0 ** -149, 0.0, 0.0):
            assert opt.loss_scale == scale
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
            report = opt.step()
            assert report.skipped and report.speculated == 0 and "cannot unscale" in report.not_speculating_reason
            opt.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert all(int(opt.state[p]["step"]) == 0 for p in model.parameters())


# ---------------------------------------------------------------- partial offload
def test_device_blocks_equal_the_all_cpu_run() -> None:
    cpu = run_side_by_side("transformer", "thread", steps=25)
    dev = run_side_by_side("transformer", "thread", steps=25, opt_kwargs={"n_device_blocks": 3})
    assert max(dev.deviations) <= TOL
    for a, b in zip(cpu.final, dev.final):
        assert (a - b).abs().max() <= TOL * max(b.abs().max().item(), 1e-3)
    for rep in dev.reports:  # device blocks are stepped in step(), never speculated
        assert rep.speculated <= rep.blocks - 3
        assert not any(what == "speculate" and block < 3 for what, block in rep.events)
    assert sum(rep.speculated for rep in dev.reports) > 0


def test_device_block_state_is_in_the_state_dict() -> None:
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", block_numel=100,
                                       n_device_blocks=2) as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        sd = opt.state_dict()
    assert [layout["on_device"] for layout in sd["state"]["layouts"]][:3] == [True, True, False]
    assert all(int(b["counts"].max()) == 1 for b in sd["state"]["blocks"][:2])


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_step_whose_blocks_are_all_kept_on_the_device_reports_why_none_was_speculated(executor: str) -> None:
    """Blocks kept on the device (n_device_blocks) are stepped in step(), never speculated; where every block is,
    the report said speculating=True with no reason (and 0 speculated): it says the step did not speculate, and
    why. A step with CPU blocks beside them speculates those, and says so."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor=executor, block_numel=100) as probe:
        n = len(probe.engine.layouts)
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor=executor, block_numel=100,
                                       n_device_blocks=n) as opt:
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        report = opt.step()
    assert report.speculated == 0 and report.stepped_late == n
    assert not report.speculating and "kept on the device" in report.not_speculating_reason, report
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor=executor, block_numel=100,
                                       n_device_blocks=n - 1) as opt:
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        report = opt.step()
    assert report.speculated == 1 and report.speculating and report.not_speculating_reason == "", report


def test_the_action_of_a_block_kept_on_the_device_says_why_it_was_not_speculated() -> None:
    """A block kept on the device (n_device_blocks) was ready during backward and held from speculating; its
    validation action's reason said "the block was not reported ready during backward" (the report said why it was
    held). The action says why: kept on the device; a CPU block's action is as before."""
    model, _ = _models()
    seen: dict[int, str] = {}
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", block_numel=100,
                                       n_device_blocks=1, loss_scale=None) as opt:
        runner, executor = opt.engine.device_runner, opt.engine.executor
        for target in (runner, executor):
            method = target.run if target is runner else target.submit

            def noted(op, method=method):
                if op.kind == "apply":
                    seen[op.block] = op.payload.reason
                return method(op)

            if target is runner:
                target.run = noted
            else:
                target.submit = noted
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        report = opt.step()
    assert report.actions[0] == "step" and report.speculated >= 1
    assert seen[0].startswith("kept on the device (n_device_blocks)"), seen
    assert all("not reported ready" not in why for why in seen.values()), seen


# ---------------------------------------------------------------- event order
def test_speculation_happens_during_backward() -> None:
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="thread", block_numel=100) as opt:
        n = len(opt.engine.layouts)
        assert n >= 3
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.engine.wait()  # all speculative steps done: recorded before step() is called
        report = opt.step()
    events = list(report.events)
    ready = [b for what, b in events if what == "ready"]
    assert ready == sorted(ready, reverse=True), "gradients arrive in reverse layer order"
    # the last block's step was submitted before the first block's gradient existed: during backward
    assert events.index(("speculate", n - 1)) < events.index(("ready", 0))
    assert sorted(report.speculated_before_step()) == list(range(n))
    assert events.index(("speculated", n - 1)) < events.index(("step_called", -1))
    assert report.speculated == report.committed == n


# ---------------------------------------------------------------- late gradient, changed hparams
@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_hook_firing_twice_sums_and_redoes(executor: str) -> None:
    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with opt:
        for step in range(6):
            b1, b2 = mlp_batch(gen), mlp_batch(gen)
            opt.zero_grad()
            ropt.zero_grad()
            opt.backward(mlp_loss(model, b1))
            mlp_loss(ref, b1).backward()
            if step > 0:
                # Not on the first step: undoing step t=1 algebraically leaves ulp-sized residues in the
                # (zero) old moments, which a redo with a much smaller summed gradient would magnify.
                opt.backward(mlp_loss(model, b2))  # every hook fires a second time: late gradients
                mlp_loss(ref, b2).backward()
            report = opt.step()
            ropt.step()
            if step > 0:
                assert report.redone == report.speculated == report.blocks
                assert ("late_gradient", 0) in report.events
            assert relative_deviation(model, ref) <= TOL


# ---------------------------------------------------------------- Adam does not check finiteness again
def _forbid_gradient_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Adam's pass over a gradient to check its finiteness fail loudly (eligibility check, speculative
    step, validation): the engine must hand its knowledge on (``grads_finite=True``)."""
    import sys

    adam_module = sys.modules["sofx.adam"]  # ``sofx.adam`` is the function

    def check(x: torch.Tensor, *_: object) -> bool:
        raise AssertionError(f"Adam read a gradient of {x.numel()} elements again to check its finiteness")

    monkeypatch.setattr(adam_module, "_all_finite", check)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_the_engine_tells_adam_the_gradients_are_finite(executor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculative steps, undo+redo after clipping, blocks stepped late after the veto, overflow steps,
    gradient accumulation: no Adam call passes over a gradient again, and the trajectory is torch's."""
    _forbid_gradient_pass(monkeypatch)
    r = run_side_by_side("mlp", executor, steps=18)
    assert max(r.deviations) <= TOL
    assert [rep.skipped for rep in r.reports] == r.ref_skipped
    assert sum(rep.skipped for rep in r.reports) >= 1
    for what in ("committed", "redone", "stepped_late"):
        assert sum(getattr(rep, what) for rep in r.reports) > 0, what


@pytest.mark.parametrize("case", ["fp16_loss_scale", "late_gradient", "missing_zero", "missing_skip"])
def test_the_engine_tells_adam_the_gradients_are_finite_in_special_cases(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 gradients cast into the fp32 buffers (the sum of squares is taken there), late gradients
    summed in, zeroed missing gradients: the same tests, with Adam's own pass over the gradients forbidden."""
    _forbid_gradient_pass(monkeypatch)
    if case == "fp16_loss_scale":
        test_fp16_model_with_dynamic_loss_scale_equals_grad_scaler_on_fp32_copy()
    elif case == "late_gradient":
        test_hook_firing_twice_sums_and_redoes("thread")
    else:
        test_missing_gradients(case.split("_")[1], 8)


def test_the_process_worker_is_told_the_gradients_are_finite() -> None:
    """The worker process cannot be patched: check what it is sent. Every operation that steps carries
    grads_finite=True (the engine took the sum of squares of the very buffer the worker reads)."""
    ops: list = []

    def make_opt(*args, **kwargs):
        opt = sofx.offload.SpeculativeAdamW(*args, **kwargs)
        executor = opt.engine.executor
        submit = executor.submit

        def spy(op):
            ops.append(op)
            submit(op)

        executor.submit = spy
        return opt

    r = run_side_by_side("mlp", "process", steps=12, make_opt=make_opt)
    assert r.executor == "process"
    assert max(r.deviations) <= TOL
    stepping = [op for op in ops if op.kind == "speculate"
                or (op.kind == "apply" and op.payload.kind in ("step", "undo_redo"))]
    kinds = {op.kind if op.kind == "speculate" else op.payload.kind for op in stepping}
    assert kinds == {"speculate", "step", "undo_redo"}
    assert all(op.grads_finite for op in stepping)


def test_hparams_changed_after_backward_are_redone() -> None:
    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread", block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with opt:
        for step in range(6):
            batch = mlp_batch(gen)
            opt.backward(mlp_loss(model, batch))
            mlp_loss(ref, batch).backward()
            changed = step % 2 == 1
            if changed:
                for g in opt.param_groups + ropt.param_groups:
                    g["lr"] *= 0.5
                    g["betas"] = (g["betas"][0] - 0.05, g["betas"][1])
            report = opt.step()
            ropt.step()
            ropt.zero_grad()
            assert report.redone == (report.blocks if changed else 0)
            assert relative_deviation(model, ref) <= TOL


def test_eligibility_is_decided_once_per_block_until_the_hparams_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """With finite gradients the undo strategy depends on hparams, grad scale, layout, dtypes and which parameters
    take their first step only (L2 decay keeps the parameter there): the engine reuses its last decision per
    block, and decides again at the step after the first and when an hparam changes."""
    from sofx.offload import engine as engine_module

    calls = []
    real = engine_module.combined_eligibility
    monkeypatch.setattr(engine_module, "combined_eligibility", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, ref = _models()
    # No snapshot memory: a block needing a snapshot (beta1 < 0.5) is not speculated ("budget").
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                        snapshot_budget_bytes=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    blocks, ineligible, refused = None, [], []
    with opt:
        for step in range(6):
            if step == 3:  # snapshots needed from here on: the memo must not answer "algebraic"
                for g in opt.param_groups + ropt.param_groups:
                    g["betas"] = (0.3, g["betas"][1])
            report = mlp_step_side_by_side(opt, ropt, model, ref, gen)
            blocks = report.blocks
            ineligible.append(report.ineligible)
            refused.append(report.refused)
            assert relative_deviation(model, ref) <= TOL
            if step == 2:
                assert len(calls) == 2 * blocks  # asked on the first step and the second only
    # Step 1 (the second moments still small by chance): every block's speculative step found it needed a
    # snapshot and was taken back; the engine remembers that (sofx.offload.snapshot_needs), so step 2 does
    # not speculate them ("budget", counted as ineligible). From step 3 the strategy itself needs snapshots.
    assert refused == [0, blocks, 0, 0, 0, 0]
    assert ineligible == [0, 0, blocks, blocks, blocks, blocks]
    assert len(calls) == 3 * blocks


# ---------------------------------------------------------------- missing gradients
class Branchy(nn.Module):
    """``extra`` is used only when asked: its gradient is missing on the other steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.b(h)


@pytest.mark.parametrize("mode", ["skip", "zero"])
@pytest.mark.parametrize("block_numel", [8, 1000])  # extra alone in its blocks / sharing one block
def test_missing_gradients(mode: str, block_numel: int) -> None:
    model, ref = _models(cls=Branchy)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, executor="inline",
                                        block_numel=block_numel, missing_grad=mode)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with opt:
        for step in range(8):
            x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)
            use = step % 3 == 0
            opt.backward(nn.functional.mse_loss(model(x, use), y))
            nn.functional.mse_loss(ref(x, use), y).backward()
            if mode == "zero":  # DeepSpeed semantics: a missing gradient is a zero gradient
                for p in ref.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            report = opt.step()
            ropt.step()
            ropt.zero_grad()
            assert relative_deviation(model, ref) <= TOL
            if not use and mode == "skip" and block_numel == 8:
                assert report.not_stepped >= 1
    counts = [int(opt.state[p]["step"]) for p in model.extra.parameters()]
    assert counts == ([3, 3] if mode == "skip" else [8, 8])


@pytest.mark.parametrize("executor", ["inline", "thread"])
@pytest.mark.parametrize("freeze_before_zero_grad", [True, False])
def test_a_parameter_frozen_before_its_backward_is_not_stepped_with_missing_grad_zero(
        executor: str, freeze_before_zero_grad: bool) -> None:
    """``missing_grad="zero"`` steps the parameters that require grad and got no gradient with zeros, not the frozen
    ones: a parameter frozen after one step and before the next backward is not stepped at that step, whether it
    was frozen before ``zero_grad()`` (which ends the step) or after it (``step(); zero_grad()`` at the end of each
    iteration, the freeze at the start of the next)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(8, 4)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, missing_grad="zero") as opt:
        opt.backward(model(x).square().mean())
        opt.step()
        if freeze_before_zero_grad:
            model.bias.requires_grad_(False)
        opt.zero_grad()
        if not freeze_before_zero_grad:
            model.bias.requires_grad_(False)
        bias = model.bias.detach().clone()
        opt.backward(model(x).square().mean())
        report = opt.step()
        assert torch.equal(model.bias, bias) and int(opt.state[model.bias]["step"]) == 1
        assert int(opt.state[model.weight]["step"]) == 2 and report.committed == 1, report.summary()


# ---------------------------------------------------------------- schedules changing betas
def test_one_cycle_lr_with_cycle_momentum() -> None:
    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-3, executor="thread", block_numel=100,
                                        max_grad_norm=2.0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20, cycle_momentum=True)
    rsched = torch.optim.lr_scheduler.OneCycleLR(ropt, max_lr=1e-2, total_steps=20, cycle_momentum=True)
    gen = torch.Generator().manual_seed(0)
    betas = set()
    with opt:
        for _ in range(20):
            batch = mlp_batch(gen)
            mlp_loss(model, batch).backward()  # plain backward works (no loss scaling)
            mlp_loss(ref, batch).backward()
            opt.step()
            torch.nn.utils.clip_grad_norm_(_trainable(ref), 2.0)
            ropt.step()
            ropt.zero_grad()
            sched.step()
            rsched.step()
            betas.add(opt.param_groups[0]["betas"][0])
            assert relative_deviation(model, ref) <= TOL
    assert len(betas) > 5


_LR = torch.optim.lr_scheduler
SCHEDULERS = {
    "CyclicLR cycling betas": lambda o: _LR.CyclicLR(o, 1e-3, 1e-2, step_size_up=3, cycle_momentum=True),
    "CosineAnnealingWarmRestarts": lambda o: _LR.CosineAnnealingWarmRestarts(o, 3, 2),
    "PolynomialLR": lambda o: _LR.PolynomialLR(o, 6, 2.0),
    "MultiplicativeLR": lambda o: _LR.MultiplicativeLR(o, lambda e: 0.9),
    "ChainedScheduler": lambda o: _LR.ChainedScheduler([_LR.ExponentialLR(o, 0.9), _LR.StepLR(o, 2, 0.5)]),
    "ReduceLROnPlateau": lambda o: _LR.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "SequentialLR": lambda o: _LR.SequentialLR(o, [_LR.LinearLR(o, 0.1, total_iters=3), _LR.CosineAnnealingLR(o, 5)],
                                               [3]),
    "OneCycleLR three phases": lambda o: _LR.OneCycleLR(o, 1e-2, total_steps=10, three_phase=True),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_torch_lr_schedulers_drive_the_facade_as_torch_adamw(name: str) -> None:
    """"Every torch.optim.lr_scheduler works, including those that change betas": the ones the tests above do not
    run, stepped after each step (ReduceLROnPlateau on a flat metric), set the same lr and betas as on
    torch.optim.AdamW, and the parameters follow it."""
    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    sched, rsched = SCHEDULERS[name](opt), SCHEDULERS[name](ropt)
    gen = torch.Generator().manual_seed(0)
    seen = set()
    with opt:
        for _ in range(10):
            batch = mlp_batch(gen)
            opt.zero_grad()
            mlp_loss(model, batch).backward()
            opt.step()
            ropt.zero_grad()
            mlp_loss(ref, batch).backward()
            ropt.step()
            for s in (sched, rsched):
                s.step(1.0) if name == "ReduceLROnPlateau" else s.step()
            group, rgroup = opt.param_groups[0], ropt.param_groups[0]
            assert (group["lr"], tuple(group["betas"])) == (rgroup["lr"], tuple(rgroup["betas"]))
            seen.add((group["lr"], group["betas"][0]))
            assert relative_deviation(model, ref) <= TOL
    assert len(seen) > 2


# ---------------------------------------------------------------- gradients set by hand
def test_gradients_set_by_hand_are_stepped_late() -> None:
    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with opt:
        for _ in range(4):
            for p, q in zip(_trainable(model), _trainable(ref)):
                g = torch.randn(p.shape, generator=gen)
                p.grad, q.grad = g.clone(), g.clone()
            report = opt.step()
            ropt.step()
            assert report.speculated == 0 and report.stepped_late == report.blocks
            assert relative_deviation(model, ref) == 0.0 or relative_deviation(model, ref) <= TOL


# ---------------------------------------------------------------- step(closure)
def test_step_with_a_closure_that_is_not_callable_names_it_and_takes_no_step() -> None:
    """step(3) (a loss, or a closure's result, passed as the closure) raised Python's bare "'int' object is not
    callable", as torch.optim's step does: a TypeError names step's closure and what was given; nothing is
    stepped, and the step goes on with a closure."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
        batch = mlp_batch(torch.Generator().manual_seed(0))
        opt.backward(mlp_loss(model, batch))
        for bad in (3, mlp_loss(model, batch)):
            with pytest.raises(TypeError, match=r"^step\(closure\): closure is (an int|a Tensor), expected a callable "
                                                r"\(one that computes the loss and runs backward\) or None"):
                opt.step(bad)
        assert opt.last_report is None
        assert opt.step(lambda: 1.5) == 1.5 and opt.last_report is not None


def test_step_with_a_closure_returns_its_loss_and_keeps_the_report() -> None:
    """torch.optim's contract: step(closure) returns the closure's loss; the report is in last_report."""
    from sofx.offload.engine import EngineStepReport

    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread", block_numel=100,
                                        loss_scale=grad_scaler(init_scale=2.0 ** 8))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9 ** k)  # wraps opt.step: the value passes
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, lambda k: 0.9 ** k)
    gen = torch.Generator().manual_seed(0)
    assert opt.last_report is None
    with opt:
        for step in range(6):
            batch = mlp_batch(gen)
            returned = []

            def closure():
                opt.zero_grad()
                loss = mlp_loss(model, batch)
                opt.backward(loss)  # scaled by the loss scale
                returned.append(loss)
                return loss

            def ref_closure():
                ropt.zero_grad()
                loss = mlp_loss(ref, batch)
                loss.backward()
                return loss

            if step % 2:
                loss = opt.step(closure)
                assert loss is returned[0], "step(closure) returns exactly what the closure returned"
                assert torch.allclose(loss, ref_closure(), rtol=1e-6, atol=0) and loss.requires_grad
                report = opt.last_report
            else:
                closure()
                ref_closure()
                report = opt.step()
                assert report is opt.last_report, "step() without a closure returns the report"
            ropt.step()
            sched.step()
            rsched.step()
            assert isinstance(report, EngineStepReport) and report.iteration == step + 1
            assert report.committed > 0
            assert relative_deviation(model, ref) <= TOL


def test_last_report_is_kept_when_a_step_fails() -> None:
    from sofx.loss_scale import MinLossScaleError

    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", block_numel=100, profile="deepspeed",
                                       loss_scale=deepspeed_scaler(init_scale=1.0, hysteresis=1)) as opt:
        gen = torch.Generator().manual_seed(0)
        assert opt.step(lambda: opt.backward(mlp_loss(model, mlp_batch(gen)))) is None  # the closure's None
        first = opt.last_report
        assert first is not None and first.iteration == 1
        handle = model.inp.weight.register_hook(lambda g: g * float("inf"))
        with pytest.raises(MinLossScaleError):
            opt.step(lambda: opt.backward(mlp_loss(model, mlp_batch(gen))))
        handle.remove()
        assert opt.last_report is first


# ---------------------------------------------------------------- deepspeed profile
def test_deepspeed_profile_speculative_equals_not_speculative() -> None:
    runs = {}
    for speculate in (True, False):
        scaler = deepspeed_scaler(init_scale=2.0 ** 10, scale_window=3)
        runs[speculate] = run_side_by_side("mlp", "thread", steps=25,
                                           opt_kwargs={"profile": "deepspeed", "loss_scale": scaler,
                                                       "speculate": speculate})
    a, b = runs[True], runs[False]
    assert sum(r.speculated for r in a.reports) > 0 and sum(r.speculated for r in b.reports) == 0
    assert [r.skipped for r in a.reports] == [r.skipped for r in b.reports]
    assert [r.scale for r in a.reports] == [r.scale for r in b.reports]
    assert len(set(r.scale for r in a.reports)) >= 3  # the scale grows every 3 clean steps, backs off on inf
    for x, y in zip(a.final, b.final):
        assert (x - y).abs().max() <= TOL * max(y.abs().max().item(), 1e-3)


# ---------------------------------------------------------------- state dict
def _clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone_tree(v) for v in x]
    return x


def test_state_dict_round_trip_continues_bitwise() -> None:
    def make(model: nn.Module) -> sofx.offload.SpeculativeAdamW:
        return sofx.offload.SpeculativeAdamW(
            [{"params": [p for p in model.parameters() if p.dim() > 1]},
             {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}],
            lr=1e-2, executor="thread", block_numel=100, max_grad_norm=3.0,
            loss_scale=grad_scaler(init_scale=256.0, growth_interval=3))

    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    batches = [mlp_batch(gen) for _ in range(12)]
    with make(model) as opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.7)
        for batch in batches[:6]:
            opt.backward(mlp_loss(model, batch))
            opt.step()
            sched.step()
        saved = _clone_tree(opt.state_dict())
        saved_sched = sched.state_dict()
        saved_model = copy.deepcopy(model.state_dict())
        for batch in batches[6:]:
            opt.backward(mlp_loss(model, batch))
            opt.step()
            sched.step()
    model2, _ = _models(seed=5)
    model2.load_state_dict(saved_model)
    with make(model2) as opt2:
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, 2, gamma=0.7)
        opt2.load_state_dict(saved)
        sched2.load_state_dict(saved_sched)
        assert opt2.loss_scale == saved["state"]["scaler_state"]["scale"] != 256.0
        for batch in batches[6:]:
            opt2.backward(mlp_loss(model2, batch))
            opt2.step()
            sched2.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_a_loaded_static_loss_scale_is_the_saved_one_as_gradscaler_and_torch_optim_load_theirs() -> None:
    """A state saved with loss_scale=512.0 loaded into an optimizer made with loss_scale=1024.0 (or None, a static
    scale of 1) goes on with 512, as saved: torch's GradScaler.load_state_dict takes the saved scale (and
    init_scale, growth settings) over its constructor's, torch.optim.load_state_dict the saved lr, DeepSpeed's
    ZeRO load puts the saved loss scaler in place, static or dynamic. The run goes on as the saved one, bit for
    bit; another scale is set in the state dict before loading."""
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0)
    theirs.load_state_dict(torch.amp.GradScaler("cpu", init_scale=512.0).state_dict())
    assert theirs.get_scale() == 512.0

    def make(model: nn.Module, loss_scale) -> sofx.offload.SpeculativeAdamW:
        return sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                            loss_scale=loss_scale)

    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    batches = [mlp_batch(gen) for _ in range(6)]
    with make(model, 512.0) as opt:
        for batch in batches[:3]:
            opt.backward(mlp_loss(model, batch))
            opt.step()
        saved, saved_model = _clone_tree(opt.state_dict()), copy.deepcopy(model.state_dict())
        for batch in batches[3:]:
            opt.backward(mlp_loss(model, batch))
            opt.step()
    for other in (1024.0, None):
        model2, _ = _models(seed=5)
        model2.load_state_dict(saved_model)
        with make(model2, other) as opt2:
            assert opt2.loss_scale == (1024.0 if other else 1.0)
            opt2.load_state_dict(_clone_tree(saved))
            assert opt2.loss_scale == 512.0 and opt2.state_dict()["state"]["scaler_state"]["scale"] == 512.0
            for batch in batches[3:]:
                opt2.backward(mlp_loss(model2, batch))
                opt2.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    edited = _clone_tree(saved)
    edited["state"]["scaler_state"]["scale"] = 1024.0
    with make(_models()[0], 1024.0) as opt3:
        opt3.load_state_dict(edited)
        assert opt3.loss_scale == 1024.0
    rule = sofx.loss_scale.static_scale(1024.0)  # the functional rule: the state carries the scale
    assert rule.scale(sofx.loss_scale.StaticScaleState(512.0)) == 512.0
    with pytest.raises(StructureError, match="the saved loss-scaler state is a StaticScaleState, this optimizer's is "
                                             "a GradScalerState"):
        with make(_models()[0], "dynamic") as opt4:
            opt4.load_state_dict(_clone_tree(saved))


@pytest.mark.parametrize("scale, why", [(0.0, "expected a finite number > 0"),
                                        (1e39, "a float32 loss times it is inf"),
                                        (1e-39, "the gradients cannot be unscaled in float32")])
def test_a_static_loss_scale_every_step_would_overflow_at_is_refused_by_the_load(scale: float, why: str) -> None:
    """A state dict whose static scale was set (as the load's docs say to resume with another one) to 0, 1e39 or
    1e-39 was loaded, and every later step was skipped as an overflow (a static scale never backs off):
    static_scale refuses these values, and so does the load now, naming the entry, before anything is loaded."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                       loss_scale=512.0) as opt:
        bad = _clone_tree(opt.state_dict())
        bad["state"]["scaler_state"]["scale"] = scale
        where = re.escape(f"state_dict['state']['scaler_state']: scale = {scale!r} is invalid")
        with pytest.raises(HParamError, match=rf"{where}.*{why}"):
            opt.load_state_dict(bad)
        assert opt.loss_scale == 512.0


def test_load_state_dict_checks_before_changing_anything() -> None:
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", block_numel=100) as opt:
        sd = _clone_tree(opt.state_dict())
        before = [p.detach().clone() for p in model.parameters()]
        bad = _clone_tree(sd)
        bad["state"]["blocks"][1]["exp_avg"] = bad["state"]["blocks"][1]["exp_avg"].double()
        with pytest.raises(StructureError,
                           match=r"state_dict\['state'\]\['blocks'\]\[1\]\['exp_avg'\].*float32.*float64"):
            opt.load_state_dict(bad)
        bad = _clone_tree(sd)
        bad["param_groups"].append(dict(bad["param_groups"][0]))
        with pytest.raises(StructureError, match="2 param groups"):
            opt.load_state_dict(bad)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    # hparams this optimizer's undo mode refuses (the next backward would): refused by the load, groups unchanged
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", block_numel=100,
                                       undo="algebraic") as opt:
        bad = _clone_tree(opt.state_dict())
        bad["param_groups"][0]["betas"] = (0.0, 0.999)
        with pytest.raises(UnsupportedError, match=r"saved param_groups\[0\]: undo='algebraic' is impossible: "
                                                   r"beta1 = 0.0"):
            opt.load_state_dict(bad)
        assert opt.param_groups[0]["betas"] == (0.9, 0.999)


# ---------------------------------------------------------------- bad input, lifetime
def test_bad_input_gives_clear_errors() -> None:
    model, _ = _models()
    with pytest.raises(UnsupportedError, match="executor='gpu'"):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="gpu")
    before = [p.data_ptr() for p in model.parameters()]
    for threads in (0, 1.5, True):  # the process worker refused 0 only once started, the parameters moved
        with pytest.raises(UnsupportedError, match=rf"num_threads must be an integer >= 1.*got {threads!r}"):
            sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", num_threads=threads)
    assert [p.data_ptr() for p in model.parameters()] == before
    with pytest.raises(UnsupportedError, match="n_device_blocks=50"):
        sofx.offload.SpeculativeAdamW(model.parameters(), n_device_blocks=50)
    with pytest.raises(HParamError, match=r"defaults\['lr'\] = -1.0"):
        sofx.offload.SpeculativeAdamW(model.parameters(), lr=-1.0)
    with pytest.raises(HParamError, match="missing_grad='drop'"):
        sofx.offload.SpeculativeAdamW(model.parameters(), missing_grad="drop")
    with pytest.raises(ValueError, match="non-leaf"):
        sofx.offload.SpeculativeAdamW([model.inp.weight * 2])  # torch.optim checks this first (ValueError)
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
        with pytest.raises(UnsupportedError, match="cannot be added"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
        before = [p.detach().clone() for p in model.parameters()]
        opt.param_groups[0]["betas"] = (0.9, 1.5)
        with pytest.raises(HParamError, match=r"param_groups\[0\]\['betas'\]\[1\] = 1.5"):
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_sparse_gradients_are_refused_clearly() -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    with sofx.offload.SpeculativeAdamW(emb.parameters(), executor="inline") as opt:
        with pytest.raises(LeafError, match="sparse gradients are not supported"):
            emb(torch.tensor([1, 2])).sum().backward()


def test_close_and_context_manager_stop_the_worker_thread() -> None:
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="thread") as opt:
        thread = opt.engine.executor._thread
        assert thread.is_alive()
    assert not thread.is_alive()
    opt.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        opt.step()


def test_a_dropped_optimizer_stops_its_worker_and_leaves_the_model_alone() -> None:
    import gc

    model, _ = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), executor="thread")
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    thread = opt.engine.executor._thread
    del opt, sched
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
    mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))).backward()
    assert model.inp.weight.grad is not None, "no hook of the dropped optimizer takes the gradient"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not run on the CPU-only CI machine)")
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_cuda_model_with_cpu_masters_and_device_blocks_equals_torch(executor: str) -> None:
    model, ref = _models()
    model, ref = model.cuda(), ref.cuda()
    # The adaptive policy off: speculate in every step, also where the last ones clipped (most do here), so
    # that the device block's and the CPU blocks' undo+redo run too.
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100,
                                        n_device_blocks=1, max_grad_norm=2.0, policy=AdaptivePolicy(enabled=False))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    reports = []
    with opt:
        assert opt.state[model.inp.weight]["master"].is_cuda  # the first block stays on the device
        assert not opt.state[model.head.weight]["master"].is_cuda
        for _ in range(10):
            x, y = (t.cuda() for t in mlp_batch(gen))
            opt.backward(mlp_loss(model, (x, y)))
            mlp_loss(ref, (x, y)).backward()
            reports.append(opt.step())
            torch.nn.utils.clip_grad_norm_(_trainable(ref), 2.0)
            ropt.step()
            ropt.zero_grad()
            assert relative_deviation(model, ref) <= 1e-5  # CUDA kernels round differently from torch's
    assert sum(r.speculated for r in reports) > 0 and sum(r.redone for r in reports) > 0


@pytest.mark.parametrize("overflow", [False, True])
def test_a_block_undone_when_its_late_gradient_came_is_reported_as_the_step_it_runs(overflow: bool) -> None:
    """Two layers in two blocks, both speculated in a first backward; a second backward gives layer ``a`` a late
    gradient, so the engine undoes its speculative step at once (to sum in place). Validation then has nothing
    left to undo: the block is stepped with the sum, and the report and the event log name that ``step`` (an
    overflow: ``skip``), not ``undo_redo`` (``undo``). It still counts as speculated, undone and redone (not
    redone on an overflow), and the values are torch's AdamW on the summed gradients."""
    torch.manual_seed(0)
    a, b = nn.Linear(16, 16), nn.Linear(16, 16)
    ref = [copy.deepcopy(a), copy.deepcopy(b)]
    ropt = torch.optim.AdamW([p for m in ref for p in m.parameters()], lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(3)
    with sofx.offload.SpeculativeAdamW([*a.parameters(), *b.parameters()], lr=1e-2, executor="thread",
                                       block_numel=16 * 16 + 16) as opt:
        for step in range(3):
            x1, x2 = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
            spoil = overflow and step == 2
            opt.zero_grad()
            opt.backward(a(x1).square().mean() + b(x1).square().mean())
            opt.backward(a(x2).square().mean() * (math.inf if spoil else 1.0))  # block 0's late gradient
            report = opt.step()
            ropt.zero_grad()
            if not spoil:
                (ref[0](x1).square().mean() + ref[1](x1).square().mean() + ref[0](x2).square().mean()).backward()
                ropt.step()
            assert ("undo_now", 0) in report.events and ("late_gradient", 0) in report.events, report.events
            if spoil:
                assert report.skipped and report.actions == ("skip", "undo"), report.actions
                assert (report.speculated, report.undone, report.redone, report.not_stepped) == (2, 2, 0, 2)
            else:
                assert report.actions == ("step", "commit"), report.actions
                assert ("step", 0) in report.events and ("undo_redo", 0) not in report.events, report.events
                assert (report.speculated, report.committed, report.undone, report.redone,
                        report.stepped_late) == (2, 1, 1, 1, 0), report.summary()
            assert max(relative_deviation(m, r) for m, r in zip((a, b), ref)) <= TOL


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_forced_algebraic_l2_block_speculated_again_after_its_parameter_became_inf(executor: str) -> None:
    """undo='algebraic' with L2 decay cannot undo the step of a parameter that is not finite (weight_decay * p
    enters the second moment): the block's eligibility depends on the parameter's values there, so it is not
    taken from an earlier step's. An embedding row set to inf between steps (never looked up: its gradient is 0)
    made the cached eligibility speculate a step recorded as not undoable, and the undo of the late gradient's
    second backward failed the executor; the block is stepped late instead, as torch.optim.Adam steps it."""
    idx = torch.tensor([1, 2, 3])

    def run(make):
        torch.manual_seed(0)
        emb = nn.Embedding(8, 4)
        opt = make(emb.parameters())
        for _ in range(2):
            opt.zero_grad()
            emb(idx).square().sum().backward()
            opt.step()
        with torch.no_grad():
            emb.weight[0, 0] = float("inf")
        opt.zero_grad()
        for _ in range(2):  # the second backward's gradient is late: a speculative step is undone
            emb(idx).square().sum().backward()
        opt.step()
        return emb, opt

    got, opt = run(lambda ps: sofx.offload.SpeculativeAdam(ps, lr=1e-2, weight_decay=0.1, undo="algebraic",
                                                          executor=executor))
    with opt:
        want, topt = run(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1))
        assert opt.last_report.actions == ("step",)
        torch.testing.assert_close(got.weight[1:], want.weight[1:], rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[got.weight][key][1:], topt.state[want.weight][key][1:],
                                       rtol=1e-5, atol=1e-9)
