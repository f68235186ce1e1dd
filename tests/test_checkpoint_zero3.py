"""DeepSpeed ZeRO-3 optimizer layout: file names, nesting, flat blocks, partitioning, round trips, and DeepSpeed
itself reading and writing it."""

from __future__ import annotations

import enum
import errno
import importlib.util
import math
import os
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

import sofx
import sofx.checkpoint as ck
from sofx.checkpoint import zero3
from sofx import tree
from sofx.errors import UnsupportedError

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(11)
    return {"enc": {"w": torch.randn(5, 3, generator=g).to(dtype), "b": torch.randn(7, generator=g).to(dtype)},
            "dec": [torch.randn(4, generator=g).to(dtype)]}


def _grads(params, step):
    g = torch.Generator().manual_seed(50 + step)
    return tree.tree_map(lambda p: torch.randn(p.shape, generator=g).to(p.dtype), params)


HP = {"enc": sofx.AdamHParams(lr=2e-2), "dec": sofx.AdamHParams(lr=5e-3, beta2=0.99)}


def _train(opt, params, state, start, stop, hp=HP):
    for step in range(start, stop):
        params, state, _ = opt.update(params, _grads(params, step), state, hp)
    return params, state


def _bits_equal(a, b):
    la, sa = tree.flatten(a)
    lb, sb = tree.flatten(b)
    return sa == sb and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


def test_layout_as_specified(tmp_path):
    opt = sofx.adamw(lr=1e-2)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 3)
    files = ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=2, mp_rank=1, deepspeed_objects=False)
    assert [os.path.basename(f) for f in files] == ["zero_pp_rank_0_mp_rank_01_optim_states.pt",
                                                    "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    top = torch.load(files[1], weights_only=True)
    z = top["optimizer_state_dict"]
    assert z["zero_stage"] == 3 and z["partition_count"] == 2
    inner = z["optimizer_state_dict"]
    # blocks = param groups in flatten order: dec (4 elements), enc (b: 7, w: 15)
    assert [g["params"] for g in inner["param_groups"]] == [[0], [1]]
    g0 = inner["param_groups"][0]
    assert (g0["lr"], g0["betas"], g0["eps"], g0["weight_decay"], g0["bias_correction"]) == \
        (5e-3, (0.9, 0.99), 1e-8, 1e-2, True)
    assert set(inner["state"]) == {0, 1}
    assert inner["state"][1]["step"] == 3 and set(inner["state"][1]) == {"step", "exp_avg", "exp_avg_sq"}
    flats = z["fp32_flat_groups"]
    # ZeRO-3 partitioning: each parameter split into ceil(n/2)-element pieces; rank 1 holds the second pieces
    assert [f.numel() for f in flats] == [2, 4 + 8]
    assert all(f.dtype == torch.float32 and f.dim() == 1 for f in flats)
    b, w = params["enc"]["b"], params["enc"]["w"].reshape(-1)
    assert torch.equal(flats[1][:4], torch.cat([b[4:], torch.zeros(1)]))  # zero padding at the end
    assert torch.equal(flats[1][4:], torch.cat([w[8:], torch.zeros(1)]))
    assert torch.equal(inner["state"][1]["exp_avg"][:3], state.mu["enc"]["b"][4:])
    assert torch.equal(inner["state"][0]["exp_avg_sq"], state.nu["dec"][0][2:])
    # bf16 params: the bf16_ prefix, and the flat master is still float32
    opt16 = sofx.adamw(state_dtype=torch.float32)
    p16 = _params(torch.bfloat16)
    files16 = ck.save_zero3(tmp_path / "bf16", opt16, p16, opt16.init(p16), deepspeed_objects=False)
    assert os.path.basename(files16[0]) == "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    flat16 = torch.load(files16[0], weights_only=True)["optimizer_state_dict"]["fp32_flat_groups"][0]
    assert flat16.dtype == torch.float32
    assert torch.equal(flat16, tree.pack(tree.flatten(p16)[0], dtype=torch.float32))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32)])
def test_round_trip_and_continue_equals_uninterrupted(tmp_path, world, dtype, state_dtype):
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    ref_params, ref_state = _train(opt, _params(dtype), opt.init(_params(dtype)), 0, 6)
    params, state = _train(opt, _params(dtype), opt.init(_params(dtype)), 0, 3)
    ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=world)
    template = tree.tree_map(torch.zeros_like, _params(dtype))
    p2, s2, hp2 = ck.load_zero3(tmp_path, opt, template, {"enc": sofx.AdamHParams(), "dec": sofx.AdamHParams()})
    assert _bits_equal((p2, s2), (params, state))  # every dtype and bit: bf16 master, fp32 moments
    assert hp2["dec"] == sofx.AdamHParams(5e-3, 0.9, 0.99, 1e-8, 0.1) and hp2["enc"].lr == 2e-2
    p3, s3 = _train(opt, p2, s2, 3, 6, hp2)
    assert _bits_equal((p3, s3), (ref_params, ref_state))


def test_single_block_and_explicit_groups(tmp_path):
    opt = sofx.adam(lr=1e-3)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2, hp=None)
    ck.save_zero3(tmp_path / "one", opt, params, state, deepspeed_objects=False)
    z = torch.load(tmp_path / "one" / ck.zero3_file_name(0), weights_only=True)["optimizer_state_dict"]
    assert len(z["fp32_flat_groups"]) == 1 and z["fp32_flat_groups"][0].numel() == 4 + 7 + 15
    groups = [["params['enc']['w']"], ["params['enc']['b']", "params['dec'][0]"]]
    ck.save_zero3(tmp_path / "two", opt, params, state, groups=groups)
    p2, s2, per_leaf = ck.load_zero3(tmp_path / "two", opt, params, groups=groups)
    assert _bits_equal((p2, s2), (params, state)) and per_leaf["enc"]["w"] == sofx.AdamHParams(1e-3, 0.9, 0.999,
                                                                                             1e-8, 0.0)


def test_meta_template_params_load_on_the_cpu(tmp_path):
    opt = sofx.adam(lr=1e-3)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2, hp=None)
    ck.save_zero3(tmp_path / "z", opt, params, state)
    meta = tree.tree_map(lambda p: torch.empty_like(p, device="meta"), params)
    p2, s2, _ = ck.load_zero3(tmp_path / "z", opt, meta)
    assert _bits_equal((p2, s2), (params, state))


@pytest.mark.parametrize("leaf, why", [(torch.zeros(7, dtype=torch.int64), "a floating-point tensor, got dtype "
                                                                         "torch.int64"),
                                       (torch.zeros(7, dtype=torch.bool), "a floating-point tensor, got dtype "
                                                                          "torch.bool"),
                                       (torch.zeros(7).to_sparse(), "a dense \\(strided\\) tensor"),
                                       (0.5, "a tensor, got float")], ids=["int64", "bool", "sparse", "float"])
