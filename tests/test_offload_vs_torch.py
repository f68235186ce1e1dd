"""The facade's trajectory equals torch.optim + clip_grad_norm_ + GradScaler, for every executor.

Each run: 50 steps on fresh random batches, a LambdaLR schedule, two param
groups, 2 micro-steps of gradient accumulation, forced clipping steps (blocks
speculated before the clip is known are undone and redone), injected inf
gradients (overflow: skipped step, scale backoff), a shared/tied parameter and
a frozen one, a dynamic loss scale that grows every 4 clean steps. Tolerance:
DESIGN.md's float32 rounding, 1e-6 relative, with no drift over the run.

The spike tests (at the end) run parameters of 3000-20000 elements, blocks of
several FINITE_CHUNK chunks, whose gradients spike (whole snapshots, chunk
snapshots, an inf or nan in one chunk) before the late events of
SPECULATION.md's outcomes table, with every step speculating; each step is
bitwise torch's until something is undone or clipped, within 1e-6 after, and
its report is checked against the table and the early veto.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from test_offload_support import one_torch_thread, run_side_by_side, tensor_deviation  # noqa: F401 (autouse fixture)

import sofx.offload
import sofx.offload.block_runner
import sofx.offload.engine
from sofx.loss_scale import grad_scaler
from sofx.speculate import AdaptivePolicy

TOL = 1e-6


def _check_events(r) -> None:
    reports = r.reports
    assert [rep.skipped for rep in reports] == r.ref_skipped
    assert [rep.scale for rep in reports] == r.ref_scales
    assert sum(rep.skipped for rep in reports) >= len(reports) // 11  # one inf injection every 11 steps
    # a forced clip every 7 steps (one may overflow)
    assert sum(rep.clipped for rep in reports) >= len(reports) // 7 - 1
    assert sum(rep.redone for rep in reports) > 0, "forced clipping must undo and redo speculated blocks"
    assert sum(rep.committed for rep in reports) > sum(rep.undone for rep in reports)
    assert len(set(rep.scale for rep in reports)) >= 2, "the loss scale must move"


@pytest.mark.parametrize("executor", ["inline", "thread", "process", "thread-borrowing"])
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_trajectory_equals_torch_optim(model: str, executor: str, monkeypatch) -> None:
    """(``thread-borrowing``: the thread executor borrowing every gradient, as it does those of large
    parameters; these small ones it copies, see ``BORROW_MIN_NUMEL``.)"""
    if executor == "thread-borrowing":
        monkeypatch.setattr(sofx.offload.engine, "BORROW_MIN_NUMEL", 0)
        executor = "thread"
    r = run_side_by_side(model, executor, steps=50)
    assert r.executor == executor
    _check_events(r)
    worst = max(r.deviations)
    assert worst <= TOL, f"max relative deviation {worst:.3g} over 50 steps (per step: {r.deviations})"


def test_speculative_adam_l2_equals_torch_adam() -> None:
    r = run_side_by_side("mlp", "thread", steps=30, make_opt=sofx.offload.SpeculativeAdam, ref_cls=torch.optim.Adam)
    _check_events(r)
    assert max(r.deviations) <= TOL


def test_without_loss_scaling_or_clipping_is_bitwise_where_nothing_is_undone() -> None:
    """No clip, no overflow: every step commits; with the reference kernel the run is torch's, bit for bit."""
    r = run_side_by_side("transformer", "thread", steps=20, clip_every=0, inf_every=0, max_norm=1e9,
                         opt_kwargs={"loss_scale": None, "backend": "reference"})
    assert all(rep.undone == 0 and rep.committed > 0 for rep in r.reports)
    assert max(r.deviations) == 0.0


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_parameters_of_one_block_keep_their_own_step_counts(executor: str) -> None:
    """Two parameters in one block, the second without a gradient on the first step: each is bias-corrected
    with its own count, as torch.optim's (the process executor's flat block path once took one count for
    all)."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    ta, tb = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    topt = torch.optim.AdamW([ta, tb], lr=1e-2, weight_decay=0.0, foreach=False)
    with sofx.offload.SpeculativeAdamW([a, b], lr=1e-2, weight_decay=0.0, executor=executor,
                                       block_numel=1024) as opt:
        for step in range(4):
            x = torch.randn(8)
            opt.zero_grad()
            topt.zero_grad()
            opt.backward((a * x).sum() ** 2 + ((b * x).sum() ** 2 if step else 0))
            ((ta * x).sum() ** 2 + ((tb * x).sum() ** 2 if step else 0)).backward()
            opt.step()
            topt.step()
            for p, t in ((a, ta), (b, tb)):
                torch.testing.assert_close(p.detach(), t.detach(), rtol=TOL, atol=0)
                assert int(opt.state[p]["step"]) == int(topt.state[t].get("step", 0))



@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_speculated_gradient_spike_undone_for_an_overflow_equals_torch(executor: str) -> None:
    """A spike (1000x) in the gradient of a block speculated with it (the last layer's, the first to arrive),
    no clipping, at step 38, where an inf arrives later in the same backward: the spiked step is undone
    (overflow) and skipped, as torch's GradScaler skips it. Its algebraic inverse would be lossy (the spike
    dominates the second moment); undo='auto' keeps a snapshot of it instead
    (sofx.kernels.base.lossy_elements), so the run stays within DESIGN.md's 1e-6."""
    r = run_side_by_side("mlp", executor, steps=41, boost_at=-1, boost=1000.0, boost_when=lambda step: step == 38,
                         inf_every=11, max_norm=1e9)
    assert r.reports[38].skipped and r.reports[38].undone > 0
    worst = max(r.deviations)
    assert worst <= TOL, f"max relative deviation {worst:.3g} over 41 steps (per step: {r.deviations})"


