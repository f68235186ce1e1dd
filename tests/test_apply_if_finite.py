"""``sofx.apply_if_finite``: optax's combinator over a sofx optimizer.

A step whose gradients hold an inf or a nan is skipped (params and inner state bitwise as they were), the
counters ``notfinite_count`` / ``last_finite`` / ``total_notfinite`` follow optax, and after
``max_consecutive_errors`` skips in a row the next step is applied anyway. Finite steps are the inner
optimizer's, bit for bit; undo inverts either kind of step. Under ``vmap`` the decision is per member.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import vmap

import sofx
from sofx import transforms
from sofx.errors import HParamError, LeafError, SofxError, UndoError, UnsupportedError
from sofx.apply_if_finite import ApplyIfFiniteState

from helpers import script_prints_ok

NAN, INF = math.nan, math.inf


def _params(gen: torch.Generator, batch: tuple[int, ...] = ()) -> dict:
    return {"w": torch.randn(*batch, 4, 3, generator=gen), "b": torch.randn(*batch, 3, generator=gen),
            "deep": [torch.randn(*batch, 5, generator=gen)]}


def _grads(gen: torch.Generator, bad: float | None = None, batch: tuple[int, ...] = ()) -> dict:
    """Random gradients; ``bad``: one element of ``b`` set to it (nan, inf, -inf)."""
    g = _params(gen, batch)
    if bad is not None:
        g["b"].view(-1)[1] = bad
    return g


def _leaves(tree):
    return sofx.tree.flatten(tree)[0]


def _bitwise(a, b) -> bool:
    """Same structure and the same bits, nan included."""
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and x.shape == y.shape and
                                      torch.equal(x.view(-1).view(torch.int8) if x.is_floating_point() else x,
                                                  y.view(-1).view(torch.int8) if y.is_floating_point() else y)
                                      for x, y in zip(la, lb))


def _counters(state: ApplyIfFiniteState) -> tuple[int, bool, int]:
    return int(state.notfinite_count), bool(state.last_finite), int(state.total_notfinite)


def test_finite_steps_equal_the_inner_optimizer_bitwise(rng):
    params = _params(rng)
    inner = sofx.adamw(lr=1e-2, weight_decay=0.1)
    opt = sofx.apply_if_finite(inner, 3)
    p, s = params, opt.init(params)
    q, t = params, inner.init(params)
    for _ in range(4):
        g = _grads(rng)
        p, s, rec = opt.update(p, g, s, sofx.AdamHParams(lr=3e-2))
        q, t, _ = inner.update(q, g, t, sofx.AdamHParams(lr=3e-2))
        assert bool(rec.applied) is True
        assert _bitwise(p, q) and _bitwise(s.inner_state, t)
        assert _counters(s) == (0, True, 0)


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_nonfinite_gradient_leaves_params_and_inner_state_bitwise_unchanged(rng, bad):
    opt = sofx.apply_if_finite(sofx.adam(lr=1e-2), 2)
    params = _params(rng)
    p1, s1, _ = opt.update(params, _grads(rng), opt.init(params))
    kept_p, kept_s = sofx.tree.tree_map(torch.clone, p1), sofx.tree.tree_map(torch.clone, s1.inner_state)

    p2, s2, rec = opt.update(p1, _grads(rng, bad), s1)
    assert bool(rec.applied) is False
    assert _bitwise(p2, kept_p) and _bitwise(s2.inner_state, kept_s)
    assert _bitwise(p1, kept_p) and _bitwise(s1.inner_state, kept_s), "the inputs are not modified"
    assert _counters(s2) == (1, False, 1)

    p3, s3, rec = opt.update(p2, _grads(rng), s2)  # a finite step: the consecutive count starts again
    assert bool(rec.applied) is True and _counters(s3) == (0, True, 1)
    assert all(int(c) == 2 for c in _leaves(s3.inner_state.count))


def test_a_none_gradient_leaf_is_not_looked_at(rng):
    opt = sofx.apply_if_finite(sofx.adam(), 0)
    params = _params(rng)
    g = _grads(rng)
    g["b"] = None
    p, s, rec = opt.update(params, g, opt.init(params))
    assert bool(rec.applied) is True and _counters(s) == (0, True, 0)
    assert int(s.inner_state.count["b"]) == 0 and int(s.inner_state.count["w"]) == 1


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_after_max_consecutive_errors_skips_the_next_nonfinite_step_is_applied(rng, limit):
    """optax: applied iff finite or the new consecutive count exceeds the limit; the count is not reset by
    an applied non-finite step."""
    opt = sofx.apply_if_finite(sofx.adam(lr=1e-2), limit)
    params = _params(rng)
    p, s = params, opt.init(params)
    for k in range(1, limit + 3):
        p, s, rec = opt.update(p, _grads(rng, NAN), s)
        assert _counters(s) == (k, False, k)
        assert bool(rec.applied) is (k > limit)
        assert int(s.inner_state.count["w"]) == max(0, k - limit)
    assert torch.isnan(p["b"]).any(), "an applied non-finite step is the inner step (nan in, nan out)"
    assert torch.isfinite(p["w"]).all()


@pytest.mark.parametrize("word", [True, np.True_, torch.tensor(True)])
def test_grads_finite_true_is_the_callers_word(rng, word):
    """A numpy True or a 0-d True tensor (which the inner update takes as the caller's word) read the gradients
    anyway and skipped the step; ``donate=np.True_`` was refused where the inner update takes it."""
    opt = sofx.apply_if_finite(sofx.adam(), 5)
    params = _params(rng)
    _, s, rec = opt.update(params, _grads(rng, NAN), opt.init(params), grads_finite=word, donate=np.False_)
    assert bool(rec.applied) is True and _counters(s) == (0, True, 0)


def test_a_skipped_step_writes_the_unchanged_params_into_the_copies(rng):
    opt = sofx.apply_if_finite(sofx.adam(), 5)
    params = _params(rng)
    copies = sofx.tree.tree_map(lambda p: torch.zeros_like(p, dtype=torch.bfloat16), params)
    p, _, rec = opt.update(params, _grads(rng, INF), opt.init(params), param_copies=copies)
    assert bool(rec.applied) is False
    for c, q in zip(_leaves(copies), _leaves(p)):
        assert torch.equal(c, q.to(torch.bfloat16))


# ------------------------------------------------------------------ undo
def test_undo_of_a_skipped_step_changes_nothing_but_the_counters(rng):
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 4)
    params = _params(rng)
    p1, s1, _ = opt.update(params, _grads(rng), opt.init(params))
    p2, s2, _ = opt.update(p1, _grads(rng, NAN), s1)
    p3, s3, rec = opt.update(p2, _grads(rng, INF), s2)
    assert _counters(s3) == (2, False, 2)
    back_p, back_s = opt.undo(p3, s3, rec)
    assert _bitwise(back_p, p2) and _bitwise(back_s.inner_state, s2.inner_state)
    assert _counters(back_s) == (1, False, 1)
    with pytest.raises(UndoError, match="already used"):
        opt.undo(p3, s3, rec)


def test_undo_after_a_finite_step_is_the_inner_undo(rng):
    inner = sofx.adamw(lr=1e-2, weight_decay=0.1)
    opt = sofx.apply_if_finite(inner, 1)
    params = _params(rng)
    p1, s1, _ = opt.update(params, _grads(rng), opt.init(params))
    p2, s2, _ = opt.update(p1, _grads(rng, NAN), s1)  # skipped: the count is 1 before the finite step
    g = _grads(rng)
    p3, s3, rec = opt.update(p2, g, s2)
    q3, t3, inner_rec = inner.update(p2, g, s2.inner_state)
    back_p, back_s = opt.undo(p3, s3, rec)
    want_p, want_s = inner.undo(q3, t3, inner_rec)
    assert _bitwise(back_p, want_p) and _bitwise(back_s.inner_state, want_s)
    assert _counters(back_s) == (1, False, 1)
    for a, b in zip(_leaves(back_p), _leaves(p2)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(int(c) == 1 for c in _leaves(back_s.inner_state.count))


def test_undo_refuses_a_record_of_a_step_the_state_did_not_come_from(rng):
    """A record whose step did not leave these counters (a skipped step's record given the state of a later step:
    its inner record has no leaf whose count could tell) is refused, changing nothing, the record still usable."""
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 3)
    params = _params(rng)
    p1, s1, skipped = opt.update(params, _grads(rng, NAN), opt.init(params))
    p2, s2, applied = opt.update(p1, _grads(rng), s1)
    p3, s3, _ = opt.update(p2, _grads(rng, INF), s2)
    for p, s, rec in ((p2, s2, skipped), (p3, s3, skipped), (p3, s3, applied)):
        with pytest.raises(UndoError, match="counters"):
            opt.undo(p, s, rec)
    with pytest.raises(UndoError, match=r"the record's counters \(notfinite_count=None"):  # (a record made by hand)
        opt.undo(p2, s2, applied._replace(notfinite_count=None))
    back_p, back_s = opt.undo(p1, s1, skipped)  # (unused by the refusals)
    assert _bitwise(back_p, params) and _counters(back_s) == (0, True, 0)


def test_a_second_undo_of_a_record_is_refused_as_used_from_the_state_the_first_gave(rng):
    """A record undone a second time, with the state its first undo gave back (the counters before its step), was
    refused as 'not those the record's step left: the record does not belong to this state', where the inner
    optimizer and an undo given the stepped state again say what is wrong: the record was already used."""
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 2)
    params = _params(rng)
    for bad in (None, NAN):  # an applied step, a skipped one
        p1, s1, rec = opt.update(params, _grads(rng, bad), opt.init(params))
        back_p, back_s = opt.undo(p1, s1, rec)
        for p, s in ((p1, s1), (back_p, back_s)):
            with pytest.raises(UndoError, match="already used"):
                opt.undo(p, s, rec)


def test_undo_takes_the_record_of_numpy_integer_counters(rng):
    """Counters given as numpy integers (which update takes, as every count) are recorded as given: the undo's
    record check took only Python ints as the counts of a step, refusing the record of a step it just took."""
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 2)
    params = _params(rng)
    state = opt.init(params)._replace(notfinite_count=np.int64(1), total_notfinite=np.int32(4))
    p1, s1, rec = opt.update(params, _grads(rng, NAN), state)
    back_p, back_s = opt.undo(p1, s1, rec)
    assert _bitwise(back_p, params) and back_s[:3] == (1, state.last_finite, 4)


@pytest.mark.parametrize("call", ["update", "undo"])
def test_meta_counters_beside_params_with_data_are_refused_naming_the_counter(rng, call):
    """Counters that are meta tensors (a state made by init under ``with torch.device("meta")``) beside params with
    data went the way of counters whose value cannot be read, into ``torch.where`` with the params: torch's bare
    "RuntimeError: Tensor on device cpu is not on the expected device meta!". Refused naming the counter, changing
    nothing (meta params still take meta counters)."""
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 2)
    params = _params(rng)
    p1, s1, rec = opt.update(params, _grads(rng), opt.init(params))
    bad = s1._replace(notfinite_count=s1.notfinite_count.to("meta"))
    with pytest.raises(SofxError, match=r"state\.notfinite_count .*meta"):
        if call == "update":
            opt.update(p1, _grads(rng), bad, donate=True)
        else:
            opt.undo(p1, bad, rec)
    assert not rec.inner.used
    meta = {"w": torch.empty(3, device="meta")}
    state = opt.init(meta)
    meta_state = state._replace(notfinite_count=state.notfinite_count.to("meta"))
    opt.update(meta, {"w": torch.empty(3, device="meta")}, meta_state)


def test_the_counters_saturate_at_int64s_largest_as_optaxs_safe_increment(rng):
    """A non-finite step from a counter at int64's largest value raised Python's bare "ValueError: Overflow when
    unpacking long long" (under vmap the counter wrapped to -2^63 without a word). The counters saturate there, as
    optax's ``safe_increment``; a Python counter no int64 holds (which the state stores) is refused naming it."""
    top = torch.iinfo(torch.int64).max
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 2)
    params = _params(rng)
    full = opt.init(params)._replace(notfinite_count=torch.tensor(top), total_notfinite=torch.tensor(top))
    p1, s1, rec = opt.update(params, _grads(rng, NAN), full)
    assert _counters(s1) == (top, False, top) and bool(rec.applied)  # (top > max_consecutive_errors: applied)
    back_p, back_s = opt.undo(p1, s1, rec)
    assert _counters(back_s) == (top, True, top)
    batched = vmap(lambda g: opt.update(params, g, full)[1][:3])(_grads(rng, NAN, batch=(2,)))
    assert [c.tolist() for c in batched] == [[top, 0], [False, True], [top, top]]  # (member 0's gradient: a nan)
    with pytest.raises(SofxError, match=r"state\.total_notfinite = 1180591620717411303424 is beyond int64's"):
        opt.update(params, _grads(rng), full._replace(total_notfinite=2 ** 70))