def test_a_params_template_leaf_sofx_cannot_step_is_refused_naming_it(tmp_path, leaf, why):
    """An int64 or bool template leaf took the fp32 master and moments cast to its dtype (truncated, without a
    word), a Python number raised a bare AttributeError ('float' object has no attribute 'shape'). Refused naming
    the leaf, as opt.init refuses such params."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 1)
    ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=2, deepspeed_objects=False)
    template = {**params, "enc": {**params["enc"], "b": leaf}}
    with pytest.raises(ck.CheckpointError, match=rf"^load_zero3: params\['enc'\]\['b'\]: expected {why}"):
        ck.load_zero3(tmp_path, opt, template, HP)


def test_a_lazy_modules_uninitialized_parameter_is_refused_naming_the_leaf_before_any_file(tmp_path):
    """A lazy module's parameters before their first forward (no shape, no data) raised torch's RuntimeError ('Can't
    access the shape of an uninitialized parameter') from save_zero3 and load_zero3, naming no leaf: a
    CheckpointError naming the function and the leaf, before any file is written or read."""
    opt = sofx.adamw()
    real = dict(torch.nn.Linear(3, 2).named_parameters())
    state = opt.init(real)
    ck.save_zero3(tmp_path / "real", opt, real, state, deepspeed_objects=False)
    lazy = dict(torch.nn.LazyLinear(2).named_parameters())
    for who, call in (("save_zero3", lambda: ck.save_zero3(tmp_path / "out", opt, lazy, state,
                                                           deepspeed_objects=False)),
                      ("load_zero3", lambda: ck.load_zero3(tmp_path / "real", opt, lazy))):
        with pytest.raises(ck.CheckpointError, match=rf"^{who}: params\['bias'\] is an uninitialized parameter"):
            call()
    assert not os.path.exists(tmp_path / "out")


def test_a_save_into_an_older_checkpoint_directory_leaves_one_checkpoint(tmp_path, monkeypatch):
    """An older save with more dp ranks (or the other bf16_ prefix) in the same directory: its files that the new
    save does not overwrite are removed (loading read them as ranks of the new one, or refused)."""
    opt = sofx.adam(lr=1e-3)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=4, model_states=True, bf16=True)
    other = tmp_path / "notes.txt"
    other.write_text("kept")
    monkeypatch.chdir(tmp_path.parent)  # a relative directory
    written = ck.save_zero3(tmp_path.name, opt, params, state, HP, dp_world_size=2, model_states=True)
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(w) for w in written] + ["notes.txt"])
    p2, s2, _ = ck.load_zero3(tmp_path, opt, params, HP)
    assert _bits_equal((p2, s2), (params, state))


def test_saves_of_every_rank_into_one_directory_at_once_all_succeed(tmp_path, monkeypatch):
    """Every rank of a run saving the same checkpoint at once (as every rank calls DeepSpeed's save_checkpoint)
    over an older one with more dp ranks: each save removes the older files, and one that another rank removed
    between listing the directory and removing it was a FileNotFoundError on this rank (seen on 17 of 20 tries
    with 3 threads). Simulated deterministically: another rank removes each older file just before this one."""
    opt = sofx.adam(lr=1e-3)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=4, model_states=True, deepspeed_objects=False)
    remove = os.remove

    def removed_by_another_rank_first(path, *args, **kwargs):
        remove(path)
        remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", removed_by_another_rank_first)
    written = ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=2, model_states=True,
                            deepspeed_objects=False)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(w) for w in written)
    p2, s2, _ = ck.load_zero3(tmp_path, opt, params, HP)
    assert _bits_equal((p2, s2), (params, state))


def test_an_older_file_the_system_will_not_remove_is_a_named_io_error(tmp_path, monkeypatch):
    """The new save's files are written but an older save's file that they do not overwrite cannot be removed
    (its directory's permissions, a read-only mount): a CheckpointIOError with the system's errno naming the file
    and saying the directory holds both (loading would refuse or misread it), not a bare PermissionError."""
    opt = sofx.adam(lr=1e-3)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=4, deepspeed_objects=False)

    def refused(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(os, "remove", refused)
    with pytest.raises(ck.CheckpointIOError, match=r"the new save's files are written; an older save's file .*"
                       r"zero_pp_rank_[23]_mp_rank_00_optim_states\.pt cannot be removed") as info:
        ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=2, deepspeed_objects=False)
    assert info.value.errno == errno.EACCES



def _refuse_listing(monkeypatch, directory) -> None:
    """os.listdir of ``directory`` raises the system's PermissionError (EACCES), as for a directory without read
    permission (root may list any, so the refusal is made here); other directories are listed."""
    real_listdir = os.listdir

    def denied(path="."):
        if os.path.abspath(path) == os.path.abspath(directory):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", denied)


def test_a_directory_the_system_will_not_list_after_the_save_is_a_named_io_error(tmp_path, monkeypatch):
    """A directory this process may write but not list (mode -wx): the new save's files were written, then the
    listing for an older save's files raised os.listdir's bare PermissionError. A CheckpointIOError with the system's
    errno naming the directory, as a file it cannot remove."""
    opt = sofx.adam(lr=1e-3)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    _refuse_listing(monkeypatch, tmp_path)
    with pytest.raises(ck.CheckpointIOError, match=r"the new save's files are written; the directory .* cannot be "
                       r"listed") as info:
        ck.save_zero3(tmp_path, opt, params, state, HP, deepspeed_objects=False)
    assert info.value.errno == errno.EACCES

def test_the_layout_a_file_records_is_used_and_checked(tmp_path):
    """Saved with groups= (the model's order), loaded without them: the file's recorded layout; loaded with
    groups that put other leaves in a block: refused naming them (the flat sizes alone would agree)."""
    opt = sofx.adamw(lr=1e-2)
    params = {"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}
    state = opt.init(params)
    ck.save_zero3(tmp_path, opt, params, state, groups=[["params['b']"], ["params['a']"]], dp_world_size=2,
                  deepspeed_objects=False)
    template = {"a": torch.zeros(4), "b": torch.zeros(4)}
    p2, _, _ = ck.load_zero3(tmp_path, opt, template)
    assert torch.equal(p2["a"], params["a"]) and torch.equal(p2["b"], params["b"])
    with pytest.raises(ck.CheckpointMismatchError, match=r"block 0, leaf 0: the file holds \[\"params\['b'\]\""):
        ck.load_zero3(tmp_path, opt, template, groups=[["params['a']"], ["params['b']"]])


@pytest.mark.parametrize("template, pattern", [
    (5, r"^hparams for params\['dec'\]\[0\]: expected an AdamHParams, got int"),
    ({"enc": 0.1, "dec": None}, r"^hparams for params\['enc'\]\['b'\]: expected an AdamHParams, got float"),
    ({"enc": sofx.AdamHParams()}, r"^hparams is not a prefix of the structure of params")],
    ids=["a number", "a number in a dict", "a dict missing an entry"])
def test_an_hparams_template_that_is_no_prefix_tree_of_adamhparams_is_refused_where_the_files_give_the_layout(
        tmp_path, template, pattern):
    """Where the layout comes from the files (the blocks a sofx file records), the ``hparams`` template was only
    mapped over: ``{"enc": 0.1, "dec": None}`` came back with an ``AdamHParams`` in the number's place, and
    ``hparams=5`` was refused as an entry covering blocks of other values, where from_torch_optim and a load
    without the recorded layout refuse both as update would. Refused alike, naming the leaf (a dict missing an
    entry was already)."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    ck.save_zero3(tmp_path, opt, params, state, HP, deepspeed_objects=False)
    with pytest.raises(sofx.SofxError, match=pattern):
        ck.load_zero3(tmp_path, opt, _params(), template)


@pytest.mark.parametrize("model_states", [False, True])
def test_an_hparams_template_coarser_than_the_files_blocks_is_refused_not_given_one_blocks_values(tmp_path,
                                                                                                  model_states):
    """Where the layout comes from the files (their recorded blocks, or the model states' names), an ``hparams``
    template whose entry covers blocks of different hyperparameters (one ``AdamHParams`` for the whole tree) came
    back as the values of the first block alone: ``enc`` would have gone on with ``dec``'s lr and beta2 without a
    word. It is refused naming the leaves and their values; a template that fits gets each block's."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    ck.save_zero3(tmp_path, opt, params, state, HP, model_states=model_states, deepspeed_objects=False)
    with pytest.raises(ck.CheckpointMismatchError, match=r"hparams: the template's entry at hparams covers leaves "
                                                         r"the files give other hyperparameters: params\['dec'\]\[0\] "
                                                         r"lr=0\.005.*params\['enc'\]\['b'\] lr=0\.02"):
        ck.load_zero3(tmp_path, opt, _params(), sofx.AdamHParams())
    _, _, hp = ck.load_zero3(tmp_path, opt, _params(), {"enc": sofx.AdamHParams(), "dec": None})
    assert hp == {"enc": HP["enc"]._replace(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2),
                  "dec": HP["dec"]._replace(beta1=0.9, eps=1e-8, weight_decay=1e-2)}
    _, _, hp = ck.load_zero3(tmp_path, opt, _params())  # no template: one per leaf
    assert hp["enc"]["w"].lr == 2e-2 and hp["dec"][0].lr == 5e-3


def test_swapped_rank_files_are_refused_naming_the_file_and_both_ranks(tmp_path):
    """Each file records the dp rank it was written for: rank files swapped (or renamed) would otherwise load
    their pieces into the other rank's places without a word (the sizes agree)."""
    opt = sofx.adamw()
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    files = ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=2, deepspeed_objects=False)
    os.replace(files[0], tmp_path / "swap")
    os.replace(files[1], files[0])
    os.replace(tmp_path / "swap", files[1])
    with pytest.raises(ck.CorruptCheckpointError,
                       match=re.escape(f"{files[0]}: written for dp rank 1, its name says dp rank 0")):
        ck.load_zero3(tmp_path, opt, params, HP)


def test_two_files_for_one_dp_rank_are_refused_naming_both(tmp_path):
    """``zero_pp_rank_01_...`` and ``zero_pp_rank_1_...`` are both dp rank 1 (DeepSpeed writes the rank
    unpadded): the one listed last was taken without a word; now both are named (so are two of one mp rank)."""
    opt = sofx.adamw()
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    files = ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=2, deepspeed_objects=False)
    padded = tmp_path / "zero_pp_rank_01_mp_rank_00_optim_states.pt"
    shutil.copy(files[1], padded)
    with pytest.raises(ck.CorruptCheckpointError, match=r"2 ZeRO-3 optimizer files for dp rank 1 of mp rank 0: "
                       r"zero_pp_rank_01_mp_rank_00_optim_states.pt and zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        ck.load_zero3(tmp_path, opt, params, HP)
    os.remove(files[1])  # the padded name alone is still read as rank 1
    p2, s2, _ = ck.load_zero3(tmp_path, opt, params, HP)
    assert _bits_equal((p2, s2), (params, state))
    shutil.copy(files[0], tmp_path / "zero_pp_rank_0_mp_rank_000_optim_states.pt")  # mp rank 0 too
    with pytest.raises(ck.CorruptCheckpointError, match=r"2 ZeRO-3 optimizer files for dp rank 0 of mp rank 0: "
                       r"zero_pp_rank_0_mp_rank_000_optim_states.pt and zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        ck.load_zero3_loss_scaler(tmp_path)


def _old_name(path: str) -> str:
    """DeepSpeed's old optimizer file name (``..._mp_rank_00optim_states.pt``, no underscore before ``optim``)."""
    return path.replace("_optim_states.pt", "optim_states.pt")


@pytest.mark.parametrize("bf16", [False, True])
def test_deepspeeds_old_optimizer_file_names_are_read_as_deepspeed_reads_them(tmp_path, bf16):
    """DeepSpeed's engine falls back to the old file name ``..._mp_rank_00optim_states.pt`` for a rank whose
    ``..._mp_rank_00_optim_states.pt`` is missing (``_get_all_zero_checkpoint_names``); such a checkpoint was
    "not found". Old names load as the new ones; an old and a new file of one rank are refused naming both, and a
    save into the directory removes the old files (as the older save's they are)."""
    opt = sofx.adamw()
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    files = ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=2, bf16=bf16, deepspeed_objects=False)
    for f in files:
        os.replace(f, _old_name(f))
    p2, s2, _ = ck.load_zero3(tmp_path, opt, params, HP)
    assert _bits_equal((p2, s2), (params, state))
    assert ck.load_zero3_loss_scaler(tmp_path) is not None
    shutil.copy(_old_name(files[1]), files[1])
    old, new = os.path.basename(_old_name(files[1])), os.path.basename(files[1])
    with pytest.raises(ck.CorruptCheckpointError, match=re.escape(f"2 ZeRO-3 optimizer files for dp rank 1 of mp "
                                                                  f"rank 0: {new} and {old}")):
        ck.load_zero3(tmp_path, opt, params, HP)
    written = ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=2, bf16=bf16, deepspeed_objects=False)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(w) for w in written)


def test_float64_is_refused_not_rounded(tmp_path):
    opt = sofx.adamw()
    params = {"w": torch.randn(3, dtype=torch.float64)}
    with pytest.raises(UnsupportedError, match=r"params\['w'\]: param has dtype torch.float64"):
        ck.save_zero3(tmp_path, opt, params, opt.init(params))
    assert not os.listdir(tmp_path)


def test_errors(tmp_path):
    opt = sofx.adamw()
    params = _params()
    state = opt.init(params)
    grads = _grads(params, 0)
    grads["enc"]["b"] = None
    p1, s1, _ = opt.update(params, grads, state)
    with pytest.raises(UnsupportedError, match=r"one step count.*params\['enc'\]\['b'\]: 0"):
        ck.save_zero3(tmp_path, opt, p1, s1)
    with pytest.raises(ck.CheckpointNotFoundError, match="no zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        ck.load_zero3(tmp_path, opt, params)
    with pytest.raises(ck.CheckpointNotFoundError):
        ck.load_zero3(tmp_path / "absent", opt, params)
    files = ck.save_zero3(tmp_path, opt, params, state, HP, dp_world_size=3)
    one_block = [["params['enc']['w']", "params['enc']['b']", "params['dec'][0]"]]
    with pytest.raises(ck.CheckpointMismatchError, match="the file's block layout has 2 blocks, the load resolves 1"):
        ck.load_zero3(tmp_path, opt, params, groups=one_block)
    swapped = [["params['enc']['b']", "params['dec'][0]"], ["params['enc']['w']"]]
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"block 0, leaf 0: the file holds \[\"params\['dec'\]\[0\]\", \[4\]\], "
                             r"the load puts \[\"params\['enc'\]\['b'\]\""):
        ck.load_zero3(tmp_path, opt, params, groups=swapped)
    ck.load_zero3(tmp_path, opt, params)  # without groups=: the layout the file records
    bigger = {"enc": {"w": torch.zeros(5, 4), "b": torch.zeros(7)}, "dec": [torch.zeros(4)]}
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"block 1, leaf 1: the file holds \[\"params\['enc'\]\['w'\]\", \[5, 3\]\], "
                             r"the load puts \[\"params\['enc'\]\['w'\]\", \[5, 4\]\]"):
        ck.load_zero3(tmp_path, opt, bigger, HP)
    with pytest.raises(UnsupportedError, match="decoupled=True"):
        ck.load_zero3(tmp_path, sofx.adam(), params, HP)
    os.unlink(files[1])
    with pytest.raises(ck.CorruptCheckpointError, match=r"dp ranks \[1\] are missing"):
        ck.load_zero3(tmp_path, opt, params, HP)
    os.unlink(files[2])
    with pytest.raises(ck.CorruptCheckpointError, match="partition_count is 3 but 1 dp rank files"):
        ck.load_zero3(tmp_path, opt, params, HP)
    with open(files[0], "r+b") as f:  # truncate the remaining file
        f.truncate(100)
    with pytest.raises(ck.CorruptCheckpointError, match="cannot be read safely"):
        ck.load_zero3(tmp_path, opt, params, HP)


