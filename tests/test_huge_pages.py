"""Large CPU arrays of the offload engine in transparent huge pages (``sofx.offload.huge_pages``): the advice
reaches the kernel where the system allows it (also after other allocations), the tensors are ordinary
zeroed ones that keep their mapping alive, and small tensors, or any where the system has no transparent
huge pages, are plain ``torch.zeros``."""

from __future__ import annotations

import sys

import pytest
import torch

from sofx.offload import huge_pages
from sofx.offload.arena import LocalArena
from sofx.offload.huge_pages import HUGE_PAGE_BYTES, MIN_ADVISED_BYTES, huge_pages_mode, zeros_advised

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


def _why(t: torch.Tensor) -> str:
    """What to look at when a tensor has no huge pages: the kernel's THP fault counters."""
    with open("/proc/vmstat", encoding="ascii") as f:
        counters = [line.strip() for line in f if line.startswith(("thp_fault", "compact_"))]
    return f"address {t.data_ptr():#x}, mode {huge_pages_mode()}; " + ", ".join(counters)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [MIN_ADVISED_BYTES // 2 + 12345, 12345])
def test_zeros_advised_is_a_zeroed_cpu_tensor(dtype, numel) -> None:
    t = zeros_advised(numel, dtype)
    assert t.dtype == dtype and t.device.type == "cpu" and t.shape == (numel,)
    assert t.is_contiguous() and not t.any()
    t[-1] = 3.0
    assert float(t.sum()) == 3.0


@pytest.mark.skipif(not THP, reason="needs Linux with transparent huge pages in mode always or madvise")
def test_large_arrays_get_huge_pages_even_after_other_allocations() -> None:
    # memory torch's allocator recycles has been touched already: zeros_advised maps its own
    scratch = [torch.ones(1 << 22) for _ in range(8)]
    del scratch
    t = zeros_advised(8 << 20, torch.float32)  # 32 MiB
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    t += 1.0
    assert _huge_bytes_at(t.data_ptr() + t.numel() * 2) >= HUGE_PAGE_BYTES, _why(t)
    assert float(t.sum()) == t.numel()
    view = t[5:]
    del t
    assert float(view[-1]) == 1.0  # the mapping lives as long as any view of it


@pytest.mark.skipif(not THP, reason="needs Linux with transparent huge pages in mode always or madvise")
def test_the_engine_arena_allocates_large_cpu_tensors_in_huge_pages() -> None:
    arena = LocalArena("cpu")
    tensors = [arena.allocate(f"t{i}", 4 << 20, torch.float32) for i in range(3)]  # 16 MiB each
    for t in tensors:
        assert not t.any()
        t.fill_(2.0)
        assert _huge_bytes_at(t.data_ptr() + t.numel() * 2) >= HUGE_PAGE_BYTES, _why(t)


def test_small_tensors_and_systems_without_huge_pages_get_plain_zeros(monkeypatch) -> None:
    assert zeros_advised(MIN_ADVISED_BYTES // 4 - 1, torch.float32).untyped_storage().resizable()
    monkeypatch.setattr(huge_pages, "huge_pages_mode", lambda: "never")
    t = zeros_advised(1 << 22, torch.float32)
    assert t.untyped_storage().resizable() and not t.any()


def test_mode_is_read_from_the_bracketed_word(tmp_path, monkeypatch) -> None:
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_MODE_FILE", str(path))
    assert huge_pages_mode() == "madvise"
    monkeypatch.setattr(huge_pages, "_MODE_FILE", str(tmp_path / "missing"))
    assert huge_pages_mode() == ""


def test_the_arena_can_be_told_to_keep_small_pages() -> None:
    t = LocalArena("cpu", huge_pages=False).allocate("t", 4 << 20, torch.float32)
    assert t.untyped_storage().resizable() and not t.any()


@pytest.mark.skipif(not THP, reason="needs Linux with transparent huge pages in mode always or madvise")
def test_the_offload_engine_keeps_its_cpu_blocks_in_huge_pages() -> None:
    import sofx.offload

    model = torch.nn.Linear(1024, 4096, bias=False)  # one block of 2^22 elements: 16 MiB per float32 array
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-3, executor="thread") as opt:
        model(torch.randn(2, 1024)).square().sum().backward()
        opt.step()
        blocks = list(opt.engine.tensors.values())
        assert blocks
        for t in blocks:
            for a in (t.master, t.exp_avg, t.exp_avg_sq):  # (the grad buffer: untouched by this step)
                assert _huge_bytes_at(a.data_ptr() + a.numel() * a.element_size() // 2) >= HUGE_PAGE_BYTES, _why(a)


@pytest.mark.skipif(not THP, reason="needs Linux with transparent huge pages in mode always or madvise")
def test_only_whole_huge_pages_inside_the_tensor_are_advised() -> None:
    t = zeros_advised((9 << 20) // 4 + 100, torch.float32)  # 9 MiB and 400 bytes
    t.fill_(1.0)
    assert _huge_bytes_at(t.data_ptr()) >= 8 << 20, _why(t)
    assert _huge_bytes_at(t.data_ptr() + t.numel() * 4 - 4) == 0  # the last 1 MiB: small pages, no 2 MiB taken
