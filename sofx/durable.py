"""Making a write durable where the system allows: fsync of a file or a directory."""

from __future__ import annotations

import errno
import os

__all__ = ["fsync_best_effort", "fsync_where_supported"]

# fsync's errors that say the file system cannot sync this file (a directory on some file systems, a descriptor
# open for reading where fsync wants one for writing): nothing was lost, there is nothing to sync with.
_UNSUPPORTED = frozenset({errno.EINVAL, errno.EBADF, errno.EROFS, errno.ENOTSUP, errno.EOPNOTSUPP})


def fsync_where_supported(path: str) -> None:
    """fsync ``path``, a file or a directory (after a rename inside it: the rename is then durable); nothing where
    it cannot be opened (directories on Windows) or where the file system does not sync it (``EINVAL``, ``EBADF``,
    ``EROFS``, ``ENOTSUP``). Any other failure (``EIO``, ``ENOSPC``, ``EDQUOT``: what was written may not be on
    disk) is raised, the ``OSError`` as the system gave it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def fsync_best_effort(path: str) -> None:
    """:func:`fsync_where_supported`, every failure ignored: for files that can be made again (a build cache)."""
    try:
        fsync_where_supported(path)
    except OSError:
        pass
