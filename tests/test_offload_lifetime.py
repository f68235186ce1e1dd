"""The offload engine's lifetime with real threads: close() is bounded, says what it leaves running, and is safe
beside a step() in another thread.

A thread executor whose operation does not finish: close() waits at most the engine's ``timeout`` (at once after a
wait that timed out) and warns that the worker thread is left to finish alone. close() called while step() runs in
another thread waits for that step, which completes whole (a step() called meanwhile is refused); so it does for
wait() and the state calls, which are refused beside a step() in another thread; called from a signal handler that
runs inside step() on the same thread, it takes effect as the step returns. At interpreter exit the close waits a
moment for a step() running in a daemon thread, then closes under it with a warning. An executor's failure names the
parameters of its block.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import pytest
import torch

from test_offload_support import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    SharedMLP,
    mlp_batch,
    mlp_loss,
    one_torch_thread,
)

import sofx.loss_scale
import sofx.offload
from sofx.errors import SofxError
from sofx.offload.block_ops import BlockOp
from sofx.offload.engine import OffloadEngine
from sofx.offload.executor import ExecutorError, ExecutorTimeout
from sofx.offload.thread_executor import ThreadExecutor


def _hang(executor, release: threading.Event) -> None:
    """Queue a real "ready" operation on block 0 whose decision waits for ``release`` (a kernel that hangs), then
    one more behind it."""
    executor.submit(BlockOp(10 ** 6, "ready", 0, payload=lambda: release.wait(30) and None))
    executor.submit(BlockOp(10 ** 6 + 1, "commit_all"))
    while not executor._active:  # the worker runs it
        time.sleep(0.001)


@pytest.mark.parametrize("waited_first", [True, False], ids=["after_a_timed_out_wait", "at_once"])
def test_closing_a_thread_executor_that_does_not_finish_is_bounded_by_the_timeout_and_says_so(
        waited_first: bool) -> None:
    """close() waited 30 s for the worker thread whatever the engine's ``timeout``, also right after a wait that
    had timed out, then returned silently with the thread still running: now it waits up to ``timeout`` (not at all
    after a timed-out wait), drops the queued operations and warns that the running one is left to finish.

    The operation ends only when the test lets it (a timer ended it after 4 s, within the test on a loaded
    machine); after a timed-out wait, the close timeout is made a minute, so that a close that waited again is told
    apart from one that did not by a bound a loaded machine keeps (0.3 s, for a close that waits 0.5 s too)."""
    release = threading.Event()
    try:
        opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="thread", block_numel=100,
                                            timeout=0.5)
        executor = opt.engine.executor
        _hang(executor, release)
        if waited_first:
            with pytest.raises(ExecutorTimeout, match="did not finish within 0.5 s"):
                opt.engine.wait()
            executor.close_timeout = 60.0  # (what a close that waited again would wait)
        start = time.monotonic()
        why = r"did not wait for it again \(the last wait for it timed out\)" if waited_first else r"waited 0.5 s"
        with pytest.warns(RuntimeWarning, match=rf"close\(\) {why}, and the thread executor's worker is still running "
                                                r"the 'ready' operation on block 0 \(parameter 0 = .*\); a thread "
                                                r"cannot be stopped: it is left to finish alone.*1 queued "
                                                r"operation\(s\) were dropped") as record:
            opt.close()
        assert record[0].filename == __file__, "the warning names the caller's line"
        took = time.monotonic() - start
        assert took < 15.0 and (waited_first or took >= 0.5), took  # (the thread executor's default: 30 s)
    finally:
        release.set()
    assert opt.state_dict()["state"]["complete"] is False, "the state kept may be changed by what was left running"
    executor._thread.join(30.0)
    assert not executor._thread.is_alive(), "it stops after the operation it ran"
    assert executor._finished == executor._submitted - 1, "the queued operation did not run"


def test_collecting_an_optimizer_whose_thread_executor_hangs_waits_as_the_process_executors_exit_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer collected (or closed at interpreter exit) while its thread executor's worker hangs waited the
    optimizer's whole ``timeout`` for it (its close's), where the process executor's waits ``min(timeout,
    EXIT_WAIT_S)`` and kills its worker: nothing reads the state again. It now waits as long as the process
    executor's (a thread cannot be killed: it is left running, with the close's warning)."""
    import gc

    monkeypatch.setattr(sofx.offload.engine, "EXIT_WAIT_S", 0.2)
    release = threading.Event()
    try:
        opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="thread", block_numel=100,
                                            timeout=10.0)
        executor = opt.engine.executor
        _hang(executor, release)
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"waited 0.2 s, and the thread executor's worker is still running "
                                                r"the 'ready' operation on block 0"):
            del opt
            gc.collect()
        took = time.monotonic() - start
        assert took < 5.0, f"waited {took:.1f} s: the optimizer's timeout (10 s), not EXIT_WAIT_S (0.2 s)"
    finally:
        release.set()
    executor._thread.join(30.0)
    assert not executor._thread.is_alive()


