"""Checkpoint bugs found by an audit, each reproduced by a test."""

from __future__ import annotations

import collections

import torch

import sofx.checkpoint as ck
import sofx.offload


def _train(model, opt, sched, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        sched.step()


def _build():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, block_numel=8, executor="inline")
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)
    return model, opt, sched


def test_a_multistep_lr_schedulers_state_round_trips_with_the_facade(tmp_path):
    """MultiStepLR (torch's most common step schedule) keeps its milestones in a collections.Counter: saving
    ``{"opt": opt.state_dict(), "sched": sched.state_dict()}`` as the README shows was refused."""
    model, opt, sched = _build()
    with opt:
        _train(model, opt, sched, 0, 3)
        path = ck.save(tmp_path / "run.ckpt", {"model": model.state_dict(), "opt": opt.state_dict(),
                                               "sched": sched.state_dict()})
        _train(model, opt, sched, 3, 6)
        want = [p.detach().clone() for p in model.parameters()]
    saved = ck.load(path)
    assert type(saved["sched"]["milestones"]) is collections.Counter
    assert saved["sched"]["milestones"] == collections.Counter([2, 4, 4])
    model, opt, sched = _build()
    with opt:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        _train(model, opt, sched, 3, 6)
        assert [g["lr"] for g in opt.param_groups] == [1e-2 * 0.5 ** 3]
    assert all(torch.equal(a, b) for a, b in zip(want, model.parameters()))


def test_a_counter_round_trips_with_a_template_and_keeps_its_order(tmp_path):
    c = collections.Counter({"b": 2, 3: 1, "a": 0})
    ck.save(tmp_path / "c.ckpt", {"c": c})
    for back in (ck.load(tmp_path / "c.ckpt"), ck.load(tmp_path / "c.ckpt", like={"c": c})):
        assert type(back["c"]) is collections.Counter and list(back["c"].items()) == list(c.items())
        assert back["c"]["missing"] == 0
