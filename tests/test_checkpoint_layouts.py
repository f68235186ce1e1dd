"""Checkpoints keep a tensor's dense layout (a transposed matrix, a channels_last convolution weight).

Such a tensor is saved as its memory, in memory order (the safetensors entry is ``t.permute(order)``, which other
safetensors readers see as a meaningful array), and its structure node records ``order``; it loads back of the
same shape and strides, so a resumed run's moments have their parameters' layout and its Adam steps run over
memory as the uninterrupted run's did (``sofx.kernels.layout``). Tensors with gaps are saved contiguous, and
contiguous ones exactly as before.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import sofx
import sofx.checkpoint as ck
from sofx.checkpoint import io as ck_io
from sofx.kernels import cpu
from sofx.kernels.layout import in_memory_order, is_dense, same_layout

native = pytest.mark.skipif(not cpu.native_available(), reason="no C compiler: no native kernels")


def _transposed(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(cols, rows, generator=gen).t()


def _channels_last(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=gen).contiguous(memory_format=torch.channels_last)


LAYOUTS = {
    "transposed": lambda gen: _transposed(gen, 5, 7),
    "square transposed": lambda gen: _transposed(gen, 6, 6),  # the file's array has the saved shape too
    "channels_last": lambda gen: _channels_last(gen, (4, 3, 5, 2)),
    "channels_last rgb": lambda gen: _channels_last(gen, (8, 3, 3, 3)),  # a first conv layer's weight
    "channels_last one image": lambda gen: _channels_last(gen, (1, 3, 4, 2)),  # a dimension of size 1
    "permuted 3-d": lambda gen: torch.randn(4, 2, 3, generator=gen).permute(2, 0, 1),
    "transposed rows of a larger one": lambda gen: torch.randn(9, 4, generator=gen)[2:7].t(),  # an offset
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, strides (of the dimensions of more than one element) and bits."""
    return a.dtype == b.dtype and same_layout(a, b) and torch.equal(_bits(a), _bits(b))


def _save_async(path, tree):
    return ck.save_async(path, tree).wait(60)


SAVES = {"save": ck.save, "save_async": _save_async}


@pytest.mark.parametrize("save", sorted(SAVES))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_dense_layout_comes_back_with_its_strides_and_bits(tmp_path, layout, dtype, save):
    gen = torch.Generator().manual_seed(0)
    t = LAYOUTS[layout](gen).to(DTYPES[dtype])
    assert is_dense(t) and not t.is_contiguous()
    path = SAVES[save](tmp_path / "l.ckpt", {"t": t, "flat": t.contiguous()})
    for back in (ck.load(path), ck.load(path, device="cpu"),
                 ck.load(path, like={"t": torch.zeros(t.shape, dtype=t.dtype), "flat": t.contiguous()})):
        assert _same_tensor(back["t"], t) and back["flat"].is_contiguous() and torch.equal(back["flat"], t)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_other_safetensors_readers_see_the_tensor_in_its_memory_order(tmp_path, layout):
    """The file's array is the tensor's memory, read as a contiguous array of its dimensions in memory order (a
    channels_last weight is an NHWC array), and its structure node names that order."""
    t = LAYOUTS[layout](torch.Generator().manual_seed(1))
    path = ck.save(tmp_path / "l.ckpt", {"t": t})
    node = ck.read_metadata(path)["tree"]["items"][0]
    order = node["order"]
    assert sorted(order) == list(range(t.dim())) and node["shape"] == list(t.shape)
    with safe_open(path, "pt") as f:
        stored = f.get_tensor("tree['t']")
    assert torch.equal(stored, t.permute(order)) and torch.equal(stored.reshape(-1), in_memory_order(t))


def test_contiguous_tensors_and_tensors_with_gaps_are_saved_contiguous_without_an_order(tmp_path):
    gen = torch.Generator().manual_seed(2)
    tree = {"c": torch.randn(3, 4, generator=gen), "gaps": torch.randn(4, 6, generator=gen)[:, ::2],
            "gaps transposed": torch.randn(6, 4, generator=gen)[::2].t(), "empty": torch.randn(0, 3).t(),
            "scalar": torch.tensor(1.5), "expanded": torch.randn(3, 1, generator=gen).expand(3, 4)}
    assert not any(is_dense(tree[k]) for k in ("gaps", "gaps transposed", "expanded"))
    path = ck.save(tmp_path / "c.ckpt", tree)
    nodes = ck.read_metadata(path)["tree"]["items"]
    assert all(set(n) == {"k", "key", "dtype", "shape", "requires_grad", "device", "crc32"} for n in nodes)
    back = ck.load(path)
    assert all(back[k].is_contiguous() and torch.equal(back[k], tree[k]) for k in tree)


