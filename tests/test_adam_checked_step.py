"""``Adam.update`` without ``grads_finite``: the CPU kernels check each gradient in the step's own pass.

The update must be the unchecked update bit for bit (params, moments, parameter copies); a leaf whose
gradient has an inf or a nan gets a record that keeps the old values of the chunks the step flagged
(``"chunk_snapshot"``; all of them: a whole snapshot), whose undo restores them bit for bit and the other
chunks as an algebraic undo does, and the gradients are not read a second time.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sofx
from sofx.kernels import cpu
from sofx.kernels.base import FINITE_CHUNK

pytestmark = pytest.mark.skipif(not cpu.native_available(), reason="no C compiler: no checked steps to test")

_adam = importlib.import_module("sofx.adam")


def _tree(gen: torch.Generator, sizes: list[int], pdt: torch.dtype, bad: list[list[int]]):
    params = {f"w{i}": torch.randn(n, generator=gen).to(pdt) for i, n in enumerate(sizes)}
    grads = {}
    for i, (n, where) in enumerate(zip(sizes, bad)):
        g = torch.randn(n, generator=gen).to(pdt)
        for j, x in zip(where, (float("inf"), float("nan"), -float("inf"))):
            g[j % n] = x
        grads[f"w{i}"] = g
    return params, grads


def _clone(tree):
    return sofx.tree.tree_map(torch.clone, tree)


def _warm_state(opt, params, gen):
    """A state after 40 steps (moments not zero, nor small next to a fresh gradient of the same law: such a
    step's inverse would be lossy, see tests/test_lossy_undo.py), and the params it left."""
    state = opt.init(params)
    for _ in range(40):
        grads = sofx.tree.tree_map(lambda p: torch.randn(p.shape, generator=gen).to(p.dtype), params)
        params, state, _ = opt.update(params, grads, state, grads_finite=True)
    return params, state


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits as integers (nan payloads compared too); counts as they are."""
    if not t.is_floating_point():
        return t
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _same(a, b) -> bool:
    la, lb = sofx.tree.flatten(a)[0], sofx.tree.flatten(b)[0]
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(la, lb))


def _trees(leaves: int) -> dict:
    """The strategies of a checked-step property: up to ``leaves`` leaves of up to 3 chunks and a bit, up to
    3 non-finite elements each (positions modulo the size), parameter dtype, donation, backend, copies."""
    return dict(sizes=st.lists(st.integers(1, 3 * FINITE_CHUNK + 50), min_size=1, max_size=leaves),
                bad=st.lists(st.lists(st.integers(0, 10**6), max_size=3), min_size=leaves, max_size=leaves),
                pdt=st.sampled_from([torch.float32, torch.bfloat16]), donate=st.booleans(),
                backend=st.sampled_from(["cpu", "cpu_fast"]),
                copies=st.sampled_from([None, torch.bfloat16, torch.float64]), seed=st.integers(0, 2**16))


def _copies_like(params, dtype):
    """A function making fresh parameter copies of ``dtype`` (None: no copies); bfloat16 ones are written by
    the kernel, float64 ones after it."""
    if dtype is None:
        return lambda: None
    return lambda: sofx.tree.tree_map(lambda p: torch.zeros(p.shape, dtype=dtype), params)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_trees(4))
def test_checked_update_is_the_unchecked_one_and_undoes(sizes, bad, pdt, donate, backend, copies, seed):
    gen = torch.Generator().manual_seed(seed)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend, state_dtype=torch.float32)
    params, _ = _tree(gen, sizes, pdt, bad)
    params, state = _warm_state(opt, params, gen)
    _, grads = _tree(gen, sizes, pdt, bad)
    make_copies = _copies_like(params, copies)
    before = (_clone(params), _clone(state))

    want_copies = make_copies()
    want = opt.update(_clone(params), grads, _clone(state), donate=True, grads_finite=True,
                      param_copies=want_copies)
    got_copies = make_copies()
    p_in, s_in = (_clone(params), _clone(state)) if donate else (params, state)
    got = opt.update(p_in, grads, s_in, donate=donate, param_copies=got_copies)
    assert _same(got[0], want[0]) and _same(got[1], want[1]) and _same(got_copies, want_copies)

    finite = [bool(torch.isfinite(grads[k]).all()) for k in sorted(grads)]
    normal = "param_snapshot" if pdt == torch.bfloat16 else "algebraic"
    strategies = got[2].strategies()
    for strategy, ok in zip(strategies, finite):
        # where a chunk's gradient is not finite: a snapshot of the chunks the step flagged (all of them: whole),
        # whole where the old parameter is kept anyway
        assert strategy == (normal if ok else "snapshot" if pdt == torch.bfloat16 else strategy), strategies
        assert ok or strategy in ("chunk_snapshot", "snapshot"), strategies
    if not donate:
        assert _same(params, before[0]) and _same(state, before[1])  # the inputs are untouched

    p0, s0 = opt.undo(got[0], got[1], got[2])
    assert _same(s0.count, before[1].count)
    for i, ok in enumerate(finite):
        k = f"w{i}"
        olds = (before[0][k], before[1].mu[k], before[1].nu[k])
        news = (p0[k], s0.mu[k], s0.nu[k])
        if strategies[i] == "snapshot" and (not donate or pdt == torch.float32):
            assert all(torch.equal(a, b) for a, b in zip(news, olds))  # the untouched inputs, or all chunks kept
            continue
        if not ok:  # the chunks with a non-finite gradient kept their old values exactly
            g = grads[k]
            for c in range(0, g.numel(), FINITE_CHUNK):
                if not bool(torch.isfinite(g[c:c + FINITE_CHUNK]).all()):
                    assert all(torch.equal(a[c:c + FINITE_CHUNK], b[c:c + FINITE_CHUNK]) for a, b in zip(news, olds))
        for a, b, stepped in zip(news, olds, (got[0][k], got[1].mu[k], got[1].nu[k])):
            if pdt == torch.bfloat16 and a is news[0]:
                assert torch.equal(a, b)  # param_snapshot: the old masters kept
                continue
            scale = max(float(b.double().abs().max()), float(stepped.double().nan_to_num(0, 0, 0).abs().max()))
            err = float((a.double() - b.double()).abs().max())
            assert err <= 1e-5 * scale, (k, err, scale)


@pytest.mark.parametrize("donate", [True, False])
def test_the_gradients_are_read_once(donate, rng, monkeypatch):
    """Contiguous CPU leaves with a native backend: no pass before the step (the step checks); a
    non-contiguous leaf is checked before, as are all of them with undo='algebraic'."""
    calls = []
    real = _adam._finite_flags
    monkeypatch.setattr(_adam, "_finite_flags",
                        lambda gs, scale, batched: calls.append(len(gs)) or real(gs, scale, batched))
    params = {"a": torch.randn(5000, generator=rng), "b": torch.randn(30, 40, generator=rng)}
    grads = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    opt = sofx.adamw(backend="cpu")
    p1, s1, rec = opt.update(params, grads, opt.init(params), donate=donate)
    assert calls == [] and rec.strategies() == ["algebraic", "algebraic"]
    grads["b"] = torch.randn(40, 30, generator=rng).t()  # not contiguous
    grads["b"][3, 4] = float("nan")
    _, _, rec = opt.update(p1, grads, s1)
    assert calls == [1] and rec.strategies() == ["algebraic", "snapshot"]
    calls.clear()
    strict = sofx.adamw(backend="cpu", undo="algebraic")
    strict.update(params, {k: g.contiguous() for k, g in grads.items()}, strict.init(params))
    assert calls == [2]


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast"])
@pytest.mark.parametrize("donate", [True, False])
def test_the_kernel_does_not_check_again_the_tensors_update_checked(backend, donate, rng, monkeypatch):
    """update's plain leaves (contiguous CPU tensors alike, in their storage, untraced; written ones writable) go
    to the kernel's table without its per-tensor checks (cpu._plain_native), with the same results; a leaf with a
    parameter copy (update does not vouch for the copy's layout), an empty one, and a call of the kernel's own
    are checked there as before."""
    checked = []
    real = cpu._plain_native
    monkeypatch.setattr(cpu, "_plain_native", lambda op, b, *a: checked.append(b.p.numel()) or real(op, b, *a))
    params = {"a": torch.randn(3000, generator=rng), "b": torch.randn(5, 7, generator=rng),
              "e": torch.randn(0, generator=rng)}
    grads = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    state = opt.init(params)
    want = opt.update(_clone(params), grads, _clone(state), grads_finite=True, undoable=False)
    checked.clear()
    got = opt.update(_clone(params), grads, _clone(state), donate=donate)
    assert checked == [0]  # (the empty leaf goes the checked way to its empty results)
    for k in params:
        for a, b in ((got[0][k], want[0][k]), (got[1].mu[k], want[1].mu[k]), (got[1].nu[k], want[1].nu[k])):
            assert torch.equal(a, b)
    checked.clear()
    copies = {"a": None, "b": torch.zeros(5, 7, dtype=torch.bfloat16), "e": None}
    opt.update(_clone(params), grads, _clone(state), donate=donate, param_copies=copies)
    assert sorted(checked) == [0, 35]
    assert torch.equal(copies["b"], want[0]["b"].bfloat16())
    checked.clear()
    p, g, m, v = (torch.randn(10, generator=rng) for _ in range(4))
    kernel = cpu if backend == "cpu" else importlib.import_module("sofx.kernels.cpu_fast")
    kernel.step_many([sofx.kernels.base.StepCall(p, g, m, v, want[2].leaves[0].scalars)], opt.variant)
    assert checked == [10]


def _undone_both_ways(opt, params, state, grads, grads2, donate, copies=None):
    """``(results, kernel checks)`` of an undo and of an undo_redo (new gradients, a new grad_scale) of an update of
    ``params``: each a fresh update's record, and the blocks the cpu kernels checked (``_plain_native``'s calls,
    recorded in ``_checks``) in that call."""
    out = []
    for redo in (False, True):
        p, s, rec = opt.update(_clone(params), grads, _clone(state))
        _checks.clear()
        res = opt.undo_redo(p, s, rec, grads2, grad_scale=0.5, donate=donate, param_copies=copies)[:2] if redo \
            else opt.undo(p, s, rec, donate=donate, param_copies=copies)
        out.append((res, list(_checks)))
    return out


_checks: list = []


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast"])
@pytest.mark.parametrize("donate", [True, False])
def test_the_kernel_does_not_check_again_the_tensors_undo_and_undo_redo_checked(backend, donate, rng, monkeypatch):
    """undo's and undo_redo's fused calls of plain leaves whose records keep nothing (algebraic: the record's
    gradient a plain tensor of the leaf's shape and dtype, contiguous in its storage, untraced; undo_redo's new
    gradient a plain leaf's) go to the kernel's table without its per-tensor checks (cpu._plain_native), with the
    results of the checked way; a record that keeps the parameter (param_snapshot), a leaf with a parameter copy,
    an empty one, and a call of the kernel's own are checked there as before."""
    real = cpu._plain_native
    monkeypatch.setattr(cpu, "_plain_native", lambda op, b, *a: _checks.append((op, b.p.numel())) or real(op, b, *a))
    params = {"a": torch.randn(3000, generator=rng), "b": torch.randn(5, 7, generator=rng),
              "e": torch.randn(0, generator=rng)}
    grads, grads2 = ({k: torch.randn(v.shape, generator=rng) for k, v in params.items()} for _ in range(2))
    step, undo, redo = cpu.src.OP_STEP, cpu.src.OP_UNDO, cpu.src.OP_UNDO_REDO
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    l2 = sofx.adam(lr=1e-2, weight_decay=0.1, backend=backend)  # (its first step keeps the parameter)
    warm = _warm_state(opt, params, rng)  # (a redo that is not lossy: fused, no chunk finished after it)
    for o, start, promised in ((opt, warm, True), (l2, (params, l2.init(params)), False)):
        got = _undone_both_ways(o, *start, grads, grads2, donate)
        with monkeypatch.context() as m:
            m.setattr(cpu, "_checked_native", lambda *a: None)  # the checked way, every block
            want = _undone_both_ways(o, *start, grads, grads2, donate)
        assert [c for _, c in want] == ([[(undo, 3000), (undo, 35), (undo, 0)], [(redo, 3000), (redo, 35), (redo, 0)]]
                                        if promised else [[(undo, 3000), (undo, 35), (undo, 0)],
                                                          [(undo, 3000), (step, 3000), (undo, 35), (step, 35),
                                                           (undo, 0), (step, 0)]])
        assert [c for _, c in got] == ([[(undo, 0)], [(redo, 0)]] if promised else [c for _, c in want])
        for (a, _), (b, _) in zip(got, want):
            assert _same(a, b)
    copies = {"a": None, "b": torch.zeros(5, 7, dtype=torch.bfloat16), "e": None}
    got = _undone_both_ways(opt, *warm, grads, grads2, donate, copies)
    assert [c for _, c in got] == [[(undo, 35), (undo, 0)], [(redo, 35), (redo, 0)]]
    assert torch.equal(copies["b"], got[1][0][0]["b"].bfloat16())
    _checks.clear()
    p, g, m, v = (torch.randn(10, generator=rng) for _ in range(4))
    kernel = cpu if backend == "cpu" else importlib.import_module("sofx.kernels.cpu_fast")
    s = sofx.kernels.base.AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 3, 1.0)
    kernel.undo_many([sofx.kernels.base.UndoCall(p, g, m, v, s)], opt.variant)
    kernel.undo_redo_many([sofx.kernels.base.UndoRedoCall(p, m, v, g, s, g.clone(), s)], opt.variant)
    assert _checks == [(undo, 10), (redo, 10)]


@pytest.mark.parametrize("redo", [False, True])
@pytest.mark.parametrize("donate", [True, False])
def test_a_record_gradient_undo_cannot_vouch_for_is_checked_in_the_kernel(redo, donate, rng, monkeypatch):
    """The kernels' promise covers a record's gradient only where undo and undo_redo proved it plain: one that is
    not contiguous (the step's gradient a transposed view) goes to the kernel's checks, with the results of a
    contiguous one; one that requires grad (in grad mode) makes the leaf autograd's, which backend 'cpu' refuses
    naming the leaf (the kernel refused it as its call's g before), nothing changed."""
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend="cpu")
    params = {"a": torch.randn(300, generator=rng), "b": torch.randn(5, 7, generator=rng)}
    grads = {"a": torch.randn(300, generator=rng), "b": torch.randn(7, 5, generator=rng).t()}
    grads2 = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    p1, s1 = _warm_state(opt, params, rng)  # (the step undone algebraically: its record keeps the gradient alone)

    def undone(grads):
        p, s, rec = opt.update(_clone(p1), grads, _clone(s1))
        assert rec.strategies() == ["algebraic", "algebraic"]
        if redo:
            return opt.undo_redo(p, s, rec, grads2, grad_scale=0.5, donate=donate)[:2]
        return opt.undo(p, s, rec, donate=donate)

    real = cpu._plain_native
    monkeypatch.setattr(cpu, "_plain_native", lambda op, b, *a: _checks.append(b.p.numel()) or real(op, b, *a))
    _checks.clear()
    got = undone(grads)
    assert _checks[-1:] == [35]
    assert _same(got, undone({k: g.contiguous() for k, g in grads.items()}))
    p, s, rec = opt.update(_clone(p1), grads2, _clone(s1))
    rec.leaves[1].grad = rec.leaves[1].grad.clone().requires_grad_()
    before = _clone((p, s))
    with pytest.raises(sofx.UnsupportedError, match=r"params\['b'\]: backend 'cpu' cannot run under .*autograd"):
        if redo:
            opt.undo_redo(p, s, rec, grads2, grad_scale=0.5, donate=donate)
        else:
            opt.undo(p, s, rec, donate=donate)
    assert _same((p, s), before) and not rec.used


