"""Pytree helpers on top of optree.

sofx works on any pytree of tensors: dicts, lists, tuples, NamedTuples and
``None`` (an empty subtree in a params tree, a "no gradient" marker in a
grads tree). This module is the only place that knows how trees are walked:

* :func:`flatten` / :func:`unflatten` -- leaves in a fixed order plus a spec;
* :func:`leaf_paths` -- human readable paths (``params['layers'][3]['w']``)
  used in every error message;
* :func:`flatten_up_to` -- flatten a second tree (grads, states, hparams)
  against the structure of the first, with an error naming the first leaf
  path where the two differ;
* :func:`broadcast_prefix` -- expand a prefix tree (e.g. per-group hparams)
  to one value per leaf;
* :func:`pack` / :func:`unpack` -- lay leaves out in one flat buffer.
"""

from __future__ import annotations

import collections.abc
import functools
import itertools
import operator
from typing import Any, Callable, Mapping, Sequence

import optree
import torch

from sofx.errors import LeafError, StructureError
from sofx.kernels.base import vmapped
from sofx.kernels.donation import MemorySpans, unwritable
from sofx.kernels.storage import in_storage, refuse_short_storage

PyTree = Any
TreeSpec = optree.PyTreeSpec

__all__ = [
    "PyTree",
    "TreeSpec",
    "flatten",
    "leaves",
    "unflatten",
    "leaf_paths",
    "paths_index",
    "named_leaves",
    "key_text",
    "spec_text",
    "structure_difference",
    "leaf_order_by_key",
    "unwalked_hint",
    "flatten_up_to",
    "broadcast_prefix",
    "tree_map",
    "pack",
    "unpack",
    "numel_of",
    "uninitialized_refusal",
]


def flatten(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], TreeSpec]:
    """Leaves of ``tree`` (``None`` is an empty subtree) and its structure."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=is_leaf)
    return leaves, spec


def leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` (``None`` is an empty subtree) in :func:`flatten`'s order, without its structure: under
    ``torch.compile`` dynamo's stand-in for optree flattens a dict whose leaves are no tensors (``{}``,
    ``{"w": None}``) only so (its structure raised "DictMetaData" Unsupported)."""
    return optree.tree_leaves(tree)


