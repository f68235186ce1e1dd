"""Finishing a checked step whose kernel left chunks alone.

A checked step (``StepCall.skip``, ``UndoRedoCall.skip``; :data:`sofx.kernels.base.FINITE_CHUNK`) reads
each chunk of the gradient of the step it takes before writing the chunk and leaves a chunk with an inf
or a nan alone, or one whose inverse would be too lossy (:func:`sofx.kernels.base.lossy_elements`). No
(exact enough) algebraic inverse exists there, so :class:`sofx.Adam` keeps the old values of those chunks:
the functions here copy them out (a ``"chunk_snapshot"`` record, :mod:`sofx.undo_record`), then step the
skipped chunks, which completes exactly the call an unchecked kernel would have made (the same bits). The
other chunks are undone algebraically, as the test found them sound. Rare but for a few leaves: an
overflow, a gradient spike, the first steps of a run (a second moment still small by chance), the rows of
an embedding or output layer that rare tokens update (there a few chunks in ten, every step), elements whose
second moment is still 0 given a gradient beside a first moment that is not, or in L2 mode or with bfloat16
moments (a row no token had used: its inverse would keep a leftover of the step's rounding; where both moments
are 0 in float32 without L2 decay the inverse gives them back exactly: :func:`sofx.kernels.base.zeros_come_back`).
Not a leaf's first step from init (``StepCall.zero_moments``: its undo zeroes the moments).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from sofx.errors import UnsupportedError
from sofx.kernels.base import (FINITE_CHUNK, AdamVariant, StepCall, Triple, UndoCall, UndoRedoCall,
                               refuse_checked_steps, write_param_copy)
from sofx.kernels.chunked import (ChunkedCall, _take_chunks, check_chunked_calls, gather_chunks, listed_elements,
                                  listed_ranges, put_chunks, range_calls)
from sofx.kernels.layout import same_layout
from sofx.undo_record import CHECKED_CHUNKS_REASON, LeafUndo, chunk_snapshot_bytes, strategy_snapshot_bytes

__all__ = ["Pending", "finish_step", "finished_bytes", "finish_undo_redo", "split_by_kept_chunks", "run_chunked",
           "restore_chunks", "roll_back_step"]


Pending = list[tuple[Any, ChunkedCall]]


def finish_step(kernel: Any, variant: AdamVariant, inputs: Triple, call: StepCall, rec: LeafUndo, results: Triple,
                donate: bool, pending: Pending | None = None) -> LeafUndo:
    """Finish ``update``'s checked step of one leaf (``inputs``: its ``p, m, v`` before, ``results`` the
    kernel's; ``rec``: the record made for it) and return the leaf's record. ``pending``: where to leave the
    step of its flagged chunks (the caller runs all leaves' at once, :func:`run_chunked`, before using the
    record or the results); None: run here.

    The skipped chunks still hold their old values (in place under donation, else the inputs are
    untouched): a ``"chunk_snapshot"`` of them is copied out, then they are stepped. Where every chunk was
    skipped the record is a whole ``"snapshot"`` (the same values, no indices). A leaf whose record keeps its
    old parameter whole (``"param_snapshot"``) gets a whole snapshot too: with donation the stepped chunks'
    old moments are recovered by the algebraic inverse into new tensors (as an undo would)."""
    chunks = call.skip.nonzero().flatten()
    step = StepCall(inputs[0], call.g, inputs[1], inputs[2], rec.scalars, tuple(results), call.p_copy)
    if chunks.numel() == call.skip.numel():  # every chunk skipped: the old values are all still there
        # (donated: copied out chunk by chunk in the step's own call, each chunk stepped while in cache)
        old = tuple(torch.empty_like(t) for t in inputs) if donate else inputs
        _run_or_leave(variant, kernel, ChunkedCall(step, chunks, kept=tuple(t.view(-1) for t in old)
                                                   if donate else None), pending)
        return LeafUndo("snapshot", call.g, rec.scalars, rec.count_before, *old, CHECKED_CHUNKS_REASON,
                        owns_kept=donate)
    if not _kept_whole(rec.strategy, chunks.numel(), call.skip.numel()):
        listed = listed_elements(chunks, results[0].numel())
        kept = tuple(torch.empty(listed, dtype=t.dtype, device=t.device) for t in inputs)
        _run_or_leave(variant, kernel, ChunkedCall(step, chunks, kept=kept), pending)
        return LeafUndo("chunk_snapshot", call.g, rec.scalars, rec.count_before, *kept, CHECKED_CHUNKS_REASON,
                        rec.moments_were_zero, chunks, owns_kept=True)
    if donate:  # (the skipped chunks: not stepped, their old values still there)
        old = _inverted_around(kernel, variant, results, call.g, rec.scalars, rec.p_old, chunks,
                               [gather_chunks(r, chunks) for r in results], rec.moments_were_zero)
        source = results
    else:
        old = source = inputs
    step = StepCall(source[0], call.g, source[1], source[2], rec.scalars, tuple(results), call.p_copy)
    _run_or_leave(variant, kernel, ChunkedCall(step, chunks), pending)
    return LeafUndo("snapshot", call.g, rec.scalars, rec.count_before, *old, CHECKED_CHUNKS_REASON, owns_kept=donate)


def _run_or_leave(variant: AdamVariant, kernel: Any, call: ChunkedCall, pending: Pending | None) -> None:
    """Run ``call`` now, or leave it in ``pending`` for the caller to run with others."""
    if pending is None:
        run_chunked(variant, [(kernel, call)])
    else:
        pending.append((kernel, call))


def finished_bytes(strategy: str, skip: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> int:
    """The snapshot bytes :func:`finish_step` keeps for a leaf planned ``strategy`` whose checked step flagged
    the chunks ``skip`` marks: those chunks', or the whole leaf's."""
    chunks = skip.nonzero().flatten()
    if _kept_whole(strategy, chunks.numel(), skip.numel()):
        return strategy_snapshot_bytes("snapshot", p, m, v)
    return chunk_snapshot_bytes(chunks, p, m, v)


def _kept_whole(strategy: str, flagged: int, chunks: int) -> bool:
    """Whether a finished step keeps its leaf whole: every chunk flagged (the same values, no indices), or a
    record that keeps the old parameter whole anyway."""
    return strategy == "param_snapshot" or flagged == chunks


def finish_undo_redo(kernel: Any, variant: AdamVariant, inputs: Triple, call: UndoRedoCall, rec: LeafUndo,
                     results: Triple, donate: bool, undone_rec: LeafUndo | None = None,
                     pending: Pending | None = None) -> LeafUndo:
    """Finish ``undo_redo``'s checked call of one leaf (the new gradient not finite, or the redo too lossy
    to invert, in the skipped chunks; ``inputs``: its ``p', m', v'`` before the call; ``rec``: the record made
    for the redo; ``undone_rec``: the record it undid) and return the record of the redone step, a
    ``"chunk_snapshot"`` of the skipped chunks' undone values (a whole ``"snapshot"`` where every chunk was
    skipped, or where ``rec`` keeps the old parameter whole, as :func:`finish_step`'s). ``pending``: as
    :func:`finish_step`'s.

    The skipped chunks still hold the old step's values (in place under donation, else the inputs are
    untouched): they are undone (the undone step's inverse, which was sound there) into the snapshot, or
    taken from ``undone_rec`` where it kept them (a chunk snapshot), then stepped from it with the new
    gradient."""
    n = results[0].numel()
    chunks = call.skip.nonzero().flatten()
    kept = undone_rec is not None and undone_rec.chunks is not None  # its kept chunks: their old values, exact
    owned = True  # (the new record's kept values: gathered, undone into new tensors, or undone_rec's own)
    if kept and bool(torch.isin(chunks, undone_rec.chunks).all()):
        # (a late clip redoes the same spikes: the undone step's record kept every chunk the redo flags) no undo:
        # the kept values, the very tensors where the chunks are the same (read only: the record is used up;
        # unchecked: the test above is take_chunks' check)
        cur = [_take_chunks(t, undone_rec.chunks, chunks, n) for t in (undone_rec.p_old, undone_rec.m_old,
                                                                        undone_rec.v_old)]
        owned = undone_rec.owns_kept
    else:
        held = results if donate else inputs  # the old step's values there
        cur = [gather_chunks(t, chunks) for t in held]
        p_old = gather_chunks(call.p_old, chunks) if call.p_old is not None else None
        kernel.undo_many([UndoCall(cur[0], gather_chunks(call.g_old, chunks), cur[1], cur[2], call.s_old, p_old,
                                   (cur[0], cur[1], cur[2]))], variant)
        if kept:
            _overlay(cur, chunks, (undone_rec.p_old, undone_rec.m_old, undone_rec.v_old), undone_rec.chunks, n)
    every = chunks.numel() == call.skip.numel()
    whole = _undone_whole(kernel, variant, inputs, call, rec, results, donate, chunks, cur) \
        if not every and _kept_whole(rec.strategy, chunks.numel(), call.skip.numel()) else None
    step = StepCall(cur[0], call.g_new, cur[1], cur[2], call.s_new, tuple(results), call.p_copy)
    _run_or_leave(variant, kernel, ChunkedCall(step, chunks, packed=True), pending)
    if every:  # a whole snapshot
        return LeafUndo("snapshot", call.g_new, call.s_new, rec.count_before,
                        *(k.view(r.shape) for k, r in zip(cur, results)), CHECKED_CHUNKS_REASON, owns_kept=owned)
    if whole is not None:  # (without donation its parameter may be the undone record's old one, passed on)
        return LeafUndo("snapshot", call.g_new, call.s_new, rec.count_before, *whole, CHECKED_CHUNKS_REASON,
                        owns_kept=donate or (undone_rec is not None and undone_rec.owns_kept))
    # (the redo of a first step from zero moments is one too, as the record of update's step from them)
    return LeafUndo("chunk_snapshot", call.g_new, call.s_new, rec.count_before, *cur, CHECKED_CHUNKS_REASON,
                    rec.moments_were_zero, chunks, owns_kept=owned)


def _undone_whole(kernel: Any, variant: AdamVariant, inputs: Triple, call: UndoRedoCall, rec: LeafUndo,
                  results: Triple, donate: bool, chunks: torch.Tensor, cur: Sequence[torch.Tensor]) -> Triple:
    """The undone ``p, m, v`` of a leaf whose checked undo+redo flagged ``chunks`` (not all) and whose redo's
    record ``rec`` keeps the old parameter whole (``"param_snapshot"``, of the undone one: ``call.p_old``), for
    its whole snapshot (:func:`finish_undo_redo`), new tensors, the values :func:`finish_step` keeps for update's
    step from the undone state: without donation the undone step's inverse of the untouched inputs (the undo's
    own bits); with donation (the kernel wrote the redo in place outside ``chunks``) the redo's inverse of
    ``results`` there and ``cur`` (the undone values of ``chunks``, packed) in ``chunks``, exact zero moments for
    a first step from them."""
    if donate:
        return _inverted_around(kernel, variant, results, call.g_new, call.s_new, rec.p_old, chunks, cur,
                                rec.moments_were_zero)
    old = kernel.undo_many([UndoCall(inputs[0], call.g_old, inputs[1], inputs[2], call.s_old, call.p_old)],
                           variant)[0]
    return _zeroed_if_fresh(old, rec.moments_were_zero)


def _inverted_around(kernel: Any, variant: AdamVariant, results: Triple, g: torch.Tensor, s: Any,
                     p_old: torch.Tensor | None, chunks: torch.Tensor, kept: Sequence[torch.Tensor],
                     fresh: bool) -> Triple:
    """The values before a donated step (gradient ``g``, scalars ``s``, the old parameter ``p_old`` where a record
    keeps it) that wrote ``results`` in place outside ``chunks``, in new tensors: the step's inverse there (as an
    undo would), ``kept`` (the chunks' old values, packed) in ``chunks``, and exact zero moments where the step was
    the first from them (``fresh``)."""
    old = kernel.undo_many([UndoCall(results[0], g, results[1], results[2], s, p_old)], variant)[0]
    for o, k in zip(old, kept):
        put_chunks(o, chunks, k)
    return _zeroed_if_fresh(old, fresh)


def _zeroed_if_fresh(old: Triple, fresh: bool) -> Triple:
    """``old`` (undone ``p, m, v``) with its moments set to exact zeros where the undone step was a leaf's first
    from them (``fresh``)."""
    if fresh:
        old[1].zero_()
        old[2].zero_()
    return old


def _overlay(dst: Sequence[torch.Tensor], dst_chunks: torch.Tensor, src: Sequence[torch.Tensor],
             src_chunks: torch.Tensor, n: int) -> None:
    """``dst[i]``'s chunks (packed: ``dst_chunks``'s, one after another) that ``src`` holds too (packed:
    ``src_chunks``') set to ``src``'s values (whole chunks as rows; the leaf of ``n`` elements' partial last
    chunk, last in both where both hold it)."""
    whole = n // FINITE_CHUNK
    d_full, s_full = dst_chunks[dst_chunks < whole], src_chunks[src_chunks < whole]
    both = torch.isin(d_full, s_full)
    rows_from = torch.searchsorted(s_full, d_full[both])
    rows_to = both.nonzero().flatten()
    for d, s_ in zip(dst, src):
        d_rows = d[:d_full.numel() * FINITE_CHUNK].view(-1, FINITE_CHUNK)
        d_rows.index_copy_(0, rows_to, s_[:s_full.numel() * FINITE_CHUNK].view(-1, FINITE_CHUNK)
                           .index_select(0, rows_from))
        tail = d.numel() - d_full.numel() * FINITE_CHUNK
        if tail and s_.numel() - s_full.numel() * FINITE_CHUNK:
            d[-tail:] = s_[-tail:]


def split_by_kept_chunks(call: UndoRedoCall, rec: LeafUndo) -> tuple[ChunkedCall, ChunkedCall]:
    """``call`` (an undo+redo of a whole leaf with ``out``) as the calls that carry it out for a
    ``"chunk_snapshot"`` record ``rec``: the fused undo+redo of the chunks the record did not keep, and the
    step of the kept chunks from their old values (packed: the exact undo there), into the same outputs, with
    the same flags (``call.skip``) and parameter copy (:func:`run_chunked` runs them)."""
    assert call.out is not None
    kept = rec.chunks
    free = torch.ones(-(-call.p.numel() // FINITE_CHUNK), dtype=torch.bool, device=kept.device)
    free[kept] = False
    redo = ChunkedCall(call, free.nonzero().flatten())
    step = StepCall(rec.p_old, call.g_new, rec.m_old, rec.v_old, call.s_new, call.out, call.p_copy, call.skip)
    return redo, ChunkedCall(step, kept, packed=True)


def run_chunked(variant: AdamVariant, calls: Sequence[tuple[Any, ChunkedCall]]) -> None:
    """Run each ``(kernel, call)`` (:class:`~sofx.kernels.chunked.ChunkedCall`, steps and undo+redos), one call
    per kernel and function: in its native code where the kernel runs chunk lists (``RUNS_CHUNK_LISTS``), else
    as its list form's calls over the runs of adjacent chunks. Every group is checked before any runs (the native
    code's checks, ``prepare_chunks``; the others' :func:`~sofx.kernels.chunked.check_chunked_calls`): a bad call
    is refused before a kept value is copied or an output written."""
    groups: dict[tuple[int, bool], tuple[Any, list[ChunkedCall]]] = {}
    for kernel, c in calls:
        groups.setdefault((id(kernel), isinstance(c.call, StepCall)), (kernel, []))[1].append(c)
    runs = [_checked_group(variant, kernel, group, is_step) for (_, is_step), (kernel, group) in groups.items()]
    for run in runs:
        run()


def _checked_group(variant: AdamVariant, kernel: Any, group: list[ChunkedCall], is_step: bool,
                   ) -> Callable[[], None]:
    """Check ``group`` (``kernel``'s steps, ``is_step``, or its undo+redos) and return the function that runs it."""
    if getattr(kernel, "RUNS_CHUNK_LISTS", False):
        return kernel.prepare_chunks(group, variant, is_step)
    where = [f"{kernel.NAME} chunks[{i}]" for i in range(len(group))]
    check_chunked_calls(where, group, StepCall if is_step else UndoRedoCall, variant)
    _refuse_unsupported(kernel, group, where)
    return functools.partial(_run_by_runs, variant, kernel, group, is_step)


def _refuse_unsupported(kernel: Any, group: Sequence[ChunkedCall], where: Sequence[str]) -> None:
    """Refuse, as ``kernel``'s list form would after :func:`~sofx.kernels.chunked.range_calls` copied the kept
    values, a call of ``group`` (checked: :func:`~sofx.kernels.chunked.check_chunked_calls`) the kernel contract
    says it does not take: a checked call (``skip``) where ``CHECKS_FINITE`` is False, a device and dtypes its
    ``supports`` (where it has one) refuses."""
    if not getattr(kernel, "CHECKS_FINITE", False):
        refuse_checked_steps([c.call for c in group], f"{kernel.NAME} chunks")  # (where[i]'s names)
    supports = getattr(kernel, "supports", None)
    for name, c in zip(where, group):
        call = c.call
        if supports is not None and not supports(call.p.device, call.p.dtype, call.m.dtype):
            raise UnsupportedError(f"{name}: device {call.p.device} with param dtype {call.p.dtype} and state dtype "
                                   f"{call.m.dtype} is not supported by the {kernel.NAME} backend")


def _run_by_runs(variant: AdamVariant, kernel: Any, group: list[ChunkedCall], is_step: bool) -> None:
    """A checked ``group`` as ``kernel``'s list form's calls over the runs of adjacent chunks (the kept values
    copied out first, :func:`~sofx.kernels.chunked.range_calls`)."""
    runs = [r for c in group for r in range_calls(c)]
    if runs:
        (kernel.step_many if is_step else kernel.undo_redo_many)(runs, variant)


def restore_chunks(rec: LeafUndo, undone: Triple, p_copy: torch.Tensor | None) -> None:
    """Put a ``"chunk_snapshot"`` record's kept values into ``undone`` (the leaf's ``p, m, v`` undone
    algebraically, of the layout of the record's gradient: garbage in those chunks, whose gradient may be an
    inf) and ``p_copy``."""
    for t, kept in zip(undone, (rec.p_old, rec.m_old, rec.v_old)):
        put_chunks(t, rec.chunks, kept)
    if p_copy is not None and not same_layout(p_copy, undone[0]):
        write_param_copy(p_copy, undone[0])
    elif p_copy is not None:
        put_chunks(p_copy, rec.chunks, rec.p_old)


def roll_back_step(kernel: Any, variant: AdamVariant, inputs: Triple, call: StepCall, rec: LeafUndo,
                   donate: bool) -> None:
    """Take back ``update``'s checked step of one leaf whose kernel left flagged chunks alone, without
    finishing it (:class:`~sofx.errors.SnapshotLimitError`: its snapshot would not fit).

    With donation the flagged chunks still hold their old values and the others are inverted in place (the
    test found their inverse sound: exact to a few ulps). Without donation the inputs are untouched. The
    parameter copy, which the kernel wrote outside the flagged chunks, gets the old parameter whole."""
    if donate:
        n = inputs[0].numel()
        stepped = listed_ranges((call.skip == 0).nonzero().flatten().tolist(), n)
        p, m, v = (_flat(t) for t in inputs)
        g = _flat(call.g)
        p_old = _flat(rec.p_old) if rec.p_old is not None else None
        if stepped:
            kernel.undo_many([UndoCall(p[a:b], g[a:b], m[a:b], v[a:b], rec.scalars,
                                       p_old[a:b] if p_old is not None else None, (p[a:b], m[a:b], v[a:b]))
                              for a, b in stepped], variant)
        _zeroed_if_fresh((p, m, v), rec.moments_were_zero)
    write_param_copy(call.p_copy, inputs[0])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)  # the checked leaves are contiguous
