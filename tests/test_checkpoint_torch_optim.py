"""to_torch_optim / from_torch_optim: a run continued on the other side equals the uninterrupted run (bitwise)."""

from __future__ import annotations

import copy
import math
import re
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import sofx
import sofx.checkpoint as ck
from sofx import tree
from sofx.errors import UnsupportedError

N, M = 4, 4

CASES = {
    "adamw_one_group": (lambda: sofx.adamw(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, None),
    "adam_l2_two_groups": (lambda: sofx.adam(lr=1e-2, weight_decay=0.02), torch.optim.Adam,
                           {"enc": sofx.AdamHParams(lr=2e-2, beta2=0.99), "dec": sofx.AdamHParams(weight_decay=0.0)}),
    "adamw_two_groups": (lambda: sofx.adamw(lr=1e-2, weight_decay=0.1), torch.optim.AdamW,
                         {"enc": sofx.AdamHParams(lr=3e-2, eps=1e-6), "dec": sofx.AdamHParams(beta1=0.8)}),
}


def _params():
    g = torch.Generator().manual_seed(3)
    return {"enc": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)},
            "dec": [torch.randn(5, 2, generator=g), torch.randn(2, generator=g)]}


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    out = tree.tree_map(lambda p: torch.randn(p.shape, generator=g), params)
    if step < 2:
        out["dec"][1] = None  # never stepped during the first steps: torch keeps no state for it
    return out


def _sofx_steps(opt, params, state, hparams, start, stop):
    for step in range(start, stop):
        params, state, _ = opt.update(params, _grads(params, step), state, hparams)
    return params, state


def _torch_steps(torch_opt, params, start, stop):
    leaves, spec = tree.flatten(params)
    for step in range(start, stop):
        for p, g in zip(leaves, tree.flatten_up_to(spec, _grads(params, step))):
            p.grad = g
        torch_opt.step()


def _adamw_state_dict() -> tuple[dict, dict]:
    """``_params()`` after two steps of ``torch.optim.AdamW`` and that optimizer's ``state_dict()``."""
    params = _params()
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(sofx.adamw(), params))
    _torch_steps(torch_opt, params, 0, 2)
    return params, torch_opt.state_dict()


def _clone(t):
    return tree.tree_map(lambda x: x.clone(), t)


def _equal(a, b):
    la, _ = tree.flatten(a)
    lb, _ = tree.flatten(b)
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("case", CASES)
def test_export_then_continue_in_torch_equals_uninterrupted(case):
    make, torch_cls, hp = CASES[case]
    opt = make()
    # uninterrupted torch run
    ref = _params()
    ref_opt = torch_cls(ck.torch_param_groups(opt, ref, hp))
    _torch_steps(ref_opt, ref, 0, N + M)
    # sofx for N steps, export, torch for M steps (a fresh torch optimizer with other defaults)
    params, state = _sofx_steps(opt, _params(), opt.init(_params()), hp, 0, N)
    sd = ck.to_torch_optim(opt, state, hp)
    # torch numbers dec[0], dec[1], enc.b, enc.w (flatten order, group by group); dec[1] missed 2 steps
    assert [sd["state"][i]["step"].item() for i in range(4)] == [N, N - 2, N, N]
    cont = _clone(params)
    cont_opt = torch_cls([{"params": g["params"]} for g in ck.torch_param_groups(opt, cont, hp)], lr=0.5)
    cont_opt.load_state_dict(sd)
    _torch_steps(cont_opt, cont, N, N + M)
    assert _equal(cont, ref)
    # the continued torch optimizer's state equals the uninterrupted one's, bit for bit
    a, b = cont_opt.state_dict(), ref_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i in b["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][i][k], b["state"][i][k])


@pytest.mark.parametrize("case", CASES)
def test_import_then_continue_in_sofx_equals_uninterrupted(case):
    make, torch_cls, hp = CASES[case]
    opt = make()
    ref_params, ref_state = _sofx_steps(opt, _params(), opt.init(_params()), hp, 0, N + M)
    ref_torch = _params()
    _torch_steps(torch_cls(ck.torch_param_groups(opt, ref_torch, hp)), ref_torch, 0, N + M)
    assert _equal(ref_params, ref_torch)  # sofx == torch.optim, step by step
    # torch for N steps, import, sofx for M steps
    params = _params()
    torch_opt = torch_cls(ck.torch_param_groups(opt, params, hp))
    _torch_steps(torch_opt, params, 0, N)
    state, hparams = ck.from_torch_optim(opt, torch_opt.state_dict(), params, hp)
    assert state.count["dec"][1].item() == N - 2 and state.count["dec"][0].item() == N
    params, state = _sofx_steps(opt, _clone(params), state, hparams, N, N + M)
    assert _equal(params, ref_params)
    assert _equal(state, ref_state)


def _frozen_grads(params, step):
    """``_grads`` with ``params['enc']['b']`` frozen: no gradient at any step (torch.optim keeps no state for it)."""
    grads = _grads(params, step)
    grads["enc"]["b"] = None
    return grads


@pytest.mark.parametrize("make, torch_cls", [(sofx.adam, torch.optim.Adam), (sofx.adamw, torch.optim.AdamW)],
                         ids=["adam", "adamw"])
def test_a_frozen_parameter_in_groups_of_other_hparams_round_trips_and_both_sides_step_on_alike(make, torch_cls):
    """Two groups of other lr, betas, eps and weight decay, one holding a parameter that never gets a gradient
    (torch.optim keeps no state for it; sofx counts 0): sofx's export leaves it out, and a fresh torch optimizer
    loading it steps on as sofx does, bit for bit, for 3 steps (the frozen parameter unchanged); torch's state dict
    of that run imports back (the frozen leaf at count 0, zero moments) and sofx steps on as torch, 3 more steps."""
    opt = make(lr=1e-2, weight_decay=0.05)
    hp = {"enc": sofx.AdamHParams(lr=3e-2, beta1=0.8, eps=1e-6), "dec": sofx.AdamHParams(beta2=0.99, weight_decay=0.0)}
    ref, ref_state = _params(), opt.init(_params())
    for step in range(9):
        ref, ref_state, _ = opt.update(ref, _frozen_grads(ref, step), ref_state, hp)
    params, state = _params(), opt.init(_params())
    for step in range(3):
        params, state, _ = opt.update(params, _frozen_grads(params, step), state, hp)
    sd = ck.to_torch_optim(opt, state, hp, params=params)
    assert sorted(sd["state"]) == [0, 1, 3]  # (torch's numbering: dec[0], dec[1], enc.b, enc.w)
    theirs = _clone(params)
    torch_opt = torch_cls([{"params": g["params"]} for g in ck.torch_param_groups(opt, theirs, hp)], lr=0.5)
    torch_opt.load_state_dict(sd)
    leaves, spec = tree.flatten(theirs)
    for step in range(3, 6):
        for p, g in zip(leaves, tree.flatten_up_to(spec, _frozen_grads(theirs, step))):
            p.grad = g
        torch_opt.step()
    ours = params
    for step in range(3, 6):
        ours, state, _ = opt.update(ours, _frozen_grads(ours, step), state, hp)
    assert _equal(theirs, ours)
    assert torch.equal(theirs["enc"]["b"], _params()["enc"]["b"])
    back, hparams = ck.from_torch_optim(opt, torch_opt.state_dict(), theirs, hp)
    assert int(back.count["enc"]["b"]) == 0 and not back.mu["enc"]["b"].any() and not back.nu["enc"]["b"].any()
    assert hparams == {"enc": sofx.AdamHParams(3e-2, 0.8, 0.999, 1e-6, 0.05),
                       "dec": sofx.AdamHParams(1e-2, 0.9, 0.99, 1e-8, 0.0)}
    assert _equal(back, state)
    theirs = _clone(theirs)
    for step in range(6, 9):
        theirs, back, _ = opt.update(theirs, _frozen_grads(theirs, step), back, hparams)
    assert _equal(theirs, ref)
    assert _equal(back, ref_state)


def test_import_returns_the_state_dicts_hparams():
    opt = sofx.adamw()
    params = _params()
    torch_opt = torch.optim.AdamW([{"params": [params["dec"][0], params["dec"][1]], "lr": 0.25},
                                   {"params": [params["enc"]["b"], params["enc"]["w"]], "betas": (0.5, 0.75)}],
                                  weight_decay=0.3)
    _torch_steps(torch_opt, params, 0, 3)
    template = {"enc": sofx.AdamHParams(), "dec": sofx.AdamHParams()}
    state, hp = ck.from_torch_optim(opt, torch_opt.state_dict(), params, template)
    assert hp["dec"] == sofx.AdamHParams(0.25, 0.9, 0.999, 1e-8, 0.3)
    assert hp["enc"] == sofx.AdamHParams(1e-3, 0.5, 0.75, 1e-8, 0.3)
    # explicit groups in torch's own order: one AdamHParams per leaf comes back
    groups = [["params['dec'][0]", "params['dec'][1]"], ["params['enc']['b']", 3]]
    state2, per_leaf = ck.from_torch_optim(opt, torch_opt.state_dict(), params, groups=groups)
    assert per_leaf["enc"]["w"] == hp["enc"] and per_leaf["dec"][1] == hp["dec"]
    assert _equal(state, state2)
    # the moments are copies: stepping torch further does not touch the imported state
    before = _clone(state)
    _torch_steps(torch_opt, params, 3, 4)
    assert _equal(state, before)


def test_state_dtype_and_devices_follow_the_optimizer():
    opt = sofx.adamw(state_dtype=torch.float64)
    params = _params()
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(opt, params))
    _torch_steps(torch_opt, params, 0, 3)
    state, _ = ck.from_torch_optim(opt, torch_opt.state_dict(), params)
    assert state.mu["enc"]["w"].dtype == torch.float64 and state.count["enc"]["w"].dtype == torch.int64
    sd = ck.to_torch_optim(opt, state)
    back = torch.optim.AdamW(ck.torch_param_groups(opt, _clone(params)))
    back.load_state_dict(sd)  # torch casts the moments to the parameter dtype
    assert back.state_dict()["state"][0]["exp_avg"].dtype == torch.float32


def test_interop_errors():
    params = _params()
    adamw, adam = sofx.adamw(), sofx.adam()
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(adamw, params))
    _torch_steps(torch_opt, params, 0, 2)
    sd = torch_opt.state_dict()
    with pytest.raises(UnsupportedError, match="decoupled_weight_decay=True.*use sofx.adamw"):
        ck.from_torch_optim(adam, sd, params)
    with pytest.raises(UnsupportedError, match="bias_correction=False"):
        ck.to_torch_optim(sofx.adamw(bias_correction=False), adamw.init(params))
    with pytest.raises(ck.CheckpointMismatchError, match="1 param groups, the params tree is laid out in 2"):
        ck.from_torch_optim(adamw, sd, params, {"enc": sofx.AdamHParams(), "dec": sofx.AdamHParams()})
    wrong = {"enc": {"w": torch.zeros(5, 6), "b": torch.zeros(5)}, "dec": [torch.zeros(5, 2), torch.zeros(2)]}
    with pytest.raises(ck.CheckpointMismatchError, match=r"exp_avg.*params\['enc'\]\['w'\]: expected shape \(5, 6\)"):
        ck.from_torch_optim(adamw, sd, wrong)
    ams = torch.optim.AdamW(ck.torch_param_groups(adamw, _params()), amsgrad=True).state_dict()
    with pytest.raises(UnsupportedError, match=r"param_groups\[0\]: amsgrad=True is not supported \(only "
                                               r"torch.optim's default, False\)"):
        ck.from_torch_optim(adamw, ams, params)
    # the value as saved (maximize=1 was reported as maximize=True), in sofx.adamw's words
    maximized = {**sd, "param_groups": [{**sd["param_groups"][0], "maximize": 1}]}
    with pytest.raises(UnsupportedError, match=r"param_groups\[0\]: maximize=1 is not supported \(only "
                                               r"torch.optim's default, False\)"):
        ck.from_torch_optim(adamw, maximized, params)
    with pytest.raises(ck.CheckpointError, match="'state' .* 'param_groups'"):
        ck.from_torch_optim(adamw, {"state": []}, params)
    with pytest.raises(ck.CheckpointError, match="every leaf must be in a group"):
        ck.to_torch_optim(adamw, adamw.init(params), groups=[[0, 1]])
    with pytest.raises(ck.CheckpointError, match="mixes hyperparameters"):
        ck.to_torch_optim(adamw, adamw.init(params), {"enc": sofx.AdamHParams(lr=1.0), "dec": sofx.AdamHParams()},
                          groups=[[0, 1, 2, 3]])
    with pytest.raises(ck.CheckpointError, match="no params leaf is named 'nope'"):
        ck.torch_param_groups(adamw, params, groups=[["nope"]])


