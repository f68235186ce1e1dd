"""Numbers a user gives (hyperparameters, options, counts, flags), read once as Python values.

Where a configuration is built, each value is read here: a Python or numpy number, or a 1-element tensor whose
value can be read (not traced), becomes a Python ``float`` or ``int``, so that the arithmetic downstream is on
Python numbers (a numpy ``float32`` was refused, a tensor kept as given made every number computed from it a
tensor); a bool is not a number, a float is not a count, and anything else is refused with an error naming the
argument, its value and its type.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from sofx.errors import HParamError
from sofx.kernels.base import as_number, is_numpy_real, is_traced
from sofx.kernels.storage import TensorName, in_storage, refuse_short_storage

__all__ = ["is_bool", "real_number", "positive_number", "nonnegative_number", "finite_number", "as_integer", "integer",
           "fact_value", "flag"]


def is_bool(x: object) -> bool:
    """A Python or numpy bool (no number where a hyperparameter is expected)."""
    return isinstance(x, bool) or (type(x).__module__ == "numpy" and type(x).__name__ in ("bool_", "bool"))


def real_number(value: Any, name: TensorName = "a 1-element tensor", error: type[Exception] = HParamError) -> Any:
    """``value`` as a real number where it is one, else ``value`` itself.

    A Python or numpy real (``numbers.Real``, not a bool) is returned as is; a
    1-element tensor whose value can be read (not traced, :func:`is_traced`) as
    its Python value, when that is a real number (a bool or complex tensor is not). A tensor whose element lies
    outside its storage (freed, ``untyped_storage().resize_(0)``, or shrunk: its ``item()`` raised torch's
    RuntimeError, or read past the end) is refused, ``error`` naming it ``name``
    (:func:`~sofx.kernels.storage.refuse_short_storage`).
    """
    x = value
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not is_traced(x):
        if not in_storage(x):
            refuse_short_storage(x, name, error)
        x = x.item()
    return x if isinstance(x, numbers.Real) and not is_bool(x) else value


def _exact_real(value: Any, name: str) -> Any:
    """:func:`real_number` of ``value``, a numpy float read as the Python float that holds it exactly, else an
    :class:`HParamError` naming ``name`` and the value (:func:`~sofx.kernels.base.as_number`: a longdouble's extra
    digits, 1/3 in x86's 80 bits, were rounded off by ``float()`` without a word). A numpy float beyond the float
    range (a longdouble's 1e400) is read as inf of its sign, as an int beyond it is: the callers' ranges take or
    refuse it (it was refused as rounded to inf where :func:`nonnegative_number` takes inf)."""
    x = real_number(value, name)
    if not is_numpy_real(x) or isinstance(x, numbers.Integral):
        return x
    f = float(x)
    return f if f in (math.inf, -math.inf) else as_number(x, name)


def _described(value: Any) -> str:
    """``value``'s type for an error message (a tensor's dtype and shape, and whether it is traced)."""
    if isinstance(value, torch.Tensor):
        why = " on meta, which holds no value (shapes only)" if value.is_meta else \
            " whose value cannot be read here (traced)" if is_traced(value) else ""
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}{why}"
    return type(value).__name__


def positive_number(name: str, value: Any) -> float:
    """``value`` as a Python float where it is a finite real number > 0 (:func:`real_number`: a Python or numpy
    number, a 1-element readable tensor; an int or numpy float beyond the float range is inf, no finite number),
    else an :class:`HParamError` naming ``name``, the value and its type (a numpy float no Python float holds
    exactly too, :func:`_exact_real`).

    Converted once where a configuration is built, so that the arithmetic downstream is on Python floats (a
    tensor kept as given made every number computed from it a tensor)."""
    x = _exact_real(value, name)
    try:
        f = float(x) if isinstance(x, numbers.Real) and not is_bool(x) else math.nan
    except OverflowError:  # an int beyond the float range
        f = math.inf
    if not 0 < f < math.inf:  # (nan fails it; a comparison, a guard under torch.compile: math.isfinite broke there)
        raise HParamError(f"{name} = {value!r:.80} is invalid; expected a finite number > 0 (a Python or numpy "
                          f"number, or a 1-element tensor), got {_described(value)}")
    return f


def nonnegative_number(name: str, value: Any, hint: str = "") -> float:
    """``value`` as a Python float where it is a real number >= 0, inf included (:func:`real_number`: a Python or
    numpy number, a 1-element readable tensor; an int or a numpy float beyond the float range is inf), else an
    :class:`HParamError` naming ``name``, the value and its type (``hint``: what the values mean, in the message; a
    numpy float no Python float holds exactly too, :func:`_exact_real`)."""
    x = _exact_real(value, name)
    try:
        f = float(x) if isinstance(x, numbers.Real) and not is_bool(x) else math.nan
    except OverflowError:  # an int beyond the float range
        f = math.inf
    if not f >= 0:  # (nan fails it)
        raise HParamError(f"{name} = {value!r:.80} is invalid; expected a number >= 0, inf included (a Python or "
                          f"numpy number, or a 1-element tensor), got {_described(value)}{hint}")
    return f


def finite_number(name: str, value: Any) -> int | float:
    """``value`` as a Python int or float where it is a finite real number (:func:`real_number`: a Python or
    numpy number, a 1-element readable tensor; an integer stays an int; one beyond the float range, an int or a
    numpy float, is no finite number), else an :class:`HParamError` naming
    ``name``, the value and its type (a numpy float no Python float holds exactly too, :func:`_exact_real`).

    Read once where a configuration is built (a numpy ``float32`` was refused, a tensor kept as given)."""
    x = _exact_real(value, name)
    if isinstance(x, numbers.Real) and not is_bool(x):
        x = int(x) if isinstance(x, numbers.Integral) else float(x)
        try:
            if math.isfinite(x):
                return x
        except OverflowError:  # an int beyond the float range
            pass
    raise HParamError(f"{name} = {value!r:.80} is invalid; expected a finite number (a Python or numpy number, or a "
                      f"1-element tensor), got {_described(value)}")


def as_integer(value: Any, name: TensorName = "a 1-element tensor",
               error: type[Exception] = HParamError) -> int | None:
    """``value`` as a Python int where it is an integer (:func:`real_number`: a Python or numpy integer, a
    1-element readable integer tensor; not a bool), else None. For a caller with its own message; else
    :func:`integer`. A tensor outside its storage is refused, ``error`` naming it ``name`` (:func:`real_number`)."""
    x = real_number(value, name, error)
    return int(x) if isinstance(x, numbers.Integral) and not is_bool(x) else None


def integer(name: str, value: Any, minimum: int = 0, error: type[Exception] = HParamError) -> int:
    """``value`` as a Python int >= ``minimum`` where it is an integer (:func:`real_number`: a Python or numpy
    integer, a 1-element readable integer tensor), else ``error`` naming ``name``, the value and its type.

    For counts and sizes: a float, even a whole one, is refused (a count computed in floats is a bug
    upstream), and so is a bool."""
    x = as_integer(value, name, error)
    if x is not None and x >= minimum:
        return x
    x = real_number(value)
    hint = " (a float is refused here, even a whole one)" if isinstance(x, numbers.Real) and not is_bool(x) \
        and not isinstance(x, numbers.Integral) else ""
    raise error(f"{name} = {value!r:.80} is invalid; expected an integer >= {minimum} (a Python or numpy integer, or "
                f"a 1-element integer tensor), got {_described(value)}{hint}")


def fact_value(value: Any, name: TensorName = "a 0-d bool tensor", error: type[Exception] = HParamError) -> Any:
    """``value`` as a Python bool where it is a 0-d bool tensor whose value can be read (not traced), else ``value``
    itself. For flags that state a fact of a step, which a caller may compute with torch (the speculation
    protocol's ``taken``, ``undone``, ``eligible``: as loss_scale's ``overflow``); an option (:func:`flag`) is a
    Python or numpy bool. A tensor whose element lies outside its storage is refused, ``error`` naming it ``name``
    (:func:`~sofx.kernels.storage.refuse_short_storage`)."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 0 and not is_traced(value):
        if not in_storage(value):
            refuse_short_storage(value, name, error)
        return bool(value.item())
    return value


def flag(name: str, value: Any, error: type[Exception] = HParamError) -> bool:
    """``value`` as a Python bool where it is a Python or numpy bool, else ``error`` naming ``name``, the value and
    its type. For on/off options: a string or a number was taken by its truth (``enabled="no"`` as on)."""
    if is_bool(value):
        return bool(value)
    raise error(f"{name} = {value!r:.80} is invalid; expected a bool (True or False), got {_described(value)}")
