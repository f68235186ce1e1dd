"""``SpeculativeAdamW`` / ``SpeculativeAdam``: the offload engine behind a ``torch.optim.Optimizer``.

::

    opt = sofx.offload.SpeculativeAdamW(model.parameters(),      # or param-group dicts
            lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
            max_grad_norm=1.0, loss_scale=None,   # None | "dynamic" | a float | a loss-scale rule
            profile="torch", executor="thread", block_numel=2**22, n_device_blocks=0,
            missing_grad="skip")
    for batch in data:
        opt.zero_grad()
        opt.backward(loss_fn(model, batch))   # scales the loss when loss scaling is on
        report = opt.step()                   # validates; returns the step report
    opt.close()                               # or use the optimizer as a context manager

``step(closure)`` follows ``torch.optim``: it calls ``closure()`` (with grad
enabled; the closure computes the loss, calls ``opt.backward(loss)`` and
returns the loss) and returns the closure's loss. The report of the latest
step is always in ``opt.last_report`` (``None`` before the first step).

The Adam steps of the parameter blocks are taken *during* backward (on a
worker thread or process, from fp32 master weights) and validated in
``step()``; the training trajectory is that of ``torch.optim.AdamW`` +
``clip_grad_norm_(max_grad_norm)`` + ``torch.amp.GradScaler`` (profile
``"torch"``) or of DeepSpeed ZeRO-3 (``"deepspeed"``). A step whose gradients hold an inf or a nan is skipped
(parameters, moments and step counts unchanged; ``report.skipped``) with every ``loss_scale``, ``None`` and a
static number included (a static scale stays as it is), as ``GradScaler`` skips it: ``torch.optim.AdamW``
without a ``GradScaler`` steps it and writes nan into the parameters. ``max_grad_norm``:
``None`` (no clipping) or a number >= 0, as ``clip_grad_norm_`` takes it: inf
never clips, and 0 zeroes every gradient under ``"torch"`` (the parameters
still move through momentum and weight decay; nothing is speculated) but is
DeepSpeed's ``gradient_clipping`` "off" under ``"deepspeed"``.

``param_groups`` are ordinary dicts (``lr``, ``betas``, ``eps``,
``weight_decay``), read at every step, so every ``torch.optim.lr_scheduler``
works, including those that change ``betas`` (``OneCycleLR`` with
``cycle_momentum``); ``max_grad_norm`` is the optimizer's, not a group's (a group
holding one is refused). They also carry ``torch.optim.AdamW``'s other options
with its defaults, so that group dicts (and a state dict's ``param_groups``) read as torch's do:
``foreach``, ``fused`` and ``capturable`` (torch's implementation choices)
are ignored, but what torch refuses of them is refused (a tensor ``lr`` or beta with
``foreach=True`` and ``capturable=False``; the constructor's ``fused`` and ``foreach``
both set; ``capturable=True`` without ``fused`` over CPU parameters); ``amsgrad``, ``maximize`` and
``differentiable`` set, or a ``decoupled_weight_decay`` other than the
class's, are refused (at construction, at every step, and in
``load_state_dict``) rather than ignored, and so is a value of any of these options that is no flag (a bool, 0,
1 or None; ``differentiable`` a Python bool, as torch's step takes it): a str ``"False"``, which torch takes as on,
is refused naming the option. A tensor ``lr`` (or tensor ``betas``) is read as the Python number
it holds, as :class:`sofx.AdamHParams` reads one: the step is ``torch.optim``'s with that float (torch's own
for-loop step with the tensor rounds ``lr * weight_decay`` and ``lr / bias_correction1``, or ``1 - beta`` and
the bias corrections, to float32, ~1e-7 relative per step); a float16 or bfloat16 one (a LambdaLR's lambda
returning a numpy float16), which torch's for-loop step computes with in that precision, is refused, as
:func:`sofx.adam` refuses it. Differences from ``torch.optim``: gradients are moved
out of ``param.grad`` as they arrive (``param.grad`` is ``None`` after
backward) and ``step()`` consumes them (gradients do not carry over to the
next step without ``gradient_accumulation_steps``: with N, a block is ready, and speculated, during the N-th
backward call, where each of its parameters got a gradient in that call (the earlier micro-steps' summed in: a
parameter of a branch the last micro-batch did not take leaves its block to ``step()``;
:mod:`sofx.offload.arrivals`); a ``step()`` after fewer backward calls (those that gave gradients, whichever
parameters each reached: :mod:`sofx.offload.backward_passes`) steps on their sum, the partial last accumulation
of an epoch, with a ``RuntimeWarning`` naming the counts, and so does one after more (N > 1: the later calls'
gradients came after their blocks were stepped, each such block undone and redone); the sum is taken in float32,
the masters' dtype: for a bf16/fp16 module, the float32 sum of its micro-steps' gradients, as torch's recipe of
fp32 master copies whose ``.grad`` sums them, not the bf16/fp16 ``.grad`` autograd would accumulate on the
module); param groups cannot be
added after construction, reordered, nor parameters added to, removed from or moved between groups' ``params``
(refused at the next step, naming a moved parameter's group, not ignored; their order in a group is free), and a
group cannot hold a parameter twice (refused at construction, and at the next step where its list was edited so,
``[a, b] -> [a, a]``: torch steps it twice); ``step()`` without a closure returns a
:class:`~sofx.offload.engine.EngineStepReport` (``torch.optim`` returns
``None``; with a closure both return its loss); with ``swap_params=True``
(the default) a CPU parameter's storage alternates between two buffers that
the worker fills during backward (``step()`` does not copy), so a reference
to ``param.data`` taken earlier goes stale -- read the parameter itself, or
pass ``swap_params=False`` to have the new values copied into the same storage.
:meth:`state_dict` keeps the engine's own layout (flat blocks; the shared
SPECULATION.md's checkpoint layout), not ``torch.optim``'s per-parameter
``state``: ``torch.optim.AdamW.load_state_dict`` does not check what it is given and would
take it without its moments; :meth:`load_state_dict` refuses torch's (carry its moments over
with ``opt.state[p][key] = value``).

Data parallelism: a model wrapped in ``torch.nn.parallel.DistributedDataParallel`` is given as ``ddp``::

    ddp_model = DistributedDataParallel(model)
    opt = sofx.offload.SpeculativeAdamW(ddp_model.parameters(), ..., ddp=ddp_model)

and trains as with ``torch.optim.AdamW`` (+ ``clip_grad_norm_`` on the averaged gradients, + ``GradScaler``):
the optimizer registers a DDP communication hook that does DDP's all-reduce and takes each bucket's averaged
gradient as it completes, so blocks are speculated on the gradient DDP writes, during backward, with every
executor; every rank takes the same decisions on the same bits, and the replicas stay identical.
``no_sync()`` accumulates as in torch (``gradient_accumulation_steps`` counts the synchronized backwards of a
step: 1 with ``no_sync()``), and a parameter that ``find_unused_parameters`` or ``static_graph`` finds unused on
every rank is not stepped. After backward ``.grad`` holds DDP's average, as in torch, until ``step()`` consumes
it (the optimizer took it during backward: ``step()`` refuses a change made to it there -- replaced, cleared,
written in place --, as it would be ignored; change gradients in a tensor hook, ``Tensor.register_hook``, which
runs before DDP averages them). ``ddp.join()`` works for uneven inputs, with the default
``divide_by_initial_world_size=True`` (``False`` is refused: DDP does not tell a hook the ranks left). A rank out of
inputs takes no step, as with torch.optim, so after the join the ranks' optimizer states differ where they took
different numbers of steps: where the ranks next compare their states (below: at the first step after construction,
or after a state change on any rank) that step is refused on every rank, naming the join and what to do (load the
last rank to join's ``state_dict`` on every rank); otherwise they step on, and the replicas diverge as DDP +
torch.optim's do. The DDP
module must not have a communication hook of its own (it takes one), nor ``mixed_precision`` (which registers
one; the optimizer keeps fp32 masters of a bf16 model itself). Without ``ddp`` the optimizer's gradient hooks
would take each rank's *local* gradient before DDP averages it, speculation on or off: parameters a DDP module
averages are refused then, at construction (or at the first backward, where the model was wrapped after the
optimizer was made). DDP compares the replicas' parameters at its construction only: at each synchronized
backward (in the communication hook, before its first bucket's all-reduce) the ranks decide together, in one
all-reduce of 11 int64, whether any rank's optimizer state changed since they last compared them -- construction,
``load_state_dict``, an ``opt.state[p][key] = value``, ``opt.state = {}``, ``reload_params()``, ``opt.speculate``
set, a step dropped by ``zero_grad()`` after that exchange -- or their hparams differ; if so, they compare their
optimizer states there, every rank at the same point (the settings that change a step's bits -- max_grad_norm, the
backend, whether blocks are speculated (a block speculated and redone is the serial step within float32 rounding:
set ``opt.speculate`` on every rank), ... --, each block's step counts, the groups' hparams, the loss scaler, and
a digest of the bits of each parameter's moments or masters that a rank changed; one all-reduce of a digest), and
where they differ (a rank loaded an older state dict, or none; assigned a state, set an lr or ``opt.speculate``
alone) that ``step()`` raises the same error on every rank, naming what differs (the parameter and key) and each
rank's value, before anything is stepped (again at each ``step()`` until ``zero_grad()``); a change made the same
way on every rank steps on. A rank that changes its state alone so makes every rank compare (none enters a collective
alone). Between a synchronized backward and ``step()`` the state cannot change (refused, as between any backward and
``step()``: also where that backward gave the optimizer no gradient). The decision costs about 0.1-0.3 ms per
synchronized backward (2 gloo ranks on one machine; the all-reduce's latency) and the comparison, where made, about
0.5 ms and 8 ms more per 1,000 blocks (about 14 ms for a 7B model's 1,700 blocks of the default ``block_numel``),
mostly in naming the blocks' entries, and one pass over each changed moment or master, inside that backward before any
block is ready (the blocks are speculated after it). So ``step()`` after a synchronized backward enters no collective:
a rank that skips it (an error between backward and ``step()`` caught on one rank) leaves no other waiting, and the
others step, as with ``torch.optim``; its ``zero_grad()`` drops the step, and the next backward compares, raising on
every rank where the states now differ (the step counts, named). A ``step()`` without a synchronized backward (the
ranks then decide, and compare, in ``step()``) is a collective, as DDP's backward is: every rank calls it at the same
point. A rank that takes no part in it (its optimizer closed or collected; a ``zero_grad()`` before it, or an extra
``step()``, on one rank only) leaves the others waiting in its all-reduce until the process group's timeout: their
``step()`` then raises a ``SofxError`` saying that a rank did not take part in the step()'s exchange, naming the
likely causes, and steps nothing (the group may be unusable after it: gloo closes its connections on a timeout). A
rank that meets it with another collective instead -- a rank out of inputs in ``ddp.join()``, whose join loop
all-reduces one number -- makes gloo abort the process on the mismatched sizes: under ``join()`` end each step with a
synchronized backward (the last micro-step outside ``no_sync()``). The decision and the comparison are made at
backward: an lr set on one rank alone between backward and ``step()`` is not seen by them, and that step diverges the
replicas. Each ``step()`` sends a digest of the hparams it used in the next exchange: the next ``step()`` raises on
every rank, one step late, naming the hparams each rank's last step used, and the steps after it go on raising (naming
the masters that differ) until the ranks load the same ``state_dict``. The same lr set on every rank between backward
and ``step()`` (a warmup) is stepped as set. An optimizer closed (or collected) on some ranks only still takes part in
the exchanges there, saying so: the other ranks' ``step()`` raises, naming the rank, and once every rank's is closed
DDP averages as without a hook.

``torch.compile``: a compiled model trains as an eager one (its backward leaves gradient accumulation, and so the
gradient hooks, to eager autograd); under compiled autograd the hooks run eagerly too (see
:mod:`sofx.offload.grad_hooks`). A compiled region's backward is one autograd node, so its parameters' gradients all
arrive as it ends: their speculative steps overlap only the backward of what runs before the region (compile each
layer, not the whole model, to keep the overlap with backward). ``step()``, ``zero_grad()``, ``state_dict()`` and
``load_state_dict()`` are ``torch.compiler.disable``d (torch.optim disables its own ``state_dict`` and
``load_state_dict`` too): a compiled function calling them (``torch.compile`` of a whole train step, as
torch.optim's step compiles) graph-breaks there and runs them eagerly; dynamo cannot trace the engine (its Python
state, locks and worker threads: see :mod:`sofx.offload.eager`). With ``fullgraph=True`` dynamo refuses such a call,
saying so, before it starts.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Iterable, Iterator, TypeVar, overload

import torch

from sofx.adam import (TORCH_MATH_OPTIONS, Adam, AdamHParams, check_float32_range, refuse_eps_held_as_0,
                       refuse_half_precision, refused_torch_option, torch_betas, torch_flag_values,
                       torch_non_flag)
from sofx.errors import HParamError, SofxError, StructureError, UnsupportedError
from sofx.kernels.base import as_number, is_numpy_real
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.kernels.user_numbers import _described, finite_number, flag, is_bool, real_number
from sofx.loss_scale import call_rule, deepspeed_scaler, grad_scaler, is_torch_grad_scaler, static_scale
from sofx.offload.block_runner import AdamConfig
from sofx.offload.eager import run_eagerly
from sofx.offload.engine import PARAM_STATE_KEYS, EngineStepReport, OffloadEngine
from sofx.offload.interrupts import without_grad
from sofx.offload.shared_memory import DEFAULT_SHM_DIR
from sofx.speculate import AdaptivePolicy, SpeculationConfig
from sofx.tree import article
from sofx.warn import caller_stacklevel

__all__ = ["SpeculativeAdamW", "SpeculativeAdam", "resolve_loss_scale"]

_Loss = TypeVar("_Loss")


def resolve_loss_scale(loss_scale: Any, profile: str) -> Any:
    """The loss-scale rule for ``loss_scale``: ``None`` (no scaling), ``"dynamic"`` (the profile's
    dynamic scaler: GradScaler for "torch", DeepSpeed's for "deepspeed"), a number (static; numpy or a
    1-element tensor too), or a rule object with ``init``/``scale``/``update`` (e.g.
    :func:`sofx.loss_scale.grad_scaler`; a custom rule's state a NamedTuple, :func:`_check_custom_state`)."""
    if loss_scale is None:
        return static_scale(1.0)
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise HParamError(f"loss_scale={loss_scale!r}; expected None, 'dynamic', a number or a loss-scale rule")
        return grad_scaler() if profile == "torch" else deepspeed_scaler()
    # numpy's float32 too, or a 1-element tensor (it was refused as no number)
    number = real_number(loss_scale, "loss_scale")
    if isinstance(number, numbers.Real) and not is_bool(number):
        try:
            return static_scale(number)
        except HParamError as exc:  # (it named static_scale's argument, "scale = nan is invalid")
            raise HParamError(f"loss_scale: {exc}") from None
    if all(callable(getattr(loss_scale, name, None)) for name in ("init", "scale", "update")):
        _check_custom_state(loss_scale)
        return loss_scale
    if is_torch_grad_scaler(loss_scale):  # torch's habit: a scaler beside
        raise HParamError("loss_scale is a torch.amp.GradScaler; the optimizer scales the loss itself: "
                          "loss_scale='dynamic' is GradScaler's rule (sofx.loss_scale.grad_scaler(init_scale=..., "
                          "growth_factor=..., backoff_factor=..., growth_interval=...) for other settings; "
                          "sofx.loss_scale.from_torch_grad_scaler(scaler) carries a used one's rule and state over), "
                          "and opt.backward(loss) or opt.scale_loss(loss).backward() take GradScaler.scale's place")
    if any(loss_scale is factory for factory in (grad_scaler, deepspeed_scaler, static_scale)):
        raise HParamError(f"loss_scale is the function {loss_scale.__name__}; call it for a rule: "
                          f"{loss_scale.__name__}(...)")
    raise HParamError(f"loss_scale={loss_scale!r}; expected None, 'dynamic', a number or a loss-scale rule "
                      "(sofx.loss_scale.grad_scaler(...), deepspeed_scaler(...), static_scale(...))")


def _check_custom_state(rule: Any) -> None:
    """Refuse (an :class:`HParamError`) a rule whose state (``rule.init()``) is not a NamedTuple: the optimizer's
    ``state_dict()`` saves the loss-scaler state as its type's name and fields, and ``load_state_dict()`` remakes
    it from them (a float state trained, and ``state_dict()`` raised "'float' object has no attribute
    '_asdict'"; under ``ddp`` every step's replica check did)."""
    state = call_rule(rule, "init", where="loss_scale: ", after="the optimizer is not made")
    if not (isinstance(state, tuple) and hasattr(type(state), "_fields") and callable(getattr(state, "_asdict", None))):
        raise HParamError(f"loss_scale: the rule's init() returned {article(type(state).__name__)}; the optimizer's "
                          "state_dict() saves the loss-scaler state's fields: expected a NamedTuple (as the states "
                          "of sofx.loss_scale's rules)")


def _check_losses(loss: Any, who: str, sequence: bool) -> None:
    """Refuse (a :class:`StructureError` naming ``who``'s ``loss`` and what it is) a ``loss`` that is no tensor
    (with ``sequence``: nor a list or tuple of tensors, as ``GradScaler.scale`` takes): multiplied by the scale or
    sent backward it raised a bare TypeError or AttributeError ("'list' object has no attribute 'backward'")."""
    items = list(enumerate(loss)) if sequence and isinstance(loss, (list, tuple)) else [(None, loss)]
    for i, x in items:
        if not isinstance(x, torch.Tensor):
            name = "loss" if i is None else f"loss[{i}]"
            several = ("a tensor, or a list or tuple of tensors" if sequence else
                       "a tensor (several losses: torch.autograd.backward(opt.scale_loss([loss1, loss2])))")
            raise StructureError(f"{who}: {name} is {article(type(x).__name__)}; expected {several}")


def _number(value: Any, what: str, field: str) -> float:
    """A group's hparam ``field`` (an :class:`AdamHParams` field) as a Python float
    (:func:`~sofx.kernels.user_numbers.finite_number`: a Python or numpy number, numpy's float32 from a LambdaLR
    included, or a 1-element tensor; finite). A tensor that requires grad is its value, as torch.optim reads a
    group's hparams in its no_grad step (grad mode is on at construction and in load_state_dict, where it read as
    traced). A float16 or bfloat16 lr, beta or weight decay (a LambdaLR whose lambda returns a numpy float16 makes
    the lr one), which torch.optim's for-loop step computes with in that precision, is refused as
    :func:`sofx.adam` refuses it (it was read as the Python float it holds: another step than torch's), and so is a
    numpy ``longdouble`` that no Python float holds exactly (:func:`~sofx.kernels.base.as_number`; it was rounded)."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        value = value.detach()
    refuse_half_precision(field, value, "", label=what)
    if field == "eps":  # (np.float16(1e-8) holds 0: refused saying so, not as an eps of 0.0 the caller never wrote)
        refuse_eps_held_as_0(value, "", label=what)
    if is_numpy_real(value):  # (a longdouble no float holds exactly was rounded by float(): refused as update does)
        value = as_number(value, what)
    if callable(value):  # a sofx schedule (optax's learning_rate=schedule)
        raise HParamError(f"{what} is a schedule ({type(value).__name__}), where the offload optimizer takes a "
                          "number: its lr follows a torch.optim.lr_scheduler; for a sofx schedule, lr=1.0 and "
                          f"{_lambda_lr_of(value)}")
    return float(finite_number(what, value))


def _lambda_lr_of(schedule: Callable[[int], Any]) -> str:
    """How ``LambdaLR`` runs ``schedule`` as a group's lr: the schedule itself, or its ``.lr`` where its values
    are :class:`AdamHParams` (``hparams_schedule``, ``one_cycle``)."""
    try:
        whole = isinstance(schedule(0), AdamHParams)
    except Exception:  # (not a sofx schedule: whatever it takes, the advice is the plain one)
        whole = False
    if whole:
        return ("torch.optim.lr_scheduler.LambdaLR(opt, lambda t: schedule(t).lr) make the group's lr "
                "schedule(step).lr (its values are AdamHParams)")
    return "torch.optim.lr_scheduler.LambdaLR(opt, schedule) make the group's lr schedule(step)"


# torch.optim.Adam/AdamW's options that change the math, and differentiable (the steps are in place, not
# recorded by autograd): only their default (False) is implemented. (Its other options, foreach / fused /
# capturable, choose torch's implementation: ignored, but what torch refuses of them is refused, see
# check_foreach_tensors and check_capturable_devices.)
_REFUSED_FLAGS = (*TORCH_MATH_OPTIONS, "differentiable")


def check_group_flags(group: Mapping[str, Any], where: str, decoupled: bool) -> None:
    """Refuse a param group asking for what the speculative optimizer does not implement: ``amsgrad``,
    ``maximize`` or ``differentiable`` set, or ``decoupled_weight_decay`` other than the class's (AdamW: True,
    Adam: False) -- silently ignored, they would train another model than ``torch.optim``'s --, a
    ``max_grad_norm`` (the optimizer's, not a group's: ignored, the group's gradients were clipped by another),
    and what ``torch.optim.AdamW`` refuses of its implementation options (:func:`check_foreach_tensors`,
    :func:`check_capturable_devices`). An option of torch's whose value is no flag (:func:`sofx.adam.torch_non_flag`:
    a str ``"False"``, true to torch's ``if group[...]:``) is refused first, naming it."""
    odd = torch_non_flag(group)
    if odd is not None:
        raise UnsupportedError(f"{where}[{odd!r}] = {group[odd]!r:.80} is no flag; expected "
                               f"{torch_flag_values(odd)}")
    check_foreach_tensors(group, where)
    check_capturable_devices(group, where)
    if "max_grad_norm" in group:
        kind = "SpeculativeAdamW" if decoupled else "SpeculativeAdam"
        raise UnsupportedError(f"{where}['max_grad_norm'] = {group['max_grad_norm']!r}: a group's max_grad_norm is "
                               "not read: the gradients of every group are clipped by one norm over all of them (as "
                               "clip_grad_norm_ over every parameter), set at construction: "
                               f"{kind}(..., max_grad_norm=...)")
    key = refused_torch_option(group, _REFUSED_FLAGS)
    if key is not None:
        raise UnsupportedError(f"{where}[{key!r}] = {group[key]!r}: {key} is not supported by the speculative "
                               "optimizer (only its default, False)")
    if "decoupled_weight_decay" in group and bool(group["decoupled_weight_decay"]) != decoupled:
        kind = "SpeculativeAdamW" if decoupled else "SpeculativeAdam"
        other = "SpeculativeAdam" if decoupled else "SpeculativeAdamW"
        raise UnsupportedError(f"{where}['decoupled_weight_decay'] = {group['decoupled_weight_decay']!r}: a "
                               f"{kind} has {'decoupled' if decoupled else 'L2'} weight decay; use {other}")


def _check_beta_types(betas: tuple[Any, Any]) -> None:
    """Refuse the constructor's ``betas`` (as :func:`~sofx.adam.torch_betas` gives them) unless both are floats (a
    Python or numpy float64) or both tensors, as ``torch.optim.AdamW``'s constructor does (an int, numpy's
    float32 or a tensor beside a float: its ValueError), so that code tried here runs on torch. (A group's
    ``betas`` set later, by hand or by a scheduler, is any number, as torch steps it.)"""
    if all(isinstance(b, float) for b in betas) or all(isinstance(b, torch.Tensor) for b in betas):
        return
    found = ", ".join(type(b).__name__ for b in betas)
    raise HParamError(f"betas must be both floats or both tensors, as torch.optim.AdamW requires; got {found} "
                      f"(betas={betas!r:.80}): give floats, e.g. ({float(betas[0])!r}, {float(betas[1])!r}), "
                      "or 1-element tensors")


def check_foreach_tensors(group: Mapping[str, Any], where: str) -> None:
    """Refuse a tensor hparam in a group whose ``foreach`` is set and ``capturable`` not, as ``torch.optim.AdamW``
    refuses it ("not supported for capturable=False and foreach=True"): a tensor ``lr`` (torch: at construction
    and at every step), a tensor beta (at construction, and at a step that foreach takes: ``fused`` not set).
    The facade has no foreach implementation to choose, but code tried here must run on torch."""
    if not group.get("foreach") or group.get("capturable"):
        return
    hint = ("as torch.optim.AdamW refuses it (foreach's kernels take Python numbers); give a float, or foreach=False "
            "(or None), or capturable=True")
    if isinstance(group.get("lr"), torch.Tensor):
        raise UnsupportedError(f"{where}['lr'] is a tensor with foreach=True and capturable=False, {hint}")
    betas = group.get("betas")
    if group.get("fused"):
        return
    if isinstance(betas, torch.Tensor):  # (its step unpacks the pair into two tensors)
        raise UnsupportedError(f"{where}['betas'] is a tensor with foreach=True and capturable=False, {hint}")
    if not isinstance(betas, (tuple, list)):
        return
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):
            raise UnsupportedError(f"{where}['betas'][{i}] is a tensor with foreach=True and capturable=False, {hint}")