def _trained(opt, params, gen, steps, state=None):
    state = opt.init(params) if state is None else state
    for _ in range(steps):
        grads = {k: (torch.randn(p.shape, generator=gen).to(p.dtype)
                     .contiguous(memory_format=torch.channels_last) if p.dim() == 4
                     else torch.randn(p.shape[::-1], generator=gen).to(p.dtype).t()) for k, p in params.items()}
        params, state, _ = opt.update(params, grads, state)
    return params, state


def _layered_params(gen, dtype):
    return {"conv": _channels_last(gen, (8, 3, 3, 3)).to(dtype), "fc": _transposed(gen, 6, 5).to(dtype)}


@pytest.mark.parametrize("save", sorted(SAVES))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_an_adam_state_comes_back_in_its_parameters_layouts(tmp_path, dtype, save):
    gen = torch.Generator().manual_seed(3)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32, backend="reference")
    params, state = _trained(opt, _layered_params(gen, DTYPES[dtype]), gen, 2)
    assert all(same_layout(state.mu[k], params[k]) for k in params)
    tree = {"params": params, "state": state}
    back = ck.load(SAVES[save](tmp_path / "a.ckpt", tree))
    assert type(back["state"]) is sofx.AdamState
    for a, b in zip(sofx.tree.flatten(tree)[0], sofx.tree.flatten(back)[0]):
        assert _same_tensor(b, a)


@native
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_adam_resumed_from_a_checkpoint_steps_leaves_of_one_layout_and_equals_the_uninterrupted_run(tmp_path,
                                                                                                  dtype,
                                                                                                  monkeypatch):
    """After a resume the moments have the parameters' (and gradients') layouts: the native kernels step each
    leaf over its memory, without the copies of a block of mixed layouts, and the run is the uninterrupted one
    bit for bit."""
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=torch.float32, backend="cpu")
    gen = torch.Generator().manual_seed(4)
    params, state = _trained(opt, _layered_params(gen, DTYPES[dtype]), gen, 2)
    ck.save(tmp_path / "r.ckpt", {"params": params, "state": state, "rng": gen.get_state()})
    want_params, want_state = _trained(opt, params, gen, 2, state)

    back = ck.load(tmp_path / "r.ckpt")
    gen.set_state(back["rng"])
    assert all(same_layout(leaves[k], params[k]) for leaves in (back["params"], back["state"].mu, back["state"].nu)
               for k in params)

    def copied(*args, **kwargs):
        raise AssertionError("a block of mixed layouts was copied")

    monkeypatch.setattr(cpu, "_prepare", copied)
    got_params, got_state = _trained(opt, back["params"], gen, 2, back["state"])
    for a, b in zip(sofx.tree.flatten((got_params, got_state))[0], sofx.tree.flatten((want_params, want_state))[0]):
        assert _same_tensor(a, b)


