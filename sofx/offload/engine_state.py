"""The offload engine's state as a plain pytree: tensors plus JSON-able values.

:func:`engine_state_dict` and :func:`load_engine_state` are what
:meth:`OffloadEngine.state_dict` / :meth:`OffloadEngine.load_state_dict`
do. The format (``STATE_FORMAT``)::

    {"format": "sofx.offload/1", "complete": bool,
     "layouts": [BlockLayout.to_json(), ...],            # which parameters each block holds
     "blocks": [{"master", "exp_avg", "exp_avg_sq", "counts"}, ...],   # tensors, in their dtypes
     "scaler_state": {"type": "GradScalerState", ...fields},
     "scaler": {"type": "GradScalerRule", ...settings} or None,   # None: a custom rule's
     "policy_state": {...fields}, "iteration": int, "adam": AdamConfig.to_json()}

``scaler`` holds the loss-scale rule's settings (growth and backoff factors, growth
interval; DeepSpeed's window, hysteresis, minimum): as ``torch.amp.GradScaler``'s
``load_state_dict`` takes the saved settings over its constructor's (and DeepSpeed's
checkpoint holds its loss scaler whole), a loaded state goes on with the saved rule's
settings, whatever the loading optimizer was made with. A state without the entry (an
older sofx's), or with ``None``, goes on with the loading optimizer's own rule.

Loading checks everything before it changes anything -- format, block layout,
every tensor's type, shape and dtype (any device that holds data: not ``meta``),
the loss-scale rule's kind and settings, the loss-scaler and policy states' kinds,
fields and ranges (the scaler state's against the saved rule), the iteration (an
integer >= 0) -- and keeps the saved dtypes (a bf16 ``exp_avg`` is never cast
to the master's fp32). Values no run writes are refused as corrupt: a negative
step count or second moment. A nan or an inf in the masters or moments (a
diverged run's state) loads, as ``torch.optim`` loads it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from sofx.errors import HParamError, SofxError, StructureError
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.loss_scale import (DynamicLossScaleRule, GradScalerRule, LossScaleRuleError, StaticScaleRule,
                             plain_state)
from sofx.offload.blocks import TENSOR_NAMES, BlockLayout
from sofx.serial import loss_scale_of
from sofx.speculate import PolicyState
from sofx.speculation.policy import checked_policy_state
from sofx.stored_values import refuse_negative
from sofx.tree import article

if TYPE_CHECKING:  # pragma: no cover
    from sofx.offload.engine import OffloadEngine

__all__ = ["STATE_FORMAT", "NONNEGATIVE", "engine_state_dict", "load_engine_state", "check_dense", "check_nonnegative",
           "replica_entries", "settings_text", "hparams_texts", "hparams_text", "bits_digest"]

STATE_FORMAT = "sofx.offload/1"
_SAVED = tuple(name for name in TENSOR_NAMES if name != "grad")
# The loss-scale rules whose settings the state holds (a custom rule's are its own: the loading optimizer's).
_RULES = (GradScalerRule, DynamicLossScaleRule, StaticScaleRule)
# The block tensors no run makes negative, and what their values are (for the error).
NONNEGATIVE = {"counts": "step count", "exp_avg_sq": "second moment"}
# bits_digest's slices: 2**DIGEST_SLICE_BITS elements (a 256 KiB int64 weight vector, one per device, reused). Not
# above torch's parallel grain (32768 elements): each slice's ops run on the calling thread. A parallel region per
# slice waits at its barrier for threads the machine runs others on: DDP ranks on one machine, each with as many
# threads as cores, took seconds for a 2**26-element state, and 0.13 s so.
DIGEST_SLICE_BITS = 15
_MASK64 = (1 << 64) - 1
# the integer view of an element of each width (an 8-byte element is folded, _folded)
_WIDTHS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# the slice multiplier's quadratic coefficient (any integer: a golden-ratio constant, so slices mix)
_SLICE_MIX = 0x9E3779B97F4A7C15


def engine_state_dict(engine: "OffloadEngine", complete: bool) -> dict[str, Any]:
    """The engine's state (live tensors, not copies); ``complete=False`` after an executor failure."""
    return {
        "format": STATE_FORMAT,
        "complete": complete,
        "layouts": [layout.to_json() for layout in engine.layouts],
        "blocks": [{name: getattr(engine.tensors[layout.index], name) for name in _SAVED}
                   for layout in engine.layouts],
        "scaler_state": {"type": type(engine.scaler_state).__name__, **_jsonable(engine.scaler_state._asdict())},
        "scaler": _rule_settings(engine.scaler),
        "policy_state": _jsonable(engine.policy_state._asdict()),
        "iteration": engine.iteration,
        "adam": engine.adam_config.to_json(),
    }


