"""GPU kernel throughput with launches back to back: the Triton step and undo against torch's fused AdamW.

    python benchmarks/gpu_back_to_back.py       # on a CUDA machine; 2^26 and 2^28 float32 elements

``gpu_kernels.py`` times every call alone between CUDA events, so a call's host work (argument checks,
scalars, the launch: ~0.1 ms here) shows where the kernel itself is short (2^26 elements: ~0.45 ms on
an H200). This script launches 50 calls back to back and divides the wall time by 50: the GPU runs one
kernel while the host prepares the next, so the per-call time is the kernel's own as long as it is
longer than the host's share, which is printed beside it. The bandwidth is the bytes a step or undo must
move (read p, g, m, v; write p, m, v) over that time. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402

S = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 10, 1.0)
CALLS = 50


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)  # --help; no options
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure")
        return 0
    from sofx.kernels import triton as tk

    variant = AdamVariant()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {CALLS} calls back to back, float32")
    print()
    print("| elements | operation | ms per call | host ms per call | GB/s |")
    print("|---|---|---:|---:|---:|")
    for n in (1 << 26, 1 << 28):
        p, g, m = (torch.randn(n, device="cuda") for _ in range(3))
        v = torch.rand(n, device="cuda") * 0.01 + 1e-4
        out = (p, m, v)
        param = torch.nn.Parameter(p.clone())
        param.grad = g.clone()
        opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)
        for name, fn in (("sofx triton step", lambda: tk.step(p, g, m, v, S, variant, out=out)),
                         ("sofx triton undo", lambda: tk.undo(p, g, m, v, S, variant, out=out)),
                         ("torch AdamW fused", opt.step)):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            host = 0.0
            start = time.perf_counter()
            for _ in range(CALLS):
                t = time.perf_counter()
                fn()
                host += time.perf_counter() - t
            torch.cuda.synchronize()
            per_call = (time.perf_counter() - start) / CALLS
            print(f"| 2^{n.bit_length() - 1} | {name} | {per_call * 1e3:.3f} | {host / CALLS * 1e3:.3f} | "
                  f"{7 * 4 * n / per_call / 1e9:.0f} |")
        del p, g, m, v, param, opt
    return 0


if __name__ == "__main__":
    sys.exit(main())
