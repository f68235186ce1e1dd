"""What a call that writes tensors in place must refuse before it writes anything.

:meth:`sofx.Adam.update`, :meth:`~sofx.Adam.undo` and :meth:`~sofx.Adam.undo_redo`
write into the caller's tensors where asked: with ``donate=True`` into the
parameters and moments (``params``, ``state.mu``, ``state.nu``), and always into
``param_copies``; a kernel's functions write their blocks' ``out`` and
``p_copy``. Before anything is written, a written tensor is refused

- whose elements overlap each other (an ``expand()``-ed tensor:
  :func:`check_writable`);
- that is a leaf requiring grad while grad mode is on (autograd refuses
  in-place writes into it), or an inference tensor outside inference mode:
  :func:`check_writable`, for a kernel's arguments :func:`check_written`;
- that shares memory with any other tensor of the call, written or read (the
  gradients, the undo record's gradient and snapshots): the same tensor given
  twice (tied weights as two leaves), a gradient that is the parameter itself,
  a parameter copy that is the parameter, views that overlap
  (:meth:`MemorySpans.check_disjoint`, :func:`first_clash`).

Memory is compared as byte ranges: ``[data_ptr, data_ptr + nbytes)`` for a
contiguous tensor (or a permutation of one: a transpose, channels_last); a
non-contiguous one is the contiguous runs its elements form (:func:`runs`:
a column slice of a matrix is a run per row, ``x[0::2]`` an element per run),
so strided views that interleave without sharing an element (``x[0::2]`` and
``x[1::2]``, two column blocks of one matrix) pass and views that share one
(a row and a column of one matrix) do not. A tensor of more than
``MAX_RUNS`` runs is taken as the whole range from its first element to its
last, which may refuse views that only interleave. A span is kept as twice
its start, plus one when the tensor is written, and twice its end; the spans
are sorted and swept once (in Python for a few, with torch operations for
many). The CPU
kernels' list forms do the same in their native code (``sofx_overlap``) from
the table of addresses they build anyway, which spares :class:`sofx.Adam` this
module's pass for a call they take whole.
"""

from __future__ import annotations

import bisect
import itertools
import math
from array import array
from typing import Any, Callable, Iterable, Sequence, Union

import torch

from sofx.errors import LeafError
from sofx.kernels.base import MemoryOverlapError, UndoRedoCall

__all__ = ["check_writable", "unwritable", "torch_refuses_write", "check_written", "may_refuse_write", "MemorySpans",
           "first_clash", "runs", "overlaps_itself", "overlap_message", "shared_memory_message",
           "kernel_shared_memory_message", "overlap_error",
           "same_memory", "blocks_clash", "call_block", "refuse_shared_memory", "MAX_RUNS"]

_FEW = 256  # spans swept in Python; more are sorted and swept with torch operations
MAX_RUNS = 1 << 20  # a non-contiguous tensor of more runs is compared as the range it spans

Spans = Union[Sequence[int], torch.Tensor]


def unwritable(path: str, t: torch.Tensor) -> str | None:
    """Why ``t`` (named ``path``) cannot be written in place, as an error message (what it is, what to pass
    instead), or None: what torch refuses to write (:func:`torch_refuses_write`), or a tensor whose elements
    overlap."""
    why = torch_refuses_write(path, t)
    if why is None and overlaps_itself(t):
        return f"{path}: {_OVERLAP}"
    return why


def torch_refuses_write(path: str, t: torch.Tensor) -> str | None:
    """Why torch refuses to write ``t`` (named ``path``) in place, as an error message (what it is, what to pass
    instead), or None: a leaf that requires grad or a view of one (with grad mode on: autograd refuses the
    write), an inference tensor outside inference mode (torch refuses its in-place update after writing it; a
    native kernel would write it anyway)."""
    base = t if t._base is None else t._base
    if t.requires_grad and base.is_leaf and torch.is_grad_enabled():
        kind = "a leaf tensor" if t is base else "a view of a leaf tensor"
        return (f"{path}: {kind} that requires grad cannot be written in place; pass it detached (.detach()) or "
                "call under torch.no_grad()")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return (f"{path}: an inference tensor (made under torch.inference_mode()) cannot be written in place "
                "outside inference mode; pass a .clone() made outside it or call under torch.inference_mode()")
    return None


