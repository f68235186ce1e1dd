"""The exact (``cpu``) kernels with MKL's square root inline (the replica) or called per tile, A/B.

    python benchmarks/mkl_sqrt_replica.py            # 2^26 elements, 2 threads, 8 rounds

Both variants run on the same tensors, alternating (in both orders) round by round, so that the
machine's bandwidth drift hits them alike; the library is the same, only its ``sqrt_replica`` flag
differs. Prints the median step and fused undo+redo (a new gradient) per storage configuration.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels import _cpu_build, cpu  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import alternating, size_arguments, time_step_and_undo_redo  # noqa: E402

VARIANT = AdamVariant(decoupled=True, bias_correction=True)
S1 = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10, grad_scale=1.0)
S2 = S1._replace(lr=9e-4, grad_scale=0.5)
CONFIGS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def main() -> None:
    args = size_arguments(__doc__.split("\n")[0], rounds=8)
    lib = _cpu_build.load()
    if lib is None or not lib.sqrt_replica:
        sys.exit(f"the replica is not in use here ({_cpu_build.unavailable_reason() or 'load-time check failed'})")
    variants = {"inline (replica)": lib, "MKL call per tile": dataclasses.replace(lib, sqrt_replica=False)}
    n = 1 << args.log2_numel
    print("| params / states | square root | step ms | undo+redo ms |")
    print("|---|---|---:|---:|")
    for pdt, sdt in CONFIGS:
        gen = torch.Generator().manual_seed(0)
        p, g, g2 = (torch.randn(n, generator=gen).to(pdt) for _ in range(3))
        m = (0.1 * torch.randn(n, generator=gen)).to(sdt)
        v = (0.01 * torch.rand(n, generator=gen) + 1e-4).to(sdt)
        cpu.step(p, g, m, v, S1, VARIANT, out=(p, m, v))
        times = {name: ([], []) for name in variants}
        for name in alternating(list(variants), args.rounds):
            _cpu_build._loaded[0] = variants[name]  # the same library, one flag changed
            step, undo_redo = time_step_and_undo_redo(cpu, p, g, m, v, S1, g2, S2, VARIANT)
            times[name][0].append(step)
            times[name][1].append(undo_redo)
        _cpu_build._loaded[0] = lib
        for name, (steps, urs) in times.items():
            print(f"| {str(pdt)[6:]} / {str(sdt)[6:]} | {name} | {statistics.median(steps) * 1e3:.1f} | "
                  f"{statistics.median(urs) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