def test_undo_refuses_a_record_of_another_kind(rng):
    inner = sofx.adam()
    opt = sofx.apply_if_finite(inner, 1)
    params = _params(rng)
    p, s, _ = opt.update(params, _grads(rng), opt.init(params))
    _, _, inner_rec = inner.update(params, _grads(rng), inner.init(params))
    with pytest.raises(UndoError, match="expected an ApplyIfFiniteRecord"):
        opt.undo(p, s, inner_rec)


# ------------------------------------------------------------------ vmap
E = 4


@pytest.mark.parametrize("undo", ["auto", "algebraic"])
def test_vmap_over_an_ensemble_skips_the_nonfinite_member_only(rng, undo):
    inner = sofx.adamw(lr=1e-2, weight_decay=0.1, undo=undo)
    opt = sofx.apply_if_finite(inner, 1)
    params = _params(rng, (E,))
    step = vmap(lambda p, g, s: opt.update(p, g, s))
    p1, s1, _ = step(params, _grads(rng, batch=(E,)), vmap(opt.init)(params))
    g = _grads(rng, batch=(E,))
    g["b"][2, 0] = NAN  # member 2 only
    p2, s2, rec = step(p1, g, s1)
    assert rec.applied.tolist() == [True, True, False, True]
    assert s2.notfinite_count.tolist() == [0, 0, 1, 0] and s2.total_notfinite.tolist() == [0, 0, 1, 0]
    assert s2.last_finite.tolist() == [True, True, False, True]
    assert s2.inner_state.count["w"].tolist() == [2, 2, 1, 2]
    for new, old in zip(_leaves((p2, s2.inner_state)), _leaves((p1, s1.inner_state))):
        assert torch.equal(new[2], old[2]), "the skipped member is bitwise as it was"
    for i in (0, 1, 3):  # the others: the member's own eager step
        pi = sofx.tree.tree_map(lambda x: x[i], p1)
        si = sofx.tree.tree_map(lambda x: x[i], s1.inner_state)
        want, _, _ = inner.update(pi, sofx.tree.tree_map(lambda x: x[i], g), si)
        for a, b in zip(_leaves(p2), _leaves(want)):
            torch.testing.assert_close(a[i], b, rtol=1e-6, atol=1e-7)

    back_p, back_s = vmap(opt.undo)(p2, s2, rec)
    assert back_s.notfinite_count.tolist() == [0] * E and back_s.last_finite.tolist() == [True] * E
    assert back_s.inner_state.count["w"].tolist() == [1] * E
    for a, b in zip(_leaves((back_p, back_s.inner_state)), _leaves((p1, s1.inner_state))):
        assert torch.equal(a[2], b[2])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    p3, s3, rec = step(p2, g, s2)  # member 2 again: beyond max_consecutive_errors=1, applied
    assert rec.applied.tolist() == [True] * E and s3.notfinite_count.tolist() == [0, 0, 2, 0]
    assert s3.inner_state.count["w"].tolist() == [3, 3, 2, 3]


