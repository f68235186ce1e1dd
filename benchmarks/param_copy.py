"""The step with a parameter copy: ``step(..., p_copy=c)`` against a step followed by ``c.copy_(p)``.

    python benchmarks/param_copy.py             # 2^26 elements on 2 threads; 2^20 and 2^22 on one thread

The offload engine gives the model the new parameters through a second buffer per parameter (its publish
buffer, in the model's dtype). The CPU kernels write that copy per chunk (``FINITE_CHUNK``) right after the
step of the chunk, with streaming stores (``copy_params`` in the C source); before, the engine copied each
block after its step, which read the masters from memory again. One thread on 2^20-2^22 elements is the
offload engine's case (its worker steps a block at a time on one core). float32 masters and moments;
copies in float32 and bfloat16; ``cpu`` backend, in-place (donated) steps, the variants alternating round
by round, medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

# the sofx of this checkout (a worktree's, for an A/B), not the one installed into the environment
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels import cpu  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402

S = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10, grad_scale=0.5)
VARIANT = AdamVariant(decoupled=True, bias_correction=True)


def time_case(n: int, threads: int, rounds: int) -> dict[str, float]:
    """Median ms of each variant for ``n`` elements on ``threads`` threads."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = 0.1 * torch.randn(n, generator=gen), 0.01 * torch.rand(n, generator=gen) + 1e-4
    copies = {torch.float32: torch.empty(n), torch.bfloat16: torch.empty(n, dtype=torch.bfloat16)}

    def separate(c: torch.Tensor) -> None:
        cpu.step(p, g, m, v, S, VARIANT, out=(p, m, v))
        c.copy_(p)

    variants = {"step": lambda: cpu.step(p, g, m, v, S, VARIANT, out=(p, m, v))}
    for dtype, c in copies.items():
        name = str(dtype).replace("torch.", "")
        variants[f"step, then copy_ ({name})"] = lambda c=c: separate(c)
        variants[f"step(p_copy) ({name})"] = lambda c=c: cpu.step(p, g, m, v, S, VARIANT, out=(p, m, v), p_copy=c)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rnd in range(rounds + 1):
        for name in variants if rnd % 2 == 0 else reversed(list(variants)):
            t = time.perf_counter()
            variants[name]()
            if rnd > 0:  # round 0 warms up
                times[name].append(time.perf_counter() - t)
            cpu.undo(p, g, m, v, S, VARIANT, out=(p, m, v))  # every step starts from the same state
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="26:2,20:1,22:1", help="log2(elements):threads, comma-separated")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases.split(",")]
    print(f"float32 masters and moments, backend cpu, median of {args.rounds} rounds (ms)")
    print()
    results = {case: time_case(1 << case[0], case[1], args.rounds) for case in cases}
    names = list(next(iter(results.values())))
    print("| variant | " + " | ".join(f"2^{k}, {t} thread{'s' * (t > 1)}" for k, t in cases) + " |")
    print("|---|" + "---:|" * len(cases))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{results[case][name]:.2f}" for case in cases) + " |")


if __name__ == "__main__":
    main()
