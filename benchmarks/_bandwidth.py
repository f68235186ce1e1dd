"""Shared benchmark helpers: memory bandwidth measured next to every timed repetition.

This machine's memory bandwidth drifts (by up to 1.8x over minutes, and other
processes share the cores), so a timing means little on its own. Every
repetition of a benchmarked operation is immediately followed by one timed
in-place ``a.add_(c)`` over two large buffers (3 streams: read a, read c,
write a); the operation's effective bandwidth is divided by that paired
measurement, and the median of those per-repetition ratios is reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["PairedBandwidth", "Timing", "time_paired", "time_round_robin"]


class PairedBandwidth:
    """In-place 3-stream add over two buffers of ``nbytes`` each (float32, on ``device``)."""

    def __init__(self, nbytes: int, device: str = "cpu") -> None:
        n = nbytes // 4
        self.device = device
        self.a = torch.rand(n, device=device)
        self.c = torch.rand(n, device=device) * 1e-6
        self.bytes = 3 * n * 4
        self.a.add_(self.c)  # touch every page

    def _sync(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()

    def measure(self) -> float:
        """Bytes per second of one ``a.add_(c)``."""
        self._sync()
        t = time.perf_counter()
        self.a.add_(self.c)
        self._sync()
        return self.bytes / (time.perf_counter() - t)


@dataclass
class Timing:
    """Per-repetition seconds and the paired bandwidths (bytes/s)."""

    seconds: list[float]
    bandwidth: list[float]
    nbytes: int  # the bytes the operation must move (its "useful" traffic)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median_s / 1e9

    @property
    def bw_ratio(self) -> float:
        """Median over repetitions of (this rep's effective bandwidth / the paired bandwidth)."""
        return statistics.median(self.nbytes / s / b for s, b in zip(self.seconds, self.bandwidth))

    @property
    def bw_gbps(self) -> float:
        return statistics.median(self.bandwidth) / 1e9


def time_paired(fn: Callable[[], object], nbytes: int, bw: PairedBandwidth, reps: int, warmup: int = 1,
                sync: Callable[[], None] = lambda: None, reset: Callable[[], object] | None = None) -> Timing:
    """Time ``fn`` ``reps`` times (after ``warmup`` untimed calls), each followed by a bandwidth measurement.

    ``reset`` (untimed, after each call and its measurement) brings the state back, e.g. a step after an
    undo, so that repeated calls see realistic values.
    """
    for _ in range(warmup):
        fn()
        if reset is not None:
            reset()
    sync()
    secs, bws = [], []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        secs.append(time.perf_counter() - t)
        bws.append(bw.measure())
        if reset is not None:
            reset()
            sync()
    return Timing(secs, bws, nbytes)


def time_round_robin(ops: dict[str, tuple[Callable[[], object], Callable[[], object] | None, int]],
                     bw: PairedBandwidth, reps: int, warmup: int = 1,
                     sync: Callable[[], None] = lambda: None) -> dict[str, Timing]:
    """Like :func:`time_paired` for several operations ``name -> (fn, reset, nbytes)``, interleaved:
    repetition ``k`` of every operation runs before repetition ``k + 1`` of any, so that slow drifts of
    the machine (other processes, bandwidth) affect all of them alike."""
    for fn, reset, _ in ops.values():
        for _ in range(warmup):
            fn()
            if reset is not None:
                reset()
    sync()
    out = {name: Timing([], [], nbytes) for name, (_, _, nbytes) in ops.items()}
    for _ in range(reps):
        for name, (fn, reset, _) in ops.items():
            t = time.perf_counter()
            fn()
            sync()
            out[name].seconds.append(time.perf_counter() - t)
            out[name].bandwidth.append(bw.measure())
            if reset is not None:
                reset()
                sync()
    return out
