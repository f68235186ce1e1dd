"""Gradient arrival: one ``register_post_accumulate_grad_hook`` per managed parameter.

The hook fires when autograd has accumulated a parameter's gradient for the
current backward (once per backward per parameter, however often the
parameter was used: tied weights have one accumulation node; but see
reentrant checkpointing below). The engine's
callback receives the parameter's index and the parameter; it takes the
gradient out of ``param.grad`` into the block's buffer.

Hooks can only be registered on tensors that require grad. :meth:`refresh`
registers the hooks of parameters that were frozen and have since been
unfrozen; it is called at the start of every step.

One owner per parameter: hooks registered on a parameter that another live
:class:`GradHooks` still hooks *supersede* that one (it removes all its hooks
and reports ``superseded``). Otherwise the older optimizer's hook, which runs
first, would take every gradient and the newer one would silently step
nothing -- what ``opt = SpeculativeAdamW(model.parameters())`` run twice
does while something (a scheduler, a notebook's output history) still holds
the first optimizer. Parameters whose gradients come another way (``unhooked``:
those a ``DistributedDataParallel`` module averages, see :mod:`sofx.offload.ddp`)
get no hook, but are taken over from older owners all the same.

The hooks run eagerly, never traced by dynamo (a ``torch.compiler.disable``d call where traced):
compiled autograd (``torch._dynamo.config.compiled_autograd = True``) traces a
backward's hooks into its graph, which would have dynamo compile the engine's
gradient intake -- its Python state guarded, its locks graph-breaking, a frame
per parameter shape until the recompile limit. The backward graph breaks at
each hook instead, and the hook runs as in an eager backward. Under a
compiled model's eager backward they run eagerly anyway (autograd's gradient
accumulation is outside the compiled graph).

With reentrant activation checkpointing
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``) a parameter used
both inside and outside a checkpointed region is accumulated twice in one
backward (once in the recomputation's own backward), so its hook fires twice:
the second call is a late gradient (summed in, its block undone and redone in
``step()``; with ``gradient_accumulation_steps`` its block is ready in the
last backward call only, and that call's second accumulation is late the same
way: :mod:`sofx.offload.arrivals`; where backward calls cannot be numbered,
the count of its hook's calls stands in, and its block is ready a micro-step
early). The non-reentrant checkpoint accumulates it once.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable, Collection, Sequence

import torch

from sofx.offload.eager import run_eagerly

__all__ = ["GradHooks"]

Callback = Callable[[int, torch.Tensor], None]


class _Hook:
    """The hook of one parameter: calls its owner's callback (both held weakly, see :class:`GradHooks`)."""

    __slots__ = ("owner", "index", "callback")

    def __init__(self, owner: "GradHooks", index: int, callback: Callable[[], Callback | None]) -> None:
        self.owner = weakref.ref(owner)
        self.index = index
        self.callback = callback

    def __call__(self, param: torch.Tensor) -> None:
        if torch.compiler.is_compiling():  # traced (compiled autograd): the graph breaks into the eager call
            return self._eagerly(param)
        callback = self.callback()
        if callback is not None:
            callback(self.index, param)

    @run_eagerly("the gradient hook of sofx's offload engine runs eagerly: dynamo cannot trace the engine")
    def _eagerly(self, param: torch.Tensor) -> None:
        """:meth:`__call__` as dynamo leaves it: run eagerly (a ``torch.compiler.disable``d call costs ~0.3 us,
        so an eager backward's hook does not go through it)."""
        callback = self.callback()
        if callback is not None:
            callback(self.index, param)


def _other_owners(p: torch.Tensor, me: "GradHooks") -> list["GradHooks"]:
    """The live :class:`GradHooks` other than ``me`` whose hooks are registered on ``p``."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}  # (torch's own registry of these hooks)
    owners = [h.owner() for h in list(hooks.values()) if isinstance(h, _Hook)]
    return [o for o in owners if o is not None and o is not me]


class GradHooks:
    """Post-accumulate-grad hooks on ``params`` (index ``i`` is ``params[i]``) calling ``callback(i, param)``,
    but on those in ``unhooked`` (their older owners are superseded all the same)."""

    def __init__(self, params: Sequence[torch.Tensor], callback: Callback, unhooked: Collection[int] = (),
                 on_superseded: Callable[[], None] | None = None) -> None:
        self.params = list(params)
        self.unhooked = frozenset(unhooked)
        #: Set when hooks of a newer owner were registered on one of the parameters (see the module docstring):
        #: the index of that parameter; the hooks are removed then and never registered again.
        self.superseded_at: int | None = None
        # The parameters outlive the optimizer: a bound-method callback is held weakly (here and by the hooks),
        # so that neither keeps a discarded optimizer (and its worker) alive, nor makes a reference cycle with it
        # (the engine holds these hooks): dropping the optimizer's last reference removes its hooks at once.
        self._callback = weakref.WeakMethod(callback) if inspect.ismethod(callback) else (lambda cb=callback: cb)
        # Called (held as weakly) once a newer owner supersedes this one, after its hooks are removed.
        self._on_superseded = (weakref.WeakMethod(on_superseded) if inspect.ismethod(on_superseded)
                               else (lambda f=on_superseded: f))
        self.handles: dict[int, torch.utils.hooks.RemovableHandle] = {}
        for i in sorted(self.unhooked):
            self._supersede_older(i)
        self.refresh()

    def refresh(self) -> None:
        """Register the hooks of parameters that require grad and have none yet (superseding their older
        owners)."""
        if self.superseded_at is not None:
            return
        for i, p in enumerate(self.params):
            if i not in self.handles and i not in self.unhooked and p.requires_grad:
                self._supersede_older(i)
                self.handles[i] = p.register_post_accumulate_grad_hook(_Hook(self, i, self._callback))

    def _supersede_older(self, i: int) -> None:
        """Supersede the other owners hooking parameter ``i``."""
        p = self.params[i]
        for older in _other_owners(p, self):
            older.supersede(next((j for j, q in enumerate(older.params) if q is p), -1))

    def supersede(self, index: int) -> None:
        """Another owner hooked parameter ``index``: remove every hook of this one, for good, then call
        ``on_superseded``."""
        self.superseded_at = index
        self.remove()
        on_superseded = self._on_superseded()
        if on_superseded is not None:
            on_superseded()

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()
