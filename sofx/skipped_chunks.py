"""Finishing a checked step whose kernel left chunks alone.

A checked step (``StepCall.skip``, ``UndoRedoCall.skip``; :data:`sofx.kernels.base.FINITE_CHUNK`) reads
each chunk of the gradient of the step it takes before writing the chunk and leaves a chunk with an inf
or a nan alone, or one whose inverse would be too lossy (:func:`sofx.kernels.base.lossy_elements`). No
(exact enough) algebraic inverse exists there, so :class:`sofx.Adam` gives such a leaf a snapshot
record: the functions here recover the values before the step for it, then step the skipped chunks,
which completes exactly the call an unchecked kernel would have made (the same bits). Rare: an overflow,
a gradient spike, the first steps of a run (a second moment still small by chance).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sofx.kernels.base import (FINITE_CHUNK, AdamVariant, StepCall, Triple, UndoCall, UndoRedoCall,
                               write_param_copy)
from sofx.undo_record import LeafUndo

__all__ = ["finish_step", "finish_undo_redo", "roll_back_step"]

_REASON = ("the gradient is not finite, or so large that its square could overflow (see GRADIENT_LIMIT), or it "
           "dominates the second moment somewhere: an algebraic inverse would restore it less exactly than 1e-6 "
           "(see sofx.kernels.base.lossy_factor)")

Ranges = Sequence[tuple[int, int]]


def finish_step(kernel: Any, variant: AdamVariant, inputs: Triple, call: StepCall, rec: LeafUndo, results: Triple,
                donate: bool) -> LeafUndo:
    """Finish ``update``'s checked step of one leaf (``inputs``: its ``p, m, v`` before, ``results`` the
    kernel's; ``rec``: the record made for it) and return the leaf's record, a snapshot of its old values.

    Without donation the old values are the inputs, untouched. With donation the skipped chunks still hold
    them; the stepped ones are recovered by the algebraic inverse (as an algebraic undo would) into new
    tensors. Then the skipped chunks are stepped from their old values."""
    ranges = _skipped(call.skip, results[0].numel())
    if donate:
        old = kernel.undo_many([UndoCall(results[0], call.g, results[1], results[2], rec.scalars, rec.p_old)],
                               variant)[0]
        _put(old, ranges, [tuple(_flat(t)[a:b] for t in results) for a, b in ranges])
        if rec.moments_were_zero:
            old[1].zero_()
            old[2].zero_()
        source = results
    else:
        old = source = inputs
    _step(kernel, variant, ranges, source, call.g, rec.scalars, results, call.p_copy)
    return LeafUndo("snapshot", call.g, rec.scalars, rec.count_before, *old, _REASON)


def finish_undo_redo(kernel: Any, variant: AdamVariant, inputs: Triple, call: UndoRedoCall, results: Triple,
                     donate: bool, count_before: torch.Tensor) -> LeafUndo:
    """Finish ``undo_redo``'s checked call of one leaf (the new gradient not finite in the skipped chunks;
    ``inputs``: its ``p', m', v'`` before the call) and return the record of the redone step, a snapshot
    of the undone values.

    Without donation the inputs are untouched: their undo gives exactly the values the fused kernel redid
    from. With donation the skipped chunks still hold the old step's values (undone here exactly so) and
    the others the redone ones, whose inverse recovers the undone values (as an algebraic undo would).
    Then the skipped chunks are stepped from their undone values with the new gradient."""
    ranges = _skipped(call.skip, results[0].numel())
    if donate:
        undone = kernel.undo_many([UndoCall(results[0], call.g_new, results[1], results[2], call.s_new)], variant)[0]
        p_old = _flat(call.p_old) if call.p_old is not None else None
        cur, g_old = [_flat(t) for t in results], _flat(call.g_old)
        parts = kernel.undo_many([UndoCall(cur[0][a:b], g_old[a:b], cur[1][a:b], cur[2][a:b], call.s_old,
                                           p_old[a:b] if p_old is not None else None) for a, b in ranges], variant)
        _put(undone, ranges, parts)
    else:
        undone = kernel.undo_many([UndoCall(inputs[0], call.g_old, inputs[1], inputs[2], call.s_old, call.p_old)],
                                  variant)[0]
    _step(kernel, variant, ranges, undone, call.g_new, call.s_new, results, call.p_copy)
    return LeafUndo("snapshot", call.g_new, call.s_new, count_before, *undone, _REASON)


def roll_back_step(kernel: Any, variant: AdamVariant, inputs: Triple, call: StepCall, rec: LeafUndo,
                   donate: bool) -> None:
    """Take back ``update``'s checked step of one leaf whose kernel left flagged chunks alone, without
    finishing it (:class:`~sofx.errors.SnapshotLimitError`: its snapshot would not fit).

    With donation the flagged chunks still hold their old values and the others are inverted in place (the
    test found their inverse sound: exact to a few ulps). Without donation the inputs are untouched. The
    parameter copy, which the kernel wrote outside the flagged chunks, gets the old parameter whole."""
    if donate:
        n = inputs[0].numel()
        stepped, at = [], 0
        for a, b in _skipped(call.skip, n) + [(n, n)]:
            if a > at:
                stepped.append((at, a))
            at = b
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


def _skipped(skip: torch.Tensor | None, n: int) -> list[tuple[int, int]]:
    """The element ranges of the flagged chunks."""
    assert skip is not None
    return [(c * FINITE_CHUNK, min(n, (c + 1) * FINITE_CHUNK)) for c in skip.nonzero().flatten().tolist()]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)  # the checked leaves are contiguous


def _put(wholes: Sequence[torch.Tensor], ranges: Ranges, parts: Sequence[Sequence[torch.Tensor]]) -> None:
    """``wholes[i][a:b] = part[i]`` for every range and its part (flat views)."""
    for (a, b), part in zip(ranges, parts):
        for whole, x in zip(wholes, part):
            _flat(whole)[a:b] = x


def _step(kernel: Any, variant: AdamVariant, ranges: Ranges, source: Sequence[torch.Tensor], g: torch.Tensor,
          scalars: Any, results: Sequence[torch.Tensor], p_copy: torch.Tensor | None) -> None:
    """The step of the chunks ``ranges`` from ``source``'s ``p, m, v`` with ``g`` into ``results`` (and
    ``p_copy``), one kernel call."""
    src, dst, grad = [_flat(t) for t in source], [_flat(t) for t in results], _flat(g)
    copy = _flat(p_copy) if p_copy is not None else None
    kernel.step_many([StepCall(src[0][a:b], grad[a:b], src[1][a:b], src[2][a:b], scalars,
                               (dst[0][a:b], dst[1][a:b], dst[2][a:b]), copy[a:b] if copy is not None else None)
                      for a, b in ranges], variant)
