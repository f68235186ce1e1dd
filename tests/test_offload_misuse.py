"""torch.optim habits that the offload engine cannot follow are refused clearly, or handled as torch would.

A speculative step that fails during backward stops the engine at ``step()`` (never a commit of a block the
failed step did not write); ``zero_grad()`` after late gradients leaves the engine usable; loading state or
reloading weights between backward and ``step()`` is refused; a ``.grad`` set after backward took the
gradient is refused; an optimizer created again over the same parameters (the old one dropped without
``close()``) owns them at once; numpy values in the param groups (a LambdaLR of ``np.cos``) reach
checkpoints as Python numbers; a refused constructor (an unknown backend or one that cannot step the
blocks among the refusals) leaves no trace and the running optimizer working; a bad state dict is refused
whole, naming the entry, before anything is loaded.
"""

from __future__ import annotations

import collections
import copy
import threading
import gc
import importlib
import io
import math
import re
import sys
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from helpers import assert_trees_bitwise, script_prints_ok
from test_offload_support import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    SharedMLP,
    linear_beside_torch,
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
from sofx.loss_scale import LossScaleRuleError
from sofx.offload.executor import ExecutorError

TOL = 1e-6
EXECUTORS = ["inline", "thread", "process"]


def _models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = SharedMLP()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_speculative_step_that_fails_during_backward_stops_the_engine_at_step(executor, monkeypatch):
    runner = importlib.import_module("sofx.offload.block_runner")  # (not yet imported when this test runs first)
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


@pytest.mark.parametrize("options", [dict(), dict(speculate=False), dict(gradient_accumulation_steps=2)],
                         ids=["speculated", "not-speculated", "mid-accumulation"])
def test_a_state_dict_between_backward_and_step_is_refused(options):
    """state_dict() holds no gradients: taken between backward and step() it would drop the held ones (mid-
    accumulation: the resumed run would step on the remaining micro-batches only). Refused whether or not a
    block was speculated (it was refused only then); after step() or zero_grad() it works."""
    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                       **options) as opt:
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        with pytest.raises(SofxError, match=r"state_dict\(\) was called between backward and step\(\)"):
            opt.state_dict()
        opt.zero_grad()
        assert opt.state_dict()["state"]


def test_the_state_of_an_optimizer_closed_between_backward_and_step_is_refused_saying_so():
    """Closed between backward and step(), an optimizer keeps blocks that may hold speculative steps never
    validated: opt.state[p] is refused, as between backward and step(), but its message told to read it after
    step() or zero_grad(), which a closed optimizer refuses. It says what the kept state holds and what to do; an
    optimizer closed between steps is read as before."""
    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    p = next(iter(model.parameters()))
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    opt.backward(mlp_loss(model, mlp_batch(gen)))
    opt.step()
    opt.backward(mlp_loss(model, mlp_batch(gen)))
    opt.close()
    with pytest.raises(SofxError, match=r"^opt.state\[p\] was read from an optimizer closed between backward and "
                                        r"step\(\): .*; close it after step\(\) or zero_grad\(\) to read its state"):
        opt.state[p]["exp_avg"]
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.step()
    assert int(opt.state[p]["step"]) == 1

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
        masters = [t.master.clone() for t in opt.engine.tensors.values()]
        with pytest.raises(SofxError, match=r"load_state_dict\(\) was called between backward and step\(\)"):
            opt.load_state_dict(saved)
        with pytest.raises(SofxError, match=r"reload_params\(\) was called between backward and step\(\)"):
            opt.reload_params()
        assert all(torch.equal(t.master, m) for t, m in zip(opt.engine.tensors.values(), masters))
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


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_grad_set_by_hand_that_cannot_be_taken_is_not_counted(executor):
    """A ``.grad`` set by hand that cannot be copied into its block's buffer (``p.grad.data = t`` of another size:
    torch checks the size only where ``.grad`` itself is assigned) raised out of step() after its arrival was
    counted: the next step() refused the gradient set right as "set after backward took this step's gradient", and
    one without it stepped the block with the last step's buffer. Now the arrival is counted once the gradient is
    in the buffer: nothing changed, and the gradient set right is stepped as torch steps it. (Its shape is checked
    first now, naming the parameter.)"""
    model, ref, opt, ropt = linear_beside_torch(executor)
    x = torch.randn(8, 4)
    with opt:
        opt.backward(model(x).square().mean())  # a first step: the buffer holds its gradients
        ref(x).square().mean().backward()
        opt.step()
        ropt.step()
        ropt.zero_grad()
        grad = torch.randn(3, 4)
        model.weight.grad = torch.zeros_like(model.weight)
        model.weight.grad.data = torch.ones(5)
        with pytest.raises(SofxError, match=re.escape(".grad has shape (5,), expected (3, 4)")):
            opt.step()  # (torch's reshape raised here before: "invalid for input of size 5")
        assert not opt.engine.in_step, "nothing was taken"
        model.weight.grad = grad.clone()
        ref.weight.grad = grad.clone()
        opt.step()
        ropt.step()
        assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)


# A .grad whose memory was freed (untyped_storage().resize_(0), as FSDP frees tensors) or shrunk, set on the bias
# while the weight's gradient is fine: the native gradient copy read it (a segmentation fault, or garbage summed
# into the step). Run in a subprocess so that a crash fails the test instead of ending pytest.
_FREED_GRAD = """
import torch
from sofx.errors import SofxError
from test_offload_support import linear_beside_torch

torch.set_num_threads(1)
for executor in ("inline", "thread", "process"):
    for keep in (0, 8):
        model, ref, opt, ropt = linear_beside_torch(executor)
        with opt:
            wg, bg = torch.randn(3, 4), torch.randn(3)
            model.weight.grad, model.bias.grad = wg.clone(), torch.zeros(3)
            model.bias.grad.untyped_storage().resize_(keep)
            before = [p.detach().clone() for p in model.parameters()]
            try:
                opt.step()
                raise AssertionError("stepped a gradient whose storage was " + ("freed" if keep == 0 else "shrunk"))
            except SofxError as e:
                msg = str(e)
            assert "parameter 1 (param_groups[0]['params'][1], shape (3,))" in msg, msg
            assert f"storage holds {keep} bytes" in msg and "reach byte 12" in msg, msg
            assert not opt.engine.in_step, "nothing was taken"
            assert model.weight.grad is not None and torch.equal(model.weight.grad, wg), "the weight's .grad is kept"
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            model.bias.grad = bg.clone()
            ref.weight.grad, ref.bias.grad = wg.clone(), bg.clone()
            opt.step()
            ropt.step()
            assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
print("ok")
"""


def test_a_grad_whose_storage_was_freed_is_refused_naming_the_parameter_and_nothing_is_taken():
    script_prints_ok(_FREED_GRAD)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_grad_set_through_data_to_another_shape_is_refused_as_torch_refuses_it(executor):
    """``p.grad.data = t`` of as many elements in another shape (torch checks the shape only where ``.grad``
    itself is assigned) was reshaped into the block's buffer and stepped; ``torch.optim.AdamW`` (foreach and
    for-loop) raises at the mismatch. Refused now, naming the parameter and both shapes, before any gradient of
    the step is taken; the gradient set right is then stepped as torch steps it."""
    model, ref, opt, ropt = linear_beside_torch(executor)
    with opt:
        wg, bg = torch.randn(3, 4), torch.randn(3)
        model.bias.grad = bg.clone()
        model.weight.grad = torch.zeros_like(model.weight)
        model.weight.grad.data = wg.t().clone()  # (4, 3): 12 elements
        torch_side = copy.deepcopy(ref)  # what torch does (its failed step has changed the weight: decayed)
        torch_side.weight.grad = torch.zeros_like(torch_side.weight)
        torch_side.weight.grad.data = wg.t().clone()
        with pytest.raises(RuntimeError, match="must match the size"):
            torch.optim.AdamW(torch_side.parameters(), lr=1e-2, foreach=False).step()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(SofxError, match=re.escape("parameter 0 (param_groups[0]['params'][0], shape (3, 4)): "
                                                      ".grad has shape (4, 3), expected (3, 4)")):
            opt.step()
        assert not opt.engine.in_step and torch.equal(model.bias.grad, bg), "nothing was taken"
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        model.weight.grad = wg.clone()
        ref.weight.grad, ref.bias.grad = wg.clone(), bg.clone()
        opt.step()
        ropt.step()
        assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_optimizer_created_again_over_the_same_parameters_owns_them_at_once(executor):
    """``opt = SpeculativeAdamW(...)`` a second time drops the first without close(): nothing the optimizer
    owns refers back to it, so its last reference frees it (and removes its hooks) without the cycle
    collector, which is off here."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    # The first optimizer a process makes imports torch._dynamo (torch.optim's add_param_group is wrapped by
    # torch._disable_dynamo), and that import keeps the frames that called it, the optimizer's among them:
    # a test run first in its process would see the first optimizer kept alive by torch, not by sofx.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
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
        with pytest.raises(sofx.SofxError, match=r"\['decoupled_weight_decay'\] = True: a SpeculativeAdam has L2"):
            l2.load_state_dict(state)
        # without the groups' flag (a state dict of an older sofx), the engine state's own record refuses it
        old_groups = [{k: v for k, v in g.items() if k != "decoupled_weight_decay"} for g in state["param_groups"]]
        with pytest.raises(sofx.SofxError, match="decoupled=True, this one has decoupled=False"):
            l2.load_state_dict({**state, "param_groups": old_groups})
        assert all(torch.equal(l2.state[p]["master"], m) for p, m in zip(model.parameters(), masters))
    w2 = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    with w2:
        broken = {**state, "state": {**state["state"], "blocks": state["state"]["blocks"][:-1]}}
        with pytest.raises(sofx.SofxError, match=r"the state holds \d+ blocks, this optimizer has \d+"):
            w2.load_state_dict(broken)
        w2.load_state_dict(state)


def test_a_torch_optim_state_dict_is_refused_naming_how_to_carry_its_moments_over():
    """torch.optim.AdamW's state dict (per-parameter entries keyed by index) was refused as "not an offload engine
    state (format None, ...)"; the error now says what it is and how to carry its moments over
    (``opt.state[p][key] = value``), which goes on with torch's trajectory bit for bit. Nothing is loaded."""
    model, ref = _models()
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        topt.zero_grad()
        mlp_loss(ref, mlp_batch(gen)).backward()
        topt.step()
    topt.zero_grad()
    model.load_state_dict(ref.state_dict())
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        with pytest.raises(sofx.StructureError, match=r"state_dict\['state'\] is a torch\.optim state .*"
                                                      r"opt\.state\[p\]\[key\] = value"):
            opt.load_state_dict(topt.state_dict())
        assert all(int(opt.state[p]["step"]) == 0 for p in model.parameters())
        assert all(torch.equal(opt.state[p]["master"], p.detach()) for p in model.parameters())
        for p, q in zip(model.parameters(), ref.parameters()):
            for key, value in topt.state.get(q, {}).items():
                opt.state[p][key] = value
        for _ in range(2):
            mlp_step_side_by_side(opt, topt, model, ref, gen)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))



def test_a_parameters_whole_state_assigned_as_torch_optim_assigns_it_is_taken_and_bad_entries_change_nothing():
    """``opt.state[p] = {...}``, torch.optim's way to set (or carry over) a parameter's whole state, raised
    Python's bare "TypeError: only integer tensors of a single element can be converted to an index" (the view had
    no item assignment). It takes torch's entry (``step``, ``exp_avg``, ``exp_avg_sq``; ``master`` kept unless
    given) and goes on with torch's trajectory bit for bit; ``{}`` starts the parameter afresh, as torch's next
    step after ``opt.state[p] = {}``. Every value is checked before any is written: an entry refused (a negative
    second moment, a key missing or unknown, no mapping, a tensor that is none of the optimizer's parameters)
    changes nothing."""
    model, ref = _models()
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        _torch_mlp_step(topt, ref, gen)
    model.load_state_dict(ref.state_dict())
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        params, refs = list(model.parameters()), list(ref.parameters())
        for p, q in zip(params, refs):
            opt.state[p] = topt.state[q]
        mlp_step_side_by_side(opt, topt, model, ref, gen)
        assert all(torch.equal(p, q) for p, q in zip(params, refs))
        opt.state[params[0]], topt.state[refs[0]] = {}, {}
        assert int(opt.state[params[0]]["step"]) == 0 and not opt.state[params[0]]["exp_avg_sq"].any()
        assert torch.equal(opt.state[params[0]]["master"], params[0].detach())
        mlp_step_side_by_side(opt, topt, model, ref, gen)
        assert all(torch.equal(p, q) for p, q in zip(params, refs))
        p, good = params[1], topt.state[refs[1]]
        before = {k: v.clone() for k, v in opt.state[p].items()}
        for bad, match in (({**good, "step": 9, "exp_avg_sq": -torch.ones_like(p)}, "negative"),
                           ({"step": 9, "exp_avg": good["exp_avg"]}, "'exp_avg_sq' missing"),
                           ({**good, "max_exp_avg_sq": good["exp_avg_sq"]}, "max_exp_avg_sq"),
                           ({**good, "step": 2.5}, "whole number"), (5, "expected a mapping")):
            with pytest.raises(sofx.UnsupportedError, match=match):
                opt.state[p] = bad
        with pytest.raises(sofx.UnsupportedError, match="not one of this optimizer's parameters"):
            opt.state[torch.nn.Parameter(torch.zeros(2))] = {}
        assert all(torch.equal(v, before[k]) for k, v in opt.state[p].items())
        mlp_step_side_by_side(opt, topt, model, ref, gen)
        assert all(torch.equal(p, q) for p, q in zip(params, refs))



def test_del_of_a_parameters_state_and_clear_reset_it_as_torch_optim_does():
    """``del opt.state[p]`` (torch.optim: the parameter starts afresh at its next step) raised a bare
    "AttributeError: __delitem__", and ``opt.state.clear()`` (torch: every parameter afresh) "'_ParamStateView'
    object has no attribute 'clear'". They reset that parameter's (every parameter's) step count and moments,
    masters kept, as ``opt.state[p] = {}`` and ``opt.state = {}`` do; the run goes on as torch's, bit for bit. A
    tensor that is none of the optimizer's parameters is refused naming what it is."""
    model, ref = _models()
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        params, refs = list(model.parameters()), list(ref.parameters())
        for reset in ("del", "clear"):
            for _ in range(2):
                mlp_step_side_by_side(opt, topt, model, ref, gen)
            if reset == "del":
                del opt.state[params[1]], topt.state[refs[1]]
                assert int(opt.state[params[1]]["step"]) == 0 and int(opt.state[params[0]]["step"]) > 0
            else:
                opt.state.clear()
                topt.state.clear()
                assert all(int(opt.state[p]["step"]) == 0 and not opt.state[p]["exp_avg"].any() for p in params)
            assert all(torch.equal(opt.state[p]["master"], p.detach()) for p in params)
            mlp_step_side_by_side(opt, topt, model, ref, gen)
            assert all(torch.equal(p, q) for p, q in zip(params, refs))
        with pytest.raises(sofx.UnsupportedError, match="not one of this optimizer's parameters"):
            del opt.state[torch.nn.Parameter(torch.zeros(2))]


