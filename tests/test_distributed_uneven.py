"""Sharding with uneven leaves on real gloo process groups (3 processes, one spawn): equal to one process.

Leaves whose sizes no world size divides, two empty leaves and a one-element one, split three ways: by
:func:`sofx.distributed.partition_blocks`, with a rank owning only the empty leaves, and with a rank owning no
leaf. Each rank runs :func:`sofx.speculate.speculative_step` on its shard, with events that reach one rank
only (a late gradient, a leaf without gradient, an inf, a nan) and some that reach all (clipping after
speculation and vetoed, hparams changed between speculation and validation); gathered, every rank's result
equals :func:`sofx.serial.serial_step` over the whole tree in one process, within 1e-6 (the steps that clip
take their coefficient from a float64 sum of squares associated per rank), counts and decisions exactly.
Then the ranks gather their shards and every rank saves the same ZeRO-3 checkpoint of 3 dp ranks at once; a
sub-group of the ranks 1 and 2 (group ranks 0 and 1) and a group of rank 0 alone each load it, shard it
again, average data-parallel gradients onto their owners (:meth:`Shard.reduce_mean` on the
sub-group) and go on: equal to the single process that was never interrupted.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

import sofx
import sofx.checkpoint as ck
from sofx import AdamHParams, AdamState, loss_scale
from sofx import distributed as sd
from sofx import speculate as sp
from sofx.serial import init_loop, serial_loop_step, serial_step
from helpers import init_gloo, run_gloo

SHAPES = {"a": (5,), "b": (0,), "c": (1,), "d": (7, 3), "e": (0, 4), "f": (2,), "g": (3, 3)}
KEYS = sorted(SHAPES)  # the leaf order (dict keys sorted)
OWNERS = {"partition": None,             # partition_blocks: (0, 0, 0, 1, 2, 2, 2)
          "only_empty": (0, 1, 2, 2, 1, 0, 2),  # rank 1 owns b and e, both empty
          "idle": (0, 0, 0, 2, 2, 2, 2)}  # rank 1 owns nothing
CASES = {"torch": ("torch", "exact", False), "deepspeed": ("deepspeed", "auto", True)}  # profile, undo, donate
STEPS = 7
LATE_STEP, INF_STEP, BIG_STEP, NAN_STEP, NO_GRAD_STEP, CLIP_STEP = 1, 2, 3, 4, 5, 6
MAX_NORM = 1.0
RESUMED_STEPS = 3


def _params() -> dict:
    g = torch.Generator().manual_seed(5)
    return {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}


def _grads(step: int, scale: float) -> dict:
    """The raw gradients of ``step`` (``None``: no gradient), scaled by ``scale``."""
    g = torch.Generator().manual_seed(100 + step)
    out = {k: torch.randn(*s, generator=g) * (0.5 if step == BIG_STEP else 0.02) for k, s in SHAPES.items()}
    if step == CLIP_STEP:  # each leaf small enough to speculate, all of them together clip
        out = {k: x * (0.45 / x.norm()) if x.numel() else x for k, x in out.items()}
    if step == INF_STEP:
        out["g"][1, 1] = math.inf
    if step == NAN_STEP:
        out["a"][0] = math.nan
    if step == NO_GRAD_STEP:
        out["d"] = None
    return {k: None if v is None else v * scale for k, v in out.items()}


def _late(step: int, scale: float) -> dict[str, torch.Tensor]:
    """A further gradient for leaf d, after it was ready (a parameter used twice)."""
    if step != LATE_STEP:
        return {}
    return {"d": torch.randn(SHAPES["d"], generator=torch.Generator().manual_seed(7)) * 0.01 * scale}


def _hparams(step: int, validation: bool) -> dict:
    lr = 2e-2 if validation and step == NO_GRAD_STEP else 1e-2  # changed between speculation and validation
    return {k: AdamHParams(lr=lr, weight_decay=0.1 if k in "adg" else 0.0) for k in KEYS}


def _opt(undo: str):
    return sofx.adamw(lr=1e-2, undo=undo)


def _scaler(profile: str):
    if profile == "torch":
        return loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=2)
    return loss_scale.deepspeed_scaler(init_scale=2.0 ** 8, scale_window=2, hysteresis=1)


def _speculative_run(case: str, owned: list[int], reduce) -> dict:
    """``STEPS`` speculative steps over the leaves ``owned`` (all of them in one process)."""
    profile, undo, donate = CASES[case]
    opt, scaler = _opt(undo), _scaler(profile)
    cfg = sp.SpeculationConfig(max_norm=MAX_NORM, profile=profile)
    params = [_params()[KEYS[i]] for i in owned]
    state, scaler_state, policy_state = opt.init(params), scaler.init(), None
    facts = []
    for step in range(STEPS):
        scale = scaler.scale(scaler_state)
        full = _grads(step, scale)
        late = {owned.index(KEYS.index(k)): g for k, g in _late(step, scale).items() if KEYS.index(k) in owned}
        res = sp.speculative_step(opt, params, [full[KEYS[i]] for i in owned], state, config=cfg, scaler=scaler,
                                  scaler_state=scaler_state, policy_state=policy_state,
                                  hparams=[_hparams(step, False)[KEYS[i]] for i in owned],
                                  validation_hparams=[_hparams(step, True)[KEYS[i]] for i in owned],
                                  late_grads=late, reduce_sumsq=reduce, donate=donate)
        params, state, scaler_state, policy_state = res.params, res.state, res.scaler_state, res.policy_state
        facts.append((res.report.skipped, res.report.clipped, res.report.scale, res.report.next_scale))
    return {"params": params, "state": state, "scaler_state": scaler_state, "facts": facts}


def _sharded(case: str, owners, rank: int) -> dict:
    shard = sd.shard_blocks(_params(), owners=owners)
    run = _speculative_run(case, list(shard.owned), sd.all_reduce_sumsq())
    return {"owned": list(shard.owned), "facts": run["facts"], **_gathered(shard, run["params"], run["state"])}


def _gathered(shard: sd.Shard, params: list, state: AdamState, group=None) -> dict:
    like = _params()
    counts = {k: torch.zeros((), dtype=torch.int64) for k in KEYS}
    return {"params": shard.gather(params, like, group), "mu": shard.gather(state.mu, like, group),
            "nu": shard.gather(state.nu, like, group), "count": shard.gather(state.count, counts, group)}


def _clipped_run(rank: int) -> dict:
    """The serial loop on the shards of a rank that owns only the empty leaves (a static scale, clipping):
    each step's global norm, and the params gathered at the end."""
    opt, scaler = _opt("exact"), loss_scale.static_scale()
    shard = sd.shard_blocks(_params(), owners=OWNERS["only_empty"])
    reduce = sd.all_reduce_sumsq()
    loop = init_loop(opt, shard.local(_params()), scaler)
    norms = []
    for step in range(RESUMED_STEPS):
        loop, facts = serial_loop_step(opt, loop, shard.local(_resumed_grads(step)), scaler=scaler,
                                       hparams=shard.local_hparams(opt, _hparams(0, False)), max_norm=MAX_NORM,
                                       reduce_sumsq=reduce)
        norms.append((facts.grad_norm, facts.clipped))
    return {"norms": norms, "params": shard.gather(loop.params, _params())}


