"""The kernel contract: what every backend (reference, cpu, triton) implements.

A kernel works on flat (or any same-shaped) tensors of one parameter block and
knows nothing of pytrees, threads or speculation. Every backend module exposes

``step(p, g, m, v, s, variant, *, out=None, p_copy=None) -> (p', m', v')``
    One Adam step (DESIGN.md "Numerics reference").
``undo(p', g, m', v', s, variant, *, p_old=None, out=None, p_copy=None) -> (p, m, v)``
    The algebraic inverse of ``step`` (SPECULATION.md section 2). With
    ``p_old`` the parameter is restored from that snapshot (exactly) and only
    the moments are recomputed.
``undo_redo(p', m', v', g_old, s_old, g_new, s_new, variant, *, p_old=None, out=None, p_copy=None)``
    ``step(*undo(p', g_old, m', v', s_old), g_new, s_new)`` as one call (fused
    in the fast backends).
``step_many(calls, variant)``, ``undo_many(calls, variant)``, ``undo_redo_many(calls, variant)``
    The same for a list of blocks (:class:`StepCall`, :class:`UndoCall`,
    :class:`UndoRedoCall`, each with its own scalars): a list of ``(p, m, v)``
    in order. The Triton backend launches one kernel per group of blocks with
    the same dtypes and scalars, the CPU backends run all blocks in one call of
    their native code (a model's many small tensors cost one launch, as
    torch's fused optimizers do); the reference runs its one-block math per
    block. Every block is checked before any is computed: a bad block raises
    an error naming it (``"cpu.undo_many[3]: ..."``) and nothing is written.
``supports(device, param_dtype, state_dtype) -> bool``
``CHECKS_OVERLAP``
    Whether the list forms refuse a call whose written arrays (``out`` but
    where it is the very input it replaces, ``p_copy``, ``skip``) share
    memory with any other array of the call, raising
    :class:`MemoryOverlapError` before anything is computed, so that the
    pytree layer may leave that check to them (the cpu backends, from their
    native table, and triton). The reference's entries refuse such calls too
    (:func:`sofx.kernels.donation.refuse_shared_memory`) but cannot compare
    what ``torch.func`` wrappers hold, which the pytree layer does.
``CHECKS_FINITE``
    Whether ``step_many`` and ``undo_redo_many`` take checked steps (``skip``, see :data:`FINITE_CHUNK`).
``native_refusal()`` (optional, the CPU backends)
    Why the backend, asked for by name, refuses to run here (its native kernels are unavailable: no
    compiler, a failed build), or None; :func:`sofx.kernels.select_backend` raises it.
``RUNS_CHUNK_LISTS`` (optional, the CPU backends)
    Whether the backend has ``step_chunks(calls, variant)`` and ``undo_redo_chunks(calls, variant)``: a
    step or an undo+redo on listed chunks of blocks alone, in one call (:mod:`sofx.kernels.chunked`, whose
    ``range_calls`` gives any backend the same through its list forms); and ``prepare_chunks(calls, variant,
    step)``: either of them checked now (nothing written), run by the function it returns.

``out=(p_out, m_out, v_out)`` receives the results and may alias the inputs
(buffer donation); without it the inputs are left untouched. ``p_copy``, a
float tensor of ``p``'s shape and device in any float dtype, also receives the
new parameters, cast to its dtype as ``p_copy.copy_(p')`` would (the offload
engine's model parameters; the CPU and Triton kernels write it in the same
pass). It must not overlap the other tensors. ``p`` is any
float dtype, ``g`` any float dtype, ``m``/``v`` the state dtype; the math is
done in float32 (float64 when ``p`` is float64) and rounded on store.

Every tensor of the caller's that a call writes in place (``out``, donated or not, ``p_copy``, a checked call's
``skip``, a chunk list's kept values) gets its version counter bumped, as by torch's in-place operations: a
backward through a graph that saved one of them then raises, as with ``torch.optim``, instead of computing the
gradient of the values it overwrote. The native and Triton backends write raw memory and bump it themselves
(:func:`mark_written`); what a call only reads keeps its counter.

Every tensor of a call must lie in its storage: one whose memory was freed (``untyped_storage().resize_(0)``, as
FSDP frees tensors) or shrunk would have native code (and torch's own operations) read and write outside any
allocation, so every entry refuses it first (:func:`~sofx.kernels.storage.refuse_short_storage`). A caller that
has checked every tensor of its calls so already (:class:`sofx.Adam`, leaf by leaf, naming leaf paths) sets
:data:`STORAGE_CHECKED` around them, and the cpu backends' common case then does not check again (~0.2 us a
tensor).

Traced tensors (one that requires grad while grad mode is on, a ``torch.func`` transform's): the reference's
results are differentiable (autograd and the transforms record its torch operations); the native and Triton
backends read raw values and refuse any such tensor argument before writing anything
(:func:`refuse_traced`). :class:`sofx.Adam` never sends them one: it steps traced leaves by the reference.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import struct
import sys
from typing import Any, Callable, Collection, Iterable, NamedTuple, Sequence, Union

import torch
from torch.autograd.graph import increment_version

from sofx.errors import HParamError, LeafError, UnsupportedError
from sofx.kernels.layout import in_memory_order, one_dense_layout, same_layout
from sofx.kernels.storage import TensorName, in_storage, refuse_short_storage

Scalar = Union[float, int, torch.Tensor]


class MemoryOverlapError(LeafError):
    """A list form's written array shares memory with another array of the call (nothing was computed).

    ``first``/``second``: ``(block index, role)``, role one of ``"p", "g"`` (``"g_old"`` in an undo+redo),
    ``"m", "v", "g_new", "p_old", "out[0]", "out[1]", "out[2]", "p_copy", "skip"``; ``first`` is written.
    """

    def __init__(self, message: str, first: tuple[int, str], second: tuple[int, str]) -> None:
        super().__init__(message)
        self.first, self.second = first, second


class AdamVariant(NamedTuple):
    """Static configuration of an Adam kernel (fixed at optimizer construction).

    ``decoupled``: AdamW's decoupled weight decay ``p *= 1 - lr*wd`` (else L2: ``g += wd*p``).
    ``bias_correction``: divide by ``1 - beta**t`` (else both corrections are 1).
    """

    decoupled: bool = True
    bias_correction: bool = True


class AdamScalars(NamedTuple):
    """The dynamic values one step uses: hparams, the step number and a gradient multiplier.

    ``step`` is ``t`` of the step being taken (the first step is 1). The
    gradient a kernel uses is ``g * grad_scale`` (unscaling and clipping folded
    into one multiplier); the inverse must be given the same value. Each field
    is a Python number or a 0-d tensor.
    """

    lr: Scalar
    beta1: Scalar
    beta2: Scalar
    eps: Scalar
    weight_decay: Scalar
    step: Scalar
    grad_scale: Scalar = 1.0


def scalars_key(s: AdamScalars) -> tuple:
    """A dict key for the values of ``s`` that a kernel computes with: ``s`` itself, and the sign of each float zero
    in it. ``0.0 == -0.0``, so ``s`` alone is one key for both, but they step differently: ``p - lr*u`` with
    ``lr = -0.0`` gives a ``-0.0`` parameter element the other sign (as
    ``sofx.speculation.decisions._same_number`` says)."""
    return s, tuple(type(x) is float and x == 0 and math.copysign(1.0, x) < 0 for x in s)


def vmapped(x: torch.Tensor) -> bool:
    """Whether a ``torch.func.vmap`` level batches ``x`` (at any depth of the transforms that wrap it): its value
    is one per member, which no host code can read as one number."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        if torch._C._functorch.is_batchedtensor(x):
            return True
        x = torch._C._functorch.get_unwrapped(x)
    return False


def is_traced(x: object) -> bool:
    """True for a tensor whose value cannot be read on the host right now.

    That is a tensor wrapped by a ``torch.func`` transform (vmap, grad), a
    tensor that requires grad while grad mode is on (autograd records what is
    computed from it; under ``torch.no_grad()`` a model's parameters are plain
    values, as ``torch.optim`` steps them), a meta tensor (shapes only: planning
    a model's optimizer state without memory), or any tensor while
    ``torch.compile`` traces.
    """
    if not isinstance(x, torch.Tensor):
        return False
    if torch.compiler.is_compiling():
        return True
    return (bool(torch._C._functorch.is_functorch_wrapped_tensor(x)) or (x.requires_grad and torch.is_grad_enabled())
            or x.is_meta)


