"""Where the engine's flat tensors are allocated: an arena hands out named, zeroed tensors.

:class:`LocalArena` allocates ordinary tensors on a device (the inline and
thread executors, and device blocks). :class:`sofx.offload.shared_memory.SharedMemoryArena`
allocates tensors backed by unnamed files in ``/dev/shm`` that a worker process
maps through the descriptors it inherits (the process executor). Both have the same small interface.

Page colouring (CPU arenas): large allocations come back at page offsets that
cycle through ``PAGE_COLOURS`` values ``COLOUR_BYTES`` apart, so that a block's
master weights, moments and gradient (allocated one after another) do not all
start at the same offset within a 4 KiB page. The kernels stream these arrays at
the same index; when all of them share a page offset (what any allocator gives
large tensors) a late clip's fused undo+redo ran 2-5% slower than with the
offsets spread (``benchmarks/arena_colouring.py``, benchmarks/RESULTS.md; more
before the kernels prefetched their streams). Since the AVX-512 vector loops
stagger their streams' prefetch distances the placement is within 1% there;
colouring costs nothing and stays for the builds without those loops (not
measured there).

Huge pages (CPU arenas): large allocations are advised for transparent huge
pages before they are zeroed (:mod:`sofx.offload.huge_pages`): the kernels'
four to six streams then need a new page translation every 2 MiB instead of
every 4 KiB (a float32 undo+redo ~10% faster on the Xeon of stop 27).
"""

from __future__ import annotations

from typing import Protocol

import torch

from sofx.offload.huge_pages import zeros_advised

__all__ = ["TensorArena", "LocalArena", "colour_offset", "PAGE_COLOURS", "COLOUR_BYTES", "MIN_COLOURED_BYTES"]

PAGE_COLOURS = 4
COLOUR_BYTES = 1088  # 17 cache lines: consecutive colours land in distinct L1 sets
MIN_COLOURED_BYTES = 1 << 16


def colour_offset(index: int, numel: int, element_size: int) -> int:
    """Elements to skip at the start of the ``index``-th allocation of an arena (0 for small ones)."""
    if numel * element_size < MIN_COLOURED_BYTES:
        return 0
    return (index % PAGE_COLOURS) * COLOUR_BYTES // element_size


class TensorArena(Protocol):
    """Allocates named, zero-initialised 1-d tensors."""

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new zeroed 1-d tensor of ``numel`` elements of ``dtype``, known by ``name`` in this arena."""
        ...

    def close(self) -> None:
        """Release what the arena holds (idempotent); its tensors must not be used afterwards."""
        ...


class LocalArena:
    """Plain tensors on ``device`` (nothing to release but references); page-coloured on the CPU."""

    def __init__(self, device: torch.device | str = "cpu", huge_pages: bool = True) -> None:
        self.device = torch.device(device)
        self.huge_pages = huge_pages  # CPU: advise huge pages for large tensors (zeros_advised)
        self._count = 0

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor; on the CPU starting at this arena's next page colour (see :func:`colour_offset`),
        a large one in huge pages where the system gives them (:func:`sofx.offload.huge_pages.zeros_advised`;
        ``huge_pages=False``: plain ``torch.zeros``)."""
        if self.device.type != "cpu":
            return torch.zeros(numel, dtype=dtype, device=self.device)
        offset = colour_offset(self._count, numel, torch.empty((), dtype=dtype).element_size())
        self._count += 1
        if not self.huge_pages:
            return torch.zeros(offset + numel, dtype=dtype)[offset:]
        return zeros_advised(offset + numel, dtype)[offset:]

    def close(self) -> None:
        """Nothing to release: the tensors are freed with their last reference."""
        pass

    def __repr__(self) -> str:
        return f"LocalArena({self.device})"