# ------------------------------------------------------------------ spikes and late events, block by block
# Blocks of several FINITE_CHUNK chunks whose gradients spike: a whole parameter's (every chunk's inverse is
# lossy: the speculative step keeps a whole "snapshot"), a few rows (a "chunk_snapshot"), an inf or nan in
# one chunk (overflow); then the late events of SPECULATION.md's outcomes table (a mild or heavy clip, the
# loss scale moving, an hparam changed between speculation and validation, a second gradient for a block
# already stepped, a parameter without a gradient). Each step is compared with torch.optim.AdamW +
# clip_grad_norm_ + GradScaler (fused=True for backend="cpu_fast", whose step is that one's), and its report
# with what the table says must happen.

ROW = 16  # the elements of a spiked "row"


@dataclass(frozen=True)
class Spike:
    """A change of one parameter's gradient: ``"whole"`` (times ``factor``), ``"rows"`` (the rows of ROW
    elements starting at ``ROW * r`` for ``r`` in ``at``, times ``factor``), ``"inf"`` or ``"nan"`` (at element
    ``at[0]``)."""

    kind: str
    param: int
    factor: float = 1.0
    at: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepEvents:
    """What happens in one step: ``spikes`` in the gradient of micro-step ``spike_micro``, ``missing``
    parameters without a gradient, ``late`` parameters with a further gradient from another backward (with
    ``late_spikes``), ``hparams = (group, key, value)`` set between backward and ``step()``."""

    spikes: tuple[Spike, ...] = ()
    missing: tuple[int, ...] = ()
    late: tuple[int, ...] = ()
    late_spikes: tuple[Spike, ...] = ()
    hparams: tuple[int, str, Any] | None = None
    spike_micro: int = -1


@dataclass(frozen=True)
class SpikeRun:
    """A run: parameters of ``sizes`` elements whose gradients are Gaussian times ``mags``, the first ``cut`` in
    param group 0 (weight decay, lr 1e-3), the rest in group 1 (lr 2e-3); ``max_norm`` (None: no clipping),
    a dynamic loss scale (``loss_scale``) that grows every 3 clean steps, ``accumulate`` micro-steps."""

    sizes: tuple[int, ...]
    mags: tuple[float, ...]
    cut: int
    block_numel: int
    max_norm: float | None
    loss_scale: bool
    backend: str
    steps: tuple[StepEvents, ...]
    accumulate: int = 1
    seed: int = 0


