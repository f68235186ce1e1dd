"""The offload facade with what training scripts do to their model, each against torch.optim side by side.

``torch.compile`` of the model (aot_eager, and inductor once), compiled
autograd, ``torch.compile`` of a function that calls ``opt.step()``,
activation checkpointing (reentrant and not), ``torch.autocast`` forwards and
gradient accumulation over micro-batches. Each run: a few steps of a tiny
model on fresh random batches; the reference is ``torch.optim.AdamW``
(``foreach=False``) on a deep copy (+ ``clip_grad_norm_`` and ``GradScaler``
where a test clips and scales). With the reference kernel and nothing undone
the trajectory is torch's bit for bit; where a step was undone and redone
(clipping, a late gradient) within DESIGN.md's 1e-6.

The facade's gradient hooks, ``step()``, ``zero_grad()``, ``state_dict()`` and
``load_state_dict()`` always run eagerly (``torch.compiler.disable``, :mod:`sofx.offload.eager`): dynamo never
traces the engine, whose Python state, locks and worker threads it cannot
follow; ``fullgraph=True`` refuses them, saying why.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from test_offload_support import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    SharedMLP,
    TinyTransformer,
    mlp_batch,
    mlp_loss,
    one_torch_thread,
    relative_deviation,
    transformer_batch,
    transformer_loss,
)

import sofx.offload
import sofx.offload.backward_passes
import sofx.offload.engine
from sofx.speculate import AdaptivePolicy

TOL = 1e-6

LossFn = Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


@dataclass
class Run:
    """What :func:`side_by_side` saw: the relative deviation and the facade's report after every step."""

    deviations: list[float] = field(default_factory=list)
    reports: list = field(default_factory=list)
    n_blocks: int = 0
    #: The facade's per-parameter state after the run (``opt.state[p]`` as plain dicts).
    states: dict = field(default_factory=dict)


def side_by_side(model: nn.Module, ref: nn.Module, loss_fn: LossFn, make_batch: Callable, *, steps: int = 4,
                 micro: int = 1, executor: str = "inline",
                 backward: Callable[[sofx.offload.SpeculativeAdamW, torch.Tensor], None] | None = None,
                 **opt_kwargs) -> Run:
    """Train ``model`` with the facade (the reference kernel, ``opt_kwargs`` over the defaults) and ``ref`` with
    torch.optim.AdamW on the same batches, ``micro`` backward calls (of the loss divided by ``micro``) per step;
    ``backward(opt, loss)`` replaces ``opt.backward(loss)``."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05, executor=executor, block_numel=100,
                  backend="reference", timeout=60.0)
    kwargs.update(opt_kwargs)
    opt = sofx.offload.SpeculativeAdamW([p for p in model.parameters() if p.requires_grad], **kwargs)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.99),
                             weight_decay=0.05, foreach=False)
    gen = torch.Generator().manual_seed(1)
    out = Run(n_blocks=len(opt.engine.layouts))
    with opt:
        for _ in range(steps):
            opt.zero_grad()
            ropt.zero_grad()
            for _ in range(micro):
                batch = make_batch(gen)
                loss = loss_fn(model, batch) / micro
                opt.backward(loss) if backward is None else backward(opt, loss)
                (loss_fn(ref, batch) / micro).backward()
            out.reports.append(opt.step())
            ropt.step()
            out.deviations.append(relative_deviation(model, ref))
        out.states = {p: dict(opt.state[p]) for p in opt.state}
    return out


def assert_speculated_in_backward(run: Run) -> None:
    """Every block of every step was speculated during backward and committed (inline executor: the
    speculative steps are done when their hooks return, before ``step()`` is called)."""
    for i, report in enumerate(run.reports):
        assert sorted(report.speculated_before_step()) == list(range(run.n_blocks)), (i, report.events)
        assert report.speculated == report.committed == run.n_blocks, (i, report)


def _models(cls: type = SharedMLP, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = cls()
    return model, copy.deepcopy(model)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches and counters emptied before and after (a test's compiles neither reuse nor count another's,
    nor leave code objects near the recompile limit)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def traced_engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The engine's gradient intake, ``step`` and gradient discarding, recording their name whenever dynamo traces
    them (``torch.compiler.is_compiling()`` inside: a traced frame replays the append)."""
    traced: list[str] = []
    for name in ("_take_gradient", "step", "discard_gradients"):
        original = getattr(sofx.offload.engine.OffloadEngine, name)
        monkeypatch.setattr(sofx.offload.engine.OffloadEngine, name, _tracing_probe(name, original, traced))
    return traced


