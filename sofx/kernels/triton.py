"""Triton Adam kernels for CUDA tensors: step, inverse and one-pass undo+redo.

One kernel, specialized at compile time on the operation (step, undo,
undo+redo), the decay mode and whether a parameter snapshot is given; every
step-dependent value is a runtime argument, so a training run compiles each
variant once. Each program handles ``BLOCK`` elements (the last one masked):
it loads ``p, g, m, v`` (and ``g_new``, ``p_old``) in their storage dtypes,
computes in float32 and stores rounded to the dtypes of ``p, m, v``; the
outputs may be the inputs' own storage (donation). The same body runs in two
kernels: ``_adam_kernel`` over one flat block, and ``_adam_multi_kernel`` over
many blocks at once (``step_many`` and friends: blocks with the same dtypes
and scalars share a launch, each program finding its tensor in a table of
element offsets), as torch's fused optimizers step many tensors per launch.

The math is :mod:`sofx.kernels.reference`'s, operation by operation, with
correctly rounded square roots and divisions (``sqrt_rn``, ``div_rn``; a
division by a step constant, sqrt(bc2), 1 - lr*wd, beta1 or beta2, is
``_div_by``: a true division's bits but for tiny or huge operands, where it is
within an ulp) and the same fused multiply-adds as torch's CPU kernels (see
:mod:`sofx.kernels._cpu_source`) and no others (``COMPILE_OPTIONS``)::

    step:  L2: g = fma(p, wd, g)          decoupled: p = p * (1 - lr*wd)
           m' = fma(c, g - m, m or g)     (torch's lerp)   v' = fma((1-b2)*g, g, v*b2)
           p' = p + (-lr/bc1 * m') / (sqrt(v')/sqrt(bc2) + eps)
    undo:  p = (p' + (lr/bc1 * m') / (sqrt(v')/sqrt(bc2) + eps)) / (1 - lr*wd if decoupled)
           gh = g or fma(p, wd, g);  m = (m' - (1-b1)*gh) / b1;  v = max0((v' - ((1-b2)*gh)*gh) / b2)

Checked calls (``StepCall.skip``, ``UndoRedoCall.skip``: ``undo="auto"``'s test of the gradient's finiteness
and of the inverse's precision, :data:`sofx.kernels.base.FINITE_CHUNK`) run one chunk per program
(:data:`CHECK_BLOCK` elements on :data:`CHECK_WARPS` warps): the program loads its chunk, decides for it
(:func:`_chunk_bad`, the CPU kernels' test operation by operation), stores its flag and, only where it is 0,
the results: the same single pass, one byte more per chunk.

Tests run these kernels with ``TRITON_INTERPRET=1`` on CPU tensors (then
:func:`supports` accepts CPU tensors too). Importing this module requires
triton; :func:`sofx.kernels.select_backend` treats an ImportError as "not
available".
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from types import MappingProxyType
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from sofx.errors import UnsupportedError
from sofx.kernels import reference
from sofx.kernels.base import (FINITE_CHUNK, STORAGE_CHECKED, AdamScalars, AdamVariant, LossyL2, StepCall, Triple,
                               UndoCall, UndoRedoCall,
                               check_block_tensors, check_skip, gradient_limit_bits, is_number, kernel_param_copy,
                               lossy_factor, lossy_l2, mark_written, refuse_traced, scalars_key, traced_possible,
                               write_kept_param_copy, write_outputs)
from sofx.kernels.donation import may_refuse_write, refuse_shared_memory
from sofx.kernels.layout import in_layout_of, in_memory_order, same_layout, spans_after_copies, spans_in_memory_order

_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

__all__ = ["NAME", "supports", "step", "undo", "undo_redo", "step_many", "undo_many", "undo_redo_many", "BLOCK",
           "COMPILE_OPTIONS", "CHECKS_FINITE", "CHECKS_OVERLAP", "CHECK_BLOCK"]

NAME = "triton"
CHECKS_FINITE = True  # step_many / undo_redo_many take checked calls (skip), see CHECK_BLOCK
CHECKS_OVERLAP = True  # every entry refuses written arrays that share memory (donation.refuse_shared_memory)
BLOCK = 1024
# A checked call (``skip``, :data:`sofx.kernels.base.FINITE_CHUNK`) runs one chunk per program, so that a
# program decides for its whole chunk (:func:`_chunk_bad`) before it stores any of it, in the same pass: the
# elements per thread of the unchecked kernel's programs (BLOCK on 4 warps), so the same registers per thread.
CHECK_BLOCK = FINITE_CHUNK
CHECK_WARPS = 4 * CHECK_BLOCK // BLOCK
# Compiled exactly as written: Triton fuses a*b + c into one multiply-add by default on GPUs (and
# leaves plain mul/add free for ptxas to contract), which rounds differently from the reference's
# separate operations. The interpreter never fuses, so only a compiled kernel shows the difference;
# tests/test_triton_ptx.py compiles the kernel for sm_80 and sm_90 on CPU and checks the PTX.
COMPILE_OPTIONS = MappingProxyType({"enable_fp_fusion": False})
VECTOR_MULTIPLE = 16

_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OP_STEP, _OP_UNDO, _OP_UNDO_REDO = 0, 1, 2


# Triton decides when it decorates the kernels (at import) whether they run under its interpreter.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(device: torch.device | str, param_dtype: torch.dtype, state_dtype: torch.dtype) -> bool:
    """CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``) with fp32/bf16/fp16 params and states."""
    kind = torch.device(device).type
    on_device = kind == "cuda" or (kind == "cpu" and _INTERPRETING)
    return on_device and param_dtype in _STORAGE_DTYPES and state_dtype in _STORAGE_DTYPES


# ------------------------------------------------------------------ kernel
@triton.jit
def _to_storage(x, DT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """float32 ``x`` rounded to the storage dtype ``DT`` (round to nearest even, a nan stays a nan).

    bfloat16 on a GPU: the hardware conversion (``cvt.rn.bf16x2.f32``, two values per instruction,
    what torch's own CUDA conversion uses: a nan becomes the canonical one). Under the interpreter,
    whose cast truncates, ``SOFT_BF16``: the same rounding in integer arithmetic, a nan keeping its
    sign and payload as torch's CPU conversion does (six integer operations per value: on a GPU that
    would make the all-bf16 step compute bound, see benchmarks/triton_sass.py)."""
    if DT == tl.bfloat16:
        if SOFT_BF16:
            u = x.to(tl.uint32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            r = tl.where(x != x, (u >> 16) | 0x40, r)
            return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    else:
        return x.to(DT)


@triton.jit
def _div_by(x, b, rb):
    """``x / b`` for a scalar ``b`` given ``rb = RN(1/b)``: the product, its remainder by one multiply-add,
    one multiply-add correction (three operations where ``div_rn`` takes about ten). The bits of
    ``div_rn(x, b)`` wherever ``|x| >= 2^-78`` (or x is 0, inf or nan), ``x / b`` is finite and ``b``, ``1/b``
    are normal (the proof and its exhaustive check: ``div_by`` in sofx/kernels/_cpu_source.py,
    tests/test_cpu_division.py); elsewhere within an ulp. The C function's operations, so its bits everywhere:
    where ``x / b`` overflows, +inf for a positive ``x`` and nan for a negative one (the remainder clamped to
    the largest float, a nan one too, as its ``minss``: ``tl.minimum`` does not propagate nan, one ``min.f32``)."""
    q = x * rb
    r = tl.fma(q, b, -x)
    rc = tl.minimum(r, 3.4028234663852886e38)
    return tl.fma(-rc, rb, q)


@triton.jit
def _l2_terms(t, gh, p, m0, vv, n_l2, k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2, k_l2t):
    """:func:`_chunk_bad`'s ``t`` (``gh * gh * c``) with L2 mode's terms where ``n_l2`` and ``k_l2t``:
    :func:`sofx.kernels.base._l2_term`'s operations in its order (``m0``: ``mb``, ``vv``: ``v``)."""
    mp = m0 * k_r1 + gh * k_omb1
    vp = vv * k_r2 + (gh * k_omb2) * gh
    q = tl.where(mp == 0.0, 0.0, tl.div_rn(tl.abs(mp), tl.sqrt_rn(vp)))
    ap = tl.abs(p)
    ag = tl.abs(gh)
    a = (ap * k_wa + q * k_wka) + ag
    b = (ap * k_wb + q * k_wkb) + ag
    t1 = (a * ag) * k_cv
    t2 = (b * b) * k_cm
    tl2 = tl.where(t1 > t, t1, t)
    tl2 = tl.where(t2 > tl2, t2, tl2)
    return tl.where(n_l2 & (k_l2t != 0), tl2, t)