def _with_tree(path, edit) -> None:
    """The checkpoint at ``path`` written again, its data kept, with ``edit(structure)`` as its structure."""
    with safe_open(path, "pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    structure = json.loads(meta["tree"])
    edit(structure)
    meta["tree"] = json.dumps(structure)
    meta["tree_crc32"] = ck_io.structure_checksum(meta["tree"])  # as a writer of that structure records it
    save_file(tensors, path, metadata=meta)


@pytest.mark.parametrize("order, why", [
    ([0, 0, 2, 3], "bad tensor order"),            # not a permutation
    ([0, 2, 1], "bad tensor order"),               # wrong length
    ([0, 2, 3, 1, 4], "bad tensor order"),
    ([0, 2, 3, 4], "bad tensor order"),            # a dimension it has not
    ([0, -3, 3, 1], "bad tensor order"),
    ([0, 2.0, 3, 1], "bad tensor order"),
    ([0, True, 3, 2], "bad tensor order"),
    ("0231", "bad tensor order"),
    (None, "bad tensor order"),
    ([0, 1, 3, 2], r"has shape \[4, 2, 3, 5\] in the file, \[4, 5, 3, 2\] in the structure \(shape \[4, 5, 2, 3\] "
                  r"in dimension order \[0, 1, 3, 2\]\)"),  # another order
])
def test_a_bad_order_in_a_file_is_corrupt_and_nothing_is_read(tmp_path, order, why):
    """A bad ``order`` is found with the structure, before any tensor's data is read: the corrupted data of the
    leaf before it is not what is reported."""
    gen = torch.Generator().manual_seed(5)
    path = ck.save(tmp_path / "b.ckpt", {"a": torch.randn(3, generator=gen),
                                         "w": _channels_last(gen, (4, 5, 2, 3))})

    def edit(structure):
        structure["items"][0]["crc32"] ^= 1  # the first leaf's data: "corrupted"
        structure["items"][1]["order"] = order

    _with_tree(path, edit)
    with pytest.raises(ck.CorruptCheckpointError, match=why):
        ck.load(path)
    with pytest.raises(ck.CorruptCheckpointError, match=why):
        ck.load(path, like={"a": torch.zeros(3), "w": torch.zeros(4, 5, 2, 3)})


def test_a_dense_layout_is_covered_by_its_checksum(tmp_path):
    path = ck.save(tmp_path / "s.ckpt", {"w": _channels_last(torch.Generator().manual_seed(6), (2, 3, 4, 5))})
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x10
    open(path, "wb").write(bytes(data))
    with pytest.raises(ck.CorruptCheckpointError, match="checksum"):
        ck.load(path)


def test_a_file_without_orders_loads_a_transposed_tensor_contiguous_as_before(tmp_path):
    """A file written before orders were recorded (a transposed tensor saved as a contiguous copy, format
    version 1) loads as it did: contiguous."""
    t = _transposed(torch.Generator().manual_seed(7), 3, 4)
    node = {"k": "tensor", "key": "tree['t']", "dtype": "float32", "shape": [3, 4], "requires_grad": False,
            "device": "cpu", "crc32": zlib.crc32(t.contiguous().numpy().tobytes())}
    structure = {"k": "dict", "keys": [["s", "t"]], "items": [node]}
    path = tmp_path / "o.ckpt"
    save_file({"tree['t']": t.contiguous()}, path, metadata={"format": "sofx.checkpoint", "format_version": "1",
                                                             "writer": "sofx 0.1.0", "tree": json.dumps(structure)})
    back = ck.load(path)["t"]
    assert back.is_contiguous() and torch.equal(back, t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("save", sorted(SAVES))
def test_a_dense_layout_on_the_gpu_comes_back_in_it_on_the_cpu_and_on_the_gpu(tmp_path, save):
    gen = torch.Generator().manual_seed(8)
    tree = {f"{k} {d}": LAYOUTS[k](gen).to(DTYPES[d]).cuda() for k in ("transposed", "channels_last") for d in DTYPES}
    assert all(is_dense(t) and not t.is_contiguous() for t in tree.values())
    path = SAVES[save](tmp_path / "g.ckpt", tree)
    template = {k: torch.zeros(t.shape, dtype=t.dtype, device="cuda") for k, t in tree.items()}
    for back, where in ((ck.load(path), "cpu"), (ck.load(path, device="cuda"), "cuda"),
                        (ck.load(path, like=template), "cuda")):
        for k, t in tree.items():
            assert back[k].device.type == where and _same_tensor(back[k].cpu(), t.cpu()) and same_layout(back[k], t)


def test_a_file_with_orders_is_format_version_2_and_others_stay_version_1(tmp_path):
    """A file that holds an array in another order of its tensor's dimensions needs a reader that knows orders:
    it says format version 2, which an older sofx refuses (a CheckpointVersionError) instead of loading the
    permuted array as the tensor (a square one, or a channels_last weight of 3 channels and a 3 x 3 kernel,
    has the file array's shape: its values came back scrambled). A file without orders stays version 1, which
    every sofx reads; this sofx reads both."""
    gen = torch.Generator().manual_seed(9)
    plain = ck.save(tmp_path / "p.ckpt", {"w": torch.randn(3, 3, generator=gen)[:, ::2], "c": torch.randn(2)})
    dense = ck.save(tmp_path / "d.ckpt", {"w": _channels_last(gen, (8, 3, 3, 3)), "c": torch.randn(2)})
    assert ck.read_metadata(plain)["version"] == 1
    assert ck.read_metadata(dense)["version"] == 2 == ck.FORMAT_VERSION
    with safe_open(dense, "pt") as f:
        assert list(f.get_slice("tree['w']").get_shape()) == [8, 3, 3, 3]  # NHWC: the tensor's shape too
    assert ck.load(plain)["w"].shape == (3, 2) and ck.load(dense)["w"].stride() == (27, 1, 9, 3)


def test_an_order_in_a_file_of_version_1_is_corrupt(tmp_path):
    """Version 1 has no orders: a node with one in such a file is damaged (or edited), not read."""
    path = ck.save(tmp_path / "o.ckpt", {"w": _transposed(torch.Generator().manual_seed(10), 3, 3)})
    with safe_open(path, "pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, path, metadata={**meta, "format_version": "1"})
    with pytest.raises(ck.CorruptCheckpointError, match=r"tree\['w'\].*has an order.*format version 1"):
        ck.load(path)
