"""The default of a required argument that a collective step must refuse itself.

A step that may run on many ranks refuses its bad calls through its reduction hook, so that the other ranks
raise instead of waiting for this rank forever. Python's own "missing required argument" ``TypeError`` is
raised at the call, before any of the step's code runs: the step's required arguments default to
:data:`REQUIRED` instead, which the step checks for first thing, and which ``help()`` shows as ``<required>``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REQUIRED"]


class _Required:
    def __repr__(self) -> str:
        return "<required>"


# typed Any so that ``scaler: LossScaler = REQUIRED`` keeps the parameter's own type
REQUIRED: Any = _Required()
