"""The facade under DistributedDataParallel (gloo, 2 ranks) equals DDP + torch.optim.AdamW, side by side.

Each rank trains the same tiny model twice, on its own batches: wrapped in ``DistributedDataParallel`` and
stepped by ``SpeculativeAdamW(ddp.parameters(), ddp=ddp)``, and wrapped again and stepped by
``torch.optim.AdamW`` + ``clip_grad_norm_`` on the averaged gradients (+ ``torch.amp.GradScaler`` where loss
scaling is on). Every step must be torch's within DESIGN.md's 1e-6 relative (bitwise where nothing is undone
and the kernels are torch's), and the replicas bitwise identical across ranks.

Without ``ddp=`` the engine took each rank's *local* gradient in its accumulation hooks during backward and
cleared ``.grad``, so DDP's reducer all-reduced nothing: ``step()`` refused the zeros DDP wrote into ``.grad``
afterwards, or (``find_unused_parameters``, ``static_graph``: DDP leaves an undefined ``.grad`` alone) every rank
silently stepped its own gradient and the replicas diverged -- with speculation off too. With ``ddp=`` the
optimizer takes each bucket's averaged gradient from a DDP communication hook as its all-reduce completes
(blocks are speculated on those during backward), and a parameter DDP found unused on every rank is not
stepped, as torch's ``.grad`` of ``None`` is not. Without ``ddp=`` the parameters of a DDP module are now
refused, naming it.

One spawned group runs every case (10 s group timeout); the tests compare what the ranks saved.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import gc
import math
import time
import warnings
import weakref
from typing import Callable, Iterator, Sequence

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

import sofx
from sofx.loss_scale import grad_scaler
from sofx.offload.blocks import BlockLayout
from sofx.speculate import AdaptivePolicy
from helpers import error_text, meet, run_gloo_cases

STEPS = 5
LR = 1e-2
MAX_NORM = 1.0
CLIP_STEPS = {1, 3}   # inp.weight's gradient (the last to arrive) 50x: blocks speculated before it are redone
INF_STEP = 4          # with loss scaling, rank 1's gradient of out.weight has an inf: DDP's average has it
TOL = 1e-6
# the counts of a step report that say what became of each block
OUTCOMES = ("speculated", "committed", "undone", "redone", "stepped_late", "not_stepped")


class _Net(nn.Module):
    """A tiny MLP whose middle layer can be left out of a forward (``use_extra``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.extra, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.out(h)


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)


def _boost(g: torch.Tensor) -> torch.Tensor:
    return g * 50.0


def _inject_inf(g: torch.Tensor) -> torch.Tensor:
    g = g.clone()
    g.view(-1)[0] = math.inf
    return g


def _always(step: int, rank: int) -> bool:
    return True


def _never(step: int, rank: int) -> bool:
    return False


def _sometimes(step: int, rank: int) -> bool:
    """``extra`` unused on every rank at step 2 (DDP leaves its ``.grad`` alone: torch does not step it), on rank 1
    only at step 3 (DDP averages rank 0's gradient with rank 1's zeros)."""
    return not (step == 2 or (step == 3 and rank == 1))


def _backward(ddp: DDP, step: int, rank: int, accumulate: int, no_sync: bool, uses_extra, scale,
              inject: bool) -> None:
    """This step's micro-steps of ``ddp``: ``scale(loss).backward()`` each, all but the last under ``no_sync()``
    where asked; ``inp.weight``'s gradient is boosted at CLIP_STEPS and, with ``inject``, rank 1's ``out.weight``
    gradient gets an inf at INF_STEP."""
    net = ddp.module
    net.use_extra = uses_extra(step, rank)
    handles = [net.inp.weight.register_hook(_boost)] if step in CLIP_STEPS else []
    if inject and step == INF_STEP and rank == 1:
        handles.append(net.out.weight.register_hook(_inject_inf))
    try:
        for micro in range(accumulate):
            quiet = ddp.no_sync() if no_sync and micro < accumulate - 1 else contextlib.nullcontext()
            with quiet:
                x, y = _batch(step, micro, rank)
                scale(((ddp(x) - y) ** 2).mean()).backward()
    finally:  # (a backward that raised left them on, for the steps after)
        for handle in handles:
            handle.remove()


def _plain_backward(ddp: DDP, step: int, rank: int) -> None:
    """:func:`_backward` of one synchronized micro-step of ``ddp``'s loss as it is (not scaled), the extra branch
    used, no inf injected."""
    _backward(ddp, step, rank, 1, False, _always, lambda loss: loss, False)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def _ddp(ddp_kwargs: dict) -> DDP:
    torch.manual_seed(0)
    return DDP(_Net(), **ddp_kwargs)


def _steps_side_by_side(out: dict, torch_side: tuple, sofx_side: tuple,
                        backward: Callable[[DDP, int, Callable[[torch.Tensor], torch.Tensor]], None],
                        max_norm: float | None) -> None:
    """STEPS steps of DDP + torch.optim.AdamW with its GradScaler and ``clip_grad_norm_`` (``torch_side``: model,
    optimizer, scaler) and of DDP + SpeculativeAdamW (``sofx_side``: model, optimizer), ``backward(ddp, step,
    scale)`` the same batches on both: the flat parameters after every step, per step (speculated, redone, clipped,
    skipped) of the facade's report and its outcomes, then each parameter's step count (torch: none for a
    parameter never stepped) into ``out``."""
    (ref, ropt, scaler), (model, opt) = torch_side, sofx_side
    for step in range(STEPS):
        ropt.zero_grad()
        backward(ref, step, scaler.scale)
        scaler.unscale_(ropt)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], max_norm)
        scaler.step(ropt)
        scaler.update()
        opt.zero_grad()
        backward(model, step, opt.scale_loss)
        report = opt.step()
        out["torch"].append(_flat(ref.module))
        out["sofx"].append(_flat(model.module))
        out["reports"].append([report.speculated, report.redone, int(report.clipped), int(report.skipped)])
        out["outcomes"].append({"actions": report.actions, **{key: getattr(report, key) for key in OUTCOMES}})
    out["counts"] = [[int(ropt.state[p]["step"]) if p in ropt.state else 0 for p in ref.parameters()],
                     [int(opt.state[p]["step"]) for p in model.parameters()]]


def _side_by_side(rank: int, *, executor: str = "thread", speculate: bool = True, ddp_kwargs: dict | None = None,
                  scaled: bool = True, accumulate: int = 1, no_sync: bool = False, uses_extra=_always,
                  max_norm: float | None = MAX_NORM, backend: str = "auto") -> dict:
    """STEPS steps of DDP + SpeculativeAdamW and of DDP + torch.optim.AdamW on this rank's batches: the flat
    parameters after every step, and per step (speculated, redone, clipped, skipped) of the facade's report."""
    ddp_kwargs = ddp_kwargs or {}
    ref = _ddp(ddp_kwargs)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2, enabled=scaled)
    model = _ddp(ddp_kwargs)
    opt = sofx.offload.SpeculativeAdamW(
        model.parameters(), lr=LR, max_grad_norm=max_norm, executor=executor, speculate=speculate,
        loss_scale=grad_scaler(init_scale=2.0 ** 10, growth_interval=2) if scaled else None, block_numel=16,
        gradient_accumulation_steps=1 if no_sync else accumulate, backend=backend,
        policy=AdaptivePolicy(enabled=False), ddp=model)  # (speculating at every step, clipped or not)
    meet()  # (each rank's process executor started its worker at its own pace)
    out: dict = {"torch": [], "sofx": [], "reports": [], "outcomes": [],
                 "bucket_view": vars(model)["_sofx_ddp_route"].bucket_view}

    def backward(ddp: DDP, step: int, scale: Callable[[torch.Tensor], torch.Tensor]) -> None:
        _backward(ddp, step, rank, accumulate, no_sync, uses_extra, scale, scaled)

    try:
        _steps_side_by_side(out, (ref, ropt, scaler), (model, opt), backward, max_norm)
    finally:
        opt.close()
    return out


# name -> keyword arguments of _side_by_side
SETUPS = {
    "inline": dict(executor="inline"),
    "inline_off": dict(executor="inline", speculate=False),
    "thread": dict(executor="thread"),
    "thread_off": dict(executor="thread", speculate=False),
    "process": dict(executor="process"),
    "process_off": dict(executor="process", speculate=False),
    "bucket_view": dict(ddp_kwargs={"gradient_as_bucket_view": True}),
    "find_unused": dict(ddp_kwargs={"find_unused_parameters": True}, uses_extra=_sometimes),
    "static_graph": dict(ddp_kwargs={"static_graph": True}, uses_extra=_never),
    "no_sync": dict(accumulate=2, no_sync=True),
    "accumulate_synced": dict(accumulate=2),
    "bitwise": dict(scaled=False, max_norm=None, backend="reference"),
}


@contextlib.contextmanager
def _reported(out: dict, opts: Sequence, case: str = "") -> Iterator[None]:
    """Run a case's body: what it raises is this rank's ``out["error"]`` (``"case: Type: message"``, for the test's
    message) instead of ending the rank's cases, and every optimizer of ``opts`` that has ``close()`` (a
    torch.optim one has none) is closed either way; ``opts`` is read at the end (a list the body may append to)."""
    try:
        yield
    except Exception as exc:
        where = f"{case}: " if case else ""
        out["error"] = f"{where}{type(exc).__name__}: {exc}"
    finally:
        for opt in opts:
            close = getattr(opt, "close", None)
            close() if close else None


def _setup_case(name: str, rank: int) -> dict:
    """SETUPS[name] on this rank; what it raised, for the test's message."""
    try:
        return _side_by_side(rank, **SETUPS[name])
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _refusals(rank: int) -> dict:
    """What ``ddp=`` refuses at construction: no DDP module, a DDP module none of whose parameters the optimizer
    steps, a DDP module with a communication hook of its own, or with ``mixed_precision`` (which registers one), a
    parameter whose all-reduce DDP delays (``delay_all_reduce_named_params``), with ``ddp=`` or without."""
    ddp, hooked = _ddp({}), _ddp({})
    hooked.register_comm_hook(None, allreduce_hook)
    mixed = _ddp({"mixed_precision": _MixedPrecision(param_dtype=torch.bfloat16)})
    torch.manual_seed(0)
    net = _Net()
    delayed = DDP(net, delay_all_reduce_named_params=[("extra.weight", net.extra.weight)],
                  param_to_hook_all_reduce=net.inp.weight)
    out = {}
    for name, params, given in (("module", ddp.parameters(), ddp.module),
                                ("other_params", nn.Linear(2, 2).parameters(), ddp),
                                ("own_hook", hooked.parameters(), hooked),
                                ("mixed_precision", mixed.parameters(), mixed),
                                ("delayed", delayed.parameters(), delayed)):
        out[name] = error_text(lambda: sofx.offload.SpeculativeAdamW(params, ddp=given).close())
    out["delayed_without_ddp"] = error_text(lambda: sofx.offload.SpeculativeAdamW([net.extra.weight]).close())
    return out


def _replaced_then_closed(rank: int) -> dict:
    """An optimizer over the same DDP module takes its gradients over from an older one, and over the model's
    parameters from one made before it was wrapped (whose gradient hooks would take them first): those refuse
    to step. Once it is closed, DDP averages for torch.optim as without a hook, with the same bits."""
    torch.manual_seed(0)
    net = _Net()
    unwrapped = sofx.offload.SpeculativeAdamW(net.parameters(), lr=LR)
    model, ref = DDP(net), _ddp({})
    first = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, ddp=model)
    second = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, ddp=model)
    _plain_backward(model, 0, rank)
    out = {"unwrapped": error_text(unwrapped.step), "first": error_text(first.step),
           "second": error_text(second.step)}
    for opt in (unwrapped, first, second):
        opt.close()
    ref.module.load_state_dict(model.module.state_dict())
    for net in (model, ref):
        opt = torch.optim.AdamW(net.parameters(), lr=LR, foreach=False)
        for step in range(2):
            opt.zero_grad()
            _backward(net, step, rank, 1, False, _always, lambda loss: loss, False)
            opt.step()
    out["params"] = [_flat(model.module), _flat(ref.module)]
    return out


def _without_ddp(rank: int) -> dict:
    """An optimizer over a DDP module's parameters without ``ddp=``: refused at construction (speculation on or
    off, with each executor), and at the first backward where the model was wrapped after the optimizer was
    made (no gradient taken, the parameters unchanged), and at every step after that."""
    out = {}
    for executor in ("inline", "thread", "process"):
        for speculate in (True, False):
            ddp = _ddp({"find_unused_parameters": True})
            out[f"{executor}_{speculate}"] = error_text(lambda: sofx.offload.SpeculativeAdamW(
                ddp.parameters(), executor=executor, speculate=speculate).close())
    torch.manual_seed(0)
    net = _Net()
    opt = sofx.offload.SpeculativeAdamW(net.parameters(), lr=LR, executor="thread")
    ddp = DDP(net, find_unused_parameters=True)
    before = _flat(net)
    out["backward"] = error_text(lambda: _backward(ddp, 0, rank, 1, False, _always, lambda loss: loss, False))
    out["unchanged"] = torch.equal(_flat(net), before) and not opt.engine.in_step
    out["step"] = error_text(opt.step)
    opt.close()
    return out