def check_capturable_devices(group: Mapping[str, Any], where: str) -> None:
    """Refuse a group whose ``capturable`` is set, ``fused`` not, holding a CPU parameter: ``torch.optim.AdamW``
    makes it and its step raises ("If capturable=True, params and state_steps must be on supported devices", the
    accelerators; its fused step takes CPU parameters). The facade ignored capturable and trained, where the same
    code stops on torch at its first step. (The constructor's ``defaults`` hold no parameters: their groups are
    checked.)"""
    if not group.get("capturable") or group.get("fused"):
        return
    params = group.get("params")
    for j, p in enumerate(params if isinstance(params, (list, tuple)) else ()):
        if isinstance(p, torch.Tensor) and p.device.type == "cpu":
            raise UnsupportedError(f"{where}['capturable'] = {group['capturable']!r} with CPU parameters "
                                   f"({where}['params'][{j}], shape {tuple(p.shape)}): torch.optim.AdamW's "
                                   "capturable step refuses them (for CUDA graphs, on an accelerator); set "
                                   "capturable=False (it is ignored here), or fused=True, which torch steps on "
                                   "the CPU")


def group_hparams(group: Mapping[str, Any], where: str) -> AdamHParams:
    """A param group's hparams as Python floats, checked (the message names the group). Its ``betas`` are any two
    numbers torch's step unpacks (``beta1, beta2 = group["betas"]``): a tuple or list, a 2-element tensor or numpy
    array. A group without one of them (``del g['eps']``, a dict rebuilt by hand) is refused naming it, where
    ``group[key]`` raised a bare ``KeyError`` (out of backward: the gradient hooks read the groups)."""
    for key in _HPARAM_KEYS:
        if key not in group:
            raise HParamError(f"{where} has no {key!r}: a param group needs "
                              f"{', '.join(map(repr, _HPARAM_KEYS))} (put it back in the group's dict)")
    lr = _number(group["lr"], f"{where}['lr']", "lr")
    betas = torch_betas(group["betas"], f"{where}['betas']")  # (what torch's step unpacks: a tensor pair too)
    b1, b2 = _number(betas[0], f"{where}['betas'][0]", "beta1"), _number(betas[1], f"{where}['betas'][1]", "beta2")
    eps = _number(group["eps"], f"{where}['eps']", "eps")
    wd = _number(group["weight_decay"], f"{where}['weight_decay']", "weight_decay")
    for name, value, ok, rule in (("['lr']", lr, lr >= 0, ">= 0"), ("['betas'][0]", b1, 0 <= b1 < 1, "in [0, 1)"),
                                  ("['betas'][1]", b2, 0 <= b2 < 1, "in [0, 1)"), ("['eps']", eps, eps > 0, "> 0"),
                                  ("['weight_decay']", wd, wd >= 0, ">= 0")):
        if not (math.isfinite(value) and ok):
            raise HParamError(f"{where}{name} = {value!r} is invalid; expected {rule}")
    hp = AdamHParams(lr, b1, b2, eps, wd)
    check_float32_range(hp, where)  # the masters are float32
    return hp


