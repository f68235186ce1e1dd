"""The inverse: undo(update(x)) == x, by property tests over hparams, variants, dtypes and step counts."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sofx
from sofx.kernels import cpu, reference
from sofx.kernels.base import AdamScalars, AdamVariant, lossy_elements

from helpers import assert_trees_bitwise, bits, clone_tree, max_rel_err, trees_equal

from sofx.adam import ALGEBRAIC_MIN_DIVISOR  # a beta or decay factor below it is refused by undo='algebraic'

# (param dtype, state dtype or None for "same as param")
DTYPES = [
    (torch.float32, None),
    (torch.float64, None),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, None),
    (torch.float32, torch.bfloat16),
]

betas = st.one_of(st.just(0.0), st.floats(0.0, 0.999), st.sampled_from([0.5, 0.9, 0.99, 0.999]))


@st.composite
def cases(draw):
    p_dtype, s_dtype = draw(st.sampled_from(DTYPES))
    decoupled = draw(st.booleans())
    hp = sofx.AdamHParams(
        lr=draw(st.one_of(st.just(0.0), st.floats(1e-5, 0.1))),
        beta1=draw(betas),
        beta2=draw(betas),
        eps=draw(st.floats(1e-10, 1e-3)),
        weight_decay=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5))),
    )
    return dict(
        p_dtype=p_dtype, s_dtype=s_dtype, decoupled=decoupled, hp=hp,
        bias_correction=draw(st.booleans()),
        count=draw(st.integers(0, 60)),
        grad_scale=draw(st.sampled_from([1.0, 0.5, 2.0, 0.3])),
        undo=draw(st.sampled_from(["auto", "exact"])),
        seed=draw(st.integers(0, 2**31 - 1)),
        n=draw(st.integers(0, 70)),
    )


def _setup(c):
    gen = torch.Generator().manual_seed(c["seed"])
    s_dtype = c["s_dtype"] or c["p_dtype"]

    def r(n, dtype):
        return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)

    n = c["n"]
    params = {"a": r(n, c["p_dtype"]), "b": [r(3, c["p_dtype"])]}
    grads = {"a": r(n, c["p_dtype"]), "b": [r(3, c["p_dtype"])]}
    mu = {"a": r(n, s_dtype), "b": [r(3, s_dtype)]}
    nu = {"a": r(n, torch.float64).square().to(s_dtype), "b": [r(3, torch.float64).square().to(s_dtype)]}
    count = {"a": torch.tensor(c["count"]), "b": [torch.tensor(c["count"])]}
    make = sofx.adamw if c["decoupled"] else sofx.adam
    opt = make(bias_correction=c["bias_correction"], state_dtype=c["s_dtype"], undo=c["undo"])
    return opt, params, grads, sofx.AdamState(count, mu, nu)


def _amax(x: torch.Tensor) -> float:
    return float(x.double().abs().max()) if x.numel() else 0.0


def _err(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """max |a - b| relative to ``scale``."""
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max()) / max(scale, 1e-30)


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@settings(max_examples=300)
@given(cases())
def test_undo_inverts_update(c):
    opt, params, grads, state = _setup(c)
    before = (sofx.tree.tree_map(torch.clone, params), sofx.tree.tree_map(torch.clone, state))
    new_params, new_state, record = opt.update(params, grads, state, c["hp"], grad_scale=c["grad_scale"])
    assert trees_equal(params, before[0]) and trees_equal(state, before[1]), "update modified its inputs"
    for t in sofx.tree.flatten((new_params, new_state.mu, new_state.nu))[0]:
        assert not torch.isnan(t).any(), "update produced a nan from finite inputs"
    old_params, old_state = opt.undo(new_params, new_state, record)
    assert trees_equal(old_state.count, state.count)
    flat = sofx.tree.flatten
    leaves = zip(flat(old_params)[0], flat(params)[0], flat(new_params)[0],
                 flat(old_state.mu)[0], flat(state.mu)[0], flat(new_state.mu)[0],
                 flat(old_state.nu)[0], flat(state.nu)[0], flat(new_state.nu)[0], record.leaves)
    tol = 1e-12 if c["p_dtype"] == torch.float64 else 1e-6
    for p0, p, p_new, m0, m, m_new, v0, v, v_new, rec in leaves:
        for t in (p0, m0, v0):
            assert not torch.isnan(t).any(), f"undo produced a nan ({rec.strategy})"
        assert p0.dtype == p.dtype and m0.dtype == m.dtype and v0.dtype == v.dtype
        if rec.strategy == "snapshot":
            assert torch.equal(p0, p) and torch.equal(m0, m) and torch.equal(v0, v)
            continue
        assert rec.strategy in ("algebraic", "param_snapshot")
        # The inverse restores values to a few ulps of the numbers it computes with: the stored
        # post-step values divided by beta (SPECULATION.md section 2: cancellation when beta*m is
        # much smaller than (1-beta)*g). Relative error is measured against that scale.
        b1, b2 = rec.scalars.beta1, rec.scalars.beta2
        if rec.strategy == "param_snapshot":
            assert torch.equal(p0, p)
        else:
            decay = 1 - rec.scalars.lr * rec.scalars.weight_decay if c["decoupled"] else 1.0
            assert _err(p0, p, max(_amax(p), _amax(p_new)) / decay) <= tol
        assert _err(m0, m, max(_amax(m), _amax(m_new) / b1)) <= tol
        assert _err(v0, v, max(_amax(v), _amax(v_new) / b2)) <= tol


@pytest.mark.parametrize("decoupled", [False, True])
def test_undo_restores_the_moments_of_a_decayed_step_in_float64(decoupled):
    """A fixed case the property test above rarely draws: strong weight decay (L2: the decay term enters the
    moments, so their inverse needs the old parameter), nonzero moments, count 5; float64 to 1e-12."""
    gen = torch.Generator().manual_seed(2)
    opt = (sofx.adamw if decoupled else sofx.adam)(lr=0.05, betas=(0.9, 0.99), weight_decay=0.3)
    params = {"w": torch.randn(64, generator=gen, dtype=torch.float64)}
    state = sofx.AdamState({"w": torch.tensor(5)}, {"w": torch.randn(64, generator=gen, dtype=torch.float64) * 0.1},
                           {"w": torch.rand(64, generator=gen, dtype=torch.float64) * 0.01})
    grads = {"w": torch.randn(64, generator=gen, dtype=torch.float64)}
    new_p, new_s, record = opt.update(params, grads, state)
    assert record.strategies() == ["algebraic"]
    old_p, old_s = opt.undo(new_p, new_s, record)
    for got, want in ((old_p["w"], params["w"]), (old_s.mu["w"], state.mu["w"]), (old_s.nu["w"], state.nu["w"])):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert int(old_s.count["w"]) == 5


@settings(max_examples=200)
@given(cases())
@example({"p_dtype": torch.float32, "s_dtype": None, "decoupled": False,
          "hp": sofx.AdamHParams(lr=0.0625, beta1=0.96875, beta2=0.5, eps=5.960464477539063e-08, weight_decay=0.25),
          "bias_correction": False, "count": 1, "grad_scale": 1.0, "undo": "auto", "seed": 17, "n": 32})  # L2, t 2
@example({"p_dtype": torch.float32, "s_dtype": None, "decoupled": False,
          "hp": sofx.AdamHParams(lr=0.0, beta1=0.5, beta2=0.5, eps=0.001, weight_decay=0.5), "bias_correction": False,
          "count": 0, "grad_scale": 1.0, "undo": "auto", "seed": 0, "n": 0})  # L2's first step keeps p
@example({"p_dtype": torch.float32, "s_dtype": None, "decoupled": False,
          "hp": sofx.AdamHParams(lr=0.0, beta1=0.5, beta2=0.5, eps=1e-10, weight_decay=0.0), "bias_correction": False,
          "count": 0, "grad_scale": 1.0, "undo": "auto", "seed": 0, "n": 0})  # ... also at weight decay 0
def test_auto_strategy_is_sound(c):
    """auto snapshots exactly where the algebraic inverse is impossible or too lossy."""
    opt, params, grads, state = _setup(c)
    _, _, record = opt.update(params, grads, state, c["hp"])
    hp = c["hp"]
    s_dtype = c["s_dtype"] or c["p_dtype"]
    # (update without grad_scale; the step t = count + 1, which the L2 terms' bias corrections read: with t = 1 for
    # every count the oracle flagged elements of an L2 step from count 1 that the step's own check rightly passed)
    s = AdamScalars(hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, c["count"] + 1, 1.0)
    # a param_snapshot keeps p: its inverse takes no recovered p, so no L2 terms in its test (p_kept); so does a
    # leaf's first step in L2 mode, whatever that step's decay (count 0: adam.py's L2_FIRST_STEP_REASON)
    p_kept = c["p_dtype"] in (torch.bfloat16, torch.float16) or bool(
        c["decoupled"] and hp.weight_decay and abs(1 - hp.lr * hp.weight_decay) < 0.5) or bool(
        not c["decoupled"] and c["count"] == 0)
    leaves = zip(*(sofx.tree.flatten(t)[0] for t in (params, grads, state.nu, state.mu)))
    lossy = [bool(lossy_elements(p, g, v, s, c["decoupled"], m=m, p_kept=p_kept).any()) for p, g, v, m in leaves]
    for rec, too_lossy in zip(record.leaves, lossy):
        if c["undo"] == "exact" or hp.beta1 < 0.5 or hp.beta2 < 0.5 or s_dtype in (torch.bfloat16, torch.float16) \
                or (c["undo"] == "auto" and too_lossy):
            assert rec.strategy == "snapshot"
        elif p_kept:
            assert rec.strategy == "param_snapshot"
        else:
            assert rec.strategy == "algebraic"


def test_exact_undo_is_bitwise_with_donation_and_reuses_storage():
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(100, generator=gen)}
    opt = sofx.adamw(lr=1e-2, undo="exact")
    state = opt.init(params)
    params, state, _ = opt.update(params, {"w": torch.randn(100, generator=gen)}, state)
    saved = (params["w"].clone(), state.mu["w"].clone(), state.nu["w"].clone())
    ptrs = (params["w"].data_ptr(), state.mu["w"].data_ptr(), state.nu["w"].data_ptr())
    p2, s2, rec = opt.update(params, {"w": torch.randn(100, generator=gen)}, state, donate=True)
    assert (p2["w"].data_ptr(), s2.mu["w"].data_ptr(), s2.nu["w"].data_ptr()) == ptrs
    assert not torch.equal(p2["w"], saved[0])
    p3, s3 = opt.undo(p2, s2, rec, donate=True)
    assert (p3["w"].data_ptr(), s3.mu["w"].data_ptr(), s3.nu["w"].data_ptr()) == ptrs
    assert torch.equal(p3["w"], saved[0]) and torch.equal(s3.mu["w"], saved[1]) and torch.equal(s3.nu["w"], saved[2])


def test_beta_zero_auto_snapshots_and_never_writes_nan():
    gen = torch.Generator().manual_seed(4)
    params = {"w": torch.randn(50, generator=gen)}
    for b1, b2 in [(0.0, 0.999), (0.9, 0.0), (0.0, 0.0)]:
        opt = sofx.adam(betas=(b1, b2), weight_decay=0.1)
        state = opt.init(params)
        p1, s1, _ = opt.update(params, {"w": torch.randn(50, generator=gen)}, state)
        p2, s2, rec = opt.update(p1, {"w": torch.randn(50, generator=gen)}, s1)
        assert rec.strategies() == ["snapshot"]
        p3, s3 = opt.undo(p2, s2, rec)
        assert torch.equal(p3["w"], p1["w"]) and torch.equal(s3.mu["w"], s1.mu["w"])
        assert not any(torch.isnan(t).any() for t in (p3["w"], s3.mu["w"], s3.nu["w"]))


def test_reference_undo_refuses_beta_zero_instead_of_writing_nan():
    x = torch.randn(10)
    s = AdamScalars(1e-3, 0.0, 0.999, 1e-8, 0.0, 3)
    with pytest.raises(sofx.UnsupportedError, match="beta1 == 0"):
        reference.undo(x, x, x, x.abs(), s, AdamVariant())


def test_clamp_keeps_nan_as_nan_and_negative_rounding_becomes_zero():
    g = torch.tensor([1.0, 2.0, 3.0])
    m = torch.tensor([0.1, 0.2, 0.3])
    b2 = 0.999
    # v' slightly below (1-b2) g^2: the recovered v would be negative -> 0; a nan stays nan.
    v = torch.tensor([(1 - b2) * 1.0 * 0.999, float("nan"), (1 - b2) * 9.0 + 0.5])
    p = torch.randn(3)
    s = AdamScalars(1e-3, 0.9, b2, 1e-8, 0.0, 2)
    _, _, v0 = reference.undo(p, g, m, v, s, AdamVariant())
    assert v0[0] == 0.0
    assert torch.isnan(v0[1])
    assert v0[2] > 0


def test_non_finite_gradient_auto_snapshots_and_restores_finite_state():
    params = {"w": torch.randn(6)}
    opt = sofx.adamw()
    state = opt.init(params)
    g = torch.randn(6)
    g[2] = float("inf")
    p1, s1, rec = opt.update(params, {"w": g}, state)
    assert rec.strategies() == ["snapshot"]
    p0, s0 = opt.undo(p1, s1, rec)
    assert torch.equal(p0["w"], params["w"]) and torch.equal(s0.nu["w"], state.nu["w"])


def test_forced_algebraic_refuses_impossible_configurations_and_changes_nothing():
    params = {"w": torch.randn(6)}
    grads = {"w": torch.randn(6)}
    with pytest.raises(sofx.UnsupportedError, match="bfloat16"):
        sofx.adamw(state_dtype=torch.bfloat16, undo="algebraic")
    opt = sofx.adamw(betas=(0.0, 0.99), undo="algebraic")
    state = opt.init(params)
    before = params["w"].clone()
    with pytest.raises(sofx.UnsupportedError, match=r"params\['w'\].*beta of 0"):
        opt.update(params, grads, state, donate=True)
    assert torch.equal(params["w"], before) and int(state.count["w"]) == 0
    # Betas that are 0 or subnormal in float32 (as the kernels compute: 1/beta would overflow into nan), or so
    # small that dividing by them loses more than half of float32's bits (1e-6: m restored 19% off).
    for tiny in (1.8e-291, 1e-40, 1e-6, ALGEBRAIC_MIN_DIVISOR / 2):
        for betas in ((0.9, tiny), (tiny, 0.999)):
            opt = sofx.adamw(betas=betas, undo="algebraic")
            with pytest.raises(sofx.UnsupportedError, match=r"params\['w'\].*beta of 0"):
                opt.update(params, grads, opt.init(params), donate=True)
            assert torch.equal(params["w"], before)
    opt = sofx.adamw(betas=(ALGEBRAIC_MIN_DIVISOR, ALGEBRAIC_MIN_DIVISOR), undo="algebraic")
    p1, s1, rec = opt.update(params, grads, opt.init(params))
    assert rec.strategies() == ["algebraic"]
    # lr * wd == 1, or within 2^-12 of it (1 + 3e-8: the parameter restored off by about 1 before)
    for lr, wd in ((2.0, 0.5), (1.0, 1 + 3e-8), (1.0, 1 - ALGEBRAIC_MIN_DIVISOR / 2)):
        opt = sofx.adamw(lr=lr, weight_decay=wd, undo="algebraic")
        with pytest.raises(sofx.UnsupportedError, match="lr \\* weight_decay == 1"):
            opt.update(params, grads, opt.init(params))
    opt = sofx.adamw(undo="algebraic")
    half = {"w": params["w"].bfloat16()}
    with pytest.raises(sofx.UnsupportedError, match="master weights"):
        opt.update(half, {"w": grads["w"].bfloat16()}, opt.init(half))
    # lr * wd == 1 with auto: the parameter is snapshotted, the moments recomputed.
    opt = sofx.adamw(lr=2.0, weight_decay=0.5)
    p1, s1, rec = opt.update(params, grads, opt.init(params))
    assert rec.strategies() == ["param_snapshot"]
    p0, _ = opt.undo(p1, s1, rec)
    assert torch.equal(p0["w"], params["w"])


def test_check_inputs_refuses_what_update_refuses_reading_no_gradient(monkeypatch):
    """check_inputs (for callers that step a tree's leaves in several calls) raises update's refusals, naming
    the leaf, without reading a gradient; zero_missing checks a leaf without one as stepped with zeros."""
    import importlib

    from sofx import AdamHParams

    adam_module = importlib.import_module("sofx.adam")
    monkeypatch.setattr(adam_module, "_all_finite", lambda *_: pytest.fail("a gradient was read"))
    params = {"a": torch.randn(4), "w": torch.randn(6)}
    grads = {"a": torch.randn(4), "w": torch.randn(6)}
    opt = sofx.adamw(undo="algebraic")
    state = opt.init(params)
    bad = {"a": AdamHParams(), "w": AdamHParams(beta1=0.0)}
    with pytest.raises(sofx.UnsupportedError, match=r"params\['w'\]: undo='algebraic' is impossible.*beta of 0"):
        opt.check_inputs(params, grads, state, bad)
    opt.check_inputs(params, grads, state, bad, check_undo=False)
    no_w = {"a": grads["a"], "w": None}
    opt.check_inputs(params, no_w, state, bad)  # w is not stepped
    with pytest.raises(sofx.UnsupportedError, match=r"params\['w'\]: undo='algebraic' is impossible"):
        opt.check_inputs(params, no_w, state, bad, zero_missing=True)
    with pytest.raises(sofx.HParamError, match=r"hparams for params\['w'\]: lr = -1.0 is invalid"):
        opt.check_inputs(params, no_w, state, {"a": AdamHParams(), "w": AdamHParams(lr=-1.0)}, zero_missing=True)
    half = {"w": params["w"].bfloat16()}
    with pytest.raises(sofx.UnsupportedError, match=r"params\['w'\].*master weights"):
        opt.check_inputs(half, {"w": grads["w"].bfloat16()}, opt.init(half))
    with pytest.raises(sofx.UnsupportedError, match=r"params\['a'\].*lr \* weight_decay == 1"):
        opt.check_inputs(params, grads, state, AdamHParams(lr=2.0, weight_decay=0.5))
    sofx.adamw(betas=(0.0, 0.99)).check_inputs(params, grads, state)  # auto: a snapshot, no refusal


@pytest.mark.parametrize("other", [dict(decoupled=False), dict(bias_correction=False)])
def test_a_record_is_undone_only_by_an_optimizer_of_its_variant(other):
    """A record undone (or undone and redone) by an optimizer with other weight decay or bias correction: its
    inverse would restore other values (0.002-0.04 off before, silently); refused, nothing changes, and the
    record still undoes with its own optimizer."""
    gen = torch.Generator().manual_seed(3)
    params, grads = {"w": torch.randn(6, generator=gen)}, {"w": torch.randn(6, generator=gen)}
    own = sofx.adamw(lr=1e-2, weight_decay=0.1)
    kwargs = dict(lr=1e-2, weight_decay=0.1, bias_correction=other.get("bias_correction", True))
    stranger = sofx.adamw(**kwargs) if other.get("decoupled", True) else sofx.adam(**kwargs)
    p1, s1, rec = own.update(params, grads, own.init(params))
    before = [t.clone() for t in (p1["w"], s1.mu["w"], s1.nu["w"])]
    with pytest.raises(sofx.UndoError, match="other values"):
        stranger.undo(p1, s1, rec, donate=True)
    with pytest.raises(sofx.UndoError, match="other values"):
        stranger.undo_redo(p1, s1, rec, grads, donate=True)
    assert all(torch.equal(a, b) for a, b in zip((p1["w"], s1.mu["w"], s1.nu["w"]), before))
    p0, _ = own.undo(p1, s1, rec)
    assert torch.allclose(p0["w"], params["w"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_a_record_inverting_the_moments_is_refused_on_rounded_moments(state_dtype):
    """An algebraic record of an optimizer with float32 moments, given to one whose moments are rounded
    (``state_dtype``) with a state of the same step count: no step of rounded moments makes such a record
    (they have no inverse: a snapshot), so it is another optimizer's, whose inverse 'restored' moments 0.05
    off before, silently. Refused naming the leaf, nothing changes; its own optimizer still undoes it."""
    gen = torch.Generator().manual_seed(4)
    own = sofx.adamw(lr=1e-2, weight_decay=0.1, backend="reference")
    stranger = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, backend="reference")
    params, state = {"w": torch.randn(50, generator=gen)}, own.init({"w": torch.zeros(50)})
    other = stranger.init(params)
    for _ in range(5):
        g = {"w": torch.randn(50, generator=gen)}
        params, state, _ = own.update(params, g, state, undoable=False)
        _, other, _ = stranger.update(params, g, other, undoable=False)
    p1, s1, rec = own.update(params, {"w": 0.1 * torch.randn(50, generator=gen)}, state)
    q1, t1, _ = stranger.update(params, {"w": 0.1 * torch.randn(50, generator=gen)}, other)
    assert rec.strategies() == ["algebraic"] and torch.equal(t1.count["w"], s1.count["w"])
    before = clone_tree((q1, t1))
    for call in (lambda: stranger.undo(q1, t1, rec, donate=True),
                 lambda: stranger.undo_redo(q1, t1, rec, {"w": torch.ones(50)}, donate=True)):
        with pytest.raises(sofx.UndoError, match=rf"params\['w'\]: .*{state_dtype}"):
            call()
    assert trees_equal((q1, t1), before) and not rec.used
    p0, _ = own.undo(p1, s1, rec)
    assert torch.allclose(p0["w"], params["w"], rtol=0, atol=1e-6)


def test_forced_algebraic_with_non_finite_gradient_steps_but_refuses_to_undo():
    params = {"w": torch.randn(4)}
    opt = sofx.adamw(undo="algebraic")
    state = opt.init(params)
    g = torch.tensor([1.0, float("nan"), 0.5, 0.1])
    p1, s1, rec = opt.update(params, {"w": g}, state)
    assert rec.strategies() == ["none"]
    with pytest.raises(sofx.UndoError, match=r"params\['w'\].*not finite"):
        opt.undo(p1, s1, rec)
    assert not rec.used


@pytest.mark.parametrize("undo", ["auto", "exact"])
def test_undo_redo_equals_undo_then_update(undo):
    gen = torch.Generator().manual_seed(9)
    params = {"a": torch.randn(40, generator=gen), "b": torch.randn(5, generator=gen),
              "c": torch.randn(3, generator=gen)}
    opt = sofx.adam(lr=1e-2, weight_decay=0.1, undo=undo)
    state = opt.init(params)
    g = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    p1, s1, _ = opt.update(params, g, state)
    step_grads = {**g, "c": None}
    p2, s2, rec = opt.update(p1, step_grads, s1, sofx.AdamHParams(lr=2e-2))
    g_new = {"a": torch.randn(40, generator=gen), "b": None, "c": torch.randn(3, generator=gen)}
    hp_new = sofx.AdamHParams(lr=5e-3, beta1=0.8)
    fused_p, fused_s, fused_rec = opt.undo_redo(p2, s2, rec, g_new, hp_new, grad_scale=0.25)
    assert rec.used
    # The same by hand: an identical step (pure update: same inputs, same outputs), undone, then redone.
    q2, t2, rec2 = opt.update(p1, step_grads, s1, sofx.AdamHParams(lr=2e-2))
    q1, t1 = opt.undo(q2, t2, rec2)
    ref_p, ref_s, _ = opt.update(q1, g_new, t1, hp_new, grad_scale=0.25)
    for k in params:
        assert _norm_rel(fused_p[k], ref_p[k]) <= 1e-6, k
        assert _norm_rel(fused_s.mu[k], ref_s.mu[k]) <= 1e-6, k
        assert _norm_rel(fused_s.nu[k], ref_s.nu[k]) <= 1e-6, k
        assert int(fused_s.count[k]) == int(ref_s.count[k]), k
    assert int(fused_s.count["b"]) == 1 and int(fused_s.count["c"]) == 2
    # b had no new gradient: it is only undone, back to its state after the first step.
    assert _norm_rel(fused_p["b"], p1["b"]) <= 1e-6
    # The new record undoes the redone step.
    back_p, back_s = opt.undo(fused_p, fused_s, fused_rec)
    assert _norm_rel(back_p["a"], p1["a"]) <= 1e-6
    assert trees_equal(back_s.count, s1.count)


def test_undoing_the_first_step_restores_exactly_zero_moments_even_when_the_redo_is_tiny():
    gen = torch.Generator().manual_seed(11)
    params = {"w": torch.randn(1000, generator=gen)}
    opt = sofx.adamw(lr=1e-3)
    state = opt.init(params)
    g = {"w": 100 * torch.randn(1000, generator=gen)}
    p1, s1, rec = opt.update(params, g, state)
    assert rec.leaves[0].strategy == "algebraic" and rec.leaves[0].moments_were_zero
    p0, s0 = opt.undo(p1, s1, rec)
    assert torch.count_nonzero(s0.mu["w"]) == 0 and torch.count_nonzero(s0.nu["w"]) == 0
    # A heavily clipped redo of the first step (coefficient 1e-6) equals the direct clipped step.
    p1, s1, rec = opt.update(params, g, state, donate=False)
    redone, redone_state, _ = opt.undo_redo(p1, s1, rec, g, grad_scale=1e-6)
    direct, direct_state, _ = opt.update(params, g, state, grad_scale=1e-6)
    assert torch.equal(redone_state.mu["w"], direct_state.mu["w"])
    assert torch.equal(redone_state.nu["w"], direct_state.nu["w"])
    assert _norm_rel(redone["w"], direct["w"]) <= 1e-6
    # Donated: the same, in place. (The step overwrites the moments it was given: whether they were zero
    # must be read before it; read after, a donated first step was recorded as not fresh and its undo left
    # rounding leftovers in v that a clipped redo magnified -- found by tests/test_offload_state_machine.py,
    # the offload engine always donates.)
    buf = {"w": params["w"].clone()}
    st = opt.init(buf)
    p1, s1, rec = opt.update(buf, g, st, donate=True)
    assert rec.leaves[0].moments_were_zero
    p0, s0 = opt.undo(p1, s1, rec, donate=True)
    assert s0.mu["w"].data_ptr() == st.mu["w"].data_ptr()
    assert torch.count_nonzero(s0.mu["w"]) == 0 and torch.count_nonzero(s0.nu["w"]) == 0
    buf = {"w": params["w"].clone()}
    p1, s1, rec = opt.update(buf, g, opt.init(buf), donate=True)
    redone, redone_state, _ = opt.undo_redo(p1, s1, rec, g, grad_scale=1e-6, donate=True)
    assert torch.equal(redone_state.mu["w"], direct_state.mu["w"])
    assert torch.equal(redone_state.nu["w"], direct_state.nu["w"])
    assert _norm_rel(redone["w"], direct["w"]) <= 1e-6


@pytest.mark.parametrize("decoupled", [True, False])
def test_inverse_recomputes_exactly_the_update_the_step_subtracted(decoupled):
    """SPECULATION.md section 2.1: u is recomputed with the step's operation order, bit for bit."""
    gen = torch.Generator().manual_seed(12)
    p, g, m = (torch.randn(100_000, generator=gen) for _ in range(3))
    v = torch.rand(100_000, generator=gen)
    s = AdamScalars(3e-3, 0.9, 0.999, 1e-8, 0.0, 7)
    variant = AdamVariant(decoupled, True)
    p1, m1, v1 = reference.step(p, g, m, v, s, variant)
    u = reference._update_direction(m1, v1, s, variant)
    assert torch.equal(p1, p - u)


# ------------------------------------------------------------------ the grads_finite hint
def _adam_module():
    import sys

    return sys.modules["sofx.adam"]  # ``sofx.adam`` is the function; the module holds _all_finite


def _same_bits(a, b) -> bool:
    """Same structure and every tensor leaf the same dtype, shape and bytes (a nan matches the same nan)."""
    la, sa = sofx.tree.flatten(a)
    lb, sb = sofx.tree.flatten(b)
    return sa == sb and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8))
        for x, y in zip(la, lb))