# ------------------------------------------------------ files written by DeepSpeed
@pytest.fixture
def deepspeed_classes():
    """DeepSpeed's loss scaler and ZeroStageEnum: the real ones when installed, else look-alikes in sys.modules."""
    if HAS_DEEPSPEED:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum

        yield DynamicLossScaler(init_scale=4096.0, scale_window=1000, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=False), ZeroStageEnum.weights
        return
    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler",
             "deepspeed.runtime.zero", "deepspeed.runtime.zero.config"]
    modules = {n: types.ModuleType(n) for n in names}

    class DynamicLossScaler:  # the attributes DeepSpeed's constructor sets
        def __init__(self):
            self.cur_scale, self.cur_iter, self.last_overflow_iter, self.scale_factor = 4096.0, 0, -1, 2.0
            self.scale_window, self.min_scale, self.delayed_shift, self.cur_hysteresis = 1000, 1, 2, 2
            self.consecutive_hysteresis, self.raise_error_at_min_scale, self.dynamic = False, True, True
            self.dtype = torch.half

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        weights = 3

    DynamicLossScaler.__module__ = "deepspeed.runtime.fp16.loss_scaler"
    ZeroStageEnum.__module__ = "deepspeed.runtime.zero.config"
    DynamicLossScaler.__qualname__, ZeroStageEnum.__qualname__ = "DynamicLossScaler", "ZeroStageEnum"
    modules["deepspeed.runtime.fp16.loss_scaler"].DynamicLossScaler = DynamicLossScaler
    modules["deepspeed.runtime.zero.config"].ZeroStageEnum = ZeroStageEnum
    sys.modules.update(modules)
    try:
        yield DynamicLossScaler(), ZeroStageEnum.weights
    finally:
        for n in names:
            sys.modules.pop(n, None)


def test_reads_files_holding_deepspeed_objects_without_running_them(tmp_path, deepspeed_classes):
    scaler, stage = deepspeed_classes
    opt = sofx.adamw()
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    files = ck.save_zero3(tmp_path, opt, params, state, HP, deepspeed_objects=False)
    top = torch.load(files[0], weights_only=True)
    top["optimizer_state_dict"]["loss_scaler"] = scaler  # what DeepSpeed's engine writes there
    top["optimizer_state_dict"]["zero_stage"] = stage
    torch.save(top, files[0])
    p2, s2, _ = ck.load_zero3(tmp_path, opt, params, HP)
    assert _bits_equal((p2, s2), (params, state))
    from sofx.checkpoint.zero3 import _plain, _torch_load

    z = _torch_load(files[0])["optimizer_state_dict"]
    assert _plain(z["zero_stage"]) == 3 and _plain(z["loss_scaler"])["cur_scale"] == 4096.0
    ds_rule, ds_state = ck.load_zero3_loss_scaler(tmp_path)  # the object DeepSpeed's engine writes, as sofx's
    assert ds_state == (4096.0, 0, -1, scaler.delayed_shift) and ds_rule.scale_window == scaler.scale_window
    # sofx's own export with DeepSpeed's objects (what DeepSpeed's engine needs) reads back the same way
    if HAS_DEEPSPEED:
        rule = sofx.loss_scale.deepspeed_scaler(init_scale=256.0)
        files = ck.save_zero3(tmp_path / "ds", opt, params, state, HP, deepspeed_objects=True,
                              loss_scaler=(rule, rule.init()._replace(cur_iter=7)))
        z = _torch_load(files[0])["optimizer_state_dict"]
        read = _plain(z["loss_scaler"])
        assert read["class"] == "DynamicLossScaler" and read["cur_scale"] == 256.0 and read["cur_iter"] == 7
        assert read["dtype"] == torch.half
        assert _bits_equal(ck.load_zero3(tmp_path / "ds", opt, params, HP)[:2], (params, state))


@pytest.mark.parametrize("deepspeed_objects", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed is not installed"))])
def test_the_loss_scaler_saved_is_the_one_loaded_and_goes_on_alike(tmp_path, deepspeed_objects):
    """load_zero3_loss_scaler gives back save_zero3's (rule, state): the same state, and a rule whose updates
    from it are the saved rule's, over random overflows (hysteresis, growth windows, the minimum)."""
    import random

    opt = sofx.adamw()
    params = _params(torch.float32)
    for consecutive in (False, True):
        rule = sofx.loss_scale.deepspeed_scaler(init_scale=2.0 ** 10, scale_window=3, hysteresis=3, min_scale=4.0,
                                               consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
        ours = rule.init()
        for overflow in (True, True, False, False, True, False):
            ours = rule.update(ours, overflow)
        ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, deepspeed_objects=deepspeed_objects,
                      loss_scaler=(rule, ours))
        got_rule, got = ck.load_zero3_loss_scaler(tmp_path)
        assert got == ours and type(got) is sofx.loss_scale.DynamicLossScaleState
        assert got_rule == sofx.loss_scale.deepspeed_scaler(
            init_scale=ours.scale, scale_window=3, hysteresis=3, min_scale=4.0, consecutive_hysteresis=consecutive,
            raise_error_at_min_scale=False)
        pick = random.Random(int(consecutive))
        for _ in range(60):
            overflow = pick.random() < 0.4
            ours, got = rule.update(ours, overflow), got_rule.update(got, overflow)
            assert got == ours
        assert ck.load_zero3_loss_scaler(tmp_path, growth_rule="legacy")[0].growth_rule == "legacy"
    static = sofx.loss_scale.static_scale(8.0)
    ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, deepspeed_objects=deepspeed_objects,
                  loss_scaler=(static, static.init()))
    assert ck.load_zero3_loss_scaler(tmp_path) == (static, sofx.loss_scale.StaticScaleState(8.0))
    ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, deepspeed_objects=deepspeed_objects)
    assert ck.load_zero3_loss_scaler(tmp_path) == (sofx.loss_scale.static_scale(), (1.0,))  # bf16/fp32 training


def _files_with_loss_scaler(directory, attrs):
    """A ZeRO-3 checkpoint in ``directory`` whose files hold the loss-scaler attributes ``attrs`` as they are (as
    another writer could store them: save_zero3 refuses a scaler no DeepSpeed run holds); its files."""
    opt = sofx.adamw()
    params = _params(torch.float32)
    files = ck.save_zero3(directory, opt, params, opt.init(params), HP, deepspeed_objects=False)
    for path in files:
        top = torch.load(path, weights_only=True)
        top["optimizer_state_dict"]["loss_scaler"] = attrs
        torch.save(top, path)
    return files


def _refused_by_save_zero3(directory, loss_scaler, match):
    """save_zero3 refuses ``loss_scaler`` (a CheckpointError matching ``match``) before it writes anything."""
    opt = sofx.adamw()
    params = _params(torch.float32)
    with pytest.raises(ck.CheckpointError, match=match):
        ck.save_zero3(directory, opt, params, opt.init(params), HP, deepspeed_objects=False, loss_scaler=loss_scaler)
    assert not os.path.exists(directory)


def test_a_loss_scaler_no_deepspeed_run_holds_is_refused(tmp_path):
    """... by load_zero3_loss_scaler as corrupt, and by save_zero3 before any file is written: as a (rule, state)
    pair was, and as DeepSpeed's attributes too (they were written as given). A number that is an int beyond the
    float range raised Python's bare OverflowError from both."""
    rule = sofx.loss_scale.deepspeed_scaler(init_scale=256.0, min_scale=2.0)
    good = ck.deepspeed_loss_scaler(rule, rule.init()._replace(cur_iter=9, last_overflow_iter=4, cur_hysteresis=1))
    for bad, match in (({"cur_scale": math.inf}, "cur_scale = inf"),
                       ({"cur_scale": 1.0}, r"\['cur_scale'\] = 1.0 is below min_scale = 2.0"),
                       ({"last_overflow_iter": 9},
                        r"loss_scaler\['last_overflow_iter'\] = 9 is invalid with cur_iter = 9"),
                       ({"cur_hysteresis": 3}, r"\['cur_hysteresis'\] = 3 is invalid"),
                       ({"cur_iter": -1}, "cur_iter"), ({"scale_window": 2.5}, "no valid 'scale_window'"),
                       ({"consecutive_hysteresis": 1}, "no valid 'consecutive_hysteresis'"),
                       ({"dynamic": False, "cur_scale": -2.0}, "cur_scale = -2.0"),
                       # (an int beyond the float range: Python's bare OverflowError from float())
                       ({"cur_scale": 10 ** 400}, r"\['cur_scale'\] is an int beyond the float range \(1329 bits\)"),
                       ({"min_scale": -10 ** 400}, r"\['min_scale'\] is an int beyond the float range"),
                       ({"scale_factor": 10 ** 400}, r"\['scale_factor'\] is an int beyond the float range")):
        _refused_by_save_zero3(tmp_path / "refused", {**good, **bad}, match)
        files = _files_with_loss_scaler(tmp_path, {**good, **bad})
        with pytest.raises(ck.CorruptCheckpointError, match=match):
            ck.load_zero3_loss_scaler(tmp_path)
    top = torch.load(files[0], weights_only=True)
    del top["optimizer_state_dict"]["loss_scaler"]
    torch.save(top, files[0])
    with pytest.raises(ck.CorruptCheckpointError, match="missing or bad 'loss_scaler'"):
        ck.load_zero3_loss_scaler(tmp_path)
    with pytest.raises(sofx.errors.HParamError, match="growth_rule"):
        ck.load_zero3_loss_scaler(tmp_path, growth_rule="stable")
    with pytest.raises(ck.CheckpointNotFoundError):
        ck.load_zero3_loss_scaler(tmp_path / "nothing here")


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeeds_own_scaler_resumes_from_the_export_as_sofxs_would_go_on(tmp_path, monkeypatch):
    """The DynamicLossScaler in the files is the one DeepSpeed's engine puts in place on resume: its
    update_scale runs (a partial attribute dict failed with an AttributeError at the first step) and follows
    sofx's rule from the saved state, overflows and clean steps alike."""
    import random

    from deepspeed.runtime.fp16 import loss_scaler

    from sofx.checkpoint.zero3 import _plain, _torch_load

    # update_scale logs on rank 0; outside torch.distributed this process is rank 0
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)
    opt = sofx.adamw()
    params = _params(torch.float32)
    state = opt.init(params)
    rule = sofx.loss_scale.deepspeed_scaler(init_scale=2.0 ** 10, scale_window=3, hysteresis=2, min_scale=4.0,
                                           raise_error_at_min_scale=False)
    ours = rule.init()
    for overflow in (True, False, False, False, True):
        ours = rule.update(ours, overflow)
    files = ck.save_zero3(tmp_path, opt, params, state, HP, deepspeed_objects=True, loss_scaler=(rule, ours))
    with open(files[0], "rb") as f:
        theirs = torch.load(f, weights_only=False)["optimizer_state_dict"]["loss_scaler"]
    assert type(theirs).__name__ == "DynamicLossScaler"
    pick = random.Random(0)
    for _ in range(40):
        overflow = pick.random() < 0.3
        theirs.update_scale(overflow)
        ours = rule.update(ours, overflow)
        assert (theirs.cur_scale, theirs.cur_iter, theirs.last_overflow_iter, theirs.cur_hysteresis) == tuple(ours)
    assert _plain(_torch_load(files[0])["optimizer_state_dict"]["loss_scaler"])["scale_window"] == 3


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_sofx_goes_on_from_deepspeeds_own_scaler_as_deepspeed_does(tmp_path, monkeypatch):
    """The other way round: a DynamicLossScaler that DeepSpeed's update_scale moved, in a file as DeepSpeed's
    engine saves it, read by load_zero3_loss_scaler; sofx's rule from there follows DeepSpeed's."""
    import random

    from deepspeed.runtime.fp16 import loss_scaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)
    opt = sofx.adamw()
    params = _params(torch.float32)
    files = ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, deepspeed_objects=False)
    top = torch.load(files[0], weights_only=True)
    pick = random.Random(3)
    for consecutive in (False, True):
        theirs = loss_scaler.DynamicLossScaler(init_scale=2.0 ** 12, scale_window=4, min_scale=8.0, delayed_shift=2,
                                               consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
        for _ in range(25):
            theirs.update_scale(pick.random() < 0.4)
        top["optimizer_state_dict"]["loss_scaler"] = theirs
        torch.save(top, files[0])
        rule, ours = ck.load_zero3_loss_scaler(tmp_path)
        for _ in range(60):
            assert (theirs.cur_scale, theirs.cur_iter, theirs.last_overflow_iter, theirs.cur_hysteresis) == tuple(ours)
            overflow = pick.random() < 0.4
            theirs.update_scale(overflow)
            ours = rule.update(ours, overflow)


@pytest.mark.parametrize("loss_scaler", [5, 1.5, "dynamic", [1], (1, 2, 3), sofx.loss_scale.grad_scaler().init()],
                         ids=["int", "float", "str", "list", "triple", "a state alone"])
def test_a_loss_scaler_that_is_no_pair_nor_attributes_is_refused_naming_it(tmp_path, loss_scaler):
    """loss_scaler=5 (or a list, a str) raised Python's bare TypeError ("'int' object is not a mapping") from the
    attributes' merge, a tuple of three one from deepspeed_loss_scaler's call; refused before any file is written,
    naming what it takes. A rule's state alone, a NamedTuple of two fields, was taken as a (rule, state) pair of its
    fields: 'a float with a int has no DeepSpeed counterpart'."""
    _refused_by_save_zero3(tmp_path / "refused", loss_scaler,
                           r"^save_zero3: loss_scaler must be None, a \(rule, state\) pair or a dict of DeepSpeed's "
                           r"loss-scaler attributes, got ")


def test_a_dynamic_scaler_dict_deepspeed_could_not_run_is_refused(tmp_path):
    opt = sofx.adamw()
    params = _params(torch.float32)
    for deepspeed_objects in (True, False):  # (without DeepSpeed's objects load_zero3_loss_scaler reads them all)
        with pytest.raises(ck.CheckpointError, match=r"needs \['last_overflow_iter', 'scale_factor'"):
            ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, deepspeed_objects=deepspeed_objects,
                          loss_scaler={"cur_scale": 256.0, "dynamic": True, "cur_iter": 7, "scale_window": 10})
    with pytest.raises(ck.CheckpointError, match=r"GradScalerRule with a GradScalerState has no DeepSpeed"):
        rule = sofx.loss_scale.grad_scaler()
        ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, loss_scaler=(rule, rule.init()))
    assert not os.path.exists(tmp_path / ck.zero3_file_name(0))


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_zero_to_fp32_reads_the_export(tmp_path, world):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    opt = sofx.adamw(state_dtype=torch.float32)
    params, state = _train(opt, _params(torch.bfloat16), opt.init(_params(torch.bfloat16)), 0, 2)
    ck.save_zero3(tmp_path / "global_step2", opt, params, state, HP, dp_world_size=world, model_states=True)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="global_step2")
    assert sorted(consolidated) == ["dec.0", "enc.b", "enc.w"]
    for name, p in (("dec.0", params["dec"][0]), ("enc.b", params["enc"]["b"]), ("enc.w", params["enc"]["w"])):
        assert consolidated[name].dtype == torch.float32 and torch.equal(consolidated[name], p.float())
    assert math.prod(consolidated["enc.w"].shape) == 15


