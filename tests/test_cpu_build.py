"""How the native CPU library is built, cached and refused where it cannot be (:mod:`sofx.kernels._cpu_build`),
with the real compiler: its reasons, an unusable cache directory, a full disk."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sofx.kernels import _cpu_build


def _real_compiler() -> str:
    cc = _cpu_build._compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    return cc


def test_a_failed_link_is_refused_with_the_linkers_reason_not_the_drivers_summary(tmp_path, caplog):
    """A link that fails (a library the linker cannot find: clang without libomp, ``-lsomething`` in ``CC``) was
    reported as gcc's "collect2: error: ld returned 1 exit status" (clang's "linker command failed"), in the
    warning, the report and the log alike; the reason is the linker's own line."""
    cc = f"{_real_compiler()} -lsofx_no_such_library"
    caplog.set_level("INFO", logger="sofx.kernels")
    err = _cpu_build._cached_or_compiled(cc, ["-O1"], str(tmp_path / "x.so"), "int sofx_x;\n")
    assert err is not None
    assert "cannot find -lsofx_no_such_library" in _cpu_build._first_error(err), err
    assert "cannot find -lsofx_no_such_library" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("text, want", [
    ("/usr/bin/ld: cannot find -lomp: No such file or directory\n"
     "clang: error: linker command failed with exit code 1 (use -v to see invocation)\n",
     "/usr/bin/ld: cannot find -lomp: No such file or directory"),
    ("/usr/bin/ld: warning: x.o: missing .note.GNU-stack section\n/usr/bin/ld: final link failed: No space left on "
     "device\ncollect2: error: ld returned 1 exit status\n", "/usr/bin/ld: final link failed: No space left on device"),
    ("x.c:1:1: error: unknown type name 'flaot'\n", "x.c:1:1: error: unknown type name 'flaot'"),
    ("collect2: error: ld returned 1 exit status\n", "collect2: error: ld returned 1 exit status"),
    ("", "failed"),
])
def test_the_first_error_of_each_kind_of_failure(text, want):
    assert _cpu_build._first_error(text) == want


def test_a_cc_that_names_no_command_is_the_reason_given(tmp_path, monkeypatch):
    """``CC`` naming a compiler that is not there was reported as "no C compiler found (set CC to one)", as if
    CC were unset: the reason names the CC that was not found."""
    missing = str(tmp_path / "bin" / "gcc-13")
    monkeypatch.setenv("CC", f"{missing} -O1")
    monkeypatch.setenv("SOFX_CACHE_DIR", str(tmp_path / "cache"))
    reason = _cpu_build._build_and_open()
    assert reason == f"no C compiler found: CC={missing!r} names no command here", reason
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert _cpu_build._build_and_open() == "no C compiler found (cc, gcc, clang): set CC to one"
    assert not (tmp_path / "cache").exists()


def _refusing_compiler(directory: Path, name: str) -> tuple[str, Path]:
    """A stand-in C compiler ``directory/name`` that answers ``--version`` as "fakecc 1.0" and refuses every build
    ("fakecc: error: cannot find -lgomp"), logging each; returns (its path, the log's path)."""
    directory.mkdir(parents=True, exist_ok=True)
    log, fake = directory / "builds", directory / name
    fake.write_text("#!/bin/sh\n"
                    'case " $* " in *" --version "*) echo "fakecc 1.0"; exit 0;; esac\n'
                    f'echo "$0" >> {log}\n'
                    'echo "fakecc: error: cannot find -lgomp" >&2\nexit 1\n')
    fake.chmod(0o755)
    return str(fake), log