@contextlib.contextmanager
def _hung_worker(executor: str, queued: bool = False) -> Iterator[tuple[sofx.offload.SpeculativeAdamW, Any]]:
    """An optimizer of ``executor`` (timeout 20 s) and its executor, whose worker hangs: the thread's in a "ready"
    operation (:func:`_hang`), the process stopped by SIGSTOP (it reads no message; ``queued``: an operation it
    does not answer is queued to it); Ctrl-C raises as in a terminal (not a background job). Afterwards the SIGINT
    handler is put back, the thread's operation released, a worker process still running killed."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    release = threading.Event()
    opt = None
    try:
        opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor=executor, block_numel=100,
                                            timeout=20.0)
        ex = opt.engine.executor
        if executor == "thread":
            _hang(ex, release)
        else:
            os.kill(ex.pid, signal.SIGSTOP)
            if queued:
                ex.submit(BlockOp(10 ** 6, "commit_all"))
        yield opt, ex
    finally:
        signal.signal(signal.SIGINT, before)
        release.set()
        if executor == "process" and opt is not None and opt.engine.executor.process.poll() is None:
            opt.engine.executor.process.kill()
            opt.engine.executor.process.wait()


def _ctrl_c_twice(call: Callable[[], Any]) -> None:
    """Ctrl-C pressed twice, 0.1 s apart, 0.5 s into ``call()`` (the first held back, the second goes through):
    ``call`` raises the KeyboardInterrupt."""
    pid = os.getpid()
    twice = threading.Timer(0.5, lambda: (os.kill(pid, signal.SIGINT), time.sleep(0.1), os.kill(pid, signal.SIGINT)))
    twice.start()
    with pytest.raises(KeyboardInterrupt):
        call()
    twice.join()


def _close_without_waiting_again(opt: sofx.offload.SpeculativeAdamW, ex: Any, why: str, running: str) -> None:
    """``opt.close()`` after a wait for its hung worker (:func:`_hung_worker`) was broken into: it does not wait again
    (within 10 s, where the timeout is 20 s): a worker process is killed, a worker thread left running with the
    close's warning, which says ``why`` (a regex) and ``running`` (what it runs, a regex)."""
    start = time.monotonic()
    if isinstance(ex, ThreadExecutor):
        with pytest.warns(RuntimeWarning, match=rf"close\(\) did not wait for it again \({why}\), and the thread "
                                                rf"executor's worker is still {running}"):
            opt.close()
    else:
        opt.close()
        assert ex.process.poll() is not None, "the worker process is killed"
    assert time.monotonic() - start < 10.0, "not waited for again"


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_close_broken_into_by_a_second_ctrl_c_is_finished_by_the_next_close(executor: str) -> None:
    """Ctrl-C twice while close() waits for a worker that hangs (the first is held back, the second goes through):
    the engine and its executor were marked closed at the start, so the next close() returned at once, leaving the
    worker process running for good (stopped, or hung in an operation: it never read the stop message, nor the
    closed connection, and outlived the main process), a worker thread running without the close's warning, and
    the state kept was said complete where an operation was left running. Now the next close() finishes without
    waiting again: the worker process is killed, a worker thread is left with the warning (an interrupted join had
    marked it stopped: CPython's), and the state kept is marked incomplete where operations were left."""
    with _hung_worker(executor) as (opt, ex):
        start = time.monotonic()
        _ctrl_c_twice(opt.close)
        assert time.monotonic() - start < 15.0
        _close_without_waiting_again(opt, ex, r"a close was interrupted",
                                     r"running the 'ready' operation on block 0")
        # (the stopped worker process had no operation left: its state is whole)
        assert opt.state_dict()["state"]["complete"] is (executor == "process")


