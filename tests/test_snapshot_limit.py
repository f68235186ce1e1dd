"""The snapshot budget holds where a step finds its own need for a snapshot (SPECULATION.md section 2:
"snapshot within a memory budget, else the block is not speculated").

``undo="auto"`` finds in the step itself (the CPU kernels' checked step) or in a pass before it (the other
backends) that a gradient dominates the second moment, where the algebraic inverse would be too lossy; the
leaf's record then keeps the old values (of the chunks the step flagged, or of the leaf where a pass before
the step found it). ``Adam.update(snapshot_limit_bytes=...)`` refuses a record that
would hold more (:class:`sofx.SnapshotLimitError`), taking the step back; a speculation passes what is left
of ``snapshot_budget_bytes`` and steps a refused block in validation instead.
"""

from __future__ import annotations

import copy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import sofx
import sofx.speculate as sp
from sofx import loss_scale
from sofx.errors import SofxError, UnsupportedError
from sofx.kernels import cpu
from sofx.kernels.base import FINITE_CHUNK
from sofx.serial import serial_step

import sofx.offload
from test_offload_support import mse_step_side_by_side, one_torch_thread, relative_deviation  # noqa: F401

TOL = 1e-6  # DESIGN.md: the speculative run against torch.optim

BACKENDS = ["reference"] + (["cpu"] if cpu.native_available() else [])
SIZES = (2 * FINITE_CHUNK + 300, 700)  # the first leaf: three chunks, the last one partial


def _warm(opt: sofx.Adam, gen: torch.Generator, steps: int = 30) -> tuple[list, sofx.AdamState]:
    """Params and moments after ``steps`` steps of unit gradients: sound for gradients of that size."""
    params = [torch.randn(n, generator=gen) for n in SIZES]
    state = opt.init(params)
    for _ in range(steps):
        params, state, _ = opt.update(params, [torch.randn(n, generator=gen) for n in SIZES], state,
                                      undoable=False)
    return params, state


def _tensors(params: list, state: sofx.AdamState) -> list[torch.Tensor]:
    return [*params, *state.mu, *state.nu, *state.count]


def _clone(params: list, state: sofx.AdamState) -> tuple[list, sofx.AdamState]:
    return [p.clone() for p in params], sofx.AdamState(*([t.clone() for t in part] for part in state))


def _spiked(gen: torch.Generator, where: list[tuple[int, int]], size: float = 1000.0) -> list[torch.Tensor]:
    grads = [torch.randn(n, generator=gen) for n in SIZES]
    for leaf, i in where:
        grads[leaf][i] = size
    return grads


def _full_snapshot(leaf: int) -> int:
    return 3 * 4 * SIZES[leaf]  # p, m, v in float32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("donate", [False, True])
