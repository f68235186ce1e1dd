"""Find the square root torch's CPU ``sqrt`` computes, so the native kernels can use the same one.

With MKL, ATen computes ``Tensor.sqrt`` of float32 with MKL's vector math
(``vmsSqrt`` in high-accuracy mode), which is within one ulp but not always
correctly rounded (about 0.7% of values differ from IEEE ``sqrtf`` by an ulp).
The reference kernels use ``Tensor.sqrt``; to give the same bits, the native
kernels call that same routine, located in the already loaded ``libtorch_cpu``.
The choice is verified on sample values (denormals, huge values, random
ones) against ``torch.sqrt``: MKL's routine is used only if it matches bit for
bit, else IEEE ``sqrtf`` (a correctly rounded result, within an ulp of torch).

The routine is an element-wise function: its result for a value does not
depend on the array length or position, which the check also covers.

:func:`initialize_vml` works around a race in torch's MKL (pytorch/pytorch
issue 188792, oneMKL 2024.2 as bundled with torch 2.13.0): MKL picks each
vector-math function's kernel on that function's first call, and when that first
call is long enough to be split over the intra-op threads, one thread can run a
low-accuracy kernel for its part (here: relative error 3e-4 for ``torch.sqrt``
of 5000 float32 values, where high accuracy is 1e-7, in about half of fresh
processes); later calls are right. One call on a single value first avoids it
(``tests/test_torch_sqrt_first_call.py``), so importing :mod:`sofx.kernels`
makes that call for float32 and float64 square roots: the reference kernels, and
torch's own optimizers in the same process, then get MKL's accurate results
from the first step on.
"""

from __future__ import annotations

import ctypes
import os

import torch

__all__ = ["VML_MODE", "initialize_vml", "torch_sqrt_routine", "torch_sqrt_is_ieee"]

# VML_HA | VML_ERRMODE_IGNORE | VML_FTZDAZ_OFF: the mode ATen's vml.h passes.
VML_MODE = 0x2 | 0x100 | 0x140000


def initialize_vml() -> None:
    """Make the first square root MKL computes in this process a single-threaded one (see the module doc)."""
    for dtype in (torch.float32, torch.float64):
        torch.sqrt(torch.ones(1, dtype=dtype))


def _samples() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    parts = [
        torch.rand(4099, generator=gen),
        torch.rand(4099, generator=gen) * 1e-3,
        torch.exp(torch.randn(4099, generator=gen) * 20),
        torch.tensor([0.0, -0.0, 1e-45, 1e-40, 1.1754942e-38, 1.1754944e-38, 3.4e38, float("inf"), 1.0, 4.0, 2.0]),
    ]
    return torch.cat(parts)


def _mkl_functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    """``vmsSqrt_64`` and ``MKL_Set_Num_Threads_Local`` from torch's MKL, if it exports them."""
    if not torch.backends.mkl.is_available():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        fn = lib.vmsSqrt_64
        local = lib.MKL_Set_Num_Threads_Local  # the C interface (the lower-case name is Fortran)
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    local.restype = ctypes.c_int
    local.argtypes = [ctypes.c_int]
    return fn, local


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def torch_sqrt_is_ieee() -> bool:
    """Whether ``torch.sqrt`` of float32 is correctly rounded here (no MKL, or MKL not used for it)."""
    x = _samples()
    return _same_bits(x.sqrt(), x.double().sqrt().float())


def torch_sqrt_routine() -> tuple[int, int, int]:
    """``(vmsSqrt_64 address, mode, mkl_set_num_threads_local address)`` if that routine equals
    ``torch.sqrt`` bit for bit, else ``(0, 0, 0)`` (IEEE ``sqrtf``)."""
    found = _mkl_functions()
    if found is None:
        return 0, 0, 0
    fn, local = found
    x = _samples()
    want = x.sqrt()
    got = torch.empty_like(x)
    # Odd lengths and offsets: the routine must not depend on them.
    for start, stop in ((0, x.numel()), (3, 1000), (1000, 1517)):
        fn(stop - start, x[start:].data_ptr(), got[start:].data_ptr(), VML_MODE)
    if not _same_bits(got, want):
        return 0, 0, 0
    address = ctypes.cast(fn, ctypes.c_void_p).value or 0
    return address, VML_MODE, ctypes.cast(local, ctypes.c_void_p).value or 0
