"""What a call that writes tensors in place must refuse before it writes anything.

:meth:`sofx.Adam.update`, :meth:`~sofx.Adam.undo` and :meth:`~sofx.Adam.undo_redo`
write into the caller's tensors where asked: with ``donate=True`` into the
parameters and moments (``params``, ``state.mu``, ``state.nu``), and always into
``param_copies``. Before any kernel runs they refuse, with a
:class:`~sofx.errors.LeafError` naming the leaf path, a written tensor

- whose elements overlap each other (an ``expand()``-ed tensor:
  :func:`check_writable`);
- that is a leaf requiring grad while grad mode is on (autograd refuses
  in-place writes into it: :func:`check_writable`);
- that shares memory with any other tensor of the call, written or read (the
  gradients, the undo record's gradient and snapshots): the same tensor given
  twice (tied weights as two leaves), a gradient that is the parameter itself,
  a parameter copy that is the parameter, views that overlap
  (:meth:`MemorySpans.check_disjoint`).

Memory is compared as byte ranges: ``[data_ptr, data_ptr + nbytes)`` for a
contiguous tensor, its first element for a non-contiguous one (strided views
may interleave without sharing an element, e.g. ``x[0::2]`` and ``x[1::2]``;
such a view conflicts with a tensor that starts where it starts or a
contiguous one that covers its start). The ranges are sorted and swept with
torch operations (a model's hundreds of leaves cost a few torch calls, not a
Python loop over pairs).
"""

from __future__ import annotations

from array import array
from typing import Callable

import torch

from sofx.errors import LeafError

__all__ = ["check_writable", "MemorySpans"]


def check_writable(path: str, t: torch.Tensor) -> None:
    """Refuse a tensor that cannot be written in place: a leaf that requires grad (with grad mode on) or one
    whose elements overlap."""
    if t.requires_grad and t.is_leaf and torch.is_grad_enabled():
        raise LeafError(f"{path}: a leaf tensor that requires grad cannot be written in place (donate=True or "
                        "param_copies); pass it detached, call under torch.no_grad(), or do not donate it")
    if not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1:
        raise LeafError(f"{path}: its elements overlap in memory (e.g. an expand()-ed tensor), so it cannot be "
                        "written in place; pass a tensor with its own memory (.clone()) or do not donate it")


class MemorySpans:
    """The memory of a call's tensors, for :meth:`check_disjoint`: plain tensors (no ``torch.func`` wrappers),
    each with a tag that names it in an error."""

    def __init__(self) -> None:
        # (four lists, not a list of tuples: no tuple per tensor for the cycle collector to traverse, nor an
        # unzip of a thousand-argument zip)
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.written: list[bool] = []
        self.tags: list[int] = []

    def add(self, t: torch.Tensor, written: bool, tag: int) -> bool:
        """Add ``t``'s span; returns whether ``t`` is contiguous (a non-contiguous written tensor must also
        pass :func:`check_writable`)."""
        contiguous = t.is_contiguous()
        n = t.nbytes
        if n:
            s = t.data_ptr()
            self.starts.append(s)
            self.ends.append(s + n if contiguous else s + 1)
            self.written.append(written)
            self.tags.append(tag)
        return contiguous

    def check_disjoint(self, name: Callable[[int], str]) -> None:
        """Refuse (naming both by ``name(tag)``) a written tensor whose memory another one shares."""
        starts, ends, written = self.starts, self.ends, self.written
        if len(starts) < 2 or not any(written):
            return
        # (array -> frombuffer: torch.tensor parses a list of Python ints one by one, ~50x slower)
        s = torch.frombuffer(array("q", starts), dtype=torch.int64)
        e = torch.frombuffer(array("q", ends), dtype=torch.int64)
        w = torch.frombuffer(array("b", written), dtype=torch.bool)
        order = torch.argsort(s, stable=True)
        s, e, w = s[order], e[order], w[order]
        # the furthest end among the earlier spans, and among the earlier written ones
        zero = s.new_zeros(1)
        before = torch.cat([zero, torch.cummax(e, 0).values[:-1]])
        before_written = torch.cat([zero, torch.cummax(torch.where(w, e, 0), 0).values[:-1]])
        clash = (s < before_written) | (w & (s < before))
        if bool(clash.any()):
            self._raise(int(clash.nonzero()[0]), order.tolist(), name)

    def _raise(self, j: int, order: list[int], name: Callable[[int], str]) -> None:
        """The clash of the ``j``-th span in order of start: find the earlier span it overlaps."""
        a = order[j]
        for b in order[:j]:
            if self.starts[a] < self.ends[b] and (self.written[a] or self.written[b]):
                first, second = sorted((a, b))  # in the order the caller added them, a written one first
                if not self.written[first]:
                    first, second = second, first
                x, y = name(self.tags[first]), name(self.tags[second])
                raise LeafError(f"{x} and {y} share memory, and {x} is written in place (donate=True or "
                                "param_copies): the call would overwrite values it still reads; pass distinct "
                                "tensors (e.g. tied weights as one leaf) or do not donate")
        raise AssertionError("unreachable: a clash without an earlier overlapping span")
