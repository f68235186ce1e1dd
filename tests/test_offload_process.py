"""The process executor with real worker processes on shared memory.

A killed worker is a clear error within the timeout and the shared state
survives; a too-small shared-memory budget warns and falls back to the thread
executor, and so does a reservation that fails after the space check passed
(leaving no file, worker or shared parameter behind); an operation failing in the worker is raised with its traceback;
every hparam reaches the worker with every step; close() stops the worker and
removes the shared-memory files. A worker killed while starting, between steps
or during backward, or one that raises, is a clear error in time, and neither
that nor optimizers made and closed in a loop leave descriptors, threads,
processes or shared-memory mappings behind; nor does a main process killed
(SIGTERM, SIGKILL) while its worker starts: the shared files never have a name.
"""

from __future__ import annotations

import copy
import gc
import glob
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
from torch import nn

from test_offload_support import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    SharedMLP,
    mlp_batch,
    mlp_loss,
    mlp_step_side_by_side,
    one_torch_thread,
    relative_deviation,
)

import sofx.offload
import sofx.offload.shared_memory
from sofx.errors import SofxError
from sofx.offload.block_ops import BlockOp
from sofx.offload.executor import ExecutorError, WorkerDiedError

TOL = 1e-6


def _shm_files(opt: sofx.offload.SpeculativeAdamW) -> list[str]:
    """``opt``'s shared-memory files that have a name, and the descriptors of its files still open here."""
    arena = opt.engine._cpu_arena
    return glob.glob(os.path.join(arena.shm_dir, arena.prefix + "*")) + [f"fd {fd}" for fd in arena.fds]


def _held_inodes(shm_dir: str = sofx.offload.shared_memory.DEFAULT_SHM_DIR) -> set[int]:
    """The inodes of the files in ``shm_dir`` that this process holds open or mapped (the shared tensors' files have
    no name: ``ls /dev/shm`` cannot see them)."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(os.path.join(shm_dir, "")):
                held.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(os.path.join(shm_dir, "")):
                held.add(int(fields[4]))
    return held


def test_killing_the_worker_mid_step_is_a_clear_error_and_the_state_survives() -> None:
    torch.manual_seed(0)
    model = SharedMLP()
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100,
                                        timeout=30.0)
    assert opt.executor == "process"
    assert _shm_files(opt) == []  # their names are removed once both processes mapped them
    for _ in range(2):
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        report = opt.step()
        # every speculative step taken in the worker is committed: no clipping, overflow or late gradient here, and
        # validation compares each block's sum of squares with the very float it was speculated with
        assert report.speculated == report.committed == report.blocks and report.redone == 0, report.summary()
    good = copy.deepcopy(opt.state_dict())
    opt.backward(mlp_loss(model, mlp_batch(gen)))  # speculative steps submitted to the worker
    worker = opt.engine.executor.process
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=60)  # (a loaded machine slows tearing a process down many times)
    start = time.monotonic()
    died = r"worker process \(pid \d+\) died \(killed by signal SIGKILL\)"
    with pytest.raises(WorkerDiedError, match=died) as raised:
        opt.step()
    assert time.monotonic() - start < 30.0
    with pytest.raises(ExecutorError, match="failed earlier"):
        opt.step()
    # the way on is said (the error said "reload a checkpoint", and this one's load_state_dict said it again)
    assert "load a checkpoint saved between steps into a new optimizer" in str(raised.value)
    with pytest.raises(ExecutorError, match=r"failed earlier and cannot continue \(close\(\) this optimizer; to go on "
                                            r"training, create a new one"):
        opt.load_state_dict(good)
    # the state in shared memory is intact and readable; it is marked as taken mid-step
    state = opt.state_dict()["state"]
    assert state["complete"] is False
    for saved, now in zip(good["state"]["blocks"], state["blocks"]):
        assert torch.isfinite(now["master"]).all()
        assert now["counts"].min() >= saved["counts"].min()
    # opt.state[p] is refused naming the failure (it said "read it after step() or zero_grad()", both refused)
    p = next(model.parameters())
    for read in (lambda: opt.state[p]["exp_avg"], lambda: copy.deepcopy(opt.state[p])):
        with pytest.raises(ExecutorError, match=r"failed in the middle of a step.*killed by signal SIGKILL"
                                                r"(?s:.*)state_dict\(\)"):
            read()
    opt.close()
    assert _shm_files(opt) == []
    with pytest.raises(ExecutorError, match=r"failed in the middle of a step.*killed by signal SIGKILL"):
        opt.state[p]["exp_avg"]
    assert opt.state_dict()["state"]["complete"] is False


def test_too_small_shared_memory_budget_warns_and_falls_back_to_thread() -> None:
    torch.manual_seed(0)
    model = SharedMLP()
    ref = copy.deepcopy(model)
    with pytest.warns(RuntimeWarning,
                      match=r"needs .* bytes .* of shared memory .* falling back to the thread executor") as record:
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100,
                                            shm_limit_bytes=1024)
    assert record[0].filename == __file__, "the warning names the caller's line"
    assert opt.executor == "thread"
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with opt:
        for _ in range(5):
            report = mlp_step_side_by_side(opt, ropt, model, ref, gen)
            assert report.executor == "thread" and report.committed > 0
            assert relative_deviation(model, ref) <= TOL


def test_the_shared_memory_warning_gives_the_sizes_in_bytes_so_that_a_small_shortfall_reads_as_one() -> None:
    """A model whose state needs less than 0.05 MiB, at a budget of 1024 bytes, was told "needs 0.0 MiB of shared
    memory ..., but only 0.0 MiB are available": two equal numbers for a shortfall. The warning gives the sizes in
    bytes (and MiB), the need above the budget."""
    model = torch.nn.Linear(20, 20)
    with pytest.warns(RuntimeWarning, match="falling back to the thread executor") as record:
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", shm_limit_bytes=1024)
    opt.close()
    message = str(record[0].message)
    found = re.search(r"needs ([\d,]+) bytes \(\d+\.\d MiB\) of shared memory .* but only ([\d,]+) bytes "
                      r"\(\d+\.\d MiB\) are available", message)
    assert found, message
    # the limit was the caller's: the remedy is to raise it (it said to enlarge /dev/shm, which had room)
    assert "(shm_limit_bytes); falling back" in message and "Raise shm_limit_bytes to use the process" in message
    assert "Enlarge" not in message
    need, available = (int(x.replace(",", "")) for x in found.groups())
    assert available == 1024 and need > available, message


def test_a_shared_memory_directory_that_does_not_exist_is_named_as_such_in_the_fallback_warning(
        tmp_path: pathlib.Path) -> None:
    """``shm_dir`` misspelt (no such directory): the warning said that only 0 bytes were available there and to
    enlarge it (docker --shm-size), where nothing can be enlarged. It says the directory does not exist."""
    missing = tmp_path / "no-such-dir"
    with pytest.warns(RuntimeWarning, match="falling back to the thread executor") as record:
        opt = sofx.offload.SpeculativeAdamW(torch.nn.Linear(3, 3).parameters(), executor="process",
                                            shm_dir=str(missing))
    opt.close()
    message = str(record[0].message)
    assert f"shm_dir {str(missing)!r} is not a directory (it does not exist)" in message, message
    assert "Enlarge" not in message and "Pass an existing directory as shm_dir" in message, message


def _child_candidates(parent: int) -> list[str]:
    """The ``/proc/PID/stat`` files of ``parent``'s children (read from ``/proc/PARENT/task/*/children``: a file per
    thread of it), or of every process where the kernel keeps no such files: a scan of all of them costs ~1.5 ms of
    a core, which a loop polling for a worker every millisecond would spend while the worker starts."""
    try:
        tids = os.listdir(f"/proc/{parent}/task")
    except FileNotFoundError:
        return []
    pids = []
    for tid in tids:
        try:
            with open(f"/proc/{parent}/task/{tid}/children") as f:
                pids += f.read().split()
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{parent}/task/{tid}"):
                continue  # the thread ended
            return glob.glob("/proc/[0-9]*/stat")  # no children files (a kernel without CONFIG_PROC_CHILDREN)
    return [f"/proc/{pid}/stat" for pid in pids]


def _worker_children(parent: int | None = None) -> list[int]:
    """Pids of the children of ``parent`` (this process by default) that run the offload worker."""
    parent = os.getpid() if parent is None else parent
    out = []
    for stat in _child_candidates(parent):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[-1].split()
            if int(fields[1]) != parent or fields[0] == "Z":
                continue
            with open(stat[:-len("stat")] + "cmdline", "rb") as f:
                if b"sofx.offload.process_worker" in f.read():
                    out.append(int(stat.split("/")[2]))
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return out


# (what fails, at which call, the exception): the first reservation; a later block tensor; mapping a file
# that was just created (it must be removed too); a publish buffer after parameters moved into shared memory.
RESERVATION_FAILURES = {
    "first_tensor": ("allocate", lambda name, k: k == 1, OSError(28, "No space left on device")),
    "later_tensor": ("allocate", lambda name, k: k == 7, RuntimeError("unable to mmap 4800 bytes")),
    "mapping": ("open", lambda name, k: k == 3, RuntimeError("unable to mmap: Cannot allocate memory")),
    "publish_buffer": ("allocate", lambda name, k: ".pub" in name and name.endswith(".1") and k > 12,
                       OSError(28, "No space left on device")),
}


@pytest.mark.parametrize("failure", list(RESERVATION_FAILURES))
def test_a_failing_shared_memory_reservation_falls_back_to_thread_and_leaves_nothing_behind(
        failure: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The /dev/shm space check passes, then reserving or mapping the shared tensors fails: a warning,
    the thread executor, no worker started, no shared-memory file and no shared parameter left behind,
    and the trajectory of an optimizer built with executor="thread"."""
    from sofx.offload import shared_memory
    from sofx.offload.thread_executor import ThreadExecutor

    where, fails, error = RESERVATION_FAILURES[failure]
    arenas, calls, failed = [], [0], []
    real_allocate, real_open = shared_memory.SharedMemoryArena.allocate, shared_memory.open_shared_tensor

    def allocate(arena, name, numel, dtype):
        if arena not in arenas:
            arenas.append(arena)
        if where == "allocate":
            calls[0] += 1
            if not failed and fails(name, calls[0]):
                failed.append(sorted(arena.specs))
                raise error
        return real_allocate(arena, name, numel, dtype)

    def open_shared(spec):
        if where == "open":
            calls[0] += 1
            if not failed and fails(spec.path, calls[0]):
                failed.append(sorted(arenas[0].specs))
                raise error
        return real_open(spec)

    monkeypatch.setattr(shared_memory.SharedMemoryArena, "allocate", allocate)
    monkeypatch.setattr(shared_memory, "open_shared_tensor", open_shared)
    torch.manual_seed(0)
    model = SharedMLP()
    ref = copy.deepcopy(model)
    kwargs = dict(lr=1e-2, weight_decay=0.05, max_grad_norm=3.0, block_numel=100)  # some steps clip
    with pytest.warns(RuntimeWarning, match=r"reserving shared memory in \S+ for the process executor failed "
                                            r"\((OSError|RuntimeError): .*\); falling back to the thread executor"
                      ) as record:
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", **kwargs)
    assert record[0].filename == __file__, "the warning names the caller's line"
    assert failed, "the injected failure happened"
    if failure != "first_tensor":
        assert failed[0], "shared tensors had been reserved before the failure"
    if failure == "publish_buffer":
        assert any(".pub" in f for f in failed[0]), "parameters had moved into shared publish buffers"
    assert opt.executor == "thread" and isinstance(opt.engine.executor, ThreadExecutor)
    assert not isinstance(opt.engine._cpu_arena, shared_memory.SharedMemoryArena)
    # nothing half-built is left: no file of the failed arena (named, open or mapped), no worker, no parameter in
    # shared memory
    assert len(arenas) == 1
    assert glob.glob(os.path.join(arenas[0].shm_dir, arenas[0].prefix + "*")) == [] and arenas[0].fds == []
    assert not _held_inodes() & set(arenas[0].inodes)
    assert _worker_children() == []
    assert not any(p.is_shared() for p in model.parameters())
    assert opt.engine._pub, "the thread executor still publishes into swapped buffers"
    monkeypatch.undo()
    ropt = sofx.offload.SpeculativeAdamW(ref.parameters(), executor="thread", **kwargs)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    gen = torch.Generator().manual_seed(0)
    redone = 0
    with opt, ropt:
        for _ in range(5):
            batch = mlp_batch(gen)
            opt.backward(mlp_loss(model, batch))
            ropt.backward(mlp_loss(ref, batch))
            report, rreport = opt.step(), ropt.step()
            assert report.executor == "thread"
            assert (report.committed, report.redone) == (rreport.committed, rreport.redone)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())), \
                "the same trajectory as the thread executor, bit for bit"
            redone += report.redone
    assert redone > 0, "clipping undid and redid speculative steps"


