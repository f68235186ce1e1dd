"""Steps whose algebraic inverse would be too lossy (SPECULATION.md section 2: "impossible or too lossy
algebraically -- detect per block and per step").

Where a gradient dominates the second moment (a spike, a rarely updated row) the inverse
``v = (v' - (1 - b2) gh^2) / b2`` loses v to cancellation: a gradient 1000x the ones before it left v 62%
off. ``sofx.kernels.base.lossy_elements`` is the test; the CPU kernels' checked step flags the chunks that
hold such an element (the vector loops as they read the next chunk, the other builds in a pass per chunk);
``Adam.update`` with ``undo="auto"`` gives such a leaf a snapshot record, on every backend.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import sofx
from sofx.errors import UndoError, UnsupportedError
from sofx.kernels import cpu, cpu_fast, reference
from sofx.kernels.base import (FINITE_CHUNK, LOSSY_M_RATIO, LOSSY_V_RATIO, AdamScalars, AdamVariant, StepCall,
                               UndoRedoCall, any_lossy, beyond_limit, lossy_elements, lossy_factor)

native = pytest.mark.skipif(not cpu.native_available(), reason="no C compiler: no native checked steps")

COMBOS = [(torch.float32, torch.float32, torch.float32), (torch.float32, torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.float32, torch.bfloat16)]


def test_lossy_factor_is_the_tighter_of_the_two_bounds():
    v_bound, m_bound = (1 - 0.999) / (LOSSY_V_RATIO * 0.999), (0.1 / (LOSSY_M_RATIO * 0.9)) ** 2
    assert lossy_factor(0.9, 0.999) == pytest.approx(max(v_bound, m_bound))
    assert lossy_factor(0.9, 0.99) == pytest.approx((1 - 0.99) / (LOSSY_V_RATIO * 0.99))
    assert lossy_factor(0.5, 0.999) == pytest.approx((0.5 / (LOSSY_M_RATIO * 0.5)) ** 2)
    assert lossy_factor(0.0, 0.999) == 0.0


def test_lossy_elements_by_hand():
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 10, 1.0)
    v = torch.tensor([1.0, 1.0, 0.0, float("nan"), 1e-6, float("inf"), 0.0, 0.0])
    g = torch.tensor([50.0, 60.0, 1e6, 0.0, 1.0, 1e6, 0.0, 1e-6])
    p = torch.zeros(8)
    # c = (1 - b2) / (3 b2): 50^2 * c = 0.83 <= 1; 60^2 * c = 1.2 > 1; v = 0 with a gradient always (its inverse
    # keeps a leftover of the step's rounding), without one never; nan v always; 1 * c > 1e-6; inf v never
    assert lossy_elements(p, g, v, s, True).tolist() == [False, True, True, True, True, False, False, True]
    # a step from zero moments that its undo zeroes (StepCall.zero_moments): a factor of 0, only nan flagged
    assert lossy_elements(p, g, v, s, True, zero_moments=True).tolist() == [False] * 3 + [True] + [False] * 4
    # L2: the decay term is part of the effective gradient (p * wd = 30)
    s2 = s._replace(weight_decay=1.0)
    p2 = torch.tensor([30.0, 0, 0, 0, 0, 0, 0, 0])
    assert lossy_elements(p2, g, v, s2, False)[0] and not lossy_elements(p2, g, v, s2, True)[0]
    # the redo of an undo+redo: against the undone v (v' = 1 made mostly of a gradient of 31.6: undone v 1e-3)
    vr = torch.tensor([1.0])
    assert lossy_elements(torch.zeros(1), torch.tensor([10.0]), vr, s, True, torch.tensor([31.6]), s)[0]
    assert not lossy_elements(torch.zeros(1), torch.tensor([10.0]), vr, s, True, torch.tensor([1.0]), s)[0]


def _planted(gen, n, combo, where):
    """Inputs whose steps are sound but at ``where`` (gradient 1000x); also a zero v with no effective gradient
    (g, p and m 0: not flagged) in the first chunk. (Parameters of 0.1: in L2 mode, with a decay of 0.1,
    ``wd |p|`` well below sqrt(v), so that the recovered p's error through it (base.py's ``_l2_term``) flags
    nothing either; m 0 there too: beside a zero v a nonzero m takes a step of m / eps, whose recovered p is
    off by an ulp of that, which the L2 term flags.)"""
    pdt, gdt, sdt = combo
    p = (0.1 * torch.randn(n, generator=gen)).to(pdt)
    g = (0.01 * torch.randn(n, generator=gen)).to(gdt)
    m = (0.01 * torch.randn(n, generator=gen)).to(sdt)
    v = (1e-4 * (1 + torch.rand(n, generator=gen))).to(sdt)
    for i in where:
        g[i % n] = 10.0
    v[7 % n] = g[7 % n] = p[7 % n] = m[7 % n] = 0.0
    return p, g, m, v


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.view(torch.int16 if b.element_size() == 2 else torch.int32))


def _flags(backend, variant: AdamVariant, call: StepCall | UndoRedoCall) -> list[int]:
    """The chunk flags ``backend``'s checked form of ``call`` (a step or an undo+redo, not donated) sets."""
    flags = torch.zeros(-(-call.p.numel() // FINITE_CHUNK), dtype=torch.uint8)
    run = backend.step_many if isinstance(call, StepCall) else backend.undo_redo_many
    run([call._replace(skip=flags)], variant)
    return flags.tolist()


def _want_flags(bad: torch.Tensor, n: int) -> list[int]:
    return torch.nn.functional.pad(bad, (0, -n % FINITE_CHUNK)).view(-1, FINITE_CHUNK).any(dim=1).to(
        torch.uint8).tolist()


# Elements in the vector loops' view of a chunk (first, middle, the last full vector, the partial last vector
# of an odd-sized last chunk) and a size that leaves a partial last chunk.
_TAIL = FINITE_CHUNK // 4 - 24  # (1000 with chunks of 4096) plus 7: a last chunk with a partial vector of 15
_N = 6 * FINITE_CHUNK + _TAIL + 7
_WHERE = [FINITE_CHUNK + 0, 2 * FINITE_CHUNK + FINITE_CHUNK // 2 + 1, 4 * FINITE_CHUNK - 1,
          6 * FINITE_CHUNK + _TAIL + 3]


@native
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(d)[6:] for d in c))
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("backend", [cpu, cpu_fast], ids=["cpu", "cpu_fast"])
def test_checked_step_flags_the_lossy_chunks(combo, decoupled, backend, rng):
    variant = AdamVariant(decoupled=decoupled)
    p, g, m, v = _planted(rng, _N, combo, _WHERE)
    v[5 * FINITE_CHUNK + 5] = float("nan")
    m[4 * FINITE_CHUNK + 17] = float("-inf")  # a non-finite first moment: its inverse would give a nan p
    p[100], v[100] = float("inf"), 0.0  # an inf parameter where v is 0: in L2 mode an inf effective gradient
    g[100] = 0.0  # (no gradient: else a zero v is flagged in either mode)
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 50, 0.5)
    bad = lossy_elements(p, g, v, s, decoupled, m=m) | beyond_limit(g, s.grad_scale)
    want = _want_flags(bad, _N)
    assert sum(want) == 6 + (not decoupled) and want[0] == (not decoupled)
    flags = torch.zeros(len(want), dtype=torch.uint8)
    out = [t.clone() for t in (p, m, v)]
    backend.step_many([StepCall(p, g, m, v, s, tuple(out), None, flags)], variant)
    assert flags.tolist() == want
    plain = backend.step(p, g, m, v, s, variant)
    for got, was, full in zip(out, (p, m, v), plain):  # flagged chunks untouched, the others stepped
        for c, f in enumerate(want):
            a, b = c * FINITE_CHUNK, min(_N, (c + 1) * FINITE_CHUNK)
            assert _same_bits(got[a:b], (was if f else full)[a:b])
    ref = torch.zeros_like(flags)  # the Python form of a checked step (no compiler) flags the same chunks
    cpu._reference_checked(0, cpu._Block(p, g, m, v, None, None, s, None, None, None, ref), variant, s, None)
    assert ref.tolist() == want