@pytest.mark.parametrize("bad", [None, NAN])
def test_a_learning_rate_sweep_vmaps_over_the_hparams_only_and_returns_the_record(rng, bad):
    """Gradients and state not batched: the decision is read on the host, one for every member, and the
    whole result (the record too) comes back from vmap; vmap(undo) inverts it."""
    inner = sofx.adam()
    opt = sofx.apply_if_finite(inner, 3)
    params = _params(rng)
    state = opt.init(params)
    g = _grads(rng, bad)
    lrs = torch.tensor([1e-3, 1e-2, 1e-1])
    p, s, rec = vmap(lambda lr: opt.update(params, g, state, sofx.AdamHParams(lr=lr)))(lrs)
    assert rec.applied.tolist() == [bad is None] * 3
    assert s.notfinite_count.tolist() == [0 if bad is None else 1] * 3
    for i, lr in enumerate(lrs.tolist()):
        want = inner.update(params, g, inner.init(params), sofx.AdamHParams(lr=lr))[0] if bad is None else params
        for a, b in zip(_leaves(p), _leaves(want)):
            torch.testing.assert_close(a[i], b, rtol=1e-6, atol=1e-7)
    back_p, back_s = vmap(opt.undo)(p, s, rec)
    assert back_s.notfinite_count.tolist() == [0] * 3
    for a, b in zip(_leaves(back_p), _leaves(params)):
        torch.testing.assert_close(a, b.expand_as(a), rtol=1e-6, atol=1e-7)


