"""sofx: functional, undoable and speculative Adam optimizers for PyTorch.

The core contract (README.md, "The functional core"; the DESIGN.md and
SPECULATION.md that docstrings cite are the team's design documents, kept
outside this repository): ``init(params) -> state``,
``update(params, grads, state, hparams) -> (params, state, undo_record)`` and
``undo(params, state, undo_record) -> (params, state)``, pure by default.
Layers above it: gradient transforms, loss scaling and schedules; the
speculation protocol and its serial twin; the offload engine; checkpoints;
torch.distributed collectives.
"""

from typing import TYPE_CHECKING, Any

from sofx import tree
from sofx.adam import Adam, AdamHParams, AdamState, adam, adamw
from sofx.errors import (HParamError, LeafError, SnapshotLimitError, SofxError, StructureError, UndoError,
                         UnsupportedError)
from sofx.kernels.base import AdamScalars, AdamVariant
from sofx.undo_record import LeafUndo, UndoRecord

from sofx import loss_scale, schedules, serial, speculate, transforms
from sofx.speculate import SpeculationConfig
from sofx.step_report import StepReport
from sofx.apply_if_finite import apply_if_finite

from sofx.lazy_imports import lazy_attribute

if TYPE_CHECKING:  # imported where first used (sofx.lazy_imports)
    from sofx import checkpoint, distributed, offload

__version__ = "0.1.0"

__all__ = [
    # the core
    "Adam",
    "AdamHParams",
    "AdamState",
    "AdamScalars",
    "AdamVariant",
    "adam",
    "adamw",
    "LeafUndo",
    "UndoRecord",
    "tree",
    # errors
    "SofxError",
    "SnapshotLimitError",
    "StructureError",
    "LeafError",
    "HParamError",
    "UndoError",
    "UnsupportedError",
    # layers above the core
    "loss_scale",
    "schedules",
    "serial",
    "speculate",
    "transforms",
    "apply_if_finite",
    "SpeculationConfig",
    "StepReport",
    "checkpoint",
    "distributed",
    "offload",
]


def __getattr__(name: str) -> Any:
    """``sofx.checkpoint``, ``sofx.distributed``, ``sofx.offload`` (or another submodule) where not imported yet:
    imported now, at first use, not by ``import sofx`` (see :mod:`sofx.lazy_imports`)."""
    return lazy_attribute(__name__, {}, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
