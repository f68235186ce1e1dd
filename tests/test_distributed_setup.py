"""Ranks set up differently (gloo, 2 ranks): every rank raises at setup, naming what differs, before any step.

:func:`sofx.distributed.shard_blocks` checks that the ranks' params agree in structure, dtypes and shapes and
their shards in owners. Before, nothing compared them: a rank whose params had another shape (or another leaf)
stepped its own shard beside the others' -- the sum-of-squares hook adds numbers whatever they belong to --
until a gather refused the layouts, or never. A rank whose own input was refused there raised alone, and the
other went on to wait for it in its first collective. :func:`sofx.distributed.all_reduce_sumsq` (as it builds
the hook) and :func:`sofx.distributed.check_same_setup` compare the rest of the setup: optimizer (with its
kernel backend), loss scaler, speculation config, hparams or schedule, settings, the hook's device. One
spawned group runs every case, with a 10 s group timeout, and is killed if it does not finish in time: a hang
fails the test instead of blocking it.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

import sofx
from sofx import AdamHParams, loss_scale
from sofx import distributed as sd
from sofx import speculate as sp
from helpers import refused_on_every_rank, run_gloo_cases

BAD = 1
HINT = "every rank must build its shard from params of the same structure, dtypes and shapes, with the same owners"
ORDER = ("the ranks list the same leaves and settings in another order (an OrderedDict's leaves come in its keys' "
         "order): in place 0, params['p'] on rank 0; params['q'] on rank 1")


def _message(call) -> str:
    """What ``call`` says (a string it returns), or ``"no error"``, or the error it raises."""
    try:
        said = call()
        return said if isinstance(said, str) else "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _params(rank: int, change: str = "") -> dict:
    """The params of rank ``rank``; on rank BAD with ``change`` applied."""
    params = {"p": torch.ones(3), "q": torch.ones(4)}
    if rank != BAD:
        return params
    if change == "shape":
        params["q"] = torch.ones(2, 2)
    elif change == "dtype":
        params["p"] = torch.ones(3, dtype=torch.float64)
    elif change == "leaf":
        params["r"] = torch.ones(1)
    elif change == "number":
        params["q"] = 1.0
    elif change == "order":  # the same leaves in another order (a dict's are sorted, an OrderedDict's are not)
        params = OrderedDict([("q", params["q"]), ("p", params["p"])])
    return params


def _shard_blocks(rank: int) -> dict:
    out = {"same": _message(lambda: sd.shard_blocks(_params(rank)))}
    for change in ("shape", "dtype", "leaf", "number", "order"):
        out[change] = _message(lambda: sd.shard_blocks(_params(rank, change)))
    bad = rank == BAD
    out["owners"] = _message(lambda: sd.shard_blocks(_params(rank), owners=(1, 0) if bad else (0, 1)))
    out["keyword"] = _message(lambda: sd.shard_blocks(_params(rank), **({"owner": (0, 1)} if bad else {})))
    out["rank_only"] = _message(lambda: sd.shard_blocks(_params(rank), **({"rank": 1} if bad else {})))
    out["positional"] = _message(lambda: sd.shard_blocks(_params(rank), None, *([(0, 1)] if bad else [])))
    return out


def _setup(rank: int, change: str = "") -> dict:
    """The setup of rank ``rank``; on rank BAD with ``change`` made."""
    bad = rank == BAD

    def schedule(step: int) -> dict:
        if bad and change == "raising schedule":
            raise ValueError("this rank's schedule failed")
        lr = 0.02 if bad and change == "hparams" else 0.01
        return {"p": AdamHParams(lr=lr * 0.9 ** step), "q": AdamHParams(lr=torch.tensor(0.01), weight_decay=0.0)}

    return {"params": _params(rank, "dtype" if change == "params" else ""),
            "opt": sofx.adamw(lr=1e-2, backend="reference" if bad and change == "backend" else "auto"),
            "scaler": loss_scale.grad_scaler(init_scale=1024.0,
                                             growth_interval=1000 if bad and change == "scaler" else 2000),
            "config": sp.SpeculationConfig(max_norm=2.0 if bad and change == "config" else 1.0),
            "hparams": schedule}


SETUP_CHANGES = ("params", "backend", "scaler", "config", "hparams")


def _all_reduce_sumsq(rank: int) -> dict:
    """The hook built with the setup (different on rank BAD in one respect per case); where it is built, it
    sums."""
    def built(**kw) -> str:
        reduce = sd.all_reduce_sumsq(**kw)
        return f"built: {reduce(rank + 1.0)}"

    bad = rank == BAD
    out = {"same": _message(lambda: built(**_setup(rank)))}
    for change in SETUP_CHANGES + ("raising schedule",):
        out[change] = _message(lambda: built(**_setup(rank, change)))
    out["keyword"] = _message(lambda: built(**_setup(rank), **({"scalar": None} if bad else {})))
    out["positional"] = _message(lambda: sd.all_reduce_sumsq(None, *(["cpu"] if bad else [])) and "built")
    out["device"] = _message(lambda: built(device="meta" if bad else None))
    out["meta"] = _message(lambda: built(device="meta"))  # (on every rank)
    out["not the backend's"] = _message(lambda: built(device="xpu" if bad else None))
    out["no device"] = _message(lambda: built(device="nowhere" if bad else None))
    return out


def _warmup(peak: float, steps: int):
    """A schedule of one's own (not a dataclass, compared by its value): lr from 0 to ``peak`` over ``steps``."""
    return lambda step: AdamHParams(lr=peak * min(1.0, step / steps))