def test_a_step_that_finds_it_needs_a_snapshot_beyond_the_limit_is_taken_back(backend: str, donate: bool) -> None:
    """A 1000x spike in the first leaf's last chunk: its record would be a snapshot (p, m, v) of that chunk
    where the kernel checks the step (cpu: 300 elements and the chunk's index), of the leaf where a pass before
    it finds the spike (reference). With a limit below it the update raises and leaves params, moments and counts
    as they were (bitwise where the test found the need: the whole leaf without donation; within 1e-6 of the
    tensor where a donated step was inverted), and the parameter copies hold the old parameters; with the limit it
    needs, the update is the unlimited one bit for bit."""
    gen = torch.Generator().manual_seed(1)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    params, state = _warm(opt, gen)
    grads = _spiked(gen, [(0, 2 * FINITE_CHUNK + 17)])
    expected = opt.update(*_clone(params, state)[:1], grads, _clone(params, state)[1])
    in_step = backend == "cpu"  # the reference tests before the step: nothing is computed
    assert expected[2].strategies() == ["chunk_snapshot" if in_step else "snapshot", "algebraic"]
    need = expected[2].snapshot_bytes()
    assert need == (3 * 4 * (SIZES[0] - 2 * FINITE_CHUNK) + 8 if in_step else _full_snapshot(0))

    before = [t.clone() for t in _tensors(params, state)]
    copies = [torch.full((n,), 7.0, dtype=torch.bfloat16) for n in SIZES]
    with pytest.raises(sofx.SnapshotLimitError, match=r"params\[0\]|nothing was changed") as info:
        opt.update(params, grads, state, donate=donate, param_copies=copies, snapshot_limit_bytes=need - 1)
    assert (info.value.needed, info.value.limit) == (need, need - 1)
    for k, (a, b) in enumerate(zip(_tensors(params, state), before)):
        if donate and in_step and k not in (0, 2, 4) and a.dtype != torch.int64:
            err = float((a.double() - b.double()).abs().max() / b.double().abs().max())
            assert err <= 1e-6, (k, err)  # the second leaf, stepped and inverted in place
        elif donate and in_step and k in (0, 2, 4):
            # the first leaf: its flagged chunk is bitwise, the two chunks before it inverted
            tail = slice(2 * FINITE_CHUNK, None)
            assert torch.equal(a[tail], b[tail]), k
            assert float((a - b).abs().max() / b.abs().max()) <= 1e-6, k
        else:
            assert torch.equal(a, b), k
    for c, p in zip(copies, params):
        if in_step:
            assert torch.equal(c, p.to(torch.bfloat16))  # written by the step, then given the old parameters
        else:
            assert bool((c == 7.0).all())  # refused before the step: untouched

    fresh_p, fresh_s = _clone(*(expected[0], expected[1]))
    got = opt.update(params, grads, state, snapshot_limit_bytes=need)
    ref = opt.update(params, grads, state)
    for a, b in zip(_tensors(got[0], got[1]), _tensors(ref[0], ref[1])):
        assert torch.equal(a, b)
    assert got[2].snapshot_bytes() == need and fresh_p is not None and fresh_s is not None


def test_a_snapshot_planned_before_the_step_is_refused_before_anything_is_computed() -> None:
    """A beta1 of 0 has no algebraic inverse: the record of every leaf is a snapshot, known before the step.
    A limit below it raises before anything is written, donated or not (bitwise, copies untouched)."""
    gen = torch.Generator().manual_seed(2)
    opt = sofx.adamw(lr=1e-2, betas=(0.0, 0.999))
    params, state = _warm(opt, gen, steps=3)
    grads = [torch.randn(n, generator=gen) for n in SIZES]
    before = [t.clone() for t in _tensors(params, state)]
    copies = [torch.full((n,), 7.0) for n in SIZES]
    need = _full_snapshot(0) + _full_snapshot(1)
    with pytest.raises(sofx.SnapshotLimitError, match="nothing was changed") as info:
        opt.update(params, grads, state, donate=True, param_copies=copies, snapshot_limit_bytes=need - 1)
    assert info.value.needed == need
    assert all(torch.equal(a, b) for a, b in zip(_tensors(params, state), before))
    assert all(bool((c == 7.0).all()) for c in copies)
    _, _, rec = opt.update(params, grads, state, snapshot_limit_bytes=need)
    assert rec.snapshot_bytes() == need


def test_a_numpy_or_tensor_limit_is_its_int() -> None:
    """snapshot_limit_bytes=np.int64(need) was refused as "expected None or an integer >= 0"; it is read as the
    int, the limit it gives is that int's (one byte less refuses the step)."""
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(2)
    opt = sofx.adamw(lr=1e-2, betas=(0.0, 0.999))  # every record a snapshot: its size known before the step
    params, state = _warm(opt, gen, steps=3)
    grads = [torch.randn(n, generator=gen) for n in SIZES]
    need = _full_snapshot(0) + _full_snapshot(1)
    for count in (np.int64, lambda x: torch.tensor([x])):
        _, _, rec = opt.update(params, grads, state, snapshot_limit_bytes=count(need))
        assert rec.snapshot_bytes() == need
        with pytest.raises(sofx.SnapshotLimitError, match="nothing was changed"):
            opt.update(params, grads, state, snapshot_limit_bytes=count(need - 1))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0"])
