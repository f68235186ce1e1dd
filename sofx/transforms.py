"""Gradient transforms: pure, pytree-wide and composable.

Two levels:

* plain functions on numbers and pytrees -- :func:`sumsq`, :func:`global_norm`,
  :func:`all_finite`, :func:`clip_coefficient` (``clip_grad_norm_``),
  :func:`zero_clip_factor` (ZeRO), :func:`scale_tree` -- which the serial loop
  and the speculation layer share, so that both compute bit-identical numbers;
* :class:`GradientTransformation` ``(init, update)`` objects in optax's style,
  composed with :func:`chain`::

      tx = chain(unscale(), check_finite(), clip_by_global_norm(1.0))
      state = tx.init(params)
      grads, state = tx.update(grads, state, params, loss_scale=S)

  ``update(grads, state, params=None, **extra)`` returns new gradients and a
  new state; nothing passed in is modified. ``extra`` carries per-step values
  (``loss_scale``) through a chain. Under ``torch.func`` transforms (``vmap``
  over an ensemble, ``grad`` through the update), autograd or ``torch.compile``
  the same math runs on tensors and the states hold 0-d tensors.

A whole optimizer that skips the steps whose gradients are not finite is
:func:`sofx.apply_if_finite.apply_if_finite` (optax's): ``opt = apply_if_finite(sofx.adamw(), 5)``,
whose ``update(params, grads, state, hparams)`` leaves the params and the inner
state as they are on an inf or a nan, counting those steps.

Gradient accumulation over micro-steps is :func:`accumulate` /
:func:`accumulated` on an immutable :class:`AccumulationState`. Param groups
are hparams prefix trees; :func:`label_params`, :func:`no_decay_labels` and
:func:`group_hparams` build them from a labelling rule.

Math. With ``n = sqrt(sum_i ||g_i||^2)`` over all leaves (``None`` leaves are
absent), ``S`` the loss scale and ``c`` the max norm (a number >= 0, inf included: :func:`max_norm_value`):

* ``clip_grad_norm_`` form: ``coef = c / (n + 1e-6)``; ``g <- g * coef`` iff ``coef < 1``
  (``c = 0`` zeroes every gradient, ``c = inf`` never clips, as torch's).
* ZeRO form (``n`` of the *scaled* gradients): ``clip = max((n/S + 1e-6)/c, 1)``;
  ``g <- g * 1/(clip*S)``; clipping happened iff ``clip > 1``. As DeepSpeed, only for ``c > 0``: its
  ``gradient_clipping`` of 0 (the default) is "off", and inf never clips.
* unscale: ``g <- g / S``. Non-finite check: every element of every leaf finite.
"""

from __future__ import annotations

import collections.abc
import inspect
import math
import numbers
import re
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from sofx import tree
from sofx.adam import AdamHParams
from sofx.errors import HParamError, LeafError, SofxError
from sofx.kernels.base import FLOAT32_MAX, is_traced, vmapped
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.kernels.user_numbers import integer, is_bool, nonnegative_number, positive_number, real_number
from sofx.loss_scale import inverse_scale

__all__ = [
    "CLIP_EPS",
    "max_norm_value",
    "sumsq",
    "total_sumsq",
    "global_norm",
    "all_finite",
    "clip_coefficient",
    "zero_clip_factor",
    "scale_tree",
    "GradientTransformation",
    "EmptyState",
    "ClipState",
    "FiniteState",
    "chain",
    "identity",
    "unscale",
    "clip_by_global_norm",
    "unscale_and_clip_zero",
    "check_finite",
    "AccumulationState",
    "accumulation_init",
    "accumulate",
    "accumulated",
    "label_params",
    "no_decay_labels",
    "merge_hparams",
    "group_hparams",
]

CLIP_EPS = 1e-6  # the 1e-6 of clip_grad_norm_ and of ZeRO's clip factor

MISSING_GRAD_MODES = ("skip", "zero")


# ----------------------------------------------------------------- numbers
def max_norm_value(max_norm: Any, name: str = "max_norm") -> float:
    """``max_norm`` as a Python float where it is a number >= 0, inf included (a Python or numpy number, or a
    1-element tensor: :func:`~sofx.kernels.user_numbers.nonnegative_number`), as ``clip_grad_norm_`` takes it:
    0 zeroes every gradient (``coef = 0/(norm + 1e-6)``), inf leaves them as they are. A negative max_norm
    (torch multiplies the gradients by a negative coefficient: every gradient reversed, the step climbs the
    loss), nan (every gradient nan) or anything else is refused, an :class:`HParamError` naming the value and
    its type (``name``: how the message calls it). No clipping is ``None`` where a caller takes it (or
    :func:`identity`); here, where the call clips, ``None`` is refused saying so."""
    if max_norm is None:  # (the rule's "None: no clipping" is the loops' and the facade's, not this call's)
        raise HParamError(f"{name} = None is invalid here: this call clips (expected a number >= 0, inf included: "
                          "inf never clips); for no clipping leave the clip out (or use identity())")
    return nonnegative_number(name, max_norm, " (as clip_grad_norm_ takes it, 0 zeroes the gradients and inf "
                              "leaves them as they are; None: no clipping; there a negative max_norm would reverse "
                              "every gradient, and nan make them nan)")


_SUMSQ_ROW = 1024  # elements reduced in the tensor's precision before float64 takes over
_SUMSQ_CHUNK = 1 << 20


def sumsq(x: torch.Tensor) -> float:
    """``sum(x**2)`` as a Python float: finite exactly when every element of ``x`` is (for float64 input: and
    the sum is below float64's largest value, i.e. no element beyond ~1e154, where torch's norm is inf too).
    ``x``: a dense floating-point tensor, else a :class:`LeafError` naming it ``sumsq: x`` (as the transforms
    refuse a gradient).
    A tensor whose elements reach past the end of its storage (freed or shrunk:
    :func:`~sofx.kernels.storage.refuse_short_storage`), or without a value to read (a meta tensor, one under
    ``vmap``), is refused, a :class:`LeafError` naming it ``sumsq: x``.

    Rows of 1024 elements are reduced in float32 (float64 for float64 input)
    and the row results summed in float64: one pass at memory speed, no copy,
    relative error ~1e-7 (where the squares are normal float32 numbers: a float32
    row of elements below ~1e-21 in magnitude loses bits, ~1e-3 at 1e-22, most of
    its sum below ~1e-23, as torch's ``clip_grad_norm_`` does; such a norm clips
    nothing). Finite values whose squares overflow float32 (beyond
    ~1e19) are summed again in float64, so inf and nan in the result always
    mean a non-finite element (or a float64 sum beyond its range): one pass gives both the norm and the overflow
    check.
    """
    if not _dense_float(x):  # (a list's storage_offset, torch's vector_norm or reshape raised, naming no argument)
        raise LeafError(_not_dense_float("sumsq", "x", x))
    if _no_value(x):
        raise LeafError(_no_value_refusal("sumsq", "x", x))
    if not in_storage(x):
        refuse_short_storage(x, "sumsq: x")
    return _sumsq(x)


