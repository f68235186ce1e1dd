"""The NamedTuple classes a checkpoint may rebuild without being told: sofx's own.

Loading never imports a name found in a file. It rebuilds a NamedTuple only
from a class it was given: the template's (``like=``), one passed in
``types=``, or a NamedTuple class defined by sofx itself in one of the fixed
modules below (``sofx.adam.AdamState``, ``sofx.adam.AdamHParams``, ...). A
recorded name is looked up in that fixed list: a module is imported only if it
is one of them, and only a NamedTuple class defined there is accepted.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Iterable, Iterator, Mapping

from sofx.checkpoint.codec import _article, type_name
from sofx.checkpoint.errors import CheckpointError

__all__ = ["SOFX_MODULES", "sofx_type", "TypeRegistry", "type_registry"]

# sofx modules whose NamedTuples are state or configuration worth checkpointing.
SOFX_MODULES = ("sofx.adam", "sofx.kernels.base", "sofx.loss_scale", "sofx.schedules", "sofx.transforms",
                "sofx.apply_if_finite", "sofx.speculate", "sofx.speculation.policy", "sofx.serial",
                "sofx.offload.facade", "sofx.offload.engine")


def _is_namedtuple_class(cls: object) -> bool:
    return inspect.isclass(cls) and issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def sofx_type(name: str) -> type | None:
    """The sofx NamedTuple class recorded as ``name``, or ``None`` if sofx defines no such class."""
    for module_name in SOFX_MODULES:
        if not name.startswith(module_name + "."):
            continue
        qualname = name[len(module_name) + 1:]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        obj: object = module
        for part in qualname.split("."):
            obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
            if obj is None:
                break
        if _is_namedtuple_class(obj) and obj.__module__ == module_name and type_name(obj) == name:
            return obj  # type: ignore[return-value]
    return None


class TypeRegistry(Mapping[str, type]):
    """The caller's NamedTuple classes by recorded name, falling back to sofx's own."""

    def __init__(self, user: Mapping[str, type]) -> None:
        self._user = dict(user)

    def __getitem__(self, name: str) -> type:
        cls = self._user.get(name) or sofx_type(name)
        if cls is None:
            raise KeyError(name)
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(self._user)

    def __len__(self) -> int:
        return len(self._user)


def type_registry(types: Iterable[type] | Mapping[str, type] | None) -> TypeRegistry:
    """A registry of the user's types (NamedTuple classes, or a mapping name -> class) plus sofx's."""
    user: dict[str, type] = {}
    if types is None:
        return TypeRegistry(user)
    if _is_namedtuple_class(types):  # (iterated, Python's bare TypeError: 'type' object is not iterable)
        raise CheckpointError(f"types: expected NamedTuple classes or a mapping of names to them, got the class "
                              f"{type_name(types)}; pass a list of classes: types=[{types.__qualname__}]")
    if isinstance(types, Mapping):
        items = list(types.items())
    elif isinstance(types, (str, bytes)):  # (iterated: "types: 't' is not a NamedTuple class", of its letters)
        raise CheckpointError(f"types: expected NamedTuple classes (a list) or a mapping of names to them, got "
                              f"{_article(type(types).__name__)} {types!r:.80}")
    else:
        try:
            items = [(None, cls) for cls in types]
        except TypeError:
            raise CheckpointError(f"types: expected NamedTuple classes (a list) or a mapping of names to them, got "
                                  f"{_article(type(types).__name__)} {types!r:.80}") from None
    for name, cls in items:
        if name is not None and not isinstance(name, str):  # (looked up by recorded name: never found)
            raise CheckpointError(f"types: the mapping's key {name!r:.80} is not a str; its keys are the names "
                                  "classes are recorded under ('module.QualName'), or pass a list of classes")
        if not _is_namedtuple_class(cls):
            raise CheckpointError(f"types: {cls!r} is not a NamedTuple class")
        user[name if name is not None else type_name(cls)] = cls
    return TypeRegistry(user)
