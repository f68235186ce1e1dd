"""Packing a model's parameters into flat blocks of fp32 master weights.

The offload engine never steps a model parameter directly. It packs the
parameters of each param group, in the order given (the groups in order, each
group's parameters in order: the model's order only where the groups follow
it), into *blocks* of about ``block_numel`` elements. A block owns five flat tensors:

``master``      the fp32 master weights (the parameters' values, laid end to end)
``exp_avg``     Adam's first moment, ``state_dtype``
``exp_avg_sq``  Adam's second moment, ``state_dtype``
``grad``        the gradient buffer, master dtype (gradients are summed here)
``counts``      one int64 step count per parameter (torch.optim counts per parameter)

A block never spans two param groups (it has one set of hyperparameters) and
never splits a parameter (a parameter larger than ``block_numel`` is a block
of its own). :class:`BlockLayout` is the JSON-able description of a block that
a worker process needs to rebuild views of the same shared tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from sofx import tree
from sofx.errors import LeafError, UnsupportedError
from sofx.kernels.user_numbers import as_integer
from sofx.offload.arena import COLOUR_BYTES, MIN_COLOURED_BYTES, PAGE_COLOURS

__all__ = ["BlockLayout", "BlockTensors", "plan_blocks", "allocate_block_tensors", "TENSOR_NAMES"]

TENSOR_NAMES = ("master", "exp_avg", "exp_avg_sq", "grad", "counts")

Allocator = Callable[[str, int, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class BlockLayout:
    """Where the parameters of one block lie in its flat tensors.

    ``index``: the block's position (in the order the parameters are given); ``group``: its param
    group; ``param_indices``: positions of its parameters in the flat list of
    all managed parameters (the groups' params one group after the other); ``numels``/``shapes``: their sizes;
    ``on_device``: a *device block*, kept on the model's device and stepped in
    ``step()`` (partial offload) instead of by the executor.
    """

    index: int
    group: int
    param_indices: tuple[int, ...]
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    on_device: bool = False

    @property
    def numel(self) -> int:
        """Elements in the block (all its parameters)."""
        return sum(self.numels)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the block's flat tensors."""
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    def span(self, slot: int) -> slice:
        """Where parameter ``slot`` of the block lies in its flat tensors."""
        start = self.offsets[slot]
        return slice(start, start + self.numels[slot])

    def tensor_name(self, what: str) -> str:
        """The arena name of one of this block's tensors (``what`` in :data:`TENSOR_NAMES`)."""
        return f"block{self.index}.{what}"

    def to_json(self) -> dict:
        """The layout as JSON-able values (sent to a worker process; :meth:`from_json` reads it back)."""
        return {"index": self.index, "group": self.group, "param_indices": list(self.param_indices),
                "numels": list(self.numels), "shapes": [list(s) for s in self.shapes], "on_device": self.on_device}

    @staticmethod
    def from_json(d: dict) -> "BlockLayout":
        """The layout :meth:`to_json` wrote."""
        return BlockLayout(d["index"], d["group"], tuple(d["param_indices"]), tuple(d["numels"]),
                           tuple(tuple(s) for s in d["shapes"]), d["on_device"])


@dataclass
class BlockTensors:
    """The five flat tensors of one block, and per-parameter views of them."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    counts: torch.Tensor

    # flat tensor's id -> (the tensor, its layout, its views): every operation on the block asks again
    _views: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def views(self, flat: torch.Tensor, layout: BlockLayout) -> list[torch.Tensor]:
        """1-d views of ``flat``, one per parameter of ``layout`` (made once per tensor and layout)."""
        cached = self._views.get(id(flat))
        if cached is None or cached[0] is not flat or cached[1] is not layout:
            cached = (flat, layout, tuple(flat[o:o + n] for o, n in zip(layout.offsets, layout.numels)))
            self._views[id(flat)] = cached
        return list(cached[2])

    def nbytes(self) -> int:
        """Bytes of the block's tensors (master, moments, gradient buffer, counts)."""
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq,
                                                          self.grad, self.counts))


