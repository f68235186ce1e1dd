"""What happened in one optimizer step: the numbers users and benchmarks need.

A :class:`StepReport` is produced by validation (:func:`sofx.speculate.plan_validation`)
and by :func:`sofx.speculate.speculative_step`. Block counts:

``speculated``    speculative steps taken during backward
``committed``     speculative steps that stood as they were
``undone``        speculative steps undone (with or without a redo)
``redone``        undone steps taken again with the final gradient, scale and hparams
``vetoed``        ready blocks not speculated because of an early veto (clipping
                  certain, a non-finite gradient, an unscaled norm too large to
                  undo safely) or a step-wide one (hparams a block refuses, a
                  loss scale that cannot unscale, ``max_norm=0``, a loss-scale
                  rule whose ``update`` fails to predict the scale)
``ineligible``    ready blocks not speculated because their step could not be
                  undone within the snapshot budget
``refused``       speculative steps taken back as they ran (undone at once: the
                  step found that its snapshot would go beyond the budget),
                  then stepped late
``stepped_late``  blocks stepped in validation without a speculative step
                  (vetoed, ineligible, refused, policy pause, earlier
                  micro-steps, missing gradient with ``missing_grad="zero"``;
                  in the offload engine also a block kept on the device, one
                  held from speculating under ``ddp`` until the ranks decided
                  whether to compare their states, a gradient set by hand)
``not_stepped``   blocks without a step this iteration (overflow, or a missing
                  gradient with ``missing_grad="skip"``)

Global facts: ``skipped``/``overflow`` (a non-finite gradient: the step was
skipped; a step whose loss-scale rule failed is skipped, an overflow only where
a gradient overflowed), ``clipped``, ``clip_coef`` (multiplier of the unscaled gradients),
``grad_norm`` (unscaled global norm), ``scale`` (the loss scale the gradients
were unscaled with), ``next_scale`` (the scale for the next step),
``backward_scale`` (the scale this step's backward multiplied the loss by: under
``"deepspeed"``, which updates the scale before unscaling, ``scale`` is already
the updated one; ``nan``: not known, a report made by hand),
``grad_scale`` (the one multiplier Adam applied to the raw gradients).
``speculating``: whether this step was allowed to speculate
(``not_speculating_reason`` says why not: disabled, not the last micro-step,
the adaptive policy, or a step no speculative block could stand: hparams a
block refuses, a loss scale that cannot unscale, ``max_norm=0``, a loss-scale rule that cannot predict the scale of a
clean step; in the offload engine, every block ready during backward held from speculating: kept on the device,
under ``ddp`` before the ranks' exchange, or one whose step ``step()`` refuses: a count at int64's largest, a step size
``lr / (1 - beta1**t)`` beyond float32). ``policy_paused``/``policy_reason``: the adaptive
policy's state *after* this step ("paused: clipping fired on 5 of the last 8
steps ...", "resumed: ..."; a disabled policy never pauses: ``False`` and ``""``,
whatever state it was given and carries). ``veto_reason``: why speculation was vetoed
during backward. ``actions``: the validation action of every block.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["StepReport"]


@dataclass(frozen=True)
class StepReport:
    """Counts and global facts of one step (see the module docstring)."""

    blocks: int
    speculated: int = 0
    committed: int = 0
    undone: int = 0
    redone: int = 0
    vetoed: int = 0
    ineligible: int = 0
    stepped_late: int = 0
    not_stepped: int = 0
    skipped: bool = False
    overflow: bool = False
    clipped: bool = False
    clip_coef: float = 1.0
    grad_norm: float = math.nan
    scale: float = 1.0
    next_scale: float = 1.0
    grad_scale: float = 1.0
    speculating: bool = True
    not_speculating_reason: str = ""
    policy_paused: bool = False
    policy_reason: str = ""
    veto_reason: str = ""
    actions: tuple[str, ...] = field(default=())
    refused: int = 0
    backward_scale: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (for logging, dataframes and plots)."""
        return asdict(self)

    def summary(self) -> str:
        """One line: ``spec 12 commit 12 undo 0 redo 0 veto 0 inelig 0 late 4 | norm 0.93 scale 65536``; a scale
        that changed as ``scale 65536 -> 32768``, from the scale of the backward (``backward_scale``, else
        ``scale``) to ``next_scale``."""
        head = "SKIPPED (overflow) " if self.skipped and self.overflow else "SKIPPED " if self.skipped else ""
        line = (f"{head}spec {self.speculated} commit {self.committed} undo {self.undone} redo {self.redone} "
                f"veto {self.vetoed} inelig {self.ineligible}{f' refused {self.refused}' if self.refused else ''} "
                f"late {self.stepped_late} | "
                f"norm {self.grad_norm:.4g}{' clipped' if self.clipped else ''} scale ")
        # (from the backward's: under "deepspeed" scale is the updated one already, and an overflow's 8 -> 4 showed 4)
        first = self.scale if math.isnan(self.backward_scale) else self.backward_scale
        if first != self.next_scale and not (math.isnan(first) and math.isnan(self.next_scale)):
            short = f"{first:g}", f"{self.next_scale:g}"
            if short[0] == short[1]:  # a change below 6 digits: every digit, not ``65536 -> 65536``
                short = repr(float(first)), repr(float(self.next_scale))
            line += f"{short[0]} -> {short[1]}"
        else:
            line += f"{first:g}"
        if self.policy_reason:
            line += f" | policy: {self.policy_reason}"
        if self.veto_reason:
            line += f" | veto: {self.veto_reason}"
        return line
