"""Values no optimizer run stores, refused where a state is loaded or imported.

A step count or an Adam second moment (a running mean of squares; algebraic undo clamps a recomputed one at 0) is
never negative. A state holding one is corrupt, and stepping from it gives nan parameters without a word. A nan or
an inf is a diverged run's state: it loads, as ``torch.optim`` loads it.
"""

from __future__ import annotations

import torch

__all__ = ["refuse_negative", "refuse_beyond"]


def refuse_negative(x: torch.Tensor, what: str, where: str, error: type[Exception]) -> None:
    """Refuse ``x`` (a tensor of ``what``: ``"step count"``, ``"second moment"``) where an element is below 0:
    ``error`` naming ``where``, the first such element's index and its value."""
    below = x < 0
    if bool(below.any()):
        at = [int(i) for i in below.nonzero()[0]]
        index = f"[{', '.join(map(str, at))}]" if at else ""
        raise error(f"{where}{index} = {x[tuple(at)].item()!r}: expected a {what} >= 0 (no run stores a negative "
                    "one: the state is corrupt)")


def refuse_beyond(x: torch.Tensor, dtype: torch.dtype, where: str, why: str, error: type[Exception]) -> None:
    """Refuse ``x`` where a finite element becomes inf in a cast to ``dtype`` (``why``: whose dtype it is): a second
    moment of 4e6 in float16 (one that rounds to its largest, 65510, is taken): ``error`` naming ``where``, the first
    such element's index and its value. An inf or nan in ``x`` is a diverged run's, cast as it is."""
    largest = torch.finfo(dtype).max
    if torch.finfo(x.dtype).max <= largest:
        return
    beyond = x.to(dtype).isinf() & x.isfinite()
    if bool(beyond.any()):
        at = tuple(int(i) for i in beyond.nonzero()[0])
        index = f"[{', '.join(map(str, at))}]" if at else ""
        name = str(dtype).removeprefix("torch.")
        raise error(f"{where}{index} = {x[at].item()!r} is beyond {name}'s range (largest {largest!r}), {why}: it "
                    "would be inf there")