DS_CHILD = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
import deepspeed
import deepspeed.ops
# DeepSpeed JIT-compiles a shared-memory all-reduce kernel for CPU collectives (minutes; unused with one rank)
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
sys.path.insert(0, sys.argv[3])
from ds_common import N, M, batch, model_


def engine_():
    model = model_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
           "zero_force_ds_cpu_optimizer": False, "gradient_clipping": 0.0}
    return deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]


def train(engine, start, stop):
    for step in range(start, stop):
        x, y = batch(step)
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()


root = sys.argv[1]
engine = engine_()                   # DeepSpeed: N steps, checkpoint "n", M more steps, checkpoint "nm"
train(engine, 0, N)
engine.save_checkpoint(root, tag="n")
train(engine, N, N + M)
engine.save_checkpoint(root, tag="nm")
engine = engine_()                   # DeepSpeed resumes sofx's export "sofx" for M steps: "sofx_nm"
engine.load_checkpoint(root, tag="sofx", load_optimizer_states=True, load_lr_scheduler_states=False)
train(engine, N, N + M)
engine.save_checkpoint(root, tag="sofx_nm")
print("deepspeed ok")
"""

DS_COMMON = """
import torch
N, M = 3, 3


def model_():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def batch(step):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
"""


def _deepspeed_scripts(tmp_path: Path, child: str) -> types.ModuleType:
    """Write ``DS_COMMON`` and the DeepSpeed child script ``child`` into ``tmp_path``; returns ``ds_common``
    imported from there (the model and batches both sides train)."""
    (tmp_path / "ds_common.py").write_text(DS_COMMON)
    (tmp_path / "ds_child.py").write_text(child)
    sys.path.insert(0, str(tmp_path))
    try:
        sys.modules.pop("ds_common", None)
        import ds_common
    finally:
        sys.path.remove(str(tmp_path))
    return ds_common


def _run_deepspeed_child(tmp_path: Path) -> None:
    """Run the child script a real DeepSpeed engine trains in (one rank on a free local port, one thread), over
    the checkpoints under ``tmp_path / "ckpt"``; it prints ``deepspeed ok`` when done."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(tmp_path / "ds_child.py"), str(tmp_path / "ckpt"), str(port),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "deepspeed ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_engine_and_sofx_continue_each_others_zero3_checkpoints(tmp_path):
    """A real DeepSpeed ZeRO-3 engine (CPU, one rank, torch AdamW): its checkpoint imported into sofx and
    continued equals DeepSpeed's own continuation, and DeepSpeed continuing sofx's export equals sofx's
    uninterrupted run -- bitwise."""
    ds_common = _deepspeed_scripts(tmp_path, DS_CHILD)
    model = ds_common.model_()
    opt = sofx.adamw(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    names = [name for name, _ in model.named_parameters()]

    def grads(params, step):
        x, y = ds_common.batch(step)
        ps = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = ((torch.func.functional_call(model, ps, (x,)) - y) ** 2).mean()
        return dict(zip(ps, torch.autograd.grad(loss, list(ps.values()))))

    def train(params, state, start, stop):
        for step in range(start, stop):
            params, state, _ = opt.update(params, grads(params, step), state)
        return params, state

    n, m = ds_common.N, ds_common.M
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    ref_p, ref_s = train(init, opt.init(init), 0, n + m)
    p, s = train(init, opt.init(init), 0, n)
    ck.save_zero3(tmp_path / "ckpt" / "sofx", opt, p, s, groups=[names], model_states=True)  # model order
    _run_deepspeed_child(tmp_path)
    template = {k: torch.zeros_like(v) for k, v in init.items()}  # sorted keys: mapped by name from param_shapes
    ds_n = ck.load_zero3(tmp_path / "ckpt" / "n", opt, template)
    ds_nm = ck.load_zero3(tmp_path / "ckpt" / "nm", opt, template)
    assert ds_n[2] == sofx.AdamHParams(1e-2, 0.9, 0.99, 1e-8, 0.1)  # one param group: one AdamHParams
    # fp32 training: DeepSpeed's engine saved a static LossScaler of 1
    assert ck.load_zero3_loss_scaler(tmp_path / "ckpt" / "n") == (sofx.loss_scale.static_scale(), (1.0,))
    assert all(c.item() == n for c in ds_n[1].count.values())
    # DeepSpeed's trajectory is sofx's, and continuing DeepSpeed's checkpoint in sofx stays on it
    assert _bits_equal(ds_nm[:2], (ref_p, ref_s))
    assert _bits_equal(train(ds_n[0], ds_n[1], n, n + m), (ref_p, ref_s))
    # DeepSpeed continuing sofx's export stays on it too
    assert _bits_equal(ck.load_zero3(tmp_path / "ckpt" / "sofx_nm", opt, template)[:2], (ref_p, ref_s))


def test_leaves_deepspeed_would_name_alike_are_refused_before_any_file(tmp_path):
    """DeepSpeed names a parameter by its tree path joined by dots: {"a": {"b": x}, "a.b": y} gave two "a.b"
    in the model states file, which neither load_zero3 nor zero_to_fp32 could read back. Refused first."""
    opt = sofx.adamw(lr=1e-2)
    params = {"a": {"b": torch.randn(3)}, "a.b": torch.randn(4)}
    state = opt.init(params)
    with pytest.raises(ck.CheckpointError, match=r"leaves 0 and 1 are both named 'a.b'"):
        ck.save_zero3(tmp_path / "ck", opt, params, state, model_states=True, deepspeed_objects=False)
    assert not (tmp_path / "ck").exists()
    ck.save_zero3(tmp_path / "ok", opt, params, state, deepspeed_objects=False)  # no names written: fine


def test_an_int_key_too_long_for_decimal_text_is_named_in_hex_and_round_trips(tmp_path):
    """DeepSpeed names a parameter by its tree path joined by dots; an int dict key of more digits than Python
    writes in decimal (4300 by default) raised Python's raw ValueError. It is named in hex (as the tree's leaf
    paths write it), and the model states file loads back by those names."""
    huge = 10 ** 5000
    opt = sofx.adamw(lr=1e-2)
    params = {"enc": {huge: torch.randn(3), 7: torch.randn(2)}}
    params, state = _train(opt, params, opt.init(params), 0, 2, hp=sofx.AdamHParams(lr=1e-2))
    assert zero3.param_names(params) == ["enc.7", f"enc.{hex(huge)}"]
    ck.save_zero3(tmp_path, opt, params, state, model_states=True, deepspeed_objects=False)
    template = tree.tree_map(torch.zeros_like, params)
    p2, s2, _ = ck.load_zero3(tmp_path, opt, template)
    assert _bits_equal((p2, s2), (params, state))


@pytest.mark.parametrize("shape", [5, None, "3", [2.5], [True], [-1]])
def test_a_model_states_shape_that_is_no_shape_is_a_corrupt_file_naming_it(tmp_path, shape):
    """A param_shapes entry of the model states file whose shape is no sequence of sizes (a damaged file): an int
    or None raised Python's bare TypeError from tuple(shape), a str was compared as its characters ('has shape
    ('3',) in the checkpoint': a mismatch, not damage). A CorruptCheckpointError names the file, the entry, the
    parameter and the value; a list of ints (not a torch.Size) is read as before."""
    opt = sofx.adamw()
    params = _params()
    ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, model_states=True, deepspeed_objects=False)
    path = tmp_path / zero3.model_states_file_name(0)
    good = torch.load(path, weights_only=True)
    name = next(iter(good["param_shapes"][1]))
    top = torch.load(path, weights_only=True)
    top["param_shapes"][1][name] = shape
    torch.save(top, path)
    entry, got = rf"param_shapes\[1\]\[{re.escape(repr(name))}\]", re.escape(repr(shape))
    with pytest.raises(ck.CorruptCheckpointError, match=rf"_model_states\.pt: {entry}: expected a shape \(a "
                                                        rf"sequence of sizes, ints >= 0\), got {got}"):
        ck.load_zero3(tmp_path, opt, params, HP)
    good["param_shapes"][1][name] = list(good["param_shapes"][1][name])
    torch.save(good, path)
    ck.load_zero3(tmp_path, opt, params, HP)


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