def test_closing_a_thread_executor_optimizer_in_a_forked_child_does_not_wait_for_the_parents_thread() -> None:
    """A child forked from the process (a DataLoader worker, a fork-based checkpoint) that closes the optimizer, or
    exits through its exit handlers: the worker thread is the parent's, and does not run in the child; the close
    does not wait for it (nor warn that it runs)."""
    import warnings

    opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="thread", block_numel=100, timeout=30.0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            start = time.monotonic()
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                opt.close()
            os.write(write, f"{time.monotonic() - start:.1f} {len(record)}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    assert os.waitpid(pid, 0)[1] == 0
    opt.close()
    took, warned = said.split()
    assert float(took) < 5.0 and warned == "0", said


def test_an_optimizer_dropped_with_operations_queued_is_closed_on_its_worker_without_waiting_for_it() -> None:
    """An optimizer dropped between backward and step() lives on in its queued speculative steps; the last of them
    drops it on the worker thread, whose close must not wait for that very thread (5 s, then a warning that it ran)."""
    import gc
    import warnings

    torch.manual_seed(0)
    model = SharedMLP()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), executor="thread", block_numel=100, timeout=20.0)
    ex = opt.engine.executor
    release = threading.Event()
    ex.submit(BlockOp(10 ** 6, "ready", 0, payload=lambda: release.wait(30) and None))  # (the worker is held)
    opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
    del opt
    gc.collect()
    assert ex.pending > 1, "the engine lives on in the queued operations"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        start = time.monotonic()
        release.set()
        assert ex._ended.wait(30)
        took = time.monotonic() - start
    assert took < 4.0 and not record, (took, [str(w.message) for w in record])


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_after_a_wait_broken_into_by_a_second_ctrl_c_close_does_not_wait_for_the_worker_again(executor: str) -> None:
    """Ctrl-C twice while step() (here wait()) waits for a worker that hangs: every later call is refused, saying to
    close the optimizer, and close() then waited the whole timeout for that worker again (as it does not after a wait
    that timed out). It does not wait again: the worker process is killed at once, a worker thread left with the
    close's warning saying why."""
    with _hung_worker(executor, queued=True) as (opt, ex):
        _ctrl_c_twice(opt.engine.wait)
        with pytest.raises(ExecutorError, match="interrupted by a second Ctrl-C"):
            opt.step()
        _close_without_waiting_again(opt, ex, r"the last wait for it was interrupted", r"running")


def _slowed(opt: sofx.offload.SpeculativeAdamW, executor: str) -> threading.Event:
    """Make the executor's next operations wait until the returned event is set: a real operation queued first
    (thread executor: a "ready" operation whose decision waits), or the worker process stopped (SIGSTOP) and
    resumed when the event is set."""
    release = threading.Event()
    ex = opt.engine.executor
    if executor == "thread":
        ex.submit(BlockOp(10 ** 6, "ready", 0, payload=lambda: release.wait(30) and None))
        return release
    os.kill(ex.pid, signal.SIGSTOP)

    def resume() -> None:
        release.wait(30)
        os.kill(ex.pid, signal.SIGCONT)

    threading.Thread(target=resume, daemon=True).start()
    return release


def _twins(executor: str) -> tuple:
    """A model with an optimizer of ``executor`` and a copy with a thread-executor optimizer, after one backward of
    the same batch each."""
    torch.manual_seed(0)
    model = SharedMLP()
    ref = copy.deepcopy(model)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100, timeout=30)
    ropt = sofx.offload.SpeculativeAdamW(ref.parameters(), lr=1e-2, executor="thread", block_numel=100)
    batch = mlp_batch(torch.Generator().manual_seed(0))
    opt.backward(mlp_loss(model, batch))
    ropt.backward(mlp_loss(ref, batch))
    ropt.step()
    ropt.close()
    return model, ref, opt


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_close_from_another_thread_waits_for_the_step_that_runs(executor: str) -> None:
    """close() while step() runs in another thread (a watchdog, a handler on another thread): it closed the executor
    and released the blocks under the step, which failed half done ("the executor is closed", a missing block);
    now close() waits for the step, which completes whole, and a step() called meanwhile is refused."""
    model, ref, opt = _twins(executor)
    release = _slowed(opt, executor)
    outcome: dict = {}

    def step() -> None:
        try:
            outcome["report"] = opt.step()
        except BaseException as exc:  # (reported below)
            outcome["error"] = exc
        outcome["stepped_at"] = time.monotonic()

    stepper = threading.Thread(target=step)
    stepper.start()
    _waiting_for_the_executor(stepper)
    closer = threading.Thread(target=opt.close)
    closer.start()
    _closing(opt)  # (a sleep of 0.05 s, and a closer thread not started yet on a loaded machine: "another thread")
    assert closer.is_alive(), "close() waits for the step"
    with pytest.raises(SofxError, match="being closed"):
        opt.step()
    release.set()
    stepper.join(30)
    closer.join(30)
    closed_at = time.monotonic()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["report"].iteration == 1 and outcome["stepped_at"] <= closed_at
    assert opt.engine._closed
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())), "the step is whole"
    with pytest.raises(SofxError, match="closed"):
        opt.step()


