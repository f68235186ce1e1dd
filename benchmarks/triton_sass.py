"""What the Triton kernel costs a GPU per element, read from its machine code (no GPU needed).

    python benchmarks/triton_sass.py            # sm_90 (H100/H200), the spec numbers of an H200 SXM
    python benchmarks/triton_sass.py --arch 80 --sms 108 --clock-ghz 1.41 --hbm-tbps 2.04   # A100 80GB

Triton's NVIDIA backend compiles on a CPU (its own LLVM, the ``ptxas`` it ships) and its
``cuobjdump`` disassembles the result, so the instruction stream of every operation and dtype
combination can be inspected before any device is lent. This script counts, per element, the
instructions one thread executes on the common path (the main body up to its exit, leaving out
the blocks that only call the slow path of a division or square root, taken for subnormal or
huge operands) and compares them with the GPU's issue budget at its memory bandwidth: while HBM
moves one element's bytes, the SMs can issue ``SMs * 4 schedulers * clock * bytes / bandwidth``
thread instructions (32 per warp instruction). A kernel well under that budget is memory bound;
near or over it, the arithmetic limits it. The GPU figures are spec-sheet values (override them
for another part); this is a static estimate, not a measurement: ``gpu_kernels.py`` measures.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

from sofx.kernels import triton as tk  # noqa: E402
from sofx.kernels._triton_aot import available, compile_kernel, resource_usage, sass  # noqa: E402

# (op, has_p_old, checked: undo="auto"'s checked call, a chunk of CHECK_BLOCK per program on CHECK_WARPS warps)
OPS = {"step": (0, False, False), "undo": (1, False, False), "undo+redo": (2, False, False),
       "step, checked": (0, False, True), "undo+redo, checked": (2, False, True)}
DTYPES = {"fp32": ("fp32", "fp32"), "bf16 p + fp32 states": ("bf16", "fp32"), "all-bf16": ("bf16", "bf16")}
SIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def common_path(code: list[tuple[int, str]]) -> list[str]:
    """The main body up to its first EXIT, without the blocks that are jumped over unless a slow path
    is called (``@!P BRA x`` whose skipped instructions contain a CALL)."""
    out, i = [], 0
    while i < len(code):
        _, ins = code[i]
        if ins.startswith("EXIT"):
            out.append(ins)
            break
        jump = re.match(r"@!?P\d+ BRA (?:`\()?.*?0x([0-9a-f]+)", ins)
        if jump:
            target = int(jump.group(1), 16)
            j = i + 1
            while j < len(code) and code[j][0] < target:
                j += 1
            if any("CALL" in c for _, c in code[i + 1:j]):
                i = j
                continue
        out.append(ins)
        i += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sms", type=int, default=132, help="streaming multiprocessors (H200 SXM: 132)")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock (H200 SXM boost: 1.98)")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="memory bandwidth, TB/s (H200 SXM: 4.8)")
    args = ap.parse_args()
    if not available():
        sys.exit("triton's NVIDIA backend (with ptxas) is not available here")
    issue = args.sms * 4 * args.clock_ghz * 1e9 * 32  # thread instructions per second

    print(f"Triton {triton.__version__}, sm_{args.arch}, BLOCK {tk.BLOCK}; budget: {args.sms} SMs x 4 x "
          f"{args.clock_ghz} GHz x 32 lanes over {args.hbm_tbps} TB/s\n")
    print("| operation | dtypes | bytes/elem | instr/elem (common path) | budget at bandwidth | share | registers |")
    print("|---|---|---|---|---|---|---|")
    for op_name, (op, has_p_old, checked) in OPS.items():
        for dt_name, (pdt, sdt) in DTYPES.items():
            kernel = compile_kernel(args.arch, op, has_p_old, pdt, sdt, check=checked)
            per_thread = (tk.CHECK_BLOCK if checked else tk.BLOCK) // (kernel.metadata.num_warps * 32)
            path = common_path(sass(kernel.asm["cubin"]))
            per_elem = len(path) / per_thread
            nbytes = 2 * SIZE[pdt] + SIZE[pdt] + 4 * SIZE[sdt] + (SIZE[pdt] if op == 2 else 0)
            budget = issue * nbytes / (args.hbm_tbps * 1e12)
            regs = resource_usage(kernel.asm["cubin"])["REG"]
            print(f"| {op_name} | {dt_name} | {nbytes} | {per_elem:.0f} | {budget:.0f} | {per_elem / budget:.2f} "
                  f"| {regs} |")


if __name__ == "__main__":
    main()