def _spiked(grads: list[torch.Tensor | None], spikes: Sequence[Spike]) -> list[torch.Tensor | None]:
    """``grads`` with ``spikes`` applied (copies of the changed ones)."""
    out = list(grads)
    for s in spikes:
        g = out[s.param]
        if g is None:
            continue
        g = g.clone()
        if s.kind == "whole":
            g *= s.factor
        elif s.kind == "rows":
            for r in s.at:
                g[ROW * r:ROW * (r + 1)] *= s.factor
        else:
            g[s.at[0]] = math.inf if s.kind == "inf" else math.nan
        out[s.param] = g
    return out


def _gradients(run: SpikeRun, step: int, draw: int, present: Sequence[int],
               spikes: Sequence[Spike] = ()) -> list[torch.Tensor | None]:
    """Draw ``draw`` of step ``step``: fresh gradients of the parameters ``present`` (None for the others)."""
    gen = torch.Generator().manual_seed(run.seed * 100_003 + step * 10 + draw)
    grads = [torch.randn(n, generator=gen) * m if j in present else None
             for j, (n, m) in enumerate(zip(run.sizes, run.mags))]
    return _spiked(grads, spikes)


def _loss(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """A loss whose gradient is ``grads`` exactly (None: the parameter is not in it)."""
    terms = [(p * g).sum() for p, g in zip(params, grads) if g is not None]
    return sum(terms[1:], terms[0])


def _backward_both(opt, scaler: torch.amp.GradScaler, params, ref, grads) -> None:
    if any(g is not None for g in grads):
        opt.backward(_loss(params, grads))
        scaler.scale(_loss(ref, grads)).backward()


def _expected_actions(rep, layouts, has_grad: Sequence[bool], changed: set[int]) -> tuple:
    """Each block's validation action as SPECULATION.md's outcomes table says, from what the step reports."""
    speculated = {b for what, b in rep.events if what == "speculate"} - {b for what, b in rep.events
                                                                           if what == "refused"}
    late = {b for what, b in rep.events if what == "late_gradient"}
    out = []
    for layout in layouts:
        b = layout.index
        # a late gradient undid the block's speculative step at once: validation has nothing left to undo
        if rep.overflow:
            out.append("undo" if b in speculated - late else "skip")
        elif b in speculated - late:
            redo = rep.clipped or layout.group in changed
            out.append("undo_redo" if redo else "commit")
        else:
            out.append("step" if has_grad[b] else "skip")
    return tuple(out)


def _check_counts(rep, n_stepped: int) -> None:
    """The report's counts agree with each other (the outcomes table, no snapshot budget)."""
    speculated = sum(what == "speculate" for what, _ in rep.events)
    assert rep.speculated == speculated and rep.refused == 0, rep.summary()
    if rep.overflow:
        assert rep.skipped and rep.undone == rep.speculated, rep.summary()
        assert rep.committed == rep.redone == rep.stepped_late == 0 and rep.not_stepped == rep.blocks, rep.summary()
        return
    assert rep.speculated == rep.committed + rep.undone and rep.undone == rep.redone, rep.summary()
    assert not (rep.clipped and rep.committed), rep.summary()
    assert rep.committed + rep.redone + rep.stepped_late == n_stepped, rep.summary()


def _check_veto(rep, run: SpikeRun, layouts, final: Sequence[torch.Tensor | None], scale: float) -> None:
    """The blocks ready during backward were speculated until the running sum of squares of the raw
    gradients passed ``(max_norm * S)**2`` or met a non-finite one, and vetoed from there on."""
    limit = math.inf if run.max_norm is None else (run.max_norm * scale) ** 2
    running, vetoed, expected = 0.0, False, []
    ready = [b for what, b in rep.events if what == "ready"]
    for b in ready:
        sumsq = sum(final[j].double().square().sum().item() for j in layouts[b].param_indices)
        running += sumsq
        vetoed = vetoed or not math.isfinite(sumsq) or running > limit
        if not vetoed:
            expected.append(b)
    assert [b for what, b in rep.events if what == "speculate"] == expected, (rep.events, expected)
    assert rep.vetoed == len(ready) - len(expected), rep.summary()


def _check_step(rep, run: SpikeRun, layouts, events: StepEvents, changed: set[int],
                final: Sequence[torch.Tensor | None], scale: float) -> None:
    """What the report of one step says against the outcomes table and the early veto."""
    block_of = {j: layout.index for layout in layouts for j in layout.param_indices}
    has_grad = [False] * len(layouts)
    for j in range(len(run.sizes)):
        if j not in events.missing or j in events.late:
            has_grad[block_of[j]] = True
    assert rep.actions == _expected_actions(rep, layouts, has_grad, changed), (rep.summary(), rep.events)
    _check_counts(rep, sum(has_grad))
    late = {b for what, b in rep.events if what == "late_gradient"}
    for layout in layouts:  # a block ready in the first backward, then given another gradient: late
        if (run.accumulate == 1 and any(j in events.late for j in layout.param_indices)
                and not any(j in events.missing for j in layout.param_indices)):
            assert layout.index in late, rep.events
    if not events.late:
        _check_veto(rep, run, layouts, final, scale)


def _torch_step(ropt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, ref: Sequence[nn.Parameter],
                max_norm: float | None) -> None:
    """The plain loop's step: GradScaler's unscale, clip_grad_norm_, GradScaler's step and update."""
    scaler.unscale_(ropt)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in ref if p.grad is not None], max_norm)
    scaler.step(ropt)
    scaler.update()


