"""Speculation under a snapshot budget on a model whose rare rows spike every step.

    python benchmarks/snapshot_budget.py              # 200 steps per budget
    python benchmarks/snapshot_budget.py --smoke      # 12 steps, tiny model: checks that it runs

A small language model (embedding 8000x128, MLP 128-512-128, output layer 128x8000; tokens drawn from a
Zipf distribution, so the rows of rare tokens get rare, spiky gradients) trained with
``sofx.offload.SpeculativeAdamW`` (inline executor, blocks of ~1M elements: the embedding and the output
layer are a block each) beside ``torch.optim.AdamW``. ``undo="auto"`` keeps a snapshot where an inverse
would be too lossy; ``snapshot_budget_bytes`` caps what the speculative steps may hold. A speculative step
that finds it needs more than is left is taken back and its block stepped in validation ("refused").

Per budget (none, the embedding's whole snapshot, a quarter of it, 0): per step after the first 30, the blocks
speculated, refused and stepped late, the milliseconds of ``backward`` + ``step()``, and the relative
deviation from torch at the end (DESIGN.md: 1e-6 per step; free-running runs amplify ulps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sofx.offload  # noqa: E402


class ZipfLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(self.emb(tokens)))


def deviation(a: torch.nn.Module, b: torch.nn.Module) -> float:
    num = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    den = max(float(q.detach().abs().max()) for q in b.parameters())
    return num / den


def run(budget: int | None, steps: int, vocab: int, dim: int, hidden: int, batch: int) -> dict:
    torch.manual_seed(0)
    model, ref = ZipfLM(vocab, dim, hidden), ZipfLM(vocab, dim, hidden)
    ref.load_state_dict(model.state_dict())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    zipf = torch.distributions.Categorical(probs=1.0 / torch.arange(1, vocab + 1, dtype=torch.float64))
    gen_state = torch.get_rng_state()
    rows = []
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-3, executor="inline", block_numel=vocab * dim,
                                       snapshot_budget_bytes=budget, loss_scale=None) as opt:
        torch.set_rng_state(gen_state)
        for step in range(steps):
            x, y = zipf.sample((batch,)), zipf.sample((batch,))
            t = time.perf_counter()
            opt.zero_grad()
            opt.backward(torch.nn.functional.cross_entropy(model(x), y))
            report = opt.step()
            t = time.perf_counter() - t
            ropt.zero_grad()
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            ropt.step()
            if step >= min(30, steps // 2):
                rows.append((report.speculated, report.refused, report.stepped_late, t))
        blocks = report.blocks
    return {"blocks": blocks, "speculated": statistics.mean(r[0] for r in rows),
            "refused": statistics.mean(r[1] for r in rows), "late": statistics.mean(r[2] for r in rows),
            "ms": statistics.median(r[3] for r in rows) * 1e3, "deviation": deviation(model, ref)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="12 steps of a tiny model")
    args = parser.parse_args(argv)
    vocab, dim, hidden, batch, steps = (8000, 128, 512, 256, args.steps) if not args.smoke else (600, 16, 32, 32, 12)
    torch.set_num_threads(1)
    whole = 3 * 4 * vocab * dim  # the embedding's p, m, v in float32
    print(f"ZipfLM vocab {vocab}, dim {dim}, hidden {hidden}, batch {batch}; {steps} steps; inline executor, "
          f"one torch thread; rows: means per step after the first {min(30, steps // 2)}")
    print()
    print("| snapshot budget | blocks | speculated | refused | stepped late | ms per step | deviation from torch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, budget in (("none", None), ("the embedding's whole snapshot", whole),
                         ("1/4 of the embedding's", whole // 4), ("0", 0)):
        r = run(budget, steps, vocab, dim, hidden, batch)
        print(f"| {name} | {r['blocks']} | {r['speculated']:.2f} | {r['refused']:.2f} | {r['late']:.2f} | "
              f"{r['ms']:.1f} | {r['deviation']:.2g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
