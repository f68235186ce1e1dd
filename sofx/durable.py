"""Making a write durable where the system allows: fsync of a file or a directory, best effort."""

from __future__ import annotations

import os

__all__ = ["fsync_best_effort"]


def fsync_best_effort(path: str) -> None:
    """fsync ``path``, a file or a directory (after a rename inside it: the rename is then durable); nothing
    where it cannot be opened or synced (directories on Windows, some file systems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
