"""Warnings that name the user's line: the ``stacklevel`` of the first frame outside sofx and torch."""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

__all__ = ["caller_stacklevel"]

_SKIPPED = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))


def _internal(frame: FrameType) -> bool:
    """Whether ``warnings.warn`` passes ``frame`` over when it counts ``stacklevel`` (importlib's bootstrap)."""
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def caller_stacklevel() -> int:
    """The ``stacklevel`` of a warning issued by the function that calls this, naming the first frame outside sofx
    and torch (``step`` runs inside torch.optim's wrappers, whose number varies; a kernel warns several calls below
    the user's). Frames ``warnings.warn`` does not count (importlib's) are not counted. Where every frame is sofx's
    or torch's (an at-exit handler, a thread of sofx's), the outermost one."""
    frame, level = sys._getframe(1), 1
    while frame.f_code.co_filename.startswith(_SKIPPED):
        outer = frame.f_back
        while outer is not None and _internal(outer):
            outer = outer.f_back
        if outer is None:
            break
        frame, level = outer, level + 1
    return level