# ---------------------------------------------------------------- save by 3 ranks, load by 2 and by 1
GROUPS = [[i] for i in range(len(KEYS))]  # a block per leaf: leaf d missed a step, its count differs


def _resumed_grads(step: int) -> dict:
    g = torch.Generator().manual_seed(500 + step)
    return {k: torch.randn(*s, generator=g) * (0.5 if step == 1 else 0.02) for k, s in SHAPES.items()}


def _go_on(params: list, state: AdamState, grads: list, reduce) -> tuple[list, AdamState]:
    """One serial step of the resumed run (a static loss scale, clipping)."""
    opt, scaler = _opt("exact"), loss_scale.static_scale()
    res = serial_step(opt, params, grads, state, scaler=scaler, scaler_state=scaler.init(), max_norm=MAX_NORM,
                      reduce_sumsq=reduce)
    return res.params, res.state


def _save_and_resume(rank: int, directory: str, first: dict) -> dict:
    """Every rank saves the gathered run ``first`` as a ZeRO-3 checkpoint of 3 dp ranks (at once, over an older
    one of 5); ranks 1 and 2 resume it on a sub-group, rank 0 on a group of its own."""
    opt = _opt("exact")
    state = AdamState(first["count"], first["mu"], first["nu"])
    if rank == 0:
        ck.save_zero3(directory, opt, _params(), opt.init(_params()), groups=GROUPS, dp_world_size=5,
                      deepspeed_objects=False)
    dist.barrier()
    ck.save_zero3(directory, opt, first["params"], state, groups=GROUPS, dp_world_size=3, deepspeed_objects=False)
    dist.barrier()
    pair, alone = dist.new_group([1, 2]), dist.new_group([0])  # every rank creates every group
    group = alone if rank == 0 else pair
    params, state, _ = ck.load_zero3(directory, opt, _params())
    shard = sd.shard_blocks(params, group)
    local, local_state = shard.local(params), AdamState(*(shard.local(x) for x in state))
    reduce = sd.all_reduce_sumsq(group)
    for step in range(RESUMED_STEPS):
        local_grads = shard.reduce_mean(_resumed_grads(step), group)  # the same on both: the mean is exact
        local, local_state = _go_on(local, local_state, local_grads, reduce)
    return {"files": sorted(os.listdir(directory)), "owned": list(shard.owned),
            **_gathered(shard, local, local_state, group)}


