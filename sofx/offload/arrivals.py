"""Per-step bookkeeping of gradient arrivals: when is a block *ready*?

A block is ready when every parameter of it that is *expected* this step
(``requires_grad`` when the step began) has received its gradient of the last
micro-step. With ``accumulation_steps = N`` a parameter's gradient is final
at its N-th arrival; earlier arrivals are summed. An arrival after the block
was ready is a *late* gradient (a parameter whose hook fires twice): it is
summed, and the block's speculative step must be undone and redone.

Pure bookkeeping: no tensors, no threads.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from sofx.errors import UnsupportedError
from sofx.kernels.user_numbers import as_integer
from sofx.offload.blocks import BlockLayout

__all__ = ["ArrivalTracker", "Arrival"]


class Arrival(NamedTuple):
    """What one gradient arrival means.

    ``block``/``slot``: where the parameter lives; ``first``: its first
    gradient this step (copy into the buffer rather than add); ``ready``:
    this arrival made the block ready; ``late``: the block was ready already.
    """

    block: int
    slot: int
    first: bool
    ready: bool
    late: bool


class ArrivalTracker:
    """Counts arrivals per parameter and readiness per block for one step at a time."""

    def __init__(self, layouts: Sequence[BlockLayout], accumulation_steps: int = 1) -> None:
        steps = as_integer(accumulation_steps)  # numpy's and 1-element integer tensors too, as a Python int
        if steps is None or steps < 1:
            raise UnsupportedError(f"gradient_accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
        self.layouts = list(layouts)
        self.accumulation_steps = steps
        self.where: dict[int, tuple[int, int]] = {}
        for layout in self.layouts:
            for slot, index in enumerate(layout.param_indices):
                self.where[index] = (layout.index, slot)
        self.n_params = len(self.where)
        self.arrivals = [0] * self.n_params
        self.expected = [True] * self.n_params
        self.pending = [0] * len(self.layouts)
        self.ready = [False] * len(self.layouts)
        self._started = False

    def reset(self, expected: Sequence[bool]) -> None:
        """Start a new step; ``expected[i]``: parameter ``i`` requires grad."""
        self.arrivals = [0] * self.n_params
        self.expected = list(expected)
        self.ready = [False] * len(self.layouts)
        self._started = False
        self.pending = [sum(1 for i in layout.param_indices if self.expected[i]) for layout in self.layouts]

    def upcoming(self, index: int) -> Arrival:
        """What the next :meth:`arrive` of parameter ``index`` records, recording nothing (the engine counts a
        gradient once it is in the block's buffer)."""
        block, slot = self.where[index]
        n = self.arrivals[index] + 1
        late = self.ready[block]
        final = not late and self.expected[index] and n == self.accumulation_steps
        return Arrival(block, slot, n == 1, final and self.pending[block] == 1, late)

    def arrive(self, index: int) -> Arrival:
        """Record one gradient arrival of parameter ``index``."""
        arrival = self.upcoming(index)
        self._started = True
        self.arrivals[index] += 1
        if not arrival.late and self.expected[index] and self.arrivals[index] == self.accumulation_steps:
            self.pending[arrival.block] -= 1
            self.ready[arrival.block] = arrival.ready
        return arrival

    def retract(self, index: int) -> None:
        """Forget parameter ``index``'s arrivals of this step, after backward (what arrived was no gradient: a
        parameter ``DistributedDataParallel`` found unused on every rank): it has none; its block keeps its
        readiness, and is stepped without it."""
        self.arrivals[index] = 0

    def present(self, block: int) -> tuple[bool, ...]:
        """Per parameter of ``block``: has it any gradient this step."""
        return tuple(self.arrivals[i] > 0 for i in self.layouts[block].param_indices)

    def has_gradient(self, block: int) -> bool:
        """Whether any parameter of ``block`` got a gradient this step."""
        return any(self.arrivals[i] > 0 for i in self.layouts[block].param_indices)

    def expected_in(self, block: int) -> tuple[bool, ...]:
        """Per parameter of ``block``: whether a gradient is expected this step (it requires grad)."""
        return tuple(self.expected[i] for i in self.layouts[block].param_indices)

    @property
    def micro_steps(self) -> int:
        """The most arrivals of any parameter this step: the backward calls (micro-steps) seen where some parameter
        got a gradient from each, fewer where none did (micro-batches through other branches of a model), more
        where a reentrant checkpoint accumulated one twice in a call. The engine counts the calls themselves
        (:mod:`sofx.offload.backward_passes`); this is its fallback where a gradient came from outside a backward."""
        return max(self.arrivals, default=0)

    @property
    def started(self) -> bool:
        """Whether any gradient arrived this step."""
        return self._started
