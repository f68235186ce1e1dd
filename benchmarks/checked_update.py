"""``update`` / ``undo_redo`` without ``grads_finite``: the gradients' finiteness checked in the pass, on CPU.

    python benchmarks/checked_update.py            # GPT-2 small's 148 tensors (124M elements), float32
    python benchmarks/checked_update.py --smoke    # tiny shapes: checks that the script runs
    python benchmarks/checked_update.py --backend cpu_fast

To choose each leaf's undo strategy ``update`` must know whether its gradient is finite. The CPU kernels
read each chunk of ``FINITE_CHUNK`` (1024) gradient elements just before stepping it (``StepCall.skip``); the variants:

- ``hinted``: ``grads_finite=True`` (the caller knows, e.g. from a sum of squares): no check;
- ``checked in the step``: the default on CPU;
- ``checked by a pass before``: the same update with the check as a pass of its own over the gradients
  (what the update did before the checked step; what it still does for GPU or non-contiguous leaves);
- ``checked in the step, an inf in one chunk``: the rare overflow path (that chunk's old values copied
  out for the leaf's record, a ``"chunk_snapshot"``, and the chunk stepped afterwards);

and ``undo_redo`` of the last step with new gradients (hinted, checked in the fused pass, checked by a pass
before) or with the step's own gradients and a new ``grad_scale`` (a late clip: not read again; with an inf
in one chunk: each record keeps that chunk, a ``"chunk_snapshot"``, and each redo steps it from its kept
values, fused elsewhere);

and ``torch.optim.AdamW(fused=True).step()`` on the same tensors as the anchor. All donated, two threads,
the variants alternating round by round, medians. Each sofx variant's parameters are checked equal to
the hinted one's after the run (they took the same steps; exit 1 otherwise).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sofx  # noqa: E402
from _ab import gpt2_arguments, time_alternating  # noqa: E402

def sofx_variant(values: list[torch.Tensor], grads: list[torch.Tensor], hint: bool | None, pass_before: bool,
                 backend: str) -> tuple[Callable[[], None], Callable[[], list[torch.Tensor]]]:
    """(step, params) of ``sofx.adamw(backend=backend).update`` with donation."""
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, backend=backend)
    if pass_before:  # the check as its own pass over the gradients, as for leaves the kernels cannot check
        opt._checked_in_step = lambda leaves, *_: [False] * len(leaves)  # type: ignore[method-assign]
    box = {"params": [v.clone() for v in values]}
    box["state"] = opt.init(box["params"])

    def step() -> None:
        box["params"], box["state"], _ = opt.update(box["params"], grads, box["state"], donate=True,
                                                    grads_finite=hint)

    return step, lambda: box["params"]


def sofx_redo_variant(values: list[torch.Tensor], grads: list[torch.Tensor], grads2: list[torch.Tensor] | None,
                      hint: bool | None, pass_before: bool, backend: str,
                      ) -> tuple[Callable[[], None], Callable[[], list[torch.Tensor]]]:
    """(call, params) of ``undo_redo`` of the last step, donated, from a warm state. ``grads2``: each call
    redoes with the other of ``grads`` / ``grads2`` than the step it undoes (new gradients); None: with the
    step's own ``grads`` and a new ``grad_scale`` (a late clip)."""
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, backend=backend)
    if pass_before:
        opt._checked_in_step = lambda leaves, *_: [False] * len(leaves)  # type: ignore[method-assign]
    box = {"params": [v.clone() for v in values], "calls": 0}
    box["state"] = opt.init(box["params"])
    # Warm: not the first step (whose undo restores zero moments and is not fused), and moments made of both
    # gradients (after two steps of one, the other is a spike next to them: undo="auto" would keep snapshots,
    # see README "a gradient that dominates the moments")
    for i in range(30):
        g = grads if grads2 is None or i % 2 else grads2
        box["params"], box["state"], box["record"] = opt.update(box["params"], g, box["state"], donate=True,
                                                                grads_finite=True)

    def call() -> None:
        box["calls"] += 1
        odd = box["calls"] % 2
        new = grads if grads2 is None or not odd else grads2
        box["params"], box["state"], box["record"] = opt.undo_redo(
            box["params"], box["state"], box["record"], new, grad_scale=0.5 if odd else 1.0, donate=True,
            grads_finite=hint)

    return call, lambda: box["params"]


def torch_variant(values: list[torch.Tensor], grads: list[torch.Tensor],
                  ) -> tuple[Callable[[], None], Callable[[], list[torch.Tensor]]]:
    params = [torch.nn.Parameter(v.clone()) for v in values]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    return opt.step, lambda: [p.detach() for p in params]


def main(argv: list[str] | None = None) -> int:
    args, shapes, rounds = gpt2_arguments(__doc__.split("\n")[0], argv, backend=True)
    b = args.backend
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    grads2 = [torch.randn(s, generator=gen) for s in shapes]
    overflowing = [g.clone() for g in grads]
    big = max(range(len(shapes)), key=lambda k: overflowing[k].numel())
    overflowing[big].view(-1)[overflowing[big].numel() // 2] = float("inf")
    variants = {
        "torch AdamW(fused=True).step()": torch_variant(values, grads),
        "sofx update, hinted (grads_finite=True)": sofx_variant(values, grads, True, False, b),
        "sofx update, checked in the step": sofx_variant(values, grads, None, False, b),
        "sofx update, checked by a pass before": sofx_variant(values, grads, None, True, b),
        "sofx update, checked in the step, an inf in one chunk": sofx_variant(values, overflowing, None, False, b),
        "sofx undo_redo, new gradients, hinted": sofx_redo_variant(values, grads, grads2, True, False, b),
        "sofx undo_redo, new gradients, checked in the pass": sofx_redo_variant(values, grads, grads2, None, False, b),
        "sofx undo_redo, new gradients, checked by a pass before": sofx_redo_variant(values, grads, grads2, None,
                                                                                     True, b),
        "sofx undo_redo, the step's own gradients, new grad_scale": sofx_redo_variant(values, grads, None, None,
                                                                                      False, b),
        "sofx undo_redo, the step's own gradients, new grad_scale, an inf in one chunk": sofx_redo_variant(
            values, overflowing, None, None, False, b),
    }
    times = time_alternating({name: v[0] for name, v in variants.items()}, rounds)
    n = sum(math.prod(s) for s in shapes)
    anchor = statistics.median(times["torch AdamW(fused=True).step()"])
    print(f"{len(shapes)} tensors, {n / 1e6:.1f}M elements, float32; backend {b}; {args.threads} threads; "
          f"median of {rounds} rounds; donated")
    print()
    # the variants that took the same steps as the hinted one of their kind
    references = {"sofx update": "sofx update, hinted (grads_finite=True)",
                  "sofx undo_redo, new": "sofx undo_redo, new gradients, hinted"}
    print("| variant | ms | x torch fused | params equal to the hinted call's |")
    print("|---|---:|---:|---|")
    ok = True
    for name, ts in times.items():
        t = statistics.median(ts)
        same = "-"
        ref = next((r for prefix, r in references.items() if name.startswith(prefix)), None)
        if ref is not None and "inf" not in name:
            equal = all(torch.equal(a, b) for a, b in zip(variants[name][1](), variants[ref][1]()))
            ok = ok and equal
            same = "yes" if equal else "NO"
        print(f"| {name} | {t * 1e3:.1f} | {anchor / t:.2f} | {same} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
