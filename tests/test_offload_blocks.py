"""Block packing, arrival bookkeeping and shared-memory tensors (no training)."""

from __future__ import annotations

import errno
import os
import resource

import pytest
import torch

from sofx.errors import LeafError, UnsupportedError
from sofx.offload.arena import COLOUR_BYTES, MIN_COLOURED_BYTES, PAGE_COLOURS, LocalArena
from sofx.offload.arrivals import ArrivalTracker
from sofx.offload.backward_passes import BackwardPasses
from sofx.offload.blocks import BlockLayout, allocate_block_tensors, block_nbytes, check_params, plan_blocks
from sofx.offload import shared_memory
from sofx.offload.shared_memory import SharedMemoryArena, SharedTensorSpec, open_shared_tensor, shm_budget


def _params(*sizes: int) -> list[torch.Tensor]:
    return [torch.nn.Parameter(torch.randn(n)) for n in sizes]


def test_plan_blocks_packs_in_order_never_spans_groups_or_splits_parameters() -> None:
    g0, g1 = _params(3, 4, 10, 2), _params(1, 1)
    layouts = plan_blocks([g0, g1], block_numel=8, n_device_blocks=1)
    assert [b.numels for b in layouts] == [(3, 4), (10,), (2,), (1, 1)]
    assert [b.group for b in layouts] == [0, 0, 0, 1]
    assert [b.param_indices for b in layouts] == [(0, 1), (2,), (3,), (4, 5)]
    assert [b.on_device for b in layouts] == [True, False, False, False]
    assert layouts[0].offsets == (0, 3)
    assert all(BlockLayout.from_json(b.to_json()) == b for b in layouts)


def test_plan_blocks_errors() -> None:
    with pytest.raises(UnsupportedError, match="block_numel"):
        plan_blocks([_params(2)], block_numel=0)
    with pytest.raises(UnsupportedError, match="n_device_blocks=3 but the parameters make only 1 blocks"):
        plan_blocks([_params(2)], block_numel=8, n_device_blocks=3)


def test_check_params_names_the_offending_parameter() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(LeafError, match=r"param_groups\[1\]\['params'\]\[0\]: the same parameter is also "
                                        r"param_groups\[0\]\['params'\]\[0\]"):
        check_params([[p], [p]])
    with pytest.raises(LeafError, match=r"param_groups\[0\]\['params'\]\[1\]: expected a float.*int64"):
        check_params([[p, torch.zeros(2, dtype=torch.int64)]])
    with pytest.raises(LeafError, match=r"param_groups\[0\]\['params'\]\[0\]: float64 parameters are not supported"):
        check_params([[torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]])
    with pytest.raises(LeafError, match="empty parameter list"):
        check_params([[]])


def test_arrivals_readiness_accumulation_and_late_gradients() -> None:
    layouts = plan_blocks([_params(2, 2, 2)], block_numel=4)  # blocks: (0, 1), (2,)
    tracker = ArrivalTracker(layouts, accumulation_steps=2)
    tracker.reset([True, True, False])  # parameter 2 is frozen
    assert not tracker.started
    a = tracker.arrive(1)
    assert (a.block, a.slot, a.first, a.ready, a.late) == (0, 1, True, False, False)
    assert not tracker.arrive(0).ready
    assert not tracker.arrive(1).ready  # 2nd arrival of param 1: final, but param 0 is not
    assert tracker.arrive(0).ready  # now the block is ready
    late = tracker.arrive(0)
    assert late.late and not late.first
    assert tracker.present(1) == (False,) and not tracker.has_gradient(1)
    tracker.reset([True, True, True])
    assert tracker.present(0) == (False, False) and not tracker.started
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        ArrivalTracker(layouts, accumulation_steps=0)


