"""Gradient arrival: one ``register_post_accumulate_grad_hook`` per managed parameter.

The hook fires when autograd has accumulated a parameter's gradient for the
current backward (once per backward per parameter, however often the
parameter was used: tied weights have one accumulation node). The engine's
callback receives the parameter's index and the parameter; it takes the
gradient out of ``param.grad`` into the block's buffer.

Hooks can only be registered on tensors that require grad. :meth:`refresh`
registers the hooks of parameters that were frozen and have since been
unfrozen; it is called at the start of every step.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable, Sequence

import torch

__all__ = ["GradHooks"]

Callback = Callable[[int, torch.Tensor], None]


class GradHooks:
    """Post-accumulate-grad hooks on ``params`` (index ``i`` is ``params[i]``) calling ``callback(i, param)``."""

    def __init__(self, params: Sequence[torch.Tensor], callback: Callback) -> None:
        self.params = list(params)
        self.callback = callback  # a bound method is held weakly by the hooks
        self.handles: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self.refresh()

    def refresh(self) -> None:
        """Register the hooks of parameters that require grad and have none yet."""
        for i, p in enumerate(self.params):
            if i not in self.handles and p.requires_grad:
                self.handles[i] = p.register_post_accumulate_grad_hook(self._make_hook(i))

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        # The parameters outlive the optimizer: hold a bound-method callback weakly, so that the hooks
        # do not keep a discarded optimizer (and its worker) alive.
        ref = weakref.WeakMethod(self.callback) if inspect.ismethod(self.callback) else (lambda cb=self.callback: cb)

        def hook(param: torch.Tensor) -> None:
            callback = ref()
            if callback is not None:
                callback(index, param)

        return hook

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()
