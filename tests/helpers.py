"""Shared test helpers: random pytrees and comparison utilities."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import numpy as np
import torch

import sofx
from sofx.kernels.base import AdamScalars

INTERPRETING_TRITON = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def rerun_under_the_triton_interpreter(test_file: str) -> None:
    """Run the tests of ``test_file`` in a fresh process with ``TRITON_INTERPRET=1`` and assert that they pass.
    The interpreter must be on before the Triton kernels are decorated and must not leak into the rest of the
    session, so a test module of the Triton backend holds, in the normal session, one test that calls this
    (where its real tests are collected only when :data:`INTERPRETING_TRITON`)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", test_file],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(test_file))))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


def rand_tree(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> dict:
    """A nested params tree with a zero-size leaf, a NamedTuple and a list."""

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return {
        "embed": r(7, 5),
        "layers": [{"w": r(5, 5), "b": r(5)}, {"w": r(5, 3), "b": r(3)}],
        "empty": r(0, 4),
        "head": sofx.AdamHParams(lr=r(3), beta1=r(2, 2)),  # any NamedTuple works as a node
    }


def clone_tree(tree):
    return sofx.tree.tree_map(lambda t: t.clone(), tree)


def trees_equal(a, b) -> bool:
    la, sa = sofx.tree.flatten(a)
    lb, sb = sofx.tree.flatten(b)
    return sa == sb and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


def max_rel_err(a: torch.Tensor, b: torch.Tensor, operand: torch.Tensor | None = None) -> float:
    """Largest |a - b| relative to max(|b|, tiny), elementwise (nan-aware: nan only matches nan).

    With ``operand`` (e.g. the parameter a step started from) relative to max(|b|, |operand|, tiny): the error
    of a result that is a sum (p' = p - u) is a fraction of its operands' magnitudes, which cancellation makes
    large against the result alone (an ulp of u where p' ~ 0)."""
    a64, b64 = a.double(), b.double()
    if not torch.equal(torch.isnan(a64), torch.isnan(b64)):
        return float("inf")
    mask = ~torch.isnan(b64)
    if mask.sum() == 0:
        return 0.0
    diff = (a64 - b64)[mask].abs()
    scale = b64[mask].abs()
    if operand is not None:
        scale = torch.maximum(scale, operand.double().expand_as(b64)[mask].abs().nan_to_num(0.0))
    return float((diff / scale.clamp_min(torch.finfo(a.dtype).tiny)).max())


def assert_trees_bitwise(a, b) -> None:
    """Same structure, and every leaf equal: tensors in dtype, shape and bits; other leaves by ==."""
    la, sa = sofx.tree.flatten(a)
    lb, sb = sofx.tree.flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        else:
            assert x == y


def library_copying_compiler(directory, library: str, before_copy: str = "") -> str:
    """A stand-in C compiler in ``directory`` (its path returned): it answers ``--version`` as "fakecc 1.0" and
    "builds" by copying ``library`` (a native library built before) to its ``-o`` target, after running the shell
    lines ``before_copy`` (a log, a wait). Quick where a test needs a build, not the compiler's work."""
    fake = directory / "fakecc"
    fake.write_text("#!/bin/sh\n"
                    'case " $* " in *" --version "*) echo "fakecc 1.0"; exit 0;; esac\n'
                    f"{before_copy}"
                    'out=""; while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done\n'
                    f'cp {library} "$out"\n')
    fake.chmod(0o755)
    return str(fake)


def cached_native_build(flags: list[str], source: str | None = None):
    """The native library built from ``source`` (default: the kernel source) with exactly ``flags``, kept in the
    library's own cache (its key has the flags): each other build a test needs (an AVX2 build, one without
    OpenMP) is compiled once per machine, not once per test worker and subprocess that checks it."""
    import pytest

    from sofx.kernels import _cpu_build

    lib = _cpu_build._build_and_open(_cpu_build.SOURCE if source is None else source, flag_sets=[flags])
    if isinstance(lib, str):
        pytest.fail(lib)
    return lib


def import_written_module(directory, name: str, source: str, extra_files: dict[str, str] | None = None):
    """Write ``source`` as ``directory/name.py`` (and ``extra_files``) and import it afresh.

    Used where a parent test and a child process must run the very same code.
    """
    import importlib
    import sys

    (directory / f"{name}.py").write_text(source)
    for file_name, text in (extra_files or {}).items():
        (directory / file_name).write_text(text)
    sys.path.insert(0, str(directory))
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(directory))


def block_inputs(gen: torch.Generator, n: int | tuple, pdt: torch.dtype, sdt: torch.dtype, sound: bool = False):
    """Random ``p, g, m, v`` of one kernel block (params and gradient in ``pdt``, moments in ``sdt``;
    ``v`` positive, nothing zero). ``sound``: a second moment large enough that no step with the gradient (or
    another of its law, within 3.5 standard deviations) is too lossy to undo (``lossy_elements``, betas of
    :func:`block_scalars`), so that a checked step flags only what a test plants: ``p`` and ``g`` are clipped to
    3.5 standard deviations (an old gradient of 4.7 at grad_scale 0.5 and beta2 0.990 left an undo+redo's undone
    second moment at 0, its chunk flagged, once in ~10^5 draws)."""
    shape = (n,) if isinstance(n, int) else n
    p = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen)
    if sound:
        p, g = p.clamp_(-3.5, 3.5), g.clamp_(-3.5, 3.5)
    p, g = p.to(pdt), g.to(pdt)
    m = (0.1 * torch.randn(shape, generator=gen)).to(sdt)
    if sound:
        v = (0.05 * torch.rand(shape, generator=gen) + 0.05).to(sdt)
    else:
        v = (0.01 * torch.rand(shape, generator=gen) + 1e-4).to(sdt)
    return p, g, m, v