def any_traced(xs: Iterable[object]) -> bool:
    """``any(is_traced(x) for x in xs)``, asking ``torch.compiler.is_compiling()`` once."""
    return leaf_tracer()(*xs)


def leaf_tracer() -> Callable[..., bool]:
    """A function ``traced(*xs)``: ``any(is_traced(x) for x in xs)`` as of now, for the many calls of one
    step (``torch.compiler.is_compiling()`` asked once, here)."""
    if torch.compiler.is_compiling():  # first: torch.compile cannot trace the functorch query
        return lambda *xs: any(isinstance(x, torch.Tensor) for x in xs)
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    recorded = torch.is_grad_enabled()  # requires_grad matters only where autograd records

    def traced(*xs: object) -> bool:
        for x in xs:  # a loop, not any(...): this runs for every leaf of every step
            if isinstance(x, torch.Tensor) and ((recorded and x.requires_grad) or wrapped(x) or x.is_meta):
                return True
        return False

    return traced


def refuse_traced(where: str, tensors: Iterable[tuple[str, Any]]) -> None:
    """Refuse (an :class:`~sofx.errors.UnsupportedError` naming the call ``where`` and the argument) a tensor
    among ``tensors`` (``(name, tensor or None)``) whose values a native or Triton kernel cannot take as plain
    numbers: one wrapped by a ``torch.func`` transform (vmap, grad), or one that requires grad while grad mode
    is on. Those kernels read raw memory, so autograd and the transforms would not see the math: the results
    would silently not be differentiable (or batched), where the reference backend's are. Call it after the
    written tensors' checks (:func:`~sofx.kernels.donation.check_written` names a written one that requires
    grad in its own words) and before anything is written. Not under ``torch.compile`` (as ``check_written``).
    Scalars are not refused: a 0-d tensor that cannot be read (:func:`is_traced`) is never read as a number,
    its block runs the reference math."""
    if torch.compiler.is_compiling():
        return
    recorded = torch.is_grad_enabled()
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if wrapped(t):
            raise UnsupportedError(f"{where}: {name} is a tensor of a torch.func transform (vmap, grad); this "
                                   "backend reads its values as plain numbers, so the transform would not see "
                                   "the math; use the reference backend or sofx.Adam (which steps such tensors "
                                   "by the reference math)")
        if recorded and t.requires_grad:
            raise UnsupportedError(f"{where}: {name} requires grad while grad mode is on; this backend reads its "
                                   "values as plain numbers, so its results would not be differentiable; pass it "
                                   "detached (.detach()) or call under torch.no_grad() to step its values, or use "
                                   "the reference backend or sofx.Adam for differentiable results")


def traced_possible() -> tuple[bool, bool]:
    """``(grad mode is on, a torch.func transform is active)``, asked once per kernel call: a fast path that
    finds no tensor requiring grad in the first case, and none wrapped in the second
    (``torch._C._functorch.is_functorch_wrapped_tensor``), has nothing :func:`refuse_traced` refuses (but a
    wrapper kept past its transform, which has no memory to read: the kernel's address reads refuse it)."""
    return torch.is_grad_enabled(), torch._C._functorch.peek_interpreter_stack() is not None


def as_number(x: Scalar, name: TensorName = "a 0-d tensor", error: type[Exception] = HParamError) -> Scalar:
    """A Python number for a concrete 0-d tensor or a numpy real (:func:`is_numpy_real`: a numpy integer as an
    int, a numpy float as a float), ``x`` itself otherwise.

    Reading hyperparameters as Python numbers makes the float arithmetic of a
    step identical to ``torch.optim``'s (done in double precision on the host).
    A tensor whose element lies outside its storage (freed, ``untyped_storage().resize_(0)``, or shrunk: its
    ``item()`` raised torch's RuntimeError, or read past the end) is refused, ``error`` naming it ``name`` (the
    caller's name of the argument, or a function that builds it: :func:`~sofx.kernels.storage.refuse_short_storage`).
    So is a numpy float that no Python float holds exactly (a ``longdouble``'s extra digits, :func:`_exact_float`).
    """
    if isinstance(x, torch.Tensor) and not is_traced(x) and x.dim() == 0:
        if not in_storage(x):
            refuse_short_storage(x, name, error)
        return x.item()
    if is_numpy_real(x):
        return int(x) if isinstance(x, numbers.Integral) else _exact_float(x, name, error)
    return x


_UNNAMED = "a 0-d tensor"  # (as_number's name where its caller gives none)


def rounds_in_float(x: Any) -> bool:
    """Whether ``float(x)`` of the numpy float ``x`` is another number than ``x``: a ``longdouble``'s extra digits
    (1/3 in x86's 80 bits), or one beyond the float range (inf there). nan is no number to round. The one test of
    :func:`as_number`, the checkpoint imports and the checkpoint codec, each of which refuses such a value."""
    return float(x) != x and x == x


def _exact_float(x: Any, name: TensorName, error: type[Exception]) -> float:
    """The numpy float ``x`` as the Python float that holds it exactly, else ``error`` naming ``name`` and the
    value (:func:`rounds_in_float`): a ``longdouble``'s extra digits (1/3 in x86's 80 bits) were rounded off by
    ``float()`` without a word, where the checkpoint codec and imports refuse such a value. Read so are
    hyperparameters and the configuration numbers of :mod:`sofx.kernels.user_numbers` (a clip norm, a loss
    scaler's settings)."""
    if rounds_in_float(x):
        label = name if isinstance(name, str) else name()
        raise error(f"{'' if label == _UNNAMED else f'{label} = '}{x!r:.60} is invalid: a numpy."
                    f"{type(x).__name__} that no Python float (a float64) holds exactly, which float() rounds to "
                    f"{float(x)!r} (sofx computes with Python floats); give float(x) if that is meant")
    return float(x)


def is_numpy_real(x: object) -> bool:
    """A numpy real scalar: a numpy floating or integer number (``float64``, a ``float`` subclass, included; a
    numpy bool is no number)."""
    return type(x).__module__ == "numpy" and isinstance(x, numbers.Real)


def concrete_scalars(s: AdamScalars, where: str = "kernel", float64: bool = False,
                     bias_correction: bool = False) -> AdamScalars:
    """``s`` with every field that can be read as a Python number converted to one, checked
    (:func:`check_scalars`; ``where`` names the call in the error, ``float64``: the block is stepped in
    float64, ``bias_correction``: the variant's). Every backend builds its scalars through this, so that all
    refuse the same values. Scalars that are not an :class:`AdamScalars` (a plain tuple of its values: its fields
    were read by name, a bare AttributeError) are refused, naming ``where``."""
    if not isinstance(s, AdamScalars):
        raise HParamError(f"{where}: the scalars must be an AdamScalars (lr, beta1, beta2, eps, weight_decay, step, "
                          f"grad_scale), got {type(s).__name__} {s!r:.80}")
    if not all(type(x) is float or type(x) is int for x in s):  # (the common case, once per leaf and step: floats)
        _refuse_non_numbers(s, where)
        s = AdamScalars(*(as_number(x) for x in s))
    check_scalars(s, where, float64, bias_correction)
    return s


# what a field of AdamScalars may be: a real number (a Python or numpy one; not a bool), a tensor, or the symbolic
# numbers torch.compile traces with
_SCALAR_TYPES = (numbers.Real, torch.Tensor, torch.SymInt, torch.SymFloat)


def _refuse_non_numbers(s: AdamScalars, where: str) -> None:
    """Refuse (an :class:`HParamError` naming ``where`` and the field) a field of ``s`` that is no number and no
    0-d tensor of a real dtype: a bool (Python's or numpy's, or a bool tensor: ``step=False`` was stepped with
    ``1 - beta1**False = 0``, every result nan), a complex number, a string, None, a tensor of elements
    (broadcast against the block: an lr of 3 elements stepped a ``p`` of 1 into a ``p'`` of 3). The range checks
    (:func:`check_scalars`) read only numbers and let these pass. Not under ``torch.compile`` (its tracing has
    its own stand-ins for numbers)."""
    if torch.compiler.is_compiling():
        return
    for name, x in zip(AdamScalars._fields, s):
        if isinstance(x, torch.Tensor):
            if x.dim() != 0:  # (a torch.func transform's tensor has the dimensions of one of its members)
                raise HParamError(f"{where}: {name} is a tensor of shape {tuple(x.shape)}; expected a number or a "
                                  "0-d tensor")
            if x.dtype == torch.bool or x.is_complex():  # (read as a bool or a complex number)
                raise HParamError(f"{where}: {name} is a {x.dtype} tensor; expected a number or a 0-d tensor of a "
                                  "real dtype")
        elif isinstance(x, bool) or not isinstance(x, _SCALAR_TYPES):
            raise HParamError(f"{where}: {name} = {x!r:.80} is invalid; expected a number or a 0-d tensor, got "
                              f"{type(x).__name__}")


