"""The facade's ``state_dict`` / ``load_state_dict`` side by side with ``torch.optim.AdamW`` and
``torch.amp.GradScaler``'s: what a torch user saves comes back as torch gives it back, and a run resumed from
it goes on as the uninterrupted one."""

from __future__ import annotations

import contextlib
import copy
import io
import math
from typing import Any, Iterator

import pytest
import torch

import sofx.offload
from sofx.errors import HParamError
from sofx.loss_scale import DynamicLossScaleState, deepspeed_scaler, grad_scaler

from helpers import assert_trees_bitwise

# GradScaler settings other than its defaults (init 2**16, growth 2, backoff 0.5, every 2000 clean steps)
SETTINGS = {"init_scale": 2.0 ** 10, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 3}
OVERFLOWS = (1, 7)  # steps whose gradients hold an inf: skipped, the scale backs off
N, M = 4, 7  # saved after step 3 (scale 256, 2 clean steps of 3 counted); after it a growth, a backoff, a growth


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 3)


def _loss(model: torch.nn.Module, step: int) -> tuple[torch.Tensor, torch.utils.hooks.RemovableHandle | None]:
    """The step's loss, with an inf put into the weight's gradient at the OVERFLOWS steps (remove the handle
    after backward)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    hook = model.weight.register_hook(_with_inf) if step in OVERFLOWS else None
    return ((model(x) - y) ** 2).mean(), hook


def _with_inf(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = math.inf
    return grad


def _torch_steps(model, opt, scaler, start: int, stop: int) -> list[float]:
    """torch.optim.AdamW with torch.amp.GradScaler; the scale of each step."""
    scales = []
    for step in range(start, stop):
        opt.zero_grad()
        loss, hook = _loss(model, step)
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        scales.append(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    return scales


def _facade_steps(model, opt, start: int, stop: int) -> list[float]:
    """The facade's steps; the scale of each."""
    scales = []
    for step in range(start, stop):
        opt.zero_grad()
        loss, hook = _loss(model, step)
        opt.backward(loss)
        if hook is not None:
            hook.remove()
        scales.append(opt.step().scale)
    return scales


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _saved_after_n_steps() -> tuple[torch.nn.Module, list[float], list[torch.Tensor], list[float], dict]:
    """The facade with the SETTINGS GradScaler rule: the scales of an uninterrupted run of N + M steps and its
    final parameters; then a new run's model after N steps, their scales and its state dict (a copy)."""
    model = _model()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, loss_scale=grad_scaler(**SETTINGS),
                                       executor="inline") as opt:
        uninterrupted = _facade_steps(model, opt, 0, N + M)
    want = _params(model)
    model = _model()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, loss_scale=grad_scaler(**SETTINGS),
                                       executor="inline") as opt:
        before = _facade_steps(model, opt, 0, N)
        saved = copy.deepcopy(opt.state_dict())
    return model, uninterrupted, want, before, saved


