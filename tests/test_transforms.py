"""Gradient transforms against torch (clip_grad_norm_, GradScaler.unscale_, .grad accumulation) and formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sofx
from sofx import AdamHParams
from sofx import transforms as tx
from sofx.errors import HParamError, LeafError, SofxError

from helpers import script_prints_ok


def _tree(gen: torch.Generator, scale: float = 1.0) -> dict:
    return {"w": torch.randn(4, 3, generator=gen) * scale, "b": torch.randn(3, generator=gen) * scale,
            "deep": [torch.randn(5, generator=gen) * scale]}


def _assert_close(a, b, rel=1e-6):
    for x, y in zip(sofx.tree.flatten(a)[0], sofx.tree.flatten(b)[0]):
        torch.testing.assert_close(x, y, rtol=rel, atol=0)


@pytest.mark.parametrize("scale", [0.01, 1.0, 50.0])
def test_clip_by_global_norm_equals_clip_grad_norm_(rng, scale: float):
    grads = _tree(rng, scale)
    leaves = [g.clone() for g in sofx.tree.flatten(grads)[0]]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in leaves]
    for p, g in zip(params, leaves):
        p.grad = g
    torch_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    t = tx.clip_by_global_norm(1.0)
    out, state = t.update(grads, t.init(grads))
    assert state.norm == pytest.approx(torch_norm.item(), rel=1e-6)
    _assert_close(out, sofx.tree.unflatten(sofx.tree.flatten(grads)[1], [p.grad for p in params]))
    assert (state.coef < 1) == (torch_norm.item() > 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clip_by_global_norm_of_half_gradients_is_clip_grad_norm_of_their_float32_copies(rng, dtype):
    """As documented: the norm and coefficient of bf16/fp16 gradients are taken in float32/float64, as
    ``clip_grad_norm_`` takes those of float32 copies; torch's own, on the bf16 gradients, rounds them to bf16."""
    grads = {k: v.to(dtype) for k, v in _tree(rng, 3.0).items() if k != "deep"}
    grads["big"] = (torch.randn(3000, generator=rng) * 0.5).to(dtype)
    leaves, spec = sofx.tree.flatten(grads)
    copies = [torch.nn.Parameter(torch.zeros(g.shape)) for g in leaves]
    for p, g in zip(copies, leaves):
        p.grad = g.float()
    norm32 = torch.nn.utils.clip_grad_norm_(copies, max_norm=1.0)
    t = tx.clip_by_global_norm(1.0)
    out, state = t.update(grads, t.init(grads))
    assert state.norm == pytest.approx(norm32.item(), rel=1e-6) and state.coef < 1
    for got, want in zip(sofx.tree.flatten(out)[0], copies):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.grad.to(dtype).float(), rtol=2 ** -7, atol=0)
        assert (got == want.grad.to(dtype)).float().mean() >= 0.99
    halves = [torch.nn.Parameter(torch.zeros_like(g)) for g in leaves]
    for p, g in zip(halves, leaves):
        p.grad = g.clone()
    theirs = torch.nn.utils.clip_grad_norm_(halves, max_norm=1.0)
    assert theirs.dtype == dtype and theirs.item() == pytest.approx(state.norm, rel=2 ** -7)  # in bf16: rounded


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_clip_by_global_norm_of_non_finite_gradients_equals_clip_grad_norm_(rng, bad: float):
    """A nan norm makes every gradient nan (torch.clamp keeps the nan), an inf norm zeroes the finite ones."""
    grads = _tree(rng, 1.0)
    leaves, spec = sofx.tree.flatten(grads)
    leaves[0][1] = bad
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in leaves]
    for p, g in zip(params, leaves):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    t = tx.clip_by_global_norm(1.0)
    out, _ = t.update(grads, t.init(grads))
    for got, want in zip(sofx.tree.flatten(out)[0], [p.grad for p in params]):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_unscale_then_clip_equals_gradscaler_unscale_then_clip(rng):
    S = 2.0 ** 14
    grads = _tree(rng, 3 * S)
    leaves = [g.clone() for g in sofx.tree.flatten(grads)[0]]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in leaves]
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=S)
    scaler.scale(sum(p.sum() for p in params))  # initialises the scale
    for p, g in zip(params, leaves):
        p.grad = g
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    t = tx.chain(tx.unscale(), tx.check_finite(), tx.clip_by_global_norm(0.5))
    out, (s0, fin, clip) = t.update(grads, t.init(grads), loss_scale=S)
    assert fin.all_finite and clip.coef < 1
    _assert_close(out, sofx.tree.unflatten(sofx.tree.flatten(grads)[1], [p.grad for p in params]))


@given(norm_scale=st.floats(0.01, 100.0), S=st.sampled_from([1.0, 2.0 ** 10, 2.0 ** 16]),
       max_norm=st.floats(0.1, 10.0))
def test_zero_form_matches_its_formula(norm_scale: float, S: float, max_norm: float):
    gen = torch.Generator().manual_seed(7)
    grads = _tree(gen, norm_scale * S)
    t = tx.unscale_and_clip_zero(max_norm)
    out, state = t.update(grads, t.init(grads), loss_scale=S)
    leaves = sofx.tree.flatten(grads)[0]
    scaled = math.sqrt(sum(float((g.double() ** 2).sum()) for g in leaves))
    clip = max((scaled / S + 1e-6) / max_norm, 1.0)
    for g, o in zip(leaves, sofx.tree.flatten(out)[0]):
        torch.testing.assert_close(o, (g.double() / (clip * S)).float(), rtol=1e-6, atol=0)
    assert state.norm == pytest.approx(scaled / S, rel=1e-12)
    assert tx.global_norm(out) <= max_norm * (1 + 1e-5)


@given(st.floats(0.1, 10.0), st.floats(1e-3, 1e3))
def test_clipping_bounds_the_norm_and_keeps_direction(max_norm: float, scale: float):
    gen = torch.Generator().manual_seed(3)
    grads = _tree(gen, scale)
    t = tx.clip_by_global_norm(max_norm)
    out, state = t.update(grads, t.init(grads))
    assert tx.global_norm(out) <= max_norm * (1 + 1e-5) or state.coef == 1.0
    for g, o in zip(sofx.tree.flatten(grads)[0], sofx.tree.flatten(out)[0]):
        torch.testing.assert_close(o, g * state.coef, rtol=1e-6, atol=0)


def test_sumsq_and_all_finite(rng):
    g = torch.randn(100, generator=rng)
    assert tx.sumsq(g) == pytest.approx(float((g.double() ** 2).sum()), rel=1e-6)
    h = torch.randn(5000, generator=rng)
    assert tx.sumsq(h) == pytest.approx(float((h.double() ** 2).sum()), rel=1e-6)
    assert math.isfinite(tx.sumsq(torch.full((3000,), 1e30)))  # squares overflow float32: float64 fallback
    big = torch.full((1000,), 3.0e38)
    assert math.isfinite(tx.sumsq(big))  # float64 accumulation: no spurious overflow
    for bad in (float("inf"), float("-inf"), float("nan")):
        h = g.clone()
        h[17] = bad
        assert not math.isfinite(tx.sumsq(h))
        assert not tx.all_finite({"a": g, "b": h})
    assert tx.all_finite({"a": g, "b": None})
    assert tx.sumsq(torch.zeros(0)) == 0.0
    assert tx.total_sumsq([1.0, None, 2.0]) == 3.0


@pytest.mark.parametrize("call, who", [(tx.global_norm, "global_norm"), (tx.all_finite, "all_finite"),
                                       (lambda g: tx.sumsq(g["w"]), "sumsq")])
def test_global_norm_all_finite_and_sumsq_of_gradients_without_a_readable_value_are_refused_naming_them(call, who):
    """They return a Python number: a meta gradient (shapes only) or one under vmap has no value to read, and
    torch's bare "item() cannot be called on meta tensors" (or vmap's data-dependent control flow error) came from
    inside them. Refused as LeafErrors naming the leaf and the transformations that take such gradients."""
    path = "x" if who == "sumsq" else r"grads\['w'\]"
    with pytest.raises(LeafError, match=rf"{who}: {path}: a meta tensor .*clip_by_global_norm"):
        call({"w": torch.ones(3, device="meta"), "b": None})
    with pytest.raises(LeafError, match=rf"{who}: {path}: .*torch.func transform.*clip_by_global_norm"):
        torch.func.vmap(lambda g: torch.as_tensor(call({"w": g})))(torch.ones(2, 3))


@pytest.mark.parametrize("x, pattern", [
    ([1.0, 2.0], r"expected a tensor, got list"), (None, r"expected a tensor, got NoneType"),
    (torch.ones(2, dtype=torch.int32), r"expected a floating-point tensor, got torch.int32"),
    (torch.ones(2, dtype=torch.complex64), r"expected a floating-point tensor, got torch.complex64"),
    (torch.ones(2).to_sparse(), r"expected a dense \(strided\) tensor, got torch.sparse_coo")])
def test_sumsq_of_something_other_than_a_dense_float_tensor_is_refused_naming_it(x, pattern):
    """A list, None or a float raised an AttributeError ('list' object has no attribute 'storage_offset'), an
    integer or complex tensor torch's vector_norm error, a sparse one its reshape error; refused as the transforms
    refuse such a gradient, a LeafError naming ``sumsq: x``."""
    with pytest.raises(LeafError, match=r"sumsq: x: " + pattern):
        tx.sumsq(x)


def test_check_finite_counts_nonfinite_steps(rng):
    t = tx.check_finite()
    g = _tree(rng)
    _, s = t.update(g, t.init(g))
    bad = dict(g, b=torch.tensor([1.0, float("nan"), 0.0]))
    out, s = t.update(bad, s)
    assert out is bad and s == tx.FiniteState(False, 1)