class _ParamState(MutableMapping):
    """``opt.state[p]``: one parameter's ``step`` (0-d int64), ``exp_avg``, ``exp_avg_sq`` and ``master`` as live
    views of the engine's blocks; assigning a key writes into them (``state["step"] = 0``; ``state["master"] = x``
    also sets the model's parameter to ``x``, rounded to its dtype, as ``load_state_dict`` does; ``update`` checks
    every value before it writes any; ``clear()`` starts it afresh). ``copy()`` is a dict of the live views,
    ``copy.deepcopy`` one of copies of torch.optim's keys (:func:`_state_copy`), as is a pickled one
    (``torch.save``)."""

    def __init__(self, engine: OffloadEngine, index: int) -> None:
        self._engine, self._index = engine, index

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._engine.param_state(self._index)[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._engine.set_param_state(self._index, key, value)

    def update(self, *other: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """As ``dict.update``, every value checked before any is written (key by key, a bad value after a good one
        left the good one written: a step count set, the moments not)."""
        values = dict(*other, **kwargs)
        if values:
            self._engine.set_param_states(self._index, values, "opt.state[p].update(...)", partial=True)

    def copy(self) -> dict[str, torch.Tensor]:
        """A dict of the state's own tensors (live views), as ``dict.copy`` of a torch.optim parameter's state."""
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, torch.Tensor]:
        """A snapshot, as ``copy.deepcopy`` of a torch.optim parameter's state (it deep-copied the engine behind
        the view, its locks too: a bare TypeError): :func:`_state_copy`."""
        return _state_copy(self._engine, self._index)

    def __copy__(self) -> "_ParamState":
        return _ParamState(self._engine, self._index)  # (a view, as before __reduce_ex__)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Pickled (``torch.save(opt.state[p])``) as its deep copy, a dict (it pickled the engine behind the view: a
        bare "AttributeError: Can't pickle local object")."""
        return dict, (list(_state_copy(self._engine, self._index).items()),)

    def clear(self) -> None:
        """``opt.state[p].clear()``: the parameter starts afresh (step 0, zero moments; its master kept), as
        torch.optim's next step after emptying its entry; ``del opt.state[p]``."""
        self._engine.set_param_states(self._index, {}, "opt.state[p].clear()")

    def __delitem__(self, key: str) -> None:
        raise UnsupportedError(f"the state of a speculative optimizer's parameter always has {sorted(self)}: "
                               "assign a key (state['step'] = 0) instead; opt.state[p].clear() or del opt.state[p] "
                               "starts p afresh, opt.state.clear() every parameter")

    def __iter__(self) -> Iterator[str]:
        return iter(PARAM_STATE_KEYS)

    def __len__(self) -> int:
        return len(PARAM_STATE_KEYS)

    def __repr__(self) -> str:
        return repr(dict(self))


