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
is set). :func:`zeros_advised` allocates a tensor, advises the 2 MiB-aligned part of it, then zeroes
it (the first touch). The advice is a hint: where the kernel has no huge pages to give, or on other
systems, nothing changes but the page size. Small tensors (below :data:`MIN_ADVISED_BYTES`) are left
alone, as are file-backed mappings (the process executor's ``/dev/shm`` tensors follow
``shmem_enabled``, which is ``never`` on the machines seen so far).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

__all__ = ["HUGE_PAGE_BYTES", "MIN_ADVISED_BYTES", "MADV_HUGEPAGE", "huge_pages_mode", "advise_huge_pages",
           "zeros_advised"]

HUGE_PAGE_BYTES = 2 << 20
MIN_ADVISED_BYTES = 8 << 20  # four huge pages: below that the translations cost little
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
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


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Advise huge pages for the 2 MiB-aligned part of ``t``'s memory; True if advice was given.

    Pages already touched keep their size (the kernel may merge them later); call it before the first
    write. A no-op (False) for non-CPU or small tensors, where the system has no transparent huge pages
    (mode ``never``), or where ``madvise`` is missing or refuses (a file mapping, say).
    """
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_ADVISED_BYTES:
        return False
    if huge_pages_mode() not in ("always", "madvise"):
        return False
    fn = _madvise()
    if fn is None:
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    return fn(first, last - first, MADV_HUGEPAGE) == 0


def zeros_advised(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(numel, dtype=dtype)`` on the CPU, its memory advised for huge pages before it is zeroed."""
    t = torch.empty(numel, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()
