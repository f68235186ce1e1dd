"""Param groups of a functional params tree, for formats that number parameters (torch.optim, DeepSpeed).

torch.optim numbers parameters across its param groups in order: group 0's
parameters are ``0..n0-1``, group 1's follow, and so on. A sofx params tree
has no such numbering, so the mapping is made explicit here:

* ``groups=None`` and ``hparams`` a prefix tree of :class:`~sofx.AdamHParams`
  (sofx's per-group hyperparameters): one group per ``AdamHParams`` of the
  prefix, holding the params leaves under it in their flatten order, the groups
  in the order of their first leaves (the prefix's flatten order, but where a
  mapping of it is of another type than the params': a ``dict``, keys sorted,
  over an ``OrderedDict``, which keeps its order, follows the params).
* ``groups=None`` and ``hparams`` a single ``AdamHParams`` or ``None``: one group
  with every leaf in flatten order.
* ``groups=[[ref, ...], ...]``: exactly these groups in this order, each leaf
  named by its index in flatten order, by its path (``"params['enc']['w']"``, as
  :func:`sofx.tree.leaf_paths` writes it) or, for a leaf directly under the root
  dict, by its key (``"enc.weight"`` for ``dict(model.named_parameters())``);
  a text that names two leaves (a key written as another leaf's path, keys of
  equal ``repr``) is refused.
  Every leaf must be in exactly one group and all leaves of a group must have
  the same hyperparameters.

Note that optree orders dict keys by sorted key, not by insertion: for a dict
built from ``model.named_parameters()`` pass ``groups=`` to follow the model's
parameter order.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import optree
import torch

from sofx import tree
from sofx.adam import (Adam, AdamHParams, _check_param, check_float32_range, refuse_eps_held_as_0,
                       refuse_half_precision)
from sofx.checkpoint.errors import CheckpointError
from sofx.errors import HParamError, LeafError
from sofx.kernels.base import as_number, check_hparam_range, is_number, is_numpy_real, rounds_in_float
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.kernels.user_numbers import is_bool

__all__ = ["ParamGroup", "resolve_groups", "prefix_ids", "hparams_tree", "one_element", "saved_hparams",
           "check_params_template", "refuse_uninitialized", "check_float32_groups", "is_saved_flag"]


@dataclass(frozen=True)
class ParamGroup:
    """One param group: complete hyperparameters (Python numbers) and its leaves (indices in flatten order)."""

    hparams: AdamHParams
    leaves: tuple[int, ...]


def _group_numbers(hp: AdamHParams, where: str, exported: bool = False, float32: bool = False) -> AdamHParams:
    """``hp`` as Python floats. ``exported``: they are written out (a torch optimizer's groups, a ZeRO-3 file), so
    each is checked in its range as :meth:`~sofx.Adam.update` checks it (an lr of -0.1, a beta of 1, a nan:
    no step takes them, and the import refuses them back), and, ``float32``, in float32's range
    (:func:`~sofx.adam.check_float32_range`): a :class:`CheckpointError` naming ``where``."""
    values = []
    for name, x in zip(AdamHParams._fields, hp):
        v = as_number(x)
        if not is_number(v):
            raise CheckpointError(f"{where}: {name} must be a concrete number to be exported, got {x!r}")
        if exported:
            try:
                check_hparam_range(name, v, where)
            except HParamError as exc:
                raise CheckpointError(str(exc)) from None
        values.append(float(v))
    out = AdamHParams(*values)
    if float32:
        try:
            check_float32_range(out, where)
        except HParamError as exc:
            raise CheckpointError(f"{exc} (the exported values are float32's)") from None
    return out


def one_element(x: Any) -> Any:
    """A saved hyperparameter that is a tensor or numpy array of one element as its 0-d tensor (detached: one that
    requires grad, a learned lr, is read as its value) or its numpy scalar, of the array's dtype (torch.optim takes
    an lr so; a float16 one is refused as a numpy float16 is, where ``.item()`` gave the Python float it holds);
    ``x`` otherwise."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.detach().reshape(())
    if type(x).__module__ == "numpy" and getattr(x, "size", None) == 1 and callable(getattr(x, "reshape", None)):
        return x.reshape(-1)[0]
    return x