def test_an_operation_failing_in_the_worker_is_raised_with_its_traceback() -> None:
    model = SharedMLP()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=100) as opt:
        executor = opt.engine.executor
        executor.submit(BlockOp(10 ** 6, "undo_now", 0))  # block 0 holds no speculative step
        with pytest.raises(ExecutorError, match=r"(?s)undo_now.*block 0.*has no speculative step.*Traceback"):
            executor.wait(30.0)


class _UnreadableInTheWorker:
    """Pickled fine here; unpickling it raises in the worker (as a message of another sofx version could)."""

    def __reduce__(self):
        return int, ("sofx test: the worker cannot read this message",)


def _unreadable_task_reports_the_exit(opt: sofx.offload.SpeculativeAdamW):
    """``opt``'s process executor given a task its worker cannot read: ``wait()`` raises WorkerDiedError with the
    exit code 1 and the worker's traceback, as the worker exits (well before the timeout). The executor."""
    executor = opt.engine.executor
    executor.submit(_UnreadableInTheWorker())
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"(?s)died \(exit code 1\).*Traceback.*ValueError: invalid literal "
                                              r"for int\(\) with base 10: 'sofx test: the worker cannot read"):
        executor.wait(120.0)
    assert time.monotonic() - start < 90.0, "told as the worker exits, not at the timeout"
    return executor


def test_a_worker_that_raises_is_a_clear_error_with_its_traceback() -> None:
    """The worker fails outside an operation (here: it cannot read a message) and exits: the error names the
    exit code and carries what the worker printed (its traceback went to the terminal only, out of sight in a
    notebook); close() then works and the state is still readable (an exit slower than EXIT_WAIT_S:
    test_a_worker_that_raises_and_is_slow_to_exit_is_reported_with_its_exit_code_and_traceback)."""
    model = SharedMLP()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100)
    opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(0))))
    opt.step()
    executor = _unreadable_task_reports_the_exit(opt)
    steps = [int(opt.state[p]["step"]) for p in model.parameters()]
    opt.close()
    assert executor.process.poll() == 1
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == steps


