"""``param_copies``: second buffers that receive the new parameters of update, undo and undo_redo.

Every call with copies gives the same results as without them, and each copy
then holds its leaf's new parameters cast to its dtype, whatever the undo
strategy (algebraic, param_snapshot, snapshot), for leaves without a gradient
too; bad copies are refused before anything changes.
"""

from __future__ import annotations

import pytest
import torch

import sofx
from sofx.errors import LeafError, StructureError

from helpers import trees_equal

BACKENDS = ["reference", "cpu", "cpu_fast"]


def _tree(rng: torch.Generator, dtype: torch.dtype) -> dict:
    return {"w": torch.randn(5000, generator=rng).to(dtype), "b": [torch.randn(7, generator=rng).to(dtype),
                                                                  torch.randn(3, 4, generator=rng).to(dtype)]}


def _copies(params: dict, dtype: torch.dtype, skip_b0: bool = False) -> dict:
    def like(t):
        return torch.full(t.shape, 7.0, dtype=dtype)

    return {"w": like(params["w"]), "b": [None if skip_b0 else like(params["b"][0]), like(params["b"][1])]}


def _clone(tree):
    return sofx.tree.tree_map(lambda t: t.clone(), tree)


def _check_copies(copies: dict, params: dict) -> None:
    for c, p in ((copies["w"], params["w"]), (copies["b"][1], params["b"][1])):
        assert torch.equal(c, p.to(c.dtype))
    if copies["b"][0] is not None:
        assert torch.equal(copies["b"][0], params["b"][0].to(copies["b"][0].dtype))


@pytest.mark.parametrize("undo", ["auto", "exact"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_copies_hold_the_new_params_and_change_nothing_else(backend, param_dtype, undo, rng):
    # fp32 + auto: algebraic; bf16 + auto: param_snapshot; exact: snapshot
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, undo=undo, backend=backend, state_dtype=torch.float32)
    params = _tree(rng, param_dtype)
    grads = _tree(rng, param_dtype)
    grads["b"][0] = None  # no gradient: the copy gets the unchanged parameter
    new_grads = _tree(rng, param_dtype)
    state = opt.init(params)
    hp = sofx.AdamHParams(lr=3e-3)
    for copy_dtype in (torch.float32, torch.bfloat16, torch.float64):
        copies = _copies(params, copy_dtype)
        p_plain, s_plain, r_plain = opt.update(_clone(params), grads, _clone(state), hp, grad_scale=0.5)
        p1, s1, r1 = opt.update(_clone(params), grads, _clone(state), hp, grad_scale=0.5, param_copies=copies)
        assert trees_equal(p1, p_plain) and trees_equal(s1, s_plain)
        _check_copies(copies, p1)

        want = opt.undo_redo(_clone(p_plain), _clone(s_plain), r_plain, new_grads, hp, grad_scale=0.25)
        got = opt.undo_redo(p1, s1, r1, new_grads, hp, grad_scale=0.25, param_copies=copies)
        assert trees_equal(got[0], want[0]) and trees_equal(got[1], want[1])
        _check_copies(copies, got[0])

        undone_want = opt.undo(_clone(want[0]), _clone(want[1]), want[2])
        undone = opt.undo(got[0], got[1], got[2], param_copies=copies)
        assert trees_equal(undone[0], undone_want[0]) and trees_equal(undone[1], undone_want[1])
        _check_copies(copies, undone[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_update_writes_the_copies_in_place(backend, rng):
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    params, grads = _tree(rng, torch.float32), _tree(rng, torch.float32)
    state = opt.init(params)
    copies = _copies(params, torch.bfloat16, skip_b0=True)
    before = copies["b"][1].data_ptr()
    new, _, _ = opt.update(params, grads, state, donate=True, param_copies=copies)
    assert new["w"] is params["w"] and copies["b"][1].data_ptr() == before
    _check_copies(copies, new)


def test_bad_copies_are_refused_and_change_nothing(rng):
    opt = sofx.adamw(lr=1e-2)
    params, grads = _tree(rng, torch.float32), _tree(rng, torch.float32)
    state = opt.init(params)
    saved = _clone(params), _clone(state)
    good = _copies(params, torch.float32)
    bad_shape = {**good, "w": torch.zeros(4999)}
    with pytest.raises(LeafError, match=r"param_copies\['w'\]: expected shape \(5000,\)"):
        opt.update(params, grads, state, donate=True, param_copies=bad_shape)
    with pytest.raises(LeafError, match=r"param_copies\['b'\]\[1\]: expected a floating-point tensor"):
        opt.update(params, grads, state, donate=True,
                   param_copies={**good, "b": [None, torch.zeros(3, 4, dtype=torch.int32)]})
    with pytest.raises(LeafError, match=r"param_copies\['w'\]: expected a tensor or None, got list"):
        opt.update(params, grads, state, donate=True, param_copies={**good, "w": [1.0]})
    with pytest.raises(StructureError, match="param_copies"):
        opt.update(params, grads, state, donate=True, param_copies={"w": good["w"]})
    assert trees_equal(params, saved[0]) and trees_equal(state, saved[1])
    assert (good["w"] == 7).all()