def _auto_resolved_otherwise(rank: int) -> str:
    """check_same_setup where ``backend="auto"`` resolves to another backend on rank BAD (as on a GPU rank without
    Triton, which takes the reference kernels: other bits than Triton's), the configurations alike."""
    import sofx.kernels

    order = sofx.kernels._auto_order
    if rank == BAD:
        sofx.kernels._auto_order = lambda device: ["reference"]
    try:
        return _message(lambda: sd.check_same_setup(params=_params(rank), opt=sofx.adamw(lr=1e-2)))
    finally:
        sofx.kernels._auto_order = order


def _check_same_setup(rank: int) -> dict:
    bad = rank == BAD
    return {"same": _message(lambda: sd.check_same_setup(**_setup(rank), settings={"max_norm": 1.0})),
            "auto resolved": _auto_resolved_otherwise(rank),
            "settings": _message(lambda: sd.check_same_setup(settings={"max_norm": 2.0 if bad else 1.0})),
            "given on one rank": _message(lambda: sd.check_same_setup(settings={"max_norm": 1.0} if bad else None)),
            "not a mapping": _message(lambda: sd.check_same_setup(settings=[1.0] if bad else {})),
            "order": _message(lambda: sd.check_same_setup(params=_params(rank, "order"))),
            "positional": _message(lambda: sd.check_same_setup(None, *([_params(rank)] if bad else []))),
            "warmup": _message(lambda: sd.check_same_setup(hparams=_warmup(0.5, 200 if bad else 100)))}


def _keys_that_read_the_same(rank: int) -> dict:
    """Params keyed by two modules of equal ``repr`` (two ``nn.Linear(2, 2)``: their leaves' paths read the same),
    the first leaf of another shape on rank BAD."""
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    params = {first: torch.ones(2 if rank == BAD else 3), second: torch.ones(4)}
    return {"shard_blocks": _message(lambda: sd.shard_blocks(params)),
            "check_same_setup": _message(lambda: sd.check_same_setup(params=params)),
            "all_reduce_sumsq": _message(lambda: sd.all_reduce_sumsq(params=params) and "built"),
            "on one rank": _message(lambda: sd.shard_blocks(params if rank == BAD else {"w": torch.ones(3)}))}


CASES = {"shard_blocks": _shard_blocks, "all_reduce_sumsq": _all_reduce_sumsq, "check_same_setup": _check_same_setup,
         "keys_that_read_the_same": _keys_that_read_the_same}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_gloo_cases(CASES, 2, tmp_path_factory.mktemp("setup"), timeout_s=300)


def test_shard_blocks_refuses_params_or_owners_that_differ_between_ranks(ranks):
    want = {"shape": "params['q'] differs between ranks: torch.float32 (4,) on rank 0; torch.float32 (2, 2) on "
                     "rank 1",
            "dtype": "params['p'] differs between ranks: torch.float32 (3,) on rank 0; torch.float64 (3,) on rank 1",
            "leaf": "params['r'] differs between ranks: absent on rank 0; torch.float32 (1,) on rank 1 (and 1 more: "
                    "owners)",
            "owners": "owners differs between ranks: (0, 1) on rank 0; (1, 0) on rank 1",
            "order": ORDER}
    for res in ranks:
        assert res["shard_blocks"]["same"] == "no error"
        for key, msg in want.items():
            assert res["shard_blocks"][key] == f"SofxError: shard_blocks: {msg}; {HINT}", (key, res["shard_blocks"])