def test_the_state_mappings_methods_that_torch_users_call_reset_as_torch_does():
    """``opt.state.clear()`` (a reset of every parameter's state, as torch.optim's defaultdict clears), and
    ``pop``, ``popitem``, ``update`` and ``setdefault`` raised a bare AttributeError (the view was a read-only
    Mapping). They act as on torch's dict: ``clear`` is ``opt.state = {}``, ``pop(p)`` gives ``p``'s state as it was
    (copies: the view's tensors are the blocks', which the reset zeroes) and forgets it, ``update`` sets states;
    ``popitem`` (whose entry is never gone) is refused saying so."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with opt:
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        opt.state.clear()
        ropt.state.clear()
        assert all(int(s["step"]) == 0 and not s["exp_avg"].any() for s in opt.state.values())
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        (p, rp), (q, rq) = list(zip(model.parameters(), ref.parameters()))[:2]
        popped, rpopped = opt.state.pop(p), ropt.state.pop(rp)
        assert int(popped["step"]) == 2 and torch.equal(popped["exp_avg"], rpopped["exp_avg"])
        assert int(opt.state[p]["step"]) == 0 and not opt.state[p]["exp_avg_sq"].any()
        opt.state.update({q: {}})
        ropt.state.update({rq: {}})
        assert opt.state.setdefault(q, {})["step"] == 0
        with pytest.raises(sofx.UnsupportedError, match=r"popitem\(\): .* an entry for every parameter"):
            opt.state.popitem()
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert relative_deviation(model, ref) <= TOL


def test_the_whole_state_assigned_as_torch_optim_assigns_it_is_taken_and_bad_entries_change_nothing():
    """``opt.state = defaultdict(dict, {p: saved})`` (torch.optim: the state replaced, ``p`` with its saved entry,
    every other parameter afresh) was refused as "can only be reset" for any mapping but an empty one. It is taken as
    torch takes it, bit for bit side by side (a plain dict too: a parameter it leaves out starts afresh, as under
    torch's defaultdict), every entry checked before anything is written: a bad entry, or a key that is none of the
    optimizer's parameters, changes nothing."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        params, refs = list(model.parameters()), list(ref.parameters())
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        saved, rsaved = copy.deepcopy(opt.state[params[1]]), copy.deepcopy(ropt.state[refs[1]])
        mlp_step_side_by_side(opt, ropt, model, ref, gen)
        before = [{k: v.clone() for k, v in opt.state[q].items()} for q in params]
        wrong = {**copy.deepcopy(opt.state[params[2]]), "step": -1}
        for bad, match in (({params[1]: saved, params[2]: wrong}, r"parameter 2 must be a whole number"),
                           ({params[1]: saved, torch.zeros(2): {}}, r"not one of this optimizer's parameters"),
                           ({params[1]: 5}, r"expected a mapping")):
            with pytest.raises(sofx.UnsupportedError, match=match):
                opt.state = bad
            assert all(torch.equal(v, b[k]) for q, b in zip(params, before) for k, v in opt.state[q].items())
        opt.state = {params[1]: saved}
        ropt.state = collections.defaultdict(dict, {refs[1]: rsaved})
        assert int(opt.state[params[1]]["step"]) == 2 and int(opt.state[params[0]]["step"]) == 0
        assert all(torch.equal(opt.state[q]["master"], q.detach()) for q in params)
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert all(torch.equal(a, b) for a, b in zip(params, refs))
        assert [int(opt.state[q]["step"]) for q in params] == [int(ropt.state[r].get("step", 0)) for r in refs]


def test_the_whole_state_assigned_something_that_is_no_mapping_is_refused_naming_it():
    """``opt.state = 5`` (or a list, a tensor) is refused naming what torch.optim's state is and the value given.
    Its refusal called a ``_described`` the facade never imported: a bare NameError from inside the library. The
    state is left as it was."""
    model = torch.nn.Linear(3, 2)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        p = next(model.parameters())
        opt.state[p]["step"] = torch.tensor(3.0)
        for bad, named in ((5, "int"), ([p], "list"), (torch.zeros(2), r"a torch\.float32 tensor of shape \(2,\)")):
            with pytest.raises(sofx.UnsupportedError, match=rf"^opt\.state must be a mapping of parameters to their "
                                                            rf"states.*got {named}; "):
                opt.state = bad
            assert int(opt.state[p]["step"]) == 3


def test_a_parameters_state_cleared_starts_it_afresh_as_torch_optims():
    """``opt.state[p].clear()`` (torch.optim: ``p``'s entry empty, its next step starts it afresh) was refused as a
    removal of a key, naming only the reset of every parameter; it starts ``p`` afresh (step 0, zero moments, its
    master kept), as ``del opt.state[p]``. A key's removal is still refused, naming those."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        p, rp, q = model.mid.weight, ref.mid.weight, model.inp.weight
        opt.state[p].clear()
        ropt.state[rp].clear()
        assert int(opt.state[p]["step"]) == 0 and not opt.state[p]["exp_avg"].any() and int(opt.state[q]["step"]) == 2
        assert torch.equal(opt.state[p]["master"], p.detach())
        mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        with pytest.raises(sofx.UnsupportedError, match=r"always has .*: assign a key .*; opt\.state\[p\]\.clear\(\) "
                                                        r"or del opt\.state\[p\] starts p afresh"):
            opt.state[p].pop("step")


def test_a_parameters_state_updated_with_a_bad_value_changes_nothing():
    """``opt.state[p].update(state)`` (a torch.optim parameter's state carried over key by key) wrote each key in
    turn: a bad value after a good one was refused with the good one written (a half-applied state: the step count
    set, the moments not). Every value is checked before any is written; a good update is taken whole."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        p = model.mid.weight  # parameter 2
        with pytest.raises(sofx.UnsupportedError, match=r"state\['exp_avg'\] of parameter 2 must be a float tensor"):
            opt.state[p].update({"step": 3, "exp_avg": torch.zeros(5)})
        assert int(opt.state[p]["step"]) == 0
        opt.state[p].update({"step": 4, "exp_avg": torch.full_like(p, 0.5)}, exp_avg_sq=torch.full_like(p, 2.0))
        assert int(opt.state[p]["step"]) == 4 and bool((opt.state[p]["exp_avg_sq"] == 2.0).all())
        assert bool((opt.state[p]["exp_avg"] == 0.5).all())


def test_the_states_updated_with_a_bad_entry_change_no_parameter():
    """``opt.state.update({p: ..., q: ...})`` (torch.optim's states of several parameters carried over at once) set
    them one by one: a bad entry for ``q`` after a good one for ``p`` was refused with ``p``'s state written (a
    half-applied update: ``p`` started afresh, ``q`` not). Every entry is checked before any is written."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        p, q = model.mid.weight, model.mid.bias  # parameters 2 and 3
        opt.state[p]["step"] = 5
        with pytest.raises(sofx.UnsupportedError, match=r"state\['step'\] of parameter 3 must be a whole number"):
            opt.state.update({p: {}, q: {"step": -1, "exp_avg": torch.zeros_like(q),
                                         "exp_avg_sq": torch.zeros_like(q)}})
        assert int(opt.state[p]["step"]) == 5
        with pytest.raises(sofx.UnsupportedError, match=r"opt.state.update\(...\): p is a tensor of shape \(2,\)"):
            opt.state.update([(p, {}), (torch.zeros(2), {})])
        assert int(opt.state[p]["step"]) == 5
        opt.state.update({p: {}, q: {"step": 2, "exp_avg": torch.ones_like(q), "exp_avg_sq": torch.ones_like(q)}})
        assert int(opt.state[p]["step"]) == 0 and int(opt.state[q]["step"]) == 2
        assert bool((opt.state[q]["exp_avg"] == 1).all())


def test_states_given_as_other_parameters_live_views_are_read_before_any_is_written():
    """``opt.state.update({p: opt.state[q], q: {}})`` and a swap of two parameters' moments read the live views of
    an entry after an earlier entry of the same call had written them (p took q's state already reset; a swap wrote
    one moment over the other and then copied it back), and an entry that is another parameter's ``opt.state[q]``
    moved p's weights to q's (its ``master``), where torch.optim's ``opt.state[p] = opt.state[q]`` leaves the
    parameter alone. Every value is read before any is written; another parameter's entry gives its torch keys."""
    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        batch = mlp_batch(gen)
        opt.zero_grad()
        opt.backward(mlp_loss(model, batch))
        opt.step()
        q, p = model.inp.bias, model.mid.bias  # (q is parameter 1, p parameter 3)
        assert q.shape == p.shape
        q_state = {k: v.clone() for k, v in opt.state[q].items()}
        p_weight = p.detach().clone()
        opt.state.update({q: {}, p: opt.state[q]})
        assert torch.equal(opt.state[p]["exp_avg"], q_state["exp_avg"]) and int(opt.state[p]["step"]) == 1
        assert torch.equal(opt.state[p]["exp_avg_sq"], q_state["exp_avg_sq"]) and int(opt.state[q]["step"]) == 0
        assert torch.equal(p, p_weight) and torch.equal(opt.state[p]["master"], p_weight)
        m, v = opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()
        view = opt.state[p]
        opt.state[p] = {"step": 1, "exp_avg": view["exp_avg_sq"], "exp_avg_sq": view["exp_avg"].abs()}
        assert torch.equal(opt.state[p]["exp_avg"], v) and torch.equal(opt.state[p]["exp_avg_sq"], m.abs())


def test_masters_given_as_the_model_parameters_are_read_before_any_master_is_written():
    """A ``master`` given as a model parameter (``opt.state.update({p: {..., "master": q.detach()}, q: {...,
    "master": p.detach()}})``, a swap of two layers' weights) was read after an earlier entry's master had been
    written into that parameter (a master is shown to its model parameter at once): both parameters ended with one
    weight. Every value is read before any is written, the model's parameters too."""
    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        opt.zero_grad()
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.step()
        q, p = model.inp.bias, model.mid.bias
        assert q.shape == p.shape
        torch_keys = ("step", "exp_avg", "exp_avg_sq")
        states = {t: {k: opt.state[t][k].clone() for k in torch_keys} for t in (p, q)}
        old_p, old_q = p.detach().clone(), q.detach().clone()
        opt.state.update({p: {**states[p], "master": q.detach()}, q: {**states[q], "master": p.detach()}})
        assert torch.equal(p, old_q) and torch.equal(q, old_p)
        assert torch.equal(opt.state[p]["master"], old_q) and torch.equal(opt.state[q]["master"], old_p)


def test_writing_each_parameters_state_in_turn_reads_no_other_parameters_storage(monkeypatch):
    """A loop writing each parameter's state through the views (``opt.state[p] = {..., "master": x}``, or
    ``opt.state[p]["master"] = x``) was quadratic in the parameters: every write listed the storage of every block
    tensor and every model parameter (to copy a value read before it is written) and rebuilt a flag and a view per
    parameter of the block to show one master (measured: 2000 parameters of 4 elements, 4.1 s for such a loop). A
    write looks at the storage it writes only (a value on it is copied first, as before: the swaps above) and shows
    the one master; the loop is linear, its results the same."""
    from sofx.offload.blocks import BlockTensors

    gen = torch.Generator().manual_seed(0)
    n = 64
    params = [nn.Parameter(torch.randn(3, generator=gen)) for _ in range(n)]
    with sofx.offload.SpeculativeAdamW(params, lr=1e-2, executor="inline") as opt:
        looked = [0]
        real_storage, real_views = torch.Tensor.untyped_storage, BlockTensors.views

        def storage(self):
            looked[0] += 1
            return real_storage(self)

        def views(self, flat, layout):
            got = real_views(self, flat, layout)
            looked[0] += len(got)
            return got

        news = [torch.randn(3, generator=gen) for _ in params]
        monkeypatch.setattr(torch.Tensor, "untyped_storage", storage)
        monkeypatch.setattr(BlockTensors, "views", views)
        counts = []
        for p, x in zip(params, news):
            looked[0] = 0
            opt.state[p] = {"step": 2, "exp_avg": x * 0.5, "exp_avg_sq": x * x, "master": x}
            opt.state[p]["master"] = x + 1
            counts.append(looked[0])
        monkeypatch.undo()
        assert max(counts) <= 24, counts[:: n // 10]
        for p, x in zip(params, news):
            assert torch.equal(p.detach(), x + 1) and torch.equal(opt.state[p]["master"], x + 1)
            assert torch.equal(opt.state[p]["exp_avg_sq"], x * x) and int(opt.state[p]["step"]) == 2


def test_a_parameters_state_deep_copied_to_roll_back_as_torch_users_do():
    """``copy.deepcopy(opt.state[p])`` (a snapshot of a parameter's state, to roll back to) and
    ``copy.deepcopy(opt.state)`` deep-copied the engine behind the view, its worker's locks too, and failed with a
    bare TypeError "cannot pickle '_thread.lock' object"; ``opt.state[p].copy()`` was an AttributeError. As on
    torch's dicts: a deep copy is a dict of copies (``opt.state[p] = saved`` takes it back: the run goes on as torch's
    rolled back the same way), ``copy()`` a dict of the state's own tensors."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread", block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with opt:
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        p, rp = model.mid.weight, ref.mid.weight
        saved, rsaved = copy.deepcopy(opt.state[p]), copy.deepcopy(ropt.state[rp])
        everything = copy.deepcopy(opt.state)
        assert type(saved) is dict and torch.equal(saved["exp_avg"], rsaved["exp_avg"])
        assert opt.state[p].copy()["exp_avg"].data_ptr() == opt.state[p]["exp_avg"].data_ptr()
        assert len(everything) == len(opt.state) and all(type(s) is dict for s in everything.values())
        mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert int(saved["step"]) == 2 and not torch.equal(saved["exp_avg"], opt.state[p]["exp_avg"])
        opt.state[p] = saved
        ropt.state[rp] = rsaved
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert relative_deviation(model, ref) <= TOL
        assert int(opt.state[p]["step"]) == int(ropt.state[rp]["step"]) == 4


def test_a_copy_of_a_parameters_state_holds_torchs_float32_step_and_a_foreach_torch_optimizer_takes_it():
    """``copy.deepcopy(opt.state[p])``, ``opt.state.pop(p)`` and a pickled ``opt.state`` (torch.optim's keys, as a
    torch user carries a parameter's state over) held the engine's int64 step, where torch.optim.AdamW keeps a
    float32 0-d tensor: a torch AdamW given it stepped on its for-loop path but its foreach path (CUDA's default)
    and its fused one raised "Tensors of the same index must be on the same device and the same dtype except `step`
    tensors that can be CPU and float32/64". The copies hold torch's float32 step; a foreach torch AdamW given them
    goes on as the offload optimizer, and they come back (``opt.state[p] = copy``). ``opt.state[p]["step"]`` itself
    stays a live view of the engine's int64 count (zeroing it resets the count)."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        for _ in range(2):
            opt.backward(mlp_loss(model, mlp_batch(gen)))
            opt.step()
        params, refs = list(model.parameters()), list(ref.parameters())
        buffer = io.BytesIO()
        torch.save(opt.state, buffer)
        buffer.seek(0)
        pickled = list(torch.load(buffer, weights_only=False).values())
        copies = [copy.deepcopy(opt.state[p]) for p in params]
        counts = [int(opt.state[p]["step"]) for p in params]
        assert all(c["step"].dtype == torch.float32 and c["step"].dim() == 0 for c in copies + pickled)
        assert [float(c["step"]) for c in copies] == [float(c["step"]) for c in pickled] == counts and 2 in counts
        assert opt.state[params[0]]["step"].dtype == torch.int64
        ref.load_state_dict(model.state_dict())
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
        for r, c in zip(refs, copies):
            ropt.state[r] = c
        popped = opt.state.pop(params[0])
        assert popped["step"].dtype == torch.float32 and int(opt.state[params[0]]["step"]) == 0
        opt.state[params[0]] = popped
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert relative_deviation(model, ref) <= TOL
        assert [int(opt.state[p]["step"]) for p in params] == [int(ropt.state[r]["step"]) for r in refs] \
            == [c + 2 if c else 0 for c in counts]


def test_the_state_saved_with_torch_save_is_copies_as_torch_optims():
    """``torch.save(opt.state)`` and ``torch.save(opt.state[p])`` (torch.optim's are dicts, saved as they are)
    pickled the engine behind the views and failed with a bare "AttributeError: Can't pickle local object
    '_hparams_of.<locals>.hparams'". They are saved as their deep copies (dicts of copies of torch.optim's keys);
    ``copy.copy`` is still a view."""
    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        mlp_loss(model, mlp_batch(gen)).backward()
        opt.step()
        p = model.mid.weight
        for saved, whole in ((opt.state[p], False), (opt.state, True)):
            buffer = io.BytesIO()
            torch.save(saved, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            state = next(s for q, s in loaded.items() if torch.equal(q, p)) if whole else loaded
            assert type(state) is dict and sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
            assert int(state["step"]) == 1 and torch.equal(state["exp_avg"], opt.state[p]["exp_avg"])
        assert len(loaded) == len(opt.state)
        assert copy.copy(opt.state[p])["exp_avg"].data_ptr() == opt.state[p]["exp_avg"].data_ptr()
        assert copy.copy(opt.state)[p]["exp_avg"].data_ptr() == opt.state[p]["exp_avg"].data_ptr()


@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_grad_scaler_stepping_the_optimizer_is_refused_by_name_and_leaves_it_usable(unscale_first):
    """``scaler.scale(loss).backward(); scaler.step(opt)``, torch's AMP habit, failed inside the GradScaler with
    "No inf checks were recorded for this optimizer" (it found no ``.grad``), which says nothing of what to do
    instead. The optimizer lets the GradScaler call its step (``_step_supports_amp_scaling``), which refuses it
    naming the GradScaler and ``loss_scale='dynamic'``; after ``zero_grad()`` the optimizer's own loop steps as
    torch's (nothing the GradScaler set on the optimizer is left behind)."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        scaler = torch.amp.GradScaler("cpu")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(model(torch.randn(4, model.inp.in_features, generator=gen)).square().sum()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        with pytest.raises(sofx.UnsupportedError, match=r"GradScaler.step\(opt\) cannot drive .* opt.zero_grad\(\) .* "
                                                        r"loss_scale='dynamic'"):
            scaler.step(opt)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        opt.zero_grad()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert relative_deviation(model, ref) <= TOL


@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_grad_scaler_whose_step_of_the_optimizer_was_refused_carries_over_its_scale(unscale_first):
    """After ``scaler.step(opt)`` was refused (nothing stepped, no inf check recorded), from_torch_grad_scaler(scaler)
    said "between unscale_()/step() and update(): call scaler.update() first", and torch's update() then raised
    "No inf checks were recorded prior to update": no way on. The scaler still holds this step's scale and growth
    tracker (no update is owed): they are carried over, as from its state_dict(); the refusal of the step names
    from_torch_grad_scaler. A scaler whose step of a torch optimizer is not yet updated is still refused."""
    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        scaler = torch.amp.GradScaler("cpu", init_scale=1000.3, growth_factor=1.5, growth_interval=3)
        scaler.scale(model(torch.randn(4, model.inp.in_features, generator=gen)).square().sum()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        with pytest.raises(sofx.UnsupportedError, match=r"from_torch_grad_scaler\(scaler\)"):
            scaler.step(opt)
        opt.zero_grad()
        rule, state = sofx.loss_scale.from_torch_grad_scaler(scaler)
        assert (rule, state) == sofx.loss_scale.from_torch_grad_scaler(scaler.state_dict())
        assert state.scale == scaler.get_scale() and (rule.growth_factor, rule.growth_interval) == (1.5, 3)
    p = torch.nn.Parameter(torch.ones(2))
    torch_opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale(p.sum()).backward()
    scaler.step(torch_opt)
    with pytest.raises(sofx.HParamError, match=r"between unscale_\(\)/step\(\) and update\(\): .*call "
                                               r"scaler\.update\(\) first"):
        sofx.loss_scale.from_torch_grad_scaler(scaler)


def test_the_state_of_a_tensor_that_is_no_parameter_is_a_key_error_naming_it_not_printing_it():
    """``opt.state[q]`` for a tensor that is none of the optimizer's parameters raised ``KeyError(q)``, whose
    text is the whole tensor's repr (torch's defaultdict gives ``{}``); a KeyError still (``q in opt.state`` and
    ``opt.state.get(q)`` rely on it), saying what ``q`` is. Each lookup is by a table of the parameters (it searched
    them one by one: quadratic for a loop over every parameter's state), and finds each parameter's own."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        params = list(model.parameters())
        stranger = torch.full((1000,), 7.0)
        with pytest.raises(KeyError, match=r"a tensor of shape \(1000,\) \(float32, cpu\) is not one of this "
                                           r"optimizer's parameters") as raised:
            opt.state[stranger]
        assert "7." not in str(raised.value)
        assert stranger not in opt.state and opt.state.get(stranger) is None and "w" not in opt.state
        assert [p in opt.state for p in params] == [True] * len(params)
        assert [opt.state[p]["exp_avg"].shape for p in params] == [p.shape for p in params]
        assert list(opt.state) == params


def _torch_mlp_step(topt: torch.optim.Optimizer, ref: nn.Module, gen: torch.Generator) -> None:
    mlp_loss(ref, mlp_batch(gen)).backward()
    topt.step()
    topt.zero_grad()


def test_a_fresh_torch_optim_state_dict_is_refused_saying_it_holds_no_moments_and_what_to_do():
    """torch.optim's state dict before its first step (``state`` empty) was refused as "a torch.optim state
    (per-parameter entries keyed by index: [])". It is still refused (a torch state dict after a step is too: taking
    only the empty one would make a checkpoint load work or fail by when it was saved), but the error says what it
    is -- a torch optimizer's state before its first step, no moments to carry over -- and what to do: take its
    hparams into opt.param_groups. Nothing is loaded."""
    model, ref = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        before = copy.deepcopy(opt.state_dict())
        fresh = torch.optim.AdamW(ref.parameters(), lr=3e-4).state_dict()
        with pytest.raises(sofx.StructureError) as info:
            opt.load_state_dict(fresh)
        message = str(info.value)
        assert "[]" not in message
        assert re.search(r"state_dict\['state'\] is empty: a torch\.optim state dict taken before its first step "
                         r"\(no per-parameter moments\)", message), message
        assert re.search(r"set its hparams in opt\.param_groups .*opt\.state = collections\.defaultdict\(dict\)",
                         message), message
        assert_trees_bitwise(before, opt.state_dict())


def test_torch_optim_options_are_carried_and_unsupported_ones_refused_not_ignored():
    """The groups carry torch.optim.AdamW's options with its defaults (state dicts move between the two);
    amsgrad / maximize / differentiable set, or the other weight decay, are refused wherever they come from:
    the constructor, a group dict (e.g. a torch optimizer's groups), a later edit, a loaded state dict."""
    model, ref = _models()
    torch_groups = torch.optim.AdamW(ref.parameters()).param_groups
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", foreach=False, fused=True,
                                       capturable=True) as opt:  # (fused with foreach is refused, as torch does)
        assert {k: v for k, v in opt.param_groups[0].items() if k != "params"}.keys() == \
            {k for k in torch_groups[0] if k != "params"}
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        state = opt.state_dict()
        opt.param_groups[0]["maximize"] = True   # an edit between steps: refused at the next step's first block
        with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[0\]\['maximize'\] = True"):
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(1))))
        opt.zero_grad()
        opt.param_groups[0]["maximize"] = False
        saved = {**state, "param_groups": [{**state["param_groups"][0], "amsgrad": True}]}
        masters = [opt.state[p]["master"].clone() for p in model.parameters()]
        with pytest.raises(sofx.UnsupportedError, match=r"saved param_groups\[0\]\['amsgrad'\] = True"):
            opt.load_state_dict(saved)
        assert all(torch.equal(opt.state[p]["master"], m) for p, m in zip(model.parameters(), masters))
        assert opt.param_groups[0]["amsgrad"] is False
    for kwargs in ({"amsgrad": True}, {"maximize": True}, {"differentiable": True}):
        with pytest.raises(sofx.UnsupportedError, match=f"defaults\\['{next(iter(kwargs))}'\\] = True"):
            sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", **kwargs)
    with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[0\]\['maximize'\]"):
        sofx.offload.SpeculativeAdamW([{"params": list(model.parameters()), "maximize": True}], executor="inline")
    with pytest.raises(sofx.UnsupportedError, match="a SpeculativeAdam has L2 weight decay; use SpeculativeAdamW"):
        sofx.offload.SpeculativeAdam(model.parameters(), executor="inline", decoupled_weight_decay=True)
    with sofx.offload.SpeculativeAdam(model.parameters(), 1e-3, (0.9, 0.999), 1e-8, 0.0, False,
                                      executor="inline") as adam:  # torch.optim.Adam's positional order
        assert adam.param_groups[0]["decoupled_weight_decay"] is False


def test_numpy_float32_hparams_are_numbers():
    """A LambdaLR whose lambda returns numpy's float32 (numpy 2 keeps the type) gives a float32 lr: accepted as
    torch accepts it, the trajectory torch's."""
    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: np.float32(0.9) ** k) for o in (opt, ropt)]
    gen = torch.Generator().manual_seed(0)
    with opt:
        for _ in range(3):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
            for s in scheds:
                s.step()
        assert type(opt.param_groups[0]["lr"]) is np.float32
    assert relative_deviation(model, ref) <= TOL