def _check_params(params: Sequence[nn.Parameter], ref: Sequence[nn.Parameter], bitwise: bool, where: str) -> None:
    """Finite, torch's bit for bit where ``bitwise``, and within TOL of torch's."""
    for j, (p, r) in enumerate(zip(params, ref)):
        assert torch.isfinite(p).all(), f"{where}: parameter {j} is not finite"
        if bitwise:
            assert torch.equal(p.detach(), r.detach()), f"{where}: parameter {j} is not torch's bit for bit"
        dev = tensor_deviation(p, r)
        assert dev <= TOL, f"{where}: parameter {j} deviates by {dev:.3g}"


def _set_hparams(opt, ropt: torch.optim.Optimizer, events: StepEvents) -> set[int]:
    """Set ``events.hparams`` in both optimizers; returns the groups whose hparams changed."""
    if events.hparams is None:
        return set()
    group, key, value = events.hparams
    changed = {group} if opt.param_groups[group][key] != value else set()
    opt.param_groups[group][key] = ropt.param_groups[group][key] = value
    return changed


def _make_optimizers(run: SpikeRun, executor: str, params: list[nn.Parameter], ref: list[nn.Parameter]):
    """``(SpeculativeAdamW speculating on every step, torch's AdamW, torch's GradScaler)`` for ``run``."""
    def groups(ps: list[nn.Parameter]) -> list[dict]:
        return [{"params": ps[:run.cut], "lr": 1e-3, "weight_decay": 0.05},
                {"params": ps[run.cut:], "lr": 2e-3, "weight_decay": 0.0}]

    scaling = dict(init_scale=2.0 ** 8, growth_interval=3)
    opt = sofx.offload.SpeculativeAdamW(
        groups(params), betas=(0.9, 0.99), max_grad_norm=run.max_norm, executor=executor, backend=run.backend,
        loss_scale=grad_scaler(**scaling) if run.loss_scale else None, block_numel=run.block_numel,
        gradient_accumulation_steps=run.accumulate, policy=AdaptivePolicy(enabled=False), timeout=60.0)
    implementation = {"fused": True} if run.backend == "cpu_fast" else {"foreach": False}
    ropt = torch.optim.AdamW(groups(ref), betas=(0.9, 0.99), **implementation)
    return opt, ropt, torch.amp.GradScaler("cpu", enabled=run.loss_scale, **scaling)


