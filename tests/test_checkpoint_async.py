"""sofx.checkpoint.save_async: the snapshot is taken before the call returns; errors come back on wait()."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import sofx
import sofx.checkpoint as ck
from sofx import tree
from sofx.checkpoint import io as ck_io

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(rng, param_dtype=torch.float32, state_dtype=None):
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    params = {"a": torch.randn(64, 16, generator=rng).to(param_dtype), "b": [torch.randn(33, generator=rng)
                                                                            .to(param_dtype)]}
    state = opt.init(params)
    for _ in range(2):
        grads = tree.tree_map(lambda p: torch.randn(p.shape, generator=rng).to(p.dtype), params)
        params, state, _ = opt.update(params, grads, state)
    return opt, params, state


def _clone(t):
    return tree.tree_map(lambda x: x.clone(), t)


def _bits_equal(a, b):
    la, _ = tree.flatten(a)
    lb, _ = tree.flatten(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


def _hold_writes(monkeypatch, timeout: float) -> threading.Event:
    """Hold every save's file write until the returned event is set (or ``timeout`` seconds)."""
    release = threading.Event()
    real = ck_io.serialize_file
    monkeypatch.setattr(ck_io, "serialize_file", lambda *a, **k: (release.wait(timeout), real(*a, **k))[1])
    return release


