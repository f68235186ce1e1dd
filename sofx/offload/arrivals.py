"""Per-step bookkeeping of gradient arrivals: when is a block *ready*?

A block is ready when every parameter of it that is *expected* this step
(``requires_grad`` when the step began) has received its *final* gradient:
that of the last micro-step, the earlier ones summed into it. With
``accumulation_steps = N`` an arrival is final where it comes during the N-th
backward call of the step (or a later one), whichever micro-steps gave the
parameter gradients before: the engine numbers the calls as gradients arrive
(:meth:`sofx.offload.backward_passes.BackwardPasses.call`). A parameter that
got gradients in earlier micro-steps but none in the N-th has no final one:
its block is not ready during backward (micro-batches through other branches
of a model: mixture-of-experts routing, multi-task heads), and is stepped in
``step()``. Where the call cannot be told (``call=None``: no graph task to
number it by, a gradient set by hand and taken in ``step()``), the per-parameter
count stands in: the N-th arrival of the parameter is final.

An arrival after the block was ready is a *late* gradient (a parameter whose
hook fires twice in the last call: used inside and outside a reentrant
checkpoint; or an (N+1)-th backward call): it is summed, and the block's
speculative step must be undone and redone. A second arrival of a parameter
whose block is not ready yet is summed in before anything is stepped.

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
    this arrival made the block ready; ``late``: the block was ready already;
    ``final``: this arrival made the parameter's gradient final (it is
    expected, and was not final before).
    """

    block: int
    slot: int
    first: bool
    ready: bool
    late: bool
    final: bool = False


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
        self.final = [False] * self.n_params  # per parameter: its gradient was final (counted out of ``pending``)
        self.expected = [True] * self.n_params
        self.pending = [0] * len(self.layouts)
        self.ready = [False] * len(self.layouts)
        self._started = False

    def reset(self, expected: Sequence[bool]) -> None:
        """Start a new step; ``expected[i]``: parameter ``i`` requires grad."""
        self.arrivals = [0] * self.n_params
        self.final = [False] * self.n_params
        self.expected = list(expected)
        self.ready = [False] * len(self.layouts)
        self._started = False
        self.pending = [sum(1 for i in layout.param_indices if self.expected[i]) for layout in self.layouts]

    def upcoming(self, index: int, call: int | None = None) -> Arrival:
        """What the next :meth:`arrive` of parameter ``index`` records, recording nothing (the engine counts a
        gradient once it is in the block's buffer). ``call``: the backward call (1 for the step's first) it comes
        from, ``None`` where that cannot be told (see the module docstring)."""
        block, slot = self.where[index]
        n = self.arrivals[index] + 1
        late = self.ready[block]
        last = n == self.accumulation_steps if call is None else call >= self.accumulation_steps
        final = not late and self.expected[index] and not self.final[index] and last
        return Arrival(block, slot, n == 1, final and self.pending[block] == 1, late, final)

    def arrive(self, index: int, call: int | None = None) -> Arrival:
        """Record one gradient arrival of parameter ``index`` (``call``: as :meth:`upcoming`)."""
        arrival = self.upcoming(index, call)
        self._started = True
        self.arrivals[index] += 1
        if arrival.final:
            self.final[index] = True
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
