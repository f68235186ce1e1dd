"""Shared harness for the offload tests: tiny models and a side-by-side run against torch.optim.

:func:`run_side_by_side` trains a model with ``sofx.offload.SpeculativeAdamW``
and a deep copy with ``torch.optim.AdamW`` + ``clip_grad_norm_`` +
``torch.amp.GradScaler`` (the "torch" profile's definition), on the same fresh
random batches, with a ``LambdaLR`` schedule, two param groups, forced
clipping steps, injected inf gradients and gradient accumulation, and returns
the per-step deviation and the reports.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pytest
import torch
from torch import nn

import sofx.offload
from sofx.loss_scale import grad_scaler

D_IN, D_OUT, VOCAB, SEQ = 6, 3, 11, 5


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread (the 2 cores are shared); restored afterwards.

    Import this fixture into every offload test module.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class SharedMLP(nn.Module):
    """An MLP whose middle layer is applied twice (a shared/tied parameter) and whose head bias is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, 12)
        self.mid = nn.Linear(12, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, D_OUT)
        self.head.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid(h))  # the same weights again
        return self.head(self.norm(h))


class TinyTransformer(nn.Module):
    """One encoder layer; the output projection is tied to the embedding; a frozen positional table."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.1, requires_grad=False)
        self.layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                                bias=False)  # a key bias has a zero true gradient: pure noise
        self.norm = nn.LayerNorm(d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.layer(self.emb(tokens) + self.pos)
        return self.norm(h) @ self.emb.weight.t()  # tied output projection


def mlp_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, D_IN, generator=gen), torch.randn(8, D_OUT, generator=gen)


def transformer_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (4, SEQ), generator=gen), torch.randint(0, VOCAB, (4, SEQ), generator=gen)


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def transformer_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, target = batch
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), target.reshape(-1))


MODELS = {
    "mlp": (SharedMLP, mlp_batch, mlp_loss),
    "transformer": (TinyTransformer, transformer_batch, transformer_loss),
}


def param_groups(model: nn.Module, lr: float = 2e-3) -> list[dict]:
    """Two groups: matrices with weight decay, vectors (biases, norms) without and with a larger lr."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0, "lr": lr * 2}]


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 10) * 0.97 ** step


