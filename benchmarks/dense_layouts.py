"""An update of leaves in a dense layout that is not contiguous, against contiguous leaves, on CPU.

    python benchmarks/dense_layouts.py            # one 4096 x 4096 float32 leaf per layout
    python benchmarks/dense_layouts.py --smoke    # tiny: checks that the script runs

A transposed matrix (``torch.randn(n, n).t()``) and a channels_last convolution weight are dense: their elements
fill their memory span, in another order than the logical one. Their gradients (autograd) and moments
(``init``'s ``zeros_like``) share the layout, and the kernels step such a leaf over its memory in memory order
(``sofx/kernels/layout.py``; before stop 46 they copied it in and the results back). Per layout: the update
without a record (``undoable=False``), checked (``undo="auto"``: in the kernel, over the leaf's memory in
memory order, ``sofx/memory_order_leaves.py``; until stop 47 a pass before the step for these leaves) and a late
clip (``undo_redo`` of the step before, the same gradient with another ``grad_scale``: fused and checked in one
pass), donated, the minimum over the calls, with the ratio to the contiguous leaf's time. The transposed leaf
(the contiguous one's values, transposed) is checked to end as the contiguous one's transpose (exit 1 otherwise).
Two threads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sofx  # noqa: E402


def leaf(layout: str, side: int, gen: torch.Generator) -> torch.Tensor:
    """A ``side * side``-element float32 tensor in ``layout``."""
    if layout == "contiguous":
        return torch.randn(side, side, generator=gen)
    if layout == "transposed":
        return torch.randn(side, side, generator=gen).t()
    # channels_last: (out, in, 4, 4) with out * in * 16 = side^2
    return torch.randn(side // 4, side // 4, 4, 4, generator=gen).contiguous(memory_format=torch.channels_last)


def time_update(layout: str, side: int, calls: int, undoable: bool | None) -> tuple[float, torch.Tensor]:
    """The minimum time of ``calls`` donated updates of one leaf in ``layout`` (the same values whatever the
    layout: generated from one seed), and the leaf after them. ``undoable=None``: late clips instead, each
    ``undo_redo`` of the step before with the same gradient and another ``grad_scale`` (checked)."""
    gen = torch.Generator().manual_seed(0)
    p, g = leaf(layout, side, gen), leaf(layout, side, gen)
    opt = sofx.adamw(lr=1e-3)
    params, grads = {"w": p}, {"w": g}
    state = opt.init(params)
    for _ in range(2):  # (moments not zero: a first step's undo_redo is not fused)
        params, state, rec = opt.update(params, grads, state, donate=True)
    best = float("inf")
    for k in range(calls):
        start = time.perf_counter()
        if undoable is None:
            params, state, rec = opt.undo_redo(params, state, rec, grads, grad_scale=0.5 + 0.25 * (k % 2),
                                               donate=True)
        else:
            params, state, _ = opt.update(params, grads, state, donate=True, undoable=undoable)
        best = min(best, time.perf_counter() - start)
    return best, params["w"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.side, args.calls = 64, 2
    torch.set_num_threads(args.threads)
    print(f"# one {args.side} x {args.side} float32 leaf per layout, sofx.adamw (backend auto), donated, min of "
          f"{args.calls} calls, {args.threads} threads, torch {torch.__version__}")
    print()
    print("| layout | undoable=False ms | x contiguous | checked ms | x contiguous | late clip ms | x contiguous |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base: dict[bool | None, float] = {}
    ref: torch.Tensor | None = None
    same = True
    for layout in ("contiguous", "transposed", "channels_last"):
        row = [layout]
        for undoable in (False, True, None):
            t, result = time_update(layout, args.side, args.calls, undoable)
            base.setdefault(undoable, t)
            row += [f"{t * 1e3:.1f}", f"{t / base[undoable]:.2f}"]
            if layout == "contiguous" and undoable:
                ref = result
            elif undoable and layout == "transposed":  # (its values are the contiguous leaf's, transposed)
                same &= ref is not None and torch.equal(result, ref.t())
        print("| " + " | ".join(row) + " |")
    if not same:
        sys.exit("the transposed leaf's results differ from the contiguous leaf's")


if __name__ == "__main__":
    main()