def test_shard_blocks_refuses_one_ranks_bad_input_on_every_rank(ranks):
    refused_on_every_rank(ranks, BAD, "shard_blocks", "number",
                           "shard_blocks: params['q'] is a float; expected a tensor")
    refused_on_every_rank(ranks, BAD, "shard_blocks", "keyword",
                           "shard_blocks: unknown keyword argument 'owner'; it takes owners, rank, world_size")
    refused_on_every_rank(ranks, BAD, "shard_blocks", "rank_only",
                           "shard_blocks: pass both rank and world_size, or neither")
    refused_on_every_rank(ranks, BAD, "shard_blocks", "positional",
                           "shard_blocks: 1 positional argument too many (tuple); it takes params, group, then only "
                           "the keywords owners, rank, world_size")


def test_the_hook_is_built_only_where_every_rank_is_set_up_the_same(ranks):
    setup_hint = ("; every rank must be set up the same (params' structure, dtypes and shapes; optimizer; loss "
                  "scaler; speculation config; hparams; settings)")
    # (a float64 leaf: the reference kernels where a float32 one takes cpu's, an entry of its own)
    want = {"params": "params['p'] differs between ranks: torch.float32 (3,) on rank 0; torch.float64 (3,) on "
                      "rank 1 (and 1 more: opt.backend(params['p']))",
            "scaler": "scaler.growth_interval differs between ranks: 2000 on rank 0; 1000 on rank 1",
            "config": "config.max_norm differs between ranks: 1 on rank 0; 2 on rank 1",
            "hparams": "hparams(0)['p'].lr differs between ranks: 0.01 on rank 0; 0.02 on rank 1 (and 1 more: "
                       "hparams(1)['p'].lr)"}
    for res in ranks:
        got = res["all_reduce_sumsq"]
        assert got["same"] == "built: 3.0", got
        for key, msg in want.items():
            assert got[key] == f"SofxError: all_reduce_sumsq: {msg}{setup_hint[:-1]}; the hook's device)", \
                (key, got[key])
        backend = got["backend"]
        assert backend.startswith("SofxError: all_reduce_sumsq: opt differs between ranks: sofx.adamw("), backend
        assert "backend='auto') on rank 0; sofx.adamw(" in backend and "backend='reference') on rank 1" in backend
    refused_on_every_rank(ranks, BAD, "all_reduce_sumsq", "raising schedule",
                           "all_reduce_sumsq: this rank's input could not be read (ValueError: this rank's schedule "
                           "failed)")
    refused_on_every_rank(ranks, BAD, "all_reduce_sumsq", "keyword",
                           "all_reduce_sumsq: unknown keyword argument 'scalar'; it takes device, params, opt, "
                           "scaler, config, hparams, settings")
    refused_on_every_rank(ranks, BAD, "all_reduce_sumsq", "positional",
                           "all_reduce_sumsq: 1 positional argument too many (str); it takes group, then only the "
                           "keywords device, params, opt, scaler, config, hparams, settings")
    refused_on_every_rank(ranks, BAD, "all_reduce_sumsq", "no device",
                          "all_reduce_sumsq: this rank's input could not be read (RuntimeError: Expected one of")
    # a meta device held the hook's sums (no data: every step's collective then failed, Python's bare
    # NotImplementedError 'Cannot copy out of meta tensor'); refused at setup, on one rank or on every rank
    meta = ("all_reduce_sumsq: device='meta': a meta tensor holds no data, and the sums of squares could not "
            "travel there; pass a device of this process that the process group's backend (gloo: cpu, cuda) runs "
            "collectives on, or None")
    refused_on_every_rank(ranks, BAD, "all_reduce_sumsq", "device", meta)
    for res in ranks:
        assert meta in res["all_reduce_sumsq"]["meta"], res["all_reduce_sumsq"]["meta"]
    refused_on_every_rank(ranks, BAD, "all_reduce_sumsq", "not the backend's",
                          "all_reduce_sumsq: device='xpu': the process group's backend runs no collectives on a xpu "
                          "device; pass a device of this process that the process group's backend (gloo: cpu, cuda) "
                          "runs collectives on, or None")


