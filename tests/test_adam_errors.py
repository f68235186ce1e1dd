"""Every bad input raises a clear error naming the leaf path, and leaves all inputs unchanged."""

from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch

import sofx
import sofx.offload
from sofx import AdamHParams

from helpers import clone_tree, max_rel_err, script_prints_ok, trees_equal


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = {"layers": [{"w": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen)}],
              "head": torch.randn(2, generator=gen)}
    grads = clone_tree(params)
    grads = sofx.tree.tree_map(lambda t: torch.randn(t.shape, generator=gen), grads)
    opt = sofx.adamw(lr=1e-2)
    state = opt.init(params)
    params, state, _ = opt.update(params, grads, state)  # nonzero state
    return opt, params, grads, state


def _snapshot(*trees):
    return [clone_tree(t) for t in trees]


def _assert_unchanged(before, *trees):
    for b, t in zip(before, trees):
        assert trees_equal(b, t), "an input was modified by a call that raised"


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("mutate, error, pattern", [
    (lambda p, g, s: (p, {"layers": [{"w": g["layers"][0]["w"]}], "head": g["head"]}, s),
     sofx.StructureError, r"grads does not have the structure of params.*grads\['layers'\]\[0\] has entries \['w'\]"),
    (lambda p, g, s: (p, {**g, "head": torch.randn(3)}, s),
     sofx.LeafError, r"grads\['head'\]: expected shape \(2,\), got \(3,\)"),
    (lambda p, g, s: (p, {**g, "head": g["head"].double()}, s),
     sofx.LeafError, r"grads\['head'\]: expected dtype torch.float32, got torch.float64"),
    (lambda p, g, s: (p, {**g, "head": g["head"].to("meta")}, s),
     sofx.LeafError, r"grads\['head'\]: expected device cpu, got meta"),
    (lambda p, g, s: (p, g, s._replace(mu={**s.mu, "head": torch.zeros(5)})),
     sofx.LeafError, r"state.mu\['head'\]: expected shape \(2,\), got \(5,\)"),
    (lambda p, g, s: (p, g, s._replace(nu={**s.nu, "head": s.nu["head"].bfloat16()})),
     sofx.LeafError, r"state.nu\['head'\]: expected dtype torch.float32, got torch.bfloat16"),
    (lambda p, g, s: (p, g, s._replace(count={**s.count, "head": torch.tensor(1.0)})),
     sofx.LeafError, r"state.count\['head'\]: expected a 0-d int64 tensor"),
    (lambda p, g, s: (p, g, s._replace(mu={"head": s.mu["head"]})),
     sofx.StructureError, r"state.mu does not have the structure of params"),
    (lambda p, g, s: ({**p, "head": p["head"].long()}, g, s),
     sofx.LeafError, r"params\['head'\]: expected a floating-point tensor"),
])
def test_bad_inputs_raise_naming_the_leaf_and_change_nothing(mutate, error, pattern, donate):
    opt, params, grads, state = _setup()
    p, g, s = mutate(params, grads, state)
    before = _snapshot(params, grads, state)
    with pytest.raises(error, match=pattern):
        opt.update(p, g, s, donate=donate)
    _assert_unchanged(before, params, grads, state)


@pytest.mark.parametrize("hp, pattern", [
    (sofx.AdamHParams(lr=-1e-3), r"lr = -0.001 is invalid; expected lr >= 0"),
    (sofx.AdamHParams(beta1=1.0), r"beta1 = 1.0 is invalid; expected 0 <= beta1 < 1"),
    (sofx.AdamHParams(beta2=-0.1), r"beta2 = -0.1 is invalid"),
    (sofx.AdamHParams(eps=0.0), r"eps = 0.0 is invalid; expected eps > 0"),
    (sofx.AdamHParams(weight_decay=-1.0), r"weight_decay = -1.0 is invalid"),
    (sofx.AdamHParams(lr=float("nan")), r"lr = nan is invalid"),
    (sofx.AdamHParams(lr=torch.tensor([1e-3, 1e-3])), r"lr must be a float or a 0-d tensor, got shape \(2,\)"),
    (sofx.AdamHParams(lr="fast"), r"lr must be a float or a 0-d tensor, got str"),
    (sofx.AdamHParams(lr=2 ** 1100), r"lr = \d+ is invalid; .*beyond the float range"),  # float() would raise
    ({"layers": sofx.AdamHParams(), "head": sofx.AdamHParams(eps=torch.tensor(-1.0))},
     r"hparams for params\['head'\]: eps = -1.0 is invalid"),
    ({"layers": sofx.AdamHParams()}, r"hparams is not a prefix of the structure of params"),
    ({"layers": sofx.AdamHParams(), "head": 0.1}, r"hparams for params\['head'\]: expected an AdamHParams"),
])
def test_invalid_hparams_raise_and_change_nothing(hp, pattern):
    opt, params, grads, state = _setup(1)
    before = _snapshot(params, grads, state)
    with pytest.raises(sofx.SofxError, match=pattern):
        opt.update(params, grads, state, hp, donate=True)
    _assert_unchanged(before, params, grads, state)


@pytest.mark.parametrize("name, value", [("lr", float("inf")), ("lr", float("nan")), ("eps", float("inf")),
                                         ("weight_decay", float("inf")), ("beta1", float("-inf"))])
@pytest.mark.parametrize("where", ["update", "defaults"])
def test_a_non_finite_hparam_is_refused_saying_a_finite_number_is_expected(name, value, where):
    """``lr = inf`` was refused as "expected lr >= 0", a rule inf meets: the message did not say what is wrong
    with it. A non-finite hparam (README: "all finite") is refused saying a finite number is expected, at the
    step and at construction, changing nothing."""
    expected = {"lr": "lr >= 0", "eps": "eps > 0", "weight_decay": "weight_decay >= 0",
                "beta1": "0 <= beta1 < 1"}[name]
    pattern = re.escape(f"{name} = {value!r} is invalid; expected {expected}, a finite number")
    if where == "defaults":
        kwargs = {"betas": (value, 0.999)} if name == "beta1" else {name: value}
        with pytest.raises(sofx.HParamError, match=pattern):
            sofx.adamw(**kwargs)
        return
    opt, params, grads, state = _setup(1)
    before = _snapshot(params, grads, state)
    with pytest.raises(sofx.HParamError, match=pattern):
        opt.update(params, grads, state, sofx.AdamHParams(**{name: value}), donate=True)
    _assert_unchanged(before, params, grads, state)


@pytest.mark.parametrize("name", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("call", ["update", "check_inputs"])
def test_a_meta_tensor_hparam_of_a_leaf_with_data_is_refused_naming_the_leaf(name, call):
    """A 0-d meta tensor as an hparam of a leaf that has data (a meta lr beside CPU parameters) reached torch's
    arithmetic, which raised "RuntimeError: Tensor on device meta is not on the expected device cpu!", naming
    neither the leaf nor the hparam. It is refused naming both, changing nothing; meta parameters (planning a
    state without memory) still take a meta hparam."""
    opt, params, grads, state = _setup(1)
    before = _snapshot(params, grads, state)
    hp = sofx.AdamHParams(**{name: torch.tensor(1e-3, device="meta")})
    with pytest.raises(sofx.HParamError, match=r"hparams for params\[.*\]: " + name + r" is a meta tensor"):
        if call == "update":
            opt.update(params, grads, state, hp, donate=True)
        else:
            opt.check_inputs(params, grads, state, hp)
    _assert_unchanged(before, params, grads, state)
    meta = {"w": torch.empty(3, device="meta")}
    out, _, _ = opt.update(meta, {"w": torch.empty(3, device="meta")}, opt.init(meta), hp)
    assert out["w"].is_meta and out["w"].shape == (3,)


@pytest.mark.parametrize("where, call", [(where, call) for call in ("update", "check_inputs", "undo")
                                         for where in ("params", "grads", "state.mu", "state.nu")
                                         if (where, call) != ("grads", "undo")])  # (undo takes no gradients)
def test_a_nested_tensor_leaf_is_refused_naming_it(where, call):
    """A nested tensor (torch.nested.nested_tensor, strided layout) as a leaf raised torch's "RuntimeError:
    Internal error: NestedTensorImpl doesn't support sizes. Please file an issue." from the leaves' common-case
    check, naming no leaf. It is refused as a LeafError naming its path, changing nothing."""
    opt, params, grads, state = _setup(1)
    new_params, new_state, record = opt.update(params, grads, state)
    p, s = (clone_tree(params), clone_tree(state)) if call != "undo" else (clone_tree(new_params),
                                                                            clone_tree(new_state))
    g = clone_tree(grads)
    with warnings.catch_warnings():  # (torch's warning that nested tensors are a prototype, once per process)
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.randn(2)])
    if where == "params":
        p["head"] = nested
    elif where == "grads":
        g["head"] = nested
    else:
        key = where.split(".")[1]
        s = s._replace(**{key: dict(getattr(s, key), head=nested)})
    before = _snapshot(p["layers"], s.mu["layers"], s.nu["layers"])  # (what donation would write; never nested)
    with pytest.raises(sofx.LeafError, match=re.escape(f"{where}['head']") + r": .*nested"):
        if call == "update":
            opt.update(p, g, s, donate=True)
        elif call == "check_inputs":
            opt.check_inputs(p, g, s)
        else:
            opt.undo(p, s, record, donate=True)
    _assert_unchanged(before, p["layers"], s.mu["layers"], s.nu["layers"])


def test_a_numpy_grad_scale_is_taken_as_the_number_it_holds():
    """grad_scale = np.float32(0.5) (or a numpy integer) was refused as "grad_scale must be a number or a 0-d
    floating-point tensor, got float32" (np.float64, a float subclass, passed): the step takes it as the Python
    number it holds, as the hparams and the loss scale take numpy numbers, bit for bit the float's step."""
    np = pytest.importorskip("numpy")
    opt, params, grads, state = _setup(1)
    want = opt.update(params, grads, state, grad_scale=0.5)
    for gs, value in ((np.float32(0.5), 0.5), (np.float64(0.5), 0.5), (np.int64(2), 2.0)):
        got = opt.update(params, grads, state, grad_scale=gs)
        ref = want if value == 0.5 else opt.update(params, grads, state, grad_scale=value)
        assert trees_equal(got[0], ref[0]) and trees_equal(got[1], ref[1]), gs
    with pytest.raises(sofx.HParamError, match=r"grad_scale must be a number .*, got bool"):
        opt.update(params, grads, state, grad_scale=np.bool_(True))
    with pytest.raises(sofx.HParamError, match=r"grad_scale = -1\.0 is invalid"):
        opt.update(params, grads, state, grad_scale=np.float32(-1.0))



