"""Long runs: step counts far beyond float32's exact integers (2^24), int32's (2^31, 2^32) and float64's (2^53), up
to int64's largest, stepped, undone and redone as at small counts (DESIGN.md "Numerics reference": ``t`` counts from
1 and is never rounded), and refused with a clear error where the count cannot take another step."""

from __future__ import annotations

import re

import pytest
import torch

import sofx
from sofx.adam import AdamState

from helpers import clone_tree, trees_equal

INT64_MAX = torch.iinfo(torch.int64).max


def _leaves(count: int, seed: int = 0):
    """Two leaves with evolved-looking moments, ``head`` at step count ``count`` and ``w`` at 5."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 4, generator=gen), "head": torch.randn(6, generator=gen)}
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    mu = {k: 0.1 * torch.randn(p.shape, generator=gen) for k, p in params.items()}
    nu = {k: torch.rand(p.shape, generator=gen) + 0.1 for k, p in params.items()}
    state = AdamState({"w": torch.tensor(5), "head": torch.tensor(count)}, mu, nu)
    return params, grads, state


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_count_at_int64_max_is_refused_naming_the_leaf_and_changes_nothing(backend, donate):
    """Its next step's count, 2^63, is no int64: it wrapped to -2^63 (a state that every later call refuses as
    negative, the step not undoable)."""
    opt = sofx.adamw(lr=1e-3, backend=backend)
    params, grads, state = _leaves(INT64_MAX)
    before = [clone_tree(t) for t in (params, grads, state)]
    pattern = r"state\.count\['head'\]: step count 9223372036854775807 is int64's largest"
    with pytest.raises(sofx.LeafError, match=pattern):
        opt.update(params, grads, state, donate=donate)
    with pytest.raises(sofx.LeafError, match=pattern):
        opt.check_inputs(params, grads, state)
    with pytest.raises(sofx.LeafError, match=pattern):
        opt.undo_strategies(params, grads, state)
    for b, t in zip(before, (params, grads, state)):
        assert trees_equal(b, t)
    # a leaf without a gradient is not stepped: its count may be the largest
    p2, s2, _ = opt.update(params, {"w": grads["w"], "head": None}, state)
    assert int(s2.count["head"]) == INT64_MAX and int(s2.count["w"]) == 6


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
def test_the_step_to_int64_max_is_taken_undone_and_redone(backend):
    opt = sofx.adamw(lr=1e-3, backend=backend)
    params, grads, state = _leaves(INT64_MAX - 1)
    p1, s1, rec = opt.update(params, grads, state)
    assert int(s1.count["head"]) == INT64_MAX
    assert rec.leaves[0].scalars.step == INT64_MAX  # (leaves in sorted order: head first)
    p0, s0 = opt.undo(p1, s1, rec)
    assert int(s0.count["head"]) == INT64_MAX - 1
    _, s1, rec = opt.update(params, grads, state)
    halved = {k: g / 2 for k, g in grads.items()}
    _, s2, _ = opt.undo_redo(p1, s1, rec, halved)
    assert int(s2.count["head"]) == INT64_MAX


def _facade_state(opt, model) -> list:
    """Every parameter's optimizer state, copied (read between steps)."""
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]


