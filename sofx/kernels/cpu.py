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
once, on ``torch.get_num_threads()`` threads. The list forms (``step_many``,
...) run all their blocks in one call of the native code, whose threads share
the blocks' elements evenly: a model's many small tensors cost one parallel
region, not one call and region each. ``step_many`` and ``undo_redo_many``
also take checked calls (``skip``): the gradient's finiteness is read chunk by
chunk in the same pass, for the undo strategy of :meth:`sofx.Adam.update` and
:meth:`sofx.Adam.undo_redo`. ``step_chunks`` and ``undo_redo_chunks`` run a
step or an undo+redo on listed chunks of blocks alone (:mod:`sofx.kernels.chunked`:
a checked step's flagged chunks, copied out first, or a chunk snapshot's kept
values stepped), also in one native call.

Square roots: with MKL, torch's ``Tensor.sqrt`` is MKL's vector routine,
which is not always correctly rounded, and rounds differently by the code
path MKL picks for the CPU (its AVX-512 one on Intel CPUs with AVX-512, its
AVX2 one on Intel CPUs without, its generic one on AMD CPUs). To give the
reference's (and ``torch.optim``'s) bits, the native code computes that
path's square root inline (a replica of each path's formula, checked against
``torch.sqrt`` on load, see ``_replica_matches`` in
:mod:`sofx.kernels._cpu_build`) in the same vector loops as ``cpu_fast``;
where no replica matches (another MKL), it calls MKL's routine itself (found
in ``libtorch_cpu``, see :mod:`sofx.kernels._torch_sqrt`) per chunk, slower.
Divisions are true divisions, except sqrt(v') / sqrt(bc2), computed through
the reciprocal and a multiply-add correction, which gives the same bits there
(see ``div_by`` in the C source). Where torch's square root is not MKL's
routine (a torch without MKL: IEEE), the same vector loops take the
hardware's IEEE square root (the ``ieee`` kind; in the AVX-512 loops the
inverse's divisions by beta1, beta2 and 1 - lr*wd go through that correction
where it is exact and divide the other lanes, the same bits as true divisions;
its tile loops with ``sqrtf`` give the same bits, 1.1-1.8x slower). :mod:`sofx.kernels.cpu_fast`
always takes IEEE square roots (about as fast as
``torch.optim.AdamW(fused=True)``, a few ulps of the update from the reference).
:func:`bitwise_with_torch` says whether this backend's results are the
reference's bit for bit on this machine. ``out`` may be the inputs' own
tensors (donation): the update is then in place and allocates nothing. Any
shape works (the tensors are treated as flat); non-contiguous tensors are
computed through copies and written back: into the parameter's layout where
it is dense (its results keep it: :func:`~sofx.kernels.layout.spans_after_copies`),
else contiguous ones.

Element types: float32, bfloat16 and float16 (params, gradients, states, in
any combination; float16 where the C compiler has ``_Float16``, through a
slower tiled path). float64 parameters are left to the reference backend
(:func:`supports` is False). The outputs may alias the inputs element for
element; other overlaps between outputs and inputs are not supported.

The native code is compiled on first use (about 15-40 s, cached on disk, see
:mod:`sofx.kernels._cpu_build`). Where it cannot be built (no C compiler,
``SOFX_CPU_NATIVE=0``) every function runs the reference math instead, with
the same results.
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from typing import Any, Callable, NamedTuple, Sequence

import torch

from sofx.errors import UnsupportedError
from sofx.kernels import _cpu_build, reference
from sofx.kernels import _cpu_source as src
from sofx.kernels.chunked import ChunkedCall, check_chunked_calls, range_calls
from sofx.kernels.base import (CALLS_CHECKED, FINITE_CHUNK, STORAGE_CHECKED, AdamScalars, AdamVariant, StepCall,
                               Triple, UndoCall, UndoRedoCall, beyond_limit, check_block_tensors, check_skip,
                               kept_elements, gradient_limit_bits, is_number, kernel_param_copy, lossy_elements,
                               lossy_factor, lossy_l2, mark_written, refuse_traced, scalars_key, traced_possible,
                               write_kept_param_copy, write_outputs, write_param_copy)
from sofx.kernels.donation import blocks_clash, may_refuse_write, overlap_error
from sofx.kernels.threads import native_thread_request
from sofx.kernels.layout import in_layout_of, same_layout, spans_after_copies, spans_in_memory_order

__all__ = ["NAME", "supports", "step", "undo", "undo_redo", "step_many", "undo_many", "undo_redo_many",
           "step_chunks", "undo_redo_chunks", "prepare_chunks", "native_available", "native_refusal",
           "bitwise_with_torch",
           "CHECKS_FINITE", "CHECKS_OVERLAP", "RUNS_CHUNK_LISTS"]

NAME = "cpu"
CHECKS_FINITE = True  # step_many / undo_redo_many take checked calls (skip)
CHECKS_OVERLAP = True  # the list forms refuse written arrays that share memory (base.MemoryOverlapError)
RUNS_CHUNK_LISTS = True  # step_chunks / undo_redo_chunks (sofx.kernels.chunked) in one native call

_DTYPE_CODES = _cpu_build.DTYPE_CODES
_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_F16_FREE_CODES = {d: c for d, c in _DTYPE_CODES.items() if d != torch.float16}  # a build without _Float16


def _codes(lib: _cpu_build.NativeLib) -> dict[torch.dtype, int]:
    """The element types ``lib`` reads and writes, by their codes."""
    return _DTYPE_CODES if lib.has_f16 else _F16_FREE_CODES


def supports(device: torch.device | str, param_dtype: torch.dtype, state_dtype: torch.dtype) -> bool:
    """CPU tensors with float32, bfloat16 or float16 parameters and states."""
    return torch.device(device).type == "cpu" and param_dtype in _STORAGE_DTYPES and state_dtype in _STORAGE_DTYPES


def native_available() -> bool:
    """Whether the compiled kernels are in use (building them now if needed)."""
    return _cpu_build.load() is not None