def block_scalars(gen: torch.Generator, wd: float, grad_scale: float = 1.0) -> AdamScalars:
    """Random scalars of a step: lr, betas and the step number drawn, ``eps`` 1e-8."""
    u = torch.rand(4, generator=gen).tolist()
    step = int(torch.randint(1, 500, (1,), generator=gen))
    return AdamScalars(lr=1e-3 * (0.5 + u[0]), beta1=0.85 + 0.1 * u[1], beta2=0.99 + 0.009 * u[2], eps=1e-8,
                       weight_decay=wd, step=step, grad_scale=grad_scale)


def refuse_bad_blocks_first(backend, prefix: str, blocks, s: AdamScalars, variant) -> None:
    """Each list form of ``backend`` refuses a bad last block (the others valid) with an error naming it
    (``prefix``: the backend's name), before running any block: ``step_many`` a gradient of another shape,
    ``undo_many`` a beta1 of 0, ``undo_redo_many`` an undone step's beta2 of 0 and a new gradient of another
    shape. A list of one bad block is named as a list (``step_many[0]``, ``undo_many[0]``), not as the
    single-block call. The callers check that every block kept its values. ``blocks``: ``(p, g, m, v)``,
    donated."""
    import pytest

    from sofx.errors import LeafError, UnsupportedError
    from sofx.kernels.base import StepCall, UndoCall, UndoRedoCall

    last = len(blocks) - 1
    g_short = blocks[last][1][:-1]
    calls = [StepCall(*b, s, out=(b[0], b[2], b[3])) for b in blocks]
    calls[last] = calls[last]._replace(g=g_short)
    with pytest.raises(LeafError, match=rf"{prefix}\.step_many\[{last}\]: g has shape"):
        backend.step_many(calls, variant)
    with pytest.raises(LeafError, match=rf"{prefix}\.step_many\[0\]: g has shape"):
        backend.step_many(calls[last:], variant)  # (triton named it triton.step)
    undo_calls = [UndoCall(*b, s._replace(beta1=0.0) if i == last else s, out=(b[0], b[2], b[3]))
                  for i, b in enumerate(blocks)]
    with pytest.raises(UnsupportedError, match=rf"{prefix}\.undo_many\[{last}\]: algebraic undo is impossible "
                                               "with beta1 == 0"):
        backend.undo_many(undo_calls, variant)
    with pytest.raises(UnsupportedError, match=rf"{prefix}\.undo_many\[0\]: algebraic undo is impossible"):
        backend.undo_many(undo_calls[last:], variant)
    redo_calls = [UndoRedoCall(b[0], b[2], b[3], b[1], s, b[1], s, out=(b[0], b[2], b[3])) for b in blocks]
    for bad, error, message in ((redo_calls[last]._replace(s_old=s._replace(beta2=0.0)), UnsupportedError,
                                 "algebraic undo is impossible with beta2 == 0"),
                                (redo_calls[last]._replace(g_new=g_short), LeafError, "g_new has shape")):
        with pytest.raises(error, match=rf"{prefix}\.undo_redo_many\[{last}\]: {message}"):
            backend.undo_redo_many(redo_calls[:last] + [bad], variant)


BAD_GRAD_SCALES = (-0.5, -1e-300, float("inf"), float("nan"), torch.tensor(-2.0))  # (0 is valid: zero gradients)


def refuse_bad_grad_scales(backend, prefix: str, blocks, s: AdamScalars, variant) -> None:
    """Every entry of ``backend`` refuses a ``grad_scale`` that is not finite and >= 0 (:data:`BAD_GRAD_SCALES`)
    with an ``HParamError`` naming the call and the value (:func:`refuse_bad_scalars_everywhere`), writing
    nothing. ``blocks``: ``(p, g, m, v)``, donated."""
    import re

    before = _copies(blocks)
    for bad in BAD_GRAD_SCALES:
        refuse_bad_scalars_everywhere(backend, prefix, blocks, s, s._replace(grad_scale=bad), variant,
                                      rf"grad_scale = {re.escape(repr(float(bad)))} is invalid; expected a finite "
                                      "value >= 0")
    _assert_unchanged(blocks, before)


# Scalars no step can take, as sofx.Adam.update refuses them (blocks stepped in float32), and the errors' words.
BAD_SCALARS = (
    ({"grad_scale": 1e39}, r"grad_scale = 1e\+39 is beyond float32's range \(largest 3.4028234663852886e\+38\); "
                           "the block is stepped in float32"),
    ({"beta1": 1.0}, r"beta1 = 1.0 is invalid; expected 0 <= beta1 < 1"),
    ({"beta2": 1.0}, r"beta2 = 1.0 is invalid; expected 0 <= beta2 < 1"),
    ({"beta2": -0.1}, r"beta2 = -0.1 is invalid; expected 0 <= beta2 < 1"),
    ({"beta1": float("nan")}, r"beta1 = nan is invalid"),
    ({"beta1": torch.tensor(1.0)}, r"beta1 = 1.0 is invalid"),
    ({"step": 0}, r"step = 0 is invalid; expected the number of the step taken, >= 1"),
    ({"step": 10**400}, r"step = 1000\d+ is invalid; expected the number of the step taken, >= 1, a finite number"),
    ({"eps": 0.0}, r"eps = 0.0 is invalid; expected eps > 0"),
    ({"eps": -1e-8}, r"eps = -1e-08 is invalid; expected eps > 0"),
    ({"eps": torch.tensor(0.0)}, r"eps = 0.0 is invalid; expected eps > 0"),
    ({"eps": 1e-46}, r"eps = 1e-46 is beyond float32's range \(an eps this small is 0 there\); the block is "
                     "stepped in float32"),
    ({"lr": -1e-3}, r"lr = -0.001 is invalid; expected lr >= 0"),
    ({"lr": float("inf")}, r"lr = inf is invalid; expected lr >= 0"),
    ({"lr": 1e39}, r"lr = 1e\+39 is beyond float32's range \(largest 3.4028234663852886e\+38\)"),
    ({"weight_decay": -0.1}, r"weight_decay = -0.1 is invalid; expected weight_decay >= 0"),
    ({"weight_decay": float("nan")}, r"weight_decay = nan is invalid; expected weight_decay >= 0"),
    ({"weight_decay": 10**400}, r"weight_decay = 1000\d+ is invalid; expected weight_decay >= 0, a finite number"),
    # a bool (no number: step=False stepped with 1 - beta1**False = 0, every result nan) or another non-number
    ({"step": False}, r"step = False is invalid; expected a number or a 0-d tensor, got bool"),
    ({"lr": True}, r"lr = True is invalid; expected a number or a 0-d tensor, got bool"),
    ({"grad_scale": np.bool_(True)}, r"grad_scale = \S+ is invalid; expected a number or a 0-d tensor, got bool"),
    ({"eps": "1e-8"}, r"eps = '1e-8' is invalid; expected a number or a 0-d tensor, got str"),
    ({"beta2": None}, r"beta2 = None is invalid; expected a number or a 0-d tensor, got NoneType"),
    # a tensor of elements (a p of 1 element was stepped by an lr of 3 into a p' of 3)
    ({"lr": torch.tensor([1e-3, 2e-3, 3e-3])}, r"lr is a tensor of shape \(3,\); expected a number or a 0-d tensor"),
    ({"grad_scale": torch.tensor([0.5])}, r"grad_scale is a tensor of shape \(1,\); expected a number or a 0-d tensor"),
    # a 0-d tensor of no real number (step=torch.tensor(False) read as False: nan results, as above)
    ({"step": torch.tensor(False)}, r"step is a torch.bool tensor; expected a number or a 0-d tensor of a real dtype"),
    ({"lr": torch.tensor(1e-3 + 0j)}, r"lr is a torch.complex64 tensor; expected a number or a 0-d tensor of a real "
                                      "dtype"),
)