def _refused_in_hook(rank: int, make: Callable[[], DDP] = functools.partial(_ddp, {})) -> dict:
    """An hparam the engine refuses when the step's first block is ready (lr nan): at step 1 on rank 1 only, at
    step 2 on both ranks, then a second backward accumulated before step(). What each backward raised, and the
    parameters after each step next to DDP + torch.optim.AdamW's (DDP's all-reduce of every bucket completed, so
    torch's backward is a whole one); both DDP modules of ``make()``."""
    ref, model = make(), make()
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                        policy=AdaptivePolicy(enabled=False))
    plain = functools.partial(_plain_backward, rank=rank)
    out: dict = {"raised": [], "torch": [], "sofx": []}
    with _reported(out, [opt]):
        for step in range(4):
            ropt.zero_grad()
            plain(ref, step)
            plain(ref, step) if step == 2 else None
            ropt.step()
            opt.zero_grad()
            refused = step == 2 or (step == 1 and rank == 1)
            opt.param_groups[0]["lr"] = math.nan if refused else LR
            out["raised"].append(error_text(lambda: plain(model, step)))
            opt.param_groups[0]["lr"] = LR
            if step == 2:
                plain(model, step)
            opt.step()
            out["torch"].append(_flat(ref.module))
            out["sofx"].append(_flat(model.module))
    return out


def _change_grad(p: torch.Tensor, how: str) -> None:
    if how == "in_place":
        p.grad.mul_(2.0)
    elif how == "replaced":
        p.grad = p.grad * 2.0
    else:
        p.grad = None


def _forward_between_backward_and_step(rank: int) -> dict:
    """A forward in grad mode between backward and ``step()`` (a metric) at the first step of a DDP module with
    ``gradient_as_bucket_view``: DDP rebuilds its buckets there (once: in the forward after the first synchronized
    backward), moving every ``.grad`` into a view of the new buckets, the same values. Before, ``step()`` took that
    for a ``.grad`` changed after backward and refused. What each ``step()`` said, and the parameters after each
    next to DDP + torch.optim.AdamW's (reference kernels: bitwise)."""
    ref, model = _ddp({"gradient_as_bucket_view": True}), _ddp({"gradient_as_bucket_view": True})
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, backend="reference", ddp=model)
    out: dict = {"said": [], "torch": [], "sofx": []}
    try:
        for step in range(2):
            for net, optimizer in ((ref, ropt), (model, opt)):
                optimizer.zero_grad()
                _plain_backward(net, step, rank)
                net(_batch(step, 1, rank)[0])  # (grad mode on)
                said = error_text(optimizer.step)
            out["said"].append(said)
            out["torch"].append(_flat(ref.module))
            out["sofx"].append(_flat(model.module))
    finally:
        opt.close()
    return out


def _grad_changed_after_backward(rank: int) -> dict:
    """``.grad`` of an averaged parameter changed between backward and step() (scaled in place, replaced,
    cleared): what step() said, whether the parameters stayed as they were, and whether zero_grad() and a step
    then work. And ``.grad`` set by hand on a parameter DDP found unused on every rank (``extra``, left out of
    the forward): the parameters after that step, next to DDP + torch.optim.AdamW's."""
    plain = functools.partial(_backward, rank=rank, accumulate=1, no_sync=False, scale=lambda loss: loss,
                              inject=False)
    out: dict = {}
    for how in ("in_place", "replaced", "cleared"):
        model = _ddp({})
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model)
        try:
            plain(model, 0, uses_extra=_always)
            before = _flat(model.module)
            _change_grad(model.module.out.weight, how)
            out[how] = error_text(opt.step)
            out[f"{how}_unchanged"] = torch.equal(_flat(model.module), before)
            opt.zero_grad()
            plain(model, 1, uses_extra=_always)
            out[f"{how}_then"] = error_text(opt.step)
        finally:
            opt.close()
    ref, model = _ddp({"find_unused_parameters": True}), _ddp({"find_unused_parameters": True})
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model)
    try:
        for net, step in ((ref, ropt.step), (model, opt.step)):
            plain(net, 0, uses_extra=_never)
            net.module.extra.weight.grad = torch.full_like(net.module.extra.weight, 0.5)
            step()
        out["set_by_hand"] = [_flat(model.module), _flat(ref.module)]
    finally:
        opt.close()
    return out


def _uneven_inputs(rank: int) -> dict:
    """Under ``ddp.join()`` rank 0 has 2 batches and rank 1 has 3 (rank 0 shadows rank 1's all-reduce at the
    third), zero_grad() after each step; then one step more on both ranks. The parameters after, for the
    facade and for torch.optim.AdamW, and what state_dict() said on this rank after the join."""
    out: dict = {}
    for name in ("torch", "sofx"):
        model = _ddp({})
        opt = (torch.optim.AdamW(model.parameters(), lr=LR, foreach=False) if name == "torch" else
               sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model))
        plain = functools.partial(_plain_backward, model, rank=rank)
        with _reported(out, [opt], case=name):
            with model.join():
                for step in range(2 + rank):
                    plain(step)
                    opt.step()
                    opt.zero_grad()
            if name == "sofx":
                out["state_dict"] = error_text(opt.state_dict)
            plain(3)
            opt.step()
            out[name] = _flat(model.module)
    return out


def _join_by_remaining_ranks(rank: int) -> dict:
    """``ddp.join(divide_by_initial_world_size=False)`` and ``Join([ddp], ...)`` with it, while the optimizer takes
    the gradients; and once it is closed."""
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model)
    out = {"join": error_text(lambda: model.join(divide_by_initial_world_size=False)),
           "Join": error_text(lambda: Join([model], divide_by_initial_world_size=False)),
           "default": error_text(model.join)}
    opt.close()
    out["closed"] = error_text(lambda: model.join(divide_by_initial_world_size=False))
    return out


def _engine_state(opt: sofx.offload.SpeculativeAdamW) -> list[torch.Tensor]:
    """Copies of every block's master, moments and step counts."""
    return [getattr(t, name).clone() for t in opt.engine.tensors.values()
            for name in ("master", "exp_avg", "exp_avg_sq", "counts")]


def _resumed_from_other_checkpoints(rank: int) -> dict:
    """Three steps, the model's and the optimizer's state saved after each; then a resumed run (a new DDP module
    and optimizer) where rank 1 loads the checkpoint saved two steps before rank 0's: what its first step() raised
    on each rank, and whether the parameters and the optimizer state stayed as they were; then, rank 1 having
    loaded rank 0's checkpoint after zero_grad(), two steps. And a resumed run where both ranks load the same
    checkpoint, two steps; and the first optimizer's two steps on: the parameters after each run. Then a resumed
    run where both ranks load the same checkpoint and rank 1 sets another lr: what its first step() raised."""
    plain = functools.partial(_plain_backward, rank=rank)

    def make(model: DDP) -> sofx.offload.SpeculativeAdamW:
        return sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                             policy=AdaptivePolicy(enabled=False))

    def resume(checkpoint: tuple[dict, dict]) -> tuple[DDP, sofx.offload.SpeculativeAdamW]:
        model = _ddp({})
        opt = make(model)
        model.module.load_state_dict(checkpoint[0])
        opt.load_state_dict(checkpoint[1])
        return model, opt

    def two_steps(model: DDP, opt: sofx.offload.SpeculativeAdamW) -> torch.Tensor:
        for step in (3, 4):
            opt.zero_grad()
            plain(model, step)
            opt.step()
        return _flat(model.module)

    out: dict = {}
    opts = []
    with _reported(out, opts):
        model = _ddp({})
        opts.append(make(model))
        saved = []
        for step in range(3):
            opts[0].zero_grad()
            plain(model, step)
            opts[0].step()
            saved.append(copy.deepcopy((model.module.state_dict(), opts[0].state_dict())))
        mixed, opt = resume(saved[2] if rank == 0 else saved[0])
        opts.append(opt)
        plain(mixed, 3)
        before = (_flat(mixed.module), _engine_state(opt))
        out["mismatch"] = error_text(opt.step)
        after = (_flat(mixed.module), _engine_state(opt))
        out["unchanged"] = torch.equal(before[0], after[0]) and all(map(torch.equal, before[1], after[1]))
        opt.zero_grad()
        mixed.module.load_state_dict(saved[2][0])
        opt.load_state_dict(saved[2][1])
        out["fixed"] = two_steps(mixed, opt)
        same, opt = resume(saved[2])
        opts.append(opt)
        out["same"] = two_steps(same, opt)
        other_lr, opt = resume(saved[2])  # the same checkpoint, and rank 1 sets another lr
        opts.append(opt)
        opt.param_groups[0]["lr"] = LR * (1 + rank)
        plain(other_lr, 3)
        out["other_lr"] = error_text(opt.step)
        out["continued"] = two_steps(model, opts[0])
    return out


def _stepped_then_changed_on_rank_0(out: dict, how: str, change: Callable[[], None], rank: int, model, opt,
                                    at: int, step: Callable[[int], str]) -> None:
    """After ``change`` made on rank 1 alone, a synchronized backward and ``step()``: into ``out[how]`` what it
    raised and ``out[how + '_unchanged']`` whether the parameters and the optimizer state stayed as they were; then
    the same change on rank 0 too (after ``zero_grad()``): into ``out[how + '_same']`` what ``step(at)`` raised."""
    opt.zero_grad()
    _plain_backward(model, at, rank=rank)
    before = (_flat(model.module), _engine_state(opt))
    out[how] = error_text(opt.step)
    after = (_flat(model.module), _engine_state(opt))
    out[f"{how}_unchanged"] = torch.equal(before[0], after[0]) and all(map(torch.equal, before[1], after[1]))
    opt.zero_grad()
    if rank == 0:
        change()
    out[f"{how}_same"] = step(at)


def _state_changed_on_one_rank(rank: int) -> dict:
    """Two steps; then, each in turn, one way of changing the optimizer state made on rank 1 alone before a step
    (the first of them too: a state dict loaded on one rank only, a state assignment, opt.state reset,
    reload_params after a weight edit, another lr): what that step() raised on each rank and whether the
    parameters and the optimizer state stayed as they were; then, the same change made on rank 0 too (after
    zero_grad()), what the step raised. Then rank 1 loads its own state dict alone (nothing differs), and two steps:
    what they raised, and the parameters after. Then steps without a backward (the ranks decide in step()): rank 1
    sets a step count alone; then rank 0 sets it too and rank 1 sets an exp_avg alone (no zero_grad() between);
    then rank 0 sets it too: what each step raised."""
    plain = functools.partial(_plain_backward, rank=rank)
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                        policy=AdaptivePolicy(enabled=False))
    p = model.module.out.weight  # parameter 4

    def step(at: int) -> str:
        opt.zero_grad()
        plain(model, at)
        return error_text(opt.step)

    def edit_then_reload() -> None:
        with torch.no_grad():
            p.add_(1.0)
        opt.reload_params()

    out: dict = {"first": step(0)}
    saved = copy.deepcopy(opt.state_dict())
    out["second"] = step(1)
    changes = {"load_state_dict": lambda: opt.load_state_dict(copy.deepcopy(saved)),
               "step": lambda: opt.state[p].__setitem__("step", 7),
               "exp_avg": lambda: opt.state[p].__setitem__("exp_avg", torch.full_like(p, 0.5)),
               "exp_avg_sq": lambda: opt.state[p].__setitem__("exp_avg_sq", torch.full_like(p, 0.5)),
               "master": lambda: opt.state[p].__setitem__("master", torch.full_like(p, 0.5)),
               "reset": lambda: setattr(opt, "state", {}),
               "reload_params": edit_then_reload,
               "lr": lambda: opt.param_groups[0].__setitem__("lr", 2 * LR)}
    with _reported(out, [opt]):
        for at, (how, change) in enumerate(changes.items(), start=2):
            if rank == 1:
                change()
            _stepped_then_changed_on_rank_0(out, how, change, rank, model, opt, at, step)
        if rank == 1:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        out["alone"] = [step(10), step(11)]
        out["params"] = _flat(model.module)
        opt.zero_grad()
        with warnings.catch_warnings():  # (step() found no gradients)
            warnings.simplefilter("ignore", RuntimeWarning)
            if rank == 1:
                opt.state[p]["step"] = 9
            out["no_backward"] = error_text(opt.step)
            if rank == 0:
                opt.state[p]["step"] = 9
            else:
                opt.state[p]["exp_avg"] = torch.full_like(p, 0.25)
            out["no_backward_then"] = error_text(opt.step)
            if rank == 0:
                opt.state[p]["exp_avg"] = torch.full_like(p, 0.25)
            out["no_backward_same"] = error_text(opt.step)
    return out


