import collections
import re
import sys

import optree
import optree.registry
import pytest
import torch

import sofx
from sofx import tree
from sofx.errors import StructureError

NT = collections.namedtuple("NT", "a b")


def test_leaf_paths_name_dicts_lists_and_namedtuples():
    t = {"layers": [{"w": torch.ones(1)}, {"w": torch.ones(1), "b": None}], "x": NT(torch.ones(1), torch.ones(1))}
    assert tree.leaf_paths(t) == [
        "params['layers'][0]['w']",
        "params['layers'][1]['w']",
        "params['x'].a",
        "params['x'].b",
    ]
    assert tree.leaf_paths(t, root="grads")[0] == "grads['layers'][0]['w']"


def test_none_is_an_empty_subtree_in_params_and_a_leaf_marker_in_grads():
    params = {"a": torch.ones(2), "b": None, "c": [torch.ones(1)]}
    leaves, spec = tree.flatten(params)
    assert len(leaves) == 2
    assert tree.flatten_up_to(spec, {"a": None, "b": None, "c": [torch.zeros(1)]}) [0] is None


def test_none_where_params_has_an_empty_subtree_is_taken_as_that_subtree(rng):
    """A grads tree marks a leaf without gradient with None; where params has a subtree without leaves (a module
    without parameters: ``[]``, ``{}``, a NamedTuple of empty lists) None gives no gradient for it either, and is
    taken as that subtree by update, serial_step, speculative_step and accumulate (it was refused, the message
    ending in "structures differ"). None over a subtree that has leaves is still refused, naming it."""
    params = {"w": torch.randn(3, generator=rng), "empty": [], "nested": {"x": {}, "y": NT([], None)}}
    spec = tree.flatten(params)[1]
    g = torch.randn(3, generator=rng)
    assert tree.flatten_up_to(spec, {"w": g, "empty": None, "nested": None}, "grads") == [g]
    assert tree.flatten_up_to(spec, {"w": None, "empty": None, "nested": {"x": None, "y": None}}) == [None]
    with_leaves = tree.flatten({"w": torch.ones(1), "sub": {"b": torch.ones(1)}})[1]
    with pytest.raises(StructureError, match=r"\(grads\['sub'\] is None, expected PyTreeSpec\(\{'b': \*\}\)\)"):
        tree.flatten_up_to(with_leaves, {"w": None, "sub": None}, "grads")

    given = {"w": g, "empty": [], "nested": {"x": {}, "y": NT([], None)}}
    marked = {"w": g, "empty": None, "nested": {"x": None, "y": None}}
    opt = sofx.adamw(lr=1e-2)
    state = opt.init(params)
    want = opt.update(params, given, state)[0]
    assert torch.equal(opt.update(params, marked, state)[0]["w"], want["w"])
    scaler = sofx.loss_scale.grad_scaler(init_scale=2.0)
    kw = dict(scaler=scaler, scaler_state=scaler.init(), max_norm=1.0)
    want = sofx.serial.serial_step(opt, params, given, state, **kw)
    got = sofx.serial.serial_step(opt, params, marked, state, **kw)
    assert torch.equal(got.params["w"], want.params["w"]) and got.facts == want.facts
    got = sofx.speculate.speculative_step(opt, params, marked, state, config=sofx.speculate.SpeculationConfig(
        max_norm=1.0), scaler=scaler, scaler_state=scaler.init())
    assert torch.equal(got.params["w"], want.params["w"])
    acc = sofx.transforms.accumulate(sofx.transforms.accumulation_init(params), marked, params)
    assert torch.equal(sofx.transforms.accumulated(acc, params)["w"], g)


def test_a_mapping_of_another_dict_type_is_matched_by_key_where_none_stands_for_an_empty_subtree_or_it_departs():
    """optree matches a dict, an OrderedDict and a defaultdict key by key (OrderedDict grads over dict params), but
    a None standing for an empty subtree in such a mapping was refused, and a difference inside one was named as
    the mapping's type ("grads is a OrderedDict, expected a dict"), not where it is."""
    od = collections.OrderedDict
    spec = tree.flatten({"x": {}, "y": torch.zeros(1)})[1]
    assert tree.flatten_up_to(spec, od([("y", 1), ("x", None)]), "grads") == [1]
    assert tree.flatten_up_to(spec, collections.defaultdict(int, {"y": 1, "x": None}), "grads") == [1]
    over_od = tree.flatten(od([("y", torch.zeros(1)), ("x", {})]))[1]
    assert tree.flatten_up_to(over_od, {"x": None, "y": 1}, "grads") == [1]
    spec = tree.flatten({"a": [torch.zeros(1), torch.zeros(1)], "b": torch.zeros(1)})[1]
    with pytest.raises(StructureError, match=r"\(grads\['a'\] has entries \[0\], expected \[0, 1\]\)"):
        tree.flatten_up_to(spec, od([("b", 1), ("a", [1])]), "grads")
    with pytest.raises(StructureError, match=r"\(grads has entries \['b', 'c'\], expected \['a', 'b'\]\)"):
        tree.flatten_up_to(spec, od([("b", 1), ("c", [1, 2])]), "grads")
    is_hp = lambda x: isinstance(x, sofx.AdamHParams)  # noqa: E731
    with pytest.raises(StructureError, match=r": hparams\['a'\] is a tuple, expected a list \(as params\['a'\]\)"):
        tree.broadcast_prefix(od([("b", None), ("a", (None, None))]), spec, is_leaf=is_hp)