@triton.jit
def _chunk_bad(p, g, g2, m, v, mask, u_gs, u_wd, u_l2, u_omb1, u_omb2, u_b2, u_ss, u_bc2, u_eps, s_gs, s_wd, s_l2,
               k_lim, k_c, k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2, k_l2t, OP: tl.constexpr,
               ROUND_S: tl.constexpr, HAS_P_OLD: tl.constexpr, L2_CHECK: tl.constexpr):
    """1 where the chunk a program holds has an element a checked step leaves alone, else 0: its gradient
    (an undo+redo's new one) beyond the limit's bits ``k_lim`` (inf and nan included), or a step an
    algebraic inverse would restore too lossily (``k_c``: the lossy factor; a zero ``v`` with a nonzero
    effective gradient is flagged for any ``k_c > 0`` unless ``m`` is 0 too, the moments are stored in float32
    (``ROUND_S``) and no L2 decay makes the effective gradients depend on p: the inverse then gives both back
    exactly, :func:`sofx.kernels.base.zeros_come_back`; 0, a beta of 0 or a step from zero moments
    (``StepCall.zero_moments``), still flags a nan ``v``, a non-finite ``m`` or effective gradient). The same
    operations, in the same order, as :func:`sofx.kernels.base.lossy_elements` and the CPU kernels'
    ``chunk_exact``; ``p`` is the parameter before the step (an undo+redo's ``p_old``, else ``p'``). L2 mode:
    ``k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2``, :class:`sofx.kernels.base.LossyL2`'s (its
    ``_l2_term``), but where ``k_l2t`` is 0 (the step's record keeps p: ``StepCall.p_kept``); an undo+redo's
    ``p'`` (no ``HAS_P_OLD``) in L2 mode first what its inverse recovers (``u_ss, u_bc2, u_eps``: the undone
    step's; :func:`sofx.kernels.base._recovered_param`). Both compiled only where ``L2_CHECK`` (a launch whose
    step, or undone step, has L2 decay): the other kernels keep their registers (compiled for sm_90, a checked
    step takes 109 a thread with them, 56 without; an undo+redo 151-160 against 71-72)."""
    n_l2 = s_l2 != 0  # (as the step's: also a decay that rounds to 0 in float32, fma(p, 0, g) nan for an inf p)
    m0 = m  # 0 where the moments' m is (an undo+redo's: the undone m's numerator)
    if OP == 2:
        if L2_CHECK and not HAS_P_OLD:
            pe = p + tl.div_rn(u_ss * m, tl.div_rn(tl.sqrt_rn(v), u_bc2) + u_eps)
            p = tl.where((u_l2 != 0) | n_l2, pe, p)
        gn = g2
        go = g * u_gs
        o_l2 = u_l2 != 0
        go = tl.where(o_l2, go + p * u_wd, go)
        x = v - (u_omb2 * go) * go
        vv = tl.where(x < 0.0, 0.0, x)  # b2 times the undone v
        m0 = m - u_omb1 * go
        zok = ~n_l2 & ~o_l2
    else:
        gn = g
        vv = v
        zok = ~n_l2
    bad = (gn.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > k_lim
    gh = gn * s_gs
    gh = tl.where(n_l2, gh + p * s_wd, gh)
    t = (gh * gh) * k_c
    if L2_CHECK:
        t = _l2_terms(t, gh, p, m0, vv, n_l2, k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2, k_l2t)
    if OP == 2:
        t = t * u_b2
    over = ~(t <= vv)
    if ROUND_S == tl.float32:
        over = over & ~(zok & (vv == 0.0) & (m0 == 0.0))
    lossy = over | ~(t <= 3.4028234663852886e38) | ~(tl.abs(m) <= 3.4028234663852886e38)
    bad = (bad | lossy) & mask
    return tl.max(bad.to(tl.int32), axis=0)


@triton.jit
def _adam_elements(p_ptr, g_ptr, m_ptr, v_ptr, g2_ptr, pold_ptr, po_ptr, mo_ptr, vo_ptr, pc_ptr, sk_ptr, chunk,
                   offs, mask,
                   u_gs, u_pdiv, u_wd, u_l2, u_bc2, u_eps, u_ss, u_omb1, u_b1, u_omb2, u_b2, u_rbc2, u_rpdiv, u_rb1,
                   u_rb2, s_gs, s_pmul, s_wd, s_l2, s_small, s_coef, s_b2, s_c2, s_bc2, s_eps, s_nss, s_rbc2,
                   k_lim, k_c, k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2, k_l2t,
                   OP: tl.constexpr, HAS_P_OLD: tl.constexpr, ROUND_P: tl.constexpr, ROUND_S: tl.constexpr,
                   SOFT_BF16: tl.constexpr, HAS_COPY: tl.constexpr, ROUND_C: tl.constexpr, CHECK: tl.constexpr,
                   L2_CHECK: tl.constexpr):
    """The operation ``OP`` on the elements ``offs`` (where ``mask``) of one block's tensors. ``CHECK``: a
    checked step (the program's elements are chunk ``chunk`` of the block, see :data:`CHECK_BLOCK`): where
    :func:`_chunk_bad` finds one, nothing is stored but the chunk's flag (``sk_ptr``); ``L2_CHECK``: its L2
    terms compiled in."""
    if HAS_P_OLD:
        p = tl.load(pold_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    if CHECK:
        g2 = g
        if OP == 2:
            g2 = tl.load(g2_ptr + offs, mask=mask, other=1.0).to(tl.float32)
        skip = _chunk_bad(p, g, g2, m, v, mask, u_gs, u_wd, u_l2, u_omb1, u_omb2, u_b2, u_ss, u_bc2, u_eps, s_gs,
                          s_wd, s_l2, k_lim, k_c, k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2,
                          k_l2t, OP, ROUND_S, HAS_P_OLD, L2_CHECK)
        tl.store(sk_ptr + chunk, skip.to(tl.uint8))
        mask = mask & (tl.full(offs.shape, 0, tl.int32) == skip)  # (a block-wide comparison: a mask of int1)
    if OP != 0:
        # inverse of the step taken with the u_* scalars
        g = g * u_gs
        if not HAS_P_OLD:
            d = _div_by(tl.sqrt_rn(v), u_bc2, u_rbc2) + u_eps
            p = _div_by(p + tl.div_rn(u_ss * m, d), u_pdiv, u_rpdiv)  # u exactly as the step computed it
        g = tl.where(u_l2 != 0, tl.fma(p, u_wd, g), g)
        m = _div_by(m - u_omb1 * g, u_b1, u_rb1)
        x = _div_by(v - (u_omb2 * g) * g, u_b2, u_rb2)  # the step's own term: moments of 0 come back 0
        v = tl.where(x < 0.0, 0.0, x)  # clamp at 0, nan stays nan
        if OP == 2:
            # the undone values as they would be stored, then the new gradient
            p = _to_storage(p, ROUND_P, SOFT_BF16).to(tl.float32)
            m = _to_storage(m, ROUND_S, SOFT_BF16).to(tl.float32)
            v = _to_storage(v, ROUND_S, SOFT_BF16).to(tl.float32)
            if CHECK:
                g = g2  # (loaded for the check: loaded again under the new mask, it was read twice)
            else:
                g = tl.load(g2_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    if OP != 1:
        g = g * s_gs
        p = p * s_pmul
        g = tl.where(s_l2 != 0, tl.fma(p, s_wd, g), g)
        m = tl.fma(s_coef, g - m, tl.where(s_small != 0, m, g))
        v = tl.fma(s_c2 * g, g, v * s_b2)
        d = _div_by(tl.sqrt_rn(v), s_bc2, s_rbc2) + s_eps
        p = p + tl.div_rn(s_nss * m, d)
    p_stored = _to_storage(p, ROUND_P, SOFT_BF16)
    tl.store(po_ptr + offs, p_stored, mask=mask)
    tl.store(mo_ptr + offs, _to_storage(m, ROUND_S, SOFT_BF16), mask=mask)
    tl.store(vo_ptr + offs, _to_storage(v, ROUND_S, SOFT_BF16), mask=mask)
    if HAS_COPY:  # p_copy: the stored parameters in the copy's dtype, as p_copy.copy_(p_out)
        tl.store(pc_ptr + offs, _to_storage(p_stored.to(tl.float32), ROUND_C, SOFT_BF16), mask=mask)


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, g2_ptr, pold_ptr, po_ptr, mo_ptr, vo_ptr, pc_ptr, sk_ptr, n,
                 # undo scalars (or the step's, for OP == 0)
                 u_gs, u_pdiv, u_wd, u_l2, u_bc2, u_eps, u_ss, u_omb1, u_b1, u_omb2, u_b2,
                 u_rbc2, u_rpdiv, u_rb1, u_rb2,
                 # step scalars
                 s_gs, s_pmul, s_wd, s_l2, s_small, s_coef, s_b2, s_c2, s_bc2, s_eps, s_nss, s_rbc2,
                 # checked-step scalars (CHECK)
                 k_lim, k_c, k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2, k_l2t,
                 OP: tl.constexpr, HAS_P_OLD: tl.constexpr, ROUND_P: tl.constexpr, ROUND_S: tl.constexpr,
                 SOFT_BF16: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 HAS_COPY: tl.constexpr = False, ROUND_C: tl.constexpr = tl.float32, CHECK: tl.constexpr = False,
                 L2_CHECK: tl.constexpr = False):
    """One flat block of ``n`` elements, ``BLOCK_SIZE`` per program."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    _adam_elements(p_ptr, g_ptr, m_ptr, v_ptr, g2_ptr, pold_ptr, po_ptr, mo_ptr, vo_ptr, pc_ptr, sk_ptr, pid,
                   offs, offs < n,
                   u_gs, u_pdiv, u_wd, u_l2, u_bc2, u_eps, u_ss, u_omb1, u_b1, u_omb2, u_b2, u_rbc2, u_rpdiv, u_rb1,
                   u_rb2, s_gs, s_pmul, s_wd, s_l2, s_small, s_coef, s_b2, s_c2, s_bc2, s_eps, s_nss, s_rbc2,
                   k_lim, k_c, k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2, k_l2t, OP, HAS_P_OLD,
                   ROUND_P, ROUND_S, SOFT_BF16, HAS_COPY, ROUND_C, CHECK, L2_CHECK)


# The multi-tensor kernel's table: a row of 14 int64 per tensor of a launch: its first program, its element
# count, per pointer argument (in this order) the element offset of its storage from that argument, and its
# number of programs (for the launcher's program-to-tensor map).
_ROW_SLOTS = ("p", "g", "m", "v", "g2", "pold", "po", "mo", "vo", "pc", "sk")
_ROW_WIDTH = 2 + len(_ROW_SLOTS)  # 13 fields the kernel reads, then the count


@triton.jit
def _adam_multi_kernel(p_ptr, g_ptr, m_ptr, v_ptr, g2_ptr, pold_ptr, po_ptr, mo_ptr, vo_ptr, pc_ptr, sk_ptr,
                       rows_ptr, tensor_of_ptr,
                       u_gs, u_pdiv, u_wd, u_l2, u_bc2, u_eps, u_ss, u_omb1, u_b1, u_omb2, u_b2,
                       u_rbc2, u_rpdiv, u_rb1, u_rb2,
                       s_gs, s_pmul, s_wd, s_l2, s_small, s_coef, s_b2, s_c2, s_bc2, s_eps, s_nss, s_rbc2,
                       k_lim, k_c, k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2, k_l2t,
                       OP: tl.constexpr, HAS_P_OLD: tl.constexpr, ROUND_P: tl.constexpr, ROUND_S: tl.constexpr,
                       SOFT_BF16: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_COPY: tl.constexpr,
                       ROUND_C: tl.constexpr, ALIGNED: tl.constexpr, ROW: tl.constexpr,
                       CHECK: tl.constexpr = False, L2_CHECK: tl.constexpr = False):
    """Many tensors in one launch: program ``pid`` runs ``BLOCK_SIZE`` elements of tensor
    ``tensor_of[pid]``, whose row in ``rows`` holds its first program, its element count and, per
    pointer argument, the element offset of its storage from that argument (every tensor of a slot
    lives in the same address space, so ``ptr + offset`` addresses it). ``ALIGNED``: every count and
    offset is a multiple of 16 (the launcher checks), so loads and stores are 128-bit wide. ``ROW``: the
    table's row length (``_ROW_WIDTH + 1``)."""
    pid = tl.program_id(0)
    row = rows_ptr + tl.load(tensor_of_ptr + pid).to(tl.int64) * ROW
    n = tl.load(row + 1)
    d_p = tl.load(row + 2)
    d_g = tl.load(row + 3)
    d_m = tl.load(row + 4)
    d_v = tl.load(row + 5)
    d_g2 = tl.load(row + 6)
    d_pold = tl.load(row + 7)
    d_po = tl.load(row + 8)
    d_mo = tl.load(row + 9)
    d_vo = tl.load(row + 10)
    d_pc = tl.load(row + 11)
    sk = sk_ptr
    if CHECK:
        sk = sk_ptr + tl.load(row + 12)  # (flags: one byte per chunk, never aligned)
    if ALIGNED:
        n = tl.multiple_of(n, 16)
        d_p = tl.multiple_of(d_p, 16)
        d_g = tl.multiple_of(d_g, 16)
        d_m = tl.multiple_of(d_m, 16)
        d_v = tl.multiple_of(d_v, 16)
        d_g2 = tl.multiple_of(d_g2, 16)
        d_pold = tl.multiple_of(d_pold, 16)
        d_po = tl.multiple_of(d_po, 16)
        d_mo = tl.multiple_of(d_mo, 16)
        d_vo = tl.multiple_of(d_vo, 16)
        d_pc = tl.multiple_of(d_pc, 16)
    chunk = pid - tl.load(row)
    offs = chunk * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    _adam_elements(p_ptr + d_p, g_ptr + d_g, m_ptr + d_m, v_ptr + d_v, g2_ptr + d_g2, pold_ptr + d_pold,
                   po_ptr + d_po, mo_ptr + d_mo, vo_ptr + d_vo, pc_ptr + d_pc, sk, chunk, offs, offs < n,
                   u_gs, u_pdiv, u_wd, u_l2, u_bc2, u_eps, u_ss, u_omb1, u_b1, u_omb2, u_b2, u_rbc2, u_rpdiv, u_rb1,
                   u_rb2, s_gs, s_pmul, s_wd, s_l2, s_small, s_coef, s_b2, s_c2, s_bc2, s_eps, s_nss, s_rbc2,
                   k_lim, k_c, k_cv, k_cm, k_wa, k_wb, k_wka, k_wkb, k_r1, k_r2, k_omb1, k_omb2, k_l2t, OP, HAS_P_OLD,
                   ROUND_P, ROUND_S, SOFT_BF16, HAS_COPY, ROUND_C, CHECK, L2_CHECK)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ------------------------------------------------------------------ scalars
class _UndoArgs(NamedTuple):
    gs: float
    pdiv: float
    wd: float
    l2: int
    bc2: float
    eps: float
    ss: float
    omb1: float
    b1: float
    omb2: float
    b2: float
    rbc2: float  # float32 reciprocals of bc2, pdiv, b1, b2 (for _div_by)
    rpdiv: float
    rb1: float
    rb2: float


class _StepArgs(NamedTuple):
    gs: float
    pmul: float
    wd: float
    l2: int
    small: int
    coef: float
    b2: float
    c2: float
    bc2: float
    eps: float
    nss: float
    rbc2: float


def _f32(x: float) -> float:
    return float(np.float32(x))


def _recip(x: float) -> float:
    """RN(1/b) in float32 for b = float32(x), the divisor the kernel sees; inf for 0, as float32 division
    gives (a divisor of 0 is never used: the undo of a step whose 1 - lr*wd is 0 restores p from p_old)."""
    b = _f32(x)
    return _f32(1.0 / b) if b != 0 else math.copysign(math.inf, b)


def _python_numbers(s: AdamScalars) -> AdamScalars:
    """``s`` with every field a Python int or float (numpy's numbers are numbers to the contract, but a kernel
    launch takes Python's only)."""
    if all(type(x) is float or type(x) is int for x in s):
        return s
    return AdamScalars(*(x if type(x) in (int, float) else int(x) if isinstance(x, numbers.Integral) else float(x)
                         for x in s))


def _step_args(s: AdamScalars, variant: AdamVariant) -> _StepArgs:
    s = _python_numbers(s)
    step_size, bc2_sqrt = reference.bias_corrections(s, variant)
    has_decay = s.weight_decay != 0
    omb1 = _f32(1 - s.beta1)
    small = abs(omb1) < 0.5
    coef = omb1 if small else float(np.float32(omb1) - np.float32(1.0))  # torch's lerp, in float32
    return _StepArgs(gs=s.grad_scale if s.grad_scale != 1 else 1.0,
                     pmul=(1 - s.lr * s.weight_decay) if variant.decoupled and has_decay else 1.0,
                     wd=s.weight_decay, l2=int(not variant.decoupled and has_decay), small=int(small), coef=coef,
                     b2=s.beta2, c2=1 - s.beta2, bc2=bc2_sqrt, eps=s.eps, nss=-step_size, rbc2=_recip(bc2_sqrt))


def _undo_args(s: AdamScalars, variant: AdamVariant) -> _UndoArgs:
    s = _python_numbers(s)
    step_size, bc2_sqrt = reference.bias_corrections(s, variant)
    has_decay = s.weight_decay != 0
    pdiv = (1 - s.lr * s.weight_decay) if variant.decoupled and has_decay else 1.0
    return _UndoArgs(gs=s.grad_scale if s.grad_scale != 1 else 1.0, pdiv=pdiv,
                     wd=s.weight_decay, l2=int(not variant.decoupled and has_decay), bc2=bc2_sqrt, eps=s.eps,
                     ss=step_size, omb1=1 - s.beta1, b1=s.beta1, omb2=1 - s.beta2, b2=s.beta2,
                     rbc2=_recip(bc2_sqrt), rpdiv=_recip(pdiv), rb1=_recip(s.beta1), rb2=_recip(s.beta2))


class _CheckArgs(NamedTuple):
    lim: int  # the float32 bits above which a gradient element's magnitude is flagged
    c: float  # lossy_factor of the step taken (the redo of an undo+redo)
    l2: LossyL2  # the constants of its L2 terms
    l2t: int  # 0: no L2 term (StepCall.p_kept)

    def flat(self) -> tuple:
        """The kernels' ``k_*`` arguments, in their order."""
        return (self.lim, self.c, *self.l2, self.l2t)


def _check_args(s: AdamScalars, g_dtype: torch.dtype, zero_moments: bool = False,
                s_old: AdamScalars | None = None, p_kept: bool = False) -> _CheckArgs:
    """A checked call's constants, as the CPU kernels' (``gradient_limit_bits``, ``lossy_factor``, 0 for a
    step from zero moments: ``StepCall.zero_moments``): the kernel compares the float32 bits of the gradient
    it loaded (a bfloat16's upper half, a float16 widened exactly: the float16 limit's own value). ``s_old``: an
    undo+redo's undone step (:func:`~sofx.kernels.base.lossy_l2`); ``p_kept``: no L2 term (``StepCall.p_kept``)."""
    s = _python_numbers(s)
    lim32, _, lim16 = gradient_limit_bits(s.grad_scale)
    if g_dtype == torch.float16:
        lim32 = int(np.array(lim16, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.int32))
    c = 0.0 if zero_moments else _f32(lossy_factor(s.beta1, s.beta2))
    l2 = lossy_l2(s, zero_moments, None if s_old is None else _python_numbers(s_old))
    return _CheckArgs(lim32, c, l2, int(not p_kept))


# placeholders for the unused half of a launch (step: no undo scalars; undo: no step scalars)
_NO_UNDO = _UndoArgs(gs=1.0, pdiv=1.0, wd=0.0, l2=0, bc2=1.0, eps=1.0, ss=0.0, omb1=0.0, b1=1.0, omb2=0.0, b2=1.0,
                     rbc2=1.0, rpdiv=1.0, rb1=1.0, rb2=1.0)
_NO_STEP = _StepArgs(gs=1.0, pmul=1.0, wd=0.0, l2=0, small=1, coef=0.0, b2=1.0, c2=0.0, bc2=1.0, eps=1.0, nss=0.0,
                     rbc2=1.0)
_NO_CHECK = _CheckArgs(lim=0, c=0.0, l2=LossyL2(*[0.0] * len(LossyL2._fields)), l2t=0)


# ------------------------------------------------------------------ checks and launch
def _check(what: str, tensors: Sequence[tuple[str, torch.Tensor | None]], like: torch.Tensor,
           out: Sequence[torch.Tensor] | None) -> None:
    """One call's tensors checked for the kernels, traced ones refused (:func:`~sofx.kernels.base.refuse_traced`);
    errors name the call ``what`` (``"triton.step_many[3]"``)."""
    check_block_tensors(what, tensors, like, out)
    refuse_traced(what, [*tensors, *zip(("out[0]", "out[1]", "out[2]"), out or ())])
    m, v = tensors[2][1], tensors[3][1]
    if not supports(like.device, like.dtype, m.dtype):
        raise UnsupportedError(f"{what}: device {like.device} with param dtype {like.dtype} and state dtype "
                               f"{m.dtype} is not supported (CUDA, or CPU under TRITON_INTERPRET=1; "
                               "float32/bfloat16/float16)")
    if v.dtype != m.dtype:
        raise UnsupportedError(f"{what}: m is {m.dtype} and v {v.dtype}; the kernels keep both moments in "
                               "one state dtype")


def _contiguous(t: torch.Tensor, spans: bool = False, like: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` as the kernels read it: contiguous, in a storage dtype (a copy where it is not already);
    ``spans``: a block of one dense layout (:func:`~sofx.kernels.layout.spans_in_memory_order`), whose tensors
    are read as they are; ``like``: a block run over the memory spans of its parameter ``like``'s layout, ``t``
    copied into it where it has another (:func:`~sofx.kernels.layout.spans_after_copies`)."""
    if t.dtype not in _STORAGE_DTYPES:
        t = t.to(torch.float32)
    if like is not None:
        return in_layout_of(t, like)
    return t if spans or t.is_contiguous() else t.contiguous()


class _Operands(NamedTuple):
    """One block's launch: its tensors contiguous in the kernel's pointer order (``_ROW_SLOTS``; an absent
    one is ``p`` again), their addresses and element sizes, the element count, the result targets, the
    kernel-written copy and the caller's ``out``; ``layout``: its tensors' dtypes and misalignments within
    an element (blocks launched together must agree); ``aligned``: whether the multi-tensor kernel may take
    it as ``ALIGNED``: 16 | n, and every pointer a multiple of 16 elements (so every offset between two
    blocks' pointers is one too), the flags of a checked call aside (read and written one byte a chunk)."""

    arrays: tuple[torch.Tensor, ...]
    ptrs: tuple[int, ...]
    sizes: tuple[int, ...]
    n: int
    targets: list[torch.Tensor]
    pc: torch.Tensor | None
    out: Sequence[torch.Tensor] | None
    p_copy: torch.Tensor | None
    layout: tuple
    aligned: bool
    skip: torch.Tensor | None = None


def _operands(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g2: torch.Tensor | None,
              p_old: torch.Tensor | None, out: Sequence[torch.Tensor] | None,
              p_copy: torch.Tensor | None, skip: torch.Tensor | None = None) -> _Operands:
    """Results go to ``out`` (or fresh tensors), via contiguous temporaries where needed; ``p_copy`` is
    written by the kernel where it is contiguous in a storage dtype, else copied afterwards."""
    spans = spans_in_memory_order(p, (g, m, v, g2, p_old), skip)
    relaid = p if not spans and spans_after_copies(p, skip) else None  # (the others copied into its layout)
    spans = spans or relaid is not None
    cp, cg, cm, cv = (_contiguous(t, spans, relaid) for t in (p, g, m, v))
    ip, ig, im, iv = _address(cp), _address(cg), _address(cm), _address(cv)
    if out is not None and out[0] is p and out[1] is m and out[2] is v and cp is p and cm is m and cv is v:
        targets, it = [p, m, v], (ip, im, iv)  # donation: the inputs themselves (the common case, cheaply)
    else:
        targets = []
        for i, like in enumerate((p, m, v)):
            o = out[i] if out is not None else None
            if o is not None and o.dtype == like.dtype and (same_layout(o, p) if spans else o.is_contiguous()):
                targets.append(o)
            elif spans:
                targets.append(torch.empty_strided(p.shape, p.stride(), dtype=like.dtype, device=p.device))
            else:
                targets.append(torch.empty(p.shape, dtype=like.dtype, device=p.device))
        it = tuple(_address(t) for t in targets)
    pc = kernel_param_copy(p_copy, _STORAGE_DTYPES, p if spans else None)  # (another layout: copied afterwards)
    c2 = _contiguous(g2, spans, relaid) if g2 is not None else cg
    co = _contiguous(p_old, spans, relaid) if p_old is not None else cp
    arrays = (cp, cg, cm, cv, c2, co, *targets, pc if pc is not None else cp, skip if skip is not None else cp)
    # An absent tensor's slot holds p (or g) again: its address is not asked twice (every tensor of every step).
    info = (ip, ig, im, iv, _address(c2) if g2 is not None else ig, _address(co) if p_old is not None else ip,
            *it, _address(pc) if pc is not None else ip)
    sk = _address(skip) if skip is not None else ip
    n = p.numel()
    return _Operands(arrays, tuple([a[0] for a in info] + [sk[0]]), tuple([a[1] for a in info] + [sk[1]]), n,
                     targets, pc, out, p_copy, tuple([a[2] for a in info] + [sk[2]]),
                     n % VECTOR_MULTIPLE == 0 and all([a[3] for a in info]), skip)


def _address(t: torch.Tensor) -> tuple[int, int, tuple[torch.dtype, int], bool]:
    """``t``'s address, element size, (dtype, misalignment within an element) and whether the address is a
    multiple of 16 elements."""
    ptr, size = t.data_ptr(), t.element_size()
    return ptr, size, (t.dtype, ptr % size), ptr % (VECTOR_MULTIPLE * size) == 0


def _finish(ops: _Operands) -> Triple:
    results = write_outputs(ops.targets, ops.out)
    if ops.pc is None:  # (a checked call's flagged chunks are left alone, in the copy too)
        write_kept_param_copy(ops.p_copy, results[0], ops.skip)
    return results


def _constexprs(op: int, ops: _Operands, has_p_old: bool, u: _UndoArgs, st: _StepArgs, k: _CheckArgs | None) -> dict:
    """A launch's compile-time arguments; a checked one (``k``) compiles the L2 terms of its check (``L2_CHECK``)
    where its step, or an undo+redo's undone step, has L2 decay."""
    fp, fm, pc = ops.arrays[0], ops.arrays[2], ops.pc
    l2 = k is not None and bool(st.l2 or (op == _OP_UNDO_REDO and u.l2))
    shape = dict(BLOCK_SIZE=CHECK_BLOCK, CHECK=True, num_warps=CHECK_WARPS, L2_CHECK=l2) if k is not None else \
        dict(BLOCK_SIZE=BLOCK)
    return dict(OP=op, HAS_P_OLD=has_p_old, ROUND_P=_TL_DTYPES[fp.dtype], ROUND_S=_TL_DTYPES[fm.dtype],
                SOFT_BF16=_INTERPRETING, HAS_COPY=pc is not None,
                ROUND_C=_TL_DTYPES[pc.dtype] if pc is not None else tl.float32, **shape, **COMPILE_OPTIONS)


def _programs(n: int, check: bool = False) -> int:
    return -(-n // (CHECK_BLOCK if check else BLOCK))


def _run_flat(op: int, ops: _Operands, has_p_old: bool, u: _UndoArgs, st: _StepArgs, k: _CheckArgs | None) -> None:
    """One block by the flat kernel. Triton loads and stores 128 bits at a time only where the mask is
    provably constant over each group of elements, i.e. where n is a multiple of 16 (it specializes on
    that at launch): the last n % 16 elements, if any, get a launch of their own (16-element offsets
    keep the pointers 16-byte aligned). A checked call (``k``) decides a chunk whole: where n % 16 is not
    0 its last chunk (partial) gets the launch of its own, with its flag."""
    constexprs = _constexprs(op, ops, has_p_old, u, st, k)
    for start, count, programs in _flat_launches(ops.n, k is not None):
        # the kernel takes the tensors' addresses: the arrays themselves from element 0
        arrays = ops.arrays if start == 0 else _from(ops.arrays, start, ops.skip)
        _adam_kernel[(programs,)](*arrays, count, *u, *st, *(k or _NO_CHECK).flat(), **constexprs)


def _flat_launches(n: int, check: bool) -> list[tuple[int, int, int]]:
    """The flat kernel's launches for a block of ``n`` elements, as ``(start, count, programs)``: elements
    ``[start, start + count)`` by ``programs`` programs. Unchecked: the first ``n - n % 16``, then the rest;
    checked (``check``): where ``n % 16`` is not 0, the last (partial) chunk on its own. Numbers only (Python
    ints: a count of 2^31 or more is passed to the kernel as a 64-bit integer, its offsets are 64-bit)."""
    if check:
        head = n - (n % CHECK_BLOCK if n % VECTOR_MULTIPLE else 0)
    else:
        head = n - n % VECTOR_MULTIPLE
    return [(start, count, _programs(count, check)) for start, count in ((0, head), (head, n - head)) if count]


def _from(arrays: Sequence[torch.Tensor], start: int, skip: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each of ``arrays`` (contiguous, or of one dense layout: in memory order) from element ``start`` on; a
    tensor in several slots is sliced once.
    ``skip`` (the flags of a checked call, ``start`` a multiple of CHECK_BLOCK): from its chunk on."""
    sliced: dict[int, torch.Tensor] = {}
    if skip is not None:
        sliced[id(skip)] = skip[start // CHECK_BLOCK:]
    for a in arrays:
        if id(a) not in sliced:
            sliced[id(a)] = in_memory_order(a)[start:]
    return [sliced[id(a)] for a in arrays]


def _run_multi(op: int, group: Sequence[_Operands], has_p_old: bool, aligned: bool, u: _UndoArgs,
               st: _StepArgs, k: _CheckArgs | None) -> None:
    """Blocks of the same dtypes and scalars by one launch of the multi-tensor kernel. Its table is built
    on the host and copied to the device without waiting for it (pinned memory); the program-to-tensor
    map is expanded on the device."""
    count = len(group)
    table, first = _table(group, k is not None)
    device = group[0].arrays[0].device
    host = torch.from_numpy(table)
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = host.to(device, non_blocking=True)
    tensor_of = torch.repeat_interleave(torch.arange(count, dtype=torch.int32, device=device),
                                        on_device[:, _ROW_WIDTH], output_size=first)
    _adam_multi_kernel[(first,)](*group[0].arrays, on_device, tensor_of, *u, *st, *(k or _NO_CHECK).flat(),
                                 ALIGNED=aligned, ROW=_ROW_WIDTH + 1, **_constexprs(op, group[0], has_p_old, u, st, k))


def _table(group: Sequence[_Operands], check: bool) -> tuple[np.ndarray, int]:
    """The multi-tensor kernel's table for ``group`` (int64, a row of ``_ROW_WIDTH + 1`` per block: its first
    program, its element count, per pointer slot (``_ROW_SLOTS``) the element offset of its address from the
    first block's, ``(ptr - base) / size`` (exact: the blocks of a launch agree on each slot's misalignment
    within an element), and its program count) and the launch's program count. Reads only the blocks' numbers
    (``ptrs``, ``sizes``, ``n``)."""
    base, sizes = group[0].ptrs, group[0].sizes
    rows = []
    first = 0
    for ops in group:  # [first program, n, the offsets..., the tensor's program count]
        programs = _programs(ops.n, check)
        rows.append([first, ops.n, *[(ptr - b) // size for ptr, b, size in zip(ops.ptrs, base, sizes)], programs])
        first += programs
    return np.array(rows, dtype=np.int64).reshape(len(group), _ROW_WIDTH + 1), first


def _launch(op: int, blocks: Sequence[tuple], u: Sequence[_UndoArgs | None],
            st: Sequence[_StepArgs | None], k: Sequence[_CheckArgs | None]) -> list[Triple]:
    """Run ``op`` on ``blocks`` (each ``(p, g, m, v, g2, p_old, out, p_copy, skip)``, with its undo, step
    and check arguments ``u[i]``, ``st[i]``, ``k[i]``, the last None for an unchecked call): blocks that share
    dtypes, scalars and alignment go to one launch of the multi-tensor kernel, a block on its own to the
    flat kernel. The caller's tensors the launches write (``out``, ``p_copy``, ``skip``) get their version
    counters bumped after them, also where a launch raised after others ran."""
    prepared = [_operands(*b) for b in blocks]
    try:
        _launch_groups(op, blocks, prepared, u, st, k)
    finally:
        mark_written([t for b in blocks for t in (*(b[6] or ()), b[7], b[8])])
    return [_finish(ops) for ops in prepared]


def _launch_groups(op: int, blocks: Sequence[tuple], prepared: Sequence[_Operands], u: Sequence[_UndoArgs | None],
                   st: Sequence[_StepArgs | None], k: Sequence[_CheckArgs | None]) -> None:
    """The launches of :func:`_launch` (``prepared``: its blocks' operands)."""
    groups: dict[tuple, list[int]] = {}
    for i, (ops, b) in enumerate(zip(prepared, blocks)):
        if ops.n == 0:
            continue
        # same dtypes, and addresses that differ by whole elements (the kernel adds element offsets); the
        # scalars' arguments by identity (the caller derives one object per distinct scalars)
        key = (ops.arrays[0].device, b[5] is not None, ops.pc is not None, ops.layout, id(u[i]), id(st[i]),
               ops.aligned, k[i])
        groups.setdefault(key, []).append(i)
    for (device, has_p_old, _, _, _, _, aligned, ki), members in groups.items():
        ui, sti = u[members[0]] or _NO_UNDO, st[members[0]] or _NO_STEP
        with _on(device):  # Triton launches on the current device
            if len(members) == 1 or _capturing(device):  # a graph would replay the table's host buffer
                for i in members:
                    _run_flat(op, prepared[i], has_p_old, ui, sti, ki)
            else:
                _run_multi(op, [prepared[i] for i in members], has_p_old, aligned, ui, sti, ki)


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` made the current CUDA device for the block (nothing to do for CPU tensors)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _numbers(s: AdamScalars) -> bool:
    return all(is_number(x) for x in s)


# ------------------------------------------------------------------ API
def step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, out: Triple | None = None, p_copy: torch.Tensor | None = None) -> Triple:
    """One Adam step; returns ``(p', m', v')`` in the dtypes of ``p, m, v`` (``p_copy``: also gets ``p'``,
    stored by the kernel)."""
    return _step_many([StepCall(p, g, m, v, s, out, p_copy)], variant, ["triton.step"])[0]


def undo(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, p_old: torch.Tensor | None = None, out: Triple | None = None,
         p_copy: torch.Tensor | None = None) -> Triple:
    """Inverse of :func:`step` given the step's gradient and scalars (``p_old``: restore p from it)."""
    return _undo_many([UndoCall(p, g, m, v, s, p_old, out, p_copy)], variant, ["triton.undo"])[0]


def undo_redo(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g_old: torch.Tensor, s_old: AdamScalars,
              g_new: torch.Tensor, s_new: AdamScalars, variant: AdamVariant, *,
              p_old: torch.Tensor | None = None, out: Triple | None = None,
              p_copy: torch.Tensor | None = None) -> Triple:
    """``step(*undo(p, g_old, m, v, s_old), g_new, s_new)`` in one kernel (one pass over memory)."""
    return _undo_redo_many([UndoRedoCall(p, m, v, g_old, s_old, g_new, s_new, p_old, out, p_copy)], variant,
                           ["triton.undo_redo"])[0]


def step_many(calls: Sequence[StepCall], variant: AdamVariant) -> list[Triple]:
    """:func:`step` for every block, blocks of the same dtypes and scalars in one launch. Every block is
    checked before anything runs."""
    return _step_many(calls, variant, _names("step", len(calls)))


def undo_many(calls: Sequence[UndoCall], variant: AdamVariant) -> list[Triple]:
    """:func:`undo` for every block (as :func:`step_many`)."""
    return _undo_many(calls, variant, _names("undo", len(calls)))


def undo_redo_many(calls: Sequence[UndoRedoCall], variant: AdamVariant) -> list[Triple]:
    """:func:`undo_redo` for every block (as :func:`step_many`)."""
    return _undo_redo_many(calls, variant, _names("undo_redo", len(calls)))


def _step_many(calls: Sequence[StepCall], variant: AdamVariant, names: Sequence[str]) -> list[Triple]:
    """:func:`step_many`, errors naming call ``i`` ``names[i]`` (the single-block forms are named as such)."""
    _check_calls(names, calls, lambda c: [("p", c.p), ("g", c.g), ("m", c.m), ("v", c.v), ("p_copy", c.p_copy)])
    scalars = reference.concrete_checked([c.s for c in calls], where=names, bias_correction=variant.bias_correction)
    return _by_kernel(_OP_STEP, calls, names, [None] * len(calls), scalars, variant,
                      lambda c, _, s: (c.p, c.g, c.m, c.v, None, None, c.out, c.p_copy, c.skip),
                      lambda c, _, s: reference.step(c.p, c.g, c.m, c.v, s, variant, out=c.out, p_copy=c.p_copy))


def _undo_many(calls: Sequence[UndoCall], variant: AdamVariant, names: Sequence[str]) -> list[Triple]:
    """:func:`undo_many` (errors named as in :func:`_step_many`)."""
    _check_calls(names, calls, lambda c: [("p", c.p), ("g", c.g), ("m", c.m), ("v", c.v), ("p_old", c.p_old),
                                          ("p_copy", c.p_copy)])
    scalars = reference.concrete_checked([c.s for c in calls], variant, [c.p_old is not None for c in calls],
                                         names, bias_correction=variant.bias_correction)
    return _by_kernel(_OP_UNDO, calls, names, scalars, [None] * len(calls), variant,
                      lambda c, s, _: (c.p, c.g, c.m, c.v, None, c.p_old, c.out, c.p_copy, None),
                      lambda c, s, _: reference.undo(c.p, c.g, c.m, c.v, s, variant, p_old=c.p_old, out=c.out,
                                                     p_copy=c.p_copy))


def _undo_redo_many(calls: Sequence[UndoRedoCall], variant: AdamVariant, names: Sequence[str]) -> list[Triple]:
    """:func:`undo_redo_many` (errors named as in :func:`_step_many`)."""
    _check_calls(names, calls, lambda c: [("p", c.p), ("g_old", c.g_old), ("m", c.m), ("v", c.v),
                                          ("g_new", c.g_new), ("p_old", c.p_old), ("p_copy", c.p_copy)])
    olds = reference.concrete_checked([c.s_old for c in calls], variant, [c.p_old is not None for c in calls], names,
                                      bias_correction=variant.bias_correction)
    news = reference.concrete_checked([c.s_new for c in calls], where=names, bias_correction=variant.bias_correction)
    return _by_kernel(_OP_UNDO_REDO, calls, names, olds, news, variant,
                      lambda c, so, sn: (c.p, c.g_old, c.m, c.v, c.g_new, c.p_old, c.out, c.p_copy, c.skip),
                      lambda c, so, sn: reference.undo_redo(c.p, c.m, c.v, c.g_old, so, c.g_new, sn, variant,
                                                            p_old=c.p_old, out=c.out, p_copy=c.p_copy))


def _check_calls(names: Sequence[str], calls: Sequence,
                 named: Callable[[Any], list[tuple[str, torch.Tensor | None]]]) -> None:
    """Every call checked (:func:`_check` on ``named(call)``, its tensors by name; errors name call ``i``
    ``names[i]``), and the memory they write (:func:`~sofx.kernels.donation.refuse_shared_memory`), before
    anything runs. A
    call whose tensors are plain tensors of ``p``'s shape and device in storage dtypes, with ``out`` None or
    the inputs themselves, passes once a call of its device and dtypes has passed the full check."""
    supported: set[tuple] = set()  # (device, param dtype, state dtype) that passed the full check
    grad, transforms = traced_possible()
    storage = not STORAGE_CHECKED.get()
    for i, c in enumerate(calls):
        tensors = named(c)
        p, m = c.p, c.m
        if type(p) is torch.Tensor and type(m) is torch.Tensor and (p.device, p.dtype, m.dtype) in supported \
                and _plain(tensors, p, m, c.v, c.out, grad, transforms, storage):
            continue
        _check(names[i], tensors, p, c.out)
        supported.add((p.device, p.dtype, m.dtype))
    for i, c in enumerate(calls):
        if getattr(c, "skip", None) is not None:
            check_skip(names[i], c, c.p.device)
            refuse_traced(names[i], [("skip", c.skip)])
    refuse_shared_memory(calls, names)


def _plain(tensors: Sequence[tuple[str, torch.Tensor | None]], p: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
           out: Sequence[torch.Tensor] | None, grad: bool = True, transforms: bool = True,
           storage: bool = True) -> bool:
    """The common case of :func:`_check_calls` (what passes here passes :func:`check_block_tensors` and
    :func:`~sofx.kernels.base.refuse_traced`; ``grad, transforms``: :func:`~sofx.kernels.base.traced_possible`'s):
    nothing written that torch refuses to write (:func:`~sofx.kernels.donation.may_refuse_write`) among them,
    every storage holding its (contiguous) tensor (``storage=False``: the caller checked that,
    :data:`~sofx.kernels.base.STORAGE_CHECKED`)."""
    device, shape = p.device, p.shape
    if v.dtype != m.dtype:
        return False
    n = p.numel()
    for _, t in tensors:
        if t is not None and not (type(t) is torch.Tensor and t.dtype in _STORAGE_DTYPES and t.shape == shape
                                  and t.device == device and t.is_contiguous() and not (grad and t.requires_grad)
                                  and not (transforms and _wrapped(t))
                                  and (not storage or (t.storage_offset() + n) * t.element_size()
                                       <= t.untyped_storage().nbytes())):
            return False
    if not (out is None or (type(out) is tuple and len(out) == 3 and out[0] is p and out[1] is m and out[2] is v)):
        return False
    return not may_refuse_write([t for name, t in tensors if name == "p_copy"] + ([p, m, v] if out else []))


def _names(op: str, count: int) -> list[str]:
    """How errors name each block of a list form, a list of one block too: ``"triton.step_many[3]"``."""
    return [f"triton.{op}_many[{i}]" for i in range(count)]


def _by_kernel(op: int, calls: Sequence, names: Sequence[str], undo_scalars: Sequence[AdamScalars | None],
               step_scalars: Sequence[AdamScalars | None], variant: AdamVariant,
               block: Callable[..., tuple], fallback: Callable[..., Triple]) -> list[Triple]:
    """The calls whose scalars are all numbers through the kernels (``block(call, s_undo, s_step)``: the
    launch operands), the others (0-d tensors that cannot be read on the host) through ``fallback``, in
    the calls' order. Kernel arguments are derived once per distinct scalars. A checked call whose scalars
    cannot be read is refused before any call runs."""
    derived: dict[tuple, tuple[_UndoArgs | None, _StepArgs | None] | None] = {}  # None: not all numbers
    by_id: dict[tuple[int, int], tuple[_UndoArgs | None, _StepArgs | None] | None] = {}  # the same, by identity
    every: list[tuple[_UndoArgs | None, _StepArgs | None] | None] = []
    for i, (c, su, ss) in enumerate(zip(calls, undo_scalars, step_scalars)):
        ids = (id(su), id(ss))  # the lists hold the objects
        if ids not in by_id:
            key = tuple(None if x is None else scalars_key(x) for x in (su, ss))  # (an lr of -0.0 is not 0.0's)
            if key not in derived:
                numbers = (su is None or _numbers(su)) and (ss is None or _numbers(ss))
                derived[key] = (_undo_args(su, variant) if su is not None else None,
                                _step_args(ss, variant) if ss is not None else None) if numbers else None
            by_id[ids] = derived[key]
        every.append(by_id[ids])
        if by_id[ids] is None and getattr(c, "skip", None) is not None:
            raise UnsupportedError(f"{names[i]}: a checked call "
                                   "needs scalars whose values can be read (not traced)")
    checks: dict[tuple[int, torch.dtype, bool, int | None, bool], _CheckArgs] = {}
    results: list[Triple | None] = [None] * len(calls)
    launch, u_args, s_args, k_args = [], [], [], []
    for i, (c, su, ss, args) in enumerate(zip(calls, undo_scalars, step_scalars, every)):
        skip = getattr(c, "skip", None)
        if args is None:
            results[i] = fallback(c, su, ss)
            continue
        launch.append(i)
        u_args.append(args[0])
        s_args.append(args[1])
        if skip is None:
            k_args.append(None)
        else:
            g = c.g_new if op == _OP_UNDO_REDO else c.g
            zero = op == _OP_STEP and c.zero_moments
            kept = getattr(c, "p_kept", False)
            kk = (id(ss), g.dtype, zero, id(su) if op == _OP_UNDO_REDO else None, kept)
            if kk not in checks:
                checks[kk] = _check_args(ss, g.dtype, zero, su if op == _OP_UNDO_REDO else None, kept)
            k_args.append(checks[kk])
    if launch:
        done = _launch(op, [block(calls[i], undo_scalars[i], step_scalars[i]) for i in launch], u_args, s_args,
                       k_args)
        for i, r in zip(launch, done):
            results[i] = r
    return results  # type: ignore[return-value]