def test_numpy_or_tensor_max_grad_norm_and_static_loss_scale_are_numbers():
    """loss_scale=np.float32(1024.0) (or a 1-element tensor) was refused as "expected None, 'dynamic', a number or a
    loss-scale rule", and max_grad_norm=np.float32(1.0) as invalid; both are taken as their Python floats."""
    model, _ = _models()
    for number in (np.float32, lambda x: torch.tensor([x])):
        with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                           max_grad_norm=number(1.0), loss_scale=number(1024.0)) as opt:
            assert opt._engine.scaler == sofx.loss_scale.static_scale(1024.0)
            assert type(opt._engine.scaler.value) is float and type(opt._engine.speculation.max_norm) is float
    for bad in (True, torch.ones(2)):
        with pytest.raises(SofxError, match=r"loss_scale=.*; expected None, 'dynamic', a number or a loss-scale rule"):
            sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", loss_scale=bad)


@pytest.mark.parametrize("value, why", [(math.nan, "expected a finite number > 0"), (math.inf, "expected a finite"),
                                        (0.0, "expected a finite number > 0"), (-8.0, "expected a finite number > 0"),
                                        (1e39, "a float32 loss times it is inf"), (1e-39, "cannot be unscaled")])
def test_an_invalid_static_loss_scale_is_refused_naming_loss_scale(value: float, why: str):
    """SpeculativeAdamW(loss_scale=nan) was refused as "scale = nan is invalid", naming static_scale's argument, not
    the constructor's the value was given as; the refusal names loss_scale."""
    model, _ = _models()
    with pytest.raises(SofxError, match=rf"^loss_scale: scale = {re.escape(repr(value))} is invalid.*{why}"):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", loss_scale=value)


def test_scale_loss_takes_a_list_or_tuple_of_losses_as_gradscaler_and_refuses_what_is_no_loss():
    """opt.scale_loss takes GradScaler.scale's place, which scales a tensor or an iterable of tensors: a list of
    losses raised "TypeError: can't multiply sequence by non-int of type 'float'" with loss scaling on (and came back
    unscaled without), opt.backward(a list, a float, None) a bare TypeError or "AttributeError: 'list' object has no
    attribute 'backward'". A list or tuple of tensors is scaled element by element (its type kept); anything else
    is refused naming the argument and what it is, before the scale is taken."""
    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                       loss_scale=8.0) as opt:
        losses = [mlp_loss(model, mlp_batch(gen)), mlp_loss(model, mlp_batch(gen))]
        for kind in (list, tuple):
            scaled = opt.scale_loss(kind(losses))
            assert type(scaled) is kind and all(torch.equal(a, b * 8.0) for a, b in zip(scaled, losses))
        # a named tuple (a tuple) keeps its type too: remade from a generator it raised a bare TypeError
        # ("Losses.__new__() missing 1 required positional argument: 'aux'")
        Losses = collections.namedtuple("Losses", "main aux")
        scaled = opt.scale_loss(Losses(*losses))
        assert type(scaled) is Losses and torch.equal(scaled.aux, losses[1] * 8.0)
        for bad, what in ((losses, "a list"), (3.0, "a float"), (None, "a NoneType")):
            with pytest.raises(sofx.StructureError, match=rf"^opt.backward\(loss\): loss is {what}; expected a tensor"):
                opt.backward(bad)
        for bad, what in (([losses[0], 2.0], r"loss\[1\] is a float"), ("x", "loss is a str"), (None, "loss is a "
                                                                                                     "NoneType")):
            with pytest.raises(sofx.StructureError, match=rf"^opt.scale_loss\(loss\): {what}; expected a tensor"):
                opt.scale_loss(bad)
        assert all(p.grad is None for p in model.parameters()) and not opt.engine.tracker.started