def test_accumulate_equals_grad_accumulation_bitwise(rng):
    params = {"a": torch.randn(6, generator=rng), "b": torch.randn(2, 2, generator=rng),
              "c": torch.randn(3, generator=rng)}
    micro = [{"a": torch.randn(6, generator=rng), "b": None, "c": None},
             {"a": torch.randn(6, generator=rng), "b": torch.randn(2, 2, generator=rng), "c": None},
             {"a": torch.randn(6, generator=rng), "b": torch.randn(2, 2, generator=rng), "c": None}]
    state = tx.accumulation_init(params)
    for m in micro:
        state = tx.accumulate(state, m, params)
    assert state.micro_steps == 3
    # autograd's accumulation: the first gradient, then grad = grad + new
    p = torch.nn.Parameter(torch.zeros(6))
    for m in micro:
        (p * m["a"]).sum().backward()
    skip = tx.accumulated(state, params, "skip")
    assert torch.equal(skip["a"], p.grad)
    assert torch.equal(skip["b"], micro[1]["b"] + micro[2]["b"])
    assert skip["c"] is None
    zero = tx.accumulated(state, params, "zero")
    assert torch.equal(zero["c"], torch.zeros(3))
    with pytest.raises(HParamError, match="missing_grad"):
        tx.accumulated(state, params, "drop")


def test_a_micro_step_without_any_gradient_is_counted_and_adds_nothing(rng):
    """``grads=None`` is no gradient for any leaf, as update, serial_step and speculative_step take it: the micro-step
    counts and the sums stay as they were (it was refused as 'grads is None, expected PyTreeSpec(...)')."""
    params = {"a": torch.randn(3, generator=rng), "b": torch.randn(2, generator=rng)}
    first = {"a": torch.randn(3, generator=rng), "b": None}
    state = tx.accumulate(tx.accumulation_init(params), first, params)
    after = tx.accumulate(state, None, params)
    assert after.micro_steps == 2 and after.total["a"] is state.total["a"] and after.total["b"] is None
    assert tx.accumulate(tx.accumulation_init(params), None, params) == tx.AccumulationState({"a": None, "b": None}, 1)


def test_accumulate_keeps_its_sum_when_the_loop_reuses_its_gradient_buffers(rng):
    """``model.zero_grad(set_to_none=False)`` zeroes ``.grad`` in place, and each micro-step's gradients are the
    same tensors: the accumulated sum must not be one of them."""
    model = torch.nn.Linear(4, 2)
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = tx.accumulation_init(params)
    want = {n: torch.zeros_like(p) for n, p in params.items()}
    for _ in range(3):
        model.zero_grad(set_to_none=False)
        model(torch.randn(8, 4, generator=rng)).pow(2).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        want = {n: want[n] + grads[n] for n in want}
        state = tx.accumulate(state, grads, params)
    got = tx.accumulated(state, params)
    assert all(torch.allclose(got[n], want[n], rtol=1e-6, atol=1e-7) for n in want)


def test_accumulate_rejects_bad_leaves_naming_the_path(rng):
    params = {"a": torch.randn(6, generator=rng)}
    state = tx.accumulation_init(params)
    with pytest.raises(LeafError, match=r"grads\['a'\].*shape"):
        tx.accumulate(state, {"a": torch.randn(5)}, params)
    with pytest.raises(LeafError, match=r"grads\['a'\].*dtype"):
        tx.accumulate(state, {"a": torch.randn(6, dtype=torch.float64)}, params)
    assert state.micro_steps == 0


def test_accumulate_and_accumulated_refuse_params_that_are_no_tensors_naming_the_leaf():
    """The gradients' shapes, dtypes and devices are read from params: a float param raised a bare AttributeError
    ('float' object has no attribute 'shape'), missing_grad="zero" torch's bare TypeError from zeros_like, and a
    numpy array's dtype was compared to the gradient's ("grads['w']: expected dtype float64, got torch.float32")."""
    np = pytest.importorskip("numpy")
    for bad, kind in ((1.0, "float"), (np.ones(3), "ndarray"), ("name", "str")):
        params = {"a": torch.ones(3), "w": bad}
        state = tx.accumulation_init(params)
        with pytest.raises(LeafError, match=rf"^accumulate: params\['w'\]: expected a tensor, got {kind}$"):
            tx.accumulate(state, {"a": torch.ones(3), "w": torch.ones(3)}, params)
        with pytest.raises(LeafError, match=rf"^accumulated: params\['w'\]: expected a tensor, got {kind}$"):
            tx.accumulated(state, params, missing_grad="zero")


def test_accumulation_state_of_other_params_is_refused_naming_the_leaf(rng):
    """A state summed for other params of the same structure (a (1, 2) leaf where params has (3, 2)) was
    broadcast into the new sum, and ``accumulated`` returned it as the (3, 2) leaf's gradient."""
    params = {"w": torch.randn(3, 2, generator=rng), "b": torch.randn(2, generator=rng)}
    other = {"w": torch.randn(1, 2, generator=rng), "b": torch.randn(2, generator=rng)}
    state = tx.accumulate(tx.accumulation_init(other), {"w": torch.randn(1, 2, generator=rng), "b": None}, other)
    with pytest.raises(LeafError, match=r"state.total\['w'\]: expected shape \(3, 2\), got \(1, 2\)"):
        tx.accumulate(state, {"w": torch.randn(3, 2, generator=rng), "b": None}, params)
    with pytest.raises(LeafError, match=r"state.total\['w'\]: expected shape \(3, 2\), got \(1, 2\)"):
        tx.accumulated(state, params)
    doubles = tx.AccumulationState({"w": torch.zeros(3, 2, dtype=torch.float64), "b": None}, 1)
    with pytest.raises(LeafError, match=r"state.total\['w'\]: expected dtype torch.float32, got torch.float64"):
        tx.accumulate(doubles, {"w": None, "b": torch.randn(2, generator=rng)}, params)


@pytest.mark.parametrize("micro_steps, kind", [(-1, "int"), (1.0, "float"), (True, "bool"), ("2", "str"),
                                               (None, "NoneType"), (torch.tensor(1.5), "a torch.float32 tensor")])
def test_an_accumulation_state_with_a_micro_step_count_that_is_no_count_is_refused(rng, micro_steps, kind):
    """``AccumulationState(total, micro_steps)`` built by hand (or loaded) took any micro_steps: -1 came back as
    0 after a micro-step, 1.0 as 2.0, and "2" raised a TypeError from ``+ 1``. Refused by ``accumulate`` and
    ``accumulated``, naming the field and the range; nothing passed in is changed."""
    params = {"w": torch.randn(3, generator=rng)}
    total = {"w": torch.randn(3, generator=rng)}
    kept = total["w"].clone()
    state = tx.AccumulationState(total, micro_steps)
    for call, who in ((lambda: tx.accumulate(state, {"w": torch.ones(3)}, params), "accumulate"),
                      (lambda: tx.accumulated(state, params), "accumulated")):
        with pytest.raises(SofxError, match=rf"{who}: state\.micro_steps = .* is invalid; expected an integer >= 0 "
                                            rf".*got {kind}"):
            call()
    assert state.total is total and torch.equal(total["w"], kept)


@pytest.mark.parametrize("steps, kind", [(-1, "int"), (1.5, "float"), (True, "bool"), ("2", "str"),
                                         (None, "NoneType"), (torch.tensor(1.5), "a torch.float32 tensor")])
def test_a_finite_state_with_a_non_finite_step_count_that_is_no_count_is_refused(steps, kind):
    """``FiniteState(all_finite, nonfinite_steps)`` built by hand (or loaded) took any count: "2" raised Python's
    bare TypeError at a non-finite step, -1 came back as 0, 1.5 counted on as 2.5. Refused naming the field and the
    range (as an AccumulationState's micro_steps); a numpy or 0-d tensor count is counted on as a Python int."""
    np = pytest.importorskip("numpy")
    check = tx.check_finite()
    for grads in ({"w": torch.ones(3)}, {"w": torch.full((3,), math.inf)}):
        with pytest.raises(SofxError, match=rf"^check_finite: state\.nonfinite_steps = .* is invalid; expected an "
                                            rf"integer >= 0 .*got {kind}"):
            check.update(grads, tx.FiniteState(True, steps))
        for n in (np.int64(2), torch.tensor(2)):
            out = check.update(grads, tx.FiniteState(True, n))[1].nonfinite_steps
            assert type(out) is int and out == 2 + math.isinf(grads["w"][0])


def test_an_accumulation_state_counts_numpy_and_tensor_micro_steps_as_ints(rng):
    """A count read back from a checkpoint as numpy's int64 or a 0-d int64 tensor is a count: the next state's
    is a Python int."""
    np = pytest.importorskip("numpy")
    params = {"w": torch.randn(3, generator=rng)}
    for n in (np.int64(2), torch.tensor(2), 2):
        state = tx.accumulate(tx.AccumulationState({"w": None}, n), {"w": torch.ones(3)}, params)
        assert type(state.micro_steps) is int and state.micro_steps == 3


def test_accumulate_under_vmap_returns_a_tensor_micro_step_count(rng):
    """Under torch.func.vmap the state's micro_steps was a Python int, which vmap refused ("must only return
    Tensors, got type <class 'int'>"). Under a torch.func transform it is a 0-d int64 tensor (of the eager count),
    the sums are each member's; eagerly it stays a Python int."""
    params = {"w": torch.randn(4, 3, generator=rng), "b": torch.randn(4, 2, generator=rng)}
    grads = {"w": torch.randn(4, 3, generator=rng), "b": torch.randn(4, 2, generator=rng)}

    def two(p, g):
        return tx.accumulate(tx.accumulate(tx.accumulation_init(p), g, p), g, p)

    state = torch.func.vmap(two)(params, grads)
    assert isinstance(state.micro_steps, torch.Tensor) and state.micro_steps.tolist() == [2] * 4
    for k in params:
        assert torch.equal(state.total[k], grads[k] + grads[k])
    eager = two(params, grads)
    assert type(eager.micro_steps) is int and eager.micro_steps == 2
    got = torch.func.vmap(lambda p, g: tx.accumulated(two(p, g), p))(params, grads)
    assert all(torch.equal(got[k], eager.total[k]) for k in params)


