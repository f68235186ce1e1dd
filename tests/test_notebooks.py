"""Every ``notebooks/*.ipynb`` runs top to bottom, and none is committed with outputs.

Each notebook is executed with nbclient in a fresh Jupyter kernel running *this* Python
(``sys.executable``): the test writes its own kernelspec into a temporary directory and
points ``JUPYTER_PATH`` at it, so no kernel needs to be installed on the CI machine. The
kernel gets a non-interactive matplotlib backend (``MPLBACKEND``: matplotlib-inline, which
renders with Agg into PNG outputs, so no display is needed and the test can check that
figures were produced; plain ``Agg`` when matplotlib-inline is missing) and the repository
on ``PYTHONPATH`` (``import sofx`` works without installing the package). Any cell error fails
the test; so does a cell that runs past its timeout. Notebooks that plot must produce at
least one image.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_NAME = "sofx-test-python3"
CELL_TIMEOUT_S = 180
NOTEBOOK_TIMEOUT_S = 300
# Each notebook takes 7-20 s here (2 shared cores); this only catches an accidental blow-up of the
# default sizes ("well under a minute" is the design target).
NOTEBOOK_BUDGET_S = 120


def _load_strip_script():
    spec = importlib.util.spec_from_file_location("strip_notebooks", ROOT / "scripts" / "strip_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mpl_backend() -> str:
    """Headless matplotlib backend for the kernel: inline (PNG outputs) where available, else Agg."""
    if importlib.util.find_spec("matplotlib_inline") is not None:
        return "module://matplotlib_inline.backend_inline"
    return "Agg"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory: pytest.TempPathFactory):
    """A kernelspec for ``sys.executable`` in a temporary ``JUPYTER_PATH`` (restored afterwards)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python {sys.version_info.major}.{sys.version_info.minor} (sofx tests)",
        "language": "python",
        "env": {"MPLBACKEND": _mpl_backend(), "PYTHONPATH": python_path, "PYDEVD_DISABLE_FILE_VALIDATION": "1",
                "IPYTHONDIR": str(root / "ipython")},  # no profile written to $HOME
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "JUPYTER_RUNTIME_DIR")}
    os.environ["JUPYTER_PATH"] = str(root)
    os.environ["JUPYTER_RUNTIME_DIR"] = str(root / "runtime")  # connection files, away from $HOME
    try:
        yield KERNEL_NAME
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "03_ensembles.ipynb"} <= names, names


def test_every_notebook_is_listed_in_the_notebooks_readme():
    readme = (NOTEBOOK_DIR / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in NOTEBOOKS if f"`{p.name}`" not in readme]
    assert not missing, f"describe these in notebooks/README.md: {missing}"


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 60)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, kernel_env: str):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=kernel_env, timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
                                     allow_errors=False, record_timing=False)
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    seconds = time.perf_counter() - start
    print(f"{path.name}: {seconds:.1f}s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    if "plt." in sources and _mpl_backend() != "Agg":
        images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
                  if "image/png" in o.get("data", {})]
        assert images, f"{path.name} plots but produced no image"
    assert seconds < NOTEBOOK_BUDGET_S, f"{path.name} took {seconds:.0f}s; keep the default sizes small"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_has_no_outputs(path: Path):
    strip = _load_strip_script()
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert strip.problems(nb) == [], f"run: python scripts/strip_notebooks.py {path.relative_to(ROOT)}"
    nbformat.validate(nbformat.reads(path.read_text(encoding="utf-8"), as_version=4))


def test_strip_script_removes_outputs(tmp_path: Path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# title"),
        nbformat.v4.new_code_cell("print(1)", execution_count=3, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="1\n")]),
    ])
    nb.cells[1].metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    path = tmp_path / "x.ipynb"
    nbformat.write(nb, path)
    script = str(ROOT / "scripts" / "strip_notebooks.py")
    check = subprocess.run([sys.executable, script, "--check", str(path)], capture_output=True, text=True)
    assert check.returncode == 1 and "not stripped" in check.stdout
    subprocess.run([sys.executable, script, str(path)], check=True, capture_output=True)
    stripped = nbformat.read(path, as_version=4)
    assert stripped.cells[1].outputs == [] and stripped.cells[1].execution_count is None
    assert "execution" not in stripped.cells[1].metadata
    assert stripped.cells[1].source == "print(1)" and stripped.cells[0].source == "# title"
    check = subprocess.run([sys.executable, script, "--check", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    before = path.read_text()
    subprocess.run([sys.executable, script, str(path)], check=True, capture_output=True)
    assert path.read_text() == before, "stripping is idempotent"