def _refuse_inexact(x: Any, label: str, error: type[CheckpointError]) -> None:
    """Refuse a saved numpy float ``x`` that no Python float holds exactly (a ``longdouble``'s extra digits:
    ``float()`` rounded them off without a word), as :mod:`sofx.checkpoint.codec` refuses to store one: ``error``
    naming ``label`` and the value (:func:`sofx.kernels.base.rounds_in_float`)."""
    if is_numpy_real(x) and not isinstance(x, numbers.Integral) and rounds_in_float(x):
        raise error(f"{label}: a numpy.{type(x).__name__} {x!r:.60} that no Python float holds exactly cannot be "
                    f"read without rounding (sofx steps with Python floats); store float(x) ({float(x)!r}) if that "
                    "is meant")


def is_saved_flag(x: Any) -> bool:
    """Whether ``x`` is a saved on/off option of a param group: a bool (Python's or numpy's) or the int 0 or 1 (a
    string such as ``"False"`` is true to ``not``)."""
    return is_bool(x) or (type(x) is int and x in (0, 1))


def _pair_form(betas: Any) -> bool:
    """Whether saved ``betas`` have a form torch.optim takes a pair in: a tuple or list, a tensor or a numpy array
    (their sizes are checked as they are taken apart). A set, a dict, a str or an iterator is none: taken apart,
    a set gives its iteration order, a dict its keys."""
    return isinstance(betas, (tuple, list, torch.Tensor)) or type(betas).__module__ == "numpy"


def saved_hparams(group: Any, at: str, missing: str, error: type[CheckpointError] = CheckpointError, *,
                  float32: str | None = None, range_error: type[CheckpointError] = CheckpointError,
                  half: bool = False) -> AdamHParams:
    """A saved param group's lr, betas, eps and weight_decay as floats. Where one is missing or the betas are not
    a pair: ``error`` with the message ``missing`` and what is wrong. Each is a real number (a Python or numpy one, or a
    tensor or numpy array of one element, as torch.optim takes a tensor lr), else ``error`` naming the entry, ``at``
    (the group) followed by its key, and its value (a string reached ``float()`` and was parsed; None or a tensor
    of two elements raised bare errors; a tensor whose storage does not hold its elements, a betas pair too, is
    ``error`` naming it), within its range as :meth:`~sofx.Adam.update` checks it (``lr >= 0``,
    ``0 <= beta < 1``, ``eps > 0``, ``weight_decay >= 0``, all finite: ``error`` naming the entry, the value and the
    range; torch.optim takes ``eps=0``, which no step here can). ``float32``: where a leaf of the group is
    stepped in float32, why (the words ending the refusal): the values float32 cannot hold are refused too
    (:func:`~sofx.adam.check_float32_range`, as ``update`` refuses them at the first step, naming a leaf). A number
    out of range is ``range_error`` (a :class:`CheckpointError`: an eps of 0 is torch's and DeepSpeed's to step, no
    damage to the file, where ``error`` may say the file is corrupt). ``half``: the group is a torch.optim one (or
    a ZeRO-3 file's), whose for-loop step computes with a float16 or bfloat16 lr, beta or weight_decay in that
    precision: such a value is ``range_error`` too, as :meth:`~sofx.Adam.update` refuses it
    (:func:`~sofx.adam.refuse_half_precision`; read as the float it holds, the run went on with another step than
    torch's). So is a numpy ``longdouble`` that no float holds exactly (rounded without a word; the checkpoint
    codec refuses to store one)."""
    betas = group.get("betas") if isinstance(group, dict) else None
    if isinstance(betas, torch.Tensor) and not in_storage(betas):  # (taken apart below: torch's bare RuntimeError)
        refuse_short_storage(betas, f"{at}['betas']", error)
    if betas is not None and not _pair_form(betas):  # (b1, b2 = {0.999, 0.9}: a set's iteration order, no word)
        raise error(f"{at}['betas']: expected a pair (beta1, beta2): a tuple or list, or a tensor or numpy array of "
                    f"2 elements (torch.optim's forms); got {type(betas).__name__} {betas!r:.80}")
    try:
        b1, b2 = group["betas"]
        raw = [("['lr']", group["lr"]), ("['betas'][0]", b1), ("['betas'][1]", b2), ("['eps']", group["eps"]),
               ("['weight_decay']", group["weight_decay"])]
    except (KeyError, TypeError, ValueError) as exc:
        raise error(f"{missing} ({type(exc).__name__}: {exc})") from None
    values = []
    for (name, x), field in zip(raw, AdamHParams._fields):
        if half:
            try:
                refuse_half_precision(field, x, "", label=f"{at}{name}")
                if type(x).__module__ == "numpy":  # (an array of one element: its scalar, of its dtype)
                    refuse_half_precision(field, one_element(x), "", label=f"{at}{name}")
            except HParamError as exc:
                raise range_error(str(exc)) from None
        _refuse_inexact(one_element(x), f"{at}{name}", range_error)
        v = as_number(one_element(x), f"{at}{name}", error)
        if not (is_number(v) and isinstance(v, numbers.Real)):  # (a complex is a number float() refuses)
            raise error(f"{at}{name}: expected a number, got {type(x).__name__} {x!r:.80}")
        try:  # (as update() checks it: refused here, naming the entry, not at the first step, naming a leaf)
            if field == "eps" and v == 0:  # (a float16 1e-8 is 0: say so, not only 'expected eps > 0')
                refuse_eps_held_as_0(one_element(x), "", label=f"{at}{name}")
            check_hparam_range(field, v, f"{at}{name}")
        except HParamError as exc:
            raise range_error(str(exc)) from None
        values.append(float(v))
    hp = AdamHParams(*values)
    if float32 is not None:
        try:
            check_float32_range(hp, at)
        except HParamError as exc:
            raise range_error(f"{exc} ({float32})") from None
    return hp


