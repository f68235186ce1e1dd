"""sofx.adam under torch.func: vmap over an ensemble, grad through update (params and hparams)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, grad_and_value, vmap

import sofx

E = 4


def _ensemble(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(E, 6, 3, generator=gen), "b": torch.randn(E, 3, generator=gen)}


@pytest.mark.parametrize("decoupled", [True, False])
def test_vmap_ensemble_with_per_member_lr_equals_separate_runs(decoupled):
    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-2, weight_decay=0.05)
    params = _ensemble()
    state = vmap(opt.init)(params)
    lrs = torch.tensor([1e-3, 3e-3, 1e-2, 3e-2])
    shared_beta1 = 0.85
    gen = torch.Generator().manual_seed(1)
    grads_seq = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(5)]

    def step(p, g, s, lr):
        return opt.update(p, g, s, sofx.AdamHParams(lr=lr, beta1=shared_beta1))

    batched = vmap(step)
    p, s = params, state
    for g in grads_seq:
        p, s, record = batched(p, g, s, lrs)
    assert s.count["w"].shape == (E,) and (s.count["w"] == 5).all()

    for i in range(E):
        pi = {k: v[i] for k, v in params.items()}
        si = opt.init(pi)
        for g in grads_seq:
            pi, si, _ = opt.update(pi, {k: v[i] for k, v in g.items()}, si,
                                   sofx.AdamHParams(lr=float(lrs[i]), beta1=shared_beta1))
        for k in pi:
            torch.testing.assert_close(p[k][i], pi[k], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(s.mu[k][i], si.mu[k], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(s.nu[k][i], si.nu[k], rtol=1e-6, atol=1e-7)

    # the batched record undoes the last batched step
    p_prev, s_prev = params, state
    for g in grads_seq[:-1]:
        p_prev, s_prev, _ = batched(p_prev, g, s_prev, lrs)
    p_back, s_back = vmap(opt.undo)(p, s, record)
    for k in p_back:
        torch.testing.assert_close(p_back[k], p_prev[k], rtol=0, atol=0)
    assert (s_back.count["w"] == 4).all()


def test_grad_through_update_wrt_params_and_hparams_matches_finite_differences():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt = sofx.adamw(lr=0.05, weight_decay=0.1)

    def loss_of(p):
        return torch.nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    state0 = opt.init(params)
    g0 = grad(loss_of)(params)
    params1, state1, _ = opt.update(params, g0, state0)  # nonzero moments

    def meta_loss(lr, p):
        # one inner step from p with learning rate lr, then the loss after it
        g = grad(loss_of)(p)
        new_p, _, _ = opt.update(p, g, state1, sofx.AdamHParams(lr=lr))
        return loss_of(new_p)

    lr = torch.tensor(0.03, dtype=torch.float64)
    d_lr, d_p = grad(meta_loss, argnums=(0, 1))(lr, params1)
    h = 1e-6
    fd_lr = (meta_loss(lr + h, params1) - meta_loss(lr - h, params1)) / (2 * h)
    torch.testing.assert_close(d_lr, fd_lr, rtol=1e-5, atol=1e-8)
    k = "weight"
    direction = torch.randn_like(params1[k])
    plus = {**params1, k: params1[k] + h * direction}
    minus = {**params1, k: params1[k] - h * direction}
    fd_p = (meta_loss(lr, plus) - meta_loss(lr, minus)) / (2 * h)
    torch.testing.assert_close((d_p[k] * direction).sum(), fd_p, rtol=1e-5, atol=1e-8)


def test_grad_and_value_functional_training_loop_decreases_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(64, 3)
    y = x.sum(1, keepdim=True)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = sofx.adamw(lr=1e-2)
    state = opt.init(params)

    def loss_fn(p):
        return torch.nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    first = None
    for _ in range(60):
        g, loss = grad_and_value(loss_fn)(params)
        first = first if first is not None else loss.item()
        params, state, _ = opt.update(params, g, state)
    assert loss_fn(params).item() < 0.2 * first
