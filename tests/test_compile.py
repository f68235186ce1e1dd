"""``torch.compile`` of a whole functional training step that includes ``sofx.adamw().update``.

The step under test is what a ``torch.func`` user writes::

    grads, loss = grad_and_value(loss_fn)(params)           # functional_call inside
    norm = global norm of grads; coef = min(max_norm / (norm + 1e-6), 1)   # clipping, in-graph
    params, state, record = opt.update(params, grads, state, AdamHParams(lr=lr), grad_scale=coef)

What works (tested below)
-------------------------
* ``fullgraph=True`` for the whole step (forward, backward, clipping, AdamW update) with
  the inductor backend: one graph, no graph break, and no recompilation from step to step
  when the step-dependent values (``lr`` from a schedule, the clip coefficient, the step
  counts in ``state.count``) are 0-d tensors. Results equal the eager step to float32
  rounding (inductor fuses and reorders the elementwise math; not bitwise).
* Python-float hyperparameters that change between calls also stay in one graph: dynamo
  specialises on the first value, then makes the float dynamic (one recompile, then none).
* A schedule evaluated inside the compiled step (``hparams_at(schedule, t)`` with ``t`` a Python int) traces:
  from the second call dynamo makes ``t`` a symbolic int and the schedule's values symbolic floats; one graph
  for the first step, then one per phase of the schedule (a warm-up's or a ``join``'s boundary is a guard).
  That holds for every field, betas too (``one_cycle``'s beta1: the bias correction takes a symbolic beta as
  ``1.0 * beta`` in float64, where ``torch.as_tensor`` specialised it), bitwise the eager steps.
* Per-group hyperparameters given as a prefix tree (``group_hparams``' groups, a dict of ``AdamHParams``
  over dict params, ``None`` for a group's defaults) trace, bitwise the eager step. Eagerly the prefix is
  broadcast by unflattening the params' spec over leaf indices, which torch's dynamo stand-in for optree
  (``torch/_dynamo/polyfills/pytree.py``) cannot do for a dict spec (``optree.registry.DictMetaData`` is not
  wrappable); under compile each leaf's path (``spec.paths()``) is walked down the prefix instead
  (``sofx.tree.broadcast_prefix``, ``full_tree``), with the same refusals.
* ``opt.undo`` compiles with ``fullgraph=True`` too, on its own or in the same graph as the
  update (step, then undo). Under compilation ``undo="auto"`` picks the *snapshot* strategy
  for every leaf (values cannot be inspected while tracing); without donation that keeps
  references to the inputs, costs no copy and restores them bit for bit.
  ``undo="algebraic"`` traces too (the inverse is then recomputed in the graph).
* ``donate=True`` traces (the in-place writes are functionalised by AOTAutograd). Memory
  cannot be read while tracing: a tensor written twice (tied weights as two leaves) or
  written and read (a gradient that is the parameter) is refused by identity; views of one
  buffer that overlap are not seen there (eager calls refuse them).

What breaks the graph, and why
------------------------------
* A fast backend (``backend="cpu"`` or ``"triton"``): these run native/Triton kernels that
  dynamo cannot trace; ``update`` raises :class:`sofx.UnsupportedError` naming the leaf
  (with ``fullgraph=True`` dynamo reports it as ``Unsupported: Observed exception`` carrying
  sofx's message). Under tracing the library always uses the reference
  kernels (``backend="auto"`` or ``"reference"``), which inductor then fuses itself.
* Undo records cross the compile boundary only in compiled code: a record returned by a
  compiled step holds dynamo's stand-in ``PyTreeSpec`` (``record.spec``), which eager
  ``undo`` does not accept as the params' structure (and whose dict unflatten fails); a record
  made eagerly holds a real optree spec, whose C comparison dynamo cannot trace (``Untraceable C
  tp_richcompare``). Undo a compiled step's record with a compiled ``undo`` (or in the same graph), an eager
  one eagerly.
* In general a graph break *inside* ``update`` is unsafe for the same reason (the stand-in
  spec escapes into eager code); the library avoids every construct that would break there
  (no ``importlib`` in the traced path, range checks by comparison, not ``math.isfinite``).

Compiles are slow on 2 cores (a cold inductor compile of the tiny step below takes ~10 s),
so the model is tiny and the inductor compiles happen once per module (a module fixture).
"""

