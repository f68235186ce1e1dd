"""What the kernels are on this machine, in words; ``python -m sofx.kernels`` prints it.

That command also builds the native CPU library where it is not built yet (the first update on a CPU would,
~15-40 s), so that a container image, a cluster's shared cache or a job's first step can have it done before
training starts, and it says why the CPU backends run the reference math where they do. It exits with status 1
when the native library is unavailable (no compiler, ``SOFX_CPU_NATIVE=0``, a build that failed), else 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
import time
import warnings
from typing import Sequence

import torch

from sofx.kernels import _cpu_build, available_backends, cpu, load_backend

__all__ = ["vector_loops", "cpu_square_root", "build_command", "lines", "main"]


def vector_loops(lib: _cpu_build.NativeLib | None) -> str:
    """Which vector loops ``lib`` runs: the AVX-512 ones, the AVX2 ones (a CPU without AVX-512, or a compiler
    told so: ``CC="gcc -mno-avx512f"``) or the portable loops the compiler vectorizes (no library: none)."""
    width = lib.vector_width if lib is not None else 0
    return {16: "AVX-512", 8: "AVX2"}.get(width, "portable") + " loops"


def cpu_square_root(lib: _cpu_build.NativeLib | None) -> str:
    """How the ``cpu`` backend takes torch's square root with ``lib`` (None: the reference's own)."""
    if lib is None:
        return "the reference's (no native library)"
    if not lib.sqrt_fn:
        where = "inline in the vector loops" if lib.sqrt_replica else "sqrtf in tiles"
        return f"IEEE, {where} (torch's is not MKL's routine here)"
    kinds = _cpu_build.REPLICA_KINDS
    paths = {kinds["avx512"]: "inline, the replica of MKL's AVX-512 path",
             kinds["generic"]: "inline, the replica of MKL's generic path",
             kinds["avx2"]: "inline, the replica of MKL's AVX2 path"}
    return paths.get(lib.sqrt_replica, "MKL called per tile (no replica matches torch.sqrt here)")


def build_command(lib: _cpu_build.NativeLib) -> str:
    """The compiler and every flag the library was compiled with, in the compiler's order: the parallel-build
    flags ``_cpu_build`` puts in front (``-flto=auto`` for GCC 10 or later, :func:`_cpu_build._parallel_flags`;
    they change the build's time, not the code, and the cache key leaves them out), the flag set and tuning
    defines it chose (``lib.flags``) and the flags every build has. The compiler is the one the cache key names
    (``CC``, else the first of cc, gcc, clang found). A build whose link-time step failed ran again without the
    parallel flags, which the cached library does not record."""
    cc = _cpu_build._compiler()
    parallel = _cpu_build._parallel_flags(cc) if cc else []
    return " ".join([cc or "(no compiler found now)", *parallel, *lib.flags, *_cpu_build._COMMON])


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def lines() -> list[str]:
    """The report, a line each, building the native library first where it is not built yet."""
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the reason is in the report
        warnings.simplefilter("ignore", RuntimeWarning)
        lib = _cpu_build.load()
    ready = time.perf_counter() - t0
    out = [f"sofx {_version('sofx') or '(not installed)'}, torch {torch.__version__}, Python "
           f"{platform.python_version()}, {platform.system()} {platform.machine()}, {torch.get_num_threads()} "
           f"torch threads"]
    if lib is None:
        out.append(f"cpu, cpu_fast: the reference math ({_cpu_build.unavailable_reason()})")
    else:
        threads = "OpenMP" if "-fopenmp" in lib.flags else "pthreads started per call (no OpenMP runtime)"
        how = "built by this process" if lib.built else "loaded from the cache"
        if ready >= 0.05:  # where this call built or loaded it (not a process that had it already)
            how += f" in {ready:.1f} s"
        out += [f"cpu, cpu_fast: native kernels, {lib.path} ({how})",
                *([f"  {lib.displaced}: in this user's temporary directory instead (set SOFX_CACHE_DIR to a "
                     "writable directory)"] if lib.displaced else []),
                f"  built with: {build_command(lib)}",
                f"  {vector_loops(lib)}; threads: {threads}; "
                f"float16: {'yes' if lib.has_f16 else 'no (the reference math)'}",
                f"  cpu's square root: {cpu_square_root(lib)}; cpu bitwise with the reference: "
                f"{'yes' if cpu.bitwise_with_torch() else 'no'}"]
    triton = _version("triton")
    if "triton" in available_backends():
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        interpreted = load_backend("triton").supports("cpu", torch.float32, torch.float32)  # TRITON_INTERPRET=1
        takes = ("CUDA tensors, and CPU tensors in the interpreter (TRITON_INTERPRET=1 is set)" if interpreted
                 else "CUDA tensors; CPU tensors only under TRITON_INTERPRET=1")
        out.append(f"triton: triton {triton}, {devices} CUDA device(s) ({takes})")
    else:
        out.append("triton: not available" + (f" (triton {triton} installed but not importable here)" if triton
                                              else " (pip install triton)"))
    out.append("reference: always (any device and dtype)")
    return out


def _parser() -> argparse.ArgumentParser:
    """The command's arguments: none but ``--help``, which says what it does (an unknown one is refused)."""
    return argparse.ArgumentParser(
        prog="python -m sofx.kernels",
        description="Build the native CPU library where the cache (~/.cache/sofx, SOFX_CACHE_DIR) has none, then "
                    "say what the kernels are here: the library and its flags, its vector loops, threads and square "
                    "root, triton's devices, or why the CPU backends run the reference math.",
        epilog="exit status: 0 where the native CPU kernels are in use, 1 where the cpu and cpu_fast backends run "
               "the reference math (no compiler, SOFX_CPU_NATIVE=0, a build that failed).")


def main(argv: Sequence[str] | None = None) -> int:
    """Print :func:`lines`; 1 where the native CPU library is unavailable, else 0. ``argv`` (default
    ``sys.argv[1:]``) takes only ``--help``."""
    _parser().parse_args(argv)
    for line in lines():
        print(line)
    return 0 if _cpu_build.load() is not None else 1


if __name__ == "__main__":
    sys.exit(main())