def test_torchs_grad_scaler_as_loss_scale_is_refused_naming_what_equals_it():
    """torch.amp.GradScaler() as loss_scale (torch's habit: a scaler beside the optimizer) was refused as "expected
    None, 'dynamic', a number or a loss-scale rule" without saying that loss_scale="dynamic" is that scaler's rule,
    and a rule's factory given uncalled (grad_scaler) without saying to call it."""
    model, _ = _models()
    with pytest.raises(SofxError, match=r"loss_scale is a torch\.amp\.GradScaler; the optimizer scales the loss "
                                        r"itself: loss_scale='dynamic' is GradScaler's rule"):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", loss_scale=torch.amp.GradScaler("cpu"))
    with pytest.raises(SofxError, match=r"loss_scale is a torch\.amp\.GradScaler; the optimizer scales the loss "):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline",
                                      loss_scale=type("ShardedGradScaler", (torch.amp.GradScaler,), {})("cpu"))
    with pytest.raises(SofxError, match=r"loss_scale is the function grad_scaler; call it for a rule: "
                                        r"grad_scaler\(\.\.\.\)"):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", loss_scale=sofx.loss_scale.grad_scaler)


class _FloatStateRule:
    """A custom loss-scale rule whose state is a plain float (init, scale and update: a rule by the protocol)."""

    def init(self) -> float:
        return 1024.0

    def scale(self, state: float) -> float:
        return state

    def update(self, state: float, overflow: bool) -> float:
        return state / 2 if overflow else state


class _CountedScale(collections.namedtuple("_CountedScale", "scale clean")):
    """A custom rule's state that is a NamedTuple (the state dict saves its fields)."""


class _CountedRule:
    def init(self) -> _CountedScale:
        return _CountedScale(1024.0, 0)

    def scale(self, state: _CountedScale) -> float:
        return state.scale

    def update(self, state: _CountedScale, overflow: bool) -> _CountedScale:
        return _CountedScale(state.scale / 2, 0) if overflow else _CountedScale(state.scale, state.clean + 1)


class _CheckingRule(_CountedRule):
    """A custom rule whose scale() refuses a state it never makes (a ValueError of its own)."""

    def scale(self, state: _CountedScale) -> float:
        if state.scale < 1.0:
            raise ValueError(f"scale {state.scale} below 1")
        return state.scale


def test_a_loaded_scaler_state_a_custom_rule_refuses_is_refused_naming_it_and_nothing_is_loaded():
    """A state dict whose scaler state a custom rule's scale() refuses (its ValueError) was refused at
    load_state_dict() as a LossScaleRuleError saying "the step is not taken", no step there, and not naming the
    entry; it is a refusal of that entry (state_dict['state']['scaler_state'], the rule's exception its cause), as
    the state's other refusals, before anything is loaded."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline",
                                       loss_scale=_CheckingRule()) as opt:
        saved = opt.state_dict()
        saved["state"]["scaler_state"]["scale"] = 0.5
        saved["param_groups"][0]["lr"] = 0.5
        with pytest.raises(sofx.HParamError, match=r"^state_dict\['state'\]\['scaler_state'\]: the loss-scale "
                                                   r"rule \(_CheckingRule\) refuses it: ValueError: scale 0\.5 "
                                                   r"below 1$") as info:
            opt.load_state_dict(saved)
        assert isinstance(info.value.__cause__, ValueError) and "step" not in str(info.value)
        assert opt.param_groups[0]["lr"] == 1e-2 and opt.engine.scaler_state == _CountedScale(1024.0, 0)


class _RaisingInitRule(_CountedRule):
    def init(self):
        raise ValueError("no initial scale configured")


def test_a_custom_loss_scale_rule_whose_init_raises_is_named_at_construction():
    """A custom rule's init() that raised escaped the optimizer's constructor bare (its own ValueError), where the
    steps (call_rule) raise a LossScaleRuleError naming the rule and the method: so is it at construction (the
    facade's check of the rule's state, and the engine's own init()), the rule's exception its cause."""
    model, _ = _models()
    with pytest.raises(LossScaleRuleError, match=r"^loss_scale: the loss-scale rule's init\(\) \(_RaisingInitRule\) "
                                                 r"raised ValueError: no initial scale configured; the optimizer is "
                                                 r"not made$") as info:
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", loss_scale=_RaisingInitRule())
    assert isinstance(info.value.__cause__, ValueError)


def test_a_custom_loss_scale_rule_whose_state_has_no_fields_is_refused_at_construction():
    """A custom rule whose state is a float trained, and opt.state_dict() then raised "AttributeError: 'float'
    object has no attribute '_asdict'" (under ddp each step's replica check did): the state dict saves the
    loss-scaler state's fields. It is refused at construction, naming the state's type; a custom rule whose state
    is a NamedTuple trains and round-trips its state."""
    model, _ = _models()
    with pytest.raises(SofxError, match=r"loss_scale: the rule's init\(\) returned a float; the optimizer's "
                                        r"state_dict\(\) saves the loss-scaler state's fields: expected a NamedTuple"):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", loss_scale=_FloatStateRule())
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                       loss_scale=_CountedRule()) as opt:
        for _ in range(2):
            opt.backward(mlp_loss(model, mlp_batch(gen)))
            opt.step()
        saved = opt.state_dict()
        assert saved["state"]["scaler_state"] == {"type": "_CountedScale", "scale": 1024.0, "clean": 2}
        opt.load_state_dict(saved)
        assert opt.engine.scaler_state == _CountedScale(1024.0, 2)


class _BreakingRule:
    """torch's GradScaler rule (growth every 2 clean steps, so that a counted step shows) whose ``update`` raises
    a ValueError at its ``fail_at``-th call: a custom rule's bug."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.rule = sofx.loss_scale.grad_scaler(init_scale=1024.0, growth_interval=2)
        self.calls, self.fail_at = 0, fail_at

    def init(self):
        return self.rule.init()

    def scale(self, state) -> float:
        return self.rule.scale(state)

    def update(self, state, overflow: bool):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("the rule broke")
        return self.rule.update(state, overflow)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_loss_scale_rule_that_raises_at_validation_undoes_the_step_and_leaves_the_optimizer_usable(executor):
    """A custom rule whose update raised (a ValueError) in step()'s validation escaped as it was, with the step's
    speculative block steps standing in the masters and the engine still "in step" (state_dict() refused as between
    backward and step()). The step's speculative steps are undone, as for DeepSpeed's MinLossScaleError: a
    SofxError naming the rule's failure (the rule's exception as its cause), parameters, moments, counts and the
    loss-scaler state as before the step, and the optimizer goes on as if the failed step had never been taken
    (a run without it, bit for bit with undo="exact")."""
    model, ref_model = _models()
    batches = [mlp_batch(torch.Generator().manual_seed(k)) for k in range(5)]
    kw = dict(lr=1e-2, executor=executor, block_numel=100, undo="exact")
    with sofx.offload.SpeculativeAdamW(model.parameters(), loss_scale=_BreakingRule(fail_at=3), **kw) as opt, \
            sofx.offload.SpeculativeAdamW(ref_model.parameters(), loss_scale=_BreakingRule(), **kw) as ref:
        for k, batch in enumerate(batches):
            opt.zero_grad()
            if k == 2:
                saved = copy.deepcopy(opt.state_dict())
                before = [p.detach().clone() for p in model.parameters()]
                opt.backward(mlp_loss(model, batch))
                with pytest.raises(LossScaleRuleError, match=r"the loss-scale rule's update\(\) \(_BreakingRule\) "
                                                             r"raised ValueError: the rule broke; the step is not "
                                                             r"taken") as info:
                    opt.step()
                assert isinstance(info.value.__cause__, ValueError)
                assert not opt.engine.in_step
                assert_trees_bitwise(opt.state_dict(), saved)
                assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
                continue
            opt.backward(mlp_loss(model, batch))
            report = opt.step()
            ref.zero_grad()
            ref.backward(mlp_loss(ref_model, batch))
            expected = ref.step()
            assert report.speculated > 0 and report.scale == expected.scale
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())), k
        assert_trees_bitwise(opt.state_dict(), ref.state_dict())


class _FlakyScale(_BreakingRule):
    """A rule whose scale() raises the first time it is asked for the scale of a state after a clean step (its
    growth tracker at 1): the step reads it (a check of the state the next backward scales with, which the step's
    report gives). ``reads`` counts the reads of that state."""

    def __init__(self, fail: bool = True) -> None:
        super().__init__()
        self.reads, self.fail = 0, fail

    def scale(self, state) -> float:
        if state.growth_tracker == 1:
            self.reads += 1
            if self.fail:
                raise ValueError("scale() failed")
        return self.rule.scale(state)


def test_a_loss_scale_rule_whose_scale_fails_on_the_next_state_undoes_the_step():
    """The step's report read the rule's scale of the next state (report.next_scale) after the step's facts were
    taken: a scale() raising there escaped validation, the speculative block steps standing and the engine in its
    step. It is the failure of a rule at validation: the step is undone, a LossScaleRuleError raised."""
    model, _ = _models()
    before = [p.detach().clone() for p in model.parameters()]
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                       loss_scale=_FlakyScale()) as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        with pytest.raises(LossScaleRuleError, match=r"the loss-scale rule's scale\(\) \(_FlakyScale\) raised "
                                                     r"ValueError: scale\(\) failed"):
            opt.step()
        assert not opt.engine.in_step
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert all(int(opt.state[p]["step"]) == 0 for p in model.parameters())
        assert opt.state_dict()["state"]["scaler_state"]["growth_tracker"] == 0


def test_a_step_reads_the_next_loss_scale_once():
    """step() read the rule's scale of the next state twice (checked as the step's facts took it, then again for
    the report's next_scale): it is read once, and the report gives that value."""
    model, _ = _models()
    rule = _FlakyScale(fail=False)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                       loss_scale=rule) as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        report = opt.step()
        assert rule.reads == 1 and report.next_scale == 1024.0 and type(report.next_scale) is float


def test_a_step_a_failing_loss_scale_rule_dropped_spends_its_scaled_backward():
    """The scaled backward of a step the rule's failure undid is spent: a loss.backward() (unscaled) after it is
    warned about at the next step(), as after any step (it was taken as the scaled one, silently)."""
    model, _ = _models()
    batch = mlp_batch(torch.Generator().manual_seed(0))
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                       loss_scale=_BreakingRule(fail_at=1)) as opt:
        opt.backward(mlp_loss(model, batch))
        with pytest.raises(LossScaleRuleError):
            opt.step()
        opt.zero_grad()
        mlp_loss(model, batch).backward()
        with pytest.warns(RuntimeWarning, match="no backward since the last step"):
            opt.step()