def replica_entries(engine: "OffloadEngine", contents: Sequence[str] = (), blocks: bool = True) -> dict[str, str]:
    """What must be the same on every rank for data-parallel replicas to take the same step (name -> text, in a
    fixed order; see :func:`sofx.offload.ddp.check_replicas`): the settings the optimizer was made with that change
    a step's bits (:func:`settings_text`), each block's step counts (one per parameter), each
    param group's hparams (the bits of their floats; an hparam the engine refuses as the text of the refusal, which
    the step then raises), and the loss scaler's state and rule settings; and for each key of ``contents``
    (``"exp_avg"``, ``"exp_avg_sq"``, ``"master"``) each parameter's :func:`bits_digest` of it (a state changed
    since the ranks last compared). ``blocks=False``: only the hparams and the loss scaler (what no block operation
    changes: read while blocks may be stepped). Reads no gradient, changes nothing."""
    entries = {"the optimizer's settings": settings_text(engine)} if blocks else {}
    for layout in engine.layouts if blocks else ():
        counts = engine.tensors[layout.index].counts.tolist()
        entries[f"the step count of {engine.describe_block(layout.index)}"] = ", ".join(map(str, counts))
    for g, text in enumerate(hparams_texts(engine)):
        entries[f"the hparams of param_groups[{g}]"] = text
    state = _jsonable(engine.scaler_state._asdict())
    entries["the loss scaler"] = f"{type(engine.scaler_state).__name__} {state}, rule {_rule_settings(engine.scaler)}"
    for key in contents if blocks else ():
        for i in range(len(engine.params)):
            entries[f"the {key} of {engine._describe_param(i)}"] = bits_digest(engine._param_views(i)[key])
    return entries


def settings_text(engine: "OffloadEngine") -> str:
    """The settings ``engine`` was made with that change a step's bits, as text: clipping (``max_grad_norm``, its
    profile), whether blocks are speculated (a block speculated and redone is the serial step within float32
    rounding; ``opt.speculate`` set on one rank alone), what becomes of a parameter without gradient, the
    accumulation, and the Adam transform's static configuration (the kernel backend among them: ``cpu_fast`` is
    a few ulps of the update from ``cpu``)."""
    spec = engine.speculation
    adam = ", ".join(f"{key}={value!r}" for key, value in engine.adam_config.to_json().items())
    return (f"max_grad_norm={spec.max_norm!r}, profile={spec.profile!r}, speculate={spec.enabled!r}, "
            f"missing_grad={spec.missing_grad!r}, "
            f"gradient_accumulation_steps={engine.tracker.accumulation_steps}, {adam}")


def hparams_texts(engine: "OffloadEngine") -> list[str]:
    """Each param group's hparams as text (:func:`hparams_text`), or every group's ``refused (...)`` where reading
    them raises: the engine refuses one, or ``hparams_fn`` raised something else (a group without ``'lr'``: a
    ``KeyError``, named with its type). That is the rank's own error, which its step raises: every rank must still
    take part in a comparison (a rank raising here instead left the others waiting in its all-reduce)."""
    try:
        return [hparams_text(hp) for hp in engine.hparams_fn()]
    except SofxError as exc:
        return [f"refused ({exc})"] * engine.n_groups
    except Exception as exc:
        return [f"refused ({type(exc).__name__}: {exc})"] * engine.n_groups


