"""The Triton backend compiled and run on a CUDA device (skipped without one; CI has none).

The interpreter tests (tests/test_kernels_triton.py) check the kernels' math on CPU tensors and
tests/test_triton_ptx.py what the GPU compiler makes of them; these run the multi-tensor launch for
real where a GPU is lent: its results against one flat launch per tensor, bit for bit, and the
functional optimizer over many CUDA leaves (one finiteness read back, a non-finite gradient snapshotted).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _shapes():
    # GPT-2-like: aligned matrices and vectors, plus sizes that are not multiples of 16 and a scalar
    return [(512, 64), (64,), (64, 192), (192,), (7,), (33, 3), (), (4096,)]


def test_step_many_on_cuda_equals_one_launch_per_tensor(device="cuda"):
    from sofx.kernels import triton as tk
    from sofx.kernels.base import AdamScalars, AdamVariant, StepCall, UndoRedoCall

    gen = torch.Generator(device=device).manual_seed(0)
    variant = AdamVariant()
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.5)
    blocks = [tuple(torch.randn(sh, device=device, generator=gen) for _ in range(4)) for sh in _shapes()]
    blocks = [(p, g, 0.1 * m, 0.01 * v.abs() + 1e-4) for p, g, m, v in blocks]
    want = [tk.step(*b, s, variant) for b in blocks]
    got = tk.step_many([StepCall(*b, s) for b in blocks], variant)
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    g_new = [torch.randn(b[1].shape, device=device, generator=gen) for b in blocks]
    s2 = s._replace(grad_scale=0.25)
    want = [tk.undo_redo(*w, b[1], s, g, s2, variant) for w, b, g in zip(want, blocks, g_new)]
    got = tk.undo_redo_many([UndoRedoCall(*r, b[1], s, g, s2) for r, b, g in zip(got, blocks, g_new)], variant)
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_adam_over_many_cuda_leaves(device="cuda"):
    import sofx

    gen = torch.Generator(device=device).manual_seed(1)
    params = {f"t{i}": torch.randn(sh, device=device, generator=gen) for i, sh in enumerate(_shapes())}
    grads = {k: torch.randn(v.shape, device=device, generator=gen) for k, v in params.items()}
    grads["t3"][5] = float("inf")
    opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend="triton")
    state = opt.init(params)
    new_p, new_s, rec = opt.update(params, grads, state)
    strategies = dict(zip(params, rec.strategies()))
    assert strategies["t3"] == "snapshot" and all(v == "algebraic" for k, v in strategies.items() if k != "t3")
    back_p, _ = opt.undo(new_p, new_s, rec)
    assert torch.equal(back_p["t3"], params["t3"])
    for k in params:
        assert torch.allclose(back_p[k], params[k], rtol=1e-5, atol=1e-6)
    # the specification is reference.py on the CPU (torch's CUDA ops contract multiply-adds)
    ref = sofx.adamw(lr=1e-2, weight_decay=0.1, backend="reference")
    to_cpu = (lambda t: t.cpu())
    want_p, _, _ = ref.update(sofx.tree.tree_map(to_cpu, params), sofx.tree.tree_map(to_cpu, grads),
                              sofx.tree.tree_map(to_cpu, state))
    for k in params:
        if k != "t3":
            assert torch.allclose(new_p[k].cpu(), want_p[k], rtol=1e-6, atol=1e-7), k


def test_checked_step_and_undo_redo_on_cuda_flag_what_the_python_form_finds(device="cuda"):
    """The compiled checked kernels (a chunk per program, CHECK_WARPS warps): the chunks flagged are those where
    beyond_limit or lossy_elements (run on the CPU) finds an element; those keep their values, the others get
    the unchecked kernel's bits; one launch for many blocks too."""
    from sofx.kernels import triton as tk
    from sofx.kernels.base import (FINITE_CHUNK, AdamScalars, AdamVariant, StepCall, UndoRedoCall, beyond_limit,
                                   lossy_elements)

    gen = torch.Generator(device=device).manual_seed(2)
    variant = AdamVariant(decoupled=False)
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.5)
    sizes = (3 * FINITE_CHUNK + 17, FINITE_CHUNK, 2 * FINITE_CHUNK + 64)
    blocks = []
    for i, n in enumerate(sizes):
        p, g, m = (torch.randn(n, device=device, generator=gen) for _ in range(3))
        v = 0.05 * torch.rand(n, device=device, generator=gen) + 0.05
        g[(i * 5000) % n] = 1000.0  # lossy
        if i == 0:
            g[n - 1] = float("inf")
        blocks.append((p, g, 0.1 * m, v))

    def chunks(bad):
        pad = torch.nn.functional.pad(bad.to(torch.uint8), (0, -bad.numel() % FINITE_CHUNK))
        return pad.view(-1, FINITE_CHUNK).amax(dim=1).tolist()

    for many in (False, True):
        flags = [torch.zeros(-(-n // FINITE_CHUNK), dtype=torch.uint8, device=device) for n in sizes]
        work = [tuple(t.clone() for t in b) for b in blocks]
        calls = [StepCall(p, g, m, v, s, (p, m, v), None, f) for (p, g, m, v), f in zip(work, flags)]
        if many:
            tk.step_many(calls, variant)
        else:
            for c in calls:
                tk.step_many([c], variant)
        for (p, g, m, v), w, f in zip(blocks, work, flags):
            cpu = [t.cpu() for t in (p, g, m, v)]
            want = chunks(beyond_limit(cpu[1], s.grad_scale) | lossy_elements(cpu[0], cpu[1], cpu[3], s, False,
                                                                               m=cpu[2]))
            assert f.tolist() == want and any(want)
            keep = (f == 0).repeat_interleave(FINITE_CHUNK)[:p.numel()]
            plain = tk.step(p, g, m, v, s, variant)
            for got, fresh, old in zip((w[0], w[2], w[3]), plain, (p, m, v)):
                assert torch.equal(got[keep], fresh[keep]) and torch.equal(got[~keep], old[~keep])
    # an undo+redo whose new gradient is lossy against the undone moments in one chunk
    p, g, m, v = (t.clone() for t in blocks[1])
    g = torch.randn(p.shape, device=device, generator=gen)
    p1, m1, v1 = tk.step(p, g, m, v, s, variant)
    g_new = torch.randn(p.shape, device=device, generator=gen)
    g_new[100] = 1000.0
    f = torch.zeros(1, dtype=torch.uint8, device=device)
    tk.undo_redo_many([UndoRedoCall(p1, m1, v1, g, s, g_new, s, None, (p1, m1, v1), None, f)], variant)
    assert f.tolist() == [1]


@pytest.mark.parametrize("undoable", [True, False])
def test_chunk_snapshots_on_cuda(undoable, device="cuda"):
    """A spike in one chunk of a CUDA leaf: the record keeps that chunk (a chunk snapshot) and undoes it bit
    for bit; undo_redo with a new gradient that overflows in another chunk runs fused calls over the chunks
    not kept and a step from the kept one. Against the reference on the CPU (DESIGN.md's 1e-6 of the
    tensor), and against Triton's own undo, bitwise, where values were kept."""
    import sofx
    from sofx.kernels.base import FINITE_CHUNK

    gen = torch.Generator(device=device).manual_seed(3)
    params = {"a": torch.randn(3 * FINITE_CHUNK + 100, device=device, generator=gen),
              "b": torch.randn(300, device=device, generator=gen)}
    tri = sofx.adamw(lr=1e-2, weight_decay=0.1, backend="triton")
    ref = sofx.adamw(lr=1e-2, weight_decay=0.1, backend="reference")
    state = tri.init(params)
    for _ in range(20):
        params, state, _ = tri.update(params, {k: torch.randn(p.shape, device=device, generator=gen)
                                               for k, p in params.items()}, state, undoable=False)
    grads = {k: torch.randn(p.shape, device=device, generator=gen) for k, p in params.items()}
    grads["a"][FINITE_CHUNK + 50] = 1e3
    new = {k: torch.randn(p.shape, device=device, generator=gen) for k, p in params.items()}
    new["a"][3 * FINITE_CHUNK + 7] = float("inf")
    p1, s1, rec = tri.update(params, grads, state)
    assert rec.strategies() == ["chunk_snapshot", "algebraic"] and rec.leaves[0].chunks.tolist() == [1]
    own = tri.undo(*tri.update(params, grads, state))
    assert all(torch.equal(a[FINITE_CHUNK:2 * FINITE_CHUNK], b[FINITE_CHUNK:2 * FINITE_CHUNK])
               for a, b in zip((own[0]["a"], own[1].mu["a"], own[1].nu["a"]),
                               (params["a"], state.mu["a"], state.nu["a"])))
    cpu = sofx.tree.tree_map(lambda t: t.cpu(), (params, grads, state, new))
    undone = ref.undo(*ref.update(cpu[0], cpu[1], cpu[2]))
    want = ref.update(undone[0], cpu[3], undone[1], grads_finite=True, undoable=False)
    got = tri.undo_redo(p1, s1, rec, new, donate=True, undoable=undoable)
    for a, b in zip(sofx.tree.flatten(got[:2])[0], sofx.tree.flatten(want[:2])[0]):
        a = a.cpu()
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a))
        assert torch.equal(a, b) if a.dtype == torch.int64 else \
            float((a[fin] - b[fin]).abs().max() / b[fin].abs().max()) <= 1e-6
    if undoable:
        assert got[2].leaves[0].strategy == "chunk_snapshot" and got[2].leaves[0].chunks.tolist() == [3]
        back = tri.undo(*got)
        for a, b in zip((back[0]["a"], back[1].mu["a"], back[1].nu["a"]),
                        (own[0]["a"], own[1].mu["a"], own[1].nu["a"])):
            assert torch.equal(a[3 * FINITE_CHUNK:], b[3 * FINITE_CHUNK:])


def test_blocks_of_one_dense_layout_on_cuda_equal_contiguous_ones(device="cuda"):
    """Transposed and channels_last blocks (sofx.kernels.layout): compiled, the kernels run over their memory
    spans without copies; results bit for bit those of the contiguous calls, in the blocks' layout, one launch
    per tensor and in the multi-tensor launch (through sofx.adamw's update)."""
    import sofx
    from sofx.kernels import triton as tk
    from sofx.kernels.base import AdamScalars, AdamVariant, StepCall

    gen = torch.Generator(device=device).manual_seed(3)

    def transposed(scale=1.0):
        return (scale * torch.randn(129, 67, device=device, generator=gen)).t()

    def channels_last(scale=1.0):
        return (scale * torch.randn(5, 7, 3, 11, device=device, generator=gen)).contiguous(
            memory_format=torch.channels_last)

    variant = AdamVariant()
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.5)
    for make in (transposed, channels_last):
        p, g, m, v = make(), make(), make(0.1), make(0.01).abs() + 1e-4
        want = tk.step(p.contiguous(), g.contiguous(), m.contiguous(), v.contiguous(), s, variant)
        got = tk.step_many([StepCall(p, g, m, v, s)], variant)[0]
        for a, b in zip(got, want):
            assert a.stride() == p.stride() and torch.equal(a, b)
    opt = sofx.adamw(lr=1e-3, backend="triton")
    params = {"t": transposed(), "c": channels_last(), "x": torch.randn(300, device=device, generator=gen)}
    grads = {k: torch.randn_like(x) for k, x in params.items()}
    flat = {k: x.contiguous() for k, x in params.items()}
    new, _, _ = opt.update(params, grads, opt.init(params), grads_finite=True)
    want, _, _ = opt.update(flat, {k: x.contiguous() for k, x in grads.items()}, opt.init(flat), grads_finite=True)
    for k in params:
        assert new[k].stride() == params[k].stride() and torch.equal(new[k], want[k])


