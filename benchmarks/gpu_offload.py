"""The offload engine's own case: a model on the GPU whose Adam runs on the CPU, during backward.

    python benchmarks/gpu_offload.py                 # on a CUDA machine: ~100M-parameter MLP, fp32
    python benchmarks/gpu_offload.py --smoke         # anywhere: tiny model on the CPU, checks the script runs

A stack of residual MLP layers (``Linear(w, 4w) -> GELU -> Linear(4w, w)``) on the GPU, fp32 (TF32 off),
trained with ``clip_grad_norm_`` by four optimizers in rotation, each step timed from the start of
backward to the end of the optimizer step (CUDA-synchronized), medians:

``gpu fused``           ``torch.optim.AdamW(fused=True)`` on the GPU: the anchor when the GPU has memory
                        for the optimizer state (the offload's reason to exist is that it has not)
``cpu offload, torch``  ZeRO-Offload without overlap, in plain torch: after backward the gradients are
                        copied to pinned CPU buffers, clipped there, stepped by ``AdamW(fused=True)`` on fp32
                        CPU masters, and the parameters copied back
``sofx serial``         ``sofx.offload.SpeculativeAdamW`` with speculation off (every block stepped in
                        ``step()``, after backward)
``sofx speculative``    the same with speculation on: each block's Adam step runs on the CPU while the rest
                        of backward runs on the GPU (gradients small enough not to clip: nothing undone)

plus ``backward`` alone (no optimizer). The table gives each step's time and its ratio to
``max(backward, cpu offload optimizer)``, the bound of perfect overlap. Afterwards the parameters of the
sofx variants are compared with the plain-torch offload's (same data, same number of steps: they must
agree to float32 rounding). ``--threads``: torch's CPU threads for the plain offload and the engine's
kernel threads (the engine's worker is one thread; its kernels use this many OpenMP threads).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sofx.offload  # noqa: E402
from sofx.speculate import AdaptivePolicy  # noqa: E402

MAX_NORM = 1.0
LR = 1e-4


class ResidualMLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchOffload:
    """fp32 masters, moments and gradient buffers on the CPU (pinned where there is a GPU); AdamW(fused)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters()]
        pin = self.params[0].is_cuda
        self.masters = [p.detach().to("cpu", copy=True).requires_grad_(True) for p in self.params]
        for m in self.masters:
            m.grad = torch.empty_like(m).pin_memory() if pin else torch.empty_like(m)
        self.opt = torch.optim.AdamW(self.masters, lr=LR, weight_decay=0.01, fused=True)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad.copy_(p.grad, non_blocking=True)
        _sync(self.params[0].device)
        torch.nn.utils.clip_grad_norm_(self.masters, MAX_NORM, foreach=True)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m, non_blocking=True)
        for p in self.params:
            p.grad = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8192, help="rows per step")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per variant (after 2 of warm-up)")
    ap.add_argument("--threads", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--block-numel", type=int, default=2**22)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks that the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        device, args.width, args.depth, args.batch, args.steps, args.threads = torch.device("cpu"), 32, 2, 16, 2, 1
        args.block_numel = 2**12
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        print("no CUDA device here: nothing to measure (--smoke runs the script on the CPU)")
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = ResidualMLP(args.width, args.depth)
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1)
    # small targets: the gradient norm stays below MAX_NORM after the first steps, so nothing is undone
    batches = [(torch.randn(args.batch, args.width, generator=gen), 0.01 * torch.randn(args.batch, args.width,
                                                                                      generator=gen))
               for _ in range(4)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]

    def loss_of(model: nn.Module, i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        return nn.functional.mse_loss(model(x), y) * 1e-3

    models = {name: copy.deepcopy(base).to(device) for name in
              ("backward", "gpu fused", "cpu offload, torch", "sofx serial", "sofx speculative")}
    gpu_opt = torch.optim.AdamW(models["gpu fused"].parameters(), lr=LR, weight_decay=0.01,
                                fused=device.type == "cuda")
    offload = TorchOffload(models["cpu offload, torch"])
    engines = {name: sofx.offload.SpeculativeAdamW(models[name].parameters(), lr=LR, weight_decay=0.01,
                                                   max_grad_norm=MAX_NORM, executor="thread",
                                                   block_numel=args.block_numel, num_threads=args.threads,
                                                   speculate=name == "sofx speculative",
                                                   policy=AdaptivePolicy(enabled=False))
               for name in ("sofx serial", "sofx speculative")}

    def run(name: str, i: int) -> tuple[float, float]:
        """(backward seconds, whole step seconds) of step ``i`` of variant ``name``."""
        model = models[name]
        loss = loss_of(model, i)
        _sync(device)
        t0 = time.perf_counter()
        if name in engines:
            engines[name].backward(loss)
        else:
            loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        if name == "gpu fused":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
            gpu_opt.step()
            gpu_opt.zero_grad()
        elif name == "cpu offload, torch":
            offload.step()
        elif name in engines:
            engines[name].step()
            engines[name].zero_grad()
        else:
            model.zero_grad()
        _sync(device)
        return t1 - t0, time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in models}
    backward_of: dict[str, list[float]] = {name: [] for name in models}
    try:
        for i in range(args.steps + 2):
            for name in models:
                b, t = run(name, i)
                if i >= 2:
                    times[name].append(t)
                    backward_of[name].append(b)
        deviation = {}
        ref = list(models["cpu offload, torch"].parameters())
        for name in engines:
            dev = max(float((a.detach() - r.detach()).abs().max() / r.detach().abs().max().clamp_min(1e-12))
                      for a, r in zip(models[name].parameters(), ref))
            deviation[name] = dev
    finally:
        for e in engines.values():
            e.close()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    backward = med["backward"]
    offload_opt = med["cpu offload, torch"] - statistics.median(backward_of["cpu offload, torch"])
    bound = max(backward, offload_opt)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)"
    out = [f"# offload: {where}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
           f"torch {torch.__version__}; {n_params / 1e6:.1f}M parameters ({args.depth} x width {args.width}), "
           f"batch {args.batch}, fp32; {args.threads} CPU threads; block_numel {args.block_numel}; median of "
           f"{args.steps} steps; command: {' '.join(sys.argv)}", "",
           "| variant | step ms | backward part ms | x max(backward, offload optimizer) | max param deviation vs "
           "torch offload |", "|---|---:|---:|---:|---:|"]
    for name in models:
        dev = f"{deviation[name]:.1e}" if name in deviation else "-"
        out.append(f"| {name} | {med[name] * 1e3:.1f} | {statistics.median(backward_of[name]) * 1e3:.1f} | "
                   f"{med[name] / bound:.2f} | {dev} |")
    out.append(f"\nbackward alone {backward * 1e3:.1f} ms; the plain offload's optimizer part (copies, clip, CPU "
               f"AdamW, copy back) {offload_opt * 1e3:.1f} ms")
    text = "\n".join(out)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_offload.md"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if all(d <= 1e-4 for d in deviation.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