def _torch_resumed(saved_scaler: dict, new_scaler: torch.amp.GradScaler) -> tuple[list[float], list[float]]:
    """torch's run, saved after N steps and resumed into ``new_scaler``: the scales before and after."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", **saved_scaler)
    before = _torch_steps(model, opt, scaler, 0, N)
    opt_sd, scaler_sd = copy.deepcopy(opt.state_dict()), scaler.state_dict()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    opt.load_state_dict(opt_sd)
    new_scaler.load_state_dict(scaler_sd)
    return before, _torch_steps(model, opt, new_scaler, N, N + M)


def test_a_resumed_dynamic_loss_scale_keeps_the_saved_growth_settings_as_torchs_grad_scaler_does():
    """torch's GradScaler.state_dict holds its growth_factor, backoff_factor and growth_interval with its scale,
    and load_state_dict takes them over the new scaler's: a run saved with other settings and resumed into a
    ``GradScaler()`` of the defaults goes on as the uninterrupted one. The facade's state dict held the scale
    and the clean-step count only: resumed into ``loss_scale="dynamic"`` (the defaults) it grew the scale by 2
    every 2000 steps and backed off by half, another run."""
    model, uninterrupted, want, before, saved = _saved_after_n_steps()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, loss_scale="dynamic",
                                       executor="inline") as opt:
        opt.load_state_dict(saved)
        after = _facade_steps(model, opt, N, N + M)
        resaved = opt.state_dict()

    torch_before, torch_after = _torch_resumed(SETTINGS, torch.amp.GradScaler("cpu"))
    assert torch_before + torch_after == before + after == uninterrupted
    assert after == [2.0 ** 8, 2.0 ** 10, 2.0 ** 10, 2.0 ** 10, 2.0 ** 8, 2.0 ** 8, 2.0 ** 8]  # grown, backed off
    assert_trees_bitwise(_params(model), want)
    # the settings are in the state dict, as in GradScaler's, and stay there once resumed
    scaler = torch.amp.GradScaler("cpu", **SETTINGS).state_dict()
    for sd in (saved, resaved):
        held = sd["state"]["scaler"]
        assert {k: held[k] for k in ("growth_factor", "backoff_factor", "growth_interval")} == \
            {k: scaler[k] for k in ("growth_factor", "backoff_factor", "growth_interval")}
    assert saved["state"]["scaler"] == {"type": "GradScalerRule", **SETTINGS}
    assert saved["state"]["scaler_state"] == {"type": "GradScalerState", "scale": 2.0 ** 8, "growth_tracker": 2}


def test_a_state_dict_without_the_loss_scale_settings_loads_with_the_constructors():
    """A state dict saved before the settings were kept (no ``scaler`` entry) still loads: the run goes on with
    the loss-scale rule the optimizer was made with."""
    model, uninterrupted, want, before, old = _saved_after_n_steps()
    del old["state"]["scaler"]
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, loss_scale=grad_scaler(**SETTINGS),
                                       executor="inline") as opt:
        opt.load_state_dict(old)
        assert before + _facade_steps(model, opt, N, N + M) == uninterrupted
        assert opt.state_dict()["state"]["scaler"] == {"type": "GradScalerRule", **SETTINGS}
    assert_trees_bitwise(_params(model), want)


def test_a_resumed_deepspeed_loss_scale_keeps_the_saved_settings():
    """DeepSpeed's checkpoint holds its loss scaler whole (settings and state) and its load puts it in place: the
    facade's deepspeed profile resumed into ``loss_scale="dynamic"`` (DeepSpeed's defaults: a window of 1000,
    hysteresis 2) goes on with the saved window and hysteresis."""
    settings = {"init_scale": 2.0 ** 10, "scale_window": 2, "hysteresis": 1, "min_scale": 2.0,
                "scale_factor": 4.0}
    kwargs = {"lr": 1e-2, "profile": "deepspeed", "executor": "inline"}
    model = _model()
    with sofx.offload.SpeculativeAdamW(model.parameters(), loss_scale=deepspeed_scaler(**settings),
                                       **kwargs) as opt:
        uninterrupted = _facade_steps(model, opt, 0, N + M)
    want = _params(model)

    model = _model()
    with sofx.offload.SpeculativeAdamW(model.parameters(), loss_scale=deepspeed_scaler(**settings),
                                       **kwargs) as opt:
        before = _facade_steps(model, opt, 0, N)
        saved = copy.deepcopy(opt.state_dict())
    with sofx.offload.SpeculativeAdamW(model.parameters(), loss_scale="dynamic", **kwargs) as opt:
        opt.load_state_dict(saved)
        after = _facade_steps(model, opt, N, N + M)
    assert before + after == uninterrupted
    assert len(set(after)) >= 2
    assert_trees_bitwise(_params(model), want)


def _lr_seen(opt: torch.optim.Optimizer, saved: dict) -> tuple:
    """What a user sees of the first group's lr: in ``saved`` (a state dict) and in the group."""
    kept, group = saved["param_groups"][0]["lr"], opt.param_groups[0]["lr"]
    return type(kept), float(kept), type(group), float(group), kept is group


