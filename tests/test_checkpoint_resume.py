"""Checkpoints across processes: resume equality in a fresh process, a save killed midway, pickle payloads.

Real subprocesses (``sys.executable``), real files, real SIGKILL.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch

import sofx
import sofx.checkpoint as ck

from helpers import assert_trees_bitwise, import_written_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The training run shared by the parent (uninterrupted and first part) and the child (resumed part).
TRAINING = textwrap.dedent('''
    import torch
    import sofx

    CONFIGS = {
        # name: (optimizer, param dtype, hparams per group or one AdamHParams)
        "one_group": (lambda: sofx.adamw(lr=1e-2, weight_decay=0.05), torch.float32, None),
        "two_groups": (lambda: sofx.adam(lr=1e-2, weight_decay=0.01), torch.float32,
                       {"enc": sofx.AdamHParams(lr=2e-2), "dec": sofx.AdamHParams(lr=5e-3, weight_decay=0.0)}),
        "bf16_master_fp32_moments": (lambda: sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32),
                                     torch.bfloat16,
                                     {"enc": sofx.AdamHParams(lr=3e-2), "dec": sofx.AdamHParams(beta1=0.8)}),
    }


    def init(name):
        make, dtype, _ = CONFIGS[name]
        g = torch.Generator().manual_seed(7)
        params = {"enc": {"w": torch.randn(16, 8, generator=g).to(dtype), "b": torch.randn(8, generator=g).to(dtype)},
                  "dec": [torch.randn(8, 4, generator=g).to(dtype), torch.randn(3, generator=g).to(dtype)]}
        return {"params": params, "state": make().init(params), "step": 0}


    def hparams(name, step):
        """A schedule: the lr decays with the step, so the resumed run must know the step it is at."""
        base = CONFIGS[name][2]
        decay = 0.97 ** step
        scale = lambda hp: hp._replace(lr=(hp.lr if hp.lr is not None else 1e-2) * decay)
        if base is None:
            return scale(sofx.AdamHParams())
        return {k: scale(v) for k, v in base.items()}


    def grads(params, step):
        g = torch.Generator().manual_seed(1000 + step)
        out = sofx.tree.tree_map(lambda p: torch.randn(p.shape, generator=g).to(p.dtype), params)
        if step % 3 == 1:
            out["dec"][1] = None  # a leaf without a gradient: its count falls behind the others
        return out


    def train(name, run, steps):
        if name == SERIAL:
            return train_serial(run, steps)
        opt = CONFIGS[name][0]()
        params, state, step = run["params"], run["state"], run["step"]
        for _ in range(steps):
            params, state, _ = opt.update(params, grads(params, step), state, hparams(name, step),
                                          donate=True)
            step += 1
        return {"params": params, "state": state, "step": step}


    # The functional loop with fp16-style dynamic loss scaling (sofx.serial): GradScaler's rule with a growth
    # window of 3 clean steps; some gradients overflow. Its whole state is one sofx.serial.LoopState.
    SERIAL = "serial_loop_loss_scaler"
    CONFIGS[SERIAL] = (lambda: sofx.adamw(lr=1e-2, weight_decay=0.01), torch.float32, None)
    OVERFLOW_STEPS = (2,)  # calls 0-1 clean, 2 overflows, 3-4 clean: the checkpoint after 5 is mid-window


    def init_serial():
        from sofx.loss_scale import grad_scaler
        from sofx.serial import init_loop

        params = init(SERIAL)["params"]
        return {"loop": init_loop(CONFIGS[SERIAL][0](), params, grad_scaler(init_scale=2.0 ** 10,
                                                                               growth_interval=3)), "calls": 0}


    def train_serial(run, steps):
        from sofx.loss_scale import grad_scaler
        from sofx.serial import serial_loop_step

        opt, scaler = CONFIGS[SERIAL][0](), grad_scaler(init_scale=2.0 ** 10, growth_interval=3)
        loop, calls = run["loop"], run["calls"]
        for _ in range(steps):
            scale = scaler.scale(loop.scaler_state)
            grads = sofx.tree.tree_map(lambda g: g * scale, grads_of(loop.params, calls))  # None stays None
            if calls in OVERFLOW_STEPS:
                grads["enc"]["w"][0, 0] = float("inf")
            loop, _ = serial_loop_step(opt, loop, grads, scaler=scaler, max_norm=5.0,
                                       hparams=lambda step: sofx.AdamHParams(lr=1e-2 * 0.97 ** step))
            calls += 1
        return {"loop": loop, "calls": calls}


    grads_of = grads
''')

CHILD = textwrap.dedent('''
    import sys
    sys.path.insert(0, sys.argv[1])
    import sofx.checkpoint as ck
    import training
    for name, src, dst, steps in zip(*[iter(sys.argv[2:])] * 4):
        run = ck.load(src)  # no template: sofx's own NamedTuples are known
        assert type(run.get("state", run.get("loop"))).__name__ in ("AdamState", "LoopState")
        ck.save(dst, training.train(name, run, int(steps)))
    print("resumed ok")
''')


def _import_training(tmp_path):
    return import_written_module(tmp_path, "training", TRAINING, {"child.py": CHILD})


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_resume_in_a_fresh_process_is_bitwise_the_uninterrupted_run(tmp_path):
    training = _import_training(tmp_path)
    n, m = 5, 4
    args = []
    expected = {}
    for name in training.CONFIGS:
        start = training.init_serial if name == training.SERIAL else training.init
        expected[name] = training.train(name, start(name) if start is training.init else start(), n + m)
        first = training.train(name, start(name) if start is training.init else start(), n)
        src, dst = tmp_path / f"{name}.n.ckpt", tmp_path / f"{name}.nm.ckpt"
        ck.save(src, first)
        args += [name, str(src), str(dst), str(m)]
    proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path), *args], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed ok" in proc.stdout
    serial = ck.load(tmp_path / f"{training.SERIAL}.n.ckpt")["loop"]  # no template: sofx's types are known
    assert type(serial).__name__ == "LoopState" and type(serial.scaler_state).__name__ == "GradScalerState"
    assert serial.scaler_state == type(serial.scaler_state)(512.0, 2) and serial.step == n - 1  # mid-window
    for name in training.CONFIGS:
        resumed = ck.load(tmp_path / f"{name}.nm.ckpt", like=expected[name])
        assert_trees_bitwise(resumed, expected[name])
        if name == training.SERIAL:
            assert resumed["calls"] == n + m and resumed["loop"].step == n + m - 1  # the overflow was skipped
            assert resumed["loop"].scaler_state.scale == 4 * serial.scaler_state.scale  # grew twice after resume
            continue
        assert resumed["step"] == n + m
        if name == "bf16_master_fp32_moments":  # dtypes survive: bf16 master, fp32 moments
            assert resumed["params"]["enc"]["w"].dtype == torch.bfloat16
            assert resumed["state"].mu["enc"]["w"].dtype == torch.float32
        # the leaf that missed gradients has its own, smaller count
        assert resumed["state"].count["dec"][1].item() < resumed["state"].count["dec"][0].item() == n + m


def _loss_scaler(profile):
    """GradScaler's rule or DeepSpeed's, growing the scale every 2 clean steps."""
    from sofx.loss_scale import deepspeed_scaler, grad_scaler

    if profile == "torch":
        return grad_scaler(init_scale=2.0 ** 10, growth_interval=2)
    return deepspeed_scaler(init_scale=2.0 ** 10, scale_window=2, hysteresis=1)


def _speculative_run(profile, loop, start, stop):
    """``speculative_loop_step`` from call ``start`` to ``stop`` with loss scaling (an overflow at call 2),
    clipping and an lr schedule; returns the loop and the step reports."""
    from sofx.speculate import SpeculationConfig, speculative_loop_step

    opt, scaler = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32), _loss_scaler(profile)
    config = SpeculationConfig(max_norm=3.0, profile=profile)
    reports = []
    for call in range(start, stop):
        g = torch.Generator().manual_seed(100 + call)
        scale = float(scaler.scale(loop.scaler_state))
        grads = sofx.tree.tree_map(lambda p: (torch.randn(p.shape, generator=g) * scale).to(p.dtype), loop.params)
        if call == 2:
            grads["a"][0, 0] = float("inf")
        loop, report = speculative_loop_step(opt, loop, grads, config=config, scaler=scaler,
                                             hparams=lambda step: sofx.AdamHParams(lr=1e-2 * 0.9 ** step))
        reports.append(report)
    return loop, reports


@pytest.mark.parametrize("profile", ["torch", "deepspeed"])
def test_the_speculative_loop_resumed_from_any_step_is_bitwise_the_uninterrupted_run(tmp_path, profile):
    """bf16 params with fp32 moments; a checkpoint after every call, among them one right after the skipped
    overflow step and ones right after the loss scale changed, loaded without a template."""
    from sofx.serial import init_loop

    def start():
        g = torch.Generator().manual_seed(0)
        params = {"a": torch.randn(5, 4, generator=g).to(torch.bfloat16),
                  "b": torch.randn(7, generator=g).to(torch.bfloat16)}
        return init_loop(sofx.adamw(state_dtype=torch.float32), params, _loss_scaler(profile))

    calls = 8
    expected, reports = _speculative_run(profile, start(), 0, calls)
    assert reports[2].skipped and expected.step == calls - 1  # the overflow did not count
    assert sum(r.speculated for r in reports) > 0 and sum(r.undone for r in reports) > 0
    for k in range(1, calls):
        first, _ = _speculative_run(profile, start(), 0, k)
        loaded = ck.load(ck.save(tmp_path / "loop.ckpt", {"loop": first, "calls": k}))
        assert type(loaded["loop"]) is type(first)
        resumed, _ = _speculative_run(profile, loaded["loop"], loaded["calls"], calls)
        assert_trees_bitwise(resumed, expected)
    scales = {float(_speculative_run(profile, start(), 0, k)[0].scaler_state.scale) for k in range(calls + 1)}
    assert len(scales) > 2  # backed off at the overflow, then grew


KILLED_SAVER = textwrap.dedent('''
    import sys
    import torch
    import sofx.checkpoint as ck
    path = sys.argv[1]
    i = 0
    while True:
        big = {"i": i, "x": [torch.full((1 << 20,), float(i)) for _ in range(12)],   # 48 MiB per save
               "count": torch.tensor(i, dtype=torch.int64)}
        ck.save(path, big)
        print("saved", i, flush=True)
        i += 1
''')


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(KILLED_SAVER)
    path = tmp_path / "run.ckpt"
    killed_mid_save = False
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, str(script), str(path)], env=_env(), stdout=subprocess.PIPE,
                                text=True)
        try:
            last = -1
            while last < 1:  # at least two complete saves
                line = proc.stdout.readline()
                assert line, "the saver died"
                last = int(line.split()[1])
            deadline = time.monotonic() + 20
            while not ck.stale_temporaries(path) and time.monotonic() < deadline:
                time.sleep(0.001)  # wait until a save is in progress (its temporary file exists) ...
            os.kill(proc.pid, signal.SIGKILL)  # ... and kill it there
        finally:
            proc.kill()
            proc.wait(30)
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL
        loaded = ck.load(path)  # checksums verified
        i = loaded["i"]
        assert i >= last and loaded["count"].item() == i
        assert all(torch.equal(x, torch.full((1 << 20,), float(i))) for x in loaded["x"])
        leftovers = ck.stale_temporaries(path)
        killed_mid_save |= bool(leftovers)
        for f in leftovers:
            os.unlink(f)
        if killed_mid_save:
            break
    assert killed_mid_save, "no attempt caught a save in progress"


def test_a_save_killed_while_writing_leaves_only_temporaries_that_stale_temporaries_lists(tmp_path):
    """safetensors (0.8) writes a file through a temporary of its own (``.tmpXXXXXX`` beside it), renamed at
    its end: a save killed while writing left that file, as large as the checkpoint and named like nobody's,
    which ``stale_temporaries`` did not list (it found sofx's temporary only once the data was written). The
    file being written is now sofx's temporary from its first byte: every leftover is listed."""
    script = tmp_path / "saver.py"
    script.write_text(KILLED_SAVER)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    path = directory / "run.ckpt"
    killed_while_writing = False
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, str(script), str(path)], env=_env(), stdout=subprocess.PIPE,
                                text=True)
        try:
            while int(proc.stdout.readline().split()[1]) < 1:  # two complete saves
                pass
            deadline = time.monotonic() + 20
            while set(os.listdir(directory)) == {"run.ckpt"} and time.monotonic() < deadline:
                time.sleep(0.0005)  # wait until the next save has created a file ...
            os.kill(proc.pid, signal.SIGKILL)  # ... and kill it while it writes
        finally:
            proc.kill()
            proc.wait(30)
            proc.stdout.close()
        leftovers = sorted(str(directory / n) for n in os.listdir(directory) if n != "run.ckpt")
        assert leftovers == ck.stale_temporaries(path)
        assert ck.load(path)["count"].item() >= 1  # the previous checkpoint, checksums verified
        complete = os.path.getsize(path)
        killed_while_writing |= any(os.path.getsize(f) < complete for f in leftovers)
        for f in leftovers:
            os.unlink(f)
        if killed_while_writing:
            break
    assert killed_while_writing, "no attempt killed a save while it wrote"


