"""One speculative step over a whole params pytree, inline: the pure combinator.

:func:`speculative_step` drives the block protocol of :mod:`sofx.speculate`
exactly as an engine would, in one thread: every leaf is a block, gradients
"arrive" in ``order`` (reverse leaf order by default, as in backward), each
ready block is speculated or not, late gradients are summed in, then the step
is validated and the actions applied. It returns what
:func:`sofx.serial.serial_step` returns for the same inputs (bitwise where no
block was undone), plus the :class:`~sofx.step_report.StepReport`.
"""

from __future__ import annotations

import math
import numbers

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from sofx import tree
from sofx.adam import Adam, AdamState, not_an_adam_state
from sofx.errors import HParamError, LeafError, SnapshotLimitError, SofxError, StructureError
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.kernels.user_numbers import is_bool
from sofx.loss_scale import LossScaler, LossScaleState
from sofx.required import REQUIRED
from sofx.serial import (_FROM_LOOP, LoopState, _keyword_names, _missing, _positional_names, call_reduce,
                         check_loop, check_opt, check_reduce_sumsq, hparams_at, refuse_reduce,
                         refuse_unknown_keywords, with_loop_settings)
from sofx.speculation.apply import apply_block_action, block_eligibility, speculative_block_step
from sofx.speculation.decisions import (
    SpeculationConfig,
    ValidationPlan,
    begin_step,
    on_block_ready,
    on_late_gradient,
    on_speculation_held,
    on_speculation_refused,
    plan_validation,
)
from sofx.speculation.policy import PolicyState
from sofx.step_report import StepReport
from sofx.transforms import _sumsq

__all__ = ["SpeculativeStepResult", "speculative_step", "speculative_loop_step"]

_SAME = object()


class SpeculativeStepResult(NamedTuple):
    """New params, Adam state, loss-scaler state, policy state, the report and the validation plan."""

    params: Any
    state: AdamState
    scaler_state: LossScaleState
    policy_state: PolicyState
    report: StepReport
    plan: ValidationPlan


