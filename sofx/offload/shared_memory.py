"""Shared-memory tensors for the process executor, and the ``/dev/shm`` budget check.

Every shared tensor is a file in a shared-memory directory (``/dev/shm`` by
default) mapped with ``torch.from_file(shared=True)``: the main process and
the worker map the same file by name, so the state survives a dead worker
(the main process still holds its mapping). Space is reserved with
``posix_fallocate`` when the file is created, so a full ``/dev/shm`` is a
clear ``OSError`` instead of a ``SIGBUS`` on first touch.

Before anything is created, :func:`shm_budget` says how many bytes may be
shared: the free space of the directory, optionally capped by a user limit
(containers often limit shared memory below what ``statvfs`` reports).
"""

from __future__ import annotations

import os
import shutil
import uuid
import weakref
from dataclasses import dataclass

import torch

from sofx.offload.arena import colour_offset

__all__ = ["SharedMemoryArena", "SharedTensorSpec", "shm_budget", "open_shared_tensor", "remove_files",
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
    """How a worker finds a shared tensor: file path, number of elements, dtype name, and where in
    the file it starts (elements; page colouring, see :mod:`sofx.offload.arena`)."""

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
    """Map an existing shared tensor file (in the worker)."""
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


class SharedMemoryArena:
    """Zeroed tensors backed by files ``{shm_dir}/sofx-{pid}-{uuid}-{name}`` (page-coloured: large ones
    start ``colour_offset`` elements into their file).

    The files are removed by :meth:`close`, when the arena is garbage collected, or at interpreter
    exit, whichever comes first (mappings that are still open stay valid until released: the offload
    engine closes its arena as soon as the worker process has mapped the tensors).
    """

    def __init__(self, shm_dir: str = DEFAULT_SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self.prefix = f"sofx-{os.getpid()}-{uuid.uuid4().hex[:12]}-"
        self.specs: dict[str, SharedTensorSpec] = {}
        self._closed = False
        self._paths: list[str] = []
        self._finalizer = weakref.finalize(self, remove_files, self._paths)

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in a new file of the shared-memory directory (its spec in :attr:`specs`)."""
        if self._closed:
            raise RuntimeError("the shared-memory arena is closed")
        if name in self.specs:
            raise ValueError(f"shared tensor {name!r} exists already")
        path = os.path.join(self.shm_dir, self.prefix + name)
        element_size = torch.empty((), dtype=dtype).element_size()
        offset = colour_offset(len(self.specs), numel, element_size)
        nbytes = (offset + numel) * element_size
        spec = SharedTensorSpec(path, numel, str(dtype).replace("torch.", ""), offset)
        if numel > 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                os.close(fd)
                os.unlink(path)
                raise OSError(exc.errno, f"cannot reserve {nbytes} bytes of shared memory in {self.shm_dir} "
                                         f"for {name}: {exc.strerror}") from exc
            os.close(fd)
            self._paths.append(path)
        self.specs[name] = spec
        return open_shared_tensor(spec)  # a fresh file reads as zeros

    def close(self) -> None:
        """Remove the files (idempotent)."""
        self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        return f"SharedMemoryArena({self.shm_dir!r}, {len(self.specs)} tensors)"