def test_a_numpy_longdouble_hparam_no_float_holds_is_refused_naming_it():
    """A numpy longdouble lr, beta or eps (or grad_scale) with more digits than a float (1/3 in x86's 80 bits) was
    read by as_number as float() of it, rounded without a word, where the checkpoint imports refuse such a value.
    update() and the defaults refuse it naming the hparam and the value, changing nothing; a longdouble a float
    holds exactly (0.5) steps as that float."""
    np = pytest.importorskip("numpy")
    third = np.longdouble(1) / np.longdouble(3)
    if float(third) == third:
        pytest.skip("numpy's longdouble is a double on this platform")
    opt, params, grads, state = _setup(1)
    before = _snapshot(params, grads, state)
    why = r" is invalid: a numpy\.longdouble that no Python float \(a float64\) holds exactly"
    for name, value in (("lr", third * 1e-3), ("beta1", third), ("eps", third * 2 ** -26)):
        assert float(value) != value
        named = rf"^hparams for params\['head'\]: {name} = {re.escape(repr(value))}"
        with pytest.raises(sofx.HParamError, match=named + why):
            opt.update(params, grads, state, sofx.AdamHParams(**{name: value}), donate=True)
        with pytest.raises(sofx.HParamError, match=rf"^defaults: {name}.*{why}"):
            sofx.adamw(**({"betas": (value, 0.999)} if name == "beta1" else {name: value}))
    with pytest.raises(sofx.HParamError, match=rf"^grad_scale = .*{why}"):
        opt.update(params, grads, state, grad_scale=third, donate=True)
    _assert_unchanged(before, params, grads, state)
    got = opt.update(params, grads, state, sofx.AdamHParams(lr=np.longdouble(0.5)))
    want = opt.update(params, grads, state, sofx.AdamHParams(lr=0.5))
    assert trees_equal(got[0], want[0]) and trees_equal(got[1], want[1])


@pytest.mark.parametrize("make, kind", [
    (lambda np: np.float16(1e-8), "float16"), (lambda np: torch.tensor(1e-8, dtype=torch.float16), "float16"),
    (lambda np: np.float32(1e-50), "float32")])
def test_an_eps_that_rounds_to_0_in_its_dtype_is_refused_saying_so(make, kind):
    """eps=np.float16(1e-8) (a float16 eps is taken, only added) holds 0: it was refused as "eps = 0.0 is
    invalid; expected eps > 0", a value the caller never wrote. The refusal says it was given as a float16 number
    that holds 0, where a value below half its least positive value rounds to 0, at a step and at construction (the
    offload optimizer's too)."""
    np = pytest.importorskip("numpy")
    eps = make(np)
    why = rf"eps = 0\.0 is invalid; expected eps > 0: given as a {kind} number .*, which holds 0 \(an eps below "
    opt, params, grads, state = _setup(1)
    before = _snapshot(params, grads, state)
    with pytest.raises(sofx.HParamError, match=rf"^hparams for params\['head'\]: {why}.* rounds to 0 in {kind}"):
        opt.update(params, grads, state, sofx.AdamHParams(eps=eps), donate=True)
    _assert_unchanged(before, params, grads, state)
    with pytest.raises(sofx.HParamError, match=rf"^defaults: {why}"):
        sofx.adamw(eps=eps)
    with pytest.raises(sofx.HParamError, match=rf"^defaults\['eps'\] = 0\.0 is invalid; expected eps > 0: given as"):
        sofx.offload.SpeculativeAdamW(torch.nn.Linear(2, 2).parameters(), eps=eps)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_eps_given_as_a_numpy_array_is_refused_as_no_number(dtype):
    """The check of an eps that holds 0 in its dtype took a numpy array of float32 or float16 (its dtype known) for a
    number: ``np.array([1e-8, 1e-8], dtype=np.float32)`` raised numpy's bare ValueError "The truth value of an array
    with more than one element is ambiguous" from update and the offload facade, and one of a single element that
    holds 0 was said to be "given as a float16 number". Refused as any array: no number."""
    np = pytest.importorskip("numpy")
    opt, params, grads, state = _setup(1)
    before = _snapshot(params, grads, state)
    for eps in (np.array([1e-8, 1e-8], dtype=dtype), np.array([1e-8], dtype=dtype)):
        with pytest.raises(sofx.HParamError, match=r"^hparams for params\['head'\]: eps must be a float or a 0-d "
                                                   r"tensor, got ndarray"):
            opt.update(params, grads, state, sofx.AdamHParams(eps=eps), donate=True)
        with pytest.raises(sofx.HParamError, match=r"^defaults\['eps'\] = array\(.* is invalid; expected a finite "
                                                   r"number \(a Python or numpy number, or a 1-element tensor\), got "
                                                   r"ndarray"):
            sofx.offload.SpeculativeAdamW(torch.nn.Linear(2, 2).parameters(), eps=eps, executor="inline")
    _assert_unchanged(before, params, grads, state)


def test_a_meta_grad_scale_of_leaves_with_data_is_refused():
    """A meta 0-d grad_scale beside parameters with data reached torch's arithmetic ("Tensor on device meta is not
    on the expected device cpu!"); it is refused naming grad_scale, changing nothing."""
    opt, params, grads, state = _setup(1)
    before = _snapshot(params, grads, state)
    with pytest.raises(sofx.HParamError, match=r"grad_scale is a meta tensor"):
        opt.update(params, grads, state, grad_scale=torch.tensor(0.5, device="meta"), donate=True)
    _assert_unchanged(before, params, grads, state)


@pytest.mark.parametrize("call", ["update", "check_inputs", "undo_strategies", "undo"])
def test_a_meta_step_count_of_a_leaf_with_data_is_refused_naming_the_leaf(call):
    """A meta step count beside a leaf with data (a state made by ``opt.init`` under ``with torch.device("meta")``:
    its counts meta, its moments like the parameters) was taken as a count whose value cannot be read, and reached
    torch's arithmetic in the kernel ("RuntimeError: Tensor on device meta is not on the expected device cpu!"),
    naming no leaf; an undo took it and restored the record's. It is refused naming the count's path, changing
    nothing; meta parameters still take meta counts."""
    opt, params, grads, state = _setup(1)
    new_params, new_state, record = opt.update(params, grads, state)
    meta_count = lambda s: s._replace(count=sofx.tree.tree_map(lambda c: c.to("meta"), s.count))  # noqa: E731
    before = _snapshot(params, grads, state)
    with pytest.raises(sofx.LeafError, match=r"state\.count\[.*\]: .*meta"):
        if call == "undo":
            opt.undo(new_params, meta_count(new_state), record, donate=True)
        else:
            getattr(opt, call)(params, grads, meta_count(state), **({"donate": True} if call == "update" else {}))
    _assert_unchanged(before, params, grads, state)
    assert not record.used
    meta = {"w": torch.empty(3, device="meta")}
    _, out, _ = opt.update(meta, {"w": torch.empty(3, device="meta")}, meta_count(opt.init(meta)))
    assert out.count["w"].is_meta


def test_undo_strategies_refuses_a_leaf_its_backend_does_not_support_as_update_does():
    """``undo_strategies`` ("checks the inputs as update does and raises the same errors"; the speculation layer
    plans a block with it) chose a strategy for a leaf the optimizer's backend does not support (float64
    parameters for backend='cpu'), which update then refused. It raises update's UnsupportedError naming the
    leaf."""
    opt = sofx.adamw(backend="cpu")
    params = {"w": torch.randn(3, dtype=torch.float64)}
    grads = {"w": torch.randn(3, dtype=torch.float64)}
    state = opt.init(params)
    pattern = r"params\['w'\]: backend 'cpu' does not support .* param dtype torch.float64"
    with pytest.raises(sofx.UnsupportedError, match=pattern):
        opt.update(params, grads, state)
    with pytest.raises(sofx.UnsupportedError, match=pattern):
        opt.undo_strategies(params, grads, state)
    assert opt.undo_strategies(params, {"w": None}, state) == [None]  # (not stepped: no backend asked)


def test_invalid_defaults_and_options_are_refused_at_construction():
    with pytest.raises(sofx.HParamError, match="betas must be a pair"):
        sofx.adamw(betas=(0.9,))
    with pytest.raises(sofx.HParamError, match="eps = -1"):
        sofx.adam(eps=-1)
    with pytest.raises(sofx.UnsupportedError, match="undo='sometimes'"):
        sofx.adamw(undo="sometimes")
    with pytest.raises(sofx.UnsupportedError, match="unknown backend 'gpu'"):
        opt = sofx.adamw(backend="gpu")
        params = {"w": torch.randn(2)}
        opt.update(params, params, opt.init(params))
    with pytest.raises(sofx.HParamError, match="grad_scale = -1.0 is invalid; expected a finite value >= 0"):
        opt = sofx.adamw()
        params = {"w": torch.randn(2)}
        opt.update(params, params, opt.init(params), grad_scale=-1.0)


def test_adam_flags_are_python_or_numpy_bools():
    """sofx.adam(bias_correction="no") was taken as bias correction on (Adam(decoupled="no") as AdamW): a numpy
    bool is stored as a Python bool, anything else is refused naming the option."""
    np = pytest.importorskip("numpy")
    opt = sofx.adam(bias_correction=np.bool_(False))
    assert opt.variant == (False, False) and type(opt.variant.bias_correction) is bool
    assert sofx.Adam(opt.defaults, decoupled=np.bool_(True)).variant == (True, True)
    for bad, kind in (("no", "str"), (0, "int"), (None, "NoneType")):
        with pytest.raises(sofx.UnsupportedError, match=rf"bias_correction = .* is invalid; expected a bool .*got "
                                                        rf"{kind}"):
            sofx.adamw(bias_correction=bad)
        with pytest.raises(sofx.UnsupportedError, match=rf"decoupled = .* is invalid; expected a bool .*got {kind}"):
            sofx.Adam(opt.defaults, decoupled=bad)


