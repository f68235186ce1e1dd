"""A/B helpers shared by the small benchmark scripts (arena_colouring.py, memory_floor.py, idle_rows.py,
prefetch_stagger.py, serial_step.py, checked_update.py, host_overhead.py, triton_host.py): alternating
rounds, timing a step and an undo+redo, a table per tensor, building a variant of the kernels (and, for
kernel_compute.py and kernel_memory_ab.py, a program on the kernel source)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import torch


def alternating(names: Sequence[str], rounds: int) -> Iterator[str]:
    """The variants in the order to time them: as given in even rounds, reversed in odd ones, so that a
    drift of the machine's memory bandwidth during the run hits every variant alike."""
    for rnd in range(rounds):
        yield from (names if rnd % 2 == 0 else list(reversed(names)))


def time_alternating(steps: dict[str, Callable[[], None]], rounds: int,
                     resets: dict[str, Callable[[], None]] | None = None) -> dict[str, list[float]]:
    """Seconds of each call of every step: one untimed round first (builds, first touch), then ``rounds``
    timed ones in :func:`alternating` order; ``resets[name]()`` (untimed) runs before each call of
    ``steps[name]``."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i, name in enumerate(alternating(list(steps), rounds + 1)):
        if resets is not None:
            resets[name]()
        t = time.perf_counter()
        steps[name]()
        elapsed = time.perf_counter() - t
        if i >= len(steps):
            times[name].append(elapsed)
    return times


def time_step_and_undo_redo(backend, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s1,
                            g2: torch.Tensor, s2, variant) -> tuple[float, float]:
    """Seconds of one in-place step (``g``, ``s1``) and of one fused undo+redo to (``g2``, ``s2``).

    Expects the state a step with (``g``, ``s1``) produced and leaves it so: the step runs after an undo,
    and a second undo+redo takes the state back.
    """
    backend.undo(p, g, m, v, s1, variant, out=(p, m, v))
    t = time.perf_counter()
    backend.step(p, g, m, v, s1, variant, out=(p, m, v))
    step = time.perf_counter() - t
    t = time.perf_counter()
    backend.undo_redo(p, m, v, g, s1, g2, s2, variant, out=(p, m, v))
    undo_redo = time.perf_counter() - t
    backend.undo_redo(p, m, v, g2, s2, g, s1, variant, out=(p, m, v))  # back to the (g, s1) step
    return step, undo_redo


def print_per_tensor_table(times: dict[str, list[float]], tensors: int, first_column: str) -> None:
    """A markdown table of ``times`` (seconds per call, as :func:`time_alternating` returns them): per
    variant the median in ms and in us per tensor (``tensors`` per call)."""
    print(f"| {first_column} | ms per call | us per tensor |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {t * 1e3:.2f} | {t * 1e6 / tensors:.1f} |")


def size_arguments(description: str, rounds: int,
                   more: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """``--log2-numel`` (default 26), ``--threads`` (2, applied to torch) and ``--rounds`` (``rounds``);
    ``more`` adds a script's own arguments."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--log2-numel", type=int, default=26)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=rounds)
    if more is not None:
        more(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def gpt2_arguments(description: str, argv: Sequence[str] | None = None, backend: bool = False,
                   ) -> tuple[argparse.Namespace, list[tuple[int, ...]], int]:
    """``--rounds`` (9), ``--threads`` (2, applied to torch), ``--smoke`` (tiny shapes, 2 rounds: checks that
    a script runs), with ``backend`` also ``--backend`` (sofx's, default ``cpu``): the arguments, GPT-2 small's
    tensor shapes (tiny ones with ``--smoke``) and the rounds."""
    from kernels import gpt2_small_shapes  # benchmarks/kernels.py

    ap = argparse.ArgumentParser(description=description)
    if backend:
        ap.add_argument("--backend", default="cpu", choices=["cpu", "cpu_fast"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 rounds: checks that the script runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = gpt2_small_shapes(vocab=40, d=16, layers=1, ctx=8) if args.smoke else gpt2_small_shapes()
    return args, shapes, 2 if args.smoke else args.rounds


# A smoke run's builds: -Og after the library's -O3 (GCC and clang take the last -O) compiles the kernel source in
# about a quarter of the time (GCC 12: 8 s of a core against 13 s at -O1, 33 s at -O3; -O0 takes longer than -O1),
# into code of no use for timing that gives the same bits; the tests' runs of the scripts that build kernels use it.
SMOKE_BUILD_FLAGS = ("-Og",)


def add_smoke_build_argument(ap: argparse.ArgumentParser) -> None:
    """``--smoke-build``: the script's kernel builds at -Og (:data:`SMOKE_BUILD_FLAGS`; :func:`build_variants` keeps
    them in the library's cache)."""
    ap.add_argument("--smoke-build", action="store_true",
                    help="build the kernels at -Og: a quarter of the compile time, times that mean nothing "
                         "(a smoke run)")


def extra_build_flags(args: argparse.Namespace) -> list[str]:
    """The flags :func:`add_smoke_build_argument`'s option adds to every build (none without it)."""
    return list(SMOKE_BUILD_FLAGS) if args.smoke_build else []


def build_variants(sources: list[str], extra_flags: Sequence[str] = ()) -> list:
    """The native libraries built from ``sources`` (variants of ``sofx.kernels._cpu_build.SOURCE``; the library's
    flags, ``extra_flags`` after each set), compiled side by side (a compiler per core: one build takes ~25 s),
    each in a temporary cache of its own, so that the library's cache is left alone; but a smoke run's builds
    (``extra_flags`` :data:`SMOKE_BUILD_FLAGS`: the tests' runs of the scripts, the same few sources each time) are
    kept in the library's cache (keyed by the source and flags, so apart from its own build), built once per
    machine and kernel source. Exits with the reason on failure."""
    from concurrent.futures import ThreadPoolExecutor

    from sofx.kernels import _cpu_build

    flag_sets = [[*flags, *extra_flags] for flags in _cpu_build._FLAG_SETS]
    keep = tuple(extra_flags) == SMOKE_BUILD_FLAGS
    with tempfile.TemporaryDirectory() as cache, ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        libs = list(pool.map(lambda i: _cpu_build._build_and_open(
            sources[i], None if keep else os.path.join(cache, str(i)), flag_sets), range(len(sources))))
    for lib in libs:
        if isinstance(lib, str):
            sys.exit(lib)
    return libs  # each .so stays mapped after its file is removed


def build_variant(source: str, extra_flags: Sequence[str] = ()):
    """:func:`build_variants` of one source."""
    return build_variants([source], extra_flags)[0]


_UNUSED_PROGRAM_S = 30 * 86400


def _prune_programs(cache: str) -> None:
    """Before a new build into ``cache``: remove the temporary directories killed builds left there (as the
    library's cache does) and the programs not used for :data:`_UNUSED_PROGRAM_S` (one is kept per kernel source
    a developer ran a smoke test with; a program taken from the cache has its time set)."""
    from sofx.kernels import _cpu_build

    _cpu_build._remove_abandoned_builds(cache)
    now = time.time()
    try:
        entries = list(os.scandir(cache))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime > _UNUSED_PROGRAM_S:
                os.remove(entry.path)
        except OSError:
            pass


def compile_program(program: str, directory: str, name: str, source: str | None = None, shared: bool = False,
                    extra_flags: Sequence[str] = ()) -> str:
    """``sofx.kernels._cpu_build.compile_program``'s build of ``program`` (in ``directory``), but a smoke run's
    (``extra_flags`` :data:`SMOKE_BUILD_FLAGS`: the tests' runs of kernel_compute.py and kernel_memory_ab.py, the
    same programs every run, ~9 s of a core each) is kept in ``programs`` in the library's cache directory, keyed
    by the program, the kernel source, the compiler and its version, the flags and the CPU (as the library's own
    build): built once per machine and kernel source (where that directory cannot take it, in ``directory``).
    Returns its path; raises RuntimeError as that function does."""
    import hashlib

    from sofx.durable import fsync_best_effort
    from sofx.kernels import _cpu_build

    cc = _cpu_build._compiler()
    if tuple(extra_flags) != SMOKE_BUILD_FLAGS or cc is None:
        return _cpu_build.compile_program(program, directory, name, source, shared, extra_flags)
    kernels = _cpu_build.SOURCE if source is None else source
    key = hashlib.sha256("\0".join([program, kernels, cc, _cpu_build._compiler_version(cc), str(shared),
                                    *extra_flags, *_cpu_build._TUNING, _cpu_build._cpu_fingerprint()])
                         .encode()).hexdigest()[:24]
    try:
        cache = os.path.join(_cpu_build._cache_dir(), "programs")
        path = os.path.join(cache, f"{name}_{key}{'.so' if shared else ''}")
        if os.path.isfile(path):
            try:
                os.utime(path)  # (used: kept by _prune_programs)
            except OSError:  # (a cache this process may read but not write)
                pass
            return path
        os.makedirs(cache, exist_ok=True)
        _prune_programs(cache)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: never a half-written file
            built = _cpu_build.compile_program(program, tmp, name, source, shared, extra_flags)
            fsync_best_effort(built)
            os.replace(built, path)
        return path
    except (OSError, _cpu_build._CacheUnusable):  # no cache directory here, read-only, full: built in directory
        return _cpu_build.compile_program(program, directory, name, source, shared, extra_flags)
