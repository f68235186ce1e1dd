"""What :meth:`OffloadEngine.step` returns: the speculation report plus the engine's event log."""

from __future__ import annotations

from dataclasses import dataclass

from sofx.speculate import StepReport

__all__ = ["EngineStepReport"]


@dataclass(frozen=True)
class EngineStepReport(StepReport):
    """:class:`sofx.speculate.StepReport` plus what the engine saw.

    ``events``: ``(what, block)`` in the order the main thread observed them
    (``block = -1`` for step-wide events): ``"ready"`` (a block's gradient was
    final during backward and the block was offered for speculation: not one
    kept on the device, nor one held under ``ddp`` before the ranks' exchange,
    see ``not_speculating_reason``, nor one with a step count at int64's
    largest, whose step ``step()`` refuses), ``"speculate"`` (its speculative step was
    submitted), ``"speculated"`` (the executor reported it done; ``"speculate_failed"``:
    it raised, which ``step()`` raises), or
    ``"refused"`` (the step was taken back as it ran: its snapshot would have
    gone beyond ``snapshot_budget_bytes``; the block is stepped in validation),
    ``"undo_now"`` (a speculative step undone at once: a late gradient came for
    its block, to be summed in place, or DDP found a parameter of it unused on
    every rank), ``"late_gradient"``, ``"step_called"``, then the validation actions
    (``"commit"``, ``"undo_redo"``, ``"undo"``, ``"step"``; a ``skip`` is not
    logged) and ``"done"``.
    With an in-process executor (inline, thread) ``"ready"`` and
    ``"speculate"`` are logged where the decision is taken, in the executor,
    in arrival order.
    A block number ``b`` is the engine's: its parameters are
    ``engine.layouts[b].param_indices``, positions in the flat list of the
    parameters in the order they were given (groups in order, then each
    group's ``params``), not the model's order of layers.
    ``executor``: the executor that ran the CPU blocks; ``iteration``: the
    1-based number of ``step()`` calls.
    """

    events: tuple[tuple[str, int], ...] = ()
    executor: str = ""
    iteration: int = 0

    def speculated_before_step(self) -> list[int]:
        """Blocks whose speculative step was done before ``step()`` was called."""
        out = []
        for what, block in self.events:
            if what == "step_called":
                break
            if what == "speculated":
                out.append(block)
        return out
