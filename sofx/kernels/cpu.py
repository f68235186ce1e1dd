"""Fused, multi-threaded CPU Adam kernels: step, inverse and one-pass undo+redo.

The math is :mod:`sofx.kernels.reference`'s, operation by operation and with
the same float32 roundings (see :mod:`sofx.kernels._cpu_source`), so that a
float32 step gives the reference's (and ``torch.optim``'s) bits on CPUs with
fused multiply-add. Per element, ``t = s.step``, ``g = g * grad_scale``::

    step:  L2: g = fma(p, wd, g)          decoupled: p = p * (1 - lr*wd)
           m' = lerp(m, g, 1 - b1)        v' = fma((1-b2)*g, g, v*b2)
           p' = p + (-lr/bc1 * m') / (sqrt(v')/sqrt(bc2) + eps)
    undo:  p = p' + (m' / (sqrt(v')/sqrt(bc2) + eps)) * lr/bc1   (/ (1 - lr*wd) if decoupled)
           gh = g (decoupled) or fma(p, wd, g) (L2)
           m = (m' - (1-b1)*gh) / b1      v = max0((v' - (1-b2)*gh*gh) / b2), nan kept
    undo_redo: undo, round to the storage dtypes, step with the new gradient and scalars

in one pass over memory: every input is read once and every output written
once, on ``torch.get_num_threads()`` threads.

Square roots: with MKL, torch's ``Tensor.sqrt`` is MKL's vector routine,
which is not always correctly rounded. To give the reference's (and
``torch.optim``'s) bits, this backend calls that same routine (found in
``libtorch_cpu`` and checked against ``torch.sqrt`` on load, see
:mod:`sofx.kernels._torch_sqrt`) on chunks of 128 elements (the size that
measured fastest): everything before and after a square root runs as one
fused loop per chunk; only the square-root call and the final parameter loop
run without memory traffic (about 5-10% slower than fully fused). Divisions
are true divisions, except sqrt(v') / sqrt(bc2), computed through the
reciprocal and a multiply-add correction, which gives the same bits there
(see ``div_by`` in the C source).
Where torch's square root is IEEE, or MKL's routine cannot be found, the fully
fused per-element loops with ``sqrtf`` are used. :mod:`sofx.kernels.cpu_fast`
always uses those (about as fast as ``torch.optim.AdamW(fused=True)``, within
an ulp of the reference). :func:`bitwise_with_torch` says whether this backend's
results are the reference's bit for bit on this machine. ``out`` may be the
inputs' own tensors (donation): the update is then in place and allocates
nothing. Any shape works (the tensors are treated as flat); non-contiguous
tensors are computed through contiguous copies and written back.

Element types: float32, bfloat16 and float16 (params, gradients, states, in
any combination; float16 where the C compiler has ``_Float16``, through a
slower tiled path). float64 parameters are left to the reference backend
(:func:`supports` is False). The outputs may alias the inputs element for
element; other overlaps between outputs and inputs are not supported.

The native code is compiled on first use (about 9 s, cached on disk, see
:mod:`sofx.kernels._cpu_build`). Where it cannot be built (no C compiler,
``SOFX_CPU_NATIVE=0``) every function runs the reference math instead, with
the same results.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from sofx.errors import UnsupportedError
from sofx.kernels import _cpu_build, reference
from sofx.kernels import _cpu_source as src
from sofx.kernels.base import (AdamScalars, AdamVariant, Triple, check_block_tensors, concrete_scalars, is_number,
                               kernel_param_copy, one_call_per_block, write_outputs, write_param_copy)

__all__ = ["NAME", "supports", "step", "undo", "undo_redo", "step_many", "undo_many", "undo_redo_many", "native_available", "bitwise_with_torch"]

NAME = "cpu"

_DTYPE_CODES = _cpu_build.DTYPE_CODES
_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(device: torch.device | str, param_dtype: torch.dtype, state_dtype: torch.dtype) -> bool:
    """CPU tensors with float32, bfloat16 or float16 parameters and states."""
    return torch.device(device).type == "cpu" and param_dtype in _STORAGE_DTYPES and state_dtype in _STORAGE_DTYPES


def native_available() -> bool:
    """Whether the compiled kernels are in use (building them now if needed)."""
    return _cpu_build.load() is not None


def bitwise_with_torch() -> bool:
    """Whether :func:`step` and :func:`undo` give the reference's bits here (native kernels loaded and
    torch's square root reproduced; the reference fallback is trivially bitwise)."""
    lib = _cpu_build.load()
    return lib is None or lib.bitwise_torch


