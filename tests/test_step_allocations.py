"""A steady-state step allocates no tensor of a parameter's size (DESIGN.md's donation: no fresh allocations per step).

Counted with :class:`_FreshTensors`, a ``TorchDispatchMode`` that records every tensor an op returns whose storage
is none of its inputs' (``empty``, ``clone``, ``cat``, an out-of-place op's result; not a view, not ``copy_``'s
``self``), on the training thread and on the thread executor's worker, and attributes it to the innermost
``sofx`` frame; what the model's forward and autograd's backward allocate (the gradients) is not sofx's and not
counted, as a ``torch.optim`` loop would allocate it too.

Measured after warm-up: the first steps of a run copy out chunks (or whole leaves) whose second moment is still
small (:mod:`sofx.skipped_chunks`), a snapshot the size of those leaves each step, until the moments have grown.
After that, a step of the offload facade (inline and thread executors, speculation on and off, clipping on: no
clip, and a late clip that undoes and redoes a speculated block) and of the donated functional loops
(:func:`sofx.serial.serial_loop_step`, :func:`sofx.speculate.speculative_loop_step`) allocates only 0-d tensors
and flags of a few elements (a leaf's step count, a block's chunk flags), none of a parameter's size (the model's
smallest has 64 elements). A snapshot undo (``undo="exact"``) does copy its blocks every step: the control that
the count sees the worker thread's allocations.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sofx
import sofx.offload
import sofx.offload.block_runner
from sofx.loss_scale import static_scale
from sofx.serial import init_loop, serial_loop_step
from sofx.speculate import AdaptivePolicy, SpeculationConfig, speculative_loop_step

from test_offload_support import one_torch_thread  # noqa: F401 (autouse fixture)

WARM_STEPS, MEASURED_STEPS = 24, 4
PARAM_SIZED = 64  # elements of the model's smallest parameter (see _mlp)
_SOFX = os.path.dirname(sofx.__file__) + os.sep
_ROOT = os.path.dirname(os.path.dirname(sofx.__file__))
_AUTOGRAD = os.path.join("torch", "autograd", "graph.py")  # autograd's engine (backward's ops and hooks)

# max_norm: over the gradient norms (~0.2 after warm-up), or under them but over the norm of the blocks that arrive
# first, so that those are speculated and clipped late (undo_redo; the others are vetoed and stepped late)
REGIMES = {"no clip": 1.0, "late clip": 0.16}


def _where(frame: Any) -> str | None:
    """The innermost sofx frame above ``frame`` as ``path:line``; None where autograd's engine or nothing of sofx
    called the op."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_SOFX):
            return f"{os.path.relpath(name, _ROOT)}:{frame.f_lineno}"
        if name.endswith(_AUTOGRAD):
            return None
        frame = frame.f_back
    return None


class _FreshTensors(TorchDispatchMode):
    """Records ``(where, op, shape, nbytes)`` of every tensor an op returns in new storage while :attr:`on`."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.seen: list[tuple[str, str, tuple[int, ...], int]] = []
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on:
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    where = _where(sys._getframe(1))
                    if where is not None:
                        with self._lock:
                            self.seen.append((where, str(func), tuple(t.shape), t.untyped_storage().nbytes()))
        return out

    def param_sized(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """What was recorded of a parameter's size or more."""
        return [s for s in self.seen if torch.Size(s[2]).numel() >= PARAM_SIZED]


@pytest.fixture
def fresh(monkeypatch) -> _FreshTensors:
    """A counter, also entered on the thread executor's worker for each operation it runs."""
    counter = _FreshTensors()
    run = sofx.offload.block_runner.BlockRunner.run

    def counted_run(self, op):
        if threading.current_thread() is threading.main_thread():
            return run(self, op)
        with counter:
            return run(self, op)

    monkeypatch.setattr(sofx.offload.block_runner.BlockRunner, "run", counted_run)
    return counter


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def _batches() -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return lambda: (torch.randn(16, 32, generator=gen), torch.randn(16, 64, generator=gen))