def check_params_template(who: str, leaves: Sequence[Any], paths: Sequence[str]) -> None:
    """Refuse a leaf of a params template (what an import unpacks the state into, in its dtype) that no update
    steps, as ``opt.init`` refuses it: not a tensor, not floating-point (an int64 or bool leaf took the moments and
    masters cast to it, truncated, without a word), not dense. A :class:`CheckpointError` naming ``who`` and the
    leaf, before any file or state dict is read (a lazy module's uninitialized parameter too, as
    :func:`refuse_uninitialized` refuses it)."""
    for path, p in zip(paths, leaves):
        try:
            _check_param(path, p)
        except LeafError as exc:
            raise CheckpointError(f"{who}: {exc} (params is the template of the parameters and state imported)") \
                from None


def refuse_uninitialized(who: str, leaves: Sequence[Any], paths: Sequence[str]) -> None:
    """Refuse a params leaf that is a lazy module's uninitialized parameter (before its first forward: no shape,
    no data; torch raised its ValueError or RuntimeError naming no leaf): a :class:`CheckpointError` naming ``who``
    and the leaf."""
    for path, p in zip(paths, leaves):
        if isinstance(p, torch.nn.parameter.UninitializedTensorMixin):
            raise CheckpointError(f"{who}: {tree.uninitialized_refusal(path)}")


def check_float32_groups(resolved: Sequence[ParamGroup], leaves: Sequence[Any], paths: Sequence[str]) -> None:
    """Refuse exported hparams that float32 cannot hold (:func:`~sofx.adam.check_float32_range`: an eps that rounds
    to 0, an lr beyond its largest value) in a group with a leaf that is not float64 (``leaves``: the params, or
    their moments), which is stepped in float32: no update steps it with them, and :func:`from_torch_optim`
    refuses them back for such leaves. A :class:`CheckpointError` naming the group's first leaf."""
    for g in resolved:
        if all(isinstance(leaves[i], torch.Tensor) and leaves[i].dtype == torch.float64 for i in g.leaves):
            continue
        try:
            check_float32_range(g.hparams, f"hparams for {paths[g.leaves[0]]}")
        except HParamError as exc:
            raise CheckpointError(f"{exc} (a leaf of the group is not float64)") from None


def _leaf_index(ref: Any, paths: list[str], by_path: dict[str, list[int]]) -> int:
    """The leaf index of ``ref``, an index or a name (:func:`sofx.tree.named_leaves`; ``by_path``: the
    :func:`sofx.tree.paths_index` of ``paths``)."""
    if isinstance(ref, numbers.Integral) and not is_bool(ref):  # (numpy's integers too: an index from an array)
        if not 0 <= ref < len(paths):
            raise CheckpointError(f"groups: leaf index {ref} is out of range (the params have {len(paths)} leaves)")
        return int(ref)
    if isinstance(ref, str):
        named = tree.named_leaves(by_path, ref)
        if len(named) > 1:  # a key written as another leaf's path, or two keys of equal repr
            listed = ", ".join(f"{i}: {paths[i]}" for i in named)
            raise CheckpointError(f"groups: {ref!r} names {len(named)} params leaves ({listed}); name it by its "
                                  "index")
        if named:
            return named[0]
        raise CheckpointError(f"groups: no params leaf is named {ref!r}; leaves are {paths[:8]}"
                              f"{' ...' if len(paths) > 8 else ''}")
    raise CheckpointError(f"groups: a leaf is named by its index or path, got {ref!r}")