def test_flatten_up_to_names_the_first_difference():
    spec = tree.flatten({"layers": [{"w": 1, "b": 2}, {"w": 3}]})[1]
    # the path is in the tree that departs (grads), not in params
    with pytest.raises(StructureError, match=r"\(grads\['layers'\]\[0\] has entries \['b', 'c'\]"):
        tree.flatten_up_to(spec, {"layers": [{"b": 1, "c": 2}, {"w": 3}]}, "grads")
    with pytest.raises(StructureError, match=r"\(grads\['layers'\] has entries \[0\], expected \[0, 1\]"):
        tree.flatten_up_to(spec, {"layers": [{"b": 1, "w": 2}]}, "grads")
    with pytest.raises(StructureError, match=r"\(grads\['layers'\] is a dict, expected a list"):
        tree.flatten_up_to(spec, {"layers": {"b": 1}}, "grads")


class _Tagged:
    """A custom pytree node (registered with optree below) whose metadata is its tag."""

    def __init__(self, x, y, tag):
        self.x, self.y, self.tag = x, y, tag


optree.register_pytree_node(_Tagged, lambda n: ((n.x, n.y), n.tag, ("x", "y")), lambda tag, c: _Tagged(*c, tag),
                            namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"))


def test_a_custom_node_of_other_metadata_is_named_where_it_departs():
    """A custom node (optree-registered) of the params' type and children whose metadata differs (another tag) was
    refused as "(structures differ)", naming no place, where every other difference is named. Its path and both
    metadata are named, in grads, in an hparams prefix and in an undo's params."""
    params = {"n": _Tagged(torch.zeros(2), torch.zeros(3), "a")}
    spec = tree.flatten(params)[1]
    other = {"n": _Tagged(torch.zeros(2), torch.zeros(3), "b")}
    with pytest.raises(StructureError, match=r"\(grads\['n'\] is a _Tagged of metadata 'b', expected 'a'\)"):
        tree.flatten_up_to(spec, other, "grads")
    hp = sofx.AdamHParams()
    with pytest.raises(StructureError, match=r": hparams\['n'\] is a _Tagged of metadata 'b', expected 'a' \(as "
                                             r"params\['n'\]\)"):
        tree.broadcast_prefix({"n": _Tagged(hp, None, "b")}, spec, is_leaf=lambda x: isinstance(x, sofx.AdamHParams))
    opt = sofx.adamw()
    new_params, new_state, record = opt.update(params, tree.tree_map(torch.ones_like, params), opt.init(params))
    moved = {"n": _Tagged(new_params["n"].x, new_params["n"].y, "b")}
    with pytest.raises(sofx.UndoError, match=r"params\['n'\] is a _Tagged of metadata 'b', the record's has 'a'"):
        opt.undo(moved, new_state, record)


def test_a_prefix_that_departs_is_named_where_it_departs():
    spec = tree.flatten({"enc": {"w": 1, "b": 2}, "head": [3, 4]})[1]
    hp = sofx.AdamHParams()
    is_hp = lambda x: isinstance(x, sofx.AdamHParams)  # noqa: E731
    for prefix, where in (({"enc": hp, "head": (hp, hp)}, r"hparams\['head'\] is a tuple, expected a list \(as "
                                                           r"params\['head'\]\)"),
                          ({"enc": {"w": hp}, "head": hp}, r"hparams\['enc'\] has entries \['w'\], expected "
                                                           r"\['b', 'w'\] \(as params\['enc'\]\)"),
                          ({"enc": hp, "head": [hp, [hp]]}, r"hparams\['head'\]\[1\] is a list where "
                                                            r"params\['head'\]\[1\] is a leaf")):
        with pytest.raises(StructureError, match=r"hparams is not a prefix of the structure of params \(.*\): "
                                                 + where):
            tree.broadcast_prefix(prefix, spec, is_leaf=is_hp)


def test_none_in_an_hparams_prefix_is_the_defaults_of_its_subtree(rng):
    """``{"enc": AdamHParams(lr=...), "head": None}``: the head takes the optimizer's defaults, as
    ``AdamHParams()`` there does."""
    params = {"enc": {"w": torch.randn(2, 2, generator=rng)}, "head": [torch.randn(3, generator=rng)]}
    grads = {"enc": {"w": torch.randn(2, 2, generator=rng)}, "head": [torch.randn(3, generator=rng)]}
    opt = sofx.adamw(lr=1e-2)
    state = opt.init(params)
    got = opt.update(params, grads, state, {"enc": sofx.AdamHParams(lr=0.1), "head": None})[0]
    want = opt.update(params, grads, state, {"enc": sofx.AdamHParams(lr=0.1), "head": sofx.AdamHParams()})[0]
    assert torch.equal(got["enc"]["w"], want["enc"]["w"]) and torch.equal(got["head"][0], want["head"][0])


def test_broadcast_prefix_gives_one_value_per_leaf():
    spec = tree.flatten({"enc": [torch.ones(1), torch.ones(1)], "dec": {"w": torch.ones(1)}, "z": None})[1]
    assert tree.broadcast_prefix(0.5, spec) == [0.5, 0.5, 0.5]
    assert tree.broadcast_prefix({"enc": 1, "dec": 2, "z": None}, spec) == [2, 1, 1]  # sorted keys: dec, enc
    with pytest.raises(StructureError, match="not a prefix"):
        tree.broadcast_prefix({"enc": 1}, spec)


@pytest.mark.parametrize("params_type, prefix_type", [(collections.OrderedDict, dict),
                                                       (dict, collections.OrderedDict)])
def test_a_prefix_of_another_mapping_type_gives_each_leaf_its_own_value(params_type, prefix_type):
    """A dict prefix over OrderedDict params (``OrderedDict(model.named_parameters())``), or the other way round,
    matches key by key, but the values came out in the prefix's key order, not the params': where the orders
    differ (an OrderedDict not sorted) each leaf got another's value, per-group hparams silently swapped
    (lr 0 stepped the leaf meant for lr 0.1)."""
    params = params_type([("b", torch.zeros(2)), ("a", {"y": torch.zeros(1), "x": torch.zeros(1)})])
    prefix = prefix_type([("b", "B"), ("a", prefix_type([("y", "Y"), ("x", "X")]))])
    spec = tree.flatten(params)[1]
    by_path = dict(zip(tree.leaf_paths(spec), tree.broadcast_prefix(prefix, spec)))
    assert by_path == {"params['b']": "B", "params['a']['y']": "Y", "params['a']['x']": "X"}
    opt = sofx.adam(lr=1e-3)
    flat = params_type([("b", torch.zeros(2)), ("a", torch.zeros(2))])
    hparams = prefix_type([("b", sofx.AdamHParams(lr=0.0)), ("a", sofx.AdamHParams(lr=0.1))])
    stepped, _, _ = opt.update(flat, sofx.tree.tree_map(torch.ones_like, flat), opt.init(flat), hparams)
    assert torch.equal(stepped["b"], torch.zeros(2)) and torch.allclose(stepped["a"], torch.full((2,), -0.1))


def test_pack_unpack_roundtrip_views_share_storage():
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(3, 4, generator=gen), torch.randn(0, generator=gen), torch.randn(5, generator=gen)]
    flat = tree.pack(leaves)
    assert flat.shape == (17,)
    views = tree.unpack(flat, [t.shape for t in leaves])
    for v, t in zip(views, leaves):
        assert torch.equal(v, t)
    views[0].add_(1)
    assert torch.equal(flat[:12], (leaves[0] + 1).reshape(-1))
    with pytest.raises(ValueError):
        tree.unpack(flat, [(3, 4)])


