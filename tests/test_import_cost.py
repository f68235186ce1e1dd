"""What importing sofx costs: not ``torch._dynamo`` (with sympy and triton about 1.5 s of a core, where ``import
torch`` is about 1.2 s), which ``import torch`` does not import either.

Each check runs in a fresh Python process: the test process has long imported dynamo. The offload process
executor's worker (``sofx.offload.process_worker``) is one such process, started by every optimizer
that runs on it. Dynamo is imported where something is compiled, or where a method that runs eagerly under
``torch.compile`` is first called: constructing a ``SpeculativeAdamW`` imports it, as constructing any
``torch.optim`` optimizer does (``Optimizer.__init__`` calls ``add_param_group``, which torch disables the same
lazy way).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import sofx

from helpers import script_prints_ok

_NO_DYNAMO = """
import sys
{imports}
assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
print("ok")
"""


@pytest.mark.parametrize("imports", [
    "import sofx",
    "import sofx.offload.process_worker",
    "import sofx.offload; sofx.offload.SpeculativeAdamW, sofx.offload.OffloadEngine",
    "from sofx.offload import SpeculativeAdam, SpeculativeAdamW",
])
def test_importing_sofx_does_not_import_dynamo(imports: str) -> None:
    script_prints_ok(_NO_DYNAMO.format(imports=imports), timeout=120)


_LEFT_UNIMPORTED = """
import sys
{imports}
loaded = sorted(m for m in {modules} if m in sys.modules)
assert not loaded, loaded
print("ok")
"""


@pytest.mark.parametrize("imports, modules", [
    # the worker: the block math and shared memory, not the engine, the facade, checkpoints or collectives
    ("import sofx.offload.process_worker",
     ["sofx.offload.engine", "sofx.offload.facade", "sofx.offload.grad_hooks", "sofx.checkpoint",
      "sofx.distributed"]),
    ("import sofx", ["sofx.offload.engine", "sofx.offload.facade", "sofx.checkpoint", "sofx.distributed"]),
])
def test_a_subpackage_is_imported_where_first_used(imports: str, modules: list[str]) -> None:
    script_prints_ok(_LEFT_UNIMPORTED.format(imports=imports, modules=modules), timeout=120)


_NAMES_REACHABLE = """
import sofx
import sofx.offload.engine, sofx.offload.executor, sofx.offload.facade
offload = sofx.offload
for name in offload.__all__:
    home = {"SpeculativeAdamW": offload.facade, "SpeculativeAdam": offload.facade,
            "resolve_loss_scale": offload.facade, "ExecutorError": offload.executor,
            "ExecutorTimeout": offload.executor, "WorkerDiedError": offload.executor}.get(name, offload.engine)
    assert getattr(offload, name) is getattr(home, name), name
assert set(offload.__all__) <= set(dir(offload)) and set(sofx.__all__) <= set(dir(sofx))
star = {}
exec("from sofx.offload import *", star)
assert set(offload.__all__) <= set(star), sorted(set(offload.__all__) - set(star))
for missing in (offload, sofx):
    try:
        missing.no_such_name
    except AttributeError as e:
        assert missing.__name__ in str(e) and "no_such_name" in str(e), str(e)
    else:
        raise AssertionError("no AttributeError")
    # a name that is no identifier is no submodule (hasattr raised ModuleNotFoundError for "a.b")
    assert not hasattr(missing, "a.b") and not hasattr(missing, "engine.OffloadEngine"), missing
print("ok")
"""

_SUBMODULES_REACHABLE = """
import sofx
assert sofx.offload.engine.OffloadEngine.__module__ == "sofx.offload.engine"
assert sofx.offload.shared_memory.DEFAULT_SHM_DIR
assert callable(sofx.checkpoint.save) and callable(sofx.distributed.all_reduce_sumsq)
from sofx.offload import SpeculativeAdamW
assert SpeculativeAdamW is sofx.offload.facade.SpeculativeAdamW
print("ok")
"""


def test_the_public_names_of_sofx_offload_are_the_modules_own() -> None:
    """``sofx.offload.X``, ``from sofx.offload import X`` and ``import *`` give the defining module's object;
    ``dir()`` lists them; an unknown name is an ``AttributeError`` naming the module and the name."""
    script_prints_ok(_NAMES_REACHABLE, timeout=120)


def test_after_import_sofx_its_subpackages_and_their_modules_are_attributes() -> None:
    """``import sofx`` then ``sofx.offload.engine.OffloadEngine``, ``sofx.checkpoint.save``: reached as
    attributes, imported where first reached."""
    script_prints_ok(_SUBMODULES_REACHABLE, timeout=120)


# DESIGN.md "Layers (dependencies point downward only)": what the modules of a layer must not import, by module
# prefix. ``sofx.checkpoint`` and ``sofx.distributed`` import ``sofx.adam`` (the torch.optim / ZeRO-3 interop and
# the ranks' hparams need it), but never the speculation layer or the offload runtime.
_HIGHER = ("sofx.speculate", "sofx.speculation", "sofx.offload")
_NOT_IMPORTED_BY = {
    "sofx.kernels": ("sofx.tree", "sofx.adam", "sofx.undo_record", "sofx.transforms", "sofx.loss_scale",
                     "sofx.schedules", "sofx.serial", "sofx.checkpoint", "sofx.distributed", *_HIGHER),
    "sofx.tree": ("sofx.adam", "sofx.transforms", "sofx.loss_scale", "sofx.schedules", "sofx.serial", *_HIGHER),
    "sofx.adam": ("sofx.transforms", "sofx.loss_scale", "sofx.schedules", "sofx.serial", "sofx.apply_if_finite",
                  "sofx.checkpoint", "sofx.distributed", *_HIGHER),
    "sofx.undo_record": ("sofx.adam", "sofx.transforms", "sofx.serial", *_HIGHER),
    "sofx.transforms": _HIGHER,
    "sofx.loss_scale": _HIGHER,
    "sofx.schedules": _HIGHER,
    "sofx.serial": _HIGHER,
    "sofx.speculate": ("sofx.offload",),
    "sofx.speculation": ("sofx.offload",),
    "sofx.checkpoint": _HIGHER,
    "sofx.distributed": _HIGHER,
}


def _imported_modules(path: pathlib.Path, module: str) -> set[str]:
    """Every module an ``import`` statement of ``path`` (module ``module``) names, function bodies included
    (relative imports resolved; ``from a import b`` counts as ``a`` and ``a.b``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_layers_import_downward_only() -> None:
    """No module of a layer imports a module of a layer above it (DESIGN.md's layer diagram)."""
    root = pathlib.Path(sofx.__file__).parent
    wrong = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for layer, forbidden in _NOT_IMPORTED_BY.items():
            if _is_under(module, layer):
                wrong += [f"{module} imports {name}" for name in sorted(_imported_modules(path, module))
                          if any(_is_under(name, f) for f in forbidden)]
    assert not wrong, wrong
