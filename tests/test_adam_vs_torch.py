"""sofx.adam / sofx.adamw equal torch.optim.Adam / AdamW step by step (torch.optim's own discipline).

Random nested pytrees with a zero-size leaf, a leaf whose gradient is None on
some steps, a frozen-then-unfrozen leaf; hyperparameters changed every step;
two param groups given as an AdamHParams prefix tree. Every parameter and
every state tensor is compared after every step.
"""

from __future__ import annotations

import math

import pytest
import torch

import sofx
from sofx import tree

from helpers import rand_tree

STEPS = 24


def _hparams_at(step: int) -> tuple[float, float, float, float, float]:
    lr = 1e-2 * (1 + 0.5 * torch.sin(torch.tensor(step * 0.7)).item())
    beta1 = 0.85 + 0.1 * ((step * 7) % 5) / 5
    beta2 = 0.99 + 0.009 * ((step * 3) % 4) / 4
    eps = 1e-8 * (1 + step % 3)
    wd = 0.05 * (step % 4)  # includes steps with weight_decay == 0
    return lr, beta1, beta2, eps, wd


def _grad_present(path_index: int, step: int) -> bool:
    if path_index == 1:  # frozen for the first 6 steps, then trained
        return step > 6
    if path_index == 3:  # no gradient on every third step
        return step % 3 != 0
    return True


def _run(decoupled: bool, dtype: torch.dtype, backend: str, bias_gen_seed: int = 0):
    gen = torch.Generator().manual_seed(bias_gen_seed)
    params = rand_tree(gen, dtype)
    leaves, spec = tree.flatten(params)
    paths = tree.leaf_paths(spec)
    # Two groups: everything under "layers" is group 1 (its own hparams), the rest group 0.
    group_of = [1 if "['layers']" in p else 0 for p in paths]

    torch_params = [torch.nn.Parameter(t.clone()) for t in leaves]
    groups = [{"params": [tp for tp, g in zip(torch_params, group_of) if g == k]} for k in (0, 1)]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    torch_opt = cls(groups, lr=1e-3, foreach=False)

    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-3, backend=backend)
    state = opt.init(params)

    for step in range(1, STEPS + 1):
        hp0 = _hparams_at(step)
        hp1 = _hparams_at(step + 11)
        for group, hp in zip(torch_opt.param_groups, (hp0, hp1)):
            group.update(lr=hp[0], betas=(hp[1], hp[2]), eps=hp[3], weight_decay=hp[4])
        hparams = {
            "embed": sofx.AdamHParams(*hp0), "empty": sofx.AdamHParams(*hp0),
            "head": sofx.AdamHParams(*hp0), "layers": sofx.AdamHParams(*hp1),
        }
        grads_flat = []
        for i, (tp, leaf) in enumerate(zip(torch_params, leaves)):
            if _grad_present(i, step):
                g = torch.randn(leaf.shape, generator=gen, dtype=torch.float64).to(dtype)
                tp.grad = g.clone()
                grads_flat.append(g)
            else:
                tp.grad = None
                grads_flat.append(None)
        torch_opt.step()
        params, state, _ = opt.update(params, tree.unflatten(spec, grads_flat), state, hparams)
        yield step, spec, params, state, torch_params, torch_opt


def _compare(step, spec, params, state, torch_params, torch_opt, rtol, atol):
    p_leaves = tree.flatten(params)[0]
    counts = tree.flatten_up_to(spec, state.count)
    mus = tree.flatten_up_to(spec, state.mu)
    nus = tree.flatten_up_to(spec, state.nu)
    for path, p, c, m, v, tp in zip(tree.leaf_paths(spec), p_leaves, counts, mus, nus, torch_params):
        where = f"step {step}, {path}"
        torch.testing.assert_close(p, tp.detach(), rtol=rtol, atol=atol, msg=lambda s: f"{where}: param {s}")
        st = torch_opt.state.get(tp)
        if not st:
            assert int(c) == 0, where
            assert torch.count_nonzero(m) == 0 and torch.count_nonzero(v) == 0, where
            continue
        assert int(c) == int(st["step"]), where
        torch.testing.assert_close(m, st["exp_avg"], rtol=rtol, atol=atol, msg=lambda s: f"{where}: mu {s}")
        torch.testing.assert_close(v, st["exp_avg_sq"], rtol=rtol, atol=atol, msg=lambda s: f"{where}: nu {s}")


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_float32_matches_torch_optim_every_step(decoupled, backend):
    # The reference backend follows torch.optim operation by operation: bitwise.
    # Other backends: torch's own float32 tolerance.
    rtol, atol = (0.0, 0.0) if backend == "reference" else (1.3e-6, 1e-5)
    for args in _run(decoupled, torch.float32, backend):
        _compare(*args, rtol=rtol, atol=atol)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_float64_matches_torch_optim_to_1e12(decoupled):
    for args in _run(decoupled, torch.float64, "auto", bias_gen_seed=1):
        _compare(*args, rtol=1e-12, atol=1e-12)