def test_arrivals_in_the_last_backward_call_are_final_whatever_came_before() -> None:
    """With the backward call of each arrival known (``call``), an arrival in the N-th call is final however many
    the parameter had before (none, or a micro-step left out); a parameter with none in the N-th call is not, and
    its block is not ready; a second arrival in the N-th call before the block is ready is summed in (not late,
    counted final once); after it is ready, late; an arrival of an (N+1)-th call to a ready block is late."""
    layouts = plan_blocks([_params(2, 2, 2, 2)], block_numel=4)  # blocks: (0, 1), (2, 3)
    tracker = ArrivalTracker(layouts, accumulation_steps=3)
    tracker.reset([True] * 4)
    assert not tracker.arrive(0, call=1).final
    assert not tracker.arrive(2, call=2).final  # param 2: no gradient in the 3rd call
    a = tracker.arrive(0, call=3)
    assert a.final and not a.ready and not a.late and not a.first
    again = tracker.arrive(0, call=3)  # (a reentrant checkpoint's second accumulation, param 1 still to come)
    assert not again.final and not again.ready and not again.late
    b = tracker.arrive(1, call=3)  # its first gradient, in the last call
    assert b.final and b.ready and b.first
    assert tracker.arrive(1, call=3).late and tracker.arrive(0, call=4).late
    assert not tracker.arrive(3, call=3).ready  # param 2 has no final gradient: block 1 is never ready
    assert tracker.arrivals == [4, 2, 1, 1] and tracker.ready == [True, False]
    tracker.reset([True] * 4)
    assert [tracker.arrive(0).final, tracker.arrive(0).final, tracker.arrive(0).final] == [False, False, True]


def _counted_calls(run, seen: list | None = None) -> int:
    """The backward calls :class:`BackwardPasses` counts while ``run(lin)`` runs, its note taken in a
    post-accumulate-grad hook of each parameter of ``lin`` (a ``Linear(3, 3)``); ``seen`` gets the call each
    gradient comes from (:meth:`BackwardPasses.call`, asked before the note, as the engine asks it)."""
    torch.manual_seed(0)
    lin, passes = torch.nn.Linear(3, 3), BackwardPasses()

    def hook(p: torch.Tensor) -> None:
        if seen is not None:
            seen.append(passes.call())
        passes.note()

    for p in lin.parameters():
        p.register_post_accumulate_grad_hook(hook)
    run(lin)
    return passes.count


def _ckpt(f, x):
    return torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True)


def _raising(g: torch.Tensor) -> torch.Tensor:
    raise ValueError("a backward that raises midway")


def _after_a_raise(lin: torch.nn.Linear, x: torch.Tensor) -> None:
    twice = x * 2
    twice.register_hook(_raising)
    with pytest.raises(ValueError, match="midway"):
        (lin(x).sum() + twice.sum()).backward()  # (lin's gradients are accumulated first: a call that gave some)
    lin(x).sum().backward()


_X = torch.randn(2, 3, requires_grad=True)
_BACKWARD_CALLS = {
    "plain": (lambda lin: lin(lin(_X)).sum().backward(), 1),
    "all checkpointed": (lambda lin: _ckpt(lambda t: lin(lin(t)), _X).sum().backward(), 1),
    "inside and outside": (lambda lin: lin(_ckpt(lin, _X)).sum().backward(), 1),
    "two regions": (lambda lin: _ckpt(lin, torch.tanh(_ckpt(lin, _X))).sum().backward(), 1),
    "nested regions": (lambda lin: _ckpt(lambda t: lin(_ckpt(lin, t)), _X).sum().backward(), 1),
    "retained graph twice": (lambda lin: [y.backward(retain_graph=True) or y.backward()
                                          for y in [_ckpt(lin, _X).sum()]], 2),
    "two calls": (lambda lin: [_ckpt(lin, _X).sum().backward() for _ in range(2)], 2),
    "autograd.grad": (lambda lin: torch.autograd.grad(lin(_X).sum(), list(lin.parameters())), 0),
    "after a raise": (lambda lin: _after_a_raise(lin, _X), 2),
}


@pytest.mark.parametrize("name", list(_BACKWARD_CALLS))
def test_backward_passes_count_backward_calls_and_reentrant_checkpoints_as_one(name: str) -> None:
    """Each backward call that gave a gradient counts once: the backwards reentrant checkpointing runs inside it
    (one region, two, nested, a parameter used inside and outside) are the same call; two backwards of a retained
    graph are two; ``torch.autograd.grad`` (no gradient accumulated, no hook) none; a backward that raised after
    giving a gradient one."""
    run, calls = _BACKWARD_CALLS[name]
    assert _counted_calls(run) == calls