@pytest.mark.parametrize("groups", [5, 1.5, len, "ab", [[0, 1], 2]], ids=["int", "float", "function", "str", "flat"])
def test_groups_that_are_not_a_sequence_of_sequences_are_refused_naming_the_argument(groups):
    """groups=5 (or a function) raised Python's bare TypeError ('int' object is not iterable) from every call that
    lays the params out in groups; it is refused as a str or a list holding a non-sequence is."""
    params = _params()
    adamw = sofx.adamw()
    state = adamw.init(params)
    sd = torch.optim.AdamW(ck.torch_param_groups(adamw, params)).state_dict()
    for call in (lambda: ck.to_torch_optim(adamw, state, groups=groups),
                 lambda: ck.from_torch_optim(adamw, sd, params, groups=groups),
                 lambda: ck.torch_param_groups(adamw, params, groups=groups)):
        with pytest.raises(ck.CheckpointError, match=r"^groups must be a sequence of sequences of leaf indices or "
                                                     r"paths, got "):
            call()


def test_a_parameter_id_listed_twice_in_the_state_dict_is_refused():
    """torch.optim lists each parameter once across its param groups (it refuses one in two groups): an id listed
    twice gave two leaves of the same shape the same saved state (and the leaf of the id it replaced, where that
    had no state, none: nothing was refused)."""
    adamw = sofx.adamw(lr=1e-2)
    g = torch.Generator().manual_seed(5)
    params = {"x": {"a": torch.randn(3, generator=g), "b": torch.randn(3, generator=g)},
              "y": {"c": torch.randn(3, generator=g), "d": torch.randn(3, generator=g)}}
    two = {"x": sofx.AdamHParams(lr=3e-2), "y": sofx.AdamHParams()}
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(adamw, params, two))
    for step in range(3):
        for i, p in enumerate(tree.flatten(params)[0]):
            p.grad = torch.randn(3, generator=g) if i % 2 == 0 else None  # 1 and 3: no state
        torch_opt.step()
    sd = torch_opt.state_dict()
    g0, g1 = sd["param_groups"]
    assert g0["params"] == [0, 1] and g1["params"] == [2, 3]
    in_one = {**sd, "param_groups": [{**g0, "params": [0, 0]}, g1]}
    with pytest.raises(ck.CheckpointMismatchError, match=r"from_torch_optim: parameter id 0 is listed twice: in "
                                                         r"param_groups\[0\] and param_groups\[0\]; torch.optim "
                                                         r"lists each parameter once"):
        ck.from_torch_optim(adamw, in_one, params, two)
    in_two = {**sd, "param_groups": [g0, {**g1, "params": [2, 0]}]}
    with pytest.raises(ck.CheckpointMismatchError, match=r"parameter id 0 is listed twice: in param_groups\[0\] and "
                                                         r"param_groups\[1\]"):
        ck.from_torch_optim(adamw, in_two, params, two)
    state, _ = ck.from_torch_optim(adamw, sd, params, two)  # the state dict is untouched and still imports
    assert [int(c) for c in tree.flatten(state.count)[0]] == [3, 0, 3, 0]


def test_an_unhashable_parameter_id_is_refused_naming_where_it_is_listed():
    """A parameter id is a key of the state dict's ``state``: an unhashable one (a list) in a param group's
    ``params`` was Python's bare TypeError; it is a CheckpointError naming its place, and nothing changes."""
    adamw = sofx.adamw(lr=1e-2)
    params = _params()
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(adamw, params))
    _torch_steps(torch_opt, params, 0, 2)
    sd = torch_opt.state_dict()
    (g0,) = sd["param_groups"]
    for ids, where in (([[0], 1, 2, 3], 0), ([0, 1, 2, {3: 3}], 3)):
        bad = {**sd, "param_groups": [{**g0, "params": ids}]}
        with pytest.raises(ck.CheckpointError, match=rf"^from_torch_optim: param_groups\[0\]\['params'\]\[{where}\] is "
                                                     r"a (list|dict), not a parameter id \(ids are keys of the state "
                                                     r"dict's 'state': they must be hashable\)"):
            ck.from_torch_optim(adamw, bad, params)
    state, _ = ck.from_torch_optim(adamw, sd, params)  # the state dict is untouched and still imports
    assert [int(c) for c in tree.flatten(state.count)[0]] == [2, 0, 2, 2]


def test_a_group_member_named_by_a_text_that_names_two_leaves_is_refused():
    """A leaf is named by its path or, under the root dict, by its key; the path won silently where a text was
    both (a key written as another leaf's path), or the first leaf where two leaves' paths read the same (keys of
    equal repr), and the group held a leaf the caller may not have meant."""
    adamw = sofx.adamw(lr=1e-2)
    by_key_or_path = {"params['w']": torch.zeros(2), "w": torch.zeros(3)}
    with pytest.raises(ck.CheckpointError, match=r"groups: \"params\['w'\]\" names 2 params leaves \(0: "
                                                 r"params\[\"params\['w'\]\"\], 1: params\['w'\]\); name it by "
                                                 r"its index"):
        ck.torch_param_groups(adamw, by_key_or_path, groups=[["params['w']"], [0]])
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    same_repr = {first: torch.zeros(2), second: torch.zeros(3)}
    path = tree.leaf_paths(same_repr)[0]
    with pytest.raises(ck.CheckpointError, match="names 2 params leaves"):
        ck.torch_param_groups(adamw, same_repr, groups=[[path], [1]])
    # where the text names one leaf, the groups are as asked
    got = ck.torch_param_groups(adamw, by_key_or_path, groups=[[1], ['params["params[\'w\']"]']])
    assert [g["params"][0].shape for g in got] == [(3,), (2,)]


def test_the_exported_moments_are_copies_and_none_in_the_hparams_prefix_means_the_defaults():
    """torch's load_state_dict keeps a tensor of its parameter's dtype and device as it is: the exported moments
    were the state's own, and torch's steps wrote into the sofx state a run went on from. A None in the hparams
    prefix tree (the defaults for its subtree, as update takes it) was refused by every interop function."""
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1)
    hp = {"enc": sofx.AdamHParams(lr=3e-2), "dec": None}
    params, state = _sofx_steps(opt, _params(), opt.init(_params()), hp, 0, 3)
    before = _clone(state)
    exported = ck.to_torch_optim(opt, state, hp)
    assert [g["lr"] for g in exported["param_groups"]] == [1e-2, 3e-2]  # dec: the defaults (flatten order)
    torch_params = _clone(params)
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(opt, torch_params, hp))
    torch_opt.load_state_dict(exported)
    _torch_steps(torch_opt, torch_params, 3, 5)
    assert _equal(state, before)  # untouched by torch's steps
    sofx_params, sofx_state = _sofx_steps(opt, _clone(params), _clone(state), hp, 3, 5)
    assert _equal(torch_params, sofx_params)
    back, _ = ck.from_torch_optim(opt, torch_opt.state_dict(), torch_params, hp)
    assert _equal(back, sofx_state)


@pytest.mark.skipif(not hasattr(sys, "get_int_max_str_digits"), reason="this Python writes ints of any size in decimal")
def test_a_dict_key_too_long_for_decimal_text_is_exported_imported_and_named_in_hex():
    """A params dict key of more digits than Python writes in decimal: torch_param_groups, to_torch_optim and
    from_torch_optim work, a group member is named by its hex path, and an error names the leaf that way."""
    huge = 10 ** 5000
    opt = sofx.adamw(lr=1e-2)
    g = torch.Generator().manual_seed(5)
    params = {huge: torch.randn(3, generator=g), "b": torch.randn(2, generator=g)}
    grads = {huge: torch.randn(3, generator=g), "b": torch.randn(2, generator=g)}
    params, state, _ = opt.update(params, grads, opt.init(params))
    groups = [[f"params[{hex(huge)}]"], ["b"]]
    assert [len(pg["params"]) for pg in ck.torch_param_groups(opt, params, groups=groups)] == [1, 1]
    sd = ck.to_torch_optim(opt, state, groups=groups)
    assert torch.equal(sd["state"][0]["exp_avg"], state.mu[huge])
    assert torch.equal(sd["state"][1]["exp_avg"], state.mu["b"])
    back, _ = ck.from_torch_optim(opt, sd, params, groups=groups)
    assert torch.equal(back.nu[huge], state.nu[huge]) and torch.equal(back.count[huge], state.count[huge])
    sd["state"][0]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ck.CheckpointMismatchError, match=rf"state\[0\]\['exp_avg'\] for params\[{hex(huge)}\]"):
        ck.from_torch_optim(opt, sd, params, groups=groups)


@pytest.mark.skipif(not hasattr(sys, "get_int_max_str_digits"), reason="this Python writes ints of any size in decimal")
def test_a_parameter_id_too_long_for_decimal_text_imports_and_is_named_in_hex():
    """torch.optim takes any hashable parameter id: an int of more digits than Python writes in decimal imports
    (its text named each leaf's step eagerly: Python's bare ValueError), and errors name it in hex."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2), "b": torch.randn(3)}
    sd = ck.to_torch_optim(adamw, adamw.update(params, tree.tree_map(torch.ones_like, params),
                                               adamw.init(params))[1])
    huge = 10 ** 5000
    renamed = {"state": {huge: sd["state"][0], 1: sd["state"][1]},
               "param_groups": [{**sd["param_groups"][0], "params": [huge, 1]}]}
    state, _ = ck.from_torch_optim(adamw, renamed, params)
    assert torch.equal(state.mu["a"], sd["state"][0]["exp_avg"]) and int(state.count["a"]) == 1
    extra = {**renamed, "state": {**renamed["state"], -huge: {}}}
    with pytest.raises(ck.CheckpointMismatchError, match=rf"state for parameter ids \[{hex(-huge)}\] that no param "):
        ck.from_torch_optim(adamw, extra, params)
    wrong = {**renamed, "state": {**renamed["state"], huge: {**sd["state"][0], "exp_avg": torch.zeros(5)}}}
    with pytest.raises(ck.CheckpointMismatchError, match=rf"state\[{hex(huge)}\]\['exp_avg'\] for params\['a'\]"):
        ck.from_torch_optim(adamw, wrong, params)
    twice = {**renamed, "param_groups": [{**sd["param_groups"][0], "params": [huge, huge]}]}
    with pytest.raises(ck.CheckpointMismatchError, match=rf"parameter id {hex(huge)} is listed twice"):
        ck.from_torch_optim(adamw, twice, params)


def test_a_saved_step_beyond_int64_is_refused_naming_the_entry():
    """sofx counts steps in int64: a saved step beyond it (an int, or a float such as 1e300) was Python's bare
    ValueError from the conversion; it is a CheckpointError naming the entry and its leaf."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2)}
    sd = ck.to_torch_optim(adamw, adamw.update(params, {"a": torch.ones(2)}, adamw.init(params))[1])
    for step in (2 ** 63, 1e300, torch.tensor(1e30)):
        bad = {**sd, "state": {0: {**sd["state"][0], "step": step}}}
        with pytest.raises(ck.CheckpointError, match=r"^state\[0\] \(params\['a'\]\): step must be a non-negative "
                                                     r"integer value below 2\*\*63, got"):
            ck.from_torch_optim(adamw, bad, params)
    widest = {**sd, "state": {0: {**sd["state"][0], "step": 2 ** 63 - 1}}}
    assert int(ck.from_torch_optim(adamw, widest, params)[0].count["a"]) == 2 ** 63 - 1


