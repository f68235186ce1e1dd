"""Leaves of a dense layout that is not contiguous (a transposed matrix, a channels_last convolution weight).

The kernels run a block whose tensors share one such layout over their memory spans, in memory order
(``sofx.kernels.layout``): the results are those of the same step on contiguous copies, bit for bit, in the
inputs' layout, and nothing is copied in or back. Blocks of mixed layouts, or with gaps, still go through
copies, with the same results.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sofx
from sofx.kernels import cpu, cpu_fast, load_backend, reference
from sofx.kernels.base import AdamScalars, AdamVariant, StepCall, UndoCall, UndoRedoCall
from sofx.kernels.chunked import gather_chunks
from sofx.kernels.layout import in_memory_order, is_dense, one_dense_layout, same_layout
from sofx.undo_record import CHECKED_CHUNKS_REASON

native = pytest.mark.skipif(not cpu.native_available(), reason="no C compiler: no native kernels")


def _transposed(gen: torch.Generator, rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(cols, rows, generator=gen)).t()


def _channels_last(gen: torch.Generator, shape: tuple[int, int, int, int], scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=gen)).contiguous(memory_format=torch.channels_last)


LAYOUTS = {
    "transposed": lambda gen, scale=1.0: _transposed(gen, 67, 129, scale),
    "channels_last": lambda gen, scale=1.0: _channels_last(gen, (5, 7, 3, 11), scale),
}


def test_layout_helpers():
    gen = torch.Generator().manual_seed(0)
    t = _transposed(gen, 4, 6)
    assert is_dense(t) and not t.is_contiguous()
    assert is_dense(_channels_last(gen, (2, 3, 4, 5)))
    assert not is_dense(torch.randn(4, 6)[:, ::2]) and is_dense(torch.randn(4, 6)[1:3])
    assert is_dense(torch.randn(0, 3).t()) and is_dense(torch.randn(1, 5)[:, :1].expand(1, 1))
    assert same_layout(t, torch.randn(6, 4).t()) and not same_layout(t, torch.randn(4, 6))
    assert torch.equal(in_memory_order(t), t.t().reshape(-1))  # the memory's order, not the logical one
    flat = in_memory_order(t)
    flat.add_(1.0)  # a view: writes land in t
    assert torch.equal(t, (flat - 0).view(6, 4).t())
    with pytest.raises(ValueError, match="not dense"):
        in_memory_order(torch.randn(4, 6)[:, ::2])


def test_one_dense_layout_is_dense_and_same_layout_on_empty_size_one_and_strided_tensors():
    """The contiguous shortcut of one_dense_layout decides as is_dense and same_layout do, empty tensors (which
    torch calls contiguous whatever their strides) and dimensions of size 1 (any stride) included."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4, 6), torch.randn(6, 4).t(), torch.randn(4, 6)[:, ::2], torch.randn(4, 3),
               torch.empty_strided((0, 3), (1, 5)), torch.empty_strided((0, 3), (3, 1)), torch.empty(0),
               torch.empty_strided((1, 5), (7, 1)), torch.empty_strided((1, 5), (5, 1)), torch.randn(3, 0).t(),
               _channels_last(gen, (2, 3, 4, 5)), torch.randn(2, 3, 4, 5), torch.randn(()), torch.randn(())]
    for p in tensors:
        for a in tensors:
            for b in (None, *tensors):
                want = is_dense(p) and same_layout(a, p) and (b is None or same_layout(b, p))
                assert one_dense_layout(p, (a, None, b)) == want
                assert one_dense_layout(p, iter([a, b])) == want


def _block(layout: str, gen: torch.Generator, pdt: torch.dtype, sdt: torch.dtype):
    make = LAYOUTS[layout]
    p = make(gen).to(pdt)
    g, g2 = make(gen).to(pdt), make(gen).to(pdt)
    m = make(gen, 0.1).to(sdt)
    v = (make(gen, 0.1).abs() + 0.05).to(sdt)
    return p, g, g2, m, v


def _contiguous(*ts):
    return [None if t is None else t.contiguous() for t in ts]


@native
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16-fp32", "bf16"])
@pytest.mark.parametrize("backend", [cpu, cpu_fast], ids=["cpu", "cpu_fast"])
def test_native_calls_on_one_dense_layout_equal_contiguous_ones_without_copies(layout, dtypes, backend,
                                                                               monkeypatch):
    """Step, undo and undo+redo (donated, into fresh outputs, with a parameter copy of the same layout) on a
    block of one dense layout give the bits of the same calls on contiguous copies, in that layout; the C
    entry takes the tensors as they are (the path that copies them is not taken)."""
    gen = torch.Generator().manual_seed(1)
    p, g, g2, m, v = _block(layout, gen, *dtypes)
    s = AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 7, 0.5)
    s2 = s._replace(grad_scale=0.25)
    variant = AdamVariant(decoupled=True)
    cp, cg, cg2, cm, cv = _contiguous(p, g, g2, m, v)
    want = {
        "step": backend.step(cp, cg, cm, cv, s, variant),
        "undo": backend.undo(cp, cg, cm, cv, s, variant),
        "undo_redo": backend.undo_redo(cp, cm, cv, cg, s, cg2, s2, variant),
    }

    def no_copies(*args, **kwargs):
        raise AssertionError("the block was copied")

    monkeypatch.setattr(cpu, "_prepare", no_copies)
    copy = torch.empty_like(p, dtype=torch.bfloat16)  # (empty_like keeps the layout)
    got = {
        "step": backend.step_many([StepCall(p, g, m, v, s, None, copy)], variant)[0],
        "undo": backend.undo_many([UndoCall(p, g, m, v, s)], variant)[0],
        "undo_redo": backend.undo_redo_many([UndoRedoCall(p, m, v, g, s, g2, s2)], variant)[0],
    }
    for op in want:
        for a, b in zip(got[op], want[op]):
            assert same_layout(a, p) and torch.equal(a, b), op
    assert torch.equal(copy, want["step"][0].to(torch.bfloat16))
    # donated: written in place, in the inputs' own storage
    pointers = [t.data_ptr() for t in (p, m, v)]
    res = backend.step_many([StepCall(p, g, m, v, s, (p, m, v))], variant)[0]
    assert [t.data_ptr() for t in res] == pointers
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), want["step"]))


