"""Long training loops that combine features, side by side with torch.optim.

Each test trains a small ``nn.Module`` (Linear, LayerNorm, GELU, a head)
for 40 steps with everything a real loop has at once: three param groups (no
weight decay on biases and norms, a head with its own lr and betas), three
micro-batches accumulated per step, a branch of the module that only some
micro-batches go through (its parameters get no gradient on most steps),
``torch.amp.GradScaler`` semantics (overflows skip the step and back the
scale off, clean steps grow it after ``growth_interval``), a warm-up + cosine
schedule that advances only on steps taken, the head's lr, weight decay and
betas changed by hand, then a checkpoint saved and loaded (the run goes on
from the loaded state), and clipping on the last steps. The torch side is
``torch.optim.AdamW(foreach=False)`` (``Adam`` for L2 decay, ``fused=True``
for a bf16 module) + ``GradScaler("cpu")`` + ``clip_grad_norm_`` +
``LambdaLR`` (or ``OneCycleLR``), its own state saved and loaded through
``torch.save`` at the same step.

Tolerance: bit for bit until the first step that clips. sofx folds unscaling
and clipping into one multiplier and sums the squares partly in float64
(``sofx.serial``'s "Known differences from torch"), so a clipped step is
torch's to float32 rounding; from there on DESIGN.md's 1e-6 relative (with
an absolute 1e-7 for elements near 0), checked at every step (no drift).

- The functional serial loop (``serial_loop_step`` + ``accumulate`` +
  ``group_hparams``), and a run handed over mid-way between torch.optim and it
  (the ``torch.optim`` state-dict interop), follow that rule. So does a loop
  of one's own (``check_finite`` + ``unscale`` + ``clip_by_global_norm`` +
  ``Adam.update``): its clip multiplies as torch's does, but its norm is
  summed partly in float64 (``clip_by_global_norm``'s docstring).
- The speculative functional loop equals the serial one bit for bit at every
  step without donation, and within 1e-6 with it (undone blocks are then
  algebraic inverses, ``sofx.speculate``).
- The offload facade (``SpeculativeAdamW`` / ``SpeculativeAdam``; the thread,
  process and inline executors; saved with ``sofx.checkpoint`` and resumed in
  a new module and optimizer on another executor; speculation switched off
  for a few steps; device blocks; a bf16 or fp16 module against torch's
  fp32-master recipe) follows the rule with ``undo="exact"``; with
  ``undo="auto"`` an undone speculative step is an algebraic inverse (float32
  rounding, README), so bit for bit until the first step that undid one.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

import pytest
import torch
from torch import nn

import sofx
import sofx.checkpoint
from sofx import AdamHParams, loss_scale
from sofx.serial import serial_loop_step
from sofx.speculate import SpeculationConfig, speculative_loop_step

from test_offload_support import one_torch_thread  # noqa: F401 (autouse fixture)

STEPS = 40
MICRO = 3
INF_INPUT_AT = {6: 1}  # step -> the micro-batch whose input holds an inf (every gradient nan)
INF_GRAD_AT = {13: 2, 14: 0, 29: 2}  # step -> the micro-batch that gives inp.weight an inf gradient
OVERFLOW_AT = {**INF_INPUT_AT, **INF_GRAD_AT}
SAVE_AT = 17  # checkpoint after this step, then go on from the loaded state
# the head's lr lowered (and other hparams changed) by hand before this step's optimizer step, before the
# checkpoint: the changed param groups must survive it
LR_CHANGE_AT = 15
CLIP_FROM = 32  # from here on, some steps' losses are scaled up: clip_grad_norm_ clips
MAX_NORM = 1.0
BASE_LR = {"decay": 3e-3, "no_decay": 3e-3, "head": 1e-3}
GROUP_OPTIONS = {"decay": dict(weight_decay=0.1), "no_decay": dict(weight_decay=0.0),
                 "head": dict(weight_decay=0.05, betas=(0.8, 0.95), eps=1e-6)}
BACKWARD_ORDER = ["head", "aux", "mid", "norm", "inp"]  # the modules in the order backward reaches them
SCALING = dict(init_scale=2.0 ** 12, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
SPECULATION_OFF = range(8, 11)  # the facade's steps with speculation switched off (opt.speculate = False)
HEAD_LR_AFTER = BASE_LR["head"] * 0.25  # the head's base lr from LR_CHANGE_AT on
HEAD_CHANGES = dict(weight_decay=0.2, betas=(0.85, 0.97))  # and its other hparams changed by hand there


class Precision(NamedTuple):
    """A dtype of the model and its gradients, with the torch.optim implementation sofx's backend steps as (README,
    "The functional core") and the clipping torch computes with the same rule in that dtype (``None``: none);
    ``decoupled``: AdamW (else Adam, L2 weight decay)."""

    dtype: torch.dtype
    torch_options: dict[str, Any]
    backend: str
    max_norm: float | None
    decoupled: bool = True


FP32 = Precision(torch.float32, dict(foreach=False), "auto", MAX_NORM)
FP32_L2 = FP32._replace(decoupled=False)
# bf16 parameters: cpu_fast's step is fused=True's; clip_grad_norm_ takes a bf16 norm, sofx a float32 one
BF16 = Precision(torch.bfloat16, dict(fused=True), "cpu_fast", None)


class Net(nn.Module):
    """A few layers: Linear -> LayerNorm -> GELU -> Linear -> tanh -> head, plus an ``aux`` head used only
    where ``forward`` is asked to (its parameters get no gradient from the other micro-batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, aux: bool = False) -> torch.Tensor:
        h = torch.tanh(self.mid(nn.functional.gelu(self.norm(self.inp(x)))))
        return self.head(h) + self.aux(h) if aux else self.head(h)


