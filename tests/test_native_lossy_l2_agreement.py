"""The native backends' list forms (cpu, cpu_fast) against reference.py on random lists of blocks, L2 mode included.

Each example is a list of one to four blocks of 1..3000 elements (sizes near the vector width and
:data:`~sofx.kernels.base.FINITE_CHUNK` boundaries drawn often), each with its own dtypes (float32 parameters and
moments; bfloat16 and float16 parameters, bfloat16 moments), scalars (weight decay 0..0.5, in L2 or decoupled mode),
``out`` donated or not, a ``p_copy`` or not, ``p_old`` or not, checked (``skip``) or not, the record keeping p
(``p_kept``) or not, an inf or a nan in a checked call's gradient or state or not. Its elements are sound but for
a few probes per chunk (so that a chunk's flag is mostly one element's): gradients over three decades, a share of
them near ``-wd p`` (where the L2 terms of the lossy check matter), second moments over up to eight decades, some
moments exactly 0, and, in some blocks, second moments at the check's very margin (bisected to the last bit, see
:func:`_at_margin`). One call of ``step_many``, ``undo_many`` or ``undo_redo_many`` per backend, then:

- a checked call's flags are the chunks ``lossy_elements | beyond_limit`` finds (base.py; the Python form of the
  native ``chunk_exact`` and its vector loops ``vlossy``/``vlossy8``), for both backends alike;
- a flagged chunk's outputs (donated inputs, ``p_copy``) are left alone;
- the other elements: cpu bitwise the reference where :func:`sofx.kernels.cpu.bitwise_with_torch`, cpu_fast within
  DESIGN.md's tolerances (float32 1e-6, bfloat16 and float16 1e-2), relative to the magnitudes the result is made
  of (an ulp of the inverse's p enters the moments times ``wd`` in L2 mode), an undo's where the undone step was
  not too lossy to undo;
- ``p_copy`` holds the backend's own new parameters, cast to its dtype;
- every tensor of a call is a view, at any alignment, into a buffer of random bits: nothing is written beside it
  (a masked vector store past a block's end, which AddressSanitizer does not see), nor into what it only reads.

The chunk-list forms (``step_chunks``, ``undo_redo_chunks``: the native ``run_listed``, packed or not, keeping the
listed chunks' values or not) give the bits of the same backend's list form over their runs of adjacent chunks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sofx.kernels import cpu, cpu_fast, reference
from sofx.kernels.base import (FINITE_CHUNK, AdamScalars, AdamVariant, StepCall, UndoCall, UndoRedoCall,
                               beyond_limit, kept_elements, lossy_elements)
from sofx.kernels.chunked import ChunkedCall, range_calls

pytestmark = pytest.mark.skipif(not cpu.native_available(), reason="no C compiler: the cpu backend is the reference")

BACKENDS = {"cpu": cpu, "cpu_fast": cpu_fast}
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# (param, gradient, state) dtypes
COMBOS = [(torch.float32, torch.float32, torch.float32), (torch.float32, torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32, torch.float32), (torch.float16, torch.float16, torch.float32),
          (torch.float16, torch.float32, torch.float32)]
EDGES = [1, 2, 15, 16, 17, 31, 33, 1008, 1023, 1024, 1025, 1039, 1040, 1041, 2047, 2048, 2049, 2063, 3000]
SIZES = st.one_of(st.sampled_from(EDGES), st.integers(1, 3000))
BETAS = [(0.9, 0.999), (0.99, 0.99), (0.9, 0.95), (0.8, 0.9)]


class Block(NamedTuple):
    """One block's drawn structure (its values come from ``seed``)."""

    n: int
    combo: tuple[torch.dtype, torch.dtype, torch.dtype]
    lr: float
    betas: tuple[float, float]
    wd: float
    t: int
    gs: float
    new_gs: float
    new_lr: float
    g_mag: float  # the gradient's magnitude (its elements over three decades below it)
    near: float  # share of gradient elements near -wd p / gs
    v_top: int  # second moments over v_span decades below 10^v_top (small ones: lossy elements)
    v_span: int
    probes: int  # at most this many risky elements per chunk (the others sound)
    zero_rows: float  # share of the probes whose moments are exactly 0
    margin: bool  # the probes' second moments where the check changes its mind (see _at_margin)
    bad_g: bool  # one inf or nan in the (new) gradient
    bad_state: int  # -1, or which of p, m, v (an undo+redo's p', m', v') gets one inf or nan
    donate: bool
    copy: torch.dtype | None
    p_old: bool
    checked: bool
    p_kept: bool
    zero_moments: bool
    seed: int


