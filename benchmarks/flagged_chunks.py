"""What the chunks a checked step flags cost: an undoable ``update`` over a training run's first steps, on CPU.

    python benchmarks/flagged_chunks.py                 # overlap.py's MLP (6 x 1024), 40 steps
    python benchmarks/flagged_chunks.py --smoke         # tiny: checks that the script runs
    python benchmarks/flagged_chunks.py --l2 0.01       # sofx.adam with L2 weight decay 0.01 (adamw otherwise)

A checked step (``update`` with ``undo="auto"``, donated: what the offload engine runs) flags a chunk of
``FINITE_CHUNK`` elements where its gradient is not finite or its algebraic inverse would be too lossy
(``sofx.kernels.base.lossy_elements``: a gradient that dominates the second moment, as in a run's first
steps, while ``v`` is still small, and now and then later); the old values of a flagged chunk are copied out
for the record and the chunk stepped again (``sofx.skipped_chunks``). This runs overlap.py's model on one
fixed batch, as overlap.py does, and times per step, alternating within the step (the same gradient):

- ``undoable``: ``update(..., donate=True)``, the gradients checked in the step (records kept);
- ``plain``: ``update(..., donate=True, undoable=False)``: the same kernels' step alone, the anchor;
- ``late clip``: a third run's ``undo_redo`` of its undoable step with half the gradient (a clip found after
  the step: what a speculative step costs when validation clips, every step), checked and undoable again,
  timed alone (its ``update`` before it is not);
- ``engine's late clip``: a fourth run's, as the offload engine's validation runs it: the step's own gradient
  tensors with ``grad_scale=0.5`` (nothing read again), not undoable again (``undoable=False``);

with the share of the elements in flagged chunks. Rows: the steps in phases (the first steps, where ``v`` is
small, then the rest). The chunk size is this checkout's ``FINITE_CHUNK``: run it in two checkouts to compare
sizes. Two threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sofx  # noqa: E402
from overlap import build_model  # noqa: E402
from sofx.kernels.base import FINITE_CHUNK  # noqa: E402


def flagged_elements(record, params: list[torch.Tensor]) -> int:
    """Elements in the chunks ``record`` kept (a chunk snapshot's chunks, a whole snapshot's leaf)."""
    kept = 0
    for leaf, p in zip(record.leaves, params):
        if leaf is None:
            continue
        if leaf.strategy == "chunk_snapshot":
            kept += leaf.p_old.numel()
        elif leaf.strategy == "snapshot":
            kept += p.numel()
    return kept


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--early", type=int, default=12, help="steps in the first phase")
    ap.add_argument("--lr", type=float, default=1e-3, help="overlap.py trains at 1e-4: ReLU units come alive "
                    "later there, and their rows' first gradients meet moments still exactly 0")
    ap.add_argument("--l2", type=float, default=None, metavar="WD",
                    help="sofx.adam with this L2 weight decay (gh = g + wd * p) instead of sofx.adamw")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cpu_fast"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.width, args.depth, args.steps, args.early = 64, 2, 4, 2
    torch.set_num_threads(args.threads)
    model = build_model(args.width, args.depth)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)
    opt = (sofx.adamw(lr=args.lr, backend=args.backend) if args.l2 is None
           else sofx.adam(lr=args.lr, weight_decay=args.l2, backend=args.backend))
    start = [p.detach().clone() for p in model.parameters()]
    runs = {name: {"params": [t.clone() for t in start]} for name in ("undoable", "plain", "late clip", "engine")}
    for run in runs.values():
        run["state"] = opt.init(run["params"])
    times: dict[str, list[float]] = {"undoable": [], "plain": [], "late clip": [], "engine": []}
    shares: list[float] = []
    total = sum(t.numel() for t in start)
    for step in range(args.steps):
        with torch.no_grad():
            for p, q in zip(model.parameters(), runs["plain"]["params"]):
                p.copy_(q)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        order = ("undoable", "plain") if step % 2 == 0 else ("plain", "undoable")
        for name in order:
            run = runs[name]
            t = time.perf_counter()
            run["params"], run["state"], record = opt.update(run["params"], grads, run["state"], donate=True,
                                                             undoable=name == "undoable")
            times[name].append(time.perf_counter() - t)
            if name == "undoable":
                shares.append(flagged_elements(record, run["params"]) / total)
        clip = runs["late clip"]
        clip["params"], clip["state"], record = opt.update(clip["params"], grads, clip["state"], donate=True)
        half = [g * 0.5 for g in grads]
        t = time.perf_counter()
        clip["params"], clip["state"], record = opt.undo_redo(clip["params"], clip["state"], record, half,
                                                              donate=True)
        times["late clip"].append(time.perf_counter() - t)
        eng = runs["engine"]
        eng["params"], eng["state"], record = opt.update(eng["params"], grads, eng["state"], donate=True,
                                                         grads_finite=True)
        t = time.perf_counter()
        eng["params"], eng["state"], _ = opt.undo_redo(eng["params"], eng["state"], record, grads, grad_scale=0.5,
                                                       donate=True, undoable=False)
        times["engine"].append(time.perf_counter() - t)
    same = all(torch.equal(a, b) for a, b in zip(runs["undoable"]["params"], runs["plain"]["params"]))
    print(f"# {args.depth} x {args.width} MLP ({total / 1e6:.2f} M float32 elements), lr {args.lr:g}, "
          f"{'adamw' if args.l2 is None else f'adam (L2 weight decay {args.l2:g})'}, "
          f"backend {args.backend}, {args.threads} threads, FINITE_CHUNK {FINITE_CHUNK}, torch {torch.__version__}; "
          f"params equal: {same}")
    print()
    print("| steps | elements in flagged chunks | undoable ms | plain ms | undoable / plain | late clip ms "
          "| late clip / plain | engine's late clip ms | engine's / plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lo, hi in ((1, args.early), (args.early, args.steps), (1, args.steps)):
        u, p, c, e = (statistics.median(times[name][lo:hi]) * 1000
                      for name in ("undoable", "plain", "late clip", "engine"))
        print(f"| {lo + 1}-{hi} | {statistics.mean(shares[lo:hi]):.1%} | {u:.1f} | {p:.1f} | {u / p:.2f} | {c:.1f} "
              f"| {c / p:.2f} | {e:.1f} | {e / p:.2f} |")
    if not same:
        sys.exit("the undoable and plain runs differ")


if __name__ == "__main__":
    main()
