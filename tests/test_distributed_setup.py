"""Ranks set up differently (gloo, 2 ranks): every rank raises at setup, naming what differs, before any step.

:func:`sofx.distributed.shard_blocks` checks that the ranks' params agree in structure, dtypes and shapes and
their shards in owners. Before, nothing compared them: a rank whose params had another shape (or another leaf)
stepped its own shard beside the others' -- the sum-of-squares hook adds numbers whatever they belong to --
until a gather refused the layouts, or never. A rank whose own input was refused there raised alone, and the
other went on to wait for it in its first collective. One spawned group runs every case, with a 10 s group
timeout, and is killed if it does not finish in time: a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from sofx import distributed as sd
from helpers import run_gloo

BAD = 1
HINT = "every rank must build its shard from params of the same structure, dtypes and shapes, with the same owners"


def _message(call) -> str:
    try:
        call()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _params(rank: int, change: str = "") -> dict:
    """The params of rank ``rank``; on rank BAD with ``change`` applied."""
    params = {"p": torch.ones(3), "q": torch.ones(4)}
    if rank != BAD:
        return params
    if change == "shape":
        params["q"] = torch.ones(2, 2)
    elif change == "dtype":
        params["p"] = torch.ones(3, dtype=torch.float64)
    elif change == "leaf":
        params["r"] = torch.ones(1)
    elif change == "number":
        params["q"] = 1.0
    return params


def _shard_blocks(rank: int) -> dict:
    out = {"same": _message(lambda: sd.shard_blocks(_params(rank)))}
    for change in ("shape", "dtype", "leaf", "number"):
        out[change] = _message(lambda: sd.shard_blocks(_params(rank, change)))
    bad = rank == BAD
    out["owners"] = _message(lambda: sd.shard_blocks(_params(rank), owners=(1, 0) if bad else (0, 1)))
    out["keyword"] = _message(lambda: sd.shard_blocks(_params(rank), **({"owner": (0, 1)} if bad else {})))
    out["rank_only"] = _message(lambda: sd.shard_blocks(_params(rank), **({"rank": 1} if bad else {})))
    return out


CASES = {"shard_blocks": _shard_blocks}


def _worker(rank: int, world: int, store: str, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=10))
    try:
        results = {}
        for name, case in CASES.items():
            results[name] = case(rank)
            sd.all_reduce_mean_({"after": torch.ones(1)})  # the group still works
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_gloo(_worker, 2, tmp_path_factory.mktemp("setup"), timeout_s=90)


def _refused_on_every_rank(ranks: list[dict], case: str, key: str, own: str) -> None:
    """Rank BAD raised ``own`` (its own error); every other rank named rank BAD's refusal, with ``own`` in it."""
    for rank, res in enumerate(ranks):
        msg = res[case][key]
        assert own in msg, (case, key, rank, msg)
        assert ("rank 1 refused its input (" in msg) == (rank != BAD), (case, key, rank, msg)


def test_shard_blocks_refuses_params_or_owners_that_differ_between_ranks(ranks):
    want = {"shape": "params['q'] differs between ranks: torch.float32 (4,) on rank 0; torch.float32 (2, 2) on "
                     "rank 1",
            "dtype": "params['p'] differs between ranks: torch.float32 (3,) on rank 0; torch.float64 (3,) on rank 1",
            "leaf": "params['r'] differs between ranks: absent on rank 0; torch.float32 (1,) on rank 1 (and 1 more: "
                    "owners)",
            "owners": "owners differs between ranks: (0, 1) on rank 0; (1, 0) on rank 1"}
    for res in ranks:
        assert res["shard_blocks"]["same"] == "no error"
        for key, msg in want.items():
            assert res["shard_blocks"][key] == f"SofxError: shard_blocks: {msg}; {HINT}", (key, res["shard_blocks"])


def test_shard_blocks_refuses_one_ranks_bad_input_on_every_rank(ranks):
    _refused_on_every_rank(ranks, "shard_blocks", "number",
                           "shard_blocks: params['q'] is a float; expected a tensor")
    _refused_on_every_rank(ranks, "shard_blocks", "keyword",
                           "shard_blocks: unknown keyword argument 'owner'; it takes owners, rank, world_size")
    _refused_on_every_rank(ranks, "shard_blocks", "rank_only",
                           "shard_blocks: pass both rank and world_size, or neither")