@pytest.mark.parametrize("out_dtype, leaf_dtype", [(torch.int64, torch.float32), (torch.int32, torch.bfloat16),
                                                     (torch.bool, torch.float32), (torch.float32, torch.complex64)])
def test_pack_refuses_an_out_that_would_truncate_a_leaf_before_writing_it(out_dtype, leaf_dtype):
    """An integer (or bool, or real) ``out`` for floating-point (or complex) leaves was filled by ``copy_``'s
    silent cast: 0.7 packed as 0. It is refused naming the leaf and both dtypes, as ``torch.cat(out=)`` refuses
    it, and ``out`` is left as it was; a cast within a kind (float32 leaves into bfloat16) is still done."""
    leaves = [torch.ones(2, dtype=out_dtype), torch.full((3,), 0.7, dtype=leaf_dtype)]
    out = torch.full((5,), 3).to(out_dtype)
    before = out.clone()
    with pytest.raises(TypeError, match=rf"pack: leaves\[1\] of dtype {leaf_dtype} cannot be cast to out's "
                                        rf"dtype {out_dtype} without losing its kind"):
        tree.pack(leaves, out=out)
    assert torch.equal(out, before)
    flat = tree.pack([torch.full((2,), 0.5)], out=torch.zeros(2, dtype=torch.bfloat16))
    assert flat.dtype == torch.bfloat16 and torch.equal(flat.float(), torch.full((2,), 0.5))


@pytest.mark.parametrize("leaves, dtype, bad", [
    ([torch.full((3,), 0.7)], torch.int64, 0),  # dtype= of another kind
    ([torch.arange(2), torch.full((3,), 0.7)], None, 1),  # the first leaf's dtype, an integer one
    ([torch.ones(2), torch.full((3,), 0.5 + 1j)], None, 1),  # complex into a real first leaf's
])
def test_pack_refuses_a_dtype_that_would_truncate_a_leaf_without_out(leaves, dtype, bad):
    """Without ``out`` the buffer is made in ``dtype`` (default: the first leaf's), and a leaf of another kind was
    cast into it by ``copy_`` without a word (0.7 packed as 0 after an integer first leaf). Refused as an ``out``
    of that dtype is, naming the leaf and both dtypes; a cast within a kind is still done."""
    target = dtype or leaves[0].dtype
    with pytest.raises(TypeError, match=rf"pack: leaves\[{bad}\] of dtype {leaves[bad].dtype} cannot be cast to "
                                        rf"the dtype {target} without losing its kind"):
        tree.pack(leaves, dtype=dtype)
    assert tree.pack([torch.full((2,), 0.5)], dtype=torch.bfloat16).dtype == torch.bfloat16


