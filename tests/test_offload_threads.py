"""Operations the training thread only waits for use its core too (``BlockOp.extra_threads``).

The last block of backward (its speculative step runs while backward has nothing left to do) and, with a
worker process, ``step()``'s actions run their native kernels on threads started per call
(:func:`sofx.kernels.threads.started_threads`), one more than the executor's own; the other speculative
steps, which run beside backward, and the thread executor's actions (``step()`` helps with those) do not.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from test_offload_support import SharedMLP, mlp_batch, mlp_loss, one_torch_thread  # noqa: F401

import sofx.offload
from sofx.kernels.threads import native_thread_request
from sofx.offload.block_ops import BlockOp
from sofx.offload.block_runner import _threads_for


def test_an_operation_adds_threads_up_to_the_machines_cores(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with _threads_for(BlockOp(0, "commit_all", extra_threads=1)):
        assert native_thread_request() == -2
    with _threads_for(BlockOp(0, "commit_all", extra_threads=3)):
        assert native_thread_request() == -2  # not more than the cores
    with _threads_for(BlockOp(0, "commit_all")):
        assert native_thread_request() == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # torch has every core already: nothing to add
    with _threads_for(BlockOp(0, "commit_all", extra_threads=1)):
        assert native_thread_request() == 2


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_the_last_block_of_backward_is_stepped_on_the_training_threads_core_too(executor, monkeypatch):
    if torch.get_num_threads() + 1 > (os.cpu_count() or 1):
        pytest.skip("one core: nothing to add")
    runner = sys.modules["sofx.offload.block_runner"]
    real = runner.speculative_block_step
    seen = {}

    def spy(*args, **kwargs):
        seen.setdefault("requests", []).append(native_thread_request())
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "speculative_block_step", spy)
    torch.manual_seed(0)
    model = SharedMLP()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    with opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        report = opt.step()
    requests = seen["requests"]
    assert report.speculated == len(requests) >= 2
    own = torch.get_num_threads()
    assert requests[:-1] == [own] * (len(requests) - 1)  # beside backward: torch's threads
    assert requests[-1] == -(own + 1)  # the last block: started threads, one more


def test_a_worker_process_carries_out_step_actions_with_one_more_thread(monkeypatch):
    """The operations sent to the worker process say so (the worker runs them as the runner test above);
    the thread executor's actions do not (step() helps with them instead)."""
    sent = {"process": [], "thread": []}
    for executor in sent:
        torch.manual_seed(0)
        model = SharedMLP()
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100,
                                            speculate=False)
        submit = opt.engine.executor.submit
        monkeypatch.setattr(opt.engine.executor, "submit",
                            lambda op, submit=submit, out=sent[executor]: (out.append(op), submit(op))[1])
        with opt:
            opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
            opt.step()
    applies = {ex: [op.extra_threads for op in ops if op.kind == "apply"] for ex, ops in sent.items()}
    assert applies["process"] and set(applies["process"]) == {1}
    assert applies["thread"] and set(applies["thread"]) == {0}

