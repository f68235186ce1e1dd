"""Encode a pytree as a JSON structure plus named tensors, and decode it back.

The structure is plain JSON (no pickle, nothing imported by name): every node
is a small dict whose ``"k"`` says what it is::

    {"k": "tensor", "key": "tree.mu['w']", "dtype": "float32", "shape": [3, 4],
     "requires_grad": false, "device": "cpu", "crc32": 123}
        (a dense, not contiguous layout, as a channels_last weight, adds "order": [0, 2, 3, 1]: the file's array is
        the tensor permuted so, its memory in memory order; a permutation of the dimensions, checked on load;
        a ``torch.nn.Parameter`` adds "parameter": true and loads as one)
    {"k": "none"} | {"k": "bool", "v": true} | {"k": "int", "v": 3} | {"k": "int", "hex": "0x..."} (beyond int64)
    {"k": "float", "v": "0x1.999999999999ap-4"}        (float.hex: exact, inf too)
    {"k": "float", "bits": 9221120237041090560}          (a nan: its 64 bits, sign and payload kept)
    {"k": "str", "v": "..."} | {"k": "dtype", "v": "bfloat16"}
    {"k": "list" | "tuple", "items": [...]}
    {"k": "dict" | "odict" | "counter", "keys": [["s", "name"], ["i", 3]], "items": [...]}
        (an OrderedDict's ``_metadata`` dict, as ``nn.Module.state_dict()`` sets it, under "metadata";
        a ``collections.Counter``: MultiStepLR's ``milestones`` in its ``state_dict()``)
    {"k": "namedtuple", "type": "sofx.adam.AdamState", "fields": [...], "items": [...]}

numpy scalars (``np.float64`` in a scheduler's state) are stored as the Python bool, int or float of their
value and load back as that (a ``longdouble`` that no float holds exactly is refused, not rounded). Tensors
are named by their leaf path (``tree['params']['w']``), which is also how every error message names them.
A NamedTuple is rebuilt only from a class the caller allows: the template's own class (``like=``), a class in
``types=``, or one of sofx's own NamedTuples (:mod:`sofx.checkpoint.known_types`).
"""

from __future__ import annotations

import collections
import functools
import numbers
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

try:
    from numpy import bool_ as _NumpyBool
except ImportError:  # numpy is optional: no numpy scalar can reach the codec then
    class _NumpyBool:  # type: ignore[no-redef]
        pass

from sofx.checkpoint.errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from sofx.kernels.base import rounds_in_float
from sofx.kernels.storage import in_storage, refuse_short_storage
from sofx.tree import article as _article  # (the shared wording: checkpoint.known_types imports it from here)

__all__ = ["EncodedTree", "NO_TEMPLATE", "encode", "decode", "dtype_name", "dtype_from_name", "type_name", "ROOT"]

ROOT = "tree"