@pytest.mark.parametrize("name", list(_BACKWARD_CALLS))
def test_backward_passes_number_each_gradient_by_its_backward_call(name: str) -> None:
    """:meth:`BackwardPasses.call` numbers the gradients of the first backward call 1, of the second 2, as each
    arrives: a backward that reentrant checkpointing runs inside a call is that call from its first gradient on
    (one region, two, nested, a parameter used inside and outside: it begins while the enclosing one is still
    running), also where the enclosing call gave no gradient before it; a backward that raised ended its call."""
    run, calls = _BACKWARD_CALLS[name]
    seen: list = []
    _counted_calls(run, seen)
    assert seen == sorted(seen) and set(seen) == set(range(1, calls + 1)), seen
    assert len(seen) >= 2 * calls


def test_backward_passes_call_is_unknown_outside_a_graph_task_and_after_an_untracked_gradient() -> None:
    """Outside any backward :meth:`BackwardPasses.call` is ``None`` (nothing to number a gradient by); so is it
    for the rest of the step once a gradient came from outside a graph task (the count is not reliable), until
    :meth:`~BackwardPasses.reset`."""
    passes = BackwardPasses()
    lin = torch.nn.Linear(3, 3)
    seen: list = []
    for p in lin.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(passes.call()) or passes.note())
    assert passes.call() is None and passes.last_call is None
    lin(_X).sum().backward()
    assert seen == [1, 1] and passes.last_call == 1
    passes.note()  # (outside a backward: untracked)
    assert passes.untracked and passes.last_call is None
    lin(_X).sum().backward()
    assert seen[2:] == [None, None]
    passes.reset()
    lin(_X).sum().backward()
    assert seen[4:] == [1, 1]