def test_a_bad_limit_is_refused(bad) -> None:
    opt = sofx.adamw()
    p = [torch.randn(5)]
    with pytest.raises(UnsupportedError, match="snapshot_limit_bytes"):
        opt.update(p, [torch.randn(5)], opt.init(p), snapshot_limit_bytes=bad)


def test_the_error_survives_pickling() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(sofx.SnapshotLimitError("too much", 10, 3)))
    assert isinstance(err, SofxError) and str(err) == "too much" and (err.needed, err.limit) == (10, 3)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(backend=st.sampled_from(BACKENDS), donate=st.booleans(), seed=st.integers(0, 2 ** 16),
       spikes=st.lists(st.tuples(st.integers(0, 1), st.integers(0, SIZES[0] - 1), st.sampled_from([30.0, 1e3, 1e5])),
                       max_size=3),
       limit=st.sampled_from([0, _full_snapshot(1), _full_snapshot(0), _full_snapshot(0) + _full_snapshot(1), None]))
def test_the_record_never_holds_more_than_the_limit(backend, donate, seed, spikes, limit) -> None:
    """Whatever the spikes: the update either returns a record within the limit, equal bit for bit to the
    unlimited update, or raises having changed nothing (within 1e-6 where a donated step was inverted)."""
    gen = torch.Generator().manual_seed(seed)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    params, state = _warm(opt, gen, steps=20)
    grads = [torch.randn(n, generator=gen) for n in SIZES]
    for leaf, i, size in spikes:
        grads[leaf][i % SIZES[leaf]] = size
    ref = opt.update(params, grads, state)
    before = [t.clone() for t in _tensors(params, state)]
    try:
        got = opt.update(params, grads, state, donate=donate, snapshot_limit_bytes=limit)
    except sofx.SnapshotLimitError as exc:
        assert limit is not None and exc.needed > limit and exc.needed == ref[2].snapshot_bytes()
        for a, b in zip(_tensors(params, state), before):
            if donate and a.dtype != torch.int64:
                assert float((a - b).abs().max() / b.abs().max()) <= 1e-6
            else:
                assert torch.equal(a, b)
        return
    assert limit is None or got[2].snapshot_bytes() <= limit
    assert got[2].strategies() == ref[2].strategies()
    for a, b in zip(_tensors(got[0], got[1]), _tensors(ref[0], ref[1])):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------- speculation
def test_on_speculation_refused_makes_the_block_a_budget_decision() -> None:
    opt = sofx.adamw(betas=(0.0, 0.999))
    scaler = loss_scale.grad_scaler()
    config = sp.SpeculationConfig(snapshot_budget_bytes=100)
    ctx, tally = sp.begin_step(opt, config, scaler, scaler.init(), None, n_blocks=2)
    tally, d = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "snapshot", "beta1 = 0", 60))
    assert d.speculate and d.snapshot_bytes == 60 and d.snapshot_budget_bytes == 100 and tally.snapshot_bytes == 60
    tally = sp.on_speculation_refused(ctx, tally, 1, "the step found more")
    d = tally.decisions[1]
    assert not d.speculate and d.kind == "refused" and "taken back as it ran: the step found more" in d.reason
    assert tally.snapshot_bytes == 0
    with pytest.raises(SofxError, match="not speculated"):
        sp.on_speculation_refused(ctx, tally, 1, "again")
    with pytest.raises(SofxError, match="not speculated"):
        sp.on_speculation_refused(ctx, tally, 0, "never ready")
    plan = sp.plan_validation(ctx, tally, [None, 1.0])
    assert plan.actions[1].kind == "step" and "taken back as it ran" in plan.actions[1].reason
    assert plan.report.refused == 1 and plan.report.ineligible == 0 and plan.report.speculated == 0
    assert "refused 1" in plan.report.summary()