def test_a_saved_numpy_integer_step_imports_as_its_count_and_a_numpy_bool_is_refused():
    """A state dict that went through numpy holds its steps as numpy integers (np.int64(3)): refused as "not a
    non-negative integer value", where torch.optim takes it (and a numpy float64, a float, was taken). Imported as
    its count; a numpy bool is no count, and is refused as a Python bool is."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2)}
    sd = ck.to_torch_optim(adamw, adamw.update(params, {"a": torch.ones(2)}, adamw.init(params))[1])
    for step in (np.int64(3), np.uint64(3), np.int32(3), np.float32(3.0)):
        state, _ = ck.from_torch_optim(adamw, {**sd, "state": {0: {**sd["state"][0], "step": step}}}, params)
        assert state.count["a"].dtype == torch.int64 and int(state.count["a"]) == 3
    for step in (np.bool_(True), True, np.int64(-1), np.uint64(2 ** 63), np.float32(1.5)):
        with pytest.raises(ck.CheckpointError, match=r"^state\[0\] \(params\['a'\]\): step must be a non-negative "
                                                     r"integer value below 2\*\*63, got"):
            ck.from_torch_optim(adamw, {**sd, "state": {0: {**sd["state"][0], "step": step}}}, params)


def test_a_state_entry_missing_moments_is_refused_whatever_its_key_types():
    """An entry without step, exp_avg or exp_avg_sq is refused listing its keys; keys of mixed types (an int
    beside a str) could not be sorted: Python's bare TypeError."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2)}
    sd = ck.to_torch_optim(adamw, adamw.update(params, {"a": torch.ones(2)}, adamw.init(params))[1])
    for entry, keys in (({"step": 1, "exp_avg": torch.zeros(2)}, r"\['exp_avg', 'step'\]"),
                        ({"step": 1, 0: torch.zeros(2), "exp_avg": torch.zeros(2)}, r"\['exp_avg', 'step', 0\]")):
        with pytest.raises(ck.CheckpointError, match=r"^from_torch_optim: state\[0\] \(params\['a'\]\) must have "
                                                     r"step, exp_avg and exp_avg_sq; has " + keys):
            ck.from_torch_optim(adamw, {**sd, "state": {0: entry}}, params)


def test_a_state_entry_that_is_not_a_dict_is_refused_even_when_empty():
    """A parameter's state is a dict (torch.optim keeps ``defaultdict(dict)``); no state is an empty dict or
    none. An int entry raised a bare TypeError (``len`` of it), and an empty list or tensor was read as no
    state."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2)}
    sd = ck.to_torch_optim(adamw, adamw.update(params, {"a": torch.ones(2)}, adamw.init(params))[1])
    for entry, kind in ((5, "int"), ([], "list"), (torch.zeros(0), "Tensor")):
        with pytest.raises(ck.CheckpointError, match=rf"^from_torch_optim: state\[0\] \(params\['a'\]\) must have "
                                                     rf"step, exp_avg and exp_avg_sq; has {kind}$"):
            ck.from_torch_optim(adamw, {**sd, "state": {0: entry}}, params)
    for empty in ({}, None):
        state, _ = ck.from_torch_optim(adamw, {**sd, "state": {0: empty}}, params)
        assert int(state.count["a"]) == 0 and not state.mu["a"].any()


def test_a_negative_step_count_is_refused_on_export_naming_the_leaf():
    """A count of 0 is a leaf torch.optim keeps no state for; a negative count (which update refuses) was taken for
    one too and left out without a word, its moments with it."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2), "b": torch.randn(3)}
    state = adamw.update(params, {"a": torch.ones(2), "b": torch.ones(3)}, adamw.init(params))[1]
    bad = state._replace(count={"a": torch.tensor(1), "b": torch.tensor(-1)})
    with pytest.raises(ck.CheckpointError, match=r"^state.count\['b'\]: expected a step count >= 0, got -1"):
        ck.to_torch_optim(adamw, bad)


def test_a_negative_second_moment_is_refused_on_export_naming_the_leaf_and_element():
    """A state's negative exp_avg_sq was exported into the torch state dict, which from_torch_optim then refused to
    import back as corrupt: refused on export, in the same words (a nan one is exported, as it is imported)."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2), "b": torch.randn(3)}
    state = adamw.update(params, {"a": torch.ones(2), "b": torch.ones(3)}, adamw.init(params))[1]
    bad = state._replace(nu={"a": state.nu["a"], "b": state.nu["b"] * torch.tensor([1.0, -1.0, 1.0])})
    with pytest.raises(ck.CheckpointError, match=r"^state.nu\['b'\]\[1\] = -.*: expected a second moment >= 0"):
        ck.to_torch_optim(adamw, bad)
    nan = state._replace(nu={"a": state.nu["a"], "b": state.nu["b"] * torch.tensor([1.0, math.nan, 1.0])})
    assert ck.to_torch_optim(adamw, nan)["state"][1]["exp_avg_sq"].isnan().any()


def test_a_saved_moment_that_is_not_a_dense_floating_point_tensor_with_data_is_refused_naming_it():
    """A meta tensor (a state dict loaded onto the meta device) raised torch's bare NotImplementedError; a sparse one
    was imported as it was (update then refused the state, naming state.mu, not the entry); integer, bool and
    complex ones were cast without a word (complex: its imaginary part dropped, with torch's warning). No
    torch.optim run of floating-point parameters writes any of them."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2, 3)}
    sd = ck.to_torch_optim(adamw, adamw.update(params, {"a": torch.ones(2, 3)}, adamw.init(params))[1])
    for name in ("exp_avg", "exp_avg_sq"):
        for moment, what in ((torch.zeros(2, 3, device="meta"), "on the meta device"),
                             (torch.zeros(2, 3).to_sparse(), "of layout torch.sparse_coo"),
                             (torch.zeros(2, 3, dtype=torch.int64), "of dtype torch.int64"),
                             (torch.zeros(2, 3, dtype=torch.bool), "of dtype torch.bool"),
                             (torch.zeros(2, 3, dtype=torch.complex64), "of dtype torch.complex64")):
            bad = {**sd, "state": {0: {**sd["state"][0], name: moment}}}
            with pytest.raises(ck.CheckpointError, match=rf"^from_torch_optim: state\[0\]\['{name}'\] for "
                                                         rf"params\['a'\]: expected a dense floating-point tensor "
                                                         rf"with data, got one {what}"):
                ck.from_torch_optim(adamw, bad, params)
    # a non-contiguous moment and one in another floating dtype load (as copies in the optimizer's state dtype)
    entry = sd["state"][0]
    odd = {**sd, "state": {0: {**entry, "exp_avg": entry["exp_avg"].t().contiguous().t(),
                               "exp_avg_sq": entry["exp_avg_sq"].double()}}}
    state, _ = ck.from_torch_optim(adamw, odd, params)
    assert torch.equal(state.mu["a"], entry["exp_avg"]) and torch.equal(state.nu["a"], entry["exp_avg_sq"])
    assert state.nu["a"].dtype == torch.float32


def test_a_meta_params_template_imports_the_moments_onto_the_cpu():
    """A params tree on the meta device (a model built under torch.device("meta")) has no storage: the imported
    moments were put on it, their data dropped without a word. As sofx.checkpoint.load and load_zero3 place a
    meta template's tensors, they come onto the CPU (zeros for a leaf torch keeps no state for)."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2, 3), "b": torch.randn(4)}
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(adamw, params))
    params["a"].grad = torch.randn(2, 3)
    torch_opt.step()
    sd = torch_opt.state_dict()
    meta = tree.tree_map(lambda p: torch.empty_like(p, device="meta"), params)
    state, _ = ck.from_torch_optim(adamw, sd, meta)
    for t in tree.flatten(state)[0]:
        assert t.device.type == "cpu"
    saved = sd["state"][0]
    assert torch.equal(state.mu["a"], saved["exp_avg"]) and torch.equal(state.nu["a"], saved["exp_avg_sq"])
    assert int(state.count["a"]) == 1 and int(state.count["b"]) == 0
    assert torch.equal(state.mu["b"], torch.zeros(4)) and torch.equal(state.nu["b"], torch.zeros(4))


@pytest.mark.parametrize("leaf, why", [(torch.zeros(2, 3, dtype=torch.int64), "a floating-point tensor, got dtype "
                                                                            "torch.int64"),
                                       (torch.zeros(2, 3, dtype=torch.complex64), "a floating-point tensor, got "
                                                                                  "dtype torch.complex64"),
                                       (torch.zeros(2, 3).to_sparse(), "a dense \\(strided\\) tensor")],
                         ids=["int64", "complex64", "sparse"])
def test_a_params_template_leaf_sofx_cannot_step_is_refused_naming_it(leaf, why):
    """An int64 (or complex, bool) params leaf took the moments cast to its dtype (torch.optim's exp_avg 0.07
    imported as 0) without a word: a state no update can step (init refuses such params). Refused naming the
    leaf, as opt.init refuses it."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2, 3), "b": torch.randn(4)}
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(adamw, params))
    params["a"].grad = torch.randn(2, 3)
    torch_opt.step()
    with pytest.raises(ck.CheckpointError, match=rf"^from_torch_optim: params\['a'\]: expected {why}"):
        ck.from_torch_optim(adamw, torch_opt.state_dict(), {**params, "a": leaf})


class _Attention(torch.nn.Module):
    """Three projections of one shape, in model order q, k, v (flatten order of their names: k, q, v)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(4, 4, bias=False) for _ in range(3))


def _attention_steps(model, torch_opt, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(2, 4, generator=g)
        torch_opt.zero_grad()
        (model.q(x) * model.k(x) + model.v(x)).square().mean().backward()
        torch_opt.step()


def test_saved_param_names_that_put_a_leaf_elsewhere_than_the_flatten_order_are_refused_naming_it():
    """torch.optim made from named_parameters() keeps each group's param_names. The params tree's flatten order
    (dict keys sorted: k, q, v) is not the model's (q, k, v), and the projections' moments, all of one shape, were
    imported into each other's leaves without a word. The names say which parameter each entry is: a name of
    another leaf than the one at its position is refused, naming both; with groups= in the state dict's order the
    import is right and a run continued in sofx is torch's, bitwise."""
    adamw = sofx.adamw(lr=1e-2)
    model = _Attention()
    torch_opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    _attention_steps(model, torch_opt, 0, 3)
    sd = torch_opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == ["q.weight", "k.weight", "v.weight"]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    with pytest.raises(ck.CheckpointMismatchError, match=r"^from_torch_optim: param_groups\[0\]\['params'\]\[0\] is "
                                                         r"named 'q.weight', the params leaf params\['q.weight'\], "
                                                         r"but the params tree puts params\['k.weight'\] there"):
        ck.from_torch_optim(adamw, sd, params)
    groups = [g["param_names"] for g in sd["param_groups"]]
    state, hp = ck.from_torch_optim(adamw, sd, params, groups=groups)
    assert torch.equal(state.mu["q.weight"], sd["state"][0]["exp_avg"])
    for step in range(3, 5):
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(2, 4, generator=g)

        def loss(p):
            q, k, v = (torch.nn.functional.linear(x, p[f"{n}.weight"]) for n in "qkv")
            return (q * k + v).square().mean()

        grads = torch.func.grad(loss)(params)
        params, state, _ = adamw.update(params, grads, state, hp)
    _attention_steps(model, torch_opt, 3, 5)
    assert all(torch.equal(params[k], v) for k, v in model.named_parameters())
    # names of no leaf of the tree (a DDP module's "module." prefix) say nothing here: the order is the caller's
    foreign = {**sd, "param_groups": [{**sd["param_groups"][0], "param_names": [f"module.{n}" for n in groups[0]]}]}
    state2, _ = ck.from_torch_optim(adamw, foreign, params, groups=groups)
    assert torch.equal(state2.mu["q.weight"], sd["state"][0]["exp_avg"])


