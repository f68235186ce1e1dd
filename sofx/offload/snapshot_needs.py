"""What each block's speculative step will likely hold in snapshots, learnt from its last steps.

With a ``snapshot_budget_bytes``, ``undo="auto"``'s speculative step may find in itself that it must keep
chunks whose inverse would be too lossy (:mod:`sofx.skipped_chunks`), bytes its decision did not plan for;
one that would go beyond what is left of the budget is taken back and its block stepped in validation (a
step, its inverse and the late step, where not speculating costs the late step alone; each take-back also
leaves the unflagged chunks a few ulps off). Where the need persists (an embedding or output layer whose
rare rows spike every step, the first steps of a run) that would happen every step. So the engine offers a
block's learnt need as its snapshot need (:class:`~sofx.speculate.Eligibility`) when it decides:

* **unplanned**: what the block's last speculative step held (its record's ``snapshot_bytes()`` as reported,
  :func:`~sofx.speculate.on_speculation_held`) beyond the bytes its undo strategy planned for that step (the
  ``snapshot_bytes`` of its :class:`~sofx.speculate.Eligibility`, before anything here was added): the chunks
  it kept, 0 where it held no more than planned. The block is decided on its plan now plus these, where they
  fit in what is left of the budget, so that the blocks decided after it (before its step reports what it
  holds, with an executor that runs it meanwhile) see the budget it will take; where they do not fit, the
  block is decided on its planned bytes (and may be taken back). Only the excess is learnt: a plan that
  shrinks (an L2-decay leaf's first step keeps its parameter, ``sofx.adam.L2_FIRST_STEP_REASON``; its later
  steps are algebraic) is not reserved at its old size a step longer, while a persistent unplanned need is
  reserved at every plan.
* **refused**: the bytes a step that was taken back needed (:class:`~sofx.errors.SnapshotLimitError`'s
  ``needed``) beyond those its strategy planned for it, as above. The block is decided on its plan now plus
  these, so not speculated while they do not fit (decision ``"budget"``), for its next ``wait`` decisions, then
  tried again; refused once more, it waits twice as long (1, 2, 4, ... up to :data:`MAX_WAIT` decisions). Each
  time it is speculated without a refusal, the wait its next refusal would get halves, and the refusal is
  forgotten at the first such step after that reached 1: a block whose need went away is forgotten after a few
  steps, while blocks that take turns at one budget keep their long waits.

Plain Python state per block; the engine calls :meth:`need` as it decides and :meth:`after_step` once the
step's decisions are final.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["SnapshotNeeds", "MAX_WAIT"]

#: The most decisions a refused block waits before its speculation is tried again.
MAX_WAIT = 16


@dataclass
class _Refused:
    beyond: int  # what the refused step needed (SnapshotLimitError.needed) beyond its strategy's plan
    wait: int  # decisions left before it is tried again
    backoff: int  # the wait it was given


class SnapshotNeeds:
    """Per block: what its last speculative step held beyond its plan, and the need of its last refused one
    while it waits (see the module docstring)."""

    def __init__(self, n_blocks: int) -> None:
        self._unplanned = [0] * n_blocks
        self._refused: list[_Refused | None] = [None] * n_blocks

    def need(self, block: int, planned: int, left: int | None) -> tuple[int, str]:
        """The snapshot bytes to decide ``block`` on (at least ``planned``, its strategy's; ``left``: what is
        left of the budget, None without one) and why, "" where they are the planned ones."""
        r = self._refused[block]
        if r is not None and r.wait > 0 and r.beyond > 0:
            return planned + r.beyond, (f"a recent speculative step of this block needed {r.beyond} bytes of "
                                        "snapshot beyond its planned ones and was taken back (see "
                                        "sofx.offload.snapshot_needs)")
        unplanned = self._unplanned[block]
        if unplanned > 0 and left is not None and planned + unplanned <= left:
            return planned + unplanned, (f"its last speculative step held {unplanned} bytes of snapshot beyond "
                                         "its planned ones")
        return planned, ""

    def after_step(self, decisions: Sequence[Any], refused_bytes: Mapping[int, int],
                   planned: Mapping[int, int] | None = None) -> None:
        """Update from a step's final decisions (:class:`~sofx.speculate.BlockDecision` or None per block; a
        speculated one's ``snapshot_bytes`` what its step holds), the bytes each refused block needed and those
        each speculated or refused block's strategy planned (the :class:`~sofx.speculate.Eligibility` it was
        decided on, before :meth:`need`; a block not in ``planned``: 0, all it held or needed is learnt)."""
        planned = {} if planned is None else planned
        for b, d in enumerate(decisions):
            if d is None:
                continue
            r = self._refused[b]
            if d.kind == "refused":
                wait = 1 if r is None else min(2 * r.backoff, MAX_WAIT)
                beyond = max(0, int(refused_bytes.get(b, 0)) - int(planned.get(b, 0)))
                self._refused[b] = _Refused(beyond, wait, wait)
            elif d.kind == "speculate":
                self._unplanned[b] = max(0, int(d.snapshot_bytes) - int(planned.get(b, 0)))
                if r is not None:  # it fitted: its next refusal waits half as long; forgotten after a few fits
                    self._refused[b] = _Refused(r.beyond, 0, r.backoff // 2) if r.backoff > 1 else None
            elif r is not None and r.wait > 0 and d.kind == "budget":
                r.wait -= 1

    def forget(self) -> None:
        """Drop everything learnt (a loaded or reset optimizer state)."""
        self._unplanned = [0] * len(self._unplanned)
        self._refused = [None] * len(self._refused)
