"""The ```python examples of README.md run against the current API.

Each block is read from README.md at test time: the first ```python block under its section heading (``## The
functional core``, ``## Transforms, loss scaling, schedules, speculation``, ``## The offload engine``, ``## Many
ranks (torch.distributed)``, ``## Checkpoints``); a block that moved, vanished or was added without a test here
fails with a message saying so. Then it is executed:

* the functional core is self-contained: run as it is, then its results are checked (the undo gives the
  parameters back, the leaf with a ``None`` gradient is not stepped, the redo is the step with ``grad_scale``);
* the apply_if_finite lines run on a gradient holding an inf: nothing stepped, the undo gives the counters back;
* the offload facade's loop runs with a prelude defining ``model``, ``data`` and ``loss_fn`` (a tiny MLP, a few
  batches, two of them large enough to clip) and ends equal to ``torch.optim.AdamW`` + ``clip_grad_norm_``;
* the torch.distributed loop runs in a real one-rank gloo group in this process (``env://`` on localhost, the
  group destroyed afterwards), its ``grads = ...`` placeholder replaced by the prelude's gradients; gathered, it
  equals the single-process speculative loop bit for bit and the serial loop within 1e-6;
* the checkpoint lines run with a prelude defining ``path``, ``params``, ``state``, ``n``, ``template``, the
  facade ``opt`` and a torch ``sched``; the saved trees come back bit for bit and every save is waited for.
"""

from __future__ import annotations

import copy
import math
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from test_offload_support import one_torch_thread, tensor_deviation  # noqa: F401 (autouse fixture)

import sofx
import sofx.offload
from sofx import loss_scale
from sofx import speculate as sp
from sofx.serial import init_loop, serial_loop_step

from helpers import assert_trees_bitwise

README = Path(__file__).resolve().parent.parent / "README.md"
SECTIONS = {  # the section heading of each tested block -> a line the block must contain
    "functional": ("## The functional core", "opt.undo_redo("),
    "apply_if_finite": ("## Transforms, loss scaling, schedules, speculation", "sofx.apply_if_finite("),
    "offload": ("## The offload engine", "sofx.offload.SpeculativeAdamW("),
    "distributed": ("## Many ranks (torch.distributed)", "sd.shard_blocks(params)"),
    "checkpoint": ("## Checkpoints", "sofx.checkpoint.save_async("),
}
TOL = 1e-6


# ---------------------------------------------------------------- reading the blocks
def _python_blocks() -> list[tuple[str, str]]:
    """Every ```python block of README.md with the ``## `` heading it falls under (outside code blocks), in order;
    a block indented in a list item is dedented."""
    blocks: list[tuple[str, str]] = []
    heading, fence, code = "", None, []
    for line in README.read_text().splitlines():
        if fence is None and line.lstrip().startswith("```"):
            fence, code = line.lstrip()[3:].strip(), []
        elif fence is not None and line.strip() == "```":
            if fence == "python":
                blocks.append((heading, textwrap.dedent("\n".join(code) + "\n")))
            fence = None
        elif fence is not None:
            code.append(line)
        elif line.startswith("## "):
            heading = line.rstrip()
    return blocks


def readme_block(name: str) -> str:
    """The code of the first ```python block under ``SECTIONS[name]``'s heading (checked for its marker)."""
    heading, marker = SECTIONS[name]
    found = [code for h, code in _python_blocks() if h == heading]
    if not found:
        pytest.fail(f"README.md has no ```python block under {heading!r} any more: the example moved or vanished; "
                    "update tests/test_readme_examples.py's SECTIONS")
    if marker not in found[0]:
        pytest.fail(f"README.md's ```python block under {heading!r} no longer contains {marker!r}: the example "
                    f"changed; update tests/test_readme_examples.py. The block now reads:\n{found[0]}")
    return found[0]


def run_block(code: str, namespace: dict[str, Any], name: str) -> dict[str, Any]:
    """Execute a README block in ``namespace`` (its prelude's names); returns the namespace."""
    exec(compile(code, f"README.md ({name} example)", "exec"), namespace)
    return namespace