def run_spikes_side_by_side(run: SpikeRun, executor: str) -> list:
    """Train ``run`` with ``SpeculativeAdamW`` (``executor``) and with torch, checking every step (see the
    section's comment); returns the step reports."""
    torch.manual_seed(run.seed)
    start = [torch.randn(n) * 0.1 for n in run.sizes]
    params, ref = [nn.Parameter(t.clone()) for t in start], [nn.Parameter(t.clone()) for t in start]
    opt, ropt, scaler = _make_optimizers(run, executor, params, ref)
    assert opt.executor == executor
    # bitwise until something is undone or clipped (cpu_fast: torch's fused step differs in the last n % 16)
    bitwise = run.backend != "cpu_fast" or all(n % 16 == 0 for n in run.sizes)
    reports = []
    with opt:
        for step, events in enumerate(run.steps):
            opt.zero_grad()
            ropt.zero_grad()
            scale = scaler.get_scale() if run.loss_scale else 1.0
            present = [j for j in range(len(run.sizes)) if j not in events.missing]
            final: list[torch.Tensor | None] = [None] * len(run.sizes)  # the raw gradients of the micro-steps
            for micro in range(run.accumulate):
                spikes = events.spikes if micro == events.spike_micro % run.accumulate else ()
                grads = _gradients(run, step, micro, present, spikes)
                final = [f if g is None else g * scale if f is None else f + g * scale for f, g in zip(final, grads)]
                _backward_both(opt, scaler, params, ref, grads)
            if events.late:
                _backward_both(opt, scaler, params, ref, _gradients(run, step, 9, events.late, events.late_spikes))
            changed = _set_hparams(opt, ropt, events)
            rep = opt.step()
            _torch_step(ropt, scaler, ref, run.max_norm)
            where = f"step {step} ({rep.summary()})"
            assert (rep.skipped, rep.scale) == (scaler.get_scale() < scale if run.loss_scale else False, scale), where
            bitwise = bitwise and not (rep.clipped or rep.undone)
            _check_params(params, ref, bitwise, where)
            _check_step(rep, run, opt.engine.layouts, events, changed, final, scale)
            reports.append(rep)
    return reports


# The scripted run: parameter 4 (the first to arrive in backward, its gradients small beside the others')
# spikes at every event step, alone in its block; parameters 0 and 1 share a block.
SIZES = (4112, 3008, 9008, 6000, 16016)
MAGS = (1e-2, 1e-2, 1e-2, 1e-2, 1e-7)
BASE_NORM = math.sqrt(sum(n * m * m for n, m in zip(SIZES, MAGS)))
EVENT_STEPS = {
    # a whole spike (a snapshot) speculated, then a mild clip (parameter 0 five times its usual)
    6: StepEvents(spikes=(Spike("whole", 4, 1e3), Spike("whole", 0, 5.0))),
    # a few rows (a chunk snapshot) speculated, then a heavy clip (parameter 0 10^4 times its usual)
    8: StepEvents(spikes=(Spike("rows", 4, 1e4, (3, 70, 500)), Spike("whole", 0, 1e4))),
    # a few rows speculated, then an inf in one chunk of parameter 0: overflow, undone, skipped
    10: StepEvents(spikes=(Spike("rows", 4, 1e4, (100, 640, 900)), Spike("inf", 0, at=(2100,)))),
    # a whole spike speculated, then group 1's lr changed before step() (a schedule)
    12: StepEvents(spikes=(Spike("whole", 4, 3e4),), hparams=(1, "lr", 1e-3)),
    # a few rows speculated, then a second gradient for that block (backward called twice)
    14: StepEvents(spikes=(Spike("rows", 4, 1e5, (7, 333)),), late=(4,)),
    # a few rows speculated; parameter 3 gets no gradient (its block is skipped)
    16: StepEvents(spikes=(Spike("rows", 4, 1e5, (200, 801)),), missing=(3,)),
    # a few rows speculated and committed
    18: StepEvents(spikes=(Spike("rows", 4, 1e6, (11, 512, 999)),)),
}


def _scripted_run(backend: str) -> SpikeRun:
    return SpikeRun(SIZES, MAGS, cut=2, block_numel=8192, max_norm=1.2 * BASE_NORM, loss_scale=True,
                    backend=backend, steps=tuple(EVENT_STEPS.get(t, StepEvents()) for t in range(20)))


