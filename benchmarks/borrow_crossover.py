"""Borrowing autograd's gradients or copying them into the block buffer: where each is faster.

    python benchmarks/borrow_crossover.py                  # inline and thread executors
    python benchmarks/borrow_crossover.py --smoke          # two sizes, 3 rounds: checks that it runs

``sofx.offload``'s in-process executors borrow the gradients of blocks whose parameters hold at least
``BORROW_MIN_NUMEL`` elements on average (``sofx.offload.engine``) and copy the others into the block's
buffer. A borrowed block is stepped one Adam leaf per parameter (host work per leaf), a copied one as one
flat leaf (the copy reads and writes the gradient once more, and takes the sum of squares in that pass).
Per parameter size: a model of 8 bias-free d x d layers (one block each) trained with each policy forced
(``BORROW_MIN_NUMEL`` 0: always borrow, 2^40: always copy), the variants alternating iteration by
iteration; medians of milliseconds per iteration (zero_grad, forward, backward, step). One torch thread.
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

import sofx.offload  # noqa: E402
from sofx.offload import engine as engine_module  # noqa: E402


def make(width: int, borrow: bool, executor: str) -> tuple[Callable[[], None], sofx.offload.SpeculativeAdamW]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(8)])
    saved = engine_module.BORROW_MIN_NUMEL
    engine_module.BORROW_MIN_NUMEL = 0 if borrow else 1 << 40
    try:
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-3, executor=executor)
    finally:
        engine_module.BORROW_MIN_NUMEL = saved
    x = torch.randn(4, width)

    def iteration() -> None:
        opt.zero_grad()
        opt.backward(model(x).square().mean())
        opt.step()

    for _ in range(3):
        iteration()
    return iteration, opt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    widths = (16, 64) if args.smoke else (64, 128, 181, 256, 362, 512, 724)
    rounds = 3 if args.smoke else args.rounds
    print(f"8 layers of d x d, no bias; one torch thread; median of {rounds} iterations per variant, alternating; "
          f"BORROW_MIN_NUMEL = {engine_module.BORROW_MIN_NUMEL}")
    print()
    print("| executor | d | elements per parameter | borrow ms | copy ms | copy / borrow |")
    print("|---|---:|---:|---:|---:|---:|")
    for executor in ("inline", "thread"):
        for width in widths:
            runs = {b: make(width, b, executor) for b in (True, False)}
            times: dict[bool, list[float]] = {True: [], False: []}
            try:
                for _ in range(rounds):
                    for b, (iteration, _) in runs.items():
                        t = time.perf_counter()
                        iteration()
                        times[b].append(time.perf_counter() - t)
            finally:
                for _, opt in runs.values():
                    opt.close()
            borrow, copy = (statistics.median(times[b]) * 1e3 for b in (True, False))
            print(f"| {executor} | {width} | {width * width} | {borrow:.3f} | {copy:.3f} | {copy / borrow:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