# ------------------------------------------------------------------ scalars
def _scalar_block(s: AdamScalars, variant: AdamVariant) -> ctypes.Array | None:
    """The doubles the C kernel reads (see ``S_*`` in the source), or None if a scalar is not a number."""
    if not all(type(x) is float or type(x) is int or is_number(x) for x in s):  # fast path for floats
        return None
    step_size, bc2_sqrt = reference.bias_corrections(s, variant)
    block = (ctypes.c_double * src.S_COUNT)()
    block[src.S_GRAD_SCALE] = s.grad_scale
    block[src.S_HAS_GRAD_SCALE] = 0.0 if s.grad_scale == 1 else 1.0
    block[src.S_HAS_DECAY] = 0.0 if s.weight_decay == 0 else 1.0
    block[src.S_WD] = s.weight_decay
    block[src.S_DECAY_FACTOR] = 1 - s.lr * s.weight_decay
    block[src.S_ONE_MINUS_B1] = 1 - s.beta1
    block[src.S_B1] = s.beta1
    block[src.S_B2] = s.beta2
    block[src.S_ONE_MINUS_B2] = 1 - s.beta2
    block[src.S_BC2_SQRT] = bc2_sqrt
    block[src.S_EPS] = s.eps
    block[src.S_STEP_SIZE] = step_size
    return block


# ------------------------------------------------------------------ checks
def _check(what: str, tensors: Sequence[tuple[str, torch.Tensor | None]], like: torch.Tensor,
           out: Sequence[torch.Tensor] | None) -> None:
    if like.device.type != "cpu":  # the others must be on like's device (checked below)
        raise UnsupportedError(f"cpu.{what}: p is on {like.device}; the cpu backend needs CPU tensors")
    try:
        check_block_tensors(f"cpu.{what}", tensors, like, out)
    except UnsupportedError as e:  # a tensor on another device than p
        raise UnsupportedError(f"{e}; the cpu backend needs CPU tensors") from None