def _state_copy(engine: OffloadEngine, index: int) -> dict[str, torch.Tensor]:
    """Copies of parameter ``index``'s ``step``, ``exp_avg`` and ``exp_avg_sq``: the state torch.optim keeps
    (``opt.state[p] = copy`` takes it back, as torch's rolls back its moments and count and leaves the parameter as
    it is). Not its ``master``, the parameter's own value in float32, which put back would move the parameter too
    (``opt.state[p]["master"]`` reads it). The ``step`` is torch.optim's, a float32 0-d tensor (the engine's count
    is int64, which torch's foreach and fused steps refuse beside float32 moments), float64 beyond ``2**24``, where
    float32 no longer holds every count (torch takes both)."""
    state = engine.param_state(index)
    out = {key: state[key].clone() for key in PARAM_STATE_KEYS[1:3]}
    step = state["step"]
    return {"step": step.to(torch.float32 if int(step) <= 2 ** 24 else torch.float64), **out}


def _entry(value: Any) -> Any:
    """A value assigned as a parameter's whole state: another parameter's ``opt.state[q]`` (a live view, read
    inside the engine's call it raised "called while another thread is in step()") as its torch.optim keys
    (``step``, ``exp_avg``, ``exp_avg_sq``; not its ``master``, which would move this parameter to q's weights, where
    torch.optim's ``opt.state[p] = opt.state[q]`` leaves the parameter alone); anything else as it is."""
    if isinstance(value, _ParamState):
        return {key: value[key] for key in PARAM_STATE_KEYS[:3]}
    return value