def test_a_step_of_2_31_elements_and_more_on_cuda_matches_near_both_ends_and_element_2_31(monkeypatch, device="cuda"):
    """A float32 block of 2^31 + 3077 elements (p, g, m, v: 32 GiB; run where 40 GiB of device memory are free)
    through the flat kernel, the aligned multi-tensor kernel and a checked multi-tensor launch
    (helpers.check_a_large_triton_step): the elements of the chunks at both ends and around element 2^31, where
    32-bit offsets, counts or chunk indices would wrap, as the kernel gives them alone and within DESIGN.md's
    tolerance of the reference on the CPU; the inf planted past 2^31 flags its chunk alone."""
    from helpers import check_a_large_triton_step

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip(f"needs 40 GiB of free device memory, {free / 2**30:.1f} GiB free")
    try:
        check_a_large_triton_step(device, 2**31 + 3 * 1024 + 5, 2**31, monkeypatch)
    finally:
        torch.cuda.empty_cache()


def _step_inputs(shapes, gen, device="cuda", pdt=torch.float32, sdt=torch.float32):
    """p, g, m, v per shape (v positive), p and g in ``pdt``, the moments in ``sdt``."""
    blocks = []
    for sh in shapes:
        p, g, m, v = (torch.randn(sh, device=device, generator=gen) for _ in range(4))
        blocks.append((p.to(pdt), g.to(pdt), (0.1 * m).to(sdt), (0.01 * v.abs() + 1e-4).to(sdt)))
    return blocks