def speculative_step(opt: Adam = REQUIRED, params: Any = REQUIRED, grads: Any = REQUIRED,
                     state: AdamState = REQUIRED, *extra: Any, config: SpeculationConfig = REQUIRED,
                     scaler: LossScaler = REQUIRED,
                     scaler_state: LossScaleState = REQUIRED, policy_state: PolicyState | None = None,
                     hparams: Any = None, validation_hparams: Any = _SAME, backward_scale: float | None = None,
                     order: Sequence[int | str] | None = None,
                     late_grads: Mapping[int | str, torch.Tensor] | None = None, last_micro_step: bool = True,
                     reduce_sumsq: Callable[[float], float] | None = None,
                     donate: bool = False, **unknown: Any) -> SpeculativeStepResult:
    """Speculate, validate and apply one step; every leaf of ``params`` is a block.

    ``grads``: raw (loss-scaled) gradients with the structure of ``params``
    (``None``: no gradient). ``hparams``: the hparams assumed during backward
    (an :class:`~sofx.AdamHParams` prefix tree); ``validation_hparams``: those
    in force at validation (default: the same). ``order``: the leaves in
    arrival order (default: reversed). ``late_grads[i]``: a further gradient
    for leaf ``i`` arriving after the leaf was ready (summed out of place; the
    final gradient of leaf ``i`` is ``grads_i + late_grads[i]``).

    A leaf is named by its index or its path. Leaf ``i`` is the ``i``-th leaf
    in optree's flatten order, the order of ``sofx.tree.leaf_paths(params)``
    (and of ``report.actions`` and ``plan.actions``): a dict's keys *sorted*,
    not in insertion order, so for ``{"w": .., "b": ..}`` (as
    ``model.named_parameters()`` lists a layer) leaf 0 is ``b``; an
    ``OrderedDict`` keeps its order. Or name it by its path as
    ``sofx.tree.leaf_paths(params)`` writes it (``"params['w']"``), in
    ``order`` and as a key of ``late_grads`` (or, for a leaf at the top of a
    dict, by its key alone: ``"w"``, ``"0.weight"`` of
    ``dict(model.named_parameters())``): a string that names no leaf is
    refused (naming the path it likely meant), and so are two keys naming one
    leaf and a late gradient of another shape, dtype or device than the leaf's
    gradient (naming both). An int is always an index: one that is also the key
    of another leaf at the top of a dict (``1`` of ``{1: a, 2: b}``, whose leaf 1
    is ``params[2]``) is refused, naming both; name such a leaf by its path
    (``"params[1]"``).
    ``backward_scale``: the scale the loss was multiplied by (default: the
    scaler's). Raises :class:`~sofx.loss_scale.MinLossScaleError` after undoing
    every speculative step when DeepSpeed's scaler gives up, and a
    :class:`~sofx.loss_scale.LossScaleRuleError` after undoing them where the
    rule's ``scale`` or ``update`` fails (a custom rule's exception, its cause).

    Without ``donate`` the inputs are never modified, so a block validation
    undoes is returned as its input (bitwise) and one it undoes and redoes is
    stepped from its input: the result is :func:`~sofx.serial.serial_step`'s
    bit for bit whatever happened (with ``donate``, algebraic undos are exact
    to a few ulps, see :mod:`sofx.undo_record`).

    Bad input raises before any leaf is stepped, naming the leaf: as
    :func:`~sofx.serial.serial_step` refuses it with the validation hparams
    (``undo='algebraic'`` where the inverse does not exist included; with
    ``missing_grad="zero"``, a leaf without a gradient too). A leaf whose
    speculative step ``undo='algebraic'`` refuses only with the speculation
    hparams is not speculated (stepped in validation). A rank that refuses
    before the reduction tells the others through ``reduce_sumsq``
    (:func:`~sofx.serial.refuse_reduce`), whose hook then raises there too; a keyword it does not take, a
    required argument (``opt``, ``params``, ``grads``, ``state``, ``config``, ``scaler``, ``scaler_state``:
    ``<required>``) left out or misspelt (``stat=``), or a positional argument too many, is refused so
    (:func:`~sofx.serial.refuse_unknown_keywords`) before anything runs.
    """
    missing = _missing(opt=opt, params=params, grads=grads, state=state, config=config, scaler=scaler,
                       scaler_state=scaler_state)
    if unknown or missing or extra:
        refuse_unknown_keywords("speculative_step", unknown, _keyword_names(speculative_step), reduce_sumsq,
                                loop=False, missing=missing, extra=extra,
                                positional=_positional_names(speculative_step))
    check_reduce_sumsq(reduce_sumsq)
    noted = None if reduce_sumsq is None else _NotedReduce(reduce_sumsq)
    try:
        return _speculative_step(opt, params, grads, state, config=config, scaler=scaler,
                                 scaler_state=scaler_state, policy_state=policy_state, hparams=hparams,
                                 validation_hparams=validation_hparams, backward_scale=backward_scale, order=order,
                                 late_grads=late_grads, last_micro_step=last_micro_step, reduce_sumsq=noted,
                                 donate=donate)
    except Exception as exc:
        if noted is not None and not noted.called:
            refuse_reduce(reduce_sumsq, exc)
        raise


class _NotedReduce:
    """The ``reduce_sumsq`` hook as :func:`speculative_step` passes it on, noting whether it was called (a failure
    after it must not refuse the step: the other ranks are past the reduction). It passes the step's settings on
    to a hook that compares them (:func:`sofx.serial.call_reduce`)."""

    def __init__(self, hook: Callable[[float], float]) -> None:
        self.hook = hook
        self.called = False

    def __call__(self, local: float) -> Any:
        return self.agreed_sum(local, None)

    def agreed_sum(self, local: float, settings: Mapping[str, Any] | None) -> Any:
        self.called = True
        return call_reduce(self.hook, local, settings)