def test_numpy_or_tensor_engine_options_are_numbers_and_bad_ones_are_refused_at_construction():
    """block_numel=np.int64(100), gradient_accumulation_steps, num_threads, timeout=np.float32(30.0) were refused
    as no int / no number (gradient_accumulation_steps with a bare ValueError); they are read as Python numbers and
    the optimizer steps as with them. timeout=True was taken as 1 s and timeout=inf raised an OverflowError at the
    first step's wait; shm_limit_bytes was not checked at all (-1, 1.5 or "x" reached the process executor's
    budget). Each is refused at construction, naming it."""
    options = dict(block_numel=100, n_device_blocks=0, gradient_accumulation_steps=1, num_threads=1, timeout=30.0,
                   shm_limit_bytes=1 << 30)
    for count, number in ((np.int64, np.float32), (lambda x: torch.tensor([x]), lambda x: torch.tensor([x]))):
        model, ref = _models()
        given = {k: number(v) if isinstance(v, float) else count(v) for k, v in options.items()}
        with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", **given) as opt, \
                sofx.offload.SpeculativeAdamW(ref.parameters(), lr=1e-2, executor="inline", **options) as want:
            engine = opt._engine
            assert engine.layouts == want._engine.layouts and type(engine.timeout) is float
            assert type(engine.tracker.accumulation_steps) is int
            mlp_step_side_by_side(opt, want, model, ref, torch.Generator().manual_seed(0))
            assert_trees_bitwise(list(model.parameters()), list(ref.parameters()))
    before = [p.detach().clone() for p in model.parameters()]
    for name, bad in (("timeout", True), ("timeout", float("inf")), ("timeout", 1e300), ("timeout", "5"),
                      ("timeout", np.float32("nan")), ("block_numel", 100.0), ("block_numel", np.int64(0)),
                      ("n_device_blocks", True), ("gradient_accumulation_steps", True),
                      ("gradient_accumulation_steps", 2.0), ("num_threads", np.int64(0)),
                      ("shm_limit_bytes", -1), ("shm_limit_bytes", 1.5), ("shm_limit_bytes", True),
                      ("shm_limit_bytes", "x")):
        with pytest.raises(sofx.errors.UnsupportedError, match=rf"{name} must be .*, got {re.escape(repr(bad))}"):
            sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", **{name: bad})
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_engine_flags_are_python_or_numpy_bools_and_others_are_refused_at_construction():
    """speculate="no", swap_params="no" and bias_correction="no" were taken as on: a numpy bool is a Python bool,
    anything else is refused at construction, naming the option, and the parameters are left as they were."""
    model, ref = _models()
    flags = dict(speculate=False, swap_params=False, bias_correction=False)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline",
                                       **{k: np.bool_(v) for k, v in flags.items()}) as opt, \
            sofx.offload.SpeculativeAdamW(ref.parameters(), lr=1e-2, executor="inline", **flags) as want:
        assert opt._engine.speculation.enabled is False and opt._engine.adam.variant.bias_correction is False
        assert opt._engine.adam_config.to_json()["bias_correction"] is False  # (sent to a worker as JSON)
        mlp_step_side_by_side(opt, want, model, ref, torch.Generator().manual_seed(0))
        assert_trees_bitwise(list(model.parameters()), list(ref.parameters()))
        opt.speculate = np.bool_(True)
        assert opt.speculate is True
        with pytest.raises(sofx.errors.UnsupportedError, match=r"speculate = 'no' is invalid; expected a bool"):
            opt.speculate = "no"  # (was taken as on)
        assert opt.speculate is True
    before = [p.detach().clone() for p in model.parameters()]
    for name in flags:
        for bad, kind in (("no", "str"), (0, "int")):
            with pytest.raises(sofx.errors.UnsupportedError, match=rf"{name} = .* is invalid; expected a bool .*got "
                                                                   rf"{kind}"):
                sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", **{name: bad})
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_state_dict_hooks_run_as_in_torch_optim():
    model, _ = _models()
    calls = []
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
        opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
        state = opt.state_dict()
        assert state["extra"] == 1
        opt.load_state_dict(state)
    assert calls == ["sd_pre", "load_post"]


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_step_hooks_run_as_in_torch_optim_and_a_pre_hooks_lr_is_stepped(executor):
    """``register_step_pre_hook`` / ``register_step_post_hook`` (torch.optim's, around ``step()``, a closure's
    backward inside them) run as on ``torch.optim.AdamW``; an lr a pre-hook sets (after backward, where blocks were
    speculated with the old one) is the step's, as torch steps with it."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    calls = {id(opt): [], id(ropt): []}

    def note(o, args, kwargs, when="pre"):
        calls[id(o)].append((when, len(args), o.param_groups[0]["lr"]))

    def halve_lr(o, args, kwargs):
        o.param_groups[0]["lr"] *= 0.5

    for o in (opt, ropt):
        o.register_step_pre_hook(note)
        o.register_step_pre_hook(halve_lr)
        o.register_step_post_hook(lambda o, args, kwargs: note(o, args, kwargs, "post"))
    with opt:
        for _ in range(3):
            report = mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert report.redone > 0  # (speculated with the lr before the hook)
        batch = mlp_batch(gen)
        for o, m in ((opt, model), (ropt, ref)):
            def closure(o=o, m=m):
                o.zero_grad()
                loss = mlp_loss(m, batch)
                loss.backward()
                return loss
            o.step(closure)
        assert relative_deviation(model, ref) <= TOL
    assert calls[id(opt)] == calls[id(ropt)] and len(calls[id(opt)]) == 8


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_an_optimizer_created_again_while_the_old_one_lives_supersedes_it(executor):
    """The first optimizer is still referenced (a scheduler, a notebook's output history): its hooks ran first
    and took every gradient, so the new one stepped nothing, silently. The new one takes the parameters over;
    the old one refuses to step, naming why."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    old = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    sched = torch.optim.lr_scheduler.StepLR(old, 1)  # holds the old optimizer
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with opt:
        for _ in range(3):
            report = mlp_step_side_by_side(opt, ropt, model, ref, gen)
            assert report.committed + report.redone + report.stepped_late > 0
        assert relative_deviation(model, ref) <= TOL
    with pytest.raises(SofxError, match=r"another optimizer was created over parameter 0 \(shape"):
        old.step()
    old.close()
    assert sched.optimizer is old


def test_closing_a_superseded_process_optimizer_leaves_the_new_ones_parameters_alone():
    """With the process executor the parameters live in the optimizer's shared publish buffers; one created again
    over them moves them into its own. Closing (or collecting) the old one moved them to private memory
    whatever they held: between the new one's backward and step(), that step then refused a parameter "changed in
    place" although nothing changed it. The old one now moves only the parameters still in its buffers, and the
    new one steps as torch does."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    old = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    mlp_step_side_by_side(old, ropt, model, ref, gen)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)  # (the new optimizer starts afresh)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100) as opt:
        ptrs = [p.data_ptr() for p in model.parameters()]
        batch = mlp_batch(gen)
        opt.backward(mlp_loss(model, batch))
        mlp_loss(ref, batch).backward()
        old.close()  # between the new one's backward and step()
        assert [p.data_ptr() for p in model.parameters()] == ptrs  # still in the new one's buffers
        opt.step()
        ropt.step()
        ropt.zero_grad()
        mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert relative_deviation(model, ref) <= TOL


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_resetting_the_optimizer_state_as_torch_users_do(executor):
    """Both reset habits act on the engine's state, side by side with torch: zeroing the moments and the step
    in place through ``opt.state[p]`` (the step was a detached copy: moments reset, step count not), and
    ``opt.state = defaultdict(dict)`` (was silently a no-op). Bad values change nothing."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with opt:
        for _ in range(3):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        for o in (opt, ropt):
            for s in o.state.values():
                s["exp_avg"].zero_()
                s["exp_avg_sq"].zero_()
                s["step"].zero_()
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert relative_deviation(model, ref) <= TOL
        opt.state = collections.defaultdict(dict)
        ropt.state = collections.defaultdict(dict)
        p = next(model.parameters())
        assert int(opt.state[p]["step"]) == 0 and not opt.state[p]["exp_avg"].any()
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert relative_deviation(model, ref) <= TOL
        opt.state[p]["step"] = torch.tensor(7.0)  # torch's own type for it
        assert int(opt.state[p]["step"]) == 7
        before = {k: v.clone() for k, v in opt.state[p].items()}
        for key, bad in (("step", 2.5), ("step", -1), ("exp_avg", torch.zeros(3)), ("nu", torch.zeros(1))):
            with pytest.raises(sofx.UnsupportedError):
                opt.state[p][key] = bad
        with pytest.raises(sofx.UnsupportedError, match=r"opt\.state = \{\.\.\.\} \(parameter 0\): 'exp_avg_sq' "
                                                        r"missing"):
            opt.state = {p: {"step": 3, "exp_avg": torch.zeros_like(p)}}
        assert all(torch.equal(v, before[k]) for k, v in opt.state[p].items())
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        with pytest.raises(SofxError, match="between backward and step"):
            opt.state[p]["step"] = 0
        with pytest.raises(SofxError, match="between backward and step"):  # speculated values, and zero_() on
            opt.state[p]["exp_avg"].zero_()                                 # them was mixed into the step
        opt.zero_grad()  # (undoes the speculative steps: algebraically, to a few ulps)
        assert int(opt.state[p]["step"]) == 7


def test_a_step_count_set_as_inf_nan_or_beyond_int64_is_refused_clearly():
    """opt.state[p]["step"] = inf raised an OverflowError, nan a bare ValueError and 2**63 a RuntimeError from
    fill_ (after waiting for the worker); each is refused as no whole number, the count unchanged. Whole numbers
    of any type (numpy, a 1-element tensor, torch's float step) are taken."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        p = next(model.parameters())
        for good in (np.float32(3.0), np.int64(4), torch.tensor([5.0]), 2 ** 63 - 1, 6):
            opt.state[p]["step"] = good
            assert int(opt.state[p]["step"]) == int(good)
        for bad in (float("inf"), float("nan"), np.float64("-inf"), 2 ** 63, 10 ** 400, True, np.bool_(True), "3",
                    torch.tensor([1.0, 2.0])):
            with pytest.raises(sofx.UnsupportedError, match=r"state\['step'\] of parameter 0 must be a whole number "
                                                            r">= 0 \(at most 9223372036854775807\), got "):
                opt.state[p]["step"] = bad
            assert int(opt.state[p]["step"]) == 6


def test_a_moment_or_master_set_per_parameter_is_checked_as_a_loaded_state_is():
    """opt.state[p][key] = value took a negative second moment (which load_state_dict refuses as corrupt: the next
    step's sqrt is nan) and failed on a meta or sparse tensor with torch's bare error from copy_. It now goes through
    load_state_dict's checks, naming the parameter and the key, nothing changed on a refusal; what torch users set
    (zeros, moments of another float dtype, torch's own state) and what load_state_dict takes (a nan or inf of a
    diverged run, an inf second moment) is taken."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        p = model.mid.weight  # parameter 2
        shape = tuple(p.shape)
        bad_sq = torch.rand(shape)
        bad_sq[3, 4] = -0.5
        refused = [("exp_avg", torch.zeros(shape, device="meta"),
                    "expected a tensor with data, got one on device meta"),
                   ("master", torch.zeros(shape, device="meta"), "expected a tensor with data, got one on device meta"),
                   ("exp_avg_sq", torch.rand(shape).to_sparse(),
                    r"expected a dense \(strided\) tensor, got layout torch.sparse_coo"),
                   ("master", _nested([torch.zeros(12)] * 12),
                    r"expected a dense \(strided\) tensor, got a nested tensor"),
                   ("exp_avg_sq", bad_sq, r"\[3, 4\] = -0\.5: expected a second moment >= 0"),
                   ("exp_avg_sq", torch.full(shape, -math.inf), r"\[0, 0\] = -inf: expected a second moment >= 0"),
                   ("exp_avg", torch.zeros(3), r"must be a float tensor of shape \(12, 12\)"),
                   ("exp_avg", torch.zeros(shape, dtype=torch.int64), r"must be a float tensor of shape \(12, 12\)")]
        before = [{k: v.clone() for k, v in opt.state[q].items()} for q in model.parameters()]
        for key, bad, match in refused:
            with pytest.raises(sofx.UnsupportedError, match=rf"parameter 2\b.*\[{key!r}\]|\[{key!r}\].* parameter 2\b"):
                opt.state[p][key] = bad
            with pytest.raises(sofx.UnsupportedError, match=match):
                opt.state[p][key] = bad
            for q, was in zip(model.parameters(), before):
                assert all(torch.equal(v, was[k]) for k, v in opt.state[q].items()), (key, bad)
        taken = [("exp_avg", torch.zeros_like(p)), ("exp_avg_sq", torch.zeros_like(p)),
                 ("exp_avg", torch.rand(shape, dtype=torch.float64)), ("exp_avg_sq", torch.rand(shape).bfloat16()),
                 ("exp_avg", torch.full(shape, math.nan)), ("exp_avg_sq", torch.full(shape, math.inf)),
                 ("master", torch.full(shape, -math.inf)), ("exp_avg_sq", torch.rand(shape, requires_grad=True))]
        for key, good in taken:
            opt.state[p][key] = good
            torch.testing.assert_close(opt.state[p][key], good.detach().float(), rtol=0, atol=0, equal_nan=True)


def test_a_moment_or_master_set_per_parameter_beyond_the_states_range_is_refused():
    """opt.state[p][key] = value casts a value of another float dtype into the state's (as torch users set moments of
    the parameter's dtype), and a finite value beyond the state's range was stored as inf (a float64 1e39 in the
    float32 masters, 1e5 in float16 moments): the next step's update was nan. It is refused, naming the parameter,
    the key and the element, nothing changed; an inf given as such is taken (as load_state_dict takes it)."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline",
                                       state_dtype=torch.float16) as opt:
        p = model.mid.weight  # parameter 2
        big = torch.zeros(tuple(p.shape), dtype=torch.float64)
        big[1, 2] = 1e39
        before = [{k: v.clone() for k, v in opt.state[q].items()} for q in model.parameters()]
        for key, value, dtype in (("master", big, "float32"), ("exp_avg", big.float() * 0 + 7e4, "float16"),
                                  ("exp_avg_sq", big.float().clamp(max=1e5), "float16")):
            with pytest.raises(sofx.UnsupportedError, match=rf"parameter 2's state\['{key}'\]\[\d, \d\] = \S+ is "
                                                            rf"beyond {dtype}'s range \(largest \S+\), the state's "
                                                            "dtype: it would be inf there"):
                opt.state[p][key] = value
            for q, was in zip(model.parameters(), before):
                assert all(torch.equal(v, was[k]) for k, v in opt.state[q].items()), key
        opt.state[p]["exp_avg"] = torch.full(tuple(p.shape), -math.inf)
        opt.state[p]["master"] = torch.full(tuple(p.shape), 3e38, dtype=torch.float64)
        assert opt.state[p]["exp_avg"].isneginf().all() and opt.state[p]["master"].isfinite().all()


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("swap_params", [True, False])
def test_parameters_changed_in_place_between_steps_are_the_new_masters(executor, swap_params):
    """Weight clipping after each step, and loading model weights mid-run, side by side with torch: the
    engine takes what the parameters hold (it overwrote the edits from its masters at the next step). A change
    between backward and step() -- after blocks began stepping -- is refused, naming the parameter."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=5e-2, executor=executor, block_numel=100,
                                        swap_params=swap_params)
    ropt = torch.optim.AdamW(ref.parameters(), lr=5e-2, foreach=False)
    with opt:
        for _ in range(4):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
            with torch.no_grad():
                for m in (model, ref):
                    for p in m.parameters():
                        p.clamp_(-0.05, 0.05)
        assert relative_deviation(model, ref) <= TOL
        loaded, _ = _models(seed=5)
        model.load_state_dict(loaded.state_dict())
        ref.load_state_dict(loaded.state_dict())
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert relative_deviation(model, ref) <= TOL
        with torch.no_grad():
            next(model.parameters()).mul_(0.5)
        saved = opt.state_dict()  # the masters of an edited model: what it holds
        assert torch.equal(opt.state[next(model.parameters())]["master"], next(model.parameters()).float())
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        with pytest.raises(SofxError, match=r"parameter 0 \(shape .*\) was changed in place between backward and"):
            opt.step()
        opt.zero_grad()
    assert saved["state"]["blocks"]


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_zero_grad_without_set_to_none_steps_unused_parameters_as_torch(executor):
    """After zero_grad(set_to_none=False) a parameter that once had a gradient keeps a zero one, so torch steps
    it (moment and weight decay) on steps where it is unused; set_to_none=True forgets that again."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)

    def step(use_head: bool, set_to_none: bool) -> None:
        for o in (opt, ropt):
            o.zero_grad(set_to_none=set_to_none)
        batch = mlp_batch(gen)
        for m, o in ((model, opt), (ref, ropt)):
            loss = mlp_loss(m, batch) if use_head else m.norm(torch.tanh(m.inp(batch[0]))[:, :12]).square().mean()
            o.backward(loss) if o is opt else loss.backward()
            o.step()

    with opt:
        for use_head, set_to_none in ((True, False), (False, False), (False, False), (True, True), (False, True),
                                      (True, False), (False, False)):
            step(use_head, set_to_none)
            assert relative_deviation(model, ref) <= TOL
        head = list(model.head.parameters())
        steps = [int(ropt.state[q]["step"]) if ropt.state[q] else 0 for q in ref.head.parameters()]
        assert [int(opt.state[p]["step"]) for p in head] == steps and steps[0] == 6


def test_undo_algebraic_refusals_come_before_any_block_is_stepped():
    """undo='algebraic' has no inverse for a beta of 0 or lr*wd == 1: refused at construction, and for a group
    changed so later, before backward steps any block (it raised in step() after other blocks were stepped)."""
    model, _ = _models()
    groups = [{"params": list(model.inp.parameters())}, {"params": list(model.head.parameters()) +
                                                         list(model.mid.parameters()) + list(model.norm.parameters())}]
    with pytest.raises(sofx.UnsupportedError,
                       match=r"param_groups\[0\]: undo='algebraic' is impossible: beta1 = 0.0: a beta of 0"):
        sofx.offload.SpeculativeAdamW([{**groups[0], "betas": (0.0, 0.999)}, groups[1]], undo="algebraic",
                                      executor="inline")
    with sofx.offload.SpeculativeAdamW(groups, lr=1e-2, undo="algebraic", executor="inline", block_numel=50) as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        counts = [int(opt.state[p]["step"]) for p in model.parameters()]
        opt.param_groups[1]["lr"], opt.param_groups[1]["weight_decay"] = 2.0, 0.5
        with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[1\]: .*lr \* weight_decay == 1"):
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(1))))
        opt.zero_grad()
        assert [int(opt.state[p]["step"]) for p in model.parameters()] == counts


def _engine_beside_serial_loop(executor: str, hparams: list, missing_grad: str = "skip") -> tuple:
    """``(engine, params, opt, loop)``: an :class:`~sofx.offload.engine.OffloadEngine` over two groups of two
    parameters, one block each, whose ``hparams_fn`` returns ``hparams`` (a list the test changes), and a
    :func:`sofx.serial.init_loop` of the same parameters to step beside it (``missing_grad``: the engine's
    :class:`~sofx.speculate.SpeculationConfig`'s)."""
    from sofx.offload.block_runner import AdamConfig
    from sofx.offload.engine import OffloadEngine
    from sofx.serial import init_loop

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5)) for _ in range(4)]
    rule = sofx.loss_scale.static_scale()
    engine = OffloadEngine([params[:2], params[2:]], lambda: list(hparams), adam=AdamConfig(decoupled=True),
                           speculation=sofx.speculate.SpeculationConfig(missing_grad=missing_grad), scaler=rule,
                           executor=executor, block_numel=5, swap_params=False)
    opt = sofx.adamw(lr=1e-2)
    return engine, params, opt, init_loop(opt, [p.detach().clone() for p in params], rule)


