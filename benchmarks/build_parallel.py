"""The native library's cold build with and without its parallel flags, and the two builds' speed in turns.

    .venv/bin/python benchmarks/build_parallel.py              # 2^26 elements (memory) and 2^18 (cache), 2 threads
    .venv/bin/python benchmarks/build_parallel.py --quick      # 2^16 elements, 2 reps (a smoke run)

With GCC 10 or later the library is built with ``-flto=auto`` (``_cpu_build._parallel_flags``): the compiler
partitions the program at link time and compiles the partitions on every core. That changes the build's time, and
the code only in where the partitions put it. This script builds the kernel source into two fresh temporary
caches, once with those flags and once without (the library's own first flag set, everything else alike), prints
each build's wall-clock and CPU seconds, then loads both and times ``cpu`` and ``cpu_fast``'s step, undo and
undo+redo (a new gradient) on the same arrays (float32, bf16 params + fp32 states, all-bf16; donated, as the
engine runs them), the two builds in turns a rep apart (in reversed order every other rep), so that both see the
same phase of this machine's drifting memory. Each rep gives a ratio (parallel / serial build); the table has both
builds' median milliseconds and the median and range of those ratios.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _ab import add_smoke_build_argument, extra_build_flags  # noqa: E402
from kernels import cpu_model  # noqa: E402

from sofx.kernels import _cpu_build, cpu, cpu_fast  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402

VARIANT = AdamVariant(decoupled=True, bias_correction=True)
S1 = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10, grad_scale=1.0)
S2 = S1._replace(lr=9e-4, grad_scale=0.5)
COMBOS = {"float32": (torch.float32, torch.float32), "bf16 params + fp32 states": (torch.bfloat16, torch.float32),
          "all-bf16": (torch.bfloat16, torch.bfloat16)}
BUILDS = ("parallel", "serial")


def build(cc: str, directory: str, parallel: bool, extra_flags: list[str]) -> tuple[_cpu_build.NativeLib, float, float]:
    """The library built in ``directory`` with or without the parallel flags (``extra_flags`` after the library's
    first flag set): (it, wall seconds, CPU seconds of the compiler's processes)."""
    target = os.path.join(directory, "sofx_adam.so")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    err = _cpu_build._compile(cc, [*_cpu_build._FLAG_SETS[0], *extra_flags], target, parallel=parallel)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if err is not None:
        raise SystemExit(f"the build failed: {err[-500:]}")
    return _cpu_build._open(target), wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def timed(libs: dict[str, _cpu_build.NativeLib], n: int, reps: int) -> dict[tuple[str, str, str, str], list[float]]:
    """Seconds per call, by (dtypes, backend, operation, build), the builds in turns on the same arrays."""
    times: dict[tuple[str, str, str, str], list[float]] = {}
    inner = max(1, (1 << 22) // n)  # calls per timing: small arrays are timed over several
    for combo, (pd, sd) in COMBOS.items():
        gen = torch.Generator().manual_seed(12345)
        p, g, g2 = (torch.randn(n, generator=gen).to(pd) for _ in range(3))
        m = (torch.randn(n, generator=gen) * 0.1).to(sd)
        v = (torch.rand(n, generator=gen) * 0.01 + 1e-4).to(sd)
        for be in (cpu, cpu_fast):
            name = be.__name__.rsplit(".", 1)[-1]
            ops = {"step": lambda: be.step(p, g, m, v, S1, VARIANT, out=(p, m, v)),
                   "undo": lambda: be.undo(p, g, m, v, S1, VARIANT, out=(p, m, v)),
                   "undo+redo": lambda: be.undo_redo(p, m, v, g, S1, g2, S2, VARIANT, out=(p, m, v))}
            for rep in range(reps + 1):  # rep 0 warms up
                for b in (BUILDS if rep % 2 else BUILDS[::-1]):
                    _cpu_build._loaded[:] = [libs[b]]
                    for op, fn in ops.items():
                        t0 = time.perf_counter()
                        for _ in range(inner):
                            fn()
                        if rep:
                            times.setdefault((combo, name, op, b), []).append((time.perf_counter() - t0) / inner)
                        if op == "step":  # back to the step's inputs, so that the undo+redo undoes a step
                            be.undo(p, g, m, v, S1, VARIANT, out=(p, m, v))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="reps per build, operation and size (default 7)")
    ap.add_argument("--quick", action="store_true", help="2^16 elements, 2 reps (a smoke run; numbers mean little)")
    add_smoke_build_argument(ap)
    args = ap.parse_args()
    cc = _cpu_build._compiler()
    if cc is None:
        raise SystemExit(_cpu_build._no_compiler())
    parallel = _cpu_build._parallel_flags(cc)
    if not parallel:
        raise SystemExit(f"{cc} has no parallel flags here (GCC 10 or later has -flto=auto): nothing to compare")
    sizes, reps = ([1 << 16], 2) if args.quick else ([1 << 26, 1 << 18], args.reps)
    _cpu_build.load()  # the library's own, so that nothing builds it in the middle of the timings
    saved = list(_cpu_build._loaded)
    print(f"# the native library built with and without {' '.join(parallel)}, machine: {cpu_model()}, "
          f"{os.cpu_count()} cores")
    print(f"command: {' '.join(['benchmarks/build_parallel.py', *sys.argv[1:]])}\n")
    libs, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="sofx-build-") as tmp:
        for b in BUILDS:
            libs[b], wall, cpu_s = build(cc, os.path.join(tmp, b), b == "parallel", extra_build_flags(args))
            rows.append(f"| {b} ({' '.join(parallel) if b == 'parallel' else 'no -flto'}) | {wall:.1f} | {cpu_s:.1f} |")
        print("| build | wall s | CPU s |\n|---|---:|---:|")
        print("\n".join(rows) + "\n")
        try:
            results = {n: timed(libs, n, reps) for n in sizes}
        finally:
            _cpu_build._loaded[:] = saved
    print(f"torch threads: {torch.get_num_threads()}\n")
    print("| elements | dtypes | backend | operation | parallel ms | serial ms | ratio (median) | ratio (min-max) |")
    print("|---:|---|---|---|---:|---:|---:|---:|")
    for n, times in results.items():
        for (combo, name, op, b), a in times.items():
            if b != "parallel":
                continue
            s = times[(combo, name, op, "serial")]
            ratios = [x / y for x, y in zip(a, s)]
            print(f"| 2^{n.bit_length() - 1} | {combo} | {name} | {op} | {1e3 * statistics.median(a):.3f} | "
                  f"{1e3 * statistics.median(s):.3f} | {statistics.median(ratios):.3f} | "
                  f"{min(ratios):.2f}-{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