def test_a_torch_option_without_a_truth_value_is_refused_naming_it():
    """amsgrad, maximize, differentiable or decoupled_weight_decay given a tensor (or numpy array) of two elements,
    which has no truth value, raised torch's bare RuntimeError ('Boolean value of Tensor with more than one value is
    ambiguous') from sofx.adam/adamw and the offload facade, as from_torch_optim did before bcc1570: refused naming
    the option and its value, as a value that is not torch's default False is."""
    two = torch.tensor([True, False])
    for make, keys in ((sofx.adam, ("amsgrad", "maximize", "decoupled_weight_decay")),
                       (sofx.adamw, ("amsgrad", "maximize"))):
        for key in keys:
            with pytest.raises(sofx.UnsupportedError,
                               match=rf"^sofx\.{make.__name__}: {key}=tensor\(\[ True, False\]\) is"):
                make(**{key: two})
    for cls in (sofx.offload.SpeculativeAdam, sofx.offload.SpeculativeAdamW):
        for key in ("amsgrad", "maximize", "differentiable", "decoupled_weight_decay"):
            with pytest.raises(sofx.UnsupportedError, match=rf"^defaults\['{key}'\] = tensor\(\[ True, False\]\)"):
                cls(torch.nn.Linear(2, 2).parameters(), executor="inline", **{key: two})


def test_check_inputs_flags_are_python_or_numpy_bools():
    """check_inputs read zero_missing and check_undo by their truth: zero_missing="no" checked every leaf without
    gradient as stepped with zeros (refusing hparams of leaves update leaves alone), check_undo="no" checked the
    undo it says not to. Refused naming the option, as update refuses undoable="no"; numpy bools are bools."""
    np = pytest.importorskip("numpy")
    opt, params, grads, state = _setup()
    for name in ("zero_missing", "check_undo"):
        for bad, kind in (("no", "str"), (0, "int"), (None, "NoneType")):
            with pytest.raises(sofx.UnsupportedError, match=rf"^{name} = .* is invalid; expected a bool .*got {kind}"):
                opt.check_inputs(params, grads, state, **{name: bad})
        opt.check_inputs(params, grads, state, **{name: np.bool_(False)})


@pytest.mark.parametrize("make", [sofx.adam, sofx.adamw], ids=["adam", "adamw"])
def test_torch_optims_amsgrad_and_maximize_are_refused_set_and_accepted_at_their_default(make):
    """torch.optim.Adam/AdamW's amsgrad and maximize (a bare TypeError before): True is refused by name, as the
    offload facade refuses it; False (torch's default) is accepted, amsgrad in torch's positional place too."""
    name = make.__name__
    for kwargs in ({"amsgrad": True}, {"maximize": True}, {"maximize": 1}):
        key, value = next(iter(kwargs.items()))
        with pytest.raises(sofx.UnsupportedError, match=rf"sofx\.{name}: {key}={value!r} is not supported \(only "
                                                        r"torch.optim's default, False\)"):
            make(**kwargs)
    with pytest.raises(sofx.UnsupportedError, match="amsgrad=True"):
        make(1e-3, (0.9, 0.999), 1e-8, 0.0, True)
    params = {"w": torch.randn(5)}
    grads = {"w": torch.randn(5)}
    want = make(lr=1e-2).update(params, grads, make(lr=1e-2).init(params))[0]
    got = make(1e-2, (0.9, 0.999), 1e-8, make().defaults.weight_decay, False, maximize=False).update(
        params, grads, make().init(params))[0]
    assert trees_equal(got, want)
    for cls in (sofx.offload.SpeculativeAdam, sofx.offload.SpeculativeAdamW):
        for kwargs in ({"amsgrad": True}, {"maximize": True}):
            with pytest.raises(sofx.UnsupportedError, match=rf"{next(iter(kwargs))} is not supported"):
                cls(torch.nn.Linear(2, 2).parameters(), executor="inline", **kwargs)


@pytest.mark.parametrize("make", [sofx.adam, sofx.adamw], ids=["adam", "adamw"])
def test_torch_optims_implementation_options_are_accepted_and_ignored(make):
    """torch.optim.Adam/AdamW's foreach, fused, capturable and differentiable (a bare TypeError before): any
    value is accepted and changes nothing (the functional update has one implementation and is differentiable
    anyway, README; the offload facade, a torch.optim.Optimizer, refuses the combinations torch refuses);
    Adam's decoupled_weight_decay=True is AdamW: refused, as the facade refuses a group's other than its class's."""
    params = {"w": torch.randn(5)}
    grads = {"w": torch.randn(5)}
    want = make(lr=1e-2).update(params, grads, make(lr=1e-2).init(params))[0]
    for kwargs in ({"foreach": True, "fused": False, "capturable": False, "differentiable": False},
                   {"foreach": False, "fused": True, "capturable": True, "differentiable": True},
                   {"foreach": None, "fused": None}):
        opt = make(lr=1e-2, **kwargs)
        assert trees_equal(opt.update(params, grads, opt.init(params))[0], want)
    if make is sofx.adam:
        with pytest.raises(sofx.UnsupportedError, match=r"sofx\.adam: decoupled_weight_decay=True is AdamW's "
                                                        r"decoupled weight decay; use sofx\.adamw"):
            make(decoupled_weight_decay=True)
        assert make(decoupled_weight_decay=False).variant.decoupled is False
    else:
        with pytest.raises(TypeError):  # (not an option of torch.optim.AdamW either)
            make(decoupled_weight_decay=True)


# torch.optim.Adam's on/off options given values that are no flag; torch takes each by its truth ("False" and 2
# set, 0.0 not) but differentiable, which its step hands to set_grad_enabled (a TypeError for any but a bool)
_NO_FLAGS = [("amsgrad", "False"), ("maximize", "no"), ("foreach", "False"), ("fused", "True"), ("capturable", 0.0),
             ("differentiable", "False"), ("differentiable", None), ("differentiable", 0),
             ("decoupled_weight_decay", "False"), ("amsgrad", 2), ("maximize", torch.tensor(False))]


@pytest.mark.parametrize("make", [sofx.adam, sofx.adamw], ids=["adam", "adamw"])
@pytest.mark.parametrize("key, value", _NO_FLAGS, ids=[f"{k}={v!r}" for k, v in _NO_FLAGS])
def test_a_torch_option_that_is_no_flag_is_refused_naming_it(make, key, value):
    """sofx.adam/adamw took torch.optim's flags by their truth or not at all: decoupled_weight_decay="False" was
    refused as 'is AdamW's decoupled weight decay; use sofx.adamw', amsgrad="False" as 'not supported (only
    torch.optim's default, False)', and foreach="False", differentiable="False" or None were taken without a word
    (torch's step refuses a differentiable that is no bool). Each is refused naming the option and its value; None,
    a bool (numpy's too) and 0 or 1 are flags, taken as torch takes them, but for differentiable, a Python bool
    only (torch.set_grad_enabled(np.False_) is a TypeError at torch's step)."""
    np = pytest.importorskip("numpy")
    if key == "decoupled_weight_decay" and make is sofx.adamw:
        return  # (no option of sofx.adamw, nor of torch.optim.AdamW)
    want = "True or False" if key == "differentiable" else "True, False or None"  # (None: torch picks)
    with pytest.raises(sofx.UnsupportedError, match=rf"^sofx\.{make.__name__}: {key}={re.escape(repr(value))} is "
                                                    rf"no flag; expected {want}$"):
        make(**{key: value})
    for taken in ((0, np.bool_(False), False) if key in ("amsgrad", "maximize", "decoupled_weight_decay") else
                  (True, False) if key == "differentiable" else (None, 1, np.bool_(True))):
        assert make(**{key: taken}).variant.decoupled is (make is sofx.adamw)
    if key == "differentiable":
        with pytest.raises(sofx.UnsupportedError, match=rf"^sofx\.{make.__name__}: differentiable=np\.False_ is no "
                                                        r"flag; expected True or False$"):
            make(differentiable=np.bool_(False))


@pytest.mark.parametrize("make, torch_cls", [(sofx.adam, torch.optim.Adam), (sofx.adamw, torch.optim.AdamW)],
                         ids=["adam", "adamw"])
