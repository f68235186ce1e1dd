"""The offload engine's page colouring, A/B: a block's four arrays from ``LocalArena`` (coloured: four
distinct page offsets) or plain ``torch.zeros`` (all at one page offset), both CPU backends.

    python benchmarks/arena_colouring.py            # 2^26 float32 elements, 2 threads, 7 repetitions

Prints, per placement and backend, the median step and the median fused undo+redo with the same
gradient and a new multiplier (what a late clip runs in the engine). Both placements stay in memory
and alternate (in both orders) round by round, so that the machine's bandwidth drift hits them alike.
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


def block_arrays(n: int, coloured: bool) -> list[torch.Tensor]:
    """p, g, m, v with fresh random values."""
    if coloured:
        arena = LocalArena("cpu")
        arrays = [arena.allocate(name, n, torch.float32) for name in ("p", "g", "m", "v")]
    else:
        arrays = [torch.zeros(n) for _ in range(4)]
    gen = torch.Generator().manual_seed(0)
    p, g, m, v = arrays
    p.copy_(torch.randn(n, generator=gen))
    g.copy_(torch.randn(n, generator=gen))
    m.copy_(0.1 * torch.randn(n, generator=gen))
    v.copy_(0.01 * torch.rand(n, generator=gen) + 1e-4)
    return arrays


def time_backend(backend, arrays: list[torch.Tensor], reps: int) -> tuple[float, float]:
    """Median seconds of a step and of a clip's undo+redo (each on a state a real step produced)."""
    p, g, m, v = arrays
    backend.step(p, g, m, v, S1, VARIANT, out=(p, m, v))
    times = [time_step_and_undo_redo(backend, p, g, m, v, S1, g, S_CLIP, VARIANT) for _ in range(reps)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main() -> None:
    args = size_arguments(__doc__.split("\n")[0], rounds=6)
    placements = {"one page offset": block_arrays(1 << args.log2_numel, False),
                  "coloured (LocalArena)": block_arrays(1 << args.log2_numel, True)}
    print("| placement | backend | step ms | clip undo+redo ms | undo+redo / step |")
    print("|---|---|---:|---:|---:|")
    for backend in (cpu, cpu_fast):
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in placements}
        for name in alternating(list(placements), args.rounds):
            step, clip = time_backend(backend, placements[name], 3)
            times[name][0].append(step)
            times[name][1].append(clip)
        for name, (steps, clips) in times.items():
            step, clip = statistics.median(steps), statistics.median(clips)
            print(f"| {name} | {backend.NAME} | {step * 1e3:.1f} | {clip * 1e3:.1f} | {clip / step:.2f} |", flush=True)


if __name__ == "__main__":
    main()