def test_the_layout_of_leaves_update_checked_is_not_tested_again(rng, monkeypatch):
    """Whether a leaf's step is checked in its kernel asks for one dense layout; _gather proved it of plain leaves
    (contiguous tensors alike), which are not tested again (one_dense_layout); a non-contiguous leaf, one with a
    parameter copy and an empty one are, and are checked in the kernel or not as before."""
    tested = []
    real = _adam.one_dense_layout
    monkeypatch.setattr(_adam, "one_dense_layout", lambda p, others: tested.append(p.shape) or real(p, others))
    params = {"a": torch.randn(3000, generator=rng), "b": torch.randn(5, 7, generator=rng),
              "t": torch.randn(7, 5, generator=rng).t(), "e": torch.randn(0, generator=rng)}
    grads = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    grads["t"] = torch.randn(7, 5, generator=rng).t()
    grads["b"][2, 3] = float("nan")
    opt = sofx.adamw(lr=1e-2, backend="cpu")
    state = opt.init(params)
    leaves = opt._gather(params, grads, state, None)[1]
    kernels = opt._kernels(leaves)
    copies = [None, torch.zeros(5, 7), None, None]
    assert opt._checked_in_step(leaves, kernels, [None] * 4, 1.0) == [True, True, True, True]
    assert tested == [(0,), (5, 7)]  # e, t (leaves in the order of the keys)
    tested.clear()
    assert opt._checked_in_step(leaves, kernels, copies, 1.0) == [True, True, True, True]
    assert tested == [(5, 7), (0,), (5, 7)]  # b (a copy), e, t
    _, _, rec = opt.update(params, grads, state)
    assert rec.strategies() == ["algebraic", "snapshot", "algebraic", "algebraic"]  # (b: its one chunk flagged)