@native
@pytest.mark.parametrize("backend", [cpu, cpu_fast], ids=["cpu", "cpu_fast"])
def test_blocks_of_mixed_layouts_or_with_gaps_are_copied_and_equal(backend):
    """A gradient of another layout than its parameter, a parameter copy of another layout, a slice with gaps:
    the kernels copy those blocks (as before) and give the contiguous calls' bits."""
    gen = torch.Generator().manual_seed(2)
    p, g, _, m, v = _block("transposed", gen, torch.float32, torch.float32)
    s = AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 7, 1.0)
    variant = AdamVariant(decoupled=False)
    want = backend.step(*_contiguous(p, g, m, v), s, variant)
    mixed = backend.step(p, g.contiguous(), m, v, s, variant)  # a contiguous gradient
    assert all(torch.equal(a, b) for a, b in zip(mixed, want))
    copy = torch.empty(p.shape)  # contiguous: written after the kernel
    res = backend.step_many([StepCall(p, g, m, v, s, None, copy)], variant)[0]
    assert torch.equal(copy, want[0]) and all(torch.equal(a, b) for a, b in zip(res, want))
    wide = [torch.randn(67, 258, generator=gen) for _ in range(4)]
    gappy = [wide[0][:, ::2], wide[1][:, ::2], 0.1 * wide[2][:, ::2], wide[3][:, ::2].abs() + 0.05]
    assert not is_dense(gappy[0])
    res = backend.step(*gappy, s, variant)
    assert all(torch.equal(a, b) for a, b in zip(res, backend.step(*_contiguous(*gappy), s, variant)))


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("donate", [False, True])
def test_adam_on_transposed_and_channels_last_leaves_equals_contiguous_leaves(backend, donate):
    """sofx.adamw over a transposed and a channels_last leaf: update (checked, the pass before the step: these
    leaves are not checked in the kernel), undo and undo_redo with a clip equal the same calls on contiguous
    leaves; the results keep the leaves' layouts (donated: the inputs themselves)."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    check_adam_on_dense_layouts(backend, donate)


def check_adam_on_dense_layouts(backend: str, donate: bool) -> None:
    """:func:`test_adam_on_transposed_and_channels_last_leaves_equals_contiguous_leaves` on one backend (the
    Triton one: test_kernels_triton.py)."""
    gen = torch.Generator().manual_seed(3)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    params = {k: make(gen) for k, make in LAYOUTS.items()}
    flat = {k: t.contiguous() for k, t in params.items()}
    state, flat_state = opt.init(params), opt.init(flat)
    assert all(same_layout(state.mu[k], params[k]) for k in params)
    for _ in range(3):
        grads = {k: make(gen) for k, make in LAYOUTS.items()}
        flat_grads = {k: t.contiguous() for k, t in grads.items()}
        keep = sofx.tree.tree_map(torch.clone, (params, state))
        new, new_state, rec = opt.update(params, grads, state, donate=donate)
        want, want_state, want_rec = opt.update(flat, flat_grads, flat_state)
        assert rec.strategies() == want_rec.strategies()
        for k in params:
            assert same_layout(new[k], params[k]) and torch.equal(new[k], want[k])
            assert torch.equal(new_state.mu[k], want_state.mu[k]) and torch.equal(new_state.nu[k], want_state.nu[k])
            if donate:
                assert new[k].data_ptr() == params[k].data_ptr()
        undone, undone_state = opt.undo(new, new_state, rec, donate=donate)
        want_undone, _ = opt.undo(want, want_state, want_rec)
        assert all(torch.equal(undone[k], want_undone[k]) for k in params)
        if donate:
            params, state = keep
        new, new_state, rec = opt.update(params, grads, state, donate=donate)
        want, want_state, want_rec = opt.update(flat, flat_grads, flat_state)
        redone, redone_state, _ = opt.undo_redo(new, new_state, rec, grads, grad_scale=0.5, donate=donate)
        want_redone, want_redone_state, _ = opt.undo_redo(want, want_state, want_rec, flat_grads, grad_scale=0.5)
        for k in params:
            assert same_layout(redone[k], params[k]) and torch.equal(redone[k], want_redone[k])
            assert torch.equal(redone_state.nu[k], want_redone_state.nu[k])
        params, state, flat, flat_state = redone, redone_state, want_redone, want_redone_state


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("donate", [False, True])
def test_a_leaf_whose_gradient_has_another_layout_keeps_its_layout(backend, layout, donate):
    """update, undo and undo_redo of a transposed or channels_last leaf whose gradient is contiguous (an
    accumulation buffer made with torch.zeros(p.shape), a view of a flat buffer): the parameters and moments
    returned keep the leaf's layout, as the reference backend's do (and torch.optim's steps in place), with the
    bits of the same calls on contiguous leaves; undo(update(x)) is x, layout included. The native kernels' calls
    whose other tensors are all contiguous give results of the parameter's layout too."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    check_a_gradient_of_another_layout(backend, layout, donate)


def check_a_gradient_of_another_layout(backend: str, layout: str, donate: bool) -> None:
    """:func:`test_a_leaf_whose_gradient_has_another_layout_keeps_its_layout` on one backend (the Triton one:
    test_kernels_triton.py)."""
    gen = torch.Generator().manual_seed(5)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    params = {"w": LAYOUTS[layout](gen)}
    state = sofx.AdamState({"w": torch.tensor(3)}, {"w": LAYOUTS[layout](gen, 0.1)},
                           {"w": LAYOUTS[layout](gen, 0.1).abs() + 0.05})
    flat, flat_state = {"w": params["w"].contiguous()}, sofx.tree.tree_map(lambda t: t.contiguous(), state)
    grads = {"w": LAYOUTS[layout](gen).contiguous()}
    keep = sofx.tree.tree_map(torch.clone, (params, state))
    new, new_state, rec = opt.update(params, grads, state, donate=donate)
    want, want_state, want_rec = opt.update(flat, grads, flat_state)
    for a, b in ((new["w"], want["w"]), (new_state.mu["w"], want_state.mu["w"]),
                 (new_state.nu["w"], want_state.nu["w"])):
        assert same_layout(a, keep[0]["w"]) and torch.equal(a, b)
    undone, undone_state = opt.undo(new, new_state, rec, donate=donate)
    want_undone, want_undone_state = opt.undo(want, want_state, want_rec)
    for a, b, x in ((undone["w"], want_undone["w"], keep[0]["w"]), (undone_state.mu["w"], want_undone_state.mu["w"],
                    keep[1].mu["w"]), (undone_state.nu["w"], want_undone_state.nu["w"], keep[1].nu["w"])):
        assert same_layout(a, x) and torch.equal(a, b)
    new, new_state, rec = opt.update(undone, grads, undone_state, donate=donate)
    want, want_state, want_rec = opt.update(want_undone, grads, want_undone_state)
    grads2 = {"w": LAYOUTS[layout](gen).contiguous()}
    redone, redone_state, _ = opt.undo_redo(new, new_state, rec, grads2, grad_scale=0.5, donate=donate)
    want_redone, want_redone_state, _ = opt.undo_redo(want, want_state, want_rec, grads2, grad_scale=0.5)
    for a, b in ((redone["w"], want_redone["w"]), (redone_state.mu["w"], want_redone_state.mu["w"]),
                 (redone_state.nu["w"], want_redone_state.nu["w"])):
        assert same_layout(a, keep[0]["w"]) and torch.equal(a, b)
    if backend == "reference":
        return  # (its torch operations follow the layouts of all their operands)
    kernel = load_backend(backend)  # moments, gradients and old parameter all contiguous: of p's layout too
    p, g, g2, m, v = _block(layout, gen, torch.float32, torch.float32)
    others = _contiguous(m, v, g, g2, 1.001 * p)
    s, s2 = AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 7, 1.0), AdamScalars(3e-3, 0.8, 0.99, 1e-8, 0.1, 7, 0.5)
    variant = AdamVariant(decoupled=True)
    for name, call in (("step", lambda p, m, v, g, g2, p_old: kernel.step(p, g, m, v, s, variant)),
                       ("undo_redo", lambda p, m, v, g, g2, p_old: kernel.undo_redo(p, m, v, g, s, g2, s2, variant,
                                                                                    p_old=p_old))):
        res, want = call(p, *others), call(p.contiguous(), *others)
        assert same_layout(res[0], p) and all(torch.equal(a, b) for a, b in zip(res, want)), name