def article(name: str) -> str:
    """``name`` after its indefinite article, for messages: ``a float``, ``an int``, ``an OrderedDict`` (by its first
    letter: "a int" was written)."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def unflatten(spec: TreeSpec, leaves: Sequence[Any]) -> PyTree:
    """Inverse of :func:`flatten` (``spec`` anything but a tree structure, or ``leaves`` no sequence -- an iterator
    is taken; a mapping, a set or a string, whose iteration is no list of the leaves in order, is not -- a
    ``TypeError`` naming it)."""
    _check_spec("unflatten", spec)
    # (Python's bare "'int' object is not iterable"; a dict's keys, a set's arbitrary order, a str's characters were
    # taken as the leaves without a word. A list, the common case in every update, is checked by its type alone)
    if type(leaves) is not list and (not isinstance(leaves, collections.abc.Iterable) or
                                     isinstance(leaves, (collections.abc.Mapping, collections.abc.Set, str, bytes))):
        n = spec.num_leaves
        raise TypeError(f"unflatten: leaves is {article(type(leaves).__name__)}, expected a sequence of {n} "
                        f"{'leaf' if n == 1 else 'leaves'}")
    return optree.tree_unflatten(spec, list(leaves))


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """``optree.tree_map`` with sofx's conventions (``None`` is an empty subtree).

    Each tree of ``rest`` is matched against ``tree``'s structure as :func:`flatten_up_to` matches it (anything,
    ``None`` included, where ``tree`` has a leaf; ``None`` for a subtree without leaves; a mapping key by key):
    one that departs is refused, a :class:`StructureError` naming the first place (from ``rest[k]``), before
    ``fn`` is called. An ``fn`` that is not callable is a ``TypeError`` naming it (Python's bare "'int' object is
    not callable" from inside optree; over a tree without leaves no word at all)."""
    if not callable(fn):
        swapped = " (the arguments swapped? tree_map(fn, tree))" if callable(tree) else ""
        raise TypeError(f"tree_map: fn is {article(type(fn).__name__)} ({fn!r:.80}), expected a callable{swapped}")
    if not rest:
        return optree.tree_map(fn, tree)
    leaves, spec = optree.tree_flatten(tree)
    others = [flatten_up_to(spec, other, f"rest[{k}]", "tree") for k, other in enumerate(rest)]
    return optree.tree_unflatten(spec, [fn(*xs) for xs in zip(leaves, *others)])


def leaf_paths(spec_or_tree: TreeSpec | PyTree, root: str = "params") -> list[str]:
    """Paths of the leaves, written as Python expressions rooted at ``root``.

    >>> leaf_paths({"layers": [{"w": 0}]})
    ["params['layers'][0]['w']"]

    A key is written as its ``repr``, except an int key too long for Python's decimal text (more digits than
    ``sys.get_int_max_str_digits()``), which is written in hex (``params[0x...]``): see :func:`key_text`.
    """
    spec = spec_or_tree if _is_treespec(spec_or_tree) else optree.tree_structure(spec_or_tree)
    if isinstance(spec, optree.PyTreeSpec):  # not torch.compile's stand-in
        try:
            paths, non_str_keys = _codified_paths(spec, root)
            if non_str_keys:
                paths = _codified_paths_of_key_texts(spec, root, _key_texts(spec))
            return list(paths)
        except TypeError:  # a custom node whose metadata cannot be hashed
            pass
    return [_codify(acc, root) for acc in spec.accessors()]


@functools.lru_cache(maxsize=1024)
def _codified_paths(spec: TreeSpec, root: str) -> tuple[tuple[str, ...], bool]:
    """:func:`leaf_paths` of a real optree spec, memoized: an update asks for the same structure's paths
    every step (to name leaves in errors), and building the accessors costs more than the rest of the
    checks of a small leaf. Also whether a mapping of ``spec`` has a key that is not a ``str``: specs compare
    their keys by ``==``, so that ``{1: x}``, ``{True: x}`` and ``{1.0: x}`` are one spec to this memo, each
    key written its own way (``params[True]``): such a spec's paths are memoized by its keys' texts as well
    (:func:`_codified_paths_of_key_texts`)."""
    if spec.is_leaf():
        return (root,), False
    accessors = spec.accessors()
    non_str_keys = any(isinstance(entry, optree.MappingEntry) and type(entry.entry) is not str
                           for acc in accessors for entry in acc)
    return tuple(_codify(acc, root) for acc in accessors), non_str_keys


@functools.lru_cache(maxsize=256)
def _codified_paths_of_key_texts(spec: TreeSpec, root: str, key_texts: tuple[str, ...]
                                 ) -> tuple[str, ...]:
    """:func:`leaf_paths` of a spec with a mapping key that is not a ``str``, memoized by ``spec`` and the
    texts of its leaves' keys (:func:`_key_texts`)."""
    return tuple(_codify(acc, root) for acc in spec.accessors())


def _key_texts(spec: TreeSpec) -> tuple[str, ...]:
    """The texts (:func:`key_text`) of the keys on the leaves' paths, one path after the other: equal keys are
    written otherwise where their types differ (``True`` and ``1``), and also where they do not (``(1, 'a')`` and
    ``(True, 'a')``, ``0.0`` and ``-0.0``); the spec fixes each path's length."""
    return tuple(map(key_text, itertools.chain.from_iterable(spec.paths())))


def _codify(accessor: optree.PyTreeAccessor, root: str) -> str:
    """``accessor.codify(root)``, except that a key written ``[repr(key)]`` is written by :func:`key_text`
    (for an int too long for decimal text, ``repr`` raises ``ValueError``)."""
    text = root
    for entry in accessor:
        if type(entry).codify is optree.GetItemEntry.codify:
            text = f"{text}[{key_text(entry.entry)}]"
        else:
            text = entry.codify(text)
    return text


def paths_index(paths: Sequence[str]) -> dict[str, list[int]]:
    """Each path of ``paths`` (:func:`leaf_paths`'s) with the indices of the leaves it is the path of (two where
    keys of equal ``repr`` give two leaves one path): :func:`named_leaves`' table, built once for many names.
    ``paths`` no sequence of str: a ``TypeError`` naming it (None: Python's bare "not iterable"; a str's characters
    were taken as the paths)."""
    if type(paths) is not list and (not isinstance(paths, Sequence) or isinstance(paths, (str, bytes))):
        raise TypeError(f"paths_index: paths is {article(type(paths).__name__)}, expected a sequence of str (the "
                        "leaf paths of sofx.tree.leaf_paths)")
    out: dict[str, list[int]] = {}
    for i, path in enumerate(paths):
        if type(path) is not str and not isinstance(path, str):
            raise TypeError(f"paths_index: paths[{i}] is {article(type(path).__name__)}, expected a str (a leaf path)")
        out.setdefault(path, []).append(i)
    return out


def named_leaves(by_path: Mapping[str, Sequence[int]], name: str) -> list[int]:
    """The indices (ascending) of the leaves that ``name`` names (``by_path``: :func:`paths_index` of the paths
    :func:`leaf_paths` writes, root ``params``): the leaf whose path ``name`` is, and the leaf at the top of a dict
    under the key ``name`` (``"w"`` names ``params['w']``). More than one where a key is written as another leaf's
    path, or two leaves have one path (the callers refuse that, asking for an index); none where ``name`` names no
    leaf. A lookup or two, not a pass over the leaves. ``by_path`` no mapping or ``name`` no str: a ``TypeError``
    naming it (a bare AttributeError, 'get')."""
    if type(by_path) is not dict and not isinstance(by_path, Mapping):
        raise TypeError(f"named_leaves: by_path is {article(type(by_path).__name__)}, expected a mapping of leaf "
                        "paths to leaf indices (sofx.tree.paths_index's)")
    if type(name) is not str and not isinstance(name, str):
        raise TypeError(f"named_leaves: name is {article(type(name).__name__)}, expected a str (a key or a leaf path)")
    return sorted({i for text in (name, f"params[{name!r}]") for i in by_path.get(text, ())})


def key_text(key: Any) -> str:
    """``repr(key)``, except for an int whose decimal text Python refuses (more digits than
    ``sys.get_int_max_str_digits()``, 4300 by default): its hex text (``0x...``), exact at any size and still a
    Python expression of the key."""
    try:
        return repr(key)
    except ValueError:
        if isinstance(key, int):
            return hex(key)
        raise


def _keys_text(keys: Sequence[Any]) -> str:
    """``repr(list(keys))``, with each key written by :func:`key_text`."""
    return "[" + ", ".join(key_text(k) for k in keys) + "]"


def spec_text(spec: TreeSpec) -> str:
    """``str(spec)`` for error messages or, where it has a key whose text Python refuses (see
    :func:`key_text`), a short description: the type of its root and its number of leaves."""
    try:
        return str(spec)
    except ValueError:
        n = spec.num_leaves
        return f"PyTreeSpec({article(spec.type.__name__)} of {n} {'leaf' if n == 1 else 'leaves'})"


def _is_treespec(x: Any) -> bool:
    """True for an optree spec, including the stand-in class torch.compile traces optree with."""
    return isinstance(x, optree.PyTreeSpec) or (torch.compiler.is_compiling() and type(x).__name__ == "PyTreeSpec")


def _check_spec(who: str, spec: Any) -> None:
    """``spec`` must be a tree structure (:func:`_is_treespec`: what :func:`flatten` returns), else a ``TypeError``
    naming ``who`` (a tree given in its place raised a bare AttributeError: 'dict' object has no attribute
    'unflatten')."""
    if not (isinstance(spec, optree.PyTreeSpec) or _is_treespec(spec)):
        raise TypeError(f"{who}: spec is {article(type(spec).__name__)}, expected a tree structure (the spec "
                        "sofx.tree.flatten(tree) returns with the leaves)")


def flatten_up_to(spec: TreeSpec, tree: PyTree, what: str = "tree", root: str = "params") -> list[Any]:
    """Flatten ``tree`` against ``spec``: one entry (a leaf or a subtree) per leaf of ``spec``.

    ``None`` where ``spec`` has a leaf is allowed and returned as ``None``
    (a missing gradient); ``None`` where ``spec`` has a subtree without leaves
    (``[]``, ``{}``: a module without parameters) is taken as that subtree (it
    has no entry to give). Raises :class:`StructureError` naming the first path
    where ``tree`` does not match (``spec`` anything but a tree structure: a ``TypeError`` naming it).
    """
    _check_spec("flatten_up_to", spec)
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError) as exc:
        error = exc
    filled = _empty_subtrees_filled(spec, tree)
    if filled is not tree:
        try:
            return spec.flatten_up_to(filled)
        except (ValueError, TypeError):
            pass
    raise StructureError(
        f"{what} does not have the structure of {root}: expected {spec_text(spec)}, "
        f"got {spec_text(optree.tree_structure(tree, none_is_leaf=True))} "
        f"({_first_difference(spec, tree, what)})"
    ) from error


