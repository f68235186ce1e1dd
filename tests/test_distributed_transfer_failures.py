"""A rank that fails after the ranks' first agreement of a collective (gloo, 2 ranks, a 2 s group timeout).

The agreement of each collective (the layout check of ``Shard.gather``, ``Shard.reduce_mean`` and
``all_reduce_mean_``, the setup's) raises a :class:`sofx.SofxError` naming the call where a rank never came to it.
The transfers after it (the gather's broadcasts, the reductions, the exchange that names what differs between the
ranks) raised gloo's bare ``RuntimeError`` where a rank stopped taking part there, naming neither the call nor what
was left of this rank's input; ``all_reduce_mean_`` had written the buckets reduced before it into the gradients
(half the mean, half this rank's own gradient). Each is now a ``SofxError`` naming the call, with gloo's error as
its cause, and nothing of this rank's is changed.

Rank ``BAD`` plays the rank that stopped: its ``torch.distributed`` call of the named kind, after ``passes`` such
calls went through, sleeps past the group's timeout (twice it) instead of taking part. One spawned group per case.
"""

from __future__ import annotations

import functools

import pytest
import torch

BAD = 1
TIMEOUT_S = 2.0
FULL = {"p": torch.ones(3), "q": torch.ones(4)}  # 2 ranks: rank 0 owns p, rank 1 owns q

# case -> (the torch.distributed function rank BAD stops in, how many of its calls go through first, the call)
CASES = {"Shard.gather": ("broadcast", 1),  # (the bucket of rank 0, then rank 1's: rank 0 waits for it)
         "Shard.reduce_mean": ("reduce", 0),  # (the bucket that rank 0 owns)
         "all_reduce_mean_": ("all_reduce", 2),  # (the layout's agreement, the float32 bucket, then the float64 one)
         "check_same_setup": ("all_gather_object", 0),  # (the settings differ: the exchange that names them)
         "all_reduce_sumsq": ("all_gather_object", 0)}  # (a step's settings differ: the same)


def _grads(rank: int) -> dict:
    gen = torch.Generator().manual_seed(rank)
    return {"a": torch.randn(5, generator=gen), "b": torch.randn(3, generator=gen, dtype=torch.float64),
            "p": torch.randn(3, generator=gen), "q": torch.randn(4, generator=gen)}


def _call(case: str, rank: int, grads: dict):
    from sofx import distributed as sd

    if case == "Shard.gather":
        shard = sd.shard_blocks(FULL, rank=rank, world_size=2)
        return lambda: shard.gather([grads[k] for k in ("p", "q")[rank:rank + 1]], like=FULL)
    if case == "Shard.reduce_mean":
        shard = sd.shard_blocks(FULL, rank=rank, world_size=2)
        return lambda: shard.reduce_mean({"p": grads["p"], "q": grads["q"]})
    if case == "all_reduce_mean_":
        return lambda: sd.all_reduce_mean_(grads)
    if case == "check_same_setup":
        return lambda: sd.check_same_setup(settings={"max_norm": 1.0 + rank})
    reduce = sd.all_reduce_sumsq()
    return lambda: reduce.agreed_sum(0.5, {"max_norm": 1.0 + rank})


def _stops_after_the_agreement(case: str, rank: int, world: int, store: str, outdir: str) -> None:
    import os
    import sys
    import time

    import torch.distributed as dist

    from helpers import init_gloo

    torch.set_num_threads(1)
    init_gloo(rank, world, store, TIMEOUT_S)
    name, passes = CASES[case]
    grads = _grads(rank)
    call = _call(case, rank, grads)  # (all_reduce_sumsq's setup: a collective of both ranks)
    out = {"before": {k: v.clone() for k, v in grads.items()}}
    path = os.path.join(outdir, f"rank{rank}.pt")
    if rank == BAD:
        real, calls = getattr(dist, name), []

        def stop(*args, **kwargs):
            calls.append(name)
            if len(calls) <= passes:
                return real(*args, **kwargs)
            torch.save(out, path)
            sys.stdout.flush()
            time.sleep(2 * TIMEOUT_S)  # (past the other rank's wait of TIMEOUT_S)
            os._exit(0)

        setattr(dist, name, stop)
    try:
        call()
        out["error"], out["cause"] = "no error", None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["cause"] = type(exc.__cause__).__name__
    out["after"] = grads
    torch.save(out, path)
    sys.stdout.flush()
    os._exit(0)  # (the group is unusable after a timeout: no destroy_process_group)