def test_numel_of_and_pack_refuse_bad_leaves_a_str_dtype_and_meta_leaves_naming_them():
    """``numel_of`` of a float leaf raised a bare AttributeError ('float' object has no attribute 'numel'), of an
    int Python's "'int' object is not iterable"; ``pack`` with ``dtype="float32"`` torch.can_cast's bare TypeError,
    a meta leaf beside CPU ones torch's bare "Cannot copy out of meta tensor; no data!" after the leaves before it
    were written into ``out``, a sparse leaf "reshape is not implemented for sparse tensors". Each is refused naming
    it, ``out`` unchanged; meta leaves still pack into a meta buffer."""
    with pytest.raises(TypeError, match=r"^numel_of: leaves\[1\] is a float, expected a tensor"):
        tree.numel_of([torch.ones(2), 3.0])
    for bad in (5, torch.ones(2, 3)):
        with pytest.raises(TypeError, match=r"^numel_of: leaves is (an int|a Tensor), expected a sequence of tensors"):
            tree.numel_of(bad)
    assert tree.numel_of(iter([torch.ones(2), torch.ones(3, 2)])) == 8
    with pytest.raises(TypeError, match=r"^pack: dtype = 'float32' \(str\), expected a torch.dtype"):
        tree.pack([torch.ones(2)], dtype="float32")
    assert tree.pack([torch.ones(2)], dtype=float).dtype == torch.float64  # (torch's reading of Python's float)
    with pytest.raises(ValueError, match=r"^pack: device = 'nope' \(str\) is not a device"):
        tree.pack([torch.ones(2)], device="nope")
    out = torch.zeros(4)
    with pytest.raises(ValueError, match=r"^pack: leaves\[1\] is a meta tensor, which holds no value, for a buffer "
                                         r"on cpu"):
        tree.pack([torch.ones(2), torch.empty(2, device="meta")], out=out)
    assert torch.equal(out, torch.zeros(4))
    with pytest.raises(ValueError, match=r"^pack: leaves\[1\] is a meta tensor"):
        tree.pack([torch.ones(2), torch.empty(2, device="meta")])
    with pytest.raises(TypeError, match=r"^pack: leaves\[0\] is a torch.sparse_coo tensor, expected a dense"):
        tree.pack([torch.ones(2).to_sparse()])
    assert tree.pack([torch.empty(2, device="meta"), torch.ones(2)]).is_meta
    assert tree.pack([torch.ones(2)], device="meta").shape == (2,)


def test_pack_refuses_a_leaf_or_an_out_whose_memory_was_freed_before_writing():
    """A leaf whose storage was freed (``untyped_storage().resize_(0)``, as FSDP frees a parameter) crashed the
    process in pack (a segmentation fault reading it), after the leaves before it were written into ``out``; a
    freed ``out`` raised torch's bare "setStorage: ... out of bounds". Refused first, a LeafError (a ValueError)
    naming it and the bytes held and needed, ``out`` unchanged."""
    freed = torch.randn(1000)
    freed.untyped_storage().resize_(0)
    out = torch.zeros(1002)
    with pytest.raises(sofx.LeafError, match=r"^pack: leaves\[1\]: its storage holds 0 bytes, but its elements .* "
                                             r"reach byte 4000"):
        tree.pack([torch.ones(2), freed], out=out)
    assert torch.equal(out, torch.zeros(1002))
    with pytest.raises(sofx.LeafError, match=r"^pack: leaves\[1\]: its storage holds 0 bytes"):
        tree.pack([torch.ones(2), freed])
    out.untyped_storage().resize_(0)
    with pytest.raises(sofx.LeafError, match=r"^pack: out: its storage holds 0 bytes, but its elements .* reach "
                                             r"byte 4008"):
        tree.pack([torch.ones(2), torch.ones(1000)], out=out)


def test_pack_refuses_an_out_that_cannot_be_written_in_place_before_writing():
    """An out that requires grad raised autograd's bare "a leaf Variable that requires grad is being used in an
    in-place operation"; an inference tensor outside inference mode was written (its first leaf's elements) before
    torch's "Inplace update to inference tensor outside InferenceMode" came; an expand()-ed out's elements share
    memory. Refused before anything is written, a LeafError naming pack: out and what to pass instead."""
    leaves = [torch.ones(2), torch.full((2,), 2.0)]
    with torch.inference_mode():
        inference = torch.zeros(4)
    for out, why in ((torch.zeros(4, requires_grad=True), "a leaf tensor that requires grad"),
                     (inference, "an inference tensor"),
                     (torch.zeros(1).expand(4), "its elements overlap in memory")):
        with pytest.raises(sofx.LeafError, match=rf"^pack: out: {why}"):
            tree.pack(leaves, out=out)
        assert out.eq(0).all()
    with torch.no_grad():
        assert tree.pack(leaves, out=torch.zeros(4, requires_grad=True)).tolist() == [1.0, 1.0, 2.0, 2.0]


def test_unpack_refuses_a_flat_buffer_whose_memory_was_freed():
    """A flat buffer whose storage was freed (as FSDP frees a flat parameter) raised torch's bare "setStorage: ...
    out of bounds for storage of size 0" from its first view; refused, a LeafError naming it and the bytes held and
    needed, as pack refuses a freed leaf."""
    flat = torch.ones(6)
    flat.untyped_storage().resize_(0)
    with pytest.raises(sofx.LeafError, match=r"^unpack: flat: its storage holds 0 bytes, but its elements .* reach "
                                             r"byte 24"):
        tree.unpack(flat, [(2,), 4])
    assert tree.unpack(torch.ones(0), [0, (0, 3)])[1].shape == (0, 3)