def test_an_accumulation_state_without_gradients_yet_leaves_vmap_and_comes_back(rng):
    """vmap refused a state whose totals were None ("must only return Tensors, got type NoneType"): the state
    accumulation_init makes, and one where a leaf got no gradient yet. Under a torch.func transform such a total is
    a 0-d bool tensor (and the count a 0-d int64 tensor); passed back in, it is no gradient yet, as None is: the
    sums and the skipped leaf are each member's eager ones. Eagerly the state is as before (None, a Python int)."""
    params = {"w": torch.randn(4, 3, generator=rng), "b": torch.randn(4, 2, generator=rng)}
    grads = {"w": torch.randn(4, 3, generator=rng), "b": None}
    step = torch.func.vmap(lambda st, w, p: tx.accumulate(st, {"w": w, "b": None}, p))
    state = torch.func.vmap(tx.accumulation_init)(params)
    assert state.micro_steps.tolist() == [0] * 4
    assert all(t.dtype == torch.bool and t.shape == (4,) for t in state.total.values())
    state = step(state, grads["w"], params)
    assert state.micro_steps.tolist() == [1] * 4 and state.total["b"].dtype == torch.bool
    assert torch.equal(state.total["w"], grads["w"])
    state = step(state, grads["w"], params)
    got = torch.func.vmap(lambda st, p: tx.accumulated(st, p, "zero"))(state, params)
    assert torch.equal(got["w"], grads["w"] + grads["w"]) and torch.equal(got["b"], torch.zeros(4, 2))
    skip = torch.func.vmap(lambda st, p: tx.accumulated(st, p)["w"])(state, params)
    assert torch.equal(skip, got["w"])
    skipped = torch.func.vmap(lambda st, p: torch.tensor(tx.accumulated(st, p)["b"] is None))(state, params)
    assert skipped.tolist() == [True] * 4
    eager = tx.accumulate(tx.accumulation_init(params), grads, params)
    assert eager.total["b"] is None and type(eager.micro_steps) is int


@pytest.mark.parametrize("bad, kind", [(-1.0, "float"), ("a", "str"), (True, "bool"), (torch.ones(2), "Tensor")])
def test_total_sumsq_refuses_what_is_no_sum_of_squares_naming_its_index(bad, kind):
    """A negative block sum (no sum of squares) was added in without a word, making the norm wrong; a str raised
    Python's bare TypeError from ``+=``; a 2-element tensor made the total a tensor. Refused naming the index; a
    numpy number or a 1-element tensor is read as the Python float it holds, inf and nan (a non-finite gradient's)
    pass."""
    np = pytest.importorskip("numpy")
    with pytest.raises(HParamError, match=rf"^total_sumsq: block_sumsq\[2\] = .* \({kind}\) is invalid; expected a "
                                          r"sum of squares >= 0"):
        tx.total_sumsq([1.0, None, bad])
    got = tx.total_sumsq([1, None, np.float64(2.0), torch.tensor([3.0])])
    assert type(got) is float and got == 6.0
    assert tx.total_sumsq([math.inf, 1.0]) == math.inf and math.isnan(tx.total_sumsq([1.0, math.nan]))


@pytest.mark.parametrize("bad, kind", [(4.0, "float"), (None, "NoneType"), ("4.0", "str")])
def test_total_sumsq_of_something_else_than_a_sequence_of_block_sums_is_refused_naming_it(bad, kind):
    """total_sumsq(4.0) (a total where the blocks' sums are taken) or None raised Python's bare "'float' object is
    not iterable"; a str was summed by its characters, refused as block_sumsq[0] = '4'. An HParamError names
    block_sumsq and what was given; a tuple or a generator of sums is summed as a list."""
    with pytest.raises(HParamError, match=rf"^total_sumsq: block_sumsq = .* \({kind}\) is invalid; expected a "
                                          r"sequence of the blocks' sums of squares"):
        tx.total_sumsq(bad)
    assert tx.total_sumsq((1.0, None, 2.0)) == tx.total_sumsq(s for s in [1.0, 2.0]) == 3.0


def test_label_params_refuses_a_none_or_container_label_naming_the_leaf():
    """A label_fn returning None ("no special group") dropped the leaf from the labels tree: group_hparams then
    gave it the optimizer's defaults, not ``base`` (its scheduled lr was ignored); a tuple became a subtree."""
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    for bad in (None, ("decay", 1), {"x": "decay"}):
        with pytest.raises(HParamError, match=r"label_fn returned .* for params\['w'\]; expected a label that is "
                                              r"neither None nor a container"):
            tx.label_params(params, lambda path, p: "no_decay" if p.dim() < 2 else bad)
    labels = tx.label_params(params, lambda path, p: "no_decay" if p.dim() < 2 else "decay")
    hp = tx.group_hparams(labels, {"decay": AdamHParams(), "no_decay": AdamHParams(weight_decay=0.0)},
                          base=AdamHParams(lr=0.5))
    assert hp["w"].lr == hp["b"].lr == 0.5


def test_unhashable_labels_are_refused_naming_the_leaf():
    """A label that is no dict key (a set, a 0-d numpy array, a bytearray: label_fn's or a hand-written labels
    tree's) raised Python's bare "TypeError: unhashable type: 'set'" from group_hparams' lookup; label_params and
    group_hparams refuse it, an HParamError naming the leaf, the label and its type."""
    np = pytest.importorskip("numpy")
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    groups = {"decay": AdamHParams(), "no_decay": AdamHParams(weight_decay=0.0)}
    for bad, kind in (({"decay"}, "set"), (np.array("decay"), "ndarray"), (bytearray(b"decay"), "bytearray")):
        with pytest.raises(HParamError, match=rf"label_fn returned .* \({kind}\) for params\['w'\]; expected a label "
                                              r"that is neither None nor a container, and hashable"):
            tx.label_params(params, lambda path, p: "no_decay" if p.dim() < 2 else bad)
        with pytest.raises(HParamError, match=rf"labels\['w'\] = .* \({kind}\) is unhashable and names no group; "
                                              r"expected a hashable label \(e.g. a string\); groups are \['decay', "
                                              r"'no_decay'\]"):
            tx.group_hparams({"w": bad, "b": "no_decay"}, groups)


def test_group_hparams_refuses_a_none_label_naming_the_leaf():
    """A None label (a hand-written "no group") gave that leaf the optimizer's defaults, not ``base`` nor a
    group: None is an empty subtree of the labels, and None in hparams means the defaults. It is refused naming
    the leaf; a None that stands for an empty subtree of params (None there too) passes given ``params=``."""
    groups = {"decay": AdamHParams(), "no_decay": AdamHParams(weight_decay=0.0)}
    base = AdamHParams(lr=0.5)
    for labels, where in (({"w": "decay", "b": None}, r"labels\['b'\]"),
                          ({"w": "decay", "deep": ["no_decay", None]}, r"labels\['deep'\]\[1\]")):
        with pytest.raises(HParamError, match=where + r" is None: a label must name a group"):
            tx.group_hparams(labels, groups, base)
    params = {"w": torch.ones(2, 2), "b": torch.ones(2), "frozen": None}
    with pytest.raises(HParamError, match=r"labels\['b'\] is None: a label must name a group"):
        tx.group_hparams({"w": "decay", "b": None, "frozen": None}, groups, base, params=params)
    labels = tx.no_decay_labels(params)
    assert labels["frozen"] is None
    with pytest.raises(HParamError, match=r"labels\['frozen'\] is None.*params=params"):
        tx.group_hparams(labels, groups, base)
    hp = tx.group_hparams(labels, groups, base, params=params)
    assert hp["w"].lr == hp["b"].lr == 0.5 and hp["b"].weight_decay == 0.0 and hp["frozen"] is None
    opt = sofx.adamw(weight_decay=0.1)
    grads = {"w": torch.ones(2, 2), "b": torch.ones(2), "frozen": None}
    new, _, _ = opt.update(params, grads, opt.init(params), hp)
    assert new["frozen"] is None


def test_a_label_that_names_no_group_is_refused_naming_the_groups_whatever_their_key_types():
    """Labels are any hashable values (label_fn may return ints, as optax's multi_transform takes them): a label
    that names no group is refused naming the groups there are, also where their keys do not sort together
    (sorting them raised a TypeError instead)."""
    labels = {"w": "decay", "b": 0}
    with pytest.raises(HParamError, match=r"labels\['b'\] = 0 names no group; groups are \['decay', 1\]"):
        tx.group_hparams(labels, {"decay": AdamHParams(), 1: AdamHParams(weight_decay=0.0)})
    with pytest.raises(HParamError, match=r"labels\['b'\] = 0 names no group; groups are \[1, 2\]"):
        tx.group_hparams({"w": 2, "b": 0}, {2: AdamHParams(), 1: AdamHParams()})
    hp = tx.group_hparams(labels, {"decay": AdamHParams(), 0: AdamHParams(weight_decay=0.0)})
    assert hp["b"].weight_decay == 0.0 and hp["w"].weight_decay is None


def test_no_decay_names_are_whole_names():
    w = torch.zeros(2, 2)
    names = ["bias", "attn.qkv_bias", "norm1", "encoder.LayerNorm", "final_layernorm", "ln_f", "h.0.ln_1",
             "rms_norm", "BatchNorm2d_3", "abnormal_proj", "kiln", "normal_init", "lnx", "weight", "unbiased"]
    labels = tx.no_decay_labels({n: w for n in names})
    assert [n for n in names if labels[n] == "no_decay"] == names[:9]
    stacked = {"0.weight": torch.zeros(4, 3, 2), "1.weight": torch.zeros(4, 3)}  # an ensemble of 4: Linear, norm
    assert tx.no_decay_labels(stacked, batch_dims=1) == {"0.weight": "decay", "1.weight": "no_decay"}
    assert tx.no_decay_labels(stacked)["1.weight"] == "decay"


