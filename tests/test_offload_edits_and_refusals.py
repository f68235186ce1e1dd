"""``SpeculativeAdamW`` beside ``torch.optim.AdamW`` where a backward is refused half-way (an hparam refused
in the gradient hook: the gradients taken are counted once, as torch's partial backward leaves them) and where
a bf16 model is edited in place between steps (the fp32 masters of the elements the edit left are kept)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import script_prints_ok
from test_offload_support import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    linear_beside_torch,
    one_torch_thread,
    relative_deviation,
)

import sofx.offload
from sofx.errors import HParamError, LeafError

TOL = 1e-6
EXECUTORS = ["inline", "thread", "process"]


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


class _Stop(Exception):
    pass


def _raise(_: torch.Tensor) -> None:
    raise _Stop()


@pytest.mark.parametrize("rerun", [False, True])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_backward_refused_in_the_gradient_hook_keeps_the_gradients_it_took_once(executor: str,
                                                                                 rerun: bool) -> None:
    """An invalid hparam refused in the gradient hook (the step's first ready block reads the groups) raises
    out of backward, as a tensor hook that raises would in torch: the gradients accumulated before that are
    the step's, once. Fixing the hparam and calling step() (or running backward again, which accumulates, and
    then step()) must equal torch.optim after the same partial backward. The refused hook took the gradient
    into its buffer but left it in ``param.grad`` too: step() refused it as "set after backward", and a
    second backward summed it twice."""
    torch.manual_seed(0)
    model = _MLP()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=20) as opt:
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        for step in range(4):
            opt.zero_grad()
            ropt.zero_grad()
            batch = _batch(gen)
            if step == 2:
                opt.param_groups[0]["lr"] = float("nan")  # e.g. a LambdaLR gone wrong
                with pytest.raises(HParamError, match=r"param_groups\[0\]\['lr'\] = nan"):
                    opt.backward(_loss(model, batch))
                opt.param_groups[0]["lr"] = 1e-2
                # torch: the same backward stopped after the first parameter's gradient was accumulated
                handle = ref.c.bias.register_post_accumulate_grad_hook(_raise)
                with pytest.raises(_Stop):
                    _loss(ref, batch).backward()
                handle.remove()
                if not rerun:
                    opt.step()
                    ropt.step()
                    assert relative_deviation(model, ref) <= TOL
                    continue
            opt.backward(_loss(model, batch))
            _loss(ref, batch).backward()
            opt.step()
            ropt.step()
            assert relative_deviation(model, ref) <= TOL, step


@pytest.mark.parametrize("key", ["lr", "betas", "eps", "weight_decay"])
def test_a_group_missing_an_hparam_is_refused_naming_the_group_and_the_key(key: str) -> None:
    """A param group whose ``lr``, ``betas``, ``eps`` or ``weight_decay`` was removed (``del g['eps']``, a group
    dict rebuilt by hand) is refused out of backward (its gradient hook reads the groups) as an HParamError
    naming the group and the key, where a bare ``KeyError: 'eps'`` named neither; put back, the run goes on as
    torch.optim's, which never saw the refused backward."""
    torch.manual_seed(0)
    model = _MLP()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=20) as opt:
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        for step in range(3):
            opt.zero_grad()
            ropt.zero_grad()
            batch = _batch(gen)
            if step == 1:
                saved = opt.param_groups[0].pop(key)
                with pytest.raises(HParamError, match=rf"param_groups\[0\] has no '{key}'"):
                    opt.backward(_loss(model, batch))
                opt.param_groups[0][key] = saved
                opt.zero_grad()
            opt.backward(_loss(model, batch))
            _loss(ref, batch).backward()
            opt.step()
            ropt.step()
            assert relative_deviation(model, ref) <= TOL, step


