"""Speculation: take Adam steps before the global facts are known, then validate them.

This is the public entry point of the speculation layer (SPECULATION.md
sections 3-4). It works over *blocks*: block ``i`` is leaf ``i`` of a params
pytree (the offload engine's params are a list of flat 1-d master tensors, one
block each; a functional user's params are any pytree, one block per leaf).
Everything here is a pure function; the only functions that touch tensors are
the *application* functions, which call :class:`sofx.Adam`.

The protocol, as an engine drives it
------------------------------------

At the start of the backward of the last micro-step::

    ctx, tally = begin_step(opt, config, scaler, scaler_state, policy_state,
                            hparams=hp, n_blocks=n, backward_scale=S)

``ctx`` (:class:`StepContext`) freezes the facts assumed while backward runs:
the loss scale ``S`` of this backward, the scale speculative steps will be
unscaled with, the hparams of every block, the early-veto threshold
``(max_norm * S)**2`` and whether the adaptive policy lets this step speculate.
``tally`` (:class:`BackwardTally`) is the immutable running record of this
backward (sum of squares so far, veto, decisions).

When block ``i``'s gradient is final (hooks fire in reverse layer order)::

    sumsq = grad_sumsq(grad_i)                               # one pass; finite iff grad_i is
    tally, d = on_block_ready(ctx, tally, i, sumsq,
                              lambda: block_eligibility(opt, p_i, grad_i, state_i,
                                                        ctx.hparams[i], ctx.grad_scale))
    if d.speculate:                                          # run it in a worker, donating buffers
        try:
            p_i, state_i, record_i = speculative_block_step(opt, p_i, grad_i, state_i, d, donate=True,
                                                            held_bytes=held, ctx=ctx)
            held += record_i.snapshot_bytes()
            tally = on_speculation_held(ctx, tally, i, record_i.snapshot_bytes())  # the budget left, for the next
        except SnapshotLimitError as exc:                    # taken back: beyond the snapshot budget
            tally = on_speculation_refused(ctx, tally, i, str(exc))

:func:`on_block_ready` is pure: it adds ``sumsq`` to the running sum, vetoes
speculation for the rest of the step once that sum exceeds
``(max_norm * S)**2`` (clipping is then certain; ``S`` is the scale the
speculative steps unscale with) or a gradient is not finite (or so large once
unscaled that its step could not be undone),
checks the block's eligibility (its undo strategy, see
:meth:`sofx.Adam.undo_strategies`, and the snapshot budget) -- the
eligibility argument may be a callable, evaluated only when needed -- and
returns a :class:`BlockDecision`. The speculative step is ``opt.update`` on
that one block with ``grad_scale = 1/S_assumed`` (GradScaler's ``float32(1/S)`` under ``"torch"``) and the
context's hparams.
With a ``snapshot_budget_bytes``, ``held`` counts the snapshot bytes the
speculative steps hold: ``undo="auto"`` may find in the step itself that a
block needs a snapshot (its gradient dominates its moments), and a step that
would go beyond the budget is taken back and stepped in validation.
:func:`on_speculation_held` tells the tally what a step holds (the snapshot
of the chunks it kept, see :mod:`sofx.skipped_chunks`), so that the blocks
decided after it see the budget actually left.
The record references ``grad_i``: do not modify it in place until the block is
validated.

If a second gradient arrives for a block that was already ready (a parameter
used twice), sum it *out of place* (``grad_i = grad_i + extra``) and call
``tally = on_late_gradient(ctx, tally, i, grad_sumsq(grad_i))``: the block is
then undone and redone in validation.

In ``step()``, after every pending speculative step has finished::

    plan = plan_validation(ctx, tally, final_sumsq, hparams=hp_now, reduce_sumsq=all_reduce)
    for i in range(n):
        p_i, state_i = apply_block_action(opt, plan.actions[i], p_i, grad_i, state_i, record_i, donate=True)
    scaler_state, policy_state = plan.scaler_state, plan.policy_state
    report = plan.report                                     # a StepReport

:func:`plan_validation` is pure: from the per-block sums of squares of the
final gradients (``None`` for a block that got no gradient; ``tally.block_sumsq[i]``, the very float
:func:`on_block_ready` or :func:`on_late_gradient` took, for one that did: a speculated block's sum other than
the one it was speculated with is a gradient changed since, and the block is undone and redone) it derives the
step's global facts exactly as the serial loop does
(:func:`sofx.serial.step_facts`: overflow, loss-scale update in the
profile's order, global norm, clip coefficient, the one gradient multiplier)
and one :class:`BlockAction` per block:

=============  ==========================================================
``commit``     speculated with exactly the final multiplier, hparams and gradient
``undo_redo``  speculated, but the multiplier (clip, scale), hparams or gradient changed
``undo``       speculated, and the step is skipped (overflow) or not taken (``plan.error``)
``step``       not speculated (vetoed, ineligible, refused, policy, earlier micro-steps), or its
               speculative step was undone when a late gradient came: step now
``skip``       nothing to do (overflow, ``plan.error``, or no gradient with ``missing_grad="skip"``)
=============  ==========================================================

(a missing gradient with ``missing_grad="zero"`` is ``step`` with
``zero_grad=True``). ``reduce_sumsq`` all-reduces the local sum of squares
across ranks (nan/inf anywhere makes every rank skip); ``taken=[...]`` says
which speculative steps actually ran (a step that did not run is stepped
late, not undone). If ``plan.error`` is set (DeepSpeed's scaler gave up at its
minimum scale, a :class:`~sofx.loss_scale.MinLossScaleError`; or the
loss-scale rule failed, a :class:`~sofx.loss_scale.LossScaleRuleError`: a
custom rule's ``scale`` or ``update`` raised, or its ``update`` returned a
state that cannot be taken), the step is not taken: the actions undo every
speculative step (``plan.scaler_state`` and ``plan.policy_state`` are the
step's own); apply them, then raise it. :func:`apply_block_action` carries
one action out with
:class:`sofx.Adam` (``undo_redo`` is the fused one-call undo+redo). The result
equals :func:`sofx.serial.serial_step` on the same inputs: bitwise for blocks
that were committed or stepped late, to float32 rounding for undone ones.

:func:`speculative_step` does all of the above in one call over a whole
params pytree (inline, in arrival order): the pure combinator for functional
training loops and tests. :func:`speculative_loop_step` is its twin of
:func:`sofx.serial.serial_loop_step` on a :class:`sofx.serial.LoopState`
(schedules evaluated at the number of steps taken; skipped steps do not count)::

    loop = sofx.serial.init_loop(opt, params, scaler)
    for batch in data:
        grads = ...                          # of loss * scaler.scale(loop.scaler_state)
        loop, report = speculative_loop_step(opt, loop, grads, config=cfg, scaler=scaler, hparams=schedule)
        print(report.summary())
"""