def _no_value(x: torch.Tensor) -> bool:
    """Whether ``x`` has no value a Python number can be read from: a meta tensor, or one a ``vmap`` batches."""
    return x.is_meta or vmapped(x)


def _no_value_refusal(who: str, path: str, x: torch.Tensor) -> str:
    """The refusal of :func:`_no_value`'s ``x`` at ``path`` by ``who``, a function that returns a Python number
    (torch's bare ``item()`` error came from inside it), naming the transformations that take such gradients."""
    why = "a meta tensor holds no value" if x.is_meta else "a tensor under a torch.func transform (vmap) has one " \
        "value per member"
    return (f"{who}: {path}: {why}, and {who} returns a Python number; clip_by_global_norm() and check_finite() "
            "take such gradients (their results tensors)")


def _sumsq(x: torch.Tensor) -> float:
    """:func:`sumsq` of a tensor checked already (:func:`_gradient_leaves`)."""
    flat = x.reshape(-1)
    if flat.numel() == 0:
        return 0.0
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    n = flat.numel() // _SUMSQ_ROW * _SUMSQ_ROW
    total = 0.0
    if n:
        rows = torch.linalg.vector_norm(flat[:n].view(-1, _SUMSQ_ROW), 2, dim=1, dtype=acc)
        total = float(rows.to(torch.float64).square().sum())
    if n < flat.numel():
        tail = torch.linalg.vector_norm(flat[n:], 2, dtype=torch.float64).item()
        total += tail * tail
    if not math.isfinite(total) and bool(torch.isfinite(flat).all()):
        total = 0.0
        for start in range(0, flat.numel(), _SUMSQ_CHUNK):
            part = torch.linalg.vector_norm(flat[start:start + _SUMSQ_CHUNK], 2, dtype=torch.float64).item()
            total += part * part
    return total


def total_sumsq(block_sumsq: Sequence[float | None]) -> float:
    """Sum of per-block sums of squares in block order (``None``: no gradient, left out).

    ``total = sum_b s_b`` over the blocks ``b`` whose ``s_b`` (:func:`sumsq` of the block) is not ``None``,
    added left to right in float64 (Python floats). The order is fixed (block index, not arrival order) so
    that every path that sums the same blocks gets the same bits.

    Each ``s_b`` is a sum of squares: a number >= 0, inf or nan (a non-finite gradient's); a Python or numpy
    number, or a 1-element tensor whose value can be read. Anything else (a negative sum, which made the norm wrong
    without a word; a str, Python's bare TypeError) is refused, an :class:`HParamError` naming its index; so is a
    ``block_sumsq`` that is no sequence (a total, ``4.0``, or ``None``: Python's bare "'float' object is not
    iterable"; a str was summed by its characters).
    """
    if type(block_sumsq) is not list and (isinstance(block_sumsq, (str, bytes))
                                          or not isinstance(block_sumsq, collections.abc.Iterable)):
        raise HParamError(f"total_sumsq: block_sumsq = {block_sumsq!r:.80} ({type(block_sumsq).__name__}) is invalid; "
                          "expected a sequence of the blocks' sums of squares (None: a block without gradient)")
    total = 0.0
    for i, s in enumerate(block_sumsq):
        if s is not None:
            total += s if type(s) is float and not s < 0 else _block_sumsq_value(i, s)
    return total


def _nonnegative_float(value: Any, name: str) -> float | None:
    """``value`` (a Python or numpy number, or a 1-element tensor whose value can be read:
    :func:`~sofx.kernels.user_numbers.real_number`, which refuses anything else naming ``name``) as a Python float
    where it is >= 0, inf or nan (a sum of squares or a norm of a non-finite gradient); ``None`` where it is negative
    or no real number (the caller's refusal)."""
    x = real_number(value, name)
    try:
        f = float(x) if isinstance(x, numbers.Real) and not is_bool(x) else -math.inf
    except OverflowError:  # an int beyond the float range
        f = math.inf
    return f if f >= 0 or math.isnan(f) else None


def _block_sumsq_value(i: int, s: Any) -> float:
    """:func:`total_sumsq`'s ``block_sumsq[i]`` as a Python float, checked."""
    f = _nonnegative_float(s, f"total_sumsq: block_sumsq[{i}]")
    if f is None:
        raise HParamError(f"total_sumsq: block_sumsq[{i}] = {s!r:.80} ({type(s).__name__}) is invalid; expected a "
                          "sum of squares >= 0 (inf or nan where a gradient is not finite: a Python or numpy number, "
                          "or a 1-element tensor whose value can be read) or None (no gradient)")
    return f


def _dense_float(g: Any) -> bool:
    """Whether ``g`` is a dense (strided, not nested) floating-point tensor."""
    return isinstance(g, torch.Tensor) and g.is_floating_point() and g.layout == torch.strided and not g.is_nested


def _not_dense_float(who: str, path: str, g: Any) -> str:
    """The refusal of ``g`` at ``path`` by ``who``, where it is not :func:`_dense_float`: what it is instead."""
    if not isinstance(g, torch.Tensor):
        return f"{who}: {path}: expected a tensor, got {type(g).__name__}"
    if g.is_nested:  # (of strided layout too: torch's operations on it raise, naming no leaf)
        return f"{who}: {path}: expected a dense (strided) tensor, got a nested tensor ({g.layout})"
    if g.layout != torch.strided:
        return f"{who}: {path}: expected a dense (strided) tensor, got {g.layout}"
    return f"{who}: {path}: expected a floating-point tensor, got {g.dtype}"


def _gradient_leaves(grads: Any, who: str = "grads", readable: bool = False) -> list[torch.Tensor]:
    """The leaves of a gradient pytree that are not ``None``, each checked: a dense floating-point tensor whose
    elements lie in its storage (not freed or shrunk, :func:`~sofx.kernels.storage.refuse_short_storage`: torch's
    operations on it crash or read past its end), else a :class:`LeafError` naming ``who`` and the leaf's path.
    The storage test is :func:`~sofx.kernels.storage.in_storage` a leaf (~0.3 us); not under ``torch.compile``.
    ``readable``: ``who`` returns a Python number, and a leaf without a value to read (:func:`_no_value`) is
    refused too."""
    present = tree.leaves(grads)  # (the structure only for a refusal's path: see tree.leaves)

    def path(i: int) -> str:
        return tree.leaf_paths(tree.flatten(grads)[1], root="grads")[i]

    compiling = torch.compiler.is_compiling()  # (no storage to check: Dynamo traces fake tensors)
    for i, g in enumerate(present):
        if not _dense_float(g):
            raise LeafError(_not_dense_float(who, path(i), g))
        if readable and _no_value(g):
            raise LeafError(_no_value_refusal(who, path(i), g))
        if not (compiling or in_storage(g)):
            refuse_short_storage(g, lambda: f"{who}: {path(i)}")
    return present