def native_refusal() -> str | None:
    """Why this backend, asked for by name, refuses to run here: the native kernels are unavailable (no C compiler,
    a failed build: :func:`sofx.kernels._cpu_build.unavailable_reason`), which would leave it running the reference
    math, several times slower; None where they are loaded, or where ``SOFX_CPU_NATIVE=0`` asked for that math.
    Builds them first where they are not built yet."""
    reason = _cpu_build.unavailable_reason()
    return None if reason is None or reason == _cpu_build.DISABLED else reason


def bitwise_with_torch() -> bool:
    """Whether :func:`step` and :func:`undo` give the reference's bits here (the reference fallback is
    trivially bitwise): torch's square root reproduced, and torch's own elementwise kernels fusing the
    multiply-adds as these do (not so in torch's unvectorized build, ``ATEN_CPU_CAPABILITY=default``, or on
    CPUs without FMA), which one sample step and undo of each kind of decay show."""
    lib = _cpu_build.load()
    return lib is None or (lib.bitwise_torch and _sample_agrees())


@functools.lru_cache(maxsize=None)
def _sample_agrees() -> bool:
    """One step and undo of 5000 random float32 elements per decay kind, native against the reference."""
    gen = torch.Generator().manual_seed(20261130)
    n = 5000
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen) * 1e-2
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 7, 0.5)
    for variant in (AdamVariant(decoupled=True), AdamVariant(decoupled=False)):
        want = reference.step(p, g, m, v, s, variant)
        got = step_impl(p, g, m, v, s, variant, out=None, exact=True, backend=NAME)
        back = undo_impl(*want[:1], g, *want[1:], s, variant, p_old=None, out=None, exact=True, backend=NAME)
        if not (all(torch.equal(a, b) for a, b in zip(got, want)) and all(
                torch.equal(a, b) for a, b in zip(back, reference.undo(*want[:1], g, *want[1:], s, variant)))):
            return False
    return True


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
    block[src.S_LIMIT_F32], block[src.S_LIMIT_BF16], block[src.S_LIMIT_F16] = gradient_limit_bits(s.grad_scale)
    block[src.S_LOSSY] = lossy_factor(s.beta1, s.beta2)
    block[src.S_L2_CV:src.S_L2_WKB + 1] = list(lossy_l2(s)[:6])  # (cv, cm, wa, wb, wka, wkb)
    return block


def _without_lossy(c: ctypes.Array) -> ctypes.Array:
    """A copy of the scalar block ``c`` with a lossy factor of 0: a checked step from zero moments
    (``StepCall.zero_moments``) flags only non-finite values."""
    out = (ctypes.c_double * src.S_COUNT)(*c)
    out[src.S_LOSSY] = out[src.S_L2_CV] = out[src.S_L2_CM] = 0.0
    return out


def _with_p_kept(c: ctypes.Array) -> ctypes.Array:
    """A copy of the scalar block ``c`` whose check takes no L2 term: the step's record keeps p
    (``StepCall.p_kept``, ``UndoRedoCall.p_kept``)."""
    out = (ctypes.c_double * src.S_COUNT)(*c)
    out[src.S_P_KEPT] = 1.0
    return out


# ------------------------------------------------------------------ checks
def _check(where: str, tensors: Sequence[tuple[str, torch.Tensor | None]], like: torch.Tensor,
           out: Sequence[torch.Tensor] | None, backend: str) -> None:
    """``where``: the call's name in errors (``"cpu.step"``, ``"cpu_fast.step_many[3]"``); ``backend``: the
    backend's (``"cpu"`` or ``"cpu_fast"``)."""
    if isinstance(like, torch.Tensor) and like.device.type != "cpu":  # the others must be on like's device
        raise UnsupportedError(f"{where}: p is on {like.device}; the {backend} backend needs CPU tensors")
    try:
        check_block_tensors(where, tensors, like, out)
    except UnsupportedError as e:  # a tensor on another device than p
        raise UnsupportedError(f"{e}; the {backend} backend needs CPU tensors") from None


_OUT_NAMES = ("out[0]", "out[1]", "out[2]")
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


# ------------------------------------------------------------------ dispatch
class _Block(NamedTuple):
    """One block of a call in the C entry's terms (``g2``/``s2``: undo+redo's new gradient and scalars)."""

    p: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    g2: torch.Tensor | None
    p_old: torch.Tensor | None
    s1: AdamScalars
    s2: AdamScalars | None
    out: Triple | None
    p_copy: torch.Tensor | None
    skip: torch.Tensor | None = None  # the finiteness flags of a checked step or undo+redo (see step_many)
    zero_moments: bool = False  # a step's StepCall.zero_moments: its check takes a lossy factor of 0
    p_kept: bool = False  # StepCall.p_kept, UndoRedoCall.p_kept: its check takes no L2 term


class _Native(NamedTuple):
    """A block ready for the C entry: its table entries and where its results go."""

    dtypes: tuple[int, int, int, int, int, int]
    ptrs: tuple[int, ...]
    n: int
    s1: ctypes.Array
    s2: ctypes.Array | None
    targets: list[torch.Tensor]
    copied: bool  # the kernel writes p_copy itself


