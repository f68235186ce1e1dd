"""Publishing without a copy (``swap_params``) and the decisions taken in the executor.

With ``swap_params=True`` (the default for CPU models) a parameter's storage
alternates between two buffers that the executor fills during backward;
``step()`` points the parameter at the new one. These tests check that this
is invisible: the same bits as copying, the model unchanged until ``step()``,
in-place-update semantics for autograd (version counter), parameters that
cannot be swapped are copied, the process executor's shared buffers, and
state_dict round trips. They also check the engine's shortcut for
eligibility (Adam told the gradients are finite once their sum of squares is).
"""

from __future__ import annotations

import copy
import threading
import time
import weakref

import pytest
import torch
from test_offload_support import SharedMLP, mlp_batch, mlp_loss, one_torch_thread  # noqa: F401 (autouse fixture)
from torch import nn

import sofx.offload
from sofx.adam import Adam, AdamHParams, AdamState
from sofx.errors import LeafError
from sofx.speculate import Eligibility, block_eligibility
from sofx.offload.block_runner import combined_eligibility, uses_flat_layout
from sofx.offload.blocks import allocate_block_tensors, plan_blocks
from sofx.offload.arena import LocalArena


def _run(model: nn.Module, steps: int = 8, **kw) -> list[sofx.offload.EngineStepReport]:
    gen = torch.Generator().manual_seed(1)
    reports = []
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, max_grad_norm=10.0, block_numel=100,
                                       **kw) as opt:
        for _ in range(steps):
            opt.zero_grad()
            opt.backward(mlp_loss(model, mlp_batch(gen)))
            reports.append(opt.step())
    return reports


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_swapping_gives_the_bits_of_copying(executor: str) -> None:
    torch.manual_seed(0)
    a = SharedMLP()
    b = copy.deepcopy(a)
    ra = _run(a, executor=executor)
    _run(b, executor=executor, swap_params=False)
    assert sum(r.speculated for r in ra) > 0
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_the_kernels_write_the_publish_buffers_in_the_steps_pass(executor: str, monkeypatch) -> None:
    """Blocks stepped one leaf per parameter (here: borrowed gradients, as those of large parameters are;
    ``BORROW_MIN_NUMEL``) are published by the Adam call itself (``param_copies``): the runner's copy after
    the step never runs; the bits are those of copying."""
    import sofx.offload.engine
    from sofx.offload.block_runner import BlockRunner

    monkeypatch.setattr(sofx.offload.engine, "BORROW_MIN_NUMEL", 0)
    copies_after = []
    monkeypatch.setattr(BlockRunner, "_publish", lambda self, op: copies_after.append(op.block))
    torch.manual_seed(0)
    a = SharedMLP()
    b = copy.deepcopy(a)
    reports = _run(a, executor=executor)
    assert sum(r.speculated for r in reports) > 0 and copies_after == []
    monkeypatch.undo()  # (b: gradients copied, each block one flat leaf, published by the runner's copy)
    _run(b, executor=executor, swap_params=False)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_gradients_of_small_parameters_are_copied_and_large_ones_borrowed(executor: str, monkeypatch) -> None:
    """A block of small parameters is stepped as one flat leaf (its gradients copied into the buffer: one Adam
    leaf's host work instead of one per parameter); a block of large ones borrows autograd's gradients (no
    copy) and is stepped one leaf per parameter. The trajectories are the same bits either way."""
    import sofx.offload.engine

    leaves = []
    real = Adam.update
    monkeypatch.setattr(Adam, "update",
                        lambda self, params, *a, **k: leaves.append(len(sofx.tree.flatten(params)[0]))
                        or real(self, params, *a, **k))

    def run(width: int, borrow_all: bool = False) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
        leaves.clear()
        with monkeypatch.context() as m:
            if borrow_all:
                m.setattr(sofx.offload.engine, "BORROW_MIN_NUMEL", 0)
            with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor,
                                               block_numel=width * width + width) as opt:
                for _ in range(3):
                    opt.zero_grad()
                    opt.backward(model(torch.ones(4, width)).square().mean())
                    opt.step()
        return [p.detach().clone() for p in model.parameters()]

    small = run(16)
    assert leaves and set(leaves) == {1}, leaves
    assert all(torch.equal(a, b) for a, b in zip(small, run(16, borrow_all=True)))
    assert set(leaves) == {2}, leaves
    run(384)  # 147456 + 384 elements per block: borrowed
    assert leaves and set(leaves) == {2}, leaves


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("width", [16, 384])  # copied, borrowed (in-process executors) gradients
def test_backward_with_create_graph_steps_as_torch_does(executor: str, width: int) -> None:
    """``backward(create_graph=True)`` hands the hooks gradients that require grad (a gradient penalty's
    loss): the engine steps their values as ``torch.optim.AdamW`` does and records nothing for autograd (its
    buffers and masters never require grad)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
    ref = copy.deepcopy(model)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4, width)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor,
                                       block_numel=width * width + width) as opt:
        for _ in range(3):
            opt.zero_grad()
            opt.backward(model(x).square().mean(), create_graph=True)
            ropt.zero_grad()
            ref(x).square().mean().backward(create_graph=True)
            assert all(p.grad.requires_grad for p in ref.parameters())
            opt.step()
            ropt.step()
            for t in opt.engine.tensors.values():
                assert not any(u.requires_grad for u in (t.master, t.exp_avg, t.exp_avg_sq, t.grad))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert not p.requires_grad or p.grad_fn is None
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_published_block_of_a_few_large_parameters_is_stepped_per_parameter() -> None:
    """So that each parameter's kernel writes its publish buffer; a block of many or small parameters stays
    one flat leaf (one kernel call, copied after)."""
    from sofx.offload.block_runner import MAX_LEAVES_FOR_FUSED_PUBLISH as most
    from sofx.offload.block_runner import MIN_LEAF_NUMEL_FOR_FUSED_PUBLISH as least

    def block(numels):
        (layout,) = plan_blocks([[torch.zeros(n) for n in numels]], sum(numels))
        return allocate_block_tensors(layout, LocalArena("cpu").allocate, torch.float32)

    large, small, many = block([least, least + 8]), block([least, 8]), block([least] * (most + 1))
    assert not uses_flat_layout(large, None, publish=(0, 1))
    assert uses_flat_layout(large, None) and uses_flat_layout(large, None, publish=None)
    assert uses_flat_layout(small, None, publish=(1, 1))  # ~16K elements per parameter on average
    assert uses_flat_layout(many, None, publish=(0,) * (most + 1))
    assert not uses_flat_layout(large, (True, False)) and not uses_flat_layout(large, None, borrowed=True)


def test_parameters_alternate_between_two_buffers_and_keep_their_values_until_step() -> None:
    torch.manual_seed(0)
    model = SharedMLP()
    w = model.inp.weight
    original = w.data_ptr()
    gen = torch.Generator().manual_seed(0)
    ptrs = []
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread", block_numel=100) as opt:
        for _ in range(4):
            opt.zero_grad()
            before = w.detach().clone()
            opt.backward(mlp_loss(model, mlp_batch(gen)))
            opt.engine.wait()  # every speculative step is done ...
            assert torch.equal(w, before)  # ... and the model still has the old values
            report = opt.step()
            assert report.speculated == report.committed == report.blocks
            assert not torch.equal(w, before)
            assert torch.equal(w.detach(), opt.state[w]["master"])
            ptrs.append(w.data_ptr())
    assert ptrs[1] == original and ptrs[0] == ptrs[2] != original and ptrs[3] == original
    # close() leaves the model with valid parameters
    assert torch.isfinite(mlp_loss(model, mlp_batch(gen)))


def test_a_graph_saved_before_step_sees_the_update_as_in_place() -> None:
    torch.manual_seed(0)
    model = SharedMLP()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread", block_numel=100) as opt:
        loss = mlp_loss(model, mlp_batch(gen))
        opt.backward(loss, retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_parameters_that_are_views_or_share_storage_are_copied() -> None:
    torch.manual_seed(0)
    flat = torch.randn(40)
    view = nn.Parameter(flat[:20].view(4, 5))  # a view of a larger storage
    alone = nn.Parameter(torch.randn(6))
    base = copy.deepcopy([view, alone])
    x = torch.randn(3, 5)

    def loss_of(v: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return (x @ v.t()).pow(2).sum() + a.pow(2).sum()

    opt = sofx.offload.SpeculativeAdamW([view, alone], lr=1e-2, executor="thread", block_numel=100)
    ref = torch.optim.AdamW(base, lr=1e-2, foreach=False)
    ptr = view.data_ptr()
    with opt:
        assert opt.engine._swappable_params() == {1}
        for _ in range(3):
            opt.zero_grad()
            ref.zero_grad()
            opt.backward(loss_of(view, alone))
            loss_of(*base).backward()
            opt.step()
            ref.step()
    assert view.data_ptr() == ptr and torch.equal(flat[:20].view(4, 5), view.detach())  # still a view of flat
    torch.testing.assert_close(view.detach(), base[0].detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(alone.detach(), base[1].detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_a_memory_format_changed_after_construction_is_kept_as_torch_keeps_it(executor: str) -> None:
    """``model.to(memory_format=torch.channels_last)`` after the optimizer exists (a ``p.data =`` of other
    strides): the parameters keep the new layout through the steps, as torch.optim's in-place update keeps it,
    and so the forward runs torch's kernels (the swap pointed them back at their contiguous buffers)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with opt:
        for step in range(4):
            if step == 1:
                model.to(memory_format=torch.channels_last)
                ref.to(memory_format=torch.channels_last)
            x = torch.randn(2, 3, 7, 7, generator=gen)
            opt.zero_grad()
            ropt.zero_grad()
            opt.backward(model(x).square().mean())
            ref(x).square().mean().backward()
            opt.step()
            ropt.step()
            for p, q in zip(model.parameters(), ref.parameters()):
                assert p.stride() == q.stride(), f"step {step}: strides {p.stride()}, torch's {q.stride()}"
                assert torch.equal(p.detach(), q.detach()), f"step {step}"