@pytest.mark.parametrize("donate", [False, True])
def test_speculative_step_stays_within_the_budget_and_equals_the_serial_step(donate: bool) -> None:
    """Both leaves spiked: the first to arrive (the second leaf, reverse order) takes the budget with its
    snapshot; the other's step finds it needs one too, is taken back and stepped in validation. The result is
    serial_step's (bitwise without donation; the refused leaf within 1e-6 with it)."""
    gen = torch.Generator().manual_seed(3)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1)
    params, state = _warm(opt, gen)
    grads = _spiked(gen, [(0, 5), (1, 600)])
    scaler = loss_scale.grad_scaler(init_scale=1.0)  # the gradients as they are
    config = sp.SpeculationConfig(snapshot_budget_bytes=_full_snapshot(1))
    ser = serial_step(opt, params, grads, state, scaler=scaler, scaler_state=scaler.init())
    spec = sp.speculative_step(opt, *_clone(params, state)[:1], grads, _clone(params, state)[1], config=config,
                               scaler=scaler, scaler_state=scaler.init(), donate=donate)
    r = spec.report
    assert r.speculated == 1 and r.committed == 1 and r.refused == 1 and r.ineligible == 0 and r.stepped_late == 1
    d = spec.plan.actions[0]
    assert d.kind == "step" and "taken back as it ran" in d.reason and "snapshot_limit_bytes" in d.reason
    for k, (a, b) in enumerate(zip(_tensors(spec.params, spec.state), _tensors(ser.params, ser.state))):
        if donate and k in (0, 2, 4):
            assert float((a - b).abs().max() / b.abs().max()) <= 1e-6, k
        else:
            assert torch.equal(a, b), k
    # without a budget both are speculated (and hold 2 snapshots)
    spec = sp.speculative_step(opt, params, grads, state, config=sp.SpeculationConfig(), scaler=scaler,
                               scaler_state=scaler.init())
    assert spec.report.speculated == 2


# ---------------------------------------------------------------------------------------------- engine
@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_the_engine_keeps_its_budget_when_a_spike_needs_snapshots(executor: str) -> None:
    """Two blocks of one layer each, a budget of one block's snapshot, both gradients spiked 1000x at steps
    12 and 15 (no clipping): the block that arrives first keeps a snapshot, the other's speculative step is
    taken back ("refused") and stepped in validation. The run equals torch.optim.AdamW within DESIGN.md's
    1e-6 at every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    ref = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    ref.load_state_dict(model.state_dict())
    block = 16 * 16 + 16
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    spiked_steps = (12, 15)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=block,
                                       snapshot_budget_bytes=3 * 4 * block) as opt:
        for step in range(18):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
            hooks = [(p, lambda g: g * 1000.0) for m in (model, ref) for p in m.parameters()] \
                if step in spiked_steps else []
            report = mse_step_side_by_side(opt, ropt, model, ref, x, y, hooks)
            assert relative_deviation(model, ref) <= TOL, step
            if step in spiked_steps:
                refused = [b for what, b in report.events if what == "refused"]
                speculated = [b for what, b in report.events if what == "speculated"]
                assert refused == [0] and speculated == [1], report.events
                assert report.refused == 1 and report.committed == 1 and report.stepped_late == 1
                assert report.actions == ("step", "commit")


def test_a_refused_block_frees_its_share_of_the_budget_for_the_blocks_after_it() -> None:
    """Decoupled decay with lr*wd near 1: every block's undo keeps its parameters (a param_snapshot); the
    budget holds two blocks' worth. At a spike in the last two layers their speculative steps (the first
    to arrive) find they need whole snapshots and are taken back; the first layer's block then still fits,
    and is speculated (the refused blocks' planned bytes are released as the refusals arrive)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    block = 16 * 16 + 16
    gen = torch.Generator().manual_seed(1)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=0.5, weight_decay=1.5, executor="inline",
                                       block_numel=block, snapshot_budget_bytes=2 * 4 * block) as opt:
        for step in range(12):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
            handles = []
            if step == 11:
                handles = [p.register_hook(lambda g: g * 1000.0) for p in list(model.parameters())[2:]]
            opt.zero_grad()
            opt.backward(((model(x) - y) ** 2).mean())
            report = opt.step()
            for h in handles:
                h.remove()
            if step == 10:  # two blocks' parameter snapshots fit; the third (first layer) does not
                assert report.speculated == 2 and report.ineligible == 1, report.summary()
        refused = [b for what, b in report.events if what == "refused"]
        speculated = [b for what, b in report.events if what == "speculated"]
        assert refused == [2, 1] and speculated == [0], report.events
        assert report.refused == 2 and report.committed == 1 and report.ineligible == 0


