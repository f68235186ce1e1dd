"""Carrying speculation decisions out on one block's tensors, with :class:`sofx.Adam`.

These are the only speculation functions that touch tensors. Each works on
one block: ``param`` a tensor, ``grad`` a tensor of its dtype, ``state`` an
:class:`~sofx.adam.AdamState` whose fields are that block's count (a 0-d int64
tensor) and moments. An engine may run them in any worker; with
``donate=True`` they write into the given buffers (the engine's flat blocks).

* :func:`grad_sumsq` -- the block's sum of squares (float64 accumulation), the
  number :func:`~sofx.speculation.decisions.on_block_ready` needs;
* :func:`block_eligibility` -- the undo strategy ``Adam.update`` would choose;
* :func:`speculative_block_step` -- the speculative Adam step, returning its record;
* :func:`apply_block_action` -- commit, undo+redo (one call, fused where the
  backend can), undo only, step late, or nothing.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from sofx import tree
from sofx.adam import Adam, AdamHParams, AdamState, not_an_adam_state, validate_grads_finite
from sofx.errors import LeafError, SofxError, UnsupportedError
from sofx.kernels.user_numbers import flag, integer
from sofx.serial import check_opt
from sofx.speculation.decisions import BlockAction, BlockDecision, Eligibility, StepContext
from sofx.transforms import sumsq
from sofx.undo_record import STRATEGIES, UndoRecord, strategy_snapshot_bytes

__all__ = ["grad_sumsq", "block_eligibility", "combine_eligibilities", "snapshot_bytes_of", "speculative_block_step",
           "apply_block_action"]


# Which strategy's snapshot costs more: a tree block's Eligibility names its costliest leaf's. Every strategy of an
# undo record that can be undone (undo_record.STRATEGIES but "none"): a "chunk_snapshot" keeps p, m and v of the
# chunks its step flagged only (algebraic elsewhere), a "param_snapshot" the whole p, a "snapshot" all three.
_STRATEGY_COST = {"algebraic": 0, "chunk_snapshot": 1, "param_snapshot": 2, "snapshot": 3}


def grad_sumsq(grad: torch.Tensor) -> float:
    """``sum(grad**2)`` accumulated in float64: finite iff every element of ``grad`` is."""
    return sumsq(grad)


def snapshot_bytes_of(strategy: str, param: torch.Tensor, state: AdamState) -> int:
    """Bytes a speculative step with undo ``strategy`` keeps alive for its snapshot (a tree block's: the sum over
    its leaves). A ``state`` that is no :class:`~sofx.adam.AdamState` is refused as Adam's calls refuse it (a bare
    AttributeError before), and a strategy that is none of an undo record's (it counted as 0 bytes). ``"none"`` and
    ``"algebraic"`` keep nothing (0). A ``"chunk_snapshot"`` is refused: its record keeps the elements of the chunks
    its step flagged (:func:`~sofx.undo_record.chunk_snapshot_bytes`), which the strategy does not say (it counted as
    0 bytes). The state's moments must have the structure of ``param`` (a StructureError naming the first difference:
    the leaves were zipped unchecked, a shorter state's sum truncated), and a moment read must be a tensor."""
    if not isinstance(state, AdamState):
        raise LeafError(not_an_adam_state(state))
    if strategy not in STRATEGIES:
        raise SofxError(f"snapshot_bytes_of: strategy {strategy!r:.80} is none of {STRATEGIES} (an undo record's)")
    if strategy == "chunk_snapshot":
        raise SofxError("snapshot_bytes_of: a 'chunk_snapshot' record's bytes depend on the chunks its step flagged, "
                        "which the strategy does not say: count them with sofx.undo_record.chunk_snapshot_bytes, or "
                        "the record's snapshot_bytes()")
    p_leaves, spec = tree.flatten(param)
    mus = tree.flatten_up_to(spec, state.mu, "state.mu", root="param")
    nus = tree.flatten_up_to(spec, state.nu, "state.nu", root="param")
    if strategy in ("none", "algebraic"):
        return 0
    for what, ts in (("param", p_leaves), ("state.mu", mus), ("state.nu", nus)):
        for path, t in zip(tree.leaf_paths(spec, root=what), ts):
            if not isinstance(t, torch.Tensor):
                raise LeafError(f"snapshot_bytes_of: {path}: expected a tensor, got {type(t).__name__}")
    return sum(strategy_snapshot_bytes(strategy, p, m, v) for p, m, v in zip(p_leaves, mus, nus))