def hparams_text(hp: Any) -> str:
    """One group's :class:`~sofx.AdamHParams` as text: the reprs of its floats (their bits)."""
    return f"lr={hp.lr!r}, betas=({hp.beta1!r}, {hp.beta2!r}), eps={hp.eps!r}, weight_decay={hp.weight_decay!r}"


def bits_digest(t: torch.Tensor) -> str:
    """A digest of ``t``'s bits, sensitive to where each value lies, in one pass over ``t``: with ``b_g`` the bit
    pattern of element ``g`` (row-major) read as an integer of its width (an 8-byte one folded, :func:`_folded`),
    ``sum_g b_g * w_g`` modulo 2**64. ``t`` is read in slices of ``S = 2**s`` elements (``s =
    DIGEST_SLICE_BITS``); element ``g = k*S + i`` weighs ``w_g = a_k * W_i``, ``W`` one fixed vector of odd
    integers (:func:`_slice_weights`) and ``a_k`` an odd multiplier of slice ``k`` (:func:`_slice_multiplier`),
    so that ``w_g - w_h`` has exactly as many trailing zero bits as ``2 * (g - h)``.

    Any change of one element changes it (its pattern changes by ``d``, nonzero modulo 2**64, times an odd
    weight); ``-0.0`` and ``0.0`` differ, as their bits do. So does exchanging the values of two elements ``g`` and
    ``h`` of a tensor of at most 2**32 elements where their (folded) patterns differ in the low 32 bits -- always
    for elements of at most 4 bytes (``-0.0`` and ``0.0`` too), and for 8-byte ones that differ in their high half
    alone (float64 values of another sign or exponent): the sum changes by ``(b_h - b_g) * (w_g - w_h)``, of at most
    31 + 1 + 31 trailing zero bits: not a multiple of 2**64. Any other rearrangement (a transpose, slices
    exchanged) changes it unless the pseudo-random high bits of ``W`` and the quadratic ``a_k`` happen to cancel
    modulo 2**64 (no linear relation between positions makes them cancel). Temporaries hold one slice (a
    non-contiguous ``t`` is copied a slice at a time). The same on every rank and machine: the weights are integer
    arithmetic."""
    width = _WIDTHS[t.element_size()]
    weights = _slice_weights(t.device)
    sums, multipliers = [], []  # (per slice part: sum_i b_i * W_i, and a_k)
    for k, i, part in _slice_parts(t.detach().view(width), weights.numel()):
        values = _folded(part) if width == torch.int64 else part
        sums.append(torch.mul(values, weights[i:i + part.numel()]).sum())
        multipliers.append(_slice_multiplier(k))
    if len(sums) <= 1:  # (one read back, where t is on a GPU too)
        total = int(sums[0]) * multipliers[0] if sums else 0
    else:
        total = int((torch.stack(sums) * torch.tensor(multipliers, device=t.device)).sum())
    return f"bits digest {total & _MASK64}"


@functools.lru_cache(maxsize=None)  # (a constant per device: made once)
def _slice_weights(device: torch.device) -> torch.Tensor:
    """``W_i = 2*i + 1 + 2**(s+1) * R_i`` modulo 2**64 for ``i < 2**s`` (int64), on ``device``, made once: odd,
    ``W_i - W_j = 2*(i - j)`` modulo 2**(s+1); ``R_i`` the splitmix64 of ``i`` (pseudo-random: no linear relation
    between the weights, which a permutation of several elements could cancel)."""
    s = DIGEST_SLICE_BITS
    i = torch.arange(1 << s, dtype=torch.int64)
    return (2 * i + 1 + (_splitmix64(i) << (s + 1))).to(device)