def test_a_tensor_lr_round_trips_as_a_tensor_as_in_torch_optim():
    """torch.optim keeps ``lr=torch.tensor(...)`` a tensor: its state_dict holds the group's tensor, and
    load_state_dict gives the group a copy of the saved one, also in an optimizer made with a float lr (and a
    saved float lr a float, in one made with a tensor). The facade's state dict held a tensor lr as a Python
    float, and the loaded group held that float: a scheduler resumed on it set floats where torch fills the
    tensor."""
    runs = {}
    for name, make in (("torch", lambda params, lr: torch.optim.AdamW(params, lr=lr, foreach=False)),
                       ("facade", lambda params, lr: sofx.offload.SpeculativeAdamW(params, lr=lr,
                                                                                   executor="inline"))):
        model = _model()
        opt = make(model.parameters(), torch.tensor(1e-2))
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        for step in range(2):
            opt.zero_grad()
            loss = _loss(model, step)[0]
            if name == "torch":
                loss.backward()
            else:
                opt.backward(loss)
            opt.step()
            sched.step()
        saved = copy.deepcopy(opt.state_dict())
        seen = [_lr_seen(opt, opt.state_dict())]
        for lr in (0.5, torch.tensor(0.5)):  # a fresh optimizer made with a float lr, then a tensor one
            fresh = make(model.parameters(), lr)
            fresh.load_state_dict(saved)
            seen.append(_lr_seen(fresh, saved))
            assert fresh.param_groups[0]["lr"] is not saved["param_groups"][0]["lr"]  # a copy of the saved
            floats = copy.deepcopy(saved)
            floats["param_groups"][0]["lr"] = 0.125
            fresh.load_state_dict(floats)
            seen.append(_lr_seen(fresh, floats))
            if name == "facade":
                fresh.close()
        if name == "facade":
            opt.close()
        runs[name] = seen
    assert runs["facade"] == runs["torch"]
    assert runs["torch"][0] == (torch.Tensor, pytest.approx(2.5e-3), torch.Tensor, pytest.approx(2.5e-3), True)


