"""``torch.func`` workflows around ``sofx.adamw`` beyond the core tests (``test_adam_func.py``).

* a whole training step (``functional_call`` + ``grad_and_value`` + the traced
  ``clip_by_global_norm`` transform + ``update``) vmapped over an ensemble built with
  ``stack_module_state``, with per-member learning rate *and* weight decay, equal to the
  members' separate runs;
* a learning-rate sweep: one initialisation, ``vmap`` over the hparams only;
* ``vmap(opt.undo)`` after ``vmap(update)``; per-group hparams (a prefix tree) under ``vmap``;
* hypergradients through an *unrolled* multi-step loop (the Adam state flows from step to
  step): d(validation loss)/d(lr, beta1, weight decay), against finite differences in float64;
* forward-mode AD (``torch.func.jvp``) through ``update``.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, grad_and_value, jvp, stack_module_state, vmap

import sofx
from sofx import transforms

E = 4


def _mlp(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)


def _data(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(32, 3, generator=gen).to(dtype)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def test_vmapped_training_step_with_clipping_equals_separate_runs():
    members = [_mlp(i) for i in range(E)]
    stacked, _ = stack_module_state(members)
    params0 = {k: v.detach().clone() for k, v in stacked.items()}
    skeleton = members[0]
    x, y = _data()
    opt = sofx.adamw()
    clip = transforms.clip_by_global_norm(0.3)  # small: fires on some members and steps
    lrs = torch.tensor([3e-3, 1e-2, 3e-2, 6e-2])
    wds = torch.tensor([0.0, 1e-2, 1e-1, 0.3])

    def loss_fn(p):
        return torch.nn.functional.mse_loss(functional_call(skeleton, p, (x,)), y)

    def train_step(p, s, lr, wd):
        grads, loss = grad_and_value(loss_fn)(p)
        grads, clip_state = clip.update(grads, clip.init(p), p)
        p, s, _ = opt.update(p, grads, s, sofx.AdamHParams(lr=lr, weight_decay=wd))
        return p, s, loss, clip_state.coef

    step = vmap(train_step)
    p, s = params0, vmap(opt.init)(params0)
    coefs = []
    for _ in range(8):
        p, s, loss, coef = step(p, s, lrs, wds)
        coefs.append(coef)
    coefs = torch.stack(coefs)
    assert (coefs < 1).any() and (coefs == 1).any(), "clipping must fire on some steps only"

    for i in range(E):
        pi = {k: v[i].clone() for k, v in params0.items()}
        si = opt.init(pi)
        for t in range(8):
            g, _ = grad_and_value(loss_fn)(pi)
            g, cs = clip.update(g, clip.init(pi), pi)
            assert (float(cs.coef) < 1) == bool(coefs[t, i] < 1)
            pi, si, _ = opt.update(pi, g, si, sofx.AdamHParams(lr=float(lrs[i]), weight_decay=float(wds[i])))
        assert _max_rel({k: v[i] for k, v in p.items()}, pi) < 1e-5, i
        assert all(int(c[i]) == 8 for c in s.count.values())


def test_learning_rate_sweep_vmaps_over_hparams_only():
    model = _mlp(0)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = _data()
    opt = sofx.adamw(weight_decay=1e-2)
    grads = grad(lambda p: torch.nn.functional.mse_loss(functional_call(model, p, (x,)), y))(params)
    state = opt.init(params)
    lrs = torch.tensor([1e-3, 1e-2, 1e-1])

    def one(lr):
        return opt.update(params, grads, state, sofx.AdamHParams(lr=lr))[0]

    swept = vmap(one)(lrs)
    for i, lr in enumerate(lrs.tolist()):
        single, _, _ = opt.update(params, grads, state, sofx.AdamHParams(lr=lr))
        assert _max_rel({k: v[i] for k, v in swept.items()}, single) < 1e-6
    assert all(v.shape[0] == 3 for v in swept.values())
    assert all(torch.equal(params[k], model.state_dict()[k]) for k in params), "inputs are not modified"


@pytest.mark.parametrize("undo", ["auto", "algebraic"])
def test_vmapped_undo_restores_every_member(undo):
    members = [_mlp(10 + i) for i in range(E)]
    stacked, _ = stack_module_state(members)
    params = {k: v.detach().clone() for k, v in stacked.items()}
    opt = sofx.adamw(weight_decay=1e-2, undo=undo)
    gen = torch.Generator().manual_seed(3)
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(2)]
    lrs = torch.tensor([1e-3, 5e-3, 2e-2, 5e-2])
    update = vmap(lambda p, g, s, lr: opt.update(p, g, s, sofx.AdamHParams(lr=lr)))
    p1, s1, _ = update(params, grads[0], vmap(opt.init)(params), lrs)
    p2, s2, record = update(p1, grads[1], s1, lrs)
    assert set(record.strategies()) == {"snapshot" if undo == "auto" else "algebraic"}
    p_back, s_back = vmap(opt.undo)(p2, s2, record)
    for k in params:
        if undo == "auto":  # snapshots of the (unmodified) inputs: bitwise
            assert torch.equal(p_back[k], p1[k]) and torch.equal(s_back.nu[k], s1.nu[k])
        else:
            torch.testing.assert_close(p_back[k], p1[k], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(s_back.mu[k], s1.mu[k], rtol=1e-5, atol=1e-7)
        assert (s_back.count[k] == 1).all()


def test_vmapped_update_returns_a_record_with_leaves_not_stepped():
    """A frozen member leaf (None gradient): the record's unstepped leaves are not pytree children (vmap refuses
    to return a None), and the undo restores the stepped ones and leaves the frozen one alone."""
    members = [_mlp(30 + i) for i in range(E)]
    stacked, _ = stack_module_state(members)
    params = {k: v.detach().clone() for k, v in stacked.items()}
    frozen = sorted(params)[0]
    gen = torch.Generator().manual_seed(5)
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    opt = sofx.adamw(lr=1e-2, undo="exact")
    state = vmap(opt.init)(params)
    update = vmap(lambda p, g, s: opt.update(p, {**g, frozen: None}, s))  # the frozen leaf: no gradient
    p1, s1, record = update(params, grads, state)
    assert record.strategies()[sorted(params).index(frozen)] is None
    assert torch.equal(p1[frozen], params[frozen])
    p_back, s_back = vmap(opt.undo)(p1, s1, record)
    for k in params:
        assert torch.equal(p_back[k], params[k]) and torch.equal(s_back.count[k], state.count[k])


def test_per_group_hparams_prefix_tree_under_vmap():
    members = [_mlp(20 + i) for i in range(E)]
    stacked, _ = stack_module_state(members)
    params = {k: v.detach().clone() for k, v in stacked.items()}
    gen = torch.Generator().manual_seed(4)
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    opt = sofx.adamw(weight_decay=0.1)
    lrs = torch.tensor([1e-3, 3e-3, 1e-2, 3e-2])

    def step(p, g, s, lr):
        # weights: this member's lr and decay; biases: a fixed lr, no decay
        groups = {k: sofx.AdamHParams(lr=lr) if k.endswith("weight") else sofx.AdamHParams(lr=1e-2, weight_decay=0.0)
                  for k in p}
        return opt.update(p, g, s, groups)[0]

    out = vmap(step)(params, grads, vmap(opt.init)(params), lrs)
    for i in range(E):
        pi = {k: v[i] for k, v in params.items()}
        gi = {k: v[i] for k, v in grads.items()}
        groups = {k: sofx.AdamHParams(lr=float(lrs[i])) if k.endswith("weight")
                  else sofx.AdamHParams(lr=1e-2, weight_decay=0.0) for k in pi}
        single, _, _ = opt.update(pi, gi, opt.init(pi), groups)
        assert _max_rel({k: v[i] for k, v in out.items()}, single) < 1e-6


def _unrolled_setup():
    model = _mlp(1, torch.float64)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = _data(torch.float64)
    x_val, y_val = x[:8] + 0.1, y[:8]
    opt = sofx.adamw()

    def loss_of(p, xs, ys):
        return torch.nn.functional.mse_loss(functional_call(model, p, (xs,)), ys)

    def validation_after(lr, beta1, wd, steps: int = 4):
        """Train ``steps`` steps (state flowing through), then the validation loss."""
        p, s = params, opt.init(params)
        for _ in range(steps):
            g = grad(loss_of)(p, x, y)
            p, s, _ = opt.update(p, g, s, sofx.AdamHParams(lr=lr, beta1=beta1, weight_decay=wd))
        return loss_of(p, x_val, y_val)

    return validation_after


def test_hypergradients_through_an_unrolled_loop_match_finite_differences():
    validation_after = _unrolled_setup()
    hp = [torch.tensor(v, dtype=torch.float64) for v in (0.02, 0.85, 0.05)]
    d_lr, d_b1, d_wd = grad(validation_after, argnums=(0, 1, 2))(*hp)
    h = 1e-6
    for i, analytic in enumerate((d_lr, d_b1, d_wd)):
        plus = [v + h if j == i else v for j, v in enumerate(hp)]
        minus = [v - h if j == i else v for j, v in enumerate(hp)]
        fd = (validation_after(*plus) - validation_after(*minus)) / (2 * h)
        torch.testing.assert_close(analytic, fd, rtol=1e-4, atol=1e-9)
    assert d_lr.abs() > 0 and d_b1.abs() > 0 and d_wd.abs() > 0


def test_forward_mode_jvp_through_update_matches_finite_differences():
    model = _mlp(2, torch.float64)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(5)
    grads = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()}
    opt = sofx.adamw(lr=0.01, weight_decay=0.1)
    state = opt.update(params, grads, opt.init(params))[1]  # non-zero moments
    tangent = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()}

    def new_params(p):
        return opt.update(p, grads, state)[0]

    _, directional = jvp(new_params, (params,), (tangent,))
    h = 1e-6
    plus = new_params({k: v + h * tangent[k] for k, v in params.items()})
    minus = new_params({k: v - h * tangent[k] for k, v in params.items()})
    for k in params:
        torch.testing.assert_close(directional[k], (plus[k] - minus[k]) / (2 * h), rtol=1e-6, atol=1e-9)