def test_pack_refuses_a_leaf_that_shares_memory_with_out_elsewhere_than_its_own_place():
    """A leaf that is a view of ``out`` where an earlier leaf is written (``pack([x, out[:2]], out=out)``) was read
    after that write: packed as the earlier leaf's values without a word; one that partly overlaps its own place
    raised torch's bare "unsupported operation" after the leaves before it were written. Refused first (as
    ``torch.cat(out=)`` refuses it), a LeafError naming the leaf and out, out unchanged. A leaf that is exactly its
    own place in out (packing unpack's views back) still packs."""
    out = torch.tensor([5.0, 6.0, 0.0, 0.0])
    for leaves in ([torch.ones(2), out[0:2]], [torch.ones(1), out[0:2], torch.ones(1)]):
        with pytest.raises(sofx.LeafError, match=r"^pack: leaves\[1\] and out share memory"):
            tree.pack(leaves, out=out)
        assert out.tolist() == [5.0, 6.0, 0.0, 0.0]
    assert tree.pack(tree.unpack(out, [(2,), (1,), 1]), out=out).tolist() == [5.0, 6.0, 0.0, 0.0]
    with pytest.raises(sofx.LeafError, match=r"^pack: leaves\[0\] and out share memory") as refused:
        tree.pack([out[2:4], torch.ones(2)], out=out)
    # (read before anything is written there: its refusal is torch.cat's rule, not that a write changed it first)
    assert "would change the leaf before it is read" not in str(refused.value)
    assert "refused as torch.cat(out=) refuses it" in str(refused.value)


def test_unflatten_flatten_up_to_and_broadcast_prefix_refuse_a_tree_given_as_the_spec():
    """A tree given where the structure is expected raised a bare AttributeError ('dict' object has no attribute
    'unflatten' / 'flatten_up_to' / 'num_leaves'). A TypeError names the function and what was given."""
    params = {"w": torch.ones(2), "b": [torch.ones(1)]}
    for call, who in ((lambda: tree.unflatten(params, [1, 2]), "unflatten"),
                      (lambda: tree.flatten_up_to(params, params), "flatten_up_to"),
                      (lambda: tree.broadcast_prefix(1.0, params), "broadcast_prefix")):
        with pytest.raises(TypeError, match=rf"^{who}: spec is a dict, expected a tree structure"):
            call()
    spec = tree.flatten(params)[1]
    assert tree.unflatten(spec, [1, 2]) == {"w": 2, "b": [1]} and tree.broadcast_prefix(1.0, spec) == [1.0, 1.0]


def test_structure_difference_refuses_a_tree_given_as_the_spec_and_unflatten_leaves_that_are_no_sequence():
    """structure_difference given a tree as the spec raised a bare AttributeError ('dict' object has no attribute
    'is_leaf'), as unflatten, flatten_up_to and broadcast_prefix did; unflatten given leaves that are no sequence
    (an int) Python's bare "'int' object is not iterable". A TypeError names the function and what was given."""
    params = {"w": torch.ones(2), "b": [torch.ones(1)]}
    with pytest.raises(TypeError, match=r"^structure_difference: spec is a dict, expected a tree structure"):
        tree.structure_difference(params, params)
    spec = tree.flatten(params)[1]
    with pytest.raises(TypeError, match=r"^unflatten: leaves is an int, expected a sequence of 2 leaves"):
        tree.unflatten(spec, 5)
    assert tree.structure_difference(spec, {"w": 1}) == "params has entries ['w'], expected ['b', 'w']"
    assert tree.unflatten(spec, iter([1, 2])) == {"w": 2, "b": [1]}
    with pytest.raises(TypeError, match=r"^unflatten: leaves is an int, expected a sequence of 1 leaf$"):
        tree.unflatten(tree.flatten({"w": 1})[1], 5)  # (not '1 leaves')


def test_unflatten_refuses_leaves_given_as_a_mapping_a_set_or_a_string():
    """unflatten's leaves are taken in order (5d30913 refused those that are no sequence, as its docstring says, by
    iterating them): a dict of leaves gave its keys as the leaves ({'w': 'b', 'b': ['w']}), a set its elements in an
    arbitrary order, a string its characters, each without a word. A TypeError names what was given; a list, a tuple
    or an iterator is taken as before."""
    params = {"w": torch.ones(2), "b": [torch.ones(1)]}
    spec = tree.flatten(params)[1]
    for leaves, kind in (({"b": 1, "w": 2}, "dict"), ({1, 2}, "set"), ("ab", "str"), (b"ab", "bytes")):
        with pytest.raises(TypeError, match=rf"^unflatten: leaves is a {kind}, expected a sequence of 2 leaves"):
            tree.unflatten(spec, leaves)
    assert tree.unflatten(spec, (1, 2)) == tree.unflatten(spec, iter([1, 2])) == {"w": 2, "b": [1]}


