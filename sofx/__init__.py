"""sofx: functional, undoable and speculative Adam optimizers for PyTorch.

The core contract (DESIGN.md): ``init(params) -> state``,
``update(params, grads, state, hparams) -> (params, state, undo_record)`` and
``undo(params, state, undo_record) -> (params, state)``, pure by default.
"""

from sofx import tree
from sofx.adam import Adam, AdamHParams, AdamState, adam, adamw
from sofx import checkpoint
from sofx.errors import HParamError, LeafError, SofxError, StructureError, UndoError, UnsupportedError
from sofx.kernels.base import AdamScalars, AdamVariant
from sofx.undo_record import LeafUndo, UndoRecord
from sofx import loss_scale, schedules, serial, speculate, transforms
from sofx.speculate import SpeculationConfig
from sofx import offload
from sofx import distributed
from sofx.step_report import StepReport

__version__ = "0.1.0"

__all__ = [
    "Adam",
    "AdamHParams",
    "AdamState",
    "AdamScalars",
    "AdamVariant",
    "adam",
    "adamw",
    "checkpoint",
    "distributed",
    "loss_scale",
    "schedules",
    "serial",
    "speculate",
    "offload",
    "transforms",
    "SpeculationConfig",
    "StepReport",
    "LeafUndo",
    "UndoRecord",
    "SofxError",
    "StructureError",
    "LeafError",
    "HParamError",
    "UndoError",
    "UnsupportedError",
]