@pytest.mark.parametrize("step_kind", ["tensor", "int"])
@pytest.mark.parametrize("options", [{"foreach": False}, {"foreach": True}, {"fused": True}],
                         ids=["single_tensor", "foreach", "fused"])
def test_a_state_dict_of_any_torch_implementation_and_step_kind_continues_in_sofx_bitwise(options, step_kind):
    """torch's state dict carries its implementation flags (foreach, fused, differentiable, capturable) in each
    group and its steps as float32 0-d tensors (an int in older torch); a parameter without a gradient in the
    first steps has no state. Whatever the flags and the step's kind, the import holds torch's moments and counts
    bit for bit, and the run continued in sofx is torch's own continuation, bitwise, in two groups of different
    hyperparameters (fused: sofx's float32 step rounds as torch's single-tensor and foreach paths, not its fused
    kernel's, so there the continuation is checked against torch's single-tensor path)."""
    make, torch_cls, hp = CASES["adamw_two_groups"]
    opt = make()
    params = _params()
    torch_opt = torch_cls(ck.torch_param_groups(opt, params, hp), **options)
    _torch_steps(torch_opt, params, 0, N)
    sd = copy.deepcopy(torch_opt.state_dict())  # (torch's load keeps the step tensors: its steps would change sd)
    assert all(sd["param_groups"][0][k] is not None for k in ("differentiable", "capturable"))
    if step_kind == "int":
        for entry in sd["state"].values():
            entry["step"] = int(entry["step"])
    state, hparams = ck.from_torch_optim(opt, sd, params, hp)
    assert _equal(state, ck.from_torch_optim(opt, copy.deepcopy(torch_opt.state_dict()), params, hp)[0])
    back = ck.to_torch_optim(opt, state, hparams)
    for i, entry in sd["state"].items():
        assert int(back["state"][i]["step"]) == int(entry["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back["state"][i][key], entry[key])
    ours, _ = _sofx_steps(opt, _clone(params), state, hparams, N, N + M)
    theirs = _clone(params)
    cont = torch_cls(ck.torch_param_groups(opt, theirs, hp), **{**options, "fused": False})
    cont.load_state_dict(sd)
    for group in cont.param_groups:
        group["fused"] = False
    _torch_steps(cont, theirs, N, N + M)
    assert _equal(ours, theirs)


def test_a_moment_without_dense_data_is_refused_on_export_naming_the_leaf():
    """A state of meta moments (sofx.adamw().init of a model on the meta device, its count set) was exported as it
    was, and torch's load_state_dict then failed in its own copy, naming no parameter; a sparse one (which update
    refuses) likewise."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(2), "b": torch.randn(3)}
    state = adamw.update(params, {"a": torch.ones(2), "b": torch.ones(3)}, adamw.init(params))[1]
    for field, moment, what in (("mu", torch.zeros(3, device="meta"), "on the meta device"),
                                ("nu", torch.zeros(3).to_sparse(), "of layout torch.sparse_coo")):
        bad = state._replace(**{field: {**getattr(state, field), "b": moment}})
        with pytest.raises(ck.CheckpointError, match=rf"^state.{field}\['b'\]: expected a dense floating-point tensor "
                                                     rf"with data, got one {what}"):
            ck.to_torch_optim(adamw, bad)


def test_a_torch_optimizer_over_model_parameters_imports_by_groups_and_a_misordered_import_says_so():
    """A newcomer imports the state of ``torch.optim.AdamW(model.parameters())`` with ``params =
    dict(model.named_parameters())``: optree takes the dict's keys sorted ('0.bias' before '0.weight'), torch numbers
    the parameters in the model's order, so the moments met the wrong leaves and were refused with "expected shape
    (8,), got shape (8, 4)" only, without the cause. The refusal now names the order and the fix, groups= in the
    model's order, which imports the state so that sofx continues torch's run bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = torch.randn(5, 4), torch.randn(5, 2)

    def torch_step():
        torch_opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch_opt.step()

    for _ in range(3):
        torch_step()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = sofx.adamw()
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"^from_torch_optim: state\[0\]\['exp_avg'\] for params\['0\.bias'\]: expected shape "
                             r"\(8,\), got shape \(8, 4\) \(.*dict keys sorted.*model's order.*"
                             r"groups=\[list\(params\)\]"):
        ck.from_torch_optim(opt, torch_opt.state_dict(), params)
    state, hp = ck.from_torch_optim(opt, torch_opt.state_dict(), params, groups=[list(params)])
    torch_step()
    grads = {k: p.grad for k, p in model.named_parameters()}
    stepped, _, _ = opt.update(params, grads, state, hp)
    assert all(torch.equal(stepped[k], p) for k, p in model.named_parameters())


def test_from_torch_optim_of_an_offload_facade_state_dict_says_whose_format_it_is():
    """The offload facade's ``state_dict()`` has torch.optim's two keys but a format of its own; given to
    ``from_torch_optim`` it is refused naming that format and the facade's ``load_state_dict`` (it said that the
    state held parameter ids 'format', 'complete', ... that no param group lists)."""
    from sofx.offload import SpeculativeAdamW

    model = torch.nn.Linear(4, 2)
    facade = SpeculativeAdamW(model.parameters(), lr=1e-3)
    try:
        model(torch.randn(3, 4)).sum().backward()
        facade.step()
        saved = facade.state_dict()
    finally:
        facade.close()
    params = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(ck.CheckpointError, match=r"from_torch_optim: this is a sofx\.offload optimizer's "
                                                 r"state_dict\(\) \(format 'sofx\.offload/1'\).*load_state_dict"):
        ck.from_torch_optim(sofx.adamw(lr=1e-3), saved, params)


@pytest.mark.parametrize("torch_cls", [torch.optim.NAdam, torch.optim.RAdam])
@pytest.mark.parametrize("decoupled", [False, True])
def test_a_state_dict_of_another_torch_optimizer_with_adams_state_keys_is_refused_naming_the_group(torch_cls,
                                                                                                   decoupled):
    """NAdam's and RAdam's state dicts hold step, exp_avg and exp_avg_sq as Adam's do, and were imported without a
    word (a run continued with Adam's steps on NAdam's or RAdam's moments); their groups lack the ``amsgrad`` that
    torch.optim.Adam and AdamW write in every group. Nothing is imported, and the params are untouched."""
    params = _params()
    torch_opt = torch_cls(ck.torch_param_groups(sofx.adam(), params), decoupled_weight_decay=decoupled,
                          weight_decay=0.01)
    _torch_steps(torch_opt, params, 0, 3)
    sd = torch_opt.state_dict()
    assert set(sd["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}
    before, saved = _clone(params), copy.deepcopy(sd)
    opt = sofx.adamw() if decoupled else sofx.adam()
    why = "'momentum_decay'" if torch_cls is torch.optim.NAdam else "no 'amsgrad'"
    with pytest.raises(ck.CheckpointMismatchError, match=rf"param_groups\[0\]: it holds .*{why}.*not a torch\.optim\."
                                                         r"Adam or AdamW state dict"):
        ck.from_torch_optim(opt, sd, params)
    assert _equal(params, before) and _equal(sd["state"], saved["state"])  # nothing changed
    # torch.optim.Adam's and AdamW's own state dicts still import
    adam_params = _params()
    adam = torch.optim.AdamW(ck.torch_param_groups(sofx.adamw(), adam_params))
    _torch_steps(adam, adam_params, 0, 3)
    state, _ = ck.from_torch_optim(sofx.adamw(), adam.state_dict(), adam_params)
    assert state.count["enc"]["w"].item() == 3


@pytest.mark.parametrize("torch_cls", [torch.optim.RAdam, torch.optim.NAdam, torch.optim.Adamax, torch.optim.SGD])
@pytest.mark.parametrize("like", ["optimizer", "state_dict", "param_groups"])
def test_an_export_like_another_torch_optimizer_is_refused_naming_the_group(torch_cls, like):
    """``like=`` another torch optimizer than Adam or AdamW (or its state dict or groups) was taken, its groups'
    entries kept: the torch optimizer loading the export then stepped RAdam on Adam's moments, or SGD without them,
    without a word, or failed in its step with torch's bare KeyError ('mu_product' for NAdam, 'exp_inf' for
    Adamax). Refused as from_torch_optim refuses such a state dict, naming the group and why."""
    opt = sofx.adamw(lr=1e-2)
    params = {"w": torch.randn(4, generator=torch.Generator().manual_seed(0))}
    state = opt.update(params, {"w": torch.ones(4)}, opt.init(params))[1]
    torch_opt = torch_cls([torch.nn.Parameter(params["w"].clone())], lr=1e-2)
    given = {"optimizer": torch_opt, "state_dict": torch_opt.state_dict(), "param_groups": torch_opt.param_groups}
    why = "'momentum_decay'" if torch_cls is torch.optim.NAdam else "no 'amsgrad'"
    with pytest.raises(ck.CheckpointMismatchError, match=rf"^to_torch_optim: like's param_groups\[0\]: it holds "
                                                         rf".*{why}.*: not a torch\.optim\.Adam or AdamW's"):
        ck.to_torch_optim(opt, state, like=given[like])
    adam = torch.optim.Adam([torch.nn.Parameter(params["w"].clone())], lr=1e-2, decoupled_weight_decay=True)
    adam.load_state_dict(ck.to_torch_optim(opt, state, like=adam))  # (torch.optim.Adam's own is taken)


@pytest.mark.parametrize("key, value, where", [
    ("lr", "0.01", r"\['lr'\]"), ("lr", None, r"\['lr'\]"), ("eps", torch.tensor([1e-8, 1e-6]), r"\['eps'\]"),
    ("betas", (0.9, "0.999"), r"\['betas'\]\[1\]"), ("weight_decay", [0.01], r"\['weight_decay'\]")])
def test_a_saved_hparam_that_is_not_a_number_is_refused_naming_it(key, value, where):
    """A param group's lr, beta, eps or weight_decay that is no number (a string, None, a tensor of two elements, a
    list) raised Python's bare ValueError, TypeError or torch's RuntimeError from float(): now a CheckpointError
    names the entry and the value."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0][key] = value
    with pytest.raises(ck.CheckpointError, match=rf"^from_torch_optim: param_groups\[0\]{where}: expected a number, "
                                                 rf"got "):
        ck.from_torch_optim(sofx.adamw(), sd, params)


def test_a_negative_second_moment_is_refused_naming_the_element_and_a_nan_one_imports():
    """No run stores a negative ``exp_avg_sq``: one imported without a word made the next step's parameters nan (the
    offload facade's ``load_state_dict`` refuses it as corrupt). It is refused naming the entry, the leaf, the
    first negative element and its value; nothing is imported. A nan one (a diverged run's) imports, as torch
    loads it."""
    params, sd = _adamw_state_dict()
    key = 3  # params['enc']['w'] (dec[0], dec[1], enc.b, enc.w)
    sd["state"][key]["exp_avg_sq"][4, 2] = -0.5
    saved = copy.deepcopy(sd)
    with pytest.raises(ck.CheckpointError, match=r"from_torch_optim: state\[3\]\['exp_avg_sq'\] for "
                                                 r"params\['enc'\]\['w'\]\[4, 2\] = -0.5: expected a second moment "
                                                 r">= 0"):
        ck.from_torch_optim(sofx.adamw(), sd, params)
    assert _equal(sd["state"], saved["state"])
    sd["state"][key]["exp_avg_sq"][4, 2] = float("nan")
    state, _ = ck.from_torch_optim(sofx.adamw(), sd, params)
    assert torch.isnan(state.nu["enc"]["w"][4, 2])


@pytest.mark.parametrize("lr", [np.array(0.02), np.array([0.02]), torch.tensor([0.02], dtype=torch.float64),
                                np.float64(0.02)], ids=["numpy 0-d", "numpy 1 element", "tensor 1 element", "numpy"])
def test_a_saved_hparam_of_one_element_imports_as_its_number(lr):
    """An lr held as a tensor or numpy array of one element (torch.optim takes one) is its number."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0]["lr"] = lr
    assert ck.from_torch_optim(sofx.adamw(), sd, params)[1].lr == 0.02


@pytest.mark.parametrize("key", ["bias_correction", "correct_bias"])
def test_a_saved_group_without_bias_correction_is_refused_naming_it(key):
    """DeepSpeed's Adam (``bias_correction``) and Hugging Face's AdamW (``correct_bias``) keep Adam's state keys in
    a torch-style state dict; a group of theirs that turned bias correction off was imported into sofx's
    bias-corrected Adam without a word (load_zero3 refuses the same group). It is refused naming the group and the
    value; ``True`` imports."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0][key] = False
    with pytest.raises(UnsupportedError, match=rf"param_groups\[0\]: {key}=False is not supported \(torch\.optim's "
                                               r"Adam always corrects the bias"):
        ck.from_torch_optim(sofx.adamw(), sd, params)
    sd["param_groups"][0][key] = True
    ck.from_torch_optim(sofx.adamw(), sd, params)


@pytest.mark.parametrize("key, value, opt", [("decoupled_weight_decay", True, sofx.adam),
                                             ("decoupled_weight_decay", False, sofx.adamw),
                                             ("amsgrad", True, sofx.adamw), ("maximize", 1, sofx.adamw),
                                             ("bias_correction", False, sofx.adamw),
                                             ("correct_bias", False, sofx.adamw)])
def test_a_saved_option_sofx_does_not_implement_is_refused_naming_from_torch_optim(key, value, opt):
    """from_torch_optim's refusals of a saved group's options (another decay than the optimizer's, amsgrad or
    maximize set, bias correction off) began 'param_groups[0] ...', naming neither the call nor the state dict, where
    its other refusals begin 'from_torch_optim: '; they do too."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0][key] = value
    with pytest.raises(UnsupportedError, match=rf"^from_torch_optim: param_groups\[0\]: {key}={value!r}"):
        ck.from_torch_optim(opt(), sd, params)


@pytest.mark.parametrize("value", ["False", "True", None, 0.0, 2])
def test_a_saved_bias_correction_flag_that_is_no_bool_is_refused_naming_it(value):
    """A ``bias_correction``/``correct_bias`` of ``"False"`` (a config read as text) was true to ``not`` and
    imported into bias-corrected Adam without a word. Anything but True/False (or 1/0) is refused naming the
    entry and the value; nothing is imported."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0]["bias_correction"] = value
    with pytest.raises(ck.CheckpointError, match=r"^from_torch_optim: param_groups\[0\]\['bias_correction'\]: "
                                                 rf"expected True or False, got {re.escape(repr(value))}$"):
        ck.from_torch_optim(sofx.adamw(), sd, params)
    for ok in (1, np.bool_(True)):
        sd["param_groups"][0]["bias_correction"] = ok
        ck.from_torch_optim(sofx.adamw(), sd, params)


@pytest.mark.parametrize("key", ["amsgrad", "maximize", "decoupled_weight_decay"])
@pytest.mark.parametrize("value", ["False", torch.tensor([0, 0])], ids=["str", "tensor"])
def test_a_saved_option_that_is_no_flag_is_refused_naming_it(key, value):
    """A group's amsgrad, maximize or decoupled_weight_decay that is no True or False: the str "False" was true to
    bool() (decoupled_weight_decay "False" imported into sofx.adamw, refused from sofx.adam as 'has
    decoupled_weight_decay=True'; amsgrad refused as amsgrad='False'), and a tensor of two elements raised torch's
    bare RuntimeError. Refused as bias_correction is, naming the entry and the value; None says nothing."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0][key] = value
    with pytest.raises(ck.CheckpointError, match=rf"^from_torch_optim: param_groups\[0\]\['{key}'\]: expected True, "
                                                 rf"False or None, got {re.escape(repr(value)[:20])}"):
        ck.from_torch_optim(sofx.adamw(), sd, params)
    sd["param_groups"][0][key] = None
    ck.from_torch_optim(sofx.adamw(), sd, params)


@pytest.mark.parametrize("key", ["foreach", "fused", "capturable", "differentiable"])
@pytest.mark.parametrize("value", ["False", 0.0, torch.tensor([0, 0])], ids=["str", "float", "tensor"])
def test_a_saved_implementation_option_that_is_no_flag_is_refused_naming_it(key, value):
    """A group's foreach, fused, capturable or differentiable that is no flag (the str "False", true to torch's
    ``if group[...]:``; 0.0; a tensor of two elements) was imported without a word, and a round trip through
    ``to_torch_optim(like=...)`` handed it on to torch; sofx.adam and the offload facade refuse such a value
    (sofx.adam.torch_non_flag). Refused as amsgrad is, naming the entry and the value; None (torch picks) is taken
    but for differentiable, which torch's step hands to torch.set_grad_enabled (a Python bool only, not 1, None or
    np.True_)."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0][key] = value
    want = "True or False" if key == "differentiable" else "True, False or None"  # (None: torch picks)
    with pytest.raises(ck.CheckpointError, match=rf"^from_torch_optim: param_groups\[0\]\['{key}'\]: expected "
                                                 rf"{want}, got {re.escape(repr(value)[:20])}"):
        ck.from_torch_optim(sofx.adamw(), sd, params)
    for ok in (False, np.bool_(True), 1, None):
        sd["param_groups"][0][key] = ok
        if key == "differentiable" and type(ok) is not bool:
            with pytest.raises(ck.CheckpointError,
                               match=rf"\['differentiable'\]: expected True or False, got {re.escape(repr(ok))}"):
                ck.from_torch_optim(sofx.adamw(), sd, params)
        else:
            ck.from_torch_optim(sofx.adamw(), sd, params)


def test_a_saved_hparam_tensor_that_requires_grad_imports_as_its_number():
    """A saved lr held as a tensor that requires grad (torch.optim's ``differentiable=True`` with a tensor lr, a
    learned lr) is read as its number, as float() took it before the number checks; they refused it as "not a
    number" (autograd records its uses while grad mode is on)."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0]["lr"] = torch.tensor(0.02, dtype=torch.float64, requires_grad=True)
    sd["param_groups"][0]["betas"] = (torch.tensor([0.8], dtype=torch.float64, requires_grad=True), 0.99)
    hp = ck.from_torch_optim(sofx.adamw(), sd, params)[1]
    assert (hp.lr, hp.beta1, hp.beta2) == (0.02, 0.8, 0.99)


@pytest.mark.parametrize("value", [0.01 + 0j, torch.tensor(0.01 + 0j), np.complex128(0.01), True],
                         ids=["complex", "complex tensor", "numpy complex", "bool"])
def test_a_saved_hparam_that_is_no_real_number_is_refused_naming_it(value):
    """A complex lr (a Python, numpy or tensor one) passed the number check (a complex is a number) and float()
    raised a bare TypeError; a bool is no number either. A CheckpointError names the entry and the value."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0]["lr"] = value
    with pytest.raises(ck.CheckpointError, match=r"^from_torch_optim: param_groups\[0\]\['lr'\]: expected a number, "
                                                 r"got "):
        ck.from_torch_optim(sofx.adamw(), sd, params)


def test_to_torch_optim_numbers_the_parameters_in_the_params_order_given_params():
    """torch_param_groups numbers the leaves in the params tree's order, to_torch_optim in state.mu's: an
    OrderedDict keeps its order where a dict's keys are sorted, so a dict state of OrderedDict params (made from
    dict(params), or loaded with a dict template) exported the moments (and each group's lr) of 'a' for 'z', both
    of one shape, without a word. Given params=, the numbering is the params'; the state is matched by key."""
    from collections import OrderedDict
    adam = sofx.adam()
    g = torch.Generator().manual_seed(5)
    params = OrderedDict([("z", torch.randn(3, generator=g)), ("a", torch.randn(3, generator=g))])
    grads = OrderedDict((k, torch.randn(3, generator=g)) for k in params)
    hp = {"z": sofx.AdamHParams(lr=0.1), "a": sofx.AdamHParams(lr=0.001)}
    stepped, state, _ = adam.update(params, grads, adam.init(params), hp)
    dict_state = sofx.AdamState(dict(state.count), dict(state.mu), dict(state.nu))
    torch_params = [p.clone() for p in params.values()]
    groups = ck.torch_param_groups(adam, params, hp)
    assert [g["lr"] for g in groups] == [0.1, 0.001]
    torch_opt = torch.optim.Adam([{**grp, "params": [torch_params[0]] if grp["lr"] == 0.1 else [torch_params[1]]}
                                  for grp in groups])
    sd = ck.to_torch_optim(adam, dict_state, hp, params=params)
    assert [g["lr"] for g in sd["param_groups"]] == [0.1, 0.001]
    torch_opt.load_state_dict(sd)
    for key, p in zip(params, torch_params):
        assert torch.equal(torch_opt.state[p]["exp_avg"], state.mu[key])
        assert torch.equal(torch_opt.state[p]["exp_avg_sq"], state.nu[key])
    back, hp_back = ck.from_torch_optim(adam, sd, params, hp)
    assert all(torch.equal(back.mu[k], state.mu[k]) for k in params)
    assert {k: h.lr for k, h in hp_back.items()} == {"z": 0.1, "a": 0.001}
    # a state of other keys than the params' is refused naming the difference
    with pytest.raises(sofx.StructureError, match=r"state\.mu"):
        ck.to_torch_optim(adam, sofx.AdamState(dict_state.count, {"a": state.mu["a"]}, dict_state.nu), hp,
                          params=params)


def test_to_torch_optim_given_params_of_other_shapes_than_the_state_refuses_naming_the_leaf():
    """params= whose leaf has another shape than its moments (the params of another model of the same keys) was
    taken for its order only: the moments were exported for it, torch's load_state_dict took them, and its next
    step failed ('The size of tensor a (3) must match the size of tensor b (4)'), naming no parameter."""
    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(3), "b": torch.randn(2, 2)}
    state = adamw.update(params, {"a": torch.ones(3), "b": torch.ones(2, 2)}, adamw.init(params))[1]
    with pytest.raises(ck.CheckpointMismatchError, match=r"^to_torch_optim: params\['a'\] has shape \(4,\), its "
                                                         r"state.mu has shape \(3,\)"):
        ck.to_torch_optim(adamw, state, params={"a": torch.randn(4), "b": torch.randn(2, 2)})
    assert ck.to_torch_optim(adamw, state, params=tree.tree_map(lambda p: p.to("meta"), params))["state"]


def test_a_refused_import_into_ordered_dict_params_does_not_blame_sorted_dict_keys():
    """An OrderedDict keeps its keys' order (a model's state_dict() order): only a dict's keys are sorted. A
    refused import into OrderedDict params in the model's order (a state dict of another model) was explained as
    'the params tree's leaves are taken in optree's order, dict keys sorted' and one whose param_names put a leaf
    elsewhere as 'its flatten order sorts dict keys': neither is so; the order is named as it is."""
    from collections import OrderedDict
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    other = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    torch_opt = torch.optim.Adam(other.parameters())
    other(torch.randn(3, 4)).sum().backward()
    torch_opt.step()
    params = OrderedDict((k, v.detach().clone()) for k, v in model.named_parameters())
    with pytest.raises(ck.CheckpointMismatchError, match=r"expected shape \(8, 4\), got shape \(6, 4\)$"):
        ck.from_torch_optim(sofx.adam(), torch_opt.state_dict(), params)
    named = torch.optim.Adam(model.named_parameters())
    model(torch.randn(3, 4)).sum().backward()
    named.step()
    backwards = OrderedDict(reversed(params.items()))
    with pytest.raises(ck.CheckpointMismatchError, match=r"but the params tree puts params\['1\.bias'\] there \(its "
                                                         r"leaf order: dict keys sorted, an OrderedDict's as it "
                                                         r"holds them\)"):
        ck.from_torch_optim(sofx.adam(), named.state_dict(), backwards)


def _refused_at_import(key: str, value: Any, where: str) -> tuple[dict, dict]:
    """A torch.optim.AdamW state dict whose ``param_groups[0][key]`` is ``value``, and its params: ``from_torch_optim``
    refuses it (a CheckpointError matching ``where`` after the group), its state left as it was."""
    params, sd = _adamw_state_dict()
    sd["param_groups"][0][key] = value
    saved = copy.deepcopy(sd)
    with pytest.raises(ck.CheckpointError, match=rf"^from_torch_optim: param_groups\[0\]{where}"):
        ck.from_torch_optim(sofx.adamw(), sd, params)
    assert _equal(sd["state"], saved["state"])
    return params, sd


@pytest.mark.parametrize("eps", [np.float16(1e-8), np.array([1e-8], dtype=np.float16),
                                 torch.tensor(1e-8, dtype=torch.float16), torch.tensor([1e-42], dtype=torch.bfloat16)],
                         ids=["numpy", "numpy-array", "tensor", "bf16-tensor-1"])
def test_a_saved_half_precision_eps_that_holds_0_is_refused_saying_why(eps):
    """A saved eps held as a float16 or bfloat16 number that holds 0 (1e-8 in float16) was refused as "eps = 0.0 is
    invalid; expected eps > 0", a value the state dict never wrote; refused as update refuses it
    (sofx.adam.refuse_eps_held_as_0), naming the entry, the dtype and that it holds 0 there; nothing imported."""
    kind = "float16" if "float16" in str(eps.dtype) and "b" not in str(eps.dtype) else "bfloat16"
    _refused_at_import("eps", eps, rf"\['eps'\] = 0\.0 is invalid; expected eps > 0: given as a {kind} number .*"
                                   rf"which holds 0")


def test_a_group_member_named_by_a_numpy_integer_is_that_leaf_index():
    """Leaf indices taken from an array (np.argsort, np.int64) were refused as 'a leaf is named by its index or
    path, got np.int64(1)', which is one; they are read as the Python ints they are (as speculative_step's order
    takes them), out of range still refused, numpy's bools too."""
    import numpy as np

    adamw = sofx.adamw(lr=1e-2)
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    want = ck.torch_param_groups(adamw, params, groups=[[1], [0]])
    got = ck.torch_param_groups(adamw, params, groups=[list(np.array([1])), [np.int32(0)]])
    assert [[p.shape for p in g["params"]] for g in got] == [[p.shape for p in g["params"]] for g in want]
    with pytest.raises(ck.CheckpointError, match=r"groups: leaf index 2 is out of range"):
        ck.torch_param_groups(adamw, params, groups=[[np.int64(2)], [0]])
    with pytest.raises(ck.CheckpointError, match=r"groups: a leaf is named by its index or path"):
        ck.torch_param_groups(adamw, params, groups=[[np.True_], [0]])


@pytest.mark.parametrize("key, value, where, why", [
    ("lr", -0.1, r"\['lr'\]: lr = -0\.1 is invalid; expected lr >= 0", None),
    ("betas", (1.5, 0.9), r"\['betas'\]\[0\]: beta1 = 1\.5 is invalid; expected 0 <= beta1 < 1", None),
    ("betas", (0.9, 1.0), r"\['betas'\]\[1\]: beta2 = 1\.0 is invalid; expected 0 <= beta2 < 1", None),
    ("eps", 0.0, r"\['eps'\]: eps = 0\.0 is invalid; expected eps > 0", None),  # (torch takes eps=0)
    ("weight_decay", float("nan"), r"\['weight_decay'\]: weight_decay = nan is invalid", None),
    ("eps", 1e-50, r": eps = 1e-50 is beyond float32's range", "float64 leaves take it"),
    ("lr", 1e39, r": lr = 1e\+39 is beyond float32's range", "float64 leaves take it")])
def test_a_saved_hparam_no_step_can_take_is_refused_at_import_naming_its_group_and_key(key, value, where, why):
    """A saved lr, beta, eps or weight_decay out of its range (eps=0, which torch.optim takes; a beta of 1, a nan
    weight decay) or beyond float32's where a group's leaves are stepped in float32 was imported without a word and
    refused only at the first update, naming a params leaf and not the state dict's entry. It is refused at import
    naming the group, the key, the value and what was expected; nothing is imported. Where only float32 cannot hold
    it, float64 params take it."""
    params, sd = _refused_at_import(key, value, where)
    if why is not None:
        wide = tree.tree_map(lambda p: p.double(), params)
        hp = ck.from_torch_optim(sofx.adamw(), sd, wide)[1]
        assert getattr(hp, key) == value


@pytest.mark.parametrize("key, value, where", [
    ("lr", np.float16(1e-3), r"\['lr'\] = np\.float16\(0\.001\) is a float16 number"),
    ("betas", (torch.tensor(0.9, dtype=torch.float16), torch.tensor(0.999, dtype=torch.float16)),
     r"\['betas'\]\[0\] = tensor\(0\.8999, dtype=torch\.float16\) is a float16 number"),
    ("weight_decay", torch.tensor([0.1], dtype=torch.bfloat16), r"\['weight_decay'\] = tensor\(\[0\.1001\], "
                                                                 r"dtype=torch\.bfloat16\) is a bfloat16 number"),
    ("lr", np.array([1e-3], dtype=np.float16), r"\['lr'\] = np\.float16\(0\.001\) is a float16 number"),
    ("weight_decay", np.array(0.1, dtype=np.float16), r"\['weight_decay'\] = np\.float16\(0\.1\) is a float16 "
                                                       r"number")])
def test_a_saved_half_precision_hparam_is_refused_at_import_as_update_refuses_it(key, value, where):
    """A float16 or bfloat16 lr, beta or weight_decay in a torch.optim state dict (a LambdaLR whose lambda returns a
    numpy float16 makes the group's lr one), which torch.optim's for-loop step computes with in that precision, was
    imported as the Python float it holds: the run went on with another step than torch's, where update, the offload
    facade and its load_state_dict refuse such a value. Refused at import naming the group and key, nothing
    imported (a numpy float16 array of one element too, which was read as its float where a numpy float16 was
    refused); a float16 eps (torch adds it to a float32 tensor) is taken, as update takes it."""
    params, sd = _refused_at_import(key, value, where)
    _, sd = _adamw_state_dict()
    sd["param_groups"][0]["eps"] = np.float16(1e-3)
    assert ck.from_torch_optim(sofx.adamw(), sd, params)[1].eps == float(np.float16(1e-3))


@pytest.mark.parametrize("hp, where", [
    (sofx.AdamHParams(lr=-0.1), r"lr = -0\.1 is invalid; expected lr >= 0"),
    (sofx.AdamHParams(beta1=1.0), r"beta1 = 1\.0 is invalid; expected 0 <= beta1 < 1"),
    (sofx.AdamHParams(weight_decay=float("nan")), r"weight_decay = nan is invalid")])
def test_hparams_no_step_can_take_are_refused_on_export_naming_them(hp, where):
    """to_torch_optim (and torch_param_groups) exported an lr of -0.1, a beta1 of 1 or a nan weight decay into the
    torch groups, which from_torch_optim refuses to import back and no update steps with: refused on export in
    update's words, naming the leaf."""
    params = _params()
    adamw = sofx.adamw()
    state = _sofx_steps(adamw, params, adamw.init(params), None, 0, 1)[1]
    with pytest.raises(ck.CheckpointError, match=rf"^hparams for params\['dec'\]\[0\]: {where}"):
        ck.to_torch_optim(adamw, state, {"enc": sofx.AdamHParams(), "dec": hp})
    with pytest.raises(ck.CheckpointError, match=rf"^hparams for params\['dec'\]\[0\]: {where}"):
        ck.torch_param_groups(adamw, params, {"enc": sofx.AdamHParams(), "dec": hp})


def test_hparams_float32_cannot_hold_are_refused_on_export_where_a_leaf_is_stepped_in_float32():
    """An eps of 1e-50 (0 in float32) for float32 leaves was exported, and from_torch_optim refused it back for
    them ('beyond float32's range'); refused on export naming the leaf. float64 leaves take it both ways."""
    adamw = sofx.adamw()
    hp = {"enc": sofx.AdamHParams(), "dec": sofx.AdamHParams(eps=1e-50)}
    for params in (_params(), tree.tree_map(lambda p: p.double(), _params())):
        state = adamw.init(params)
        if params["dec"][0].dtype == torch.float64:
            sd = ck.to_torch_optim(adamw, state, hp)
            assert ck.from_torch_optim(adamw, sd, params, hp)[1]["dec"].eps == 1e-50
            assert ck.torch_param_groups(adamw, params, hp)[0]["eps"] == 1e-50  # (dec first: keys sorted)
            continue
        for call in (lambda: ck.to_torch_optim(adamw, state, hp), lambda: ck.to_torch_optim(adamw, state, hp,
                                                                                            params=params),
                     lambda: ck.torch_param_groups(adamw, params, hp)):
            with pytest.raises(ck.CheckpointError, match=r"^hparams for params\['dec'\]\[0\]: eps = 1e-50 is "
                                                         r"beyond float32's range"):
                call()



def test_an_export_without_params_takes_hparams_of_float64_params_whose_state_dtype_is_float32():
    """Without ``params=`` the moments stood for the params' dtype, which ``state_dtype`` sets apart from them: an
    eps of 1e-50 that update steps float64 params with (float32 moments, float64 arithmetic) was refused as 'stepped
    in float32'. The moments tell nothing there; the import checks the params."""
    opt = sofx.adamw(state_dtype=torch.float32)
    params = tree.tree_map(lambda p: p.double(), _params())
    hp = {"enc": sofx.AdamHParams(), "dec": sofx.AdamHParams(eps=1e-50)}
    state = opt.update(params, tree.tree_map(torch.ones_like, params), opt.init(params), hp)[1]
    sd = ck.to_torch_optim(opt, state, hp)
    assert ck.from_torch_optim(opt, sd, params, hp)[1]["dec"].eps == 1e-50

def _one_cycle(torch_opt):
    return torch.optim.lr_scheduler.OneCycleLR(torch_opt, max_lr=0.05, total_steps=8, cycle_momentum=True,
                                               base_momentum=0.8, max_momentum=0.9)


@pytest.mark.parametrize("like", ["optimizer", "state_dict"])
def test_a_torch_scheduler_goes_on_after_an_export_that_keeps_the_torch_groups_other_entries(like):
    """torch's load_state_dict replaces each param group by the saved one: to_torch_optim's groups held no
    'initial_lr', 'max_lr', 'min_lr', 'base_momentum', 'max_momentum' (what a torch lr scheduler writes into the
    groups it drives), so a OneCycleLR over the torch optimizer raised KeyError: 'initial_lr' at its next step.
    ``like=`` (the torch optimizer, its state_dict() or its param_groups; the one from_torch_optim imported, for a
    round trip) keeps its groups' entries but the hparams and Adam's options, which are the export's: a torch run
    with OneCycleLR (its betas cycled too) taken into sofx and back goes on as the uninterrupted run, bit for bit."""
    opt = sofx.adamw(weight_decay=0.1)
    ref = _params()
    ref_opt = torch.optim.AdamW(ck.torch_param_groups(opt, ref), foreach=False)
    ref_sched = _one_cycle(ref_opt)
    for step in range(5):
        _torch_steps(ref_opt, ref, step, step + 1)
        ref_sched.step()
    params = _params()
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(opt, params), foreach=False)
    sched = _one_cycle(torch_opt)
    for step in range(2):
        _torch_steps(torch_opt, params, step, step + 1)
        sched.step()
    saved, saved_sched = torch_opt.state_dict(), sched.state_dict()
    state, hparams = ck.from_torch_optim(opt, saved, params)
    params = _clone(params)
    back = torch.optim.AdamW(ck.torch_param_groups(opt, params, hparams), foreach=False)
    back_sched = _one_cycle(back)
    back_sched.load_state_dict(saved_sched)
    exported = ck.to_torch_optim(opt, state, hparams, like=back if like == "optimizer" else saved)
    with pytest.raises(KeyError, match="initial_lr"):  # (without like=: torch's groups lose the scheduler's entries)
        probe = torch.optim.AdamW(ck.torch_param_groups(opt, _clone(params), hparams))
        probe_sched = _one_cycle(probe)
        probe.load_state_dict(ck.to_torch_optim(opt, state, hparams))
        with warnings.catch_warnings():  # ("lr_scheduler.step() before optimizer.step()")
            warnings.simplefilter("ignore", UserWarning)
            probe_sched.step()
    group = exported["param_groups"][0]
    assert (group["lr"], group["betas"]) == (hparams.lr, (hparams.beta1, hparams.beta2))
    assert group["max_lr"] == 0.05 and group["max_momentum"] == 0.9 and group["foreach"] is False
    back.load_state_dict(exported)
    for step in range(2, 5):
        _torch_steps(back, params, step, step + 1)
        back_sched.step()
    assert _equal(params, ref)
    assert back.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]


def test_a_like_whose_groups_do_not_match_the_export_is_refused_naming_them():
    opt = sofx.adamw()
    params = _params()
    state = opt.init(params)
    two = {"enc": sofx.AdamHParams(lr=3e-2), "dec": sofx.AdamHParams()}
    torch_opt = torch.optim.AdamW(ck.torch_param_groups(opt, params))
    with pytest.raises(ck.CheckpointMismatchError, match=r"to_torch_optim: like has 1 param groups, the export 2"):
        ck.to_torch_optim(opt, state, two, like=torch_opt)
    other = torch.optim.AdamW(ck.torch_param_groups(opt, params, two))
    other.param_groups[1]["params"] = other.param_groups[1]["params"][:1]
    with pytest.raises(ck.CheckpointMismatchError, match=r"to_torch_optim: like's param_groups\[1\] has 1 "
                                                         r"parameters, the export's 2"):
        ck.to_torch_optim(opt, state, two, like=other)
    with pytest.raises(ck.CheckpointError, match=r"to_torch_optim: like must be a torch optimizer, its "
                                                 r"state_dict\(\) or its param_groups, got a str"):
        ck.to_torch_optim(opt, state, like="AdamW")


@pytest.mark.parametrize("group", [{"params": 5}, {"params": "ab"}, {"lr": 1e-3}], ids=["int", "str", "none"])
def test_a_like_group_without_a_params_list_is_refused_naming_it(group):
    """A ``like`` group whose ``params`` is no list (an int, a str) or that has none was taken and its entries kept,
    its size never checked against the export's group (torch's load_state_dict would refuse that state dict, or
    none of it matches the optimizer it is for). Refused naming the group, as from_torch_optim refuses such a group
    of its state dict; nothing exported."""
    opt = sofx.adamw()
    params = {"a": torch.randn(2), "b": torch.randn(3)}
    state = opt.init(params)
    for like in ([group], {"state": {}, "param_groups": [group]}):
        with pytest.raises(ck.CheckpointError, match=r"^to_torch_optim: like's param_groups\[0\] has no 'params' "
                                                     r"list \((got|it has no 'params')"):
            ck.to_torch_optim(opt, state, like=like)
    ck.to_torch_optim(opt, state, like=[{"params": (0, 1), "foreach": None}])


@pytest.mark.parametrize("key, value", [("foreach", "False"), ("fused", 0.0), ("capturable", "no"),
                                        ("differentiable", None), ("differentiable", 1)])
def test_a_like_group_option_that_is_no_flag_is_refused_naming_it(key, value):
    """``like``'s foreach, fused, capturable and differentiable are kept in the export, which torch's step reads
    (``if group["foreach"]:`` takes "False" as on; differentiable None or 1 a TypeError in set_grad_enabled): a value
    that is no flag was handed on without a word. Refused as from_torch_optim refuses it in a state dict
    (sofx.adam.torch_non_flag), naming like's group, the option and the value; amsgrad, maximize and
    decoupled_weight_decay are the export's own, whatever like holds."""
    opt = sofx.adamw()
    params = {"a": torch.randn(2)}
    state = opt.init(params)
    want = "True or False" if key == "differentiable" else "True, False or None"  # (None: torch picks)
    with pytest.raises(ck.CheckpointError, match=rf"^to_torch_optim: like's param_groups\[0\]\['{key}'\]: expected "
                                                 rf"{want}, got {re.escape(repr(value))}"):
        ck.to_torch_optim(opt, state, like=[{"params": [0], key: value}])
    kept = ck.to_torch_optim(opt, state, like=[{"params": [0], key: False, "amsgrad": "no"}])["param_groups"][0]
    assert kept[key] is False and kept["amsgrad"] is False


def test_an_older_state_dict_without_decoupled_weight_decay_says_which_decay_it_imports_as():
    """torch.optim before ``decoupled_weight_decay`` wrote the same group keys for Adam and AdamW: such a state
    dict imported into ``sofx.adam()`` or ``sofx.adamw()`` alike, the other decay taken without a word where its
    weight decay is not 0. The import warns, naming the group, the decay it assumed and how to say which; with
    the key, or a weight decay of 0 (both decays the same step), it says nothing."""
    params, sd = _adamw_state_dict()
    older = copy.deepcopy(sd)
    del older["param_groups"][0]["decoupled_weight_decay"]
    for opt, assumed in ((sofx.adamw(), r"decoupled \(torch\.optim\.AdamW's\)"), (sofx.adam(), r"L2 \(torch\.optim"
                                                                                               r"\.Adam's\)")):
        with pytest.warns(UserWarning, match=rf"^from_torch_optim: param_groups\[0\] has weight_decay=0\.01 and no "
                                             rf"'decoupled_weight_decay'.*imported as {assumed} weight decay"):
            ck.from_torch_optim(opt, older, params)
    older["param_groups"][0]["weight_decay"] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.from_torch_optim(sofx.adam(), older, params)
        ck.from_torch_optim(sofx.adamw(), sd, params)


def test_moments_beyond_the_range_of_the_dtype_they_are_cast_to_are_refused_naming_the_element():
    """torch.optim's ``load_state_dict`` casts the moments to their parameter's dtype: a float32 (or bfloat16)
    state of float16 params holding a second moment beyond 65504 (a gradient of 300 makes one) was exported and
    loaded as inf, the parameter then frozen without a word; ``from_torch_optim`` into a float16 ``state_dtype``
    cast torch's float32 moments as well. Both refused, naming the element, its value and the dtype; without
    ``params=`` the export cannot know the params' dtype (a state_dtype's moments stand for no dtype)."""
    for state_dtype in (torch.float32, torch.bfloat16):
        opt = sofx.adamw(lr=1e-3, state_dtype=state_dtype)
        params = {"b": torch.ones(2, dtype=torch.float16), "w": torch.ones(3, dtype=torch.float16)}
        grads = {"b": torch.ones(2, dtype=torch.float16), "w": torch.tensor([1.0, 6e4, 2.0], dtype=torch.float16)}
        params, state, _ = opt.update(params, grads, opt.init(params))
        with pytest.raises(UnsupportedError, match=r"^to_torch_optim: state\.nu\['w'\]\[1\] = 36[0-9.]+ is beyond "
                                                   r"float16's range \(largest 65504\.0\), params\['w'\]'s dtype"):
            ck.to_torch_optim(opt, state, params=params)
        torch_params = [torch.nn.Parameter(params[k].clone()) for k in ("b", "w")]
        torch_opt = torch.optim.AdamW(torch_params)
        torch_opt.load_state_dict(ck.to_torch_optim(opt, state))  # (no params=: not known, not checked)
        assert torch_opt.state[torch_params[1]]["exp_avg_sq"][1].isinf()  # (what torch makes of it)
    params, sd = _adamw_state_dict()
    sd["state"][3]["exp_avg_sq"][1, 2] = 1e7
    with pytest.raises(UnsupportedError, match=r"^from_torch_optim: state\[3\]\['exp_avg_sq'\] for "
                                               r"params\['enc'\]\['w'\]\[1, 2\] = 10000000\.0 is beyond float16's "
                                               r"range \(largest 65504\.0\), the optimizer's state_dtype"):
        ck.from_torch_optim(sofx.adamw(state_dtype=torch.float16), sd, params)
    ck.from_torch_optim(sofx.adamw(state_dtype=torch.bfloat16), sd, params)
    sd["state"][3]["exp_avg_sq"][1, 2] = 65519.0  # (the cast rounds it to float16's largest, 65504: taken)
    state, _ = ck.from_torch_optim(sofx.adamw(state_dtype=torch.float16), sd, params)
    assert state.nu["enc"]["w"][1, 2].item() == 65504.0


def test_an_l2_export_like_a_torch_adamw_is_refused_saying_that_adamw_would_decouple_its_decay():
    """``torch.optim.AdamW.load_state_dict`` makes every group's weight decay decoupled (its ``__setstate__``),
    whatever the state dict says: ``to_torch_optim(sofx.adam(), ..., like=torch_adamw)`` exported
    ``decoupled_weight_decay=False``, and the torch optimizer went on as AdamW without a word (0.6e-3 off sofx.adam's
    next step here). Refused, naming the torch optimizer to load it into; a torch.optim.Adam takes it, so does AdamW
    where no weight decay is exported (the two the same step), and sofx.adamw's export loads into either."""
    params = {"w": torch.randn(4, generator=torch.Generator().manual_seed(0))}
    grads = {"w": torch.randn(4, generator=torch.Generator().manual_seed(1))}
    adam = sofx.adam(lr=1e-2, weight_decay=0.1)
    state = adam.update(params, grads, adam.init(params))[1]
    torch_adamw = torch.optim.AdamW([torch.nn.Parameter(params["w"].clone())], lr=1e-2, weight_decay=0.1)
    with pytest.raises(UnsupportedError, match=r"^to_torch_optim: like is a torch\.optim\.AdamW, whose "
                                               r"load_state_dict makes every group's weight decay decoupled.*"
                                               r"torch\.optim\.Adam"):
        ck.to_torch_optim(adam, state, like=torch_adamw)
    torch_adam = torch.optim.Adam([torch.nn.Parameter(params["w"].clone())], lr=1e-2, weight_decay=0.1)
    torch_adam.load_state_dict(ck.to_torch_optim(adam, state, like=torch_adam))
    assert torch_adam.param_groups[0]["decoupled_weight_decay"] is False
    torch_adamw.load_state_dict(ck.to_torch_optim(adam, state, sofx.AdamHParams(weight_decay=0.0), like=torch_adamw))
    adamw = sofx.adamw(lr=1e-2, weight_decay=0.1)
    for like in (torch_adam, torch_adamw):
        like.load_state_dict(ck.to_torch_optim(adamw, adamw.update(params, grads, adamw.init(params))[1], like=like))
        assert like.param_groups[0]["decoupled_weight_decay"] is True


def test_an_l2_export_like_a_decoupled_state_dict_is_refused_naming_its_group():
    """A ``like=`` given as a state dict or param groups said nothing of the torch class it is for, so
    ``to_torch_optim(sofx.adam(), ..., like=torch_adamw.state_dict())`` was taken, and the AdamW loading it went on
    decoupled without a word. torch >= 2.x writes ``decoupled_weight_decay`` into every group: a like= group that
    says True (AdamW's, or an Adam made decoupled) over an exported group with weight decay is refused, naming it;
    one that says False, a group without decay, or sofx.adamw's export are taken."""
    params = {"w": torch.randn(4, generator=torch.Generator().manual_seed(0))}
    grads = {"w": torch.randn(4, generator=torch.Generator().manual_seed(1))}
    adam = sofx.adam(lr=1e-2, weight_decay=0.1)
    state = adam.update(params, grads, adam.init(params))[1]
    torch_adamw = torch.optim.AdamW([torch.nn.Parameter(params["w"].clone())], lr=1e-2, weight_decay=0.1)
    for like in (torch_adamw.state_dict(), torch_adamw.param_groups):
        with pytest.raises(UnsupportedError, match=r"^to_torch_optim: like's param_groups\[0\] has "
                                                   r"decoupled_weight_decay=True.*torch\.optim\.Adam"):
            ck.to_torch_optim(adam, state, like=like)
    torch_adam = torch.optim.Adam([torch.nn.Parameter(params["w"].clone())], lr=1e-2, weight_decay=0.1)
    torch_adam.load_state_dict(ck.to_torch_optim(adam, state, like=torch_adam.state_dict()))
    assert torch_adam.param_groups[0]["decoupled_weight_decay"] is False
    ck.to_torch_optim(adam, state, sofx.AdamHParams(weight_decay=0.0), like=torch_adamw.state_dict())
    adamw = sofx.adamw(lr=1e-2, weight_decay=0.1)
    ck.to_torch_optim(adamw, adamw.update(params, grads, adamw.init(params))[1], like=torch_adam.state_dict())


@pytest.mark.parametrize("like", ["optimizer", "state_dict"])
def test_an_adamw_export_goes_on_in_a_decoupled_torch_adam_and_back_in_sofx_bitwise(like):
    """torch >= 2.x's ``Adam(decoupled_weight_decay=True)`` is AdamW (``torch.optim.AdamW`` is that Adam): sofx.adamw's
    export like= it (the optimizer, or its state_dict(), whose groups say decoupled_weight_decay=True as an AdamW's
    do) is taken, and that torch Adam steps on as sofx.adamw, bit for bit, in two groups of other hparams; its
    state dict imports back into sofx.adamw, which steps on as the uninterrupted run. (sofx.adam's L2 export like=
    such a state dict stays refused: a state dict does not say whether an Adam or an AdamW loads it, and AdamW's
    load_state_dict decouples every group's decay.)"""
    make, _, hp = CASES["adamw_two_groups"]
    opt = make()
    ref_params, ref_state = _sofx_steps(opt, _params(), opt.init(_params()), hp, 0, N + M)
    params, state = _sofx_steps(opt, _params(), opt.init(_params()), hp, 0, N)
    torch_opt = torch.optim.Adam(ck.torch_param_groups(opt, params, hp), decoupled_weight_decay=True)
    sd = ck.to_torch_optim(opt, state, hp, like=torch_opt if like == "optimizer" else torch_opt.state_dict())
    assert [g["decoupled_weight_decay"] for g in sd["param_groups"]] == [True, True]
    torch_opt.load_state_dict(sd)
    _torch_steps(torch_opt, params, N, N + 2)
    state, hparams = ck.from_torch_optim(opt, torch_opt.state_dict(), params, hp)
    params, state = _sofx_steps(opt, _clone(params), state, hparams, N + 2, N + M)
    assert _equal(params, ref_params)
    assert _equal(state, ref_state)


def test_an_export_like_a_torch_optimizer_whose_param_names_put_a_leaf_elsewhere_is_refused_naming_it():
    """A torch optimizer made from named_parameters() keeps each group's param_names, and like= carries them into the
    export; but the export numbers the leaves in the params tree's flatten order (dict keys sorted: k, q, v), not the
    model's (q, k, v): torch's load_state_dict put the projections' moments, all of one shape, into each other's
    parameters without a word, and the names said so. A name of another leaf than the one at its position is
    refused, naming both (as from_torch_optim refuses it); with groups= in the optimizer's order the export loads
    each moment into its own parameter."""
    adamw = sofx.adamw(lr=1e-2)
    model = _Attention()
    torch_opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) for i, (k, v) in
             enumerate(params.items())}
    state = adamw.update(params, grads, adamw.init(params))[1]
    for like in (torch_opt, torch_opt.state_dict()):
        with pytest.raises(ck.CheckpointMismatchError, match=r"^to_torch_optim: like's param_groups\[0\]\['param_"
                                                             r"names'\]\[0\] is 'q.weight', the params leaf "
                                                             r"params\['q.weight'\], but the export puts "
                                                             r"params\['k.weight'\] there"):
            ck.to_torch_optim(adamw, state, like=like)
    groups = [g["param_names"] for g in torch_opt.state_dict()["param_groups"]]
    torch_opt.load_state_dict(ck.to_torch_optim(adamw, state, groups=groups, like=torch_opt))
    for name, p in model.named_parameters():
        assert torch.equal(torch_opt.state[p]["exp_avg"], state.mu[name])
    foreign = [{**torch_opt.param_groups[0], "param_names": [f"module.{n}" for n in groups[0]]}]
    ck.to_torch_optim(adamw, state, like=foreign)  # (names of no leaf say nothing: the order is the caller's)


