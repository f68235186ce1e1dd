"""Overlap benchmark: does the speculative optimizer step hide behind backward?

A CPU MLP whose backward and Adam step take comparable time. Backward runs on
one core (``torch.set_num_threads(1)`` in the main process); the executor (a
worker thread or a worker process, one torch thread) has the other core.
Per training step we time, after warm-up, the median of:

``backward``     ``loss.backward()`` alone, plain torch (no optimizer hooks)
``optimizer``    ``step()`` of the non-speculative optimizer (every block stepped in step())
``serial``       backward + step() with ``speculate=False``
``speculative``  backward + step() with speculation on
``spec+clip``    the same, but every step clips late (the first layer's gradient, the last to
                 arrive, is boosted past ``max_grad_norm``): every speculated block is undone
                 and redone (adaptive policy off, so it keeps paying)

and print the ratios to ``max(backward, optimizer)`` (what perfect overlap
reaches) and to ``backward + optimizer`` (no overlap). Target:
``speculative <= 1.15 x max(backward, optimizer)`` when nothing is undone.
Forward is timed separately and excluded (it cannot overlap with the step).

Run: ``python benchmarks/overlap.py [--width 1024 --depth 6 --batch 64 --steps 30]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Callable

import torch
from torch import nn

import sofx.offload
from sofx.speculate import AdaptivePolicy


def build_model(width: int, depth: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def _median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def time_plain_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, warmup: int) -> dict:
    fwd, bwd = [], []
    for i in range(steps + warmup):
        for p in model.parameters():
            p.grad = None
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return {"forward": _median_ms(fwd), "backward": _median_ms(bwd)}


def time_optimizer(model: nn.Module, make_opt: Callable[[nn.Module], sofx.offload.SpeculativeAdamW],
                   x: torch.Tensor, y: torch.Tensor, steps: int, warmup: int, boost_first: bool = False) -> dict:
    """Median backward, step() and backward+step() times (ms) and the speculation counts."""
    opt = make_opt(model)
    first = next(model.parameters())
    bwd, stp, tot = [], [], []
    counts = {"speculated": 0, "committed": 0, "redone": 0, "stepped_late": 0}
    try:
        for i in range(steps + warmup):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            handle = first.register_hook(lambda g: g * 1e4) if boost_first else None
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            report = opt.step()
            t2 = time.perf_counter()
            if handle is not None:
                handle.remove()
            if i >= warmup:
                bwd.append(t1 - t0)
                stp.append(t2 - t1)
                tot.append(t2 - t0)
                for k in counts:
                    counts[k] += getattr(report, k)
        executor = opt.executor
    finally:
        opt.close()
    return {"backward": _median_ms(bwd), "step": _median_ms(stp), "total": _median_ms(tot),
            "executor": executor, **{k: v / steps for k, v in counts.items()}}


def parallelism_probe(repeats: int = 2) -> float:
    """How much two threads of plain torch work overlap here: ``time(both) / max(time(each))``.

    1.0 means two free cores; about 2.0 means the machine gives this process one core (other
    load). The overlap the optimizer can reach is bounded by this number.
    """
    a = torch.randn(384, 384)
    p, g = torch.randn(1 << 21), torch.randn(1 << 21)

    def main_work() -> None:
        for _ in range(30):
            a @ a

    def side_work() -> None:
        for _ in range(30):
            p.mul_(0.999).add_(g, alpha=1e-3)

    ratios = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        main_work()
        t1 = time.perf_counter()
        side_work()
        t2 = time.perf_counter()
        thread = threading.Thread(target=side_work)
        thread.start()
        main_work()
        thread.join()
        t3 = time.perf_counter()
        ratios.append((t3 - t2) / max(t1 - t0, t2 - t1))
    return min(ratios)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block-numel", type=int, default=2 ** 20)
    parser.add_argument("--executors", default="thread,process")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # backward on one core; the executor gets the other
    model = build_model(args.width, args.depth)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, 1)

    plain = time_plain_backward(model, x, y, args.steps, args.warmup)

    def factory(executor: str, speculate: bool, clip: bool) -> Callable[[nn.Module], sofx.offload.SpeculativeAdamW]:
        def make(m: nn.Module) -> sofx.offload.SpeculativeAdamW:
            return sofx.offload.SpeculativeAdamW(
                m.parameters(), lr=1e-4, weight_decay=0.01, max_grad_norm=1e3 if not clip else 1.0,
                executor=executor, block_numel=args.block_numel, speculate=speculate, num_threads=1,
                policy=AdaptivePolicy(enabled=False))
        return make

    print(f"# overlap benchmark: MLP {args.depth}x{args.width} ({n_params / 1e6:.2f} M params), batch {args.batch}, "
          f"{args.steps} timed steps (median), torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"1 torch thread per side")
    probe = parallelism_probe()
    print(f"parallelism probe (two threads of plain torch work, time(both)/max(each); 1.0 = two free cores): "
          f"{probe:.2f}; load average {os.getloadavg()[0]:.1f}")
    print(f"forward {plain['forward']:.1f} ms (excluded), plain backward {plain['backward']:.1f} ms")
    print()
    print("| executor | backward ms | optimizer ms | serial ms | speculative ms | spec / max | spec / sum | "
          "serial / sum | spec+clip ms | clip / max | blocks spec/commit/redo per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for executor in args.executors.split(","):
        serial = time_optimizer(model, factory(executor, False, False), x, y, args.steps, args.warmup)
        spec = time_optimizer(model, factory(executor, True, False), x, y, args.steps, args.warmup)
        clip = time_optimizer(model, factory(executor, True, True), x, y, args.steps, args.warmup, boost_first=True)
        b, o = plain["backward"], serial["step"]
        print(f"| {spec['executor']} | {b:.1f} | {o:.1f} | {serial['total']:.1f} | {spec['total']:.1f} | "
              f"{spec['total'] / max(b, o):.2f} | {spec['total'] / (b + o):.2f} | {serial['total'] / (b + o):.2f} | "
              f"{clip['total']:.1f} | {clip['total'] / max(b, o):.2f} | "
              f"{spec['speculated']:.1f}/{spec['committed']:.1f}/{spec['redone']:.1f} "
              f"(clip: {clip['speculated']:.1f}/{clip['committed']:.1f}/{clip['redone']:.1f}) |")


if __name__ == "__main__":
    main()
