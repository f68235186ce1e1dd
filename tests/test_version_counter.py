"""What a kernel writes in place gets its version counter bumped, as torch's in-place operations do.

Autograd refuses a backward through a graph that saved a tensor written in place since ("one of the variables
needed for gradient computation has been modified by an inplace operation"): it knows of the write by the
tensor's version counter. The reference backend writes with torch operations, which bump it; the native CPU
kernels and the Triton kernels write raw memory, so they bump it themselves, once per call, for every tensor of
the caller's they write (donated ``p, m, v``, ``out``, ``p_copy``, a checked call's flags, a chunk list's kept
values), and leave what they only read alone. A donated step under ``torch.no_grad()`` on a parameter that a
live graph saved then makes its backward raise on every backend, as with ``torch.optim``'s AdamW, instead of
silently giving gradients of the new values.

The Triton backend runs under its interpreter (``TRITON_INTERPRET=1``), which must be set before the kernels are
decorated: as in tests/test_kernels_triton.py, the normal session runs this file again in a fresh process with
the variable set, where the tests run for the Triton backend alone.
"""

from __future__ import annotations


import pytest
import torch

import sofx
from sofx.errors import LeafError
from sofx.kernels import load_backend
from sofx.kernels.base import FINITE_CHUNK, AdamVariant, StepCall, UndoCall, UndoRedoCall

from helpers import (HAVE_TRITON, INTERPRETING_TRITON, block_inputs, block_scalars,
                     rerun_under_the_triton_interpreter)

BACKENDS = ["triton"] if INTERPRETING_TRITON else ["reference", "cpu", "cpu_fast"]
N = 40  # elements per leaf (small: the Triton interpreter runs every program in Python)
MODIFIED = "modified by an inplace operation"
VARIANT = AdamVariant(decoupled=True)

if not INTERPRETING_TRITON:

    @pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
    def test_the_triton_kernels_bump_versions_under_the_interpreter():
        rerun_under_the_triton_interpreter(__file__)


# ------------------------------------------------------------------ sofx.Adam: a graph that saved the parameter
def _stepped_twice(backend: str, gen: torch.Generator):
    """An optimizer, a parameter leaf requiring grad (donated: stepped in place, under no_grad) after two steps,
    the state and the second step's record. The second gradient is close to the first, so that its step is not
    too lossy to undo algebraically (tests/test_lossy_undo.py): the undo runs the kernel's inverse."""
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    w = torch.randn(N, generator=gen, requires_grad=True)
    g1 = torch.randn(N, generator=gen)
    with torch.no_grad():
        params = {"w": w}
        state = opt.init(params)
        params, state, _ = opt.update(params, {"w": g1}, state, donate=True)
        params, state, record = opt.update(params, {"w": g1 * 1.05}, state, donate=True)
    assert params["w"] is w
    return opt, params, state, record


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_donated_update_makes_a_backward_through_the_saved_parameter_raise(backend):
    gen = torch.Generator().manual_seed(1)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    w = torch.randn(N, generator=gen, requires_grad=True)
    with torch.no_grad():
        state = opt.init({"w": w})
    y = (w * w).sum()  # saves w
    with torch.no_grad():
        opt.update({"w": w}, {"w": torch.randn(N, generator=gen)}, state, donate=True)
    with pytest.raises(RuntimeError, match=MODIFIED):
        y.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_donated_undo_makes_a_backward_through_the_saved_parameter_raise(backend):
    opt, params, state, record = _stepped_twice(backend, torch.Generator().manual_seed(2))
    w = params["w"]
    y = (w * w).sum()
    with torch.no_grad():
        opt.undo(params, state, record, donate=True)
    with pytest.raises(RuntimeError, match=MODIFIED):
        y.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_donated_undo_redo_makes_a_backward_through_the_saved_parameter_raise(backend):
    gen = torch.Generator().manual_seed(3)
    opt, params, state, record = _stepped_twice(backend, gen)
    w = params["w"]
    y = (w * w).sum()
    with torch.no_grad():
        opt.undo_redo(params, state, record, {"w": torch.randn(N, generator=gen)}, grad_scale=0.5, donate=True)
    with pytest.raises(RuntimeError, match=MODIFIED):
        y.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_copy_written_by_an_update_makes_a_backward_through_it_raise(backend):
    """``param_copies``: the model's parameter, written in the step's pass (the masters are others)."""
    gen = torch.Generator().manual_seed(4)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    master = {"w": torch.randn(N, generator=gen)}
    model_w = master["w"].clone().requires_grad_()
    state = opt.init(master)
    y = (model_w * model_w).sum()
    with torch.no_grad():
        opt.update(master, {"w": torch.randn(N, generator=gen)}, state, donate=True, param_copies={"w": model_w})
    with pytest.raises(RuntimeError, match=MODIFIED):
        y.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_update_that_donates_nothing_leaves_the_saved_parameter_usable(backend):
    gen = torch.Generator().manual_seed(5)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    w = torch.randn(N, generator=gen, requires_grad=True)
    with torch.no_grad():
        state = opt.init({"w": w})
    y = (w * w).sum()
    with torch.no_grad():
        opt.update({"w": w}, {"w": torch.randn(N, generator=gen)}, state)
    y.backward()
    assert torch.equal(w.grad, 2 * w.detach())