# The worker's ``sitecustomize`` (its PYTHONPATH): once it has closed its connection and printed what it printed,
# its interpreter takes {seconds} s more to end (as one did on a loaded machine: exit handlers, the teardown of torch);
# ``refuse`` makes it fail its authentication (after connecting, so the main process sees the connection break);
# ``late`` leaves its stderr open {late} s after it exited, in a process that writes one more line there then (as
# a reader thread that got no core for that long on a loaded machine: the stream ends later than the worker).
_SLOW_TO_EXIT = """\
import atexit
import subprocess
import time

with open("/proc/self/cmdline", "rb") as _f:
    _IS_THE_WORKER = b"sofx.offload.process_worker" in _f.read()
if _IS_THE_WORKER:
    atexit.register(time.sleep, {seconds})
if _IS_THE_WORKER and {late}:
    atexit.register(subprocess.Popen, ["sh", "-c", "sleep {late}; echo sofx test: a late line >&2"])
if _IS_THE_WORKER and {refuse}:
    import multiprocessing.connection as _connection

    def _refuse(conn, authkey):
        raise EOFError("sofx test: the worker refuses to authenticate")

    _connection.answer_challenge = _refuse
"""


def _worker_slow_to_exit(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, refuse: bool = False,
                         seconds: float = 3.0, late: float = 0.0) -> None:
    """Workers started from now on take ``seconds`` to end once their connection closed, 15 times ``EXIT_WAIT_S``
    (made 0.2 s): a loaded machine's slowdown where the default 5 s is given; their stderr ends ``late`` s after
    them (see :data:`_SLOW_TO_EXIT`)."""
    from sofx.offload import process_executor

    (tmp_path / "sitecustomize.py").write_text(_SLOW_TO_EXIT.format(seconds=seconds, refuse=refuse, late=late))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(process_executor, "EXIT_WAIT_S", 0.2)


def test_a_worker_that_raises_and_is_slow_to_exit_is_reported_with_its_exit_code_and_traceback(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that fails outside an operation closes its connection, prints its traceback and exits: where its
    exit took longer than EXIT_WAIT_S (a loaded machine), wait() said "the connection to it broke", without the
    exit code. It now waits for the exit within its own timeout, and names the code and the traceback."""
    _worker_slow_to_exit(tmp_path, monkeypatch)
    model = SharedMLP()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100)
    try:
        executor = _unreadable_task_reports_the_exit(opt)
    finally:
        opt.close()
    assert executor.process.poll() == 1


def test_a_worker_that_does_not_exit_after_its_connection_broke_is_reported_at_the_timeout_and_killed_by_close(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose connection broke but that does not exit (here: stuck in an exit handler) is waited for up to
    the timeout of wait(), which then says both facts and what it printed so far; close() kills it at once.

    wait() is called once the worker's traceback was read (printed after its connection closed), so its 5 s are
    left for the exit on a loaded machine too."""
    _worker_slow_to_exit(tmp_path, monkeypatch, seconds=600.0)
    opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="process", block_numel=100, timeout=60.0)
    try:
        executor = opt.engine.executor
        executor.submit(_UnreadableInTheWorker())
        deadline = time.monotonic() + 60
        while "ValueError" not in executor._stderr.tail() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(WorkerDiedError, match=r"(?s)died \(the connection to it broke, and it had not exited "
                                                  r"[0-9.]+ s later\).*its last output so far \(its stderr had not "
                                                  r"ended\):\nTraceback.*ValueError: invalid literal"):
            executor.wait(5.0)
        assert executor.process.poll() is None
        start = time.monotonic()
        opt.close()
        assert time.monotonic() - start < 30.0, "not the optimizer's 60 s timeout"
    finally:
        if executor.process.poll() is None:
            executor.process.kill()
    assert executor.process.wait(timeout=30) == -signal.SIGKILL


def test_a_worker_whose_connection_breaks_while_starting_and_is_slow_to_exit_is_reported_with_its_exit_code(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker connects, then fails (here: its authentication) and exits: where its exit took longer than
    EXIT_WAIT_S (a loaded machine), the constructor raised the bare EOFError of the broken connection. It now
    waits for the exit within its startup timeout, and raises a WorkerDiedError with the exit code and what the
    worker printed."""
    _worker_slow_to_exit(tmp_path, monkeypatch, refuse=True)
    gc.collect()
    before = _resources()
    with pytest.raises(WorkerDiedError, match=r"(?s)died \(exit code 1\) while starting.*its last output:.*"
                                              r"ended while authenticating: EOFError\('sofx test: the worker refuses"):
        sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="process", block_numel=100)
    assert _resources() == before


def test_an_operation_that_cannot_be_sent_is_a_clear_error_and_the_worker_stops_when_closed() -> None:
    """Pickling an operation fails (here: a lambda; a MemoryError could too): the error says so and names the
    pickling error, the worker is alive and goes on with the next operations, and close() stops it by its stop
    message. The sender thread stopped at the failure: wait() said the worker had died, and close() waited its
    10 s for a worker that never got the stop message, then killed it."""
    model = SharedMLP()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=100) as opt:
        ex = opt.engine.executor
        ex.submit(lambda: None)
        with pytest.raises(ExecutorError, match=r"could not be sent to the worker process.*lambda") as failed:
            ex.wait(30.0)
        assert not isinstance(failed.value, WorkerDiedError)
        assert ex.process.poll() is None
        ex.submit(BlockOp(10 ** 6, "commit_all"))
        assert [r.kind for r in ex.wait(30.0)] == ["commit_all"]
        start = time.monotonic()
    assert time.monotonic() - start < 30.0, "not the optimizer's 60 s timeout"
    assert ex.process.poll() == 0, "stopped by its stop message"


def test_the_worker_gets_every_hparam_with_every_operation() -> None:
    """Betas, eps and weight decay change every step (a schedule, a resume): the worker must use them all."""
    torch.manual_seed(0)
    model = SharedMLP()
    ref = copy.deepcopy(model)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100,
                                        max_grad_norm=3.0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    with opt:
        for step in range(12):
            for g in opt.param_groups + ropt.param_groups:
                g["lr"] = 1e-2 * (1 + step % 3)
                g["betas"] = (0.8 + 0.01 * step, 0.99 - 0.001 * step)
                g["eps"] = 10.0 ** -(6 + step % 3)
                g["weight_decay"] = 0.01 * (step % 4)
            batch = mlp_batch(gen)
            opt.backward(mlp_loss(model, batch))
            mlp_loss(ref, batch).backward()
            report = opt.step()
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 3.0)
            ropt.step()
            ropt.zero_grad()
            assert report.executor == "process"
            assert relative_deviation(model, ref) <= TOL


def test_close_stops_the_worker_and_no_shared_memory_file_outlives_the_start() -> None:
    """The shared tensors' files are unlinked as soon as both processes mapped them: training works on the
    mappings, and nothing can be left in /dev/shm however the processes end."""
    model, ref = SharedMLP(), None
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100) as opt:
        worker = opt.engine.executor.process
        assert opt.engine._cpu_arena.specs and _shm_files(opt) == []
        for _ in range(3):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
        assert _shm_files(opt) == []
    assert worker.poll() == 0, "the worker exits cleanly"
    assert relative_deviation(model, ref) <= TOL


def _resources() -> tuple[int, int, list[int], int]:
    """What an optimizer may leave behind in this process: open file descriptors, threads, offload worker
    processes, and mappings of this process's shared-memory files (unlinked, so ``ls /dev/shm`` cannot see them)."""
    shm = os.path.join(sofx.offload.shared_memory.DEFAULT_SHM_DIR, "")
    with open("/proc/self/maps") as f:
        mappings = sum(shm in line for line in f)
    return len(os.listdir("/proc/self/fd")), threading.active_count(), _worker_children(), mappings


@pytest.mark.parametrize("executor,times", [("inline", 20), ("thread", 20), ("process", 2)])
def test_optimizers_made_and_closed_in_a_loop_leave_nothing_behind(executor: str, times: int) -> None:
    """No file descriptor, thread, worker process or shared-memory mapping accumulates (without help from the
    garbage collector), whether the optimizer is closed, left by ``with``, or dropped unclosed."""
    gc.collect()
    before = _resources()
    model = SharedMLP()
    gen = torch.Generator().manual_seed(0)
    for k in range(times):
        opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=100)
        assert opt.executor == executor
        opt.backward(mlp_loss(model, mlp_batch(gen)))
        opt.step()
        if k % 2 == 0:
            with opt:
                opt.backward(mlp_loss(model, mlp_batch(gen)))  # closed between backward and step
        del opt  # unclosed on odd rounds: collected at once
        assert _resources() == before, k
    assert not any(p.is_shared() for p in model.parameters())


