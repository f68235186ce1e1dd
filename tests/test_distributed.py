"""sofx.distributed on real gloo process groups (1, 2 and 3 local processes).

Each process group is spawned once (a module fixture) and runs every scenario;
the ranks save what they computed and the tests here compare it, side by side,
with single-process runs on the same fresh random inputs:

* sharded blocks (ZeRO-style): each rank owns a disjoint part of the params
  tree and runs :func:`sofx.speculate.speculative_loop_step` with
  ``reduce_sumsq=all_reduce_sumsq()``; gathered, the result equals
  :func:`sofx.serial.serial_loop_step` over the whole tree -- bitwise until a
  step clips (the float64 sum of squares is associated per rank) or undoes a
  speculative step algebraically, <= 1e-6 relative afterwards -- over 20
  steps with clipping (vetoed and undone+redone), a loss scaler, a per-group
  schedule, and an inf and a nan injected into one rank's blocks only (every
  rank skips; with snapshot undo both lie in the bitwise stretch);
* data parallel: replicated params, gradients averaged by
  :func:`all_reduce_mean_`: every rank bitwise identical and equal to one
  process stepping on the averaged gradients;
* ZeRO-2 style: data-parallel gradients averaged onto their owners by
  :meth:`Shard.reduce_mean`, speculation on the shards, a leaf with no
  gradient on one step: equal to one process on the mean gradients;
* the sharded serial loop equals ``torch.optim.AdamW`` + ``clip_grad_norm_``
  over the full parameter set;
* a rank that owns no block still takes part (3 ranks); one rank alone owns
  every block and steps as one process does;
* the collectives themselves: inf/nan on one rank reach every rank (also
  through gloo's own ``all_reduce(SUM)``), the mean is rank-identical,
  sub-groups, errors without a process group.
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

import sofx
from sofx import AdamHParams, loss_scale
from sofx import distributed as sd
from sofx import speculate as sp
from sofx.serial import init_loop, serial_loop_step
from helpers import init_gloo, run_gloo

STEPS = 20
MAX_NORM = 1.0
SEED = 20261130
BIG_STEPS = {10, 16}        # gradients 25x larger: every block's norm is above MAX_NORM (speculation vetoed)
MODERATE_STEPS = {9, 13, 17}  # every leaf's norm is 0.6: ranks speculate, then the global norm clips (undo+redo)
CLIP_STEPS = BIG_STEPS | MODERATE_STEPS
INF_STEP, NAN_STEP = 3, 7               # overflow injected into one rank's blocks only


# ---------------------------------------------------------------- shared inputs (parent and ranks)
def _params() -> dict:
    g = torch.Generator().manual_seed(SEED)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {"embed": r(6, 4), "layers": [{"w": r(4, 4), "b": r(4)}, {"w": r(4, 3), "b": r(3)}], "head": r(3, 5)}


def _schedule(step: int) -> dict:
    """Per-group hparams (a prefix tree of the params) that move every step."""
    decay = 0.97 ** step
    return {"embed": AdamHParams(lr=1e-2 * decay, weight_decay=0.0),
            "layers": AdamHParams(lr=2e-2 * decay, beta1=0.85),
            "head": AdamHParams(lr=5e-3, weight_decay=0.1)}


def _raw_grads(step: int, stream: int = 0, *, owners: tuple[int, ...] | None = None,
               inject: dict[int, tuple[int, float]] | None = None) -> dict:
    """Fresh unscaled gradients of step ``step``; ``inject[step] = (rank, value)`` writes ``value``
    into one element of the first leaf owned by ``rank`` (``owners``)."""
    g = torch.Generator().manual_seed(SEED + 1000 * stream + step + 1)
    leaves, spec = sofx.tree.flatten(_params())
    out = [torch.randn(p.shape, generator=g) * (0.5 if step in BIG_STEPS else 0.02) for p in leaves]
    if step in MODERATE_STEPS:
        out = [x * (0.6 / x.norm()) for x in out]
    if inject and step in inject:
        rank, value = inject[step]
        leaf = owners.index(rank)
        out[leaf].view(-1)[1] = value
    return sofx.tree.unflatten(spec, out)


def _scaled(grads: dict, scale: float) -> dict:
    return sofx.tree.tree_map(lambda g: g * scale, grads)  # a None leaf is an empty subtree: stays None


def _scalers(profile: str):
    if profile == "torch":
        return loss_scale.grad_scaler(init_scale=2.0 ** 10, growth_interval=3)
    return loss_scale.deepspeed_scaler(init_scale=2.0 ** 10, scale_window=3, hysteresis=1)


def _opt(undo: str = "auto"):
    return sofx.adamw(lr=1e-2, weight_decay=0.05, undo=undo)


UNDO = {"torch": "exact", "deepspeed": "auto"}  # snapshot undo (bitwise) with one profile, algebraic with the other


def _inject(world: int) -> dict[int, tuple[int, float]]:
    return {INF_STEP: (world - 1, math.inf), NAN_STEP: (0, math.nan)}


# ---------------------------------------------------------------- what each rank runs
def _gather_loop(shard: sd.Shard, loop, like) -> dict:
    return {"params": shard.gather(loop.params, like),
            "mu": shard.gather(loop.opt_state.mu, like),
            "nu": shard.gather(loop.opt_state.nu, like),
            "count": shard.gather(loop.opt_state.count, sofx.tree.tree_map(lambda _: torch.zeros((), dtype=torch.int64),
                                                                            like))}


def _run_sharded_speculative(rank: int, world: int, profile: str) -> dict:
    params = _params()
    shard = sd.shard_blocks(params)
    opt, scaler = _opt(UNDO[profile]), _scalers(profile)
    cfg = sp.SpeculationConfig(max_norm=MAX_NORM, profile=profile)
    reduce = sd.all_reduce_sumsq(opt=opt, scaler=scaler, config=cfg, hparams=_schedule)  # the same on every rank
    loop = init_loop(opt, shard.local(params), scaler)
    hparams = shard.local_hparams(opt, _schedule)
    steps = []
    for step in range(STEPS):
        scale = scaler.scale(loop.scaler_state)
        grads = _scaled(_raw_grads(step, owners=shard.owners, inject=_inject(world)), scale)
        loop, report = sp.speculative_loop_step(opt, loop, shard.local(grads, "grads"), config=cfg, scaler=scaler,
                                                hparams=hparams, reduce_sumsq=reduce)
        steps.append({"scale": scale, "skipped": report.skipped, "clipped": report.clipped,
                      "actions": list(report.actions), "step": loop.step, **_gather_loop(shard, loop, params)})
    return {"owned": list(shard.owned), "owners": list(shard.owners), "steps": steps}


def _run_data_parallel(rank: int, world: int) -> dict:
    opt, scaler = _opt("exact"), _scalers("torch")  # snapshot undo: the overflow step's undo is bitwise
    cfg = sp.SpeculationConfig(max_norm=MAX_NORM)
    sd.check_same_setup(params=_params(), opt=opt, scaler=scaler, config=cfg, hparams=_schedule)
    serial = spec = init_loop(opt, _params(), scaler)
    averaged, steps = [], []
    for step in range(STEPS):
        scale = scaler.scale(serial.scaler_state)
        assert scale == scaler.scale(spec.scaler_state)
        mine = _raw_grads(step, stream=1 + rank)
        if step == INF_STEP and rank == world - 1:
            mine["layers"][0]["w"][1, 2] = math.inf
        grads = sd.all_reduce_mean_(_scaled(mine, scale))
        if step in (0, INF_STEP):
            averaged.append(grads)
        serial, facts = serial_loop_step(opt, serial, grads, scaler=scaler, hparams=_schedule, max_norm=MAX_NORM)
        spec, report = sp.speculative_loop_step(opt, spec, grads, config=cfg, scaler=scaler, hparams=_schedule)
        steps.append({"serial": serial.params, "serial_mu": serial.opt_state.mu, "spec": spec.params,
                      "skipped": facts.skipped, "spec_skipped": report.skipped, "actions": list(report.actions)})
    return {"averaged": averaged, "steps": steps}


NO_HEAD_STEP = 5  # no gradient for "head" on any rank (missing_grad="skip": its state does not move)


def _zero2_grads(step: int, rank: int, world: int) -> dict:
    g = _raw_grads(step, stream=1 + rank)
    if step == INF_STEP and rank == world - 1:
        g["layers"][1]["b"][0] = math.inf
    if step == NO_HEAD_STEP:
        g["head"] = None
    return g


def _run_zero2(rank: int, world: int) -> dict:
    """Data parallel and sharded: full gradients per rank, averaged onto the owners, speculation on the shards."""
    params = _params()
    shard = sd.shard_blocks(params)
    like = sofx.tree.tree_map(lambda p: torch.empty_like(p, device="meta"), params)
    opt, scaler = _opt("exact"), _scalers("torch")
    cfg = sp.SpeculationConfig(max_norm=MAX_NORM)
    reduce = sd.all_reduce_sumsq()
    loop = init_loop(opt, shard.local(params), scaler)
    hparams = shard.local_hparams(opt, _schedule)
    steps = []
    for step in range(STEPS):
        grads = _scaled(_zero2_grads(step, rank, world), scaler.scale(loop.scaler_state))
        before = sofx.tree.tree_map(torch.clone, grads)
        local = shard.reduce_mean(grads)
        assert all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten(grads)[0], sofx.tree.flatten(before)[0]))
        loop, report = sp.speculative_loop_step(opt, loop, local, config=cfg, scaler=scaler, hparams=hparams,
                                                reduce_sumsq=reduce)
        steps.append({"skipped": report.skipped, "clipped": report.clipped, "actions": list(report.actions),
                      "params": shard.gather(loop.params, like), "mu": shard.gather(loop.opt_state.mu, like),
                      "count": shard.gather(loop.opt_state.count, sofx.tree.tree_map(
                          lambda _: torch.zeros((), dtype=torch.int64), like))})
    return {"steps": steps}


def _run_sharded_serial_static(rank: int, world: int) -> dict:
    params = _params()
    shard = sd.shard_blocks(params)
    opt, scaler = _opt(), loss_scale.static_scale()
    reduce = sd.all_reduce_sumsq()
    loop = init_loop(opt, shard.local(params), scaler)
    steps = []
    for step in range(STEPS):
        loop, facts = serial_loop_step(opt, loop, shard.local(_raw_grads(step), "grads"), scaler=scaler,
                                       max_norm=MAX_NORM, reduce_sumsq=reduce)
        steps.append({"norm": facts.grad_norm, "clipped": facts.clipped, **_gather_loop(shard, loop, params)})
    return {"steps": steps}


def _run_collectives(rank: int, world: int) -> dict:
    out = {}
    reduce = sd.all_reduce_sumsq()
    out["sum"] = reduce(float(rank + 1) * 0.1)
    out["inf"] = reduce(math.inf if rank == world - 1 else 1.0)
    out["nan"] = reduce(math.nan if rank == 0 else 1.0)
    for name, value in (("gloo_inf", math.inf), ("gloo_nan", math.nan)):
        t = torch.tensor([value if rank == world - 1 else 2.0], dtype=torch.float64)
        dist.all_reduce(t)
        out[name] = t.item()
    g = {"a": torch.full((3,), float(rank + 1)), "b": None, "c": torch.full((2,), float(rank), dtype=torch.float64)}
    sd.all_reduce_mean_(g)
    out["mean_a"], out["mean_c"] = g["a"], g["c"]
    g = torch.Generator().manual_seed(SEED + rank)
    noisy = {"x": torch.randn(37, generator=g), "y": torch.randn(2, 3, generator=g, dtype=torch.float64)}
    out["noisy_own"] = {k: v.clone() for k, v in noisy.items()}
    out["noisy_mean"] = sd.all_reduce_mean_(noisy)
    out["layout_errors"] = _layout_errors(rank)
    if world >= 3:  # a sub-group of ranks 1..world-1: hooks, gathers and membership errors
        sub = dist.new_group(list(range(1, world)))
        if rank == 0:
            try:
                sd.all_reduce_sumsq(sub)
            except sofx.SofxError as exc:
                out["not_member"] = str(exc)
            # no process group at all (before, torch's bare ValueError "Group 1 is not registered")
            out["not_a_group"] = []
            for call in (lambda: sd.all_reduce_mean_({"a": torch.ones(1)}, 1), lambda: sd.all_reduce_sumsq("sub"),
                         lambda: sd.group_size(1)):
                try:
                    call()
                except sofx.SofxError as exc:
                    out["not_a_group"].append(str(exc))
        else:
            out["sub_sum"] = sd.all_reduce_sumsq(sub)(float(rank))
            params = _params()
            shard = sd.shard_blocks(params, sub)
            full = shard.gather(shard.local(params), params, group=sub)
            out["sub_gather_equal"] = all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten(full)[0],
                                                                            sofx.tree.flatten(params)[0]))
            out["sub_owned"] = list(shard.owned)
    return out


def _layout_errors(rank: int) -> list[str]:
    """Trees that differ between ranks (a None leaf on one rank only; the same sizes in other shapes; another
    dtype; the same leaves in another order): every rank raises naming the leaf, nothing is summed, and the
    group works on afterwards."""
    x = torch.arange(6.0) * (rank + 1)
    full = {"p": torch.ones(3), "q": torch.ones(4)}
    two = sd.shard_blocks(full, owners=(0, 1))  # rank 1 owns q
    cases = [
        lambda: sd.all_reduce_mean_({"a": torch.ones(3), "b": None if rank == 0 else torch.ones(2)}),
        lambda: sd.all_reduce_mean_({"a": x.view(2, 3) if rank == 0 else x.view(3, 2)}),
        lambda: sd.shard_blocks({"p": torch.ones(3), "q": torch.ones(4)}).reduce_mean(
            {"p": torch.ones(3), "q": None if rank == 1 else torch.ones(4)}),
        lambda: sd.shard_blocks({"p": torch.ones(3)}, owners=(0,)).gather(
            [torch.ones(3)] if rank == 0 else [], {"p": torch.ones(3, dtype=torch.float64 if rank else None)}),
        lambda: sd.all_reduce_mean_(OrderedDict((k, torch.ones(3)) for k in ("ab" if rank == 1 else "ba"))),
        # rank 1's own input refused (before, rank 1 raised at once and the others waited in the collective):
        lambda: sd.all_reduce_mean_({"a": torch.ones(3, dtype=torch.int64 if rank == 1 else None)}),
        lambda: two.reduce_mean({"p": torch.ones(3), **({} if rank == 1 else {"q": torch.ones(4)})}),
        lambda: two.reduce_mean({"p": torch.ones(3), "q": torch.ones(4, dtype=torch.int32 if rank == 1 else None)}),
        lambda: two.gather(two.local(full), {"p": torch.ones(3), **({} if rank == 1 else {"q": torch.ones(4)})}),
        lambda: two.gather(two.local(full), {"p": torch.ones(3), "q": torch.ones(4, dtype=torch.float64
                                                                                 if rank == 1 else None)}),
        lambda: two.gather(two.local(full), {"p": torch.ones(3), "q": None if rank == 1 else torch.ones(4)}),
        lambda: two.gather(None if rank == 1 else two.local(full), full),  # not a list: TypeError on rank 1
    ]
    errors = []
    for case in cases:
        try:
            case()
            errors.append("no error")
        except sofx.SofxError as exc:
            errors.append(str(exc))
    errors.append(x)  # untouched: not averaged with the other rank's differently shaped view
    sd.all_reduce_mean_({"after": torch.ones(1)})      # the group still works
    return errors


IDLE_OWNERS = (0, 0, 0, 2, 2, 2)  # on 3 ranks, rank 1 owns no block but still takes part in every all-reduce
IDLE_STEPS = 6


def _idle_grads(step: int) -> dict:
    grads = _raw_grads(step + 5)  # steps 4 and 5 are the main stream's 9 and 10: clipping
    if step == 2:
        grads["head"][0, 0] = math.inf  # owned by rank 2 only
    return grads


def _run_idle_rank(rank: int, world: int) -> dict:
    params = _params()
    shard = sd.shard_blocks(params, owners=IDLE_OWNERS)
    opt, scaler = _opt(), _scalers("torch")
    reduce = sd.all_reduce_sumsq()
    loop = init_loop(opt, shard.local(params), scaler)
    steps = []
    for step in range(IDLE_STEPS):
        grads = _scaled(_idle_grads(step), scaler.scale(loop.scaler_state))
        loop, facts = serial_loop_step(opt, loop, shard.local(grads, "grads"), scaler=scaler, max_norm=MAX_NORM,
                                       reduce_sumsq=reduce)
        steps.append({"skipped": facts.skipped, "clipped": facts.clipped, **_gather_loop(shard, loop, params)})
    return {"owned": list(shard.owned), "steps": steps}


# ---------------------------------------------------------------- audit regressions (what each rank runs)
HALF_BIG = {torch.float16: 40000.0, torch.bfloat16: 3e38}  # finite alone, inf when two are summed in the dtype


def _half_grads(rank: int, world: int) -> dict:
    """fp16 and bf16 gradients: a value near the top of the range on every rank (the mean is finite, the sum
    in the dtype is not), a value that differs per rank, an inf on the last rank and a nan on rank 0."""
    def row(dtype: torch.dtype) -> torch.Tensor:
        big = HALF_BIG[dtype]
        return torch.tensor([big, -big, 0.3 * (rank + 1) + 1e-3 * rank, math.inf if rank == world - 1 else 1.0,
                             math.nan if rank == 0 else 1.0], dtype=dtype)

    return {"bf16": row(torch.bfloat16), "fp16": row(torch.float16)}


def _run_half_means(rank: int, world: int) -> dict:
    shard = sd.shard_blocks(_half_grads(rank, world), owners=(world - 1, 0))  # bf16 onto the last rank
    return {"all_reduce": sd.all_reduce_mean_(_half_grads(rank, world)),
            "reduce_mean": shard.reduce_mean(_half_grads(rank, world)), "owned": list(shard.owned)}


def _run_owner_errors(rank: int, world: int) -> dict:
    """Shards built with other owners on rank 1 (say from rank-local sizes): every rank raises naming the
    first leaf whose owner differs, nothing is sent, the group works on afterwards. (Built by hand:
    shard_blocks refuses such shards already, tests/test_distributed_setup.py.)"""
    full = {"p": torch.full((3,), 1.0 + rank), "q": torch.full((3,), 2.0 + rank)}
    shard = sd.Shard(rank, world, (1, 0) if rank == 1 else (0, 1), sofx.tree.flatten(full)[1])
    errors = []
    for call in (lambda: shard.gather(shard.local(full), full), lambda: shard.reduce_mean(full)):
        try:
            call()
            errors.append("no error")
        except sofx.SofxError as exc:
            errors.append(str(exc))
    sd.all_reduce_mean_({"after": torch.ones(1)})
    return {"errors": errors}


def _unwritable(rank: int) -> list:
    """Gradients rank 1 passes that the mean cannot be written into (the others pass ordinary ones)."""
    if rank != 1:
        return [torch.ones(4)] * 4
    with torch.inference_mode():
        inference = torch.ones(4)
    leaf = torch.ones(4, requires_grad=True)
    return [torch.ones(1).expand(4), leaf, leaf[:4], inference]


def _run_unwritable(rank: int, world: int) -> dict:
    """all_reduce_mean_ on {"a": fine, "b": unwritable on rank 1}: every rank raises, "a" is unchanged."""
    out = []
    for bad in _unwritable(rank):
        a = torch.full((3,), float(rank + 1))
        try:
            sd.all_reduce_mean_({"a": a, "b": bad})
            msg = "no error"
        except sofx.SofxError as exc:
            msg = str(exc)
        except RuntimeError as exc:  # what torch's in-place write raised (halfway) before the check
            msg = f"RuntimeError: {exc}"
        out.append({"msg": msg, "a": a})
    sd.all_reduce_mean_({"after": torch.ones(1)})
    return {"cases": out}


EMPTY_STEP, ZERO_STEP = 1, 2  # no gradient on any rank; zero gradients on every rank (a step that counts)


def _empty_step_grads(step: int) -> dict:
    if step == EMPTY_STEP:
        return {"a": None, "b": None}
    return {"a": torch.full((3,), 0.0 if step == ZERO_STEP else 0.1), "b": torch.full((2,), 0.0 if step == ZERO_STEP
                                                                                        else 0.2)}


def _empty_step_run(reduce, local) -> dict:
    """The serial and the speculative loop over 5 steps with a GradScaler that grows every 2 steps counted;
    ``local`` selects this rank's gradients (the identity in one process)."""
    opt, scaler = sofx.adamw(lr=1e-2), loss_scale.grad_scaler(init_scale=4.0, growth_interval=2)
    cfg = sp.SpeculationConfig(max_norm=MAX_NORM)
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    serial = spec = init_loop(opt, local(params), scaler)
    out = {"serial": [], "spec": [], "recent": []}
    for step in range(5):
        serial, _ = serial_loop_step(opt, serial, local(_empty_step_grads(step)), scaler=scaler, max_norm=MAX_NORM,
                                     reduce_sumsq=reduce)
        spec, _ = sp.speculative_loop_step(opt, spec, local(_empty_step_grads(step)), config=cfg, scaler=scaler,
                                           reduce_sumsq=reduce)
        out["serial"].append(scaler.scale(serial.scaler_state))
        out["spec"].append(scaler.scale(spec.scaler_state))
        out["recent"].append(list(spec.policy_state.recent))
    return out


