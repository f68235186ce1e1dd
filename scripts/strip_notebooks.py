#!/usr/bin/env python
"""Strip outputs, execution counts and run metadata from Jupyter notebooks, in place.

Committed notebooks carry no outputs, so that diffs show only what a person wrote
(CI executes every notebook anyway: ``tests/test_notebooks.py``).

Usage::

    python scripts/strip_notebooks.py                   # every notebooks/*.ipynb
    python scripts/strip_notebooks.py a.ipynb b.ipynb   # these files
    python scripts/strip_notebooks.py --check           # list unstripped notebooks, exit 1 if any

The notebook JSON is edited directly (no nbformat needed); cell ids, sources and
the notebook's kernelspec/language metadata are kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GLOB = "notebooks/*.ipynb"

# Cell metadata written by Jupyter while running or viewing; never meaningful in a commit.
VOLATILE_CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")
# Notebook metadata that records a particular run or widget state.
VOLATILE_NOTEBOOK_METADATA = ("widgets", "papermill")


def strip(nb: dict[str, Any]) -> dict[str, Any]:
    """A copy of the notebook dict ``nb`` without outputs, counts and run metadata."""
    out = json.loads(json.dumps(nb))
    for cell in out.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        meta = cell.get("metadata", {})
        for key in VOLATILE_CELL_METADATA:
            meta.pop(key, None)
    for key in VOLATILE_NOTEBOOK_METADATA:
        out.get("metadata", {}).pop(key, None)
    return out


def problems(nb: dict[str, Any]) -> list[str]:
    """What keeps ``nb`` from being stripped (empty when it is clean)."""
    found = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") == "code":
            if cell.get("outputs"):
                found.append(f"cell {i} has {len(cell['outputs'])} output(s)")
            if cell.get("execution_count") is not None:
                found.append(f"cell {i} has execution_count {cell['execution_count']}")
        volatile = [k for k in VOLATILE_CELL_METADATA if k in cell.get("metadata", {})]
        if volatile:
            found.append(f"cell {i} has run metadata {volatile}")
    volatile = [k for k in VOLATILE_NOTEBOOK_METADATA if k in nb.get("metadata", {})]
    if volatile:
        found.append(f"notebook metadata has {volatile}")
    return found


def _dump(nb: dict[str, Any]) -> str:
    # Jupyter's own layout: one-space indent, sorted keys, unicode kept, final newline.
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def strip_file(path: Path) -> bool:
    """Strip ``path`` in place; True when the file changed."""
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    new_text = _dump(strip(nb))
    if new_text == text:
        return False
    path.write_text(new_text, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help=f"notebooks (default: {DEFAULT_GLOB})")
    parser.add_argument("--check", action="store_true", help="only report; exit 1 if a notebook is not stripped")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(ROOT.glob(DEFAULT_GLOB))
    dirty = 0
    for path in paths:
        if args.check:
            found = problems(json.loads(path.read_text(encoding="utf-8")))
            if found:
                dirty += 1
                print(f"{path}: not stripped ({'; '.join(found[:3])}{'; ...' if len(found) > 3 else ''})")
        elif strip_file(path):
            print(f"stripped {path}")
    if args.check and dirty:
        print(f"{dirty} notebook(s) carry outputs; run: python scripts/strip_notebooks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
