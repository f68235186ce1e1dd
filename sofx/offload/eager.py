"""What the offload runtime runs eagerly under ``torch.compile``: :func:`run_eagerly`.

Dynamo cannot trace the engine: its Python state changes from call to call
(guarded, it recompiles; read through guards, another thread's change is
missed), it takes locks (graph breaks) and hands work to worker threads and
processes. A compiled function that calls one of these entry points
graph-breaks there and runs it as eager code; with ``fullgraph=True`` dynamo
refuses the call instead, before it starts, naming the reason given here.

Importing dynamo costs more than importing torch (sympy, triton: ~1.5 s of a
core), and ``torch.compiler.disable`` imports it. So the wrapper is torch's
own lazy one, ``torch._disable_dynamo`` (what ``torch.optim`` disables its
methods with): it imports dynamo and disables the function at its first call
-- as ``torch.optim``'s ``zero_grad`` does -- not where the class is defined,
so ``import sofx``, and a process executor's worker, never import dynamo. Its
frame is in a file dynamo skips, so a compiled function's graph break runs it
as plain Python, not as a frame dynamo compiles. Tracing a call to it, dynamo
reads the marks that ``torch.compiler.disable`` sets (``_torchdynamo_disable``
and its message), set here too: it graph-breaks there, or under
``fullgraph=True`` refuses, naming the reason (without the marks it would
still break, as at any skipped function, but name no reason).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

__all__ = ["run_eagerly"]

_F = TypeVar("_F", bound=Callable[..., Any])


def run_eagerly(reason: str) -> Callable[[_F], _F]:
    """``torch.compiler.disable`` with ``reason`` (which dynamo's refusal under ``fullgraph=True`` shows), dynamo
    imported at the first call, not here (see the module docstring). A torch without the lazy wrapper disables at
    once; one whose ``disable`` takes no reason, before 2.8, disables without it."""

    def wrap(fn: _F) -> _F:
        lazy = getattr(torch, "_disable_dynamo", None)
        if lazy is None:
            return _disable_now(fn, reason)
        eager = lazy(fn)
        eager._torchdynamo_disable = True  # type: ignore[attr-defined]
        eager._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
        return eager

    return wrap


def _disable_now(fn: _F, reason: str) -> _F:
    """``torch.compiler.disable(fn, reason=reason)``, without the reason where ``disable`` takes none."""
    try:
        return torch.compiler.disable(fn, reason=reason)  # type: ignore[call-arg]
    except TypeError:
        return torch.compiler.disable(fn)