def global_norm(grads: Any) -> float:
    """The L2 norm over every leaf of a gradient pytree (``None`` leaves are absent).

    ``||g|| = sqrt(sum_leaves sum_i g_i^2)``: :func:`sumsq` per leaf, :func:`total_sumsq` over the leaves in
    tree order, the square root in float64 (a Python float). A leaf without a value to read (a meta tensor, one
    under ``vmap``) is refused, a :class:`LeafError` naming it: :func:`clip_by_global_norm` takes those.
    """
    return math.sqrt(total_sumsq([_sumsq(g) for g in _gradient_leaves(grads, "global_norm", readable=True)]))


def all_finite(grads: Any) -> bool:
    """True when every element of every (non-``None``) leaf is finite (a leaf without a value to read, a meta
    tensor or one under ``vmap``, is refused as by :func:`global_norm`: :func:`check_finite` takes those)."""
    return all(bool(torch.isfinite(g).all()) for g in _gradient_leaves(grads, "all_finite", readable=True))


def _norm_value(who: str, name: str, norm: Any) -> float | torch.Tensor:
    """A gradient norm as a Python float where it is a number >= 0, inf or nan (a non-finite gradient's: a Python
    or numpy number, or a 1-element tensor whose value can be read); a tensor whose value cannot be read
    (:func:`~sofx.kernels.base.is_traced`: vmap, autograd, compile) as it is. Else an :class:`HParamError` naming
    ``who``, ``name``, the value and its type (a negative norm made ``norm + 1e-6`` 0 or of the wrong sign)."""
    if is_traced(norm):
        return norm
    f = _nonnegative_float(norm, f"{who}: {name}")
    if f is None:
        raise HParamError(f"{who}: {name} = {norm!r:.80} is invalid; expected a number >= 0 (a gradient norm: inf or "
                          f"nan where a gradient is not finite; a Python or numpy number, or a 1-element tensor), "
                          f"got {type(norm).__name__}")
    return f


def clip_coefficient(norm: float | torch.Tensor, max_norm: float) -> float | torch.Tensor:
    """``clip_grad_norm_``'s multiplier: ``max_norm / (norm + 1e-6)`` when that is ``< 1``, else 1 (a nan norm
    gives nan, as ``torch.clamp`` keeps it: the gradients become nan, as torch's do).

    ``norm``: a number >= 0, inf or nan (:func:`_norm_value`), or a tensor whose value cannot be read (vmap,
    autograd, compile): then ``torch.clamp(max_norm / (norm + 1e-6), max=1)``, a tensor. ``max_norm``: a number
    >= 0, inf included (:func:`max_norm_value`). Anything else (a negative norm, whose ``norm + 1e-6`` was 0 or
    negative) is refused, an :class:`HParamError` naming the argument and the range expected."""
    max_norm = max_norm_value(max_norm, "clip_coefficient: max_norm")
    norm = _norm_value("clip_coefficient", "norm", norm)
    if isinstance(norm, torch.Tensor):
        return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    coef = max_norm / (norm + CLIP_EPS)
    return 1.0 if coef >= 1.0 else coef


def zero_clip_factor(scaled_norm: float | torch.Tensor, scale: float | torch.Tensor,
                     max_norm: float) -> float | torch.Tensor:
    """ZeRO's clip divisor ``max((scaled_norm/scale + 1e-6) / max_norm, 1)`` (``> 1``: clipping; 1 for a nan
    norm); 1 for a ``max_norm`` of 0, as DeepSpeed clips only where its ``clip_grad > 0`` (0, its default, is "off").

    ``scaled_norm``: a number >= 0, inf or nan (:func:`_norm_value`); ``scale``: the loss scale, a finite number
    > 0; ``max_norm``: a number >= 0, inf included (:func:`max_norm_value`). Where ``scaled_norm`` or ``scale`` is
    a tensor whose value cannot be read (vmap, autograd, compile) the same rule on tensors, a tensor. Anything
    else (a scale of 0, whose division raised a ZeroDivisionError) is refused, an :class:`HParamError` naming the
    argument and the range expected."""
    max_norm = max_norm_value(max_norm, "zero_clip_factor: max_norm")
    scaled_norm = _norm_value("zero_clip_factor", "scaled_norm", scaled_norm)
    if not is_traced(scale):
        scale = positive_number("zero_clip_factor: scale", scale)
    if isinstance(scaled_norm, torch.Tensor) or isinstance(scale, torch.Tensor):
        if max_norm == 0:
            return torch.ones_like(torch.as_tensor(scaled_norm / scale))
        clip_t = (scaled_norm / scale + CLIP_EPS) / max_norm
        return torch.where(clip_t > 1.0, clip_t, torch.ones_like(clip_t))  # (nan: 1, as below)
    if max_norm == 0:
        return 1.0
    clip = ((scaled_norm / scale) + CLIP_EPS) / max_norm
    return clip if clip > 1.0 else 1.0


def scale_tree(grads: Any, factor: float | torch.Tensor) -> Any:
    """Every (non-``None``) leaf multiplied by ``factor`` (new tensors); ``factor`` a finite number or a
    1-element float tensor (on the leaves' device or the CPU; a meta one for meta leaves only).

    A nan or inf factor (every gradient nan or inf) is refused, an :class:`HParamError` naming it: a number, and a
    CPU tensor whose value can be read (its ``item()``, no device sync). A tensor on an accelerator is not read
    (that would wait for the device, where the float path does not), nor one whose value cannot be read (vmap,
    autograd, compile: :func:`~sofx.kernels.base.is_traced`): its nan or inf multiplies as torch's would."""
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or not factor.is_floating_point():
            # a (3,) factor was broadcast against each leaf: a (5, 3) leaf scaled column by column
            raise HParamError(f"scale_tree: factor is a {factor.dtype} tensor of shape {tuple(factor.shape)}; "
                              "expected a finite number or a 1-element float tensor")
    elif isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not _finite_float(factor):
        raise HParamError(f"scale_tree: factor = {factor!r:.60} ({type(factor).__name__}) is invalid; expected a "
                          "finite number or a tensor")
    _gradient_leaves(grads, "scale_tree")
    if isinstance(factor, torch.Tensor):
        _check_device("scale_tree", "factor", factor, grads)
        if not (is_traced(factor) or in_storage(factor)):  # (freed or shrunk: every leaf times bytes past its end)
            refuse_short_storage(factor, "scale_tree: factor", HParamError)
        if factor.device.type == "cpu" and not is_traced(factor) and not _finite_float(factor.item()):
            # (the float path's refusal: a nan factor made every gradient nan without a word)
            raise HParamError(f"scale_tree: factor = {factor!r:.60} is invalid; expected a finite number or a "
                              "1-element float tensor holding one")
        return _scale_by_tensor(grads, factor.reshape(()))
    return tree.tree_map(lambda g: g * factor, grads)


