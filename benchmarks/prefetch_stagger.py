"""A/B of the vector loops' prefetch stagger: the step and the undo+redo with a new gradient per stagger.

    python benchmarks/prefetch_stagger.py                       # staggers 0 and 320 bytes, 2^26 fp32
    python benchmarks/prefetch_stagger.py --staggers 0,128,320,448 --traffic-only --rounds 10

The kernels prefetch stream k (p, g, m, v, new gradient) PREFETCH_BYTES + k * PREFETCH_STAGGER bytes
ahead. This builds one native library per stagger (``--traffic-only``: also the memory-traffic-only
library of ``memory_floor.py`` per stagger) in a temporary cache and times the ``cpu`` backend on
each, alternating round by round. benchmarks/RESULTS.md "Staggered prefetch" has the runs that chose
320. Needs the AVX-512 vector loops (HW_BF16 CPUs).
"""

from __future__ import annotations

import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels import _cpu_build, cpu  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import alternating, build_variant, size_arguments, time_step_and_undo_redo  # noqa: E402
from memory_floor import S1, S2, VARIANT, traffic_only_source  # noqa: E402

_DEFINE = re.compile(r"^#define PREFETCH_STAGGER \d+$", re.M)


def stagger_source(source: str, stagger: int) -> str:
    """The kernel source with PREFETCH_STAGGER set to ``stagger`` bytes."""
    if len(_DEFINE.findall(source)) != 1:
        sys.exit(f"the kernel source changed: update {__file__} (#define PREFETCH_STAGGER)")
    return _DEFINE.sub(f"#define PREFETCH_STAGGER {stagger}", source)


def main() -> None:
    import argparse

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--staggers", default="0,320")
    extra.add_argument("--traffic-only", action="store_true")
    own, rest = extra.parse_known_args()
    sys.argv[1:] = rest
    args = size_arguments(__doc__.split("\n")[0], rounds=8)
    lib = _cpu_build.load()
    if lib is None or not lib.sqrt_replica or not lib.vector_loops:
        sys.exit("needs the native library with its vector loops (AVX-512 with bf16 conversion) "
                 f"({_cpu_build.unavailable_reason() or 'the vector loops are not in use here'})")
    libraries = {}
    for stagger in (int(x) for x in own.staggers.split(",")):
        source = stagger_source(_cpu_build.SOURCE, stagger)
        libraries[f"kernels, stagger {stagger}"] = build_variant(source)
        if own.traffic_only:
            libraries[f"traffic only, stagger {stagger}"] = build_variant(traffic_only_source(source))
    n = 1 << args.log2_numel
    gen = torch.Generator().manual_seed(0)
    p, g, g2 = (torch.randn(n, generator=gen) for _ in range(3))
    m = 0.1 * torch.randn(n, generator=gen)
    v = 0.01 * torch.rand(n, generator=gen) + 1e-4
    cpu.step(p, g, m, v, S1, VARIANT, out=(p, m, v))  # the state a step with (g, S1) produced
    # One set of arrays for the kernel libraries (each A/B pair leaves it as it found it); the traffic-only
    # libraries change the values, so they get their own.
    traffic = tuple(x.clone() for x in (p, g, m, v, g2))
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in libraries}
    try:
        for name in alternating(list(libraries), args.rounds):
            _cpu_build._loaded[0] = libraries[name]
            pp, gg, mm, vv, gg2 = traffic if name.startswith("traffic") else (p, g, m, v, g2)
            step, undo_redo = time_step_and_undo_redo(cpu, pp, gg, mm, vv, S1, gg2, S2, VARIANT)
            times[name][0].append(step)
            times[name][1].append(undo_redo)
    finally:
        _cpu_build._loaded[0] = lib
    print(f"float32, {n} elements, {torch.get_num_threads()} threads, backend cpu, median of {args.rounds} rounds")
    print()
    print("| library | step ms | undo+redo ms (new gradient) | undo+redo / step |")
    print("|---|---:|---:|---:|")
    for name, (steps, urs) in times.items():
        step, ur = statistics.median(steps), statistics.median(urs)
        print(f"| {name} | {step * 1e3:.1f} | {ur * 1e3:.1f} | {ur / step:.2f} |", flush=True)


if __name__ == "__main__":
    main()
