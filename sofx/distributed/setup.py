"""The setup's agreement: every rank set up the same (params, optimizer, loss scaler, config, hparams).

:func:`check_same_setup`, and the entries (name -> text) it and
:func:`sofx.distributed.all_reduce_sumsq` compare by :func:`~sofx.distributed.agreement._agree`.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from typing import Any, Callable, Mapping, Sequence

import torch

from sofx import tree
from sofx.adam import Adam
from sofx.distributed.agreement import _agree, _dtype_shape
from sofx.distributed.groups import _collective_device, require_initialized
from sofx.distributed.refusals import _as_refusal, _check_arguments
from sofx.errors import SofxError, UnsupportedError
from sofx.kernels import select_backend
from sofx.kernels.user_numbers import is_bool

__all__ = ["check_same_setup"]


_SETUP_KEYWORDS = ("params", "opt", "scaler", "config", "hparams", "settings")


def _setup_hint(*more: str) -> str:
    """What a setup's error asks for: the same of everything it compared, on every rank."""
    compared = ("params' structure, dtypes and shapes", "optimizer", "loss scaler", "speculation config", "hparams",
                "settings", *more)
    return f"every rank must be set up the same ({'; '.join(compared)})"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

# where a schedule's values are compared: the first step, and the second, where a warm-up (which starts at the
# same value whatever its length) or a decay has moved already
_SCHEDULE_STEPS = (0, 1)


def check_same_setup(group: Any = None, *extra: Any, params: Any = None, opt: Any = None, scaler: Any = None,
                     config: Any = None, hparams: Any = None, settings: Mapping[str, Any] | None = None,
                     **unknown: Any) -> None:
    """Raise on every rank of ``group`` unless every rank passed the same setup: a collective, at setup.

    ``params``: the full params tree (structure, dtypes and shapes are
    compared leaf by leaf, each named by its path, not values; two leaves
    whose paths read the same, dict keys of equal ``repr``, are refused);
    ``opt``: the optimizer (its static configuration and kernel backend, by
    ``repr``, and its default hparams field by field; with ``params``, also the backend each leaf resolves to:
    ``backend="auto"`` takes Triton on a GPU where it is installed and the
    reference kernels elsewhere, whose bits differ); ``scaler``: the loss
    scaler (its settings); ``config``: a :class:`~sofx.speculate.SpeculationConfig`;
    ``hparams``: the full hparams (an ``AdamHParams`` prefix tree, not a
    rank's :meth:`Shard.local_hparams`), or a schedule of them, compared by
    its fields (a dataclass: every schedule of :mod:`sofx.schedules`) or
    ``repr`` and by its values at steps 0 and 1 (a warm-up of another length
    starts at the same value, and differs at step 1);
    ``settings``: anything else that must agree (``{"max_norm": 1.0,
    "profile": "torch"}`` for the serial loop, say). Dataclasses,
    NamedTuples, dicts, lists and tuples are compared field by field; Python
    and numpy numbers by their exact value (``lr=1`` and ``lr=1.0`` or
    ``np.float64(1.0)`` agree; a bool is not a number), one-element tensors
    by their exact value and dtype; sets by their elements,
    sorted; anything else by ``repr`` (object addresses left out); a dict's
    keys read as values do, its items sorted by them (two keys that read the
    same are refused: which is which could differ between ranks). A keyword
    left ``None`` is not compared, but a rank that passes it where another
    does not differs.

    One all-reduce of 16 bytes (a digest); where the ranks differ, every rank
    raises naming the first entry that differs (``config.max_norm``,
    ``params['w']``, ``hparams(0)['head'].lr``) with each rank's value; where
    a rank refuses its own input (an unknown keyword, a positional argument
    after ``group``, a schedule that raises at step 0 or 1), it raises its error
    and every other rank names it. Without the check such ranks step side by
    side, differently, and their gathered results silently mix.
    (:func:`all_reduce_sumsq` takes the same keywords and checks them as it
    builds the hook; :func:`shard_blocks` checks the params of a shard.)
    """
    require_initialized(group, "check_same_setup")
    _agree_setup("check_same_setup", group, extra, _SETUP_KEYWORDS, unknown,
                 lambda: _setup_entries(params, opt, scaler, config, hparams, settings), _setup_hint())


