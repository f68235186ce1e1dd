"""Convert Adam state to and from ``torch.optim.Adam`` / ``AdamW`` state dicts.

::

    sd = to_torch_optim(opt, state, hparams)             # torch_opt.load_state_dict(sd) continues the run
    state, hparams = from_torch_optim(opt, torch_opt.state_dict(), params, hparams)

The parameter numbering of torch.optim (across param groups, in order) is
mapped to the leaves of the params tree as :mod:`sofx.checkpoint.groups`
describes; :func:`torch_param_groups` builds the matching param groups for
constructing a torch optimizer over the params tree's tensors. A run continued
in torch.optim after export, or in sofx after import, is the uninterrupted run
(bitwise: sofx's Adam is torch.optim's operation by operation).

torch.optim keeps no state for a parameter that was never stepped: such
leaves (count 0) are left out on export and come back with count 0 and zero
moments on import. Step counts travel as torch's float32 ``step`` tensors
(exact up to 2**24). Moments come back in the optimizer's ``state_dtype``
(the parameter's dtype when ``None``); torch casts them to the parameter
dtype on ``load_state_dict``. A moment beyond the range of the dtype it is cast
to (a float32 second moment over 65504 for float16) is refused, not made inf:
on import, and on export where ``params=`` gives the parameters' dtypes. Unsupported on either side: ``amsgrad``,
``maximize``, and sofx's ``bias_correction=False`` (torch has no such option).
The state dict of another torch optimizer that keeps Adam's state keys
(``NAdam``, ``RAdam``) is refused by its param groups. torch's ``load_state_dict``
replaces the param groups whole: ``to_torch_optim(..., like=torch_opt)`` keeps
what a torch lr scheduler wrote into them (``initial_lr``, ``OneCycleLR``'s
``max_lr``...) and torch's implementation options, or, given the state dict
``from_torch_optim`` imported, carries them through a round trip.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from typing import Any, Sequence

import optree
import torch

from sofx import tree
from sofx.adam import Adam, AdamHParams, AdamState, refused_torch_option, torch_flag_values, torch_non_flag
from sofx.checkpoint.errors import CheckpointError, CheckpointMismatchError
from sofx.checkpoint.groups import (ParamGroup, check_float32_groups, check_params_template, hparams_tree,
                                    is_saved_flag, refuse_uninitialized, resolve_groups, saved_hparams)
from sofx.checkpoint.io import template_device
from sofx.errors import UnsupportedError
from sofx.kernels.base import as_number, is_numpy_real
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.stored_values import refuse_beyond, refuse_negative
from sofx.warn import caller_stacklevel

__all__ = ["to_torch_optim", "from_torch_optim", "torch_param_groups"]

_EXACT_STEPS = 2 ** 24  # float32 holds every integer up to here


def _check_opt(opt: Adam, what: str) -> None:
    if not isinstance(opt, Adam):
        raise CheckpointError(f"{what}: opt must be a sofx Adam (sofx.adam/sofx.adamw), got {type(opt).__name__}")
    if not opt.variant.bias_correction:
        raise UnsupportedError(f"{what}: torch.optim.Adam always applies bias correction; this optimizer has "
                               "bias_correction=False")


def _torch_group(opt: Adam, g: ParamGroup, first: int) -> dict:
    hp = g.hparams
    return {"lr": hp.lr, "betas": (hp.beta1, hp.beta2), "eps": hp.eps, "weight_decay": hp.weight_decay,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": opt.variant.decoupled,
            "params": list(range(first, first + len(g.leaves)))}


def torch_param_groups(opt: Adam, params: Any, hparams: Any = None, *,
                       groups: Sequence[Sequence[Any]] | None = None) -> list[dict]:
    """Param groups for ``torch.optim.Adam(...)``/``AdamW(...)`` over the leaves of ``params``, in the order
    :func:`to_torch_optim` numbers them given ``params=params`` (with each group's lr, betas, eps and weight_decay).
    Without it, :func:`to_torch_optim` numbers them in ``state.mu``'s order, which is this one where the state was
    made or stepped from ``params`` (not where a mapping's type differs: an ``OrderedDict`` keeps its keys' order,
    a ``dict``'s are sorted). What :func:`to_torch_optim` refuses of ``opt`` is refused here too (no sofx Adam,
    no bias correction), and so is a leaf that is no tensor, naming it."""
    _check_opt(opt, "torch_param_groups")
    leaves, spec = tree.flatten(params)
    for path, p in zip(tree.leaf_paths(spec), leaves):  # (torch.optim refused it later, naming no leaf)
        if not isinstance(p, torch.Tensor):
            raise CheckpointError(f"torch_param_groups: {path}: expected a tensor (a parameter of the torch "
                                  f"optimizer), got {type(p).__name__}")
    out = []
    resolved = resolve_groups(opt, spec, hparams, groups, exported=True)
    check_float32_groups(resolved, leaves, tree.leaf_paths(spec))
    for g in resolved:
        hp = g.hparams
        out.append({"params": [leaves[i] for i in g.leaves], "lr": hp.lr, "betas": (hp.beta1, hp.beta2),
                    "eps": hp.eps, "weight_decay": hp.weight_decay})
    return out


def to_torch_optim(opt: Adam, state: AdamState, hparams: Any = None, *,
                   groups: Sequence[Sequence[Any]] | None = None, params: Any = None, like: Any = None) -> dict:
    """A ``torch.optim.Adam``/``AdamW`` ``state_dict()`` holding ``state`` and the hyperparameters.

    The parameters are numbered in the leaf order of ``params`` where it is given (as :func:`torch_param_groups`
    and :func:`from_torch_optim` number them; the state is matched to it key by key, a
    :class:`~sofx.errors.StructureError` naming the first difference), else of ``state.mu``: the same where the
    state was made or stepped from the params, but a mapping of another type orders its leaves otherwise (an
    ``OrderedDict`` keeps its keys' order, a ``dict``'s are sorted: a dict state of ``OrderedDict`` params puts
    one leaf's moments where the torch optimizer over ``torch_param_groups(opt, params)`` has another).

    The state dict's moments are copies of the state's: torch's ``load_state_dict`` keeps a tensor of its
    parameter's dtype and device as it is, and its steps would then write into ``state``.

    What the export refuses depends on the parameters' dtypes, which ``params=`` gives: an eps or lr float32 cannot
    hold for a group with a leaf that is not float64, and a moment beyond the range of its parameter's dtype, to
    which torch's ``load_state_dict`` casts it (a float32 or bfloat16 second moment over 65504 of float16 params:
    inf there). Without ``params=`` the moments stand for the parameters' dtype only where the optimizer has no
    ``state_dtype``; with one (float64 params may have float32 moments, float16 params bfloat16 ones) neither is
    checked: give ``params=`` for the checks (:func:`from_torch_optim` makes them on import).

    torch's ``load_state_dict`` replaces each param group by the saved one whole, and these groups hold only the
    hparams and Adam's options: what a torch lr scheduler wrote into the torch optimizer's groups (``initial_lr``;
    ``OneCycleLR``'s ``max_lr``, ``min_lr``, ``base_momentum``, ``max_momentum``) and its implementation choices
    (``foreach``, ``fused``, ``capturable``) are gone after it, and such a scheduler's next ``step()`` raises
    ``KeyError: 'initial_lr'``. ``like``: the torch optimizer the state dict is for (or its ``state_dict()``, or
    its ``param_groups``; for a round trip, the state dict :func:`from_torch_optim` imported): each group keeps
    the entries of ``like``'s group of its position but ``params``, the hparams (``lr``, ``betas``, ``eps``,
    ``weight_decay``: the export's) and the options that change the math (``amsgrad``, ``maximize``,
    ``decoupled_weight_decay``: the optimizer's); ``like`` with another number of groups, or a group of another
    size, is refused (:class:`~sofx.checkpoint.CheckpointMismatchError`); so is a ``torch.optim.AdamW`` as ``like``
    of an L2 optimizer's export with weight decay (``sofx.adam``: AdamW's ``load_state_dict`` makes it decoupled),
    and a state dict or groups as ``like`` whose group says ``decoupled_weight_decay=True`` over a group with decay;
    so is ``like`` of another torch optimizer than Adam or AdamW (``RAdam``, ``NAdam``, ``SGD``...: its groups, as
    :func:`from_torch_optim` refuses its state dict), which would step on Adam's moments as its own algorithm.
    A ``like`` group's ``param_names`` (a torch optimizer made from ``named_parameters()``) that name another leaf
    than the one the export puts at that position are refused, naming both (pass ``groups=`` in its order).
    """
    _check_opt(opt, "to_torch_optim")
    if not isinstance(state, AdamState):
        raise CheckpointError(f"to_torch_optim: expected an AdamState, got {type(state).__name__}")
    if params is None:
        mus, spec = tree.flatten(state.mu)
    else:  # the params' order (a state whose mappings are of another type: matched key by key)
        p_leaves, spec = tree.flatten(params)
        refuse_uninitialized("to_torch_optim", p_leaves, tree.leaf_paths(spec))
        mus = tree.flatten_up_to(spec, state.mu, "state.mu")
    paths = tree.leaf_paths(spec)
    counts = tree.flatten_up_to(spec, state.count, "state.count")
    nus = tree.flatten_up_to(spec, state.nu, "state.nu")
    if params is not None:
        _check_shapes(p_leaves, mus, nus, paths)
    resolved = resolve_groups(opt, spec, hparams, groups, exported=True)
    # (the moments stand for the params' dtype only where the optimizer has no state_dtype: float64 params with
    # float32 moments are stepped in float64; from_torch_optim checks its params)
    if params is not None or opt.state_dtype is None:
        check_float32_groups(resolved, mus if params is None else p_leaves, paths)
    kept = _like_entries(like, [len(g.leaves) for g in resolved])
    _refuse_decoupling_like(opt, like, resolved)
    _check_like_names(like, resolved, _leaves_by_name(state.mu if params is None else params), paths)
    torch_state: dict[int, dict] = {}
    param_groups = []
    index = 0
    for gi, g in enumerate(resolved):
        param_groups.append({**_torch_group(opt, g, index), **kept[gi]})
        for leaf in g.leaves:
            c = _export_count(counts[leaf], f"state.count{paths[leaf][len('params'):]}")
            if c > 0:
                target = p_leaves[leaf] if params is not None else None
                _check_exported_moments(mus[leaf], nus[leaf], paths[leaf][len('params'):],
                                        target.dtype if isinstance(target, torch.Tensor) else None, paths[leaf])
                torch_state[index] = {"step": torch.tensor(float(c), dtype=torch.float32),
                                      "exp_avg": mus[leaf].detach().clone(),
                                      "exp_avg_sq": nus[leaf].detach().clone()}
            index += 1
    return {"state": torch_state, "param_groups": param_groups}


def _check_shapes(p_leaves: list[Any], mus: list[Any], nus: list[Any], paths: list[str]) -> None:
    """Refuse (a :class:`CheckpointMismatchError` naming the leaf and both shapes) a ``params=`` leaf of another shape
    than its moments: torch's ``load_state_dict`` takes them, and its next step fails naming no parameter."""
    for path, p, mu, nu in zip(paths, p_leaves, mus, nus):
        for field, t in (("mu", mu), ("nu", nu)):
            if isinstance(p, torch.Tensor) and isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(p.shape):
                raise CheckpointMismatchError(f"to_torch_optim: {path} has shape {tuple(p.shape)}, its state.{field} "
                                              f"has shape {tuple(t.shape)}: params= must be the state's parameters")


# A param group's entries that to_torch_optim writes itself, whatever like= holds: the hparams and the options that
# change the math
_EXPORTED_KEYS = frozenset({"params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
                            "decoupled_weight_decay"})


def _refuse_decoupling_like(opt: Adam, like: Any, resolved: list[ParamGroup]) -> None:
    """Refuse an export of L2 weight decay (``sofx.adam``; a group of ``resolved`` with a decay other than 0) for a
    ``torch.optim.AdamW`` (``like``): its ``load_state_dict`` makes every group's weight decay decoupled
    (``AdamW.__setstate__``), whatever the state dict says, and the run would go on as AdamW without a word. A
    state dict or groups as ``like`` do not say which torch class they are for, but torch >= 2.x writes
    ``decoupled_weight_decay`` into every group: such a group that says True over an exported group with decay
    is refused too (AdamW's; a ``torch.optim.Adam`` made decoupled, which would take the export's L2 decay, is
    given as the optimizer itself); ``like`` of another form is left to :func:`_like_entries`."""
    if opt.variant.decoupled or not any(g.hparams.weight_decay != 0 for g in resolved):
        return
    if isinstance(like, torch.optim.AdamW):
        raise UnsupportedError("to_torch_optim: like is a torch.optim.AdamW, whose load_state_dict makes every "
                               "group's weight decay decoupled: this optimizer's L2 weight decay (sofx.adam) would "
                               "go on as AdamW's; load the export into a torch.optim.Adam (like=torch.optim.Adam(...))")
    if isinstance(like, torch.optim.Optimizer):  # (its class says: torch.optim.Adam takes the export's decay)
        return
    found = like["param_groups"] if isinstance(like, dict) and "param_groups" in like else like
    if not isinstance(found, (list, tuple)) or len(found) != len(resolved):
        return
    for gi, (group, g) in enumerate(zip(found, resolved)):
        decoupled = group.get("decoupled_weight_decay") if isinstance(group, dict) else None
        if g.hparams.weight_decay != 0 and is_saved_flag(decoupled) and decoupled:
            raise UnsupportedError(f"to_torch_optim: like's param_groups[{gi}] has decoupled_weight_decay=True (a "
                                   "torch.optim.AdamW's, whose load_state_dict makes every group's weight decay "
                                   "decoupled): this optimizer's L2 weight decay (sofx.adam) would go on as AdamW's; "
                                   "load the export into a torch.optim.Adam and give it as like= (a state dict does "
                                   "not say which torch class it is for)")


def _like_entries(like: Any, sizes: list[int]) -> list[dict]:
    """The entries of ``like``'s param groups (a torch optimizer, its ``state_dict()`` or its ``param_groups``) that
    the exported groups keep (all but :data:`_EXPORTED_KEYS`; deep copies), one dict per group; ``sizes``: the
    number of parameters of each exported group, which ``like``'s must match (a group without a ``params`` list is
    refused naming it, and so is a kept on/off option of torch's that is no flag, :func:`sofx.adam.torch_non_flag`).
    ``None``: nothing kept."""
    if like is None:
        return [{} for _ in sizes]
    if isinstance(like, torch.optim.Optimizer):
        found = like.param_groups
    elif isinstance(like, dict) and "param_groups" in like:
        found = like["param_groups"]
    else:
        found = like
    if not isinstance(found, (list, tuple)) or not all(isinstance(g, dict) for g in found):
        raise CheckpointError(f"to_torch_optim: like must be a torch optimizer, its state_dict() or its param_groups, "
                              f"got {tree.article(type(like).__name__)}")
    for gi, group in enumerate(found):  # (as from_torch_optim refuses their state dicts)
        other = _other_torch_optimizer(group)
        if other is not None:
            raise CheckpointMismatchError(f"to_torch_optim: like's param_groups[{gi}]: {other}: not a torch.optim.Adam "
                                          "or AdamW's (loading the export, it would step another algorithm on Adam's "
                                          "moments and steps, or fail in its step)")
    if len(found) != len(sizes):
        raise CheckpointMismatchError(f"to_torch_optim: like has {len(found)} param groups, the export {len(sizes)}")
    for gi, (group, size) in enumerate(zip(found, sizes)):
        members = group.get("params")
        if not isinstance(members, (list, tuple)):  # (as from_torch_optim refuses such a group of its state dict)
            got = f"got {tree.article(type(members).__name__)}: {members!r:.60}" if "params" in group \
                else "it has no 'params'"
            raise CheckpointError(f"to_torch_optim: like's param_groups[{gi}] has no 'params' list ({got}): "
                                  "expected the parameters (or their ids) of the torch optimizer's group")
        if len(members) != size:
            raise CheckpointMismatchError(f"to_torch_optim: like's param_groups[{gi}] has {len(members)} parameters, "
                                          f"the export's {size} (torch's load_state_dict refuses groups of other "
                                          "sizes)")
    for gi, group in enumerate(found):  # (kept: torch's step reads them, "False" as on)
        odd = torch_non_flag({k: v for k, v in group.items() if k not in _EXPORTED_KEYS})
        if odd is not None:
            raise CheckpointError(f"to_torch_optim: like's param_groups[{gi}]['{odd}']: expected "
                                  f"{torch_flag_values(odd)}, got {group[odd]!r:.80} (kept in the export, which "
                                  "torch's step reads)")
    return [{k: copy.deepcopy(v) for k, v in group.items() if k not in _EXPORTED_KEYS} for group in found]


def _check_like_names(like: Any, resolved: list[ParamGroup], named: dict[str, int], paths: list[str]) -> None:
    """Refuse an export whose ``like`` (checked by :func:`_like_entries`) has a group whose ``param_names`` (a torch
    optimizer made from ``named_parameters()`` keeps them, and the export carries them) name, at some position,
    another leaf than the one the export puts there (``named``: :func:`_leaves_by_name` of the exported tree): the
    tree's flatten order (dict keys sorted) is not the model's, and torch's ``load_state_dict`` would put moments
    of equal shapes into each other's parameters. Names of no leaf (another naming) say nothing, as
    :func:`_check_param_names` reads them on import."""
    if like is None:
        return
    found = like.param_groups if isinstance(like, torch.optim.Optimizer) else \
        like["param_groups"] if isinstance(like, dict) else like
    for gi, (group, g) in enumerate(zip(found, resolved)):
        wrong = _first_misnamed(group, g, named)
        if wrong is not None:
            j, name, other, leaf = wrong
            raise CheckpointMismatchError(
                f"to_torch_optim: like's param_groups[{gi}]['param_names'][{j}] is {name!r}, the params leaf "
                f"{paths[other]}, but the export puts {paths[leaf]} there (the tree's leaf order: dict keys "
                "sorted, an OrderedDict's as it holds them), and torch's load_state_dict would give that "
                "parameter another's moments; pass groups= in the torch optimizer's order (for "
                "dict(model.named_parameters()): groups=[g['param_names'] for g in torch_opt.param_groups])")


def _check_exported_moments(mu: Any, nu: Any, at: str, dtype: torch.dtype | None, path: str) -> None:
    """Refuse moments torch's ``load_state_dict`` cannot copy (it fails in its own copy, naming no parameter):
    not a tensor, or one without dense floating-point data (:func:`_not_a_moment`); a negative second moment,
    which no run stores and :func:`from_torch_optim` refuses as corrupt; and, where the parameter's ``dtype`` is
    known (``params=``), a value beyond its range, which that ``load_state_dict`` casts the moments to (a float32
    state of float16 params: inf there, the parameter frozen). ``at``: the leaf's path below the state's root,
    ``path`` the parameter's."""
    for field, t in (("mu", mu), ("nu", nu)):
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"state.{field}{at}: expected a dense floating-point tensor with data, got a "
                                  f"{type(t).__name__}")
        odd = _not_a_moment(t)
        if odd is not None:
            raise CheckpointError(f"state.{field}{at}: expected a dense floating-point tensor with data, got one {odd}")
        if not in_storage(t):  # (freed or shrunk: its clone read outside its storage)
            refuse_short_storage(t, f"state.{field}{at}", CheckpointError)
        if field == "nu":  # (from_torch_optim refuses it back as corrupt)
            refuse_negative(t.detach(), "second moment", f"state.nu{at}", CheckpointError)
        if dtype is not None and dtype.is_floating_point:
            refuse_beyond(t.detach(), dtype, f"to_torch_optim: state.{field}{at}",
                          f"{path}'s dtype, to which torch.optim's load_state_dict casts the moments", UnsupportedError)