@native
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(d)[6:] for d in c))
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("with_p_old", [False, True], ids=["", "p_old"])
def test_checked_undo_redo_flags_against_the_undone_moment(combo, decoupled, with_p_old, rng):
    """The redo is tested against the undone v: an old step whose gradient made up most of v' leaves a small
    undone v, against which a new gradient of ordinary size is a spike."""
    variant = AdamVariant(decoupled=decoupled)
    p0, g_old, m0, v0 = _planted(rng, _N, combo, [])
    s_old = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 50, 1.0)
    g_old[_WHERE[1]] = 10.0  # the undone step was a spike: its undone v is small there
    p1, m1, v1 = cpu.step(p0, g_old, m0, v0, s_old, variant)
    g_new = g_old.clone()
    g_new[_WHERE[1]] = 0.01
    g_new[_WHERE[3]] = 10.0  # and a spike of the new gradient
    m1[4 * FINITE_CHUNK + 100] = float("nan")  # and a non-finite m'
    p0[200] = p1[200] = float("inf")  # and an inf parameter where v' is 0 (L2: an inf effective gradient)
    v1[200] = 0.0
    g_new[200] = 0.0  # (no new gradient: else the undone v of 0 is flagged in either mode)
    s_new = s_old._replace(grad_scale=0.25)
    p_old = p0 if with_p_old else None
    bad = lossy_elements(p_old if with_p_old else p1, g_new, v1, s_new, decoupled, g_old, s_old, m=m1)
    want = _want_flags(bad | beyond_limit(g_new, s_new.grad_scale), _N)
    assert want[2] == 0 and want[4] == 1 and want[-1] == 1  # the undone spike is no spike of the redo (v' holds it)
    assert bool(bad[200]) == (not decoupled)
    for backend in (cpu, cpu_fast):
        flags = torch.zeros(len(want), dtype=torch.uint8)
        backend.undo_redo_many([UndoRedoCall(p1, m1, v1, g_old, s_old, g_new, s_new, p_old, None, None, flags)],
                               variant)
        assert flags.tolist() == want
        ref = torch.zeros_like(flags)
        cpu._reference_checked(2, cpu._Block(p1, g_old, m1, v1, g_new, p_old, s_old, s_new, None, None, ref),
                               variant, s_old, s_new)
        assert ref.tolist() == want


def _zero_v_planted(gen, combo):
    """Sound inputs (:func:`_planted`) with a zero v where the vector loops read a chunk (``_WHERE``, each with
    its gradient) and chunk 5 all zero (v, m, g and p: no effective gradient in L2 mode either)."""
    p, g, m, v = _planted(gen, _N, combo, [])
    for i in _WHERE:
        v[i] = 0.0
    five = slice(5 * FINITE_CHUNK, 6 * FINITE_CHUNK)
    for t in (p, g, m, v):
        t[five] = 0.0
    return p, g, m, v


@native
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(d)[6:] for d in c))
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_checked_calls_flag_a_zero_v_with_a_gradient(combo, decoupled, rng):
    """A v of 0 (an embedding row no token used yet) given a gradient: its inverse keeps ~1e-7 of v' (the
    step's and the inverse's roundings of (1 - b2) gh^2 differ), which a heavily clipped redo magnified (v
    1.2e-3 off). Flagged as lossy_elements finds it, in a checked step and in an undo+redo whose undone v is
    0 (m not: gradients whose squares underflowed); a zero v without an effective gradient is not, nor a step
    with zero_moments (a leaf's first step from init, whose undo zeroes the moments) but where its gradient is
    not finite, nor moments both exactly 0 that the inverse gives back exactly (float32 moments, decoupled
    decay: test_exact_zero_moments_are_not_flagged)."""
    variant = AdamVariant(decoupled=decoupled)
    p, g, m, v = _zero_v_planted(rng, combo)
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 50, 0.5)
    g_old = g.clone()
    for i in _WHERE:
        g_old[i] = 0.0  # the undone step added nothing there: its undone v is 0
    s_old = s._replace(step=49, grad_scale=1.0, weight_decay=0.01)  # (L2: an undone v near v')
    want = _want_flags(lossy_elements(p, g, v, s, decoupled, m=m) | beyond_limit(g, s.grad_scale), _N)
    want_redo = _want_flags(lossy_elements(p, g, v, s, decoupled, g_old, s_old, m=m)
                            | beyond_limit(g, s.grad_scale), _N)
    assert want == want_redo == [0, 1, 1, 1, 0, 0, 1]
    zeros = torch.zeros_like(v)
    g_inf = g.clone()
    g_inf[3 * FINITE_CHUNK + 9] = float("inf")
    want_zero = _want_flags(lossy_elements(p, g_inf, zeros, s, decoupled, m=zeros, zero_moments=True)
                            | beyond_limit(g_inf, s.grad_scale), _N)
    assert want_zero == [0, 0, 0, 1, 0, 0, 0]
    for backend in (cpu, cpu_fast):
        assert _flags(backend, variant, StepCall(p, g, m, v, s)) == want
        assert _flags(backend, variant, UndoRedoCall(p, m, v, g_old, s_old, g, s)) == want_redo
        assert _flags(backend, variant, StepCall(p, g_inf, zeros, zeros, s, zero_moments=True)) == want_zero
        # without zero_moments: every chunk with a gradient, but where the inverse gives exact zeros back
        # (float32 moments, no L2 decay: base.zeros_come_back)
        exact = combo[2] == torch.float32 and decoupled
        assert _flags(backend, variant, StepCall(p, g_inf, zeros, zeros, s)) == (
            want_zero if exact else [1, 1, 1, 1, 1, 0, 1])
    for op, block, flags_want in (
            (0, cpu._Block(p, g, m, v, None, None, s, None, None, None), want),
            (2, cpu._Block(p, g_old, m, v, g, None, s_old, s, None, None), want_redo),
            (0, cpu._Block(p, g_inf, zeros, zeros, None, None, s, None, None, None, None, True), want_zero)):
        ref = torch.zeros(len(want), dtype=torch.uint8)  # the Python form of a checked call (no compiler)
        cpu._reference_checked(op, block._replace(skip=ref), variant, block.s1, block.s2)
        assert ref.tolist() == flags_want


