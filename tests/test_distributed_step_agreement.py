"""Ranks that step with different settings (gloo, 2 ranks): every rank raises at that step, naming what differs.

:func:`sofx.distributed.all_reduce_sumsq` compares the setup once, as it builds the hook. What a loop passes at
each step was not compared: a rank stepping with another ``max_norm`` clipped at another threshold, one with
another profile or missing_grad mode took other decisions, one whose loss-scaler state had drifted (another
scale, another growth count) unscaled with another scale or grew it at another step, one at another step count
(resumed from another checkpoint) evaluated the schedule elsewhere -- and the replicas diverged silently. The
hook's one collective now carries a digest of those settings; where the ranks' digests differ every rank raises,
naming the setting and each rank's value, before any rank applies the step. One spawned group runs every case,
with a 10 s group timeout, and is killed if it does not finish in time: a hang fails the test instead of blocking
it.
"""

from __future__ import annotations

import pytest
import torch

import sofx
from sofx import distributed as sd
from sofx.serial import init_loop, serial_loop_step
from sofx.speculate import SpeculationConfig, speculative_loop_step
from helpers import error_text, run_gloo_cases

BAD = 1
HINT = ("every rank must step with the same profile, max_norm, missing_grad, loss-scaler state and step count; "
        "nothing was stepped")
# what differs on rank BAD: a loop step's keywords, the speculation config's fields, or its loop's scaler state or
# step count
CHANGES = {"max_norm": ({"max_norm": 2.0}, "max_norm", "1; 2"),
           "profile": ({"profile": "deepspeed"}, "profile", "'torch'; 'deepspeed'"),
           "missing_grad": ({"missing_grad": "zero"}, "missing_grad", "'skip'; 'zero'"),
           "scale": ({}, "scaler_state.scale", "65536; 32768"),
           "growth_tracker": ({}, "scaler_state.growth_tracker", "0; 1"),
           "step": ({}, "step", "0; 1")}


def _schedule(step: int) -> sofx.AdamHParams:
    return sofx.AdamHParams(lr=1e-2 / (step + 1))


def _params() -> list:
    return [torch.linspace(-1.0, 1.0, 3), torch.linspace(0.5, 2.0, 4)]


def _grads() -> list:
    return [torch.full((3,), 0.5), torch.full((4,), -0.25)]


def _setup(rank: int, change: str, scaler, loop):
    """The settings of rank ``rank`` (keywords of a loop step) and its loop (its scaler state and step count); on
    rank BAD with ``change`` made."""
    kw = {"max_norm": 1.0, "profile": "torch", "missing_grad": "skip"}
    state = scaler.init()
    if rank == BAD:
        kw.update(CHANGES[change][0])
        if change == "scale":
            state = state._replace(scale=state.scale / 2)
        elif change == "growth_tracker":
            state = state._replace(growth_tracker=1)
        elif change == "step":
            loop = loop._replace(step=1)
    return kw, loop._replace(scaler_state=state)


def _steps_with_other_settings(rank: int) -> dict:
    """serial_loop_step and speculative_loop_step (donating, snapshot undo: its speculative steps are written in
    place, then taken back) with a schedule, where rank BAD's settings differ in one of CHANGES, then steps where
    they agree."""
    opt, scaler = sofx.adamw(lr=1e-2, undo="exact"), sofx.loss_scale.grad_scaler()
    reduce = sd.all_reduce_sumsq(opt=opt, scaler=scaler, hparams=_schedule)
    out = {}
    for change in CHANGES:
        kw, loop = _setup(rank, change, scaler, init_loop(opt, _params(), scaler))
        out[f"serial_{change}"] = error_text(lambda: serial_loop_step(opt, loop, _grads(), scaler=scaler,
                                                                      hparams=_schedule, reduce_sumsq=reduce, **kw))
        out[f"serial_{change}_params"] = loop.params
        cfg = SpeculationConfig(**kw)
        out[f"speculative_{change}"] = error_text(lambda: speculative_loop_step(
            opt, loop, _grads(), config=cfg, scaler=scaler, hparams=_schedule, reduce_sumsq=reduce, donate=True))
        out[f"speculative_{change}_params"] = loop.params
        out[f"speculative_{change}_mu"] = loop.opt_state.mu
    loop = init_loop(opt, _params(), scaler)
    loop, _ = speculative_loop_step(opt, loop, _grads(), config=SpeculationConfig(max_norm=1.0), scaler=scaler,
                                    hparams=_schedule, reduce_sumsq=reduce)
    loop, _ = serial_loop_step(opt, loop, _grads(), scaler=scaler, hparams=_schedule, reduce_sumsq=reduce)
    out["next"] = loop.step
    return out


