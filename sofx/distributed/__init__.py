"""torch.distributed collectives for the serial and speculative loops.

Plain functions over an optional process group (``None``: the default group);
nothing here holds global state. Every function raises :class:`SofxError`
with a clear message when ``torch.distributed`` is unavailable or not
initialized, or when this process is not a member of ``group``.

What the loops need
-------------------

The global facts of a step (SPECULATION.md sections 3-4) are the overflow flag
and the global gradient norm; both derive from one number, the sum of squares
``s = sum_r s_r`` of the raw gradients over every block of every rank ``r``:
``overflow = not isfinite(s)`` and ``norm = sqrt(s) / S``.
:func:`all_reduce_sumsq` returns the ``reduce_sumsq`` hook of
:func:`sofx.serial.serial_loop_step` and
:func:`sofx.speculate.speculative_loop_step` /
:func:`sofx.speculate.plan_validation`::

    reduce = sofx.distributed.all_reduce_sumsq(group)
    loop, report = speculative_loop_step(opt, loop, local_grads, config=cfg, scaler=scaler,
                                         hparams=local_hparams, reduce_sumsq=reduce)

It all-gathers the ``world_size`` local float64 sums and adds them in rank
order, ``s = (((s_0 + s_1) + s_2) + ...)``, on every rank: every rank gets the
same bits whatever the backend's reduction algorithm, so every rank takes the
same decisions (overflow, clip coefficient, loss-scale update). A nan or inf on
any rank makes ``s`` non-finite on every rank (IEEE addition: ``inf + x = inf``
for ``x >= 0``, ``nan + x = nan``; sums of squares are never negative), so
every rank skips the step. (gloo's ``all_reduce(SUM)`` propagates inf and nan
as well -- the tests check both -- but the association of its additions is the
backend's and depends on its algorithm and the world size; the all-gather makes
it explicit and the same for every backend.)
Every rank must call the hook once per step, also a rank that owns no block
or got no gradient: its local sum is then ``-0.0``
(:func:`sofx.serial.local_sumsq`), IEEE addition's identity, so ``s`` is
``-0.0`` exactly when no rank has a gradient, and such a step is not counted
by the loss scaler or the speculation policy, as in one process
(:func:`sofx.serial.without_gradients`). A hook of one's own that adds the
ranks' values (``dist.all_reduce(SUM)`` of a float64 tensor will do) keeps
that; one that returns ``+0.0`` there makes the step count as a step with zero
gradients.

The loops also pass the hook their step's settings (profile, ``max_norm``,
``missing_grad``, the loss-scaler state: :func:`sofx.serial.step_settings`;
a loop step adds ``loop.step``), whose digest travels in the same all-gather: ranks that step with different
ones raise on every rank, naming what differs, before any steps.

ZeRO-style sharding: each rank owns a subset of the blocks (the leaves of the
params pytree) and keeps their master weights and Adam state; :class:`Shard`
says which (by default :func:`partition_blocks`: contiguous, balanced by
element count), selects a rank's leaves from a full tree (params, gradients,
per-leaf hparams or a schedule of them), averages a data-parallel rank's full
gradients onto their owners (:meth:`Shard.reduce_mean`, ZeRO-2's
reduce-scatter) and gathers the updated leaves back from their owners
(:meth:`Shard.gather`, one broadcast per owner and dtype). Each rank runs the
ordinary loop on its local list of leaves with ``reduce_sumsq``::

    shard = sofx.distributed.shard_blocks(params)            # every rank; checks their params agree
    reduce = sofx.distributed.all_reduce_sumsq(opt=opt, scaler=scaler, config=cfg, hparams=schedule)
    loop = sofx.serial.init_loop(opt, shard.local(params), scaler)
    hp = shard.local_hparams(opt, schedule)                  # a prefix tree or a schedule of one
    for batch in data:
        local_grads = shard.reduce_mean(grads)               # or shard.local(grads) if already averaged
        loop, report = speculative_loop_step(opt, loop, local_grads, config=cfg, scaler=scaler,
                                             hparams=hp, reduce_sumsq=reduce)
    full_params = shard.gather(loop.params, like=params)

``shard_blocks`` and ``all_reduce_sumsq`` are collectives of the setup: each
checks, with one all-reduce of 16 bytes, that every rank passed the same
(params' structure, dtypes and shapes and the owners; the optimizer, loss
scaler, speculation config and the full hparams or schedule), and where not,
every rank raises naming what differs (:func:`check_same_setup` checks the
same for a loop without the hook). Build them first: a rank that fails
before them alone leaves the others waiting there until the group's timeout
(each then raises a :class:`SofxError` naming the call it waited in).

The result, gathered, equals the single-process loop over the whole tree:
bitwise on every step until one clips (the clip coefficient comes from ``s``,
whose float64 rounding depends on how the blocks are split across ranks) or
undoes a speculative step algebraically (snapshot undo, ``undo="exact"``, is
bitwise); to float32 rounding (<= 1e-6 relative) after that. Overflow and loss
scale decisions are identical on every rank and equal to the single process's.

Checkpoints and world sizes: a checkpoint of a sharded run holds the full
tree, so that a run of any world size resumes it. Gather the shards
(:meth:`Shard.gather` of ``loop.params`` and of each field of
``loop.opt_state``) and save them with the loop's ``step`` and
``scaler_state``: :func:`sofx.checkpoint.save` (from one rank) holds the
whole tree; :func:`sofx.checkpoint.save_zero3` (every rank may write it at
once) holds the params, the Adam state and a DeepSpeed or static loss
scaler (``loss_scaler=``), not the loop's step (keep it beside). To resume,
load the full tree, shard it again with :func:`shard_blocks` (the owners
follow the new world size) and take each rank's leaves with
:meth:`Shard.local` (tests/test_distributed_uneven.py: saved by 3 ranks,
resumed by 2 and by 1). A rank's own local loop state, saved alone, is a
list of its leaves: it resumes only at the same world size and owners (a
load with another rank's template is refused where the number or shapes of
the leaves differ, not where they agree), and ranks resumed at different
steps are refused at their first step (``loop.step``, with the step's
settings).

Data parallelism: :func:`all_reduce_mean_` averages a gradient pytree in place
across ranks, ``g <- (sum_r g_r) / world_size`` (summed by the backend's
all-reduce, then divided once; fp16 and bf16 gradients in float32, divided
first as ``DistributedDataParallel`` does, so that finite gradients never sum
to inf), so replicated parameters stay identical.

Modules (dependencies point downward)
-------------------------------------

``groups``     process groups: ``is_ready``, ``require_initialized``, rank, size, the collectives' device
``refusals``   a rank's checks of its own input, its refusal told to the others, :class:`RankRefusedError`
``agreement``  whether every rank passed the same (a digest all-reduced; what differs, named)
``setup``      :func:`check_same_setup`: the setup's entries, agreed
``sumsq``      :func:`all_reduce_sumsq` and its hook :class:`SumsqReduce`
``mean``       :func:`all_reduce_mean_`, the gradient mean
``sharding``   :func:`partition_blocks`, :class:`Shard`, :func:`shard_blocks`
"""

from __future__ import annotations

# dist (torch.distributed) and _collective_device: importable from here as before the split (the tests patch
# and call them)
from sofx.distributed.groups import _collective_device, dist, group_rank, group_size, is_ready, require_initialized
from sofx.distributed.mean import all_reduce_mean_
from sofx.distributed.refusals import RankRefusedError
from sofx.distributed.setup import check_same_setup
from sofx.distributed.sharding import Shard, partition_blocks, shard_blocks
from sofx.distributed.sumsq import SumsqReduce, all_reduce_sumsq

__all__ = [
    "is_ready",
    "require_initialized",
    "group_rank",
    "group_size",
    "all_reduce_sumsq",
    "check_same_setup",
    "SumsqReduce",
    "RankRefusedError",
    "all_reduce_mean_",
    "partition_blocks",
    "Shard",
    "shard_blocks",
]
