"""What a gradient spike costs an undoable step and its late clip, on CPU.

    python benchmarks/spike_records.py              # six 1M-element float32 leaves, two threads
    python benchmarks/spike_records.py --smoke      # tiny: checks that the script runs

A record's kept values are fresh memory, which glibc may have handed back to the system after the last record
was dropped: its page faults (a column of the table) can cost more than the copy. The README's malloc settings
(``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824`` in the environment) keep it; the
rows then show the kernels' and the host's work alone.

A spike (a gradient 1000x the ones the second moments were built from) makes every element's algebraic
inverse too lossy: a checked ``update`` (``undo="auto"``, donated, as the offload engine runs it) flags every
chunk, copies the old values out (the record keeps the leaves whole: ``"snapshot"``) and steps them; a late
clip then redoes the step from those kept values (``undo_redo`` with the step's own gradients and a new
``grad_scale``, not undoable again: what validation runs). Rows, each timed alone on fresh state, median of
``--reps`` (ms, and as a multiple of the plain step; the page faults the timed call took):

- ``plain step``: ``update(..., donate=True, undoable=False)`` of the same gradient;
- ``spiked update, undoable``: the checked update with every chunk flagged;
- ``its late clip``: the ``undo_redo`` of that record;
- ``kernel: checked step, every chunk flagged``: the checked kernel call alone (``cpu.step_many`` with flags):
  what finding the chunks costs;
- ``kernel: step out of place``: ``cpu.step_many`` from other tensors into the leaf (a step from kept values,
  or ``donate=False``), against the same call in place.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sofx  # noqa: E402
from sofx.kernels import cpu  # noqa: E402
from sofx.kernels.base import FINITE_CHUNK, AdamScalars, AdamVariant, StepCall  # noqa: E402


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _Clock:
    """Times a region and counts its page faults (minor): a record's kept values are fresh memory, which
    glibc may have handed back to the system, faulted in again."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.faults: list[int] = []

    def __enter__(self) -> "_Clock":
        self._f0, self._t0 = _minor_faults(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.times.append(time.perf_counter() - self._t0)
        self.faults.append(_minor_faults() - self._f0)


def _timed(fn: Callable[[_Clock], None], reps: int) -> tuple[float, float]:
    """The medians of the time (ms) and of the page faults of the region ``fn`` times, over ``reps`` runs."""
    clock = _Clock()
    for _ in range(reps):
        fn(clock)
    return 1000 * statistics.median(clock.times), statistics.median(clock.faults)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", type=int, default=6)
    ap.add_argument("--numel", type=int, default=1 << 20, help="elements per leaf")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spike", type=float, default=1e3, help="the spike's gradient over the usual one")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.leaves, args.numel, args.reps = 2, 3 * FINITE_CHUNK + 5, 2
    torch.set_num_threads(args.threads)
    opt = sofx.adamw(lr=1e-3, weight_decay=0.01, backend="cpu")
    n, k = args.numel, args.leaves

    def warmed() -> tuple[list[torch.Tensor], sofx.AdamState]:
        params = [torch.randn(n) for _ in range(k)]
        state = opt.init(params)
        for _ in range(3):
            params, state, _ = opt.update(params, [torch.randn(n) for _ in range(k)], state, donate=True,
                                          undoable=False)
        return params, state

    grads = [torch.randn(n) for _ in range(k)]
    spiked = [g * args.spike for g in grads]
    strategies: set[str] = set()

    def plain(clock: _Clock) -> None:
        params, state = warmed()
        with clock:
            opt.update(params, spiked, state, donate=True, undoable=False)

    def spiked_update(clock: _Clock, clip: bool) -> None:
        params, state = warmed()
        with contextlib.nullcontext() if clip else clock:
            params, state, record = opt.update(params, spiked, state, donate=True)
        strategies.update(record.strategies())
        if clip:
            with clock:
                opt.undo_redo(params, state, record, spiked, grad_scale=1 / args.spike, donate=True,
                              undoable=False)

    variant = AdamVariant(decoupled=True)
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 4)
    total = n * k
    p, g, m, v = (torch.randn(total) for _ in range(4))
    v.abs_().mul_(1e-3)
    kp, km, kv = p.clone(), m.clone(), v.clone()
    g_spiked = g * args.spike
    flags = torch.zeros(-(-total // FINITE_CHUNK), dtype=torch.uint8)

    def kernel(fn: Callable[[], None]) -> Callable[[_Clock], None]:
        def run(clock: _Clock) -> None:
            with clock:
                fn()
        return run

    def checked() -> None:
        flags.zero_()
        cpu.step_many([StepCall(p, g_spiked, m, v, s, (p, m, v), None, flags)], variant)  # writes nothing

    rows = [("plain step", _timed(plain, args.reps)),
            ("spiked update, undoable", _timed(lambda clock: spiked_update(clock, False), args.reps)),
            ("its late clip (undo_redo)", _timed(lambda clock: spiked_update(clock, True), args.reps)),
            ("kernel: step in place", _timed(kernel(lambda: cpu.step_many(
                [StepCall(p, g, m, v, s, (p, m, v))], variant)), args.reps)),
            ("kernel: checked step, every chunk flagged", _timed(kernel(checked), args.reps)),
            ("kernel: step out of place", _timed(kernel(lambda: cpu.step_many(
                [StepCall(kp, g, km, kv, s, (p, m, v))], variant)), args.reps))]
    assert bool(flags.all()), "the spiked kernel call flagged a chunk less than every one"
    print(f"# {k} leaves of {n} float32 elements, spike {args.spike:g}x, backend cpu, {args.threads} threads, "
          f"median of {args.reps}, FINITE_CHUNK {FINITE_CHUNK}, torch {torch.__version__}; the spiked records: "
          f"{', '.join(sorted(strategies))}")
    print()
    print("| row | ms | x the plain step (kernel rows: x the step in place) | page faults per run |")
    print("|---|---:|---:|---:|")
    plain_ms, in_place_ms = rows[0][1][0], rows[3][1][0]
    for i, (name, (ms, faults)) in enumerate(rows):
        print(f"| {name} | {ms:.2f} | {ms / (plain_ms if i < 3 else in_place_ms):.2f} | {faults:.0f} |")


if __name__ == "__main__":
    main()
