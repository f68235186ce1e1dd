"""Carries block operations out on block tensors, through the speculation layer.

The runner is the only part of the offload runtime that touches optimizer
state. For each :class:`~sofx.offload.block_ops.BlockOp` it calls the pure
speculation layer's tensor functions (:func:`sofx.speculate.speculative_block_step`,
:func:`sofx.speculate.apply_block_action`, which call :class:`sofx.Adam`)
with ``donate=True`` on views of the block's flat tensors, so the results are
written in place, and keeps each block's undo record until the step is
final. Every executor (inline, thread, process) runs the same runner, so all
compute the same bits. Where an operation asks for it (``BlockOp.publish``),
the new master values of the block's parameters also go to their publish
buffers (cast to the model's dtype): the copy into the model is done here,
during backward, instead of in ``step()``. The Adam call writes them
(``param_copies``: the CPU kernels in the same pass as the step, which saves
reading the masters again), for which a published block of a few large
parameters is stepped one leaf per parameter (:func:`uses_flat_layout`); a
block of many small ones is stepped as one flat leaf and copied after.

Layout of a call: when every parameter of the block has a gradient in the
block's buffer, all share one step count and the block is not published one
parameter at a time, the block is one flat leaf (one kernel call); otherwise
one leaf per parameter, where a parameter without a gradient is a ``None``
leaf (not stepped, its count kept). Adam is elementwise, so both layouts give
the same bits.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from sofx.adam import Adam, AdamHParams, AdamState
from sofx.errors import SnapshotLimitError, UnsupportedError
from sofx.kernels.user_numbers import flag
from sofx.offload.block_ops import BlockOp, OpResult
from sofx.offload.blocks import BlockLayout, BlockTensors
from sofx.speculate import Eligibility, apply_block_action, block_eligibility, speculative_block_step
from sofx.speculation.apply import combine_eligibilities
from sofx.undo_record import UndoRecord

__all__ = ["BlockRunner", "AdamConfig", "block_tree", "combined_eligibility"]

# A block whose new values are published is stepped one leaf per parameter when it has at most
# MAX_LEAVES_FOR_FUSED_PUBLISH parameters of MIN_LEAF_NUMEL_FOR_FUSED_PUBLISH elements or more on
# average, so that each leaf's kernel writes its publish buffer in the same pass (param_copies): one more
# Adam leaf and kernel call per parameter (~0.05 ms of Python) against reading the block's masters again
# for a copy (~0.05 ms per 32K float32 elements here).
MAX_LEAVES_FOR_FUSED_PUBLISH = 16
MIN_LEAF_NUMEL_FOR_FUSED_PUBLISH = 1 << 15


@dataclass(frozen=True)
class AdamConfig:
    """The static configuration of the Adam transform, JSON-able (sent to worker processes)."""

    decoupled: bool = True
    bias_correction: bool = True
    state_dtype: str = "float32"
    undo: str = "auto"
    backend: str = "auto"

    def __post_init__(self) -> None:
        # Python bools: a numpy bool is no JSON value (the process executor's worker gets this as JSON)
        for name in ("decoupled", "bias_correction"):
            object.__setattr__(self, name, flag(name, getattr(self, name), UnsupportedError))

    def build(self) -> Adam:
        """The :class:`~sofx.Adam` transform of this configuration (hparams come with each operation)."""
        dtype = getattr(torch, self.state_dtype)
        # The defaults are never used: every decision and action carries all five hparams.
        return Adam(AdamHParams(1e-3, 0.9, 0.999, 1e-8, 0.0), decoupled=self.decoupled,
                    bias_correction=self.bias_correction, state_dtype=dtype, undo=self.undo, backend=self.backend)

    def to_json(self) -> dict:
        """The configuration as JSON-able values (sent to a worker process)."""
        return dict(self.__dict__)


def block_tree(t: BlockTensors, layout: BlockLayout, flat: bool, present: Sequence[bool] | None,
               grads: Sequence[torch.Tensor] | None = None) -> tuple[Any, Any, AdamState]:
    """``(params, grads, state)`` of a block as the Adam transform sees them.

    ``flat``: one leaf (the flat tensors; the count is the first parameter's).
    Otherwise lists with one leaf per parameter; ``present[i] = False`` makes
    parameter ``i``'s gradient ``None``. ``grads``: the parameters' 1-d
    gradients when they are not in the block's gradient buffer (borrowed from
    autograd by an in-process engine; never flat). Counts are copies (Adam
    returns new ones).
    """
    if flat:
        if grads is not None:
            raise ValueError("a block with borrowed gradients is never stepped as one flat leaf")
        return t.master, t.grad, AdamState(t.counts[0].clone(), t.exp_avg, t.exp_avg_sq)
    n = len(layout.numels)
    present = tuple(present) if present is not None else (True,) * n
    sources = t.views(t.grad, layout) if grads is None else grads
    grads = [g if has else None for g, has in zip(sources, present)]
    counts = [t.counts[i].clone() for i in range(n)]
    return (t.views(t.master, layout), grads,
            AdamState(counts, t.views(t.exp_avg, layout), t.views(t.exp_avg_sq, layout)))


def uses_flat_layout(t: BlockTensors, present: Sequence[bool] | None, borrowed: bool = False,
                     publish: Sequence[int] | None = None) -> bool:
    """One flat leaf when the gradients are in the block's buffer, every parameter has one, all counts
    agree and the block is not published one parameter at a time (``publish``: the operation's publish
    mask; see MAX_LEAVES_FOR_FUSED_PUBLISH)."""
    if borrowed or (present is not None and not all(present)):
        return False
    if (publish is not None and len(publish) <= MAX_LEAVES_FOR_FUSED_PUBLISH
            and t.master.numel() >= len(publish) * MIN_LEAF_NUMEL_FOR_FUSED_PUBLISH):
        return False
    counts = t.counts
    return counts.numel() == 1 or bool((counts == counts[0]).all())


def _leaf_eligibility(opt: Adam, p: torch.Tensor, g: torch.Tensor, state: AdamState, hparams: AdamHParams,
                      grad_scale: float, finite: bool) -> Eligibility:
    # The strategy depends on the gradient only through its finiteness: when the caller knows it (the
    # block's sum of squares was finite), Adam is told so and does not pass over the gradient again.
    return block_eligibility(opt, p, g, state, hparams, grad_scale, grads_finite=True if finite else None)


def combined_eligibility(opt: Adam, t: BlockTensors, layout: BlockLayout, flat: bool,
                         present: Sequence[bool] | None, hparams: AdamHParams, grad_scale: float,
                         grads: Sequence[torch.Tensor] | None = None, finite: bool = False) -> Eligibility:
    """The block's :class:`~sofx.speculate.Eligibility` (per parameter, combined, when not flat).

    ``finite=True``: the caller knows every gradient of the block is finite (its sum of squares is);
    the gradients are then not read again. A block none of whose parameters has a gradient is ineligible ("no
    gradient"), as :func:`sofx.speculation.apply.block_eligibility` says: a speculative step would take nothing
    (``speculative_block_step`` refuses it), and validation steps no such block.
    """
    params, grads, state = block_tree(t, layout, flat, present, grads)
    if flat:
        return _leaf_eligibility(opt, params, grads, state, hparams, grad_scale, finite)
    combined = combine_eligibilities(_leaf_eligibility(opt, p, g, AdamState(c, m, v), hparams, grad_scale, finite)
                                     for p, g, c, m, v in zip(params, grads, state.count, state.mu, state.nu)
                                     if g is not None)
    return Eligibility(False, None, "no gradient", 0) if combined is None else combined


@dataclass
class _Kept:
    record: UndoRecord | None  # None: undone already (undo_now: record_used), or taken back as it ran (refused)
    flat: bool
    snapshot_bytes: int = 0  # the record's, counted in BlockRunner.held_bytes
    record_used: bool = False


class BlockRunner:
    """Runs block operations on ``tensors`` (block index -> :class:`BlockTensors`)."""

    def __init__(self, adam: Adam, layouts: Sequence[BlockLayout], tensors: dict[int, BlockTensors],
                 publish: dict[int, Sequence[Sequence[torch.Tensor] | None]] | None = None) -> None:
        self.adam = adam
        self.layouts = {layout.index: layout for layout in layouts}
        self.tensors = tensors
        # block -> per parameter: its two publish buffers (1-d, the model's dtype), or None
        self.publish = publish or {}
        self.kept: dict[int, _Kept] = {}
        self.held_bytes = 0  # snapshot bytes of the kept records
        self._held_lock = threading.Lock()
        self._budget_turn = threading.Lock()  # held by a speculative step with a snapshot budget while it runs
        # block -> why its speculative step was taken back, and the snapshot bytes it needed (for run())
        self._refused: dict[int, tuple[str, int]] = {}

    def run(self, op: BlockOp) -> OpResult:
        """Apply ``op``; an exception becomes an error result (with its traceback)."""
        try:
            # A handler returns whether the publish buffers op.publish names are still to be written.
            if getattr(self, "_" + op.kind)(op) and op.publish is not None:
                self._publish(op)
            refused = self._refused.pop(op.block, None) if op.kind in ("speculate", "ready") else None
            if refused is not None:
                return OpResult(op.seq, op.kind, op.block, refused=refused[0], refused_bytes=refused[1])
            kept = self.kept.get(op.block) if op.kind in ("speculate", "ready") else None
            held = kept.snapshot_bytes if kept is not None and kept.record is not None else None
            return OpResult(op.seq, op.kind, op.block, held_bytes=held)
        except Exception as exc:  # reported to the main process, which raises it
            detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            return OpResult(op.seq, op.kind, op.block, f"{type(exc).__name__}: {exc}\n{detail}")

    # ------------------------------------------------------------ operations
    def _speculate(self, op: BlockOp) -> bool:
        if op.block in self.kept:
            raise RuntimeError(f"block {op.block} already holds an uncommitted speculative step")
        t, layout = self.tensors[op.block], self.layouts[op.block]
        flat = uses_flat_layout(t, op.present, op.grads is not None, op.publish)
        params, grads, state = block_tree(t, layout, flat, op.present, op.grads)
        copies = self._copies(op, flat)
        budget = op.payload.snapshot_budget_bytes
        # With a budget, speculative steps take turns (a thread helping in step() runs the next one after this):
        # each may keep what is left of the budget when it runs. Other operations meanwhile (undos) only free
        # bytes, so what is held now bounds what the step may keep.
        with self._budget_turn if budget is not None else contextlib.nullcontext():
            try:
                _, new_state, record = speculative_block_step(self.adam, params, grads, state, op.payload,
                                                              donate=True, grads_finite=op.grads_finite or None,
                                                              param_copies=copies, held_bytes=self.held_bytes)
            except SnapshotLimitError as exc:
                # Taken back (the block is as it was): not speculated; validation steps it.
                self._refused[op.block] = (str(exc), exc.needed)
                self._keep(op.block, _Kept(None, flat))
                return False
            except BaseException:
                self._keep(op.block, None)
                raise
            self._store_counts(op.block, flat, new_state)
            self._keep(op.block, _Kept(record, flat, record.snapshot_bytes()))
        return copies is None

    def _ready(self, op: BlockOp) -> bool:
        decision = op.payload()
        if decision is None:
            return False  # not speculated: nothing to publish
        return self._speculate(BlockOp(op.seq, "speculate", op.block, decision, op.present, op.grads,
                                       op.publish, grads_finite=op.grads_finite))

    def _undo_now(self, op: BlockOp) -> bool:
        kept = self.kept.get(op.block)
        if kept is not None and kept.record is None and not kept.record_used:
            return False  # taken back as it ran (refused): nothing to undo
        if kept is None or kept.record is None:
            raise RuntimeError(f"block {op.block} has no speculative step to undo")
        params, _, state = block_tree(self.tensors[op.block], self.layouts[op.block], kept.flat, None)
        _, new_state = self.adam.undo(params, state, kept.record, donate=True)
        self._store_counts(op.block, kept.flat, new_state)
        self._keep(op.block, _Kept(None, kept.flat, record_used=True))
        return False

    def _apply(self, op: BlockOp) -> bool:
        action = op.payload
        kept = self._keep(op.block, None)
        if kept is not None and kept.record is None:
            # The speculative step was undone by undo_now, or taken back as it ran: the engine plans a step or a
            # skip then (it tells validation which steps were taken); should an undo or undo_redo still come,
            # the undo is done already and an undo_redo is a step.
            if action.kind == "undo":
                return True
            if action.kind == "undo_redo":
                action = action._replace(kind="step")
        if action.kind in ("commit", "skip"):
            return True
        t, layout = self.tensors[op.block], self.layouts[op.block]
        if action.zero_grad:
            # The engine zeroed the buffers of the parameters that got no gradient.
            action = action._replace(zero_grad=False)
        if kept is not None and kept.record is not None:
            flat = kept.flat
        else:
            flat = uses_flat_layout(t, op.present, op.grads is not None, op.publish)
        params, grads, state = block_tree(t, layout, flat, op.present, op.grads)
        record = kept.record if kept is not None else None
        copies = self._copies(op, flat)
        _, new_state = apply_block_action(self.adam, action, params, grads, state, record, donate=True,
                                          grads_finite=op.grads_finite or None, param_copies=copies)
        self._store_counts(op.block, flat, new_state)
        return copies is None

    def _commit_all(self, op: BlockOp) -> bool:
        with self._held_lock:
            self.kept.clear()
            self.held_bytes = 0
        return False

    def _keep(self, block: int, kept: _Kept | None) -> _Kept | None:
        """Set (None: drop) what ``block`` keeps, counting its snapshot bytes; returns what the block kept
        before."""
        with self._held_lock:
            old = self.kept.pop(block, None)
            if old is not None:
                self.held_bytes -= old.snapshot_bytes
            if kept is not None:
                self.kept[block] = kept
                self.held_bytes += kept.snapshot_bytes
        return old

    def _copies(self, op: BlockOp, flat: bool) -> list[torch.Tensor | None] | None:
        """The publish buffers ``op.publish`` names, one per parameter (None where it names none), for the
        Adam call to write (``param_copies``); None when the block is one flat leaf or nothing is published."""
        if op.publish is None or flat:
            return None
        buffers = self.publish.get(op.block)
        copies = []
        for slot, which in enumerate(op.publish):
            if which < 0:
                copies.append(None)
                continue
            if buffers is None or buffers[slot] is None:
                raise RuntimeError(f"block {op.block}, parameter {slot}: no publish buffer")
            copies.append(buffers[slot][which])
        return copies

    def _publish(self, op: BlockOp) -> None:
        """Copy the block's new master values into the publish buffers ``op.publish`` names."""
        t, layout, buffers = self.tensors[op.block], self.layouts[op.block], self.publish.get(op.block)
        for slot, (which, view) in enumerate(zip(op.publish, t.views(t.master, layout))):
            if which >= 0:
                if buffers is None or buffers[slot] is None:
                    raise RuntimeError(f"block {op.block}, parameter {slot}: no publish buffer")
                buffers[slot][which].copy_(view)

    # --------------------------------------------------------------- helpers
    def _store_counts(self, block: int, flat: bool, state: AdamState) -> None:
        counts = self.tensors[block].counts
        if flat:
            counts.fill_(state.count)
        else:
            counts.copy_(torch.stack(list(state.count)))