STAGES = {"Shard.gather": "the broadcast of the owners' leaves",
          "Shard.reduce_mean": "the reduction of the gradients onto their owners",
          "all_reduce_mean_": "the all-reduce of the gradients",
          "check_same_setup": "the exchange that names what differs between the ranks",
          "all_reduce_sumsq": "the exchange that names what differs between the ranks"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_that_stops_after_the_agreement_is_a_clear_error_and_changes_nothing(tmp_path, case):
    from helpers import run_gloo

    res = run_gloo(functools.partial(_stops_after_the_agreement, case), 2, tmp_path, timeout_s=120)[0]
    assert res["error"].startswith(f"SofxError: {case}: a rank did not take part in {STAGES[case]} (RuntimeError: "), \
        res["error"]
    assert "the process group may be unusable now" in res["error"], res["error"]
    assert res["cause"] == "RuntimeError"
    for k, before in res["before"].items():  # (all_reduce_mean_ wrote its first bucket's mean into "a")
        assert torch.equal(res["after"][k], before), k


# gloo's errors where a rank is missing (its timeout; the connections an earlier timeout closed; a peer that exited),
# and one that every rank raises at the call (a dtype gloo cannot send)
GLOO_LOST = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv "
             "operation to complete", "Application timeout caused pair closure",
             "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:12677. "
             "This is typically caused by a remote worker crashing.")
AT_THE_CALL = "Invalid scalar type"


class _FailingDist:
    """A stand-in for ``torch.distributed`` whose collectives raise ``RuntimeError(text)``."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, text: str) -> None:
        self.text = text

    def get_world_size(self, group=None) -> int:
        return 2

    def all_reduce(self, *args, **kwargs) -> None:
        raise RuntimeError(self.text)

    all_gather = all_gather_object = all_reduce


def test_an_error_of_every_rank_at_the_call_is_torchs_not_a_missing_rank(monkeypatch):
    """Every backend RuntimeError after the ranks' agreement (and in the agreement's all-reduce, and a step's
    all_gather of all_reduce_sumsq) was reported as a rank that did not take part within the group's timeout, also
    gloo's 'Invalid scalar type' that every rank raises at once at the call. Only a timeout or a closed connection
    blames a missing rank now; another error is 'the collective failed', with torch's words."""
    from sofx import SofxError
    from sofx.distributed import agreement, groups, sumsq

    for text in GLOO_LOST:
        err = groups._data_failure("Shard.gather", RuntimeError(text), STAGES["Shard.gather"], "nothing changed")
        assert str(err).startswith("Shard.gather: a rank did not take part in the broadcast of the owners' leaves "
                                   f"(RuntimeError: {text}) within the process group's timeout"), str(err)
    err = groups._data_failure("Shard.gather", RuntimeError(AT_THE_CALL), STAGES["Shard.gather"], "nothing changed")
    assert str(err).startswith("Shard.gather: the collective failed in the broadcast of the owners' leaves "
                               "(RuntimeError: Invalid scalar type); nothing changed; "), str(err)
    assert "did not take part" not in str(err) and "within the process group's timeout" not in str(err), str(err)

    monkeypatch.setattr(agreement, "dist", _FailingDist(AT_THE_CALL))
    with pytest.raises(SofxError, match=r"^Shard.reduce_mean: the collective failed in this call's agreement "
                                        r"\(RuntimeError: Invalid scalar type\); no data moved; ") as info:
        agreement._digests_agree("entries", None, torch.device("cpu"), "Shard.reduce_mean")
    assert "did not take part" not in str(info.value)
    monkeypatch.setattr(agreement, "dist", _FailingDist(GLOO_LOST[1]))
    with pytest.raises(SofxError, match=r"^Shard.reduce_mean: a rank did not take part in this call's agreement"):
        agreement._digests_agree("entries", None, torch.device("cpu"), "Shard.reduce_mean")

    monkeypatch.setattr(sumsq, "require_initialized", lambda *args: None)
    monkeypatch.setattr(sumsq, "dist", _FailingDist(AT_THE_CALL))
    with pytest.raises(SofxError, match=r"^all_reduce_sumsq: the collective failed in this step's reduction of the "
                                        r"sum of squares \(RuntimeError: Invalid scalar type\); nothing was stepped "
                                        "on this rank; ") as info:
        sumsq.SumsqReduce(None, "cpu")._gather(0.5, refused=False)
    assert "did not take part" not in str(info.value)
    monkeypatch.setattr(sumsq, "dist", _FailingDist(GLOO_LOST[0]))
    with pytest.raises(SofxError, match=r"^all_reduce_sumsq: a rank did not take part in this step's reduction"):
        sumsq.SumsqReduce(None, "cpu")._gather(0.5, refused=False)
