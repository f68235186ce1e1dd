"""Train a small transformer on the CPU with speculative offloaded AdamW: ``python -m sofx.demo``.

The model learns a synthetic language (each token is followed by a fixed
random successor, with some noise). ``sofx.offload.SpeculativeAdamW`` keeps
fp32 master weights and Adam state in flat blocks and takes each block's Adam
step on a worker while backward is still computing the gradients of earlier
layers; ``step()`` validates the speculative steps (global-norm clipping,
warm-up schedule) and commits, or undoes and redoes them.

In the same run, every other step is taken without speculation, so the
summary compares serial and speculative step times measured side by side;
and every step is also taken by ``torch.optim.AdamW`` + ``clip_grad_norm_``
from the same parameters on the same batch (a reference copy of the model,
re-synchronised before each step): the summary reports the largest
per-step deviation between the two (float32 rounding, at most 1e-6
relative). Re-synchronising matters: any two float32 implementations drift
apart chaotically over a long run (ReLU boundaries, Adam's normalised
updates of tiny gradients), so a free-running comparison measures the model's
chaos, not the optimizer.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import sofx.offload

TOLERANCE = 1e-6
MAX_NORM = 4.0


class TinyLM(nn.Module):
    """A two-layer causal transformer language model with tied input/output embeddings."""

    def __init__(self, vocab: int, d: int, layers: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        nn.init.normal_(self.emb.weight, std=0.1)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        # bias=False: an attention key bias has a zero true gradient, so its Adam updates follow
        # rounding noise and no two implementations agree on it.
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True, bias=False)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.emb(tokens) + self.pos, mask=self.mask, is_causal=True)
        return self.norm(h) @ self.emb.weight.t()


def make_batch(successor: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Sequences where each token is followed by ``successor[token]`` (10% random tokens)."""
    vocab = successor.numel()
    out = torch.empty(batch, seq + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(seq):
        noise = torch.rand(batch, generator=gen) < 0.1
        out[:, t + 1] = torch.where(noise, torch.randint(0, vocab, (batch,), generator=gen), successor[out[:, t]])
    return out


def relative_deviation(a: nn.Module, b: nn.Module) -> float:
    """max over parameters of max|a - b| / max|b|."""
    return max(((p.detach() - q.detach()).abs().max() / q.detach().abs().max().clamp_min(1e-12)).item()
               for p, q in zip(a.parameters(), b.parameters()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--executor", default="thread", choices=sofx.offload.EXECUTORS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)
    from tqdm import tqdm

    vocab, d, layers, seq, lr = 32, args.width, 2, 16, 1e-3
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # backward on one core, the optimizer worker on the other
    model = TinyLM(vocab, d, layers, seq)
    reference = copy.deepcopy(model)
    successor = torch.randperm(vocab)
    gen = torch.Generator().manual_seed(args.seed + 1)

    def warmup(step: int) -> float:
        return min(1.0, (step + 1) / 20)

    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=lr, weight_decay=0.01, max_grad_norm=MAX_NORM,
                                        executor=args.executor, block_numel=2 ** 16)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.01, foreach=False)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, warmup)

    def loss_of(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    totals = dict.fromkeys(("speculated", "committed", "undone", "redone", "vetoed", "stepped_late"), 0)
    times: dict[bool, list[float]] = {True: [], False: []}
    clipped = skipped = 0
    deviation = 0.0
    first_loss = last_loss = float("nan")
    with opt:
        bar = tqdm(range(args.steps), desc=f"sofx.offload ({opt.executor})", unit="step", mininterval=0.5)
        for step in bar:
            tokens = make_batch(successor, args.batch, seq, gen)
            speculate = step % 2 == 1
            opt.speculate = speculate
            opt.zero_grad()
            before = [p.detach().clone() for p in model.parameters()]
            loss = loss_of(model, tokens)
            start = time.perf_counter()
            opt.backward(loss)
            report = opt.step()
            times[speculate].append(time.perf_counter() - start)
            sched.step()

            # The reference takes the same step from the same parameters: copy them over first, so the
            # gradients are the same bits and the comparison measures the optimizer step alone.
            with torch.no_grad():
                for p, q in zip(before, reference.parameters()):
                    q.copy_(p)
            ref_opt.zero_grad()
            loss_of(reference, tokens).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            ref_opt.step()
            ref_sched.step()

            for key in totals:
                totals[key] += getattr(report, key)
            clipped += report.clipped
            skipped += report.skipped
            deviation = max(deviation, relative_deviation(model, reference))
            first_loss = loss.item() if step == 0 else first_loss
            last_loss = loss.item()
            bar.set_postfix(loss=f"{last_loss:.3f}", spec=totals["speculated"], redo=totals["redone"])
        bar.close()
        executor = opt.executor

    serial_ms = 1000 * statistics.median(times[False]) if times[False] else float("nan")
    spec_ms = 1000 * statistics.median(times[True]) if times[True] else float("nan")
    print(f"steps: {args.steps} (executor {executor}; {clipped} clipped, {skipped} skipped)")
    print(f"loss: {first_loss:.4f} -> {last_loss:.4f}")
    print("speculation: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    print(f"backward+step time (median): serial {serial_ms:.1f} ms, speculative {spec_ms:.1f} ms "
          f"({serial_ms / spec_ms:.2f}x)")
    verdict = "OK" if deviation <= TOLERANCE else "FAILED"
    print(f"max relative deviation per step from torch.optim.AdamW + clip_grad_norm_ (same parameters and "
          f"gradients): {deviation:.1e} (tolerance {TOLERANCE:.0e}): {verdict}")


if __name__ == "__main__":
    main()