def test_process_executor_parameters_live_in_shared_memory_until_close() -> None:
    torch.manual_seed(0)
    model = SharedMLP()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100) as opt:
        assert opt.executor == "process"
        assert model.inp.weight.is_shared()
        _ = opt  # trained by the bitwise test above
    assert not model.inp.weight.is_shared()
    assert torch.isfinite(model.inp.weight).all()


def test_process_executor_without_room_for_the_buffers_copies() -> None:
    torch.manual_seed(0)
    model = SharedMLP()
    n = sum(p.numel() for p in model.parameters())
    state_only = sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=100)
    state_bytes = sum(t.nbytes() for t in state_only.engine.tensors.values())
    state_only.close()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=100,
                                       shm_limit_bytes=state_bytes + 4 * n) as opt:  # not 2 buffers of 4 bytes
        assert opt.executor == "process" and not model.inp.weight.is_shared()
        assert opt.engine._pub == {}


def test_state_dict_round_trip_with_swapped_parameters() -> None:
    torch.manual_seed(0)
    model = SharedMLP()
    gen = torch.Generator().manual_seed(0)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread", block_numel=100) as opt:
        for _ in range(3):
            opt.zero_grad()
            opt.backward(mlp_loss(model, mlp_batch(gen)))
            opt.step()
        saved = copy.deepcopy(opt.state_dict())
        values = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            opt.zero_grad()
            opt.backward(mlp_loss(model, mlp_batch(gen)))
            opt.step()
        opt.load_state_dict(saved)
        for p, v in zip(model.parameters(), values):
            assert torch.equal(p.detach(), v)
        opt.zero_grad()
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        assert opt.step().speculated > 0


