"""A rank that never comes to a synchronized backward under DDP (gloo, 2 ranks, a 2 s group timeout).

The engine's DDP communication hook has every rank take part in the ranks' exchange at bucket 0 of each
synchronized backward (:class:`sofx.offload.ddp.ReplicaWatch`). Where a rank raised in its own code before its
backward, the other waited in that exchange until the group's timeout, and its backward raised gloo's bare
``RuntimeError`` ("Timed out waiting 2000ms for send operation to complete"), naming neither the exchange nor what
to do. It now raises a :class:`sofx.SofxError` naming them, gloo's error its cause; nothing is stepped.
"""

from __future__ import annotations

import torch
from torch import nn

TIMEOUT_S = 2.0
BAD = 1


def _left_before_backward(rank: int, world: int, store: str, outdir: str) -> None:
    import os
    import sys
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    import sofx.offload
    from helpers import init_gloo

    torch.set_num_threads(1)
    init_gloo(rank, world, store, TIMEOUT_S)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, block_numel=16, ddp=model)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # (steps of both ranks: DDP rebuilds its buckets in the second's forward, a collective)
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    out: dict = {}
    path = os.path.join(outdir, f"rank{rank}.pt")
    if rank == BAD:  # (it raised in its own code before its backward: alive, the other's exchange times out)
        torch.save(out, path)
        sys.stdout.flush()
        time.sleep(2 * TIMEOUT_S)  # (past the other rank's wait of TIMEOUT_S)
        os._exit(0)
    out["before"] = [p.detach().clone() for p in model.parameters()]
    loss = model(x).square().sum()  # (no collective in DDP's forward from the third step on)
    try:
        loss.backward()
        out["backward"], out["cause"] = "no error", None
    except Exception as exc:
        out["backward"], out["cause"] = f"{type(exc).__name__}: {exc}", type(exc.__cause__).__name__
    out["after"] = [p.detach().clone() for p in model.parameters()]
    torch.save(out, path)
    sys.stdout.flush()
    os._exit(0)  # (the group is unusable after a timeout: no destroy_process_group)


def test_a_rank_that_left_before_a_synchronized_backward_is_a_clear_error_after_the_groups_timeout(tmp_path):
    from helpers import run_gloo

    res = run_gloo(_left_before_backward, 2, tmp_path, timeout_s=120)[0]
    assert res["backward"].startswith("SofxError: backward under DDP: a rank did not take part in the ranks' exchange "
                                      "at this synchronized backward (RuntimeError: "), res["backward"]
    assert "nothing was stepped" in res["backward"], res["backward"]
    assert res["cause"] == "RuntimeError"
    assert all(torch.equal(a, b) for a, b in zip(res["after"], res["before"]))
