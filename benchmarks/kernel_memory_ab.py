"""Two kernel sources against each other where the memory sets the time: both in one process, rep by rep.

    .venv/bin/python benchmarks/kernel_memory_ab.py --against HEAD                  # cpu_fast's loops
    .venv/bin/python benchmarks/kernel_memory_ab.py --against HEAD --backend cpu    # cpu's (MKL's square root inline)
    .venv/bin/python benchmarks/kernel_memory_ab.py --against HEAD --define PREFETCH_BYTES=2048   # one define only
    .venv/bin/python benchmarks/kernel_memory_ab.py --quick --against HEAD          # small, a smoke run

``kernel_compute.py --against`` compares two kernel sources in cache, where the arithmetic sets the time; for a
change to what the loops ask of the memory (prefetching, the order of the streams, stores) that says nothing, and
``kernels.py`` runs before and after cannot say it either: this machine's memory runs in phases (seen here on the
Zen 5 EPYC: a float32 step of 2^26 elements took ~17 ms for some seconds, ~30 ms for the next ones), so that two
runs minutes apart differ by more than most changes. This script compiles this tree's kernel source
(``sofx/kernels/_cpu_source.py``) and either a git revision's (``--against REV``) or this tree's with one define
more (``--define NAME=VALUE``, for a knob the source leaves ``#ifndef``) into two shared libraries with the
kernels' own flags, loads both, and times them in turns a rep apart: each rep runs, on the same arrays of
2^26 elements (``--elements``; two sets would lie differently in the memory, a bias of its own) with ``--threads``
threads (the elements split evenly, at a multiple of the finiteness chunk), a step, an undo+redo with a new gradient,
and an undo (the inverse of the step; an untimed undo+redo back in between), so that both builds see the same memory
phase. Each rep gives a ratio per operation (this tree / the other); the table has the median time of each build and
the median and range of those ratios, for float32, bf16 params + fp32 states and all-bf16. The threads are plain
pthreads started per call (the library's own OpenMP or started threads do the same split).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel_compute import HELPERS, loops_title, replica_kind, source_at, with_define  # noqa: E402
from _ab import add_smoke_build_argument, compile_program, extra_build_flags  # noqa: E402
from kernels import cpu_model  # noqa: E402

from sofx.kernels import _cpu_build  # noqa: E402
from sofx.kernels._cpu_source import SOURCE  # noqa: E402

LIBRARY = HELPERS + r"""
#include <pthread.h>

typedef struct {
  Job j, back;
} AB;

typedef struct {
  const Job *j;
  int64_t begin, end;
} Part;

static void *part_run(void *arg) {
  const Part *p = (const Part *)arg;
  Job job = *p->j;
  job.begin = p->begin;
  job.end = p->end;
  run_range(&job);
  return 0;
}

/* j on nt threads (this one among them), the elements split evenly at multiples of CHUNK */
static void run_threads(const Job *j, int nt) {
  pthread_t t[64];
  Part parts[64];
  if (nt < 1) nt = 1;
  if (nt > 64) nt = 64;
  for (int i = 0; i < nt; i++) {
    parts[i].j = j;
    parts[i].begin = j->n * i / nt / CHUNK * CHUNK;
    parts[i].end = i == nt - 1 ? j->n : j->n * (i + 1) / nt / CHUNK * CHUNK;
  }
  for (int i = 1; i < nt; i++) pthread_create(&t[i], 0, part_run, &parts[i]);
  part_run(&parts[0]);
  for (int i = 1; i < nt; i++) pthread_join(t[i], 0);
}

/* The jobs on arrays of n elements, p, g, g2, m, v (the caller's: both builds step the same memory), of dtype dt
   (0 float32, 1 bfloat16) for params and gradients, ds for the states; replica 0 for cpu_fast's loops, else
   cpu's with that inline replica. */
void *ab_new(int dt, int ds, int replica, int64_t n, void *p, void *g, void *g2, void *m, void *v) {
  AB *h = (AB *)calloc(1, sizeof(AB));
  make_jobs(&h->j, &h->back, dt, dt, ds, n, p, g, g2, m, v, replica);
  return h;
}

/* One rep: out[0] the step's seconds, out[1] the undo+redo's (a new gradient), out[2] the undo's (of the step). */
void ab_rep(void *handle, int nt, double *out) {
  AB *h = (AB *)handle;
  double t0;
  h->j.op = OP_STEP;
  t0 = now();
  run_threads(&h->j, nt);
  out[0] = now() - t0;
  h->j.op = OP_UNDO_REDO;
  t0 = now();
  run_threads(&h->j, nt);
  out[1] = now() - t0;
  h->back.op = OP_UNDO_REDO;
  run_threads(&h->back, nt);
  h->j.op = OP_UNDO;
  t0 = now();
  run_threads(&h->j, nt);
  out[2] = now() - t0;
}

