"""Host work per tensor: an update over many small CPU tensors, where Python, not memory, sets the time.

    python benchmarks/host_overhead.py                     # 500 tensors of 1000 float32 elements
    python benchmarks/host_overhead.py --tensors 148 --numel 100
    python benchmarks/host_overhead.py --smoke             # 20 tensors, 3 rounds: checks that it runs

Variants, alternating round by round, medians of ``--rounds`` calls: ``torch.optim.AdamW`` ``step()``
(fused and foreach; the anchors), ``sofx.adamw(backend=...).update`` donated with ``grads_finite=True``
and without it (the gradients then checked in the kernels' pass), for the ``cpu`` and ``cpu_fast``
backends, one-block ``sofx.kernels.cpu.step`` calls (the kernel contract's own host cost), and the
``undo`` and late-clip ``undo_redo`` of a hinted update (the update untimed before each call). Prints
milliseconds per call and microseconds per tensor. Two threads.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sofx  # noqa: E402
from _ab import print_per_tensor_table, time_alternating  # noqa: E402
from sofx.kernels import cpu  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402


def sofx_update(values: list[torch.Tensor], grads: list[torch.Tensor], backend: str,
                hint: bool | None) -> Callable[[], None]:
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, backend=backend)
    box = {"params": [v.clone() for v in values]}
    box["state"] = opt.init(box["params"])

    def step() -> None:
        box["params"], box["state"], _ = opt.update(box["params"], grads, box["state"], donate=True,
                                                    grads_finite=hint)

    return step


def sofx_undo(values: list[torch.Tensor], grads: list[torch.Tensor], backend: str,
              redo: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(call, reset)``: ``reset`` (untimed) takes a donated, hinted update; ``call`` undoes it
    (``undo``), or undoes and redoes it at ``grad_scale=0.5`` with the same gradients (``undo_redo``, a
    late clip's), donated. Five updates first: the records are those of a running optimizer's steps."""
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, backend=backend)
    box = {"params": [v.clone() for v in values]}
    box["state"] = opt.init(box["params"])

    def reset() -> None:
        box["params"], box["state"], box["record"] = opt.update(box["params"], grads, box["state"], donate=True,
                                                                grads_finite=True)

    for _ in range(5):
        reset()

    def call() -> None:
        if redo:
            box["params"], box["state"], _ = opt.undo_redo(box["params"], box["state"], box["record"], grads,
                                                           grad_scale=0.5, donate=True, grads_finite=True)
        else:
            box["params"], box["state"] = opt.undo(box["params"], box["state"], box["record"], donate=True)

    return call, reset


def torch_step(values: list[torch.Tensor], grads: list[torch.Tensor], kind: str) -> Callable[[], None]:
    params = [torch.nn.Parameter(v.clone()) for v in values]
    for p, g in zip(params, grads):
        p.grad = g
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{kind: True}).step


def kernel_calls(values: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], None]:
    ps = [v.clone() for v in values]
    ms = [torch.zeros_like(v) for v in values]
    vs = [torch.zeros_like(v) for v in values]
    s, variant = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 1), AdamVariant()

    def step() -> None:
        for p, g, m, v in zip(ps, grads, ms, vs):
            cpu.step(p, g, m, v, s, variant, out=(p, m, v))

    return step


def _nothing() -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--numel", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="20 tensors, 3 rounds: checks that the script runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tensors, rounds = (20, 3) if args.smoke else (args.tensors, args.rounds)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(args.numel, generator=gen) for _ in range(tensors)]
    grads = [torch.randn(args.numel, generator=gen) for _ in range(tensors)]
    steps = {
        "torch AdamW(fused=True).step()": torch_step(values, grads, "fused"),
        "torch AdamW(foreach=True).step()": torch_step(values, grads, "foreach"),
        "sofx update, cpu, hinted": sofx_update(values, grads, "cpu", True),
        "sofx update, cpu, checked in the pass": sofx_update(values, grads, "cpu", None),
        "sofx update, cpu_fast, hinted": sofx_update(values, grads, "cpu_fast", True),
        "sofx update, cpu_fast, checked in the pass": sofx_update(values, grads, "cpu_fast", None),
        "sofx.kernels.cpu.step, one call per tensor": kernel_calls(values, grads),
    }
    resets: dict[str, Callable[[], None]] = {name: _nothing for name in steps}
    for name, redo in (("sofx undo of an update, cpu", False), ("sofx undo_redo (late clip), cpu", True)):
        steps[name], resets[name] = sofx_undo(values, grads, "cpu", redo)
    times = time_alternating(steps, rounds, resets)
    print(f"{tensors} tensors of {args.numel} float32 elements; {args.threads} threads; median of {rounds} calls; "
          f"native kernels: {cpu.native_available()}")
    print()
    print_per_tensor_table(times, tensors, "variant")
    return 0


if __name__ == "__main__":
    sys.exit(main())
