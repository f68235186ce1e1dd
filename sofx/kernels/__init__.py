"""Adam kernels on flat tensors, one module per backend (see :mod:`sofx.kernels.base`).

:func:`select_backend` maps ``backend="auto" | "reference" | "cpu" | "cpu_fast" | "triton"``
and a device/dtype combination to a backend module:

``reference``  plain torch, every device and dtype, the specification
``cpu``        fused multi-threaded native CPU kernels, bitwise equal to ``reference``
``cpu_fast``   one fused loop, IEEE square roots: fastest, a few ulps of the update from ``reference``,
               its step bitwise ``torch.optim`` Adam/AdamW with ``fused=True``
``triton``     Triton GPU kernels (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``)

``"auto"`` picks ``cpu`` for CPU tensors and ``triton`` for CUDA tensors where
they support the dtypes, else ``reference`` (float64, other devices).
Backends whose dependencies are missing (triton) are simply not available;
the reference backend always is. ``cpu`` and ``cpu_fast`` asked for by name
where their native kernels cannot be built (no C compiler, a failed build)
are refused with the reason; ``"auto"`` runs the reference math there.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch

from sofx.errors import UnsupportedError
from sofx.kernels._torch_sqrt import initialize_vml
from sofx.kernels.base import AdamScalars, AdamVariant

initialize_vml()  # MKL's first vector-math call must not be a multi-threaded one (see _torch_sqrt)

__all__ = ["AdamScalars", "AdamVariant", "select_backend", "available_backends", "load_backend",
           "check_backend_name"]

_BACKEND_MODULES = {
    "reference": "sofx.kernels.reference",
    "cpu": "sofx.kernels.cpu",
    "cpu_fast": "sofx.kernels.cpu_fast",
    "triton": "sofx.kernels.triton",
}


def check_backend_name(name: str) -> None:
    """Refuse a ``backend`` that names no backend (``"auto"`` or one of ``_BACKEND_MODULES``); whether it
    runs here, on which devices and dtypes, is :func:`select_backend`'s."""
    if name != "auto" and (not isinstance(name, str) or name not in _BACKEND_MODULES):
        raise UnsupportedError(f"unknown backend {name!r}; expected one of {sorted(_BACKEND_MODULES)} or 'auto'")


def load_backend(name: str) -> ModuleType | None:
    """The backend module called ``name``, or None when it cannot be imported here."""
    if name not in _BACKEND_MODULES:
        check_backend_name(name)
        raise UnsupportedError("'auto' names no single backend module: use select_backend")
    module = sys.modules.get(_BACKEND_MODULES[name])  # imported already: once per leaf and step, skip importlib
    if module is not None and not getattr(module.__spec__, "_initializing", False):
        return module
    try:  # (a module another thread is importing: import_module waits for it)
        return importlib.import_module(_BACKEND_MODULES[name])
    except ImportError:
        return None


def available_backends() -> list[str]:
    """Names of the backends that import on this machine."""
    return [name for name in _BACKEND_MODULES if load_backend(name) is not None]


def _auto_order(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return ["triton", "reference"]
    if device.type == "cpu":
        return ["cpu", "reference"]
    return ["reference"]


def _refuse_unable(module: ModuleType) -> None:
    """Raise where the backend ``module``, asked for by name, cannot run as itself here (``native_refusal``: the
    CPU backends without their native kernels, which would run the reference math, several times slower)."""
    refusal = getattr(module, "native_refusal", None)
    reason = refusal() if refusal is not None else None
    if reason is not None:
        raise UnsupportedError(f"backend {module.NAME!r} needs the native CPU kernels, unavailable here ({reason}); "
                               "backend='auto' or 'reference' runs the reference math (several times slower), "
                               "SOFX_CPU_NATIVE=0 too")


# what each named backend steps, for its refusal of another leaf (their ``supports``, in words)
_TAKES = {
    "cpu": "CPU tensors with float32, bfloat16 or float16 params and states",
    "cpu_fast": "CPU tensors with float32, bfloat16 or float16 params and states",
    "triton": "CUDA tensors (CPU tensors only under TRITON_INTERPRET=1) with float32, bfloat16 or float16 params "
              "and states",
}


def _what_to_do(backend: str, device: torch.device, param_dtype: torch.dtype, state_dtype: torch.dtype) -> str:
    """The tail of a named backend's refusal of a leaf: what the backend takes, and which backend ``auto`` picks
    for this leaf (``""`` where neither is known)."""
    tail = f": it takes {_TAKES[backend]}" if backend in _TAKES else ""
    try:
        picked = select_backend("auto", device, param_dtype, state_dtype).NAME
    except UnsupportedError:
        return tail
    return f"{tail}; backend='auto' picks {picked!r} for this one"


def select_backend(backend: str, device: torch.device | str, param_dtype: torch.dtype,
                   state_dtype: torch.dtype) -> ModuleType:
    """The kernel module to use for one block, or a clear :class:`UnsupportedError`."""
    device = torch.device(device)
    names = _auto_order(device) if backend == "auto" else [backend]
    for name in names:
        module = load_backend(name)
        if module is not None and module.supports(device, param_dtype, state_dtype):
            if backend != "auto":
                _refuse_unable(module)
            return module
    if backend == "auto":
        raise UnsupportedError(f"no backend supports device={device}, param dtype {param_dtype}, "
                               f"state dtype {state_dtype}")
    module = load_backend(backend)
    if module is None:
        raise UnsupportedError(f"backend {backend!r} is not available here (its dependencies are not installed)")
    raise UnsupportedError(f"backend {backend!r} does not support device={device}, param dtype {param_dtype}, "
                           f"state dtype {state_dtype}{_what_to_do(backend, device, param_dtype, state_dtype)}")
