"""A/B of the vector loops' prefetch stagger: the step and the undo+redo with a new gradient per stagger.

    python benchmarks/prefetch_stagger.py                       # staggers 0 and 320 bytes, 2^26 fp32
    python benchmarks/prefetch_stagger.py --staggers 0,128,320,448 --traffic-only --rounds 10

The kernels prefetch stream k (p, g, m, v, new gradient) PREFETCH_BYTES + k * PREFETCH_STAGGER bytes
ahead. This builds one native library per stagger (``--traffic-only``: also the memory-traffic-only
library of ``memory_floor.py`` per stagger) in a temporary cache and times the ``cpu`` backend on
each (``cpu_fast`` where ``cpu``'s vector loops do not run, or ``--backend``'s), alternating round by round.
benchmarks/RESULTS.md "Staggered prefetch" has the runs that chose 320. Needs the vector loops (AVX-512 or
AVX2).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sofx.kernels import _cpu_build  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import add_smoke_build_argument, build_variants, extra_build_flags, size_arguments  # noqa: E402
from memory_floor import backend_for, compare_libraries, require_vector_loops, traffic_only_source  # noqa: E402

_DEFINE = re.compile(r"^#define PREFETCH_STAGGER \d+$", re.M)


def stagger_source(source: str, stagger: int) -> str:
    """The kernel source with PREFETCH_STAGGER set to ``stagger`` bytes."""
    if len(_DEFINE.findall(source)) != 1:
        sys.exit(f"the kernel source changed: update {__file__} (#define PREFETCH_STAGGER)")
    return _DEFINE.sub(f"#define PREFETCH_STAGGER {stagger}", source)


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--staggers", default="0,320", help="comma-separated bytes (default 0,320)")
    ap.add_argument("--traffic-only", action="store_true", help="also each stagger's traffic-only library")
    ap.add_argument("--backend", choices=("cpu", "cpu_fast"),
                    help="default: cpu where its vector loops run, else cpu_fast")
    add_smoke_build_argument(ap)


def main() -> None:
    args = size_arguments(__doc__.split("\n")[0], rounds=8, more=_arguments)
    backend = backend_for(require_vector_loops(), args.backend)
    sources = {}  # name: (source, traffic only)
    for stagger in (int(x) for x in args.staggers.split(",")):
        source = stagger_source(_cpu_build.SOURCE, stagger)
        sources[f"kernels, stagger {stagger}"] = (source, False)
        if args.traffic_only:
            sources[f"traffic only, stagger {stagger}"] = (traffic_only_source(source), True)
    built = build_variants([source for source, _ in sources.values()], extra_build_flags(args))
    libraries = {name: (lib, traffic) for (name, (_, traffic)), lib in zip(sources.items(), built)}
    compare_libraries(libraries, 1 << args.log2_numel, args.rounds, backend)


if __name__ == "__main__":
    main()