def _open_inodes() -> set[int]:
    """The inodes of the files this process holds open."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass
    return out


@pytest.mark.parametrize("made", ["unnamed", "created_and_unlinked"])
def test_shared_memory_arena_maps_the_same_bytes_and_never_names_a_file(made, tmp_path, monkeypatch) -> None:
    """The files never have a name in the directory (a process killed at any time leaves nothing there): made
    unnamed, or where the filesystem cannot (here: made to refuse O_TMPFILE) created and unlinked at once. They are
    held by descriptors until close(); the mappings stay valid after."""
    if made == "created_and_unlinked":
        real_open = os.open

        def no_tmpfile(path, flags, *args):
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "Operation not supported", path)
            return real_open(path, flags, *args)

        monkeypatch.setattr(shared_memory.os, "open", no_tmpfile)
    arena = SharedMemoryArena(str(tmp_path))
    layout = plan_blocks([_params(3, 5)], block_numel=100)[0]
    t = allocate_block_tensors(layout, arena.allocate, torch.bfloat16)
    assert t.exp_avg.dtype == torch.bfloat16 and t.master.dtype == torch.float32 and t.counts.dtype == torch.int64
    assert t.master.abs().sum() == 0
    t.master.copy_(torch.arange(8.0))
    again = open_shared_tensor(SharedTensorSpec.from_json(arena.specs[layout.tensor_name("master")].to_json()))
    assert torch.equal(again, torch.arange(8.0))
    assert os.listdir(tmp_path) == []
    assert len(arena.fds) == len(set(arena.inodes)) == 5 and set(arena.inodes) <= _open_inodes()
    assert not any(os.get_inheritable(fd) for fd in arena.fds), "only the worker inherits them (pass_fds)"
    arena.close()
    assert arena.fds == [] and not set(arena.inodes) & _open_inodes()
    assert torch.equal(t.master, torch.arange(8.0)), "mappings stay valid after the descriptors are closed"
    assert shm_budget(str(tmp_path), limit_bytes=10) == 10
    assert shm_budget(str(tmp_path / "missing")) == 0


def test_shared_memory_arena_raises_the_descriptor_soft_limit_it_needs(tmp_path) -> None:
    """A descriptor per tensor is held until the worker has mapped them all: past the soft limit (1024 by default
    on many systems; a large model has thousands of tensors) the arena raises it toward the hard limit instead of
    failing (which fell back to the thread executor)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip(f"the hard descriptor limit is {hard}")
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 16, hard))
    arena = SharedMemoryArena(str(tmp_path))
    try:
        tensors = [arena.allocate(f"t{k}", 4, torch.float32) for k in range(64)]
        assert len(arena.fds) == 64 and resource.getrlimit(resource.RLIMIT_NOFILE)[0] > used + 16
        assert all(t.abs().sum() == 0 for t in tensors)
    finally:
        arena.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_cpu_arenas_colour_the_page_offsets_of_large_tensors(tmp_path) -> None:
    """A block's four large tensors start at four distinct page offsets (small ones are not padded);
    the shared ones map to the same bytes in another mapping, and the budget covers the padding."""
    big = MIN_COLOURED_BYTES // 4 + 3  # float32 elements: just over the threshold
    layout = plan_blocks([_params(big)], block_numel=big)[0]
    shared = SharedMemoryArena(str(tmp_path))
    for allocate in (LocalArena("cpu").allocate, shared.allocate):
        t = allocate_block_tensors(layout, allocate, torch.float32)
        large = (t.master, t.exp_avg, t.exp_avg_sq, t.grad)
        skips = [x.storage_offset() * x.element_size() for x in large]
        assert sorted(skips) == [k * COLOUR_BYTES for k in range(PAGE_COLOURS)]
        assert t.counts.storage_offset() == 0
        for x in large:
            assert x.is_contiguous() and x.numel() == big and x.abs().sum() == 0
            assert x.untyped_storage().nbytes() <= (big * 4 + (PAGE_COLOURS - 1) * COLOUR_BYTES)
        if allocate == shared.allocate:
            assert len({x.data_ptr() % 4096 for x in large}) == PAGE_COLOURS  # mmap'd files start on a page
            t.exp_avg.copy_(torch.arange(float(big)))
            spec = SharedTensorSpec.from_json(shared.specs[layout.tensor_name("exp_avg")].to_json())
            assert spec.offset * 4 == skips[1]
            assert torch.equal(open_shared_tensor(spec), torch.arange(float(big)))
            used = sum(os.fstat(fd).st_size for fd in shared.fds)
            assert 0 < used <= block_nbytes(layout, torch.float32)
    shared.close()


def test_check_params_refuses_a_lazy_modules_uninitialized_parameter_naming_it() -> None:
    """A lazy module's parameter before its first forward (an UninitializedParameter) given to the offload
    optimizer raised torch's ValueError ('Attempted to use an uninitialized parameter in <method 'numel' ...>')
    from plan_blocks, naming no parameter: a LeafError naming it and what to do."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LazyLinear(3))
    with pytest.raises(LeafError, match=r"^param_groups\[0\]\['params'\]\[2\] is an uninitialized parameter \(a "
                                        r"lazy module's, before its first forward\).*run a forward pass first"):
        check_params([list(model.parameters())])


def test_check_params_refuses_a_parameter_without_dense_data_naming_it() -> None:
    """A sparse, nested or meta parameter given to the offload optimizer raised torch's bare errors from its
    constructor ('reshape is not implemented for sparse tensors', 'Internal error: NestedTensorImpl doesn't support
    sizes', 'Cannot copy out of meta tensor; no data!'), naming no parameter: the engine packs each parameter's
    dense data into flat blocks. A LeafError names the parameter and what it is."""
    import warnings

    with warnings.catch_warnings():  # (torch's warning that nested tensors are a prototype)
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    dense = torch.nn.Parameter(torch.zeros(2))
    for bad, what in ((torch.zeros(3, 3).to_sparse(), r"a tensor of layout torch\.sparse_coo"),
                      (nested, r"a nested tensor"), (torch.zeros(3, device="meta"), r"on the meta device")):
        with pytest.raises(LeafError, match=rf"^param_groups\[0\]\['params'\]\[1\]: .*{what}"):
            check_params([[dense, torch.nn.Parameter(bad)]])