def _measured(fresh: _FreshTensors, step: Callable[[], Any]) -> list[Any]:
    """Run ``WARM_STEPS`` steps, then ``MEASURED_STEPS`` counted; their results."""
    out = []
    with fresh:
        for i in range(WARM_STEPS + MEASURED_STEPS):
            fresh.on = i >= WARM_STEPS
            result = step()
            if fresh.on:
                out.append(result)
        fresh.on = False
    return out


def _facade_reports(fresh: _FreshTensors, executor: str, **kwargs: Any) -> tuple[nn.Module, list[Any]]:
    """``(model, reports)``: :func:`_measured` steps of a SpeculativeAdamW (``kwargs``: its settings beside lr
    1e-3, blocks of 2048 elements and no adaptive policy) training :func:`_mlp` on :func:`_batches`."""
    model = _mlp()
    batch = _batches()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-3, executor=executor, block_numel=2048,
                                       policy=AdaptivePolicy(enabled=False), **kwargs) as opt:
        def step():
            x, y = batch()
            opt.zero_grad()
            opt.backward(((model(x) - y) ** 2).mean())
            return opt.step()

        return model, _measured(fresh, step)


def _expected_actions(actions: tuple[str, ...], speculate: bool, regime: str) -> bool:
    if not speculate:
        return set(actions) == {"step"}
    return set(actions) == {"commit"} if regime == "no clip" else "undo_redo" in actions


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("speculate", [True, False])
@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_offload_facade_steady_state_step_allocates_nothing_parameter_sized(executor, speculate, regime, fresh):
    """The facade's steady-state steps (inline and thread executors, speculated or not, committed or undone and
    redone for a late clip) allocate only 0-d and tiny tensors."""
    _, reports = _facade_reports(fresh, executor, max_grad_norm=REGIMES[regime], speculate=speculate)
    assert all(_expected_actions(r.actions, speculate, regime) for r in reports), [r.actions for r in reports]
    assert all(r.clipped == (regime == "late clip") for r in reports)
    assert fresh.param_sized() == []
    assert fresh.seen, "the counter saw none of the 0-d step counts"


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("loop_step", ["serial_loop_step", "speculative_loop_step"])
def test_donated_loop_steady_state_step_allocates_nothing_parameter_sized(loop_step, regime, fresh):
    max_norm = REGIMES[regime]
    model = _mlp()
    batch = _batches()
    opt, scaler = sofx.adamw(lr=1e-3), static_scale(1.0)
    loop = init_loop(opt, {k: v.detach().clone() for k, v in model.named_parameters()}, scaler)
    config = SpeculationConfig(max_norm=max_norm, policy=AdaptivePolicy(enabled=False))

    def loss(params, x, y):
        return ((functional_call(model, params, (x,)) - y) ** 2).mean()

    def step():
        nonlocal loop
        was_on, fresh.on = fresh.on, False  # (the gradients are autograd's)
        grads = grad(loss)(loop.params, *batch())
        fresh.on = was_on
        if loop_step == "serial_loop_step":
            loop, out = serial_loop_step(opt, loop, grads, scaler=scaler, max_norm=max_norm, donate=True)
        else:
            loop, out = speculative_loop_step(opt, loop, grads, config=config, scaler=scaler, donate=True)
        return out

    results = _measured(fresh, step)
    assert all(r.clipped == (regime == "late clip") for r in results)
    if loop_step == "speculative_loop_step":
        assert all(_expected_actions(r.actions, True, regime) for r in results), [r.actions for r in results]
    assert fresh.param_sized() == []


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_snapshot_undo_copies_its_blocks_every_step_where_the_count_sees_them(executor, fresh):
    """The control: ``undo="exact"`` snapshots the master weights and both moments of every speculated block
    (``Adam._prepare_step``), on the worker thread with the thread executor."""
    model, reports = _facade_reports(fresh, executor, max_grad_norm=3.0, undo="exact")
    assert all(set(r.actions) == {"commit"} for r in reports)
    numel = sum(p.numel() for p in model.parameters())
    copied = fresh.param_sized()
    assert all(where.startswith("sofx/adam.py:") and op == "aten.clone.default" for where, op, _, _ in copied), copied
    assert sum(nbytes for *_, nbytes in copied) == MEASURED_STEPS * 3 * 4 * numel  # p, m, v in float32
