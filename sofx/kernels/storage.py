"""Tensors whose elements reach past the end of their storage are refused before anything is written.

FSDP frees a tensor's memory while keeping the tensor (``untyped_storage().resize_(0)``), and a storage can be
resized to fewer bytes than its views need. Native code handed such a tensor's address reads and writes outside
any allocation (a segmentation fault at address 0, memory of something else past a shrunk end), and torch's own
operations crash on it too. Every entry that hands tensors on refuses such a one first with
:func:`refuse_short_storage`, naming it as its caller does (a kernel argument ``"cpu.step: g"``, a leaf path
``"grads['w']"``, a parameter of the offload engine): one test (:func:`storage_shortfall`), one message
(:func:`short_storage_message`). The name is built only to raise (a callable), so the common case costs the
test alone. Callers that check many tensors per step (:class:`sofx.Adam`'s leaves and records) first take the
common case in one expression each (:func:`in_storage`, or the same test inline), and refuse with
:func:`refuse_short_storage` only where it does not hold; the kernels' own common cases do so inline, or skip it
where their caller checked (:data:`sofx.kernels.base.STORAGE_CHECKED`). Beyond the kernels and
:class:`sofx.Adam`, the same refusal guards what reads the user's tensors before them: the gradient transforms
(``sofx.transforms``: each leaf once, in ``_gradient_leaves``), a speculative step's late gradients and
``apply_if_finite``'s finiteness test, a number given as a tensor (:func:`sofx.kernels.base.as_number`,
:func:`sofx.kernels.user_numbers.real_number`: an hparam, ``grad_scale``, a loss scale, named by their callers), the
offload engine's state loading and the model parameters it writes, and the checkpoint writers and converters.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from sofx.errors import LeafError

__all__ = ["in_storage", "storage_shortfall", "short_storage_message", "refuse_short_storage"]

#: How a caller names the tensor it checks: the name, or a function that builds it (called only to raise).
TensorName = Union[str, Callable[[], str]]


def in_storage(t: torch.Tensor) -> bool:
    """The common case of :func:`storage_shortfall` in one expression (~0.25 us): ``t`` contiguous and its storage
    holding ``storage_offset * element_size + nbytes`` bytes (``nbytes`` at offset 0, a tensor that starts its
    storage: no element size read). False where it is not, or where it cannot tell (no storage to look at: a
    ``torch.func`` wrapper); :func:`storage_shortfall` decides those. Not under ``torch.compile`` (Dynamo cannot
    read a fake tensor's storage): its callers test that once for all their tensors."""
    try:
        offset = t.storage_offset()
        return t.is_contiguous() and t.untyped_storage().nbytes() >= (
            t.nbytes if not offset else offset * t.element_size() + t.nbytes)
    except (NotImplementedError, RuntimeError):  # (torch.func's wrappers: "Cannot access storage of ...")
        return False


def storage_shortfall(t: torch.Tensor) -> tuple[int, int] | None:
    """``(have, need)`` in bytes where ``t``'s elements reach past the end of its storage, else None.

    ``need`` is where its last element ends, ``(storage_offset + 1 + sum((size - 1) * stride)) * element_size``
    (``(storage_offset + numel) * element_size`` where contiguous; less for an ``expand()``-ed view, stride 0;
    more than ``numel`` elements for a slice with gaps), ``have`` its storage's ``nbytes()``. A storage
    resized to 0 (``untyped_storage().resize_(0)``, as FSDP frees a tensor's memory while keeping the tensor)
    has no memory at all: native code handed its address reads and writes outside any allocation. An empty
    tensor needs nothing; a tensor without a storage to look at (a ``torch.func`` wrapper, a subclass without
    one) is None too, and so is every tensor under ``torch.compile`` (its tracing has fake tensors, whose storage
    Dynamo cannot read). About 0.3 us a tensor."""
    n = t.numel()
    if not n or torch.compiler.is_compiling():
        return None
    try:
        have = t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):  # (torch.func's wrappers: "Cannot access storage of ...")
        return None
    size, offset = t.element_size(), t.storage_offset()
    if (offset + n) * size <= have and t.is_contiguous():
        return None
    need = (offset + 1 + sum((k - 1) * s for k, s in zip(t.shape, t.stride()))) * size
    return None if need <= have else (have, need)


#: What :func:`short_storage_message` tells the caller to do, unless its caller knows better.
GIVE_IT_BACK = "give it its memory back (or a tensor that has it) before this call"


def short_storage_message(name: str, t: torch.Tensor, have: int, need: int, remedy: str = GIVE_IT_BACK) -> str:
    """The error for tensor ``name`` (``"grads['w']"``, ``"cpu.step: g"``) whose storage holds ``have`` bytes where
    its elements need ``need`` (:func:`storage_shortfall`), ending with ``remedy`` (what to do: by default, give it
    its memory back before the call; a caller where that is not enough says what is)."""
    return (f"{name}: its storage holds {have} bytes, but its elements (shape {tuple(t.shape)}, strides "
            f"{t.stride()}, storage offset {t.storage_offset()}, {t.dtype}) reach byte {need}: its memory was freed "
            f"or shrunk (untyped_storage().resize_(), as FSDP frees a tensor's memory); {remedy}")


def refuse_short_storage(t: torch.Tensor, name: TensorName, error: type[Exception] = LeafError) -> None:
    """Raise ``error`` (:class:`~sofx.errors.LeafError` unless the caller's kind of refusal is another) where
    ``t``'s elements reach past the end of its storage (:func:`storage_shortfall`), with
    :func:`short_storage_message` naming it ``name`` (a string, or a function returning it: called only to
    raise); nothing else is looked at or changed."""
    short = storage_shortfall(t)
    if short is not None:
        raise error(short_storage_message(name if isinstance(name, str) else name(), t, *short))