class _Strategies:
    """Records the undo strategies of the speculative steps validation undid (in-process executors)."""

    def __init__(self, monkeypatch) -> None:
        self.undone: list[tuple[str, ...]] = []
        apply = sofx.offload.block_runner.apply_block_action

        def spy(opt, action, param, grad, state, record=None, **kwargs):
            if record is not None and action.kind in ("undo", "undo_redo"):
                self.undone.append(tuple(s for s in record.strategies() if s is not None))
            return apply(opt, action, param, grad, state, record, **kwargs)

        monkeypatch.setattr(sofx.offload.block_runner, "apply_block_action", spy)


@pytest.mark.parametrize("backend", ["auto", "cpu_fast"])
@pytest.mark.parametrize("executor", ["thread", "thread-borrowing", "process"])
def test_gradient_spikes_with_late_events_equal_torch(executor: str, backend: str, monkeypatch) -> None:
    """Spikes in blocks of several FINITE_CHUNK chunks (whole snapshots, chunk snapshots) speculated, then each
    late event in turn, step by step against torch (see the section's comment). (``thread-borrowing``: the
    thread executor borrowing every gradient, its blocks stepped one leaf per parameter.)"""
    if executor == "thread-borrowing":
        monkeypatch.setattr(sofx.offload.engine, "BORROW_MIN_NUMEL", 0)
        executor = "thread"
    strategies = _Strategies(monkeypatch)
    reports = run_spikes_side_by_side(_scripted_run(backend), executor)
    spiked = 3  # parameter 4's block
    action = [rep.actions[spiked] for rep in reports]
    assert reports[6].clipped and 0.3 < reports[6].clip_coef < 0.8 and action[6] == "undo_redo"
    assert reports[8].clipped and reports[8].clip_coef < 1e-3 and action[8] == "undo_redo"
    assert reports[10].skipped and action[10] == "undo"
    assert not reports[12].clipped and action[12] == "undo_redo"
    assert ("late_gradient", spiked) in reports[14].events and action[14] == "step"
    assert reports[16].actions[2] == "skip" and action[16] == "commit"
    assert action[18] == "commit"
    assert len({rep.scale for rep in reports}) >= 3, "the loss scale must grow and back off"
    if executor == "thread":
        assert ("snapshot",) in strategies.undone and ("chunk_snapshot",) in strategies.undone, strategies.undone


@st.composite
def _spikes(draw, sizes: Sequence[int], params: Sequence[int], overflow: bool) -> tuple[Spike, ...]:
    """Up to two spikes of parameters ``params`` (inf and nan only where ``overflow``)."""
    out = []
    for _ in range(draw(st.integers(0, 2)) if params else 0):
        j = draw(st.sampled_from(params))
        kind = draw(st.sampled_from(["whole", "rows", "inf", "nan"] if overflow else ["whole", "rows"]))
        factor = draw(st.sampled_from([10.0, 1e2, 1e3, 1e4]))
        if kind == "whole":
            out.append(Spike(kind, j, factor))
        elif kind == "rows":
            rows = draw(st.lists(st.integers(0, sizes[j] // ROW - 1), min_size=1, max_size=4, unique=True))
            out.append(Spike(kind, j, factor, tuple(rows)))
        else:
            out.append(Spike(kind, j, at=(draw(st.integers(0, sizes[j] - 1)),)))
    return tuple(out)


@st.composite
def _step_events(draw, sizes: Sequence[int], overflow: bool) -> StepEvents:
    """One step's spikes and late events."""
    n = len(sizes)
    everyone = list(range(n))
    missing = draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True))  # (n >= 3: one has a gradient)
    late = draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True) | st.just([]))
    key = draw(st.sampled_from(["lr", "betas", "weight_decay", "eps"]))
    value = draw({"lr": st.sampled_from([5e-4, 1e-3, 4e-3]), "betas": st.sampled_from([(0.9, 0.99), (0.8, 0.995)]),
                  "weight_decay": st.sampled_from([0.0, 0.1]), "eps": st.sampled_from([1e-8, 1e-6])}[key])
    return StepEvents(draw(_spikes(sizes, everyone, overflow)), tuple(missing), tuple(sorted(late)),
                      draw(_spikes(sizes, sorted(late), overflow)),
                      draw(st.none() | st.just((draw(st.integers(0, 1)), key, value))),
                      draw(st.sampled_from([-1, 0])))


