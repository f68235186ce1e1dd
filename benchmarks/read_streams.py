"""What this machine's memory charges for reading and for writing: time of in-place passes by streams read and written.

    python benchmarks/read_streams.py                 # 2^26 float32 elements per array, 2 threads, 7 rounds

Issue #4 asks for a fused undo+redo with a new gradient within 1.25x of a step. The step reads 4 arrays
(p, g, m, v) and writes 3 of them back; the undo+redo reads 5 (p', g_old, m', v', g_new) and writes 3:
8 streams against 7, 1.14x the bytes. This script times plain passes of that shape, without Adam's
arithmetic and without torch: R arrays read (summed, with the kernels' software prefetch), W of them
written back in place, for R/W = 4/0, 5/0, 4/3, 5/3, 3/3, 4/4, 5/5 and the bandwidth anchor 2/1 (the
in-place ``a.add_(c)`` of ``kernels.py``), alternating round by round. Where the reads alone set the
time (the same read rate whatever is written), 5/3 takes 5/4 of 4/3, which is the issue's bound with
nothing left for arithmetic. Builds a small C library with the system compiler (gcc or clang, OpenMP).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

# (read, written) arrays per pass; (2, 1) is kernels.py's bandwidth anchor.
MIXES = ((4, 0), (5, 0), (4, 3), (5, 3), (3, 3), (4, 4), (5, 5), (2, 1))

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>

#define MAX_ARRAYS 5
static float *arrays[MAX_ARRAYS];

/* MAX_ARRAYS arrays of n floats, page aligned (so at one page offset, as torch places large tensors),
   filled with small non-zero values. */
int allocate(int64_t n) {
  for (int k = 0; k < MAX_ARRAYS; k++) {
    if (posix_memalign((void **)&arrays[k], 4096, (size_t)n * sizeof(float))) return -1;
    for (int64_t i = 0; i < n; i++) arrays[k][i] = 1e-3f * (float)((i + k) % 7 + 1);
  }
  return 0;
}

/* The vector loops' software prefetch: 1024 bytes ahead, staggered by 320 bytes per stream. */
#define PREFETCH(a, i, k) __builtin_prefetch((const char *)((a) + (i)) + 1024 + (k) * 320, 0, 3)

/* One pass: R arrays read and summed, the sum plus a tiny constant written into the first W of them
   (R and W are constants: the compiler drops the branches and vectorizes the loop). */
#define MIX(R, W)                                                                         \
  static float mix_##R##_##W(int64_t n) {                                                \
    float total = 0.0f;                                                                   \
    _Pragma("omp parallel reduction(+:total)")                                            \
    {                                                                                     \
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();                    \
      const int64_t begin = n / nt * t / 64 * 64;                                         \
      const int64_t end = t == nt - 1 ? n : n / nt * (t + 1) / 64 * 64;                  \
      float *restrict a0 = arrays[0], *restrict a1 = arrays[1], *restrict a2 = arrays[2]; \
      float *restrict a3 = arrays[3], *restrict a4 = arrays[4];                          \
      float acc[16] = {0};                                                                \
      for (int64_t b = begin; b < end; b += 16) {                                         \
        if ((R) > 0) PREFETCH(a0, b, 0);                                                  \
        if ((R) > 1) PREFETCH(a1, b, 1);                                                  \
        if ((R) > 2) PREFETCH(a2, b, 2);                                                  \
        if ((R) > 3) PREFETCH(a3, b, 3);                                                  \
        if ((R) > 4) PREFETCH(a4, b, 4);                                                  \
        const int64_t stop = b + 16 < end ? b + 16 : end;                                \
        _Pragma("omp simd")                                                               \
        for (int64_t i = b; i < stop; i++) {                                              \
          float x = a0[i];                                                                \
          if ((R) > 1) x += a1[i];                                                        \
          if ((R) > 2) x += a2[i];                                                        \
          if ((R) > 3) x += a3[i];                                                        \
          if ((R) > 4) x += a4[i];                                                        \
          const float y = x * 0.25f + 1e-30f;                                             \
          if ((W) > 0) a0[i] = y;                                                         \
          if ((W) > 1) a1[i] = y;                                                         \
          if ((W) > 2) a2[i] = y;                                                         \
          if ((W) > 3) a3[i] = y;                                                         \
          if ((W) > 4) a4[i] = y;                                                         \
          acc[i - b] += x;                                                                \
        }                                                                                 \
      }                                                                                   \
      for (int k = 0; k < 16; k++) total += acc[k];                                       \
    }                                                                                     \
    return total;                                                                         \
  }
MIX(4, 0) MIX(5, 0) MIX(4, 3) MIX(5, 3) MIX(3, 3) MIX(4, 4) MIX(5, 5) MIX(2, 1)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

volatile float sink;

/* Seconds of one pass of the mix (reads, writes) over n elements per array; -1 for an unknown mix. */
double time_mix(int reads, int writes, int64_t n) {
  float (*f)(int64_t) = 0;
#define CASE(R, W) if (reads == R && writes == W) f = mix_##R##_##W;
  CASE(4, 0) CASE(5, 0) CASE(4, 3) CASE(5, 3) CASE(3, 3) CASE(4, 4) CASE(5, 5) CASE(2, 1)
  if (!f) return -1.0;
  const double t = now();
  sink = f(n);
  return now() - t;
}
"""