def _empty_subtrees_filled(spec: TreeSpec, tree: PyTree) -> PyTree:
    """``tree`` with every ``None`` that stands where ``spec`` has a subtree without leaves replaced by that
    subtree; ``tree`` itself (the same object) where there is none, or where its containers depart from
    ``spec`` on the way to one (:func:`flatten_up_to` then names the difference)."""
    if spec.is_leaf():
        return tree
    if tree is None:
        return optree.tree_unflatten(spec, []) if spec.num_leaves == 0 else tree
    if optree.tree_is_leaf(tree, none_is_leaf=True):
        return tree
    children, metadata, entries, unflatten = optree.tree_flatten_one_level(tree, none_is_leaf=True)
    specs = _children_specs(spec, tree, entries)
    if specs is None:
        return tree
    filled = [_empty_subtrees_filled(s, c) for s, c in zip(specs, children)]
    if all(f is c for f, c in zip(filled, children)):
        return tree
    return unflatten(metadata, filled)


def _children_specs(spec: TreeSpec, node: Any, entries: Sequence[Any]) -> list[TreeSpec] | None:
    """The specs of ``node``'s children (its ``entries``, in its order) where ``node`` has ``spec``'s structure one
    level down: the same type and entries, or, as optree matches them, a mapping of another dict type (an
    ``OrderedDict`` over a ``dict``, in any key order) with the same keys; else ``None``."""
    want = list(spec.entries())
    if type(node) is spec.type and list(entries) == want:
        return list(spec.children())
    if _mappings_by_key(spec, node) and _same_keys(entries, want):
        by_key = dict(zip(want, spec.children()))
        return [by_key[k] for k in entries]
    return None


def _same_keys(entries: Sequence[Any], want: Sequence[Any]) -> bool:
    """Whether a mapping's ``entries`` are the keys ``want`` lists, in any order."""
    return len(entries) == len(want) and set(entries) == set(want)


def _mappings_by_key(spec: TreeSpec, node: Any) -> bool:
    """Whether optree matches ``node`` to ``spec`` key by key: both dicts (dict, OrderedDict, defaultdict)."""
    return isinstance(node, dict) and isinstance(spec.type, type) and issubclass(spec.type, dict)


