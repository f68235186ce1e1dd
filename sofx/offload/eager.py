"""What the offload runtime runs eagerly under ``torch.compile``: :func:`run_eagerly`.

Dynamo cannot trace the engine: its Python state changes from call to call
(guarded, it recompiles; read through guards, another thread's change is
missed), it takes locks (graph breaks) and hands work to worker threads and
processes. A compiled function that calls one of these entry points
graph-breaks there and runs it as eager code; with ``fullgraph=True`` dynamo
refuses the call instead, before it starts, naming the reason given here.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

__all__ = ["run_eagerly"]

_F = TypeVar("_F", bound=Callable[..., Any])


def run_eagerly(reason: str) -> Callable[[_F], _F]:
    """``torch.compiler.disable`` with ``reason`` (which dynamo's refusal under ``fullgraph=True`` shows; a torch
    whose ``disable`` takes no reason, before 2.8, disables without it)."""

    def wrap(fn: _F) -> _F:
        try:
            return torch.compiler.disable(fn, reason=reason)  # type: ignore[call-arg]
        except TypeError:
            return torch.compiler.disable(fn)

    return wrap
