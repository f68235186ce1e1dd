"""The plain loops side by side with ``torch.optim`` over drawn configurations, bit for bit where nothing clips.

The other parity tests run chosen configurations; these draw one per example: one to five leaves among 0-d,
empty and small ones, one to three param groups with their own lr (0 included), betas (0 included), eps and
weight decay (AdamW, or Adam with L2), changed every step or not, ``GradScaler`` factors that are not powers of
two (``init_scale=3``, ``growth_factor=1.5``) with a ``growth_interval`` of 1-3, an inf or nan injected into a
gradient now and then (overflow), leaves without a gradient on some micro-steps or whole steps, one to three
micro-batches accumulated, ``max_norm`` ``None``, inf or above any norm (no clip: torch's multiplications and
sofx's folded multiplier agree to the bit only there, ``sofx.serial``'s "Known differences").

- :func:`sofx.serial.serial_loop_step` + ``accumulate`` against ``torch.optim.Adam/AdamW(foreach=False)`` +
  ``GradScaler("cpu")`` + ``clip_grad_norm_`` (torch's ``.grad`` accumulated by autograd); every parameter,
  moment, step count and the loss scale compared bitwise after every step, and the speculative loop (no
  donation) equal to the serial one bit for bit; at a drawn step each side may go on from the other's state
  (``to_torch_optim`` / ``from_torch_optim`` with the groups).
- The offload facade (inline or thread executor, blocks of 1 to 64 elements or one, device blocks, ``undo=
  "exact"``, ``zero_grad(set_to_none=False)`` or not, ``gradient_accumulation_steps`` the number of backward
  calls or 1: the later backward calls undo and redo the speculated blocks) against the same torch loop,
  bitwise, with ``opt.state[p]``'s moments and steps.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sofx
import sofx.checkpoint
import sofx.offload
from sofx import AdamHParams, loss_scale, serial, speculate

from test_offload_support import one_torch_thread  # noqa: F401 (autouse fixture)

STEPS = 8
SHAPES = [(), (0,), (3,), (4, 3), (2, 0), (1,), (17,)]
serial_draws = settings(max_examples=12, deadline=None)
facade_draws = settings(max_examples=6, deadline=None)


def _group_options(rnd: random.Random) -> dict[str, Any]:
    return dict(lr=rnd.choice([1e-3, 1e-2, 0.1, 0.0]),
                betas=(rnd.choice([0.0, 0.5, 0.9]), rnd.choice([0.0, 0.5, 0.999])),
                eps=rnd.choice([1e-8, 1e-3]), weight_decay=rnd.choice([0.0, 0.01, 0.5]))


def _config(seed: int) -> dict[str, Any]:
    """A drawn configuration (see the module docstring)."""
    rnd = random.Random(seed)
    n = rnd.randint(1, 5)
    n_groups = rnd.randint(1, min(3, n))
    group_of = [i % n_groups for i in range(n)]
    rnd.shuffle(group_of)
    return dict(rnd=rnd, gen=torch.Generator().manual_seed(seed), shapes=[rnd.choice(SHAPES) for _ in range(n)],
                group_of=group_of, options=[_group_options(rnd) for _ in range(n_groups)],
                decoupled=rnd.random() < 0.5, changing=rnd.random() < 0.5, micro=rnd.randint(1, 3),
                scaling=dict(init_scale=rnd.choice([1.0, 3.0, 2.0 ** 16]), growth_factor=rnd.choice([2.0, 1.5]),
                             backoff_factor=rnd.choice([0.5, 0.3]), growth_interval=rnd.randint(1, 3)),
                max_norm=rnd.choice([None, math.inf, 1e30]), mult=rnd.choice([0.01, 1.0, 100.0]))


def _micro_grads(c: dict[str, Any], inject: bool, some: bool = False) -> list[torch.Tensor | None]:
    """One micro-batch's gradients (``None``: that leaf has none; ``some``: not all ``None``), an inf or nan in one
    of them at times."""
    rnd, gen = c["rnd"], c["gen"]
    grads = [None if rnd.random() < 0.25 else torch.randn(s, generator=gen) * c["mult"] for s in c["shapes"]]
    if some and all(g is None for g in grads):
        grads[0] = torch.randn(c["shapes"][0], generator=gen) * c["mult"]
    if inject and rnd.random() < 0.1:
        present = [g for g in grads if g is not None and g.numel()]
        if present:
            rnd.choice(present).view(-1)[0] = rnd.choice([math.inf, -math.inf, math.nan])
    return grads


def _torch_step(c: dict[str, Any], topt: torch.optim.Optimizer, tscaler: torch.amp.GradScaler,
                tparams: list[torch.nn.Parameter]) -> None:
    """torch's step after backward: unscale, clip, step, update (a plain step where no parameter has a gradient:
    GradScaler.step refuses it)."""
    with_grad = [p for p in tparams if p.grad is not None]
    if not with_grad:
        topt.step()
        return
    tscaler.unscale_(topt)
    if c["max_norm"] is not None:
        torch.nn.utils.clip_grad_norm_(with_grad, c["max_norm"])
    tscaler.step(topt)
    tscaler.update()


def _change_hparams(c: dict[str, Any], topt: torch.optim.Optimizer) -> None:
    if c["changing"]:
        c["options"] = [_group_options(c["rnd"]) for _ in c["options"]]
        for group, options in zip(topt.param_groups, c["options"]):
            group.update(options)


def _torch_groups(c: dict[str, Any], params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [dict(params=[p for p, g in zip(params, c["group_of"]) if g == k], **o) for k, o in enumerate(c["options"])]


def _assert_state_equal(where: str, got: dict[str, torch.Tensor], got_count: int, topt: torch.optim.Optimizer,
                        p: torch.nn.Parameter) -> None:
    want = topt.state.get(p, {})
    assert got_count == (int(want["step"]) if want else 0), where
    if want:
        assert torch.equal(got["exp_avg"], want["exp_avg"]), f"{where}: exp_avg"
        assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"]), f"{where}: exp_avg_sq"


@serial_draws
@given(seed=st.integers(0, 2 ** 31 - 1))
def test_the_serial_loop_of_a_drawn_configuration_is_torchs_bit_for_bit(seed: int) -> None:
    c = _config(seed)
    init = [torch.randn(s, generator=c["gen"]) for s in c["shapes"]]
    tparams = [torch.nn.Parameter(v.clone()) for v in init]
    topt = (torch.optim.AdamW if c["decoupled"] else torch.optim.Adam)(_torch_groups(c, tparams), foreach=False)
    tscaler = torch.amp.GradScaler("cpu", **c["scaling"])
    opt, rule = (sofx.adamw if c["decoupled"] else sofx.adam)(), loss_scale.grad_scaler(**c["scaling"])
    keys = [f"p{i}" for i in range(len(init))]
    loop = serial.init_loop(opt, {k: v.clone() for k, v in zip(keys, init)}, rule)
    spec_loop = loop
    config = sofx.SpeculationConfig(max_norm=c["max_norm"])
    handover = c["rnd"].choice([None, 2, 5])
    groups = [[k for k, g in zip(keys, c["group_of"]) if g == n] for n in range(len(c["options"]))]
    for step in range(STEPS):
        _change_hparams(c, topt)
        hp = {k: AdamHParams(lr=o["lr"], beta1=o["betas"][0], beta2=o["betas"][1], eps=o["eps"],
                             weight_decay=o["weight_decay"])
              for k, o in zip(keys, (c["options"][g] for g in c["group_of"]))}
        if step == handover:  # each side goes on from the other's state, through the state-dict interop
            theirs = topt.state_dict()
            topt.load_state_dict(sofx.checkpoint.to_torch_optim(opt, loop.opt_state, hp, groups=groups,
                                                                params=loop.params))
            loop = loop._replace(opt_state=sofx.checkpoint.from_torch_optim(opt, theirs, loop.params,
                                                                             groups=groups)[0])
        scale = rule.scale(loop.scaler_state)
        tscaler.scale(torch.ones(()))  # initialises the scale lazily, as scaler.scale(loss) would
        assert tscaler.get_scale() == scale
        acc = sofx.transforms.accumulation_init(loop.params)
        for p in tparams:
            p.grad = None
        for _ in range(c["micro"]):
            grads = [None if g is None else g * scale for g in _micro_grads(c, inject=True)]
            acc = sofx.transforms.accumulate(acc, dict(zip(keys, grads)), loop.params)
            for p, g in zip(tparams, grads):
                if g is not None:
                    (p * g).sum().backward()
        _torch_step(c, topt, tscaler, tparams)
        grads = sofx.transforms.accumulated(acc, loop.params)
        loop, _ = serial.serial_loop_step(opt, loop, grads, scaler=rule, hparams=hp, max_norm=c["max_norm"])
        spec_loop, _ = speculate.speculative_loop_step(opt, spec_loop, grads, config=config, scaler=rule, hparams=hp)
        assert rule.scale(loop.scaler_state) == tscaler.get_scale(), step
        for k, p in zip(keys, tparams):
            where = f"seed {seed}, step {step}, {k}"
            assert torch.equal(loop.params[k], p.detach()), where
            assert torch.equal(spec_loop.params[k], loop.params[k]), f"{where}: speculative"
            _assert_state_equal(where, {"exp_avg": loop.opt_state.mu[k], "exp_avg_sq": loop.opt_state.nu[k]},
                                int(loop.opt_state.count[k]), topt, p)


@facade_draws
@given(seed=st.integers(0, 2 ** 31 - 1))
def test_the_facade_in_a_drawn_configuration_is_torchs_bit_for_bit(seed: int) -> None:
    c = _config(seed)
    rnd = c["rnd"]
    scaled = rnd.random() < 0.7  # (without a loss scale only finite gradients: torch would step a nan)
    options = dict(executor=rnd.choice(["inline", "thread"]), block_numel=rnd.choice([1, 8, 64, 2 ** 22]),
                   gradient_accumulation_steps=rnd.choice([c["micro"], 1]), undo="exact",
                   max_grad_norm=c["max_norm"])
    set_to_none = rnd.random() < 0.6
    init = [torch.randn(s, generator=c["gen"]) for s in c["shapes"]]
    tparams = [torch.nn.Parameter(v.clone()) for v in init]
    fparams = [torch.nn.Parameter(v.clone()) for v in init]
    topt = (torch.optim.AdamW if c["decoupled"] else torch.optim.Adam)(_torch_groups(c, tparams), foreach=False)
    tscaler = torch.amp.GradScaler("cpu", enabled=scaled, **c["scaling"])
    if scaled:
        options["loss_scale"] = loss_scale.grad_scaler(**c["scaling"])
    options["n_device_blocks"] = rnd.choice([0, 1])  # (there is always a block: an empty parameter makes one)
    cls = sofx.offload.SpeculativeAdamW if c["decoupled"] else sofx.offload.SpeculativeAdam
    with cls(_torch_groups(c, fparams), **options) as fopt:
        for step in range(STEPS):
            _change_hparams(c, topt)
            for group, o in zip(fopt.param_groups, c["options"]):
                group.update(o)
            topt.zero_grad(set_to_none=set_to_none)
            fopt.zero_grad(set_to_none=set_to_none)
            for _ in range(c["micro"]):  # (every micro-batch has a backward: a step() after none steps nothing)
                terms = [(i, g) for i, g in enumerate(_micro_grads(c, inject=scaled, some=True)) if g is not None]
                tscaler.scale(sum((tparams[i] * g).sum() for i, g in terms)).backward()
                fopt.backward(sum((fparams[i] * g).sum() for i, g in terms))
            _torch_step(c, topt, tscaler, tparams)
            fopt.step()
            if scaled:
                assert fopt.loss_scale == tscaler.get_scale(), step
            for i, (fp, tp) in enumerate(zip(fparams, tparams)):
                where = f"seed {seed}, step {step}, parameter {i}"
                assert torch.equal(fp.detach(), tp.detach()), where
                state = fopt.state[fp]
                _assert_state_equal(where, state, int(state["step"]), topt, tp)


@pytest.mark.parametrize("scale", [None, 4.0])
def test_without_a_dynamic_loss_scale_the_facade_skips_a_non_finite_step_where_torch_optim_writes_nan(scale) -> None:
    """The documented difference (the facade's module docstring): with ``loss_scale=None`` or a static number a
    step whose gradients hold a nan is skipped -- parameters, moments and counts as they were, the scale too --
    where ``torch.optim.AdamW`` without a ``GradScaler`` steps it into nan; the steps around it are torch's
    (whose loop skips that step by hand) bit for bit."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]
    fparams, tparams, alone = ([torch.nn.Parameter(v.clone()) for v in init] for _ in range(3))
    topt = torch.optim.AdamW(tparams, lr=1e-2, foreach=False)
    alone_opt = torch.optim.AdamW(alone, lr=1e-2, foreach=False)
    with sofx.offload.SpeculativeAdamW(fparams, lr=1e-2, executor="inline", loss_scale=scale) as fopt:
        for step in range(4):
            grads = [torch.randn(p.shape, generator=gen) for p in init]
            if step == 2:
                grads[0][1, 1] = math.nan
            fopt.zero_grad()
            fopt.backward(sum((p * g).sum() for p, g in zip(fparams, grads)))
            report = fopt.step()
            assert report.skipped == (step == 2) and fopt.loss_scale == (scale or 1.0)
            for p, q, g in zip(tparams, alone, grads):
                p.grad, q.grad = g.clone(), g.clone()
            alone_opt.step()
            if step != 2:
                topt.step()
            for fp, tp in zip(fparams, tparams):
                assert torch.equal(fp.detach(), tp.detach()), step
                assert int(fopt.state[fp]["step"]) == int(topt.state[tp]["step"]), step
                assert torch.equal(fopt.state[fp]["exp_avg_sq"], topt.state[tp]["exp_avg_sq"]), step
    assert torch.isnan(alone[0]).any() and not torch.isnan(fparams[0]).any()