def test_vmap_refuses_param_copies(rng):
    opt = sofx.apply_if_finite(sofx.adam(), 1)
    params = _params(rng, (E,))
    copies = sofx.tree.tree_map(torch.zeros_like, params)
    with pytest.raises(UnsupportedError, match="param_copies"):
        vmap(lambda p, g, s, c: opt.update(p, g, s, param_copies=c))(params, _grads(rng, batch=(E,)),
                                                                       vmap(opt.init)(params), copies)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("bad", [-1, 1.0, 2.5, True, "3", None, torch.tensor([1, 2])])
def test_bad_max_consecutive_errors_is_refused(bad):
    with pytest.raises(HParamError, match="max_consecutive_errors .*expected an integer >= 0"):
        sofx.apply_if_finite(sofx.adam(), bad)


def test_max_consecutive_errors_takes_numpy_and_tensor_integers():
    assert sofx.apply_if_finite(sofx.adam(), np.int64(3)).max_consecutive_errors == 3
    assert sofx.apply_if_finite(sofx.adam(), torch.tensor(2)).max_consecutive_errors == 2


@pytest.mark.parametrize("inner", [transforms.check_finite(), object()])
def test_an_inner_that_is_not_an_optimizer_is_refused(inner):
    with pytest.raises(UnsupportedError, match="expected a sofx optimizer"):
        sofx.apply_if_finite(inner, 1)