def _kill_the_worker(done: threading.Event, once_it_maps: bool) -> None:
    """SIGKILL this process's offload workers as soon as they appear, or (``once_it_maps``) as soon as one has
    mapped a shared tensor: it has connected then and is building its blocks, not yet ready."""
    mark = os.path.join(sofx.offload.shared_memory.DEFAULT_SHM_DIR, "")  # (the files have no name)
    while not done.is_set():
        for pid in _worker_children():
            try:
                if once_it_maps:
                    with open(f"/proc/{pid}/maps") as f:
                        if mark not in f.read():
                            continue
                os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        time.sleep(0.001)


def test_the_error_of_a_worker_that_raised_has_its_last_output_however_late_its_stderr_ends(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker raised and exited, and its stderr ended 1.5 s later, 7 times EXIT_WAIT_S (made 0.2 s): the error
    was made from the lines read by then, the last ones missing. The end of the stream is now waited for once the
    worker exited (OUTPUT_WAIT_S), and the error has every line."""
    _worker_slow_to_exit(tmp_path, monkeypatch, seconds=0.0, late=1.5)
    opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="process", block_numel=100)
    with opt:
        opt.engine.executor.submit(_UnreadableInTheWorker())
        with pytest.raises(WorkerDiedError, match=r"(?s)died \(exit code 1\).*; its last output:\n.*Traceback.*"
                                                  r"ValueError: invalid literal.*\nsofx test: a late line$"):
            opt.engine.executor.wait(120.0)


def test_close_waits_for_the_end_of_the_workers_stderr_and_leaves_no_reader_thread(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    """The worker exited at close(), and its stderr ended 1.5 s later: close() waited 1 s for the stream's reader
    thread and returned with that thread still running (and the last line not yet passed on). It now waits for the
    stream's end once the worker exited (OUTPUT_WAIT_S), so close() leaves no thread behind and every line read."""
    _worker_slow_to_exit(tmp_path, monkeypatch, seconds=0.0, late=1.5)
    before = threading.active_count()
    opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="process", block_numel=100)
    worker = opt.engine.executor.process
    opt.close()
    assert worker.poll() == 0
    assert threading.active_count() == before, [t.name for t in threading.enumerate()]
    assert "sofx test: a late line" in capfd.readouterr().err


_STALL_AFTER_THE_FIRST_MAPPING = """\
import time
import sofx.offload.shared_memory as shared_memory

_open = shared_memory.open_shared_tensor


def _open_then_stall(spec):
    tensor = _open(spec)
    time.sleep(600)  # the test kills this worker now: it has mapped a tensor and is not ready
    return tensor


shared_memory.open_shared_tensor = _open_then_stall
"""


@pytest.mark.parametrize("when", ["at_once", "while_it_maps_the_blocks"])
def test_a_worker_killed_while_starting_fails_the_constructor_and_leaves_nothing_behind(
        when: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real worker SIGKILLed (the OOM killer) before it got ready: a WorkerDiedError from the constructor within a
    moment -- killed while mapping the blocks, after it had connected, a bare EOFError came out instead -- and no
    file in /dev/shm, no mapping, no parameter in shared memory, no hook, thread, descriptor or process.

    "While it maps": the worker's ``sitecustomize`` (its PYTHONPATH here) stalls it after its first mapping, so the
    kill lands there on a loaded machine too (polling alone, the worker got ready first once in CI)."""
    if when != "at_once":
        (tmp_path / "sitecustomize.py").write_text(_STALL_AFTER_THE_FIRST_MAPPING)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    gc.collect()
    before = _resources()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)])  # 100 blocks: mapping them takes a while
    values = [p.detach().clone() for p in model.parameters()]
    done = threading.Event()
    killer = threading.Thread(target=_kill_the_worker, args=(done, when != "at_once"))
    killer.start()
    try:
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker process \(pid \d+\) died \(killed by signal SIGKILL\) "
                                                  r"while starting"):
            sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=4)
        # within a moment of the kill, not at the 120 s startup timeout (the worker's start before it counts too:
        # importing torch, slowed many times on a loaded machine)
        assert time.monotonic() - start < 100.0
    finally:
        done.set()
        killer.join()
    assert glob.glob(os.path.join(sofx.offload.shared_memory.DEFAULT_SHM_DIR, f"sofx-{os.getpid()}-*")) == []
    assert _resources() == before
    assert all(torch.equal(p, v) and not p.is_shared() for p, v in zip(model.parameters(), values))
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_a_worker_that_cannot_start_is_a_clear_error_with_what_it_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's interpreter fails at once (here: a PYTHONHOME without the standard library; a missing module, a
    broken environment): the constructor raises the exit status and the worker's own words, whether the worker was
    gone before its key was written (a BrokenPipeError came out raw) or only while the main process waited for it."""
    monkeypatch.setenv("PYTHONHOME", "/nonexistent")
    gc.collect()
    before = _resources()
    with pytest.raises(WorkerDiedError, match=r"(?s)died \(exit code 1\) while starting.*its last output:.*"
                                              r"No module named 'encodings'"):
        sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="process", block_numel=100)
    assert _resources() == before


def _socket_path_taken(tmp_path: pathlib.Path) -> str:
    """A private directory whose socket's path is taken already (by a file): binding the socket there fails."""
    path = tempfile.mkdtemp(prefix="sofx-worker-", dir=tmp_path)
    pathlib.Path(path, "socket").write_text("")
    return path


# What keeps the worker from starting (monkeypatch target, value) and the words the error must have.
UNSTARTABLE = {
    "no_executable": ((sys, "executable", ""), r"sys\.executable is '' \(Python could not tell its own "
                                               r"interpreter"),
    "no_executable_none": ((sys, "executable", None), r"sys\.executable is None \(Python could not tell"),
    "missing_executable": ((sys, "executable", "/nonexistent/python3"),
                           r"running sys\.executable \('/nonexistent/python3'\) failed: FileNotFoundError"),
    "socket_not_bound": (None, r"binding its unix socket .*/socket failed: OSError: \[Errno 98\] Address already in "
                               r"use"),
    "no_temporary_directory": ((tempfile, "tempdir", "/nonexistent/tmp"),
                               r"making a private directory for its unix socket .* failed: FileNotFoundError"),
}