def _run_empty_step(rank: int, world: int) -> dict:
    """A step without gradient on any rank (with 3 ranks and 2 leaves, rank 1 owns none: it never has one):
    with sofx's hook and with a user's hook that sums by gloo's all_reduce."""
    shard = sd.shard_blocks({"a": torch.ones(3), "b": torch.ones(2)})

    def users_hook(local: float) -> float:
        t = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    def local(full: dict) -> list:
        return shard.local(full, "grads")

    return {"sofx": _empty_step_run(sd.all_reduce_sumsq(), local), "user": _empty_step_run(users_hook, local)}


REFUSING_RANK = 1


def _refusal_case(rank: int, name: str, reduce) -> dict:
    """One step of the ``name`` loop where rank REFUSING_RANK's inputs are refused (a gradient of the wrong
    shape, or a schedule that raises), then one good step everywhere."""
    opt, scaler = sofx.adamw(lr=1e-2), loss_scale.grad_scaler(init_scale=4.0)
    cfg = sp.SpeculationConfig(max_norm=MAX_NORM)
    loop = init_loop(opt, [torch.linspace(-1.0, 1.0, 5) * (1 + rank)], scaler)
    for _ in range(3):  # warm moments
        loop, _ = serial_loop_step(opt, loop, [torch.full((5,), 0.3)], scaler=scaler, reduce_sumsq=reduce)
    before = [t.clone() for t in (*loop.params, *loop.opt_state.mu, *loop.opt_state.nu, *loop.opt_state.count)]
    bad = rank == REFUSING_RANK
    grads = [torch.ones(6 if bad and name.endswith("shape") else 5)]

    def schedule(step: int) -> AdamHParams:
        if bad and name.endswith("schedule"):
            raise ValueError("this rank's schedule failed")
        return AdamHParams(lr=1e-2)

    try:
        if name.startswith("serial"):
            serial_loop_step(opt, loop, grads, scaler=scaler, hparams=schedule, max_norm=MAX_NORM,
                             reduce_sumsq=reduce)
        else:
            sp.speculative_loop_step(opt, loop, grads, config=cfg, scaler=scaler, hparams=schedule,
                                     reduce_sumsq=reduce, donate=name.startswith("donated"))
        msg = "no error"
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
    after = [*loop.params, *loop.opt_state.mu, *loop.opt_state.nu, *loop.opt_state.count]
    deviation = max(_rel(a, b) for a, b in zip(after, before))
    loop, facts = serial_loop_step(opt, loop, [torch.full((5,), 0.2)], scaler=scaler, reduce_sumsq=reduce)
    return {"msg": msg, "deviation": deviation, "stepped_after": loop.step}


