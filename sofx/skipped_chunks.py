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
second moment is still 0 given a gradient (a row no token had used: its inverse would keep a leftover of the
step's rounding). Not a leaf's first step from init (``StepCall.zero_moments``: its undo zeroes the moments).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sofx.kernels.base import (FINITE_CHUNK, AdamVariant, StepCall, Triple, UndoCall, UndoRedoCall,
                               write_param_copy)
from sofx.undo_record import (CHECKED_CHUNKS_REASON, LeafUndo, chunk_ranges, chunk_snapshot_bytes,
                               strategy_snapshot_bytes)

__all__ = ["finish_step", "finished_bytes", "finish_undo_redo", "split_by_kept_chunks", "restore_chunks",
           "roll_back_step"]

Ranges = Sequence[tuple[int, int]]


def finish_step(kernel: Any, variant: AdamVariant, inputs: Triple, call: StepCall, rec: LeafUndo, results: Triple,
                donate: bool) -> LeafUndo:
    """Finish ``update``'s checked step of one leaf (``inputs``: its ``p, m, v`` before, ``results`` the
    kernel's; ``rec``: the record made for it) and return the leaf's record.

    The skipped chunks still hold their old values (in place under donation, else the inputs are
    untouched): a ``"chunk_snapshot"`` of them is copied out, then they are stepped. Where every chunk was
    skipped the record is a whole ``"snapshot"`` (the same values, no indices). A leaf whose record keeps its
    old parameter whole (``"param_snapshot"``) gets a whole snapshot too: with donation the stepped chunks'
    old moments are recovered by the algebraic inverse into new tensors (as an undo would)."""
    chunks, ranges = _skipped(call.skip, results[0].numel())
    if len(ranges) == call.skip.numel():  # every chunk skipped: the old values are all still there
        old = [t.clone() for t in inputs] if donate else list(inputs)
        everything = [(0, results[0].numel())]
        _step(kernel, variant, everything, _pieces(old, everything), call.g, rec.scalars, results, call.p_copy)
        return LeafUndo("snapshot", call.g, rec.scalars, rec.count_before, *old, CHECKED_CHUNKS_REASON)
    runs = _runs(ranges)  # (one copy and one kernel block per run of adjacent chunks, not per chunk)
    if not _kept_whole(rec.strategy, len(ranges), call.skip.numel()):
        kept = _copy_out(inputs, runs)
        _step(kernel, variant, runs, _pieces(inputs, runs), call.g, rec.scalars, results, call.p_copy)
        return LeafUndo("chunk_snapshot", call.g, rec.scalars, rec.count_before, *kept, CHECKED_CHUNKS_REASON,
                        rec.moments_were_zero, chunks)
    if donate:
        old = kernel.undo_many([UndoCall(results[0], call.g, results[1], results[2], rec.scalars, rec.p_old)],
                               variant)[0]
        _put(old, runs, _pieces(results, runs))
        if rec.moments_were_zero:
            old[1].zero_()
            old[2].zero_()
        source = results
    else:
        old = source = inputs
    _step(kernel, variant, runs, _pieces(source, runs), call.g, rec.scalars, results, call.p_copy)
    return LeafUndo("snapshot", call.g, rec.scalars, rec.count_before, *old, CHECKED_CHUNKS_REASON)


def finished_bytes(strategy: str, skip: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> int:
    """The snapshot bytes :func:`finish_step` keeps for a leaf planned ``strategy`` whose checked step flagged
    the chunks ``skip`` marks: those chunks', or the whole leaf's."""
    chunks = skip.nonzero().flatten().tolist()
    if _kept_whole(strategy, len(chunks), skip.numel()):
        return strategy_snapshot_bytes("snapshot", p, m, v)
    return chunk_snapshot_bytes(chunks, p, m, v)


def _kept_whole(strategy: str, flagged: int, chunks: int) -> bool:
    """Whether a finished step keeps its leaf whole: every chunk flagged (the same values, no indices), or a
    record that keeps the old parameter whole anyway."""
    return strategy == "param_snapshot" or flagged == chunks


def finish_undo_redo(kernel: Any, variant: AdamVariant, inputs: Triple, call: UndoRedoCall, results: Triple,
                     donate: bool, count_before: torch.Tensor, undone_rec: LeafUndo | None = None) -> LeafUndo:
    """Finish ``undo_redo``'s checked call of one leaf (the new gradient not finite, or the redo too lossy
    to invert, in the skipped chunks; ``inputs``: its ``p', m', v'`` before the call; ``undone_rec``: the
    record it undid) and return the record of the redone step, a ``"chunk_snapshot"`` of the skipped
    chunks' undone values (a whole ``"snapshot"`` where every chunk was skipped).

    The skipped chunks still hold the old step's values (in place under donation, else the inputs are
    untouched): they are undone (the undone step's inverse, which was sound there) into the snapshot, or
    taken from ``undone_rec`` where it kept them (a chunk snapshot), then stepped from it with the new
    gradient."""
    n = results[0].numel()
    chunks, ranges = _skipped(call.skip, n)
    kept = _kept_by_chunk(undone_rec, n) if undone_rec is not None and undone_rec.chunks is not None else {}
    cur, g_old = _pieces(results if donate else inputs, ranges), _flat(call.g_old)
    p_old = _flat(call.p_old) if call.p_old is not None else None
    order = chunks.tolist()
    inverted = [i for i, c in enumerate(order) if c not in kept]
    calls = []
    for i in inverted:
        a, b = ranges[i]
        calls.append(UndoCall(cur[i][0], g_old[a:b], cur[i][1], cur[i][2], call.s_old,
                              p_old[a:b] if p_old is not None else None))
    done = dict(zip(inverted, kernel.undo_many(calls, variant))) if calls else {}
    undone = [done[i] if i in done else kept[c] for i, c in enumerate(order)]
    olds = [torch.cat([piece[i].reshape(-1) for piece in undone]) for i in range(3)]
    _step(kernel, variant, ranges, undone, call.g_new, call.s_new, results, call.p_copy)
    if len(ranges) == call.skip.numel():  # every chunk: a whole snapshot
        return LeafUndo("snapshot", call.g_new, call.s_new, count_before,
                        *(k.view(r.shape) for k, r in zip(olds, results)), CHECKED_CHUNKS_REASON)
    return LeafUndo("chunk_snapshot", call.g_new, call.s_new, count_before, *olds, CHECKED_CHUNKS_REASON,
                    chunks=chunks)


def split_by_kept_chunks(call: UndoRedoCall, rec: LeafUndo) -> tuple[list[UndoRedoCall], list[StepCall]]:
    """``call`` (an undo+redo of a whole leaf with ``out``) as the calls that carry it out for a
    ``"chunk_snapshot"`` record ``rec``: fused undo+redo calls over the runs of chunks the record did not
    keep, and step calls from the kept chunks' old values (the exact undo there) into the same outputs.
    Ranges of the leaf's memory, each with its chunks' flags (``call.skip``) and parameter copy."""
    n = call.p.numel()
    kept = _kept_runs(rec, n)
    free = _gaps([r for r, _ in kept], n)
    assert call.out is not None
    p, m, v, g_old, g_new = (_flat(t) for t in (call.p, call.m, call.v, call.g_old, call.g_new))
    out = [_flat(t) for t in call.out]
    copy = _flat(call.p_copy) if call.p_copy is not None else None

    def outputs(a: int, b: int) -> tuple[Triple, torch.Tensor | None, torch.Tensor | None]:
        skip = call.skip[a // FINITE_CHUNK:-(-b // FINITE_CHUNK)] if call.skip is not None else None
        return (out[0][a:b], out[1][a:b], out[2][a:b]), copy[a:b] if copy is not None else None, skip

    redo = [UndoRedoCall(p[a:b], m[a:b], v[a:b], g_old[a:b], call.s_old, g_new[a:b], call.s_new, None,
                         *outputs(a, b)) for a, b in free]
    step = [StepCall(old[0], g_new[a:b], old[1], old[2], call.s_new, *outputs(a, b)) for (a, b), old in kept]
    return redo, step


def restore_chunks(rec: LeafUndo, undone: Triple, p_copy: torch.Tensor | None) -> None:
    """Put a ``"chunk_snapshot"`` record's kept values into ``undone`` (the leaf's ``p, m, v`` undone
    algebraically, contiguous: garbage in those chunks, whose gradient may be an inf) and ``p_copy``."""
    kept = _kept_runs(rec, undone[0].numel())
    ranges, parts = [r for r, _ in kept], [old for _, old in kept]
    _put(undone, ranges, parts)
    if p_copy is not None and not p_copy.is_contiguous():
        write_param_copy(p_copy, undone[0])
    elif p_copy is not None:
        copy = _flat(p_copy)
        for (a, b), part in zip(ranges, parts):
            write_param_copy(copy[a:b], part[0])


def roll_back_step(kernel: Any, variant: AdamVariant, inputs: Triple, call: StepCall, rec: LeafUndo,
                   donate: bool) -> None:
    """Take back ``update``'s checked step of one leaf whose kernel left flagged chunks alone, without
    finishing it (:class:`~sofx.errors.SnapshotLimitError`: its snapshot would not fit).

    With donation the flagged chunks still hold their old values and the others are inverted in place (the
    test found their inverse sound: exact to a few ulps). Without donation the inputs are untouched. The
    parameter copy, which the kernel wrote outside the flagged chunks, gets the old parameter whole."""
    if donate:
        n = inputs[0].numel()
        stepped = _gaps(_skipped(call.skip, n)[1], n)
        p, m, v = (_flat(t) for t in inputs)
        g = _flat(call.g)
        p_old = _flat(rec.p_old) if rec.p_old is not None else None
        if stepped:
            kernel.undo_many([UndoCall(p[a:b], g[a:b], m[a:b], v[a:b], rec.scalars,
                                       p_old[a:b] if p_old is not None else None, (p[a:b], m[a:b], v[a:b]))
                              for a, b in stepped], variant)
        if rec.moments_were_zero:
            m.zero_()
            v.zero_()
    write_param_copy(call.p_copy, inputs[0])


def _skipped(skip: torch.Tensor | None, n: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The indices (int64, ascending, on the flags' device) and element ranges of the flagged chunks."""
    assert skip is not None
    chunks = skip.nonzero().flatten()
    return chunks, chunk_ranges(chunks.tolist(), n)


def _runs(ranges: Ranges) -> list[tuple[int, int]]:
    """``ranges`` (ascending, disjoint) with the adjacent ones joined: the same elements in fewer ranges."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _gaps(ranges: Ranges, n: int) -> list[tuple[int, int]]:
    """The element ranges of ``[0, n)`` outside ``ranges`` (ascending, disjoint)."""
    out, at = [], 0
    for a, b in list(ranges) + [(n, n)]:
        if a > at:
            out.append((at, a))
        at = b
    return out


def _kept_by_chunk(rec: LeafUndo, n: int) -> dict[int, Triple]:
    """A ``"chunk_snapshot"`` record's kept ``p, m, v`` of each chunk (views; ``n``: the leaf's elements),
    in the record's (ascending) order."""
    chunks = rec.chunks.tolist()
    lengths = [b - a for a, b in chunk_ranges(chunks, n)]
    split = [torch.split(kept, lengths) for kept in (rec.p_old, rec.m_old, rec.v_old)]
    return {c: (split[0][i], split[1][i], split[2][i]) for i, c in enumerate(chunks)}


def _kept_runs(rec: LeafUndo, n: int) -> list[tuple[tuple[int, int], Triple]]:
    """A ``"chunk_snapshot"`` record's kept ``p, m, v`` by run of adjacent chunks (one piece each: the
    record keeps its chunks one after the other), with each run's element range in the leaf."""
    runs = _runs(chunk_ranges(rec.chunks.tolist(), n))
    split = [torch.split(kept, [b - a for a, b in runs]) for kept in (rec.p_old, rec.m_old, rec.v_old)]
    return [(r, (split[0][i], split[1][i], split[2][i])) for i, r in enumerate(runs)]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)  # the checked leaves are contiguous


def _pieces(triple: Sequence[torch.Tensor], ranges: Ranges) -> list[Triple]:
    """The flat views ``(p[a:b], m[a:b], v[a:b])`` of ``triple`` for each range."""
    flat = [_flat(t) for t in triple]
    return [(flat[0][a:b], flat[1][a:b], flat[2][a:b]) for a, b in ranges]


def _copy_out(triple: Sequence[torch.Tensor], ranges: Ranges) -> list[torch.Tensor]:
    """``p, m, v``'s elements in ``ranges``, one after the other: three new flat tensors."""
    flat = [_flat(t) for t in triple]
    return [torch.cat([x[a:b] for a, b in ranges]) for x in flat]


def _put(wholes: Sequence[torch.Tensor], ranges: Ranges, parts: Sequence[Sequence[torch.Tensor]]) -> None:
    """``wholes[i][a:b] = part[i]`` for every range and its part (flat views)."""
    for (a, b), part in zip(ranges, parts):
        for whole, x in zip(wholes, part):
            _flat(whole)[a:b] = x.reshape(-1)


def _step(kernel: Any, variant: AdamVariant, ranges: Ranges, sources: Sequence[Sequence[torch.Tensor]],
          g: torch.Tensor, scalars: Any, results: Sequence[torch.Tensor], p_copy: torch.Tensor | None) -> None:
    """The step of the chunks ``ranges`` (``sources``: each one's ``p, m, v`` before) with ``g`` into
    ``results`` (and ``p_copy``), one kernel call."""
    dst, grad = [_flat(t) for t in results], _flat(g)
    copy = _flat(p_copy) if p_copy is not None else None
    kernel.step_many([StepCall(src[0].reshape(-1), grad[a:b], src[1].reshape(-1), src[2].reshape(-1), scalars,
                               (dst[0][a:b], dst[1][a:b], dst[2][a:b]), copy[a:b] if copy is not None else None)
                      for (a, b), src in zip(ranges, sources)], variant)