def _export_count(x: Any, where: str) -> int:
    """A leaf's step count as torch.optim can hold it: an integer in ``[0, 2**24]`` (0: a leaf never stepped,
    which torch keeps no state for; torch's float32 ``step`` is exact up to ``2**24``). A negative count (which
    ``update`` refuses) is refused, not left out as a leaf never stepped."""
    c = as_number(x, where, CheckpointError)
    if not isinstance(c, int):
        raise CheckpointError(f"{where}: expected a concrete 0-d int64 tensor, got {x!r}")
    if c < 0:
        raise CheckpointError(f"{where}: expected a step count >= 0, got {c}")
    if c > _EXACT_STEPS:
        raise UnsupportedError(f"{where} = {c}: torch.optim stores the step as float32, exact only up to "
                               f"{_EXACT_STEPS}")
    return c


def _as_step(x: Any, where: str) -> int:
    """A saved step as sofx counts it: an integer value in ``[0, 2**63)`` (an int64 count): a Python, numpy
    (``np.int64(3)``: a state dict that went through numpy, which torch.optim takes) or 0-d tensor number; a bool,
    numpy's too, is none."""
    v = as_number(x, where, CheckpointError) if isinstance(x, torch.Tensor) or is_numpy_real(x) else x
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not 0 <= v < 2 ** 63 or int(v) != v:
        raise CheckpointError(f"{where}: step must be a non-negative integer value below 2**63, got "
                              f"{tree.key_text(x)}")
    return int(v)