_BAD_ENGINE_HPARAMS = [sofx.AdamHParams(1e-2, 0.9, 0.999, 1e-8, 0.0)._replace(**kw) for kw in (
    {"lr": -1.0}, {"beta1": 1.0}, {"beta2": math.nan}, {"eps": 0.0}, {"weight_decay": -0.1},
    {"lr": 1e39}, {"eps": 1e-50}, {"weight_decay": 1e39})]  # (the last three: beyond what float32 holds)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_engines_hparams_adam_refuses_are_refused_by_step_and_the_engine_keeps_working(executor):
    """An OffloadEngine whose hparams_fn gives a group a value sofx.Adam's update refuses (a scheduler gone
    wrong): the blocks of the other group arriving first were speculated, then the bad block's speculative step
    raised in the executor and stopped the engine for good; a value only float32 cannot hold (the masters are
    float32) did so in validation's step of the block. Now nothing is speculated: step() refuses the hparams as
    update refuses them for a float32 leaf, naming the block, and once they are put back step() steps the same
    gradients as the serial loop does. Each bad value in turn, on one engine, a good step between them."""
    from sofx.serial import serial_loop_step

    good = sofx.AdamHParams(1e-2, 0.9, 0.999, 1e-8, 0.0)
    hparams = [good, good]
    engine, params, opt, loop = _engine_beside_serial_loop(executor, hparams)
    rule = engine.scaler
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(2 * len(_BAD_ENGINE_HPARAMS) + 1):
            bad = _BAD_ENGINE_HPARAMS[step // 2] if step % 2 else None
            grads = [torch.randn(5, generator=gen) for _ in params]
            hparams[1] = good if bad is None else bad  # (read as the step's first block is ready, in backward)
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
            if bad is not None:
                with pytest.raises(sofx.HParamError) as update_error:
                    opt.update(torch.zeros(5), torch.zeros(5), opt.init(torch.zeros(5)), bad)
                with pytest.raises(sofx.HParamError) as info:
                    engine.step()
                assert str(info.value) == str(update_error.value).replace("hparams for params:",
                                                                          "hparams for blocks[2]:"), bad
                hparams[1] = good
            report = engine.step()
            loop, _ = serial_loop_step(opt, loop, grads, scaler=rule, hparams=[good] * 4)
            assert not report.skipped
            assert all(torch.equal(p.detach(), q) for p, q in zip(params, loop.params)), (step, bad)
    finally:
        engine.close()


@pytest.mark.parametrize("missing_grad", ["skip", "zero"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_refused_hparams_of_a_frozen_group_leave_the_other_groups_speculated(executor, missing_grad):
    """A param group whose parameters are all frozen (requires_grad=False) gets no gradient and is not stepped
    (missing_grad="zero" steps with a zero gradient the parameters expected to get one, which require grad), so
    its hparams are not read (as serial_step's): an lr a scheduler set to -1 there is taken. begin_step yet
    vetoed every block for it, at every step of the run, only the report's reason saying so; with "zero",
    validation refused them as those of blocks it steps, so step() raised at every step. The engine tells
    begin_step which blocks may be stepped (a parameter requiring grad, or with a gradient) and validation those
    it steps: the other group's blocks are speculated, and the run is the serial loop's bit for bit."""
    from sofx.serial import serial_loop_step

    good = sofx.AdamHParams(1e-2, 0.9, 0.999, 1e-8, 0.0)
    hparams = [good, good._replace(lr=-1.0)]
    engine, params, opt, loop = _engine_beside_serial_loop(executor, hparams, missing_grad)
    for p in params[2:]:
        p.requires_grad_(False)
    rule = engine.scaler
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(3):
            grads = [torch.randn(5, generator=gen) for _ in params[:2]] + [None, None]
            sum((p * g).sum() for p, g in zip(params[:2], grads)).backward()
            report = engine.step()
            loop, _ = serial_loop_step(opt, loop, grads, scaler=rule, hparams=[good, good] + hparams[1:] * 2)
            assert report.speculating and report.speculated == 2, report.summary()
            assert all(torch.equal(p.detach(), q) for p, q in zip(params, loop.params)), step
    finally:
        engine.close()


def test_hparams_float32_cannot_hold_are_refused_before_any_block_is_stepped():
    """The masters are float32: an lr beyond its range, or an eps that is 0 there, was taken by the constructor
    and refused inside the executor at the first step, which stopped the engine for good (a scheduler setting
    such an lr mid-run did the same). Refused at construction, and for a group changed so later before backward
    steps any block; the engine keeps working once the value is put back."""
    model, _ = _models()
    for kw, name in (({"lr": 1e39}, "lr"), ({"eps": 1e-46}, "eps"),
                     ({"lr": 0.0, "weight_decay": 1e39}, "weight_decay")):
        with pytest.raises(sofx.HParamError, match=rf"{name} = .* is beyond float32's range"):
            sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", **kw)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread") as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        counts = [int(opt.state[p]["step"]) for p in model.parameters()]
        opt.param_groups[0]["lr"] = 1e39
        with pytest.raises(sofx.HParamError, match=r"param_groups\[0\]: lr = 1e\+39 is beyond float32's range"):
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(1))))
        opt.zero_grad()
        assert [int(opt.state[p]["step"]) for p in model.parameters()] == counts
        opt.param_groups[0]["lr"] = 1e-2
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(2))))
        opt.step()
        # (a parameter the loss does not reach has no gradient and stays at 0)
        assert [int(opt.state[p]["step"]) for p in model.parameters()] == [c + 1 if c else 0 for c in counts]


def test_a_parameter_list_of_a_group_changed_after_construction_is_refused_not_ignored():
    """torch.optim steps a parameter appended to ``param_groups[i]['params']`` (and stops stepping one removed);
    the speculative optimizer packs its blocks at construction, and ignored the change: the appended parameter
    was never stepped (its gradient left in ``.grad``), the removed one still was. Refused as
    ``add_param_group`` is, before any block is stepped; the optimizer works again once the list is put back
    (its order does not matter)."""
    model, _ = _models()
    extra = nn.Parameter(torch.randn(3))
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread") as opt:
        params = opt.param_groups[0]["params"]
        n = len(params)
        for change, message in ((lambda: params.append(extra),
                                 rf"param_groups\[0\]\['params'\]\[{n}\] \(shape \(3,\)\) is not one of the "
                                 "parameters this optimizer was made with"),
                                (lambda: params.pop(0), rf"param_groups\[0\]\['params'\] has {n - 1} parameters, "
                                                        rf"this optimizer was made with {n}")):
            kept = list(params)
            change()
            with pytest.raises(sofx.UnsupportedError, match=message):
                opt.backward(mlp_loss(model, mlp_batch(gen)) + extra.square().sum())
            opt.zero_grad()
            assert [int(opt.state[p]["step"]) for p in model.parameters()] == [0] * n
            params[:] = kept
        params.reverse()
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.step()
        assert [int(opt.state[p]["step"]) for p in model.parameters() if p.requires_grad] == [1] * (n - 1)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_parameter_written_over_another_in_a_groups_list_is_refused_not_stepped_as_before(executor):
    """``params[1] = params[0]`` (``[a, b] -> [a, a]``) keeps the list's length and holds only parameters the group
    was made with: torch.optim then steps ``a`` twice per step and ``b`` no more; the facade went on stepping both
    once, as if the list were unchanged. Refused at the next step, naming both places, before any block is
    stepped; the optimizer works again once the list is put back."""
    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor) as opt:
        params = opt.param_groups[0]["params"]
        kept = list(params)
        params[1] = params[0]
        with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[0\]\['params'\]\[1\] is "
                                                        r"param_groups\[0\]\['params'\]\[0\] again"):
            opt.backward(mlp_loss(model, mlp_batch(gen)))
            opt.step()
        opt.zero_grad()
        assert [int(opt.state[p]["step"]) for p in model.parameters()] == [0] * len(kept)
        params[:] = kept
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.step()
        assert [int(opt.state[p]["step"]) for p in model.parameters() if p.requires_grad] == [1] * sum(
            p.requires_grad for p in model.parameters())


def test_groups_reordered_or_a_parameter_moved_between_groups_is_refused_naming_its_group_at_construction():
    """torch.optim steps each parameter with the hparams of the group that holds it now: groups reordered
    (``param_groups.reverse()``) or a parameter moved to another group's list train on. The facade's blocks are
    packed per group at construction, and it refused both saying the parameter "is not one of the parameters this
    optimizer was made with", which it is: refused naming the group it was made in and what cannot change, before
    any block is stepped; the optimizer works again once the lists are put back."""
    model, _ = _models()
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2,
                                       executor="inline") as opt:
        groups = opt.param_groups
        first, second = groups[0]["params"], groups[1]["params"]

        def move():
            second.append(first.pop())

        for change, message in ((groups.reverse, r"param_groups\[0\]\['params'\]\[0\] \(shape \(12, 12\)\) is a "
                                                 r"parameter of param_groups\[1\] as this optimizer was made"),
                                (move, rf"param_groups\[1\]\['params'\]\[{len(params) - 2}\] \(shape \(12,\)\) is a "
                                       r"parameter of param_groups\[0\] as this optimizer was made")):
            kept = [list(g["params"]) for g in groups]
            kept_groups = list(groups)
            change()
            with pytest.raises(sofx.UnsupportedError, match=message + ".*cannot be reordered"):
                opt.backward(mlp_loss(model, mlp_batch(gen)))
            opt.zero_grad()
            assert [int(opt.state[p]["step"]) for p in params] == [0] * len(params)
            groups[:] = kept_groups
            for g, ps in zip(groups, kept):
                g["params"][:] = ps
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.step()
        assert [int(opt.state[p]["step"]) for p in params if p.requires_grad] == [1] * sum(
            p.requires_grad for p in params)


def _refused_with_nothing_stepped(opt: sofx.offload.SpeculativeAdamW, model: torch.nn.Module, gen: torch.Generator,
                            message: str) -> None:
    """With ``opt``'s param groups changed by hand: a backward and ``state_dict()`` are refused (an UnsupportedError
    matching ``message``), before any block is stepped (every step count 0 after ``zero_grad()``)."""
    params = list(model.parameters())
    with pytest.raises(sofx.UnsupportedError, match=message):
        opt.backward(mlp_loss(model, mlp_batch(gen)))
    with pytest.raises(sofx.UnsupportedError, match=message):
        opt.state_dict()
    opt.zero_grad()
    assert [int(opt.state[p]["step"]) for p in params] == [0] * len(params)


@pytest.mark.parametrize("given, found", [(lambda model: model.parameters(), "generator"),
                                           (lambda model: model.inp.weight, "Parameter"),
                                           (lambda model: None, "NoneType"),
                                           (lambda model: set(model.parameters()), "set")],
                         ids=["generator", "parameter", "none", "set"])
def test_a_groups_params_set_to_other_than_a_list_is_refused_naming_its_type(given, found):
    """``param_groups[0]['params'] = model.parameters()`` (a generator), a single parameter or ``None``: torch.optim's
    ``add_param_group`` makes a group's ``params`` a list (refusing a set, whose order changes between runs), and its
    step iterates whatever is there (a tensor's rows: nothing stepped). The facade raised a bare ``TypeError`` out of
    backward ("object of type 'generator' has no len()", having consumed the generator) or said a parameter's row
    was "not one of the parameters this optimizer was made with". Refused naming the type, before any block is
    stepped, in ``state_dict()`` too; the optimizer works again once a list is put back."""
    model, _ = _models()
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        opt.param_groups[0]["params"] = given(model)
        message = rf"param_groups\[0\]\['params'\] is a {found}, not a list of the group's parameters"
        _refused_with_nothing_stepped(opt, model, gen, message)
        opt.param_groups[0]["params"] = params
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.step()
        assert [int(opt.state[p]["step"]) for p in params if p.requires_grad] == [1] * sum(
            p.requires_grad for p in params)


@pytest.mark.parametrize("change, message", [
    (lambda opt: opt.param_groups.__setitem__(0, 5), r"param_groups\[0\] is of type int, not a param group \(a dict"),
    (lambda opt: setattr(opt, "param_groups", None), r"param_groups is None, not a list of param groups"),
    (lambda opt: setattr(opt, "param_groups", {"params": []}),
     r"param_groups is of type dict, not a list of param groups")],
    ids=["a group that is no dict", "none", "a dict"])
def test_param_groups_or_a_group_that_is_not_what_torch_optim_holds_is_refused_naming_its_type(change, message):
    """``opt.param_groups[0] = 5`` or ``opt.param_groups = None``: the facade raised Python's bare AttributeError
    ("'int' object has no attribute 'get'") or TypeError ("object of type 'NoneType' has no len()") out of
    backward, ``step()``, ``state_dict()`` and ``load_state_dict()``. Refused naming what is there, before any
    block is stepped; the optimizer works again once the groups are put back."""
    model, _ = _models()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        groups, group = opt.param_groups, opt.param_groups[0]
        change(opt)
        _refused_with_nothing_stepped(opt, model, gen, message)
        groups[:] = [group]
        opt.param_groups = groups
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        assert not opt.step().skipped


def test_a_group_appended_to_or_removed_from_param_groups_directly_is_refused_naming_param_groups():
    """``opt.param_groups.append(group)`` bypasses the refused ``add_param_group`` (and ``pop`` removes a group
    whose parameters are packed into blocks): refused clearly, naming ``param_groups`` and what to do, before any
    block is stepped (it raised a raw ``IndexError`` from a backward hook); putting the list back makes the
    optimizer work again."""
    model, _ = _models()
    params = list(model.parameters())
    extra = nn.Parameter(torch.randn(3))
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2,
                                       executor="thread") as opt:
        groups = opt.param_groups
        for change, message in ((lambda: groups.append({**groups[0], "params": [extra]}),
                                 r"param_groups has 3 groups, this optimizer was made with 2: .*add_param_group"),
                                (lambda: groups.pop(), r"param_groups has 1 groups, this optimizer was made with 2")):
            kept = list(groups)
            change()
            with pytest.raises(sofx.UnsupportedError, match=message):
                opt.backward(mlp_loss(model, mlp_batch(gen)) + extra.square().sum())
            opt.zero_grad()
            assert [int(opt.state[p]["step"]) for p in params] == [0] * len(params)
            groups[:] = kept
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.step()
        assert [int(opt.state[p]["step"]) for p in params if p.requires_grad] == [1] * sum(
            p.requires_grad for p in params)