class _ParamStateView(MutableMapping):
    """``opt.state``: torch.optim-style per-parameter state (live views of the engine's blocks), an entry for every
    parameter. ``clear()`` starts every parameter afresh (as ``opt.state = {}``), ``pop(p)`` gives a copy of ``p``'s
    state and starts it afresh; ``update`` (every entry checked before any is written) and ``setdefault`` as on a
    dict; ``popitem`` is refused (an entry is never
    gone: which parameter it would reset is arbitrary). ``copy.deepcopy`` of it, or of ``opt.state[p]``, copies the
    states (:func:`_state_copy`), not the engine behind them; so does a pickle (``torch.save``)."""

    def __init__(self, engine: OffloadEngine) -> None:
        self._engine = engine  # (not the optimizer: no reference cycle, see _hparams_of)
        self._indices = {id(q): i for i, q in enumerate(engine.params)}  # (the engine's parameters are fixed)

    def _index(self, p: Any) -> int:
        i = self._indices.get(id(p))
        if i is None or self._engine.params[i] is not p:
            what = (f"a tensor of shape {tuple(p.shape)} ({str(p.dtype).removeprefix('torch.')}, {p.device})"
                    if isinstance(p, torch.Tensor) else f"{type(p).__name__} {p!r:.60}")
            raise KeyError(f"{what} is not one of this optimizer's parameters (opt.state holds theirs only)")
        return i

    def __getitem__(self, p: Any) -> _ParamState:
        return _ParamState(self._engine, self._index(p))

    def __setitem__(self, p: Any, value: Any) -> None:
        """``opt.state[p] = {...}``: the parameter's whole state, as torch.optim's (``{}``: afresh), checked whole
        before anything is written (:meth:`~sofx.offload.engine.OffloadEngine.set_param_states`)."""
        self._engine.set_param_states(self._member(p, "opt.state[p] = ..."), _entry(value))

    def __delitem__(self, p: Any) -> None:
        """``del opt.state[p]``: the parameter starts afresh (step 0, zero moments; its master kept), as
        torch.optim's next step after deleting its entry; ``opt.state[p] = {}``."""
        self._engine.set_param_states(self._member(p, "del opt.state[p]"), {}, "del opt.state[p]")

    def clear(self) -> None:
        """``opt.state.clear()``: every parameter starts afresh, as ``opt.state = {}`` (torch.optim's
        ``state.clear()``)."""
        self._engine.reset_state()

    def pop(self, p: Any, *default: Any) -> Any:  # type: ignore[override]
        """``p``'s state as it was (:func:`_state_copy`: the views' tensors are the blocks', which the reset
        zeroes), then ``p`` starts afresh; ``default`` where ``p`` is not one of the parameters."""
        try:
            index = self._index(p)
        except KeyError:
            if default:
                return default[0]
            raise
        state = _state_copy(self._engine, index)
        self._engine.set_param_states(index, {}, "opt.state.pop(p)")
        return state

    def update(self, *other: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """As ``dict.update``, every entry checked before any is written (one by one, a bad entry for ``q`` after a
        good one for ``p`` left ``p``'s written): :meth:`~sofx.offload.engine.OffloadEngine.set_params_states`."""
        what = "opt.state.update(...)"
        entries = [(self._member(p, what), _entry(value)) for p, value in dict(*other, **kwargs).items()]
        if entries:
            self._engine.set_params_states(entries, what)

    def popitem(self) -> tuple[torch.Tensor, Any]:
        raise UnsupportedError("opt.state.popitem(): the state of a speculative optimizer has an entry for every "
                               "parameter, always (reset, it starts afresh): use opt.state.pop(p), or "
                               "opt.state.clear() for all of them")

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[Any, dict[str, torch.Tensor]]:
        """As ``copy.deepcopy`` of torch.optim's ``opt.state``: the parameters deep-copied as keys (the model's own
        copies where ``memo`` holds them: a deep copy of the model and the state together), each with
        :func:`_state_copy` of its state."""
        return {copy.deepcopy(p, memo): _state_copy(self._engine, i) for i, p in enumerate(self._engine.params)}

    def __copy__(self) -> "_ParamStateView":
        return _ParamStateView(self._engine)  # (a view, as before __reduce_ex__)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Pickled (``torch.save(opt.state)``) as torch.optim's ``opt.state`` is, a dict of the parameters, each
        with :func:`_state_copy` of its state (it pickled the engine behind the view: a bare AttributeError)."""
        return dict, ([(p, _state_copy(self._engine, i)) for i, p in enumerate(self._engine.params)],)

    def _member(self, p: Any, what: str) -> int:
        """The index of ``p``, or an :class:`UnsupportedError` naming ``what`` was done with which tensor."""
        try:
            return self._index(p)
        except KeyError as exc:
            raise UnsupportedError(f"{what}: p is {exc.args[0]}") from None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._engine.params)

    def __len__(self) -> int:
        return len(self._engine.params)


def _check_params_argument(params: Any) -> None:
    """Refuse a module or a dict given as ``params``, saying what to pass (torch's TypeError, "optimizer can only
    optimize Tensors, but one of the params is str" for a dict, whose keys it iterates, does not)."""
    takes = "pass model.parameters(), model.named_parameters() or a list of param-group dicts"
    if isinstance(params, torch.nn.Module) and not isinstance(params, torch.nn.ParameterList):  # (iterates them)
        raise StructureError(f"params is {article(type(params).__name__)} (a module): {takes}")
    if isinstance(params, Mapping):
        keys = ", ".join(repr(k) for k in list(params)[:2]) + (", ..." if len(params) > 2 else "")
        what = "one param group: a list of it, [group]" if "params" in params else \
            "a dict of named parameters: its .items()"
        entries = "1 entry (key" if len(params) == 1 else f"{len(params)} entries (keys"
        raise StructureError(f"params is a dict of {entries} {keys}): {takes}; {what}")


def _hparams_of(opt: "_SpeculativeBase") -> Callable[[], list[AdamHParams]]:
    """The engine's ``hparams_fn``: the optimizer's param groups, read through a weak reference. Nothing the
    optimizer owns refers back to it, so dropping its last reference frees it (and closes its engine, which
    removes the gradient hooks) at once, without waiting for the cycle collector: an optimizer created again
    over the same parameters (``opt = SpeculativeAdamW(model.parameters())`` twice) must not find the old one's
    hooks still taking the gradients."""
    ref = weakref.ref(opt)

    def hparams() -> list[AdamHParams]:
        live = ref()
        if live is None:
            raise SofxError("the optimizer that owns this engine was garbage-collected")
        return live._hparams()

    return hparams


class _SpeculativeBase(torch.optim.Optimizer):
    """Shared implementation of :class:`SpeculativeAdamW` and :class:`SpeculativeAdam`."""

    _decoupled = True
    # torch.amp.GradScaler.step(opt) then leaves the step to step(), setting opt.grad_scale and opt.found_inf first
    # (its own path found no .grad and failed with "No inf checks were recorded for this optimizer"): step() refuses
    # it by name (_refuse_grad_scaler)
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool | None = None,
                 max_grad_norm: float | None = None,
                 loss_scale: Any = None, profile: str = "torch", executor: str = "thread",
                 block_numel: int = 2 ** 22, n_device_blocks: int = 0, missing_grad: str = "skip",
                 gradient_accumulation_steps: int = 1, speculate: bool = True, bias_correction: bool = True,
                 state_dtype: torch.dtype = torch.float32, undo: str = "auto", backend: str = "auto",
                 policy: AdaptivePolicy | None = None, snapshot_budget_bytes: int | None = None,
                 timeout: float = 60.0, num_threads: int = 1, shm_dir: str = DEFAULT_SHM_DIR,
                 shm_limit_bytes: int | None = None, swap_params: bool = True, ddp: Any = None) -> None:
        self._engine: OffloadEngine | None = None
        defaults = {"lr": lr, "betas": torch_betas(betas), "eps": eps,
                    "weight_decay": weight_decay, "amsgrad": amsgrad, "maximize": maximize, "foreach": foreach,
                    "capturable": capturable, "differentiable": differentiable, "fused": fused,
                    "decoupled_weight_decay": self._decoupled if decoupled_weight_decay is None
                    else decoupled_weight_decay}
        group_hparams(defaults, "defaults")
        _check_beta_types(defaults["betas"])  # (numbers, checked: float() reads them for the message)
        check_group_flags(defaults, "defaults", self._decoupled)
        if fused and foreach:  # (torch.optim.Adam's constructor; a group's pair steps fused there)
            raise UnsupportedError(f"fused={fused!r} and foreach={foreach!r}: torch.optim.AdamW's implementations, "
                                   "which cannot be set together (torch refuses it); set one (both are ignored here)")
        _check_params_argument(params)
        super().__init__(params, defaults)
        # Each group's parameters, fixed at construction (they are packed into blocks): see _check_group_members.
        for i, group in enumerate(self.param_groups):
            _check_no_repeats(group["params"], f"param_groups[{i}]['params']")
        self._group_param_ids = [frozenset(id(p) for p in g["params"]) for g in self.param_groups]
        for i, group in enumerate(self.param_groups):
            group_hparams(group, f"param_groups[{i}]")
            check_group_flags(group, f"param_groups[{i}]", self._decoupled)
        if state_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise UnsupportedError(f"state_dtype={state_dtype!r} ({article(type(state_dtype).__name__)}); expected "
                                   "torch.float32, torch.bfloat16 or torch.float16 (a torch.dtype)")
        speculate = flag("speculate", speculate, UnsupportedError)  # (speculate="no" was taken as on)
        speculation = SpeculationConfig(max_norm=max_grad_norm, profile=profile, missing_grad=missing_grad,
                                        snapshot_budget_bytes=snapshot_budget_bytes,
                                        policy=policy if policy is not None else AdaptivePolicy(), enabled=speculate)
        adam = AdamConfig(decoupled=self._decoupled, bias_correction=bias_correction,
                          state_dtype=str(state_dtype).replace("torch.", ""), undo=undo, backend=backend)
        # What every step checks, checked now too -- before the engine takes the parameters over from an older
        # optimizer (its hooks supersede that one's): a refused constructor leaves the old optimizer working.
        self._checked_hparams(adam.build())
        scaler = resolve_loss_scale(loss_scale, profile)
        # The engine is the last thing made: it checks everything before it registers hooks and starts a worker.
        self._engine = OffloadEngine(
            [g["params"] for g in self.param_groups], _hparams_of(self), adam=adam, speculation=speculation,
            scaler=scaler, executor=executor, block_numel=block_numel,
            n_device_blocks=n_device_blocks, gradient_accumulation_steps=gradient_accumulation_steps,
            timeout=timeout, num_threads=num_threads, shm_dir=shm_dir, shm_limit_bytes=shm_limit_bytes,
            swap_params=swap_params, ddp=ddp)
        try:  # (a Ctrl-C here left the engine's hooks, worker and gate live until a garbage collection)
            self._state_view = _ParamStateView(self._engine)
            #: The :class:`~sofx.offload.engine.EngineStepReport` of the latest completed ``step()``
            #: (``None`` before the first); ``step(closure)`` returns the loss, the report is here.
            self.last_report: EngineStepReport | None = None
            # Whether a backward since the last step() was scaled by this optimizer (opt.backward, scale_loss) or
            # the caller read opt.loss_scale to scale one itself: see _warn_unscaled_backward.
            self._scale_taken = False
        except BaseException:
            self._engine.close()
            raise

    # ------------------------------------------------------------ torch.optim interface
    @property  # type: ignore[override]
    def state(self) -> Mapping:
        """``opt.state[p]``: the parameter's ``step``, ``exp_avg``, ``exp_avg_sq`` and ``master`` (live views;
        assigning a key writes it; ``opt.state[p] = {...}`` sets them as torch.optim's entry, ``{}`` or
        ``del opt.state[p]`` afresh). ``opt.state = collections.defaultdict(dict)`` (or any empty mapping, or
        ``opt.state.clear()``) resets every parameter's moments and step count, as it does for ``torch.optim``;
        ``opt.state = {p: {...}, ...}`` (a ``defaultdict(dict, ...)`` or a dict) replaces the state as torch's:
        each parameter it holds takes its entry (as ``opt.state[p] = {...}``), every other one starts afresh,
        every entry checked before anything is written (a key that is none of the parameters refused)."""
        view = self.__dict__.get("_state_view")
        return view if view is not None else self.__dict__["_torch_state"]

    @state.setter
    def state(self, value: Any) -> None:
        if self.__dict__.get("_state_view") is None:  # torch.optim.Optimizer.__init__'s empty state
            self.__dict__["_torch_state"] = value
            return
        if value is self._state_view:
            return
        if isinstance(value, Mapping) and len(value) == 0:
            self.engine.reset_state()
            return
        if isinstance(value, Mapping):  # torch.optim's state replaced: the parameters it leaves out start afresh
            what = "opt.state = {...}"
            given = {self._state_view._member(p, what): _entry(entry) for p, entry in value.items()}
            self.engine.set_params_states([(i, given.get(i, {})) for i in range(len(self.engine.params))], what)
            return
        raise UnsupportedError(f"opt.state must be a mapping of parameters to their states, as torch.optim's (an "
                               f"empty one, e.g. collections.defaultdict(dict), resets every parameter), got "
                               f"{_described(value)}; change a parameter's state with opt.state[p][key] = value, or "
                               "load a state dict")

    def _hparams(self) -> list[AdamHParams]:
        return self._checked_hparams(self.engine.adam)

    def _checked_hparams(self, adam: Adam) -> list[AdamHParams]:
        """Every group's hparams, checked (flags, ranges, and what ``adam``'s undo mode refuses; its parameters
        those of construction)."""
        self._check_groups()
        out = []
        for i, g in enumerate(self.param_groups):
            check_group_flags(g, f"param_groups[{i}]", self._decoupled)
            hp = group_hparams(g, f"param_groups[{i}]")
            refusal = adam.algebraic_refusal(hp)  # (fp32 masters) before any block of the step is stepped
            if refusal is not None:
                raise UnsupportedError(f"param_groups[{i}]: {refusal}")
            out.append(hp)
        return out

    def _check_groups(self) -> None:
        """``param_groups`` holds the groups of construction in their order, each with its parameters (in any order,
        each once): the engine's blocks are packed per group at construction, and its state is in their order."""
        self._check_group_count()
        for i, g in enumerate(self.param_groups):  # (every group first: a moved parameter is named where it is now)
            self._check_group_members(g, i)
        for i, g in enumerate(self.param_groups):
            self._check_group_params(g, i)

    def _check_group_count(self) -> None:
        """``param_groups`` still holds as many groups as at construction: a group appended to the list directly
        (bypassing the refused :meth:`add_param_group`) or removed from it is refused, as that method is; so is a
        ``param_groups`` that is no list (``None``, a dict: Python's bare TypeError from ``len``, or its keys read as
        groups) and a group that is no dict (``param_groups[0] = 5``: a bare AttributeError)."""
        groups = self.param_groups
        if not isinstance(groups, (list, tuple)):
            found = "None" if groups is None else f"of type {type(groups).__name__}"
            raise UnsupportedError(f"param_groups is {found}, not a list of param groups (dicts) as torch.optim "
                                   "holds: put back the list it was made with")
        for i, g in enumerate(groups):
            if not isinstance(g, Mapping):
                raise UnsupportedError(f"param_groups[{i}] is of type {type(g).__name__}, not a param group (a dict "
                                       "with 'params' and the hparams, as torch.optim holds): put back the group it "
                                       "was made with")
        n, made = len(groups), len(self._group_param_ids)
        if n != made:
            raise UnsupportedError(f"param_groups has {n} groups, this optimizer was made with {made}: its "
                                   "parameters are packed into blocks at construction, so groups cannot be added "
                                   "(with param_groups.append or add_param_group) or removed; put the list back, "
                                   "or create a new optimizer with every group")

    def _check_group_members(self, group: Mapping[str, Any], i: int) -> None:
        """Every entry of group ``i``'s ``params`` is one of the parameters it was made with. torch.optim steps a
        parameter appended to it, and one moved there from another group (or the groups reordered) with this
        group's hparams; here each group's parameters are packed into its blocks at construction, so such a change
        is refused (as :meth:`add_param_group` is), naming the group a moved parameter was made in. ``params`` is a
        list (or tuple), as ``torch.optim``'s ``add_param_group`` makes it: a generator assigned there
        (``model.parameters()``), a single parameter (torch's step iterates its rows) or a set are refused."""
        params = group.get("params")
        if not isinstance(params, (list, tuple)):
            found = "missing" if "params" not in group else article(type(params).__name__)
            raise UnsupportedError(f"param_groups[{i}]['params'] is {found}, not a list of the group's parameters: "
                                   "put back a list of the parameters it was made with (torch.optim's "
                                   "add_param_group makes it a list; a set's order changes between runs)")
        made = self._group_param_ids[i]
        for j, p in enumerate(params):
            if id(p) in made:
                continue
            what = f"param_groups[{i}]['params'][{j}] (shape " + (
                f"{tuple(p.shape)})" if isinstance(p, torch.Tensor) else f"{type(p).__name__})")
            home = [k for k, ids in enumerate(self._group_param_ids) if id(p) in ids]
            if home:
                raise UnsupportedError(f"{what} is a parameter of param_groups[{home[0]}] as this optimizer was made: "
                                       "its groups' parameters are packed into blocks at construction, so groups "
                                       "cannot be reordered nor parameters moved between them; put the lists back "
                                       "(set a parameter's hparams in its group's dict), or create a new optimizer "
                                       "with the new groups")
            raise UnsupportedError(f"{what} is not one of the parameters this optimizer was made with: its "
                                   "parameters are packed into blocks at construction and cannot be added or "
                                   "replaced; create a new optimizer over every parameter")

    def _check_group_params(self, group: Mapping[str, Any], i: int) -> None:
        """Group ``i`` (its entries those it was made with, :meth:`_check_group_members`) still holds each of them
        once (in any order). torch.optim stops stepping a parameter removed from ``param_groups[i]['params']``, and
        steps one written over another (``[a, b] -> [a, a]``) twice per step; here the blocks are packed at
        construction, so such a change is refused (as :meth:`add_param_group` is) rather than ignored."""
        params, made = group["params"], self._group_param_ids[i]
        where = f"param_groups[{i}]['params']"
        _check_no_repeats(params, where)  # (as many as made, all made: one twice means another is gone)
        if len(params) != len(made):
            raise UnsupportedError(f"{where} has {len(params)} parameters, this optimizer was made with {len(made)}: "
                                   "its parameters are packed into blocks at construction and cannot be removed; "
                                   "create a new optimizer over every parameter")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._engine is not None:
            raise UnsupportedError("param groups cannot be added to a speculative optimizer after construction: "
                                   "its parameters are packed into blocks; pass every group to the constructor")
        super().add_param_group(param_group)

    @overload
    def step(self, closure: None = None) -> EngineStepReport: ...

    @overload
    def step(self, closure: Callable[[], _Loss]) -> _Loss: ...

    @run_eagerly("the speculative optimizer's step() runs eagerly: dynamo cannot trace the offload engine (call it "
                 "outside a fullgraph=True function, or compile without fullgraph)")
    @without_grad  # (torch.no_grad() is left off by a Ctrl-C in its __enter__ or __exit__: a script goes on)
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Validate the step (see the module docstring).

        Without ``closure``: returns the step's
        :class:`~sofx.offload.engine.EngineStepReport`. With ``closure``
        (``torch.optim``'s contract): it is called first, with grad enabled,
        to compute the loss and run backward (``opt.backward(loss)``, which
        scales the loss when loss scaling is on), and ``step`` returns what
        it returned. Either way the report is also kept in :attr:`last_report`.
        """
        self._refuse_grad_scaler()
        if closure is not None and not callable(closure):  # (Python's bare "'int' object is not callable")
            raise TypeError(f"step(closure): closure is {article(type(closure).__name__)}, expected a callable (one "
                            "that computes the loss and runs backward) or None")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._warn_unscaled_backward()
        self._warn_partial_accumulation()
        # Ctrl-C held back over the step and its notes here: raised as the engine's step ended (held there until its
        # state was whole) or before these lines, it lost the step's report and left the scaled backward noted
        with self.engine.interrupts:
            try:
                report = self.engine.step()
            except BaseException:
                if not self.engine.in_step:  # (dropped: a failed loss-scale rule's step is undone, its backward spent)
                    self._scale_taken = False
                raise
            self._scale_taken = False
            self.last_report = report
        return report if closure is None else loss

    def _refuse_grad_scaler(self) -> None:
        """Refuse a step that ``torch.amp.GradScaler.step(opt)`` calls (it set ``grad_scale`` and ``found_inf`` on the
        optimizer for it; removed here, so that the next ``step()`` is this optimizer's own): the gradients went to
        this optimizer during backward, scaled by the GradScaler's scale, which it neither knows nor checks."""
        if "grad_scale" not in self.__dict__ and "found_inf" not in self.__dict__:
            return
        self.__dict__.pop("grad_scale", None)
        self.__dict__.pop("found_inf", None)
        raise UnsupportedError("torch.amp.GradScaler.step(opt) cannot drive a speculative optimizer: it takes the "
                               "gradients during backward (never left in .grad for the scaler to unscale and check) "
                               "and scales the loss itself. Call opt.zero_grad() to drop this step's gradients "
                               "(scaled by the GradScaler's scale), then use loss_scale='dynamic' (GradScaler's rule; "
                               "sofx.loss_scale.grad_scaler(init_scale=...) for its settings; to go on from this "
                               "scaler's scale, rule, state = sofx.loss_scale.from_torch_grad_scaler(scaler) and "
                               "loss_scale=rule) with opt.backward(loss) and opt.step() in place of "
                               "scaler.scale(loss).backward(), scaler.step(opt) and scaler.update()")

    @run_eagerly("the speculative optimizer's zero_grad() runs eagerly: dynamo cannot trace the offload engine "
                 "(call it outside a fullgraph=True function, or compile without fullgraph)")
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of the current step (speculative steps already taken are undone: work wasted, and
        with an algebraic undo a result within its error, not bit for bit; freeze a model, ``requires_grad_(False)``,
        around a backward it is not to step on, such as a GAN discriminator's in the generator's backward).

        ``set_to_none=False``: as in ``torch.optim``, a parameter that has had a gradient keeps a zero one, so
        a later step steps it (with a zero gradient: moment decay, weight decay) when backward gives it none.
        Which parameters have had one is this optimizer's, not in :meth:`state_dict` (torch keeps the zero
        ``.grad`` on the parameter, here ``.grad`` is ``None`` after ``step()``): a new optimizer starts without.
        So ``model.zero_grad(set_to_none=False)`` in its place does not do this (it finds every ``.grad`` ``None``):
        where torch.optim steps a parameter without a gradient this step on its zeroed ``.grad``, this optimizer
        skips it (``missing_grad="skip"``); call ``opt.zero_grad(set_to_none=False)``.
        """
        with self.engine.interrupts:  # (a Ctrl-C raised as the engine dropped the step left the note below standing)
            dropped = self.engine.in_step
            self.engine.discard_gradients(set_to_none)
            if dropped:  # the scaled backward that fed the dropped step is not the next one's (_warn_unscaled_backward)
                self._scale_taken = False

    @run_eagerly("the speculative optimizer's state_dict() runs eagerly: dynamo cannot trace the offload engine "
                 "(call it outside a fullgraph=True function, or compile without fullgraph)")
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": engine state (tensors + JSON-able values), "param_groups": [...]}``.

        ``param_groups`` are torch.optim-style: every key but ``params`` (a tensor
        ``lr`` the group's own tensor, as torch's; numpy numbers as Python numbers),
        and ``params`` as indices numbered across the groups in order, as ``torch.optim`` numbers them. The hooks of
        ``register_state_dict_pre_hook`` / ``_post_hook`` run as in ``torch.optim``. Groups edited as ``step()``
        refuses them (reordered, added or removed; parameters moved, added, removed or held twice) are refused
        here too: their hparams would be saved beside the engine's state in another order than its blocks'.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        # (groups edited as a step refuses would be saved beside the engine's state in another order or size)
        self._check_groups()
        groups, start = [], 0
        for g in self.param_groups:
            entry = {k: _plain(v) for k, v in g.items() if k != "params"}
            entry["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(entry)
        state_dict = {"state": self.engine.state_dict(), "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @run_eagerly("the speculative optimizer's load_state_dict() runs eagerly: dynamo cannot trace the offload "
                 "engine (call it outside a fullgraph=True function, or compile without fullgraph)")
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict`'s output: block state, loss scale, and every group's hparams (the
        hooks of ``register_load_state_dict_pre_hook`` / ``_post_hook`` run as in ``torch.optim``).

        As ``torch.optim``'s, each group is replaced by a copy of the saved one (a key only the current group has
        is dropped, a saved ``betas`` list stays a list; ``params``, and ``param_names`` where the saved group has
        none, are the current group's; torch's options the saved group lacks take Adam's defaults, and a
        SpeculativeAdamW's weight decay is decoupled, as ``torch.optim.AdamW`` sets it). The groups are checked as
        a step checks them (a group without ``lr``, which torch takes and fails on at the next step, is refused)
        before anything is loaded.

        The loss scale and its rule's settings (``state_dict["state"]["scaler"]``: growth and backoff factors,
        growth interval; DeepSpeed's window, hysteresis, minimum) are the saved ones, whatever the constructor's
        ``loss_scale``: a static one too (a number, or ``None``: a static scale of 1), whose value is only the
        scale of a fresh run. So torch's ``GradScaler.load_state_dict`` takes the saved scale (and init scale
        and growth settings) over its constructor's, ``torch.optim``'s the saved ``lr``, and DeepSpeed's ZeRO
        load puts the saved loss scaler in place, static or dynamic: a resumed run goes on as the saved one. To
        resume with another static scale or other settings, set ``state_dict["state"]["scaler_state"]["scale"]``
        or the setting in ``state_dict["state"]["scaler"]`` before loading. A state dict without the settings
        (an older sofx's) goes on with the constructor's rule. A state of another kind of rule (a dynamic
        scaler's into a static one) is refused.

        As ``torch.optim``'s, the pre-hooks get a shallow copy of ``state_dict``: one that sets or removes a
        top-level key leaves the caller's dict as it was. Into groups edited as ``step()`` refuses them (reordered:
        each would take the other's saved hparams) nothing is loaded: that is refused as the step refuses it."""
        if isinstance(state_dict, Mapping):  # (anything else is refused by name below, after the hooks)
            state_dict = state_dict.copy() if isinstance(state_dict, dict) else dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_groups()  # (the saved groups replace these by position: reordered, each took the other's)
        if isinstance(state_dict, Mapping) and _is_torch_optim_state(state_dict.get("state")):
            raise StructureError(_torch_optim_state_refusal(state_dict["state"]))
        groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise StructureError(f"the state dict has {len(groups) if isinstance(groups, list) else 'no'} param "
                                 f"groups, this optimizer has {len(self.param_groups)}")
        if "state" not in state_dict:
            raise StructureError("the state dict has no 'state' entry (the engine state)")
        for i, (saved, g) in enumerate(zip(groups, self.param_groups)):
            _check_saved_group_fits(saved, g, f"saved param_groups[{i}]")
        # copies, as torch.optim's one deepcopy of the saved groups (a tensor lr stays one, a betas list a list)
        loaded = [self._loaded_group(saved, g) for saved, g in zip(copy.deepcopy(groups), self.param_groups)]
        for i, group in enumerate(loaded):
            self._check_loaded_group(group, f"saved param_groups[{i}]")
        # the engine checks its whole state before it changes anything; the groups cannot fail after it. Ctrl-C held
        # back over both: raised as the engine's load ended, it left the engine's state loaded and the groups not
        with self.engine.interrupts:
            self.engine.load_state_dict(state_dict["state"], where="state_dict['state']")
            self.param_groups = loaded

    def _loaded_group(self, saved: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, Any]:
        """The group that replaces ``group`` on loading (a copy of) ``saved``, as ``torch.optim``'s
        ``load_state_dict`` makes it: the saved group with ``group``'s ``params`` (and its ``param_names`` where the
        saved group has none); a key only ``group`` has is dropped. Then what ``torch.optim.Adam.__setstate__``
        does: its options the saved group lacks take their defaults, and (AdamW's) weight decay is decoupled."""
        new = dict(saved)
        new["params"] = group["params"]
        if "param_names" in group and "param_names" not in new:
            new["param_names"] = group["param_names"]
        for key, default in _TORCH_SETSTATE_DEFAULTS.items():
            new.setdefault(key, default)
        if self._decoupled:  # (torch.optim.AdamW.__setstate__)
            new["decoupled_weight_decay"] = True
        return new

    def _check_loaded_group(self, group: Mapping[str, Any], where: str) -> None:
        """A group as loaded (:meth:`_loaded_group`) has every hparam (torch.optim takes a group without one and
        fails at the next step), valid, and flags this optimizer implements."""
        for key in _HPARAM_KEYS:
            if key not in group:
                raise StructureError(f"{where} has no {key!r}: the saved group replaces this optimizer's, as in "
                                     f"torch.optim, and a group needs {', '.join(map(repr, _HPARAM_KEYS))}")
        hp = group_hparams(group, where)
        check_group_flags(group, where, self._decoupled)
        refusal = self.engine.adam.algebraic_refusal(hp)  # as the next backward would, before anything is loaded
        if refusal is not None:
            raise UnsupportedError(f"{where}: {refusal}")

    # ------------------------------------------------------------ sofx additions
    @property
    def engine(self) -> OffloadEngine:
        """The :class:`~sofx.offload.engine.OffloadEngine` doing the work."""
        if self._engine is None:
            raise UnsupportedError("the optimizer is not fully constructed")
        return self._engine

    @property
    def loss_scale(self) -> float:
        """The loss scale the next backward must use (1.0 without loss scaling)."""
        return self._take_loss_scale()

    def scale_loss(self, loss: Any) -> Any:
        """``loss * loss_scale`` (``loss`` itself without loss scaling); a list or tuple of losses (tensors), as
        ``GradScaler.scale`` takes them, each scaled, in a list or tuple of their type (a named tuple's too;
        ``torch.autograd.backward`` takes it).
        Anything else is refused (a :class:`StructureError` naming it) before the scale is taken."""
        _check_losses(loss, "opt.scale_loss(loss)", sequence=True)
        s = self._take_loss_scale()
        if s == 1.0:
            return loss
        if not isinstance(loss, (list, tuple)):
            return loss * s
        scaled = [x * s for x in loss]
        return type(loss)(*scaled) if hasattr(type(loss), "_fields") else type(loss)(scaled)  # (a named tuple)

    @run_eagerly("the speculative optimizer's loss scale is read eagerly: it notes that a backward is scaled, "
                 "which step() checks (traced, the note was lost), and the scale changes as the run goes")
    def _take_loss_scale(self) -> float:
        """The engine's loss scale, noting that the caller scales a backward with it (see
        :meth:`_warn_unscaled_backward`)."""
        scale = self.engine.loss_scale  # (read first: a Ctrl-C between the two left the note with no scale read)
        self._scale_taken = True
        return scale

    def _warn_unscaled_backward(self) -> None:
        """Warn where loss scaling is on and gradients arrived, but no backward since the last step (or the last
        ``zero_grad()`` that dropped one) was scaled by this optimizer (nor ``loss_scale`` read to scale one): a
        ``loss.backward()`` in place of ``opt.backward(loss)`` gives gradients of the unscaled loss, which
        ``step()`` divides by the scale. A warning, not a refusal: a loss scaled elsewhere by the same factor
        (another optimizer's ``backward``) is right."""
        scale = self.engine.loss_scale
        if scale == 1.0 or self._scale_taken or not self.engine.tracker.started:
            return
        warnings.warn(f"sofx.offload: loss scaling is on (scale {scale}) but no backward since the last step() was "
                      "scaled by this optimizer: a loss.backward() gives gradients of the unscaled loss, which "
                      f"step() divides by {scale}; call opt.backward(loss) (or opt.scale_loss(loss).backward()) "
                      "instead, as GradScaler's scaler.scale(loss).backward()", RuntimeWarning,
                      stacklevel=caller_stacklevel())

    def _warn_partial_accumulation(self) -> None:
        """Warn where gradients arrived from fewer backward calls than ``gradient_accumulation_steps``: the step is
        taken on the sum of the micro-steps seen (as ``torch.optim`` steps on what ``.grad`` accumulated), which
        the last accumulation of an epoch means, but a forgotten micro-step, or ``no_sync()`` backwards under DDP
        (which do not count), do not. A warning, not a refusal, so that a partial last accumulation steps;
        DeepSpeed's ``engine.step()`` before the boundary does nothing instead. It counts the backward calls that
        gave gradients (:attr:`~sofx.offload.engine.OffloadEngine.micro_steps`), not the most gradients of any one
        parameter: micro-batches through other branches of a model (mixture-of-experts routing, multi-task heads)
        reach no parameter in all of them, and that warned after a full accumulation."""
        tracker = self.engine.tracker
        declared, seen = tracker.accumulation_steps, self.engine.micro_steps
        if not tracker.started:
            return
        if seen >= declared:
            self._warn_extra_accumulation()
            return
        ddp = (" (under DDP a backward inside no_sync() does not count: with no_sync(), "
               "gradient_accumulation_steps=1)" if self.engine.reduced else "")
        taken = "that micro-step's gradients" if seen == 1 else f"the sum of those {seen} micro-steps' gradients"
        warnings.warn(f"sofx.offload: step() after {seen} backward call{'s' if seen > 1 else ''} (micro-steps) of "
                      f"gradient_accumulation_steps={declared}: the step is taken on {taken} (with each loss divided "
                      f"by {declared}, {seen}/{declared} of a full accumulation's), as a partial last accumulation at "
                      f"the end of an epoch is meant to; otherwise call step() once per {declared} backward calls "
                      f"(DeepSpeed's engine.step() before the boundary does nothing; here it steps){ddp}",
                      RuntimeWarning, stacklevel=caller_stacklevel())

    def _warn_extra_accumulation(self) -> None:
        """Warn where more backward calls than ``gradient_accumulation_steps`` (N > 1) gave this step gradients: a
        block was ready, and speculated, during the N-th call, so every later call's gradients are *late* (summed,
        the block's step undone and redone in ``step()``: right, but each such block is stepped twice), and the step
        takes more than a full accumulation (each loss divided by N). ``torch.optim`` steps on whatever ``.grad``
        accumulated, DeepSpeed at each boundary of N: a warning (the sum is stepped), not a refusal. It counts the
        backward calls numbered (:attr:`sofx.offload.backward_passes.BackwardPasses.calls`: too few where that cannot
        be told, never too many: a reentrant checkpoint's nested backward is its enclosing call). N = 1 (the
        default) declares nothing: several backwards accumulate as ``.grad`` does, silently."""
        declared, seen = self.engine.tracker.accumulation_steps, self.engine.passes.calls
        if declared == 1 or seen <= declared:
            return
        warnings.warn(f"sofx.offload: step() after {seen} backward calls (micro-steps) of "
                      f"gradient_accumulation_steps={declared}: the step is taken on the sum of those {seen} "
                      f"micro-steps' gradients (with each loss divided by {declared}, {seen}/{declared} of a full "
                      f"accumulation's), as torch.optim steps on what .grad accumulated; the later calls' gradients "
                      f"were late (a block speculated during backward call {declared} that they reached was undone "
                      f"and redone in step()); call step() once per {declared} backward calls (DeepSpeed steps at "
                      "each boundary)", RuntimeWarning, stacklevel=caller_stacklevel())

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scale_loss(loss).backward(**kwargs)``; ``loss`` a tensor (several losses:
        ``torch.autograd.backward(opt.scale_loss([loss1, loss2]))``)."""
        _check_losses(loss, "opt.backward(loss)", sequence=False)
        self.scale_loss(loss).backward(**kwargs)

    @property
    def executor(self) -> str:
        """The executor in use ("inline", "thread" or "process"; "thread" after a shared-memory fallback)."""
        return self.engine.executor_name

    @property
    def speculate(self) -> bool:
        """Whether blocks are speculated during backward (settable between steps, not after ``close()``; under
        ``ddp`` set on every rank: a rank's setting alone makes the next ``step()`` raise on every rank, naming each
        rank's)."""
        return self.engine.speculation.enabled

    @speculate.setter
    def speculate(self, on: bool) -> None:
        on = flag("speculate", on, UnsupportedError)  # (bool("no") was True)
        self.engine.set_speculation(on)  # (under ddp the ranks compare it at the next step)

    def reload_params(self) -> None:
        """Take the model's current parameter values as the fp32 masters: after a write into ``p.data`` in place
        (``p.data.clamp_()``), which the optimizer does not see (``model.load_state_dict()``, ``p.data = t`` and
        in-place changes of the parameters themselves under ``torch.no_grad()`` are taken at the next backward)."""
        self.engine.reload_params()

    def close(self) -> None:
        """Stop the worker thread/process and release shared memory (idempotent). The state stays readable
        (``opt.state[p]``, :meth:`state_dict`: a ``with opt:`` loop saves after the block). An optimizer still open
        when the interpreter exits is closed then (before finalization, where its threads could no longer run), after
        a step() still running in a daemon thread (waited for up to ``sofx.offload.engine.EXIT_WAIT_S`` seconds)."""
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> "_SpeculativeBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled (it holds gradient hooks on the model, an "
                        "executor and locks); use state_dict()")


# torch.optim.Adam.__setstate__'s defaults of its options, for a loaded group without them (an older state dict)
_TORCH_SETSTATE_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                            "differentiable": False, "decoupled_weight_decay": False, "fused": None}
_HPARAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def _check_no_repeats(params: list[torch.Tensor], where: str) -> None:
    """Refuse a group holding a parameter twice: torch.optim warns that it "will cause an error" in future and
    steps it twice per step; its blocks would hold it twice here."""
    first: dict[int, int] = {}
    for j, p in enumerate(params):
        i = first.setdefault(id(p), j)
        if i != j:
            raise UnsupportedError(f"{where}[{j}] is {where}[{i}] again (shape {tuple(p.shape)}): a parameter can be "
                                   "in a group once (torch.optim warns that it steps it twice and will refuse it)")


def _check_saved_group_fits(saved: Any, group: Mapping[str, Any], where: str) -> None:
    """A saved param group fits ``group``: a dict with as many ``params``, whose tensors (a tensor ``lr``, ``betas``
    of tensors) hold their elements in their storage (not freed or shrunk: torch's deepcopy of the group failed on
    one, :func:`~sofx.kernels.storage.refuse_short_storage`; an :class:`HParamError` naming it)."""
    if not isinstance(saved, Mapping):
        raise StructureError(f"{where}: expected a dict (a param group), got {type(saved).__name__}")
    for key, value in saved.items():
        values = value if isinstance(value, (list, tuple)) else (value,)
        for j, v in enumerate(values):
            if isinstance(v, torch.Tensor) and not in_storage(v):
                refuse_short_storage(v, f"{where}[{key!r}]" + (f"[{j}]" if values is value else ""), HParamError)
    params = saved.get("params", ())
    if not isinstance(params, (list, tuple)) or len(params) != len(group["params"]):
        found = f"{len(params)} parameters" if isinstance(params, (list, tuple)) else repr(params)
        raise StructureError(f"{where}['params']: this optimizer's group has {len(group['params'])} parameters, "
                             f"the saved group {found}")


def _is_torch_optim_state(state: Any) -> bool:
    """Whether ``state`` is a ``torch.optim`` state dict's ``state``: per-parameter dicts keyed by parameter index
    (empty before torch's first step), where the engine's is a dict of named entries (``format``, ``blocks``)."""
    return isinstance(state, Mapping) and all(isinstance(k, int) and not isinstance(k, bool)
                                              and isinstance(v, Mapping) for k, v in state.items())


def _torch_optim_state_refusal(state: Mapping[int, Any]) -> str:
    """Why a ``torch.optim`` state dict's ``state`` is not loaded, and what to do instead: its moments are assigned
    per parameter; an empty one (taken before torch's first step) has none, only its param groups' hparams.

    An empty one is refused too, not taken as "no state yet": a checkpoint of torch's would load or fail by whether
    it was saved before the first step."""
    own = "not this optimizer's own (its state_dict()'s, of flat blocks)"
    if not state:
        return (f"state_dict['state'] is empty: a torch.optim state dict taken before its first step (no "
                f"per-parameter moments), {own}; there are no moments to carry over: set its hparams in "
                "opt.param_groups (for g, saved in zip(opt.param_groups, state_dict['param_groups']): g['lr'] = "
                "saved['lr'], and so 'betas', 'eps', 'weight_decay'), and where this optimizer has stepped, start "
                "its moments afresh with opt.state = collections.defaultdict(dict)")
    found = sorted(state)[:3]
    return (f"state_dict['state'] is a torch.optim state (per-parameter entries keyed by index: "
            f"{found}{'...' if len(state) > 3 else ''}), {own}; to carry torch.optim.Adam/AdamW's moments over, "
            "assign them per parameter: opt.state[p][key] = value for key in 'step', 'exp_avg', 'exp_avg_sq'")


def _plain(v: Any) -> Any:
    """A group value as checkpoints store it: numpy scalars (a LambdaLR of np.cos) as Python numbers, tuples
    and lists element by element. A tensor (``lr=torch.tensor(1e-3)``) is kept, the group's own, as
    ``torch.optim``'s state_dict keeps it (its load_state_dict gives the group a copy: a tensor again)."""
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (tuple, list)):
        return type(v)(_plain(x) for x in v)
    if type(v) in (bool, int, float):  # (numpy's float64 is a float subclass)
        return v
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    return v


