"""Exceptions raised by :mod:`sofx.checkpoint`.

Every checkpoint error is a :class:`CheckpointError` (itself a
:class:`sofx.errors.SofxError`, so a ``ValueError``). A failed load or save
never modifies the tree passed in, and a failed save never touches the
checkpoint already at the destination.
"""

from __future__ import annotations

from sofx.errors import SofxError, StructureError


class CheckpointError(SofxError):
    """Base class of the checkpoint errors (also raised for a tree that cannot be saved)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist (also a ``FileNotFoundError``)."""


class CorruptCheckpointError(CheckpointError):
    """The file is not a readable sofx checkpoint: truncated, bad header, bad checksum, not ours."""


class CheckpointVersionError(CheckpointError):
    """The file was written in a format version this sofx cannot read."""


class CheckpointMismatchError(CheckpointError, StructureError):
    """The checkpoint does not match the template (``like=``): structure, shape, dtype or kind of a leaf."""


class CheckpointIOError(CheckpointError, OSError):
    """Writing or reading a checkpoint file failed at the operating system (a full disk, a quota, an I/O
    error); an ``OSError`` too, with the cause chained."""