def _finite_float(x: numbers.Real) -> bool:
    """Whether the real number ``x`` is a finite float (an int beyond the float range is not: its ``float`` raised
    a bare OverflowError). By comparison, not ``math.isfinite``: a number that changes between calls of a compiled
    step is a symbolic float there, which ``math.isfinite`` breaks the graph on; nan fails it too."""
    try:
        return -math.inf < float(x) < math.inf
    except OverflowError:
        return False


def _check_device(who: str, name: str, x: Any, grads: Any) -> None:
    """A tensor ``x`` (a factor, a loss scale) that cannot multiply a gradient of ``grads`` for its device (another
    device than the gradient's, but for the CPU, whose 0-d tensors torch takes with any: a meta one, which holds
    no value, for gradients with data) is refused, an :class:`HParamError` naming it and the gradient (torch's bare
    "Tensor on device meta is not on the expected device cpu!" came from the multiply)."""
    if not isinstance(x, torch.Tensor) or x.device.type == "cpu":
        return
    leaves, spec = tree.flatten(grads)
    for i, g in enumerate(leaves):
        if isinstance(g, torch.Tensor) and g.device != x.device:
            path = tree.leaf_paths(spec, root="grads")[i]
            raise HParamError(f"{who}: {name} is a tensor on {x.device}{' (no value)' if x.is_meta else ''}, the "
                              f"gradient {path} on {g.device}: give it on {g.device} (or a float; a meta one goes "
                              "with meta gradients only)")


