"""CPU Adam kernel benchmark: sofx step / undo / undo+redo against torch.optim and memory bandwidth.

    .venv/bin/python benchmarks/kernels.py            # 2^26 flat + GPT-2-small shapes, fp32 and bf16
    .venv/bin/python benchmarks/kernels.py --quick    # small sizes, seconds
    .venv/bin/python benchmarks/kernels.py --huge-pages   # every array in 2 MiB pages, as the engine's arena

For each tensor set (one flat tensor of 2^26 elements, the 148 tensors of
GPT-2 small) and storage configuration (fp32; bf16 params + fp32 states; all
bf16) it prints, per operation: median milliseconds, the effective bandwidth
of the bytes the operation must move (step and undo read p, g, m, v and write
p, m, v; fused undo+redo also reads the second gradient, except in the
``clip`` row, which redoes with the same gradient tensor and a new multiplier,
as the speculation engine does when a step clips late; undo then step moves
twice a step's bytes), that bandwidth as a fraction of the machine's memory
bandwidth measured right after each repetition (``xBW``, see
``_bandwidth.py``), and the speed relative to ``torch.optim.AdamW(fused=True)``
on the same tensors (``xfused``, the median over repetitions of the fused
time over this operation's time in the same round: > 1 is faster). ``undo+redo/step`` is the
fused undo+redo's time over sofx's own step time. The operations of a table
run round-robin (repetition k of each before repetition k+1 of any), so
that the machine's drift affects them alike.

The run ends with issue 4's targets judged on the flat tensor's numbers (``met`` / ``not met``,
per backend).

All sofx operations are in place (donated buffers), as the offload engine
runs them. torch's fused AdamW keeps states in the parameter dtype, so its
bf16 anchor is all-bf16. DeepSpeed's ``DeepSpeedCPUAdam`` is measured when the
``deepspeed`` package imports (``--no-deepspeed`` leaves it out: its CPU op is compiled on first use).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bandwidth import PairedBandwidth, time_round_robin  # noqa: E402

from sofx.kernels import _cpu_build, cpu, cpu_fast, report  # noqa: E402
from sofx.kernels.base import AdamScalars, AdamVariant, StepCall, UndoCall, UndoRedoCall  # noqa: E402
from sofx.offload.huge_pages import huge_pages_mode  # noqa: E402

VARIANT = AdamVariant(decoupled=True, bias_correction=True)
S1 = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10, grad_scale=1.0)
S2 = S1._replace(lr=9e-4, grad_scale=0.5)
S_CLIP = S1._replace(grad_scale=0.5)  # a late clip: the same gradient again, times the clip coefficient


def gpt2_small_shapes(vocab: int = 50257, d: int = 768, layers: int = 12, ctx: int = 1024) -> list[tuple]:
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def kernel_loops() -> str:
    """Which vector loops the native library built here runs (a compiler forced to AVX2, ``CC="gcc
    -mno-avx512f"``, builds the AVX2 ones on an AVX-512 CPU)."""
    return report.vector_loops(_cpu_build.load())


def cpu_model() -> str:
    """The CPU's model name, its widest vector extension and the kernel loops built for it (the kernels'
    loops differ between AVX-512 and AVX2 machines), from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({platform.machine()}, {isa}; {kernel_loops()})"


THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def page_setting() -> str:
    """Which pages the arrays get: 2 MiB ones where torch's allocator advises them (``--huge-pages``) and the
    system allows, else 4 KiB ones (torch's default)."""
    mode = huge_pages_mode() or "unknown"
    if os.environ.get(THP_VARIABLE) == "1":
        return f"transparent huge pages advised for every allocation ({THP_VARIABLE}=1; system mode: {mode})"
    return f"4 KiB (torch's default allocation; the system's transparent huge pages: {mode}; see --huge-pages)"


def placed(t: torch.Tensor, offset_bytes: int | None) -> torch.Tensor:
    """A copy of ``t`` starting ``offset_bytes`` past a 4 KiB boundary (None: ``t`` itself, as torch allocated it)."""
    if offset_bytes is None:
        return t
    es = t.element_size()
    buf = torch.empty(t.numel() + (offset_bytes + 4096) // es, dtype=t.dtype)
    skip = (-(buf.data_ptr() % 4096) + offset_bytes) % 4096 // es
    out = buf[skip:skip + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def make(shapes: list[tuple], pdt: torch.dtype, sdt: torch.dtype, gen: torch.Generator, stagger: int = 0):
    """p, g, g2, m, v per shape; ``stagger`` > 0: the five arrays of a shape start k * stagger bytes
    (k = 0..4, modulo 4 KiB) past a page boundary instead of all at the offset torch's allocator gives."""
    at = [k * stagger % 4096 if stagger else None for k in range(5)]
    ps = [placed(torch.randn(s, generator=gen).to(pdt), at[0]) for s in shapes]
    gs = [placed(torch.randn(s, generator=gen).to(pdt), at[1]) for s in shapes]
    g2s = [placed(torch.randn(s, generator=gen).to(pdt), at[2]) for s in shapes]
    ms = [placed((0.1 * torch.randn(s, generator=gen)).to(sdt), at[3]) for s in shapes]
    vs = [placed((0.01 * torch.rand(s, generator=gen) + 1e-4).to(sdt), at[4]) for s in shapes]
    return ps, gs, g2s, ms, vs


def sofx_ops(backend, ps, gs, g2s, ms, vs) -> dict[str, Callable[[], None]]:
    """In-place (donated) calls over every tensor of the set, all tensors in one call of the list forms
    (``step_many`` ...; an undo is followed by an untimed step, an undo+redo by an untimed one back), so
    that each operation inverts a step that was really taken."""
    outs = [(p, m, v) for p, m, v in zip(ps, ms, vs)]
    steps = [StepCall(p, g, m, v, S1, o) for p, g, m, v, o in zip(ps, gs, ms, vs, outs)]
    undos = [UndoCall(p, g, m, v, S1, None, o) for p, g, m, v, o in zip(ps, gs, ms, vs, outs)]
    # the step taken with (g, S1) becomes one with (g2, S2) and back (untimed), so that every operation
    # finds a step taken with (g, S1); a late clip: the same gradient tensor, a new multiplier
    redos = [UndoRedoCall(p, m, v, g, S1, g2, S2, None, o) for p, g, g2, m, v, o in zip(ps, gs, g2s, ms, vs, outs)]
    backs = [UndoRedoCall(p, m, v, g2, S2, g, S1, None, o) for p, g, g2, m, v, o in zip(ps, gs, g2s, ms, vs, outs)]
    clips = [UndoRedoCall(p, m, v, g, S1, g, S_CLIP, None, o) for p, g, m, v, o in zip(ps, gs, ms, vs, outs)]
    unclips = [UndoRedoCall(p, m, v, g, S_CLIP, g, S1, None, o) for p, g, m, v, o in zip(ps, gs, ms, vs, outs)]

    def step():
        backend.step_many(steps, VARIANT)

    def undo():
        backend.undo_many(undos, VARIANT)

    def undo_redo():
        backend.undo_redo_many(redos, VARIANT)

    def redo_back():
        backend.undo_redo_many(backs, VARIANT)

    def undo_redo_clip():
        backend.undo_redo_many(clips, VARIANT)

    def clip_back():
        backend.undo_redo_many(unclips, VARIANT)

    def undo_then_step():
        undo()
        step()

    return {"step": step, "undo": (undo, step), "undo+redo (fused)": (undo_redo, redo_back),
            "undo+redo (fused), clip": (undo_redo_clip, clip_back), "undo, then step": undo_then_step}


def torch_ops(ps, gs) -> dict[str, Callable[[], None]]:
    ops = {}
    for kind in ("fused", "foreach"):
        params = [torch.nn.Parameter(p.clone()) for p in ps]
        for p, g in zip(params, gs):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{kind: True})
        ops[f"torch AdamW {kind}"] = opt.step
    return ops


def deepspeed_ops(ps, gs, ms, vs) -> tuple[dict[str, Callable[[], None]], str]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception as e:  # not installed, or its CPU op does not build
        return {}, f"DeepSpeed CPUAdam: skipped ({type(e).__name__}: {str(e)[:80]})"
    params = [torch.nn.Parameter(p.float().clone()) for p in ps]
    for p, g in zip(params, gs):
        p.grad = g.float()
    opt = DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
    if len(params) != 1 or not hasattr(opt, "rollback_subgroup"):
        return {"DeepSpeed CPUAdam step": opt.step}, "DeepSpeed rollback: measured on the flat tensor only"
    # ZeRO-style: one flat tensor per sub-group; rollback_subgroup undoes the last step_subgroup
    step = lambda: opt.step_subgroup(0)  # noqa: E731
    return {"DeepSpeed CPUAdam step": step, "DeepSpeed CPUAdam rollback": (lambda: opt.rollback_subgroup(0), step)}, ""


def run_case(title: str, shapes, pdt, sdt, bw: PairedBandwidth, reps: int, gen, with_torch: bool,
             with_deepspeed: bool = True, stagger: int = 0) -> tuple[list[str], dict[str, dict[str, float]]]:
    """The table of one tensor set and storage configuration, and per operation its numbers
    (``xBW``, ``xfused``, and ``per_step`` for the undo+redo rows)."""
    ps, gs, g2s, ms, vs = make(shapes, pdt, sdt, gen, stagger)
    n = sum(p.numel() for p in ps)
    pb, sb = torch.finfo(pdt).bits // 8, torch.finfo(sdt).bits // 8
    step_bytes = n * (2 * pb + pb + 4 * sb)  # read p, g, m, v; write p, m, v
    nbytes = {"step": step_bytes, "undo": step_bytes, "undo+redo (fused)": step_bytes + n * pb,
              "undo+redo (fused), clip": step_bytes, "undo, then step": 2 * step_bytes}
    lines = [f"\n### {title}: {len(shapes)} tensor(s), {n / 1e6:.1f}M elements, params {str(pdt)[6:]}, "
             f"states {str(sdt)[6:]}, {step_bytes / 2**20:.0f} MiB per step\n",
             "| operation | ms | GB/s | xBW | xfused | note |", "|---|---:|---:|---:|---:|---|"]
    ops: dict[str, tuple] = {}
    if with_torch:
        for name, fn in torch_ops([p.to(pdt) for p in ps], [g.to(pdt) for g in gs]).items():
            ops[name] = (fn, None, step_bytes if pdt == sdt else n * 7 * pb)
    for backend in (cpu, cpu_fast):
        for name, fn in sofx_ops(backend, ps, gs, g2s, ms, vs).items():
            fn, reset = fn if isinstance(fn, tuple) else (fn, None)
            ops[f"sofx {backend.NAME} {name}"] = (fn, reset, nbytes[name])
    ds, skipped = deepspeed_ops(ps, gs, ms, vs) if with_deepspeed and pdt == sdt == torch.float32 else ({}, "")
    for name, fn in ds.items():
        fn, reset = fn if isinstance(fn, tuple) else (fn, None)
        ops[name] = (fn, reset, step_bytes)
    timings = time_round_robin(ops, bw, reps)
    rows = [(name, t) for name, t in timings.items() if not name.startswith("torch")]
    anchors = {name: t for name, t in timings.items() if name.startswith("torch")}
    fused = anchors.get("torch AdamW fused")
    steps = {b.NAME: t for b in (cpu, cpu_fast) for name, t in rows if name == f"sofx {b.NAME} step"}
    numbers: dict[str, dict[str, float]] = {}
    for name, t in list(anchors.items()) + rows:
        numbers[name] = {"xBW": t.bw_ratio}
        if fused:
            numbers[name]["xfused"] = statistics.median(f / x for f, x in zip(fused.seconds, t.seconds))
        xf = f"{numbers[name]['xfused']:.2f}" if fused else "-"
        note = ""
        if "undo+redo" in name:
            own = steps[name.split(" ")[1]].seconds
            numbers[name]["per_step"] = statistics.median(x / y for x, y in zip(t.seconds, own))
            note = f"undo+redo/step = {numbers[name]['per_step']:.2f}"
        if name.startswith("torch") and pdt != sdt:
            note = "all-bf16 anchor (torch keeps states in the param dtype)"
        lines.append(f"| {name} | {t.median_s * 1e3:.1f} | {t.gbps:.1f} | {t.bw_ratio:.2f} | {xf} | {note} |")
    all_bw = [b for _, t in list(anchors.items()) + rows for b in t.bandwidth]
    lines.append(f"\npaired bandwidth (in-place add_, 3 streams over {bw.bytes // 3 // 2**20} MiB buffers): "
                 f"median {sorted(all_bw)[len(all_bw) // 2] / 1e9:.1f} GB/s, "
                 f"min {min(all_bw) / 1e9:.1f}, max {max(all_bw) / 1e9:.1f}")
    if skipped:
        lines.append(skipped)
    return lines, numbers


# Issue 4's targets, on the flat tensor: (row, storage, operation, measure, bound, "ge" | "le").
TARGETS = [
    ("step >= 0.97 xBW", "fp32", "step", "xBW", 0.97, "ge"),
    ("step >= 0.97x torch fused", "fp32", "step", "xfused", 0.97, "ge"),
    ("undo >= 0.9 xBW", "fp32", "undo", "xBW", 0.9, "ge"),
    ("fused undo+redo <= 1.25x step, clip (same gradient)", "fp32", "undo+redo (fused), clip", "per_step", 1.25, "le"),
    ("fused undo+redo <= 1.25x step, a new gradient", "fp32", "undo+redo (fused)", "per_step", 1.25, "le"),
    ("bf16 params + fp32 states step >= 0.9 xBW", "bf16-fp32", "step", "xBW", 0.9, "ge"),
    ("all-bf16 step >= 0.9 xBW", "bf16", "step", "xBW", 0.9, "ge"),
]


def targets_table(flat: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """The targets against the flat tensor's numbers (``flat[storage][operation name]``), per backend."""
    lines = ["\n### Against issue 4's targets (flat tensor)\n", "| target | cpu | cpu_fast |", "|---|---|---|"]
    for label, storage, op, measure, bound, sense in TARGETS:
        cells = []
        for backend in (cpu, cpu_fast):
            value = flat.get(storage, {}).get(f"sofx {backend.NAME} {op}", {}).get(measure)
            if value is None:
                cells.append("-")
                continue
            met = value >= bound if sense == "ge" else value <= bound
            cells.append(f"{'met' if met else 'not met'}: {value:.2f}")
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run, numbers mean little)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-gpt2", action="store_true", help="only the flat tensor")
    ap.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's CPUAdam out")
    ap.add_argument("--stagger", type=int, default=0, metavar="BYTES",
                    help="start p, g, g2, m, v at 0, 1, 2, 3, 4 x BYTES past a page boundary (default 0: every array "
                         "at the same page offset, as torch allocates them)")
    ap.add_argument("--huge-pages", action="store_true",
                    help="run with torch's allocator advising transparent huge pages for every allocation "
                         "(THP_MEM_ALLOC_ENABLE=1: the arrays, torch's optimizer states, the bandwidth buffers), "
                         "as the offload engine's CPU arena does for its own (sofx.offload.huge_pages)")
    args = ap.parse_args()
    if args.huge_pages and os.environ.get(THP_VARIABLE) != "1":
        # torch reads the variable once, at its first allocation: start again with it set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, THP_VARIABLE: "1"})
    torch.set_num_threads(args.threads)
    reps = args.reps or (3 if args.quick else 7)
    gen = torch.Generator().manual_seed(0)
    flat = [(2**20,)] if args.quick else [(2**26,)]
    gpt2 = gpt2_small_shapes(vocab=5000, d=128, layers=2, ctx=256) if args.quick else gpt2_small_shapes()
    bw = PairedBandwidth((32 if args.quick else 256) * 2**20)
    print(f"# sofx CPU kernels, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cpus, torch "
          f"{torch.__version__}, {args.threads} threads, native kernels: {cpu.native_available()}, "
          f"cpu bitwise with torch: {cpu.bitwise_with_torch()}, "
          f"cpu's square root: {report.cpu_square_root(_cpu_build.load())}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"pages: {page_setting()}")
    cases = [("flat", flat, torch.float32, torch.float32), ("flat", flat, torch.bfloat16, torch.float32),
             ("flat", flat, torch.bfloat16, torch.bfloat16)]
    if not args.no_gpt2:
        cases += [("GPT-2 small", gpt2, torch.float32, torch.float32),
                  ("GPT-2 small", gpt2, torch.bfloat16, torch.float32)]
    flat_numbers: dict[str, dict[str, dict[str, float]]] = {}
    for title, shapes, pdt, sdt in cases:
        lines, numbers = run_case(title, shapes, pdt, sdt, bw, reps, gen, with_torch=True,
                                  with_deepspeed=not args.no_deepspeed, stagger=args.stagger)
        for line in lines:
            print(line, flush=True)
        if title == "flat":
            storage = "fp32" if pdt == torch.float32 else ("bf16-fp32" if sdt == torch.float32 else "bf16")
            flat_numbers[storage] = numbers
    for line in targets_table(flat_numbers):
        print(line)


if __name__ == "__main__":
    main()