def refuse_bad_scalars(backend, prefix: str, blocks, s: AdamScalars, variant) -> None:
    """Every entry of ``backend`` refuses each of :data:`BAD_SCALARS` (:func:`refuse_bad_scalars_everywhere`),
    writing nothing. ``blocks``: ``(p, g, m, v)`` of float32 (or bfloat16, float16) parameters, donated."""
    before = _copies(blocks)
    for fields, message in BAD_SCALARS:
        refuse_bad_scalars_everywhere(backend, prefix, blocks, s, s._replace(**fields), variant, message)
    _assert_unchanged(blocks, before)


def _copies(blocks) -> list:
    return [[t.clone() for t in b] for b in blocks]


def _assert_unchanged(blocks, before) -> None:
    """Every tensor of ``blocks`` holds what it held in ``before`` (nothing written: the calls were refused)."""
    for b, old in zip(blocks, before):
        assert all(torch.equal(x, y) for x, y in zip(b, old))


def refuse_bad_scalars_everywhere(backend, prefix: str, blocks, s: AdamScalars, sb: AdamScalars, variant,
                                  message: str) -> None:
    """Every entry of ``backend`` refuses the scalars ``sb`` with an ``HParamError`` naming the call (``prefix``:
    the backend's name) that matches ``message``: in the last block of a list form (the others valid, with
    ``s``) and in either scalars of an undo+redo, before anything is computed: the callers check that every
    block kept its values. ``blocks``: ``(p, g, m, v)``, donated."""
    import pytest

    from sofx.errors import HParamError
    from sofx.kernels.base import StepCall, UndoCall, UndoRedoCall

    last = len(blocks) - 1

    def scalars(i: int) -> AdamScalars:
        return sb if i == last else s

    cases = [
        (f"{prefix}.step", lambda: backend.step(*blocks[0], sb, variant, out=(blocks[0][0], *blocks[0][2:]))),
        (f"{prefix}.undo", lambda: backend.undo(*blocks[0], sb, variant, out=(blocks[0][0], *blocks[0][2:]))),
        (f"{prefix}.undo_redo", lambda: backend.undo_redo(blocks[0][0], *blocks[0][2:], blocks[0][1], s,
                                                          blocks[0][1], sb, variant,
                                                          out=(blocks[0][0], *blocks[0][2:]))),
        (f"{prefix}.undo_redo", lambda: backend.undo_redo(blocks[0][0], *blocks[0][2:], blocks[0][1], sb,
                                                          blocks[0][1], s, variant,
                                                          out=(blocks[0][0], *blocks[0][2:]))),
        (rf"{prefix}.step_many\[{last}\]", lambda: backend.step_many(
            [StepCall(*b, scalars(i), out=(b[0], b[2], b[3])) for i, b in enumerate(blocks)], variant)),
        (rf"{prefix}.undo_many\[{last}\]", lambda: backend.undo_many(
            [UndoCall(*b, scalars(i), out=(b[0], b[2], b[3])) for i, b in enumerate(blocks)], variant)),
        (rf"{prefix}.undo_redo_many\[{last}\]", lambda: backend.undo_redo_many(
            [UndoRedoCall(b[0], b[2], b[3], b[1], s, b[1], scalars(i), out=(b[0], b[2], b[3]))
             for i, b in enumerate(blocks)], variant)),
    ]
    for where, call in cases:
        with pytest.raises(HParamError, match=rf"{where}: {message}"):
            call()


# lr / (1 - beta1**t) beyond float32's range at t = 4 (about 2.25e45): torch.optim refuses such a step
HUGE_STEP_SIZE = {"lr": 1e30, "beta1": 1 - 2**-53, "step": 4}


