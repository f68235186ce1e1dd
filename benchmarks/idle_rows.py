"""Steps over tensors with idle rows: the embedding-table case, where most rows get no gradient for long.

    python benchmarks/idle_rows.py            # 2^26 elements, 2 threads, 7 repetitions (--rounds)

Per storage dtype (float32; all-bf16) and fraction of idle elements (0, 1/2, all), the median time of one
in-place step of each sofx CPU backend and of ``torch.optim.AdamW(fused=True)`` on the same values, and
of each backend's fused undo+redo of that step (a late clip: the same gradient, half the scale), for
two kinds of idle rows: **zero** (g, m and v all 0: rows never touched) and **decayed** (g = 0, m = 1e-30,
v = 1e-34: rows last touched some 50,000 steps ago, whose second moment has decayed below 2^-95, where
MKL's square root takes another path). A slow path taken per vector shows as a ratio well above the
0-fraction row; torch's fused step is the anchor measured on the same data.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels import cpu, cpu_fast  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import size_arguments  # noqa: E402

VARIANT = AdamVariant(decoupled=True, bias_correction=True)
STEP = 60_000
SCALARS = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=STEP, grad_scale=1.0)
CLIPPED = SCALARS._replace(grad_scale=0.5)
IDLE = {"zero": (0.0, 0.0), "decayed": (1e-30, 1e-34)}  # (m, v) of an idle element; its gradient is 0


def arrays(n: int, dtype: torch.dtype, idle: str, fraction: float) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = 0.1 * torch.randn(n, generator=gen), 0.01 * torch.rand(n, generator=gen) + 1e-4
    k = int(n * fraction)
    g[:k] = 0.0
    m[:k], v[:k] = IDLE[idle]
    return tuple(t.to(dtype) for t in (p, g, m, v))


def time_sofx(backend, values: tuple[torch.Tensor, ...], reps: int) -> tuple[float, float]:
    """Median seconds of a step and of the undo+redo of that step (same gradient, half the scale)."""
    steps, redos = [], []
    for _ in range(reps):
        p, g, m, v = (t.clone() for t in values)
        t0 = time.perf_counter()
        backend.step(p, g, m, v, SCALARS, VARIANT, out=(p, m, v))
        t1 = time.perf_counter()
        backend.undo_redo(p, m, v, g, SCALARS, g, CLIPPED, VARIANT, out=(p, m, v))
        t2 = time.perf_counter()
        steps.append(t1 - t0)
        redos.append(t2 - t1)
    return statistics.median(steps), statistics.median(redos)


def time_torch_fused(values: tuple[torch.Tensor, ...], reps: int) -> float:
    times = []
    for _ in range(reps):
        p, g, m, v = (t.clone() for t in values)
        param = torch.nn.Parameter(p)
        param.grad = g
        opt = torch.optim.AdamW([param], lr=SCALARS.lr, betas=(SCALARS.beta1, SCALARS.beta2), eps=SCALARS.eps,
                                weight_decay=SCALARS.weight_decay, fused=True)
        opt.state[param] = {"step": torch.tensor(float(STEP - 1)), "exp_avg": m, "exp_avg_sq": v}
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    args = size_arguments(__doc__.split("\n")[0], rounds=7)
    n = 1 << args.log2_numel
    print(f"{n} elements, {torch.get_num_threads()} threads, step {STEP}, median of {args.rounds}")
    print()
    print("| dtype | idle rows | idle fraction | sofx cpu step ms | sofx cpu_fast step ms | torch AdamW fused ms "
          "| sofx cpu undo+redo ms | sofx cpu_fast undo+redo ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for idle in IDLE:
            for fraction in (0.0, 0.5, 1.0):
                values = arrays(n, dtype, idle, fraction)
                (step, redo), (step_fast, redo_fast) = (time_sofx(b, values, args.rounds) for b in (cpu, cpu_fast))
                row = [step, step_fast, time_torch_fused(values, args.rounds), redo, redo_fast]
                print(f"| {str(dtype)[6:]} | {idle} | {fraction:g} | " + " | ".join(f"{t * 1e3:.1f}" for t in row)
                      + " |", flush=True)


if __name__ == "__main__":
    main()