@pytest.mark.parametrize("betas", [
    pytest.param(lambda: (torch.tensor([0.8]), torch.tensor([[0.99]])), id="1-element tensors"),
    pytest.param(lambda: torch.tensor([0.8, 0.99]), id="a 2-element tensor"),
    pytest.param(lambda: __import__("numpy").array([0.8, 0.99]), id="a float64 numpy array"),
])
def test_betas_torch_takes_are_taken_as_torch_stores_them_and_step_as_torch(make, torch_cls, betas):
    """torch.optim.Adam/AdamW take ``betas`` as a pair of 1-element tensors (squeezed to 0-d), or a 2-element
    tensor or numpy array (its two items); sofx.adam/adamw refused all three ("a float or a 0-d tensor", "a
    pair"). Taken, the defaults hold torch's stored betas, and steps follow torch's (to float32 rounding: torch
    computes with the float32 tensors, sofx with their values)."""
    opt = make(lr=1e-2, betas=betas(), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, generator=gen))
    ref = torch_cls([w], lr=1e-2, betas=betas(), weight_decay=0.1, foreach=False)
    stored = ref.param_groups[0]["betas"]
    for got, want in zip((opt.defaults.beta1, opt.defaults.beta2), stored):
        assert type(got) is type(want)
        assert got.shape == want.shape and torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
    params = {"w": w.detach().clone()}
    state = opt.init(params)
    for step in range(4):
        grads = {"w": torch.randn(6, generator=gen)}
        params, state, _ = opt.update(params, grads, state)
        w.grad = grads["w"].clone()
        ref.step()
        assert max_rel_err(params["w"], w.detach()) <= 1e-6 * (step + 1)


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_grad_scale_beyond_float32_is_refused_and_changes_nothing(backend, donate):
    """A grad_scale that is inf in float32 (where the kernels multiply by it) would write nan that the checked step
    does not see (an algebraic record whose undo gives nan): refused, in update and in undo_redo; the largest
    float32 and a 0-d tensor are read as numbers."""
    _, params, grads, _ = _setup(3)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    state = opt.init(params)
    p1, s1, record = opt.update(params, grads, state)
    before = _snapshot(params, grads, state, p1, s1)
    for scale in (3.5e38, torch.tensor(1e39, dtype=torch.float64)):
        with pytest.raises(sofx.HParamError, match=r"grad_scale = .* is beyond float32's range .*; params\['head'\] "
                                                   "is stepped in float32"):
            opt.update(params, grads, state, grad_scale=scale, donate=donate)
        with pytest.raises(sofx.HParamError, match=r"grad_scale = .* is beyond float32's range"):
            opt.undo_redo(p1, s1, record, grads, grad_scale=scale, donate=donate)
    _assert_unchanged(before, params, grads, state, p1, s1)
    tiny = sofx.tree.tree_map(lambda g: g * 1e-30, grads)
    p2, s2, rec2 = opt.update(params, tiny, state, grad_scale=torch.finfo(torch.float32).max)
    assert all(bool(t.isfinite().all()) for t in sofx.tree.flatten(p2)[0])
    p3, _ = opt.undo(p2, s2, rec2)
    assert all((a - b).abs().max() <= 1e-6 for a, b in zip(sofx.tree.flatten(p3)[0], sofx.tree.flatten(params)[0]))
    if backend == "reference":  # float64 leaves are stepped in float64, where such a scale is a number like others
        wide = {"w": torch.randn(5, dtype=torch.float64)}
        tiny64 = {"w": torch.randn(5, dtype=torch.float64) * 1e-300}
        st64 = opt.init(wide)
        new, st1, rec = opt.update(wide, tiny64, st64, grad_scale=1e300)
        assert bool(new["w"].isfinite().all()) and not torch.equal(new["w"], wide["w"])
        assert torch.allclose(opt.undo(new, st1, rec)[0]["w"], wide["w"], rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
@pytest.mark.parametrize("hp, name", [(AdamHParams(lr=1e39), "lr"), (AdamHParams(weight_decay=1e39), "weight_decay"),
                                      (AdamHParams(eps=1e-46), "eps"), (AdamHParams(eps=2.0 ** -150), "eps")])
def test_hparams_float32_cannot_hold_are_refused_where_a_leaf_is_stepped_in_float32(backend, hp, name):
    """An lr or weight_decay beyond float32's largest value (inf there) or an eps that rounds to 0 (0/0 where a
    moment is 0) wrote nan on the native backends (the reference raised torch's overflow error): refused naming
    the leaf, nothing written; float64 leaves are stepped in float64, where they are numbers like others."""
    _, params, grads, _ = _setup(3)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    state = opt.init(params)
    before = _snapshot(params, grads, state)
    with pytest.raises(sofx.HParamError, match=rf"hparams for params\['\w+'\]: {name} = .* is beyond float32's "
                                               "range .*is stepped in float32"):
        opt.update(params, grads, state, hp, donate=True)
    _assert_unchanged(before, params, grads, state)
    # a leaf stepped with a zero gradient (missing_grad="zero") too: check_inputs passed it, and a speculative
    # step wrote the other leaves before update refused it
    only_head = {"layers": AdamHParams(), "head": hp}
    no_head = {**grads, "head": None}
    with pytest.raises(sofx.HParamError, match=rf"hparams for params\['head'\]: {name} = .* is beyond float32's"):
        opt.check_inputs(params, no_head, state, only_head, zero_missing=True)
    opt.check_inputs(params, no_head, state, only_head)  # not stepped: not checked
    smallest = AdamHParams(eps=2.0 ** -149)  # float32's smallest subnormal: a number there
    opt.update(params, grads, state, smallest)
    if backend == "reference":
        wide = {"w": torch.randn(5, dtype=torch.float64)}
        opt.update(wide, {"w": torch.randn(5, dtype=torch.float64)}, opt.init(wide), hp)


def test_undo_with_a_record_of_another_state_or_twice_raises_and_changes_nothing():
    opt, params, grads, state = _setup(2)
    p1, s1, rec1 = opt.update(params, grads, state)
    p2, s2, rec2 = opt.update(p1, grads, s1)
    before = _snapshot(p2, s2)
    # the record of step 2 applied to the state after step 1: counts differ
    with pytest.raises(sofx.UndoError,
                       match=r"params\['head'\]: the state's step count is 2, the record undoes step 3"):
        opt.undo(p1, s1, rec2)
    # a record for another structure
    other = {"w": torch.randn(3)}
    _, _, other_rec = opt.update(other, other, opt.init(other))
    with pytest.raises(sofx.UndoError, match=r"the record was made for params of another structure: params has "
                                             r"entries \['head', 'layers'\], expected \['w'\]"):
        opt.undo(p2, s2, other_rec)
    with pytest.raises(sofx.UndoError, match="expected an UndoRecord"):
        opt.undo(p2, s2, "not a record")
    p1b, s1b = opt.undo(p2, s2, rec2, donate=False)
    with pytest.raises(sofx.UndoError, match="already used"):
        opt.undo(p2, s2, rec2, donate=True)
    _assert_unchanged(before, p2, s2)
    assert trees_equal(s1b.count, s1.count)



@pytest.mark.skipif(not hasattr(sys, "get_int_max_str_digits"), reason="this Python writes ints of any size in decimal")
def test_a_record_of_another_structure_with_a_huge_int_key_is_named():
    """The structure mismatch names both specs; a dict key whose decimal text Python refuses (more digits than
    ``sys.get_int_max_str_digits()``) raised that ValueError from the message instead."""
    opt = sofx.adamw(lr=1e-2)
    huge = {10 ** 5000: torch.randn(3)}
    _, _, rec = opt.update(huge, {10 ** 5000: torch.randn(3)}, opt.init(huge))
    other = {"w": torch.randn(3)}
    state = opt.init(other)
    with pytest.raises(sofx.UndoError,
                       match=r"\(the record's: PyTreeSpec\(a dict of 1 leaf\), params: PyTreeSpec\(\{'w'"):
        opt.undo(other, state, rec)

@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("method", ["undo", "undo_redo"])
def test_a_snapshot_record_of_params_of_another_dtype_raises_and_changes_nothing(donate, method):
    """A record of a tree of the same structure and step counts whose leaves have other dtypes (bf16
    parameters' ``param_snapshot``, or a ``snapshot`` kept for an inf, where these are fp32) was applied: its
    snapshots cast into these leaves (donated) or returned as they were, in another dtype."""
    gen = torch.Generator().manual_seed(3)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32)

    def tree(dtype):
        return {"a": torch.randn(64, generator=gen).to(dtype), "b": torch.randn(64, generator=gen).to(dtype)}

    low, params = tree(torch.bfloat16), tree(torch.float32)
    grads_low = tree(torch.bfloat16)
    grads_low["a"][3] = float("inf")  # a whole snapshot for "a"; "b" a param_snapshot (bf16 parameters)
    _, _, rec = opt.update(low, grads_low, opt.init(low))
    assert rec.strategies() == ["snapshot", "param_snapshot"]
    grads = tree(torch.float32)
    params, state, _ = opt.update(params, grads, opt.init(params))
    before = _snapshot(params, state)
    args = (grads, None) if method == "undo_redo" else ()
    with pytest.raises(sofx.UndoError, match=r"params\['a'\]: the record keeps \(64,\) torch.bfloat16 on cpu of p; "
                                             r"this leaf's p is \(64,\) torch.float32"):
        getattr(opt, method)(params, state, rec, *args, donate=donate)
    _assert_unchanged(before, params, state)
    params["a"] = params["a"].to(torch.bfloat16)  # "a" fits now (fp32 moments both); "b" does not
    grads["a"] = grads["a"].to(torch.bfloat16)
    with pytest.raises(sofx.UndoError, match=r"params\['b'\]: the record keeps \(64,\) torch.bfloat16 on cpu of p"):
        getattr(opt, method)(params, state, rec, *args, donate=donate)


@pytest.mark.parametrize("method", ["undo", "undo_redo"])
@pytest.mark.parametrize("value", [lambda t: None, lambda t: t.tolist()], ids=["None", "list"])
def test_a_record_whose_gradient_a_transform_replaced_is_refused_by_name(method, value):
    """A record is a pytree whose tensors a transform may replace by any values (torch's tree_map to None, to
    lists); undo and undo_redo of such a record raised a bare AttributeError ('NoneType' object has no attribute
    'storage_offset', 'list' object has no attribute 'shape'). An UndoError names the leaf, and nothing changes."""
    import torch.utils._pytree as torch_pytree

    gen = torch.Generator().manual_seed(5)
    opt = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(8, generator=gen), "b": torch.randn(8, generator=gen)}
    grads = {k: torch.randn(8, generator=gen) for k in params}
    p1, s1, rec = opt.update(params, grads, opt.init(params))
    mapped = torch_pytree.tree_map(lambda t: value(t) if isinstance(t, torch.Tensor) and t.dim() else t, rec)
    before = _snapshot(p1, s1)
    args = (grads, None) if method == "undo_redo" else ()
    with pytest.raises(sofx.UndoError, match=r"params\['a'\]: the record's gradient is a (NoneType|list), not a "
                                             r"tensor"):
        getattr(opt, method)(p1, s1, mapped, *args)
    _assert_unchanged(before, p1, s1)


