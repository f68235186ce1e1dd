"""The Triton Adam kernel compiled ahead of time for an NVIDIA GPU, on any machine (no GPU needed).

Triton's NVIDIA backend lowers to PTX with its own LLVM and assembles with the ``ptxas`` it ships;
its ``cuobjdump`` disassembles the result. ``tests/test_triton_ptx.py`` checks the PTX of every
operation and dtype combination; ``benchmarks/triton_sass.py`` counts the machine instructions.
The kernel is specialized as for a launch on 16-byte aligned tensors with an element count that
is a multiple of 16 (what :func:`sofx.kernels.triton._launch` arranges for all but the last n % 16
elements).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import typing
from typing import Any, Mapping

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sofx.kernels import triton as tk
from sofx.kernels.base import LossyL2

__all__ = ["available", "compile_kernel", "resource_usage", "sass"]

TL_DTYPES = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}


def available() -> bool:
    """Whether this triton can compile for sm_80 and sm_90 here (its NVIDIA backend and ptxas)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return all(get_ptxas(arch) is not None for arch in (80, 90))
    except Exception:  # noqa: BLE001 - any missing piece means: cannot compile here
        return False


def _scalar_type(name: str, large: bool = False) -> str:
    """Triton's type for a runtime argument of the kernel (from the launcher's NamedTuple fields); the element
    count ``n`` is a 32-bit integer, a 64-bit one where ``large`` (Triton types a Python int by its value: a
    count of 2^31 or more is an ``i64``)."""
    if name == "n":
        return "i64" if large else "i32"
    # (resolved: under ``from __future__ import annotations`` the raw annotations are strings)
    fields = typing.get_type_hints({"u": tk._UndoArgs, "s": tk._StepArgs, "k": tk._CheckArgs}[name[0]])
    if name[0] == "k":  # (its L2 constants: base.LossyL2's fields, one argument each)
        fields.update(typing.get_type_hints(LossyL2))
    return "i32" if fields[name[2:]] is int else "fp32"


def compile_kernel(arch: int, op: int, has_p_old: bool, pdt: str, sdt: str,
                   options: Mapping[str, Any] = tk.COMPILE_OPTIONS, copy_dtype: str | None = None,
                   multi: bool = False, check: bool = False, large: bool = False, l2: bool = False):
    """``_adam_kernel`` for ``sm_<arch>``: ``op`` 0 step, 1 undo, 2 undo+redo; dtypes "fp32"/"bf16"/"fp16";
    ``copy_dtype``: the dtype of a ``p_copy`` (None: without one). ``multi``: the multi-tensor kernel
    (``_adam_multi_kernel``) as launched on tensors that are all aligned (``ALIGNED``). ``check``: a
    checked call (``CHECK``: a chunk of ``CHECK_BLOCK`` elements per program, on ``CHECK_WARPS`` warps).
    ``large``: the flat kernel as launched on a count of 2^31 elements or more (a 64-bit ``n``). ``l2``: a checked
    call in L2 mode (``L2_CHECK``: its check's L2 terms compiled in)."""
    fn = tk._adam_multi_kernel if multi else tk._adam_kernel
    names = fn.arg_names
    storage = dict(p=pdt, g=pdt, g2=pdt, pold=pdt, po=pdt, m=sdt, v=sdt, mo=sdt, vo=sdt, pc=copy_dtype or pdt,
                   sk="u8", rows="i64", tensor_of="i32")
    constexprs = dict(OP=op, HAS_P_OLD=has_p_old, ROUND_P=TL_DTYPES[pdt], ROUND_S=TL_DTYPES[sdt], SOFT_BF16=False,
                      BLOCK_SIZE=tk.CHECK_BLOCK if check else tk.BLOCK, HAS_COPY=copy_dtype is not None,
                      ROUND_C=TL_DTYPES[copy_dtype or "fp32"], CHECK=check, L2_CHECK=check and l2)
    if check:
        options = {**options, "num_warps": tk.CHECK_WARPS}
    if multi:
        constexprs.update(ALIGNED=True, ROW=tk._ROW_WIDTH + 1)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + storage[name[:-4]]
        else:
            signature[name] = _scalar_type(name, large)
    # (the flags of a checked call are one byte per chunk, at any address)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if (name.endswith("_ptr") and name != "sk_ptr") or name == "n"}
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))


def _cuobjdump(flag: str, cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers per thread and bytes of stack, local (spilled) and shared memory: {"REG": .., "LOCAL": ..}."""
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", _cuobjdump("-res-usage", cubin))}


_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of a cubin, by the cuobjdump that ships with triton."""
    text = _cuobjdump("-sass", cubin)
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, text.splitlines()) if m]
