"""The Triton backend against reference.py, run by the Triton interpreter on CPU tensors.

The interpreter must be switched on (``TRITON_INTERPRET=1``) before the
kernels are decorated, and it must not leak into the rest of the test session.
So, in the normal session, this module holds a single test that runs this
same file in a fresh interpreter process with the variable set; there the
real tests below are collected.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

if not INTERPRETING:

    @pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
    def test_triton_kernels_under_the_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__],
                              env=env, capture_output=True, text=True, timeout=600,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        assert " passed" in proc.stdout

else:
    from sofx.errors import LeafError, UnsupportedError
    from sofx.kernels import reference, select_backend
    from sofx.kernels import triton as tk
    from sofx.kernels.base import AdamScalars, AdamVariant

    from helpers import max_rel_err

    VARIANTS = [AdamVariant(decoupled=d, bias_correction=b) for d in (True, False) for b in (True, False)]
    DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
              (torch.float16, torch.float32)]
    TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}
    # a partial single block, exactly one block, a partial last block
    SIZES = (7, tk.BLOCK, 3 * tk.BLOCK + 417)

    def _inputs(gen, shape, pdt, sdt):
        shape = (shape,) if isinstance(shape, int) else shape
        p = torch.randn(shape, generator=gen).to(pdt)
        g = torch.randn(shape, generator=gen).to(pdt)
        m = (0.1 * torch.randn(shape, generator=gen)).to(sdt)
        v = (0.01 * torch.rand(shape, generator=gen) + 1e-4).to(sdt)
        return p, g, m, v

    def _scalars(gen, wd, grad_scale=1.0):
        u = torch.rand(3, generator=gen).tolist()
        return AdamScalars(lr=1e-3 * (0.5 + u[0]), beta1=0.85 + 0.1 * u[1], beta2=0.99 + 0.009 * u[2], eps=1e-8,
                           weight_decay=wd, step=int(torch.randint(1, 500, (1,), generator=gen)),
                           grad_scale=grad_scale)

    def _close(got, want):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            err = max_rel_err(a, b)
            assert err <= TOL[a.dtype], err

    @pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"dec{int(v.decoupled)}-bc{int(v.bias_correction)}")
    @pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{str(d[0])[6:]}-{str(d[1])[6:]}")
    def test_step_undo_undo_redo_match_reference(dtypes, variant, rng):
        for n, wd, gs in zip(SIZES, (0.1, 0.0, 0.05), (1.0, 0.5, 0.25)):
            p, g, m, v = _inputs(rng, n, *dtypes)
            s = _scalars(rng, wd, gs)
            want = reference.step(p, g, m, v, s, variant)
            _close(tk.step(p, g, m, v, s, variant), want)
            _close(tk.undo(*want[:1], g, *want[1:], s, variant), reference.undo(*want[:1], g, *want[1:], s, variant))
            g2 = torch.randn(p.shape, generator=rng).to(g.dtype)
            s2 = _scalars(rng, wd)._replace(step=s.step)
            undone = reference.undo(*want[:1], g, *want[1:], s, variant)
            _close(tk.undo_redo(*want, g, s, g2, s2, variant), reference.step(*undone[:1], g2, *undone[1:], s2, variant))

    def test_donation_reuses_storage_and_inputs_stay_untouched_otherwise(rng):
        variant = AdamVariant()
        p, g, m, v = _inputs(rng, 2 * tk.BLOCK + 5, torch.float32, torch.float32)
        s = _scalars(rng, 0.1)
        copies = [t.clone() for t in (p, g, m, v)]
        fresh = tk.step(p, g, m, v, s, variant)
        assert all(torch.equal(a, b) for a, b in zip((p, g, m, v), copies))
        ptrs = [t.data_ptr() for t in (p, m, v)]
        res = tk.step(p, g, m, v, s, variant, out=(p, m, v))
        assert [t.data_ptr() for t in res] == ptrs
        assert all(torch.equal(a, b) for a, b in zip(res, fresh))
        assert [t.data_ptr() for t in tk.undo(p, g, m, v, s, variant, out=(p, m, v))] == ptrs
        _close((p, m, v), reference.undo(*fresh[:1], g, *fresh[1:], s, variant))
        assert [t.data_ptr() for t in tk.undo_redo(p, m, v, g, s, g, s, variant, out=(p, m, v))] == ptrs

    def test_non_contiguous_zero_size_and_p_old(rng):
        variant = AdamVariant(decoupled=False)
        big = _inputs(rng, (33, 90), torch.float32, torch.float32)
        p, g, m, v = (t[:, ::2] for t in big)
        s = _scalars(rng, 0.1, 0.5)
        want = reference.step(p, g, m, v, s, variant)
        _close(tk.step(p, g, m, v, s, variant), want)
        tk.step(p, g, m, v, s, variant, out=(p, m, v))
        _close((p, m, v), want)
        empty = [torch.empty(0, 3) for _ in range(4)]
        assert all(t.shape == (0, 3) for t in tk.step(*empty, s, variant))
        pb, gb, mb, vb = _inputs(rng, 1500, torch.bfloat16, torch.float32)
        stepped = reference.step(pb, gb, mb, vb, s, variant)
        got = tk.undo(*stepped[:1], gb, *stepped[1:], s, variant, p_old=pb)
        assert torch.equal(got[0], pb)
        _close(got, reference.undo(*stepped[:1], gb, *stepped[1:], s, variant, p_old=pb))
        _close(tk.undo_redo(*stepped, gb, s, gb, s, variant, p_old=pb),
               reference.undo_redo(*stepped, gb, s, gb, s, variant, p_old=pb))

    @pytest.mark.parametrize("dtypes", DTYPES[:3], ids=["fp32", "bf16-fp32", "bf16"])
    def test_p_copy_receives_the_new_params_in_its_dtype(dtypes, rng, monkeypatch):
        """Stored by the kernel (contiguous, a storage dtype) or copied afterwards (float64, strided),
        as ``p_copy.copy_(p')``; the results are those without a copy."""
        copied_after = []
        monkeypatch.setattr(tk, "write_param_copy",
                            lambda c, p: c is not None and (copied_after.append(c.dtype), c.copy_(p)))
        variant = AdamVariant()
        n = tk.BLOCK + 9
        p, g, m, v = _inputs(rng, n, *dtypes)
        s = _scalars(rng, 0.1, 0.5)
        stepped = tk.step(p, g, m, v, s, variant)
        ops = {"step": lambda **kw: tk.step(p, g, m, v, s, variant, **kw),
               "undo": lambda **kw: tk.undo(*stepped[:1], g, *stepped[1:], s, variant, **kw),
               "undo_redo": lambda **kw: tk.undo_redo(*stepped, g, s, g, s._replace(grad_scale=0.25), variant, **kw)}
        for op, run in ops.items():
            want = run()
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                buffer = torch.full((2 * n,), 7.0, dtype=dtype)
                for copy in (buffer[:n], buffer[::2]):
                    copied_after.clear()
                    got = run(p_copy=copy)
                    assert copied_after == ([] if copy.is_contiguous() and dtype != torch.float64 else [dtype])
                    assert all(torch.equal(a, b) for a, b in zip(got, want)), (op, dtype)
                    assert torch.equal(copy, want[0].to(dtype)), (op, dtype)

    def test_nan_propagates_and_the_clamp_keeps_nan(rng):
        variant = AdamVariant()
        p, g, m, v = _inputs(rng, 100, torch.float32, torch.float32)
        g[3] = float("nan")
        s = _scalars(rng, 0.1)
        got = tk.step(p, g, m, v, s, variant)
        assert all(bool(torch.isnan(t[3])) for t in got)
        p, g, m, v = _inputs(rng, 100, torch.float32, torch.float32)
        v_small = v * 1e-6
        v_small[9] = float("nan")
        got = tk.undo(p, g, m, v_small, s, variant)
        assert torch.isnan(got[2][9]) and (got[2][torch.arange(100) != 9] == 0).all()
        pb, gb, mb, vb = _inputs(rng, 100, torch.bfloat16, torch.bfloat16)
        gb[4] = float("nan")
        assert all(bool(torch.isnan(t[4])) for t in tk.step(pb, gb, mb, vb, s, variant))

    def test_bad_input_is_refused_and_changes_nothing(rng):
        variant = AdamVariant()
        p, g, m, v = _inputs(rng, 10, torch.float32, torch.float32)
        copies = [t.clone() for t in (p, g, m, v)]
        s = _scalars(rng, 0.1)
        with pytest.raises(LeafError, match="shape"):
            tk.step(p, g[:9], m, v, s, variant, out=(p, m, v))
        with pytest.raises(UnsupportedError, match="not supported"):
            tk.step(p.double(), g.double(), m.double(), v.double(), s, variant)
        with pytest.raises(UnsupportedError, match="beta2 == 0"):
            tk.undo(p, g, m, v, s._replace(beta2=0.0), variant, out=(p, m, v))
        assert all(torch.equal(a, b) for a, b in zip((p, g, m, v), copies))

    def test_small_and_zero_beta1_take_torchs_other_lerp_branch(rng):
        p, g, m, v = _inputs(rng, 1500, torch.float32, torch.float32)
        for beta1 in (0.3, 0.0):
            s = _scalars(rng, 0.1)._replace(beta1=beta1)
            for variant in (VARIANTS[0], VARIANTS[3]):
                _close(tk.step(p, g, m, v, s, variant), reference.step(p, g, m, v, s, variant))

    def test_selection_under_the_interpreter():
        assert tk.supports("cpu", torch.float32, torch.float32)
        assert not tk.supports("cpu", torch.float64, torch.float64)
        assert select_backend("triton", "cpu", torch.bfloat16, torch.float32) is tk
        assert select_backend("auto", "cpu", torch.float32, torch.float32).NAME == "cpu"
