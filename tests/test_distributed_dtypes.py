"""Shards of mixed dtypes and param groups (gloo, 2 ranks), and the gradient mean beside DDP's.

* fp32, bf16 and fp16 leaves (fp32 moments for all), each leaf its own param group (its lr, betas, weight
  decay; one lr a 0-d tensor) from a schedule, gradients missing on some steps, an inf in one rank's leaf:
  the sharded serial and speculative loops, gathered, equal the single-process serial loop bit for bit (no
  step clips: the sum of squares is associated per rank, which only a clip coefficient reads), step counts
  and decisions included.
* The mean of data-parallel gradients, :func:`sofx.distributed.all_reduce_mean_` and
  :meth:`Shard.reduce_mean`, equals what ``DistributedDataParallel`` averages, bit for bit, on two ranks:
  fp32, bf16, and fp16 in its normal range (DDP multiplies each gradient by 1/2 and sums; sofx sums, halving
  first in float32 for fp16 and bf16: the same bits wherever halving is exact. An fp16 subnormal DDP halves
  with a rounding; sofx keeps its half).

One spawned group runs every case, with a 10 s group timeout, and is killed if it does not finish in time.
"""

from __future__ import annotations

import math

import pytest
import torch

import sofx
from sofx import AdamHParams, loss_scale
from sofx import distributed as sd
from sofx import speculate as sp
from sofx.serial import init_loop, serial_loop_step
from helpers import run_gloo_cases

WORLD = 2
SHAPES = {"a": (300,), "b": (7, 5), "c": (11,), "d": (2, 3), "e": (1,)}
DTYPES = {"a": torch.float32, "b": torch.bfloat16, "c": torch.float16, "d": torch.float32, "e": torch.bfloat16}
KEYS = sorted(SHAPES)
STEPS = 8
INF_STEP = 2                                  # an inf in leaf d only (owned by one rank)
MISSING = {4: ("c",), 5: ("a", "e"), 6: ("c",)}  # no gradient for these leaves at these steps
MAX_NORM = 1e3                                # never reached: no step clips


def _params() -> dict:
    g = torch.Generator().manual_seed(31)
    return {k: torch.randn(*SHAPES[k], generator=g).to(DTYPES[k]) for k in KEYS}


def _grads(step: int, scale: float) -> dict:
    g = torch.Generator().manual_seed(300 + step)
    out = {k: (torch.randn(*SHAPES[k], generator=g) * 0.05 * scale).to(DTYPES[k]) for k in KEYS}
    if step == INF_STEP:
        out["d"][1, 2] = math.inf
    return {k: None if k in MISSING.get(step, ()) else v for k, v in out.items()}


def _schedule(step: int) -> dict:
    """Every leaf its own group, moving with the step."""
    decay = 0.9 ** step
    return {"a": AdamHParams(lr=torch.tensor(1e-2 * decay), weight_decay=0.0),
            "b": AdamHParams(lr=2e-2 * decay, beta1=0.8, weight_decay=0.1),
            "c": AdamHParams(lr=5e-3, beta2=0.99),
            "d": AdamHParams(lr=1e-2 * decay, eps=1e-6, weight_decay=0.05),
            "e": AdamHParams(lr=3e-2, beta1=0.5, beta2=0.9)}


def _run(local, hparams, reduce, speculative: bool) -> tuple[sofx.serial.LoopState, list]:
    """The loop over ``local`` (a rank's leaves, or the identity in one process)."""
    opt = sofx.adamw(lr=1e-2, state_dtype=torch.float32)
    scaler = loss_scale.grad_scaler(init_scale=2.0 ** 8, growth_interval=3)
    cfg = sp.SpeculationConfig(max_norm=MAX_NORM)
    loop = init_loop(opt, local(_params()), scaler)
    facts = []
    for step in range(STEPS):
        grads = local(_grads(step, scaler.scale(loop.scaler_state)))
        if speculative:
            loop, report = sp.speculative_loop_step(opt, loop, grads, config=cfg, scaler=scaler, hparams=hparams,
                                                    reduce_sumsq=reduce)
            facts.append((report.skipped, report.clipped, report.scale))
        else:
            loop, f = serial_loop_step(opt, loop, grads, scaler=scaler, hparams=hparams, max_norm=MAX_NORM,
                                       reduce_sumsq=reduce)
            facts.append((f.skipped, f.clipped, f.scale))
    return loop, facts


def _sharded_loops(rank: int) -> dict:
    shard = sd.shard_blocks(_params())
    opt = sofx.adamw(lr=1e-2, state_dtype=torch.float32)
    reduce = sd.all_reduce_sumsq()
    moments = {k: torch.empty(SHAPES[k], device="meta") for k in KEYS}
    counts = {k: torch.zeros((), dtype=torch.int64) for k in KEYS}
    out = {"owned": list(shard.owned)}
    for speculative in (False, True):
        loop, facts = _run(shard.local, shard.local_hparams(opt, _schedule), reduce, speculative)
        out[speculative] = {"facts": facts, "step": loop.step, "params": shard.gather(loop.params, _params()),
                            "mu": shard.gather(loop.opt_state.mu, moments),
                            "nu": shard.gather(loop.opt_state.nu, moments),
                            "count": shard.gather(loop.opt_state.count, counts)}
    return out


