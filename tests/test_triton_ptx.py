"""The Triton kernel compiled for real NVIDIA GPUs (sm_80, sm_90), on this CPU machine.

The interpreter (tests/test_kernels_triton.py) checks the kernel's math but not what the GPU
compiler makes of it. Triton's NVIDIA backend needs no GPU to compile: it lowers to PTX with its
own LLVM and assembles with the ``ptxas`` it ships. This test compiles every operation and dtype
combination the launcher uses, with the launcher's options, and checks the PTX:

- every float32 add, subtract and multiply is rounded on its own (``.rn``: neither LLVM nor ptxas
  may fuse it into a multiply-add) and the only fused multiply-adds are the source's ``tl.fma``;
- divisions and square roots are the correctly rounded ones (``div.rn``, ``sqrt.rn``), nothing
  flushes subnormals (``.ftz``), no approximate reciprocal or square root is used;
- every global load and store is 128 bits wide (for 16-byte aligned tensors, which torch's
  allocators give, and an element count that is a multiple of 16: Triton specializes on both at
  launch, and the launcher gives the last n % 16 elements a launch of their own), so the kernel
  can reach the bandwidth;
- ptxas accepts it (a cubin comes out).
"""

from __future__ import annotations

import collections
import os
import re
import shutil

import pytest

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the kernel is an interpreted function under TRITON_INTERPRET=1", allow_module_level=True)

import triton.language as tl  # noqa: E402

from sofx.kernels import triton as tk  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    HAVE_NVIDIA_BACKEND = all(get_ptxas(arch) is not None for arch in (80, 90))
except Exception:  # noqa: BLE001 - any missing piece means: cannot compile here
    HAVE_NVIDIA_BACKEND = False

pytestmark = pytest.mark.skipif(not HAVE_NVIDIA_BACKEND, reason="triton's NVIDIA backend (with ptxas) is not available")

OPS = [(0, False), (1, False), (1, True), (2, False), (2, True)]  # (OP, HAS_P_OLD)
EXPLICIT_FMAS = {0: 3, 1: 1, 2: 4}  # tl.fma calls per element in _adam_kernel for each OP
DTYPES = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32")]
TL = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
CASES = [(90, op, dt) for op in OPS for dt in DTYPES] + [(80, op, DTYPES[0]) for op in OPS]

F32_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:add|sub|mul|fma|div|sqrt|rcp|rsqrt|ex2|lg2)(?:\.[a-z0-9]+)*?\.f32)\s",
                    re.M)
GLOBAL_MEM = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st)\.global(?:\.[a-z0-9]+)*)\s", re.M)


def _scalar_type(name: str) -> str:
    """Triton's type for a runtime argument, from the launcher's NamedTuple field types."""
    if name.endswith("_ptr"):
        raise AssertionError(name)
    if name == "n":
        return "i32"
    fields = (tk._UndoArgs if name.startswith("u_") else tk._StepArgs).__annotations__
    return "i32" if fields[name[2:]] in (int, "int") else "fp32"


def _compile(arch: int, op: int, has_p_old: bool, pdt: str, sdt: str, options=tk.COMPILE_OPTIONS):
    fn = tk._adam_kernel
    names = fn.arg_names
    storage = dict(p=pdt, g=pdt, g2=pdt, pold=pdt, po=pdt, m=sdt, v=sdt, mo=sdt, vo=sdt)
    constexprs = dict(OP=op, HAS_P_OLD=has_p_old, ROUND_P=TL[pdt], ROUND_S=TL[sdt], BLOCK_SIZE=tk.BLOCK)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + storage[name[:-4]]
        else:
            signature[name] = _scalar_type(name)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name.endswith("_ptr") or name == "n"}  # as Triton specializes a launch of the head
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))


@pytest.fixture(scope="module", autouse=True)
def _own_cache(tmp_path_factory):
    """A fresh Triton cache: the compiler runs (and its output is checked) whatever ran before."""
    old = os.environ.get("TRITON_CACHE_DIR")
    d = tmp_path_factory.mktemp("triton_cache")
    os.environ["TRITON_CACHE_DIR"] = str(d)
    yield
    if old is None:
        del os.environ["TRITON_CACHE_DIR"]
    else:
        os.environ["TRITON_CACHE_DIR"] = old
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("arch,op,dtypes", CASES,
                         ids=[f"sm{a}-op{o[0]}{'-pold' if o[1] else ''}-{d[0]}-{d[1]}" for a, o, d in CASES])
def test_compiled_kernel_keeps_the_reference_arithmetic(arch, op, dtypes):
    kernel = _compile(arch, op[0], op[1], *dtypes)
    ptx = kernel.asm["ptx"]
    assert len(kernel.asm["cubin"]) > 0

    ops = collections.Counter(F32_OP.findall(ptx))
    assert ops, "no float32 arithmetic found: the PTX format changed?"
    for name in ops:
        assert ".ftz" not in name and ".approx" not in name and ".full" not in name, (name, dict(ops))
        assert not name.startswith(("rcp", "rsqrt", "ex2", "lg2")), (name, dict(ops))
        assert ".rn" in name, f"{name}: not rounded on its own (may be fused or approximate); {dict(ops)}"

    per_thread = tk.BLOCK // (kernel.metadata.num_warps * 32)
    fmas = sum(c for name, c in ops.items() if name.startswith("fma"))
    assert fmas == EXPLICIT_FMAS[op[0]] * per_thread, dict(ops)
    assert ops["div.rn.f32"] > 0, dict(ops)
    assert (ops["sqrt.rn.f32"] > 0) != (op == (1, True)), dict(ops)  # an undo from a snapshot needs no sqrt

    mem = collections.Counter(GLOBAL_MEM.findall(ptx))
    assert mem and set(mem) <= {"ld.global.v4.b32", "st.global.v4.b32"}, dict(mem)


def test_fusion_is_what_the_check_would_catch():
    """With Triton's default (fusion on) the same kernel has extra multiply-adds: the check above bites."""
    assert dict(tk.COMPILE_OPTIONS) == {"enable_fp_fusion": False}
    kernel = _compile(90, 2, False, "fp32", "fp32", options={**tk.COMPILE_OPTIONS, "enable_fp_fusion": True})
    ops = collections.Counter(F32_OP.findall(kernel.asm["ptx"]))
    fmas = sum(c for name, c in ops.items() if name.startswith("fma"))
    per_thread = tk.BLOCK // (kernel.metadata.num_warps * 32)
    assert fmas > EXPLICIT_FMAS[2] * per_thread and any(".rn" not in name for name in ops), dict(ops)