def check_written(where: str, written: Iterable[tuple[str, Any]], autograd: bool = False) -> None:
    """Refuse (a :class:`LeafError` naming the call ``where`` and the argument) a tensor a kernel call would write
    (``written``: ``(name, tensor or None)``) that torch refuses to write in place (:func:`torch_refuses_write`),
    before the call writes anything: its backends write raw memory, or write with torch, which raises only after
    writing it. Unless the backend writes through torch (``autograd``: autograd records its writes, as the
    reference's), also any tensor that requires grad while grad mode is on: a raw write leaves it the history of
    its old values, so that a backward through it would give their gradient. Whether its elements overlap is the
    call's memory check's (:class:`MemorySpans`). Not under ``torch.compile`` (its tracing has its own rules for
    writes, as :meth:`sofx.Adam.update`'s checks)."""
    if torch.compiler.is_compiling():
        return
    for name, t in written:
        if isinstance(t, torch.Tensor):
            path = f"{where}: {name}"
            why = torch_refuses_write(path, t)
            if why is None and not autograd and t.requires_grad and torch.is_grad_enabled():
                why = (f"{path}: a tensor that requires grad cannot be written by these kernels while grad mode is "
                       "on (autograd does not see their writes: it would keep the history of the old values); pass "
                       "it detached (.detach()), call under torch.no_grad() or use the reference backend")
            if why is not None:
                raise LeafError(why)


def may_refuse_write(written: Iterable[torch.Tensor | None]) -> bool:
    """Whether :func:`check_written` may refuse one of ``written`` (None where absent): one requires grad while
    grad mode is on, or is an inference tensor outside inference mode. A few attribute reads per tensor, for a
    kernel's common case (the full check where this is True)."""
    grad = torch.is_grad_enabled()
    outside = not torch.is_inference_mode_enabled()
    for t in written:
        if t is not None and ((grad and t.requires_grad) or (outside and t.is_inference())):
            return True
    return False


def check_writable(path: str, t: torch.Tensor) -> None:
    """Refuse (a :class:`LeafError`) a tensor a call would write in place that cannot be: :func:`unwritable`."""
    why = unwritable(path, t)
    if why is not None:
        raise LeafError(f"{why}, or do not donate it (donate=True and param_copies write in place)")


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (e.g. ``expand()``, a zero stride): not writable in place."""
    return not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1


_OVERLAP = ("its elements overlap in memory (e.g. an expand()-ed tensor), so it cannot be written in place; pass a "
            "tensor with its own memory (.clone())")


def overlap_message(path: str) -> str:
    """The error for a written leaf at ``path`` whose elements overlap in memory."""
    return f"{path}: {_OVERLAP} or do not donate it"


def shared_memory_message(written: str, other: str) -> str:
    """The error for a leaf written in place (``written``) that shares memory with another of the call."""
    return (f"{written} and {other} share memory, and {written} is written in place (donate=True or "
            "param_copies): the call would overwrite values it still reads; pass distinct tensors (e.g. tied "
            "weights as one leaf) or do not donate")


def kernel_shared_memory_message(written: str, other: str) -> str:
    """The error of a kernel call whose written array (``written``: an ``out[k]`` that is not the input it
    replaces, a donated input, ``p_copy``, ``skip``, a chunk list's ``kept[k]``) shares memory with another of its
    arrays, in the call's own terms (:func:`shared_memory_message` is the pytree layer's, in terms of donation)."""
    return (f"{written} and {other} share memory, and {written} is written by the call: it would overwrite values "
            "it still reads; pass arrays with memory of their own (an out[k] may be the very input it replaces, "
            "nothing else of the call)")


def overlap_error(first: tuple[int, str], second: tuple[int, str], where: Sequence[str]) -> MemoryOverlapError:
    """The error of a list form whose call ``first[0]``'s array ``first[1]`` (written) shares memory with call
    ``second[0]``'s ``second[1]`` (the same array: its elements overlap); ``where[i]`` names call i. In the kernel
    call's terms (:func:`kernel_shared_memory_message`; the pytree layer words what it catches its own way)."""
    a, b = f"{where[first[0]]}: {first[1]}", f"{where[second[0]]}: {second[1]}"
    return MemoryOverlapError(f"{a}: {_OVERLAP}" if a == b else kernel_shared_memory_message(a, b), first, second)


