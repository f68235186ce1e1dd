"""How the native CPU library is built, cached and refused where it cannot be (:mod:`sofx.kernels._cpu_build`),
with the real compiler: its reasons, an unusable cache directory, a full disk."""

from __future__ import annotations

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
