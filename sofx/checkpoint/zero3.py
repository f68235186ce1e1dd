"""Export and import the DeepSpeed ZeRO-3 optimizer checkpoint layout (SPECULATION.md section 6).

One file per data-parallel rank ``dp`` (model-parallel rank ``mp``)::

    [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt
    {"optimizer_state_dict": {                           # DeepSpeedZeroOptimizer_Stage3.state_dict()
         "zero_stage": 3, "partition_count": W, "loss_scaler": ..., "dynamic_loss_scale": bool,
         "overflow": False,
         "optimizer_state_dict": {                       # the wrapped Adam's state_dict()
             "state": {i: {"step": int, "exp_avg": flat_i, "exp_avg_sq": flat_i}},
             "param_groups": [{"lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad",
                               "params": [i]}, ...]},   # (DeepSpeed's FusedAdam: "step" here,
                                                        #  read where an entry has none)
         "fp32_flat_groups": [flat_0, flat_1, ...]},     # the fp32 master of each block
     "ds_version": ..., "sofx": {...}}                    # "sofx": what sofx needs to check the layout

Blocks: for the functional API a block is a param group (see
:mod:`sofx.checkpoint.groups`): its leaves packed in order into one flat
float32 tensor (:func:`sofx.tree.pack`), one param group entry per block, as
DeepSpeed's sub-groups. (DeepSpeed splits a param group into sub-groups of
about ``sub_group_size`` elements, one block each, and its group entry lists
them all: ``"params": [0, 1]``; :func:`load_zero3` reads that too, each block
with its group's hyperparameters.) Partitioning is ZeRO-3's: every parameter of ``n``
elements is split into ``W`` pieces of ``ceil(n / W)`` elements (the last
zero-padded) and rank ``r``'s flat block is the concatenation of its pieces of
the block's parameters -- the layout ``deepspeed.utils.zero_to_fp32`` reads.

These files are ``torch.save`` files by definition (a zip holding a pickle of
plain containers and tensors). sofx writes only plain containers, numbers,
strings and tensors, and reads them with ``torch.load(weights_only=True)``,
which refuses to build any other object: nothing from the file is executed.
DeepSpeed's own files also pickle its ``ZeroStageEnum`` and its loss scaler
object (``LossScaler``/``DynamicLossScaler``); the importer reads those into
inert stand-ins (:data:`DEEPSPEED_STAND_INS`, an int and a record of plain
attributes) without importing DeepSpeed, so real DeepSpeed files load too.
On export, sofx writes DeepSpeed's own loss scaler object and stage enum when
the ``deepspeed`` package is installed (``deepspeed_objects=True``: DeepSpeed's
engine can then resume from the files), else a plain dict and an int
(``zero_to_fp32`` and sofx read those; DeepSpeed's engine needs its objects).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import math
import os
import pickle
import re
import threading
from typing import Any, Mapping, Sequence

import optree
import torch

from sofx import tree
from sofx.adam import Adam, AdamHParams, AdamState, refused_torch_option
from sofx.checkpoint.atomic import atomic_write
from sofx.checkpoint.errors import (CheckpointError, CheckpointMismatchError, CheckpointNotFoundError,
                                    CheckpointVersionError, CorruptCheckpointError, check_path, system_error)
from sofx.checkpoint.groups import (ParamGroup, check_params_template, hparams_tree, is_saved_flag, prefix_ids,
                                    refuse_uninitialized, resolve_groups, saved_hparams)
from sofx.checkpoint.io import template_device
from sofx.errors import HParamError, UnsupportedError
from sofx.kernels.base import as_number
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.kernels.user_numbers import flag, integer
from sofx.loss_scale import (GROWTH_RULES, DynamicLossScaleRule, DynamicLossScaleState, StaticScaleRule,
                             StaticScaleState, deepspeed_scaler, static_scale)
from sofx.stored_values import refuse_beyond, refuse_negative

__all__ = ["zero3_file_name", "model_states_file_name", "param_names", "save_zero3", "load_zero3",
           "load_zero3_loss_scaler", "partition_numel", "DEEPSPEED_STAND_INS"]

FORMAT_VERSION = 1
# (``_?``: DeepSpeed's engine still reads its old name ``..._mp_rank_00optim_states.pt`` where the new one is missing)
_FILE_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(?P<mp>\d{2,})_?optim_states\.pt$")
_MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(?P<mp>\d{2,})_model_states\.pt$")


def _block_named(b: int, group: ParamGroup, paths: Sequence[str]) -> str:
    """Block ``b`` (of ``group``'s leaves) for a message: ``block 2 (params['w'])``, ``block 0 (params['a']...)``
    where it holds more leaves than its first."""
    more = "..." if len(group.leaves) > 1 else ""
    return f"block {b} ({paths[group.leaves[0]]}{more})"


def zero3_file_name(dp_rank: int, mp_rank: int = 0, bf16: bool = False) -> str:
    """``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`` (ranks integers >= 0, else a
    :class:`CheckpointError` naming the argument)."""
    dp_rank, mp_rank = _ranks(dp_rank, mp_rank)
    bf16 = flag("bf16", bf16, CheckpointError)
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def _ranks(dp_rank: Any, mp_rank: Any) -> tuple[int, int]:
    """``dp_rank, mp_rank`` as Python ints >= 0 (numpy's and 1-element integer tensors too), else a
    :class:`CheckpointError` naming the argument (1.5 named a file DeepSpeed never reads)."""
    return integer("dp_rank", dp_rank, 0, CheckpointError), integer("mp_rank", mp_rank, 0, CheckpointError)


def partition_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's piece of a parameter of ``numel`` elements (ZeRO-3: ``ceil(numel / W)``)."""
    return math.ceil(numel / world_size)


def _first_layout_difference(saved: Any, here: list) -> str:
    """Where the block layout recorded in a file first differs from the one resolved for the load."""
    if not isinstance(saved, list) or len(saved) != len(here):
        return (f"the file's block layout has {len(saved) if isinstance(saved, list) else '?'} blocks, the load "
                f"resolves {len(here)}")
    for b, (a, h) in enumerate(zip(saved, here)):
        if a != h:
            for k, (x, y) in enumerate(zip(a, h)):
                if x != y:
                    return f"block {b}, leaf {k}: the file holds {x}, the load puts {y} there"
            return f"block {b}: the file holds {len(a)} leaves, the load {len(h)}"
    return "the block layouts differ"


def _pieces(leaves: Sequence[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """Rank ``r``'s flat float32 block: the concatenation of its piece of every leaf."""
    sizes = [partition_numel(t.numel(), world_size) for t in leaves]
    out = [torch.zeros(sum(sizes), dtype=torch.float32) for _ in range(world_size)]
    offset = 0
    for t, pn in zip(leaves, sizes):
        flat = t.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        for r in range(world_size):
            piece = flat[r * pn:(r + 1) * pn]
            out[r][offset:offset + piece.numel()].copy_(piece)
        offset += pn
    return out


def _block_count(counts: list[Any], g: ParamGroup, paths: list[str]) -> int:
    """The one step count of block ``g``: its leaves' counts, each a concrete integer >= 0, all equal."""
    values = [as_number(counts[i], f"state.count{paths[i][len('params'):]}", CheckpointError) for i in g.leaves]
    for i, v in zip(g.leaves, values):
        if not isinstance(v, int):
            raise CheckpointError(f"state.count{paths[i][len('params'):]}: expected a concrete 0-d int64 tensor")
        if v < 0:  # (update refuses it, and load_zero3 a file holding it)
            raise CheckpointError(f"state.count{paths[i][len('params'):]}: expected a step count >= 0, got {v}")
    if len(set(values)) > 1:
        detail = ", ".join(f"{paths[i]}: {v}" for i, v in zip(g.leaves, values))
        raise UnsupportedError(f"a ZeRO-3 block has one step count, the leaves of this block differ ({detail}); "
                               "put leaves stepped a different number of times into different groups")
    return values[0] if values else 0


def save_zero3(directory: str | os.PathLike, opt: Adam, params: Any, state: AdamState, hparams: Any = None, *,
               groups: Sequence[Sequence[Any]] | None = None, dp_world_size: int = 1, mp_rank: int = 0,
               bf16: bool | None = None, loss_scaler: dict | tuple | None = None, model_states: bool = False,
               deepspeed_objects: bool | None = None) -> list[str]:
    """Write the DeepSpeed ZeRO-3 optimizer files of ``(params, state)`` into ``directory``; returns their paths.

    One file per rank ``0..dp_world_size-1``, each written atomically (the
    set of files is not one atomic unit, as with DeepSpeed); then this
    ``mp_rank``'s files of an older save that the new set does not overwrite
    (more dp ranks, the other ``bf16_`` prefix) are removed, so the directory
    holds one consistent checkpoint (every rank of a run may save the same checkpoint at once: each writes the
    same files, and a file another rank removed first is not an error). ``bf16`` sets the
    ``bf16_`` file prefix (default: when a params leaf is bfloat16).
    ``loss_scaler``: sofx's loss scaler as a ``(rule, state)`` pair
    (:func:`sofx.loss_scale.deepspeed_scaler` or ``static_scale``, see
    :func:`deepspeed_loss_scaler`), or its attributes as DeepSpeed names them;
    a dynamic one must have every attribute DeepSpeed's ``update_scale``
    reads (``DEEPSPEED_DYNAMIC_ATTRIBUTES``); either is refused before any
    file is written where no DeepSpeed run holds it (what
    :func:`load_zero3_loss_scaler` refuses to read back);
    ``None``: a static scale of 1 (bf16/fp32 training).
    ``deepspeed_objects``: store the loss scaler as DeepSpeed's own
    ``LossScaler``/``DynamicLossScaler`` object and the stage as its
    ``ZeroStageEnum``, which DeepSpeed's engine needs to resume
    (``engine.load_checkpoint``) from the files; needs the ``deepspeed``
    package (default: when it is installed). Otherwise they are stored as a
    plain dict and an int (enough for ``zero_to_fp32`` and for sofx).
    """
    directory = check_path("save_zero3", directory)  # (text: a directory in bytes too)
    if not isinstance(opt, Adam):
        raise CheckpointError(f"save_zero3: opt must be a sofx Adam, got {type(opt).__name__}")
    # Python ints (numpy's were refused; a bool was taken, into file names and partition_count)
    dp_world_size = integer("save_zero3: dp_world_size", dp_world_size, 1, CheckpointError)
    mp_rank = integer("save_zero3: mp_rank", mp_rank, 0, CheckpointError)
    bf16 = _optional_flag("save_zero3: bf16", bf16)  # ("no" was true: bf16_ files)
    model_states = flag("save_zero3: model_states", model_states, CheckpointError)
    deepspeed_objects = _optional_flag("save_zero3: deepspeed_objects", deepspeed_objects)
    if not isinstance(state, AdamState):
        raise CheckpointError(f"save_zero3: expected an AdamState, got {type(state).__name__}")
    # (a pair: a plain tuple; a rule's state alone, a NamedTuple of two fields, is no pair of a rule and a state)
    if type(loss_scaler) is tuple and len(loss_scaler) == 2:
        loss_scaler = deepspeed_loss_scaler(*loss_scaler)
    if loss_scaler is not None and not isinstance(loss_scaler, dict):  # (5: Python's bare TypeError, merged below)
        raise CheckpointError(f"save_zero3: loss_scaler must be None, a (rule, state) pair or a dict of DeepSpeed's "
                              f"loss-scaler attributes, got {type(loss_scaler).__name__} {loss_scaler!r:.80}")
    _check_plain(loss_scaler, "loss_scaler")
    p_leaves, spec = tree.flatten(params)
    paths = tree.leaf_paths(spec)
    refuse_uninitialized("save_zero3", p_leaves, paths)
    counts = tree.flatten_up_to(spec, state.count, "state.count")
    mus = tree.flatten_up_to(spec, state.mu, "state.mu")
    nus = tree.flatten_up_to(spec, state.nu, "state.nu")
    for path, p, m, v in zip(paths, p_leaves, mus, nus):
        for name, t in (("param", p), ("state.mu", m), ("state.nu", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{path}: {name} must be a tensor of the parameter's shape")
            if t.layout != torch.strided or t.device.type == "meta":  # (torch's bare errors from the copy)
                what = f"of layout {t.layout}" if t.layout != torch.strided else "on the meta device"
                raise CheckpointError(f"{path}: {name} is a tensor {what}, which has no dense data to store")
            if not in_storage(t):  # (freed, as FSDP frees tensors, or shrunk: torch's view of it failed)
                refuse_short_storage(t, path if name == "param" else name + path[len("params"):], CheckpointError)
            if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                # the layout's flat groups are float32: wider values would be rounded without a word
                raise UnsupportedError(f"{path}: {name} has dtype {t.dtype}; the ZeRO-3 layout stores float32 (from "
                                       "float32, bfloat16 or float16); use sofx.checkpoint.save for other dtypes")
            if name == "state.nu":  # (load_zero3 refuses the file back as corrupt)
                refuse_negative(t.detach(), "second moment", name + path[len("params"):], CheckpointError)
    # (float32: the layout's flat groups are, and load_zero3 refuses what float32 cannot hold for such leaves)
    resolved = resolve_groups(opt, spec, hparams, groups, exported=True, float32=True)
    names = param_names(params) if model_states else []  # (refused before any file is written)
    if bf16 is None:
        bf16 = any(p.dtype == torch.bfloat16 for p in p_leaves)
    steps = [_block_count(counts, g, paths) for g in resolved]
    masters = [_pieces([p_leaves[i] for i in g.leaves], dp_world_size) for g in resolved]
    exp_avgs = [_pieces([mus[i] for i in g.leaves], dp_world_size) for g in resolved]
    exp_avg_sqs = [_pieces([nus[i] for i in g.leaves], dp_world_size) for g in resolved]
    param_groups = [{"lr": g.hparams.lr, "betas": (g.hparams.beta1, g.hparams.beta2), "eps": g.hparams.eps,
                     "weight_decay": g.hparams.weight_decay, "bias_correction": opt.variant.bias_correction,
                     "amsgrad": False, "params": [b]} for b, g in enumerate(resolved)]
    layout = {"format_version": FORMAT_VERSION, "decoupled": opt.variant.decoupled,
              "bias_correction": opt.variant.bias_correction,
              "blocks": [[[paths[i], list(p_leaves[i].shape)] for i in g.leaves] for g in resolved]}
    scaler_attrs = {"cur_scale": 1.0, "dynamic": False, **(loss_scaler or {})}
    dynamic = bool(scaler_attrs["dynamic"])
    missing = [a for a in DEEPSPEED_DYNAMIC_ATTRIBUTES if a not in scaler_attrs] if dynamic else []
    if missing:
        raise CheckpointError(f"save_zero3: a dynamic loss_scaler needs {missing} too (DeepSpeed's update_scale "
                              "and load_zero3_loss_scaler read them); pass loss_scaler=(rule, state), sofx's own "
                              "deepspeed_scaler() rule and its state")
    _check_scaler_attributes(scaler_attrs)  # as a (rule, state) pair is, before any file is written
    stage, scaler = 3, scaler_attrs
    if deepspeed_objects is None:
        deepspeed_objects = importlib.util.find_spec("deepspeed") is not None
    if deepspeed_objects:
        stage, scaler = _deepspeed_objects(scaler_attrs)
    _make_directory(directory)
    written = []
    for r in range(dp_world_size):
        inner = {"state": {b: {"step": steps[b], "exp_avg": exp_avgs[b][r], "exp_avg_sq": exp_avg_sqs[b][r]}
                           for b in range(len(resolved))},
                 "param_groups": param_groups}
        zero = {"zero_stage": stage, "loss_scaler": scaler, "dynamic_loss_scale": dynamic,
                "overflow": False, "partition_count": dp_world_size, "optimizer_state_dict": inner,
                "fp32_flat_groups": [masters[b][r] for b in range(len(resolved))]}
        payload = {"optimizer_state_dict": zero, "ds_version": "sofx", "sofx": dict(layout, dp_rank=r)}
        path = os.path.join(os.fspath(directory), zero3_file_name(r, mp_rank, bf16))
        written.append(atomic_write(path, lambda tmp, obj=payload: torch.save(obj, tmp)))
    if model_states:
        shapes = [collections.OrderedDict((names[i], torch.Size(p_leaves[i].shape)) for i in g.leaves)
                  for g in resolved]
        global_steps = max(steps, default=0)
        # as DeepSpeed's ZeRO-3 engine writes it: the module's parameters are empty placeholders (the weights
        # are the fp32 flat groups of the optimizer files)
        module = collections.OrderedDict((names[i], torch.empty(0, dtype=p_leaves[i].dtype)) for g in resolved
                                         for i in g.leaves)
        states = {"module": module, "buffer_names": [], "param_shapes": shapes,
                  "frozen_param_shapes": collections.OrderedDict(),
                  "frozen_param_fragments": collections.OrderedDict(), "shared_params": {}, "optimizer": None,
                  "lr_scheduler": None,
                  "data_sampler": None, "random_ltd": None, "sparse_tensor_module_names": [],
                  "skipped_steps": 0, "global_steps": global_steps, "global_samples": 0,
                  "dp_world_size": dp_world_size, "mp_world_size": 1, "ds_version": "sofx"}
        for r in range(dp_world_size):
            path = os.path.join(os.fspath(directory), model_states_file_name(r, mp_rank))
            written.append(atomic_write(path, lambda tmp: torch.save(states, tmp)))
    _remove_older_files(os.path.abspath(os.fspath(directory)), mp_rank, {os.path.abspath(w) for w in written})
    return written


def _make_directory(directory: str | os.PathLike) -> None:
    """Create ``directory`` (and its parents) if missing. A path that is a file is refused with a
    :class:`CheckpointError`, and the system's refusal (a read-only parent, a parent that is a file) raised as a
    :class:`CheckpointIOError` naming the directory (an ``OSError`` too, the cause chained), not ``os.makedirs``'s
    bare error."""
    if os.path.isfile(directory):
        raise CheckpointError(f"save_zero3: {os.fspath(directory)} is a file, not a directory; the ZeRO-3 layout "
                              "is a directory of files (name its tag directory, e.g. .../global_step100)")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise system_error(f"save_zero3: cannot create the ZeRO-3 checkpoint directory "
                           f"{os.fspath(directory)}: {type(exc).__name__}: {exc}", exc.errno) from exc


def _remove_older_files(directory: str, mp_rank: int, keep: set[str]) -> None:
    """Remove ``mp_rank``'s ZeRO-3 optimizer and model files in ``directory`` other than ``keep`` (an older save
    with more dp ranks or the other prefix: loading would read them as part of the new one, or refuse). A file
    already gone when it is removed (another rank saving the same checkpoint at once removed it) is fine; one the
    system will not remove is a :class:`CheckpointIOError` (its ``errno`` the system's) naming it, and so is a
    directory it will not list (written, not read: mode -wx)."""
    try:
        names = os.listdir(directory)
    except OSError as exc:  # (os.listdir's bare PermissionError, after the new files were written)
        raise system_error(f"save_zero3: the new save's files are written; the directory {directory} "
                           f"cannot be listed ({type(exc).__name__}: {exc}) for an older save's files (more "
                           "dp ranks, the other prefix), which a load reads as part of the new one or "
                           "refuses: remove any there", exc.errno) from exc
    for name in names:
        m = _FILE_RE.match(name) or _MODEL_FILE_RE.match(name)
        path = os.path.join(directory, name)
        if m and int(m.group("mp")) == mp_rank and path not in keep:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # (the system's refusal: a bare PermissionError after the new files were written)
                raise system_error(f"save_zero3: the new save's files are written; an older save's file "
                                   f"{path} cannot be removed ({type(exc).__name__}: {exc}), and a load of "
                                   f"{directory} reads it as part of the new one or refuses: remove it",
                                   exc.errno) from exc


def model_states_file_name(dp_rank: int, mp_rank: int = 0) -> str:
    """``zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt`` (DeepSpeed ZeRO-3's per-rank model file; ranks as
    :func:`zero3_file_name` takes them)."""
    dp_rank, mp_rank = _ranks(dp_rank, mp_rank)
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def _deepspeed_objects(scaler_attrs: dict) -> tuple[Any, Any]:
    """DeepSpeed's ``ZeroStageEnum.weights`` and its loss scaler object holding ``scaler_attrs`` exactly
    (built without running its constructor, so every attribute is the one given)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
    except ImportError as exc:
        raise UnsupportedError(f"save_zero3(deepspeed_objects=True) needs the deepspeed package: {exc}") from None
    cls = DynamicLossScaler if scaler_attrs.get("dynamic") else LossScaler
    scaler = cls.__new__(cls)
    scaler.__dict__.update(scaler_attrs)
    if scaler_attrs.get("dynamic"):
        scaler.__dict__.setdefault("dtype", torch.half)  # dynamic loss scaling is fp16 training's
    return ZeroStageEnum.weights, scaler


# What DeepSpeed's DynamicLossScaler.update_scale reads (besides ``dtype``, fp16 for a dynamic scaler)
DEEPSPEED_DYNAMIC_ATTRIBUTES = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
                                "min_scale", "delayed_shift", "cur_hysteresis", "consecutive_hysteresis",
                                "raise_error_at_min_scale")


def deepspeed_loss_scaler(rule: Any, state: Any) -> dict:
    """DeepSpeed's loss-scaler attributes for sofx's ``rule`` and ``state``: a
    :class:`~sofx.loss_scale.DynamicLossScaleRule` (``deepspeed_scaler()``) gives a ``DynamicLossScaler``'s,
    which DeepSpeed's engine resumes from; a :class:`~sofx.loss_scale.StaticScaleRule` a ``LossScaler``'s.
    torch's GradScaler rule has no DeepSpeed counterpart."""
    if isinstance(rule, DynamicLossScaleRule) and isinstance(state, DynamicLossScaleState):
        try:  # a state no run of the rule reaches: DeepSpeed would take it, load_zero3_loss_scaler refuses it
            rule.check_reachable(state, "loss_scaler")
        except HParamError as exc:
            raise CheckpointError(f"save_zero3: {exc}") from None
        return {"cur_scale": float(state.scale), "dynamic": True, "cur_iter": int(state.cur_iter),
                "last_overflow_iter": int(state.last_overflow_iter), "scale_factor": float(rule.scale_factor),
                "scale_window": int(rule.scale_window), "min_scale": float(rule.min_scale),
                "delayed_shift": int(rule.delayed_shift), "cur_hysteresis": int(state.cur_hysteresis),
                "consecutive_hysteresis": bool(rule.consecutive_hysteresis),
                "raise_error_at_min_scale": bool(rule.raise_error_at_min_scale)}
    if isinstance(rule, StaticScaleRule) and isinstance(state, StaticScaleState):
        return {"cur_scale": float(state.scale), "dynamic": False}
    raise CheckpointError(f"loss_scaler: {tree.article(type(rule).__name__)} with {tree.article(type(state).__name__)} "
                          "has no DeepSpeed counterpart; expected deepspeed_scaler() or static_scale() with its state")


def _check_plain(x: Any, where: str) -> None:
    if x is None or isinstance(x, (bool, int, float, str)):
        return
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where}: keys must be str or int, got {k!r}")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _check_plain(v, f"{where}[{i}]")
        return
    raise CheckpointError(f"{where}: only plain data (dicts, lists, numbers, strings) can be stored, got "
                          f"{type(x).__name__}")


# ------------------------------------------------------------------------ import
class _DeepSpeedRecord:
    """Stand-in for an object DeepSpeed pickles into its files (its loss scaler): keeps the attributes as data.

    ``torch.load(weights_only=True)`` builds it from the allow-list below
    instead of importing DeepSpeed: creating it runs no code from the file.
    """

    def as_dict(self) -> dict:
        return {"class": type(self).__qualname__, **vars(self)}


def _record_class(module: str, name: str) -> type:
    cls = type(name, (_DeepSpeedRecord,), {})
    cls.__module__, cls.__qualname__ = module, name
    return cls


class _ZeroStageEnum(int):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an IntEnum): just its int value."""


_ZeroStageEnum.__module__, _ZeroStageEnum.__qualname__ = "deepspeed.runtime.zero.config", "ZeroStageEnum"

# The DeepSpeed objects a ZeRO-3 optimizer file may hold besides plain data and tensors.
DEEPSPEED_STAND_INS = (
    _ZeroStageEnum,
    _record_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    _record_class("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
)


def _plain(x: Any) -> Any:
    """Stand-ins turned into plain data (an int for the stage, a dict for a loss scaler)."""
    if isinstance(x, _ZeroStageEnum):
        return int(x)
    if isinstance(x, _DeepSpeedRecord):
        return x.as_dict()
    return x


# torch.serialization.safe_globals() edits torch's process-wide allow-list for the duration of the block;
# serialise our loads so that one thread leaving the block cannot drop the list another one is reading with.
_SAFE_GLOBALS_LOCK = threading.Lock()


def _torch_load(path: str, kind: str = "optimizer") -> Any:
    """The contents of the ZeRO-3 ``kind`` file ("optimizer", "model states") ``path``, read with
    ``torch.load(weights_only=True)`` and :data:`DEEPSPEED_STAND_INS`: a :class:`CheckpointNotFoundError` where it
    does not exist, a :class:`CheckpointIOError` (its ``errno`` the system's) where the system does not let this
    process read it (no read permission), a :class:`CorruptCheckpointError` where it is damaged or holds objects
    the unpickler refuses."""
    try:
        with _SAFE_GLOBALS_LOCK, torch.serialization.safe_globals(list(DEEPSPEED_STAND_INS)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"ZeRO-3 checkpoint file {path} does not exist") from None
    except OSError as exc:
        if exc.errno is None:  # (not the system's: torch's own reading of a damaged file)
            raise _corrupt_file(path, kind, exc) from None
        raise system_error(f"cannot read the ZeRO-3 {kind} file {path}: {exc}", exc.errno) from exc
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError,
            KeyError, IndexError, TypeError) as exc:  # (torch's weights-only unpickler on a damaged pickle)
        raise _corrupt_file(path, kind, exc) from None


def _corrupt_file(path: str, kind: str, exc: BaseException) -> CorruptCheckpointError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CorruptCheckpointError(f"{path} cannot be read safely as a ZeRO-3 {kind} file: {first} (files are read "
                                  "with torch.load(weights_only=True), which refuses arbitrary objects)")


def _optional_flag(name: str, value: Any) -> bool | None:
    """``value`` as None or a Python bool (:func:`~sofx.kernels.user_numbers.flag`), else a CheckpointError."""
    return None if value is None else flag(name, value, CheckpointError)


def _tag_directories_hint(directory: str, mp_rank: int) -> str:
    """Where ``directory`` is a checkpoint root (DeepSpeed's engine reads the tag from its ``latest`` file, which
    sofx does not write): the subdirectories holding ZeRO-3 optimizer files of ``mp_rank``, as the tail of the
    error that ``directory`` holds none; ``""`` where none do."""
    def holds_files(sub: str) -> bool:
        with contextlib.suppress(OSError):
            return any((m := _FILE_RE.match(name)) and int(m.group(3)) == mp_rank for name in os.listdir(sub))
        return False

    tags = [name for name in sorted(os.listdir(directory)) if holds_files(os.path.join(directory, name))]
    return f"; name a tag directory below it: {', '.join(tags)} hold ZeRO-3 files" if tags else ""


def _find_files(directory: str, mp_rank: int, bf16: bool | None) -> tuple[list[str], bool]:
    """The ZeRO-3 optimizer files of ``mp_rank`` in ``directory``, one per dp rank ``0..W-1`` in rank order, and
    whether they are the ``bf16_`` ones (``bf16=None``: those present). Ranks are read as numbers (DeepSpeed
    writes ``zero_pp_rank_1``; ``zero_pp_rank_01`` is rank 1 too), and DeepSpeed's old name
    ``..._mp_rank_00optim_states.pt`` is read as its engine reads it: two files of one rank are refused, naming
    both (which one is rank 1's?)."""
    if os.path.isfile(directory):
        raise CheckpointError(f"ZeRO-3 checkpoint directory {directory} is a file, not a directory; name the "
                              "directory that holds the zero_pp_rank_* files (the tag directory, e.g. "
                              ".../global_step100)")
    if not os.path.isdir(directory):
        raise CheckpointNotFoundError(f"ZeRO-3 checkpoint directory {directory} does not exist")
    found: dict[bool, dict[int, list[str]]] = {False: {}, True: {}}
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:  # (no read permission: os.listdir's bare PermissionError)
        raise system_error(f"cannot list the ZeRO-3 checkpoint directory {directory}: {exc}", exc.errno) from exc
    for name in names:
        m = _FILE_RE.match(name)
        if m and int(m.group(3)) == mp_rank:
            found[m.group(1) is not None].setdefault(int(m.group(2)), []).append(name)
    if bf16 is None:
        if found[True] and found[False]:
            raise CheckpointError(f"{directory} holds both bf16_ and plain ZeRO-3 optimizer files for mp rank "
                                  f"{mp_rank}; pass bf16=True or False")
        bf16 = bool(found[True])
    named = found[bf16]
    for dp, names in sorted(named.items()):
        if len(names) > 1:
            raise CorruptCheckpointError(f"{directory} holds {len(names)} ZeRO-3 optimizer files for dp rank {dp} of "
                                         f"mp rank {mp_rank}: {' and '.join(names)}; remove those that are not part "
                                         "of the checkpoint")
    ranks = {dp: os.path.join(directory, names[0]) for dp, names in named.items()}
    if not ranks:
        raise CheckpointNotFoundError(f"no {zero3_file_name(0, mp_rank, bf16)} (or other dp ranks) in {directory}"
                                      f"{_tag_directories_hint(directory, mp_rank)}")
    world = len(ranks)
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        raise CorruptCheckpointError(f"{directory}: ZeRO-3 files of dp ranks {missing} are missing "
                                     f"(found ranks {sorted(ranks)})")
    return [ranks[r] for r in range(world)], bf16


def _get(d: Any, key: str, path: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict) or key not in d or not isinstance(d[key], kind):
        raise CorruptCheckpointError(f"{path}: expected the DeepSpeed ZeRO-3 layout, missing or bad {key!r}")
    return d[key]


def _step_value(x: Any, where: str) -> int:
    """A file's step as sofx counts it: an integer value in ``[0, 2**63)`` (an int64 count; inf, nan and values
    beyond are a corrupt file, checked before ``int()``, which fails on inf)."""
    v = as_number(x) if isinstance(x, torch.Tensor) else x
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not 0 <= v < 2 ** 63 or int(v) != v:
        raise CorruptCheckpointError(f"{where}: step must be a non-negative integer below 2**63, got {x!r}")
    return int(v)


def _block_owners(saved_groups: Sequence[Any], n_blocks: int, path: str) -> list[dict]:
    """The param group of each flat block: the wrapped optimizer's groups list the blocks' ids, which its
    ``state_dict()`` numbers ``0..n_blocks-1`` in group order (the ids of its ``state``). ZeRO-3 splits a param
    group into sub-groups of about ``sub_group_size`` elements, one flat block each, so a group lists one block or
    several (:func:`save_zero3` writes one per group). Anything else is a :class:`CorruptCheckpointError`."""
    owners: list[dict] = []
    for gi, group in enumerate(saved_groups):
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
            raise CorruptCheckpointError(f"{path}: param_groups[{gi}] must be a dict whose 'params' lists flat block "
                                         f"ids (ints), got {str(ids if isinstance(group, dict) else group)[:80]}")
        owners.extend(group for _ in ids)
    listed = [i for group in saved_groups for i in group["params"]]
    if listed != list(range(n_blocks)):
        raise CorruptCheckpointError(f"{path}: the param groups list the flat blocks {str(listed)[:80]}; expected "
                                     f"each of the {n_blocks} flat blocks once, in order (0 to {n_blocks - 1}), as "
                                     "an optimizer's state_dict() numbers them")
    return owners


def _recorded_layout_refusal(path: str, recorded_groups: list[list[Any]], exc: CheckpointError) -> CheckpointError:
    """The error for params that the leaf layout recorded in the sofx-written file ``path`` does not fit (params
    of another structure than the saved ones): names the file, the leaves it records and the way out, where
    :func:`resolve_groups`'s own error spoke of a ``groups:`` argument the caller did not pass."""
    leaves = [leaf for block in recorded_groups for leaf in block]
    shown = ", ".join(f'"{leaf}"' for leaf in leaves[:8]) + (", ..." if len(leaves) > 8 else "")
    reason = str(exc).removeprefix("groups: ")
    return CheckpointMismatchError(f"{path}: the layout the file records does not fit params ({reason}); it "
                                   f"records the leaves [{shown}]: pass params in the structure they were saved "
                                   "in, or groups= naming params' leaves per block")


def load_zero3(directory: str | os.PathLike, opt: Adam, params: Any, hparams: Any = None, *,
               groups: Sequence[Sequence[Any]] | None = None, mp_rank: int = 0,
               bf16: bool | None = None) -> tuple[Any, AdamState, Any]:
    """Read the ZeRO-3 optimizer files in ``directory``: returns ``(params, state, hparams)``.

    ``params`` is the template: the blocks are unpacked into its leaves'
    shapes, dtypes (the fp32 master is cast to each leaf's dtype) and devices (a meta leaf's: the CPU);
    moments come back in ``opt.state_dtype`` (the leaf's dtype when ``None``); a value beyond the range of the
    dtype it is cast to (a second moment over 65504 into float16) is refused, naming it, not made inf.
    Block layout: with ``groups``, as given (checked against the layout a sofx-written file records);
    else, when the directory holds
    DeepSpeed's ``zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt`` (DeepSpeed
    writes it; :func:`save_zero3` with ``model_states=True`` too), from its
    ``param_shapes``: parameter names in model order per group, matched to the
    params leaves by :func:`param_names` (so ``dict(model.named_parameters())``
    or the module's nested structure map by name, whatever the tree's key order);
    else, for a file sofx wrote, the layout it records (leaf paths per block); else from ``hparams`` as for
    :func:`save_zero3`. The returned hparams carry
    the file's values (in the structure of ``hparams`` when given: where the layout comes from the files, an
    entry of it over blocks of different values is refused). ``bf16=None``
    picks the files present (``bf16_`` prefixed or not). Every dp rank's file
    must be there.
    """
    directory = check_path("load_zero3", directory)  # (text: a directory in bytes too)
    if not isinstance(opt, Adam):
        raise CheckpointError(f"load_zero3: opt must be a sofx Adam, got {type(opt).__name__}")
    mp_rank = integer("load_zero3: mp_rank", mp_rank, 0, CheckpointError)  # (1.5 raised a ValueError from a format)
    bf16 = _optional_flag("load_zero3: bf16", bf16)
    p_leaves, spec = tree.flatten(params)
    paths = tree.leaf_paths(spec)
    check_params_template("load_zero3", p_leaves, paths)
    files, _ = _find_files(directory, mp_rank, bf16)
    first = _torch_load(files[0])
    from_file = False
    if groups is None:
        groups = _groups_from_model_states(directory, mp_rank, params, p_leaves)
        from_file = groups is not None
    recorded_groups = None
    if groups is None:  # the layout sofx recorded in the file (save_zero3's groups=, whatever the tree's order)
        recorded = first.get("sofx", {}).get("blocks") if isinstance(first, dict) and \
            isinstance(first.get("sofx"), dict) else None
        if isinstance(recorded, list) and all(isinstance(b, list) for b in recorded):
            groups = recorded_groups = [[leaf[0] for leaf in block if isinstance(leaf, list) and leaf]
                                        for block in recorded]
            from_file = True
    if from_file and hparams is not None:  # (a template only, but one update takes: 5 came back as AdamHParams)
        opt.resolve_hparams(hparams, spec)
    try:
        resolved = resolve_groups(opt, spec, None if from_file else hparams, groups)
    except CheckpointError as exc:
        if recorded_groups is None:  # the caller's groups=, or the model states' names: its own error says it
            raise
        raise _recorded_layout_refusal(files[0], recorded_groups, exc) from exc
    world = len(files)
    ranks = [_read_rank(f, r, world, resolved, p_leaves, paths, opt, first if r == 0 else None)
             for r, f in enumerate(files)]
    group_hp, steps = ranks[0]["hparams"], ranks[0]["steps"]
    for r, rk in enumerate(ranks[1:], start=1):  # (each rank's file holds every block's count and hparams)
        for b, g in enumerate(resolved):
            for what, mine, first in (("step count", rk["steps"][b], steps[b]),
                                      ("hyperparameters", rk["hparams"][b], group_hp[b])):
                if mine != first:
                    raise CorruptCheckpointError(f"{files[r]}: {_block_named(b, g, paths)} has {what} "
                                                 f"{mine}, rank 0's file {first}: the rank files are of different "
                                                 "runs or steps")
    new_p: list[Any] = [None] * len(p_leaves)
    counts: list[Any] = [None] * len(p_leaves)
    mus: list[Any] = [None] * len(p_leaves)
    nus: list[Any] = [None] * len(p_leaves)
    for b, g in enumerate(resolved):
        offset = 0
        for i in g.leaves:
            p = p_leaves[i]
            pn = partition_numel(p.numel(), world)
            state_dtype = opt.state_dtype or p.dtype

            def gather(key: str, dtype: torch.dtype, whose: str) -> torch.Tensor:
                full = torch.cat([rk[key][b][offset:offset + pn] for rk in ranks])[:p.numel()].reshape(p.shape)
                # (a value the cast would make inf: a DeepSpeed fp16 run's second moment over 65504)
                refuse_beyond(full, dtype, f"load_zero3: block {b}'s {key} for {paths[i]}", whose, UnsupportedError)
                return full.to(device=template_device(p), dtype=dtype, copy=True)

            moments = "the optimizer's state_dtype" if opt.state_dtype is not None else "the leaf's dtype"
            new_p[i] = gather("master", p.dtype, "the leaf's dtype")
            mus[i] = gather("exp_avg", state_dtype, moments)
            nus[i] = gather("exp_avg_sq", state_dtype, moments)
            counts[i] = torch.tensor(steps[b], dtype=torch.int64)
            offset += pn
    state = AdamState(tree.unflatten(spec, counts), tree.unflatten(spec, mus), tree.unflatten(spec, nus))
    if from_file and hparams is not None:
        per_leaf = {i: hp for g, hp in zip(resolved, group_hp) for i in g.leaves}
        out_hp = _hparams_like(hparams, spec, per_leaf)
    elif from_file and len(set(group_hp)) == 1:
        out_hp = group_hp[0]  # one set of hyperparameters for every block
    else:
        out_hp = hparams_tree(resolved, group_hp, spec, hparams, groups)
    return tree.unflatten(spec, new_p), state, out_hp


def load_zero3_loss_scaler(directory: str | os.PathLike, *, mp_rank: int = 0, bf16: bool | None = None,
                           growth_rule: str = "stable_interval") -> tuple[Any, Any]:
    """The loss scaler of the ZeRO-3 optimizer files in ``directory`` as sofx's ``(rule, state)``: what
    :func:`save_zero3`'s ``loss_scaler`` stored, or the scaler DeepSpeed's engine saved, so that a resumed
    run goes on with the scale, iteration count, last overflow and hysteresis it had.

    A ``DynamicLossScaler`` gives a :func:`sofx.loss_scale.deepspeed_scaler` rule with its ``scale_window``,
    ``min_scale``, ``delayed_shift`` (hysteresis), ``scale_factor``, ``consecutive_hysteresis`` and
    ``raise_error_at_min_scale``, and its ``DynamicLossScaleState(cur_scale, cur_iter, last_overflow_iter,
    cur_hysteresis)``. The file does not hold the run's initial scale (DeepSpeed keeps only the current one):
    the rule's ``init_scale`` is the current scale, which only :meth:`~sofx.loss_scale.DynamicLossScaleRule.init`
    reads. Nor does it say which window count the DeepSpeed version used: ``growth_rule`` (the pinned
    DeepSpeed's ``"stable_interval"``, or ``"legacy"``). A static ``LossScaler`` gives
    :func:`sofx.loss_scale.static_scale` of its scale (1.0: bf16/fp32 training, :func:`save_zero3`'s default).
    Reads rank 0's file (every rank stores the same scaler); ``mp_rank``, ``bf16`` as for :func:`load_zero3`.
    A scaler no DeepSpeed run holds (a scale that is not a positive finite number or is below the minimum,
    counts below their least values, a last overflow at or after the current iteration, a hysteresis its
    iteration and last overflow cannot leave: :meth:`~sofx.loss_scale.DynamicLossScaleRule.check_reachable`)
    raises :class:`~sofx.checkpoint.CorruptCheckpointError` naming the field."""
    if growth_rule not in GROWTH_RULES:
        raise HParamError(f"growth_rule = {growth_rule!r}; expected one of {GROWTH_RULES}")
    directory = check_path("load_zero3_loss_scaler", directory)  # (text: a directory in bytes too)
    mp_rank = integer("load_zero3_loss_scaler: mp_rank", mp_rank, 0, CheckpointError)
    bf16 = _optional_flag("load_zero3_loss_scaler: bf16", bf16)
    files, _ = _find_files(directory, mp_rank, bf16)
    top = _torch_load(files[0])
    zero = _get(top, "optimizer_state_dict", files[0], dict)
    raw = _plain(_get(zero, "loss_scaler", files[0], (dict, _DeepSpeedRecord)))
    try:
        return _scaler_of_attributes(raw, growth_rule)
    except HParamError as exc:
        raise CorruptCheckpointError(f"{files[0]}: its loss_scaler {raw!r} is not one a DeepSpeed run holds: "
                                     f"{exc}") from None


def _scaler_of_attributes(raw: Mapping[str, Any], growth_rule: str) -> tuple[Any, Any]:
    """sofx's ``(rule, state)`` of DeepSpeed's loss-scaler attributes ``raw`` (``dynamic``, or DeepSpeed's
    ``class`` name, says which kind), under ``growth_rule``; an :class:`HParamError` naming the field where
    ``raw`` is not a scaler a DeepSpeed run holds (a missing or mistyped attribute, a scale that is not a
    positive finite number or is below the minimum, a state the rule cannot reach:
    :meth:`~sofx.loss_scale.DynamicLossScaleRule.check_reachable`)."""
    def attr(name: str, kind: type | tuple[type, ...]) -> Any:
        value = raw.get(name)
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise HParamError(f"loss_scaler has no valid {name!r} (got {value!r})")
        return value

    def number(name: str) -> float:
        value = attr(name, (int, float))
        try:
            return float(value)
        except OverflowError:  # (an int beyond the float range: Python's bare OverflowError)
            raise HParamError(f"loss_scaler[{name!r}] is an int beyond the float range ({value.bit_length()} bits); "
                              "expected a finite number") from None

    scale = number("cur_scale")
    dynamic = attr("dynamic", bool) if "dynamic" in raw else raw.get("class") == "DynamicLossScaler"
    if not (math.isfinite(scale) and scale > 0):
        raise HParamError(f"cur_scale = {scale!r}; expected a finite number > 0")
    if not dynamic:
        rule: Any = static_scale(scale)
        return rule, rule.init()
    hysteresis = attr("delayed_shift", int)
    min_scale = number("min_scale")
    if scale < min_scale:  # (the rule would refuse it as an init_scale below min_scale: the attributes have none)
        raise HParamError(f"loss_scaler['cur_scale'] = {scale!r} is below min_scale = {min_scale!r}; expected "
                          "a scale >= min_scale (DeepSpeed's never goes below it)")
    rule = deepspeed_scaler(init_scale=scale, scale_window=attr("scale_window", int), hysteresis=hysteresis,
                            min_scale=min_scale, scale_factor=number("scale_factor"),
                            consecutive_hysteresis=attr("consecutive_hysteresis", bool),
                            raise_error_at_min_scale=attr("raise_error_at_min_scale", bool),
                            growth_rule=growth_rule)
    state = DynamicLossScaleState(scale, attr("cur_iter", int), attr("last_overflow_iter", int),
                                  attr("cur_hysteresis", int))
    rule.check_reachable(state, "loss_scaler")
    return rule, state


def _check_scaler_attributes(attrs: Mapping[str, Any]) -> None:
    """Refuse (a :class:`CheckpointError` naming the field) loss-scaler attributes that no DeepSpeed run holds,
    under either window count (``GROWTH_RULES``: the files do not say which DeepSpeed version counts how):
    what :func:`load_zero3_loss_scaler` would refuse to read back."""
    first = None
    for growth_rule in GROWTH_RULES:
        try:
            _scaler_of_attributes(attrs, growth_rule)
            return
        except HParamError as exc:
            first = first or exc
    raise CheckpointError(f"save_zero3: {first}")


def _hparams_like(hparams: Any, spec: tree.TreeSpec, per_leaf: dict[int, AdamHParams]) -> Any:
    """The file's hyperparameters in the structure of the ``hparams`` template: each template entry takes the
    values of its leaves. An entry over leaves the files give different values (one ``AdamHParams`` for blocks of
    different lrs) is a :class:`CheckpointMismatchError` naming two of them: the values of one would have been
    those of every leaf under it."""
    ids, leaf_ids = prefix_ids(hparams, spec)
    first: dict[int, int] = {}
    paths = tree.leaf_paths(spec)
    for leaf, gid in enumerate(leaf_ids):
        was = first.setdefault(gid, leaf)
        if per_leaf[leaf] != per_leaf[was]:
            at = tree.leaf_paths(ids, root="hparams")[gid]
            raise CheckpointMismatchError(
                f"load_zero3: hparams: the template's entry at {at} covers leaves the files give other "
                f"hyperparameters: {paths[was]} {_hparams_words(per_leaf[was])}, {paths[leaf]} "
                f"{_hparams_words(per_leaf[leaf])}; pass hparams=None (one per leaf) or a template with an entry "
                "for each block's leaves")
    return optree.tree_map(lambda gid: per_leaf[first[gid]] if gid in first else AdamHParams(), ids)


def _hparams_words(hp: AdamHParams) -> str:
    """``lr=0.02, beta1=0.9, ...``: one block's hyperparameters, as an error names them."""
    return ", ".join(f"{name}={value!r}" for name, value in zip(AdamHParams._fields, hp))


def _name_part(key: Any) -> str:
    """``str(key)``, except for an int whose decimal text Python refuses (more digits than
    ``sys.get_int_max_str_digits()``): its hex text, as :func:`sofx.tree.key_text` writes it."""
    try:
        return str(key)
    except ValueError:
        return tree.key_text(key)


def param_names(params: Any) -> list[str]:
    """DeepSpeed-style names of the leaves of a params tree: their tree paths joined by dots
    (``{"enc": {"w": ...}}`` -> ``"enc.w"``; ``dict(model.named_parameters())`` -> the module's names; an int
    key too long for decimal text in hex)."""
    names = [".".join(_name_part(k) for k in keys) for keys in optree.tree_paths(params)]
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:  # {"a": {"b": x}, "a.b": y}: DeepSpeed's files would hold two parameters of one name
            raise CheckpointError(f"params: leaves {seen[name]} and {i} are both named {name!r} as DeepSpeed names "
                                  "parameters (tree path joined by dots); rename one (a model's named_parameters() "
                                  "never clashes)")
        seen[name] = i
    return names


def _groups_from_model_states(directory: str, mp_rank: int, params: Any,
                              p_leaves: list[Any]) -> list[list[int]] | None:
    """The blocks as DeepSpeed laid them out (``param_shapes`` of the rank-0 model states file: parameter
    names in model order, per group), mapped to the leaves of ``params`` by name; ``None`` without that file."""
    path = os.path.join(directory, model_states_file_name(0, mp_rank))
    if not os.path.exists(path):
        return None
    top = _torch_load(path, "model states")
    shapes = top.get("param_shapes") if isinstance(top, dict) else None
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise CorruptCheckpointError(f"{path}: expected 'param_shapes', a list of name -> shape dicts per group")
    names = param_names(params)
    index = {n: i for i, n in enumerate(names)}
    groups = []
    for gi, group in enumerate(shapes):
        idx = []
        for name, shape in group.items():
            if name not in index:
                raise CheckpointMismatchError(
                    f"{path}: parameter {name!r} (param_shapes[{gi}]) is not a leaf of the params tree; its leaves "
                    f"are named {names[:6]}{' ...' if len(names) > 6 else ''} (tree paths joined by dots)")
            if not (isinstance(shape, (list, tuple)) and all(type(d) is int and d >= 0 for d in shape)):
                # (an int or None raised Python's bare TypeError from tuple(); a str was compared by its characters)
                raise CorruptCheckpointError(f"{path}: param_shapes[{gi}][{name!r}]: expected a shape (a sequence of "
                                             f"sizes, ints >= 0), got {shape!r:.80}")
            i = index[name]
            if tuple(p_leaves[i].shape) != tuple(shape):
                raise CheckpointMismatchError(f"{path}: parameter {name!r} has shape {tuple(shape)} in the checkpoint, "
                                              f"the params tree has {tuple(p_leaves[i].shape)}")
            idx.append(i)
        groups.append(idx)
    return groups


# A file's param group options read as on/off (torch.optim's, DeepSpeed's Adam's and FusedAdam's): each a bool
# (Python's or numpy's) or the int 0 or 1 where a group holds it (None: not said, but of bias_correction, which
# DeepSpeed's Adam always writes: a group without it is bias-corrected)
_FLAG_KEYS = ("bias_correction", "amsgrad", "maximize", "decoupled_weight_decay", "adam_w_mode")


def _read_rank(path: str, rank: int, world: int, resolved: list[ParamGroup], p_leaves: list[Any],
               paths: list[str], opt: Adam, top: Any = None) -> dict:
    """Rank ``rank``'s file (the rank its name says), checked against the layout and, where sofx wrote it,
    against the dp rank it records (``top``: its contents, if loaded already)."""
    if top is None:
        top = _torch_load(path)
    zero = _get(top, "optimizer_state_dict", path, dict)
    zero = {k: _plain(v) for k, v in zero.items()}
    if zero.get("zero_stage") != 3:
        raise CheckpointVersionError(f"{path}: zero_stage is {zero.get('zero_stage')!r}; only ZeRO stage 3 files "
                                     "are supported")
    partitions = zero.get("partition_count")
    if isinstance(partitions, list) and partitions and all(type(n) is int for n in partitions):
        partitions = max(partitions)
    if partitions != world:
        raise CorruptCheckpointError(f"{path}: partition_count is {partitions!r} but {world} dp rank files were "
                                     "found: a rank's file is missing or left over from another run")
    sofx_meta = top.get("sofx") if isinstance(top, dict) else None
    if isinstance(sofx_meta, dict):
        version = sofx_meta.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointVersionError(f"{path}: written by sofx in layout version {version!r}; this sofx reads "
                                         f"version {FORMAT_VERSION}")
        recorded = sofx_meta.get("dp_rank")
        if recorded is not None and (type(recorded) is not int or recorded != rank):
            # (swapped or renamed rank files: the sizes agree, each piece would land in another rank's place)
            raise CorruptCheckpointError(f"{path}: written for dp rank {recorded!r}, its name says dp rank {rank}; "
                                         "rank files were swapped or renamed")
        if sofx_meta.get("decoupled") is not None and sofx_meta["decoupled"] != opt.variant.decoupled:
            raise UnsupportedError(f"{path}: written by an optimizer with decoupled={sofx_meta['decoupled']}, "
                                   f"loading into one with decoupled={opt.variant.decoupled}")
        saved_blocks = sofx_meta.get("blocks")
        if saved_blocks is not None:  # the leaves of each block, as written: another grouping would mix them up
            here = [[[paths[i], list(p_leaves[i].shape)] for i in g.leaves] for g in resolved]
            if saved_blocks != here:
                raise CheckpointMismatchError(f"{path}: {_first_layout_difference(saved_blocks, here)}; pass the "
                                              "groups= it was saved with")
    inner = _get(zero, "optimizer_state_dict", path, dict)
    flats = _get(zero, "fp32_flat_groups", path, (list, tuple))
    saved_groups = _get(inner, "param_groups", path, (list, tuple))
    saved_state = _get(inner, "state", path, dict)
    if len(flats) != len(resolved):
        raise CheckpointMismatchError(f"{path}: {len(flats)} flat groups and {len(saved_groups)} param groups, "
                                      f"the params tree is laid out in {len(resolved)} blocks")
    owners = _block_owners(saved_groups, len(flats), path)
    hps, steps, exp_avg, exp_avg_sq = [], [], [], []
    for b, (g, saved, flat) in enumerate(zip(resolved, owners, flats)):
        want = sum(partition_numel(p_leaves[i].numel(), world) for i in g.leaves)
        where = f"{path}: {_block_named(b, g, paths)}"
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != want:
            got = f"{flat.numel()} elements" if isinstance(flat, torch.Tensor) else type(flat).__name__
            raise CheckpointMismatchError(f"{where}: the flat master has {got}, the params need {want} per rank")
        if not flat.is_floating_point():
            raise CorruptCheckpointError(f"{where}: the flat master is {flat.dtype}, not a floating-point tensor")
        if flat.layout != torch.strided:  # (torch.load rebuilds sparse tensors; reshape would fail on it)
            raise CorruptCheckpointError(f"{where}: the flat master is a tensor of layout {flat.layout}, not a dense "
                                         "one")
        gi = next(i for i, group in enumerate(saved_groups) if group is saved)
        for key in _FLAG_KEYS:  # (bool() took "False" as true; a tensor of two raised torch's bare RuntimeError)
            # (a bias_correction of None is no flag either, as from_torch_optim reads it: it was refused as the
            # optimizer's 'bias_correction=None, the optimizer has True')
            if key in saved and (saved[key] is not None or key == "bias_correction") \
                    and not is_saved_flag(saved[key]):
                taken = "True or False" if key == "bias_correction" else "True, False or None"
                raise CorruptCheckpointError(f"{where}: param_groups[{gi}]['{key}']: expected {taken}, got "
                                             f"{saved[key]!r:.80}")
        if saved.get("bias_correction", True) != opt.variant.bias_correction:
            raise UnsupportedError(f"{where}: bias_correction={saved.get('bias_correction')}, the optimizer has "
                                   f"{opt.variant.bias_correction}")
        refused = refused_torch_option(saved)
        if refused is not None:
            raise UnsupportedError(f"{where}: {refused}={saved[refused]!r} is not supported (only torch.optim's "
                                   "default, False)")
        decoupled = saved.get("decoupled_weight_decay")
        if decoupled is None:  # (None says nothing: an entry of None hid DeepSpeed's adam_w_mode)
            decoupled = saved.get("adam_w_mode")
        if decoupled is not None and bool(decoupled) != opt.variant.decoupled:
            raise UnsupportedError(f"{where}: the file's optimizer has decoupled weight decay={bool(decoupled)}, "
                                   f"this one {opt.variant.decoupled}")
        # (the masters are cast to the template's leaves: a block of float64 ones is stepped in float64)
        wide = all(p_leaves[i].dtype == torch.float64 for i in g.leaves)
        # (half: a float16 or bfloat16 lr, beta or weight_decay is refused, as from_torch_optim and update refuse
        # it. DeepSpeed writes none: its schedulers compute Python floats and the weights-only load refuses numpy
        # scalars; a half tensor is a user's scheduler's, which a torch optimizer steps with in that precision)
        hp = saved_hparams(saved, f"{where}: param_groups[{gi}]",
                           f"{where}: the param group lacks lr, betas, eps or weight_decay", CorruptCheckpointError,
                           float32=None if wide else "a leaf of the block is not float64", half=True)
        entry = saved_state.get(b)
        if entry is None:
            steps.append(0)
            exp_avg.append(torch.zeros(want, dtype=torch.float32))
            exp_avg_sq.append(torch.zeros(want, dtype=torch.float32))
        else:
            for key in ("exp_avg", "exp_avg_sq"):
                t = entry.get(key) if isinstance(entry, dict) else None
                if not isinstance(t, torch.Tensor) or t.numel() != want or not t.is_floating_point() \
                        or t.layout != torch.strided:
                    raise CheckpointMismatchError(f"{where}: {key} must be a flat floating-point tensor of {want} "
                                                  "elements")
            refuse_negative(entry["exp_avg_sq"].reshape(-1), "second moment", f"{where}: exp_avg_sq",
                            CorruptCheckpointError)
            # (DeepSpeed's FusedAdam kept the count in its param group and starts an entry's step from it)
            step = entry["step"] if "step" in entry else saved.get("step") if isinstance(saved, dict) else None
            steps.append(_step_value(step, where))
            exp_avg.append(entry["exp_avg"].reshape(-1))
            exp_avg_sq.append(entry["exp_avg_sq"].reshape(-1))
        hps.append(hp)
    return {"hparams": hps, "steps": steps, "master": [f.reshape(-1) for f in flats], "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq}