@pytest.mark.parametrize("method", ["undo", "undo_redo"])
def test_a_record_whose_count_a_transform_replaced_is_refused_by_name(method):
    """A record's step count (count_before) that a tree_map replaced by a list was restored as the state's count
    by undo (state.count['a'] = [1, 2], refused only by the next update) and added to by undo_redo (a bare
    TypeError). An UndoError names the leaf; a Python int (a transform's number) is still taken by undo."""
    import torch.utils._pytree as torch_pytree

    gen = torch.Generator().manual_seed(6)
    opt = sofx.adamw(lr=1e-2)
    params = {"a": torch.randn(8, generator=gen), "b": torch.randn(8, generator=gen)}
    grads = {k: torch.randn(8, generator=gen) for k in params}
    p1, s1, rec = opt.update(params, grads, opt.init(params))
    args = (grads, None) if method == "undo_redo" else ()
    counts = lambda f: lambda t: f(t) if isinstance(t, torch.Tensor) and t.dtype == torch.int64 else t  # noqa: E731
    listed = torch_pytree.tree_map(counts(lambda t: [1, 2]), rec)
    before = _snapshot(p1, s1)
    with pytest.raises(sofx.UndoError, match=r"params\['a'\]: the record's count_before is a list, expected the "
                                             r"step count"):
        getattr(opt, method)(p1, s1, listed, *args)
    _assert_unchanged(before, p1, s1)
    if method == "undo":
        numbers = torch_pytree.tree_map(counts(lambda t: int(t)), rec)
        assert int(opt.undo(p1, s1, numbers)[1].count["a"]) == 0


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("method", ["undo", "undo_redo"])
def test_an_algebraic_record_of_params_of_another_dtype_raises_and_changes_nothing(donate, method):
    """An algebraic record (nothing kept but the gradient) of fp32 parameters applied to bf16 parameters of the
    same structure, step counts and fp32 moments was inverted silently: a bf16 parameter, which
    undo='algebraic' refuses to step because its rounding cannot be inverted."""
    gen = torch.Generator().manual_seed(4)
    opt = sofx.adamw(lr=1e-2, state_dtype=torch.float32, undo="algebraic")
    params = {"a": torch.randn(64, generator=gen), "b": torch.randn(64, generator=gen)}
    grads = sofx.tree.tree_map(lambda t: torch.randn(t.shape, generator=gen), params)
    p1, s1, rec = opt.update(params, grads, opt.init(params))
    assert rec.strategies() == ["algebraic", "algebraic"]
    low = {"a": p1["a"], "b": p1["b"].to(torch.bfloat16)}
    before = _snapshot(low, s1)
    args = ({"a": grads["a"], "b": grads["b"].to(torch.bfloat16)}, None) if method == "undo_redo" else ()
    with pytest.raises(sofx.UndoError, match=r"params\['b'\]: the record's gradient is torch.float32 on cpu, the "
                                             r"parameter torch.bfloat16 on cpu: the record is not of these params"):
        getattr(opt, method)(low, s1, rec, *args, donate=donate)
    _assert_unchanged(before, low, s1)
    opt.undo(p1, s1, rec)  # the record was not used


def test_an_unknown_backend_is_refused_at_construction():
    """An unknown backend was taken by the constructor and failed only at the first step (the offload engine
    then stopped for good)."""
    for backend in ("gpu", None, "Auto"):
        with pytest.raises(sofx.UnsupportedError, match=f"unknown backend {backend!r}; expected one of"):
            sofx.adamw(backend=backend)
    assert sofx.adam(backend="reference").backend == "reference"


@pytest.mark.skipif(not hasattr(sys, "get_int_max_str_digits"), reason="this Python writes ints of any size in decimal")
def test_a_dict_key_too_long_for_decimal_text_is_stepped_and_named_in_hex():
    """An int key of more digits than Python writes in decimal (``sys.get_int_max_str_digits()``): init and
    update work, and an error about its leaf names it by its hex path and changes nothing."""
    huge = 10 ** 5000
    gen = torch.Generator().manual_seed(1)
    params = {huge: torch.randn(3, generator=gen), "b": torch.randn(2, generator=gen)}
    grads = {huge: torch.randn(3, generator=gen), "b": torch.randn(2, generator=gen)}
    opt = sofx.adamw(lr=1e-2)
    state = opt.init(params)
    new_p, new_s, _ = opt.update(params, grads, state)
    ref_p, ref_s, _ = opt.update({"a": params[huge], "b": params["b"]}, {"a": grads[huge], "b": grads["b"]},
                                 opt.init({"a": params[huge], "b": params["b"]}))
    assert torch.equal(new_p[huge], ref_p["a"]) and torch.equal(new_s.nu[huge], ref_s.nu["a"])
    before = _snapshot(new_p, grads, new_s)
    with pytest.raises(sofx.LeafError, match=rf"^grads\[{hex(huge)}\]: expected shape \(3,\), got \(4,\)"):
        opt.update(new_p, {**grads, huge: torch.randn(4)}, new_s)
    with pytest.raises(sofx.StructureError, match=rf"\(grads has entries \[{hex(huge)}\], expected \["):
        opt.update(new_p, {huge: grads[huge]}, new_s)
    _assert_unchanged(before, new_p, grads, new_s)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_numpy_hparams_are_taken_as_the_python_numbers_they_hold(backend):
    """AdamHParams(lr=np.float32(1e-3)) was refused ("lr must be a float or a 0-d tensor, got float32"), as
    sofx.adamw(lr=np.float32(...)) was, where torch.optim takes numpy numbers (and sofx's schedules and the offload
    facade did); a numpy float64 was taken and handed to the kernels as a numpy number. Numpy reals (floating and
    integer scalars) are read as Python numbers where hparams are read: defaults and a step's hparams step
    bitwise as the Python numbers they hold, and what reaches the kernels is a Python float or int. A numpy bool is
    no number, and a numpy value out of range is refused as a Python one."""
    np = pytest.importorskip("numpy")
    lr32, b2 = np.float32(3e-2), np.float32(0.99)
    numpy_hp = AdamHParams(lr=lr32, beta1=np.float64(0.8), beta2=b2, eps=np.float16(1e-3), weight_decay=np.int64(1))
    plain_hp = AdamHParams(lr=float(lr32), beta1=0.8, beta2=float(b2), eps=float(np.float16(1e-3)), weight_decay=1)
    opt, params, grads, state = _setup(2)
    numpy_opt = sofx.adamw(lr=lr32, betas=(np.float64(0.8), b2), eps=np.float16(1e-3), weight_decay=np.int64(1),
                           backend=backend)
    plain_opt = sofx.adamw(lr=float(lr32), betas=(0.8, float(b2)), eps=float(np.float16(1e-3)), weight_decay=1,
                           backend=backend)
    assert numpy_opt.defaults == plain_opt.defaults  # (kept as given, as torch.optim keeps its group's values)
    spec = sofx.tree.flatten(params)[1]
    for hp in (None, numpy_hp, AdamHParams(lr=lr32)):  # (None: the numpy defaults, read at each step)
        assert all(type(x) in (float, int) for full in numpy_opt.resolve_hparams(hp, spec) for x in full)
    for (o, hp), (q, want_hp) in (((numpy_opt, None), (plain_opt, None)),
                                  ((opt, numpy_hp), (opt, plain_hp))):
        got = o.update(clone_tree(params), grads, clone_tree(state), hp)[:2]
        want = q.update(clone_tree(params), grads, clone_tree(state), want_hp)[:2]
        assert trees_equal(got, want)
    for hp, pattern in ((AdamHParams(beta1=np.bool_(False)), r"beta1 must be a float or a 0-d tensor, got bool"),
                        (AdamHParams(lr=np.float32(-1.0)), r"lr = -1\.0 is invalid; expected lr >= 0"),
                        (AdamHParams(eps=np.float64("nan")), r"eps = nan is invalid")):
        with pytest.raises(sofx.HParamError, match=pattern):
            opt.update(params, grads, state, hp)
        with pytest.raises(sofx.HParamError, match=pattern):
            sofx.Adam(hp, decoupled=True)


@pytest.mark.parametrize("value, dtype", [(torch.tensor(True), "torch.bool"),
                                          (torch.tensor(1e-3 + 0j), "torch.complex64")])
@pytest.mark.parametrize("where", ["update", "sofx.adamw", "hparams_schedule"])
def test_a_bool_or_complex_tensor_hparam_is_refused_naming_its_dtype(value, dtype, where):
    """lr=torch.tensor(True) was refused at the step as "got bool" and taken at construction (its value True, 1 in
    range), then refused at every step as the same bool; lr=torch.tensor(1e-3+0j) was "got complex" at the step,
    and at construction torch's bare TypeError ("'<' not supported between instances of 'float' and 'complex'").
    Refused everywhere, naming the tensor it is: its dtype and shape."""
    pattern = rf"lr must be a float or a 0-d tensor of a real dtype, got a {dtype} tensor of shape \(\)"
    opt, params, grads, state = _setup(1)
    before = _snapshot(params, grads, state)
    with pytest.raises(sofx.HParamError, match=pattern):
        if where == "update":
            opt.update(params, grads, state, AdamHParams(lr=value), donate=True)
        elif where == "sofx.adamw":
            sofx.adamw(lr=value)
        else:
            sofx.schedules.hparams_schedule(lr=value)
    _assert_unchanged(before, params, grads, state)


@pytest.mark.parametrize("hp, pattern", [
    (AdamHParams(beta1=1.0), r"^algebraic_refusal: beta1 = 1.0 is invalid; expected 0 <= beta1 < 1"),
    (AdamHParams(lr="fast"), r"^algebraic_refusal: lr must be a float or a 0-d tensor, got str"),
    (AdamHParams(lr=float("nan"), weight_decay=1.0), r"^algebraic_refusal: lr = nan is invalid")])
def test_algebraic_refusal_of_hparams_update_refuses_is_that_refusal(hp, pattern):
    """algebraic_refusal says what update would raise, for callers that check hparams before the tensors; of hparams
    that update refuses (a beta of 1, a string lr, a nan lr) it returned None: "algebraic undo is possible". Refused
    as update refuses them, an HParamError naming the value."""
    opt, params, grads, state = _setup(1)
    alg = sofx.adamw(undo="algebraic")
    with pytest.raises(sofx.HParamError, match=pattern):
        alg.algebraic_refusal(hp)
    with pytest.raises(sofx.HParamError, match=pattern.replace("^algebraic_refusal", r"^hparams for params\[.*?\]")):
        alg.update(params, grads, alg.init(params), hp)
    assert alg.algebraic_refusal(AdamHParams(beta1=0.5)) is None