def test_the_reference_on_a_dense_layout_equals_it_on_contiguous_copies():
    """The reference backend computes with torch's own elementwise operations (which follow dense layouts): its
    results, what the other backends are compared with, do not depend on the layout either."""
    gen = torch.Generator().manual_seed(4)
    p, g, _, m, v = _block("channels_last", gen, torch.float32, torch.float32)
    s = AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 7, 1.0)
    res = reference.step(p, g, m, v, s, AdamVariant(decoupled=True))
    want = reference.step(*_contiguous(p, g, m, v), s, AdamVariant(decoupled=True))
    assert all(torch.equal(a, b) for a, b in zip(res, want))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("op", ["step", "undo_redo"])
@pytest.mark.parametrize("backend", [cpu, cpu_fast], ids=["cpu", "cpu_fast"])
def test_a_checked_call_of_a_dense_layout_without_a_compiler_equals_it_on_contiguous_copies(layout, op, backend,
                                                                                           monkeypatch):
    """A checked call (skip) whose tensors share a dense, not contiguous layout, through the reference math (no
    native library): the flags and the outputs of the same call on contiguous copies (the reference's results
    keep the layout; the unflagged chunks are taken from them in logical order), not an error."""
    from sofx.kernels import _cpu_build
    from sofx.kernels.base import FINITE_CHUNK

    monkeypatch.setattr(_cpu_build, "load", lambda: None)
    gen = torch.Generator().manual_seed(5)
    p, g, g2, m, v = _block(layout, gen, torch.float32, torch.float32)
    (g if op == "step" else g2)[2, 1] = float("inf")  # its chunk flagged
    s = AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 7, 1.0)
    variant = AdamVariant(decoupled=True)
    chunks = -(-p.numel() // FINITE_CHUNK)

    def run(p, g, g2, m, v):
        skip = torch.zeros(chunks, dtype=torch.uint8)
        out = tuple(t.contiguous().clone() for t in (p, m, v))
        if op == "step":
            backend.step_many([StepCall(p, g, m, v, s, out, None, skip)], variant)
        else:
            backend.undo_redo_many([UndoRedoCall(p, m, v, g, s, g2, s._replace(grad_scale=0.5), None, out, None,
                                                 skip)], variant)
        return skip, out

    skip, out = run(p, g, g2, m, v)
    want_skip, want = run(*_contiguous(p, g, g2, m, v))
    assert bool(want_skip.any()) and torch.equal(skip, want_skip)
    assert all(torch.equal(a, b) for a, b in zip(out, want))


@native
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", [cpu, cpu_fast], ids=["cpu", "cpu_fast"])
def test_the_general_path_takes_one_dense_layout_without_copies_too(layout, backend, monkeypatch):
    """Blocks the C entry's common case does not take (``nn.Parameter`` leaves, ``out=`` buffers that are not
    the inputs, a float64 gradient) go through its general path: a block of one dense layout is read and
    written there as it is too, with the contiguous calls' bits, in that layout."""
    gen = torch.Generator().manual_seed(6)
    p, g, _, m, v = _block(layout, gen, torch.float32, torch.float32)
    s = AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 7, 0.5)
    variant = AdamVariant(decoupled=True)
    want = backend.step(*_contiguous(p, g, m, v), s, variant)
    original = torch.Tensor.contiguous

    def no_copies(t, *args, **kwargs):
        assert t.is_contiguous(*args, **kwargs), "a block tensor was copied"
        return original(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", no_copies)
    param = torch.nn.Parameter(p.clone(), requires_grad=False)
    assert not param.is_contiguous() and same_layout(param, p)
    out = tuple(torch.empty_like(t) for t in (p, m, v))  # (empty_like keeps the layout)
    copy = torch.empty_like(p)
    res = backend.step_many([StepCall(param, g, m, v, s, out, copy)], variant)[0]
    assert all(a is b for a, b in zip(res, out)) and torch.equal(copy, want[0])
    assert all(torch.equal(a, b) for a, b in zip(res, want))
    res = backend.step_many([StepCall(p, g.double(), m, v, s)], variant)[0]  # (the gradient rounded to float32)
    assert all(same_layout(a, p) and torch.equal(a, b) for a, b in zip(res, want))


CHECKED = {  # (shape, layout) of more than a few FINITE_CHUNKs, the last partial
    "transposed": lambda gen, dtype: _transposed(gen, 67, 129).to(dtype),
    "channels_last": lambda gen, dtype: _channels_last(gen, (16, 33, 3, 3)).to(dtype),
}


def _memory_chunk(t: torch.Tensor, index: tuple[int, ...]) -> int:
    """The chunk of ``t``'s memory order that holds element ``index``."""
    from sofx.kernels.base import FINITE_CHUNK

    return sum(i * s for i, s in zip(index, t.stride())) // FINITE_CHUNK


@native
@pytest.mark.parametrize("layout", sorted(CHECKED))
@pytest.mark.parametrize("backend", ["cpu", "cpu_fast"])
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-params"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_checked_step_of_a_dense_layout_keeps_the_chunks_of_its_memory_it_flagged(layout, backend, pdt, donate,
                                                                                     monkeypatch):
    """A leaf of one dense, not contiguous layout is checked in its kernel (no pass before the step, no copy)
    over its memory in memory order: a spike and an inf flag the chunks of the memory that hold them, which the
    record keeps (bf16 parameters: the old parameter whole); the step's results are the contiguous leaf's bit for
    bit, in the leaf's layout; the undo puts those chunks back bit for bit and inverts the rest within DESIGN.md's
    1e-6; ``undo_redo`` (a chunk snapshot's: fused by chunks) equals undo then update; a leaf of another layout
    is refused by the undo, unchanged."""
    check_checked_step_of_a_dense_layout(layout, backend, pdt, donate, monkeypatch)