def test_the_kernels_run_on_the_current_cuda_stream_in_order_with_torch_ops_on_it(device="cuda"):
    """Triton launches on torch's current stream (as torch's ops do), not the default one: on a side stream kept
    busy (torch.cuda._sleep) before it writes the gradients, a flat step and multi-tensor steps (whose table is
    copied on that stream, without waiting) read the gradients written there, and give the results of the
    same steps on the default stream."""
    from sofx.kernels import triton as tk
    from sofx.kernels.base import AdamScalars, AdamVariant, StepCall

    gen = torch.Generator(device=device).manual_seed(5)
    variant = AdamVariant()
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.5)
    # one flat block, then two pairs for the multi-tensor kernel (aligned and not)
    blocks = _step_inputs([(4096,), (2048,), (64, 64), (1000,), (7,)], gen)
    want = [tk.step(*b, s, variant) for b in blocks]
    work = [(p.clone(), torch.zeros_like(g), m.clone(), v.clone()) for p, g, m, v in blocks]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: a launch on another stream would read the zeros
        for w, b in zip(work, blocks):
            w[1].copy_(b[1])
        got = [tk.step(*work[0], s, variant)] + tk.step_many([StepCall(*w, s) for w in work[1:]], variant)
    side.synchronize()
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_step_many_captured_in_a_cuda_graph_replays_on_new_values(device="cuda"):
    """While a CUDA graph is being captured, blocks that would share a multi-tensor launch (its table a host
    buffer the graph would replay) get a flat launch each, nothing on the host waits for the device; replayed
    on new values in the same tensors, the graph gives the eager steps' results."""
    from sofx.kernels import triton as tk
    from sofx.kernels.base import AdamScalars, AdamVariant, StepCall

    gen = torch.Generator(device=device).manual_seed(6)
    variant = AdamVariant()
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.5)
    shapes = [(2048,), (64, 64), (1000,), (7,)]
    static = _step_inputs(shapes, gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled before the capture
        for b in static:
            tk.step(*[t.clone() for t in b], s, variant)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.step_many([StepCall(p, g, m, v, s, (p, m, v)) for p, g, m, v in static], variant)
    fresh = _step_inputs(shapes, gen)
    for b, f in zip(static, fresh):
        for t, x in zip(b, f):
            t.copy_(x)
    want = [tk.step(*f, s, variant) for f in fresh]
    graph.replay()
    torch.cuda.synchronize()
    for (p, _, m, v), w in zip(static, want):
        assert all(torch.equal(x, y) for x, y in zip((p, m, v), w))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_blocks_run_on_their_own_device_whatever_the_current_one():
    """Blocks on cuda:1 stepped while cuda:0 is current run on cuda:1 (the launcher makes their device current,
    as torch's ops do; the current device is left as it was), in one list with blocks on cuda:0 too; a call
    whose tensors are on two devices is refused, naming the tensor, before anything is written."""
    from sofx.errors import UnsupportedError
    from sofx.kernels import triton as tk
    from sofx.kernels.base import AdamScalars, AdamVariant, StepCall

    variant = AdamVariant()
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.5)
    shapes = [(2048,), (64, 64), (1000,)]
    on = {d: _step_inputs(shapes, torch.Generator(device=d).manual_seed(7), d) for d in ("cuda:0", "cuda:1")}
    want = {}
    for d, blocks in on.items():
        with torch.cuda.device(d):
            want[d] = [tk.step(*b, s, variant) for b in blocks]
    with torch.cuda.device(0):
        got = tk.step_many([StepCall(*b, s) for b in on["cuda:0"] + on["cuda:1"]], variant)
        alone = tk.step(*on["cuda:1"][0], s, variant)
        assert torch.cuda.current_device() == 0
    for a, b in zip(got + [alone], want["cuda:0"] + want["cuda:1"] + want["cuda:1"][:1]):
        assert all(x.device == y.device and torch.equal(x, y) for x, y in zip(a, b))
    p, g, m, v = on["cuda:1"][0]
    before = [t.clone() for t in (p, m, v)]
    with pytest.raises(UnsupportedError, match="g is on cuda:0, p on cuda:1"):
        tk.step(p, g.to("cuda:0"), m, v, s, variant, out=(p, m, v))
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their 16-bit dtype lie between ``a`` and ``b`` (same dtype)."""
    def ordered(t):
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("pdt,sdt", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float32), (torch.float16, torch.float16)], ids=str)
def test_bf16_and_fp16_cuda_results_are_rounded_to_nearest_as_the_reference(pdt, sdt, device="cuda"):
    """The compiled kernels' bfloat16 and float16 stores round to nearest even as the reference's conversions
    on the CPU do: of a step's and an undo+redo's 16-bit results, all but a few (float32 values an ulp apart
    on a rounding boundary) are the reference's bits, none more than one value apart (a truncating
    conversion would leave about half of them one below)."""
    from sofx.kernels import reference
    from sofx.kernels import triton as tk
    from sofx.kernels.base import AdamScalars, AdamVariant

    gen = torch.Generator(device=device).manual_seed(8)
    variant = AdamVariant()
    s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.5)
    s2 = s._replace(grad_scale=0.25)
    ((p, g, m, v),) = _step_inputs([(1 << 16,)], gen, device, pdt, sdt)
    g2 = torch.randn(p.shape, device=device, generator=gen).to(pdt)
    cpu = [t.cpu() for t in (p, g, m, v, g2)]
    stepped = reference.step(*cpu[:4], s, variant)
    undone = reference.undo(stepped[0], cpu[1], *stepped[1:], s, variant)
    cases = [(tk.step(p, g, m, v, s, variant), stepped),
             (tk.undo_redo(*(t.to(device) for t in stepped), g, s, g2, s2, variant),
              reference.step(undone[0], cpu[4], *undone[1:], s2, variant))]
    for got, want in cases:
        for a, b in zip(got, want):
            if a.dtype == torch.float32:
                continue
            ulps = _ulps_apart(a.cpu(), b)
            assert int(ulps.max()) <= 1 and float((ulps != 0).float().mean()) < 1e-3, (a.dtype, int(ulps.max()))
