"""torch.optim habits that the offload engine cannot follow are refused clearly, or handled as torch would.

A speculative step that fails during backward stops the engine at ``step()`` (never a commit of a block the
failed step did not write); ``zero_grad()`` after late gradients leaves the engine usable; loading state or
reloading weights between backward and ``step()`` is refused; a ``.grad`` set after backward took the
gradient is refused; an optimizer created again over the same parameters (the old one dropped without
``close()``) owns them at once; numpy values in the param groups (a LambdaLR of ``np.cos``) reach
checkpoints as Python numbers.
"""

from __future__ import annotations

import copy
import gc
import sys
import weakref

import numpy as np
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
)

import sofx
import sofx.checkpoint
import sofx.offload
from sofx.errors import SofxError
from sofx.offload.executor import ExecutorError

TOL = 1e-6
EXECUTORS = ["inline", "thread", "process"]


def _models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = SharedMLP()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_speculative_step_that_fails_during_backward_stops_the_engine_at_step(executor, monkeypatch):
    runner = sys.modules["sofx.offload.block_runner"]
    real = runner.speculative_block_step
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("simulated failure of a speculative block step")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "speculative_block_step", fail_once)
    model, _ = _models()
    before = [p.detach().clone() for p in model.parameters()]
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    with opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        with pytest.raises(ExecutorError, match="'ready' operation on block .* failed: MemoryError: simulated"):
            opt.step()
        assert calls, "no speculative step ran"
        # nothing was published to the model (the failed block's buffer was never written)
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        with pytest.raises(ExecutorError, match="failed earlier"):
            opt.step()


@pytest.mark.parametrize("executor", EXECUTORS)
def test_zero_grad_after_late_gradients_leaves_the_engine_usable(executor):
    """Two backward passes (every hook fires twice: late gradients undo the speculative steps), then the step
    is abandoned; the next steps equal torch's."""
    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with opt:
        for step in range(4):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
            if step == 1:
                b1, b2 = mlp_batch(gen), mlp_batch(gen)
                opt.backward(mlp_loss(model, b1))
                opt.backward(mlp_loss(model, b2))  # late gradients
                opt.zero_grad()  # the step is abandoned
        assert relative_deviation(model, ref) <= TOL


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_loading_state_or_weights_between_backward_and_step_is_refused(executor):
    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with opt:
        mlp_step_side_by_side(opt, ropt, model, ref, gen)
        saved = copy.deepcopy(opt.state_dict())
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.engine.wait()  # the speculative steps of the thread executor have finished
        masters = [opt.state[p]["master"].clone() for p in model.parameters()]
        with pytest.raises(SofxError, match=r"load_state_dict\(\) was called between backward and step\(\)"):
            opt.load_state_dict(saved)
        with pytest.raises(SofxError, match=r"reload_params\(\) was called between backward and step\(\)"):
            opt.reload_params()
        assert all(torch.equal(opt.state[p]["master"], m) for p, m in zip(model.parameters(), masters))
        opt.zero_grad()  # then both work: the rollback pattern
        opt.load_state_dict(saved)
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert relative_deviation(model, ref) <= TOL


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_grad_set_after_backward_took_it_is_refused(executor):
    model, _ = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    with opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        before = [p.detach().clone() for p in model.parameters()]
        model.head.weight.grad = torch.ones_like(model.head.weight)  # gradient surgery, torch-style
        with pytest.raises(SofxError, match=r"\.grad was set after backward took this step's gradient"):
            opt.step()
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        opt.zero_grad()
        assert model.head.weight.grad is None
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(1))))
        assert opt.step().blocks > 0


@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_optimizer_created_again_over_the_same_parameters_owns_them_at_once(executor):
    """``opt = SpeculativeAdamW(...)`` a second time drops the first without close(): nothing the optimizer
    owns refers back to it, so its last reference frees it (and removes its hooks) without the cycle
    collector, which is off here."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    gc.disable()
    try:
        opt = sofx.offload.SpeculativeAdamW(model.head.parameters(), lr=1e-2, executor=executor, block_numel=100)
        b = mlp_batch(gen)
        opt.backward(mlp_loss(model, b))
        opt.step()
        first = weakref.ref(opt)
        engine = weakref.ref(opt.engine)
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
        assert first() is None and engine() is None
        ropt = torch.optim.AdamW(ref.head.parameters(), lr=1e-2, foreach=False)
        mlp_loss(ref, b).backward()
        ropt.step()
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        ropt.zero_grad()
        with opt:
            opt.zero_grad()  # gradients the first optimizer's backward left in .grad
            for _ in range(3):
                mlp_step_side_by_side(opt, ropt, model, ref, gen)
            trainable = [p for p in model.parameters() if p.requires_grad]
            assert [int(opt.state[p]["step"]) for p in trainable] == [3] * len(trainable)
        assert relative_deviation(model, ref) <= TOL
    finally:
        gc.enable()


def test_numpy_values_in_param_groups_reach_checkpoints_as_numbers(tmp_path):
    model, _ = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: np.cos(0.1 * k))
    with opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        sched.step()
        assert type(opt.param_groups[0]["lr"]) is np.float64
        state = opt.state_dict()
        assert type(state["param_groups"][0]["lr"]) is float
        path = tmp_path / "ckpt"
        sofx.checkpoint.save(path, {"opt": state, "sched": sched.state_dict()})
        loaded = sofx.checkpoint.load(path)
        assert loaded["sched"]["_last_lr"][0] == pytest.approx(1e-2 * np.cos(0.1))
        assert type(loaded["sched"]["_last_lr"][0]) is float
        opt.load_state_dict(loaded["opt"])


def test_a_state_of_another_adam_kind_is_refused():
    model, _ = _models()
    w = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    with w:
        w.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        w.step()
        state = w.state_dict()
    l2 = sofx.offload.SpeculativeAdam(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    with l2:
        masters = [l2.state[p]["master"].clone() for p in model.parameters()]
        with pytest.raises(sofx.SofxError, match="decoupled=True, this one has decoupled=False"):
            l2.load_state_dict(state)
        assert all(torch.equal(l2.state[p]["master"], m) for p, m in zip(model.parameters(), masters))
    w2 = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    with w2:
        broken = {**state, "state": {**state["state"], "blocks": state["state"]["blocks"][:-1]}}
        with pytest.raises(sofx.SofxError, match=r"the state holds \d+ blocks, this optimizer has \d+"):
            w2.load_state_dict(broken)
        w2.load_state_dict(state)