@pytest.mark.parametrize("speculate", [True, False])
@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_the_offload_facade_refuses_a_step_from_a_count_at_int64_max_and_keeps_working(executor, speculate):
    """The engine's blocks step through sofx.adam, which refuses that count: the refusal came out of the executor
    (the block's speculative step, or validation's) and stopped the engine for good. Now no block holding such a
    count is speculated, and step() refuses it before any block is stepped, naming the parameter; a parameter
    without gradient may hold it (it is not stepped), and a speculative step to it is redone (the lr changed
    between backward and step(): every speculated block undone and redone at the count it reached)."""
    import sofx.offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    gen = torch.Generator().manual_seed(1)

    def loss() -> torch.Tensor:
        return model(torch.randn(4, 6, generator=gen)).pow(2).mean()

    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor=executor, block_numel=40,
                                       loss_scale=None, speculate=speculate) as opt:
        opt.backward(loss())
        opt.step()
        opt.zero_grad()
        first = list(model.parameters())[0]
        opt.state[first]["step"] = INT64_MAX
        before = _facade_state(opt, model)
        weights = [p.detach().clone() for p in model.parameters()]
        opt.backward(loss())
        with pytest.raises(sofx.LeafError, match=r"parameter 0 = param_groups\[0\]\['params'\]\[0\].*step count "
                                                 r"9223372036854775807 is int64's largest"):
            opt.step()
        opt.zero_grad()
        after = _facade_state(opt, model)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)
        assert all(torch.equal(w, p.detach()) for w, p in zip(weights, model.parameters()))
        # not stepped (no gradient): its count may be the largest
        first.requires_grad_(False)
        opt.backward(loss())
        opt.step()
        opt.zero_grad()
        assert int(opt.state[first]["step"]) == INT64_MAX
        assert [int(opt.state[p]["step"]) for p in list(model.parameters())[1:]] == [2, 2, 2]
        first.requires_grad_(True)
        opt.state[first]["step"] = INT64_MAX - 1
        opt.backward(loss())
        opt.param_groups[0]["lr"] = 2e-2  # (as a scheduler between backward and step())
        report = opt.step()
        assert int(opt.state[first]["step"]) == INT64_MAX
        assert report.redone == (2 if speculate else 0)


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
@pytest.mark.parametrize("lr_wd", [1e19, 1e38])
def test_a_decay_factor_far_beyond_one_keeps_the_parameter_and_its_undo_restores_it(backend, lr_wd):
    """Decoupled decay with ``lr * weight_decay`` huge (valid hparams, torch.optim.AdamW takes them): the decayed
    parameter ``p * (1 - lr * wd)`` is beyond float32 (``1 - lr*wd`` itself, -1e76, is inf there), where dividing
    by the factor cannot give it back: the cpu backends' undo, algebraic outside the chunk their check kept, wrote
    nan into three quarters of the parameters. ``undo="auto"`` keeps the parameter (``1 - lr*wd`` outside
    ``[2^-12, 2^12]``, as below ``2^-12``), ``"algebraic"`` refuses."""
    gen = torch.Generator().manual_seed(3)
    n = 4096
    params = {"w": 10 * torch.randn(n, generator=gen)}
    grads = {"w": torch.randn(n, generator=gen)}
    state = AdamState({"w": torch.tensor(3)}, {"w": 0.1 * torch.randn(n, generator=gen)},
                      {"w": torch.rand(n, generator=gen) * 0.1 + 1e-3})
    hp = sofx.AdamHParams(lr=lr_wd, weight_decay=lr_wd)
    before = [clone_tree(t) for t in (params, state)]
    opt = sofx.adamw(backend=backend)
    p1, s1, rec = opt.update(params, grads, state, hp)
    assert rec.strategies() in (["param_snapshot"], ["snapshot"])
    p0, s0 = opt.undo(p1, s1, rec)
    assert trees_equal(p0, before[0])
    m, v = before[1].mu["w"], before[1].nu["w"]
    assert int(s0.count["w"]) == 3
    assert bool(((s0.mu["w"] - m).abs() <= 2e-6 * (v.sqrt() + m.abs())).all())  # (the tolerance of the inverse)
    torch.testing.assert_close(s0.nu["w"], v, rtol=2e-6, atol=0)
    with pytest.raises(sofx.UnsupportedError, match=r"params\['w'\]: undo='algebraic' is impossible: .*1 - lr \* "
                                                     r"weight_decay"):
        sofx.adamw(backend=backend, undo="algebraic").update(params, grads, state, hp)


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
@pytest.mark.parametrize("decoupled", [True, False])
def test_a_step_size_beyond_float32_is_refused_naming_the_leaf_and_changes_nothing(backend, decoupled):
    """``lr / (1 - beta1**t)`` beyond float32 (lr 1e30 with a beta1 of 1 - 2^-53 at t = 4: 2.25e45): torch.optim
    refuses the step ('value cannot be converted to type float without overflow'); the reference backend raised
    that bare RuntimeError, the cpu backends stepped every parameter to inf or nan (their undo then wrote nan).
    Refused before anything is computed, naming the leaf, the step and the value; the redo of an undo_redo
    likewise; later steps, whose ``1 - beta1**t`` is larger, are taken."""
    b1 = 1 - 2 ** -53
    torch_opt = torch.optim.AdamW if decoupled else torch.optim.Adam
    w = torch.nn.Parameter(torch.randn(4))
    w.grad = torch.randn(4)
    topt = torch_opt([w], lr=1e30, betas=(b1, 0.999), weight_decay=0.0, foreach=False)
    topt.state[w] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.ones(4)}
    with pytest.raises(RuntimeError, match="overflow"):
        topt.step()
    opt = (sofx.adamw if decoupled else sofx.adam)(backend=backend, weight_decay=0.0)
    params, grads, state = _leaves(3)
    hp = {"w": sofx.AdamHParams(lr=1e-3), "head": sofx.AdamHParams(lr=1e30, beta1=b1)}
    before = [clone_tree(t) for t in (params, grads, state)]
    pattern = (r"hparams for params\['head'\]: lr / \(1 - beta1\*\*t\) = 2\.25\d*e\+45 at step t = 4 is beyond "
               r"float32's range")
    for donate in (False, True):
        with pytest.raises(sofx.HParamError, match=pattern):
            opt.update(params, grads, state, hp, donate=donate)
        for b, t in zip(before, (params, grads, state)):
            assert trees_equal(b, t)
    with pytest.raises(sofx.HParamError, match=pattern):
        opt.check_inputs(params, grads, state, hp)
    # the redo of an undo_redo takes the undone step's t
    ok = {"w": sofx.AdamHParams(lr=1e-3), "head": sofx.AdamHParams(lr=1e-3, beta1=b1)}
    p1, s1, rec = opt.update(params, grads, state, ok)
    with pytest.raises(sofx.HParamError, match=pattern):
        opt.undo_redo(p1, s1, rec, grads, hp)
    # at t = 2^60, 1 - beta1**t is 0.12: the step is taken
    far = state._replace(count={"w": state.count["w"], "head": torch.tensor(2 ** 60)})
    p2, _, _ = opt.update(params, grads, far, hp)
    assert bool(p2["head"].isfinite().all())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_redo_of_a_leaf_the_undone_step_did_not_step_is_checked_at_its_own_step(backend):
    """An undo_redo's redo of a leaf the undone step did not step (no gradient then, one now) is its step from its
    count, ``t = count + 1``; its step size was checked at ``t = count`` (the undone step's t of a leaf it stepped),
    and not at all from a count of 0. So a step size beyond float32 at its ``t`` was refused by the kernel, naming
    no leaf ("reference.step_many[0]"), after the leaves before it were undone and redone in place under donation;
    and one refused at ``t = count`` only was refused though its step is taken by update. Checked at its own
    ``t`` before anything is written."""
    b1 = 1 - 2 ** -53  # 1 - b1**t is t * 2^-53 for small t
    opt = sofx.adamw(backend=backend, weight_decay=0.0)
    params, grads, state = _leaves(0)
    state = state._replace(count={"w": torch.tensor(5), "head": torch.tensor(0)})
    nan_grads = {"w": grads["w"].clone(), "head": grads["head"]}
    nan_grads["w"][0, 0] = float("nan")  # (the reference backend then undoes, then steps "w": not fused)
    bad = {"w": sofx.AdamHParams(lr=1e-3), "head": sofx.AdamHParams(lr=1e30, beta1=b1)}
    p1, s1, rec = opt.update(params, {"w": grads["w"], "head": None}, state, donate=True)
    before = [clone_tree(t) for t in (p1, s1)]
    with pytest.raises(sofx.HParamError, match=r"hparams for params\['head'\]: lr / \(1 - beta1\*\*t\) = .* at step "
                                               r"t = 1 is beyond float32's range"):
        opt.undo_redo(p1, s1, rec, nan_grads, bad, donate=True)
    assert trees_equal(before[0], p1) and trees_equal(before[1], s1) and not rec.used
    # from a count of 1 its step is t = 2, where lr / (1 - beta1**2) = 5e22 / 2^-52 is within float32
    ok = {"w": sofx.AdamHParams(lr=1e-3), "head": sofx.AdamHParams(lr=5e22, beta1=b1)}
    counted = state._replace(count={"w": torch.tensor(5), "head": torch.tensor(1)})
    p1, s1, rec = opt.update(params, {"w": grads["w"], "head": None}, counted)
    q0, t0 = opt.undo(p1, s1, rec)
    want = opt.update(q0, grads, t0, ok)
    p1, s1, rec = opt.update(params, {"w": grads["w"], "head": None}, counted)
    got = opt.undo_redo(p1, s1, rec, grads, ok)
    assert trees_equal(got[0], want[0]) and trees_equal(got[1], want[1])
    assert int(got[1].count["head"]) == 2