@native
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(d)[6:] for d in c))
@pytest.mark.parametrize("betas", [(0.0, 0.999), (0.9, 0.0)], ids=["beta1-0", "beta2-0"])
def test_checked_steps_flag_what_lossy_elements_finds_with_a_lossy_factor_of_0(combo, betas, rng):
    """A beta of 0 makes lossy_factor 0: no step is too lossy then, but a nan v, a non-finite m and (L2) an inf
    parameter are still flagged (lossy_elements), which the native checked step and undo+redo skipped."""
    s = AdamScalars(1e-3, *betas, 1e-8, 0.1, 50, 0.5)
    s_old = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 49, 1.0)  # the undone step of an undo+redo: invertible
    assert lossy_factor(*betas) == 0.0
    p, g, m, v = _planted(rng, _N, combo, _WHERE)  # its spikes are not lossy with a factor of 0
    g2 = (0.01 * torch.randn(_N, generator=rng)).to(g.dtype)
    v[5 * FINITE_CHUNK + 5] = float("nan")
    m[4 * FINITE_CHUNK + 17] = float("-inf")
    m[_N - 2] = float("nan")  # in the partial last vector of the partial last chunk
    p[100], v[100] = float("inf"), 0.0  # an inf parameter where v is 0: in L2 mode an inf effective gradient
    for decoupled in (True, False):
        variant = AdamVariant(decoupled=decoupled)
        want = _want_flags(lossy_elements(p, g, v, s, decoupled, m=m) | beyond_limit(g, s.grad_scale), _N)
        want_redo = _want_flags(lossy_elements(p, g2, v, s, decoupled, g, s_old, m=m)
                                | beyond_limit(g2, s.grad_scale), _N)
        assert want == want_redo == [int(not decoupled), 0, 0, 0, 1, 1, 1]
        for backend in (cpu, cpu_fast):
            assert _flags(backend, variant, StepCall(p, g, m, v, s)) == want
            assert _flags(backend, variant, UndoRedoCall(p, m, v, g, s_old, g2, s)) == want_redo


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_first_step_from_init_keeps_no_snapshot(backend, donate):
    """A leaf's first step from init: every v is 0, but its undo zeroes the moments (moments_were_zero), so
    no element is lossy (the checked kernels are told so: StepCall.zero_moments). The record keeps nothing,
    its undo gives the init state back, and its heavily clipped redo is the clipped step; a leaf with a row
    whose moments are still 0 after the first step (no gradient there) keeps nothing at that row's first
    gradient either (its inverse gives the zeros back exactly: test_exact_zero_moments_are_not_flagged)."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(6)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    params = {"w": torch.randn(3 * FINITE_CHUNK + 5, generator=gen), "b": torch.randn(37, generator=gen)}
    grads = {k: torch.randn(x.shape, generator=gen) for k, x in params.items()}
    grads["w"][FINITE_CHUNK:2 * FINITE_CHUNK] = 0.0  # rows no token has used
    init = opt.init(params)

    def clone(tree):
        return sofx.tree.tree_map(torch.clone, tree)

    p1, s1, rec = opt.update(clone(params), grads, clone(init), donate=donate)
    assert rec.strategies() == ["algebraic", "algebraic"] and rec.snapshot_bytes() == 0
    assert all(leaf.moments_were_zero for leaf in rec.leaves)
    p0, s0 = opt.undo(p1, s1, rec, donate=donate)
    assert all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten(s0)[0], sofx.tree.flatten(init)[0]))
    assert all(_rel(p0[k], params[k]) <= 1e-6 for k in params)
    p1, s1, rec = opt.update(clone(params), grads, clone(init), donate=donate)
    p2, s2, rec2 = opt.undo_redo(p1, s1, rec, grads, grad_scale=1e-3, donate=donate)
    want = opt.update(clone(params), grads, clone(init), grad_scale=1e-3)
    assert rec2.strategies() == ["algebraic", "algebraic"] and all(leaf.moments_were_zero for leaf in rec2.leaves)
    assert all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten(s2)[0], sofx.tree.flatten(want[1])[0]))
    assert all(_rel(p2[k], want[0][k]) <= 1e-6 for k in params)  # (from the undone p: a few ulps)
    # the second step: the rows whose v is still 0 get a gradient (the others the first one's: a sound inverse)
    g3 = clone(grads)
    g3["w"][FINITE_CHUNK:2 * FINITE_CHUNK] = torch.randn(FINITE_CHUNK, generator=gen)
    p1, s1, _ = opt.update(clone(params), grads, clone(init))
    _, _, rec3 = opt.update(p1, g3, s1, donate=donate)
    assert rec3.strategies() == ["algebraic", "algebraic"] and rec3.snapshot_bytes() == 0


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("mode", ["adamw", "adam-no-decay", "adam-l2", "bf16-moments"])
def test_exact_zero_moments_are_not_flagged(backend, mode):
    """Rows whose moments are still exactly 0 after many steps (an embedding's rows no token used yet) get a
    gradient: every backend's inverse subtracts the step's own roundings, so undo gives m = v = 0 back exactly
    and a heavily clipped redo (a global norm 1000x max_norm) equals the clipped step from the state before:
    nothing is kept for them (base.zeros_come_back). Where the inverse cannot be exact (L2 decay: its effective
    gradient is from the recovered p; bfloat16 moments: v' is the term rounded) their chunks are still kept.
    (The Triton backend: test_kernels_triton.py.)"""
    if backend in ("cpu", "cpu_fast") and not cpu.native_available():
        pytest.skip("no C compiler")
    check_exact_zero_moments(backend, mode)


def check_exact_zero_moments(backend: str, mode: str) -> None:
    """:func:`test_exact_zero_moments_are_not_flagged` on one backend and mode (float32 parameters: bfloat16
    ones are kept whole whatever the moments, adam.py's ``_rounded``)."""
    gen = torch.Generator().manual_seed(11)
    decoupled = mode not in ("adam-no-decay", "adam-l2")
    make = sofx.adamw if decoupled else sofx.adam
    kw = {"state_dtype": torch.bfloat16} if mode == "bf16-moments" else {}
    opt = make(lr=1e-3, weight_decay=0.0 if mode == "adam-no-decay" else 0.05, backend=backend, undo="auto", **kw)
    n = 4 * FINITE_CHUNK + 37
    params = {"w": torch.randn(n, generator=gen)}
    unused = slice(FINITE_CHUNK, 3 * FINITE_CHUNK + 11)  # rows without a gradient so far
    if mode == "adam-l2":
        params["w"][unused] = 0.0  # (else their L2 term is a gradient)
    state = opt.init(params)
    for _ in range(30):  # (v past its first steps: ordinary gradients are sound)
        g = {"w": torch.randn(n, generator=gen)}
        g["w"][unused] = 0.0
        params, state, _ = opt.update(params, g, state)
    assert not state.nu["w"][unused].any() and not state.mu["w"][unused].any()
    g = {"w": torch.randn(n, generator=gen)}
    before = sofx.tree.tree_map(torch.clone, (params, state))

    def update(**kw):
        return opt.update(*sofx.tree.tree_map(torch.clone, before)[:1], g, sofx.tree.tree_map(torch.clone, before)[1],
                          **kw)

    p1, s1, rec = update()
    if mode not in ("adamw", "adam-no-decay"):  # the rows' chunks kept (chunk snapshots or the whole leaf)
        assert rec.strategies() != ["algebraic"]
        return
    assert rec.strategies() == ["algebraic"] and rec.snapshot_bytes() == 0
    _, s0 = opt.undo(p1, s1, rec)
    assert not s0.mu["w"][unused].any() and not s0.nu["w"][unused].any()  # exactly 0 again
    assert _rel(s0.nu["w"], before[1].nu["w"]) <= 1e-6
    assert float(((s0.mu["w"] - before[1].mu["w"]).abs() / before[1].nu["w"].sqrt().clamp_min(1e-30)).max()) <= 2e-6
    clip = 1e-3
    p1, s1, rec = update()
    p2, s2, rec2 = opt.undo_redo(p1, s1, rec, g, grad_scale=clip)
    assert rec2.strategies() == ["algebraic"]  # (the redo from the exact zeros: undoable exactly again)
    want_p, want_s, _ = update(grad_scale=clip)
    for got, want in ((s2.mu["w"], want_s.mu["w"]), (s2.nu["w"], want_s.nu["w"])):
        assert torch.equal(got[unused], want[unused])  # stepped from the exact zeros: bit for bit
    # the other rows as test_a_spike_is_undone_within_the_tolerance allows
    assert _rel(s2.nu["w"], want_s.nu["w"]) <= 1e-6
    assert float(((s2.mu["w"] - want_s.mu["w"]).abs() / want_s.nu["w"].sqrt().clamp_min(1e-30)).max()) <= 2e-6
    assert float((p2["w"] - want_p["w"]).abs().max()) <= 1e-6 * float(want_p["w"].abs().max())


# Elements of a zero-moment row (both moments exactly 0) where the vector loops read a chunk: its first
# element, the middle, the last full vector, the partial last vector of the partial last chunk.
_ZERO_ROWS = [FINITE_CHUNK, 2 * FINITE_CHUNK + FINITE_CHUNK // 2 + 1, 4 * FINITE_CHUNK - 1, _N - 2]


def check_zero_rows_come_back(backends, pdt: torch.dtype, sdt: torch.dtype, gen: torch.Generator) -> None:
    """Each of ``backends``' inverse gives moments that were exactly 0 back exactly 0 (undo and the undo of an
    undo+redo; its step and inverse from the step's own roundings), and their checked step and undo+redo flag
    such elements only where base.zeros_come_back does not hold (L2 decay, bfloat16 moments), as
    lossy_elements; elsewhere ordinary, sound elements."""
    from helpers import block_inputs

    p, g, m, v = block_inputs(gen, _N, pdt, sdt, sound=True)
    for i in _ZERO_ROWS:
        m[i] = v[i] = 0.0
    g[_ZERO_ROWS[1]] = 1e3  # (a spike there too: the inverse from zeros is exact whatever the gradient)
    g_new = (0.01 * torch.randn(_N, generator=gen)).to(pdt)  # (a heavy clip of the gradient)
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 50, 0.5)
    s_new = s._replace(grad_scale=1e-3)
    for variant in (AdamVariant(decoupled=True), AdamVariant(decoupled=False),
                    AdamVariant(decoupled=False, bias_correction=False)):
        s_v = s if variant.decoupled or variant.bias_correction else s._replace(weight_decay=0.0)
        exact = sdt == torch.float32 and (variant.decoupled or s_v.weight_decay == 0)
        want = _want_flags(lossy_elements(p, g, v, s_v, variant.decoupled, m=m) | beyond_limit(g, s_v.grad_scale), _N)
        assert want == ([0] * 7 if exact else [0, 1, 1, 1, 0, 0, 1])
        for backend in backends:
            if backend is not reference:
                assert _flags(backend, variant, StepCall(p, g, m, v, s_v)) == want
            p1, m1, v1 = backend.step(p, g, m, v, s_v, variant)
            _, m0, v0 = backend.undo(p1, g, m1, v1, s_v, variant)
            if exact:
                assert all(float(m0[i]) == 0.0 and float(v0[i]) == 0.0 for i in _ZERO_ROWS)
            # the redo of an undo+redo of that step: against the undone moments, exact zeros where they were
            s_n = s_new._replace(weight_decay=s_v.weight_decay)
            bad = lossy_elements(p1, g_new, v1, s_n, variant.decoupled, g, s_v, m=m1) | beyond_limit(g_new, 1e-3)
            want_redo = _want_flags(bad, _N)
            if exact:  # (else what the leftovers of an inexact inverse make of it)
                assert want_redo == [0] * 7
            if backend is not reference:
                assert _flags(backend, variant, UndoRedoCall(p1, m1, v1, g, s_v, g_new, s_n)) == want_redo


@native
@pytest.mark.parametrize("combo", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                   (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16-fp32", "bf16"])
def test_moments_exactly_0_come_back_exactly_and_are_not_flagged(combo, rng):
    """check_zero_rows_come_back on this machine's build (cpu, cpu_fast) and the reference."""
    check_zero_rows_come_back((cpu, cpu_fast, reference), *combo, rng)


# One edge of the exemption of exact zero moments per chunk (the element at 37 k of chunk k): a step's (p, g,
# m, v before it) and an undo+redo's (g_old and p', m', v' after the undone step, stepped with gs 1 from
# b1 0.9, b2 0.999; the new gradient 0.01 randn at gs 1e-3), with the flags where zeros_come_back holds.
_NAN, _INF = float("nan"), float("inf")
_GO = 0.5  # the undone step's gradient: m' = (1 - b1) go and v' = ((1 - b2) go) go as it rounds them
_M1 = float(torch.tensor(1 - 0.9, dtype=torch.float32) * torch.tensor(_GO))
_V1 = float(torch.tensor(1 - 0.999, dtype=torch.float32) * torch.tensor(_GO) * torch.tensor(_GO))
_STEP_EDGES = [  # (element values, flagged)
    ({"m": 0.0, "v": 0.0, "g": 0.5}, 0),
    ({"m": -0.0, "v": 0.0, "g": 0.5}, 0),  # (a negative zero is 0)
    ({"m": 0.0, "v": -0.0, "g": 0.5}, 0),
    ({"m": 1e-40, "v": 0.0, "g": 0.5}, 1),  # a subnormal m is not 0
    ({"m": 0.0, "v": 1e-45, "g": 0.5}, 1),  # nor a subnormal v
    ({"m": 0.0, "v": 0.0, "g": 1e-40}, 0),  # (its square underflows: nothing to take back)
    ({"m": 0.0, "v": _NAN, "g": 0.5}, 1),
    ({"m": 0.0, "v": 0.0, "g": _INF}, 1),
    ({"m": _NAN, "v": 0.0, "g": 0.0}, 1)]
_REDO_EDGES = [
    ({"g": _GO, "m": _M1, "v": _V1}, 0),  # undone to exact zeros
    ({"g": _GO, "m": _M1, "v": _V1 / 2}, 0),  # the undone v clamped at 0 from below, m 0: exact zeros too
    ({"g": _GO, "m": _M1 * (1 + 2 ** -22), "v": _V1}, 1),  # the undone m not 0
    ({"g": 0.0, "m": -0.0, "v": -0.0}, 0),
    ({"g": _NAN, "m": _M1, "v": _V1}, 1)]


def _edge_inputs(edges, gen: torch.Generator, pdt: torch.dtype, sdt: torch.dtype):
    """``(p, g, m, v, g_new)`` of sound elements (the new gradient too) but at each edge's element."""
    n = len(edges) * FINITE_CHUNK + 5
    p, g = 0.01 * torch.randn(n, generator=gen), 0.01 * torch.randn(n, generator=gen)
    m, v = 0.01 * torch.randn(n, generator=gen), 1e-4 * (1 + torch.rand(n, generator=gen))
    g_new = 0.01 * torch.randn(n, generator=gen)
    for k, (values, _) in enumerate(edges):
        for name, x in values.items():
            {"p": p, "g": g, "m": m, "v": v}[name][k * FINITE_CHUNK + 37 * k] = x
    return p.to(pdt), g.to(pdt), m.to(sdt), v.to(sdt), g_new.to(pdt)


def check_zero_edges_flagged_alike(backends, gen: torch.Generator, python_form: bool = False) -> None:
    """Each of ``backends``' checked step and undo+redo flag the chunks of :data:`_STEP_EDGES` and
    :data:`_REDO_EDGES` as lossy_elements does (``python_form``: cpu's Python checked call and any_lossy too):
    as listed where base.zeros_come_back holds (float32 moments, no L2 decay), else every zero v with a gradient
    as well (L2 decay, bfloat16 moments)."""
    s_old = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 50, 1.0)
    for sdt, decoupled, wd in ((torch.float32, True, 0.1), (torch.float32, False, 0.0),
                               (torch.float32, False, 0.1), (torch.bfloat16, True, 0.1)):
        variant = AdamVariant(decoupled=decoupled)
        s = s_old._replace(weight_decay=wd, grad_scale=0.5)
        s_new = s._replace(grad_scale=1e-3)
        exact = sdt == torch.float32 and (decoupled or wd == 0)
        p, g, m, v, _ = _edge_inputs(_STEP_EDGES, gen, torch.float32, sdt)
        cases = [(_STEP_EDGES, StepCall(p, g, m, v, s),
                  lossy_elements(p, g, v, s, decoupled, m=m) | beyond_limit(g, 0.5))]
        p, g, m, v, g_new = _edge_inputs(_REDO_EDGES, gen, torch.float32, sdt)
        s_o = s_old._replace(weight_decay=wd)
        cases.append((_REDO_EDGES, UndoRedoCall(p, m, v, g, s_o, g_new, s_new),
                      lossy_elements(p, g_new, v, s_new, decoupled, g, s_o, m=m) | beyond_limit(g_new, 1e-3)))
        for edges, call, bad in cases:
            want = _want_flags(bad, call.p.numel())
            if exact:
                assert want == [f for _, f in edges] + [0], (sdt, decoupled, wd)
            for backend in backends:
                assert _flags(backend, variant, call) == want, (backend.NAME, sdt, decoupled, wd)
            if not python_form:
                continue
            redo = isinstance(call, UndoRedoCall)
            block = cpu._Block(call.p, call.g_old, call.m, call.v, call.g_new, None, call.s_old, call.s_new, None,
                               None) if redo else cpu._Block(call.p, call.g, call.m, call.v, None, None, call.s,
                                                             None, None, None)
            ref = torch.zeros(len(want), dtype=torch.uint8)
            cpu._reference_checked(2 if redo else 0, block._replace(skip=ref), variant, block.s1, block.s2)
            assert ref.tolist() == want
            chunks = [slice(k * FINITE_CHUNK, (k + 1) * FINITE_CHUNK) for k in range(len(want))]
            new, s_n = (call.g_new, call.s_new) if redo else (call.g, call.s)
            found = [int(bool(any_lossy(call.p[c], new[c], call.v[c], s_n, decoupled,
                                        call.g_old[c] if redo else None, call.s_old if redo else None, m=call.m[c])
                              | beyond_limit(new[c], s_n.grad_scale).any())) for c in chunks]
            assert found == want


@native
def test_checked_calls_flag_the_edges_of_exact_zero_moments_alike(rng):
    """check_zero_edges_flagged_alike on this machine's build (cpu, cpu_fast), cpu's Python checked call and
    any_lossy: negative zeros count as 0, a subnormal moment does not, an undone v clamped at 0 beside an undone
    m of 0 is exempt, a nan is flagged."""
    check_zero_edges_flagged_alike((cpu, cpu_fast), rng, python_form=True)


def _run_to(opt, n, steps, gen):
    params = {"w": torch.randn(n, generator=gen), "b": torch.randn(37, generator=gen)}
    state = opt.init(params)
    for _ in range(steps):
        grads = {k: torch.randn(x.shape, generator=gen) for k, x in params.items()}
        params, state, _ = opt.update(params, grads, state, grads_finite=True)
    return params, state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(backend=st.sampled_from(["cpu", "reference"]), decoupled=st.booleans(), donate=st.booleans(),
       spike=st.floats(3.0, 1e5), at=st.integers(0, 3 * FINITE_CHUNK - 1), grads_finite=st.sampled_from([None, True]))
@example(backend="cpu", decoupled=True, donate=False, spike=30.0, at=FINITE_CHUNK + 896,
         grads_finite=None)  # R = 11: 1.6e-6 at 12
def test_a_spike_is_undone_within_the_tolerance(backend, decoupled, donate, spike, at, grads_finite):
    """update then undo (and update then undo_redo with a clip) on a run 40 steps in, with one gradient
    element ``spike`` times its usual size: v comes back within 1e-6 (it was 1e-5 to 3e-3 off, algebraic),
    m within 2e-6 of the update's scale sqrt(v) (base.py's bound: about (2 R_m + 2 |m| / sqrt(v)) 2^-24), p
    within a few ulps. (Spikes from 3x: also the steps just below the lossy ratios, undone algebraically.)"""
    if backend == "cpu" and not cpu.native_available():
        return
    gen = torch.Generator().manual_seed(at)
    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-3, weight_decay=0.01, backend=backend, undo="auto")
    n = 3 * FINITE_CHUNK
    params, state = _run_to(opt, n, 40, gen)
    before = sofx.tree.tree_map(torch.clone, (params, state))
    g = {k: torch.randn(x.shape, generator=gen) for k, x in params.items()}
    g["w"][at] *= spike
    p2, s2, rec = opt.update(params, g, state, donate=donate, grads_finite=grads_finite)
    p3, s3 = opt.undo(p2, s2, rec, donate=donate)
    (p0, st0) = before
    assert _rel(s3.nu["w"], st0.nu["w"]) <= 1e-6
    assert float(((s3.mu["w"] - st0.mu["w"]).abs() / st0.nu["w"].sqrt()).max()) <= 2e-6
    assert float((p3["w"] - p0["w"]).abs().max()) <= 1e-6 * float(p0["w"].abs().max())
    # undo_redo with a clip (the gradient's norm is the spike's): as the clipped step from the state before
    params, state = sofx.tree.tree_map(torch.clone, before)
    p2, s2, rec = opt.update(params, g, state, donate=donate, grads_finite=grads_finite)
    p4, s4, _ = opt.undo_redo(p2, s2, rec, g, grad_scale=1 / spike, donate=donate, grads_finite=grads_finite)
    want_p, want_s, _ = opt.update(*sofx.tree.tree_map(torch.clone, before)[:1], g,
                                   sofx.tree.tree_map(torch.clone, before)[1], grad_scale=1 / spike)
    assert _rel(s4.nu["w"], want_s.nu["w"]) <= 1e-6
    assert float(((s4.mu["w"] - want_s.mu["w"]).abs() / want_s.nu["w"].sqrt()).max()) <= 2e-6


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_sound_steps_stay_algebraic(backend):
    """Past the first few steps (a second moment still small by chance) ordinary gradients are undone
    algebraically: the check costs no snapshot where none is needed."""
    if backend == "cpu" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(3)
    opt = sofx.adamw(lr=1e-3, backend=backend)
    params, state = _run_to(opt, 4 * FINITE_CHUNK, 30, gen)
    grads = {k: torch.randn(x.shape, generator=gen) for k, x in params.items()}
    _, _, rec = opt.update(params, grads, state, donate=True)
    assert [leaf.strategy for leaf in rec.leaves] == ["algebraic", "algebraic"]


@pytest.mark.parametrize("undo", ["auto", "exact", "algebraic"])
def test_undoable_false_reads_and_copies_nothing_for_an_undo(undo, monkeypatch):
    """``undoable=False`` (a plain loop): the same values, no snapshot, no check, records that refuse."""
    gen = torch.Generator().manual_seed(5)
    opt = sofx.adamw(lr=1e-3, undo=undo)
    params, state = _run_to(opt, 3000, 5, gen)
    grads = {k: torch.randn(x.shape, generator=gen) for k, x in params.items()}
    grads["w"][5] = 1e4  # a spike: the undoable step would snapshot it
    want = opt.update(params, grads, state)
    adam = importlib.import_module("sofx.adam")
    monkeypatch.setattr(adam, "any_lossy", None)  # never asked
    monkeypatch.setattr(adam, "_all_finite", None)
    got = opt.update(params, grads, state, undoable=False)
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten(got[:2])[0], sofx.tree.flatten(want[:2])[0]))
    assert all(leaf.strategy == "none" and leaf.p_old is None and leaf.m_old is None for leaf in got[2].leaves)
    with pytest.raises(UndoError, match="undoable=False"):
        opt.undo(got[0], got[1], got[2])
    # undo_redo(undoable=False): the redone values as with True, a record that refuses
    _, _, rec = opt.update(params, grads, state)
    _, _, rec2 = opt.update(params, grads, state)
    p5, s5, r5 = opt.undo_redo(*want[:2], rec, grads, grad_scale=0.5, undoable=False)
    p6, s6, _ = opt.undo_redo(*want[:2], rec2, grads, grad_scale=0.5)
    assert all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten((p5, s5))[0], sofx.tree.flatten((p6, s6))[0]))
    assert all(leaf.strategy == "none" for leaf in r5.leaves)
    with pytest.raises(UnsupportedError, match="undoable"):
        opt.update(params, grads, state, undoable="no")
    # nothing to refuse where nothing will be undone: undo='algebraic' with a beta1 of 0 (no inverse)
    strict = sofx.adamw(lr=1e-3, undo="algebraic")
    hp = sofx.AdamHParams(beta1=0.0)
    with pytest.raises(UnsupportedError, match="impossible"):
        strict.update(params, grads, strict.init(params), hp)
    p7, _, r7 = strict.update(params, grads, strict.init(params), hp, undoable=False)
    assert r7.strategies() == ["none", "none"] and not torch.equal(p7["w"], params["w"])