def _speculative_step(opt: Adam, params: Any, grads: Any, state: AdamState, *, config: SpeculationConfig,
                      scaler: LossScaler, scaler_state: LossScaleState, policy_state: PolicyState | None,
                      hparams: Any, validation_hparams: Any, backward_scale: float | None,
                      order: Sequence[int | str] | None, late_grads: Mapping[int | str, torch.Tensor] | None,
                      last_micro_step: bool, reduce_sumsq: Callable[[float], float] | None,
                      donate: bool) -> SpeculativeStepResult:
    _check_step_inputs(opt, params, grads, state, config, hparams, validation_hparams, donate)
    p_leaves, spec = tree.flatten(params)
    n = len(p_leaves)
    g_leaves = list(tree.flatten_up_to(spec, grads, "grads")) if grads is not None else [None] * n
    if not isinstance(state, AdamState):
        raise LeafError(not_an_adam_state(state))
    counts = tree.flatten_up_to(spec, state.count, "state.count")
    mus = tree.flatten_up_to(spec, state.mu, "state.mu")
    nus = tree.flatten_up_to(spec, state.nu, "state.nu")
    block_states = [AdamState(c, m, v) for c, m, v in zip(counts, mus, nus)]
    input_states = list(block_states)
    hps = opt.resolve_hparams(hparams, spec)
    final_hps = hps if validation_hparams is _SAME else opt.resolve_hparams(validation_hparams, spec)
    given = order
    paths: list[str] | None = None  # (built only where a leaf is named by its path)
    by_path: dict[str, list[int]] = {}  # each path's leaf indices (tree.named_leaves' table)
    keyed_top = isinstance(spec.type, type) and issubclass(spec.type, dict)  # (only a dict's int keys are keys)

    def index_of(key: Any, where: str) -> Any:
        """``key`` as a leaf index where it names a leaf of params (a str: its path, or the key of a leaf at the
        top of a dict, ``'w'`` for ``params['w']``, as :func:`sofx.checkpoint.groups.resolve_groups` names leaves), else
        ``key`` as given. An int is an index; one that is also the key of a leaf at the top of a dict of int keys,
        another leaf than the one it indexes (``1`` of ``{1: a, 2: b}``), is refused (:func:`_refuse_key_as_index`);
        a list's or tuple's position is no key (``2`` of ``[a, [b, c], d]`` is leaf 2, ``params[1][1]``)."""
        nonlocal paths
        if not isinstance(key, str) and not (_is_index(key) and keyed_top):  # (a list's positions are no keys)
            return key
        if paths is None:
            paths = tree.leaf_paths(spec)
            by_path.update(tree.paths_index(paths))
        if not isinstance(key, str):
            _refuse_key_as_index(key, where, paths, by_path)
            return key
        named = tree.named_leaves(by_path, key)
        if len(named) > 1:  # (a key written as another leaf's path)
            listed = ", ".join(f"{i}: {paths[i]}" for i in named)
            raise SofxError(f"{where}: {key!r:.80} names {len(named)} leaves of params ({listed}); name it by its "
                            "index")
        if not named:
            raise SofxError(f"{where}: {key!r:.80} is not a leaf path of params{_path_hint(key, paths)}")
        return named[0]

    try:
        order = list(range(n - 1, -1, -1)) if order is None else list(order)
    except TypeError:  # (not iterable: order=5, and order=0 is no permutation of one leaf either)
        order = None
    if given is not None and order is not None and not isinstance(given, str):  # (a str is no sequence of paths)
        order = [index_of(i, f"order[{k}]") for k, i in enumerate(order)]
    if order is None or not all(_is_index(i) for i in order) or sorted(order) != list(range(n)):
        raise SofxError(f"order must be a permutation of the {n} leaf indices (ints), got {given!r:.80}"
                        + (" (a str as a leaf path names one leaf: pass a list of paths)" if isinstance(given, str)
                           else ""))
    order = [int(i) for i in order]
    if late_grads is not None and not isinstance(late_grads, Mapping):  # (a list went through dict())
        raise SofxError(f"late_grads is {tree.article(type(late_grads).__name__)}; expected a mapping "
                        "{leaf index or path: tensor} (a further gradient for a leaf that already has one), or None")
    late: dict[int, tuple[Any, Any]] = {}  # leaf index -> (the key given, the further gradient)
    for key, extra in (late_grads or {}).items():
        i = index_of(key, f"late_grads[{key!r:.80}]")
        if not (_is_index(i) and 0 <= i < n) or g_leaves[int(i)] is None:
            raise SofxError(f"late_grads[{key!r}]: a late gradient needs a leaf (an int index or a leaf path) that "
                            "already has a gradient")
        # (numpy integers hash and compare as the Python ints they are: no two int keys name one leaf)
        if int(i) in late:
            other = late[int(i)][0]
            raise SofxError(f"late_grads[{other!r}] and late_grads[{key!r}] both name "
                            f"{tree.leaf_paths(spec)[int(i)]}: give one late gradient per leaf (their sum)")
        late[int(i)] = (key, extra)
    late_grads = {i: extra for i, (_, extra) in late.items()}
    for i, (key, extra) in late.items():
        g = g_leaves[i]
        if not isinstance(extra, torch.Tensor) or extra.shape != g.shape or extra.dtype != g.dtype \
                or extra.device != g.device:
            got = (f"shape {tuple(extra.shape)}, dtype {extra.dtype}, device {extra.device}"
                   if isinstance(extra, torch.Tensor) else type(extra).__name__)
            raise LeafError(f"late_grads[{key!r}]: expected a tensor like the leaf's gradient (grads of "
                            f"{tree.leaf_paths(spec)[i]}: shape {tuple(g.shape)}, dtype {g.dtype}, device "
                            f"{g.device}), got {got}")
        if not in_storage(extra):  # (freed or shrunk: added to the gradient after the leaves were stepped)
            refuse_short_storage(extra, f"late_grads[{key!r}]")

    # stepped: a leaf with a gradient, or any with missing_grad="zero" (a leaf without gradient is not stepped
    # otherwise, and its hparams are not read: they veto no other leaf's speculation)
    zero = config.missing_grad == "zero"
    ctx, tally = begin_step(opt, config, scaler, scaler_state, policy_state, n_blocks=n, hparams=list(hps),
                            backward_scale=backward_scale, last_micro_step=last_micro_step,
                            float64=[isinstance(p, torch.Tensor) and p.dtype == torch.float64 for p in p_leaves],
                            stepped=[zero or g is not None for g in g_leaves])
    new_p = list(p_leaves)
    records: list[Any] = [None] * n
    held = 0  # snapshot bytes the speculative steps' records hold
    try:
        for i in order:
            g = g_leaves[i]
            if g is None:
                continue

            def eligibility(i: int = i, g: torch.Tensor = g) -> Any:
                # Asked only when the sum of squares of g is finite, i.e. every element is.
                return block_eligibility(opt, new_p[i], g, block_states[i], ctx.hparams[i], ctx.grad_scale,
                                         grads_finite=True)

            # (g's storage checked by _check_step_inputs: transforms.sumsq, grad_sumsq, would check it again)
            tally, decision = on_block_ready(ctx, tally, i, _sumsq(g), eligibility)
            if decision.speculate:
                # Speculated only with a finite sum of squares of this very gradient: every element is finite.
                try:
                    new_p[i], block_states[i], records[i] = speculative_block_step(
                        opt, new_p[i], g, block_states[i], decision, donate=donate, grads_finite=True,
                        held_bytes=held, ctx=ctx)
                except SnapshotLimitError as exc:  # taken back: its snapshot would go beyond the budget
                    tally = on_speculation_refused(ctx, tally, i, str(exc))
                    continue
                held += records[i].snapshot_bytes()
                tally = on_speculation_held(ctx, tally, i, records[i].snapshot_bytes())
        for i, extra in late_grads.items():
            g_leaves[i] = g_leaves[i] + extra  # out of place: the record keeps the old gradient
            tally = on_late_gradient(ctx, tally, i, _sumsq(g_leaves[i]))  # (a new tensor)

        final = [None if g is None else tally.block_sumsq[i] for i, g in enumerate(g_leaves)]
        plan = plan_validation(ctx, tally, final, hparams=list(final_hps), reduce_sumsq=reduce_sumsq)
    except BaseException:
        # A failure before validation decided (reduce_sumsq's all-reduce, say): the speculative steps written in
        # place are undone (to a few ulps where the inverse is algebraic), so that the state is the one passed in,
        # as after serial_step's failures. (Without donation the inputs were never written.)
        if donate:
            for i in reversed(order):
                if records[i] is not None:
                    new_p[i], block_states[i] = opt.undo(new_p[i], block_states[i], records[i], donate=True)
        raise
    for i, action in enumerate(plan.actions):
        finite = final[i] is not None and math.isfinite(final[i])  # this block's own gradient, as Adam reads it
        record = records[i]
        if not donate and action.kind in ("undo", "undo_redo"):
            # The inputs are untouched: the undone block is the input itself (bitwise, where an algebraic undo
            # is a few ulps off), and its redo a plain step from it (no inverse computed).
            new_p[i], block_states[i], record = p_leaves[i], input_states[i], None
            action = action._replace(kind="skip" if action.kind == "undo" else "step")
        new_p[i], block_states[i] = apply_block_action(opt, action, new_p[i], g_leaves[i], block_states[i],
                                                       record, donate=donate, grads_finite=finite or None)
    if plan.error is not None:
        raise plan.error
    new_state = AdamState(tree.unflatten(spec, [s.count for s in block_states]),
                          tree.unflatten(spec, [s.mu for s in block_states]),
                          tree.unflatten(spec, [s.nu for s in block_states]))
    return SpeculativeStepResult(tree.unflatten(spec, new_p), new_state, plan.scaler_state, plan.policy_state,
                                 plan.report, plan)