def _first_difference(spec: TreeSpec, tree: PyTree, root: str, value: Callable[[Any], bool] | None = None,
                      spec_root: str = "params") -> str:
    """Describe the first place where ``tree`` departs from ``spec`` (paths from ``root``). ``value``: ``tree``
    is a prefix of ``spec`` whose values (``value(x)``, or any other leaf) stand for whole subtrees; where its
    containers depart, the message also names ``spec``'s place (from ``spec_root``)."""

    def walk(sub_spec: TreeSpec, sub: Any, path: str, full: str) -> str | None:
        as_full = ""
        if value is not None:
            if value(sub) or optree.tree_is_leaf(sub, none_is_leaf=True):
                return None
            if sub_spec.is_leaf():
                return f"{path} is {article(type(sub).__name__)} where {full} is a leaf"
            as_full = f" (as {full})"
        else:
            if sub_spec.is_leaf():
                return None  # anything (a tensor, None, a subtree) may stand at a leaf position
            if sub is None:
                return None if sub_spec.num_leaves == 0 else f"{path} is None, expected {spec_text(sub_spec)}"
            if optree.tree_is_leaf(sub, none_is_leaf=True):
                return f"{path} is {article(type(sub).__name__)}{unwalked_hint(sub)}, expected {spec_text(sub_spec)}"
        children, _, entries, _ = optree.tree_flatten_one_level(sub, none_is_leaf=True)
        if type(sub) is not sub_spec.type and not _mappings_by_key(sub_spec, sub):
            name = type(sub).__name__
            if name == sub_spec.type.__name__:  # ("grads is a NT, expected a NT")
                return (f"{path} is {article(name)}, another class than the {name} of {full} of the same name (defined "
                        "again? a notebook cell run twice or a reloaded module makes a new class: make both trees "
                        "with one)")
            return f"{path} is {article(name)}, expected {article(sub_spec.type.__name__)}{as_full}"
        want = list(sub_spec.entries())
        specs = _children_specs(sub_spec, sub, entries)
        if specs is None:
            return f"{path} has entries {_keys_text(entries)}, expected {_keys_text(want)}{as_full}"
        metadata = _custom_metadata_difference(sub_spec, sub)
        if metadata is not None:
            return f"{path} is {article(type(sub).__name__)} of metadata {metadata[0]}, expected {metadata[1]}{as_full}"
        for child_spec, child, entry in zip(specs, children, entries):
            step = _entry_str(entry, sub)
            found = walk(child_spec, child, path + step, full + step)
            if found:
                return found
        return None

    return walk(spec, tree, root, spec_root) or "structures differ"


def _custom_metadata_difference(spec: TreeSpec, node: Any) -> tuple[str, str] | None:
    """Where ``node`` is a custom (optree-registered) node of ``spec``'s type and entries whose metadata differs from
    ``spec``'s (which optree compares: another tag, say), the texts of both (``node``'s first); else ``None``."""
    if spec.kind != optree.PyTreeKind.CUSTOM:
        return None
    try:
        like = optree.tree_unflatten(spec.one_level(), [None] * spec.num_children)
        want = optree.tree_flatten_one_level(like, none_is_leaf=True)[1]
        got = optree.tree_flatten_one_level(node, none_is_leaf=True)[1]
        if got == want:
            return None
        return f"{got!r:.80}", f"{want!r:.80}"
    except Exception:  # (an unflatten that does not take placeholders, metadata that does not compare)
        return None


def unwalked_hint(x: Any) -> str:
    """Why ``x`` stands as one leaf where it looks like a container: a subclass of ``dict``, ``list`` or
    ``tuple`` (not a NamedTuple) that optree does not walk (it walks those types themselves, ``OrderedDict`` and
    ``defaultdict``, not their subclasses), and what to pass; else ''."""
    if optree.is_namedtuple_instance(x) or not isinstance(x, (dict, list, tuple)):
        return ""
    if not optree.tree_is_leaf(x, none_is_leaf=True):
        return ""
    base = next(b for b in (dict, list, tuple) if isinstance(x, b)).__name__
    return (f" (a {base} subclass, which optree takes as one leaf: pass {base}(x) or register {type(x).__name__} "
            "with optree)")


def structure_difference(spec: TreeSpec, tree: PyTree, root: str = "params", other: str = "the record's") -> str:
    """Where ``tree``'s structure departs from ``spec`` (``other``'s, the structure it must have exactly), the node
    types and their entries in order: unlike :func:`flatten_up_to`, which matches a mapping of another dict type or
    key order key by key, such a mapping is a difference here (named as one: its leaves come in another order).
    ``spec`` anything but a tree structure: a ``TypeError`` naming it (a bare AttributeError, 'is_leaf')."""
    _check_spec("structure_difference", spec)

    def walk(sub_spec: TreeSpec, sub: Any, path: str) -> str | None:
        if sub_spec.is_leaf():
            return None if optree.tree_structure(sub).is_leaf() else \
                f"{path} is {article(type(sub).__name__)} where {other} is a leaf"
        want = list(sub_spec.entries())
        if optree.tree_is_leaf(sub):
            return f"{path} is {article(type(sub).__name__)}, {other} is {article(sub_spec.type.__name__)}"
        children, _, entries, _ = optree.tree_flatten_one_level(sub)
        name, other_name = type(sub).__name__, sub_spec.type.__name__
        if type(sub) is not sub_spec.type:
            if _mappings_by_key(sub_spec, sub) and _same_keys(entries, want):
                return f"{path} is {article(name)} where {other} is {article(other_name)} (keys {_keys_text(want)})"
            if name == other_name:
                return f"{path} is {article(name)} of another class than {other} of the same name"
            return f"{path} is {article(name)}, {other} is {article(other_name)}"
        if list(entries) != want:
            if _same_keys(entries, want):
                return (f"{path} is {article(name)} of keys {_keys_text(entries)} where {other} has them in the "
                        f"order {_keys_text(want)}")
            return f"{path} has entries {_keys_text(entries)}, expected {_keys_text(want)}"
        metadata = _custom_metadata_difference(sub_spec, sub)
        if metadata is not None:
            return f"{path} is {article(name)} of metadata {metadata[0]}, {other} has {metadata[1]}"
        for child_spec, child, entry in zip(sub_spec.children(), children, entries):
            found = walk(child_spec, child, path + _entry_str(entry, sub))
            if found:
                return found
        return None

    return walk(spec, tree, root) or "structures differ"


