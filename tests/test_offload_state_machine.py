"""Hypothesis state machine: the facade against torch.optim under random sequences of events.

Each run builds one of the harness's models (shared/tied and frozen parameters included) twice: one
trained with ``sofx.offload.SpeculativeAdamW`` (a random executor, CPU backend, block size, partial
offload, gradient accumulation, clipping norm, undo mode, swapped or copied parameters), the copy with
``torch.optim.AdamW`` + ``clip_grad_norm_`` + ``torch.amp.GradScaler`` (the "torch" profile's
definition). Every step draws its events: a gradient boosted past the clipping norm (on a random
parameter, so on blocks speculated early or late), an inf or nan gradient (overflow: skipped step, scale
backoff), hyperparameters of one param group changed between backward and ``step()`` (lr, betas, weight
decay: validation must redo the speculated blocks with the new values), or the gradients thrown away
after backward (``zero_grad`` without ``step()``: what was speculated is undone, nothing else changes).
Between steps the optimizer may be replaced by a new one loaded from its ``state_dict()`` (a resumed run).

After every step: the same skip decision and loss scale as the GradScaler, and the model's parameters
and the engine's masters within DESIGN.md's float32 rounding of torch's (1e-6 relative per step). Then
masters, moments and model are set to torch's values, so that every step is checked at the per-step
tolerance. An algebraic undo restores the moments to a few ulps of the stepped ones (SPECULATION.md:
"the moments suffer cancellation"; README): where the undone gradient dominated the second moment,
several overflow steps undone in a row add up (1.6e-6 after three without the re-synchronisation), and
a redo with a much smaller gradient magnifies it by about 1/coef^2 (with this harness's beta2 = 0.99 a
x100 boost, clip coefficients down to ~0.07, gave 1.2e-6). So under ``undo="auto"`` a boost is x3, under
``undo="exact"`` (snapshots, bit for bit) x100. This machine found a real bug: a donated first step was
recorded as not fresh (its moments were read after the kernel overwrote them), and its undo left
leftovers that a clipped redo magnified.
"""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from test_offload_support import MODELS, param_groups, relative_deviation, tensor_deviation

import sofx.offload
from sofx.loss_scale import grad_scaler

TOL = 1e-6


