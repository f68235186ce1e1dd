"""Meta-learning through sofx's functional Adam, side by side with ``torch.optim``'s differentiable one.

The scenario: K = 3 unrolled steps of ``sofx.adamw`` / ``sofx.adam`` (weight decay, bias correction on) on a
small regression problem, then a validation loss; its hypergradients d(loss)/d(lr) (a 0-d tensor) and
d(loss)/d(initial params), in float64:

* with plain autograd (parameters that require grad, inner gradients taken with ``create_graph=True``) and
  with ``torch.func.grad`` of a pure function of ``(params, lr)``, equal to those of
  ``torch.optim.AdamW`` / ``Adam(differentiable=True)`` with a tensor lr, to float64 rounding;
* ``torch.func.vmap`` over a batch of 4 learning rates equal to 4 separate runs;
* ``undo`` of a differentiable step gives the inputs back, and d undo(update(x))/dx is the identity;
  ``undo_redo`` is differentiable as the redone step;
* traced leaves are stepped by the reference math with ``backend="auto"`` and ``"reference"``; ``"cpu"``
  refuses them naming the leaf (its kernels read raw memory, which autograd and the transforms do not see);
* values that cannot be read are not read: a ``grad_scale`` that vmap batches, ``algebraic_refusal`` of
  traced hparams; a traced hparam's shape is checked as a concrete one's.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import pytest
import torch
from torch.func import grad, jacrev, vmap

import sofx
from sofx.errors import UnsupportedError

D = torch.float64
K = 3  # unrolled steps
LR = 0.05
BETAS = (0.85, 0.95)
EPS = 1e-6
WD = 0.1
# float64 rounding of a few steps' worth of operations (torch computes the step with other, equivalent
# operations: denom = sqrt(v) / (bc2_sqrt * -step_size) + eps / -step_size)
RTOL, ATOL = 1e-12, 1e-14


def _problem() -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(3, 2, generator=gen, dtype=D), "b": torch.randn(2, generator=gen, dtype=D)}
    x, x_val = torch.randn(8, 3, generator=gen, dtype=D), torch.randn(6, 3, generator=gen, dtype=D)
    true_w = torch.randn(3, 2, generator=gen, dtype=D)
    return params, (x, torch.tanh(x @ true_w), x_val, torch.tanh(x_val @ true_w))


PARAMS, (X, Y, X_VAL, Y_VAL) = _problem()


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor = X, y: torch.Tensor = Y) -> torch.Tensor:
    return ((torch.tanh(x @ p["w"] + p["b"]) - y) ** 2).mean()


def _val_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
    return _loss(p, X_VAL, Y_VAL)


def _make(decoupled: bool, backend: str = "auto", undo: str = "auto") -> sofx.Adam:
    make = sofx.adamw if decoupled else sofx.adam
    return make(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, backend=backend, undo=undo)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch.optim keeps the step count as a tensor of the default dtype, and its differentiable path takes the
    bias corrections from it: float64 here, as sofx takes them in double precision."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _leaves(lr: float = LR) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A learning rate and initial parameters that require grad (autograd's inputs)."""
    return (torch.tensor(lr, dtype=D, requires_grad=True),
            {k: v.clone().requires_grad_(True) for k, v in PARAMS.items()})


def _torch_unrolled(decoupled: bool, lr: torch.Tensor | float, init: dict[str, torch.Tensor]) -> torch.Tensor:
    """The validation loss after K steps of torch.optim.AdamW / Adam(differentiable=True).

    torch steps its parameters in place, and each step's loss saved them for backward: every step runs on new
    clones (its state moved over), so that the graph of the earlier steps stays intact."""
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    params = {k: v.clone() for k, v in init.items()}
    with _default_dtype(D):
        opt = cls(list(params.values()), lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, differentiable=True)
        for _ in range(K):
            grads = torch.autograd.grad(_loss(params), list(params.values()), create_graph=True)
            fresh = {k: v.clone() for k, v in params.items()}
            for old, new in zip(params.values(), fresh.values()):
                if old in opt.state:
                    opt.state[new] = opt.state.pop(old)
            opt.param_groups[0]["params"] = list(fresh.values())
            params = fresh
            for p, g in zip(params.values(), grads):
                p.grad = g
            opt.step()
    return _val_loss(params)