def _assert_records_equal(a, b) -> None:
    assert a.spec == b.spec and len(a.leaves) == len(b.leaves)
    for x, y in zip(a.leaves, b.leaves):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert (x.strategy, x.reason, x.moments_were_zero) == (y.strategy, y.reason, y.moments_were_zero)
        assert tuple(x.scalars) == tuple(y.scalars)
        assert x.grad is y.grad and torch.equal(x.count_before, y.count_before)
        for s, t in ((x.p_old, y.p_old), (x.m_old, y.m_old), (x.v_old, y.v_old)):
            assert (s is None) == (t is None)
            if s is not None:
                assert _same_bits(s, t)


@settings(max_examples=100)
@given(cases(), st.sampled_from(["auto", "algebraic", "exact"]), st.booleans())
def test_grads_finite_hint_gives_the_same_step_record_and_undo(c, undo, donate):
    """With finite gradients the hint changes nothing: same outputs, same record, same undo, bit for bit."""
    s_dtype = c["s_dtype"] or c["p_dtype"]
    if undo == "algebraic" and (s_dtype in (torch.bfloat16, torch.float16) or c["p_dtype"] in (
            torch.bfloat16, torch.float16) or min(c["hp"].beta1, c["hp"].beta2) < ALGEBRAIC_MIN_DIVISOR
            or (c["decoupled"] and abs(1 - c["hp"].lr * c["hp"].weight_decay) < ALGEBRAIC_MIN_DIVISOR)):
        undo = "auto"  # refused by undo='algebraic' (tested elsewhere)
    opt, params, grads, state = _setup({**c, "undo": undo})
    results = []
    for hint in (None, True):
        p_in, s_in = sofx.tree.tree_map(torch.clone, params), sofx.tree.tree_map(torch.clone, state)
        new_p, new_s, rec = opt.update(p_in, grads, s_in, c["hp"], grad_scale=c["grad_scale"], donate=donate,
                                       grads_finite=hint)
        out = (sofx.tree.tree_map(torch.clone, new_p), sofx.tree.tree_map(torch.clone, new_s))
        back = opt.undo(new_p, new_s, rec, donate=donate)
        results.append((out, rec, back))
    (out0, rec0, back0), (out1, rec1, back1) = results
    assert _same_bits(out0, out1)
    _assert_records_equal(rec0, rec1)
    assert _same_bits(back0, back1)