def test_a_lazy_modules_uninitialized_parameter_is_refused_naming_the_leaf():
    """A lazy module's parameters before its first forward (no shape, no data) as from_torch_optim's params or
    to_torch_optim's params= raised torch's ValueError or RuntimeError ('Attempted to use an uninitialized
    parameter', 'Can't access the shape'), naming no leaf: a CheckpointError naming the function and the leaf."""
    opt = sofx.adamw()
    real = dict(torch.nn.Linear(3, 2).named_parameters())
    state = opt.update(real, tree.tree_map(torch.ones_like, real), opt.init(real))[1]
    lazy = dict(torch.nn.LazyLinear(2).named_parameters())
    for who, call in (("from_torch_optim", lambda: ck.from_torch_optim(opt, ck.to_torch_optim(opt, state), lazy)),
                      ("to_torch_optim", lambda: ck.to_torch_optim(opt, state, params=lazy))):
        with pytest.raises(ck.CheckpointError, match=rf"^{who}: params\['bias'\] is an uninitialized parameter \(a "
                                                     r"lazy module's"):
            call()


@pytest.mark.skipif(np.finfo(np.longdouble).eps == np.finfo(np.float64).eps, reason="longdouble is a double here")
def test_a_longdouble_hparam_no_float_holds_is_refused_as_the_checkpoint_codec_refuses_it():
    """A saved group's numpy longdouble lr or beta (a scheduler's arithmetic in it, which torch's step computed
    with) that no Python float holds exactly was rounded to the nearest float by from_torch_optim without a word,
    where sofx.checkpoint's codec refuses to store it. A CheckpointError names the entry and the value; a
    longdouble a float holds exactly (0.5) imports as that float."""
    third = np.longdouble(1) / np.longdouble(3)
    assert float(third) != third
    params, sd = _adamw_state_dict()
    sd["param_groups"][0]["lr"] = third
    with pytest.raises(ck.CheckpointError, match=r"^from_torch_optim: param_groups\[0\]\['lr'\]: a numpy\.longdouble "
                                                 r".* that no Python float holds exactly"):
        ck.from_torch_optim(sofx.adamw(), sd, params)
    sd["param_groups"][0]["betas"] = (np.array([third]), 0.999)
    sd["param_groups"][0]["lr"] = 0.01
    with pytest.raises(ck.CheckpointError, match=r"^from_torch_optim: param_groups\[0\]\['betas'\]\[0\]: a "
                                                 r"numpy\.longdouble"):
        ck.from_torch_optim(sofx.adamw(), sd, params)
    sd["param_groups"][0]["betas"] = (0.9, 0.999)
    sd["param_groups"][0]["lr"] = np.longdouble(0.5)
    assert ck.from_torch_optim(sofx.adamw(), sd, params)[1].lr == 0.5