@pytest.mark.parametrize("case", ["plain", "beta1_zero", "bf16_state", "lr_wd_one", "missing"])
def test_eligibility_told_the_gradients_are_finite_equals_eligibility_that_reads_them(case: str) -> None:
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7)]
    state_dtype = torch.bfloat16 if case == "bf16_state" else torch.float32
    adam = Adam(AdamHParams(1e-3, 0.9, 0.999, 1e-8, 0.0), decoupled=True, state_dtype=state_dtype)
    (layout,) = plan_blocks([params], 100)
    t = allocate_block_tensors(layout, LocalArena("cpu").allocate, state_dtype)
    t.master.normal_()
    t.exp_avg.normal_()
    t.exp_avg_sq.uniform_(0, 1)
    t.counts.fill_(3)
    hp = {"beta1_zero": AdamHParams(1e-3, 0.0, 0.999, 1e-8, 0.1), "lr_wd_one": AdamHParams(0.5, 0.9, 0.999, 1e-8, 2.0)
          }.get(case, AdamHParams(1e-3, 0.9, 0.999, 1e-8, 0.1))
    present = (True, False) if case == "missing" else (True, True)
    seen: set = set()
    for borrowed in (False, True):
        grads = (torch.randn(15), torch.randn(7)) if borrowed else None
        if grads is None:
            t.grad.normal_()
        flat = uses_flat_layout(t, present, grads is not None)
        want = combined_eligibility(adam, t, layout, flat, present, hp, 0.5, grads)
        got = combined_eligibility(adam, t, layout, flat, present, hp, 0.5, grads, finite=True)
        assert got == want
        seen.add((want.strategy, want.snapshot_bytes > 0))
    expected = {"plain": ("algebraic", False), "missing": ("algebraic", False), "beta1_zero": ("snapshot", True),
                "bf16_state": ("snapshot", True), "lr_wd_one": ("param_snapshot", True)}[case]
    assert seen == {expected}