def _two_layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _groups_seen(opt: torch.optim.Optimizer) -> tuple[list[dict], list[dict]]:
    """The param groups as a user sees them (without the parameters) and as the state dict holds them."""
    return ([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            copy.deepcopy(opt.state_dict()["param_groups"]))


@pytest.mark.parametrize("grouped", [False, True])
def test_named_parameters_and_param_names_round_trip_as_in_torch_optim(grouped):
    """torch.optim (>= 2.5) takes ``model.named_parameters()`` (or groups of them), keeps each group's
    ``param_names`` and stores them in the state dict; load_state_dict does not check them: saved names
    (other ones too) replace the group's, a state dict without names keeps the group's, and one with names gives
    them to an optimizer made without. The facade does the same, side by side."""
    def named(model: torch.nn.Sequential) -> list:
        if not grouped:
            return list(model.named_parameters())
        return [{"params": [(n, p) for n, p in model.named_parameters() if n.startswith("0.")]},
                {"params": [(n, p) for n, p in model.named_parameters() if n.startswith("2.")], "lr": 3e-2}]

    def unnamed(model: torch.nn.Sequential) -> list:
        return [{**g, "params": [p for _, p in g["params"]]} for g in named(model)] if grouped \
            else list(model.parameters())

    seen = {}
    for name, make in (("torch", lambda params: torch.optim.AdamW(params)),
                       ("facade", lambda params: sofx.offload.SpeculativeAdamW(params, executor="inline"))):
        model = _two_layers()
        opts = [make(named(model))]
        out = [_groups_seen(opts[0])]
        saved = copy.deepcopy(opts[0].state_dict())
        renamed = copy.deepcopy(saved)
        for group in renamed["param_groups"]:
            group["param_names"] = [f"other.{n}" for n in group["param_names"]]
        nameless = copy.deepcopy(saved)
        for group in nameless["param_groups"]:
            del group["param_names"]
        for make_params, sd in ((named, renamed), (named, nameless), (unnamed, saved), (unnamed, nameless)):
            opts.append(make(make_params(model)))
            opts[-1].load_state_dict(sd)
            out.append(_groups_seen(opts[-1]))
            if "param_names" in sd["param_groups"][0]:  # the group's own copy, as torch's deepcopy of the groups
                assert opts[-1].param_groups[0]["param_names"] is not sd["param_groups"][0]["param_names"]
        opts[-1].zero_grad()
        loss = _loss(model, 0)[0]
        if name == "torch":
            loss.backward()
        else:
            opts[-1].backward(loss)
        opts[-1].step()  # the names are no hparam: the step takes them
        for opt in opts if name == "facade" else ():
            opt.close()
        seen[name] = out
    assert seen["facade"] == seen["torch"]
    names = [g["param_names"] for g in seen["torch"][0][1]]
    assert names == ([["0.weight", "0.bias"], ["2.weight", "2.bias"]] if grouped
                     else [["0.weight", "0.bias", "2.weight", "2.bias"]])
    assert [g["param_names"] for g in seen["torch"][1][0]] == [[f"other.{n}" for n in ns] for ns in names]
    assert "param_names" not in seen["torch"][4][0][0]


def test_named_and_unnamed_param_groups_mixed_are_refused_as_in_torch_optim():
    model = _two_layers()
    groups = [{"params": list(model[0].named_parameters())}, {"params": list(model[2].parameters())}]
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW(groups)
    with pytest.raises(ValueError) as ours:
        sofx.offload.SpeculativeAdamW(groups, executor="inline")
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kind", ["AdamW", "Adam"])
def test_load_state_dict_replaces_each_group_by_the_saved_one_as_torch_optim_does(kind):
    """torch.optim's load_state_dict gives each group a copy of the saved one: a key the saved group lacks is
    dropped (a user's tag, an ``initial_lr``; torch's own options take Adam's defaults, and AdamW's weight decay
    stays decoupled), and a saved ``betas`` list stays a list. The facade merged the saved keys into its groups
    (a dropped key kept, betas made a tuple) and refused an AdamW group saved with decoupled_weight_decay=False,
    which torch.optim.AdamW takes as decoupled. Side by side, the groups come out the same, and step."""
    seen = {}
    for name, make in (("torch", lambda groups: getattr(torch.optim, kind)(groups, lr=1e-2, foreach=False)),
                       ("facade", lambda groups: getattr(sofx.offload, f"Speculative{kind}")(groups, lr=1e-2,
                                                                                           foreach=False,
                                                                                           executor="inline"))):
        model = _two_layers()
        groups = [{"params": list(model[0].parameters()), "tag": "encoder"},
                  {"params": list(model[2].parameters()), "lr": 3e-2}]
        opt = make(groups)
        saved = copy.deepcopy(opt.state_dict())
        older = saved["param_groups"][0]  # an older state dict: neither the tag nor torch's newer options
        for key in ("tag", "foreach", "fused", "capturable", "decoupled_weight_decay", "differentiable"):
            del older[key]
        older["betas"] = [0.8, 0.99]  # as a JSON checkpoint gives it back
        saved["param_groups"][1].update({"note": "saved", "decoupled_weight_decay": False})
        fresh = make(groups)
        fresh.param_groups[0]["initial_lr"] = 1e-2  # (an lr scheduler made before the load)
        fresh.load_state_dict(saved)
        seen[name] = _groups_seen(fresh)
        assert [g["params"] for g in fresh.param_groups] == [groups[0]["params"], groups[1]["params"]]
        fresh.zero_grad()
        loss = _loss(model, 0)[0]
        if name == "torch":
            loss.backward()
        else:
            fresh.backward(loss)
        fresh.step()
        if name == "facade":
            opt.close()
            fresh.close()
    assert seen["facade"] == seen["torch"]
    group0, group1 = seen["torch"][0]
    assert "tag" not in group0 and "initial_lr" not in group0 and type(group0["betas"]) is list
    assert group1["note"] == "saved" and group1["decoupled_weight_decay"] is (kind == "AdamW")
    assert type(seen["facade"][1][0]["betas"]) is list


def test_a_saved_group_without_an_hparam_is_refused_before_anything_is_loaded():
    """torch.optim takes a saved group without ``lr`` and fails at the next step (KeyError: 'lr'); the facade,
    which now replaces the group by the saved one as torch does (no longer keeping its own ``lr``), refuses it at
    the load, naming the group and the key, and changes nothing."""
    model = _two_layers()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        saved = copy.deepcopy(opt.state_dict())
        del saved["param_groups"][0]["lr"]
        before = copy.deepcopy(opt.state_dict())
        groups = opt.param_groups
        with pytest.raises(sofx.StructureError, match=r"saved param_groups\[0\] has no 'lr'"):
            opt.load_state_dict(saved)
        assert opt.param_groups is groups and opt.param_groups[0]["lr"] == 1e-2
        assert_trees_bitwise(opt.state_dict()["state"], before["state"])


def test_a_load_pre_hook_editing_the_state_dict_in_place_leaves_the_callers_dict_as_torch_optim_does():
    """torch.optim's load_state_dict hands its pre-hooks a shallow copy of the caller's dict: a hook that
    removes or sets a top-level key (as a hook adapting an older checkpoint does) edits that copy, and the
    caller's dict keeps its keys. The facade handed the caller's own dict, so loading changed it. Side by side
    with torch.optim.AdamW."""
    def adapt(opt: torch.optim.Optimizer, sd: dict) -> None:
        del sd["extra"]
        sd["adapted"] = True

    seen = {}
    for name, make in (("torch", lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False)),
                       ("facade", lambda params: sofx.offload.SpeculativeAdamW(params, lr=1e-2,
                                                                               executor="inline"))):
        model = _model()
        opt = make(model.parameters())
        opt.register_load_state_dict_pre_hook(adapt)
        saved = {**opt.state_dict(), "extra": 1}
        opt.load_state_dict(saved)
        seen[name] = sorted(saved)
        if name == "facade":
            opt.close()
    assert seen["facade"] == seen["torch"] == ["extra", "param_groups", "state"]