@pytest.mark.parametrize("case", list(UNSTARTABLE))
def test_a_worker_process_that_cannot_be_started_is_a_clear_error_and_leaves_nothing_behind(
        case: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty or missing ``sys.executable`` (an embedded interpreter), a socket that cannot be bound, a temporary
    directory that cannot be used: the constructor raised the bare OSError (or Popen's TypeError for a None
    executable) from inside the executor. Now an ExecutorError names what failed and says what to do (the thread
    executor needs none of it), and nothing is left behind: no shared memory mapped, no parameter moved, no hook,
    thread, descriptor or process."""
    target, words = UNSTARTABLE[case]
    gc.collect()
    before = _resources()
    model = SharedMLP()
    values = [p.detach().clone() for p in model.parameters()]
    if target is None:
        from sofx.offload import process_executor

        monkeypatch.setattr(process_executor, "_socket_dir", lambda: _socket_path_taken(tmp_path))
    else:
        monkeypatch.setattr(*target)
    with pytest.raises(ExecutorError, match=rf"(?s)the process executor could not start its worker: {words}.*"
                                            r"executor=\"thread\""):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=100)
    monkeypatch.undo()
    assert _resources() == before
    assert all(torch.equal(p, v) and not p.is_shared() for p, v in zip(model.parameters(), values))
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert not list(tmp_path.glob("sofx-worker-*")), "the socket's private directory is removed"


def test_every_block_on_the_device_starts_no_worker_and_trains_as_torch_optim() -> None:
    """``executor="process"`` with every block on the device (``n_device_blocks`` all of them): the constructor raised
    a bare AttributeError ('LocalArena' object has no attribute 'fds': no shared memory was reserved, as nothing
    lives on the CPU). Now no worker process is started (nothing for it to step) and the optimizer trains as
    torch.optim.AdamW does, bit for bit."""
    gc.collect()
    before = _resources()
    torch.manual_seed(0)
    model = SharedMLP()
    ref = copy.deepcopy(model)
    n_blocks = len(sofx.offload.SpeculativeAdamW(copy.deepcopy(model).parameters(), executor="inline",
                                                 block_numel=100).engine.layouts)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100,
                                        n_device_blocks=n_blocks)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    assert opt.executor == "process" and _worker_children() == []
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        mlp_step_side_by_side(opt, ropt, model, ref, gen)
        opt.zero_grad()
    assert relative_deviation(model, ref) == 0.0

    def child() -> str:  # (no worker, no shared memory: a forked child steps its own copy, as with "inline")
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(7))))
        opt.step()
        return "stepped"

    assert _in_a_forked_child(child) == "stepped"  # (it was refused, "its process executor's worker process...")
    opt.close()
    del opt
    assert _resources() == before


@pytest.mark.parametrize("when", ["between_steps", "during_backward"])
def test_a_worker_killed_is_reported_at_the_next_step_and_close_releases_everything(when: str) -> None:
    """SIGKILL (the OOM killer) between two steps, or while the speculative steps run: step() raises at once
    (no hang), so does every later step(); zero_grad() too; close() works and leaves nothing behind."""
    gc.collect()
    before = _resources()
    model = SharedMLP()
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100,
                                        timeout=120.0)
    opt.backward(mlp_loss(model, mlp_batch(gen)))
    opt.step()
    worker = opt.engine.executor.process
    if when == "during_backward":
        opt.backward(mlp_loss(model, mlp_batch(gen)))
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=60)  # (a loaded machine slows tearing a process down many times)
    if when == "between_steps":
        opt.backward(mlp_loss(model, mlp_batch(gen)))  # its operations go to a dead worker
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"died \(killed by signal SIGKILL\)"):
        opt.step()
    assert time.monotonic() - start < 30.0, "at once, not at the timeout"
    with pytest.raises(ExecutorError, match="failed earlier"):
        opt.step()
    with pytest.raises(ExecutorError, match="failed earlier"):
        opt.zero_grad()
    opt.close()
    opt.close()
    with pytest.raises(SofxError, match="closed"):
        opt.step()
    del opt
    assert _resources() == before
    assert not any(p.is_shared() for p in model.parameters())


def _shm_mappings(opt: sofx.offload.SpeculativeAdamW) -> list[str]:
    """This process's mappings of ``opt``'s shared-memory files (they have no name, so ``ls /dev/shm`` cannot see
    them; once the worker has mapped them, only the mappings hold the memory)."""
    arena = opt.engine._cpu_arena
    inodes = {str(i) for i in arena.inodes}
    with open("/proc/self/maps") as f:
        return [line for line in f if len(line.split()) > 5 and line.split()[4] in inodes
                and line.split()[5].startswith(os.path.join(arena.shm_dir, ""))]


def test_close_gives_the_shared_memory_back_while_the_optimizer_is_still_referenced() -> None:
    """close() releases the shared memory although the optimizer object lives on (a notebook variable, a list, a
    scheduler): its blocks held the /dev/shm space until it was garbage-collected, so an optimizer re-created in a
    container with a small /dev/shm found that space still taken. Its state stays readable, as the in-process
    executors' does."""
    model = SharedMLP()
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100)
    opt.backward(mlp_loss(model, mlp_batch(gen)))
    opt.step()
    assert _shm_mappings(opt), "the blocks live in shared memory"
    before = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())}
    opt.close()
    assert _shm_mappings(opt) == [], "close() unmaps every shared tensor"
    assert not any(p.is_shared() for p in model.parameters())
    for i, p in enumerate(model.parameters()):
        state = opt.state[p]
        assert not any(v.is_shared() for v in state.values())
        assert all(torch.equal(state[k], v) for k, v in before[i].items())
    with pytest.raises(SofxError, match="the optimizer is closed"):
        opt.step()
    opt.close()  # idempotent
    assert torch.isfinite(mlp_loss(model, mlp_batch(gen))), "the model keeps its trained values"


def test_a_start_that_fails_after_connecting_closes_the_connection(monkeypatch) -> None:
    """The worker connected, then its start failed (here: made to fail waiting for it to be ready): the
    connection was left open (a file descriptor until the executor was collected) beside the killed worker."""
    from sofx.offload.process_executor import ProcessExecutor

    def not_ready(self, timeout):
        raise ExecutorError("the worker never got ready (made to fail)")

    monkeypatch.setattr(ProcessExecutor, "_wait_ready", not_ready)
    model = SharedMLP()
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ExecutorError, match="made to fail") as failed:
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=100)
    executor = next(f.frame.f_locals["self"] for f in failed.traceback
                    if isinstance(f.frame.f_locals.get("self"), ProcessExecutor))
    assert executor.conn is not None and executor.conn.closed and executor.process.poll() is not None
    assert len(os.listdir("/proc/self/fd")) <= before


