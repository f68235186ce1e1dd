"""kernels.base's readers of user-given numbers: finite_number and integer (positive_number is tested where
max_norm is, tests/test_transforms.py)."""

from __future__ import annotations

import math

import pytest
import torch

from sofx.errors import HParamError, UnsupportedError
from sofx.kernels.base import rounds_in_float
from sofx.kernels.user_numbers import as_integer, finite_number, flag, integer, nonnegative_number, positive_number

from helpers import script_prints_ok

np = pytest.importorskip("numpy")


@pytest.mark.parametrize("value, want", [
    (3, 3), (-2.5, -2.5), (np.float32(0.5), 0.5), (np.int64(7), 7), (np.float64(1e-3), 1e-3),
    (torch.tensor(0.25), 0.25), (torch.tensor([4]), 4), (torch.tensor(1.5, dtype=torch.float64), 1.5)])
def test_finite_number_reads_numpy_and_one_element_tensors_as_python_numbers(value, want):
    got = finite_number("x", value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value, kind", [
    (True, "bool"), (np.bool_(False), "bool"), (math.nan, "float"), (-math.inf, "float"), (10 ** 400, "int"),
    ("1", "str"), (None, "NoneType"), (np.float32("inf"), "float32"),
    (torch.ones(2), r"a torch.float32 tensor of shape \(2,\)"), (torch.tensor(True), r"a torch.bool tensor"),
    (torch.ones((), requires_grad=True), r"a torch.float32 tensor of shape \(\) whose value cannot be read here"),
    (torch.ones((), device="meta"), r"a torch.float32 tensor of shape \(\) on meta, which holds no value \(shapes "
                                    r"only\)$")])
def test_finite_number_refuses_what_is_no_finite_number_naming_it(value, kind):
    """(A meta tensor was called one "whose value cannot be read here (traced)": it holds no value at all.)"""
    with pytest.raises(HParamError, match=r"x = .* is invalid; expected a finite number .*, got " + kind):
        finite_number("x", value)


@pytest.mark.parametrize("read", [positive_number, nonnegative_number, finite_number])
def test_a_numpy_longdouble_no_float_holds_is_refused_naming_it(read):
    """A numpy longdouble config number (max_norm, init_scale, a scaler's factors) with more digits than a float (1/3
    in x86's 80 bits) was read as float() of it, rounded without a word, where update, the defaults and the
    checkpoint imports refuse it (kernels.base.as_number); refused so, naming it and the float it rounds to (the
    message said "sofx computes hparams as Python floats" of these settings too, which are no hparams). One a
    float holds exactly is read as that float."""
    third = np.longdouble(1) / np.longdouble(3)
    if float(third) == third:
        pytest.skip("numpy's longdouble is a double on this platform")
    with pytest.raises(HParamError, match=r"^x = np\.longdouble\('0\.333.*'\) is invalid: a numpy\.longdouble that "
                                          r"no Python float \(a float64\) holds exactly, which float\(\) rounds to "
                                          r"0\.3333333333333333 \(sofx computes with Python floats\); give float\(x\) "
                                          r"if that is meant$"):
        read("x", third)
    got = read("x", np.longdouble(0.5))
    assert got == 0.5 and type(got) is float


def test_a_number_beyond_the_float_range_is_inf_whether_an_int_or_a_numpy_longdouble():
    """nonnegative_number takes inf and reads an int beyond the float range as inf; a numpy longdouble beyond it
    (1e400 in x86's 80 bits) was refused as 'no Python float holds exactly, which float() rounds to inf'. Read as
    inf as the int is: nonnegative_number takes it, positive_number and finite_number refuse it as they refuse the
    int (no finite number); -1e400 is below 0."""
    big = np.longdouble("1e400")
    if float(big) != math.inf or big == math.inf:
        pytest.skip("numpy's longdouble has no range beyond a double's on this platform")
    for value in (10 ** 400, big):
        assert nonnegative_number("x", value) == math.inf
        with pytest.raises(HParamError, match=r"^x = .* is invalid; expected a finite number > 0"):
            positive_number("x", value)
        with pytest.raises(HParamError, match=r"^x = .* is invalid; expected a finite number \("):
            finite_number("x", value)
    with pytest.raises(HParamError, match=r"^x = .* is invalid; expected a number >= 0, inf included"):
        nonnegative_number("x", -big)