def _run_refusals(rank: int, world: int) -> dict:
    """A rank that refuses a step before the reduction (bad input there) tells the others through
    all_reduce_sumsq's hook: they raise RankRefusedError instead of waiting in the collective forever."""
    reduce = sd.all_reduce_sumsq()
    return {name: _refusal_case(rank, name, reduce)
            for name in ("serial_shape", "serial_schedule", "spec_shape", "spec_schedule", "donated_shape")}


def _worker(rank: int, world: int, store: str, outdir: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, world, store, timeout_s=60)
    try:
        if world == 1:  # one rank owns every block: the same steps as no sharding
            results = {f"sharded_{p}": _run_sharded_speculative(rank, world, p) for p in ("torch", "deepspeed")}
            torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
            return
        results = {"collectives": _run_collectives(rank, world),
                   "sharded_torch": _run_sharded_speculative(rank, world, "torch")}
        if world == 2:
            results["sharded_deepspeed"] = _run_sharded_speculative(rank, world, "deepspeed")
            results["data_parallel"] = _run_data_parallel(rank, world)
            results["serial_static"] = _run_sharded_serial_static(rank, world)
            results["zero2"] = _run_zero2(rank, world)
        else:
            results["idle_rank"] = _run_idle_rank(rank, world)
        for name, run in (("half_means", _run_half_means), ("owner_errors", _run_owner_errors),
                          ("unwritable", _run_unwritable), ("empty_step", _run_empty_step),
                          ("refusals", _run_refusals)):
            results[name] = run(rank, world)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


