"""Audit of ``SpeculativeAdamW`` as a drop-in for ``torch.optim.AdamW``: bugs found, each with its test."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from test_offload_support import one_torch_thread, relative_deviation  # noqa: F401 (autouse fixture)

import sofx.offload
from sofx.errors import HParamError

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