def test_a_deepspeed_loss_scale_resumed_with_an_edited_window_loads_though_the_edited_rule_cannot_reach_it():
    """The saved loss-scale settings may be edited before loading (load_state_dict's docstring): a run whose scale
    grew after an overflow (hysteresis restored to 2) resumed with a wider scale_window holds a state that no run
    of the *edited* rule reaches (it would not have grown yet), which ``check_reachable`` refuses. The load takes
    it, as DeepSpeed's update_scale goes on from any state within the settings: check_reachable is for a rule and
    a state from one source (a ZeRO-3 file), and is not applied here."""
    settings = {"init_scale": 2.0 ** 10, "scale_window": 2, "hysteresis": 2, "min_scale": 1.0}
    kwargs = {"lr": 1e-2, "profile": "deepspeed", "executor": "inline"}
    model = _model()
    with sofx.offload.SpeculativeAdamW(model.parameters(), loss_scale=deepspeed_scaler(**settings),
                                       **kwargs) as opt:
        _facade_steps(model, opt, 0, 6)  # an overflow at step 1, a growth at step 4
        saved = copy.deepcopy(opt.state_dict())
    assert saved["state"]["scaler_state"] == {"type": "DynamicLossScaleState", "scale": 2.0 ** 11, "cur_iter": 6,
                                              "last_overflow_iter": 1, "cur_hysteresis": 2}
    saved["state"]["scaler"]["scale_window"] = 100
    wider = deepspeed_scaler(**{**settings, "scale_window": 100})
    state = DynamicLossScaleState(2.0 ** 11, 6, 1, 2)
    with pytest.raises(HParamError, match=r"cur_hysteresis'\] = 2 is invalid"):
        wider.check_reachable(state)
    with sofx.offload.SpeculativeAdamW(model.parameters(), loss_scale="dynamic", **kwargs) as opt:
        opt.load_state_dict(saved)
        assert opt.engine.scaler == wider and opt.engine.scaler_state == state
        scales = _facade_steps(model, opt, 6, 9)  # an overflow at step 7: hysteresis 2 -> 1, no backoff
    assert scales == [2.0 ** 11] * 3
    assert wider.update(wider.update(state, False), True) == (2.0 ** 11, 8, 7, 1)