#: How long one spawned group of this module's cases may run (:func:`helpers.run_gloo` kills it after that and fails
#: the test: a rank hanging in a collective hung CI until its job's timeout): far longer than its cases take.
SPAWN_TIMEOUT_S = 600.0


def _spawn(world: int, tmp_path_factory) -> list[dict]:
    return run_gloo(_worker, world, tmp_path_factory.mktemp(f"gloo{world}"), timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def ranks1(tmp_path_factory) -> list[dict]:
    return _spawn(1, tmp_path_factory)


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory) -> list[dict]:
    return _spawn(2, tmp_path_factory)


@pytest.fixture(scope="module")
def ranks3(tmp_path_factory) -> list[dict]:
    return _spawn(3, tmp_path_factory)


# ---------------------------------------------------------------- comparisons
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| relative to the largest |b| of the tensor."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _check_tree(got, want, exact: bool, what: str) -> None:
    g_leaves, g_spec = sofx.tree.flatten(got)
    w_leaves, w_spec = sofx.tree.flatten(want)
    assert g_spec == w_spec, what
    for i, (a, b) in enumerate(zip(g_leaves, w_leaves)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i)
        assert torch.isfinite(a).all(), f"{what} leaf {i}: not finite"
        if exact:
            assert torch.equal(a, b), f"{what} leaf {i}: not bitwise equal (rel {_rel(a, b):.3g})"
        else:
            assert _rel(a, b) <= 1e-6, f"{what} leaf {i}: rel {_rel(a, b):.3g}"


def _check_sharded(ranks: list[dict], key: str, profile: str) -> None:
    world = len(ranks)
    runs = [r[key] for r in ranks]
    owned = sorted(i for run in runs for i in run["owned"])
    assert owned == list(range(len(sofx.tree.flatten(_params())[0]))), "the shards must partition the leaves"
    assert all(run["owned"] for run in runs), "every rank owns blocks"
    opt, scaler = _opt(UNDO[profile]), _scalers(profile)
    ref = init_loop(opt, _params(), scaler)
    exact = True
    bitwise_steps = 0
    seen = {"clipped": 0, "skipped": 0, "undo_redo": 0, "commit": 0, "undo": 0}
    for step in range(STEPS):
        scale = scaler.scale(ref.scaler_state)
        grads = _scaled(_raw_grads(step, owners=tuple(runs[0]["owners"]), inject=_inject(world)), scale)
        ref, facts = serial_loop_step(opt, ref, grads, scaler=scaler, hparams=_schedule, max_norm=MAX_NORM,
                                      profile=profile)
        rows = [run["steps"][step] for run in runs]
        for row in rows:
            assert row["scale"] == scale, (step, row["scale"], scale)
            assert row["skipped"] == facts.skipped, f"step {step}: a rank disagrees on the overflow"
            assert row["clipped"] == facts.clipped, f"step {step}: a rank disagrees on clipping"
            assert row["step"] == ref.step
        actions = [a for row in rows for a in row["actions"]]
        if step in (INF_STEP, NAN_STEP):  # the ranks with finite gradients speculated every block, then undid it
            bad_rank = _inject(world)[step][0]
            for r, row in enumerate(rows):
                if r != bad_rank:
                    assert row["actions"] and set(row["actions"]) == {"undo"}, (step, r, row["actions"])
        if facts.clipped or (UNDO[profile] == "auto" and any(a in ("undo", "undo_redo") for a in actions)):
            exact = False  # the clip coefficient's float64 sum depends on the split; algebraic undo rounds
        seen["clipped"] += facts.clipped
        seen["skipped"] += facts.skipped
        for a in ("undo_redo", "commit", "undo"):
            seen[a] += actions.count(a)
        for row in rows[1:]:  # every rank gathered the same tree
            for k in ("params", "mu", "nu", "count"):
                _check_tree(row[k], rows[0][k], True, f"step {step} {k} rank-to-rank")
        bitwise_steps += exact
        _check_tree(rows[0]["params"], ref.params, exact, f"step {step} params")
        _check_tree(rows[0]["mu"], ref.opt_state.mu, exact, f"step {step} mu")
        _check_tree(rows[0]["nu"], ref.opt_state.nu, exact, f"step {step} nu")
        _check_tree(rows[0]["count"], ref.opt_state.count, True, f"step {step} count")
    # the scenario exercised what it claims to
    # (deepspeed: on a step where the scale grows the gradients are divided by the grown scale, so one
    # moderate step does not clip)
    if UNDO[profile] == "exact":  # both overflows (undone speculative steps) fall in the bitwise stretch
        assert bitwise_steps == min(CLIP_STEPS) > NAN_STEP, bitwise_steps
    assert seen["skipped"] == 2 and seen["clipped"] >= len(CLIP_STEPS) - 1
    assert seen["undo_redo"] > 0 and seen["commit"] > 0 and seen["undo"] > 0, seen
    assert int(sofx.tree.flatten(ref.opt_state.count)[0][0]) == STEPS - 2