def test_half_precision_hparams_that_torch_computes_with_in_their_precision_are_refused_naming_them():
    """lr=np.float16(1e-3): numpy keeps float16 in torch's arithmetic (NEP 50), so torch's for-loop AdamW computed
    1 - lr * weight_decay in float16 (1: no decay) and lr / bias_correction1 in float16, its fused one in float64,
    as sofx did: the two torch results differ (sofx was 1e-4 off the for-loop's after 3 steps). A float16 or
    bfloat16 lr, beta1, beta2 or weight_decay (numpy's, or a 0-d tensor) is refused naming it, at construction and
    at a step, before anything is written; a float16 eps (only added, as a double, by torch) is taken."""
    np = pytest.importorskip("numpy")
    lr16 = np.float16(1e-3)
    stepped = []
    for kw in ({"foreach": False}, {"fused": True}):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 8))
        torch_opt = torch.optim.AdamW([p], lr=lr16, weight_decay=1e-2, **kw)
        p.grad = torch.cos(torch.arange(8.0))
        torch_opt.step()
        stepped.append(p.detach().clone())
    assert not torch.equal(*stepped)
    opt, params, grads, state = _setup(1)
    before = _snapshot(params, grads, state)
    for name, value, kind in (("lr", lr16, "float16"), ("beta1", np.float16(0.9), "float16"),
                              ("weight_decay", torch.tensor(1e-2, dtype=torch.bfloat16), "bfloat16"),
                              ("beta2", torch.tensor(0.999, dtype=torch.float16), "float16")):
        pattern = rf"{name} = .* is a {kind} number: torch.optim's for-loop and foreach AdamW compute with it in {kind}"
        with pytest.raises(sofx.HParamError, match=r"^hparams for params\[.*\]: " + pattern):
            opt.update(params, grads, state, AdamHParams(**{name: value}))
        with pytest.raises(sofx.HParamError, match=r"^defaults: " + pattern):
            sofx.Adam(AdamHParams(**{name: value}), decoupled=True)
        with pytest.raises(sofx.HParamError, match=r"^hparams_schedule: " + pattern):
            sofx.schedules.hparams_schedule(**{name: value})
    _assert_unchanged(before, params, grads, state)
    assert sofx.adamw(eps=np.float16(1e-3)).defaults.eps == float(np.float16(1e-3))


@pytest.mark.parametrize("given", ["parameters", "named_parameters", "module"])
@pytest.mark.parametrize("call", ["init", "update", "check_inputs"])
def test_a_module_or_its_parameter_iterator_as_params_says_to_pass_a_tree_of_tensors(given, call):
    """A torch.optim user passes ``model.parameters()`` (or the module) where sofx takes a pytree of tensors; it was
    refused with "params: expected a tensor, got generator", which does not say what to pass: now the message
    names the tree to build from the module, and the facade that takes ``model.parameters()``."""
    model = torch.nn.Linear(3, 2)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = sofx.adamw()
    state = opt.init(params)
    bad = {"parameters": model.parameters, "named_parameters": model.named_parameters,
           "module": lambda: model}[given]()
    kind = {"parameters": "generator", "named_parameters": "generator", "module": "Linear"}[given]
    run = {"init": lambda: opt.init(bad), "update": lambda: opt.update(bad, params, state),
           "check_inputs": lambda: opt.check_inputs(bad, params, state)}[call]
    before = _snapshot(params, state)
    with pytest.raises(sofx.LeafError, match=rf"^params: expected a tensor, got {kind} \(.*\{{name: p\.detach\(\) "
                                             r"for name, p in model\.named_parameters\(\)\}.*"
                                             r"sofx\.offload\.SpeculativeAdamW"):
        run()
    _assert_unchanged(before, params, state)


def _states_not_adam(params, opt):
    """What a newcomer passes where ``update`` takes an AdamState, and what the refusal should point to."""
    model = torch.nn.Linear(2, 2)
    torch_opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 2)).sum().backward()
    torch_opt.step()
    from sofx.loss_scale import static_scale
    from sofx.serial import init_loop
    return {"none": (None, r"opt\.init\(params\) makes it"),
            "params": (params, r"opt\.init\(params\) makes it"),
            "torch state_dict": (torch_opt.state_dict(),
                                 r"a torch\.optim state_dict\(\).*sofx\.checkpoint\.from_torch_optim\(opt, "
                                 r"state_dict, params\)"),
            "loop": (init_loop(opt, params, static_scale(1.0)), r"a LoopState: its Adam state is loop\.opt_state"),
            "apply_if_finite": (sofx.apply_if_finite(opt, 3).init(params),
                                r"an ApplyIfFiniteState: .*state\.inner_state")}


@pytest.mark.parametrize("given", ["none", "params", "torch state_dict", "loop", "apply_if_finite"])
def test_a_state_that_is_not_an_adam_state_says_where_the_adam_state_comes_from(given):
    """``update(params, grads, None)`` (init forgotten), a torch.optim ``state_dict()``, a loop's or
    apply_if_finite's state were refused with "state: expected an AdamState, got dict", which does not say what to
    pass: now the message says where the Adam state comes from, in ``update`` and in the speculative step."""
    from sofx.loss_scale import static_scale
    from sofx.serial import init_loop
    from sofx.speculate import SpeculationConfig, speculative_loop_step
    opt, params, grads, state = _setup()
    bad, hint = _states_not_adam(params, opt)[given]
    before = _snapshot(params, grads, state)
    with pytest.raises(sofx.LeafError, match=rf"^state: expected an AdamState, got {type(bad).__name__}.*{hint}"):
        opt.update(params, grads, bad)
    loop = init_loop(opt, params, static_scale(1.0))._replace(opt_state=bad)
    with pytest.raises(sofx.SofxError, match=rf"state: expected an AdamState, got {type(bad).__name__}.*{hint}"):
        speculative_loop_step(opt, loop, grads, config=SpeculationConfig(), scaler=static_scale(1.0))
    _assert_unchanged(before, params, grads, state)


@pytest.mark.parametrize("hp, error, pattern", [
    (1e-3, sofx.HParamError,
     r"^hparams for params\['head'\]: expected an AdamHParams, got float; a number is not taken as the lr: "
     r"AdamHParams\(lr=0\.001\)"),
    ({"layers": sofx.AdamHParams(), "head": 0.1}, sofx.HParamError,
     r"^hparams for params\['head'\]: expected an AdamHParams, got float; .*AdamHParams\(lr=0\.1\)"),
    ({"lr": 1e-3, "weight_decay": 0.0}, sofx.StructureError,
     r"^hparams is not a prefix of the structure of params.*; a dict of AdamHParams fields is not the hparams: "
     r"sofx\.AdamHParams\(lr=0\.001, weight_decay=0\.0\)"),
    ({"lr": 1e-3, "betas": (0.9, 0.99)}, sofx.StructureError,
     r"; a dict of AdamHParams fields is not the hparams: sofx\.AdamHParams\(lr=0\.001, beta1=0\.9, beta2=0\.99\)")],
    ids=["a number", "a number in a group", "a dict of fields", "a torch param group's keys"])
def test_hparams_given_as_a_number_or_a_dict_of_fields_say_how_to_write_them(hp, error, pattern):
    """``update(params, grads, state, 1e-3)`` (an lr alone, as optax's ``learning_rate``) and ``{"lr": 1e-3}`` (a
    torch param group's keys) were refused with "expected an AdamHParams, got float" and "hparams has entries
    ['lr'], expected ['head', 'layers']": now the message writes the AdamHParams they meant."""
    opt, params, grads, state = _setup(2)
    before = _snapshot(params, grads, state)
    with pytest.raises(error, match=pattern):
        opt.update(params, grads, state, hp)
    _assert_unchanged(before, params, grads, state)


@pytest.mark.parametrize("loop_step", ["serial_loop_step", "speculative_loop_step"])
def test_a_loop_step_given_a_dict_of_hparam_fields_writes_the_adam_hparams_meant(loop_step):
    """The loop steps refused ``hparams={"lr": 1e-3, "betas": (0.9, 0.95)}`` (a torch param group's keys) with
    "hparams['betas'][0] = 0.9 (float) is a number; expected an AdamHParams (AdamHParams(lr=0.9))", which reads a
    beta as an lr: now they say, as ``update`` does, that a dict of fields is not the hparams, and write the
    AdamHParams meant; a tree of AdamHParams keyed like fields (a params dict with such keys) still steps."""
    from sofx.loss_scale import static_scale
    from sofx.serial import init_loop, serial_loop_step
    from sofx.speculate import SpeculationConfig, speculative_loop_step
    opt, scaler = sofx.adamw(), static_scale(1.0)
    step = {"serial_loop_step": lambda loop, g, hp: serial_loop_step(opt, loop, g, scaler=scaler, hparams=hp),
            "speculative_loop_step": lambda loop, g, hp: speculative_loop_step(
                opt, loop, g, config=SpeculationConfig(), scaler=scaler, hparams=hp)}[loop_step]
    params = {"w": torch.ones(3)}
    loop = init_loop(opt, params, scaler)
    with pytest.raises(sofx.HParamError, match=r"^hparams has the keys \['betas', 'lr'\]; a dict of AdamHParams fields "
                                               r"is not the hparams: sofx\.AdamHParams\(lr=0\.001, beta1=0\.9, "
                                               r"beta2=0\.95\)$"):
        step(loop, {"w": torch.ones(3)}, {"lr": 1e-3, "betas": (0.9, 0.95)})
    assert loop.params["w"].eq(1).all()
    keyed = {"lr": torch.ones(2), "eps": torch.ones(2)}
    stepped, _ = step(init_loop(opt, keyed, scaler), {"lr": torch.ones(2), "eps": torch.ones(2)},
                      {"lr": AdamHParams(lr=0.5), "eps": None})
    assert stepped.step == 1 and not stepped.params["lr"].eq(1).any()


@pytest.mark.parametrize("make", [sofx.adam, sofx.adamw], ids=["adam", "adamw"])
@pytest.mark.parametrize("field", ["lr", "eps", "weight_decay", "betas"])
def test_a_default_hparam_given_as_none_is_refused_at_construction(make, field):
    """``sofx.adamw(weight_decay=None)`` (a torch habit of "None: not set") was taken, and the first update raised
    a bare TypeError deep in the kernels ("unsupported operand type(s) for *: 'float' and 'NoneType'"): the
    defaults are what a step's None fields fall back to, so they must be numbers. Refused at construction now,
    naming the field; a step's AdamHParams(field=None) still means the default."""
    value = (None, 0.999) if field == "betas" else None
    name = "beta1" if field == "betas" else field
    with pytest.raises(sofx.HParamError, match=rf"^defaults: {name} = None is invalid; the optimizer's defaults "
                                               r"are numbers.*None in a step's AdamHParams means the default"):
        make(**{field: value})
    opt = make()
    params, grads = {"w": torch.ones(3)}, {"w": torch.ones(3)}
    opt.update(params, grads, opt.init(params), AdamHParams(**{name: None}))



