"""A rank's refusal of its own input, and the error the other ranks raise for it.

A collective's ranks wait for each other: a rank that raised before the
collective alone would leave the others waiting there until the group's
timeout. So each collective checks its own input first (:func:`_check_arguments`,
:func:`_check_floating_tensors`, :func:`_check_writable`, :func:`_no_data`),
still takes part in the collective's agreement as a rank that refuses
(:func:`_as_refusal`), and raises its error after telling the others;
:class:`RankRefusedError` is what the sum-of-squares hook raises on the others.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sofx.errors import SofxError
from sofx.kernels.donation import unwritable

__all__ = ["RankRefusedError"]


class RankRefusedError(SofxError):
    """Another rank refused this step before its sum of squares was reduced (bad input there, say).

    Raised by :func:`all_reduce_sumsq`'s hook on every rank that did not refuse, in place of the sum:
    nothing was stepped on this rank either (the loops call the hook before they write), so every rank
    stays at the same step. ``ranks``: those that refused (their own errors say why).
    """

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.ranks)


def _check_floating_tensors(what: str, paths: Sequence[str], grads: Sequence[Any]) -> None:
    """Refuse a gradient that is not a dense floating-point tensor with data (:func:`_no_data`), naming its path
    (``paths``, one per gradient); ``None`` (no gradient) passes."""
    for path, g in zip(paths, grads):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            raise SofxError(f"{what}: {path} is of type {type(g).__name__}; expected a floating-point tensor")
        if not g.is_floating_point():
            raise SofxError(f"{what}: {path} is a {g.dtype} tensor; expected a floating-point one")
        why = _no_data(g)
        if why is not None:
            raise SofxError(f"{what}: {path} is {why}")


def _check_writable(what: str, paths: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
    """Refuse a gradient the mean cannot be written into in place, before any is written (``copy_`` would
    raise on it after the leaves before it were overwritten): :func:`sofx.kernels.donation.unwritable`."""
    for path, g in zip(paths, grads):
        why = unwritable(path, g)
        if why is not None:
            raise SofxError(f"{what}: {why} (the mean is written into the gradients)")


def _check_arguments(what: str, positional: str, extra: tuple[Any, ...], unknown: dict[str, Any],
                     known: Sequence[str]) -> None:
    """Refuse the positional arguments a collective caught in ``*extra`` (after its own, ``positional``) and the
    keyword arguments it caught in ``**unknown`` (it takes ``known``): a misspelt keyword or one positional
    argument too many on one rank is that rank's refusal, told to the others inside the collective, where
    Python's ``TypeError`` at the call left them waiting for it."""
    if extra:
        raise SofxError(f"{what}: {len(extra)} positional argument{'s' if len(extra) > 1 else ''} too many "
                        f"({', '.join(type(a).__name__ for a in extra)}); it takes {positional}, then only the "
                        f"keywords {', '.join(known)}")
    if unknown:
        names = ", ".join(map(repr, sorted(unknown)))
        raise SofxError(f"{what}: unknown keyword argument{'s' if len(unknown) > 1 else ''} {names}; it takes "
                        f"{', '.join(known)}")


def _no_data(x: torch.Tensor) -> str | None:
    """Why a collective cannot pack tensor ``x`` into a flat buffer (``None`` where it can): a meta tensor has no
    data, a sparse, nested or other non-strided one has no flat view of its elements (a nested tensor of the
    strided layout has not even a shape)."""
    if x.is_nested:
        return "a nested tensor; expected a dense (strided) one"
    if x.layout != torch.strided:
        return f"a {x.layout} tensor; expected a dense (strided) one"
    if x.is_meta:
        return "a meta tensor, without data"
    return None


def _as_refusal(what: str, error: Exception) -> SofxError:
    """``error``, raised by this rank's check of its own input, as the refusal it raises after telling the others
    (a :class:`SofxError` as it is; anything else, an input the checks did not foresee, wrapped)."""
    if isinstance(error, SofxError):
        return error
    refusal = SofxError(f"{what}: this rank's input could not be read ({type(error).__name__}: {error})")
    refusal.__cause__ = error
    return refusal