# ---------------------------------------------------------------- tests
def test_collectives_propagate_overflow_and_sum_in_rank_order(ranks2, ranks3):
    for ranks in (ranks2, ranks3):
        world = len(ranks)
        want = 0.0
        for r in range(world):
            want += (r + 1) * 0.1
        for r in ranks:
            c = r["collectives"]
            assert c["sum"] == want  # the same bits on every rank, summed in rank order
            assert c["inf"] == math.inf and math.isnan(c["nan"])
            assert c["gloo_inf"] == math.inf and math.isnan(c["gloo_nan"])  # gloo's SUM propagates too
            assert torch.equal(c["mean_a"], torch.full((3,), (world + 1) / 2))
            assert torch.equal(c["mean_c"], torch.full((2,), (world - 1) / 2, dtype=torch.float64))
        # the data-parallel mean: the same bits on every rank, the mean to float rounding
        for k in ("x", "y"):
            mean = ranks[0]["collectives"]["noisy_mean"][k]
            want = sum(r["collectives"]["noisy_own"][k].double() for r in ranks) / world
            assert _rel(mean, want) <= 1e-6
            for r in ranks[1:]:
                assert torch.equal(r["collectives"]["noisy_mean"][k], mean)
            if world == 2:
                a, b = (r["collectives"]["noisy_own"][k] for r in ranks)
                assert torch.equal(mean, (a + b) / 2)
        for r in ranks:
            *msgs, untouched = r["collectives"]["layout_errors"]
            assert "grads['b'] is" in msgs[0] and "no tensor on rank" in msgs[0]
            assert "grads['a'] is" in msgs[1] and "(3, 2)" in msgs[1] and "(2, 3)" in msgs[1]
            assert "Shard.reduce_mean: grads['q']" in msgs[2]
            assert "Shard.gather: like['p']" in msgs[3] and "torch.float64" in msgs[3]
            me, other = ranks.index(r), 0 if ranks.index(r) == 1 else 1
            assert msgs[4] == (f"all_reduce_mean_: the grads tree of rank {other} lists its leaves in another order "
                               f"than rank {me}'s (an OrderedDict's leaves come in its keys' order): leaf 0 is "
                               f"grads[{'ba'[other == 1]!r}] on rank {other}, grads[{'ba'[me == 1]!r}] on rank {me}")
            own = ["all_reduce_mean_: grads['a'] is a torch.int64 tensor; expected a floating-point one",
                   "grads does not have the structure of params",
                   "Shard.reduce_mean: grads['q'] is a torch.int32 tensor; expected a floating-point one",
                   "like does not have the structure of params",
                   "Shard.gather: this rank's local leaf for params['q'] is torch.float32 (4,); like says "
                   "torch.float64 (4,)",
                   "Shard.gather: like['q'] is NoneType; like's leaves must be tensors",
                   "Shard.gather: this rank's input could not be read (TypeError: "]
            for msg, want in zip(msgs[5:], own, strict=True):
                if ranks.index(r) == 1:
                    assert want in msg and "refused its input" not in msg, msg
                else:
                    assert "rank 1 refused its input (" in msg and want in msg, msg
            assert torch.equal(untouched, torch.arange(6.0) * (ranks.index(r) + 1))
    c0, c1, c2 = (r["collectives"] for r in ranks3)
    assert "not a member" in c0["not_member"]
    assert len(c0["not_a_group"]) == 3, c0["not_a_group"]
    for msg, (what, group) in zip(c0["not_a_group"], (("all_reduce_mean_", "1"), ("all_reduce_sumsq", "'sub'"),
                                                      ("sofx.distributed", "1"))):
        assert msg.startswith(f"{what}: group={group} is no process group of torch.distributed (ValueError: ") and \
            msg.endswith("); pass None (the default group) or a group that torch.distributed.new_group made"), msg
    assert c1["sub_sum"] == c2["sub_sum"] == 3.0
    assert c1["sub_gather_equal"] and c2["sub_gather_equal"]
    assert sorted(c1["sub_owned"] + c2["sub_owned"]) == list(range(6))


@pytest.mark.parametrize("profile", ["torch", "deepspeed"])
def test_sharded_speculation_equals_single_process_serial_loop(ranks2, profile):
    _check_sharded(ranks2, f"sharded_{profile}", profile)


@pytest.mark.parametrize("profile", ["torch", "deepspeed"])
def test_a_world_of_one_rank_shards_like_no_sharding(ranks1, profile):
    """A group of one rank (as ``torchrun --nproc-per-node 1`` or DeepSpeed on one GPU gives): the rank owns every
    block, and its sharded loop, gathered, equals the single-process loop."""
    assert ranks1[0][f"sharded_{profile}"]["owners"] == [0] * len(sofx.tree.flatten(_params())[0])
    _check_sharded(ranks1, f"sharded_{profile}", profile)


def test_sharded_speculation_on_three_ranks(ranks3):
    _check_sharded(ranks3, "sharded_torch", "torch")


def test_data_parallel_ranks_identical_and_equal_to_averaged_single_process(ranks2):
    world = len(ranks2)
    opt, scaler = _opt("exact"), _scalers("torch")
    ref = init_loop(opt, _params(), scaler)
    averaged = 0
    skipped = 0
    for step in range(STEPS):
        scale = scaler.scale(ref.scaler_state)
        per_rank = []
        for r in range(world):
            g = _raw_grads(step, stream=1 + r)
            if step == INF_STEP and r == world - 1:
                g["layers"][0]["w"][1, 2] = math.inf
            per_rank.append(_scaled(g, scale))
        mean = sofx.tree.tree_map(lambda *gs: sum(gs[1:], gs[0]) / world, *per_rank)
        if step in (0, INF_STEP):
            for r in ranks2:
                got, want = sofx.tree.flatten(r["data_parallel"]["averaged"][averaged])[0], sofx.tree.flatten(mean)[0]
                assert all(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and
                           torch.equal(torch.isinf(a), torch.isinf(b)) for a, b in zip(got, want))
            averaged += 1
        ref, facts = serial_loop_step(opt, ref, mean, scaler=scaler, hparams=_schedule, max_norm=MAX_NORM)
        skipped += facts.skipped
        spec_ref = None
        for r in ranks2:
            row = r["data_parallel"]["steps"][step]
            assert row["skipped"] == row["spec_skipped"] == facts.skipped
            _check_tree(row["serial"], ref.params, True, f"step {step} serial params")
            _check_tree(row["serial_mu"], ref.opt_state.mu, True, f"step {step} serial mu")
            if spec_ref is None:
                spec_ref = row["spec"]
            _check_tree(row["spec"], spec_ref, True, f"step {step} speculative params rank-to-rank")
            # replicated: the same sum of squares as one process, and snapshot undo: bitwise on every step
            _check_tree(row["spec"], ref.params, True, f"step {step} speculative params")
    assert skipped == 1
    actions = [a for row in ranks2[0]["data_parallel"]["steps"] for a in row["actions"]]
    assert "undo" in actions and "commit" in actions and "step" in actions, actions


