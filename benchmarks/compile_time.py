"""The first ``torch.compile`` trace of a donated AdamW update, and the compiles of a loop of it.

    python benchmarks/compile_time.py                      # 25, 50, 100 leaves, Dynamo only
    python benchmarks/compile_time.py --leaves 50 --backend inductor
    python benchmarks/compile_time.py --smoke              # 4 leaves: checks that the script runs

The step is ``opt.update(params, grads, state, AdamHParams(lr=lr), donate=True)`` (``--no-donate``: without
donation) over N leaves of 3x2 elements, compiled with ``fullgraph=True``, then called ``--steps`` times with new
gradients (a 0-d tensor lr: one compile for the loop). Printed per N: the first call's wall and CPU time, the
bytecode instructions Dynamo traced for it (counted by wrapping Dynamo's interpreter step: a measure of the trace's
Python work that the machine's load does not change) and the compiles of the loop. The default backend
(``count``: Dynamo's CompileCounter) times the trace alone; the graph is the same for every N per leaf, so what
grows faster than N there is the library's Python, traced. ``--top K`` names the K functions Dynamo traced most
instructions of. ``inductor`` adds the graph's compile (clear its caches for a cold time:
TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Any

import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sofx  # noqa: E402


def count_instructions() -> collections.Counter[str]:
    """A counter of the bytecode instructions Dynamo traces, by ``file:function`` (empty where this torch's
    interpreter has no ``InstructionTranslatorBase.step`` to wrap)."""
    counts: collections.Counter[str] = collections.Counter()
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslatorBase
    except ImportError:
        return counts
    real_step = getattr(InstructionTranslatorBase, "step", None)
    if real_step is None:
        return counts

    def step(self: Any) -> Any:
        code = self.f_code
        counts[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
        return real_step(self)

    InstructionTranslatorBase.step = step
    return counts


def measure(n: int, steps: int, backend: str, donate: bool, counts: collections.Counter[str]) -> dict[str, Any]:
    """The first call's wall and CPU seconds and traced instructions, and the compiles of ``steps`` calls."""
    torch._dynamo.reset()
    counts.clear()
    opt = sofx.adamw(weight_decay=1e-2)

    def step(p: Any, g: Any, s: Any, lr: torch.Tensor) -> Any:
        return opt.update(p, g, s, sofx.AdamHParams(lr=lr), donate=donate)

    counter = CompileCounter() if backend == "count" else CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(3, 2, generator=gen) for i in range(n)}
    state = opt.init(params)
    lr = torch.tensor(1e-3)
    wall, cpu = time.perf_counter(), time.process_time()
    for k in range(steps):
        grads = {name: torch.randn(v.shape, generator=gen) for name, v in params.items()}
        params, state, _ = compiled(params, grads, state, lr)
        if k == 0:
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            instructions = sum(counts.values())
            top = counts.most_common()
    return dict(wall=wall, cpu=cpu, instructions=instructions, compiles=counter.frame_count, top=top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[25, 50, 100])
    parser.add_argument("--steps", type=int, default=3, help="calls with new gradients (the first traces)")
    parser.add_argument("--backend", default="count", help="'count' (Dynamo only) or a torch.compile backend")
    parser.add_argument("--no-donate", dest="donate", action="store_false")
    parser.add_argument("--top", type=int, default=0, help="name the functions most traced")
    parser.add_argument("--smoke", action="store_true", help="4 leaves, 2 steps")
    args = parser.parse_args()
    if args.smoke:
        args.leaves, args.steps = [4], 2
    if args.steps < 1 or min(args.leaves) < 1:  # (the first call is the trace measured)
        parser.error("--steps and --leaves must be at least 1")
    counts = count_instructions()
    print(f"torch {torch.__version__}, backend {args.backend}, donate={args.donate}, {args.steps} steps")
    for n in args.leaves:
        r = measure(n, args.steps, args.backend, args.donate, counts)
        traced = f"{r['instructions']} instructions traced" if r["instructions"] else \
            "instructions not counted"
        print(f"{n:5d} leaves: first call {r['wall']:.2f} s ({r['cpu']:.2f} CPU-s), {traced}; "
              f"{r['compiles']} compile(s) in {args.steps} steps", flush=True)
        for name, k in r["top"][:args.top]:
            print(f"      {k:9d}  {name}")


if __name__ == "__main__":
    main()