def test_the_thread_executor_refuses_nothing_when_the_budget_holds_every_snapshot() -> None:
    """undo="exact": every speculative step keeps a snapshot. With a budget of exactly all of them, no block
    is refused or ineligible, also where step() helps the worker run two speculative steps at once (each
    reserves what its block could keep, not all that is left)."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(6)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())])
    block = 64 * 64 + 64
    gen = torch.Generator().manual_seed(2)
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-3, executor="thread", block_numel=block,
                                       undo="exact", snapshot_budget_bytes=6 * 3 * 4 * block) as opt:
        for _ in range(6):
            x = torch.randn(32, 64, generator=gen)
            opt.zero_grad()
            opt.backward((model(x) ** 2).mean())
            report = opt.step()
            assert report.refused == 0 and report.ineligible == 0, report.events


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_a_block_undone_for_a_late_gradient_frees_its_share_of_the_budget(executor: str) -> None:
    """undo="exact", a budget of one block's snapshot, three backward passes in one step: the first makes
    block 0 ready (speculated, its snapshot held), the second gives it a late gradient (the engine undoes
    its step at once, to sum in place: the snapshot is freed), the third makes block 1 ready. Block 1 is
    speculated in the budget block 0 freed (it was "budget": the tally still counted block 0's snapshot);
    block 0 is redone in validation. The same values as torch's AdamW on the summed gradients."""
    torch.manual_seed(0)
    a, b = nn.Linear(16, 16), nn.Linear(16, 16)
    ref = [copy.deepcopy(a), copy.deepcopy(b)]
    ropt = torch.optim.AdamW([p for m in ref for p in m.parameters()], lr=1e-2)
    block = 16 * 16 + 16
    gen = torch.Generator().manual_seed(3)
    with sofx.offload.SpeculativeAdamW([*a.parameters(), *b.parameters()], lr=1e-2, executor=executor,
                                       block_numel=block, undo="exact", snapshot_budget_bytes=3 * 4 * block) as opt:
        for _ in range(3):
            xs = [torch.randn(8, 16, generator=gen) for _ in range(3)]
            opt.zero_grad()
            for layer, x in zip((a, a, b), xs):
                opt.backward(layer(x).square().mean())
            report = opt.step()
            ropt.zero_grad()
            for layer, x in zip((ref[0], ref[0], ref[1]), xs):
                layer(x).square().mean().backward()
            ropt.step()
            kinds = [w for w, blk in report.events if blk == 1 and w in ("speculate", "speculated")]
            assert ("undo_now", 0) in report.events and kinds, report.events
            assert report.speculated == 2 and report.redone == 1 and report.committed == 1, report.summary()
        assert max(relative_deviation(m, r) for m, r in zip((a, b), ref)) <= TOL


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_an_l2_block_kept_from_speculating_at_its_first_step_is_speculated_from_its_second(executor: str) -> None:
    """L2 decay (``SpeculativeAdam(weight_decay=...)``), ``undo="auto"``, a snapshot budget of 0 bytes: the first
    step's undo keeps the parameter (``param_snapshot``, see ``sofx.adam.L2_FIRST_STEP_REASON``), which does not
    fit (decision "budget", stepped in validation); from the second step on the inverse is algebraic (no snapshot;
    gradients of one size, so the step's check keeps no chunk), so the block is speculated, with the same hparams,
    grad scale, layout and dtypes as at its first step."""
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(300, generator=gen))
    signs = torch.randn(300, generator=gen).sign()
    with sofx.offload.SpeculativeAdam([w], lr=1e-3, weight_decay=1e-3, executor=executor,
                                      snapshot_budget_bytes=0) as opt:
        for step in range(3):
            opt.zero_grad()
            opt.backward((w * signs).sum())
            report = opt.step()
            if step == 0:
                assert report.speculated == 0 and report.ineligible == 1, report.summary()
            else:
                assert report.speculated == 1 and report.committed == 1 and report.refused == 0, report.summary()


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_a_block_whose_planned_snapshot_shrank_reserves_none_of_it_for_the_blocks_after_it(executor: str) -> None:
    """L2 decay, ``undo="auto"``, two one-parameter blocks, a budget of one parameter snapshot. Step 1: only ``a``
    has a gradient; its first step keeps its parameter (``param_snapshot``, the bytes planned). Step 2: ``a``'s step
    is algebraic (nothing planned, nothing kept: gradients of one size) and arrives first; ``c`` then takes its
    first step (a parameter snapshot planned). ``a`` held only what it planned, so its next decision reserves
    nothing of it: ``c`` is speculated too, with an executor that runs ``a``'s step meanwhile as well (its
    report of what it holds comes after ``c``'s decision there), rather than decided "budget"."""
    gen = torch.Generator().manual_seed(0)
    n = 300
    c, a = (nn.Parameter(torch.randn(n, generator=gen)) for _ in range(2))
    signs = torch.randn(n, generator=gen).sign()
    with sofx.offload.SpeculativeAdam([c, a], lr=1e-3, weight_decay=1e-3, executor=executor, block_numel=n,
                                      snapshot_budget_bytes=4 * n) as opt:
        for step in range(3):
            opt.zero_grad()
            first = (c * signs).sum() if step else 0.0  # made first: its gradient comes last
            opt.backward(first + (a * signs).sum())
            report = opt.step()
            assert report.speculated == 1 + (step > 0) and report.committed == report.speculated, report.summary()
            assert report.ineligible == 0 and report.refused == 0, (report.summary(), report.events)