def test_sharded_serial_loop_equals_torch_adamw_and_clip_grad_norm(ranks2):
    ref = [torch.nn.Parameter(p.clone()) for p in sofx.tree.flatten(_params())[0]]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05)
    clipped = 0
    for step in range(STEPS):
        for p, g in zip(ref, sofx.tree.flatten(_raw_grads(step))[0]):
            p.grad = g.clone()
        norm = float(torch.nn.utils.clip_grad_norm_(ref, MAX_NORM))
        torch_opt.step()
        for r in ranks2:
            row = r["serial_static"]["steps"][step]
            assert row["norm"] == pytest.approx(norm, rel=1e-6)
            clipped += row["clipped"]
            want_params = [p.detach() for p in ref]
            want_mu = [torch_opt.state[p]["exp_avg"] for p in ref]
            want_nu = [torch_opt.state[p]["exp_avg_sq"] for p in ref]
            for k, want in (("params", want_params), ("mu", want_mu), ("nu", want_nu)):
                for i, (a, b) in enumerate(zip(sofx.tree.flatten(row[k])[0], want)):
                    assert _rel(a, b) <= 1e-6, (step, k, i, _rel(a, b))
            assert all(int(c) == step + 1 for c in sofx.tree.flatten(row["count"])[0])
    assert clipped == len(CLIP_STEPS) * len(ranks2)


def test_errors_without_a_process_group():
    assert not sd.is_ready()
    for call in (lambda: sd.all_reduce_sumsq(), lambda: sd.all_reduce_mean_([torch.ones(2)]),
                 lambda: sd.shard_blocks(_params()), lambda: sd.group_size()):
        with pytest.raises(sofx.SofxError, match="not initialized"):
            call()
    shard = sd.shard_blocks(_params(), rank=1, world_size=2)
    with pytest.raises(sofx.SofxError, match="not initialized"):
        shard.gather(shard.local(_params()), _params())
    with pytest.raises(sofx.SofxError, match="both rank and world_size"):
        sd.shard_blocks(_params(), rank=1)
    with pytest.raises(sofx.SofxError, match="owners"):
        sd.shard_blocks(_params(), owners=[0, 1], rank=0, world_size=2)
    n = len(sofx.tree.flatten(_params())[0])
    for bad in (0.5, True):  # truncated to rank 0, taken as rank 1 before
        with pytest.raises(sofx.SofxError, match=rf"owners must be ranks \(ints\), got {bad!r}"):
            sd.shard_blocks(_params(), owners=[0] * (n - 1) + [bad], rank=0, world_size=2)
    with pytest.raises(sofx.SofxError, match=r"shard_blocks: params\['w'\] is a float; expected a tensor"):
        sd.shard_blocks({"w": 1.0, "b": torch.ones(2)}, rank=0, world_size=2)
    with pytest.raises(sofx.SofxError, match="world_size"):
        sd.partition_blocks([1, 2], 0)


def test_owners_and_sizes_that_are_not_sequences_are_refused_naming_the_call():
    """owners=1 (or sizes=5) raised a bare TypeError ('int' object is not iterable); owners given as a
    generator were read twice, the second time empty ('owners has 0 entries, the params tree has 2 leaves')."""
    spec = sofx.tree.flatten(_params())[1]
    with pytest.raises(sofx.SofxError, match="shard_blocks: owners must be a sequence of ranks, one per leaf, got int"):
        sd.shard_blocks(_params(), owners=1, rank=0, world_size=2)
    with pytest.raises(sofx.SofxError, match="Shard: owners must be a sequence of ranks, one per leaf, got int"):
        sd.Shard(0, 2, 1, spec)
    with pytest.raises(sofx.SofxError, match="partition_blocks: sizes must be a sequence of element counts, got int"):
        sd.partition_blocks(5, 2)
    owners = (0,) * (spec.num_leaves - 1) + (1,)
    assert sd.shard_blocks(_params(), owners=iter(owners), rank=0, world_size=2).owners == owners
    assert sd.Shard(0, 2, iter(owners), spec).owners == owners
    assert sd.partition_blocks(iter([10, 10]), 2) == (0, 1)
    # a spec that is no tree structure (the params tree itself, say): before, a bare AttributeError ('dict' object
    # has no attribute 'num_leaves')
    with pytest.raises(sofx.SofxError, match=r"^Shard: spec is a dict; expected the params' tree structure "):
        sd.Shard(0, 2, owners, _params())


def test_partition_blocks_is_contiguous_balanced_and_complete():
    assert sd.partition_blocks([10, 10], 2) == (0, 1)
    assert sd.partition_blocks([1, 1, 1, 100, 1], 2) == (0, 0, 0, 1, 1)
    assert sd.partition_blocks([3] * 6, 3) == (0, 0, 1, 1, 2, 2)
    assert sd.partition_blocks([5], 3) == (1,)  # more ranks than blocks: some own nothing
    assert sd.partition_blocks([0, 0, 0], 2) == (0, 0, 1)
    g = torch.Generator().manual_seed(7)
    for world in (1, 2, 3, 5):
        sizes = (torch.randint(0, 50, (12,), generator=g)).tolist()
        owners = sd.partition_blocks(sizes, world)
        assert list(owners) == sorted(owners) and all(0 <= o < world for o in owners)
        # every rank's load is at most an even share plus one block
        for r in range(world):
            load = sum(s for s, o in zip(sizes, owners) if o == r)
            assert load <= sum(sizes) / world + max(sizes)
    shard = sd.shard_blocks(_params(), rank=0, world_size=2)
    hp = shard.local_hparams(_opt(), _schedule)(3)
    full = _opt().resolve_hparams(_schedule(3), sofx.tree.flatten(_params())[1])
    assert hp == [full[i] for i in shard.owned]


def test_local_hparams_of_a_schedule_refuse_what_the_loops_refuse_in_their_words():
    """A float schedule (``cosine_decay(...)`` given as the whole hparams) was refused by the schedule local_hparams
    gives with "hparams for params['embed']: expected an AdamHParams, got float"; the loops say what the schedule
    returned and how to wrap it (hparams_schedule(lr=schedule)): the shard's schedule says the same."""
    shard = sd.shard_blocks(_params(), rank=0, world_size=2)
    with pytest.raises(sofx.HParamError, match=r"^hparams: the schedule CosineDecay\(.*\) returned 0\.01 \(float\) at "
                                               r"step 0, a number; .*hparams_schedule\(lr=schedule\)"):
        shard.local_hparams(_opt(), sofx.schedules.cosine_decay(1e-2, 10))(0)
    wrapped = shard.local_hparams(_opt(), sofx.schedules.hparams_schedule(lr=sofx.schedules.cosine_decay(1e-2, 10)))
    assert [hp.lr for hp in wrapped(0)] == [1e-2] * len(shard.owned)


def test_local_hparams_refuse_an_opt_that_is_no_sofx_adam_at_once():
    """An ``opt`` that is no sofx.Adam (None, a torch.optim optimizer) raised Python's bare AttributeError ('...
    has no attribute resolve_hparams'); given a schedule, only at the first step, inside the loop."""
    shard = sd.shard_blocks(_params(), rank=0, world_size=2)
    torch_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for opt, hparams in ((None, None), (torch_opt, _schedule), (sofx.apply_if_finite(_opt(), 3), None)):
        with pytest.raises(sofx.SofxError, match=rf"^Shard.local_hparams: opt is an? {type(opt).__name__}"):
            shard.local_hparams(opt, hparams)