@pytest.mark.parametrize("undo_redo", [False, True], ids=["undo", "undo_redo"])
def test_float64_params_with_float32_states_use_float32s_tolerance(undo_redo):
    """float64 parameters stepped in float64 but with float32 moments (state_dtype=torch.float32): v' is
    rounded to float32 when stored, so the inverse loses what a float32 step's does; the test must use
    float32's factor (the moments' dtype), not float64's 2^29 finer one (v came back 7.5e-4 off)."""
    gen = torch.Generator().manual_seed(11)
    opt = sofx.adamw(lr=1e-3, weight_decay=0.0, state_dtype=torch.float32)
    params = {"w": torch.randn(1000, generator=gen, dtype=torch.float64)}
    state = opt.init(params)
    for _ in range(40):
        params, state, _ = opt.update(params, {"w": torch.randn(1000, generator=gen, dtype=torch.float64)}, state)
    before = sofx.tree.tree_map(torch.clone, (params, state))
    g = {"w": torch.randn(1000, generator=gen, dtype=torch.float64)}
    spiked = {"w": g["w"].clone()}
    spiked["w"][3] *= 1000
    if undo_redo:  # the redo's test against the undone v
        p2, s2, rec = opt.update(params, g, state)
        assert rec.leaves[0].strategy == "algebraic"
        p2, s2, rec = opt.undo_redo(p2, s2, rec, spiked)
    else:
        p2, s2, rec = opt.update(params, spiked, state)
    assert rec.leaves[0].strategy == "snapshot"
    _, s3 = opt.undo(p2, s2, rec)
    assert _rel(s3.nu["w"], before[1].nu["w"]) <= 1e-6
    # lossy_elements itself: float32's factor for float32 moments of float64 parameters
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 41, 1.0)
    v = torch.ones(1, dtype=torch.float32)
    p = torch.zeros(1, dtype=torch.float64)
    assert lossy_elements(p, torch.tensor([1000.0], dtype=torch.float64), v, s, True)[0]


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_grad_scale_under_a_transform_is_not_read(backend):
    """vmap or grad over ``grad_scale`` alone (concrete leaves) with ``grads_finite=True``: the lossy test
    cannot read the multiplier (``float()`` of it raised under vmap), so ``"auto"`` keeps the inputs as for
    any value it cannot read, and the step is the one with each scale."""
    gen = torch.Generator().manual_seed(0)
    opt = sofx.adamw(lr=1e-3, backend=backend)
    params = {"w": torch.randn(100, generator=gen)}
    state = opt.init(params)
    for _ in range(3):
        params, state, _ = opt.update(params, {"w": torch.randn(100, generator=gen)}, state)
    g = {"w": torch.randn(100, generator=gen)}
    g["w"][7] *= 1000  # a spike: the step of a concrete scale is a snapshot

    def step(gs):
        p, _, rec = opt.update(params, g, state, grad_scale=gs, grads_finite=True)
        assert rec.strategies() == ["snapshot"]
        return p["w"]

    scales = torch.tensor([0.5, 1.0])
    got = torch.func.vmap(step)(scales)
    for gs, row in zip(scales.tolist(), got):
        assert torch.equal(row, step(gs))
    dp = torch.func.grad(lambda gs: step(gs).sum())(torch.tensor(0.5))
    assert torch.isfinite(dp)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("undo", ["algebraic", "auto"])