def test_close_from_a_signal_handler_inside_step_takes_effect_as_the_step_returns() -> None:
    """A signal handler (SIGTERM from a scheduler; here SIGALRM) that closes the optimizer runs on the main thread,
    inside the step() it interrupts: close() cannot wait for it there (it would wait for itself), and closing under
    it failed the step; now the close is done as the step returns, whole.

    The signal is sent once the step waits for the executor, whose operation ends once the handler has run (a 0.2 s
    timer for the signal and a 0.5 s one for the operation: on a loaded machine, the signal could come before the
    step or after it)."""
    model, ref, opt = _twins("thread")
    release = _slowed(opt, "thread")
    seen: dict = {}

    def handler(signum, frame) -> None:
        opt.close()
        seen["closed_in_handler"] = opt.engine._closed
        release.set()  # the step goes on once the handler has run inside it

    def send() -> None:
        _waiting_for_the_executor(threading.main_thread())
        signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)

    old = signal.signal(signal.SIGALRM, handler)
    sender = threading.Thread(target=send)
    sender.start()
    try:
        report = opt.step()
    finally:
        sender.join(60)
        signal.signal(signal.SIGALRM, old)
        release.set()
    assert seen == {"closed_in_handler": False}, "the handler ran during the step"
    assert report.iteration == 1 and opt.engine._closed
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())), "the step is whole"
    with pytest.raises(SofxError, match="closed"):
        opt.step()


def test_close_from_a_signal_handler_inside_a_gradient_hook_takes_effect_as_the_hook_ends() -> None:
    """The handler runs inside a gradient hook (here: SIGUSR1 sent as the hook of ``mid.weight``, a block of its
    own, takes its gradient): closing under it made the hook's submission of the ready block fail and backward raise
    "the thread executor is closed"; now the hook ends whole, the optimizer closes then, and the rest of backward
    leaves its gradients in .grad."""
    torch.manual_seed(0)
    model = SharedMLP()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="thread", block_numel=100)
    take = type(opt.engine)._take_gradient.__code__
    mid = [i for i, p in enumerate(model.parameters()) if p is model.mid.weight][0]
    assert [layout.param_indices for layout in opt.engine.layouts if mid in layout.param_indices] == [(mid,)]
    sent = []

    def trace(frame, event, arg):
        if event == "call" and frame.f_code is take and frame.f_locals["index"] == mid and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGUSR1)
        return None

    seen = {}

    def handler(signum, frame) -> None:
        opt.close()
        seen["closed_in_handler"] = opt.engine._closed

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        sys.settrace(trace)
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGUSR1, old)
    assert seen == {"closed_in_handler": False}, "the handler ran inside the hook"
    assert opt.engine._closed
    assert any(p.grad is not None for p in model.parameters()), "later gradients stay in .grad"
    with pytest.raises(SofxError, match="closed"):
        opt.step()


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_an_executor_failure_names_the_parameters_of_its_block(executor: str) -> None:
    """A failing block operation named "block 1" only, which the user cannot map to anything: the error names the
    block's parameters as the engine's other errors do (index, ``param_groups[g]['params'][k]``, shape), the first
    four of a block of many."""
    weight = torch.nn.Parameter(torch.randn(4, 3))
    biases = [torch.nn.Parameter(torch.randn(2)) for _ in range(6)]
    with sofx.offload.SpeculativeAdamW([{"params": [weight]}, {"params": biases}], executor=executor,
                                       block_numel=100) as opt:
        assert [layout.param_indices for layout in opt.engine.layouts] == [(0,), (1, 2, 3, 4, 5, 6)]
        opt.engine.executor.submit(BlockOp(10 ** 6, "undo_now", 1))  # (it holds no speculative step)
        names = "; ".join(f"parameter {k + 1} = param_groups\\[1\\]\\['params'\\]\\[{k}\\], shape \\(2,\\)"
                          for k in range(4))
        with pytest.raises(ExecutorError, match=rf"(?s)the 'undo_now' operation on block 1 \({names}; and 2 more\) "
                                                r"failed: .*has no speculative step"):
            opt.engine.wait()
        with pytest.raises(ExecutorError, match=r"failed earlier.*block 1 \(parameter 1 = param_groups"):
            opt.step()