def test_every_python_block_of_the_readme_is_tested() -> None:
    """A ```python block added to README.md (or moved under another heading) fails here until it has a test."""
    headings = [h for h, _ in _python_blocks()]
    tested = [heading for heading, _ in SECTIONS.values()]
    assert headings == tested, (f"README.md's ```python blocks fall under {headings}; tests/test_readme_examples.py "
                                f"runs those under {tested}")


# ---------------------------------------------------------------- the functional core
def test_functional_core_example_undoes_and_redoes() -> None:
    ns = run_block(readme_block("functional"), {}, "functional core")
    params, grads, opt, state, hp = (ns[k] for k in ("params", "grads", "opt", "state", "hp"))
    new_params, new_state, _ = opt.update(params, grads, state, hp)  # the example's first step, again
    for tree_ in (new_params, ns["old_params"], ns["redone"]):
        assert {k: v.shape for k, v in tree_.items()} == {"w": (4, 3), "b": (3,)}
    assert not torch.equal(new_params["w"], params["w"])
    # the undo gives the parameters and the (first step's zero) moments back
    for k in ("w", "b"):
        assert (ns["old_params"][k] - params[k]).abs().max() <= TOL, k
    assert torch.equal(ns["old_state"].mu["w"], torch.zeros(4, 3))
    assert torch.equal(ns["old_state"].nu["w"], torch.zeros(4, 3))
    assert int(ns["old_state"].count["w"]) == 0
    # 'b' had a None gradient: not stepped, in the step and in the redo
    for p, s in ((new_params, new_state), (ns["redone"], ns["redone_state"])):
        assert torch.equal(p["b"], params["b"])
        assert int(s.count["b"]) == 0 and int(s.count["w"]) == 1
    # the redo is the step taken with grad_scale=0.5 from the start
    want, want_state, _ = opt.update(params, grads, state, hp, grad_scale=0.5)
    assert (ns["redone"]["w"] - want["w"]).abs().max() <= TOL
    assert (ns["redone_state"].mu["w"] - want_state.mu["w"]).abs().max() <= TOL
    assert not torch.equal(ns["redone_state"].mu["w"], new_state.mu["w"])  # (a first step's p is scale-free)


# ---------------------------------------------------------------- apply_if_finite
def test_apply_if_finite_example_skips_a_non_finite_step() -> None:
    """The example's step of a gradient holding an inf leaves the params and the Adam state as they were and counts
    it; its undo gives the counters back; a finite step after it is the plain AdamW step."""
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads["w"][1, 2] = math.inf
    ns = run_block(readme_block("apply_if_finite"), {"sofx": sofx, "params": params, "grads": grads}, "apply_if_finite")
    for k in params:
        assert torch.equal(ns["params"][k], params[k]), k
    fresh = sofx.adamw(lr=1e-3).init(params)
    assert int(ns["state"].inner_state.count["w"]) == int(fresh.count["w"]) == 0
    assert int(ns["state"].notfinite_count) == 0 and bool(ns["state"].last_finite)  # the undo's counters
    skipped, skipped_state, _ = ns["opt"].update(params, grads, ns["state"])
    assert int(skipped_state.notfinite_count) == 1 and int(skipped_state.total_notfinite) == 1
    grads["w"][1, 2] = 0.5
    stepped, _, _ = ns["opt"].update(params, grads, ns["state"])
    want, _, _ = sofx.adamw(lr=1e-3).update(params, grads, fresh)
    for k in params:
        assert torch.equal(stepped[k], want[k]), k


# ---------------------------------------------------------------- the offload engine
OFFLOAD_STEPS = 6
OFFLOAD_CLIPPED = {2, 5}  # batches whose targets are 50x: the gradient norm is above max_grad_norm=1.0


def _offload_prelude() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen) * (50.0 if i in OFFLOAD_CLIPPED
                                                                                   else 1.0))
            for i in range(OFFLOAD_STEPS)]

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    return {"torch": torch, "sofx": sofx, "model": model, "data": data, "loss_fn": loss_fn}