from __future__ import annotations

from sofx.speculation.apply import (
    apply_block_action,
    block_eligibility,
    grad_sumsq,
    speculative_block_step,
)
from sofx.speculation.decisions import (
    BackwardTally,
    BlockAction,
    BlockDecision,
    Eligibility,
    SpeculationConfig,
    StepContext,
    ValidationPlan,
    begin_step,
    on_block_ready,
    on_late_gradient,
    on_speculation_held,
    on_speculation_refused,
    plan_validation,
)
from sofx.speculation.policy import AdaptivePolicy, PolicyState
from sofx.speculation.tree_step import SpeculativeStepResult, speculative_loop_step, speculative_step
from sofx.step_report import StepReport

__all__ = [
    "AdaptivePolicy",
    "PolicyState",
    "SpeculationConfig",
    "StepContext",
    "BackwardTally",
    "Eligibility",
    "BlockDecision",
    "BlockAction",
    "ValidationPlan",
    "StepReport",
    "SpeculativeStepResult",
    "begin_step",
    "on_block_ready",
    "on_late_gradient",
    "on_speculation_refused",
    "on_speculation_held",
    "plan_validation",
    "grad_sumsq",
    "block_eligibility",
    "speculative_block_step",
    "apply_block_action",
    "speculative_step",
    "speculative_loop_step",
]