def _agree_setup(what: str, group: Any, extra: tuple[Any, ...], known: Sequence[str], unknown: dict[str, Any],
                 entries: Callable[[], dict[str, str]], hint: str) -> None:
    """:func:`_agree` on ``entries()``, where a positional argument after ``group`` (``extra``), an unknown
    keyword or a failure of ``entries`` is this rank's refusal."""
    refused, mine = None, {}
    try:
        _check_arguments(what, "group", extra, unknown, known)
        mine = entries()
    except Exception as e:  # told to the other ranks by the agreement, which they are waiting in
        refused = _as_refusal(what, e)
    _agree(what, mine, group, _collective_device(group, None), refused, hint)


def _setup_entries(params: Any, opt: Any, scaler: Any, config: Any, hparams: Any,
                   settings: Mapping[str, Any] | None) -> dict[str, str]:
    """The setup as entries (name -> text) that are equal on every rank where the setup is."""
    out = {} if params is None else _params_entries(params)
    for name, value in (("opt", opt), ("scaler", scaler), ("config", config), ("hparams", hparams)):
        if value is not None and name == "opt" and isinstance(opt, Adam):
            out["opt"] = _optimizer_text(opt)
            _entries("opt.defaults", opt.defaults, out)
        elif value is not None:
            _entries(name, value, out)
    if params is not None and isinstance(opt, Adam):
        out.update(_kernel_entries(params, opt))
    if callable(hparams):
        for step in _SCHEDULE_STEPS:
            _entries(f"hparams({step})", hparams(step), out)
    if settings is not None:
        if not isinstance(settings, Mapping):
            raise SofxError(f"settings is {tree.article(type(settings).__name__)}; expected a mapping of names to "
                            "settings")
        _entries("settings", dict(settings), out)
    return out


def _optimizer_text(opt: Adam) -> str:
    """The static configuration of ``opt``: its ``repr`` without its default hparams, which are compared field by
    field (its ``repr`` reads a 0-d tensor default to 4 digits, ``lr=1`` and ``lr=1.0`` differently)."""
    return _ADDRESS.sub("", repr(opt)).replace(repr(opt.defaults), "defaults=opt.defaults", 1)


def _params_entries(params: Any) -> dict[str, str]:
    """Every leaf of ``params`` as its path and its dtype and shape (what the ranks' params must agree in; a leaf
    that is not a tensor, by :func:`_text`). Two leaves of one path (dict keys of equal ``repr``: two
    ``nn.Linear(2, 2)``) are refused: one entry would hold the second's and leave the first uncompared."""
    leaves, spec = tree.flatten(params)
    out: dict[str, str] = {}
    for path, x in zip(tree.leaf_paths(spec), leaves):
        if path in out:
            raise SofxError(f"params has two leaves named {path}: which is which could differ between ranks; give "
                            "the keys a repr that tells them apart")
        out[path] = _dtype_shape(x.dtype, x.shape) if isinstance(x, torch.Tensor) else _text(x)
    return out


def _kernel_entries(params: Any, opt: Adam) -> dict[str, str]:
    """The kernel backend ``opt`` steps each tensor leaf of ``params`` with, as this process resolves it
    (``backend="auto"``: on a GPU, Triton where it is installed, else the reference kernels, whose bits differ):
    ``opt.backend(params['w'])`` -> ``"triton"``, or the refusal's text where none supports the leaf."""
    leaves, spec = tree.flatten(params)
    out = {}
    for path, x in zip(tree.leaf_paths(spec), leaves):
        if isinstance(x, torch.Tensor):
            try:
                chosen = select_backend(opt.backend, x.device, x.dtype, opt.state_dtype or x.dtype).NAME
            except UnsupportedError as e:
                chosen = f"none ({e})"
            out[f"opt.backend({path})"] = chosen
    return out