# --------------------------------------------------------------- pickle payloads
class _Payload:
    """Unpickling this object calls open(marker, 'w'): it would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _payload_bytes(marker):
    return pickle.dumps({"optimizer_state_dict": _Payload(str(marker))})


def test_the_payload_is_real(tmp_path):
    marker = tmp_path / "proof"
    pickle.loads(_payload_bytes(marker))["optimizer_state_dict"].close()
    assert marker.exists()  # plain unpickling runs it: the tests below would notice


def test_pickle_payload_as_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "executed"
    for i, make in enumerate((lambda p: p.write_bytes(_payload_bytes(marker)),
                              lambda p: torch.save({"x": _Payload(str(marker))}, p))):
        path = tmp_path / f"evil{i}.ckpt"
        make(path)
        with pytest.raises(ck.CorruptCheckpointError):
            ck.load(path)
        with pytest.raises(ck.CorruptCheckpointError):
            ck.read_metadata(path)
    assert not marker.exists()


def test_pickle_payload_as_metadata_is_refused(tmp_path):
    from safetensors.torch import save_file

    marker = tmp_path / "executed"
    path = tmp_path / "meta.ckpt"
    payload = _payload_bytes(marker)
    save_file({"tree['x']": torch.zeros(1)}, path,
              metadata={"format": "sofx.checkpoint", "format_version": "1", "tree": payload.decode("latin-1")})
    with pytest.raises(ck.CorruptCheckpointError, match="not valid JSON"):
        ck.load(path)
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_payload_as_zero3_file_is_refused(tmp_path):
    marker = tmp_path / "executed"
    opt = sofx.adamw()
    params = {"w": torch.randn(4)}
    files = ck.save_zero3(tmp_path / "z", opt, params, opt.init(params))
    target = files[0]
    torch.save({"optimizer_state_dict": _Payload(str(marker))}, target)  # a real torch.save zip with the payload
    assert zipfile.is_zipfile(target)
    with pytest.raises(ck.CorruptCheckpointError, match="weights_only"):
        ck.load_zero3(tmp_path / "z", opt, params)
    with open(target, "wb") as f:  # a raw pickle stream in place of the zip
        f.write(_payload_bytes(marker))
    with pytest.raises(ck.CorruptCheckpointError):
        ck.load_zero3(tmp_path / "z", opt, params)
    assert not marker.exists()