def test_snapshot_needs_reserve_only_what_a_step_held_beyond_its_plan() -> None:
    """What a speculative step held beyond the bytes its strategy planned is learnt, and offered on top of the
    next plan where both fit: a plan that shrank (an L2 first step's parameter snapshot, then algebraic steps)
    is not reserved at its old size; chunks kept beyond the plan (sofx.skipped_chunks) are, at every plan."""
    from sofx.offload.snapshot_needs import SnapshotNeeds

    def decision(held: int):
        return sp.BlockDecision(0, True, "speculate", "", None, 1.0, "param_snapshot", held, 1000)

    needs = SnapshotNeeds(1)
    needs.after_step([decision(400)], {}, planned={0: 400})  # held what it planned
    assert needs.need(0, 0, 1000) == (0, "") and needs.need(0, 400, 1000) == (400, "")
    needs.after_step([decision(700)], {}, planned={0: 400})  # 300 bytes of chunks kept beyond the plan
    nbytes, why = needs.need(0, 0, 1000)
    assert nbytes == 300 and "300 bytes of snapshot beyond" in why
    assert needs.need(0, 100, 1000)[0] == 400 and needs.need(0, 100, 399) == (100, "")
    needs.after_step([decision(50)], {}, planned={0: 400})  # less than planned: nothing beyond
    assert needs.need(0, 0, 1000) == (0, "")


