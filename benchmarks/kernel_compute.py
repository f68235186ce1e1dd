"""The CPU kernels' arithmetic, apart from the memory: nanoseconds per element on one core.

    .venv/bin/python benchmarks/kernel_compute.py                 # in cache, and from memory
    .venv/bin/python benchmarks/kernel_compute.py --quick         # smaller, fewer repetitions (a smoke run)
    .venv/bin/python benchmarks/kernel_compute.py --backend cpu   # cpu's loops (MKL's square root inline)
    .venv/bin/python benchmarks/kernel_compute.py --against HEAD  # this tree's kernels against a revision's
    .venv/bin/python benchmarks/kernel_compute.py --define UNDO_WIDTH=2   # against this tree with one knob set

``kernels.py`` times the operations where they meet the memory (2^26 elements, two threads), so a row there is
bound by the memory traffic or by the arithmetic, whichever is slower, and says which only by its ratio. This
script separates the two: it compiles the kernel source (``sofx/kernels/_cpu_source.py``, with the library's
own flags) together with a small C program that runs the loops of ``cpu_fast`` (``run_range`` on one range,
``exact`` off, i.e. whichever loops this build selects: AVX-512, AVX2 or the portable ones; with ``--backend
cpu``, ``exact`` on with an inline replica of MKL's square root: the one the library's load-time check accepts
here, else the first the build has, or ``--replica``'s: the loops ``cpu`` runs where that check accepts it; a
revision older than the replicas' kinds takes its own, its only one) on the calling thread alone, over

- ``cache``: 16384 elements, which stay in the core's L2 between repetitions: the arithmetic's own rate;
- ``memory``: 2^24 elements (64 MiB per float32 stream), one core's view of the memory.

for float32, bf16 params + fp32 states, and all-bf16, each of step, undo and undo+redo with a new gradient.
An operation whose ``cache`` time times the number of cores exceeds its share of ``kernels.py``'s time is
bound by its arithmetic there. Timings are the minimum over repetitions.

``--against REV`` also builds the kernel source of a git revision (``git show REV:sofx/kernels/_cpu_source.py``)
and runs the two programs in alternation, a few repetitions at a time (this machine's speed drifts between
runs by more than the changes being measured), then prints both tables and their ratio (this tree / REV).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _ab import add_smoke_build_argument, compile_program, extra_build_flags  # noqa: E402
from kernels import cpu_model  # noqa: E402

from sofx.kernels import _cpu_build  # noqa: E402
from sofx.kernels._cpu_source import SOURCE  # noqa: E402

# The harnesses' common part (also kernel_memory_ab.py's): the kernel source, a clock, a step's scalars, arrays of
# random values, the jobs on them.
HELPERS = r"""
#include "sofx_adam.c"
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void scalars(double *d, double lr, double gs) {
  const double b1 = 0.9, b2 = 0.999, wd = 0.01;
  const int t = 10;
  memset(d, 0, sizeof(double) * S_COUNT);
  d[S_GRAD_SCALE] = gs;
  d[S_HAS_GRAD_SCALE] = gs != 1.0;
  d[S_HAS_DECAY] = 1;
  d[S_WD] = wd;
  d[S_DECAY_FACTOR] = 1 - lr * wd;
  d[S_ONE_MINUS_B1] = 1 - b1;
  d[S_B1] = b1;
  d[S_B2] = b2;
  d[S_ONE_MINUS_B2] = 1 - b2;
  d[S_BC2_SQRT] = sqrt(1 - pow(b2, t));
  d[S_EPS] = 1e-8;
  d[S_STEP_SIZE] = lr / (1 - pow(b1, t));
  d[S_LIMIT_F32] = 0x7F7FFFFF;
  d[S_LIMIT_BF16] = 0x7F7F;
  d[S_LIMIT_F16] = 0x7BFF;
}

static float uniform(uint32_t *s) { /* in [-1, 1) */
  *s = *s * 1664525u + 1013904223u;
  return (float)(*s >> 8) / 8388608.0f - 1.0f;
}