@pytest.mark.parametrize("undo", ["auto", "algebraic"])  # "exact" always snapshots and never checks
def test_grads_finite_hint_skips_the_pass_over_the_gradients(undo, monkeypatch):
    gen = torch.Generator().manual_seed(13)
    params = {"a": torch.randn(50, generator=gen), "b": torch.randn(7, generator=gen)}
    grads = {"a": torch.randn(50, generator=gen), "b": torch.randn(7, generator=gen)}
    # The reference backend reads the gradients before the step (the CPU kernels check them in the step
    # itself: tests/test_adam_checked_step.py).
    opt = sofx.adamw(lr=1e-2, undo=undo, backend="reference")
    state = opt.init(params)
    p1, s1, rec1 = opt.update(params, grads, state)
    p2, s2, rec2 = opt.update(p1, grads, s1)
    reads = []

    def no_pass(x, *_):
        reads.append(x)
        raise AssertionError("the gradients were read to check finiteness despite grads_finite=True")

    monkeypatch.setattr(_adam_module(), "_all_finite", no_pass)
    with pytest.raises(AssertionError, match="despite grads_finite"):
        opt.update(params, grads, state)  # the check is really done without the hint...
    for hint in (None, False):
        with pytest.raises(AssertionError, match="despite grads_finite"):
            opt.update(params, grads, state, grads_finite=hint)
    with pytest.raises(AssertionError, match="despite grads_finite"):
        opt.undo_strategies(params, grads, state)
    reads.clear()
    assert opt.undo_strategies(params, grads, state, grads_finite=True) == [("algebraic", "")] * 2
    q1, t1, r1 = opt.update(params, grads, state, grads_finite=True)  # ...and skipped with it
    q2, t2, r2 = opt.update(q1, grads, t1, grads_finite=True)
    g_new = {"a": torch.randn(50, generator=gen), "b": None}
    fused = opt.undo_redo(q2, t2, r2, g_new, grad_scale=0.5, grads_finite=True)
    assert reads == []
    monkeypatch.undo()
    assert trees_equal(q2, p2) and trees_equal(t2, s2)
    _assert_records_equal(r2, rec2)
    ref = opt.undo_redo(p2, s2, rec2, g_new, grad_scale=0.5)
    assert trees_equal(fused[0], ref[0]) and trees_equal(fused[1], ref[1])
    _assert_records_equal(fused[2], ref[2])


def test_grads_finite_must_be_a_bool_or_none():
    params = {"w": torch.randn(3)}
    opt = sofx.adamw()
    with pytest.raises(sofx.UnsupportedError, match="grads_finite"):
        opt.update(params, {"w": torch.randn(3)}, opt.init(params), grads_finite=1)


def test_donate_must_be_a_bool():
    """donate="no" is true: it donated (and the reference backend raised a TypeError later); refused by every
    call that takes it, nothing written."""
    params, grads = {"w": torch.randn(3)}, {"w": torch.randn(3)}
    opt = sofx.adamw()
    p1, s1, rec = opt.update(params, grads, opt.init(params))
    before = [p1["w"].clone(), s1.mu["w"].clone()]
    for call in (lambda: opt.update(p1, grads, s1, donate="no"), lambda: opt.undo(p1, s1, rec, donate="no"),
                 lambda: opt.undo_redo(p1, s1, rec, grads, donate=1),
                 lambda: opt.check_inputs(p1, grads, s1, donate="no")):
        with pytest.raises(sofx.UnsupportedError, match=r"donate = .*; expected a bool \(True or False\)"):
            call()
    assert torch.equal(p1["w"], before[0]) and torch.equal(s1.mu["w"], before[1]) and not rec.used


def test_batched_finiteness_check_agrees_with_the_per_leaf_one():
    """The GPU path (one multi-tensor largest magnitude, one read back) gives the per-leaf answers: a nan or
    an inf, or a finite element whose scaled magnitude exceeds GRADIENT_LIMIT (its square could overflow the
    second moment) is not undone algebraically."""
    from sofx.kernels.base import GRADIENT_LIMIT

    adam_module = _adam_module()
    nan, inf = float("nan"), float("inf")
    gs = [torch.tensor([1.0, nan]), torch.tensor([inf, 1.0]), torch.tensor([-inf], dtype=torch.float16),
          torch.tensor([3e38, 3e38]), torch.tensor([6e4, 6e4], dtype=torch.float16),
          torch.ones(5, dtype=torch.bfloat16), torch.empty(0), torch.randn(100, dtype=torch.float64),
          torch.tensor([1.5 * GRADIENT_LIMIT, 1.0])]
    for scale, last in ((1.0, False), (0.5, True)):  # the limit is on |g * grad_scale|
        want = [False, False, False, False, True, True, True, True, last]
        assert [adam_module._all_finite(g, scale) for g in gs] == want
        assert adam_module._finite_flags(gs, scale, batched=True) == want
        assert adam_module._finite_flags(gs, scale, batched=False) == want
    assert adam_module._finite_flags([], 1.0, batched=True) == []


@pytest.mark.parametrize("hint", [True, None])
def test_leaves_sharing_hparams_and_count_keep_their_own_strategy(hint):
    """Plans are shared by leaves alike in hparams, count, finiteness and dtypes only: a bf16 master beside
    float32 ones (one group, one count) gets its parameter snapshot, and leaves of other counts their t."""
    gen = torch.Generator().manual_seed(5)
    params = {"a": torch.randn(40, generator=gen), "b": torch.randn(40, generator=gen).to(torch.bfloat16),
              "c": torch.randn(40, generator=gen)}
    grads = {k: torch.randn(40, generator=gen).to(v.dtype) for k, v in params.items()}
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32)
    state = opt.init(params)
    # c: 7 steps in (moments not zero: a zero v given a gradient would make its step lossy to invert)
    state = sofx.AdamState({**state.count, "c": torch.tensor(7)},
                           {**state.mu, "c": 0.1 * torch.randn(40, generator=gen)},
                           {**state.nu, "c": 1.0 + torch.rand(40, generator=gen)})
    _, _, record = opt.update(params, grads, state, grads_finite=hint)
    assert record.strategies() == ["algebraic", "param_snapshot", "algebraic"]
    assert [rec.scalars.step for rec in record.leaves] == [1, 1, 8]