def block_eligibility(opt: Adam, param: torch.Tensor, grad: torch.Tensor, state: AdamState,
                      hparams: AdamHParams, grad_scale: float, grads_finite: bool | None = None) -> Eligibility:
    """Whether a speculative step of this block could be undone, and at what snapshot cost.

    The strategy is the one :meth:`sofx.Adam.update` would choose for these
    inputs (:meth:`sofx.Adam.undo_strategies`): algebraic (free),
    param_snapshot or snapshot (costs memory), or none / refused (ineligible).
    Bad inputs raise as ``update`` would. A tree block (a list of leaves) is ineligible where one of its leaves
    is, else its costliest leaf's strategy, with the sum of the leaves' snapshot bytes. ``grads_finite``: the hint of
    :meth:`sofx.Adam.update` (True when the caller knows every element of
    ``grad`` is finite, e.g. from its sum of squares: it is not read again).
    """
    check_opt(opt)
    # (the caller's own argument, read first: refused inside the strategies' planning, it came back as the block's
    # Eligibility(False, reason="grads_finite = 'no' is invalid ..."), the block stepped late without a raise)
    grads_finite = validate_grads_finite(grads_finite)
    try:
        plans = opt.undo_strategies(param, grad, state, hparams, grad_scale=grad_scale, grads_finite=grads_finite)
    except UnsupportedError as exc:
        return Eligibility(False, None, str(exc), 0)
    # A tree block (speculative_block_step takes one) combines its leaves (it raised a bare ValueError unpacking
    # their plans, and a bare AttributeError taking a list's numel); a leaf without gradient counts for nothing.
    combined = combine_eligibilities(_leaf_eligibility(plan, p, m, v) for plan, p, m, v in
                                     zip(plans, tree.leaves(param), tree.leaves(state.mu), tree.leaves(state.nu))
                                     if plan is not None)
    return Eligibility(False, None, "no gradient", 0) if combined is None else combined