def _path_hint(key: str, paths: Sequence[str]) -> str:
    """For a str that is not a leaf path of params: the path it most likely meant (a dict key given alone, ``'w'``
    for ``"params['w']"``; the path with other quotes or root), else the first paths."""
    def plain(text: str) -> str:
        return text.replace('"', "'").replace(" ", "")

    meant = [p for p in paths if p.endswith(f"[{key!r}]") or plain(p) == plain(key)
             or plain(p).partition("[")[1:] == plain(key).partition("[")[1:] != ("", "")]
    if len(meant) == 1:
        return f" (as sofx.tree.leaf_paths(params) writes them): did you mean {meant[0]!r}?"
    listed = ", ".join(repr(p) for p in paths[:4]) + (f", ... ({len(paths)} leaves)" if len(paths) > 4 else "")
    return f" (as sofx.tree.leaf_paths(params) writes them: {listed})"


def _refuse_key_as_index(key: Any, where: str, paths: Sequence[str], by_path: Mapping[str, Sequence[int]]) -> None:
    """Refuse (a :class:`SofxError` naming ``where``, the leaves and their paths) an int ``key`` (a leaf index, in
    optree's flatten order) that is also the key of a leaf at the top of a dict, another leaf than the one it
    indexes: ``1`` of ``{1: a, 2: b}`` (leaf 1 is ``params[2]``), ``0`` of ``OrderedDict([(1, a), (0, b)])``. Read as
    the index, it gave a late gradient of the same shape to the other leaf, without a word."""
    i = int(key)
    keyed = tree.named_leaves(by_path, f"params[{i!r}]")
    if not keyed or keyed == [i]:
        return
    named = paths[keyed[0]]
    if 0 <= i < len(paths):
        read = f"is a leaf index (leaf {i}: {paths[i]}) and"
        both = f"{named!r} or {paths[i]!r}"
    else:
        read = f"is no leaf index (params has {len(paths)} leaves) but"
        both = repr(named)
    raise SofxError(f"{where}: {i} {read} the key of {named} (leaf {keyed[0]}): an int is a leaf index, in the order "
                    f"of sofx.tree.leaf_paths(params); name the leaf by its path ({both})")