def plan_blocks(groups: Sequence[Sequence[torch.Tensor]], block_numel: int, n_device_blocks: int = 0,
                ) -> list[BlockLayout]:
    """Lay the parameters of ``groups`` (in the order given, group after group) out in blocks.

    Parameters are numbered across groups in order (``param_indices``). A new
    block starts at each group and whenever adding the next parameter would
    exceed ``block_numel`` (unless the block is empty). The first
    ``n_device_blocks`` blocks are marked ``on_device``. Both are integers (numpy's and 1-element integer
    tensors too, read as Python ints).
    """
    numel, n_device = as_integer(block_numel), as_integer(n_device_blocks)
    if numel is None or numel < 1:
        raise UnsupportedError(f"block_numel must be a positive int, got {block_numel!r}")
    if n_device is None or n_device < 0:
        raise UnsupportedError(f"n_device_blocks must be an int >= 0, got {n_device_blocks!r}")
    block_numel, n_device_blocks = numel, n_device
    layouts: list[BlockLayout] = []
    index = 0
    for gi, params in enumerate(groups):
        current: list[tuple[int, torch.Tensor]] = []
        size = 0

        def close_block() -> None:
            nonlocal current, size
            if current:
                b = len(layouts)
                layouts.append(BlockLayout(b, gi, tuple(i for i, _ in current), tuple(p.numel() for _, p in current),
                                           tuple(tuple(p.shape) for _, p in current), b < n_device_blocks))
            current, size = [], 0

        for p in params:
            if current and size + p.numel() > block_numel:
                close_block()
            current.append((index, p))
            size += p.numel()
            index += 1
        close_block()
    if n_device_blocks > len(layouts):
        raise UnsupportedError(f"n_device_blocks={n_device_blocks} but the parameters make only {len(layouts)} "
                               f"blocks of block_numel={block_numel}")
    return layouts


def check_params(groups: Sequence[Sequence[torch.Tensor]]) -> torch.device:
    """Check that the managed parameters can be offloaded; return their (common) device."""
    device = None
    seen: dict[int, tuple[int, int]] = {}
    for gi, params in enumerate(groups):
        for pi, p in enumerate(params):
            where = f"param_groups[{gi}]['params'][{pi}]"
            if not isinstance(p, torch.Tensor):
                raise LeafError(f"{where}: expected a tensor, got {type(p).__name__}")
            if isinstance(p, torch.nn.parameter.UninitializedTensorMixin):  # (torch's ValueError from its numel())
                raise LeafError(tree.uninitialized_refusal(where))
            # (no dense data to pack into a block: torch's bare errors from the constructor's reshape or copy)
            if p.is_nested:  # (of strided layout too: it has no shape, torch's "Internal error" said)
                raise LeafError(f"{where}: a nested tensor has no dense data to offload; nested parameters are not "
                                "supported")
            if p.layout != torch.strided:
                raise LeafError(f"{where}: a tensor of layout {p.layout} has no dense data to offload; sparse "
                                "parameters are not supported (convert it to dense)")
            if p.is_meta:
                raise LeafError(f"{where}: a tensor on the meta device holds no data to offload (a model built on "
                                "'meta': materialize its parameters first, e.g. model.to_empty(device=...) and "
                                "initialize them)")
            if not p.is_leaf:
                raise LeafError(f"{where}: can't optimize a non-leaf tensor")
            if p.dtype == torch.float64:
                raise LeafError(f"{where}: float64 parameters are not supported by the offload engine (its masters "
                                "are float32); use sofx.adamw / sofx.adam directly, or a float32 model")
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise LeafError(f"{where}: expected a float32/bfloat16/float16 tensor, got dtype {p.dtype}")
            if id(p) in seen:
                g0, p0 = seen[id(p)]
                raise LeafError(f"{where}: the same parameter is also param_groups[{g0}]['params'][{p0}]; "
                                "a (tied) parameter must appear once")
            seen[id(p)] = (gi, pi)
            if device is None:
                device = p.device
            elif p.device != device:
                raise LeafError(f"{where}: expected device {device} (as the first parameter), got {p.device}")
    if device is None:
        raise LeafError("the optimizer got an empty parameter list")
    return device


def allocate_block_tensors(layout: BlockLayout, allocate: Allocator, state_dtype: torch.dtype,
                           master_dtype: torch.dtype = torch.float32) -> BlockTensors:
    """Allocate (through ``allocate(name, numel, dtype)``) the zeroed tensors of one block."""
    n = layout.numel
    return BlockTensors(
        master=allocate(layout.tensor_name("master"), n, master_dtype),
        exp_avg=allocate(layout.tensor_name("exp_avg"), n, state_dtype),
        exp_avg_sq=allocate(layout.tensor_name("exp_avg_sq"), n, state_dtype),
        grad=allocate(layout.tensor_name("grad"), n, master_dtype),
        counts=allocate(layout.tensor_name("counts"), len(layout.numels), torch.int64),
    )


def block_nbytes(layout: BlockLayout, state_dtype: torch.dtype, master_dtype: torch.dtype = torch.float32) -> int:
    """Bytes :func:`allocate_block_tensors` needs for ``layout`` (at most: with page colouring's padding)."""
    m = torch.empty((), dtype=master_dtype).element_size()
    s = torch.empty((), dtype=state_dtype).element_size()
    padding = sum((PAGE_COLOURS - 1) * COLOUR_BYTES  # the most a coloured (large) tensor is padded by
                  for size in (m, m, s, s) if layout.numel * size >= MIN_COLOURED_BYTES)
    return layout.numel * (2 * m + 2 * s) + 8 * len(layout.numels) + padding