def test_rounds_in_float_is_the_one_test_of_a_numpy_float_no_python_float_holds():
    """as_number, the checkpoint imports (checkpoint.groups) and the codec each tested ``float(x) != x and x == x``
    of their own; one predicate, kernels.base.rounds_in_float: nan is no number to round, a float64 and a float32
    are held."""
    third = np.longdouble(1) / np.longdouble(3)
    assert rounds_in_float(third) is (float(third) != third)
    assert not any(rounds_in_float(x) for x in (np.longdouble(0.5), np.longdouble("nan"), np.float32(0.1),
                                                np.float64(1e300), np.float64("inf")))


@pytest.mark.parametrize("value", [0, 5, np.int64(5), np.uint8(5), torch.tensor(5),
                                   torch.tensor([5], dtype=torch.int32)])
def test_integer_reads_numpy_and_one_element_integer_tensors_as_python_ints(value):
    got = integer("n", value)
    assert got == int(value) and type(got) is int


@pytest.mark.parametrize("value, kind", [
    (4.0, r"float \(a float is refused here, even a whole one\)"), (np.float32(4.5), "float32 .a float is refused"),
    (torch.tensor(4.0), r"a torch.float32 tensor of shape \(\) \(a float is refused here"), (True, "bool"),
    (np.bool_(True), "bool"), (-1, "int"), (np.int64(-1), "int64"), ("3", "str"), (None, "NoneType"),
    (torch.tensor([1, 2]), r"a torch.int64 tensor of shape \(2,\)")])
def test_integer_refuses_floats_bools_and_values_below_its_minimum_naming_them(value, kind):
    with pytest.raises(HParamError, match=r"n = .* is invalid; expected an integer >= 0 .*, got " + kind):
        integer("n", value)


def test_integer_raises_the_error_class_its_caller_names():
    with pytest.raises(UnsupportedError, match=r"n = 0 is invalid; expected an integer >= 1"):
        integer("n", 0, 1, UnsupportedError)


@pytest.mark.parametrize("value, want", [
    (3, 3), (np.int64(-2), -2), (torch.tensor([7]), 7), (4.0, None), (np.float32(4), None), (True, None),
    (np.bool_(False), None), (torch.tensor(4.0), None), (torch.tensor([1, 2]), None), ("4", None), (None, None)])
def test_as_integer_reads_integers_and_gives_none_for_the_rest(value, want):
    got = as_integer(value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value, kind", [
    ("no", "str"), (0, "int"), (1.0, "float"), (None, "NoneType"), (torch.tensor(True), "a torch.bool tensor")])
def test_flag_refuses_what_is_no_python_or_numpy_bool_naming_it(value, kind):
    """(loss_scale kept a twin of its own that took 0-d bool tensors; flags are Python or numpy bools)"""
    assert flag("on", np.bool_(True)) is True
    with pytest.raises(HParamError, match=r"on = .* is invalid; expected a bool \(True or False\), got " + kind):
        flag("on", value)


