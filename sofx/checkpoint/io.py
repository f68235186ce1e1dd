"""One checkpoint file: safetensors for the tensors, JSON in its header for everything else.

The file is a standard safetensors file (any safetensors reader can list and
read its tensors). Its header's ``__metadata__`` holds::

    "format": "sofx.checkpoint"      "format_version": "1" (or "2", below)
    "writer": "sofx 0.1.0"           "tree": <the JSON structure of sofx.checkpoint.codec>
    "tree_crc32": "123"              (the CRC-32 of the "tree" text, in decimal)

sofx writes the file itself (the format is 8 bytes of header length, the
JSON header, then each tensor's bytes), into its own temporary from the first
byte: safetensors' ``serialize_file`` (0.8) writes through a temporary of its
own, which a save killed meanwhile left unnamed beside the checkpoint. It is
read with safetensors.

Each tensor node of the structure records the tensor's dtype, shape and the
CRC-32 of its bytes, checked on load; the structure itself (its Python
numbers: a step count, a loss scale; its dict keys) is checked against
``tree_crc32`` (a file without one, an older sofx's, is read unchecked).
Older readers ignore the key. Writing is atomic
(:mod:`sofx.checkpoint.atomic`) and zero-copy for contiguous CPU tensors;
tensors that share storage (views of one flat buffer) are simply written
once each. Nothing is ever unpickled.

A tensor of a dense layout that is not contiguous (a channels_last
convolution weight and its moments, a transposed matrix:
:mod:`sofx.kernels.layout`) is written as its memory, in memory order, also
without a copy: the file's array is ``t.permute(order)`` (contiguous; a
channels_last weight is an NHWC array to other safetensors readers), and its
node records ``"order"``. It loads back as ``array.permute(inverse)``: the
saved shape and strides (of the dimensions of more than one element), so a
resumed run's moments keep their parameters' layout and the kernels step
them over memory. A tensor with gaps (a strided slice, an expanded one) is
written as a contiguous copy and loads contiguous.

A file with orders is format version 2: a reader that does not know orders
(sofx before them reads version 1 only) refuses it rather than take the
array for the tensor (a square matrix's transpose, or a channels_last
``(C_out, 3, 3, 3)`` weight, has the array's shape). A file without orders
is version 1, as before; this sofx reads both.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import struct
import sys
import zlib
from types import ModuleType
from typing import Any, BinaryIO, Callable, Iterable, Mapping, NamedTuple

import torch

from sofx.checkpoint.atomic import atomic_write, check_destination, special_kind
from sofx.checkpoint.codec import EncodedTree, decode, dtype_name, encode, json_int, max_key_digits
from sofx.checkpoint.errors import (CheckpointError, CheckpointIOError, CheckpointMismatchError,
                                    CheckpointNotFoundError, CheckpointVersionError, CorruptCheckpointError,
                                    system_error)
from sofx.checkpoint.known_types import type_registry
from sofx.kernels.layout import dims_in_memory_order, is_dense
from sofx.tree import article

__all__ = ["FORMAT", "FORMAT_VERSION", "prepare", "snapshot", "check_writable", "check_header", "write", "read",
           "read_metadata", "nbytes", "structure_checksum"]

FORMAT = "sofx.checkpoint"
FORMAT_VERSION = 2  # the newest format, read and written: version 1 and tensor nodes with an "order"
_FIRST_VERSION = 1  # what a file without orders says (every sofx reads it)


def _check_byteorder() -> None:
    if sys.byteorder != "little":  # safetensors stores little-endian bytes; we write memory as it is
        raise CheckpointError("sofx checkpoints are only supported on little-endian machines")


def _as_cpu_contiguous(t: torch.Tensor, copy: bool) -> torch.Tensor:
    if t.device.type != "cpu":
        return t.to("cpu", memory_format=torch.contiguous_format)  # always a copy
    if copy:
        return t.clone(memory_format=torch.contiguous_format)
    return t if t.is_contiguous() else t.contiguous()


def _stored(t: torch.Tensor, copy: bool) -> tuple[torch.Tensor, list[int] | None]:
    """What a file holds of ``t``, CPU and contiguous, and the order of ``t``'s dimensions it holds them in
    (``None``: ``t``'s own). A dense layout that is not contiguous (a channels_last weight, a transposed matrix)
    is kept as its memory in memory order: ``t.permute(order)``, a view (``copy``: a copy of it; on another
    device: moved); other tensors as ``t.contiguous()`` (``t`` itself where it is a contiguous CPU tensor and
    ``copy`` is false)."""
    # a conjugate or negative view's memory holds the values before the lazy op: resolve it (a copy)
    t = t.detach().resolve_conj().resolve_neg()
    order = None
    if not t.is_contiguous() and is_dense(t):
        order = dims_in_memory_order(t)
        t = t.permute(order)
    return _as_cpu_contiguous(t, copy), order


def _store(encoded: EncodedTree, copy: bool) -> EncodedTree:
    """``encoded`` with the tensors a file holds (:func:`_stored`); a tensor node gets ``"order"`` where its
    tensor is held in another order of its dimensions."""
    for key, t in list(encoded.tensors.items()):
        encoded.tensors[key], order = _stored(t, copy)
        if order is not None:
            encoded.nodes[key]["order"] = order
    return encoded


def prepare(tree: Any) -> EncodedTree:
    """Encode ``tree``; its tensors are CPU and contiguous (a dense layout in memory order), copied only where
    they were not."""
    return _store(encode(tree), copy=False)


def snapshot(tree: Any, path: str | os.PathLike | None = None) -> EncodedTree:
    """Encode ``tree`` with a private copy of every tensor (for a save that finishes later; ``path``: the file it
    is for, where a tree whose header is surely too large is refused before anything is copied:
    :func:`check_header`)."""
    encoded = encode(tree)
    if path is not None:
        check_header(path, encoded)
    return _store(encoded, copy=True)


def _safetensors() -> ModuleType:
    """The safetensors package (an optional dependency: ``pip install sofx[checkpoint]``)."""
    try:
        import safetensors
    except ImportError as exc:
        raise CheckpointError("sofx.checkpoint.save/load need the safetensors package: "
                              "pip install 'sofx[checkpoint]' (or safetensors)") from exc
    return safetensors


# The safetensors format's dtype codes by the checkpoint's dtype names, in the order its writer lays tensors out
# (the widest elements first, so that every tensor starts at a multiple of its element size).
_FILE_DTYPES = {"uint64": "U64", "int64": "I64", "float64": "F64", "complex64": "C64", "float32": "F32",
                "uint32": "U32", "int32": "I32", "bfloat16": "BF16", "float16": "F16", "uint16": "U16",
                "int16": "I16", "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e4m3fnuz": "F8_E4M3FNUZ",
                "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_FILE_ORDER = {name: rank for rank, name in enumerate(_FILE_DTYPES)}
_ALIGNMENT = 8  # the header is padded with spaces so that the data starts at a multiple of this
_MAX_HEADER_BYTES = 100_000_000  # the largest header safetensors reads (and its writer wrote)


class FileTensor(NamedTuple):
    """One tensor of a file to write: its dtype name (:func:`~sofx.checkpoint.codec.dtype_name`), shape and
    bytes (a view of its memory, valid while the tensor lives)."""

    dtype: str
    shape: list[int]
    data: memoryview


def _file_header(specs: dict[str, FileTensor], metadata: dict[str, str],
                 path: str | os.PathLike | None = None) -> tuple[bytes, list[str]]:
    """The header of a safetensors file of ``specs`` (JSON, padded with spaces to a multiple of
    :data:`_ALIGNMENT` bytes, as safetensors pads it) and the order of the tensors' bytes after it: safetensors'
    own (by dtype, widest first, then by name). A header larger than safetensors reads is a
    :class:`CheckpointError` (naming ``path``, the file to be saved)."""
    return _header_of({key: (spec.dtype, spec.shape, len(spec.data)) for key, spec in specs.items()}, metadata, path)


def _header_of(sizes: dict[str, tuple[str, list[int], int]], metadata: dict[str, str],
               path: str | os.PathLike | None) -> tuple[bytes, list[str]]:
    """:func:`_file_header` of tensors given as ``{key: (dtype name, shape, bytes)}``."""
    order = sorted(sizes, key=lambda k: (_FILE_ORDER[sizes[k][0]], k))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key in order:
        dtype, shape, size = sizes[key]
        header[key] = {"dtype": _FILE_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % _ALIGNMENT)
    if len(text) > _MAX_HEADER_BYTES:
        where = f"cannot save {os.fspath(path)}: " if path is not None else ""
        raise CheckpointError(f"{where}the checkpoint needs a header of {len(text)} bytes (its tree structure and "
                              f"tensor names), and safetensors reads one of at most {_MAX_HEADER_BYTES}: store "
                              "large data (long strings, many Python numbers) as tensors")
    return text, order


def serialize_file(specs: dict[str, FileTensor], filename: str, metadata: dict[str, str],
                   header: tuple[bytes, list[str]] | None = None) -> None:
    """Write a safetensors file of ``specs`` to ``filename`` (created, or truncated), directly and without
    copying the tensors' bytes: 8 bytes of header length (little-endian), the header, then each tensor's bytes
    (``header``: :func:`_file_header` of ``specs`` and ``metadata``, where the caller made it already)."""
    header, order = header if header is not None else _file_header(specs, metadata)
    with open(filename, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for key in order:
            f.write(specs[key].data)


def _bytes_view(t: torch.Tensor) -> tuple[int, memoryview]:
    """Address and bytes of a contiguous CPU tensor's data (no copy; valid while ``t`` lives)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return 0, memoryview(b"")
    return t.data_ptr(), memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def nbytes(encoded: EncodedTree) -> int:
    """Bytes of tensor data in ``encoded``."""
    return sum(t.numel() * t.element_size() for t in encoded.tensors.values())


def check_writable(path: str | os.PathLike) -> str:
    """The absolute ``path``, after the checks :func:`write` makes before writing (the machine's byte order,
    the safetensors package, the destination's directory): a save that will finish later refuses now."""
    _check_byteorder()
    _safetensors()
    return check_destination(path)


def write(path: str | os.PathLike, encoded: EncodedTree) -> str:
    """Write ``encoded`` (from :func:`prepare` or :func:`snapshot`) atomically to ``path``."""
    _check_byteorder()
    _safetensors()  # (what reads the file back)
    specs, views = {}, []
    for key, t in encoded.tensors.items():
        _, data = _bytes_view(t)
        views.append(t)  # keep the buffers alive while they are written
        encoded.nodes[key]["crc32"] = zlib.crc32(data)
        specs[key] = FileTensor(dtype_name(t.dtype), list(t.shape), data)
    metadata = _metadata(encoded, path)
    header = _file_header(specs, metadata, path)  # one safetensors would not read is refused before any writing

    def _write(tmp: str) -> None:
        serialize_file(specs, tmp, metadata=metadata, header=header)

    try:
        return atomic_write(path, _write)
    finally:
        del views


def _metadata(encoded: EncodedTree, path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a file of ``encoded``."""
    import sofx

    structure = _structure_json(encoded, path)
    return {"format": FORMAT, "format_version": str(_version_needed(encoded)),
            "writer": f"sofx {getattr(sofx, '__version__', '?')}", "tree": structure,
            "tree_crc32": structure_checksum(structure)}


def check_header(path: str | os.PathLike, encoded: EncodedTree) -> None:
    """Refuse now, as :func:`write` would later, a tree whose file header is larger than safetensors reads
    (:class:`CheckpointError`): ``encoded`` from :func:`~sofx.checkpoint.codec.encode`, before its tensors are
    copied or checksummed. The header is measured without the tensors' CRC-32s and dimension orders, which only
    lengthen it: a tree refused here is refused by :func:`write`, and :func:`write` checks the rest."""
    sizes = {key: (dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size())
             for key, t in encoded.tensors.items()}
    _header_of(sizes, _metadata(encoded, path), path)


def _version_needed(encoded: EncodedTree) -> int:
    """The format version of a file of ``encoded``: :data:`FORMAT_VERSION` where a tensor is held in another
    order of its dimensions (a reader must know orders), else the first (what every sofx reads)."""
    return FORMAT_VERSION if any("order" in node for node in encoded.nodes.values()) else _FIRST_VERSION


def _structure_json(encoded: EncodedTree, path: str | os.PathLike) -> str:
    """The JSON text of ``encoded``'s structure. Its int dict keys were checked against the process's limit on
    decimal digits when it was encoded; a save that finishes later (``save_async``) may find the limit lowered
    since: that is a CheckpointError too, not Python's bare ``ValueError``."""
    try:
        return json.dumps(encoded.structure, separators=(",", ":"), allow_nan=False)
    except ValueError:
        limit = max_key_digits()
        raise CheckpointError(f"{os.fspath(path)}: the tree holds an int dict key of more than {limit} decimal "
                              "digits, which this process no longer writes (sys.get_int_max_str_digits() was "
                              "lowered after the tree was encoded)") from None


def structure_checksum(text: str) -> str:
    """What the header's ``tree_crc32`` holds for the structure ``text``: its UTF-8 bytes' CRC-32, in decimal."""
    return str(zlib.crc32(text.encode("utf-8")))


def _check_structure(meta: dict, text: str, path: str) -> None:
    """A :class:`CorruptCheckpointError` where the header records a checksum of the structure that ``text`` does
    not have: a byte of it changed since it was written (a Python number, a dict key: nothing else would
    notice)."""
    recorded = meta.get("tree_crc32")
    if recorded is not None and recorded != structure_checksum(text):
        raise CorruptCheckpointError(f"{path}: the tree structure in the header fails its checksum (recorded "
                                     f"{str(recorded)[:40]!r}, computed {structure_checksum(text)!r}): the header "
                                     "is corrupted")


def _read_error(path: str, exc: OSError) -> CheckpointIOError:
    """The :class:`CheckpointIOError` of a checkpoint the system does not let this process read, with its number."""
    return system_error(f"cannot read checkpoint {path}: {exc}", exc.errno)


def _open_held(path: str) -> BinaryIO:
    """``path`` opened for reading, held while safetensors opens it (:func:`_open`): safetensors reports every
    failure to open a file as "No such file or directory", whatever the system said (no read permission, a socket);
    this says what it was. A file that is not a regular one is refused: a FIFO's open (without ``O_NONBLOCK``)
    blocked for ever waiting for a writer, and a checkpoint is read mapped from a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist") from None
    except IsADirectoryError:  # (Windows)
        raise CheckpointError(f"checkpoint {path} is a directory, expected a file written by sofx.checkpoint.save") \
            from None
    except OSError as exc:
        raise _read_error(path, exc) from exc
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise CheckpointError(f"checkpoint {path} is a directory, expected a file written by sofx.checkpoint.save")
        kind = special_kind(mode)
        if kind is not None:
            raise CheckpointError(f"checkpoint {path} is {kind}, not a regular file; a checkpoint is read from a "
                                  "file written by sofx.checkpoint.save")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# torch.save's legacy format: a protocol-2 pickle whose first value is torch.serialization.MAGIC_NUMBER
_TORCH_LEGACY_HEAD = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _torch_save_kind(held: BinaryIO) -> str | None:
    """What ``torch.save`` wrote in the open file ``held`` by its first bytes ("a zip archive", or "a pickle" in its
    legacy format), or ``None``: a file safetensors refused is named so (its bytes are not unpickled)."""
    try:
        held.seek(0)
        head = held.read(len(_TORCH_LEGACY_HEAD))
    except OSError:
        return None
    if head[:4] == b"PK\x03\x04":
        return "a zip archive"
    return "a pickle" if head == _TORCH_LEGACY_HEAD else None


def _still_named(held: BinaryIO, path: str) -> bool:
    """Whether ``path`` still names the open file ``held`` (not a file a save has renamed over it since)."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    then = os.fstat(held.fileno())
    return (now.st_dev, now.st_ino) == (then.st_dev, then.st_ino)


_OPEN_TRIES = 5  # opens of a file that a save replaced meanwhile, before a load gives up


def _open(path: str) -> Any:
    """``safetensors.safe_open`` of ``path``, of one whole file. safetensors opens the file twice by its name (the
    header, then the data, through torch's ``UntypedStorage.from_file``): a save committed in between (another
    process saving every step) gave the old header with the new data (a spurious checksum failure; with
    ``verify=False``, the old structure holding the new tensors). The file opened first is held meanwhile (its
    inode cannot be reused), and where ``path`` no longer names it afterwards, the open is made again."""
    st = _safetensors()
    for _ in range(_OPEN_TRIES):
        with _open_held(path) as held:
            try:
                f = st.safe_open(path, framework="pt", device="cpu")
            except st.SafetensorError as exc:
                if not _still_named(held, path):
                    continue  # (replaced meanwhile: its header and size may be two files')
                kind = _torch_save_kind(held)
                if kind is not None:
                    raise CorruptCheckpointError(f"{path} is not a sofx checkpoint: it is {kind}, as torch.save "
                                                 "writes; read it with torch.load") from None
                size = os.fstat(held.fileno()).st_size
                raise CorruptCheckpointError(f"{path} is not a readable checkpoint ({size} bytes): {exc}; the file "
                                             "is truncated, corrupted, or not a sofx checkpoint") from None
            except OSError as exc:
                raise _read_error(path, exc) from exc
            if _still_named(held, path):
                return f
            f.__exit__(None, None, None)
    raise CheckpointError(f"cannot read checkpoint {path}: it was replaced each of the {_OPEN_TRIES} times it was "
                          "opened (saves to it committing meanwhile); try again")


def _header(f: Any, path: str, verify: bool = True) -> dict:
    """The checked sofx metadata of an open file: ``{"version": int, "tree": <structure>}`` (``verify``: its
    structure checked against its checksum, where the file records one)."""
    meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path} is a safetensors file but not a sofx checkpoint (its metadata has "
                                     f"format={meta.get('format')!r}, expected {FORMAT!r})")
    raw_version = meta.get("format_version", "")
    try:
        version = int(raw_version)
    except ValueError:
        raise CorruptCheckpointError(f"{path}: bad format_version {raw_version[:40]!r}") from None
    if not _FIRST_VERSION <= version <= FORMAT_VERSION:
        newer = "a newer" if version > FORMAT_VERSION else "an older, unsupported"
        raise CheckpointVersionError(f"{path} was written in {newer} checkpoint format (version {version}, by "
                                     f"{meta.get('writer', 'an unknown writer')}); this sofx reads versions "
                                     f"{_FIRST_VERSION} to {FORMAT_VERSION}")
    text = meta.get("tree", "")
    if verify:
        _check_structure(meta, text, path)
    try:
        structure = json.loads(text)
    except ValueError as exc:
        _check_key_digits(text, path)
        raise CorruptCheckpointError(f"{path}: the tree structure in the header is not valid JSON ({exc})") from None
    except RecursionError:  # a crafted or damaged header: "[[[[..."
        raise CorruptCheckpointError(f"{path}: the tree structure in the header is nested too deeply to "
                                     "read") from None
    return {"version": version, "writer": meta.get("writer"), "tree": structure}


def _check_key_digits(text: str, path: str) -> None:
    """After ``json.loads(text)`` failed: a :class:`CheckpointError` where the reason is an int (a dict key) of
    more decimal digits than this process reads, not a damaged file. (Parsed again, rather than with
    :func:`~sofx.checkpoint.codec.json_int` the first time: a header holds many ints, and the hook costs a
    Python call for each.)"""
    try:
        json.loads(text, parse_int=json_int)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except (ValueError, RecursionError):
        pass


def read_metadata(path: str | os.PathLike) -> dict:
    """The format version, writer and JSON tree structure of a checkpoint, without reading tensors."""
    path = os.fspath(path)
    with _open(path) as f:
        return _header(f, path)


def template_device(like_leaf: Any) -> torch.device | None:
    """Where a template leaf puts its loaded tensor: its device, except a meta template (it has no storage,
    as a model built under ``torch.device("meta")``): the CPU, so the data is not dropped."""
    if not isinstance(like_leaf, torch.Tensor) or like_leaf.device.type == "meta":
        return None
    return like_leaf.device


def _unavailable(device: torch.device) -> str | None:
    """Why tensors cannot be placed on ``device`` in this process (``None``: they can). An accelerator torch has
    a module for (``torch.cuda``, ``torch.xpu``) is asked for its devices, without creating a context; another
    is tried with an empty tensor."""
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    if callable(getattr(module, "is_available", None)) and callable(getattr(module, "device_count", None)):
        count = module.device_count() if module.is_available() else 0
        if device.index is None and count == 0:
            return f"torch has no {device.type} device in this process"
        if device.index is not None and device.index >= count:
            return f"this process has {count} {device.type} device{'s' if count != 1 else ''}"
        return None
    try:
        torch.empty(0, device=device)
    except Exception as exc:  # noqa: BLE001 - torch's reason, whatever its type (AssertionError, RuntimeError)
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def load_device(device: Any) -> torch.device | None:
    """``device=`` of :func:`read` as a ``torch.device`` (``None``: none given), or a :class:`CheckpointError`
    naming the argument: not a device torch knows, or one this process cannot place tensors on."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise CheckpointError(f"load: device={device!r:.80} is not a device ({reason}); expected a torch.device "
                              "or a name such as 'cpu' or 'cuda:0'") from None
    reason = _unavailable(parsed)
    if reason is not None:
        raise CheckpointError(f"load: device={device!r:.80} is not available here: {reason}")
    return parsed


def _file_shape(node: dict) -> list[int]:
    """The shape of a tensor node's array in the file: its shape, in its ``"order"`` of dimensions if it has
    one (checked by :func:`sofx.checkpoint.codec.decode`: a permutation of its dimensions)."""
    shape = node["shape"]
    return [shape[d] for d in node["order"]] if "order" in node else shape


def _inverse(order: list[int]) -> list[int]:
    """The permutation that undoes ``t.permute(order)``: ``t.permute(order).permute(_inverse(order))`` is ``t``."""
    return sorted(range(len(order)), key=order.__getitem__)


def read(path: str | os.PathLike, like: Any = None, *, types: Iterable[type] | Mapping[str, type] | None = None,
         device: torch.device | str | None = None, verify: bool = True) -> Any:
    """Load the tree saved at ``path`` (see :func:`sofx.checkpoint.load`); ``like=None``: no template."""
    device = load_device(device)  # before the file is opened
    path = os.fspath(path)
    _check_byteorder()
    registry = type_registry(types)
    with _open(path) as f:
        header = _header(f, path, verify)
        structure = header["tree"]
        file_keys = set(f.keys())
        seen: set[str] = set()

        def check_node(node: dict, leaf_path: str, _like: Any) -> None:
            key = node["key"]
            if key not in file_keys:
                raise CorruptCheckpointError(f"{path}: tensor {leaf_path} is missing from the file")
            if key in seen:
                raise CorruptCheckpointError(f"{path}: tensor {key} is used twice in the structure")
            seen.add(key)
            if "order" in node and header["version"] < FORMAT_VERSION:
                raise CorruptCheckpointError(f"{path}: tensor {leaf_path} has an order of its dimensions in a file "
                                             f"of format version {header['version']}, which has none")
            crc = node.get("crc32")  # (compared with the data's: a "123" or 1.5 was data failing its checksum)
            if verify and "crc32" in node and not (type(crc) is int and 0 <= crc < 2 ** 32):
                raise CorruptCheckpointError(f"{path}: tensor {leaf_path} has a damaged crc32 field {crc!r:.40} "
                                             f"({article(type(crc).__name__)}), expected an integer 0 <= crc32 < "
                                             "2**32 (the CRC-32 of its data): the structure is corrupted")
            view = f.get_slice(key)
            shape = list(view.get_shape())
            if shape != _file_shape(node):
                order = f" (shape {node['shape']} in dimension order {node['order']})" if "order" in node else ""
                raise CorruptCheckpointError(f"{path}: tensor {leaf_path} has shape {shape} in the file, "
                                             f"{_file_shape(node)} in the structure{order}")

        # Pass 1: check the structure (and the template) before reading any tensor data.
        like_arg = {} if like is None else {"like": like}
        _decode_file(path, structure, check_node, registry, like_arg)
        extra = file_keys - seen
        if extra:
            raise CorruptCheckpointError(f"{path}: the file holds tensors the structure does not use: "
                                         f"{sorted(extra)[:5]}")

        def load_node(node: dict, leaf_path: str, like_leaf: Any) -> torch.Tensor:
            # A private copy: safetensors maps the file, and a file rewritten in place afterwards (cp, rsync
            # --inplace; sofx's own saves replace it) would change, or truncated kill, what was loaded.
            t = f.get_tensor(node["key"]).clone()
            if dtype_name(t.dtype) != node["dtype"]:
                raise CorruptCheckpointError(f"{path}: tensor {leaf_path} has dtype {t.dtype} in the file, "
                                             f"{node['dtype']} in the structure")
            crc = node.get("crc32")
            if verify and crc is not None and zlib.crc32(_bytes_view(t)[1]) != crc:
                raise CorruptCheckpointError(f"{path}: tensor {leaf_path} fails its checksum: the data is corrupted")
            if "order" in node:
                t = t.permute(_inverse(node["order"]))  # its own dimensions, the strides it was saved with
            target = device if device is not None else template_device(like_leaf)
            if target is not None and target != t.device:
                t = t.to(target)
            if node.get("requires_grad") and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
            if node.get("parameter") is True:  # (saved from one: its kind comes back, as torch.load gives it)
                t = torch.nn.Parameter(t, requires_grad=t.requires_grad)
            return t

        return _decode_file(path, structure, load_node, registry, like_arg)


def _decode_file(path: str, structure: Any, load_tensor: Callable[[dict, str, Any], Any],
                 registry: Mapping[str, type], like_arg: dict) -> Any:
    """:func:`~sofx.checkpoint.codec.decode` of the structure of the file ``path``: its refusals (a malformed
    structure's :class:`CorruptCheckpointError`, a template's :class:`CheckpointMismatchError`, a NamedTuple type
    not allowed), which name the leaf path only, name the file too."""
    try:
        return decode(structure, load_tensor, types=registry, **like_arg)
    except CheckpointError as exc:
        if str(exc).startswith(path) or type(exc) not in _NAMED_BY_FILE:
            raise
        raise type(exc)(f"{path}: {exc}") from None


_NAMED_BY_FILE = (CorruptCheckpointError, CheckpointMismatchError, CheckpointError)  # (the exact types only)