def test_the_count_and_step_size_checks_run_once_per_hparams_count_and_dtype(monkeypatch):
    """A group's leaves at one count share one check of the next count and of the step size (each is a function
    of the hparams object, the count and the dtype; was once per leaf); a refusal still names the first leaf, in
    the tree's order, that it refuses."""
    import importlib

    adam_module = importlib.import_module("sofx.adam")
    sized = []
    real = adam_module.check_step_size
    monkeypatch.setattr(adam_module, "check_step_size", lambda path, *a: sized.append(path) or real(path, *a))
    params = {f"w{i}": torch.randn(3) for i in range(6)}
    grads = {k: torch.randn(3) for k in params}
    opt = sofx.adamw(lr=1e-3)
    state = opt.init(params)
    state = state._replace(count={k: torch.tensor(7 if k in ("w4", "w5") else 2) for k in params})
    p1, s1, _ = opt.update(params, grads, state)
    assert sized == ["params['w0']", "params['w4']"]
    sized.clear()
    hp = {k: sofx.AdamHParams() for k in params}  # one object a leaf: one check each
    opt.update(params, grads, state, hp)
    assert sized == [f"params['w{i}']" for i in range(6)]
    bad = sofx.AdamHParams(lr=1e30, beta1=1 - 2 ** -53)
    pattern = r"hparams for params\['w1'\]: lr / \(1 - beta1\*\*t\) = .* at step t = 3 is beyond float32's range"
    with pytest.raises(sofx.HParamError, match=pattern):
        opt.update(params, grads, state, {k: bad if k != "w0" else sofx.AdamHParams() for k in params})
    at_max = state._replace(count={k: torch.tensor(INT64_MAX if k in ("w2", "w3") else 2) for k in params})
    with pytest.raises(sofx.LeafError, match=r"state\.count\['w2'\]: step count 9223372036854775807 is int64's"):
        opt.update(params, grads, at_max)


