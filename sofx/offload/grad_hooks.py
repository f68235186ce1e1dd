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
        # The parameters outlive the optimizer: a bound-method callback is held weakly (here and by the hooks),
        # so that neither keeps a discarded optimizer (and its worker) alive, nor makes a reference cycle with it
        # (the engine holds these hooks): dropping the optimizer's last reference removes its hooks at once.
        self._callback = weakref.WeakMethod(callback) if inspect.ismethod(callback) else (lambda cb=callback: cb)
        self.handles: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self.refresh()

    def refresh(self) -> None:
        """Register the hooks of parameters that require grad and have none yet."""
        for i, p in enumerate(self.params):
            if i not in self.handles and p.requires_grad:
                self.handles[i] = p.register_post_accumulate_grad_hook(self._make_hook(i))

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        ref = self._callback

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