@st.composite
def blocks(draw: Any) -> Block:
    wd = draw(st.sampled_from([0.0, 0.01, 0.1, 0.5]))
    return Block(n=draw(SIZES), combo=draw(st.sampled_from(COMBOS)),
                 lr=draw(st.sampled_from([1e-3, 1e-2, 0.1, 1.0])), betas=draw(st.sampled_from(BETAS)), wd=wd,
                 t=draw(st.integers(1, 40)), gs=draw(st.sampled_from([1.0, 0.5, 0.3])),
                 new_gs=draw(st.sampled_from([1.0, 0.5, 0.1])), new_lr=draw(st.sampled_from([1e-3, 1e-2, 0.1])),
                 g_mag=draw(st.sampled_from([1e-3, 1e-2, 1.0])), near=draw(st.sampled_from([0.0, 0.3, 0.9])),
                 v_top=draw(st.sampled_from([-1, 1])), v_span=draw(st.sampled_from([1, 8])),
                 probes=draw(st.sampled_from([1, 2, 1024])), zero_rows=draw(st.sampled_from([0.0, 0.0, 0.2])),
                 margin=draw(st.booleans()), bad_g=draw(st.booleans()),
                 bad_state=draw(st.sampled_from([-1, -1, -1, 0, 1, 2])),
                 donate=draw(st.booleans()), copy=draw(st.sampled_from([None, torch.float32, torch.bfloat16])),
                 p_old=draw(st.booleans()), checked=draw(st.booleans()), p_kept=draw(st.booleans()),
                 zero_moments=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 31 - 1)))


VARIANTS = st.builds(AdamVariant, decoupled=st.booleans(), bias_correction=st.booleans())
LISTS = st.lists(blocks(), min_size=1, max_size=4)


def _scalars(b: Block) -> AdamScalars:
    return AdamScalars(b.lr, b.betas[0], b.betas[1], 1e-8, b.wd, b.t, b.gs)


def _probes(b: Block, gen: torch.Generator) -> torch.Tensor:
    """The probe elements: up to ``b.probes`` at random places in each chunk (the rest are sound), so that a
    chunk's flag is mostly one element's."""
    mask = torch.zeros(b.n, dtype=torch.bool)
    for a in range(0, b.n, FINITE_CHUNK):
        width = min(FINITE_CHUNK, b.n - a)
        k = int(torch.randint(b.probes + 1, (1,), generator=gen))
        mask[a + torch.randint(width, (k,), generator=gen)] = True
    return mask


