"""Host work per parameter of the offload facade: a training iteration of a model of many tiny layers.

    python benchmarks/facade_overhead.py                  # 74 layers of 16x16 (148 parameters), 60 rounds
    python benchmarks/facade_overhead.py --layers 250
    python benchmarks/facade_overhead.py --smoke          # 4 layers, 3 rounds: checks that it runs

One iteration is ``zero_grad()``, forward, backward and ``step()``; the arithmetic is negligible, so the
time is Python and launch work, most of it per parameter (the engine's gradient hook, its share of
``step()``). Variants, alternating round by round, medians of ``--rounds`` iterations, each over its own
copy of the model: ``torch.optim.AdamW`` (foreach and fused; the anchors), and
``sofx.offload.SpeculativeAdamW`` with the ``inline`` and ``thread`` executors, the latter also made
without the SIGINT gate (``sofx.offload.interrupts``: the optimizer created while SIGINT is ignored),
which shows what holding Ctrl-C back in the hooks costs. Prints milliseconds per iteration and
microseconds per parameter. One torch thread (the thread executor's worker is the other core).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sofx.offload  # noqa: E402
from _ab import print_per_tensor_table, time_alternating  # noqa: E402
from sofx.offload.interrupts import InterruptGate  # noqa: E402


def make_model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])


def iteration(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, sofx_backward: bool
              ) -> Callable[[], None]:
    def run() -> None:
        opt.zero_grad()
        loss = model(x).square().mean()
        if sofx_backward:
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()

    return run


def speculative(layers: int, executor: str, gate: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its SpeculativeAdamW; ``gate=False``: made while SIGINT is ignored, so without the gate."""
    model = make_model(layers)
    before = signal.getsignal(signal.SIGINT)
    if not gate:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-3, executor=executor, block_numel=2 ** 14)
    finally:
        signal.signal(signal.SIGINT, before)
    return model, opt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=74)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--smoke", action="store_true", help="4 layers, 3 rounds: checks that the script runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not callable(signal.getsignal(signal.SIGINT)):  # started as a background job: SIGINT ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
    layers, rounds = (4, 3) if args.smoke else (args.layers, args.rounds)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    steps: dict[str, Callable[[], None]] = {}
    for kind in ("foreach", "fused"):
        model = make_model(layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{kind: True})
        steps[f"torch AdamW({kind}=True)"] = iteration(model, opt, x, False)
    opened = []
    for executor, gate in (("inline", True), ("thread", True), ("thread", False)):
        model, opt = speculative(layers, executor, gate)
        opened.append(opt)
        assert isinstance(opt.engine._interrupts, InterruptGate) == gate
        name = f"SpeculativeAdamW, {executor} executor" + ("" if gate else ", no SIGINT gate")
        steps[name] = iteration(model, opt, x, True)
    try:
        times = time_alternating(steps, rounds)
    finally:
        for opt in opened:
            opt.close()
    params = 2 * layers
    print(f"{layers} layers of 16x16 ({params} parameters), batch 4; one torch thread; median of {rounds} "
          "iterations (zero_grad, forward, backward, step)")
    print()
    print_per_tensor_table(times, params, "variant")
    return 0


if __name__ == "__main__":
    sys.exit(main())