def compiler() -> str | None:
    """The system compiler: ``CC``, else the first of cc, gcc, clang on the PATH (None if none)."""
    return os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def build(directory: str) -> ctypes.CDLL:
    """The C library above, compiled with the system compiler into ``directory``; exits if none works."""
    cc = compiler()
    if cc is None:
        sys.exit("needs a C compiler (cc, gcc or clang)")
    src, out = os.path.join(directory, "read_streams.c"), os.path.join(directory, "read_streams.so")
    with open(src, "w", encoding="utf-8") as f:
        f.write(SOURCE)
    proc = subprocess.run([*cc.split(), "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", out],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"compiling the stream library failed:\n{proc.stderr}")
    lib = ctypes.CDLL(out)
    lib.allocate.argtypes, lib.allocate.restype = [ctypes.c_int64], ctypes.c_int
    lib.time_mix.argtypes, lib.time_mix.restype = [ctypes.c_int, ctypes.c_int, ctypes.c_int64], ctypes.c_double
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--log2-numel", type=int, default=26)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read when the library's OpenMP runtime starts
    n = 1 << args.log2_numel
    with tempfile.TemporaryDirectory() as directory:
        lib = build(directory)
    if lib.allocate(n) != 0:
        sys.exit("allocation failed")
    times: dict[tuple[int, int], list[float]] = {mix: [] for mix in MIXES}
    for rnd in range(args.rounds + 1):
        for mix in MIXES if rnd % 2 == 0 else tuple(reversed(MIXES)):
            t = lib.time_mix(*mix, n)
            if rnd > 0:  # round 0 warms up (first touch, OpenMP threads)
                times[mix].append(t)
    median = {mix: statistics.median(ts) for mix, ts in times.items()}
    array_gb = n * 4 / 1e9
    print(f"float32, {n} elements per array, {args.threads} threads, median of {args.rounds} rounds")
    print()
    print("| read / written | ms | read GB/s | read + written GB/s |")
    print("|---|---:|---:|---:|")
    for (reads, writes), t in median.items():
        print(f"| {reads} / {writes} | {t * 1e3:.1f} | {reads * array_gb / t:.1f} | "
              f"{(reads + writes) * array_gb / t:.1f} |")
    print()
    print(f"5/3 over 4/3 (undo+redo with a new gradient over a step, traffic only): "
          f"{median[(5, 3)] / median[(4, 3)]:.2f}; bytes alone: {8 / 7:.2f}; reads alone: {5 / 4:.2f}")
    print(f"5/0 over 4/0 (reads only): {median[(5, 0)] / median[(4, 0)]:.2f}; "
          f"4/3 over 4/0 (what writing 3 arrays back adds): {median[(4, 3)] / median[(4, 0)]:.2f}")


if __name__ == "__main__":
    main()