def check_checked_step_of_a_dense_layout(layout: str, backend: str, pdt: torch.dtype, donate: bool,
                                         monkeypatch) -> None:
    """:func:`test_a_checked_step_of_a_dense_layout_keeps_the_chunks_of_its_memory_it_flagged` on one backend
    (the Triton one: test_kernels_triton.py)."""
    import sys

    from sofx.kernels.base import FINITE_CHUNK

    adam_module = sys.modules["sofx.adam"]
    gen = torch.Generator().manual_seed(11)
    make = CHECKED[layout]
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), backend=backend)
    params = {"w": make(gen, pdt)}
    state = opt.init(params)
    for _ in range(30):  # (fewer: more chunks are still lossy to invert)
        params, state, _ = opt.update(params, {"w": make(gen, pdt)}, state, undoable=False)
    flat, flat_state = {"w": params["w"].contiguous()}, sofx.tree.tree_map(lambda t: t.contiguous(), state)
    g = make(gen, pdt)
    spike, inf = (1, 2) + (0,) * (g.dim() - 2), (g.shape[0] - 1, 5) + (1,) * (g.dim() - 2)
    g[spike], g[inf] = 1e3, float("inf")
    flagged = sorted({_memory_chunk(g, spike), _memory_chunk(g, inf)})
    keep = sofx.tree.tree_map(torch.clone, (params, state))
    monkeypatch.setattr(adam_module, "any_lossy", lambda *a, **k: pytest.fail("a pass before the step"))
    new, new_state, rec = opt.update(params, {"w": g}, state, donate=donate)
    want, want_state, _ = opt.update(flat, {"w": g.contiguous()}, flat_state)
    for a, b, like in ((new["w"], want["w"], params["w"]), (new_state.mu["w"], want_state.mu["w"], state.mu["w"]),
                       (new_state.nu["w"], want_state.nu["w"], state.nu["w"])):
        assert same_layout(a, like) and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert (a.data_ptr() == like.data_ptr()) == donate
    leaf = rec.leaves[0]
    if pdt == torch.float32:
        assert rec.strategies() == ["chunk_snapshot"] and leaf.chunks.tolist() == flagged
        assert leaf.p_old.numel() == sum(min(FINITE_CHUNK, g.numel() - c * FINITE_CHUNK) for c in flagged)
    else:
        assert rec.strategies() == ["snapshot"] and same_layout(leaf.p_old, params["w"])
    assert leaf.grad is g

    other = sofx.tree.tree_map(lambda t: t.contiguous(), (new, new_state))
    before = sofx.tree.tree_map(torch.clone, other)
    if pdt == torch.float32:
        with pytest.raises(sofx.UndoError, match=r"\['w'\].*is not of strides"):
            opt.undo(*other, rec, donate=True)
        assert all(torch.equal(a.nan_to_num(), b.nan_to_num())
                   for a, b in zip(sofx.tree.flatten(other)[0], sofx.tree.flatten(before)[0])) and not rec.used
    again = sofx.tree.tree_map(torch.clone, (new, new_state))
    undone, undone_state = opt.undo(new, new_state, rec, donate=donate)
    for a, b in ((undone["w"], keep[0]["w"]), (undone_state.mu["w"], keep[1].mu["w"]),
                 (undone_state.nu["w"], keep[1].nu["w"])):
        assert same_layout(a, b)
        for c in flagged:
            chunk = slice(c * FINITE_CHUNK, (c + 1) * FINITE_CHUNK)
            assert torch.equal(in_memory_order(a)[chunk], in_memory_order(b)[chunk])
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    clean = {"w": make(gen, pdt)}
    new, new_state = again
    def record():  # of the same step, unused
        p0, s0 = sofx.tree.tree_map(torch.clone, keep)
        return opt.update(p0, {"w": g}, s0)[2]

    undone, undone_state = opt.undo(*sofx.tree.tree_map(torch.clone, again), record())
    want = opt.update(undone, clean, undone_state, grad_scale=0.5)
    rec = record()
    redone, redone_state, _ = opt.undo_redo(new, new_state, rec, clean, grad_scale=0.5, donate=donate)
    for a, b in ((redone["w"], want[0]["w"]), (redone_state.mu["w"], want[1].mu["w"]),
                 (redone_state.nu["w"], want[1].nu["w"])):
        assert same_layout(a, params["w"]) and torch.equal(a, b)


