"""The CPU kernels of :mod:`sofx.kernels.cpu` as single fused loops: fastest; bitwise torch's fused Adam.

:mod:`sofx.kernels.cpu` reproduces the reference's bits (torch.optim's
default for-loop/foreach Adam), which means calling torch's own square-root
routine (MKL's vector math, not always correctly rounded) on small tiles of
the update. This backend instead runs one fully fused loop per element with
the correctly rounded IEEE ``sqrtf``, which is what
``torch.optim.Adam/AdamW(fused=True)`` computes: its step equals torch's
fused CPU kernel bit for bit (float32 and bfloat16; tested), and differs
from ``cpu`` / ``reference`` by a few ulps of the update (up to 3 measured, on
about one element in eight): the fused kernel's order of operations, which
torch's own fused and for-loop steps differ by as much, and MKL's square root
where it is an ulp off. Its inverse divides by
``1 - lr*wd``, ``beta1`` and ``beta2`` through their reciprocals and one
multiply-add correction (the true quotient but for operands below ~2^-78 or
quotients that overflow, where it may be an ulp off; ``u`` itself is
recomputed exactly as the step computed it), which keeps the fused undo+redo
closer to memory speed. Its step runs at the memory bandwidth, as fast as
torch's fused Adam (all-bf16: about 1.3x faster, close to the bandwidth).

Choose it with ``backend="cpu_fast"``; ``backend="auto"`` picks ``cpu`` (bitwise the reference).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from sofx.kernels import cpu
from sofx.kernels.base import AdamScalars, AdamVariant, StepCall, Triple, UndoCall, UndoRedoCall
from sofx.kernels.chunked import ChunkedCall

__all__ = ["NAME", "supports", "step", "undo", "undo_redo", "step_many", "undo_many", "undo_redo_many", "step_chunks",
           "undo_redo_chunks", "prepare_chunks", "native_refusal", "CHECKS_FINITE", "CHECKS_OVERLAP",
           "RUNS_CHUNK_LISTS"]

NAME = "cpu_fast"
CHECKS_FINITE = True  # step_many / undo_redo_many take checked calls (skip)
CHECKS_OVERLAP = True  # the list forms refuse written arrays that share memory (cpu._run_blocks)
RUNS_CHUNK_LISTS = True  # step_chunks / undo_redo_chunks (sofx.kernels.chunked) in one native call


def supports(device: torch.device | str, param_dtype: torch.dtype, state_dtype: torch.dtype) -> bool:
    """The same combinations as :func:`sofx.kernels.cpu.supports`."""
    return cpu.supports(device, param_dtype, state_dtype)


def native_refusal() -> str | None:
    """:func:`sofx.kernels.cpu.native_refusal` (the same native library)."""
    return cpu.native_refusal()


def step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, out: Triple | None = None, p_copy: torch.Tensor | None = None) -> Triple:
    """One Adam step (:func:`sofx.kernels.cpu.step` with IEEE square roots)."""
    return cpu.step_impl(p, g, m, v, s, variant, out=out, exact=False, p_copy=p_copy, backend=NAME)


def undo(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, p_old: torch.Tensor | None = None, out: Triple | None = None,
         p_copy: torch.Tensor | None = None) -> Triple:
    """Inverse of :func:`step` (:func:`sofx.kernels.cpu.undo` with IEEE square roots)."""
    return cpu.undo_impl(p, g, m, v, s, variant, p_old=p_old, out=out, exact=False, p_copy=p_copy, backend=NAME)


def undo_redo(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g_old: torch.Tensor, s_old: AdamScalars,
              g_new: torch.Tensor, s_new: AdamScalars, variant: AdamVariant, *,
              p_old: torch.Tensor | None = None, out: Triple | None = None,
              p_copy: torch.Tensor | None = None) -> Triple:
    """One-pass undo and redo (:func:`sofx.kernels.cpu.undo_redo` with IEEE square roots)."""
    return cpu.undo_redo_impl(p, m, v, g_old, s_old, g_new, s_new, variant, p_old=p_old, out=out, exact=False,
                              p_copy=p_copy, backend=NAME)


def step_many(calls: Sequence[StepCall], variant: AdamVariant) -> list[Triple]:
    """:func:`step` for each block, in one call of the native code."""
    return cpu.step_many_impl(calls, variant, exact=False, backend=NAME)


def undo_many(calls: Sequence[UndoCall], variant: AdamVariant) -> list[Triple]:
    """:func:`undo` for each block, in one call of the native code."""
    return cpu.undo_many_impl(calls, variant, exact=False, backend=NAME)


def undo_redo_many(calls: Sequence[UndoRedoCall], variant: AdamVariant) -> list[Triple]:
    """:func:`undo_redo` for each block, in one call of the native code."""
    return cpu.undo_redo_many_impl(calls, variant, exact=False, backend=NAME)


def step_chunks(calls: Sequence[ChunkedCall], variant: AdamVariant) -> None:
    """Each call's step on its listed chunks alone (:func:`sofx.kernels.cpu.step_chunks` with IEEE square roots)."""
    cpu.step_chunks_impl(calls, variant, exact=False, backend=NAME)


def undo_redo_chunks(calls: Sequence[ChunkedCall], variant: AdamVariant) -> None:
    """Each call's undo+redo on its listed chunks alone (:func:`sofx.kernels.cpu.undo_redo_chunks`, IEEE square
    roots)."""
    cpu.undo_redo_chunks_impl(calls, variant, exact=False, backend=NAME)


def prepare_chunks(calls: Sequence[ChunkedCall], variant: AdamVariant, step: bool) -> Callable[[], None]:
    """:func:`step_chunks` or :func:`undo_redo_chunks` checked now, run by the function returned
    (:func:`sofx.kernels.cpu.prepare_chunks`, IEEE square roots)."""
    return cpu.prepare_chunks_impl(calls, variant, step, exact=False, backend=NAME)
