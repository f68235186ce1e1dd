"""Backend selection: "auto" by device and dtype, explicit names, clear errors, life without triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import sofx
from sofx.errors import UnsupportedError
from sofx.kernels import available_backends, cpu, cpu_fast, load_backend, reference, select_backend

from helpers import max_rel_err


def test_auto_picks_cpu_for_cpu_tensors_and_reference_for_the_rest():
    for pdt, sdt in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                     (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        assert select_backend("auto", "cpu", pdt, sdt) is cpu
    assert select_backend("auto", "cpu", torch.float64, torch.float64) is reference
    assert select_backend("auto", "meta", torch.float32, torch.float32) is reference


@pytest.mark.parametrize("undo", ["auto", "algebraic", "exact"])
def test_meta_tensors_plan_every_operation_without_reading_values(undo):
    """Meta tensors (a model's optimizer state planned without memory) go through update, undo and undo_redo:
    the undo strategy is chosen without reading values (a snapshot where it would have read them), and the
    results are meta tensors of the right shapes and dtypes (it failed on Tensor.item())."""
    opt = sofx.adamw(lr=1e-2, undo=undo, state_dtype=torch.float32)
    params = {"w": torch.empty(3, 4, device="meta", dtype=torch.bfloat16), "b": torch.empty(4, device="meta")}
    if undo == "algebraic":  # refused as for real tensors: the dtypes are known, only the values are not
        with pytest.raises(UnsupportedError, match=r"params\['w'\]: undo='algebraic' is impossible: "
                                                   "torch.bfloat16 master weights"):
            opt.update(params, params, opt.init(params))
        params["w"] = params["w"].float()
    state = opt.init(params)
    p1, s1, record = opt.update(params, params, state)
    assert record.strategies() == ["algebraic" if undo == "algebraic" else "snapshot"] * 2
    p0, s0 = opt.undo(p1, s1, record)
    p2, s2, _ = opt.undo_redo(*opt.update(params, params, state), params)
    for tree in (p0, p1, p2, s1.mu, s2.nu):
        assert all(t.is_meta for t in tree.values())
    assert p2["w"].dtype == params["w"].dtype and s2.mu["w"].dtype == torch.float32 and p2["w"].shape == (3, 4)


def test_auto_on_cuda_prefers_triton_when_it_is_installed():
    want = "triton" if "triton" in available_backends() else "reference"
    assert select_backend("auto", torch.device("cuda"), torch.float32, torch.float32).NAME == want
    assert select_backend("auto", "cuda", torch.float64, torch.float64) is reference


def test_explicit_names():
    assert select_backend("reference", "cpu", torch.float64, torch.float64) is reference
    assert select_backend("cpu", "cpu", torch.bfloat16, torch.bfloat16) is cpu
    assert select_backend("cpu_fast", "cpu", torch.float32, torch.float32) is cpu_fast
    assert {"reference", "cpu", "cpu_fast"} <= set(available_backends())


def test_clear_errors_for_unsupported_combinations():
    with pytest.raises(UnsupportedError, match="backend 'cpu' does not support .*float64"):
        select_backend("cpu", "cpu", torch.float64, torch.float64)
    with pytest.raises(UnsupportedError, match="does not support device=cuda"):
        select_backend("cpu", "cuda", torch.float32, torch.float32)
    with pytest.raises(UnsupportedError, match="unknown backend 'gpu'"):
        select_backend("gpu", "cpu", torch.float32, torch.float32)
    if load_backend("triton") is not None:
        with pytest.raises(UnsupportedError, match="backend 'triton' does not support device=cpu"):
            select_backend("triton", "cpu", torch.float32, torch.float32)
    # through an optimizer: the leaf is named, nothing is changed
    params = {"a": torch.randn(3), "b": torch.randn(3, dtype=torch.float64)}
    opt = sofx.adamw(backend="cpu")
    state = opt.init(params)
    before = [t.clone() for t in (params["a"], params["b"], *state.mu.values())]
    with pytest.raises(UnsupportedError, match=r"params\['b'\]: backend 'cpu' does not support .*float64"):
        opt.update(params, params, state, donate=True)
    assert all(torch.equal(x, y) for x, y in zip(before, (params["a"], params["b"], *state.mu.values())))


def test_adam_uses_the_selected_backend(rng):
    params = {"w": torch.randn(300, 7, generator=rng), "b": torch.randn(7, generator=rng).to(torch.bfloat16)}
    grads = {k: torch.randn(v.shape, generator=rng).to(v.dtype) for k, v in params.items()}
    results = {}
    for backend in ("reference", "cpu", "cpu_fast"):
        opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
        state = opt.init(params)
        p, state, _ = opt.update(params, grads, state)
        p, state, _ = opt.update(p, grads, state)
        results[backend] = p
    if cpu.bitwise_with_torch():
        assert all(torch.equal(results["cpu"][k], results["reference"][k]) for k in params)
    # relative to the parameters' magnitudes too: the square roots differ by an ulp where torch's is MKL's
    assert max_rel_err(results["cpu_fast"]["w"], results["reference"]["w"], params["w"]) <= 1e-6
    assert max_rel_err(results["cpu_fast"]["b"].float(), results["reference"]["b"].float()) <= 1e-2


@pytest.mark.parametrize("donate", [False, True])
def test_a_models_parameters_under_no_grad_take_the_native_kernels(donate):
    """A model's parameters (they require grad) stepped under torch.no_grad(), as torch.optim steps them: values,
    not traced tensors, so "auto" takes the cpu kernels and an algebraic undo, with the bits of the same step on
    detached tensors; donated, the parameters themselves are written. In grad mode the step stays
    differentiable (the reference, snapshots), and an explicit native backend is refused saying why."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    params = dict(model.named_parameters())
    values = {k: v.detach().clone() for k, v in params.items()}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = sofx.adamw(lr=1e-2)
    state = opt.init(values)
    want, _, _ = opt.update(values, grads, state)
    with torch.no_grad():
        got, new_state, record = opt.update(params, grads, state, donate=donate)
        assert record.strategies() == ["algebraic", "algebraic"]
        assert all(torch.equal(got[k], want[k]) for k in params)
        assert all((got[k] is params[k]) == donate for k in params)
        assert all(p.requires_grad for p in model.parameters())
        back, _ = opt.undo(got, new_state, record, donate=donate)
    assert all((back[k] - values[k]).abs().max() <= 1e-6 for k in params)
    fresh = dict(torch.nn.Linear(5, 3).named_parameters())
    _, _, record = opt.update(fresh, grads, state)
    assert record.strategies() == ["snapshot", "snapshot"]
    with pytest.raises(UnsupportedError, match=r"requires grad, in grad mode: call under torch.no_grad\(\)"):
        sofx.adamw(backend="cpu").update(fresh, grads, state)


def test_each_leaf_of_a_tree_is_refused_by_its_own_kind(rng):
    """The backend is chosen once per kind of leaf (device, dtypes, traced): a leaf that the named backend
    cannot take is refused even after leaves it can take, and nothing is written."""
    a = torch.randn(5, generator=rng)
    for other, match in ((torch.randn(3, generator=rng, dtype=torch.float64), r"does not support .*float64"),
                         (torch.randn(3, generator=rng).requires_grad_(), r"params\['b'\].*cannot run under")):
        params = {"a": a.clone(), "b": other}
        opt = sofx.adamw(lr=1e-2, backend="cpu")
        state = opt.init({"a": a, "b": other.detach()})
        grads = {"a": torch.randn(5, generator=rng), "b": torch.randn(3, generator=rng, dtype=other.dtype)}
        with pytest.raises(UnsupportedError, match=match):
            opt.update(params, grads, state, donate=True, grads_finite=True)
        assert torch.equal(params["a"], a)


_WITHOUT_TRITON = r"""
import importlib.abc, sys

class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (blocked for this test)")
        return None

sys.meta_path.insert(0, _NoTriton())
for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
    del sys.modules[name]

import torch
import sofx
from sofx.errors import UnsupportedError
from sofx.kernels import available_backends, select_backend

assert "triton" not in available_backends(), available_backends()
assert select_backend("auto", "cuda", torch.float32, torch.float32).NAME == "reference"
assert select_backend("auto", "cpu", torch.float32, torch.float32).NAME == "cpu"
try:
    select_backend("triton", "cuda", torch.float32, torch.float32)
except UnsupportedError as e:
    assert "not available" in str(e), e
else:
    raise AssertionError("selecting triton without triton must fail")
opt = sofx.adamw(lr=1e-2)
params = {"w": torch.randn(50, 3)}
state = opt.init(params)
new, state, record = opt.update(params, {"w": torch.randn(50, 3)}, state)
back, _ = opt.undo(new, state, record)
assert (back["w"] - params["w"]).abs().max() < 1e-6
assert "triton" not in sys.modules
print("ok")
"""


def test_the_library_works_without_triton():
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")


_RACE = r"""
import importlib.abc, importlib.machinery, sys, threading, time

started, returned, main = threading.Event(), threading.Event(), threading.main_thread()


def main_waits_for_the_import():
    # until the main thread, inside load_backend, waits on the module's import lock (or load_backend returned)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not returned.is_set():
        frame, codes = sys._current_frames().get(main.ident), []
        while frame is not None:
            codes.append(frame.f_code)
            frame = frame.f_back
        if load_backend.__code__ in codes and codes[0].co_name == "acquire":
            return
        time.sleep(0.001)


class _Slow(importlib.abc.MetaPathFinder):
    # Imports sofx.kernels.cpu slowly: the module is in sys.modules, still empty, meanwhile.
    def find_spec(self, name, path, target=None):
        if name != "sofx.kernels.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module
        def slow(module):
            started.set()
            main_waits_for_the_import()
            exec_module(module)
        spec.loader.exec_module = slow
        return spec

sys.meta_path.insert(0, _Slow())
from sofx.kernels import load_backend
assert "sofx.kernels.cpu" not in sys.modules
first = threading.Thread(target=load_backend, args=("cpu",))
first.start()
assert started.wait(60)
assert "sofx.kernels.cpu" in sys.modules  # being imported by the first thread
module = load_backend("cpu")
returned.set()
assert hasattr(module, "supports") and hasattr(module, "step_many"), "a half-imported backend was returned"
first.join()
print("ok")
"""


def test_a_backend_two_threads_load_at_once_is_whole_in_both():
    """The offload engine's worker and a helping step() may load a backend at the same time: the second
    must wait for the first's import, not take the module half-initialized from sys.modules.

    The first import goes on once the second waits for it (it slept 0.5 s, and the test 0.2 s before it looked
    for the module being imported: on a loaded machine, the first thread could not have begun yet)."""
    proc = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")


def test_an_optimizer_that_chose_its_backends_still_copies_and_pickles(rng):
    """The backends an optimizer remembers (by name) do not keep it from being deep-copied or pickled, and
    a copy steps as the original does."""
    import copy
    import pickle

    params = {"w": torch.randn(40, generator=rng), "d": torch.randn(5, generator=rng, dtype=torch.float64)}
    grads = {k: torch.randn(v.shape, generator=rng, dtype=v.dtype) for k, v in params.items()}
    opt = sofx.adamw(lr=1e-2)
    state = opt.init(params)
    want, _, _ = opt.update(params, grads, state)
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        got, _, _ = other.update(params, grads, state)
        assert all(torch.equal(got[k], want[k]) for k in params)


_NATIVE_ASKED_FOR = r"""
import warnings
import torch
import sofx
from sofx.errors import UnsupportedError
params = {"w": torch.randn(3)}
for backend in ("cpu", "cpu_fast", "auto"):
    opt = sofx.adamw(backend=backend)
    state = opt.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            opt.update(params, params, state)
            print(backend, "ran")
        except UnsupportedError as e:
            print(backend, "refused:", e)
"""


def test_a_native_backend_asked_for_by_name_is_refused_where_it_cannot_be_built(tmp_path):
    """backend="cpu" or "cpu_fast" where the native kernels cannot be built (no compiler here: CC names none)
    ran the reference math, several times slower, behind a warning; asked for by name, it is refused with the
    reason. "auto" still runs the reference math."""
    import os

    missing = str(tmp_path / "no-such-cc")
    env = dict(os.environ, CC=missing, SOFX_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _NATIVE_ASKED_FOR], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout.splitlines()
    assert said[2] == "auto ran", said
    for backend, line in zip(("cpu", "cpu_fast"), said):
        assert line == (f"{backend} refused: params['w']: backend {backend!r} needs the native CPU kernels, "
                        f"unavailable here (no C compiler found: CC={missing!r} names no command here); "
                        "backend='auto' or 'reference' runs the reference math (several times slower), "
                        "SOFX_CPU_NATIVE=0 too"), line


def test_a_native_backend_asked_for_by_name_runs_the_reference_math_where_sofx_cpu_native_0_says_so(tmp_path):
    import os

    env = dict(os.environ, SOFX_CPU_NATIVE="0", SOFX_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _NATIVE_ASKED_FOR], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["cpu ran", "cpu_fast ran", "auto ran"]


def test_an_unsupported_combination_says_what_the_backend_takes_and_what_auto_would_pick():
    """A backend named for a leaf it cannot step says what it takes and which backend ``auto`` picks for that
    leaf, so that the error says what to do (it named the combination only)."""
    with pytest.raises(UnsupportedError, match=r"backend 'cpu' does not support .*float64.*: it takes CPU tensors "
                                               r"with float32, bfloat16 or float16 .*backend='auto' picks "
                                               r"'reference' for this one"):
        select_backend("cpu", "cpu", torch.float64, torch.float64)
    with pytest.raises(UnsupportedError, match=r"backend 'cpu_fast' does not support device=cuda.*: it takes CPU "
                                               r"tensors"):
        select_backend("cpu_fast", "cuda", torch.float32, torch.float32)
    if load_backend("triton") is not None:
        with pytest.raises(UnsupportedError, match=r"backend 'triton' does not support device=cpu.*: it takes CUDA "
                                                   r"tensors \(CPU tensors only under TRITON_INTERPRET=1\).*"
                                                   r"backend='auto' picks 'cpu' for this one"):
            select_backend("triton", "cpu", torch.float32, torch.float32)