# A number given as a 0-d tensor whose memory was freed (untyped_storage().resize_(0), as FSDP frees tensors) or
# shrunk: its .item() raised torch's RuntimeError ("... lazy allocation ... mutable_data()") for a freed one, and
# read bytes past a shrunk end (an lr of 1.9e36, a loss scale of -1.2e17: steps of garbage, or refused as the
# wrong number). Refused naming the argument (the hparam's leaf path), nothing written; in a subprocess, so that a
# crash fails the test.
_FREED_NUMBER = """
import re
import torch
from refusal_script import clones, expect_refused
import sofx
from sofx import AdamHParams, loss_scale, serial
from sofx import transforms as tx
from sofx.errors import HParamError, SofxError


def number(value, keep, dtype=torch.float32):
    t = torch.tensor(value, dtype=dtype)
    t.untyped_storage().resize_(keep)
    return t


def expect(case, fn, error, name, keep, need=4):
    expect_refused(case, fn, error, re.escape(name) + rf": its storage holds {keep} bytes.*reach byte {need}",
                   clones(params.values()))


for keep in (0, 2):  # freed; shrunk
    params = {"w": torch.randn(4, 3), "b": torch.randn(5)}
    grads = {k: torch.randn(t.shape) for k, t in params.items()}
    opt = sofx.adamw(lr=1e-2)
    state = opt.init(params)
    for donate in (False, True):
        expect(f"hparams lr {keep} {donate}",
               lambda: opt.update(params, grads, state, AdamHParams(lr=number(1e-3, keep)), donate=donate),
               HParamError, "hparams for params['b']: lr", keep)
        expect(f"hparams per leaf {keep} {donate}",
               lambda: opt.update(params, grads, state, {"w": AdamHParams(), "b": AdamHParams(eps=number(1e-8, keep))},
                                  donate=donate), HParamError, "hparams for params['b']: eps", keep)
        expect(f"grad_scale {keep} {donate}", lambda: opt.update(params, grads, state, grad_scale=number(0.5, keep),
               donate=donate), HParamError, "grad_scale", keep)
    expect(f"defaults {keep}", lambda: sofx.adamw(lr=number(1e-3, keep)), HParamError, "defaults: lr", keep)
    lr = torch.tensor(1e-3)
    later = sofx.adamw(lr=lr)
    lr.untyped_storage().resize_(keep)
    expect(f"defaults freed later {keep}", lambda: later.update(params, grads, later.init(params)), HParamError,
           "defaults: lr", keep)
    static = loss_scale.static_scale()
    expect(f"speculative hparams {keep}", lambda: sofx.speculate.speculative_step(
        opt, params, grads, state, config=sofx.speculate.SpeculationConfig(), scaler=static,
        scaler_state=static.init(), hparams=AdamHParams(beta1=number(0.9, keep))), HParamError,
        "hparams for params['b']: beta1", keep)
    expect(f"begin_step hparams {keep}", lambda: sofx.speculate.begin_step(
        opt, sofx.speculate.SpeculationConfig(), static, static.init(), None, n_blocks=2,
        hparams=[AdamHParams(), AdamHParams(lr=number(1e-3, keep))]), HParamError, "hparams for blocks[1]: lr", keep)

    t = tx.unscale()
    expect(f"unscale loss_scale {keep}", lambda: t.update(grads, t.init(grads), loss_scale=number(2.0, keep)),
           HParamError, "unscale: loss_scale", keep)
    t = tx.unscale_and_clip_zero(1.0)
    expect(f"zero loss_scale {keep}", lambda: t.update(grads, t.init(grads), loss_scale=number(2.0, keep)),
           HParamError, "unscale_and_clip_zero: loss_scale", keep)
    expect(f"max_norm {keep}", lambda: tx.clip_by_global_norm(number(1.0, keep)), HParamError, "max_norm", keep)
    expect(f"clip_coefficient norm {keep}", lambda: tx.clip_coefficient(number(1.0, keep), 1.0), HParamError,
           "clip_coefficient: norm", keep)
    expect(f"zero_clip_factor scale {keep}", lambda: tx.zero_clip_factor(1.0, number(2.0, keep), 1.0), HParamError,
           "zero_clip_factor: scale", keep)
    expect(f"scale_tree factor {keep}", lambda: tx.scale_tree(grads, number(0.5, keep)), HParamError,
           "scale_tree: factor", keep)

    rule = loss_scale.grad_scaler()
    sstate = rule.init()._replace(scale=number(65536.0, keep))
    expect(f"serial_step scaler_state {keep}", lambda: serial.serial_step(
        opt, params, grads, state, scaler=rule, scaler_state=sstate), HParamError, "scaler.scale(scaler_state)", keep)
    expect(f"scaler update {keep}", lambda: rule.update(sstate, False), HParamError, "scaler_state['scale']", keep)
    if keep == 0:  # (a bool's one byte cannot be shrunk but to none)
        expect("scaler overflow", lambda: rule.update(rule.init(), number(True, 0, torch.bool)), HParamError,
               "overflow", 0, 1)

    fin = sofx.apply_if_finite(sofx.adamw(lr=1e-2), 2)
    fstate = fin.init(params)
    fstate = fstate._replace(notfinite_count=number(0, keep * 2, torch.int64))
    expect(f"apply_if_finite counter {keep}", lambda: fin.update(params, grads, fstate), SofxError,
           "apply_if_finite: state.notfinite_count", keep * 2, 8)
print("ok")
"""


