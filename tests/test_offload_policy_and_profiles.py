"""The offload engine beside ``sofx.serial.serial_loop_step`` where SPECULATION.md's rules span steps: the
adaptive policy (paused after clipping in ``pause_fraction`` of the last ``window`` steps, resumed after
``quiet_steps`` without) and both loss-scaling profiles (``"torch"``: GradScaler's backoff and growth;
``"deepspeed"``: DynamicLossScaler's hysteresis and window) with clipping and overflow together.

Every step: the engine's loss scale is the serial loop's, the same skip decision, the policy paused exactly
when the rule run on the serial loop's facts says, every speculated block committed or undone, and the
masters within DESIGN.md's 1e-6 relative of the serial loop's parameters.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import sofx
from sofx import AdamHParams, loss_scale
from sofx.offload.block_runner import AdamConfig
from sofx.offload.engine import OffloadEngine
from sofx.serial import init_loop, serial_loop_step
from sofx.speculate import AdaptivePolicy, SpeculationConfig

from test_offload_support import one_torch_thread  # noqa: F401 (autouse fixture)

TOL = 1e-6


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
@pytest.mark.parametrize("profile", ["torch", "deepspeed"])
def test_policy_and_loss_scale_follow_the_serial_loop_step_for_step(profile: str, executor: str) -> None:
    torch.manual_seed(0)
    sizes = [5, 7, 3, 6, 4]
    params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    hp = AdamHParams(1e-2, 0.9, 0.99, 1e-8, 0.01)
    if profile == "deepspeed":
        scaler = loss_scale.deepspeed_scaler(init_scale=2.0 ** 4, scale_window=2, hysteresis=2)
    else:
        scaler = loss_scale.grad_scaler(init_scale=2.0 ** 4, growth_interval=2)
    policy = AdaptivePolicy(window=3, pause_fraction=0.5, quiet_steps=2)
    engine = OffloadEngine([params], lambda: [hp], adam=AdamConfig(decoupled=True),
                           speculation=SpeculationConfig(max_norm=1.0, profile=profile, policy=policy),
                           scaler=scaler, executor=executor, block_numel=8, swap_params=False)
    opt = sofx.adamw(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    loop = init_loop(opt, [p.detach().clone() for p in params], scaler)
    policy_state = policy.init()
    gen = torch.Generator().manual_seed(1)
    seen = {"paused": 0, "resumed": 0, "skipped": 0, "clipped": 0, "undone": 0}
    try:
        for step in range(30):
            scale = engine.loss_scale
            assert scale == scaler.scale(loop.scaler_state), (step, scale, loop.scaler_state)
            size = 1.0 if step % 5 in (1, 2, 3) else 0.02  # runs of clipped steps, then quiet ones
            grads = [torch.randn(s, generator=gen) * size / math.sqrt(s) for s in sizes]
            if step % 7 == 4:
                grads[2][0] = math.inf  # overflow: skipped, the scale backs off (or hysteresis counts down)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the inf's loss)
                (sum((p * g).sum() for p, g in zip(params, grads)) * scale).backward()
            report = engine.step()
            loop, facts = serial_loop_step(opt, loop, [g * scale for g in grads], scaler=scaler, hparams=hp,
                                           max_norm=1.0, profile=profile)
            was_paused = policy_state.paused
            if not facts.skipped:
                policy_state = policy.update(policy_state, facts.clipped)
            assert report.skipped == facts.skipped and report.clipped == facts.clipped, step
            assert report.policy_paused == policy_state.paused, step
            assert report.speculated == report.committed + report.undone, report.summary()
            deviation = max(float((p.detach() - q).abs().max() / q.abs().max()) for p, q in zip(params, loop.params))
            assert deviation <= TOL, (step, deviation)
            seen["paused"] += policy_state.paused and not was_paused
            seen["resumed"] += was_paused and not policy_state.paused
            seen["skipped"] += facts.skipped
            seen["clipped"] += facts.clipped
            seen["undone"] += report.undone > 0
    finally:
        engine.close()
    assert all(seen.values()), seen  # every rule was exercised