def uses_aux(step: int, micro: int) -> bool:
    """Whether this micro-batch goes through ``aux``: one micro-batch of every third step, so ``aux`` has no
    gradient on the other steps (torch.optim leaves it and its state alone) and one micro-batch's on these."""
    return step % 3 == 0 and micro == 1


def group_of(name: str) -> str:
    """The param group of a parameter: the head's, or decay / no decay (biases and norms)."""
    if name.startswith("head."):
        return "head"
    return "no_decay" if name.endswith("bias") or name.startswith("norm.") else "decay"


def lr_factor(t: int) -> float:
    """Linear warm-up over 5 steps, then cosine decay to 10% by step 40 (a LambdaLR factor)."""
    if t < 5:
        return (t + 1) / 5
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(t - 5, 35) / 35))


class WarmupCosine:
    """A LambdaLR of ``lr_factor``; the head's lr lowered to ``HEAD_LR_AFTER`` by hand (its base lr too, so
    that the scheduler keeps it), its weight decay and betas changed."""

    def make(self, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    def change_head_hparams(self, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> None:
        sched.base_lrs[2] = HEAD_LR_AFTER
        opt.param_groups[2]["lr"] = HEAD_LR_AFTER * lr_factor(sched.last_epoch)
        opt.param_groups[2].update(HEAD_CHANGES)


class OneCycle:
    """OneCycleLR, which moves beta1 too (``cycle_momentum``); the head's lr lowered by hand for the step,
    and its peak lr from then on, its weight decay and betas changed (beta1 for the step)."""

    def make(self, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[3 * BASE_LR[g] for g in BASE_LR], total_steps=STEPS,
                                                   pct_start=0.25)

    def change_head_hparams(self, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> None:
        opt.param_groups[2]["lr"] *= 0.25
        opt.param_groups[2]["max_lr"] *= 0.25
        opt.param_groups[2].update(HEAD_CHANGES)


def batch(gen: torch.Generator, step: int, micro: int, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Micro-batch ``micro`` of ``step``: inputs (an inf in one at ``INF_INPUT_AT``), targets, and the loss
    weight (heavy on some clipping steps: the first block's gradient alone clips)."""
    x = torch.randn(8, 6, generator=gen)
    y = torch.randn(8, 3, generator=gen)
    if INF_INPUT_AT.get(step) == micro:
        x[2, 1] = math.inf
    weight = 200.0 if step >= CLIP_FROM and step % 4 == 0 else 1.0
    return x.to(dtype), y.to(dtype), weight / MICRO


def gradient_edit(step: int, micro: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a tensor hook does to this micro-step's gradient of ``inp.weight`` (the last to arrive in
    backward): an inf (an fp16 overflow's) at ``INF_GRAD_AT``, 8x on the clipping steps that are not heavy
    (the blocks speculated before it must be undone and redone), else nothing (``None``)."""
    if INF_GRAD_AT.get(step) == micro:
        return with_inf
    if step >= CLIP_FROM and step % 4 in (1, 2):
        return lambda g: g * 8.0
    return None


def micro_backward(model: Net, gen: torch.Generator, step: int, micro: int, dtype: torch.dtype,
                   backward: Callable[[torch.Tensor], Any]) -> None:
    """One micro-step of a module loop: its batch (of ``dtype``) through ``model``, the loss handed to
    ``backward`` (``scaler.scale(loss).backward()``, ``opt.backward``) with this micro-step's
    :func:`gradient_edit` hooked on ``inp.weight`` while it runs."""
    x, y, w = batch(gen, step, micro, dtype)
    edit = gradient_edit(step, micro)
    hook = model.inp.weight.register_hook(edit) if edit else None
    backward(loss_of(model(x, uses_aux(step, micro)), y, w))
    if hook is not None:
        hook.remove()


def with_inf(g: torch.Tensor) -> torch.Tensor:
    """``g`` with an inf in one element."""
    g = g.clone()
    g[3, 4] = math.inf
    return g


def loss_of(out: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
    return nn.functional.mse_loss(out, y) * weight


def scaler_step(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer,
                sched: torch.optim.lr_scheduler.LRScheduler, before: float) -> bool:
    """GradScaler's step and update (``before``: the scale of the step's backward), the scheduler stepped where
    the optimizer was (the scale did not drop: no overflow); whether it was."""
    scaler.step(opt)
    scaler.update()
    stepped = scaler.get_scale() >= before
    if stepped:
        sched.step()
    return stepped


def through_torch_save(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` saved by ``torch.save`` and loaded back (``weights_only``), as a checkpoint file would."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def load_opt_scaler_sched(run: "TorchRun | TorchMastersRun", saved: dict[str, Any]) -> None:
    """``run``'s fresh optimizer, scaler and scheduler given the saved states of :func:`through_torch_save`."""
    run.opt.load_state_dict(saved["opt"])
    run.scaler.load_state_dict(saved["scaler"])
    run.sched.load_state_dict(saved["sched"])


@dataclass
class TorchRun:
    """torch's side: the module, AdamW (or Adam) over three groups, GradScaler, the schedule's scheduler stepped
    when the optimizer was."""

    model: Net
    precision: Precision = FP32
    opt: torch.optim.AdamW = field(init=False)
    scaler: torch.amp.GradScaler = field(init=False)
    schedule: WarmupCosine | OneCycle = field(default_factory=WarmupCosine)
    sched: torch.optim.lr_scheduler.LRScheduler = field(init=False)
    backward_scale: float = field(init=False, default=0.0)  # the loss scale of the latest step's backward

    def __post_init__(self) -> None:
        self.build()

    def build(self) -> None:
        named = dict(self.model.named_parameters())
        groups = [dict(params=[p for n, p in named.items() if group_of(n) == g], lr=BASE_LR[g], **GROUP_OPTIONS[g])
                  for g in BASE_LR]
        cls = torch.optim.AdamW if self.precision.decoupled else torch.optim.Adam
        self.opt = cls(groups, **self.precision.torch_options)
        self.scaler = torch.amp.GradScaler("cpu", **SCALING)
        self.sched = self.schedule.make(self.opt)

    def step(self, gen: torch.Generator, step: int) -> bool:
        """One iteration; returns whether the optimizer stepped (no overflow)."""
        self.opt.zero_grad()
        for micro in range(MICRO):
            micro_backward(self.model, gen, step, micro, self.precision.dtype,
                           lambda loss: self.scaler.scale(loss).backward())
        if step == LR_CHANGE_AT:  # by hand, between backward and step
            self.schedule.change_head_hparams(self.opt, self.sched)
        before = self.backward_scale = self.scaler.get_scale()
        self.scaler.unscale_(self.opt)
        if self.precision.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.precision.max_norm)
        return scaler_step(self.scaler, self.opt, self.sched, before)

    def reload(self) -> None:
        """Save model, optimizer, scaler and scheduler through torch.save, then go on with fresh objects."""
        saved = through_torch_save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                                    "scaler": self.scaler.state_dict(), "sched": self.sched.state_dict()})
        self.model = Net().to(self.precision.dtype)
        self.model.load_state_dict(saved["model"])
        base_lrs = list(self.sched.base_lrs)
        self.build()
        load_opt_scaler_sched(self, saved)
        assert self.sched.base_lrs == base_lrs


def _hparams(base: dict[str, float], options: dict[str, dict[str, Any]]):
    """The sofx schedule: each group's ``options`` at its lr ``base[g] * lr_factor(t)``, as LambdaLR computes it."""
    def at(t: int) -> dict[str, AdamHParams]:
        out = {}
        for g, o in options.items():
            b1, b2 = o.get("betas", (0.9, 0.999))
            out[g] = AdamHParams(lr=base[g] * lr_factor(t), beta1=b1, beta2=b2, eps=o.get("eps", 1e-8),
                                 weight_decay=o["weight_decay"])
        return out
    return at


def _grads(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: float, aux: bool, scale: float,
           template: Net) -> dict[str, torch.Tensor | None]:
    """Gradients of the loss times the loss scale, by ``torch.func.functional_call`` on the params tree (``None``
    for the parameters the forward did not use)."""
    live = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss = loss_of(torch.func.functional_call(template, live, (x, aux)), y, w)
    grads = torch.autograd.grad(loss * torch.tensor(scale), list(live.values()), allow_unused=True)
    return dict(zip(live, grads))


def _assert_pairs(step: int, name: str, pairs: list[tuple[str, torch.Tensor, torch.Tensor]], bitwise: bool) -> None:
    """Each ``(what, ours, torch's)`` of parameter ``name`` at ``step``: bit for bit, or within DESIGN.md's
    tolerance."""
    for what, ours, theirs in pairs:
        if bitwise:
            assert torch.equal(ours, theirs), f"step {step}: {what} of {name} differs from torch's"
        else:
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"step {step}: {what} of {name}: {m}")


def _compare(step: int, params: dict[str, torch.Tensor], state, model: Net, topt: torch.optim.AdamW,
             bitwise: bool) -> None:
    """sofx's params, moments and counts against torch's, bit for bit or within DESIGN.md's tolerance."""
    for name, p in model.named_parameters():
        pairs = [("param", params[name], p.detach())]
        tstate = topt.state.get(p, {})
        assert int(state.count[name]) == (int(tstate["step"]) if tstate else 0), (step, name)
        if tstate:
            pairs += [("exp_avg", state.mu[name], tstate["exp_avg"]), ("exp_avg_sq", state.nu[name],
                                                                       tstate["exp_avg_sq"])]
        _assert_pairs(step, name, pairs, bitwise)


def _accumulated_grads(params: dict[str, torch.Tensor], gen: torch.Generator, step: int, scale: float,
                       template: Net) -> dict[str, torch.Tensor]:
    """The step's micro-batches' gradients of the scaled loss, edited as torch's hooks edit them, summed."""
    acc = sofx.transforms.accumulation_init(params)
    for micro in range(MICRO):
        x, y, w = batch(gen, step, micro, params["inp.weight"].dtype)
        g = _grads(params, x, y, w, uses_aux(step, micro), scale, template)
        edit = gradient_edit(step, micro)
        if edit:
            g["inp.weight"] = edit(g["inp.weight"])
        acc = sofx.transforms.accumulate(acc, g, params)
    return sofx.transforms.accumulated(acc, params)


class ChainLoop(NamedTuple):
    """A loop of one's own over ``Adam.update``: params, Adam state, the transforms' and the scaler's states,
    steps taken."""

    params: Any
    opt_state: Any
    chain_state: Any
    scaler_state: Any
    step: int = 0


def _chain(max_norm: float | None) -> sofx.transforms.GradientTransformation:
    """GradScaler's ``unscale_`` then ``clip_grad_norm_`` (``None``: no clipping), with the overflow check first."""
    tx = sofx.transforms
    clip = tx.identity() if max_norm is None else tx.clip_by_global_norm(max_norm)
    return tx.chain(tx.check_finite(), tx.unscale(), clip)


def _chain_step(opt: sofx.Adam, rule: Any, loop: ChainLoop, grads: Any, hparams: Callable[[int], Any],
                max_norm: float | None) -> tuple[ChainLoop, bool]:
    """check_finite + unscale + clip_by_global_norm, then ``opt.update`` unless an overflow skips the step, then
    the loss scaler's update (torch's loop order); returns the loop and whether the step was taken."""
    grads, chain_state = _chain(max_norm).update(grads, loop.chain_state, loop.params,
                                                 loss_scale=rule.scale(loop.scaler_state))
    finite = chain_state[0].all_finite
    params, state = loop.params, loop.opt_state
    if finite:
        params, state, _ = opt.update(params, grads, state, hparams(loop.step), undoable=False)
    return ChainLoop(params, state, chain_state, rule.update(loop.scaler_state, not finite),
                     loop.step + finite), finite


def _assert_loops_bitwise(step: int, a: sofx.serial.LoopState, b: sofx.serial.LoopState) -> None:
    assert a.step == b.step and a.scaler_state == b.scaler_state, step
    for x, y in zip(sofx.tree.flatten((a.params, a.opt_state))[0], sofx.tree.flatten((b.params, b.opt_state))[0]):
        assert torch.equal(x, y), f"step {step}: the speculative loop left the serial one"


def _assert_loops_close(step: int, a: sofx.serial.LoopState, b: sofx.serial.LoopState) -> None:
    """Within DESIGN.md's float32 rounding (an algebraic undo's), with the same counts and loss scale."""
    assert a.step == b.step and a.scaler_state == b.scaler_state, step
    assert all(torch.equal(x, y) for x, y in zip(*(sofx.tree.flatten(s.opt_state.count)[0] for s in (a, b))))
    for x, y in zip(sofx.tree.flatten((a.params, a.opt_state))[0], sofx.tree.flatten((b.params, b.opt_state))[0]):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step}: donated: {m}")