# ------------------------------------------------------------------ the kernels' entries
def _versions(ts) -> list[int]:
    return [t._version for t in ts]


def _block(gen: torch.Generator, donate: bool):
    """``p, g, m, v``, a second gradient, the ``out`` a call writes (the inputs themselves where donated), a
    bfloat16 parameter copy, and the tensors it only reads."""
    p, g, m, v = block_inputs(gen, N, torch.float32, torch.float32, sound=True)
    g2 = torch.randn(N, generator=gen)
    out = (p, m, v) if donate else tuple(torch.empty_like(t) for t in (p, m, v))
    pc = torch.empty(N, dtype=torch.bfloat16)
    read = [g, g2] + ([] if donate else [p, m, v])
    return (p, g, m, v, g2), out, pc, read


def _call(k, entry: str, block, out, pc, s, s2) -> None:
    p, g, m, v, g2 = block
    if entry == "step":
        k.step(p, g, m, v, s, VARIANT, out=out, p_copy=pc)
    elif entry == "undo":
        k.undo(p, g, m, v, s, VARIANT, out=out, p_copy=pc)
    elif entry == "undo_redo":
        k.undo_redo(p, m, v, g, s, g2, s2, VARIANT, out=out, p_copy=pc)
    elif entry == "step_many":
        k.step_many([StepCall(p, g, m, v, s, out, pc)], VARIANT)
    elif entry == "undo_many":
        k.undo_many([UndoCall(p, g, m, v, s, None, out, pc)], VARIANT)
    else:
        k.undo_redo_many([UndoRedoCall(p, m, v, g, s, g2, s2, None, out, pc)], VARIANT)


ENTRIES = ["step", "undo", "undo_redo", "step_many", "undo_many", "undo_redo_many"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("donate", [False, True], ids=["out", "donated"])
def test_a_kernel_call_bumps_the_version_of_each_tensor_it_writes_and_of_nothing_it_reads(backend, entry, donate):
    gen = torch.Generator().manual_seed(6)
    k = load_backend(backend)
    block, out, pc, read = _block(gen, donate)
    s = block_scalars(gen, 0.1)
    written = [*out, pc]
    before_written, before_read = _versions(written), _versions(read)
    _call(k, entry, block, out, pc, s, s._replace(grad_scale=0.5))
    assert all(a > b for a, b in zip(_versions(written), before_written)), (before_written, _versions(written))
    assert _versions(read) == before_read


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_list_of_blocks_bumps_every_blocks_outputs(backend):
    """Several blocks in one call (the cpu backends' one native call, Triton's one launch per group), the
    parameter copies of some only, a view of a larger tensor as an output (its base's counter is the view's)."""
    gen = torch.Generator().manual_seed(7)
    k = load_backend(backend)
    s = block_scalars(gen, 0.1)
    base = torch.zeros(3 * N)
    calls, written = [], []
    for i in range(3):
        (p, g, m, v, _), out, pc, _ = _block(gen, donate=i == 1)
        if i == 2:
            out = (base[N:2 * N], out[1], out[2])
        calls.append(StepCall(p, g, m, v, s, out, pc if i != 1 else None))
        written += [*out, base] + ([pc] if i != 1 else [])
    before = _versions(written)
    k.step_many(calls, VARIANT)
    assert all(a > b for a, b in zip(_versions(written), before))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if load_backend(b).CHECKS_FINITE])