@native
@pytest.mark.parametrize("donate", [False, True])
def test_a_checked_step_of_a_dense_layout_beyond_the_snapshot_limit_is_taken_back_and_copies_follow(donate):
    """A checked step of a transposed leaf whose flagged chunks would pass ``snapshot_limit_bytes`` is taken back
    (the inputs as they were: untouched, or inverted in place within float32 rounding under donation, its
    flagged chunk bit for bit); parameter copies of the leaf's layout and of another receive the step's and the
    undo's parameters."""
    gen = torch.Generator().manual_seed(12)
    opt = sofx.adamw(lr=1e-2, betas=(0.9, 0.95), backend="cpu")
    params = {"w": _transposed(gen, 7, 3000)}
    state = opt.init(params)
    for _ in range(30):
        params, state, _ = opt.update(params, {"w": _transposed(gen, 7, 3000)}, state, undoable=False)
    g = _transposed(gen, 7, 3000)
    g[3, 100] = float("inf")
    before = sofx.tree.tree_map(torch.clone, (params, state))
    with pytest.raises(sofx.errors.SnapshotLimitError):
        opt.update(params, {"w": g}, state, donate=donate, snapshot_limit_bytes=100)
    for a, b in zip(sofx.tree.flatten((params, state))[0], sofx.tree.flatten(before)[0]):
        assert same_layout(a, b) and torch.equal(in_memory_order(a)[:1024], in_memory_order(b)[:1024])  # flagged
        torch.testing.assert_close(a, b, rtol=0 if not donate else 1e-6, atol=0 if not donate else 1e-7)
    copy = torch.empty_like(params["w"], dtype=torch.bfloat16)
    new, new_state, rec = opt.update(params, {"w": g}, state, param_copies={"w": copy})
    assert rec.strategies() == ["chunk_snapshot"]
    assert torch.equal(copy.nan_to_num(), new["w"].to(torch.bfloat16).nan_to_num())
    other = torch.zeros(params["w"].shape, dtype=torch.bfloat16)  # contiguous: another layout than the leaf's
    undone, _ = opt.undo(new, new_state, rec, param_copies={"w": other})
    assert torch.equal(other, undone["w"].to(torch.bfloat16))
    assert torch.equal(in_memory_order(undone["w"])[:1024], in_memory_order(params["w"])[:1024])  # g[3, 100]'s