def test_a_saved_parameter_of_another_shape_with_as_many_elements_is_refused_naming_it():
    """The engine state's block layouts hold every parameter's shape, but the load compared only their sizes: a
    state saved for Linear(5, 6)'s (6, 5) weight loaded into Linear(6, 5)'s (5, 6) one without a word, its master
    and moments read in the other shape (torch.optim's moments of the other shape fail at its next step). It is
    refused naming the parameter and both shapes, and nothing changes."""
    torch.manual_seed(0)
    saved_model, model = torch.nn.Linear(5, 6, bias=False), torch.nn.Linear(6, 5, bias=False)
    with sofx.offload.SpeculativeAdamW(saved_model.parameters(), lr=1e-2, executor="inline") as opt:
        opt.backward(saved_model(torch.randn(4, 5)).square().mean())
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline") as opt:
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(sofx.StructureError, match=r"state_dict\['state'\]\['layouts'\]\[0\]: parameter 0 has "
                                                      r"shape \(6, 5\) in the state, \(5, 6\) here"):
            opt.load_state_dict(saved)
        assert_trees_bitwise(opt.state_dict()["state"], before["state"])


@pytest.mark.parametrize("block_numel", [2 ** 22, 8])
def test_a_saved_parameter_of_another_size_is_refused_naming_it_and_both_shapes(block_numel):
    """torch.optim's load_state_dict matches the parameters by position and refuses groups of other sizes; the
    offload optimizer's does too, but a parameter of another size (a state saved for another model, groups of the
    same sizes) was refused as "the saved blocks do not match this optimizer's blocks (block_numel, parameter sizes
    or param groups differ)" with every block's sizes, naming no parameter. It names the first parameter that
    differs (its number, its group and its place there) and both shapes; nothing changes."""
    torch.manual_seed(0)
    saved_model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3))
    kwargs = dict(lr=1e-2, executor="inline", block_numel=block_numel)

    def groups(m):
        return [{"params": list(m[0].parameters())}, {"params": list(m[1].parameters())}]

    with sofx.offload.SpeculativeAdamW(groups(saved_model), **kwargs) as opt:
        opt.backward(saved_model(torch.randn(4, 4)).square().mean())
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
    with sofx.offload.SpeculativeAdamW(groups(model), **kwargs) as opt:
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(sofx.StructureError, match=r"^state_dict\['state'\]\['layouts'\]: parameter 2 "
                                                      r"\(param_groups\[1\]\['params'\]\[0\]\) has shape \(2, 3\) in "
                                                      r"the state, \(3, 3\) here"):
            opt.load_state_dict(saved)
        assert_trees_bitwise(opt.state_dict()["state"], before["state"])

def test_a_state_saved_with_another_block_numel_is_refused_saying_so_and_carries_over_per_parameter():
    """A run resumed with another ``block_numel`` (a performance setting) was refused with "the saved blocks do not
    match this optimizer's blocks (block_numel, parameter sizes or param groups differ)", without saying which:
    where the same parameters are only packed into other blocks the refusal now says that block_numel differs and
    how to carry the state over, per parameter, which the test does (then both optimizers step alike)."""
    def make(block_numel):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        return model, sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", block_numel=block_numel)

    x = torch.randn(3, 8)
    model, opt = make(64)
    with opt:
        for _ in range(2):
            opt.zero_grad()
            opt.backward(model(x).square().mean())
            opt.step()
        saved = opt.state_dict()
        wide_model, wide = make(2 ** 22)
        with wide:
            with pytest.raises(sofx.SofxError, match=r"^state_dict\['state'\]\['layouts'\]: the saved state holds "
                                                     r"these parameters packed into other blocks \(saved \[\[128\], "
                                                     r"\[16, 32, 2\]\], here \[\[128, 16, 32, 2\]\]\): this "
                                                     r"optimizer's block_numel differs from the saved run's.*"
                                                     r"opt\.state\[p\]\[key\] = value"):
                wide.load_state_dict(saved)
            wide_model.load_state_dict(model.state_dict())
            for p, q in zip(model.parameters(), wide_model.parameters()):
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    wide.state[q][key] = opt.state[p][key]
            for o, m in ((opt, model), (wide, wide_model)):
                o.zero_grad()
                o.backward(m(x).square().mean())
                o.step()
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), wide_model.parameters()))


