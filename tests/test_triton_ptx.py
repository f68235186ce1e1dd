"""The Triton kernel compiled for real NVIDIA GPUs (sm_80, sm_90), on this CPU machine.

The interpreter (tests/test_kernels_triton.py) checks the kernel's math but not what the GPU
compiler makes of it. Triton's NVIDIA backend needs no GPU to compile: it lowers to PTX with its
own LLVM and assembles with the ``ptxas`` it ships. This test compiles every operation and dtype
combination the launcher uses, with the launcher's options, and checks the PTX:

- every float32 add, subtract and multiply is rounded on its own (``.rn``: neither LLVM nor ptxas
  may fuse it into a multiply-add) and the only fused multiply-adds are the source's ``tl.fma``;
- divisions and square roots are the correctly rounded ones (``div.rn``, ``sqrt.rn``), nothing
  flushes subnormals (``.ftz``), no approximate reciprocal or square root is used;
- bfloat16 stores use the round-to-nearest-even conversion instruction (``cvt.rn.bf16x2.f32``,
  ``cvt.rn.bf16.f32``);
- every global load and store is 128 bits wide (for 16-byte aligned tensors, which torch's
  allocators give, and an element count that is a multiple of 16: Triton specializes on both at
  launch, and the launcher gives the last n % 16 elements a launch of their own), so the kernel
  can reach the bandwidth;
- ptxas accepts it (a cubin comes out) and nothing spills to local memory.

The multi-tensor kernel (many tensors per launch, ``_adam_multi_kernel``) is checked the same way, as
launched on aligned tensors: the same arithmetic and 128-bit accesses as the flat kernel, plus the scalar
loads of its table.

The checked step and undo+redo (``CHECK``: a chunk of ``CHECK_BLOCK`` elements per program on
``CHECK_WARPS`` warps, which decides for its chunk before it stores, see ``_chunk_bad``) likewise: the
same per-thread arithmetic and 128-bit accesses, plus the one-byte store of the chunk's flag.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the kernel is an interpreted function under TRITON_INTERPRET=1", allow_module_level=True)

from sofx.kernels import triton as tk  # noqa: E402
from sofx.kernels._triton_aot import available, compile_kernel, resource_usage  # noqa: E402

pytestmark = pytest.mark.skipif(not available(), reason="triton's NVIDIA backend (with ptxas) is not available")

OPS = [(0, False), (1, False), (1, True), (2, False), (2, True)]  # (OP, HAS_P_OLD)
# tl.fma per element in _adam_kernel: step 3 + 2 in _div_by (sqrt(v) / sqrt(bc2)); undo 1 + 2 per _div_by
# (sqrt(v) / sqrt(bc2) and by 1 - lr*wd only without a snapshot, by beta1 and beta2 always)
EXPLICIT_FMAS = {(0, False): 5, (1, False): 9, (1, True): 5, (2, False): 14, (2, True): 10}
DTYPES = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32")]
CASES = [(90, op, dt) for op in OPS for dt in DTYPES] + [(80, op, DTYPES[0]) for op in OPS]
# with a p_copy: (op, param/state dtypes, copy dtype)
COPY_CASES = [((0, False), ("fp32", "fp32"), "bf16"), ((2, False), ("fp32", "fp32"), "fp32"),
              ((1, True), ("bf16", "fp32"), "fp32"), ((2, True), ("bf16", "bf16"), "bf16")]
# the multi-tensor kernel: every operation in fp32, the step in every dtype combination, one with a copy
MULTI_CASES = ([(op, DTYPES[0], None) for op in OPS] + [((0, False), dt, None) for dt in DTYPES[1:]]
               + [COPY_CASES[0]])
# the table's scalar loads in the multi-tensor kernel (each row's int64 fields, the program's tensor index)
TABLE_LOADS = {"ld.global.b64", "ld.global.b32"}
FLAG_STORE = "st.global.b8"  # a checked program's flag for its chunk

F32_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:add|sub|mul|fma|div|sqrt|rcp|rsqrt|ex2|lg2)(?:\.[a-z0-9]+)*?\.f32)\s",
                    re.M)
GLOBAL_MEM = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st)\.global(?:\.[a-z0-9]+)*)\s", re.M)


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


def _case_id(arch, op, dtypes, copy_dtype, multi):
    return (f"sm{arch}-op{op[0]}{'-pold' if op[1] else ''}-{dtypes[0]}-{dtypes[1]}"
            + (f"-copy-{copy_dtype}" if copy_dtype else "") + ("-multi" if multi else ""))


# checked calls: the step and the undo+redo (with and without p_old) in fp32, the step in the other dtypes, the
# multi-tensor kernel, one with a copy, one for sm_80
CHECK_OPS = [(0, False), (2, False), (2, True)]
CHECK_CASES = ([(90, op, DTYPES[0], None, False) for op in CHECK_OPS]
               + [(90, (0, False), dt, None, False) for dt in DTYPES[1:]] + [(90, (2, False), DTYPES[2], None, False)]
               + [(90, op, DTYPES[0], None, True) for op in CHECK_OPS]
               + [(90, (0, False), DTYPES[0], "bf16", False), (80, (2, False), DTYPES[0], None, False)])
ALL_CASES = ([(*case, None, False, False) for case in CASES] + [(90, *case, False, False) for case in COPY_CASES]
             + [(90, *case, True, False) for case in MULTI_CASES] + [(*case, True) for case in CHECK_CASES])


def _all_case_id(arch, op, dtypes, copy_dtype, multi, check):
    return _case_id(arch, op, dtypes, copy_dtype, multi) + ("-checked" if check else "")


@pytest.mark.parametrize("arch,op,dtypes,copy_dtype,multi,check", ALL_CASES,
                         ids=[_all_case_id(*c) for c in ALL_CASES])
def test_compiled_kernel_keeps_the_reference_arithmetic(arch, op, dtypes, copy_dtype, multi, check):
    kernel = compile_kernel(arch, op[0], op[1], *dtypes, copy_dtype=copy_dtype, multi=multi, check=check)
    ptx = kernel.asm["ptx"]
    assert len(kernel.asm["cubin"]) > 0
    usage = resource_usage(kernel.asm["cubin"])
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and 0 < usage["REG"] <= 128, usage  # no spills

    ops = collections.Counter(F32_OP.findall(ptx))
    assert ops, "no float32 arithmetic found: the PTX format changed?"
    # integer arguments (the decay-mode flags, a checked call's limit bits) compiled as integers, as launched
    assert not re.search(r"cvt\.rn\.f32\.[us]32", ptx), "an integer argument converted to float"
    for name in ops:
        assert ".ftz" not in name and ".approx" not in name and ".full" not in name, (name, dict(ops))
        assert not name.startswith(("rcp", "rsqrt", "ex2", "lg2")), (name, dict(ops))
        assert ".rn" in name, f"{name}: not rounded on its own (may be fused or approximate); {dict(ops)}"

    per_thread = (tk.CHECK_BLOCK if check else tk.BLOCK) // (kernel.metadata.num_warps * 32)
    assert per_thread == tk.BLOCK // (4 * 32)  # a checked program: the unchecked one's elements per thread
    fmas = sum(c for name, c in ops.items() if name.startswith("fma"))
    assert fmas == EXPLICIT_FMAS[op] * per_thread, dict(ops)
    # an undo from a snapshot needs no square root and divides only by constants (_div_by)
    assert (ops["sqrt.rn.f32"] > 0) == (ops["div.rn.f32"] > 0) == (op != (1, True)), dict(ops)

    conversions = set(re.findall(r"cvt(?:\.[a-z0-9]+)*\.bf16(?:x2)?\.f32", ptx))
    # (an undo from a bf16 snapshot stores the snapshot's own values: the compiler drops that round trip)
    expect_some = dtypes[1] == "bf16" or (dtypes[0] == "bf16" and op != (1, True)) or (
        copy_dtype == "bf16" and dtypes[0] != "bf16")
    assert conversions <= {"cvt.rn.bf16x2.f32", "cvt.rn.bf16.f32"} and bool(conversions) == expect_some, conversions

    mem = collections.Counter(GLOBAL_MEM.findall(ptx))
    vector = {"ld.global.v4.b32", "st.global.v4.b32"}
    allowed = vector | (TABLE_LOADS if multi else set()) | ({FLAG_STORE} if check else set())
    assert mem and set(mem) <= allowed and mem[FLAG_STORE] == int(check), dict(mem)
    if multi or check:  # the elements' accesses exactly as in the flat, unchecked kernel
        flat = collections.Counter(GLOBAL_MEM.findall(compile_kernel(arch, op[0], op[1], *dtypes,
                                                                     copy_dtype=copy_dtype).asm["ptx"]))
        assert {k: c for k, c in mem.items() if k in vector} == dict(flat), (dict(mem), dict(flat))


L2_CASES = [(90, op, False) for op in CHECK_OPS] + [(80, (2, False), False), (90, (2, False), True)]


@pytest.mark.parametrize("arch,op,multi", L2_CASES, ids=[f"sm{a}-op{o[0]}{'-pold' if o[1] else ''}"
                                                         f"{'-multi' if m else ''}" for a, o, m in L2_CASES])
def test_the_l2_terms_of_a_checked_kernel_keep_the_reference_arithmetic(arch, op, multi):
    """A checked call in L2 mode (``L2_CHECK``: its check's L2 terms, and an undo+redo's recovered parameter,
    compiled in; the other kernels are compiled without them): correctly rounded square roots and divisions,
    every other operation rounded on its own, no multiply-add but the source's, the same memory accesses as
    without them, and nothing spilled (more registers: a checked step 109 a thread on sm_90 against 56, an
    undo+redo 151-160 against 71-72, 130 against 64 with p_old; the occupancy that costs is unmeasured)."""
    kernel = compile_kernel(arch, op[0], op[1], "fp32", "fp32", multi=multi, check=True, l2=True)
    plain = compile_kernel(arch, op[0], op[1], "fp32", "fp32", multi=multi, check=True)
    usage = resource_usage(kernel.asm["cubin"])
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and 0 < usage["REG"] <= 168, usage  # no spills
    ops, without = (collections.Counter(F32_OP.findall(k.asm["ptx"])) for k in (kernel, plain))
    for name in ops:
        assert ".ftz" not in name and ".approx" not in name and ".full" not in name, (name, dict(ops))
        assert not name.startswith(("rcp", "rsqrt", "ex2", "lg2")), (name, dict(ops))
        assert ".rn" in name, f"{name}: not rounded on its own (may be fused or approximate); {dict(ops)}"
    fmas = {name: c for name, c in ops.items() if name.startswith("fma")}
    assert fmas == {name: c for name, c in without.items() if name.startswith("fma")}, (dict(ops), dict(without))
    assert ops["sqrt.rn.f32"] > without["sqrt.rn.f32"] and ops["div.rn.f32"] > without["div.rn.f32"], dict(ops)
    assert collections.Counter(GLOBAL_MEM.findall(kernel.asm["ptx"])) == \
        collections.Counter(GLOBAL_MEM.findall(plain.asm["ptx"]))


@pytest.mark.parametrize("op,check", [((0, False), False), ((2, False), False), ((2, True), True)],
                         ids=["step", "undo_redo", "undo_redo-pold-checked"])
def test_the_kernel_launched_on_2_31_elements_or_more_compiles_as_on_fewer(op, check):
    """A count of 2^31 or more is a 64-bit kernel argument (Triton types a Python int by its value): that
    variant of the flat kernel takes the count as 64 bits and compares the (64-bit) element offsets with it,
    with the 32-bit variant's arithmetic and 128-bit accesses, and spills nothing."""
    from triton.runtime.jit import mangle_type

    assert mangle_type(2**31 - 1) == "i32" and mangle_type(2**31) == "i64"
    n_param = tk._adam_kernel.arg_names.index("n")
    ptx = {}
    for large in (False, True):
        kernel = compile_kernel(90, op[0], op[1], "fp32", "fp32", check=check, large=large)
        usage = resource_usage(kernel.asm["cubin"])
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and 0 < usage["REG"] <= 128, usage
        ptx[large] = kernel.asm["ptx"]
        width = "64" if large else "32"
        assert re.search(rf"\.param \.u{width} _adam_kernel_param_{n_param}\b", ptx[large]), large
    assert re.search(r"setp\.lt\.s64", ptx[True])  # the mask: offsets < n, in 64 bits
    assert collections.Counter(GLOBAL_MEM.findall(ptx[True])) == collections.Counter(GLOBAL_MEM.findall(ptx[False]))
    assert collections.Counter(F32_OP.findall(ptx[True])) == collections.Counter(F32_OP.findall(ptx[False]))