@native
@pytest.mark.parametrize("backend", ["cpu", "cpu_fast"])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("inf", [False, True], ids=["finite", "inf"])
def test_an_undo_redo_of_a_dense_leaf_whose_record_has_another_layout_is_undo_then_update(backend, donate, inf):
    """A transposed leaf (``p, m, v`` and the new gradient of one dense layout) whose record's gradient is
    contiguous (the undone step's, another layout) is not checked in its kernel as its memory (the record's
    order is not the leaf's): its undo+redo is checked before (a new gradient with an inf: a whole snapshot),
    undo then update's bits, not refused by the kernel or the chunk finishing."""
    check_undo_redo_of_a_record_of_another_layout(backend, donate, inf)


def check_undo_redo_of_a_record_of_another_layout(backend: str, donate: bool, inf: bool) -> None:
    """:func:`test_an_undo_redo_of_a_dense_leaf_whose_record_has_another_layout_is_undo_then_update` on one
    backend (the Triton one: test_kernels_triton.py)."""
    gen = torch.Generator().manual_seed(13)
    make = CHECKED["transposed"]
    opt = sofx.adamw(lr=1e-2, betas=(0.9, 0.95), backend=backend)
    params = {"w": make(gen, torch.float32)}
    state = opt.init(params)
    for _ in range(30):
        params, state, _ = opt.update(params, {"w": make(gen, torch.float32)}, state, undoable=False)
    g = make(gen, torch.float32).contiguous()  # the undone step's gradient: contiguous
    keep = sofx.tree.tree_map(torch.clone, (params, state))

    def stepped():  # the step to undo, donated: its results in the leaf's layout; its record, unused
        p0, s0 = sofx.tree.tree_map(torch.clone, keep)
        new, new_state, rec = opt.update(p0, {"w": g}, s0, donate=True)
        return (new, new_state), rec

    g2 = 0.5 * make(gen, torch.float32)  # the redo's: of the leaf's layout
    if inf:
        g2[3, 100] = float("inf")
    (undone, undone_state), rec = stepped()
    undone, undone_state = opt.undo(undone, undone_state, rec)
    want, want_state, want_rec = opt.update(undone, {"w": g2}, undone_state)
    (new, new_state), rec = stepped()
    assert same_layout(new["w"], params["w"]) and same_layout(new_state.mu["w"], params["w"])
    assert rec.leaves[0].grad.is_contiguous() and not new["w"].is_contiguous()
    got, got_state, got_rec = opt.undo_redo(new, new_state, rec, {"w": g2}, donate=donate)
    # (the inf: checked before, a whole snapshot; undo then update checks the undone leaf, of its layout, in the
    # kernel: that chunk only)
    assert got_rec.strategies() == (["snapshot"] if inf else want_rec.strategies())
    for a, b in ((got["w"], want["w"]), (got_state.mu["w"], want_state.mu["w"]),
                 (got_state.nu["w"], want_state.nu["w"])):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("layout", sorted(CHECKED))
@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("inf", [False, True], ids=["clean", "inf"])
def test_the_fused_redo_of_a_bf16_leaf_of_a_dense_layout_equals_undo_then_update(layout, backend, donate, inf):
    """undo_redo of a bfloat16 master of one dense, not contiguous layout (fp32 moments; its records keep the
    old parameter whole) runs fused, over its memory on the checked backends (an inf in the new gradient
    flagged there: a whole snapshot): the bits of undo then update -- results, record, and its undo -- in the
    leaf's layout, the record's old parameter too."""
    from helpers import assert_trees_bitwise
    from test_adam_undo import _assert_records_bitwise, _bits_tree, _kernel_calls

    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(13)
    make = CHECKED[layout]
    opt = sofx.adam(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32, backend=backend)
    params = {"w": make(gen, torch.bfloat16)}
    state = sofx.AdamState({"w": torch.tensor(4)}, {"w": make(gen, torch.float32) * 0.1},
                           {"w": make(gen, torch.float32).square() + 1})
    grads = [{"w": make(gen, torch.bfloat16) * 0.01} for _ in range(2)]
    if inf:
        in_memory_order(grads[1]["w"])[5] = float("inf")

    def stepped():
        return opt.update(*sofx.tree.tree_map(torch.clone, (params, grads[0], state)), donate=donate)

    with _kernel_calls(backend) as calls:
        got = opt.undo_redo(*stepped(), grads[1], grad_scale=0.3, donate=donate)
    assert calls["undo_redo_many"] == (0 if inf and backend == "reference" else 1), calls
    assert got[2].strategies() == ["snapshot" if inf else "param_snapshot"]
    assert same_layout(got[0]["w"], params["w"]) and same_layout(got[2].leaves[0].p_old, params["w"])
    got_results = sofx.tree.tree_map(torch.clone, got[:2])
    undone = opt.undo(*stepped(), donate=donate)
    want = opt.update(*undone[:1], grads[1], undone[1], grad_scale=0.3, donate=donate)
    assert_trees_bitwise(_bits_tree(got_results), _bits_tree(want[:2]))
    _assert_records_bitwise(got[2], want[2])
    assert_trees_bitwise(_bits_tree(opt.undo(*got, donate=donate)), _bits_tree(opt.undo(*want, donate=donate)))