def test_leaves_of_several_backends_in_one_update(rng):
    """float64 leaves go to the reference backend, float32 ones to the native kernels, bf16 params to
    the native kernels with snapshots (bf16 states): one update / undo_redo / undo hands each backend its leaves at
    once; every leaf gets exactly what a tree of that leaf alone gets, in the tree's order."""
    params = {"a": torch.randn(50, generator=rng), "b": torch.randn(6, generator=rng, dtype=torch.float64),
              "c": torch.randn(20, generator=rng).to(torch.bfloat16), "d": torch.randn(3, 4, generator=rng),
              "e": torch.randn(7, generator=rng, dtype=torch.float64)}
    grads = {k: torch.randn(v.shape, generator=rng).to(v.dtype) for k, v in params.items()}
    grads2 = {k: torch.randn(v.shape, generator=rng).to(v.dtype) for k, v in params.items()}
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(params)
    p1, s1, r1 = opt.update(params, grads, state)
    p2, s2, r2 = opt.update(p1, grads2, s1)
    p3, s3, _ = opt.undo_redo(p2, s2, r2, grads, grad_scale=0.5)
    p4, s4 = opt.undo(*opt.update(p1, grads2, s1))
    assert r1.strategies() == ["algebraic", "algebraic", "snapshot", "algebraic", "algebraic"]  # c: bf16 states
    for k in params:
        one = lambda t: {k: t[k]}  # noqa: E731
        q1, t1, _ = opt.update(one(params), one(grads), sofx.AdamState(*(one(x) for x in state)))
        q2, t2, rq2 = opt.update(q1, one(grads2), t1)
        q3, t3, _ = opt.undo_redo(q2, t2, rq2, one(grads), grad_scale=0.5)
        q4, t4 = opt.undo(*opt.update(q1, one(grads2), t1))
        for got, want in ((p1, q1), (p3, q3), (p4, q4), (s3.mu, t3.mu), (s3.nu, t3.nu), (s4.nu, t4.nu)):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("undo", ["auto", "exact"])
def test_a_donated_redo_of_a_snapshot_keeps_values_the_caller_may_reuse(backend, undo):
    """A record of an update without donation keeps the caller's tensors themselves (the caller keeps them
    unchanged while that record may be undone). Once a donated undo_redo has used it, the caller may reuse
    them; the new record, whose redo needs a snapshot again (a clipped spike, or undo="exact"), must not
    refer to them: it keeps its own copy (it kept the caller's tensors, and its undo restored whatever the
    caller had written there since). A record of a donated update keeps its own copies, which the redo's
    record shares (no copy)."""
    gen = torch.Generator().manual_seed(12)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, undo=undo, backend=backend)
    params = {"a": torch.randn(40, generator=gen), "w": torch.randn(3, 50, generator=gen)}
    state = opt.init(params)
    params, state, _ = opt.update(params, {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}, state)
    grads = {k: 1e4 * torch.randn(p.shape, generator=gen) for k, p in params.items()}  # dominates: a snapshot
    before = sofx.tree.tree_map(torch.clone, (params, state))
    for donated_update in (False, True):
        ins = sofx.tree.tree_map(torch.clone, (params, state))
        p1, s1, rec = opt.update(*ins[:1], grads, ins[1], donate=donated_update)
        assert rec.strategies() == ["snapshot", "snapshot"]
        p2, s2, rec2 = opt.undo_redo(p1, s1, rec, grads, grad_scale=0.01, donate=True)
        assert rec2.strategies() == ["snapshot", "snapshot"] and rec.used
        for old, new in zip(rec.leaves, rec2.leaves):
            shared = [a is b for a, b in zip((old.p_old, old.m_old, old.v_old), (new.p_old, new.m_old, new.v_old))]
            assert shared == [donated_update] * 3
        for t in sofx.tree.flatten((ins[0], ins[1].mu, ins[1].nu))[0]:  # the caller reuses its tensors
            t.fill_(float("nan"))
        p3, s3 = opt.undo(p2, s2, rec2, donate=True)
        for a, b in zip(sofx.tree.flatten((p3, s3))[0], sofx.tree.flatten(before)[0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("donate", [False, True])
def test_an_undo_redo_of_mixed_records_steps_whole_snapshots_from_the_callers_tensors(backend, donate):
    """One undo_redo over a record of an update without donation that mixes a chunk snapshot ("a": a spike in
    one chunk; a whole snapshot on the reference), whole snapshots that keep the caller's tensors themselves ("w"
    non-contiguous, "u" without a new gradient: only undone) and an algebraic leaf redone fused ("z"), with
    parameter copies: "w" is the clipped step from the old state and "u" the old state, bit for bit, the others
    within float32 rounding; the caller's tensors are not written; the new record undoes it."""
    gen = torch.Generator().manual_seed(13)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    params = {"a": torch.randn(2 * 1024 + 3, generator=gen), "u": torch.randn(40, generator=gen),
              "w": torch.randn(5, 300, generator=gen).t(), "z": torch.randn(30, generator=gen)}
    state = opt.init(params)
    for _ in range(20):
        params, state, _ = opt.update(params, {k: torch.randn(p.shape, generator=gen) for k, p in params.items()},
                                      state, undoable=False)
    params["w"] = params["w"].t().contiguous().t()  # (the kernels' outputs are contiguous)
    state = state._replace(mu={**state.mu, "w": state.mu["w"].t().contiguous().t()},
                           nu={**state.nu, "w": state.nu["w"].t().contiguous().t()})
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    grads["a"][1024 + 5] = 1e4
    grads["u"], grads["w"] = 1e4 * grads["u"], 1e4 * grads["w"]
    before = sofx.tree.tree_map(torch.clone, (params, state))
    p1, s1, rec = opt.update(params, grads, state)
    assert rec.strategies()[1:] == ["snapshot", "snapshot", "algebraic"]
    assert rec.leaves[2].p_old is params["w"] and not params["w"].is_contiguous()
    new_grads = {**grads, "u": None}
    copies = {k: torch.zeros(p.shape, dtype=torch.bfloat16) for k, p in params.items()}
    p2, s2, rec2 = opt.undo_redo(p1, s1, rec, new_grads, grad_scale=0.5, donate=donate, param_copies=copies)
    want_p, want_s, _ = opt.update(*sofx.tree.tree_map(torch.clone, (params, new_grads, state)), grad_scale=0.5,
                                   undoable=False)
    for k in params:
        got, want = (p2[k], s2.mu[k], s2.nu[k], s2.count[k]), (want_p[k], want_s.mu[k], want_s.nu[k], want_s.count[k])
        assert all(torch.equal(a, b) if k in "uw" or a.dtype == torch.int64 else _norm_rel(a, b) <= 1e-6
                   for a, b in zip(got, want)), k
        assert torch.equal(copies[k], p2[k].to(torch.bfloat16)), k
    assert trees_equal((params, state), before)  # the record's kept tensors (the caller's) were read only
    p3, s3 = opt.undo(p2, s2, rec2, donate=donate)
    assert rec2.leaves[1] is None  # ("u": not stepped, as it was)
    for a, b in zip(sofx.tree.flatten((p3, s3))[0], sofx.tree.flatten(before)[0]):
        assert _norm_rel(a, b) <= 1e-6 and a.dtype == b.dtype


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("kept", ["snapshot", "exact", "param_snapshot"])
def test_a_redo_without_donation_keeps_no_tensor_the_caller_may_reuse(backend, kept):
    """As a donated undo_redo's (above), the record of an undo_redo without donation must not refer to the
    tensors that the record it used kept from its own caller (an update without donation keeps the params
    and moments passed in, which the caller may reuse once that record is used): a whole snapshot stepped
    from (a spike, or undo="exact"), or an old parameter kept whole (lr * weight_decay near 1) that the
    undo passes on. The caller reuses them (a donated update writes into them), then undoes the new
    record: the state before the first update, bit for bit (the moments a param_snapshot recomputes: to
    float32 rounding)."""
    gen = torch.Generator().manual_seed(12)
    opt = sofx.adamw(lr=0.9 if kept == "param_snapshot" else 1e-2, weight_decay=0.9 if kept == "param_snapshot"
                     else 0.1, undo="exact" if kept == "exact" else "auto", backend=backend)
    params = {"a": torch.randn(40, generator=gen), "w": torch.randn(3, 50, generator=gen)}
    state = opt.init(params)
    for _ in range(5):
        params, state, _ = opt.update(params, {k: torch.randn(p.shape, generator=gen) for k, p in params.items()},
                                      state)
    size = 1e4 if kept == "snapshot" else 1.0  # a spike dominates the second moment: a snapshot
    grads = {k: size * torch.randn(p.shape, generator=gen) for k, p in params.items()}
    before = sofx.tree.tree_map(torch.clone, (params, state))
    for donated_update in (False, True):
        ins = sofx.tree.tree_map(torch.clone, (params, state))
        p1, s1, rec = opt.update(ins[0], grads, ins[1], donate=donated_update)
        assert ("param_snapshot" if kept == "param_snapshot" else "snapshot") in rec.strategies()
        p2, s2, rec2 = opt.undo_redo(p1, s1, rec, grads, grad_scale=0.5)
        assert rec.used and set(rec2.strategies()) & {"snapshot", "param_snapshot"}, rec2.strategies()
        opt.update(ins[0], grads, ins[1], donate=True)  # the caller reuses its tensors: written in place
        p3, s3 = opt.undo(p2, s2, rec2)
        assert trees_equal((p3, s3.count), (before[0], before[1].count))
        for a, b in zip(sofx.tree.flatten((s3.mu, s3.nu))[0], sofx.tree.flatten((before[1].mu, before[1].nu))[0]):
            if kept == "param_snapshot":
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            else:
                assert torch.equal(a, b), (donated_update, rec.strategies(), rec2.strategies())


# ------------------------------------------------------------------ the redo of a leaf's first step
@contextlib.contextmanager
def _kernel_calls(backend: str):
    """Count the calls of ``backend``'s list forms an undo_redo makes (``{"undo_redo_many": n, ...}``): a fused
    redo is one ``undo_redo_many``, an unfused one an ``undo_many`` and a ``step_many``."""
    module = sofx.kernels.load_backend(backend)
    calls = {"undo_redo_many": 0, "undo_many": 0, "step_many": 0}

    def counted(name):
        real = getattr(module, name)

        def run(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return run

    with pytest.MonkeyPatch.context() as mp:
        for name in calls:
            mp.setattr(module, name, counted(name))
        yield calls


@st.composite
def first_steps(draw):
    """A leaf's first step and its redo: hparams, the first step's ``grad_scale`` and the redo's (a clip: the
    gradient scaled by as little as 1e-6), the redo's gradient the record's own (a late clip) or a new one. Adam's L2
    decay with a weight decay of 0 only (its inverse gives exact zeros back: base.zeros_come_back)."""
    decoupled = draw(st.booleans())
    beta = st.one_of(st.sampled_from([0.5, 0.9, 0.99, 0.999]), st.floats(0.5, 0.9999))  # (algebraic: >= 0.5)
    hp = sofx.AdamHParams(lr=draw(st.floats(1e-5, 0.1)), beta1=draw(beta), beta2=draw(beta),
                          eps=draw(st.floats(1e-10, 1e-3)),
                          weight_decay=draw(st.floats(0.0, 0.5)) if decoupled else 0.0)
    return dict(decoupled=decoupled, hp=hp, bias_correction=draw(st.booleans()),
                grad_scale=draw(st.sampled_from([1.0, 0.5, 2.0, 0.3])),
                clip=draw(st.sampled_from([1e-3, 1e-6, 0.5, 1.0])), same_grad=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)), n=draw(st.integers(1, 2 * 1024 + 70)))


def check_first_step_redone_fused(backend: str, p_dtype: torch.dtype, donate: bool, undoable: bool, c: dict,
                                  ) -> None:
    """The undo_redo of a leaf's first step from init (float32 moments, no L2 decay: its inverse gives the zeros
    back exactly) runs fused (one undo_redo_many, no undo; a bfloat16 master's redo keeps the old parameter
    that the undone record kept), and gives the bits of undo then update: the same values, the same record
    (again a first step from zero moments); the reference's moments bit for bit; the parameters to DESIGN.md's
    tolerance of the float64 truth (the same first step and redo in float64), not of the float32 reference's:
    two float32 results each within it of the truth may be twice as far apart (cpu_fast's steps differ from the
    reference's by ulps of the update). Relative to the magnitudes the redo computes with: the parameter, and
    for a float32 master the first step's result p1, which the undo recovers p from (p1 + u, exact where they
    cancel but for p1's own rounding: an ulp of p1, large against a small p that the first step moved far)."""
    gen = torch.Generator().manual_seed(c["seed"])
    params = {"w": torch.randn(c["n"], generator=gen).to(p_dtype), "b": torch.randn(5, generator=gen).to(p_dtype)}
    grads = {k: torch.randn(x.shape, generator=gen).to(p_dtype) for k, x in params.items()}
    new = grads if c["same_grad"] else {k: (100 * torch.randn(x.shape, generator=gen)).to(p_dtype)
                                        for k, x in params.items()}
    kind = sofx.adamw if c["decoupled"] else sofx.adam

    def first(opt):  # the first step, afresh (donated: it takes its inputs' storage)
        p1, s1, rec = opt.update(clone_tree(params), grads, opt.init(params), c["hp"], grad_scale=c["grad_scale"],
                                 donate=donate)
        assert all(leaf.moments_were_zero for leaf in rec.leaves)
        return p1, s1, rec

    def redone(opt, stepped):
        return opt.undo_redo(*stepped, new, c["hp"], grad_scale=c["clip"], donate=donate, undoable=undoable)

    opt = kind(bias_correction=c["bias_correction"], state_dtype=torch.float32, backend=backend)
    stepped = first(opt)
    with _kernel_calls(backend) as calls:
        p2, s2, rec2 = redone(opt, stepped)
    assert (calls["undo_redo_many"], calls["undo_many"]) == (1, 0), calls
    q0, t0 = opt.undo(*first(opt), donate=donate)
    want_p, want_s, want_rec = opt.update(q0, new, t0, c["hp"], grad_scale=c["clip"], donate=donate,
                                          undoable=undoable)
    assert_trees_bitwise(_bits_tree((p2, s2)), _bits_tree((want_p, want_s)))
    assert rec2.strategies() == want_rec.strategies()
    assert [leaf.moments_were_zero for leaf in rec2.leaves] == [leaf.moments_were_zero for leaf in want_rec.leaves]
    ref = kind(bias_correction=c["bias_correction"], state_dtype=torch.float32, backend="reference")
    _, ref_s, _ = redone(ref, first(ref))
    assert_trees_bitwise(_bits_tree(s2), _bits_tree(ref_s))
    wide = kind(bias_correction=c["bias_correction"], state_dtype=torch.float64, backend="reference")
    params64, grads64, new64 = (sofx.tree.tree_map(torch.Tensor.double, t) for t in (params, grads, new))
    p1_64, s1_64, rec_64 = wide.update(params64, grads64, wide.init(params64), c["hp"], grad_scale=c["grad_scale"])
    truth = wide.undo_redo(p1_64, s1_64, rec_64, new64, c["hp"], grad_scale=c["clip"])[0]
    tol = 1e-6 if p_dtype == torch.float32 else 1e-2
    for k in params:
        operand = params[k].double().abs()
        if p_dtype == torch.float32:
            operand = torch.maximum(operand, p1_64[k].abs())
        err = max_rel_err(p2[k], truth[k], operand)
        assert err <= tol, (k, err)
    if undoable:  # undone again (in place where donated): the init state's exact zeros
        _, s0 = opt.undo(p2, s2, rec2, donate=donate)
        assert not any(bool(t.any()) for t in sofx.tree.flatten((s0.count, s0.mu, s0.nu))[0])


def _bits_tree(tree):
    """``tree`` with every floating-point tensor as its bits (-0.0 and 0.0 told apart)."""
    return sofx.tree.tree_map(lambda t: bits(t) if t.is_floating_point() else t, tree)


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-fp32"])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("undoable", [True, False])
@settings(max_examples=25)
@given(c=first_steps())
@example(c=dict(decoupled=True, hp=sofx.AdamHParams(lr=0.026993478880013095, beta1=0.75, beta2=0.999,
                                                    eps=0.0006723025658575096, weight_decay=0.109375),
                bias_correction=False, grad_scale=0.3, clip=0.001, same_grad=True, seed=95557, n=565))
def test_the_redo_of_a_first_step_is_fused_and_equals_undo_then_update(backend, p_dtype, donate, undoable, c):
    """check_first_step_redone_fused over random hparams, sizes, clips. (The Triton backend:
    test_kernels_triton.py.)"""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    check_first_step_redone_fused(backend, p_dtype, donate, undoable, c)


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("mode", ["adam-l2", "bf16-moments"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_first_step_whose_inverse_is_not_exact_at_zero_is_redone_from_exact_zeros(backend, mode, donate):
    """The undo_redo of a leaf's first step from init where the inverse would not give the zeros back exactly
    (L2 decay: its effective gradient is from the recovered p; bfloat16 moments: kept whole anyway) is not
    fused: undone to the exact zeros, then stepped. A clipped redo (the gradient scaled by 1e-3) is undo then
    update bit for bit (the same record: in L2 mode again a first step from zero moments that keeps only p,
    adam.L2_FIRST_STEP_REASON), and the clipped step from init bit for bit (in L2 mode from the kept p: it was
    redone from the undone p, a few ulps off, which the redo's gh = g + wd * p carried into its moments)."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(21)
    params = {"w": torch.randn(2 * 1024 + 37, generator=gen)}
    grads = {"w": 100 * torch.randn(params["w"].shape, generator=gen)}
    state_dtype = torch.bfloat16 if mode == "bf16-moments" else torch.float32
    opt = sofx.adam(lr=1e-3, weight_decay=0.1, state_dtype=state_dtype, backend=backend)

    def first():
        return opt.update(clone_tree(params), grads, opt.init(params), donate=donate)

    stepped = first()
    with _kernel_calls(backend) as calls:
        p2, s2, rec2 = opt.undo_redo(*stepped, grads, grad_scale=1e-3, donate=donate)
    assert calls["undo_redo_many"] == 0
    q0, t0 = opt.undo(*first(), donate=donate)
    assert not t0.mu["w"].any() and not t0.nu["w"].any()
    want_p, want_s, want_rec = opt.update(q0, grads, t0, grad_scale=1e-3, donate=donate)
    assert_trees_bitwise(_bits_tree((p2, s2)), _bits_tree((want_p, want_s)))
    assert rec2.strategies() == want_rec.strategies() == (["param_snapshot"] if mode == "adam-l2" else ["snapshot"])
    assert rec2.leaves[0].moments_were_zero == want_rec.leaves[0].moments_were_zero == (mode == "adam-l2")
    direct_p, direct_s, _ = opt.update(clone_tree(params), grads, opt.init(params), grad_scale=1e-3)
    assert_trees_bitwise(_bits_tree((p2, s2)), _bits_tree((direct_p, direct_s)))  # from the very values before


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("inf_in", ["first", "redo"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_first_step_with_an_inf_is_redone_as_undo_then_update(backend, inf_in, donate):
    """The undo_redo of a leaf's first step from init whose gradient (``"first"``: a chunk snapshot of zero
    moments, redone fused by chunks on the checked backends) or whose redo's gradient (``"redo"``: its chunk
    flagged in the fused call) has an inf in one chunk: the bits and the record (strategy, kept chunks, again a
    first step from zero moments) of undo then update, the redo clipped (the gradient scaled by 1e-3)."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(22)
    n = 3 * 1024 + 5
    params = {"w": torch.randn(n, generator=gen), "b": torch.randn(7, generator=gen)}
    grads = {k: torch.randn(x.shape, generator=gen) for k, x in params.items()}
    new = {k: 10 * torch.randn(x.shape, generator=gen) for k, x in params.items()}
    (grads if inf_in == "first" else new)["w"][1024 + 3] = float("inf")
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)

    def first():
        return opt.update(clone_tree(params), grads, opt.init(params), donate=donate)

    stepped = first()
    with _kernel_calls(backend) as calls:
        p2, s2, rec2 = opt.undo_redo(*stepped, new, grad_scale=1e-3, donate=donate)
    if backend != "reference":  # (checked in the kernels: "b" and "w"'s redo fused; "w"'s first step by chunks)
        assert calls["undo_redo_many"] == 1 and calls["step_many"] == 0, calls
    q0, t0 = opt.undo(*first(), donate=donate)
    want_p, want_s, want_rec = opt.update(q0, new, t0, grad_scale=1e-3, donate=donate)
    assert_trees_bitwise(_bits_tree((p2, s2)), _bits_tree((want_p, want_s)))
    assert rec2.strategies() == want_rec.strategies()
    for got, want in zip(rec2.leaves, want_rec.leaves):
        assert got.moments_were_zero == want.moments_were_zero
        assert (got.chunks is None) == (want.chunks is None)
        if got.chunks is not None:
            assert torch.equal(got.chunks, want.chunks)
            assert_trees_bitwise(_bits_tree((got.p_old, got.m_old, got.v_old)),
                                 _bits_tree((want.p_old, want.m_old, want.v_old)))