@pytest.mark.parametrize("param_dtype, state_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32)])
def test_async_save_before_donated_update_holds_pre_step_values(tmp_path, rng, param_dtype, state_dtype):
    opt, params, state = _setup(rng, param_dtype, state_dtype)
    before = _clone({"params": params, "state": state})
    ids = [id(x) for x in tree.flatten((params, state.mu))[0]]
    # Slow the write down so that the in-place step surely runs while the file is being written.
    started, release = threading.Event(), threading.Event()
    real_write = ck_io.serialize_file

    def slow_write(*args, **kwargs):
        started.set()
        release.wait(10)
        return real_write(*args, **kwargs)

    ck_io.serialize_file = slow_write
    try:
        handle = ck.save_async(tmp_path / "pre.ckpt", {"params": params, "state": state})
        assert started.wait(10) and not handle.done()
        grads = tree.tree_map(lambda p: torch.randn(p.shape, generator=rng).to(p.dtype), params)
        params2, state2, _ = opt.update(params, grads, state, donate=True)  # writes into params/state in place
        assert [id(x) for x in tree.flatten((params2, state2.mu))[0]] == ids  # really donated
        assert not _bits_equal(params2, before["params"])
        release.set()
        assert handle.wait(30) == str(tmp_path / "pre.ckpt")
    finally:
        ck_io.serialize_file = real_write
        release.set()
    assert handle.done() and handle.exception() is None
    loaded = ck.load(tmp_path / "pre.ckpt", like=before)
    assert _bits_equal(loaded, before)
    assert loaded["state"].count["a"].item() == 2


def test_wait_reraises_the_write_error_and_keeps_previous(tmp_path, rng, monkeypatch):
    path = tmp_path / "e.ckpt"
    ck.save(path, {"x": torch.arange(3)})

    def failing(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(ck_io, "serialize_file", failing)
    handle = ck.save_async(path, {"x": torch.zeros(3)})
    with pytest.raises(OSError, match="no space left"):
        handle.wait(30)
    assert isinstance(handle.exception(), OSError)
    monkeypatch.undo()
    assert torch.equal(ck.load(path)["x"], torch.arange(3))
    assert ck.stale_temporaries(path) == []


def test_waiting_again_on_a_failed_save_raises_its_error_with_the_same_traceback(tmp_path, monkeypatch):
    """wait() raised the one exception object each time: every call added its frames to the traceback, which grew
    (and held the frames) with each wait of a loop that polls a failed save."""
    import traceback

    def failing(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(ck_io, "serialize_file", failing)
    handle = ck.save_async(tmp_path / "g.ckpt", {"x": torch.zeros(3)})
    lengths = []
    for _ in range(3):
        with pytest.raises(OSError) as info:
            handle.wait(30)
        lengths.append(len(traceback.extract_tb(info.value.__traceback__)))
    assert lengths[0] == lengths[1] == lengths[2], lengths
    # exception(): the save's own frames, without this test's and wait()'s
    assert len(traceback.extract_tb(handle.exception().__traceback__)) == lengths[0] - 2


def test_a_failed_save_does_not_keep_its_snapshot(tmp_path, monkeypatch):
    """Its error is kept until wait(); the traceback's frames no longer hold the snapshot (a loop saving to a
    full disk and waiting at the end grew by a copy of the tree per failed save)."""
    import gc

    def failing(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(ck_io, "serialize_file", failing)
    big = torch.randn(1 << 16)
    handles = []
    for _ in range(3):
        handles.append(ck.save_async(tmp_path / "f.ckpt", {"w": big}, after=handles[-1] if handles else None))
    for h in handles:
        with pytest.raises(OSError):
            h.wait(30)
    gc.collect()
    copies = [o for o in gc.get_objects() if type(o) is torch.Tensor and o.numel() == big.numel() and o is not big]
    assert copies == [], f"{len(copies)} snapshot copies alive after the failed saves"
    assert handles[0].exception().__traceback__ is not None  # where it failed is still shown


def test_a_saver_with_max_pending_waits_for_the_oldest_save(tmp_path, monkeypatch):
    """Saves issued faster than the disk writes them held a snapshot each (190 at once in a loop); with
    ``max_pending=2`` a third save waits until the first is written, and all commit in order."""
    release = _hold_writes(monkeypatch, 30)
    saver = ck.AsyncSaver(max_pending=2)
    saver.save(tmp_path / "a.ckpt", {"x": torch.zeros(3)})
    saver.save(tmp_path / "b.ckpt", {"x": torch.ones(3)})
    third = threading.Thread(target=lambda: saver.save(tmp_path / "c.ckpt", {"x": torch.full((3,), 2.0)}))
    third.start()
    third.join(0.5)
    assert third.is_alive(), "the third save did not wait while two were unfinished"
    release.set()
    third.join(30)
    saver.wait(30)
    assert [float(ck.load(tmp_path / f"{n}.ckpt")["x"][0]) for n in "abc"] == [0.0, 1.0, 2.0]
    with pytest.raises(ck.CheckpointError, match="max_pending = 0"):
        ck.AsyncSaver(max_pending=0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_save_of_the_parent_is_refused_in_a_forked_child_rather_than_waited_for(tmp_path, monkeypatch):
    """A child forked while a save runs (a fork-based DataLoader worker, multiprocessing) has no thread of its
    parent's save: its ``wait()`` waited forever (or its timeout), and a save chained ``after=`` it never started.
    Both are refused in the child, naming the process the save runs in; the parent's save is committed."""
    release = _hold_writes(monkeypatch, 30)
    handle = ck.save_async(tmp_path / "parent.ckpt", {"x": torch.arange(3.0)})
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what each call raised, then leave at once
        words = []
        for call in (lambda: handle.wait(5), lambda: ck.save_async(tmp_path / "child.ckpt", {"y": torch.ones(2)},
                                                                    after=handle)):
            try:
                call()
                words.append("no error")
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                words.append(f"{type(exc).__name__}: {exc}")
        os.write(write, "\n".join(words).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        report = f.read().splitlines()
    os.waitpid(pid, 0)
    release.set()
    assert handle.wait(30) == str(tmp_path / "parent.ckpt")
    for line in report:
        assert line.startswith(f"CheckpointError: the checkpoint save to {tmp_path / 'parent.ckpt'} runs in "
                               f"process {os.getpid()}"), report
    assert not (tmp_path / "child.ckpt").exists()


def test_max_pending_holds_for_saves_issued_by_threads_at_once(tmp_path, monkeypatch):
    """Threads saving through one saver at the same moment: each counted the unfinished saves, then started its
    own under a second hold of the lock, so two could both pass a count of max_pending - 1. Here the count's
    read of ``max_pending`` is slowed to widen that window; at most one save may run at any moment."""
    from sofx.checkpoint import async_save

    class SlowCount(ck.AsyncSaver):
        @property
        def max_pending(self):
            time.sleep(0.02)  # (read between the count and the start)
            return self._max_pending

        @max_pending.setter
        def max_pending(self, value):
            self._max_pending = value

    real_write, real_save_async = ck_io.write, async_save.save_async
    handles, peak = [], []

    def slow_write(*args, **kwargs):
        time.sleep(0.05)
        return real_write(*args, **kwargs)

    def counted(*args, **kwargs):
        peak.append(1 + sum(not h.done() for h in handles))  # the saves running as this one starts
        handles.append(real_save_async(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(ck_io, "write", slow_write)
    monkeypatch.setattr(async_save, "save_async", counted)
    saver = SlowCount(max_pending=1)
    start = threading.Barrier(3)

    def save(k):
        start.wait(10)
        saver.save(tmp_path / f"{k}.ckpt", {"x": torch.full((3,), float(k))})

    threads = [threading.Thread(target=save, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    saver.wait(30)
    assert len(handles) == 3 and max(peak) == 1, peak
    assert sorted(float(ck.load(tmp_path / f"{k}.ckpt")["x"][0]) for k in range(3)) == [0.0, 1.0, 2.0]


def test_bad_tree_raises_at_call_time(tmp_path):
    with pytest.raises(ck.CheckpointError, match=r"tree\['x'\]"):
        ck.save_async(tmp_path / "b.ckpt", {"x": object()})
    assert not (tmp_path / "b.ckpt").exists()


def test_an_after_that_is_not_a_save_handle_is_refused_at_call_time(tmp_path, monkeypatch):
    """``after=`` a path (or anything but a handle) was taken: the save failed in its thread with an
    AttributeError, the file never written, seen only at ``wait()``."""
    started, real_snapshot = [], ck_io.snapshot
    monkeypatch.setattr(ck_io, "snapshot", lambda tree: (started.append(tree), real_snapshot(tree))[1])
    for after in (tmp_path / "a.ckpt", "a.ckpt", object()):
        with pytest.raises(ck.CheckpointError, match=r"after= must be a SaveHandle .*got "):
            ck.save_async(tmp_path / "b.ckpt", {"x": torch.zeros(1)}, after=after)
    assert started == [] and list(tmp_path.iterdir()) == []


def test_a_destination_that_save_refuses_is_refused_at_call_time(tmp_path, monkeypatch):
    """A missing directory (or one that is a file, or a path that is a directory) raised only at ``wait()``, as
    torch.save and ``save`` raise at once; it is refused at the call, before any snapshot or thread."""
    started, real_snapshot = [], ck_io.snapshot
    monkeypatch.setattr(ck_io, "snapshot", lambda tree: (started.append(tree), real_snapshot(tree))[1])
    (tmp_path / "file").write_text("")
    for path, message in ((tmp_path / "missing" / "b.ckpt", "directory .*missing does not exist"),
                          (tmp_path / "file" / "b.ckpt", "directory .*file is not a directory"),
                          (tmp_path, "is a directory")):
        with pytest.raises(ck.CheckpointError, match=message):
            ck.save_async(path, {"x": torch.zeros(1)})
        with pytest.raises(ck.CheckpointError, match=message):
            ck.AsyncSaver().save(path, {"x": torch.zeros(1)})
    assert started == [] and not (tmp_path / "missing").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_directory_the_process_cannot_write_is_refused_at_call_time(tmp_path, monkeypatch):
    """A directory the process may not write (its permissions, a read-only file system) raised only at ``wait()``,
    after the snapshot of the whole tree, where torch.save raises PermissionError at once; ``save`` found it only
    after encoding and checksumming the tree. Both refuse it at the call, with the check ``save`` makes of the
    destination: a CheckpointIOError (an OSError) with the system's number, naming the directory, nothing copied
    or written. (os.access answers for the process: root may write any directory, so it is told here.)"""
    import errno

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(locked)
                        else real_access(p, mode, **kw))
    started = []
    monkeypatch.setattr(ck_io, "snapshot", lambda *args: started.append(args))
    monkeypatch.setattr(ck_io, "prepare", lambda *args: started.append(args))
    for save in (ck.save_async, ck.AsyncSaver().save, ck.save):
        with pytest.raises(ck.CheckpointIOError, match=r"cannot save .*locked.b\.ckpt: the directory .*locked is "
                                                       r"not writable by this process") as err:
            save(locked / "b.ckpt", {"x": torch.zeros(1)})
        assert err.value.errno == errno.EACCES and isinstance(err.value, OSError)
    assert started == [] and os.listdir(locked) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write any directory")
def test_a_read_only_directory_is_refused_at_call_time(tmp_path):
    """As above, with the directory's permissions themselves."""
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        for save in (ck.save_async, ck.save):
            with pytest.raises(ck.CheckpointIOError, match=r"the directory .*locked is not writable"):
                save(locked / "b.ckpt", {"x": torch.zeros(1)})
    finally:
        os.chmod(locked, 0o755)
    assert os.listdir(locked) == []


def test_wait_timeout(tmp_path, monkeypatch):
    release = _hold_writes(monkeypatch, 10)
    handle = ck.save_async(tmp_path / "slow.ckpt", {"x": torch.zeros(1)})
    with pytest.raises(TimeoutError):
        handle.wait(0.05)
    assert not handle.done() and "running" in repr(handle)
    release.set()
    assert handle.wait(30) and handle.done()


def test_a_saver_wait_that_times_out_keeps_the_saves_pending(tmp_path, monkeypatch):
    """A timed-out ``AsyncSaver.wait`` forgets nothing: the next wait waits for the save and re-raises its error."""
    release = threading.Event()

    def slow_failing(*args, **kwargs):
        release.wait(10)
        raise OSError("no space left on device")

    monkeypatch.setattr(ck_io, "serialize_file", slow_failing)
    saver = ck.AsyncSaver()
    saver.save(tmp_path / "a.ckpt", {"x": torch.zeros(1)})
    with pytest.raises(TimeoutError):
        saver.wait(timeout=0.05)
    release.set()
    with pytest.raises(OSError, match="no space left"):
        saver.wait(timeout=30)
    saver.wait(timeout=30)  # each error once


class _Interrupt(BaseException):
    """What a signal handler raises in the main thread (as Ctrl-C's KeyboardInterrupt)."""


def _interrupt_once_it_waits_for(handle: ck.SaveHandle) -> threading.Thread:
    """Start a thread that sends SIGALRM to the main thread once it waits for ``handle`` (``SaveHandle.wait`` on its
    stack): a timer could fire before the main thread got there, on a loaded machine."""
    main, waiting = threading.main_thread(), type(handle).wait.__code__

    def send() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main.ident)
            while frame is not None and not (frame.f_code is waiting and frame.f_locals.get("self") is handle):
                frame = frame.f_back
            if frame is not None:
                signal.pthread_kill(main.ident, signal.SIGALRM)
                return
            time.sleep(0.001)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def test_an_interrupted_saver_wait_raises_at_once_and_its_saves_stay_pending(tmp_path, monkeypatch):
    """A signal (Ctrl-C) while ``AsyncSaver.wait`` waits is raised at once: it was taken for a save's error and
    held until every other pending save had finished. The saves go on, and a later wait commits them.

    The saves are held until the test lets them go (held 3 s, they could end before a loaded machine had looked)."""
    release = _hold_writes(monkeypatch, 60)

    def on_alarm(signum, frame):
        raise _Interrupt

    saver = ck.AsyncSaver()
    handles = [saver.save(tmp_path / f"{n}.ckpt", {"x": torch.full((2,), float(i))}) for i, n in enumerate("ab")]
    previous = signal.signal(signal.SIGALRM, on_alarm)
    sender = _interrupt_once_it_waits_for(handles[0])
    try:
        with pytest.raises(_Interrupt):
            saver.wait(timeout=30)
        running = [not h.done() for h in handles]
    finally:
        sender.join(60)
        signal.signal(signal.SIGALRM, previous)
        release.set()
    assert running == [True, True], "the interrupt was held until the saves had finished"
    saver.wait(timeout=30)
    assert [float(ck.load(tmp_path / f"{n}.ckpt")["x"][0]) for n in "ab"] == [0.0, 1.0]


@pytest.mark.parametrize("cut_short", ["timeout", "interrupt"])
def test_a_failed_saves_error_is_kept_when_a_saver_wait_is_cut_short(tmp_path, monkeypatch, cut_short):
    """A save that had failed was forgotten, its error unreported, when a later save's wait timed out or was
    interrupted: the next ``wait`` returned as if every save had been committed.

    The second save is held until the test lets it go (held 3 s, it could end before the wait was cut short on a
    loaded machine), and the interrupt is sent once the wait waits for it."""
    release, issued = threading.Event(), threading.Event()
    real = ck_io.serialize_file

    def writer(specs, filename, metadata=None, **kwargs):
        if os.path.basename(filename).startswith(".a.ckpt."):
            issued.wait(60)  # (failed before the second save, it would be raised by it)
            raise OSError("no space left on device")
        release.wait(60)
        return real(specs, filename, metadata=metadata, **kwargs)

    def on_alarm(signum, frame):
        raise _Interrupt

    monkeypatch.setattr(ck_io, "serialize_file", writer)
    saver = ck.AsyncSaver()
    failed = saver.save(tmp_path / "a.ckpt", {"x": torch.zeros(1)})
    held = saver.save(tmp_path / "b.ckpt", {"x": torch.ones(1)})
    issued.set()
    failed._done.wait(30)
    previous = signal.signal(signal.SIGALRM, on_alarm)
    sender = None
    try:
        if cut_short == "timeout":
            with pytest.raises(TimeoutError):
                saver.wait(timeout=0.2)
        else:
            sender = _interrupt_once_it_waits_for(held)
            with pytest.raises(_Interrupt):
                saver.wait(timeout=30)
    finally:
        if sender is not None:
            sender.join(60)
        signal.signal(signal.SIGALRM, previous)
        release.set()
    with pytest.raises(OSError, match="no space left"):
        saver.wait(timeout=30)
    saver.wait(timeout=30)  # each error once
    assert float(ck.load(tmp_path / "b.ckpt")["x"][0]) == 1.0 and not (tmp_path / "a.ckpt").exists()


def test_a_failed_saves_error_is_raised_by_the_next_save_of_the_saver(tmp_path, monkeypatch):
    """A loop saving through one AsyncSaver and waiting only at the end went on for the whole run while every
    save failed (the directory removed, a full disk): the first error came at the end, with no checkpoint
    written. The next ``save`` after a save failed raises its error, before it snapshots or writes anything;
    each error is reported once."""
    real = ck_io.serialize_file

    def writer(specs, filename, metadata=None, **kwargs):
        if os.path.basename(filename).startswith(".a.ckpt."):
            raise OSError("no space left on device")
        return real(specs, filename, metadata=metadata, **kwargs)

    monkeypatch.setattr(ck_io, "serialize_file", writer)
    for max_pending in (None, 1):
        saver = ck.AsyncSaver(max_pending=max_pending)
        failed = saver.save(tmp_path / "a.ckpt", {"x": torch.zeros(1)})
        failed._done.wait(30)
        started, real_snapshot = [], ck_io.snapshot
        monkeypatch.setattr(ck_io, "snapshot", lambda tree: (started.append(tree), real_snapshot(tree))[1])
        with pytest.raises(OSError, match="no space left") as err:
            saver.save(tmp_path / "b.ckpt", {"x": torch.ones(1)})
        assert err.value is failed.exception() and started == [] and not (tmp_path / "b.ckpt").exists()
        monkeypatch.setattr(ck_io, "snapshot", real_snapshot)
        saver.save(tmp_path / "b.ckpt", {"x": torch.ones(1)})  # reported once: the next save goes on
        saver.wait(30)
        assert float(ck.load(tmp_path / "b.ckpt")["x"][0]) == 1.0 and not (tmp_path / "a.ckpt").exists()
        os.unlink(tmp_path / "b.ckpt")


def test_async_saver_commits_in_order(tmp_path, rng):
    path = tmp_path / "ordered.ckpt"
    x = torch.randn(1000, generator=rng)
    with ck.AsyncSaver() as saver:
        handles = []
        for i in range(6):
            x.add_(1.0)  # in place after each call: each save must hold its own value
            handles.append(saver.save(path, {"i": i, "x": x}))
    assert all(h.done() for h in handles)
    last = ck.load(path)
    assert last["i"] == 5 and torch.equal(last["x"], x)
    other = ck.save_async(tmp_path / "chain.ckpt", {"i": 0}, after=handles[-1])
    assert other.wait(30).endswith("chain.ckpt")


def test_max_pending_given_as_numpy_is_an_int_and_a_bool_or_float_is_refused():
    """AsyncSaver(max_pending=np.int64(2)) was refused as no integer; it is read as the int 2."""
    np = pytest.importorskip("numpy")
    for count in (np.int64(2), torch.tensor([2])):
        saver = ck.AsyncSaver(max_pending=count)
        assert saver.max_pending == 2 and type(saver.max_pending) is int
    for bad, kind in ((True, "bool"), (2.0, "float"), ("2", "str")):
        with pytest.raises(ck.CheckpointError, match=r"AsyncSaver: max_pending = .* is invalid; expected an integer "
                                                     r">= 1 .*got " + kind):
            ck.AsyncSaver(max_pending=bad)


def test_a_tree_whose_header_is_too_large_is_refused_at_call_time(tmp_path, monkeypatch):
    """A tree whose file header is larger than safetensors reads (a long string) cannot be saved, and
    ``save_async`` refuses such trees at the call; it was snapshotted and refused only by ``wait()`` (a loop
    learnt of it at its next save, after a copy of the model). It is refused before the copy and the thread,
    by ``save_async`` and ``AsyncSaver.save``; a tree just within the limit is saved."""
    copied, real_store = [], ck_io._store  # (what copies the tensors)
    monkeypatch.setattr(ck_io, "_store", lambda encoded, copy: (copied.append(copy), real_store(encoded, copy))[1])
    tree_ = {"s": "x" * 100_000_000, "w": torch.randn(2, generator=torch.Generator().manual_seed(3))}
    for save in (ck.save_async, ck.AsyncSaver().save):
        with pytest.raises(ck.CheckpointError, match=r"cannot save .*h.ckpt: .*header of \d+ bytes.*at most "
                                                     r"100000000"):
            save(tmp_path / "h.ckpt", tree_)
    assert copied == [] and os.listdir(tmp_path) == []
    tree_["s"] = "x" * 99_999_000
    assert ck.load(ck.save_async(tmp_path / "h.ckpt", tree_).wait())["s"] == tree_["s"]


def test_a_saver_with_block_that_raises_keeps_its_exception_when_a_save_failed_too(tmp_path, monkeypatch):
    """``with AsyncSaver()``'s exit waits for the saves: where the body raised and a save had failed, the save's
    error replaced the body's (which the user saw only as its context). The body's exception propagates, the
    save's failure added to it as a note; a body that succeeded gets the save's error, as before."""

    def failing(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(ck_io, "serialize_file", failing)
    with pytest.raises(ValueError, match="the body's own") as info:
        with ck.AsyncSaver() as saver:
            saver.save(tmp_path / "a.ckpt", {"x": torch.zeros(1)})
            raise ValueError("the body's own")
    assert any("no space left on device" in note and "a.ckpt" in note for note in info.value.__notes__)
    assert saver._pending == []  # the failure was reported (on the body's exception): not raised again
    with pytest.raises(OSError, match="no space left"):
        with ck.AsyncSaver() as saver:
            saver.save(tmp_path / "b.ckpt", {"x": torch.zeros(1)})


def test_a_save_whose_thread_cannot_start_is_refused_naming_the_file(tmp_path, monkeypatch):
    """Python 3.12 refuses to start a thread in an atexit handler ("can't create new thread at interpreter
    shutdown"), and a process at its thread limit refuses too: save_async raised threading's bare RuntimeError
    (the module docstring said such a save is issued and needs its wait()). A CheckpointError names the file and
    says to save synchronously; nothing is written, and the saver has nothing pending."""

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    saver = ck.AsyncSaver()
    for save in (ck.save_async, saver.save):
        with pytest.raises(ck.CheckpointError, match=r"cannot save .*t\.ckpt asynchronously: its writing thread did "
                                                     r"not start \(RuntimeError: can't create new thread at "
                                                     r"interpreter shutdown\); save it with sofx\.checkpoint\.save"):
            save(tmp_path / "t.ckpt", {"x": torch.ones(2)})
    monkeypatch.undo()
    assert saver._pending == [] and os.listdir(tmp_path) == []
    saver.wait()


def test_a_wait_timeout_of_inf_waits_and_one_that_is_not_a_number_is_refused(tmp_path, monkeypatch):
    """``wait(math.inf)`` of a save still running raised threading's bare OverflowError ("timestamp out of range"),
    AsyncSaver.wait's too; ``wait("5")`` a bare TypeError, and a nan was taken as no time. inf (or more than
    threading.TIMEOUT_MAX) waits without a limit; a value that is not a number of seconds, a bool or a nan is
    refused naming the call, before anything is waited for or forgotten."""
    import math

    release = _hold_writes(monkeypatch, 30)
    saver = ck.AsyncSaver()
    handle = saver.save(tmp_path / "a.ckpt", {"x": torch.ones(2)})
    for wait, who in ((handle.wait, "SaveHandle.wait"), (saver.wait, "AsyncSaver.wait")):
        for bad in ("5", math.nan, True, [1]):
            with pytest.raises(ck.CheckpointError, match=rf"^{who}: timeout must be None or a number of seconds"):
                wait(bad)
    assert not handle.done() and saver._pending == [handle]
    threading.Timer(0.05, release.set).start()
    assert handle.wait(math.inf) == str(tmp_path / "a.ckpt")
    release.clear()
    second = saver.save(tmp_path / "a.ckpt", {"x": torch.full((2,), 2.0)})
    threading.Timer(0.05, release.set).start()
    saver.wait(math.inf)
    assert second.done() and saver._pending == [] and float(ck.load(tmp_path / "a.ckpt")["x"][0]) == 2.0


def test_a_save_issued_at_interpreter_exit_is_written_before_the_process_ends(tmp_path):
    """A ``save_async`` issued in an ``atexit`` handler (a last checkpoint saved as the program ends) was lost: the
    interpreter joins its non-daemon threads before it runs the atexit handlers, so the thread started there was
    frozen when the interpreter finalized, and the process exited 0 without the file (its temporary half written),
    silently (the docstring said to call ``wait()`` there). Issued by the main thread while the interpreter exits,
    the save is written in the call (the handle is done); one issued before, never waited for, is still written
    (the interpreter waits for its thread). A real process; the writes are slowed so that a thread would not end
    before the interpreter."""
    script = "\n".join([
        "import atexit, sys, time, torch, sofx.checkpoint as ck",
        "from sofx.checkpoint import io as ck_io",
        "real = ck_io.serialize_file",
        "ck_io.serialize_file = lambda *a, **k: (time.sleep(0.2), real(*a, **k))[1]",
        "d = sys.argv[1]",
        "ck.save_async(d + '/before.ckpt', {'x': torch.full((4,), 1.0)})",
        "def last():",
        "    print(ck.save_async(d + '/at_exit.ckpt', {'x': torch.full((4,), 2.0)}).done(), flush=True)",
        "atexit.register(last)",
    ])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0 and out.stdout.split() == ["True"], (out.returncode, out.stdout, out.stderr[-2000:])
    assert sorted(os.listdir(tmp_path)) == ["at_exit.ckpt", "before.ckpt"]  # (no temporary left)
    assert [float(ck.load(tmp_path / f"{n}.ckpt")["x"][0]) for n in ("before", "at_exit")] == [1.0, 2.0]


def test_a_save_written_in_the_call_at_exit_raises_an_interrupt_and_leaves_no_temporary(tmp_path, monkeypatch):
    """Written in the call (issued by the main thread while the interpreter exits, above), a save interrupted by
    Ctrl-C raises the interrupt there (not kept for a ``wait()`` nobody calls at exit), leaving the previous file
    and no temporary; a failed write is the handle's error, as an asynchronous one's."""
    ck.save(tmp_path / "a.ckpt", {"x": torch.zeros(2)})
    monkeypatch.setattr(threading, "_SHUTTING_DOWN", True, raising=False)
    real = ck_io.serialize_file

    def interrupted(specs, filename, metadata=None, **kwargs):
        real(specs, filename, metadata=metadata, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ck_io, "serialize_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.save_async(tmp_path / "a.ckpt", {"x": torch.ones(2)})
    assert os.listdir(tmp_path) == ["a.ckpt"] and float(ck.load(tmp_path / "a.ckpt")["x"][0]) == 0.0
    monkeypatch.setattr(ck_io, "serialize_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    handle = ck.save_async(tmp_path / "a.ckpt", {"x": torch.ones(2)})
    assert handle.done()
    with pytest.raises(ck.CheckpointIOError, match="disk full"):
        handle.wait()
    assert os.listdir(tmp_path) == ["a.ckpt"]
