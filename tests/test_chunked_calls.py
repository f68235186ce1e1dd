"""Calls on the listed chunks of a block (``sofx.kernels.chunked``): the CPU backends' ``step_chunks`` and
``undo_redo_chunks`` run them in one native call.

Each listed chunk must get the bits of the block's one-block call there (which tests/test_kernels_cpu.py checks
against the reference), the other chunks nothing: from the block's own values or from packed ones (a chunk
snapshot's kept values), with the kept values copied out first (donation: the old ones), checked calls flagging
and leaving alone what the list forms do, whatever the thread splits, and the same without a compiler (the
calls over the runs of adjacent chunks, ``range_calls``). Bad calls are refused before anything is written.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sofx.errors import HParamError, LeafError
from sofx.kernels import cpu, cpu_fast
from sofx.kernels.base import FINITE_CHUNK, AdamVariant, MemoryOverlapError, StepCall, UndoRedoCall
from sofx.kernels.chunked import (ChunkedCall, gather_chunks, listed_elements, listed_ranges, put_chunks, range_calls,
                                  take_chunks)

from helpers import UNWRITABLE, bits, block_inputs, block_scalars, result_requiring_grad

BACKENDS = {"cpu": cpu, "cpu_fast": cpu_fast}
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float32)]
C = FINITE_CHUNK

pytestmark = pytest.mark.skipif(not cpu.native_available(), reason="no C compiler: the cpu backend is the reference")


def _listed(t: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """``t``'s elements in the listed chunks, one chunk after another."""
    flat = t.reshape(-1)
    return torch.cat([flat[a:b] for a, b in listed_ranges(chunks, flat.numel())]) if chunks else flat[:0]


def _mask(chunks: list[int], n: int) -> torch.Tensor:
    keep = torch.zeros(n, dtype=torch.bool)
    for a, b in listed_ranges(chunks, n):
        keep[a:b] = True
    return keep


