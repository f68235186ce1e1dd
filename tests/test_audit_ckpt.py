"""Checkpoint bugs found by an audit, each reproduced by a test."""

from __future__ import annotations

import collections

import torch

import sofx
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


def _damaged_torch_file(path, pickle_bytes):
    """A torch.save zip whose data.pkl is ``pickle_bytes`` (damaged: not what torch.save writes)."""
    import zipfile

    good = path.parent / "good.pt"
    torch.save({"a": 1}, good)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            zout.writestr(name, pickle_bytes if name.endswith("/data.pkl") else zin.read(name))
    good.unlink()


def test_a_damaged_zero3_file_is_a_corrupt_checkpoint_error(tmp_path):
    """torch.load(weights_only=True) raises KeyError/IndexError/TypeError for some damaged pickles (byte flips in
    the file do it): they came out raw instead of as CorruptCheckpointError."""
    import pytest

    opt = sofx.adamw()
    params = {"w": torch.randn(3)}
    # PROTO 2, BINGET 5 (a memo entry that does not exist), STOP / PROTO 2, STOP (nothing on the stack)
    for i, damaged in enumerate((b"\x80\x02h\x05.", b"\x80\x02.")):
        directory = tmp_path / f"d{i}"
        directory.mkdir()
        _damaged_torch_file(directory / ck.zero3_file_name(0), damaged)
        with pytest.raises(ck.CorruptCheckpointError, match="cannot be read safely"):
            ck.load_zero3(directory, opt, params)
        with pytest.raises(ck.CorruptCheckpointError, match="cannot be read safely"):
            ck.load_zero3_loss_scaler(directory)
