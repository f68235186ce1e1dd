"""Undo records as objects: what a caller can do with one besides undoing it (copy it, re-wrap its leaves,
map it as a pytree, save it), and that none of those lets a step be undone twice.

A record can be used once: its undo (or undo_redo) marks it used. A second undo of the same step would read
kept tensors the first one handed back to the caller (an undo without donation returns a snapshot's kept
tensors as the restored values; a donated update then writes into them), or invert a state stepped since
with another gradient: wrong values, silently. Every copy of a record therefore shares whether it was used.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any, Callable

import pytest
import torch
import torch.utils._pytree as torch_pytree

import sofx
from sofx.kernels.base import AdamVariant
from sofx.undo_record import UndoRecord

from helpers import clone_tree, trees_equal


def _rewrap(rec: UndoRecord) -> UndoRecord:
    return UndoRecord(rec.leaves, rec.spec, rec.variant)


def _rewrap_copied_leaves(rec: UndoRecord) -> UndoRecord:
    return UndoRecord([copy.copy(leaf) for leaf in rec.leaves], rec.spec, rec.variant)


def _rewrap_mapped_leaves(rec: UndoRecord) -> UndoRecord:
    mapped = [torch_pytree.tree_map(lambda t: t, leaf) for leaf in rec.leaves]
    return UndoRecord(mapped, rec.spec, rec.variant)


def _unflatten(rec: UndoRecord) -> UndoRecord:
    children, spec = torch_pytree.tree_flatten(rec)
    return torch_pytree.tree_unflatten(children, spec)


COPIES: dict[str, Callable[[UndoRecord], UndoRecord]] = {
    "copy.copy": copy.copy,
    "copy.deepcopy": copy.deepcopy,
    "UndoRecord(rec.leaves, ...)": _rewrap,
    "UndoRecord(copied leaves, ...)": _rewrap_copied_leaves,
    "UndoRecord(tree-mapped leaves, ...)": _rewrap_mapped_leaves,
    "tree_unflatten(tree_flatten(rec))": _unflatten,
}


def _problem(seed: int = 5) -> tuple[sofx.Adam, dict, dict, dict, sofx.AdamState]:
    """An optimizer whose records keep whole snapshots (undo="exact"), a warmed state and two gradients."""
    gen = torch.Generator().manual_seed(seed)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, undo="exact", backend="reference")
    params = {"a": torch.randn(40, generator=gen), "w": torch.randn(3, 5, generator=gen)}
    state = opt.init(params)
    for _ in range(3):
        params, state, _ = opt.update(params, {k: torch.randn(p.shape, generator=gen) for k, p in params.items()},
                                      state)
    grads = [{k: torch.randn(p.shape, generator=gen) for k, p in params.items()} for _ in range(2)]
    return opt, params, grads[0], grads[1], state


@pytest.mark.parametrize("make_copy", list(COPIES.values()), ids=list(COPIES))
@pytest.mark.parametrize("first_use", ["undo", "undo_redo"])
def test_a_copy_of_a_record_cannot_undo_the_step_a_second_time(make_copy, first_use):
    """A record of a donated update owns its kept copies; its undo without donation hands them back as the
    restored values, and an undo_redo's record takes them over. A copy made before that use (any way a
    caller can make one) must not undo the step again: the state stepped once more (count back at t, its
    kept values written in place by a donated update) would be 'restored' from overwritten memory. It is
    refused, and nothing changes; so is a copy made after the use."""
    opt, params, g1, g2, state = _problem()
    p1, s1, rec = opt.update(*clone_tree((params, g1, state)), donate=True)
    twin = make_copy(rec)
    if first_use == "undo":
        p0, s0 = opt.undo(p1, s1, rec)  # (the kept copies, handed back)
        p2, s2, _ = opt.update(p0, g2, s0, donate=True)  # written in place: the step counts are back at t
    else:
        p2, s2, _ = opt.undo_redo(p1, s1, rec, g2, donate=True)
    assert rec.used and twin.used and make_copy(rec).used
    before = clone_tree((p2, s2))
    for again in (twin, make_copy(rec)):
        with pytest.raises(sofx.UndoError, match="already used"):
            opt.undo(p2, s2, again, donate=True)
        with pytest.raises(sofx.UndoError, match="already used"):
            opt.undo_redo(p2, s2, again, g1, donate=True)
    assert trees_equal((p2, s2), before)


@pytest.mark.parametrize("make_copy", list(COPIES.values()), ids=list(COPIES))
def test_a_copy_of_an_unused_record_undoes_bitwise_and_uses_up_the_original(make_copy):
    """A copy undoes the step as the record itself would (bit for bit: whole snapshots); then the original
    is used too."""
    opt, params, g1, _, state = _problem()
    p1, s1, rec = opt.update(params, g1, state)
    twin = make_copy(rec)
    p0, s0 = opt.undo(p1, s1, twin)
    assert trees_equal((p0, s0), (params, state))
    assert rec.used
    with pytest.raises(sofx.UndoError, match="already used"):
        opt.undo(p1, s1, rec)


def _pickle(obj: Any) -> None:
    pickle.dumps(obj)


def _torch_save(obj: Any) -> None:
    torch.save(obj, io.BytesIO())


@pytest.mark.parametrize("save", [_pickle, _torch_save], ids=["pickle", "torch.save"])
@pytest.mark.parametrize("what", ["record", "leaf", "a tree holding a record"])
def test_a_record_cannot_be_pickled_or_saved(save, what):
    """A saved record, loaded, could not know whether its step was undone since (nor could its kept tensors
    still be the caller's): it would undo the step a second time. Saving one is refused, naming the way out."""
    opt, params, g1, _, state = _problem()
    _, _, rec = opt.update(params, g1, state)
    saved = {"record": rec, "leaf": rec.leaves[0], "a tree holding a record": {"params": params, "rec": rec}}[what]
    with pytest.raises(sofx.UndoError, match="cannot be pickled"):
        save(saved)
    assert not rec.used


def test_a_record_is_made_of_its_leaves_spec_and_variant_and_says_nothing_of_donation():
    """Whether a record's kept tensors are its own is per leaf (``LeafUndo.owns_kept``: a chunk snapshot's
    are, donated or not; an undo_redo's record takes over owned ones, donated or not); the ``donate`` of the
    call that made it told nothing the library or a caller could use, and is gone. The old form of the
    constructor, with it, is refused rather than read as another record."""
    opt, params, g1, _, state = _problem()
    _, _, rec = opt.update(params, g1, state, donate=False)
    assert not hasattr(rec, "donated")
    twin = UndoRecord(rec.leaves, rec.spec, rec.variant)
    assert twin.variant == rec.variant and twin.leaves == rec.leaves and not twin.used
    with pytest.raises(TypeError):
        UndoRecord(rec.leaves, rec.spec, False, rec.variant)
    with pytest.raises(sofx.UndoError, match="variant: expected an AdamVariant, got bool"):
        UndoRecord(rec.leaves, rec.spec, False)
    assert isinstance(rec.variant, AdamVariant)


@pytest.mark.parametrize("bad", ["a tensor", "a record"])
def test_a_record_of_something_other_than_leaf_records_is_refused_naming_the_leaf(bad):
    """``UndoRecord(leaves, ...)`` with a leaf that is neither a LeafUndo nor None (a tensor, a whole record)
    failed later with an AttributeError deep in undo (or in ``used``); refused when made, naming its index."""
    opt, params, g1, _, state = _problem()
    _, _, rec = opt.update(params, g1, state)
    wrong = torch.zeros(3) if bad == "a tensor" else rec
    with pytest.raises(sofx.UndoError, match=rf"leaves\[1\]: expected a LeafUndo or None, got {type(wrong).__name__}"):
        UndoRecord([rec.leaves[0], wrong], rec.spec, rec.variant)
    assert not rec.used


@pytest.mark.parametrize("field, bad, pattern", [
    ("strategy", "foo", r"strategy: expected one of \('algebraic', .*\), got 'foo'"),
    ("grad", None, r"grad: expected a tensor \(the step's gradient\), got NoneType"),
    ("scalars", (1e-2, 0.9), r"scalars: expected a sofx.AdamScalars \(the step's\), got tuple"),
    ("count_before", None,
     r"count_before: expected a tensor or an int \(the step count before the step\), got NoneType"),
    ("p_old", 1.0, r"p_old: expected a tensor or None, got float"),
    ("chunks", torch.zeros(1, dtype=torch.int64), r"chunks: a chunk_snapshot record, and only one, has the indices"),
])
def test_a_leaf_record_of_fields_that_are_not_a_steps_is_refused_when_made_naming_the_field(field, bad, pattern):
    """``LeafUndo(...)`` built by hand (its docstring says how) took anything: an unknown strategy was a bare
    ValueError, not a SofxError; a None gradient or a tuple of scalars gave an AttributeError deep in undo, and a
    None count_before an undo that returned a state whose count was None, without a word. Each is refused when
    made, an UndoError naming the field."""
    opt, params, g1, _, state = _problem()
    _, _, rec = opt.update(params, g1, state)
    leaf = rec.leaves[0]
    fields = dict(strategy=leaf.strategy, grad=leaf.grad, scalars=leaf.scalars, count_before=leaf.count_before,
                  p_old=leaf.p_old, m_old=leaf.m_old, v_old=leaf.v_old, chunks=leaf.chunks)
    fields[field] = bad
    with pytest.raises(sofx.UndoError, match=pattern):
        sofx.LeafUndo(**fields)
    again = sofx.LeafUndo(**{**fields, field: getattr(leaf, field)})  # (the step's own fields make one)
    assert again.strategy == leaf.strategy and not again.used


def test_a_record_whose_spec_is_not_the_params_structure_is_refused_when_made():
    """``UndoRecord(leaves, None, variant)`` was taken, and its undo ran as an update (the undo's structure check
    is skipped for a record without a spec, and its step-size check counts as a step's); a spec of another number
    of leaves than the record's was found only at undo. Both are refused when made, naming the spec."""
    opt, params, g1, _, state = _problem()
    _, _, rec = opt.update(params, g1, state)
    with pytest.raises(sofx.UndoError, match=r"spec: expected the structure of the params \(an optree PyTreeSpec\), "
                                             r"got NoneType"):
        UndoRecord(rec.leaves, None, rec.variant)
    with pytest.raises(sofx.UndoError, match=r"spec has 2 leaves, the record 1"):
        UndoRecord(rec.leaves[:1], rec.spec, rec.variant)
    assert not rec.used


@pytest.mark.parametrize("make_copy", list(COPIES.values()), ids=list(COPIES))
def test_a_copy_of_a_record_whose_kept_tensor_was_written_since_the_step_refuses_the_undo(make_copy):
    """A record of an update without donation keeps the caller's params themselves (undo="exact": whole
    snapshots); the caller writing into one since the step makes its undo restore the values written (refused,
    naming the leaf and the tensor). Every copy of the record made after the write refuses it too (a deep copy's
    kept tensors are copies of the written ones), and nothing is used up."""
    opt, params, g1, _, state = _problem()
    p1, s1, rec = opt.update(params, g1, state)
    with torch.no_grad():
        params["w"].copy_(p1["w"])  # (the new values into the model's parameter, as torch.optim leaves them)
    twin = make_copy(rec)
    for r in (twin, rec):
        with pytest.raises(sofx.UndoError, match=r"^params\['w'\]: the old parameter the record keeps was "
                                                 r"changed in place since the step \(its version (\d+), (?!\1)\d+ "
                                                 r"at the step\)"):
            opt.undo(p1, s1, r)
    assert not rec.used


def test_a_deep_copy_made_before_a_write_into_the_kept_tensor_undoes_from_its_own_copies():
    """A deep copy made before the caller wrote into the tensors the record keeps holds copies of the values the
    step kept: its undo restores them (bit for bit), though the record's own refuses."""
    opt, params, g1, _, state = _problem()
    before = clone_tree((params, state))
    p1, s1, rec = opt.update(params, g1, state)
    twin = copy.deepcopy(rec)
    with torch.no_grad():
        params["w"].copy_(p1["w"])
    with pytest.raises(sofx.UndoError, match="the old parameter the record keeps was changed in place"):
        opt.undo(p1, s1, rec)
    assert trees_equal(opt.undo(p1, s1, twin), before)


def test_a_record_tree_mapped_to_new_tensors_is_not_refused_for_their_versions():
    """A pytree map of a record to new tensors (clones) gives a record of tensors whose versions tell nothing of
    the step's (a clone's is 0 where the gradient the step took had been written before the step): not taken as
    written since. Its undo restores the state bit for bit."""
    opt, params, g1, _, state = _problem()
    for g in g1.values():
        g.mul_(1.0)  # (written before the step: version 1 when the record is made)
    before = clone_tree((params, state))
    p1, s1, rec = opt.update(params, g1, state)
    cloned = torch_pytree.tree_map(torch.clone, rec)
    assert trees_equal(opt.undo(p1, s1, cloned), before)


@pytest.mark.parametrize("written, named", [("params", "the old parameter"), ("mu", "the old first moment"),
                                            ("nu", "the old second moment"), ("donated update", "the old parameter")])
def test_each_kept_tensor_of_the_caller_written_since_the_step_is_named(written, named):
    """The kept tensors of an update without donation are the caller's params and moments: a write into any of
    them since the step (a moment reset in place, a donated update taken again from the same state) is refused
    naming the leaf and which tensor, the record unused."""
    opt, params, g1, g2, state = _problem()
    p1, s1, rec = opt.update(params, g1, state)
    if written == "donated update":
        opt.update(params, g2, state, donate=True)  # (writes the record's kept params and moments)
    else:
        target = params if written == "params" else getattr(state, written)
        target["a"].zero_()
    with pytest.raises(sofx.UndoError, match=rf"^params\['a'\]: {named} the record keeps was changed in place"):
        opt.undo_redo(p1, s1, rec, g2)
    assert not rec.used


@pytest.mark.parametrize("write", ["add_", "zero_"])
@pytest.mark.parametrize("call", ["undo", "undo_redo"])
def test_a_step_count_written_in_place_since_the_step_refuses_the_undo(write, call):
    """A record keeps the old state's count tensor itself (``count_before``), which its undo returns as the state's
    count: a ``state.count[...] += 1`` or ``zero_()`` on it since the step made the undo return the count written
    (6 where 1 was due), without a word, its version not being taken. Refused naming the leaf and the count, the
    record unused; a count left alone undoes as before."""
    opt, params, g1, g2, state = _problem()
    before = clone_tree((params, state))
    p1, s1, _ = opt.update(params, g1, state)
    p2, s2, rec2 = opt.update(p1, g2, s1)
    getattr(s1.count["a"], write)(*([5] if write == "add_" else []))
    with pytest.raises(sofx.UndoError, match=r"^params\['a'\]: the step count tensor of the state the step was taken "
                                             r"from was changed in place since the step"):
        opt.undo(p2, s2, rec2) if call == "undo" else opt.undo_redo(p2, s2, rec2, g1)
    assert not rec2.used
    p3, s3, rec3 = opt.update(params, g2, state)
    assert trees_equal(opt.undo(p3, s3, rec3), before)


def test_an_undo_record_of_leaves_that_are_no_sequence_is_refused_naming_them():
    """UndoRecord(None, spec, variant) or of one LeafUndo not in a list raised Python's bare "'NoneType' object is
    not iterable"; an UndoError names the argument and what it expects."""
    opt, params, g1, _, state = _problem()
    _, _, rec = opt.update(params, g1, state)
    for bad, kind in ((None, "NoneType"), (rec.leaves[0], "LeafUndo")):
        with pytest.raises(sofx.UndoError, match=rf"^leaves: expected a sequence of LeafUndo \(or None\), one per leaf "
                                                 rf"of the params, got {kind}"):
            UndoRecord(bad, rec.spec, rec.variant)
    assert not rec.used


def test_records_of_one_layout_have_one_structure_whatever_their_tensors_versions():
    """Records of two steps of the same params (unused) have the same pytree structure, as before versions were
    taken: a tree_map over both (a batch of records stacked for vmap) raised torch's 'Node context mismatch for
    custom node type LeafUndo' where one gradient had been written before its step (its version 1, the other's 0).
    The map keeps the first record's versions for its very tensors only."""
    opt, params, g1, g2, state = _problem()
    for g in g2.values():
        g.mul_(1.0)  # (written before the step: version 1 when the record is made)
    p1, s1, rec1 = opt.update(params, g1, state)
    _, _, rec2 = opt.update(params, g2, state)
    assert torch_pytree.tree_structure(rec1) == torch_pytree.tree_structure(rec2)
    firsts = torch_pytree.tree_map(lambda a, b: a, rec1, rec2)
    with torch.no_grad():
        params["a"].copy_(p1["a"])  # (the caller's params the first record keeps, written since its step)
    with pytest.raises(sofx.UndoError, match=r"^params\['a'\]: the old parameter the record keeps was changed"):
        opt.undo_redo(p1, s1, firsts, g2)