def test_sigterm_to_the_process_group_leaves_no_shared_memory_behind() -> None:
    """``timeout``, ``docker stop``, a batch scheduler: SIGTERM to the main process and its worker at once (the
    worker died before it could remove the files; they stayed in /dev/shm)."""
    script = (
        "import os, sys, time, torch, sofx.offload\n"
        "m = torch.nn.Linear(64, 64)\n"
        "opt = sofx.offload.SpeculativeAdamW(m.parameters(), executor='process')\n"
        "opt.backward(m(torch.randn(4, 64)).sum())\n"
        "opt.step()\n"
        "arena = opt.engine._cpu_arena\n"
        "print(os.path.join(arena.shm_dir, arena.prefix), opt.engine.executor.pid, opt.engine.executor._dir, "
        "flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        prefix, worker, socket_dir = proc.stdout.readline().split()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _wait_for_the_worker_to_clean_up(prefix, int(worker))
    assert not os.path.exists(socket_dir)  # removed once the worker had connected (it stayed in /tmp)


def test_a_main_process_killed_without_close_leaves_no_shared_memory_behind() -> None:
    script = (
        "import os, signal, torch, sofx.offload\n"
        "m = torch.nn.Linear(8, 8)\n"
        "opt = sofx.offload.SpeculativeAdamW(m.parameters(), executor='process')\n"
        "arena = opt.engine._cpu_arena\n"
        "print(os.path.join(arena.shm_dir, arena.prefix), opt.engine.executor.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    prefix, worker = _run_until_it_kills_itself(script)
    _wait_for_the_worker_to_clean_up(prefix, int(worker))


_MADE_DURING_KILL = """
import sys, torch, sofx.offload
model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)])  # 100 blocks: mapping them takes a while
sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=4)
print("started", flush=True)
"""

# The ``sitecustomize`` of the main process and its worker (their PYTHONPATH): the main process leaves its pid to the
# worker; the worker stalls where the main process is to be killed, until that process is gone (the worker's parent
# changes; it may have by the time this runs), then goes on as a slow worker would -- it finds nobody to connect to,
# or nobody to tell it is ready, and exits.
_STALL_THE_WORKER = """\
import os
import time

with open("/proc/self/cmdline", "rb") as _f:
    _IS_THE_WORKER = b"sofx.offload.process_worker" in _f.read()
if not _IS_THE_WORKER:
    os.environ["SOFX_TEST_MAIN_PID"] = str(os.getpid())


def _stall_while_the_main_process_lives():
    while os.getppid() == int(os.environ["SOFX_TEST_MAIN_PID"]):
        time.sleep(0.01)


if _IS_THE_WORKER and {when!r} == "before_it_connects":
    _stall_while_the_main_process_lives()  # (before it reads its key and connects)
elif _IS_THE_WORKER:
    import sofx.offload.shared_memory as shared_memory

    _open = shared_memory.open_shared_tensor
    _stalled = []

    def _open_then_stall(spec):
        tensor = _open(spec)
        if not _stalled:  # connected, its first block tensor mapped, not ready
            _stalled.append(True)
            _stall_while_the_main_process_lives()
        return tensor

    shared_memory.open_shared_tensor = _open_then_stall
"""


def _socket_dir(worker: int) -> str:
    """The private directory of the unix socket worker ``worker`` connects to (its last argument)."""
    with open(f"/proc/{worker}/cmdline", "rb") as f:
        return os.path.dirname(f.read().split(b"\0")[-2].decode())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("when", ["before_it_connects", "once_it_connected"])
def test_a_main_process_killed_while_its_worker_starts_leaves_no_shared_memory_behind(
        when: str, signum: int, tmp_path: pathlib.Path) -> None:
    """SIGTERM (what torchrun, SLURM and Kubernetes send first) or SIGKILL to the main process while its worker
    starts (1-5 s: importing torch, mapping the blocks): the shared tensors' files were made before the worker
    and named until it was ready, and stayed in /dev/shm for good (nothing left knew their names); now none ever
    has a name, the worker exits and the socket's directory goes too.

    The worker's ``sitecustomize`` stalls it before it connects, or after its first mapping, until the main
    process is gone, so the signal lands there on a loaded machine too (polling alone, the main process could
    have finished starting before the poll saw the worker, or saw it connected)."""
    (tmp_path / "sitecustomize.py").write_text(_STALL_THE_WORKER.format(when=when))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", _MADE_DURING_KILL], stdout=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    named = os.path.join(sofx.offload.shared_memory.DEFAULT_SHM_DIR, f"sofx-{proc.pid}-*")
    try:
        deadline = time.monotonic() + 180  # (the main process imports torch and sofx first)
        workers: list[int] = []
        while not workers and time.monotonic() < deadline and proc.poll() is None:
            workers = _worker_children(proc.pid)
            time.sleep(0.001)
        assert workers, "the worker started"
        worker, socket_dir = workers[0], _socket_dir(workers[0])
        # (the main process removes the socket's directory once the worker has connected, then sends the blocks)
        while when == "once_it_connected" and os.path.exists(socket_dir) and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert when == "before_it_connects" or not os.path.exists(socket_dir), "the worker connected"
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == -signum
        assert proc.stdout.read() == "", "killed while starting"
        deadline = time.monotonic() + 120  # (a worker stalled before it connects imports torch then)
        while time.monotonic() < deadline and _alive(worker):
            time.sleep(0.05)
        assert not _alive(worker), "the worker exits when its main process is gone"
        assert glob.glob(named) == [], "no shared-memory file is left in /dev/shm"
        assert not os.path.exists(socket_dir), "nor the socket's directory in /tmp"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sofx.offload.shared_memory.remove_files(glob.glob(named))  # (what a failure left)


def _run_until_it_kills_itself(script: str) -> list[str]:
    """Run ``script`` in a fresh interpreter that ends by SIGKILL-ing itself; the words it printed."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == -signal.SIGKILL, out.stderr
    return out.stdout.split()


def _wait_for_the_worker_to_clean_up(prefix: str, worker: int) -> None:
    """A worker whose main process was killed removes the shared-memory files (``prefix*``) and exits (waited for up
    to 120 s: it may finish a step first, and its interpreter took over 5 s to end on a loaded machine)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (glob.glob(prefix + "*") or _alive(worker)):
        time.sleep(0.1)
    assert glob.glob(prefix + "*") == [], "the worker removes the files when its main process is gone"
    assert not _alive(worker), "the worker exits when its main process is gone"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) counts as gone
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_reaches_the_main_process_only() -> None:
    """Ctrl-C in a terminal signals the whole process group: a script that catches the KeyboardInterrupt and
    goes on training must find its worker alive (it died of the SIGINT)."""
    model, ref = SharedMLP(), None
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100) as opt:
        mlp_step_side_by_side(opt, ropt, model, ref, gen)
        os.kill(opt.engine.executor.pid, signal.SIGINT)
        time.sleep(0.2)
        assert opt.engine.executor.process.poll() is None
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
    assert relative_deviation(model, ref) <= TOL


def test_an_interrupt_while_waiting_loses_no_result() -> None:
    """KeyboardInterrupt (here from SIGALRM) while the main thread waits for the worker: the results are read
    by the receiver thread, so waiting again collects every one (an interrupt inside the socket read lost a
    result, or left a message half read and later reads misaligned).

    The signal is sent once the main thread is in wait() (a 0.2 s timer could fire before it got there, on a
    loaded machine)."""
    model = SharedMLP()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=100) as opt:
        ex = opt.engine.executor
        os.kill(ex.pid, signal.SIGSTOP)
        try:
            for k in range(20):
                ex.submit(BlockOp(k, "commit_all"))

            def interrupt(*_):
                raise KeyboardInterrupt

            def send() -> None:
                main, waiting = threading.main_thread(), type(ex).wait.__code__
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    frame = sys._current_frames().get(main.ident)
                    while frame is not None and frame.f_code is not waiting:
                        frame = frame.f_back
                    if frame is not None:
                        signal.pthread_kill(main.ident, signal.SIGALRM)
                        return
                    time.sleep(0.001)

            old = signal.signal(signal.SIGALRM, interrupt)
            sender = threading.Thread(target=send)
            sender.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    ex.wait(30)
            finally:
                sender.join(60)
                signal.signal(signal.SIGALRM, old)
        finally:
            os.kill(ex.pid, signal.SIGCONT)
        assert [r.kind for r in ex.wait(30)] == ["commit_all"] * 20


