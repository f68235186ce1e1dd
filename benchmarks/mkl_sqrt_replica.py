"""The exact (``cpu``) kernels with MKL's square root inline (the replica) or called per tile, A/B.

    python benchmarks/mkl_sqrt_replica.py            # 2^26 elements, 2 threads, 8 rounds
    python benchmarks/mkl_sqrt_replica.py --ieee     # as with a torch whose square root is IEEE, not MKL's

``--ieee``: the library as it loads where torch's square root is not MKL's routine (``sqrt_fn`` 0): the IEEE
kind (the vector loops with the hardware's square root) against the exact tile loops with ``sqrtf`` (the same
bits; what ran there before the kind), and ``cpu_fast`` as the anchor.

Both variants run on the same tensors, alternating (in both orders) round by round, so that the
machine's bandwidth drift hits them alike; the library is the same, only its ``sqrt_replica`` flag
differs. Prints the median step and fused undo+redo (a new gradient) per storage configuration.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels import _cpu_build, cpu, cpu_fast  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import alternating, size_arguments, time_step_and_undo_redo  # noqa: E402

VARIANT = AdamVariant(decoupled=True, bias_correction=True)
S1 = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10, grad_scale=1.0)
S2 = S1._replace(lr=9e-4, grad_scale=0.5)
CONFIGS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def main() -> None:
    args = size_arguments(__doc__.split("\n")[0], rounds=8, more=lambda ap: ap.add_argument(
        "--ieee", action="store_true", help="IEEE square roots inline against sqrtf per tile (torch without MKL)"))
    lib = _cpu_build.load()
    if lib is None:
        sys.exit(f"no native library here ({_cpu_build.unavailable_reason()})")
    if args.ieee:
        ieee = ctypes.CDLL(lib.path).sofx_has_sqrt_replica() & _cpu_build.REPLICA_KINDS["ieee"]
        if not ieee:
            sys.exit("this build has no vector loops: its tile loops are the only ones")
        variants = {"IEEE inline (vector loops)": (cpu, dataclasses.replace(lib, sqrt_fn=0, sqrt_replica=ieee)),
                    "sqrtf per tile": (cpu, dataclasses.replace(lib, sqrt_fn=0, sqrt_replica=0)),
                    "cpu_fast": (cpu_fast, lib)}
    elif not lib.sqrt_replica:
        sys.exit(f"the replica is not in use here ({_cpu_build.unavailable_reason() or 'load-time check failed'})")
    else:
        variants = {"inline (replica)": (cpu, lib),
                    "MKL call per tile": (cpu, dataclasses.replace(lib, sqrt_replica=False))}
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
            backend, _cpu_build._loaded[0] = variants[name]  # the same library, one flag changed
            step, undo_redo = time_step_and_undo_redo(backend, p, g, m, v, S1, g2, S2, VARIANT)
            times[name][0].append(step)
            times[name][1].append(undo_redo)
        _cpu_build._loaded[0] = lib
        for name, (steps, urs) in times.items():
            print(f"| {str(pdt)[6:]} / {str(sdt)[6:]} | {name} | {statistics.median(steps) * 1e3:.1f} | "
                  f"{statistics.median(urs) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