DDP_N = 2048


class _Linear(torch.nn.Module):
    """``loss = sum(p * x)``: the gradient of ``p`` is ``x``, exactly."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(DDP_N, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.p * x).sum()


def _ddp_gradient(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s gradient: numbers over 25 binades whose halves are normal in fp16 too (at least 2**-13)."""
    g = torch.Generator().manual_seed(70 + rank)
    x = torch.randn(DDP_N, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-12, 12, (DDP_N,), generator=g).double())
    return torch.where(x.abs() < 2.0 ** -13, torch.copysign(torch.full_like(x, 2.0 ** -13), x), x).to(dtype)


def _means_beside_ddp(rank: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        module = _Linear(dtype)
        ddp = torch.nn.parallel.DistributedDataParallel(module)
        x = _ddp_gradient(rank, dtype)
        ddp(x).backward()
        mine = {"p": x.clone()}
        sd.all_reduce_mean_(mine)
        shard = sd.shard_blocks({"p": module.p.detach()}, owners=(WORLD - 1,))
        onto_owner = shard.reduce_mean({"p": x})
        out[str(dtype)] = {"ddp": module.p.grad.clone(), "all_reduce_mean_": mine["p"],
                           "reduce_mean": onto_owner[0] if onto_owner else None}
    return out


# leaves of dtypes gloo cannot broadcast (its "Invalid scalar type"), and of others
GATHERED = {"a": torch.float8_e4m3fn, "b": torch.float32, "c": torch.int16, "d": torch.float8_e5m2, "e": torch.uint16}


def _gathered_leaf(k: str) -> torch.Tensor:
    return torch.arange(-3, 4, dtype=torch.float32).mul(0.75).add(1 + 0.5 * KEYS.index(k)).to(GATHERED[k])


def _gather_of_any_dtype(rank: int) -> dict:
    """Shard.gather of leaves of every dtype (a float8 master or moment, an int16 or uint16 count): before, the
    broadcast of a float8 or int16 leaf raised gloo's 'Invalid scalar type' on every rank, reported as a rank that
    did not take part within the group's timeout."""
    like = {k: torch.empty(7, dtype=dt, device="meta") for k, dt in GATHERED.items()}
    shard = sd.shard_blocks(like, owners=(0, 1, 1, 0, 1))
    full = shard.gather([_gathered_leaf(KEYS[i]) for i in shard.owned], like=like)
    return {k: (str(v.dtype), v.view(torch.uint8).clone()) for k, v in full.items()}  # (bits: any dtype saved)


CASES = {"sharded_loops": _sharded_loops, "means_beside_ddp": _means_beside_ddp,
         "gather_of_any_dtype": _gather_of_any_dtype}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_gloo_cases(CASES, WORLD, tmp_path_factory.mktemp("dtypes"), timeout_s=300)


@pytest.mark.parametrize("speculative", [False, True], ids=["serial", "speculative"])
def test_shards_of_mixed_dtypes_and_param_groups_equal_one_process_bitwise(ranks, speculative):
    want, facts = _run(lambda tree: tree, _schedule, None, speculative=False)
    assert [f[:2] for f in facts] == [(False, False)] * INF_STEP + [(True, False)] + [(False, False)] * 5
    assert sorted(i for r in ranks for i in r["sharded_loops"]["owned"]) == list(range(len(KEYS)))
    assert all(r["sharded_loops"]["owned"] for r in ranks)  # both ranks own leaves
    state = want.opt_state
    for rank, r in enumerate(ranks):
        got = r["sharded_loops"][speculative]
        assert got["facts"] == facts and got["step"] == want.step, rank
        for name, full in (("params", want.params), ("mu", state.mu), ("nu", state.nu), ("count", state.count)):
            for k in KEYS:
                a, b = got[name][k], full[k]
                assert a.dtype == b.dtype and torch.equal(a, b), (rank, name, k)
    assert int(state.count["c"]) == STEPS - 1 - 2 and int(state.count["a"]) == STEPS - 1 - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_mean_on_two_ranks_is_ddps_bit_for_bit(ranks, dtype):
    exact = (_ddp_gradient(0, dtype).double() + _ddp_gradient(1, dtype).double()) / 2
    for rank, r in enumerate(ranks):
        got = r["means_beside_ddp"][str(dtype)]
        assert torch.equal(got["all_reduce_mean_"], got["ddp"]), rank
        assert torch.equal(got["all_reduce_mean_"], exact.to(dtype)), rank  # the exact mean, rounded once
        if rank == WORLD - 1:
            assert torch.equal(got["reduce_mean"], got["ddp"])
        else:
            assert got["reduce_mean"] is None


def test_a_gather_of_leaves_of_any_dtype_sends_their_bits(ranks):
    for r in ranks:
        got = r["gather_of_any_dtype"]
        for k, dt in GATHERED.items():
            assert got[k][0] == str(dt) and torch.equal(got[k][1], _gathered_leaf(k).view(torch.uint8)), k