def test_offload_example_trains_as_torch_adamw_with_clip_grad_norm() -> None:
    ns = _offload_prelude()
    model = ns["model"]
    ref = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    run_block(readme_block("offload"), ns, "offload engine")
    opt, report = ns["opt"], ns["report"]
    assert opt.last_report is report and report.clipped  # the last batch clips
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-2)
    norms = []
    for batch in ns["data"]:
        ropt.zero_grad()
        ns["loss_fn"](ref, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0)))
        ropt.step()
    clipped = {i for i, n in enumerate(norms) if n > 1.0}
    assert OFFLOAD_CLIPPED <= clipped and len(clipped) < len(norms), norms  # clipped and unclipped steps
    for p, q, p0 in zip(model.parameters(), ref.parameters(), start):
        assert not torch.equal(p.detach(), p0)
        assert tensor_deviation(p, q) <= TOL, tensor_deviation(p, q)


# ---------------------------------------------------------------- many ranks (torch.distributed)
DIST_STEPS = 8
DIST_BIG = {3, 6}  # gradients 25x: the global norm clips
GRADS_PLACEHOLDER = re.compile(r"^(\s*)grads = \.\.\.(?=\s)", re.M)


def _dist_params() -> dict:
    g = torch.Generator().manual_seed(20261130)
    return {"embed": torch.randn(6, 4, generator=g),
            "layers": [{"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}],
            "head": torch.randn(3, 5, generator=g)}


def _schedule(step: int) -> dict:
    decay = 0.97 ** step
    return {"embed": sofx.AdamHParams(lr=1e-2 * decay, weight_decay=0.0),
            "layers": sofx.AdamHParams(lr=2e-2 * decay, beta1=0.85),
            "head": sofx.AdamHParams(lr=5e-3, weight_decay=0.1)}


def _raw_grads(step: int) -> dict:
    g = torch.Generator().manual_seed(7 + step)
    return sofx.tree.tree_map(lambda p: torch.randn(p.shape, generator=g) * (0.5 if step in DIST_BIG else 0.02),
                              _dist_params())


def _scaler():
    return loss_scale.grad_scaler(init_scale=2.0 ** 10, growth_interval=3)


def _scaled(grads: dict, scale: float) -> dict:
    return sofx.tree.tree_map(lambda g: g * scale, grads)


def _dist_prelude() -> dict[str, Any]:
    def gradients(batch: int, loop) -> dict:
        """This rank's gradients of loss * scale for ``batch`` (a step number)."""
        return _scaled(_raw_grads(batch), ns["scaler"].scale(loop.scaler_state))

    ns = {"params": _dist_params(), "opt": sofx.adamw(lr=1e-2, weight_decay=0.05), "scaler": _scaler(),
          "schedule": _schedule, "cfg": sp.SpeculationConfig(max_norm=1.0), "data": range(DIST_STEPS),
          "gradients": gradients}
    return ns


def _with_gradients(code: str) -> str:
    """The block with its ``grads = ...`` placeholder computing the prelude's gradients."""
    code, n = GRADS_PLACEHOLDER.subn(r"\1grads = gradients(batch, loop)", code)
    if n != 1:
        pytest.fail(f"README.md's torch.distributed example has {n} 'grads = ...' placeholder lines, expected one")
    return code


@pytest.fixture
def one_rank_env(monkeypatch):
    """What ``dist.init_process_group("gloo")`` reads (``env://``): a one-rank group on localhost, the store
    on a free port; the group is destroyed afterwards, whatever the test did."""
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    assert not dist.is_initialized()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _single_process_runs(opt, cfg) -> tuple[Any, Any, set[int]]:
    """The speculative and the serial loop over the whole tree, one process, the same gradients; and the steps
    where the serial loop clipped."""
    scaler = _scaler()
    spec = ser = init_loop(opt, _dist_params(), scaler)
    clipped = set()
    for step in range(DIST_STEPS):
        spec, _ = sp.speculative_loop_step(opt, spec, _scaled(_raw_grads(step), scaler.scale(spec.scaler_state)),
                                           config=cfg, scaler=scaler, hparams=_schedule)
        ser, facts = serial_loop_step(opt, ser, _scaled(_raw_grads(step), scaler.scale(ser.scaler_state)),
                                      scaler=scaler, hparams=_schedule, max_norm=cfg.max_norm)
        if facts.clipped:
            clipped.add(step)
    return spec, ser, clipped


def test_distributed_example_equals_the_single_process_loops(one_rank_env) -> None:
    ns = run_block(_with_gradients(readme_block("distributed")), _dist_prelude(), "torch.distributed")
    assert dist.get_world_size() == 1 and list(ns["shard"].owned) == list(range(4))
    loop, shard, params = ns["loop"], ns["shard"], ns["params"]
    assert loop.step == DIST_STEPS
    spec, ser, clipped = _single_process_runs(ns["opt"], ns["cfg"])
    assert clipped == DIST_BIG  # the run clips (the speculated steps are undone and redone)
    got = {"params": ns["full"], "mu": shard.gather(loop.opt_state.mu, like=params),
           "nu": shard.gather(loop.opt_state.nu, like=params)}
    assert_trees_bitwise(got, {"params": spec.params, "mu": spec.opt_state.mu, "nu": spec.opt_state.nu})
    for a, b in zip(sofx.tree.flatten(ns["full"])[0], sofx.tree.flatten(ser.params)[0]):
        assert (a - b).abs().max() <= TOL * b.abs().max(), "the gathered params differ from the serial loop's"
    assert not all(torch.equal(a, b) for a, b in zip(sofx.tree.flatten(ns["full"])[0],
                                                     sofx.tree.flatten(_dist_params())[0]))


# ---------------------------------------------------------------- checkpoints
def _checkpoint_prelude(tmp_path: Path) -> dict[str, Any]:
    adam = sofx.adamw(lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen).to(torch.bfloat16)}
    state = adam.init(params)
    for _ in range(2):
        grads = sofx.tree.tree_map(lambda p: torch.randn(p.shape, generator=gen).to(p.dtype), params)
        params, state, _ = adam.update(params, grads, state)
    template = {"params": sofx.tree.tree_map(torch.zeros_like, params),
                "state": sofx.tree.tree_map(torch.zeros_like, state), "step": 0}
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, executor="inline")
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(torch.randn(5, 6, generator=gen)).square().mean())
        opt.step()
        sched.step()
    return {"torch": torch, "sofx": sofx, "path": str(tmp_path / "run.ckpt"), "params": params, "state": state,
            "n": 2, "template": template, "opt": opt, "sched": sched, "model": model}


