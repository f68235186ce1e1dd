"""A whole optimizer step on CPU as a training loop runs it: sofx's ``serial_step`` against torch's stack.

    python benchmarks/serial_step.py            # GPT-2 small's 148 tensors (124M elements), float32
    python benchmarks/serial_step.py --smoke    # tiny shapes: checks that the script runs

torch's stack is ``GradScaler.unscale_`` (one pass over the gradients: divide, check for inf/nan),
``clip_grad_norm_`` (foreach: a pass for the norm, one to scale) and ``scaler.step`` with
``AdamW(fused=True)``, then ``scaler.update``. sofx's ``serial_step`` does the same step with the same
results (tests/test_serial_vs_torch.py): one pass for the sum of squares, which also says whether a
gradient overflowed, and the Adam kernel with unscaling and clipping folded into its gradient
multiplier (the gradients are not written). Both are given fresh scaled gradients before every
repetition (not timed), clipping is active (the gradients' norm is far above ``max_norm``), the
variants alternate round by round, medians; torch's and sofx's steps on 2 threads.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sofx  # noqa: E402
from _ab import gpt2_arguments, time_alternating  # noqa: E402
from sofx import loss_scale  # noqa: E402
from sofx.serial import serial_step  # noqa: E402

SCALE = 2.0**16
MAX_NORM = 1.0


def torch_variant(values: list[torch.Tensor], grads: list[torch.Tensor], with_scaler: bool,
                  ) -> tuple[Callable, Callable, Callable]:
    """(reset, step, params) for torch.optim.AdamW(fused=True) with clip_grad_norm_ (and GradScaler)."""
    params = [torch.nn.Parameter(v.clone()) for v in values]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**9) if with_scaler else None

    def reset() -> None:
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            if scaler is None:
                p.grad.div_(SCALE)  # already unscaled: the plain loop without a scaler
        if scaler is not None:
            scaler.scale(torch.ones(()))  # as scaler.scale(loss) before backward (creates the scale once)

    def step() -> None:
        if scaler is None:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
            opt.step()
            return
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        scaler.step(opt)
        scaler.update()

    return reset, step, lambda: [p.detach() for p in params]


def sofx_variant(values: list[torch.Tensor], grads: list[torch.Tensor], backend: str,
                 ) -> tuple[Callable, Callable, Callable]:
    """(reset, step, params) for sofx.serial_step with a GradScaler-rule loss scaler, donated buffers."""
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, backend=backend)
    rule = loss_scale.grad_scaler(init_scale=SCALE, growth_interval=10**9)
    box = {"params": [v.clone() for v in values], "grads": [g.clone() for g in grads], "scaler": rule.init()}
    box["state"] = opt.init(box["params"])

    def reset() -> None:
        for dst, g in zip(box["grads"], grads):
            dst.copy_(g)

    def step() -> None:
        out = serial_step(opt, box["params"], box["grads"], box["state"], scaler=rule, scaler_state=box["scaler"],
                          max_norm=MAX_NORM, donate=True)
        assert not out.facts.overflow and out.facts.clipped
        box["params"], box["state"], box["scaler"] = out.params, out.state, out.scaler_state

    return reset, step, lambda: box["params"]


def main(argv: list[str] | None = None) -> int:
    args, shapes, rounds = gpt2_arguments(__doc__.split("\n")[0], argv)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) * SCALE for s in shapes]  # scaled, as a backward leaves them
    variants = {
        "torch: GradScaler + clip_grad_norm_ + AdamW(fused=True)": torch_variant(values, grads, True),
        "torch: clip_grad_norm_ + AdamW(fused=True), no scaler": torch_variant(values, grads, False),
        "sofx serial_step (backend cpu)": sofx_variant(values, grads, "cpu"),
        "sofx serial_step (backend cpu_fast)": sofx_variant(values, grads, "cpu_fast"),
    }
    times = time_alternating({name: v[1] for name, v in variants.items()}, rounds,
                             resets={name: v[0] for name, v in variants.items()})
    n = sum(math.prod(s) for s in shapes)
    anchor = statistics.median(times["torch: GradScaler + clip_grad_norm_ + AdamW(fused=True)"])
    print(f"{len(shapes)} tensors, {n / 1e6:.1f}M elements, float32; {args.threads} threads; "
          f"median of {rounds} rounds; clipping active")
    print()
    # every variant took the same steps from the same values: the parameters must agree
    want = variants["torch: GradScaler + clip_grad_norm_ + AdamW(fused=True)"][2]()
    print("| variant | ms | x torch with GradScaler | max param diff vs it |")
    print("|---|---:|---:|---:|")
    worst = 0.0
    for name, ts in times.items():
        t = statistics.median(ts)
        diff = max(float((a - b).abs().max()) for a, b in zip(variants[name][2](), want))
        worst = max(worst, diff)
        print(f"| {name} | {t * 1e3:.1f} | {anchor / t:.2f} | {diff:.1e} |")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
