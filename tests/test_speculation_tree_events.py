"""Random event sequences over nested trees of mixed leaves: speculation == serial.

The events test (tests/test_speculation_events.py) runs flat lists of float32/bfloat16 leaves with one scalar
schedule. This one adds what it leaves out: a dict/list tree with a float64 leaf and leaves of 0 and 1 elements,
per-group hparams (a prefix tree) from a schedule and per step, betas that move with the schedule, a beta of 0 or
``lr * weight_decay == 1`` on some steps (no algebraic inverse: snapshot or not speculated), 0-d tensor hparams,
a snapshot budget, the adaptive policy with its defaults, bias correction off.

Without donation the two loops are bitwise equal at every step (SPECULATION.md section 3; ``speculative_step``'s
docstring), the same loss-scaler states, schedule positions and counts; with donation a block undone (an algebraic
inverse) is within DESIGN.md's tolerance of the serial loop's, the others bitwise, and the paths are then
re-synchronised. Input the serial loop refuses (``undo="algebraic"`` where the inverse does not exist) is refused by
the speculative loop too, with the same error type, changing nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sofx
from sofx import AdamHParams, loss_scale
from sofx import speculate as sp
from sofx.serial import init_loop, serial_loop_step


def _scaler(profile: str, init_scale: float, interval: int):
    if profile == "torch":
        return loss_scale.grad_scaler(init_scale=init_scale, growth_interval=interval)
    return loss_scale.deepspeed_scaler(init_scale=max(init_scale, 2.0), scale_window=interval, hysteresis=1)


_EVENT = st.fixed_dictionaries({
    "clip": st.sampled_from([False, False, True]),
    "overflow": st.sampled_from([None] * 5 + [math.inf, math.nan]),
    "overflow_leaf": st.sampled_from(["a", "w", "one"]),
    "wrong_scale": st.sampled_from([None] * 4 + [0.5, 2.0]),
    "hp": st.sampled_from(["plain", "plain", "beta1_0", "beta2_0", "lrwd_1", "tensor", "neg_zero_lr", "groups"]),
    "final_hp": st.sampled_from([None, None, None, "lr", "betas", "groups", "tensor"]),
    "missing": st.sampled_from([None, None, None, "a", "w", "empty", "one"]),
    "late": st.sampled_from([None, None, None, "a", "w", "one"]),
    "not_last": st.sampled_from([False] * 5 + [True]),
    "order": st.sampled_from(["reverse", "forward", "shuffle"]),
    "seed": st.integers(0, 2 ** 16),
})

_NAMES = ("a", "w", "empty", "one")  # leaf order of the tree below


def _tree(leaves):
    a, w, empty, one = leaves
    return {"a": a, "b": [w, {"empty": empty, "one": one}]}


def _leaves(t):
    return [t["a"], t["b"][0], t["b"][1]["empty"], t["b"][1]["one"]]


def _group_hparams(a_hp, b_hp):
    """Per-group hparams: a prefix tree of the params tree."""
    return {"a": a_hp, "b": b_hp}


_PLAIN = {"clip": False, "overflow": None, "overflow_leaf": "a", "wrong_scale": None, "hp": "plain", "final_hp": None,
          "missing": None, "late": None, "not_last": False, "order": "reverse", "seed": 0}

# The tolerance of a leaf undone (an algebraic inverse, with donation) against the serial loop's, relative to the
# tensor's largest value. float64 has float32's: undo="auto"'s lossy check (sofx.kernels.base.lossy_factor) allows a
# float64 step ratios 2^29 times float32's (R = (1 - b2) gh^2 / (b2 v) up to 3 * 2^29), i.e. float32's relative error
# of about 1e-6 (v within (3.3 R + 4) 2^-53, m within 2 R_m 2^-53 of sqrt(v)), not float64's own rounding: a float64
# leaf undone at R = 2e4 comes back with v 2e-12 off (~9000 float64 ulps), at R = 1.5e9 3e-7 off.
_UNDONE_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-6}


@settings(max_examples=40, deadline=None)
@example(decoupled=False, bias_correction=True, undo="auto", profile="deepspeed", predict=True, max_norm=None,
         missing_grad="skip", budget=None, init_scale=2.0 ** 8, interval=1, a_dtype=torch.float32, donate=True,
         events=[dict(_PLAIN, seed=63), dict(_PLAIN, hp="lrwd_1", final_hp="groups"), _PLAIN], seed=1)
@given(decoupled=st.booleans(), bias_correction=st.booleans(),
       undo=st.sampled_from(["auto", "auto", "exact", "algebraic"]), profile=st.sampled_from(["torch", "deepspeed"]),
       predict=st.booleans(), max_norm=st.sampled_from([None, math.inf, 1.0, 1.0, 0.05]),
       missing_grad=st.sampled_from(["skip", "zero"]), budget=st.sampled_from([None, None, 0, 64]),
       init_scale=st.sampled_from([2.0 ** 8, 4.0, 1.0]), interval=st.integers(1, 3),
       a_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       donate=st.booleans(), events=st.lists(_EVENT, min_size=3, max_size=7), seed=st.integers(0, 2 ** 16))
def test_random_events_over_a_mixed_tree_follow_the_serial_loop(
        decoupled, bias_correction, undo, profile, predict, max_norm, missing_grad, budget, init_scale, interval,
        a_dtype, donate, events, seed):
    gen = torch.Generator().manual_seed(seed)
    make = sofx.adamw if decoupled else sofx.adam
    opt = make(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.05, bias_correction=bias_correction, undo=undo)
    config = sp.SpeculationConfig(max_norm=max_norm, profile=profile, missing_grad=missing_grad,
                                  predict_scale=predict, snapshot_budget_bytes=budget)
    scaler = _scaler(profile, init_scale, interval)
    dtypes = (a_dtype, torch.float64, torch.float32, torch.float32)
    shapes = ((5,), (2, 3), (0,), (1,))
    params = _tree([torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes)])
    ser = spec = init_loop(opt, params, scaler)
    for k, ev in enumerate(events):
        egen = torch.Generator().manual_seed(ev["seed"])
        S = scaler.scale(ser.scaler_state)
        mult = 0.5 if ev["clip"] else 0.01
        grads = [(torch.randn(s, generator=egen) * mult * S).to(d) for s, d in zip(shapes, dtypes)]
        if ev["overflow"] is not None:
            grads[_NAMES.index(ev["overflow_leaf"])].view(-1)[0] = ev["overflow"]
        if ev["missing"] is not None:
            grads[_NAMES.index(ev["missing"])] = None
        late = {}
        if ev["late"] is not None and grads[_NAMES.index(ev["late"])] is not None:
            i = _NAMES.index(ev["late"])
            late[i] = (torch.randn(shapes[i], generator=egen) * mult * S).to(dtypes[i])
        final = [g + late[i] if i in late else g for i, g in enumerate(grads)]
        t = ser.step
        base = AdamHParams(lr=1e-2 * (1 + 0.5 * math.sin(t)), beta1=(0.9, 0.8)[t % 2], beta2=(0.999, 0.99)[t % 2],
                           weight_decay=(0.05, 0.0, 0.2)[t % 3])
        hp = {"plain": base, "beta1_0": base._replace(beta1=0.0), "beta2_0": base._replace(beta2=0.0),
              "lrwd_1": base._replace(lr=0.5, weight_decay=2.0),
              "tensor": AdamHParams(*(None if x is None else torch.tensor(x, dtype=torch.float64) for x in base)),
              "neg_zero_lr": base._replace(lr=-0.0),
              "groups": _group_hparams(base, [base._replace(lr=base.lr * 0.3, weight_decay=0.0),
                                              base._replace(beta1=0.5)])}[ev["hp"]]
        flat_hp = hp if not isinstance(hp, dict) else None
        final_hp = {None: hp,
                    "lr": (flat_hp or base)._replace(lr=base.lr * 0.5),
                    "betas": (flat_hp or base)._replace(beta1=0.7, beta2=0.95),
                    "groups": _group_hparams(base._replace(lr=base.lr * 2), None),
                    "tensor": AdamHParams(*(None if x is None else torch.tensor(float(x)) for x in (flat_hp or base)))
                    }[ev["final_hp"]]
        order = {"reverse": [3, 2, 1, 0], "forward": [0, 1, 2, 3],
                 "shuffle": torch.randperm(4, generator=egen).tolist()}[ev["order"]]
        if donate:
            spec = spec._replace(params=sofx.tree.tree_map(lambda x: x.clone(), spec.params),
                                 opt_state=sofx.AdamState(*(sofx.tree.tree_map(lambda x: x.clone(), part)
                                                            for part in spec.opt_state)))
        kw = dict(donate=donate, validation_hparams=final_hp, order=order, late_grads=late,
                  last_micro_step=not ev["not_last"],
                  backward_scale=S * ev["wrong_scale"] if ev["wrong_scale"] else None)
        try:
            ser_next, facts = serial_loop_step(opt, ser, _tree(final), scaler=scaler, hparams=final_hp,
                                               max_norm=max_norm, profile=profile, missing_grad=missing_grad)
        except (loss_scale.MinLossScaleError, sofx.SofxError) as exc:
            before = [t.clone() for t in sofx.tree.flatten((spec.params, spec.opt_state))[0]]
            with pytest.raises(type(exc)):
                sp.speculative_loop_step(opt, spec, _tree(grads), config=config, scaler=scaler,
                                         hparams=lambda step, hp=hp: hp, **kw)
            if not isinstance(exc, loss_scale.MinLossScaleError):  # refused: nothing changed
                after = sofx.tree.flatten((spec.params, spec.opt_state))[0]
                assert all(torch.equal(a, b) for a, b in zip(before, after)), exc
            return
        spec_next, report = sp.speculative_loop_step(opt, spec, _tree(grads), config=config, scaler=scaler,
                                                     hparams=lambda step, hp=hp: hp, **kw)
        assert spec_next.scaler_state == ser_next.scaler_state and spec_next.step == ser_next.step, k
        assert report.skipped == facts.skipped
        assert report.speculated == report.committed + report.undone, report
        assert report.blocks == 4 == len(report.actions)
        assert report.grad_norm == facts.grad_norm or (math.isnan(report.grad_norm) and math.isnan(facts.grad_norm))
        assert report.clipped == facts.clipped and report.clip_coef == facts.clip_coef
        if ev["not_last"]:
            assert report.speculated == 0
        for name, got, want, prev in (
                ("count", spec_next.opt_state.count, ser_next.opt_state.count, ser.opt_state.count),
                ("mu", spec_next.opt_state.mu, ser_next.opt_state.mu, ser.opt_state.mu),
                ("nu", spec_next.opt_state.nu, ser_next.opt_state.nu, ser.opt_state.nu),
                ("params", spec_next.params, ser_next.params, ser.params)):
            for i, (a, b, c) in enumerate(zip(_leaves(got), _leaves(want), _leaves(prev))):
                assert a.dtype == b.dtype and a.shape == b.shape, (k, name, i)
                if donate and report.actions[i] in ("undo", "undo_redo"):
                    tol = _UNDONE_TOL.get(a.dtype)
                    if a.is_floating_point() and a.numel():
                        # relative to the tensor's largest value before or after the step: a moment of one element
                        # that the redo's step cancels to a small value keeps the inverse's few ulps of the old one
                        big = torch.maximum(b.double().abs().max(), c.double().abs().max()).clamp_min(1e-30)
                        err = float((a.double() - b.double()).abs().max() / big)
                        assert not (a.isnan() & ~b.isnan()).any(), (k, name, _NAMES[i], report.actions)
                        # (undo="algebraic" never falls back to a snapshot: its moments keep the cancellation of
                        # an inverse where beta * m is much smaller than (1 - beta) * g, SPECULATION.md section 2)
                        assert err <= tol or undo == "algebraic", (k, name, _NAMES[i], report.actions, err)
                    else:
                        assert torch.equal(a, b), (k, name, _NAMES[i])
                else:
                    assert torch.equal(a, b), (k, name, _NAMES[i], report.actions, ev)
        ser, spec = ser_next, (ser_next._replace(policy_state=spec_next.policy_state) if donate else spec_next)