def check_scalars(s: AdamScalars, where: str, float64: bool = False, bias_correction: bool = False) -> None:
    """Refuse, as :meth:`sofx.Adam.update` does, the values of ``s`` that can be read (numbers; concrete 0-d
    tensors) and that no step can take: an hparam outside :data:`HPARAM_RANGES` (an eps of 0 divides 0 by 0
    where v is 0, a beta of 1 divides by ``1 - beta**t`` = 0 with bias correction), an lr, weight_decay or
    eps that float32 cannot hold unless the block is stepped in float64 (``float64``), a ``step`` below 1
    (``t`` counts from 1: ``1 - beta**0`` is 0), a ``grad_scale`` that :func:`check_grad_scale` refuses, and
    with ``bias_correction`` a step size ``lr / (1 - beta1**t)`` beyond the block's float range
    (:func:`check_step_size`)."""
    values = {name: as_number(getattr(s, name)) for name in HPARAM_RANGES}
    for name, x in values.items():
        if is_number(x):
            check_hparam_range(name, x, where)
    for name in () if float64 else ("lr", "weight_decay", "eps"):
        x = values[name]
        if is_number(x) and (x > FLOAT32_MAX or (name == "eps" and x <= F32_ROUNDS_TO_0)):
            limit = f"largest {FLOAT32_MAX!r}" if x > FLOAT32_MAX else "an eps this small is 0 there"
            raise HParamError(f"{where}: {name} = {x!r} is beyond float32's range ({limit}); the block is stepped "
                              "in float32")
    t = as_number(s.step)
    if is_number(t) and not t >= 1:
        raise HParamError(f"{where}: step = {t!r} is invalid; expected the number of the step taken, >= 1 (the "
                          "first step is 1)")
    if isinstance(t, int) and t > sys.float_info.max:  # beta ** t is taken in floats
        raise HParamError(f"{where}: step = {t!r} is invalid; expected the number of the step taken, >= 1, a finite "
                          "number (this int is beyond the float range)")
    check_grad_scale(s.grad_scale, where, float64)
    if bias_correction:
        check_step_size(where, values["lr"], values["beta1"], t, float64)


def check_step_size(where: str, lr: Scalar, beta1: Scalar, t: Scalar, float64: bool, what: str = "block") -> None:
    """Refuse (an :class:`HParamError` naming ``where``) a step ``t`` with bias correction whose step size
    ``lr / (1 - beta1**t)`` (computed in double precision, as torch.optim's) is beyond the range of the dtype
    the ``what`` (block, leaf) is stepped in (float64 where ``float64``, else float32): a large lr with a beta1
    near 1 at a small ``t``. The kernels take it as a number of that dtype: inf there, every element stepped
    to inf or nan (torch.optim refuses such a step: "value cannot be converted to type float without
    overflow"). Values that cannot be read (traced), and those the hparam checks refuse, are not checked."""
    if not (is_number(lr) and is_number(beta1) and is_number(t)) or lr == 0:
        return
    if not (0 <= beta1 < 1 and t >= 1):
        return  # (check_hparam_value's and the step's refusals)
    denominator = 1 - beta1 ** t
    size = lr / denominator if denominator > 0 else math.inf
    largest = sys.float_info.max if float64 else FLOAT32_MAX
    if abs(size) > largest:
        kind = "float64" if float64 else "float32"
        raise HParamError(f"{where}: lr / (1 - beta1**t) = {size!r} at step t = {t} is beyond {kind}'s range "
                          f"(largest {largest!r}), in which the {what} is stepped: its update would be inf "
                          "(torch.optim refuses such a step); a smaller lr, or a beta1 further from 1 on the "
                          "first steps")


def check_hparam_range(name: str, x: float | int, where: str, path: str = "") -> None:
    """Refuse (an :class:`HParamError` naming ``where + path``) a number out of hparam ``name``'s range
    (:data:`HPARAM_RANGES`), in :meth:`sofx.Adam.update`'s words (which checks its hparams with it too)."""
    ok, rule = HPARAM_RANGES[name]
    if isinstance(x, int) and not -sys.float_info.max <= x <= sys.float_info.max:  # float(x) would overflow
        raise HParamError(f"{where}{path}: {name} = {x!r} is invalid; expected {rule}, a finite number (this int is "
                          "beyond the float range)")
    # A comparison, not math.isfinite: torch.compile traces it for a dynamic (symbolic) float. (nan fails every
    # comparison; inf meets some rules: say what is wrong with it)
    if not -math.inf < x < math.inf:
        raise HParamError(f"{where}{path}: {name} = {x!r} is invalid; expected {rule}, a finite number")
    if not ok(x):
        raise HParamError(f"{where}{path}: {name} = {x!r} is invalid; expected {rule}")


def check_grad_scale(grad_scale: Scalar, where: str, float64: bool = False) -> None:
    """Refuse a ``grad_scale`` that can be read (a number or a concrete 0-d tensor) and is not finite and
    >= 0, as :meth:`sofx.Adam.update` does: the gradient a kernel uses is ``g * grad_scale``; nor, unless the
    block is stepped in float64 (``float64``), one beyond float32's largest value (the gradient times it is inf
    there: nan results). 0, or a value too small for float32 (0 there), is valid: zero gradients, as
    ``clip_grad_norm_`` at ``max_norm=0`` gives them, or torch's unscaling where it underflows. A traced tensor
    is not read."""
    x = as_number(grad_scale)
    if is_number(x) and not 0 <= x < math.inf:  # (nan fails both comparisons)
        raise HParamError(f"{where}: grad_scale = {x!r} is invalid; expected a finite value >= 0 (the kernel "
                          "uses g * grad_scale)")
    if is_number(x) and not float64 and x > FLOAT32_MAX:
        raise HParamError(f"{where}: grad_scale = {x!r} is beyond float32's range (largest {FLOAT32_MAX!r}); the "
                          "block is stepped in float32, where the gradient times it is inf")


def is_number(x: object) -> bool:
    """A Python (or numpy) number, not a bool."""
    t = type(x)
    return t is float or t is int or (isinstance(x, numbers.Number) and t is not bool)