def test_a_state_of_another_kind_is_refused(rng):
    opt = sofx.apply_if_finite(sofx.adam(), 1)
    params = _params(rng)
    with pytest.raises(SofxError, match="ApplyIfFiniteState"):
        opt.update(params, _grads(rng), sofx.adam().init(params))
    good = opt.init(params)
    with pytest.raises(SofxError, match="state.notfinite_count"):
        opt.update(params, _grads(rng), good._replace(notfinite_count=-1))
    with pytest.raises(SofxError, match="state.last_finite"):
        opt.update(params, _grads(rng), good._replace(last_finite="yes"))


@pytest.mark.parametrize("bad", [None, NAN])
def test_bad_gradients_are_refused_whether_or_not_the_step_is_skipped(rng, bad):
    opt = sofx.apply_if_finite(sofx.adam(), 3)
    params = _params(rng)
    state = opt.init(params)
    g = _grads(rng, bad)
    g["w"] = g["w"][:2]  # a wrong shape
    with pytest.raises(LeafError, match=r"grads\['w'\]: expected shape \(4, 3\), got \(2, 3\)"):
        opt.update(params, g, state)
    assert _counters(state) == (0, True, 0)


def test_a_bad_option_is_refused_on_a_skipped_step(rng):
    opt = sofx.apply_if_finite(sofx.adam(), 3)
    params = _params(rng)
    with pytest.raises(UnsupportedError, match="donate"):
        opt.update(params, _grads(rng, NAN), opt.init(params), donate="no")
    with pytest.raises(HParamError, match="grad_scale"):
        opt.update(params, _grads(rng, NAN), opt.init(params), grad_scale=-1.0)


