"""Blocks whose tensors share one dense layout are stepped in memory order.

Adam is elementwise: a block's ``p, g, m, v`` (and its outputs, old values, parameter copy) can be visited in
any order, as long as every tensor visits the same elements in it. A tensor whose elements fill its memory span
exactly, in some order of its dimensions (*dense*: ``t.t()`` of a contiguous matrix, a channels_last
convolution weight), holds element ``k`` of its span at address ``data_ptr() + k * element_size()``; tensors of
one shape and the same strides (:func:`same_layout`) hold the same logical element at the same ``k``. So the
kernels run such a block over the memory spans as they do over contiguous tensors: no copy in, no copy back.
(A transposed 4096 x 4096 leaf took 50-75x a contiguous one's update through copies.) Autograd gives a
parameter of a dense layout gradients of that layout, and ``zeros_like`` moments of it.

Where the layouts differ the kernels copy the other tensors into a dense parameter's layout and run the block
over the memory spans as above (:func:`spans_after_copies`: its fresh results keep the parameter's layout, as the
reference's do); where the parameter is not dense (a slice with gaps), every tensor into a contiguous one. A
checked step's chunks (``FINITE_CHUNK`` flags) are ranges of contiguous memory: :class:`sofx.Adam` gives the
kernels such a leaf's 1-d memory views for it (:mod:`sofx.memory_order_leaves`), so its chunks are ranges of its
memory order.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["is_dense", "same_layout", "in_memory_order", "dims_in_memory_order", "one_dense_layout",
           "all_contiguous_alike", "spans_in_memory_order", "spans_after_copies", "in_layout_of"]


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span exactly (non-overlapping, no gaps), in some order of its
    dimensions: its strides, sorted, are those of a contiguous tensor of its sizes so ordered (dimensions of
    size 1 have no say). Contiguous tensors are dense; so is an empty one."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(t: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``t`` visits its elements in ``like``'s memory order: the same shape and, on every dimension of
    more than one element, the same stride (then both dense if either is)."""
    if t.shape != like.shape:
        return False
    return all(a == b for a, b, size in zip(t.stride(), like.stride(), t.shape) if size != 1)


def in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """A dense ``t`` as a 1-d view of its memory span, in memory order (``t.view(-1)`` where contiguous); a
    tensor that is not dense is refused (its span holds other memory too)."""
    if t.is_contiguous():
        return t.view(-1)
    if not is_dense(t):
        raise ValueError(f"in_memory_order: a tensor of shape {tuple(t.shape)} and strides {t.stride()} is not "
                         "dense")
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def dims_in_memory_order(t: torch.Tensor) -> list[int]:
    """The dimensions of a dense ``t``, outermost first: by stride, largest first (ties, which only dimensions of
    size 1 can have, by index), so that ``t.permute(order)`` is contiguous, a view of ``t``'s memory span in
    memory order (``[0, 2, 3, 1]``, NHWC, for a channels_last weight; ``list(range(t.dim()))`` where ``t`` is
    contiguous). A tensor that is not dense is refused."""
    if t.is_contiguous():
        return list(range(t.dim()))
    if not is_dense(t):
        raise ValueError(f"dims_in_memory_order: a tensor of shape {tuple(t.shape)} and strides {t.stride()} is "
                         "not dense")
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def one_dense_layout(p: torch.Tensor, others: Iterable[torch.Tensor | None]) -> bool:
    """Whether ``p`` is dense and every tensor of ``others`` (None where absent) of its layout: contiguous
    tensors all, or tensors whose memory order is one (:func:`in_memory_order` views them alike).

    The common case first (:func:`all_contiguous_alike`, a few attribute reads a tensor: this runs for every
    leaf of every checked update), then :func:`same_layout`'s strides."""
    others = tuple(others)
    return all_contiguous_alike(p, others) or (is_dense(p) and all(t is None or same_layout(t, p) for t in others))


def all_contiguous_alike(p: torch.Tensor, others: Iterable[torch.Tensor | None]) -> bool:
    """Whether ``p`` has an element, is contiguous, and every tensor of ``others`` (None where absent) is
    contiguous of ``p``'s shape: then ``p`` is dense and each of them :func:`same_layout` as ``p`` (contiguous
    tensors of one shape have the same stride on every dimension of more than one element; not so for empty
    ones, which torch calls contiguous whatever their strides). False says nothing."""
    if not (p.is_contiguous() and p.numel()):
        return False
    shape = p.shape
    for t in others:
        if t is not None and not (t.is_contiguous() and t.shape == shape):
            return False
    return True


def spans_in_memory_order(p: torch.Tensor, others: Iterable[torch.Tensor | None],
                          skip: torch.Tensor | None = None) -> bool:
    """Whether a kernel block (parameter ``p``, its other tensors ``others``, None where absent) is run over its
    memory spans in memory order rather than through contiguous copies: ``p`` not contiguous, of one dense layout
    with the others (:func:`one_dense_layout`), and the call unchecked (``skip`` None: a checked call's chunk
    flags index the order of its callers' slices; :mod:`sofx.memory_order_leaves` gives such calls the memory's
    1-d views)."""
    return skip is None and not p.is_contiguous() and one_dense_layout(p, others)


def spans_after_copies(p: torch.Tensor, skip: torch.Tensor | None = None) -> bool:
    """Whether a kernel block that :func:`spans_in_memory_order` does not take as it is (a tensor of another
    layout than ``p``'s: a contiguous gradient of a transposed parameter, say) is run over its memory spans once
    those tensors are copied into ``p``'s layout (:func:`in_layout_of`), rather than through contiguous copies of
    all: ``p`` dense, not contiguous, the call unchecked. Its fresh results then have ``p``'s layout, as the
    reference's have (a parameter keeps its layout across a step, as with torch.optim's steps in place), and
    ``p`` itself is not copied."""
    return skip is None and not p.is_contiguous() and is_dense(p)


def in_layout_of(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in dense ``like``'s layout: ``t`` itself where it has it (:func:`same_layout`), else a copy of it of
    that layout (``like``'s strides, ``t``'s dtype)."""
    if same_layout(t, like):
        return t
    return torch.empty_like(like, dtype=t.dtype).copy_(t)  # (empty_like keeps a dense tensor's strides)