def test_a_block_without_any_gradient_is_ineligible_as_the_speculation_layer_says() -> None:
    """A tree block none of whose parameters has a gradient came back from combined_eligibility eligible
    "algebraic", where sofx.speculation.block_eligibility says such a block ineligible ("no gradient"):
    speculative_block_step refuses a step that would take nothing, and validation steps no such block. The two
    agree."""
    params = [torch.randn(5, 3), torch.randn(7)]
    adam = Adam(AdamHParams(1e-3, 0.9, 0.999, 1e-8, 0.0), decoupled=True)
    (layout,) = plan_blocks([params], 100)
    t = allocate_block_tensors(layout, LocalArena("cpu").allocate, torch.float32)
    hp = AdamHParams(1e-3, 0.9, 0.999, 1e-8, 0.1)
    for grads in (None, (torch.randn(15), torch.randn(7))):
        got = combined_eligibility(adam, t, layout, False, (False, False), hp, 0.5, grads)
        want = block_eligibility(adam, [t.master[:15], t.master[15:]], [None, None],
                                 AdamState([t.counts[0], t.counts[1]], [t.exp_avg[:15], t.exp_avg[15:]],
                                           [t.exp_avg_sq[:15], t.exp_avg_sq[15:]]), hp, 0.5)
        assert got == want == Eligibility(False, None, "no gradient", 0)


def test_step_helps_the_worker_with_queued_speculative_steps() -> None:
    torch.manual_seed(0)
    model = SharedMLP()
    ref = copy.deepcopy(model)
    batch = mlp_batch(torch.Generator().manual_seed(0))
    where: dict[int, bool] = {}
    gate = threading.Event()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread", block_numel=100) as opt:
        runner = opt.engine.executor.runner
        run = runner.run

        def gated_run(op):
            result = run(op)
            if op.kind == "ready":
                on_main = threading.current_thread() is threading.main_thread()
                where[op.block] = on_main
                if not on_main:
                    gate.wait(30)  # the worker stays busy with the first block ...
                elif op.block == 0:
                    gate.set()  # ... until step() has run the others
            return result

        runner.run = gated_run
        opt.backward(mlp_loss(model, batch))
        deadline = time.monotonic() + 30
        while False not in where.values() and time.monotonic() < deadline:
            time.sleep(0.001)  # the worker has taken the first ready block (backward may outrun its start)
        report = opt.step()
    assert list(where.values()).count(False) == 1 and where[0] is True
    assert report.speculated == report.committed == report.blocks
    with sofx.offload.SpeculativeAdamW(ref.parameters(), lr=1e-2, executor="inline", block_numel=100) as ropt:
        ropt.backward(mlp_loss(ref, batch))
        ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("speculate", [False, True])