def test_snapshot_needs_hold_back_a_refused_block_only_for_what_it_needed_beyond_its_plan() -> None:
    """A refused step's need beyond its plan is what keeps the block waiting ("budget") while it does not fit on
    top of the next plan: one whose plan shrank since (an L2 first step's parameter snapshot, then algebraic
    steps) is speculated where its plan now and that excess fit, not held back for the bytes it no longer plans."""
    from sofx.offload.snapshot_needs import SnapshotNeeds

    def decision(kind: str):
        return sp.BlockDecision(0, kind == "speculate", kind, "", None, 1.0, "param_snapshot", 0, 1000)

    needs = SnapshotNeeds(1)
    needs.after_step([decision("refused")], {0: 700}, planned={0: 400})  # 300 bytes of chunks beyond its plan
    nbytes, why = needs.need(0, 0, 400)
    assert nbytes == 300 and "300 bytes of snapshot beyond" in why and "taken back" in why
    assert needs.need(0, 200, 400)[0] == 500  # too much for what is left: decided "budget" on it
    needs.after_step([decision("budget")], {})
    assert needs.need(0, 0, 400) == (0, "")  # its wait is over
    needs.after_step([decision("refused")], {0: 400}, planned={0: 400})  # nothing beyond its plan
    assert needs.need(0, 0, 400) == (0, "")


def test_on_speculation_held_counts_what_the_step_holds() -> None:
    opt = sofx.adamw()
    scaler = loss_scale.grad_scaler()
    config = sp.SpeculationConfig(snapshot_budget_bytes=100)
    ctx, tally = sp.begin_step(opt, config, scaler, scaler.init(), None, n_blocks=3)
    tally, d = sp.on_block_ready(ctx, tally, 2, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    assert d.speculate and tally.snapshot_bytes == 0
    tally = sp.on_speculation_held(ctx, tally, 2, 70)  # the step kept chunks
    assert tally.snapshot_bytes == 70 and tally.decisions[2].snapshot_bytes == 70
    tally, d = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "snapshot", "beta1 = 0", 40))
    assert not d.speculate and d.kind == "budget" and "30 of the budget" in d.reason
    with pytest.raises(SofxError, match="not speculated"):
        sp.on_speculation_held(ctx, tally, 1, 10)
    for bad in (-1, 1.5, True):
        with pytest.raises(SofxError, match="snapshot_bytes"):
            sp.on_speculation_held(ctx, tally, 2, bad)
    np = pytest.importorskip("numpy")  # a numpy block index and byte count were refused
    held = sp.on_speculation_held(ctx, tally, np.int64(2), np.int64(60))
    assert held.snapshot_bytes == 60 and type(held.decisions[2].snapshot_bytes) is int
    tally = sp.on_speculation_refused(ctx, tally, 2, "gone")  # what it held is free again
    assert tally.snapshot_bytes == 0


def test_a_budget_decision_after_reserved_and_held_bytes_past_the_budget_names_none_left() -> None:
    """A block's planned bytes are reserved as it is decided; what an earlier block's step held is learnt later
    (the engine's thread executor reports it after the next block's decision): reserved and held together may pass
    the budget for a while (the later step is then taken back). A block decided meanwhile read "-40 of the budget
    of 100 bytes are left"; it says none is left, and what the steps so far hold or reserve."""
    opt = sofx.adamw()
    scaler = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(snapshot_budget_bytes=100), scaler, scaler.init(), None,
                               n_blocks=3)
    tally, _ = sp.on_block_ready(ctx, tally, 2, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    tally, _ = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "snapshot", "exact", 80))
    tally = sp.on_speculation_held(ctx, tally, 2, 60)  # (block 2's step kept chunks: 140 held or reserved)
    tally, d = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "snapshot", "exact", 10))
    assert d.kind == "budget" and "-" not in d.reason.split("bytes of snapshot")[1], d.reason
    assert "none of the budget of 100 bytes is left" in d.reason and "140" in d.reason, d.reason


def test_on_speculation_held_refuses_more_than_the_budget() -> None:
    """A speculative step keeps at most the budget (speculative_block_step's snapshot_limit_bytes): a count beyond
    it is not a step's, and was taken, the blocks after it all decided "budget" with a negative "left"."""
    opt = sofx.adamw()
    scaler = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(snapshot_budget_bytes=100), scaler, scaler.init(), None,
                               n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "algebraic", "", 0))
    with pytest.raises(SofxError, match=r"block 1's step holds 101 bytes .*snapshot_budget_bytes of 100"):
        sp.on_speculation_held(ctx, tally, 1, 101)
    assert sp.on_speculation_held(ctx, tally, 1, 100).snapshot_bytes == 100  # (the whole budget: taken)
    unlimited, tally = sp.begin_step(opt, sp.SpeculationConfig(), scaler, scaler.init(), None, n_blocks=1)
    tally, _ = sp.on_block_ready(unlimited, tally, 0, 1.0, sp.Eligibility(True, "snapshot", "exact", 10))
    assert sp.on_speculation_held(unlimited, tally, 0, 10**12).snapshot_bytes == 10**12  # (no budget: any count)


