"""Compile the native CPU kernels once per machine and load them with ctypes.

The C source (:mod:`sofx.kernels._cpu_source`) is plain C99 with no Python or
torch headers; a cold compile takes ~21 s of one core (``-O3``, several vector loops). With GCC (10 or
later) it is built with ``-flto=auto``, which compiles the program's partitions on every core (11.5 s on two
cores here, the same code speed; a build whose link-time step fails is built again without it; the cache key
leaves it out). The shared library is cached on disk under ``$SOFX_CACHE_DIR`` (default
``$XDG_CACHE_HOME/sofx`` or ``~/.cache/sofx``; where that directory cannot take it, read-only or full, in
``$TMPDIR/sofx-<uid>``, this user's alone, with a warning that says why), keyed by a hash of the source, the
compiler, its flags and the CPU's instruction-set flags (the library is built with ``-march=native``),
written to a temporary file, synced to disk and renamed into place, so that concurrent
processes never load a half-written file (a cached file cut short anyway, by a copy say, is found
damaged by :func:`elf_problem`, logged and built again: mapped, it would kill the process with
SIGBUS), and built by one process while the others that need it wait (a lock file beside it). A flag set
the compiler refused (``-fopenmp`` without an OpenMP runtime, say) is recorded there too (a
``.failed`` file beside the library's name, with the host, the compiler's file and the environment variables it
finds its programs, headers and libraries through: :func:`_build_context`) and skipped by later processes
where they are the same; elsewhere (another node sharing the cache, another ``PATH`` or ``LIBRARY_PATH``) it is
tried again, and a refusal there is added to the record; a refusal is kept for a day, then tried again (an
OpenMP runtime installed since; a failure of the machine, a full disk or a compiler killed for its memory, is not
recorded). In the process it is built and
loaded at most once (a lock guards the lazy load); the result, or the reason
it is unavailable, is cached.

The build is logged on the ``sofx.kernels`` logger at level INFO (the compiler and flags, a wait for another
process's build, the time it took, a refused flag set), so that a first update's pause of 15-40 s can be
told apart from a hang: ``logging.basicConfig(level=logging.INFO)`` shows it.

Set ``SOFX_CPU_NATIVE=0`` to disable the native kernels (the CPU backend then
runs the reference math), ``CC`` to choose the compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence

import torch

from sofx.durable import fsync_best_effort
from sofx.kernels._cpu_source import DT_BF16, DT_F16, DT_F32, SOURCE
from sofx.kernels._torch_sqrt import torch_sqrt_is_ieee, torch_sqrt_routine
from sofx.warn import caller_stacklevel

__all__ = ["NativeLib", "load", "unavailable_reason"]

_log = logging.getLogger("sofx.kernels")

# -ffp-contract=off: no multiply-add is fused unless the source says fmaf (bitwise reference results).
# vect-epilogues-nomask=0: no vectorized remainder loops (a third less compile time, tails are short).
# Tried in order (clang has no such --param; some compilers or CPUs have no -march=native).
# -fopenmp: the threads come from torch's OpenMP runtime when torch uses libgomp (see the source);
# without OpenMP (no libgomp, some clang setups) the kernels start pthreads per call instead.
_BASE_FLAG_SETS = (
    ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
     "--param", "vect-epilogues-nomask=0"],
    ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"],
    ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"],
)
_FLAG_SETS = tuple([*f, "-fopenmp"] for f in _BASE_FLAG_SETS) + _BASE_FLAG_SETS
_COMMON = ["-std=gnu11", "-shared", "-fPIC", "-pthread"]


@dataclasses.dataclass(frozen=True)
class NativeLib:
    """The loaded library: ``adam_many`` is the C entry point ``sofx_adam_many`` (any number of blocks in one
    call), ``has_f16`` whether float16 works.

    ``sqrt_fn``/``sqrt_mode``/``sqrt_local``: the square-root routine to pass to ``adam_many`` (see
    :mod:`sofx.kernels._torch_sqrt`);
    ``vector_width``: the lanes of this build's explicit vector loops, 16 (AVX-512 with bf16 conversion in
    hardware), 8 (AVX2) or 0 (the portable loops alone), and ``vector_loops`` whether they are the AVX-512 ones;
    ``sqrt_replica``: 0, or which inline replica of that routine the exact mode computes its results with
    (``REPLICA_*`` in the source: 1 MKL's AVX-512 code path, 2 its generic one, 4 its AVX2 one; the first that this
    build has and that gives ``torch.sqrt``'s bits here; 0: the routine called per chunk; 8 where torch's square
    root is not MKL's routine: IEEE square roots in the vector loops, as the exact mode's sqrtf, where the build has
    them); ``sqrt``: the C entry ``sofx_sqrt`` (square roots as
    the exact mode takes them); ``bitwise_torch``: whether the exact mode reproduces ``torch.sqrt`` bit for bit;
    ``copy_sumsq``: the C entry ``sofx_copy_sumsq`` (:mod:`sofx.kernels.grad_copy`); ``overlap``: the C entry
    ``sofx_overlap`` (a call's written arrays against the others, from ``adam_many``'s tables); ``flags``: the
    flag set and tuning defines it was built with (empty where it was opened by path); ``built``: whether it was
    not in the cache when this process asked for it (so built then, by this process or one it waited for);
    ``displaced``: why it is in this user's private temporary directory, not the cache directory (that
    directory could not take it: read-only, full, ...; :func:`_private_cache_dir`), else ''.
    """

    path: str
    adam_many: ctypes._CFuncPtr
    has_f16: bool
    sqrt_fn: int
    sqrt_mode: int
    sqrt_local: int
    vector_width: int
    sqrt_replica: int
    sqrt: ctypes._CFuncPtr
    bitwise_torch: bool
    copy_sumsq: ctypes._CFuncPtr
    overlap: ctypes._CFuncPtr
    flags: tuple[str, ...] = ()
    built: bool = False
    displaced: str = ""

    @property
    def vector_loops(self) -> bool:
        return self.vector_width == 16


# The element types the library's entry points take, by their codes (DT_* in the source).
DTYPE_CODES = {torch.float32: DT_F32, torch.bfloat16: DT_BF16, torch.float16: DT_F16}

_lock = threading.Lock()
_loaded: list[NativeLib | str] = []  # at most one entry: the library or why it is unavailable
DISABLED = "disabled by SOFX_CPU_NATIVE=0"  # the reason where the native kernels were asked not to be used


class _CacheUnusable(Exception):
    """The cache directory cannot take a build: it cannot be made or written (a read-only home), or there is no
    room left in it; the message says which."""


def _private_cache_dir() -> str:
    """``sofx-<uid>/kernels`` in the temporary directory (``TMPDIR``, :func:`tempfile.gettempdir`), where the
    library is built when the cache directory cannot take it: made readable and writable by this user alone,
    and refused (OSError) where it is there but not so (another user's, or open to others, in a shared /tmp:
    what they put in it would run as this user's code)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    root = os.path.join(tempfile.gettempdir(), f"sofx-{uid if uid is not None else 'user'}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    info = os.lstat(root)
    if uid is not None and (not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077):
        raise OSError(f"{root} is not a directory of this user's alone")
    return os.path.join(root, "kernels")


def _cache_dir() -> str:
    """``$SOFX_CACHE_DIR/kernels``, else ``sofx/kernels`` in ``$XDG_CACHE_HOME`` (where absolute, as the XDG
    specification asks) or ``~/.cache``; raises :class:`_CacheUnusable` where there is no home to find that in
    (no HOME, a user the password database does not know: "~" would be a directory named so in the working
    directory)."""
    root = os.environ.get("SOFX_CACHE_DIR")
    if root:
        return os.path.join(root, "kernels")
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            who = f"user {os.getuid()}" if hasattr(os, "getuid") else "this user"
            raise _CacheUnusable(f"HOME is unset and {who} has no home")
        base = os.path.join(home, ".cache")
    return os.path.join(base, "sofx", "kernels")


def _cpuinfo_field(name: str) -> str:
    """The first value of ``name`` in /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""


def _tuning_defines() -> list[str]:
    """Defines for choices the source leaves to measurement on the CPU: ``FAST_DIVIDER=1`` (the AVX-512 loops take
    true divisions in cpu_fast's inverse, see quot_vec, and in cpu's denominators, see adam_denominator) on AMD
    Zen 5 (family 26) and later, whose 512-bit divider made cpu_fast's undo 13-35% and cpu's step ~10% faster
    in cache than div_by (benchmarks/RESULTS.md); elsewhere div_by: Intel's AVX-512 CPUs divide 512-bit vectors
    more slowly (on the Xeon of stop 27, 10.6 cycles per division and 12.7 per square root, on one divider: there
    the define made cpu_fast's undo 1.3-1.9x slower in cache), and Zen 4 splits them in halves (not measured)."""
    family = _cpuinfo_field("cpu family")
    if _cpuinfo_field("vendor_id") == "AuthenticAMD" and family.isdigit() and int(family) >= 26:
        return ["-DFAST_DIVIDER=1"]
    return []


_TUNING = _tuning_defines()


def _cpu_fingerprint() -> str:
    """The CPU's vendor, family, model and feature flags (what ``-march=native`` depends on: its instruction sets
    and its tuning; Arm's /proc/cpuinfo names its flags ``Features`` and its model ``CPU part``)."""
    fields = [_cpuinfo_field(name) for name in ("vendor_id", "cpu family", "model", "flags", "Features", "CPU part")]
    return "|".join(fields) if any(fields) else platform.processor() + platform.machine()


_COMPILER_NAMES = ("cc", "gcc", "clang")


def _compiler() -> str | None:
    """``CC`` (a command and its arguments) where it names a command found here, else the first of
    ``_COMPILER_NAMES`` on the PATH where CC is unset; None where there is none (:func:`_no_compiler`: why)."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc.split()[0]) and cc
    for name in _COMPILER_NAMES:
        if shutil.which(name):
            return name
    return None


def _no_compiler() -> str:
    """Why :func:`_compiler` found none: the CC set names no command, or none of the usual names is on the PATH."""
    cc = os.environ.get("CC")
    if cc:
        return f"no C compiler found: CC={cc.split()[0]!r} names no command here"
    return f"no C compiler found ({', '.join(_COMPILER_NAMES)}): set CC to one"


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([*cc.split(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


_GCC_MAJOR = re.compile(r"\)\s+(\d+)\.")  # GCC's first line: "NAME (PKGVERSION) VERSION [DATE]"


def _parallel_flags(cc: str) -> list[str]:
    """``-flto=auto`` for GCC 10 or later (its spelling of "partition the program at link time and compile the
    partitions on every core": the build's time, not the code, is what changes; measured equal in and out of
    cache), else nothing (clang's link-time optimization needs a linker plugin the system may lack)."""
    version = _compiler_version(cc)
    major = _GCC_MAJOR.search(version.split("\n", 1)[0])
    is_gcc = "Free Software Foundation" in version and major is not None
    return ["-flto=auto"] if is_gcc and int(major.group(1)) >= 10 else []


_COMPILE_TIMEOUT_S = 300.0


def _run_as_group(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``command`` run to its end, its output captured, in a process group of its own: where it overruns
    ``timeout`` (``subprocess.TimeoutExpired``) or this process is interrupted while it runs (Ctrl-C, any
    exception), the whole group is killed, the compiler's own children (``cc1``, ``as``, the link-time
    partitions of ``-flto=auto``) with it, not only the driver (``subprocess.run`` kills that one alone, and its
    children ran on to their end). Ctrl-C at a terminal reaches this process alone, which then kills the group."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=hasattr(os, "killpg"))
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        if hasattr(os, "killpg"):
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _run_compiler(cc: str, args: list[str], parallel: bool = True) -> subprocess.CompletedProcess:
    """``cc`` on ``args`` (:func:`_run_as_group`), with :func:`_parallel_flags` in front (``parallel``); again
    without them where the first run failed in its link-time step (its errors name lto: a GCC without its LTO
    plugin, say)."""
    extra = _parallel_flags(cc) if parallel else []
    proc = _run_as_group([*cc.split(), *extra, *args], _COMPILE_TIMEOUT_S)
    if proc.returncode != 0 and extra and "lto" in proc.stderr.lower():
        proc = _run_as_group([*cc.split(), *args], _COMPILE_TIMEOUT_S)
    return proc


def _beside(target: str, ext: str) -> str:
    """The file named as ``target`` (a ``.so``) but for its extension, ``ext``."""
    return target[:-len(".so")] + ext


def _failed_marker(target: str) -> str:
    """The file beside ``target`` that records the compiler's refusals of it (see :func:`_compile`)."""
    return _beside(target, ".failed")


# The environment variables through which the compiler finds its programs (PATH: the assembler and the linker;
# COMPILER_PATH, GCC_EXEC_PREFIX), headers (CPATH, C_INCLUDE_PATH), libraries (LIBRARY_PATH; LD_LIBRARY_PATH: the
# linker's search for a library's own dependencies, and the compiler's own shared libraries) and options (clang's
# CCC_OVERRIDE_OPTIONS; SDKROOT on macOS): a flag set refused with one value of them may build with another.
_BUILD_ENVIRONMENT = ("PATH", "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "C_INCLUDE_PATH", "COMPILER_PATH",
                      "GCC_EXEC_PREFIX", "CCC_OVERRIDE_OPTIONS", "SDKROOT")
_REFUSALS_KEPT = 32  # refusals a marker keeps, the newest (one per host and environment a refusal was met in)
_REFUSAL_KEPT_S = 24 * 3600  # then the build is tried again: what was missing may have been installed since


def _build_context(cc: str) -> dict:
    """Where a build with the compiler command ``cc`` runs, as a refusal records it: ``host``, this machine's name
    (what is installed on it: an OpenMP runtime, the headers; a cache shared between nodes is read by several),
    ``compiler``, the file ``cc`` resolves to (links followed: update-alternatives), and ``environment``, those
    of :data:`_BUILD_ENVIRONMENT` that are set. The compiler's command and version, the flags, the source and the
    CPU are in the cache key, so in the marker's name, already."""
    command = cc.split()[0]
    return {"host": platform.node(), "compiler": os.path.realpath(shutil.which(command) or command),
            "environment": {name: os.environ[name] for name in _BUILD_ENVIRONMENT if name in os.environ}}


def _recorded_refusals(marker: str) -> list[dict]:
    """The refusals recorded in ``marker`` (:func:`_failed_marker`) less than :data:`_REFUSAL_KEPT_S` ago (or
    ahead: a clock set wrong), each a :func:`_build_context` with the ``time`` and the compiler's ``error``; none
    where there is no such record: no file, a damaged one, or an older sofx's, the error alone, which does not say
    where or when it was met."""
    try:
        with open(marker, encoding="utf-8") as f:
            refusals = json.load(f)["refusals"]
    except (OSError, ValueError, TypeError, KeyError):
        return []
    if not isinstance(refusals, list):
        return []
    now = time.time()
    return [r for r in refusals if isinstance(r, dict) and isinstance(r.get("error"), str)
            and type(r.get("time")) in (int, float) and abs(now - r["time"]) < _REFUSAL_KEPT_S]


def _met_in(refusal: dict, context: dict) -> bool:
    """Whether ``refusal`` was met where ``context`` (:func:`_build_context`) describes: same host, compiler
    file and environment."""
    return all(refusal.get(key) == value for key, value in context.items())


def _record_refusal(marker: str, scratch: str, cc: str, err: str) -> None:
    """Add the refusal ``err`` of a build with ``cc`` here and now to those ``marker`` records (in place of one met
    in the same context before; those older than a day dropped; the newest :data:`_REFUSALS_KEPT`), written to
    ``scratch`` and renamed into place (a reader finds the old record or the new one)."""
    context = _build_context(cc)
    kept = [r for r in _recorded_refusals(marker) if not _met_in(r, context)]
    refusals = [*kept, {**context, "time": time.time(), "error": err}][-_REFUSALS_KEPT:]
    with open(scratch, "w", encoding="utf-8") as f:
        json.dump({"refusals": refusals}, f, indent=1)
    os.replace(scratch, marker)


# What a compiler's errors say where the machine failed the build, not the flags: no space or quota left for its
# files, no memory left, one of its programs killed (the out-of-memory killer, a limit on its CPU time).
_NO_ROOM = ("No space left on device", "Disk quota exceeded")
_MACHINE_FAILURES = (*_NO_ROOM, "out of memory", "Cannot allocate memory", "signal terminated program")


def _refused(returncode: int, err: str) -> bool:
    """Whether a compiler that exited with ``returncode`` and the errors ``err`` refused its flags (or the
    source), as it will again: not where it was killed by a signal or its errors name a failure of the machine
    (:data:`_MACHINE_FAILURES`), which may be gone for the next process."""
    return returncode > 0 and not any(failure in err for failure in _MACHINE_FAILURES)


def _compile(cc: str, flags: list[str], target: str, source: str = SOURCE, parallel: bool = True) -> str | None:
    """Compile ``source`` (the kernel source) to ``target`` atomically (``parallel``: with
    :func:`_parallel_flags`); the compiler's error text on failure, else None. Where the compiler ran and
    refused (a flag set it lacks: ``-fopenmp`` without an OpenMP runtime, say) that text is also recorded in
    :func:`_failed_marker`'s file with where it was met (:func:`_record_refusal`), so that later processes there
    skip the flag set instead of paying the failed build again (~10 s each; a timeout, a compiler that did not
    start, or one that the machine failed, :func:`_refused`, leaves no record)."""
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src = os.path.join(tmp, "sofx_adam.c")
        with open(src, "w", encoding="utf-8") as f:
            f.write(source)
        out = os.path.join(tmp, "sofx_adam.so")
        try:
            proc = _run_compiler(cc, [*flags, *_TUNING, *_COMMON, src, "-o", out, "-lm"], parallel)
        except (OSError, subprocess.SubprocessError) as e:
            return str(e)
        if proc.returncode != 0:
            err = proc.stderr.strip() or f"exit status {proc.returncode}"
            if not _refused(proc.returncode, err):  # the machine failed it: the next process tries it again
                return err
            _record_refusal(_failed_marker(target), os.path.join(tmp, "failed"), cc, err)
            return err
        fsync_best_effort(out)  # on disk before it has its name: a crash after the rename leaves a whole file or none
        os.replace(out, target)
        fsync_best_effort(directory)
    return None


def elf_problem(path: str) -> str | None:
    """Why the shared library at ``path`` is not a whole ELF file (truncated by a crash or a copy: mapping it
    would kill the process with SIGBUS), or None. Checks the header and that every table and loaded segment
    it names lies within the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 16 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
                return "not an ELF file"
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            fields = struct.Struct(order + ("QQQIHHHHHH" if wide else "IIIIHHHHHH"))
            if len(head) < 16 + 8 + fields.size:
                return f"{size} bytes: shorter than its header"
            _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _ = fields.unpack_from(head, 24)
            for what, offset, count, entry in (("program headers", phoff, phnum, phentsize),
                                               ("section headers", shoff, shnum, shentsize)):
                if offset + count * entry > size:
                    return f"{size} bytes: its {what} end at byte {offset + count * entry}"
            program = struct.Struct(order + ("IIQQQQQQ" if wide else "IIIIIIII"))
            f.seek(phoff)
            table = f.read(phnum * phentsize)
        for i in range(phnum):
            entry = program.unpack_from(table, i * phentsize)
            offset, filesz = (entry[2], entry[5]) if wide else (entry[1], entry[4])
            if entry[0] == 1 and offset + filesz > size:  # PT_LOAD
                return f"{size} bytes: a loaded segment ends at byte {offset + filesz}"
    except (OSError, struct.error) as e:
        return f"unreadable: {e}"
    return None


def compile_program(program: str, directory: str, name: str = "program", source: str | None = None,
                    shared: bool = False, extra_flags: Sequence[str] = ()) -> str:
    """Compile ``program`` (C that ``#include "sofx_adam.c"``, the kernel source, written beside it) into an
    executable in ``directory`` with the kernels' own flags (the first set that works here), for the checks
    and benchmarks that call the kernels' internal functions directly. ``source`` replaces the kernel source
    (a benchmark's other revision); ``shared``: a shared library (``name.so``, for ctypes) instead;
    ``extra_flags`` go after each flag set's (``["-Og"]``: a smoke run's build, in a quarter of the time). Returns
    its path; raises RuntimeError with the compiler's errors when no flag set builds it (or there is no compiler)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(_no_compiler())
    with open(os.path.join(directory, "sofx_adam.c"), "w", encoding="utf-8") as f:
        f.write(SOURCE if source is None else source)
    src = os.path.join(directory, name + ".c")
    with open(src, "w", encoding="utf-8") as f:
        f.write(program)
    exe = os.path.join(directory, name + (".so" if shared else ""))
    kind = ["-shared", "-fPIC"] if shared else []
    errors = []
    for flags in _FLAG_SETS:  # -ffp-contract=off, -march=native, ...
        proc = _run_compiler(cc, [*flags, *extra_flags, *_TUNING, *kind, "-std=gnu11", "-pthread", src, "-o", exe,
                                  "-lm"])
        if proc.returncode == 0:
            return exe
        errors.append(proc.stderr[-500:])
    raise RuntimeError(f"{name}.c did not build: " + " | ".join(errors))


# A compiler driver's summary of a failed link (gcc's "collect2: error: ld returned 1 exit status", clang's "linker
# command failed with exit code 1"): the linker's own lines before it say why ("cannot find -lomp", "No space left").
_LINK_SUMMARY = re.compile(r"ld returned \d+ exit status|linker command failed with exit code")


def _first_error(text: str) -> str:
    """The line of the compiler's error ``text`` that says why it failed: the first naming an error, but for a
    failed link the linker's first line other than a warning (before the driver's summary of it)."""
    lines = [line for line in text.splitlines() if line.strip()]
    summary = next((i for i, line in enumerate(lines) if _LINK_SUMMARY.search(line)), None)
    if summary is not None:
        return next((line for line in lines[:summary] if "warning" not in line), lines[summary])
    return next((line for line in lines if "error" in line), lines[0] if lines else "failed")


# The inline replicas of MKL's square root by name (REPLICA_* in the source), in the order they are tried: its
# AVX-512 code path (Intel CPUs with AVX-512), its generic one (AMD CPUs, whether or not they have AVX-512), its
# AVX2 one (Intel CPUs with AVX2 but not AVX-512); and "ieee", the hardware's IEEE square root, for a torch whose
# square root is not MKL's routine (sqrtf's bits: those the exact mode computes then anyway).
REPLICA_KINDS = {"avx512": 1, "generic": 2, "avx2": 4, "ieee": 8}


def _open(path: str) -> NativeLib:
    lib = ctypes.CDLL(path)
    fn = lib.sofx_adam_many
    fn.restype = ctypes.c_int
    # op, decoupled, count, dtypes (int[6 count]), ns (int64[count]), ptrs (void*[11 count]), s_old and s_new
    # (double*[count]), threads, exact, sqrt_fn, sqrt_mode, sqrt_local, sqrt_replica, chunk_tab (int64[6 count] or 0)
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    has_f16 = lib.sofx_has_f16
    has_f16.restype = ctypes.c_int
    sqrt = lib.sofx_sqrt
    sqrt.restype = None
    sqrt.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    has_replica = lib.sofx_has_sqrt_replica
    has_replica.restype = ctypes.c_int
    vector_width = lib.sofx_vector_width
    vector_width.restype = ctypes.c_int
    copy_sumsq = lib.sofx_copy_sumsq
    copy_sumsq.restype = ctypes.c_double
    copy_sumsq.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    overlap = lib.sofx_overlap
    overlap.restype = ctypes.c_int
    # count, dtypes, ns, ptrs (sofx_adam_many's tables), out (int64[4])
    overlap.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    sqrt_fn, sqrt_mode, sqrt_local = torch_sqrt_routine()
    ieee = REPLICA_KINDS["ieee"]
    if sqrt_fn:  # a replica of torch's MKL routine, where one gives its bits
        kinds = has_replica() & ~ieee
        replica = next((kind for kind in REPLICA_KINDS.values() if kinds & kind and _replica_matches(sqrt, kind)), 0)
    else:  # the exact mode takes IEEE sqrtf: in the vector loops where the build has them
        replica = has_replica() & ieee
    bitwise = bool(sqrt_fn) or torch_sqrt_is_ieee()
    return NativeLib(path, fn, bool(has_f16()), sqrt_fn, sqrt_mode, sqrt_local, vector_width(), replica,
                     sqrt, bitwise, copy_sumsq, overlap)


def _replica_matches(sqrt: ctypes._CFuncPtr, kind: int) -> bool:
    """Whether the inline replica ``kind`` of MKL's square root gives ``torch.sqrt``'s bits: on every 7th float of
    [1, 4) (2.4M values: every significand pattern class, both exponent parities, so a different algorithm
    shows here), on 256 random floats of every binade, the subnormals and the tiny ones below 2^-95 (which
    the replica scales) up to the largest (a different treatment of some exponent range shows there), and
    on the specials. About 10 ms."""
    x = torch.arange(0x3F800000, 0x40800000, 7, dtype=torch.int64).to(torch.int32).view(torch.float32)
    fractions = torch.randint(0, 1 << 23, (255, 256), generator=torch.Generator().manual_seed(0))
    binades = (torch.arange(255).unsqueeze(1) << 23) | fractions  # exponent field 0 (subnormals) to 254
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), -1.0, -1e-40, float("nan"), 2.0**-95, 3.4e38])
    x = torch.cat([x, binades.reshape(-1).to(torch.int32).view(torch.float32), specials])
    got = torch.empty_like(x)
    sqrt(x.numel(), x.data_ptr(), got.data_ptr(), None, 0, kind)
    return torch.equal(got.view(torch.int32), x.sqrt().view(torch.int32))


@contextlib.contextmanager
def _build_lock(target: str) -> Iterator[None]:
    """An exclusive lock on the lock file beside ``target``, held while a process builds it: the other processes
    that need it at the same moment (ranks started together on one machine, test workers) wait, then find it
    built, or refused, instead of compiling it again each. The operating system releases it when the holder
    exits, however it exits. Where the file cannot be made or locked (an unwritable cache, a file system without
    locks, no ``fcntl``), nothing is locked: each process builds it, as without the lock."""
    try:
        import fcntl

        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd = os.open(_beside(target, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: another process builds it
                _log.info("waiting for another process building %s", target)
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # ENOLCK and the like
            pass
        yield
    finally:
        os.close(fd)  # and with it the lock


_ABANDONED_AFTER_S = 900  # a build's temporary directory this old was left by a killed process (builds: <= 300 s)


def _remove_abandoned_builds(directory: str) -> None:
    """Remove the temporary build directories a killed process left in the cache (a megabyte or more each)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            if name.startswith("tmp") and os.path.isdir(path) and now - os.path.getmtime(path) > _ABANDONED_AFTER_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _cached_or_compiled(cc: str, flags: list[str], target: str, source: str) -> str | None:
    """None where ``target`` is built (already, or now by :func:`_compile`), else why not: the compiler's
    refusal recorded before where this process runs (:func:`_refused_here`) or now, or its failure; raises
    :class:`_CacheUnusable` where the directory cannot take the build (it cannot be made or written, or its disk
    is full)."""
    if os.path.exists(target):  # built by another process while this one waited for the lock
        return None
    refused = _refused_here(cc, flags, target)
    if refused is not None:
        return refused
    _remove_abandoned_builds(os.path.dirname(target))
    _log.info("building the native CPU kernels (once per compiler and CPU; 15-40 s): %s %s -> %s",
              cc, " ".join(flags), target)
    start = time.perf_counter()
    try:
        err = _compile(cc, flags, target, source)
    except OSError as e:  # unwritable cache directory and the like
        _log.info("cannot build %s there: %s", target, e)
        raise _CacheUnusable(str(e)) from None
    if err is not None and any(failure in err for failure in _NO_ROOM):  # the compiler's output did not fit
        _log.info("cannot build %s there: %s", target, _first_error(err))
        raise _CacheUnusable(_first_error(err))
    if err is None:
        _log.info("built %s in %.1f s", target, time.perf_counter() - start)
    else:
        _log.info("%s refused %s (%.1f s): %s", cc, " ".join(flags), time.perf_counter() - start, _first_error(err))
    return err


def _refused_here(cc: str, flags: list[str], target: str) -> str | None:
    """The compiler's error recorded (:func:`_failed_marker`) where its build of ``target`` was refused in the
    context this process builds in (:func:`_build_context`) in the last day, or None: none recorded (or only
    longer ago), or only elsewhere (another host, compiler file or environment; logged, as the build is tried
    again here)."""
    marker = _failed_marker(target)
    refusals = _recorded_refusals(marker)
    if not refusals:
        return None
    context = _build_context(cc)
    here = next((r for r in refusals if _met_in(r, context)), None)
    if here is not None:
        return here["error"] or "failed before"
    hosts = sorted({str(r.get("host")) for r in refusals})
    _log.info("a refusal of %s %s is recorded (%s) on %s, not on %s in this environment: trying it here", cc,
              " ".join(flags), marker, ", ".join(hosts), context["host"])
    return None


def _build_and_open(source: str = SOURCE, cache_dir: str | None = None,
                    flag_sets: Sequence[Sequence[str]] = _FLAG_SETS) -> NativeLib | str:
    """The library built from ``source`` (the kernel source; a benchmark's variant of it) with the first of
    ``flag_sets`` (default: the library's own) the compiler takes, and opened, cached in ``cache_dir`` (default:
    the library's cache, :func:`_cache_dir`; the key has the flags), or where that directory cannot take it in
    this user's private temporary directory (:func:`_private_cache_dir`; ``NativeLib.displaced`` says why); why
    it is unavailable where it cannot be."""
    if os.environ.get("SOFX_CPU_NATIVE", "1") == "0":
        return DISABLED
    cc = _compiler()
    if cc is None:
        return _no_compiler()
    version = _compiler_version(cc)
    directory, displaced = cache_dir, ""  # None: _cache_dir(), found below
    errors = []
    for flags in map(list, flag_sets):
        key = hashlib.sha256("\0".join([source, cc, version, *flags, *_TUNING, *_COMMON, _cpu_fingerprint()])
                             .encode()).hexdigest()[:24]
        while True:
            try:
                directory = directory or _cache_dir()
                lib = _cached_or_built(cc, flags, os.path.join(directory, f"sofx_adam_{key}.so"), source)
                break
            except _CacheUnusable as e:
                if displaced:  # the private directory cannot take it either
                    return f"{displaced}, nor this user's private {directory} ({e})"
                displaced = (f"the cache directory {directory} cannot take the native CPU kernels ({e})" if directory
                             else f"no cache directory for the native CPU kernels ({e})")
                try:
                    directory = _private_cache_dir()
                except OSError as private:
                    return f"{displaced}, nor a private temporary directory ({private})"
        if isinstance(lib, NativeLib):
            return dataclasses.replace(lib, displaced=displaced)
        errors.append(lib)
    return "the native CPU kernels could not be built: " + " | ".join(errors)


def _cached_or_built(cc: str, flags: list[str], target: str, source: str) -> NativeLib | str:
    """The library at ``target``, opened; built first where it is not there (or damaged), by this process or
    another it waits for; why not where the compiler refused or failed, or it does not open (raises
    :class:`_CacheUnusable` where ``target``'s directory cannot take it)."""
    built = not os.path.exists(target)
    broken = None if built else elf_problem(target)
    if broken is not None:  # a cached library cut short (a crash, a copy): built again, not mapped
        _log.warning("the cached native library %s is damaged (%s); building it again", target, broken)
        try:
            os.remove(target)
        except FileNotFoundError:
            pass
        except OSError as e:  # a read-only cache
            raise _CacheUnusable(f"its damaged {os.path.basename(target)} cannot be removed: {e}") from None
        built = True
    if built:
        with _build_lock(target):
            err = _cached_or_compiled(cc, flags, target, source)
        if err is not None:
            return f"{cc} {' '.join(flags)}: {_first_error(err)}"
    try:
        return dataclasses.replace(_open(target), flags=(*flags, *_TUNING), built=built)
    except OSError as e:
        return f"loading {target}: {e}"


def load() -> NativeLib | None:
    """The native library, building it on first use; None when it cannot be built here, which a
    :class:`RuntimeWarning` says once (the CPU backends then run the reference math, several times slower;
    not where ``SOFX_CPU_NATIVE=0`` asked for that)."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_build_and_open())
                if isinstance(_loaded[0], NativeLib) and _loaded[0].displaced:
                    warnings.warn(f"sofx: {_loaded[0].displaced}; they are in {os.path.dirname(_loaded[0].path)}, "
                                  "this user's alone on this machine, instead (set SOFX_CACHE_DIR to a writable "
                                  "directory to keep them there)", RuntimeWarning, stacklevel=caller_stacklevel())
                if isinstance(_loaded[0], str) and _loaded[0] != DISABLED:
                    warnings.warn(f"sofx: the native CPU kernels are unavailable ({_loaded[0]}); the cpu and cpu_fast "
                                  "backends run the reference math, several times slower (`python -m sofx.kernels` "
                                  "reports; SOFX_CPU_NATIVE=0 silences this)", RuntimeWarning,
                                  stacklevel=caller_stacklevel())
    lib = _loaded[0]
    return lib if isinstance(lib, NativeLib) else None


def unavailable_reason() -> str | None:
    """Why :func:`load` returns None (after it was called), or None when the library is loaded."""
    load()
    lib = _loaded[0]
    return None if isinstance(lib, NativeLib) else lib