# ------------------------------------------------------------------ property
@given(st.lists(st.booleans(), min_size=1, max_size=10), st.integers(0, 3), st.sampled_from([NAN, INF, -INF]))
def test_counters_and_steps_follow_a_plain_python_model(finite_steps, limit, bad):
    """Against optax's rule written out in Python: the counters after every step, and the params and inner
    state equal to the inner optimizer stepped on the applied steps only."""
    gen = torch.Generator().manual_seed(len(finite_steps) * 7 + limit)
    inner = sofx.adam(lr=1e-2)
    opt = sofx.apply_if_finite(inner, limit)
    params = {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(4, generator=gen)}
    p, s = params, opt.init(params)
    q, t = params, inner.init(params)
    count = total = 0
    for finite in finite_steps:
        g = {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(4, generator=gen)}
        if not finite:
            g["b"][0] = bad
        count = 0 if finite else count + 1
        total += 0 if finite else 1
        applied = finite or count > limit
        p, s, rec = opt.update(p, g, s)
        if applied:
            q, t, _ = inner.update(q, g, t)
        assert bool(rec.applied) is applied
        assert _counters(s) == (count, finite, total)
        assert _bitwise(p, q) and _bitwise(s.inner_state, t)


def test_compiled_update_and_undo_decide_with_tensors(rng):
    """Under ``torch.compile`` the decision cannot be read: the step is selected with ``torch.where``, in one
    graph."""
    opt = sofx.apply_if_finite(sofx.adam(lr=1e-2), 1)
    params = _params(rng)
    update = torch.compile(lambda p, g, s: opt.update(p, g, s), backend="eager", fullgraph=True)
    undo = torch.compile(opt.undo, backend="eager", fullgraph=True)
    p1, s1, rec = update(params, _grads(rng, NAN), opt.init(params))
    assert not bool(rec.applied)
    assert _bitwise(p1, params) and _counters(s1) == (1, False, 1)
    assert all(int(c) == 0 for c in _leaves(s1.inner_state.count))
    p2, s2, rec = update(p1, _grads(rng), s1)
    assert bool(rec.applied) and _counters(s2) == (0, True, 1)
    back_p, back_s = undo(p2, s2, rec)
    assert _counters(back_s) == (1, False, 1) and all(int(c) == 0 for c in _leaves(back_s.inner_state.count))
    for a, b in zip(_leaves(back_p), _leaves(p1)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_state_survives_a_checkpoint_and_counts_on(rng, tmp_path):
    opt = sofx.apply_if_finite(sofx.adam(), 1)
    params = _params(rng)
    p, s, _ = opt.update(params, _grads(rng, NAN), opt.init(params))
    sofx.checkpoint.save(tmp_path / "run.ckpt", {"params": p, "state": s})
    loaded = sofx.checkpoint.load(tmp_path / "run.ckpt", like={"params": p, "state": s})
    assert isinstance(loaded["state"], ApplyIfFiniteState) and _counters(loaded["state"]) == (1, False, 1)
    _, s2, rec = opt.update(loaded["params"], _grads(rng, NAN), loaded["state"])
    assert bool(rec.applied) and _counters(s2) == (2, False, 2)


def test_the_loops_refuse_the_wrapper_and_say_they_skip_non_finite_steps_themselves():
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-3), max_consecutive_errors=2)
    params = {"w": torch.randn(3, 2)}
    with pytest.raises(SofxError, match=r"apply_if_finite.*opt\.inner.*loss scaler"):
        sofx.serial.init_loop(opt, params, sofx.loss_scale.static_scale(1.0))
    loop = sofx.serial.init_loop(opt.inner, params, sofx.loss_scale.static_scale(1.0))
    with pytest.raises(SofxError, match=r"apply_if_finite.*opt\.inner"):
        sofx.serial.serial_loop_step(opt, loop, {"w": torch.randn(3, 2)}, scaler=sofx.loss_scale.static_scale(1.0))