def refuse_step_sizes_beyond_float32(backend, prefix: str, blocks, s: AdamScalars, variant) -> None:
    """Every entry of ``backend`` refuses scalars whose step size ``lr / (1 - beta1**t)`` is beyond float32's range
    (:data:`HUGE_STEP_SIZE`) with bias correction (``variant``'s), naming the call, ``t`` and the value, as
    sofx.Adam.update does (:func:`refuse_bad_scalars_everywhere`), writing nothing; without bias correction
    (a step size of lr) the same scalars step every block to finite values. ``blocks``: ``(p, g, m, v)`` of
    float32 parameters, donated."""
    from sofx.kernels.base import AdamVariant

    before = _copies(blocks)
    bad = s._replace(**HUGE_STEP_SIZE)
    refuse_bad_scalars_everywhere(backend, prefix, blocks, s, bad, variant._replace(bias_correction=True),
                                  r"lr / \(1 - beta1\*\*t\) = 2\.25\d*e\+45 at step t = 4 is beyond float32's range "
                                  r"\(largest 3\.4028234663852886e\+38\), in which the block is stepped")
    _assert_unchanged(blocks, before)
    p, g, m, v = blocks[0]
    uncorrected = AdamVariant(decoupled=variant.decoupled, bias_correction=False)
    assert all(torch.isfinite(t).all() for t in backend.step(p, g, m, v, bad, uncorrected))


WRITTEN_SLOTS = ("out[0]", "out[1]", "out[2]", "p", "m", "v", "p_copy")


def _entry_call(backend, entry: str, variant, s: AdamScalars, block: tuple, good: tuple):
    """A call of ``backend``'s ``entry`` (step, undo, undo_redo or their ``_many`` forms) on ``block``
    ``(p, g, m, v, g_new, out, p_copy)``; the list forms get the donated valid block ``good`` ``(p, g, m, v,
    g_new)`` first, so that a refusal of ``block`` must come before ``good`` is written."""
    from sofx.kernels.base import StepCall, UndoCall, UndoRedoCall

    p, g, m, v, g_new, out, p_copy = block
    gp, gg, gm, gv, gg_new = good
    if entry == "step":
        return lambda: backend.step(p, g, m, v, s, variant, out=out, p_copy=p_copy)
    if entry == "undo":
        return lambda: backend.undo(p, g, m, v, s, variant, out=out, p_copy=p_copy)
    if entry == "undo_redo":
        return lambda: backend.undo_redo(p, m, v, g, s, g_new, s, variant, out=out, p_copy=p_copy)
    if entry == "step_many":
        return lambda: backend.step_many([StepCall(gp, gg, gm, gv, s, (gp, gm, gv)),
                                          StepCall(p, g, m, v, s, out, p_copy)], variant)
    if entry == "undo_many":
        return lambda: backend.undo_many([UndoCall(gp, gg, gm, gv, s, None, (gp, gm, gv)),
                                          UndoCall(p, g, m, v, s, None, out, p_copy)], variant)
    return lambda: backend.undo_redo_many([UndoRedoCall(gp, gm, gv, gg, s, gg_new, s, None, (gp, gm, gv)),
                                           UndoRedoCall(p, m, v, g, s, g_new, s, None, out, p_copy)], variant)


def refuse_bad_writes(backend, prefix: str, gen: torch.Generator, bad, error: type, message: str,
                      slots: tuple[str, ...] = WRITTEN_SLOTS) -> None:
    """Every entry of ``backend`` (``prefix``: its name) refuses a call whose written tensor in one of ``slots``
    is ``bad(t)`` (a tensor of ``t``'s values that cannot be written so: ``"out[k]"`` an ``out`` that is not an
    input, ``"p"``/``"m"``/``"v"`` the donated input itself, ``"p_copy"`` beside a donated call) with an
    ``error`` matching ``"<call>: <slot>: <message>"``, raised before any tensor is written: step, undo,
    undo_redo, and each list form with the bad block last after a valid donated one. Every tensor of the calls
    (inputs, outputs, copies) keeps its bits."""
    import re

    import pytest

    from sofx.kernels.base import AdamVariant

    variant = AdamVariant()
    s = block_scalars(gen, 0.1)
    n = 37
    for slot in slots:
        for entry in ("step", "undo", "undo_redo", "step_many", "undo_many", "undo_redo_many"):
            p, g, m, v = block_inputs(gen, n, torch.float32, torch.float32)
            g_new = torch.randn(n, generator=gen)
            out, p_copy = (p, m, v), None
            if slot.startswith("out["):
                out = [torch.randn(n, generator=gen) for _ in range(3)]
                k = int(slot[4])
                out[k] = bad(out[k])
                out = tuple(out)
            elif slot == "p_copy":
                p_copy = bad(torch.randn(n, generator=gen))
            else:
                k = "pmv".index(slot)
                donated = [p, m, v]
                donated[k] = bad(donated[k])
                p, m, v = out = tuple(donated)
            good = block_inputs(gen, n, torch.float32, torch.float32)
            gp, gg, gm, gv = good
            watched = [p, g, m, v, g_new, *out, p_copy, *good]
            with torch.no_grad():
                before = [None if t is None else t.detach().clone() for t in watched]
            call = _entry_call(backend, entry, variant, s, (p, g, m, v, g_new, out, p_copy), (gp, gg, gm, gv, gg))
            where = f"{prefix}.{entry}" + (r"\[1\]" if entry.endswith("_many") else "")
            with pytest.raises(error, match=rf"{where}: {re.escape(slot)}: {message}"):
                call()
            for t, b in zip(watched, before):
                assert t is None or torch.equal(t.detach(), b), f"{entry}, {slot}: written before refusing"


READ_SLOTS = {"step": ("p", "g", "m", "v"), "undo": ("p", "g", "m", "v", "p_old"),
              "undo_redo": ("p", "m", "v", "g_old", "g_new", "p_old")}