def test_no_decay_batch_dims_given_as_numpy_is_an_int_and_a_float_or_bool_is_refused():
    """no_decay_labels(batch_dims=np.int64(1)) was refused as "expected an integer >= 0"; it is read as the int."""
    np = pytest.importorskip("numpy")
    stacked = {"0.weight": torch.zeros(4, 3, 2), "1.weight": torch.zeros(4, 3)}
    want = tx.no_decay_labels(stacked, batch_dims=1)
    for count in (np.int64(1), torch.tensor([1])):
        assert tx.no_decay_labels(stacked, batch_dims=count) == want
    for bad, kind in ((1.0, "float"), (True, "bool"), (-1, "int"), ("1", "str")):
        with pytest.raises(HParamError, match=r"batch_dims = .* is invalid; expected an integer >= 0 .*got " + kind):
            tx.no_decay_labels(stacked, batch_dims=bad)


def test_param_groups_no_decay_on_biases_and_norms_equals_torch_groups(rng):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    labels = tx.no_decay_labels(params)
    assert labels == {"0.weight": "decay", "0.bias": "no_decay", "1.weight": "no_decay", "1.bias": "no_decay",
                      "2.weight": "decay", "2.bias": "no_decay"}
    hp = tx.group_hparams(labels, {"decay": AdamHParams(), "no_decay": AdamHParams(weight_decay=0.0)},
                          base=AdamHParams(lr=0.01))
    opt = sofx.adamw(weight_decay=0.1)
    grads = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
    new, _, _ = opt.update(params, grads, opt.init(params), hp)
    named = dict(model.named_parameters())
    decay = [named[k] for k, v in labels.items() if v == "decay"]
    no_decay = [named[k] for k, v in labels.items() if v == "no_decay"]
    topt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.01,
                             weight_decay=0.1, foreach=False)
    for k, p in named.items():
        p.grad = grads[k].clone()
    topt.step()
    for k, p in named.items():
        torch.testing.assert_close(new[k], p.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(HParamError, match="names no group"):
        tx.group_hparams(labels, {"decay": AdamHParams()})


@pytest.mark.parametrize("leaf, pattern", [
    (3.0, r"grads\['enc'\]\['b'\]: expected a tensor, got float"),
    (torch.tensor([3]), r"grads\['enc'\]\['b'\]: expected a floating-point tensor, got torch.int64"),
    (torch.ones(2).to_sparse(), r"grads\['enc'\]\['b'\]: expected a dense \(strided\) tensor"),
])
def test_gradient_transforms_refuse_bad_leaves_naming_the_path(leaf, pattern):
    _refused_by_every_gradient_transform({"enc": {"w": torch.ones(2), "b": leaf}}, pattern)


def _refused_by_every_gradient_transform(grads, pattern: str) -> None:
    """The gradient transforms, the norms and ``scale_tree`` refuse ``grads`` with a LeafError naming the call,
    then matching ``pattern``."""
    for name, t, extra in (("clip_by_global_norm", tx.clip_by_global_norm(1.0), {}),
                           ("check_finite", tx.check_finite(), {}), ("unscale", tx.unscale(), {"loss_scale": 2.0}),
                           ("unscale_and_clip_zero", tx.unscale_and_clip_zero(1.0), {"loss_scale": 2.0})):
        with pytest.raises(LeafError, match=name + ": " + pattern):
            t.update(grads, t.init(None), **extra)
    for name, f in (("global_norm", tx.global_norm), ("all_finite", tx.all_finite),
                    ("scale_tree", lambda g: tx.scale_tree(g, 0.5))):
        with pytest.raises(LeafError, match=name + ": " + pattern):
            f(grads)


def test_loss_scale_of_any_real_number_type_or_a_one_element_float_tensor(rng):
    """numpy scalars are numbers (they were refused as invalid); a tensor of several elements, or of an integer
    dtype, is refused by name (a raw RuntimeError before)."""
    np = pytest.importorskip("numpy")
    grads = _tree(rng)
    t = tx.unscale()
    want, _ = t.update(grads, t.init(None), loss_scale=4.0)
    for s in (np.float32(4.0), np.float64(4.0), np.int64(4), torch.tensor(4.0), torch.tensor([4.0])):
        got, _ = t.update(grads, t.init(None), loss_scale=s)
        assert all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten(got)[0], sofx.tree.flatten(want)[0]))
    for s in (torch.tensor([4.0, 4.0]), torch.tensor(4)):
        with pytest.raises(HParamError, match=r"unscale: loss_scale must be a number or a 1-element float tensor"):
            t.update(grads, t.init(None), loss_scale=s)


@pytest.mark.parametrize("make", [tx.unscale, lambda: tx.unscale_and_clip_zero(1.0)], ids=["unscale", "zero"])
def test_a_loss_scale_beyond_the_float_range_is_refused_naming_it(rng, make):
    """An int loss scale beyond the float range raised Python's raw OverflowError ("int too large to convert to
    float") instead of the HParamError that names the loss scale."""
    t = make()
    with pytest.raises(HParamError, match=r": loss_scale = 1000+ is invalid; expected a finite number > 0"):
        t.update(_tree(rng), t.init(None), loss_scale=10 ** 400)


@pytest.mark.parametrize("make", [tx.unscale, lambda: tx.unscale_and_clip_zero(1.0)], ids=["unscale", "zero"])
@pytest.mark.parametrize("scale", [1e-40, 2.0 ** -130, 1e-320])
def test_a_loss_scale_whose_reciprocal_is_beyond_float32_is_refused(rng, make, scale: float):
    """A loss scale of 1e-40 (GradScaler's halvings reach it after ~145 overflows in a row) was taken: 1/S is
    inf in float32, so unscale turned every gradient into inf (a zero into nan), and the ZeRO form, whose
    ``norm/S`` was inf, into zeros (1e-320). It is refused, naming the scale, as the serial loop's
    ``can_unscale`` counts such a scale an overflow; the scales just above the boundary still unscale."""
    t = make()
    grads = _tree(rng)
    with pytest.raises(HParamError, match=r": loss_scale = .* is invalid: 1/loss_scale = .* is beyond float32's "
                                          r"range"):
        t.update(grads, t.init(None), loss_scale=scale)
    out, _ = t.update(sofx.tree.tree_map(lambda g: g * 2.0 ** -127, grads), t.init(None), loss_scale=2.0 ** -127)
    assert all(bool(torch.isfinite(g).all()) for g in sofx.tree.flatten(out)[0])
    assert sofx.serial.can_unscale(2.0 ** -127) and not sofx.serial.can_unscale(scale)


def test_hparams_given_as_dicts_or_tuples_are_refused():
    """A torch-style dict for a group (or a tuple) was zipped over its keys: lr became the string
    'weight_decay', or base's later fields were dropped."""
    base = AdamHParams(lr=1e-3, weight_decay=0.1)
    for override in ({"weight_decay": 0.0}, (None, 0.5)):
        with pytest.raises(HParamError, match=r"override is a (dict|tuple); expected sofx.AdamHParams"):
            tx.merge_hparams(base, override)
    with pytest.raises(HParamError, match=r"base is a dict"):
        tx.merge_hparams({"lr": 1e-3}, AdamHParams())
    labels = {"w": "decay", "b": "no_decay"}
    with pytest.raises(HParamError, match=r"groups\['no_decay'\] is a dict; expected sofx.AdamHParams"):
        tx.group_hparams(labels, {"decay": AdamHParams(), "no_decay": {"weight_decay": 0.0}})
    with pytest.raises(HParamError, match=r"base is a tuple"):
        tx.group_hparams(labels, {"decay": AdamHParams(), "no_decay": AdamHParams()}, base=(1e-3,))
    assert tx.merge_hparams(base, AdamHParams(beta1=0.5)) == AdamHParams(lr=1e-3, beta1=0.5, weight_decay=0.1)


def test_the_clip_epsilon_is_torchs_where_it_shows(rng):
    """Norms near 1e-3: the 1e-6 of clip_grad_norm_ moves the coefficient by 1e-3 relative."""
    assert tx.clip_coefficient(1e-3, 1e-4) == 1e-4 / (1e-3 + 1e-6)
    grads = {"w": torch.randn(4, 3, generator=rng) * 3e-4, "b": torch.randn(3, generator=rng) * 3e-4}
    ours, st = tx.clip_by_global_norm(1e-4).update(grads, tx.ClipState())
    theirs = {k: v.clone().requires_grad_() for k, v in grads.items()}
    for t in theirs.values():
        t.grad = t.detach().clone()
    torch.nn.utils.clip_grad_norm_(list(theirs.values()), 1e-4)
    for k in grads:
        torch.testing.assert_close(ours[k], theirs[k].grad, rtol=1e-6, atol=0)


def test_chain_and_transform_errors(rng):
    with pytest.raises(SofxError, match="GradientTransformation"):
        tx.chain(tx.identity(), lambda g: g)
    t = tx.unscale()
    with pytest.raises(SofxError, match="loss_scale"):
        t.update(_tree(rng), t.init(None))
    with pytest.raises(HParamError, match="loss_scale"):
        t.update(_tree(rng), t.init(None), loss_scale=0.0)
    with pytest.raises(HParamError, match="max_norm"):
        tx.clip_by_global_norm(-1.0)
    c = tx.chain(tx.identity())
    with pytest.raises(SofxError, match="state tuple"):
        c.update(_tree(rng), ())