def test_undo_redo_undoable_false_refuses_no_strategy_of_the_redo(backend, undo):
    """``undo_redo(undoable=False)`` chooses no strategy for its redo, as ``update(undoable=False)`` does: new
    hparams with no inverse (a beta1 of 0) are stepped, not refused under ``undo='algebraic'`` (it raised
    UnsupportedError); the values are those of the undo and then the plain step, and the record refuses."""
    gen = torch.Generator().manual_seed(9)
    opt = sofx.adamw(lr=1e-3, undo=undo, backend=backend)
    params, state = _run_to(opt, 3000, 40, gen)

    def fresh():
        return sofx.tree.tree_map(torch.clone, (params, state))

    grads = {k: torch.randn(x.shape, generator=gen) for k, x in params.items()}
    p1, s1, rec = opt.update(fresh()[0], grads, fresh()[1])
    assert rec.strategies() == ["algebraic", "algebraic"]
    new = {k: g * 0.9 for k, g in grads.items()}
    hp = sofx.AdamHParams(beta1=0.0)
    p2, s2, r2 = opt.undo_redo(*sofx.tree.tree_map(torch.clone, (p1, s1)), rec, new, hp, undoable=False)
    assert r2.strategies() == ["none", "none"]
    with pytest.raises(UndoError, match="undoable=False"):
        opt.undo(p2, s2, r2)
    _, _, rec2 = opt.update(fresh()[0], grads, fresh()[1])
    p3, s3 = opt.undo(p1, s1, rec2)
    want = opt.update(p3, new, s3, hp, undoable=False)
    assert all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten((p2, s2))[0], sofx.tree.flatten(want[:2])[0]))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_non_finite_first_moment_is_not_undone_algebraically(backend, donate):
    """SPECULATION.md: no algebraic inverse of "any non-finite input". A first moment already inf (a diverged
    state, loaded) beside a finite second moment: the step writes a nan p' there (torch's lerp: inf - inf), and
    the algebraic inverse a nan in place of the finite parameter. undo='auto' keeps that chunk's old values."""
    if backend == "cpu" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(9)
    opt = sofx.adamw(lr=1e-3, backend=backend)
    params, state = _run_to(opt, 3 * FINITE_CHUNK, 30, gen)
    state.mu["w"][FINITE_CHUNK + 5] = float("inf")
    before = sofx.tree.tree_map(torch.clone, (params, state))
    grads = {k: 0.1 * torch.randn(x.shape, generator=gen) for k, x in params.items()}
    p2, s2, rec = opt.update(params, grads, state, donate=donate)
    kept = "chunk_snapshot" if backend == "cpu" else "snapshot"  # the chunk its step flagged, or the leaf
    assert rec.strategies() == ["algebraic", kept] and not bool(p2["w"][FINITE_CHUNK + 5].isfinite())  # b, w
    p3, s3 = opt.undo(p2, s2, rec, donate=donate)
    assert bool(torch.isfinite(p3["w"]).all())
    assert torch.equal(p3["w"][FINITE_CHUNK:2 * FINITE_CHUNK], before[0]["w"][FINITE_CHUNK:2 * FINITE_CHUNK])
    assert torch.equal(s3.mu["w"][FINITE_CHUNK:2 * FINITE_CHUNK], before[1].mu["w"][FINITE_CHUNK:2 * FINITE_CHUNK])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("donate", [False, True])