def test_step_runs_its_block_actions_on_both_threads(speculate: bool) -> None:
    """step()'s actions ("apply": a late step of every block without speculation; an undo+redo of every
    speculated block when the learning rate changed after backward) are shared by the worker and the waiting
    main thread, one block each at a time; the results are the inline executor's bit for bit."""
    torch.manual_seed(0)
    model = SharedMLP()
    ref = copy.deepcopy(model)
    batch = mlp_batch(torch.Generator().manual_seed(0))
    kwargs = dict(lr=1e-2, block_numel=100, speculate=speculate)
    ran: list[tuple[int, bool]] = []
    running: set[int] = set()
    overlapped = []
    worker_in, main_done = threading.Event(), threading.Event()
    lock = threading.Lock()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="thread", **kwargs) as opt:
        runner = opt.engine.executor.runner
        run = runner.run

        def gated_run(op):
            if op.kind != "apply":
                return run(op)
            on_main = threading.current_thread() is threading.main_thread()
            if on_main:
                worker_in.wait(30)  # the worker holds a block of its own meanwhile ...
            with lock:
                assert op.block not in running  # one operation per block at a time
                overlapped.append(bool(running))
                running.add(op.block)
            if not on_main:
                worker_in.set()
            result = run(op)
            if on_main:
                main_done.set()
            elif not main_done.is_set():
                main_done.wait(30)  # ... until the main thread has run one beside it
            with lock:
                running.discard(op.block)
                ran.append((op.block, on_main))
            return result

        runner.run = gated_run
        opt.backward(mlp_loss(model, batch))
        opt.param_groups[0]["lr"] *= 0.5
        report = opt.step()
    assert sorted(b for b, _ in ran) == list(range(report.blocks))
    assert {on_main for _, on_main in ran} == {True, False} and any(overlapped)
    assert (report.redone if speculate else report.stepped_late) == report.blocks
    with sofx.offload.SpeculativeAdamW(ref.parameters(), executor="inline", **kwargs) as ropt:
        ropt.backward(mlp_loss(ref, batch))
        ropt.param_groups[0]["lr"] *= 0.5
        ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_thread_executor_runs_apply_operations_of_one_block_in_order() -> None:
    """Two "apply" operations of one block never run at the same time (the second waits for the first,
    whoever runs it), while one of another block may run beside them; "commit_all" waits for all.

    The worker is held in an operation of a third block until the helping main thread has taken block 0's first
    (where the worker took that one first, the helper found block 0's second at the head, stopped helping, and block
    1's ran after it: on a loaded machine, the worker could start between two submissions); block 0's second then
    waits for block 1's to start beside it (a 0.05 s sleep each: a worker that woke late missed that window)."""
    from sofx.offload.block_ops import BlockOp, OpResult
    from sofx.offload.thread_executor import ThreadExecutor

    spans: list[tuple[int, int, float, float]] = []  # (seq, block, start, end)
    held, first_taken, beside = threading.Event(), threading.Event(), threading.Event()
    waited: list[bool] = []

    class GatedRunner:
        def run(self, op):
            start = time.monotonic()
            if op.seq == 10:  # the worker's, on block 2: held until the helper has taken block 0's first
                held.set()
                waited.append(first_taken.wait(30))
            elif op.seq == 0:
                first_taken.set()
                time.sleep(0.05)  # (block 0's second, run beside it, would start in here)
            elif op.seq == 1:
                waited.append(beside.wait(30))  # until block 1's has started beside it
            elif op.seq == 2:
                beside.set()
            spans.append((op.seq, op.block, start, time.monotonic()))
            return OpResult(op.seq, op.kind, op.block)

    executor = ThreadExecutor(GatedRunner())
    try:
        executor.submit(BlockOp(10, "apply", 2, payload="action"))
        assert held.wait(30), "the worker runs block 2's operation"
        for seq, block in enumerate((0, 0, 1)):
            executor.submit(BlockOp(seq, "apply", block, payload="action"))
        executor.submit(BlockOp(3, "commit_all"))
        executor.wait(30, help=True)
    finally:
        held.set()
        first_taken.set()
        beside.set()
        executor.close()
    assert waited == [True, True]
    by_seq = {seq: (block, start, end) for seq, block, start, end in spans}
    assert sorted(by_seq) == [0, 1, 2, 3, 10]
    assert by_seq[1][1] >= by_seq[0][2]  # block 0's second action after its first
    assert by_seq[3][1] >= max(by_seq[k][2] for k in (0, 1, 2, 10))  # commit_all after every action
    assert by_seq[2][1] < max(by_seq[0][2], by_seq[1][2])  # block 1's beside one of block 0's


def test_thread_executor_starts_no_ready_operation_beside_commit_all() -> None:
    """A "ready" operation (the next step's speculative step) may start beside anything but "commit_all" (the
    last step's end, queued and not waited for): a helper that took it while the worker was still clearing the
    kept records would have its new record dropped by the clear."""
    from sofx.offload.block_ops import BlockOp, OpResult
    from sofx.offload.thread_executor import ThreadExecutor

    spans: dict[str, tuple[float, float]] = {}

    class SlowCommit:
        def run(self, op):
            start = time.monotonic()
            time.sleep(0.2 if op.kind == "commit_all" else 0.01)
            spans[op.kind] = (start, time.monotonic())
            return OpResult(op.seq, op.kind, op.block)

    executor = ThreadExecutor(SlowCommit())
    try:
        executor.submit(BlockOp(0, "commit_all"))
        while not executor._active:  # the worker has taken it
            time.sleep(0.001)
        executor.submit(BlockOp(1, "ready", 0, payload=lambda: None))
        executor.wait(30, help=True)  # the helper must not take the ready operation meanwhile
    finally:
        executor.close()
    assert spans["ready"][0] >= spans["commit_all"][1]


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_borrowed_gradients_are_released_after_step(executor: str) -> None:
    torch.manual_seed(0)
    model = SharedMLP()
    refs = []
    model.inp.weight.register_post_accumulate_grad_hook(lambda p: refs.append(weakref.ref(p.grad)))
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100) as opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
        opt.step()
        opt.engine.wait()  # the thread executor's worker drops them
        assert len(refs) == 1 and refs[0]() is None
        opt.zero_grad()  # nothing pending: returns at once
        assert opt.engine.executor.pending == 0


