"""The adaptive speculation policy: stop speculating while clipping keeps firing.

When clipping fires on most recent steps (typical during warm-up), every
speculative step costs an undo and a redo, i.e. more work than not
speculating. The policy watches the clip outcome of validated steps::

    pause   when more than ``pause_fraction * window`` of the last ``window``
            validated steps clipped (``n / window > pause_fraction``: exactly
            70% of a window is not more than ``pause_fraction=0.7``);
    resume  after ``quiet_steps`` consecutive validated steps without clipping
            (the clip outcome is still known while paused: validation always
            computes the global norm); the history then starts afresh.

Skipped (overflow) steps carry no clip information and leave the state as is.
State is an immutable :class:`PolicyState`; :meth:`AdaptivePolicy.update` is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from sofx.errors import HParamError
from sofx.kernels.user_numbers import _described, fact_value, finite_number, flag, integer
from sofx.tree import article

__all__ = ["AdaptivePolicy", "PolicyState", "checked_policy_state"]


class PolicyState(NamedTuple):
    """Recent clip outcomes (oldest first), whether speculation is paused, and why."""

    recent: tuple[bool, ...] = ()
    paused: bool = False
    quiet: int = 0
    reason: str = ""


def checked_policy_state(state: PolicyState, name: str = "policy_state", keyed: bool = False) -> PolicyState:
    """``state``, a :class:`PolicyState`, with its fields read as the policy reads them, else an
    :class:`HParamError` naming the field (``policy_state.recent[1]``; ``keyed``: as a dict's entry,
    ``policy_state['recent'][1]``, for a saved state) and what it got: ``recent`` a tuple of bools (a list is taken
    as its tuple, numpy bools as Python ones), ``paused`` a bool, ``quiet`` an integer >= 0, ``reason`` a str. A
    state made by hand with others was taken as it was: ``paused="no"`` as paused, a ``recent`` entry ``2`` as two
    clipped steps, and a ``recent`` list or ``None`` raised Python's bare TypeError from the validation that
    followed the speculative steps."""
    def field(f: str) -> str:
        return f"{name}[{f!r}]" if keyed else f"{name}.{f}"

    recent = state.recent
    if not isinstance(recent, (tuple, list)):
        raise HParamError(f"{field('recent')} = {recent!r:.80} is invalid; expected a list or tuple of bools (the "
                          f"clip outcomes of the last steps, oldest first), got {_described(recent)}")
    recent = tuple(flag(f"{field('recent')}[{k}]", x) for k, x in enumerate(recent))
    paused = flag(field("paused"), state.paused)
    quiet = integer(field("quiet"), state.quiet, 0)
    if not isinstance(state.reason, str):
        raise HParamError(f"{field('reason')} = {state.reason!r:.80} is invalid; expected a str, got "
                          f"{_described(state.reason)}")
    return PolicyState(recent, paused, quiet, state.reason)


def _read_state(state: Any, where: str) -> PolicyState:
    """``state`` as :func:`checked_policy_state` reads it, for :meth:`AdaptivePolicy.allows` and
    :meth:`~AdaptivePolicy.update` (``where``), which run every step: a state of exactly the fields' types (one the
    policy made) is taken as it is, in a few type checks; anything else is read field by field, else an
    :class:`HParamError` naming ``where``, the field and what it got. Called by hand they took a state made by hand
    as it was: ``paused="no"`` as paused, ``recent=None`` or a str ``quiet`` raised Python's bare TypeError, a tuple
    a bare AttributeError."""
    if (type(state) is PolicyState and type(state.recent) is tuple and type(state.paused) is bool
            and type(state.quiet) is int and state.quiet >= 0 and type(state.reason) is str
            and all(type(x) is bool for x in state.recent)):
        return state
    if not isinstance(state, PolicyState):
        raise HParamError(f"{where}: state is {article(type(state).__name__)}; expected a PolicyState (as the policy's "
                          "init() makes it)")
    return checked_policy_state(state, f"{where}: state")


@dataclass(frozen=True)
class AdaptivePolicy:
    """Pause speculation while clipping fires on most recent steps (see the module docstring).

    ``enabled=False`` never pauses: a state it is given (a checkpoint of a run with the policy on) is checked and
    carried (:meth:`allows` and :meth:`update` take no decision from it, nor record the step in it), and the step
    report shows no pause.
    """

    enabled: bool = True
    window: int = 8
    pause_fraction: float = 0.5
    quiet_steps: int = 4

    def __post_init__(self) -> None:
        # read once as Python numbers (numpy's were refused): window and quiet_steps are counts
        window = integer("AdaptivePolicy.window", self.window, 1)
        pause_fraction = finite_number("AdaptivePolicy.pause_fraction", self.pause_fraction)
        if not 0 <= pause_fraction < 1:
            raise HParamError(f"AdaptivePolicy.pause_fraction = {self.pause_fraction!r} is invalid; "
                              "expected 0 <= pause_fraction < 1")
        quiet_steps = integer("AdaptivePolicy.quiet_steps", self.quiet_steps, 1)
        enabled = flag("AdaptivePolicy.enabled", self.enabled)  # a Python bool ("no" was stored, and read as true)
        for name, value in (("enabled", enabled), ("window", window), ("pause_fraction", pause_fraction),
                            ("quiet_steps", quiet_steps)):
            object.__setattr__(self, name, value)

    def init(self) -> PolicyState:
        """The state before the first step: no history, speculation allowed."""
        return PolicyState()

    def allows(self, state: PolicyState) -> tuple[bool, str]:
        """Whether this step may speculate, and a sentence saying why not (``state`` read as
        :func:`checked_policy_state` reads it: :func:`_read_state`)."""
        state = _read_state(state, "AdaptivePolicy.allows")
        if not self.enabled or not state.paused:
            return True, ""
        return False, state.reason

    def update(self, state: PolicyState, clipped: bool | None) -> PolicyState:
        """The state after a validated step (``clipped=None``: a skipped step, no information; ``state`` read as
        :func:`checked_policy_state` reads it: :func:`_read_state`)."""
        state = _read_state(state, "AdaptivePolicy.update")
        if clipped is not None and type(clipped) is not bool:  # (validation's is a Python bool)
            # a Python or numpy bool, or a 0-d bool tensor (as the loss-scale rules take overflow); "no" and 1.0
            # were taken by their truth, as clipped, and a tensor of several elements raised torch's bare error
            clipped = flag("AdaptivePolicy.update: clipped", fact_value(clipped, "AdaptivePolicy.update: clipped"))
        if not self.enabled or clipped is None:
            return state
        if state.paused:
            quiet = 0 if clipped else state.quiet + 1
            if quiet >= self.quiet_steps:
                return PolicyState((), False, 0, f"resumed: {quiet} steps without clipping")
            return PolicyState(state.recent, True, quiet,
                               f"paused: clipping fired on most recent steps; {quiet} of {self.quiet_steps} "
                               "quiet steps needed to resume")
        recent = (state.recent + (bool(clipped),))[-self.window:]
        n_clipped = sum(recent)
        # (the fraction n/window, correctly rounded, against pause_fraction: the product pause_fraction * window
        # rounds below a whole number, 0.7 * 90 to 62.99999999999999, and paused on exactly 70% of the window)
        if n_clipped / self.window > self.pause_fraction:
            return PolicyState(recent, True, 0,
                               f"paused: clipping fired on {n_clipped} of the last {len(recent)} steps "
                               f"(each would cost an undo and a redo); resuming after {self.quiet_steps} "
                               "steps without clipping")
        return PolicyState(recent, False, 0, "")