def test_an_inf_parameter_in_l2_mode_is_not_undone_algebraically(backend, donate):
    """L2 mode: a parameter already inf (a diverged state) where v is exactly 0 makes the effective gradient
    g + wd * p inf; the step writes nan moments there, and their algebraic inverse nan in place of the zeros
    (it was not flagged: a v of 0 is exempt). undo='auto' keeps that chunk's old values."""
    if backend == "cpu" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(10)
    opt = sofx.adam(lr=1e-3, weight_decay=0.01, backend=backend)
    params, state = _run_to(opt, 3 * FINITE_CHUNK, 30, gen)
    i = FINITE_CHUNK + 5
    params["w"][i] = float("inf")
    state.mu["w"][i] = state.nu["w"][i] = 0.0
    before = sofx.tree.tree_map(torch.clone, (params, state))
    grads = {k: 0.1 * torch.randn(x.shape, generator=gen) for k, x in params.items()}
    p2, s2, rec = opt.update(params, grads, state, donate=donate)
    assert rec.strategies() == ["algebraic", "chunk_snapshot" if backend == "cpu" else "snapshot"]  # b, w
    p3, s3 = opt.undo(p2, s2, rec, donate=donate)
    assert bool(torch.isfinite(s3.mu["w"]).all()) and bool(torch.isfinite(s3.nu["w"]).all())
    chunk = slice(FINITE_CHUNK, 2 * FINITE_CHUNK)
    for a, b in zip((p3["w"], s3.mu["w"], s3.nu["w"]), (before[0]["w"], before[1].mu["w"], before[1].nu["w"])):
        assert torch.equal(a[chunk], b[chunk])


def test_any_lossy_is_lossy_elements_any():
    """The pass before a step no kernel checks (slices on CPU, m by its sum) answers as the elementwise test."""
    from sofx.kernels.base import _LOSSY_SLICE, any_lossy

    gen = torch.Generator().manual_seed(4)
    n = 2 * _LOSSY_SLICE + 77
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 50, 0.5)
    for case in range(6):
        p, g, m, g_old = (torch.randn(n, generator=gen) for _ in range(4))
        v = 1.0 + torch.rand(n, generator=gen)
        if case == 1:
            g[n - 3] = 1e4  # in the last, partial slice
        if case == 2:
            m[5] = float("nan")
        if case == 3:
            v[_LOSSY_SLICE + 1] = float("nan")
        if case == 4:
            p, g, m, v = (torch.stack([x, x], dim=1)[:, 0] for x in (p, g, m, v))  # not contiguous
            g[_LOSSY_SLICE] = 1e4
        for redo in (False, True):
            extra = (g_old, s) if redo else (None, None)
            for decoupled in (True, False):
                want = bool(lossy_elements(p, g, v, s, decoupled, *extra, m=m).any())
                assert bool(any_lossy(p, g, v, s, decoupled, *extra, m=m)) == want, (case, redo, decoupled)
                assert want == (case in (1, 2, 3, 4) or bool(lossy_elements(p, g, v, s, decoupled, *extra).any()))