@pytest.mark.parametrize("betas", [{0.999, 0.9}, {0.9: 0, 0.999: 1}, "ab", iter([0.9, 0.999])],
                         ids=["set", "dict", "str", "iterator"])
def test_saved_betas_that_are_no_pair_are_refused_naming_the_entry(betas):
    """A saved group's betas that are no pair were taken apart by ``b1, b2 = betas``: a set of two numbers imported
    in its iteration order ({0.999, 0.9}: beta1=0.999, beta2=0.9, without a word), a dict's keys and an iterator's
    items were taken, a two-character str refused as betas[0] 'a' ; a tuple or list, or a tensor or numpy array
    of two elements (torch.optim's forms), else refused naming the entry."""
    _refused_at_import("betas", betas, r"\['betas'\]: expected a pair \(beta1, beta2\)")


@pytest.mark.parametrize("change", ["no eps", "one beta"])
def test_a_group_without_an_hparam_is_refused_naming_from_torch_optim(change):
    """A saved group without lr, betas, eps or weight_decay, or with betas of one element, was refused as
    'param_groups[0]: expected lr, betas (a pair), ...', the only refusal of from_torch_optim's not naming it ; the
    message starts with 'from_torch_optim: ' as its others do."""
    params, sd = _adamw_state_dict()
    if change == "no eps":
        del sd["param_groups"][0]["eps"]
    else:
        sd["param_groups"][0]["betas"] = (0.9,)
    with pytest.raises(ck.CheckpointError, match=r"^from_torch_optim: param_groups\[0\]: expected lr, betas"):
        ck.from_torch_optim(sofx.adamw(), sd, params)


def test_torch_param_groups_refuses_what_is_no_sofx_adam_or_a_leaf_that_is_no_tensor():
    """torch_param_groups(3, params) raised Python's bare AttributeError ("'int' object has no attribute
    'resolve_hparams'"), and of an optimizer without bias correction it made groups torch's Adam steps with bias
    correction, where to_torch_optim refuses both; a leaf that is no tensor went into the groups (torch.optim then
    refused "one of the params is int", naming no leaf). Each is refused, naming what was given."""
    params = _params()
    with pytest.raises(ck.CheckpointError, match=r"^torch_param_groups: opt must be a sofx Adam .*got int"):
        ck.torch_param_groups(3, params)
    with pytest.raises(UnsupportedError, match=r"^torch_param_groups: torch\.optim\.Adam always applies bias "
                                               r"correction"):
        ck.torch_param_groups(sofx.adamw(bias_correction=False), params)
    with pytest.raises(ck.CheckpointError, match=r"^torch_param_groups: params\['x'\]: expected a tensor \(a "
                                                 r"parameter of the torch optimizer\), got int"):
        ck.torch_param_groups(sofx.adamw(), {**params, "x": 3})