def test_a_state_dtype_that_is_not_a_torch_dtype_is_refused_naming_it():
    """``sofx.adamw(state_dtype="bfloat16")`` raised a bare AttributeError ("'str' object has no attribute
    'is_floating_point'"): refused now naming the dtype meant."""
    for bad in ("bfloat16", "torch.float16", 32):
        kind = sofx.tree.article(type(bad).__name__)
        with pytest.raises(sofx.UnsupportedError, match=rf"^state_dtype={bad!r} is {kind}; expected "
                                                        r"a floating torch\.dtype \(torch\.float32, torch\.bfloat16, "
                                                        r"torch\.float16, torch\.float64\) or None"):
            sofx.adamw(state_dtype=bad)


# A leaf whose memory was freed (untyped_storage().resize_(0), as FSDP frees tensors) or shrunk: update, undo and
# undo_redo handed its address to the native kernels, or read it with torch before them (a segmentation fault at 0,
# reads past a shrunk end). Run in a subprocess so that a crash fails the test instead of ending pytest.
_FREED_LEAF = """
import re, sys
import torch
from refusal_script import clones, expect_refused
import sofx
from sofx.errors import LeafError, UndoError

backend = sys.argv[1]
N = 3000


def setup():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(40, 30, generator=gen), "head": torch.randn(N, generator=gen)}
    grads = {k: torch.randn(t.shape, generator=gen) for k, t in params.items()}
    opt = sofx.adamw(lr=1e-2, backend=backend)
    state = opt.init(params)
    params, state, _ = opt.update(params, grads, state)  # nonzero state
    return opt, params, grads, state


def tensors(*trees):
    return [t for tree in trees for t in sofx.tree.flatten(tree)[0] if isinstance(t, torch.Tensor)]


def expect(case, fn, error, pattern, *trees):
    kept = [t for t in tensors(*trees) if t.untyped_storage().nbytes() >= t.nbytes]  # (not the freed one)
    expect_refused(case, fn, error, pattern, clones(kept))


for keep in (0, 40):
    holds = rf"\\['head'\\]: its storage holds {keep} bytes.*reach byte 12000"
    for donate in (False, True):
        for role in ("params", "grads", "state.mu", "state.nu", "param_copies"):
            opt, params, grads, state = setup()
            copies = {"w": None, "head": torch.zeros(N)}
            tree = {"params": params, "grads": grads, "state.mu": state.mu, "state.nu": state.nu,
                    "param_copies": copies}[role]
            tree["head"].untyped_storage().resize_(keep)
            expect(f"update {role} {keep} {donate}",
                   lambda: opt.update(params, grads, state, donate=donate, param_copies=copies), LeafError,
                   re.escape(role) + holds, params, grads, state, copies)
        opt, params, grads, state = setup()
        p1, s1, record = opt.update(params, grads, state)
        record.leaves[0].grad.untyped_storage().resize_(keep)  # head's (leaves in key order); the caller's tensor
        expect(f"undo record grad {keep} {donate}", lambda: opt.undo(p1, s1, record, donate=donate), UndoError,
               r"params\\['head'\\]: the record's gradient: its storage holds", p1, s1)
        new = {k: torch.randn(t.shape) for k, t in grads.items()}
        expect(f"undo_redo record grad {keep} {donate}",
               lambda: opt.undo_redo(p1, s1, record, new, donate=donate), UndoError,
               r"params\\['head'\\]: the record's gradient: its storage holds", p1, s1, new)
        opt, params, grads, state = setup()
        p1, s1, record = opt.update(params, grads, state)
        new = {k: torch.randn(t.shape) for k, t in grads.items()}
        new["head"].untyped_storage().resize_(keep)
        expect(f"undo_redo grads {keep} {donate}", lambda: opt.undo_redo(p1, s1, record, new, donate=donate),
               LeafError, "grads" + holds, p1, s1, new)
        s1.nu["head"].untyped_storage().resize_(keep)
        expect(f"undo state.nu {keep} {donate}", lambda: opt.undo(p1, s1, record, donate=donate), LeafError,
               "state.nu" + holds, p1, s1)
print("ok")
"""


@pytest.mark.parametrize("backend", ["cpu", "cpu_fast", "reference"])
def test_a_leaf_whose_storage_was_freed_is_refused_naming_it_and_changes_nothing(backend):
    script_prints_ok(_FREED_LEAF, backend)


# Leaves that are views of one flat buffer (storage offsets, the common cases' other branch), a gradient with gaps
# (its record's storage is then checked whole), and a snapshot record's kept values (the caller's own tensors
# without donation): a storage cut one element short of a view's end is refused naming it, as a freed one is.
_SHORT_VIEWS = """
import re, sys
import torch
from refusal_script import expect_refused
import sofx
from sofx.errors import LeafError, UndoError

backend = sys.argv[1]
gen = torch.Generator().manual_seed(0)


def flat_tree(n_a, n_head):  # {"a", "head"}: views of one buffer, "head" at storage offset n_a, ending it
    flat = torch.randn(n_a + n_head, generator=gen)
    return flat, {"a": flat[:n_a], "head": flat[n_a:]}


expect = expect_refused


short = r"\\['head'\\]: its storage holds 11996 bytes.*storage offset 100.*reach byte 12000"
for role in ("params", "grads"):
    flat_p, params = flat_tree(100, 2900)
    flat_g, grads = flat_tree(100, 2900)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    state = opt.init(params)
    before = {k: t.clone() for k, t in params.items()}
    (flat_p if role == "params" else flat_g).untyped_storage().resize_(11996)  # head's last element cut off
    expect(f"update {role}", lambda: opt.update(params, grads, state), LeafError, re.escape(role) + short)
    assert torch.equal(params["a"], before["a"]) and torch.equal(state.mu["a"], torch.zeros(100))

params = {"head": torch.randn(30, 100, generator=gen)}
wide = torch.randn(30, 200, generator=gen)
grads = {"head": wide[:, ::2]}  # (gaps: it needs 23996 bytes of its storage's 24000, 12000 of elements)
opt = sofx.adamw(lr=1e-2, backend=backend)
p1, s1, record = opt.update(params, grads, opt.init(params))
wide.untyped_storage().resize_(23992)
expect("undo record grad with gaps", lambda: opt.undo(p1, s1, record), UndoError,
       r"params\\['head'\\]: the record's gradient: its storage holds 23992 bytes.*reach byte 23996")

params = {"head": torch.randn(3000, generator=gen)}
opt = sofx.adamw(lr=1e-2, backend=backend, undo="exact")
p1, s1, record = opt.update(params, {"head": torch.randn(3000, generator=gen)}, opt.init(params))
params["head"].untyped_storage().resize_(0)  # the caller's tensor, which the snapshot record keeps
expect("undo record kept p", lambda: opt.undo(p1, s1, record), UndoError,
       r"params\\['head'\\]: the record's kept p: its storage holds 0 bytes.*reach byte 12000")
print("ok")
"""


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_view_whose_storage_ends_short_of_it_is_refused_naming_it(backend):
    script_prints_ok(_SHORT_VIEWS, backend)


# A step count whose memory was freed or shrunk (its state's count leaf, or the one an undo record restores):
# update and undo read the state's with .item() (torch's RuntimeError for a freed one, 8 bytes of a shrunk
# 4-byte storage read past its end), and undo_redo added 1 to the record's (a segmentation fault); the leaf's other
# tensors were refused naming them. Refused now alike, before anything is written.
_SHORT_COUNT = """
import re, sys
import torch
from refusal_script import clones, expect_refused
import sofx
from sofx.errors import LeafError, UndoError

backend = sys.argv[1]
gen = torch.Generator().manual_seed(0)


def setup():
    params = {"w": torch.randn(4, 3, generator=gen), "head": torch.randn(30, generator=gen)}
    grads = {k: torch.randn(t.shape, generator=gen) for k, t in params.items()}
    opt = sofx.adamw(lr=1e-2, backend=backend)
    params, state, _ = opt.update(params, grads, opt.init(params))
    return opt, params, grads, state


def expect(case, fn, error, pattern, *kept):
    expect_refused(case, fn, error, pattern, clones(kept))


for keep in (0, 4):
    holds = rf"its storage holds {keep} bytes.*reach byte 8"
    for donate in (False, True):
        opt, params, grads, state = setup()
        state.count["head"].untyped_storage().resize_(keep)
        kept = [*params.values(), *state.mu.values(), *state.nu.values()]
        expect(f"update {keep} {donate}", lambda: opt.update(params, grads, state, donate=donate), LeafError,
               r"state\\.count\\['head'\\]: " + holds, *kept)
        opt, params, grads, state = setup()
        p1, s1, record = opt.update(params, grads, state)
        state.count["head"].untyped_storage().resize_(keep)  # the count the record restores
        kept = [*p1.values(), *s1.mu.values(), *s1.nu.values()]
        expect(f"undo {keep} {donate}", lambda: opt.undo(p1, s1, record, donate=donate), UndoError,
               r"params\\['head'\\]: the record's count_before: " + holds, *kept)
        expect(f"undo_redo {keep} {donate}", lambda: opt.undo_redo(p1, s1, record, grads, donate=donate),
               UndoError, r"params\\['head'\\]: the record's count_before: " + holds, *kept)
print("ok")
"""


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_step_count_whose_storage_was_freed_is_refused_naming_it_and_changes_nothing(backend):
    script_prints_ok(_SHORT_COUNT, backend)


def test_a_record_whose_count_before_is_a_number_is_undone_as_before():
    # (torch.func rebuilds records with non-tensor leaves; there is no storage to check)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, generator=gen)}
    opt = sofx.adamw(lr=1e-2, backend="cpu")
    p1, s1, record = opt.update(params, {"w": torch.randn(5, generator=gen)}, opt.init(params))
    record.leaves[0].count_before = 0
    p0, s0 = opt.undo(p1, s1, record)
    assert s0.count["w"] == 0 and torch.allclose(p0["w"], params["w"], rtol=1e-6, atol=1e-7)
    # restored as the state holds counts (an int was restored as is: the next step refused the state)
    assert isinstance(s0.count["w"], torch.Tensor) and s0.count["w"].dtype == torch.int64
    opt.update(p0, {"w": torch.randn(5, generator=gen)}, s0)


