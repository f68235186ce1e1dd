"""bits_digest: the digest DDP ranks compare of a changed optimizer state's contents (no processes).

It was the plain sum of the elements' bit patterns: a state holding the same values at other positions (two
elements exchanged, a square moment transposed) had the same digest, and the replicas diverged silently. It is now
``sum_g b_g * w_g`` modulo 2**64 with odd weights that differ per position (slice by slice): these tests pin what it
tells apart, its math, and that it takes every dtype width, an empty and a non-contiguous tensor.
"""

from __future__ import annotations

import pytest
import torch

from sofx.offload.engine_state import DIGEST_SLICE_BITS, bits_digest

S = 1 << DIGEST_SLICE_BITS  # elements per slice
MASK = (1 << 64) - 1
# a dtype of each element width (1, 2, 4, 8 bytes), floating and integer
DTYPES = [torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16, torch.int16, torch.float32, torch.int32,
          torch.float64, torch.int64]


def _values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``n`` distinct-ish values of ``dtype`` (a bool tensor alternates, so that neighbours differ)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.arange(n) % 2 == 0
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)


def _exchanged(x: torch.Tensor, g: int, h: int) -> torch.Tensor:
    """A copy of 1-D ``x`` with the values of elements ``g`` and ``h`` exchanged."""
    y = x.clone()
    y[g], y[h] = x[h], x[g]
    return y


def _splitmix64(x: int) -> int:
    z = (x + 1) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _reference(x: torch.Tensor) -> str:
    """The docstring's math in Python integers, for a 1-D float32 ``x``: ``sum_g b_g * a_k * W_i`` modulo 2**64."""
    s, total = DIGEST_SLICE_BITS, 0
    for g, b in enumerate(x.view(torch.int32).tolist()):
        k, i = divmod(g, S)
        weight = (2 * i + 1 + (_splitmix64(i) << (s + 1))) & MASK
        multiplier = (1 + (k * (1 + 2 * 0x9E3779B97F4A7C15 * k) << (s + 1))) & MASK
        total = (total + b * weight * multiplier) & MASK
    return f"bits digest {total}"


def test_the_digest_is_the_weighted_sum_of_the_bit_patterns_modulo_2_64() -> None:
    x = _values(S + 37, torch.float32)
    assert bits_digest(x) == _reference(x)
    assert bits_digest(x) == bits_digest(x.clone())


@pytest.mark.parametrize("g, h", [(0, 1), (3, 700), (0, 999)])
def test_two_elements_exchanged_within_a_slice_change_the_digest(g: int, h: int) -> None:
    """The plain sum of the bit patterns did not change: the state held the same values, elsewhere."""
    x = _values(1000, torch.float32)
    assert bits_digest(_exchanged(x, g, h)) != bits_digest(x)


@pytest.mark.parametrize("g, h", [(5, S + 5), (5, 2 * S + 9), (0, 3 * S + 16), (S - 1, S)])
def test_two_elements_exchanged_across_slices_change_the_digest(g: int, h: int) -> None:
    """At the same position of two slices too (where only the slices' multipliers tell them apart)."""
    x = _values(3 * S + 17, torch.float32)
    assert bits_digest(_exchanged(x, g, h)) != bits_digest(x)


def test_whole_slices_exchanged_change_the_digest() -> None:
    """Two slices exchanged, of other values and of the same values arranged otherwise (the same sum of patterns:
    only the slices' multipliers tell them apart)."""
    a, b = _values(S, torch.float32, seed=1), _values(S, torch.float32, seed=2)
    assert bits_digest(torch.cat([b, a])) != bits_digest(torch.cat([a, b]))
    rearranged = a.flip(0)
    assert bits_digest(torch.cat([rearranged, a])) != bits_digest(torch.cat([a, rearranged]))


def test_a_transposed_square_tensor_has_another_digest() -> None:
    x = _values(64, torch.float32).view(8, 8)
    assert bits_digest(x.t().contiguous()) != bits_digest(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_negative_zero_and_zero_differ_where_they_lie_too(dtype: torch.dtype) -> None:
    """-0.0 for 0.0 changes the digest; so does exchanging a -0.0 and a 0.0 (their patterns differ in the sign bit
    alone: the largest power of two a difference of patterns of the width can hold)."""
    x = torch.tensor([0.0, 1.5, -0.0, 2.0], dtype=dtype)
    assert bits_digest(torch.tensor([-0.0, 1.5, -0.0, 2.0], dtype=dtype)) != bits_digest(x)
    assert bits_digest(_exchanged(x, 0, 2)) != bits_digest(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_element_width_tells_one_change_and_an_exchange_apart(dtype: torch.dtype) -> None:
    """1, 2, 4 and 8 bytes: the same values give the same digest; one element changed (each to another value), and
    two elements of different values exchanged, give another."""
    x = _values(3000, dtype)
    assert bits_digest(x.clone()) == bits_digest(x)
    for g in (0, 1234, 2999):
        changed = x.clone()
        changed[g] = x[(g + 1) % 3000]
        assert not torch.equal(changed, x) and bits_digest(changed) != bits_digest(x), g
    assert bits_digest(_exchanged(x, 10, 11)) != bits_digest(x)


@pytest.mark.parametrize("a, b", [(1.0, 2.0), (1.0, -1.0), (3.0, 0.75)])
def test_float64_values_differing_in_sign_or_exponent_alone_exchanged_far_apart_change_the_digest(a: float,
                                                                                              b: float) -> None:
    """Their 64-bit patterns differ in the high bits alone (a difference of 2**52 or 2**63), at positions 2**11
    apart: times the weights' difference (12 trailing zero bits) a multiple of 2**64, unless the high half is folded
    into the low one first."""
    x = torch.zeros(4096, dtype=torch.float64)
    x[0], x[2048] = a, b
    assert bits_digest(_exchanged(x, 0, 2048)) != bits_digest(x)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
def test_an_empty_tensor_digests_to_zero(shape: tuple[int, ...]) -> None:
    assert bits_digest(torch.empty(shape)) == "bits digest 0"


def test_a_scalar_tensor_is_digested() -> None:
    assert bits_digest(torch.tensor(1.5)) == bits_digest(torch.tensor([1.5]))
    assert bits_digest(torch.tensor(1.5)) != bits_digest(torch.tensor(-1.5))


@pytest.mark.parametrize("rows, cols", [(8, 8), (S + 3, 2), (40000, 5)])
def test_a_non_contiguous_tensor_digests_as_its_contiguous_copy(rows: int, cols: int) -> None:
    """A transposed tensor's digest is that of the same values laid out row-major (rows longer than a slice, and
    copies of whole rows that cross a slice boundary)."""
    x = _values(rows * cols, torch.float32).view(rows, cols).t()
    assert not x.is_contiguous()
    assert bits_digest(x) == bits_digest(x.contiguous())
    assert bits_digest(x[:, 1:]) == bits_digest(x[:, 1:].contiguous())


def test_a_digest_does_not_change_its_tensor() -> None:
    x = _values(S + 5, torch.float64)
    before = x.clone()
    bits_digest(x)
    assert torch.equal(x, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not run on the CPU-only CI machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_cuda_tensor_digests_as_on_the_cpu(dtype: torch.dtype) -> None:
    """The weights and the int64 products wrap modulo 2**64 on either device: the same bits, the same digest."""
    x = _values(2 * S + 11, dtype)
    assert bits_digest(x.cuda()) == bits_digest(x)
    assert bits_digest(x.cuda().view(-1, 1).t()) == bits_digest(x)