# (layout, shape): views of every dense kind, sizes that end mid-chunk, exactly on a chunk, a single element
VIEWS = [("transposed", (67, 129)), ("transposed", (3, 1025)), ("transposed", (1, 5)),
         ("channels_last", (5, 7, 3, 11)), ("channels_last", (2, 64, 4, 4)), ("channels_last", (1, 1, 1, 1)),
         ("offset", (2 * 1024 + 17,)), ("offset", (1024,)), ("offset", (1,)), ("contiguous", (3 * 1024 + 123,))]
_MARK = {"spike": 1e3, "inf": float("inf"), "nan": float("nan")}
_EVENT = st.fixed_dictionaries({
    "marks": st.lists(st.sampled_from(sorted(_MARK)), max_size=3), "same_gradient": st.booleans(),
    "hp": st.sampled_from([sofx.AdamHParams(), sofx.AdamHParams(lr=3e-3, beta1=0.8, beta2=0.99),
                           sofx.AdamHParams(lr=10.0), sofx.AdamHParams(eps=1e-30),
                           sofx.AdamHParams(weight_decay=0.0), sofx.AdamHParams(lr=1.0, weight_decay=0.9999)]),
    "grad_scale": st.sampled_from([1.0, 0.25, 2.0 ** -8, 3.0]), "donate": st.booleans(), "seed": st.integers(0, 99),
    "contiguous_gradient": st.sampled_from([False, False, True])})