def _bf16_run(executor: str, edit: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _MLP().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    # lr small enough that most updates are below bf16's resolution: only the fp32 masters carry them
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-4, executor=executor, block_numel=20) as opt:
        for step in range(12):
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
            opt.zero_grad()
            opt.backward(((model(x.bfloat16()) - y.bfloat16()).float() ** 2).mean())
            opt.step()
            if edit == "clip":  # weight clipping that clips nothing
                with torch.no_grad():
                    for p in model.parameters():
                        p.clamp_(-10.0, 10.0)
            elif edit == "resume" and step == 5:  # the optimizer's state loaded first, then the model's
                saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
                opt.load_state_dict(saved_opt)
                model.load_state_dict(saved_model)
            elif edit == "reload" and step == 5:  # a write through .data the engine cannot see, then told
                with torch.no_grad():
                    for p in model.parameters():
                        p.data.copy_(p.data.clone())
                opt.reload_params()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_in_place_edit_of_a_bf16_model_keeps_the_fp32_masters_of_the_values_it_left(executor: str) -> None:
    """A bf16 parameter holds its fp32 master rounded. An in-place change between steps is taken as the new
    master, but elements the change left as they were must keep their master: weight clipping that clips
    nothing, or a resume that loads the optimizer's state and then the model's weights, replaced every master
    by its bf16 rounding (updates below bf16's resolution were lost from then on); so did reload_params().
    (Each edit's run against one plain run: each run with the process executor starts a worker.)"""
    plain = _bf16_run(executor, "none")
    differ = [edit for edit in ("clip", "resume", "reload")
              if not all(torch.equal(p, q) for p, q in zip(_bf16_run(executor, edit), plain, strict=True))]
    assert not differ, f"the parameters after these edits differ from the plain run's: {differ}"


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_parameter_given_new_storage_is_taken_as_torch_takes_it(executor: str) -> None:
    """``p.data = t`` between steps (a re-initialised layer, a weight loaded by hand): torch's AdamW steps from
    ``t``; the engine's publish buffers and masters did not see it and stepped from the old values."""
    torch.manual_seed(0)
    model = _MLP()
    ref = copy.deepcopy(model)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=80) as opt:
        for step in range(5):
            if step in (2, 3):
                new = torch.randn(8, 8, generator=gen)
                model.b.weight.data = new.clone()
                ref.b.weight.data = new.clone()
            batch = _batch(gen)
            opt.zero_grad()
            opt.backward(_loss(model, batch))
            opt.step()
            ropt.zero_grad()
            _loss(ref, batch).backward()
            ropt.step()
            assert relative_deviation(model, ref) <= TOL, step


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_model_converted_after_the_optimizer_was_made_is_refused_clearly(executor: str) -> None:
    """``model.double()`` after the optimizer was made: its masters and publish buffers are float32, and the
    next step() pointed the parameters back at them (the model silently float32 again). Refused at the next
    backward, before anything is taken; converted back, training goes on."""
    torch.manual_seed(0)
    model = _MLP()
    gen = torch.Generator().manual_seed(6)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=80) as opt:
        batch = _batch(gen)
        opt.zero_grad()
        opt.backward(_loss(model, batch))
        opt.step()
        model.double()
        with pytest.raises(LeafError, match=r"parameter \d+ is now \(\d+(, \d+)?\) torch.float64 on cpu, the "
                                            r"optimizer was made for .* torch.float32"):
            opt.backward(_loss(model, tuple(t.double() for t in batch)))
        with pytest.raises(LeafError, match="torch.float64"):
            opt.step()
        assert all(p.dtype == torch.float64 for p in model.parameters())
        model.float()
        opt.zero_grad()
        opt.backward(_loss(model, batch))
        opt.step()
        assert all(p.dtype == torch.float32 for p in model.parameters())


# A parameter whose memory was freed between steps (untyped_storage().resize_(0), as FSDP frees a resharded
# parameter), gradients then set by hand: step() took it as edited (its storage moved) and copied it into its
# master, reading address 0 (a segmentation fault). Run in a subprocess so that a crash fails the test instead of
# ending pytest. (The process executor's parameters live in shared memory, which cannot be resized.)
_FREED_PARAM = """
import torch
from sofx.errors import LeafError
from test_offload_support import linear_beside_torch

torch.set_num_threads(1)
for executor in ("inline", "thread"):
    model, ref, opt, ropt = linear_beside_torch(executor)
    x = torch.randn(8, 4)
    with opt:
        opt.backward(model(x).square().mean())
        opt.step()
        ref(x).square().mean().backward()
        ropt.step()
        ropt.zero_grad()
        bias = model.bias.detach().clone()
        model.bias.untyped_storage().resize_(0)
        wg, bg = torch.randn(3, 4), torch.randn(3)
        model.weight.grad, model.bias.grad = wg.clone(), bg.clone()
        try:
            opt.step()
            raise AssertionError("stepped a parameter whose storage was freed")
        except LeafError as e:
            msg = str(e)
        assert "parameter 1 (param_groups[0]['params'][1], shape (3,)): its storage holds 0 bytes" in msg, msg
        assert not opt.engine.in_step and torch.equal(model.weight.grad, wg), "nothing was taken"
        model.bias.data = bias.clone()  # its memory back: taken as the new master, as torch steps from it
        ref.bias.data = bias.clone()
        ref.weight.grad, ref.bias.grad = wg.clone(), bg.clone()
        opt.step()
        ropt.step()
        assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
print("ok")
"""


def test_a_parameter_whose_storage_was_freed_is_refused_naming_it_and_nothing_is_taken() -> None:
    script_prints_ok(_FREED_PARAM)


