"""Overlap benchmark: does the speculative optimizer step hide behind backward?

A CPU MLP whose backward and Adam step take comparable time. Backward runs on
one core (``torch.set_num_threads(1)`` in the main process); the executor (a
worker thread or a worker process, one torch thread) has the other core.
Per training step we time, after warm-up, the median of:

``backward``     ``loss.backward()`` alone, plain torch (a model copy without optimizer hooks)
``optimizer``    ``step()`` of the non-speculative optimizer (every block stepped in step())
``serial``       backward + step() with ``speculate=False``
``speculative``  backward + step() with speculation on, nothing undone
``spec+clip``    the same, but every step clips late (the first layer's gradient, the last to
                 arrive, is boosted past ``max_grad_norm``): every speculated block is undone
                 and redone (adaptive policy off, so it keeps paying). A spike: the gradients
                 are clipped by ~1e-4, so the unclipped ones the speculative steps took dominate
                 the second moments and their inverse would be lossy nearly everywhere (the
                 records keep old values: sofx.skipped_chunks)
``mild clip``    the same with a clipping coefficient of about 0.5 (the first layer's gradient
                 set to norm 2 * ``max_grad_norm``): the usual late clip, undone algebraically

and print the ratios to ``max(backward, optimizer)`` (what perfect overlap
reaches) and to ``backward + optimizer`` (no overlap). Target:
``speculative <= 1.15 x max(backward, optimizer)`` when nothing is undone.
Forward is excluded (it cannot overlap with the step). The variants run in
rotation, in runs of a few steps (the first of each run is not recorded: it
starts with another variant's data in the caches), so that a changing machine
load hits them alike; a parallelism probe (two threads of plain torch work)
says how much two-thread overlap the machine allowed during the run.

Run: ``python benchmarks/overlap.py [--width 1024 --depth 6 --batch 64 --steps 30]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import threading
import time

import torch
from torch import nn

# the sofx of this checkout (a worktree's, for an A/B), not the one installed into the environment
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sofx.offload  # noqa: E402
from sofx.speculate import AdaptivePolicy  # noqa: E402


def build_model(width: int, depth: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def _minor_faults() -> int:
    """Page faults (minor) of the calling thread so far: a backward that faults its gradient pages in
    again every step (see README "Performance notes") shows here."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def _median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


VARIANTS = ("plain", "serial", "speculative", "clip", "mild")


