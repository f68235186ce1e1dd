"""GPU Adam kernel benchmark: sofx Triton step / undo / undo+redo vs torch fused CUDA Adam vs copy bandwidth.

    python benchmarks/gpu_kernels.py            # 2^26 and 2^28 elements, fp32 / bf16+fp32 / all-bf16
    python benchmarks/gpu_kernels.py --quick    # 2^24 elements

Self-contained: needs a CUDA device, torch and triton. Every repetition is
timed with CUDA events and followed by a device-to-device copy of a 1 GiB
buffer (read + write); each operation's effective bandwidth (the bytes it
must move: step and undo read p, g, m, v and write p, m, v; fused undo+redo
also reads the second gradient) is divided by that paired copy bandwidth
(``xcopy``), and compared with ``torch.optim.AdamW(fused=True)`` on the same
tensors (``xfused``: > 1 is faster). Targets (issue 4): Triton step >= 0.9 of
the copy bandwidth and >= 1.0x torch fused.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure")
        return
    from sofx.kernels import triton as tk
    from sofx.kernels.base import AdamScalars, AdamVariant

    dev = torch.device("cuda")
    variant = AdamVariant()
    s1 = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 10, 1.0)
    src = torch.empty(2**28, device=dev)  # 1 GiB
    dst = torch.empty_like(src)

    def timed(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def copy_bw() -> float:
        return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src))

    def bench(fn, nbytes: int) -> tuple[float, float]:
        for _ in range(3):
            fn()
        secs, ratios = [], []
        for _ in range(args.reps):
            t = timed(fn)
            secs.append(t)
            ratios.append(nbytes / t / copy_bw())
        return statistics.median(secs), statistics.median(ratios)

    print(f"# sofx Triton kernels on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"command: {' '.join(sys.argv)}")
    sizes = [2**24] if args.quick else [2**26, 2**28]
    configs = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]
    for n in sizes:
        for pdt, sdt in configs:
            pb, sb = torch.finfo(pdt).bits // 8, torch.finfo(sdt).bits // 8
            step_bytes = n * (3 * pb + 4 * sb)
            p = torch.randn(n, device=dev).to(pdt)
            g = torch.randn(n, device=dev).to(pdt)
            m = (0.1 * torch.randn(n, device=dev)).to(sdt)
            v = (0.01 * torch.rand(n, device=dev) + 1e-4).to(sdt)
            rows = {}
            param = torch.nn.Parameter(p.clone())
            param.grad = g.clone()
            for kind in ("fused", "foreach"):
                opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **{kind: True})
                rows[f"torch AdamW {kind} ({str(pdt)[6:]} states)"] = bench(opt.step, n * 7 * pb)
                del opt
            del param
            rows["sofx triton step"] = bench(lambda: tk.step(p, g, m, v, s1, variant, out=(p, m, v)), step_bytes)
            rows["sofx triton undo"] = bench(lambda: tk.undo(p, g, m, v, s1, variant, out=(p, m, v)), step_bytes)
            rows["sofx triton undo+redo (fused)"] = bench(
                lambda: tk.undo_redo(p, m, v, g, s1, g, s1, variant, out=(p, m, v)), step_bytes + n * pb)
            fused = rows[f"torch AdamW fused ({str(pdt)[6:]} states)"][0]
            print(f"\n### {n / 2**20:.0f}M elements, params {str(pdt)[6:]}, states {str(sdt)[6:]}\n")
            print("| operation | ms | xcopy | xfused |\n|---|---:|---:|---:|")
            for name, (t, r) in rows.items():
                print(f"| {name} | {t * 1e3:.2f} | {r:.2f} | {fused / t:.2f} |")
            print(f"\nundo+redo / step = {rows['sofx triton undo+redo (fused)'][0] / rows['sofx triton step'][0]:.2f}; "
                  f"copy bandwidth {copy_bw() / 1e9:.0f} GB/s")
            del p, g, m, v


if __name__ == "__main__":
    main()