def test_check_same_setup_names_the_setting_that_differs_on_every_rank(ranks):
    for res in ranks:
        got = res["check_same_setup"]
        assert got["same"] == "no error", got
        # (max_norm=1.0: a number reads by its value, as 1 does)
        assert got["settings"].startswith("SofxError: check_same_setup: settings['max_norm'] differs between "
                                          "ranks: 1 on rank 0; 2 on rank 1; every rank must be set up"), got
        assert got["given on one rank"].startswith("SofxError: check_same_setup: settings differs between ranks: "
                                                   "absent on rank 0; dict on rank 1 (and 1 more: "
                                                   "settings['max_norm'])"), got
        assert got["order"].startswith(f"SofxError: check_same_setup: {ORDER}; every rank must be set up"), got
        assert got["auto resolved"].startswith("SofxError: check_same_setup: opt.backend(params['p']) differs between "
                                               "ranks: cpu on rank 0; reference on rank 1 (and 1 more: "
                                               "opt.backend(params['q'])); every rank must be set up"), got
        # a warm-up of another length: lr 0 at step 0 on every rank (before, all that was compared)
        assert got["warmup"].startswith("SofxError: check_same_setup: hparams(1).lr differs between ranks: 0.005 on "
                                        "rank 0; 0.0025 on rank 1; every rank must be set up"), got
    refused_on_every_rank(ranks, BAD, "check_same_setup", "positional",
                           "check_same_setup: 1 positional argument too many (dict); it takes group, then only the "
                           "keywords params, opt, scaler, config, hparams, settings")
    refused_on_every_rank(ranks, BAD, "check_same_setup", "not a mapping",
                           "settings is a list; expected a mapping of names to settings")


def test_equal_sets_in_a_setup_read_the_same():
    """A set's repr lists its elements in the order of their hashes and of their insertion: equal sets built in
    another order, or on another rank (Python salts a str's hash per process), read differently, and ranks that
    passed the same setup were refused as different. Compared by their elements' texts, sorted."""
    from sofx.distributed.setup import _setup_entries

    def entries(value):
        return _setup_entries(None, None, None, None, None, {"layers": value})

    assert {0, 8} == {8, 0} and repr({0, 8}) != repr({8, 0})  # 8 and 0 share a slot: the first one takes it
    assert entries({0, 8}) == entries({8, 0})
    assert entries(frozenset({0, 8})) == entries(frozenset({8, 0}))
    assert entries({0, 8})["settings['layers']"] == "set({0, 8})"
    assert entries({0, 8}) != entries(frozenset({0, 8})) != entries({0, 9})


class _Key:
    """A dict key without a repr of its own: ``repr`` gives its address, another on every rank."""


def test_dict_keys_in_a_setup_read_the_same_on_every_rank():
    """A dict's entries were named and sorted by their keys' ``repr``: a frozenset key read differently where the
    set was built in another order or on another rank (Python salts a str's hash per process), an object key by
    its address, and ranks that passed the same setup were refused as different. Keys are named by the same text
    as values (sets sorted, addresses left out); keys that read the same cannot be told apart between ranks and
    are refused, naming where."""
    from sofx.distributed.setup import _setup_entries

    def entries(value):
        return _setup_entries(None, None, None, None, None, {"layers": value})

    assert repr(frozenset({0, 8})) != repr(frozenset({8, 0}))
    assert entries({frozenset({0, 8}): 1.0}) == entries({frozenset({8, 0}): 1.0})
    assert entries({(frozenset({0, 8}), "a"): 1.0}) == entries({(frozenset({8, 0}), "a"): 1.0})
    assert "settings['layers'][frozenset({0, 8})]" in entries({frozenset({8, 0}): 1.0})
    assert entries({_Key(): 1.0}) == entries({_Key(): 1.0}) != entries({_Key(): 2.0})
    assert entries({"b": 1, "a": 2}) == {"settings": "dict", "settings['layers']": "dict",
                                         "settings['layers']['a']": "2", "settings['layers']['b']": "1"}
    with pytest.raises(sofx.SofxError) as info:
        entries({_Key(): 1.0, _Key(): 2.0})
    assert str(info.value) == (f"settings['layers'] has two keys that read <{_Key.__module__}._Key object> "
                               "(addresses left out): which is which could differ between ranks; give the keys a "
                               "repr that tells them apart")