def _native_input(t: torch.Tensor, spans: bool = False, like: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` as a contiguous tensor of a dtype the C kernel reads (a copy only where needed); ``spans``: a block
    of one dense layout (:func:`~sofx.kernels.layout.spans_in_memory_order`), whose tensors are read as they
    are; ``like``: a block run over the memory spans of its parameter ``like``'s layout, ``t`` copied into it
    where it has another (:func:`~sofx.kernels.layout.spans_after_copies`).

    Other dtypes (float64 gradients) are rounded to float32, as the reference's ``.to(float32)`` (which keeps a
    dense layout).
    """
    if t.dtype not in _DTYPE_CODES:
        t = t.to(torch.float32)
    if like is not None:
        return in_layout_of(t, like)
    return t if spans else t.contiguous()


def _native(b: _Block, lib: _cpu_build.NativeLib | None) -> _cpu_build.NativeLib | None:
    """``lib`` if it can run this block, else None (the reference math is used)."""
    p, m = b.p, b.m
    if lib is None or p.dtype not in _STORAGE_DTYPES or m.dtype not in _STORAGE_DTYPES or b.v.dtype != m.dtype:
        return None
    if not lib.has_f16 and any(t is not None and t.dtype == torch.float16 for t in (p, m, b.g, b.g2, b.p_old)):
        return None  # (a float16 p_copy is copied after the kernel there: see _prepare)
    return lib


def _prepare(b: _Block, s1: ctypes.Array, s2: ctypes.Array | None, lib: _cpu_build.NativeLib) -> _Native:
    """The C entry's view of ``b``: contiguous inputs of its dtypes (copies only where needed; a block of one
    dense layout as it is; one of a dense parameter, the others copied into its layout) and the tensors it
    writes (``out``'s own where they fit, else fresh ones, of the layout the call runs in)."""
    spans = spans_in_memory_order(b.p, (b.g, b.m, b.v, b.g2, b.p_old), b.skip)
    like = b.p if not spans and spans_after_copies(b.p, b.skip) else None  # (the others copied into its layout)
    spans = spans or like is not None
    p, g, m, v = (_native_input(t, spans, like) for t in (b.p, b.g, b.m, b.v))
    g2 = _native_input(b.g2, spans, like) if b.g2 is not None else None
    p_old = _native_input(b.p_old, spans, like) if b.p_old is not None else None
    pc = kernel_param_copy(b.p_copy, _codes(lib), p if spans else None)  # (another layout: written after the call)
    out = b.out
    if out is not None and out[0] is p and out[1] is m and out[2] is v:
        targets = [p, m, v]  # donation: the inputs themselves, contiguous (the common case, checked cheaply)
    else:
        targets = []
        for i, dtype in enumerate((p.dtype, m.dtype, v.dtype)):
            o = out[i] if out is not None else None
            fits = o is not None and o.dtype == dtype and (same_layout(o, p) if spans else o.is_contiguous())
            targets.append(o if fits else torch.empty_strided(p.shape, p.stride(), dtype=dtype))
    dtypes, ptrs = _table_entry(_DTYPE_CODES, p, g, m, v, g2, p_old, targets, pc, b.skip)
    # The inputs' contiguous copies (if any) stay alive through this list until the call returns.
    return _Native(dtypes, ptrs, p.numel(), s1, s2, [*targets, p, g, m, v, g2, p_old], pc is not None)


def _plain_native(op: int, b: _Block, lib: _cpu_build.NativeLib, s1: ctypes.Array, s2: ctypes.Array | None,
                  grad: bool = True, transforms: bool = True, storage: bool = True) -> _Native | None:
    """The C entry's view of ``b`` (a block of ``op``) when it is the common case, else None (the block then
    goes through the checks and :func:`_prepare`): every tensor ``op`` needs given (the second gradient an
    undo+redo's only), every tensor a plain contiguous CPU tensor of ``p``'s shape in a dtype ``lib`` reads,
    states of one storage dtype, ``out`` None or the inputs themselves (donation), ``skip`` (if any) a
    contiguous uint8 vector of one flag per chunk, at least one element, nothing written that torch refuses to
    write (:func:`~sofx.kernels.donation.may_refuse_write`), and every tensor's storage holding its elements (here
    ``(storage_offset + numel) * element_size`` bytes: contiguous or dense; one freed with
    ``untyped_storage().resize_(0)`` goes to the checks, which refuse it naming it; ``storage=False``: the caller
    checked that, :data:`~sofx.kernels.base.STORAGE_CHECKED`). What this accepts passes every
    check of :func:`_run_blocks`, and :func:`_prepare` would build the same entry (but for the tensors of one
    dense layout of an unchecked call, :mod:`sofx.kernels.layout`: taken as they are, in memory order, where
    :func:`_prepare` copies them; fresh outputs of that layout). ``grad, transforms``:
    :func:`~sofx.kernels.base.traced_possible`'s (a tensor that requires grad, or a wrapped one, goes to the
    checks, which refuse it)."""
    p, g, m, v, g2, p_old, pc, out, sk = b.p, b.g, b.m, b.v, b.g2, b.p_old, b.p_copy, b.out, b.skip
    if type(p) is not torch.Tensor or (g2 is None) != (op != src.OP_UNDO_REDO):  # g2: an undo+redo's, only
        return None
    codes = _codes(lib)
    shape = p.shape
    n = p.numel()
    contiguous = p.is_contiguous()
    for t in (p, g, m, v, g2, p_old, pc):
        if t is not None and not (type(t) is torch.Tensor and t.is_cpu and t.dtype in codes and t.shape == shape
                                  and (not contiguous or t.is_contiguous()) and not (grad and t.requires_grad)
                                  and not (transforms and _wrapped(t))
                                  and (not storage or (t.storage_offset() + n) * t.element_size()
                                       <= t.untyped_storage().nbytes())):
            return None
    if not contiguous and not spans_in_memory_order(p, (g, m, v, g2, p_old, pc), sk):
        return None
    if g is None or m is None or v is None:
        return None
    if n == 0 or m.dtype != v.dtype or not (out is None or (type(out) is tuple and len(out) == 3 and out[0] is p
                                                             and out[1] is m and out[2] is v)):
        return None
    if sk is not None and not (type(sk) is torch.Tensor and sk.dtype == torch.uint8 and sk.is_cpu
                               and sk.dim() == 1 and sk.shape[0] == -(-n // FINITE_CHUNK) and sk.is_contiguous()
                               and not (transforms and _wrapped(sk))
                               and (not storage or sk.storage_offset() + sk.shape[0] <= sk.untyped_storage().nbytes())):
        return None
    if may_refuse_write((pc, sk, *((p, m, v) if out is not None else ()))):
        return None
    targets = [p, m, v] if out is not None else [torch.empty_strided(shape, p.stride(), dtype=t.dtype)
                                                 for t in (p, m, v)]
    dtypes, ptrs = _table_entry(codes, p, g, m, v, g2, p_old, targets, pc, sk)
    return _Native(dtypes, ptrs, n, s1, s2, targets, pc is not None)


def _checked_native(op: int, b: _Block, lib: _cpu_build.NativeLib, s1: ctypes.Array, s2: ctypes.Array | None,
                    ) -> _Native | None:
    """:func:`_plain_native` of a block of ``op`` under :data:`~sofx.kernels.base.CALLS_CHECKED` (of that
    operation), whose caller (:class:`sofx.Adam`) checked what that function tests of ``p, m, v``, the gradients
    (``g``; an undo+redo's ``g2`` too), ``out`` and ``skip``: only what the promise leaves out is tested here (CPU
    tensors, dtypes ``lib`` reads, at least one element, the second gradient an undo+redo's only, no kept
    ``p_old``, no parameter copy), else None (the block goes the way of any other caller's)."""
    p, m, g2, out = b.p, b.m, b.g2, b.out
    codes = _codes(lib)
    if b.p_copy is not None or b.p_old is not None or (g2 is None) == (op == src.OP_UNDO_REDO) or not p.is_cpu \
            or p.dtype not in codes or m.dtype not in codes:
        return None
    n = p.numel()
    if n == 0:
        return None
    if out is None:
        targets = [torch.empty_strided(p.shape, p.stride(), dtype=t.dtype) for t in (p, m, b.v)]
    elif out[0] is p and out[1] is m and out[2] is b.v:
        targets = [p, m, b.v]
    else:
        return None
    dtypes, ptrs = _table_entry(codes, p, b.g, m, b.v, g2, None, targets, None, b.skip)
    return _Native(dtypes, ptrs, n, s1, s2, targets, False)


# The operations' names in the kernels' promise (base.CALLS_CHECKED)
_OP_NAMES = {src.OP_STEP: "step", src.OP_UNDO: "undo", src.OP_UNDO_REDO: "undo_redo"}


def _table_entry(codes: dict[torch.dtype, int], p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 g2: torch.Tensor | None, p_old: torch.Tensor | None, targets: Sequence[torch.Tensor],
                 pc: torch.Tensor | None, skip: torch.Tensor | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A block's row of the C entry's tables (``sofx_adam_many``): the dtype codes of p, g, m, g2, p_old, p_copy
    and the addresses of p, g, m, v, g2, p_old, the outputs (``targets``), p_copy and skip (float32 and 0 for
    what is absent). The tensors are contiguous (or of one dense layout: their memory spans), in dtypes of
    ``codes``."""
    f32 = src.DT_F32
    dtypes = (codes[p.dtype], codes[g.dtype], codes[m.dtype], codes[g2.dtype] if g2 is not None else f32,
              codes[p_old.dtype] if p_old is not None else f32, codes[pc.dtype] if pc is not None else f32)
    ptrs = (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), g2.data_ptr() if g2 is not None else 0,
            p_old.data_ptr() if p_old is not None else 0, targets[0].data_ptr(), targets[1].data_ptr(),
            targets[2].data_ptr(), pc.data_ptr() if pc is not None else 0, skip.data_ptr() if skip is not None else 0)
    return dtypes, ptrs


def _named(op: int, b: _Block) -> list[tuple[str, torch.Tensor | None]]:
    if op == src.OP_STEP:
        return [("p", b.p), ("g", b.g), ("m", b.m), ("v", b.v), ("p_copy", b.p_copy)]
    if op == src.OP_UNDO:
        return [("p", b.p), ("g", b.g), ("m", b.m), ("v", b.v), ("p_old", b.p_old), ("p_copy", b.p_copy)]
    return [("p", b.p), ("m", b.m), ("v", b.v), ("g_old", b.g), ("g_new", b.g2), ("p_old", b.p_old),
            ("p_copy", b.p_copy)]


def _reference_checked(op: int, b: _Block, variant: AdamVariant, s1: AdamScalars, s2: AdamScalars | None,
                        ) -> Triple:
    """A checked step or undo+redo (see :func:`step_many`) through the reference math: flags from the
    gradient of the step taken (the new one of an undo+redo) and :func:`lossy_elements`, the flagged chunks
    not written."""
    n = b.p.numel()
    redo = op == src.OP_UNDO_REDO
    checked, s = (b.g2, s2) if redo else (b.g, s1)
    bad = beyond_limit(checked.reshape(-1), s.grad_scale)  # the bits the native check compares
    p = b.p_old if redo and b.p_old is not None else b.p
    bad |= lossy_elements(p.reshape(-1), checked.reshape(-1), b.v.reshape(-1), s, variant.decoupled,
                          b.g.reshape(-1) if redo else None, s1 if redo else None, m=b.m.reshape(-1),
                          zero_moments=b.zero_moments and not redo, p_kept=b.p_kept,
                          bias_correction=variant.bias_correction, p_old_given=redo and b.p_old is not None)
    flags = torch.nn.functional.pad(bad, (0, -n % FINITE_CHUNK)).view(-1, FINITE_CHUNK).any(dim=1)
    b.skip.copy_(flags)
    unchecked = b._replace(skip=None)
    if not bool(flags.any()):
        return _reference(op, unchecked, variant, s1, s2)
    new = _reference(op, unchecked._replace(out=None, p_copy=None), variant, s1, s2)
    keep = kept_elements(b.skip, n)
    targets = b.out if b.out is not None else tuple(torch.empty(b.p.shape, dtype=t.dtype) for t in (b.p, b.m, b.v))
    for t, r in zip(targets, new):  # (r keeps the inputs' layout, maybe not contiguous: read in logical order)
        t.view(-1)[keep] = r.reshape(-1)[keep].to(t.dtype)
    write_kept_param_copy(b.p_copy, new[0], b.skip)
    return targets[0], targets[1], targets[2]


def _reference(op: int, b: _Block, variant: AdamVariant, s1: AdamScalars, s2: AdamScalars | None) -> Triple:
    if b.skip is not None:
        return _reference_checked(op, b, variant, s1, s2)
    if op == src.OP_STEP:
        return reference.step(b.p, b.g, b.m, b.v, s1, variant, out=b.out, p_copy=b.p_copy)
    if op == src.OP_UNDO:
        return reference.undo(b.p, b.g, b.m, b.v, s1, variant, p_old=b.p_old, out=b.out, p_copy=b.p_copy)
    return reference.undo_redo(b.p, b.m, b.v, b.g, s1, b.g2, s2, variant, p_old=b.p_old, out=b.out,
                               p_copy=b.p_copy)


def _run_blocks(op: int, blocks: Sequence[_Block], variant: AdamVariant, exact: bool, backend: str,
                where: Sequence[str]) -> list[Triple]:
    """Every block's results (see :func:`step`, :func:`undo`, :func:`undo_redo`); ``where[i]`` names
    block i in errors, ``backend`` the backend the caller called (``"cpu"``, ``"cpu_fast"``). All blocks
    are checked before any is computed; those the native code takes run in one call of the C entry (its
    threads share all their elements), the others through the reference.

    ``exact``: take torch's own square root (bitwise the reference); else IEEE ``sqrtf`` in the fused loops.
    """
    lib = _cpu_build.load()
    undone = op != src.OP_STEP
    float64 = [getattr(b.p, "dtype", None) == torch.float64 for b in blocks]  # (the reference's float64 math)
    s1s = reference.concrete_checked([b.s1 for b in blocks], variant if undone else None,
                                     [b.p_old is not None for b in blocks] if undone else None, where, float64,
                                     variant.bias_correction)
    s2s = reference.concrete_checked([b.s2 for b in blocks], where=where, float64=float64,
                                     bias_correction=variant.bias_correction) \
        if op == src.OP_UNDO_REDO else [None] * len(blocks)
    by_value: dict[tuple, ctypes.Array | None] = {}  # a group's blocks share scalars (scalars_key) ...
    by_id: dict[int, ctypes.Array | None] = {}  # ... and mostly the very objects (the lists hold them)
    no_lossy: dict[int, ctypes.Array] = {}  # a block of by_value's with S_LOSSY 0, by its id (zero_moments)
    p_kept: dict[int, ctypes.Array] = {}  # a block (by its id) with S_P_KEPT 1 (StepCall.p_kept)

    def scalar_block(s: AdamScalars | None) -> ctypes.Array | None:
        """The C block of ``s`` (None: no scalars, no library, or not all numbers)."""
        if s is None or lib is None:
            return None
        if id(s) not in by_id:
            key = scalars_key(s)  # (an lr of -0.0 is not 0.0's)
            if key not in by_value:
                by_value[key] = _scalar_block(s, variant)
            by_id[id(s)] = by_value[key]
        return by_id[id(s)]

    def without_lossy(c: ctypes.Array) -> ctypes.Array:
        if id(c) not in no_lossy:
            no_lossy[id(c)] = _without_lossy(c)
        return no_lossy[id(c)]

    def with_p_kept(c: ctypes.Array) -> ctypes.Array:
        if id(c) not in p_kept:
            p_kept[id(c)] = _with_p_kept(c)
        return p_kept[id(c)]

    grad, transforms = traced_possible()
    storage = not STORAGE_CHECKED.get()
    checked = _OP_NAMES[op] in CALLS_CHECKED.get()  # (the promise names the operations it covers)
    plans: list[tuple[ctypes.Array | None, ctypes.Array | None, _Native | None]] = []
    for b, name, s1, s2 in zip(blocks, where, s1s, s2s):
        c1, c2 = scalar_block(s1), scalar_block(s2)
        if c1 is not None and b.zero_moments and b.skip is not None and op == src.OP_STEP:
            c1 = without_lossy(c1)
        if b.p_kept and b.skip is not None and (c2 if op == src.OP_UNDO_REDO else c1) is not None:
            if op == src.OP_UNDO_REDO:
                c2 = with_p_kept(c2)
            else:
                c1 = with_p_kept(c1)
        fast = None
        if checked and c1 is not None and (s2 is None or c2 is not None):
            fast = _checked_native(op, b, lib, c1, c2)
        if fast is None and c1 is not None and (s2 is None or c2 is not None):
            fast = _plain_native(op, b, lib, c1, c2, grad, transforms, storage)
        if fast is None:
            _check(name, _named(op, b), b.p, b.out, backend)
            if b.skip is not None:
                check_skip(name, b, torch.device("cpu"))
            refuse_traced(name, [*_named(op, b), *zip(_OUT_NAMES, b.out or ()), ("skip", b.skip)])
            if _native(b, lib) is None:
                c1 = c2 = None
        plans.append((c1, c2, fast))
    if all(fast is not None for _, _, fast in plans):  # the common case: the C entry's table says it all
        table = _Table.of([fast for _, _, fast in plans])  # type: ignore[misc]
        _refuse_overlap(op, table.clash(lib, backend), where)
    else:
        table = None
        _refuse_overlap(op, _blocks_clash(blocks), where)
    results: list[Triple | None] = [None] * len(blocks)
    native: list[tuple[int, _Native]] = []
    for i, (b, s1, s2, (c1, c2, fast)) in enumerate(zip(blocks, s1s, s2s, plans)):
        if fast is not None:
            native.append((i, fast))
        elif c1 is None or (s2 is not None and c2 is None):
            results[i] = _reference(op, b, variant, s1, s2)
        elif b.p.numel() == 0:
            results[i] = _empty_results(b)
        else:
            assert lib is not None
            native.append((i, _prepare(b, c1, c2, lib)))
    if native:
        assert lib is not None
        written = [t for i, _ in native for t in _written(blocks[i])]
        try:
            _call(lib, op, variant, table if table is not None else _Table.of([nb for _, nb in native]), exact,
                  backend)
        finally:  # (the C entry writes everything or, refusing, nothing; an interrupt may follow its writes)
            mark_written(written)
        for i, nb in native:
            b = blocks[i]
            res = write_outputs(nb.targets, b.out)
            if not nb.copied:
                write_kept_param_copy(b.p_copy, res[0], b.skip)
            results[i] = res
    return results  # type: ignore[return-value]


def _written(b: _Block) -> list[torch.Tensor | None]:
    """The caller's tensors a native call of ``b`` writes (or that are copied into after it): ``out``,
    ``p_copy``, ``skip`` (for :func:`~sofx.kernels.base.mark_written`)."""
    return [*(b.out or ()), b.p_copy, b.skip]


def _empty_results(b: _Block) -> Triple:
    targets = [torch.empty(b.p.shape, dtype=t.dtype) for t in (b.p, b.m, b.v)]
    res = write_outputs(targets, b.out)
    write_param_copy(b.p_copy, res[0])
    return res


class _Table(NamedTuple):
    """The C entry's tables of a list of blocks, in its layout (see ``sofx_adam_many``)."""

    blocks: Sequence[_Native]
    dtypes: array
    ns: array
    ptrs: array

    @staticmethod
    def of(blocks: Sequence[_Native]) -> "_Table":
        return _Table(blocks, array("i", [d for nb in blocks for d in nb.dtypes]), array("q", [nb.n for nb in blocks]),
                      array("q", [x for nb in blocks for x in nb.ptrs]))

    def clash(self, lib: _cpu_build.NativeLib, backend: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """``(block, table column)`` of a written array and another that shares its memory, or None (the C
        entry ``sofx_overlap``: the table's arrays are contiguous; its outputs are the inputs themselves, then
        written, or fresh tensors; ``p_copy`` and ``skip`` are written)."""
        out = array("q", [0, 0, 0, 0])
        rc = lib.overlap(len(self.blocks), self.dtypes.buffer_info()[0], self.ns.buffer_info()[0],
                         self.ptrs.buffer_info()[0], out.buffer_info()[0])
        if rc < 0:
            raise MemoryError(f"{backend}: no memory to compare a call's arrays")
        return ((out[0], out[1]), (out[2], out[3])) if rc else None


# The roles of the C entry's table columns
_COLUMN_ROLES = ("p", "g", "m", "v", "g_new", "p_old", "out[0]", "out[1]", "out[2]", "p_copy", "skip")


def _role(op: int, role: str) -> str:
    return "g_old" if role == "g" and op == src.OP_UNDO_REDO else role


def _refuse_overlap(op: int, found: tuple[tuple[int, Any], tuple[int, Any]] | None, where: Sequence[str]) -> None:
    """Raise :class:`~sofx.kernels.base.MemoryOverlapError` for a clash (``(block, column or role)`` twice)."""
    if found is None:
        return
    first, second = ((b, _role(op, _COLUMN_ROLES[r] if isinstance(r, int) else r)) for b, r in found)
    raise overlap_error(first, second, where)


def _blocks_clash(blocks: Sequence[_Block]) -> tuple[tuple[int, str], tuple[int, str]] | None:
    """:meth:`_Table.clash` for blocks that are not all in the table's terms: from the tensors themselves
    (:func:`~sofx.kernels.donation.blocks_clash`; an undo+redo's ``g_old`` is named ``g`` there, as in the
    table)."""
    return blocks_clash([([("p", b.p), ("g", b.g), ("m", b.m), ("v", b.v), ("g_new", b.g2), ("p_old", b.p_old)],
                          b.out, [("p_copy", b.p_copy), ("skip", b.skip)]) for b in blocks])


def _call(lib: _cpu_build.NativeLib, op: int, variant: AdamVariant, table: _Table, exact: bool, backend: str,
          chunk_tab: array | None = None) -> None:
    """One call of the C entry ``sofx_adam_many`` over ``table``'s blocks (``chunk_tab``: its chunk table,
    six entries per block, see :func:`_run_chunked`)."""
    blocks, dtypes, ns, ptrs = table
    s1 = array("Q", [ctypes.addressof(nb.s1) for nb in blocks])
    s2 = array("Q", [ctypes.addressof(nb.s2) if nb.s2 is not None else 0 for nb in blocks])
    rc = lib.adam_many(op, int(variant.decoupled), len(blocks), dtypes.buffer_info()[0], ns.buffer_info()[0],
                       ptrs.buffer_info()[0], s1.buffer_info()[0], s2.buffer_info()[0], native_thread_request(),
                       int(exact), (lib.sqrt_fn or None) if exact else None, lib.sqrt_mode,
                       lib.sqrt_local or None, lib.sqrt_replica if exact else 0,
                       chunk_tab.buffer_info()[0] if chunk_tab is not None else None)
    if rc != 0:  # unreachable with the checks above; never hand back unwritten memory
        raise UnsupportedError(f"{backend}: the native kernel refused its arguments (code {rc})")


# ------------------------------------------------------------------ API
def step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, out: Triple | None = None, p_copy: torch.Tensor | None = None) -> Triple:
    """One Adam step; returns ``(p', m', v')`` in the dtypes of ``p, m, v`` (see the module docstring;
    ``p_copy``: also gets ``p'``, in the same pass)."""
    return step_impl(p, g, m, v, s, variant, out=out, exact=True, p_copy=p_copy, backend=NAME)


def undo(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, p_old: torch.Tensor | None = None, out: Triple | None = None,
         p_copy: torch.Tensor | None = None) -> Triple:
    """Inverse of :func:`step` given the step's gradient and scalars (``p_old``: restore p from it).

    Raises :class:`~sofx.errors.UnsupportedError` where the inverse does not exist, as the reference.
    """
    return undo_impl(p, g, m, v, s, variant, p_old=p_old, out=out, exact=True, p_copy=p_copy, backend=NAME)


def undo_redo(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g_old: torch.Tensor, s_old: AdamScalars,
              g_new: torch.Tensor, s_new: AdamScalars, variant: AdamVariant, *,
              p_old: torch.Tensor | None = None, out: Triple | None = None,
              p_copy: torch.Tensor | None = None) -> Triple:
    """``step(*undo(p, g_old, m, v, s_old), g_new, s_new)`` in one pass over memory.

    The undone values are rounded to the storage dtypes in between, exactly as
    two separate calls would store them.
    """
    return undo_redo_impl(p, m, v, g_old, s_old, g_new, s_new, variant, p_old=p_old, out=out, exact=True,
                          p_copy=p_copy, backend=NAME)


def step_many(calls: Sequence[StepCall], variant: AdamVariant) -> list[Triple]:
    """:func:`step` for each block, in one call of the native code (the kernel contract's list form). A
    block with ``skip`` is a checked step (:data:`~sofx.kernels.base.FINITE_CHUNK`): each chunk's gradient
    is read first, in the same pass, and a chunk with an inf or a nan is left alone and flagged."""
    return step_many_impl(calls, variant, exact=True, backend=NAME)


def undo_many(calls: Sequence[UndoCall], variant: AdamVariant) -> list[Triple]:
    """:func:`undo` for each block, in one call of the native code."""
    return undo_many_impl(calls, variant, exact=True, backend=NAME)


def undo_redo_many(calls: Sequence[UndoRedoCall], variant: AdamVariant) -> list[Triple]:
    """:func:`undo_redo` for each block, in one call of the native code; a block with ``skip`` is checked
    as in :func:`step_many`, on its new gradient."""
    return undo_redo_many_impl(calls, variant, exact=True, backend=NAME)


def step_chunks(calls: Sequence[ChunkedCall], variant: AdamVariant) -> None:
    """Each call's step on its listed chunks alone (:mod:`sofx.kernels.chunked`: the kept values copied out
    first, or the packed ones stepped), in one call of the native code; writes the calls' ``out``."""
    step_chunks_impl(calls, variant, exact=True, backend=NAME)


def undo_redo_chunks(calls: Sequence[ChunkedCall], variant: AdamVariant) -> None:
    """Each call's undo+redo on its listed chunks alone (see :func:`step_chunks`)."""
    undo_redo_chunks_impl(calls, variant, exact=True, backend=NAME)


def prepare_chunks(calls: Sequence[ChunkedCall], variant: AdamVariant, step: bool) -> Callable[[], None]:
    """:func:`step_chunks` (``step``) or :func:`undo_redo_chunks` of ``calls`` in two parts: the calls checked
    now (refused as that function refuses them, nothing written), and the function returned runs them (the calls
    left as they were in between: the checks were of their tensors then). :func:`sofx.skipped_chunks.run_chunked`
    checks all its kernels' calls so before it runs any."""
    return prepare_chunks_impl(calls, variant, step, exact=True, backend=NAME)


# ------------------------------------------------------------------ implementations (shared with cpu_fast)
def step_impl(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
              variant: AdamVariant, *, out: Triple | None, exact: bool, p_copy: torch.Tensor | None = None,
              backend: str) -> Triple:
    """:func:`step`; ``exact=False`` uses IEEE ``sqrtf`` (see :mod:`sofx.kernels.cpu_fast`). ``backend``: the
    name errors give the backend the caller called (``cpu_fast`` runs this code under its own)."""
    return _run_blocks(src.OP_STEP, [_Block(p, g, m, v, None, None, s, None, out, p_copy)], variant, exact,
                       backend, [f"{backend}.step"])[0]


def undo_impl(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
              variant: AdamVariant, *, p_old: torch.Tensor | None, out: Triple | None, exact: bool,
              p_copy: torch.Tensor | None = None, backend: str) -> Triple:
    """:func:`undo` with the choice of square root and the backend's name (see :func:`step_impl`)."""
    return _run_blocks(src.OP_UNDO, [_Block(p, g, m, v, None, p_old, s, None, out, p_copy)], variant, exact,
                       backend, [f"{backend}.undo"])[0]


def undo_redo_impl(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g_old: torch.Tensor, s_old: AdamScalars,
                   g_new: torch.Tensor, s_new: AdamScalars, variant: AdamVariant, *,
                   p_old: torch.Tensor | None, out: Triple | None, exact: bool,
                   p_copy: torch.Tensor | None = None, backend: str) -> Triple:
    """:func:`undo_redo` with the choice of square root and the backend's name (see :func:`step_impl`)."""
    return _run_blocks(src.OP_UNDO_REDO, [_Block(p, g_old, m, v, g_new, p_old, s_old, s_new, out, p_copy)],
                       variant, exact, backend, [f"{backend}.undo_redo"])[0]


def step_many_impl(calls: Sequence[StepCall], variant: AdamVariant, *, exact: bool, backend: str,
                   ) -> list[Triple]:
    """:func:`step_many` with the choice of square root and the backend's name (see :func:`step_impl`)."""
    blocks = [_Block(c.p, c.g, c.m, c.v, None, None, c.s, None, c.out, c.p_copy, c.skip, c.zero_moments,
                     c.p_kept) for c in calls]
    return _run_blocks(src.OP_STEP, blocks, variant, exact, backend, _block_names(backend, "step_many", calls))


def undo_many_impl(calls: Sequence[UndoCall], variant: AdamVariant, *, exact: bool, backend: str,
                   ) -> list[Triple]:
    """:func:`undo_many` with the choice of square root and the backend's name (see :func:`step_impl`)."""
    blocks = [_Block(c.p, c.g, c.m, c.v, None, c.p_old, c.s, None, c.out, c.p_copy) for c in calls]
    return _run_blocks(src.OP_UNDO, blocks, variant, exact, backend, _block_names(backend, "undo_many", calls))


def undo_redo_many_impl(calls: Sequence[UndoRedoCall], variant: AdamVariant, *, exact: bool, backend: str,
                        ) -> list[Triple]:
    """:func:`undo_redo_many` with the choice of square root and the backend's name (see :func:`step_impl`)."""
    blocks = [_Block(c.p, c.g_old, c.m, c.v, c.g_new, c.p_old, c.s_old, c.s_new, c.out, c.p_copy, c.skip, False,
                     c.p_kept)
              for c in calls]
    return _run_blocks(src.OP_UNDO_REDO, blocks, variant, exact, backend,
                       _block_names(backend, "undo_redo_many", calls))


def step_chunks_impl(calls: Sequence[ChunkedCall], variant: AdamVariant, *, exact: bool, backend: str) -> None:
    """:func:`step_chunks` with the choice of square root and the backend's name (see :func:`step_impl`)."""
    prepare_chunks_impl(calls, variant, True, exact=exact, backend=backend)()


def undo_redo_chunks_impl(calls: Sequence[ChunkedCall], variant: AdamVariant, *, exact: bool, backend: str,
                          ) -> None:
    """:func:`undo_redo_chunks` with the choice of square root and the backend's name (see :func:`step_impl`)."""
    prepare_chunks_impl(calls, variant, False, exact=exact, backend=backend)()


def prepare_chunks_impl(calls: Sequence[ChunkedCall], variant: AdamVariant, step: bool, *, exact: bool,
                        backend: str) -> Callable[[], None]:
    """:func:`prepare_chunks` with the choice of square root and the backend's name (see :func:`step_impl`)."""
    op, fn = (src.OP_STEP, "step_chunks") if step else (src.OP_UNDO_REDO, "undo_redo_chunks")
    return _checked_chunked(op, calls, variant, exact, backend, _block_names(backend, fn, calls))


def _checked_chunked(op: int, calls: Sequence[ChunkedCall], variant: AdamVariant, exact: bool, backend: str,
                     where: Sequence[str]) -> Callable[[], None]:
    """Check ``calls`` (:class:`~sofx.kernels.chunked.ChunkedCall` of ``op``) and return the function that runs
    them, nothing written before: those the native code takes in one call of the C entry (its chunk table: per
    block the chunk list, its length, packed, and the kept arrays), then the others as their runs' blocks
    (:func:`~sofx.kernels.chunked.range_calls`). The C entry goes first, as it may still refuse (no memory for its
    job table: nothing written); the calls over runs cannot (the checks here are theirs), and they write and copy
    their kept values as they run."""
    s1s, s2s = check_chunked_calls(where, calls, StepCall if op == src.OP_STEP else UndoRedoCall, variant)
    for name, c in zip(where, calls):
        if c.call.out[0].device.type != "cpu":
            raise UnsupportedError(f"{name}: the block is on {c.call.out[0].device}; the {backend} backend needs "
                                   "CPU tensors")
    lib = _cpu_build.load()
    native: list[_Native] = []
    tab = array("q")
    keep_alive: list[Any] = [calls]  # the tensors the table points at (the chunk lists' contiguous views too)
    written: list[torch.Tensor | None] = []  # what the C entry writes of the caller's: out, p_copy, skip, kept
    by_runs: list[tuple[str, ChunkedCall]] = []
    for name, c, s1, s2 in zip(where, calls, s1s, s2s):
        if not c.chunks.numel():
            continue
        entry = _chunked_native(op, c, lib, variant, s1, s2) if lib is not None else None
        if entry is None:  # (dtypes or scalars the native code does not take: the same through the blocks)
            by_runs.append((name, c))
            continue
        nb, listed = entry
        native.append(nb)
        kept = c.kept if c.kept is not None else (None, None, None)
        tab.extend([listed.data_ptr(), listed.numel(), int(c.packed)]
                   + [t.data_ptr() if t is not None else 0 for t in kept])
        keep_alive.append(listed)
        written += [*c.call.out, c.call.p_copy, c.call.skip, *kept]
    return functools.partial(_run_checked_chunked, op, variant, exact, backend, lib, native, tab, by_runs,
                             keep_alive, written)


def _run_checked_chunked(op: int, variant: AdamVariant, exact: bool, backend: str, lib: _cpu_build.NativeLib | None,
                         native: Sequence[_Native], tab: array, by_runs: Sequence[tuple[str, ChunkedCall]],
                         keep_alive: Sequence[Any], written: Sequence[torch.Tensor | None]) -> None:
    """Run what :func:`_checked_chunked` checked: the ``native`` blocks in one call of the C entry (``tab``: its
    chunk table; ``keep_alive``: the tensors it points at; ``written``: the caller's tensors it writes, their
    version counters bumped after it), then ``by_runs``' calls over their runs."""
    if native:
        assert lib is not None
        try:
            _call(lib, op, variant, _Table.of(native), exact, backend, tab)
        finally:  # (see _run_blocks)
            mark_written(written)
    for name, c in by_runs:
        _run_by_runs(op, name, c, variant, exact, backend)


def _run_by_runs(op: int, name: str, c: ChunkedCall, variant: AdamVariant, exact: bool, backend: str) -> None:
    """A checked :class:`ChunkedCall` of ``op`` (named ``name``) as the blocks of its runs of adjacent chunks, its
    kept values copied out first (:func:`~sofx.kernels.chunked.range_calls`)."""
    runs = range_calls(c)
    blocks = [_Block(r.p, r.g, r.m, r.v, None, None, r.s, None, r.out, r.p_copy, r.skip,
                     getattr(r, "zero_moments", False), r.p_kept) if op == src.OP_STEP else
              _Block(r.p, r.g_old, r.m, r.v, r.g_new, r.p_old, r.s_old, r.s_new, r.out, r.p_copy, r.skip, False,
                     r.p_kept)
              for r in runs]
    _run_blocks(op, blocks, variant, exact, backend, [f"{name} run {i}" for i in range(len(blocks))])


def _chunked_native(op: int, c: ChunkedCall, lib: _cpu_build.NativeLib, variant: AdamVariant, s1: AdamScalars,
                    s2: AdamScalars | None) -> tuple[_Native, torch.Tensor] | None:
    """The C entry's view of a checked :class:`ChunkedCall` and its chunk list (contiguous), or None where the
    native code does not take it (a dtype, scalars that are not all numbers, a parameter copy it cannot store)."""
    call = c.call
    g, g2 = (call.g, None) if op == src.OP_STEP else (call.g_old, call.g_new)
    codes = _codes(lib)
    p_old = call.p_old if op == src.OP_UNDO_REDO else None
    if any(t is not None and t.dtype not in codes for t in (call.p, call.m, g, g2, p_old)) \
            or call.m.dtype != call.v.dtype:
        return None
    if call.p_copy is not None and kernel_param_copy(call.p_copy, codes) is None:
        return None
    c1 = _scalar_block(s1, variant)
    c2 = _scalar_block(s2, variant) if s2 is not None else None
    if c1 is None or (s2 is not None and c2 is None):
        return None
    if op == src.OP_STEP and call.zero_moments and call.skip is not None:
        c1 = _without_lossy(c1)
    if getattr(call, "p_kept", False) and call.skip is not None:
        if op == src.OP_UNDO_REDO:
            c2 = _with_p_kept(c2)
        else:
            c1 = _with_p_kept(c1)
    pc, out = call.p_copy, call.out
    dtypes, ptrs = _table_entry(codes, call.p, g, call.m, call.v, g2, p_old, out, pc, call.skip)
    return _Native(dtypes, ptrs, g.numel(), c1, c2, list(out), pc is not None), c.chunks.contiguous()


def _block_names(backend: str, fn: str, calls: Sequence) -> list[str]:
    """How errors name each block of a list form: ``"cpu_fast.step_many[3]"``."""
    return [f"{backend}.{fn}[{i}]" for i in range(len(calls))]