def test_a_number_given_as_a_tensor_whose_storage_was_freed_or_shrunk_is_refused_naming_it():
    script_prints_ok(_FREED_NUMBER)


# The same for a float16 or bfloat16 lr, beta or weight_decay: the refusal of its precision (torch's for-loop step
# computes in it) showed the tensor's repr before its storage was looked at, and that repr read the freed memory (a
# segmentation fault at the constructor, a step, a schedule, the offload facade or from_torch_optim).
_FREED_HALF_NUMBER = """
import copy
import re
import torch
from refusal_script import clones, expect_refused
import sofx
import sofx.checkpoint as ck
import sofx.offload
from sofx import AdamHParams
from sofx.checkpoint import CheckpointError
from sofx.errors import HParamError


def number(value, keep, dtype):
    t = torch.tensor(value, dtype=dtype)
    t.untyped_storage().resize_(keep)
    return t


params = {"w": torch.randn(4, 3), "b": torch.randn(5)}
grads = {k: torch.randn(t.shape) for k, t in params.items()}
opt = sofx.adamw(lr=1e-2)
state = opt.init(params)
model = torch.nn.Linear(3, 2)
torch_opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 3)).sum().backward()
torch_opt.step()
template = [p.detach().clone() for p in model.parameters()]
for dtype in (torch.float16, torch.bfloat16):
    for keep in (0, 1):  # freed; shrunk
        def expect(case, fn, error, name):
            pattern = re.escape(name) + rf": its storage holds {keep} bytes.*reach byte 2"
            expect_refused(f"{case} {dtype} {keep}", fn, error, pattern, clones(params.values()))
        expect("hparams lr", lambda: opt.update(params, grads, state, AdamHParams(lr=number(1e-3, keep, dtype))),
               HParamError, "hparams for params['b']: lr")
        expect("defaults beta1", lambda: sofx.adamw(betas=(number(0.9, keep, dtype), 0.999)), HParamError,
               "defaults: beta1")
        expect("schedule", lambda: sofx.schedules.hparams_schedule(weight_decay=number(0.1, keep, dtype)),
               HParamError, "hparams_schedule: weight_decay")
        expect("facade", lambda: sofx.offload.SpeculativeAdamW(model.parameters(), lr=number(1e-3, keep, dtype),
                                                               executor="inline"), HParamError, "defaults['lr']")
        saved = copy.deepcopy(torch_opt.state_dict())
        saved["param_groups"][0]["lr"] = number(1e-3, keep, dtype)
        expect("from_torch_optim", lambda: ck.from_torch_optim(sofx.adamw(), saved, template), CheckpointError,
               "from_torch_optim: param_groups[0]['lr']")
print("ok")
"""


def test_a_half_precision_number_whose_storage_was_freed_or_shrunk_is_refused_naming_it_not_a_crash():
    script_prints_ok(_FREED_HALF_NUMBER)



# betas given as a 2-element tensor (or a pair holding 1-element tensors) whose memory was freed: taking its two items
# (or squeezing one, as torch.optim's _to_scalar does) raised torch's bare RuntimeError ('setStorage: ... out of
# bounds for storage of size 0') out of sofx.adamw and the offload facade. Refused naming the betas, the bytes held
# and needed. (In a subprocess: a failure's report would show the freed tensor, whose repr reads its memory.)
_FREED_BETAS = """
import torch
from refusal_script import expect_refused
import sofx
import sofx.offload
from sofx.errors import HParamError

model = torch.nn.Linear(2, 1)
for case, make in (("pair tensor", lambda t: t), ("beta1 of 1 element", lambda t: (t[:1], 0.999)),
                   ("beta2 of 1 element", lambda t: [0.9, t[1:]])):
    t = torch.tensor([0.9, 0.999])
    betas = make(t)
    t.untyped_storage().resize_(0)
    pattern = r"^betas(\\[[01]\\])?: its storage holds 0 bytes"
    expect_refused(f"sofx.adamw {case}", lambda: sofx.adamw(betas=betas), HParamError, pattern)
    expect_refused(f"facade {case}", lambda: sofx.offload.SpeculativeAdamW(model.parameters(), betas=betas,
                                                                          executor="inline"), HParamError, pattern)
print("ok")
"""


def test_betas_in_a_tensor_whose_storage_was_freed_are_refused_naming_them():
    script_prints_ok(_FREED_BETAS)
