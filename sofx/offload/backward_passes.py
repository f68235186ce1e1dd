"""How many backward calls gave the optimizer gradients this step (``gradient_accumulation_steps``' micro-steps).

Not the most gradient arrivals of any one parameter: where the micro-batches take other branches of the model
(mixture-of-experts routing, multi-task heads, conditional layers) no parameter need get a gradient from every
backward call, and a parameter used inside and outside a reentrant activation checkpoint gets two in one. A
backward call is one top-level autograd graph task, told by ``torch._C._current_graph_task_id()`` where a
gradient hook (or ``DistributedDataParallel``'s communication hook) runs: :meth:`BackwardPasses.note` counts each
task the first time it hands the optimizer a gradient. What is and is not counted:

- ``loss.backward()`` and ``opt.backward(loss)`` alike, once each, however many gradients they give; two
  backward calls of one graph (``retain_graph=True``) twice; a backward that raised midway, where it gave
  gradients (they are summed into the step);
- ``torch.autograd.grad`` never (it accumulates into no ``.grad``: the hooks do not fire);
- a backward that reentrant checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) runs inside the
  backward of its region is the same backward call: it is a graph task of its own, counted where it gives the
  first gradient, and found out as it ends (:meth:`_ended`, a final callback of it, queued with
  ``queue_callback`` as DDP queues its own): ``torch._C._current_autograd_node()`` is then the node of the
  enclosing backward that runs it, not ``None``. A post-hook of that node (:meth:`_enclosing`) runs in the
  enclosing task once the node is done: where that task is counted, the nested one is taken back; where not,
  the count is carried over to it (and it is watched in turn: nested checkpoints);
- under ``ddp``, each synchronized backward once, where its first bucket comes to DDP's communication hook (in the
  same graph task as the gradient hooks of the parameters DDP does not average: once for both); a backward under
  ``no_sync()`` gives DDP's parameters no gradient, and counts only where it gives another parameter one;
- under compiled autograd the final callbacks do not run: every graph task counts (a reentrant checkpoint inside
  one would count twice; too many, never too few: the warning is left out, never given falsely).

:meth:`BackwardPasses.call` says, where a gradient arrives, *which* backward call of the step it comes from (1 for
the first), for ``gradient_accumulation_steps``' last micro-step (:mod:`sofx.offload.arrivals`). A nested backward
cannot be told from a new call where it begins (``_current_autograd_node()`` is then the parameter's own
accumulation node): a graph task counted and still *open* -- its final callback neither run nor dropped (a backward
that raised drops its callbacks unrun) -- is running, so a task that begins meanwhile runs inside it (reentrant
checkpointing) and is the same call; where none is open, it is the next call. Wrong only where backward calls run at
the same time on other threads, or a task's callback is kept unrun and undropped: then a later call is numbered as the
open one, too low, never too high (a gradient of the last micro-step taken for an earlier one's is only stepped late).

Nothing here holds the engine: the callbacks and node hooks keep only this small counter alive.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

__all__ = ["BackwardPasses"]

# torch's own (torch.utils.checkpoint reads them); a torch without them: every gradient counts as untracked, and the
# engine falls back to the most gradient arrivals of any parameter
_task_id = getattr(torch._C, "_current_graph_task_id", None)
_current_node = getattr(torch._C, "_current_autograd_node", None)


class _End:
    """The final callback of a counted graph task ``task``: it is no longer open (:meth:`BackwardPasses.call`) once
    the callback runs, or is dropped unrun (the backward raised: autograd frees its callbacks as the error leaves
    it); running, it calls ``ended(call)``."""

    __slots__ = ("running", "task", "call", "ended")

    def __init__(self, running: dict[int, int], task: int, call: int, ended: Callable[[int], None]) -> None:
        self.running, self.task, self.call, self.ended = running, task, call, ended
        running[task] = call

    def __call__(self) -> None:
        self.running.pop(self.task, None)
        self.ended(self.call)

    def __del__(self) -> None:
        self.running.pop(self.task, None)  # (atomic: no lock, whichever thread frees the callback)


class BackwardPasses:
    """The backward calls (top-level autograd graph tasks) that gave gradients since the last :meth:`reset`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (hooks and callbacks may run on autograd's device threads)
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (a new step, or ``zero_grad()``): callbacks of backward calls still running count
        nothing (their generation is over)."""
        with self._lock:
            self._generation = object()
            # Per counted graph task: the backward call it belongs to (1 for the step's first)
            self._seen: dict[int, int] = {}
            # The counted graph tasks still running (their final callback neither run nor dropped): their calls
            self._open: dict[int, int] = {}
            #: Graph tasks counted (nested ones not yet taken back included).
            self.count = 0
            #: The backward calls :meth:`call` numbered (a nested task is its enclosing call's, at once).
            self.calls = 0
            #: Whether a gradient came from outside any graph task (no backward to count it by).
            self.untracked = False

    def call(self) -> int | None:
        """The backward call (1 for the step's first) of the graph task running here, as :meth:`note` counts it,
        counting nothing: its own where counted, else that of a counted task still running (it runs inside it:
        reentrant checkpointing), else the next; ``None`` where it cannot be told (no graph task, or a gradient of
        this step came from outside one: :attr:`untracked`)."""
        task = _task_id() if _task_id is not None else -1
        if task < 0 or self.untracked:
            return None
        known = self._seen.get(task)  # (every later gradient of a counted task: no lock)
        if known is not None:
            return known
        with self._lock:
            return self._call_of(task)

    def _call_of(self, task: int) -> int:
        """:meth:`call` of graph task ``task`` (holding the lock)."""
        known = self._seen.get(task)
        if known is not None:
            return known
        running = tuple(self._open.values())  # (one C call: a callback dropped on another thread changes no view)
        return max(running) if running else self.calls + 1

    @property
    def last_call(self) -> int | None:
        """The latest backward call numbered (:meth:`call`), ``None`` where none was or :attr:`untracked`: what a
        gradient handed over outside its graph task (DDP's averages, on the thread completing the all-reduce)
        belongs to, the backward that began it being counted first (:meth:`note` at its bucket 0)."""
        return None if self.untracked or self.calls == 0 else self.calls

    def note(self) -> None:
        """A gradient hook (or DDP's communication hook) ran: count the backward call it runs in, once."""
        task = _task_id() if _task_id is not None else -1
        if task in self._seen:  # (every later gradient of a backward call: no lock)
            return
        with self._lock:
            if task < 0:
                self.untracked = True
                return
            if task in self._seen:
                return
            call = self._call_of(task)
            self.calls = max(self.calls, call)
            self._seen[task] = call
            self.count += 1
            end = _End(self._open, task, call, functools.partial(self._ended, self._generation))
        torch.autograd.Variable._execution_engine.queue_callback(end)

    def _ended(self, generation: object, call: int) -> None:
        """The end of a counted graph task (its final callback) of backward call ``call``: nested in another
        backward's node, have that node's post-hook merge it into the enclosing task."""
        node = _current_node() if _current_node is not None else None
        if node is None or generation is not self._generation:
            return  # a top-level backward call ended: it was counted at its first gradient
        handle: list[Any] = []
        try:
            handle.append(node.register_hook(functools.partial(self._enclosing, generation, call, handle)))
        except (AttributeError, RuntimeError):  # (a node that takes no hooks: the nested call stays counted, too
            return                              # many, never raised out of the user's backward)

    def _enclosing(self, generation: object, call: int, handle: list[Any], *_: Any) -> None:
        """The node that ran a nested backward (of backward call ``call``) is done, in the enclosing graph task: the
        nested count is this task's (taken back where this one is counted already; else this task is ``call``)."""
        handle[0].remove()  # (once: a second backward of a retained graph runs the node again)
        task = _task_id()
        with self._lock:
            if generation is not self._generation or task < 0:
                return
            if task in self._seen:
                self.count -= 1
                return
            self._seen[task] = call
            end = _End(self._open, task, call, functools.partial(self._ended, generation))
        torch.autograd.Variable._execution_engine.queue_callback(end)