@pytest.mark.parametrize("given, pattern", [
    (lambda: sofx.adamw(), r"^chain: argument 1 is an Adam \(a sofx optimizer, which is not chained as optax's: "
                           r"its update takes \(params, grads, state, hparams\)\); chain the gradient "
                           r"transformations, then opt\.update\(params, grads, state, hparams\) with their "
                           r"gradients$"),
    (lambda: sofx.apply_if_finite(sofx.adamw(), 3), r"^chain: argument 1 is an ApplyIfFinite \(a sofx optimizer"),
    (lambda: tx.clip_by_global_norm, r"^chain: argument 1 is the function clip_by_global_norm: call it for the "
                                     r"transformation, clip_by_global_norm\(\.\.\.\)$"),
    (lambda: type("undoable_opt", (), {"update": lambda self: None, "undo": lambda self: None})(),
     r"^chain: argument 1 is an undoable_opt \(a sofx optimizer")],
    ids=["adamw", "apply_if_finite", "a transformation's function", "a lowercase class name"])
def test_chain_given_an_optimizer_or_an_uncalled_transformation_says_what_to_do(given, pattern):
    """optax chains the optimizer last (``chain(clip_by_global_norm(1.0), adamw(1e-3))``): sofx's chain refused it
    with "argument 1 is a Adam, expected a GradientTransformation", which does not say how sofx composes them; a
    transformation's function not called (``chain(clip_by_global_norm)``) said "is a function". Now both say what
    to do."""
    with pytest.raises(SofxError, match=pattern):
        tx.chain(tx.identity(), given())


def test_chain_gives_a_transform_only_the_per_step_values_its_update_takes(rng):
    """optax's chain gives extra arguments only to the transforms that take them; sofx's gave ``loss_scale=`` to an
    optax-style ``update(grads, state, params=None)`` of the user's too, a TypeError ("got an unexpected keyword
    argument 'loss_scale'"). Now such a transform gets what its update names, a ``**extra`` one everything."""
    seen = []
    halve = tx.GradientTransformation(lambda p: tx.EmptyState(),
                                      lambda g, s, params=None: (tx.scale_tree(g, 0.5), s))
    named = tx.GradientTransformation(lambda p: tx.EmptyState(),
                                      lambda g, s, params=None, loss_scale=None: (seen.append(loss_scale) or g, s))
    t = tx.chain(tx.unscale(), halve, named, tx.clip_by_global_norm(1.0))
    grads = _tree(rng, 8.0)
    out, (_, _, _, clip) = t.update(grads, t.init(grads), loss_scale=4.0)
    want, want_clip = tx.clip_by_global_norm(1.0).update(tx.scale_tree(grads, 0.125), tx.ClipState())
    _assert_close(out, want, rel=0)
    assert clip == want_clip and seen == [4.0]


def test_chain_gives_a_keyword_only_value_to_an_update_with_var_positional_params(rng):
    """A transform whose update takes ``(grads, state, *args, loss_scale=...)`` (params caught by ``*args``) names
    ``loss_scale`` as a keyword-only parameter; the chain counted it among the three positional ones it passes
    (grads, state, params) and left it out: the update ran with its default scale, the gradients not unscaled,
    without a word."""
    seen = []
    star = tx.GradientTransformation(lambda p: tx.EmptyState(),
                                     lambda g, s, *args, loss_scale=1.0: (seen.append(loss_scale) or g, s))
    t = tx.chain(star)
    grads = _tree(rng, 1.0)
    t.update(grads, t.init(grads), loss_scale=4.0)
    assert seen == [4.0]


def test_transforms_vmap_over_an_ensemble(rng):
    """The chain runs under torch.func.vmap: each member equals the eager result."""
    members = [_tree(rng, s) for s in (0.05, 1.0, 30.0)]
    batched = sofx.tree.tree_map(lambda *xs: torch.stack(xs), *members)
    t = tx.chain(tx.unscale(), tx.check_finite(), tx.clip_by_global_norm(1.0))
    state = t.init(members[0])

    def one(g):
        out, (_, fin, clip) = t.update(g, state, loss_scale=4.0)
        return out, clip.norm, fin.all_finite

    out, norms, finite = torch.func.vmap(one)(batched)
    assert bool(finite.all())
    for k, m in enumerate(members):
        eager, (_, _, clip) = t.update(m, state, loss_scale=4.0)
        assert norms[k].item() == pytest.approx(clip.norm, rel=1e-6)
        _assert_close(sofx.tree.tree_map(lambda x: x[k], out), eager)
    z = tx.unscale_and_clip_zero(1.0)
    zout, zstate = torch.func.vmap(lambda g: z.update(g, z.init(g), loss_scale=4.0))(batched)
    for k, m in enumerate(members):
        eager, es = z.update(m, z.init(m), loss_scale=4.0)
        assert zstate.coef[k].item() == pytest.approx(es.coef, rel=1e-6)
        _assert_close(sofx.tree.tree_map(lambda x: x[k], zout), eager)


def test_transform_states_made_under_vmap_are_tensors_and_step_each_member(rng):
    """vmap refused the states that check_finite, clip_by_global_norm and unscale_and_clip_zero's init made ("must
    only return Tensors, got type <class 'bool'>" / 'float'), where Adam's and apply_if_finite's init are vmapped
    to make an ensemble's state. Under a torch.func transform they are 0-d tensors of the same values; a state so
    made steps each member as the eager one does. Eagerly they are Python numbers, as before."""
    members = [_tree(rng, s) for s in (0.05, 30.0)]
    batched = sofx.tree.tree_map(lambda *xs: torch.stack(xs), *members)
    t = tx.chain(tx.unscale(), tx.check_finite(), tx.clip_by_global_norm(1.0), tx.unscale_and_clip_zero(2.0))
    state = torch.func.vmap(t.init)(batched)
    _, fin, clip, zero = state
    assert fin.all_finite.tolist() == [True, True] and fin.nonfinite_steps.tolist() == [0, 0]
    assert clip.coef.tolist() == zero.coef.tolist() == [1.0, 1.0] and clip.norm.isnan().all()
    out, (_, fin, clip, _) = torch.func.vmap(lambda g, s: t.update(g, s, loss_scale=4.0))(batched, state)
    for k, m in enumerate(members):
        eager, (_, efin, eclip, _) = t.update(m, t.init(m), loss_scale=4.0)
        assert fin.nonfinite_steps[k].item() == efin.nonfinite_steps == 0
        assert clip.norm[k].item() == pytest.approx(eclip.norm, rel=1e-6)
        _assert_close(sofx.tree.tree_map(lambda x: x[k], out), eager)
    assert t.init(members[0])[1:] == (tx.FiniteState(True, 0), tx.ClipState(), tx.ClipState())


@pytest.mark.parametrize("call, name", [
    (lambda g, x: tx.scale_tree(g, x), "scale_tree: factor"),
    (lambda g, x: tx.unscale().update(g, tx.EmptyState(), loss_scale=x), "unscale: loss_scale"),
    (lambda g, x: tx.unscale_and_clip_zero(1.0).update(g, tx.ClipState(), loss_scale=x),
     "unscale_and_clip_zero: loss_scale")])
def test_a_meta_factor_or_loss_scale_for_gradients_with_data_is_refused_naming_it(call, name):
    """A meta tensor (shapes only, no value) as scale_tree's factor or as the loss scale of gradients with data
    raised torch's bare "Tensor on device meta is not on the expected device cpu!"; refused as an HParamError
    naming it and the gradient. With meta gradients it still plans the shapes."""
    meta = torch.tensor(2.0, device="meta")
    with pytest.raises(HParamError, match=rf"{name} is a tensor on meta \(no value\), the gradient grads\['w'\] "
                                          r"on cpu"):
        call({"b": None, "w": torch.ones(3)}, meta)
    out = call({"w": torch.ones(3, device="meta")}, meta)
    out = out[0] if isinstance(out, tuple) else out
    assert out["w"].is_meta and out["w"].shape == (3,)