def test_pack_and_unpack_refuse_what_is_not_a_tensor_naming_it():
    """A leaf of ``pack`` or the buffer of ``unpack`` that is not a tensor (a list, a number) raised a bare
    AttributeError ("'list' object has no attribute 'numel'", "'int' object has no attribute 'dim'"), and
    ``unpack`` of a shape given as an int (``[3]``, as ``view(3)`` takes it) Python's "'int' object is not
    iterable". Each is a TypeError naming the argument; an int shape is the 1-d shape of that size."""
    with pytest.raises(TypeError, match=r"pack: leaves\[1\] is a list, expected a tensor"):
        tree.pack([torch.ones(2), [1.0]])
    with pytest.raises(TypeError, match=r"unpack: flat is an int, expected a 1-d tensor"):
        tree.unpack(5, [(1,)])
    with pytest.raises(TypeError, match=r"unpack: shapes\[1\] = 'ab' is not a shape"):
        tree.unpack(torch.zeros(3), [(1,), "ab"])
    views = tree.unpack(torch.arange(5.0), [3, (2,)])
    assert [tuple(v.shape) for v in views] == [(3,), (2,)] and torch.equal(views[0], torch.arange(3.0))
    with pytest.raises(TypeError, match=r"pack: out is a list, expected a 1-d tensor"):  # (its numel: bare)
        tree.pack([torch.ones(2)], out=[0.0, 0.0])
    with pytest.raises(TypeError, match=r"^pack: leaves is a Tensor, expected a sequence of tensors"):
        tree.pack(torch.ones(2))  # (iterated: its elements as 0-d leaves, without a word)
    with pytest.raises(TypeError, match=r"^unpack: shapes is an int, expected a sequence of shapes"):
        tree.unpack(torch.zeros(3), 3)  # ('int' object is not iterable)
    assert torch.equal(tree.pack(t for t in (torch.ones(2), torch.zeros(1))), torch.tensor([1.0, 1.0, 0.0]))


@pytest.mark.parametrize("flat, shapes, pattern", [
    (torch.zeros(5), [(2,), (4,)], r"shapes cover 6 elements, flat buffer has 5"),
    (torch.zeros(5), [(-1,), (6,)], r"shapes\[0\] = \(-1,\) has a negative size"),
    (torch.zeros(2, 3), [(3,), (3,)], r"expected a 1-d flat buffer, got shape \(2, 3\)"),
])
def test_unpack_refuses_shapes_that_do_not_fit_the_buffer_before_any_view(flat, shapes, pattern):
    """Shapes covering more elements than the buffer (or of a negative size, or a buffer that is not 1-d)
    raised torch's bare "shape '[4]' is invalid for input of size 3" from the view of the leaf that ran out;
    the fewer-elements case alone was named. Each is refused naming the sizes, before any view is made."""
    with pytest.raises(ValueError, match=pattern):
        tree.unpack(flat, shapes)



def test_leaf_paths_write_each_key_as_it_is_where_equal_keys_of_other_types_make_one_spec():
    """``{1: x}``, ``{True: x}`` and ``{1.0: x}`` are one spec to optree (keys compare by ``==``): the memo of
    the paths gave the first one's text to the others (an error about ``{True: w}`` named ``params[1]``). Each
    is written with its own keys, whichever came first, and the path reaches its leaf."""
    for order in ((1, True, 1.0), (True, 1.0, 1), (1.0, 1, True)):
        for key in order * 2:
            t = {key: [torch.ones(1), {key: torch.ones(2)}], "a": torch.ones(3)}
            paths = tree.leaf_paths(t, root="grads")
            assert paths == [f"grads[{key!r}][0]", f"grads[{key!r}][1][{key!r}]", "grads['a']"], (order, key)
            for path, leaf in zip(paths, tree.flatten(t)[0]):
                assert eval(path, {"grads": t}) is leaf  # noqa: S307
    opt = sofx.adam()
    opt.init({1: torch.ones(2)})  # (its paths memoized first)
    with pytest.raises(sofx.LeafError, match=r"^params\[True\]: "):
        opt.init({True: torch.ones(2, dtype=torch.int64)})

def test_leaf_paths_write_each_key_as_it_is_where_equal_keys_of_the_same_type_are_written_otherwise():
    """Keys of one type can be equal and written otherwise: tuples holding equal items of other types (``(1, 'a')``
    and ``(True, 'a')``), ``0.0`` and ``-0.0``. Their specs are one to optree, and memoizing the paths by the
    keys' types gave the first one's text to the others. Each is written with its own keys, whichever came first,
    and the path reaches its leaf."""
    for keys in (((1, "a"), (True, "a"), (1.0, "a")), (0.0, -0.0), (frozenset({1}), frozenset({True}))):
        for order in (keys, keys[::-1]):
            for key in order * 2:
                t = {key: [torch.ones(1), {key: torch.ones(2)}]}
                paths = tree.leaf_paths(t, root="grads")
                assert paths == [f"grads[{key!r}][0]", f"grads[{key!r}][1][{key!r}]"], (order, key)
                for path, leaf in zip(paths, tree.flatten(t)[0]):
                    assert eval(path, {"grads": t}) is leaf  # noqa: S307


@pytest.mark.skipif(not hasattr(sys, "get_int_max_str_digits"), reason="this Python writes ints of any size in decimal")
def test_an_int_key_too_long_for_decimal_text_is_written_in_hex_in_leaf_paths():
    """Python refuses the decimal text of an int of more than ``sys.get_int_max_str_digits()`` digits: such a
    dict key is written in hex (exact, and still a Python expression that reaches the leaf); other keys'
    paths are unchanged."""
    huge, neg = 10 ** 5000, -(10 ** 4400)
    t = {huge: torch.ones(1), neg: [torch.ones(2)], 7: torch.ones(3), "a": NT(torch.ones(1), None)}
    paths = tree.leaf_paths(t)
    assert f"params[{hex(huge)}]" in paths and f"params[{hex(neg)}][0]" in paths
    assert "params[7]" in paths and "params['a'].a" in paths
    for path, leaf in zip(paths, tree.flatten(t)[0]):
        assert eval(path, {"params": t}) is leaf  # noqa: S307
    assert tree.leaf_paths({huge: 1}, root="grads") == [f"grads[{hex(huge)}]"]
    # the limit is the process's: a key of 1000 digits under a limit of 640
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        assert tree.leaf_paths({10 ** 999: [1], 10 ** 500: 2}) == [f"params[{10 ** 500}]",
                                                                   f"params[{hex(10 ** 999)}][0]"]
    finally:
        sys.set_int_max_str_digits(old)