def test_a_redo_of_a_record_whose_counts_are_numbers_equals_the_redo_of_the_record():
    """A record a transform rebuilt with numbers for its 0-d counts (torch's tree_map): undo_redo raised the
    LeafUndo refusal of its count (an int) and, before, returned a state of int counts the next step refused; it
    redoes as with the record the step returned, counts as the state holds them."""
    import torch.utils._pytree as torch_pytree

    gen = torch.Generator().manual_seed(1)
    params = {"a": torch.randn(5, generator=gen), "b": torch.randn(3, generator=gen)}
    grads = {"a": torch.randn(5, generator=gen), "b": torch.randn(3, generator=gen)}
    results = []
    for as_numbers in (False, True):
        opt = sofx.adamw(lr=1e-2)
        p1, s1, _ = opt.update(params, grads, opt.init(params))
        p2, s2, record = opt.update(p1, grads, s1)
        if as_numbers:
            record = torch_pytree.tree_map(
                lambda x: int(x) if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_floating_point() else x,
                record)
            assert all(type(leaf.count_before) is int for leaf in record.leaves)
        p3, s3, redone = opt.undo_redo(p2, s2, record, grads, grad_scale=0.5, donate=as_numbers)
        opt.update(p3, grads, s3)  # (a state the next step takes)
        p4, s4 = opt.undo(p3, s3, redone)
        results.append((p3, s3.count, s4.count))
    assert trees_equal(results[0][0], results[1][0])
    assert trees_equal(results[0][1], results[1][1]) and trees_equal(results[0][2], results[1][2])


@pytest.mark.parametrize("call", ["init", "update"])
def test_params_or_grads_of_a_dict_subclass_say_that_optree_takes_it_as_one_leaf(call):
    """optree walks dict, OrderedDict and defaultdict, but takes a subclass of them (a user's dict class, an
    OrderedDict subclass as transformers' outputs are) as one leaf: params of such a class were refused as
    'params: expected a tensor, got Params', grads as 'grads is a Params, expected PyTreeSpec(...)', which do not say
    why a dict is not walked. Both now say so and what to pass."""
    class Params(dict):
        pass

    params = {"w": torch.randn(2), "b": torch.randn(2)}
    opt = sofx.adam()
    state = opt.init(params)
    run = {"init": lambda: opt.init(Params(params)), "update": lambda: opt.update(Params(params), params, state)}[call]
    hint = r"\(a dict subclass, which optree takes as one leaf: pass dict\(x\) or register Params with optree\)"
    with pytest.raises(sofx.LeafError, match=rf"^params: expected a tensor, got Params {hint}"):
        run()
    with pytest.raises(sofx.StructureError, match=rf"\(grads is a Params {hint}, expected PyTreeSpec"):
        opt.update(params, Params(params), state)


def test_an_hparams_prefix_of_a_dict_subclass_says_that_optree_takes_it_as_one_leaf():
    """An hparams prefix of a dict subclass (one leaf to optree) stood for every leaf and was refused as 'expected an
    AdamHParams, got Groups'; it says why the dict was not walked."""
    class Groups(dict):
        pass

    params = {"w": torch.randn(2), "b": torch.randn(2)}
    opt = sofx.adam()
    hp = Groups(w=AdamHParams(lr=0.1), b=AdamHParams(lr=0.2))
    with pytest.raises(sofx.HParamError, match=r"expected an AdamHParams, got Groups \(a dict subclass, which optree "
                                               r"takes as one leaf: pass dict\(x\)"):
        opt.update(params, params, opt.init(params), hp)


def test_undo_of_params_whose_mapping_differs_from_the_records_names_where():
    """A record made for OrderedDict params undone with params of another key was refused with both specs only
    ('made for params of structure PyTreeSpec(...), got PyTreeSpec(...)'), which do not say where they differ. The
    refusal names the place. (A mapping of another dict type or key order with the same keys is matched key by key,
    as update matches grads to params: tests/test_adam_undo.py.)"""
    from collections import OrderedDict
    opt = sofx.adam()
    params = OrderedDict([("z", torch.randn(2)), ("a", torch.randn(2))])
    stepped, state, rec = opt.update(params, params, opt.init(params))
    with pytest.raises(sofx.UndoError, match=r"params has entries \['q', 'z'\], expected \['z', 'a'\]"):
        opt.undo(OrderedDict([("q", stepped["a"]), ("z", stepped["z"])]), state, rec)
    with pytest.raises(sofx.UndoError, match=r"the record was made for params of another structure: params is a "
                                             r"list, the record's is an OrderedDict"):
        opt.undo([stepped["z"], stepped["a"]], state, rec)
    assert not rec.used
    undone, _ = opt.undo(dict(stepped), state, rec)  # (the same keys: matched key by key)
    assert type(undone) is dict and all(torch.equal(undone[k], params[k]) for k in params)


def test_update_undo_and_undo_redo_take_numpy_bools_and_a_0d_bool_tensor_for_grads_finite():
    """The speculation protocol takes a step's facts as numpy bools or readable 0-d bool tensors
    (user_numbers.fact_value) and its options as numpy bools (user_numbers.flag), but Adam refused them:
    ``grads_finite=torch.isfinite(g).all()`` (a fact computed with torch) and ``donate=np.True_`` raised "expected
    None, True or False". grads_finite takes a Python or numpy bool or a readable 0-d bool tensor, donate and
    undoable a Python or numpy bool, each read once as a Python bool, the results bitwise those of Python bools;
    a string, a number or a tensor of another dtype or shape stays refused naming the argument, nothing written."""
    np = pytest.importorskip("numpy")
    opt = sofx.adamw(lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    params, grads = {"w": torch.randn(5, generator=gen)}, {"w": torch.randn(5, generator=gen)}
    late = {"w": torch.randn(5, generator=gen)}
    state = opt.init(params)

    def run(finite, yes, no):
        p1, s1, rec = opt.update(clone_tree(params), grads, clone_tree(state), grads_finite=finite(grads), donate=yes,
                                 undoable=yes)
        p2, s2, rec2 = opt.undo_redo(p1, s1, rec, late, grads_finite=finite(late), donate=no, undoable=yes)
        p3, s3 = opt.undo(p2, s2, rec2, donate=yes)
        strategies = opt.undo_strategies(params, grads, state, grads_finite=finite(grads))
        return [p1["w"], s1.mu["w"], p2["w"], s2.nu["w"], p3["w"], s3.mu["w"]], strategies

    want = run(lambda g: True, True, False)
    for finite, yes, no in ((lambda g: torch.isfinite(g["w"]).all(), np.True_, np.False_),
                            (lambda g: np.bool_(True), np.bool_(True), np.bool_(False)),
                            (lambda g: None, True, np.False_)):
        got = run(finite, yes, no)
        assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])) and got[1] == want[1]
    p1, s1, rec = opt.update(clone_tree(params), grads, state)
    before = _snapshot(p1, s1)
    for bad in ("yes", 1, torch.tensor(1), torch.tensor([True]), torch.tensor(1.0)):
        for name, call in (("grads_finite", lambda: opt.update(p1, grads, s1, grads_finite=bad)),
                           ("grads_finite", lambda: opt.undo_redo(p1, s1, rec, late, grads_finite=bad)),
                           ("grads_finite", lambda: opt.undo_strategies(p1, grads, s1, grads_finite=bad)),
                           ("donate", lambda: opt.update(p1, grads, s1, donate=bad)),
                           ("donate", lambda: opt.undo(p1, s1, rec, donate=bad)),
                           ("undoable", lambda: opt.undo_redo(p1, s1, rec, late, undoable=bad))):
            with pytest.raises(sofx.UnsupportedError, match=rf"^{name} = .* is invalid; expected"):
                call()
    with pytest.raises(sofx.UnsupportedError,
                       match=r"^donate = tensor\(True\) is invalid; expected a bool \(True or False\)"):
        opt.update(p1, grads, s1, donate=torch.tensor(True))  # (an option, not a fact of the step)
    _assert_unchanged(before, p1, s1)
    assert not rec.used


def test_algebraic_refusal_of_something_else_than_hparams_is_named():
    """``Adam.algebraic_refusal`` (public: the offload facade asks it of its param groups) of a str raised a bare
    AttributeError, and of an AdamHParams with fields left None (the defaults, as update reads them) a TypeError."""
    opt = sofx.adamw(lr=1e-2, weight_decay=1e2, undo="algebraic")
    with pytest.raises(sofx.HParamError, match=r"^algebraic_refusal: expected an AdamHParams, got str"):
        opt.algebraic_refusal("x")
    assert "lr * weight_decay == 1" in opt.algebraic_refusal(sofx.AdamHParams())
    assert opt.algebraic_refusal(sofx.AdamHParams(weight_decay=0.0)) is None


@pytest.mark.parametrize("call", ["init", "update", "check_inputs", "undo"])
def test_a_lazy_modules_uninitialized_parameter_is_refused_naming_the_leaf(call):
    """A lazy module's parameter before its first forward (``nn.LazyLinear``: an UninitializedParameter, no shape,
    no data) as a params leaf raised torch's ValueError ('Attempted to use an uninitialized parameter in ...')
    naming no leaf: a LeafError naming the leaf and what to do, nothing changed."""
    real = {name: p.detach().clone() for name, p in torch.nn.Linear(3, 2).named_parameters()}
    opt = sofx.adamw()
    grads = {name: torch.ones_like(p) for name, p in real.items()}
    new, state, record = opt.update(real, grads, opt.init(real))
    lazy = dict(torch.nn.LazyLinear(2).named_parameters())
    run = {"init": lambda: opt.init(lazy), "update": lambda: opt.update(lazy, grads, state, donate=True),
           "check_inputs": lambda: opt.check_inputs(lazy, grads, state),
           "undo": lambda: opt.undo(lazy, state, record, donate=True)}[call]
    before = _snapshot(grads, state)
    with pytest.raises(sofx.LeafError, match=r"^params\['bias'\] is an uninitialized parameter \(a lazy module's, "
                                             r"before its first forward\).*run a forward pass first"):
        run()
    _assert_unchanged(before, grads, state)