@native
def test_a_weight_decay_that_rounds_to_0_in_float32_is_l2_decay_in_every_check():
    """Adam (L2) with a weight decay below float32's range (1e-46: 0 in float32, not 0 as given): the step still
    adds the L2 term (``fmaf(p, 0, g)``: an inf parameter makes its moments nan), so the checked calls test the
    effective gradient with it as lossy_elements does: the chunk of an inf parameter is flagged, and moments
    exactly 0 are not exempt (the inverse's L2 term is from the recovered p). They tested it only where the
    float32 decay was not 0. (The Triton backend: test_kernels_triton.py.)"""
    check_tiny_weight_decay_flagged((cpu, cpu_fast))


def check_tiny_weight_decay_flagged(backends) -> None:
    """:func:`test_a_weight_decay_that_rounds_to_0_in_float32_is_l2_decay_in_every_check` on ``backends``."""
    gen = torch.Generator().manual_seed(5)
    n = 4 * FINITE_CHUNK
    p = torch.randn(n, generator=gen)
    g = 0.01 * torch.randn(n, generator=gen)
    m = 0.01 * torch.randn(n, generator=gen)
    v = 1e-3 * (1 + torch.rand(n, generator=gen))
    p[FINITE_CHUNK + 3] = float("inf")  # chunk 1
    m[2 * FINITE_CHUNK + 5] = v[2 * FINITE_CHUNK + 5] = 0.0  # chunk 2: moments exactly 0, a gradient
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 1e-46, 50, 1.0)
    variant = AdamVariant(decoupled=False)
    want = _want_flags(lossy_elements(p, g, v, s, False, m=m) | beyond_limit(g, 1.0), n)
    assert want == [0, 1, 1, 0]
    g_old = 0.01 * torch.randn(n, generator=gen)
    p1, m1, v1 = reference.step(p, g_old, m, v, s, variant)
    want_redo = _want_flags(lossy_elements(p1, g, v1, s, False, g_old, s, m=m1) | beyond_limit(g, 1.0), n)
    assert want_redo[1] == 1
    for backend in backends:
        assert _flags(backend, variant, StepCall(p, g, m, v, s)) == want
        assert _flags(backend, variant, UndoRedoCall(p1, m1, v1, g_old, s, g, s)) == want_redo


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
def test_l2_steps_far_larger_than_the_parameter_are_flagged_or_undone_within_the_tolerance(backend):
    """L2 mode (gh = g + wd * p) with an effective step far larger than |p| (lr 1, wd 0.5, betas 0.99, a few
    steps in): the inverse recovers p about an ulp of p' off, and wd times that error passes into the recovered
    moments (``v = (v' - (1 - b2) gh^2) / b2``: ~ ``2 (1 - b2) / b2 |gh| wd ulp(p')``). Every element
    :func:`lossy_elements` does not flag comes back within the tolerance of the other lossy tests: v within
    1e-6, m within 2e-6 of sqrt(v) (v was 7.5e-6 off: base.py's _l2_term now flags such elements)."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    opt = sofx.adam(lr=1.0, betas=(0.99, 0.99), weight_decay=0.5, backend=backend, undo="algebraic")
    worst_v = worst_m = 0.0
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        for steps in range(1, 4):
            params = {"w": torch.randn(4 * FINITE_CHUNK, generator=gen)}
            state = opt.init(params)
            for _ in range(steps):
                params, state, _ = opt.update(params, {"w": torch.randn(params["w"].shape, generator=gen)}, state,
                                              grads_finite=True)
            g = {"w": torch.randn(params["w"].shape, generator=gen)}
            p0, v0, m0 = params["w"].clone(), state.nu["w"].clone(), state.mu["w"].clone()
            s = AdamScalars(1.0, 0.99, 0.99, 1e-8, 0.5, steps + 1, 1.0)
            ok = ~lossy_elements(p0, g["w"], v0, s, False, m=m0)
            p2, s2, rec = opt.update(params, g, state)
            _, s3 = opt.undo(p2, s2, rec)
            assert rec.strategies() == ["algebraic"] and bool(ok.any())
            worst_v = max(worst_v, _rel(s3.nu["w"][ok], v0[ok]))
            worst_m = max(worst_m, float(((s3.mu["w"][ok] - m0[ok]).abs() / v0[ok].sqrt()).max()))
    assert worst_v <= 1e-6 and worst_m <= 2e-6, (worst_v, worst_m)



@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
def test_l2_gradients_near_minus_wd_p_are_flagged_or_undone_within_the_tolerance(backend):
    """L2 mode (lr 0.01, wd 0.1) where the loss gradient nearly cancels the decay (``g ~ -wd p``, the balance L2
    training tends to) while the second moment is still small (a second step): ``gh`` is small beside ``wd
    p``, so the recovered p's ulp, times wd, is many ulps of ``gh``. Without the L2 terms (the check of a
    record that keeps p: ``p_kept``) unflagged elements come back with v beyond 1e-6 (5e-6 measured); with them
    every element lossy_elements lets through is within the tolerance of the other lossy tests (v 1e-6, m 2e-6
    of sqrt(v))."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    opt = sofx.adam(lr=1e-2, weight_decay=0.1, backend=backend, undo="algebraic")
    gen = torch.Generator().manual_seed(5)
    n = 32 * FINITE_CHUNK
    params = {"w": torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-2, 1, generator=gen)}
    state = opt.init(params)
    g = torch.randn(n, generator=gen) * 1e-2 * 10 ** torch.empty(n).uniform_(-1, 1, generator=gen)
    params, state, _ = opt.update(params, {"w": g}, state, grads_finite=True)
    p0, v0, m0 = params["w"].clone(), state.nu["w"].clone(), state.mu["w"].clone()
    g = {"w": -0.1 * p0 * (1 + 1e-3 * torch.randn(n, generator=gen))}
    s = AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 2, 1.0)
    ok = ~lossy_elements(p0, g["w"], v0, s, False, m=m0)
    ratios_ok = ~lossy_elements(p0, g["w"], v0, s, False, m=m0, p_kept=True)
    p2, s2, rec = opt.update(params, g, state)
    _, s3 = opt.undo(p2, s2, rec)
    assert rec.strategies() == ["algebraic"] and bool(ok.any())
    assert _rel(s3.nu["w"][ratios_ok], v0[ratios_ok]) > 2e-6  # what the ratios alone let through
    assert _rel(s3.nu["w"][ok], v0[ok]) <= 1e-6
    assert float(((s3.mu["w"][ok] - m0[ok]).abs() / v0[ok].sqrt()).max()) <= 2e-6


