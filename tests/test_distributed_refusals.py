"""Bad input on one rank of a gloo process group (2 ranks): every rank raises, and nothing changes anywhere.

Each case is a call of :mod:`sofx.distributed` that every rank makes, with something wrong on rank ``BAD``
only. Before the fixes that rank raised alone (at once, or inside the backend) while the other waited for it in
a collective until the group's timeout. Now the bad rank raises its own error and every other rank one naming
it, before any data moves, and the group works on afterwards. One spawned group runs every case, with a 10 s
group timeout, and is killed if it does not finish in time: a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import pytest
import torch

import sofx
from sofx import distributed as sd
from sofx.serial import init_loop, serial_loop_step, serial_step
from sofx.speculate import SpeculationConfig, begin_step, plan_validation, speculative_loop_step, speculative_step
from helpers import error_text, refused_on_every_rank, run_gloo_cases

BAD = 1
FULL = {"p": torch.ones(3), "q": torch.ones(4)}  # 2 ranks: rank 0 owns p, rank 1 owns q



def _grads(rank: int) -> dict:
    return {"p": torch.full((3,), 1.0 + rank), "q": torch.full((4,), 2.0 + rank)}


def _shard_of_another_rank(rank: int) -> dict:
    """A hand-built Shard that says rank 0 (or a world of 3) on rank BAD: its gather and reduce_mean."""
    spec = sofx.tree.flatten(FULL)[1]
    out = {}
    for name, shard in (("rank", sd.Shard(0, 2, (0, 1), spec)),
                        ("world", sd.Shard(rank, 3 if rank == BAD else 2, (0, 1), spec))):
        out[f"gather_{name}"] = error_text(lambda: shard.gather(shard.local(FULL), FULL))
        grads = _grads(rank)
        out[f"reduce_mean_{name}"] = error_text(lambda: shard.reduce_mean(grads))
        out[f"grads_{name}"] = grads
    return out


def _local_leaf_without_data(rank: int) -> dict:
    """Shard.gather where rank BAD's local leaf (it owns q) is a meta or a sparse tensor of the right shape and
    dtype: before, that rank failed packing it ("Cannot copy out of meta tensor", "reshape is not implemented
    for sparse tensors") while the other waited for its broadcast; a nested tensor (which has no shape) was
    refused only as input that "could not be read" ("NestedTensorImpl doesn't support sizes")."""
    shard = sd.shard_blocks(FULL)
    out = {}
    with warnings.catch_warnings():  # nested tensors are a prototype
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(2)])
    for name, bad in (("meta", torch.empty(4, device="meta")), ("sparse", torch.ones(4).to_sparse()),
                      ("nested", nested)):
        local = [bad] if rank == BAD else shard.local(FULL)
        out[name] = error_text(lambda: shard.gather(local, FULL))
    return out


def _local_leaf_unlike(rank: int) -> dict:
    """Shard.gather where rank BAD's local leaf (it owns q) has another shape than like's, or is not a tensor:
    before, its refusal named the leaf by its index ("leaf 1 is (2, 2) torch.float32, like says ...")."""
    shard = sd.shard_blocks(FULL)
    out = {}
    for name, bad in (("shape", torch.ones(2, 2)), ("number", 1.0)):
        local = [bad] if rank == BAD else shard.local(FULL)
        out[name] = error_text(lambda: shard.gather(local, FULL))
    return out


def _meta_gradient(rank: int) -> dict:
    """all_reduce_mean_ and Shard.reduce_mean where rank BAD's gradient for q is a meta tensor: before,
    all_reduce_mean_ on that rank "all-reduced" the meta buffer without error and the other rank's backend
    aborted the process (a size mismatch in gloo); reduce_mean failed packing it on that rank alone."""
    shard = sd.shard_blocks(FULL)
    out = {}
    for name, call in (("all_reduce_mean_", sd.all_reduce_mean_), ("reduce_mean", shard.reduce_mean)):
        grads = _grads(rank)
        if rank == BAD:
            grads["q"] = torch.empty(4, device="meta")
        out[name] = error_text(lambda: call(grads))
        out[f"{name}_p"] = grads["p"]
    return out


def _nested_gradient(rank: int) -> dict:
    """all_reduce_mean_ and Shard.reduce_mean where rank BAD's gradient for q is a nested tensor (of the strided
    layout, floating point): before, it passed the checks and that rank raised alone in the layout check, where
    its shape was asked for ("NestedTensorImpl doesn't support sizes"), while the other waited for it there."""
    shard = sd.shard_blocks(FULL)
    out = {}
    for name, call in (("all_reduce_mean_", sd.all_reduce_mean_), ("reduce_mean", shard.reduce_mean)):
        grads = _grads(rank)
        if rank == BAD:
            with warnings.catch_warnings():  # nested tensors are a prototype
                warnings.simplefilter("ignore")
                grads["q"] = torch.nested.nested_tensor([torch.ones(2), torch.ones(2)])
        out[name] = error_text(lambda: call(grads))
        out[f"{name}_p"] = grads["p"]
    return out


def _gradient_not_floating(rank: int) -> dict:
    """all_reduce_mean_ and Shard.reduce_mean where rank BAD's gradient for q is an integer tensor or a number:
    before, the refusal named no leaf ("gradients must be floating point, got torch.int64") or only its index
    ("gradient 1 must be a floating-point tensor"); one check now names its path in both."""
    shard = sd.shard_blocks(FULL)
    out = {}
    for kind, bad in (("int", torch.ones(4, dtype=torch.int64)), ("number", 2.0)):
        for name, call in (("all_reduce_mean_", sd.all_reduce_mean_), ("reduce_mean", shard.reduce_mean)):
            grads = _grads(rank)
            if rank == BAD:
                grads["q"] = bad
            out[f"{name}_{kind}"] = error_text(lambda: call(grads))
            out[f"{name}_{kind}_p"] = grads["p"]
    return out


def _unreadable_gradients(rank: int) -> dict:
    """all_reduce_mean_ and Shard.reduce_mean where rank BAD's gradient tree holds itself (a list appended to
    itself), which all_reduce_mean_ cannot flatten: before, all_reduce_mean_ flattened it outside its checks and
    that rank raised RecursionError alone, while the other waited for it in the layout check."""
    shard = sd.shard_blocks(FULL)
    out = {}
    for name, call in (("all_reduce_mean_", sd.all_reduce_mean_), ("reduce_mean", shard.reduce_mean)):
        grads = _grads(rank)
        if rank == BAD:
            grads["q"] = [grads["q"]]
            grads["q"].append(grads["q"])
        out[name] = error_text(lambda: call(grads))
        out[f"{name}_p"] = grads["p"]
    return out


def _unknown_keyword(rank: int) -> dict:
    """A misspelt keyword (check_layuot=) on rank BAD only: before, a TypeError there at the call, while the
    other rank waited for it in the collective."""
    shard = sd.shard_blocks(FULL)
    kw = {"check_layuot": False} if rank == BAD else {}
    grads = _grads(rank)
    return {"all_reduce_mean_": error_text(lambda: sd.all_reduce_mean_(grads, **kw)),
            "reduce_mean": error_text(lambda: shard.reduce_mean(grads, **kw)),
            "gather": error_text(lambda: shard.gather(shard.local(FULL), FULL, **kw)), "grads": grads}


def _positional_too_many(rank: int) -> dict:
    """check_layout=False passed positionally on rank BAD only: before, a TypeError there at the call ("takes from
    2 to 3 positional arguments but 4 were given"), while the other rank waited for it in the collective."""
    shard = sd.shard_blocks(FULL)
    more = (False,) if rank == BAD else ()
    grads = _grads(rank)
    return {"all_reduce_mean_": error_text(lambda: sd.all_reduce_mean_(grads, None, *more)),
            "reduce_mean": error_text(lambda: shard.reduce_mean(grads, None, *more)),
            "gather": error_text(lambda: shard.gather(shard.local(FULL), FULL, None, *more)),
            "gather_without_like": error_text(lambda: shard.gather(shard.local(FULL)) if rank == BAD
                                              else shard.gather(shard.local(FULL), FULL)),
            "grads": grads}


class _SaysCuda0(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 (no GPU needed): all_reduce_mean_ buckets it as a cuda leaf."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


class _SaysCuda1(_SaysCuda0):
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 1)


def _gradient_on_another_device(rank: int) -> dict:
    """all_reduce_mean_ where rank BAD keeps q's gradient on another device than the other rank ("cuda" against
    "cpu"), or its two gradients on two cuda devices where the other has both on one: each rank sums the leaves
    of one dtype and device as one buffer, so the ranks' buffers paired p with p and q on one rank, p alone on
    the other (a size mismatch inside gloo, or unrelated elements summed where the sizes agree). A device's index
    may differ (rank 1 trains on cuda:1): which leaves share a device must not."""
    out = {}
    for name, kinds in (("type", ((None, None), (None, _SaysCuda0))),
                        ("index", ((_SaysCuda0, _SaysCuda0), (_SaysCuda0, _SaysCuda1)))):
        grads = _grads(rank)
        for key, kind in zip(("p", "q"), kinds[rank == BAD]):
            if kind is not None:
                grads[key] = grads[key].as_subclass(kind)
        out[name] = error_text(lambda: sd.all_reduce_mean_(grads))
        out[f"{name}_grads"] = {k: v.as_subclass(torch.Tensor).clone() for k, v in grads.items()}
    return out


def _loop_step_unknown_keyword(rank: int) -> dict:
    """serial_loop_step and speculative_loop_step with a misspelt keyword (max_nrom=) on rank BAD only: before, a
    TypeError there (at the call, or from speculative_step), while the other rank waited for its sum of squares."""
    opt, scaler = sofx.adamw(lr=1e-2), sofx.loss_scale.grad_scaler()
    reduce = sd.all_reduce_sumsq()
    loop = init_loop(opt, [torch.ones(3)], scaler)
    kw = {"max_nrom": 1.0} if rank == BAD else {}
    grads = [torch.full((3,), 0.5)]
    return {"serial": error_text(lambda: serial_loop_step(opt, loop, grads, scaler=scaler, reduce_sumsq=reduce,
                                                          **kw)),
            "speculative": error_text(lambda: speculative_loop_step(opt, loop, grads, config=SpeculationConfig(),
                                                                    scaler=scaler, reduce_sumsq=reduce, **kw)),
            "next": serial_loop_step(opt, loop, grads, scaler=scaler, reduce_sumsq=reduce)[0].step}


def _hook_under_a_misspelt_keyword(rank: int) -> dict:
    """The loop steps, the steps and plan_validation given the hook as reduce_sumq= on rank BAD only: before,
    that rank refused the keyword without telling the hook (it had none under reduce_sumsq=), while the other
    waited in the hook for its sum until the group's timeout."""
    opt, scaler = sofx.adamw(lr=1e-2), sofx.loss_scale.grad_scaler()
    reduce = sd.all_reduce_sumsq()
    loop = init_loop(opt, [torch.ones(3)], scaler)
    kw = {"reduce_sumq": reduce} if rank == BAD else {"reduce_sumsq": reduce}
    grads = [torch.full((3,), 0.5)]
    cfg = SpeculationConfig()
    ctx, tally = begin_step(opt, cfg, scaler, loop.scaler_state, n_blocks=1)
    calls = {"serial_loop_step": lambda: serial_loop_step(opt, loop, grads, scaler=scaler, **kw),
             "speculative_loop_step": lambda: speculative_loop_step(opt, loop, grads, config=cfg, scaler=scaler, **kw),
             "serial_step": lambda: serial_step(opt, loop.params, grads, loop.opt_state, scaler=scaler,
                                                scaler_state=loop.scaler_state, **kw),
             "speculative_step": lambda: speculative_step(opt, loop.params, grads, loop.opt_state, config=cfg,
                                                          scaler=scaler, scaler_state=loop.scaler_state, **kw),
             "plan_validation": lambda: plan_validation(ctx, tally, [0.75], **kw)}
    out = {what: error_text(call) for what, call in calls.items()}
    out["next"] = serial_loop_step(opt, loop, grads, scaler=scaler, reduce_sumsq=reduce)[0].step
    out["params"] = loop.params
    return out


def _required_keyword_misspelt(rank: int) -> dict:
    """The loop steps and the steps with a required keyword misspelt (scalr=, confg=, scaler_sate=) on rank BAD
    only: before, Python's "missing required keyword-only argument" TypeError there at the call, before any code
    ran, while the other rank waited in the hook for its sum until the group's timeout."""
    opt, scaler = sofx.adamw(lr=1e-2), sofx.loss_scale.grad_scaler()
    reduce = sd.all_reduce_sumsq()
    loop = init_loop(opt, [torch.ones(3)], scaler)
    bad = rank == BAD
    grads = [torch.full((3,), 0.5)]
    cfg = SpeculationConfig()
    state = {"scaler_sate" if bad else "scaler_state": loop.scaler_state}
    calls = {"serial_loop_step": lambda: serial_loop_step(opt, loop, grads, reduce_sumsq=reduce,
                                                          **{"scalr" if bad else "scaler": scaler}),
             "speculative_loop_step": lambda: speculative_loop_step(opt, loop, grads, scaler=scaler,
                                                                    reduce_sumsq=reduce,
                                                                    **{"confg" if bad else "config": cfg}),
             "serial_step": lambda: serial_step(opt, loop.params, grads, loop.opt_state, scaler=scaler,
                                                reduce_sumsq=reduce, **state),
             "speculative_step": lambda: speculative_step(opt, loop.params, grads, loop.opt_state, config=cfg,
                                                          scaler=scaler, reduce_sumsq=reduce, **state)}
    out = {what: error_text(call) for what, call in calls.items()}
    out["next"] = serial_loop_step(opt, loop, grads, scaler=scaler, reduce_sumsq=reduce)[0].step
    out["params"] = loop.params
    return out


def _plan_validation_input(rank: int) -> dict:
    """plan_validation with one sum of squares too few, taken for a block not speculated, or a sum of squares
    that is not a number, on rank BAD only: before, that rank raised without telling the hook, while the other
    waited in it for its sum until the group's timeout (the last, float()'s ValueError after telling it)."""
    opt, scaler = sofx.adamw(lr=1e-2), sofx.loss_scale.grad_scaler()
    reduce = sd.all_reduce_sumsq()
    bad = rank == BAD
    ctx, tally = begin_step(opt, SpeculationConfig(), scaler, scaler.init(), n_blocks=2)
    calls = {"sumsq": lambda: plan_validation(ctx, tally, [0.75] if bad else [0.75, 0.5], reduce_sumsq=reduce),
             "taken": lambda: plan_validation(ctx, tally, [0.75, 0.5], taken=[True, False] if bad else None,
                                              reduce_sumsq=reduce),
             "not_a_number": lambda: plan_validation(ctx, tally, [0.75, "x" if bad else 0.5], reduce_sumsq=reduce)}
    out = {what: error_text(call) for what, call in calls.items()}
    out["next"] = plan_validation(ctx, tally, [0.75, 0.5], reduce_sumsq=reduce).report.grad_norm
    return out


def _hook_called_with_a_misspelt_keyword(rank: int) -> dict:
    """all_reduce_sumsq's hook called on rank BAD with a misspelt keyword (locl=, setings=, eror=) or an argument
    too many: before, Python's TypeError there at the call, while the other rank waited for its sum."""
    reduce = sd.all_reduce_sumsq()
    bad = rank == BAD
    calls = {"call_keyword": lambda: reduce(locl=1.0) if bad else reduce(1.0),
             "call_positional": lambda: reduce(1.0, 2.0) if bad else reduce(1.0),
             "agreed_sum_keyword": lambda: reduce.agreed_sum(1.0, setings={}) if bad else reduce(1.0),
             "agreed_sum_positional": lambda: reduce.agreed_sum(1.0, None, 2.0) if bad else reduce(1.0),
             "refuse_keyword": lambda: reduce.refuse(eror=ValueError("mine")) if bad else reduce(1.0)}
    out = {what: error_text(call) for what, call in calls.items()}
    out["next"] = reduce(2.0)
    return out


def _not_a_number(rank: int) -> dict:
    """all_reduce_sumsq's hook called with two numbers (a tensor of 2) on rank BAD: before, float() raised there
    while the other rank waited for its sum."""
    reduce = sd.all_reduce_sumsq()
    out = {"msg": error_text(lambda: reduce(torch.ones(2) if rank == BAD else 1.0)),
           "str": error_text(lambda: reduce("1.0" if rank == BAD else 1.0))}  # (before, float() read it as 1.0)
    # no sum of squares either (before, taken: -5.0 lowered the others' sum silently, True counted as 1), and an
    # int beyond the float range, inf (before, refused as no real number)
    for name, local in (("negative", -5.0), ("bool", True), ("huge", 10**400)):
        out[name] = error_text(lambda: out.setdefault(f"{name}_sum", reduce(local if rank == BAD else 1.0)))
    return {**out, "next": reduce(2.0)}


def _positional_argument_misspelt_or_too_many(rank: int) -> dict:
    """The steps, the loop steps and plan_validation with a positional argument under a misspelt keyword (stat=,
    lop=, sumsqs=) or one positional argument too many on rank BAD only: before, Python's TypeError there at the
    call, before any code ran, while the other rank waited in the hook for its sum until the group's timeout."""
    opt, scaler = sofx.adamw(lr=1e-2), sofx.loss_scale.grad_scaler()
    reduce = sd.all_reduce_sumsq()
    loop = init_loop(opt, [torch.ones(3)], scaler)
    bad = rank == BAD
    grads = [torch.full((3,), 0.5)]
    cfg = SpeculationConfig()
    ctx, tally = begin_step(opt, cfg, scaler, loop.scaler_state, n_blocks=1)
    state = {"stat" if bad else "state": loop.opt_state}
    looped = {"lop" if bad else "loop": loop}
    extra = (True,) if bad else ()
    step_kw = {"scaler": scaler, "scaler_state": loop.scaler_state, "reduce_sumsq": reduce}
    calls = {"serial_step_misspelt": lambda: serial_step(opt, loop.params, grads, **state, **step_kw),
             "serial_step_too_many": lambda: serial_step(opt, loop.params, grads, loop.opt_state, *extra, **step_kw),
             "serial_loop_step_misspelt": lambda: serial_loop_step(opt, grads=grads, scaler=scaler,
                                                                   reduce_sumsq=reduce, **looped),
             "serial_loop_step_too_many": lambda: serial_loop_step(opt, loop, grads, *extra, scaler=scaler,
                                                                   reduce_sumsq=reduce),
             "speculative_step_misspelt": lambda: speculative_step(opt, loop.params, grads, config=cfg, **state,
                                                                   **step_kw),
             "speculative_step_too_many": lambda: speculative_step(opt, loop.params, grads, loop.opt_state, *extra,
                                                                   config=cfg, **step_kw),
             "speculative_loop_step_misspelt": lambda: speculative_loop_step(opt, grads=grads, config=cfg,
                                                                             scaler=scaler, reduce_sumsq=reduce,
                                                                             **looped),
             "speculative_loop_step_too_many": lambda: speculative_loop_step(opt, loop, grads, *extra, config=cfg,
                                                                             scaler=scaler, reduce_sumsq=reduce),
             "plan_validation_misspelt": lambda: plan_validation(ctx, tally, reduce_sumsq=reduce,
                                                                 **{"sumsqs" if bad else "sumsq": [0.75]}),
             "plan_validation_too_many": lambda: plan_validation(ctx, tally, [0.75], *extra, reduce_sumsq=reduce)}
    out = {what: error_text(call) for what, call in calls.items()}
    out["next"] = serial_loop_step(opt, loop, grads, scaler=scaler, reduce_sumsq=reduce)[0].step
    out["params"] = loop.params
    return out


CASES = {"shard_of_another_rank": _shard_of_another_rank, "local_leaf_without_data": _local_leaf_without_data,
         "local_leaf_unlike": _local_leaf_unlike, "meta_gradient": _meta_gradient,
         "nested_gradient": _nested_gradient, "gradient_not_floating": _gradient_not_floating,
         "unreadable_gradients": _unreadable_gradients, "unknown_keyword": _unknown_keyword,
         "positional_too_many": _positional_too_many, "gradient_on_another_device": _gradient_on_another_device,
         "loop_step_unknown_keyword": _loop_step_unknown_keyword,
         "hook_under_a_misspelt_keyword": _hook_under_a_misspelt_keyword,
         "required_keyword_misspelt": _required_keyword_misspelt, "plan_validation_input": _plan_validation_input,
         "hook_called_with_a_misspelt_keyword": _hook_called_with_a_misspelt_keyword, "not_a_number": _not_a_number,
         "positional_argument_misspelt_or_too_many": _positional_argument_misspelt_or_too_many}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_gloo_cases(CASES, 2, tmp_path_factory.mktemp("refusals"), timeout_s=300)


def _assert_unchanged(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (got, want)


def test_a_shard_of_another_rank_or_world_size_is_refused_on_every_rank(ranks):
    for what in ("gather", "reduce_mean"):
        refused_on_every_rank(ranks, BAD, "shard_of_another_rank", f"{what}_rank",
                               f"Shard.{what}: the shard is rank 0 of 2, the group has this process as rank 1 of 2")
        refused_on_every_rank(ranks, BAD, "shard_of_another_rank", f"{what}_world",
                               f"Shard.{what}: the shard is rank 1 of 3, the group has this process as rank 1 of 2")
    for rank, res in enumerate(ranks):
        for name in ("rank", "world"):
            _assert_unchanged(res["shard_of_another_rank"][f"grads_{name}"], _grads(rank))


def test_a_meta_or_sparse_local_leaf_to_gather_is_refused_on_every_rank(ranks):
    for name, why in (("meta", "a meta tensor, without data"),
                      ("sparse", "a torch.sparse_coo tensor; expected a dense (strided) one"),
                      ("nested", "a nested tensor; expected a dense (strided) one")):
        refused_on_every_rank(ranks, BAD, "local_leaf_without_data", name,
                               f"Shard.gather: this rank's local leaf for params['q'] is {why}")


def test_a_local_leaf_unlike_like_is_refused_naming_its_path(ranks):
    for name, got in (("shape", "torch.float32 (2, 2)"), ("number", "of type float")):
        refused_on_every_rank(ranks, BAD, "local_leaf_unlike", name,
                               f"Shard.gather: this rank's local leaf for params['q'] is {got}; like says "
                               "torch.float32 (4,)")


@pytest.mark.parametrize("case, words", [("meta_gradient", "is a meta tensor, without data"),
                                         ("nested_gradient", "is a nested tensor; expected a dense (strided) one")])
def test_a_gradient_without_dense_data_is_refused_on_every_rank_and_nothing_is_written(ranks, case, words):
    """A meta or a nested gradient (the nested one passed every check, then one rank raised alone)."""
    for what in ("all_reduce_mean_", "reduce_mean"):
        prefix = "Shard." if what == "reduce_mean" else ""
        refused_on_every_rank(ranks, BAD, case, what, f"{prefix}{what}: grads['q'] {words}")
        for rank, res in enumerate(ranks):
            assert torch.equal(res[case][f"{what}_p"], _grads(rank)["p"])


def test_a_gradient_that_is_not_floating_point_is_refused_naming_its_path(ranks):
    for what in ("all_reduce_mean_", "reduce_mean"):
        prefix = "Shard." if what == "reduce_mean" else ""
        for kind, own in (("int", "grads['q'] is a torch.int64 tensor; expected a floating-point one"),
                          ("number", "grads['q'] is of type float; expected a floating-point tensor")):
            refused_on_every_rank(ranks, BAD, "gradient_not_floating", f"{what}_{kind}", f"{prefix}{what}: {own}")
            for rank, res in enumerate(ranks):
                assert torch.equal(res["gradient_not_floating"][f"{what}_{kind}_p"], _grads(rank)["p"])


def test_a_gradient_tree_that_cannot_be_flattened_is_refused_on_every_rank(ranks):
    for what, own in (("all_reduce_mean_", "all_reduce_mean_: this rank's input could not be read (RecursionError: "),
                      ("reduce_mean", "Shard.reduce_mean: grads['q'] is of type list; expected a floating-point "
                                      "tensor")):  # (flattened up to the shard's leaves only)
        refused_on_every_rank(ranks, BAD, "unreadable_gradients", what, own)
        for rank, res in enumerate(ranks):
            assert torch.equal(res["unreadable_gradients"][f"{what}_p"], _grads(rank)["p"])


def test_an_unknown_keyword_on_one_rank_is_refused_on_every_rank(ranks):
    for what in ("all_reduce_mean_", "Shard.reduce_mean", "Shard.gather"):
        refused_on_every_rank(ranks, BAD, "unknown_keyword", what.removeprefix("Shard."),
                               f"{what}: unknown keyword argument 'check_layuot'; it takes check_layout")
    for rank, res in enumerate(ranks):
        _assert_unchanged(res["unknown_keyword"]["grads"], _grads(rank))


def test_a_positional_argument_too_many_on_one_rank_is_refused_on_every_rank(ranks):
    for what, takes in (("all_reduce_mean_", "grads, group"), ("Shard.reduce_mean", "grads, group"),
                        ("Shard.gather", "local, like, group")):
        refused_on_every_rank(ranks, BAD, "positional_too_many", what.removeprefix("Shard."),
                               f"{what}: 1 positional argument too many (bool); it takes {takes}, then only the "
                               "keywords check_layout")
    refused_on_every_rank(ranks, BAD, "positional_too_many", "gather_without_like",
                          "Shard.gather: missing required argument 'like'")  # (left out on one rank)
    for rank, res in enumerate(ranks):
        _assert_unchanged(res["positional_too_many"]["grads"], _grads(rank))


def test_gradients_on_other_devices_than_another_ranks_are_refused_on_every_rank(ranks):
    for rank, res in enumerate(ranks):
        case = res["gradient_on_another_device"]
        mine, theirs = ("cuda", "cpu") if rank == BAD else ("cpu", "cuda")
        other = 1 - rank
        assert case["type"] == (f"all_reduce_mean_: grads['q'] is on {theirs} on rank {other}, on {mine} on rank "
                                f"{rank}; every rank must keep its gradients on the same kind of device (the leaves "
                                "of one dtype and device are summed as one buffer)"), case["type"]
        mine, theirs = ("cuda #1 of 2", "cuda") if rank == BAD else ("cuda", "cuda #1 of 2")
        assert case["index"] == (f"all_reduce_mean_: grads['p'] is on {theirs} on rank {other}, on {mine} on rank "
                                 f"{rank}; every rank must keep its gradients on the same kind of device (the leaves "
                                 "of one dtype and device are summed as one buffer; #k of n: the kth of the n devices "
                                 "of that type a rank's gradients use)"), case["index"]
        for name in ("type", "index"):
            _assert_unchanged(case[f"{name}_grads"], _grads(rank))


OTHERS_REFUSED = "rank 1 of the process group refused this step before the sum of squares was reduced"


def _refused_on_every_rank(ranks: list[dict], name: str, own: dict[str, Callable[[str], bool]]) -> list[dict]:
    """Each rank's results of case ``name``, after checking its messages: on rank BAD, ``own[what](message)`` for
    each call ``what``; on the others, that each call raised because rank BAD refused the step."""
    cases = []
    for rank, res in enumerate(ranks):
        case = res[name]
        for what, holds in own.items():
            assert (holds(case[what]) if rank == BAD else case[what].startswith(OTHERS_REFUSED)), case[what]
        cases.append(case)
    return cases


def _starts(text: str) -> Callable[[str], bool]:
    return lambda message: message.startswith(text)


def _is(text: str) -> Callable[[str], bool]:
    return lambda message: message == text


def test_a_loop_step_with_an_unknown_keyword_on_one_rank_is_refused_on_every_rank(ranks):
    own = {what: _starts(f"{what}_loop_step: unknown keyword argument 'max_nrom'; it takes ")
           for what in ("serial", "speculative")}
    for case in _refused_on_every_rank(ranks, "loop_step_unknown_keyword", own):
        assert case["next"] == 1  # the next step, on every rank


def test_the_hook_under_a_misspelt_keyword_on_one_rank_is_refused_on_every_rank(ranks):
    hint = " (reduce_sumq is a reduce_sumsq hook: pass it as reduce_sumsq=)"
    own = {what: (lambda message, what=what: message.startswith(f"{what}: unknown keyword argument 'reduce_sumq'; "
                                                                 "it takes ") and message.endswith(hint))
           for what in ("serial_loop_step", "speculative_loop_step", "serial_step", "speculative_step",
                        "plan_validation")}
    for case in _refused_on_every_rank(ranks, "hook_under_a_misspelt_keyword", own):
        assert case["next"] == 1  # the next step, on every rank
        assert torch.equal(case["params"][0], torch.ones(3))


def test_a_required_keyword_misspelt_on_one_rank_is_refused_on_every_rank(ranks):
    own = {"serial_loop_step": "missing required keyword argument 'scaler' (scalr= given, did you mean scaler=?)",
           "speculative_loop_step": "missing required keyword argument 'config' (confg= given, did you mean "
                                    "config=?)",
           "serial_step": "missing required keyword argument 'scaler_state' (scaler_sate= given, did you mean "
                          "scaler_state=?)",
           "speculative_step": "missing required keyword argument 'scaler_state' (scaler_sate= given, did you mean "
                               "scaler_state=?)"}
    own = {what: _starts(f"{what}: {words}; it takes ") for what, words in own.items()}
    for case in _refused_on_every_rank(ranks, "required_keyword_misspelt", own):
        assert case["next"] == 1  # the next step, on every rank
        assert torch.equal(case["params"][0], torch.ones(3))


def test_plan_validation_input_refused_on_one_rank_is_refused_on_every_rank(ranks):
    own = {"sumsq": _is("sumsq has 1 entries, the step has 2 blocks"),
           "taken": _is("block 0: taken[0] is True but the block was not speculated"),
           "not_a_number": _is("plan_validation: sumsq[1] is 'x' (str); expected block 1's sum of squares, "
                               "a real number >= 0 (inf or nan where its gradient is not finite), or None for no "
                               "gradient")}
    for case in _refused_on_every_rank(ranks, "plan_validation_input", own):
        assert case["next"] == pytest.approx((2 * 1.25) ** 0.5 / 2.0 ** 16)  # the next step, on every rank


def test_a_positional_argument_misspelt_or_too_many_on_one_rank_is_refused_on_every_rank(ranks):
    misspelt = {"serial_step": ("state", "stat"), "serial_loop_step": ("loop", "lop"),
                "speculative_step": ("state", "stat"), "speculative_loop_step": ("loop", "lop"),
                "plan_validation": ("sumsq", "sumsqs")}
    own = {}
    for what, (name, wrong) in misspelt.items():
        own[f"{what}_misspelt"] = _starts(f"{what}: missing required argument '{name}' ({wrong}= given, did you "
                                          f"mean {name}=?); it takes ")
        own[f"{what}_too_many"] = _starts(f"{what}: 1 positional argument too many (bool); it takes ")
    for case in _refused_on_every_rank(ranks, "positional_argument_misspelt_or_too_many", own):
        assert case["next"] == 1  # the next step, on every rank
        assert torch.equal(case["params"][0], torch.ones(3))


def test_the_hook_called_with_a_misspelt_keyword_on_one_rank_is_refused_on_every_rank(ranks):
    own = {"call_keyword": "all_reduce_sumsq: the hook got the unknown keyword argument 'locl'; it takes local",
           "call_positional": "all_reduce_sumsq: the hook got 1 positional argument too many (float); it takes "
                              "local",
           "agreed_sum_keyword": "all_reduce_sumsq: the hook's agreed_sum got the unknown keyword argument "
                                 "'setings'; it takes local, settings",
           "agreed_sum_positional": "all_reduce_sumsq: the hook's agreed_sum got 1 positional argument too many "
                                    "(float); it takes local, settings",
           "refuse_keyword": "all_reduce_sumsq: the hook's refuse got the unknown keyword argument 'eror'; it takes "
                             "error"}
    for case in _refused_on_every_rank(ranks, "hook_called_with_a_misspelt_keyword",
                                       {what: _is(words) for what, words in own.items()}):
        assert case["next"] == 4.0  # the next step's sum, on every rank


def test_a_local_sum_that_is_not_a_number_is_refused_on_every_rank(ranks):
    for rank, res in enumerate(ranks):
        msg = res["not_a_number"]["msg"]
        if rank == BAD:
            assert msg == "all_reduce_sumsq: this rank's local sum of squares is tensor([1., 1.]) (Tensor); " \
                          "expected a real number", msg
        else:
            assert msg.startswith(OTHERS_REFUSED), msg
        msg = res["not_a_number"]["str"]
        assert msg == "all_reduce_sumsq: this rank's local sum of squares is '1.0' (str); expected a real number" \
            if rank == BAD else msg.startswith(OTHERS_REFUSED), msg
        for name, shown in (("negative", "-5.0 (float)"), ("bool", "True (bool)")):
            msg = res["not_a_number"][name]
            if rank == BAD:
                assert msg == f"all_reduce_sumsq: this rank's local sum of squares is {shown}; expected a sum of " \
                              "squares >= 0 (inf or nan where a gradient is not finite, -0.0 where it has none)", msg
            else:
                assert msg.startswith(OTHERS_REFUSED), msg
            assert f"{name}_sum" not in res["not_a_number"]
        assert res["not_a_number"]["huge"] == "no error" and res["not_a_number"]["huge_sum"] == math.inf
        assert res["not_a_number"]["next"] == 4.0  # the next step's sum, on every rank


# ---------------------------------------------------------------- a rank that never comes to the step's reduction
LEFT_TIMEOUT_S = 2.0  # the group's timeout in this run: rank 0 waits this long for the rank that left


def _left_before_the_reduction(rank: int, world: int, store: str, outdir: str) -> None:
    """Rank BAD raises in its own code before its step, leaving the group (it never calls the hook); rank 0 takes
    the serial and the speculative loop step (donating) and waits in the hook's collective until the group's
    timeout (its own group: a timeout leaves it unusable)."""
    import os
    import sys
    import time

    from helpers import init_gloo

    torch.set_num_threads(1)
    init_gloo(rank, world, store, LEFT_TIMEOUT_S)
    opt, scaler = sofx.adamw(lr=1e-2, undo="exact"), sofx.loss_scale.grad_scaler()
    reduce = sd.all_reduce_sumsq()  # (the setup's collective: both ranks take part)
    out = {}
    if rank == BAD:
        time.sleep(4 * LEFT_TIMEOUT_S)  # (alive: rank 0's collective times out, its peer is not gone)
    else:
        loop = init_loop(opt, [torch.ones(3)], scaler)
        grads = [torch.full((3,), 0.5)]
        out["serial"] = error_text(lambda: serial_loop_step(opt, loop, grads, scaler=scaler, reduce_sumsq=reduce))
        out["speculative"] = error_text(lambda: speculative_loop_step(
            opt, loop, grads, config=SpeculationConfig(), scaler=scaler, reduce_sumsq=reduce, donate=True))
        out["params"] = loop.params
        out["refused"] = error_text(lambda: serial_loop_step(opt, loop, [torch.ones(4)], scaler=scaler,
                                                             reduce_sumsq=reduce))
        out["misspelt"] = error_text(lambda: reduce.agreed_sum(1.0, setings={}))
        out["bare_refuse"] = error_text(lambda: reduce.refuse())
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # (the group is unusable after a timeout: no destroy_process_group)


def test_a_rank_that_left_before_the_reduction_is_a_clear_error_after_the_groups_timeout(tmp_path):
    """Where a rank raised in its own code before its step (no sofx call to refuse through), the other waited in
    the hook's all_gather until the group's timeout and raised gloo's bare RuntimeError ("Timed out waiting
    2000ms for send operation to complete", or "Application timeout caused pair closure"), which named neither
    the step's reduction nor what to do. It is now a SofxError naming them, with gloo's words; nothing was
    stepped. A step that this rank refuses then raises its own error, where the hook's refuse raised gloo's
    ("Application timeout caused pair closure") in its place."""
    from helpers import run_gloo

    res = run_gloo(_left_before_the_reduction, 2, tmp_path, timeout_s=120)[0]
    for what in ("serial", "speculative"):
        assert res[what].startswith("all_reduce_sumsq: a rank did not take part in this step's reduction of the sum "
                                    "of squares (RuntimeError: "), (what, res[what])
        assert "nothing was stepped on this rank" in res[what], res[what]
    assert torch.equal(res["params"][0], torch.ones(3))
    # a rank that refuses its own input raises that error, where the hook's refuse raised gloo's in its place
    assert res["refused"] == "grads[0]: expected shape (3,), got (4,)", res["refused"]
    # a misspelt call of the hook raises its own error too (gloo's bare RuntimeError before), and a refuse() without
    # an error a SofxError naming the hook's refusal
    assert res["misspelt"] == ("all_reduce_sumsq: the hook's agreed_sum got the unknown keyword argument 'setings'; "
                               "it takes local, settings"), res["misspelt"]
    assert res["bare_refuse"].startswith("all_reduce_sumsq: this rank's refusal of the step could not be told to "
                                         "the other ranks (RuntimeError: "), res["bare_refuse"]


def _left_before_an_agreement(rank: int, world: int, store: str, outdir: str) -> None:
    """Rank BAD never comes to the collectives rank 0 calls (it raised in its own code before them): the first
    waits until the group's timeout, the later ones find the group's connections closed."""
    import os
    import sys
    import time

    from helpers import init_gloo

    torch.set_num_threads(1)
    init_gloo(rank, world, store, LEFT_TIMEOUT_S)
    out = {}
    if rank == BAD:
        time.sleep(4 * LEFT_TIMEOUT_S)
    else:
        shard = sd.shard_blocks(FULL, rank=0, world_size=2)  # (no collective)
        calls = {"shard_blocks": lambda: sd.shard_blocks(FULL), "check_same_setup": lambda: sd.check_same_setup(
                 params=FULL), "Shard.gather": lambda: shard.gather(shard.local(FULL), FULL),
                 "Shard.reduce_mean": lambda: shard.reduce_mean(_grads(rank)),
                 "all_reduce_mean_": lambda: sd.all_reduce_mean_(_grads(rank))}
        out = {what: error_text(call) for what, call in calls.items()}
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # (the group is unusable after a timeout: no destroy_process_group)


def test_a_rank_that_left_before_an_agreement_is_a_clear_error_after_the_groups_timeout(tmp_path):
    """The setup's collectives and the layout checks of gather, reduce_mean and all_reduce_mean_, where a rank never
    came to them: the other raised gloo's bare RuntimeError after the group's timeout ("Timed out waiting 2000ms
    ...", then "Application timeout caused pair closure"), naming neither the call nor what to do. Each is now a
    SofxError naming the call, with gloo's words."""
    from helpers import run_gloo

    res = run_gloo(_left_before_an_agreement, 2, tmp_path, timeout_s=120)[0]
    for what in ("shard_blocks", "check_same_setup", "Shard.gather", "Shard.reduce_mean", "all_reduce_mean_"):
        assert res[what].startswith(f"{what}: a rank did not take part in this call's agreement (RuntimeError: "), \
            (what, res[what])
        assert "every rank must make the same calls in the same order" in res[what], res[what]