# Tensor dtypes a checkpoint can hold (those safetensors stores), by name. A fixed
# table: a dtype name read from a file is looked up here, never with getattr.
_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                "uint16", "uint32", "uint64", "complex64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz")
_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
_NAMES: dict[torch.dtype, str] = {d: n for n, d in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The checkpoint name of a tensor dtype (``None`` if it cannot be stored)."""
    return _NAMES.get(dtype)


def dtype_from_name(name: str) -> torch.dtype | None:
    """The dtype of a checkpoint dtype name (``None`` if unknown)."""
    return _DTYPES.get(name) if isinstance(name, str) else None


def type_name(cls: type) -> str:
    """The name a NamedTuple class is recorded under: ``module.QualName``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields") and isinstance(type(x)._fields, tuple)


@dataclass
class EncodedTree:
    """A tree split into its JSON structure and its tensors (by key, in leaf order)."""

    structure: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nodes: dict[str, dict] = field(default_factory=dict)  # key -> its tensor node (to fill in crc32)


def encode(tree: Any, root: str = ROOT) -> EncodedTree:
    """Split ``tree`` into a JSON structure and its tensors.

    Raises :class:`CheckpointError` naming the leaf path for anything that
    cannot be stored faithfully (an arbitrary object, a sparse or meta tensor,
    a dtype safetensors has no code for, a tensor inside ``torch.func``
    transforms, a dict key that is not a str or an int, an int key of more
    decimal digits than :func:`max_key_digits`).
    """
    out = EncodedTree({})
    out.structure = _encode(tree, root, out)
    return out


# Containers within containers, at most: the structure is nested JSON (two levels per container), which Python's
# json reads and writes recursively (its limit: sys.getrecursionlimit(), 1000 by default, less the caller's frames).
MAX_NESTING = 200


def _encode(x: Any, path: str, out: EncodedTree, depth: int = 0) -> dict:
    if depth > MAX_NESTING:
        where = path if len(path) <= 160 else f"{path[:80]}...{path[-60:]}"
        raise CheckpointError(f"{where}: the tree is nested more than {MAX_NESTING} containers deep; a checkpoint's "
                              "structure is nested JSON, which Python reads back recursively")
    if isinstance(x, torch.Tensor):
        return _encode_tensor(x, path, out)
    if x is None:
        return {"k": "none"}
    if isinstance(x, bool):
        return {"k": "bool", "v": x}
    if type(x) is int:
        # beyond int64, as hexadecimal text (JSON has no limit, but Python's decimal conversion stops at
        # sys.get_int_max_str_digits(), 4300 digits by default; hex is exact at any size)
        return {"k": "int", "v": x} if -2 ** 63 <= x < 2 ** 63 else {"k": "int", "hex": hex(x)}
    if type(x) is float:
        if x != x:  # nan: float.hex drops its sign and payload; the 64 bits keep them
            return {"k": "float", "bits": struct.unpack("<Q", struct.pack("<d", x))[0]}
        return {"k": "float", "v": x.hex()}
    if type(x) is str:
        return {"k": "str", "v": x}
    if _is_numpy_scalar(x):
        # numpy scalars (a LambdaLR of np.cos puts np.float64 in a scheduler's state): stored as the Python
        # number of the same value (np.float32 widened exactly), loaded back as that number
        if isinstance(x, _NumpyBool):
            return {"k": "bool", "v": bool(x)}
        if isinstance(x, numbers.Integral):
            return _encode(int(x), path, out)
        if rounds_in_float(x):  # (a longdouble's extra digits: float() rounded them off without a word)
            raise CheckpointError(f"{path}: a numpy.{type(x).__name__} {x!r:.60} that no Python float holds exactly "
                                  "cannot be stored without rounding; store float(x), or its digits as a str")
        return _encode(float(x), path, out)
    if isinstance(x, torch.dtype):
        name = dtype_name(x)
        if name is None:
            raise CheckpointError(f"{path}: the dtype {x} cannot be stored in a checkpoint")
        return {"k": "dtype", "v": name}
    if _is_namedtuple(x):
        fields = list(type(x)._fields)
        return {"k": "namedtuple", "type": type_name(type(x)), "fields": fields,
                "items": [_encode(v, f"{path}.{f}", out, depth + 1) for f, v in zip(fields, x)]}
    if type(x) in (list, tuple):
        kind = "list" if type(x) is list else "tuple"
        return {"k": kind, "items": [_encode(v, f"{path}[{i}]", out, depth + 1) for i, v in enumerate(x)]}
    if type(x) in (dict, collections.OrderedDict, collections.Counter):
        keys, items = [], []
        for key, value in x.items():
            _check_key(key, path)
            keys.append(["s", key] if type(key) is str else ["i", key])
            items.append(_encode(value, f"{path}[{key!r}]", out, depth + 1))
        kind = {dict: "dict", collections.OrderedDict: "odict", collections.Counter: "counter"}[type(x)]
        node = {"k": kind, "keys": keys, "items": items}
        meta = getattr(x, "_metadata", None)  # nn.Module.state_dict()'s per-module versions
        if type(x) is collections.OrderedDict and isinstance(meta, dict):
            node["metadata"] = _encode(meta, f"{path}._metadata", out, depth + 1)
        return node
    raise CheckpointError(f"{path}: {_article(type(x).__module__ + '.' + type(x).__qualname__)} cannot be stored in a "
                          "checkpoint; expected tensors, None, bool/int/float/str, torch.dtype, and lists, tuples, "
                          "dicts (str or int keys) and NamedTuples of these")


def max_key_digits() -> int:
    """The most decimal digits of an int dict key, 0 for no limit: JSON writes a key in decimal, and Python
    writes and reads decimal ints only up to ``sys.get_int_max_str_digits()`` digits (4300 by default, 0: no
    limit; a process sets it with ``sys.set_int_max_str_digits``). A leaf's int value is kept exact at any size
    as hexadecimal instead. (Pythons before 3.10.7 have no limit.)"""
    return getattr(sys, "get_int_max_str_digits", lambda: 0)()


@functools.lru_cache(maxsize=8)
def _key_bound(digits: int) -> int:
    """``10 ** digits``: the smallest magnitude of more than ``digits`` decimal digits."""
    return 10 ** digits


def _check_key(key: Any, path: str) -> None:
    """Refuse a dict key that a checkpoint cannot hold: not a str or an int, or an int of more decimal digits
    than :func:`max_key_digits` (described by its size: its decimal text is what fails)."""
    if isinstance(key, bool) or type(key) not in (str, int):
        raise CheckpointError(f"{path}: dict key {key!r} of type {type(key).__name__} cannot be stored; "
                              "keys must be str or int")
    limit = max_key_digits()
    if type(key) is int and limit and abs(key) >= _key_bound(limit):
        raise CheckpointError(f"{path}: an int dict key of {key.bit_length()} bits (more than {limit} decimal "
                              "digits) cannot be stored: the structure's JSON writes keys in decimal, which this "
                              f"process writes and reads only up to {limit} digits (sys.get_int_max_str_digits(); "
                              "sys.set_int_max_str_digits() changes it)")


def json_int(text: str) -> int:
    """``int(text)`` for ``json.loads(..., parse_int=json_int)``, but a :class:`CheckpointError` (a dict key too
    long for this process, not a damaged file) instead of Python's bare ``ValueError`` where ``text`` has more
    decimal digits than :func:`max_key_digits`."""
    limit = max_key_digits()
    digits = len(text) - text.startswith("-")
    if limit and digits > limit:
        raise CheckpointError(f"the tree structure holds an int of {digits} decimal digits (an int dict key), more "
                              f"than this process reads: sys.get_int_max_str_digits() is {limit}; "
                              "sys.set_int_max_str_digits() raises it")
    return int(text)


def _encode_tensor(t: torch.Tensor, path: str, out: EncodedTree) -> dict:
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # (torch's ValueError at its first use)
        raise CheckpointError(f"{path}: an uninitialized parameter or buffer (a lazy module's, before its first "
                              "forward) has no shape or data to store; run a forward pass first")
    if t.is_nested:  # (of strided layout too: it has no shape, which torch's "Internal error" said)
        raise CheckpointError(f"{path}: a nested tensor cannot be stored; store its components (t.unbind())")
    if t.layout != torch.strided:
        raise CheckpointError(f"{path}: a tensor with layout {t.layout} cannot be stored; convert it to dense")
    if t.device.type == "meta":
        raise CheckpointError(f"{path}: a tensor on the meta device has no data to store")
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(t):
        raise CheckpointError(f"{path}: the tensor is traced by torch.func or torch.compile and has no value to store")
    if not in_storage(t):  # (freed, as FSDP frees tensors, or shrunk: its bytes would be read outside its storage)
        refuse_short_storage(t, path, CheckpointError)
    name = dtype_name(t.dtype)
    if name is None:
        raise CheckpointError(f"{path}: dtype {t.dtype} cannot be stored in a checkpoint (safetensors has no code "
                              f"for it); supported: {', '.join(_DTYPES)}")
    if path in out.tensors:
        raise CheckpointError(f"{path}: two leaves have the same path")  # unreachable: paths are unique
    node = {"k": "tensor", "key": path, "dtype": name, "shape": list(t.shape),
            "requires_grad": bool(t.requires_grad), "device": str(t.device)}
    if isinstance(t, torch.nn.Parameter):  # (loads as one, as torch.load gives it; a reader before it: a tensor)
        node["parameter"] = True
    out.tensors[path] = t
    out.nodes[path] = node
    return node


# ----------------------------------------------------------------------- decode
_SCALAR_KINDS = ("none", "bool", "int", "float", "str", "dtype")
_NO_LIKE = NO_TEMPLATE = object()  # "no template given" (None is a valid template)


def decode(structure: Any, load_tensor: Callable[[dict, str, Any], Any], *, like: Any = _NO_LIKE,
           types: Mapping[str, type] | None = None, root: str = ROOT) -> Any:
    """Rebuild a tree from its JSON structure; ``load_tensor(node, path, like_leaf)`` makes each tensor.

    ``like_leaf`` is the template's tensor at that path (``None`` without a template).

    With ``like`` every node is checked against the template first (kind,
    NamedTuple type and fields, dict keys, sequence length, tensor shape and
    dtype) and a :class:`CheckpointMismatchError` names the first leaf path
    that differs; dict entries come back in the template's order and
    NamedTuples as the template's classes. A malformed structure raises
    :class:`CorruptCheckpointError`.
    """
    try:
        return _decode(structure, like, root, load_tensor, types if types is not None else {})
    except RecursionError:  # a crafted structure, or a caller deep in its own stack already
        raise CheckpointError(f"{root}: the tree structure is nested too deeply to read here (Python's recursion "
                              f"limit, {sys.getrecursionlimit()}, is reached; sofx writes at most {MAX_NESTING} "
                              "containers deep)") from None


def _corrupt(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"corrupted checkpoint structure at {path}: {what}")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    if _is_namedtuple(x) or _is_numpy_scalar(x):  # (numpy's bool_ is named "bool": named by its module too)
        return _article(f"{type(x).__module__}.{type(x).__qualname__}")
    return _article(type(x).__name__)


def _is_numpy_scalar(x: Any) -> bool:
    """Whether ``x`` is a numpy bool or real number, which :func:`encode` stores as the Python number of its
    value."""
    return type(x).__module__ == "numpy" and isinstance(x, (numbers.Real, _NumpyBool))


_KIND_OF_SAVED = {"tensor": "a tensor", "none": "None", "bool": "a bool", "int": "an int", "float": "a float",
                  "str": "a str", "dtype": "a torch.dtype", "list": "a list", "tuple": "a tuple", "dict": "a dict",
                  "odict": "an OrderedDict", "counter": "a Counter", "namedtuple": "a NamedTuple"}
_DICT_KINDS = ("dict", "odict", "counter")  # each matches a template of the others (the file's kind comes back)


def _like_kind(x: Any) -> str | None:
    if isinstance(x, torch.Tensor):
        return "tensor"
    if x is None:
        return "none"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, float):
        return "float"
    if isinstance(x, str):
        return "str"
    if isinstance(x, torch.dtype):
        return "dtype"
    if _is_numpy_scalar(x):  # stored as the Python number of its value: a template of the tree saved is one
        return "bool" if isinstance(x, _NumpyBool) else "int" if isinstance(x, numbers.Integral) else "float"
    if _is_namedtuple(x):
        return "namedtuple"
    if isinstance(x, list):
        return "list"
    if isinstance(x, collections.OrderedDict):
        return "odict"
    if isinstance(x, collections.Counter):
        return "counter"
    if isinstance(x, dict):
        return "dict"
    if isinstance(x, tuple):
        return "tuple"
    return None