@pytest.mark.skipif(not hasattr(sys, "get_int_max_str_digits"), reason="this Python writes ints of any size in decimal")
def test_a_structure_difference_under_a_huge_int_key_is_named_in_hex():
    huge = 10 ** 5000
    spec = tree.flatten({huge: {"w": 1, "b": 2}})[1]
    with pytest.raises(StructureError, match=rf"\(grads\[{hex(huge)}\] has entries \['w'\], expected \['b', 'w'\]"):
        tree.flatten_up_to(spec, {huge: {"w": 1}}, "grads")


@pytest.mark.skipif(not hasattr(sys, "get_int_max_str_digits"), reason="this Python writes ints of any size in decimal")
def test_spec_text_of_a_spec_with_a_huge_int_key_names_its_root_type_after_its_article():
    """Where Python refuses a spec's text (a key too long for decimal), spec_text wrote 'PyTreeSpec(a OrderedDict of
    1 leaves)'; sofx.tree.article before the type's name, and 'leaf' for one leaf."""
    spec = tree.flatten(collections.OrderedDict([(10 ** 5000, torch.ones(1))]))[1]
    assert tree.spec_text(spec) == "PyTreeSpec(an OrderedDict of 1 leaf)"
    assert tree.spec_text(tree.flatten({10 ** 5000: 1, 2: 3})[1]) == "PyTreeSpec(a dict of 2 leaves)"


def test_a_namedtuple_of_another_class_of_the_same_name_is_named_as_another_class():
    """A NamedTuple class defined again (a notebook cell run twice, a reloaded module) is another class of the same
    name: the refusal read 'grads is a NT, expected a NT'. It says that the two classes differ."""
    again = collections.namedtuple("NT", "a b")
    spec = tree.flatten(NT(torch.ones(1), torch.ones(1)))[1]
    with pytest.raises(StructureError, match=r"\(grads is a NT, another class than the NT of params of the same "
                                             r"name \(defined again\?"):
        tree.flatten_up_to(spec, again(torch.ones(1), torch.ones(1)), "grads")
    with pytest.raises(StructureError, match=r"hparams is a NT, another class than the NT of params of the same "
                                             r"name \(defined again\?"):
        tree.broadcast_prefix(again(1, 2), spec, is_leaf=lambda x: isinstance(x, int))


def test_tree_map_over_trees_of_other_structures_names_the_first_difference():
    """tree_map(fn, a, b) where b departs from a raised optree's bare ValueError ("Expected an instance of dict
    ... got list", or the two specs only): a StructureError names the first place, rooted at rest[k], before fn is
    called. Where they match (a None standing for an empty subtree, a dict in another key order, None at a leaf
    of the first tree), the result is optree's."""
    a = {"w": torch.ones(2), "b": torch.zeros(1), "empty": []}
    calls = []

    def add(x, y):
        calls.append(1)
        return x + (0 if y is None else y)

    for bad, where in (({"w": torch.ones(2), "c": torch.ones(1), "empty": []}, r"rest\[0\] has entries"),
                       ({"w": torch.ones(2), "b": torch.ones(1), "empty": [torch.ones(1)]},
                        r"rest\[0\]\['empty'\] has entries \[0\], expected \[\]"),
                       ([torch.ones(2), torch.ones(1)], r"rest\[0\] is a list, expected a dict")):
        with pytest.raises(StructureError, match=r"^rest\[0\] does not have the structure of tree: .*" + where):
            tree.tree_map(add, a, bad)
        with pytest.raises(StructureError, match=r"^rest\[1\] does not have the structure of tree"):
            tree.tree_map(lambda x, y, z: x, a, a, bad)
    assert not calls
    b = collections.OrderedDict([("w", torch.ones(2)), ("b", None), ("empty", None)])
    got = tree.tree_map(add, a, b)
    assert list(got) == list(a) and got["empty"] == []
    assert torch.equal(got["w"], torch.full((2,), 2.0)) and torch.equal(got["b"], torch.zeros(1))


def test_tree_map_with_an_fn_that_is_not_callable_names_it_even_over_an_empty_tree():
    """tree_map(3, tree) raised Python's bare "'int' object is not callable" from inside optree, and over a tree
    without leaves returned it without a word; tree_map(tree, fn) (the arguments swapped) said "'dict' object is
    not callable". A TypeError names tree_map and what was given (and the order, where the tree is callable)."""
    params = {"w": torch.ones(2)}
    for fn, tr in ((3, params), (3, {}), (None, [])):
        with pytest.raises(TypeError, match=rf"^tree_map: fn is {tree.article(type(fn).__name__)} \({fn!r}\), "
                                            r"expected a callable"):
            tree.tree_map(fn, tr)
        with pytest.raises(TypeError, match=r"^tree_map: fn is a"):
            tree.tree_map(fn, tr, tr)
    with pytest.raises(TypeError, match=r"^tree_map: fn is a dict .*expected a callable.*tree_map\(fn, tree\)"):
        tree.tree_map(params, torch.neg)