def test_on_late_gradient_undone_releases_the_blocks_snapshot_once() -> None:
    opt = sofx.adamw()
    scaler = loss_scale.grad_scaler()
    ctx, tally = sp.begin_step(opt, sp.SpeculationConfig(snapshot_budget_bytes=100), scaler, scaler.init(), None,
                               n_blocks=2)
    tally, _ = sp.on_block_ready(ctx, tally, 0, 1.0, sp.Eligibility(True, "snapshot", "exact", 60))
    assert sp.on_late_gradient(ctx, tally, 0, 2.0).snapshot_bytes == 60  # summed out of place: still held
    tally = sp.on_late_gradient(ctx, tally, 0, 2.0, undone=True)
    assert tally.snapshot_bytes == 0 and tally.decisions[0].snapshot_bytes == 60  # what the step held
    assert sp.on_late_gradient(ctx, tally, 0, 3.0, undone=True).snapshot_bytes == 0  # released once
    tally, d = sp.on_block_ready(ctx, tally, 1, 1.0, sp.Eligibility(True, "snapshot", "exact", 60))
    assert d.speculate and tally.snapshot_bytes == 60


def test_snapshot_needs_reserve_what_was_held_and_wait_longer_after_each_refusal() -> None:
    from sofx.offload.snapshot_needs import MAX_WAIT, SnapshotNeeds

    def decision(kind: str, held: int = 0):
        return sp.BlockDecision(0, kind == "speculate", kind, "", None, 1.0, "algebraic", held, 0)

    needs = SnapshotNeeds(2)
    assert needs.need(0, 0, 100) == (0, "")
    # held: reserved where it fits, else the block is decided on its planned bytes
    needs.after_step([decision("speculate", 60), None], {})
    assert needs.need(0, 0, 100)[0] == 60 and "held 60" in needs.need(0, 0, 100)[1]
    assert needs.need(0, 0, 50) == (0, "") and needs.need(0, 80, 100) == (80, "") and needs.need(0, 0, None) == (0, "")
    assert needs.need(1, 0, 100) == (0, "")

    def refused_need() -> int | None:
        nbytes, why = needs.need(0, 0, 10)
        return nbytes if "taken back" in why else None

    waits = []
    for _ in range(6):  # refused at every try: waits of 1, 2, 4, 8, 16, 16 decisions
        needs.after_step([decision("refused"), None], {0: 500})
        n = 0
        while refused_need() is not None:
            assert refused_need() == 500
            needs.after_step([decision("budget"), None], {})
            n += 1
        waits.append(n)
    assert waits == [1, 2, 4, 8, MAX_WAIT, MAX_WAIT]
    # each time it fits, the wait of its next refusal halves: one fit between refusals keeps it (blocks taking
    # turns at one budget), a few in a row forget it
    for fits in (1, 2, 3):
        before = needs._refused[0].backoff
        for _ in range(fits):
            needs.after_step([decision("speculate"), None], {})
            assert refused_need() is None
        needs.after_step([decision("refused"), None], {0: 7})
        assert needs._refused[0].wait == min(MAX_WAIT, 2 * (before >> fits)) and refused_need() == 7
        while refused_need() is not None:
            needs.after_step([decision("budget"), None], {})
    for _ in range(4):
        needs.after_step([decision("speculate"), None], {})
    assert needs._refused[0] is None
    needs.after_step([decision("refused"), None], {0: 9})
    needs.forget()
    assert needs.need(0, 0, 100) == (0, "")