def _decode(node: Any, like: Any, path: str, load_tensor: Callable[[dict, str, Any], Any],
            types: Mapping[str, type]) -> Any:
    if not isinstance(node, dict) or not isinstance(node.get("k"), str):
        raise _corrupt(path, f"expected a node object, got {str(node)[:80]!r}")
    kind = node["k"]
    if kind not in _KIND_OF_SAVED:
        raise _corrupt(path, f"unknown node kind {kind[:40]!r}")
    has_like = like is not _NO_LIKE
    if has_like:
        want = _like_kind(like)
        same = want == kind or (want in _DICT_KINDS and kind in _DICT_KINDS)
        if not same:
            raise CheckpointMismatchError(f"{path}: the checkpoint holds {_KIND_OF_SAVED.get(kind, kind)}, "
                                          f"the template has {_describe(like)}")
    if kind == "tensor":
        return _decode_tensor(node, like if has_like else None, path, load_tensor)
    if kind in _SCALAR_KINDS:
        return _decode_scalar(node, kind, path)
    items = node.get("items")
    if not isinstance(items, list):
        raise _corrupt(path, f"a {kind} node without items")
    if kind in ("list", "tuple"):
        if has_like and len(like) != len(items):
            raise CheckpointMismatchError(f"{path}: the checkpoint holds a {kind} of length {len(items)}, "
                                          f"the template has length {len(like)}")
        values = [_decode(n, like[i] if has_like else _NO_LIKE, f"{path}[{i}]", load_tensor, types)
                  for i, n in enumerate(items)]
        return values if kind == "list" else tuple(values)
    if kind in _DICT_KINDS:
        return _decode_dict(node, kind, items, like, has_like, path, load_tensor, types)
    return _decode_namedtuple(node, items, like, has_like, path, load_tensor, types)


