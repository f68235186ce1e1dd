"""``copy_with_sumsq``: a gradient copied into a buffer and its sum of squares in one pass.

The copy has ``dst.copy_(grad)``'s bits; the sum is within 1e-6 of :func:`sofx.transforms.sumsq` of
the values written (fresh random data, partial rows, unaligned buffers, every storage dtype pair) and
finite exactly when every element is; where the native library cannot take it (a strided buffer,
float64, no library) the copy is a plain ``copy_`` and the sum is left to the caller (None).
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import script_prints_ok
from sofx.kernels import _cpu_build, cpu
from sofx.kernels.grad_copy import copy_with_sumsq
from sofx.transforms import sumsq

pytestmark = pytest.mark.skipif(not cpu.native_available(), reason="no C compiler: copy_with_sumsq only copies")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dst_dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_copy_and_sum_match_copy_and_sumsq(grad_dtype, dst_dtype, rng):
    for n in (1, 1000, 1024, 3 * 1024 + 17, 70000):
        grad = (3 * torch.randn(n, generator=rng)).to(grad_dtype)
        buffer = torch.full((n + 5,), 7.0, dtype=dst_dtype)
        dst = buffer[3:3 + n]  # not 64-byte aligned: plain stores up to the first aligned row
        total = copy_with_sumsq(dst, grad)
        assert torch.equal(dst, grad.to(dst_dtype)), (n, grad_dtype, dst_dtype)
        assert buffer[:3].eq(7).all() and buffer[3 + n:].eq(7).all()
        if torch.float16 in (grad_dtype, dst_dtype) and not _cpu_build.load().has_f16:
            assert total is None  # a compiler without _Float16 (clang before 15): the plain copy
            continue
        want = sumsq(dst)
        assert total is not None and abs(total - want) <= 1e-6 * want, (total, want)


def test_aligned_float32_rows_take_streaming_stores(rng):
    n = 1 << 16
    grad, dst = torch.randn(n, generator=rng), torch.empty(n)
    assert dst.data_ptr() % 64 == 0
    total = copy_with_sumsq(dst, grad)
    assert torch.equal(dst, grad) and abs(total - sumsq(grad)) <= 1e-6 * sumsq(grad)


def test_finite_exactly_when_every_element_is(rng):
    grad = torch.randn(5000, generator=rng)
    grad[7] = 1e30  # finite, its square overflows float32: the row is summed again in double
    dst = torch.empty(5000)
    total = copy_with_sumsq(dst, grad)
    assert math.isfinite(total) and abs(total - sumsq(grad)) <= 1e-6 * sumsq(grad)
    for bad in (float("inf"), float("-inf"), float("nan")):
        grad[4321] = bad
        assert not math.isfinite(copy_with_sumsq(dst, grad))
        assert torch.equal(torch.isnan(dst), torch.isnan(grad)) and (dst[4321] == bad or bad != bad)


def test_what_the_library_cannot_take_is_copied_and_left_to_the_caller(rng, monkeypatch):
    grad = torch.randn(300, generator=rng)
    strided = torch.zeros(600)[::2]
    assert copy_with_sumsq(strided, grad) is None and torch.equal(strided, grad)
    wide = torch.zeros(300, dtype=torch.float64)
    assert copy_with_sumsq(wide, grad) is None and torch.equal(wide, grad.double())
    monkeypatch.setattr(_cpu_build, "_loaded", ["no library here"])
    dst = torch.zeros(300)
    assert copy_with_sumsq(dst, grad) is None and torch.equal(dst, grad)


def test_a_gradient_of_any_shape_is_copied_in_memory_order(rng):
    """The engine's hooks pass autograd's gradient as it is (a weight's 2-d gradient; a transposed one)."""
    grad = torch.randn(24, 40, generator=rng)
    dst = torch.empty(24 * 40)
    total = copy_with_sumsq(dst, grad)
    assert torch.equal(dst, grad.reshape(-1)) and abs(total - sumsq(grad)) <= 1e-6 * sumsq(grad)
    transposed = grad.t()  # not contiguous: the plain copy, in the order of its elements
    assert copy_with_sumsq(dst, transposed) is None and torch.equal(dst, transposed.reshape(-1))
    with pytest.raises(RuntimeError):  # as many elements or nothing
        copy_with_sumsq(torch.empty(7), grad)


# A gradient or buffer whose memory was freed (untyped_storage().resize_(0), as FSDP frees tensors) or shrunk: the
# native copy read and wrote at its address (a segmentation fault, or memory of something else). Run in a subprocess
# so that a crash fails the test instead of ending pytest.
_FREED = """
import torch
from sofx.errors import LeafError
from sofx.kernels.grad_copy import copy_with_sumsq

for keep in (0, 40):
    for freed in ("grad", "dst"):
        grad, dst = torch.randn(3000), torch.full((3000,), 7.0)
        (grad if freed == "grad" else dst).untyped_storage().resize_(keep)
        try:
            copy_with_sumsq(dst, grad)
            raise AssertionError(f"copied with a {freed} of {keep} bytes")
        except LeafError as e:
            assert f"copy_with_sumsq: {freed}: its storage holds {keep} bytes" in str(e) and "byte 12000" in str(e), e
        if freed == "grad":
            assert torch.equal(dst, torch.full((3000,), 7.0)), "nothing written"
print("ok")
"""


def test_a_tensor_whose_storage_was_freed_is_refused_before_anything_is_written():
    script_prints_ok(_FREED, timeout=120)