def compute_dtype(p: torch.Tensor) -> torch.dtype:
    """float64 math for float64 parameters, float32 for everything else."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


_OPTIONAL_TENSORS = ("p_old", "p_copy")  # a block's tensors that may be None


def check_block_tensors(where: str, tensors: Sequence[tuple[str, torch.Tensor | None]], like: torch.Tensor,
                        out: Sequence[torch.Tensor] | None = None, autograd: bool = False) -> None:
    """Refuse, before anything is written, block tensors a kernel cannot take.

    Every named tensor (``None`` where the name is an optional one, ``p_old``
    or ``p_copy``) and every ``out`` tensor must be a floating-point tensor
    with the shape and device of ``like`` (the parameter); ``out`` must be
    ``(p_out, m_out, v_out)``, named ``out[k]`` as the argument's elements (or the input's name where it is
    the input itself: donation). What the call writes, ``out`` and ``p_copy``,
    must be writable in place (:func:`sofx.kernels.donation.check_written`;
    ``autograd``: the backend writes through torch, which autograd records).
    Every tensor's storage must hold its elements (:func:`~sofx.kernels.storage.refuse_short_storage`).
    ``where`` prefixes the message (``"cpu.step"``). Backend-specific limits
    (device type, dtypes) and the memory the tensors share are the backend's
    own check.
    """
    if not isinstance(like, torch.Tensor):
        raise LeafError(f"{where}: p must be a tensor, got {type(like).__name__}")
    named = list(tensors)
    written = [(name, t) for name, t in named if name == "p_copy"]
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise LeafError(f"{where}: out must be a tuple of three tensors (out[0], out[1], out[2]: the new p, m, v)")
        # donation: out is the inputs, checked already (by ``is``: Dynamo guards a tensor's id() on its value,
        # which recompiled a donated step for every step's new gradients)
        seen = [t for _, t in named if t is not None]
        named += [(f"out[{k}]", o) for k, o in enumerate(out) if not any(o is t for t in seen)]
        inputs = dict(tensors)
        written += [(role if o is inputs.get(role) else f"out[{k}]", o) for k, (role, o) in enumerate(zip("pmv", out))]
    device, shape = like.device, like.shape
    for name, t in named:
        if t is None and name in _OPTIONAL_TENSORS:
            continue
        check_float_tensor(where, name, t, device, "p")
        if t.shape != shape:
            raise LeafError(f"{where}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        refuse_short_storage(t, lambda: f"{where}: {name}")
    from sofx.kernels.donation import check_written  # (donation imports this module)

    check_written(where, written, autograd)


#: True while a caller runs kernel calls every tensor of which it has checked
#: (:func:`~sofx.kernels.storage.storage_shortfall`; :func:`storage_checked`); the cpu backends' common case then
#: leaves that test out. Their other checks, and every other backend's, test all the same.
STORAGE_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("sofx_storage_checked", default=False)


@contextlib.contextmanager
def storage_checked() -> Any:
    """Run kernel calls under :data:`STORAGE_CHECKED` (their caller checked every tensor's storage); nothing to
    set under ``torch.compile`` (Dynamo cannot trace a ``ContextVar``; its tracing checks no storage)."""
    if torch.compiler.is_compiling():
        yield
        return
    token = STORAGE_CHECKED.set(True)
    try:
        yield
    finally:
        STORAGE_CHECKED.reset(token)


#: The operations (``"step"``, ``"undo"``, ``"undo_redo"``) whose list-form calls :class:`sofx.Adam` runs now,
#: having checked every one itself, leaf by leaf, naming their paths (:func:`calls_checked`; not for other
#: callers). In every call of such an operation, ``p, m, v`` and its gradients (a step's ``g``, an undo's ``g``,
#: an undo+redo's ``g_old`` and ``g_new``) are plain ``torch.Tensor`` objects (no subclass) of one shape and
#: device, contiguous, each in its storage, the gradients of ``p``'s dtype and ``v`` of ``m``'s, none wrapped by a
#: ``torch.func`` transform nor requiring grad while grad mode is on; ``out`` is None or ``(p, m, v)``
#: themselves, writable (not inference tensors outside inference mode); ``skip`` is None or a fresh contiguous
#: uint8 vector of one flag per chunk. The cpu backends then build such a call's table row without testing those
#: again (~4 us a call); what the promise does not cover (a kept ``p_old``, a parameter copy, an empty block,
#: dtypes the native code lacks, the memory overlap between calls) they test as for any caller, and the calls of
#: other operations as any caller's.
CALLS_CHECKED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("sofx_calls_checked",
                                                                                default=frozenset())

#: The operations :data:`CALLS_CHECKED` may name.
CHECKED_OPS = frozenset({"step", "undo", "undo_redo"})


@contextlib.contextmanager
def calls_checked(*ops: str) -> Any:
    """Run the calls of ``ops`` (of :data:`CHECKED_OPS`) under :data:`CALLS_CHECKED` (and every call under
    :data:`STORAGE_CHECKED`, which it implies): for :class:`sofx.Adam` alone, which made the promise true of the
    calls of those operations it runs so. Nothing to set under ``torch.compile`` (as :func:`storage_checked`)."""
    if not ops or not CHECKED_OPS.issuperset(ops):
        raise ValueError(f"calls_checked{ops}: expected one or more of {sorted(CHECKED_OPS)}")
    if torch.compiler.is_compiling():
        yield
        return
    token = CALLS_CHECKED.set(frozenset(ops))
    try:
        with storage_checked():
            yield
    finally:
        CALLS_CHECKED.reset(token)


def check_float_tensor(where: str, name: str, t: Any, device: torch.device, anchor: str) -> None:
    """Refuse ``t`` (argument ``name`` of the call ``where``) unless it is a floating-point tensor on ``device``,
    the device of the call's ``anchor`` (named in the message: ``"p"``, ``"the gradient"``)."""
    if not isinstance(t, torch.Tensor):
        raise LeafError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
    if t.device != device:
        raise UnsupportedError(f"{where}: {name} is on {t.device}, {anchor} on {device}")
    if not t.dtype.is_floating_point:
        raise LeafError(f"{where}: {name} must be a floating-point tensor, got {t.dtype}")


def kernel_param_copy(p_copy: torch.Tensor | None, dtypes: Collection[torch.dtype],
                      layout_of: torch.Tensor | None = None) -> torch.Tensor | None:
    """``p_copy`` where a kernel can store it itself (contiguous, in one of its storage ``dtypes``; with
    ``layout_of``, a block run over its memory spans: of that tensor's dense layout instead), else None: the
    caller then copies after the kernel (:func:`write_param_copy`)."""
    if p_copy is None or p_copy.dtype not in dtypes:
        return None
    fits = p_copy.is_contiguous() if layout_of is None else same_layout(p_copy, layout_of)
    return p_copy if fits else None


def write_param_copy(p_copy: torch.Tensor | None, p_new: torch.Tensor) -> None:
    """``p_copy.copy_(p_new)`` where a kernel did not write the copy itself (``p_copy`` may be None)."""
    if p_copy is not None:
        p_copy.copy_(p_new)


def write_kept_param_copy(p_copy: torch.Tensor | None, p_new: torch.Tensor, skip: torch.Tensor | None) -> None:
    """:func:`write_param_copy` where the kernel did not write the copy itself; of a checked call
    (``skip``, see :data:`FINITE_CHUNK`) only the chunks it did not flag (a flagged chunk's outputs are left
    alone, the copy's too)."""
    if p_copy is None or skip is None or not bool(skip.any()):
        write_param_copy(p_copy, p_new)
        return
    keep = kept_elements(skip, p_new.numel())
    p_copy.view(-1)[keep] = p_new.reshape(-1)[keep].to(p_copy.dtype)


def kept_elements(skip: torch.Tensor, n: int) -> torch.Tensor:
    """A mask of the ``n`` elements whose chunk a checked call's ``skip`` does not flag."""
    return (skip == 0).repeat_interleave(FINITE_CHUNK)[:n]


def write_outputs(results: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A kernel's ``(p, m, v)``: ``results`` as they are, or copied into ``out`` where a
    result is not already ``out``'s own tensor (a kernel may have written in place)."""
    if out is None:
        return results[0], results[1], results[2]
    for o, r in zip(out, results):
        if o is not r:
            o.copy_(r)
    return out[0], out[1], out[2]


def _increments_lists() -> bool:
    """Whether torch's ``increment_version`` takes a list of tensors (torch >= 2.5; 2.4 takes one tensor)."""
    try:
        increment_version([])
    except (TypeError, RuntimeError):
        return False
    return True


_INCREMENTS_LISTS = _increments_lists()


def mark_written(tensors: Iterable[torch.Tensor | None]) -> None:
    """Bump the version counter of each of ``tensors`` (None skipped) that a native or Triton kernel wrote in
    place, as a torch in-place operation does, so that autograd refuses a backward through a graph that saved
    one of them (or a view sharing its counter: ``detach()``, slices) instead of computing the gradient of the
    values it overwrote. A tensor bumped twice (listed twice, or written by torch too) is harmless; a tensor
    taken through ``.data`` has a counter of its own (the offload engine's buffers rely on it), an inference
    tensor none (not bumped). One call of torch's for the whole list: ~0.05 us a tensor."""
    written = [t for t in tensors if t is not None]
    if not written:
        return
    if _INCREMENTS_LISTS:
        increment_version(written)
    else:
        for t in written:
            increment_version(t)


Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class StepCall(NamedTuple):
    """The arguments of one block's ``step`` (for ``step_many``); ``skip``: see :data:`FINITE_CHUNK`.

    ``zero_moments``: ``m`` and ``v`` are all zero and the caller undoes the step by zeroing them (a leaf's
    first step: :class:`~sofx.undo_record.LeafUndo`'s ``moments_were_zero``), so a checked step flags no
    element as lossy (:func:`lossy_elements` with ``zero_moments``); an unchecked step ignores it."""

    p: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    s: AdamScalars
    out: Triple | None = None
    p_copy: torch.Tensor | None = None
    skip: torch.Tensor | None = None
    zero_moments: bool = False
    p_kept: bool = False  # the caller keeps p (a param_snapshot record): no L2 term in the check, see _l2_term


# A checked step (``StepCall.skip``, ``UndoRedoCall.skip``; backends whose ``CHECKS_FINITE`` is True):
# ``skip`` is a contiguous uint8 tensor of ceil(n / FINITE_CHUNK) zeros on the block's device. The kernel reads
# each chunk of FINITE_CHUNK elements of the (flat) gradient of the step it takes (an undo+redo's new one) before
# writing the chunk; a chunk with an inf, a nan, or an element beyond ``GRADIENT_LIMIT / grad_scale`` (see
# :func:`gradient_limit_bits`), or an element :func:`lossy_elements` finds (the step's moments and, in L2
# mode, parameter read too; ``StepCall.zero_moments`` passed on to it), is left alone (none of its outputs
# written: p, m, v, out, p_copy) and its flag set to 1. The caller learns whether the step can be
# undone algebraically without a pass of its own over the gradient, and steps the flagged chunks after
# keeping their old values. What the kernel writes in place must be contiguous (``out`` also in the
# dtypes of p, m, v; ``p_copy``). 1024 elements (4096 before stop 44): a chunk is flagged for one lossy element,
# and smaller chunks keep less (overlap.py's MLP after its first steps: 9% of its elements in flagged chunks,
# against 22%) at no cost to the checked step (benchmarks/RESULTS.md "Stop 44").
FINITE_CHUNK = 1024

FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4028234663852886e38
F32_ROUNDS_TO_0 = 2.0 ** -150  # a positive value at most this is 0 in float32 (half its smallest subnormal)

# Each hparam's valid values, all finite: (test, rule in errors). sofx.Adam.update and the kernels refuse by it.
HPARAM_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda x: x >= 0, "lr >= 0"),
    "beta1": (lambda x: 0 <= x < 1, "0 <= beta1 < 1"),
    "beta2": (lambda x: 0 <= x < 1, "0 <= beta2 < 1"),
    "eps": (lambda x: x > 0, "eps > 0"),
    "weight_decay": (lambda x: x >= 0, "weight_decay >= 0"),
}