def test_a_zero3_file_the_system_does_not_let_us_read_is_an_io_error_and_a_model_file_is_named_so(tmp_path,
                                                                                                  monkeypatch):
    """A rank file torch.load could not open (no read permission: PermissionError) was a CorruptCheckpointError
    ('cannot be read safely'), where sofx.checkpoint.load raises a CheckpointIOError with the system's number; and
    a damaged model states file was called 'a ZeRO-3 optimizer file'."""
    import errno

    opt = sofx.adamw()
    params = _params()
    ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, model_states=True, deepspeed_objects=False)
    real_load = torch.load

    def denied(path, *args, **kwargs):
        if str(path).endswith("_optim_states.pt"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", denied)
    for call in (lambda: ck.load_zero3(tmp_path, opt, params, HP), lambda: ck.load_zero3_loss_scaler(tmp_path)):
        with pytest.raises(ck.CheckpointIOError, match=r"cannot read the ZeRO-3 optimizer file .*Permission denied") \
                as caught:
            call()
        assert caught.value.errno == errno.EACCES
    monkeypatch.setattr(torch, "load", real_load)
    model_file = tmp_path / zero3.model_states_file_name(0)
    model_file.write_bytes(model_file.read_bytes()[:100])
    with pytest.raises(ck.CorruptCheckpointError, match=r"_model_states\.pt cannot be read safely as a ZeRO-3 model "
                                                        r"states file"):
        ck.load_zero3(tmp_path, opt, params, HP)


def test_a_zero3_directory_the_system_does_not_let_us_list_is_an_io_error(tmp_path, monkeypatch):
    """A checkpoint directory this process may not list (no read permission) raised os.listdir's bare
    PermissionError from load_zero3 and load_zero3_loss_scaler: a CheckpointIOError naming it, with its errno."""
    opt = sofx.adamw()
    params = _params()
    ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, deepspeed_objects=False)
    _refuse_listing(monkeypatch, tmp_path)
    for call in (lambda: ck.load_zero3(tmp_path, opt, params, HP), lambda: ck.load_zero3_loss_scaler(tmp_path)):
        with pytest.raises(ck.CheckpointIOError, match=r"cannot list the ZeRO-3 checkpoint directory .*Permission "
                                                       r"denied") as caught:
            call()
        assert caught.value.errno == errno.EACCES


def test_a_file_of_the_right_pickle_but_wrong_types_is_a_checkpoint_error(tmp_path):
    """Fields of the wrong type in a file that unpickles (a param group's id a list, partition counts that are
    not ints, an integer master or moment) raised a raw TypeError or were cast in silently."""
    import copy

    opt = sofx.adamw()
    params = _params()
    files = ck.save_zero3(tmp_path, opt, params, _train(opt, params, opt.init(params), 0, 2)[1], HP,
                          deepspeed_objects=False)
    good = torch.load(files[0], weights_only=True)

    def inner(top):
        return top["optimizer_state_dict"]["optimizer_state_dict"]

    edits = [
        (lambda top: inner(top)["param_groups"][0].__setitem__("params", [[0]]),
         r"param_groups\[0\] must be a dict whose 'params' lists flat block ids \(ints\), got \[\[0\]\]"),
        (lambda top: inner(top)["param_groups"][0].__setitem__("params", [1]),
         r"list the flat blocks \[1, 1\]; expected each of the 2 flat blocks once, in order \(0 to 1\)"),
        (lambda top: top["optimizer_state_dict"].__setitem__("partition_count", ["a", 1]), "partition_count"),
        (lambda top: top["optimizer_state_dict"]["fp32_flat_groups"].__setitem__(
            0, top["optimizer_state_dict"]["fp32_flat_groups"][0].long()), "not a floating-point tensor"),
        (lambda top: inner(top)["state"][0].__setitem__("exp_avg", inner(top)["state"][0]["exp_avg"].long()),
         "exp_avg must be a flat floating-point tensor"),
    ]
    for edit, match in edits:
        top = copy.deepcopy(good)
        edit(top)
        torch.save(top, files[0])
        with pytest.raises(ck.CheckpointError, match=match):
            ck.load_zero3(tmp_path, opt, params, HP)


@pytest.mark.parametrize("key, value", [("bias_correction", "True"), ("bias_correction", torch.tensor([True, True])),
                                        ("bias_correction", None), ("adam_w_mode", "False"),
                                        ("decoupled_weight_decay", torch.tensor([1, 1])),
                                        ("amsgrad", torch.tensor([0, 0])), ("maximize", 0.5)])
def test_a_file_option_that_is_no_flag_is_a_corrupt_file_naming_it(tmp_path, key, value):
    """A param group's bias_correction, amsgrad, maximize, decoupled_weight_decay or adam_w_mode that is no True or
    False (a damaged file): a str was read by bool() ("False" as true: taken as decoupled; bias_correction "True"
    refused as 'bias_correction=True, the optimizer has True') and a tensor of two elements raised torch's bare
    RuntimeError; a bias_correction of None was refused as 'bias_correction=None, the optimizer has True' (an
    UnsupportedError: the optimizer's, not the file's). Each is a CorruptCheckpointError naming the block, the key
    and the value, as from_torch_optim refuses them (None says nothing of the other options, as there; a group
    without bias_correction is bias-corrected)."""
    opt, params = _saved_with_group_entry(tmp_path, key, value)
    want = "True or False" if key == "bias_correction" else "True, False or None"  # (None: not said)
    with pytest.raises(ck.CorruptCheckpointError, match=rf"block 1 .*param_groups\[1\]\['{key}'\]: expected "
                                                        rf"{want}, got {re.escape(repr(value)[:20])}"):
        ck.load_zero3(tmp_path, opt, params, HP)


