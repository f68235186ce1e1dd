"""Names of a package imported where first used: :func:`lazy_attribute`, a package's module ``__getattr__``
(PEP 562).

``import sofx`` imports the core; ``sofx.offload``, ``sofx.checkpoint`` and ``sofx.distributed``, and the offload
facade and engine, are imported at their first use (``sofx.offload.SpeculativeAdamW``, ``from sofx.offload import
SpeculativeAdamW``, ``import sofx.checkpoint``): a process that needs none of them (a process executor's worker,
which imports ``sofx.offload.process_worker``) does not pay for compiling and importing them. Nothing is cached
but by the import system: a name is looked up in its module, from ``sys.modules``, at each use (a few hundred
nanoseconds); ``from ... import`` and module-level aliases look it up once.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

__all__ = ["lazy_attribute"]


def lazy_attribute(package: str, homes: Mapping[str, str], name: str) -> Any:
    """Module ``__getattr__`` of ``package``: ``name`` from its home submodule (``homes``), else the submodule
    ``name`` itself (as a package's attribute once imported), imported now; ``AttributeError`` where neither
    exists (a name that is no identifier, ``"a.b"``, is no submodule: ``hasattr`` is False for it)."""
    home = homes.get(name)
    if home is not None:
        return getattr(importlib.import_module(f"{package}.{home}"), name)
    if not name.startswith("__") and name.isidentifier():
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