def test_close_is_bounded_by_its_timeout_and_kills_a_worker_that_does_not_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped worker (SIGSTOP: alive, never answering): close() kills it once its timeout has passed, and at
    once after a wait() that timed out (it waited another 10 s there); a bad timeout is refused first. An optimizer
    collected without close() (or still open at interpreter exit: the same close, which drops the shared state)
    gives it EXIT_WAIT_S: that close waited the optimizer's timeout, where nothing reads the blocks again.

    The close timeout not given here is the optimizer's 60 s, so a close() that waited it (again, or in place of
    the 0.5 s given) is told apart from one that did not by a bound a loaded machine keeps (it had 1.5 s for the
    kill, the reaping and the threads' ends)."""
    from sofx.errors import UnsupportedError
    from sofx.offload import engine
    from sofx.offload.executor import ExecutorTimeout

    monkeypatch.setattr(engine, "EXIT_WAIT_S", 0.5)
    for how in ("waited_first", "timeout_given", "collected"):
        waited_first = how == "waited_first"
        opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="process", block_numel=100,
                                            timeout=60.0)
        ex = opt.engine.executor
        os.kill(ex.pid, signal.SIGSTOP)
        ex.submit(BlockOp(0, "commit_all"))
        if how == "collected":
            start = time.monotonic()
            del opt
            gc.collect()
            took = time.monotonic() - start
            assert 0.5 <= took < 30.0, took
            assert ex.process.poll() == -signal.SIGKILL
            continue
        if waited_first:
            with pytest.raises(ExecutorTimeout, match="alive but not answering"):
                ex.wait(0.2)
        else:
            with pytest.raises(UnsupportedError, match="close timeout must be a number of seconds >= 0, got -1"):
                ex.close(timeout=-1)
        start = time.monotonic()
        if waited_first:
            ex.close()  # (its default timeout: the optimizer's 60 s)
        else:
            ex.close(timeout=0.5)
        took = time.monotonic() - start
        assert took < 30.0 and (waited_first or took >= 0.5), took
        assert ex.process.poll() == -signal.SIGKILL
        opt.close()


def test_closing_the_optimizer_waits_its_timeout_for_a_worker_that_does_not_answer_as_the_thread_executor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """opt.close() gave a stopped worker (SIGSTOP, an operation queued) a fixed 10 s (CLOSE_TIMEOUT_S) before it
    killed it, whatever the optimizer's ``timeout``, where the thread executor's close waits that timeout: the
    process executor's now waits it too.

    The process executor's own default is made a minute here, so a close that did not wait the optimizer's 0.5 s is
    told apart by a bound a loaded machine keeps (it had 2.5 s for the kill, the reaping and the threads' ends)."""
    from sofx.offload import process_executor

    class DefaultCloseOfAMinute(process_executor.ProcessExecutor):
        def __init__(self, *args, close_timeout: float = 60.0, **kwargs) -> None:
            super().__init__(*args, close_timeout=close_timeout, **kwargs)

    monkeypatch.setattr(process_executor, "CLOSE_TIMEOUT_S", 60.0)
    monkeypatch.setattr(process_executor, "ProcessExecutor", DefaultCloseOfAMinute)
    opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="process", block_numel=100, timeout=0.5)
    ex = opt.engine.executor
    os.kill(ex.pid, signal.SIGSTOP)
    ex.submit(BlockOp(10 ** 6, "commit_all"))
    start = time.monotonic()
    opt.close()
    took = time.monotonic() - start
    assert 0.5 <= took < 30.0, took
    assert ex.process.poll() == -signal.SIGKILL


def test_close_leaves_a_worker_that_does_not_die_at_once_to_the_system_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that does not answer and, once killed, does not exit within the time close() gives it (here 0 s; a
    process in uninterruptible sleep, or tearing down a large address space): close() raised a bare
    subprocess.TimeoutExpired and left the connection open; now it releases everything else, warns, and the worker
    exits when the kernel lets it.

    The SIGKILL close() sends is held back until close() has returned: a stopped worker killed at once could exit
    (on the other core, or while close() was descheduled) before even a 0 s wait looked, and close() rightly did not
    warn."""
    from sofx.offload import process_executor
    from sofx.offload.executor import ExecutorTimeout

    monkeypatch.setattr(process_executor, "KILL_WAIT_S", 0.0)
    model = SharedMLP()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), executor="process", block_numel=100, timeout=0.3)
    ex = opt.engine.executor
    os.kill(ex.pid, signal.SIGSTOP)  # hangs
    ex.submit(BlockOp(10 ** 6, "commit_all"))
    held_back = []
    monkeypatch.setattr(ex.process, "kill", lambda: held_back.append(signal.SIGKILL))  # killed, it does not exit yet
    try:
        with pytest.raises(ExecutorTimeout, match="alive but not answering"):
            opt.engine.wait()
        with pytest.warns(RuntimeWarning, match=rf"worker process \(pid {ex.pid}\) did not exit within 0 s of "
                                                r"SIGKILL.*left to the system") as record:
            opt.close()
    finally:
        os.kill(ex.pid, signal.SIGKILL)  # (the kernel lets it exit now)
    assert record[0].filename == __file__, "the warning names the caller's line"
    assert held_back == [signal.SIGKILL], "close() killed the worker"
    assert opt.engine._closed and ex.conn.closed
    assert not any(p.is_shared() for p in model.parameters()), "the shared memory is released all the same"
    assert ex.process.wait(timeout=30) == -signal.SIGKILL


def test_close_without_a_time_limit_waits_for_a_worker_that_answers() -> None:
    """close(timeout=math.inf) lets the worker finish and exit however long it takes (a join's longest wait);
    its deadline overflowed the threads' join (OverflowError: timeout value is too large)."""
    opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="process", block_numel=100)
    ex = opt.engine.executor
    ex.close(timeout=math.inf)
    assert ex.process.poll() == 0
    opt.close()


def test_a_main_process_killed_during_a_step_leaves_no_shared_memory_behind() -> None:
    """Killed (the OOM killer) while the worker steps blocks: the worker cannot send its result and must still
    remove the shared-memory files and the socket's directory (it exited with a broken pipe, leaving both)."""
    script = (
        "import os, signal, torch, sofx.offload\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])\n"
        "opt = sofx.offload.SpeculativeAdamW(m.parameters(), executor='process', block_numel=2**20)\n"
        "arena = opt.engine._cpu_arena\n"
        "print(os.path.join(arena.shm_dir, arena.prefix), opt.engine.executor.pid, opt.engine.executor._dir, "
        "flush=True)\n"
        "for _ in range(3):\n"
        "    opt.backward(m(torch.randn(8, 1024)).square().mean())\n"
        "    opt.step()\n"
        "opt.backward(m(torch.randn(8, 1024)).square().mean())\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # blocks are being stepped\n"
    )
    prefix, worker, sockdir = _run_until_it_kills_itself(script)
    _wait_for_the_worker_to_clean_up(prefix, int(worker))
    assert not os.path.exists(sockdir)


_EXIT_WITHOUT_CLOSE = """
import atexit, sys, torch
import sofx.offload
seen = {}
# registered first, so it runs after the optimizer's own exit handler (atexit runs last-in first-out)
atexit.register(lambda: print("closed", seen["engine"]._closed, "worker", seen["engine"].executor.process.poll(),
                              flush=True))
model = torch.nn.Linear(4, 2)
opt = sofx.offload.SpeculativeAdamW(model.parameters(), executor=sys.argv[1])
seen["engine"] = opt.engine
opt.backward(model(torch.randn(3, 4)).square().mean())
opt.step()
if sys.argv[2] == "raise":
    raise RuntimeError("the script fails")
"""


@pytest.mark.parametrize("ending", ["end", "raise"])
def test_a_script_that_ends_without_close_stops_the_worker_by_its_stop_message(ending: str) -> None:
    """The optimizer is closed before the interpreter finalizes: its worker exits by the stop message (code 0).
    Closed from __del__ during finalization, the sender thread could no longer run, and close() waited 10 s,
    then killed the worker."""
    out = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, "process", ending], capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == (0 if ending == "end" else 1), out.stderr
    assert out.stdout.strip().endswith("closed True worker 0"), (out.stdout, out.stderr)


