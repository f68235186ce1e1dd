"""Calls on the listed chunks of a block: a step or an undo+redo of some chunks of :data:`FINITE_CHUNK`
elements, the rest of the block left alone.

A checked step leaves the chunks it flags alone (:data:`~sofx.kernels.base.FINITE_CHUNK`); finishing it
(:mod:`sofx.skipped_chunks`) copies those chunks' old values out and steps them, and an undo+redo of such a
record (a ``"chunk_snapshot"``) steps the kept chunks from their old values and undoes and redoes the others.
A :class:`ChunkedCall` says each of those in one block, whatever the number of chunks::

    for each listed chunk c (ascending), elements [a, b) of the block (b - a = FINITE_CHUNK but for the
    block's last chunk), at position [k, k + b - a) of the listed chunks one after another:
        kept[i][k : k + b - a] = src[i][at]            (with kept; src = call.p, m, v)
        the call's function on elements [a, b): its inputs p, m, v at [k, k + b - a) with packed, else [a, b);
        every other array (gradients, p_old, out, p_copy, skip's flags) at [a, b)

Backends whose ``RUNS_CHUNK_LISTS`` is True run a list of them in one call of their native code
(``step_chunks``, ``undo_redo_chunks``: :mod:`sofx.kernels.cpu`; ``prepare_chunks``: the same checked first,
run later, so that :func:`sofx.skipped_chunks.run_chunked` checks every list before it runs any);
:func:`range_calls` gives any backend the same as calls of its list form over the runs of adjacent listed chunks
(one block per run).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from sofx.errors import LeafError
from sofx.kernels.base import (FINITE_CHUNK, AdamScalars, AdamVariant, StepCall, Triple, UndoRedoCall,
                               check_float_tensor, refuse_traced)
from sofx.kernels.donation import MemorySpans, check_written, overlap_error, same_memory
from sofx.kernels.layout import in_memory_order
from sofx.kernels.storage import refuse_short_storage
from sofx.kernels.reference import concrete_checked

__all__ = ["ChunkedCall", "ascending_chunks", "check_chunked", "check_chunked_calls", "gather_chunks",
           "listed_elements", "listed_ranges", "put_chunks", "range_calls", "take_chunks"]


class ChunkedCall(NamedTuple):
    """A :class:`~sofx.kernels.base.StepCall` or :class:`~sofx.kernels.base.UndoRedoCall` of a whole block
    run on its listed chunks alone (see the module docstring).

    ``call``: its tensors contiguous (flat in effect), ``out`` given (written at the listed chunks only, as are
    ``p_copy`` and a checked call's ``skip``). ``chunks``: ascending chunk indices (int64, 1-d, on the block's
    device). ``packed``: ``call``'s ``p, m, v`` hold the listed chunks' values one after another (a
    ``"chunk_snapshot"`` record's kept values) instead of the whole block's. ``kept``: where the listed chunks'
    ``p, m, v`` are copied, one after another, before they are written (with donation, the old values)."""

    call: StepCall | UndoRedoCall
    chunks: torch.Tensor
    packed: bool = False
    kept: Triple | None = None


def listed_ranges(chunks: Sequence[int], n: int) -> list[tuple[int, int]]:
    """The element ranges of the runs of adjacent chunks among ``chunks`` (ascending indices) of a block of
    ``n`` elements."""
    out: list[tuple[int, int]] = []
    for c in chunks:
        a, b = c * FINITE_CHUNK, min(n, (c + 1) * FINITE_CHUNK)
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def ascending_chunks(chunks: torch.Tensor, n: int) -> bool:
    """Whether ``chunks`` (a 1-d int64 tensor) are ascending chunk indices of a block of ``n`` elements (no
    index twice; an empty list is)."""
    k = chunks.numel()
    if not k:
        return True
    return (chunks[0].item() >= 0 and chunks[-1].item() < -(-n // FINITE_CHUNK)
            and (k == 1 or bool((chunks[1:] > chunks[:-1]).all())))


def listed_elements(chunks: torch.Tensor, n: int) -> int:
    """The elements of the listed ``chunks`` (:func:`ascending_chunks`) of a block of ``n`` elements: a chunk
    each but the block's partial last chunk, if listed."""
    k, last = chunks.numel(), -(-n // FINITE_CHUNK)
    return k * FINITE_CHUNK - (last * FINITE_CHUNK - n if k and chunks[-1].item() == last - 1 else 0)


def _block_size(call: StepCall | UndoRedoCall) -> int:
    return (call.g if isinstance(call, StepCall) else call.g_new).numel()


def check_chunked(where: str, c: ChunkedCall, kind: type) -> None:
    """Refuse, before anything is written, a :class:`ChunkedCall` (of a ``kind`` call) a backend cannot run as
    the module docstring says: the chunk list, and the tensors' sizes, contiguity, device and floating-point
    dtypes (those of the outputs and kept values the inputs'), storage that does not hold a tensor's elements
    (:func:`~sofx.kernels.storage.refuse_short_storage`), and written arrays that cannot be written
    (:func:`~sofx.kernels.donation.check_written`: none may require grad with grad mode on, as the native code
    writes them), and tensors it would read as plain values that autograd or a ``torch.func`` transform traces
    (:func:`~sofx.kernels.base.refuse_traced`). Its scalars and memory: :func:`check_chunked_calls`; the dtypes
    a backend takes: the backend's."""
    if not isinstance(c, ChunkedCall) or not isinstance(c.call, kind):
        def article(name: str) -> str:  # (sofx.tree.article's words: the kernels do not import sofx.tree)
            return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"

        raise LeafError(f"{where}: expected a ChunkedCall of {article(kind.__name__)}, got {type(c).__name__}"
                        + (f" of {article(type(c.call).__name__)}" if isinstance(c, ChunkedCall) else ""))
    call = c.call
    if not isinstance(c.packed, bool):
        raise LeafError(f"{where}: packed = {c.packed!r}; expected True or False")
    g = call.g if isinstance(call, StepCall) else call.g_new
    if not isinstance(g, torch.Tensor):
        raise LeafError(f"{where}: the gradient must be a tensor, got {type(g).__name__}")
    n, device = g.numel(), g.device
    last = -(-n // FINITE_CHUNK)
    ch = c.chunks
    if not (isinstance(ch, torch.Tensor) and ch.dtype == torch.int64 and ch.dim() == 1 and ch.device == device):
        got = f"{ch.dtype} of shape {tuple(ch.shape)} on {ch.device}" if isinstance(ch, torch.Tensor) \
            else type(ch).__name__
        raise LeafError(f"{where}: chunks must be a 1-d int64 tensor on {device}, got {got}")
    refuse_short_storage(ch, lambda: f"{where}: chunks")
    if not ascending_chunks(ch, n):
        raise LeafError(f"{where}: chunks {ch[:8].tolist()} are not ascending chunk indices of a block of {last} "
                        f"chunks ({n} elements, {FINITE_CHUNK} per chunk)")
    listed = listed_elements(ch, n)
    if call.out is None or not isinstance(call.out, (tuple, list)) or len(call.out) != 3:
        raise LeafError(f"{where}: out must be given, a tuple of three tensors (out[0], out[1], out[2]: the new p, "
                        "m, v) of the whole block")
    whole = [(f"out[{k}]", o) for k, o in enumerate(call.out)] + [("p_copy", call.p_copy)]
    whole += [("g", call.g)] if isinstance(call, StepCall) else [("g_old", call.g_old), ("g_new", call.g_new),
                                                                  ("p_old", call.p_old)]
    inputs = [("p", call.p), ("m", call.m), ("v", call.v)]
    block, chunks_of = (n, "the block's"), (listed, "the listed chunks'")
    sized = [(name, t, chunks_of if c.packed else block) for name, t in inputs] + [(name, t, block)
                                                                                   for name, t in whole]
    if c.kept is not None:
        if not isinstance(c.kept, (tuple, list)) or len(c.kept) != 3:
            raise LeafError(f"{where}: kept must be a tuple (p, m, v) of the listed chunks' elements")
        sized += [(f"kept[{i}]", t, chunks_of) for i, t in enumerate(c.kept)]
    for name, t, (size, whose) in sized:
        if t is None and name in ("p_copy", "p_old"):
            continue
        check_float_tensor(where, name, t, device, "the gradient")
        if t.numel() != size or not t.is_contiguous():
            raise LeafError(f"{where}: {name} must be contiguous with {size} elements ({whose}), got shape "
                            f"{tuple(t.shape)}" + ("" if t.is_contiguous() else ", not contiguous"))
        refuse_short_storage(t, lambda: f"{where}: {name}")
    sk = call.skip
    if sk is not None and not (isinstance(sk, torch.Tensor) and sk.dtype == torch.uint8 and sk.device == device
                               and sk.shape == (last,) and sk.is_contiguous()):
        got = f"{sk.dtype} of shape {tuple(sk.shape)} on {sk.device}" if isinstance(sk, torch.Tensor) \
            else type(sk).__name__
        raise LeafError(f"{where}: skip must be a contiguous uint8 tensor of shape ({last},) on {device} (one flag "
                        f"per {FINITE_CHUNK} elements of the block), got {got}")
    if sk is not None:
        refuse_short_storage(sk, lambda: f"{where}: skip")
    for i, (name, t) in enumerate(inputs):
        if call.out[i].dtype != t.dtype or (c.kept is not None and c.kept[i].dtype != t.dtype):
            raise LeafError(f"{where}: {name} is {t.dtype}; its output"
                            + (" and kept values" if c.kept is not None else "") + " must be too")
    written = [(f"out[{k}]", o) for k, o in enumerate(call.out)] + [(f"kept[{k}]", t) for k, t in
                                                                     enumerate(c.kept or ())]
    written += [("p_copy", call.p_copy), ("skip", sk)]
    check_written(where, written)
    refuse_traced(where, inputs + whole[4:] + [("chunks", ch)] + written)


def check_chunked_calls(where: Sequence[str], calls: Sequence[ChunkedCall], kind: type, variant: AdamVariant,
                        ) -> tuple[list[AdamScalars], list[AdamScalars | None]]:
    """Refuse, before anything is written, a list of :class:`ChunkedCall` (of ``kind`` calls; ``where[i]`` names
    call i) that no backend runs: a call :func:`check_chunked` refuses, a written array sharing memory with
    another array of the list (:class:`~sofx.kernels.base.MemoryOverlapError`), scalars every backend refuses
    (:func:`~sofx.kernels.reference.concrete_checked`; a float64 block's as the float64 math takes them).
    Returns the concrete scalars of each call: a step's and None, or an undo+redo's undone and new ones."""
    for name, c in zip(where, calls):
        check_chunked(name, c, kind)
    found = _clash(calls, where)
    if found is not None:
        raise overlap_error(*found, where)
    float64 = [c.call.p.dtype == torch.float64 for c in calls]
    bc = variant.bias_correction
    if kind is StepCall:
        return (concrete_checked([c.call.s for c in calls], where=where, float64=float64, bias_correction=bc),
                [None] * len(calls))
    return (concrete_checked([c.call.s_old for c in calls], variant, [c.call.p_old is not None for c in calls], where,
                             float64, bc),
            concrete_checked([c.call.s_new for c in calls], where=where, float64=float64, bias_correction=bc))


def _clash(calls: Sequence[ChunkedCall], where: Sequence[str]) -> tuple[tuple[int, str], tuple[int, str]] | None:
    """A written array of ``calls`` and another that shares its memory (``(call, role)`` twice), or None: the
    outputs, kept arrays, parameter copies and flags are written, the inputs and the chunk lists read (written
    where an output is the input itself: donation). (Native code reads a chunk list as it writes: one
    overwritten mid-call would send its writes outside the block.)"""
    spans = MemorySpans()
    for i, c in enumerate(calls):
        call = c.call
        grads = [("g", call.g)] if isinstance(call, StepCall) else [("g_old", call.g_old), ("g_new", call.g_new)]
        donated = [not c.packed and same_memory(o, t) for o, t in zip(call.out, (call.p, call.m, call.v))]
        read = [(r, t) for (r, t), d in zip((("p", call.p), ("m", call.m), ("v", call.v)), donated) if not d]
        read += [(r, t) for r, t in grads + [("p_old", getattr(call, "p_old", None)), ("chunks", c.chunks)]
                 if t is not None]
        written = [(f"out[{k}]", o) for k, o in enumerate(call.out)]
        written += [(f"kept[{k}]", t) for k, t in enumerate(c.kept or ())]
        written += [(r, t) for r, t in (("p_copy", call.p_copy), ("skip", call.skip)) if t is not None]
        for group, w in ((read, False), (written, True)):
            spans.add([t for _, t in group], w, lambda j, i=i, group=group: (i, group[j][0]))
    return spans.clash(lambda tag: f"{where[tag[0]]}: {tag[1]}")


def range_calls(c: ChunkedCall) -> list[StepCall | UndoRedoCall]:
    """``c`` (checked: :func:`check_chunked`) as plain calls of its list form, one per run of adjacent listed
    chunks; its kept values are copied out here (call this right before running them)."""
    call = c.call
    ranges = listed_ranges(c.chunks.tolist(), _block_size(call))
    flat = lambda t: t.view(-1) if t is not None else None  # noqa: E731 (contiguous: checked)
    src = [flat(t) for t in (call.p, call.m, call.v)]
    out = [flat(t) for t in call.out]
    copy = flat(call.p_copy)
    p_old = flat(call.p_old) if isinstance(call, UndoRedoCall) else None
    at, calls = 0, []
    for a, b in ranges:
        k = (at, at + b - a) if c.packed else (a, b)
        pieces = [x[k[0]:k[1]] for x in src]
        if c.kept is not None:
            for kept, piece in zip(c.kept, pieces):
                kept.view(-1)[at:at + b - a].copy_(piece)
        rest = dict(out=(out[0][a:b], out[1][a:b], out[2][a:b]), p_copy=copy[a:b] if copy is not None else None,
                    skip=call.skip[a // FINITE_CHUNK:-(-b // FINITE_CHUNK)] if call.skip is not None else None)
        if isinstance(call, StepCall):
            calls.append(StepCall(pieces[0], flat(call.g)[a:b], pieces[1], pieces[2], call.s, **rest,
                                  zero_moments=call.zero_moments, p_kept=call.p_kept))
        else:
            calls.append(UndoRedoCall(pieces[0], pieces[1], pieces[2], flat(call.g_old)[a:b], call.s_old,
                                      flat(call.g_new)[a:b], call.s_new,
                                      p_old[a:b] if p_old is not None else None, **rest, p_kept=call.p_kept))
        at += b - a
    return calls


def gather_chunks(t: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """The listed chunks' elements of ``t`` (dense: chunks of its memory in memory order,
    :func:`~sofx.kernels.layout.in_memory_order`), one chunk after another, in a new flat tensor: one
    ``index_select`` over its whole chunks (and the block's partial last chunk after them, if listed).
    ``chunks``: ascending chunk indices (int64, on ``t``'s device)."""
    flat = in_memory_order(t)
    whole = flat.numel() // FINITE_CHUNK
    rows = flat[:whole * FINITE_CHUNK].view(whole, FINITE_CHUNK)
    if chunks.numel() and flat.numel() % FINITE_CHUNK and int(chunks[-1]) == whole:  # the partial last chunk
        return torch.cat([rows.index_select(0, chunks[:-1]).view(-1), flat[whole * FINITE_CHUNK:]])
    return rows.index_select(0, chunks).view(-1)


def put_chunks(t: torch.Tensor, chunks: torch.Tensor, packed: torch.Tensor) -> None:
    """The inverse of :func:`gather_chunks`: ``t``'s listed chunks (dense: of its memory order) set to
    ``packed``'s values (the chunks one after another; converted to ``t``'s dtype)."""
    flat, packed = in_memory_order(t), packed.reshape(-1)
    whole = flat.numel() // FINITE_CHUNK
    rows = flat[:whole * FINITE_CHUNK].view(whole, FINITE_CHUNK)
    if chunks.numel() and flat.numel() % FINITE_CHUNK and int(chunks[-1]) == whole:  # the partial last chunk
        tail = flat.numel() - whole * FINITE_CHUNK
        flat[whole * FINITE_CHUNK:] = packed[-tail:]
        chunks, packed = chunks[:-1], packed[:-tail]
    rows.index_copy_(0, chunks, packed.view(-1, FINITE_CHUNK).to(t.dtype))


def take_chunks(packed: torch.Tensor, packed_chunks: torch.Tensor, chunks: torch.Tensor, n: int) -> torch.Tensor:
    """The values of ``chunks`` (ascending, each one of ``packed_chunks``) from ``packed``, which holds
    ``packed_chunks``' (ascending) one after another, of a block of ``n`` elements: ``packed`` itself where
    they are the same chunks, else a new tensor (whole chunks as rows; the block's partial last chunk, last in
    both where both hold it). Refuses (:class:`~sofx.errors.LeafError`) chunk lists that are not ascending chunk
    indices of the block, a chunk ``packed_chunks`` does not list, and ``packed`` of another size than its
    chunks'."""
    for name, ch in (("packed_chunks", packed_chunks), ("chunks", chunks)):
        if not (isinstance(ch, torch.Tensor) and ch.dtype == torch.int64 and ch.dim() == 1):
            got = f"{ch.dtype} of shape {tuple(ch.shape)}" if isinstance(ch, torch.Tensor) else type(ch).__name__
            raise LeafError(f"take_chunks: {name} must be a 1-d int64 tensor, got {got}")
        if not ascending_chunks(ch, n):
            raise LeafError(f"take_chunks: {name} {_shown(ch)} are not ascending chunk indices of a block of "
                            f"{-(-n // FINITE_CHUNK)} chunks ({n} elements, {FINITE_CHUNK} per chunk)")
    if packed.numel() != listed_elements(packed_chunks, n):
        raise LeafError(f"take_chunks: packed has {packed.numel()} elements; its chunks {_shown(packed_chunks)} hold "
                        f"{listed_elements(packed_chunks, n)}")
    missing = chunks[~torch.isin(chunks, packed_chunks)]
    if missing.numel():
        raise LeafError(f"take_chunks: chunks {_shown(missing)} are not among the packed chunks "
                        f"{_shown(packed_chunks)}")
    return _take_chunks(packed, packed_chunks, chunks, n)


def _shown(chunks: object) -> object:
    """A chunk list as an error shows it: its first 8 indices (a tensor), else the object."""
    return chunks[:8].tolist() if isinstance(chunks, torch.Tensor) else chunks


def _take_chunks(packed: torch.Tensor, packed_chunks: torch.Tensor, chunks: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`take_chunks` unchecked: for callers that know ``chunks`` to be among ``packed_chunks``
    (:func:`sofx.skipped_chunks.finish_undo_redo`, which tests it to choose this path)."""
    if torch.equal(chunks, packed_chunks):
        return packed
    whole = n // FINITE_CHUNK
    rows = packed[:int((packed_chunks < whole).sum()) * FINITE_CHUNK].view(-1, FINITE_CHUNK)
    full = chunks[chunks < whole]
    out = rows.index_select(0, torch.searchsorted(packed_chunks, full)).view(-1)
    if full.numel() < chunks.numel():  # the partial last chunk
        return torch.cat([out, packed[-(n - whole * FINITE_CHUNK):]])
    return out
