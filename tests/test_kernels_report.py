"""``python -m sofx.kernels`` (:mod:`sofx.kernels.report`): it builds the native library where the cache has none,
says what the kernels are here, and exits with 1 where the CPU backends run the reference math."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from sofx.kernels import _cpu_build, report

from helpers import library_copying_compiler


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sofx.kernels"], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


def test_the_report_names_the_cached_library_and_what_it_runs():
    lib = _cpu_build.load()
    if lib is None:
        pytest.skip("no native library here")
    proc = _run({})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"native kernels, {lib.path} (loaded from the cache" in out
    assert f"built with: {report.build_command(lib)}" in out and "-O3" in lib.flags
    cc = _cpu_build._compiler()
    parallel = _cpu_build._parallel_flags(cc)  # -flto=auto for GCC 10 or later: given outside lib.flags
    assert report.build_command(lib) == " ".join([cc, *parallel, *lib.flags, *_cpu_build._COMMON])
    assert report.vector_loops(lib) in out and report.cpu_square_root(lib) in out
    assert ("threads: OpenMP" in out) == ("-fopenmp" in lib.flags)
    assert "triton:" in out and "reference: always" in out


def test_an_empty_cache_is_filled_and_the_report_says_so(tmp_path):
    """The command builds the library where the cache has none (a compiler standing in for the real one gives this
    process's library, quickly)."""
    lib = _cpu_build.load()
    if lib is None:
        pytest.skip("no native library here")
    env = {"CC": library_copying_compiler(tmp_path, lib.path), "SOFX_CACHE_DIR": str(tmp_path / "cache")}
    first, second = _run(env), _run(env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert f"native kernels, {tmp_path / 'cache'}" in first.stdout and "(built by this process" in first.stdout
    assert "(loaded from the cache" in second.stdout
    flags = [*_cpu_build._FLAG_SETS[0], *_cpu_build._TUNING, *_cpu_build._COMMON]
    assert f"built with: {env['CC']} {' '.join(flags)}\n" in first.stdout  # not GCC: no -flto=auto


def test_the_report_names_the_parallel_flags_given_outside_the_flag_set(tmp_path):
    """A GCC 10 or later compiles with ``-flto=auto`` in front of the library's flags (``_run_compiler``); the
    report's ``built with`` line says so (a stand-in answering ``--version`` as GCC 12 does, copying the library)."""
    lib = _cpu_build.load()
    if lib is None:
        pytest.skip("no native library here")
    fake = tmp_path / "gcc-12"
    fake.write_text("#!/bin/sh\n"
                    'case " $* " in *" --version "*) echo "gcc (Debian 12.2.0-14) 12.2.0"; '
                    'echo "Copyright (C) 2022 Free Software Foundation, Inc."; exit 0;; esac\n'
                    'echo "$*" >> "$0.log"\n'
                    'out=""; while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done\n'
                    f'cp {lib.path} "$out"\n')
    fake.chmod(0o755)
    assert _cpu_build._parallel_flags(str(fake)) == ["-flto=auto"]
    proc = _run({"CC": str(fake), "SOFX_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    flags = [*_cpu_build._FLAG_SETS[0], *_cpu_build._TUNING, *_cpu_build._COMMON]
    assert f"built with: {fake} -flto=auto {' '.join(flags)}\n" in proc.stdout
    build = [line for line in (tmp_path / "gcc-12.log").read_text().splitlines() if "-shared" in line]
    assert build and build[0].startswith(f"-flto=auto {' '.join(flags)} "), build  # what the compiler was given


@pytest.mark.parametrize("env, reason", [({"SOFX_CPU_NATIVE": "0"}, "disabled by SOFX_CPU_NATIVE=0"),
                                         ({"CC": "/no/such/compiler"}, "no C compiler found")])
def test_without_the_native_library_it_says_why_and_exits_with_1(env, reason, tmp_path):
    proc = _run({**env, "SOFX_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 1, proc.stderr
    assert f"cpu, cpu_fast: the reference math ({reason}" in proc.stdout


def test_the_descriptions_of_each_build_kind():
    assert report.vector_loops(None) == "portable loops"
    assert report.cpu_square_root(None) == "the reference's (no native library)"
    lib = _cpu_build.load()
    if lib is None:
        pytest.skip("no native library here")
    assert [report.vector_loops(dataclasses.replace(lib, vector_width=w)) for w in (16, 8, 0)] == [
        "AVX-512 loops", "AVX2 loops", "portable loops"]
    kinds = _cpu_build.REPLICA_KINDS
    mkl = dataclasses.replace(lib, sqrt_fn=1)
    assert report.cpu_square_root(dataclasses.replace(mkl, sqrt_replica=kinds["generic"])) == (
        "inline, the replica of MKL's generic path")
    assert report.cpu_square_root(dataclasses.replace(mkl, sqrt_replica=0)).startswith("MKL called per tile")
    ieee = dataclasses.replace(lib, sqrt_fn=0)
    assert report.cpu_square_root(dataclasses.replace(ieee, sqrt_replica=kinds["ieee"])).startswith(
        "IEEE, inline in the vector loops")
    assert report.cpu_square_root(dataclasses.replace(ieee, sqrt_replica=0)).startswith("IEEE, sqrtf in tiles")


def test_help_prints_the_usage_and_an_unknown_argument_is_refused(tmp_path):
    """``python -m sofx.kernels --help`` says what the command does and exits 0 without building or reporting
    (it ran the report, a build in an empty cache, and ignored its arguments); an unknown argument is refused
    naming it, with argparse's exit status 2."""
    env = {"SOFX_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "sofx.kernels", "--help"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m sofx.kernels") and "exit status" in proc.stdout
    assert "native kernels" not in proc.stdout and not any(tmp_path.iterdir())
    proc = subprocess.run([sys.executable, "-m", "sofx.kernels", "--build"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unrecognized arguments: --build" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_the_triton_line_says_whether_the_interpreter_runs_cpu_tensors():
    """Under ``TRITON_INTERPRET=1`` the report says that the triton backend takes CPU tensors now (the
    interpreter), where it said "only under TRITON_INTERPRET=1" whether or not that was set."""
    from sofx.kernels import load_backend
    if load_backend("triton") is None:
        pytest.skip("triton is not installed")
    interpreted = _run({"TRITON_INTERPRET": "1"})
    assert interpreted.returncode in (0, 1), interpreted.stderr
    assert "CUDA tensors, and CPU tensors in the interpreter (TRITON_INTERPRET=1 is set)" in interpreted.stdout
    plain = _run({"TRITON_INTERPRET": "0"})
    assert "(CUDA tensors; CPU tensors only under TRITON_INTERPRET=1)" in plain.stdout