def refuse_traced_inputs(backend, prefix: str, gen: torch.Generator) -> None:
    """Every entry of ``backend`` (``prefix``: its name) refuses, with an ``UnsupportedError`` naming the call and
    the argument and saying what to do, a call whose read tensor (each of :data:`READ_SLOTS`, the list forms' in
    their second block after a valid donated one) requires grad while grad mode is on, or is a ``torch.func``
    transform's (vmap, grad): such a kernel reads raw values, so its results were silently not differentiable
    (or batched). Nothing is written; under ``torch.no_grad()`` the same call runs, giving the values of the
    detached one."""
    import re

    import pytest

    from sofx.errors import UnsupportedError
    from sofx.kernels.base import AdamVariant, StepCall, UndoCall, UndoRedoCall

    variant = AdamVariant()
    s = block_scalars(gen, 0.1)
    n = 37

    def call(entry: str, t: dict, out, good: list, many: bool) -> tuple:
        """The call of ``entry`` on ``t``'s tensors as they are now (``many``: as the list form's second block)."""
        gp, gg, gm, gv = good
        if entry == "step":
            args = (t["p"], t["g"], t["m"], t["v"], s)
            listed = [StepCall(gp, gg, gm, gv, s, (gp, gm, gv)), StepCall(*args, out)]
        elif entry == "undo":
            args = (t["p"], t["g"], t["m"], t["v"], s)
            listed = [UndoCall(gp, gg, gm, gv, s, None, (gp, gm, gv)), UndoCall(*args, t["p_old"], out)]
        else:
            args = (t["p"], t["m"], t["v"], t["g_old"], s, t["g_new"], s)
            listed = [UndoRedoCall(gp, gm, gv, gg, s, gg, s, None, (gp, gm, gv)),
                      UndoRedoCall(*args, t["p_old"], out)]
        if many:
            return getattr(backend, f"{entry}_many")(listed, variant)[1]
        kw = {} if entry == "step" else {"p_old": t["p_old"]}
        return getattr(backend, entry)(*args, variant, out=out, **kw)

    for entry, slots in READ_SLOTS.items():
        for slot in slots:
            for how in ("requires_grad", "vmap", "grad"):
                for many in (False, True):
                    p, g, m, v = block_inputs(gen, n, torch.float32, torch.float32)
                    t = {"p": p, "g": g, "m": m, "v": v, "g_old": g, "g_new": torch.randn(n, generator=gen),
                         "p_old": p.clone()}
                    out = tuple(torch.zeros(n) for _ in range(3))
                    good = [x.clone() for x in block_inputs(gen, n, torch.float32, torch.float32)]
                    where = f"{prefix}.{entry}" + (r"_many\[1\]" if many else "")
                    if how == "requires_grad":
                        t[slot] = t[slot].clone().requires_grad_()
                        message = rf"{where}: {re.escape(slot)} requires grad while grad mode is on;.*detach.*" \
                                  r"no_grad.*reference backend or sofx.Adam"
                    else:
                        message = rf"{where}: {re.escape(slot)} is a tensor of a torch.func transform.*reference " \
                                  r"backend or sofx.Adam"
                    before = {k: x.detach().clone() for k, x in t.items()}
                    good_before = [x.clone() for x in good]
                    plain = t[slot]

                    def inner(x: torch.Tensor) -> torch.Tensor:
                        t[slot] = x
                        return call(entry, t, out, good, many)[0].sum()

                    with pytest.raises(UnsupportedError, match=message):
                        if how == "requires_grad":
                            call(entry, t, out, good, many)
                        elif how == "vmap":
                            torch.func.vmap(inner)(plain.expand(2, n).clone())
                        else:
                            torch.func.grad(inner)(plain)
                    t[slot] = plain
                    case = f"{entry}, {slot}, {how}, many={many}: written before refusing"
                    assert all(torch.equal(x.detach(), before[k]) for k, x in t.items()), case
                    assert all(torch.equal(x, torch.zeros(n)) for x in out), case
                    assert all(torch.equal(a, b) for a, b in zip(good, good_before)), case
    # under no_grad a tensor that requires grad is a plain value
    p, g, m, v = block_inputs(gen, n, torch.float32, torch.float32)
    with torch.no_grad():
        got = backend.step(p.clone().requires_grad_(), g, m, v, s, variant)
    want = backend.step(p, g, m, v, s, variant)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def inference_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in an inference tensor (made under ``torch.inference_mode()``)."""
    with torch.inference_mode():
        return t.clone()


def leaf_requiring_grad(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a leaf tensor that requires grad."""
    return t.detach().clone().requires_grad_()