# The largest scaled gradient magnitude |g * grad_scale| whose step is undone algebraically: its square (and
# a second moment made of such squares) stays below FLT_MAX / 4, so v' = b2 v + (1 - b2) g^2 is finite and
# its inverse is not inf - inf = nan. The factor 4 leaves room for a redo whose grad_scale doubled (a loss
# scale halved) on a gradient checked with the old one.
GRADIENT_LIMIT = math.sqrt(FLOAT32_MAX / 4)


def gradient_limit_bits(grad_scale: float) -> tuple[int, int, int]:
    """The magnitude bits (sign cleared) above which a gradient element of dtype float32, bfloat16,
    float16 is flagged for ``grad_scale`` (the largest value at most ``GRADIENT_LIMIT / grad_scale``, float32's
    largest for a ``grad_scale`` of 0; an inf or a nan always has larger bits)."""
    limit = FLOAT32_MAX if grad_scale == 0 else min(GRADIENT_LIMIT / abs(grad_scale), FLOAT32_MAX)
    f32 = struct.unpack("<I", struct.pack("<f", limit))[0]
    if struct.unpack("<f", struct.pack("<I", f32))[0] > limit:  # rounded up: the float below
        f32 -= 1
    f16 = 0x7BFF if limit >= 65504.0 else struct.unpack("<H", struct.pack("<e", limit))[0]
    if limit < 65504.0 and struct.unpack("<e", struct.pack("<H", f16))[0] > limit:
        f16 -= 1
    return f32, f32 >> 16, f16  # bfloat16: float32's upper half, truncated (at most the limit)