def _traced(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether any leaf cannot be read on the host (torch.func transforms, autograd, compile)."""
    return any(is_traced(g) for g in leaves)


def _on_tensors(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether a transform computes on tensors: a leaf cannot be read on the host (:func:`_traced`), or a
    ``torch.func`` transform runs (``vmap``, ``grad``), whose function must return tensors, over leaves it does not
    wrap (none, or gradients made outside it): ``vmap`` refused the Python float of their norm in the state ("must
    only return Tensors")."""
    return _traced(leaves) or torch._C._functorch.maybe_current_level() is not None


def _check_one_device(who: str, grads: Any, leaves: Sequence[torch.Tensor]) -> None:
    """The gradients a tensor reduction (:func:`_on_tensors`) combines must lie on one device: ``torch.stack`` of
    their norms (or finite flags) raised torch's bare "Tensor on device meta is not on the expected device cpu!".
    Else a :class:`LeafError` naming ``who``, the first gradient on another device than the first one's, both
    paths and both devices (a meta gradient, which holds no value, among gradients with data included)."""
    device = leaves[0].device if leaves else None
    if all(g.device == device for g in leaves):
        return
    all_leaves, spec = tree.flatten(grads)
    paths = tree.leaf_paths(spec, root="grads")
    present = [(path, g) for path, g in zip(paths, all_leaves) if g is not None]
    (first, g0), (other, g1) = present[0], next((path, g) for path, g in present if g.device != device)
    meta = " (a meta tensor holds no value: it goes with meta gradients only)" if g0.is_meta or g1.is_meta else ""
    raise LeafError(f"{who}: {other} is on {g1.device}, {first} on {g0.device}: the norm of traced gradients (vmap, "
                    f"grad, autograd, compile, meta) is one tensor, of gradients on one device; give them on one "
                    f"device{meta}")


def _global_norm_tensor(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`global_norm` as a 0-d float32 (float64 for float64 leaves) tensor, for traced gradients or a traced
    loss scale; 0 without any leaf, as :func:`global_norm` (``torch.stack`` refused an empty list). Reduced in
    float32 without :func:`sumsq`'s float64 fallback (a float64 reduction was ~30x slower on CPU, measured): finite
    float32 elements beyond ~1e19 (squares past float32's range) give an inf norm here, as torch's
    ``clip_grad_norm_`` does, where the eager norm is finite."""
    if not leaves:
        return torch.zeros(())
    acc = torch.float64 if any(g.dtype == torch.float64 for g in leaves) else torch.float32
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=acc) for g in leaves]))


def _scale_by_tensor(grads: Any, factor: torch.Tensor) -> Any:
    """Every leaf times the 0-d tensor ``factor`` as the float path multiplies by a Python float: in float32
    (float64 for float64 leaves), rounded once to the leaf's dtype. (``factor.to(g.dtype)`` rounded a clip
    coefficient or ``1/S`` to 8 bits for bfloat16 leaves: up to 2 ulps off the eager result.)"""

    def mul(g: torch.Tensor) -> torch.Tensor:
        if g.dtype == torch.float64:
            return g * factor.double()
        return (g.float() * factor.float()).to(g.dtype)

    return tree.tree_map(mul, grads)


# -------------------------------------------------------- transformations
class GradientTransformation(NamedTuple):
    """``init(params) -> state`` and ``update(grads, state, params=None, **extra) -> (grads, state)``."""

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


class ClipState(NamedTuple):
    """What the last clip saw: the global norm and the multiplier applied (1.0: not clipped)."""

    norm: float = math.nan
    coef: float = 1.0


class FiniteState(NamedTuple):
    """Whether the last gradients were all finite, and how many non-finite steps so far."""

    all_finite: bool = True
    nonfinite_steps: int = 0


def _clip_init(params: Any) -> ClipState:
    """A clip's state before its first step: :class:`ClipState`'s defaults; under a ``torch.func`` transform
    (``vmap`` over an ensemble's init), whose function must return tensors, as 0-d tensors of them (vmap refused
    the Python floats)."""
    if _in_func_transform():
        return ClipState(torch.full((), math.nan), torch.ones(()))
    return ClipState()


def _finite_init(params: Any) -> FiniteState:
    """:func:`check_finite`'s state before its first step, as :func:`_clip_init` makes a clip's (under a
    ``torch.func`` transform a 0-d bool and a 0-d int64 tensor)."""
    if _in_func_transform():
        return FiniteState(torch.ones((), dtype=torch.bool), torch.zeros((), dtype=torch.int64))
    return FiniteState()


def identity() -> GradientTransformation:
    """Leaves the gradients as they are."""
    return GradientTransformation(lambda params: EmptyState(),
                                  lambda grads, state, params=None, **extra: (grads, state))


def _not_a_transformation(where: str, t: Any) -> str:
    """The refusal of ``t`` where a :class:`GradientTransformation` is taken, saying what to do for a sofx
    optimizer (optax chains its optimizer last) and for a transformation's function not called."""
    if callable(getattr(t, "update", None)) and callable(getattr(t, "undo", None)):
        name = type(t).__name__
        return (f"{where} is {tree.article(name)} (a sofx optimizer, which is not chained as "
                "optax's: its update takes (params, grads, state, hparams)); chain the gradient transformations, "
                "then opt.update(params, grads, state, hparams) with their gradients")
    if inspect.isfunction(t) and t.__name__ in globals() and globals()[t.__name__] is t:
        return f"{where} is the function {t.__name__}: call it for the transformation, {t.__name__}(...)"
    return f"{where} is {tree.article(type(t).__name__)}, expected a GradientTransformation"


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after another; the state is the tuple of their states.

    The per-step values ``extra`` (``loss_scale``) go to each transform whose ``update`` takes them: all of them
    where it has ``**extra``, else those it names (an optax-style ``update(grads, state, params=None)`` gets none,
    as optax's chain gives extra arguments only to the transforms that take them)."""
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise SofxError(_not_a_transformation(f"chain: argument {i}", t))
    taken = [_keywords_taken(t.update) for t in transforms]

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None, **extra: Any) -> tuple[Any, tuple[Any, ...]]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise SofxError(f"chain: expected a state tuple of {len(transforms)} entries, got {state!r:.80}")
        new_states = []
        for t, names, s in zip(transforms, taken, state):
            given = extra if names is None else {k: v for k, v in extra.items() if k in names}
            grads, s = t.update(grads, s, params, **given)
            new_states.append(s)
        return grads, tuple(new_states)

    return GradientTransformation(init, update)


def _keywords_taken(update: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword arguments ``update`` takes after ``(grads, state, params)``: ``None`` for any (``**extra``, or a
    signature that cannot be read), else the names of its other parameters: its positional-or-keyword ones after
    the first three, and its keyword-only ones (after ``*args``, which takes params where it comes third or
    before, they are keywords all the same)."""
    try:
        parameters = list(inspect.signature(update).parameters.values())
    except (TypeError, ValueError):  # a builtin or an object without a readable signature: give it everything
        return None
    kind = inspect.Parameter
    if any(p.kind is kind.VAR_KEYWORD for p in parameters):
        return None
    positional = [p for p in parameters if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)]
    return frozenset([p.name for p in positional[3:] if p.kind is kind.POSITIONAL_OR_KEYWORD]
                     + [p.name for p in parameters if p.kind is kind.KEYWORD_ONLY])


def _check_state(who: str, state: Any, expected: type, made_by: str) -> None:
    """A state of another type than the transformation's own is refused, naming both (an AttributeError later)."""
    if not isinstance(state, expected):
        raise SofxError(f"{who}: state is {tree.article(type(state).__name__)}; expected "
                        f"{tree.article(expected.__name__)} (as {made_by} makes it)")


def _loss_scale(extra: Mapping[str, Any], who: str) -> float | torch.Tensor:
    """The loss scale ``S`` passed to ``update``: a checked float (finite, > 0, and ``1/S`` within float32's
    range), or a 0-d tensor as is where its value cannot be read (``vmap`` over loss scales, ``compile``). While
    ``torch.compile`` traces, a number is checked by comparisons (guards) and given as a 0-d float64 tensor: a
    scale that changes from call to call (a dynamic loss scale) is a symbolic float there, which ``math.isfinite``
    and :func:`~sofx.loss_scale.inverse_scale`'s float32 rounding do not take (a graph break at the second
    step); the tensor path unscales with the same bits."""
    if "loss_scale" not in extra:
        raise SofxError(f"{who}: pass the loss scale of this backward as update(..., loss_scale=S)")
    s = extra["loss_scale"]
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or not s.is_floating_point():
            raise HParamError(f"{who}: loss_scale must be a number or a 1-element float tensor, got {s.dtype} "
                              f"{tuple(s.shape)}")
        if is_traced(s):
            return s.reshape(())
        s = real_number(s, f"{who}: loss_scale")
    if isinstance(s, bool) or not isinstance(s, numbers.Real):
        raise HParamError(f"{who}: loss_scale must be a number or a 1-element float tensor, got {type(s).__name__}")
    try:
        f = float(s)
    except OverflowError:  # an int beyond the float range
        f = math.inf
    if not 0 < f < math.inf:  # (a comparison, not math.isfinite: a guard under compile; nan is refused too)
        raise HParamError(f"{who}: loss_scale = {s!r:.80} is invalid; expected a finite number > 0")
    if not 1.0 / f <= FLOAT32_MAX:  # (sofx.serial.can_unscale: such a scale makes the serial loop's step an overflow)
        raise HParamError(f"{who}: loss_scale = {s!r:.80} is invalid: 1/loss_scale = {1.0 / f!r} is beyond float32's "
                          f"range (unscaled gradients would be inf, or 0 * inf = nan); expected a loss scale >= "
                          f"1/{FLOAT32_MAX!r}")
    if torch.compiler.is_compiling():
        return torch.ones((), dtype=torch.float64) * f
    return f


def unscale() -> GradientTransformation:
    """``g <- g * float32(1/S)`` with ``S = extra['loss_scale']`` (``GradScaler.unscale_``, whose ``inv_scale`` is a
    float32 tensor: float64 gradients are multiplied by the float32 value too,
    :func:`~sofx.loss_scale.inverse_scale`); a scale whose ``1/S`` is beyond float32's range (every gradient inf)
    is refused, where the serial loop counts it an overflow."""

    def update(grads: Any, state: EmptyState, params: Any = None, **extra: Any) -> tuple[Any, EmptyState]:
        s = _loss_scale(extra, "unscale")
        _gradient_leaves(grads, "unscale")
        _check_device("unscale", "loss_scale", s, grads)
        if isinstance(s, torch.Tensor):  # as the float path: 1/S in float64 rounded to float32 (GradScaler's)
            return _scale_by_tensor(grads, torch.reciprocal(s.double()).float()), state
        inv = inverse_scale(s)
        return (grads if s == 1.0 else tree.tree_map(lambda g: g * inv, grads)), state

    return GradientTransformation(lambda params: EmptyState(), update)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_``: ``g <- g * max_norm/(norm + 1e-6)`` when that is ``< 1``.

    ``max_norm``: a number >= 0 (Python, numpy or a 1-element tensor: :func:`max_norm_value`), read once here as
    a float; 0 zeroes every gradient (a negative element becomes -0.0, as torch's), inf leaves them as they are.

    The rule is torch's; the precision is not. ``norm`` is :func:`global_norm` (float32 rows summed in
    float64) and ``coef`` a Python float, whatever the gradients' dtype. torch computes each gradient's norm,
    the total and the coefficient in the gradients' dtype: for bfloat16 (float16) gradients it rounds the norm
    and the coefficient to 8 (11) significant bits, up to 2**-9 (2**-12) relative each, and a clipped gradient
    can come out a few ulps off this one (up to 1% relative, measured). Here bf16/fp16 gradients are clipped
    as ``clip_grad_norm_`` clips their float32 copies, rounded once to the gradient's dtype (bf16: the same
    bits where measured; fp16: a few elements in a thousand one ulp off), as the offload engine's fp32 masters and
    ``serial_step`` take them.

    Traced (vmap, autograd, compile) the norm is a float32 reduction, as torch's: gradients with finite elements
    beyond ~1e19 have an inf norm there, coefficient 0 (zeroed, as ``clip_grad_norm_`` zeroes them), where the
    eager norm, summed again in float64 (:func:`sumsq`), is finite and clips them to ``max_norm``."""
    max_norm = max_norm_value(max_norm)

    def update(grads: Any, state: ClipState, params: Any = None, **extra: Any) -> tuple[Any, ClipState]:
        leaves = _gradient_leaves(grads, "clip_by_global_norm")
        if _on_tensors(leaves):  # torch.func (vmap, grad), autograd, compile: the same math on tensors
            _check_one_device("clip_by_global_norm", grads, leaves)
            norm_t = _global_norm_tensor(leaves)
            coef_t = torch.clamp(max_norm / (norm_t + CLIP_EPS), max=1.0)
            return _scale_by_tensor(grads, coef_t), ClipState(norm_t, coef_t)
        norm = math.sqrt(total_sumsq([_sumsq(g) for g in leaves]))
        coef = clip_coefficient(norm, max_norm)
        return (grads if coef == 1.0 else tree.tree_map(lambda g: g * coef, grads)), ClipState(norm, coef)

    return GradientTransformation(_clip_init, update)


def unscale_and_clip_zero(max_norm: float | None) -> GradientTransformation:
    """ZeRO's combined unscale and clip: ``g <- g / (clip * S)``, ``clip = max((n/S + 1e-6)/max_norm, 1)``.

    ``n`` is the norm of the *scaled* gradients and ``S = extra['loss_scale']``
    (in ZeRO, the scale after this step's loss-scale update). ``max_norm=None``
    only unscales, and so does 0 (DeepSpeed clips only where ``clip_grad > 0``: its ``gradient_clipping`` of 0,
    the default, is "off") and inf. The state's ``norm`` is the unscaled norm ``n / S``.
    """
    max_norm = None if max_norm is None else max_norm_value(max_norm)
    if max_norm == 0:
        max_norm = None

    def update(grads: Any, state: ClipState, params: Any = None, **extra: Any) -> tuple[Any, ClipState]:
        s = _loss_scale(extra, "unscale_and_clip_zero")
        leaves = _gradient_leaves(grads, "unscale_and_clip_zero")
        _check_device("unscale_and_clip_zero", "loss_scale", s, grads)
        if _on_tensors(leaves) or isinstance(s, torch.Tensor):
            _check_one_device("unscale_and_clip_zero", grads, leaves)
            scaled_t = _global_norm_tensor(leaves)
            if max_norm is None:
                clip_t = torch.ones_like(scaled_t)
            else:  # clipped only where clip > 1, as the float path: a nan clip (a nan norm, inf / inf) is 1 there
                clip_t = (scaled_t / s + CLIP_EPS) / max_norm
                clip_t = torch.where(clip_t > 1.0, clip_t, torch.ones_like(clip_t))
            return _scale_by_tensor(grads, 1.0 / (clip_t * s)), ClipState(scaled_t / s, 1.0 / clip_t)
        scaled = math.sqrt(total_sumsq([_sumsq(g) for g in leaves]))
        clip = 1.0 if max_norm is None else zero_clip_factor(scaled, s, max_norm)
        combined = clip * s
        return ((grads if combined == 1.0 else tree.tree_map(lambda g: g * (1.0 / combined), grads)),
                ClipState(scaled / s, 1.0 / clip))

    return GradientTransformation(_clip_init, update)


def check_finite() -> GradientTransformation:
    """Records in its state whether every gradient element is finite (gradients pass unchanged)."""

    def update(grads: Any, state: FiniteState, params: Any = None, **extra: Any) -> tuple[Any, FiniteState]:
        _check_state("check_finite", state, FiniteState, "check_finite().init(params)")
        # (a str raised a bare TypeError at a non-finite step, -1 became 0, 1.5 counted on as 2.5)
        steps = _state_count("check_finite", "nonfinite_steps", state.nonfinite_steps)
        leaves = _gradient_leaves(grads, "check_finite")
        if _on_tensors(leaves):  # (no leaf: True, as the float path)
            _check_one_device("check_finite", grads, leaves)
            ok_t = torch.stack([torch.isfinite(g).all() for g in leaves]).all() if leaves else \
                torch.ones((), dtype=torch.bool)
            return grads, FiniteState(ok_t, steps + (~ok_t).to(torch.int64))
        ok = all(bool(torch.isfinite(g).all()) for g in leaves)
        return grads, FiniteState(ok, steps + (0 if ok else 1))

    return GradientTransformation(_finite_init, update)


# ------------------------------------------------------------ accumulation
class AccumulationState(NamedTuple):
    """Gradients summed over the micro-steps so far (``None`` leaves: no gradient yet), and how many micro-steps
    (an integer >= 0: a Python int eagerly, a 0-d int64 tensor from :func:`accumulate` under a ``torch.func``
    transform, ``vmap`` or ``grad``, whose function must return tensors).

    Under a ``torch.func`` transform (:func:`accumulation_init` and :func:`accumulate` there) a leaf without a
    gradient yet is a 0-d bool tensor instead of ``None`` (``vmap`` refused ``None`` in the state it returns:
    "must only return Tensors"); a state passed in takes either for no gradient yet (a sum is of the parameter's
    floating dtype, never bool)."""

    total: Any
    micro_steps: int = 0


def _in_func_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``) runs, whose function must return tensors."""
    return torch._C._functorch.maybe_current_level() is not None


def _no_gradient_yet() -> torch.Tensor:
    """A leaf's total before its first gradient under a ``torch.func`` transform (:class:`AccumulationState`)."""
    return torch.zeros((), dtype=torch.bool)


def _total_or_none(t: Any) -> Any:
    """A state's total ``t`` of one leaf, ``None`` where it stands for no gradient yet (``None``, or a 0-d bool
    tensor: :class:`AccumulationState`)."""
    return None if isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() == 0 else t


def accumulation_init(params: Any) -> AccumulationState:
    """No gradient yet for any leaf of ``params`` (under a ``torch.func`` transform: 0-d tensors,
    :class:`AccumulationState`)."""
    if _in_func_transform():
        return AccumulationState(tree.tree_map(lambda _: _no_gradient_yet(), params),
                                 torch.zeros((), dtype=torch.int64))
    return AccumulationState(tree.tree_map(lambda _: None, params), 0)  # (see _like_params)


def _like_params(params: Any, spec: Any, values: Sequence[Any]) -> Any:
    """``values`` (one per leaf, in :func:`sofx.tree.flatten`'s order) in the structure ``spec`` of ``params``. Where
    every value is ``None`` by a map over ``params``: under ``torch.compile`` dynamo's stand-in for optree did not
    unflatten a spec over leaves that are all ``None`` (an InternalTorchDynamoError, "unhashable type: 'list'").
    (Only there: its map visits a dict's leaves in insertion order, its flatten in sorted key order.)"""
    if all(v is None for v in values):
        return tree.tree_map(lambda _: None, params)
    return tree.unflatten(spec, values)


def _micro_steps(who: str, state: AccumulationState) -> int | torch.Tensor:
    """``state.micro_steps`` read by :func:`_state_count` (-1 became 0 after a micro-step, 1.0 became 2.0)."""
    return _state_count(who, "micro_steps", state.micro_steps)


def _state_count(who: str, field: str, n: Any) -> int | torch.Tensor:
    """A state's count ``n`` (its ``field``) as a Python int where it is an integer >= 0 (a Python or numpy integer,
    or a 1-element integer tensor), an integer tensor whose value cannot be read (vmap, autograd, compile) as it is;
    else a :class:`SofxError` naming ``who`` and ``state.<field>``."""
    if isinstance(n, torch.Tensor) and is_traced(n) and not n.is_floating_point() and not n.is_complex() \
            and n.dtype != torch.bool:
        return n
    return integer(f"{who}: state.{field}", n, 0, SofxError)


def accumulate(state: AccumulationState, grads: Any, params: Any) -> AccumulationState:
    """Add one micro-step's gradients (``None`` leaves: no gradient this micro-step; ``grads=None``: none for any
    leaf, as :meth:`sofx.Adam.update` and the loop steps take it).

    The sum is ``first + second + ...`` in micro-step order, as autograd
    accumulates into ``.grad``. Nothing passed in is modified, and the state
    holds no tensor passed in: a first gradient is copied, so that a loop that
    reuses its gradient buffers (``zero_grad(set_to_none=False)``) keeps its sum.
    """
    _check_state("accumulate", state, AccumulationState, "accumulation_init(params)")
    micro_steps = _micro_steps("accumulate", state)
    leaves, spec = tree.flatten(params)
    paths = tree.leaf_paths(spec)
    _check_params("accumulate", paths, leaves)
    new = tree.flatten_up_to(spec, grads, "grads") if grads is not None else [None] * len(leaves)
    old = [_total_or_none(t) for t in tree.flatten_up_to(spec, state.total, "accumulated gradients")]
    for path, p, acc, g in zip(paths, leaves, old, new):
        if g is not None:
            _check_grad(path, g, p)
        if acc is not None:  # a state of other params: acc + g broadcast a (1, n) sum to (m, n)
            _check_grad(path, acc, p, "state.total")
    out = [acc if g is None else g.clone() if acc is None else acc + g for acc, g in zip(old, new)]
    micro_steps = micro_steps + 1
    if _in_func_transform():  # (whose function must return tensors: vmap refused the Python int, and None totals)
        if not isinstance(micro_steps, torch.Tensor):
            micro_steps = torch.tensor(micro_steps, dtype=torch.int64)
        out = [_no_gradient_yet() if t is None else t for t in out]
    return AccumulationState(_like_params(params, spec, out), micro_steps)


def accumulated(state: AccumulationState, params: Any, missing_grad: str = "skip") -> Any:
    """The summed gradients; a leaf that got no gradient in any micro-step is ``None``
    (``missing_grad="skip"``: torch.optim leaves it untouched) or zeros (``"zero"``: DeepSpeed)."""
    if missing_grad not in MISSING_GRAD_MODES:
        raise HParamError(f"missing_grad={missing_grad!r}; expected one of {MISSING_GRAD_MODES}")
    _check_state("accumulated", state, AccumulationState, "accumulation_init(params)")
    _micro_steps("accumulated", state)
    leaves, spec = tree.flatten(params)
    _check_params("accumulated", tree.leaf_paths(spec), leaves)
    totals = [_total_or_none(t) for t in tree.flatten_up_to(spec, state.total, "accumulated gradients")]
    for path, p, t in zip(tree.leaf_paths(spec), leaves, totals):
        if t is not None:
            _check_grad(path, t, p, "state.total")
    if missing_grad == "zero":
        totals = [torch.zeros_like(p) if t is None else t for p, t in zip(leaves, totals)]
    return _like_params(params, spec, totals)


def _check_params(who: str, paths: Sequence[str], leaves: Sequence[Any]) -> None:
    """Every leaf of ``params`` (the gradients' shapes, dtypes and devices are read from them) must be a tensor, else
    a :class:`LeafError` naming ``who`` and its path (a float raised a bare AttributeError from ``p.shape``, and
    ``zeros_like`` a TypeError; a numpy array's dtype was compared to the gradient's: "expected dtype float64")."""
    for path, p in zip(paths, leaves):
        if not isinstance(p, torch.Tensor):
            raise LeafError(f"{who}: {path}: expected a tensor, got {type(p).__name__}")


def _check_grad(path: str, g: Any, p: torch.Tensor, root: str = "grads") -> None:
    """``g`` (a gradient, or a sum of them: ``root``) must be a tensor of the shape, dtype and device of ``p``, whose
    elements lie in its storage (:func:`~sofx.kernels.storage.refuse_short_storage`)."""
    gpath = root + path[len("params"):]
    if not isinstance(g, torch.Tensor):
        raise LeafError(f"{gpath}: expected a tensor, got {type(g).__name__}")
    if g.is_nested:  # (its shape cannot be read: torch's "Internal error")
        raise LeafError(f"{gpath}: expected a dense (strided) tensor, got a nested tensor ({g.layout})")
    if g.shape != p.shape:
        raise LeafError(f"{gpath}: expected shape {tuple(p.shape)}, got {tuple(g.shape)}")
    if g.dtype != p.dtype:
        raise LeafError(f"{gpath}: expected dtype {p.dtype}, got {g.dtype}")
    if g.device != p.device:
        raise LeafError(f"{gpath}: expected device {p.device}, got {g.device}")
    if not (torch.compiler.is_compiling() or in_storage(g)):  # (freed or shrunk: acc + g read past its end)
        refuse_short_storage(g, gpath)


# ------------------------------------------------------------- param groups
def label_params(params: Any, label_fn: Callable[[str, torch.Tensor], str]) -> Any:
    """A tree of labels: ``label_fn(path, param)`` for every leaf (path as in error messages)."""
    if not callable(label_fn):
        raise HParamError(f"label_fn = {label_fn!r:.60} ({type(label_fn).__name__}) is invalid; expected a callable "
                          "(path, param) -> label")
    leaves, spec = tree.flatten(params)
    paths = tree.leaf_paths(spec)
    labels = [label_fn(path, p) for path, p in zip(paths, leaves)]
    for path, label in zip(paths, labels):
        inner = tree.flatten(label)[0]
        if len(inner) != 1 or inner[0] is not label or not _hashable(label):
            # None is an empty subtree: the leaf dropped out of the labels, and group_hparams gave it the
            # optimizer's defaults instead of base (a scheduled lr ignored); a tuple or a dict became a subtree; a
            # set or a numpy array names no group (group_hparams' lookup raised a bare "unhashable type")
            raise HParamError(f"label_fn returned {label!r:.60} ({type(label).__name__}) for {path}; expected a "
                              "label that is neither None nor a container, and hashable (e.g. a string)")
    return tree.unflatten(spec, labels)


# A path's names: split at non-alphanumerics and camel case ("LayerNorm" -> "Layer", "Norm"); the names of a
# bias or a normalization layer, with a number (norm1, ln_2 -> "ln", "2") or BatchNorm's "2d".
_NAME_PARTS = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_NO_DECAY_NAME = re.compile(r"(?:[a-z0-9]*norm|ln|bias)(?:\d+d?)?")


def _names_bias_or_norm(path: str) -> bool:
    """Whether a name in ``path`` is a bias or a normalization layer: ``bias`` (``qkv_bias``), a name ending
    in ``norm`` (``norm1``, ``layernorm``, ``LayerNorm``, ``rms_norm``, ``BatchNorm2d``) or ``ln`` (``ln_1``,
    ``ln_f``); not a name that merely contains those letters (``abnormal_proj``, ``kiln``)."""
    return any(_NO_DECAY_NAME.fullmatch(part.lower()) for part in _NAME_PARTS.split(path))


def no_decay_labels(params: Any, decay: str = "decay", no_decay: str = "no_decay", *, batch_dims: int = 0) -> Any:
    """``no_decay`` for biases and normalization weights, ``decay`` for the rest.

    A leaf is ``no_decay`` when it has fewer than 2 dimensions (biases, norm
    scales) or a name in its path is a bias or a norm (``bias``, ``qkv_bias``,
    ``norm1``, ``LayerNorm``, ``ln_f``; not ``abnormal_proj``). ``batch_dims``:
    leading dimensions not counted (1 for an ensemble's stacked parameters,
    ``torch.func.stack_module_state``); a leaf with fewer dimensions than that (not stacked) is refused, a
    :class:`LeafError` naming it, its shape and ``batch_dims``.
    """
    batch_dims = integer("batch_dims", batch_dims, 0)  # numpy's too, as a Python int

    def rule(path: str, p: torch.Tensor) -> str:
        if not isinstance(p, torch.Tensor):  # (an AttributeError from p.dim())
            raise LeafError(f"no_decay_labels: {path}: expected a tensor, got {type(p).__name__}")
        if p.dim() < batch_dims:  # (labelled no_decay without a word: its dims after the batch dims were < 0)
            raise LeafError(f"no_decay_labels: {path}: has {p.dim()} dimension{'' if p.dim() == 1 else 's'} (shape "
                            f"{tuple(p.shape)}), fewer than batch_dims = {batch_dims} (the leading dimensions "
                            "stacked, not counted); expected every leaf stacked alike")
        return no_decay if p.dim() - batch_dims < 2 or _names_bias_or_norm(path) else decay

    return label_params(params, rule)


def merge_hparams(base: AdamHParams, override: AdamHParams | None) -> AdamHParams:
    """``base`` with every field that ``override`` sets (not ``None``) replaced."""
    _check_is_hparams("base", base)
    if override is None:
        return base
    _check_is_hparams("override", override)
    return AdamHParams(*(b if o is None else o for b, o in zip(base, override)))


def _check_is_hparams(name: str, x: Any) -> None:
    if not isinstance(x, AdamHParams):
        raise HParamError(f"{name} is {tree.article(type(x).__name__)}; expected sofx.AdamHParams (e.g. "
                          f"AdamHParams(weight_decay=0.0), not a dict or a tuple)")


def group_hparams(labels: Any, groups: Mapping[str, AdamHParams], base: AdamHParams | None = None, *,
                  params: Any = None) -> Any:
    """A per-leaf hparams tree (a valid prefix of the params tree) from labels.

    Leaf ``x`` gets ``merge_hparams(base, groups[label(x)])``: e.g. ``base`` from a
    schedule and ``groups = {"decay": AdamHParams(), "no_decay": AdamHParams(weight_decay=0.0)}``.

    Every label names a group: a ``None`` label is refused naming its path (in an hparams tree ``None`` means
    the optimizer's defaults, which would give that leaf neither ``base`` nor a group). Where ``params`` has
    an empty subtree (``None``), :func:`label_params` leaves ``None`` in the labels: pass ``params=params``,
    and a ``None`` label there is taken as that empty subtree (``None`` in the hparams tree).
    """
    _check_no_none_label(labels, params)
    base = base if base is not None else AdamHParams()
    _check_is_hparams("base", base)
    if not isinstance(groups, Mapping):
        raise HParamError(f"groups is {tree.article(type(groups).__name__)}; expected a mapping label -> AdamHParams "
                          "(e.g. {'no_decay': AdamHParams(weight_decay=0.0)})")
    for label, hp in groups.items():
        if hp is not None:
            _check_is_hparams(f"groups[{label!r}]", hp)
    leaves, spec = tree.flatten(labels)
    out = []
    for path, label in zip(tree.leaf_paths(spec, root="labels"), leaves):
        if not _hashable(label):  # (the lookup raised a bare TypeError, "unhashable type: 'set'")
            raise HParamError(f"{path} = {label!r:.60} ({type(label).__name__}) is unhashable and names no group; "
                              f"expected a hashable label (e.g. a string); groups are {_group_names(groups)}")
        if label not in groups:
            raise HParamError(f"{path} = {label!r} names no group; groups are {_group_names(groups)}")
        out.append(merge_hparams(base, groups[label]))
    return tree.unflatten(spec, out)


def _hashable(label: Any) -> bool:
    """Whether ``label`` can be looked up in a mapping (a set, a numpy array or a bytearray cannot)."""
    try:
        hash(label)
    except TypeError:
        return False
    return True


def _group_names(groups: Mapping[Any, Any]) -> list[Any]:
    """The labels of ``groups`` for an error message: sorted, or in the mapping's order where they do not sort
    together (``"decay"`` and ``0``: ``sorted`` raised a TypeError in place of the message)."""
    try:
        return sorted(groups)
    except TypeError:
        return list(groups)


def _check_no_none_label(labels: Any, params: Any) -> None:
    """Refuse a ``None`` label, naming its path; given ``params``, one over an empty subtree of ``params``
    (``None`` there too) passes, and ``labels`` must be a prefix of the structure of ``params``."""
    if params is None:
        leaves, spec = tree.flatten(labels, is_leaf=lambda x: x is None)
        hint = ("; where params has an empty subtree (None), pass group_hparams(..., params=params) to have it "
                "taken as one")
    else:  # one label per leaf of params: a None over an empty subtree covers no leaf
        spec = tree.flatten(params)[1]
        leaves = tree.broadcast_prefix(labels, spec, is_leaf=lambda x: False, what="labels")
        hint = ""
    for path, label in zip(tree.leaf_paths(spec, root="labels"), leaves):
        if label is None:
            raise HParamError(f"{path} is None: a label must name a group, got None (it would give that leaf the "
                              f"optimizer's defaults, neither base nor a group){hint}")