def _check_group_flags(opt: Adam, group: dict, gi: int) -> None:
    """Refuse a saved group whose options sofx does not implement: another torch optimizer's
    (:func:`_other_torch_optimizer`), torch's options that change the math (:func:`sofx.adam.refused_torch_option`,
    the rule sofx.adam/adamw and the offload facade refuse by), bias correction turned off (``bias_correction``,
    ``correct_bias``: torch-style state dicts of DeepSpeed's and Hugging Face's Adam) and a
    ``decoupled_weight_decay`` other than ``opt``'s; each of these options, and each of torch's other on/off options
    (``foreach``, ``fused``, ``capturable``, ``differentiable``), that is no flag (:func:`is_saved_flag`,
    :func:`sofx.adam.torch_non_flag`) is a :class:`CheckpointError` naming it."""
    other = _other_torch_optimizer(group)
    if other is not None:
        raise CheckpointMismatchError(f"from_torch_optim: param_groups[{gi}]: {other}: not a torch.optim.Adam or AdamW "
                                      "state dict (their moments and steps are another algorithm's)")
    # (None: not said, or torch picks; bool() took "False" as true, a tensor of two raised torch's bare RuntimeError;
    # foreach, fused, capturable and differentiable are carried on by to_torch_optim(like=...) to torch's step)
    key = torch_non_flag(group)
    if key is not None:
        raise CheckpointError(f"from_torch_optim: param_groups[{gi}]['{key}']: expected {torch_flag_values(key)}, "
                              f"got {group[key]!r:.80}")
    name = refused_torch_option(group)
    if name is not None:
        raise UnsupportedError(f"from_torch_optim: param_groups[{gi}]: {name}={group[name]!r} is not supported "
                               "(only torch.optim's default, False)")
    for key in ("bias_correction", "correct_bias"):  # DeepSpeed's Adam, Hugging Face's AdamW (as load_zero3 refuses)
        if key not in group:
            continue
        if not is_saved_flag(group[key]):
            raise CheckpointError(f"from_torch_optim: param_groups[{gi}]['{key}']: expected True or False, got "
                                  f"{group[key]!r:.80}")
        if not group[key]:
            raise UnsupportedError(f"from_torch_optim: param_groups[{gi}]: {key}={group[key]!r} is not supported "
                                   "(torch.optim's Adam always corrects the bias, and so does the optimizer it "
                                   "imports into)")
    decoupled = group.get("decoupled_weight_decay")
    if decoupled is not None and bool(decoupled) != opt.variant.decoupled:
        want = "sofx.adamw (decoupled)" if decoupled else "sofx.adam (L2)"
        raise UnsupportedError(f"from_torch_optim: param_groups[{gi}]: decoupled_weight_decay={decoupled!r}, the "
                               f"optimizer's weight decay is {'decoupled' if opt.variant.decoupled else 'L2'}: use "
                               f"{want}")


