"""A small functional training run with sofx.adamw: ``python -m sofx.demo``.

Fits a two-layer MLP to a random regression target with ``torch.func``,
showing ``update`` and ``undo`` on real tensors, and compares the trajectory
with ``torch.optim.AdamW`` run side by side.
"""

from __future__ import annotations

import argparse

import torch
from torch.func import functional_call, grad_and_value

import sofx


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    x = torch.randn(256, 16)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    opt = sofx.adamw(lr=3e-3, weight_decay=1e-2)
    state = opt.init(params)

    reference = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    torch_opt = torch.optim.AdamW(reference.values(), lr=3e-3, weight_decay=1e-2, foreach=False)

    first_loss = None
    for step in range(1, args.steps + 1):
        grads, loss = grad_and_value(loss_fn)(params)
        first_loss = first_loss if first_loss is not None else loss.item()
        params, state, record = opt.update(params, grads, state)
        if step == args.steps // 2:
            undone, undone_state = opt.undo(params, state, record)
            redone, _, _ = opt.update(undone, grads, undone_state)
            drift = max((redone[k] - params[k]).abs().max().item() for k in params)
            print(f"step {step}: undo then redo reproduces the step to {drift:.1e}")
        torch_opt.zero_grad()
        for k, p in reference.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        if step % 50 == 0 or step == 1:
            print(f"step {step:4d}  loss {loss.item():.5f}")

    deviation = max((params[k] - reference[k].detach()).abs().max().item() for k in params)
    print(f"done: {args.steps} steps, loss {first_loss:.4f} -> {loss_fn(params).item():.4f}; "
          f"max |sofx - torch.optim.AdamW| = {deviation:.1e}")


if __name__ == "__main__":
    main()
