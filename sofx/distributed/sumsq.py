"""The sum-of-squares all-reduce: the ``reduce_sumsq`` hook of the serial and speculative loops.

:func:`all_reduce_sumsq` checks the setup and builds a :class:`SumsqReduce`:
the ranks' local sums gathered and added in rank order, the same bits on every
rank; a rank that refuses the step says so in the same collective, and a digest
of each rank's step settings (profile, max_norm, missing_grad, loss-scaler
state, and a loop step's step count) travels with its sum, so that ranks
stepping differently raise there.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Any, Mapping, Sequence

import torch

from sofx.distributed.agreement import _difference, _shortened
from sofx.distributed.groups import (_collective_device, _collective_failure, _data_failure, _lost_rank, dist,
                                     require_initialized)
from sofx.distributed.refusals import RankRefusedError, _as_refusal
from sofx.distributed.setup import _SETUP_KEYWORDS, _agree_setup, _entries, _setup_entries, _setup_hint
from sofx.errors import SofxError
from sofx.kernels.user_numbers import is_bool, real_number
from sofx.required import REQUIRED
from sofx.transforms import _nonnegative_float
from sofx.tree import article

__all__ = ["SumsqReduce", "all_reduce_sumsq"]


# what a step's settings (sofx.serial.step_settings) must agree in, as the hook's error asks for it
_STEP_HINT = ("every rank must step with the same profile, max_norm, missing_grad, loss-scaler state and step count; "
              "nothing was stepped")


class SumsqReduce:
    """The ``reduce_sumsq`` hook :func:`all_reduce_sumsq` returns (see there): callable as
    ``s_local -> s``, :meth:`agreed_sum` for the loops, which also compares the step's settings, and
    :meth:`refuse` for a rank that cannot take part in the step.

    Build it with :func:`all_reduce_sumsq`, not with this constructor: that call is a collective, so a
    misspelt keyword, or a setup or ``device`` that differs, on one rank is refused on every rank there. The
    constructor is not one (it checks only that ``group`` is initialized and has this process): it compares
    nothing across ranks, and what it raises (Python's ``TypeError`` for a misspelt keyword included) is this
    rank's alone, while the other ranks go on to their first step and wait in its collective for this rank
    until the group's timeout."""

    def __init__(self, group: Any = None, device: torch.device | str | None = None) -> None:
        require_initialized(group, "all_reduce_sumsq")
        self.group = group
        self.device = device

    def __call__(self, local: Any = REQUIRED, *extra: Any, **unknown: Any) -> float:
        """The sum over ranks of ``local``; :meth:`agreed_sum` without settings (every rank must call it so).
        Arguments it does not take are refused as this rank's refusal of the step (:meth:`_refuse_call`)."""
        self._refuse_call("the hook", ("local",), local is REQUIRED, extra, unknown)
        return self.agreed_sum(local, None)

    def agreed_sum(self, local: Any = REQUIRED, settings: Mapping[str, Any] | None = None, *extra: Any,
                   **unknown: Any) -> float:
        """The sum over ranks of ``local`` where every rank passed the same ``settings``; else a
        :class:`SofxError` on every rank naming the first setting that differs with each rank's value.

        ``settings``: what the ranks' steps must share (:func:`sofx.serial.step_settings`: profile,
        ``max_norm``, ``missing_grad``, the loss-scaler state; a loop step adds its step count,
        :func:`sofx.serial.with_loop_settings`; the loops pass it through :func:`sofx.serial.reduced_sumsq`), or
        ``None``; named by strings (another name is this rank's refusal of the step). They travel in the sum's
        own collective, as a 48-bit digest of their text: one more float64 per rank beside its sum and its
        refusal flag (24 bytes a rank in place of 16; no further round). Only where the digests differ, the
        error's path, does an ``all_gather_object`` fetch the settings to name what differs; every rank sees the
        same digests, so every rank takes that path, and raises before it steps anything.

        ``local``: this rank's sum of squares, a real number >= 0 (inf or nan: an overflow; ``-0.0``: no
        gradient); another (negative, a bool, a str) is this rank's refusal of the step too.
        """
        self._refuse_call("the hook's agreed_sum", ("local", "settings"), local is REQUIRED, extra, unknown)
        try:
            value = _local_sumsq(local)
        except Exception as e:  # refused in the collective: raised before it, the others would wait for this rank
            error = SofxError(f"all_reduce_sumsq: this rank's local sum of squares is {_shortened(repr(local), 80)} "
                              f"({type(local).__name__}); expected a real number")
            self.refuse(error)
            raise error from e
        if value is None:  # (added, it lowered the others' sum silently: a clip coefficient of another step)
            error = SofxError(f"all_reduce_sumsq: this rank's local sum of squares is {_shortened(repr(local), 80)} "
                              f"({type(local).__name__}); expected a sum of squares >= 0 (inf or nan where a "
                              "gradient is not finite, -0.0 where it has none)")
            self.refuse(error)
            raise error
        try:
            entries = _settings_entries(settings)
        except Exception as e:
            error = _as_refusal("all_reduce_sumsq", e)
            self.refuse(error)
            raise error from e
        return self._gather(value, refused=False, entries=entries)

    def refuse(self, error: BaseException | None = None, *extra: Any, **unknown: Any) -> None:
        """Take part in this step's collective as a rank that refuses the step (``error``: why, for the
        record; this rank raises it itself): every other rank's call raises :class:`RankRefusedError`
        instead of waiting for this rank forever. Where the collective fails (the others gone, or the group's
        timeout), it raises ``error`` itself, the step's cause, not the backend's error (without ``error``, a
        :class:`SofxError` saying the refusal could not be told, the backend's error its cause). The serial and
        speculative loops call it when they raise before reducing. Arguments it does not take are refused after
        it took part, as a :class:`SofxError`."""
        self._refuse_call("the hook's refuse", ("error",), False, extra, unknown)
        try:
            self._gather(math.nan, refused=True)
        except RuntimeError as exc:  # (the others gone: this rank's own error is its step's cause, not gloo's)
            if isinstance(error, Exception):
                raise error from exc
            raise SofxError(f"all_reduce_sumsq: this rank's refusal of the step could not be told to the other ranks "
                            f"({type(exc).__name__}: {exc}) within the process group's timeout (or they exited); "
                            "nothing was stepped on this rank, and the process group may be unusable now (gloo "
                            "closes its connections on a timeout)") from exc

    def _refuse_call(self, what: str, takes: Sequence[str], missing: bool, extra: tuple[Any, ...],
                     unknown: dict[str, Any]) -> None:
        """Where the call of ``what`` (it takes ``takes``, the first required) got an unknown keyword (a misspelt
        one: ``locl=``), a positional argument too many or no ``takes[0]``: take part in the step's collective as
        a rank that refuses it (the others raise :class:`RankRefusedError` instead of waiting for this rank, as
        they did where Python's ``TypeError`` at the call was this rank's), then raise a :class:`SofxError`
        naming what it got and what it takes."""
        if unknown:
            names = ", ".join(map(repr, sorted(unknown)))
            why = f"the unknown keyword argument{'s' if len(unknown) > 1 else ''} {names}"
        elif extra:
            why = (f"{len(extra)} positional argument{'s' if len(extra) > 1 else ''} too many "
                   f"({', '.join(type(a).__name__ for a in extra)})")
        elif missing:
            why = f"no {takes[0]}"
        else:
            return
        error = SofxError(f"all_reduce_sumsq: {what} got {why}; it takes {', '.join(takes)}")
        try:
            self._gather(math.nan, refused=True)
        except RuntimeError as exc:  # (the others gone: this call's own error is the cause, not gloo's)
            raise error from exc
        raise error

    def _gather(self, local: float, refused: bool, entries: dict[str, str] | None = None) -> float:
        group = self.group
        require_initialized(group, "all_reduce_sumsq")
        dev = _collective_device(group, self.device)
        world = dist.get_world_size(group)
        digest = math.nan if entries is None else _digest(entries)
        mine = torch.tensor([local, 1.0 if refused else 0.0, digest], dtype=torch.float64, device=dev)
        parts = [torch.empty(3, dtype=torch.float64, device=dev) for _ in range(world)]
        try:
            dist.all_gather(parts, mine, group=group)
        except RuntimeError as exc:  # (gloo's timeout, or its peer gone; NCCL's DistBackendError is one too)
            if refused:  # (refuse raises this rank's own error, the step's cause)
                raise
            if not _lost_rank(exc):
                raise _collective_failure("all_reduce_sumsq", exc, "this step's reduction of the sum of squares",
                                          "nothing was stepped on this rank") from exc
            raise SofxError(f"all_reduce_sumsq: a rank did not take part in this step's reduction of the sum of "
                            f"squares ({type(exc).__name__}: {exc}) within the process group's timeout (or it "
                            "exited): a rank that raised in its own code before its step, took fewer steps or "
                            "failed; nothing was stepped on this rank, and the process group may be unusable now "
                            "(gloo closes its connections on a timeout); every rank must take every step") from exc
        gathered = torch.stack(parts).tolist()
        refusing = [r for r, (_, flag, _) in enumerate(gathered) if flag != 0.0]
        if refused:
            return math.nan
        if refusing:
            raise RankRefusedError(f"rank{'s' if len(refusing) > 1 else ''} {', '.join(map(str, refusing))} of the "
                                   "process group refused this step before the sum of squares was reduced (see "
                                   "the error raised there); nothing was stepped on this rank", refusing)
        if any(theirs != digest for _, _, theirs in gathered):  # the same on every rank: each takes this path
            everyone: list[Any] = [None] * world
            try:
                dist.all_gather_object(everyone, entries, group=group)
            except RuntimeError as exc:  # (gloo's timeout, or its peer gone; NCCL's DistBackendError is one too)
                raise _data_failure("all_reduce_sumsq", exc, "the exchange that names what differs between the ranks",
                                    "nothing was stepped on this rank (its step's settings differ from another "
                                    "rank's)") from exc
            raise SofxError(_difference("all_reduce_sumsq", everyone, _STEP_HINT, "between ranks at this step"))
        total = -0.0  # IEEE addition's identity: -0.0 (no gradient) on every rank sums to -0.0, as it should
        for value, _, _ in gathered:
            total += value
        return total


def _local_sumsq(local: Any) -> float | None:
    """A rank's local sum of squares ``local`` as a Python float (a Python or numpy number, or a 1-element tensor;
    an int beyond the float range is inf: :func:`sofx.transforms._nonnegative_float`, as
    :func:`~sofx.transforms.total_sumsq` reads a block's); ``None`` where it is a real number but no sum of squares:
    negative (-0.0, no gradient, is none), or a bool (``True`` was 1). Python's ``TypeError`` where it is no real
    number (a str, a tensor of many elements)."""
    if is_bool(local) or (isinstance(local, torch.Tensor) and local.dtype == torch.bool):
        return None
    x = real_number(local, "all_reduce_sumsq: local", SofxError)
    if not isinstance(x, numbers.Real):  # (float() read the str "1.0" as 1.0)
        raise TypeError(f"{type(local).__name__} is no real number")
    return _nonnegative_float(x, "all_reduce_sumsq: local")


def _settings_entries(settings: Mapping[str, Any] | None) -> dict[str, str]:
    """A step's settings as entries (name -> text, a record's fields each its own: ``scaler_state.scale``) that
    are equal on every rank where the settings are (:func:`~sofx.distributed.setup._entries`). A name that is not
    a string is refused (named by its text, ``1`` would read as ``"1"``)."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise SofxError(f"all_reduce_sumsq: settings is {article(type(settings).__name__)}; expected a mapping of "
                        "names to settings (sofx.serial.step_settings) or None")
    out: dict[str, str] = {}
    for name, value in settings.items():
        if not isinstance(name, str):  # (str(1) is "1": {1: x} and {"1": x} had one digest, taken as agreeing)
            raise SofxError(f"all_reduce_sumsq: settings has the name {_shortened(repr(name), 80)} "
                            f"({type(name).__name__}); the names of a step's settings must be strings "
                            f"({_shortened(repr(name), 80)} and {_shortened(repr(str(name)), 80)} would read the same)")
        _entries(name, value, out)
    return out


def _digest(entries: dict[str, str]) -> float:
    """A 48-bit digest of ``entries`` as a float64 (an integer below 2**53: exact), equal on the ranks whose
    entries are, in whatever order (a dict's key order is not part of its value: equal settings built in another
    order raised on every rank that the ranks list them in another order; the error names the first that differs
    in each rank's own order, a loop's step count first)."""
    text = repr(sorted(entries.items())).encode()
    return float(int.from_bytes(hashlib.blake2b(text, digest_size=6).digest(), "little"))


def all_reduce_sumsq(group: Any = None, *extra: Any, device: torch.device | str | None = None,
                     params: Any = None, opt: Any = None, scaler: Any = None, config: Any = None,
                     hparams: Any = None, settings: Mapping[str, Any] | None = None,
                     **unknown: Any) -> SumsqReduce:
    """The ``reduce_sumsq`` hook: ``s_local -> sum over ranks of s_local`` (float64, rank order).

    ``s = (((s_0 + s_1) + s_2) + ...)`` with ``s_r`` rank ``r``'s local sum of
    squares, computed identically on every rank from one ``all_gather`` of
    ``world_size`` float64 values, so every rank sees the same bits. A nan or
    inf on any rank gives a non-finite ``s`` on every rank (an overflow: every
    rank skips). ``device``: where the gathered buffer lives (default: the
    current CUDA device for NCCL, else the CPU). Every rank of ``group`` must
    call the hook the same number of times (once per step). The sum starts
    from ``-0.0`` (``-0.0 + x = x`` for every ``x``): ``-0.0`` from every rank
    (no gradient anywhere) gives ``-0.0``; every other sum is unchanged.

    A rank that refuses the step before reducing (its inputs fail the checks)
    calls ``hook.refuse(error)`` in its place, as :func:`sofx.serial.serial_step`
    and :func:`sofx.speculate.speculative_step` do, and raises its own error; the
    hook then raises :class:`RankRefusedError` on the other ranks, which step
    nothing either, instead of leaving them waiting in the collective. A rank
    that never calls the hook (it raised in its own code before its step) leaves
    the others waiting until the group's timeout: their hook then raises a
    :class:`SofxError` saying so (with the backend's words), not the backend's bare error.

    At every step the loops call it as ``hook.agreed_sum(s_local, settings)``
    (:func:`sofx.serial.reduced_sumsq`) with what their step must share beyond
    the setup, :func:`sofx.serial.step_settings`: the profile, ``max_norm``,
    ``missing_grad`` and the loss-scaler state, and in a loop step its step
    count ``loop.step`` (:func:`sofx.serial.with_loop_settings`). A digest of
    them travels in the same ``all_gather`` as the sum (one more float64 a
    rank, no further round); where the ranks' differ, every rank raises a
    :class:`SofxError` naming the first that differs and each rank's value,
    before any rank applies the step (a rank that clipped at another
    threshold, unscaled with another scale, or evaluated the schedule at
    another step would silently diverge from the others). The hparams are
    not compared at each step: a sharded rank steps its own leaves' hparams
    (:meth:`Shard.local_hparams`), which differ from another rank's; they and
    their schedule are compared at setup (``hparams=``), where the step count
    then keeps a schedule's values the same on every rank.

    Building the hook is a collective too, every rank builds it once at
    setup: it checks, as :func:`check_same_setup` (``params``, ``opt``,
    ``scaler``, ``config``, ``hparams``, ``settings``: the same keywords),
    that the ranks agree in their setup and in where the sums travel
    (``device``'s type), so that no rank steps differently configured.
    """
    require_initialized(group, "all_reduce_sumsq")

    def entries() -> dict[str, str]:
        return {"device": _device_type(group, device),
                **_setup_entries(params, opt, scaler, config, hparams, settings)}

    _agree_setup("all_reduce_sumsq", group, extra, ("device", *_SETUP_KEYWORDS), unknown, entries,
                 _setup_hint("the hook's device"))
    return SumsqReduce(group, device)


def _device_type(group: Any, device: torch.device | str | None) -> str:
    """The type of the device the hook's sums travel on, refused where this process cannot hold a tensor there
    (the hook would fail on this rank alone at the first step), where it is the meta device (no data: every step's
    collective failed), or where the group's backend runs no collectives on that type of device (the backend
    config ``torch.distributed.get_backend_config`` names, ``cpu:gloo,cuda:gloo``: gloo on ``xpu``, NCCL on the
    CPU)."""
    dev = _collective_device(group, device)
    devices = _backend_devices(group)
    usable = ("; pass a device of this process that the process group's backend "
              f"({', '.join(f'{b}: {t}' for b, t in devices.items())}) runs collectives on, or None"
              if devices else "; pass a device of this process, or None")
    if dev.type == "meta":
        raise SofxError(f"all_reduce_sumsq: device={device!r}: a meta tensor holds no data, and the sums of "
                        f"squares could not travel there{usable}")
    if devices and not any(dev.type in types.split(", ") for types in devices.values()):
        raise SofxError(f"all_reduce_sumsq: device={device!r}: the process group's backend runs no collectives "
                        f"on a {dev.type} device{usable}")
    try:
        torch.empty(0, device=dev)
    except Exception as e:
        raise SofxError(f"all_reduce_sumsq: device={device!r}: this process cannot hold a tensor there ({e})") from e
    return dev.type


def _backend_devices(group: Any) -> dict[str, str]:
    """The group's backends and the types of device each runs collectives on (``{"gloo": "cpu, cuda"}``), read from
    its backend config (``cpu:gloo,cuda:gloo``); empty where that cannot be read as such (a backend of one's own
    registered otherwise: nothing is refused by it)."""
    try:
        config = str(dist.get_backend_config(group))
    except Exception:  # (a build of torch without get_backend_config, a group it cannot describe)
        return {}
    out: dict[str, list[str]] = {}
    for part in config.split(","):
        kind, sep, backend = part.strip().partition(":")
        if not sep or not kind or not backend:
            return {}
        out.setdefault(backend, []).append(kind)
    return {backend: ", ".join(kinds) for backend, kinds in out.items()}