def _worker(rank: int, world: int, store: str, outdir: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, world, store, timeout_s=30)
    try:
        results = {(case, name): _sharded(case, owners, rank) for case in CASES for name, owners in OWNERS.items()}
        results["clipped"] = _clipped_run(rank)
        results["resumed"] = _save_and_resume(rank, os.path.join(outdir, "zero3"),
                                              results[("torch", "partition")])
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the one-process reference
def _reference(case: str) -> tuple[dict, list]:
    """The serial step over the whole tree, in one process; what each step decided."""
    profile, undo, _ = CASES[case]
    opt, scaler = _opt(undo), _scaler(profile)
    params, scaler_state = _params(), scaler.init()
    state = opt.init(params)
    steps = []
    for step in range(STEPS):
        scale = scaler.scale(scaler_state)
        grads = _grads(step, scale)
        for k, extra in _late(step, scale).items():
            grads[k] = grads[k] + extra
        res = serial_step(opt, params, grads, state, scaler=scaler, scaler_state=scaler_state,
                          hparams=_hparams(step, True), max_norm=MAX_NORM, profile=profile)
        params, state, scaler_state = res.params, res.state, res.scaler_state
        steps.append((res.facts.skipped, res.facts.clipped, res.facts.scale, scaler.scale(scaler_state)))
    return {"params": params, "mu": state.mu, "nu": state.nu, "count": state.count}, steps


def _check(got: dict, want: dict, exact: bool, what: str) -> None:
    for name in ("params", "mu", "nu", "count"):
        for k in KEYS:
            a, b = got[name][k], want[name][k]
            assert a.dtype == b.dtype and a.shape == b.shape, (what, name, k)
            assert torch.isfinite(a).all(), (what, name, k)
            if exact or name == "count":
                assert torch.equal(a, b), (what, name, k)
            elif b.numel():
                rel = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
                assert rel <= 1e-6, (what, name, k, rel)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_gloo(_worker, 3, tmp_path_factory.mktemp("uneven"), timeout_s=300)


def test_uneven_shards_with_events_on_one_rank_equal_one_process(ranks):
    for case in CASES:
        want, steps = _reference(case)
        assert [s[:2] for s in steps] == [(False, False), (False, False), (True, False), (False, True),
                                          (True, False), (False, False), (False, True)], (case, steps)
        for name in OWNERS:
            runs = [r[(case, name)] for r in ranks]
            assert sorted(i for run in runs for i in run["owned"]) == list(range(len(KEYS)))
            if name != "partition":
                assert [KEYS[i] for i in runs[1]["owned"]] == {"only_empty": ["b", "e"], "idle": []}[name]
            for rank, run in enumerate(runs):
                assert run["facts"] == steps, (case, name, rank)  # skipped, clipped, scale: every rank alike
                # (not bitwise: the clip coefficient's float64 sum of squares is associated per rank)
                _check(run, want, exact=False, what=(case, name, rank))


def test_a_checkpoint_of_three_ranks_resumes_on_two_and_on_one(ranks):
    want, _ = _reference("torch")
    params, state = want["params"], AdamState(want["count"], want["mu"], want["nu"])
    for step in range(RESUMED_STEPS):
        grads = _resumed_grads(step)
        params, state = _go_on(params, state, grads, None)
    names = [ck.zero3_file_name(r) for r in range(3)]
    resumed = [r["resumed"] for r in ranks]
    assert all(r["files"] == names for r in resumed)  # the older checkpoint's ranks 3 and 4 are gone
    assert resumed[0]["owned"] == list(range(len(KEYS)))  # a group of one rank owns every leaf
    assert sorted(resumed[1]["owned"] + resumed[2]["owned"]) == list(range(len(KEYS)))
    for rank, run in enumerate(resumed):
        _check(run, {"params": params, "mu": state.mu, "nu": state.nu, "count": state.count}, exact=False,
               what=("resumed", rank))


def test_the_global_norm_across_uneven_shards_clips_as_clip_grad_norm_on_the_full_gradient(ranks):
    """The ranks' norm is ``clip_grad_norm_``'s of the whole gradient, and their steps ``torch.optim.AdamW``'s
    after it (to float32 rounding: torch's norm is a float32 one)."""
    ref = [torch.nn.Parameter(_params()[k].clone()) for k in KEYS]
    hp = _hparams(0, False)
    torch_opt = torch.optim.AdamW([{"params": [p], "weight_decay": hp[k].weight_decay} for k, p in zip(KEYS, ref)],
                                  lr=1e-2)
    for step in range(RESUMED_STEPS):
        grads = _resumed_grads(step)
        for k, p in zip(KEYS, ref):
            p.grad = grads[k].clone()
        norm = float(torch.nn.utils.clip_grad_norm_(ref, MAX_NORM))
        torch_opt.step()
        for rank, r in enumerate(ranks):
            got, clipped = r["clipped"]["norms"][step]
            assert got == pytest.approx(norm, rel=1e-6) and clipped == (norm > MAX_NORM), (step, rank, got, norm)
    assert [c for _, c in ranks[0]["clipped"]["norms"]] == [False, True, False]
    for rank, r in enumerate(ranks):
        for k, p in zip(KEYS, ref):
            a, b = r["clipped"]["params"][k], p.detach()
            if b.numel():
                assert float((a - b).abs().max() / b.abs().max()) <= 1e-6, (rank, k)