# ------------------------------------------------------------------ the redo of a leaf that keeps its parameter
@st.composite
def kept_parameter_redos(draw):
    """Two redos in a row of a step of bfloat16 or float16 masters with float32 moments (a ``"param_snapshot"``
    record: the old parameter kept whole): Adam's L2 decay or AdamW's, from warm moments or a first step from
    init, the redos clipped (the gradient scaled by 1e-3 to 1), each with the gradient it undoes (a late clip) or
    a new one, the first redo's of which may hold an inf or a spike (a step that no algebraic inverse undoes well
    enough, but for a float16 one clipped hard) in one chunk; parameter copies or none. (The second redo's
    gradient is clean: a redo of a whole snapshot steps from its kept values, which are exact where an update's
    checked step with donation recovers them to a few ulps, an older path than the one tested here.)"""
    decoupled = draw(st.booleans())
    beta = st.one_of(st.sampled_from([0.5, 0.9, 0.99, 0.999]), st.floats(0.5, 0.9999))  # (algebraic: >= 0.5)
    hp = sofx.AdamHParams(lr=draw(st.floats(1e-5, 0.1)), beta1=draw(beta), beta2=draw(beta),
                          eps=draw(st.floats(1e-10, 1e-3)),
                          weight_decay=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5))))
    same = draw(st.booleans())
    bad = draw(st.sampled_from(["none", "inf", "spike"])) if not same else "none"
    return dict(decoupled=decoupled, hp=hp, bias_correction=draw(st.booleans()),
                p_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])), first=draw(st.booleans()),
                clips=[draw(st.floats(1e-3, 1.0)), draw(st.floats(1e-3, 1.0))],
                same=[same, bad == "none" and draw(st.booleans())], bad=[bad, "none"],
                copies=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
                n=draw(st.integers(1, 3 * 1024 + 70)))


def _assert_records_bitwise(got: sofx.UndoRecord, want: sofx.UndoRecord) -> None:
    """The same strategies, first steps, kept chunks and kept values (bits), gradients and scalars, leaf by leaf
    (not the reasons: a gradient read before the step or checked in it)."""
    assert got.strategies() == want.strategies()
    for a, b in zip(got.leaves, want.leaves):
        if a is None:
            continue
        assert (a.moments_were_zero, a.scalars) == (b.moments_were_zero, b.scalars)
        assert torch.equal(bits(a.grad), bits(b.grad)) and torch.equal(a.count_before, b.count_before)
        for x, y in ((a.p_old, b.p_old), (a.m_old, b.m_old), (a.v_old, b.v_old), (a.chunks, b.chunks)):
            assert (x is None) == (y is None)
            if x is not None:
                assert_trees_bitwise(_bits_tree(x), _bits_tree(y))