@contextlib.contextmanager
def _two_groups_after_a_step() -> Iterator[tuple[list[torch.Tensor], Any]]:
    """``(params, opt)``: a SpeculativeAdamW (inline) over two groups of a two-layer model's parameters (lr 1e-2
    and 0.5), after one step."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    params = list(model.parameters())
    groups = [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 0.5}]
    with sofx.offload.SpeculativeAdamW(groups, executor="inline") as opt:
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        yield params, opt


def test_a_state_dict_of_reordered_or_edited_groups_is_refused_as_their_next_step_is():
    """Groups reordered (or a group's ``params`` edited: a parameter moved, removed, written over another) are refused
    at the next step, as the blocks are packed per group at construction; ``state_dict()`` took them as they were:
    reordered, each group's hparams were saved at the other's place beside the engine's state (in the groups'
    order of construction), and loading that gave each group of a new optimizer the other's lr without a word.
    Refused as the step refuses them; once the lists are put back the state dict is the optimizer's."""
    with _two_groups_after_a_step() as (params, opt):
        for edit, undo, message in (
                (opt.param_groups.reverse, opt.param_groups.reverse,
                 r"param_groups\[0\]\['params'\]\[0\] \(shape \(3, 3\)\) is a parameter of param_groups\[1\]"),
                (opt.param_groups[1]["params"].pop, lambda: opt.param_groups[1]["params"].append(params[3]),
                 r"param_groups\[1\]\['params'\] has 1 parameters, this optimizer was made with 2")):
            edit()
            with pytest.raises(sofx.UnsupportedError, match=message):
                opt.state_dict()
            undo()
        saved = opt.state_dict()
    assert [g["lr"] for g in saved["param_groups"]] == [1e-2, 0.5]


def test_a_state_dict_loaded_into_reordered_groups_is_refused_before_anything_is_loaded():
    """Loading gives the saved groups' hparams to the groups by position. Into groups reordered (refused at the next
    step), each took the other's saved hparams, and putting the order back then kept the swap: every group trained
    on at the other's lr without a word. Refused, as the step refuses such groups, before anything is loaded."""
    with _two_groups_after_a_step() as (params, opt):
        saved = copy.deepcopy(opt.state_dict())
        before = copy.deepcopy(opt.state_dict())
        opt.param_groups.reverse()
        with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(3, 3\)\) is a "
                                                        r"parameter of param_groups\[1\]"):
            opt.load_state_dict(saved)
        opt.param_groups.reverse()
        assert [g["lr"] for g in opt.param_groups] == [1e-2, 0.5]
        assert_trees_bitwise(opt.state_dict(), before)
        opt.load_state_dict(saved)
        assert [g["lr"] for g in opt.param_groups] == [1e-2, 0.5]


_L = torch.optim.lr_scheduler
_SCHEDULERS = {  # every torch.optim.lr_scheduler a training script uses (CyclicLR and OneCycleLR also cycle beta1)
    "LambdaLR": lambda o: _L.LambdaLR(o, lambda e: e / 2 if e < 2 else 0.8 ** e),
    "MultiplicativeLR": lambda o: _L.MultiplicativeLR(o, lambda e: 0.9),
    "StepLR": lambda o: _L.StepLR(o, 2, 0.5),
    "MultiStepLR": lambda o: _L.MultiStepLR(o, [2, 4], 0.3),
    "ConstantLR": lambda o: _L.ConstantLR(o, 0.5, 3),
    "LinearLR": lambda o: _L.LinearLR(o, 0.2, 1.0, 4),
    "ExponentialLR": lambda o: _L.ExponentialLR(o, 0.9),
    "PolynomialLR": lambda o: _L.PolynomialLR(o, 6, 2.0),
    "CosineAnnealingLR": lambda o: _L.CosineAnnealingLR(o, 5),
    "CosineAnnealingWarmRestarts": lambda o: _L.CosineAnnealingWarmRestarts(o, 2, 2),
    "CyclicLR": lambda o: _L.CyclicLR(o, 1e-3, 1e-2, step_size_up=2, cycle_momentum=True, base_momentum=0.8,
                                      max_momentum=0.9),
    "OneCycleLR": lambda o: _L.OneCycleLR(o, 1e-2, total_steps=8, cycle_momentum=True),
    "ReduceLROnPlateau": lambda o: _L.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "SequentialLR": lambda o: _L.SequentialLR(o, [_L.LinearLR(o, 0.1, 1.0, 2), _L.ExponentialLR(o, 0.8)], [2]),
    "ChainedScheduler": lambda o: _L.ChainedScheduler([_L.ConstantLR(o, 0.5, 2), _L.ExponentialLR(o, 0.9)]),
}