def test_undo_redo_after_a_checked_update_with_an_overflow(rng):
    """The speculation's sequence after an overflowing step: the record of the checked update is
    undone and redone with clean gradients, as after an unchecked update."""
    params = {"a": torch.randn(2 * FINITE_CHUNK + 3, generator=rng), "b": torch.randn(7, generator=rng)}
    opt = sofx.adamw(lr=1e-2, backend="cpu")
    params, state = _warm_state(opt, params, rng)
    bad = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    bad["a"][FINITE_CHUNK + 1] = float("inf")
    clean = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    want = opt.update(_clone(params), clean, _clone(state), grads_finite=True)
    p1, s1, rec = opt.update(_clone(params), bad, _clone(state), donate=True)
    assert rec.strategies() == ["chunk_snapshot", "algebraic"] and rec.leaves[0].chunks.tolist() == [1]
    p2, s2, _ = opt.undo_redo(p1, s1, rec, clean, donate=True)
    for k in params:
        assert torch.allclose(p2[k], want[0][k], rtol=0, atol=1e-6)
        assert torch.allclose(s2.mu[k], want[1].mu[k], rtol=0, atol=1e-6)
        assert torch.allclose(s2.nu[k], want[1].nu[k], rtol=1e-5, atol=1e-12)


def test_undo_redo_with_the_records_own_gradient_does_not_read_it(rng, monkeypatch):
    """A late clip redoes with the gradient tensor the step used (algebraic record: it was finite);
    a new gradient tensor is checked, in the fused kernel (a first step's redo too: float32 moments, no L2
    decay), which flags its chunk with an inf instead of a pass before."""
    calls = []
    real = _adam._finite_flags
    monkeypatch.setattr(_adam, "_finite_flags",
                        lambda gs, scale, batched: calls.append(len(gs)) or real(gs, scale, batched))
    params = {"a": torch.randn(300, generator=rng), "b": torch.randn(7, generator=rng)}
    grads = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    opt = sofx.adamw(lr=1e-2, backend="cpu")
    p1, s1, rec = opt.update(params, grads, opt.init(params))
    want = opt.undo_redo(p1, s1, rec, grads, grad_scale=0.5, grads_finite=True)
    p1, s1, rec = opt.update(params, grads, opt.init(params))
    got = opt.undo_redo(p1, s1, rec, grads, grad_scale=0.5)
    assert calls == [] and _same(got[0], want[0]) and _same(got[1], want[1])
    assert got[2].strategies() == ["algebraic", "algebraic"]
    other = {"a": grads["a"], "b": grads["b"].clone()}
    other["b"][0] = float("inf")
    _, _, rec2 = opt.undo_redo(*opt.update(params, grads, opt.init(params)), other)
    assert calls == [] and rec2.strategies() == ["algebraic", "snapshot"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_trees(3))