def test_refusals_naming_a_type_put_the_right_article_before_it():
    """About 40 refusals wrote "is a {type(x).__name__}": "groups is a int", "opt is a Adam", "schedule 0 is a int".
    They put :func:`sofx.tree.article`'s article before the type's name, as the rest of sofx does."""
    import sofx.serial
    import sofx.transforms as tx

    for call, words in ((lambda: tx.group_hparams({"w": "a"}, 5), "groups is an int; expected a mapping"),
                        (lambda: sofx.loss_scale.grad_scaler().scale(7), "scaler_state is an int; this scaler's "
                                                                         "state is a GradScalerState"),
                        (lambda: sofx.schedules.join([1], []), "join: schedule 0 is an int, not callable"),
                        (lambda: sofx.serial.check_opt(torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])),
                         "opt is an Adam; expected a sofx.Adam"),
                        (lambda: tx.chain(tx.identity(), 1.5), "argument 1 is a float, expected")):
        with pytest.raises(sofx.SofxError, match=re.escape(words)):
            call()


def test_pack_and_numel_of_refuse_a_lazy_modules_uninitialized_parameter_naming_it():
    """A lazy module's parameter before its first forward (an UninitializedParameter: no shape, no data) among
    pack's or numel_of's leaves raised torch's ValueError ('Attempted to use an uninitialized parameter in <method
    'storage_offset' ...>') naming no leaf: a ValueError names the function and the leaf, as sofx.Adam refuses it."""
    lazy = torch.nn.LazyLinear(2).weight
    for who, call in (("pack", lambda: tree.pack([torch.ones(2), lazy])),
                      ("numel_of", lambda: tree.numel_of([torch.ones(2), lazy]))):
        with pytest.raises(ValueError, match=rf"^{who}: leaves\[1\] is an uninitialized parameter \(a lazy module's, "
                                             r"before its first forward\).*run a forward pass first"):
            call()


def test_paths_index_and_named_leaves_name_what_they_refuse():
    """The public helpers checked nothing: named_leaves of a by_path that is no mapping raised Python's bare
    AttributeError ("'NoneType' object has no attribute 'get'"), paths_index(None) a bare TypeError ("'NoneType'
    object is not iterable"), and paths_index of a str indexed its characters. Each is a TypeError naming the
    function, the argument and what was given."""
    by_path = tree.paths_index(tree.leaf_paths({"w": torch.ones(1), "b": torch.ones(1)}))
    assert tree.named_leaves(by_path, "w") == [1]
    for bad in (None, [1], "params['w']"):
        with pytest.raises(TypeError, match=r"^named_leaves: by_path is (a|an) \w+, expected a mapping"):
            tree.named_leaves(bad, "w")
    with pytest.raises(TypeError, match=r"^named_leaves: name is an int, expected a str"):
        tree.named_leaves(by_path, 3)
    for bad, what in ((None, "a NoneType"), ("params", "a str"), ({"a": 1}.keys(), "a dict_keys")):
        with pytest.raises(TypeError, match=rf"^paths_index: paths is {what}, expected a sequence of str"):
            tree.paths_index(bad)
    with pytest.raises(TypeError, match=r"^paths_index: paths\[1\] is an int, expected a str"):
        tree.paths_index(["params[0]", 1])


def test_pack_under_vmap_makes_a_batched_buffer_and_refuses_an_out_shared_by_the_batch(rng):
    """tree.pack under torch.func.vmap without out= raised torch's bare "vmap: inplace arithmetic(self,
    *extra_args) is not possible ..." (a new buffer is not batched, the leaves are). The buffer is made from the
    leaves (each member's leaves packed, cast to the dtype); an out= that vmap does not batch, where a leaf is
    batched, is a LeafError naming it (a batched out still packs in place)."""
    a, b = torch.randn(3, 4, generator=rng), torch.randn(3, 2, 2, generator=rng)
    got = torch.func.vmap(lambda x, y: tree.pack([x, y]))(a, b)
    assert torch.equal(got, torch.cat([a, b.reshape(3, 4)], dim=1))
    got = torch.func.vmap(lambda x, y: tree.pack([x, y], dtype=torch.float64))(a, b)
    assert got.dtype == torch.float64 and torch.equal(got, torch.cat([a, b.reshape(3, 4)], dim=1).double())
    one = torch.randn(2, generator=rng)  # (a leaf vmap does not batch beside a batched one: each member's copy)
    got = torch.func.vmap(lambda x: tree.pack([one, x]))(a)
    assert torch.equal(got, torch.cat([one.expand(3, 2), a], dim=1))
    out = torch.zeros(3, 8)
    torch.func.vmap(lambda x, y, o: tree.pack([x, y], out=o))(a, b, out)
    assert torch.equal(out, torch.cat([a, b.reshape(3, 4)], dim=1))
    shared = torch.zeros(8)
    with pytest.raises(sofx.LeafError, match=r"^pack: leaves\[1\] is batched by torch.func.vmap, out is not"):
        torch.func.vmap(lambda x: tree.pack([one, x, one], out=shared))(torch.randn(3, 4, generator=rng))
    assert not shared.any()
