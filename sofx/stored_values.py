"""Values no optimizer run stores, refused where a state is loaded or imported.

A step count or an Adam second moment (a running mean of squares; algebraic undo clamps a recomputed one at 0) is
never negative. A state holding one is corrupt, and stepping from it gives nan parameters without a word. A nan or
an inf is a diverged run's state: it loads, as ``torch.optim`` loads it.
"""

from __future__ import annotations

import torch

__all__ = ["refuse_negative"]


def refuse_negative(x: torch.Tensor, what: str, where: str, error: type[Exception]) -> None:
    """Refuse ``x`` (a tensor of ``what``: ``"step count"``, ``"second moment"``) where an element is below 0:
    ``error`` naming ``where``, the first such element's index and its value."""
    below = x < 0
    if bool(below.any()):
        at = [int(i) for i in below.nonzero()[0]]
        index = f"[{', '.join(map(str, at))}]" if at else ""
        raise error(f"{where}{index} = {x[tuple(at)].item()!r}: expected a {what} >= 0 (no run stores a negative "
                    "one: the state is corrupt)")