def _scheduled_run(kind: str, scheduler: str, resume_at: int | None) -> tuple[list[torch.Tensor], list[Any]]:
    """8 steps of ``kind`` ("torch" or "sofx") with ``scheduler``; with ``resume_at``, the optimizer's and the
    scheduler's state dicts are saved before that step, through ``torch.save``/``torch.load`` (weights_only), and
    loaded into a fresh model, optimizer and scheduler that go on. The parameters, and each step's
    ``get_last_lr()`` with every group's lr and betas."""
    def make(model: torch.nn.Module) -> tuple[Any, Any]:
        groups = [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}]
        opt = (torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=False) if kind == "torch" else
               sofx.offload.SpeculativeAdamW(groups, lr=1e-2, weight_decay=0.1, executor="inline", block_numel=8))
        return opt, _SCHEDULERS[scheduler](opt)

    model = _model()
    opt, sched = make(model)
    seen = []
    for step in range(8):
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "model": model.state_dict()}, buffer)
            if kind == "sofx":
                opt.close()
            buffer.seek(0)
            saved = torch.load(buffer)
            model = torch.nn.Linear(5, 3)
            model.load_state_dict(saved["model"])
            opt, sched = make(model)
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
        loss, _ = _loss(model, step + 100)  # (no overflow)
        opt.zero_grad()
        if kind == "torch":
            loss.backward()
        else:
            opt.backward(loss)
        opt.step()
        sched.step(loss.item() if step % 3 else 100.0) if scheduler == "ReduceLROnPlateau" else sched.step()
        seen.append((sched.get_last_lr(), [(g["lr"], tuple(g["betas"])) for g in opt.param_groups]))
    if kind == "sofx":
        opt.close()
    return [p.detach().clone() for p in model.parameters()], seen


@pytest.mark.parametrize("scheduler", list(_SCHEDULERS))
def test_every_lr_scheduler_resumed_through_torch_save_goes_on_as_torch_optims_uninterrupted_run(scheduler):
    """Each ``torch.optim.lr_scheduler`` (those cycling AdamW's beta1 included) drives the facade as it drives
    ``torch.optim.AdamW``, bit for bit, with the same ``get_last_lr()``; optimizer and scheduler saved mid-run
    together through ``torch.save``/``torch.load`` and loaded into fresh objects go on as the uninterrupted run."""
    want = _scheduled_run("torch", scheduler, None)
    for resume_at in (None, 3):
        params, seen = _scheduled_run("sofx", scheduler, resume_at)
        assert seen == want[1], f"resumed at {resume_at}"
        assert_trees_bitwise(params, want[0])


def test_a_state_value_of_another_dtype_or_kind_is_refused_naming_what_it_is():
    """``opt.state[p]["exp_avg"] = value``: an int64 tensor of the right shape was refused as "must be a float
    tensor of shape (3, 5), got Tensor (3, 5)", the shape it has and no word of its dtype; a list was shown whole.
    The refusal names the dtype and shape of a tensor, and the type of anything else (shortened)."""
    model = _model()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
        state = opt.state[model.weight]
        with pytest.raises(sofx.UnsupportedError, match=r"must be a float tensor of shape \(3, 5\), got a "
                                                        r"torch\.int64 tensor of shape \(3, 5\)$"):
            state["exp_avg"] = torch.zeros(3, 5, dtype=torch.int64)
        with pytest.raises(sofx.UnsupportedError, match=r"must be a float tensor of shape \(3, 5\), got a "
                                                        r"torch\.float32 tensor of shape \(5, 3\)$"):
            state["exp_avg"] = torch.zeros(5, 3)
        with pytest.raises(sofx.UnsupportedError, match=r"got a list \[\[0, 0, 0.{0,55}$"):
            state["exp_avg_sq"] = [[0] * 5] * 300