def _other_torch_optimizer(group: dict) -> str | None:
    """Why the saved ``group`` is another torch optimizer's than Adam's or AdamW's (``None``: nothing says so).
    NAdam and RAdam keep ``step``, ``exp_avg`` and ``exp_avg_sq`` as Adam does, but torch.optim.Adam and AdamW
    write ``amsgrad`` into every group, beside the ``maximize`` every torch optimizer writes (a group made by hand,
    without either, says nothing); NAdam's also holds its ``momentum_decay``."""
    if "momentum_decay" in group:
        return "it holds 'momentum_decay' (torch.optim.NAdam's)"
    if "maximize" in group and "amsgrad" not in group:
        return ("it holds torch.optim's options ('maximize') but no 'amsgrad', which torch.optim.Adam and AdamW "
                "write into every group (the other torch optimizers' groups, RAdam's, Adamax's or SparseAdam's, "
                "have none)")
    return None


def _refuse_offload_state(state_dict: dict) -> None:
    """Refuse the offload facade's ``state_dict()`` (``sofx.offload``'s own format under torch.optim's two keys,
    ``state["format"]`` naming it) with a :class:`CheckpointError` saying whose it is and what loads it."""
    fmt = state_dict["state"].get("format")
    if isinstance(fmt, str) and fmt.startswith("sofx.offload/"):
        raise CheckpointError(f"from_torch_optim: this is a sofx.offload optimizer's state_dict() (format {fmt!r}), "
                              "its own format, not a torch.optim one; load it with that optimizer's "
                              "load_state_dict (sofx.checkpoint.save and load keep it as it is)")


