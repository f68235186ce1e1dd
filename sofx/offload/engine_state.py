"""The offload engine's state as a plain pytree: tensors plus JSON-able values.

:func:`engine_state_dict` and :func:`load_engine_state` are what
:meth:`OffloadEngine.state_dict` / :meth:`OffloadEngine.load_state_dict`
do. The format (``STATE_FORMAT``)::

    {"format": "sofx.offload/1", "complete": bool,
     "layouts": [BlockLayout.to_json(), ...],            # which parameters each block holds
     "blocks": [{"master", "exp_avg", "exp_avg_sq", "counts"}, ...],   # tensors, in their dtypes
     "scaler_state": {"type": "GradScalerState", ...fields},
     "policy_state": {...fields}, "iteration": int, "adam": AdamConfig.to_json()}

Loading checks everything (format, block layout, every tensor's shape and
dtype, the loss-scaler type) before it changes anything, and keeps the saved
dtypes (a bf16 ``exp_avg`` is never cast to the master's fp32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sofx.errors import StructureError
from sofx.offload.blocks import TENSOR_NAMES, BlockLayout
from sofx.speculate import PolicyState

if TYPE_CHECKING:  # pragma: no cover
    from sofx.offload.engine import OffloadEngine

__all__ = ["STATE_FORMAT", "engine_state_dict", "load_engine_state"]

STATE_FORMAT = "sofx.offload/1"
_SAVED = tuple(name for name in TENSOR_NAMES if name != "grad")


def engine_state_dict(engine: "OffloadEngine", complete: bool) -> dict[str, Any]:
    """The engine's state (live tensors, not copies); ``complete=False`` after an executor failure."""
    return {
        "format": STATE_FORMAT,
        "complete": complete,
        "layouts": [layout.to_json() for layout in engine.layouts],
        "blocks": [{name: getattr(engine.tensors[layout.index], name) for name in _SAVED}
                   for layout in engine.layouts],
        "scaler_state": {"type": type(engine.scaler_state).__name__, **_jsonable(engine.scaler_state._asdict())},
        "policy_state": _jsonable(engine.policy_state._asdict()),
        "iteration": engine.iteration,
        "adam": engine.adam_config.to_json(),
    }


def load_engine_state(engine: "OffloadEngine", state: Any) -> None:
    """Check ``state`` against ``engine``, then copy it in (nothing changes on a mismatch)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise StructureError(f"not an offload engine state (format {found!r}, expected {STATE_FORMAT!r})")
    if not state.get("complete", True):
        raise StructureError("this state was taken after an executor failure in the middle of a step "
                             "(\"complete\": False): some blocks may be partly stepped; load a checkpoint "
                             "saved between steps")
    layouts = [BlockLayout.from_json(d) for d in state["layouts"]]
    if [(b.numels, b.group) for b in layouts] != [(b.numels, b.group) for b in engine.layouts]:
        raise StructureError("the saved blocks do not match this optimizer's blocks (block_numel, parameter "
                             "sizes or param groups differ): saved "
                             f"{[list(b.numels) for b in layouts]}, here {[list(b.numels) for b in engine.layouts]}")
    saved_adam = state.get("adam")
    if isinstance(saved_adam, dict):
        here = engine.adam_config.to_json()
        # what the moments mean (the backend and undo mode are free to differ)
        for key in ("decoupled", "bias_correction", "state_dtype"):
            if key in saved_adam and saved_adam[key] != here.get(key):
                raise StructureError(f"the state was saved by an optimizer with {key}={saved_adam[key]!r}, this one "
                                     f"has {key}={here.get(key)!r} (e.g. SpeculativeAdamW's state into "
                                     "SpeculativeAdam)")
    blocks = state["blocks"]
    if not isinstance(blocks, (list, tuple)) or len(blocks) != len(engine.layouts):
        raise StructureError(f"the state holds {len(blocks) if isinstance(blocks, (list, tuple)) else 'no'} blocks, "
                             f"this optimizer has {len(engine.layouts)}")
    for layout, saved in zip(engine.layouts, blocks):
        t = engine.tensors[layout.index]
        for name in _SAVED:
            x, have = saved.get(name), getattr(t, name)
            if not isinstance(x, torch.Tensor) or x.shape != have.shape or x.dtype != have.dtype:
                desc = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise StructureError(f"blocks[{layout.index}][{name!r}]: expected shape {tuple(have.shape)} "
                                     f"dtype {have.dtype}, got {desc}")
    scaler_fields = dict(state["scaler_state"])
    kind = scaler_fields.pop("type")
    if kind != type(engine.scaler_state).__name__:
        raise StructureError(f"the saved loss-scaler state is a {kind}, this optimizer's is a "
                             f"{type(engine.scaler_state).__name__}")
    try:
        scaler_state = type(engine.scaler_state)(**scaler_fields)
        pol = dict(state["policy_state"])
        pol["recent"] = tuple(pol.get("recent", ()))
        policy_state = PolicyState(**pol)
    except TypeError as exc:
        raise StructureError(f"the saved loss-scaler or policy state does not fit: {exc}") from exc
    with torch.no_grad():
        for layout, saved in zip(engine.layouts, blocks):
            t = engine.tensors[layout.index]
            for name in _SAVED:
                getattr(t, name).copy_(saved[name])
    engine.scaler_state, engine.policy_state = scaler_state, policy_state
    engine.iteration = int(state.get("iteration", 0))


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out