def test_local_hparams_follow_a_tensor_hparam_changed_in_place_as_one_process_does():
    """A 0-d tensor lr that the training loop changes in place (``lr.fill_()``, a schedule of one's own) is read
    by each step in one process; a shard's local hparams read it once, when built, and its steps went on with
    the first value. They keep the tensor, as the full tree does, and each step reads it."""
    params = _params()
    lr = torch.tensor(1e-2)
    hparams = {"embed": AdamHParams(lr=lr), "layers": AdamHParams(lr=lr, beta1=0.85), "head": AdamHParams()}
    opt, scaler = _opt(), loss_scale.static_scale()
    shard = sd.shard_blocks(params, rank=1, world_size=2)
    local_hp = shard.local_hparams(opt, hparams)
    full, local = init_loop(opt, params, scaler), init_loop(opt, shard.local(params), scaler)
    for step in range(3):
        lr.fill_(1e-2 * 0.5 ** step)
        grads = _raw_grads(step)
        full, _ = serial_loop_step(opt, full, grads, scaler=scaler, hparams=hparams)
        local, _ = serial_loop_step(opt, local, shard.local(grads, "grads"), scaler=scaler, hparams=local_hp)
        for got, want in zip(local.params, shard.local(full.params)):
            assert torch.equal(got, want), step
    assert local_hp == shard.local_hparams(opt, hparams)
    assert [hp.beta2 for hp in local_hp] == [0.999] * len(shard.owned)  # the defaults filled in


def test_a_rank_owning_no_block_still_takes_part(ranks3):
    runs = [r["idle_rank"] for r in ranks3]
    assert runs[1]["owned"] == [] and runs[0]["owned"] == [0, 1, 2] and runs[2]["owned"] == [3, 4, 5]
    opt, scaler = _opt(), _scalers("torch")
    ref = init_loop(opt, _params(), scaler)
    seen = []
    for step in range(IDLE_STEPS):
        grads = _scaled(_idle_grads(step), scaler.scale(ref.scaler_state))
        ref, facts = serial_loop_step(opt, ref, grads, scaler=scaler, max_norm=MAX_NORM)
        seen.append((facts.skipped, facts.clipped))
        for run in runs:
            row = run["steps"][step]
            assert (row["skipped"], row["clipped"]) == seen[-1]
            exact = not any(c for _, c in seen)  # bitwise until the first clipped step
            for k, want in (("params", ref.params), ("mu", ref.opt_state.mu), ("nu", ref.opt_state.nu),
                            ("count", ref.opt_state.count)):
                _check_tree(row[k], want, exact or k == "count", f"step {step} {k}")
    assert seen[2] == (True, False) and [c for _, c in seen] == [False] * 4 + [True] * 2


def test_zero2_reduce_mean_onto_owners_equals_single_process_on_the_mean(ranks2):
    world = len(ranks2)
    opt, scaler = _opt("exact"), _scalers("torch")
    ref = init_loop(opt, _params(), scaler)
    exact = True
    undo_redo = 0
    for step in range(STEPS):
        scale = scaler.scale(ref.scaler_state)
        per_rank = [_scaled(_zero2_grads(step, r, world), scale) for r in range(world)]
        mean = sofx.tree.tree_map(lambda a, b: (a + b) / 2, *per_rank)  # two ranks: the sum is exact to order
        ref, facts = serial_loop_step(opt, ref, mean, scaler=scaler, hparams=_schedule, max_norm=MAX_NORM)
        exact = exact and not facts.clipped
        rows = [r["zero2"]["steps"][step] for r in ranks2]
        for row in rows:
            assert (row["skipped"], row["clipped"]) == (facts.skipped, facts.clipped), step
            _check_tree(row["params"], ref.params, exact, f"step {step} params")
            _check_tree(row["mu"], ref.opt_state.mu, exact, f"step {step} mu")
            _check_tree(row["count"], ref.opt_state.count, True, f"step {step} count")
        undo_redo += sum(a == "undo_redo" for row in rows for a in row["actions"])
    assert undo_redo > 0
    counts = ref.opt_state.count
    assert int(counts["embed"]) == STEPS - 1 and int(counts["head"]) == STEPS - 2  # "head" missed one step


