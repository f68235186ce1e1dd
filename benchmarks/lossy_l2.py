"""How exactly an algebraic undo restores the elements the lossy check lets through, in L2 mode (a study, no timing).

    python benchmarks/lossy_l2.py                           # 216 cases of 2^15 elements, a few seconds
    python benchmarks/lossy_l2.py --share-v 1 --share-m 1   # the L2 terms' weights (base.py's LOSSY_L2_V, _M)
    python benchmarks/lossy_l2.py --smoke                   # a few small cases: checks that the script runs

In L2 mode (``gh = g + wd * p``) the inverse recovers p an ulp or so off, and ``wd`` times that error enters the
recovered moments (``sofx.kernels.base.LOSSY_V_RATIO``'s comment has the algebra). For each case this takes a
state, the reference step and its reference inverse (float32), and reports, over the elements
``lossy_elements`` does not flag, the worst error of the recovered ``v`` (in ulps of v, 2^-24 relative; the
tolerance, 1e-6, is 16.8) and of ``m`` (in ulps of ``sqrt(v) + |m|``), with the share of elements flagged.
Two checks side by side: this checkout's, and the ratios alone (``p_kept=True``: the check of a step whose
record keeps p, which has no L2 terms). Cases: lr 1e-3..1, wd 0.01..0.5, betas (0.9, 0.999), (0.99, 0.99),
(0.9, 0.95), 1, 3 or 30 steps in, on two kinds of state:

- ``evolved``: p over three decades, Adam (L2) steps from zero moments with gradients over two decades, then a
  gradient over three, an eighth of it near ``-wd p`` (``gh`` small beside ``wd p``: where L2 training tends);
- ``random``: p, g, m and v drawn independently over four to eight decades.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels import base, reference  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402

L2 = AdamVariant(decoupled=False)
ULP = 2.0 ** -24


def decades(gen: torch.Generator, n: int, lo: float, hi: float) -> torch.Tensor:
    return 10 ** torch.empty(n).uniform_(lo, hi, generator=gen)


def evolved(gen: torch.Generator, n: int, s: AdamScalars) -> tuple[torch.Tensor, ...]:
    """``p, g, m, v`` after ``s.step - 1`` Adam steps (gradients ~1e-2 over two decades), the next gradient."""
    p = torch.randn(n, generator=gen) * decades(gen, n, -2, 1)
    m, v = torch.zeros(n), torch.zeros(n)
    for t in range(1, int(s.step)):
        g = torch.randn(n, generator=gen) * 1e-2 * decades(gen, n, -1, 1)
        p, m, v = reference.step(p, g, m, v, s._replace(step=t), L2)
    g = torch.randn(n, generator=gen) * 1e-2 * decades(gen, n, -1.5, 1.5)
    k = n // 8
    g[:k] = -float(s.weight_decay) * p[:k] * (1 + 1e-3 * torch.randn(k, generator=gen))
    return p, g, m, v


def random_state(gen: torch.Generator, n: int, s: AdamScalars) -> tuple[torch.Tensor, ...]:
    p = torch.randn(n, generator=gen) * decades(gen, n, -3, 1)
    g = torch.randn(n, generator=gen) * decades(gen, n, -4, 0)
    m = torch.randn(n, generator=gen) * decades(gen, n, -4, 0)
    return p, g, m, decades(gen, n, -8, 0)


def errors(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
           s: AdamScalars) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element: the recovered v's error in ulps of v, the recovered m's in ulps of ``sqrt(v) + |m|``."""
    p2, m2, v2 = reference.step(p, g, m, v, s, L2)
    _, m0, v0 = reference.undo(p2, g, m2, v2, s, L2)
    return (v0 - v).abs() / v.clamp_min(1e-30) / ULP, (m0 - m).abs() / (v.sqrt() + m.abs()).clamp_min(1e-30) / ULP


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--share-v", type=float, default=base.LOSSY_L2_V, help="W's weight in the v test (base.LOSSY_L2_V)")
    ap.add_argument("--share-m", type=float, default=base.LOSSY_L2_M, help="W's weight in the m test (base.LOSSY_L2_M)")
    ap.add_argument("--log2-n", type=int, default=15, help="elements per case: 2^N")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    saved = base.LOSSY_L2_V, base.LOSSY_L2_M
    base.LOSSY_L2_V, base.LOSSY_L2_M = args.share_v, args.share_m  # (read at each check: lossy_l2)
    try:
        n = 1 << (8 if args.smoke else args.log2_n)
        lrs, wds, betas, steps = ((1e-3, 1.0), (0.1,), ((0.9, 0.999),), (1, 3)) if args.smoke else (
            (1e-3, 1e-2, 0.1, 1.0), (0.01, 0.1, 0.5), ((0.9, 0.999), (0.99, 0.99), (0.9, 0.95)), (1, 3, 30))
        gen = torch.Generator().manual_seed(0)
        rows: dict[tuple[str, str, str], list[float]] = {}  # (kind, lr, check): cases, flagged, worst v, m
        for kind, make in (("evolved", evolved), ("random", random_state)):
            for lr in lrs:
                for wd in wds:
                    for b1, b2 in betas:
                        for t in steps:
                            s = AdamScalars(lr, b1, b2, 1e-8, wd, t + 1, 1.0)
                            p, g, m, v = make(gen, n, s)
                            ev, em = errors(p, g, m, v, s)
                            for check, kept in (("this checkout's", False), ("ratios alone", True)):
                                ok = ~base.lossy_elements(p, g, v, s, False, m=m, p_kept=kept) & (v > 0)
                                for key in ((kind, f"{lr:g}", check), (kind, "all", check)):
                                    r = rows.setdefault(key, [0, 0.0, 0.0, 0.0])
                                    r[0] += 1
                                    r[1] += 1 - float(ok.float().mean())
                                    r[2] = max(r[2], float(ev[ok].max()) if ok.any() else 0.0)
                                    r[3] = max(r[3], float(em[ok].max()) if ok.any() else 0.0)
    finally:  # (the test runner's process runs other scripts after this one)
        base.LOSSY_L2_V, base.LOSSY_L2_M = saved
    print(f"# L2 terms' weights: {args.share_v:.3g} in the v test, {args.share_m:.3g} in the m test; {n} elements "
          f"per case, torch {torch.__version__}")
    print()
    print("| state | lr | check | elements flagged | worst v, ulps of v | worst m, ulps of sqrt(v) + abs(m) |")
    print("|---|---|---|---:|---:|---:|")
    for (kind, lr, check), (cases, flagged, wv, wm) in sorted(rows.items(), key=lambda kv: kv[0][1] == "all"):
        print(f"| {kind} | {lr} | {check} | {flagged / cases:.1%} | {wv:.1f} | {wm:.1f} |")


if __name__ == "__main__":
    main()
