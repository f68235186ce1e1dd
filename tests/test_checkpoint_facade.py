"""Checkpoints of the offload facade (``sofx.offload.SpeculativeAdamW``): its complete state through
sofx.checkpoint, resumed in a fresh process, and async saves racing a speculative step."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import sofx.checkpoint as ck
import sofx.offload
from sofx import tree
from sofx.checkpoint import io as ck_io

from helpers import assert_trees_bitwise, import_written_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAINING = textwrap.dedent('''
    import torch
    from sofx.loss_scale import grad_scaler
    from sofx.offload import SpeculativeAdam, SpeculativeAdamW

    CONFIGS = {
        # name: (model dtype, optimizer class, two param groups?, extra optimizer arguments)
        "one_group": (torch.float32, SpeculativeAdamW, False, {"max_grad_norm": 0.5}),
        "two_groups": (torch.float32, SpeculativeAdam, True, {"weight_decay": 0.01, "max_grad_norm": 2.0}),
        "bf16_model_fp32_master_moments": (torch.bfloat16, SpeculativeAdamW, True, {}),
        "bf16_states": (torch.float32, SpeculativeAdamW, False, {"state_dtype": torch.bfloat16}),
        # fp16 with GradScaler's rule: overflows at first (scale 2**20), then a growth window of 3 clean steps;
        # the checkpoint is taken in the middle of a window
        "fp16_loss_scaler_mid_window": (torch.float16, SpeculativeAdamW, True,
                                        {"loss_scale": grad_scaler(init_scale=2.0 ** 20, growth_interval=3),
                                         "max_grad_norm": 1.0}),
    }


    def build(name):
        dtype, cls, two_groups, extra = CONFIGS[name]
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(dtype)
        if two_groups:
            params = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-2}]
        else:
            params = model.parameters()
        opt = cls(params, lr=1e-2, block_numel=40, executor="thread", **extra)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        return model, opt, sched


    def train(model, opt, sched, start, stop):
        dtype = next(model.parameters()).dtype
        for step in range(start, stop):
            g = torch.Generator().manual_seed(500 + step)
            x, y = torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g)
            opt.zero_grad()
            opt.backward(((model(x).float() - y) ** 2).mean())
            opt.step()
            sched.step()


    def checkpoint(model, opt, sched, step):
        return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step}


    def restore(model, opt, sched, ckpt):
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        return ckpt["step"]
''')

CHILD = textwrap.dedent('''
    import sys
    sys.path.insert(0, sys.argv[1])
    import sofx.checkpoint as ck
    import facade_training as ft
    for name, src, dst, steps in zip(*[iter(sys.argv[2:])] * 4):
        model, opt, sched = ft.build(name)
        with opt:
            step = ft.restore(model, opt, sched, ck.load(src))
            ft.train(model, opt, sched, step, step + int(steps))
            ck.save(dst, ft.checkpoint(model, opt, sched, step + int(steps)))
    print("resumed ok")
''')

N, M = 6, 4  # the fp16 run: tracker 1 of 3 at the checkpoint; after it a growth, then an overflow


def _training(tmp_path):
    return import_written_module(tmp_path, "facade_training", TRAINING, {"facade_child.py": CHILD})


def _snapshot(x):
    return tree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def test_facade_resume_in_a_fresh_process_is_bitwise_the_uninterrupted_run(tmp_path):
    ft = _training(tmp_path)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    args, expected = [], {}
    for name in ft.CONFIGS:
        model, opt, sched = ft.build(name)
        with opt:
            ft.train(model, opt, sched, 0, N + M)
            expected[name] = _snapshot(ft.checkpoint(model, opt, sched, N + M))
        model, opt, sched = ft.build(name)
        with opt:
            ft.train(model, opt, sched, 0, N)
            src = ck.save(tmp_path / f"{name}.n.ckpt", ft.checkpoint(model, opt, sched, N))
        args += [name, src, str(tmp_path / f"{name}.nm.ckpt"), str(M)]
    proc = subprocess.run([sys.executable, str(tmp_path / "facade_child.py"), str(tmp_path), *args], env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ft.CONFIGS:
        resumed = ck.load(tmp_path / f"{name}.nm.ckpt")
        assert_trees_bitwise(resumed, expected[name])
    # what the configurations were meant to exercise really happened
    fp16 = ck.load(tmp_path / "fp16_loss_scaler_mid_window.n.ckpt")["opt"]["state"]["scaler_state"]
    assert fp16["type"] == "GradScalerState" and 0 < fp16["growth_tracker"] < 3 and fp16["scale"] < 2.0 ** 20
    bf16 = ck.load(tmp_path / "bf16_states.n.ckpt")["opt"]["state"]["blocks"][0]
    assert bf16["exp_avg"].dtype == torch.bfloat16 and bf16["master"].dtype == torch.float32
    bf16_model = ck.load(tmp_path / "bf16_model_fp32_master_moments.n.ckpt")
    assert bf16_model["model"]["0.weight"].dtype == torch.bfloat16
    assert bf16_model["opt"]["state"]["blocks"][0]["exp_avg"].dtype == torch.float32
    assert ck.load(tmp_path / "one_group.n.ckpt")["sched"]["last_epoch"] == N


def test_async_save_taken_just_before_a_speculative_step_holds_the_pre_step_values(tmp_path):
    ft = _training(tmp_path)
    model, opt, sched = ft.build("two_groups")
    started, release = threading.Event(), threading.Event()
    real_write = ck_io.serialize_file

    def held_write(*args, **kwargs):
        started.set()
        release.wait(30)
        return real_write(*args, **kwargs)

    with opt:
        ft.train(model, opt, sched, 0, 2)
        live = ft.checkpoint(model, opt, sched, 2)  # live views of the engine's blocks
        before = _snapshot(live)
        ck_io.serialize_file = held_write
        try:
            handle = ck.save_async(tmp_path / "pre.ckpt", live)
            assert started.wait(30) and not handle.done()
            # the next step: its blocks are stepped speculatively, in place, during backward
            g = torch.Generator().manual_seed(502)
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            opt.zero_grad()
            opt.backward(((model(x) - y) ** 2).mean())
            report = opt.step()
            assert report.speculated > 0 and report.committed > 0
            assert not torch.equal(live["opt"]["state"]["blocks"][0]["master"],
                                   before["opt"]["state"]["blocks"][0]["master"])  # really changed in place
            release.set()
            handle.wait(60)
        finally:
            ck_io.serialize_file = real_write
            release.set()
    assert_trees_bitwise(ck.load(tmp_path / "pre.ckpt"), before)


def test_facade_state_round_trips_through_a_checkpoint_file(tmp_path):
    ft = _training(tmp_path)
    model, opt, sched = ft.build("fp16_loss_scaler_mid_window")
    with opt:
        ft.train(model, opt, sched, 0, 3)
        sd = _snapshot(opt.state_dict())
        back = ck.load(ck.save(tmp_path / "sd.ckpt", opt.state_dict()), like=sd)
        assert_trees_bitwise(back, sd)
        opt.load_state_dict(back)
        assert_trees_bitwise(opt.state_dict(), sd)
        bad = _snapshot(sd)
        bad["state"]["blocks"][1]["exp_avg"] = bad["state"]["blocks"][1]["exp_avg"][:-1]
        with pytest.raises(ck.CheckpointMismatchError, match=r"tree\['state'\]\['blocks'\]\[1\]\['exp_avg'\]"):
            ck.load(tmp_path / "sd.ckpt", like=bad)


def test_a_custom_loss_scale_rules_tuple_state_fields_come_back_as_tuples(tmp_path):
    """The facade's state dict holds a tuple field of a loss-scale rule's state as a list (JSON-like); loaded
    back (directly or through a checkpoint file) the field stayed a list, and the rule's update failed at the
    next step (a list plus a tuple). The field comes back as the tuple the rule's state holds."""
    from typing import NamedTuple

    import sofx.offload

    class RecentState(NamedTuple):
        scale: float = 4.0
        recent: tuple = ()

    class RecentRule:
        def init(self) -> RecentState:
            return RecentState()

        def scale(self, state: RecentState) -> float:
            return state.scale

        def update(self, state: RecentState, overflow: bool) -> RecentState:
            return RecentState(state.scale, (state.recent + (bool(overflow),))[-3:])

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with sofx.offload.SpeculativeAdamW(model.parameters(), loss_scale=RecentRule(), executor="inline") as opt:
        for _ in range(2):
            opt.zero_grad()
            opt.backward(model(torch.randn(3, 4)).sum())
            opt.step()
        back = ck.load(ck.save(tmp_path / "sd.ckpt", opt.state_dict()))
        for sd in (opt.state_dict(), back):
            opt.load_state_dict(sd)
            assert opt.engine.scaler_state == RecentState(4.0, (False, False))
            opt.zero_grad()
            opt.backward(model(torch.randn(3, 4)).sum())
            opt.step()


