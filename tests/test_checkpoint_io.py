"""sofx.checkpoint.save / load: round trips (every dtype and bit), templates, atomicity and clear errors."""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import re
import stat
import struct
import sys
import threading
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import save_file

import sofx
import sofx.checkpoint as ck
from sofx import tree
from sofx.checkpoint import atomic as ck_atomic
from sofx.checkpoint import io as ck_io

from helpers import script_prints_ok, trees_equal


class Pair(NamedTuple):
    a: object
    b: object


def _rand(shape, dtype, g):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def _sample_tree(g):
    opt = sofx.adamw(state_dtype=torch.float32)
    flat = torch.randn(40, generator=g)
    params = {"w": torch.randn(3, 4, generator=g).to(torch.bfloat16),      # bf16 master ...
              "views": [flat[:12].view(3, 4), flat[10:30]],               # ... views sharing one storage
              "t": torch.randn(5, 3, generator=g).t(),                   # non-contiguous
              "none": None}
    state = opt.init(params)                                              # ... fp32 moments, 0-d int64 counts
    state = state._replace(count=tree.tree_map(lambda c: c + 7, state.count),
                           mu=tree.tree_map(lambda m: torch.randn(m.shape, generator=g), state.mu))
    dtypes = {str(d): _rand((2, 3), d, g) for d in (torch.float64, torch.float16, torch.int32, torch.int8,
                                                    torch.uint8, torch.bool, torch.int16)}
    return {"params": params, "state": state, "hp": sofx.AdamHParams(lr=3e-4, beta1=torch.tensor(0.9)),
            "step": 12, "big": 2 ** 70, "flag": True, "lr": 0.1, "inf": float("-inf"), "name": "run-1",
            "dtype": torch.bfloat16, "od": collections.OrderedDict([(3, "x"), ("k", None)]),
            "tup": (1, [2.5, ()], {}), "dtypes": dtypes, "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5)}


def _assert_same(a, b):
    la, sa = tree.flatten(a, is_leaf=lambda x: x is None)
    lb, sb = tree.flatten(b, is_leaf=lambda x: x is None)
    assert sa == sb
    for x, y in zip(la, lb):
        assert type(x) is type(y) or (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor))
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.reshape(-1).view(torch.uint8) if x.numel() else x,
                               y.reshape(-1).view(torch.uint8) if y.numel() else y)
        elif isinstance(x, float) and x != x:
            assert y != y
        else:
            assert x == y


def test_round_trip_every_kind_dtype_and_bit(tmp_path, rng):
    t = _sample_tree(rng)
    path = ck.save(tmp_path / "a.ckpt", t)
    assert os.path.isabs(path) and os.path.exists(path)
    back = ck.load(path)
    _assert_same(t, back)
    assert type(back["state"]) is sofx.AdamState and type(back["hp"]) is sofx.AdamHParams
    assert back["state"].mu["w"].dtype == torch.float32 and back["params"]["w"].dtype == torch.bfloat16
    assert back["state"].count["w"].dtype == torch.int64 and back["state"].count["w"].dim() == 0
    assert type(back["od"]) is collections.OrderedDict and list(back["od"]) == [3, "k"]
    # loaded views are independent tensors (the saved tree's storage sharing is not kept)
    back["params"]["views"][0].add_(1)
    assert torch.equal(back["params"]["views"][1], t["params"]["views"][1])
    # the saved tree is untouched and still usable
    _assert_same(t, ck.load(path, like=t))
    assert ck.stale_temporaries(path) == []


def test_nan_payloads_and_negative_zero_kept_bitwise(tmp_path):
    x = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45], dtype=torch.float32)
    x.view(torch.int32)[0] = 0x7FC00123  # a nan with a payload
    back = ck.load(ck.save(tmp_path / "n.ckpt", {"x": x, "h": x.to(torch.bfloat16)}))
    assert torch.equal(back["x"].view(torch.int32), x.view(torch.int32))
    assert torch.equal(back["h"].view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_python_scalars_beyond_json_and_nan_payloads(tmp_path):
    """An int beyond int64 (and beyond Python's 4300-digit decimal limit), a Python nan's sign and payload."""
    nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000123))[0]  # negative, with a payload
    tree_ = {"big": 10 ** 5000, "neg": -(2 ** 70), "edge": 2 ** 63 - 1, "nan": nan}
    back = ck.load(ck.save(tmp_path / "s.ckpt", tree_))
    assert back["big"] == 10 ** 5000 and back["neg"] == -(2 ** 70) and back["edge"] == 2 ** 63 - 1
    assert struct.pack("<d", back["nan"]) == struct.pack("<d", nan)


def test_numpy_scalars_load_under_the_tree_they_were_saved_from_as_template(tmp_path):
    """numpy scalars are saved as the Python number of their value (a LambdaLR's np.float32 lr in a scheduler's
    state_dict()); ``like=`` the very tree saved refused them as another kind of leaf ('the checkpoint holds a
    bool, the template has a bool'). A numpy scalar template is the kind it is saved as; another kind still differs."""
    np = pytest.importorskip("numpy")
    tree_ = {"f32": np.float32(0.25), "f64": np.float64(0.5), "i": np.int64(-3), "u": np.uint8(7), "b": np.bool_(True)}
    path = ck.save(tmp_path / "np.ckpt", tree_)
    back = ck.load(path, like=tree_)
    assert back == {"f32": 0.25, "f64": 0.5, "i": -3, "u": 7, "b": True}
    assert [type(v) for v in back.values()] == [float, float, int, int, bool]
    with pytest.raises(ck.CheckpointMismatchError, match=r"\['i'\]: the checkpoint holds an int, the template has "
                                                          r"a numpy\.float32"):
        ck.load(path, like={**tree_, "i": np.float32(1.0)})


def test_a_numpy_longdouble_no_float_holds_is_refused_not_rounded(tmp_path):
    """A numpy longdouble with more digits than a float (1/3 in x86's 80 bits) was stored as float() of it, rounded
    without a word (it loaded back unequal); refused naming the leaf, nothing written. One a float holds loads as
    that float."""
    np = pytest.importorskip("numpy")
    third = np.longdouble(1) / np.longdouble(3)
    if float(third) == third:
        pytest.skip("numpy's longdouble is a double on this platform")
    with pytest.raises(ck.CheckpointError, match=r"^tree\['x'\]: a numpy\.longdouble .* no Python float holds"):
        ck.save(tmp_path / "ld.ckpt", {"x": third})
    assert not os.path.exists(tmp_path / "ld.ckpt")
    assert ck.load(ck.save(tmp_path / "ld.ckpt", {"x": np.longdouble(0.5)}))["x"] == 0.5


def test_lazy_conjugate_and_negative_views_are_saved_as_their_values(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, -2.0])
    views = {"conj": z.conj(), "neg": torch._neg_view(x), "imag": z.conj().imag}
    assert views["conj"].is_conj() and views["neg"].is_neg()
    for save in (ck.save, lambda p, t: ck.save_async(p, t).wait()):
        back = ck.load(save(tmp_path / "v.ckpt", views))
        for k, v in views.items():
            assert torch.equal(back[k], v.resolve_conj().resolve_neg()), k


def test_loaded_tensors_do_not_change_with_the_file(tmp_path):
    """Loaded tensors are the process's own: a file rewritten in place afterwards (cp, rsync --inplace) or
    truncated does not change them."""
    path = tmp_path / "a.ckpt"
    ck.save(path, {"x": torch.zeros(100000)})
    other = ck.save(tmp_path / "b.ckpt", {"x": torch.ones(100000)})
    back = ck.load(path)
    with open(other, "rb") as src, open(path, "r+b") as dst:  # in place, as cp does
        dst.write(src.read())
    assert float(back["x"].sum()) == 0.0
    os.truncate(path, 10)
    assert float(back["x"].sum()) == 0.0  # (a mapped tensor would be a bus error here)


def test_module_state_dict_with_its_metadata(tmp_path, rng):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    sd = model.state_dict()
    back = ck.load(ck.save(tmp_path / "m.ckpt", sd))
    assert type(back) is collections.OrderedDict and list(back) == list(sd)
    assert back._metadata == sd._metadata and back["1.num_batches_tracked"].dtype == torch.int64
    model.load_state_dict(back)
    assert ck.load(tmp_path / "m.ckpt", like=sd)._metadata == sd._metadata


def test_meta_template_loads_real_data_on_the_cpu(tmp_path, rng):
    """A model built on the meta device is a template of shapes and dtypes: the data comes to the CPU
    (a meta tensor would have dropped it); an explicit ``device="meta"`` is still obeyed."""
    sd = torch.nn.Linear(3, 2).state_dict()
    path = ck.save(tmp_path / "m.ckpt", sd)
    with torch.device("meta"):
        template = torch.nn.Linear(3, 2).state_dict()
    back = ck.load(path, like=template)
    assert all(t.device.type == "cpu" and torch.equal(t, sd[k]) for k, t in back.items())
    assert all(t.is_meta for t in ck.load(path, like=template, device="meta").values())