def same_memory(out: Any, t: Any) -> bool:
    """Whether ``out`` is ``t``'s own memory (donation; possibly another view object of it)."""
    return out is t or (isinstance(out, torch.Tensor) and isinstance(t, torch.Tensor) and out.dtype == t.dtype
                        and out.data_ptr() == t.data_ptr() and out.shape == t.shape and out.stride() == t.stride())


# One block of a kernel call for :func:`blocks_clash`: its inputs ``(role, tensor or None)`` (those named "p", "m",
# "v" written where ``out`` donates them), its ``out`` (or None) and the other arrays it writes (``p_copy``, ``skip``)
Block = tuple[Sequence[tuple[str, Any]], Union[Sequence[Any], None], Sequence[tuple[str, Any]]]
_DONATED = ("p", "m", "v")  # the inputs out[0], out[1], out[2] replace
_OUT_ROLES = ("out[0]", "out[1]", "out[2]")


def blocks_clash(blocks: Sequence[Block]) -> tuple[tuple[int, str], tuple[int, str]] | None:
    """``(block, role)`` of a written array of a kernel call and of another that shares its memory, or None (the
    same pair twice for a written array whose elements overlap): ``out[k]`` is written, and named so, unless it is
    the input it replaces (:func:`same_memory`: then that input is written), and so are the other written arrays.
    Tensors without memory of their own here are left out (meta tensors, ``torch.func`` wrappers: the pytree
    layer compares what they wrap), and under ``torch.compile`` nothing is compared."""
    if torch.compiler.is_compiling():
        return None
    read: list[tuple[int, str, Any]] = []  # (block, role, tensor or None)
    written: list[tuple[int, str, Any]] = []
    for i, (inputs, out, others) in enumerate(blocks):
        donated = _donated(inputs, out)
        for role, t in inputs:
            (written if role in donated else read).append((i, role, t))
        if out is not None:
            written += [(i, _OUT_ROLES[k], o) for k, o in enumerate(out) if _DONATED[k] not in donated]
        written += [(i, role, t) for role, t in others]
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    read = [x for x in read if isinstance(x[2], torch.Tensor) and not x[2].is_meta and not wrapped(x[2])]
    written = [x for x in written if isinstance(x[2], torch.Tensor) and not x[2].is_meta and not wrapped(x[2])]
    for i, role, t in written:
        if overlaps_itself(t):
            return (i, role), (i, role)
    spans = MemorySpans()
    for group, w in ((read, False), (written, True)):
        spans.add([t for _, _, t in group], w, lambda j, group=group: group[j][:2])
    return spans.clash(lambda tag: f"block {tag[0]}: {tag[1]}")


def _donated(inputs: Sequence[tuple[str, Any]], out: Sequence[Any] | None) -> tuple[str, ...]:
    """The roles among ``"p", "m", "v"`` whose input ``out`` replaces in place (:func:`same_memory`)."""
    if out is None:
        return ()
    role_of = dict(inputs)
    pmv = [role_of.get(role) for role in _DONATED]
    if out[0] is pmv[0] and out[1] is pmv[1] and out[2] is pmv[2]:  # (the common case)
        return _DONATED
    return tuple(role for role, o, t in zip(_DONATED, out, pmv) if same_memory(o, t))


def call_block(c: Any) -> Block:
    """A :class:`~sofx.kernels.base.StepCall`, :class:`~sofx.kernels.base.UndoCall` or
    :class:`~sofx.kernels.base.UndoRedoCall` as a block of :func:`blocks_clash` (its roles in the order the cpu
    backend's table holds them, so that every backend names the same pair)."""
    if isinstance(c, UndoRedoCall):
        inputs = [("p", c.p), ("g_old", c.g_old), ("m", c.m), ("v", c.v), ("g_new", c.g_new), ("p_old", c.p_old)]
    else:
        inputs = [("p", c.p), ("g", c.g), ("m", c.m), ("v", c.v), ("p_old", getattr(c, "p_old", None))]
    return inputs, c.out, [("p_copy", c.p_copy), ("skip", getattr(c, "skip", None))]


def refuse_shared_memory(calls: Sequence[Any], where: Sequence[str]) -> None:
    """Raise :class:`MemoryOverlapError` (:func:`overlap_error`; ``where[i]`` names call i) where a written array
    of ``calls`` (kernel calls, :func:`call_block`) shares memory with another array of theirs
    (:func:`blocks_clash`), before anything is written: an ``out`` or ``p_copy`` overlapping a gradient, another
    output, another block's array, or its own elements (``expand()``)."""
    found = blocks_clash([call_block(c) for c in calls])
    if found is not None:
        raise overlap_error(*found, where)


