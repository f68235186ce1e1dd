"""A sparse gradient (``nn.Embedding(sparse=True)``) passed to sofx.distributed's gradient collectives.

The loops refuse sparse gradients (Adam: "expected a dense (strided) tensor"); the collectives in front of them
must refuse them too, as a rank's own input, on every rank before any gradient moves. ``Shard.reduce_mean``
took a sparse gradient as a floating-point one: the layout check passed (same dtype and shape), then the rank
with it raised alone ("reshape is not implemented for sparse tensors") while the others waited for it in
``dist.reduce`` (until the group's timeout, or a "Connection closed by peer" once it exited);
``all_reduce_mean_`` refused it on every rank, but as a tensor whose "elements overlap in memory".
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from sofx import distributed as sd
from helpers import error_text, init_gloo, run_gloo

SPARSE_RANK = 1


def _grad(rank: int) -> torch.Tensor:
    if rank != SPARSE_RANK:
        return torch.ones(4)
    return torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,), check_invariants=True)


def _worker(rank: int, world: int, store: str, outdir: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, world, store, timeout_s=20)
    try:
        shard = sd.shard_blocks({"a": torch.ones(2), "e": torch.ones(4)})
        out = {"reduce_mean": error_text(lambda: shard.reduce_mean({"a": torch.ones(2), "e": _grad(rank)})),
               "all_reduce_mean_": error_text(lambda: sd.all_reduce_mean_({"a": torch.ones(2), "e": _grad(rank)}))}
        sd.all_reduce_mean_({"after": torch.ones(1)})  # the group still works
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_sparse_gradient_on_one_rank_is_refused_on_every_rank(tmp_path):
    results = run_gloo(_worker, 2, tmp_path, timeout_s=120.0)  # (a rank left waiting fails the test, not CI's job)
    for what in ("reduce_mean", "all_reduce_mean_"):
        for rank, res in enumerate(results):
            msg = res[what]
            assert "dense (strided)" in msg and "sparse_coo" in msg, (what, rank, msg)
            assert ("rank 1 refused its input (" in msg) == (rank != SPARSE_RANK), (what, rank, msg)