def test_unscale_under_vmap_over_loss_scales_equals_each_scale(rng):
    """A loss scale that vmap wraps cannot be read on the host (it raised on .item()): the same math on the
    tensor, bit for bit the float path's for float32, bfloat16 and float64 leaves."""
    grads = {"a": torch.randn(5, generator=rng), "b": torch.randn(3, generator=rng).bfloat16(),
             "c": torch.randn(2, generator=rng, dtype=torch.float64)}
    scales = torch.tensor([1024.0, 3.0, 1e-3, 7.5])
    u = tx.unscale()
    out = torch.func.vmap(lambda s: u.update(grads, u.init(grads), loss_scale=s)[0])(scales)
    for i, s in enumerate(scales.tolist()):
        want = u.update(grads, u.init(grads), loss_scale=s)[0]
        assert all(torch.equal(out[k][i], want[k]) for k in grads), s
    z = tx.unscale_and_clip_zero(1.0)
    out = torch.func.vmap(lambda s: z.update(grads, z.init(grads), loss_scale=s)[0])(scales)
    want = z.update(grads, z.init(grads), loss_scale=3.0)[0]
    torch.testing.assert_close(out["a"][1], want["a"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("max_norm", [1.0, math.inf])
def test_traced_unscale_and_clip_zero_of_a_non_finite_gradient_does_not_clip_as_eager_and_deepspeed(rng, max_norm):
    """ZeRO clips only where ``clip > 1``: a nan norm (a nan gradient), or an inf one against an inf max_norm
    (``inf / inf``), gives ``clip = 1`` eagerly (:func:`~sofx.transforms.zero_clip_factor`), the gradients
    unscaled as they are. Under vmap (or with a traced loss scale) ``torch.clamp(min=1)`` kept the nan: every
    gradient of the member nan, its finite leaves included, and its coefficient nan."""
    bad = math.nan if max_norm == 1.0 else math.inf
    members = [_tree(rng), _tree(rng)]
    members[0]["w"][1, 2] = bad
    batched = sofx.tree.tree_map(lambda *xs: torch.stack(xs), *members)
    z = tx.unscale_and_clip_zero(max_norm)
    out, state = torch.func.vmap(lambda g: z.update(g, z.init(g), loss_scale=4.0))(batched)
    scaled, scaled_state = torch.func.vmap(lambda s: z.update(members[0], z.init(None), loss_scale=s))(
        torch.tensor([4.0, 4.0]))
    for k, m in enumerate(members):
        eager, es = z.update(m, z.init(m), loss_scale=4.0)
        assert state.coef[k].item() == pytest.approx(es.coef, rel=1e-6), k
        for a, b in zip(sofx.tree.flatten(sofx.tree.tree_map(lambda x: x[k], out))[0], sofx.tree.flatten(eager)[0]):
            assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()],
                                                                                          b[~b.isnan()]), k
    assert scaled_state.coef[0].item() == 1.0
    for a, b in zip(sofx.tree.flatten(sofx.tree.tree_map(lambda x: x[0], scaled))[0],
                    sofx.tree.flatten(z.update(members[0], z.init(None), loss_scale=4.0)[0])[0]):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_traced_clip_and_unscale_multiply_low_precision_leaves_as_eager(rng, dtype: torch.dtype):
    """Under vmap the clip coefficient (and ZeRO's 1/(clip*S)) was rounded to the leaves' dtype before the
    multiply: bfloat16 gradients came out up to 2 ulps off the eager result with the same coefficient."""
    grads = {"a": (torch.randn(3, 50, generator=rng) * 3).to(dtype), "b": torch.randn(3, 7, generator=rng).to(dtype)}
    clip = tx.clip_by_global_norm(1.0)
    out, coef = torch.func.vmap(lambda g: (lambda r: (r[0], r[1].coef))(clip.update(g, clip.init(g))))(grads)
    zero = tx.unscale_and_clip_zero(None)
    unscaled = torch.func.vmap(lambda g: zero.update(g, tx.ClipState(), loss_scale=3.0)[0])(grads)
    for k in range(3):
        member = {name: g[k] for name, g in grads.items()}
        assert coef[k] < 1
        want = tx.scale_tree(member, float(coef[k]))  # the eager multiply with the traced coefficient
        want_unscaled, _ = zero.update(member, tx.ClipState(), loss_scale=3.0)
        for name in grads:
            assert torch.equal(out[name][k], want[name]), (k, name)
            assert torch.equal(unscaled[name][k], want_unscaled[name]), (k, name)


@pytest.mark.parametrize("call", [
    lambda p: tx.accumulate((None, 0), {"a": torch.ones(3)}, p),
    lambda p: tx.accumulated((None, 0), p),
    lambda p: tx.check_finite().update({"a": torch.ones(3)}, (), p)],
    ids=["accumulate", "accumulated", "check_finite"])
def test_transforms_refuse_a_state_of_another_type(call):
    """A plain tuple as the state raised an AttributeError ('tuple' object has no attribute 'total')."""
    p = {"a": torch.ones(3)}
    with pytest.raises(SofxError, match=r": state is a tuple; expected (an AccumulationState|a FiniteState) \(as "):
        call(p)


def test_no_decay_labels_of_a_leaf_that_is_not_a_tensor_is_refused_naming_it():
    """A float or a numpy array among the params raised an AttributeError ('float' object has no attribute 'dim')
    from inside the rule; a LeafError names the leaf and what it is."""
    np = pytest.importorskip("numpy")
    for leaf, kind in ((1.0, "float"), (np.zeros((2, 2)), "ndarray")):
        with pytest.raises(LeafError, match=rf"no_decay_labels: params\['head'\]\[1\]: expected a tensor, got {kind}"):
            tx.no_decay_labels({"head": [torch.ones(2, 2), leaf]})


def test_no_decay_labels_refuses_a_leaf_with_fewer_dims_than_batch_dims_naming_it():
    """With batch_dims=2 (an ensemble of ensembles) a leaf of 1 dimension (a parameter that was not stacked, or
    batch_dims too large) was labelled no_decay without a word: its dims after the batch dims were -1. Refused,
    a LeafError naming the leaf, its shape and batch_dims; a leaf of exactly batch_dims dims (stacked scalars) is
    no_decay, as a scalar is."""
    params = {"w": torch.zeros(4, 2, 3, 5), "head": [torch.zeros(4, 2), torch.zeros(3)]}
    with pytest.raises(LeafError, match=r"no_decay_labels: params\['head'\]\[1\]: has 1 dimension \(shape \(3,\)\), "
                                        r"fewer than batch_dims = 2"):
        tx.no_decay_labels(params, batch_dims=2)
    params["head"][1] = torch.zeros(4, 2, 3)
    assert tx.no_decay_labels(params, batch_dims=2) == {"w": "decay", "head": ["no_decay", "no_decay"]}


def test_param_group_helpers_and_scale_tree_refuse_arguments_of_the_wrong_type():
    """A list of pairs as groups raised an AttributeError, a string label_fn a TypeError; scale_tree with a string
    factor a TypeError from torch, with a nan factor gave nan gradients, with an int beyond the float range a bare
    OverflowError ("int too large to convert to float")."""
    p = {"w": torch.ones(2, 2)}
    with pytest.raises(HParamError, match=r"groups is a list; expected a mapping label -> AdamHParams"):
        tx.group_hparams({"w": "decay"}, [("decay", AdamHParams())])
    with pytest.raises(HParamError, match=r"label_fn = 'decay' \(str\) is invalid; expected a callable"):
        tx.label_params(p, "decay")
    for factor in ("x", math.nan, math.inf, True, None, 10 ** 400, -(10 ** 400)):
        with pytest.raises(HParamError, match=r"scale_tree: factor = .* is invalid; expected a finite number"):
            tx.scale_tree(p, factor)
    assert torch.equal(tx.scale_tree(p, torch.tensor(2.0))["w"], torch.full((2, 2), 2.0))


def test_scale_tree_refuses_a_tensor_factor_of_several_elements_and_multiplies_as_a_number(rng):
    """A (3,) factor scaled a (5, 3) leaf column by column (and a (2,) one raised torch's size mismatch); a
    1-element factor multiplies as the same factor given as a number, bfloat16 leaves too."""
    grads = {"w": torch.randn(5, 3, generator=rng), "h": torch.randn(4, 3, generator=rng).bfloat16()}
    for factor in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.5]), torch.tensor(2)):
        with pytest.raises(HParamError, match=r"scale_tree: factor is a torch\.\w+ tensor of shape .*; expected a "
                                              r"finite number or a 1-element float tensor"):
            tx.scale_tree(grads, factor)
    c = 0.3712
    for factor in (torch.tensor(c), torch.tensor([c]), torch.tensor(c, dtype=torch.float64)):
        out = tx.scale_tree(grads, factor)
        want = tx.scale_tree(grads, float(torch.tensor(c)))
        assert all(torch.equal(out[k], want[k]) for k in grads)


def test_scale_tree_refuses_a_cpu_tensor_factor_holding_nan_or_inf(rng):
    """A float factor of nan or inf was refused, the same value as a 0-d (or 1-element) CPU tensor was not read:
    every gradient came back nan or inf without a word. Its value is read where that costs no device sync (a CPU
    tensor whose value can be read), refused naming the value; a negative one multiplies, as a negative float does.
    Under vmap (one factor per member) it is not read."""
    grads = {"b": None, "w": torch.randn(2, 3, generator=rng)}
    for value in (math.nan, math.inf, -math.inf):
        for factor in (torch.tensor(value), torch.tensor([value], dtype=torch.float64)):
            with pytest.raises(HParamError, match=r"scale_tree: factor = tensor\(.*\) is invalid; expected a finite "
                                                  r"number"):
                tx.scale_tree(grads, factor)
    assert torch.equal(tx.scale_tree(grads, torch.tensor(-2.0))["w"], grads["w"] * -2.0)
    factors = torch.tensor([0.5, math.nan])
    out = torch.func.vmap(lambda f: tx.scale_tree(grads, f)["w"])(factors)
    assert torch.equal(out[0], grads["w"] * 0.5) and out[1].isnan().all()


def test_max_norm_of_any_real_number_type_or_a_one_element_tensor(rng):
    """A numpy max_norm (a LambdaLR's or a config file's) or a 1-element tensor was refused as "invalid; expected a
    finite number > 0"; it clips as the same Python float. bool, nan, negative numbers (-inf too), strings and
    tensors of several elements are refused, naming the argument, its value and its type (0 and inf are taken,
    as clip_grad_norm_ takes them)."""
    np = pytest.importorskip("numpy")
    grads = _tree(rng, 3.0)
    for make, extra in ((tx.clip_by_global_norm, {}), (tx.unscale_and_clip_zero, {"loss_scale": 2.0})):
        want, want_state = make(0.5).update(grads, tx.ClipState(), **extra)
        for m in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.tensor([0.5]),
                  torch.tensor(0.5, dtype=torch.float64)):
            got, state = make(m).update(grads, tx.ClipState(), **extra)
            assert state == want_state and type(state.coef) is float, (make, m)
            assert all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten(got)[0], sofx.tree.flatten(want)[0]))
        for bad, kind in ((True, "bool"), (np.bool_(True), "bool"), (math.nan, "float"), (-math.inf, "float"),
                          (-1e-300, "float"), (-1, "int"), ("1.0", "str"), (np.float32(-2.0), "float32"),
                          (torch.tensor([0.5, 0.5]), r"a torch.float32 tensor of shape \(2,\)"),
                          (torch.tensor(True), r"a torch.bool tensor of shape \(\)")):
            with pytest.raises(HParamError, match=r"max_norm = .* is invalid; expected a number >= 0, inf included "
                                                  r".*, got " + kind):
                make(bad)


