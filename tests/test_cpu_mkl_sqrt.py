"""The inline replica of MKL's square root (``mkl_sqrt_replica`` in sofx/kernels/_cpu_source.py) gives
``torch.sqrt``'s bits: the exact CPU kernels compute their square roots with it where this check holds.

``torch.sqrt`` of float32 is MKL's ``vmsSqrt`` (high accuracy): within an ulp, not correctly rounded for
0.6% (AVX-512 code path) to 17% (the generic SSE path MKL runs on AMD CPUs) of values, or only for tiny
ones (the AVX2 path of Intel CPUs without AVX-512). AVX-512 builds reproduce all three paths, AVX2 builds
the generic and AVX2 ones (the load-time check picks the one MKL takes here; tests/test_cpu_mkl_code_paths.py
runs this module under the other paths); these tests compare the replica in use with torch.sqrt on every
non-negative float32 (all 2^31 bit patterns: zeros, subnormals, every binade, +inf, nans), on
every float of [1, 4) and every tiny positive float below 2^-95 once more (there the AVX-512 replica scales
by 2^64 and back by 2^-32, as MKL does), and on ranges of negative numbers and nans. Each range goes
through ``sofx_sqrt``, the kernels' own tile routine.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from sofx.kernels import _cpu_build

LIB = _cpu_build.load()
HAS_REPLICA = LIB is not None and bool(LIB.sqrt_fn) and bool(ctypes.CDLL(LIB.path).sofx_has_sqrt_replica())
# Where the load-time check finds the replica unequal to torch.sqrt (another MKL code path), the kernels
# call MKL itself and there is nothing to compare here.
needs_replica = pytest.mark.skipif(not (HAS_REPLICA and LIB.sqrt_replica),
                                   reason="no native library, no MKL square root in torch, a build without AVX-512 or "
                                          "AVX2, or an MKL whose square root the replica does not reproduce")


@pytest.mark.skipif(not (HAS_REPLICA and _cpu_build._cpuinfo_field("vendor_id") == "AuthenticAMD"),
                    reason="needs the native library with a replica, torch's MKL square root and an AMD CPU")
def test_the_replica_is_in_use_on_amd_cpus():
    """On AMD CPUs torch's MKL runs its generic code path, with or without AVX-512 (Zen 4 and 5 have it), which
    both builds replicate (REPLICA_GENERIC, 2): there the load-time check must accept it (a fallback to MKL calls
    would pass every other test, slower, and skip this module's)."""
    assert LIB.sqrt_replica == _cpu_build.REPLICA_KINDS["generic"]


RANGES = {  # [first, last) float32 bit patterns
    "[1, 4)": (0x3F800000, 0x40800000),
    "around 2^-95": (0x0F000000, 0x11000000),
    "subnormals and +0": (0x00000000, 0x00800000),
    "largest binades, +inf, nans": (0x7F000000, 0x80000000),
    "-0 and negative subnormals": (0x80000000, 0x80800000),
    "negative normals near -1": (0xBF000000, 0xC0000000),
    "-inf and negative nans": (0xFF800000, 0x100000000),
}


def _floats(first: int, last: int) -> torch.Tensor:
    return torch.arange(first, last, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _kernel_sqrt(x: torch.Tensor, replica: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    LIB.sqrt(x.numel(), x.data_ptr(), out.data_ptr(), LIB.sqrt_fn, LIB.sqrt_mode, LIB.sqrt_replica if replica else 0)
    return out


@needs_replica
@pytest.mark.parametrize("name", list(RANGES))
def test_replica_equals_torch_sqrt(name):
    x = _floats(*RANGES[name])
    got, want = _kernel_sqrt(x, True).view(torch.int32), x.sqrt().view(torch.int32)
    bad = (got != want).nonzero()[:5, 0]
    assert bad.numel() == 0, [(hex(int(x.view(torch.int32)[i]) & 0xFFFFFFFF), hex(int(got[i]) & 0xFFFFFFFF),
                               hex(int(want[i]) & 0xFFFFFFFF)) for i in bad]


@needs_replica
def test_every_non_negative_float():
    """All 2^31 bit patterns with the sign bit clear (about 6 s): the replica's formula, and where it hands a lane
    to another rule (zeros, subnormals, the largest floats, +inf, nans), that rule, against torch.sqrt."""
    chunk = 1 << 24
    offsets = torch.arange(chunk, dtype=torch.int32)
    bits, got, want = torch.empty_like(offsets), torch.empty(chunk), torch.empty(chunk)
    for first in range(0, 1 << 31, chunk):
        torch.add(offsets, first, out=bits)
        x = bits.view(torch.float32)
        LIB.sqrt(chunk, x.data_ptr(), got.data_ptr(), LIB.sqrt_fn, LIB.sqrt_mode, LIB.sqrt_replica)
        torch.sqrt(x, out=want)
        bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()[:5, 0]
        assert bad.numel() == 0, [(hex(first + int(i)), hex(int(got.view(torch.int32)[i]) & 0xFFFFFFFF),
                                   hex(int(want.view(torch.int32)[i]) & 0xFFFFFFFF)) for i in bad]


# Where each code path's results differ from a correctly rounded square root: the AVX-512 and generic ones
# on [1, 4) (0.6% and 17% of values), the AVX2 one only on the tiny normal floats (~1% of those below 2^-125).
TEETH = {"avx512": RANGES["[1, 4)"], "generic": RANGES["[1, 4)"], "avx2": (0x00800000, 0x01000000)}


@needs_replica
def test_replica_is_not_ieee_and_random_bits_agree():
    """The comparison has teeth: MKL differs from a correctly rounded square root on the replica's range
    (so the replica is not sqrtf in disguise) and the replica agrees there; on random bit patterns of
    every exponent it agrees too."""
    name = next(name for name, kind in _cpu_build.REPLICA_KINDS.items() if kind == LIB.sqrt_replica)
    x = _floats(*TEETH[name])
    assert int((x.sqrt() != x.double().sqrt().float()).sum()) > 50_000
    assert torch.equal(_kernel_sqrt(x, True).view(torch.int32), x.sqrt().view(torch.int32))
    bits = torch.randint(-2**31, 2**31, (1 << 22,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    r = bits.to(torch.int32).view(torch.float32)
    assert torch.equal(_kernel_sqrt(r, True).view(torch.int32), r.sqrt().view(torch.int32))



@needs_replica
def test_every_tiny_float_without_calling_mkl():
    """All 2^28 positive floats below 2^-95 (subnormals included), with no MKL routine given to the kernels'
    tile routine (IEEE sqrtf would run where the replica declined, and differ): the replica's own
    scaled formula gives MKL's bits. Until this stop such vectors called MKL, 8x slower."""
    chunk = 1 << 24
    for first in range(0x00000001, 0x10000000, chunk):
        last = min(first + chunk, 0x10000000)
        x = torch.arange(first, last, dtype=torch.int32).view(torch.float32)
        got = torch.empty_like(x)
        LIB.sqrt(x.numel(), x.data_ptr(), got.data_ptr(), None, 0, LIB.sqrt_replica)
        bad = (got.view(torch.int32) != x.sqrt().view(torch.int32)).nonzero()[:5, 0]
        assert bad.numel() == 0, [hex(int(x.view(torch.int32)[i])) for i in bad]


@needs_replica
def test_partial_vectors_and_tiles():
    """Lengths that leave a partial 16-lane vector or a partial tile (masked loads and stores), and
    the output beyond ``n`` untouched."""
    gen = torch.Generator().manual_seed(1)
    for n in (*range(1, 40), 127, 129, 300):
        x = torch.rand(n + 8, generator=gen) * 10
        out = torch.full((n + 8,), -7.0)
        LIB.sqrt(n, x.data_ptr(), out.data_ptr(), LIB.sqrt_fn, LIB.sqrt_mode, LIB.sqrt_replica)
        assert torch.equal(out[:n].view(torch.int32), x[:n].sqrt().view(torch.int32)), n
        assert torch.all(out[n:] == -7.0), n
