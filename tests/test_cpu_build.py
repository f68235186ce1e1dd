"""How the native CPU library is built, cached and refused where it cannot be (:mod:`sofx.kernels._cpu_build`),
with the real compiler: its reasons, an unusable cache directory, a full disk."""

from __future__ import annotations

import os
import subprocess
import sys

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


def _on_a_small_disk(tmp_path, code: str, size: str = "1m", env: dict[str, str] | None = None
                     ) -> subprocess.CompletedProcess:
    """``code`` run by Python in a process of its own with ``tmp_path/disk`` a file system of ``size`` (a tmpfs
    mounted in a mount namespace of that process alone: root, or user namespaces, and util-linux's unshare)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    probe = subprocess.run([*unshare, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a small file system here (unshare -m)")
    script = f'mount -t tmpfs -o size={size} tmpfs {disk} && exec {sys.executable} -c "$0"'
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