def _builds(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.parametrize("recorded", [
    "/usr/bin/ld: cannot find -lgomp: No such file or directory",  # an older sofx's: the error alone, not where
    json.dumps({"refusals": [{"host": "node-7", "compiler": "/usr/bin/x86_64-linux-gnu-gcc-12",
                              "environment": {"PATH": "/usr/bin:/bin", "LIBRARY_PATH": "/opt/broken/lib"},
                              "time": time.time(), "error": "/usr/bin/ld: cannot find -lgomp"}]}),
], ids=["without-a-host", "on-node-7"])
def test_a_refusal_recorded_on_another_host_is_tried_again_here(tmp_path, caplog, recorded):
    """A cache shared between the nodes of a cluster (NFS): a flag set one node refused (no OpenMP runtime there, a
    header missing, a job's broken LIBRARY_PATH) was recorded as refused for every node until the cache was
    deleted, and each loaded a slower build. A refusal recorded on another host (the marker as that host writes
    it), or by an older sofx that did not say where, is tried again here: here it builds."""
    target = tmp_path / "cache" / "x.so"
    target.parent.mkdir()
    with open(_cpu_build._failed_marker(str(target)), "w", encoding="utf-8") as f:
        f.write(recorded)
    caplog.set_level("INFO", logger="sofx.kernels")
    err = _cpu_build._cached_or_compiled(_real_compiler(), ["-O1"], str(target), "int sofx_x;\n")
    assert err is None and target.exists(), err
    if "node-7" in recorded:  # said, where it said where
        assert "-O1 is recorded" in caplog.records[0].getMessage(), caplog.text
        assert "on node-7, not on " in caplog.records[0].getMessage(), caplog.text


def _other_library_path(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LIBRARY_PATH", str(tmp_path / "lib"))


def _other_path(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")


def _other_compiler_behind_the_name(monkeypatch, tmp_path) -> None:  # update-alternatives, say
    os.remove(tmp_path / "fake" / "cc")
    os.symlink(tmp_path / "fake" / "cc-b", tmp_path / "fake" / "cc")


@pytest.mark.parametrize("change", [_other_library_path, _other_path, _other_compiler_behind_the_name])
def test_a_refusal_in_another_environment_is_tried_again_and_each_one_is_refused_once(tmp_path, monkeypatch, change):
    """What the compiler finds (its libraries through LIBRARY_PATH, its assembler and linker through PATH, the
    compiler a name resolves to) makes a build fail or not: a refusal recorded in one environment is not this
    one's and is tried again; then each environment's refusal is kept, and neither is tried again."""
    _refusing_compiler(tmp_path / "fake", "cc-a")
    _, log = _refusing_compiler(tmp_path / "fake", "cc-b")  # (the two log to the same file)
    os.symlink(tmp_path / "fake" / "cc-a", tmp_path / "fake" / "cc")
    cc, target = str(tmp_path / "fake" / "cc"), str(tmp_path / "cache" / "x.so")

    def builds_after_a_call() -> int:
        err = _cpu_build._cached_or_compiled(cc, ["-O1"], target, "int sofx_x;\n")
        assert err is not None and "cannot find -lgomp" in err, err
        return _builds(log)

    first = [builds_after_a_call(), builds_after_a_call()]
    with monkeypatch.context() as m:
        change(m, tmp_path)
        changed = [builds_after_a_call(), builds_after_a_call()]
    back = builds_after_a_call()  # the first environment (or the second compiler still): its refusal kept
    assert (first, changed, back) == ([1, 1], [2, 2], 2)


@pytest.mark.parametrize("hours", [25, -25], ids=["a-day-ago", "a-day-ahead"])
def test_a_refusal_recorded_more_than_a_day_ago_is_tried_again(tmp_path, hours):
    """An OpenMP runtime installed since, a header put back: a refusal was kept until the cache was deleted, and the
    node loaded a slower build for good. One recorded more than a day ago (or dated a day ahead: a clock set wrong)
    is tried again; the new refusal is then kept."""
    cc, log = _refusing_compiler(tmp_path / "fake", "fakecc")
    target = str(tmp_path / "cache" / "x.so")
    for _ in range(2):
        assert "cannot find -lgomp" in _cpu_build._cached_or_compiled(cc, ["-O1"], target, "int sofx_x;\n")
    assert _builds(log) == 1
    marker = _cpu_build._failed_marker(target)
    with open(marker, encoding="utf-8") as f:
        recorded = json.load(f)
    recorded["refusals"][0]["time"] -= hours * 3600
    with open(marker, "w", encoding="utf-8") as f:
        json.dump(recorded, f)
    for _ in range(2):
        assert "cannot find -lgomp" in _cpu_build._cached_or_compiled(cc, ["-O1"], target, "int sofx_x;\n")
    assert _builds(log) == 2
    with open(marker, encoding="utf-8") as f:
        assert len(json.load(f)["refusals"]) == 1  # the stale one replaced


def _on_a_small_disk(tmp_path, code: str, size: str = "1m", env: dict[str, str] | None = None,
                     options: str = "", args: tuple[str, ...] = ("-c",), before: str = "true"
                     ) -> subprocess.CompletedProcess:
    """``code`` run by Python (``python ARGS code``) in a process of its own with ``tmp_path/disk`` a file system
    of ``size`` (a tmpfs, mounted with ``options`` too, ``ro`` say, in a mount namespace of that process alone:
    root, or user namespaces, and util-linux's unshare), after the shell command ``before``."""
    disk = tmp_path / "disk"
    disk.mkdir()
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    probe = subprocess.run([*unshare, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a small file system here (unshare -m)")
    script = (f"mount -t tmpfs -o size={size}{',' + options if options else ''} tmpfs {disk} && {before} && "
              f'exec {sys.executable} {" ".join(args)} "$0"')
    return subprocess.run([*unshare, "sh", "-c", script, code], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def test_a_build_that_finds_no_space_left_is_not_recorded_as_the_compilers_refusal(tmp_path):
    """A cache on a full disk failed the link of the best flag sets ("No space left on device"), which were then
    recorded as refused for good: every later process skipped them and loaded a smaller, slower build (no
    -march=native), even once there was room. A failure of the disk is not the compiler's refusal."""
    code = ("from sofx.kernels import _cpu_build; import os, sys\n"
            f"target = os.path.join({str(tmp_path / 'disk')!r}, 'x.so')\n"
            "try:\n"
            f"    print(_cpu_build._cached_or_compiled({_real_compiler()!r}, ['-O1'], target, "
            "'char sofx_big[4 << 20] = {1};\\n'))\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n"
            "print(sorted(os.listdir(os.path.dirname(target))))\n")
    proc = _on_a_small_disk(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    said, files = proc.stdout.strip().rsplit("\n", 1)
    assert "No space left on device" in said, proc.stdout
    assert said.startswith("_CacheUnusable "), said  # built elsewhere (see the private directory's tests)
    assert files == "['x.lock']" or files == "[]", files


def test_a_compiler_killed_by_a_limit_is_not_recorded_as_refusing_the_flags(tmp_path):
    """A compiler killed mid-build (the kernel's out-of-memory killer, a CPU-time limit: "Killed signal terminated
    program cc1") was recorded as refusing the flag set for good; the next process must try it again."""
    cc = _real_compiler()
    limited = tmp_path / "limited-cc"
    limited.write_text("#!/bin/sh\n"
                       f'case " $* " in *" --version "*) exec {cc} "$@";; esac\n'
                       f'ulimit -t 1\nexec {cc} "$@"\n')
    limited.chmod(0o755)
    target = tmp_path / "cache" / "x.so"
    err = _cpu_build._cached_or_compiled(str(limited), _cpu_build._FLAG_SETS[0], str(target), _cpu_build.SOURCE)
    assert err is not None and "signal" in err, err
    assert not os.path.exists(_cpu_build._failed_marker(str(target)))


def _private_dir_holding_this_build(tmp_path, uid: int | None = None) -> tuple[str, str]:
    """A temporary directory (for ``TMPDIR``) whose ``sofx-<uid>/kernels`` (``uid``: this process's user, or the
    one a child runs as) holds a copy of the library this process loaded, under its cache name (and the refusals
    recorded beside it), so that a process loading it from there needs no build; returns (that TMPDIR, the
    library's path in it)."""
    lib = _cpu_build.load()
    if lib is None:
        pytest.skip("no native library here")
    uid = os.getuid() if uid is None else uid
    private = tmp_path / "tmp" / f"sofx-{uid}" / "kernels"
    private.mkdir(parents=True)
    (tmp_path / "tmp" / f"sofx-{uid}").chmod(0o700)
    cache = os.path.dirname(lib.path)
    for name in [os.path.basename(lib.path), *(n for n in os.listdir(cache) if n.endswith(".failed"))]:
        shutil.copy(os.path.join(cache, name), private / name)
    return str(tmp_path / "tmp"), str(private / os.path.basename(lib.path))


_LOAD = """
import warnings
warnings.simplefilter("always")
from sofx.kernels import _cpu_build, cpu
lib = _cpu_build.load()
print(lib.path if lib else "unavailable: " + _cpu_build.unavailable_reason())
"""


def _unusable(tmp_path) -> str:
    """A cache directory that cannot be made, even by root: a path under a regular file."""
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "cache")


def test_a_cache_directory_that_cannot_be_made_moves_the_build_to_a_private_temporary_directory(tmp_path):
    """A read-only home (XDG_CACHE_HOME, SOFX_CACHE_DIR where nothing can be written) made the native kernels
    unavailable: the CPU backends ran the reference math, several times slower, for a reason repeated once per
    flag set. The library is built (here: found) in ``$TMPDIR/sofx-<uid>/kernels`` instead, with a warning that
    says why and what to set."""
    tmpdir, private = _private_dir_holding_this_build(tmp_path)
    cache = _unusable(tmp_path)
    env = {**os.environ, "XDG_CACHE_HOME": cache, "TMPDIR": tmpdir}
    env.pop("SOFX_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == private, proc.stdout + proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "Warning" in line]
    assert len(warned) == 1, proc.stderr
    assert f"the cache directory {cache}/sofx/kernels cannot take the native CPU kernels" in warned[0]
    assert "Not a directory" in warned[0] and os.path.dirname(private) in warned[0]
    assert "SOFX_CACHE_DIR" in warned[0]


@pytest.mark.parametrize("options, size, why", [("ro", "1m", "Read-only file system"),
                                                ("", "64k", "No space left on device")])
def test_a_read_only_or_full_cache_directory_moves_the_build_to_a_private_temporary_directory(
        tmp_path, options, size, why):
    """The cache on a read-only file system (a home mounted read-only in a container), or on one with no room
    left (too little for the source, here): the private temporary directory, and ``python -m sofx.kernels`` says
    where the library is and why there."""
    tmpdir, private = _private_dir_holding_this_build(tmp_path)
    env = {"SOFX_CACHE_DIR": str(tmp_path / "disk"), "TMPDIR": tmpdir}
    if not options:  # fill it
        env["SOFX_FILL"] = str(tmp_path / "disk" / "filler")
    code = "import os, runpy\n" \
           "if os.environ.get('SOFX_FILL'):\n" \
           "    with open(os.environ['SOFX_FILL'], 'wb') as f:\n" \
           "        try:\n" \
           "            f.write(bytes(1 << 20))\n" \
           "        except OSError:\n" \
           "            pass\n" \
           "    open(os.environ['SOFX_FILL'], 'rb+').truncate(os.path.getsize(os.environ['SOFX_FILL']) - 8192)\n" \
           "runpy.run_module('sofx.kernels', run_name='__main__')\n"
    proc = _on_a_small_disk(tmp_path, code, size=size, env=env, options=options)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"native kernels, {private}" in proc.stdout, proc.stdout
    assert f"  the cache directory {tmp_path / 'disk'}/kernels cannot take the native CPU kernels (" in proc.stdout
    assert why in proc.stdout, proc.stdout


def test_a_private_directory_that_others_can_write_is_not_used(tmp_path):
    """``$TMPDIR/sofx-<uid>`` made by someone else, or open to others (a shared /tmp: what they put there would
    run as this user's code): not used; the kernels are unavailable, and the reason says both why not."""
    lib = _cpu_build.load()
    if lib is None:
        pytest.skip("no native library here")
    shared = tmp_path / "tmp" / f"sofx-{os.getuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    env = {**os.environ, "SOFX_CACHE_DIR": _unusable(tmp_path), "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout.strip()
    assert said.startswith("unavailable: "), said
    assert "Not a directory" in said and f"{shared} is not a directory of this user's alone" in said, said
    assert not (shared / "kernels").exists()


def test_a_damaged_library_in_a_read_only_cache_is_not_loaded_nor_fatal(tmp_path):
    """A cached library cut short, in a cache that is read-only now (a shared cache, mounted so): it could not be
    removed to be built again, and that error went up through the first update. It is left alone, and the
    library built (here: found) in the private temporary directory."""
    tmpdir, private = _private_dir_holding_this_build(tmp_path)
    disk = tmp_path / "disk"
    damaged = disk / "kernels" / os.path.basename(private)
    before = (f"mkdir {disk / 'kernels'} && head -c 100 {private} > {damaged} && "
              f"mount -o remount,ro {disk}")
    proc = _on_a_small_disk(tmp_path, _LOAD, env={"SOFX_CACHE_DIR": str(disk), "TMPDIR": tmpdir}, before=before)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == private, proc.stdout + proc.stderr
    assert f"the cached native library {damaged} is damaged" in proc.stderr
    assert f"its damaged {damaged.name} cannot be removed: [Errno 30] Read-only file system" in proc.stderr


def test_a_user_without_a_home_caches_in_the_private_directory_not_in_the_working_directory(tmp_path):
    """No HOME and a user the password database does not know (a container run as an arbitrary uid): "~" stayed
    "~", and the library was cached in ``./~/.cache/sofx`` under whatever directory the job started in, one per
    directory. It goes to the private temporary directory, with the warning saying why."""
    uid = 54321  # a user namespace maps this process's user to it: files made here are that user's there
    probe = subprocess.run(["unshare", "-U", f"--map-user={uid}", f"--map-group={uid}", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot run as a user without a home here (unshare -U --map-user)")
    tmpdir, private = _private_dir_holding_this_build(tmp_path, uid)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME", "SOFX_CACHE_DIR")}
    proc = subprocess.run(["unshare", "-U", f"--map-user={uid}", f"--map-group={uid}", sys.executable, "-c", _LOAD],
                          env={**env, "TMPDIR": tmpdir}, cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == private, proc.stdout + proc.stderr
    assert os.listdir(work) == []
    assert f"no cache directory for the native CPU kernels (HOME is unset and user {uid} has no home)" in proc.stderr


_RANK = """
import logging, os, sys, time
logging.basicConfig(level=logging.INFO)
from sofx.kernels import _cpu_build
barrier, n = sys.argv[1], int(sys.argv[2])
open(os.path.join(barrier, str(os.getpid())), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(barrier)) < n and time.monotonic() < deadline:  # all imported: build at the same moment
    time.sleep(0.01)
lib = _cpu_build._build_and_open(cache_dir=sys.argv[3], flag_sets=[["-O0"]])
print(lib if isinstance(lib, str) else lib.path)
"""


def test_ranks_started_together_on_an_empty_cache_build_once_with_the_real_compiler(tmp_path):
    """Four processes (ranks on one machine, DataLoader workers) needing the library at the same moment, from an
    empty cache, with the real compiler (an -O0 build, a second; it waits 1 s first so that the others come
    while it builds): one build, the others wait and open what it built, a whole library."""
    cc = _real_compiler()
    log = tmp_path / "builds"
    wrapper = tmp_path / "cc"
    wrapper.write_text("#!/bin/sh\n"
                       f'case " $* " in *" --version "*) exec {cc} "$@";; esac\n'
                       f'echo build >> {log}\nsleep 1\nexec {cc} "$@"\n')
    wrapper.chmod(0o755)
    barrier, cache, n = tmp_path / "barrier", tmp_path / "cache", 4
    barrier.mkdir()
    env = {**os.environ, "CC": str(wrapper)}
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(barrier), str(n), str(cache)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = [rank.communicate(timeout=240) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1, outs
    path = paths.pop()
    assert path.startswith(str(cache)) and _cpu_build.elf_problem(path) is None, path
    assert log.read_text().splitlines() == ["build"]
    logged = "".join(err for _, err in outs)
    assert logged.count("INFO:sofx.kernels:building the native CPU kernels") == 1, logged
    assert 1 <= logged.count("INFO:sofx.kernels:waiting for another process building") <= n - 1, logged  # (a rank
    # held back past the build finds the library built)
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(path), os.path.basename(path)[:-3] + ".lock"])


@pytest.mark.parametrize("outcome", ["unavailable", "displaced"])
def test_the_load_warnings_name_the_callers_line(monkeypatch, outcome):
    """The warning that the native kernels are unavailable, or built in the private directory, named the line in
    sofx that first asked for the library; it names the first line outside sofx (and torch) that led there."""
    from sofx.kernels import cpu

    lib = _cpu_build.load()
    if outcome == "displaced" and lib is None:
        pytest.skip("the native kernels are unavailable here")
    result = "no C compiler found" if outcome == "unavailable" else dataclasses.replace(lib, displaced="the cache "
                                                                                       "directory /x is read-only")
    monkeypatch.setattr(_cpu_build, "_loaded", [])
    monkeypatch.setattr(_cpu_build, "_build_and_open", lambda: result)
    with pytest.warns(RuntimeWarning, match="no C compiler found" if outcome == "unavailable" else "read-only") \
            as record:
        cpu.native_available()
    assert record[0].filename == __file__, record[0].filename