@pytest.mark.parametrize("op", ["step_many", "undo_redo_many"])
def test_a_checked_call_bumps_its_flags_and_outputs(backend, op):
    gen = torch.Generator().manual_seed(8)
    k = load_backend(backend)
    (p, g, m, v, g2), out, pc, read = _block(gen, donate=True)
    skip = torch.zeros(-(-N // FINITE_CHUNK), dtype=torch.uint8)
    s = block_scalars(gen, 0.1)
    written = [*out, pc, skip]
    before_written, before_read = _versions(written), _versions(read)
    if op == "step_many":
        k.step_many([StepCall(p, g, m, v, s, out, pc, skip)], VARIANT)
    else:
        k.undo_redo_many([UndoRedoCall(p, m, v, g, s, g2, s, None, out, pc, skip)], VARIANT)
    assert all(a > b for a, b in zip(_versions(written), before_written))
    assert _versions(read) == before_read


@pytest.mark.parametrize("backend", [b for b in BACKENDS if getattr(load_backend(b), "RUNS_CHUNK_LISTS", False)])
@pytest.mark.parametrize("step", [True, False], ids=["step_chunks", "undo_redo_chunks"])
def test_a_chunk_list_call_bumps_its_outputs_copies_flags_and_kept_values(backend, step):
    from sofx.kernels.chunked import ChunkedCall

    gen = torch.Generator().manual_seed(9)
    k = load_backend(backend)
    n = 3 * FINITE_CHUNK
    p, g, m, v = block_inputs(gen, n, torch.float32, torch.float32, sound=True)
    g2 = torch.randn(n, generator=gen)
    pc = torch.empty(n, dtype=torch.bfloat16)
    skip = torch.zeros(3, dtype=torch.uint8)
    chunks = torch.tensor([0, 2])
    kept = tuple(torch.empty(2 * FINITE_CHUNK) for _ in range(3))
    s = block_scalars(gen, 0.1)
    call = StepCall(p, g, m, v, s, (p, m, v), pc, skip) if step else \
        UndoRedoCall(p, m, v, g, s, g2, s, None, (p, m, v), pc, skip)
    written = [p, m, v, pc, skip, *kept]
    before_written, before_read = _versions(written), _versions([g, g2, chunks])
    (k.step_chunks if step else k.undo_redo_chunks)([ChunkedCall(call, chunks, False, kept)], VARIANT)
    assert all(a > b for a, b in zip(_versions(written), before_written))
    assert _versions([g, g2, chunks]) == before_read


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_call_bumps_nothing(backend):
    """Bad input changes nothing, the version counters included: a call refused by its checks has written
    nothing."""
    gen = torch.Generator().manual_seed(10)
    k = load_backend(backend)
    (p, g, m, v, _), out, pc, read = _block(gen, donate=False)
    bad = (out[0], out[1], torch.empty(N + 1))
    s = block_scalars(gen, 0.1)
    tensors = [p, g, m, v, *bad, pc]
    before = _versions(tensors)
    with pytest.raises(LeafError, match="shape"):
        k.step_many([StepCall(p, g, m, v, s, None, None), StepCall(p.clone(), g, m.clone(), v.clone(), s, bad, pc)],
                    VARIANT)
    assert _versions(tensors) == before


def test_versions_are_bumped_one_tensor_at_a_time_where_torch_takes_no_list(monkeypatch):
    """torch 2.4's ``increment_version`` takes one tensor (a list from 2.5 on): :func:`mark_written` finds out
    which once, and bumps each tensor by itself there."""
    from sofx.kernels import base

    def one_tensor_only(t):
        if not isinstance(t, torch.Tensor):
            raise RuntimeError("increment_version expect a Tensor as input")
        torch._C._increment_version([t])

    monkeypatch.setattr(base, "increment_version", one_tensor_only)
    assert not base._increments_lists()
    monkeypatch.setattr(base, "_INCREMENTS_LISTS", False)
    a, b = torch.zeros(3), torch.zeros(3)
    base.mark_written([a, None, b])
    assert (a._version, b._version) == (1, 1)