def test_an_adam_w_mode_behind_a_decoupled_weight_decay_of_none_is_read(tmp_path):
    """A group holding decoupled_weight_decay=None (not said) and adam_w_mode=True (DeepSpeed's word for AdamW) was
    read as saying nothing: the entry of None hid adam_w_mode, and the decoupled file loaded into sofx.adam (L2
    weight decay) without a word. None says nothing, so adam_w_mode is read: refused as a file of another decay
    mode; a group whose adam_w_mode agrees loads."""
    opt, params = _saved_with_group_entry(tmp_path, "decoupled_weight_decay", None)
    path = os.path.join(tmp_path, zero3.zero3_file_name(0, 0))
    top = torch.load(path, weights_only=True)
    top["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][1]["adam_w_mode"] = True
    del top["sofx"]  # (DeepSpeed's file: no sofx notes saying the mode)
    torch.save(top, path)
    with pytest.raises(UnsupportedError, match=r"block 1 .*the file's optimizer has decoupled weight decay=True, "
                                               r"this one False"):
        ck.load_zero3(tmp_path, sofx.adam(), params, HP)
    ck.load_zero3(tmp_path, opt, params, HP)


def test_a_step_kept_in_the_param_group_as_deepspeeds_fused_adam_keeps_it_is_read(tmp_path):
    """DeepSpeed's FusedAdam (ZeRO-3 without CPU offload) kept the step count in its param group
    (``group['step']``), not in each flat block's state entry, and initializes an entry's step from it: a file
    whose entries have no ``step`` was refused as corrupt; the group's step is read for its blocks (and a file
    with neither is still refused)."""
    opt = sofx.adamw()
    params = _params()
    trained, state = _train(opt, params, opt.init(params), 0, 3)
    files = ck.save_zero3(tmp_path, opt, trained, state, HP, deepspeed_objects=False)
    for f in files:
        top = torch.load(f, weights_only=True)
        inner = top["optimizer_state_dict"]["optimizer_state_dict"]
        for entry in inner["state"].values():
            del entry["step"]
        for group in inner["param_groups"]:
            group["step"] = 3
        torch.save(top, f)
    p2, s2, _ = ck.load_zero3(tmp_path, opt, params, HP)
    assert _bits_equal((p2, s2), (trained, state))
    for f in files:
        top = torch.load(f, weights_only=True)
        for group in top["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]:
            del group["step"]
        torch.save(top, f)
    with pytest.raises(ck.CorruptCheckpointError, match="step must be a non-negative integer"):
        ck.load_zero3(tmp_path, opt, params, HP)


def _saved_with_group_entry(tmp_path, key, value):
    """``(opt, params)`` of a ZeRO-3 checkpoint saved into ``tmp_path`` after two steps, whose rank-0 file's second
    param group has ``key`` set to ``value`` (a damaged or foreign file)."""
    opt = sofx.adamw()
    params = _params()
    files = ck.save_zero3(tmp_path, opt, params, _train(opt, params, opt.init(params), 0, 2)[1], HP,
                          deepspeed_objects=False)
    top = torch.load(files[0], weights_only=True)
    top["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][1][key] = value
    torch.save(top, files[0])
    return opt, params


@pytest.mark.parametrize("key, value, where", [
    ("lr", "0.01", r"\['lr'\]"), ("eps", None, r"\['eps'\]"), ("lr", torch.tensor([1e-2, 1e-3]), r"\['lr'\]"),
    ("betas", (0.9, "0.99"), r"\['betas'\]\[1\]")])
def test_a_saved_hparam_that_is_not_a_number_is_a_corrupt_file_naming_it(tmp_path, key, value, where):
    """A file's lr, beta, eps or weight_decay that is not a number: a string was parsed by float() and loaded, and
    None or a tensor of two elements was said to be missing ("the param group lacks lr, betas, eps or
    weight_decay"): each is a CorruptCheckpointError naming the entry and its value."""
    opt, params = _saved_with_group_entry(tmp_path, key, value)
    with pytest.raises(ck.CorruptCheckpointError, match=rf"block 1 .*param_groups\[1\]{where}: expected a number, "
                                                        r"got "):
        ck.load_zero3(tmp_path, opt, params, HP)


@pytest.mark.parametrize("hp, where", [
    (sofx.AdamHParams(lr=-0.1), r"lr = -0\.1 is invalid; expected lr >= 0"),
    (sofx.AdamHParams(beta2=1.0), r"beta2 = 1\.0 is invalid; expected 0 <= beta2 < 1"),
    (sofx.AdamHParams(eps=1e-50), r"eps = 1e-50 is beyond float32's range")])
def test_hparams_no_step_can_take_are_refused_before_any_file_is_written(tmp_path, hp, where):
    """save_zero3 wrote an lr of -0.1, a beta2 of 1 or an eps float32 cannot hold (its flat groups are float32) into
    every rank's file, which load_zero3 then refused to read back; refused before any file is written, naming the
    leaf."""
    opt = sofx.adamw()
    params = _params()
    state = _train(opt, params, opt.init(params), 0, 1, hp=None)[1]
    with pytest.raises(ck.CheckpointError, match=rf"^hparams for params\['dec'\]\[0\]: {where}"):
        ck.save_zero3(tmp_path / "out", opt, params, state, {"enc": sofx.AdamHParams(), "dec": hp},
                      deepspeed_objects=False)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("key, value, where", [
    ("eps", 0.0, r"\['eps'\]: eps = 0\.0 is invalid; expected eps > 0"),
    ("lr", -0.1, r"\['lr'\]: lr = -0\.1 is invalid; expected lr >= 0"),
    ("betas", (0.9, 1.0), r"\['betas'\]\[1\]: beta2 = 1\.0 is invalid; expected 0 <= beta2 < 1"),
    ("eps", 1e-50, r": eps = 1e-50 is beyond float32's range"),
    ("lr", 1e39, r": lr = 1e\+39 is beyond float32's range")])
def test_a_saved_hparam_no_step_can_take_is_refused_at_load_naming_its_group(tmp_path, key, value, where):
    """A file's eps or lr that float32, in which a float32 leaf load_zero3 loads is stepped (a block of float64
    leaves: the next test), cannot hold was loaded without a word and refused only at the first update, naming a
    params leaf (the range check at import covered from_torch_optim's float32 leaves only): it is refused at load
    naming the group. A value out of the range a step takes (an eps of 0, which DeepSpeed's and torch's Adam step)
    is no damage to the file: a CheckpointError as from_torch_optim raises, not a CorruptCheckpointError (it was
    one)."""
    opt, params = _saved_with_group_entry(tmp_path, key, value)
    with pytest.raises(ck.CheckpointError, match=rf"block 1 .*param_groups\[1\]{where}") as info:
        ck.load_zero3(tmp_path, opt, params, HP)
    assert not isinstance(info.value, ck.CorruptCheckpointError)


@pytest.mark.parametrize("key, value, where", [
    ("lr", torch.tensor(1e-3, dtype=torch.float16), r"\['lr'\] = tensor\(0\.0010, dtype=torch\.float16\) is a "
                                                    r"float16 number"),
    ("betas", (0.9, torch.tensor([0.999], dtype=torch.bfloat16)), r"\['betas'\]\[1\] = tensor\(\[1\.\], "
                                                                  r"dtype=torch\.bfloat16\) is a bfloat16 number"),
    ("weight_decay", torch.tensor(0.1, dtype=torch.bfloat16), r"\['weight_decay'\] = tensor\(0\.1001, "
                                                              r"dtype=torch\.bfloat16\) is a bfloat16 number")])
def test_a_saved_half_precision_hparam_is_refused_at_load_as_from_torch_optim_refuses_it(tmp_path, key, value,
                                                                                         where):
    """A file's float16 or bfloat16 lr, beta or weight_decay (a user's scheduler wrote one: DeepSpeed's own write
    Python floats, and the weights-only load refuses numpy scalars) was loaded as the float it holds, where
    from_torch_optim and update refuse it (a torch optimizer's step computes with it in that precision). Refused at
    load naming the block, the group and the key, as a range refusal (no damage to the file); a float16 eps
    loads, as update takes it."""
    opt, params = _saved_with_group_entry(tmp_path, key, value)
    with pytest.raises(ck.CheckpointError, match=rf"block 1 .*param_groups\[1\]{where}") as info:
        ck.load_zero3(tmp_path, opt, params, HP)
    assert not isinstance(info.value, ck.CorruptCheckpointError)
    opt, params = _saved_with_group_entry(tmp_path, "eps", torch.tensor(1e-3, dtype=torch.float16))
    assert ck.load_zero3(tmp_path, opt, params, HP)[2]["enc"].eps == float(torch.tensor(1e-3, dtype=torch.float16))


def test_a_saved_eps_float32_cannot_hold_loads_into_float64_leaves_that_can_step_with_it(tmp_path):
    """load_zero3 loads into a float64 template (the masters cast to float64, stepped in float64), where
    ``update`` takes an eps of 1e-50. The float32 check at load refused such a file ("a ZeRO-3 checkpoint holds no
    float64 leaf"), for a block whose leaves are all float64; it applies where a leaf of the block is not."""
    opt = sofx.adamw()
    params = _params()
    files = ck.save_zero3(tmp_path, opt, params, _train(opt, params, opt.init(params), 0, 2)[1], HP,
                          deepspeed_objects=False)
    top = torch.load(files[0], weights_only=True)
    top["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][1]["eps"] = 1e-50
    torch.save(top, files[0])
    wide = _params(torch.float64)
    p64, s64, hp = ck.load_zero3(tmp_path, opt, wide, HP)
    assert p64["enc"]["b"].dtype == torch.float64 and hp["enc"].eps == 1e-50
    p1, _, _ = opt.update(p64, _grads(p64, 2), s64, hp)
    assert torch.isfinite(p1["enc"]["b"]).all()
    mixed = {"enc": {**wide["enc"], "b": params["enc"]["b"]}, "dec": wide["dec"]}  # (a float32 leaf in block 1)
    with pytest.raises(ck.CheckpointError, match=r"block 1 .*param_groups\[1\]: eps = 1e-50 is beyond float32's "
                                                 r"range.*\(a leaf of the block is not float64\)"):
        ck.load_zero3(tmp_path, opt, mixed, HP)


def test_a_negative_second_moment_in_a_file_is_a_corrupt_checkpoint_error_and_a_nan_one_loads(tmp_path):
    """No run stores a negative ``exp_avg_sq``: one loaded without a word made the next step's parameters nan. It is
    a CorruptCheckpointError naming the file, the block and the element of its flat moment; a nan (a diverged
    run's state) loads."""
    opt = sofx.adamw()
    params = _params()
    files = ck.save_zero3(tmp_path, opt, params, _train(opt, params, opt.init(params), 0, 2)[1], HP, dp_world_size=2,
                          deepspeed_objects=False)
    top = torch.load(files[1], weights_only=True)
    top["optimizer_state_dict"]["optimizer_state_dict"]["state"][1]["exp_avg_sq"][2] = -0.25
    torch.save(top, files[1])
    with pytest.raises(ck.CorruptCheckpointError, match=r"rank_1_.*: block 1 .*exp_avg_sq\[2\] = -0\.25: expected a "
                                                        r"second moment >= 0"):
        ck.load_zero3(tmp_path, opt, params, HP)
    top["optimizer_state_dict"]["optimizer_state_dict"]["state"][1]["exp_avg_sq"][2] = float("nan")
    torch.save(top, files[1])
    _, state, _ = ck.load_zero3(tmp_path, opt, params, HP)
    assert torch.isnan(state.nu["enc"]["b"][6]) and int(torch.isnan(state.nu["enc"]["b"]).sum()) == 1


def test_a_file_whose_group_sets_amsgrad_or_maximize_is_refused_naming_the_saved_value(tmp_path):
    """A param group with maximize=1 was reported as maximize=True (the checkpoint had its own copy of the
    rule); it is refused by sofx.adam.refused_torch_option, in sofx.adamw's words."""
    opt = sofx.adamw()
    params = _params()
    files = ck.save_zero3(tmp_path, opt, params, _train(opt, params, opt.init(params), 0, 2)[1], HP,
                          deepspeed_objects=False)
    good = torch.load(files[0], weights_only=True)
    for key, value in (("amsgrad", True), ("maximize", 1)):
        top = {**good, "optimizer_state_dict": {**good["optimizer_state_dict"]}}
        inner = top["optimizer_state_dict"]["optimizer_state_dict"] = {
            **good["optimizer_state_dict"]["optimizer_state_dict"]}
        inner["param_groups"] = [{**inner["param_groups"][0], key: value}, *inner["param_groups"][1:]]
        torch.save(top, files[0])
        with pytest.raises(UnsupportedError, match=rf"block 0 .*: {key}={value!r} is not supported \(only "
                                                   r"torch.optim's default, False\)"):
            ck.load_zero3(tmp_path, opt, params, HP)


def test_ranks_and_world_size_given_as_numpy_are_ints_and_bools_or_floats_are_refused(tmp_path):
    """save_zero3(dp_world_size=np.int64(2)) was refused; mp_rank=True was taken (a file mp_rank_01 and a bool
    partition_count); load_zero3(mp_rank=1.5) raised a ValueError from a format. numpy or 1-element tensor ranks
    are read as ints; bools, floats and strings are refused naming the argument, before anything is written."""
    np = pytest.importorskip("numpy")
    opt = sofx.adamw(lr=1e-2)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    want = ck.save_zero3(tmp_path / "want", opt, params, state, HP, dp_world_size=2, mp_rank=1,
                         deepspeed_objects=False)
    for i, count in enumerate((np.int64, lambda x: torch.tensor([x]))):
        files = ck.save_zero3(tmp_path / str(i), opt, params, state, HP, dp_world_size=count(2), mp_rank=count(1),
                              deepspeed_objects=False)
        assert [os.path.basename(f) for f in files] == [os.path.basename(f) for f in want]
        z = torch.load(files[0], weights_only=True)["optimizer_state_dict"]
        assert type(z["partition_count"]) is int and z["partition_count"] == 2
        loaded, loaded_state = ck.load_zero3(tmp_path / str(i), opt, params, mp_rank=count(1))[:2]
        assert _bits_equal(loaded, params) and _bits_equal(loaded_state, state)
    for kwargs, pattern in (({"mp_rank": True}, r"save_zero3: mp_rank = True is invalid; expected an integer >= 0"),
                            ({"dp_world_size": 2.0}, r"save_zero3: dp_world_size = 2.0 is invalid; expected an "
                                                     r"integer >= 1 .*got float"),
                            ({"dp_world_size": np.int64(0)}, r"dp_world_size = .*0.* is invalid; .*got int64")):
        with pytest.raises(ck.CheckpointError, match=pattern):
            ck.save_zero3(tmp_path / "bad", opt, params, state, HP, deepspeed_objects=False, **kwargs)
        assert not (tmp_path / "bad").exists()
    for bad in (1.5, "1", True, -1):
        with pytest.raises(ck.CheckpointError, match=r"mp_rank = .* is invalid; expected an integer >= 0"):
            ck.load_zero3(tmp_path / "want", opt, params, mp_rank=bad)
        with pytest.raises(ck.CheckpointError, match=r"mp_rank = .* is invalid; expected an integer >= 0"):
            ck.load_zero3_loss_scaler(tmp_path / "want", mp_rank=bad)


def test_on_off_options_must_be_bools(tmp_path):
    """save_zero3(bf16="no") wrote bf16_ files (a string's truth), model_states="no" a model-states file,
    deepspeed_objects="no" DeepSpeed's objects; load_zero3(bf16="no") looked for bf16_ files; load(verify="no")
    checked CRCs where verify=0 did not. Each is refused naming the option, before any file is written or read;
    numpy bools are read as bools."""
    np = pytest.importorskip("numpy")
    opt = sofx.adamw(lr=1e-2)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 1)
    for name in ("bf16", "model_states", "deepspeed_objects"):
        for bad in ("no", 0, 1.0):
            with pytest.raises(ck.CheckpointError, match=rf"save_zero3: {name} = .* is invalid; expected a bool"):
                ck.save_zero3(tmp_path / "bad", opt, params, state, HP, **{"deepspeed_objects": False, name: bad})
            assert not (tmp_path / "bad").exists()
    files = ck.save_zero3(tmp_path / "ok", opt, params, state, HP, bf16=np.bool_(False),
                          deepspeed_objects=np.bool_(False))
    assert not os.path.basename(files[0]).startswith("bf16_")
    for load in (lambda b: ck.load_zero3(tmp_path / "ok", opt, params, bf16=b),
                 lambda b: ck.load_zero3_loss_scaler(tmp_path / "ok", bf16=b)):
        with pytest.raises(ck.CheckpointError, match=r"bf16 = 'no' is invalid; expected a bool"):
            load("no")
        load(np.bool_(False))
    path = ck.save(tmp_path / "t.ckpt", {"x": torch.ones(3)})
    with pytest.raises(ck.CheckpointError, match=r"load: verify = 'no' is invalid; expected a bool"):
        ck.load(path, verify="no")
    assert torch.equal(ck.load(path, verify=np.bool_(True))["x"], torch.ones(3))


def test_a_loss_scaler_whose_hysteresis_its_overflow_history_cannot_leave_is_refused(tmp_path):
    """DeepSpeed's hysteresis is delayed_shift until the first overflow, lower right after one (by one per overflow),
    and back at delayed_shift after a clean iteration (consecutive_hysteresis) or a scale growth (otherwise); a file
    whose cur_hysteresis its cur_iter and last_overflow_iter cannot leave loaded silently. It is refused as
    corrupt, naming the field; so is a cur_scale below min_scale (named, not as an init_scale the file lacks), and
    save_zero3 refuses to write such a (rule, state) or such attributes."""
    opt = sofx.adamw()
    params = _params(torch.float32)
    rule = sofx.loss_scale.deepspeed_scaler(init_scale=256.0, min_scale=2.0, hysteresis=3, scale_window=4)
    good = ck.deepspeed_loss_scaler(rule, rule.init()._replace(cur_iter=8, last_overflow_iter=5, cur_hysteresis=2))
    for bad, match in (
            ({"cur_iter": 9, "last_overflow_iter": -1, "cur_hysteresis": 2},
             r"loss_scaler\['cur_hysteresis'\] = 2 is invalid with cur_iter = 9, last_overflow_iter = -1: .*no "
             r"overflow yet.*expected cur_hysteresis = 3"),
            ({"cur_iter": 9, "last_overflow_iter": 8, "cur_hysteresis": 3}, r"\['cur_hysteresis'\] = 3 .*expected 1 "
                                                                             r"<= cur_hysteresis <= 2"),
            ({"cur_iter": 2, "last_overflow_iter": 0, "cur_hysteresis": 1}, r"\['cur_hysteresis'\] = 1 .*at most 1 "
                                                                             r"overflows.*expected cur_hysteresis = 2"),
            ({"cur_iter": 20, "last_overflow_iter": 5, "cur_hysteresis": 1}, r"\['cur_hysteresis'\] = 1 .*scale grew"),
            ({"cur_iter": 8, "last_overflow_iter": 5, "cur_hysteresis": 3}, r"\['cur_hysteresis'\] = 3 .*expected 1 "
                                                                             r"<= cur_hysteresis <= 2"),
            ({"consecutive_hysteresis": True}, r"\['cur_hysteresis'\] = 2 .*consecutive_hysteresis"),
            ({"cur_scale": 1.0}, r"loss_scaler\['cur_scale'\] = 1.0 is below min_scale = 2.0")):
        _refused_by_save_zero3(tmp_path / "refused", {**good, **bad}, match)
        _files_with_loss_scaler(tmp_path, {**good, **bad})
        with pytest.raises(ck.CorruptCheckpointError, match=match):
            ck.load_zero3_loss_scaler(tmp_path)
    ck.save_zero3(tmp_path, opt, params, opt.init(params), HP, deepspeed_objects=False, loss_scaler=good)
    assert ck.load_zero3_loss_scaler(tmp_path)[1] == (256.0, 8, 5, 2)
    with pytest.raises(ck.CheckpointError, match=r"loss_scaler\['cur_hysteresis'\] = 3 is invalid"):
        ck.save_zero3(tmp_path / "new", opt, params, opt.init(params), HP, deepspeed_objects=False,
                      loss_scaler=(rule, rule.init()._replace(cur_iter=9, last_overflow_iter=8)))
    assert not os.path.exists(tmp_path / "new")


def test_a_saved_step_that_is_infinite_or_beyond_int64_is_a_corrupt_checkpoint_error(tmp_path):
    """sofx counts steps in int64: a file's step of inf (a float or a 0-d tensor) was Python's bare OverflowError,
    one beyond int64 (2**64, 1e30) torch's bare ValueError when the count was made; both are corrupt files, named
    by file and block. The widest int64 step loads."""
    opt = sofx.adamw()
    params = _params()
    state = _train(opt, params, opt.init(params), 0, 2)[1]
    for i, step in enumerate((math.inf, torch.tensor(math.inf), 2 ** 64, 1e30, torch.tensor(2.0 ** 70))):
        directory = tmp_path / f"d{i}"
        files = ck.save_zero3(directory, opt, params, state, HP, deepspeed_objects=False)
        top = torch.load(files[0], weights_only=True)
        top["optimizer_state_dict"]["optimizer_state_dict"]["state"][1]["step"] = step
        torch.save(top, files[0])
        with pytest.raises(ck.CorruptCheckpointError, match=r"block 1 \(params\['enc'\]\['b'\]...\): step must be "
                                                            r"a non-negative integer below 2\*\*63, got"):
            ck.load_zero3(directory, opt, params, HP)
    top["optimizer_state_dict"]["optimizer_state_dict"]["state"][1]["step"] = 2 ** 63 - 1
    torch.save(top, files[0])
    assert int(ck.load_zero3(directory, opt, params, HP)[1].count["enc"]["w"]) == 2 ** 63 - 1


def test_a_negative_step_count_is_refused_before_any_file_is_written(tmp_path):
    """save_zero3 wrote a block's negative count (which update refuses) as its step, and load_zero3 then refused its
    own file as corrupt."""
    opt = sofx.adamw()
    params = _params()
    state = _train(opt, params, opt.init(params), 0, 1)[1]
    bad = state._replace(count=tree.tree_map(lambda c: torch.tensor(-1), state.count))
    with pytest.raises(ck.CheckpointError, match=r"state.count\['dec'\]\[0\]: expected a step count >= 0, got -1"):
        ck.save_zero3(tmp_path / "out", opt, params, bad, HP, deepspeed_objects=False)
    assert not os.path.exists(tmp_path / "out")


def test_a_negative_second_moment_is_refused_before_any_file_is_written(tmp_path):
    """save_zero3 wrote a state's negative exp_avg_sq into the flat groups, and load_zero3 then refused its own file
    as corrupt: refused before any file is written, naming the leaf and the element."""
    opt = sofx.adamw()
    params = _params()
    state = _train(opt, params, opt.init(params), 0, 1)[1]
    bad = state._replace(nu={**state.nu, "dec": [-state.nu["dec"][0]]})
    with pytest.raises(ck.CheckpointError, match=r"^state.nu\['dec'\]\[0\]\[0\] = -.*: expected a second moment >= 0"):
        ck.save_zero3(tmp_path / "out", opt, params, bad, HP, deepspeed_objects=False)
    assert not os.path.exists(tmp_path / "out")


def test_a_meta_or_sparse_leaf_is_refused_naming_it_before_any_file_is_written(tmp_path):
    """A param or moment on the meta device (no data) raised torch's bare NotImplementedError from the copy into
    the flat groups, a sparse one a bare RuntimeError from reshape; sofx.checkpoint.save names such leaves."""
    opt = sofx.adamw()
    params = _params()
    state = _train(opt, params, opt.init(params), 0, 1)[1]
    meta_w = torch.empty(5, 3, device="meta")
    sparse_w = state.mu["enc"]["w"].to_sparse()
    cases = (({**params, "enc": {**params["enc"], "w": meta_w}}, state, "param", "on the meta device"),
             (params, state._replace(mu={**state.mu, "enc": {**state.mu["enc"], "w": meta_w}}), "state.mu",
              "on the meta device"),
             (params, state._replace(nu={**state.nu, "enc": {**state.nu["enc"], "w": sparse_w}}), "state.nu",
              "of layout torch.sparse_coo"))
    for p, s, name, what in cases:
        with pytest.raises(ck.CheckpointError, match=rf"^params\['enc'\]\['w'\]: {name} is a tensor {what}, which "
                                                     "has no dense data to store"):
            ck.save_zero3(tmp_path / "out", opt, p, s, HP, deepspeed_objects=False)
        assert not os.path.exists(tmp_path / "out")


DS_SUB_GROUPS_CHILD = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
import deepspeed
import deepspeed.ops
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
sys.path.insert(0, sys.argv[3])
from ds_common import N, batch, model_

model = model_()
ps = list(model.parameters())
opt = torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2}], lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                        weight_decay=0.1)
cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "sub_group_size": 40},
       "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "gradient_clipping": 0.0}
