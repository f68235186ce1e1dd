"""Checkpoints: atomic, asynchronous, dtype-exact, and interoperable (SPECULATION.md section 6).

::

    sofx.checkpoint.save("run.ckpt", {"params": params, "state": state, "step": 100})
    tree = sofx.checkpoint.load("run.ckpt")                    # or like=template to check it
    handle = sofx.checkpoint.save_async("run.ckpt", tree)      # snapshot taken before it returns
    params, state, _ = opt.update(params, grads, state, hp, donate=True)   # safe right away
    handle.wait()

A checkpoint is one safetensors file: tensors in safetensors, the tree
structure (dicts, lists, tuples, NamedTuples, None, Python scalars, dtypes)
and metadata as JSON in its header. Every dtype and bit comes back as saved
(a bf16 master with fp32 moments stays so). Nothing is ever unpickled and
no name from a file is ever imported. Saves are atomic: an interrupted save
leaves the previous checkpoint intact.

The offload optimizer's complete state (fp32 master blocks, moments, counts,
loss-scaler and policy state, param groups with their schedule position) is
its ``state_dict()``, a plain tree::

    sofx.checkpoint.save("run.ckpt", {"opt": opt.state_dict(), "sched": sched.state_dict()})
    ckpt = sofx.checkpoint.load("run.ckpt")
    opt.load_state_dict(ckpt["opt"]); sched.load_state_dict(ckpt["sched"])

Interop: :func:`to_torch_optim` / :func:`from_torch_optim` convert to and
from ``torch.optim.Adam``/``AdamW`` state dicts; :func:`save_zero3` /
:func:`load_zero3` write and read the DeepSpeed ZeRO-3 optimizer layout
(DeepSpeed's engine and ``zero_to_fp32`` read sofx's export, sofx reads
DeepSpeed's). The parameter numbering both need is explicit: see
:mod:`sofx.checkpoint.groups`.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import torch

from sofx.checkpoint import io
from sofx.checkpoint.async_save import AsyncSaver, SaveHandle, save_async
from sofx.checkpoint.atomic import stale_temporaries
from sofx.checkpoint.errors import (CheckpointError, CheckpointIOError, CheckpointMismatchError,
                                    CheckpointNotFoundError, CheckpointVersionError, CorruptCheckpointError,
                                    check_path)
from sofx.checkpoint.torch_optim import from_torch_optim, to_torch_optim, torch_param_groups
from sofx.checkpoint.zero3 import (deepspeed_loss_scaler, load_zero3, load_zero3_loss_scaler, save_zero3,
                                  zero3_file_name)
from sofx.kernels.user_numbers import flag

__all__ = [
    "save",
    "load",
    "save_async",
    "read_metadata",
    "SaveHandle",
    "AsyncSaver",
    "stale_temporaries",
    "to_torch_optim",
    "from_torch_optim",
    "torch_param_groups",
    "save_zero3",
    "deepspeed_loss_scaler",
    "load_zero3",
    "load_zero3_loss_scaler",
    "zero3_file_name",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointIOError",
    "CorruptCheckpointError",
    "CheckpointVersionError",
    "CheckpointMismatchError",
    "FORMAT_VERSION",
]

FORMAT_VERSION = io.FORMAT_VERSION


def save(path: str | os.PathLike, tree: Any) -> str:
    """Write ``tree`` to ``path`` atomically and durably; returns the absolute path.

    ``tree``: any pytree of tensors (any device, dtype safetensors stores,
    contiguous or not, sharing storage or not), None, bool/int/float/str,
    ``torch.dtype``, in lists, tuples, dicts, OrderedDicts and Counters (str or
    int keys) and NamedTuples. Anything else raises :class:`CheckpointError` naming the leaf
    path, before anything is written. A ``path`` that is a symbolic link is written through, as
    ``open(path, "w")`` would: its target gets the new file, and the link stays.

    A tensor of a dense layout (a channels_last weight and its Adam moments, a
    transposed matrix) is saved as its memory, in memory order (the file's
    array is ``t.permute(order)``, the order recorded in the structure) and
    loads back with its strides: a resumed run's moments keep their
    parameters' layout, which the kernels step without copies. A tensor with
    gaps (a strided slice) is saved as a contiguous copy and loads contiguous.
    """
    path = io.check_writable(check_path("save", path))  # (before the tree is encoded, copied and checksummed)
    encoded = io.prepare(tree)
    return io.write(path, encoded)


def load(path: str | os.PathLike, like: Any = None, *,
         types: Iterable[type] | Mapping[str, type] | None = None,
         device: torch.device | str | None = None, verify: bool = True) -> Any:
    """Read the tree saved at ``path``: same structure, dtypes and bits (and dense layouts, see :func:`save`).

    ``like``: a template tree (``None``: no template); the checkpoint must have its structure, dict
    keys, NamedTuple types, leaf kinds, tensor shapes and dtypes, or a
    :class:`CheckpointMismatchError` names the first leaf path that differs
    (before any tensor is read). A dict, ``OrderedDict`` or ``Counter`` matches a template of another of these
    types key by key and comes back of its saved type, its keys in the template's order, but for a saved
    ``OrderedDict`` under a template of another type: its order is its leaf order, kept as saved. Tensors are
    placed on the template's devices (a meta
    template's on the CPU: a model built on the meta device loads real data), in the
    layout they were saved with, not the template's (its strides are not compared: a
    contiguous template loads a saved channels_last tensor as channels_last). A tensor comes back with the
    ``requires_grad`` it was saved with, a ``torch.nn.Parameter`` as a Parameter (as ``torch.load`` gives it; a
    plain tensor stays one under a template of Parameters, as does a Parameter in a file written before sofx
    marked them).
    ``types``: NamedTuple classes allowed besides sofx's own (needed without a
    template for a NamedTuple type that sofx does not define).
    ``device``: where to put every tensor (default: the template's device,
    else the CPU); one torch does not know, or that this process has not, is a
    :class:`CheckpointError` naming it, before the file is read. ``verify``: check each tensor's CRC-32
    and the structure's (its Python numbers and dict keys).

    Errors: :class:`CheckpointNotFoundError` (no file), :class:`CheckpointIOError`
    (the system does not let this process read it: the reason, with its number),
    :class:`CorruptCheckpointError` (truncated, corrupted header or data, not a
    sofx checkpoint), :class:`CheckpointVersionError` (another format version),
    :class:`CheckpointMismatchError` (does not match ``like``).
    """
    path = check_path("load", path)
    return io.read(path, like, types=types, device=device, verify=flag("load: verify", verify, CheckpointError))


def read_metadata(path: str | os.PathLike) -> dict:
    """Format version, writer and JSON structure of a checkpoint (checked against its CRC-32), without reading its
    tensors."""
    path = check_path("read_metadata", path)
    return io.read_metadata(path)