def check_kept_parameter_redone_fused(backend: str, donate: bool, c: dict) -> None:
    """update, undo_redo, undo_redo, undo of a leaf whose records keep its old parameter (low-precision masters:
    ``"param_snapshot"``) and a small one beside it: each undo_redo gives the bits of undo then update (the
    definition) -- parameters, moments, counts, parameter copies, the record (strategy, kept values) -- and the
    last undo those of the definition's; a redo that keeps the parameter again runs fused (one undo_redo_many,
    no undo nor step call: the redo's record keeps the undone record's old parameter, the undone one exactly),
    where its new gradient has an inf or a spike too on the backends that check it in the fused pass (finished
    as an update's checked step: a whole snapshot); the first step from init only where its inverse gives the
    zeros back exactly (no L2 decay). The caller's tensors are not written without donation."""
    gen = torch.Generator().manual_seed(c["seed"])
    n, p_dtype = c["n"], c["p_dtype"]
    params = {"w": torch.randn(n, generator=gen).to(p_dtype), "b": torch.randn(5, generator=gen).to(p_dtype)}
    kind = sofx.adamw if c["decoupled"] else sofx.adam
    opt = kind(bias_correction=c["bias_correction"], state_dtype=torch.float32, backend=backend)
    if c["first"]:
        state = opt.init(params)
    else:
        state = sofx.AdamState({k: torch.tensor(7) for k in params},
                               {k: 0.1 * torch.randn(x.shape, generator=gen) for k, x in params.items()},
                               {k: torch.randn(x.shape, generator=gen).square() + 4 for k, x in params.items()})

    def gradient(bad: str, clip: float) -> dict:  # (small beside the second moment: undone algebraically)
        g = {k: (0.01 * torch.randn(x.shape, generator=gen)).to(p_dtype) for k, x in params.items()}
        at = int(torch.randint(n, (1,), generator=gen))
        if bad == "inf":
            g["w"][at] = float("inf")
        elif bad == "spike":  # dominates the second moment however clipped
            g["w"][at] = min(1e4 / clip, 6e4)
        return g

    grads = [gradient("none", 1.0)]
    for same, bad, clip in zip(c["same"], c["bad"], c["clips"]):
        grads.append(grads[-1] if same else gradient(bad, clip))
    copies = [{k: torch.zeros(x.shape, dtype=torch.float32) for k, x in params.items()} if c["copies"] else None
              for _ in range(3)]
    before = clone_tree((params, state))
    zeros_exact = not c["first"] or c["decoupled"] or c["hp"].weight_decay == 0

    # undo_redo twice
    got = opt.update(*clone_tree((params,)), grads[0], clone_tree(state), c["hp"], donate=donate)
    assert got[2].strategies() == ["param_snapshot", "param_snapshot"]
    got_stages = []
    for i, clip in enumerate(c["clips"]):
        kept = got[2].strategies() == ["param_snapshot", "param_snapshot"]  # (the record this redo undoes)
        with _kernel_calls(backend) as calls:
            got = opt.undo_redo(*got, grads[i + 1], c["hp"], grad_scale=clip, donate=donate, param_copies=copies[i])
        got_stages.append((clone_tree(got[:2]), got[2]))  # (donated: the next call writes into them)
        if not zeros_exact:  # undone to exact zeros, then stepped
            assert calls["undo_redo_many"] == 0, calls
        elif kept and c["bad"][i] == "none":
            assert got[2].strategies() == ["param_snapshot", "param_snapshot"]
            assert calls == {"undo_redo_many": 1, "undo_many": 0, "step_many": 0}, calls
        elif kept and backend != "reference":
            assert calls["undo_redo_many"] == 1, calls  # (then its flagged chunks: undone, then stepped)
    got_end = opt.undo(*got, donate=donate, param_copies=copies[2])

    # the definition: undo, then update
    want = opt.update(*clone_tree((params,)), grads[0], clone_tree(state), c["hp"], donate=donate)
    want_copies = [{k: torch.zeros(x.shape, dtype=torch.float32) for k, x in params.items()} if c["copies"] else None
                   for _ in range(3)]
    for i, clip in enumerate(c["clips"]):
        undone = opt.undo(*want, donate=donate)
        want = opt.update(*undone[:1], grads[i + 1], undone[1], c["hp"], grad_scale=clip, donate=donate,
                          param_copies=want_copies[i])
        assert_trees_bitwise(_bits_tree(got_stages[i][0]), _bits_tree(want[:2]))
        _assert_records_bitwise(got_stages[i][1], want[2])
    want_end = opt.undo(*want, donate=donate, param_copies=want_copies[2])
    assert_trees_bitwise(_bits_tree(got_end), _bits_tree(want_end))
    assert_trees_bitwise(_bits_tree(copies), _bits_tree(want_copies))
    if not donate:
        assert_trees_bitwise(_bits_tree(before), _bits_tree((params, state)))


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("donate", [False, True])
@settings(max_examples=40, deadline=None)
@given(c=kept_parameter_redos())
def test_the_redo_of_a_leaf_keeping_its_parameter_is_fused_and_equals_undo_then_update(backend, donate, c):
    """check_kept_parameter_redone_fused over random hparams, sizes, clips, gradients. (The Triton backend:
    test_kernels_triton.py.)"""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    check_kept_parameter_redone_fused(backend, donate, c)


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("donated_update", [False, True])
@pytest.mark.parametrize("donate", [False, True])
def test_a_fused_redo_keeping_the_parameter_shares_it_only_where_the_used_record_owns_it(backend, donated_update,
                                                                                         donate):
    """The fused redo of a bfloat16 master's step keeps, as its record's old parameter, the one the undone
    record kept: that very tensor where that record owns it (a donated update copied it), a copy where it is
    the caller's own (an update without donation keeps the params passed in, which the caller may reuse once
    the record is used). The caller then reuses its tensors (those it did not donate); undoing the new record
    gives the state before the update: the parameter bit for bit, the moments to float32 rounding."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(31)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32, backend=backend)
    params = {"w": torch.randn(2 * 1024 + 9, generator=gen).to(torch.bfloat16)}
    state = sofx.AdamState({"w": torch.tensor(3)}, {"w": 0.1 * torch.randn(params["w"].shape, generator=gen)},
                           {"w": torch.randn(params["w"].shape, generator=gen).square() + 1})
    grads = {"w": (0.1 * torch.randn(params["w"].shape, generator=gen)).to(torch.bfloat16)}
    before = clone_tree((params, state))
    ins = clone_tree((params, state))
    p1, s1, rec = opt.update(ins[0], grads, ins[1], donate=donated_update)
    assert rec.strategies() == ["param_snapshot"] and (rec.leaves[0].p_old is ins[0]["w"]) != donated_update
    with _kernel_calls(backend) as calls:
        p2, s2, rec2 = opt.undo_redo(p1, s1, rec, grads, grad_scale=0.5, donate=donate)
    assert calls == {"undo_redo_many": 1, "undo_many": 0, "step_many": 0}, calls
    assert rec2.strategies() == ["param_snapshot"]
    assert (rec2.leaves[0].p_old is rec.leaves[0].p_old) == donated_update
    assert torch.equal(rec2.leaves[0].p_old, before[0]["w"])
    for t in sofx.tree.flatten(ins)[0] if not donated_update else []:  # the caller reuses its tensors
        if t.is_floating_point():
            t.fill_(float("nan"))
    p3, s3 = opt.undo(p2, s2, rec2, donate=donate)
    assert torch.equal(p3["w"], before[0]["w"]) and torch.equal(s3.count["w"], before[1].count["w"])
    torch.testing.assert_close((s3.mu, s3.nu), (before[1].mu, before[1].nu), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
def test_a_fused_redo_without_donation_takes_over_the_copy_of_the_redo_before_it(backend):
    """A chain of undo_redo's without donation of a bfloat16 master's step: the first fused redo copies the old
    parameter the update kept (the caller's own), the next ones keep that copy (the record they use owns it:
    nobody else holds it) instead of copying it again. A leaf the used record did not step ("n": no gradient in
    the update) is stepped from the caller's tensors, which its new record keeps: the next redo copies those.
    The caller then reuses every tensor it passed in; undoing the last record gives the state before the
    update: the parameters bit for bit, the moments to float32 rounding."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(32)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32, backend=backend)
    params = {k: torch.randn(n, generator=gen).to(torch.bfloat16) for k, n in (("w", 2 * 1024 + 9), ("n", 70))}
    state = sofx.AdamState({k: torch.tensor(3) for k in params},
                           {k: 0.1 * torch.randn(p.shape, generator=gen) for k, p in params.items()},
                           {k: torch.randn(p.shape, generator=gen).square() + 1 for k, p in params.items()})
    grads = {k: (0.1 * torch.randn(p.shape, generator=gen)).to(torch.bfloat16) for k, p in params.items()}
    before = clone_tree((params, state))
    inputs = [clone_tree((params, state))]
    stepped = opt.update(inputs[0][0], {**grads, "n": None}, inputs[0][1])
    records = [stepped[2]]
    assert records[0].strategies() == [None, "param_snapshot"]  # (leaves in key order: "n", "w")
    for scale in (0.5, 0.7, 0.6):
        inputs.append(stepped[:2])
        with _kernel_calls(backend) as calls:
            stepped = opt.undo_redo(*stepped, grads, grad_scale=scale)
        records.append(stepped[2])
        assert records[-1].strategies() == ["param_snapshot", "param_snapshot"]
        assert calls["undo_redo_many"] == 1, calls
    (n1, w1), (n2, w2), (n3, w3) = [[leaf.p_old for leaf in rec.leaves] for rec in records[1:]]
    assert w1 is not records[0].leaves[1].p_old and w2 is w1 and w3 is w1  # one copy, taken over
    assert n1 is inputs[1][0]["n"] and n2 is not n1 and n3 is n2
    assert torch.equal(w3, before[0]["w"]) and torch.equal(n3, before[0]["n"])
    for t in sofx.tree.flatten(inputs)[0]:  # the caller reuses what it passed in
        if t.is_floating_point():
            t.fill_(float("nan"))
    p4, s4 = opt.undo(*stepped)
    assert trees_equal((p4, s4.count), (before[0], before[1].count))
    torch.testing.assert_close((s4.mu, s4.nu), (before[1].mu, before[1].nu), rtol=1e-5, atol=1e-7)


def _storages(tree) -> set[int]:
    """The storages of ``tree``'s floating-point tensors (their addresses)."""
    return {t.untyped_storage().data_ptr() for t in sofx.tree.flatten(tree)[0] if t.is_floating_point()}


def _undone_chain(opt, hparams, stages, donations, upto: int, reuse: bool):
    """Run an update and ``upto`` undo_redo's of its record (``stages[i]``: the call's gradients and grad_scale,
    ``donations[i]``: whether it donates), then undo the last record (donated as its call was); return the
    undone params and state, the strategies of the records and how many tensors the caller wrote nan into. With
    ``reuse`` the caller writes nan into every tensor it may reuse as soon as it may: those it passed to a call
    without donation, once that call's record is used, but for those it still holds as the inputs or results of
    a later call (where it writes into none, the run is the one without ``reuse``)."""
    params, state, grads = stages[0]
    calls = [(clone_tree((params, state)), donations[0])]  # (inputs, donated) of each call
    stepped = opt.update(*calls[0][0][:1], grads, calls[0][0][1], hparams, donate=donations[0])
    strategies, reused = [stepped[2].strategies()], 0
    for i in range(1, upto + 1):
        calls.append((stepped[:2], donations[i]))
        _, grads, scale = stages[i]
        stepped = opt.undo_redo(*stepped, grads, hparams, grad_scale=scale, donate=donations[i])
        strategies.append(stepped[2].strategies())
        (used_inputs, donated), (inputs, _) = calls[-2], calls[-1]
        if reuse and not donated:  # its record is used: the caller may reuse what it passed in
            held = _storages((inputs, stepped[:2]))
            for t in sofx.tree.flatten(used_inputs)[0]:
                if t.is_floating_point() and t.untyped_storage().data_ptr() not in held:
                    t.fill_(float("nan"))
                    reused += 1
    return opt.undo(*stepped, donate=donations[upto]), strategies, reused