def test_a_loaded_tensor_loss_scale_is_held_as_the_python_number(tmp_path):
    """A state dict whose loss scale is a 0-d tensor (torch's GradScaler keeps one) loaded as is: the
    facade's state_dict() then held a tensor among its JSON-able values until the scale first changed, and a
    checkpoint saved then no longer loaded with a template taken after (nor the other way). It is held as
    the Python float (and the growth tracker as the int) the optimizer's own state holds."""
    from sofx.loss_scale import grad_scaler

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with sofx.offload.SpeculativeAdamW(model.parameters(), loss_scale=grad_scaler(init_scale=1024.0,
                                                                                  growth_interval=2),
                                       executor="inline") as opt:
        template = _snapshot(opt.state_dict())
        sd = _snapshot(template)
        sd["state"]["scaler_state"] = {**sd["state"]["scaler_state"], "scale": torch.tensor(1024.0),
                                       "growth_tracker": torch.tensor(0)}
        opt.load_state_dict(sd)
        held = opt.state_dict()["state"]["scaler_state"]
        assert type(held["scale"]) is float and type(held["growth_tracker"]) is int
        assert held == {"type": "GradScalerState", "scale": 1024.0, "growth_tracker": 0}
        path = ck.save(tmp_path / "sd.ckpt", opt.state_dict())
        assert ck.load(path, like=template)["state"]["scaler_state"] == held
        for _ in range(2):
            opt.zero_grad()
            opt.backward(model(torch.randn(3, 4)).sum())
            opt.step()
        assert opt.state_dict()["state"]["scaler_state"] == {"type": "GradScalerState", "scale": 2048.0,
                                                             "growth_tracker": 0}