@pytest.mark.parametrize("speculate", [True, False])
@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_the_offload_facade_refuses_a_step_size_beyond_float32_and_keeps_working(executor, speculate):
    """A group's lr set so that ``lr / (1 - beta1**t)`` is beyond float32 (beta1 of 1 - 2^-53: ``1 - beta1**t`` is
    2.2e-16 at t = 2), as sofx.adam refuses it: the refusal came out of the executor and stopped the engine for
    good. step() refuses it before any block is stepped, naming the parameter, with nothing speculated; the
    engine keeps working once the lr is put back, and a later lr change between backward and step() to such a
    value is refused as well (the speculated blocks' redo)."""
    import sofx.offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    gen = torch.Generator().manual_seed(1)

    def loss() -> torch.Tensor:
        return model(torch.randn(4, 6, generator=gen)).pow(2).mean()

    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-3, betas=(1 - 2 ** -53, 0.999), executor=executor,
                                       block_numel=40, loss_scale=None, speculate=speculate) as opt:
        opt.backward(loss())
        opt.step()
        opt.zero_grad()
        for bad_before_backward in (True, False):
            before = _facade_state(opt, model)
            weights = [p.detach().clone() for p in model.parameters()]
            if bad_before_backward:
                opt.param_groups[0]["lr"] = 1e30
            opt.backward(loss())
            opt.param_groups[0]["lr"] = 1e30
            with pytest.raises(sofx.HParamError, match=r"hparams for parameter 0 = param_groups\[0\]\['params'\]\[0\]: "
                                                       r"lr / \(1 - beta1\*\*t\) = 4\.5\d*e\+45 at step t = 2 is "
                                                       r"beyond float32's range"):
                opt.step()
            opt.zero_grad()
            assert all(torch.equal(a[k], b[k]) for a, b in zip(before, _facade_state(opt, model)) for k in a)
            assert all(torch.equal(w, p.detach()) for w, p in zip(weights, model.parameters()))
            opt.param_groups[0]["lr"] = 1e-3
        opt.backward(loss())
        opt.step()
        assert [int(opt.state[p]["step"]) for p in model.parameters()] == [2, 2, 2, 2]


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu_fast"])
@pytest.mark.parametrize("start", [2 ** 24 - 2, 2 ** 31 - 2, 2 ** 32 - 2, 2 ** 53 - 2])
def test_a_run_resumed_from_a_checkpoint_at_a_large_count_is_the_uninterrupted_run(backend, start, tmp_path):
    """Counts past float32's exact integers (2^24) and int32's (2^31, 2^32) are int64 in the state and in the file:
    the resumed run steps with the same ``t`` bit for bit (a beta2 of 1 - 2^-24 makes ``1 - beta2**t`` depend on
    every bit of ``t`` near 2^24), and its count goes on from the saved one."""
    import sofx.checkpoint as ck

    hp = sofx.AdamHParams(lr=1e-3, beta1=0.9, beta2=1 - 2 ** -24, eps=1e-8, weight_decay=0.1)
    opt = sofx.adamw(backend=backend)
    params, _, state = _leaves(start)
    state = state._replace(count={k: torch.tensor(start) for k in params})
    gen = torch.Generator().manual_seed(5)
    grads = [{k: torch.randn(p.shape, generator=gen) for k, p in params.items()} for _ in range(6)]
    p, s = params, state
    for i, g in enumerate(grads):
        p, s, _ = opt.update(p, g, s, hp)
        if i == 2:
            ck.save(tmp_path / "run.ckpt", {"params": p, "state": s})
    back = ck.load(tmp_path / "run.ckpt")
    q, r = back["params"], back["state"]
    assert r.count["head"].dtype == torch.int64 and int(r.count["head"]) == start + 3
    for g in grads[3:]:
        q, r, _ = opt.update(q, g, r, hp)
    assert trees_equal(p, q) and trees_equal(s, r) and int(r.count["w"]) == start + 6


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_the_offload_facade_resumed_from_a_checkpoint_at_a_large_count_is_the_uninterrupted_run(executor, tmp_path):
    import sofx.checkpoint as ck
    import sofx.offload

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def loss(model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
        return model(torch.randn(4, 6, generator=gen)).pow(2).mean()

    kw = dict(lr=1e-2, betas=(0.9, 1 - 2 ** -24), executor=executor, block_numel=40, loss_scale=None)
    model, gen = make(), torch.Generator().manual_seed(1)
    with sofx.offload.SpeculativeAdamW(model.parameters(), **kw) as opt:
        opt.backward(loss(model, gen))
        opt.step()
        opt.zero_grad()
        for p in model.parameters():
            opt.state[p]["step"] = 2 ** 24 - 2
        for i in range(6):
            opt.backward(loss(model, gen))
            opt.step()
            opt.zero_grad()
            if i == 2:
                ck.save(tmp_path / "run.ckpt", {"opt": opt.state_dict(), "model": model.state_dict(),
                                                "gen": gen.get_state()})
        whole = [p.detach().clone() for p in model.parameters()]
    saved = ck.load(tmp_path / "run.ckpt")
    model = make()
    model.load_state_dict(saved["model"])
    gen.set_state(saved["gen"])
    with sofx.offload.SpeculativeAdamW(model.parameters(), **kw) as opt:
        opt.load_state_dict(saved["opt"])
        for _ in range(3):
            opt.backward(loss(model, gen))
            opt.step()
            opt.zero_grad()
        assert [int(opt.state[p]["step"]) for p in model.parameters()] == [2 ** 24 + 4] * 4
    assert all(torch.equal(a, b.detach()) for a, b in zip(whole, model.parameters()))


def test_the_offload_report_of_an_overflow_step_counts_no_block_at_int64_max_as_ineligible():
    """A block whose count is int64's largest is not speculated (its step is refused in step()); on a step that
    overflows (skipped: no block stepped, a report returned) the report counted it ``ineligible``, which says its
    step could not be undone within the snapshot budget. It is held from speculating, as a block kept on the device:
    not counted ineligible, no "ready" event (a step that is not skipped refuses it, naming the count)."""
    import sofx.offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, executor="inline", block_numel=40) as opt:
        layouts = opt.engine.layouts
        assert len(layouts) == 2
        last = list(model.parameters())[-1]  # (block 1: ready first in backward)
        opt.backward(model(torch.randn(2, 4)).square().mean())
        opt.step()
        opt.zero_grad()
        opt.state[last]["step"] = INT64_MAX
        model[0].weight.register_hook(lambda g: g * float("inf"))  # (block 0, ready last: the step overflows)
        opt.backward(model(torch.randn(2, 4)).square().mean())
        report = opt.step()
    assert report.overflow and report.skipped and report.actions == ("skip", "skip")
    assert report.ineligible == 0 and ("ready", 1) not in report.events, report
    assert int(opt.state[last]["step"]) == INT64_MAX


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_the_offload_report_of_an_overflow_step_counts_no_block_with_a_step_size_beyond_float32_as_ineligible(
        executor):
    """A block whose step size ``lr / (1 - beta1**t)`` at its count is beyond float32 (its step is refused in
    step(), naming the parameter, as a count at int64's largest is) is not speculated; on a step that overflows
    (skipped, a report returned) the report counted it ``ineligible``, which says its step could not be undone
    within the snapshot budget, and said nowhere why. It is held from speculating, as a block at int64's largest:
    not counted ineligible, no "ready" event, the report saying that no block was speculated and why, in step()'s
    words."""
    import sofx.offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, betas=(1 - 2 ** -53, 0.999), executor=executor,
                                       block_numel=40) as opt:
        assert len(opt.engine.layouts) == 2
        opt.backward(model(torch.randn(2, 4)).square().mean())
        opt.step()
        opt.zero_grad()
        opt.param_groups[0]["lr"] = 1e30  # (lr / (1 - beta1**2) = 4.5e45)
        hook = model[0].weight.register_hook(lambda g: g * float("inf"))  # (the step overflows)
        opt.backward(model(torch.randn(2, 4)).square().mean())
        report = opt.step()
        opt.zero_grad()
        hook.remove()
        assert report.overflow and report.skipped and report.actions == ("skip", "skip")
        assert report.ineligible == 0 and not any(kind == "ready" for kind, _ in report.events), report
        assert not report.speculating
        assert re.search(r"^every block was held from speculating: step\(\) refuses its step with these hparams: "
                         r"hparams for parameter \d = param_groups\[0\]\['params'\]\[\d\]: lr / \(1 - beta1\*\*t\) = "
                         r"4\.5\d*e\+45 at step t = 2 is beyond float32's range", report.not_speculating_reason), \
            report.not_speculating_reason
        opt.backward(model(torch.randn(2, 4)).square().mean())
        with pytest.raises(sofx.HParamError, match=r"hparams for parameter \d = param_groups\[0\]\['params'\]\[\d\]: "
                                                   r"lr / \(1 - beta1\*\*t\) = 4\.5\d*e\+45 at step t = 2 is beyond"):
            opt.step()
        opt.zero_grad()
