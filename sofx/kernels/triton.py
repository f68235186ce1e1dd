"""Triton Adam kernels for CUDA tensors: step, inverse and one-pass undo+redo.

One kernel, specialized at compile time on the operation (step, undo,
undo+redo), the decay mode and whether a parameter snapshot is given; every
step-dependent value is a runtime argument, so a training run compiles each
variant once. Each program handles ``BLOCK`` elements (the last one masked):
it loads ``p, g, m, v`` (and ``g_new``, ``p_old``) in their storage dtypes,
computes in float32 and stores rounded to the dtypes of ``p, m, v``; the
outputs may be the inputs' own storage (donation).

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
           gh = g or fma(p, wd, g);  m = (m' - (1-b1)*gh) / b1;  v = max0((v' - (1-b2)*gh*gh) / b2)

Tests run these kernels with ``TRITON_INTERPRET=1`` on CPU tensors (then
:func:`supports` accepts CPU tensors too). Importing this module requires
triton; :func:`sofx.kernels.select_backend` treats an ImportError as "not
available".
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import NamedTuple, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from sofx.errors import UnsupportedError
from sofx.kernels import reference
from sofx.kernels.base import (AdamScalars, AdamVariant, check_block_tensors, concrete_scalars, is_number,
                               kernel_param_copy, write_outputs, write_param_copy)

__all__ = ["NAME", "supports", "step", "undo", "undo_redo", "BLOCK", "COMPILE_OPTIONS"]

NAME = "triton"
BLOCK = 1024
# Compiled exactly as written: Triton fuses a*b + c into one multiply-add by default on GPUs (and
# leaves plain mul/add free for ptxas to contract), which rounds differently from the reference's
# separate operations. The interpreter never fuses, so only a compiled kernel shows the difference;
# tests/test_triton_ptx.py compiles the kernel for sm_80 and sm_90 on CPU and checks the PTX.
COMPILE_OPTIONS = MappingProxyType({"enable_fp_fusion": False})
VECTOR_MULTIPLE = 16

Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OP_STEP, _OP_UNDO, _OP_UNDO_REDO = 0, 1, 2


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(device: torch.device | str, param_dtype: torch.dtype, state_dtype: torch.dtype) -> bool:
    """CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``) with fp32/bf16/fp16 params and states."""
    kind = torch.device(device).type
    on_device = kind == "cuda" or (kind == "cpu" and _interpreting())
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
    tests/test_cpu_division.py); elsewhere within an ulp."""
    q = x * rb
    r = tl.fma(-q, b, x)
    return tl.where((r < 0.0) | (r > 0.0), tl.fma(r, rb, q), q)


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, g2_ptr, pold_ptr, po_ptr, mo_ptr, vo_ptr, pc_ptr, n,
                 # undo scalars (or the step's, for OP == 0)
                 u_gs, u_pdiv, u_wd, u_l2, u_bc2, u_eps, u_ss, u_omb1, u_b1, u_omb2, u_b2,
                 u_rbc2, u_rpdiv, u_rb1, u_rb2,
                 # step scalars
                 s_gs, s_pmul, s_wd, s_l2, s_small, s_coef, s_b2, s_c2, s_bc2, s_eps, s_nss, s_rbc2,
                 OP: tl.constexpr, HAS_P_OLD: tl.constexpr, ROUND_P: tl.constexpr, ROUND_S: tl.constexpr,
                 SOFT_BF16: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 HAS_COPY: tl.constexpr = False, ROUND_C: tl.constexpr = tl.float32):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    if HAS_P_OLD:
        p = tl.load(pold_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    if OP != 0:
        # inverse of the step taken with the u_* scalars
        g = g * u_gs
        if not HAS_P_OLD:
            d = _div_by(tl.sqrt_rn(v), u_bc2, u_rbc2) + u_eps
            p = _div_by(p + tl.div_rn(u_ss * m, d), u_pdiv, u_rpdiv)  # u exactly as the step computed it
        g = tl.where(u_l2 != 0, tl.fma(p, u_wd, g), g)
        m = _div_by(m - u_omb1 * g, u_b1, u_rb1)
        x = _div_by(v - u_omb2 * (g * g), u_b2, u_rb2)
        v = tl.where(x < 0.0, 0.0, x)  # clamp at 0, nan stays nan
        if OP == 2:
            # the undone values as they would be stored, then the new gradient
            p = _to_storage(p, ROUND_P, SOFT_BF16).to(tl.float32)
            m = _to_storage(m, ROUND_S, SOFT_BF16).to(tl.float32)
            v = _to_storage(v, ROUND_S, SOFT_BF16).to(tl.float32)
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
    """RN(1/b) in float32 for b = float32(x), the divisor the kernel sees."""
    return _f32(1.0 / _f32(x))


def _step_args(s: AdamScalars, variant: AdamVariant) -> _StepArgs:
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
    step_size, bc2_sqrt = reference.bias_corrections(s, variant)
    has_decay = s.weight_decay != 0
    pdiv = (1 - s.lr * s.weight_decay) if variant.decoupled and has_decay else 1.0
    return _UndoArgs(gs=s.grad_scale if s.grad_scale != 1 else 1.0, pdiv=pdiv,
                     wd=s.weight_decay, l2=int(not variant.decoupled and has_decay), bc2=bc2_sqrt, eps=s.eps,
                     ss=step_size, omb1=1 - s.beta1, b1=s.beta1, omb2=1 - s.beta2, b2=s.beta2,
                     rbc2=_recip(bc2_sqrt), rpdiv=_recip(pdiv), rb1=_recip(s.beta1), rb2=_recip(s.beta2))


# placeholders for the unused half of a launch (step: no undo scalars; undo: no step scalars)
_NO_UNDO = _UndoArgs(gs=1.0, pdiv=1.0, wd=0.0, l2=0, bc2=1.0, eps=1.0, ss=0.0, omb1=0.0, b1=1.0, omb2=0.0, b2=1.0,
                     rbc2=1.0, rpdiv=1.0, rb1=1.0, rb2=1.0)
_NO_STEP = _StepArgs(gs=1.0, pmul=1.0, wd=0.0, l2=0, small=1, coef=0.0, b2=1.0, c2=0.0, bc2=1.0, eps=1.0, nss=0.0,
                     rbc2=1.0)


# ------------------------------------------------------------------ checks and launch
def _check(what: str, tensors: Sequence[tuple[str, torch.Tensor | None]], like: torch.Tensor,
           out: Sequence[torch.Tensor] | None) -> None:
    check_block_tensors(f"triton.{what}", tensors, like, out)
    if not supports(like.device, like.dtype, tensors[2][1].dtype):
        raise UnsupportedError(f"triton.{what}: device {like.device} with param dtype {like.dtype} and state dtype "
                               f"{tensors[2][1].dtype} is not supported (CUDA, or CPU under TRITON_INTERPRET=1; "
                               "float32/bfloat16/float16)")


def _flat(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _STORAGE_DTYPES:
        t = t.to(torch.float32)
    return t.contiguous().view(-1)


def _launch(op: int, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g2: torch.Tensor | None,
            p_old: torch.Tensor | None, u: _UndoArgs | None, st: _StepArgs | None,
            out: Sequence[torch.Tensor] | None, p_copy: torch.Tensor | None = None) -> Triple:
    """Run the kernel; results go to ``out`` (or fresh tensors), via contiguous temporaries where needed.
    ``p_copy`` is written by the kernel where it is contiguous in a storage dtype, else copied afterwards."""
    targets = []
    for i, like in enumerate((p, m, v)):
        o = out[i] if out is not None else None
        if o is not None and o.dtype == like.dtype and o.is_contiguous():
            targets.append(o)
        else:
            targets.append(torch.empty(p.shape, dtype=like.dtype, device=p.device))
    pc = kernel_param_copy(p_copy, _STORAGE_DTYPES)
    n = p.numel()
    if n:
        fp, fg, fm, fv = _flat(p), _flat(g), _flat(m), _flat(v)
        fg2 = _flat(g2) if g2 is not None else fg
        fpo = _flat(p_old) if p_old is not None else fp
        u = u or _NO_UNDO
        st = st or _NO_STEP
        arrays = (fp, fg, fm, fv, fg2, fpo, *(t.view(-1) for t in targets), pc.view(-1) if pc is not None else fp)
        # Triton loads and stores 128 bits at a time only where the mask is provably constant over
        # each group of elements, i.e. where n is a multiple of 16 (it specializes on that at launch):
        # the last n % 16 elements, if any, get a launch of their own (16-element offsets keep the
        # pointers 16-byte aligned).
        head = n - n % VECTOR_MULTIPLE
        for start, count in ((0, head), (head, n - head)):
            if count:
                _adam_kernel[(triton.cdiv(count, BLOCK),)](
                    *(a[start:] for a in arrays), count, *u, *st, OP=op, HAS_P_OLD=p_old is not None,
                    ROUND_P=_TL_DTYPES[p.dtype], ROUND_S=_TL_DTYPES[m.dtype], SOFT_BF16=_interpreting(),
                    BLOCK_SIZE=BLOCK, HAS_COPY=pc is not None,
                    ROUND_C=_TL_DTYPES[pc.dtype] if pc is not None else tl.float32, **COMPILE_OPTIONS)
    results = write_outputs(targets, out)
    if pc is None:
        write_param_copy(p_copy, results[0])
    return results


def _numbers(s: AdamScalars) -> bool:
    return all(is_number(x) for x in s)


# ------------------------------------------------------------------ API
def step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, out: Triple | None = None, p_copy: torch.Tensor | None = None) -> Triple:
    """One Adam step; returns ``(p', m', v')`` in the dtypes of ``p, m, v`` (``p_copy``: also gets ``p'``,
    stored by the kernel)."""
    _check("step", [("p", p), ("g", g), ("m", m), ("v", v), ("p_copy", p_copy)], p, out)
    s = concrete_scalars(s)
    if not _numbers(s):
        return reference.step(p, g, m, v, s, variant, out=out, p_copy=p_copy)
    return _launch(_OP_STEP, p, g, m, v, None, None, None, _step_args(s, variant), out, p_copy)


def undo(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, p_old: torch.Tensor | None = None, out: Triple | None = None,
         p_copy: torch.Tensor | None = None) -> Triple:
    """Inverse of :func:`step` given the step's gradient and scalars (``p_old``: restore p from it)."""
    _check("undo", [("p", p), ("g", g), ("m", m), ("v", v), ("p_old", p_old), ("p_copy", p_copy)], p, out)
    s = concrete_scalars(s)
    reference._check_invertible(s, variant, p_old is not None)
    if not _numbers(s):
        return reference.undo(p, g, m, v, s, variant, p_old=p_old, out=out, p_copy=p_copy)
    return _launch(_OP_UNDO, p, g, m, v, None, p_old, _undo_args(s, variant), None, out, p_copy)


def undo_redo(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g_old: torch.Tensor, s_old: AdamScalars,
              g_new: torch.Tensor, s_new: AdamScalars, variant: AdamVariant, *,
              p_old: torch.Tensor | None = None, out: Triple | None = None,
              p_copy: torch.Tensor | None = None) -> Triple:
    """``step(*undo(p, g_old, m, v, s_old), g_new, s_new)`` in one kernel (one pass over memory)."""
    _check("undo_redo", [("p", p), ("g_old", g_old), ("m", m), ("v", v), ("g_new", g_new), ("p_old", p_old),
                         ("p_copy", p_copy)], p, out)
    s_old = concrete_scalars(s_old)
    s_new = concrete_scalars(s_new)
    reference._check_invertible(s_old, variant, p_old is not None)
    if not (_numbers(s_old) and _numbers(s_new)):
        return reference.undo_redo(p, m, v, g_old, s_old, g_new, s_new, variant, p_old=p_old, out=out,
                                   p_copy=p_copy)
    return _launch(_OP_UNDO_REDO, p, g_old, m, v, g_new, p_old, _undo_args(s_old, variant),
                   _step_args(s_new, variant), out, p_copy)