def from_torch_optim(opt: Adam, state_dict: dict, params: Any, hparams: Any = None, *,
                     groups: Sequence[Sequence[Any]] | None = None) -> tuple[AdamState, Any]:
    """Import a ``torch.optim.Adam``/``AdamW`` ``state_dict()``: returns ``(state, hparams)``.

    ``params``: the params tree (its leaves' shapes, dtypes and devices shape
    the state; a meta leaf's state comes on the CPU, as :func:`sofx.checkpoint.load`
    places a meta template's tensors). ``hparams``/``groups``: the param group layout (see
    :mod:`sofx.checkpoint.groups`); ``hparams`` serves as a template only. The
    returned hparams carry the state dict's values: in the template's
    structure, or one :class:`AdamHParams` per leaf with ``groups=``, or a single
    one without either. Nothing is shared with ``state_dict``. A group's saved
    ``param_names`` (torch.optim made from ``named_parameters()``) that name another
    leaf than the one the layout puts at that position are refused (the tree's
    flatten order sorts dict keys: pass ``groups=`` in the state dict's order). A group saved with
    ``decoupled_weight_decay`` other than ``opt``'s is refused; one without it (an older torch.optim's, whose Adam
    and AdamW groups hold the same keys) is imported as ``opt``'s decay, with a ``UserWarning`` saying so where its
    weight decay is not 0.
    """
    _check_opt(opt, "from_torch_optim")
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), (list, tuple)):
        raise CheckpointError("from_torch_optim: expected a torch.optim state_dict() with 'state' (a dict) and "
                              "'param_groups' (a list)")
    _refuse_offload_state(state_dict)
    leaves, spec = tree.flatten(params)
    paths = tree.leaf_paths(spec)
    check_params_template("from_torch_optim", leaves, paths)
    resolved = resolve_groups(opt, spec, hparams, groups)
    named = _leaves_by_name(params)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(resolved):
        raise CheckpointMismatchError(f"from_torch_optim: the state dict has {len(saved_groups)} param groups, the "
                                      f"params tree is laid out in {len(resolved)}")
    saved_state = state_dict["state"]
    counts: list[Any] = [None] * len(leaves)
    mus: list[Any] = [None] * len(leaves)
    nus: list[Any] = [None] * len(leaves)
    group_hp: list[AdamHParams] = []
    used: dict[Any, int] = {}  # parameter id -> the param group listing it
    for gi, (g, saved) in enumerate(zip(resolved, saved_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise CheckpointError(f"from_torch_optim: param_groups[{gi}] has no 'params' list")
        if len(saved["params"]) != len(g.leaves):
            raise CheckpointMismatchError(f"from_torch_optim: param_groups[{gi}] has {len(saved['params'])} "
                                          f"parameters, the params tree's group {gi} has {len(g.leaves)} "
                                          f"({[paths[i] for i in g.leaves][:4]}...)")
        _check_group_flags(opt, saved, gi)
        _check_param_names(saved, g, gi, named, paths)
        group_hp.append(_group_hparams(saved, gi, [leaves[i] for i in g.leaves]))
        for j, (pid, leaf) in enumerate(zip(saved["params"], g.leaves)):
            _check_hashable(pid, f"param_groups[{gi}]['params'][{j}]")
            _list_once(used, pid, gi)
            try:
                _import_leaf(opt, saved_state.get(pid), leaves[leaf], paths[leaf], pid, leaf, counts, mus, nus)
            except CheckpointMismatchError as exc:
                hint = _sorted_keys_hint(params) if groups is None else ""
                raise CheckpointMismatchError(f"{exc}{hint}") from None
    extra = [k for k in saved_state if k not in used]
    if extra:
        ids = "[" + ", ".join(map(tree.key_text, extra[:8])) + "]"
        raise CheckpointMismatchError(f"from_torch_optim: the state dict has state for parameter ids {ids} "
                                      "that no param group lists")
    _warn_assumed_decay(opt, saved_groups, group_hp)
    state = AdamState(tree.unflatten(spec, counts), tree.unflatten(spec, mus), tree.unflatten(spec, nus))
    return state, hparams_tree(resolved, group_hp, spec, hparams, groups)


def _warn_assumed_decay(opt: Adam, saved_groups: Sequence[dict], group_hp: list[AdamHParams]) -> None:
    """Warn where a saved group with a weight decay other than 0 has no ``decoupled_weight_decay``: torch.optim
    wrote none before its Adam took that option, and its Adam's and AdamW's groups then held the same keys, so the
    state dict does not say whether its decay was L2 (``p += wd * p`` in the gradient) or decoupled; it is
    imported as ``opt``'s, which steps on differently from the other (without decay the two are one step)."""
    unsaid = [gi for gi, (saved, hp) in enumerate(zip(saved_groups, group_hp))
              if "decoupled_weight_decay" not in saved and hp.weight_decay != 0]
    if not unsaid:
        return
    gi = unsaid[0]
    more = f" (and {len(unsaid) - 1} more group{'s' if len(unsaid) > 2 else ''})" if len(unsaid) > 1 else ""
    if opt.variant.decoupled:
        assumed, other = "decoupled (torch.optim.AdamW's)", "torch.optim.Adam's L2 decay imports into sofx.adam()"
    else:
        assumed, other = "L2 (torch.optim.Adam's)", "torch.optim.AdamW's decoupled decay imports into sofx.adamw()"
    warnings.warn(f"from_torch_optim: param_groups[{gi}] has weight_decay={group_hp[gi].weight_decay!r} and no "
                  f"'decoupled_weight_decay'{more} (an older torch.optim's state dict, whose Adam and AdamW groups "
                  f"hold the same keys): imported as {assumed} weight decay, the optimizer's; {other} (set the "
                  "groups' 'decoupled_weight_decay' to say which, and nothing is said)",
                  UserWarning, stacklevel=caller_stacklevel())


def _group_hparams(saved: dict, gi: int, members: list[Any]) -> AdamHParams:
    """Saved ``param_groups[gi]``'s hparams (:func:`~sofx.checkpoint.groups.saved_hparams`: numbers in their
    ranges, not float16 or bfloat16 where torch.optim's step computes in that precision), refused where float32 cannot
    hold them and a leaf of the group (``members``) is stepped in float32
    (every dtype but float64), as ``update`` would refuse them at the first step, naming a leaf and not the entry."""
    wide = all(isinstance(p, torch.Tensor) and p.dtype == torch.float64 for p in members)
    return saved_hparams(saved, f"from_torch_optim: param_groups[{gi}]",
                         f"from_torch_optim: param_groups[{gi}]: expected lr, betas (a pair), eps and weight_decay",
                         float32=None if wide else "a leaf of the group is not float64", half=True)


def _leaves_by_name(params: Any) -> dict[str, int]:
    """Each params leaf by its name as ``named_parameters()`` writes it (the keys of its tree path joined by
    dots: ``dict(model.named_parameters())``'s keys, ``{"enc": {"w": ...}}`` -> ``"enc.w"``), for names that
    only one leaf has."""
    index: dict[str, int] = {}
    clashes = set()
    for i, keys in enumerate(optree.tree_paths(params)):
        name = ".".join(tree.key_text(k) if isinstance(k, int) else str(k) for k in keys)
        if name in index:
            clashes.add(name)
        index[name] = i
    return {n: i for n, i in index.items() if n not in clashes}


def _check_param_names(saved: dict, g: ParamGroup, gi: int, named: dict[str, int], paths: list[str]) -> None:
    """Refuse a saved group whose ``param_names`` (torch.optim keeps them for an optimizer made from
    ``named_parameters()``) name, at some position, another params leaf than the one the layout puts there: the
    params tree's flatten order (dict keys sorted, an ``OrderedDict``'s kept) is not the model's, and moments of
    equal shapes would be imported into each other's leaves. Names of no leaf (another naming, a ``module.``
    prefix) say nothing."""
    wrong = _first_misnamed(saved, g, named)
    if wrong is not None:
        j, name, other, leaf = wrong
        raise CheckpointMismatchError(
            f"from_torch_optim: param_groups[{gi}]['params'][{j}] is named {name!r}, the params leaf "
            f"{paths[other]}, but the params tree puts {paths[leaf]} there (its leaf order: dict keys sorted, an "
            f"OrderedDict's as it holds them); "
            "pass groups= in the state dict's order (for dict(model.named_parameters()): "
            "groups=[g['param_names'] for g in state_dict['param_groups']])")


def _first_misnamed(group: dict, g: ParamGroup, named: dict[str, int]) -> tuple[int, str, int, int] | None:
    """The first position of a torch group's ``param_names`` (one name per leaf of ``g``) whose name is another
    params leaf's (``named``: :func:`_leaves_by_name`) than the one ``g`` puts there: (position, name, the leaf it
    names, the leaf there); ``None`` where there is none, or the group has no such list. Names of no leaf say
    nothing."""
    names = group.get("param_names")
    if not isinstance(names, (list, tuple)) or len(names) != len(g.leaves):
        return None
    for j, (name, leaf) in enumerate(zip(names, g.leaves)):
        other = named.get(name) if isinstance(name, str) else None
        if other is not None and other != leaf:
            return j, name, other, leaf
    return None


def _sorted_keys_hint(params: Any) -> str:
    """Where ``params`` holds a dict (not an ``OrderedDict``: its order is kept) whose keys are not in sorted
    order, why its leaves can meet another parameter's state (optree takes dict keys sorted, torch.optim numbers
    parameters in the model's order) and what to pass; else ''."""
    def unsorted(node: Any) -> bool:
        if isinstance(node, OrderedDict):  # (its leaves come in its keys' order, the model's where made from it)
            return any(unsorted(v) for v in node.values())
        if isinstance(node, dict):
            keys = list(node)
            try:
                if keys != sorted(keys):
                    return True
            except TypeError:  # keys of mixed types: optree sorts them its own way
                return True
            return any(unsorted(v) for v in node.values())
        return isinstance(node, (list, tuple)) and any(unsorted(v) for v in node)

    if not unsorted(params):
        return ""
    return (" (the params tree's leaves are taken in optree's order, dict keys sorted, where torch.optim numbers "
            "its parameters in the model's order: pass groups= in the model's order, e.g. groups=[list(params)] "
            "for params = dict(model.named_parameters()) in one param group, or make the torch optimizer over "
            "sofx.checkpoint.torch_param_groups(opt, params))")


def _check_hashable(pid: Any, where: str) -> None:
    """Refuse a parameter id that cannot be a key of the state dict's ``state`` (a list, say): Python's bare
    TypeError otherwise, where it is looked up."""
    try:
        hash(pid)
    except TypeError:
        raise CheckpointError(f"from_torch_optim: {where} is {tree.article(type(pid).__name__)}, not a parameter id "
                              "(ids are keys of the state dict's 'state': they must be hashable)") from None


def _list_once(used: dict[Any, int], pid: Any, gi: int) -> None:
    """Record that ``param_groups[gi]`` lists parameter id ``pid``; refuse an id listed before (torch.optim
    lists each parameter once: an id twice would import one saved state for two leaves)."""
    if pid in used:
        raise CheckpointMismatchError(f"from_torch_optim: parameter id {tree.key_text(pid)} is listed twice: in "
                                      f"param_groups[{used[pid]}] and param_groups[{gi}]; torch.optim lists each "
                                      "parameter once")
    used[pid] = gi


def _import_leaf(opt: Adam, entry: Any, p: torch.Tensor, path: str, pid: Any, leaf: int,
                 counts: list, mus: list, nus: list) -> None:
    dtype = opt.state_dtype or p.dtype  # (p: a floating-point tensor, groups.check_params_template)
    device = template_device(p) or torch.device("cpu")  # (a meta leaf has no storage: its state comes on the CPU)
    where = f"state[{tree.key_text(pid)}]"  # (an int id too long for decimal text: in hex)
    if entry is None or (isinstance(entry, dict) and not entry):  # no state: torch.optim's defaultdict(dict)
        counts[leaf] = torch.zeros((), dtype=torch.int64)
        mus[leaf] = torch.zeros_like(p, dtype=dtype, device=device)
        nus[leaf] = torch.zeros_like(p, dtype=dtype, device=device)
        return
    if not isinstance(entry, dict) or any(k not in entry for k in ("step", "exp_avg", "exp_avg_sq")):
        # keys sorted by their text: keys of mixed types (an int beside a str) do not sort themselves
        keys = "[" + ", ".join(sorted(map(tree.key_text, entry))) + "]" if isinstance(entry, dict) \
            else type(entry).__name__
        raise CheckpointError(f"from_torch_optim: {where} ({path}) must have step, exp_avg and exp_avg_sq; "
                              f"has {keys}")
    if "max_exp_avg_sq" in entry:
        raise UnsupportedError(f"from_torch_optim: {where} ({path}) has max_exp_avg_sq (amsgrad)")
    counts[leaf] = torch.tensor(_as_step(entry["step"], f"{where} ({path})"), dtype=torch.int64)
    for name, out in (("exp_avg", mus), ("exp_avg_sq", nus)):
        t = entry[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape):
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointMismatchError(f"from_torch_optim: {where}[{name!r}] for {path}: expected shape "
                                          f"{tuple(p.shape)}, got {got}")
        odd = _not_a_moment(t)
        if odd is not None:
            raise CheckpointError(f"from_torch_optim: {where}[{name!r}] for {path}: expected a dense floating-point "
                                  f"tensor with data, got one {odd}")
        if not in_storage(t):  # (freed or shrunk: its copy read outside its storage)
            refuse_short_storage(t, f"from_torch_optim: {where}[{name!r}] for {path}", CheckpointError)
        if name == "exp_avg_sq":
            refuse_negative(t.detach(), "second moment", f"from_torch_optim: {where}[{name!r}] for {path}",
                            CheckpointError)
        refuse_beyond(t.detach(), dtype, f"from_torch_optim: {where}[{name!r}] for {path}",
                      "the optimizer's state_dtype" if opt.state_dtype is not None else "the parameter's dtype",
                      UnsupportedError)
        out[leaf] = t.detach().to(device=device, dtype=dtype, copy=True)


def _not_a_moment(t: torch.Tensor) -> str | None:
    """What makes ``t`` no moment a torch.optim run of floating-point parameters writes (``None``: nothing): a
    layout other than strided, the meta device (no data to copy), a dtype that is not floating-point (which the
    copy into the state dtype would cast without a word)."""
    if t.layout != torch.strided:
        return f"of layout {t.layout}"
    if t.device.type == "meta":
        return "on the meta device"
    if not t.dtype.is_floating_point:
        return f"of dtype {t.dtype}"
    return None