def runs(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The memory of ``t``'s elements as runs of one length: the byte offsets of their starts from
    ``t.data_ptr()`` (an int64 tensor) and that length in bytes; None where there are more than
    :data:`MAX_RUNS` of them.

    The strides are taken from the smallest up: while a dimension's stride is the run's length so far, the
    run extends over it (a permuted contiguous tensor is one run); the remaining dimensions place the runs.
    Dimensions of size 1 or stride 0 (``expand()``) add no memory and are left out."""
    size = t.element_size()
    dims = sorted((stride, n) for stride, n in zip(t.stride(), t.shape) if n > 1 and stride != 0)
    length, k = size, 0
    while k < len(dims) and dims[k][0] * size == length:
        length *= dims[k][1]
        k += 1
    outer = dims[k:]
    if math.prod(n for _, n in outer) > MAX_RUNS:
        return None
    starts = torch.zeros(1, dtype=torch.int64)
    for stride, n in outer:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * (stride * size)).reshape(-1)
    return starts, length


def _extent(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to the end of its last (strides are not negative in torch)."""
    return (sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


def first_clash(starts2: Spans, ends2: Spans) -> tuple[int, int] | None:
    """Spans as twice the start (+1: written) and twice the end, as lists or int64 tensors: ``(a, b)``, the
    indices of two overlapping spans of which one is written (``a`` the first written one in the order of the
    arguments), or None."""
    n = len(starts2)
    if n < 2:
        return None
    if n <= _FEW:
        starts2 = starts2.tolist() if isinstance(starts2, torch.Tensor) else starts2
        ends2 = ends2.tolist() if isinstance(ends2, torch.Tensor) else ends2
        order = sorted(range(n), key=starts2.__getitem__)
        reach = reach_written = -1
        for j, i in enumerate(order):
            s2 = starts2[i]
            w = s2 & 1
            if s2 - w < reach_written or (w and s2 - w < reach):
                return _pair(order, j, starts2, ends2)
            reach = max(reach, ends2[i])
            if w:
                reach_written = max(reach_written, ends2[i])
        return None
    s2 = torch.as_tensor(starts2, dtype=torch.int64)
    e2 = torch.as_tensor(ends2, dtype=torch.int64)
    order = torch.argsort(s2)  # (the same address written and read: read first)
    ss, es = s2[order], e2[order]
    w = (ss & 1).bool()
    # twice the address against twice the furthest end among the earlier spans, and the earlier written ones
    zero = ss.new_zeros(1)
    before = torch.cat([zero, torch.cummax(es, 0).values[:-1]])
    before_written = torch.cat([zero, torch.cummax(torch.where(w, es, 0), 0).values[:-1]])
    clash = (ss - w.long() < before_written) | (w & (ss - 1 < before))
    if not bool(clash.any()):
        return None
    return _pair(order.tolist(), int(clash.nonzero()[0]), s2.tolist(), e2.tolist())


def _pair(order: list[int], j: int, starts2: Sequence[int], ends2: Sequence[int]) -> tuple[int, int]:
    """The clash of the ``j``-th span in ``order``: the earlier span it overlaps, the written one first (the
    first in the arguments' order when both are)."""
    a = order[j]
    start = starts2[a] & ~1
    for b in order[:j]:
        if start < ends2[b] and (starts2[a] & 1 or starts2[b] & 1):
            first, second = sorted((a, b))
            return (first, second) if starts2[first] & 1 else (second, first)
    raise AssertionError("unreachable: a clash without an earlier overlapping span")


class MemorySpans:
    """The memory of a call's tensors, for :meth:`clash`: plain tensors (no ``torch.func`` wrappers), added in
    groups (each a list of tensors, all written or all read, and a function giving its i-th one's tag)."""

    def __init__(self) -> None:
        self._groups: list[tuple[Sequence[torch.Tensor], bool, Callable[[int], Any]]] = []

    def add(self, tensors: Sequence[torch.Tensor], written: bool, tag: Callable[[int], Any]) -> None:
        """One group of the call's tensors: all written (``written=True``) or all read; ``tag(i)`` names the i-th."""
        self._groups.append((tensors, written, tag))

    def clash(self, name: Callable[[Any], str]) -> tuple[Any, Any] | None:
        """The tags of a written tensor and another whose memory it shares (see :func:`first_clash`), or None.
        A non-contiguous written tensor whose elements overlap is refused here (:func:`check_writable`,
        named by ``name(tag)``); whether a written tensor requires grad is the caller's to check."""
        ptrs, sizes, counts = array("q"), array("q"), []
        strided: dict[int, torch.Tensor] = {}  # the non-contiguous tensors, by their index among all
        any_written = False
        for tensors, written, tag in self._groups:
            contiguous = [t.is_contiguous() for t in tensors]
            if not all(contiguous):
                for i, c in enumerate(contiguous):
                    if not c:
                        if written:
                            check_writable(name(tag(i)), tensors[i])
                        strided[len(ptrs) + i] = tensors[i]
            # list comprehensions over the group: a method call per tensor cost ~3x more
            ptrs.extend([t.data_ptr() for t in tensors])
            sizes.extend([t.nbytes for t in tensors])
            counts.append(len(tensors))
            any_written |= written and len(tensors) > 0
        if len(ptrs) < 2 or not any_written:
            return None
        offsets = list(itertools.accumulate(counts, initial=0))
        if strided:
            starts2, ends2, where = self._spans_with_runs(ptrs, sizes, offsets, strided)
        elif len(ptrs) <= _FEW:
            starts2, ends2, where = [], [], []
            for (_, written, _), lo, hi in zip(self._groups, offsets, offsets[1:]):
                for i in range(lo, hi):
                    if sizes[i]:
                        starts2.append(2 * ptrs[i] + written)
                        ends2.append(2 * (ptrs[i] + sizes[i]))
                        where.append(i)
        else:
            p = torch.frombuffer(ptrs, dtype=torch.int64)  # (torch.tensor parses a list one int at a time)
            n = torch.frombuffer(sizes, dtype=torch.int64)
            w = torch.cat([torch.full((k,), bool(written)) for (_, written, _), k in zip(self._groups, counts)])
            keep = (n > 0).nonzero().squeeze(1)
            starts2 = (2 * p + w)[keep]
            ends2 = (2 * (p + n))[keep]
            where = keep
        found = first_clash(starts2, ends2)
        if found is None:
            return None
        tags = []
        for k in found:
            i = int(where[k])
            g = bisect.bisect_right(offsets, i) - 1
            tags.append(self._groups[g][2](i - offsets[g]))
        return tags[0], tags[1]

    def _spans_with_runs(self, ptrs: array, sizes: array, offsets: list[int], strided: dict[int, torch.Tensor],
                         ) -> tuple[Spans, Spans, Spans]:
        """The spans (twice the start, +1 where written; twice the end) and the index of the tensor of each,
        in the tensors' order: a contiguous tensor's memory, a non-contiguous one's runs (:func:`runs`; the
        range it spans where it has too many)."""
        starts: list[int] = []
        ends: list[int] = []
        where: list[int] = []
        for (_, written, _), lo, hi in zip(self._groups, offsets, offsets[1:]):
            for i in range(lo, hi):
                if not sizes[i]:
                    continue
                t = strided.get(i)
                found = runs(t) if t is not None else None
                if found is None:  # contiguous, or too many runs: one span
                    length = _extent(t) if t is not None else sizes[i]
                    starts.append(2 * ptrs[i] + written)
                    ends.append(2 * (ptrs[i] + length))
                    where.append(i)
                else:
                    first, length = found
                    first = (first + ptrs[i]).tolist()
                    starts.extend([2 * a + written for a in first])
                    ends.extend([2 * (a + length) for a in first])
                    where.extend([i] * len(first))
        if len(starts) <= _FEW:
            return starts, ends, where
        return (torch.tensor(starts, dtype=torch.int64), torch.tensor(ends, dtype=torch.int64),
                torch.tensor(where, dtype=torch.int64))

    def check_disjoint(self, name: Callable[[Any], str]) -> None:
        """Raise a :class:`LeafError` naming both (``name(tag)``) for :meth:`clash`'s pair."""
        found = self.clash(name)
        if found is not None:
            raise LeafError(shared_memory_message(name(found[0]), name(found[1])))
