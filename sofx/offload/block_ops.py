"""The messages an executor carries: operations on one block, and their results.

An operation names the block and carries the speculation layer's decision or
action for it (:class:`sofx.speculate.BlockDecision` /
:class:`sofx.speculate.BlockAction`), which hold *every* dynamic value the
Adam call needs -- all five hyperparameters and the gradient multiplier
(``1/loss_scale``, times the clip coefficient where one applies). A worker
never relies on values it received earlier (a worker that only received
``lr`` ran with stale betas after a schedule change or a resume); undoing
uses the values recorded with the step being undone. Operations are small
and picklable.

Kinds:

``"speculate"``  the speculative step of a ready block (``payload``: a BlockDecision); its undo record is kept
``"ready"``      a block is ready (in-process executors only): ``payload()`` asks the speculation layer and
                 returns its BlockDecision, or None not to speculate; then as ``"speculate"``
``"undo_now"``   undo the block's speculative step at once (a late gradient is about to be summed into
                 the buffer the record refers to); validation then plans the block's ``step``
``"apply"``      carry out validation's action for the block (``payload``: a BlockAction)
``"commit_all"`` forget every kept record: the step is final

A ``"speculate"`` or ``"apply"`` operation may also *publish* the block: write the
new master values of some of its parameters into one of their two publish
buffers (the engine's double-buffered model parameters, see
:mod:`sofx.offload.engine`), so that ``step()`` only has to point the model's
parameters at them instead of copying.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["BlockOp", "OpResult", "OP_KINDS"]

OP_KINDS = ("speculate", "ready", "undo_now", "apply", "commit_all")


@dataclass(frozen=True)
class BlockOp:
    """One operation on one block (``block`` is -1 for ``"commit_all"``).

    ``present`` marks, per parameter of the block, whether it has a gradient
    this step (``None``: all do); parameters without one are not stepped and
    keep their state and count (``missing_grad="skip"``, frozen parameters).
    ``grads``: the parameters' 1-d gradients when they are not in the block's
    gradient buffer (an in-process executor borrows them from autograd
    instead of copying; never sent to a worker process).
    ``grads_finite``: the engine took the sum of squares of exactly the
    gradient values this operation steps with (the buffer or ``grads``) and it
    was finite, so every element is; Adam then does not read the gradients
    again to check (:meth:`sofx.Adam.update`'s ``grads_finite``). For a
    ``"ready"`` operation it holds for a decision that speculates (the
    speculation layer speculates only on a finite sum of squares).
    """

    seq: int
    kind: str
    block: int = -1
    payload: Any = None
    present: Optional[tuple[bool, ...]] = None
    grads: Optional[tuple[Any, ...]] = None
    publish: Optional[tuple[int, ...]] = None
    grads_finite: bool = False

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"unknown block operation {self.kind!r}; expected one of {OP_KINDS}")
        if self.kind in ("speculate", "ready", "apply") and self.payload is None:
            raise ValueError(f"a {self.kind!r} operation needs its decision or action")


@dataclass(frozen=True)
class OpResult:
    """What came of an operation: ``error`` is a message (with the worker's traceback) or None.

    ``refused``: a speculative step (``"speculate"``, ``"ready"``) that was taken back because its snapshot
    would have gone beyond the budget (:class:`~sofx.errors.SnapshotLimitError`'s message), else None;
    ``refused_bytes``: the snapshot bytes it needed (the error's ``needed``); ``held_bytes``: those a
    speculative step that was not taken back holds (its record's ``snapshot_bytes()``), else None."""

    seq: int
    kind: str
    block: int
    error: Optional[str] = None
    refused: Optional[str] = None
    refused_bytes: int = 0
    held_bytes: Optional[int] = None

    @property
    def ok(self) -> bool:
        """Whether the operation succeeded."""
        return self.error is None