@pytest.mark.parametrize("precision", [FP32, FP32_L2, BF16], ids=["fp32", "fp32-adam_l2", "bf16"])
def test_a_functional_loop_with_every_feature_equals_torch_optim_and_speculation_equals_it_bitwise(
        tmp_path, precision: Precision):
    """serial_loop_step on the params of a module through functional_call, against torch's loop over the
    module (see the module docstring for the events and the tolerance), and speculative_loop_step beside it,
    bitwise the serial one at every step: blocks speculated in backward's order, undone for overflows, undone
    and redone for clips and for the hparams changed between backward and the step, vetoed, paused by the adaptive
    policy. The checkpoint holds the loops and the changed base lrs. bf16: a bf16 module (parameters,
    gradients, their sums) against ``fused=True``, without clipping: bit for bit throughout. adam_l2: sofx.adam
    against torch.optim.Adam (L2 weight decay, its own inverse)."""
    torch.manual_seed(0)
    max_norm = precision.max_norm
    ref = TorchRun(Net().to(precision.dtype), precision)
    template = Net().to(precision.dtype)
    params = {k: v.detach().clone() for k, v in ref.model.named_parameters()}
    labels = {name: group_of(name) for name in params}
    base, options = dict(BASE_LR), {g: dict(o) for g, o in GROUP_OPTIONS.items()}

    def hparams(t: int) -> Any:
        return sofx.transforms.group_hparams(labels, _hparams(base, options)(t), params=params)

    opt = (sofx.adamw if precision.decoupled else sofx.adam)(backend=precision.backend)
    rule = loss_scale.grad_scaler(**SCALING)
    ser = spec = sofx.serial.init_loop(opt, params, rule)
    donated = sofx.serial.init_loop(opt, {k: v.clone() for k, v in params.items()}, rule)
    mine = ChainLoop(params, opt.init(params), _chain(max_norm).init(params), rule.init())
    config = SpeculationConfig(max_norm=max_norm)
    names = sorted(params)  # the leaf order (optree sorts dict keys)
    arrival = sorted(range(len(names)), key=lambda i: BACKWARD_ORDER.index(names[i].split(".")[0]))
    gen, tgen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    seen = {"skipped": 0, "growth": 0, "clipped": 0, "undone": 0, "redone": 0, "speculated": 0, "lr_redone": 0}
    first_clip = None
    for step in range(STEPS):
        stepped = ref.step(tgen, step)
        S = rule.scale(ser.scaler_state)
        grads = _accumulated_grads(ser.params, gen, step, S, template)
        assumed = hparams(spec.step)  # what the speculative steps during backward took
        if step == LR_CHANGE_AT:
            base["head"] = HEAD_LR_AFTER
            options["head"].update(HEAD_CHANGES)
        ser, facts = serial_loop_step(opt, ser, grads, scaler=rule, hparams=hparams, max_norm=max_norm)
        spec, report = speculative_loop_step(opt, spec, grads, config=config, scaler=rule, hparams=assumed,
                                             validation_hparams=hparams, order=arrival)
        donated, _ = speculative_loop_step(opt, donated, grads, config=config, scaler=rule, hparams=assumed,
                                           validation_hparams=hparams, order=arrival, donate=True)
        mine, taken = _chain_step(opt, rule, mine, grads, hparams, max_norm)
        assert facts.skipped == (not stepped) == (step in OVERFLOW_AT), step
        assert rule.scale(ser.scaler_state) == ref.scaler.get_scale() and ser.step == ref.sched.last_epoch, step
        first_clip = step if facts.clipped and first_clip is None else first_clip
        _compare(step, ser.params, ser.opt_state, ref.model, ref.opt, bitwise=first_clip is None)
        _assert_loops_bitwise(step, spec, ser)
        _assert_loops_close(step, donated, ser)
        assert taken == stepped and mine.scaler_state == ser.scaler_state and mine.step == ser.step, step
        _compare(step, mine.params, mine.opt_state, ref.model, ref.opt, bitwise=first_clip is None)
        for key, n in [("skipped", facts.skipped), ("growth", rule.scale(ser.scaler_state) > S),
                       ("clipped", facts.clipped), ("undone", report.undone), ("redone", report.redone),
                       ("speculated", report.speculated), ("lr_redone", report.redone * (step == LR_CHANGE_AT))]:
            seen[key] += n
        if step == SAVE_AT:
            ref.reload()
            ser, spec, donated, mine, base, options = sofx.checkpoint.load(sofx.checkpoint.save(
                tmp_path / "run.ckpt", (ser, spec, donated, mine, base, options)), types=[ChainLoop])
            params = ser.params
    if max_norm is None:
        assert first_clip is None
    else:
        assert first_clip is not None and first_clip >= CLIP_FROM and seen["clipped"] >= 3, (first_clip, seen)
    assert seen["skipped"] == len(OVERFLOW_AT) and seen["growth"] >= 2, seen
    assert seen["speculated"] > 0 and seen["undone"] > seen["redone"] >= seen["lr_redone"] > 0, seen
    assert 0 < ser.opt_state.count["aux.weight"] < ser.opt_state.count["head.weight"]  # steps without aux's