def test_checked_undo_redo_is_the_unchecked_one_and_undoes(sizes, bad, pdt, donate, backend, copies, seed):
    """undo_redo with new gradients, some with an inf or a nan, not hinted: the fused kernel checks them
    (bf16 masters too: the redo keeps the old parameter that the undone record kept). The results are the
    hinted call's bit for bit; a leaf whose new gradient is not finite gets a snapshot record of the chunks
    the kernel flagged (a whole one where that is all of them, or where the masters are bf16, as update's)
    whose undo restores the undone state (what undo of the first update gives): exactly in the kept chunks,
    algebraically in the others (a bf16 master's whole snapshot with donation: exactly in the flagged chunks,
    elsewhere the redo's inverse of its results, as update's)."""
    gen = torch.Generator().manual_seed(seed)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend, state_dtype=torch.float32)
    params, _ = _tree(gen, sizes, pdt, [[]] * len(sizes))
    params, state = _warm_state(opt, params, gen)
    _, first = _tree(gen, sizes, pdt, [[]] * len(sizes))
    _, new = _tree(gen, sizes, pdt, bad)
    make_copies = _copies_like(params, copies)

    def stepped():
        return opt.update(_clone(params), first, _clone(state), donate=True, grads_finite=True)

    want_copies, got_copies = make_copies(), make_copies()
    want = opt.undo_redo(*stepped(), new, grad_scale=0.5, donate=True, grads_finite=True, param_copies=want_copies)
    p1, s1, r1 = stepped()
    before = (_clone(p1), _clone(s1))
    got = opt.undo_redo(p1, s1, r1, new, grad_scale=0.5, donate=donate, param_copies=got_copies)
    assert _same(got[0], want[0]) and _same(got[1], want[1]) and _same(got_copies, want_copies)
    if not donate:
        assert _same(p1, before[0]) and _same(s1, before[1])
    finite = [bool(torch.isfinite(new[k]).all()) for k in sorted(new)]
    normal = "param_snapshot" if pdt == torch.bfloat16 else "algebraic"
    strategies = got[2].strategies()
    for strategy, ok in zip(strategies, finite):
        assert strategy == (normal if ok else "snapshot" if pdt == torch.bfloat16 else strategy), strategies
        assert ok or strategy in ("chunk_snapshot", "snapshot"), strategies

    undone = opt.undo(*stepped())  # the state the redo started from
    p0, s0 = opt.undo(got[0], got[1], got[2])
    for i, ok in enumerate(finite):
        k = f"w{i}"
        if ok:
            continue
        rec = got[2].leaves[i]
        kept = range(-(-new[k].numel() // FINITE_CHUNK)) if rec.strategy == "snapshot" else rec.chunks.tolist()
        flagged = [c // FINITE_CHUNK for c in range(0, new[k].numel(), FINITE_CHUNK)
                   if not bool(torch.isfinite(new[k][c:c + FINITE_CHUNK]).all())]
        assert set(flagged) <= set(kept)
        exact = flagged if rec.strategy == "snapshot" and donate and pdt == torch.bfloat16 else kept
        for a, b in zip((p0[k], s0.mu[k], s0.nu[k]), (undone[0][k], undone[1].mu[k], undone[1].nu[k])):
            for c in exact:  # the undo of the old step there, as the fused kernel had it
                there = slice(c * FINITE_CHUNK, (c + 1) * FINITE_CHUNK)
                assert torch.equal(a[there], b[there])
            scale = float(b.double().abs().max())
            assert float((a.double() - b.double()).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("donate", [True, False])
def test_first_checked_step_with_an_overflow_undoes_to_zero_moments(donate, rng):
    """The first step from init with an inf in one chunk: the chunk snapshot's moments are exactly the zeros
    the step started from, the parameters exact in that chunk, within an algebraic undo's rounding in the
    others."""
    params = {"w": torch.randn(2 * FINITE_CHUNK + 9, generator=rng)}
    g = torch.randn(params["w"].shape, generator=rng)
    g[FINITE_CHUNK + 3] = float("inf")
    opt = sofx.adamw(lr=1e-2, backend="cpu_fast")
    state = opt.init(params)
    p1, s1, rec = opt.update(_clone(params), {"w": g}, _clone(state), donate=donate)
    want = opt.update(_clone(params), {"w": g}, _clone(state), grads_finite=True)
    assert _same(p1, want[0]) and _same(s1, want[1]) and rec.strategies() == ["chunk_snapshot"]
    p0, s0 = opt.undo(p1, s1, rec)
    assert torch.equal(s0.mu["w"], state.mu["w"]) and torch.equal(s0.nu["w"], state.nu["w"])
    assert torch.equal(s0.count["w"], state.count["w"])
    assert torch.allclose(p0["w"], params["w"], rtol=1e-6, atol=0)
    assert torch.equal(p0["w"][FINITE_CHUNK:2 * FINITE_CHUNK], params["w"][FINITE_CHUNK:2 * FINITE_CHUNK])


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_finite_gradient_whose_square_overflows_is_undone_exactly(backend, donate, rng):
    """|g * grad_scale| beyond GRADIENT_LIMIT: v' may be inf, whose algebraic inverse is nan; such a leaf
    gets a snapshot record (the checked kernels flag its chunk and keep it, the others' pass finds it and keeps
    the leaf), so its undo and a late clip's undo+redo are exact there and finite."""
    from sofx.kernels.base import GRADIENT_LIMIT

    opt = sofx.adamw(lr=1e-3, backend=backend)
    params = {"w": torch.randn(2 * FINITE_CHUNK + 5, generator=rng), "b": torch.randn(9, generator=rng)}
    params, state = _warm_state(opt, params, rng)
    huge = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    huge["w"][FINITE_CHUNK + 7] = 3.0 * GRADIENT_LIMIT  # finite; its square overflows float32
    before = (_clone(params), _clone(state))
    new_p, new_s, rec = opt.update(_clone(params) if not donate else params,
                                   huge, _clone(state) if not donate else state, donate=donate)
    kept = "snapshot" if backend == "reference" else "chunk_snapshot"
    assert rec.strategies() == ["algebraic", kept]  # b, then w
    old_p, old_s = opt.undo(new_p, new_s, rec)
    was_p, was_s = before
    # the snapshot: exact (a chunk snapshot exact in the flagged chunk; the others recovered algebraically)
    flagged = slice(FINITE_CHUNK, 2 * FINITE_CHUNK) if backend != "reference" else slice(None)
    assert all(torch.equal(a[flagged], b[flagged]) for a, b in (
        (old_p["w"], was_p["w"]), (old_s.mu["w"], was_s.mu["w"]), (old_s.nu["w"], was_s.nu["w"])))
    for a, b in ((old_p["w"], was_p["w"]), (old_s.mu["w"], was_s.mu["w"]), (old_s.nu["w"], was_s.nu["w"]),
                 (old_p["b"], was_p["b"]), (old_s.mu["b"], was_s.mu["b"]), (old_s.nu["b"], was_s.nu["b"])):
        assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    # at a quarter of the scale the same gradient is within the limit (for undo="auto" still a spike whose
    # inverse would be lossy: a snapshot); undo="algebraic" inverts it there, and refuses to at full scale
    _, _, rec = opt.update(_clone(before[0]), huge, _clone(before[1]), grad_scale=0.25)
    assert rec.strategies() == ["algebraic", kept]
    strict = sofx.adamw(lr=1e-3, backend=backend, undo="algebraic")
    _, _, rec = strict.update(_clone(before[0]), huge, _clone(before[1]), grad_scale=0.25)
    assert rec.strategies() == ["algebraic", "algebraic"]
    _, _, rec = strict.update(_clone(before[0]), huge, _clone(before[1]))
    assert rec.strategies() == ["algebraic", "none"]
