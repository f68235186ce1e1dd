"""The offload engine's lifetime with real threads: close() is bounded and says what it leaves running.

A thread executor whose operation does not finish: close() waits at most the engine's ``timeout`` (at once after a
wait that timed out) and warns that the worker thread is left to finish alone.
"""

from __future__ import annotations

import threading
import time

import pytest

from test_offload_support import SharedMLP, one_torch_thread  # noqa: F401 (one_torch_thread is an autouse fixture)

import sofx.offload
from sofx.offload.block_ops import BlockOp
from sofx.offload.executor import ExecutorTimeout


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
    after a timed-out wait), drops the queued operations and warns that the running one is left to finish."""
    release = threading.Event()
    timer = threading.Timer(4.0, release.set)  # (ends the operation in any case)
    timer.start()
    try:
        opt = sofx.offload.SpeculativeAdamW(SharedMLP().parameters(), executor="thread", block_numel=100,
                                            timeout=0.5)
        executor = opt.engine.executor
        _hang(executor, release)
        if waited_first:
            with pytest.raises(ExecutorTimeout, match="did not finish within 0.5 s"):
                opt.engine.wait()
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"worker is still running the 'ready' operation on block 0 \("
                                                + (r"the last wait for it timed out" if waited_first
                                                   else r"close\(\) waited 0.5 s") +
                                                r".*\).*left to finish alone.*1 queued operation\(s\) were dropped"):
            opt.close()
        took = time.monotonic() - start
        assert took < (0.3 if waited_first else 1.5) and (waited_first or took >= 0.5), took
    finally:
        release.set()
        timer.cancel()
    executor._thread.join(5.0)
    assert not executor._thread.is_alive(), "it stops after the operation it ran"
    assert executor._finished == executor._submitted - 1, "the queued operation did not run"