class SpeculativeAdamW(_SpeculativeBase):
    """AdamW (decoupled weight decay) with fp32 masters, speculated during backward.

    The loop, the trajectory it follows and how it differs from ``torch.optim``: the docstring of
    :mod:`sofx.offload.facade` (``help(sofx.offload.facade)``). ``lr``, ``betas``, ``eps``, ``weight_decay``
    and ``torch.optim.AdamW``'s options as there (``amsgrad``, ``maximize``, ``differentiable``: only False;
    ``foreach``, ``fused``, ``capturable``: ignored, but a tensor ``lr`` or beta with ``foreach=True`` and
    ``capturable=False``, and ``fused`` with ``foreach``, are refused, as torch refuses them). ``betas`` is
    taken and stored as torch does (:func:`sofx.adam.torch_betas`): a pair, or a tensor or numpy array of 2
    elements, a 1-element tensor squeezed to 0-d; both floats or both tensors (an int, numpy's float32 or a
    tensor beside a float is refused, as torch refuses it; a group's ``betas`` are any numbers). The others:

    - ``max_grad_norm``: ``None`` (no clipping) or a number >= 0, as ``clip_grad_norm_``'s ``max_norm`` (0 is
      no clipping under ``"deepspeed"``); ``loss_scale``: ``None``, ``"dynamic"`` (the profile's dynamic
      scaler), a number (static) or a :mod:`sofx.loss_scale` rule (with each, a step whose gradients are not
      all finite is skipped, where ``torch.optim`` alone would write nan); ``profile``: ``"torch"`` (``GradScaler`` +
      ``clip_grad_norm_``) or ``"deepspeed"`` (ZeRO-3's order and rules). A ``torch.amp.GradScaler`` (after its
      ``update()``, or never used) is carried over as its rule and state,
      ``rule, state = sofx.loss_scale.from_torch_grad_scaler(scaler)``: ``loss_scale=rule`` starts at its scale with
      no clean step counted; its growth tracker goes in through :meth:`load_state_dict`
      (``saved = opt.state_dict(); saved["state"]["scaler_state"].update(state._asdict());
      opt.load_state_dict(saved)``, before the first backward), else the scale grows that many steps late. Back:
      ``GradScaler(device).load_state_dict(sofx.loss_scale.to_torch_grad_scaler_state(rule,
      opt.state_dict()["state"]["scaler_state"]))``. A rule whose ``scale`` or ``update`` raises in ``step()`` (a
      custom rule's bug) undoes the step (a :class:`~sofx.loss_scale.LossScaleRuleError`, the rule's exception its
      cause): nothing of it is taken, and the optimizer goes on from the state before it.
    - ``executor``: ``"inline"``, ``"thread"`` or ``"process"`` (a worker process with ``num_threads``
      threads, on shared memory in ``shm_dir``, at most ``shm_limit_bytes`` of it; ``"thread"``, with a
      warning, where that cannot hold the blocks); ``timeout``: the seconds a wait for it may take before
      it raises, and the most ``close()`` waits for it to finish what was queued (then a worker thread is left
      to finish its operation alone, with a warning; a worker process is killed).
    - ``block_numel``: the most elements of a block (a larger parameter is a block of its own);
      ``n_device_blocks``: that many first blocks stay on the model's device and are stepped there in
      ``step()`` -- first in the order the parameters are given (the groups in order, each group's params
      in order), which is the model's (first layers first, the gradients that arrive last in backward)
      only where the groups follow it: a decay / no-decay split puts every layer's weights before the
      first bias (``opt.engine.layouts`` lists each block's ``param_indices`` and ``on_device``);
      ``swap_params``: see the module docstring.
    - ``missing_grad``: ``"skip"`` or ``"zero"``, for a parameter that got no gradient;
      ``gradient_accumulation_steps``: backward calls (micro-steps) per ``step()`` (a ``step()`` after fewer,
      or more where it is over 1, steps on their sum, with a ``RuntimeWarning`` naming the counts).
    - ``speculate``: on or off (also settable between steps); ``policy``: the
      :class:`~sofx.speculate.AdaptivePolicy` that pauses it while clipping fires on most steps;
      ``snapshot_budget_bytes``: the most snapshot memory the speculative steps may hold (``None``: no limit).
    - ``bias_correction``, ``state_dtype`` (of the moments: float32, bfloat16 or float16), ``undo`` and
      ``backend``: as :func:`sofx.adamw`.
    - ``ddp``: the ``DistributedDataParallel`` module whose parameters these are, under data parallelism (see
      the module docstring): their gradients are taken as DDP averages them, from a communication hook it
      registers on the module.
    """

    _decoupled = True


class SpeculativeAdam(_SpeculativeBase):
    """Adam (L2 weight decay, ``g += wd * p``) with fp32 masters, speculated during backward.

    Same arguments as :class:`SpeculativeAdamW`; ``weight_decay`` defaults to 0.
    """

    _decoupled = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, **kwargs: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