def tensor_deviation(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max(max|b|, 1e-3): DESIGN.md's relative error of ``a`` against the reference ``b``."""
    d = (a.detach().double() - b.detach().double()).abs().max().item()
    return d / max(b.detach().abs().max().item(), 1e-3)


def relative_deviation(a: nn.Module, b: nn.Module) -> float:
    """max over parameters of :func:`tensor_deviation`."""
    return max((tensor_deviation(p, q) for p, q in zip(a.parameters(), b.parameters())), default=0.0)


def linear_beside_torch(executor: str) -> tuple[nn.Linear, nn.Linear, sofx.offload.SpeculativeAdamW,
                                                torch.optim.AdamW]:
    """``(model, ref, opt, ropt)``: after ``torch.manual_seed(0)``, an ``nn.Linear(4, 3)`` and a deep copy of it,
    the first stepped by ``SpeculativeAdamW`` (``executor``), the copy by ``torch.optim.AdamW`` (for-loop), both at
    lr 1e-2: the refusal tests' smallest side-by-side (their subprocess scripts import it too)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    return (model, ref, sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor),
            torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False))


def mlp_step_side_by_side(opt, ropt: torch.optim.Optimizer, model: nn.Module, ref: nn.Module,
                          gen: torch.Generator):
    """One training step of ``model`` with the sofx optimizer ``opt`` and of ``ref`` with the torch
    optimizer ``ropt`` on the same batch; returns ``opt``'s step report."""
    batch = mlp_batch(gen)
    opt.backward(mlp_loss(model, batch))
    mlp_loss(ref, batch).backward()
    report = opt.step()
    ropt.step()
    ropt.zero_grad()
    return report


def mse_step_side_by_side(opt, ropt: torch.optim.Optimizer, model: nn.Module, ref: nn.Module, x: torch.Tensor,
                          y: torch.Tensor, hooks: Sequence[tuple[torch.Tensor, Callable]] = ()):
    """One step of ``model`` with the sofx optimizer ``opt`` and of ``ref`` with the torch optimizer ``ropt``
    on the squared error of ``model(x)`` against ``y``; ``hooks``: ``(parameter, gradient hook)`` pairs
    registered for this step only (a gradient spike in both models, say). Returns ``opt``'s step report."""
    handles = [p.register_hook(h) for p, h in hooks]
    try:
        opt.zero_grad()
        opt.backward(((model(x) - y) ** 2).mean())
        ((ref(x) - y) ** 2).mean().backward()
        report = opt.step()
        ropt.step()
        ropt.zero_grad()
    finally:
        for h in handles:
            h.remove()
    return report


@dataclass
class SideBySide:
    deviations: list[float] = field(default_factory=list)
    reports: list = field(default_factory=list)
    ref_skipped: list[bool] = field(default_factory=list)
    ref_scales: list[float] = field(default_factory=list)
    executor: str = ""
    final: list[torch.Tensor] = field(default_factory=list)


def run_side_by_side(model_name: str, executor: str, *, steps: int = 50, accumulate: int = 2, seed: int = 0,
                     clip_every: int = 7, inf_every: int = 11, max_norm: float = 20.0,
                     opt_kwargs: dict | None = None,
                     make_opt: Callable[..., torch.optim.Optimizer] | None = None,
                     ref_cls: type = torch.optim.AdamW, boost_at: int = 0, boost: float = 100.0,
                     boost_when: Callable[[int], bool] | None = None) -> SideBySide:
    """Train side by side and record the deviation after every step (see the module docstring).
    ``boost_at``: which trainable parameter's gradient the forced clips multiply by ``boost`` (0: the first,
    the last to arrive in backward; -1: the last, the first to arrive, so its block is speculated with it);
    ``boost_when(step)``: at which steps (default: every ``clip_every``-th, from the fourth)."""
    make_model, make_batch, loss_fn = MODELS[model_name]
    torch.manual_seed(seed)
    model = make_model()
    ref = copy.deepcopy(model)
    kwargs = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-8, max_grad_norm=max_norm,
                  loss_scale=grad_scaler(init_scale=2.0 ** 10, growth_interval=4), executor=executor,
                  block_numel=200, gradient_accumulation_steps=accumulate, timeout=60.0)
    kwargs.update(opt_kwargs or {})
    opt = (make_opt or sofx.offload.SpeculativeAdamW)(param_groups(model), **kwargs)
    ropt = ref_cls(param_groups(ref), lr=2e-3, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, schedule)
    gen = torch.Generator().manual_seed(seed + 1)
    out = SideBySide(executor=opt.executor)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    first, victim = trainable[boost_at], trainable[len(trainable) // 2]
    try:
        for step in range(steps):
            opt.zero_grad()
            ropt.zero_grad()
            for micro in range(accumulate):
                batch = make_batch(gen)
                # Forced clipping: the first parameter's gradient (the last to arrive in backward) is
                # made large, so blocks speculated before it must be undone and redone.
                boosted = boost_when(step) if boost_when else bool(clip_every) and step % clip_every == 3
                inject = bool(inf_every) and step % inf_every == 5 and micro == accumulate - 1
                handles = []
                for m in (model, ref):
                    named = dict(m.named_parameters())
                    if boosted:
                        handles.append(named[first].register_hook(lambda g: g * boost))
                    if inject:
                        handles.append(named[victim].register_hook(_inject_inf))
                opt.backward(loss_fn(model, batch))
                scaler.scale(loss_fn(ref, batch)).backward()
                for h in handles:
                    h.remove()
            report = opt.step()
            out.ref_scales.append(scaler.get_scale())
            scaler.unscale_(ropt)
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], max_norm)
            before = scaler.get_scale()
            scaler.step(ropt)
            scaler.update()
            out.ref_skipped.append(scaler.get_scale() < before)
            sched.step()
            rsched.step()
            out.reports.append(report)
            out.deviations.append(relative_deviation(model, ref))
    finally:
        opt.close()
    out.final = [p.detach().clone() for p in model.parameters()]
    return out


def _inject_inf(g: torch.Tensor) -> torch.Tensor:
    g = g.clone()
    g.view(-1)[0] = math.inf
    return g


def test_harness_models_run() -> None:
    for name, (make_model, make_batch, loss_fn) in MODELS.items():
        model = make_model()
        loss = loss_fn(model, make_batch(torch.Generator().manual_seed(0)))
        assert torch.isfinite(loss), name
        assert any(not p.requires_grad for p in model.parameters()), f"{name} has a frozen parameter"