from __future__ import annotations

import collections
import importlib
from typing import Any, Callable

import optree
import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch.func import functional_call, grad_and_value

import sofx

MAX_NORM = 0.5
WEIGHT_DECAY = 1e-2


def _problem(seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(32, 4, generator=gen)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return model, params, x, y


def _make_step(opt: sofx.Adam, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[..., Any]:
    """The whole functional training step: loss, gradients, global-norm clipping, AdamW update."""

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    def train_step(params: dict[str, torch.Tensor], state: sofx.AdamState, lr: Any) -> tuple[Any, ...]:
        grads, loss = grad_and_value(loss_fn)(params)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s coefficient
        params, state, record = opt.update(params, grads, state, sofx.AdamHParams(lr=lr), grad_scale=coef)
        return params, state, record, loss, norm

    return train_step


def _lr(step: int) -> torch.Tensor:
    """A warm-up then decay schedule, as a 0-d tensor (a new value every step, no recompile)."""
    return torch.tensor(0.05 * min(1.0, (step + 1) / 3) * 0.9 ** step)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def compiled_run() -> dict[str, Any]:
    """Six compiled and six eager steps of the same problem (one inductor compile)."""
    torch._dynamo.reset()
    model, params, x, y = _problem()
    opt = sofx.adamw(lr=1e-2, weight_decay=WEIGHT_DECAY)
    step = _make_step(opt, model, x, y)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    pc, sc = params, opt.init(params)
    pe, se = params, opt.init(params)
    history = []
    for t in range(6):
        before = pc
        pc, sc, rc, lc, nc = compiled(pc, sc, _lr(t))
        pe, se, re, le, ne = step(pe, se, _lr(t))
        history.append(dict(before=before, pc=pc, sc=sc, rc=rc, lc=lc, nc=nc, pe=pe, se=se, le=le, ne=ne))
    return dict(opt=opt, step=step, counter=counter, history=history, params=params)


def test_whole_step_compiles_to_one_graph_without_recompiles(compiled_run):
    counter = compiled_run["counter"]
    assert counter.frame_count == 1, "the whole step must be one graph, compiled once for all six steps"
    assert counter.op_count > 0


def test_compiled_step_equals_eager_step(compiled_run):
    clipped = 0
    for h in compiled_run["history"]:
        assert torch.allclose(h["lc"], h["le"], rtol=1e-5, atol=1e-7)
        assert torch.allclose(h["nc"], h["ne"], rtol=1e-5, atol=1e-7)
        clipped += int(h["ne"].item() > MAX_NORM)
        for k in h["pc"]:
            assert torch.allclose(h["pc"][k], h["pe"][k], rtol=1e-5, atol=1e-6), k
            assert torch.allclose(h["sc"].mu[k], h["se"].mu[k], rtol=1e-5, atol=1e-7), k
            assert torch.allclose(h["sc"].nu[k], h["se"].nu[k], rtol=1e-5, atol=1e-9), k
            assert torch.isfinite(h["pc"][k]).all()
    last = compiled_run["history"][-1]
    assert all(int(c) == 6 for c in last["sc"].count.values())
    assert clipped >= 1, "the problem must exercise clipping inside the graph"
    first_loss, last_loss = compiled_run["history"][0]["lc"].item(), last["lc"].item()
    assert last_loss < first_loss


def test_record_of_a_compiled_step_undoes_bitwise_in_compiled_undo(compiled_run):
    opt = compiled_run["opt"]
    h = compiled_run["history"][-1]
    assert set(h["rc"].strategies()) == {"snapshot"}  # values cannot be inspected while tracing
    undo = torch.compile(opt.undo, backend="eager", fullgraph=True)
    p0, s0 = undo(h["pc"], h["sc"], h["rc"])
    assert h["rc"].used
    previous = compiled_run["history"][-2]
    for k in p0:
        assert torch.equal(p0[k], h["before"][k]), k
        assert torch.equal(s0.mu[k], previous["sc"].mu[k]), k
        assert torch.equal(s0.nu[k], previous["sc"].nu[k]), k
        assert int(s0.count[k]) == 5


def test_algebraic_undo_compiles_fullgraph_alone_and_in_the_step_graph():
    torch._dynamo.reset()
    model, params, x, y = _problem(1)
    opt = sofx.adamw(lr=1e-2, weight_decay=WEIGHT_DECAY, undo="algebraic")
    step = _make_step(opt, model, x, y)
    counter = CompileCounter()
    compiled_step = torch.compile(step, backend=counter, fullgraph=True)
    compiled_undo = torch.compile(opt.undo, backend=counter, fullgraph=True)
    p1, s1, _, _, _ = compiled_step(params, opt.init(params), _lr(0))
    p2, s2, rec2, _, _ = compiled_step(p1, s1, _lr(1))
    assert set(rec2.strategies()) == {"algebraic"}
    p_back, s_back = compiled_undo(p2, s2, rec2)
    assert counter.frame_count == 2  # the step once, the undo once

    def step_then_undo(p, s, lr):
        p_new, s_new, record, _, _ = step(p, s, lr)
        return opt.undo(p_new, s_new, record)

    in_graph = CompileCounter()
    p_back2, s_back2 = torch.compile(step_then_undo, backend=in_graph, fullgraph=True)(p1, s1, _lr(1))
    assert in_graph.frame_count == 1
    for k in params:
        for got in (p_back[k], p_back2[k]):
            assert torch.allclose(got, p1[k], rtol=1e-6, atol=1e-7), k
        for got in (s_back.mu[k], s_back2.mu[k]):
            assert torch.allclose(got, s1.mu[k], rtol=1e-5, atol=1e-7), k
        assert int(s_back.count[k]) == int(s_back2.count[k]) == 1


def test_python_float_hparams_recompile_at_most_once():
    torch._dynamo.reset()
    model, params, x, y = _problem(2)
    opt = sofx.adamw(weight_decay=WEIGHT_DECAY)
    step = _make_step(opt, model, x, y)
    counter = CompileCounter()  # dynamo only: this test is about graphs, not codegen
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    pc, sc = params, opt.init(params)
    pe, se = params, opt.init(params)
    for t in range(4):
        lr = float(_lr(t))
        pc, sc, *_ = compiled(pc, sc, lr)
        pe, se, *_ = step(pe, se, lr)
    assert counter.frame_count <= 2
    assert _max_diff(pc, pe) < 1e-6


@pytest.mark.parametrize("undo", ["auto", "algebraic"])
def test_donated_update_traces(undo):
    torch._dynamo.reset()
    model, params, x, y = _problem(3)
    opt = sofx.adamw(lr=1e-2, weight_decay=WEIGHT_DECAY, undo=undo)
    step = _make_step(opt, model, x, y)
    state = opt.init(params)
    expected, _, _, _, _ = step(params, state, _lr(0))

    def donated(p, s, lr):
        grads, _ = grad_and_value(lambda q: torch.nn.functional.mse_loss(functional_call(model, q, (x,)), y))(p)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        return opt.update(p, grads, s, sofx.AdamHParams(lr=lr), grad_scale=coef, donate=True)

    counter = CompileCounter()
    mine = {k: v.clone() for k, v in params.items()}
    out, _, record = torch.compile(donated, backend=counter, fullgraph=True)(mine, opt.init(mine), _lr(0))
    assert counter.frame_count == 1
    assert _max_diff(out, expected) < 1e-6
    assert _max_diff(mine, expected) < 1e-6, "donated inputs receive the result"
    assert all(leaf.owns_kept for leaf in record.leaves)  # (copies made under donation, or nothing kept)


def test_donated_update_in_a_loop_compiles_once():
    """A donated step called with new gradients every step: the identity checks of the donated writes must not
    guard on the tensors' ids (every step's new gradients recompiled the step)."""
    torch._dynamo.reset()
    opt = sofx.adamw(weight_decay=WEIGHT_DECAY)

    def step(p, g, s, lr):
        return opt.update(p, g, s, sofx.AdamHParams(lr=lr), donate=True)

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(6)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    pc, sc = {k: v.clone() for k, v in params.items()}, opt.init(params)
    pe, se = {k: v.clone() for k, v in params.items()}, opt.init(params)
    for t in range(4):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        pc, sc, _ = compiled(pc, grads, sc, _lr(t))
        pe, se, _ = opt.update(pe, grads, se, sofx.AdamHParams(lr=_lr(t)))
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 4 steps"
    assert _max_diff(pc, pe) < 1e-6


@pytest.mark.parametrize("lr", [torch.tensor, float], ids=["tensor_lr", "float_lr"])
def test_hparams_made_outside_the_compiled_step_do_not_recompile_it(lr):
    """An ``AdamHParams`` built outside the compiled step every step (a schedule's value): the update looked it
    up by ``id()``, which Dynamo guards, so that every step's new object recompiled the step."""
    torch._dynamo.reset()
    opt = sofx.adamw(weight_decay=WEIGHT_DECAY)

    def step(p, g, s, hp):
        return opt.update(p, g, s, hp)

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(9)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    pc, sc = params, opt.init(params)
    pe, se = params, opt.init(params)
    for t in range(5):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        hp = sofx.AdamHParams(lr=lr(float(_lr(t))))
        pc, sc, _ = compiled(pc, grads, sc, hp)
        pe, se, _ = opt.update(pe, grads, se, sofx.AdamHParams(lr=lr(float(_lr(t)))))
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles for 5 steps"  # (a float: dynamic after one)
    assert _max_diff(pc, pe) < 1e-6


def test_donated_tied_leaves_are_refused_under_compile():
    """One tensor as two leaves, or a gradient that is its parameter, with donation: the eager refusal, by
    identity while tracing, and nothing written."""
    opt = sofx.adamw(lr=0.1)

    def step(params, grads, state):
        return opt.update(params, grads, state, donate=True)

    w = torch.randn(4)
    before = w.clone()
    for params, grads, pattern in (({"a": w, "b": w}, {"a": torch.ones(4), "b": torch.ones(4)},
                                    r"params\['a'\] and params\['b'\] share memory"),
                                   ({"a": w}, {"a": w}, r"params\['a'\] and grads\['a'\] share memory")):
        torch._dynamo.reset()
        with pytest.raises(sofx.LeafError, match=pattern):
            torch.compile(step, backend="eager")(params, grads, opt.init(params))
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match=pattern):
            torch.compile(step, backend="eager", fullgraph=True)(params, grads, opt.init(params))
        assert torch.equal(w, before)


def test_identity_checks_of_donated_writes_trace_in_time_linear_in_the_leaves(monkeypatch):
    """The identity checks of a donated update's writes (while tracing) scanned the tensors written so far by ``is``
    for every tensor: Dynamo traced that scan element by element, quadratic in the leaves (it doubled the first
    trace of a donated update of 100 leaves). Counted in the bytecode instructions Dynamo traces."""
    adam_module = importlib.import_module("sofx.adam")
    translator = torch._dynamo.symbolic_convert.InstructionTranslatorBase
    traced = [0]
    real_step = translator.step

    def counting_step(self: Any) -> bool:
        traced[0] += 1
        return real_step(self)

    monkeypatch.setattr(translator, "step", counting_step)

    def check(leaves: list[Any]) -> torch.Tensor:
        adam_module._check_distinct_writes(leaves, [None] * len(leaves), True, None)
        return leaves[0].p + 1

    counts = []
    for n in (6, 12):
        torch._dynamo.reset()
        leaves = [adam_module._Leaf(f"['w{i}']", *(torch.zeros(2) for _ in range(5)), None, True, None)
                  for i in range(n)]
        traced[0] = 0
        torch.compile(check, backend="eager", fullgraph=True)(leaves)
        counts.append(traced[0])
    assert counts[1] < 2.5 * counts[0], f"{counts[0]} instructions traced for 6 leaves, {counts[1]} for 12"


def test_fast_backend_under_compile_is_a_clear_error():
    torch._dynamo.reset()
    model, params, x, y = _problem(4)
    opt = sofx.adamw(backend="cpu")
    step = _make_step(opt, model, x, y)
    with pytest.raises(sofx.UnsupportedError, match="backend 'cpu' cannot run under"):
        torch.compile(step, backend="eager")(params, opt.init(params), _lr(0))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="backend 'cpu' cannot run under"):
        torch.compile(step, backend="eager", fullgraph=True)(params, opt.init(params), _lr(0))