def _tracing_probe(name: str, method: Callable, traced: list[str]) -> Callable:
    """``method``, appending ``name`` to ``traced`` where it runs traced by dynamo."""

    def probe(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            traced.append(name)
        return method(self, *args, **kwargs)

    return probe


# ---------------------------------------------------------------- torch.compile(model)
@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
def test_compiled_model_trains_bitwise_as_torch_optim(model_name: str, fresh_dynamo: None,
                                                      traced_engine_calls: list[str]) -> None:
    """``torch.compile(model, backend="aot_eager")``: the compiled backward (one autograd node) leaves each
    parameter's gradient accumulation to eager autograd, so the hooks fire per parameter (all at the end of that
    node, not in reverse layer order) and every block is speculated during backward; the trajectory is torch's
    bit for bit (the tied weights of both models included)."""
    cls, make_batch, loss_fn = {"mlp": (SharedMLP, mlp_batch, mlp_loss),
                                "transformer": (TinyTransformer, transformer_batch, transformer_loss)}[model_name]
    model, ref = _models(cls)
    compiled, compiled_ref = torch.compile(model, backend="aot_eager"), torch.compile(ref, backend="aot_eager")
    run = side_by_side(model, ref, lambda m, batch: loss_fn(compiled if m is model else compiled_ref, batch),
                       make_batch)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert traced_engine_calls == []
    assert_speculated_in_backward(run)
    assert run.deviations == [0.0] * len(run.deviations)


@pytest.mark.slow  # a cold inductor compile of the tiny MLP takes ~15-20 s on 2 shared cores
def test_inductor_compiled_model_trains_bitwise_as_torch_optim(fresh_dynamo: None) -> None:
    """The inductor backend (one compiled loss function for both models: the same kernels, the same gradient
    bits): hooks fire per parameter during backward; the trajectory is torch's bit for bit."""
    model, ref = _models()
    run = side_by_side(model, ref, torch.compile(mlp_loss), mlp_batch, steps=3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert_speculated_in_backward(run)
    assert run.deviations == [0.0] * len(run.deviations)


# ---------------------------------------------------------------- compiled autograd
def test_compiled_autograd_runs_the_gradient_hooks_eagerly(fresh_dynamo: None, traced_engine_calls: list[str]) -> None:
    """``torch._dynamo.config.compiled_autograd = True``, backward called in a compiled function: compiled autograd
    has dynamo trace the whole backward, post-accumulate-grad hooks included. The facade's hooks are
    ``torch.compiler.disable``d: the backward graph breaks at each and it runs eagerly (traced, the engine's
    gradient intake was compiled once per parameter shape and block state, past dynamo's recompile limit, its
    Python state guarded and its locks graph-breaking). Every block is speculated during backward, and the
    trajectory (a tied weight, the reference's backward eager) is torch's bit for bit."""
    model, ref = _models()
    with torch._dynamo.config.patch(compiled_autograd=True):  # (read where torch.compile wraps the function)

        @torch.compile(backend="aot_eager")
        def compiled_backward(opt: sofx.offload.SpeculativeAdamW, loss: torch.Tensor) -> None:
            opt.backward(loss)

        run = side_by_side(model, ref, mlp_loss, mlp_batch, backward=compiled_backward)
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] > 0, "compiled autograd did not run"
    assert traced_engine_calls == []
    assert_speculated_in_backward(run)
    assert run.deviations == [0.0] * len(run.deviations)


# ---------------------------------------------------------------- torch.compile of a function calling opt.step()
def _inject_inf(g: torch.Tensor) -> torch.Tensor:
    g = g.clone()
    g.view(-1)[0] = float("inf")
    return g


@pytest.mark.parametrize("compiled", ["step", "train_step"])
def test_a_compiled_function_calling_step_runs_it_eagerly(compiled: str, fresh_dynamo: None,
                                                         traced_engine_calls: list[str]) -> None:
    """``torch.compile`` of ``lambda: opt.step()`` (torch.optim's step compiles) or of a whole train step
    (``zero_grad``, forward, ``opt.backward``, ``step``): ``step()`` and ``zero_grad()`` are
    ``torch.compiler.disable``d, so the function graph-breaks there and the engine runs eagerly (traced, an undo
    failed: dynamo's stand-in pytree spec reached the undo record check). With clipping (blocks undone and redone),
    a dynamic loss scale and an overflow (a skipped step, the scale backed off), a LambdaLR: the run equals
    torch.optim.AdamW + clip_grad_norm_ + GradScaler, within 1e-6, and ``step`` returns its report. (The first
    layer's gradient, the last to arrive, is boosted: clipping is known only after the other blocks were
    speculated.)"""
    model, ref = _models()
    for m in (model, ref):
        m.inp.weight.register_hook(lambda g: g * 1000.0)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, weight_decay=0.05, max_grad_norm=20.0,
                                        loss_scale="dynamic", executor="inline", block_numel=100, timeout=60.0,
                                        policy=AdaptivePolicy(enabled=False))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    scaler = torch.amp.GradScaler("cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, lambda s: 0.9 ** s)

    @torch.compile(backend="aot_eager")
    def step() -> sofx.offload.engine.EngineStepReport:
        return opt.step()

    @torch.compile(backend="aot_eager")
    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> sofx.offload.engine.EngineStepReport:
        opt.zero_grad()
        opt.backward(mlp_loss(model, batch))
        return opt.step()

    gen = torch.Generator().manual_seed(1)
    reports = []
    with opt, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            batch = mlp_batch(gen)
            handles = [m.mid.weight.register_hook(_inject_inf) for m in (model, ref)] if i == 2 else []
            if compiled == "step":
                opt.zero_grad()
                opt.backward(mlp_loss(model, batch))
                reports.append(step())
            else:
                reports.append(train_step(batch))
            ropt.zero_grad()
            scaler.scale(mlp_loss(ref, batch)).backward()
            scaler.unscale_(ropt)
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 20.0)
            scaler.step(ropt)
            scaler.update()
            for h in handles:
                h.remove()
            sched.step()
            rsched.step()
            assert opt.loss_scale == scaler.get_scale()
            assert relative_deviation(model, ref) <= TOL, i
    assert torch._dynamo.utils.counters["frames"]["total"] > 0, "dynamo did not run"
    assert traced_engine_calls == []
    assert all(isinstance(r, sofx.offload.engine.EngineStepReport) for r in reports)
    assert [r.skipped for r in reports] == [False, False, True, False, False]
    assert all(r.clipped for i, r in enumerate(reports) if i != 2)
    assert sum(r.redone for r in reports) > 0, reports
    # every backward was opt.backward's: no warning that one was not scaled (a traced scale_loss's flag was lost)
    assert not [w for w in caught if "loss scaling is on" in str(w.message)], [str(w.message) for w in caught]