def _in_a_forked_child(work) -> str:
    """Run ``work()`` in a child forked from this process; what it returned (a str), or its exception's type and
    message. The child ends with ``os._exit`` (no exit handlers, pytest's included), within 60 s."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 0
        try:
            os.close(read)
            try:
                text = work()
            except BaseException as exc:
                text = f"{type(exc).__name__}: {exc}"
            os.write(write, text.encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    with os.fdopen(read, "rb") as f:
        chunks.append(f.read())
    assert os.waitpid(pid, 0)[1] == 0
    return b"".join(chunks).decode()


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_an_optimizer_used_in_a_forked_child_is_refused_and_leaves_the_parents_step_alone(executor: str) -> None:
    """A child forked between backward and step() (os.fork, multiprocessing's "fork") that runs a backward of the
    model took the gradients into the parent's shared-memory gradient buffers (process executor): the parent's
    step silently stepped the sum of both. Its step() waited for a worker that is not its own: the thread
    executor's timeout, or the process executor's "worker died (exit code 0)" of a worker alive and well. In the
    child the optimizer takes no gradient (they stay in .grad, as without it) and its calls are refused at once,
    naming the fork; the parent's trajectory is torch.optim's."""
    model = SharedMLP()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.05, executor=executor,
                                        block_numel=100, timeout=30.0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    try:
        for i in range(3):
            batch = mlp_batch(gen)
            opt.zero_grad()
            opt.backward(mlp_loss(model, batch))
            if i == 1:
                def child() -> str:
                    opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(7))))
                    kept = all(p.grad is not None for p in model.parameters() if p.requires_grad)
                    start = time.monotonic()
                    try:
                        opt.step()
                    except SofxError as exc:
                        return f"grads kept {kept} in {time.monotonic() - start:.1f} s: {exc}"
                    return "stepped"
                said = _in_a_forked_child(child)
                assert said.startswith("grads kept True in 0."), said
                assert f"created in process {os.getpid()}" in said and "forked" in said, said
            opt.step()
            mlp_loss(ref, batch).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ropt.step()
            ropt.zero_grad()
            assert relative_deviation(model, ref) <= TOL
        # A child forked between steps that reads the state (a fork-based asynchronous checkpoint): the thread
        # executor's is the child's copy, as it was at the fork; the process executor's is the shared memory that
        # the parent goes on stepping (it read the parent's later steps, or one half-written): refused, saying so.
        at_fork = opt.state_dict()["state"]["blocks"][0]["master"].clone()

        def read_in_child() -> str:
            master = opt.state_dict()["state"]["blocks"][0]["master"]
            return f"read, as at the fork: {torch.equal(master, at_fork)}"

        said = _in_a_forked_child(read_in_child)
        if executor == "thread":
            assert said == "read, as at the fork: True", said
        else:
            assert said.startswith("SofxError: state_dict() in process") and "shared memory" in said, said
            assert f"take the state dict in process {os.getpid()} before forking" in said, said
    finally:
        opt.close()


# A script's step with the process executor, after it imported sofx (from a checkout: see the two tests below)
_TRAINS_WITH_THE_PROCESS_EXECUTOR = """\
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process") as opt:
    opt.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    print("executor", opt.executor)
"""

_IMPORTED_FROM_ITS_PATH = """\
import sys
sys.path.insert(0, sys.argv[1])  # (a checkout beside an installed sofx, a notebook's sys.path.append(".."))
import torch
import sofx.offload
assert sofx.__file__.startswith(sys.argv[1]), sofx.__file__
""" + _TRAINS_WITH_THE_PROCESS_EXECUTOR


def test_the_worker_imports_the_sofx_the_main_process_imported(tmp_path: pathlib.Path) -> None:
    """The worker ran ``python -m sofx.offload.process_worker`` with its own import path (its working directory,
    PYTHONPATH, site-packages): a main process that imported sofx from a directory on its ``sys.path`` (a checkout
    beside an installed release, a notebook's ``sys.path.append``) got a worker running another sofx -- an
    installed one, silently, or none ("No module named 'sofx'"). It imports from the main process's path now."""
    checkout = tmp_path / "checkout"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run_a_script_with_a_marked_checkout(checkout, [_IMPORTED_FROM_ITS_PATH, str(checkout)], elsewhere)


def _run_a_script_with_a_marked_checkout(checkout: pathlib.Path, args: list[str], cwd: pathlib.Path) -> None:
    """Copy sofx into ``checkout`` with a worker module that says it ran, run ``python -c *args`` in ``cwd``, and
    assert that the script trained with the process executor and that its worker was that copy's."""
    shutil.copytree(pathlib.Path(sofx.__file__).parent, checkout / "sofx",
                    ignore=shutil.ignore_patterns("__pycache__"))
    worker = checkout / "sofx" / "offload" / "process_worker.py"
    worker.write_text(worker.read_text() + '\nprint("sofx test: worker module", __file__, file=sys.stderr)\n')
    out = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "executor process", out.stdout
    assert f"sofx test: worker module {worker}" in out.stderr, out.stderr


def test_a_temporary_directory_too_long_for_a_socket_address_is_not_refused(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's unix socket lives in a private directory under the temporary directory; a socket's address holds
    at most 107 bytes (103 on BSDs), and a long ``TMPDIR`` (a job's scratch directory) made the constructor raise
    ``OSError: AF_UNIX path too long``. The directory is made in /tmp then; nothing is left in either."""
    long = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    model = SharedMLP()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process", block_numel=100) as opt:
        assert opt.executor == "process"
        socket_dir = opt.engine.executor._dir
        assert os.path.dirname(socket_dir) == "/tmp"
        for _ in range(2):
            mlp_step_side_by_side(opt, ropt, model, ref, gen)
    assert relative_deviation(model, ref) <= TOL
    assert list(long.glob("sofx-worker-*")) == [] and not os.path.exists(socket_dir)


_IMPORTED_FROM_A_RELATIVE_ENTRY = """\
import os, sys
sys.path.insert(0, "checkout")  # (relative: a notebook's sys.path.append(".."), then an os.chdir)
import torch
import sofx.offload
assert sofx.__file__ == os.path.abspath(os.path.join("checkout", "sofx", "__init__.py")), sofx.__file__
os.chdir("elsewhere")
""" + _TRAINS_WITH_THE_PROCESS_EXECUTOR


def test_the_worker_imports_the_sofx_of_a_relative_path_entry_after_a_chdir(tmp_path: pathlib.Path) -> None:
    """A relative ``sys.path`` entry is resolved by the import system where it is first used (its finder holds the
    directory): a main process that imported sofx through one and then changed its working directory gave the
    worker the entry as text, which named another directory there: the worker ran another sofx (an installed one,
    silently) or none. The worker gets the directory the main process's import system resolved it to."""
    (tmp_path / "elsewhere").mkdir()
    _run_a_script_with_a_marked_checkout(tmp_path / "checkout", [_IMPORTED_FROM_A_RELATIVE_ENTRY], tmp_path)


_A_LONG_IMPORT_PATH = """\
import copy, sys
sys.path.extend(f"/nonexistent/{'d' * 120}/{i}" for i in range(1200))  # (150 KB of JSON: a big runfiles tree's)
import torch
import sofx.offload
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
ref = copy.deepcopy(model)
ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
x = torch.randn(5, 4)
with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="process") as opt:
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(x).square().mean())
        opt.step()
        ref(x).square().mean().backward()
        ropt.step()
        ropt.zero_grad()
    print("executor", opt.executor, max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                                               ref.parameters())))
"""


def test_an_import_path_longer_than_an_argument_may_be_reaches_the_worker() -> None:
    """The worker got the main process's ``sys.path`` as a command-line argument, which Linux holds to 128 KiB
    (MAX_ARG_STRLEN): a longer one (a build tool's runfiles tree lists a directory per dependency) made the
    constructor raise ``OSError: [Errno 7] Argument list too long``. It is read from the worker's stdin now."""
    out = subprocess.run([sys.executable, "-c", _A_LONG_IMPORT_PATH], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[:2] == ["executor", "process"] and float(words[2]) <= 1e-6, out.stdout