engine = deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]
for step in range(N):
    x, y = batch(step)
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()
engine.save_checkpoint(sys.argv[1], tag="n")
print("deepspeed ok")
"""


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_a_deepspeed_checkpoint_whose_param_group_spans_several_sub_groups_loads(tmp_path):
    """ZeRO-3 splits a param group into sub-groups of about ``sub_group_size`` elements (default 1e9: any group of
    a larger model), one flat block each; the wrapped optimizer's param group then lists all of its blocks. Such
    files (3 flat blocks, 2 param groups listing [0, 1] and [2]) were refused ('3 flat groups and 2 param groups');
    they load, each block with its group's hyperparameters, and equal sofx's own run of the same groups."""
    ds_common = _deepspeed_scripts(tmp_path, DS_SUB_GROUPS_CHILD)
    _run_deepspeed_child(tmp_path)
    top = torch.load(tmp_path / "ckpt" / "n" / ck.zero3_file_name(0), weights_only=False)
    assert [g["params"] for g in top["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]] == [[0, 1], [2]]

    model = ds_common.model_()
    opt = sofx.adamw(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    hp = {"0.weight": sofx.AdamHParams(), "0.bias": sofx.AdamHParams(), "2.weight": sofx.AdamHParams(lr=3e-2),
          "2.bias": sofx.AdamHParams(lr=3e-2)}
    params, state = init, opt.init(init)
    for step in range(ds_common.N):
        x, y = ds_common.batch(step)
        ps = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = ((torch.func.functional_call(model, ps, (x,)) - y) ** 2).mean()
        grads = dict(zip(ps, torch.autograd.grad(loss, list(ps.values()))))
        params, state, _ = opt.update(params, grads, state, hp)
    template = {k: torch.zeros_like(v) for k, v in init.items()}
    loaded_p, loaded_s, loaded_hp = ck.load_zero3(tmp_path / "ckpt" / "n", opt, template, hp)
    assert _bits_equal((loaded_p, loaded_s), (params, state))
    assert loaded_hp["2.bias"].lr == 3e-2 and loaded_hp["0.bias"].lr == 1e-2 and loaded_hp["0.weight"].lr == 1e-2


def test_a_sparse_flat_master_or_moment_in_a_file_is_a_corrupt_checkpoint_error(tmp_path):
    """torch.load(weights_only=True) rebuilds sparse tensors: a file whose flat master or moment was sparse passed
    the size checks and raised torch's bare RuntimeError from reshape. No ZeRO-3 run writes one."""
    opt = sofx.adamw()
    params = _params()
    state = _train(opt, params, opt.init(params), 0, 1)[1]

    def sparse_master(z):
        z["fp32_flat_groups"][1] = z["fp32_flat_groups"][1].to_sparse()

    def sparse_moment(z):
        entry = z["optimizer_state_dict"]["state"][1]
        entry["exp_avg_sq"] = entry["exp_avg_sq"].to_sparse()

    for i, (edit, match) in enumerate(((sparse_master, r"the flat master is a tensor of layout torch.sparse_coo"),
                                       (sparse_moment, r"exp_avg_sq must be a flat floating-point tensor"))):
        files = ck.save_zero3(tmp_path / f"d{i}", opt, params, state, HP, deepspeed_objects=False)
        top = torch.load(files[0], weights_only=True)
        edit(top["optimizer_state_dict"])
        torch.save(top, files[0])
        with pytest.raises(ck.CheckpointError, match=r"block 1 \(params\['enc'\]\['b'\]...\): " + match):
            ck.load_zero3(tmp_path / f"d{i}", opt, params, HP)