# A gradient whose memory was freed (untyped_storage().resize_(0), as FSDP frees tensors) or shrunk: the finiteness
# test read it with torch before the inner optimizer's checks (a segmentation fault for a freed one). Refused naming
# its path, the inputs and the counters unchanged; run in a subprocess so that a crash fails the test.
_FREED_GRADIENT = """
import torch
import sofx
from sofx.errors import LeafError
from refusal_script import clones, expect_refused

for keep in (0, 11996):  # freed; one element short
    for donate in (False, True):
        gen = torch.Generator().manual_seed(0)
        params = {"w": torch.randn(4, 3, generator=gen), "deep": [torch.randn(3000, generator=gen)]}
        grads = {"w": torch.randn(4, 3, generator=gen), "deep": [torch.randn(3000, generator=gen)]}
        opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 2)
        state = opt.init(params)
        kept = [params["w"], params["deep"][0], grads["w"], state.notfinite_count, state.total_notfinite]
        grads["deep"][0].untyped_storage().resize_(keep)
        expect_refused(f"{keep} {donate}", lambda: opt.update(params, grads, state, donate=donate), LeafError,
                       rf"grads\\['deep'\\]\\[0\\]: its storage holds {keep} bytes.*reach byte 12000", clones(kept))
print("ok")
"""


def test_a_gradient_whose_storage_was_freed_or_shrunk_is_refused_naming_it_before_the_finiteness_test():
    script_prints_ok(_FREED_GRADIENT)


def test_a_nested_tensor_gradient_is_refused_naming_its_path(rng):
    """A nested tensor gradient reached torch.isfinite in the finiteness test, which raised "Could not run
    'aten::ne.Scalar' with arguments from the 'NestedTensorCPU' backend", naming no leaf, before the inner
    optimizer's checks. It is refused as a LeafError naming its path, the counters unchanged."""
    import warnings
    opt = sofx.apply_if_finite(sofx.adam(), 3)
    params = _params(rng)
    state = opt.init(params)
    g = _grads(rng)
    with warnings.catch_warnings():  # (torch's warning that nested tensors are a prototype, once per process)
        warnings.simplefilter("ignore", UserWarning)
        g["b"] = torch.nested.nested_tensor([torch.ones(3)])
    with pytest.raises(LeafError, match=r"grads\['b'\]: expected a dense \(strided\) tensor, got a nested tensor"):
        opt.update(params, g, state)
    assert _counters(state) == (0, True, 0)