def _two_values_exchanged(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` whose first two elements hold each other's values (the same values, arranged otherwise)."""
    y = x.detach().clone()
    y.view(-1)[:2] = x.detach().reshape(-1)[:2].flip(0)
    return y


def _state_rearranged_on_one_rank(rank: int) -> dict:
    """Two steps; then, each in turn, rank 1 alone rearranges values of one parameter's state before a step (its
    elements hold the same values as rank 0's, at other positions): two elements of ``out.weight``'s exp_avg
    exchanged (``opt.state[p]['exp_avg'] = ...``), ``extra.weight``'s exp_avg_sq transposed, a state dict loaded with
    two elements of ``out.weight``'s master exchanged. What that step() raised on each rank, whether the parameters
    and the optimizer state stayed as they were, and whether the rearranged values differ from the old ones; then,
    the same change made on rank 0 too (after zero_grad()), what the step raised."""
    plain = functools.partial(_plain_backward, rank=rank)
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                        policy=AdaptivePolicy(enabled=False))
    out_w, extra_w = model.module.out.weight, model.module.extra.weight  # parameters 4 and 2

    def step(at: int) -> str:
        opt.zero_grad()
        plain(model, at)
        return error_text(opt.step)

    def master_exchanged_in_state_dict() -> Callable[[], None]:
        """Loading this state dict with parameter 4's master's first two elements exchanged."""
        state = copy.deepcopy(opt.state_dict())
        for layout in map(BlockLayout.from_json, state["state"]["layouts"]):
            if 4 in layout.param_indices:
                master = state["state"]["blocks"][layout.index]["master"]
                span = layout.span(layout.param_indices.index(4))
                master[span] = _two_values_exchanged(master[span])
        return lambda: opt.load_state_dict(copy.deepcopy(state))

    def assigned(p: torch.Tensor, key: str, how: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        value = how(opt.state[p][key])
        return lambda: opt.state[p].__setitem__(key, value)

    out: dict = {"first": step(0), "second": step(1)}
    changes = {"exchanged": lambda: assigned(out_w, "exp_avg", _two_values_exchanged),
               "transposed": lambda: assigned(extra_w, "exp_avg_sq", lambda x: x.t().contiguous()),
               "loaded": master_exchanged_in_state_dict}
    with _reported(out, [opt]):
        for at, (how, make) in enumerate(changes.items(), start=2):
            opt.zero_grad()
            old = _engine_state(opt)
            change = make()  # (the same change on both ranks: the states are the same here)
            if rank == 1:
                change()
            out[f"{how}_moved"] = not all(map(torch.equal, old, _engine_state(opt))) if rank == 1 else None
            _stepped_then_changed_on_rank_0(out, how, change, rank, model, opt, at, step)
    return out


# What reading a param group without 'lr' raises (the facade's HParamError; a bare KeyError before)
NO_LR = ("param_groups[0] has no 'lr': a param group needs 'lr', 'betas', 'eps', 'weight_decay' (put it back in the "
         "group's dict)")


def _hparams_unreadable_on_one_rank(rank: int) -> dict:
    """Rank 1's param group loses its 'lr' (reading its hparams raises, :data:`NO_LR`): at
    step 1 before backward (restored before step()); at step 2 before backward too, a step count set the same way
    on both ranks first (so every rank compares its state at that backward), restored before step(); restored,
    zero_grad(), step 3. What each backward and step() raised, and the parameters after."""
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                        policy=AdaptivePolicy(enabled=False))
    plain = functools.partial(_plain_backward, model, rank=rank)
    group = opt.param_groups[0]
    out: dict = {}
    with _reported(out, [opt]):
        plain(0)
        opt.step()
        opt.zero_grad()
        group.pop("lr") if rank == 1 else None
        out["backward"] = error_text(lambda: plain(1))
        group["lr"] = LR
        out["step"] = error_text(opt.step)
        opt.zero_grad()
        opt.state[model.module.out.weight]["step"] = 2
        group.pop("lr") if rank == 1 else None
        out["compared_backward"] = error_text(lambda: plain(2))
        group["lr"] = LR
        out["compared"] = error_text(opt.step)
        opt.zero_grad()
        plain(3)
        out["then"] = error_text(opt.step)
        out["params"] = _flat(model.module)
    return out


class _Reordered(nn.Module):
    """A model whose parameters are registered in another order than backward makes their gradients ready: DDP
    rebuilds its buckets after the first iteration in that order (one bucket per parameter at a tiny
    ``bucket_cap_mb``; the first iteration's single bucket before)."""

    def __init__(self) -> None:
        super().__init__()
        self.mid, self.out, self.inp, self.skip = nn.Linear(8, 8), nn.Linear(8, 3), nn.Linear(4, 8), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)) + self.skip(x))))


def _steps_under_join(rank: int, make: Callable[[], nn.Module]) -> dict:
    """Under ``ddp.join()``, a DDP module of ``make()`` in one bucket per parameter (after DDP's rebuild; a single one
    in the first iteration): rank 0 has 1 batch and rank 1 has 3 (rank 0 shadows the rebuilt buckets), then rank 0
    has 3 and rank 1 has 1 (rank 1 joins after the rebuild); then 2 steps on both ranks. The parameters after, for
    the facade (torch's kernels, no clipping) and for torch.optim.AdamW, and DDP's rebuilt bucket order."""
    out: dict = {}
    for batches in ((1, 3), (3, 1)):
        for name in ("torch", "sofx"):
            torch.manual_seed(0)
            model = DDP(make(), bucket_cap_mb=1e-5)
            opt = (torch.optim.AdamW(model.parameters(), lr=LR, foreach=False) if name == "torch" else
                   sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                                 backend="reference", policy=AdaptivePolicy(enabled=False)))
            with _reported(out, [opt], case=f"{name} {batches}"):
                with model.join():
                    for step in range(batches[rank]):
                        opt.zero_grad()
                        _plain_backward(model, step, rank)
                        opt.step()
                for step in (3, 4):
                    opt.zero_grad()
                    _plain_backward(model, step, rank)
                    opt.step()
                out[f"{name}_{batches}"] = _flat(model.module)
                out["order"] = model._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    return out


def _state_changed_after_a_backward_without_gradient(rank: int) -> dict:
    """An optimizer over ``extra`` alone, frozen before the model was wrapped (DDP reduces the other layers: the
    ranks exchange at each backward, and this optimizer gets no gradient). Between a backward and step(), on rank 1
    alone: a step count set, a state dict loaded; what each raised, and what step() then said on each rank; then the
    step count set on rank 1 alone after step(), and what the next backward's step() said."""
    torch.manual_seed(0)
    net = _Net()
    net.extra.requires_grad_(False)
    model = DDP(net)
    opt = sofx.offload.SpeculativeAdamW(net.extra.parameters(), lr=LR, block_numel=16, ddp=model)
    plain = functools.partial(_plain_backward, model, rank=rank)
    out: dict = {}
    with _reported(out, [opt]):
        with warnings.catch_warnings():  # (step() found no gradients)
            warnings.simplefilter("ignore", RuntimeWarning)
            saved = copy.deepcopy(opt.state_dict())
            plain(0)
            if rank == 1:
                out["step"] = error_text(lambda: opt.state[net.extra.weight].__setitem__("step", 3))
                out["load_state_dict"] = error_text(lambda: opt.load_state_dict(saved))
            out["stepped"] = error_text(opt.step)
            if rank == 1:
                opt.state[net.extra.weight]["step"] = 3
            opt.zero_grad()
            plain(1)
            out["then"] = error_text(opt.step)
    return out


class _Checkpointed(nn.Module):
    """The tiny MLP with its middle layer under reentrant checkpointing: its gradients come from a backward of their
    own, inside the outer one (three autograd backwards in which DDP's buckets are ready once DDP rebuilt them, one
    per parameter; one exchange of the ranks, at bucket 0)."""

    def __init__(self, recompute_s: float = 0.0) -> None:
        super().__init__()
        self.inp, self.extra, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.recompute_s = recompute_s  # how long the recomputation (inside backward) sleeps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(self._middle, h, use_reentrant=True)
        return self.out(h)

    def _middle(self, h: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # (the recomputation: the reentrant forward runs without grad)
            time.sleep(self.recompute_s)
        return torch.tanh(self.extra(h))


def _checkpointed_ddp(recompute_s: float = 0.0) -> DDP:
    """:class:`_Checkpointed` in DDP, one bucket per parameter once DDP rebuilt them (a single one at the first
    iteration)."""
    torch.manual_seed(0)
    return DDP(_Checkpointed(recompute_s), bucket_cap_mb=1e-5)


@contextlib.contextmanager
def _counted(calls: list, watch) -> Iterator[None]:
    """Count the ranks' exchanges (``watch.exchange``) and comparisons (the engine's ``check_replicas``) into
    ``calls`` (``"exchange"``, ``"compare"``)."""
    import sofx.offload.engine as engine_module

    compare, exchange = engine_module.check_replicas, watch.exchange
    engine_module.check_replicas = lambda *args: (calls.append("compare"), compare(*args))[1]
    watch.exchange = lambda *args, **kwargs: (calls.append("exchange"), exchange(*args, **kwargs))[1]
    try:
        yield
    finally:
        engine_module.check_replicas = compare
        del watch.exchange


def _exchanges_within_a_step(rank: int) -> dict:
    """Per step, what step() said, the exchanges made, and the comparisons made in backward and in step(): a middle
    layer under reentrant checkpointing, one bucket per parameter (3 autograd backwards see buckets once DDP rebuilt
    them), a step count set on rank 1 alone before step 2 ("checkpointed"); two synchronized backwards per step, rank 1
    setting another lr between them at step 1 ("accumulated")."""
    out: dict = {}
    for name in ("checkpointed", "accumulated"):
        torch.manual_seed(0)
        model = DDP(_Checkpointed(), bucket_cap_mb=1e-5) if name == "checkpointed" else _ddp({})
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                            gradient_accumulation_steps=1 if name == "checkpointed" else 2,
                                            policy=AdaptivePolicy(enabled=False))
        out[name] = []
        calls: list = []
        with _reported(out, [opt], case=name):
            with _counted(calls, opt.engine._replicas):
                for step in range(3):
                    opt.zero_grad()
                    calls.clear()
                    if name == "checkpointed":
                        if step == 2 and rank == 1:
                            opt.state[model.module.out.weight]["step"] = 9
                        x, y = _batch(step, 0, rank)
                        ((model(x) - y) ** 2).mean().backward()
                    else:
                        for micro in range(2):
                            opt.param_groups[0]["lr"] = LR * (1 + rank) if (step, micro) == (1, 1) else LR
                            x, y = _batch(step, micro, rank)
                            ((model(x) - y) ** 2).mean().backward()
                    in_backward = calls.count("compare")
                    said = error_text(opt.step)
                    out[name].append((said, calls.count("exchange"), in_backward, calls.count("compare") - in_backward))
    return out


def _compared_once_after_a_difference(rank: int) -> dict:
    """Two synchronized backwards per step; rank 1 sets a step count alone before step 1 (its first backward's
    exchange decides to compare, and the comparison finds the difference); rank 0 sets it too before step 2. Per
    step, what step() said, the exchanges made, and the comparisons made in backward and in step()."""
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                        gradient_accumulation_steps=2, policy=AdaptivePolicy(enabled=False))
    out: dict = {"steps": []}
    calls: list = []
    with _reported(out, [opt]):
        with _counted(calls, opt.engine._replicas):
            for step in range(3):
                opt.zero_grad()
                calls.clear()
                if (step, rank) in ((1, 1), (2, 0)):
                    opt.state[model.module.out.weight]["step"] = 9
                for micro in range(2):
                    x, y = _batch(step, micro, rank)
                    ((model(x) - y) ** 2).mean().backward()
                in_backward = calls.count("compare")
                said = error_text(opt.step)
                out["steps"].append((said, calls.count("exchange"), in_backward, calls.count("compare") - in_backward))
    return out


def _lr_set_between_backward_and_step(rank: int) -> dict:
    """Rank 1 alone sets another lr between step 1's synchronized backward and its step() (after the ranks' exchange
    at that backward), and sets it back after step(): what steps 2 and 3 (zero_grad() between) said on each rank;
    then both ranks load the model and optimizer states saved before step 1: what a step said, and the parameters
    after. And DDP + torch.optim.AdamW and the facade (torch's kernels, no clipping; speculation on and off) with an
    lr set on both ranks between each backward and step() (a warmup): the parameters after 4 steps, and what each
    facade step said."""
    out: dict = {}
    plain = functools.partial(_plain_backward, rank=rank)
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                        policy=AdaptivePolicy(enabled=False))
    group = opt.param_groups[0]
    with _reported(out, [opt], case="alone"):
        plain(model, 0)
        opt.step()
        saved = copy.deepcopy((model.module.state_dict(), opt.state_dict()))
        opt.zero_grad()
        plain(model, 1)
        group["lr"] = LR * (1 + rank)
        out["alone"] = error_text(opt.step)
        group["lr"] = LR
        out["said"] = []
        for step in (2, 3):
            opt.zero_grad()
            plain(model, step)
            out["said"].append(error_text(opt.step))
        opt.zero_grad()
        model.module.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        plain(model, 4)
        out["resumed"] = error_text(opt.step)
        out["params"] = _flat(model.module)
    for name in ("torch", "sofx", "sofx_off"):
        model = _ddp({})
        opt = (torch.optim.AdamW(model.parameters(), lr=LR, foreach=False) if name == "torch" else
               sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model, backend="reference",
                                             speculate=name == "sofx", policy=AdaptivePolicy(enabled=False)))
        out[f"{name}_said"] = []
        with _reported(out, [opt], case=name):
            for step in range(4):
                opt.zero_grad()
                plain(model, step)
                opt.param_groups[0]["lr"] = LR * (step + 2) / 4
                out[f"{name}_said"].append(error_text(opt.step))
            out[name] = _flat(model.module)
    return out


def _closed_on_one_rank(rank: int, collected: bool = False) -> dict:
    """A step; then rank 1 closes its optimizer (``collected``: drops it, collected without close()) and trains on
    with DDP alone: what the next backward and step() said on each rank (rank 1: its backward) and how long rank 0's
    took; then rank 0 closes its optimizer too, and both train 2 steps with DDP + torch.optim.AdamW: what each
    backward said, and the parameters after."""
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model)
    plain = functools.partial(_plain_backward, model, rank=rank)
    out: dict = {}
    try:
        plain(0)
        opt.step()
        opt.zero_grad()
        if rank == 1 and collected:
            opt = None
            gc.collect()
        elif rank == 1:
            opt.close()
        start = time.monotonic()
        out["backward"] = error_text(lambda: plain(1))
        out["step"] = error_text(opt.step) if rank == 0 else "closed"
        out["seconds"] = time.monotonic() - start
        if opt is not None:
            opt.close()
        ref = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        out["then"] = []
        for step in (2, 3):
            ref.zero_grad()
            out["then"].append(error_text(lambda: plain(step)))
            ref.step()
        out["params"] = _flat(model.module)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if opt is not None:
            opt.close()
    return out


def _join_without_batches(rank: int) -> dict:
    """Under ``ddp.join()`` rank 0 has no batch and rank 1 has 2: what the step after the join said on each rank; then,
    after zero_grad(), both ranks load rank 1's optimizer state (broadcast) and step twice: what they said, and the
    parameters after."""
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                        policy=AdaptivePolicy(enabled=False))
    plain = functools.partial(_plain_backward, model, rank=rank)
    out: dict = {}
    with _reported(out, [opt]):
        with model.join():
            for step in range(2 * rank):
                opt.zero_grad()
                plain(step)
                opt.step()
        opt.zero_grad()
        plain(2)
        out["after"] = error_text(opt.step)
        opt.zero_grad()
        state = [opt.state_dict()]
        torch.distributed.broadcast_object_list(state, src=1)
        opt.load_state_dict(state[0])
        out["loaded"] = []
        for step in (3, 4):
            opt.zero_grad()
            plain(step)
            out["loaded"].append(error_text(opt.step))
        out["params"] = _flat(model.module)
    return out


def _settings_differ(rank: int) -> dict:
    """Rank 1's optimizer is made with another max_grad_norm, then (a second pair) with the cpu_fast backend: what
    the first step() said on each rank, and whether the parameters stayed as they were."""
    out: dict = {}
    for how, other in (("max_grad_norm", {"max_grad_norm": 2.0}), ("backend", {"backend": "cpu_fast"})):
        model = _ddp({})
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                            **{"max_grad_norm": 1.0, **(other if rank == 1 else {})})
        with _reported(out, [opt], case=how):
            _plain_backward(model, 1, rank)
            before = _flat(model.module)
            out[how] = error_text(opt.step)
            out[f"{how}_unchanged"] = torch.equal(before, _flat(model.module))
    return out


def _speculation_set_on_one_rank(rank: int) -> dict:
    """Rank 1 alone sets ``opt.speculate = False`` after a step: what the next step() said on each rank (a clipping
    step: blocks speculated on rank 0 are redone), and whether the parameters stayed as they were; then rank 0 sets
    it too, and both set it back on later: what those steps said, and the parameters after. And an optimizer made
    with ``speculate=False`` on rank 1 alone: what its first step() said."""
    out: dict = {}
    plain = functools.partial(_plain_backward, rank=rank)
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model, max_grad_norm=MAX_NORM,
                                        policy=AdaptivePolicy(enabled=False))
    with _reported(out, [opt], case="set"):
        plain(model, 0)
        opt.step()
        opt.zero_grad()
        if rank == 1:
            opt.speculate = False
        plain(model, 1)
        before = _flat(model.module)
        out["alone"] = error_text(opt.step)
        out["alone_unchanged"] = torch.equal(before, _flat(model.module))
        out["said"] = []
        for step, on in ((2, False), (3, True)):
            opt.zero_grad()
            opt.speculate = on
            plain(model, step)
            out["said"].append(error_text(opt.step))
        out["params"] = _flat(model.module)
    model = _ddp({})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model, speculate=rank == 0)
    with _reported(out, [opt], case="made"):
        plain(model, 1)
        out["made"] = error_text(opt.step)
    return out


def _step_without_backward_beside_a_closed_rank(rank: int) -> dict:
    """On a group of its own (5 s timeout: the default group outlives what happens to it), a step; then rank 1 closes
    its optimizer, and both ranks run a backward under ``no_sync()``, after which rank 0 alone calls step(): what its
    step() said (rank 1: nothing), and how long it took."""
    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    torch.manual_seed(0)
    meet()  # (the ranks' collectives on the group are 5 s apart at most: its construction, DDP's, the backward's)
    model = DDP(_Net(), process_group=group)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model)
    meet()
    out: dict = {"step": "closed"}
    with _reported(out, [opt]):
        _plain_backward(model, 0, rank)
        opt.step()
        opt.zero_grad()
        if rank == 1:
            opt.close()
        with model.no_sync():  # (on rank 1 with DDP alone)
            _plain_backward(model, 1, rank)
        if rank == 0:
            start = time.monotonic()
            out["step"] = error_text(opt.step)
            out["seconds"] = time.monotonic() - start
    meet()
    torch.distributed.destroy_process_group(group)
    return out


class _LoopError(Exception):
    """An error of the training loop on one rank, between backward and step()."""


def _raise_in_loop() -> None:
    raise _LoopError("the loop's own error")


def _step_skipped_on_one_rank(rank: int) -> dict:
    """A step count set the same way on both ranks (so the next backward compares the ranks' states); after that
    backward rank 1 skips step(): an error of the training loop raised and caught there ("raised"), or its step()
    raising its own error (its param group lost its 'lr' after backward: "own_error"); both ranks then zero_grad().
    What rank 0's step() (rank 1's error) said and how long it took; what the next step() said on each rank; and
    after both ranks load the model and optimizer states saved before and zero_grad(), what a step() said and the
    parameters after."""
    out: dict = {}
    for how in ("raised", "own_error"):
        model = _ddp({})
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model,
                                            policy=AdaptivePolicy(enabled=False))
        plain = functools.partial(_plain_backward, model, rank=rank)
        group = opt.param_groups[0]
        with _reported(out, [opt], case=how):
            plain(0)
            opt.step()
            saved = copy.deepcopy((model.module.state_dict(), opt.state_dict()))
            opt.zero_grad()
            opt.state[model.module.out.weight]["step"] = 5
            plain(1)
            start = time.monotonic()
            if rank == 0:
                out[how] = error_text(opt.step)
            elif how == "raised":
                out[how] = error_text(_raise_in_loop)
            else:
                group.pop("lr")
                out[how] = error_text(opt.step)
                group["lr"] = LR
            out[f"{how}_s"] = time.monotonic() - start
            opt.zero_grad()
            plain(2)
            out[f"{how}_next"] = error_text(opt.step)
            opt.zero_grad()
            model.module.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            plain(3)
            out[f"{how}_resumed"] = error_text(opt.step)
            out[f"{how}_params"] = _flat(model.module)
    return out


def _raise_in_backward(g: torch.Tensor) -> torch.Tensor:
    raise _LoopError("rank 1's own error in backward")


def _exchange_failed_at_backward(rank: int) -> dict:
    """DDP over a group whose collectives time out after 1 s; one step, then a backward in which rank 1 raises
    (its own tensor hook on the model's output, before any bucket of its is ready): rank 0 waits alone in the
    ranks' exchange at its bucket 0 and its backward raises. What each rank's backward said; on rank 0, what two
    step()s said, how long each took and the exchanges each made, then a zero_grad()."""
    out: dict = {}
    meet()
    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=1))
    meet()  # (DDP's construction broadcasts over the short-timeout group)
    model = _ddp({"process_group": group})
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=LR, block_numel=16, ddp=model, executor="inline")
    with _reported(out, [opt]):
        x, y = _batch(0, 0, rank)
        meet()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        meet()
        h = model(x)
        if rank == 1:
            h.register_hook(_raise_in_backward)
        out["backward"] = error_text(lambda: ((h - y) ** 2).mean().backward())
        if rank == 0:
            for key in ("step", "again"):
                calls: list = []
                start = time.monotonic()
                with _counted(calls, opt.engine._replicas):
                    out[key] = error_text(opt.step)
                out[f"{key}_s"], out[f"{key}_calls"] = time.monotonic() - start, calls
        opt.zero_grad()
        out["in_step"] = opt.engine.in_step
        out["failed"] = opt.engine._replicas.failed is not None  # (dropped with the step)
    meet()
    return out


class _Heads(nn.Module):
    """A trunk and two heads; ``forward(x, head)`` goes through one head (multi-task heads, expert routing)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)])

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](torch.tanh(self.trunk(x)))


def _alternating_heads(rank: int, crossed: bool, exact: bool) -> dict:
    """``gradient_accumulation_steps=2`` under DDP with ``find_unused_parameters``, micro-step ``i`` of a step through
    head ``i % 2`` on every rank (the other head unused on every rank: DDP leaves its ``.grad`` alone), or, with
    ``crossed``, through head ``(i + rank) % 2`` (both used, each on one rank: DDP averages with the other's zeros);
    side by side with DDP + torch.optim.AdamW. ``exact``: torch's kernels, no clipping nor loss scaling (bitwise);
    else a loss scale and a clipping max norm on every other step. :func:`_check`'s dict."""
    def make() -> DDP:
        torch.manual_seed(0)
        return DDP(_Heads(), find_unused_parameters=True)

    ref, model = make(), make()
    max_norm = None if exact else 0.5
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2, enabled=not exact)
    opt = sofx.offload.SpeculativeAdamW(
        model.parameters(), lr=LR, executor="thread", block_numel=16, gradient_accumulation_steps=2, ddp=model,
        backend="reference" if exact else "auto", max_grad_norm=max_norm,
        loss_scale=None if exact else grad_scaler(init_scale=2.0 ** 10, growth_interval=2),
        policy=AdaptivePolicy(enabled=False))
    out: dict = {"torch": [], "sofx": [], "reports": [], "outcomes": []}

    def backward(ddp: DDP, step: int, scale: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for micro in range(2):
            x, y = _batch(step, micro, rank)
            scale(((ddp(x, (micro + rank) % 2 if crossed else micro % 2) - y) ** 2).mean() / 2).backward()

    with _reported(out, [opt]):
        _steps_side_by_side(out, (ref, ropt, scaler), (model, opt), backward, max_norm)
    return out


def _backward_calls_counted(rank: int) -> dict:
    """``gradient_accumulation_steps=2`` over :class:`_Checkpointed` in DDP (bucket 0 may be all-reduced in the
    reentrant checkpoint's nested backward) and a weight outside DDP (its gradient from a gradient hook, in the same
    backward calls): per step, the backward calls counted before step() and the accumulation warnings step() gave,
    for two synchronized backwards, one under ``no_sync()`` (the weight outside DDP gets a gradient from it) then one
    synchronized, and one synchronized."""
    model = _checkpointed_ddp()
    scale = nn.Parameter(torch.ones(3))
    opt = sofx.offload.SpeculativeAdamW([*model.parameters(), scale], lr=LR, ddp=model, executor="inline",
                                        gradient_accumulation_steps=2)
    out: dict = {"steps": []}
    with _reported(out, [opt]):
        for step, quiet in enumerate(((False, False), (True, False), (False,))):
            for micro, no_sync in enumerate(quiet):
                x, y = _batch(step, micro, rank)
                with model.no_sync() if no_sync else contextlib.nullcontext():
                    ((model(x) * scale - y) ** 2).mean().backward()
            counted = opt.engine.micro_steps
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            said = [str(w.message) for w in caught if "gradient_accumulation" in str(w.message)]
            out["steps"].append((counted, said))
    return out


def _held_by_the_exchange(rank: int) -> dict:
    """A weight outside DDP in a param group (a block) of its own, its gradient from the loss's last op, the first
    of backward: per step (synchronized, then under ``no_sync()``), whether the report says the step speculated, why
    not, and the blocks speculated."""
    model = _ddp({})
    scale = nn.Parameter(torch.ones(3))
    opt = sofx.offload.SpeculativeAdamW([{"params": list(model.parameters())}, {"params": [scale]}], lr=LR,
                                        block_numel=16, ddp=model, executor="inline")
    out: dict = {"steps": []}
    with _reported(out, [opt]):
        for step, quiet in enumerate((False, True)):
            opt.zero_grad()
            x, y = _batch(step, 0, rank)
            with model.no_sync() if quiet else contextlib.nullcontext():
                ((model(x) * scale - y) ** 2).mean().backward()
            report = opt.step()
            out["steps"].append((report.speculating, report.not_speculating_reason, report.speculated))
    return out


CASES = {"refusals": _refusals, "replaced_then_closed": _replaced_then_closed, "without_ddp": _without_ddp,
         "refused_in_hook": _refused_in_hook,
         "refused_in_hook_checkpointed": functools.partial(_refused_in_hook, make=functools.partial(
             _checkpointed_ddp, recompute_s=0.05)), "grad_changed": _grad_changed_after_backward,
         "forward_between_backward_and_step": _forward_between_backward_and_step,
         "uneven_inputs": _uneven_inputs, "join_by_remaining_ranks": _join_by_remaining_ranks,
         "resumed": _resumed_from_other_checkpoints, "changed_on_one_rank": _state_changed_on_one_rank,
         "rearranged_on_one_rank": _state_rearranged_on_one_rank,
         "hparams_unreadable": _hparams_unreadable_on_one_rank,
         "rebuilt_buckets": functools.partial(_steps_under_join, make=_Reordered),
         **{name: functools.partial(_setup_case, name) for name in SETUPS},
         "no_gradient": _state_changed_after_a_backward_without_gradient, "within_a_step": _exchanges_within_a_step,
         "compared_once": _compared_once_after_a_difference, "lr_before_step": _lr_set_between_backward_and_step,
         "closed_on_one_rank": _closed_on_one_rank,
         "collected_on_one_rank": functools.partial(_closed_on_one_rank, collected=True),
         "join_without_batches": _join_without_batches, "settings_differ": _settings_differ,
         "speculation_on_one_rank": _speculation_set_on_one_rank,
         "without_backward_beside_closed": _step_without_backward_beside_a_closed_rank,
         "checkpointed_under_join": functools.partial(_steps_under_join, make=_Checkpointed),
         "backward_calls": _backward_calls_counted,
         "exchange_failed": _exchange_failed_at_backward,
         **{f"heads_{how}_{kind}": functools.partial(_alternating_heads, crossed=how == "crossed",
                                                     exact=kind == "exact")
            for how in ("alternating", "crossed") for kind in ("exact", "clipped")},
         "held_by_the_exchange": _held_by_the_exchange,
         "skipped_on_one_rank": _step_skipped_on_one_rank}  # (last: where it hangs, the cases before have run)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_gloo_cases(CASES, 2, tmp_path_factory.mktemp("ddp"), timeout_s=600)


def test_a_forward_between_backward_and_step_where_ddp_rebuilds_its_buckets_steps_as_torch(ranks):
    results = [r["forward_between_backward_and_step"] for r in ranks]
    for rank, res in enumerate(results):
        assert res["said"] == ["no error", "no error"], (rank, res["said"])
        for step in range(2):
            assert torch.equal(res["sofx"][step], res["torch"][step]), (rank, step)
            assert torch.equal(res["sofx"][step], results[0]["sofx"][step]), (rank, step)


def _deviation(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|: DESIGN.md's relative error of ``a`` against the reference ``b``."""
    return (a.double() - b.double()).abs().max().item() / max(b.abs().max().item(), 1e-3)


def _check(ranks: list[dict], name: str, tol: float = TOL) -> list[list[list[int]]]:
    """Case ``name``: no rank raised; every step within ``tol`` of torch's on each rank, and each parameter's
    step count torch's; the facade's replicas (and torch's) bitwise identical across ranks. Returns each rank's
    per-step report counts."""
    results = [r[name] for r in ranks]
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}: {res['error']}"
        assert res["counts"][1] == res["counts"][0], f"{name}: rank {rank}'s step counts differ from torch's"
    for step in range(STEPS):
        for rank, res in enumerate(results):
            dev = _deviation(res["sofx"][step], res["torch"][step])
            assert dev <= tol, f"{name}: rank {rank} step {step}: {dev:.3g} from DDP + torch.optim.AdamW"
        assert torch.equal(results[0]["torch"][step], results[1]["torch"][step])
        assert torch.equal(results[0]["sofx"][step], results[1]["sofx"][step]), \
            f"{name}: the replicas differ after step {step}"
    return [res["reports"] for res in results]


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
@pytest.mark.parametrize("speculate", [True, False])
def test_each_executor_under_ddp_equals_ddp_and_torch_adamw(ranks, executor: str, speculate: bool) -> None:
    """Clipping on CLIP_STEPS (speculated blocks undone and redone; the steps after may clip too), an inf on one
    rank at INF_STEP (every rank skips, the scale backs off), a dynamic loss scale that grows. The first step, whose
    backward compares the ranks' states (construction), is speculated after the comparison (it was held for a
    comparison in step())."""
    reports = _check(ranks, executor if speculate else f"{executor}_off")
    assert reports[0] == reports[1], "the ranks took other decisions"
    for per_rank in reports:
        assert not per_rank[0][2] and all(per_rank[s][2] for s in CLIP_STEPS)
        assert [bool(r[3]) for r in per_rank] == [s == INF_STEP for s in range(STEPS)]
        assert (sum(r[0] for r in per_rank) > 0) == speculate
        if speculate:
            assert all(per_rank[s][1] > 0 for s in CLIP_STEPS), "the clipped steps redo speculated blocks"
            assert per_rank[0][0] > 0, "the first step's blocks are speculated once its backward compared the states"


@pytest.mark.parametrize("name", ["bucket_view", "find_unused", "static_graph", "no_sync", "accumulate_synced"])
def test_ddp_modes_equal_ddp_and_torch_adamw(ranks, name: str) -> None:
    """``gradient_as_bucket_view``; ``find_unused_parameters`` with a layer unused on every rank at one step
    (not stepped: no weight decay, no moment decay, as torch leaves a ``None`` gradient) and on one rank at
    another; ``static_graph`` with a layer never used; accumulation of 2 micro-steps under ``no_sync()`` (one
    synchronized backward per step) and without it (each micro-step's average summed)."""
    reports = _check(ranks, name)
    assert all(sum(r[0] for r in per_rank) > 0 for per_rank in reports)
    assert [r[name]["bucket_view"] for r in ranks] == [name == "bucket_view"] * 2  # (the hook's route knows it)


def test_without_clipping_or_loss_scaling_is_bitwise_torch(ranks) -> None:
    """Nothing undone, torch's kernels (backend="reference"): every step is DDP + torch.optim.AdamW's, bit for
    bit, on both ranks. Without clipping, overflow or late gradients every speculative step is committed
    (validation compares each block's sum of squares with the very float it was speculated with: an undo+redo
    here would be one for nothing)."""
    _check(ranks, "bitwise", tol=0.0)
    for rank in ranks:
        outcomes = rank["bitwise"]["outcomes"]
        assert sum(o["speculated"] for o in outcomes) > 0
        assert all(o["committed"] == o["speculated"] and o["undone"] == o["redone"] == 0 for o in outcomes), outcomes


def test_ddp_that_cannot_be_hooked_is_refused_at_construction(ranks) -> None:
    for res in ranks:
        out = res["refusals"]
        assert "ddp must be the torch.nn.parallel.DistributedDataParallel module" in out["module"]
        assert "got _Net" in out["module"]
        assert "none of the optimizer's 2 parameters is one whose gradient ddp averages" in out["other_params"]
        assert "ddp has a communication hook already" in out["own_hook"]
        assert "ddp was made with mixed_precision=" in out["mixed_precision"], out["mixed_precision"]
        assert "param_dtype=torch.bfloat16" in out["mixed_precision"]
        assert "parameter 2 (shape (8, 8)) is one whose all-reduce ddp delays (delay_all_reduce_named_params)" \
            in out["delayed"], out["delayed"]
        assert "parameter 0 (shape (8, 8)) is one whose gradient a DistributedDataParallel module" \
            in out["delayed_without_ddp"], out["delayed_without_ddp"]


def test_an_optimizer_takes_ddp_over_and_a_closed_one_leaves_ddps_own_average(ranks) -> None:
    for res in ranks:
        out = res["replaced_then_closed"]
        assert "another optimizer was created over parameter" in out["unwrapped"]
        assert "another optimizer was created over parameter" in out["first"]
        assert out["second"] == "no error"
        assert torch.equal(*out["params"])
    assert torch.equal(ranks[0]["replaced_then_closed"]["params"][0], ranks[1]["replaced_then_closed"]["params"][0])


def test_a_ddp_modules_parameters_without_ddp_are_refused_naming_ddp(ranks) -> None:
    """Taken by the gradient hooks, each rank's local gradient would be stepped before DDP averages it (with
    find_unused_parameters silently: the replicas diverge), speculation on or off."""
    for res in ranks:
        out = res["without_ddp"]
        for executor in ("inline", "thread", "process"):
            for speculate in (True, False):
                msg = out[f"{executor}_{speculate}"]
                assert "parameter 0 (shape (8, 4)) is one whose gradient a DistributedDataParallel module" in msg
                assert "ddp=ddp_model" in msg, msg
        assert "is one whose gradient a DistributedDataParallel module" in out["backward"]
        assert "wrapped in it after the optimizer was made" in out["backward"]
        assert out["unchanged"]
        assert "ddp=ddp_model" in out["step"]


@pytest.mark.parametrize("case", ["refused_in_hook", "refused_in_hook_checkpointed"])
def test_an_error_in_the_communication_hook_is_raised_by_backward_as_without_ddp(ranks, case: str) -> None:
    """The engine refusing a gradient DDP hands it (here an lr of nan, read when the step's first block is ready)
    raises the engine's own error out of backward, as its gradient hooks do without DDP (it reached the user as
    DDP's RuntimeError "Got the following error when running the callback: ..."). The hook still gives DDP the
    reduced bucket: the all-reduce completes on every rank (rank 0 goes on alone at step 1), DDP writes .grad,
    and step() after fixing the lr (or after a second backward) is DDP + torch.optim.AdamW's. Under reentrant
    checkpointing the error is raised at the end of the outer backward, after DDP's: raised at the end of the
    nested backward of the recomputation (its first bucket's block refused meanwhile), it left DDP's reduction
    unfinished (gloo aborted on the next, mismatched collective, or DDP refused the next forward)."""
    for rank, res in enumerate(ranks):
        out = res[case]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        for step, msg in enumerate(out["raised"]):
            if step == 2 or (step == 1 and rank == 1):
                assert msg.startswith("param_groups[0]['lr'] = nan is invalid"), (rank, step, msg)
            else:
                assert msg == "no error", (rank, step, msg)
        for step, (mine, theirs) in enumerate(zip(out["sofx"], out["torch"])):
            assert _deviation(mine, theirs) <= TOL, f"rank {rank} step {step}"
    for step in range(4):
        assert torch.equal(ranks[0][case]["sofx"][step], ranks[1][case]["sofx"][step])


def test_a_block_ddp_found_unused_on_every_rank_is_reported_not_stepped(ranks) -> None:
    """find_unused_parameters, step 2: ``extra`` (blocks 2 and 3) unused on every rank. Its blocks were speculated
    on the zeros DDP's bucket carried, and undone once DDP left its ``.grad`` alone; nothing is applied to them
    (torch does not step them). The report says so, as it reports a block without gradient ("skip", not
    stepped), not as redone."""
    for rank, res in enumerate(ranks):
        outcome = res["find_unused"]["outcomes"][2]
        assert outcome["actions"][2:4] == ("skip", "skip"), (rank, outcome)
        assert {key: outcome[key] for key in OUTCOMES} == {
            "speculated": 6, "committed": 4, "undone": 2, "redone": 0, "stepped_late": 0, "not_stepped": 2}, \
            (rank, outcome)


def test_a_grad_changed_between_backward_and_step_is_refused_as_without_ddp(ranks) -> None:
    """step() consumed the ``.grad`` DDP wrote without looking at it: a change made to it after backward (the engine
    had taken DDP's average during backward) was silently ignored. It is refused, as the gradient hooks' engine
    refuses a ``.grad`` set after backward, seen cheaply (the tensor DDP wrote: its identity, storage and version),
    before anything changes; zero_grad() drops the step. A ``.grad`` set by hand on a parameter DDP found unused
    on every rank is taken, as torch.optim steps it."""
    for rank, res in enumerate(ranks):
        out = res["grad_changed"]
        for how in ("in_place", "replaced", "cleared"):
            assert "parameter 4 (shape (3, 8)): .grad was changed after backward took this step's gradient" \
                in out[how], (rank, how, out[how])
            assert "zero_grad()" in out[how]
            assert out[f"{how}_unchanged"], (rank, how)
            assert out[f"{how}_then"] == "no error", (rank, how, out[f"{how}_then"])
        assert _deviation(*out["set_by_hand"]) <= TOL, rank


def test_a_rank_that_joined_under_ddp_join_takes_no_gradient_from_the_others(ranks) -> None:
    """A rank out of inputs under ``ddp.join()`` shadows the others' all-reduce with zeros, outside backward,
    through the communication hook: the hook gave the engine the others' averages as its gradients, and it was
    left in a step (state_dict() refused; the step after the join refused the parameters DDP synchronized when
    the join ended as changed in place). It only all-reduces: the joined rank's optimizer has no step, as torch's,
    and training goes on as DDP + torch.optim.AdamW's on each rank (whose moments differ across ranks after the
    join, torch's too)."""
    for rank, res in enumerate(ranks):
        out = res["uneven_inputs"]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["state_dict"] == "no error", (rank, out["state_dict"])
        assert _deviation(out["sofx"], out["torch"]) <= TOL, rank


def test_join_dividing_by_the_ranks_left_is_refused_naming_it(ranks) -> None:
    """``join(divide_by_initial_world_size=False)``: DDP's reducer divides each gradient by the number of ranks
    with inputs left, which it tells no communication hook; the optimizer's divides by the world size (as DDP's
    own hooks do), and the steps after a rank joined differed silently from DDP + torch.optim.AdamW's. Refused
    where the join is made, on every rank, before any collective, while an optimizer takes the gradients."""
    for rank, res in enumerate(ranks):
        out = res["join_by_remaining_ranks"]
        for how in ("join", "Join"):
            assert "divide_by_initial_world_size=False" in out[how], (rank, how, out[how])
            assert "ddp=" in out[how], (rank, how, out[how])
        assert out["default"] == "no error" and out["closed"] == "no error", (rank, out)


def test_ranks_resumed_from_different_checkpoints_refuse_to_step_on_every_rank(ranks) -> None:
    """Rank 1 loaded the checkpoint saved two steps before rank 0's: each rank stepped its own optimizer state and
    the replicas diverged silently (DDP compares the parameters at construction only). The first step() after
    construction or load_state_dict compares a digest of the ranks' step counts, hparams and loss scaler (one
    all-reduce): every rank raises the same error naming what differs and each rank's value, before anything is
    stepped (another lr on one rank too). zero_grad() and loading the same checkpoint then go on as a run resumed on
    every rank from it, and as the run that was never interrupted, bit for bit."""
    said = [res["resumed"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["mismatch"].startswith("step() under DDP: the step count of block 0 (parameter 0 = param_groups"
                                          "[0]['params'][0], shape (8, 4)) differs between ranks: 3 on rank 0; 1 on "
                                          "rank 1 (and "), (rank, out["mismatch"])
        assert "load the same state_dict on every rank" in out["mismatch"], out["mismatch"]
        assert out["unchanged"], rank
        assert torch.equal(out["fixed"], out["continued"]) and torch.equal(out["same"], out["continued"]), rank
        assert out["other_lr"].startswith("step() under DDP: the hparams of param_groups[0] differs between ranks: "
                                          "lr=0.01, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01 on rank 0; "
                                          "lr=0.02, "), (rank, out["other_lr"])
    assert said[0]["mismatch"] == said[1]["mismatch"]
    assert torch.equal(said[0]["continued"], said[1]["continued"])


# what differs, named, where each way of changing the state is made on rank 1 alone (_state_changed_on_one_rank)
_DIFFERS = {
    "load_state_dict": "the step count of block 0 (parameter 0 = param_groups[0]['params'][0], shape (8, 4)) differs "
                       "between ranks: 2 on rank 0; 1 on rank 1",
    "step": "the step count of block 4 (parameter 4 = param_groups[0]['params'][4], shape (3, 8)) differs between "
            "ranks: 2 on rank 0; 7 on rank 1",
    **{how: f"the {key} of parameter 4 (param_groups[0]['params'][4], shape (3, 8)) differs between ranks: bits "
            "digest " for how, key in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("master", "master"),
                                       ("reload_params", "master"))},
    "reset": "the step count of block 0 (parameter 0 = param_groups[0]['params'][0], shape (8, 4)) differs between "
             "ranks: 6 on rank 0; 0 on rank 1",
    "lr": "the hparams of param_groups[0] differs between ranks: lr=0.01, betas=(0.9, 0.999), eps=1e-08, "
          "weight_decay=0.01 on rank 0; lr=0.02, ",
}


def test_a_state_changed_on_one_rank_alone_is_refused_at_the_next_step_on_every_rank(ranks) -> None:
    """The comparison of the ranks' states was armed at the first step() and by load_state_dict only, on the rank
    that called it: a state assignment, opt.state reset, reload_params or another lr on one rank stepped on
    silently, and a state dict loaded on one rank alone made that rank enter the comparison's all-reduce alone
    (gloo aborted on the mismatched collective). Now the ranks decide together at each backward whether any
    rank's state changed: each way of changing rank 1's state alone is refused at the next step() on every rank,
    with the same error naming the parameter, the key and each rank's value, before anything is stepped; the same
    change on rank 0 too then steps."""
    said = [res["changed_on_one_rank"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["first"] == out["second"] == "no error", (rank, out)
        for how, differs in _DIFFERS.items():
            assert out[how].startswith(f"step() under DDP: {differs}"), (rank, how, out[how])
            assert "on rank 1" in out[how] and "change the state the same way on every rank" in out[how], out[how]
            assert out[f"{how}_unchanged"], (rank, how)
            assert out[f"{how}_same"] == "no error", (rank, how, out[f"{how}_same"])
    for how in _DIFFERS:
        assert said[0][how] == said[1][how], how


# what differs, named, where rank 1 alone rearranges values of a state (_state_rearranged_on_one_rank)
_REARRANGED = {
    "exchanged": "the exp_avg of parameter 4 (param_groups[0]['params'][4], shape (3, 8))",
    "transposed": "the exp_avg_sq of parameter 2 (param_groups[0]['params'][2], shape (8, 8))",
    "loaded": "the master of parameter 4 (param_groups[0]['params'][4], shape (3, 8))",
}


def test_values_rearranged_within_a_state_on_one_rank_are_refused_at_the_next_step_on_every_rank(ranks) -> None:
    """The ranks compared a changed state's contents by the sum of its elements' bit patterns: rank 1's state with
    two elements' values exchanged (an assignment, a state dict loaded), or a square moment transposed, summed as
    rank 0's, and each rank stepped its own state silently. Each such change on rank 1 alone is refused at the
    next step() on every rank, with the same error naming the parameter and the key, before anything is stepped;
    the same change on rank 0 too then steps."""
    said = [res["rearranged_on_one_rank"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["first"] == out["second"] == "no error", (rank, out)
        for how, entry in _REARRANGED.items():
            assert out[how].startswith(f"step() under DDP: {entry} differs between ranks: bits digest "), \
                (rank, how, out[how])
            assert "on rank 1" in out[how] and "change the state the same way on every rank" in out[how], out[how]
            assert out[f"{how}_unchanged"], (rank, how)
            assert out[f"{how}_same"] == "no error", (rank, how, out[f"{how}_same"])
    for how in _REARRANGED:
        assert said[1][f"{how}_moved"], how  # (values really moved: the state differs from rank 0's)
        assert said[0][how] == said[1][how], how


def test_a_state_dict_loaded_on_one_rank_alone_steps_on_every_rank(ranks) -> None:
    """Rank 1 loads its own state dict alone (nothing differs): every rank compares at the next step, which steps,
    and the next one; the replicas stay identical (the spawn's timeout fails a hang)."""
    for rank, res in enumerate(ranks):
        assert res["changed_on_one_rank"]["alone"] == ["no error", "no error"], rank
    assert torch.equal(ranks[0]["changed_on_one_rank"]["params"], ranks[1]["changed_on_one_rank"]["params"])


def test_a_state_changed_on_one_rank_before_a_step_without_backward_is_refused_on_every_rank(ranks) -> None:
    """Without a synchronized backward the ranks decide in step() whether to compare. After a refused step the next
    decides anew: an exp_avg set on rank 1 alone after it (no zero_grad() between) was left out of the comparison
    that the refused step had decided (its keys), and stepped on silently."""
    for rank, res in enumerate(ranks):
        out = res["changed_on_one_rank"]
        assert out["no_backward"].startswith("step() under DDP: the step count of block 4 (parameter 4 = "
                                             "param_groups[0]['params'][4], shape (3, 8)) differs between ranks: "), \
            (rank, out["no_backward"])
        assert out["no_backward_then"].startswith("step() under DDP: the exp_avg of parameter 4 (param_groups[0]"
                                                  "['params'][4], shape (3, 8)) differs between ranks: "), \
            (rank, out["no_backward_then"])
        assert out["no_backward_same"] == "no error", (rank, out["no_backward_same"])


def test_hparams_that_raise_on_one_rank_are_its_own_error_and_no_rank_waits_for_it(ranks) -> None:
    """Reading rank 1's hparams raised (a group without 'lr': a KeyError then, the facade's HParamError naming the
    key now, :data:`NO_LR`). At its backward the hook raised it before the ranks' exchange and the bucket's
    all-reduce: rank 0 waited in the exchange alone (gloo aborted on the mismatched collective, or a hang). Where
    the ranks compare their states, rank 1 raised it before the comparison's all-reduce (rank 0 waited there
    alone). Now it is rank 1's own error, as a refused hparam is: raised out of its backward (the all-reduces
    complete on every rank, and step() after restoring the lr steps as rank 0's), and named as rank 1's refused
    hparams by the comparison at the backward where the ranks compare (nothing is speculated: neither backward
    raises), raised by step() on every rank."""
    said = [res["hparams_unreadable"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["backward"] == (NO_LR if rank == 1 else "no error"), (rank, out["backward"])
        assert out["step"] == out["compared_backward"] == out["then"] == "no error", (rank, out)
        assert out["compared"].startswith("step() under DDP: the hparams of param_groups[0] differs between ranks: "
                                          "lr=0.01, "), (rank, out["compared"])
        assert f"refused ({NO_LR}) on rank 1" in out["compared"], (rank, out["compared"])
    assert said[0]["compared"] == said[1]["compared"]
    assert torch.equal(said[0]["params"], said[1]["params"])


def test_buckets_ddp_rebuilds_in_another_order_under_join_equal_ddp_and_torch_adamw(ranks) -> None:
    """The ranks' exchange is made at the first bucket DDP all-reduces in each synchronized backward (and by a
    rank that joined, at bucket 0 of the others'): one bucket in the first iteration, then one per parameter in
    the order DDP rebuilt them (not the registration order), a rank joining before the rebuild and after it.
    No rank waits alone (the spawn's timeout fails a hang), and every step is DDP + torch.optim.AdamW's, bit for
    bit, on both ranks."""
    for rank, res in enumerate(ranks):
        out = res["rebuilt_buckets"]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["order"] == "3, 2, 1, 0, 7, 6, 5, 4", (rank, out["order"])  # (registration: 7, 6, ..., 0)
        for batches in ((1, 3), (3, 1)):
            assert torch.equal(out[f"sofx_{batches}"], out[f"torch_{batches}"]), (rank, batches)


def test_reentrant_checkpointing_under_join_equals_ddp_and_torch_adamw(ranks) -> None:
    """A middle layer under reentrant checkpointing makes its gradients ready in a backward of their own, inside the
    outer one (three autograd backwards per synchronized backward once DDP rebuilt its buckets, one per parameter),
    while a rank that joined (``ddp.join()``) shadows each synchronized backward once: every rank makes the same
    exchanges all the same (gloo aborted on the mismatched collective, or the ranks waited), a rank joining before
    the rebuild and after it, and every step is DDP + torch.optim.AdamW's, bit for bit, on both ranks."""
    for rank, res in enumerate(ranks):
        out = res["checkpointed_under_join"]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        for batches in ((1, 3), (3, 1)):
            assert torch.equal(out[f"sofx_{batches}"], out[f"torch_{batches}"]), (rank, batches)


def test_a_step_skipped_on_one_rank_after_a_comparing_backward_leaves_no_rank_waiting(ranks) -> None:
    """The ranks compared their states in step() where their exchange at backward decided so: a rank that skipped
    that step() (an error of the loop between backward and step(), caught there; its step() raising its own error
    first) left the others waiting in the comparison's all-reduce (until gloo's timeout, or its abort on the next
    mismatched collective), where torch.optim steps on. The comparison is now made at backward, every rank at the
    same point, and step() enters no collective: rank 0 steps at once (the group's timeout is 10 s). Rank 1's
    zero_grad() dropped the step the ranks had exchanged at: the next backward compares, and every rank's step()
    names the step counts that differ (the replicas diverged silently, as torch.optim's would). Loading the same
    states on both ranks then steps on both, and the replicas are the same."""
    said = [res["skipped_on_one_rank"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        for how in ("raised", "own_error"):
            mine = "no error" if rank == 0 else "_LoopError: the loop's own error" if how == "raised" else NO_LR
            assert out[how] == mine, (rank, how, out[how])
            assert out[f"{how}_s"] < 9.0, (rank, how, out[f"{how}_s"])  # (not the group's 10 s timeout)
            assert out[f"{how}_next"].startswith("step() under DDP: the step count of block 0 (parameter 0 = "
                                                 "param_groups[0]['params'][0], shape (8, 4)) differs between ranks: "
                                                 "2 on rank 0; 1 on rank 1"), (rank, how, out[f"{how}_next"])
            assert out[f"{how}_resumed"] == "no error", (rank, how, out[f"{how}_resumed"])
    for how in ("raised", "own_error"):
        assert said[0][f"{how}_next"] == said[1][f"{how}_next"], how
        assert torch.equal(said[0][f"{how}_params"], said[1][f"{how}_params"]), how


def test_a_state_change_between_a_backward_without_gradient_and_step_is_refused_under_ddp(ranks) -> None:
    """Where a synchronized backward gave the optimizer no gradient (its parameters frozen: DDP reduces the
    others) it held none, and a state change before step() was taken: the ranks had compared their states at that
    backward, and step() compares nothing, so a change on one rank would be stepped unseen by the others (a state
    dict loaded there made that rank's step() a collective of its own: gloo aborted). It is refused, as between a
    backward that gave gradients and step(), naming it, and nothing changes; step() steps on every rank, and a
    change made after it on one rank alone is named by the next step() on every rank."""
    said = [res["no_gradient"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["stepped"] == "no error", (rank, out["stepped"])
        assert out["then"].startswith("step() under DDP: the step count of block 0 (parameter 0 = param_groups[0]"
                                      "['params'][0], shape (8, 8)) differs between ranks: 0 on rank 0; 3 on rank 1"), \
            (rank, out["then"])
    for what, call in (("step", "changing the optimizer state ('step')"), ("load_state_dict", "load_state_dict()")):
        assert said[1][what].startswith(f"{call} was called between a synchronized backward and step(): under ddp "
                                        "the ranks compared their optimizer states at that backward"), said[1][what]
    assert said[0]["then"] == said[1]["then"]


def test_the_exchanges_within_a_step_compare_once_and_step_enters_no_collective(ranks) -> None:
    """Reentrant checkpointing runs several autograd backwards per synchronized backward, in which DDP's buckets
    are ready: the ranks exchange once (at bucket 0), and compare once where it decided so. An lr set on one rank
    alone between two synchronized backwards of a step is compared at the second (the hparams: blocks may be
    speculated by then), and step() raises it on every rank, entering no collective (a comparison there needed
    every rank's step())."""
    said = [res["within_a_step"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        checkpointed, accumulated = out["checkpointed"], out["accumulated"]
        assert [c[1:] for c in checkpointed] == [(1, 1, 0), (1, 0, 0), (1, 1, 0)], (rank, checkpointed)
        assert checkpointed[0][0] == checkpointed[1][0] == "no error", (rank, checkpointed)
        assert checkpointed[2][0].startswith("step() under DDP: the step count of block 4 (parameter 4 = "
                                             "param_groups[0]['params'][4], shape (3, 8)) differs between ranks: "
                                             "2 on rank 0; 9 on rank 1"), (rank, checkpointed[2][0])
        assert [a[1:] for a in accumulated] == [(2, 1, 0), (2, 1, 0), (2, 1, 0)], (rank, accumulated)
        assert accumulated[0][0] == "no error" and accumulated[2][0] == "no error", (rank, accumulated)
        assert accumulated[1][0].startswith("step() under DDP: the hparams of param_groups[0] differs between ranks: "
                                            "lr=0.01, "), (rank, accumulated[1][0])
    assert said[0]["checkpointed"] == said[1]["checkpointed"] and said[0]["accumulated"] == said[1]["accumulated"]


def test_a_difference_found_at_a_steps_backward_is_not_compared_again_at_its_later_backwards(ranks) -> None:
    """Where a synchronized backward's comparison found the ranks' states differ (a step count set on rank 1 alone),
    the step's later synchronized backwards (an accumulation) still exchange (every rank takes part) but compare
    nothing again: every rank found the difference, and step() raises it on every rank, entering no collective.
    The step after the same change on rank 0 compares once (rank 0's state changed) and steps."""
    said = [res["compared_once"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        steps = out["steps"]
        assert [s[1:] for s in steps] == [(2, 1, 0), (2, 1, 0), (2, 1, 0)], (rank, steps)
        assert steps[0][0] == steps[2][0] == "no error", (rank, steps)
        assert steps[1][0].startswith("step() under DDP: the step count of block 4 (parameter 4 = param_groups[0]"
                                      "['params'][4], shape (3, 8)) differs between ranks: 1 on rank 0; 9 on rank 1"), \
            (rank, steps[1][0])
    assert said[0]["steps"] == said[1]["steps"]


def test_an_lr_set_on_one_rank_between_backward_and_step_is_refused_at_the_next_step_on_every_rank(ranks) -> None:
    """The ranks exchange their hparams at a step's synchronized backward, and step() enters no collective: an lr
    set on rank 1 alone after that backward (set back after step()) was stepped unseen, and the replicas diverged
    silently from then on. Each step() folds the digest of the hparams it used into the next exchange: the next
    step() raises on every rank, naming the hparams the last step used on each rank (one step late: the replicas
    diverged at that step), and the steps after it go on refusing (the masters differ, named) until the ranks'
    states are the same again: loading the same states on both ranks then steps, and the replicas are the same.
    The same lr set on both ranks between backward and step() (a warmup) is DDP + torch.optim.AdamW's: bit for bit
    without speculation, within 1e-6 with it (the blocks speculated with the lr of backward are redone)."""
    said = [res["lr_before_step"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["alone"] == "no error", (rank, out["alone"])
        first, then = out["said"]
        assert first.startswith("step() under DDP: the hparams the last step() used (set after the ranks' exchange "
                                "at its synchronized backward: unseen by the other ranks, and the replicas diverged "
                                "at that step) differs between ranks: lr=0.01, betas=(0.9, 0.999), eps=1e-08, "
                                "weight_decay=0.01 on rank 0; lr=0.02, "), (rank, first)
        assert "load the same state_dict on every rank" in first, first
        assert then.startswith("step() under DDP: the master of parameter 0 (param_groups[0]['params'][0], shape "
                               "(8, 4)) differs between ranks: bits digest "), (rank, then)
        assert out["resumed"] == "no error", (rank, out["resumed"])
        assert out["sofx_said"] == out["sofx_off_said"] == ["no error"] * 4, (rank, out)
        assert torch.equal(out["sofx_off"], out["torch"]), rank
        assert _deviation(out["sofx"], out["torch"]) <= TOL, rank
    assert said[0]["said"] == said[1]["said"]
    assert torch.equal(said[0]["params"], said[1]["params"])


@pytest.mark.parametrize("case", ["closed_on_one_rank", "collected_on_one_rank"])
def test_an_optimizer_closed_on_one_rank_is_named_by_the_others_step(ranks, case: str) -> None:
    """An optimizer closed on rank 1 alone left its DDP module's plain all-reduce there, while rank 0's made the
    ranks' exchange at its next backward: the mismatched collectives aborted gloo (SIGABRT, "Received data size
    doesn't match expected size"). A rank whose optimizer is closed now takes part in the exchange, saying so: its
    backward trains on, and the others' step() raises, within the group's timeout, naming the rank whose optimizer
    is closed, stepping nothing (as where it was collected without close()). Once every rank's is closed, the ranks
    leave the exchange together: DDP trains on with torch.optim on every rank, and the replicas are the same."""
    said = [res[case] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["backward"] == "no error", (rank, out["backward"])
        assert out["seconds"] < 9.0, (rank, out["seconds"])  # (not the group's 10 s timeout)
        assert out["then"] == ["no error", "no error"], (rank, out["then"])
    assert said[0]["step"].startswith("step() under DDP: the optimizer of rank 1 over this DDP module is closed"), \
        said[0]["step"]
    assert torch.equal(said[0]["params"], said[1]["params"])


def test_a_rank_without_batches_under_join_is_refused_at_the_next_step_naming_the_join(ranks) -> None:
    """Under ``ddp.join()`` rank 0 had no batch (it shadowed each of rank 1's backwards, and its optimizer took no
    step, as torch.optim's takes none): the step after the join is refused on every rank, as the step counts differ
    (torch.optim's replicas diverge there silently), and the error said only that the states differ, with the
    advice for a state dict loaded on one rank. It now says that a rank ran out of inputs under DDP.join() and what to
    do; loading the last rank to join's optimizer state on every rank then steps, and the replicas are the same."""
    said = [res["join_without_batches"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["after"].startswith("step() under DDP: the step count of block 0 (parameter 0 = param_groups"
                                       "[0]['params'][0], shape (8, 4)) differs between ranks: 0 on rank 0; 2 on "
                                       "rank 1"), (rank, out["after"])
        assert "a rank ran out of inputs under DDP.join() (it shadowed the others' synchronized backwards)" \
            in out["after"], (rank, out["after"])
        assert "after the join load the same state_dict on every rank: that of the last rank to join" \
            in out["after"], out["after"]
        assert out["loaded"] == ["no error", "no error"], (rank, out["loaded"])
    assert said[0]["after"] == said[1]["after"]
    assert torch.equal(said[0]["params"], said[1]["params"])


def test_optimizers_made_with_other_settings_on_one_rank_are_refused_at_the_first_step_on_every_rank(ranks) -> None:
    """The ranks compared their step counts, hparams and loss scaler, not the settings the optimizer was made with:
    rank 1's optimizer made with another max_grad_norm (clipping at another norm) or another backend (cpu_fast:
    within an ulp of cpu) stepped on silently, and the replicas diverged. The settings that change a step's bits
    are compared too: the first step() is refused on every rank, naming them and each rank's value, and nothing
    is stepped."""
    said = [res["settings_differ"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        for how, mine, theirs in (("max_grad_norm", "max_grad_norm=1.0", "max_grad_norm=2.0"),
                                  ("backend", "backend='auto'", "backend='cpu_fast'")):
            assert out[how].startswith("step() under DDP: the optimizer's settings differs between ranks: "), \
                (rank, how, out[how])
            assert mine in out[how].split(" on rank 0; ")[0] and theirs in out[how].split(" on rank 0; ")[1], \
                (rank, how, out[how])
            assert out[f"{how}_unchanged"], (rank, how)
    assert said[0]["max_grad_norm"] == said[1]["max_grad_norm"] and said[0]["backend"] == said[1]["backend"]


def test_speculation_set_on_one_rank_alone_is_refused_at_the_next_step_on_every_rank(ranks) -> None:
    """``opt.speculate = False`` set on rank 1 alone (or ``speculate=False`` given to its constructor alone) was
    compared by no rank: rank 0 speculated blocks and redid them at a clipping step (within float32 rounding of the
    serial step rank 1 took), and the replicas diverged silently. The setting is among the settings the ranks
    compare, and setting it makes the ranks compare: the next step() is refused on every rank, naming each rank's
    setting, and nothing is stepped; the same setting on every rank (set on both, or back) steps on, and the
    replicas are the same."""
    said = [res["speculation_on_one_rank"] for res in ranks]
    for rank, out in enumerate(said):
        assert "error" not in out, f"rank {rank}: {out['error']}"
        for key in ("alone", "made"):
            assert out[key].startswith("step() under DDP: the optimizer's settings differs between ranks: "), \
                (rank, key, out[key])
            mine, theirs = out[key].split(" on rank 0; ")
            assert "speculate=True" in mine and "speculate=False" in theirs.split(" on rank 1")[0], \
                (rank, key, out[key])
        assert out["alone_unchanged"], rank
        assert out["said"] == ["no error", "no error"], (rank, out["said"])
    assert said[0]["alone"] == said[1]["alone"] and said[0]["made"] == said[1]["made"]
    assert torch.equal(said[0]["params"], said[1]["params"])


def test_a_step_without_synchronized_backward_beside_a_closed_rank_raises_naming_the_exchange(ranks) -> None:
    """A step() whose backwards were all under ``no_sync()`` is a collective (the ranks' exchange); a rank whose
    optimizer is closed takes no part in it: the live rank waited the group's timeout and got gloo's raw
    ``RuntimeError`` ("Timed out waiting 5000ms for recv operation"). It now raises a SofxError after that timeout,
    saying that a rank did not take part in the step()'s exchange and naming the likely causes (a closed optimizer
    among them), with gloo's error; nothing is stepped."""
    out = ranks[0]["without_backward_beside_closed"]
    assert "error" not in out, out["error"]
    assert ranks[1]["without_backward_beside_closed"] == {"step": "closed"}, ranks[1]["without_backward_beside_closed"]
    assert out["step"].startswith("step() under DDP without a synchronized backward (every backward of the step under "
                                  "no_sync(), or none) is a collective: "), out["step"]
    for said in ("a rank did not take part in the ranks' exchange of this step() within the process group's timeout",
                 "a rank whose optimizer over this DDP module is closed", "Timed out waiting 5000ms"):
        assert said in out["step"], (said, out["step"])
    assert out["seconds"] < 30.0, out["seconds"]  # (the group's 5 s timeout: bounded)


def test_a_step_whose_blocks_the_exchange_held_from_speculating_reports_why(ranks) -> None:
    """A block ready during backward before the ranks' exchange (a weight outside DDP, whose gradient comes before
    the first bucket's, or every gradient of a step under ``no_sync()``) is held from speculating; where every block
    of a step was, the report said speculating=True with no reason: it says the step did not speculate, and why."""
    for rank in range(2):
        out = ranks[rank]["held_by_the_exchange"]
        assert "error" not in out, out["error"]
        (synced, _, some), (quiet, why, none) = out["steps"]
        assert synced and some > 0 and not quiet and none == 0, out["steps"]
        assert "under ddp no block is speculated before the ranks decide" in why and "no_sync()" in why, why


def test_a_step_after_a_backward_whose_exchange_failed_raises_at_once_naming_it(ranks) -> None:
    """A rank raised in its backward before DDP's all-reduce; the other waited alone in the ranks' exchange at its
    bucket 0, and its backward raised (the group's timeout). Its next step() entered the exchange of a step without
    synchronized backward, a collective on a group that may be unusable (gloo closed its connections here; where a
    backend does not, it waited the timeout again at each step()), and said a rank had closed its optimizer or
    skipped step(). It raises at once, entering no collective, naming the failed exchange of the step's backward
    and what to do, at each step() until zero_grad() drops the step."""
    for rank, res in enumerate(ranks):
        out = res["exchange_failed"]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert not out["in_step"] and not out["failed"], rank
    out = ranks[0]["exchange_failed"]
    assert out["backward"].startswith("backward under DDP: a rank did not take part in the ranks' exchange"), out
    assert ranks[1]["exchange_failed"]["backward"] == "_LoopError: rank 1's own error in backward"
    for key in ("step", "again"):
        assert out[key].startswith("step() under DDP: the ranks' exchange at this step's synchronized backward "
                                   "failed (RuntimeError: "), (key, out[key])
        assert "nothing was stepped" in out[key] and "zero_grad()" in out[key], (key, out[key])
        assert out[f"{key}_calls"] == [], (key, out[f"{key}_calls"])
        assert out[f"{key}_s"] < 0.5, (key, out[f"{key}_s"])


@pytest.mark.parametrize("where", ["exchange", "comparison"])
def test_a_failure_at_a_synchronized_backward_is_named_as_the_exchange_or_the_comparison_that_raised(where) -> None:
    """At a synchronized backward the ranks exchange, then compare their states where they decided so; whatever
    raised in either, step() raised as "the ranks' exchange at this step's synchronized backward failed", likely
    "a rank that raised in its own code before its backward", where the exchange had passed and the comparison
    raised (an interrupt, or an error of its own). The error names the one that raised."""
    from types import SimpleNamespace

    from sofx.offload.ddp import Decision, DDPRoute, ReplicaWatch

    watch = ReplicaWatch(DDPRoute(None, 2))

    def exchange(hparams, joined=False):
        if where == "exchange":
            raise RuntimeError("the exchange's own failure")
        watch.decision = Decision(True, ())

    def compare(decision, whole):
        raise RuntimeError("the comparison's own failure")

    watch.exchange = exchange
    engine = SimpleNamespace(_replicas=watch, passes=SimpleNamespace(note=lambda: None), _reduced_error=None,
                             _hparams_text=lambda: "", _compare_replicas=compare)
    with pytest.raises(RuntimeError, match=f"the {where}'s own failure"):
        sofx.offload.engine.OffloadEngine.begin_reduced_backward(engine)
    error = str(watch.failure_error())
    said = ("the ranks' exchange at this step's synchronized backward failed (RuntimeError: the exchange's own "
            "failure)" if where == "exchange" else
            "the ranks' comparison of their optimizer states at this step's synchronized backward failed "
            "(RuntimeError: the comparison's own failure)")
    assert error.startswith(f"step() under DDP: {said}"), error
    assert ("a rank that raised in its own code before its backward" in error) == (where == "exchange"), error


@pytest.mark.parametrize("how", ["alternating", "crossed"])
@pytest.mark.parametrize("kind", ["exact", "clipped"])
def test_micro_batches_through_alternating_heads_equal_ddp_and_torch_adamw(ranks, how: str, kind: str) -> None:
    """``gradient_accumulation_steps=2``, ``find_unused_parameters``, each micro-step through one of two heads (the
    same on every rank, the other head unused everywhere; or crossed, each head used on one rank): DDP + torch.optim
    .AdamW's steps, bit for bit with torch's kernels and neither clipping nor loss scaling, within 1e-6 with them;
    the replicas identical; blocks speculated during the second backward call."""
    reports = _check(ranks, f"heads_{how}_{kind}", tol=0.0 if kind == "exact" else TOL)
    assert all(sum(r[0] for r in per_rank) > 0 for per_rank in reports), reports


class _Kept:
    """A stand-in engine for :func:`sofx.offload.ddp._scale_for_average`: the parameters whose ``.grad`` is the one
    DDP left at the step's last synchronized backward."""

    def __init__(self, kept: set[int]) -> None:
        self.kept = kept

    def grad_kept_since_reduced(self, index: int) -> bool:
        return index in self.kept


class _Bucket:
    """A stand-in for DDP's ``GradBucket``: a buffer and each parameter's view of it."""

    def __init__(self, buffer: torch.Tensor, params: list[nn.Parameter]) -> None:
        self._buffer, self._params = buffer, params
        self._views = list(buffer.split([p.numel() for p in params]))

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._views


@pytest.mark.parametrize("world", [2, 3])
def test_the_hook_scales_a_bucket_view_grad_kept_since_the_last_backward_as_ddp_divides_it(world: int) -> None:
    """DDP's reducer multiplies a gradient by 1 / world_size as it copies it into its bucket, but divides by
    world_size in place a ``.grad`` that is its bucket view already (``gradient_as_bucket_view``, the second
    synchronized backward of an accumulation); the hook multiplied every gradient, which is not DDP's average where
    the world size is no power of two (a third of the elements 1 ulp off on 3 ranks: checked side by side with DDP +
    torch.optim.AdamW on 3 gloo ranks, bitwise now). It divides the views whose ``.grad`` DDP left at the step's
    last synchronized backward, and multiplies the others: a copied ``.grad``, one replaced since, one that is no
    view of the bucket."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(300)) for _ in range(4)]
    original = torch.randn(1200, generator=gen)
    bucket = _Bucket(original.clone(), params)
    params[0].grad, params[1].grad, params[2].grad = bucket.gradients()[:3]
    params[3].grad = torch.zeros(300)  # (no view of the bucket: DDP copies it, without gradient_as_bucket_view)
    route = sofx.offload.ddp.DDPRoute(None, world)
    engine = _Kept({0, 2, 3})  # (1: a view DDP made at this backward)
    route._engine, route._index = (lambda: engine), {id(p): i for i, p in enumerate(params)}
    sofx.offload.ddp._scale_for_average(route, bucket)
    expected = [g * (1.0 / world) for g in original.split(300)]
    if world == 3:
        expected[0], expected[2] = original[:300] / world, original[600:900] / world
        assert not torch.equal(expected[0], original[:300] * (1.0 / world))  # (the case is telling)
    assert torch.equal(bucket.buffer(), torch.cat(expected))


def test_the_hook_scales_another_optimizers_parameters_as_ddp_does() -> None:
    """A parameter of the DDP module that the engine does not step (another optimizer's) was always multiplied by
    1 / world_size, where DDP divides in place a ``.grad`` that is its bucket view (``zero_grad(set_to_none=False)``
    in that optimizer, or two synchronized backwards before its step): on 3 ranks its average was not DDP's in the
    last bit (checked side by side with DDP + torch.optim.AdamW on 3 gloo ranks, bitwise now). The route notes
    where autograd accumulated into such a ``.grad`` (a post-accumulate-grad hook, before DDP's reducer copies it)
    and divides a bucket view accumulated into; given no gradient in this backward (unused), a ``.grad`` that is
    its bucket view. Here a real backward accumulates into two of four parameters of a 3-rank route."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(300)) for _ in range(4)]
    bucket = _Bucket(torch.randn(1200, generator=gen), params)
    views = bucket.gradients()
    params[0].grad, params[2].grad = views[0], views[2]  # (bucket views kept from an earlier backward)
    route = sofx.offload.ddp.DDPRoute(None, 3)
    engine = _Kept(set())
    route._engine, route._index = (lambda: engine), {}  # (a live engine stepping none of these)
    note = functools.partial(sofx.offload.ddp._note_accumulated, weakref.ref(route))
    for p in params:
        p.register_post_accumulate_grad_hook(note)
    coefs = torch.randn(2, 300, generator=gen)
    ((params[0] * coefs[0]).sum() + (params[1] * coefs[1]).sum()).backward()  # (2 and 3 unused)
    views[1].copy_(params[1].grad)  # (DDP's copy of a fresh .grad into its view, which then is .grad)
    params[1].grad = views[1]
    before = bucket.buffer().clone().split(300)
    sofx.offload.ddp._scale_for_average(route, bucket)
    expected = [before[0] / 3, before[1] * (1.0 / 3), before[2] / 3, before[3] * (1.0 / 3)]
    assert not torch.equal(expected[0], before[0] * (1.0 / 3))  # (the case is telling)
    assert not torch.equal(expected[2], before[2] * (1.0 / 3))
    assert torch.equal(bucket.buffer(), torch.cat(expected))
    assert route._accumulated == {}  # (each note read once, at its synchronized backward)


@pytest.mark.parametrize("gone", ["closed", "collected"])
def test_the_hook_of_a_closed_optimizer_scales_as_ddp_does(gone: str) -> None:
    """With every rank's optimizer closed (or collected without close()), DDP "averages for torch.optim, as without
    a hook" (the hook stays: DDP takes no hook back); it multiplied every gradient by 1 / world_size, where DDP
    divides in place a ``.grad`` that is its bucket view (the last bit on 3 ranks). It scales them as another
    optimizer's parameters (the route's notes of where autograd accumulated)."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(300)) for _ in range(2)]
    bucket = _Bucket(torch.randn(600, generator=gen), params)
    views = bucket.gradients()
    params[0].grad = views[0]  # (a bucket view kept from an earlier backward)
    route = sofx.offload.ddp.DDPRoute(None, 3)
    engine = _Kept({0, 1})
    route._engine, route._index = (lambda: engine), {id(p): i for i, p in enumerate(params)}
    if gone == "closed":
        route.unbind(engine)
    else:
        route._engine = weakref.ref(_Kept(set()))  # (collected at once: its index kept)
    note = functools.partial(sofx.offload.ddp._note_accumulated, weakref.ref(route))
    for p in params:
        p.register_post_accumulate_grad_hook(note)
    coefs = torch.randn(2, 300, generator=gen)
    ((params[0] * coefs[0]).sum() + (params[1] * coefs[1]).sum()).backward()
    views[1].copy_(params[1].grad)  # (DDP's copy of a fresh .grad into its view, which then is .grad)
    params[1].grad = views[1]
    before = bucket.buffer().clone().split(300)
    sofx.offload.ddp._scale_for_average(route, bucket)
    assert not torch.equal(before[0] / 3, before[0] * (1.0 / 3))  # (the case is telling)
    assert torch.equal(bucket.buffer(), torch.cat([before[0] / 3, before[1] * (1.0 / 3)]))


def test_an_exchange_error_that_names_no_missing_rank_is_torchs() -> None:
    """The ranks' exchange at a synchronized backward, and at a step() without one, reported every RuntimeError of
    its collective as a rank that did not take part within the group's timeout, also an error every rank raises at
    the call (gloo's 'Invalid scalar type'); only a timeout or a closed connection blames a missing rank now."""
    def failing(text: str):
        def exchange() -> None:
            raise RuntimeError(text)
        return exchange

    with pytest.raises(sofx.SofxError, match=r"^backward under DDP: the collective failed in the ranks' exchange at "
                                             r"this synchronized backward \(RuntimeError: Invalid scalar type\); "
                                             "nothing was stepped; ") as info:
        sofx.offload.ddp._exchanging(failing("Invalid scalar type"))
    assert "did not take part" not in str(info.value)
    with pytest.raises(sofx.SofxError, match=r"^backward under DDP: a rank did not take part in the ranks' exchange"):
        sofx.offload.ddp._exchanging(failing("Application timeout caused pair closure"))
    err = str(sofx.offload.ddp.unmatched_step_error(RuntimeError("Invalid scalar type")))
    assert err.startswith("step() under DDP without a synchronized backward: the collective failed in the ranks' "
                          "exchange of this step() (RuntimeError: Invalid scalar type); nothing was stepped; "), err
    assert "did not take part" not in err
    err = str(sofx.offload.ddp.unmatched_step_error(RuntimeError("Timed out waiting 2000ms for recv operation")))
    assert "a rank did not take part in the ranks' exchange of this step() within the process group's timeout" in err


class _Unread(_Bucket):
    """A :class:`_Bucket` that fails where its parameters or views are read."""

    def parameters(self) -> list[nn.Parameter]:
        raise AssertionError("the bucket's parameters were read")

    def gradients(self) -> list[torch.Tensor]:
        raise AssertionError("the bucket's views were read")


def test_the_hook_reads_no_parameter_where_ddp_makes_no_bucket_view_grad() -> None:
    """Only a ``.grad`` that is its bucket view (``gradient_as_bucket_view=True``) is divided in place by DDP; the
    hook looped over the bucket's parameters at every backward on a world that is no power of two whatever the DDP
    module's setting. A route of a module without bucket views (``ddp_route`` reads it at construction) multiplies
    the whole buffer by 1 / world_size at once, reading no parameter (the same bits as the loop's there)."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(300)) for _ in range(2)]
    original = torch.randn(600, generator=gen)
    bucket = _Unread(original.clone(), params)
    route = sofx.offload.ddp.DDPRoute(None, 3, bucket_view=False)
    engine = _Kept({0, 1})
    route._engine, route._index = (lambda: engine), {id(p): i for i, p in enumerate(params)}
    sofx.offload.ddp._scale_for_average(route, bucket)
    assert torch.equal(bucket.buffer(), original * (1.0 / 3))
    assert sofx.offload.ddp.DDPRoute(None, 3).bucket_view  # (by default, the loop: a view may be a .grad)


def test_accumulation_counts_each_synchronized_backward_call_once(ranks) -> None:
    """With gradient_accumulation_steps=2 step() warns after fewer backward calls, each counted once although
    DDP's buckets may come in a reentrant checkpoint's nested backward and a weight outside DDP gets its gradient
    from a gradient hook in the same call; a backward under no_sync() counts where it gave a gradient (here to the
    weight outside DDP). The warning says that under DDP a backward inside no_sync() does not count (for DDP's
    parameters, whose gradients it holds back)."""
    for res in ranks:
        out = res["backward_calls"]
        assert "error" not in out, out.get("error")
        assert [n for n, _ in out["steps"]] == [2, 2, 1], out["steps"]
        assert out["steps"][0][1] == out["steps"][1][1] == [], out["steps"]
        (warned,) = out["steps"][2][1]
        assert warned.startswith("sofx.offload: step() after 1 backward call (micro-steps)"), warned
        assert "a backward inside no_sync() does not count" in warned, warned