def time_interleaved(model: nn.Module, executor: str, x: torch.Tensor, y: torch.Tensor, steps: int, warmup: int,
                     block_numel: int, backend: str = "auto", run_length: int = 4) -> dict:
    """Median times (ms) of the four variants, run in rotation within one loop.

    The machine's load changes during a run; rotating the variants exposes them to the same load. Each
    variant runs ``run_length`` steps in a row per turn and the first of them is not recorded (with
    ``run_length`` 1 every step is, as before 2026-11-30 12:00): a step right after another variant
    starts with that variant's data in the caches (the plain backward's model copy costs the next
    speculative step ~1 ms), which a training loop never does. ``steps`` recorded steps per variant,
    after ``warmup`` rounds. ``plain`` is backward alone on a copy of the model without an optimizer;
    the others are backward + step() of a SpeculativeAdamW with speculation off / on / on with a late
    clip, each on a copy of the model of its own (its training run: the second moments of a run that
    clips a spike every step are not those of one that never clips, and a record keeps old values where
    a gradient dominates them).
    """
    plain_model = copy.deepcopy(model)
    models = {v: copy.deepcopy(model) for v in VARIANTS if v != "plain"}
    opts = {v: sofx.offload.SpeculativeAdamW(m.parameters(), lr=1e-4, weight_decay=0.01, max_grad_norm=1.0,
                                             executor=executor, block_numel=block_numel, num_threads=1,
                                             backend=backend, policy=AdaptivePolicy(enabled=False),
                                             speculate=v != "serial")
            for v, m in models.items()}
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    samples["optimizer"] = []
    faults: dict[str, list[int]] = {"plain": [], "speculative": []}
    counts = {v: {"speculated": 0, "committed": 0, "redone": 0} for v in ("speculative", "clip", "mild")}

    def _one_step(variant: str, record: bool) -> None:
        if variant == "plain":
            for p in plain_model.parameters():
                p.grad = None
            loss = nn.functional.mse_loss(plain_model(x), y)
            f0, t0 = _minor_faults(), time.perf_counter()
            loss.backward()
            if record:
                samples["plain"].append(time.perf_counter() - t0)
                faults["plain"].append(_minor_faults() - f0)
            return
        opt, model = opts[variant], models[variant]
        first = next(model.parameters())
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        # The loss is scaled down so that the gradient norm stays below max_grad_norm (nothing is
        # undone); the clip variant boosts the first layer's gradient, the last to arrive, far above it,
        # the mild one sets its norm to twice max_grad_norm.
        if variant == "clip":
            handle = first.register_hook(lambda g: g * 1e4)
        else:
            handle = first.register_hook(lambda g: g * (2.0 / g.norm())) if variant == "mild" else None
            loss = loss * 1e-3
        f0, t0 = _minor_faults(), time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        if variant == "speculative" and record:
            faults["speculative"].append(_minor_faults() - f0)
        report = opt.step()
        t2 = time.perf_counter()
        if handle is not None:
            handle.remove()
        if not record:
            return
        samples[variant].append(t2 - t0)
        if variant == "serial":
            samples["optimizer"].append(t2 - t1)
        else:
            for key in counts[variant]:
                counts[variant][key] += getattr(report, key)
            assert report.clipped == (variant != "speculative")

    recorded = max(run_length - 1, 1)  # steps recorded per run: all but the first (it follows another variant)
    rounds = -(-steps // recorded)
    try:
        for i in range(rounds + warmup):
            for k in range(len(VARIANTS)):
                variant = VARIANTS[(i + k) % len(VARIANTS)]
                for j in range(run_length):
                    _one_step(variant, record=i >= warmup and (j > 0 or run_length == 1))
        name = opts["serial"].executor
    finally:
        for opt in opts.values():
            opt.close()
    out = {v: _median_ms(samples[v]) for v in samples}
    out["executor"] = name
    out["faults"] = {k: statistics.median(v) for k, v in faults.items()}
    out["counts"] = {v: {k: n / len(samples[v]) for k, n in c.items()} for v, c in counts.items()}
    return out


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
    parser.add_argument("--warmup", type=int, default=2, help="rounds (every variant) not recorded first")
    parser.add_argument("--run-length", type=int, default=4,
                        help="steps of one variant in a row; the first of each run is not recorded (1: record all)")
    parser.add_argument("--block-numel", type=int, default=2 ** 20)
    parser.add_argument("--executors", default="thread,process")
    parser.add_argument("--backend", default="auto", help="the CPU kernels: auto (= cpu, bitwise torch.optim's "
                        "default AdamW) or cpu_fast (bitwise torch's fused AdamW, faster)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # backward on one core; the executor gets the other
    model = build_model(args.width, args.depth)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, 1)
    probe = parallelism_probe()
    print(f"# overlap benchmark: MLP {args.depth}x{args.width} ({n_params / 1e6:.2f} M params), batch {args.batch}, "
          f"median of {args.steps} steps per variant (variants interleaved, runs of {args.run_length}), "
          f"torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, 1 torch thread per side, backend {args.backend}")
    print(f"parallelism probe (two threads of plain torch work, time(both)/max(each); 1.0 = two free cores): "
          f"{probe:.2f}; load average {os.getloadavg()[0]:.1f}")
    print()
    print("| executor | backward ms | optimizer ms | serial ms | speculative ms | spec / max | spec / sum | "
          "serial / sum | spec+clip ms | clip / max | spec+mild clip ms | mild / max | "
          "blocks spec/commit/redo per step (clip; mild) | page faults per backward (plain / spec) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for executor in args.executors.split(","):
        r = time_interleaved(model, executor, x, y, args.steps, args.warmup, args.block_numel, args.backend,
                             args.run_length)
        b, o = r["plain"], r["optimizer"]
        c, k, w = r["counts"]["speculative"], r["counts"]["clip"], r["counts"]["mild"]
        print(f"| {r['executor']} | {b:.1f} | {o:.1f} | {r['serial']:.1f} | {r['speculative']:.1f} | "
              f"{r['speculative'] / max(b, o):.2f} | {r['speculative'] / (b + o):.2f} | {r['serial'] / (b + o):.2f} | "
              f"{r['clip']:.1f} | {r['clip'] / max(b, o):.2f} | {r['mild']:.1f} | {r['mild'] / max(b, o):.2f} | "
              f"{c['speculated']:.1f}/{c['committed']:.1f}/{c['redone']:.1f} "
              f"({k['speculated']:.1f}/{k['committed']:.1f}/{k['redone']:.1f}; "
              f"{w['speculated']:.1f}/{w['committed']:.1f}/{w['redone']:.1f}) | "
              f"{r['faults']['plain']:.0f} / {r['faults']['speculative']:.0f} |")


if __name__ == "__main__":
    main()