def test_fusion_is_what_the_check_would_catch():
    """With Triton's default (fusion on) the same kernel has extra multiply-adds: the check above bites."""
    assert dict(tk.COMPILE_OPTIONS) == {"enable_fp_fusion": False}
    kernel = compile_kernel(90, 2, False, "fp32", "fp32", options={**tk.COMPILE_OPTIONS, "enable_fp_fusion": True})
    ops = collections.Counter(F32_OP.findall(kernel.asm["ptx"]))
    fmas = sum(c for name, c in ops.items() if name.startswith("fma"))
    per_thread = tk.BLOCK // (kernel.metadata.num_warps * 32)
    assert fmas > EXPLICIT_FMAS[(2, False)] * per_thread and any(".rn" not in name for name in ops), dict(ops)


def test_sass_count_script_runs():
    """benchmarks/triton_sass.py end to end: one row per operation and dtype combination. It runs on this module's
    Triton cache (``_own_cache``, in the environment it inherits): 14 of its 15 kernels are the ones the tests above
    compile with the same options, so the compiler is not run twice on them where those tests ran first in this
    process (a cached kernel is the compiler's output as much as a fresh one)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "triton_sass.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2:5] in ("ste", "und")]
    assert len(rows) == 15, proc.stdout  # 5 operations (2 of them checked calls) x 3 dtype combinations
    for row in rows:
        per_elem, budget, share = (float(x) for x in row.strip("| ").split(" | ")[3:6])
        assert 10 < per_elem < budget * 2 and abs(share - per_elem / budget) < 0.01, row