def _torch_group_names(model: Net) -> list[list[str]]:
    """The parameter names of torch's param groups, in their order (``groups=`` of the torch.optim interop)."""
    return [[n for n, _ in model.named_parameters() if group_of(n) == g] for g in BASE_LR]


def _serial_from_torch(ref: TorchRun, opt: sofx.Adam, rule: Any, hparams: Callable[[int], Any]
                       ) -> sofx.serial.LoopState:
    """The serial loop that takes the torch run over: its parameters, ``from_torch_optim`` of its optimizer's
    state dict, GradScaler's scale and growth tracker (from_torch_grad_scaler), its scheduler's position."""
    params = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    state, _ = sofx.checkpoint.from_torch_optim(opt, ref.opt.state_dict(), params, hparams(ref.sched.last_epoch),
                                                groups=_torch_group_names(ref.model))
    carried, scaler_state = loss_scale.from_torch_grad_scaler(ref.scaler)
    assert replace(carried, init_scale=rule.init_scale) == rule  # (its settings: the run's rule)
    return sofx.serial.LoopState(params, state, scaler_state, ref.sched.last_epoch)


def _torch_from_serial(loop: sofx.serial.LoopState, opt: sofx.Adam, rule: Any, hparams: Callable[[int], Any],
                       base: dict[str, float]) -> TorchRun:
    """A torch run that takes the serial loop over: a module of its params, ``to_torch_optim`` of its state
    loaded into AdamW, GradScaler at its scale and growth tracker (to_torch_grad_scaler_state), a LambdaLR of the
    base lrs ``base`` at its schedule position."""
    run = TorchRun(Net())
    with torch.no_grad():
        for n, p in run.model.named_parameters():
            p.copy_(loop.params[n])
    saved = sofx.checkpoint.to_torch_optim(opt, loop.opt_state, hparams(loop.step),
                                           groups=_torch_group_names(run.model))
    for group, g in zip(saved["param_groups"], BASE_LR):
        group["initial_lr"] = base[g]  # (LambdaLR's base lr: not an Adam hparam)
    run.opt.load_state_dict(saved)
    run.scaler.load_state_dict(loss_scale.to_torch_grad_scaler_state(rule, loop.scaler_state))
    run.sched = torch.optim.lr_scheduler.LambdaLR(run.opt, lr_factor, last_epoch=loop.step - 1)
    return run