def _stepped_once(executor: str) -> tuple[torch.nn.Module, sofx.offload.SpeculativeAdamW]:
    """A model and an optimizer of ``executor`` after one step (its moments hold values)."""
    torch.manual_seed(0)
    model = SharedMLP()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100, timeout=30)
    opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
    opt.step()
    return model, opt


def _waiting_for_the_executor(thread: threading.Thread) -> None:
    """Return once ``thread`` waits for the engine's executor (``OffloadEngine._wait`` is on its stack)."""
    waiting = OffloadEngine._wait.__code__
    deadline = time.monotonic() + 60
    while True:
        frame = sys._current_frames().get(thread.ident)
        while frame is not None and frame.f_code is not waiting:
            frame = frame.f_back
        if frame is not None:
            return
        assert thread.is_alive() and time.monotonic() < deadline, "the call waits for the executor"
        time.sleep(0.001)


def _closing(opt: sofx.offload.SpeculativeAdamW) -> None:
    """Return once a close() called in another thread is under way (it waits for the call that holds the engine)."""
    deadline = time.monotonic() + 60
    while not opt.engine._closing:
        assert time.monotonic() < deadline, "close() began"
        time.sleep(0.001)


def _set_exp_avg(model, opt) -> None:
    opt.state[model.mid.weight]["exp_avg"] = torch.full_like(model.mid.weight, 0.5)


def _reload_doubled(model, opt) -> None:
    with torch.no_grad():
        model.mid.weight.mul_(2)
    opt.reload_params()


_WAITING_CALLS = {  # name: (the call, run in another thread; what it leaves in the state of model.mid.weight)
    "wait": (lambda model, opt: opt.engine.wait(), None),
    "set_state": (_set_exp_avg, lambda model, state: torch.equal(state["exp_avg"], torch.full_like(model.mid.weight,
                                                                                                    0.5))),
    "reset_state": (lambda model, opt: setattr(opt, "state", {}),
                    lambda model, state: int(state["step"]) == 0 and not state["exp_avg"].any()),
    "reload_params": (_reload_doubled, lambda model, state: torch.equal(state["master"], model.mid.weight)),
}


@pytest.mark.parametrize("executor,call", [("thread", name) for name in _WAITING_CALLS]
                         + [("process", "set_state"), ("process", "reload_params")])
def test_close_from_another_thread_waits_for_wait_and_the_state_calls(executor: str, call: str) -> None:
    """wait(), opt.state[p][key] = value, opt.state = {} and reload_params() did not hold the engine as step() does:
    a close() from another thread while they waited for the executor closed the optimizer under them (with the
    process executor, a write that came after close() copied the blocks out of shared memory was lost). close() now
    waits for them as for step(): they complete whole, and their change is in the state close() keeps."""
    run, effect = _WAITING_CALLS[call]
    model, opt = _stepped_once(executor)
    release = _slowed(opt, executor)
    if executor == "process":
        opt.engine.executor.submit(BlockOp(10 ** 6, "commit_all"))  # (something for the stopped worker to answer)
    outcome: dict = {}

    def calling() -> None:
        try:
            run(model, opt)
        except BaseException as exc:  # (reported below)
            outcome["error"] = exc
        outcome["done_at"] = time.monotonic()

    caller = threading.Thread(target=calling)
    caller.start()
    try:
        _waiting_for_the_executor(caller)
        closer = threading.Thread(target=opt.close)
        closer.start()
        _closing(opt)
        assert closer.is_alive() and not opt.engine._closed, "close() waits for the call"
    finally:
        release.set()
        caller.join(30)
    closer.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert opt.engine._closed and outcome["done_at"] <= time.monotonic()
    assert effect is None or effect(model, opt.state[model.mid.weight]), "the call is whole, and in the state kept"


_STATE_CALLS = {  # what the refusal names: the call
    "wait()": lambda model, opt: opt.engine.wait(),
    "opt.state[p]": lambda model, opt: opt.state[model.mid.weight]["exp_avg"],
    "opt.state[p]['exp_avg'] = ...": _set_exp_avg,
    "reset_state() (opt.state = {})": lambda model, opt: setattr(opt, "state", {}),
    "reload_params()": _reload_doubled,
}


