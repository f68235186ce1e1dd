"""``sofx.kernels.threads.started_threads``: the native CPU kernels on threads started for each call.

The bits are those of torch's OpenMP threads (the threads only share the elements out), the request
belongs to the context that made it (another thread keeps torch's threads), the calling thread does only
its share of the work, and a bad request is refused.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from sofx.kernels import _cpu_build, cpu, cpu_fast
from sofx.kernels.base import AdamVariant
from sofx.kernels.threads import native_thread_request, started_threads

from helpers import block_inputs, block_scalars, run_blocks

pytestmark = pytest.mark.skipif(not cpu.native_available(), reason="no C compiler: the cpu backend is the reference")


@pytest.mark.parametrize("backend", [cpu, cpu_fast], ids=["cpu", "cpu_fast"])
@pytest.mark.parametrize("op", ["step", "undo", "undo_redo"])
def test_started_threads_give_the_openmp_threads_bits(backend, op, rng, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    variant = AdamVariant(decoupled=op != "undo")
    s, s_new = block_scalars(rng, 0.1, 0.5), block_scalars(rng, 0.05)
    work = []
    for i, n in enumerate([70001, 5, 130003, 65536 + 129]):
        p, g, m, v = block_inputs(rng, n, torch.float32 if i % 2 else torch.bfloat16, torch.float32)
        work.append((p, g, m, v, torch.randn(n, generator=rng).to(p.dtype), s, False, None))
    want = run_blocks(backend, op, work, variant, s_new, many=True)
    with started_threads(3):  # three started threads: the splits fall inside blocks
        got = run_blocks(backend, op, work, variant, s_new, many=True)
    assert all(torch.equal(a, b) for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))


def test_the_request_reaches_the_native_call_and_belongs_to_its_context(rng, monkeypatch):
    requests = []
    lib = _cpu_build.load()
    adam_many = lib.adam_many

    def spy(*args):
        requests.append(args[8])  # nthreads
        return adam_many(*args)

    monkeypatch.setattr(_cpu_build, "_loaded", [type(lib)(**{**lib.__dict__, "adam_many": spy})])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    p, g, m, v = block_inputs(rng, 1000, torch.float32, torch.float32)
    s = block_scalars(rng, 0.1)

    def step():
        cpu.step(p, g, m, v, s, AdamVariant())

    seen_inside = []
    with started_threads(2):
        step()
        other = threading.Thread(target=lambda: (seen_inside.append(native_thread_request()), step()))
        other.start()
        other.join()
        with started_threads(4):
            step()
        step()
    step()
    assert requests == [-2, 2, -4, -2, 2]  # the other thread kept torch's threads
    assert seen_inside == [2]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_bad_request_is_refused(bad):
    with pytest.raises(ValueError, match="started_threads"):
        with started_threads(bad):
            pass
    assert native_thread_request() == torch.get_num_threads()


def test_a_numpy_or_tensor_request_is_its_int():
    """started_threads(np.int64(2)) was refused as "expected an int >= 1"; it is read as the int 2."""
    np = pytest.importorskip("numpy")
    for n in (np.int64(2), torch.tensor([2])):
        with started_threads(n):
            assert native_thread_request() == -2 and type(native_thread_request()) is int
    with pytest.raises(ValueError, match="started_threads"):
        with started_threads(np.float64(2.0)):
            pass


def test_the_calling_thread_runs_only_its_share():
    """Three started threads on one block: the calling thread's CPU time is about a third of the process's
    (one thread, i.e. a request the native code ignored, would take all of it). In a fresh process whose
    torch uses one thread, so that no OpenMP thread spins beside the call."""
    script = textwrap.dedent("""
        import time, torch
        torch.set_num_threads(1)
        from sofx.kernels import cpu
        from sofx.kernels.base import AdamScalars, AdamVariant
        from sofx.kernels.threads import started_threads
        n = 3 << 20
        p, g, m, v = (torch.rand(n) for _ in range(4))
        s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
        out = (p, m, v)
        def share(started):
            t0, c0 = time.thread_time(), time.process_time()
            for _ in range(20):
                if started:
                    with started_threads(3):
                        cpu.step(p, g, m, v, s, AdamVariant(), out=out)
                else:
                    cpu.step(p, g, m, v, s, AdamVariant(), out=out)
            return (time.thread_time() - t0) / (time.process_time() - c0)
        share(True)
        print(share(False), share(True))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    alone, started = map(float, res.stdout.split())
    assert alone > 0.9
    assert started < 0.6