def _settings_in_another_order(rank: int) -> dict:
    """The hook's agreed_sum given the same settings on both ranks, a dict built in another key order on rank BAD
    (equal dicts), then settings that differ in one value."""
    reduce = sd.all_reduce_sumsq()
    items = [("max_norm", 1.0), ("profile", "torch"), ("missing_grad", "skip")]
    settings = dict(reversed(items) if rank == BAD else items)
    out = {"same": None}

    def same() -> None:
        out["same"] = reduce.agreed_sum(0.5 + rank, settings)

    out["same_error"] = error_text(same)
    out["other"] = error_text(lambda: reduce.agreed_sum(0.5, {**settings, "max_norm": 1.0 + (rank == BAD)}))
    return out


def _settings_named_by_other_types(rank: int) -> dict:
    """The hook's agreed_sum given a setting named ``"1"`` on rank 0 and one named ``1`` on rank BAD (unequal
    dicts): both names read ``1`` in the digest's text, so the ranks were taken as agreeing, and both returned the
    sum."""
    reduce = sd.all_reduce_sumsq()
    return {"error": error_text(lambda: reduce.agreed_sum(0.5, {1: 1.0} if rank == BAD else {"1": 1.0}))}


CASES = {"steps_with_other_settings": _steps_with_other_settings,
         "settings_in_another_order": _settings_in_another_order,
         "settings_named_by_other_types": _settings_named_by_other_types}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_gloo_cases(CASES, 2, tmp_path_factory.mktemp("step_agreement"), timeout_s=300)


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("loop", ["serial", "speculative"])
def test_a_step_whose_settings_differ_between_ranks_is_refused_on_every_rank(ranks, loop, change):
    _, name, values = CHANGES[change]
    first, second = values.split("; ")
    want = (f"all_reduce_sumsq: {name} differs between ranks at this step: {first} on rank 0; {second} on rank 1; "
            f"{HINT}")
    for res in ranks:
        case = res["steps_with_other_settings"]
        assert case[f"{loop}_{change}"] == want, (loop, change, case[f"{loop}_{change}"])


@pytest.mark.parametrize("change", list(CHANGES))
def test_nothing_is_stepped_where_the_settings_differ(ranks, change):
    """The loops return nothing and write nothing: the speculative steps taken in place were taken back."""
    for res in ranks:
        case = res["steps_with_other_settings"]
        for loop in ("serial", "speculative"):
            assert all(torch.equal(a, b) for a, b in zip(case[f"{loop}_{change}_params"], _params()))
        assert all(not m.any() for m in case[f"speculative_{change}_mu"])


def test_the_ranks_step_on_once_their_settings_agree(ranks):
    assert [res["steps_with_other_settings"]["next"] for res in ranks] == [2, 2]


def test_equal_settings_whose_dicts_list_their_keys_in_another_order_agree(ranks):
    """A dict's key order is not part of its value (``{"a": 1, "b": 2} == {"b": 2, "a": 1}``): such settings agree,
    as in check_same_setup, where the ranks raised that they list them in another order."""
    want = f"all_reduce_sumsq: max_norm differs between ranks at this step: 1 on rank 0; 2 on rank 1; {HINT}"
    for res in ranks:
        case = res["settings_in_another_order"]
        assert (case["same_error"], case["same"]) == ("no error", 0.5 + 1.5)
        assert case["other"] == want


def test_settings_named_by_other_types_are_not_taken_as_the_same(ranks):
    """A name that is not a string (1, on rank BAD) is that rank's refusal of the step, told to the other rank."""
    own = ("all_reduce_sumsq: settings has the name 1 (int); the names of a step's settings must be strings (1 and "
           "'1' would read the same)")
    assert ranks[BAD]["settings_named_by_other_types"]["error"] == own
    assert ranks[0]["settings_named_by_other_types"]["error"].startswith(f"rank {BAD} of the process group refused "
                                                                         "this step")