def _per_group_cases(params: dict[str, torch.Tensor]) -> list[tuple[Any, Any]]:
    """(params, per-group hparams) pairs: group_hparams' no-decay groups over dict params; a dict prefix over an
    OrderedDict (the other key order) holding dicts and a list, with a None group (the defaults)."""
    groups = {"decay": sofx.AdamHParams(lr=1e-2), "no_decay": sofx.AdamHParams(lr=1e-3, weight_decay=0.0)}
    nested = collections.OrderedDict([("x", [torch.linspace(-1, 1, 3), torch.ones(2)]), ("layer", params)])
    return [(params, sofx.transforms.group_hparams(sofx.transforms.no_decay_labels(params), groups)),
            (nested, {"layer": {"0.weight": sofx.AdamHParams(lr=2e-2), "0.bias": None, "2.weight": None,
                                "2.bias": sofx.AdamHParams(lr=0.5)}, "x": sofx.AdamHParams(lr=1e-3)})]


def _compiled_equals_eager(opt: sofx.Adam, cases: list[tuple[Any, Any]], fullgraph: bool) -> int:
    """Step each case compiled and eagerly, assert the same structure and bits; the number of graphs compiled."""
    counter = CompileCounter()
    for p, hp in cases:
        grads = sofx.tree.tree_map(lambda t: torch.cos(t * 3), p)

        def step(q, s, hp=hp, grads=grads):
            return opt.update(q, grads, s, hp)[:2]

        (pc, sc), (pe, se) = torch.compile(step, backend=counter, fullgraph=fullgraph)(p, opt.init(p)), \
            step(p, opt.init(p))
        assert sofx.tree.flatten(pc)[1] == sofx.tree.flatten(pe)[1]
        assert all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten(pc)[0], sofx.tree.flatten(pe)[0]))
    return counter.frame_count


