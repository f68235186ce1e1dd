"""What the memory traffic alone costs: the fused kernels against the same loops with the arithmetic taken out.

    python benchmarks/memory_floor.py                      # 2^26 float32 elements, 2 threads, 6 rounds
    python benchmarks/memory_floor.py --backend cpu_fast
    CC="gcc -mno-avx512f" python benchmarks/memory_floor.py   # the AVX2 loops on an AVX-512 CPU

Builds a second copy of the native library (in a temporary cache directory) whose vector loops keep
every load, prefetch and store but replace Adam's arithmetic by one add (step) or subtract (undo) per
array, then times the ``cpu`` backend's step and fused undo+redo with a new gradient on both libraries
(``cpu_fast`` where ``cpu``'s vector loops do not run: no inline replica of MKL's square root in use, so that
it calls MKL per chunk; or ``--backend``'s), alternating round by round. The ratio undo+redo / step of the
second library is the floor that the memory system alone sets on this machine for issue #4's "undo+redo <=
1.25x a step" (5 streams read and 3 written against 4 and 3; ``read_streams.py`` shows the reads alone set it
here: 5/4). Needs the vector loops: the AVX-512 ones (HW_BF16 CPUs) or the AVX2 ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from types import ModuleType

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels import _cpu_build, cpu, cpu_fast  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import (add_smoke_build_argument, alternating, build_variant, extra_build_flags, size_arguments,  # noqa: E402
                 time_step_and_undo_redo)

VARIANT = AdamVariant(decoupled=True, bias_correction=True)
S1 = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10, grad_scale=1.0)
S2 = S1._replace(lr=9e-4, grad_scale=0.5)

# The first lines of the vector loops' arithmetic, with what the traffic-only library does instead (its loads,
# prefetches and stores kept): the AVX-512 step and undo (one add / subtract per array), and the AVX2 loops'
# helpers, which every AVX2 loop (pipelined ones included) is made of: no square root, the step's moments and
# parameter one add each, the undo one subtract per array. Both sets are patched: the build compiles one.
_STEP_HEAD = ("static inline __attribute__((always_inline)) void step_vec(__m512 *P, __m512 G, __m512 *M, __m512 *V,\n"
              + " " * 60 + "const StepK *k, int rk) {")
_UNDO_HEAD = ("static inline __attribute__((always_inline)) void undo_vec(__m512 *P, __m512 G, __m512 *M, __m512 *V,\n"
              + " " * 60 + "const UndoK *k, int have_p_old, int fast, int rk) {")
_PATCHES = (
    (_STEP_HEAD, "*P = _mm512_add_ps(*P, G); *M = _mm512_add_ps(*M, G); *V = _mm512_add_ps(*V, G);"
                 " (void)k; (void)rk; return;"),
    (_UNDO_HEAD, "*P = _mm512_sub_ps(*P, G); *M = _mm512_sub_ps(*M, G); *V = _mm512_sub_ps(*V, G);"
                 " (void)k; (void)rk; return;"),
    ("static inline __attribute__((always_inline)) v8 sqrt8(v8 x, const Sqrt *sq) {",
     "(void)sq; return x;"),
    ("static inline __attribute__((always_inline)) void step_pre8(v8 *P, v8 G, v8 *M, v8 *V, const StepK *k) {",
     "*M = _mm256_add_ps(*M, G); *V = _mm256_add_ps(*V, G); (void)P; (void)k; return;"),
    ("static inline __attribute__((always_inline)) v8 step_post8(v8 P, v8 M, v8 D, const StepK *k) {",
     "(void)M; (void)k; return _mm256_add_ps(P, D);"),
    ("static inline __attribute__((always_inline)) void undo8_d(v8 *P, v8 G, v8 *M, v8 *V, v8 D, const UndoK *k,\n"
     + " " * 58 + "int have_p_old, int fast) {",
     "*P = _mm256_sub_ps(*P, G); *M = _mm256_sub_ps(*M, G); *V = _mm256_sub_ps(*V, G);"
     " (void)D; (void)k; (void)have_p_old; (void)fast; return;"),
)


def traffic_only_source(source: str) -> str:
    """The kernel source with the vector loops' arithmetic reduced to one add / subtract per array."""
    for head, body in _PATCHES:
        if source.count(head) != 1:
            sys.exit(f"the kernel source changed: update {__file__} ({head[:60]}...)")
        source = source.replace(head, head + "\n  " + body)
    return source