@pytest.mark.parametrize("direction", ["torch_then_sofx", "sofx_then_torch"])
def test_a_run_handed_over_between_torch_optim_and_the_serial_loop_mid_run_stays_torchs(direction: str) -> None:
    """The combined loop begun in one and, after ``SAVE_AT``, continued in the other through the torch.optim
    interop (``from_torch_optim`` / ``to_torch_optim``, GradScaler's state, the schedule position) equals the
    uninterrupted torch run: bit for bit until the first clip, within 1e-6 after."""
    torch.manual_seed(0)
    ref = TorchRun(Net())
    first = TorchRun(Net())
    first.model.load_state_dict(ref.model.state_dict())
    template = Net()
    params = {k: v.detach().clone() for k, v in ref.model.named_parameters()}
    labels = {name: group_of(name) for name in params}
    base, options = dict(BASE_LR), {g: dict(o) for g, o in GROUP_OPTIONS.items()}

    def hparams(t: int) -> Any:
        return sofx.transforms.group_hparams(labels, _hparams(base, options)(t), params=params)

    opt, rule = sofx.adamw(), loss_scale.grad_scaler(**SCALING)
    loop = sofx.serial.init_loop(opt, params, rule)
    gens = [torch.Generator().manual_seed(1) for _ in range(2)]
    first_clip, handed_over = None, False
    for step in range(STEPS):
        stepped = ref.step(gens[0], step)
        in_torch = (direction == "torch_then_sofx") != handed_over
        if in_torch:
            first.step(gens[1], step)
        else:
            grads = _accumulated_grads(loop.params, gens[1], step, rule.scale(loop.scaler_state), template)
        if step == LR_CHANGE_AT:  # (the sofx schedule's record of the change, on either side)
            base["head"] = HEAD_LR_AFTER
            options["head"].update(HEAD_CHANGES)
        if not in_torch:
            loop, facts = serial_loop_step(opt, loop, grads, scaler=rule, hparams=hparams, max_norm=MAX_NORM)
            assert facts.skipped == (not stepped), step
            first_clip = step if facts.clipped and first_clip is None else first_clip
        if in_torch:
            for a, b in zip(first.model.parameters(), ref.model.parameters()):
                assert torch.equal(a, b) or first_clip is not None, step
        else:
            _compare(step, loop.params, loop.opt_state, ref.model, ref.opt, bitwise=first_clip is None)
        if step == SAVE_AT:
            handed_over = True
            if direction == "torch_then_sofx":
                loop = _serial_from_torch(first, opt, rule, hparams)
                params = loop.params
            else:
                first = _torch_from_serial(loop, opt, rule, hparams, base)
    if direction == "sofx_then_torch":
        _compare(STEPS, {n: p.detach() for n, p in first.model.named_parameters()},
                 sofx.checkpoint.from_torch_optim(opt, first.opt.state_dict(), params, hparams(first.sched.last_epoch),
                                                  groups=_torch_group_names(first.model))[0],
                 ref.model, ref.opt, bitwise=first_clip is None)  # (torch clipped after the hand-over as ref)
    else:
        assert first_clip is not None  # the clipping steps came after the hand-over


