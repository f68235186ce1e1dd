"""Exceptions raised by sofx.

Every error that concerns one leaf of a pytree names that leaf's path
(``params['layers'][3]['w']``) together with what was expected and what was
found. Raising one of these guarantees that nothing was modified, but for a
:class:`SnapshotLimitError` that a donated update's own step found: its inputs
were stepped, then taken back, a few ulps off where the inverse ran (see it).
"""

from __future__ import annotations


class SofxError(ValueError):
    """Base class of every error sofx raises for bad input."""


class StructureError(SofxError):
    """Two pytrees that must have the same structure do not."""


class LeafError(SofxError):
    """A leaf has the wrong shape, dtype or device."""


class HParamError(SofxError):
    """A hyperparameter is out of its valid range or has the wrong form."""


class UndoError(SofxError):
    """An undo record does not belong to the state it is applied to, or was used already."""


class UnsupportedError(SofxError):
    """A combination of options (backend, device, dtype, undo strategy) is not supported."""


class SnapshotLimitError(SofxError):
    """An undoable update would keep more snapshot memory than its ``snapshot_limit_bytes`` allows.

    An update refused before it ran touched nothing. One whose step found the need
    (:func:`sofx.kernels.base.lossy_elements`, a gradient not finite) was taken back: its inputs are as they
    were (under donation: exactly where the need was found, by the inverse elsewhere, which the same test
    found sound: a few ulps) and its parameter copies hold the old parameters.
    ``needed``/``limit``: the bytes the record would hold, and those allowed.
    """

    def __init__(self, message: str, needed: int, limit: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.limit = limit

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.needed, self.limit)
