"""In-place writes (``donate=True``, ``param_copies``) that cannot be done, or would overwrite what the call
still reads, are refused naming the leaf before anything is written, on every backend; layouts that only look
alike (disjoint views of one buffer, interleaved strided views, a gradient read by two leaves) are not."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import vmap

import sofx
from sofx.kernels import donation

from helpers import clone_tree

BACKENDS = ["reference", "cpu", "cpu_fast"]


def _tree(gen: torch.Generator, n: int = 6) -> dict:
    # "a" is the first leaf in order, "z" the last: a refusal of "z" must leave "a" unwritten
    return {"a": torch.randn(n, generator=gen), "z": torch.randn(n, generator=gen)}


def _stepped(backend: str, seed: int = 0):
    """An optimizer, params, grads and a state with nonzero moments."""
    gen = torch.Generator().manual_seed(seed)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    params, grads = _tree(gen), _tree(gen)
    state = opt.init(params)
    params, state, _ = opt.update(params, grads, state)
    return opt, params, _tree(gen), state


def _bits(*trees) -> list:
    return [t.clone() for tree in trees for t in sofx.tree.flatten(tree)[0]]


def _same_bits(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _refused(call, pattern: str, *trees) -> None:
    before = _bits(*trees)
    with pytest.raises(sofx.LeafError, match=pattern):
        call()
    assert _same_bits(before, _bits(*trees)), "an input was written by a call that raised"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_written_tensor_that_overlaps_itself_is_refused(backend):
    opt, params, grads, state = _stepped(backend)
    expanded = torch.randn(1).expand(6)
    p = {**params, "z": expanded}
    _refused(lambda: opt.update(p, grads, state, donate=True), r"params\['z'\]: its elements overlap", p, state)
    s = state._replace(nu={**state.nu, "z": torch.rand(1).expand(6)})
    _refused(lambda: opt.update(params, grads, s, donate=True), r"state.nu\['z'\]: its elements overlap",
             params, s)
    copies = {"a": None, "z": torch.zeros(1).expand(6)}
    _refused(lambda: opt.update(params, grads, state, param_copies=copies),
             r"param_copies\['z'\]: its elements overlap", params, state)
    opt.update(p, {**grads, "z": torch.randn(1).expand(6)}, state)  # read only: fine


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_leaf_that_requires_grad_is_not_donated(backend):
    opt, params, grads, state = _stepped(backend)
    p = {**params, "z": torch.nn.Parameter(params["z"].clone())}
    _refused(lambda: opt.update(p, grads, state, donate=True), r"params\['z'\]: a leaf tensor that requires grad",
             p, state)
    with torch.no_grad():  # autograd allows the write there
        opt.update(p, grads, state, donate=True)
    # a view of such a leaf: autograd refused the write after the leaves before it were written
    whole = torch.nn.Parameter(torch.randn(12))
    v = {**params, "z": whole[:6]}
    _refused(lambda: opt.update(v, grads, state, donate=True),
             r"params\['z'\]: a view of a leaf tensor that requires grad", v, state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inference_tensor_is_not_written_outside_inference_mode(backend):
    """torch refuses an in-place update of an inference tensor outside inference mode: the reference backend
    raised it after writing the leaves before ("a" stepped, "z" not), and the native kernels wrote it. Donated
    leaves, their moments and parameter copies are refused first; under inference_mode the update runs."""
    opt, params, grads, state = _stepped(backend)
    with torch.inference_mode():
        z = params["z"].clone()
        m = state.mu["z"].clone()
        copy = torch.zeros(6)
    p = {**params, "z": z}
    _refused(lambda: opt.update(p, grads, state, donate=True), r"params\['z'\]: an inference tensor", p, state)
    s = state._replace(mu={**state.mu, "z": m})
    _refused(lambda: opt.update(params, grads, s, donate=True), r"exp_avg\['z'\]|mu\['z'\]: an inference",
             params, s)
    _refused(lambda: opt.update(params, grads, state, param_copies={"a": None, "z": copy}),
             r"param_copies\['z'\]: an inference tensor", params, state)
    opt.update(params, grads, state, param_copies={"a": None, "z": torch.zeros(6)})  # an ordinary copy: fine
    with torch.inference_mode():
        opt.update(p, grads, state, donate=True)
    opt.update(p, {**grads, "z": None}, state, donate=True)  # a leaf without a gradient is not written


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_copy_that_requires_grad_is_refused(backend):
    """The kernels write copies as raw memory: a copy that is a leaf requiring grad (the model's own
    nn.Parameter, say) is refused under grad mode, whatever its parameter."""
    opt, params, grads, state = _stepped(backend)
    copies = {"a": None, "z": torch.nn.Parameter(torch.zeros(6))}
    for donate in (False, True):
        _refused(lambda: opt.update(params, grads, state, donate=donate, param_copies=copies),
                 r"param_copies\['z'\]: a leaf tensor that requires grad", params, state, copies)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_tensors_are_refused_by_name(backend):
    opt, params, grads, state = _stepped(backend)
    g = {**grads, "z": grads["z"].to_sparse()}
    for donate in (False, True):
        _refused(lambda: opt.update(params, g, state, donate=donate), r"grads\['z'\]: expected a dense", params,
                 state)
    p = {**params, "z": params["z"].to_sparse()}
    with pytest.raises(sofx.LeafError, match=r"params\['z'\]: expected a dense"):
        opt.init(p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_tensors_that_share_memory_with_another_are_refused(backend):
    opt, params, grads, state = _stepped(backend)
    tied = {"a": params["a"], "z": params["a"]}  # one tensor as two leaves
    tied_state = opt.init(tied)
    _refused(lambda: opt.update(tied, grads, tied_state, donate=True),
             r"params\['a'\] and params\['z'\] share memory", tied, tied_state)
    # a gradient that is the parameter itself: the record's gradient would be overwritten
    g = {**grads, "z": params["z"]}
    _refused(lambda: opt.update(params, g, state, donate=True), r"params\['z'\] and grads\['z'\] share memory",
             params, state)
    # a moment that overlaps another leaf's moment partly
    buf = torch.rand(9)
    s = state._replace(mu={"a": buf[:6], "z": buf[3:]})
    _refused(lambda: opt.update(params, grads, s, donate=True), r"state.mu\['a'\] and state.mu\['z'\] share memory",
             params, s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_copies_that_are_inputs_are_refused(backend):
    opt, params, grads, state = _stepped(backend)
    for copies, pattern in (({"a": None, "z": params["z"]}, r"param_copies\['z'\] and params\['z'\] share"),
                            ({"a": None, "z": grads["a"]}, r"param_copies\['z'\] and grads\['a'\] share"),
                            ({"a": state.nu["a"], "z": None}, r"param_copies\['a'\] and state.nu\['a'\] share")):
        _refused(lambda: opt.update(params, grads, state, param_copies=copies), pattern, params, grads, state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_undo_that_would_overwrite_its_record_is_refused(backend):
    """A non-donated snapshot record keeps the caller's old tensors: an undo donating those very tensors (the
    old params passed instead of the new) would overwrite the snapshot it restores from."""
    gen = torch.Generator().manual_seed(3)
    opt = sofx.adamw(lr=1e-2, backend=backend, undo="exact")
    params, grads = _tree(gen), _tree(gen)
    state = opt.init(params)
    new_p, new_s, rec = opt.update(params, grads, state)
    wrong = {"a": new_p["a"], "z": params["z"]}
    _refused(lambda: opt.undo(wrong, new_s, rec, donate=True),
             r"params\['z'\] and the undo record's saved parameters of params\['z'\] share memory", wrong, new_s)
    old_p, _ = opt.undo(new_p, new_s, rec, donate=True)  # the record is still usable
    assert all(torch.equal(old_p[k], params[k]) for k in params)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_undo_leaves_the_memory_check_to_a_kernel_that_has_every_tensor(backend, monkeypatch):
    """An undo whose every leaf goes to one undo_many call of a backend that checks memory (CHECKS_OVERLAP: algebraic
    records) leaves its memory check to it (no MemorySpans pass over the leaves, ~4 us a leaf), as update does; a
    snapshot record's leaf (restored by a copy) or another backend keeps the pass. The refusals are the same,
    naming the record's gradient as such, nothing written."""
    adam_module = __import__("importlib").import_module("sofx.adam")
    passes = []
    real = adam_module._check_writes
    monkeypatch.setattr(adam_module, "_check_writes", lambda *a, **k: passes.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(6)
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend)
    params = _tree(gen, 50)
    state = opt.init(params)
    for _ in range(20):
        params, state, _ = opt.update(params, _tree(gen, 50), state, undoable=False)
    grads = {k: 0.1 * v for k, v in _tree(gen, 50).items()}

    def fresh():
        p, s, r = opt.update(clone_tree(params), grads, clone_tree(state))
        assert r.strategies() == ["algebraic", "algebraic"]
        passes.clear()
        return p, s, r

    p, s, r = fresh()
    opt.undo(p, s, r, donate=True)
    assert passes == ([] if backend != "reference" else [1])
    p, s, r = sofx.adamw(lr=1e-2, weight_decay=0.1, backend=backend, undo="exact").update(
        clone_tree(params), grads, clone_tree(state))
    passes.clear()
    opt.undo(p, s, r, donate=True)
    assert passes == [1]
    for make, pattern in ((lambda p, r: {"a": p["a"], "z": p["a"]}, r"params\['a'\] and params\['z'\] share memory"),
                          (lambda p, r: {"a": p["a"], "z": r.leaves[1].grad},
                           r"params\['z'\] and the undo record's gradient of params\['z'\] share memory")):
        p, s, r = fresh()
        wrong = make(p, r)
        _refused(lambda: opt.undo(wrong, s, r, donate=True), pattern, wrong, s)
        assert not r.used
    p, s, r = fresh()
    copies = {"a": None, "z": r.leaves[0].grad}
    _refused(lambda: opt.undo(p, s, r, param_copies=copies),
             r"param_copies\['z'\] and the undo record's gradient of params\['a'\] share memory", p, s, copies)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_undo_redo_that_would_overwrite_its_record_is_refused_before_any_leaf_is_written(backend):
    """The same for undo_redo, which steps a whole snapshot's leaf from the record's kept tensors into the leaf:
    the old params or moments of "z" passed back donated, or as its parameter copy, would be written while its
    step reads them. Refused naming the leaf before "a" (redone fused, in place) is written; the record is
    still usable."""
    gen = torch.Generator().manual_seed(4)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    params = _tree(gen, 2000)
    state = opt.init(params)
    for _ in range(20):
        params, state, _ = opt.update(params, _tree(gen, 2000), state, undoable=False)
    grads = {"a": torch.randn(2000, generator=gen), "z": 1e4 * torch.randn(2000, generator=gen)}
    new_p, new_s, rec = opt.update(params, grads, state)
    assert rec.strategies() == ["algebraic", "snapshot"] and rec.leaves[1].p_old is params["z"]
    wrong_p = {"a": new_p["a"], "z": params["z"]}
    _refused(lambda: opt.undo_redo(wrong_p, new_s, rec, grads, grad_scale=0.5, donate=True),
             r"params\['z'\] and the undo record's saved parameters of params\['z'\] share memory", wrong_p, new_s)
    wrong_s = new_s._replace(nu={"a": new_s.nu["a"], "z": state.nu["z"]})
    _refused(lambda: opt.undo_redo(new_p, wrong_s, rec, grads, grad_scale=0.5, donate=True),
             r"state.nu\['z'\] and the undo record's saved second moments of params\['z'\] share memory",
             new_p, wrong_s)
    copies = {"a": None, "z": params["z"]}
    _refused(lambda: opt.undo_redo(new_p, new_s, rec, grads, grad_scale=0.5, param_copies=copies),
             r"param_copies\['z'\] and the undo record's saved parameters of params\['z'\] share memory",
             new_p, new_s, params)
    assert not rec.used
    want_p, _, _ = opt.update(params, grads, state, grad_scale=0.5)
    got_p, _, _ = opt.undo_redo(new_p, new_s, rec, grads, grad_scale=0.5, donate=True)
    assert torch.equal(got_p["z"], want_p["z"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_that_only_look_alike_are_accepted(backend):
    """Disjoint views of one flat buffer (as the offload engine's blocks), interleaved strided views, one
    gradient read by two leaves, empty leaves: donated steps give the bits of separate tensors."""
    gen = torch.Generator().manual_seed(5)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    flat_p, flat_m, flat_v = torch.randn(20, generator=gen), torch.randn(20, generator=gen), \
        torch.rand(20, generator=gen)
    inter = torch.randn(12, generator=gen)
    g = torch.randn(6, generator=gen)
    params = {"a": flat_p[:6], "b": flat_p[6:12], "c": inter[0::2], "d": inter[1::2], "e": flat_p[12:12]}
    state = sofx.AdamState({k: torch.tensor(2) for k in params},
                           {"a": flat_m[:6], "b": flat_m[6:12], "c": flat_m[12:18], "d": torch.randn(6, generator=gen),
                            "e": flat_m[18:18]},
                           {"a": flat_v[:6], "b": flat_v[6:12], "c": flat_v[12:18], "d": torch.rand(6, generator=gen),
                            "e": flat_v[18:18]})
    grads = {"a": g, "b": g, "c": g, "d": g, "e": torch.zeros(0)}
    separate = clone_tree(params), grads, sofx.AdamState(*(clone_tree(x) for x in state))
    want_p, want_s, _ = opt.update(*separate)
    got_p, got_s, _ = opt.update(params, grads, state, donate=True)
    for k in params:
        assert got_p[k].data_ptr() == params[k].data_ptr() or params[k].numel() == 0
        assert torch.equal(got_p[k], want_p[k]) and torch.equal(got_s.nu[k], want_s.nu[k])


@pytest.mark.parametrize("backend", BACKENDS)
def test_hparam_tensors_are_read_when_the_step_is_taken(backend):
    """A schedule that updates a tensor lr in place (as torch's schedulers do with ``fill_``) after the step
    does not change what the record undoes."""
    opt, params, grads, state = _stepped(backend)
    lr = torch.tensor(2e-2)
    new_p, new_s, rec = opt.update(params, grads, state, sofx.AdamHParams(lr=lr, weight_decay=torch.tensor(0.1)))
    want = opt.update(params, grads, state, sofx.AdamHParams(lr=2e-2, weight_decay=0.1))[0]
    lr.fill_(0.5)
    assert all(torch.equal(new_p[k], want[k]) for k in params)
    old_p, old_s = opt.undo(new_p, new_s, rec)
    assert all(torch.allclose(old_p[k], params[k], rtol=1e-6, atol=0) for k in params)


@pytest.mark.parametrize("bad, pattern", [
    (torch.tensor([0.5]), r"grad_scale must be a number or a 0-d floating-point tensor, got a tensor of shape \(1,\)"),
    (torch.full((6,), 0.5), r"got a tensor of shape \(6,\)"),
    (torch.tensor(-1.0), r"grad_scale = -1.0 is invalid"),
    (torch.tensor(2), r"dtype torch.int64"),
    ("2", r"got str"),
    (True, r"got bool"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_grad_scale_is_refused_before_anything_is_written(bad, pattern, backend):
    opt, params, grads, state = _stepped(backend)
    before = _bits(params, state)
    with pytest.raises(sofx.HParamError, match=pattern):
        opt.update(params, grads, state, grad_scale=bad, donate=True)
    assert _same_bits(before, _bits(params, state))
    opt.update(params, grads, state, grad_scale=torch.tensor(0.5))  # a 0-d float tensor is a value


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_tensors_that_start_together_are_refused(backend):
    """A transposed parameter given as its own gradient (a permuted contiguous tensor: one run of memory)."""
    opt = sofx.adamw(lr=1e-2, backend=backend)
    w = torch.randn(2, 3).t()
    params = {"w": w}
    state = opt.init(params)
    _refused(lambda: opt.update(params, {"w": w}, state, donate=True), r"params\['w'\] and grads\['w'\] share",
             params, state)


@pytest.mark.parametrize("n_leaves", [3, 100], ids=["few", "many"])  # swept in Python / with torch operations
def test_an_overlap_among_many_leaves_is_found(n_leaves):
    """Leaves that are disjoint views of one buffer (with gaps) pass; a parameter that overlaps the next by one
    element, or a gradient that starts in a gap and reaches into a parameter, is refused naming the pair."""
    opt = sofx.adamw(lr=1e-2, backend="cpu")
    buf = torch.randn(20 * n_leaves + 1)
    gen = torch.Generator().manual_seed(0)
    params = {f"p{k:03d}": buf[20 * k:20 * k + 10] for k in range(n_leaves)}
    grads = {k: torch.randn(10, generator=gen) for k in params}
    state = opt.init(params)
    opt.update(params, grads, state, donate=True)
    mid = n_leaves // 2
    stretched = {**params, f"p{mid:03d}": buf[20 * mid + 11:20 * mid + 21]}  # its last element: the next's first
    _refused(lambda: opt.update(stretched, grads, state, donate=True),
             rf"params\['p{mid:03d}'\] and params\['p{mid + 1:03d}'\] share memory", stretched, state)
    for start in (20 * mid - 5, 20 * mid + 5):  # read only: from a gap into p_mid, from inside p_mid on
        into = {**grads, "p000": buf[start:start + 10]}
        _refused(lambda: opt.update(params, into, state, donate=True),
                 rf"params\['p{mid:03d}'\] and grads\['p000'\] share memory", params, state)


@pytest.mark.parametrize("n_columns", [4, 120], ids=["few", "many"])  # swept in Python / with torch operations
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_are_compared_element_by_element(backend, n_columns):
    """Column slices of one matrix interleave row by row without sharing an element: donated, they give the bits
    of separate tensors. A row and a column of it share one element: refused, whether the row is written or
    only read, with nothing written."""
    gen = torch.Generator().manual_seed(11)
    opt = sofx.adamw(lr=1e-2, backend=backend)
    big = torch.randn(5, 2 * n_columns, generator=gen)
    params = {f"c{k:03d}": big[:, 2 * k:2 * k + 2] for k in range(n_columns)}
    grads = {k: torch.randn(5, 2, generator=gen) for k in params}
    state = opt.init(params)
    want_p, want_s, _ = opt.update(clone_tree(params), grads, opt.init(params))
    got_p, got_s, _ = opt.update(params, grads, state, donate=True)
    for k in params:
        assert got_p[k].data_ptr() == params[k].data_ptr()
        assert torch.equal(got_p[k], want_p[k]) and torch.equal(got_s.nu[k], want_s.nu[k])
    last = f"c{n_columns - 1:03d}"
    row_piece = big[1:2, :2].expand(5, 2)  # read only: a gradient holding elements (1, 0) and (1, 1) of c000
    _refused(lambda: opt.update(params, {**grads, last: row_piece}, state, donate=True),
             r"params\['c000'\] and grads\['" + last + r"'\] share memory", params, state)
    row_and_column = {"col": big[:, 0], "row": big[1]}  # share element (1, 0)
    rc_grads = {"col": torch.randn(5, generator=gen), "row": torch.randn(2 * n_columns, generator=gen)}
    rc_state = opt.init(row_and_column)
    _refused(lambda: opt.update(row_and_column, rc_grads, rc_state, donate=True),
             r"params\['col'\] and params\['row'\] share memory", row_and_column, rc_state)


def test_a_tensor_of_too_many_runs_is_taken_as_its_whole_range(monkeypatch):
    """Beyond ``MAX_RUNS`` runs a strided view is compared as the range from its first element to its last:
    interleaved views are then refused (a conservative answer, documented in :mod:`sofx.kernels.donation`)."""
    opt = sofx.adamw(lr=1e-2, backend="reference")
    x = torch.randn(12)
    params = {"even": x[0::2], "odd": x[1::2]}
    grads = {k: torch.randn(6) for k in params}
    opt.update(params, grads, opt.init(params), donate=True)  # 6 runs each: element by element
    monkeypatch.setattr(donation, "MAX_RUNS", 5)
    state = opt.init(params)
    _refused(lambda: opt.update(params, grads, state, donate=True),
             r"params\['even'\] and params\['odd'\] share memory", params, state)


def test_the_range_of_a_tensor_of_too_many_runs_reaches_its_last_element(monkeypatch):
    """A gradient that starts on the last element of such a parameter is refused (the range ends after that
    element, not at its start)."""
    monkeypatch.setattr(donation, "MAX_RUNS", 2)
    opt = sofx.adamw(lr=1e-2, backend="reference")
    buf = torch.randn(40)
    params = {"p": buf[0:20:2]}  # 10 runs: taken as elements 0..18
    grads = {"p": buf[18:28]}  # read only, from the parameter's last element on
    state = opt.init(params)
    _refused(lambda: opt.update(params, grads, state, donate=True), r"params\['p'\] and grads\['p'\] share memory",
             params, state)
    grads = {"p": buf[19:29]}  # from just after it: disjoint
    opt.update(params, grads, state, donate=True)


@st.composite
def _strided_views(draw):
    """A view of a 1-d buffer: up to 3 dimensions, any order of strides, steps, expanded dimensions."""
    dims = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 4)) for _ in range(dims)]
    steps = [draw(st.integers(1, 3)) for _ in range(dims)]
    base = torch.empty([n * s for n, s in zip(sizes, steps)], dtype=draw(st.sampled_from([torch.float32,
                                                                                             torch.bfloat16])))
    view = base[tuple(slice(0, None, s) for s in steps)]
    view = view.permute(draw(st.permutations(range(dims))))
    if draw(st.booleans()):  # a dimension of stride 0
        at = draw(st.integers(0, dims))
        view = view.unsqueeze(at)
        view = view.expand([3 if d == at else n for d, n in enumerate(view.shape)])
    return view


@settings(max_examples=150, deadline=None)
@given(_strided_views())
def test_runs_are_the_bytes_of_the_elements(view):
    """:func:`donation.runs` covers exactly the bytes of the view's elements."""
    size = view.element_size()
    index = torch.arange(view.untyped_storage().nbytes() // size, dtype=torch.int64)
    offsets = index.as_strided(view.shape, view.stride(), view.storage_offset()) - view.storage_offset()
    want = {int(o) * size + b for o in offsets.reshape(-1) for b in range(size)}
    starts, length = donation.runs(view)
    got = {int(s) + b for s in starts for b in range(length)}
    assert got == want


def test_traced_leaves_that_are_one_tensor_are_refused():
    """A tensor autograd records (a non-leaf requiring grad, grad mode on) or one vmap batches is compared by
    the memory it is: given as two leaves with donation, it is refused as a plain tensor is."""
    opt = sofx.adamw(lr=0.1)
    p = torch.randn(4, requires_grad=True) * 1.0
    before = p.detach().clone()
    params, grads = {"a": p, "b": p}, {"a": torch.ones(4), "b": torch.ones(4)}
    with pytest.raises(sofx.LeafError, match=r"params\['a'\] and params\['b'\] share memory"):
        opt.update(params, grads, opt.init(params), donate=True)
    assert torch.equal(p.detach(), before)

    w = torch.randn(3, 4)
    w0 = w.clone()

    def tied(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        params = {"a": x, "b": x}
        return opt.update(params, {"a": g, "b": g}, opt.init(params), donate=True)[0]["a"]

    with pytest.raises(sofx.LeafError, match=r"params\['a'\] and params\['b'\] share memory"):
        vmap(tied)(w, torch.ones(3, 4))
    assert torch.equal(w, w0)
    separate = vmap(lambda x, g: opt.update({"a": x}, {"a": g}, opt.init({"a": x}), donate=True)[0]["a"])
    assert torch.equal(separate(w, torch.ones(3, 4)), w)  # one leaf: donated, written in place


def test_a_state_vmap_does_not_batch_is_refused_before_anything_is_written():
    """``vmap(update, in_dims=(0, 0, None))`` with donation: the batched moments cannot be written into an
    unbatched state; refused naming it before the parameters are written (torch raised after)."""
    opt = sofx.adamw(lr=1e-2)
    params, grads = {"w": torch.randn(3, 5)}, {"w": torch.randn(3, 5)}
    shared = opt.init({"w": params["w"][0]})
    before = _bits(params, shared)
    with pytest.raises(sofx.LeafError, match=r"state.mu\['w'\] is written in place, but its new values are "
                                             r"transformed by torch.func level"):
        vmap(lambda p, g, s: opt.update(p, g, s, donate=True)[:2], in_dims=(0, 0, None))(params, grads, shared)
    assert _same_bits(before, _bits(params, shared))
    batched = vmap(opt.init)(params)
    vmap(lambda p, g, s: opt.update(p, g, s, donate=True)[:2])(params, grads, batched)  # batched alike: fine
    assert not _same_bits(before[:1], _bits(params))