static void *filled(int64_t n, int bf16, float scale, float shift, uint32_t *seed) {
  void *a = aligned_alloc(64, (size_t)(n * 4 + 64) / 64 * 64);
  for (int64_t i = 0; i < n; i++) {
    const float x = scale * uniform(seed) + shift;
    if (bf16) ((uint16_t *)a)[i] = f32_to_bf16(x);
    else ((float *)a)[i] = x;
  }
  return a;
}

/* The harnesses' jobs on n elements at p, g, g2, m, v (dtypes dp for the params, dg for both gradients, ds for
   the states), in place: j a step with (g, the scalars of lr 1e-3) whose undo+redo takes (g2, lr 9e-4 and a
   gradient scale of 0.5), its op set per call; back the undo+redo from there back to the step with g. replica:
   0 for cpu_fast's loops (exact off), else the inline replica of MKL's square root to use (REPLICA_*). */
static void make_jobs(Job *j, Job *back, int dp, int dg, int ds, int64_t n, void *p, void *g, void *g2, void *m,
                      void *v, int replica) {
  double d1[S_COUNT], d2[S_COUNT];
  scalars(d1, 1e-3, 1.0);
  scalars(d2, 9e-4, 0.5);
  memset(j, 0, sizeof *j);
  j->decoupled = 1;
  j->dp = dp; j->dg = dg; j->ds = ds; j->dg2 = dg; j->dpo = dp;
  j->n = n;
  j->p = p; j->g = g; j->m = m; j->v = v; j->g2 = g2; j->po = p; j->mo = m; j->vo = v;
  j->begin = 0;
  j->end = n;
  j->s1 = make_sc(d1);
  j->s2 = make_sc(d2);
  j->exact = replica != 0;
  j->sq.replica = replica; /* no routine to call: the replica, or sqrtf where the build has none */
  *back = *j;
  back->g = g2; back->g2 = g; back->s1 = j->s2; back->s2 = j->s1;
}
"""

HARNESS = HELPERS + r"""
/* ns per element of step, undo, undo+redo (a new gradient) on n elements of dtypes (dp, dg, ds): each
   operation runs reps times and is then inverted (untimed), so that the states stay those of a real step.
   replica as in make_jobs. */
static void bench(int dp, int dg, int ds, int64_t n, int reps, int rounds, int replica, double *out) {
  uint32_t seed = 12345;
  void *p = filled(n, dp, 1.0f, 0.0f, &seed), *g = filled(n, dg, 1.0f, 0.0f, &seed);
  void *g2 = filled(n, dg, 1.0f, 0.0f, &seed), *m = filled(n, ds, 0.1f, 0.0f, &seed);
  void *v = filled(n, ds, 0.005f, 0.006f, &seed);
  Job j, back;
  make_jobs(&j, &back, dp, dg, ds, n, p, g, g2, m, v, replica);
  for (int k = 0; k < 3; k++) out[k] = 1e30;
  for (int round = 0; round < rounds; round++)
    for (int k = 0; k < 3; k++) {
      double t = 0;
      for (int r = 0; r < reps; r++) {
        j.op = k == 0 ? OP_STEP : k == 1 ? OP_UNDO : OP_UNDO_REDO;
        const double t0 = now();
        run_range(&j);
        t += now() - t0;
        if (k == 1) { j.op = OP_STEP; run_range(&j); }
        if (k == 2) { back.op = OP_UNDO_REDO; run_range(&back); }
      }
      if (k == 0) { /* the steps are taken: undo them (untimed) */
        j.op = OP_UNDO;
        for (int r = 0; r < reps; r++) run_range(&j);
      }
      t = t / reps / (double)n * 1e9;
      if (t < out[k]) out[k] = t;
    }
  free(p); free(g); free(g2); free(m); free(v);
}

