"""Loss scalers: torch.amp.GradScaler side by side, DeepSpeed's DynamicLossScaler rule by table."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sofx import loss_scale as ls
from sofx.errors import HParamError


def _torch_scales(overflows: list[bool], **kwargs) -> list[tuple[float, int]]:
    """Scale and growth tracker of a real torch.amp.GradScaler after each step."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    out = []
    for ov in overflows:
        scaler.scale(p.sum()).backward()
        if ov:
            p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append((scaler.get_scale(), int(scaler._growth_tracker)))
    return out


@given(seq=st.lists(st.booleans(), min_size=1, max_size=40), interval=st.integers(1, 4),
       init=st.sampled_from([1.0, 3.0, 2.0 ** 16, 2.0 ** 126]))
def test_grad_scaler_equals_torch(seq: list[bool], interval: int, init: float):
    rule = ls.grad_scaler(init_scale=init, growth_interval=interval)
    state = rule.init()
    ours = []
    for ov in seq:
        state = rule.update(state, ov)
        ours.append((rule.scale(state), state.growth_tracker))
    assert ours == _torch_scales(seq, init_scale=init, growth_interval=interval)


def test_grad_scaler_defaults_over_a_long_random_sequence():
    rnd = random.Random(0)
    seq = [rnd.random() < 0.0008 for _ in range(4500)]
    rule = ls.grad_scaler()
    state = rule.init()
    assert state == ls.GradScalerState(65536.0, 0)
    scales = []
    for ov in seq:
        state = rule.update(state, ov)
        scales.append(rule.scale(state))
    ref = _torch_scales(seq)
    assert scales == [s for s, _ in ref]


# DeepSpeed rule, window 3, hysteresis 2 (non-consecutive), init 16: the scale after each update.
_DS_EVENTS = "...O.OO...O...OO"
_DS_SCALES = [16, 16, 32, 32, 32, 16, 8, 8, 8, 16, 16, 16, 16, 32, 32, 16]
# Same events with consecutive hysteresis: a clean step restores the hysteresis.
_DS_SCALES_CONSECUTIVE = [16, 16, 32, 32, 32, 32, 16, 16, 16, 32, 32, 32, 32, 64, 64, 32]


@pytest.mark.parametrize("consecutive, expected", [(False, _DS_SCALES), (True, _DS_SCALES_CONSECUTIVE)])
def test_deepspeed_rule_table(consecutive: bool, expected: list[int]):
    rule = ls.deepspeed_scaler(init_scale=16, scale_window=3, hysteresis=2, consecutive_hysteresis=consecutive)
    state = rule.init()
    got = []
    for e in _DS_EVENTS:
        state = rule.update(state, e == "O")
        got.append(rule.scale(state))
    assert got == expected


def test_deepspeed_defaults_grow_after_1000_clean_iterations():
    rule = ls.deepspeed_scaler()
    state = rule.init()
    assert state == ls.DynamicLossScaleState(65536.0, 0, -1, 2)
    for _ in range(999):
        state = rule.update(state, False)
    assert rule.scale(state) == 2.0 ** 16
    state = rule.update(state, False)
    assert rule.scale(state) == 2.0 ** 17
    # one overflow only uses up hysteresis; the window restarts from the overflow
    state = rule.update(state, True)
    assert rule.scale(state) == 2.0 ** 17 and state.cur_hysteresis == 1
    for _ in range(999):
        state = rule.update(state, False)
    assert rule.scale(state) == 2.0 ** 17
    state = rule.update(state, False)
    assert rule.scale(state) == 2.0 ** 18 and state.cur_hysteresis == 2


def test_deepspeed_min_scale_and_error():
    rule = ls.deepspeed_scaler(init_scale=2.0, hysteresis=1)
    state = rule.update(rule.init(), True)
    assert rule.scale(state) == 1.0
    with pytest.raises(ls.MinLossScaleError, match="minimum"):
        rule.update(state, True)
    quiet = ls.deepspeed_scaler(init_scale=2.0, hysteresis=1, raise_error_at_min_scale=False)
    assert quiet.scale(quiet.update(quiet.update(quiet.init(), True), True)) == 1.0


def _deepspeed_reference(events: list[bool], **kw) -> list[float]:
    """The rule as SPECULATION.md states it, written independently as a loop."""
    scale, it, last = kw["init_scale"], 0, -1
    hyst = kw["hysteresis"]
    out = []
    for ov in events:
        if ov:
            if kw["hysteresis"] == 1 or hyst == 1:
                scale = max(scale / 2, 1.0)
            else:
                hyst -= 1
            last = it
        elif (it - last) % kw["scale_window"] == 0:
            hyst = kw["hysteresis"]
            scale *= 2
        it += 1
        out.append(scale)
    return out


@given(events=st.lists(st.booleans(), max_size=60), window=st.integers(1, 5), hysteresis=st.integers(1, 3))
def test_deepspeed_rule_matches_independent_loop(events: list[bool], window: int, hysteresis: int):
    rule = ls.deepspeed_scaler(init_scale=2.0 ** 20, scale_window=window, hysteresis=hysteresis)
    state = rule.init()
    ours = []
    for ov in events:
        state = rule.update(state, ov)
        ours.append(rule.scale(state))
    assert ours == _deepspeed_reference(events, init_scale=2.0 ** 20, scale_window=window, hysteresis=hysteresis)


def test_deepspeed_package_when_installed():
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    rnd = random.Random(1)
    for consecutive in (False, True):
        events = [rnd.random() < 0.05 for _ in range(3000)]
        theirs = loss_scaler.DynamicLossScaler(init_scale=2 ** 16, scale_window=100, delayed_shift=2,
                                               consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
        rule = ls.deepspeed_scaler(scale_window=100, consecutive_hysteresis=consecutive,
                                   raise_error_at_min_scale=False)
        state = rule.init()
        for ov in events:
            theirs.update_scale(ov)
            state = rule.update(state, ov)
            assert rule.scale(state) == theirs.cur_scale
            assert state.cur_hysteresis == theirs.cur_hysteresis


def test_static_scale_and_validation():
    rule = ls.static_scale()
    assert rule.scale(rule.update(rule.init(), True)) == 1.0
    with pytest.raises(HParamError, match="init_scale"):
        ls.grad_scaler(init_scale=0.0)
    with pytest.raises(HParamError, match="backoff_factor"):
        ls.grad_scaler(backoff_factor=1.0)
    with pytest.raises(HParamError, match="scale_window"):
        ls.deepspeed_scaler(scale_window=0)