def test_per_group_hparams_trees_trace_as_eager():
    """Per-group hparams as a tree over dict params did not trace: broadcasting the prefix unflattened the params'
    dict spec over constant leaves, which dynamo's optree stand-in cannot ("DictMetaData" Unsupported). Each
    leaf's path is walked down the prefix under compile: one graph per case, bitwise the eager steps; a tree that
    is no prefix is refused as eagerly (dynamo's Unsupported carries sofx's message)."""
    torch._dynamo.reset()
    params = _problem(5)[1]
    opt = sofx.adamw(weight_decay=WEIGHT_DECAY)
    cases = _per_group_cases(params)
    assert _compiled_equals_eager(opt, cases, fullgraph=True) == len(cases)
    bad = {"0.weight": sofx.AdamHParams(lr=1e-2)}
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"hparams has entries .*0\.weight.*, expected .*0\.bias"):
        torch.compile(lambda q, s: opt.update(q, params, s, bad), backend="eager", fullgraph=True)(
            params, opt.init(params))


def test_per_group_hparams_tree_without_fullgraph_steps_as_eager():
    """Without fullgraph the graph broke in the broadcast and the resumed frame handed dynamo's stand-in spec to
    optree's code ("ValueError: length mismatch", "TypeError: unhashable type: 'list'"), where eagerly it steps."""
    torch._dynamo.reset()
    params = _problem(5)[1]
    assert _compiled_equals_eager(sofx.adamw(weight_decay=WEIGHT_DECAY), _per_group_cases(params)[:1],
                                  fullgraph=False) == 1


