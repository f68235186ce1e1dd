"""The offload engine's CPU arena placement, A/B: a block's arrays from ``LocalArena`` (coloured: distinct page
offsets; in 2 MiB pages where the system gives them), from ``LocalArena(huge_pages=False)`` (coloured, 4 KiB
pages) or plain ``torch.zeros`` (all at one page offset, 4 KiB pages), both CPU backends.

    python benchmarks/arena_colouring.py            # 2^26 float32 elements, 2 threads, 6 rounds

Prints, per placement and backend, the median step, the median fused undo+redo with the same gradient and a
new multiplier (what a late clip runs in the engine) and with a new gradient (a fifth array from the same
placement). The placements stay in memory and alternate (in both orders) round by round, so that the
machine's bandwidth drift hits them alike.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels import cpu, cpu_fast  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402
from sofx.offload.arena import LocalArena  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import alternating, size_arguments, time_step_and_undo_redo  # noqa: E402

VARIANT = AdamVariant(decoupled=True, bias_correction=True)
S1 = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10, grad_scale=1.0)
S_CLIP = S1._replace(grad_scale=0.5)
S2 = S1._replace(lr=9e-4, grad_scale=0.5)


PLACEMENTS = ("one page offset", "coloured, 4 KiB pages", "coloured, huge pages (LocalArena)")


def block_arrays(n: int, placement: str) -> list[torch.Tensor]:
    """p, g, g2, m, v with fresh random values, placed as ``placement`` (one of :data:`PLACEMENTS`) says."""
    if placement == PLACEMENTS[0]:
        arrays = [torch.zeros(n) for _ in range(5)]
    else:
        arena = LocalArena("cpu", huge_pages=placement == PLACEMENTS[2])
        arrays = [arena.allocate(name, n, torch.float32) for name in ("p", "g", "g2", "m", "v")]
    gen = torch.Generator().manual_seed(0)
    p, g, g2, m, v = arrays
    p.copy_(torch.randn(n, generator=gen))
    g.copy_(torch.randn(n, generator=gen))
    g2.copy_(torch.randn(n, generator=gen))
    m.copy_(0.1 * torch.randn(n, generator=gen))
    v.copy_(0.01 * torch.rand(n, generator=gen) + 1e-4)
    return arrays


def time_backend(backend, arrays: list[torch.Tensor], reps: int) -> tuple[float, float, float]:
    """Median seconds of a step, of a clip's undo+redo and of a new gradient's (each on a state a real step
    produced)."""
    p, g, g2, m, v = arrays
    backend.step(p, g, m, v, S1, VARIANT, out=(p, m, v))
    clip = [time_step_and_undo_redo(backend, p, g, m, v, S1, g, S_CLIP, VARIANT) for _ in range(reps)]
    new = [time_step_and_undo_redo(backend, p, g, m, v, S1, g2, S2, VARIANT) for _ in range(reps)]
    return (statistics.median(t[0] for t in clip + new), statistics.median(t[1] for t in clip),
            statistics.median(t[1] for t in new))


def main() -> None:
    args = size_arguments(__doc__.split("\n")[0], rounds=6)
    placements = {name: block_arrays(1 << args.log2_numel, name) for name in PLACEMENTS}
    print("| placement | backend | step ms | clip undo+redo ms | new-gradient undo+redo ms | clip / step "
          "| new / step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for backend in (cpu, cpu_fast):
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in placements}
        for name in alternating(list(placements), args.rounds):
            times[name].append(time_backend(backend, placements[name], 3))
        for name, rows in times.items():
            step, clip, new = (statistics.median(r[i] for r in rows) for i in range(3))
            print(f"| {name} | {backend.NAME} | {step * 1e3:.1f} | {clip * 1e3:.1f} | {new * 1e3:.1f} | "
                  f"{clip / step:.2f} | {new / step:.2f} |", flush=True)


if __name__ == "__main__":
    main()