# A parameter whose memory was freed (untyped_storage().resize_(0), as FSDP frees a resharded parameter) or shrunk
# between backward and step(), after its block began stepping from its master: step() refused it as "changed in
# place", which it was not. The refusal names it, says its memory was freed or shrunk and what to do; nothing is
# stepped, and zero_grad() drops the step. (The process executor's parameters live in shared memory, which cannot
# be resized.)
@pytest.mark.parametrize("keep", [0, 8])
@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_parameter_freed_between_backward_and_step_is_refused_as_freed_and_nothing_is_stepped(executor: str,
                                                                                                keep: int) -> None:
    model, ref, opt, ropt = linear_beside_torch(executor)
    x = torch.randn(8, 4)
    with opt:
        for _ in range(2):
            ref(x).square().mean().backward()
            ropt.step()
            ropt.zero_grad()
        opt.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
        opt.backward(model(x).square().mean())
        model.bias.untyped_storage().resize_(keep)
        with pytest.raises(LeafError) as refused:
            opt.step()
        msg = str(refused.value)
        assert msg.startswith(f"parameter 1 (param_groups[0]['params'][1], shape (3,)): its storage holds {keep} "
                              "bytes, but its elements"), msg
        assert "its memory was freed or shrunk" in msg and "between backward and step()" in msg, msg
        assert "zero_grad()" in msg and "changed in place" not in msg, msg
        assert torch.equal(model.weight, weight), "nothing is stepped"
        model.bias.data = bias.clone()  # its memory back, then the step dropped
        opt.zero_grad()
        assert [int(opt.state[p]["step"]) for p in (model.weight, model.bias)] == [1, 1]
        opt.backward(model(x).square().mean())
        opt.step()
        assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)


# The optimizer's state given, or a model parameter it writes, whose memory was freed (untyped_storage().resize_(0),
# as FSDP frees tensors) or shrunk: load_state_dict() copied a block's tensors in (a segmentation fault for a freed
# one) and the masters into the model's parameters (a segmentation fault, or a write past a shrunk parameter's end:
# glibc's "corrupted double-linked list"); opt.state[p][key] = t copied t in (reading past its end: garbage in the
# moments), and a master into the model's parameter; a saved group's tensor lr failed torch's deepcopy. Each is
# refused naming it before anything changes; in a subprocess, so that a crash fails the test.
_FREED_STATE = """
import re
import torch
from refusal_script import expect_refused
from torch import nn
import sofx.offload
from sofx.errors import HParamError, LeafError, StructureError, UnsupportedError

torch.set_num_threads(1)


def cut(t, keep):
    t.untyped_storage().resize_(keep)
    return t


def setup(executor):
    torch.manual_seed(0)
    model = nn.Linear(40, 30)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor)
    for _ in range(2):
        opt.backward(model(torch.randn(8, 40)).square().mean())
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    saved = {"state": {**sd["state"], "blocks": [{k: v.clone() for k, v in b.items()} for b in sd["state"]["blocks"]]},
             "param_groups": [dict(g) for g in sd["param_groups"]]}
    return model, opt, saved


def engine_tensors(opt):
    blocks = [opt.engine.tensors[layout.index] for layout in opt.engine.layouts]
    return [getattr(t, k).clone() for t in blocks for k in ("master", "exp_avg", "exp_avg_sq", "counts")]


def expect(case, opt, model, fn, error, pattern):  # (the engine's state and the model's bias unchanged)
    expect_refused(case, fn, error, pattern, lambda: engine_tensors(opt) + [model.bias.detach().clone()])


for executor in ("inline", "thread"):
    for keep in (0, 8):  # freed; shrunk
        holds = f": its storage holds {keep} bytes"
        for key in ("master", "exp_avg", "exp_avg_sq", "counts"):
            model, opt, saved = setup(executor)
            cut(saved["state"]["blocks"][0][key], keep)
            expect(f"load {key} {executor} {keep}", opt, model, lambda: opt.load_state_dict(saved), StructureError,
                   re.escape(f"state_dict['state']['blocks'][0][{key!r}]") + holds)
        model, opt, saved = setup(executor)
        saved["param_groups"][0]["lr"] = cut(torch.tensor(1e-3), keep // 4)
        expect(f"load group lr {executor} {keep}", opt, model, lambda: opt.load_state_dict(saved), HParamError,
               re.escape("saved param_groups[0]['lr']") + f": its storage holds {keep // 4} bytes")
        for key in ("exp_avg", "exp_avg_sq", "master"):
            model, opt, saved = setup(executor)
            value = cut(torch.randn(30, 40), keep)
            expect(f"set {key} {executor} {keep}", opt, model, lambda: opt.state[model.weight].__setitem__(key, value),
                   UnsupportedError, re.escape(f"parameter 0's state[{key!r}]") + holds)
        model, opt, saved = setup(executor)
        step = cut(torch.tensor(5), keep // 2)
        expect(f"set step {executor} {keep}", opt, model, lambda: opt.state[model.weight].__setitem__("step", step),
               UnsupportedError, re.escape("parameter 0's state['step']") + f": its storage holds {keep // 2} bytes")
        param = re.escape("parameter 0 (param_groups[0]['params'][0], shape (30, 40))") + holds
        model, opt, saved = setup(executor)
        cut(model.weight, keep)
        expect(f"set master into a freed parameter {executor} {keep}", opt, model,
               lambda: opt.state[model.weight].__setitem__("master", torch.randn(30, 40)), LeafError, param)
        model, opt, saved = setup(executor)
        cut(model.weight, keep)
        expect(f"load into a freed parameter {executor} {keep}", opt, model, lambda: opt.load_state_dict(saved),
               LeafError, param)
print("ok")
"""


def test_a_state_or_a_parameter_whose_storage_was_freed_or_shrunk_is_refused_naming_it_and_nothing_changes() -> None:
    script_prints_ok(_FREED_STATE)