def leaf_order_by_key(spec: TreeSpec, other: TreeSpec) -> tuple[int, ...] | None:
    """Where ``other`` is ``spec``'s structure but for mappings of another dict type or key order (a dict over an
    ``OrderedDict``, as :func:`flatten_up_to` matches them key by key): for each leaf of ``other``, in its order, the
    index of ``spec``'s leaf at the same path; else ``None`` (``other`` is ``spec`` itself included: nothing to
    reorder, or another structure)."""
    if other == spec or not (isinstance(spec, optree.PyTreeSpec) and isinstance(other, optree.PyTreeSpec)):
        return None
    try:
        return _leaf_order_by_key(spec, other)
    except TypeError:  # a custom node whose metadata cannot be hashed: not memoized
        return _leaf_order_by_key.__wrapped__(spec, other)


@functools.lru_cache(maxsize=256)
def _leaf_order_by_key(spec: TreeSpec, other: TreeSpec) -> tuple[int, ...] | None:
    """:func:`leaf_order_by_key`, memoized (an undo of such params asks once per step)."""
    n = spec.num_leaves
    if other.num_leaves != n:
        return None
    try:
        entries = other.flatten_up_to(optree.tree_unflatten(spec, list(range(n))))
    except (ValueError, TypeError):
        return None
    # (a subtree of spec where other has a leaf is an entry that is no index)
    if not all(type(e) is int for e in entries) or sorted(entries) != list(range(n)):
        return None
    return tuple(entries)


def _entry_str(entry: Any, node: Any) -> str:
    if optree.is_namedtuple_instance(node):
        return f".{node._fields[entry]}" if isinstance(entry, int) else f".{entry}"
    return f"[{key_text(entry)}]"


def broadcast_prefix(prefix: PyTree, spec: TreeSpec, is_leaf: Callable[[Any], bool] | None = None,
                     what: str = "hparams", root: str = "params", full_tree: PyTree = None) -> list[Any]:
    """One value per leaf of ``spec`` from a tree that is a prefix of it.

    ``is_leaf`` marks the values of the prefix tree (e.g. ``AdamHParams``
    instances, which would otherwise be walked as NamedTuples); it is applied
    to the prefix tree only, never to the full structure. The values come in the order of ``spec``'s leaves; a
    mapping of the prefix is matched key by key, whatever its order (a dict over an ``OrderedDict``).
    ``full_tree``: the tree ``spec`` is the structure of, where the caller has it: under ``torch.compile``, where
    it holds a mapping (in a custom node too), the prefix is matched to it leaf path by leaf path
    (:func:`_broadcast_prefix_traced`). ``spec`` anything but a tree structure: a ``TypeError`` naming it.
    """
    _check_spec("broadcast_prefix", spec)
    if is_leaf is not None and is_leaf(prefix):
        # One value for every leaf (no tree walked: also under torch.compile).
        return [prefix] * spec.num_leaves
    if is_leaf is not None:  # a value tree: None is a value too ("the defaults" for its subtree)
        values_of = is_leaf
        is_leaf = lambda x: x is None or values_of(x)  # noqa: E731
    if full_tree is not None and is_leaf is not None and torch.compiler.is_compiling() and _holds_mapping(full_tree):
        return _broadcast_prefix_traced(prefix, spec, full_tree, is_leaf, what, root)
    prefix_values, prefix_spec = optree.tree_flatten(prefix, is_leaf=is_leaf)
    # The full structure with each leaf's index: a mapping of the prefix is matched key by key, and its keys may
    # come in another order than the params' (a dict, sorted, over an OrderedDict): each value goes to the indices
    # of its subtree (not in the prefix's order, which gave a leaf another's value).
    full = optree.tree_unflatten(spec, list(range(spec.num_leaves)))
    try:
        subtrees = prefix_spec.flatten_up_to(full)
    except (ValueError, TypeError) as exc:
        where = _first_difference(spec, prefix, what, is_leaf or (lambda x: False), root)
        raise StructureError(f"{what} is not a prefix of the structure of {root} ({spec_text(spec)}): "
                             f"{where}") from exc
    out: list[Any] = [None] * spec.num_leaves
    for value, sub in zip(prefix_values, subtrees):
        for index in optree.tree_leaves(sub):
            out[index] = value
    return out