class _Block:
    """A custom pytree node (registered with optree below): a layer's weight and bias, and a tag as its metadata."""

    def __init__(self, w: Any, b: Any, tag: str = "block") -> None:
        self.w, self.b, self.tag = w, b, tag


optree.register_pytree_node(_Block, lambda n: ((n.w, n.b), n.tag, ("w", "b")), lambda tag, c: _Block(*c, tag),
                            namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"))


def test_per_group_hparams_over_custom_nodes_in_dict_params_trace_as_eager():
    """Under compile the prefix was walked through mappings, lists and tuples only: a custom (optree-registered)
    node of the prefix over the same node of dict params was taken as one leaf's value and refused ("expected an
    AdamHParams, got _Block"), where eagerly optree walks it. It is walked as eagerly (its children by entry): each
    leaf gets the eager value; a node of other metadata is refused as eagerly, naming the place."""
    torch._dynamo.reset()
    params = {"blk": _Block(torch.linspace(-1, 1, 6).reshape(2, 3), torch.ones(3)), "head": torch.ones(4)}
    a, b = sofx.AdamHParams(lr=0.1), sofx.AdamHParams(lr=1e-3)
    is_hp = lambda x: isinstance(x, sofx.AdamHParams)  # noqa: E731

    def lrs(q, hp):
        values = sofx.tree.broadcast_prefix(hp, sofx.tree.flatten(q)[1], is_leaf=is_hp, full_tree=q)
        return [p * (-1.0 if v is None else v.lr) for p, v in zip(sofx.tree.flatten(q)[0], values)]

    compiled = torch.compile(lrs, backend="eager", fullgraph=True)
    hp = {"blk": _Block(a, None), "head": b}
    assert all(torch.equal(x, y) for x, y in zip(compiled(params, hp), lrs(params, hp)))
    other = {"blk": _Block(a, None, "other"), "head": None}
    with pytest.raises(sofx.StructureError, match=r"hparams\['blk'\] is a _Block of metadata 'other', expected "
                                                  r"'block' \(as params\['blk'\]\)"):
        lrs(params, other)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"hparams\[.*blk.*\] is a _Block of metadata .*other.*, "
                                                            r"expected .*block.* \(as params\[.*blk.*\]\)"):
        compiled(params, other)