def _empty_view(layout: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` in ``layout`` (``"offset"``: contiguous, 5 elements into a larger
    storage)."""
    if layout == "transposed":
        return torch.empty(shape[::-1], dtype=dtype).t()
    if layout == "channels_last":
        return torch.empty(shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    if layout == "offset":
        n = shape[0]
        return torch.empty(n + 9, dtype=dtype)[5:5 + n]
    return torch.empty(shape, dtype=dtype)


def _empty_like_view(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new uninitialized tensor of dense ``like``'s layout (a contiguous one at an offset: again at one)."""
    dtype = dtype or like.dtype
    if like.storage_offset():
        return _empty_view("offset", tuple(like.shape), dtype)
    return torch.empty_like(like, dtype=dtype)  # (strides kept: dense)


def _random_view(gen: torch.Generator, like: torch.Tensor, scale: float = 1.0, square: bool = False,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fresh random values (float64, then rounded) in a new tensor of ``like``'s layout."""
    x = torch.randn(like.shape, generator=gen, dtype=torch.float64)
    return _empty_like_view(like, dtype).copy_((x.square() if square else x) * scale)


def _views_clone(tree):
    """``tree`` with each tensor copied into a new one of its layout."""
    return sofx.tree.tree_map(lambda t: _empty_like_view(t).copy_(t), tree)


def _marked_grads(params: dict, event: dict) -> dict:
    """Fresh random gradients of the leaves' layouts (contiguous ones where the event says); leaf "w" with a spike,
    an inf or a nan per mark."""
    gen = torch.Generator().manual_seed(event["seed"])
    grads = {k: _random_view(gen, p.contiguous() if event["contiguous_gradient"] else p) for k, p in params.items()}
    w = grads["w"]
    for mark in event["marks"]:
        index = tuple(int(torch.randint(n, (), generator=gen)) for n in w.shape)
        w[index] = _MARK[mark]
    return grads


def _rel_to(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """max |a - b| over the finite elements of ``b`` relative to max(|b|, ``scale``); inf where a and b are not
    finite at the same elements or differ at the others (an inf, a nan)."""
    a64, b64 = a.double(), b.double()
    fin = torch.isfinite(b64)
    if not torch.equal(fin, torch.isfinite(a64)) or not torch.equal(a64[~fin].nan_to_num(0.0, 1.0, -1.0),
                                                                     b64[~fin].nan_to_num(0.0, 1.0, -1.0)):
        return float("inf")
    if not bool(fin.any()):
        return 0.0
    diff = float((a64[fin] - b64[fin]).abs().max())
    return diff / max(float(b64[fin].abs().max()), scale, 1e-30) if diff else 0.0


def _finite_peak(*trees) -> float:
    return max((float(t.double().nan_to_num(0.0, 0.0, 0.0).abs().max()) for t in sofx.tree.flatten(trees)[0]
                if t.numel()), default=0.0)


@settings(deadline=None)
@given(view=st.sampled_from(VIEWS), backend=st.sampled_from(["reference", "cpu", "cpu_fast"]),
       dtypes=st.sampled_from([(torch.float32, None), (torch.bfloat16, torch.float32), (torch.bfloat16, None)]),
       decoupled=st.booleans(), bias_correction=st.sampled_from([True, True, False]), warm=st.sampled_from([0, 3]),
       first=_EVENT, redos=st.lists(_EVENT, max_size=3), donate_undo=st.booleans())
def test_update_undo_redo_and_undo_of_views_equal_the_reference_and_the_serial_path(
        view, backend, dtypes, decoupled, bias_correction, warm, first, redos, donate_undo):
    """A leaf that is a view (transposed, channels_last, a contiguous slice at an offset; sizes ending mid-chunk,
    one element) beside a small contiguous one, fresh random values, spikes, infs and nans in a few chunks, large
    lr and tiny eps, gradients of its layout or contiguous: ``update`` equals the reference backend's (DESIGN.md:
    1e-6 in float32, 1e-2 for bfloat16), and keeps the leaf's layout; each ``undo_redo`` (donated or not, other
    gradients, hparams and multipliers) equals ``undo`` then ``update`` within 1e-6 of the largest parameter; the
    last record's ``undo`` equals the serial path's, finite, with the start's counts; a single update's undo
    restores its snapshot bit for bit (its chunks for a chunk snapshot) and zero moments exactly. Inputs not
    donated are left as they were."""
    if backend != "reference" and not cpu.native_available():
        return
    layout, shape = view
    pdt, sdt = dtypes
    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-2, weight_decay=0.05, bias_correction=bias_correction, state_dtype=sdt, backend=backend)
    ref = make(lr=1e-2, weight_decay=0.05, bias_correction=bias_correction, state_dtype=sdt, backend="reference")
    gen = torch.Generator().manual_seed(first["seed"] + 1000)
    params = {"w": _random_view(gen, _empty_view(layout, shape, pdt)), "b": torch.randn(37, generator=gen).to(pdt)}
    state = opt.init(params)
    if warm:
        sd = sdt or pdt
        state = sofx.AdamState({k: torch.tensor(warm) for k in params},
                               {k: _random_view(gen, p, 0.1, dtype=sd) for k, p in params.items()},
                               {k: _random_view(gen, p, 0.01, square=True, dtype=sd) for k, p in params.items()})
    start = _views_clone((params, state))
    low = {torch.bfloat16}
    tol = {"p": 1e-2 if pdt in low else 1e-6, "m": 1e-2 if (sdt or pdt) in low else 1e-6}
    tol["v"] = tol["m"]
    grads = _marked_grads(params, first)
    want = ref.update(_views_clone(params), grads, _views_clone(state), first["hp"], grad_scale=first["grad_scale"])
    inputs = _views_clone((params, state))
    p, s, rec = opt.update(*inputs[:1], grads, inputs[1], first["hp"], grad_scale=first["grad_scale"],
                           donate=first["donate"])
    for k in params:
        for name, a, b in (("p", p[k], want[0][k]), ("m", s.mu[k], want[1].mu[k]), ("v", s.nu[k], want[1].nu[k])):
            assert _rel_to(a, b, 0.0) <= max(tol[name], 2e-6), (k, name, rec.strategies())
            assert same_layout(a, params[k]), (k, name)
    if not first["donate"]:
        sofx.tree.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), inputs, start)
    serial = opt.update(*_views_clone(start)[:1], grads, _views_clone(start)[1], first["hp"],
                        grad_scale=first["grad_scale"])
    peak = _finite_peak(p, params)
    for i, event in enumerate(redos):
        if not event["same_gradient"]:
            grads = _marked_grads(params, event)
        peak = max(peak, _finite_peak(p))
        given_in = (p, s) if event["donate"] else _views_clone((p, s))
        kept_in = None if event["donate"] else _views_clone(given_in)
        p, s, rec = opt.undo_redo(*given_in, rec, grads, event["hp"], grad_scale=event["grad_scale"],
                                  donate=event["donate"])
        if kept_in is not None:
            sofx.tree.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True),
                               given_in, kept_in)
        undone = opt.undo(*serial)
        serial = opt.update(undone[0], grads, undone[1], event["hp"], grad_scale=event["grad_scale"])
        for k in params:
            assert torch.equal(s.count[k], serial[1].count[k])
            for name, a, b in (("p", p[k], serial[0][k]), ("m", s.mu[k], serial[1].mu[k]),
                               ("v", s.nu[k], serial[1].nu[k])):
                assert _rel_to(a, b, peak if name == "p" else 0.0) <= tol[name], (i, k, name, rec.strategies())
                assert same_layout(a, params[k]), (i, k, name)
    peak = max(peak, _finite_peak(p))
    last = rec
    p0, s0 = opt.undo(p, s, rec, donate=donate_undo)
    want0 = opt.undo(*serial)
    for k in params:
        assert torch.equal(s0.count[k], start[1].count[k])
        for name, a, b, b0 in (("p", p0[k], want0[0][k], start[0][k]), ("m", s0.mu[k], want0[1].mu[k], start[1].mu[k]),
                               ("v", s0.nu[k], want0[1].nu[k], start[1].nu[k])):
            assert bool(torch.isfinite(a).all()), (k, name, last.strategies())
            assert _rel_to(a, b, peak if name == "p" else 0.0) <= tol[name], (k, name, last.strategies())
            assert same_layout(a, params[k]), (k, name)
            if name != "p" and not warm:
                assert torch.equal(a, b0), (k, name)  # zero moments back exactly
    if redos:
        return
    for k, leaf in zip(sorted(params), last.leaves):
        restored = (p0[k], s0.mu[k], s0.nu[k])
        before = (start[0][k], start[1].mu[k], start[1].nu[k])
        if leaf.strategy == "snapshot" and not (first["donate"] and leaf.reason == CHECKED_CHUNKS_REASON):
            assert all(torch.equal(a, b) for a, b in zip(restored, before)), k
        if leaf.strategy == "chunk_snapshot":
            assert all(torch.equal(gather_chunks(a, leaf.chunks), gather_chunks(b, leaf.chunks))
                       for a, b in zip(restored, before)), k