def _broadcast_prefix_traced(prefix: PyTree, spec: TreeSpec, full_tree: PyTree, is_leaf: Callable[[Any], bool],
                             what: str, root: str) -> list[Any]:
    """:func:`broadcast_prefix` while ``torch.compile`` traces, for a ``full_tree`` holding a mapping. Dynamo's
    stand-in for optree cannot unflatten a dict spec over constant leaves (``optree.registry.DictMetaData`` is not
    wrappable: a graph break, and without ``fullgraph`` its stand-in spec reached optree's code in the resumed
    frame, "ValueError: length mismatch" or "TypeError: unhashable type: 'list'"). Each leaf's path
    (``spec.paths()``, which it traces) is walked down ``prefix`` and ``full_tree`` together until a value of the
    prefix: a mapping is matched key by key (its keys those of the tree's mapping there, in any order), a list or
    tuple position by position (of the tree's type and length there), a custom (optree-registered) node entry by
    entry (of the tree's class, entries and metadata there, as optree matches it eagerly); else a
    :class:`StructureError` naming the place (as the eager path words it)."""
    out = []
    for path in spec.paths():
        node, full, at = prefix, full_tree, ""
        for entry in path:
            if is_leaf(node) or not (isinstance(node, (Mapping, list, tuple)) or _custom_node(node)):
                break  # a value (a float: the caller's refusal)
            if isinstance(node, Mapping) and isinstance(full, Mapping):
                if set(node) != set(full):
                    raise StructureError(f"{what} is not a prefix of the structure of {root}: {what}{at} has entries "
                                         f"{_sorted_keys(node)}, expected {_sorted_keys(full)} (as {root}{at})")
            elif _custom_node(node) and type(node) is type(full):  # (an optree-registered class: walked as eagerly)
                node, full, at = _custom_children(node, full, entry, what, root, at)
                continue
            elif not (isinstance(node, (list, tuple)) and type(node) is type(full) and len(node) == len(full)):
                raise StructureError(f"{what} is not a prefix of the structure of {root}: {what}{at} is "
                                     f"{_described_node(node)} where {root}{at} is {_described_node(full)}")
            node, full, at = node[entry], full[entry], f"{at}[{entry!r}]"
        if (isinstance(node, (Mapping, list, tuple)) or _custom_node(node)) and not is_leaf(node):  # (at a leaf)
            raise StructureError(f"{what} is not a prefix of the structure of {root}: {what}{at} is "
                                 f"{_described_node(node)} where {root}{at} is a leaf")
        out.append(node)
    return out


def _custom_node(x: Any) -> bool:
    """Whether ``x`` is a node of a class registered with optree (neither a mapping, a list nor a tuple: those are
    walked by :func:`_broadcast_prefix_traced` itself), which optree flattens into children."""
    return not isinstance(x, (Mapping, list, tuple, torch.Tensor)) and x is not None and \
        not optree.tree_is_leaf(x, none_is_leaf=True)


def _custom_children(node: Any, full: Any, entry: Any, what: str, root: str, at: str) -> tuple[Any, Any, str]:
    """The children at ``entry`` of the custom nodes ``node`` (of the prefix) and ``full`` (of the tree), one class,
    with the path ``at`` one step down; where their entries or metadata differ (which eagerly ``flatten_up_to``
    refuses) a :class:`StructureError` naming the place."""
    children, metadata, entries, _ = optree.tree_flatten_one_level(node, none_is_leaf=True)
    full_children, full_metadata, full_entries, _ = optree.tree_flatten_one_level(full, none_is_leaf=True)
    name = type(node).__name__
    if list(entries) != list(full_entries):
        raise StructureError(f"{what} is not a prefix of the structure of {root}: {what}{at} is {article(name)} of "
                             f"entries {list(entries)!r}, expected {list(full_entries)!r} (as {root}{at})")
    if metadata != full_metadata:
        raise StructureError(f"{what} is not a prefix of the structure of {root}: {what}{at} is {article(name)} of "
                             f"metadata {metadata!r:.80}, expected {full_metadata!r:.80} (as {root}{at})")
    i = list(entries).index(entry)
    return children[i], full_children[i], at + _entry_str(entry, node)


def _sorted_keys(mapping: Mapping[Any, Any]) -> list[Any]:
    """The keys of ``mapping`` sorted, or in its order where they do not sort together."""
    try:
        return sorted(mapping)
    except TypeError:
        return list(mapping)


def _described_node(x: Any) -> str:
    """``x`` as a structure error names it: its type, and a list's or a tuple's length."""
    kind = type(x).__name__
    return f"{article(kind)} of {len(x)}" if isinstance(x, (list, tuple)) else article(kind)


def _holds_mapping(x: PyTree) -> bool:
    """Whether ``x``, walked through its mappings, lists, tuples and custom (optree-registered) nodes, is or holds a
    mapping (a custom node's mapping was not seen: its params took the eager path, which dynamo cannot trace)."""
    if isinstance(x, Mapping):
        return True
    if _custom_node(x):
        return any(_holds_mapping(y) for y in optree.tree_flatten_one_level(x, none_is_leaf=True)[0])
    return isinstance(x, (list, tuple)) and any(_holds_mapping(y) for y in x)


def numel_of(leaves: Sequence[torch.Tensor]) -> int:
    """Total number of elements of a sequence of tensors (anything else refused, a ``TypeError`` naming it)."""
    return sum(t.numel() for t in _tensor_leaves("numel_of", leaves))