def _decode_scalar(node: dict, kind: str, path: str) -> Any:
    if kind == "none":
        return None
    v = node.get("v")
    if kind == "bool" and isinstance(v, bool):
        return v
    if kind == "int" and type(v) is int:
        return v
    if kind == "int" and v is None and isinstance(node.get("hex"), str):
        try:
            return int(node["hex"], 16)
        except ValueError:
            raise _corrupt(path, f"bad int {node['hex'][:80]!r}") from None
    if kind == "float" and v is None and type(node.get("bits")) is int and 0 <= node["bits"] < 2 ** 64:
        return struct.unpack("<d", struct.pack("<Q", node["bits"]))[0]
    if kind == "str" and isinstance(v, str):
        return v
    if kind == "float" and isinstance(v, str):
        try:
            return float.fromhex(v)
        except (ValueError, OverflowError):
            raise _corrupt(path, f"bad float {v!r}") from None
    if kind == "dtype":
        dtype = dtype_from_name(v)
        if dtype is not None:
            return dtype
    raise _corrupt(path, f"bad {kind} value {str(v)[:80]!r}")


def _decode_tensor(node: dict, like: Any, path: str, load_tensor: Callable[[dict, str, Any], Any]) -> Any:
    dtype = dtype_from_name(node.get("dtype"))
    shape = node.get("shape")
    if dtype is None:
        raise _corrupt(path, f"unknown tensor dtype {str(node.get('dtype'))[:40]!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _corrupt(path, f"bad tensor shape {str(shape)[:80]!r}")
    if not isinstance(node.get("key"), str):
        raise _corrupt(path, "a tensor node without a key")
    order = node.get("order", list(range(len(shape))))
    if not isinstance(order, list) or not all(type(d) is int for d in order) \
            or sorted(order) != list(range(len(shape))):
        raise _corrupt(path, f"bad tensor order {str(order)[:80]!r} (expected a permutation of the dimensions "
                             f"of shape {shape})")
    # (read by their truth, a damaged "yes" or 1 was taken; a file written before "parameter" existed has none)
    for mark in ("requires_grad", "parameter"):
        if mark in node and type(node[mark]) is not bool:
            raise _corrupt(path, f"bad tensor {mark} {node[mark]!r:.80} (expected true or false)")
    if isinstance(like, torch.nn.parameter.UninitializedTensorMixin):  # (torch's RuntimeError from its shape)
        raise CheckpointMismatchError(f"{path}: the template has an uninitialized parameter or buffer (a lazy "
                                      "module's, before its first forward), which has no shape to match; run a "
                                      "forward pass first, or load without like=")
    if like is not None:
        if tuple(like.shape) != tuple(shape):
            raise CheckpointMismatchError(f"{path}: the checkpoint holds shape {tuple(shape)}, "
                                          f"the template has shape {tuple(like.shape)}")
        if like.dtype != dtype:
            raise CheckpointMismatchError(f"{path}: the checkpoint holds dtype {dtype}, "
                                          f"the template has dtype {like.dtype}")
    return load_tensor(node, path, like)


def _decode_key(k: Any, path: str) -> str | int:
    if isinstance(k, list) and len(k) == 2 and ((k[0] == "s" and isinstance(k[1], str))
                                                or (k[0] == "i" and type(k[1]) is int)):
        return k[1]
    raise _corrupt(path, f"bad dict key {str(k)[:80]!r}")


def _decode_dict(node: dict, kind: str, items: list, like: Any, has_like: bool, path: str,
                 load_tensor: Callable[[dict, str, Any], Any], types: Mapping[str, type]) -> Any:
    raw_keys = node.get("keys")
    if not isinstance(raw_keys, list) or len(raw_keys) != len(items):
        raise _corrupt(path, "dict keys and items do not match")
    keys = [_decode_key(k, path) for k in raw_keys]
    if len(set(map(repr, keys))) != len(keys):
        raise _corrupt(path, "duplicate dict keys")
    saved = dict(zip(keys, items))
    order = keys
    if has_like:
        missing = [k for k in like if k not in saved]
        extra = [k for k in keys if k not in like]
        if missing or extra:
            raise CheckpointMismatchError(
                f"{path}: the dict keys differ from the template's: "
                + "; ".join(s for s in (f"missing from the checkpoint: {missing}" if missing else "",
                                        f"not in the template: {extra}" if extra else "") if s))
        _check_key_kinds(like, keys, path)
        if kind != "odict" or isinstance(like, collections.OrderedDict):
            # (a saved OrderedDict's order is its leaf order: a template of another dict type, which matches it
            # key by key, does not reorder it)
            order = list(like.keys())
    values = [(k, _decode(saved[k], like[k] if has_like else _NO_LIKE, f"{path}[{k!r}]", load_tensor, types))
              for k in order]
    if kind == "dict":
        return dict(values)
    if kind == "counter":
        return collections.Counter(dict(values))  # (from a mapping: the values as they are, in order)
    out = collections.OrderedDict(values)
    if "metadata" in node:
        meta = _decode(node["metadata"], _NO_LIKE, f"{path}._metadata", load_tensor, types)
        if not isinstance(meta, dict):
            raise _corrupt(path, "the OrderedDict's _metadata is not a dict")
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def _check_key_kinds(like: Mapping[Any, Any], keys: list[str | int], path: str) -> None:
    """Refuse a template key that is a saved int key only by Python's equality (``True == 1 == 1.0``): a bool, or a
    number that is no integer (a save refuses such keys; the loaded dict held the template's key, which no save
    writes). An integer of another type (numpy's, an ``IntEnum``) is the int it equals, as a numpy scalar template
    is the number it holds."""
    saved = {k: k for k in keys}
    for k in like:
        s = saved.get(k)
        if type(s) is int and (isinstance(k, (bool, _NumpyBool)) or not isinstance(k, numbers.Integral)):
            raise CheckpointMismatchError(f"{path}: the template's dict key {k!r} ({_describe(k)}) is the "
                                          f"checkpoint's key {s!r} (an int) only by Python's equality: a "
                                          "checkpoint's keys are str or int, the template's must be of their kind")


def _decode_namedtuple(node: dict, items: list, like: Any, has_like: bool, path: str,
                       load_tensor: Callable[[dict, str, Any], Any], types: Mapping[str, type]) -> Any:
    name, fields = node.get("type"), node.get("fields")
    if not isinstance(name, str) or not isinstance(fields, list) or len(fields) != len(items) \
            or not all(isinstance(f, str) for f in fields):
        raise _corrupt(path, "a NamedTuple node without a type name or with fields not matching its items")
    if has_like:
        cls = type(like)
        if type_name(cls) != name:
            raise CheckpointMismatchError(f"{path}: the checkpoint holds a {name}, the template has a {type_name(cls)}")
    else:
        cls = types.get(name)
        if cls is None:
            raise CheckpointError(f"{path}: the checkpoint holds a NamedTuple of type {name!r}, which is not a sofx "
                                  "type; pass the class in types=[...] (or a template with like=) to allow it "
                                  "(checkpoints never import names found in a file)")
    if list(cls._fields) != fields:
        err = CheckpointMismatchError if has_like else CheckpointError
        raise err(f"{path}: the checkpoint's {name} has fields {fields}, the class has {list(cls._fields)}")
    values = [_decode(n, like[i] if has_like else _NO_LIKE, f"{path}.{f}", load_tensor, types)
              for i, (f, n) in enumerate(zip(fields, items))]
    return cls(*values)