CHAIN_DONATIONS = ["nnnn", "dddd", "ndnd", "dndn", "nddn", "ddnn"]  # per call of the chain: donated or not


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
@pytest.mark.parametrize("donations", CHAIN_DONATIONS)
def test_a_chain_of_undo_redos_keeps_every_record_intact_while_the_caller_reuses_its_tensors(backend, donations):
    """check_records_intact_through_a_chain (the Triton backend: test_kernels_triton.py)."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    check_records_intact_through_a_chain(backend, donations)


def check_records_intact_through_a_chain(backend: str, donations: str) -> None:
    """An update, then undo_redo's of its record, each of the last's, with and without donation, over leaves
    of every kind of record: bfloat16 masters (their old parameter kept whole: fused redos that pass it on),
    one of them not stepped by the update ("n": the first undo_redo steps it from the caller's tensor, which
    its record keeps; the next redoes it fused, the last only undoes it), float32 ones whose decay factor
    1 - lr*wd is small (the old parameter kept whole too), a spike every step (a whole snapshot), a spike in
    one chunk (a chunk snapshot on the checking backends) and plain ones (algebraic). After each call the
    caller reuses every tensor it may (nan written into them, as a later in-place step would): the undo of
    each record in turn (a chain run up to it) gives the very bits it gives where the caller reuses nothing,
    and the state before the update to float32 rounding. No record refers to a tensor its caller may reuse.
    ``donations``: per call, "d" (donated) or "n"."""
    gen = torch.Generator().manual_seed(33)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32, backend=backend)
    shapes = {"a": (40,), "b": (3, 50), "c": (2 * 1024 + 7,), "k": (60,), "n": (70,), "s": (30,)}
    low = ("b", "n")
    params = {k: torch.randn(s, generator=gen).to(torch.bfloat16 if k in low else torch.float32)
              for k, s in shapes.items()}
    state = sofx.AdamState({k: torch.tensor(5) for k in params},
                           {k: 0.1 * torch.randn(s, generator=gen) for k, s in shapes.items()},
                           {k: torch.randn(s, generator=gen).square() + 1 for k, s in shapes.items()})
    hparams = {k: sofx.AdamHParams(lr=0.9, weight_decay=0.9) if k == "k" else None for k in params}

    def gradient(seen: set[str]) -> dict:
        g = {k: 0.1 * torch.randn(s, generator=gen) for k, s in shapes.items()}
        g["s"] = 1e4 * g["s"]
        g["c"][1024 + 3] = 1e4
        g = {k: x.to(params[k].dtype) for k, x in g.items()}
        return {k: (x if k in seen else None) for k, x in g.items()}

    every = set(shapes)
    first, second = gradient(every - {"n"}), gradient(every)
    # "n": stepped first by the undo_redo's (from the caller's tensors), then redone, then only undone
    stages = [(params, state, first), (None, second, 0.5), (None, second, 0.3), (None, gradient(every - {"n"}), 0.8)]
    donations = [d == "d" for d in donations]
    grads = clone_tree([g for _, _, g in stages[:1]] + [g for _, g, _ in stages[1:]])
    for upto in range(len(stages)):
        got, strategies, reused = _undone_chain(opt, hparams, stages, donations, upto, reuse=True)
        if reused:  # (else the same calls as the run without reuse: not run twice, ~1/5 of the Triton interpreter's)
            want, _, _ = _undone_chain(opt, hparams, stages, donations, upto, reuse=False)
            assert_trees_bitwise(_bits_tree(got), _bits_tree(want))
        kinds = {s for rec in strategies for s in rec}
        assert {"param_snapshot", "snapshot", "algebraic", None} <= kinds, strategies
        assert backend == "reference" or "chunk_snapshot" in kinds, strategies
        torch.testing.assert_close(got, (params, state), rtol=1e-5, atol=1e-6)
    assert trees_equal(grads, [g for _, _, g in stages[:1]] + [g for _, g, _ in stages[1:]])  # none written


# ------------------------------------------------------------------ the lossiness test of a first step's fused redo
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-fp32"])
@pytest.mark.parametrize("donate", [False, True])
def test_the_fused_redo_of_a_first_step_takes_no_lossiness_pass(p_dtype, donate, monkeypatch):
    """The undo_redo of a leaf's first step from init that the reference backend (no check in its kernel) runs
    fused (float32 moments, no L2 decay: its undo gives the zeros back exactly) tests its redo for lossiness no
    more than undo then update does (a step from zero moments is not tested): no any_lossy pass where the new
    gradient was read at its grad_scale, or is the undone step's own at a grad_scale no larger (a late clip,
    a loss scale grown); the same gradient at a larger grad_scale is still tested (it may be beyond the gradient
    limit now, unread). The results and the record are undo then update's."""
    gen = torch.Generator().manual_seed(41)
    params = {"w": torch.randn(3000, generator=gen).to(p_dtype), "b": torch.randn(5, generator=gen).to(p_dtype)}
    grads = {k: torch.randn(x.shape, generator=gen).to(p_dtype) for k, x in params.items()}
    new = {k: (1e3 * torch.randn(x.shape, generator=gen)).to(p_dtype) for k, x in params.items()}
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32, backend="reference")
    passes = []
    module = importlib.import_module("sofx.adam")  # (sofx.adam is the function)
    real = module.any_lossy
    monkeypatch.setattr(module, "any_lossy", lambda *a, **k: passes.append(a[0].shape) or real(*a, **k))

    def first():
        return opt.update(clone_tree(params), grads, opt.init(params), grad_scale=0.5, donate=donate)

    for redo, scale, tested in ((new, 1e-3, False), (grads, 0.5, False), (grads, 1e-4, False), (grads, 2.0, True)):
        stepped = first()
        passes.clear()
        with _kernel_calls("reference") as calls:
            got = opt.undo_redo(*stepped, redo, grad_scale=scale, donate=donate)
        assert calls == {"undo_redo_many": 1, "undo_many": 0, "step_many": 0}, calls
        assert len(passes) == (2 if tested else 0), (scale, passes)
        got_results = clone_tree(got[:2])
        undone = opt.undo(*first(), donate=donate)
        want = opt.update(*undone[:1], redo, undone[1], grad_scale=scale, donate=donate)
        assert_trees_bitwise(_bits_tree(got_results), _bits_tree(want[:2]))
        _assert_records_bitwise(got[2], want[2])
        assert all(leaf.moments_were_zero for leaf in got[2].leaves)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@settings(max_examples=60, deadline=None)