void ab_free(void *handle) { free(handle); }
"""

COMBOS = {"float32": (0, 1), "bf16 params + fp32 states": (1, 1), "all-bf16": (1, 0)}  # (dtype, fp32 states)
OPS = ("step", "undo+redo", "undo")


def load(directory: str, source: str, extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """The harness library built from ``source`` in ``directory`` (its own folder: the kernel source beside it;
    ``extra_flags`` after the kernels' flags)."""
    os.makedirs(directory, exist_ok=True)
    try:
        path = compile_program(LIBRARY, directory, "ab", source, shared=True, extra_flags=extra_flags)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    lib = ctypes.CDLL(path)
    lib.ab_new.restype = ctypes.c_void_p
    lib.ab_new.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, *[ctypes.c_void_p] * 5]
    lib.ab_rep.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    lib.ab_free.argtypes = [ctypes.c_void_p]
    return lib


def arrays(dt: int, fp32_states: int, n: int) -> list[torch.Tensor]:
    """p, g, g2, m, v: random values of a step's sizes (never zeros), bfloat16 where ``dt`` says (the states
    float32 with ``fp32_states``)."""
    gen = torch.Generator().manual_seed(12345)
    pg, st = (torch.bfloat16 if dt else torch.float32), (torch.bfloat16 if dt and not fp32_states else torch.float32)

    def uniform(scale: float, shift: float, dtype: torch.dtype) -> torch.Tensor:
        return (torch.rand(n, generator=gen) * (2 * scale) - scale + shift).to(dtype)

    return [uniform(1.0, 0.0, pg), uniform(1.0, 0.0, pg), uniform(1.0, 0.0, pg), uniform(0.1, 0.0, st),
            uniform(0.005, 0.006, st)]


def timed(libs: list[ctypes.CDLL], dt: int, fp32_states: int, replica: int, n: int, reps: int,
          threads: int) -> list[list[tuple[float, ...]]]:
    """Per build, per rep: the seconds of each of OPS, all builds on the same arrays (the memory's layout would
    differ between two sets: a bias of its own), in turns (in reversed order every other rep)."""
    data = arrays(dt, fp32_states, n)
    ptrs = [t.data_ptr() for t in data]
    ds = 0 if fp32_states else dt
    handles = [lib.ab_new(dt, ds, replica, n, *ptrs) for lib in libs]
    out = (ctypes.c_double * 3)()
    times: list[list[tuple[float, ...]]] = [[] for _ in libs]
    try:
        for i, lib in enumerate(libs):  # a warm-up rep each (the threads' first start)
            lib.ab_rep(handles[i], threads, out)
        for rep in range(reps):
            order = range(len(libs)) if rep % 2 == 0 else reversed(range(len(libs)))
            for i in order:
                libs[i].ab_rep(handles[i], threads, out)
                times[i].append(tuple(out))
    finally:
        for lib, h in zip(libs, handles):
            lib.ab_free(h)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--against", metavar="REV", help="the other build: the kernel source of this git revision")
    what.add_argument("--define", metavar="NAME=VALUE", help="the other build: this tree's source with this define")
    ap.add_argument("--backend", choices=("cpu_fast", "cpu"), default="cpu_fast",
                    help="whose loops: cpu_fast's (IEEE square roots) or cpu's (MKL's square root inline)")
    ap.add_argument("--replica", choices=tuple(_cpu_build.REPLICA_KINDS),
                    help="with --backend cpu: which inline replica of MKL's square root (default: the one in use here)")
    ap.add_argument("--elements", type=int, default=1 << 26, help="elements per array (default 2^26)")
    ap.add_argument("--reps", type=int, default=9, help="reps per build and dtype combination (default 9)")
    ap.add_argument("--threads", type=int, default=2, help="threads per call (default 2)")
    ap.add_argument("--quick", action="store_true", help="2^20 elements, 3 reps (a smoke run; numbers mean little)")
    add_smoke_build_argument(ap)
    args = ap.parse_args()
    n, reps = ((1 << 20), 3) if args.quick else (args.elements, args.reps)
    replica = replica_kind(args.replica) if args.backend == "cpu" else 0
    other = source_at(args.against) if args.against else with_define(SOURCE, args.define)
    label = args.against or args.define
    with tempfile.TemporaryDirectory(prefix="sofx-memory-ab-") as tmp:
        with ThreadPoolExecutor(max_workers=2) as pool:  # both compilers at once (~25 s of a core each)
            libs = list(pool.map(load, [os.path.join(tmp, "tree"), os.path.join(tmp, "other")], [SOURCE, other],
                                 [extra_build_flags(args)] * 2))
        results = {name: timed(libs, dt, fs, replica, n, reps, args.threads) for name, (dt, fs) in COMBOS.items()}
    print(f"# sofx CPU kernels where the memory sets the time ({loops_title(args.backend, replica)}, {args.threads} "
          f"threads, {n} elements), machine: {cpu_model()}")
    print(f"command: {' '.join(['benchmarks/kernel_memory_ab.py', *sys.argv[1:]])}\n")
    print(f"| dtypes | operation | this tree ms | {label} ms | ratio (median) | ratio (min-max) |")
    print("|---|---|---:|---:|---:|---:|")
    for name, (tree, oth) in results.items():
        for k, op in enumerate(OPS):
            a, b = [t[k] for t in tree], [t[k] for t in oth]
            ratios = [x / y for x, y in zip(a, b)]
            print(f"| {name} | {op} | {1e3 * statistics.median(a):.2f} | {1e3 * statistics.median(b):.2f} | "
                  f"{statistics.median(ratios):.3f} | {min(ratios):.2f}-{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