@pytest.mark.parametrize("max_norm", [1.0, 1e-7, None])
def test_zero_clip_of_a_tree_without_gradients_under_a_traced_loss_scale_is_a_norm_of_0(max_norm):
    """A vmapped (or autograd-recorded) loss scale with every gradient None raised torch's "stack expects a
    non-empty TensorList"; the norm is 0 and the coefficient the eager path's, whatever the loss scale."""
    z = tx.unscale_and_clip_zero(max_norm)
    scales = torch.tensor([1.0, 2.0, 65536.0])
    for grads in ({"a": None}, {}, [None, {"b": None}]):
        state = torch.func.vmap(lambda s: z.update(grads, tx.ClipState(), loss_scale=s)[1])(scales)
        recorded = z.update(grads, tx.ClipState(), loss_scale=torch.tensor(2.0, requires_grad=True))
        for i, s in enumerate(scales.tolist()):
            out, want = z.update(grads, tx.ClipState(), loss_scale=s)
            assert out == grads and want.norm == 0.0
            assert state.norm[i].item() == 0.0 and state.coef[i].item() == pytest.approx(want.coef, rel=1e-6)
        assert recorded[0] == grads and recorded[1].norm.item() == 0.0
        assert recorded[1].coef.item() == pytest.approx(want.coef, rel=1e-6)


@pytest.mark.parametrize("grads", [{}, {"a": None}, [None, {"b": None}]])
def test_clip_check_finite_and_zero_clip_of_a_tree_without_gradients_under_vmap_and_grad_give_tensor_states(grads):
    """Without a gradient the norm (0.0), the coefficient (1.0) and the finite flag (True) were Python numbers also
    under torch.func.vmap, which refused the state ("must only return Tensors, got type <class 'float'>"), where a
    tree with gradients gives 0-d tensors: they are tensors under vmap and grad, of the eager values."""
    x = torch.arange(3.0)
    for t, fields in ((tx.clip_by_global_norm(1.0), ("norm", "coef")),
                      (tx.check_finite(), ("all_finite", "nonfinite_steps")),
                      (tx.unscale_and_clip_zero(1.0), ("norm", "coef"))):
        eager_out, eager = t.update(grads, t.init(grads), loss_scale=2.0)
        assert eager_out == grads

        def state(x, t=t, fields=fields):
            s = t.update(grads, t.init(grads), loss_scale=2.0)[1]
            return tuple(getattr(s, f) for f in fields)

        got = torch.func.vmap(state)(x)
        for f, v in zip(fields, got):
            assert isinstance(v, torch.Tensor) and v.tolist() == [getattr(eager, f)] * 3, f
        last = float(getattr(eager, fields[-1]))
        assert torch.func.grad(lambda x: (x * state(x)[-1]).sum())(x).tolist() == [last] * 3


def test_clip_check_finite_and_zero_clip_of_gradients_made_outside_vmap_give_tensor_states(rng):
    """Gradients vmap does not batch (made outside it: shared by the members) were read on the host, and the state
    held Python numbers, which vmap refused ("must only return Tensors, got type <class 'float'>"); the same
    function over batched gradients returns tensors. Under a torch.func transform the state holds 0-d tensors,
    the eager values to float32 rounding, and the gradients are the eager ones."""
    grads = _tree(rng, 30.0)
    for t, fields in ((tx.clip_by_global_norm(1.0), ("norm", "coef")),
                      (tx.check_finite(), ("all_finite", "nonfinite_steps")),
                      (tx.unscale_and_clip_zero(1.0), ("norm", "coef"))):
        eager_out, eager = t.update(grads, t.init(grads), loss_scale=2.0)
        out, state = torch.func.vmap(lambda x, t=t: t.update(grads, t.init(grads), loss_scale=2.0))(torch.ones(2))
        for f in fields:
            got = getattr(state, f)
            assert isinstance(got, torch.Tensor) and got.shape == (2,), f
            assert got.tolist() == pytest.approx([float(getattr(eager, f))] * 2, rel=1e-6), f
        _assert_close(sofx.tree.tree_map(lambda x: x[1], out), eager_out)


@pytest.mark.parametrize("t, who", [(tx.clip_by_global_norm(1.0), "clip_by_global_norm"),
                                     (tx.check_finite(), "check_finite"),
                                     (tx.unscale_and_clip_zero(1.0), "unscale_and_clip_zero")])
def test_reductions_over_gradients_on_two_devices_on_tensors_are_refused_naming_both(t, who):
    """A meta gradient (shapes only) beside one with data, eagerly (a meta leaf takes the tensor path) or under
    vmap: torch.stack of their norms raised torch's bare "Tensor on device meta is not on the expected device cpu!".
    A LeafError names the transform, both leaves and both devices; meta gradients alone still plan the shapes."""
    pattern = rf"{who}: grads\['c'\] is on meta, grads\['a'\] on cpu: .* give them on one device \(a meta tensor"
    with pytest.raises(LeafError, match=pattern):
        t.update({"a": torch.ones(3), "b": None, "c": torch.ones(2, device="meta")}, t.init(None), loss_scale=2.0)
    with pytest.raises(LeafError, match=pattern):
        torch.func.vmap(lambda a: t.update({"a": a, "b": None, "c": torch.ones(2, device="meta")}, t.init(None),
                                           loss_scale=2.0)[0]["a"])(torch.ones(2, 3))
    out, _ = t.update({"a": torch.ones(3, device="meta"), "c": torch.ones(2, device="meta")}, t.init(None),
                      loss_scale=2.0)
    assert out["a"].is_meta and out["c"].shape == (2,)


@pytest.mark.parametrize("max_norm", [0.0, math.inf])
def test_clip_by_global_norm_of_max_norm_0_or_inf_equals_clip_grad_norm_bitwise(rng, max_norm: float):
    """clip_grad_norm_ takes both: 0 zeroes every gradient (``coef = 0/(norm + 1e-6)``; a negative element
    becomes -0.0), inf leaves them as they are (``coef`` inf, clamped to 1); sofx refused them. Now the same bits,
    eager and traced (autograd recording the gradients)."""
    grads = _tree(rng, 3.0)
    leaves, spec = sofx.tree.flatten(grads)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in leaves]
    for p, g in zip(params, leaves):
        p.grad = g.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    t = tx.clip_by_global_norm(max_norm)
    out, state = t.update(grads, t.init(grads))
    assert state.norm == pytest.approx(torch_norm.item(), rel=1e-6) and state.coef == min(max_norm, 1.0)
    for got, want in zip(sofx.tree.flatten(out)[0], [p.grad for p in params]):
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    recorded = sofx.tree.tree_map(lambda g: g.clone().requires_grad_(), grads)
    traced, tstate = t.update(recorded, t.init(grads))
    assert tstate.coef.item() == min(max_norm, 1.0)
    for got, want in zip(sofx.tree.flatten(traced)[0], [p.grad for p in params]):
        assert torch.equal(got.detach(), want)


@pytest.mark.parametrize("max_norm", [0.0, math.inf])
def test_zero_form_of_max_norm_0_or_inf_only_unscales_as_deepspeeds_stage3(rng, max_norm: float):
    """DeepSpeed clips only where ``clip_grad > 0`` (its gradient_clipping 0.0, the default, is "off"), and a
    clip_grad of inf never clips: ZeRO-3's ``unscale_and_clip_grads`` only unscales. So does the ZeRO form here,
    eager and with a loss scale autograd records (sofx refused both values)."""
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    from types import SimpleNamespace
    S = 2.0 ** 10
    grads = _tree(rng, 3.0 * S)
    leaves, spec = sofx.tree.flatten(grads)
    flat = torch.cat([g.reshape(-1) for g in leaves])
    ds = SimpleNamespace(loss_scale=S, clip_grad=max_norm, fp32_partitioned_groups_flat=[SimpleNamespace(grad=flat)])
    stage3.DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads(ds, 0, torch.linalg.vector_norm(flat))
    z = tx.unscale_and_clip_zero(max_norm)
    out, state = z.update(grads, z.init(grads), loss_scale=S)
    assert state.coef == 1.0
    assert torch.equal(torch.cat([g.reshape(-1) for g in sofx.tree.flatten(out)[0]]), flat)
    traced, tstate = z.update(grads, z.init(grads), loss_scale=torch.tensor(S, requires_grad=True))
    assert tstate.coef.item() == 1.0
    assert torch.equal(torch.cat([g.detach().reshape(-1) for g in sofx.tree.flatten(traced)[0]]), flat)


@pytest.mark.parametrize("call, pattern", [
    (lambda: tx.clip_coefficient(-1e-6, 1.0), r"clip_coefficient: norm = -1e-06 is invalid; expected a number >= 0"),
    (lambda: tx.clip_coefficient(-math.inf, 1.0), r"clip_coefficient: norm = -inf is invalid; expected a number >= 0"),
    (lambda: tx.clip_coefficient("1.0", 1.0), r"clip_coefficient: norm = '1.0' is invalid; .* got str"),
    (lambda: tx.clip_coefficient(True, 1.0), r"clip_coefficient: norm = True is invalid; .* got bool"),
    (lambda: tx.clip_coefficient(1.0, -1.0), r"clip_coefficient: max_norm = -1.0 is invalid; expected a number >= 0"),
    (lambda: tx.clip_coefficient(1.0, math.nan), r"clip_coefficient: max_norm = nan is invalid"),
    (lambda: tx.zero_clip_factor(1.0, 0.0, 1.0), r"zero_clip_factor: scale = 0.0 is invalid; expected a finite "
                                                   r"number > 0"),
    (lambda: tx.zero_clip_factor(1.0, -2.0, 1.0), r"zero_clip_factor: scale = -2.0 is invalid; expected a finite "
                                                    r"number > 0"),
    (lambda: tx.zero_clip_factor(1.0, math.inf, 1.0), r"zero_clip_factor: scale = inf is invalid"),
    (lambda: tx.zero_clip_factor(-1.0, 2.0, 1.0), r"zero_clip_factor: scaled_norm = -1.0 is invalid; expected a "
                                                    r"number >= 0"),
    (lambda: tx.zero_clip_factor(1.0, 2.0, -1.0), r"zero_clip_factor: max_norm = -1.0 is invalid; expected a "
                                                    r"number >= 0"),
    (lambda: tx.zero_clip_factor(1.0, torch.tensor([2.0, 3.0]), 1.0), r"zero_clip_factor: scale = .* is invalid"),
], ids=["norm -1e-6", "norm -inf", "norm str", "norm bool", "max_norm negative", "max_norm nan", "scale 0",
        "scale negative", "scale inf", "scaled_norm negative", "zero max_norm negative", "scale of 2 elements"])
