"""Shared-memory tensors for the process executor, and the ``/dev/shm`` budget check.

Every shared tensor is a file in a shared-memory directory (``/dev/shm`` by
default) mapped with ``torch.from_file(shared=True)``: the main process and
the worker map the same file, so the state survives a dead worker (the main
process still holds its mapping). The files never have a name: each is made
unnamed (``O_TMPFILE``; where the filesystem lacks it, created and unlinked at
once) and held by an open descriptor, which the worker inherits at the same
number (``subprocess``'s ``pass_fds``) and maps as ``/proc/self/fd/N``. Nothing
is ever left in the directory however the processes end (a main process killed
while its worker started left every file there for good, as nothing else knew
their names); the memory goes back when the last descriptor and mapping of a
file are gone. Space is reserved with ``posix_fallocate`` when the file is
created, so a full ``/dev/shm`` is a clear ``OSError`` instead of a ``SIGBUS``
on first touch.

Before anything is created, :func:`shm_budget` says how many bytes may be
shared: the free space of the directory, optionally capped by a user limit
(containers often limit shared memory below what ``statvfs`` reports).
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import uuid
import weakref
from dataclasses import dataclass

import torch

from sofx.offload.arena import colour_offset

__all__ = ["SharedMemoryArena", "SharedTensorSpec", "shm_budget", "open_shared_tensor", "remove_files", "close_fds",
           "DEFAULT_SHM_DIR"]

DEFAULT_SHM_DIR = "/dev/shm"


def shm_budget(shm_dir: str = DEFAULT_SHM_DIR, limit_bytes: int | None = None) -> int:
    """Bytes that may be placed in ``shm_dir``: its free space, capped at ``limit_bytes``.

    0 when the directory does not exist or cannot be queried.
    """
    try:
        free = shutil.disk_usage(shm_dir).free
    except OSError:
        free = 0
    return free if limit_bytes is None else min(free, int(limit_bytes))


@dataclass(frozen=True)
class SharedTensorSpec:
    """How a worker finds a shared tensor: file path (``/proc/self/fd/N``: a descriptor it inherited; empty
    for no elements), number of elements, dtype name, and where in the file it starts (elements; page
    colouring, see :mod:`sofx.offload.arena`)."""

    path: str
    numel: int
    dtype: str
    offset: int = 0

    def to_json(self) -> dict:
        """The spec as JSON-able values (sent to a worker process; :meth:`from_json` reads it back)."""
        return {"path": self.path, "numel": self.numel, "dtype": self.dtype, "offset": self.offset}

    @staticmethod
    def from_json(d: dict) -> "SharedTensorSpec":
        """The spec :meth:`to_json` wrote."""
        return SharedTensorSpec(d["path"], d["numel"], d["dtype"], d.get("offset", 0))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def open_shared_tensor(spec: SharedTensorSpec) -> torch.Tensor:
    """Map an existing shared tensor file (in the worker, or again in the main process while the arena is open)."""
    dtype = _dtype(spec.dtype)
    if spec.numel == 0:
        return torch.zeros(0, dtype=dtype)
    return torch.from_file(spec.path, shared=True, size=spec.offset + spec.numel, dtype=dtype)[spec.offset:]


def remove_files(paths: list[str]) -> None:
    """Unlink ``paths`` (those already gone are skipped)."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def close_fds(fds: list[int]) -> None:
    """Close the descriptors ``fds`` and empty the list (idempotent)."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


#: Descriptors left for the rest of the process (and a mapping's own, briefly) beyond those of an arena's files.
_SPARE_FDS = 256

#: What ``open(dir, O_TMPFILE)`` fails with where the kernel or the filesystem cannot make unnamed files.
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)


def _unnamed_file(shm_dir: str, fallback_path: str, held: int) -> int:
    """A descriptor (read-write, not inherited) of a new empty file in ``shm_dir`` that has no name (see
    :func:`_open_unnamed`); ``held``: the descriptors of files the caller holds already. A descriptor per tensor
    is held until the worker has mapped them all (a large model has thousands; the soft limit is often 1024):
    the soft limit is raised toward the hard one to leave room for as many again, and on ``EMFILE``."""
    _raise_descriptor_limit(2 * held + _SPARE_FDS)
    try:
        return _open_unnamed(shm_dir, fallback_path)
    except OSError as exc:
        if exc.errno != errno.EMFILE or not _raise_descriptor_limit(None):
            raise
    return _open_unnamed(shm_dir, fallback_path)


def _open_unnamed(shm_dir: str, fallback_path: str) -> int:
    """A new file in ``shm_dir`` made without a name (``O_TMPFILE``), or else created as ``fallback_path`` and
    unlinked at once."""
    try:
        return os.open(shm_dir, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as exc:
        if exc.errno not in _NO_TMPFILE or not os.path.isdir(shm_dir):
            raise
    fd = os.open(fallback_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(fallback_path)
    except BaseException:
        os.close(fd)
        remove_files([fallback_path])
        raise
    return fd


def _raise_descriptor_limit(need: int | None) -> bool:
    """Raise this process's soft limit on open descriptors where it is below ``need``: to ``need`` or twice what
    it was, whichever is more (``need`` None: twice), at most to the hard limit; whether it rose."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if need is not None and (soft == resource.RLIM_INFINITY or soft >= need):
        return False
    target = 2 * soft if need is None else max(need, 2 * soft)
    if hard != resource.RLIM_INFINITY:
        target = min(target, hard)
    if target <= soft:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        return False
    return True