def test_hypergradient_through_a_skipped_step_under_func_grad_equals_autograd():
    """``torch.func.grad`` through a loop whose second step is skipped (a nan gradient): the decision can be read
    there, as with autograd. It was taken as unreadable, the inner step run on the nan gradient and selected away
    with ``torch.where``, whose backward multiplied that step's nan derivatives by 0: a nan hypergradient."""
    p0 = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(11), dtype=torch.float64)}
    opt = sofx.apply_if_finite(sofx.adamw(lr=0.05, weight_decay=0.1), 3)

    def after(lr: torch.Tensor) -> torch.Tensor:
        p, s = p0, opt.init(p0)
        for i in range(3):
            g = torch.randn(3, 2, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
            if i == 1:
                g[0, 0] = NAN
            p, s, _ = opt.update(p, {"w": g}, s, sofx.AdamHParams(lr=lr))
        assert int(s.total_notfinite) == 1 and int(s.inner_state.count["w"]) == 2
        return p["w"].square().sum()

    lr = torch.tensor(0.05, dtype=torch.float64)
    leaf = lr.clone().requires_grad_(True)
    (by_autograd,) = torch.autograd.grad(after(leaf), [leaf])
    by_func = torch.func.grad(after)(lr)
    h = 1e-6
    by_fd = (after(lr + h) - after(lr - h)) / (2 * h)
    assert torch.isfinite(by_func)
    torch.testing.assert_close(by_func, by_autograd, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(by_func, by_fd, rtol=1e-6, atol=1e-9)


def test_hypergradients_through_a_skipped_step_under_vmap_of_grad_are_finite():
    """``vmap(grad(...))`` over members of which one skips a step (a nan gradient): there the decision is one per
    member and the step is selected with ``torch.where``; the skipped member's inner step ran on its nan gradient,
    whose derivatives (times 0 from the select) made its hypergradient nan. Each member equals its own run."""
    p0 = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(12), dtype=torch.float64)}
    opt = sofx.apply_if_finite(sofx.adamw(lr=0.05, weight_decay=0.1), 3)
    poison = torch.tensor([0.0, NAN, 0.0], dtype=torch.float64)  # member 1's second step is skipped

    steps = [torch.randn(3, 2, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(3)]

    def after(lr: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        p, s = p0, opt.init(p0)
        for i, g in enumerate(steps):
            p, s, _ = opt.update(p, {"w": g + bad if i == 1 else g}, s, sofx.AdamHParams(lr=lr))
        return p["w"].square().sum()

    lrs = torch.tensor([0.01, 0.05, 0.1], dtype=torch.float64)
    batched = vmap(torch.func.grad(after))(lrs, poison)
    assert torch.isfinite(batched).all(), batched
    for i in range(3):
        torch.testing.assert_close(batched[i], torch.func.grad(after)(lrs[i], poison[i]), rtol=1e-12, atol=1e-14)


def test_vmap_takes_a_state_with_none_for_an_empty_subtree_as_the_eager_step_does():
    """A state whose moments hold None where the params have an empty subtree (a module without parameters) is
    taken by the inner optimizer and by the eager step; under vmap the selection of each member's results raised
    optree's bare 'Expected an instance of dict ..., got None'. It matches the trees as the optimizer does."""
    opt = sofx.apply_if_finite(sofx.adam(backend="reference"), 1)
    params = {"w": torch.randn(3, 2), "e": {}}
    grads = {"w": torch.randn(3, 2), "e": {}}
    grads["w"][1, 0] = math.inf

    def step(p, g):
        state = opt.init(p)
        inner = state.inner_state
        none_for_empty = sofx.AdamState(*({"w": t["w"], "e": None} for t in inner))
        return opt.update(p, g, state._replace(inner_state=none_for_empty))[0]

    got = vmap(step)(params, grads)
    want = vmap(lambda p, g: opt.update(p, g, opt.init(p))[0])(params, grads)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["w"][1], params["w"][1])


@pytest.mark.parametrize("meta_first", [True, False])
def test_a_meta_gradient_beside_one_with_data_is_refused_naming_both(rng, meta_first):
    """A meta gradient beside a CPU one raised torch's bare "Cannot copy out of meta tensor; no data!" (or "Tensor on
    device cpu is not on the expected device meta!") from the finiteness check. Refused naming both leaves and the
    device, nothing changed."""
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 2)
    params = {"a": torch.randn(3, generator=rng), "b": torch.randn(3, generator=rng)}
    meta, data = torch.empty(3, device="meta"), torch.randn(3, generator=rng)
    grads = {"a": meta, "b": data} if meta_first else {"a": data, "b": meta}
    state = opt.init(params)
    before = [x.clone() for x in _leaves((params, state))]
    with pytest.raises(LeafError, match=r"grads\['[ab]'\] is a meta tensor.*beside grads\['[ab]'\] on cpu"):
        opt.update(params, grads, state)
    assert _bitwise(before, _leaves((params, state)))


@pytest.mark.parametrize("call", ["update", "undo"])
def test_a_state_whose_inner_state_is_no_adam_state_is_refused_naming_it(rng, call):
    """An ApplyIfFiniteState whose inner_state is no AdamState (None, a LoopState's field taken by mistake) was
    refused by the inner step as "state: expected an AdamState, got NoneType", naming the state the caller gave,
    an ApplyIfFiniteState. The refusal names state.inner_state, nothing changed."""
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 2)
    params = _params(rng)
    p1, s1, rec = opt.update(params, _grads(rng), opt.init(params))
    for bad in (None, (1, 2, 3)):
        with pytest.raises(LeafError, match=r"^apply_if_finite: state\.inner_state is a (NoneType|tuple); expected "
                                            r"the inner optimizer's AdamState"):
            if call == "update":
                opt.update(p1, _grads(rng), s1._replace(inner_state=bad))
            else:
                opt.undo(p1, s1._replace(inner_state=bad), rec)
    assert not rec.inner.used