def _gradient(b: Block, p: torch.Tensor, gs: float, probes: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Small elements (1e-3) but at the probes: random ones over three decades up to ``b.g_mag``, a share
    ``b.near`` of them at the L2 balance ``g gs ~ -wd p``."""
    risky = torch.randn(b.n, generator=gen) * b.g_mag * 10.0 ** (-3 * torch.rand(b.n, generator=gen))
    if b.wd and b.near:
        balanced = -b.wd * p.float() / gs * (1 + 1e-3 * torch.randn(b.n, generator=gen))
        risky = torch.where(torch.rand(b.n, generator=gen) < b.near, balanced, risky)
    return torch.where(probes, risky, 1e-3 * torch.randn(b.n, generator=gen))


def _state(b: Block, probes: torch.Tensor, gen: torch.Generator, zero: bool = False) -> tuple[torch.Tensor, ...]:
    """``p, g, m, v`` in the block's dtypes (``zero``: all-zero moments); sound (v from 1 to 10) but at the
    probes: v over ``b.v_span`` decades below ``10^b.v_top``, a share ``b.zero_rows`` of moments exactly 0."""
    pdt, gdt, sdt = b.combo
    p = torch.randn(b.n, generator=gen) * 10.0 ** (2 * torch.rand(b.n, generator=gen) - 1)
    g = _gradient(b, p, b.gs, probes, gen)
    if zero:
        m = v = torch.zeros(b.n)
    else:
        m = 0.1 * torch.randn(b.n, generator=gen)
        risky = 10.0 ** (b.v_top - b.v_span * torch.rand(b.n, generator=gen)) * (1 + m.abs())
        v = torch.where(probes, risky, 1 + 9 * torch.rand(b.n, generator=gen))
        rows = probes & (torch.rand(b.n, generator=gen) < b.zero_rows)
        m, v = m.masked_fill(rows, 0.0), v.masked_fill(rows, 0.0)
    return p.to(pdt), g.to(gdt), m.to(sdt), v.to(sdt)


def _spoil(b: Block, g: torch.Tensor, gen: torch.Generator, spoiled: bool | None = None) -> torch.Tensor:
    """``g`` with one inf, -inf or nan at a random place where ``spoiled`` (default ``b.bad_g``) in a checked call
    (whose check flags its chunk; an unchecked call's nan results are not compared but to the reference's)."""
    if not ((b.bad_g if spoiled is None else spoiled) and b.checked):
        return g
    g = g.clone()
    g[int(torch.randint(b.n, (1,), generator=gen))] = (float("inf"), float("-inf"), float("nan"))[b.seed % 3]
    return g


class Case(NamedTuple):
    """One block's call arguments, and what the reference needs beside them."""

    p: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    s: AdamScalars
    g_new: torch.Tensor | None
    s_new: AdamScalars | None
    p_old: torch.Tensor | None


def _case(op: str, b: Block, variant: AdamVariant) -> Case:
    """The block's inputs: a step's from random moments; an undo's or undo+redo's the results of a reference step
    (``p_old``: the parameters before it)."""
    gen = torch.Generator().manual_seed(b.seed)
    s = _scalars(b)
    zero = op == "step" and b.zero_moments
    probes = _probes(b, gen)
    p, g, m, v = _state(b, probes, gen, zero)
    if op == "step":
        c = Case(p, _spoil(b, g, gen), m, v, s, None, None, None)
    else:
        p1, m1, v1 = reference.step(p, g, m, v, s, variant)
        s_new = s._replace(lr=b.new_lr, grad_scale=b.new_gs) if op == "undo_redo" else None
        g_new = _spoil(b, _gradient(b, p, b.new_gs, probes, gen).to(g.dtype), gen) if op == "undo_redo" else None
        c = Case(p1, g, m1, v1, s, g_new, s_new, p.clone() if b.p_old else None)
    if b.bad_state >= 0 and op != "undo":
        k = "pmv"[b.bad_state]
        c = c._replace(**{k: _spoil(b, getattr(c, k), gen, True)})
    return _at_margin(op, c, b, variant, probes, gen) if b.margin and b.checked and op != "undo" else c


class Guarded(NamedTuple):
    """A tensor of a call as a view into a larger buffer (``before``: the buffer's bits before the call): the
    elements around it must keep their bits (masked vector stores, which AddressSanitizer does not see, would
    change them), and all of it where the call only reads it."""

    view: torch.Tensor
    buffer: torch.Tensor
    before: torch.Tensor
    name: str
    written: bool


def _guarded(t: torch.Tensor, name: str, written: bool, gen: torch.Generator) -> Guarded:
    """``t``'s values in a view at a random offset (0..40 elements: any alignment) into a buffer of random bits
    with 40 elements after it."""
    lead = int(torch.randint(41, (1,), generator=gen))
    ints = _int_view(torch.empty(t.numel() + lead + 40, dtype=t.dtype))
    ints.copy_(torch.randint(-128, 128, ints.shape, generator=gen).to(ints.dtype))
    buffer = ints.view(t.dtype)
    view = buffer[lead:lead + t.numel()]
    view.copy_(t)
    return Guarded(view, buffer, _int_view(buffer).clone(), name, written)


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_guards(guards: list[Guarded], where: str) -> None:
    """Nothing written around any guarded tensor, nor into one the call only reads."""
    for gd in guards:
        now = _int_view(gd.buffer)
        if gd.written:
            lead = gd.view.storage_offset()
            now = torch.cat([now[:lead], now[lead + gd.view.numel():]])
            before = torch.cat([gd.before[:lead], gd.before[lead + gd.view.numel():]])
        else:
            before = gd.before
        assert torch.equal(now, before), f"{where}: {gd.name} (or memory beside it) written"


def _call(op: str, c: Case, b: Block) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[Guarded]]:
    """The backend call of ``c`` on guarded copies of its inputs (``(call, p_copy, skip, guards)``)."""
    gen = torch.Generator().manual_seed(b.seed + 1)
    guards = [_guarded(t, name, b.donate, gen) for name, t in (("p", c.p), ("m", c.m), ("v", c.v))]
    guards += [_guarded(t, name, False, gen) for name, t in (("g", c.g), ("g_new", c.g_new), ("p_old", c.p_old))
               if t is not None]
    p, m, v = (gd.view for gd in guards[:3])
    g, g_new, p_old = ({gd.name: gd.view for gd in guards}.get(k) for k in ("g", "g_new", "p_old"))
    out = (p, m, v) if b.donate else None
    p_copy = skip = None
    if b.copy is not None:
        guards.append(_guarded(torch.full((b.n,), 7.0, dtype=b.copy), "p_copy", True, gen))
        p_copy = guards[-1].view
    if b.checked and op != "undo":
        guards.append(_guarded(torch.zeros(-(-b.n // FINITE_CHUNK), dtype=torch.uint8), "skip", True, gen))
        skip = guards[-1].view
    return _call_of(op, c, b, (p, g, m, v, g_new, p_old), out, p_copy, skip), p_copy, skip, guards


def _call_of(op: str, c: Case, b: Block, tensors: tuple, out: tuple | None, p_copy: torch.Tensor | None,
             skip: torch.Tensor | None) -> Any:
    """The backend call of ``op`` on ``tensors`` = ``(p, g, m, v, g_new, p_old)`` with ``c``'s scalars and ``b``'s
    flags."""
    p, g, m, v, g_new, p_old = tensors
    if op == "step":
        return StepCall(p, g, m, v, c.s, out, p_copy, skip, b.zero_moments, b.p_kept)
    if op == "undo":
        return UndoCall(p, g, m, v, c.s, p_old, out, p_copy)
    return UndoRedoCall(p, m, v, g, c.s, g_new, c.s_new, p_old, out, p_copy, skip, b.p_kept)


def _lossy(op: str, c: Case, b: Block, variant: AdamVariant) -> torch.Tensor:
    """The elements a checked call's step (an undo+redo's redo) flags: ``beyond_limit | lossy_elements``."""
    if op == "step":
        return beyond_limit(c.g, c.s.grad_scale) | lossy_elements(
            c.p, c.g, c.v, c.s, variant.decoupled, m=c.m, zero_moments=b.zero_moments, p_kept=b.p_kept,
            bias_correction=variant.bias_correction)
    p = c.p_old if c.p_old is not None else c.p
    return beyond_limit(c.g_new, c.s_new.grad_scale) | lossy_elements(
        p, c.g_new, c.v, c.s_new, variant.decoupled, c.g, c.s, m=c.m, p_kept=b.p_kept,
        bias_correction=variant.bias_correction, p_old_given=c.p_old is not None)


def _want_flags(op: str, c: Case, b: Block, variant: AdamVariant) -> list[bool] | None:
    """The chunks a checked call flags (None: not a checked call)."""
    if not b.checked or op == "undo":
        return None
    bad = _lossy(op, c, b, variant)
    return torch.nn.functional.pad(bad, (0, -b.n % FINITE_CHUNK)).view(-1, FINITE_CHUNK).any(1).tolist()


def _at_margin(op: str, c: Case, b: Block, variant: AdamVariant, probes: torch.Tensor,
               gen: torch.Generator) -> Case:
    """``c`` with the probes' second moments (an undo+redo's ``v'``) where :func:`_lossy` changes its mind, on one
    side or the other at random (bisected on the bits of ``v``'s dtype, an ulp apart): a backend whose check
    rounds one operation otherwise than base.py's flags another chunk there. Probes flagged whatever their ``v``
    (or never) keep theirs."""
    it = torch.int32 if c.v.dtype == torch.float32 else torch.int16
    lo = torch.zeros(b.n, dtype=torch.int64)
    hi = torch.full((b.n,), 0x7F7FFFFF if it is torch.int32 else 0x7F7F, dtype=torch.int64)  # the largest finite

    def bad(bits: torch.Tensor) -> torch.Tensor:
        v = torch.where(probes, bits.to(it).view(c.v.dtype), c.v)
        return _lossy(op, c._replace(v=v), b, variant)

    todo = probes & bad(lo) & ~bad(hi)
    while bool((todo & (hi - lo > 1)).any()):
        mid = (lo + hi) // 2
        f = bad(mid)
        lo, hi = torch.where(todo & f, mid, lo), torch.where(todo & ~f, mid, hi)
    pick = torch.where(torch.rand(b.n, generator=gen) < 0.5, lo, hi)
    return c._replace(v=torch.where(todo, pick.to(it).view(c.v.dtype), c.v))


def _reference(op: str, c: Case, variant: AdamVariant) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The reference's results, and the values they are made of (the inputs; an undo+redo's undone ones too)."""
    if op == "step":
        return reference.step(c.p, c.g, c.m, c.v, c.s, variant), (c.p, c.m, c.v)
    undone = reference.undo(c.p, c.g, c.m, c.v, c.s, variant, p_old=c.p_old)
    if op == "undo":
        return undone, (c.p, c.m, c.v)
    want = reference.undo_redo(c.p, c.m, c.v, c.g, c.s, c.g_new, c.s_new, variant, p_old=c.p_old)
    return want, tuple(torch.maximum(a.double().abs(), b.double().abs()) for a, b in zip(undone, (c.p, c.m, c.v)))


def _undone_lossy(c: Case, variant: AdamVariant) -> torch.Tensor:
    """The elements whose undone step (``c.g``, ``c.s``, from what the reference's inverse restores) was too lossy
    to undo algebraically (``lossy_elements``; no L2 term where p is restored from ``p_old``): an unchecked
    inverse's leftover there is not within DESIGN.md's tolerance, nor the same in two backends whose inverses round
    an operation differently."""
    p, m, v = reference.undo(c.p, c.g, c.m, c.v, c.s, variant, p_old=c.p_old)
    return lossy_elements(p, c.g, v, c.s, variant.decoupled, m=m, p_kept=c.p_old is not None,
                          bias_correction=variant.bias_correction)


def _l2_scales(op: str, c: Case, b: Block, variant: AdamVariant) -> tuple[torch.Tensor, torch.Tensor]:
    """Extra magnitudes of the moments' error in L2 mode: an ulp of the inverse's p enters ``gh`` times ``wd``
    (m: ``wd |p|``; v: ``wd |p|`` times the effective gradients' magnitudes); zeros elsewhere."""
    zero = torch.zeros(b.n, dtype=torch.float64)
    if op == "step" or variant.decoupled or not b.wd:
        return zero, zero
    wp = b.wd * c.p.double().abs()
    gh = (c.g.double() * c.s.grad_scale).abs() + wp
    if c.g_new is not None:
        gh = gh + (c.g_new.double() * c.s_new.grad_scale).abs().nan_to_num(0.0, 0.0, 0.0)
    return wp, 2 * wp * gh


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, keep: torch.Tensor,
                  exact: bool, where: str) -> None:
    """``got`` == ``want`` on ``keep`` (bitwise where ``exact``, else within TOL of ``scale``; nan only at nan)."""
    a, w = got.reshape(-1)[keep], want.reshape(-1)[keep]
    if exact:
        assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           w.view(torch.int16 if w.element_size() == 2 else torch.int32)) or \
            torch.equal(torch.isnan(a), torch.isnan(w)) and torch.equal(a[~torch.isnan(a)], w[~torch.isnan(w)]), \
            f"{where}: {name} not bitwise the reference"
        return
    assert torch.equal(torch.isnan(a), torch.isnan(w)), f"{where}: {name}'s nans differ"
    s = scale.reshape(-1)[keep].nan_to_num(0.0).clamp_min(torch.finfo(got.dtype).tiny)
    err = ((a.double() - w.double()).abs() / s).nan_to_num(0.0)
    assert a.numel() == 0 or float(err.max()) <= TOL[got.dtype], \
        f"{where}: {name} off by {float(err.max())} (element {int(keep.nonzero()[int(err.argmax())])})"


def _check_block(op: str, name: str, i: int, c: Case, b: Block, variant: AdamVariant, call: Any,
                 result: tuple, p_copy: torch.Tensor | None, skip: torch.Tensor | None) -> None:
    where = f"{name}.{op}_many[{i}] ({b})"
    want_flags = _want_flags(op, c, b, variant)
    keep = torch.ones(b.n, dtype=torch.bool)
    if want_flags is not None:
        assert skip is not None and skip.tolist() == [int(f) for f in want_flags], \
            f"{where}: flags {skip.tolist()}, lossy_elements finds {want_flags}"
        keep = kept_elements(skip, b.n)
        if call.out is not None:  # a flagged chunk's donated inputs are left alone
            for k, (got, before) in enumerate(zip(result, (c.p, c.m, c.v))):
                assert torch.equal(got[~keep].view(torch.int16 if got.element_size() == 2 else torch.int32),
                                   before[~keep].view(torch.int16 if got.element_size() == 2 else torch.int32)), \
                    f"{where}: out[{k}] written in a flagged chunk"
        if p_copy is not None:
            assert bool((p_copy[~keep] == 7.0).all()), f"{where}: p_copy written in a flagged chunk"
    if p_copy is not None:
        got, want = p_copy[keep], result[0][keep].to(p_copy.dtype)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()]), \
            f"{where}: p_copy is not p' cast"
    want, parts = _reference(op, c, variant)
    exact = name == "cpu" and cpu.bitwise_with_torch()
    if not exact and op != "step":  # DESIGN.md's tolerance holds where the undone step was not too lossy to undo
        keep = keep & ~_undone_lossy(c, variant)
    wm, wv = _l2_scales(op, c, b, variant)
    extra = (torch.zeros(b.n, dtype=torch.float64), wm, wv)
    for k, (got, w, x, e) in enumerate(zip(result, want, parts, extra)):
        assert got.dtype == w.dtype and got.shape == w.shape
        scale = torch.maximum(torch.maximum(w.double().abs(), x.double().abs()), e)
        if k == 0 and op != "step":  # the update's size: an ulp of the recomputed u
            scale = torch.maximum(scale, (w.double() - x.double()).abs().nan_to_num(0.0, 0.0, 0.0))
        _assert_close(f"out[{k}]", got, w, scale, keep, exact, where)


def _run(op: str, variant: AdamVariant, spec: list[Block]) -> None:
    cases = [_case(op, b, variant) for b in spec]
    for name, backend in BACKENDS.items():
        prepared = [_call(op, c, b) for c, b in zip(cases, spec)]
        results = getattr(backend, f"{op}_many")([call for call, *_ in prepared], variant)
        for i, (c, b, (call, p_copy, skip, guards), r) in enumerate(zip(cases, spec, prepared, results)):
            _assert_guards(guards, f"{name}.{op}_many[{i}] ({b})")
            _check_block(op, name, i, c, b, variant, call, r, p_copy, skip)


FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
L2 = AdamVariant(decoupled=False)


def _margin_block(n: int, seed: int) -> Block:
    """A float32 block in L2 mode (lr 0.1, wd 0.5) whose one probe per chunk is at the check's margin
    (:func:`_at_margin`); with the seeds below, the probe whose flag a square root's last bit decides."""
    return Block(n=n, combo=(torch.float32,) * 3, lr=0.1, betas=(0.9, 0.999), wd=0.5, t=3, gs=1.0, new_gs=0.5,
                 new_lr=0.01, g_mag=1.0, near=0.3, v_top=-1, v_span=8, probes=1, zero_rows=0.0, margin=True,
                 bad_g=False, bad_state=-1, donate=False, copy=None, p_old=False, checked=True, p_kept=False,
                 zero_moments=False, seed=seed)


@FUZZ
@given(variant=VARIANTS, spec=LISTS)
# the check's square roots (q = |m'| / sqrt(v')) correctly rounded, as the native kernels' (and Triton's), not
# torch's (MKL's, an ulp off now and then): a lone element at the margin (the chunk's own pass), one in a second
# chunk (the vector loop's read of the next chunk, vlossy)
@example(variant=L2, spec=[_margin_block(1, 3579)])
@example(variant=L2, spec=[_margin_block(2048, 2701)])
def test_step_many_flags_and_steps_as_the_reference(variant, spec):
    _run("step", variant, spec)


@FUZZ
@given(variant=VARIANTS, spec=LISTS)
def test_undo_many_restores_as_the_reference(variant, spec):
    _run("undo", variant, spec)


@FUZZ
@given(variant=VARIANTS, spec=LISTS)
@example(variant=L2, spec=[_margin_block(1, 3881)])  # (see the step's examples)
def test_undo_redo_many_flags_and_steps_as_the_reference(variant, spec):
    _run("undo_redo", variant, spec)


# ------------------------------------------------------------------ chunk lists (the native run_listed)
class Listed(NamedTuple):
    """A block's chunk-list call (:class:`~sofx.kernels.chunked.ChunkedCall`) and the tensors it writes."""

    call: ChunkedCall
    written: list[torch.Tensor]  # out, kept, p_copy, skip (the same order for every form)


def _listing(b: Block) -> tuple[list[int], bool, bool]:
    """The block's listed chunks (each at random, at least one), whether its p, m, v are packed, whether the
    listed chunks' values are kept first."""
    gen = torch.Generator().manual_seed(b.seed + 2)
    chunks = -(-b.n // FINITE_CHUNK)
    listed = [k for k in range(chunks) if float(torch.rand(1, generator=gen)) < 0.6] or [chunks - 1]
    return listed, bool(b.seed % 3 == 0), bool(b.seed % 5 < 2)


def _listed_call(op: str, c: Case, b: Block, guard: torch.Generator | None, guards: list[Guarded]) -> Listed:
    """``c`` as a chunk-list call of ``b``'s listing, on fresh copies (``guard``: guarded ones, added to
    ``guards``)."""

    def fresh(t: torch.Tensor | None, name: str, written: bool) -> torch.Tensor | None:
        if t is None:
            return None
        if guard is None:
            return t.clone()
        guards.append(_guarded(t, name, written, guard))
        return guards[-1].view

    listed, packed, keep = _listing(b)
    chunks = torch.tensor(listed, dtype=torch.int64)
    at = torch.cat([torch.arange(k * FINITE_CHUNK, min(b.n, (k + 1) * FINITE_CHUNK)) for k in listed])
    donated = b.donate and not packed
    p, m, v = (fresh(t[at] if packed else t, name, donated) for name, t in (("p", c.p), ("m", c.m), ("v", c.v)))
    out = (p, m, v) if donated else tuple(fresh(t, f"out[{k}]", True) for k, t in enumerate((c.p, c.m, c.v)))
    kept = tuple(fresh(torch.zeros(at.numel(), dtype=t.dtype), f"kept[{k}]", True)
                 for k, t in enumerate((c.p, c.m, c.v))) if keep else None
    p_copy = fresh(torch.full((b.n,), 7.0, dtype=b.copy), "p_copy", True) if b.copy is not None else None
    skip = fresh(torch.zeros(-(-b.n // FINITE_CHUNK), dtype=torch.uint8), "skip", True) if b.checked else None
    g, g_new, p_old = (fresh(t, name, False) for name, t in (("g", c.g), ("g_new", c.g_new), ("p_old", c.p_old)))
    call = _call_of(op, c, b, (p, g, m, v, g_new, p_old), out, p_copy, skip)
    return Listed(ChunkedCall(call, chunks, packed, kept), [*out, *(kept or ()), p_copy, skip])


def _run_listed(op: str, variant: AdamVariant, spec: list[Block]) -> None:
    """Each backend's chunk-list form (one native call, run_listed) against its own list form over the runs of
    adjacent listed chunks (:func:`~sofx.kernels.chunked.range_calls`, run_range): the same bits everywhere."""
    cases = [_case(op, b, variant) for b in spec]
    for name, backend in BACKENDS.items():
        guards: list[Guarded] = []
        listed = [_listed_call(op, c, b, torch.Generator().manual_seed(b.seed + 3), guards)
                  for c, b in zip(cases, spec)]
        getattr(backend, f"{op}_chunks")([x.call for x in listed], variant)
        _assert_guards(guards, f"{name}.{op}_chunks ({spec})")
        plain = [_listed_call(op, c, b, None, []) for c, b in zip(cases, spec)]
        getattr(backend, f"{op}_many")([r for x in plain for r in range_calls(x.call)], variant)
        for i, (x, y) in enumerate(zip(listed, plain)):
            for k, (a, w) in enumerate(zip(x.written, y.written)):
                assert (a is None) == (w is None)
                if a is not None:
                    assert torch.equal(_int_view(a), _int_view(w)), \
                        f"{name}.{op}_chunks[{i}] ({spec[i]}, listing {_listing(spec[i])}): written tensor {k} " \
                        "differs from the list form's over its runs"


@FUZZ
@given(variant=VARIANTS, spec=LISTS)
def test_step_chunks_give_the_list_forms_bits(variant, spec):
    _run_listed("step", variant, spec)


@FUZZ
@given(variant=VARIANTS, spec=LISTS)
def test_undo_redo_chunks_give_the_list_forms_bits(variant, spec):
    _run_listed("undo_redo", variant, spec)