def test_params_whose_leaf_paths_read_the_same_are_refused_on_every_rank(ranks):
    """The ranks compare their params leaf by leaf, each named by its path; two leaves whose keys have the same
    ``repr`` (two ``nn.Linear(2, 2)``) had one name, the second's dtype and shape replaced the first's, and
    ranks whose first such leaf differed in shape were taken as set up the same."""
    path = "params[Linear(in_features=2, out_features=2, bias=True)]"
    for res in ranks:
        for what, msg in res["keys_that_read_the_same"].items():
            if what == "on one rank":
                continue
            assert msg == (f"SofxError: params has two leaves named {path}: which is which could differ "
                           "between ranks; give the keys a repr that tells them apart"), (what, msg)
    refused_on_every_rank(ranks, BAD, "keys_that_read_the_same", "on one rank", f"params has two leaves named {path}")


def test_optimizers_whose_tensor_defaults_differ_beyond_their_repr_read_differently():
    """The optimizer was compared by its ``repr``, in which a 0-d tensor default reads to 4 digits
    (``lr=tensor(0.0100)`` for 0.01 and for 0.0100001): ranks whose optimizers step with other defaults were
    taken as set up the same. Its defaults are compared field by field too, a tensor by its exact value."""
    from sofx.distributed.setup import _setup_entries

    def entries(lr):
        return _setup_entries(None, sofx.adamw(lr=lr), None, None, None, None)

    assert repr(sofx.adamw(lr=torch.tensor(0.01))) == repr(sofx.adamw(lr=torch.tensor(0.0100001)))
    assert entries(torch.tensor(0.01)) == entries(torch.tensor(0.01))
    assert entries(torch.tensor(0.01)) != entries(torch.tensor(0.0100001))
    exact = torch.tensor(0.0100001).item()
    assert entries(torch.tensor(0.0100001))["opt.defaults.lr"] == f"tensor({exact!r}, dtype=torch.float32)"
    assert entries(0.01)["opt.defaults.lr"] == "0.01" and list(entries(0.01))[0] == "opt"  # named after opt


def test_numbers_in_a_setup_read_the_same_where_their_values_are_equal():
    """Numbers were compared by ``repr``: ``lr=1`` and ``lr=1.0``, or a numpy float and the Python float of the
    same value (``np.float64(0.01)``), were refused as different setups. Compared by value, exactly: an int by
    itself, a float by its exact value (integral ones as the int), a bool as a bool."""
    np = pytest.importorskip("numpy")
    from sofx.distributed.setup import _setup_entries

    def entries(value):
        return _setup_entries(None, None, None, None, None, {"x": value})["settings['x']"]

    assert entries(1) == entries(1.0) == entries(np.float64(1.0)) == entries(np.int64(1)) == "1"
    assert entries(0.01) == entries(np.float64(0.01)) == "0.01"
    assert entries(np.float32(0.5)) == entries(0.5) and entries(-0.0) == entries(0)
    assert entries(math.inf) == entries(np.float64(math.inf)) and entries(math.nan) == entries(np.float32(math.nan))
    assert entries(np.bool_(True)) == entries(True) == "True"
    # real differences stay differences
    assert entries(np.float32(0.01)) != entries(0.01)  # float32's nearest to 0.01 is another number
    assert entries(2 ** 53 + 1) != entries(float(2 ** 53 + 1))  # the float is 2**53
    assert entries(True) != entries(1) and entries(1) != entries("1") and entries(1) != entries(1.5)
    hp = lambda lr: _setup_entries(None, None, None, None, AdamHParams(lr=lr, eps=np.float64(1e-8)), None)
    assert hp(1) == hp(np.float64(1.0)) != hp(2)
    opt = lambda lr: _setup_entries(None, sofx.adamw(lr=lr), None, None, None, None)  # (its repr held lr=1)
    assert opt(1) == opt(1.0) == opt(np.float64(1.0)) != opt(2)
    assert opt(1)["opt"] == ("sofx.adamw(defaults=opt.defaults, bias_correction=True, state_dtype=None, "
                             "undo='auto', backend='auto')")
    assert opt(1) != _setup_entries(None, sofx.adam(lr=1), None, None, None, None)