class OffloadMachine(RuleBasedStateMachine):
    @initialize(model_name=st.sampled_from(["mlp", "transformer"]),
                executor=st.sampled_from(["inline", "thread", "thread", "process"]),
                accumulate=st.integers(1, 2), block_numel=st.sampled_from([40, 200, 1 << 20]),
                max_norm=st.sampled_from([1.0, 20.0]), undo=st.sampled_from(["auto", "auto", "exact"]),
                backend=st.sampled_from(["auto", "auto", "cpu_fast", "reference"]), n_device_blocks=st.integers(0, 1),
                swap_params=st.booleans(), seed=st.integers(0, 2 ** 16))
    def setup(self, model_name, executor, accumulate, block_numel, max_norm, undo, backend, n_device_blocks,
              swap_params, seed):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)
        make_model, self.make_batch, self.loss_fn = MODELS[model_name]
        torch.manual_seed(seed)
        self.model = make_model()
        self.ref = copy.deepcopy(self.model)
        self.accumulate, self.max_norm = accumulate, max_norm
        self.boost = 100.0 if undo == "exact" else 3.0  # see the module docstring
        self.make_opt = lambda: sofx.offload.SpeculativeAdamW(
            param_groups(self.model), lr=2e-3, betas=(0.9, 0.99), eps=1e-8, max_grad_norm=max_norm,
            loss_scale=grad_scaler(init_scale=2.0 ** 10, growth_interval=3), executor=executor,
            block_numel=block_numel, gradient_accumulation_steps=accumulate, timeout=60.0, undo=undo,
            backend=backend, n_device_blocks=n_device_blocks, swap_params=swap_params)
        self.opt = self.make_opt()
        self.ropt = torch.optim.AdamW(param_groups(self.ref), lr=2e-3, betas=(0.9, 0.99), eps=1e-8, foreach=False)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]

    @rule(boost=st.sampled_from([None, None, 0, 1, 2, 3, 4, 5, 6, 7]),
          bad=st.sampled_from([None, None, None, "inf", "nan"]), bad_param=st.integers(0, 7),
          change=st.sampled_from([None, None, "lr", "betas", "weight_decay"]), group=st.integers(0, 1),
          discard=st.sampled_from([False, False, False, False, True]))
    def step(self, boost, bad, bad_param, change, group, discard):
        self.opt.zero_grad()
        self.ropt.zero_grad()
        for micro in range(self.accumulate):
            batch = self.make_batch(self.gen)
            handles = []
            for m in (self.model, self.ref):
                named = dict(m.named_parameters())
                if boost is not None:
                    handles.append(named[self.names[boost % len(self.names)]].register_hook(
                        lambda g: g * self.boost))
                if bad is not None and micro == self.accumulate - 1:
                    value = math.inf if bad == "inf" else math.nan
                    handles.append(named[self.names[bad_param % len(self.names)]].register_hook(
                        lambda g, value=value: torch.where(torch.arange(g.numel()).view(g.shape) == 0, value, g)))
            self.opt.backward(self.loss_fn(self.model, batch))
            self.scaler.scale(self.loss_fn(self.ref, batch)).backward()
            for h in handles:
                h.remove()
        if discard:  # the gradients are thrown away: nothing changes (the engine undoes what it speculated)
            self.opt.zero_grad()
            self.ropt.zero_grad()
            assert self.opt.engine.loss_scale == self.scaler.get_scale()
            self._check_masters()
            self._resync()
            return
        # Hyperparameters changed after backward (speculated blocks used the old ones), in both optimizers.
        if change is not None:
            for opt in (self.opt, self.ropt):
                g = opt.param_groups[group]
                if change == "lr":
                    g["lr"] = g["lr"] * 0.5
                elif change == "betas":
                    g["betas"] = (0.8, 0.995)
                else:
                    g["weight_decay"] = 0.1
        scale = self.scaler.get_scale()
        report = self.opt.step()
        self.scaler.unscale_(self.ropt)
        torch.nn.utils.clip_grad_norm_([p for p in self.ref.parameters() if p.grad is not None], self.max_norm)
        self.scaler.step(self.ropt)
        self.scaler.update()
        skipped = self.scaler.get_scale() < scale
        assert report.skipped == skipped
        assert report.scale == scale
        assert report.speculated == report.committed + report.undone
        worst = relative_deviation(self.model, self.ref)
        assert worst <= TOL, (worst, report.summary())
        self._check_masters()
        self._resync()

    @rule()
    def resume(self):
        """Replace the optimizer by a new one loaded from its state_dict (the model keeps its values)."""
        state = copy.deepcopy(self.opt.state_dict())
        self.opt.close()
        self.opt = self.make_opt()
        self.opt.load_state_dict(state)
        assert self.opt.engine.loss_scale == self.scaler.get_scale()
        for g, rg in zip(self.opt.param_groups, self.ropt.param_groups):
            assert [g["lr"], tuple(g["betas"]), g["weight_decay"]] == [rg["lr"], tuple(rg["betas"]),
                                                                       rg["weight_decay"]]
        self._check_masters()

    def _check_masters(self):
        """The engine's fp32 masters hold what the model shows (fp32 model: the same values), within the
        per-step tolerance of torch's."""
        for i, q in enumerate(self._ref_params()):
            deviation = tensor_deviation(self.opt.engine.param_state(i)["master"], q)
            assert deviation <= TOL, (i, deviation)

    def _ref_params(self) -> list[torch.Tensor]:
        """torch's parameters in the engine's order (both take the same param groups)."""
        return [p for g in self.ropt.param_groups for p in g["params"]]

    def _resync(self):
        """Give the engine (masters, moments) and the model torch's values (see the module docstring)."""
        engine = self.opt.engine
        with torch.no_grad():
            for i, (p, q) in enumerate(zip(engine.params, self._ref_params())):
                state = engine.param_state(i)
                state["master"].copy_(q)
                p.copy_(q)
                if q in self.ropt.state:
                    assert int(state["step"]) == int(self.ropt.state[q]["step"])
                    state["exp_avg"].copy_(self.ropt.state[q]["exp_avg"])
                    state["exp_avg_sq"].copy_(self.ropt.state[q]["exp_avg_sq"])

    def teardown(self):
        if hasattr(self, "opt"):
            self.opt.close()
            torch.set_num_threads(self.threads)


OffloadMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=8, deadline=None)
TestOffloadMachine = OffloadMachine.TestCase