def test_requires_grad_and_parameters(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    back = ck.load(ck.save(tmp_path / "p.ckpt", [p, torch.randn(2)]))
    assert back[0].requires_grad and not back[1].requires_grad and torch.equal(back[0], p)


def test_a_saved_parameter_loads_as_a_parameter_as_torch_load_gives_it(tmp_path):
    """A ``torch.nn.Parameter`` came back a plain tensor (its requires_grad kept), with or without a template of
    Parameters, where ``torch.load`` gives a Parameter back: assigning it to a module (``module.weight = w``) raised
    torch's TypeError. The saved kind comes back (a Parameter, its requires_grad as saved; a plain tensor stays one,
    also under a template of Parameters, as a file written without the mark reads)."""
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    saved = {**dict(model.named_parameters()), "plain": torch.randn(2)}
    path = ck.save(tmp_path / "m.ckpt", saved)
    template = {**dict(torch.nn.Linear(3, 2).named_parameters()), "plain": torch.nn.Parameter(torch.zeros(2))}
    for back in (ck.load(path), ck.load(path, like=template), ck.load(path, like=template, device="meta")):
        assert type(back["weight"]) is torch.nn.Parameter and back["weight"].requires_grad
        assert type(back["bias"]) is torch.nn.Parameter and not back["bias"].requires_grad
        assert type(back["plain"]) is torch.Tensor and not back["plain"].requires_grad
    back = ck.load(path)
    assert torch.equal(back["weight"], model.weight) and torch.equal(back["bias"], model.bias)
    fresh = torch.nn.Linear(3, 2)
    fresh.weight = back["weight"]
    assert fresh.weight is back["weight"]


def test_is_a_standard_safetensors_file(tmp_path, rng):
    from safetensors import safe_open

    path = ck.save(tmp_path / "s.ckpt", {"params": {"w": torch.randn(2, generator=rng)}})
    with safe_open(path, "pt") as f:
        assert list(f.keys()) == ["tree['params']['w']"]
        assert f.metadata()["format"] == "sofx.checkpoint"
    meta = ck.read_metadata(path)
    assert meta["version"] == 1 and meta["tree"]["k"] == "dict"  # (no dense layout: the first version)


def test_like_places_on_template_device_and_orders_keys(tmp_path, rng):
    t = {"b": torch.randn(2, generator=rng), "a": torch.randn(1, generator=rng)}
    path = ck.save(tmp_path / "l.ckpt", t)
    back = ck.load(path, like={"a": torch.zeros(1), "b": torch.zeros(2)})
    assert list(back) == ["a", "b"] and torch.equal(back["b"], t["b"])
    assert ck.load(path, device="cpu")["a"].device.type == "cpu"


def test_a_device_that_is_not_one_or_not_here_is_refused_naming_the_argument_before_reading(tmp_path):
    """``device=`` is checked first: a name torch does not know, a value of another type, an accelerator this
    machine does not have (torch's raw error came from the first tensor moved, after the file was read)."""
    path = ck.save(tmp_path / "d.ckpt", {"x": torch.arange(3)})
    missing = tmp_path / "missing.ckpt"
    absent = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    for bad, why in (("bogus", "is not a device"), (" cpu", "is not a device"), (1.5, "is not a device"),
                     (absent, "is not available here")):
        for where in (path, missing):  # refused before the file is opened
            with pytest.raises(ck.CheckpointError, match=rf"^load: device={re.escape(repr(bad))} {why}"):
                ck.load(where, device=bad)
    assert ck.load(path, device="cpu:0")["x"].device.type == "cpu"
    assert ck.load(path, device=torch.device("cpu"))["x"].device.type == "cpu"


def test_the_file_is_the_one_safetensors_writes_for_every_dtype(tmp_path):
    """sofx writes the safetensors format itself (into its own temporary): the same header (tensors in
    safetensors' order, the data aligned as it aligns it) and the same bytes as ``safetensors.serialize`` writes
    for those tensors and metadata."""
    import safetensors

    from sofx.checkpoint.codec import _DTYPES

    g = torch.Generator().manual_seed(4)
    tree = {name: torch.randint(0, 256, (2, 3 * dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype)
            for name, dtype in _DTYPES.items() if dtype != torch.bool}
    tree["bool"] = torch.rand(2, 3, generator=g) > 0.5
    tree["empty"] = torch.empty(0, 3)
    path = ck.save(tmp_path / "d.ckpt", tree)
    ours = open(path, "rb").read()
    with safetensors.safe_open(path, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    specs = {k: safetensors.TensorSpec(dtype=ck_io.dtype_name(t.dtype), shape=list(t.shape), data_ptr=t.data_ptr(),
                                       data_len=t.numel() * t.element_size()) for k, t in tensors.items()}
    theirs = safetensors.serialize(specs, metadata=metadata)
    (n,) = struct.unpack("<Q", ours[:8])
    assert struct.unpack("<Q", theirs[:8]) == (n,) and n % 8 == 0
    assert json.loads(ours[8:8 + n]) == json.loads(theirs[8:8 + n])
    assert list(json.loads(ours[8:8 + n])) == list(json.loads(theirs[8:8 + n]))  # the same order
    assert ours[8 + n:] == theirs[8 + n:]
    _assert_same(ck.load(path), tree)


def test_a_header_beyond_what_safetensors_reads_is_refused_before_writing(tmp_path):
    """safetensors reads a header of at most 100,000,000 bytes (and its writer refused more): a tree whose
    structure is larger (a long string) is refused when saved, naming the sizes, and the file before it kept."""
    path = ck.save(tmp_path / "h.ckpt", {"s": "x", "w": torch.ones(2)})
    before = open(path, "rb").read()
    with pytest.raises(ck.CheckpointError, match=r"cannot save .*h.ckpt: .*header of \d+ bytes.*at most 100000000"):
        ck.save(path, {"s": "x" * 100_000_000, "w": torch.ones(2)})
    assert open(path, "rb").read() == before and ck.stale_temporaries(path) == []
    assert os.listdir(tmp_path) == ["h.ckpt"]


def test_overwrite_replaces_atomically(tmp_path, rng):
    path = tmp_path / "o.ckpt"
    ck.save(path, {"x": torch.zeros(3)})
    ck.save(path, {"y": torch.ones(2)})
    assert list(ck.load(path)) == ["y"]
    assert ck.stale_temporaries(path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fsync's file from /proc/self/fd")
def test_a_save_writes_a_temporary_fsyncs_it_renames_it_and_then_fsyncs_the_directory(tmp_path, monkeypatch, rng):
    """SPECULATION.md section 6: write to a temporary file, fsync, rename (then the directory, making the rename
    durable): the order of the system calls of a save over an older checkpoint."""
    path = tmp_path / "f.ckpt"
    ck.save(path, {"old": torch.randn(3, generator=rng)})
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tree_ = {"w": torch.randn(4, 3, generator=rng)}
    ck.save(path, tree_)
    monkeypatch.undo()
    replaces = [c for c in calls if c[0] == "replace"]
    assert len(replaces) == 1 and replaces[0][2] == str(path), calls
    tmp = replaces[0][1]
    assert os.path.dirname(tmp) == str(tmp_path) and tmp != str(path), calls
    at = calls.index(replaces[0])
    assert ("fsync", tmp) in calls[:at], calls  # the temporary's bytes are on disk before the rename
    assert ("fsync", str(tmp_path)) in calls[at + 1:], calls  # and the rename itself after it
    assert trees_equal(ck.load(path), tree_) and ck.stale_temporaries(path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fsync's file from /proc/self/fd")
def test_a_writer_that_renames_its_own_file_over_the_temporary_has_that_file_fsynced(tmp_path, monkeypatch):
    """atomic_write creates the temporary (with its mode) and fsyncs it through the descriptor that created it; a
    writer that writes a file of its own and renames it over the temporary (as safetensors' serialize_file 0.8
    does) left that descriptor on the empty file it replaced: the file written is the one fsynced, with its mode."""
    path = tmp_path / "t.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    synced, real_fsync = [], os.fsync

    def writer(tmp):
        with open(tmp + ".own", "wb") as f:
            f.write(b"new")
        os.replace(tmp + ".own", tmp)
        synced.append(os.stat(tmp).st_ino)

    def fsync(fd):
        synced.append(os.fstat(fd).st_ino)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ck_atomic.atomic_write(path, writer)
    monkeypatch.undo()
    assert synced[1] == synced[0] and path.read_bytes() == b"new" and os.stat(path).st_mode & 0o777 == 0o640


@pytest.mark.parametrize("code", [errno.EIO, errno.EINVAL])
def test_an_io_error_in_the_directorys_fsync_is_raised_and_an_unsupported_one_ignored(tmp_path, monkeypatch, code):
    """The directory's fsync makes the rename durable. Its EIO (or ENOSPC) was ignored as an fsync the file system
    does not support is: a save reported done that a crash could take back. It is a CheckpointIOError saying the
    file is in place; EINVAL (no fsync of directories there) is still nothing."""
    path, real_fsync = tmp_path / "d.ckpt", os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if code == errno.EIO:
        with pytest.raises(ck.CheckpointIOError, match=r"saved .*d\.ckpt, but the fsync of its directory .* failed: "
                                                       r"OSError: .*Input/output error.*the file is in place") as e:
            ck.save(path, {"x": torch.arange(3)})
        assert e.value.errno == errno.EIO
    else:
        ck.save(path, {"x": torch.arange(3)})
    monkeypatch.undo()
    assert torch.equal(ck.load(path)["x"], torch.arange(3)) and ck.stale_temporaries(path) == []

@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names a closed file from /proc/self/fd")
def test_a_failed_close_of_the_temporary_is_not_closed_again(tmp_path, monkeypatch, rng):
    """The descriptor that created the temporary is closed before the rename. Where that close failed (EIO, as NFS
    reports a failed write-back; the descriptor is released all the same), the cleanup closed it a second time: a
    descriptor number that another thread (an async save's, a DataLoader's) may have been given meanwhile. It is
    closed once; the save is refused, the old checkpoint kept and the temporary removed."""
    path = tmp_path / "c.ckpt"
    old = {"old": torch.randn(3, generator=rng)}
    ck.save(path, old)
    closed, real_close = [], os.close

    def close(fd):
        temporary = ".tmp-" in os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else None
        closed.append((fd, temporary))
        real_close(fd)
        if temporary:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(ck_atomic.os, "close", close)
    with pytest.raises(ck.CheckpointIOError, match="Input/output error"):
        ck.save(path, {"new": torch.randn(4, generator=rng)})
    monkeypatch.undo()
    fds = [fd for fd, temporary in closed if temporary]
    assert len(fds) == 1 and [fd for fd, _ in closed].count(fds[0]) == 1, closed
    assert trees_equal(ck.load(path), old) and ck.stale_temporaries(path) == []


def test_stale_temporaries_lists_only_the_temporaries_of_saves_to_that_path(tmp_path):
    """A temporary is ``.NAME.tmp-PID-RANDOM``: a sibling file that merely starts like one (a user's own file,
    another target's temporary whose name starts with NAME) is not listed."""
    path = tmp_path / "a.ckpt"
    ck.save(path, {"x": torch.arange(3)})
    other = tmp_path / "a.ckpt.tmp-1-0123456789ab"  # another checkpoint, named so
    ck.save(other, {"x": torch.arange(2)})
    for name in (".a.ckpt.tmp-notmine", ".a.ckpt.tmp-12-0123456789ab.bak", ".a.ckpt.tmp-", ".a.ckpt.tmp-12-"):
        (tmp_path / name).write_text("")
    for target in (path, other):  # what a save killed mid-write leaves
        with open(ck_atomic._temporary_name(str(target)), "wb") as f:
            f.write(b"partial")
    mine, theirs = ck.stale_temporaries(path), ck.stale_temporaries(other)
    assert len(mine) == 1 and len(theirs) == 1
    assert re.fullmatch(r"\.a\.ckpt\.tmp-\d+-[0-9a-f]{12}", os.path.basename(mine[0]))
    assert re.fullmatch(r"\.a\.ckpt\.tmp-1-0123456789ab\.tmp-\d+-[0-9a-f]{12}", os.path.basename(theirs[0]))


def test_mismatch_messages_put_the_right_article_before_the_templates_kind(tmp_path):
    """A template's int or OrderedDict where the checkpoint holds a tensor read "the template has a int"."""
    path = tmp_path / "a.ckpt"
    ck.save(path, {"w": torch.ones(2)})
    with pytest.raises(ck.CheckpointMismatchError, match=r"tree\['w'\]: the checkpoint holds a tensor, the template "
                                                         r"has an int$"):
        ck.load(path, like={"w": 3})
    with pytest.raises(ck.CheckpointMismatchError, match=r"the template has an OrderedDict$"):
        ck.load(path, like={"w": collections.OrderedDict()})


def test_a_save_over_a_file_keeps_its_permissions_as_torch_save_does(tmp_path):
    """torch.save over an existing file truncates it in place: its mode stays. The atomic save renames a new file
    over it, which had the process's default mode (a 0600 checkpoint of private data came back 0644); it now
    takes the replaced file's mode. A new file gets the default mode, as open() gives it."""
    params = {"w": torch.randn(3)}
    path = tmp_path / "private.ckpt"
    ck.save(path, params)
    default = os.stat(path).st_mode & 0o777
    for mode in (0o600, 0o640, 0o604):
        os.chmod(path, mode)
        ck.save(path, {"w": torch.randn(3)})
        assert os.stat(path).st_mode & 0o777 == mode
    fresh = tmp_path / "fresh.ckpt"
    ck.save(fresh, params)
    assert os.stat(fresh).st_mode & 0o777 == default


def test_a_saves_temporary_has_the_replaced_files_mode_while_the_data_is_written(tmp_path, monkeypatch):
    """The temporary was created with the default mode (0644 under umask 022) and given the replaced file's only
    after the whole tree was written to it: a 0600 checkpoint's data was readable by every user meanwhile, and for
    good in the temporary a killed save leaves. It has the mode from its creation, before any byte is written."""
    path = tmp_path / "private.ckpt"
    ck.save(path, {"w": torch.randn(3)})
    default = os.stat(path).st_mode & 0o777
    modes, real = [], ck_io.serialize_file

    def writer(specs, filename, *args, **kwargs):
        modes.append(os.stat(filename).st_mode & 0o777 if os.path.exists(filename) else None)
        real(specs, filename, *args, **kwargs)
        modes.append(os.stat(filename).st_mode & 0o777)

    monkeypatch.setattr(ck_io, "serialize_file", writer)
    for mode in (0o600, 0o640):
        os.chmod(path, mode)
        ck.save(path, {"w": torch.randn(3)})
        assert modes == [mode, mode] and os.stat(path).st_mode & 0o777 == mode
        modes.clear()
    ck.save(tmp_path / "fresh.ckpt", {"w": torch.randn(3)})
    assert modes == [default, default] and os.stat(tmp_path / "fresh.ckpt").st_mode & 0o777 == default
    # Its owner (the writer, opening it again by its name) may read and write it meanwhile, where the mode it gets
    # does not let it: a shared file writable by its group only, a umask taking the owner's write bit.
    os.chmod(path, 0o464)
    modes.clear()
    ck.save(path, {"w": torch.randn(3)})
    assert modes == [0o664, 0o664] and os.stat(path).st_mode & 0o777 == 0o464
    modes.clear()
    umask = os.umask(0o222)
    try:
        ck.save(tmp_path / "unwritable.ckpt", {"w": torch.randn(3)})
    finally:
        os.umask(umask)
    assert modes == [0o644, 0o644] and os.stat(tmp_path / "unwritable.ckpt").st_mode & 0o777 == 0o444


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write any file")
def test_a_save_over_a_read_only_file_is_refused_as_torch_save_refuses_it(tmp_path):
    """torch.save over a file the process may not write raises PermissionError; the atomic save's rename
    replaced it (the directory being writable). It is refused before anything is written, naming the file."""
    path = tmp_path / "frozen.ckpt"
    ck.save(path, {"w": torch.ones(3)})
    os.chmod(path, 0o444)
    with pytest.raises(ck.CheckpointError, match=r"frozen.ckpt: the file is read-only"):
        ck.save(path, {"w": torch.zeros(3)})
    assert torch.equal(ck.load(path)["w"], torch.ones(3))
    assert ck.stale_temporaries(path) == []


def test_a_save_to_a_symbolic_link_writes_through_it_to_its_target(tmp_path, monkeypatch):
    """As ``open(link, "w")`` would: the link stays a link and its target (relative to the link's directory,
    dangling or not) gets the new file, committed atomically beside the target; a link that loops is refused."""
    data, links = tmp_path / "data", tmp_path / "links"
    data.mkdir()
    links.mkdir()
    target, link = data / "real.ckpt", links / "run.ckpt"
    ck.save(target, {"x": torch.arange(2)})
    os.symlink(os.path.join("..", "data", "real.ckpt"), link)
    for step, save in enumerate((ck.save, lambda p, t: ck.save_async(p, t).wait())):
        assert save(link, {"x": torch.arange(3 + step)}) == str(link)
        assert os.path.islink(link) and os.readlink(link) == os.path.join("..", "data", "real.ckpt")
        assert torch.equal(ck.load(target)["x"], torch.arange(3 + step))
        assert sorted(os.listdir(data)) == ["real.ckpt"] and sorted(os.listdir(links)) == ["run.ckpt"]

    real = ck_io.serialize_file

    def interrupted(specs, filename, metadata=None, **kwargs):  # a save killed here leaves its temporary, beside
        real(specs, filename, metadata=metadata, **kwargs)                # the target
        seen.append((ck.stale_temporaries(link), ck.stale_temporaries(target)))
        raise KeyboardInterrupt

    seen = []
    monkeypatch.setattr(ck_io, "serialize_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.save(link, {"x": torch.zeros(1)})
    monkeypatch.undo()
    (by_link, by_target), = seen
    assert len(by_link) == 1 and by_link == by_target and os.path.dirname(by_link[0]) == str(data)

    dangling = links / "new.ckpt"
    os.symlink(data / "new.ckpt", dangling)
    ck.save(dangling, {"y": 1})
    assert os.path.islink(dangling) and ck.load(data / "new.ckpt") == {"y": 1}

    to_no_dir = links / "nowhere.ckpt"
    os.symlink(data / "no" / "x.ckpt", to_no_dir)
    with pytest.raises(ck.CheckpointError, match=r"nowhere.ckpt \(a symbolic link to .*data/no/x.ckpt\): the "
                                                 r"directory .*data/no does not exist"):
        ck.save(to_no_dir, {"y": 1})
    os.symlink("loop_b", links / "loop_a")
    os.symlink("loop_a", links / "loop_b")
    for save in (ck.save, ck.save_async):
        with pytest.raises(ck.CheckpointError, match=r"cannot save .*loop_a: a symbolic link that loops"):
            save(links / "loop_a", {"y": 1})
    assert os.readlink(links / "loop_a") == "loop_b" and os.readlink(to_no_dir) == str(data / "no" / "x.ckpt")
    assert sorted(os.listdir(data)) == ["new.ckpt", "real.ckpt"]



@pytest.mark.skipif(os.name != "posix", reason="the system resolves DIR/.. after DIR's links on POSIX only")
def test_a_path_through_a_linked_directory_and_dot_dot_saves_where_open_and_load_find_it(tmp_path, monkeypatch):
    """``run/../latest.ckpt`` with ``run`` a link to ``data/exp1``: the system (open(), load) goes up from the link's
    target, to ``data/latest.ckpt``, but save dropped ``run/..`` as text (os.path.abspath) and wrote
    ``./latest.ckpt``, which load then did not find; ``nodir/../x.ckpt`` (no ``nodir``), which open() refuses, was
    written as ``./x.ckpt``. A save now writes where open() would, and refuses where it would refuse."""
    work, exp = tmp_path / "work", tmp_path / "data" / "exp1"
    work.mkdir()
    exp.mkdir(parents=True)
    os.symlink(os.path.join("..", "data", "exp1"), work / "run")
    monkeypatch.chdir(work)
    for step, save in enumerate((ck.save, lambda p, t: ck.save_async(p, t).wait())):
        assert save(os.path.join("run", "..", "latest.ckpt"), {"x": step}) == str(tmp_path / "data" / "latest.ckpt")
        assert ck.load(os.path.join("run", "..", "latest.ckpt")) == {"x": step}
        with pytest.raises(ck.CheckpointError, match=r"cannot save .*nodir/\.\./x\.ckpt: the directory .*nodir/\.\. "
                                                     r"does not exist"):
            save(os.path.join("nodir", "..", "x.ckpt"), {"x": step})
    assert os.listdir(work) == ["run"] and sorted(os.listdir(tmp_path / "data")) == ["exp1", "latest.ckpt"]
# ------------------------------------------------------------------ clear errors
@pytest.mark.parametrize("bad, where", [
    ({"x": object()}, "tree['x']"),
    ({"x": [1, {"deep": 1 + 2j}]}, "tree['x'][1]['deep']"),
    ({(1, 2): 1}, "tree"),
    ({"x": torch.randn(2, 2).to_sparse()}, "tree['x']"),
    ({"x": torch.empty(2, device="meta")}, "tree['x']"),
    ({"x": torch.zeros(2, dtype=torch.complex128)}, "tree['x']"),
    ({"x": collections.defaultdict(int)}, "tree['x']"),
])
def test_unsavable_leaf_names_path_and_writes_nothing(tmp_path, bad, where):
    path = tmp_path / "u.ckpt"
    ck.save(path, {"previous": torch.arange(3)})
    with pytest.raises(ck.CheckpointError) as err:
        ck.save(path, bad)
    assert where in str(err.value)
    assert torch.equal(ck.load(path)["previous"], torch.arange(3))
    assert ck.stale_temporaries(path) == []


def test_an_int_key_beyond_the_decimal_digits_json_reads_is_refused_naming_its_dict(tmp_path):
    """JSON writes an int key in decimal, which Python reads back only up to 4300 digits: a longer key is a
    CheckpointError naming the dict's path (not Python's bare int-to-str ValueError), and nothing is written;
    a key of 4300 digits round-trips."""
    path = tmp_path / "k.ckpt"
    ck.save(path, {"previous": torch.arange(3)})
    for huge in (10 ** 4300, -(10 ** 5000)):
        for save in (ck.save, lambda p, t: ck.save_async(p, t).wait()):
            with pytest.raises(ck.CheckpointError, match=r"^tree\['a'\]: an int dict key of \d+ bits") as err:
                save(path, {"a": {huge: torch.ones(2), 1: 2}})
            assert "4300" in str(err.value)
            assert torch.equal(ck.load(path)["previous"], torch.arange(3)) and ck.stale_temporaries(path) == []
    widest = 10 ** 4300 - 1
    back = ck.load(ck.save(path, {widest: torch.ones(1), -widest: 1}))
    assert list(back) == [widest, -widest] and back[-widest] == 1


@contextlib.contextmanager
def _int_max_str_digits(limit):
    if not hasattr(sys, "set_int_max_str_digits"):  # Python before 3.10.7: no limit
        pytest.skip("this Python has no limit on the digits of int text")
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(old)


def test_an_int_key_follows_the_processs_limit_on_decimal_digits(tmp_path):
    """The most decimal digits of an int dict key is the process's ``sys.get_int_max_str_digits()`` (0: no
    limit): over it, a save is a CheckpointError naming the dict and writes nothing; a file holding a key over
    the reading process's limit is a CheckpointError saying so (the file is not corrupt), and loads once the
    limit allows it."""
    path = tmp_path / "k.ckpt"
    ck.save(path, {"previous": torch.arange(3)})
    key = 10 ** 999  # 1000 digits
    with _int_max_str_digits(640):
        for save in (ck.save, lambda p, t: ck.save_async(p, t).wait()):
            with pytest.raises(ck.CheckpointError, match=r"^tree\['a'\]: an int dict key of \d+ bits") as err:
                save(path, {"a": {key: torch.ones(2), 1: 2}})
            assert "640" in str(err.value) and "sys.set_int_max_str_digits" in str(err.value)
            assert torch.equal(ck.load(path)["previous"], torch.arange(3)) and ck.stale_temporaries(path) == []
        widest = 10 ** 640 - 1
        back = ck.load(ck.save(tmp_path / "w.ckpt", {widest: torch.ones(1), -widest: 1}))
        assert list(back) == [widest, -widest]
    encoded = ck_io.snapshot({"a": {key: torch.ones(2)}})  # a save that finishes after the limit is lowered
    with _int_max_str_digits(640):
        with pytest.raises(ck.CheckpointError, match=r"an int dict key of more than 640 decimal digits"):
            ck_io.write(path, encoded)
        assert torch.equal(ck.load(path)["previous"], torch.arange(3)) and ck.stale_temporaries(path) == []
    with _int_max_str_digits(0):
        ck.save(path, {"a": {key: torch.ones(2), -(10 ** 5000): 2}})
        back = ck.load(path)
        assert torch.equal(back["a"][key], torch.ones(2)) and back["a"][-(10 ** 5000)] == 2
    for limit, digits in ((640, 1000), (4300, 5001)):
        with _int_max_str_digits(limit):
            for read in (ck.load, ck.read_metadata):
                with pytest.raises(ck.CheckpointError, match=rf"an int of {digits} decimal digits") as err:
                    read(path)
                assert not isinstance(err.value, ck.CorruptCheckpointError)
                assert f"sys.get_int_max_str_digits() is {limit}" in str(err.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ck.CheckpointNotFoundError, match="does not exist") as err:
        ck.load(tmp_path / "nope.ckpt")
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(ck.CheckpointError, match="directory .* does not exist"):
        ck.save(tmp_path / "no" / "dir.ckpt", {"x": torch.zeros(1)})
    (tmp_path / "file").write_text("")
    with pytest.raises(ck.CheckpointError, match="directory .*file is not a directory"):
        ck.save(tmp_path / "file" / "x.ckpt", {"x": torch.zeros(1)})
    with pytest.raises(ck.CheckpointError, match="is a directory"):
        ck.load(tmp_path)
    with pytest.raises(ck.CheckpointError, match="is a directory"):
        ck.save(tmp_path, {"x": torch.zeros(1)})
    with pytest.raises(ck.CheckpointNotFoundError, match="does not exist"):
        ck.load(tmp_path / "file" / "x.ckpt")


def test_save_refuses_a_destination_before_it_copies_or_checksums_the_tree(tmp_path, monkeypatch):
    """save() encoded the tree, copied its tensors that are not contiguous CPU tensors (a GPU model's whole state
    to host memory) and checksummed every byte before it found that the directory does not exist, as save_async
    finds it before its snapshot. The destination is checked first."""
    prepared = []
    monkeypatch.setattr(ck_io, "prepare", lambda tree: prepared.append(tree))
    for bad in (tmp_path / "no" / "dir.ckpt", tmp_path, f"{tmp_path}{os.sep}"):
        with pytest.raises(ck.CheckpointError, match=r"does not exist|is a directory|ends in a path separator"):
            ck.save(bad, {"x": torch.zeros(1)})
    assert prepared == [] and os.listdir(tmp_path) == []


def test_a_checkpoint_that_cannot_be_opened_says_why(tmp_path):
    """safetensors reports every failure to open a file as "No such file or directory": a checkpoint that
    exists but cannot be read (no read permission, a socket) said that it does not exist. The system's reason
    comes back, in a CheckpointIOError (an OSError) with its number."""
    import socket

    path = tmp_path / "s.ckpt"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # a socket file cannot be opened, even by root
        with pytest.raises(ck.CheckpointIOError, match=r"cannot read checkpoint .*s.ckpt: .*No such device") as err:
            ck.load(path)
    assert err.value.errno == errno.ENXIO and "No such file" not in str(err.value)
    if os.geteuid() != 0:  # (root reads any file)
        locked = ck.save(tmp_path / "l.ckpt", {"x": torch.zeros(1)})
        os.chmod(locked, 0)
        with pytest.raises(ck.CheckpointIOError, match="Permission denied") as err:
            ck.load(locked)
        assert err.value.errno == errno.EACCES


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_given_to_load_is_refused_at_once_rather_than_waited_on(tmp_path):
    """load or read_metadata of a FIFO (a named pipe) blocked for ever in open(), waiting for a writer (a checkpoint
    is read mapped from a regular file: nothing a pipe gives could be read). It is refused at once, as saves refuse
    it, naming the file and what it is."""
    fifo = tmp_path / "p.ckpt"
    os.mkfifo(fifo)
    for read in (ck.load, ck.read_metadata):
        errors = []
        reader = threading.Thread(target=lambda: errors.append(pytest.raises(ck.CheckpointError, read, fifo)),
                                  daemon=True)  # (where it blocks, left blocked)
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), f"{read.__name__} blocked on the FIFO"
        assert re.fullmatch(rf"checkpoint {re.escape(str(fifo))} is a FIFO, not a regular file.*",
                            str(errors[0].value)), errors[0].value


def test_truncated_file(tmp_path, rng):
    path = ck.save(tmp_path / "t.ckpt", {"x": torch.randn(100, generator=rng)})
    data = open(path, "rb").read()
    for cut in (len(data) - 1, len(data) // 2, 20, 7, 0):
        open(path, "wb").write(data[:cut])
        with pytest.raises(ck.CorruptCheckpointError, match="truncated, corrupted, or not a sofx checkpoint"):
            ck.load(path)


def test_corrupted_header(tmp_path, rng):
    path = ck.save(tmp_path / "h.ckpt", {"x": torch.randn(4, generator=rng)})
    data = bytearray(open(path, "rb").read())
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + n]
    header[header.index(b"{") + 1] = ord("#")  # break the JSON
    open(path, "wb").write(bytes(data[:8] + header + data[8 + n:]))
    with pytest.raises(ck.CorruptCheckpointError):
        ck.load(path)
    open(path, "wb").write(b"\xff" * 64)
    with pytest.raises(ck.CorruptCheckpointError):
        ck.load(path)


def _flip_in_header(path, text: bytes, at: int, bit: int) -> None:
    """Flip ``bit`` of the byte ``at`` places into the first ``text`` of the file's header, in place."""
    data = bytearray(open(path, "rb").read())
    (n,) = struct.unpack("<Q", data[:8])
    pos = 8 + data[8:8 + n].index(text) + at
    data[pos] ^= 1 << bit
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("text, at, bit", [
    pytest.param(b'\\"v\\":3}', 6, 0, id="the step count 3 read as 2"),
    pytest.param(b'\\"s\\",\\"step\\"', 10, 0, id="the key 'step' read as 'sted'"),
    pytest.param(b'\\"v\\":\\"0x1.', 12, 3, id="the loss scale 1024.0 read as 1536.0"),
])
def test_a_bit_flipped_in_the_tree_structure_is_corrupt_not_another_value(tmp_path, text, at, bit):
    """The tensors carry checksums, the structure in the header did not: a flipped bit in a Python number (the
    step a schedule resumes at, the loss scale) or in a dict key loaded as another value without a word. The
    header records the structure's CRC-32, checked on load (``verify=False`` skips it, as the tensors')."""
    tree = {"step": 3, "scale": 1024.0, "w": torch.arange(4.0)}
    path = ck.save(tmp_path / "s.ckpt", tree)
    _flip_in_header(path, text, at, bit)
    with pytest.raises(ck.CorruptCheckpointError, match="tree structure in the header fails its checksum"):
        ck.load(path)
    with pytest.raises(ck.CorruptCheckpointError, match="fails its checksum"):
        ck.read_metadata(path)
    damaged = ck.load(path, verify=False)  # the damage itself (the test's id)
    assert (damaged.get("step"), damaged.get("scale")) != (3, 1024.0)


def _rewrite_metadata(path, **changes):
    """A checkpoint's tensors saved again with edited sofx metadata (keeps the data); an edited tree gets its
    checksum, as a writer of that structure would record it."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.update(changes)
    if "tree" in changes:
        meta["tree_crc32"] = ck_io.structure_checksum(meta["tree"])
    save_file(tensors, path, metadata=meta)


def test_a_load_while_a_save_replaces_the_file_reads_one_whole_file(tmp_path, monkeypatch):
    """safetensors opens the file twice, by its name: once for the header, once (torch's from_file) for the data. A
    save committed in between (another process saving every step) gave the old header with the new data: a
    spurious "fails its checksum", and with verify=False the old structure holding the new tensors. A load holds
    the file it opened and opens it again where the name no longer names that file: it reads one whole file."""
    path = tmp_path / "r.ckpt"
    real, saves = torch.UntypedStorage.from_file, iter(range(1, 100))

    def from_file(*args, **kwargs):  # a concurrent save commits between the two opens (the first ones only)
        step = next(saves)
        if step <= 2:
            ck.save(path, {"step": step, "x": torch.full((4,), float(step)), "y": torch.full((3,), float(step))})
        return real(*args, **kwargs)

    for verify in (True, False):
        ck.save(path, {"step": 0, "x": torch.zeros(4), "y": torch.zeros(3)})
        saves = iter(range(1, 100))
        monkeypatch.setattr(torch.UntypedStorage, "from_file", from_file)
        loaded = ck.load(path, verify=verify)
        monkeypatch.undo()
        if next(saves) == 1:
            pytest.skip("this safetensors does not read the data through torch.UntypedStorage.from_file")
        step = loaded["step"]
        assert torch.equal(loaded["x"], torch.full((4,), float(step))), (verify, loaded)
        assert torch.equal(loaded["y"], torch.full((3,), float(step))), (verify, loaded)


def test_corrupted_tree_structure_and_data(tmp_path, rng):
    path = ck.save(tmp_path / "c.ckpt", {"x": torch.randn(8, generator=rng)})
    good = open(path, "rb").read()
    _rewrite_metadata(path, tree="{not json")
    with pytest.raises(ck.CorruptCheckpointError, match="not valid JSON"):
        ck.load(path)
    open(path, "wb").write(good)
    _rewrite_metadata(path, tree=json.dumps({"k": "dict", "keys": [["s", "x"]], "items": [{"k": "???"}]}))
    with pytest.raises(ck.CorruptCheckpointError, match="unknown node kind"):
        ck.load(path)
    # flip one bit of the tensor data: the checksum catches it
    data = bytearray(good)
    data[-3] ^= 0x10
    open(path, "wb").write(bytes(data))
    with pytest.raises(ck.CorruptCheckpointError, match="checksum"):
        ck.load(path)
    assert ck.load(path, verify=False)["x"].shape == (8,)


def test_a_malformed_structure_is_a_corrupt_checkpoint_error_naming_the_file(tmp_path, rng):
    """The structure's own errors (an unknown node kind, a tensor node without a key, a bad order: a damaged file
    read with verify=False, an older file without the structure's checksum, a crafted one) said "corrupted checkpoint
    structure at tree[...]" without the file, unlike every other CorruptCheckpointError of load."""
    path = ck.save(tmp_path / "m.ckpt", {"x": torch.randn(3, 2, generator=rng).t()})
    tree_ = ck.read_metadata(path)["tree"]
    good = open(path, "rb").read()
    for node, what in (({"k": "???"}, "unknown node kind"), ({**tree_["items"][0], "key": None}, "without a key"),
                       ({**tree_["items"][0], "order": [0, 0]}, "bad tensor order")):
        open(path, "wb").write(good)
        _rewrite_metadata(path, tree=json.dumps({**tree_, "items": [node]}))
        for load in (lambda: ck.load(path), lambda: ck.load(path, like={"x": torch.zeros(2, 3)}),
                     lambda: ck.load(path, verify=False)):
            with pytest.raises(ck.CorruptCheckpointError, match=rf"^{re.escape(str(path))}: .*{what}"):
                load()


def test_a_tensor_nodes_requires_grad_or_parameter_mark_that_is_no_bool_is_corrupt(tmp_path, rng):
    """A tensor node's "requires_grad" and "parameter" marks were read by their truth: a damaged file's "yes" or 1
    loaded the tensor as one requiring grad (a Parameter for parameter=1 was not made, "yes" neither) without a word,
    where the codec refuses its other damaged node fields. Each is a CorruptCheckpointError naming the file, the
    leaf and the value; a node without "parameter" (a file written before it existed) still loads."""
    path = ck.save(tmp_path / "m.ckpt", {"x": torch.nn.Parameter(torch.randn(3, generator=rng))})
    tree_ = ck.read_metadata(path)["tree"]
    good = open(path, "rb").read()
    node = tree_["items"][0]
    for field, value in (("requires_grad", "yes"), ("requires_grad", 1), ("parameter", "yes"), ("parameter", 1),
                         ("parameter", None)):
        open(path, "wb").write(good)
        _rewrite_metadata(path, tree=json.dumps({**tree_, "items": [{**node, field: value}]}))
        with pytest.raises(ck.CorruptCheckpointError,
                           match=rf"^{re.escape(str(path))}: .*bad tensor {field} {re.escape(repr(value))}"):
            ck.load(path)
    open(path, "wb").write(good)
    _rewrite_metadata(path, tree=json.dumps({**tree_, "items": [{k: v for k, v in node.items() if k != "parameter"}]}))
    x = ck.load(path)["x"]
    assert type(x) is torch.Tensor and x.requires_grad


def test_a_tensor_nodes_crc32_that_is_no_integer_is_a_damaged_field_not_a_failed_checksum(tmp_path, rng):
    """A tensor node's "crc32" that is no integer (a damaged or crafted file's "123", 1.5, true, null, one beyond 32
    bits) was compared with the data's CRC-32 and reported as "fails its checksum: the data is corrupted", which
    the data is not. It is a CorruptCheckpointError naming the file, the leaf, the field, its value and type, before
    any tensor is read; verify=False does not read the field and loads the data."""
    x = torch.randn(3, generator=rng)
    path = ck.save(tmp_path / "c.ckpt", {"x": x})
    tree_ = ck.read_metadata(path)["tree"]
    good = open(path, "rb").read()
    node = tree_["items"][0]
    for value in (str(node["crc32"]), float(node["crc32"]), True, None, 2 ** 32, -1):
        open(path, "wb").write(good)
        _rewrite_metadata(path, tree=json.dumps({**tree_, "items": [{**node, "crc32": value}]}))
        with pytest.raises(ck.CorruptCheckpointError, match=rf"^{re.escape(str(path))}: tensor tree\['x'\] has a "
                                                            rf"damaged crc32 field {re.escape(repr(value))} "
                                                            rf"\({tree.article(type(value).__name__)}\)"):
            ck.load(path)
        assert torch.equal(ck.load(path, verify=False)["x"], x)


def test_trees_nested_too_deeply_are_refused_and_deep_headers_are_corrupt(tmp_path, rng):
    """A tree nested beyond MAX_NESTING containers is refused when saved (a CheckpointError naming where; the file
    before it kept), so that every file sofx writes reads back (its JSON is read recursively); one at the limit
    round-trips; a header nested deeper than Python's json can read (crafted, damaged) is corrupt, and a structure
    too deep for the decoder a CheckpointError, not a RecursionError."""
    from sofx.checkpoint import codec

    def nested(depth):
        t = torch.randn(2, generator=rng)
        for k in range(depth):
            t = [t] if k % 2 else {"a": t}
        return t

    deep = nested(codec.MAX_NESTING)
    path = ck.save(tmp_path / "n.ckpt", deep)
    assert trees_equal(ck.load(path), deep)
    before = open(path, "rb").read()
    for depth in (codec.MAX_NESTING + 1, 600):
        with pytest.raises(ck.CheckpointError, match=f"nested more than {codec.MAX_NESTING} containers deep"):
            ck.save(path, nested(depth))
    assert open(path, "rb").read() == before
    _rewrite_metadata(path, tree="[" * 100_000 + "]" * 100_000)
    with pytest.raises(ck.CorruptCheckpointError, match="nested too deeply to read"):
        ck.load(path)
    structure = {"k": "none"}
    for _ in range(5000):  # beyond the recursion limit of the decoder itself (json stops sooner, above)
        structure = {"k": "list", "items": [structure]}
    with pytest.raises(ck.CheckpointError, match="nested too deeply to read here"):
        codec.decode(structure, lambda node, path, like: None)


def test_version_mismatch(tmp_path):
    path = ck.save(tmp_path / "v.ckpt", {"x": torch.zeros(1)})
    _rewrite_metadata(path, format_version=str(ck.FORMAT_VERSION + 1))
    with pytest.raises(ck.CheckpointVersionError, match="newer checkpoint format"):
        ck.load(path)
    _rewrite_metadata(path, format_version="0")
    with pytest.raises(ck.CheckpointVersionError, match="older"):
        ck.load(path)


def test_not_a_sofx_checkpoint(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, path)
    with pytest.raises(ck.CorruptCheckpointError, match="not a sofx checkpoint"):
        ck.load(path)


def test_like_mismatch_errors_name_the_file_and_the_leaf(tmp_path, rng):
    opt = sofx.adamw()
    params = {"enc": {"w": torch.randn(2, 3, generator=rng)}, "dec": [torch.randn(4, generator=rng)]}
    saved = {"params": params, "state": opt.init(params), "step": 3}
    path = ck.save(tmp_path / "m.ckpt", saved)

    def like(**edits):
        t = {"params": {"enc": {"w": torch.zeros(2, 3)}, "dec": [torch.zeros(4)]}, "state": opt.init(params),
             "step": 0}
        for k, v in edits.items():
            t[k] = v
        return t

    cases = [
        (like(params={"enc": {"w": torch.zeros(3, 2)}, "dec": [torch.zeros(4)]}),
         r"tree\['params'\]\['enc'\]\['w'\]: the checkpoint holds shape \(2, 3\), the template has shape \(3, 2\)"),
        (like(params={"enc": {"w": torch.zeros(2, 3, dtype=torch.float64)}, "dec": [torch.zeros(4)]}),
         r"tree\['params'\]\['enc'\]\['w'\]: the checkpoint holds dtype torch.float32, the template has dtype "
         r"torch.float64"),
        (like(params={"enc": {"w": torch.zeros(2, 3)}, "dec": [torch.zeros(4), torch.zeros(1)]}),
         r"tree\['params'\]\['dec'\]: the checkpoint holds a list of length 1, the template has length 2"),
        (like(params={"enc": {"w": torch.zeros(2, 3), "b": torch.zeros(1)}, "dec": [torch.zeros(4)]}),
         r"tree\['params'\]\['enc'\]: the dict keys differ .*missing from the checkpoint: \['b'\]"),
        (like(step=0.0), r"tree\['step'\]: the checkpoint holds an int, the template has a float"),
        (like(state=Pair(1, 2)), r"tree\['state'\]: the checkpoint holds a sofx.adam.AdamState, the template has a "),
        (like(params={"enc": {"w": None}, "dec": [torch.zeros(4)]}),
         r"tree\['params'\]\['enc'\]\['w'\]: the checkpoint holds a tensor, the template has a NoneType"),
    ]
    for template, message in cases:
        with pytest.raises(ck.CheckpointMismatchError, match=message) as e:
            ck.load(path, like=template)
        assert str(e.value).startswith(f"{path}: tree["), str(e.value)  # the file is named too
    bad_count = like()
    bad_count["state"] = bad_count["state"]._replace(count={"enc": {"w": torch.zeros((), dtype=torch.int32)},
                                                            "dec": [torch.zeros((), dtype=torch.int64)]})
    with pytest.raises(ck.CheckpointMismatchError, match=r"tree\['state'\].count\['enc'\]\['w'\]: .*dtype"):
        ck.load(path, like=bad_count)
    assert isinstance(ck.CheckpointMismatchError("x"), sofx.StructureError)


def test_namedtuples_only_from_allowed_classes(tmp_path):
    path = ck.save(tmp_path / "nt.ckpt", {"p": Pair(torch.ones(1), 2)})
    with pytest.raises(ck.CheckpointError, match=r"tree\['p'\]: .*Pair.*pass the class in types="):
        ck.load(path)
    assert type(ck.load(path, types=[Pair])["p"]) is Pair
    assert type(ck.load(path, like={"p": Pair(torch.zeros(1), 0)})["p"]) is Pair

    class Other(NamedTuple):
        a: object
        c: object

    with pytest.raises(ck.CheckpointError, match="fields"):
        ck.load(path, types={f"{Pair.__module__}.{Pair.__qualname__}": Other})


def test_types_that_are_not_namedtuple_classes_are_refused_naming_the_argument_before_reading(tmp_path):
    """types=Pair (the class itself, not a list of it) and types=5 raised Python's bare TypeError ('type' object is
    not iterable); a mapping keyed by the class instead of its name was taken and ignored, the load then refused the
    NamedTuple as 'not a sofx type'. Each is a CheckpointError naming types=, before the file is opened."""
    path = ck.save(tmp_path / "nt.ckpt", {"p": Pair(torch.ones(1), 2)})
    for bad, what in ((Pair, r"the class .*Pair; pass a list of classes: types=\[Pair\]"), (5, "an int"),
                      ({Pair: Pair}, r"the mapping's key .*Pair.* is not a str"),
                      (f"{Pair.__module__}.{Pair.__qualname__}", r"a str '.*Pair'")):  # (its letters: "'t' is not")
        with pytest.raises(ck.CheckpointError, match=rf"^types: .*{what}"):
            ck.load(tmp_path / "missing.ckpt", types=bad)
    assert type(ck.load(path, types=(Pair,))["p"]) is Pair


def _sofx_state_classes():
    """Every NamedTuple class named ``...State`` that a sofx module defines (the states a run checkpoints)."""
    import importlib
    import pkgutil

    from sofx.checkpoint.known_types import _is_namedtuple_class

    found = []
    for info in pkgutil.walk_packages(sofx.__path__, "sofx."):
        if info.name in ("sofx.demo", "sofx.kernels.__main__"):
            continue
        module = importlib.import_module(info.name)
        found += [cls for name, cls in vars(module).items()
                  if _is_namedtuple_class(cls) and cls.__module__ == info.name and name.endswith("State")]
    return found


def test_every_sofx_state_namedtuple_loads_without_a_template(tmp_path, rng):
    """sofx's own NamedTuples load without like= or types=: apply_if_finite's state, moved to its own module,
    was refused as "not a sofx type"."""
    classes = _sofx_state_classes()
    from sofx.apply_if_finite import ApplyIfFiniteState
    from sofx.checkpoint.codec import type_name
    from sofx.checkpoint.known_types import sofx_type

    assert ApplyIfFiniteState in classes
    assert [type_name(c) for c in classes if sofx_type(type_name(c)) is not c] == []
    opt = sofx.apply_if_finite(sofx.adamw(lr=1e-2), max_consecutive_errors=5)
    params = {"w": torch.randn(3, 4, generator=rng)}
    params, state, _ = opt.update(params, {"w": torch.randn(3, 4, generator=rng)}, opt.init(params))
    loaded = ck.load(ck.save(tmp_path / "aif.ckpt", {"params": params, "state": state}))
    assert type(loaded["state"]) is ApplyIfFiniteState
    _assert_same(loaded, {"params": params, "state": state})


def test_type_names_in_a_file_are_never_imported(tmp_path, monkeypatch):
    """A structure naming 'os.system' or an unimported module is refused, and nothing is imported."""
    import sys

    path = ck.save(tmp_path / "evil.ckpt", {"x": torch.zeros(1)})
    for name in ("posix.system", "os.system", "sofx_evil_module_never_imported.Thing", "sofx.adam.math.pi",
                 "sofx.adam.Adam", "sofx.adam.AdamState.__new__"):
        structure = {"k": "namedtuple", "type": name, "fields": ["a"], "items": [{"k": "int", "v": 1}]}
        _rewrite_metadata(path, tree=json.dumps({"k": "dict", "keys": [["s", "x"]], "items": [structure]}))
        with pytest.raises(ck.CheckpointError, match="not a sofx type"):
            ck.load(path)
    assert "sofx_evil_module_never_imported" not in sys.modules


def test_failed_write_leaves_previous_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "f.ckpt"
    ck.save(path, {"x": torch.arange(4)})

    def failing(specs, filename, metadata=None, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ck_io, "serialize_file", failing)
    with pytest.raises(OSError, match="disk full") as err:  # an OSError still, and a CheckpointError naming the file
        ck.save(path, {"x": torch.zeros(4)})
    assert isinstance(err.value, ck.CheckpointIOError) and str(path) in str(err.value)

    def writer_error(specs, filename, metadata=None, **kwargs):  # e.g. safetensors' own error type
        raise RuntimeError("Error while serializing")

    monkeypatch.setattr(ck_io, "serialize_file", writer_error)
    with pytest.raises(ck.CheckpointError, match=r"cannot save .*f.ckpt: RuntimeError: Error while serializing"):
        ck.save(path, {"x": torch.zeros(4)})
    monkeypatch.undo()
    assert torch.equal(ck.load(path)["x"], torch.arange(4))
    assert ck.stale_temporaries(path) == []


def test_the_writers_own_system_errors_are_checkpoint_io_errors():
    """A real failing write (a directory no file can be created in, even by root) is a CheckpointIOError, an
    OSError with the system's number; a writer that reports the system's errors as its own exception type
    (not an OSError), the number in its message, as safetensors does, has it read from there. A directory the
    process may not write (/proc/self: os.access says so, even to root) is refused before the write, with EACCES."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    with pytest.raises(ck.CheckpointIOError, match="/proc/self/f.ckpt: the directory .* is not writable") as err:
        ck.save("/proc/self/f.ckpt", {"x": torch.arange(4)})
    assert isinstance(err.value, OSError) and err.value.errno == errno.EACCES
    if os.access("/proc", os.W_OK | os.X_OK):  # (root: the write itself fails, with the system's ENOENT)
        with pytest.raises(ck.CheckpointIOError) as err:
            ck.save("/proc/f.ckpt", {"x": torch.arange(4)})
        assert isinstance(err.value, OSError) and err.value.errno == errno.ENOENT and "f.ckpt" in str(err.value)
    assert ck_atomic.system_errno(RuntimeError("I/O error: No space left on device (os error 28)")) == 28
    assert ck_atomic.system_errno(RuntimeError("Error while serializing")) is None


# ------------------------------------------------------------ property: any tree

@pytest.mark.parametrize("call", ["save", "save_async", "AsyncSaver.save", "load", "read_metadata",
                                  "stale_temporaries"])
def test_a_path_that_is_not_a_path_is_refused_naming_the_call_and_the_argument_order(tmp_path, call):
    """``ck.save(tree, path)`` (arguments swapped, as ``torch.save(obj, f)`` takes them) raised a bare TypeError
    from ``os.fspath`` deep inside ("expected str, bytes or os.PathLike object, not dict"): now a
    CheckpointError names the call, what it got and, for a tree, that the path comes first; nothing is written."""
    tree_ = {"w": torch.ones(2)}
    runs = {"save": lambda: ck.save(tree_, str(tmp_path / "x")),
            "save_async": lambda: ck.save_async(tree_, str(tmp_path / "x")),
            "AsyncSaver.save": lambda: ck.AsyncSaver().save(tree_, str(tmp_path / "x")),
            "load": lambda: ck.load(tree_),
            "read_metadata": lambda: ck.read_metadata(tree_),
            "stale_temporaries": lambda: ck.stale_temporaries(tree_)}
    with pytest.raises(ck.CheckpointError, match=rf"^{re.escape(call)}: path must be a str or "
                                                 r"os\.PathLike, got dict \{'w': .*the path comes first"):
        runs[call]()
    assert not os.listdir(tmp_path)
    with pytest.raises(ck.CheckpointError, match=r"^load: path must be a str or os\.PathLike, got NoneType None$"):
        ck.load(None)


class _BytesPath:
    """An ``os.PathLike`` whose ``__fspath__`` gives bytes (as ``os.fspath`` allows)."""

    def __init__(self, path: bytes) -> None:
        self.path = path

    def __fspath__(self) -> bytes:
        return self.path


@pytest.mark.parametrize("kind", ["bytes", "bytes PathLike"])
def test_a_bytes_path_saves_and_loads_as_its_text(tmp_path, rng, kind):
    """A path in bytes (which the checks let through, as ``os.fspath`` takes it) raised bare TypeErrors ("Can't mix
    strings and bytes in path components" from save, save_async and stale_temporaries; "argument 'filename':
    'bytes' object is not an instance of 'str'" from load and read_metadata): now it is the path it names."""
    wrap = (lambda p: p) if kind == "bytes" else _BytesPath
    path = tmp_path / "b.ckpt"
    tree_ = {"w": torch.randn(3, 4, generator=rng), "n": 3}
    assert ck.save(wrap(os.fsencode(path)), tree_) == str(path)
    _assert_same(ck.load(wrap(os.fsencode(path))), tree_)
    assert ck.read_metadata(wrap(os.fsencode(path)))["tree"]["k"] == "dict"
    assert ck.stale_temporaries(wrap(os.fsencode(path))) == []
    other = {"w": torch.randn(2, generator=rng)}
    assert ck.save_async(wrap(os.fsencode(tmp_path / "a.ckpt")), other).wait() == str(tmp_path / "a.ckpt")
    with ck.AsyncSaver() as saver:
        saver.save(wrap(os.fsencode(tmp_path / "s.ckpt")), other)
    for name in ("a.ckpt", "s.ckpt"):
        _assert_same(ck.load(tmp_path / name), other)
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt", "s.ckpt"]


@pytest.mark.parametrize("call", ["save", "save_async", "AsyncSaver.save", "load", "read_metadata",
                                  "stale_temporaries"])
def test_a_path_with_a_nul_character_is_refused_naming_the_call(tmp_path, call):
    """A path holding a NUL character (no system takes one) raised the os module's bare "ValueError: embedded null
    byte" from deep inside; a CheckpointError names the call and the path, and nothing is written."""
    tree_, bad = {"w": torch.ones(2)}, str(tmp_path / "a\0b.ckpt")
    runs = {"save": lambda p: ck.save(p, tree_), "save_async": lambda p: ck.save_async(p, tree_),
            "AsyncSaver.save": lambda p: ck.AsyncSaver().save(p, tree_), "load": ck.load,
            "read_metadata": ck.read_metadata, "stale_temporaries": ck.stale_temporaries}
    for given in (bad, os.fsencode(bad)):
        with pytest.raises(ck.CheckpointError, match=rf"^{re.escape(call)}: the path .*a\\x00b\.ckpt' holds a NUL"):
            runs[call](given)
    assert not os.listdir(tmp_path)



@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy pickle"])
def test_a_torch_save_file_given_to_load_says_to_read_it_with_torch_load(tmp_path, legacy):
    """``ck.load`` of a file ``torch.save`` wrote (a torch user's ``ckpt.pt``) said "Error while deserializing header:
    header too large; the file is truncated, corrupted, or not a sofx checkpoint", as for a damaged file: now it
    says what the file is and what reads it. Still a CorruptCheckpointError; nothing is unpickled."""
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=not legacy)
    what = "a pickle" if legacy else "a zip archive"
    with pytest.raises(ck.CorruptCheckpointError, match=rf"^{re.escape(str(path))} is not a sofx checkpoint: it is "
                                                        rf"{what}, as torch\.save writes; read it with torch\.load"):
        ck.load(path)
    with pytest.raises(ck.CorruptCheckpointError, match=r"is not a sofx checkpoint: it is"):
        ck.read_metadata(path)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool]


@st.composite
def _tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    raw = draw(st.binary(min_size=0, max_size=1))  # seed material
    g = torch.Generator().manual_seed(int.from_bytes(raw or b"\x00", "little") + len(shape) * 1000)
    t = _rand(tuple(shape), dtype, g)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous
    return t


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                     st.text(max_size=5), st.sampled_from([torch.float32, torch.bfloat16]))
_trees = st.recursive(
    st.one_of(_scalars, _tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5)), children, max_size=3),
        st.tuples(children, children).map(lambda ab: Pair(*ab)),
    ),
    max_leaves=8,
)


@settings(max_examples=40, deadline=None)
@given(t=_trees)
def test_any_tree_round_trips_bitwise(tmp_path_factory, t):
    path = tmp_path_factory.mktemp("prop") / "t.ckpt"
    ck.save(path, t)
    back = ck.load(path, types=[Pair])
    _assert_same_deep(t, back)
    _assert_same_deep(t, ck.load(path, like=t))


def _assert_same_deep(a, b):
    """Structure, node types, dict key order, dtypes and bits (nan == nan)."""
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.numel():
            assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same_deep(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_deep(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


# ------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_save_load_and_async_snapshot(tmp_path, rng):
    x = torch.randn(1000, generator=rng).cuda()
    m = torch.randn(10, generator=rng).to("cuda", torch.bfloat16)
    ck.save(tmp_path / "c.ckpt", {"x": x, "m": m})
    back = ck.load(tmp_path / "c.ckpt")
    assert back["x"].device.type == "cpu" and torch.equal(back["x"], x.cpu())
    on_gpu = ck.load(tmp_path / "c.ckpt", like={"x": torch.zeros(1000, device="cuda"),
                                                "m": torch.zeros(10, device="cuda", dtype=torch.bfloat16)})
    assert on_gpu["x"].is_cuda and torch.equal(on_gpu["m"], m)
    before = x.clone()
    handle = ck.save_async(tmp_path / "a.ckpt", {"x": x})
    x.add_(1)  # in place right after the call
    handle.wait(60)
    assert torch.equal(ck.load(tmp_path / "a.ckpt", device="cuda")["x"], before)


def test_a_counter_round_trips_with_a_template_and_keeps_its_order(tmp_path):
    c = collections.Counter({"b": 2, 3: 1, "a": 0})
    ck.save(tmp_path / "c.ckpt", {"c": c})
    for back in (ck.load(tmp_path / "c.ckpt"), ck.load(tmp_path / "c.ckpt", like={"c": c})):
        assert type(back["c"]) is collections.Counter and list(back["c"].items()) == list(c.items())
        assert back["c"]["missing"] == 0


@pytest.mark.parametrize("name_of", [lambda n: "c" * (n - 5) + ".ckpt", lambda n: "é" * (n // 2)],
                         ids=["ascii", "two-byte"])
def test_a_file_name_as_long_as_the_file_system_allows_is_saved_and_its_temporaries_are_found(tmp_path, monkeypatch,
                                                                                                name_of):
    """The temporary file beside the target must fit the file system's name limit too (a 250-character name is
    a valid file name, and torch.save writes it)."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    path = tmp_path / name_of(limit)
    assert len(os.fsencode(path.name)) <= limit
    path.write_bytes(b"")  # the name itself is valid here
    path.unlink()
    ck.save(path, {"x": torch.arange(3)})
    ck.save(path, {"x": torch.arange(4)})
    assert torch.equal(ck.load(path)["x"], torch.arange(4))
    assert ck.stale_temporaries(path) == [] and sorted(os.listdir(tmp_path)) == [path.name]

    seen = []
    real = ck_io.serialize_file

    def interrupted(specs, filename, metadata=None, **kwargs):  # a save killed here leaves its temporary file
        real(specs, filename, metadata=metadata, **kwargs)
        seen.append(ck.stale_temporaries(path))
        raise KeyboardInterrupt

    monkeypatch.setattr(ck_io, "serialize_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.save(path, {"x": torch.zeros(2)})
    assert len(seen) == 1 and len(seen[0]) == 1 and len(os.fsencode(os.path.basename(seen[0][0]))) <= limit
    assert torch.equal(ck.load(path)["x"], torch.arange(4)) and ck.stale_temporaries(path) == []


# A tensor whose memory was freed (untyped_storage().resize_(0), as FSDP frees tensors) or shrunk, given to a
# checkpoint writer or converter: save() failed in safetensors' memoryview ("info->buf must not be NULL") for a freed
# one and wrote a file of bytes read past a shrunk one's end (its load then failed the checksum); save_async(),
# to_torch_optim() and from_torch_optim() copied it (a segmentation fault; garbage past a shrunk end); save_zero3()
# failed in torch's view ("setStorage: ... out of bounds"); a step count or a group's tensor lr named no leaf,
# a group's betas as a tensor pair raised that bare RuntimeError.
# Each is refused naming the leaf, before any file is written; in a subprocess, so that a crash fails the test.
_FREED_CHECKPOINT = """
import os, re, sys, tempfile
import torch
from refusal_script import expect_refused
import sofx
import sofx.checkpoint as ck
from sofx.checkpoint import CheckpointError


def cut(t, keep):
    t.untyped_storage().resize_(keep)
    return t


def setup():
    gen = torch.Generator().manual_seed(0)
    opt = sofx.adamw(lr=1e-2)
    params = {"w": torch.randn(40, 30, generator=gen), "b": torch.randn(3000, generator=gen)}
    grads = {k: torch.randn(t.shape, generator=gen) for k, t in params.items()}
    params, state, _ = opt.update(params, grads, opt.init(params))
    return opt, params, state


def expect(case, fn, pattern, directory):  # (and no file written)
    expect_refused(case, fn, CheckpointError, pattern, lambda: [sorted(os.listdir(directory))])


for keep in (0, 8):  # freed; shrunk
    holds = f": its storage holds {keep} bytes"
    d = tempfile.mkdtemp()
    path = os.path.join(d, "run.ckpt")
    opt, params, state = setup()
    cut(params["b"], keep)
    expect(f"save {keep}", lambda: ck.save(path, {"params": params}), re.escape("tree['params']['b']") + holds, d)
    expect(f"save_async {keep}", lambda: ck.save_async(path, {"params": params}).wait(),
           re.escape("tree['params']['b']") + holds, d)
    expect(f"save_zero3 param {keep}", lambda: ck.save_zero3(d, opt, params, state),
           re.escape("params['b']") + holds, d)
    for field in ("mu", "nu"):
        opt, params, state = setup()
        cut(getattr(state, field)["b"], keep)
        expect(f"to_torch_optim {field} {keep}", lambda: ck.to_torch_optim(opt, state),
               re.escape(f"state.{field}['b']") + holds, d)
        expect(f"save_zero3 {field} {keep}", lambda: ck.save_zero3(d, opt, params, state),
               re.escape(f"state.{field}['b']") + holds, d)
    opt, params, state = setup()
    cut(state.count["b"], keep // 2)
    count = re.escape("state.count['b']") + f": its storage holds {keep // 2} bytes"
    expect(f"to_torch_optim count {keep}", lambda: ck.to_torch_optim(opt, state), count, d)
    expect(f"save_zero3 count {keep}", lambda: ck.save_zero3(d, opt, params, state), count, d)
    for key in ("exp_avg", "exp_avg_sq"):
        opt, params, state = setup()
        sd = ck.to_torch_optim(opt, state)
        cut(sd["state"][0][key], keep)
        expect(f"from_torch_optim {key} {keep}", lambda: ck.from_torch_optim(opt, sd, params),
               re.escape(f"state[0][{key!r}] for params['b']") + holds, d)
    opt, params, state = setup()
    sd = ck.to_torch_optim(opt, state)
    cut(sd["state"][0]["step"], keep // 4)
    expect(f"from_torch_optim step {keep}", lambda: ck.from_torch_optim(opt, sd, params),
           re.escape("state[0] (params['b'])") + f": its storage holds {keep // 4} bytes", d)
    sd = ck.to_torch_optim(opt, state)
    sd["param_groups"][0]["lr"] = cut(torch.tensor(1e-3), keep // 4)
    expect(f"from_torch_optim lr {keep}", lambda: ck.from_torch_optim(opt, sd, params),
           re.escape("param_groups[0]['lr']") + f": its storage holds {keep // 4} bytes", d)
    sd = ck.to_torch_optim(opt, state)
    sd["param_groups"][0]["betas"] = cut(torch.tensor([0.9, 0.999]), keep // 2)  # (unpacked: a bare RuntimeError)
    expect(f"from_torch_optim betas {keep}", lambda: ck.from_torch_optim(opt, sd, params),
           re.escape("param_groups[0]['betas']") + f": its storage holds {keep // 2} bytes", d)
print("ok")
"""


def test_a_tensor_whose_storage_was_freed_or_shrunk_is_refused_by_the_checkpoint_writers_naming_it():
    script_prints_ok(_FREED_CHECKPOINT)


def test_a_nested_tensor_is_refused_naming_its_path_and_nothing_is_written(tmp_path):
    """A nested tensor (strided layout) passed the layout check and raised torch's "Internal error:
    NestedTensorImpl doesn't support sizes" from save and save_async, naming no leaf. It is a CheckpointError
    naming its path, before anything is written (the previous file intact, no temporary left)."""
    import warnings
    with warnings.catch_warnings():  # (torch's warning that nested tensors are a prototype, once per process)
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    path = tmp_path / "n.ckpt"
    ck.save(path, {"previous": torch.arange(3)})
    for save in (ck.save, ck.save_async):
        with pytest.raises(ck.CheckpointError, match=r"^tree\['x'\]: a nested tensor cannot be stored"):
            save(path, {"x": nested})
    assert torch.equal(ck.load(path)["previous"], torch.arange(3))
    assert ck.stale_temporaries(path) == []


def test_a_lazy_modules_uninitialized_parameter_is_refused_naming_its_path_and_nothing_is_written(tmp_path):
    """A lazy module's parameter before its first forward (torch.nn.UninitializedParameter, or an
    UninitializedBuffer) raised torch's ValueError ('Attempted to use an uninitialized parameter in ...
    storage_offset') from save and save_async, and its RuntimeError as load's template, naming no leaf. Each is a
    CheckpointError naming its path, before anything is written or read."""
    path = tmp_path / "u.ckpt"
    ck.save(path, {"previous": torch.arange(3)})
    lazy = torch.nn.LazyLinear(2)
    for save in (ck.save, ck.save_async):
        for leaf in (lazy.weight, torch.nn.UninitializedBuffer()):
            with pytest.raises(ck.CheckpointError, match=r"^tree\['x'\]: an uninitialized parameter or buffer \(a "
                                                         r"lazy module's"):
                save(path, {"x": leaf})
    assert torch.equal(ck.load(path)["previous"], torch.arange(3))
    assert ck.stale_temporaries(path) == []
    with pytest.raises(ck.CheckpointMismatchError, match=r"u\.ckpt: tree\['previous'\]: the template has an "
                                                         r"uninitialized parameter or buffer"):
        ck.load(path, like={"previous": torch.nn.UninitializedBuffer()})  # (torch's RuntimeError from its shape)


def test_a_path_ending_in_a_separator_is_refused(tmp_path):
    """``save("run/ckpt/", tree)`` (a path naming a directory, as its separator at the end says) wrote a file
    ``run/ckpt``, which ``load("run/ckpt/")`` then said does not exist; ``open`` (and so ``torch.save``) refuses
    such a path. It is refused before anything is written or snapshotted, by ``save``, ``save_async`` and
    ``AsyncSaver.save``, also where a file or a link is there."""
    old = {"x": torch.randn(3, generator=torch.Generator().manual_seed(1))}
    ck.save(tmp_path / "kept", old)
    os.symlink(tmp_path / "kept", tmp_path / "link")
    for name in ("new", "kept", "link"):
        for path in (f"{tmp_path / name}/", os.fsencode(f"{tmp_path / name}/")):
            for save in (ck.save, lambda p, t: ck.save_async(p, t).wait(), lambda p, t: ck.AsyncSaver().save(p, t)):
                with pytest.raises(ck.CheckpointError, match=r"ends in a path separator"):
                    save(path, {"x": torch.zeros(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "link"]
    assert torch.equal(ck.load(tmp_path / "kept")["x"], old["x"])


def test_a_path_ending_in_dot_is_refused_as_naming_a_directory(tmp_path):
    """``save("run/ckpt/.", tree)`` with ``run/ckpt`` a checkpoint replaced that file (abspath drops the ``/.``),
    where ``open`` refuses the path (not a directory); ``.`` or ``..`` last names a directory. Refused before
    anything is written, by ``save``, ``save_async`` and ``AsyncSaver.save``."""
    old = {"x": torch.randn(3, generator=torch.Generator().manual_seed(1))}
    ck.save(tmp_path / "kept", old)
    for path in (f"{tmp_path / 'kept'}{os.sep}.", os.fsencode(os.path.join(tmp_path, "kept", ".")),
                 os.path.join(tmp_path, "kept", ".."), os.path.join(tmp_path, "new", ".")):
        for save in (ck.save, lambda p, t: ck.save_async(p, t).wait(), lambda p, t: ck.AsyncSaver().save(p, t)):
            with pytest.raises(ck.CheckpointError, match=r"cannot save .*: the path ends in '\.\.?', so it names a "
                                                         r"directory"):
                save(path, {"x": torch.zeros(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert torch.equal(ck.load(tmp_path / "kept")["x"], old["x"])


def test_a_destination_that_is_not_a_regular_file_is_refused(tmp_path):
    """A save to a FIFO or a device node (``save("/dev/null", tree)`` for a dry run) renamed its temporary over
    it: the node was replaced by a regular file (as root, /dev/null itself). Such a destination, or a link to one,
    is refused before anything is written, by ``save``, ``save_async`` and ``AsyncSaver.save``; the node stays."""
    import stat

    os.mkfifo(tmp_path / "fifo")
    nodes = {"fifo": "a FIFO"}
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        nodes["null"] = "a character device"
    except (PermissionError, AttributeError):  # (not root: the FIFO alone)
        pass
    os.symlink(tmp_path / "fifo", tmp_path / "link")
    nodes["link"] = "a FIFO"
    before = {name: stat.S_IFMT(os.lstat(tmp_path / name).st_mode) for name in nodes}
    for name, kind in nodes.items():
        for save in (ck.save, lambda p, t: ck.save_async(p, t).wait(), lambda p, t: ck.AsyncSaver().save(p, t)):
            with pytest.raises(ck.CheckpointError, match=rf"{name}.* is {kind}, not a regular file"):
                save(tmp_path / name, {"x": torch.randn(3)})
    assert {name: stat.S_IFMT(os.lstat(tmp_path / name).st_mode) for name in nodes} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(nodes)


def test_a_file_name_longer_than_the_file_system_allows_is_refused_before_writing(tmp_path, monkeypatch):
    """A name one byte over the file system's limit (``open`` refuses it: "File name too long") was found out only
    by the rename, after the whole tree had been written to the temporary (whose name is shortened to fit), and by
    ``save_async`` only at ``wait()``. It is refused at once, naming both lengths; nothing is written."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    written = []
    real = ck_io.serialize_file
    monkeypatch.setattr(ck_io, "serialize_file", lambda *a, **k: (written.append(a[1]), real(*a, **k))[1])
    for name in ("c" * (limit - 4) + ".ckpt", "é" * (limit // 2 + 1)):
        with pytest.raises(OSError):
            open(tmp_path / name, "wb")
        for save in (ck.save, ck.save_async, ck.AsyncSaver().save):
            with pytest.raises(ck.CheckpointError, match=rf"the file name is {len(os.fsencode(name))} bytes long; "
                                                         rf"this file system allows at most {limit}"):
                save(tmp_path / name, {"x": torch.randn(4)})
    assert written == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("template", [dict, collections.Counter, lambda d: collections.defaultdict(int, d)],
                         ids=["dict", "Counter", "defaultdict"])
def test_a_saved_ordered_dict_keeps_its_order_under_a_template_of_another_dict_type(tmp_path, template):
    """An OrderedDict's order is its leaf order (optree keeps it; a dict's keys are sorted). Loaded with a template of
    another dict type, which matches it key by key, it came back an OrderedDict in the template's insertion order:
    another tree than the one saved (its leaves renumbered: to_torch_optim's numbering, a Shard's owners, leaf
    indices). It keeps its saved order; an OrderedDict template still orders it."""
    saved = collections.OrderedDict([("z", torch.ones(2)), ("a", torch.zeros(3))])
    path = ck.save(tmp_path / "o.ckpt", {"x": saved})
    back = ck.load(path, like={"x": template({"a": torch.zeros(3), "z": torch.zeros(2)})})["x"]
    assert type(back) is collections.OrderedDict and list(back) == ["z", "a"]
    assert torch.equal(back["z"], saved["z"]) and torch.equal(back["a"], saved["a"])
    reordered = collections.OrderedDict([("a", torch.zeros(3)), ("z", torch.zeros(2))])
    assert list(ck.load(path, like={"x": reordered})["x"]) == ["a", "z"]


@pytest.mark.parametrize("key, kind", [(True, "a bool"), (1.0, "a float")])
def test_a_template_key_equal_to_a_saved_key_only_by_pythons_equality_is_refused_naming_both(tmp_path, key, kind):
    """A checkpoint's dict keys are str or int (a bool or float key is refused at save). A template key of
    another type that Python finds equal (``True == 1 == 1.0``) matched the saved ``1``, and the loaded dict held
    the template's key, which no save writes: refused, naming the path and both keys. An integer of another type
    is the int it equals."""
    path = ck.save(tmp_path / "k.ckpt", {0: torch.zeros(1), 1: torch.ones(2)})
    shown = re.escape(repr(key))
    with pytest.raises(ck.CheckpointMismatchError, match=rf"k\.ckpt: tree: the template's dict key {shown} \({kind}\) "
                                                         r"is the checkpoint's key 1 \(an int\) only by Python's "
                                                         r"equality"):
        ck.load(path, like={0: torch.zeros(1), key: torch.ones(2)})
    assert list(ck.load(path, like={1: torch.zeros(2), 0: torch.zeros(1)})) == [1, 0]
    np = pytest.importorskip("numpy")  # (a numpy integer is the int it holds, as a numpy scalar template is)
    assert ck.load(path, like={0: torch.zeros(1), np.int64(1): torch.zeros(2)})[1].shape == (2,)
