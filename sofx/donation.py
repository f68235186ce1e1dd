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
contiguous one that covers its start). The ranges are sorted and swept once
(in Python for a few, with torch operations for a model's hundreds of leaves).
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


_FEW = 256  # spans swept in Python; more are sorted and swept with torch operations


class MemorySpans:
    """The memory of a call's tensors, for :meth:`check_disjoint`: plain tensors (no ``torch.func`` wrappers),
    numbered in the order they are added (the numbers name them in an error)."""

    def __init__(self) -> None:
        # Two arrays of twice the addresses, the low bit of a start saying whether the tensor is written (no
        # Python object per tensor for the cycle collector; torch reads the arrays as they are). ``numbers``:
        # each span's number (tensors without elements have none).
        self.starts = array("q")
        self.ends = array("q")
        self.numbers = array("q")
        self.count = 0
        self.any_written = False

    def add(self, t: torch.Tensor, written: bool) -> bool:
        """Add ``t`` (its number is the count of tensors added before); returns whether it is contiguous (a
        non-contiguous written tensor must also pass :func:`check_writable`)."""
        contiguous = t.is_contiguous()
        n = t.nbytes
        if n:
            s = t.data_ptr()
            self.starts.append(2 * s + written)
            self.ends.append(2 * (s + n if contiguous else s + 1))
            self.numbers.append(self.count)
            self.any_written |= written
        self.count += 1
        return contiguous

    def add_leaf(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                 written: bool) -> bool:
        """:meth:`add` of a leaf's parameter, moments (``written``) and gradient (read; None: none, and no
        number taken); whether the first three are contiguous."""
        contiguous = self.add(p, written)
        contiguous &= self.add(m, written)
        contiguous &= self.add(v, written)
        if g is not None:
            self.add(g, False)
        return contiguous

    def check_disjoint(self, name: Callable[[int], str]) -> None:
        """Refuse (naming both by ``name(number)``) a written tensor whose memory another one shares."""
        starts = self.starts
        if len(starts) < 2 or not self.any_written:
            return
        if len(starts) <= _FEW:
            self._sweep(sorted(range(len(starts)), key=starts.__getitem__), name)
            return
        # (frombuffer: torch.tensor parses a list of Python ints one by one, ~50x slower)
        s2 = torch.frombuffer(starts, dtype=torch.int64)
        e2 = torch.frombuffer(self.ends, dtype=torch.int64)
        order = torch.argsort(s2)  # (ties: the same address written and read sort read first)
        s2, e2 = s2[order], e2[order]
        w = (s2 & 1).bool()
        # twice the address against twice the furthest end among the earlier spans, and the earlier written ones
        zero = s2.new_zeros(1)
        before = torch.cat([zero, torch.cummax(e2, 0).values[:-1]])
        before_written = torch.cat([zero, torch.cummax(torch.where(w, e2, 0), 0).values[:-1]])
        clash = (s2 - w.long() < before_written) | (w & (s2 - 1 < before))
        if bool(clash.any()):
            self._raise(int(clash.nonzero()[0]), order.tolist(), name)

    def _sweep(self, order: list[int], name: Callable[[int], str]) -> None:
        """check_disjoint's sweep in Python (a few spans: a dozen torch calls would cost more)."""
        reach = reach_written = -1
        for j, i in enumerate(order):
            s2, e2 = self.starts[i], self.ends[i]
            w = s2 & 1
            s2 -= w
            if s2 < reach_written or (w and s2 < reach):
                self._raise(j, order, name)
            if e2 > reach:
                reach = e2
            if w and e2 > reach_written:
                reach_written = e2

    def _raise(self, j: int, order: list[int], name: Callable[[int], str]) -> None:
        """The clash of the ``j``-th span in order of start: find the earlier span it overlaps."""
        a = order[j]
        sa, wa = self.starts[a] & ~1, self.starts[a] & 1
        for b in order[:j]:
            if sa < self.ends[b] and (wa or self.starts[b] & 1):
                first, second = sorted((a, b))  # in the order the caller added them, a written one first
                if not self.starts[first] & 1:
                    first, second = second, first
                x, y = name(self.numbers[first]), name(self.numbers[second])
                raise LeafError(f"{x} and {y} share memory, and {x} is written in place (donate=True or "
                                "param_copies): the call would overwrite values it still reads; pass distinct "
                                "tensors (e.g. tied weights as one leaf) or do not donate")
        raise AssertionError("unreachable: a clash without an earlier overlapping span")