def test_a_step_without_gradients_warns_that_nothing_is_stepped():
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        with pytest.warns(RuntimeWarning, match="step\\(\\) found no gradients") as record:
            report = opt.step()  # torch.optim would step again with the old .grad
        assert record[0].filename == __file__, "the warning names the caller's line"
        assert report.committed + report.redone + report.stepped_late == 0


def test_a_step_without_gradients_is_not_counted_by_the_loss_scaler():
    """GradScaler refuses a step without gradients; sofx warns and steps nothing, and its scaler does not count
    the step either: the scales stay torch's (growth every 2 steps, an empty step between the real ones)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ref = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(3, 4)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline",
                                       loss_scale=sofx.loss_scale.grad_scaler(init_scale=1024.0,
                                                                               growth_interval=2)) as opt:
        for step in range(4):
            opt.zero_grad()
            opt.backward(model(x).pow(2).mean())
            opt.step()
            topt.zero_grad()
            scaler.scale(ref(x).pow(2).mean()).backward()
            scaler.step(topt)
            scaler.update()
            if step % 2 == 0:
                with pytest.warns(RuntimeWarning, match="step\\(\\) found no gradients"):
                    report = opt.step()
                assert report.scale == report.next_scale == opt.loss_scale
            assert opt.loss_scale == scaler.get_scale(), step
            for a, b in zip(model.parameters(), ref.parameters()):
                assert torch.equal(a, b)


def test_step_zero_grad_and_state_calls_from_two_threads_at_once_are_refused():
    """Two step()s at once took one step and counted two (the thread executor), or failed with an
    AttributeError (the process one): a call while another thread is in one of them is refused, changing
    nothing, and the optimizer goes on."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="thread") as opt:
        saved = opt.state_dict()
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        before = [p.detach().clone() for p in model.parameters()]
        errors: list[BaseException] = []

        def other_thread() -> None:
            for call in (opt.step, opt.zero_grad, opt.state_dict, lambda: opt.load_state_dict(saved)):
                try:
                    call()
                except sofx.SofxError as e:
                    errors.append(e)

        with opt.engine._exclusive("step()"):  # as a step() running in this thread holds it
            t = threading.Thread(target=other_thread)
            t.start()
            t.join(60)
        assert len(errors) == 4
        for e, what in zip(errors, ("step()", "zero_grad()", "state_dict()", "load_state_dict()")):
            assert str(e).startswith(f"{what} was called while another thread is in step()")
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        report = opt.step()
        assert report.committed + report.stepped_late + report.redone > 0


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_parameter_frozen_with_a_zeroed_gradient_is_stepped_as_torch(executor):
    """torch steps a parameter whose .grad zero_grad(set_to_none=False) zeroed, also once it is frozen; its block
    made ready by the others during backward was speculated without it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)  # weight and bias in one block
    ref = copy.deepcopy(model)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(8, 4)
    with opt:
        for t in range(3):
            if t == 1:
                model.bias.requires_grad_(False)
                ref.bias.requires_grad_(False)
            opt.zero_grad(set_to_none=False)
            ropt.zero_grad(set_to_none=False)
            opt.backward(model(x).square().mean())
            ref(x).square().mean().backward()
            report = opt.step()
            ropt.step()
            assert torch.equal(model.bias, ref.bias) and int(opt.state[model.bias]["step"]) == t + 1
        assert report.committed == 1  # speculated, with the frozen bias


def _nested(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A nested tensor of ``tensors`` (without the warning that nested tensors are a prototype)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor(tensors)


def _corrupt(key_path: tuple, value: object) -> object:
    """A state-dict mutation: the entry at ``key_path`` (under ``state_dict['state']``) set to ``value`` (a
    function of the old value when callable)."""
    def mutate(sd: dict) -> None:
        *parents, last = key_path
        entry = sd["state"]
        for k in parents:
            entry = entry[k]
        entry[last] = value(entry[last]) if callable(value) else value
    return mutate


def _unknown_keys(entry: str) -> object:
    """A state-dict mutation: two unknown keys, ``1`` and ``'zz'``, added to ``state_dict['state'][entry]``."""
    def mutate(sd: dict) -> None:
        sd["state"][entry].update({1: True, "zz": True})
    return mutate


_BAD_STATES = {  # name: (mutation, the error's match)
    "iteration None": (_corrupt(("iteration",), None), r"\['state'\]\['iteration'\] = None; expected an integer"),
    "iteration -5": (_corrupt(("iteration",), -5), r"\['iteration'\] = -5; expected an integer >= 0"),
    "iteration 2.7": (_corrupt(("iteration",), 2.7), r"\['iteration'\] = 2.7; expected an integer >= 0"),
    "meta tensor in the last block": (_corrupt(("blocks", -1, "exp_avg_sq"), lambda t: t.to("meta")),
                                      r"state_dict\['state'\]\['blocks'\]\[\d+\]\['exp_avg_sq'\]: expected a "
                                      "tensor with data, got one on device meta"),
    "nested tensor": (_corrupt(("blocks", 0, "exp_avg"), lambda t: _nested([t])),
                      r"\['blocks'\]\[0\]\['exp_avg'\]: expected a dense \(strided\) tensor, got a nested tensor"),
    "negative count": (_corrupt(("blocks", 1, "counts"), lambda t: t - 5),
                       r"\['blocks'\]\[1\]\['counts'\]\[0\] = -\d: expected a step count >= 0"),
    "negative second moment": (_corrupt(("blocks", 1, "exp_avg_sq"), lambda t: -t - 1),
                               r"\['blocks'\]\[1\]\['exp_avg_sq'\]\[0\] = -1\.\d+: expected a second moment >= 0"),
    "scale nan": (_corrupt(("scaler_state", "scale"), float("nan")),
                  r"\['scaler_state'\]\['scale'\] = nan is invalid; expected a finite number >= 0"),
    "scale str": (_corrupt(("scaler_state", "scale"), "big"), r"\['scale'\] = 'big' is invalid"),
    "negative growth tracker": (_corrupt(("scaler_state", "growth_tracker"), -1),
                                r"\['growth_tracker'\] = -1 is invalid; expected an integer >= 0"),
    "growth tracker at the interval": (_corrupt(("scaler_state", "growth_tracker"), 2000),
                                       r"\['growth_tracker'\] = 2000 is invalid for growth_interval = 2000"),
    "unknown scaler field": (_corrupt(("scaler_state", "hysteresis"), 2), r"\['hysteresis'\]: a GradScalerState"),
    "scaler settings a list": (_corrupt(("scaler",), [2.0]),
                               r"\['scaler'\]: expected a dict \(the loss-scale rule's settings\) or None, got list"),
    "scaler of another kind": (_corrupt(("scaler", "type"), "DynamicLossScaleRule"),
                               r"\['scaler'\]: the saved loss-scale rule is a DynamicLossScaleRule, this "
                               "optimizer's is a GradScalerRule"),
    "scaler of a kind starting with a vowel": (_corrupt(("scaler", "type"), "EagerRule"),
                                               r"\['scaler'\]: the saved loss-scale rule is an EagerRule, this "
                                               "optimizer's is a GradScalerRule"),
    "scaler of no kind": (_corrupt(("scaler", "type"), None),
                          r"\['scaler'\]: the saved loss-scale rule names no kind \('type' = None\), this "
                          "optimizer's is a GradScalerRule"),
    "scaler state of a kind starting with a vowel": (_corrupt(("scaler_state", "type"), "EagerState"),
                                                     r"\['scaler_state'\]: the saved loss-scaler state is an "
                                                     "EagerState, this optimizer's is a GradScalerState"),
    "unknown scaler setting": (_corrupt(("scaler", "hysteresis"), 2),
                               r"\['scaler'\]\['hysteresis'\]: a GradScalerRule has no such setting"),
    "growth factor 0.5": (_corrupt(("scaler", "growth_factor"), 0.5),
                          r"\['scaler'\]: growth_factor = 0.5 is invalid; expected > 1"),
    "growth tracker at the saved interval": (_corrupt(("scaler", "growth_interval"), 3),
                                             r"\['growth_tracker'\] = 3 is invalid for growth_interval = 3"),
    "policy recent 5": (_corrupt(("policy_state", "recent"), 5),
                        r"\['recent'\] = 5 is invalid; expected a list or tuple of bools"),
    "policy quiet str": (_corrupt(("policy_state", "quiet"), "x"),
                         r"\['quiet'\] = 'x' is invalid; expected an integer"),
    # unknown keys of two kinds (an int and a str, which sorted() cannot order): Python's bare TypeError before
    "policy keys of two kinds": (_unknown_keys("policy_state"), r"\['policy_state'\]\[1\]: a PolicyState has no such"),
    "scaler state keys of two kinds": (_unknown_keys("scaler_state"),
                                       r"\['scaler_state'\]\[1\]: a GradScalerState has no such field"),
    "scaler setting keys of two kinds": (_unknown_keys("scaler"), r"\['scaler'\]\[1\]: a GradScalerRule has no such"),
    "layouts str": (_corrupt(("layouts",), "x"), r"\['layouts'\]: expected a list of block layouts, got str"),
    "layout None": (_corrupt(("layouts", 0), None), r"\['layouts'\]\[0\]: not a block layout"),
    "block None": (_corrupt(("blocks", 0), None), r"\['blocks'\]\[0\]: expected a dict of tensors"),
    "counts float": (_corrupt(("blocks", 0, "counts"), lambda t: t.float()),
                     r"\['counts'\]: expected shape \(\d+,\) dtype torch.int64, got \(\d+,\) torch.float32"),
    "group a list": (lambda sd: sd["param_groups"].__setitem__(0, [1, 2]),
                     r"saved param_groups\[0\]: expected a dict \(a param group\), got list"),
}


@pytest.mark.parametrize("bad", _BAD_STATES)
def test_a_bad_state_dict_is_refused_whole_before_anything_is_loaded(bad):
    """load_state_dict checks the whole state dict first: it wrote every block (and the loss-scaler state) before
    int(iteration) or the copy from a meta tensor in the last block failed, and took negative counts or second
    moments, a nan or str loss scale, a policy state of wrong types; raw AttributeErrors for non-dict entries."""
    mutate, match = _BAD_STATES[bad]
    model, _ = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                        loss_scale="dynamic", max_grad_norm=1.0)
    with opt:
        for k in range(2):
            opt.zero_grad()
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(k))))
            opt.step()
        assert len(opt.engine.layouts) >= 3
        state = copy.deepcopy(opt.state_dict())
        for block in state["state"]["blocks"]:  # a load would show
            block["master"] += 1
        state["state"]["iteration"] += 1
        state["state"]["scaler_state"]["growth_tracker"] += 1
        mutate(state)
        before = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()])
        with pytest.raises(SofxError, match=match):
            opt.load_state_dict(state)
        after = (opt.state_dict(), list(model.parameters()))
        assert_trees_bitwise(before, after)


def test_a_diverged_state_loads_as_torch_loads_it():
    """nan and inf masters and moments are a diverged run's state, not a corrupt one: they load (as torch.optim
    loads them), and the model gets the nan masters."""
    model, _ = _models()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        state = copy.deepcopy(opt.state_dict())
        block = state["state"]["blocks"][0]
        block["master"][0], block["exp_avg"][1] = float("nan"), float("-inf")
        block["exp_avg_sq"][2], block["exp_avg_sq"][3] = float("nan"), float("inf")
        opt.load_state_dict(state)
        for loaded, saved in zip(opt.state_dict()["state"]["blocks"], state["state"]["blocks"]):
            for name, x in loaded.items():
                assert torch.equal(x.isnan(), saved[name].isnan())
                assert torch.equal(x.nan_to_num(), saved[name].nan_to_num())
        assert torch.isnan(next(iter(model.parameters())).reshape(-1)[0])


def _constructor_traces(params: list[torch.Tensor]) -> tuple[int, int, list[int]]:
    """What a constructor leaves behind: threads, atexit callbacks, gradient hooks per parameter."""
    import atexit

    hooks = [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params]
    return threading.active_count(), atexit._ncallbacks(), hooks


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_refused_constructor_leaves_no_trace_and_the_running_optimizer_working(executor):
    """SpeculativeAdamW(..., undo='algebraic', lr * weight_decay == 1) was refused after its engine had hooked the
    parameters, superseding the running optimizer over them, which then refused to step for good. Every refusal
    now comes before: no hooks, threads or atexit callbacks are left, and the first optimizer steps on."""
    model, _ = _models()
    params = list(model.parameters())
    opt = sofx.offload.SpeculativeAdamW(params, lr=1e-2, executor=executor, block_numel=100)
    with opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        traces = _constructor_traces(params)
        refused = [(dict(undo="algebraic", lr=0.5, weight_decay=2.0), r"lr \* weight_decay == 1"),
                   (dict(backend="gpu"), "unknown backend 'gpu'"),
                   (dict(loss_scale="static"), "loss_scale='static'")]
        for k, (kwargs, match) in enumerate(refused):
            with pytest.raises(SofxError, match=match):
                sofx.offload.SpeculativeAdamW(params, executor=executor, block_numel=100, **kwargs)
            assert _constructor_traces(params) == traces
            opt.zero_grad()
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(k + 1))))
            report = opt.step()
            assert report.committed + report.redone + report.stepped_late > 0


def test_a_backend_that_cannot_step_the_blocks_is_refused_at_construction():
    """backend='gpu' was taken, and so was backend='triton' for CPU blocks: the engine failed at the first step,
    for good. Refused now, naming the first parameter of a block the backend cannot step."""
    model, _ = _models()
    groups = [{"params": list(model.inp.parameters())}, {"params": list(model.head.parameters())}]
    with pytest.raises(sofx.UnsupportedError, match=r"unknown backend 'gpu'; expected one of"):
        sofx.offload.SpeculativeAdamW(groups, backend="gpu", executor="inline")
    triton = sys.modules.get("sofx.kernels.triton") or sofx.kernels.load_backend("triton")
    if triton is not None and triton.supports("cpu", torch.float32, torch.float32):
        pytest.skip("Triton runs on CPU tensors here (TRITON_INTERPRET=1)")
    with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[0\]\['params'\]\[0\] \(block 0, stepped on cpu "
                                                    r"as fp32 masters\): backend 'triton' "):
        sofx.offload.SpeculativeAdamW(groups, backend="triton", executor="inline")
    with sofx.offload.SpeculativeAdamW(groups, backend="cpu_fast", executor="inline") as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        assert opt.step().blocks > 0


_BAD_DEEPSPEED_SCALER_STATES = {  # field: (value, the error's match), under deepspeed_scaler(hysteresis=2, min_scale=2)
    "last_overflow_iter": (lambda s: s["cur_iter"], r"\['last_overflow_iter'\] = \d+ is invalid with cur_iter = \d+"),
    "cur_hysteresis": (lambda s: 3, r"\['cur_hysteresis'\] = 3 is invalid for delayed_shift \(hysteresis\) = 2"),
    "scale": (lambda s: 1.0, r"\['scale'\] = 1.0 is below min_scale = 2.0"),
    "scale 0": (lambda s: 0.0, r"\['scale'\] = 0.0 is invalid; expected a finite number > 0"),
}


@pytest.mark.parametrize("bad", _BAD_DEEPSPEED_SCALER_STATES)
def test_a_deepspeed_scaler_state_no_run_reaches_is_refused_by_load_state_dict(bad):
    """A DeepSpeed loss-scaler state whose last overflow is at or after its iteration, whose hysteresis is above
    delayed_shift or whose scale is below min_scale (or 0) loaded silently (only the counts' least values were
    checked); it is refused naming the field, and nothing changes."""
    value, match = _BAD_DEEPSPEED_SCALER_STATES[bad]
    model, _ = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                        profile="deepspeed", max_grad_norm=1.0,
                                        loss_scale=sofx.loss_scale.deepspeed_scaler(init_scale=1024.0, hysteresis=2,
                                                                                    min_scale=2.0))
    with opt:
        for k in range(2):
            opt.zero_grad()
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(k))))
            opt.step()
        state = copy.deepcopy(opt.state_dict())
        scaler_state = state["state"]["scaler_state"]
        scaler_state[bad.split()[0]] = value(scaler_state)
        before = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()])
        with pytest.raises(SofxError, match=r"state_dict\['state'\]\['scaler_state'\].*" + match):
            opt.load_state_dict(state)
        assert_trees_bitwise(before, (opt.state_dict(), list(model.parameters())))


@pytest.mark.parametrize("profile, field", [("torch", "growth_tracker"), ("deepspeed", "cur_iter"),
                                            ("deepspeed", "last_overflow_iter"), ("deepspeed", "cur_hysteresis")])
def test_a_scaler_state_missing_a_field_is_refused_by_load_state_dict_naming_it(profile, field):
    """A saved loss-scaler state without one of its fields (every sofx state dict holds them all, as torch's
    GradScaler state dict holds its ``_growth_tracker``, whose ``load_state_dict`` raises without it) loaded with the
    field's default: a growth tracker of 2 became 0, a DeepSpeed scaler's iteration count 0, without a word. It is
    refused naming the field, and nothing changes."""
    model, _ = _models()
    rule = (sofx.loss_scale.grad_scaler(init_scale=1024.0, growth_interval=5) if profile == "torch" else
            sofx.loss_scale.deepspeed_scaler(init_scale=1024.0, hysteresis=2, min_scale=2.0))
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                        profile=profile, max_grad_norm=1.0, loss_scale=rule)
    with opt:
        for k in range(3):
            opt.zero_grad()
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(k))))
            opt.step()
        state = copy.deepcopy(opt.state_dict())
        del state["state"]["scaler_state"][field]
        before = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()])
        with pytest.raises(SofxError, match=rf"state_dict\['state'\]\['scaler_state'\]\[{field!r}\]: the field is "
                                            r"missing"):
            opt.load_state_dict(state)
        assert_trees_bitwise(before, (opt.state_dict(), list(model.parameters())))


@pytest.mark.parametrize("how", ["loss.backward()", "closure with loss.backward()"])
def test_a_backward_the_optimizer_did_not_scale_under_loss_scaling_warns_at_step(how):
    """With ``loss_scale="dynamic"`` a torch user's ``loss.backward()`` (in place of ``opt.backward(loss)``) gives
    gradients of the unscaled loss, which ``step()`` divides by the scale (65536): the run went on silently with
    every gradient 65536 times too small (clipping and eps against the wrong norm). ``step()`` now warns, naming
    what to call instead; the step itself is the one taken before."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", loss_scale="dynamic") as opt:
        pattern = (r"loss scaling is on \(scale 65536\.0\) but no backward since the last step\(\) was scaled by "
                   r"this optimizer.*opt\.backward\(loss\).*opt\.scale_loss\(loss\)\.backward\(\)")
        opt.zero_grad()
        with pytest.warns(RuntimeWarning, match=pattern) as record:
            if how == "loss.backward()":
                model(x).square().mean().backward()
                opt.step()
            else:
                opt.step(lambda: model(x).square().mean().backward())
        assert record[0].filename == __file__, "the warning names the caller's line"