def _slice_multiplier(k: int) -> int:
    """``a_k = 1 + 2**(s+1) * k * (1 + 2*C*k)`` modulo 2**64 (as a signed int64; ``C = _SLICE_MIX``): ``a_k = 1``
    modulo 2**(s+1) (``a_k*W_i - a_l*W_j = 2*(i - j)`` modulo 2**(s+1)), and ``a_k - a_l = 2**(s+1) * (k - l) *
    (1 + 2*C*(k + l))``, an odd multiple of ``2**(s+1) * (k - l)``. Exchanging slices ``k`` and ``l`` changes the
    digest by ``(a_k - a_l) * (D_l - D_k)``, ``D`` a slice's ``sum_i b_i * W_i`` (pseudo-random where the contents
    differ, arranged otherwise too); quadratic in ``k``: no linear relation between the slices' multipliers, which
    slices rotated could cancel (with ``a_k`` linear, ``a_0 + a_2 = 2 * a_1``)."""
    a = (1 + (k * (1 + 2 * _SLICE_MIX * k) << (DIGEST_SLICE_BITS + 1))) & _MASK64
    return a - (1 << 64) if a >= 1 << 63 else a


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer of ``x + 1`` (int64, wrapping; ``>>>`` a logical shift)."""
    z = x + 1
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
        z = z ^ _logical_shift(z, shift)
        if factor is not None:
            z = z * (factor - (1 << 64))
    return z


def _logical_shift(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x >>> shift`` of int64 ``x`` (zeros shifted in; torch's ``>>`` shifts the sign in)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _folded(bits: torch.Tensor) -> torch.Tensor:
    """``b ^ (b >>> 32)`` of 8-byte patterns: a bijection (the high half kept, the low half xor-ed with it), so that
    two patterns that differ in their high half only (float64 values differing in sign or exponent) differ in their
    low 32 bits."""
    return bits ^ _logical_shift(bits, 32)


def _row_major_pieces(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """``t``'s elements in row-major order, as 1-D contiguous pieces of at most ``limit`` elements: slices of
    ``t``'s own memory where ``t`` is contiguous, else copies of rows of it (no piece is copied larger)."""
    if t.is_contiguous():
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), limit):
            yield flat[start:start + limit]
    elif t.numel():
        row = t[0].numel()
        if row > limit:
            for sub in t:
                yield from _row_major_pieces(sub, limit)
        else:
            rows = limit // row
            for start in range(0, t.shape[0], rows):
                yield t[start:start + rows].reshape(-1)