@given(c=first_steps(), p_dtype=st.sampled_from([torch.float32, torch.bfloat16]), top=st.floats(-30.0, 0.0))
def test_the_lossiness_test_finds_nothing_in_the_fused_redo_of_a_first_step(backend, c, p_dtype, top):
    """What the pass that undo_redo leaves out (above) would find in the fused redo of a first step from init
    (float32 moments, no L2 decay): nothing, for any new gradient whose scaled magnitude is within the gradient
    limit (largest 10^top of it: as a gradient read at its grad_scale is) and for the undone step's own at a
    grad_scale no larger: the undone moments are exact zeros (the step's own rounding subtracted), where every
    element with a finite effective gradient's square passes (lossy_elements' redo form)."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    from sofx.kernels.base import GRADIENT_LIMIT, any_lossy

    kernels = sofx.kernels.load_backend(backend)
    gen = torch.Generator().manual_seed(c["seed"])
    n = c["n"]
    p = torch.randn(n, generator=gen).to(p_dtype)
    g_old = torch.randn(n, generator=gen).to(p_dtype)
    variant = AdamVariant(decoupled=c["decoupled"], bias_correction=c["bias_correction"])
    hp = c["hp"]
    s_old = AdamScalars(hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, 1, c["grad_scale"])
    zeros = torch.zeros(n)
    p1, m1, v1 = kernels.step(p, g_old, zeros, zeros.clone(), s_old, variant)
    p_before = p if p_dtype != torch.float32 else p1  # (the undone record keeps it, or the stepped one)
    g_new = torch.randn(n, generator=gen, dtype=torch.float64)
    g_new = (g_new / g_new.abs().max() * GRADIENT_LIMIT * 10 ** top / c["clip"]).to(p_dtype)
    s_new = s_old._replace(grad_scale=c["clip"])
    assert not bool(any_lossy(p_before, g_new, v1, s_new, c["decoupled"], g_old, s_old, m=m1))
    s_same = s_old._replace(grad_scale=c["grad_scale"] * min(c["clip"], 1.0))
    assert not bool(any_lossy(p_before, g_old, v1, s_same, c["decoupled"], g_old, s_old, m=m1))


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
@settings(max_examples=30, deadline=None)
@given(n=st.sampled_from([1, 1023, 1024, 1025, 2049]), old_scale=st.sampled_from([1.0, 0.0, 1e-20]),
       new_scale=st.sampled_from([1e20, 1e30, 3e38]), decoupled=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_redo_with_the_undone_gradient_at_a_larger_grad_scale_is_checked_again(backend, n, old_scale, new_scale,
                                                                                decoupled, seed):
    """undo_redo given the undone step's own gradient tensor (a late clip, a loss scale changed) takes it for
    finite, as the undone record's strategy says; that holds at that step's grad_scale, not at a larger one:
    ``g * grad_scale`` beyond GRADIENT_LIMIT overflows the second moment. undo='algebraic' must record such a redo
    as not undoable ("none"), as update does with the same inputs, not as "algebraic" (whose undo wrote nan into
    v)."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(seed)
    opt = (sofx.adamw if decoupled else sofx.adam)(weight_decay=0.01, undo="algebraic", backend=backend)
    params = {"w": torch.randn(n, generator=gen)}
    grads = {"w": torch.randn(n, generator=gen)}
    grads["w"][n // 2] = 1.5  # (|g * new_scale| beyond GRADIENT_LIMIT there)
    state = sofx.AdamState({"w": torch.tensor(3)}, {"w": torch.randn(n, generator=gen) * 0.1},
                           {"w": torch.rand(n, generator=gen) + 0.5})
    p1, s1, rec = opt.update(params, grads, state, grad_scale=old_scale)
    assert rec.strategies() == ["algebraic"]
    direct = opt.update(params, grads, state, grad_scale=new_scale)
    assert direct[2].strategies() == ["none"]
    p2, s2, rec2 = opt.undo_redo(p1, s1, rec, grads, grad_scale=new_scale)
    assert rec2.strategies() == ["none"]
    assert torch.equal(s2.count["w"], direct[1].count["w"])
    for got, want in zip((p2["w"], s2.mu["w"], s2.nu["w"]), (direct[0]["w"], direct[1].mu["w"], direct[1].nu["w"])):
        # (from the algebraically undone state: within float32 rounding; inf and nan where the gradient overflowed)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)) and torch.equal(got[~finite].isnan(), want[~finite].isnan())
        assert torch.equal(got[want.isinf()], want[want.isinf()])
        assert _norm_rel(got[finite], want[finite]) <= 1e-6
    with pytest.raises(sofx.UndoError, match=r"params\['w'\]: this step cannot be undone"):
        opt.undo(p2, s2, rec2)


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
@pytest.mark.parametrize("big", [float("inf"), -float("inf"), float("nan"), 1e25])
@pytest.mark.parametrize("n", [7, 1024, 2049])
def test_forced_algebraic_l2_step_of_a_parameter_beyond_the_gradient_limit_is_not_undoable(backend, big, n):
    """L2 decay takes ``gh = g + wd * p``: a parameter that is not finite, or whose ``wd * p`` is beyond
    GRADIENT_LIMIT, makes the step's moments inf or nan, where the algebraic inverse gives nan (inf - inf) in
    m and v that were finite. undo='algebraic' records such a step as not undoable ("none"), as it records a
    step of such a gradient, instead of an undo that wrote nan; a decay of 0, or decoupled decay (``gh = g``),
    is still undone."""
    if backend != "reference" and not cpu.native_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(n)
    params = {"w": torch.randn(n, generator=gen), "ok": torch.randn(5, generator=gen)}
    params["w"][n // 2] = big
    grads = {k: torch.randn(x.shape, generator=gen) for k, x in params.items()}
    state = sofx.AdamState({k: torch.tensor(3) for k in params},
                           {k: 0.1 * torch.randn(x.shape, generator=gen) for k, x in params.items()},
                           {k: torch.rand(x.shape, generator=gen) + 0.5 for k, x in params.items()})
    opt = sofx.adam(weight_decay=0.1, undo="algebraic", backend=backend)
    p1, s1, rec = opt.update(params, grads, state)
    assert rec.strategies() == ["algebraic", "none"]  # (leaves in key order: "ok", "w")
    with pytest.raises(sofx.UndoError, match=r"params\['w'\]: this step cannot be undone \(.*parameter"):
        opt.undo(p1, s1, rec)
    assert not rec.used
    for opt in (sofx.adam(weight_decay=0.0, undo="algebraic", backend=backend),
                sofx.adamw(weight_decay=0.1, undo="algebraic", backend=backend)):
        p1, s1, rec = opt.update(params, grads, state)
        assert rec.strategies() == ["algebraic", "algebraic"]
        p0, s0 = opt.undo(p1, s1, rec)
        for t in (s0.mu["w"], s0.nu["w"]):
            assert not torch.isnan(t).any()


def test_forced_algebraic_l2_plan_is_shared_by_leaves_where_the_decay_is_zero(monkeypatch):
    """The per-parameter check of undo='algebraic' with L2 decay (``weight_decay * p``) reads nothing where the
    decay is 0: leaves with the same hparams share one plan there (one strategy choice per call, not one per leaf:
    ~10 us a leaf), as with decoupled decay; the step is still torch.optim.Adam's."""
    adam_module = importlib.import_module("sofx.adam")
    gen = torch.Generator().manual_seed(5)
    params = {f"p{i}": torch.randn(13, generator=gen) for i in range(6)}
    grads = {k: torch.randn(13, generator=gen) for k in params}
    calls = []
    choose = adam_module.Adam._choose_strategy
    monkeypatch.setattr(adam_module.Adam, "_choose_strategy",
                        lambda self, *a, **k: calls.append(1) or choose(self, *a, **k))
    for opt, shared in ((sofx.adam(lr=1e-2, undo="algebraic"), True),
                        (sofx.adam(lr=1e-2, weight_decay=0.1, undo="algebraic"), False)):
        calls.clear()
        p1, s1, rec = opt.update(params, grads, opt.init(params), grads_finite=True)
        assert len(calls) == (1 if shared else len(params))
        assert rec.strategies() == ["algebraic"] * len(params)
        tp = [torch.nn.Parameter(params[k].clone()) for k in sorted(params)]
        topt = torch.optim.Adam(tp, lr=1e-2, weight_decay=opt.defaults.weight_decay)
        for t, k in zip(tp, sorted(params)):
            t.grad = grads[k].clone()
        topt.step()
        for t, k in zip(tp, sorted(params)):
            torch.testing.assert_close(p1[k], t.detach(), rtol=1e-6, atol=1e-7)


def test_undo_chooses_each_kind_of_leaf_s_kernel_once(rng, monkeypatch):
    """undo picks the kernel of each kind of leaf (device, dtypes) once, as update does, not once a leaf (a
    select_backend each: ~2 us a leaf); the results are a tree of that leaf alone's. A backend that cannot run
    a leaf is still refused naming the first such leaf, before anything is restored."""
    adam_module = importlib.import_module("sofx.adam")
    params = {"a": torch.randn(5, generator=rng), "b": torch.randn(6, generator=rng, dtype=torch.float64),
              "c": torch.randn(7, generator=rng), "d": torch.randn(3, generator=rng, dtype=torch.float64)}
    grads = {k: torch.randn(v.shape, generator=rng, dtype=v.dtype) for k, v in params.items()}
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(params)
    p1, s1, rec = opt.update(params, grads, state)
    chosen = []
    real = adam_module.select_backend
    monkeypatch.setattr(adam_module, "select_backend", lambda *a: chosen.append(a[2]) or real(*a))
    p0, s0 = sofx.adamw(lr=1e-2, weight_decay=0.1).undo(p1, s1, rec)
    assert sorted(chosen, key=str) == [torch.float32, torch.float64]
    for k in params:
        one = lambda t: {k: t[k]}  # noqa: E731
        q1, t1, r1 = opt.update(one(params), one(grads), sofx.AdamState(*(one(x) for x in state)))
        q0, t0 = opt.undo(q1, t1, r1)
        for got, want in ((p0, q0), (s0.mu, t0.mu), (s0.nu, t0.nu), (s0.count, t0.count)):
            assert torch.equal(got[k], want[k]), k
    p1, s1, rec = opt.update(params, grads, state)
    before = clone_tree((p1, s1))
    with pytest.raises(sofx.UnsupportedError, match=r"^params\['b'\]: backend 'cpu' does not support"):
        sofx.adamw(lr=1e-2, weight_decay=0.1, backend="cpu").undo(p1, s1, rec, donate=True)
    assert trees_equal((p1, s1), before) and not rec.used


@settings(max_examples=25, deadline=None)
@given(order=st.permutations(["z", "a", "m"]), redo=st.booleans(), as_dict=st.booleans(), seed=st.integers(0, 99))
def test_undo_matches_params_to_the_record_key_by_key_as_update_matches_grads(order, redo, as_dict, seed):
    """update matches grads and state to params key by key (a dict over an OrderedDict, in any key order); undo and
    undo_redo refused params that differed from the record's only so (a dict where the record's were an
    OrderedDict, one in another key order), though they hold the same leaves. They are matched key by key too:
    each leaf's undo is that of its own key, bit for bit the undo of the params as stepped, and the result has the
    structure of the params given (as update's); the new record of undo_redo undoes them in turn."""
    from collections import OrderedDict

    gen = torch.Generator().manual_seed(seed)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1)
    params = OrderedDict((k, torch.randn(3 + i, generator=gen)) for i, k in enumerate(("z", "a", "m")))
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    again = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    stepped, state, rec = opt.update(params, grads, opt.init(params))
    _, _, rec2 = opt.update(params, grads, opt.init(params))  # (the same step: a record can be used once)
    given_params = (dict if as_dict else OrderedDict)((k, stepped[k]) for k in order)
    if redo:
        want_p, want_s, _ = opt.undo_redo(stepped, state, rec, again)
        got_p, got_s, new_rec = opt.undo_redo(given_params, state, rec2, again)
    else:
        want_p, want_s = opt.undo(stepped, state, rec)
        got_p, got_s = opt.undo(given_params, state, rec2)
    assert type(got_p) is type(given_params) and list(got_p) == list(given_params)
    for k in params:
        for got, want in ((got_p[k], want_p[k]), (got_s.mu[k], want_s.mu[k]), (got_s.nu[k], want_s.nu[k]),
                          (got_s.count[k], want_s.count[k])):
            assert torch.equal(got, want), k
    assert rec2.used  # (the record given is used, as the undo of the params as stepped uses it)
    if redo:
        back_p, _ = opt.undo(got_p, got_s, new_rec)
        assert all(max_rel_err(back_p[k], params[k]) <= 1e-6 for k in params)


# ------------------------------------------------------------------ a record's tensors changed in place since the step
def _warm_model_step(seed: int, undo: str = "auto", donate: bool = False):
    """A model stepped a few times (warm moments: the inverse of the moments reads the gradient), then one more
    step from its ``.grad`` (``torch.optim``'s way: the record refers to the model's gradients themselves), with
    its params, state and record."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = sofx.adamw(lr=1e-2, betas=(0.9, 0.9), weight_decay=0.1, undo=undo)  # (v follows the gradients: algebraic)
    params = {k: p.detach() for k, p in model.named_parameters()}
    state = opt.init(params)
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        params, state, _ = opt.update(params, {k: p.grad.clone() for k, p in model.named_parameters()}, state,
                                      undoable=False)
        model.zero_grad(set_to_none=True)
    model(torch.randn(2, 4)).sum().backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    new_p, new_s, rec = opt.update(*clone_tree((params,)), grads, clone_tree(state), donate=donate)
    return model, opt, (params, state), (new_p, new_s), rec, grads


_REUSES = {
    "p.grad.zero_()": lambda model: [p.grad.zero_() for p in model.parameters()],
    "zero_grad(set_to_none=False)": lambda model: model.zero_grad(set_to_none=False),  # (as torch.optim's)
    "the next backward": lambda model: model(torch.randn(2, 4)).sum().backward(),
    "clip_grad_norm_": lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3),
}


@pytest.mark.parametrize("reuse", list(_REUSES), ids=list(_REUSES))
@pytest.mark.parametrize("use", ["undo", "undo_redo"])
@pytest.mark.parametrize("donate", [False, True])
def test_an_undo_whose_gradient_was_changed_in_place_since_the_step_is_refused(reuse, use, donate):
    """An algebraic record keeps a reference to the gradient the step took, not a copy. torch's habits write into
    it after the step (a ``p.grad.zero_()``, an optimizer's ``zero_grad(set_to_none=False)``, the next backward
    accumulating into it, a late ``clip_grad_norm_`` in place): the undo then inverted the step with those values
    (zeros, the next gradient, the clipped one), giving the wrong moments without a word. Refused, an UndoError
    naming the leaf and the gradient, before anything is written."""
    model, opt, _, (new_p, new_s), rec, grads = _warm_model_step(3, donate=donate)
    assert rec.strategies() == ["algebraic", "algebraic"]
    _REUSES[reuse](model)
    before = clone_tree((new_p, new_s))
    with pytest.raises(sofx.UndoError, match=r"^params\['bias'\]: the gradient the step took was changed in "
                                             r"place since the step \(its version"):
        if use == "undo":
            opt.undo(new_p, new_s, rec, donate=donate)
        else:
            opt.undo_redo(new_p, new_s, rec, grads, grad_scale=0.5, donate=donate)
    assert trees_equal((new_p, new_s), before) and not rec.used


@pytest.mark.parametrize("use", ["undo", "undo_redo"])
def test_an_undo_whose_untouched_gradient_and_a_fresh_one_are_taken(use):
    """The check refuses only a gradient written in place: an undo with the model's gradients untouched (or set
    to None and made anew by the next backward, the record keeping the old tensor) restores the state."""
    model, opt, (params, state), (new_p, new_s), rec, grads = _warm_model_step(4)
    model.zero_grad(set_to_none=True)
    model(torch.randn(2, 4)).sum().backward()
    assert rec.strategies() == ["algebraic", "algebraic"]
    if use == "undo":
        got, want = opt.undo(new_p, new_s, rec), (params, state)
    else:
        got, want = opt.undo_redo(new_p, new_s, rec, grads)[:2], (new_p, new_s)  # (the same step again)
    for a, b in zip(sofx.tree.flatten(got)[0], sofx.tree.flatten(want)[0]):
        assert torch.equal(a, b) if a.dtype == torch.int64 else max_rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("use", ["undo", "undo_redo"])
def test_an_undo_whose_kept_parameter_of_the_caller_was_written_since_is_refused(use):
    """A snapshot record of an update without donation keeps the caller's own params and moments (not copies; the
    caller keeps them unchanged while the record may be undone). A caller that copies the new values into its
    model's parameters under ``torch.no_grad()`` (as ``torch.optim`` leaves them) writes the record's old
    parameter: its undo 'restored' the new values without a word. Refused, naming the leaf and the tensor."""
    _, opt, _, (new_p, new_s), rec, _ = _warm_model_step(5, undo="exact")
    assert rec.strategies() == ["snapshot", "snapshot"] and not rec.leaves[0].owns_kept
    old_p = rec.leaves[1].p_old  # (params['weight'])
    with torch.no_grad():
        old_p.copy_(new_p["weight"])
    before = clone_tree((new_p, new_s))
    with pytest.raises(sofx.UndoError, match=r"^params\['weight'\]: the old parameter the record keeps was changed "
                                             r"in place since the step \(its version"):
        if use == "undo":
            opt.undo(new_p, new_s, rec)
        else:
            opt.undo_redo(new_p, new_s, rec, {k: torch.ones_like(p) for k, p in new_p.items()})
    assert trees_equal((new_p, new_s), before) and not rec.used


@pytest.mark.parametrize("reuse", list(_REUSES), ids=list(_REUSES))
@pytest.mark.parametrize("use", ["undo", "undo_redo"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_snapshot_undo_is_taken_after_its_gradient_was_written_in_place(reuse, use, donate):
    """A ``"snapshot"`` record restores the kept params and moments bit for bit and never reads the gradient its
    step took (an undo_redo steps from the kept values with the new one): a ``p.grad.zero_()`` or the next backward
    since the step changes nothing of its undo, which the version check refused as 'the gradient the step took was
    changed in place'. Taken: the state before the step, bit for bit."""
    model, opt, (params, state), (new_p, new_s), rec, _ = _warm_model_step(6, undo="exact", donate=donate)
    assert rec.strategies() == ["snapshot", "snapshot"]
    _REUSES[reuse](model)
    if use == "undo":
        got = opt.undo(new_p, new_s, rec, donate=donate)
        assert trees_equal(got, (params, state))
    else:
        fresh = {k: torch.full_like(p, 0.25) for k, p in new_p.items()}
        got = opt.undo_redo(new_p, new_s, rec, fresh, donate=donate)[:2]
        want = opt.update(params, fresh, state)[:2]
        assert trees_equal(got, want)
