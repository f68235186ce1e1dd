"""The CPU backends' list forms (``step_many``, ``undo_many``, ``undo_redo_many``): all blocks in one call
of the native code, whose threads share the blocks' elements.

Each block's results must be the bits of its one-block call (which tests/test_kernels_cpu.py checks
against the reference), whatever the list around it: sizes, dtypes, scalars, donation, parameter copies,
thread splits that fall inside blocks, and blocks that only the reference math can take. Every block is
checked before any is computed. Checked steps (``StepCall.skip``) leave the chunks whose gradient is not
finite alone and flag them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sofx.errors import LeafError, UnsupportedError
from sofx.kernels import cpu, cpu_fast, reference
from sofx.kernels.base import FINITE_CHUNK, AdamVariant, StepCall, UndoRedoCall

from helpers import bits, block_inputs, block_scalars, refuse_bad_blocks_first, run_blocks

BACKENDS = {"cpu": cpu, "cpu_fast": cpu_fast}
# (param dtype, state dtype)
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float32)]

pytestmark = pytest.mark.skipif(not cpu.native_available(), reason="no C compiler: the cpu backend is the reference")


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blocks=st.lists(st.tuples(st.integers(0, 700), st.sampled_from(range(len(DTYPES))), st.integers(0, 2),
                                 st.booleans(), st.sampled_from([None, torch.float32, torch.bfloat16]),
                                 st.integers(0, 3)), min_size=1, max_size=8),
       op=st.sampled_from(["step", "undo", "undo_redo"]), decoupled=st.booleans(),
       name=st.sampled_from(sorted(BACKENDS)), seed=st.integers(0, 2**16))
def test_many_blocks_equal_one_call_per_block_property(blocks, op, decoupled, name, seed):
    """Any list of blocks (0 to 700 elements, at offsets 0-3 into their storage, four dtype combinations,
    three scalar sets, donated or not, with or without a copy): each block's results from the list form
    are the bits of its one-block call."""
    gen = torch.Generator().manual_seed(seed)
    variant = AdamVariant(decoupled=decoupled)
    scalar_sets = [block_scalars(gen, 0.1, 0.5), block_scalars(gen, 0.0), block_scalars(gen, 0.05, 2.0)]
    ins = []
    for n, dt, sc, donate, copy, offset in blocks:
        pdt, sdt = DTYPES[dt]
        p, g, m, v = (t[offset:] for t in block_inputs(gen, n + offset, pdt, sdt))
        g2 = torch.randn(n, generator=gen).to(pdt)
        ins.append((p, g, m, v, g2, scalar_sets[sc], donate, copy))

    def run(many: bool) -> list:
        work = [(p.clone(), g, m.clone(), v.clone(), g2, s, d, torch.empty(p.shape, dtype=c) if c else None)
                for p, g, m, v, g2, s, d, c in ins]
        return run_blocks(BACKENDS[name], op, work, variant, scalar_sets[1], many)

    _same(run(True), run(False))


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("op", ["step", "undo", "undo_redo"])
def test_thread_splits_inside_blocks(name, op, rng, monkeypatch):
    """Three threads over blocks of ~290k elements in all: the splits fall inside blocks, away from
    multiples of the square-root tile; every block's bits are its one-block call's (and for ``cpu`` the
    reference's)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    variant = AdamVariant(decoupled=op != "undo")
    sizes = [70001, 5, 130003, 0, 65536 + 129, 1000, 23]
    s, s_new = block_scalars(rng, 0.1, 0.5), block_scalars(rng, 0.05)
    work = []
    for i, n in enumerate(sizes):
        p, g, m, v = block_inputs(rng, n, *DTYPES[i % 3])
        work.append((p, g, m, v, torch.randn(n, generator=rng).to(p.dtype), s, False,
                     torch.empty(n, dtype=torch.bfloat16) if i % 2 else None))
    backend = BACKENDS[name]
    got = run_blocks(backend, op, work, variant, s_new, many=True)
    _same(got, run_blocks(backend, op, work, variant, s_new, many=False))
    if backend is cpu and cpu.bitwise_with_torch() and op == "step":
        for (p, g, m, v, *_), got_bits in zip(work, got):
            _same([got_bits[:3]], [[bits(t) for t in reference.step(p, g, m, v, s, variant)]])


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_blocks_only_the_reference_takes_run_beside_native_ones(name, rng):
    """float64 parameters and a float64 gradient: the reference's results (the others native), in order."""
    backend = BACKENDS[name]
    variant = AdamVariant()
    s = block_scalars(rng, 0.1)
    b64 = [t.double() for t in block_inputs(rng, 300, torch.float32, torch.float32)]
    b32 = block_inputs(rng, 500, torch.float32, torch.float32)
    mixed = (b32[0], b32[1].double(), b32[2], b32[3])  # a float64 gradient: rounded to float32 first
    b16 = block_inputs(rng, 257, torch.bfloat16, torch.float32)
    blocks = [b32, b64, mixed, b16]
    got = backend.step_many([StepCall(*b, s) for b in blocks], variant)
    for b, r in zip(blocks, got):
        _same([[bits(t) for t in r]], [[bits(t) for t in backend.step(*b, s, variant)]])
    assert got[1][0].dtype == torch.float64
    _same([[bits(t) for t in got[1]]], [[bits(t) for t in reference.step(*b64, s, variant)]])


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_donated_blocks_are_updated_in_place(name, rng):
    backend = BACKENDS[name]
    s = block_scalars(rng, 0.1)
    blocks = [block_inputs(rng, n, torch.float32, torch.float32) for n in (100, 4096, 3)]
    ptrs = [[t.data_ptr() for t in (p, m, v)] for p, _, m, v in blocks]
    got = backend.step_many([StepCall(p, g, m, v, s, (p, m, v)) for p, g, m, v in blocks], AdamVariant())
    assert [[t.data_ptr() for t in r] for r in got] == ptrs


@pytest.mark.parametrize("name", [*sorted(BACKENDS), "reference"])
def test_every_block_is_checked_before_any_runs(name, rng):
    # The reference computed the blocks before a bad one (undo_many: an UnsupportedError for a beta of 0 after
    # block 0 was written in place), and no backend named the block whose beta it refused.
    backend = reference if name == "reference" else BACKENDS[name]
    variant = AdamVariant()
    s = block_scalars(rng, 0.1)
    blocks = [block_inputs(rng, n, torch.float32, torch.float32) for n in (100, 200, 300, 400)]
    before = [[t.clone() for t in b] for b in blocks]
    refuse_bad_blocks_first(backend, name, blocks, s, variant)  # (cpu_fast's errors named cpu's entries)
    redo_calls = [UndoRedoCall(b[0], b[2], b[3], b[1], s, b[1], s, out=(b[0], b[2], b[3])) for b in blocks]
    redo_calls[1] = redo_calls[1]._replace(g_new=torch.randn(200, dtype=torch.float64).to("meta"))
    needs = "" if name == "reference" else f"; the {name} backend needs CPU tensors"
    with pytest.raises(UnsupportedError, match=rf"{name}\.undo_redo_many\[1\]: g_new is on meta, p on cpu{needs}"):
        backend.undo_redo_many(redo_calls, variant)
    for b, old in zip(blocks, before):
        assert all(torch.equal(a, o) for a, o in zip(b, old))


def test_an_empty_list_runs_nothing():
    assert cpu.step_many([], AdamVariant()) == []
    assert cpu_fast.undo_redo_many([], AdamVariant()) == []


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("op", ["step", "undo"])
def test_blocks_whose_lr_differs_only_in_the_sign_of_zero_keep_their_own_scalars(name, op, rng):
    """Two blocks of one list call on the same inputs, one with ``lr = 0.0`` and one with ``lr = -0.0`` (equal
    numbers: one dict key where scalars are shared by value): ``p -+ lr*u`` gives a parameter element that is
    ``-0.0`` the other sign, so each block's bits are its one-block call's (as
    ``sofx.speculation.decisions._same_number`` tells the two apart)."""
    variant = AdamVariant(decoupled=op == "step")
    s = block_scalars(rng, 0.0)
    p, g, m, v = block_inputs(rng, 300, torch.float32, torch.float32)
    p[::3] = -0.0
    work = [(p.clone(), g, m.clone(), v.clone(), g, s._replace(lr=lr), False, None) for lr in (0.0, -0.0)]
    many = run_blocks(BACKENDS[name], op, work, variant, s, many=True)
    _same(many, run_blocks(BACKENDS[name], op, work, variant, s, many=False))
    assert not torch.equal(many[0][0], many[1][0])  # (those zeros' signs differ between the two)


# ---------------------------------------------------------------- checked steps (StepCall.skip)
def _nonfinite_gradient(gen: torch.Generator, n: int, dtype: torch.dtype, where: list[int]) -> torch.Tensor:
    g = torch.randn(n, generator=gen).to(dtype)
    for i, x in zip(where, (float("inf"), float("nan"), -float("inf"))):
        g[i] = x
    return g


def _flags_for(g: torch.Tensor) -> list[int]:
    n = g.numel()
    return [int(not bool(torch.isfinite(g[c:c + FINITE_CHUNK]).all())) for c in range(0, n, FINITE_CHUNK)]


def _checked(backend, op: str, blocks, s, s_new, variant, donate: bool):
    """``step_many`` (``op`` "step") or ``undo_redo_many`` (blocks ``(p, g, m, v, g_new)``, the step taken
    with ``g``, ``s`` undone and redone with ``g_new``, ``s_new``) with flags over clones of ``blocks``:
    results, flags, copies."""
    work = [tuple(t.clone() for t in b[:4]) for b in blocks]
    flags = [torch.zeros(-(-b[0].numel() // FINITE_CHUNK), dtype=torch.uint8) for b in blocks]
    cps = [torch.full(b[0].shape, 7.0, dtype=torch.bfloat16) for b in blocks]
    if op == "step":
        res = backend.step_many([StepCall(p, g, m, v, s, (p, m, v) if donate else None, c, f)
                                 for (p, g, m, v), c, f in zip(work, cps, flags)], variant)
    else:
        res = backend.undo_redo_many([UndoRedoCall(p, m, v, g, s, b[4], s_new, None, (p, m, v) if donate else None,
                                                   c, f)
                                      for (p, g, m, v), b, c, f in zip(work, blocks, cps, flags)], variant)
    return res, flags, cps


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("donate", [True, False], ids=["donated", "fresh"])
@pytest.mark.parametrize("library", ["native", "no-replica", "no-compiler"])
@pytest.mark.parametrize("op", ["step", "undo_redo"])
def test_checked_step_leaves_chunks_with_non_finite_gradients_alone(op, name, donate, library, rng, monkeypatch):
    """Flags exactly on the chunks whose gradient (an undo+redo's new one) has an inf or a nan (anywhere
    in a chunk: its first vector, its last, the partial last chunk's tail; float32 and bf16 gradients
    beside either parameter dtype; three threads splitting the blocks); the other chunks get the
    unchecked call's bits, the flagged ones keep their old values (donated) and their copy is not
    written. The vector loops read the next chunk's gradient while stepping one (``native``, a step);
    the exact loops without the inline square root read each chunk just before (``no-replica``);
    without a compiler the reference math gives the same."""
    import dataclasses

    from sofx.kernels import _cpu_build

    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    if library == "no-compiler":
        monkeypatch.setattr(_cpu_build, "load", lambda: None)
    elif library == "no-replica":
        lib = _cpu_build.load()
        monkeypatch.setattr(_cpu_build, "_loaded", [dataclasses.replace(lib, sqrt_replica=False)])
    backend = BACKENDS[name]
    variant = AdamVariant()
    s = block_scalars(rng, 0.1, 0.5)
    blocks = []
    c = FINITE_CHUNK
    for n, dt, gdt, where in ((3 * c + 77, 0, None, [c + 5, 3 * c + 76]), (100, 1, None, [99]), (2 * c, 0, None, []),
                              (70000, 2, None, [0, 40000, 65537]), (5 * c + 1, 0, None, [5 * c]),
                              (4 * c + 33, 0, None, [c, 2 * c + c - 1, 4 * c + 32]),
                              (3 * c + 20, 1, torch.float32, [2 * c + 15, 3 * c + 19]),
                              (3 * c, 0, torch.bfloat16, [c + 16 * 7])):
        p, g, m, v = block_inputs(rng, n, *DTYPES[dt], sound=True)
        bad = _nonfinite_gradient(rng, n, gdt or p.dtype, where)
        blocks.append((p, bad, m, v) if op == "step" else (p, g.to(bad.dtype), m, v, bad))
    s_new = s._replace(grad_scale=0.25, lr=2 * s.lr)
    res, flags, cps = _checked(backend, op, blocks, s, s_new, variant, donate)
    for b, r, f, c in zip(blocks, res, flags, cps):
        p, g, m, v = b[:4]
        assert f.tolist() == _flags_for(b[1] if op == "step" else b[4])  # the gradient of the step taken
        keep = (f == 0).repeat_interleave(FINITE_CHUNK)[:p.numel()]
        want = backend.step(p, g, m, v, s, variant) if op == "step" else \
            backend.undo_redo(p, m, v, g, s, b[4], s_new, variant)
        for got, w, old in zip(r, want, (p, m, v)):
            assert torch.equal(bits(got[keep]), bits(w[keep]))
            if donate:
                assert torch.equal(bits(got[~keep]), bits(old[~keep]))
        assert torch.equal(c[keep], want[0][keep].to(torch.bfloat16))
        assert bool((c[~keep] == 7.0).all())


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("native", [True, False], ids=["native", "no-compiler"])
def test_checked_step_of_strided_inputs_and_a_copy_the_kernel_does_not_write(name, native, rng, monkeypatch):
    """Inputs need not be contiguous (they are read through copies); a float64 parameter copy, written
    after the kernel, gets only the stepped chunks."""
    from sofx.kernels import _cpu_build

    if not native:
        monkeypatch.setattr(_cpu_build, "load", lambda: None)
    backend = BACKENDS[name]
    s = block_scalars(rng, 0.1)
    n = 2 * FINITE_CHUNK + 10
    p, g, m, v = (t[:, 0] for t in block_inputs(rng, (n, 2), torch.float32, torch.float32, sound=True))
    g = g.clone()
    g[FINITE_CHUNK + 1] = float("nan")
    copy = torch.full((n,), 5.0, dtype=torch.float64)
    flags = torch.zeros(3, dtype=torch.uint8)
    got = backend.step_many([StepCall(p, g, m, v, s, None, copy, flags)], AdamVariant())[0]
    want = backend.step(p, g, m, v, s, AdamVariant())
    assert flags.tolist() == [0, 1, 0]
    keep = (flags == 0).repeat_interleave(FINITE_CHUNK)[:n]
    assert all(torch.equal(a[keep], b[keep]) for a, b in zip(got, want))
    assert torch.equal(copy[keep], want[0][keep].double()) and bool((copy[~keep] == 5.0).all())


def test_checked_steps_are_refused_where_not_supported_or_malformed(rng):
    s = block_scalars(rng, 0.1)
    n = FINITE_CHUNK + 904  # two chunks, the last partial
    p, g, m, v = block_inputs(rng, n, torch.float32, torch.float32)
    ok = torch.zeros(2, dtype=torch.uint8)
    wide = torch.randn(n, 2)[:, 0]
    assert cpu.CHECKS_FINITE and cpu_fast.CHECKS_FINITE and not reference.CHECKS_FINITE
    with pytest.raises(UnsupportedError, match=r"reference\.step_many\[0\]: this backend has no checked step"):
        reference.step_many([StepCall(p, g, m, v, s, skip=ok)], AdamVariant())
    with pytest.raises(UnsupportedError, match=r"reference\.undo_redo_many\[0\]: this backend has no checked step"):
        reference.undo_redo_many([UndoRedoCall(p, m, v, g, s, g, s, skip=ok)], AdamVariant())
    with pytest.raises(UnsupportedError, match=r"cpu\.undo_redo_many\[0\]: p_copy is not contiguous"):
        cpu.undo_redo_many([UndoRedoCall(p, m, v, g, s, g, s, p_copy=wide, skip=ok)], AdamVariant())
    for bad in (torch.zeros(3, dtype=torch.uint8), torch.zeros(2, dtype=torch.int32), [0, 0]):
        with pytest.raises(LeafError, match=r"cpu\.step_many\[0\]: skip must be a contiguous uint8 tensor "
                                            r"of shape \(2,\) on cpu"):
            cpu.step_many([StepCall(p, g, m, v, s, skip=bad)], AdamVariant())
    with pytest.raises(UnsupportedError, match=r"cpu\.step_many\[0\]: out\[1\] is not contiguous"):
        cpu.step_many([StepCall(p, g, m, v, s, (p, wide, v), skip=ok)], AdamVariant())
    with pytest.raises(UnsupportedError, match=r"cpu\.step_many\[0\]: out\[0\] is not contiguous or not of its"):
        cpu.step_many([StepCall(p, g, m, v, s, (p.double(), m, v), skip=ok)], AdamVariant())
    assert ok.tolist() == [0, 0]


def test_the_c_source_chunk_is_the_contracts():
    from sofx.kernels._cpu_source import SOURCE

    assert f"#define CHUNK {FINITE_CHUNK}\n" in SOURCE


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_written_arrays_that_share_memory_are_refused_before_anything_is_computed(name, rng):
    """The contract's CHECKS_OVERLAP: an ``out`` that is not its own input, a ``p_copy`` or a donated input that
    shares memory with another array of the call is refused naming block and role (MemoryOverlapError), for
    calls in the C entry's terms (plain) and others (a strided block among them); donation itself is not."""
    from sofx.kernels.base import MemoryOverlapError

    backend = BACKENDS[name]
    s = block_scalars(rng, 0.1)
    blocks = [block_inputs(rng, n, torch.float32, torch.float32) for n in (300, 5000, 70)]
    before = [[t.clone() for t in b] for b in blocks]
    donated = [StepCall(p, g, m, v, s, (p, m, v)) for p, g, m, v in blocks]
    cases = [
        # block 2's p_copy is block 0's gradient
        ([*donated[:2], donated[2]._replace(p_copy=blocks[0][1][:70])], (2, "p_copy"), (0, "g")),
        # block 1's first moment is also block 0's second moment (donated: written twice)
        ([donated[0]._replace(v=blocks[1][2][:300], out=(blocks[0][0], blocks[0][2], blocks[1][2][:300])),
          *donated[1:]], (0, "v"), (1, "m")),
        # an out that is another block's (donated, so written) parameter: the first written one is named first
        ([donated[0], donated[1], StepCall(*blocks[2][:4], s, (blocks[0][0][:70], blocks[2][2], blocks[2][3]))],
         (0, "p"), (2, "out[0]")),
        # a strided (not plain) block whose out[0] is its own gradient
        ([donated[0], StepCall(blocks[1][0][::2], blocks[1][1][::2], blocks[1][2][::2], blocks[1][3][::2], s,
                               (blocks[1][1][::2], blocks[1][2][::2], blocks[1][3][::2]))], (1, "out[0]"), (1, "g")),
    ]
    for calls, first, second in cases:
        with pytest.raises(MemoryOverlapError) as err:
            backend.step_many(calls, AdamVariant())
        assert (err.value.first, err.value.second) == (first, second)
        assert f"step_many[{first[0]}]: {first[1]} and" in str(err.value)
        assert all(torch.equal(x, y) for b, c in zip(blocks, before) for x, y in zip(b, c)), "written before refusing"
    p, g, m, v = blocks[0]
    with pytest.raises(MemoryOverlapError, match=r"undo_redo_many\[0\]: p and .*undo_redo_many\[0\]: p_old share"):
        backend.undo_redo_many([UndoRedoCall(p, m, v, g, s, g.clone(), s, p, (p, m, v))], AdamVariant())
    backend.undo_redo_many([UndoRedoCall(p, m, v, g, s, g.clone(), s, g, (p, m, v))], AdamVariant())  # reads
    backend.step_many(donated, AdamVariant())  # donation is no overlap


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_scale", [1.0, 0.5, 3e-15])
def test_checked_steps_flag_gradients_beyond_the_limit(name, gdtype, grad_scale, rng):
    """A chunk is flagged for an inf, a nan, or a finite element whose scaled magnitude exceeds
    GRADIENT_LIMIT, by the native vector loop, its per-chunk check and the reference fallback alike
    (base.beyond_limit's bits): one value per chunk, just above and just below the limit."""
    from sofx.kernels.base import GRADIENT_LIMIT, beyond_limit

    limit = GRADIENT_LIMIT / grad_scale
    finfo = torch.finfo(gdtype)
    # (a value after an unflagged chunk is found by that chunk's vector loop, the others by the per-chunk check)
    values = [1.0, limit * 1.01, limit * 0.99, -limit * 1.01, float("inf"), 1.0, float("nan"), limit * 0.99]
    n = len(values) * FINITE_CHUNK + 100
    p, _, m, v = block_inputs(rng, n, torch.float32, torch.float32, sound=True)
    g = torch.randn(n, generator=rng).to(gdtype)
    for c, x in enumerate(values):
        g[c * FINITE_CHUNK + 11] = min(max(x, -finfo.max), finfo.max) if x == x and abs(x) != float("inf") else x
        v[c * FINITE_CHUNK + 11] = float("inf")  # (no spike next to it: the limit alone is tested)
    want = beyond_limit(g, grad_scale).view(-1)
    want = torch.nn.functional.pad(want, (0, -n % FINITE_CHUNK)).view(-1, FINITE_CHUNK).any(dim=1).to(torch.uint8)
    s = block_scalars(rng, 0.1)._replace(grad_scale=grad_scale)
    assert want.tolist() == [int(not abs(float(g[c * FINITE_CHUNK + 11])) * grad_scale <= GRADIENT_LIMIT)
                             for c in range(len(values))] + [0]
    for states in (torch.float32, torch.float64):  # the native loops / the reference fallback (float64)
        skip = torch.zeros(-(-n // FINITE_CHUNK), dtype=torch.uint8)
        BACKENDS[name].step_many([StepCall(p.to(states), g, m.to(states), v.to(states), s, None, None, skip)],
                                 AdamVariant())
        assert torch.equal(skip, want), (states, skip.tolist(), want.tolist())