def _sofx_unrolled(opt: sofx.Adam, lr: torch.Tensor | float, init: dict[str, torch.Tensor]) -> torch.Tensor:
    """The validation loss after K steps of ``opt.update``, inner gradients by autograd (``create_graph``)."""
    p, s = init, opt.init(init)
    for _ in range(K):
        grads = dict(zip(p, torch.autograd.grad(_loss(p), list(p.values()), create_graph=True)))
        p, s, _ = opt.update(p, grads, s, sofx.AdamHParams(lr=lr))
    return _val_loss(p)


def _pure(opt: sofx.Adam) -> Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]:
    """A pure function of ``(params, lr)``: the validation loss after K steps (inner gradients by torch.func)."""

    def run(params: dict[str, torch.Tensor], lr: torch.Tensor) -> torch.Tensor:
        p, s = params, opt.init(params)
        for _ in range(K):
            p, s, _ = opt.update(p, grad(_loss)(p), s, sofx.AdamHParams(lr=lr))
        return _val_loss(p)

    return run


def _torch_hypergradients(decoupled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lr, init = _leaves()
    d = torch.autograd.grad(_torch_unrolled(decoupled, lr, init), [lr, *init.values()])
    return d[0], dict(zip(init, d[1:]))


def _assert_close_trees(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_hypergradients_through_unrolled_steps_equal_torch_differentiable_adam(decoupled, backend):
    lr, init = _leaves()
    loss = _sofx_unrolled(_make(decoupled, backend), lr, init)
    d = torch.autograd.grad(loss, [lr, *init.values()])
    want_lr, want_p = _torch_hypergradients(decoupled)
    torch.testing.assert_close(loss, _torch_unrolled(decoupled, *_leaves()), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(d[0], want_lr, rtol=RTOL, atol=ATOL)
    _assert_close_trees(dict(zip(init, d[1:])), want_p)
    assert want_lr.abs() > 1e-3 and all(g.abs().max() > 1e-3 for g in want_p.values())
    assert all(not p.grad_fn for p in init.values())  # the inputs are as they were: leaves, unchanged
    assert all(torch.equal(init[k], PARAMS[k]) for k in PARAMS)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_gradients_wrt_initial_params_with_a_float_lr_equal_torch_differentiable_adam(decoupled):
    """Only the parameters traced (a Python float lr: the step's scalar arithmetic in double on the host)."""
    init, want_init = _leaves()[1], _leaves()[1]
    got = torch.autograd.grad(_sofx_unrolled(_make(decoupled), LR, init), list(init.values()))
    want = torch.autograd.grad(_torch_unrolled(decoupled, LR, want_init), list(want_init.values()))
    _assert_close_trees(dict(zip(init, got)), dict(zip(init, want)))


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_func_grad_of_a_pure_unrolled_loop_equals_torch_differentiable_adam(decoupled):
    d_p, d_lr = grad(_pure(_make(decoupled)), argnums=(0, 1))(PARAMS, torch.tensor(LR, dtype=D))
    want_lr, want_p = _torch_hypergradients(decoupled)
    torch.testing.assert_close(d_lr, want_lr, rtol=RTOL, atol=ATOL)
    _assert_close_trees(d_p, want_p)


def test_vmap_over_four_learning_rates_equals_four_separate_runs():
    run = _pure(_make(True))
    lrs = torch.tensor([0.01, 0.03, 0.05, 0.1], dtype=D)
    losses = vmap(run, in_dims=(None, 0))(PARAMS, lrs)
    d_lrs = vmap(grad(run, argnums=1), in_dims=(None, 0))(PARAMS, lrs)
    for i, lr in enumerate(lrs):
        torch.testing.assert_close(losses[i], run(PARAMS, lr), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(d_lrs[i], grad(run, argnums=1)(PARAMS, lr), rtol=RTOL, atol=ATOL)
    assert len(set(losses.tolist())) == 4


def _stepped_state(opt: sofx.Adam) -> sofx.AdamState:
    """A state after one step: moments that are not zero."""
    return opt.update(PARAMS, grad(_loss)(PARAMS), opt.init(PARAMS))[1]


@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_a_record_of_a_gradient_that_requires_grad_undone_in_grad_mode_is_autograds(backend):
    """A gradient that requires grad, stepped under ``torch.no_grad()`` (plain values, an algebraic record that
    holds it), undone in grad mode: the undo is autograd's, as a step of that gradient in grad mode is (the
    reference math, differentiable in the gradient; ``backend='cpu'`` refuses naming the leaf). The cpu kernel
    refused it naming its own call ('cpu.undo_many[0]: g requires grad'), and suggested sofx.Adam."""
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(6, generator=gen)}  # (float32: the cpu backend's)
    g = {"w": torch.randn(6, generator=gen, requires_grad=True)}
    opt = sofx.adamw(lr=LR, weight_decay=WD, backend=backend)
    with torch.no_grad():
        p1, s1, _ = opt.update(params, g, opt.init(params))
        p2, s2, record = opt.update(p1, g, s1)
    assert record.leaves[0].strategy == "algebraic" and record.leaves[0].grad.requires_grad
    if backend == "cpu":
        with pytest.raises(UnsupportedError, match=r"params\['w'\]: backend 'cpu' cannot run under"):
            opt.undo(p2, s2, record)
        return
    p0, s0 = opt.undo(p2, s2, record)
    assert torch.allclose(p0["w"].detach(), p1["w"], rtol=1e-5, atol=1e-6)
    assert torch.allclose(s0.mu["w"].detach(), s1.mu["w"], rtol=1e-5, atol=1e-6) and int(s0.count["w"]) == 1
    assert s0.mu["w"].requires_grad  # (m = (m' - (1 - beta1) g) / beta1: a function of the record's gradient)
    s0.mu["w"].sum().backward()
    assert g["w"].grad is not None and torch.isfinite(g["w"].grad).all()

@pytest.mark.parametrize("undo", ["auto", "exact", "algebraic"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_undo_of_a_differentiable_step_gives_back_its_inputs_with_an_identity_jacobian(decoupled, undo):
    opt = _make(decoupled, undo=undo)
    state = _stepped_state(opt)
    grads = grad(_loss)(PARAMS)

    def round_trip(w: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
        p1, s1, record = opt.update({**PARAMS, "w": w}, grads, state, sofx.AdamHParams(lr=lr))
        back, back_state = opt.undo(p1, s1, record)
        assert all(torch.equal(c, state.count[k]) for k, c in back_state.count.items())
        return back["w"]

    lr = torch.tensor(LR, dtype=D)
    torch.testing.assert_close(round_trip(PARAMS["w"], lr), PARAMS["w"], rtol=RTOL, atol=ATOL)
    d_w, d_lr = jacrev(round_trip, argnums=(0, 1))(PARAMS["w"], lr)
    identity = torch.eye(PARAMS["w"].numel(), dtype=D).reshape(*PARAMS["w"].shape, *PARAMS["w"].shape)
    torch.testing.assert_close(d_w, identity, rtol=0, atol=ATOL)
    torch.testing.assert_close(d_lr, torch.zeros_like(d_lr), rtol=0, atol=ATOL)
    # plain autograd: parameters that require grad
    lr, init = _leaves()
    p1, s1, record = opt.update(init, grads, state, sofx.AdamHParams(lr=lr))
    back, _ = opt.undo(p1, s1, record)
    _assert_close_trees(back, PARAMS)
    d = torch.autograd.grad(sum(v.sum() for v in back.values()), [*init.values()])
    _assert_close_trees(dict(zip(init, d)), {k: torch.ones_like(v) for k, v in PARAMS.items()})


@pytest.mark.parametrize("undo", ["auto", "exact", "algebraic"])
def test_undo_redo_of_a_differentiable_step_is_differentiable_as_the_redone_step(undo):
    opt = _make(True, undo=undo)
    state = _stepped_state(opt)
    grads = grad(_loss)(PARAMS)
    new_grads = {k: 0.5 * g for k, g in grads.items()}

    def redone(params: dict[str, torch.Tensor], lr: torch.Tensor) -> torch.Tensor:
        p1, s1, record = opt.update(params, grads, state, sofx.AdamHParams(lr=lr))
        p2, _, _ = opt.undo_redo(p1, s1, record, new_grads, sofx.AdamHParams(lr=2 * lr))
        return _val_loss(p2)

    def direct(params: dict[str, torch.Tensor], lr: torch.Tensor) -> torch.Tensor:
        return _val_loss(opt.update(params, new_grads, state, sofx.AdamHParams(lr=2 * lr))[0])

    lr = torch.tensor(LR, dtype=D)
    got, want = grad(redone, argnums=(0, 1))(PARAMS, lr), grad(direct, argnums=(0, 1))(PARAMS, lr)
    _assert_close_trees(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("how", ["autograd", "func.grad", "vmap", "traced lr only"])
def test_backend_cpu_refuses_traced_leaves_naming_the_leaf(how):
    opt = sofx.adamw(lr=LR, weight_decay=WD, backend="cpu")
    grads = grad(_loss)(PARAMS)
    state = opt.init(PARAMS)
    before = {k: v.clone() for k, v in PARAMS.items()}
    match = r"params\['b'\]: backend 'cpu' cannot run under torch.func transforms, autograd .* use " \
            r"backend='reference' or 'auto'"

    def step(params: dict[str, torch.Tensor], lr: torch.Tensor | float = LR) -> torch.Tensor:
        return _val_loss(opt.update(params, grads, state, sofx.AdamHParams(lr=lr))[0])

    with pytest.raises(UnsupportedError, match=match):
        if how == "autograd":
            step(_leaves()[1])
        elif how == "func.grad":
            grad(step)(PARAMS)
        elif how == "vmap":
            vmap(step, in_dims=(None, 0))(PARAMS, torch.tensor([0.01, 0.02], dtype=D))
        else:
            step(PARAMS, torch.tensor(LR, dtype=D, requires_grad=True))
    assert all(torch.equal(PARAMS[k], before[k]) for k in PARAMS)
    assert all(not m.any() for m in state.mu.values()) and all(int(c) == 0 for c in state.count.values())


def test_parameters_that_require_grad_step_as_plain_values_under_no_grad():
    """As torch.optim steps a model's parameters: under ``torch.no_grad()`` nothing is traced (the lr that
    requires grad is read as a number), and the step is the traced one's values without a graph."""
    lr, init = _leaves()
    grads = grad(_loss)(PARAMS)
    traced, _, _ = _make(True).update(init, grads, _make(True).init(PARAMS), sofx.AdamHParams(lr=lr))
    with torch.no_grad():
        plain, _, _ = _make(True).update(init, grads, _make(True).init(PARAMS), sofx.AdamHParams(lr=lr))
    assert all(v.grad_fn is None and not v.requires_grad for v in plain.values())
    _assert_close_trees(plain, {k: v.detach() for k, v in traced.items()})


@pytest.mark.parametrize("undo", ["auto", "exact", "algebraic"])
def test_vmap_over_grad_scale_alone_equals_separate_runs_and_undoes(undo):
    """A gradient multiplier per member (a clip coefficient) that vmap batches, with concrete leaves and no
    ``grads_finite`` word: the finiteness of ``g * grad_scale`` cannot be read (it raised vmap's
    data-dependent control flow error), so the strategy is the one for values that cannot be read."""
    opt = _make(True, undo=undo)
    state = _stepped_state(opt)
    grads = grad(_loss)(PARAMS)

    def step(scale: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        p1, s1, record = opt.update(PARAMS, grads, state, grad_scale=scale)
        return p1, opt.undo(p1, s1, record)[0]

    scales = torch.tensor([0.25, 0.5, 1.0, 0.0], dtype=D)
    stepped, back = vmap(step)(scales)
    for i, scale in enumerate(scales):
        _assert_close_trees({k: v[i] for k, v in stepped.items()}, step(scale)[0])
        _assert_close_trees({k: v[i] for k, v in back.items()}, PARAMS)
    d_scale = grad(lambda s: _val_loss(step(s)[0]))(torch.tensor(0.5, dtype=D))
    assert torch.isfinite(d_scale) and d_scale != 0


@pytest.mark.parametrize("how", ["autograd", "vmap", "defaults"])
def test_a_traced_hparam_that_is_not_0_d_is_refused_as_a_concrete_one(how):
    """An lr of shape (2,) was refused as a plain tensor but stepped when autograd or vmap traced it (its value
    cannot be read, its shape can): broadcast against each leaf, a per-column lr, or a shape error from inside
    the math."""
    grads = grad(_loss)(PARAMS)
    lr = torch.full((2,), LR, dtype=D, requires_grad=True)
    match = r"lr must be a float or a 0-d tensor, got shape \(2,\)"
    with pytest.raises(sofx.HParamError, match=r"hparams for params\['b'\]: " + match):
        _make(True).update(PARAMS, grads, _make(True).init(PARAMS), sofx.AdamHParams(lr=lr.detach()))
    if how == "defaults":
        with pytest.raises(sofx.HParamError, match="defaults: " + match):
            sofx.adamw(lr=lr)
        return
    opt = _make(True)
    state = opt.init(PARAMS)
    with pytest.raises(sofx.HParamError, match=r"hparams for params\['b'\]: " + match):
        if how == "autograd":
            opt.update(PARAMS, grads, state, sofx.AdamHParams(lr=lr))
        else:
            vmap(lambda x: opt.update(PARAMS, grads, state, sofx.AdamHParams(lr=x))[0])(lr.detach().expand(4, 2))


@pytest.mark.parametrize("how", ["autograd", "func.grad", "vmap"])
def test_algebraic_refusal_of_traced_hparams_is_what_update_does(how):
    """``algebraic_refusal`` says what ``update`` would raise: of hparams that cannot be read (traced), only the
    dtypes, as ``update`` checks them (it read ``float()`` of them: vmap raised, autograd warned and refused
    ``lr * weight_decay == 1``, which ``update`` steps)."""
    opt = sofx.adamw(lr=LR, weight_decay=WD, undo="algebraic")
    found = []

    def refusal(lr: torch.Tensor) -> torch.Tensor:
        hp = sofx.AdamHParams(lr, *BETAS, EPS, 1 / LR)  # lr * weight_decay == 1: no inverse where read
        found.append((opt.algebraic_refusal(hp, D), opt.algebraic_refusal(hp, torch.bfloat16)))
        return 2 * lr

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if how == "autograd":
            refusal(torch.tensor(LR, dtype=D, requires_grad=True))
        elif how == "func.grad":
            grad(refusal)(torch.tensor(LR, dtype=D))
        else:
            vmap(refusal)(torch.tensor([LR, LR], dtype=D))
    (in_float64, in_bfloat16), = found
    assert in_float64 is None
    assert in_bfloat16 == ("undo='algebraic' is impossible: torch.bfloat16 optimizer states are rounded; "
                           "torch.bfloat16 master weights are rounded; use undo='auto' or 'exact'")
    assert "lr * weight_decay == 1" in opt.algebraic_refusal(sofx.AdamHParams(LR, *BETAS, EPS, 1 / LR), D)
    p = {"w": PARAMS["w"]}
    lr = torch.tensor(LR, dtype=D, requires_grad=True)
    opt.update(p, {"w": torch.ones_like(p["w"])}, opt.init(p), sofx.AdamHParams(lr=lr, weight_decay=1 / LR))
