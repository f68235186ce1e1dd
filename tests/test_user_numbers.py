"""kernels.base's readers of user-given numbers: finite_number and integer (positive_number is tested where
max_norm is, tests/test_transforms.py)."""

from __future__ import annotations

import math

import pytest
import torch

from sofx.errors import HParamError, UnsupportedError
from sofx.kernels.user_numbers import as_integer, finite_number, flag, integer

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
    (torch.ones((), requires_grad=True), r"a torch.float32 tensor of shape \(\) whose value cannot be read here")])
def test_finite_number_refuses_what_is_no_finite_number_naming_it(value, kind):
    with pytest.raises(HParamError, match=r"x = .* is invalid; expected a finite number .*, got " + kind):
        finite_number("x", value)


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