int main(int argc, char **argv) {
  const int64_t n = atoll(argv[1]);
  const int reps = atoi(argv[2]), rounds = atoi(argv[3]), replica = argc > 4 ? atoi(argv[4]) : 0;
  static const int combos[3][3] = {{0, 0, 0}, {1, 0, 0}, {1, 1, 1}};
  for (int c = 0; c < 3; c++) {
    double out[3];
    bench(combos[c][0], combos[c][1], combos[c][2], n, reps, rounds, replica, out);
    printf("%d%d%d %.4f %.4f %.4f\n", combos[c][0], combos[c][1], combos[c][2], out[0], out[1], out[2]);
  }
  return 0;
}
"""

COMBOS = {"000": "float32", "100": "bf16 params + fp32 states", "111": "all-bf16"}


def build(directory: str, source: str | None = None, extra_flags: Sequence[str] = ()) -> str:
    """The harness compiled with the kernels' first flag set that works here (``source``: another kernel
    source than this tree's; ``extra_flags`` after the set's)."""
    try:
        return compile_program(HARNESS, directory, "compute", source, extra_flags=extra_flags)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def source_at(rev: str) -> str:
    """The kernel source (``SOURCE``) of ``sofx/kernels/_cpu_source.py`` at git revision ``rev``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(["git", "show", f"{rev}:sofx/kernels/_cpu_source.py"], cwd=root, capture_output=True,
                          text=True, check=True).stdout
    namespace: dict = {}
    exec(compile(text, f"{rev}:_cpu_source.py", "exec"), namespace)  # noqa: S102 (the repository's own file)
    return namespace["SOURCE"]


def with_define(source: str, define: str) -> str:
    """``source`` with ``#define NAME VALUE`` first (``define``: NAME=VALUE)."""
    name, sep, value = define.partition("=")
    if not sep or not name.isidentifier():
        raise SystemExit(f"--define takes NAME=VALUE, not {define!r}")
    if f"#ifndef {name}\n" not in source:  # a plain #define later in the source would override it, silently
        knobs = ", ".join(sorted(set(re.findall(r"^#ifndef (\w+)$", source, flags=re.MULTILINE))))
        raise SystemExit(f"{name} is not one of the kernel source's #ifndef knobs; they are: {knobs}")
    return f"#define {name} {value}\n" + source


Rows = dict[str, tuple[float, float, float]]  # a program's times per dtype combination: step, undo, undo+redo


def run(exe: str, n: int, reps: int, rounds: int, replica: int) -> Rows:
    """The program's rows; ``replica``: 0 for cpu_fast's loops, else the replica kind of cpu's."""
    out = subprocess.run([exe, str(n), str(reps), str(rounds), str(replica)], capture_output=True, text=True,
                         check=True, timeout=1800).stdout
    rows = {}
    for line in out.splitlines():
        combo, *times = line.split()
        rows[combo] = tuple(float(t) for t in times)
    return rows


def alternated(exes: list[str], n: int, reps: int, rounds: int, replica: int, calls: int) -> list[Rows]:
    """Each program's rows, the minimum over ``calls`` runs of ``rounds`` rounds each, the programs taking
    turns (in reversed order every other time)."""
    best: list[Rows] = [{} for _ in exes]
    for call in range(calls):
        order = list(range(len(exes)))
        for i in order if call % 2 == 0 else order[::-1]:
            for combo, times in run(exes[i], n, reps, rounds, replica).items():
                old = best[i].get(combo)
                best[i][combo] = times if old is None else tuple(min(a, b) for a, b in zip(old, times))
    return best