@st.composite
def _spike_runs(draw) -> SpikeRun:
    """Runs of 3-5 parameters of 3000-20000 elements in 2-5 blocks, a few plain steps, then steps with
    spikes and late events; clipping none, mild on every step, or only where a spike makes the norm grow."""
    sizes = tuple(draw(st.lists(st.integers(3000, 20000), min_size=3, max_size=5)))
    mags = tuple(draw(st.lists(st.sampled_from([1e-7, 1e-3, 1e-2]), min_size=len(sizes), max_size=len(sizes))))
    base = math.sqrt(sum(n * m * m for n, m in zip(sizes, mags)))
    max_norm = draw(st.sampled_from([None, 0.5, 1.5]))
    loss_scale = draw(st.booleans())
    warm = draw(st.integers(0, 4))
    events = draw(st.lists(_step_events(sizes, loss_scale), min_size=3, max_size=6))
    return SpikeRun(sizes, mags, cut=draw(st.integers(1, len(sizes) - 1)),
                    block_numel=draw(st.sampled_from([min(sizes), max(sizes), sum(sizes) // 3])),
                    max_norm=None if max_norm is None else max_norm * base, loss_scale=loss_scale,
                    backend=draw(st.sampled_from(["auto", "cpu_fast"])), steps=(StepEvents(),) * warm + tuple(events),
                    accumulate=draw(st.sampled_from([1, 1, 2])), seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=_spike_runs())
def test_spikes_and_late_events_equal_torch_thread(run: SpikeRun) -> None:
    run_spikes_side_by_side(run, "thread")


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=_spike_runs())
def test_spikes_and_late_events_equal_torch_process(run: SpikeRun) -> None:
    """(Few examples: each starts a worker process.)"""
    run_spikes_side_by_side(run, "process")


@pytest.mark.parametrize("max_norm", [0.0, math.inf])
def test_max_grad_norm_0_or_inf_equals_torch_bitwise(max_norm: float) -> None:
    """max_grad_norm=0 (clip_grad_norm_ zeroes every gradient; the parameters move through momentum and weight
    decay) and inf (nothing clipped) were refused; with the reference kernel the run, overflows included, is
    torch's bit for bit: 0 speculates nothing (every step is clipped), inf commits every speculated block."""
    r = run_side_by_side("mlp", "thread", steps=14, clip_every=0, inf_every=11, max_norm=max_norm,
                         opt_kwargs={"backend": "reference"})
    assert sum(rep.skipped for rep in r.reports) == 1 and max(r.deviations) == 0.0
    for rep in r.reports:
        if not rep.skipped:
            assert rep.clipped == (max_norm == 0.0) and rep.undone == 0
            assert rep.speculated == (0 if max_norm == 0.0 else rep.committed)


# ------------------------------------------------------------------ a CNN trained as torch.optim users train it
class _ChannelsLastCNN(nn.Module):
    """Convolutions in channels_last (the second without a bias), a layer used on some steps only, a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 8, 3, padding=1, bias=False)
        self.head = nn.Linear(8, 5)
        self.sometimes = nn.Linear(5, 5, bias=False)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.use_sometimes = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        out = self.head(h.mean(dim=(2, 3)))
        if self.use_sometimes:
            out = out + self.sometimes(out)
        return self.frozen(out)


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
@pytest.mark.parametrize("scaled", [False, True])
def test_a_channels_last_cnn_trained_with_torch_habits_equals_torch(executor: str, scaled: bool) -> None:
    """Two param groups, OneCycleLR moving lr and beta1, step(closure), zero_grad(set_to_none=False) (the layer
    used on some steps is stepped with a zero gradient on the others), against torch.optim.AdamW: bit for bit.
    ``scaled``: a dynamic loss scale with an inf gradient in the first layer (the last to arrive: the blocks
    speculated before it are undone) and a late clip on some steps, within DESIGN.md's 1e-6."""
    torch.manual_seed(0)
    model = _ChannelsLastCNN().to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)

    def groups(m: nn.Module) -> list[dict]:
        return [{"params": [p for p in m.parameters() if p.dim() > 1]},
                {"params": [p for p in m.parameters() if p.dim() <= 1], "lr": 5e-3, "weight_decay": 0.0}]

    steps, max_norm = 12, (5.0 if scaled else None)
    opt = sofx.offload.SpeculativeAdamW(groups(model), lr=3e-3, weight_decay=0.05, executor=executor, block_numel=64,
                                        max_grad_norm=max_norm, loss_scale="dynamic" if scaled else None)
    ropt = torch.optim.AdamW(groups(ref), lr=3e-3, weight_decay=0.05, foreach=False)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[6e-3, 1e-2], total_steps=steps, cycle_momentum=True)
              for o in (opt, ropt)]
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1)
    undone = False
    with opt:
        for step in range(steps):
            x = torch.randn(4, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)
            y = torch.randn(4, 5, generator=gen)
            inf, boost = scaled and step in (3, 8), 1000.0 if scaled and step in (5, 9) else 1.0

            def loss_of(m: nn.Module) -> torch.Tensor:
                m.use_sometimes = step % 3 == 0
                loss = ((m(x) - y) ** 2).mean() * boost
                return loss + m.c1.weight[0, 0, 0, 0] * math.inf if inf else loss

            def closure() -> torch.Tensor:
                opt.zero_grad(set_to_none=False)
                loss = loss_of(model)
                opt.backward(loss)
                return loss

            opt.step(closure)
            ropt.zero_grad(set_to_none=False)
            scaler.scale(loss_of(ref)).backward() if scaled else loss_of(ref).backward()
            if scaled:
                scaler.unscale_(ropt)
                torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], max_norm)
                scaler.step(ropt)
                scaler.update()
            else:
                ropt.step()
            report = opt.last_report
            assert report.skipped == inf
            undone = undone or report.undone > 0
            for s in scheds:
                if not inf:
                    s.step()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if undone or boost > 1:
                    assert tensor_deviation(p, q) <= TOL, f"step {step}: {name}"
                else:
                    assert torch.equal(p, q), f"step {step}: {name}"
                assert p.stride() == q.stride()
    assert not scaled or undone, "the inf gradient must undo speculated blocks"


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_swa_and_ema_averaged_models_with_swalr_equal_torch(executor: str) -> None:
    """``torch.optim.swa_utils``: an ``AveragedModel`` (equal averages and an EMA) updated after each step, the
    lr switched to ``SWALR`` halfway, and a frozen parameter that takes no gradient, against torch.optim.AdamW:
    the model and both averages bit for bit (the averages read the parameters each buffer swap leaves current)."""
    swa = torch.optim.swa_utils
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, executor=executor,
                                        block_numel=16)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    runs = []
    for m, o in ((model, opt), (ref, ropt)):
        ema = swa.AveragedModel(m, multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))
        runs.append((m, o, swa.AveragedModel(m), ema, torch.optim.lr_scheduler.CosineAnnealingLR(o, 8),
                     swa.SWALR(o, swa_lr=5e-3, anneal_epochs=2)))
    gen = torch.Generator().manual_seed(1)
    with opt:
        for step in range(8):
            x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)
            for m, o, averaged, ema, sched, swa_sched in runs:
                o.zero_grad()
                loss = ((m(x) - y) ** 2).mean()
                o.backward(loss) if o is opt else loss.backward()
                o.step()
                ema.update_parameters(m)
                if step >= 4:
                    averaged.update_parameters(m)
                    swa_sched.step()
                else:
                    sched.step()
    for i, what in ((0, "model"), (2, "average"), (3, "ema")):
        for (name, p), q in zip(runs[0][i].named_parameters(), runs[1][i].parameters()):
            assert torch.equal(p, q), f"{what}: {name}"
    assert runs[0][1].param_groups[0]["lr"] == runs[1][1].param_groups[0]["lr"]
