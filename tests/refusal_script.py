"""What the crash-case scripts share: :func:`expect_refused`.

Those scripts run in a fresh Python process (:func:`helpers.script_prints_ok`, which puts this directory on their
path): a case that crashed the process before its fix (a segmentation fault) then fails its test instead of ending
pytest."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

__all__ = ["expect_refused", "clones"]


def clones(tensors: Any) -> Callable[[], list[torch.Tensor]]:
    """A snapshot for :func:`expect_refused`: copies of ``tensors``' values, taken each time it is called."""
    tensors = list(tensors)
    return lambda: [t.clone() for t in tensors]


def expect_refused(case: str, fn: Callable[[], Any], error: type[BaseException], pattern: str,
                   snapshot: Callable[[], list[Any]] | None = None) -> None:
    """``fn()`` must raise ``error`` whose message matches ``pattern`` (``re.search``) and leave ``snapshot()`` as it
    was before (tensors compared with ``torch.equal``, bit for bit; anything else with ``==``). ``case`` is printed
    first, so that a crash names the case it crashed in."""
    print(case, flush=True)
    before = None if snapshot is None else snapshot()
    try:
        fn()
    except error as e:
        assert re.search(pattern, str(e)), f"{case}: {e}"
    else:
        raise AssertionError(f"{case}: not refused")
    if snapshot is not None:
        after = snapshot()
        assert len(after) == len(before) and all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(after, before)), \
            f"{case}: the refused call changed what it was given"
