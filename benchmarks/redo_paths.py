"""``Adam.undo_redo`` on the leaves that went unfused (an undo, then a step) before stop 47, on CPU.

    python benchmarks/redo_paths.py            # 2^22 elements per leaf
    python benchmarks/redo_paths.py --smoke    # tiny: checks that the script runs

Rows:

- ``first step``: the redo of a leaf's first step from zero moments (a clip of it: the same gradient, ``grad_scale``
  1e-3), float32 parameters and moments, ``adamw``: fused since stop 47 where the inverse gives the zero moments
  back exactly (``sofx.kernels.base.zeros_come_back``);
- ``bf16 params, late clip`` / ``new gradient``: a bfloat16-parameter leaf with float32 moments, whose records keep
  the old parameter (``"param_snapshot"``), redone with its own gradient at another ``grad_scale`` or with a new
  one: fused since stop 47 (the new record keeps the undone record's parameter).

Per backend (``cpu``, ``cpu_fast``), donated and not: the minimum and the median over the calls, in ms, and the
plain step of the same leaf (``undoable=False``, donated) for scale. Two threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sofx  # noqa: E402


def _times(run: Callable[[int], None], calls: int) -> tuple[float, float]:
    """``(min, median)`` ms of ``calls`` calls of ``run(i)`` after two warm-up calls."""
    times = []
    for i in range(calls + 2):
        start = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - start)
    times = times[2:]
    return min(times) * 1e3, statistics.median(times) * 1e3


def first_step(backend: str, n: int, calls: int, donate: bool) -> tuple[float, float]:
    """The undo_redo of a first step from zero moments (timed alone: each call starts from a fresh init)."""
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(n, generator=gen), {"w": torch.randn(n, generator=gen)}
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, backend=backend)
    times = []
    for _ in range(calls + 2):
        params = {"w": p0.clone()}
        p1, s1, rec = opt.update(params, g, opt.init(params), donate=donate)
        start = time.perf_counter()
        opt.undo_redo(p1, s1, rec, g, grad_scale=1e-3, donate=donate)
        times.append(time.perf_counter() - start)
    times = times[2:]
    return min(times) * 1e3, statistics.median(times) * 1e3


def bf16_params(backend: str, n: int, calls: int, donate: bool, new_gradient: bool) -> tuple[float, float]:
    """A chain of undo_redo calls of a bf16-parameter leaf (float32 moments after 100 steps), alternating the
    ``grad_scale``; with ``new_gradient`` every other call's gradient is another."""
    gen = torch.Generator().manual_seed(0)
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, state_dtype=torch.float32, backend=backend)
    params = {"w": torch.randn(n, generator=gen).to(torch.bfloat16)}
    state = sofx.AdamState({"w": torch.tensor(100)}, {"w": 0.1 * torch.randn(n, generator=gen)},
                           {"w": torch.randn(n, generator=gen).square() + 0.5})
    g = {"w": torch.randn(n, generator=gen).to(torch.bfloat16)}
    g2 = {"w": torch.randn(n, generator=gen).to(torch.bfloat16)} if new_gradient else g
    box = list(opt.update(params, g, state, donate=donate))
    if box[2].strategies() != ["param_snapshot"]:
        sys.exit(f"expected a param_snapshot record, got {box[2].strategies()}")

    def run(i: int) -> None:
        box[:] = opt.undo_redo(*box, g2 if i % 2 == 0 else g, grad_scale=0.5 if i % 2 == 0 else 0.7, donate=donate)

    return _times(run, calls)


def plain_step(backend: str, n: int, calls: int, dtype: torch.dtype) -> tuple[float, float]:
    """A donated step without a record of an ``n``-element leaf of ``dtype`` parameters, float32 moments."""
    gen = torch.Generator().manual_seed(0)
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, state_dtype=torch.float32, backend=backend)
    params = {"w": torch.randn(n, generator=gen).to(dtype)}
    g = {"w": torch.randn(n, generator=gen).to(dtype)}
    box = [params, opt.init(params)]
    box[:2] = opt.update(*box[:1], g, box[1], donate=True, undoable=False)[:2]

    def run(i: int) -> None:
        box[:2] = opt.update(box[0], g, box[1], donate=True, undoable=False)[:2]

    return _times(run, calls)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.numel, args.calls = 5000, 2
    torch.set_num_threads(args.threads)
    print(f"# one leaf of {args.numel} elements, sofx.adamw, min / median of {args.calls} calls, {args.threads} "
          f"threads, torch {torch.__version__}")
    print()
    print("| row | backend | donated | min ms | median ms |")
    print("|---|---|---|---:|---:|")
    for backend in ("cpu", "cpu_fast"):
        rows = [("plain step, fp32", True, lambda d: plain_step(backend, args.numel, args.calls, torch.float32)),
                ("plain step, bf16 params", True,
                 lambda d: plain_step(backend, args.numel, args.calls, torch.bfloat16))]
        for donate in (True, False):
            rows += [("first step", donate, lambda d: first_step(backend, args.numel, args.calls, d)),
                     ("bf16 params, late clip", donate,
                      lambda d: bf16_params(backend, args.numel, args.calls, d, False)),
                     ("bf16 params, new gradient", donate,
                      lambda d: bf16_params(backend, args.numel, args.calls, d, True))]
        for name, donate, run in rows:
            low, mid = run(donate)
            print(f"| {name} | {backend} | {'yes' if donate else 'no'} | {low:.2f} | {mid:.2f} |")


if __name__ == "__main__":
    main()