def test_collective_buffers_follow_the_backend(monkeypatch):
    """NCCL groups get CUDA buffers (the current device), every other backend CPU ones; ``device`` overrides."""
    monkeypatch.setattr(sd.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert sd._collective_device(None, None) == torch.device("cuda", 3)
    assert sd._collective_device(None, "cpu") == torch.device("cpu")
    monkeypatch.setattr(sd.dist, "get_backend", lambda group=None: "gloo")
    assert sd._collective_device(None, None) == torch.device("cpu")


def test_fp16_and_bf16_means_are_finite_where_the_mean_is(ranks2, ranks3):
    """Summed in fp16, two gradients of 40000 make inf (DDP divides first); sofx sums them in float32, divided
    first: the mean of finite values is finite, inf and nan still reach every rank, every rank has the same bits."""
    for ranks in (ranks2, ranks3):
        world = len(ranks)
        for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            per_rank = [_half_grads(r, world)[key] for r in range(world)]
            want = sum(g.float() / world for g in per_rank).to(dtype)  # the float32 sum, in rank order
            assert torch.isfinite(want[:3]).all() and want[3] == math.inf and math.isnan(want[4])
            assert want[0] == torch.tensor(HALF_BIG[dtype], dtype=dtype)
            means = [r["half_means"]["all_reduce"][key] for r in ranks]
            owner = world - 1 if key == "bf16" else 0  # each owns this one leaf
            assert ranks[owner]["half_means"]["owned"] == [0 if key == "bf16" else 1]
            means.append(ranks[owner]["half_means"]["reduce_mean"][0])
            for mean in means:
                assert mean.dtype == dtype
                assert torch.equal(mean[:4], want[:4]) and math.isnan(mean[4]), (key, world, mean, want)


def test_shards_with_other_owners_are_refused_on_every_rank(ranks2, ranks3):
    for ranks in (ranks2, ranks3):
        for r, run in enumerate(ranks):
            gather, reduce = run["owner_errors"]["errors"]
            for what, root, msg in (("Shard.gather", "like", gather), ("Shard.reduce_mean", "grads", reduce)):
                assert msg.startswith(f"{what}: {root}['p'] is owned by rank "), msg
                assert "every rank must build its Shard with the same owners" in msg
                assert ("in rank 1's shard" in msg) == (r != 1), msg  # each names a rank that differs from it


def test_all_reduce_mean_refuses_an_unwritable_gradient_before_writing_any(ranks2, ranks3):
    """An expanded tensor, a leaf that requires grad, a view of one, an inference tensor on rank 1 only:
    every rank raises (rank 1 its own error, the others naming rank 1) and no gradient changed."""
    wanted = ["grads['b']: its elements overlap in memory", "grads['b']: a leaf tensor that requires grad",
              "grads['b']: a view of a leaf tensor that requires grad", "grads['b']: an inference tensor"]
    for ranks in (ranks2, ranks3):
        for r, run in enumerate(ranks):
            for case, want in zip(run["unwritable"]["cases"], wanted, strict=True):
                msg = case["msg"]
                assert msg.startswith("all_reduce_mean_: ") and want in msg, msg
                assert ("rank 1 refused its input (" in msg) == (r != 1), msg
                assert torch.equal(case["a"], torch.full((3,), float(r + 1))), (msg, case["a"])


def test_a_step_without_gradient_on_any_rank_is_not_counted_as_in_one_process(ranks2, ranks3):
    """GradScaler (growth every 2 counted steps) and the adaptive policy skip a step without any gradient in
    one process; on many ranks too, with sofx's hook and with a user's hook summing by all_reduce (-0.0, the
    local sum of a rank without gradient, sums to -0.0 only where every rank has none). A step of zero
    gradients counts."""
    ref = _empty_step_run(None, lambda t: t)
    assert ref["serial"] == ref["spec"] == [4.0, 4.0, 8.0, 8.0, 16.0]  # the scale after each step: 1 not counted
    assert len(ref["recent"][EMPTY_STEP]) == len(ref["recent"][EMPTY_STEP - 1])
    for ranks in (ranks2, ranks3):
        for run in ranks:
            assert run["empty_step"]["sofx"] == ref
            assert run["empty_step"]["user"] == ref


def test_a_shard_holds_its_owners_in_one_form():
    """The ranks compare their shards' owners in the layout check: owners given as a list on one rank and as a
    tuple on another (shard_blocks') differed there (a bare StopIteration on every rank), and True passed for
    rank 1 (a digest mismatch). Owners are held as a tuple of ints; a bool is refused."""
    from sofx.distributed import Shard

    _, spec = sofx.tree.flatten({"p": torch.zeros(2), "q": torch.zeros(3)})
    assert Shard(0, 2, [0, 1], spec).owners == Shard(0, 2, (0, 1), spec).owners == (0, 1)
    assert type(Shard(0, 2, [0, 1], spec).owners) is tuple
    with pytest.raises(sofx.SofxError, match=r"owners must be ranks in \[0, 2\), got True"):
        Shard(0, 2, (0, True), spec)


def test_owned_by_refuses_a_rank_outside_the_world():
    """Shard.owned_by(rank) of a rank outside [0, world_size) (2 of 2 ranks, -1, a float, a bool) returned () as a
    rank that owns nothing: refused naming the rank and the world size; a numpy rank is read as an int."""
    from sofx.distributed import Shard

    _, spec = sofx.tree.flatten({"p": torch.zeros(2), "q": torch.zeros(3)})
    shard = Shard(0, 2, (0, 1), spec)
    assert shard.owned_by(0) == (0,) and shard.owned_by(1) == (1,)
    for rank, pattern in ((2, r"Shard.owned_by: rank 2 is not in \[0, 2\) \(the shard's world_size is 2\)"),
                          (-1, r"Shard.owned_by: rank = -1 is invalid; expected an integer >= 0"),
                          (0.0, r"Shard.owned_by: rank = 0.0 is invalid"),
                          (True, r"Shard.owned_by: rank = True is invalid")):
        with pytest.raises(sofx.SofxError, match=pattern):
            shard.owned_by(rank)
    np = pytest.importorskip("numpy")
    assert shard.owned_by(np.int64(1)) == (1,)


def test_a_rank_that_refuses_a_step_makes_every_rank_refuse_it(ranks2, ranks3):
    """Rank 1 passes a gradient of the wrong shape, or its schedule raises, in the serial and the speculative
    loop (donated too): it raises its own error, every other rank RankRefusedError naming rank 1 (before, they
    waited in all_gather until the process group's timeout); nothing was stepped on any rank (bitwise; within
    1e-6 where a donated speculative step was undone), and the next step runs everywhere."""
    for ranks in (ranks2, ranks3):
        for name in ("serial_shape", "serial_schedule", "spec_shape", "spec_schedule", "donated_shape"):
            for rank, res in enumerate(ranks):
                case = res["refusals"][name]
                if rank == REFUSING_RANK:
                    want = "LeafError" if name.endswith("shape") else "ValueError: this rank's schedule failed"
                    assert case["msg"].startswith(want), (name, case["msg"])
                else:
                    assert case["msg"].startswith("RankRefusedError: rank 1 of the process group refused"), \
                        (name, rank, case["msg"])
                if name.startswith("donated"):
                    assert case["deviation"] <= 1e-6, (name, rank, case["deviation"])
                else:
                    assert case["deviation"] == 0.0, (name, rank, case["deviation"])
                assert case["stepped_after"] == 4, (name, rank)


def test_the_refusal_error_survives_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(sd.RankRefusedError("rank 2 refused", [2])))
    assert isinstance(err, sofx.SofxError) and str(err) == "rank 2 refused" and err.ranks == (2,)


def test_ranks_and_world_sizes_given_as_numpy_are_ints_and_floats_or_bools_are_refused():
    """shard_blocks(rank=0.5, world_size=2) was taken as rank 0 (int() truncated it), world_size="2" as 2 and
    rank=True as 1; partition_blocks refused np.int64(2) and Shard np.int64 owners. numpy and 1-element tensor
    ranks are read as ints; floats, bools and strings are refused naming the argument. partition_blocks'
    sizes too (int() truncated [2.5, 1.9] to [2, 1]), naming the index."""
    np = pytest.importorskip("numpy")
    from sofx.distributed import Shard

    params = _params()
    n = len(sofx.tree.flatten(params)[0])
    want = sd.shard_blocks(params, rank=1, world_size=2)
    for count in (np.int64, lambda x: torch.tensor([x])):
        shard = sd.shard_blocks(params, rank=count(1), world_size=count(2))
        assert shard == want and (type(shard.rank), type(shard.world_size)) == (int, int)
        assert sd.partition_blocks([10, 10], count(2)) == (0, 1)
        got = Shard(count(1), count(2), [count(o) for o in want.owners], want.spec)
        assert got == want and all(type(o) is int for o in got.owners)
    assert sd.shard_blocks(params, owners=[np.int64(0)] * n, rank=0, world_size=2).owners == (0,) * n
    for kwargs, pattern in (({"rank": 0.5, "world_size": 2}, r"shard_blocks: rank = 0.5 is invalid; .*got float"),
                            ({"rank": True, "world_size": 2}, r"shard_blocks: rank = True is invalid; .*got bool"),
                            ({"rank": 0, "world_size": "2"}, r"shard_blocks: world_size = '2' is invalid; .*got str"),
                            ({"rank": 0, "world_size": 2.0, "owners": [0] * n},
                             r"shard_blocks: world_size = 2.0 is invalid; expected an integer >= 1")):
        with pytest.raises(sofx.SofxError, match=pattern):
            sd.shard_blocks(params, **kwargs)
    with pytest.raises(sofx.SofxError, match=r"partition_blocks: world_size = True is invalid"):
        sd.partition_blocks([1, 2], True)
    assert sd.partition_blocks([np.int64(10), torch.tensor([10])], 2) == (0, 1)
    for i, bad, got in ((0, 2.5, "float"), (1, 1.9, "float"), (1, True, "bool"), (0, -1, "int"), (1, "3", "str")):
        sizes = [2, 3]
        sizes[i] = bad  # int() truncated 2.5 and 1.9, took True as 1 and "3" as 3
        with pytest.raises(sofx.SofxError, match=rf"partition_blocks: sizes\[{i}\] = {re.escape(repr(bad))} is "
                                                 rf"invalid; expected an integer >= 0 .*got {got}"):
            sd.partition_blocks(sizes, 2)
    with pytest.raises(sofx.SofxError, match=r"Shard: rank = 0.0 is invalid; expected an integer >= 0"):
        Shard(0.0, 2, want.owners, want.spec)
    with pytest.raises(sofx.SofxError, match=r"owners must be ranks in \[0, 2\), got 1.0"):
        Shard(0, 2, (0,) * (n - 1) + (1.0,), want.spec)