def test_save_zero3_into_a_path_that_is_a_file_raises_a_checkpoint_error(tmp_path):
    """A ``directory`` that is a file (a sofx checkpoint's path, say) is refused naming it, not with
    ``os.makedirs``'s bare FileExistsError; the file is left as it was."""
    opt = sofx.adamw(lr=1e-2)
    params = _params()
    state = opt.init(params)
    path = tmp_path / "model.sofx"
    path.write_bytes(b"keep me")
    with pytest.raises(ck.CheckpointError, match=r"model\.sofx.*is a file, not a directory"):
        ck.save_zero3(path, opt, params, state, deepspeed_objects=False)
    assert path.read_bytes() == b"keep me"


def test_save_zero3_where_the_directory_cannot_be_made_raises_a_checkpoint_io_error(tmp_path):
    """The system's refusal to create the directory (here: under a file) is a ``CheckpointIOError`` naming the
    directory, an ``OSError`` too, with the cause chained."""
    opt = sofx.adamw(lr=1e-2)
    params = _params()
    (tmp_path / "plain").write_bytes(b"")
    target = tmp_path / "plain" / "global_step1"
    with pytest.raises(ck.CheckpointIOError, match=r"cannot create the ZeRO-3 checkpoint directory .*global_step1"):
        ck.save_zero3(target, opt, params, opt.init(params), deepspeed_objects=False)

def test_a_zero3_directory_in_bytes_is_the_one_it_names_and_one_that_is_not_a_path_is_refused(tmp_path):
    """``save_zero3``, ``load_zero3`` and ``load_zero3_loss_scaler`` raised bare TypeErrors for a directory in bytes
    ("Can't mix strings and bytes in path components", "cannot use a string pattern on a bytes-like object") and
    for one that is not a path (None; the params tree passed first): a bytes directory is the one it names, and
    anything else a CheckpointError naming the call, before any file is written."""
    opt = sofx.adamw(lr=1e-2)
    params, state = _train(opt, _params(), opt.init(_params()), 0, 2)
    directory = tmp_path / "global_step2"
    files = ck.save_zero3(os.fsencode(directory), opt, params, state, HP, deepspeed_objects=False)
    assert files == [str(directory / zero3.zero3_file_name(0))]
    loaded_params, loaded_state, _ = ck.load_zero3(os.fsencode(directory), opt, _params(), HP)
    assert _bits_equal((loaded_params, loaded_state), (params, state))
    rule, scaler_state = ck.load_zero3_loss_scaler(os.fsencode(directory))
    assert scaler_state.scale == 1.0
    for call, run in (("save_zero3", lambda bad: ck.save_zero3(bad, opt, params, state, HP)),
                      ("load_zero3", lambda bad: ck.load_zero3(bad, opt, params, HP)),
                      ("load_zero3_loss_scaler", lambda bad: ck.load_zero3_loss_scaler(bad))):
        for bad in (None, params):
            with pytest.raises(ck.CheckpointError, match=rf"^{call}: path must be a str or os\.PathLike, got "
                                                         rf"{type(bad).__name__}"):
                run(bad)
    assert os.listdir(tmp_path) == ["global_step2"]


def test_load_zero3_of_a_file_says_it_is_not_a_directory(tmp_path):
    """``load_zero3`` given a file (not the directory holding it) says so, rather than that it does not exist."""
    opt = sofx.adamw(lr=1e-2)
    params = _params()
    files = ck.save_zero3(tmp_path, opt, params, opt.init(params), deepspeed_objects=False)
    with pytest.raises(ck.CheckpointError, match=r"is a file, not a directory.*the directory that holds") as e:
        ck.load_zero3(files[0], opt, params)
    assert not isinstance(e.value, FileNotFoundError)
    with pytest.raises(ck.CheckpointError, match=r"is a file, not a directory"):
        ck.load_zero3_loss_scaler(files[0])


def test_load_zero3_of_the_checkpoint_root_names_the_tag_directories_below_it(tmp_path):
    """DeepSpeed's engine takes the checkpoint root and reads the tag from its ``latest`` file, which sofx does not
    write: ``load_zero3`` given the root says which tag directories below it hold ZeRO-3 files (it said only
    that the root holds none)."""
    opt = sofx.adamw(lr=1e-2)
    params = _params()
    ck.save_zero3(tmp_path / "global_step2", opt, params, opt.init(params), deepspeed_objects=False)
    ck.save_zero3(tmp_path / "global_step4", opt, params, opt.init(params), deepspeed_objects=False)
    (tmp_path / "other").mkdir()
    with pytest.raises(ck.CheckpointNotFoundError, match=r"no zero_pp_rank_0_mp_rank_00_optim_states\.pt .*; "
                                                         r"name a tag directory below it: global_step2, "
                                                         r"global_step4 hold ZeRO-3 files") as e:
        ck.load_zero3(tmp_path, opt, params)
    assert str(e.value).endswith(": global_step2, global_step4 hold ZeRO-3 files")  # not the empty "other"
    with pytest.raises(ck.CheckpointNotFoundError, match=r"optim_states\.pt \(or other dp ranks\) in \S+$"):
        ck.load_zero3(tmp_path / "other", opt, params)


def test_load_zero3_into_params_of_another_structure_names_the_file_and_its_recorded_leaves(tmp_path):
    """Without ``groups=``, the layout a sofx-written file records is resolved against ``params``; params of
    another structure (a list where a dict was saved) are refused naming the file and the leaves it records, not
    as a ``groups:`` error about an argument the caller never passed."""
    opt = sofx.adamw(lr=1e-2)
    params = {"w": torch.randn(4, 3), "b": torch.zeros(3)}
    files = ck.save_zero3(tmp_path, opt, params, opt.init(params), deepspeed_objects=False)
    with pytest.raises(ck.CheckpointMismatchError) as e:
        ck.load_zero3(tmp_path, opt, [params["b"], params["w"]])
    message = str(e.value)
    assert message.startswith(f"{files[0]}: the layout the file records does not fit params")
    assert "no params leaf is named \"params['b']\"" in message
    assert "it records the leaves [\"params['b']\", \"params['w']\"]" in message and "groups=" in message


def test_the_file_name_helpers_refuse_ranks_that_are_not_integers():
    """zero3_file_name(1.5) named a file 'zero_pp_rank_1.5_...' DeepSpeed never reads, mp_rank=1.5 raised a bare
    ValueError from a format, bf16='no' named a bf16_ file: each refused, a CheckpointError naming the argument."""
    from sofx.checkpoint.zero3 import model_states_file_name

    assert ck.zero3_file_name(2, 1, bf16=True) == "bf16_zero_pp_rank_2_mp_rank_01_optim_states.pt"
    assert model_states_file_name(0) == "zero_pp_rank_0_mp_rank_00_model_states.pt"
    for call, name in ((lambda: ck.zero3_file_name(1.5), "dp_rank"), (lambda: ck.zero3_file_name(0, 1.5), "mp_rank"),
                       (lambda: ck.zero3_file_name(-1), "dp_rank"), (lambda: ck.zero3_file_name(0, bf16="no"), "bf16"),
                       (lambda: model_states_file_name("0"), "dp_rank")):
        with pytest.raises(ck.CheckpointError, match=rf"^{name} = "):
            call()


def test_values_beyond_the_range_of_the_dtype_they_are_loaded_in_are_refused_naming_the_element(tmp_path):
    """A file's fp32 masters are cast to each template leaf's dtype and its moments to ``opt.state_dtype`` (the
    leaf's where ``None``): a second moment over 65504 (a DeepSpeed fp16 run's, common) loaded into a float16
    template came back inf without a word, the parameter then frozen; a master over 65504 too. Refused, naming the
    block, the leaf, the element and the dtype; a float32 state_dtype takes the moment."""
    opt = sofx.adamw()
    params = _params()
    files = ck.save_zero3(tmp_path, opt, params, _train(opt, params, opt.init(params), 0, 2)[1], HP,
                          deepspeed_objects=False)
    top = torch.load(files[0], weights_only=True)
    top["optimizer_state_dict"]["optimizer_state_dict"]["state"][1]["exp_avg_sq"][7 + 4] = 1e7
    torch.save(top, files[0])
    half = _params(torch.float16)
    with pytest.raises(sofx.UnsupportedError, match=r"^load_zero3: block 1's exp_avg_sq for params\['enc'\]\['w'\]"
                                                    r"\[1, 1\] = 10000000\.0 is beyond float16's range \(largest "
                                                    r"65504\.0\), the leaf's dtype"):
        ck.load_zero3(tmp_path, opt, half, HP)
    wide = sofx.adamw(state_dtype=torch.float32)
    assert ck.load_zero3(tmp_path, wide, half, HP)[1].nu["enc"]["w"][1, 1] == 1e7
    top["optimizer_state_dict"]["fp32_flat_groups"][1][7 + 5] = -1e5
    torch.save(top, files[0])
    with pytest.raises(sofx.UnsupportedError, match=r"^load_zero3: block 1's master for params\['enc'\]\['w'\]"
                                                    r"\[1, 2\] = -100000\.0 is beyond float16's range"):
        ck.load_zero3(tmp_path, wide, half, HP)


def test_ranks_whose_step_counts_or_hparams_differ_are_refused_naming_the_block_and_both_values(tmp_path):
    """Rank files of two runs (or a rank's file edited) whose step counts or hyperparameters differ were refused
    as "its step counts or hyperparameters differ from rank 0's", naming neither the block nor the values: the
    refusal names the rank's file, the first block that differs, what differs and both ranks' values."""
    opt = sofx.adamw()
    params = _params()
    files = ck.save_zero3(tmp_path, opt, params, _train(opt, params, opt.init(params), 0, 2)[1], HP,
                          dp_world_size=2, deepspeed_objects=False)
    top = torch.load(files[1], weights_only=True)
    top["optimizer_state_dict"]["optimizer_state_dict"]["state"][1]["step"] = 5
    torch.save(top, files[1])
    with pytest.raises(ck.CorruptCheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: block 1 "
                                                        r"\(params\['enc'\]\['b'\]\.\.\.\) has step count 5, rank 0's "
                                                        r"file 2"):
        ck.load_zero3(tmp_path, opt, params, HP)
    top["optimizer_state_dict"]["optimizer_state_dict"]["state"][1]["step"] = 2
    top["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][0]["lr"] = 0.5
    torch.save(top, files[1])
    pattern = (r"rank_1_mp_rank_00_optim_states\.pt: block 0 \(params\['dec'\]\[0\]\) has hyperparameters "
               r"AdamHParams\(lr=0\.5, .*\), rank 0's file AdamHParams\(lr=0\.005, ")
    with pytest.raises(ck.CorruptCheckpointError, match=pattern):
        ck.load_zero3(tmp_path, opt, params, HP)
