"""The Triton backend against reference.py, run by the Triton interpreter on CPU tensors.

The interpreter must be switched on (``TRITON_INTERPRET=1``) before the
kernels are decorated, and it must not leak into the rest of the test session.
So, in the normal session, this module holds a single test that runs this
same file in a fresh interpreter process with the variable set; there the
real tests below are collected.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from helpers import HAVE_TRITON, INTERPRETING_TRITON, rerun_under_the_triton_interpreter

if not INTERPRETING_TRITON:

    @pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
    @pytest.mark.timeout(600)  # (the whole file's ~110 tests in one process: its run's own limit, not 300 s)
    def test_triton_kernels_under_the_interpreter():
        rerun_under_the_triton_interpreter(__file__)

else:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from sofx.errors import LeafError, UnsupportedError
    from sofx.kernels import reference, select_backend
    from sofx.kernels import triton as tk
    from sofx.kernels.base import AdamScalars, AdamVariant, StepCall, UndoCall, UndoRedoCall

    from helpers import (UNWRITABLE, bits, block_inputs, block_scalars, check_a_large_triton_step, expanded,
                         max_rel_err, refuse_bad_blocks_first, refuse_bad_grad_scales, refuse_bad_scalars,
                         refuse_bad_writes, refuse_shared_memory, refuse_step_sizes_beyond_float32,
                         refuse_traced_inputs, result_requiring_grad, run_blocks)
    from test_adam_undo import (CHAIN_DONATIONS, check_first_step_redone_fused, check_kept_parameter_redone_fused,
                                check_records_intact_through_a_chain, first_steps, kept_parameter_redos)

    VARIANTS = [AdamVariant(decoupled=d, bias_correction=b) for d in (True, False) for b in (True, False)]
    DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
              (torch.float16, torch.float32)]
    TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}
    # a partial single block, exactly one block, a partial last block
    SIZES = (7, tk.BLOCK, 3 * tk.BLOCK + 417)

    def _close(got, want, *operands):
        """Within TOL, relative to each result's magnitude and those of ``operands`` (tuples of tensors, one per
        result: the values the operation computed it from, as the step's inputs p, m, v: p' = p - u is small
        where it cancels, and an ulp of u, by which the kernels may differ, large against it alone)."""
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and a.shape == b.shape
            scale = None
            for x in (o[i] for o in operands):
                scale = x.double().abs() if scale is None else torch.maximum(scale, x.double().abs())
            err = max_rel_err(a, b, scale)
            assert err <= TOL[a.dtype], err

    def _check_step_undo_undo_redo(p, g, m, v, s, g2, s2, variant):
        """The step, the undo of the reference's step and the undo+redo of it with ``(g2, s2)``: the reference's
        results within TOL, relative to the magnitudes each computes with (the undo's: the stepped values; the
        undo+redo's: those and the undone ones, from which it redoes)."""
        want = reference.step(p, g, m, v, s, variant)
        _close(tk.step(p, g, m, v, s, variant), want, (p, m, v))
        undone = reference.undo(*want[:1], g, *want[1:], s, variant)
        _close(tk.undo(*want[:1], g, *want[1:], s, variant), undone, want)
        _close(tk.undo_redo(*want, g, s, g2, s2, variant), reference.step(*undone[:1], g2, *undone[1:], s2, variant),
               undone, want)

    @pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"dec{int(v.decoupled)}-bc{int(v.bias_correction)}")
    @pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{str(d[0])[6:]}-{str(d[1])[6:]}")
    def test_step_undo_undo_redo_match_reference(dtypes, variant, rng):
        for n, wd, gs in zip(SIZES, (0.1, 0.0, 0.05), (1.0, 0.5, 0.25)):
            p, g, m, v = block_inputs(rng, n, *dtypes)
            s = block_scalars(rng, wd, gs)
            g2 = torch.randn(p.shape, generator=rng).to(g.dtype)
            s2 = block_scalars(rng, wd)._replace(step=s.step)
            _check_step_undo_undo_redo(p, g, m, v, s, g2, s2, variant)

    # Elements where a result cancels (block_inputs' draws of other seeds found them; the reference's and the
    # interpreted kernel's differed by 1.06e-6 (step), 2.66e-6 (undo) and 1.47e-6 (undo+redo) relative to the
    # result alone): (decoupled, p, g, m, v, g2 as float32 hex), the step's scalars, the redo's.
    CANCELLING = [
        (True, ("0x1.7dc7820000000p-10", "0x1.6ae52c0000000p-2", "0x1.41e48a0000000p-4", "0x1.3dbb7c0000000p-8",
                "0x1.585af20000000p+1"),
         AdamScalars(lr=0.0010421139001846314, beta1=0.8603864252567291, beta2=0.9901138388514519, eps=1e-08,
                     weight_decay=0.0, step=39, grad_scale=0.5),
         AdamScalars(lr=0.0013351465463638306, beta1=0.875005578994751, beta2=0.9967228549718856, eps=1e-08,
                     weight_decay=0.0, step=39, grad_scale=1.0)),
        (True, ("-0x1.6ec1f80000000p-16", "0x1.7c590c0000000p+0", "-0x1.0163980000000p-8", "0x1.35670e0000000p-7",
                "0x1.e4079a0000000p-2"),
         AdamScalars(lr=0.0009810062050819397, beta1=0.8550269663333893, beta2=0.9955728498101234, eps=1e-08,
                     weight_decay=0.0, step=492, grad_scale=0.5),
         AdamScalars(lr=0.0010349714756011962, beta1=0.8702129304409026, beta2=0.9947274309396744, eps=1e-08,
                     weight_decay=0.0, step=492, grad_scale=1.0)),
        (False, ("0x1.7c284c0000000p-10", "0x1.d36d620000000p-5", "0x1.fe48d00000000p-5", "0x1.d113c40000000p-8",
                 "0x1.a156040000000p+0"),
         AdamScalars(lr=0.0009515793323516846, beta1=0.8749171257019043, beta2=0.9947458072900772, eps=1e-08,
                     weight_decay=0.0, step=79, grad_scale=0.5),
         AdamScalars(lr=0.001307931959629059, beta1=0.9493463575839997, beta2=0.9971365460157394, eps=1e-08,
                     weight_decay=0.0, step=79, grad_scale=1.0)),
    ]

    @pytest.mark.parametrize("case", range(len(CANCELLING)))
    def test_step_undo_undo_redo_of_cancelling_elements_match_reference(case):
        """test_step_undo_undo_redo_match_reference's checks on CANCELLING's elements (a block of them)."""
        decoupled, values, s, s2 = CANCELLING[case]
        p, g, m, v, g2 = (torch.full((tk.BLOCK + 3,), float.fromhex(x)) for x in values)
        _check_step_undo_undo_redo(p, g, m, v, s, g2, s2, AdamVariant(decoupled=decoupled, bias_correction=False))

    def test_donation_reuses_storage_and_inputs_stay_untouched_otherwise(rng):
        variant = AdamVariant()
        p, g, m, v = block_inputs(rng, 2 * tk.BLOCK + 5, torch.float32, torch.float32)
        s = block_scalars(rng, 0.1)
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
        big = block_inputs(rng, (33, 90), torch.float32, torch.float32)
        p, g, m, v = (t[:, ::2] for t in big)
        s = block_scalars(rng, 0.1, 0.5)
        want = reference.step(p, g, m, v, s, variant)
        _close(tk.step(p, g, m, v, s, variant), want)
        tk.step(p, g, m, v, s, variant, out=(p, m, v))
        _close((p, m, v), want)
        empty = [torch.empty(0, 3) for _ in range(4)]
        assert all(t.shape == (0, 3) for t in tk.step(*empty, s, variant))
        pb, gb, mb, vb = block_inputs(rng, 1500, torch.bfloat16, torch.float32)
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
        monkeypatch.setattr(tk, "write_kept_param_copy",
                            lambda c, p, skip: c is not None and (copied_after.append(c.dtype), c.copy_(p)))
        variant = AdamVariant()
        n = tk.BLOCK + 9
        p, g, m, v = block_inputs(rng, n, *dtypes)
        s = block_scalars(rng, 0.1, 0.5)
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

    def test_a_decay_factor_of_zero_undoes_from_p_old(rng):
        """Decoupled lr * wd == 1 (1 - lr*wd == 0: sofx.adamw undoes such a step from a parameter snapshot):
        the kernel's divisor 0 is never used, the undo and the undo+redo give the reference's results."""
        p, g, m, v = block_inputs(rng, 1000, torch.float32, torch.float32)
        s = block_scalars(rng, 0.0)._replace(lr=0.5, weight_decay=2.0)
        variant = AdamVariant(decoupled=True)
        stepped = reference.step(p, g, m, v, s, variant)
        want = reference.undo(stepped[0], g, *stepped[1:], s, variant, p_old=p)
        got = tk.undo(stepped[0], g, *stepped[1:], s, variant, p_old=p)
        assert torch.equal(got[0], p)
        _close(got, want)
        g2 = torch.randn(p.shape, generator=rng)
        _close(tk.undo_redo(*stepped, g, s, g2, s, variant, p_old=p), reference.step(*want[:1], g2, *want[1:], s,
                                                                                      variant))

    def test_nan_propagates_and_the_clamp_keeps_nan(rng):
        variant = AdamVariant()
        p, g, m, v = block_inputs(rng, 100, torch.float32, torch.float32)
        g[3] = float("nan")
        s = block_scalars(rng, 0.1)
        got = tk.step(p, g, m, v, s, variant)
        assert all(bool(torch.isnan(t[3])) for t in got)
        p, g, m, v = block_inputs(rng, 100, torch.float32, torch.float32)
        v_small = v * 1e-6
        v_small[9] = float("nan")
        got = tk.undo(p, g, m, v_small, s, variant)
        assert torch.isnan(got[2][9]) and (got[2][torch.arange(100) != 9] == 0).all()
        pb, gb, mb, vb = block_inputs(rng, 100, torch.bfloat16, torch.bfloat16)
        gb[4] = float("nan")
        assert all(bool(torch.isnan(t[4])) for t in tk.step(pb, gb, mb, vb, s, variant))

    def test_bad_input_is_refused_and_changes_nothing(rng):
        variant = AdamVariant()
        p, g, m, v = block_inputs(rng, 10, torch.float32, torch.float32)
        copies = [t.clone() for t in (p, g, m, v)]
        s = block_scalars(rng, 0.1)
        with pytest.raises(LeafError, match="shape"):
            tk.step(p, g[:9], m, v, s, variant, out=(p, m, v))
        with pytest.raises(UnsupportedError, match="not supported"):
            tk.step(p.double(), g.double(), m.double(), v.double(), s, variant)
        with pytest.raises(UnsupportedError, match="beta2 == 0"):
            tk.undo(p, g, m, v, s._replace(beta2=0.0), variant, out=(p, m, v))
        assert all(torch.equal(a, b) for a, b in zip((p, g, m, v), copies))

    def test_kernel_level_misuse_is_refused_before_anything_is_written(rng):
        """Three inputs the optimizers never pass but the kernel API takes: moments of two dtypes (the kernels
        rounded v to m's dtype: silently wrong), a written tensor whose elements overlap (torch raised after m
        and v were written), also as the second block of a launch, whose dtypes skip the full check; refused
        first, nothing written."""
        from sofx.kernels.base import StepCall

        variant = AdamVariant()
        s = block_scalars(rng, 0.1)
        p, g, m, v = block_inputs(rng, 37, torch.float32, torch.float32)
        copies = [t.clone() for t in (p, g, m, v)]
        for mb, vb in ((m.bfloat16(), v), (m, v.bfloat16())):
            with pytest.raises(UnsupportedError, match="the kernels keep both moments in one state dtype"):
                tk.step(p, g, mb, vb, s, variant)
            with pytest.raises(UnsupportedError, match="one state dtype"):
                tk.step_many([StepCall(p, g, m, v, s), StepCall(p, g, mb, vb, s)], variant)
        wide = torch.randn(1).expand(37)
        with pytest.raises(LeafError, match=r"triton.step: p: its elements overlap in memory"):
            tk.step(wide, g, m, v, s, variant, out=(wide, m, v))
        with pytest.raises(LeafError, match=r"step_many\[1\]: p: its elements overlap"):
            tk.step_many([StepCall(p, g, m, v, s, out=(p, m, v)), StepCall(wide, g, m, v, s, out=(wide, m, v))],
                         variant)
        with pytest.raises(LeafError, match=r"p_copy: its elements overlap"):
            tk.step(p, g, m, v, s, variant, p_copy=torch.zeros(1).expand(37))
        assert all(torch.equal(a, b) for a, b in zip((p, g, m, v), copies))

    @pytest.mark.parametrize("bad, message", UNWRITABLE, ids=["inference", "leaf", "view_of_leaf"])
    def test_written_tensors_torch_cannot_write_in_place_are_refused_before_anything_is_written(bad, message, rng):
        """An out, a donated input or a p_copy torch refuses to write in place (a leaf that requires grad or a
        view of one, with grad mode on; an inference tensor outside inference mode) was written by the kernels;
        every entry now refuses it first, naming the argument, as the other backends do."""
        refuse_bad_writes(tk, "triton", rng, bad, LeafError, message)

    def test_a_written_tensor_autograd_records_is_refused_by_the_triton_kernels(rng):
        """An out, a donated input or a p_copy that requires grad without being a leaf was written in memory
        autograd does not see while grad mode is on (its history, of its old values, kept); refused first now,
        as the cpu backends do."""
        refuse_bad_writes(tk, "triton", rng, result_requiring_grad, LeafError,
                          "a tensor that requires grad cannot be written by these kernels while grad mode is on")

    def test_traced_inputs_are_refused_by_the_triton_kernels(rng):
        """A read tensor that requires grad (grad mode on) or a torch.func transform's was read as plain values:
        the results were silently not differentiable, where the reference's are. Refused before anything is
        written, naming the call, the argument and what to do, as the cpu backends do."""
        refuse_traced_inputs(tk, "triton", rng)

    def test_written_tensors_that_share_memory_are_refused_by_every_entry(rng):
        """An out or p_copy overlapping another array of the call (a gradient, another out, a donated input,
        another block's) was written as the programs ran: wrong results, and the arrays read changed. Every
        entry now refuses it first, naming both (MemoryOverlapError), as the cpu backends do; an expand()-ed
        one too (the same error now)."""
        from sofx.kernels.base import MemoryOverlapError

        refuse_bad_writes(tk, "triton", rng, expanded, MemoryOverlapError, "its elements overlap in memory")
        refuse_shared_memory(tk, "triton", rng)

    def test_numpy_scalars_and_overflowing_quotients_give_cpu_fasts_bits(rng):
        """numpy numbers are numbers to the contract (the launch took Python's only and failed); an inverse whose
        quotient overflows gives cpu_fast's div_by bits (+inf, nan for a negative one; it gave nan for both)."""
        import numpy as np

        from sofx.kernels import cpu_fast
        from sofx.kernels.base import AdamScalars

        variant = AdamVariant()
        p, g, m, v = block_inputs(rng, 37, torch.float32, torch.float32)
        s = AdamScalars(np.float32(1e-3), np.float64(0.9), 0.999, np.float32(1e-8), 0.1, np.int64(5), np.float32(0.5))
        for op in ("step", "undo"):
            want = getattr(cpu_fast, op)(p, g, m, v, s, variant)
            got = getattr(tk, op)(p, g, m, v, s, variant)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), op
        s = AdamScalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 5, 1.0)
        for sign in (1.0, -1.0):  # m = (m' - 0.1 g) / 0.9 beyond float32's range
            g, m = torch.full((37,), -1.5e38 * sign), torch.full((37,), 3.0e38 * sign)
            want = cpu_fast.undo(p, g, m, v, s, variant)[1]
            got = tk.undo(p, g, m, v, s, variant)[1]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (sign, got[:2], want[:2])

    def test_small_and_zero_beta1_take_torchs_other_lerp_branch(rng):
        p, g, m, v = block_inputs(rng, 1500, torch.float32, torch.float32)
        for beta1 in (0.3, 0.0):
            s = block_scalars(rng, 0.1)._replace(beta1=beta1)
            for variant in (VARIANTS[0], VARIANTS[3]):
                _close(tk.step(p, g, m, v, s, variant), reference.step(p, g, m, v, s, variant))

    def _many_blocks(rng):
        """Blocks that exercise the multi-tensor launch: aligned and not (n % 16, a view at an odd offset),
        one block per program and several, a partial last program, an empty block, a strided one, two
        dtype combinations."""
        blocks = [block_inputs(rng, n, torch.float32, torch.float32) for n in (16, tk.BLOCK, 3 * tk.BLOCK + 48, 7,
                                                                          tk.BLOCK + 417, 0)]
        odd = block_inputs(rng, 200, torch.float32, torch.float32)
        blocks.append(tuple(t[3:163] for t in odd))  # 160 elements, not 16-element aligned
        wide = block_inputs(rng, (20, 30), torch.float32, torch.float32)
        blocks.append(tuple(t[:, ::3] for t in wide))  # strided
        blocks += [block_inputs(rng, n, torch.bfloat16, torch.float32) for n in (48, 2 * tk.BLOCK + 5, 64)]
        return blocks

    def _count_multi_launches(monkeypatch):
        launches = []
        run_multi = tk._run_multi

        def counting(op, group, *args):
            launches.append(len(group))
            return run_multi(op, group, *args)

        monkeypatch.setattr(tk, "_run_multi", counting)
        return launches

    def _same(got, want):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    def test_many_blocks_in_one_launch_equal_one_call_per_block(rng, monkeypatch):
        """step_many / undo_many / undo_redo_many: each block's results are the one-block functions' bits
        (those are checked against the reference above), whatever the grouping; blocks with the same
        dtypes, scalars and alignment share a launch."""
        launches = _count_multi_launches(monkeypatch)
        variant = AdamVariant(decoupled=False)
        blocks = _many_blocks(rng)
        s_a, s_b = block_scalars(rng, 0.1, 0.5), block_scalars(rng, 0.0)
        scalars = [s_a if i % 3 else s_b for i in range(len(blocks))]
        want = [tk.step(*b, s, variant) for b, s in zip(blocks, scalars)]
        assert launches == []  # one block per call: the flat kernel
        got = tk.step_many([StepCall(*b, s) for b, s in zip(blocks, scalars)], variant)
        for g_, w in zip(got, want):
            _same(g_, w)
        assert launches and sum(launches) >= 6, launches
        # undo, some from a parameter snapshot
        launches.clear()
        calls = [UndoCall(w[0], b[1], w[1], w[2], s, b[0].to(w[0].dtype) if i % 4 == 1 else None)
                 for i, (b, w, s) in enumerate(zip(blocks, want, scalars))]
        got = tk.undo_many(calls, variant)
        for c, g_ in zip(calls, got):
            _same(g_, tk.undo(c.p, c.g, c.m, c.v, c.s, variant, p_old=c.p_old))
        assert launches
        # undo+redo with new gradients and scalars
        launches.clear()
        calls = [UndoRedoCall(w[0], w[1], w[2], b[1], s, torch.randn(b[1].shape, generator=rng).to(b[1].dtype),
                              s._replace(grad_scale=0.25)) for b, w, s in zip(blocks, want, scalars)]
        got = tk.undo_redo_many(calls, variant)
        for c, g_ in zip(calls, got):
            _same(g_, tk.undo_redo(c.p, c.m, c.v, c.g_old, c.s_old, c.g_new, c.s_new, variant))
        assert launches

    def test_blocks_whose_lr_differs_only_in_the_sign_of_zero_keep_their_own_scalars_in_triton(rng):
        """Two blocks of one list call on the same inputs, one with ``lr = 0.0`` and one with ``lr = -0.0`` (equal
        numbers: one dict key where kernel arguments are derived by value): a ``-0.0`` parameter element comes out
        of a step and of an undo with the other sign, so each block's bits are its one-block call's."""
        s = block_scalars(rng, 0.0)
        p, g, m, v = block_inputs(rng, 300, torch.float32, torch.float32)
        p[::3] = -0.0
        for lr_first in (0.0, -0.0):
            lrs = (lr_first, -lr_first)
            got = tk.step_many([StepCall(p, g, m, v, s._replace(lr=lr)) for lr in lrs], AdamVariant())
            for g_, lr in zip(got, lrs):
                _same([bits(t) for t in g_], [bits(t) for t in tk.step(p, g, m, v, s._replace(lr=lr), AdamVariant())])
            assert not torch.equal(bits(got[0][0]), bits(got[1][0]))  # (those zeros' signs differ between the two)
            variant = AdamVariant(decoupled=False)
            got = tk.undo_many([UndoCall(p, g, m, v, s._replace(lr=lr)) for lr in lrs], variant)
            for g_, lr in zip(got, lrs):
                _same([bits(t) for t in g_], [bits(t) for t in tk.undo(p, g, m, v, s._replace(lr=lr), variant)])

    def test_many_blocks_donate_copy_and_tensorblock_scalars(rng):
        """In place (out = the inputs) and with parameter copies, as one call per block; a block whose
        scalars are 0-d tensors takes the reference path in between."""
        variant = AdamVariant()
        blocks = _many_blocks(rng)
        s = block_scalars(rng, 0.1)
        tensor_s = s._replace(lr=torch.tensor(s.lr))
        scalars = [tensor_s if i == 2 else s for i in range(len(blocks))]
        want = [tk.step(*b, s, variant) for b in blocks]
        copies = [torch.full(b[0].shape, 3.0, dtype=torch.bfloat16) for b in blocks]
        inputs = [tuple(t.clone() for t in b) for b in blocks]
        got = tk.step_many([StepCall(p, g, m, v, sc, (p, m, v) if p.is_contiguous() else None, c)
                            for (p, g, m, v), sc, c in zip(inputs, scalars, copies)], variant)
        for i, (g_, w, (p, _, m, v), c) in enumerate(zip(got, want, inputs, copies)):
            if i == 2:
                _close(g_, w)
            else:
                _same(g_, w)
            if p.is_contiguous():
                assert [t.data_ptr() for t in g_] == [t.data_ptr() for t in (p, m, v)]
            assert torch.equal(c, g_[0].to(torch.bfloat16))

    def test_many_blocks_checks_every_block_before_running_any(rng, monkeypatch):
        variant = AdamVariant()
        blocks = _many_blocks(rng)[:4]
        s = block_scalars(rng, 0.1)
        before = [[t.clone() for t in b] for b in blocks]
        refuse_bad_blocks_first(tk, "triton", blocks, s, variant)
        p, g, m, v = blocks[3]
        # after blocks that passed, a block of the same kind with an out of another shape, and one of a kind
        # the backend refuses (its plain tensors alone do not let it through)
        calls = [StepCall(*b, s, out=(b[0], b[2], b[3])) for b in blocks]
        q, mq, vq = (torch.empty(b.shape[0] + 1, dtype=b.dtype) for b in (p, m, v))
        calls[3] = StepCall(p, g, m, v, s, out=(q, mq, vq))
        with pytest.raises(LeafError, match=r"triton\.step_many\[3\]: out\[0\] has shape"):
            tk.step_many(calls, variant)
        with pytest.raises(LeafError, match=r"triton\.step_many\[1\]: m must be a tensor"):
            tk.step_many([calls[0], StepCall(p, g, None, v, s)], variant)
        supports = tk.supports
        monkeypatch.setattr(tk, "supports", lambda device, pd, sd: pd != torch.bfloat16 and supports(device, pd, sd))
        hp, hg, hm, hv = block_inputs(rng, 48, torch.bfloat16, torch.float32)
        with pytest.raises(UnsupportedError, match=r"triton\.step_many\[4\]: .*param dtype torch.bfloat16"):
            tk.step_many(calls[:3] + [StepCall(p, g, m, v, s, out=(p, m, v)),
                                      StepCall(hp, hg, hm, hv, s, out=(hp, hm, hv))], variant)
        for b, old in zip(blocks, before):
            assert all(torch.equal(a, o) for a, o in zip(b, old))

    def test_a_tensor_whose_storage_was_freed_is_refused_by_the_triton_kernels(rng):
        # A block's tensor whose memory was freed (untyped_storage().resize_(0), as FSDP frees tensors) passed the
        # common-case check of a list call's blocks after the first of their kind: the kernels read and wrote its
        # address. Refused now, naming it, before any block runs (sofx.Adam checks its leaves itself and sets
        # base.storage_checked(), under which the common case does not test them again).
        variant = AdamVariant()
        blocks = _many_blocks(rng)[:3]
        s = block_scalars(rng, 0.1)
        before = [[t.clone() for t in b] for b in blocks]
        for k, role in ((1, "g"), (2, "m"), (0, "p")):
            freed = [t.clone() for t in blocks[k]]
            freed["pgmv".index(role)].untyped_storage().resize_(0)
            calls = [StepCall(*b, s, out=(b[0], b[2], b[3])) for b in blocks]
            calls[k] = StepCall(*freed, s, out=(freed[0], freed[2], freed[3]))
            with pytest.raises(LeafError, match=rf"triton\.step_many\[{k}\]: {role}: its storage holds 0 bytes"):
                tk.step_many(calls, variant)
        for b, old in zip(blocks, before):
            assert all(torch.equal(a, o) for a, o in zip(b, old))

    def test_a_grad_scale_negative_or_not_finite_is_refused_by_every_entry(rng):
        blocks = _many_blocks(rng)[:2]
        refuse_bad_grad_scales(tk, "triton", blocks, block_scalars(rng, 0.1), AdamVariant())
        p, g, m, v = blocks[0]  # 0 (clip_grad_norm_ at max_norm=0) steps with zero gradients
        zero = block_scalars(rng, 0.0, grad_scale=0.0)
        for got, want in zip(tk.step(p, g, m, v, zero, AdamVariant()),
                             reference.step(p, 0 * g, m, v, zero._replace(grad_scale=1.0), AdamVariant())):
            assert torch.equal(got, want)

    def test_scalars_no_step_can_take_are_refused_by_every_entry(rng):
        blocks = _many_blocks(rng)[:2]
        refuse_bad_scalars(tk, "triton", blocks, block_scalars(rng, 0.1), AdamVariant())

    @pytest.mark.parametrize("decoupled", [True, False])
    def test_step_sizes_beyond_float32_are_refused_by_every_entry(decoupled, rng):
        """lr / (1 - beta1**t) beyond float32 with bias correction: the kernels wrote inf or nan, where
        sofx.Adam.update refuses it; every entry now refuses it as the other backends do, writing nothing."""
        blocks = _many_blocks(rng)[:2]
        variant = AdamVariant(decoupled=decoupled)
        refuse_step_sizes_beyond_float32(tk, "triton", blocks, block_scalars(rng, 0.1), variant)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(blocks=st.lists(st.tuples(st.integers(0, 300), st.sampled_from(range(3)), st.integers(0, 2),
                                     st.booleans(), st.booleans(), st.integers(0, 3)), min_size=1, max_size=7),
           op=st.sampled_from(["step", "undo", "undo_redo"]), decoupled=st.booleans(), seed=st.integers(0, 2**16))
    def test_many_blocks_equal_one_call_per_block_property(blocks, op, decoupled, seed):
        """Any list of blocks (sizes from 0 to 300 elements, at offsets 0-3 into their storage, three dtype
        combinations, two scalar sets, donated or not, with or without a bf16 copy): each block's results
        from the ``*_many`` function are those of its one-block call, bit for bit, whatever the grouping."""
        gen = torch.Generator().manual_seed(seed)
        variant = AdamVariant(decoupled=decoupled)
        scalar_sets = [block_scalars(gen, 0.1, 0.5), block_scalars(gen, 0.0), block_scalars(gen, 0.05, 2.0)]
        ins, calls_args = [], []
        for n, dt, sc, donate, copy, offset in blocks:
            pdt, sdt = DTYPES[dt]
            stor = block_inputs(gen, n + offset, pdt, sdt)
            p, g, m, v = (t[offset:] for t in stor)
            g2 = torch.randn(n, generator=gen).to(pdt)
            ins.append((p, g, m, v, g2, scalar_sets[sc], donate,
                        torch.empty(n, dtype=torch.bfloat16) if copy else None))

        def run(many: bool):
            work = [(p.clone(), g, m.clone(), v.clone(), g2, s, d, c) for p, g, m, v, g2, s, d, c in ins]
            return run_blocks(tk, op, work, variant, scalar_sets[2], many)

        for a, b in zip(run(True), run(False)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))

    def test_adam_leaves_the_memory_check_of_a_call_to_the_triton_kernels(rng, monkeypatch):
        """The Triton entries refuse written arrays that share memory (CHECKS_OVERLAP), so sofx.Adam does not
        compare a call's memory a second time: its refusals still name the leaves, nothing written."""
        import sofx
        adam = sys.modules["sofx.adam"]

        def second_pass(*args, **kwargs):
            raise AssertionError("sofx.Adam compared the memory the kernel compares")

        monkeypatch.setattr(adam, "_check_writes", second_pass)
        opt = sofx.adamw(lr=1e-2, backend="triton")
        params = {"a": torch.randn(40, generator=rng), "z": torch.randn(40, generator=rng)}
        grads = {k: torch.randn(40, generator=rng) for k in params}
        state = opt.init(params)
        params, state, record = opt.update(params, grads, state, donate=True)
        before = [t.clone() for t in (*params.values(), *state.mu.values(), *state.nu.values())]
        tied = {"a": params["a"], "z": params["a"]}
        with pytest.raises(LeafError, match=r"params\['a'\] and params\['z'\] share memory"):
            opt.update(tied, grads, state, donate=True)
        copies = {"a": None, "z": grads["z"]}
        with pytest.raises(LeafError, match=r"param_copies\['z'\] and grads\['z'\] share memory"):
            opt.update(params, grads, state, donate=True, param_copies=copies)
        with pytest.raises(LeafError, match=r"params\['a'\] and .*share memory"):
            opt.undo_redo(tied, state, record, grads, donate=True)
        after = [*params.values(), *state.mu.values(), *state.nu.values()]
        assert all(torch.equal(a, b) for a, b in zip(after, before))

    def test_adam_on_a_tree_of_many_leaves(rng, monkeypatch):
        """sofx.adamw(backend="triton") over many leaves: one launch per group, each leaf's bits those of
        the one-block kernels; undo and undo_redo too."""
        import sofx
        launches = _count_multi_launches(monkeypatch)
        shapes = [(16,), (48, 16), (7,), (3, 5), (tk.BLOCK + 32,), (64,)]
        params = {f"w{i}": torch.randn(sh, generator=rng) for i, sh in enumerate(shapes)}
        grads = {k: torch.randn(v.shape, generator=rng) for k, v in params.items()}
        # (the second step's gradient close to the first's: its inverse is not lossy, see test_lossy_undo.py,
        # so that the undo and the redo run algebraically)
        grads2 = {k: g * (1 + 0.1 * torch.randn(g.shape, generator=rng)) for k, g in grads.items()}
        grads["w2"] = None
        opt = sofx.adamw(lr=1e-2, weight_decay=0.1, backend="triton")
        one_by_one = sofx.adamw(lr=1e-2, weight_decay=0.1, backend="triton")
        monkeypatch.setattr(one_by_one, "_kernel", lambda leaf: _OneByOne)
        state = opt.init(params)
        p1, s1, r1 = opt.update(params, grads, state)
        q1, t1, _ = one_by_one.update(params, grads, state)
        assert launches == [4], launches  # four aligned fp32 leaves; (3, 5) alone; w2 has no gradient
        for a, b in zip(sofx.tree.flatten((p1, s1))[0], sofx.tree.flatten((q1, t1))[0]):
            assert torch.equal(a, b)
        for op in ("undo_redo", "undo"):
            launches.clear()
            results = []
            for o in (opt, one_by_one):
                p2, s2, r2 = o.update(p1, grads2, s1)
                if op == "undo":
                    results.append(o.undo(p2, s2, r2))
                else:
                    results.append(o.undo_redo(p2, s2, r2, grads, grad_scale=0.5)[:2])
            assert launches == [4, 4], (op, launches)  # the update, then the undo (+redo)
            for a, b in zip(sofx.tree.flatten(results[0])[0], sofx.tree.flatten(results[1])[0]):
                assert torch.equal(a, b), op

    class _OneByOne:
        """The triton backend with one kernel call per leaf (what Adam did before the *_many functions)."""

        CHECKS_FINITE = False

        @staticmethod
        def step_many(calls, variant):
            return [tk.step(c.p, c.g, c.m, c.v, c.s, variant, out=c.out, p_copy=c.p_copy) for c in calls]

        @staticmethod
        def undo_many(calls, variant):
            return [tk.undo(c.p, c.g, c.m, c.v, c.s, variant, p_old=c.p_old, out=c.out, p_copy=c.p_copy)
                    for c in calls]

        @staticmethod
        def undo_redo_many(calls, variant):
            return [tk.undo_redo(c.p, c.m, c.v, c.g_old, c.s_old, c.g_new, c.s_new, variant, p_old=c.p_old,
                                 out=c.out, p_copy=c.p_copy) for c in calls]

    # ------------------------------------------------------------ checked calls (skip)
    from sofx.kernels.base import FINITE_CHUNK, beyond_limit, lossy_elements

    def _chunk_any(bad: torch.Tensor) -> list[int]:
        n = bad.numel()
        padded = torch.nn.functional.pad(bad.reshape(-1).to(torch.uint8), (0, -n % FINITE_CHUNK))
        return padded.view(-1, FINITE_CHUNK).amax(dim=1).tolist()

    def _planted(rng, n, dtypes, where, sound=True):
        """Block inputs whose steps are sound but in the chunks ``where`` names: a spike (1000x, lossy),
        an inf gradient, a nan second moment, an inf first moment."""
        p, g, m, v = block_inputs(rng, n, *dtypes, sound=sound)
        for what, i in where:
            if what == "spike":
                g[i] = 1000.0
            elif what == "inf":
                g[i] = float("inf")
            elif what == "nan_v":
                v[i] = float("nan")
            elif what == "inf_p":  # where v is 0, no gradient: flagged in L2 mode (an inf effective gradient)
                p[i], v[i], g[i] = float("inf"), 0.0, 0.0
            else:
                m[i] = float("inf")
        return p, g, m, v

    CHECK_SIZES = (7, FINITE_CHUNK, 2 * FINITE_CHUNK + 417)

    @pytest.mark.parametrize("variant", VARIANTS[:3], ids=lambda v: f"dec{int(v.decoupled)}-bc{int(v.bias_correction)}")
    @pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{str(d[0])[6:]}-{str(d[1])[6:]}")
    def test_checked_step_flags_what_the_python_form_finds_and_leaves_those_chunks_alone(dtypes, variant, rng):
        """A checked step (skip) flags exactly the chunks where beyond_limit or lossy_elements finds an element
        (a spike, an inf gradient, a nan v, an inf m, an inf p where v is 0; planted in the first, a middle and
        the partial last chunk), writes none of their outputs (donated: they keep their old values) and gives the
        unchecked step's bits everywhere else."""
        for n in CHECK_SIZES:
            last = n - 1
            where = [("spike", 3), ("inf", min(FINITE_CHUNK + 5, last)), ("nan_v", last), ("inf_m", last // 2),
                     ("inf_p", min(2, last))]
            for planted in ([], where[:1], where[1:2], where[2:3], where[3:4], where[4:], where):
                p, g, m, v = _planted(rng, n, dtypes, planted)
                s = block_scalars(rng, 0.1, 0.5)
                want_flags = _chunk_any(beyond_limit(g, s.grad_scale)
                                        | lossy_elements(p, g, v, s, variant.decoupled, m=m))
                plain = tk.step(p, g, m, v, s, variant)
                skip = torch.zeros(-(-n // FINITE_CHUNK), dtype=torch.uint8)
                pp, mm, vv = p.clone(), m.clone(), v.clone()
                copy = torch.full((n,), 7.0, dtype=torch.bfloat16)
                wide = torch.full((n,), 7.0, dtype=torch.float64)  # (not a storage dtype: copied after the kernel)
                skip2 = skip.clone()
                tk.step_many([StepCall(pp, g, mm, vv, s, (pp, mm, vv), copy, skip),
                              StepCall(p.clone(), g, m.clone(), v.clone(), s, None, wide, skip2)], variant)
                assert skip.tolist() == want_flags and skip2.tolist() == want_flags, (n, planted)
                keep2 = (skip2 == 0).repeat_interleave(FINITE_CHUNK)[:n]
                assert torch.equal(wide[keep2], plain[0][keep2].double()) and bool((wide[~keep2] == 7.0).all())
                keep = (skip == 0).repeat_interleave(FINITE_CHUNK)[:n]
                for got, fresh, old in zip((pp, mm, vv), plain, (p, m, v)):
                    assert torch.equal(got[keep], fresh[keep]), (n, planted)
                    assert torch.equal(got[~keep].nan_to_num(), old[~keep].nan_to_num()), (n, planted)
                assert torch.equal(copy[keep], plain[0][keep].to(torch.bfloat16))
                assert bool((copy[~keep] == 7.0).all())

    @pytest.mark.parametrize("betas", [(0.0, 0.999), (0.9, 0.0)], ids=["beta1-0", "beta2-0"])
    def test_checked_calls_flag_what_lossy_elements_finds_with_a_lossy_factor_of_0(betas, rng):
        """A beta of 0 makes lossy_factor 0: a spike is then not lossy, but a nan v, an inf m and (L2) an inf
        p where v is 0 are still flagged, in a checked step and undo+redo, as lossy_elements finds them."""
        n = CHECK_SIZES[-1]
        where = [("spike", 3), ("nan_v", FINITE_CHUNK + 7), ("inf_m", n - 1), ("inf_p", 2)]
        p, g, m, v = _planted(rng, n, DTYPES[0], where)
        g2 = torch.randn(n, generator=rng)
        s = block_scalars(rng, 0.1, 0.5)._replace(beta1=betas[0], beta2=betas[1])
        s_old = block_scalars(rng, 0.1, 1.0)
        for decoupled in (True, False):
            variant = AdamVariant(decoupled=decoupled)
            want = _chunk_any(lossy_elements(p, g, v, s, decoupled, m=m))
            want_redo = _chunk_any(lossy_elements(p, g2, v, s, decoupled, g, s_old, m=m))
            assert want == want_redo == [int(not decoupled), 1, 1]
            skip = torch.zeros(3, dtype=torch.uint8)
            tk.step_many([StepCall(p, g, m, v, s, None, None, skip)], variant)
            assert skip.tolist() == want
            skip.zero_()
            tk.undo_redo_many([UndoRedoCall(p, m, v, g, s_old, g2, s, None, None, None, skip)], variant)
            assert skip.tolist() == want_redo

    @pytest.mark.parametrize("dtypes", DTYPES[:3], ids=["fp32", "bf16-fp32", "bf16"])
    def test_checked_calls_flag_a_zero_v_with_a_gradient(dtypes, rng):
        """A zero v (an undone one of 0) given a nonzero effective gradient is flagged, as lossy_elements finds
        it, in a checked step and undo+redo (beside a nonzero m); not one without, nor one of a step with
        zero_moments (a leaf's first step from init) but for an inf gradient, nor one beside a zero m that the
        inverse gives back exactly (float32 moments, decoupled decay)."""
        n = CHECK_SIZES[-1]
        p, g, m, v = block_inputs(rng, n, *dtypes, sound=True)
        g_old = g.clone()
        for i in (FINITE_CHUNK + 7, n - 1):  # the middle and the last chunk
            v[i] = g_old[i] = 0.0  # (the undone step added nothing there: its undone v is 0)
        for t in (p, g, m, v, g_old):
            t[:FINITE_CHUNK] = 0.0  # no effective gradient in either mode
        s = block_scalars(rng, 0.1, 0.5)
        s_old = s._replace(step=s.step + 1, grad_scale=1.0, weight_decay=0.01)
        zeros = torch.zeros_like(v)
        g_inf = g.clone()
        g_inf[n - 3] = float("inf")
        for decoupled in (True, False):
            variant = AdamVariant(decoupled=decoupled)
            cases = [(lossy_elements(p, g, v, s, decoupled, m=m), [0, 1, 1],
                      lambda f: StepCall(p, g, m, v, s, None, None, f)),
                     (lossy_elements(p, g, v, s, decoupled, g_old, s_old, m=m), [0, 1, 1],
                      lambda f: UndoRedoCall(p, m, v, g_old, s_old, g, s, None, None, None, f)),
                     (lossy_elements(p, g_inf, zeros, s, decoupled, m=zeros, zero_moments=True)
                      | beyond_limit(g_inf, s.grad_scale), [0, 0, 1],
                      lambda f: StepCall(p, g_inf, zeros, zeros, s, None, None, f, True)),
                     # (not told: flagged, but where the inverse gives the zeros back exactly: float32 moments,
                     # decoupled decay, base.zeros_come_back)
                     (lossy_elements(p, g, zeros, s, decoupled, m=zeros),
                      [0, 0, 0] if decoupled and dtypes[1] == torch.float32 else [0, 1, 1],
                      lambda f: StepCall(p, g, zeros, zeros, s, None, None, f))]
            for bad, expected, call in cases:
                assert _chunk_any(bad) == expected
                skip = torch.zeros(3, dtype=torch.uint8)
                c = call(skip)
                (tk.step_many if isinstance(c, StepCall) else tk.undo_redo_many)([c], variant)
                assert skip.tolist() == expected

    @pytest.mark.parametrize("mode", ["adamw", "adam-l2", "bf16-moments"])
    def test_exact_zero_moments_are_not_flagged_in_triton(mode):
        """test_lossy_undo.py's test on the Triton backend: rows whose moments are still exactly 0 get a
        gradient; the inverse gives them back exactly (float32 moments, no L2 decay) and nothing is kept."""
        from test_lossy_undo import check_exact_zero_moments
        check_exact_zero_moments("triton", mode)

    def test_checked_calls_flag_the_edges_of_exact_zero_moments_alike_in_triton(rng):
        """test_lossy_undo.py's check_zero_edges_flagged_alike on the Triton backend (_chunk_bad)."""
        from test_lossy_undo import check_zero_edges_flagged_alike
        check_zero_edges_flagged_alike((tk,), rng)

    def test_checked_calls_flag_the_l2_term_alike_in_triton(rng):
        """test_lossy_undo.py's check_l2_flags_alike on the Triton backend (_chunk_bad's L2 term, p_kept), with 4
        chunks and a partial one per call, not 12 (the interpreter runs a program per chunk, ~30 ms each): its 16
        draws still flag 13 of 80 chunks, 7 of them by the L2 term alone (where p_kept flags fewer)."""
        from test_lossy_undo import COMBOS, check_l2_flags_alike
        check_l2_flags_alike((tk,), rng, [c for c in COMBOS if c[0] == c[1]], nc=4)

    def test_a_weight_decay_that_rounds_to_0_in_float32_is_l2_decay_in_the_triton_check():
        """test_lossy_undo.py's test on the Triton kernels: their check tests the L2 term wherever the step adds
        it (an inf parameter's chunk flagged, moments exactly 0 not exempt)."""
        from test_lossy_undo import check_tiny_weight_decay_flagged
        check_tiny_weight_decay_flagged((tk,))

    @pytest.mark.parametrize("layout", ["transposed", "channels_last"])
    def test_a_block_of_one_dense_layout_runs_over_its_memory_without_copies(layout, rng, monkeypatch):
        """A block whose tensors share a dense, not contiguous layout (sofx.kernels.layout): step, undo and
        undo+redo give the bits of the contiguous calls, in that layout, donated in place, without copies."""
        from test_dense_layouts import LAYOUTS
        make = LAYOUTS[layout]
        p, g, g2 = make(rng), make(rng), make(rng)
        m, v = make(rng, 0.1), make(rng, 0.1).abs() + 0.05
        s = block_scalars(rng, 0.1, 0.5)
        s2 = s._replace(grad_scale=0.25)
        variant = AdamVariant(decoupled=True)
        cp, cg, cg2, cm, cv = (t.contiguous() for t in (p, g, g2, m, v))
        want = [tk.step(cp, cg, cm, cv, s, variant), tk.undo(cp, cg, cm, cv, s, variant),
                tk.undo_redo(cp, cm, cv, cg, s, cg2, s2, variant)]
        original = torch.Tensor.contiguous

        def no_copies(t, *args, **kwargs):
            assert t.is_contiguous(*args, **kwargs), "a block tensor was copied"
            return original(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "contiguous", no_copies)
        got = [tk.step(p, g, m, v, s, variant), tk.undo(p, g, m, v, s, variant),
               tk.undo_redo(p, m, v, g, s, g2, s2, variant)]
        for res, ref in zip(got, want):
            for a, b in zip(res, ref):
                assert a.stride() == p.stride() and torch.equal(a, b)
        res = tk.step_many([StepCall(p, g, m, v, s, (p, m, v))], variant)[0]
        assert all(a is b for a, b in zip(res, (p, m, v)))
        assert all(torch.equal(a, b) for a, b in zip((p, m, v), want[0]))

    @pytest.mark.parametrize("donate", [False, True])
    def test_adam_on_dense_layouts_in_triton(donate):
        """test_dense_layouts.py's Adam test on the Triton backend (its leaves in one multi-tensor launch)."""
        from test_dense_layouts import check_adam_on_dense_layouts
        check_adam_on_dense_layouts("triton", donate)

    @pytest.mark.parametrize("layout", ["transposed", "channels_last"])
    @pytest.mark.parametrize("donate", [False, True])
    def test_a_leaf_whose_gradient_has_another_layout_keeps_its_layout_in_triton(layout, donate):
        """test_dense_layouts.py's leaf with a contiguous gradient on the Triton backend: its results keep its
        layout, with the bits of the same calls on contiguous leaves."""
        from test_dense_layouts import check_a_gradient_of_another_layout
        check_a_gradient_of_another_layout("triton", layout, donate)

    @pytest.mark.parametrize("donate", [False, True])
    def test_a_checked_step_of_a_dense_layout_in_triton_keeps_the_chunks_of_its_memory(donate, monkeypatch):
        """test_dense_layouts.py's checked step of a transposed leaf on the Triton backend: checked in the kernel
        over the leaf's memory, its flagged memory chunks kept, undone and redone."""
        from test_dense_layouts import check_checked_step_of_a_dense_layout
        check_checked_step_of_a_dense_layout("transposed", "triton", torch.float32, donate, monkeypatch)

    @pytest.mark.parametrize("donate", [False, True])
    def test_an_undo_redo_of_a_dense_leaf_whose_record_has_another_layout_in_triton(donate):
        """test_dense_layouts.py's undo+redo of a transposed leaf whose record's gradient is contiguous, on the
        Triton backend: checked before the step (not in the kernel as its memory), undo then update's bits."""
        from test_dense_layouts import check_undo_redo_of_a_record_of_another_layout
        check_undo_redo_of_a_record_of_another_layout("triton", donate, True)

    def test_a_first_step_from_init_keeps_no_snapshot_in_triton(rng):
        """A leaf's first step from init (every v 0, undone by zeroing the moments): the checked step flags
        nothing, the record keeps nothing and its undo gives the init state back."""
        import sofx
        opt = sofx.adamw(lr=1e-2, backend="triton")
        params = {"a": torch.randn(2 * FINITE_CHUNK + 100, generator=rng), "b": torch.randn(300, generator=rng)}
        grads = {k: torch.randn(p.shape, generator=rng) for k, p in params.items()}
        init = opt.init(params)
        p1, s1, rec = opt.update(sofx.tree.tree_map(torch.clone, params), grads, init, donate=True)
        assert rec.strategies() == ["algebraic", "algebraic"] and rec.snapshot_bytes() == 0
        assert all(leaf.moments_were_zero for leaf in rec.leaves)
        _, s0 = opt.undo(p1, s1, rec)
        assert all(not bool(t.any()) for t in sofx.tree.flatten((s0.mu, s0.nu, s0.count))[0])

    @pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-fp32"])
    @pytest.mark.parametrize("donate", [False, True])
    @settings(max_examples=5, deadline=None)
    @given(undoable=st.booleans(), c=first_steps())
    def test_the_redo_of_a_first_step_is_fused_in_triton(p_dtype, donate, undoable, c):
        """test_adam_undo.py's check_first_step_redone_fused on the Triton backend."""
        check_first_step_redone_fused("triton", p_dtype, donate, undoable, c)

    @pytest.mark.parametrize("donate", [False, True])
    @settings(max_examples=5, deadline=None)
    @given(c=kept_parameter_redos())
    def test_the_redo_of_a_leaf_keeping_its_parameter_is_fused_in_triton(donate, c):
        """test_adam_undo.py's check_kept_parameter_redone_fused on the Triton backend."""
        check_kept_parameter_redone_fused("triton", donate, c)

    @pytest.mark.parametrize("donations", CHAIN_DONATIONS)
    def test_a_chain_of_undo_redos_keeps_every_record_intact_in_triton(donations):
        """test_adam_undo.py's check_records_intact_through_a_chain on the Triton backend."""
        check_records_intact_through_a_chain("triton", donations)

    @pytest.mark.parametrize("has_p_old", [False, True])
    @pytest.mark.parametrize("dtypes", DTYPES[:3], ids=["fp32", "bf16-fp32", "bf16"])
    def test_checked_undo_redo_flags_its_redo_against_the_undone_moments(dtypes, has_p_old, rng):
        """A checked undo+redo flags the chunks where the new gradient is beyond the limit or its step from the
        undone moments is too lossy (lossy_elements' redo form; L2 mode, the parameter before the undone step
        from p_old where given), and equals the unchecked undo+redo elsewhere."""
        variant = AdamVariant(decoupled=False)
        n = 2 * FINITE_CHUNK + 417
        p, g_old, m, v = block_inputs(rng, n, *dtypes, sound=True)
        s_old = block_scalars(rng, 0.1, 0.5)
        p_old = p.clone() if has_p_old else None
        p1, m1, v1 = reference.step(p, g_old, m, v, s_old, variant)
        g_new = torch.randn(n, generator=rng).to(p.dtype)
        g_new[FINITE_CHUNK + 11] = 1000.0  # the middle chunk: lossy
        g_new[n - 1] = float("nan")  # the last: not finite
        s_new = block_scalars(rng, 0.1, 0.25)._replace(step=s_old.step)
        base = p_old if has_p_old else p1
        want_flags = _chunk_any(beyond_limit(g_new, s_new.grad_scale)
                                | lossy_elements(base, g_new, v1, s_new, False, g_old, s_old, m=m1))
        assert want_flags == [0, 1, 1]
        plain = tk.undo_redo(p1, m1, v1, g_old, s_old, g_new, s_new, variant, p_old=p_old)
        skip = torch.zeros(3, dtype=torch.uint8)
        pp, mm, vv = p1.clone(), m1.clone(), v1.clone()
        tk.undo_redo_many([UndoRedoCall(pp, mm, vv, g_old, s_old, g_new, s_new, p_old, (pp, mm, vv), None, skip)],
                          variant)
        assert skip.tolist() == want_flags
        keep = (skip == 0).repeat_interleave(FINITE_CHUNK)[:n]
        for got, fresh, old in zip((pp, mm, vv), plain, (p1, m1, v1)):
            assert torch.equal(got[keep], fresh[keep]) and torch.equal(got[~keep], old[~keep])

    def test_checked_blocks_in_one_launch_equal_one_call_per_block(rng, monkeypatch):
        """Checked blocks launched together (the multi-tensor kernel, their flags views of one buffer at odd
        offsets) give the flags and bits of one checked call per block; unchecked blocks beside them too."""
        launches = _count_multi_launches(monkeypatch)
        variant = AdamVariant()
        sizes = (FINITE_CHUNK + 16, 32, 3 * FINITE_CHUNK, 2 * FINITE_CHUNK + 48)
        blocks = [_planted(rng, n, DTYPES[0], [("spike", n - 20)] if i % 2 else []) for i, n in enumerate(sizes)]
        s = block_scalars(rng, 0.1)
        chunks = [-(-n // FINITE_CHUNK) for n in sizes]
        flags = torch.zeros(sum(chunks) + 1, dtype=torch.uint8)
        views, at = [], 1  # (from offset 1: not aligned)
        for c in chunks:
            views.append(flags[at:at + c])
            at += c
        work = [tuple(t.clone() for t in b) for b in blocks]
        calls = [StepCall(p, g, m, v, s, (p, m, v), None, views[i] if i != 2 else None)
                 for i, (p, g, m, v) in enumerate(work)]
        tk.step_many(calls, variant)
        assert launches == [3]  # the three checked blocks; the unchecked one alone
        for i, (b, w) in enumerate(zip(blocks, work)):
            p, g, m, v = (t.clone() for t in b)
            own = torch.zeros(chunks[i], dtype=torch.uint8) if i != 2 else None
            tk.step_many([StepCall(p, g, m, v, s, (p, m, v), None, own)], variant)
            assert all(torch.equal(a, c) for a, c in zip((w[0], w[2], w[3]), (p, m, v))), i
            if own is not None:
                assert views[i].tolist() == own.tolist() and own.tolist()[-1] == i % 2, i
        assert flags[0] == 0

    def test_a_checked_call_with_scalars_that_cannot_be_read_is_refused_before_any_block_runs(rng):
        variant = AdamVariant()
        s = block_scalars(rng, 0.1)._replace(lr=torch.tensor(1e-3, requires_grad=True))
        blocks = [block_inputs(rng, 100, torch.float32, torch.float32) for _ in range(2)]
        before = [[t.clone() for t in b] for b in blocks]
        calls = [StepCall(p, g, m, v, s, (p, m, v)) for p, g, m, v in blocks]
        calls[1] = calls[1]._replace(skip=torch.zeros(1, dtype=torch.uint8))
        with pytest.raises(UnsupportedError, match=r"step_many\[1\]: a checked call needs scalars"):
            tk.step_many(calls, variant)
        assert all(torch.equal(a, b) for x, y in zip(blocks, before) for a, b in zip(x, y))

    def test_checked_calls_refuse_bad_flags_and_outputs(rng):
        variant = AdamVariant()
        p, g, m, v = block_inputs(rng, FINITE_CHUNK + 1, torch.float32, torch.float32)
        s = block_scalars(rng, 0.1)
        before = [t.clone() for t in (p, m, v)]
        for bad in (torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.uint8),
                    torch.zeros(4, dtype=torch.uint8)[::2]):
            with pytest.raises(LeafError, match=r"triton\.step_many\[0\]: skip must be a contiguous uint8 tensor "
                                                r"of shape \(2,\) on cpu"):
                tk.step_many([StepCall(p, g, m, v, s, (p, m, v), None, bad)], variant)
        strided = torch.empty(2 * p.numel())[::2]
        with pytest.raises(UnsupportedError, match=r"out\[0\] is not contiguous"):
            tk.step_many([StepCall(p, g, m, v, s, (strided, m, v), None, torch.zeros(2, dtype=torch.uint8))],
                         variant)
        assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))

    def _spiked_pair(rng, n):
        """``sofx.adamw`` on the triton and reference backends, params ``a`` (``n`` elements) and ``b`` with
        moments of 20 steps, and gradients with a 1000x spike in ``a``'s second chunk."""
        import sofx
        params = {"a": torch.randn(n, generator=rng), "b": torch.randn(300, generator=rng)}
        opts = [sofx.adamw(lr=1e-2, weight_decay=0.1, backend=b) for b in ("triton", "reference")]
        state = opts[0].init(params)
        for _ in range(20):
            params, state, _ = opts[1].update(params, {k: torch.randn(p.shape, generator=rng)
                                                       for k, p in params.items()}, state, undoable=False)
        grads = {k: torch.randn(p.shape, generator=rng) for k, p in params.items()}
        grads["a"][FINITE_CHUNK + 50] = 1e3
        return opts, params, state, grads

    def test_adam_checks_in_the_triton_step_without_a_pass_before(rng, monkeypatch):
        """sofx.adamw(backend="triton"): undo="auto" finds a spike in the checked step itself (the pass of
        torch operations before it, any_lossy, is not run) and keeps a snapshot of that chunk (the reference,
        testing before the step, of the leaf); the update and its undo are the reference backend's."""
        import sofx
        adam_module = sys.modules["sofx.adam"]  # (sofx.adam is the function)

        def no_pass(*args, **kwargs):
            raise AssertionError("the pass before the step ran")

        opts, params, state, grads = _spiked_pair(rng, FINITE_CHUNK + 100)
        monkeypatch.setattr(adam_module, "any_lossy", no_pass)
        got = opts[0].update(params, grads, state)
        monkeypatch.undo()
        want = opts[1].update(params, grads, state)
        assert got[2].strategies() == ["chunk_snapshot", "algebraic"] and got[2].leaves[0].chunks.tolist() == [1]
        assert want[2].strategies() == ["snapshot", "algebraic"]
        for a, b in zip(sofx.tree.flatten(got[:2])[0], sofx.tree.flatten(want[:2])[0]):
            assert torch.equal(a, b) if a.dtype == torch.int64 else max_rel_err(a, b) <= 1e-6
        undone = opts[0].undo(*got)
        for a, b in zip(sofx.tree.flatten(undone)[0], sofx.tree.flatten((params, state))[0]):
            if a.dtype == torch.int64:
                assert torch.equal(a, b)
            else:  # (the kept chunk bitwise, the rest undone algebraically)
                assert float((a - b).abs().max() / b.abs().max()) <= 1e-6
        for a, b in zip((undone[0]["a"], undone[1].mu["a"], undone[1].nu["a"]),
                        (params["a"], state.mu["a"], state.nu["a"])):
            assert torch.equal(a[FINITE_CHUNK:], b[FINITE_CHUNK:])

    @pytest.mark.parametrize("undoable", [True, False])
    def test_undo_redo_of_a_chunk_snapshot_in_triton(rng, undoable):
        """A chunk snapshot (a spike in the second of three chunks) redone with new gradients, one with an inf
        in the first chunk: fused calls over the chunks not kept, a step from the kept one; the result is the
        reference's undo then update, and its record (undoable) undoes to the reference's undone state."""
        import sofx
        opts, params, state, grads = _spiked_pair(rng, 2 * FINITE_CHUNK + 100)
        new = {k: torch.randn(p.shape, generator=rng) for k, p in params.items()}
        new["a"][7] = float("inf")
        p1, s1, rec = opts[0].update(params, grads, state)
        assert rec.strategies() == ["chunk_snapshot", "algebraic"]
        undone = opts[1].undo(*opts[1].update(params, grads, state))
        want = opts[1].update(undone[0], new, undone[1], grads_finite=True, undoable=False)
        got = opts[0].undo_redo(p1, s1, rec, new, donate=True, undoable=undoable)
        for a, b in zip(sofx.tree.flatten(got[:2])[0], sofx.tree.flatten(want[:2])[0]):
            if a.dtype == torch.int64:
                assert torch.equal(a, b)
                continue
            fin = torch.isfinite(b)  # (DESIGN.md's 1e-6 of the tensor: an undo's cancellation, elementwise)
            assert torch.equal(fin, torch.isfinite(a))
            assert float((a[fin] - b[fin]).abs().max() / b[fin].abs().max()) <= 1e-6
        if undoable:
            assert got[2].strategies() == ["chunk_snapshot", "algebraic"] and got[2].leaves[0].chunks.tolist() == [0]
            back = opts[0].undo(*got)
            for a, b in zip(sofx.tree.flatten(back)[0], sofx.tree.flatten(undone)[0]):
                assert torch.equal(a, b) if a.dtype == torch.int64 else \
                    float((a - b).abs().max() / b.abs().max()) <= 1e-6
            own = opts[0].undo(*opts[0].update(params, grads, state))  # the chunk kept: Triton's own undo, bitwise
            for a, b in zip((back[0]["a"], back[1].mu["a"], back[1].nu["a"]),
                            (own[0]["a"], own[1].mu["a"], own[1].nu["a"])):
                assert torch.equal(a[:FINITE_CHUNK], b[:FINITE_CHUNK])

    def _numbers_only(n, ptrs, sizes):
        """A block's operands as the launcher's host side reads them: its numbers, no tensors (so a block of
        2^31 elements or more costs nothing here)."""
        return tk._Operands(arrays=(), ptrs=tuple(ptrs), sizes=tuple(sizes), n=n, targets=[], pc=None, out=None,
                            p_copy=None, layout=(), aligned=False)

    @pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
    def test_the_launch_table_holds_counts_and_offsets_beyond_2_31_in_int64(check):
        """The multi-tensor kernel's table (_table): element counts of 2^31 and more, their program counts and
        first programs, and offsets between blocks of more than 2^32 elements, below the first block's addresses
        too, exactly, as int64; the launch's programs within the grid's 2^31 - 1."""
        slots = len(tk._ROW_SLOTS)
        sizes = [4] * (slots - 1) + [1]  # float32 tensors, one byte per flag
        base = [0x7F00_0000_0000 + (i << 40) for i in range(slots)]
        counts = [2**31 + 5, 3 * 2**31 + 1024, 7, 2**31 - 1]
        shifts = [0, -(2**36) - 4096, 2**35 + 64, 2**33]  # bytes from the first block's addresses
        group = [_numbers_only(n, [b + d for b in base], sizes) for n, d in zip(counts, shifts)]
        table, programs = tk._table(group, check)
        assert table.dtype == np.int64 and table.shape == (len(counts), tk._ROW_WIDTH + 1)
        each = [-(-n // (tk.CHECK_BLOCK if check else tk.BLOCK)) for n in counts]
        assert table[:, 0].tolist() == [sum(each[:i]) for i in range(len(each))]
        assert table[:, 1].tolist() == counts and table[:, tk._ROW_WIDTH].tolist() == each
        for row, d in zip(table, shifts):
            assert row[2:2 + slots].tolist() == [d // size for size in sizes]
        assert programs == sum(each) < 2**31 - 1

    def test_the_flat_launches_of_blocks_of_2_31_elements_and_more():
        """The flat kernel's launches (_flat_launches, numbers only): the 16-multiple head and the rest for a
        block of 2^31 elements and more, a checked block's last partial chunk on its own (from a chunk's first
        element, so its flags from that chunk's); programs of BLOCK elements, within the grid's 2^31 - 1."""
        big = 2**31 + 17
        assert tk._flat_launches(big, False) == [(0, 2**31 + 16, 2**21 + 1), (2**31 + 16, 1, 1)]
        assert tk._flat_launches(big, True) == [(0, 2**31, 2**21), (2**31, 17, 1)]
        assert tk._flat_launches(2**32, False) == tk._flat_launches(2**32, True) == [(0, 2**32, 2**22)]
        assert tk._flat_launches(2**32 + 48, True) == [(0, 2**32 + 48, 2**22 + 1)]
        for n in (2**31 - 1, 2**31, 2**31 + 1, 3 * 2**31 + 1029):
            for check in (False, True):
                launches = tk._flat_launches(n, check)
                assert sum(c for _, c, _ in launches) == n and launches[0][0] == 0
                assert all(0 <= p * tk.BLOCK - c < tk.BLOCK and p < 2**31 - 1 for _, c, p in launches)
                assert all(start % (tk.CHECK_BLOCK if check else 16) == 0 for start, _, _ in launches)

    BLOCK_ROLES = ("p", "g", "m", "v", "g2", "p_old", "out[0]", "out[1]", "out[2]", "p_copy")

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
    def test_a_block_is_aligned_for_the_multi_tensor_kernel_only_where_every_address_is_16_elements_aligned(
            dtype, rng):
        """The multi-tensor kernel's ALIGNED (tl.multiple_of(.., 16) on the count and on every offset between
        blocks' addresses, in elements) is claimed only for blocks whose count is a multiple of 16 and whose every
        tensor the kernel addresses (inputs, old values, new gradient, outputs, copy) starts at a multiple of 16
        elements: a view 16 bytes but not 16 elements in (a bfloat16 one 8 elements in, a float32 one 4) is not;
        the flags of a checked call, one byte a chunk, may be at any address."""
        n = 64

        def at(k, count=n):
            return torch.randn(count + 32, generator=rng).to(dtype)[k:k + count]

        def block(role=None, k=0, count=n, skip=None):
            t = {r: at(k if r == role else 0, count) for r in BLOCK_ROLES}
            return tk._operands(t["p"], t["g"], t["m"], t["v"], t["g2"], t["p_old"],
                                (t["out[0]"], t["out[1]"], t["out[2]"]), t["p_copy"], skip)

        assert block().aligned and block(k=16).aligned
        size = torch.empty(0, dtype=dtype).element_size()
        for role in BLOCK_ROLES:
            for k in (1, 16 // size, 8):
                assert not block(role, k).aligned, (role, k)
            assert block(role, 16).aligned, role
        assert not block(count=n + 8).aligned
        flags = torch.zeros(8, dtype=torch.uint8)
        assert block(skip=flags[3:4]).aligned

    def test_the_large_block_check_of_the_cuda_tests_passes_on_a_small_block(monkeypatch):
        """helpers.check_a_large_triton_step, which tests/test_triton_cuda.py runs on 2^31 + 3077 elements
        around element 2^31, on 6149 elements around element 3072 under the interpreter."""
        check_a_large_triton_step("cpu", 6 * tk.BLOCK + 5, 3 * tk.BLOCK, monkeypatch)

    def test_selection_under_the_interpreter():
        assert tk.supports("cpu", torch.float32, torch.float32)
        assert not tk.supports("cpu", torch.float64, torch.float64)
        assert select_backend("triton", "cpu", torch.bfloat16, torch.float32) is tk
        assert select_backend("auto", "cpu", torch.float32, torch.float32).NAME == "cpu"
