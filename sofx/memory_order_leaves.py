"""Checked steps of leaves in a dense layout that is not contiguous, taken over their memory in memory order.

A checked step (``StepCall.skip``) flags chunks of ``FINITE_CHUNK`` elements, and a ``"chunk_snapshot"`` record
keeps the old values of the flagged ones (:mod:`sofx.skipped_chunks`): chunks are ranges of a leaf's memory. A
leaf whose ``p, g, m, v`` (and parameter copy) share one dense layout that is not contiguous (a transposed matrix,
a channels_last weight: :mod:`sofx.kernels.layout`) is stepped as the 1-d views of their memory
(:func:`~sofx.kernels.layout.in_memory_order`): contiguous tensors to every kernel and chunk function, no copy in
or back, and its chunks are ranges of its memory in memory order. :class:`sofx.Adam` makes such a leaf
(:func:`flat_leaf`; an undo+redo's record too, :func:`flat_record`) once it knows the step is checked, and puts
its results and record back into the leaf's shape (:func:`shaped_back`); the record keeps the gradient, whose
layout says which memory order its chunks index (an undo checks the leaf's tensors have it).

Elementwise, the order does not matter: the results are those of the same step on contiguous copies, bit for
bit; only the chunks that a spike or an inf flags differ (those of the memory order, not the logical one).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sofx.kernels.layout import in_memory_order, same_layout
from sofx.undo_record import LeafUndo

__all__ = ["flat_leaf", "flat_record", "shaped_back", "flat_checked", "put_back"]


def flat_leaf(leaf: Any, copy: torch.Tensor | None) -> tuple[Any, torch.Tensor | None]:
    """``leaf`` (a ``sofx.adam._Leaf`` whose ``p, g, m, v`` and ``copy`` share one dense layout) and ``copy`` as
    the 1-d views of their memory."""
    flat = leaf._replace(p=in_memory_order(leaf.p), g=in_memory_order(leaf.g), m=in_memory_order(leaf.m),
                         v=in_memory_order(leaf.v), plain=False)
    return flat, (in_memory_order(copy) if copy is not None else None)


def flat_record(rec: LeafUndo | None, like: torch.Tensor) -> LeafUndo | None | bool:
    """A record of a leaf of ``like``'s layout whose tensors are the 1-d views of theirs (a
    ``"chunk_snapshot"``'s kept chunks are packed already); None for None; False where its gradient or a whole
    snapshot has another layout (the leaf is then not stepped as its memory, nor checked in its kernel: its
    chunk flags would index its logical order)."""
    if rec is None:
        return None
    whole = [] if rec.strategy == "chunk_snapshot" else [rec.p_old, rec.m_old, rec.v_old]
    if not all(t is None or same_layout(t, like) for t in [rec.grad, *whole]):
        return False
    if rec.strategy != "chunk_snapshot":
        p_old, m_old, v_old = (None if t is None else in_memory_order(t) for t in whole)
    else:
        p_old, m_old, v_old = rec.p_old, rec.m_old, rec.v_old
    return LeafUndo(rec.strategy, in_memory_order(rec.grad), rec.scalars, rec.count_before, p_old, m_old, v_old,
                    rec.reason, rec.moments_were_zero, rec.chunks, rec.owns_kept)


def shaped_back(leaf: Any, results: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rec: LeafUndo | None,
                ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], LeafUndo | None]:
    """The results of a step of :func:`flat_leaf`'s leaf (1-d) and its record (made by the step: changed in
    place), in the shape and layout of the caller's ``leaf``: the caller's tensors where they are their memory
    (donation), else views of that layout (fresh outputs, a record's whole snapshots). A ``"chunk_snapshot"``'s
    kept chunks stay packed."""
    known = (leaf.p, leaf.m, leaf.v, leaf.g)
    back = tuple(_shaped(t, like, known) for t, like in zip(results, (leaf.p, leaf.m, leaf.v)))
    if rec is not None:
        rec.grad = _shaped(rec.grad, leaf.g, known)
        if rec.strategy != "chunk_snapshot":
            rec.p_old, rec.m_old, rec.v_old = (None if t is None else _shaped(t, like, known)
                                               for t, like in zip((rec.p_old, rec.m_old, rec.v_old),
                                                                  (leaf.p, leaf.m, leaf.v)))
    return back, rec


def _shaped(t: torch.Tensor, like: torch.Tensor, known: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``t`` (1-d: elements of ``like``'s layout in memory order) in ``like``'s shape: the tensor of ``known``
    (all of ``like``'s layout) whose memory it is, else a view of ``like``'s strides."""
    for x in known:
        if x.data_ptr() == t.data_ptr() and x.dtype == t.dtype and x.numel() == t.numel():
            return x
    return t.as_strided(like.shape, like.stride())


def flat_checked(leaves: Sequence[Any], copies: Sequence[torch.Tensor | None], checked: list[bool],
                 recs: Sequence[LeafUndo | None] | None = None,
                 ) -> tuple[list[Any], list[torch.Tensor | None], list[LeafUndo | None] | None, dict[int, Any]]:
    """The leaves whose step is checked in the kernel (``checked``, per leaf) and that are dense, not contiguous,
    as their memory's views (:func:`flat_leaf`; with an undo+redo's records ``recs``, :func:`flat_record` of
    each), in new lists: ``(leaves, copies, recs, shapes)``, ``shapes`` mapping each such index to the caller's
    leaf (:func:`put_back`). A leaf whose record has another layout stays as it is and is no longer checked in
    the kernel (``checked[k]`` set to False: its chunk flags would index its logical order)."""
    leaves, copies = list(leaves), list(copies)
    recs = None if recs is None else list(recs)
    shapes: dict[int, Any] = {}
    for k, chk in enumerate(checked):
        if not chk or leaves[k].p.is_contiguous():
            continue
        if recs is not None:
            flat = flat_record(recs[k], leaves[k].p)
            if flat is False:
                checked[k] = False
                continue
            recs[k] = flat
        shapes[k] = leaves[k]
        leaves[k], copies[k] = flat_leaf(leaves[k], copies[k])
    return leaves, copies, recs, shapes


def put_back(shapes: dict[int, Any], new_p: list[torch.Tensor], new_m: list[torch.Tensor], new_v: list[torch.Tensor],
             records: list[LeafUndo | None]) -> None:
    """The results (``new_p, new_m, new_v``) and records of the leaves :func:`flat_checked` flattened, in place in
    those lists, in their callers' shapes and layouts (:func:`shaped_back`)."""
    for k, leaf in shapes.items():
        (new_p[k], new_m[k], new_v[k]), records[k] = shaped_back(leaf, (new_p[k], new_m[k], new_v[k]), records[k])
