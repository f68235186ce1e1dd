"""Transparent huge pages for the engine's large CPU arrays.

The CPU kernels stream four to six arrays at once (a fused undo+redo reads ``p', m', v'``, the old and
the new gradient). With 4 KiB pages every stream crosses a page, and needs a translation, every 1024
float32 elements: on the 2-core Intel Xeon of stop 27 (benchmarks/RESULTS.md, "Intel Xeon (AVX-512, AMX),
stop 27") ``cpu_fast``'s float32 undo+redo of 2^26 elements took 47.8-50.0 ms in 4 KiB pages against
42.3-45.1 in 2 MiB ones, its step 37.5-39.8 against 35.3-36.7; the memory traffic alone
(``benchmarks/memory_floor.py``) set undo+redo / step at 1.24-1.28 in small pages, above issue 4's 1.25,
and at 1.22 in huge ones.

Linux gives an anonymous mapping huge pages on first touch where the region is advised with
``madvise(MADV_HUGEPAGE)`` and ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
``madvise`` (torch's own allocator does the same for every allocation when ``THP_MEM_ALLOC_ENABLE=1``
is set). Advising the memory torch's allocator hands out was not enough: in the full test suite such
tensors came back in 4 KiB pages (pages touched before keep their size; the likely cause, not proven). So
:func:`zeros_advised` maps fresh anonymous memory of its own (Python's ``mmap``, already zero), advises it
and wraps it as a tensor (``torch.frombuffer``, which keeps the mapping alive while the tensor's storage
lives; such a tensor cannot be resized). The advice is a hint: where the kernel has no huge pages to give,
nothing changes but the page size; on other systems, or without transparent huge pages, or for tensors
below :data:`MIN_ADVISED_BYTES`, it is an ordinary ``torch.zeros``. File-backed mappings (the process
executor's ``/dev/shm`` tensors) follow ``shmem_enabled`` instead, ``never`` on the machines seen so far.
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["HUGE_PAGE_BYTES", "MIN_ADVISED_BYTES", "huge_pages_mode", "zeros_advised"]

HUGE_PAGE_BYTES = 2 << 20
MIN_ADVISED_BYTES = 8 << 20  # a mapping of its own per tensor from here on (an engine block: 16 MiB per fp32 array)
_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_mode() -> str:
    """The system's transparent-huge-page mode (``always``, ``madvise`` or ``never``), ``""`` where unknown."""
    try:
        with open(_MODE_FILE, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def _advisable(nbytes: int) -> bool:
    return (nbytes >= MIN_ADVISED_BYTES and hasattr(mmap, "MADV_HUGEPAGE")
            and huge_pages_mode() in ("always", "madvise"))


def zeros_advised(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(numel, dtype=dtype)`` on the CPU; a large one in its own anonymous mapping, starting at a
    2 MiB boundary, its whole huge pages advised before anything touches them (the rest, under 2 MiB at the
    end, keeps small pages: no memory beyond the tensor's is taken; see the module doc)."""
    nbytes = numel * dtype.itemsize
    if not _advisable(nbytes):
        return torch.zeros(numel, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return torch.zeros(numel, dtype=dtype)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES
    try:
        # only whole huge pages inside the tensor: a last partial one would take 2 MiB for less
        region.madvise(mmap.MADV_HUGEPAGE, skip, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError:
        pass  # a hint only: the memory is the same
    return whole[skip:skip + nbytes].view(dtype)