class SharedMemoryArena:
    """Zeroed tensors backed by unnamed files in ``shm_dir`` (page-coloured: large ones start
    ``colour_offset`` elements into their file), one open descriptor each (:attr:`fds`).

    A worker process maps them by inheriting :attr:`fds` at the same numbers (``pass_fds``): every spec's
    path is ``/proc/self/fd/N``. :meth:`close` closes the descriptors (the mappings stay valid; the engine
    closes its arena as soon as the worker process has mapped the tensors), as do garbage collection and
    interpreter exit, whichever comes first.
    """

    def __init__(self, shm_dir: str = DEFAULT_SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self.prefix = f"sofx-{os.getpid()}-{uuid.uuid4().hex[:12]}-"  # (the names a file has for an instant
        # where O_TMPFILE is not supported)
        self.specs: dict[str, SharedTensorSpec] = {}
        self._closed = False
        #: The open descriptors of the files, one per tensor of more than 0 elements.
        self.fds: list[int] = []
        #: The files' inode numbers (what ``/proc/PID/maps`` shows of a mapping of them).
        self.inodes: list[int] = []
        self._finalizer = weakref.finalize(self, close_fds, self.fds)

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in a new unnamed file of the shared-memory directory (its spec in :attr:`specs`)."""
        if self._closed:
            raise RuntimeError("the shared-memory arena is closed")
        if name in self.specs:
            raise ValueError(f"shared tensor {name!r} exists already")
        element_size = torch.empty((), dtype=dtype).element_size()
        offset = colour_offset(len(self.specs), numel, element_size)
        nbytes = (offset + numel) * element_size
        path = ""
        if numel > 0:
            fd = _unnamed_file(self.shm_dir, os.path.join(self.shm_dir, self.prefix + name), len(self.fds))
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                os.close(fd)
                raise OSError(exc.errno, f"cannot reserve {nbytes} bytes of shared memory in {self.shm_dir} "
                                         f"for {name}: {exc.strerror}") from exc
            self.fds.append(fd)
            self.inodes.append(os.fstat(fd).st_ino)
            path = f"/proc/self/fd/{fd}"
        spec = SharedTensorSpec(path, numel, str(dtype).replace("torch.", ""), offset)
        self.specs[name] = spec
        return open_shared_tensor(spec)  # a fresh file reads as zeros

    def close(self) -> None:
        """Close the files' descriptors (idempotent): the memory goes back once the mappings are gone too."""
        self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        return f"SharedMemoryArena({self.shm_dir!r}, {len(self.specs)} tensors)"