def print_table(results: dict[str, Rows], digits: int = 3) -> None:
    print("| ns per element | step cache | step memory | undo cache | undo memory | undo+redo cache "
          "| undo+redo memory |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for combo, name in COMBOS.items():
        c, m = results["cache"][combo], results["memory"][combo]
        cells = " | ".join(f"{x:.{digits}f}" for pair in zip(c, m) for x in pair)
        print(f"| {name} | {cells} |")


def replica_kind(name: str | None) -> int:
    """The replica kind for cpu's loops: ``name``'s, else the one the load-time check accepts here, else the
    first this build has (any: the harness calls no MKL routine)."""
    if name is not None:
        return _cpu_build.REPLICA_KINDS[name]
    lib = _cpu_build.load()
    if lib is None:
        raise SystemExit("no native library here (see sofx.kernels.cpu's unavailable reason)")
    if lib.sqrt_replica:
        return lib.sqrt_replica
    import ctypes

    kinds = ctypes.CDLL(lib.path).sofx_has_sqrt_replica()
    return kinds & -kinds if kinds else _cpu_build.REPLICA_KINDS["generic"]


def loops_title(backend: str, replica: int) -> str:
    """Whose loops a run times, for its header: the backend's, and with cpu's the replica kind's name."""
    names = {kind: name for name, kind in _cpu_build.REPLICA_KINDS.items()}
    return f"{backend} loops, {names[replica]} replica" if replica else f"{backend} loops"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions (numbers mean little)")
    ap.add_argument("--backend", choices=("cpu_fast", "cpu"), default="cpu_fast",
                    help="whose loops: cpu_fast's (IEEE square roots) or cpu's (exact: MKL's square root inline)")
    ap.add_argument("--replica", choices=tuple(_cpu_build.REPLICA_KINDS),
                    help="with --backend cpu: which inline replica of MKL's square root (default: the one in use here)")
    other = ap.add_mutually_exclusive_group()
    other.add_argument("--against", metavar="REV", help="also time the kernel source of this git revision, in turns")
    other.add_argument("--define", metavar="NAME=VALUE",
                       help="also time this tree's kernel source with this define (an #ifndef knob), in turns")
    ap.add_argument("--calls", type=int, default=5, help="with --against or --define: turns per program (default 5)")
    add_smoke_build_argument(ap)
    args = ap.parse_args()
    # (elements, repetitions, rounds, calls): the minimum over calls x rounds rounds
    sizes = {"cache": (4096, 50, 3, 1), "memory": (1 << 16, 2, 2, 1)} if args.quick else \
        {"cache": (16384, 2000, 15, 1), "memory": (1 << 24, 2, 5, 1)}
    against = args.against or args.define
    if against:
        sizes = {where: (n, reps, max(1, rounds // 5), args.calls) for where, (n, reps, rounds, _) in sizes.items()}
    replica = replica_kind(args.replica) if args.backend == "cpu" else 0
    with tempfile.TemporaryDirectory(prefix="sofx-compute-") as tmp:
        builds = [(tmp, None)]
        if against:
            os.mkdir(os.path.join(tmp, "against"))
            other_source = source_at(args.against) if args.against else with_define(SOURCE, args.define)
            builds.append((os.path.join(tmp, "against"), other_source))
        with ThreadPoolExecutor(max_workers=len(builds)) as pool:  # both compilers at once (~25 s of a core each)
            exes = list(pool.map(lambda b: build(*b, extra_build_flags(args)), builds))
        per_size = {where: alternated(exes, n, reps, rounds, replica, calls)
                    for where, (n, reps, rounds, calls) in sizes.items()}
    results = [{where: rows[i] for where, rows in per_size.items()} for i in range(len(exes))]
    print(f"# sofx CPU kernels' arithmetic ({loops_title(args.backend, replica)}, one core), machine: {cpu_model()}")
    print(f"command: {' '.join(['benchmarks/kernel_compute.py', *sys.argv[1:]])}\n")
    if not against:
        print_table(results[0])
        return
    print("this tree:\n")
    print_table(results[0])
    print(f"\n{against}:\n")
    print_table(results[1])
    ratio = {where: {combo: tuple(a / b for a, b in zip(results[0][where][combo], results[1][where][combo]))
                     for combo in COMBOS} for where in sizes}
    print(f"\nthis tree / {against}:\n")
    print_table(ratio, digits=2)


if __name__ == "__main__":
    main()