def test_frozen_leaf_keeps_state_and_count_until_it_gets_a_gradient():
    gen = torch.Generator().manual_seed(5)
    params = {"a": torch.randn(4, generator=gen), "b": torch.randn(3, generator=gen)}
    opt = sofx.adamw(lr=1e-2)
    state = opt.init(params)
    new_params, new_state, record = opt.update(params, {"a": torch.randn(4, generator=gen), "b": None}, state)
    assert new_params["b"] is params["b"]
    assert new_state.mu["b"] is state.mu["b"] and new_state.nu["b"] is state.nu["b"]
    assert int(new_state.count["b"]) == 0 and int(new_state.count["a"]) == 1
    assert record.strategies() == ["algebraic", None]


@pytest.mark.parametrize("backend, dtype", [("reference", torch.float32), ("cpu", torch.float32),
                                            ("cpu_fast", torch.float32), ("reference", torch.float64)])
def test_a_grad_scale_of_0_steps_with_zero_gradients(backend: str, dtype: torch.dtype):
    """grad_scale=0 (clip_grad_norm_ at max_norm=0 multiplies every gradient by 0) was refused as invalid; it is
    the step with zero gradients -- the parameters still move through the momentum and the weight decay -- bit
    for bit, undone and redone as that one (the reference backend: torch.optim.AdamW's step on zeroed gradients).
    A non-finite gradient is still one: 0 * inf is nan."""
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(5, 4, generator=gen, dtype=dtype), "b": torch.randn(4, generator=gen, dtype=dtype)}
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    params, state, _ = opt.update(params, tree.tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=dtype),
                                                        params), opt.init(params))  # nonzero moments
    grads = tree.tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=dtype) * 3.0, params)
    zeros = tree.tree_map(lambda g: g * 0.0, grads)
    got = opt.update(params, grads, state, grad_scale=0.0)
    want = opt.update(params, zeros, state)
    for k in params:
        for a, b in ((got[0][k], want[0][k]), (got[1].mu[k], want[1].mu[k]), (got[1].nu[k], want[1].nu[k])):
            assert torch.equal(a, b), k
        assert not torch.equal(got[0][k], params[k])
    undone, undone_state = opt.undo(got[0], got[1], got[2])
    want_undone, want_undone_state = opt.undo(want[0], want[1], want[2])
    assert all(torch.equal(undone[k], want_undone[k]) and torch.equal(undone_state.mu[k], want_undone_state.mu[k])
               for k in params)
    redone = opt.undo_redo(*opt.update(params, grads, state), grads, grad_scale=0.0)
    assert all(torch.allclose(redone[0][k], want[0][k], rtol=1e-6, atol=0) for k in params)
    if backend == "reference":
        tp = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
        topt = torch.optim.AdamW(list(tp.values()), lr=1e-2, weight_decay=0.1, foreach=False)
        topt.state.update({tp[k]: {"step": torch.tensor(1.0, dtype=torch.float32), "exp_avg": state.mu[k].clone(),
                                   "exp_avg_sq": state.nu[k].clone()} for k in params})
        for k in params:
            tp[k].grad = grads[k] * 0.0
        topt.step()
        assert all(torch.equal(got[0][k], tp[k].detach()) for k in params)
    bad = dict(grads, b=grads["b"].clone().index_fill_(0, torch.tensor([1]), math.inf))
    assert opt.undo_strategies(params, bad, state, grad_scale=0.0) == opt.undo_strategies(params, bad, state)
    assert opt.undo_strategies(params, bad, state)[0][0] != "algebraic"


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_0d_tensor_lr_steps_as_torch_optim_with_the_float_it_holds(decoupled: bool):
    """A float32 0-d tensor lr (torch's schedulers ``fill_`` a group's tensor lr) is read as the Python number it
    holds, as every hparam is: the run is ``torch.optim``'s with that float as lr, bit for bit, in ``sofx.adam(w)``
    and in the offload facade. torch's for-loop Adam(W) given the tensor itself computes ``lr * weight_decay``
    and ``lr / bias_correction1`` in float32 tensor arithmetic, where its float path computes them in float64:
    its own two runs differ by that rounding (~1e-7 relative per step), and sofx's is the float one."""
    gen = torch.Generator().manual_seed(5)
    init = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(20)]
    lr, wd = torch.tensor(3e-3), 0.1

    def torch_run(step_lr) -> torch.Tensor:
        p = torch.nn.Parameter(init.clone())
        topt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([p], lr=step_lr, weight_decay=wd, foreach=False)
        for g in grads:
            p.grad = g.clone()
            topt.step()
        return p.detach()

    opt = (sofx.adamw if decoupled else sofx.adam)(weight_decay=wd)
    params, state = {"p": init.clone()}, opt.init({"p": init})
    for g in grads:
        params, state, _ = opt.update(params, {"p": g}, state, sofx.AdamHParams(lr=lr))
    facade_param = torch.nn.Parameter(init.clone())
    cls = sofx.offload.SpeculativeAdamW if decoupled else sofx.offload.SpeculativeAdam
    with cls([facade_param], lr=lr.clone(), weight_decay=wd, executor="inline") as fopt:
        for g in grads:
            fopt.zero_grad()
            fopt.backward((facade_param * g).sum())
            fopt.step()
    want = torch_run(float(lr))
    assert torch.equal(params["p"], want) and torch.equal(facade_param.detach(), want)
    with_tensor = torch_run(lr.clone())
    assert not torch.equal(with_tensor, want)  # torch's tensor-lr path: its float32 scalar arithmetic
    torch.testing.assert_close(with_tensor, want, rtol=1e-5, atol=0)
