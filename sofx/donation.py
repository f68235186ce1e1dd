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

import bisect
import itertools
from array import array
from typing import Callable, Sequence

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
    added in groups (each a list of tensors, all written or all read, and a function naming its i-th)."""

    def __init__(self) -> None:
        self._groups: list[tuple[Sequence[torch.Tensor], bool, Callable[[int], str]]] = []

    def add(self, tensors: Sequence[torch.Tensor], written: bool, name: Callable[[int], str]) -> None:
        self._groups.append((tensors, written, name))

    def check_disjoint(self) -> None:
        """Refuse a written tensor whose memory another tensor shares, or whose elements overlap (a
        non-contiguous one, :func:`check_writable`; whether a written tensor requires grad is the caller's to
        check)."""
        # Spans are twice the addresses, the low bit of a start saying whether the tensor is written.
        starts, ends, where = [], [], []  # where: the index of each span's tensor, all groups in order
        ptrs, sizes, flat, groups = array("q"), array("q"), array("b"), []  # groups: (written, count)
        for gi, (tensors, written, name) in enumerate(self._groups):
            contiguous = [t.is_contiguous() for t in tensors]
            if written and not all(contiguous):
                for i, c in enumerate(contiguous):
                    if not c:
                        check_writable(name(i), tensors[i])
            # list comprehensions over the group: a method call per tensor cost ~3x more
            ptrs.extend([t.data_ptr() for t in tensors])
            sizes.extend([t.nbytes for t in tensors])
            flat.extend(contiguous)
            groups.append((written, len(tensors)))
        total = len(ptrs)
        if total < 2 or not any(w and n for w, n in groups):
            return
        self._offsets = list(itertools.accumulate((n for _, n in groups), initial=0))
        if total <= _FEW:
            for gi, (w, n) in enumerate(groups):
                for i in range(self._offsets[gi], self._offsets[gi] + n):
                    if sizes[i]:
                        starts.append(2 * ptrs[i] + w)
                        ends.append(2 * (ptrs[i] + sizes[i]) if flat[i] else 2 * ptrs[i] + 2)
                        where.append(i)
            self.starts, self.ends, self._where = starts, ends, where
            self._sweep(sorted(range(len(starts)), key=starts.__getitem__))
            return
        p = torch.frombuffer(ptrs, dtype=torch.int64)  # (torch.tensor parses a list one int at a time)
        n = torch.frombuffer(sizes, dtype=torch.int64)
        c = torch.frombuffer(flat, dtype=torch.bool)
        w = torch.cat([torch.full((k,), bool(wr)) for wr, k in groups])
        keep = (n > 0).nonzero().squeeze(1)
        s2 = (2 * p + w)[keep]
        e2 = torch.where(c, 2 * (p + n), 2 * p + 2)[keep]
        order = torch.argsort(s2)  # (the same address written and read: read first)
        s2, e2, w = s2[order], e2[order], w[keep][order]
        # twice the address against twice the furthest end among the earlier spans, and the earlier written ones
        zero = s2.new_zeros(1)
        before = torch.cat([zero, torch.cummax(e2, 0).values[:-1]])
        before_written = torch.cat([zero, torch.cummax(torch.where(w, e2, 0), 0).values[:-1]])
        clash = (s2 - w.long() < before_written) | (w & (s2 - 1 < before))
        if bool(clash.any()):
            self.starts, self.ends = s2.tolist(), e2.tolist()
            self._where = keep[order].tolist()
            self._raise(int(clash.nonzero()[0]), list(range(len(self.starts))))

    def _name(self, span: int) -> str:
        i = self._where[span]
        gi = bisect.bisect_right(self._offsets, i) - 1
        return self._groups[gi][2](i - self._offsets[gi])

    def _sweep(self, order: list[int]) -> None:
        """check_disjoint's sweep in Python (a few spans: a dozen torch calls would cost more)."""
        reach = reach_written = -1
        for j, i in enumerate(order):
            s2, e2 = self.starts[i], self.ends[i]
            w = s2 & 1
            s2 -= w
            if s2 < reach_written or (w and s2 < reach):
                self._raise(j, order)
            if e2 > reach:
                reach = e2
            if w and e2 > reach_written:
                reach_written = e2

    def _raise(self, j: int, order: list[int]) -> None:
        """The clash of the ``j``-th span in order of start: find the earlier span it overlaps."""
        a = order[j]
        sa, wa = self.starts[a] & ~1, self.starts[a] & 1
        for b in order[:j]:
            if sa < self.ends[b] and (wa or self.starts[b] & 1):
                first, second = sorted((a, b), key=self._where.__getitem__)  # the caller's order, written first
                if not self.starts[first] & 1:
                    first, second = second, first
                x, y = self._name(first), self._name(second)
                raise LeafError(f"{x} and {y} share memory, and {x} is written in place (donate=True or "
                                "param_copies): the call would overwrite values it still reads; pass distinct "
                                "tensors (e.g. tied weights as one leaf) or do not donate")
        raise AssertionError("unreachable: a clash without an earlier overlapping span")