def _entries(path: str, x: Any, out: dict[str, str], depth: int = 0) -> None:
    """``x`` as ``out[path] = text``, and one entry per compared field of a dataclass or NamedTuple and per item
    of a dict, list or tuple (so that a message names the field that differs, ``config.max_norm``)."""
    items = _items(path, x) if depth < 8 else None
    if items is None:
        out[path] = _text(x)
        return
    out[path] = type(x).__qualname__
    for suffix, value in items:
        _entries(path + suffix, value, out, depth + 1)


def _items(path: str, x: Any) -> list[tuple[str, Any]] | None:
    """The named parts of a container or record ``x`` at ``path`` (``None`` for anything else)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [(f".{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x) if f.compare]
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return [(f".{name}", value) for name, value in zip(x._fields, x)]
    if isinstance(x, Mapping):
        return _mapping_items(path, x)
    if isinstance(x, (list, tuple)):
        return [(f"[{i}]", value) for i, value in enumerate(x)]
    return None


def _mapping_items(path: str, x: Mapping) -> list[tuple[str, Any]]:
    """The items of mapping ``x`` at ``path``, each named by its key's :func:`_text` (a frozenset key or one whose
    ``repr`` holds an address reads the same on every rank), sorted by it. Keys that read the same are refused:
    which is which could differ between ranks."""
    named: dict[str, Any] = {}
    for k in x:
        name = f"[{_text(k)}]"
        if name in named:
            raise SofxError(f"{path} has two keys that read {name[1:-1]} (addresses left out): which is which could "
                            "differ between ranks; give the keys a repr that tells them apart")
        named[name] = x[k]
    return sorted(named.items())


def _text(x: Any) -> str:
    """``x`` as text that is the same on every rank where ``x`` is: a one-element tensor by its exact value,
    another by its dtype and shape, a set by its elements' texts, sorted (its ``repr`` follows their hashes,
    which Python salts per process for strings, and their insertion order), a tuple by its items' texts, a
    Python or numpy number by its exact value (:func:`_number_text`: ``1``, ``1.0`` and ``np.float64(1.0)`` read
    the same), anything else by ``repr`` without object addresses."""
    number = _number_text(x)
    if number is not None:
        return number
    if isinstance(x, torch.Tensor):
        if x.numel() == 1 and x.layout == torch.strided and not x.is_meta:
            return f"tensor({x.item()!r}, dtype={x.dtype})"
        return f"tensor of {_dtype_shape(x.dtype, x.shape)}"
    if isinstance(x, (set, frozenset)):
        return f"{type(x).__name__}({{{', '.join(sorted(map(_text, x)))}}})"
    if type(x) is tuple:  # (a dict key or a set's element, say: a set in it reads as above)
        return f"({', '.join(map(_text, x))}{',' if len(x) == 1 else ''})"
    return _ADDRESS.sub("", repr(x))


def _number_text(x: Any) -> str | None:
    """A Python or numpy number as text that is equal exactly where the values are (``None`` for anything else):
    a bool as ``True``/``False``; an integer, or a float of integral value, as the integer (``1``, ``1.0`` and
    ``np.float64(1.0)`` read ``1``); another float by the ``repr`` of its exact value (``0.01``, ``inf``,
    ``nan``; a float32 reads as the float it is, not as the decimal it was written as). A real number that no
    float holds exactly (a ``longdouble``'s extra digits) is left to its ``repr``."""
    if is_bool(x):
        return repr(bool(x))
    if isinstance(x, numbers.Integral):
        return _int_text(int(x))
    if not isinstance(x, numbers.Real):
        return None
    value = float(x)
    if value != x and value == value:  # (nan is nan: not equal to itself)
        return None
    return _int_text(int(value)) if value.is_integer() else repr(value)


def _int_text(n: int) -> str:
    """``n`` in decimal, or in hex where it has more digits than Python writes in decimal."""
    try:
        return str(n)
    except ValueError:
        return hex(n)