def beyond_limit(g: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """The elements of ``g`` a checked step flags (:func:`gradient_limit_bits`, compared on the bits of the
    gradient's own dtype; other dtypes as float32, as the kernels read them)."""
    lim32, lim_bf16, lim_f16 = gradient_limit_bits(grad_scale)
    if g.dtype in (torch.bfloat16, torch.float16):
        return (g.view(torch.int16) & 0x7FFF) > (lim_bf16 if g.dtype == torch.bfloat16 else lim_f16)
    x = g if g.dtype == torch.float32 else g.to(torch.float32)
    return (x.view(torch.int32) & 0x7FFFFFFF) > lim32


# A checked step also flags a chunk whose step an algebraic inverse would restore less exactly than DESIGN.md's
# 1e-6: where the effective gradient ``gh`` (``g * grad_scale``, plus ``wd * p`` in L2 mode) dominates the
# moments. The inverse takes ``v = (v' - (1 - b2) gh^2) / b2`` from the stored ``v'``: the roundings of
# ``v'`` and of the ``(1 - b2) gh^2`` terms the step and the inverse compute (2^-24 relative each) come back
# amplified by ``R = (1 - b2) gh^2 / (b2 v)``; ``m`` likewise by ``(1 - b1) |gh| / (b1 sqrt(v))`` relative
# to the update's own scale ``sqrt(v)``. A gradient 1000x the ones before it (a spike, a row of an embedding
# seen rarely) left v 62% off. An element is flagged where ``R > LOSSY_V_RATIO`` or that m ratio
# ``> LOSSY_M_RATIO``: see :func:`lossy_factor`. Measured over 4M elements per unit of R (cpu and reference
# alike), v came back within about (3.3 R + 4) 2^-24: 13.3 2^-24 = 7.9e-7 for R up to 3, 46 2^-24 = 2.7e-6
# at 12 (the first ratio, 12, took only v' into account and let a 30x spike's v back 1.6e-6 off); m within
# about (2 R_m + 2 |m| / sqrt(v)) 2^-24 of sqrt(v): measured 28 2^-24 = 1.7e-6 up to 12 (the tests allow 2e-6).
# A zero ``v`` with a nonzero ``gh`` fails ``gh^2 c <= 0``. Any leftover of the inverse there is magnified by
# a redo with a much smaller gradient (a heavy clip): rows of an embedding no token had used (m = v = 0,
# count > 0) came back with v 1.2e-3 off and p 3.6e-6 (relative to the tensor's max) at a global norm 100x
# max_norm while the inverse's rounding of ``(1 - b2) gh^2`` differed from the step's. Every backend's inverse
# now subtracts the step's own ``((1 - b2) gh) gh`` and its own ``(1 - b1) gh``, so that moments that were
# exactly 0 come back exactly 0 (``v' - ((1 - b2) gh) gh = 0``, ``m' - (1 - b1) gh = 0``, each the same
# rounding of the same operands as the step's, and a quotient of 0): such an element is not flagged
# (:func:`zeros_come_back`) where the step's ``gh`` does not depend on p (the inverse's L2 ``gh`` is from the
# recovered p, an ulp off: ~5e-6 of m' left over) and the moments are stored in the compute dtype (a bfloat16
# ``v'`` is not the float32 term it rounds). A zero ``v`` beside a nonzero ``m`` (gradients whose squares
# underflowed) is still flagged. Not flagged either: a zero ``v`` with a zero ``gh`` (nothing added, nothing
# to take back), and a leaf's first step from zero moments (``StepCall.zero_moments``: its undo restores exact
# zeros). A nan ``v`` is flagged, a non-finite ``m``, and a non-finite ``gh^2 c`` (an inf or nan parameter in
# L2 mode, whose effective gradient is then not finite: the inverse would give nan moments).
# L2 mode (``gh = g * grad_scale + wd * p``) also: the inverse recovers p from p' about half an ulp of each off (at most
# 2^-24 (|p| + |p'|) <= 2^-24 P, ``P = 2 |p| + |u|``, ``u`` the update, ``|u| <= K |m'| / sqrt(v')``, ``K`` of
# :class:`LossyL2`; an element hits it now and then: a tie, the update's rounding), and wd times that error enters the
# recovered ``gh``, so the moments: v by up to ``E_v = 2 (1 - b2) / b2 |gh| W / v`` (relative, in units of 2^-24; ``W =
# wd P``) and m by up to ``E_m = (1 - b1) / b1 W / sqrt(v)``. Where ``wd |p|`` or the update is large beside ``|gh|``
# that is far beyond the ratios' bounds: with an update far larger than |p| (``sofx.adam(weight_decay=0.5)``, lr 1,
# betas 0.99, a few steps in) unflagged elements came back with v 7.5e-6 off; with ``g`` near ``-wd p`` (``gh`` small
# beside ``wd p``: the balance L2 training tends to) and a second moment still small (a second step), 5e-6 off at lr
# 0.01 and wd 0.1, 6e-4 at lr 0.1 and wd 0.5. So in L2 mode these errors share the ratios' budgets: ``3.3 R + E_v <= 3.3
# LOSSY_V_RATIO``, i.e. ``|gh| (|gh| + LOSSY_L2_V W) cv <= v`` with ``LOSSY_L2_V = 2 / 3.3``, and ``2 R_m + E_m <= 2
# LOSSY_M_RATIO``, i.e. ``(|gh| + LOSSY_L2_M W)^2 cm <= v`` with ``LOSSY_L2_M = 1 / 2`` (``cv``, ``cm``: the two parts
# of :func:`lossy_factor`; :func:`_l2_term`): where W is 0 the ratios' own test, elsewhere never more error than they
# allow. Measured by ``benchmarks/lossy_l2.py`` (float32, 2^15 elements per case over lr 1e-3..1, wd 0.01..0.5, betas
# (0.9, 0.999), (0.99, 0.99), (0.9, 0.95), 1..30 steps; Adam-evolved states with gradients over three decades and an
# eighth of them near ``-wd p``): 17.4% of elements flagged (the ratios alone: 14.5%, and unflagged elements came back
# with v up to 9e-4 off; separate budgets of 2 ulps of v and 8 of sqrt(v): 29.5%), unflagged ones within 11.8 ulps of v
# and 12.1 of ``sqrt(v) + |m|`` (on wider random states 13.8 and 14.2). None where the step's record keeps p
# (``StepCall.p_kept``: a ``param_snapshot``, whose inverse takes p from it exactly). An undo+redo's check reads the
# parameter its redo steps from, for ``|p|`` and its ``gh``: its ``p_old``, else what the inverse recovers from ``p'``
# (:func:`_recovered_param`).
LOSSY_V_RATIO = 3.0
LOSSY_M_RATIO = 12.0
LOSSY_L2_V = 2 / 3.3
LOSSY_L2_M = 1 / 2


def lossy_factor(beta1: float, beta2: float, float64: bool = False) -> float:
    """``c`` such that an element's step is too lossy to undo algebraically where not ``gh * gh * c <= v``
    (``gh`` the effective gradient, ``v`` the second moment before the step; a zero ``v`` with a nonzero
    ``gh`` included, for ``c > 0``):
    ``max((1 - b2) / (LOSSY_V_RATIO * b2), ((1 - b1) / (LOSSY_M_RATIO * b1))^2)``. 0 for a beta of 0 (no
    inverse at all: such a step is never undone algebraically). ``float64``: for a step computed in float64,
    whose rounding is 2^29 times finer (the ratios 2^29 times larger)."""
    b1, b2 = float(beta1), float(beta2)
    if b1 == 0 or b2 == 0:
        return 0.0
    if min(b1, b2) < 1e-30:  # (no overflow below: float32's largest for a beta too small to undo at all)
        return FLOAT32_MAX
    finer = 2.0 ** 29 if float64 else 1.0
    c = max((1 - b2) / (LOSSY_V_RATIO * finer * b2), ((1 - b1) / (LOSSY_M_RATIO * finer * b1)) ** 2)
    return min(c, FLOAT32_MAX)


def _to_f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (as C's ``(float)`` of a double)."""
    return struct.unpack("<f", struct.pack("<f", x))[0] if abs(x) <= FLOAT32_MAX else math.copysign(math.inf, x)


class LossyL2(NamedTuple):
    """The float32 constants of the L2 terms of the lossy check (see :data:`LOSSY_V_RATIO`), for a step ``s`` (the
    redo of an undo+redo: also ``s_old``, the undone one's): ``cv, cm``: the two parts of :func:`lossy_factor`,
    ``(1 - b2) / (LOSSY_V_RATIO b2)`` and ``((1 - b1) / (LOSSY_M_RATIO b1))^2`` (both 0 for a step from zero
    moments, whose undo zeroes them); ``wa = 2 LOSSY_L2_V wd``, ``wb = 2 LOSSY_L2_M wd`` (the factors of ``|p|`` in
    each check's share of ``wd P``, ``P = 2 |p| + K q``); ``wka = wa K / 2``, ``wkb = wb K / 2`` (those of ``q``)
    with ``K = lr max(1, sqrt(1 - b2^t) / (1 - b1^t))`` (``|u| <= K |m'| / sqrt(v')``, with or without bias
    correction); ``r1, r2``: ``b1, b2`` (an undo+redo's ``b1 / b1_old, b2 / b2_old``, of the float32 betas: against
    the undone moments' ``b1_old m, b2_old v``); ``omb1, omb2``: the step's ``1 - b1, 1 - b2``."""

    cv: float
    cm: float
    wa: float
    wb: float
    wka: float
    wkb: float
    r1: float
    r2: float
    omb1: float
    omb2: float


def lossy_l2(s: AdamScalars, zero_moments: bool = False, s_old: AdamScalars | None = None,
             float64: bool = False) -> LossyL2:
    """:class:`LossyL2` of a step ``s`` (``zero_moments``: from zero moments; ``float64``: computed and stored in
    float64, whose ratios are 2^29 times larger, as :func:`lossy_factor`'s)."""
    b1, b2, t = float(s.beta1), float(s.beta2), float(s.step)
    finer = 2.0 ** 29 if float64 else 1.0
    if zero_moments or b1 == 0 or b2 == 0:
        cv = cm = 0.0
    elif min(b1, b2) < 1e-30:
        cv = cm = FLOAT32_MAX
    else:
        cv = min((1 - b2) / (LOSSY_V_RATIO * finer * b2), FLOAT32_MAX)
        cm = min(((1 - b1) / (LOSSY_M_RATIO * finer * b1)) ** 2, FLOAT32_MAX)
    bc1 = 1 - b1 ** t
    k = float(s.lr) * (max(1.0, math.sqrt(max(1 - b2 ** t, 0.0)) / bc1) if bc1 > 0 else math.inf)
    wd = abs(_to_f32(float(s.weight_decay)))
    wa, wb = 2 * LOSSY_L2_V * wd, 2 * LOSSY_L2_M * wd
    r1, r2 = _to_f32(b1), _to_f32(b2)
    if s_old is not None:
        o1, o2 = _to_f32(float(s_old.beta1)), _to_f32(float(s_old.beta2))
        r1, r2 = _to_f32(r1 / o1) if o1 else math.inf, _to_f32(r2 / o2) if o2 else math.inf
    return LossyL2(_to_f32(cv), _to_f32(cm), _to_f32(wa), _to_f32(wb), _to_f32(min(wa * k / 2, FLOAT32_MAX)),
                   _to_f32(min(wb * k / 2, FLOAT32_MAX)), r1, r2, _to_f32(1 - b1), _to_f32(1 - b2))


def _l2_term(p: torch.Tensor, gh: torch.Tensor, mb: torch.Tensor | None, vv: torch.Tensor, c: float,
             k: LossyL2) -> torch.Tensor:
    """L2 mode's ``gh^2 c`` of :func:`_lossy_operands` (``vv``: ``v``, an undo+redo's ``b2_old`` times the undone
    ``v``; ``mb``: ``m``, an undo+redo's ``b1_old`` times the undone ``m``): ``max(gh^2 c, |gh| (|gh| + A) cv, (|gh| +
    B)^2 cm)`` with ``A = |p| wa + q wka``, ``B = |p| wb + q wkb``, ``q = |m'| / sqrt(v')`` (0 where ``m'`` is; ``m' =
    r1 mb + (1 - b1) gh``, ``v' = r2 vv + ((1 - b2) gh) gh``); see :data:`LOSSY_V_RATIO` and :class:`LossyL2`. ``mb``
    None (unknown): no ``q`` terms. A nan term leaves the others' maximum (a nan ``gh^2 c`` stays nan)."""
    t = torch.mul(gh, gh).mul_(c)
    ap = torch.abs(p.to(gh.dtype))
    ag = torch.abs(gh)
    a = torch.mul(ap, k.wa)
    b = ap.mul_(k.wb)
    if mb is not None:
        mp = torch.mul(mb, k.r1).add_(torch.mul(gh, k.omb1))
        vp = torch.mul(vv, k.r2).add_(torch.mul(gh, k.omb2).mul_(gh))
        q = torch.abs(mp).div_(_sqrt_rn(vp)).masked_fill_(mp == 0, 0.0)
        a.add_(torch.mul(q, k.wka))
        b.add_(q.mul_(k.wkb))
    t1 = a.add_(ag).mul_(ag).mul_(k.cv)
    t = torch.where(t1 > t, t1, t)
    b.add_(ag)
    t2 = b.mul_(b).mul_(k.cm)
    return torch.where(t2 > t, t2, t)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` correctly rounded in ``x``'s dtype (a new tensor), as the lossy check's native (``sqrtf``) and
    Triton (``sqrt_rn``) forms take it, so that all flag the same elements where one bit of ``q`` or of the
    recovered p decides. torch's own float32 square root on CPU is MKL's where torch has MKL, an ulp off for ~0.7%
    of values (:mod:`sofx.kernels._torch_sqrt`): there a float32 one is taken in float64 and rounded, which is
    float32's correctly rounded result (the square root of a float32 lies at least 2^-49 relative from a float32
    midpoint, farther than float64's rounding)."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return x.double().sqrt_().float()
    return x.sqrt()


def _float64_tensor(x: Scalar) -> torch.Tensor:
    """``x`` (a beta) as a 0-d float64 tensor, ``torch.as_tensor(x, dtype=torch.float64)``. A Python number while
    ``torch.compile`` traces is ``1.0 * x`` in float64 instead, the same value: a beta a schedule computes from a
    step that changes is a symbolic float there, which ``as_tensor`` specialised (a recompile per value; on a
    cosine, "Guard failed on the same frame it was created", the guard's sympy cosine an ulp off ``math.cos``)."""
    if isinstance(x, torch.Tensor) or not torch.compiler.is_compiling():
        return torch.as_tensor(x, dtype=torch.float64)
    return torch.ones((), dtype=torch.float64) * x


def bias_corrections(s: AdamScalars, variant: AdamVariant) -> tuple[Scalar, Scalar]:
    """``(lr / bc1, sqrt(bc2))`` of the step, in double precision for Python numbers.

    Computed from the step's own betas and ``t`` every time (no cache).
    """
    if not variant.bias_correction:
        return s.lr, 1.0
    if is_number(s.beta1) and is_number(s.step):
        bc1 = 1 - s.beta1 ** s.step
    else:
        bc1 = 1 - _float64_tensor(s.beta1) ** s.step
    if is_number(s.beta2) and is_number(s.step):
        bc2_sqrt = (1 - s.beta2 ** s.step) ** 0.5
    else:
        bc2_sqrt = (1 - _float64_tensor(s.beta2) ** s.step).sqrt()
    return s.lr / bc1, bc2_sqrt


def _recovered_param(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s_old: AdamScalars,
                     bias_correction: bool) -> torch.Tensor:
    """What the inverse of an L2 step (scalars ``s_old``; ``m``, ``v``: its results) recovers from its result
    ``p``: ``p + (ss m) / (sqrt(v) / sqrt(bc2) + eps)`` (``ss = lr / bc1``), with true divisions and a correctly
    rounded square root in the compute dtype: the parameter the redo of an undo+redo steps from, within an ulp or
    two of the kernels' own (their inverses' square roots and divisions by a step constant), for the redo's
    lossy test (see :data:`LOSSY_V_RATIO`)."""
    dtype = compute_dtype(p)
    ss, bc2 = bias_corrections(s_old, AdamVariant(decoupled=False, bias_correction=bias_correction))
    d = _sqrt_rn(v.to(dtype)).div_(float(bc2)).add_(float(s_old.eps))
    return torch.mul(m.to(dtype), float(ss)).div_(d).add_(p.to(dtype))


def _effective_gradient(p: torch.Tensor, g: torch.Tensor, s: AdamScalars, decoupled: bool) -> torch.Tensor:
    """``g * grad_scale`` (plus ``p * wd`` in L2 mode), a new tensor in the compute dtype."""
    dtype = compute_dtype(p)
    gh = torch.mul(g.to(dtype), float(s.grad_scale))
    if not decoupled and float(s.weight_decay) != 0:
        gh.add_(torch.mul(p.to(dtype), float(s.weight_decay)))
    return gh


def zeros_come_back(p: torch.Tensor, m: torch.Tensor | None, v: torch.Tensor, s: AdamScalars, decoupled: bool,
                    s_old: AdamScalars | None = None) -> bool:
    """Whether a step (``s``; the redo of an undo+redo also ``s_old``, the undone one's) on this block gives
    moments that were exactly 0 back exactly 0 when undone: its effective gradient does not depend on p
    (decoupled decay, or none), and ``m`` and ``v`` are stored in the compute dtype (see
    :data:`LOSSY_V_RATIO`). ``m`` None: unknown, so not."""
    dtype = compute_dtype(p)
    if m is None or m.dtype != dtype or v.dtype != dtype:
        return False
    return all(decoupled or float(x.weight_decay) == 0 for x in (s, s_old) if x is not None)


def _lossy_operands(p: torch.Tensor, g: torch.Tensor, v: torch.Tensor, s: AdamScalars, decoupled: bool,
                    g_old: torch.Tensor | None, s_old: AdamScalars | None, zero_moments: bool = False,
                    m: torch.Tensor | None = None, p_kept: bool = False, bias_correction: bool = True,
                    p_old_given: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], torch.Tensor] | None]:
    """``(gh * gh * c, v, mm)`` of :func:`lossy_elements` (``c`` 0 with ``zero_moments``; ``mm()``: 0 where the
    first moment before the step is, so that both moments are 0 where ``v`` is too, :func:`_zeros`, computed when
    called; None where :func:`zeros_come_back` says such elements are not undone exactly), in place where the
    tensors are its own (the pass before a step that no kernel checks: a few passes, no more temporaries than
    needed). An undo+redo's in L2 mode (either step's decay) given the undone step's result ``p'`` (not
    ``p_old_given``) and ``m``: its p from :func:`_recovered_param`."""
    dtype = compute_dtype(p)
    if g_old is not None and not decoupled and not p_old_given and m is not None and any(
            float(x.weight_decay) != 0 for x in (s, s_old)):
        p = _recovered_param(p, m, v, s_old, bias_correction)
    vv = v.to(dtype)
    mm: Callable[[], torch.Tensor] | None = None
    if m is not None and zeros_come_back(p, m, v, s, decoupled, s_old):
        mo = m.to(dtype)
        mm = lambda: mo  # noqa: E731
    if g_old is not None:
        assert s_old is not None
        gho = _effective_gradient(p, g_old, s_old, decoupled)
        if mm is not None:  # m' - (1 - b1) gh_old: 0 where the undone m is
            mm = lambda: torch.sub(mo, torch.mul(gho, 1 - float(s_old.beta1)))  # noqa: E731
        u = torch.mul(gho, 1 - float(s_old.beta2)).mul_(gho)  # (1 - b2) * gh * gh, in that order
        vv = torch.sub(vv, u, out=u).clamp_min_(0)  # b2 times the undone v (a nan stays nan)
    t = _effective_gradient(p, g, s, decoupled)
    # float64's finer factor only where the moments are stored in float64 too: float32 moments (state_dtype)
    # round v' to float32 whatever the precision of the step's math
    c_float64 = dtype == torch.float64 and v.dtype == torch.float64
    c = 0.0 if zero_moments else lossy_factor(s.beta1, s.beta2, float64=c_float64)
    if not decoupled and float(s.weight_decay) != 0 and not p_kept:
        mb = None if m is None else m.to(dtype) if g_old is None else \
            torch.sub(m.to(dtype), torch.mul(gho, 1 - float(s_old.beta1)))
        t = _l2_term(p, t, mb, vv, c, lossy_l2(s, zero_moments, s_old, float64=c_float64))
    else:
        t.mul_(t).mul_(c)
    if g_old is not None:
        t.mul_(float(s_old.beta2))  # against b2 times the undone v: no division
    return t, vv, mm


def _zeros(vv: torch.Tensor, mm: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Where both moments are exactly 0 (of :func:`_lossy_operands`' results)."""
    return torch.eq(vv, 0).logical_and_(torch.eq(mm(), 0))


def _sound(t: torch.Tensor, vv: torch.Tensor, mm: Callable[[], torch.Tensor] | None) -> torch.Tensor:
    """Where an element's inverse is within the tolerance (of :func:`_lossy_operands`' results): ``gh^2 c <=
    v`` or moments exactly 0 (``mm``: see there), and ``gh^2 c`` finite."""
    ok = torch.le(t, vv)
    if mm is not None:
        ok.logical_or_(_zeros(vv, mm))
    return ok.logical_and_(torch.isfinite(t))


def lossy_elements(p: torch.Tensor, g: torch.Tensor, v: torch.Tensor, s: AdamScalars, decoupled: bool,
                   g_old: torch.Tensor | None = None, s_old: AdamScalars | None = None,
                   m: torch.Tensor | None = None, zero_moments: bool = False, p_kept: bool = False, *,
                   bias_correction: bool = True, p_old_given: bool = False) -> torch.Tensor:
    """The elements whose step (``p, g, v`` before it, scalars ``s``) an algebraic inverse would restore
    less exactly than DESIGN.md's tolerance: not ``gh^2 * lossy_factor(b1, b2) <= v``, a nan ``v`` and a zero
    ``v`` with a nonzero ``gh`` included (see :data:`LOSSY_V_RATIO`), but for moments exactly 0 where
    :func:`zeros_come_back` (their inverse is exact; ``m`` needed). The redo of an undo+redo (``g_old,
    s_old``: the undone step; ``v`` its result, ``p`` the parameters before it where its record kept them,
    else its result ``p'``) compares the new gradient against the undone ``v``, ``(v' - (1 - b2) gh_old^2) /
    b2`` (at least 0: where that is 0, a nonzero new ``gh`` is flagged unless the undone ``m``, ``(m' - (1 - b1)
    gh_old) / b1``, is 0 too), both ``gh`` from that ``p``; as ``b2 (gh^2 c) <= v' - (1 - b2) gh_old^2``,
    without a division (the fused undo+redo loops are bound by their divider). A non-finite ``gh^2 c`` is
    flagged whatever ``v`` (an inf or nan parameter in L2 mode: its inverse gives nan moments). ``m``: the
    first moment (``m'`` of an undo+redo); an element where it is not finite is flagged too (its inverse would
    give a nan parameter: inf - inf). ``zero_moments`` (a step's, as :class:`StepCall`'s: all-zero moments
    that its undo restores by zeroing them): a factor ``c`` of 0, so that only non-finite values are flagged.
    L2 mode: ``gh^2 c`` is :func:`_l2_term`'s (the inverse's p is an ulp of p' off), but where ``p_kept`` (the
    step's record keeps p: a ``param_snapshot``, :class:`StepCall`'s); an undo+redo's ``p``, the undone step's
    result ``p'`` where not ``p_old_given``, is first what its inverse recovers (:func:`_recovered_param`, with or
    without ``bias_correction``): the effective gradients read the parameter the redo steps from (with ``p'``
    instead, far off where ``g`` nearly cancels ``wd p``, redone steps undone again came back with v 1.2e-4 off at
    lr 1e-3, wd 0.5). The checked kernels flag the chunks holding such an element."""
    bad = _sound(*_lossy_operands(p, g, v, s, decoupled, g_old, s_old, zero_moments, m, p_kept, bias_correction,
                                  p_old_given)).logical_not_()
    return bad if m is None else bad.logical_or_(~torch.isfinite(m))


_LOSSY_SLICE = 1 << 18  # elements per slice of a CPU tensor in any_lossy (its temporaries stay in cache)


def any_lossy(p: torch.Tensor, g: torch.Tensor, v: torch.Tensor, s: AdamScalars, decoupled: bool,
              g_old: torch.Tensor | None = None, s_old: AdamScalars | None = None,
              m: torch.Tensor | None = None, p_kept: bool = False, *, bias_correction: bool = True,
              p_old_given: bool = False) -> torch.Tensor:
    """``lossy_elements(...).any()`` (a 0-d bool tensor) with fewer passes. On CPU a slice at a time, up to
    the first one found: whole-tensor temporaries cost ~9x a streaming pass there (fresh pages). ``m`` is
    tested by its sum, one reduction (an inf or a nan makes it so; a sum beyond the float range, from finite
    elements, flags it too: a snapshot where none was needed), and read by slice where :func:`zeros_come_back`
    (its exact zeros, and in L2 mode for its L2 term: see :data:`LOSSY_V_RATIO`)."""

    def sound(p: torch.Tensor, g: torch.Tensor, v: torch.Tensor, g_old: torch.Tensor | None,
              m: torch.Tensor | None) -> torch.Tensor:
        t, vv, mm = _lossy_operands(p, g, v, s, decoupled, g_old, s_old, m=m, p_kept=p_kept,
                                    bias_correction=bias_correction, p_old_given=p_old_given)
        if mm is None or p.device.type != "cpu":
            return _sound(t, vv, mm).all()
        ok = torch.le(t, vv).logical_and_(torch.isfinite(t)).all()  # (on CPU the exact zeros only where needed)
        return ok if bool(ok) else _sound(t, vv, mm).all()

    m_bad = torch.zeros((), dtype=torch.bool, device=p.device) if m is None or m.numel() == 0 else \
        ~torch.isfinite(m.sum())
    if p.device.type != "cpu" or p.numel() <= _LOSSY_SLICE:
        return ~sound(p, g, v, g_old, m) | m_bad
    if bool(m_bad):
        return m_bad
    tensors = (p, g, v, g_old, m)
    if one_dense_layout(p, tensors):  # (an elementwise test: any order)
        flat = [None if x is None else in_memory_order(x) for x in tensors]
    else:
        flat = [None if x is None else x.reshape(-1) for x in tensors]
    for a in range(0, p.numel(), _LOSSY_SLICE):
        if not bool(sound(*(None if x is None else x[a:a + _LOSSY_SLICE] for x in flat))):
            return torch.tensor(True)
    return torch.tensor(False)


class UndoCall(NamedTuple):
    """The arguments of one block's ``undo`` (for ``undo_many``)."""

    p: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    s: AdamScalars
    p_old: torch.Tensor | None = None
    out: Triple | None = None
    p_copy: torch.Tensor | None = None


class UndoRedoCall(NamedTuple):
    """The arguments of one block's ``undo_redo`` (for ``undo_redo_many``)."""

    p: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    g_old: torch.Tensor
    s_old: AdamScalars
    g_new: torch.Tensor
    s_new: AdamScalars
    p_old: torch.Tensor | None = None
    out: Triple | None = None
    p_copy: torch.Tensor | None = None
    skip: torch.Tensor | None = None  # checked on g_new, see FINITE_CHUNK
    p_kept: bool = False  # the redo's record keeps p (see StepCall)


def refuse_checked_steps(calls: Sequence[StepCall] | Sequence[UndoRedoCall], where: str) -> None:
    """Raise for a call with ``skip`` in a backend without checked steps (``CHECKS_FINITE`` False)."""
    for i, c in enumerate(calls):
        if c.skip is not None:
            raise UnsupportedError(f"{where}[{i}]: this backend has no checked step (skip); use a backend whose "
                                   "CHECKS_FINITE is True or check the gradient first")


def check_skip(where: str, c: Any, device: torch.device) -> None:
    """A checked call's ``c.skip`` (``c``: a call or block with ``p, m, v, out, p_copy, skip``): one uint8 per
    chunk of :data:`FINITE_CHUNK` elements, zeros, contiguous, on ``device``, in its storage
    (:func:`~sofx.kernels.storage.refuse_short_storage`), writable (:func:`~sofx.kernels.donation.check_written`);
    and what is written in place contiguous (``out``, in the dtypes of ``p, m, v``; ``p_copy``), so that a skipped
    chunk's outputs are not touched."""
    chunks = -(-c.p.numel() // FINITE_CHUNK)
    sk = c.skip
    if not isinstance(sk, torch.Tensor) or sk.dtype != torch.uint8 or sk.device != device \
            or sk.shape != (chunks,) or not sk.is_contiguous():
        desc = f"{sk.dtype} of shape {tuple(sk.shape)} on {sk.device}" if isinstance(sk, torch.Tensor) \
            else type(sk).__name__
        raise LeafError(f"{where}: skip must be a contiguous uint8 tensor of shape ({chunks},) on {device} (one "
                        f"flag per {FINITE_CHUNK} elements), got {desc}")
    refuse_short_storage(sk, lambda: f"{where}: skip")
    from sofx.kernels.donation import check_written  # (donation imports this module)

    check_written(where, [("skip", sk)])
    written = [("p_copy", c.p_copy, None)]
    if c.out is not None:
        written += zip(("out[0]", "out[1]", "out[2]"), c.out, (c.p.dtype, c.m.dtype, c.v.dtype))
    for name, t, dtype in written:
        if t is not None and not (t.is_contiguous() and (dtype is None or t.dtype == dtype)):
            raise UnsupportedError(f"{where}: {name} is not contiguous or not of its input's dtype; a checked step "
                                   "(skip) writes its outputs in place")