def _run(backend, op: str, inputs, chunks: list[int], s, s_new, variant, *, donate: bool, packed: bool,
         keep: bool, checked: bool, copy: bool):
    """One chunked call over clones of ``inputs`` (``p, g, m, v`` and an undo+redo's new gradient): the outputs,
    the kept values, the flags and the bf16 parameter copy it wrote."""
    p, g, m, v = (t.clone() for t in inputs[:4])
    n = p.numel()
    if donate and not packed:
        out = (p, m, v)
    else:  # fresh outputs (or a chunk snapshot's leaf: its values outside the chunks are kept)
        out = tuple(torch.full_like(t, 3.0) for t in (p, m, v))
    src = tuple(_listed(t, chunks) for t in (p, m, v)) if packed else (p, m, v)
    kept = tuple(torch.empty(sum(b - a for a, b in listed_ranges(chunks, n)), dtype=t.dtype)
                 for t in (p, m, v)) if keep else None
    flags = torch.zeros(-(-n // C), dtype=torch.uint8) if checked else None
    pc = torch.full((n,), 7.0, dtype=torch.bfloat16) if copy else None
    idx = torch.tensor(chunks, dtype=torch.int64)
    if op == "step":
        call = StepCall(src[0], g, src[1], src[2], s, out, pc, flags)
        backend.step_chunks([ChunkedCall(call, idx, packed, kept)], variant)
    else:
        call = UndoRedoCall(src[0], src[1], src[2], g, s, inputs[4], s_new, None, out, pc, flags)
        backend.undo_redo_chunks([ChunkedCall(call, idx, packed, kept)], variant)
    return out, kept, flags, pc


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(BACKENDS)), op=st.sampled_from(["step", "undo_redo"]),
       dt=st.integers(0, len(DTYPES) - 1), chunks_in=st.integers(1, 9), tail=st.integers(0, C - 1),
       picks=st.lists(st.booleans(), min_size=9, max_size=9), donate=st.booleans(), packed=st.booleans(),
       keep=st.booleans(), checked=st.booleans(), copy=st.booleans(), bad=st.integers(-1, 8),
       decoupled=st.booleans(), native=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_listed_chunks_get_the_whole_calls_bits_and_nothing_else_is_written_property(
        name, op, dt, chunks_in, tail, picks, donate, packed, keep, checked, copy, bad, decoupled, native, seed,
        monkeypatch):
    """Random blocks (a partial last chunk or not), chunk lists (runs of adjacent chunks and gaps, the last
    chunk or not), dtypes, donation, packed inputs, kept copies, checked calls with a nan planted in a chunk
    (listed or not), parameter copies; native or without a compiler."""
    from sofx.kernels import _cpu_build

    if not native:
        monkeypatch.setattr(_cpu_build, "load", lambda: None)
    gen = torch.Generator().manual_seed(seed)
    n = max(1, (chunks_in - 1) * C + tail) if tail else chunks_in * C
    last = -(-n // C)
    chunks = [c for c in range(last) if picks[c]]
    p, g, m, v = block_inputs(gen, n, *DTYPES[dt], sound=True)
    g_new = torch.randn(n, generator=gen).clamp_(-3.5, 3.5).to(p.dtype)  # (of g's law: block_inputs' sound)
    if checked and 0 <= bad < last:
        (g if op == "step" else g_new)[min(n - 1, bad * C + 17)] = float("nan")
    s = block_scalars(gen, 0.1, 0.5)
    s_new = s._replace(grad_scale=0.25, lr=2 * s.lr)
    variant = AdamVariant(decoupled=decoupled)
    backend = BACKENDS[name]
    out, kept, flags, pc = _run(backend, op, (p, g, m, v, g_new), chunks, s, s_new, variant, donate=donate,
                                packed=packed, keep=keep, checked=checked, copy=copy)
    want = backend.step(p, g, m, v, s, variant) if op == "step" else \
        backend.undo_redo(p, m, v, g, s, g_new, s_new, variant)
    flagged = [c for c in chunks if checked and c == bad]
    if checked:
        assert flags.tolist() == [int(c in flagged) for c in range(last)]
    written = _mask([c for c in chunks if c not in flagged], n)
    for got, w, old in zip(out, want, (p, m, v)):
        assert torch.equal(bits(got[written]), bits(w[written]))
        untouched = old[~written] if donate and not packed else torch.full_like(old[~written], 3.0)
        assert torch.equal(bits(got[~written]), bits(untouched))
    if keep:
        for k, old in zip(kept, (p, m, v)):
            assert torch.equal(bits(k), bits(_listed(old, chunks)))
    if copy:
        assert torch.equal(pc[written], want[0][written].to(torch.bfloat16)) and bool((pc[~written] == 7.0).all())


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("op", ["step", "undo_redo"])
def test_threads_split_the_listed_chunks(name, op, rng, monkeypatch):
    """Three threads share 70 listed chunks of 90 (runs and gaps; the kept copies chunk by chunk): the
    one-thread bits."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    n = 90 * C - 5
    chunks = [c for c in range(90) if c % 9 not in (2, 5)]
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32, sound=True)
    g_new = torch.randn(n, generator=rng)
    s = block_scalars(rng, 0.1)
    got = [_run(BACKENDS[name], op, (p, g, m, v, g_new), chunks, s, s, AdamVariant(), donate=True, packed=False,
                keep=keep, checked=True, copy=True) for keep in (False, True)]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    want = _run(BACKENDS[name], op, (p, g, m, v, g_new), chunks, s, s, AdamVariant(), donate=True, packed=False,
                keep=True, checked=True, copy=True)
    for run in got:
        assert all(torch.equal(a, b) for a, b in zip(run[0], want[0]))
        assert torch.equal(run[2], want[2]) and torch.equal(run[3], want[3])
    assert all(torch.equal(a, b) for a, b in zip(got[1][1], want[1]))


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("dtypes", DTYPES[:3], ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("n", [1, 5, 21, 2 * C + 37])
def test_kept_values_are_copied_whatever_their_alignment(name, dtypes, n, rng):
    """The native code copies a listed chunk's old values to the kept arrays by streaming stores from the first
    64-byte line boundary on, by memcpy before and after it: kept arrays that start at every 2-byte offset of a
    line, and listed elements that fill less than a line (1, 5, 21 elements: 2 to 84 bytes) or end in a partial
    chunk, get the old values bit for bit and nothing around them is written; the outputs are the call's without
    kept arrays."""
    p, g, m, v = block_inputs(rng, n, *dtypes, sound=True)
    s = block_scalars(rng, 0.1)
    chunks = torch.tensor([0, 2] if n > 2 * C else [0])
    listed = listed_elements(chunks, n)
    want = tuple(t.clone() for t in (p, m, v))
    BACKENDS[name].step_chunks([ChunkedCall(StepCall(p, g, m, v, s, want), chunks)], AdamVariant())
    for off in range(32):  # (elements: a line's 2-byte offsets for bf16, its 4-byte ones twice for float32)
        out = tuple(t.clone() for t in (p, m, v))
        bufs = [torch.full((listed + 64,), -3.0, dtype=t.dtype) for t in (p, m, v)]
        kept = tuple(b[off:off + listed] for b in bufs)
        BACKENDS[name].step_chunks([ChunkedCall(StepCall(*out[:1], g, *out[1:], s, out), chunks, False, kept)],
                                   AdamVariant())
        for k, t in zip(kept, (p, m, v)):
            assert torch.equal(bits(k), bits(_listed(t, chunks.tolist()))), off
        for b in bufs:
            assert bool((b[:off] == -3.0).all()) and bool((b[off + listed:] == -3.0).all()), off
        assert all(torch.equal(bits(a), bits(w)) for a, w in zip(out, want)), off


def test_range_calls_are_the_runs_of_adjacent_chunks(rng):
    """The calls a backend without chunk lists runs: one per run of adjacent listed chunks, at the run's
    elements (packed inputs at their positions), the kept values copied out."""
    n = 6 * C + 100
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32)
    kept = tuple(torch.empty(2 * C + 100) for _ in range(3))
    out = tuple(torch.empty(n) for _ in range(3))
    calls = range_calls(ChunkedCall(StepCall(p, g, m, v, block_scalars(rng, 0.0), out), torch.tensor([1, 2, 6]),
                                    kept=kept))
    assert [(c.p.data_ptr() - p.data_ptr()) // 4 for c in calls] == [C, 6 * C]
    assert [c.p.numel() for c in calls] == [2 * C, 100]
    assert torch.equal(kept[0], torch.cat([p[C:3 * C], p[6 * C:]]))


@pytest.mark.parametrize("native", [True, False])
def test_a_checked_step_from_zero_moments_flags_no_lossy_chunk_with_or_without_a_compiler(native, rng, monkeypatch):
    """``StepCall.zero_moments`` (a leaf's first step from init): the checked step flags no chunk as too lossy to
    undo, only the inf; without a compiler the calls over the runs (``range_calls``) keep it too, so they flag and
    write what the native call does (they dropped it: every chunk whose step from zero moments is "lossy" was
    flagged and left alone)."""
    from sofx.kernels import _cpu_build

    n = 4 * C + 100
    p, g, _, _ = block_inputs(rng, n, torch.float32, torch.float32)
    g[2 * C + 5] = float("inf")
    zeros = torch.zeros(n)
    s = block_scalars(rng, 0.1)
    want_flags = torch.zeros(5, dtype=torch.uint8)
    want = cpu.step_many([StepCall(p, g, zeros, zeros, s, None, None, want_flags, zero_moments=True)], AdamVariant())[0]
    assert want_flags.tolist() == [0, 0, 1, 0, 0]
    if not native:
        monkeypatch.setattr(_cpu_build, "load", lambda: None)
    chunks = [0, 2, 3, 4]
    out = tuple(torch.full((n,), 3.0) for _ in range(3))
    flags = torch.zeros(5, dtype=torch.uint8)
    call = StepCall(p, g, zeros, zeros, s, out, None, flags, zero_moments=True)
    assert all(r.zero_moments for r in range_calls(ChunkedCall(call, torch.tensor(chunks))))
    cpu.step_chunks([ChunkedCall(call, torch.tensor(chunks))], AdamVariant())
    assert flags.tolist() == want_flags.tolist()
    written = _mask([0, 3, 4], n)
    for got, w in zip(out, want):
        assert torch.equal(bits(got[written]), bits(w[written])) and bool((got[~written] == 3.0).all())


@pytest.mark.parametrize("op", ["step", "undo_redo"])
def test_a_float64_block_takes_the_scalars_its_list_form_takes(op, rng):
    """A float64 block is stepped in float64 (the reference math, over the runs): an eps or lr that float32
    cannot hold is its list form's to take, and the chunk list's (it was refused as if stepped in float32)."""
    n = 3 * C + 9
    p, g, m, v = (t.double() for t in block_inputs(rng, n, torch.float32, torch.float32, sound=True))
    g_new = torch.randn(n, generator=rng, dtype=torch.float64)
    s = block_scalars(rng, 0.1)._replace(eps=1e-60)
    s_new = s._replace(lr=1e-50)
    chunks = [0, 1, 3]
    out = tuple(torch.full((n,), 3.0, dtype=torch.float64) for _ in range(3))
    if op == "step":
        want = cpu.step_many([StepCall(p, g, m, v, s)], AdamVariant())[0]
        cpu.step_chunks([ChunkedCall(StepCall(p, g, m, v, s, out), torch.tensor(chunks))], AdamVariant())
    else:
        want = cpu.undo_redo_many([UndoRedoCall(p, m, v, g, s, g_new, s_new)], AdamVariant())[0]
        cpu.undo_redo_chunks([ChunkedCall(UndoRedoCall(p, m, v, g, s, g_new, s_new, None, out), torch.tensor(chunks))],
                             AdamVariant())
    written = _mask(chunks, n)
    for got, w in zip(out, want):
        assert torch.equal(got[written], w[written]) and bool((got[~written] == 3.0).all())


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("written", ["kept", "out"])
def test_a_chunk_list_in_memory_the_call_writes_is_refused(name, written, rng):
    """The native code reads the chunk list while it writes: a list sharing memory with a kept array or an output
    was overwritten mid-call (its later indices garbage: writes outside the block, a crash where the first chunk's
    copy reached them). Refused as any written array sharing memory, nothing written."""
    n = 4 * C
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32)
    buf = torch.zeros(4 * C)
    chunks = buf[-6:].view(torch.int64)  # (the end of the buffer: the last chunk's copy reaches it)
    chunks.copy_(torch.tensor([0, 1, 3]))
    if written == "kept":
        out, kept = tuple(torch.zeros(n) for _ in range(3)), (buf[C:], torch.zeros(3 * C), torch.zeros(3 * C))
    else:
        out, kept = (torch.zeros(n), buf, torch.zeros(n)), None
    with pytest.raises(MemoryOverlapError, match=re.escape(f"{name}.step_chunks[0]: chunks")):
        BACKENDS[name].step_chunks([ChunkedCall(StepCall(p, g, m, v, block_scalars(rng, 0.0), out), chunks,
                                                kept=kept)], AdamVariant())
    assert chunks.tolist() == [0, 1, 3] and not bool(buf[:-6].any())
    assert all(not bool(t.any()) for t in out + (kept or ()) if t.untyped_storage().data_ptr() != buf.data_ptr())


def test_a_backend_without_chunk_lists_refuses_a_bad_call_before_any_runs(rng):
    """run_chunked over a backend without chunk lists (the reference here, Triton) runs the calls over the runs
    of its calls (range_calls), the kept values copied out first: it checks the whole list as the CPU backends
    do before that, so a bad call is named as the list's (not as the n-th run of all the calls) and no kept value
    is copied, and a kept array in the memory of another call's output is refused (it was overwritten)."""
    from sofx.kernels import reference
    from sofx.skipped_chunks import run_chunked

    n = 3 * C + 10
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32)
    s = block_scalars(rng, 0.0)
    outs = [tuple(torch.zeros(n) for _ in range(3)) for _ in range(2)]
    kept = tuple(torch.zeros(2 * C) for _ in range(3))
    good = ChunkedCall(StepCall(p, g, m, v, s, outs[0]), torch.tensor([0, 2]), kept=kept)
    bad = ChunkedCall(StepCall(p, g, m, v, s._replace(beta1=1.5), outs[1]), torch.tensor([1]))
    with pytest.raises(HParamError, match=re.escape("reference chunks[1]: beta1 = 1.5")):
        run_chunked(AdamVariant(), [(reference, good), (reference, bad)])
    assert all(not bool(t.any()) for t in kept + outs[0] + outs[1])
    shared = good._replace(kept=(outs[1][0][:2 * C], kept[1], kept[2]))
    with pytest.raises(MemoryOverlapError, match=re.escape("reference chunks[0]: kept[0]")):
        run_chunked(AdamVariant(), [(reference, shared), (reference, bad._replace(call=bad.call._replace(s=s)))])
    assert all(not bool(t.any()) for t in kept + outs[0] + outs[1])


@pytest.mark.parametrize("n", [5 * C, 5 * C - 7, 3])
def test_gather_and_put_chunks_are_inverses(n, rng):
    """gather_chunks takes the listed chunks one after another (the partial last chunk too); put_chunks puts
    them back, converted to the destination's dtype, and nothing else."""
    t = torch.randn(n, generator=rng)
    last = -(-n // C)
    for chunks in ([], [0], [last - 1], list(range(0, last, 2)), list(range(last))):
        idx = torch.tensor(chunks, dtype=torch.int64)
        packed = gather_chunks(t, idx)
        assert torch.equal(packed, _listed(t, chunks)) and packed.numel() == listed_elements(idx, n)
        dst = torch.zeros(n, dtype=torch.bfloat16)
        put_chunks(dst, idx, packed)
        mask = _mask(chunks, n)
        assert torch.equal(dst[mask], t[mask].bfloat16()) and not bool(dst[~mask].any())


@pytest.mark.parametrize("n", [5 * C, 5 * C - 7])
def test_take_chunks_picks_listed_chunks_out_of_packed_ones(n, rng):
    """take_chunks: a subset of packed chunks' values (the partial last chunk too); the packed tensor itself
    where the chunks are the same."""
    t = torch.randn(n, generator=rng)
    held = [0, 1, 3, 4]
    packed = gather_chunks(t, torch.tensor(held))
    for want in ([0, 1, 3, 4], [1, 4], [0, 3], [4], []):
        got = take_chunks(packed, torch.tensor(held), torch.tensor(want, dtype=torch.int64), n)
        assert torch.equal(got, _listed(t, want))
        assert (got is packed) == (want == held)


@pytest.mark.parametrize("n", [5 * C, 5 * C - 7])
def test_take_chunks_refuses_chunks_the_packed_values_do_not_hold(n, rng):
    """take_chunks (exported) trusted that the chunks asked for are among the packed ones: one that is not got
    another chunk's values (the next held one: searchsorted's slot), or past the last one an index error, with no
    word of the cause. Refused now, naming the chunks, as are chunk lists that are not ascending int64 chunk
    indices and packed values of another size than their chunks'."""
    t = torch.randn(n, generator=rng)
    held = torch.tensor([0, 1, 3, 4])
    packed = gather_chunks(t, held)
    for want, words in (([2], "chunks [2] are not among the packed chunks [0, 1, 3, 4]"),
                        ([1, 2, 3], "chunks [2] are not among the packed chunks"),
                        ([3, 1], "chunks [3, 1] are not ascending chunk indices of a block of 5 chunks"),
                        ([5], "chunks [5] are not ascending chunk indices of a block of 5 chunks")):
        with pytest.raises(LeafError, match=re.escape(f"take_chunks: {words}")):
            take_chunks(packed, held, torch.tensor(want), n)
    with pytest.raises(LeafError, match=re.escape("take_chunks: packed_chunks [1, 0] are not ascending")):
        take_chunks(packed, torch.tensor([1, 0]), torch.tensor([1]), n)
    with pytest.raises(LeafError, match=re.escape("take_chunks: chunks must be a 1-d int64 tensor, got torch.int32")):
        take_chunks(packed, held, torch.tensor([1], dtype=torch.int32), n)
    with pytest.raises(LeafError, match=re.escape(f"take_chunks: packed has {packed.numel() - 1} elements; its "
                                                  f"chunks [0, 1, 3, 4] hold {packed.numel()}")):
        take_chunks(packed[1:], held, torch.tensor([1]), n)


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("native", [True, False])
def test_bad_chunked_calls_are_refused_before_anything_is_written(name, native, rng, monkeypatch):
    """Chunks not ascending or outside the block, a kept array or packed input of the wrong size, no outputs,
    an output of another dtype, a kept array sharing an input's memory, a gradient, moments or parameter copy
    that is not floating-point, a step's ChunkedCall given to undo_redo_chunks: refused with the call named,
    nothing written (valid calls first in the list, one with a float64 parameter copy, which runs as the calls
    over its runs (range_calls) as every call does without a compiler: such a call ran, and wrote its outputs
    and kept values, before the next call's gradient of integers was refused)."""
    from sofx.kernels import _cpu_build

    if not native:
        monkeypatch.setattr(_cpu_build, "load", lambda: None)
    backend = BACKENDS[name]
    n = 3 * C + 10
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32)
    s = block_scalars(rng, 0.0)
    good_out = tuple(torch.zeros(n) for _ in range(6)) + (torch.zeros(n, dtype=torch.float64),)
    good_kept = tuple(torch.zeros(2 * C) for _ in range(3))
    good = [ChunkedCall(StepCall(p, g, m, v, s, good_out[:3]), torch.tensor([0, 3])),
            ChunkedCall(StepCall(p, g, m, v, s, good_out[3:6], good_out[6]), torch.tensor([0, 1]), kept=good_kept)]
    out = tuple(torch.zeros(n) for _ in range(3))
    whole = torch.zeros(n, dtype=torch.int32)
    step = StepCall(p, g, m, v, s, out)
    cases = [
        (ChunkedCall(step, torch.tensor([2, 1])), LeafError, "not ascending"),
        (ChunkedCall(step, torch.tensor([4])), LeafError, "not ascending chunk indices of a block of 4"),
        (ChunkedCall(step, torch.tensor([-1, 2])), LeafError, "not ascending"),
        (ChunkedCall(step, torch.tensor([1, 1])), LeafError, "not ascending"),
        (ChunkedCall(step, torch.tensor([1.0])), LeafError, "1-d int64"),
        (ChunkedCall(step, torch.tensor([1]), kept=(torch.empty(C - 1), torch.empty(C), torch.empty(C))),
         LeafError, f"kept[0] must be contiguous with {C} elements"),
        (ChunkedCall(step._replace(p=p[:C]), torch.tensor([1, 2]), packed=True), LeafError,
         f"p must be contiguous with {2 * C} elements (the listed chunks')"),
        (ChunkedCall(step._replace(out=None), torch.tensor([1])), LeafError, "out must be given"),
        (ChunkedCall(step._replace(out=(out[0].bfloat16(), out[1], out[2])), torch.tensor([1])), LeafError,
         "its output must be too"),
        (ChunkedCall(step, torch.tensor([1]), kept=(p[:C], torch.empty(C), torch.empty(C))), MemoryOverlapError,
         "kept[0]"),
        (ChunkedCall(step, torch.tensor([1]), packed="no"), LeafError, "packed"),
        (ChunkedCall(step._replace(s=s._replace(beta1=1.5)), torch.tensor([1])), HParamError, "beta1 = 1.5"),
        (ChunkedCall(step._replace(g=whole), torch.tensor([1])), LeafError,
         "g must be a floating-point tensor, got torch.int32"),
        (ChunkedCall(step._replace(m=whole.clone(), out=(out[0], whole, out[2])), torch.tensor([1])), LeafError,
         "m must be a floating-point tensor, got torch.int32"),
        (ChunkedCall(step._replace(p_copy=whole), torch.tensor([1])), LeafError,
         "p_copy must be a floating-point tensor, got torch.int32"),
    ]
    for bad, error, words in cases:
        with pytest.raises(error, match=re.escape(words)) as e:
            backend.step_chunks([*good, bad], AdamVariant())
        assert all(not bool(t.any()) for t in good_out + good_kept + out)
        assert str(e.value).startswith(f"{name}.step_chunks[2]: ") and " run " not in str(e.value)
    with pytest.raises(LeafError, match="expected a ChunkedCall of an UndoRedoCall"):
        backend.undo_redo_chunks(good, AdamVariant())


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("bad, words", [*UNWRITABLE, (result_requiring_grad, "a tensor that requires grad cannot be "
                                                                            "written by these kernels")],
                         ids=["inference", "leaf", "view_of_leaf", "result"])
def test_written_arrays_that_cannot_be_written_are_refused_before_anything_is_written(name, native, bad, words, rng,
                                                                                      monkeypatch):
    """An output, kept array, parameter copy or flags torch refuses to write in place (an inference tensor outside
    inference mode, a leaf that requires grad or a view of one) or that requires grad at all (autograd does not
    see the native code's writes) were written: by the native code, or by the calls over their runs after the kept
    values were copied out. Refused with the call and the array named, nothing written (valid calls first)."""
    from sofx.kernels import _cpu_build

    if not native:
        monkeypatch.setattr(_cpu_build, "load", lambda: None)
    backend = BACKENDS[name]
    n = 3 * C + 10
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32)
    s = block_scalars(rng, 0.0)
    good_out = tuple(torch.zeros(n) for _ in range(3))
    good_kept = tuple(torch.zeros(2 * C) for _ in range(3))
    good = ChunkedCall(StepCall(p, g, m, v, s, good_out), torch.tensor([0, 1]), kept=good_kept)
    for role in ("out[0]", "out[2]", "kept[1]", "p_copy", "skip"):
        out = [torch.zeros(n) for _ in range(3)]
        kept = [torch.zeros(C) for _ in range(3)]
        p_copy, skip = torch.zeros(n), None
        if role.startswith("out"):
            out[int(role[4])] = bad(out[int(role[4])])
        elif role.startswith("kept"):
            kept[int(role[5])] = bad(kept[int(role[5])])
        elif role == "p_copy":
            p_copy = bad(p_copy)
        else:
            if bad is not UNWRITABLE[0][0]:
                continue  # (flags are integers: they cannot require grad)
            skip = bad(torch.zeros(-(-n // C), dtype=torch.uint8))
        call = ChunkedCall(StepCall(p, g, m, v, s, tuple(out), p_copy, skip), torch.tensor([2]), kept=tuple(kept))
        written = [*good_out, *good_kept, *out, *kept, p_copy] + ([skip] if skip is not None else [])
        with pytest.raises(LeafError, match=re.escape(f"{name}.step_chunks[1]: {role}: ") + words):
            backend.step_chunks([good, call], AdamVariant())
        assert all(not bool(t.detach().any()) for t in written), role


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("op", ["step", "undo_redo"])
def test_a_refused_native_call_leaves_the_calls_over_runs_unwritten(name, op, rng, monkeypatch):
    """A list form runs the calls its native code does not take (a float64 block) over their runs and the others
    in one call of the C entry, which can still refuse (its out-of-memory code: nothing written). It ran after
    the calls over runs, which had written their outputs and copied their kept values; now nothing is written
    before the C entry took its calls."""
    import dataclasses

    from sofx.errors import UnsupportedError
    from sofx.kernels import _cpu_build

    lib = _cpu_build.load()
    monkeypatch.setattr(_cpu_build, "load", lambda: dataclasses.replace(lib, adam_many=lambda *a: -1000000000))
    n = 3 * C + 10
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32)
    wide = [t.double() for t in (p, g, m, v)]
    s = block_scalars(rng, 0.0)
    outs = [tuple(torch.zeros(n, dtype=t.dtype) for _ in range(3)) for t in (wide[0], p)]
    kept = tuple(torch.zeros(2 * C, dtype=torch.float64) for _ in range(3))
    chunks = torch.tensor([0, 2])
    if op == "step":
        calls = [ChunkedCall(StepCall(*w, s, o), chunks, kept=kept if i == 0 else None)
                 for i, (w, o) in enumerate(zip((wide, (p, g, m, v)), outs))]
        run = BACKENDS[name].step_chunks
    else:
        calls = [ChunkedCall(UndoRedoCall(w[0], w[2], w[3], w[1], s, w[1], s, None, o), chunks,
                             kept=kept if i == 0 else None)
                 for i, (w, o) in enumerate(zip((wide, (p, g, m, v)), outs))]
        run = BACKENDS[name].undo_redo_chunks
    with pytest.raises(UnsupportedError, match="refused its arguments"):
        run(calls, AdamVariant())
    assert all(not bool(t.any()) for t in kept + outs[0] + outs[1])


@pytest.mark.parametrize("kernel", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("bad", ["chunks", "out"])
def test_run_chunked_checks_every_kernel_function_before_any_runs(kernel, bad, rng):
    """run_chunked runs one call per kernel and function (a kernel's steps, then its undo+redos): each of them was
    checked just before it ran, so a bad undo+redo was refused after the steps had written their outputs and
    copied their kept values. Every call of the list is checked first now."""
    from sofx.kernels import reference
    from sofx.skipped_chunks import run_chunked

    backend = {"reference": reference, **BACKENDS}[kernel]
    n = 3 * C + 10
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32)
    s = block_scalars(rng, 0.0)
    out = tuple(torch.zeros(n) for _ in range(3))
    kept = tuple(torch.zeros(2 * C) for _ in range(3))
    step = ChunkedCall(StepCall(p, g, m, v, s, out), torch.tensor([0, 2]), kept=kept)
    redo_out = tuple(torch.zeros(n - 1 if bad == "out" else n) for _ in range(3))
    redo = ChunkedCall(UndoRedoCall(p, m, v, g, s, g, s, None, redo_out),
                       torch.tensor([2, 1] if bad == "chunks" else [1]))
    words = "not ascending" if bad == "chunks" else f"out[0] must be contiguous with {n} elements"
    inputs = [t.clone() for t in (p, g, m, v)]
    with pytest.raises(LeafError, match=re.escape(words)):
        run_chunked(AdamVariant(), [(backend, step), (backend, redo)])
    assert all(not bool(t.any()) for t in out + kept + redo_out)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (p, g, m, v)))


@pytest.mark.parametrize("bad", ["checked", "unsupported"])
def test_run_chunked_refuses_what_the_list_form_refuses_before_copying_kept_values(bad, rng):
    """A backend without chunk lists runs a group as its list form's calls over the runs, whose kept values
    range_calls copies out first: a call the list form then refused (a checked call where the backend has no
    checked step, CHECKS_FINITE False; a param dtype its supports() refuses, float64 for Triton) had its kept
    values copied, and the groups before it run. These refusals of the kernel contract are made with the other
    checks now, before any group runs."""
    from sofx.errors import UnsupportedError
    from sofx.kernels import reference
    from sofx.skipped_chunks import run_chunked

    n = 3 * C + 10
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32)
    s = block_scalars(rng, 0.0)
    outs = [tuple(torch.zeros(n) for _ in range(3)) for _ in range(2)]
    kept = [tuple(torch.zeros(C) for _ in range(3)) for _ in range(2)]
    step = ChunkedCall(StepCall(p, g, m, v, s, outs[0]), torch.tensor([1]), kept=kept[0])
    if bad == "checked":
        backend = reference
        redo = UndoRedoCall(p, m, v, g, s, g, s, None, outs[1], skip=torch.zeros(4, dtype=torch.uint8))
        words = "reference chunks[0]: this backend has no checked step"
    else:
        pytest.importorskip("triton")
        from sofx.kernels import triton as backend

        outs[1] = (torch.zeros(n, dtype=torch.float64),) + outs[1][1:]
        kept[1] = (torch.zeros(C, dtype=torch.float64),) + kept[1][1:]
        redo = UndoRedoCall(p.double(), m, v, g, s, g, s, None, outs[1])
        words = "triton chunks[0]: device cpu with param dtype torch.float64 and state dtype torch.float32"
    with pytest.raises(UnsupportedError, match=re.escape(words)):
        run_chunked(AdamVariant(), [(reference, step), (backend, ChunkedCall(redo, torch.tensor([2]), kept=kept[1]))])
    assert all(not bool(t.any()) for t in outs[0] + outs[1] + kept[0] + kept[1])