def test_wait_and_the_state_calls_from_another_thread_during_a_step_are_refused() -> None:
    """While step() runs in one thread, wait() in another took the step's results (a failure among them was raised
    there, and the step went on), and the state calls read or wrote blocks the step was changing: each is refused as
    a second step() is, changing nothing, and the optimizer goes on."""
    model, opt = _stepped_once("thread")
    with opt:
        state = {k: v.clone() for k, v in opt.state[model.mid.weight].items()}
        weight = model.mid.weight.detach().clone()
        errors: dict = {}

        def other_thread() -> None:
            for what, call in _STATE_CALLS.items():
                try:
                    call(model, opt)
                except SofxError as e:
                    errors[what] = e

        with opt.engine._exclusive("step()"):  # as a step() running in this thread holds it
            t = threading.Thread(target=other_thread)
            t.start()
            t.join(60)
        assert list(errors) == list(_STATE_CALLS)
        for what, e in errors.items():
            assert str(e).startswith(f"{what} was called while another thread is in step()"), e
        after = opt.state[model.mid.weight]
        assert all(torch.equal(after[k], v) for k, v in state.items()) and torch.equal(model.mid.weight, weight * 2)
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(1))))
        assert opt.step().iteration == 2


def test_a_state_call_from_a_signal_handler_inside_step_is_refused_naming_the_call_it_is_inside(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler (a "save a checkpoint on SIGUSR1" handler), which Python runs in the main thread between any
    two bytecodes, calling state_dict() while step() runs there: refused as "called while another thread is in
    step()", where no other thread was. It says the call is inside step() on the same thread, and the step goes on."""
    model, opt = _stepped_once("thread")
    original = OffloadEngine._publish_to_model

    def signalled(self, *args, **kwargs):
        monkeypatch.setattr(OffloadEngine, "_publish_to_model", original)
        os.kill(os.getpid(), signal.SIGUSR1)  # (the handler runs here, in step())
        return original(self, *args, **kwargs)

    with _state_dict_on_sigusr1(opt) as said, opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(1))))
        monkeypatch.setattr(OffloadEngine, "_publish_to_model", signalled)
        assert opt.step().iteration == 2
        assert said and said[0].startswith("state_dict() was called inside step() on the same thread (a signal "
                                           "handler"), said
        assert "another thread" not in said[0], said
        assert opt.state_dict()["state"]["complete"]


@contextlib.contextmanager
def _state_dict_on_sigusr1(opt: Any) -> Iterator[list]:
    """A "save a checkpoint on SIGUSR1" handler calling ``opt.state_dict()`` installed for the block; yields the
    list of the refusals it met (their messages)."""
    said: list = []

    def save(signum, frame) -> None:
        try:
            opt.state_dict()
        except SofxError as e:
            said.append(str(e))

    before = signal.signal(signal.SIGUSR1, save)
    try:
        yield said
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_state_call_from_a_signal_handler_inside_close_is_refused_naming_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A "save a checkpoint on SIGUSR1" handler calling state_dict() while close() runs in the main thread (as it
    stops the executor) was told the optimizer "is being closed by another thread", where no other thread was. It
    says the call is inside close() on the same thread; the close goes on, and the closed optimizer's state_dict()
    works afterwards."""
    _, opt = _stepped_once("thread")
    original = OffloadEngine._record_at_close

    def signalled(self):
        os.kill(os.getpid(), signal.SIGUSR1)  # (the handler runs here, in close())
        return original(self)

    monkeypatch.setattr(OffloadEngine, "_record_at_close", signalled)
    with _state_dict_on_sigusr1(opt) as said:
        opt.close()
    assert said and said[0].startswith("state_dict() was called inside close() on the same thread (a signal "
                                       "handler"), said
    assert "another thread" not in said[0], said
    assert opt.state_dict()["state"]["complete"]


_EXIT_DURING_STEP = """
import atexit, os, sys, threading, time, torch
import sofx.offload, sofx.offload.engine
from sofx.offload.block_ops import BlockOp
hold, sofx.offload.engine.EXIT_WAIT_S = sys.argv[1], float(sys.argv[2])
seen = {}
# registered first, so it runs after the optimizer's own exit handler (atexit runs last-in first-out): it says how
# long that handler took, and the step's thread gets to say how its step ended
atexit.register(lambda: (print(f"the exit's close took {time.monotonic() - seen['exit']:.3f} s", file=sys.stderr,
                               flush=True), seen["stepper"].join(30)))
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = sofx.offload.SpeculativeAdamW(model.parameters(), executor="thread", timeout=30)
atexit.register(lambda: seen.setdefault("exit", time.monotonic()))  # (runs before the optimizer's exit handler)
opt.backward(model(torch.randn(3, 4)).square().mean())


