"""Host work of the Triton backend, measured on this CPU: the kernels' launches replaced by no-ops.

    python benchmarks/triton_host.py            # GPT-2 small's 148 tensors (CPU tensors, ~2.5 GB)
    python benchmarks/triton_host.py --smoke    # tiny shapes, 2 rounds: checks that it runs

A GPU step of GPT-2 small takes ~1.8 ms (torch's fused Adam on an H200), so the Python that prepares the
launches decides whether the Triton backend keeps up. This script runs the backend under
``TRITON_INTERPRET=1`` (set here) on CPU tensors with ``_adam_kernel`` and ``_adam_multi_kernel``
replaced by launchers that do nothing: what is timed is the checks, the grouping, the multi-tensor table
and Adam's own host work, as on a GPU (there the table's copy and the program map are asynchronous launches
too, and a real launch adds Triton's own launcher). Variants alternate round by round; medians.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before sofx.kernels.triton is imported

import sys  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sofx  # noqa: E402
from _ab import gpt2_arguments, print_per_tensor_table, time_alternating  # noqa: E402
from sofx.kernels import load_backend  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant, StepCall, UndoRedoCall  # noqa: E402


class _NoLaunch:
    """Stands in for a ``triton.jit`` kernel: ``kernel[grid](*args, **constexprs)`` does nothing."""

    calls = 0

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            _NoLaunch.calls += 1

        return launch


def main(argv: list[str] | None = None) -> int:
    args, shapes, rounds = gpt2_arguments(__doc__.split("\n")[0], argv)
    tk = load_backend("triton")
    if tk is None:
        print("triton is not installed: nothing to measure")
        return 0
    tk._adam_kernel = tk._adam_multi_kernel = _NoLaunch()
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(shape, generator=gen) for shape in shapes]
    grads = [torch.randn(shape, generator=gen) for shape in shapes]
    grads2 = [torch.randn(shape, generator=gen) for shape in shapes]
    ms = [torch.randn(shape, generator=gen) for shape in shapes]
    vs = [torch.rand(shape, generator=gen) for shape in shapes]
    s, s2, variant = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 5), AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 5, 0.5), \
        AdamVariant()
    steps_ = [StepCall(p, g, m, v, s, (p, m, v)) for p, g, m, v in zip(values, grads, ms, vs)]
    redos = [UndoRedoCall(p, m, v, g, s, g2, s2, None, (p, m, v)) for p, g, g2, m, v in
             zip(values, grads, grads2, ms, vs)]
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, backend="triton")
    box = {"params": values}
    box["state"] = opt.init(values)

    def update() -> None:
        box["params"], box["state"], box["record"] = opt.update(box["params"], grads, box["state"], donate=True,
                                                                grads_finite=True)

    def update_undo_redo() -> None:
        update()
        box["params"], box["state"], box["record"] = opt.undo_redo(box["params"], box["state"], box["record"],
                                                                   grads2, donate=True, grads_finite=True)

    variants = {
        "triton.step, one call per tensor": lambda: [tk.step(c.p, c.g, c.m, c.v, c.s, variant, out=c.out)
                                                     for c in steps_],
        "triton.step_many, all tensors": lambda: tk.step_many(steps_, variant),
        "triton.undo_redo_many, all tensors": lambda: tk.undo_redo_many(redos, variant),
        "adamw(backend='triton').update(..., grads_finite=True)": update,
        "the same update, then undo_redo(new grads, grads_finite=True)": update_undo_redo,
    }
    times = time_alternating(variants, rounds)
    print(f"GPT-2 small{' (smoke: tiny)' if args.smoke else ''}: {len(shapes)} tensors; launches replaced by no-ops "
          f"({_NoLaunch.calls} made); median of {rounds} rounds")
    print()
    print_per_tensor_table(times, len(shapes), "host work")
    return 0


if __name__ == "__main__":
    sys.exit(main())