def _is_index(i: Any) -> bool:
    """A leaf index: a Python or numpy integer (an index taken from an array, as ``on_block_ready`` takes block
    ids), not a bool (the block protocol refuses ``True``/``False``, numpy's too, as block ids)."""
    return isinstance(i, numbers.Integral) and not is_bool(i)


def _check_step_inputs(opt: Adam, params: Any, grads: Any, state: AdamState, config: SpeculationConfig,
                       hparams: Any, validation_hparams: Any, donate: bool) -> None:
    """Refuse what any of the step's calls of ``opt`` would refuse, before any leaf is stepped (they are
    stepped one call each, as they "arrive", in place with ``donate``): the leaves with the speculation
    hparams, and as :func:`sofx.serial.serial_step` checks them, with the validation hparams (a missing
    gradient stepped with zeros included; ``undo='algebraic'`` where its inverse does not exist). A
    leaf refused only with the speculation hparams is not speculated (stepped in validation)."""
    check_opt(opt)
    if not isinstance(config, SpeculationConfig):
        raise HParamError(f"config must be a SpeculationConfig, got {type(config).__name__}")
    zero = config.missing_grad == "zero"
    same = validation_hparams is _SAME
    opt.check_inputs(params, grads, state, hparams, donate=donate, zero_missing=zero and same, check_undo=same)
    if not same:
        try:
            opt.check_inputs(params, grads, state, validation_hparams, zero_missing=zero)
        except (HParamError, StructureError) as exc:
            if type(exc) not in (HParamError, StructureError):
                raise
            # the values or the structure of the validation hparams, which the optimizer calls "hparams", as those
            # given as hparams= (checked above); its other refusals (undo='algebraic' here) concern the leaves
            raise type(exc)(f"validation_hparams: {exc}") from None