def test_per_group_hparams_over_a_custom_node_holding_dict_params_trace_as_eager():
    """Params whose root is a custom (optree-registered) node holding a dict were not seen to hold a mapping: the
    prefix took the eager path, which dynamo cannot trace over a dict spec ("DictMetaData" Unsupported, or "length
    mismatch" from its stand-in spec). The custom node's children are looked into: each leaf gets the eager value."""
    torch._dynamo.reset()
    is_hp = lambda x: isinstance(x, sofx.AdamHParams)  # noqa: E731

    def lrs(q, hp):
        values = sofx.tree.broadcast_prefix(hp, sofx.tree.flatten(q)[1], is_leaf=is_hp, full_tree=q)
        return [p * (-1.0 if v is None else v.lr) for p, v in zip(sofx.tree.flatten(q)[0], values)]

    a, b = sofx.AdamHParams(lr=0.1), sofx.AdamHParams(lr=1e-3)
    params = _Block({"u": torch.ones(2), "v": torch.ones(1)}, torch.ones(3))
    for hp in (_Block({"u": a, "v": None}, b), _Block(a, b)):
        got = torch.compile(lrs, backend="eager", fullgraph=True)(params, hp)
        assert all(torch.equal(x, y) for x, y in zip(got, lrs(params, hp)))


@pytest.mark.parametrize("grads", [{}, {"w": None, "deep": [None]}])
def test_gradient_transforms_of_a_dict_without_gradients_compile(grads):
    """A dict of no tensor (no parameter, or every gradient None) did not trace: flattening it for its structure is
    what dynamo's stand-in for optree cannot do ("SourcelessBuilder.create does not know how to wrap
    optree.registry.DictMetaData"), where eagerly such a tree passes unchanged, a norm of 0. Its leaves are taken
    without its structure (needed only to name a refused leaf): fullgraph, the eager values."""
    torch._dynamo.reset()
    tx = sofx.transforms
    for t in (tx.chain(tx.unscale(), tx.check_finite(), tx.clip_by_global_norm(1.0)), tx.unscale_and_clip_zero(1.0)):
        out, state = torch.compile(lambda g, s, t=t: t.update(g, s, loss_scale=2.0), backend="eager",
                                   fullgraph=True)(grads, t.init(grads))
        want_out, want = t.update(grads, t.init(grads), loss_scale=2.0)
        assert out == want_out == grads
        assert [float(x) for x in sofx.tree.flatten(state)[0]] == [float(x) for x in sofx.tree.flatten(want)[0]]