def view_of_leaf_requiring_grad(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view (all but the first element) of a leaf tensor that requires grad."""
    return torch.cat([t.new_zeros(1), t.detach()]).requires_grad_()[1:]


def result_requiring_grad(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor that requires grad and is not a leaf (computed from one: autograd records
    the writes into it that torch makes)."""
    return t.detach().clone().requires_grad_() * 1.0


# Written tensors torch refuses to write in place, and the words of the kernels' refusal
UNWRITABLE = (
    (inference_copy, r"an inference tensor \(made under torch.inference_mode\(\)\) cannot be written in place "
                     "outside inference mode"),
    (leaf_requiring_grad, "a leaf tensor that requires grad cannot be written in place"),
    (view_of_leaf_requiring_grad, "a view of a leaf tensor that requires grad cannot be written in place"),
)


def expanded(t: torch.Tensor) -> torch.Tensor:
    """``t``'s first value in a tensor of ``t``'s shape whose elements all share its memory (``expand()``)."""
    return t.detach()[:1].clone().expand(t.shape)


def _shifted(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors of ``n`` elements whose memory overlaps partly (views of one buffer, 5 elements apart)."""
    buf = torch.randn(n + 5, generator=gen)
    return buf[:n], buf[5:]


# A block's written tensor sharing memory with another of the call: (case, the (block, role) pair a
# MemoryOverlapError names: the written one first; "g" is an undo+redo's "g_old"). The bad block is a list
# form's second, after a valid donated one (block 0: ``gp, gg, gm, gv``, an undo+redo's new gradient ``gg2``).
SHARED_MEMORY = (
    ("out[1] overlaps g", ((1, "out[1]"), (1, "g"))),
    ("out[2] overlaps out[1]", ((1, "out[1]"), (1, "out[2]"))),
    ("out[0] is m", ((1, "out[0]"), (1, "m"))),
    ("p_copy overlaps g", ((1, "p_copy"), (1, "g"))),
    ("p_copy is the donated p", ((1, "p"), (1, "p_copy"))),
    ("p_copy overlaps the donated m", ((1, "m"), (1, "p_copy"))),
    ("out[0] overlaps block 0's g", ((1, "out[0]"), (0, "g"))),
)


def refuse_shared_memory(backend, prefix: str, gen: torch.Generator) -> None:
    """Every entry of ``backend`` (``prefix``: its name) refuses a call whose written tensor shares memory with
    another of the call (:data:`SHARED_MEMORY`, partial overlaps and whole tensors; across blocks in the list
    forms) with a :class:`~sofx.kernels.base.MemoryOverlapError` naming both, before any tensor is written:
    step, undo, undo_redo, and each list form with the bad block last after a valid donated one. Every tensor
    of the calls keeps its bits."""
    import pytest

    from sofx.kernels.base import AdamVariant, MemoryOverlapError

    variant = AdamVariant()
    s = block_scalars(gen, 0.1)
    n = 37
    for case, pair in SHARED_MEMORY:
        for entry in ("step", "undo", "undo_redo", "step_many", "undo_many", "undo_redo_many"):
            many = entry.endswith("_many")
            if "block 0" in case and not many:
                continue
            gp, gg, gm, gv = block_inputs(gen, n, torch.float32, torch.float32)
            gg2 = torch.randn(n, generator=gen)
            p, g, m, v = block_inputs(gen, n, torch.float32, torch.float32)
            g_new = torch.randn(n, generator=gen)
            out, p_copy = tuple(torch.randn(n, generator=gen) for _ in range(3)), None
            if case == "out[1] overlaps g":
                g, o = _shifted(gen, n)
                out = (out[0], o, out[2])
            elif case == "out[2] overlaps out[1]":
                out = (out[0], *_shifted(gen, n))
            elif case == "out[0] is m":
                out = (m, out[1], out[2])
            elif case == "p_copy overlaps g":
                g, p_copy = _shifted(gen, n)
            elif case == "p_copy is the donated p":
                out, p_copy = (p, m, v), p
            elif case == "p_copy overlaps the donated m":
                m, p_copy = _shifted(gen, n)
                m.mul_(0.1)
                out = (p, m, v)
            else:
                gg, o = _shifted(gen, n)
                out = (o, out[1], out[2])
            watched = [gp, gg, gm, gv, gg2, p, g, m, v, g_new, *out, p_copy]
            before = [None if t is None else t.clone() for t in watched]
            call = _entry_call(backend, entry, variant, s, (p, g, m, v, g_new, out, p_copy), (gp, gg, gm, gv, gg2))
            want = tuple((i if many else 0, "g_old" if r == "g" and "redo" in entry else r) for i, r in pair)
            where = f"{prefix}.{entry}" + (f"[{want[0][0]}]" if many else "")
            with pytest.raises(MemoryOverlapError) as err:
                call()
            assert (err.value.first, err.value.second) == want, (entry, case, str(err.value))
            assert str(err.value).startswith(f"{where}: {want[0][1]} and "), (entry, case, str(err.value))
            for t, b in zip(watched, before):
                assert t is None or torch.equal(t, b), f"{entry}, {case}: written before refusing"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (nan payloads compared too)."""
    if t.dtype == torch.float64:
        return t.view(torch.int64).clone()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16).clone()


def run_blocks(backend, op: str, work: list, variant, s_new: AdamScalars, many: bool) -> list:
    """``op`` over ``work`` = [(p, g, m, v, g2, s, donate, copy)] through ``backend``'s list form
    (``many``) or one call per block; the results' and copies' bits."""
    from sofx.kernels.base import StepCall, UndoCall, UndoRedoCall

    if op == "step":
        calls = [StepCall(p, g, m, v, s, (p, m, v) if d else None, c) for p, g, m, v, _, s, d, c in work]
        res = backend.step_many(calls, variant) if many else [
            backend.step(*c[:5], variant, out=c.out, p_copy=c.p_copy) for c in calls]
    elif op == "undo":
        calls = [UndoCall(p, g, m, v, s, None, (p, m, v) if d else None, c) for p, g, m, v, _, s, d, c in work]
        res = backend.undo_many(calls, variant) if many else [
            backend.undo(*c[:5], variant, out=c.out, p_copy=c.p_copy) for c in calls]
    else:
        calls = [UndoRedoCall(p, m, v, g, s, g2, s_new, None, (p, m, v) if d else None, c)
                 for p, g, m, v, g2, s, d, c in work]
        res = backend.undo_redo_many(calls, variant) if many else [
            backend.undo_redo(*c[:7], variant, out=c.out, p_copy=c.p_copy) for c in calls]
    return [[bits(t) for t in r] + ([bits(c)] if c is not None else []) for r, (*_, c) in zip(res, work)]


def run_gloo(worker, world: int, directory, timeout_s: float = 120.0) -> list:
    """Run ``worker(rank, world, store, outdir)`` on ``world`` spawned processes and return what each rank saved
    as ``outdir/rank{r}.pt``. A run still going after ``timeout_s`` (a rank waiting in a collective for one that
    left) is killed and fails the test instead of blocking it. Each rank writes its standard output and error
    to ``outdir/rank{r}.log`` (a message that a native library prints before aborting the process, too); a run
    that fails shows each rank's exit and the end of its log.

    A run in which a rank was killed by a signal it raised itself (SIGABRT, SIGSEGV: no rank of these tests
    ends so) runs once more, in ``directory/again``, with a warning that shows the first run's logs: gloo's
    transport threads abort the process on a socket error (a loaded machine's connection closed early), which
    no test here can catch. A second such death fails the test."""
    import warnings

    import pytest

    failure = _spawn_ranks(worker, world, directory, timeout_s)
    if failure is not None and failure[0]:
        warnings.warn(f"a gloo run of {world} ranks lost a rank to a signal; ran it again: {failure[1]}",
                      stacklevel=2)
        directory = directory / "again"
        directory.mkdir()
        failure = _spawn_ranks(worker, world, directory, timeout_s)
    if failure is not None:
        pytest.fail(failure[1])
    return [torch.load(directory / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _spawn_ranks(worker, world: int, directory, timeout_s: float) -> tuple[bool, str] | None:
    """:func:`run_gloo`'s run, once: ``None`` where every rank finished, else whether a rank died by a signal of
    its own, and the failure with each rank's exit and the end of its log."""
    import time

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

    ctx = mp.start_processes(functools.partial(_logged_rank, worker), args=(world, str(directory / "store"),
                             str(directory)), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                return False, (f"the {world} ranks did not finish within {timeout_s} s (a rank hangs in a "
                               f"collective)\n{_rank_logs(ctx.processes, directory)}")
    except ProcessException as e:
        for p in ctx.processes:
            p.join()
        signalled = isinstance(e, ProcessExitedException) and e.exit_code < 0
        return signalled, f"{e}\n{_rank_logs(ctx.processes, directory)}"
    return None


def _logged_rank(worker, rank: int, world: int, store: str, outdir: str) -> None:
    """``worker(rank, world, store, outdir)`` with this process's file descriptors 1 and 2 on
    ``outdir/rank{rank}.log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.path.join(outdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    worker(rank, world, store, outdir)


def _rank_logs(processes, directory, lines: int = 25) -> str:
    """Each rank's exit (a signal by name) and the last ``lines`` lines of its log (:func:`_logged_rank`)."""
    import signal

    out = []
    for r, p in enumerate(processes):
        code = p.exitcode
        exit_text = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
        path = directory / f"rank{r}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no log)"]
        text = text or ["(empty)"]
        out.append(f"--- rank {r}: {exit_text}; the end of {path.name}:\n" + "\n".join(text))
    return "\n".join(out)


#: How long spawned ranks wait for each other to join their gloo group (:func:`init_gloo`): far longer than a rank
#: takes to start, however loaded the machine; a run's own timeout (:func:`run_gloo`) ends a rank that never comes.
RENDEZVOUS_S = 300.0


def init_gloo(rank: int, world: int, store: str, timeout_s: float) -> None:
    """Join the ``world`` ranks' gloo group through the file ``store``, waiting up to :data:`RENDEZVOUS_S` for the
    others (ranks start seconds apart on a loaded machine: importing torch), then make ``timeout_s`` the timeout of
    the group's collectives (a rank left waiting alone in one fails after it instead of hanging). The timeout given
    to ``init_process_group`` covers both: a short one made a late rank fail the rendezvous."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=RENDEZVOUS_S))
    dist.barrier()  # every rank has joined
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))


def meet() -> None:
    """Wait, up to :data:`RENDEZVOUS_S`, until every rank of :func:`init_gloo`'s group gets here (a barrier of that
    timeout, whatever the group's): after work whose time differs between the ranks by more than the group's short
    timeout on a loaded machine (starting an offload worker process: it imports torch), before the collectives that
    follow it."""
    import datetime

    import torch.distributed as dist

    dist.monitored_barrier(timeout=datetime.timedelta(seconds=RENDEZVOUS_S))


def run_gloo_cases(cases: dict, world: int, directory, timeout_s: float = 120.0,
                   case_timeout_s: float = 10.0) -> list[dict]:
    """:func:`run_gloo` of ``cases`` (name -> ``case(rank)``, module-level functions returning what to keep):
    every rank runs them in order on one gloo group (:func:`init_gloo`; its collectives time out after
    ``case_timeout_s``), each followed by an all-reduce that shows the group still works, and saves
    ``{name: result}``."""
    return run_gloo(functools.partial(_run_cases, cases, case_timeout_s), world, directory, timeout_s)


def _run_cases(cases: dict, case_timeout_s: float, rank: int, world: int, store: str, outdir: str) -> None:
    import os

    import torch.distributed as dist

    from sofx import distributed as sd

    torch.set_num_threads(1)
    init_gloo(rank, world, store, case_timeout_s)
    try:
        results = {}
        for name, case in cases.items():
            results[name] = case(rank)
            sd.all_reduce_mean_({"after": torch.ones(1)})  # the group still works
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def error_text(call) -> str:
    """What ``call()`` raises, for a rank's result: a :class:`~sofx.SofxError`'s message, another exception as
    ``"Type: message"`` (what a rank raised inside torch or its backend), or ``"no error"``."""
    try:
        call()
        return "no error"
    except sofx.SofxError as exc:
        return str(exc)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def refused_on_every_rank(ranks: list[dict], bad: int, case: str, key: str, own: str) -> None:
    """Of a :func:`run_gloo_cases` run: rank ``bad`` raised ``own`` (its own error) in ``case``'s ``key``; every
    other rank named rank ``bad``'s refusal, with ``own`` in it."""
    for rank, res in enumerate(ranks):
        msg = res[case][key]
        assert own in msg, (case, key, rank, msg)
        assert (f"rank {bad} refused its input (" in msg) == (rank != bad), (case, key, rank, msg)


def _chunks_near(n: int, mid: int) -> list[int]:
    """The chunks (``FINITE_CHUNK`` elements) of ``n`` elements at both ends and on both sides of element ``mid``."""
    from sofx.kernels.base import FINITE_CHUNK

    last = (n - 1) // FINITE_CHUNK
    c = mid // FINITE_CHUNK
    return sorted({0, 1, c - 2, c - 1, c, c + 1, last - 1, last} & set(range(last + 1)))


def _chunk_elements(chunks: list[int], n: int, device: torch.device | str) -> tuple[torch.Tensor, list[int]]:
    """The indices of the elements of ``chunks`` (of ``n`` elements), and each chunk's size."""
    from sofx.kernels.base import FINITE_CHUNK

    ranges = [torch.arange(c * FINITE_CHUNK, min((c + 1) * FINITE_CHUNK, n)) for c in chunks]
    return torch.cat(ranges).to(device), [len(r) for r in ranges]


def _within_tensor_tolerance(got, want) -> None:
    """DESIGN.md's tolerance: the largest difference at most 1e-6 of the reference tensor's largest magnitude."""
    for a, b in zip(got, want):
        a, b = a.cpu().double(), b.double()
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-6


def check_a_large_triton_step(device: torch.device | str, n: int, mid: int, monkeypatch) -> None:
    """Triton steps on float32 blocks of ``n`` elements (not a multiple of 16), compared at the elements of the
    chunks at both ends and around element ``mid`` (2^31 on a GPU: where 32-bit offsets would wrap): bit for
    bit the kernel's results on those elements alone (Adam is elementwise) and within DESIGN.md's 1e-6 of the
    reference's on the CPU. In turn: the flat kernel in place (a launch of the first n - n % 16 elements, then
    one of the rest); the multi-tensor kernel, aligned, over a view of the first ``n - n % 2048`` and a small
    block; a checked multi-tensor launch (not aligned) over the whole block with an inf planted past ``mid`` and a
    small block: the planted chunk's flag alone set, its elements left alone, the others stepped. About 16 bytes
    an element of memory."""
    from sofx.kernels import reference
    from sofx.kernels import triton as tk
    from sofx.kernels.base import FINITE_CHUNK, AdamVariant, StepCall, beyond_limit, lossy_elements

    assert n % 16 and mid % FINITE_CHUNK == 0 and 2 * FINITE_CHUNK < mid < n - 2 * FINITE_CHUNK
    gen = torch.Generator(device=device).manual_seed(4)
    p, g, m, v = (torch.empty(n, device=device) for _ in range(4))
    p.normal_(generator=gen)
    g.normal_(generator=gen)
    m.normal_(0.0, 0.1, generator=gen)
    v.uniform_(0.05, 0.1, generator=gen)  # g^2 * lossy_factor < v: only the planted inf is flagged
    variant = AdamVariant()
    s = AdamScalars(1e-2, 0.9, 0.999, 1e-8, 0.01, 7, 1.0)
    launches = []
    run_multi = tk._run_multi

    def counting(op, group, has_p_old, aligned, *args):
        launches.append((len(group), aligned))
        return run_multi(op, group, has_p_old, aligned, *args)

    monkeypatch.setattr(tk, "_run_multi", counting)

    def small_block(count):
        return tuple(torch.randn(count, device=device, generator=gen) * k + o
                     for k, o in ((1.0, 0.0), (1.0, 0.0), (0.1, 0.0), (0.0, 0.07)))

    def stepped_alone(block, run):  # run(block) in place; checked against one call on a copy of it
        before = [t.clone() for t in block]
        run()
        assert all(torch.equal(a, b) for a, b in zip((block[0], block[2], block[3]), tk.step(*before, s, variant)))

    def sampled(count, run):  # run() steps the first count elements of p, g, m, v in place
        idx, _ = _chunk_elements(_chunks_near(count, mid), count, device)
        before = [t[idx] for t in (p, g, m, v)]
        run()
        got = [t[idx] for t in (p, m, v)]
        assert all(torch.equal(a, b) for a, b in zip(got, tk.step(*before, s, variant)))
        _within_tensor_tolerance(got, reference.step(*(t.cpu() for t in before), s, variant))

    # the flat kernel
    sampled(n, lambda: tk.step(p, g, m, v, s, variant, out=(p, m, v)))
    assert launches == []
    # the multi-tensor kernel, aligned
    head = n - n % 2048
    views = [t[:head] for t in (p, g, m, v)]
    small = small_block(4096)
    sampled(head, lambda: stepped_alone(small, lambda: tk.step_many(
        [StepCall(*views, s, (views[0], views[2], views[3])), StepCall(*small, s, (small[0], small[2], small[3]))],
        variant)))
    assert launches == [(2, True)]
    # a checked multi-tensor launch
    launches.clear()
    g[mid + 100] = float("inf")
    flags = torch.zeros(-(-n // FINITE_CHUNK), dtype=torch.uint8, device=device)
    small, small_flags = small_block(1000), torch.zeros(1, dtype=torch.uint8, device=device)
    chunks = _chunks_near(n, mid)
    idx, sizes = _chunk_elements(chunks, n, device)
    before = [t[idx] for t in (p, g, m, v)]
    stepped_alone(small, lambda: tk.step_many(
        [StepCall(p, g, m, v, s, (p, m, v), None, flags),
         StepCall(*small, s, (small[0], small[2], small[3]), None, small_flags)], variant))
    assert launches == [(2, False)]
    cpu = [t.cpu() for t in before]
    bad = beyond_limit(cpu[1], s.grad_scale) | lossy_elements(cpu[0], cpu[1], cpu[3], s, variant.decoupled, m=cpu[2])
    want = [int(b.any()) for b in bad.split(sizes)]
    assert flags[chunks].tolist() == want and want[chunks.index(mid // FINITE_CHUNK)] == 1
    assert int(flags.sum()) == 1 and int(small_flags.sum()) == 0
    keep = torch.cat([torch.full((k,), not w, dtype=torch.bool) for k, w in zip(sizes, want)]).to(device)
    got = [t[idx] for t in (p, m, v)]
    for a, fresh, old in zip(got, tk.step(*before, s, variant), (before[0], before[2], before[3])):
        assert torch.equal(a[keep], fresh[keep]) and torch.equal(a[~keep], old[~keep])


def script_prints_ok(script: str, *args: str, timeout: float = 300) -> None:
    """Run ``script`` in a fresh Python process (``args`` its ``sys.argv[1:]``) and require that it exits with 0 and
    prints ``ok`` last: for cases that crashed the process before their fix (a segmentation fault then fails the
    test instead of ending pytest). On failure the message carries the exit code and the output's tails. The
    tests' directory is on its path (``from refusal_script import expect_refused``)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                         env=env)
    assert out.returncode == 0 and out.stdout.splitlines()[-1:] == ["ok"], \
        f"exit code {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
