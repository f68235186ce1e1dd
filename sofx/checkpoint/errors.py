"""Exceptions raised by :mod:`sofx.checkpoint`.

Every checkpoint error is a :class:`CheckpointError` (itself a
:class:`sofx.errors.SofxError`, so a ``ValueError``). A failed load or save
never modifies the tree passed in, and a failed save never touches the
checkpoint already at the destination.
"""

from __future__ import annotations

import os
from typing import Any

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


def system_error(message: str, errno: int | None) -> CheckpointIOError:
    """A :class:`CheckpointIOError` saying ``message``, its ``errno`` the system's (``exc.errno`` of the ``OSError``
    it stands for, or a number such as ``EACCES``)."""
    failure = CheckpointIOError(message)
    failure.errno = errno
    return failure


def check_path(who: str, path: Any) -> str:
    """``path`` as text (``os.fsdecode``: a path in bytes, or an ``os.PathLike`` giving bytes, is the path it names;
    safetensors and ``os.path.join`` with text took it for a bare TypeError). A ``path`` that ``os.fspath`` does not
    take is refused with a :class:`CheckpointError` naming ``who`` (a tree passed first, as ``torch.save(obj, f)``
    takes its arguments, raised a bare TypeError from deep inside). A path holding a NUL character, which no system
    takes (the os module raised a bare ``ValueError: embedded null byte``), is refused so too."""
    if isinstance(path, (str, bytes, os.PathLike)):
        text = os.fsdecode(path)
        if "\0" in text:
            raise CheckpointError(f"{who}: the path {text!r:.200} holds a NUL character, which no file's path can hold")
        return text
    hint = "" if path is None else f" ({who}'s arguments: the path comes first)"
    raise CheckpointError(f"{who}: path must be a str or os.PathLike, got {type(path).__name__} {path!r:.80}{hint}")

