"""Ctrl-C held back while the engine changes state that must change whole.

Python raises ``KeyboardInterrupt`` in the main thread between any two bytecodes. Inside the
engine's bookkeeping (an operation sent to the executor but not yet recorded as sent, a result
taken from a queue but not yet counted, a block's undo record used but the block still marked
speculative) such an interrupt would leave the optimizer inconsistent: a later ``zero_grad()``
would commit a step it should undo, or wait for a result that was dropped. A script may catch
the interrupt and go on (README), so these sections hold SIGINT back and deliver it as soon as
they end: the interrupt arrives a little late, between two consistent states.

An engine created in the main thread installs an :class:`InterruptGate` as the SIGINT handler
(:func:`acquire_gate`; engines share one) and removes it when the last of them closes in the
main thread (:func:`release_gate`; closed elsewhere, e.g. collected on another thread, it leaves
the gate in place, which only passes signals on), unless something else replaced it since
(which also ends the holding for the engines still alive). The gate hands every SIGINT to the
handler that was there before, at once outside a section, when the outermost section ends
inside one. A second SIGINT within one section goes through at once: a section that waits for a
worker that does not answer (up to the engine's ``timeout``) can still be interrupted by pressing
Ctrl-C twice, at the price of leaving that step's state undefined: the gate counts it
(:func:`section_breaks`), and the engine whose call or gradient hook it broke into refuses every later
call, saying so (close the optimizer then).
While the gate is installed ``asyncio.run`` keeps SIGINT's handler as it finds it (the gate, which
raises ``KeyboardInterrupt`` in the main thread as Python's default handler does) instead of
installing its own, which cancels the main task.

Entering and leaving a section costs two counter updates (the handler is not swapped per section:
``signal.signal`` takes ~4 us, and a section runs for every gradient). Python runs signal
handlers in the main thread only, so sections in other threads (autograd's device threads, the
executors' own) hold nothing and need not; where SIGINT is ignored or has the default action (not
a Python handler), or the engine is made in another thread, there is no gate (:data:`NO_GATE`).

Calls that turn grad mode off for their whole span, outside any section (the facade's ``step()``, which runs the
user's closure), use :func:`without_grad` instead of ``torch.no_grad()``, which an interrupt can leave off.
"""

from __future__ import annotations

import dis
import functools
import signal
import threading
from types import FrameType
from typing import Any, Callable, TypeVar

import torch

__all__ = ["InterruptGate", "NO_GATE", "acquire_gate", "release_gate", "section_breaks", "without_grad"]

_F = TypeVar("_F", bound=Callable[..., Any])


class InterruptGate:
    """The SIGINT handler while engines live; ``with gate:`` is a section that holds SIGINT back."""

    def __init__(self, previous: Callable[[int, FrameType | None], Any]) -> None:
        self._previous = previous  # the handler before: receives every SIGINT
        self._main = threading.main_thread().ident
        self._depth = 0  # sections entered in the main thread, not yet left
        self._caught: tuple[int, FrameType | None] | None = None
        self._users = 0  # engines that acquired the gate and have not released it (under _lock)
        self._lock = threading.Lock()  # a release may run on another thread (an engine collected there)
        #: Signals passed on inside a section (a second Ctrl-C) whose handler raised there (``KeyboardInterrupt``):
        #: each may have left a section's state half changed (see :func:`section_breaks`). A handler that returns
        #: (a script's "stop after this step" flag) breaks nothing.
        self.breaks = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self._depth and self._caught is None:
            self._caught = (signum, frame)
        else:  # outside a section, or a second Ctrl-C within one: at once
            self._caught = None
            if not self._depth:
                self._previous(signum, frame)
                return
            try:
                self._previous(signum, frame)
            except BaseException:
                self.breaks += 1
                if frame is not None and frame.f_code is _EXIT_CODE and frame.f_lasti < _EXIT_DECREMENT:
                    # Raised as a section's __exit__ began (Python runs handlers at a function's entry and after a C
                    # call), before its count went down: left counted, every later first Ctrl-C was held for good
                    self._depth -= 1
                raise

    def __enter__(self) -> InterruptGate:
        if threading.get_ident() == self._main:
            self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        if threading.get_ident() != self._main:
            return
        self._depth -= 1
        if self._depth == 0 and self._caught is not None:
            caught, self._caught = self._caught, None
            self._previous(*caught)  # e.g. raises KeyboardInterrupt here, the section's state whole


# Where a handler raising inside InterruptGate.__exit__ (its frame) left the section counted: before this offset
_EXIT_CODE = InterruptGate.__exit__.__code__
_EXIT_DECREMENT = next(i.offset for i in dis.get_instructions(_EXIT_CODE)
                       if i.opname == "STORE_ATTR" and i.argval == "_depth")


class _NoGate:
    """A section that holds nothing (no gate: see the module docstring)."""

    def __enter__(self) -> _NoGate:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


NO_GATE = _NoGate()


def section_breaks(gate: InterruptGate | _NoGate) -> int | None:
    """How many signals ``gate`` has passed on inside a section so far whose handler raised there (a second Ctrl-C's
    ``KeyboardInterrupt``, which may leave the section's state half changed), as the calling thread sees it: None
    outside the main thread or without a gate (nothing is held there, so nothing is broken into). A call compares it
    at its start and end to know whether it was broken into."""
    if not isinstance(gate, InterruptGate) or threading.get_ident() != gate._main:
        return None
    return gate.breaks


def acquire_gate() -> InterruptGate | _NoGate:
    """The process's :class:`InterruptGate`, installed now if it is not yet; :data:`NO_GATE` outside the main thread
    or where SIGINT has no Python handler. Give it back with :func:`release_gate`."""
    if threading.current_thread() is not threading.main_thread():
        return NO_GATE
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, InterruptGate):
        with current._lock:
            current._users += 1
        return current
    if not callable(current):
        return NO_GATE
    gate = InterruptGate(current)
    gate._users = 1
    signal.signal(signal.SIGINT, gate)
    return gate


def release_gate(gate: InterruptGate | _NoGate) -> None:
    """Give back what :func:`acquire_gate` returned; the last user puts the handler before it back (from the main
    thread, and where the gate is still the handler: a handler installed since is left alone)."""
    if not isinstance(gate, InterruptGate):
        return
    with gate._lock:
        gate._users -= 1
        users = gate._users
    if users > 0 or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is gate:
        signal.signal(signal.SIGINT, gate._previous)


def without_grad(fn: _F) -> _F:
    """``fn`` run with grad mode off, as under ``@torch.no_grad()``, and the mode before put back however it ends,
    a Ctrl-C included.

    ``torch.no_grad()`` switches grad mode off inside its ``__enter__`` and back inside its ``__exit__``, both Python
    functions: a ``KeyboardInterrupt`` raised in ``__enter__`` after the switch (Python raises it after any C call)
    never reaches ``__exit__``, one raised as ``__exit__`` starts skips the switch back, and a script that caught the
    Ctrl-C and went on found grad mode off (its next backward: "element 0 of tensors does not require grad"). Here
    both switches are single C calls in a ``try``/``finally`` of one frame: no Python call comes between the end of
    ``fn`` and the switch back, where an interrupt could be raised."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        before = torch.is_grad_enabled()
        try:
            torch._C._set_grad_enabled(False)
            return fn(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(before)

    return run  # type: ignore[return-value]