# ------------------------------------------------------------------ the offload facade


def _facade(model: Net, executor: str, undo: str, decoupled: bool = True, **options: Any
            ) -> sofx.offload.SpeculativeAdamW:
    """The facade (SpeculativeAdamW, or SpeculativeAdam where not ``decoupled``) over the module's three param
    groups, with the torch run's loss scaling, clipping and accumulation; blocks of at most 16 elements or one
    parameter (several per group, speculated during backward); ``options``: the facade's others."""
    named = dict(model.named_parameters())
    groups = [dict(params=[p for n, p in named.items() if group_of(n) == g], lr=BASE_LR[g], **GROUP_OPTIONS[g])
              for g in BASE_LR]
    cls = sofx.offload.SpeculativeAdamW if decoupled else sofx.offload.SpeculativeAdam
    return cls(groups, max_grad_norm=MAX_NORM, loss_scale=loss_scale.grad_scaler(**SCALING), executor=executor,
               undo=undo, block_numel=16, gradient_accumulation_steps=MICRO, timeout=60.0, **options)


@dataclass
class FacadeRun:
    """sofx's side: the module, the facade, the schedule's scheduler stepped when the optimizer was."""

    model: Net
    executor: str
    undo: str
    schedule: WarmupCosine | OneCycle
    decoupled: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    opt: sofx.offload.SpeculativeAdamW = field(init=False)
    sched: torch.optim.lr_scheduler.LRScheduler = field(init=False)

    def __post_init__(self) -> None:
        self.opt = _facade(self.model, self.executor, self.undo, self.decoupled, **self.options)
        self.sched = self.schedule.make(self.opt)

    def step(self, gen: torch.Generator, step: int, dtype: torch.dtype = torch.float32):
        """One iteration, as torch's loop (TorchRun.step) with the facade's calls (speculation switched off for
        the steps of ``SPECULATION_OFF``), on batches of the module's ``dtype``; returns the step report."""
        self.opt.speculate = step not in SPECULATION_OFF
        self.opt.zero_grad()
        for micro in range(MICRO):
            micro_backward(self.model, gen, step, micro, dtype, self.opt.backward)
        if step == LR_CHANGE_AT:  # after the blocks were speculated with the old lr
            self.schedule.change_head_hparams(self.opt, self.sched)
        report = self.opt.step()
        if not report.skipped:
            self.sched.step()
        return report

    def reload(self, path, executor: str, dtype: torch.dtype = torch.float32) -> None:
        """Save model, facade and scheduler with sofx.checkpoint, close, and go on with fresh objects (on
        ``executor``)."""
        sofx.checkpoint.save(path, {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                                    "sched": self.sched.state_dict()})
        base_lrs = list(self.sched.base_lrs)
        self.opt.close()
        saved = sofx.checkpoint.load(path)
        self.model = Net().to(dtype)
        self.model.load_state_dict(saved["model"])
        self.executor = executor
        self.__post_init__()
        self.opt.load_state_dict(saved["opt"])
        self.sched.load_state_dict(saved["sched"])
        assert self.sched.base_lrs == base_lrs


