"""Large CPU arrays of the offload engine in transparent huge pages (``sofx.offload.huge_pages``): the advice
reaches the kernel where the system allows it, the tensors are ordinary zeroed ones, and small or non-CPU
tensors are left alone."""

from __future__ import annotations

import sys

import pytest
import torch

from sofx.offload import huge_pages
from sofx.offload.arena import LocalArena
from sofx.offload.huge_pages import MIN_ADVISED_BYTES, advise_huge_pages, huge_pages_mode, zeros_advised

THP = sys.platform.startswith("linux") and huge_pages_mode() in ("always", "madvise")


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (/proc/self/smaps), in bytes."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_advised_is_a_zeroed_cpu_tensor(dtype) -> None:
    t = zeros_advised((MIN_ADVISED_BYTES // 2) + 12345, dtype)
    assert t.dtype == dtype and t.device.type == "cpu" and t.numel() == MIN_ADVISED_BYTES // 2 + 12345
    assert t.is_contiguous() and not t.any()


@pytest.mark.skipif(not THP, reason="needs Linux with transparent huge pages in mode always or madvise")
def test_large_arrays_get_huge_pages() -> None:
    t = zeros_advised(8 << 20, torch.float32)  # 32 MiB
    assert _huge_bytes_at(t.data_ptr() + t.numel() * 2) >= huge_pages.HUGE_PAGE_BYTES
    t += 1.0  # an ordinary tensor
    assert float(t.sum()) == t.numel()


@pytest.mark.skipif(not THP, reason="needs Linux with transparent huge pages in mode always or madvise")
def test_the_engine_arena_allocates_large_cpu_tensors_in_huge_pages() -> None:
    arena = LocalArena("cpu")
    tensors = [arena.allocate(f"t{i}", 4 << 20, torch.float32) for i in range(3)]  # 16 MiB each
    for t in tensors:
        assert not t.any()
        assert _huge_bytes_at(t.data_ptr() + t.numel() * 2) >= huge_pages.HUGE_PAGE_BYTES


def test_small_and_meta_tensors_are_left_alone() -> None:
    assert advise_huge_pages(torch.empty(MIN_ADVISED_BYTES // 4 - 1)) is False
    assert advise_huge_pages(torch.empty(1 << 24, device="meta")) is False


def test_no_advice_where_the_system_has_none(monkeypatch) -> None:
    monkeypatch.setattr(huge_pages, "huge_pages_mode", lambda: "never")
    t = torch.empty(1 << 22)
    assert advise_huge_pages(t) is False
    assert not zeros_advised(1 << 22, torch.float32).any()


def test_mode_is_read_from_the_bracketed_word(tmp_path, monkeypatch) -> None:
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_MODE_FILE", str(path))
    assert huge_pages_mode() == "madvise"
    monkeypatch.setattr(huge_pages, "_MODE_FILE", str(tmp_path / "missing"))
    assert huge_pages_mode() == ""