def test_l2_redone_steps_undone_again_come_back_within_the_tolerance():
    """L2 mode, an undo+redo given the undone step's result p' (no p_old: an algebraic record), as a late clip
    redoes it: its check must read the parameter the redo steps from, what the inverse recovers from p', not p'
    itself (with g near -wd p the effective gradients from p' are far off: the redone step, undone again, gave v
    back 1.7e-4 off here, at lr 1e-2 and wd 0.1 on a second step). Every element lossy_elements does not flag
    comes back as the first inverse gave it (v within 1e-6, m 2e-6 of sqrt(v)); the kernels flag its chunks
    (check_l2_flags_alike)."""
    variant = AdamVariant(decoupled=False)
    gen = torch.Generator().manual_seed(1)
    n = 1 << 15
    s_old = AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 2, 1.0)
    s_new = s_old._replace(grad_scale=0.3)  # (a clip)
    p = torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-2, 1, generator=gen)
    g1 = torch.randn(n, generator=gen) * 1e-2 * 10 ** torch.empty(n).uniform_(-1, 1, generator=gen)
    p, m, v = reference.step(p, g1, torch.zeros(n), torch.zeros(n), s_old._replace(step=1), variant)
    g = torch.randn(n, generator=gen) * 1e-2 * 10 ** torch.empty(n).uniform_(-1.5, 1.5, generator=gen)
    g[:n // 8] = -0.1 * p[:n // 8] * (1 + 1e-3 * torch.randn(n // 8, generator=gen))
    p1, m1, v1 = reference.step(p, g, m, v, s_old, variant)
    ok = ~lossy_elements(p1, g, v1, s_new, False, g, s_old, m=m1)
    p0, m0, v0 = reference.undo(p1, g, m1, v1, s_old, variant)  # what the redo steps from
    p2, m2, v2 = reference.step(p0, g, m0, v0, s_new, variant)  # the redo
    _, m3, v3 = reference.undo(p2, g, m2, v2, s_new, variant)
    ok &= v0 > 0
    assert bool(ok[:n // 8].any())
    assert _rel(v3[ok], v0[ok]) <= 1e-6
    assert float(((m3[ok] - m0[ok]).abs() / v0[ok].sqrt()).max()) <= 2e-6

def l2_risky(gen: torch.Generator, nc: int, combo) -> tuple[torch.Tensor, ...]:
    """Sound inputs (p 0, v 1) but for one element per chunk of random size in each of p, g, m, v, so that
    about half the chunks are flagged in L2 mode, now and then by base.py's ``_l2_term`` alone (see
    :func:`l2_terms_matter`)."""
    n = nc * FINITE_CHUNK + 77
    p, g, m, v = torch.zeros(n), torch.full((n,), 1e-4), torch.zeros(n), torch.ones(n)
    at = (torch.arange(nc + 1) * FINITE_CHUNK + torch.randint(0, FINITE_CHUNK, (nc + 1,), generator=gen)).clamp_max(
        n - 1)

    def scale(lo: float, hi: float) -> torch.Tensor:
        return 10 ** torch.empty(len(at)).uniform_(lo, hi, generator=gen)

    p[at] = torch.randn(len(at), generator=gen) * scale(-2, 1)
    g[at] = torch.randn(len(at), generator=gen) * scale(-3, 0)
    m[at] = torch.randn(len(at), generator=gen) * scale(-3, 0)
    v[at] = scale(-5, -1)
    return tuple(t.to(d) for t, d in zip((p, g, m, v), (combo[0], combo[1], combo[2], combo[2])))


def l2_terms_matter(gen: torch.Generator, s: AdamScalars) -> tuple[torch.Tensor, ...]:
    """:func:`l2_risky` inputs (float32) where the L2 terms flag an element the ratios alone do not (the check of a
    record that keeps p, ``p_kept``): the first of a few draws."""
    for _ in range(20):
        p, g, m, v = l2_risky(gen, 12, COMBOS[0])
        if bool((lossy_elements(p, g, v, s, False, m=m) & ~lossy_elements(p, g, v, s, False, m=m, p_kept=True)).any()):
            return p, g, m, v
    raise AssertionError("no draw where the L2 terms flag more than the ratios alone")


L2_SCALARS = [AdamScalars(lr, 0.9, 0.999, 1e-8, wd, t, 0.5) for lr, wd, t in ((1e-3, 0.1, 2), (1.0, 0.5, 50),
                                                                                (0.1, 0.1, 2), (0.3, 0.5, 50))]


def check_l2_flags_alike(backends, gen: torch.Generator, combos=COMBOS, nc: int = 12) -> None:
    """``backends``' checked step and undo+redo (with and without p_old, p_kept or not) flag in L2 mode the
    chunks lossy_elements finds, and so does the Python form of a checked call (cpu._reference_checked); ``nc``
    chunks (and a partial one) per call."""
    variant = AdamVariant(decoupled=False)
    flagged = 0
    for combo in combos:
        for s in L2_SCALARS:
            p, g, m, v = l2_risky(gen, nc, combo)
            s_old = s._replace(step=s.step - 1, grad_scale=1.0, weight_decay=0.05, beta1=0.8)
            g_old = (0.7 * g.float()).to(g.dtype)
            for kept in (False, True):
                want = _want_flags(lossy_elements(p, g, v, s, False, m=m, p_kept=kept)
                                   | beyond_limit(g, s.grad_scale), p.numel())
                assert sum(want) < len(want)
                flagged += sum(want)
                ref = torch.zeros(len(want), dtype=torch.uint8)
                cpu._reference_checked(0, cpu._Block(p, g, m, v, None, None, s, None, None, None, ref, False, kept),
                                       variant, s, None)
                assert ref.tolist() == want
                for bc in (True, False):  # (the step's flags, whatever its bias correction)
                    var = AdamVariant(decoupled=False, bias_correction=bc)
                    for backend in backends:
                        assert _flags(backend, var, StepCall(p, g, m, v, s, p_kept=kept)) == want, backend
                for p_old in (None, p):  # (without p_old the check reads what the inverse recovers from p)
                    for bc in (True, False):
                        var = AdamVariant(decoupled=False, bias_correction=bc)
                        want_redo = _want_flags(lossy_elements(p, g, v, s, False, g_old, s_old, m=m, p_kept=kept,
                                                               bias_correction=bc, p_old_given=p_old is not None)
                                                | beyond_limit(g, s.grad_scale), p.numel())
                        ref = torch.zeros(len(want), dtype=torch.uint8)
                        cpu._reference_checked(2, cpu._Block(p, g_old, m, v, g, p_old, s_old, s, None, None, ref,
                                                             False, kept), var, s_old, s)
                        assert ref.tolist() == want_redo
                        for backend in backends:
                            assert _flags(backend, var, UndoRedoCall(p, m, v, g_old, s_old, g, s, p_old,
                                                                     p_kept=kept)) == want_redo, backend
    assert flagged > 0


@native
def test_checked_calls_flag_the_l2_term_alike(rng):
    """The L2 term (the recovered p's error through wd * p) in the native checked step and undo+redo, as
    lossy_elements finds it; none where the record keeps p (p_kept), which flags fewer chunks."""
    check_l2_flags_alike((cpu, cpu_fast), rng)
    l2_terms_matter(rng, L2_SCALARS[1])


@pytest.mark.parametrize("native_build", [True, False], ids=["native", "no-compiler"])
def test_a_chunked_checked_call_keeping_p_flags_as_the_whole_call(native_build, rng, monkeypatch):
    """A checked step and undo+redo by chunks (every chunk listed) whose record keeps p (p_kept) take no L2 term,
    as the whole call: the chunk flags lossy_elements finds with p_kept, with or without the native loops."""
    from sofx.kernels import _cpu_build
    from sofx.kernels.chunked import ChunkedCall

    if native_build and not cpu.native_available():
        pytest.skip("no C compiler")
    if not native_build:
        monkeypatch.setattr(_cpu_build, "load", lambda: None)
    variant = AdamVariant(decoupled=False)
    s = L2_SCALARS[1]
    p, g, m, v = l2_terms_matter(rng, s)
    s_old = s._replace(step=s.step - 1, grad_scale=1.0)
    n, idx = p.numel(), torch.arange(-(-p.numel() // FINITE_CHUNK))
    want = _want_flags(lossy_elements(p, g, v, s, False, m=m, p_kept=True), n)
    want_redo = _want_flags(lossy_elements(p, g, v, s, False, g, s_old, m=m, p_kept=True), n)
    assert want != _want_flags(lossy_elements(p, g, v, s, False, m=m), n)
    for backend in (cpu, cpu_fast):
        flags = torch.zeros(len(want), dtype=torch.uint8)
        out = tuple(t.clone() for t in (p, m, v))
        backend.step_chunks([ChunkedCall(StepCall(p, g, m, v, s, out, None, flags, p_kept=True), idx, False, None)],
                            variant)
        assert flags.tolist() == want
        flags = torch.zeros(len(want), dtype=torch.uint8)
        out = tuple(t.clone() for t in (p, m, v))
        backend.undo_redo_chunks([ChunkedCall(UndoRedoCall(p, m, v, g, s_old, g, s, None, out, None, flags,
                                                           p_kept=True), idx, False, None)], variant)
        assert flags.tolist() == want_redo