def _compare_facade(step: int, run: FacadeRun, ref: TorchRun, bitwise: bool) -> None:
    """The facade's params and per-parameter state against torch's."""
    for (name, p), q in zip(run.model.named_parameters(), ref.model.parameters()):
        state, tstate = run.opt.state[p], ref.opt.state.get(q, {})
        assert int(state["step"]) == (int(tstate["step"]) if tstate else 0), (step, name)
        pairs = [("param", p.detach(), q.detach())]
        if tstate:
            pairs += [(key, state[key], tstate[key]) for key in ("exp_avg", "exp_avg_sq")]
        _assert_pairs(step, name, pairs, bitwise)


@pytest.mark.parametrize("executor,resumed_on,undo,schedule,decoupled,options", [
    ("thread", "inline", "exact", WarmupCosine(), True, {}),
    ("thread", "thread", "auto", OneCycle(), True, {}),
    ("process", "thread", "auto", WarmupCosine(), True, dict(n_device_blocks=2)),
    ("thread", "thread", "auto", WarmupCosine(), False, dict(swap_params=False))],
    ids=["thread-then-inline-exact-warmup_cosine", "thread-auto-one_cycle",
         "process-then-thread-auto-warmup_cosine-device_blocks", "thread-auto-warmup_cosine-adam_l2-copied_params"])
def test_the_facade_with_every_feature_equals_torch_optim(tmp_path, executor: str, resumed_on: str, undo: str,
                                                          schedule: WarmupCosine | OneCycle, decoupled: bool,
                                                          options: dict[str, Any]) -> None:
    """SpeculativeAdamW + a torch scheduler on it against torch's loop (module docstring), resumed from its
    checkpoint on the executor ``resumed_on``, with speculation switched off for a few steps. With
    ``undo="exact"`` an undone speculative step comes back bit for bit, so the run is torch's bit for bit until
    the first clip; with ``"auto"`` an algebraic undo restores to float32 rounding (README), so bit for bit
    until the first step that undid something, then within 1e-6. OneCycleLR moves beta1 at every step.
    adam_l2: SpeculativeAdam against torch.optim.Adam. ``options``: two blocks stepped in ``step()`` on the
    module's device (partial offload: here the CPU), the new parameters copied rather than swapped in."""
    torch.manual_seed(0)
    model = Net()
    ref = TorchRun(Net(), FP32 if decoupled else FP32_L2, schedule=schedule)
    ref.model.load_state_dict(model.state_dict())
    run = FacadeRun(model, executor, undo, schedule, decoupled, options)
    gen, tgen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    seen = {"skipped": 0, "clipped": 0, "undone": 0, "redone": 0, "speculated": 0, "lr_redone": 0}
    exact_until = None  # the first step after which the runs may differ by rounding
    try:
        for step in range(STEPS):
            stepped = ref.step(tgen, step)
            report = run.step(gen, step)
            assert report.skipped == (not stepped) == (step in OVERFLOW_AT), step
            assert report.scale == ref.backward_scale, step
            assert run.sched.last_epoch == ref.sched.last_epoch, step
            assert report.speculated == 0 or step not in SPECULATION_OFF, step
            assert run.opt.executor == (executor if step <= SAVE_AT else resumed_on), step
            if exact_until is None and (report.clipped or (undo == "auto" and report.undone)):
                exact_until = step
            _compare_facade(step, run, ref, bitwise=exact_until is None)
            for key, n in [("skipped", report.skipped), ("clipped", report.clipped), ("undone", report.undone),
                           ("redone", report.redone), ("speculated", report.speculated),
                           ("lr_redone", report.redone * (step == LR_CHANGE_AT))]:
                seen[key] += n
            if step == SAVE_AT:
                ref.reload()
                run.reload(tmp_path / "run.ckpt", resumed_on)
    finally:
        run.opt.close()
    assert seen["skipped"] == len(OVERFLOW_AT) and seen["clipped"] >= 3, seen
    assert seen["speculated"] > 0 and seen["undone"] > seen["lr_redone"] > 0 and seen["redone"] > 0, seen
    if undo == "exact":
        assert exact_until >= CLIP_FROM, exact_until
    assert 0 < run.opt.state[run.model.aux.weight]["step"] < run.opt.state[run.model.head.weight]["step"]