def build_traffic_only(extra_flags: list[str]) -> _cpu_build.NativeLib:
    return build_variant(traffic_only_source(_cpu_build.SOURCE), extra_flags)


def fresh_state(n: int) -> tuple[torch.Tensor, ...]:
    """(p, g, m, v, g2): the state a step with (g, S1) produced, and a second gradient."""
    gen = torch.Generator().manual_seed(0)
    p, g, g2 = (torch.randn(n, generator=gen) for _ in range(3))
    m = 0.1 * torch.randn(n, generator=gen)
    v = 0.01 * torch.rand(n, generator=gen) + 1e-4
    cpu.step(p, g, m, v, S1, VARIANT, out=(p, m, v))
    return p, g, m, v, g2


def compare_libraries(libraries: dict[str, tuple[_cpu_build.NativeLib, bool]], n: int, rounds: int,
                      backend: ModuleType = cpu) -> None:
    """Time ``backend``'s step and undo+redo with a new gradient on each library (name -> (library,
    traffic_only)), alternating round by round, and print the table. The kernel libraries share one set
    of arrays (every timed pair leaves it as it found it); the traffic-only ones, which change the values,
    another."""
    arrays = {kind: fresh_state(n) for kind in sorted({t for _, t in libraries.values()})}
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in libraries}
    loaded = _cpu_build._loaded[0]
    try:
        for name in alternating(list(libraries), rounds):
            library, traffic_only = libraries[name]
            _cpu_build._loaded[0] = library
            p, g, m, v, g2 = arrays[traffic_only]
            step, undo_redo = time_step_and_undo_redo(backend, p, g, m, v, S1, g2, S2, VARIANT)
            times[name][0].append(step)
            times[name][1].append(undo_redo)
    finally:
        _cpu_build._loaded[0] = loaded
    name = backend.__name__.rsplit(".", 1)[-1]
    print(f"float32, {n} elements, {torch.get_num_threads()} threads, backend {name}, median of {rounds} rounds")
    print()
    print("| library | step ms | undo+redo ms (new gradient) | undo+redo / step |")
    print("|---|---:|---:|---:|")
    for name, (steps, urs) in times.items():
        step, ur = statistics.median(steps), statistics.median(urs)
        print(f"| {name} | {step * 1e3:.1f} | {ur * 1e3:.1f} | {ur / step:.2f} |", flush=True)


def require_vector_loops() -> _cpu_build.NativeLib:
    """The loaded native library; exits unless it has the vector loops these scripts patch (AVX-512 or AVX2)."""
    lib = _cpu_build.load()
    if lib is None or not lib.vector_width:
        sys.exit("needs the native library with its vector loops (AVX-512 or AVX2) "
                 f"({_cpu_build.unavailable_reason() or 'this build has the portable loops alone'})")
    return lib


def backend_for(lib: _cpu_build.NativeLib, name: str | None) -> ModuleType:
    """The backend to time: ``name``'s, else ``cpu`` where its vector loops run (an inline replica of MKL's
    square root in use), else ``cpu_fast`` (``cpu`` calls MKL per chunk there: its square roots are not
    patched)."""
    name = name or ("cpu" if lib.sqrt_replica else "cpu_fast")
    if name == "cpu" and not lib.sqrt_replica:
        sys.exit("cpu's vector loops do not run here (no inline replica of MKL's square root in use): "
                 "--backend cpu_fast")
    return {"cpu": cpu, "cpu_fast": cpu_fast}[name]


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--backend", choices=("cpu", "cpu_fast"),
                    help="default: cpu where its vector loops run, else cpu_fast")
    add_smoke_build_argument(ap)


def main() -> None:
    args = size_arguments(__doc__.split("\n")[0], rounds=6, more=_arguments)
    lib = require_vector_loops()
    traffic = build_traffic_only(extra_build_flags(args))
    compare_libraries({"kernels": (lib, False), "memory traffic only": (traffic, True)},
                      1 << args.log2_numel, args.rounds, backend_for(lib, args.backend))


if __name__ == "__main__":
    main()