def _adamw_from(opt, params: list[torch.Tensor], lr: float) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    """torch's AdamW started from ``opt``'s state: fp32 copies of the masters, the moments and step counts."""
    ref = [opt.state[p]["master"].clone().requires_grad_(p.requires_grad) for p in params]
    ropt = torch.optim.AdamW(ref, lr=lr, foreach=False)
    for p, r in zip(params, ref):
        state = opt.state[p]
        if int(state["step"]) > 0:
            ropt.state[r] = {"step": torch.tensor(float(state["step"])), "exp_avg": state["exp_avg"].clone(),
                             "exp_avg_sq": state["exp_avg_sq"].clone()}
    return ref, ropt


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_device_blocks", [0, 1])
def test_a_master_assigned_between_steps_is_the_models_parameter_at_once(executor: str, dtype: torch.dtype,
                                                                         n_device_blocks: int) -> None:
    """``opt.state[p]["master"] = x`` gives the model's ``p`` the new master (rounded to ``p``'s dtype) at once, as
    ``load_state_dict`` gives it the loaded masters: a forward pass before the next step used the old weights while
    that step started from ``x``. The other parameters keep their values; the next step equals torch's AdamW started
    from those weights (gradients of the weights the model shows)."""
    torch.manual_seed(0)
    model = SharedMLP().to(dtype)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = mlp_batch(gen)
        return x.to(dtype), y.to(dtype)

    with sofx.offload.SpeculativeAdamW(params, lr=1e-2, executor=executor, block_numel=100,
                                       n_device_blocks=n_device_blocks) as opt:
        for _ in range(3):  # moments, and publish buffers swapped an odd number of times
            opt.zero_grad()
            opt.backward(mlp_loss(model, batch()))
            opt.step()
        for p in (model.mid.weight, model.inp.weight):  # (a CPU block; the device block with n_device_blocks=1)
            before = [q.detach().clone() for q in params]
            new = torch.randn(tuple(p.shape), generator=gen) * 0.3
            opt.state[p]["master"] = new
            assert torch.equal(opt.state[p]["master"], new)
            assert torch.equal(p.detach(), new.to(dtype)), "the model shows the assigned master"
            assert all(torch.equal(q.detach(), b) for q, b in zip(params, before) if q is not p)

        weights = copy.deepcopy(model)  # what the model shows, stepped by nothing
        ref, ropt = _adamw_from(opt, params, lr=1e-2)
        data = batch()
        grads = torch.autograd.grad(mlp_loss(weights, data), [q for q in weights.parameters() if q.requires_grad])
        opt.zero_grad()
        opt.backward(mlp_loss(model, data))
        opt.step()
        for r, g in zip([r for r in ref if r.requires_grad], grads):
            r.grad = g.float()
        ropt.step()
        for p, r in zip(params, ref):
            master = opt.state[p]["master"]
            assert (master - r.detach()).abs().max() <= 1e-6 * max(r.abs().max().item(), 1e-3)
            assert torch.equal(p.detach(), master.to(dtype))


def test_a_master_assigned_after_the_parameter_changed_kind_leaves_the_next_step_refused() -> None:
    """A parameter given storage of another kind (``p.data = t``) is refused at the next step, naming it (its masters
    and buffers are of the old kind); assigning its master in between writes the new values into the parameter
    but must not hide the change."""
    torch.manual_seed(0)
    model = SharedMLP()
    gen = torch.Generator().manual_seed(1)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100) as opt:
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.step()
        p = model.mid.weight  # parameter 2
        p.data = p.detach().double()
        opt.state[p]["master"] = torch.ones(tuple(p.shape))
        assert torch.equal(p.detach(), torch.ones(tuple(p.shape), dtype=torch.float64))
        with pytest.raises(LeafError, match=r"parameter 2 is now \(12, 12\) torch.float64"):
            opt.step()  # (before it looks for gradients)