def test_gradient_accumulation_of_no_gradient_yet_compiles():
    """accumulation_init, an accumulate of no gradient (grads=None) and accumulated of such a state did not trace:
    their dict of ``None`` leaves was built by unflattening the params' spec, which dynamo's stand-in for optree
    did not do over values that are all None (InternalTorchDynamoError "unhashable type: 'list'"). They map over
    the params instead: fullgraph, the eager values."""
    torch._dynamo.reset()
    tx = sofx.transforms
    params = {"w": torch.randn(3, 2), "deep": [torch.randn(2)]}
    grads = {"w": torch.randn(3, 2), "deep": [None]}

    def run(p, g):
        empty = tx.accumulate(tx.accumulation_init(p), None, p)
        return tx.accumulated(empty, p), tx.accumulate(empty, g, p)

    (none, state) = torch.compile(run, backend="eager", fullgraph=True)(params, grads)
    want_none, want = run(params, grads)
    assert none == want_none == {"w": None, "deep": [None]}
    assert state.micro_steps == want.micro_steps == 2 and state.total["deep"] == [None]
    assert torch.equal(state.total["w"], want.total["w"])


def test_a_compiled_apply_block_action_refuses_an_action_applied_already():
    """apply_block_action carries an action that writes out once (BlockAction.applied_cell). The cell was made at
    the first application: made while tracing, it was not guarded, so the compiled function stepped the block
    again from the same action (twice, counted twice) where eager code refuses it. It is made with the action, and
    the compiled function refuses a second application as the eager one does (its guard sees the cell change)."""
    from sofx import speculate as sp

    torch._dynamo.reset()
    opt = sofx.adamw(lr=1e-2)
    param, grad = torch.randn(4), torch.randn(4)
    apply = torch.compile(lambda a, p, g, s: sp.apply_block_action(opt, a, p, g, s, None), backend="eager")
    action = sp.BlockAction(0, "step", "stepped late", 1.0, opt.defaults)
    p1, s1 = apply(action, param, grad, opt.init(param))
    assert int(s1.count) == 1
    with pytest.raises(sofx.SofxError, match=r"plan\.actions\[0\] \(step\) was applied already"):
        apply(action, p1, grad, s1)
    fresh = sp.BlockAction(0, "step", "stepped late", 1.0, opt.defaults)
    assert int(apply(fresh, p1, grad, s1)[1].count) == 2


def test_a_schedule_evaluated_in_the_compiled_step_traces_at_every_step():
    """A schedule called inside the compiled step with the step count as a Python int: from the second call dynamo
    makes the int symbolic, and the schedules' values symbolic floats. Their finiteness check (math.isfinite) and
    the step in their messages (an f-string: "BUILD_STRING type error") broke the graph at the second step; step_decay
    recompiled at each of its steps. One graph for the first step, one for all the others, bitwise the eager steps."""
    torch._dynamo.reset()
    params = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(6)), "b": torch.linspace(-1, 1, 3)}
    grads = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(7)) for k, v in params.items()}
    opt = sofx.adamw(weight_decay=WEIGHT_DECAY)
    schedule = sofx.schedules.hparams_schedule(lr=sofx.schedules.step_decay(1e-2, 2, 0.5),
                                               weight_decay=sofx.schedules.linear(0.0, 0.1, 4))
    assert _compiled_scheduled_steps_frames(opt, params, grads, schedule, 7) == 2


def _compiled_scheduled_steps_frames(opt, params, grads, schedule, steps):
    """Run ``steps`` updates with ``schedule``'s hparams evaluated inside a ``torch.compile(fullgraph=True)`` step
    and eagerly side by side, asserting bitwise equal params at each; the frames compiled."""
    def step(p, s, t):
        return opt.update(p, grads, s, sofx.serial.hparams_at(schedule, t))[:2]

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    pc, sc = params, opt.init(params)
    pe, se = params, opt.init(params)
    for t in range(steps):
        pc, sc = compiled(pc, sc, t)
        pe, se = step(pe, se, t)
        assert all(torch.equal(pc[k], pe[k]) for k in params), t
    return counter.frame_count