# ---------------------------------------------------------------- activation checkpointing
class CheckpointedNet(nn.Module):
    """Residual blocks run under ``torch.utils.checkpoint`` (``use_reentrant``; ``None``: not checkpointed); with
    ``shared``, the first block's linear layer is applied once more outside the checkpointed regions."""

    def __init__(self, use_reentrant: bool | None, shared: bool = False) -> None:
        super().__init__()
        self.use_reentrant, self.shared = use_reentrant, shared
        self.inp = nn.Linear(6, 16)
        self.lins = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(3))
        self.head = nn.Linear(16, 3)

    def block(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lins[i](self.norms[i](h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.shared:
            h = self.lins[0](h)
        for i in range(3):
            if self.use_reentrant is None:
                h = self.block(i, h)
            else:
                h = checkpoint(self.block, i, h, use_reentrant=self.use_reentrant)
        return self.head(h)


def _checkpointed_models(use_reentrant: bool, shared: bool = False) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = CheckpointedNet(use_reentrant, shared)
    ref = copy.deepcopy(model)
    ref.use_reentrant = None  # torch.optim's run without checkpointing: the same gradients
    return model, ref


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_trains_bitwise_as_torch_optim(use_reentrant: bool, accumulate: int) -> None:
    """Checkpointed blocks recompute their forward during backward (reentrant: in a backward of their own), so
    their gradients arrive then; the hooks fire once per parameter, every block is speculated during backward,
    and the trajectory is that of torch.optim on the model without checkpointing, bit for bit. With
    ``gradient_accumulation_steps=2`` a reentrant checkpoint's own backward is the backward call it runs in: its
    gradients of the first call are not final (nothing is speculated there, and nothing is late in the second)."""
    model, ref = _checkpointed_models(use_reentrant)
    run = side_by_side(model, ref, mlp_loss, mlp_batch, micro=accumulate, gradient_accumulation_steps=accumulate)
    assert_speculated_in_backward(run)
    assert all(("late_gradient", b) not in r.events for r in run.reports for b in range(run.n_blocks))
    assert run.deviations == [0.0] * len(run.deviations)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_parameter_used_inside_and_outside_a_checkpointed_region_equals_torch_optim(use_reentrant: bool,
                                                                                      accumulate: int) -> None:
    """A parameter used inside a checkpointed region and outside it: the non-reentrant checkpoint accumulates its
    gradient once (bit for bit torch's); the reentrant one twice, once in the recomputation's own backward, so its
    hook fires twice and the second call is a late gradient (summed in, its block undone and redone): within
    1e-6. With ``gradient_accumulation_steps`` its gradients of the earlier backward calls are summed, and its block
    is ready in the last call: that call's second arrival is a late gradient the same way."""
    model, ref = _checkpointed_models(use_reentrant, shared=True)
    run = side_by_side(model, ref, mlp_loss, mlp_batch, steps=5, micro=accumulate,
                       gradient_accumulation_steps=accumulate)
    late = [sum(what == "late_gradient" for what, _ in r.events) for r in run.reports]
    if use_reentrant:
        assert all(n > 0 for n in late), late
        assert all(r.redone > 0 for r in run.reports)
        assert max(run.deviations) <= TOL, run.deviations
    else:
        assert late == [0] * len(late)
        assert_speculated_in_backward(run)
        assert run.deviations == [0.0] * len(run.deviations)


# ---------------------------------------------------------------- autocast
@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
def test_autocast_bf16_forward_trains_bitwise_as_torch_optim(model_name: str) -> None:
    """``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward of an fp32 model: the matmuls run in
    bf16, the gradients reach the fp32 parameters as fp32 (autocast's casts are differentiated); every block is
    speculated during backward and the trajectory is torch.optim's on the same autocast forward, bit for bit."""
    cls, make_batch, loss_fn = {"mlp": (SharedMLP, mlp_batch, mlp_loss),
                                "transformer": (TinyTransformer, transformer_batch, transformer_loss)}[model_name]

    def autocast_loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(m, batch)
        return loss

    model, ref = _models(cls)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(make_batch(torch.Generator().manual_seed(0))[0]).dtype == torch.bfloat16
    run = side_by_side(model, ref, autocast_loss, make_batch)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_speculated_in_backward(run)
    assert run.deviations == [0.0] * len(run.deviations)
    assert relative_deviation(model, _models(cls)[0]) > 0  # (it trained)


# ---------------------------------------------------------------- gradient accumulation
def test_gradient_accumulation_steps_speculate_once_on_the_summed_gradient() -> None:
    """``gradient_accumulation_steps=3`` and three backward calls per step: the gradients are summed as ``.grad``
    sums them, each block is speculated once, on its last micro-step's arrival (no late gradient, nothing
    undone), and the trajectory and step counts are torch.optim's, bit for bit."""
    model, ref = _models()
    run = side_by_side(model, ref, mlp_loss, mlp_batch, micro=3, gradient_accumulation_steps=3)
    assert_speculated_in_backward(run)
    assert all(r.undone == 0 and ("late_gradient", 0) not in r.events for r in run.reports)
    assert run.deviations == [0.0] * len(run.deviations)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_backward_called_several_times_before_step_accumulates_as_torch(executor: str) -> None:
    """Three backward calls per step without ``gradient_accumulation_steps`` (as torch users accumulate): each
    block is speculated at its first arrival; the later ones are late gradients, summed in, the block undone and
    redone in ``step()``. The trajectory is torch.optim's on the summed ``.grad`` (within 1e-6), one step per
    ``step()``: step counts advance by one, not by three."""
    model, ref = _models()
    run = side_by_side(model, ref, mlp_loss, mlp_batch, micro=3, executor=executor, steps=5)
    assert all(r.redone == r.speculated > 0 and ("late_gradient", 0) in r.events for r in run.reports)
    assert max(run.deviations) <= TOL, run.deviations
    assert all(int(run.states[p]["step"]) == 5 for p in run.states)


class SometimesUsed(nn.Module):
    """A linear model with a second weight that only odd-numbered calls use."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.extra = nn.Parameter(torch.randn(3, 6) * 0.1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) + (x @ self.extra.t() if self.calls % 2 else 0.0)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_parameter_used_in_some_micro_batches_only_accumulates_as_torch(accumulate: int) -> None:
    """Two micro-batches per step, a parameter used in the first only: it has no gradient in the last backward call
    of ``gradient_accumulation_steps=2``, so its block is not ready in backward and is stepped in ``step()``
    (with the default 1, its block is speculated at once); either way torch.optim's trajectory on ``.grad``."""
    model, ref = _models(SometimesUsed)
    run = side_by_side(model, ref, mlp_loss, mlp_batch, micro=2, gradient_accumulation_steps=accumulate,
                       block_numel=1)
    assert max(run.deviations) <= TOL, run.deviations
    if accumulate == 2:
        assert run.deviations == [0.0] * len(run.deviations)
        assert all(r.stepped_late >= 1 for r in run.reports)


class TwoHeads(nn.Module):
    """A trunk and two heads: micro-batch ``i`` goes through head ``i % 2`` (multi-task heads; mixture-of-experts
    routing sends micro-batches through other experts the same way), so a head gets gradients in some micro-steps
    of an accumulation only."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.heads = nn.ModuleList(nn.Linear(8, 3) for _ in range(2))

    def forward(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return self.heads[i % 2](torch.tanh(self.trunk(x)))


def _branched_side_by_side(accumulate: int, executor: str, calls: int | None = None, max_norm: float = 100.0,
                           steps: int = 3, boost: float = 1.0,
                           **opt_kwargs) -> tuple[list, list[float], dict[int, str]]:
    """:class:`TwoHeads` trained by the facade (the reference kernel, a block per parameter) and by
    torch.optim.AdamW + ``clip_grad_norm_`` on the same micro-batches, ``calls`` backward calls per step (default
    ``accumulate``, the facade's ``gradient_accumulation_steps``), head 0's weight gradient times ``boost`` (a
    tensor hook) in both: the reports, the largest relative deviation after each step, and the name of the
    parameter of each block."""
    torch.manual_seed(0)
    model = TwoHeads()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.heads[0].weight.register_hook(lambda g: g * boost)
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05,
                                        executor=executor, block_numel=1, backend="reference", timeout=60.0,
                                        max_grad_norm=max_norm, gradient_accumulation_steps=accumulate,
                                        policy=AdaptivePolicy(enabled=False), **opt_kwargs)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05, foreach=False)
    names = [name for name, _ in model.named_parameters()]
    blocks = {layout.index: names[layout.param_indices[0]] for layout in opt.engine.layouts}
    gen = torch.Generator().manual_seed(1)
    reports, deviations = [], []
    with opt:
        for _ in range(steps):
            for i in range(accumulate if calls is None else calls):
                x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
                opt.backward(nn.functional.mse_loss(model(x, i), y) / accumulate)
                (nn.functional.mse_loss(ref(x, i), y) / accumulate).backward()
            reports.append(opt.step())
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], max_norm)
            ropt.step()
            ropt.zero_grad()
            deviations.append(relative_deviation(model, ref))
    return reports, deviations, blocks


@pytest.mark.parametrize("executor", ["inline", "thread"])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_branches_taken_in_the_last_micro_step_are_speculated_during_its_backward(accumulate: int,
                                                                                  executor: str) -> None:
    """``gradient_accumulation_steps=N``, micro-batches through alternating heads: a head's gradient is final in
    the N-th backward call (its earlier micro-steps summed in), so the blocks of the trunk and of the last
    micro-step's head are speculated during that backward (each head got fewer than N gradients: they were all
    stepped late in ``step()``); the other head got no gradient in the last micro-step, so its blocks are not ready
    in backward and are stepped late. Nothing is undone: the trajectory is torch.optim.AdamW + ``clip_grad_norm_``
    on the summed ``.grad``, bit for bit."""
    reports, deviations, blocks = _branched_side_by_side(accumulate, executor)
    last = f"heads.{(accumulate - 1) % 2}."
    for report in reports:
        actions = dict(zip(blocks.values(), report.actions))
        assert all(action == ("step" if name.startswith("heads.") and not name.startswith(last) else "commit")
                   for name, action in actions.items()), actions
        assert report.speculated == report.committed == 4 and report.stepped_late == 2 and not report.clipped
    assert deviations == [0.0] * len(deviations)


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_backward_call_after_the_last_micro_step_is_a_late_gradient_of_the_blocks_it_reaches(executor: str) -> None:
    """Three backward calls with ``gradient_accumulation_steps=2`` (heads 0, 1, 0): the trunk and head 1 were
    speculated in the 2nd call; the 3rd's trunk gradients are late (summed in, the trunk's blocks undone at once and
    stepped in ``step()``), head 1 stands as speculated, and head 0, not ready in the 2nd call, is ready in the 3rd
    (a call after the N-th is a last micro-step too), speculated on its two micro-steps' sum. The trajectory is
    torch.optim's on the summed ``.grad``, within 1e-6 (the undone blocks); each ``step()`` warns of the extra call."""
    with pytest.warns(RuntimeWarning, match=r"step\(\) after 3 backward calls \(micro-steps\) of "
                                            r"gradient_accumulation_steps=2") as caught:
        reports, deviations, blocks = _branched_side_by_side(2, executor, calls=3)
    assert sum("gradient_accumulation_steps" in str(w.message) for w in caught) == len(reports)
    for report in reports:
        actions = dict(zip(blocks.values(), report.actions))
        assert actions == {"trunk.weight": "step", "trunk.bias": "step", "heads.0.weight": "commit",
                           "heads.0.bias": "commit", "heads.1.weight": "commit", "heads.1.bias": "commit"}, actions
        late = {blocks[b] for what, b in report.events if what == "late_gradient"}
        assert late == {"trunk.weight", "trunk.bias"}, report.events
    assert max(deviations) <= TOL, deviations


def test_clipping_after_branches_speculated_in_the_last_micro_step_redoes_them_as_torch() -> None:
    """The same accumulation with a ``max_grad_norm`` that clips every step, found only in ``step()`` (head 0's
    weight gradient, boosted, is not ready in backward: no early veto): the blocks speculated in the last
    micro-step's backward are undone and redone with the clipped gradient, the others stepped late with it; within
    1e-6 of torch.optim.AdamW + ``clip_grad_norm_``."""
    reports, deviations, _ = _branched_side_by_side(2, "inline", max_norm=2.0, boost=100.0)
    assert all(r.clipped and r.speculated == r.redone == 4 and r.stepped_late == 2 for r in reports), reports
    assert max(deviations) <= TOL, deviations


def test_without_a_backward_call_count_the_last_micro_step_is_each_parameter_s_n_th_gradient(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch cannot tell the graph task a gradient comes from (``torch._C._current_graph_task_id`` missing:
    :mod:`sofx.offload.backward_passes` counts nothing), a parameter's gradient is final at its N-th arrival, as
    before: the trunk (a gradient from every micro-step) is speculated, the heads (fewer) are stepped late; torch's
    trajectory bit for bit."""
    monkeypatch.setattr(sofx.offload.backward_passes, "_task_id", None)
    reports, deviations, blocks = _branched_side_by_side(2, "inline")
    for report in reports:
        actions = dict(zip(blocks.values(), report.actions))
        assert all(a == ("step" if n.startswith("heads.") else "commit") for n, a in actions.items()), actions
    assert deviations == [0.0] * len(deviations)


def test_a_compiled_function_saving_or_loading_the_state_runs_state_dict_eagerly(
        fresh_dynamo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile`` of a function calling ``opt.state_dict()`` or ``opt.load_state_dict(...)`` (a checkpoint
    inside a compiled train loop): dynamo traced both into the engine (its locks, its executor's state), as
    ``torch.optim`` disables its own; they are ``torch.compiler.disable``d, run eagerly, and give and take what the
    eager calls do. ``fullgraph=True`` refuses them, naming why."""
    traced: list[str] = []
    for name in ("state_dict", "load_state_dict"):
        original = getattr(sofx.offload.engine.OffloadEngine, name)
        monkeypatch.setattr(sofx.offload.engine.OffloadEngine, name, _tracing_probe(name, original, traced))
    model, _ = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100)

    @torch.compile(backend="aot_eager")
    def save() -> dict:
        return opt.state_dict()

    @torch.compile(backend="aot_eager")
    def load(state_dict: dict) -> None:
        opt.load_state_dict(state_dict)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def save_in_one_graph() -> dict:
        return opt.state_dict()

    with opt:
        opt.backward(mlp_loss(model, mlp_batch(torch.Generator().manual_seed(1))))
        opt.step()
        saved = save()
        assert torch._dynamo.utils.counters["frames"]["total"] > 0, "dynamo did not run"
        assert saved["param_groups"] == opt.state_dict()["param_groups"]
        assert [int(b["counts"].max()) for b in saved["state"]["blocks"]] == [1] * len(saved["state"]["blocks"])
        opt.param_groups[0]["lr"] = 0.5
        load(saved)
        assert opt.param_groups[0]["lr"] == 1e-2
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"state_dict\(\) runs eagerly"):
            save_in_one_graph()
    assert traced == []


def test_a_fullgraph_compile_of_step_is_refused_with_the_reason_and_changes_nothing(fresh_dynamo: None) -> None:
    """``torch.compile(..., fullgraph=True)`` of a function calling ``opt.step()`` cannot graph-break there: dynamo
    refuses it, naming why (the engine runs eagerly), before the step starts; the gradients are still held, and an
    eager ``step()`` then takes torch.optim's step, bit for bit."""
    model, ref = _models()
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=100,
                                        backend="reference")
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step() -> sofx.offload.engine.EngineStepReport:
        return opt.step()

    batch = mlp_batch(torch.Generator().manual_seed(1))
    with opt:
        opt.backward(mlp_loss(model, batch))
        mlp_loss(ref, batch).backward()
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"step\(\) runs eagerly: dynamo cannot trace"):
            step()
        assert opt.engine.in_step and opt.engine.iteration == 0
        opt.step()
        ropt.step()
    assert relative_deviation(model, ref) == 0.0
