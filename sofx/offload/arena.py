"""Where the engine's flat tensors are allocated: an arena hands out named, zeroed tensors.

:class:`LocalArena` allocates ordinary tensors on a device (the inline and
thread executors, and device blocks). :class:`sofx.offload.shared_memory.SharedMemoryArena`
allocates tensors backed by files in ``/dev/shm`` that a worker process maps
by name (the process executor). Both have the same small interface.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["TensorArena", "LocalArena"]


class TensorArena(Protocol):
    """Allocates named, zero-initialised 1-d tensors."""

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def close(self) -> None: ...


class LocalArena:
    """Plain tensors on ``device`` (nothing to release but references)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"LocalArena({self.device})"