# what speculative_loop_step takes: speculative_step's keywords but those it takes from the LoopState
_LOOP_KEYWORDS = _keyword_names(speculative_step, leave_out=tuple(_FROM_LOOP))


def speculative_loop_step(opt: Adam = REQUIRED, loop: LoopState = REQUIRED, grads: Any = REQUIRED, *extra: Any,
                          config: SpeculationConfig = REQUIRED, scaler: LossScaler = REQUIRED, hparams: Any = None,
                          **kwargs: Any) -> tuple[LoopState, StepReport]:
    """:func:`speculative_step` on a :class:`~sofx.serial.LoopState` (the speculative twin of
    :func:`sofx.serial.serial_loop_step`).

    ``hparams`` may be a schedule ``step -> hparams``, evaluated at ``loop.step``, and so may
    ``validation_hparams`` (the hparams in force at validation, see :func:`speculative_step`);
    ``loop.step`` advances only when the step was not skipped, and the policy
    state travels in ``loop.policy_state``; a hook that compares the ranks' step settings also compares
    ``loop.step`` (:func:`sofx.serial.with_loop_settings`). ``opt``, ``loop``, ``grads``, ``config`` and
    ``scaler`` are required (``<required>``). ``kwargs`` go to :func:`speculative_step`; one it does not take
    (or one the loop takes from ``loop``, ``scaler_state=``), a required argument left out or misspelt
    (``lop=``), or a positional argument too many, is refused before anything runs
    (:func:`sofx.serial.refuse_unknown_keywords`).
    """
    refuse_unknown_keywords("speculative_loop_step", {k: v for k, v in kwargs.items() if k not in _LOOP_KEYWORDS},
                            _LOOP_KEYWORDS, kwargs.get("reduce_sumsq"),
                            missing=_missing(opt=opt, loop=loop, grads=grads, config=config, scaler=scaler),
                            extra=extra, positional=_positional_names(speculative_loop_step))
    try:
        step = check_loop(loop)
        check_opt(opt)  # (before the schedule runs)
        hp = hparams_at(hparams, step)
        if "validation_hparams" in kwargs:
            kwargs = {**kwargs, "validation_hparams": hparams_at(kwargs["validation_hparams"], step,
                                                                 "validation_hparams")}
    except Exception as exc:  # a schedule's failure: refused before the reduction, as speculative_step's
        refuse_reduce(kwargs.get("reduce_sumsq"), exc)
        raise
    if "reduce_sumsq" in kwargs:
        kwargs["reduce_sumsq"] = with_loop_settings(kwargs["reduce_sumsq"], step)
    res = speculative_step(opt, loop.params, grads, loop.opt_state, config=config, scaler=scaler,
                           scaler_state=loop.scaler_state, policy_state=loop.policy_state, hparams=hp, **kwargs)
    new = LoopState(res.params, res.state, res.scaler_state, step + (not res.report.skipped), res.policy_state)
    return new, res.report