def resolve_groups(opt: Adam, spec: tree.TreeSpec, hparams: Any = None,
                   groups: Sequence[Sequence[Any]] | None = None, *, exported: bool = False,
                   float32: bool = False) -> list[ParamGroup]:
    """The param groups of a params tree of structure ``spec`` (see the module docstring). ``exported``: their
    hparams are written out, checked in their ranges (and, ``float32``, in float32's: :func:`_group_numbers`); else they
    are a template only (an import's)."""
    paths = tree.leaf_paths(spec)
    per_leaf = opt.resolve_hparams(hparams, spec)
    if groups is not None:
        # (not iterable, 5 or a function: Python's bare TypeError from the loop below)
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) \
                or not all(isinstance(g, Sequence) and not isinstance(g, str) for g in groups):
            raise CheckpointError(f"groups must be a sequence of sequences of leaf indices or paths, got "
                                  f"{type(groups).__name__} {groups!r:.80}")
        out, owner = [], {}
        by_path = tree.paths_index(paths)
        for gi, refs in enumerate(groups):
            idx = tuple(_leaf_index(r, paths, by_path) for r in refs)
            for i in idx:
                if i in owner:
                    raise CheckpointError(f"groups: {paths[i]} is in group {owner[i]} and in group {gi}")
                owner[i] = gi
            if not idx:
                raise CheckpointError(f"groups: group {gi} is empty")
            hps = [_group_numbers(per_leaf[i], f"hparams for {paths[i]}", exported, float32) for i in idx]
            for i, hp in zip(idx, hps):
                if hp != hps[0]:
                    raise CheckpointError(f"groups: group {gi} mixes hyperparameters: {paths[idx[0]]} has {hps[0]}, "
                                          f"{paths[i]} has {hp}")
            out.append(ParamGroup(hps[0], idx))
        missing = [paths[i] for i in range(len(paths)) if i not in owner]
        if missing:
            raise CheckpointError(f"groups: every leaf must be in a group; missing: {missing}")
        return out
    if hparams is None or isinstance(hparams, AdamHParams):
        if not paths:
            return []
        return [ParamGroup(_group_numbers(per_leaf[0], "hparams", exported, float32), tuple(range(len(paths))))]
    _, leaf_ids = prefix_ids(hparams, spec)
    order: dict[Any, list[int]] = {}
    for i, gid in enumerate(leaf_ids):
        order.setdefault(gid, []).append(i)
    return [ParamGroup(_group_numbers(per_leaf[idx[0]], f"hparams for {paths[idx[0]]}", exported, float32), tuple(idx))
            for idx in order.values()]


def prefix_ids(hparams: Any, spec: tree.TreeSpec) -> tuple[Any, list[int]]:
    """``hparams`` (a prefix tree of AdamHParams) with each AdamHParams replaced by its number in
    flatten order, and that number for every params leaf. A ``None`` in it (the defaults for its subtree, as
    ``update`` reads it) is a value too, with its own number."""
    counter = itertools.count()
    ids = optree.tree_map(lambda _: next(counter), hparams, is_leaf=lambda x: isinstance(x, AdamHParams),
                          none_is_leaf=True)
    return ids, tree.broadcast_prefix(ids, spec, what="hparams")


def hparams_tree(resolved: list[ParamGroup], group_hp: list[AdamHParams], spec: tree.TreeSpec, hparams: Any,
                 groups: Any) -> Any:
    """Hyperparameters read from a file (one per group) as an ``hparams`` argument for ``update``: in the
    template's structure, one per leaf with explicit ``groups``, or a single one."""
    per_leaf: list[Any] = [None] * spec.num_leaves
    for g, hp in zip(resolved, group_hp):
        for leaf in g.leaves:
            per_leaf[leaf] = hp
    if groups is not None:
        return tree.unflatten(spec, per_leaf)
    if hparams is None or isinstance(hparams, AdamHParams):
        return group_hp[0] if group_hp else hparams
    ids, leaf_ids = prefix_ids(hparams, spec)
    first = {}
    for leaf, gid in enumerate(leaf_ids):
        first.setdefault(gid, per_leaf[leaf])
    return optree.tree_map(lambda gid: first.get(gid, AdamHParams()), ids)  # no leaves: nothing to set
