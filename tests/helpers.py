"""Shared test helpers: random pytrees and comparison utilities."""

from __future__ import annotations

import torch

import sofx


def rand_tree(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> dict:
    """A nested params tree with a zero-size leaf, a NamedTuple and a list."""

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return {
        "embed": r(7, 5),
        "layers": [{"w": r(5, 5), "b": r(5)}, {"w": r(5, 3), "b": r(3)}],
        "empty": r(0, 4),
        "head": sofx.AdamHParams(lr=r(3), beta1=r(2, 2)),  # any NamedTuple works as a node
    }


def clone_tree(tree):
    return sofx.tree.tree_map(lambda t: t.clone(), tree)


def trees_equal(a, b) -> bool:
    la, sa = sofx.tree.flatten(a)
    lb, sb = sofx.tree.flatten(b)
    return sa == sb and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| relative to max(|b|, tiny), elementwise (nan-aware: nan only matches nan)."""
    a64, b64 = a.double(), b.double()
    if not torch.equal(torch.isnan(a64), torch.isnan(b64)):
        return float("inf")
    mask = ~torch.isnan(b64)
    if mask.sum() == 0:
        return 0.0
    diff = (a64 - b64)[mask].abs()
    scale = b64[mask].abs().clamp_min(torch.finfo(a.dtype).tiny)
    return float((diff / scale).max())


def assert_trees_bitwise(a, b) -> None:
    """Same structure, and every leaf equal: tensors in dtype, shape and bits; other leaves by ==."""
    la, sa = sofx.tree.flatten(a)
    lb, sb = sofx.tree.flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        else:
            assert x == y


def import_written_module(directory, name: str, source: str, extra_files: dict[str, str] | None = None):
    """Write ``source`` as ``directory/name.py`` (and ``extra_files``) and import it afresh.

    Used where a parent test and a child process must run the very same code.
    """
    import importlib
    import sys

    (directory / f"{name}.py").write_text(source)
    for file_name, text in (extra_files or {}).items():
        (directory / file_name).write_text(text)
    sys.path.insert(0, str(directory))
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(directory))