@dataclass
class TorchMastersRun:
    """torch's mixed-precision recipe for a bf16 module: AdamW over fp32 master copies of its parameters, each
    micro-step's bf16 gradients summed in float32 into the masters' ``.grad``, GradScaler + ``clip_grad_norm_``
    on the masters, the new masters rounded into the module after each step."""

    model: Net
    masters: list[nn.Parameter] = field(init=False)
    opt: torch.optim.AdamW = field(init=False)
    scaler: torch.amp.GradScaler = field(init=False)
    sched: torch.optim.lr_scheduler.LRScheduler = field(init=False)
    backward_scale: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.build([p.detach().float() for p in self.model.parameters()])

    def build(self, masters: list[torch.Tensor]) -> None:
        self.masters = [nn.Parameter(m.clone()) for m in masters]
        names = [n for n, _ in self.model.named_parameters()]
        groups = [dict(params=[m for n, m in zip(names, self.masters) if group_of(n) == g], lr=BASE_LR[g],
                       **GROUP_OPTIONS[g]) for g in BASE_LR]
        self.opt = torch.optim.AdamW(groups, foreach=False)
        self.scaler = torch.amp.GradScaler("cpu", **SCALING)
        self.sched = WarmupCosine().make(self.opt)

    def step(self, gen: torch.Generator, step: int) -> bool:
        """One iteration (TorchRun.step's, on the masters); returns whether the optimizer stepped."""
        self.opt.zero_grad()
        for micro in range(MICRO):
            micro_backward(self.model, gen, step, micro, self.model.inp.weight.dtype,
                           lambda loss: self.scaler.scale(loss).backward())
            for p, m in zip(self.model.parameters(), self.masters):
                if p.grad is not None:
                    m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                    p.grad = None
        if step == LR_CHANGE_AT:
            WarmupCosine().change_head_hparams(self.opt, self.sched)
        before = self.backward_scale = self.scaler.get_scale()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.masters, MAX_NORM)
        stepped = scaler_step(self.scaler, self.opt, self.sched, before)
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m)
        return stepped

    def reload(self) -> None:
        """Save masters, optimizer, scaler and scheduler through torch.save, then go on with fresh objects."""
        saved = through_torch_save({"masters": [m.detach() for m in self.masters], "opt": self.opt.state_dict(),
                                    "scaler": self.scaler.state_dict(), "sched": self.sched.state_dict()})
        self.model = Net().to(self.model.inp.weight.dtype)
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), saved["masters"]):
                p.copy_(m)
        self.build(saved["masters"])
        load_opt_scaler_sched(self, saved)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_facade_on_a_half_precision_module_equals_torch_optim_over_fp32_masters(tmp_path,
                                                                                    dtype: torch.dtype) -> None:
    """A bf16 (fp16) module: the facade keeps fp32 masters itself and sums each micro-step's bf16 gradients in
    float32 (its gradient buffers are the masters' dtype), which is torch's recipe of fp32 master copies whose
    ``.grad`` takes the float32 sum of the micro-steps' bf16 gradients, not the bf16 ``.grad`` autograd would
    accumulate on the module itself. The same events as the other loops (thread executor, ``undo="auto"``, resumed
    on the process executor); masters, moments and counts compared, and the module's bf16 parameters: bit for bit until
    the first step that undid or clipped something, within 1e-6 after (the module's parameters: their bf16
    rounding of the masters)."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    ref = TorchMastersRun(Net().to(dtype))
    ref.model.load_state_dict(model.state_dict())
    ref.__post_init__()
    run = FacadeRun(model, "thread", "auto", WarmupCosine())
    gen, tgen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    exact_until, undone, overflows = None, 0, 0
    try:
        for step in range(STEPS):
            stepped = ref.step(tgen, step)
            report = run.step(gen, step, dtype)
            assert report.skipped == (not stepped) and (report.skipped or step not in OVERFLOW_AT), step
            overflows += report.skipped
            assert report.scale == ref.backward_scale and run.sched.last_epoch == ref.sched.last_epoch, step
            if exact_until is None and (report.clipped or report.undone):
                exact_until = step
            undone += report.undone
            bitwise = exact_until is None
            for (name, p), q, m in zip(run.model.named_parameters(), ref.model.parameters(), ref.masters):
                state, tstate = run.opt.state[p], ref.opt.state.get(m, {})
                assert int(state["step"]) == (int(tstate["step"]) if tstate else 0), (step, name)
                pairs = [("master", state["master"], m.detach())]
                pairs += [(key, state[key], tstate[key]) for key in ("exp_avg", "exp_avg_sq") if tstate]
                _assert_pairs(step, name, pairs, bitwise)
                assert torch.equal(p.detach(), state["master"].to(dtype)), (step, name)
                if bitwise:
                    assert torch.equal(p.detach(), q.detach()), (step, name)
            if step == SAVE_AT:
                ref.reload()
                run.reload(tmp_path / "run.ckpt", "process", dtype)
    finally:
        run.opt.close()
    assert exact_until is not None and undone > 0
    # fp16: the heavy steps' gradients overflow too, in backward, in both runs
    assert overflows == len(OVERFLOW_AT) if dtype == torch.bfloat16 else overflows > len(OVERFLOW_AT)