def _leaf_eligibility(plan: tuple[str, str | None], p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> Eligibility:
    """One leaf's :class:`Eligibility` from its undo plan (``Adam.undo_strategies``' strategy and reason)."""
    strategy, reason = plan
    if strategy == "none":
        return Eligibility(False, strategy, reason or "the step cannot be undone", 0)
    return Eligibility(True, strategy, reason or "", strategy_snapshot_bytes(strategy, p, m, v))


def combine_eligibilities(leaves: Iterable[Eligibility]) -> Eligibility | None:
    """A block's :class:`Eligibility` from its leaves' (read in order, up to the first ineligible one, which is the
    block's): else eligible with the costliest leaf's strategy, the leaves' reasons (each once) and the sum of their
    snapshot bytes; ``None`` where there is no leaf. An eligible leaf whose strategy is none an undo record can be
    undone by (None, ``"none"``, an unknown string: taken as "algebraic" before, the block's strategy then depending
    on its leaves' order, or None for the block, which the offload engine took for an eligible "algebraic" one) is
    refused, a :class:`~sofx.errors.SofxError` naming the leaf."""
    strategy, reasons, nbytes = None, [], 0
    for i, el in enumerate(leaves):
        if not el.eligible:
            return el
        cost = _STRATEGY_COST.get(el.strategy) if isinstance(el.strategy, str) else None
        if cost is None:
            raise SofxError(f"combine_eligibilities: leaf {i}: an eligible leaf's strategy = {el.strategy!r:.80} is "
                            f"none of {tuple(_STRATEGY_COST)} (the undo records' that can be undone)")
        if strategy is None or cost > _STRATEGY_COST[strategy]:
            strategy = el.strategy
        if el.reason:
            reasons.append(el.reason)
        nbytes += el.snapshot_bytes
    return None if strategy is None else Eligibility(True, strategy, "; ".join(dict.fromkeys(reasons)), nbytes)


def speculative_block_step(opt: Adam, param: torch.Tensor, grad: torch.Tensor, state: AdamState,
                           decision: BlockDecision, *, donate: bool = False, grads_finite: bool | None = None,
                           param_copies: Any = None, held_bytes: int = 0,
                           ctx: StepContext | None = None) -> tuple[torch.Tensor, AdamState, UndoRecord]:
    """The speculative step: ``opt.update`` with the decision's hparams and ``grad_scale = 1/S_assumed`` (the
    context's multiplier: GradScaler's ``float32(1/S)`` under ``"torch"``).

    Returns ``(param, state, record)``; keep ``record`` (and do not modify
    ``grad`` in place) until validation has applied this block's action. A ``grad`` without any tensor (``None``)
    is refused: the step would take nothing, and validation commit it.
    ``held_bytes``: the snapshot memory the speculative steps of this step
    hold already (their records' ``snapshot_bytes()``). With a snapshot budget
    the record may hold what is left of it: a step that would keep more raises
    :class:`~sofx.errors.SnapshotLimitError` having changed nothing (taken back
    where it found the need itself); record that with
    :func:`~sofx.speculation.decisions.on_speculation_refused`, and the block is
    stepped in validation.
    A decision whose speculative step was taken already (by this call or with a copy of it) is refused, nothing
    written (:class:`~sofx.speculation.decisions.BlockDecision`), and so is a pickled copy loaded in the process that
    pickled it. ``ctx``: the step's context (:func:`begin_step`'s);
    given, a decision of another step (its ``context_id`` another, not ``0``: kept from an earlier step, never used
    there) is refused, naming both steps, nothing written (without it such a step is taken, and only
    :func:`apply_block_action` refuses its record, the block stepped with the earlier step's hparams meanwhile).
    ``grads_finite``: :meth:`sofx.Adam.update`'s hint -- pass ``True`` when the
    decision's sum of squares was taken on these very gradient values (it was
    finite, or the block would not have been speculated). ``param_copies``: :meth:`sofx.Adam.update`'s
    (second buffers that also receive the new parameters).
    """
    check_opt(opt)
    if not isinstance(decision, BlockDecision):
        raise SofxError(f"speculative_block_step: decision is {tree.article(type(decision).__name__)}; expected the "
                        "BlockDecision on_block_ready returned for the block")
    speculate = decision.speculate
    if speculate is not True and speculate is not False:  # (one made by hand: "no" took the step)
        speculate = flag(f"speculative_block_step: block {decision.block}: decision.speculate", speculate, SofxError)
    if not speculate:
        raise SofxError(f"block {decision.block} was not chosen for speculation ({decision.kind}: {decision.reason})")
    if ctx is not None:
        if not isinstance(ctx, StepContext):
            raise SofxError(f"speculative_block_step: ctx is {tree.article(type(ctx).__name__)}; expected the "
                            "StepContext begin_step made for this step (ctx, tally = begin_step(...)), or None")
        made = decision.context_id
        if made and made != ctx.context_id:
            raise SofxError(f"speculative_block_step: block {decision.block}: the decision is of another step "
                            f"(context_id {made}) than ctx's (context_id {ctx.context_id}): a decision kept from an "
                            "earlier step, whose hparams and multiplier this step's validation does not check; use "
                            "the one on_block_ready returned this step. Nothing was written")
    if not tree.leaves(grad):
        # (Adam leaves a leaf without gradient as it is: the step took nothing, and validation committed it)
        raise SofxError(f"speculative_block_step: block {decision.block}: grad has no gradient (no tensor in it: "
                        f"{type(grad).__name__}); the decision was made from the block's gradient (its sum of "
                        "squares): pass that gradient. Nothing was written")
    used = decision.used_cell()
    if used[0]:
        raise SofxError(f"speculative_block_step: block {decision.block}: its decision was used already for a "
                        "speculative step (of its own step: a decision kept from an earlier step, or a retry): a "
                        "decision is one speculative step of one step; use the one on_block_ready returned this "
                        "step. Nothing was written")
    if decision.pickled_here():
        raise SofxError(f"speculative_block_step: block {decision.block}: the decision is a pickled copy, loaded in "
                        "the process that pickled it: it shares no marker with the original (whose step it would "
                        "take again); use the decision on_block_ready returned. Nothing was written")
    if not (type(held_bytes) is int and held_bytes >= 0):  # (the common case first: the engine's count)
        # a Python int >= 0 (a str or None raised Python's bare TypeError where a budget is set, a float an error
        # naming snapshot_limit_bytes, which the caller did not pass, and a negative count raised the limit past it)
        held_bytes = integer("speculative_block_step: held_bytes", held_bytes, 0, SofxError)
    budget = decision.snapshot_budget_bytes
    if budget is not None and not (type(budget) is int and budget >= 0):
        # (a decision made by hand: a str raised Python's bare TypeError below, -3 and True were budgets of 0 and 1)
        budget = integer("speculative_block_step: decision.snapshot_budget_bytes", budget, 0, SofxError)
    limit = None if budget is None else max(0, budget - held_bytes)
    new_param, new_state, record = opt.update(param, grad, state, decision.hparams, grad_scale=decision.grad_scale,
                                              donate=donate, grads_finite=grads_finite, param_copies=param_copies,
                                              snapshot_limit_bytes=limit)
    used[0] = True  # (after the step: one taken back, SnapshotLimitError, wrote nothing)
    # (whose step it is: apply_block_action refuses it with another block's action, or another step's)
    record.block, record.context_id = decision.block, decision.context_id
    record.param_ptrs = _param_ptrs(new_param)  # (where its params are: apply_block_action refuses other tensors)
    return new_param, new_state, record


def _param_ptrs(param: Any) -> tuple[int, ...] | None:
    """Where ``param``'s tensors lie: their sorted data pointers (a view's includes its offset; sorted, so that the
    same tensors in another key order match), or ``None`` where one cannot be read (a tensor of a ``torch.func``
    transform, a meta tensor, a tensor subclass such as a fake tensor, while ``torch.compile`` traces): nothing
    to check then."""
    if torch.compiler.is_compiling():
        return None
    out = []
    for leaf in tree.flatten(param)[0] if not isinstance(param, torch.Tensor) else (param,):
        if type(leaf) not in (torch.Tensor, torch.nn.Parameter) or leaf.is_meta:
            return None
        try:
            out.append(leaf.data_ptr())
        except (RuntimeError, NotImplementedError):  # (no storage: a functorch wrapper, a fake tensor)
            return None
    return tuple(sorted(out))


def apply_block_action(opt: Adam, action: BlockAction, param: torch.Tensor, grad: torch.Tensor | None,
                       state: AdamState, record: UndoRecord | None = None, *,
                       donate: bool = False, grads_finite: bool | None = None,
                       param_copies: Any = None) -> tuple[torch.Tensor, AdamState]:
    """Carry out one validation action on one block; returns ``(param, state)``.

    ``commit``: nothing to do (the speculative result stands). ``undo_redo``:
    ``opt.undo_redo`` with the final gradient, hparams and multiplier.
    ``undo``: ``opt.undo``. ``step``: ``opt.update`` with the final multiplier
    (a zero gradient when ``action.zero_grad``). ``skip``: nothing.
    ``record`` is the speculative step's record (needed by ``undo`` and ``undo_redo``); one of another
    block's speculative step (:func:`speculative_block_step` notes the block in it) is refused, naming both
    blocks, before anything is written: the tensors and record of block ``i`` go with ``plan.actions[i]``.
    So is the record of a speculative step of another step's decision (:class:`BlockDecision`'s ``context_id``,
    which its record and the plan's actions carry): validation checked this step's decision, not the one the block
    was stepped with. So are params other than those the speculative step left (the record notes where they lie in
    memory, ``UndoRecord.param_ptrs``: views of the same memory pass; a record already used is not checked). Where
    no record is given (a ``step`` or ``skip`` of a block not speculated) nothing tells one block's tensors from
    another's: the caller passes block ``i``'s with ``plan.actions[i]``. So is a ``step`` given a record that was not
    used (a speculative step that stands would be stepped again), a ``skip`` given one (the block would keep the
    step), and a ``commit`` given one that was used (its step was undone: the block would be left without it).
    An ``undo_redo`` without a gradient -- ``grad`` ``None``, or a tree block's with no tensor in it -- is refused,
    nothing written (it would only undo the speculative step); so is a ``step`` (but with ``zero_grad``) given
    ``None``, while a tree block's ``[None, ...]`` is stepped as ``update`` steps it, leaving each leaf without
    gradient as it is (the offload engine's step of a block of frozen parameters).
    ``grads_finite``: :meth:`sofx.Adam.update`'s hint for ``grad`` (``True``
    when the caller took its sum of squares on these very values and it was finite).
    ``param_copies``: :meth:`sofx.Adam.update`'s, written by every action that changes the
    parameters (not by ``commit`` and ``skip``). An action that writes is applied once: a second
    application (of it or a copy, ``action._replace(...)``) is refused, naming the block, nothing written; so is a
    pickled copy loaded in the process that pickled it (it shares no marker with the original).
    """
    check_opt(opt)
    if not isinstance(action, BlockAction):
        raise SofxError(f"apply_block_action: action is {tree.article(type(action).__name__)}; expected one "
                        "BlockAction of a ValidationPlan (plan.actions[i])")
    kind = action.kind
    whose = record.block if isinstance(record, UndoRecord) else None
    if whose is not None and whose != action.block:
        raise SofxError(f"apply_block_action: plan.actions[{action.block}] is block {action.block}'s; the record given "
                        f"is of block {whose}'s speculative step: pass block {action.block}'s tensors and record "
                        f"with its action (plan.actions[i] goes with block i's), nothing was written")
    made = record.context_id if whose is not None else None
    if made and action.context_id and made != action.context_id:
        raise SofxError(f"apply_block_action: block {action.block}: the record given is of a speculative step of "
                        "another step's decision (a BlockDecision of an earlier begin_step, whose hparams and "
                        "multiplier this step's validation did not check): speculate with the decision "
                        "on_block_ready returned this step. Nothing was written; the record's opt.undo takes its "
                        "step back")
    if whose is not None and record.param_ptrs is not None and not record.used:
        given = _param_ptrs(param)
        if given is not None and given != record.param_ptrs:
            raise SofxError(f"apply_block_action: block {action.block}: the params given are not those its "
                            "speculative step left (they lie elsewhere in memory): the record goes with the tensors "
                            f"the step returned or wrote (block {action.block}'s, with plan.actions"
                            f"[{action.block}]), nothing was written")
    if kind == "commit" and isinstance(record, UndoRecord) and record.used:
        raise SofxError(f"apply_block_action: block {action.block}: a commit, but the record given was used (its "
                        "speculative step was undone): the block is without the step the plan commits, and the report "
                        f"counts it committed. A step undone before validation is not taken (taken[{action.block}] "
                        "False): plan_validation then steps the block. Nothing was written")
    if kind == "skip" and isinstance(record, UndoRecord) and not record.used:
        raise SofxError(f"apply_block_action: block {action.block}: a skip, but the record given is of the block's "
                        "speculative step, which stands (it was not undone): the block would keep a step the plan "
                        f"does not take. A step that ran is taken (taken[{action.block}] True, or taken=None): "
                        "plan_validation then commits it, undoes it, or undoes and redoes it. Nothing was written")
    if kind in ("commit", "skip"):
        return param, state
    if kind == "step" and isinstance(record, UndoRecord) and not record.used:
        raise SofxError(f"apply_block_action: block {action.block}: a step action, but the record given is of the "
                        "block's speculative step, which stands (it was not undone): the block would be stepped "
                        f"twice. A step that ran is taken (taken[{action.block}] True, or taken=None): "
                        "plan_validation then commits it or undoes and redoes it. Nothing was written")
    applied = action.applied_cell()
    if applied[0]:
        raise SofxError(f"apply_block_action: block {action.block}: plan.actions[{action.block}] ({kind}) was applied "
                        "already: an action carries its block's step out once (one step per block per step); a "
                        "second application would step the block again. Nothing was written")
    if action.pickled_here():
        raise SofxError(f"apply_block_action: block {action.block}: plan.actions[{action.block}] ({kind}) is a pickled "
                        "copy, loaded in the process that pickled it: it shares no marker with the original (applied, "
                        "or to be applied: the block would be stepped twice); apply the plan's own action. Nothing "
                        "was written")
    new_param, new_state = _apply(opt, action, kind, param, grad, state, record, donate, grads_finite, param_copies)
    applied[0] = True
    return new_param, new_state


def _no_tensor(grad: Any) -> str:
    """What a block's ``grad`` without any tensor is, for the refusals of :func:`_apply` ("" for ``None``): a tree
    of ``None`` leaves was taken, and the action, applied, undid (``undo_redo``) or stepped (``step``) nothing of the
    leaves (Adam leaves a leaf without gradient as it is), as :func:`speculative_block_step` refuses it."""
    return "" if grad is None else f" (grad has no tensor in it: {type(grad).__name__})"


def _apply(opt: Adam, action: BlockAction, kind: str, param: torch.Tensor, grad: torch.Tensor | None,
           state: AdamState, record: UndoRecord | None, donate: bool, grads_finite: bool | None,
           param_copies: Any) -> tuple[torch.Tensor, AdamState]:
    """:func:`apply_block_action` of an action that writes (``undo``, ``undo_redo``, ``step``)."""
    if kind in ("undo", "undo_redo") and record is None:
        raise SofxError(f"block {action.block}: {kind} needs the record of its speculative step")
    if kind == "undo":
        return opt.undo(param, state, record, donate=donate, param_copies=param_copies)
    if kind == "undo_redo":
        if not tree.leaves(grad):
            raise SofxError(f"block {action.block}: undo_redo needs the block's final gradient{_no_tensor(grad)}")
        new_param, new_state, _ = opt.undo_redo(param, state, record, grad, action.hparams,
                                                grad_scale=action.grad_scale, donate=donate,
                                                grads_finite=grads_finite, param_copies=param_copies,
                                                undoable=False)
        return new_param, new_state
    if kind == "step":
        zero_grad = action.zero_grad
        if zero_grad is not False and zero_grad is not True:  # (one made by hand: "no" stepped zeros in place of grad)
            zero_grad = flag(f"apply_block_action: block {action.block}: action.zero_grad", zero_grad, SofxError)
        if zero_grad:  # (each leaf of a tree block; what is no tensor is left for update to refuse)
            grad = tree.tree_map(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, param)
            grads_finite = True
        elif grad is None:  # (a tree block's with no tensor is taken: the engine steps a frozen group's block so)
            raise SofxError(f"block {action.block}: step needs the block's final gradient")
        new_param, new_state, _ = opt.update(param, grad, state, action.hparams, grad_scale=action.grad_scale,
                                             donate=donate, grads_finite=grads_finite, param_copies=param_copies,
                                             undoable=False)
        return new_param, new_state
    raise SofxError(f"block {action.block}: unknown action {kind!r}")