def test_clip_coefficient_and_zero_clip_factor_refuse_values_out_of_range_naming_them(call, pattern):
    """A norm of -1e-6 (norm + 1e-6 == 0) or a loss scale of 0 raised a bare ZeroDivisionError, and other negative
    norms or scales gave a coefficient that reverses or blows up the gradients: refused, naming the argument and
    the range expected."""
    with pytest.raises(HParamError, match=pattern):
        call()


def test_clip_coefficient_and_zero_clip_factor_take_inf_and_nan_norms_and_numbers_of_any_type():
    """A non-finite gradient's norm (inf, nan) is a norm: clip_grad_norm_'s coefficient is 0 and nan for them
    (nan kept, as torch.clamp keeps it); numpy numbers and 1-element tensors read as their Python float."""
    np = pytest.importorskip("numpy")
    assert tx.clip_coefficient(math.inf, 1.0) == 0.0
    assert math.isnan(tx.clip_coefficient(math.nan, 1.0))
    assert tx.clip_coefficient(0.0, 1.0) == 1.0 and tx.clip_coefficient(0.0, 0.0) == 0.0
    assert tx.zero_clip_factor(math.inf, 2.0, 1.0) == math.inf
    assert tx.zero_clip_factor(1.0, 2.0, 0.0) == 1.0
    want = tx.clip_coefficient(3.0, 0.5)
    for norm in (np.float32(3.0), np.float64(3.0), torch.tensor(3.0), torch.tensor([3.0], dtype=torch.float64), 3):
        got = tx.clip_coefficient(norm, 0.5)
        assert type(got) is float and got == want, norm
    assert (tx.zero_clip_factor(np.float64(6.0), torch.tensor(2.0), np.float32(0.5))
            == tx.zero_clip_factor(6.0, 2.0, 0.5))


def test_clip_coefficient_and_zero_clip_factor_of_traced_norms_equal_the_float_path():
    """Under vmap (or autograd recording, or torch.compile) the norm cannot be read: the same rule on the tensor
    (``coef >= 1.0`` on a vmapped tensor raised a data-dependent control flow error), each value the eager one."""
    norms = torch.tensor([0.0, 0.3, 2.0, 1e4, math.inf, math.nan], dtype=torch.float64)
    scales = torch.tensor([1.0, 2.0, 0.5, 1024.0, 3.0, 4.0], dtype=torch.float64)
    coef = torch.func.vmap(lambda n: tx.clip_coefficient(n, 0.5))(norms)
    clip = torch.func.vmap(lambda n, s: tx.zero_clip_factor(n, s, 0.5))(norms, scales)
    off = torch.func.vmap(lambda n, s: tx.zero_clip_factor(n, s, 0.0))(norms, scales)
    for i, (n, s) in enumerate(zip(norms.tolist(), scales.tolist())):
        for got, want in ((coef[i].item(), tx.clip_coefficient(n, 0.5)),
                          (clip[i].item(), tx.zero_clip_factor(n, s, 0.5)),
                          (off[i].item(), tx.zero_clip_factor(n, s, 0.0))):
            assert got == want or (math.isnan(got) and math.isnan(want)), (i, got, want)
    recorded = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    tx.clip_coefficient(recorded, 0.5).backward()
    assert recorded.grad.item() == pytest.approx(-0.5 / (2.0 + 1e-6) ** 2)
    compiled = torch.compile(lambda n, s: (tx.clip_coefficient(n, 0.5), tx.zero_clip_factor(n, s, 0.5)),
                             backend="eager", fullgraph=True)
    c, z = compiled(torch.tensor(2.0, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64))
    assert c.item() == tx.clip_coefficient(2.0, 0.5) and z.item() == tx.zero_clip_factor(2.0, 0.5, 0.5)


# A gradient (or an accumulated sum) whose memory was freed (untyped_storage().resize_(0), as FSDP frees tensors)
# or shrunk: the transforms read it with torch (a segmentation fault for a freed one in all_finite, scale_tree,
# unscale, check_finite and accumulate; torch's RuntimeError in sumsq's views; nan from past a shrunk end). Refused
# naming its path, before anything is computed; run in a subprocess so that a crash fails the test.
_FREED_GRADIENT = """
import re
import torch
from refusal_script import clones, expect_refused
from sofx import transforms as tx
from sofx.errors import LeafError


def tree():
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(40, 30, generator=gen), "deep": [torch.randn(3000, generator=gen)]}


def expect(case, fn, pattern, *kept):
    expect_refused(case, fn, LeafError, pattern, clones(kept))


def cut(t, keep):
    t.untyped_storage().resize_(keep)
    return t


for keep in (0, 11996):  # freed; one element short
    holds = rf"\\['deep'\\]\\[0\\]: its storage holds {keep} bytes.*reach byte 12000"
    transforms = {"clip_by_global_norm": (tx.clip_by_global_norm(1.0), {}),
                  "unscale": (tx.unscale(), {"loss_scale": 2.0}),
                  "unscale_and_clip_zero": (tx.unscale_and_clip_zero(1.0), {"loss_scale": 2.0}),
                  "check_finite": (tx.check_finite(), {})}
    for name, (t, extra) in transforms.items():
        g = tree()
        cut(g["deep"][0], keep)
        expect(f"{name} {keep}", lambda: t.update(g, t.init(g), **extra), name + ": grads" + holds, g["w"])
    for name, fn in {"global_norm": tx.global_norm, "all_finite": tx.all_finite,
                     "scale_tree": lambda g: tx.scale_tree(g, 0.5)}.items():
        g = tree()
        cut(g["deep"][0], keep)
        expect(f"{name} {keep}", lambda: fn(g), name + ": grads" + holds, g["w"])
    expect(f"sumsq {keep}", lambda: tx.sumsq(cut(torch.randn(3000), keep)),
           rf"sumsq: x: its storage holds {keep} bytes.*reach byte 12000")

    params = tree()
    first = tree()
    state = tx.accumulate(tx.accumulation_init(params), first, params)
    g = tree()
    cut(g["deep"][0], keep)
    expect(f"accumulate first {keep}", lambda: tx.accumulate(tx.accumulation_init(params), g, params),
           "grads" + holds, params["w"])
    expect(f"accumulate {keep}", lambda: tx.accumulate(state, g, params), "grads" + holds, state.total["w"],
           state.total["deep"][0])
    cut(state.total["deep"][0], keep)
    expect(f"accumulate state.total {keep}", lambda: tx.accumulate(state, tree(), params), "state.total" + holds,
           state.total["w"])
    expect(f"accumulated state.total {keep}", lambda: tx.accumulated(state, params), "state.total" + holds,
           state.total["w"])
print("ok")
"""


def test_a_gradient_whose_storage_was_freed_or_shrunk_is_refused_by_the_transforms_naming_it():
    script_prints_ok(_FREED_GRADIENT)


@pytest.mark.parametrize("call, name", [(lambda: tx.clip_by_global_norm(None), "max_norm"),
                                        (lambda: tx.clip_coefficient(1.0, None), "clip_coefficient: max_norm"),
                                        (lambda: tx.zero_clip_factor(1.0, 2.0, None), "zero_clip_factor: max_norm")],
                         ids=["clip_by_global_norm", "clip_coefficient", "zero_clip_factor"])
def test_a_max_norm_of_none_where_the_call_clips_is_refused_saying_how_not_to_clip(call, name):
    """``clip_by_global_norm(None)`` was refused with a message that said "None: no clipping" (the rule of the
    loops and the facade, which take None), as if None were what it takes; it says that this call always
    clips, and how not to clip (leave the clip out, or ``identity()``), without that contradiction."""
    with pytest.raises(HParamError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name} = None is invalid here: this call clips"), message
    assert "identity()" in message and "None: no clipping" not in message, message


def test_a_nested_tensor_gradient_is_refused_naming_its_path():
    """A nested tensor (torch.nested.nested_tensor) as a gradient reached torch's operations, which raised
    "reshape: For now nested reshape cannot change ...", "Could not run 'aten::ne.Scalar' with arguments from the
    'NestedTensorCPU' backend" or "NestedTensorImpl doesn't support sizes" (accumulate), naming no leaf. The
    transforms, the norms, ``scale_tree``, ``sumsq`` and ``accumulate`` refuse it as a LeafError naming it."""
    import warnings
    from sofx import speculate as sp
    with warnings.catch_warnings():  # (torch's warning that nested tensors are a prototype, once per process)
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.ones(2)])
    grads = {"enc": {"w": torch.ones(2), "b": nested}}
    pattern = r"grads\['enc'\]\['b'\]: expected a dense \(strided\) tensor, got a nested tensor"
    _refused_by_every_gradient_transform(grads, pattern)
    for f in (tx.sumsq, sp.grad_sumsq):
        with pytest.raises(LeafError, match=r"sumsq: x: expected a dense \(strided\) tensor, got a nested tensor"):
            f(nested)
    params = {"enc": {"w": torch.ones(2), "b": torch.ones(2)}}
    state = tx.accumulation_init(params)
    with pytest.raises(LeafError, match=pattern):
        tx.accumulate(state, grads, params)