def test_scheduled_betas_evaluated_in_the_compiled_step_trace():
    """A beta a schedule computes in the compiled step (one_cycle's beta1, a cosine beta2) is a symbolic float
    from the second call. The bias correction made it a tensor with torch.as_tensor, which specialised it: a
    recompile per value (until dynamo's limit), and on a cosine torch's "Guard failed on the same frame it was
    created". It is 1.0 * beta in float64 there: one graph after the first, bitwise the eager steps."""
    torch._dynamo.reset()
    params = {"w": torch.linspace(-1, 1, 6).reshape(2, 3), "b": torch.linspace(0.5, 1, 3)}
    grads = {k: torch.cos(v * 5) for k, v in params.items()}
    opt = sofx.adamw(weight_decay=WEIGHT_DECAY)
    schedule = sofx.schedules.hparams_schedule(base=sofx.schedules.one_cycle(1e-2, 10, pct_start=0.5),
                                               beta2=sofx.schedules.cosine_decay(0.999, 100, 0.99))
    # (the cycle's first phase: one graph for step 0, one for the others)
    assert _compiled_scheduled_steps_frames(opt, params, grads, schedule, 4) == 2


def test_a_python_float_loss_scale_that_changes_traces_in_the_unscaling_transforms():
    """A dynamic loss scale passed as a Python float (update(..., loss_scale=S), S changing as GradScaler's does)
    is a symbolic float from the second call: unscale() and unscale_and_clip_zero() checked it with math.isfinite
    and rounded 1/S to float32 with struct, which dynamo cannot trace (a graph break at the second step). They
    check it by comparisons and unscale with it as a 0-d tensor there: one graph after the first, bitwise eager."""
    torch._dynamo.reset()
    params = {"w": torch.linspace(-1, 1, 6).reshape(2, 3), "b": torch.linspace(0.5, 1, 3)}
    grads = {k: torch.cos(v * 5) * 300 for k, v in params.items()}
    chained = sofx.transforms.chain(sofx.transforms.unscale(), sofx.transforms.check_finite())
    zero = sofx.transforms.unscale_and_clip_zero(None)

    def unscaled(g, scale):
        return (chained.update(g, chained.init(g), loss_scale=scale)[0],
                zero.update(g, zero.init(g), loss_scale=scale)[0])

    counter = CompileCounter()
    compiled = torch.compile(unscaled, backend=counter, fullgraph=True)
    for scale in (1024.0, 3000.0, 0.75, 65536.0):
        for got, want in zip(compiled(grads, scale), unscaled(grads, scale)):
            assert all(torch.equal(got[k], want[k]) for k in params), scale
    assert counter.frame_count == 2


def test_python_float_factors_that_change_trace_in_scale_tree_and_zero_clip_factor():
    """scale_tree's factor and zero_clip_factor's loss scale, Python floats that change from call to call (symbolic
    from the second call), were checked with math.isfinite: a graph break at the second call. Comparisons now."""
    torch._dynamo.reset()
    grads = {"w": torch.linspace(-1, 1, 6).reshape(2, 3), "b": torch.linspace(0.5, 1, 3)}

    def scaled(g, x):
        return sofx.transforms.scale_tree(g, x * sofx.transforms.zero_clip_factor(3.0, x, 1.0))

    counter = CompileCounter()
    compiled = torch.compile(scaled, backend=counter, fullgraph=True)
    for x in (0.5, 0.75, 2.0):
        got, want = compiled(grads, x), scaled(grads, x)
        assert all(torch.equal(got[k], want[k]) for k in grads), x
    assert counter.frame_count == 2


def test_unpack_compiles_fullgraph():
    """sofx.tree.unpack's views of a flat buffer traced in one graph; its check of a freed or shrunk buffer (4a9b1fa:
    the buffer's storage read, which Dynamo cannot do for a fake tensor) broke the graph ("Unsupported torch.* op
    returned non-Tensor"), fullgraph=True refused. It is not made while compiling, as in_storage's callers skip it."""
    torch._dynamo.reset()
    flat = torch.linspace(-1, 1, 7)

    def views(f):
        a, b = sofx.tree.unpack(f, [(3,), (2, 2)])
        return a * 2, b + 1

    counter = CompileCounter()
    got, want = torch.compile(views, backend=counter, fullgraph=True)(flat), views(flat)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and counter.frame_count == 1
