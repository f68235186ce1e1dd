"""A gradient copied into a buffer and its sum of squares, in one pass over the gradient.

The offload engine copies each gradient of the process executor into its block's shared buffer, on the
training thread during backward, and then needs the block's sum of squares (the global norm for
clipping, the overflow check). :func:`copy_with_sumsq` does both in the native library's one pass
(``sofx_copy_sumsq`` in :mod:`sofx.kernels._cpu_source`): the gradient is read once, and the buffer is
written with streaming stores, which do not read its lines first. Elsewhere it is a plain ``copy_`` and
the caller takes the sum of squares itself (:func:`sofx.transforms.sumsq`).

The sum: rows of 1024 elements in float32, the row sums in float64, finite exactly when every element
stored is (relative error ~1e-7, as :func:`sofx.transforms.sumsq`, not its bits).
"""

from __future__ import annotations

import torch

from sofx.kernels import _cpu_build
from sofx.kernels._cpu_build import DTYPE_CODES as _DTYPE_CODES
from sofx.kernels.storage import refuse_short_storage

__all__ = ["copy_with_sumsq"]


def copy_with_sumsq(dst: torch.Tensor, grad: torch.Tensor) -> float | None:
    """``dst.copy_(grad)`` (``dst`` 1-d, ``grad`` of as many elements, any shape); returns the sum of squares
    of the values written to ``dst`` where the native library took it in the same pass, else None.

    A tensor whose elements reach past the end of its storage (freed with ``untyped_storage().resize_(0)``:
    :func:`~sofx.kernels.storage.storage_shortfall`) is refused with a :class:`~sofx.errors.LeafError`, nothing
    written. Called once per gradient on the training thread (the offload engine's hooks): the checks are the
    cheap tensor attributes (the storage's in the native case's own test), a 256-element gradient costs ~2 us
    here."""
    lib = _cpu_build.load()
    n = grad.numel()
    if (lib is not None and dst.is_cpu and grad.is_cpu and dst.is_contiguous() and grad.is_contiguous()
            and dst.numel() == n
            and (grad.storage_offset() + n) * grad.element_size() <= grad.untyped_storage().nbytes()
            and (dst.storage_offset() + n) * dst.element_size() <= dst.untyped_storage().nbytes()):
        grad_code, dst_code = _DTYPE_CODES.get(grad.dtype), _DTYPE_CODES.get(dst.dtype)
        if grad_code is not None and dst_code is not None:
            total = lib.copy_sumsq(grad.data_ptr(), grad_code, dst.data_ptr(), dst_code, n)
            if total != -1.0:  # -1: a dtype this build cannot convert (float16 without compiler support)
                return total
    else:
        # (native code, and torch's copy_, would read or write outside any allocation)
        refuse_short_storage(dst, "copy_with_sumsq: dst")
        refuse_short_storage(grad, "copy_with_sumsq: grad")
    dst.copy_(grad.reshape(dst.shape))
    return None