# ------------------------------------------------------------------ dispatch
def _native_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor of a dtype the C kernel reads (a copy only where needed).

    Other dtypes (float64 gradients) are rounded to float32, as the reference's ``.to(float32)``.
    """
    if t.dtype not in _DTYPE_CODES:
        t = t.to(torch.float32)
    return t.contiguous()


def _run(op: int, variant: AdamVariant, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
         g2: torch.Tensor | None, p_old: torch.Tensor | None, s1: ctypes.Array, s2: ctypes.Array | None,
         out: Sequence[torch.Tensor] | None, lib: _cpu_build.NativeLib, exact: bool,
         p_copy: torch.Tensor | None = None) -> Triple:
    """Run the C kernel; results go to ``out`` (or fresh tensors), via contiguous temporaries where needed.

    ``exact``: take torch's own square root (bitwise the reference); else IEEE ``sqrtf`` in the fused loops.
    ``p_copy``: written by the kernel in the same pass where it is contiguous in a storage dtype, else
    copied afterwards.
    """
    inputs = [_native_input(p), _native_input(g), _native_input(m), _native_input(v)]
    g2c = _native_input(g2) if g2 is not None else None
    poc = _native_input(p_old) if p_old is not None else None
    pc = kernel_param_copy(p_copy, _DTYPE_CODES)
    want = (p.dtype, m.dtype, v.dtype)
    targets: list[torch.Tensor] = []
    for i, dtype in enumerate(want):
        o = out[i] if out is not None else None
        if o is not None and o.dtype == dtype and o.is_contiguous():
            targets.append(o)
        else:
            targets.append(torch.empty(p.shape, dtype=dtype))
    n = p.numel()
    if n:
        dtypes = (ctypes.c_int * 6)(_DTYPE_CODES[p.dtype], _DTYPE_CODES[inputs[1].dtype], _DTYPE_CODES[m.dtype],
                                    _DTYPE_CODES[g2c.dtype] if g2c is not None else src.DT_F32,
                                    _DTYPE_CODES[poc.dtype] if poc is not None else src.DT_F32,
                                    _DTYPE_CODES[pc.dtype] if pc is not None else src.DT_F32)
        ptrs = (ctypes.c_void_p * 10)(*(t.data_ptr() for t in inputs),
                                      g2c.data_ptr() if g2c is not None else None,
                                      poc.data_ptr() if poc is not None else None,
                                      *(t.data_ptr() for t in targets),
                                      pc.data_ptr() if pc is not None else None)
        rc = lib.adam(op, int(variant.decoupled), dtypes, n, ptrs, s1, s2 if s2 is not None else s1,
                      torch.get_num_threads(), int(exact), (lib.sqrt_fn or None) if exact else None,
                      lib.sqrt_mode, lib.sqrt_local or None, int(exact and lib.sqrt_replica))
        if rc != 0:  # unreachable with the checks above; never hand back unwritten memory
            raise UnsupportedError(f"cpu: the native kernel refused its arguments (code {rc})")
    results = write_outputs(targets, out)
    if pc is None:
        write_param_copy(p_copy, results[0])
    return results


def _native(p: torch.Tensor, m: torch.Tensor, tensors: Sequence[torch.Tensor | None]) -> _cpu_build.NativeLib | None:
    """The native library if it can run this call, else None (the reference math is used)."""
    if p.dtype not in _STORAGE_DTYPES or m.dtype not in _STORAGE_DTYPES or tensors[0].dtype != m.dtype:
        return None
    lib = _cpu_build.load()
    if lib is None:
        return None
    if not lib.has_f16 and any(t is not None and t.dtype == torch.float16 for t in (p, m, *tensors)):
        return None
    return lib


# ------------------------------------------------------------------ API
def step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, out: Triple | None = None, p_copy: torch.Tensor | None = None) -> Triple:
    """One Adam step; returns ``(p', m', v')`` in the dtypes of ``p, m, v`` (see the module docstring;
    ``p_copy``: also gets ``p'``, in the same pass)."""
    return step_impl(p, g, m, v, s, variant, out=out, exact=True, p_copy=p_copy)


def undo(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, p_old: torch.Tensor | None = None, out: Triple | None = None,
         p_copy: torch.Tensor | None = None) -> Triple:
    """Inverse of :func:`step` given the step's gradient and scalars (``p_old``: restore p from it).

    Raises :class:`~sofx.errors.UnsupportedError` where the inverse does not exist, as the reference.
    """
    return undo_impl(p, g, m, v, s, variant, p_old=p_old, out=out, exact=True, p_copy=p_copy)


def undo_redo(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g_old: torch.Tensor, s_old: AdamScalars,
              g_new: torch.Tensor, s_new: AdamScalars, variant: AdamVariant, *,
              p_old: torch.Tensor | None = None, out: Triple | None = None,
              p_copy: torch.Tensor | None = None) -> Triple:
    """``step(*undo(p, g_old, m, v, s_old), g_new, s_new)`` in one pass over memory.

    The undone values are rounded to the storage dtypes in between, exactly as
    two separate calls would store them.
    """
    return undo_redo_impl(p, m, v, g_old, s_old, g_new, s_new, variant, p_old=p_old, out=out, exact=True,
                          p_copy=p_copy)


step_many, undo_many, undo_redo_many = one_call_per_block(step, undo, undo_redo)


# ------------------------------------------------------------------ implementations (shared with cpu_fast)
def step_impl(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
              variant: AdamVariant, *, out: Triple | None, exact: bool, p_copy: torch.Tensor | None = None,
              ) -> Triple:
    """:func:`step`; ``exact=False`` uses IEEE ``sqrtf`` (see :mod:`sofx.kernels.cpu_fast`)."""
    _check("step", [("p", p), ("g", g), ("m", m), ("v", v), ("p_copy", p_copy)], p, out)
    s = concrete_scalars(s)
    block = _scalar_block(s, variant)
    lib = _native(p, m, (v, g, p_copy))
    if block is None or lib is None:
        return reference.step(p, g, m, v, s, variant, out=out, p_copy=p_copy)
    return _run(src.OP_STEP, variant, p, g, m, v, None, None, block, None, out, lib, exact, p_copy)


def undo_impl(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
              variant: AdamVariant, *, p_old: torch.Tensor | None, out: Triple | None, exact: bool,
              p_copy: torch.Tensor | None = None) -> Triple:
    """:func:`undo` with the choice of square root (see :func:`step_impl`)."""
    _check("undo", [("p", p), ("g", g), ("m", m), ("v", v), ("p_old", p_old), ("p_copy", p_copy)], p, out)
    s = concrete_scalars(s)
    reference._check_invertible(s, variant, p_old is not None)
    block = _scalar_block(s, variant)
    lib = _native(p, m, (v, g, p_old, p_copy))
    if block is None or lib is None:
        return reference.undo(p, g, m, v, s, variant, p_old=p_old, out=out, p_copy=p_copy)
    return _run(src.OP_UNDO, variant, p, g, m, v, None, p_old, block, None, out, lib, exact, p_copy)


def undo_redo_impl(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g_old: torch.Tensor, s_old: AdamScalars,
                   g_new: torch.Tensor, s_new: AdamScalars, variant: AdamVariant, *,
                   p_old: torch.Tensor | None, out: Triple | None, exact: bool,
                   p_copy: torch.Tensor | None = None) -> Triple:
    """:func:`undo_redo` with the choice of square root (see :func:`step_impl`)."""
    _check("undo_redo", [("p", p), ("m", m), ("v", v), ("g_old", g_old), ("g_new", g_new), ("p_old", p_old),
                         ("p_copy", p_copy)], p, out)
    s_old = concrete_scalars(s_old)
    s_new = concrete_scalars(s_new)
    reference._check_invertible(s_old, variant, p_old is not None)
    b_old = _scalar_block(s_old, variant)
    b_new = _scalar_block(s_new, variant)
    lib = _native(p, m, (v, g_old, g_new, p_old, p_copy))
    if b_old is None or b_new is None or lib is None:
        return reference.undo_redo(p, m, v, g_old, s_old, g_new, s_new, variant, p_old=p_old, out=out,
                                   p_copy=p_copy)
    return _run(src.OP_UNDO_REDO, variant, p, g_old, m, v, g_new, p_old, b_old, b_new, out, lib, exact, p_copy)