def held():
    if hold == "until_closed":  # past the exit's wait for the step: its close closes the executor under it
        while not opt.engine.executor._closed:
            time.sleep(0.001)
    else:
        time.sleep(float(hold))


opt.engine.executor.submit(BlockOp(10 ** 6, "ready", 0, payload=held))  # (the step waits)


def step():
    try:
        print("stepped", opt.step().iteration, flush=True)
    except BaseException as exc:
        print("step failed:", repr(exc), flush=True)


seen["stepper"] = threading.Thread(target=step, daemon=True)
seen["stepper"].start()
while not opt.engine._call_lock.locked():  # the script ends while the daemon thread is in step()
    time.sleep(0.001)
"""


def _exit_during_step(hold: float | str, exit_wait: float) -> tuple[subprocess.CompletedProcess, float]:
    """Run a script that ends while a daemon thread is in step(), held ``hold`` s (``"until_closed"``: until the
    exit's close has closed the executor), with ``EXIT_WAIT_S = exit_wait``; its result and how long the optimizer's
    exit handler took (measured in the script: its start, importing torch, is slowed many times on a loaded machine)."""
    out = subprocess.run([sys.executable, "-c", _EXIT_DURING_STEP, str(hold), str(exit_wait)], capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    took = re.search(r"the exit's close took ([0-9.]+) s", out.stderr)
    assert took, (out.stdout, out.stderr)
    return out, float(took.group(1))


def test_at_exit_the_close_waits_for_a_step_running_in_a_daemon_thread() -> None:
    """The at-exit close bypassed the locks: a script that ended while a daemon thread was in step() had the
    optimizer closed under that step, which failed half done ("the thread executor is closed"). The exit now waits
    for the step as close() does (at most EXIT_WAIT_S), and the step completes whole."""
    out, _ = _exit_during_step(hold=1.0, exit_wait=30.0)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "stepped 1", (out.stdout, out.stderr)
    assert "RuntimeWarning" not in out.stderr, out.stderr


def test_at_exit_a_step_that_does_not_end_in_time_is_closed_under_with_a_warning() -> None:
    """Waiting for a daemon thread's step() at exit is bounded: past EXIT_WAIT_S the optimizer is closed anyway (the
    process must exit, its worker stopped), with a warning naming the call.

    The step is held until the executor is closed (held 2 s, it could end within the exit's 0.2 s wait when the
    script reached its end late, on a loaded machine)."""
    out, took = _exit_during_step(hold="until_closed", exit_wait=0.2)
    assert out.returncode == 0, out.stderr
    assert "at interpreter exit, step() was still running in another thread after 0.2 s" in out.stderr, out.stderr
    assert out.stdout.startswith("step failed: ExecutorError('the thread executor is closed')"), out.stdout
    assert took < 20, "not the optimizer's 30 s timeout"


def _with_loop(model: torch.nn.Module, executor: str, batches: list, saved: dict | None = None
               ) -> sofx.offload.SpeculativeAdamW:
    """Train ``model`` on ``batches`` in a ``with opt:`` block (clipping, a dynamic loss scale that grows every 2
    clean steps), after loading ``saved`` where given; returns the closed optimizer."""
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100,
                                       max_grad_norm=0.5, loss_scale=sofx.loss_scale.grad_scaler(
                                           init_scale=2.0 ** 10, growth_interval=2)) as opt:
        if saved is not None:
            opt.load_state_dict(saved)
        for batch in batches:
            opt.zero_grad()
            opt.backward(mlp_loss(model, batch))
            opt.step()
    return opt


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_a_with_block_saves_after_it_ends_and_the_saved_state_resumes_bitwise(executor: str) -> None:
    """state_dict() after close() was refused ("the optimizer is closed"), though opt.state[p] stays readable: a
    ``with opt:`` loop could not save its optimizer after the block. Now it saves the state the optimizer kept (the
    thread executor's last operation, queued by step(), recorded as close() stops the worker), and a run resumed
    from it in a fresh optimizer is the uninterrupted run bit for bit; the uninterrupted run is torch.optim.AdamW's
    + clip_grad_norm_ + GradScaler's."""
    gen = torch.Generator().manual_seed(3)
    batches = [mlp_batch(gen) for _ in range(8)]
    torch.manual_seed(0)
    whole = SharedMLP()
    ref, model = copy.deepcopy(whole), copy.deepcopy(whole)
    _with_loop(whole, executor, batches)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    for batch in batches:
        ropt.zero_grad()
        scaler.scale(mlp_loss(ref, batch)).backward()
        scaler.unscale_(ropt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        scaler.step(ropt)
        scaler.update()
    for p, q in zip(whole.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)

    opt = _with_loop(model, executor, batches[:5])
    saved = copy.deepcopy(opt.state_dict())  # after the block
    assert saved["state"]["complete"] and saved["state"]["iteration"] == 5
    for p in model.parameters():  # (the state kept is what opt.state shows)
        if p.requires_grad:
            assert int(opt.state[p]["step"]) == 5
    for entry, t in zip(saved["state"]["blocks"], opt.engine.tensors.values()):
        assert torch.equal(entry["exp_avg"], t.exp_avg) and torch.equal(entry["master"], t.master)
    _with_loop(model, executor, batches[5:], saved)
    for p, q in zip(model.parameters(), whole.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_the_state_dict_of_an_optimizer_closed_mid_step_or_at_exit_is_refused_saying_so(executor: str) -> None:
    """state_dict() after close() returns the state kept, except where the close came between backward and step()
    (blocks may hold speculative steps never validated, and no step() nor zero_grad() can come) or at interpreter
    exit (the process executor's shared blocks are dropped then: it raised a KeyError): refused, saying why."""
    gen = torch.Generator().manual_seed(0)
    model = SharedMLP()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    opt.backward(mlp_loss(model, mlp_batch(gen)))
    opt.step()
    opt.backward(mlp_loss(model, mlp_batch(gen)))
    opt.close()
    with pytest.raises(SofxError, match=r"^state_dict\(\) was called on an optimizer closed between backward and "
                                        r"step\(\): .*; close it after step\(\) or zero_grad\(\) to save its state"):
        opt.state_dict()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
    opt.backward(mlp_loss(model, mlp_batch(gen)))
    opt.step()
    opt.engine._close_for_exit()  # (what the exit handler calls)
    if executor == "process":
        with pytest.raises(SofxError, match=r"^state_dict\(\): the optimizer was closed at interpreter exit"):
            opt.state_dict()
    else:
        assert opt.state_dict()["state"]["complete"]


_READ_AT_EXIT = """
import atexit, torch
import sofx.offload


def read():  # registered first: it runs after the optimizer's own exit handler (atexit runs last-in first-out)
    for what, call in (("state", lambda: opt.state[model.weight]["exp_avg"]), ("state_dict", opt.state_dict)):
        try:
            call()
            print(what, "read", flush=True)
        except Exception as exc:
            print(what, "refused:", type(exc).__name__, exc, flush=True)


atexit.register(read)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = sofx.offload.SpeculativeAdamW(model.parameters(), executor="process")
opt.backward(model(torch.randn(3, 4)).square().mean())
opt.step()
"""


def test_reading_the_state_of_a_process_executor_optimizer_after_the_exit_closed_it_is_refused_saying_so() -> None:
    """An exit handler registered before the optimizer runs after the optimizer's own, which closes it dropping the
    process executor's shared blocks (no copy at exit): opt.state[p] raised a bare ``KeyError: 0`` there. It and
    state_dict() now say that the exit closed the optimizer, dropping its state."""
    out = subprocess.run([sys.executable, "-c", _READ_AT_EXIT], capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    said = "SofxError {}: the optimizer was closed at interpreter exit (or as it was collected), dropping its state"
    assert out.stdout.splitlines() == ["state refused: " + said.format("opt.state[p]"),
                                       "state_dict refused: " + said.format("state_dict()")], (out.stdout, out.stderr)


def test_setting_speculate_on_a_closed_optimizer_is_refused_as_its_other_calls_are() -> None:
    """``opt.speculate = False`` after close() was taken without a word (the setting changed, nothing to step with
    it), where zero_grad(), reload_params() and load_state_dict() refuse a closed optimizer: refused the same way,
    the setting as it was (still readable)."""
    model = torch.nn.Linear(3, 2)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline")
    opt.close()
    for on in (False, True):
        with pytest.raises(SofxError, match=r"^the optimizer is closed$"):
            opt.speculate = on
    assert opt.speculate is True
    with pytest.raises(SofxError, match=r"^the optimizer is closed$"):
        opt.zero_grad()
