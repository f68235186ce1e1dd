"""Warnings issued deep inside sofx name the user's line (:func:`sofx.warn.caller_stacklevel`)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys

import pytest

import sofx

_SOFX_DIR = os.path.dirname(os.path.abspath(sofx.__file__))


def _sofx_function(name: str, body: str):
    """A function whose code says it is in sofx's own directory (as a sofx module's would)."""
    namespace: dict = {}
    exec(compile(f"import warnings\nfrom sofx.warn import caller_stacklevel\n{body}",
                 os.path.join(_SOFX_DIR, "_as_if_in_sofx.py"), "exec"), namespace)
    return namespace[name]


def test_a_warning_several_sofx_calls_deep_names_the_users_line():
    inner = _sofx_function("inner", "def inner():\n    warnings.warn('deep', RuntimeWarning, "
                                    "stacklevel=caller_stacklevel())\n")
    outer = _sofx_function("outer", "def outer(f):\n    f()\n")
    with pytest.warns(RuntimeWarning, match="deep") as record:
        outer(inner)
    assert record[0].filename == __file__


class _SofxNamedLoader(importlib.machinery.SourceFileLoader):
    """Loads a file as if it were one of sofx's modules (its code names a file in sofx's directory)."""

    def source_to_code(self, data, path, *, _optimize=-1):
        return compile(data, os.path.join(_SOFX_DIR, os.path.basename(path)), "exec", dont_inherit=True)


class _SofxNamedFinder:
    """The modules ``_sofx_probe*`` in ``directory``, loaded by :class:`_SofxNamedLoader`."""

    def __init__(self, directory):
        self.directory = directory

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("_sofx_probe"):
            return None
        return importlib.util.spec_from_loader(name, _SofxNamedLoader(name, str(self.directory / f"{name}.py")))


def test_a_warning_issued_while_sofx_imports_its_modules_names_the_users_import_line(tmp_path, monkeypatch):
    """A sofx module that imports another, which warns as it is imported: importlib's frames lie between the
    modules, and between the first and the user's ``import``; they are passed over (as ``warnings.warn`` passes
    them over when it counts ``stacklevel``), and the warning names the user's line, not the first module's."""
    (tmp_path / "_sofx_probe_outer.py").write_text("import _sofx_probe_inner\n")
    (tmp_path / "_sofx_probe_inner.py").write_text(
        "import warnings\nfrom sofx.warn import caller_stacklevel\n"
        "warnings.warn('at import', RuntimeWarning, stacklevel=caller_stacklevel())\n")
    monkeypatch.setattr(sys, "meta_path", [_SofxNamedFinder(tmp_path), *sys.meta_path])
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    for name in ("_sofx_probe_outer", "_sofx_probe_inner"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        with pytest.warns(RuntimeWarning, match="at import") as record:
            __import__("_sofx_probe_outer")
    finally:
        for name in ("_sofx_probe_outer", "_sofx_probe_inner"):
            sys.modules.pop(name, None)
    assert record[0].filename == __file__