def _slice_parts(bits: torch.Tensor, size: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(k, i, part)``: ``bits``'s elements in row-major order as 1-D contiguous parts, each within one slice of
    ``size`` elements, ``part`` holding elements ``k*size + i`` on: slices of ``bits``'s own memory where it is
    contiguous, else copies of at most ``size`` elements (:func:`_row_major_pieces`) split at the slices' ends."""
    if bits.is_contiguous():
        flat = bits.reshape(-1)
        for start in range(0, flat.numel(), size):
            yield start // size, 0, flat if flat.numel() <= size else flat[start:start + size]
        return
    offset = 0
    for piece in _row_major_pieces(bits, size):
        start = 0
        while start < piece.numel():
            k, i = divmod(offset + start, size)
            n = min(piece.numel() - start, size - i)
            yield k, i, piece[start:start + n]
            start += n
        offset += piece.numel()


def load_engine_state(engine: "OffloadEngine", state: Any, where: str = "state") -> None:
    """Check ``state`` against ``engine`` whole, then copy it in: a bad state raises a
    :class:`~sofx.errors.SofxError` naming the entry (``where``: what the caller calls ``state``) and
    what was expected, and changes nothing."""
    blocks, scaler, scaler_state, policy_state, iteration = _checked_state(engine, state, where)
    with torch.no_grad():
        for layout, saved in zip(engine.layouts, blocks):
            t = engine.tensors[layout.index]
            for name in _SAVED:
                getattr(t, name).copy_(saved[name])
    engine.scaler, engine.scaler_state = scaler, scaler_state
    engine.policy_state, engine.iteration = policy_state, iteration


def _checked_state(engine: "OffloadEngine", state: Any,
                   where: str) -> tuple[list[Mapping[str, torch.Tensor]], Any, Any, PolicyState, int]:
    """Everything :func:`load_engine_state` writes, checked: the blocks' tensors, the loss-scale rule, the
    loss-scaler and policy states, the iteration."""
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise StructureError(f"{where}: not an offload engine state (format {found!r}, expected {STATE_FORMAT!r})")
    complete = state.get("complete", True)
    if not isinstance(complete, bool):
        raise StructureError(f"{where}['complete']: expected a bool, got {complete!r}")
    if not complete:
        raise StructureError(f"{where}: this state was taken after an executor failure in the middle of a step "
                             "(\"complete\": False): some blocks may be partly stepped; load a checkpoint "
                             "saved between steps")
    _check_layouts(engine, _entry(state, "layouts", where), f"{where}['layouts']")
    _check_adam_config(engine, state.get("adam"), f"{where}['adam']")
    blocks = _checked_blocks(engine, _entry(state, "blocks", where), f"{where}['blocks']")
    scaler, scaler_state = _checked_scaler_state(engine, _entry(state, "scaler_state", where), state.get("scaler"),
                                                 where)
    policy_state = _checked_policy_state(_entry(state, "policy_state", where), f"{where}['policy_state']")
    iteration = state.get("iteration", 0)
    if isinstance(iteration, bool) or not isinstance(iteration, numbers.Integral) or iteration < 0:
        raise StructureError(f"{where}['iteration'] = {iteration!r}; expected an integer >= 0 (steps taken)")
    return blocks, scaler, scaler_state, policy_state, int(iteration)


def _entry(state: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in state:
        raise StructureError(f"{where}: the entry {key!r} is missing")
    return state[key]


def _check_layouts(engine: "OffloadEngine", saved: Any, where: str) -> None:
    """The saved blocks hold the parameters as this engine's do (sizes and param groups), each of its shape."""
    if not isinstance(saved, (list, tuple)):
        raise StructureError(f"{where}: expected a list of block layouts, got {type(saved).__name__}")
    layouts = []
    for i, d in enumerate(saved):
        try:
            layouts.append(BlockLayout.from_json(d))
        except (KeyError, TypeError, ValueError) as exc:
            raise StructureError(f"{where}[{i}]: not a block layout ({type(exc).__name__}: {exc})") from None
    if [(b.numels, b.group) for b in layouts] != [(b.numels, b.group) for b in engine.layouts]:
        if _per_parameter(layouts) == _per_parameter(engine.layouts):
            raise StructureError(f"{where}: the saved state holds these parameters packed into other blocks (saved "
                                 f"{[list(b.numels) for b in layouts]}, here "
                                 f"{[list(b.numels) for b in engine.layouts]}): this optimizer's block_numel "
                                 "differs from the saved run's; make it with the saved run's block_numel, or load "
                                 "the state into such an optimizer and carry it over per parameter, with the model's "
                                 "weights: opt.state[p][key] = value for 'step', 'exp_avg', 'exp_avg_sq'")
        _refuse_other_size(layouts, engine.layouts, where)
        raise StructureError(f"{where}: the saved blocks do not match this optimizer's blocks (block_numel, "
                             f"parameter sizes or param groups differ): saved {[list(b.numels) for b in layouts]}, "
                             f"here {[list(b.numels) for b in engine.layouts]}")
    for b, (was, here) in enumerate(zip(layouts, engine.layouts)):
        _check_shapes(was, here, f"{where}[{b}]")


def _refuse_other_size(saved: Sequence[BlockLayout], here: Sequence[BlockLayout], where: str) -> None:
    """Where the saved layouts hold as many parameters as ``here``, each group as many (the facade checks the groups'
    sizes first, as torch.optim's ``load_state_dict``) and in the same groups, but one of another size: a
    :class:`StructureError` naming the first such parameter (its number, as torch.optim numbers parameters across
    the groups, its group and place there) and both shapes. torch.optim matches the parameters by position too."""
    def params(layouts: Sequence[BlockLayout]) -> list[tuple[int, int, tuple[int, ...]]]:
        return sorted((i, b.group, tuple(shape)) for b in layouts for i, shape in zip(b.param_indices, b.shapes))

    was, now = params(saved), params(here)
    if [(i, g) for i, g, _ in was] != [(i, g) for i, g, _ in now]:
        return
    for (_, _, old), (i, g, shape) in zip(was, now):
        if math.prod(old) != math.prod(shape):
            place = sum(1 for j, h, _ in now if h == g and j < i)
            raise StructureError(f"{where}: parameter {i} (param_groups[{g}]['params'][{place}]) has shape {old} in "
                                 f"the state, {shape} here (a state saved for another model: the parameters are "
                                 "matched by position, as torch.optim matches them)")


def _per_parameter(layouts: Sequence[BlockLayout]) -> list[tuple[int, int]]:
    """``(numel, group)`` of every parameter, in block order: what two packings of the same parameters share."""
    return [(n, b.group) for b in layouts for n in b.numels]


def _check_shapes(saved: BlockLayout, here: BlockLayout, where: str) -> None:
    """Each parameter of a saved block has the shape of this engine's (as many elements in another shape, a
    (6, 5) weight saved for a (5, 6) one, would be read in the wrong shape)."""
    for index, was, now in zip(here.param_indices, saved.shapes, here.shapes):
        if tuple(was) != tuple(now):
            raise StructureError(f"{where}: parameter {index} has shape {tuple(was)} in the state, {tuple(now)} here "
                                 "(as many elements, another shape: a state saved for another model)")


def _check_adam_config(engine: "OffloadEngine", saved: Any, where: str) -> None:
    """What the moments mean is this engine's (the backend and undo mode are free to differ); a state without
    the entry (an older sofx's) is taken as is."""
    if saved is None:
        return
    if not isinstance(saved, Mapping):
        raise StructureError(f"{where}: expected a dict (AdamConfig.to_json()), got {type(saved).__name__}")
    here = engine.adam_config.to_json()
    for key in ("decoupled", "bias_correction", "state_dtype"):
        if key in saved and saved[key] != here.get(key):
            raise StructureError(f"{where}[{key!r}]: the state was saved by an optimizer with {key}={saved[key]!r}, "
                                 f"this one has {key}={here.get(key)!r} (e.g. SpeculativeAdamW's state into "
                                 "SpeculativeAdam)")


def _checked_blocks(engine: "OffloadEngine", saved: Any, where: str) -> list[Mapping[str, torch.Tensor]]:
    """The saved blocks, each a dict of tensors of this engine's shapes and dtypes (any device with data), with
    counts >= 0 and no negative second moment."""
    if not isinstance(saved, (list, tuple)) or len(saved) != len(engine.layouts):
        raise StructureError(f"{where}: the state holds {len(saved) if isinstance(saved, (list, tuple)) else 'no'} "
                             f"blocks, this optimizer has {len(engine.layouts)}")
    for layout, block in zip(engine.layouts, saved):
        at = f"{where}[{layout.index}]"
        if not isinstance(block, Mapping):
            raise StructureError(f"{at}: expected a dict of tensors {list(_SAVED)}, got {type(block).__name__}")
        t = engine.tensors[layout.index]
        for name in _SAVED:
            _check_tensor(block.get(name), getattr(t, name), f"{at}[{name!r}]")
        _check_values(block, at)
    return list(saved)


def _check_tensor(x: Any, have: torch.Tensor, where: str) -> None:
    """``x`` can be copied into ``have``: a dense tensor with data, of its shape and dtype."""
    if isinstance(x, torch.Tensor):
        check_dense(x, where)  # (first: a nested tensor has no shape)
    if not isinstance(x, torch.Tensor) or x.shape != have.shape or x.dtype != have.dtype:
        desc = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise StructureError(f"{where}: expected shape {tuple(have.shape)} dtype {have.dtype}, got {desc}")


def check_dense(x: torch.Tensor, where: str, error: type[SofxError] = StructureError) -> None:
    """``x`` is a dense (strided) tensor with data (not nested, not ``meta``, its elements in its storage: not freed
    or shrunk, :func:`~sofx.kernels.storage.refuse_short_storage`), which ``copy_`` can copy from; else ``error``
    naming ``where``."""
    if x.is_nested:  # (its layout is strided or jagged; it has no shape)
        raise error(f"{where}: expected a dense (strided) tensor, got a nested tensor")
    if x.layout != torch.strided:
        raise error(f"{where}: expected a dense (strided) tensor, got layout {x.layout}")
    if x.is_meta:
        raise error(f"{where}: expected a tensor with data, got one on device {x.device}")
    if not in_storage(x):  # (freed, as FSDP frees tensors, or shrunk: copy_ read outside any allocation)
        refuse_short_storage(x, where, error)


def _check_values(block: Mapping[str, torch.Tensor], where: str) -> None:
    """Values no run writes: a negative step count or second moment (see :func:`check_nonnegative`)."""
    for name in NONNEGATIVE:
        check_nonnegative(block[name], name, f"{where}[{name!r}]")


def check_nonnegative(x: torch.Tensor, name: str, where: str, error: type[SofxError] = StructureError) -> None:
    """No element of ``x``, a block's tensor ``name``, is below 0 where that is a value no run writes: a step count
    or a second moment (``NONNEGATIVE``; a nan or an inf is a diverged run's state and loads, as ``torch.optim``
    loads it; rounding never makes a stored second moment negative: algebraic undo clamps it at 0); else ``error``
    naming ``where``, the first such element's index and its value."""
    what = NONNEGATIVE.get(name)
    if what is not None:
        refuse_negative(x, what, where, error)


def _rule_settings(rule: Any) -> dict[str, Any] | None:
    """``{"type": "GradScalerRule", "init_scale": ..., "growth_factor": ..., ...}``: the settings of one of
    sofx's loss-scale rules (what ``torch.amp.GradScaler.state_dict`` holds next to its scale), ``None`` for a
    custom rule."""
    if type(rule) not in _RULES:
        return None
    return {"type": type(rule).__name__, **dataclasses.asdict(rule)}


def _checked_rule(engine: "OffloadEngine", saved: Any, where: str) -> Any:
    """The loss-scale rule a loaded state goes on with: the engine's, with the saved settings (as
    ``GradScaler.load_state_dict`` takes the saved ones over its constructor's); the engine's own where none were
    saved (``None``, or no entry: a state of an older sofx). A setting the entry lacks keeps the engine's; a rule
    of another kind, an unknown setting or an invalid value (the rule's own checks) is refused."""
    rule = engine.scaler
    if saved is None:
        return rule
    if not isinstance(saved, Mapping):
        raise StructureError(f"{where}: expected a dict (the loss-scale rule's settings) or None, got "
                             f"{type(saved).__name__}")
    settings = dict(saved)
    kind, here = settings.pop("type", None), type(rule).__name__
    if kind != here or type(rule) not in _RULES:
        custom = "" if type(rule) in _RULES else " (a custom rule, which keeps its own settings: set the entry to None)"
        raise StructureError(f"{where}: the saved loss-scale rule {_saved_kind(kind)}, this optimizer's is "
                             f"{article(here)}{custom}")
    names = [f.name for f in dataclasses.fields(rule)]
    unknown = sorted(set(settings) - set(names), key=str)  # (keys of several kinds: sorted by what they read as)
    if unknown:
        raise StructureError(f"{where}[{unknown[0]!r}]: {article(here)} has no such setting (it has {names})")
    try:
        return dataclasses.replace(rule, **settings)
    except HParamError as exc:
        raise HParamError(f"{where}: {exc}") from None


def _saved_kind(kind: Any) -> str:
    """What a saved loss-scale rule or scaler state is, by its ``'type'`` entry (``kind``), for a refusal: ``is an
    EagerRule`` (:func:`sofx.tree.article`), or ``names no kind ('type' = None)`` where it holds no class name."""
    return f"is {article(kind)}" if isinstance(kind, str) and kind else f"names no kind ('type' = {kind!r:.60})"


def _checked_scaler_state(engine: "OffloadEngine", saved: Any, saved_rule: Any, at: str) -> tuple[Any, Any]:
    """The loss-scale rule (:func:`_checked_rule`, from ``saved_rule``) and the saved loss-scaler state, of this
    engine's kind, with every field (none missing: its default is not the run's value) and fields any run can reach
    (see :func:`sofx.loss_scale.check_state`), valid for that rule, and a scale that is a finite number >= 0 (a
    static rule's: one :func:`~sofx.loss_scale.static_scale` takes, else every step would be skipped), held as
    Python numbers (:func:`sofx.loss_scale.plain_state`). ``at``: what the caller calls the engine state."""
    where = f"{at}['scaler_state']"
    if not isinstance(saved, Mapping):
        raise StructureError(f"{where}: expected a dict, got {type(saved).__name__}")
    fields = dict(saved)
    kind, expected = fields.pop("type", None), type(engine.scaler_state)
    if kind != expected.__name__:
        raise StructureError(f"{where}: the saved loss-scaler state {_saved_kind(kind)}, this optimizer's is "
                             f"{article(expected.__name__)}")
    unknown = sorted(set(fields) - set(expected._fields), key=str)  # (keys of several kinds, as above)
    if unknown:
        raise StructureError(f"{where}[{unknown[0]!r}]: {article(expected.__name__)} has no such field (it has "
                             f"{list(expected._fields)})")
    missing = [name for name in expected._fields if name not in fields]
    if missing:  # (every state dict holds them all: a default would be taken for the run's value without a word)
        raise StructureError(f"{where}[{missing[0]!r}]: the field is missing ({article(expected.__name__)} has "
                             f"{list(expected._fields)})")
    for name, value in fields.items():  # the state dict holds a tuple field as a list (JSON-like, as torch's betas)
        if isinstance(value, list) and isinstance(getattr(engine.scaler_state, name), tuple):
            fields[name] = tuple(value)
    try:
        scaler_state = expected(**fields)
    except TypeError as exc:  # a field without a default is missing
        raise StructureError(f"{where}: {exc}") from None
    scaler_state = plain_state(scaler_state, where)  # a 0-d tensor scale held as its Python float
    rule = _checked_rule(engine, saved_rule, f"{at}['scaler']")
    try:
        loss_scale_of(rule, scaler_state)  # (a custom rule's state: its scale at least)
        if isinstance(rule, StaticScaleRule):  # (never changes: at a scale static_scale refuses, every step skipped)
            dataclasses.replace(rule, value=scaler_state.scale)
    except HParamError as exc:
        raise HParamError(f"{where}: {exc}") from None
    except LossScaleRuleError as exc:  # (a custom rule's own exception: its message spoke of a step not taken)
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise HParamError(f"{where}: the loss-scale rule ({type(rule).__name__}) refuses it: "
                          f"{type(cause).__name__}: {cause}") from cause
    return rule, scaler_state


def _checked_policy_state(saved: Any, where: str) -> PolicyState:
    """The saved adaptive-policy state: a dict of :class:`PolicyState`'s fields (each missing field takes its
    default) read as :func:`~sofx.speculation.policy.checked_policy_state` reads them (``recent`` a list of bools,
    ``paused`` a bool, ``quiet`` an integer >= 0, ``reason`` a str); a :class:`StructureError` naming the entry."""
    if not isinstance(saved, Mapping):
        raise StructureError(f"{where}: expected a dict, got {type(saved).__name__}")
    unknown = sorted(set(saved) - set(PolicyState._fields), key=str)  # (keys of several kinds, as above)
    if unknown:
        raise StructureError(f"{where}[{unknown[0]!r}]: a PolicyState has no such field (it has "
                             f"{list(PolicyState._fields)})")
    try:
        return checked_policy_state(PolicyState()._replace(**saved), where, keyed=True)
    except HParamError as exc:
        raise StructureError(str(exc)) from None


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out