def _train_with_schedule(model, opt, sched, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        sched.step()


def _build_with_multistep():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, block_numel=8, executor="inline")
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)
    return model, opt, sched


def test_a_multistep_lr_schedulers_state_round_trips_with_the_facade(tmp_path):
    """MultiStepLR (torch's most common step schedule) keeps its milestones in a collections.Counter: saving
    ``{"opt": opt.state_dict(), "sched": sched.state_dict()}`` as the README shows was refused."""
    model, opt, sched = _build_with_multistep()
    with opt:
        _train_with_schedule(model, opt, sched, 0, 3)
        path = ck.save(tmp_path / "run.ckpt", {"model": model.state_dict(), "opt": opt.state_dict(),
                                               "sched": sched.state_dict()})
        _train_with_schedule(model, opt, sched, 3, 6)
        want = [p.detach().clone() for p in model.parameters()]
    saved = ck.load(path)
    assert type(saved["sched"]["milestones"]) is collections.Counter
    assert saved["sched"]["milestones"] == collections.Counter([2, 4, 4])
    model, opt, sched = _build_with_multistep()
    with opt:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        _train_with_schedule(model, opt, sched, 3, 6)
        assert [g["lr"] for g in opt.param_groups] == [1e-2 * 0.5 ** 3]
    assert all(torch.equal(a, b) for a, b in zip(want, model.parameters()))