def test_a_backward_the_optimizer_did_not_scale_after_a_dropped_step_warns_at_step():
    """A scaled backward whose step ``zero_grad()`` dropped (a GAN's generator backward reaching the discriminator)
    no longer counts as this step's: a ``loss.backward()`` after it gives gradients of the unscaled loss, and
    ``step()`` warns, where the dropped backward's note kept it silent; a scaled backward after the drop does not
    warn, nor does a ``zero_grad()`` that drops nothing undo a scale read before it."""
    import warnings
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", loss_scale="dynamic") as opt:
        opt.zero_grad()
        opt.backward(model(x).square().mean())
        opt.zero_grad()  # drops that step
        model(x).square().mean().backward()
        with pytest.warns(RuntimeWarning, match="no backward since the last step\\(\\) was scaled"):
            opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.zero_grad()
            opt.backward(model(x).square().mean())
            opt.zero_grad()
            opt.backward(model(x).square().mean())
            opt.step()
            scaled = opt.scale_loss(model(x).square().mean())
            opt.zero_grad()  # (no gradients held: nothing dropped)
            scaled.backward()
            opt.step()


@pytest.mark.parametrize("how", ["opt.backward", "scale_loss", "by opt.loss_scale", "no loss scaling"])
def test_a_backward_scaled_by_the_optimizer_or_without_loss_scaling_does_not_warn(how):
    """What the warning above suggests, scaling by ``opt.loss_scale`` by hand, and a plain ``loss.backward()``
    without loss scaling step without a warning (and ``opt.backward`` after a warned step too)."""
    import warnings
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    scaled = how != "no loss scaling"
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline",
                                       loss_scale="dynamic" if scaled else None) as opt:
        backward = {"opt.backward": lambda loss: opt.backward(loss),
                    "scale_loss": lambda loss: opt.scale_loss(loss).backward(),
                    "by opt.loss_scale": lambda loss: (loss * opt.loss_scale).backward(),
                    "no loss scaling": lambda loss: loss.backward()}[how]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                opt.zero_grad()
                backward(model(x).square().mean())
                opt.step()
        if scaled:
            opt.zero_grad()
            model(x).square().mean().backward()
            with pytest.warns(RuntimeWarning, match="loss scaling is on"):
                opt.step()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                opt.zero_grad()
                backward(model(x).square().mean())
                opt.step()


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_step_before_the_last_micro_step_warns_at_the_caller_and_steps_the_partial_sum(executor):
    """With gradient_accumulation_steps=4, step() after 3 backward calls stepped on the sum of the 3 micro-steps
    without a word (DeepSpeed's engine.step() does nothing before the boundary; a forgotten micro-step, or
    gradient_accumulation_steps=4 with DDP's no_sync(), went unnoticed). It warns at the caller's line, naming the
    counts; the step is still taken, on the partial sum (the last accumulation of an epoch), as torch.optim.AdamW
    steps on what the 3 backwards accumulated in .grad. A full accumulation does not warn."""
    model, ref = _models()
    gen = torch.Generator().manual_seed(0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100,
                                       gradient_accumulation_steps=4) as opt:
        for micro_steps in (4, 3, 4):
            for _ in range(micro_steps):
                batch = mlp_batch(gen)
                opt.backward(mlp_loss(model, batch) / 4)
                (mlp_loss(ref, batch) / 4).backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            ropt.step()
            ropt.zero_grad()
            partial = [w for w in caught if "gradient_accumulation_steps" in str(w.message)]
            if micro_steps == 4:
                assert not partial, [str(w.message) for w in partial]
            else:
                assert len(partial) == 1 and partial[0].category is RuntimeWarning
                assert re.match(r"sofx\.offload: step\(\) after 3 backward calls \(micro-steps\) of "
                                r"gradient_accumulation_steps=4: the step is taken on the sum of those 3",
                                str(partial[0].message)), str(partial[0].message)
                assert partial[0].filename == __file__
            assert relative_deviation(model, ref) <= TOL


class _Branches(nn.Module):
    """Two heads and nothing shared: micro-batch ``i`` goes through head ``i % 2`` (as mixture-of-experts routing or
    multi-task heads do), so no parameter gets a gradient from every backward call of an accumulation."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])

    def forward(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return self.heads[i % 2](x)


def _partial_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "gradient_accumulation_steps" in str(w.message)]


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_branches_used_alternately_count_every_backward_call_of_an_accumulation(executor):
    """gradient_accumulation_steps=2 and two backward calls, each through another head: step() warned "after 1
    backward call" (it counted the most gradient arrivals of any one parameter, 1 here) although both were made.
    It counts the backward calls that reached the optimizer: no warning; one backward call still warns, and so
    does one after a zero_grad() that dropped the other. The steps are torch.optim.AdamW's on the summed .grad."""
    torch.manual_seed(0)
    model = _Branches()
    ref = copy.deepcopy(model)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor,
                                       gradient_accumulation_steps=2) as opt:
        for calls, dropped in ((2, 0), (1, 0), (2, 0), (1, 1)):
            for i in range(dropped + calls):
                x = torch.randn(3, 4, generator=gen)
                opt.backward(model(x, i).square().mean() / 2)
                if i < dropped:
                    opt.zero_grad()
                else:
                    (ref(x, i).square().mean() / 2).backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            ropt.step()
            ropt.zero_grad()
            partial = _partial_warnings(caught)
            if calls == 2:
                assert not partial, partial
            else:
                assert len(partial) == 1, partial
                assert partial[0].startswith("sofx.offload: step() after 1 backward call (micro-steps) of "
                                             "gradient_accumulation_steps=2"), partial
            assert relative_deviation(model, ref) <= TOL


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_more_backward_calls_than_the_accumulation_warn_at_the_caller_and_step_the_sum(executor):
    """gradient_accumulation_steps=2 and 3 backward calls before step(): the third call's gradients came after
    their blocks were stepped (late: summed, undone, redone), silently, and the step took 3/2 of a full
    accumulation (each loss divided by 2). step() warns once at the caller's line, naming the counts, and steps
    the sum, as torch.optim.AdamW steps on what .grad accumulated; micro-batches through alternating heads count
    each call. Two calls do not warn, nor do several with gradient_accumulation_steps=1 (the default: torch's
    accumulation in .grad, nothing declared)."""
    gen = torch.Generator().manual_seed(0)
    for steps, plan in ((2, (3, 2, 4)), (1, (2, 3))):
        torch.manual_seed(0)
        model = _Branches()
        ref = copy.deepcopy(model)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor,
                                           gradient_accumulation_steps=steps) as opt:
            for calls in plan:
                for i in range(calls):
                    x = torch.randn(3, 4, generator=gen)
                    opt.backward(model(x, i).square().mean() / steps)
                    (ref(x, i).square().mean() / steps).backward()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    opt.step()
                ropt.step()
                ropt.zero_grad()
                extra = [w for w in caught if "gradient_accumulation_steps" in str(w.message)]
                if steps == 1 or calls == steps:
                    assert not extra, [str(w.message) for w in extra]
                else:
                    assert len(extra) == 1 and extra[0].category is RuntimeWarning, [str(w.message) for w in extra]
                    assert str(extra[0].message).startswith(
                        f"sofx.offload: step() after {calls} backward calls (micro-steps) of "
                        f"gradient_accumulation_steps={steps}: "), str(extra[0].message)
                    assert extra[0].filename == __file__
                assert relative_deviation(model, ref) <= TOL


class _Checkpointed(nn.Module):
    """``inner`` applied inside a reentrant activation checkpoint (its backward runs a backward of its own) and,
    with ``shared``, ``inner`` again outside it (autograd accumulates its gradient twice in one backward call);
    micro-batch ``i`` goes through head ``i % 2``."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])
        self.shared = shared

    def forward(self, x: torch.Tensor, i: int) -> torch.Tensor:
        head = self.heads[i % 2]
        h = torch.utils.checkpoint.checkpoint(lambda t: head(torch.tanh(self.inner(t))), x, use_reentrant=True)
        return h + self.inner(x)[:, :2] if self.shared else h


@pytest.mark.parametrize("shared", [False, True])
def test_reentrant_checkpointing_counts_one_backward_call(shared):
    """Reentrant activation checkpointing runs a backward inside the backward call: it is one backward call of the
    accumulation (one warns with gradient_accumulation_steps=2, two do not), also where a parameter used inside
    and outside the checkpoint has its gradient accumulated twice in it (then one call did not warn: its two
    arrivals were counted as two backward calls). ``backward(retain_graph=True)`` and a second backward of the same
    graph are two calls; ``torch.autograd.grad`` (it accumulates nothing) is none."""
    torch.manual_seed(0)
    model = _Checkpointed(shared)
    x = torch.randn(3, 4, requires_grad=True)  # (a reentrant checkpoint's output requires grad through its inputs)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline",
                                       gradient_accumulation_steps=2) as opt:

        def one(i):
            opt.backward(model(x, i).square().mean())

        def graph_twice(i):
            loss = model(x, i).square().mean()
            opt.backward(loss, retain_graph=True)
            opt.backward(loss)

        def grad_then_one(i):
            torch.autograd.grad(model(x, i).square().mean(), list(model.parameters()), allow_unused=True)
            one(i)

        for name, run, calls in (("two calls", lambda: (one(0), one(1)), 2), ("one call", lambda: one(0), 1),
                                 ("one graph twice", graph_twice, 2), ("autograd.grad", grad_then_one, 1)):
            run(1) if name in ("one graph twice", "autograd.grad") else run()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            partial = _partial_warnings(caught)
            if calls == 2:
                assert not partial, (name, partial)
            else:
                assert len(partial) == 1 and "step() after 1 backward call (micro-steps)" in partial[0], (name, partial)


def test_pickling_the_optimizer_is_refused_saying_what_to_use():
    """pickle/copy.deepcopy of the optimizer: refused (it holds hooks on the model, an executor and locks; the
    message said "it owns a worker" for the inline executor too), pointing to state_dict()."""
    import pickle

    model = torch.nn.Linear(3, 2)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        for copy_it in (pickle.dumps, copy.deepcopy):
            with pytest.raises(TypeError, match=r"cannot be pickled \(it holds gradient hooks on the model, an "
                                                r"executor and locks\); use state_dict\(\)"):
                copy_it(opt)