def _tensor_leaves(who: str, leaves: Any) -> list[torch.Tensor]:
    """``leaves`` as a list, every element a tensor; else a ``TypeError`` naming ``who`` and what is not (a tensor
    given as the sequence: iterated as its rows; an int: 'int' object is not iterable; a float leaf: a bare
    AttributeError from ``numel``). A lazy module's uninitialized parameter is a ``ValueError`` naming it
    (:func:`uninitialized_refusal`)."""
    if isinstance(leaves, torch.Tensor) or not isinstance(leaves, collections.abc.Iterable):
        raise TypeError(f"{who}: leaves is {article(type(leaves).__name__)}, expected a sequence of tensors")
    leaves = list(leaves)  # (an iterator: 'not subscriptable', or emptied by the checks: 'leaves need 0')
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: leaves[{i}] is {article(type(t).__name__)}, expected a tensor")
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # (torch's ValueError naming no leaf)
            raise ValueError(f"{who}: {uninitialized_refusal(f'leaves[{i}]')}")
    return leaves


def uninitialized_refusal(path: str) -> str:
    """The refusal of the lazy module's uninitialized parameter (``nn.LazyLinear``'s before its first forward: no
    shape, no data; torch raised its ValueError or RuntimeError at its first use, naming no leaf) at ``path``."""
    return (f"{path} is an uninitialized parameter (a lazy module's, before its first forward), which has no shape "
            "or data; run a forward pass first")


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def pack(leaves: Sequence[torch.Tensor], dtype: torch.dtype | None = None,
         device: torch.device | str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``leaves`` one after another into one flat 1-d tensor (``out`` if given, else a new one of ``dtype``,
    default the first leaf's, on ``device``, default the first leaf's). A leaf that this dtype cannot hold without
    changing its kind (floating point into an integer or bool one, complex into a real one) is refused before
    anything is written, as ``torch.cat(out=)`` refuses it; a cast within a kind is done. So are a leaf that is not
    dense (sparse, nested: no flat view), a meta leaf (no value) for a buffer not on meta, a ``dtype`` or
    ``device`` torch does not read as one, and a leaf or ``out`` whose elements reach past the end of its storage
    (freed or shrunk: :func:`~sofx.kernels.storage.refuse_short_storage`, a :class:`~sofx.errors.LeafError`; reading
    such a leaf crashed the process). A leaf that shares memory with ``out`` is refused as ``torch.cat(out=)`` refuses
    it (a :class:`~sofx.errors.LeafError`: read after an earlier leaf was written there, it packed that leaf's
    values), but for one that is exactly its own place in ``out`` (:func:`unpack`'s views packed back); so is an
    ``out`` that cannot be written in place (:func:`~sofx.kernels.donation.unwritable`: a leaf that requires grad in
    grad mode, an inference tensor outside inference mode, which torch refused after the first leaf was written).
    Under ``torch.func.vmap``, where a leaf is batched, the new buffer is batched too (each member's leaves packed);
    an ``out`` that vmap does not batch is refused (a :class:`~sofx.errors.LeafError`: it cannot hold each member's
    values)."""
    leaves = _tensor_leaves("pack", leaves)
    if out is not None and not isinstance(out, torch.Tensor):  # (a bare AttributeError from numel)
        raise TypeError(f"pack: out is {article(type(out).__name__)}, expected a 1-d tensor")
    if dtype is not None and not isinstance(dtype, torch.dtype):  # (torch.can_cast's bare TypeError for a str)
        try:
            dtype = torch.empty(0, dtype=dtype, device="meta").dtype  # (Python's float, as torch reads it)
        except TypeError:
            raise TypeError(f"pack: dtype = {dtype!r:.60} ({type(dtype).__name__}), expected a torch.dtype") from None
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"pack: device = {device!r:.60} ({type(device).__name__}) is not a device") from None
    for i, t in enumerate(leaves):
        if t.layout != torch.strided or t.is_nested:  # (torch's bare "reshape is not implemented for sparse tensors")
            raise TypeError(f"pack: leaves[{i}] is a {t.layout} tensor, expected a dense (strided) one")
    where = out.device if out is not None else device if device is not None else \
        leaves[0].device if leaves else torch.device("cpu")
    if where.type != "meta":
        for i, t in enumerate(leaves):
            if t.is_meta:  # (torch's bare "Cannot copy out of meta tensor; no data!", out half written)
                raise ValueError(f"pack: leaves[{i}] is a meta tensor, which holds no value, for a buffer on {where} "
                                 "(meta leaves pack into a meta buffer only)")
            if not in_storage(t):  # (freed or shrunk: a segmentation fault reading it, out half written)
                refuse_short_storage(t, f"pack: leaves[{i}]")
        if out is not None and not in_storage(out):  # (torch's bare "setStorage: ... out of bounds")
            refuse_short_storage(out, "pack: out")
    n = numel_of(leaves)
    if out is not None and (out.numel() != n or out.dim() != 1):
        raise ValueError(f"pack: out has {out.numel()} elements (dim {out.dim()}), leaves need {n} in 1-d")
    target = out.dtype if out is not None else dtype if dtype is not None else \
        leaves[0].dtype if leaves else torch.float32
    for i, t in enumerate(leaves):
        if not torch.can_cast(t.dtype, target):
            into = "out's dtype" if out is not None else "the dtype"
            raise TypeError(f"pack: leaves[{i}] of dtype {t.dtype} cannot be cast to {into} {target} without losing "
                            "its kind")
    # (under torch.func.vmap a new buffer is not batched: writing a batched leaf into it raised torch's bare "vmap:
    # inplace arithmetic(self, *extra_args) is not possible ...")
    batched = next((i for i, t in enumerate(leaves) if _functorch_wrapped(t) and vmapped(t)), None)
    if out is None:
        if batched is not None:  # (made from the leaves, each member's; an unbatched leaf is every member's)
            return torch.cat([t.reshape(-1).to(device=where, dtype=target) for t in leaves])
        out = torch.empty(n, dtype=target, device=where)
    else:
        why = unwritable("pack: out", out)  # (requires grad, inference, elements overlapping: torch's bare errors)
        if why is not None:
            raise LeafError(why)
        if batched is not None and not vmapped(out):
            raise LeafError(f"pack: leaves[{batched}] is batched by torch.func.vmap, out is not: one buffer shared by "
                            "the batch cannot hold each member's values; give no out (a new batched buffer is made) "
                            "or an out batched as the leaves are")
        _refuse_leaves_in_out(leaves, out)
    offset = 0
    for t in leaves:
        k = t.numel()
        out[offset:offset + k].copy_(t.reshape(-1))
        offset += k
    return out


def _refuse_leaves_in_out(leaves: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """:func:`pack`'s refusal (a :class:`~sofx.errors.LeafError` naming it) of a leaf whose memory overlaps ``out``
    (:class:`~sofx.kernels.donation.MemorySpans`) but for one that is exactly its own place there (its copy writes
    each element onto itself). Not for meta tensors (no memory) nor ``torch.func`` wrappers (no address)."""
    tensors = [out, *leaves]
    if any(t.is_meta or torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        return
    others, offset = [], 0
    for i, t in enumerate(leaves):
        k = t.numel()
        place = out[offset:offset + k]
        offset += k
        if not (t.dtype == out.dtype and t.is_contiguous() and place.is_contiguous() and k
                and t.data_ptr() == place.data_ptr()):
            others.append(i)
    spans = MemorySpans()
    spans.add([out], True, lambda i: "out")
    spans.add([leaves[i] for i in others], False, lambda j: others[j])
    found = spans.clash(lambda tag: "pack: out" if tag == "out" else f"pack: leaves[{tag}]")
    if found is not None:
        i = found[1] if found[0] == "out" else found[0]
        raise LeafError(f"pack: leaves[{i}] and out share memory, elsewhere than its own place in out: refused as "
                        "torch.cat(out=) refuses it (out is written as the leaves are read, so that a write may change "
                        "a leaf before it is read); pack into another buffer, or clone the leaf")


def unpack(flat: torch.Tensor, shapes: Sequence[torch.Size | Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` (1-d) with the given shapes (a sequence of sizes each, or an int: the 1-d shape of that
    size, as ``view(3)`` takes it), laid out one after another; shapes that do not cover its elements exactly (or
    of a negative size) are refused, a ``ValueError`` naming the sizes, before any view (a ``flat`` that is no
    tensor, or a shape that is no shape, a ``TypeError``; a ``flat`` whose memory was freed or shrunk, a
    :class:`~sofx.errors.LeafError`: :func:`~sofx.kernels.storage.refuse_short_storage`, but while ``torch.compile``
    traces, which cannot read a fake tensor's storage)."""
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"unpack: flat is {article(type(flat).__name__)}, expected a 1-d tensor")
    if flat.dim() != 1:  # (a row slice of a 2-d buffer was viewed as the leaf: torch's bare view error)
        raise ValueError(f"unpack: expected a 1-d flat buffer, got shape {tuple(flat.shape)}")
    if not isinstance(shapes, collections.abc.Iterable):  # ('int' object is not iterable)
        raise TypeError(f"unpack: shapes is {article(type(shapes).__name__)}, expected a sequence of shapes")
    sizes = []
    for i, shape in enumerate(shapes):
        try:
            shape = (operator.index(shape),) if not isinstance(shape, collections.abc.Iterable) else \
                tuple(operator.index(d) for d in shape)
        except TypeError:
            raise TypeError(f"unpack: shapes[{i}] = {shape!r:.60} is not a shape (a sequence of int sizes, or an "
                            "int)") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"unpack: shapes[{i}] = {shape} has a negative size")
        k = 1
        for d in shape:
            k *= d
        sizes.append((shape, k))
    total = sum(k for _, k in sizes)
    if total != flat.numel():  # (checked first: the leaf that ran out raised torch's bare view error)
        raise ValueError(f"unpack: shapes cover {total} elements, flat buffer has {flat.numel()}")
    # (freed or shrunk: torch's bare "setStorage: ... out of bounds" from the first view; not while compiling, where
    # the storage of a fake tensor cannot be read: it broke the graph)
    if not torch.compiler.is_compiling() and not in_storage(flat):
        refuse_short_storage(flat, "unpack: flat")
    views = []
    offset = 0
    for shape, k in sizes:
        views.append(flat[offset:offset + k].view(shape))
        offset += k
    return views