def _clone(tree_: Any) -> Any:
    return sofx.tree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree_)


def test_checkpoint_example_round_trips(tmp_path: Path) -> None:
    ns = _checkpoint_prelude(tmp_path)
    opt = ns["opt"]
    saved = _clone({"params": ns["params"], "state": ns["state"], "step": ns["n"]})
    saved_opt, saved_sched = _clone(opt.state_dict()), ns["sched"].state_dict()
    try:
        run_block(readme_block("checkpoint"), ns, "checkpoints")
        # its async save to the path is committed before the facade's save to the same path (unordered, the
        # file held either tree)
        assert ns["handle"].done(), "the example must wait for save_async before saving to the same path again"
        assert ns["handle"].wait(60) == ns["path"]
        ns["saver"].wait(60)
        assert_trees_bitwise(ns["tree"], saved)  # dtypes (the bf16 leaf) and bits kept
        ckpt = sofx.checkpoint.load(ns["path"])  # the facade's save, the last to the path
        assert_trees_bitwise(ckpt["opt"], saved_opt)
        assert ckpt["sched"] == saved_sched
        model = copy.deepcopy(ns["model"])
        with sofx.offload.SpeculativeAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0,
                                           executor="inline") as again:
            sched = torch.optim.lr_scheduler.ExponentialLR(again, gamma=0.9)
            again.load_state_dict(ckpt["opt"])
            sched.load_state_dict(ckpt["sched"])
            assert_trees_bitwise(again.state_dict(), saved_opt)
            assert math.isclose(again.param_groups[0]["lr"], 1e-2 * 0.9 ** 2)
        # the saver of the example commits its saves in order
        ns["saver"].save(ns["path"], ns["tree"])
        ns["saver"].save(tmp_path / "other.ckpt", saved)
        ns["saver"].wait(60)
        assert_trees_bitwise(sofx.checkpoint.load(ns["path"], like=ns["template"]), saved)
    finally:
        for k in ("handle", "saver"):
            if k in ns:
                ns[k].wait(60)
        opt.close()
