"""Reference Adam kernels: plain torch, every variant, the readable specification.

Every faster backend is tested against this module. It follows
``torch.optim.Adam/AdamW`` (``foreach=False``) operation by operation, so that
with float hyperparameters its results are those of ``torch.optim`` bit for
bit, and it is differentiable and ``vmap``-able when the inputs or the
hyperparameters are tensors under a ``torch.func`` transform.

Per element, with ``t = s.step``, ``g = g * grad_scale`` and hparams of step ``t``::

    L2:        g = g + wd * p                 decoupled: p = p * (1 - lr * wd)
    m' = lerp(m, g, 1 - b1)   (= b1*m + (1-b1)*g)
    v' = b2 * v + (1 - b2) * g * g
    bc1 = 1 - b1**t, bc2 = 1 - b2**t          (1 and 1 without bias correction)
    u  = ((lr / bc1) * m') / (sqrt(v') / sqrt(bc2) + eps)
    p' = p - u

Inverse (SPECULATION.md section 2): recompute ``u`` from ``m', v'`` with the
same operations (bit-identical), ``p = p' + u`` (divided by ``1 - lr*wd`` when
decoupled), ``gh = g`` (decoupled) or ``g + wd*p`` (L2),
``m = (m' - (1-b1)*gh) / b1``, ``v = (v' - ((1-b2)*gh)*gh) / b2`` (the step's own
rounding of its term, so that moments that were exactly 0 come back exactly 0)
clamped at 0 with nan kept as nan.

``weight_decay == 0`` means no decay term at all (not a multiplication by 1).
"""

from __future__ import annotations

from typing import Sequence

import torch

from sofx.errors import UnsupportedError
from sofx.kernels.base import (
    AdamScalars,
    AdamVariant,
    Scalar,
    StepCall,
    Triple,
    UndoCall,
    UndoRedoCall,
    any_traced,
    bias_corrections,
    check_block_tensors,
    compute_dtype,
    concrete_scalars,
    is_number,
    refuse_checked_steps,
    write_param_copy,
)
from sofx.kernels.donation import refuse_shared_memory

Out = "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None"

__all__ = ["step", "undo", "undo_redo", "step_many", "undo_many", "undo_redo_many", "supports", "bias_corrections",
           "NAME", "CHECKS_FINITE"]

NAME = "reference"
CHECKS_FINITE = False  # no checked calls (skip)


def supports(device: torch.device | str, param_dtype: torch.dtype, state_dtype: torch.dtype) -> bool:
    """The reference backend runs on any device and any floating dtype."""
    return param_dtype.is_floating_point and state_dtype.is_floating_point


def _has_decay(wd: Scalar) -> bool:
    """Whether a decay term exists: a nonzero number, or any tensor (masked below)."""
    return not is_number(wd) or wd != 0


def _axpy(y: torch.Tensor, x: torch.Tensor, alpha: Scalar) -> torch.Tensor:
    """``y + alpha * x`` as torch.optim computes it (``add(alpha=)`` for numbers)."""
    if is_number(alpha):
        return y.add(x, alpha=alpha)
    return y + alpha * x


def _wd_mask(wd: Scalar, with_decay: torch.Tensor, without: torch.Tensor) -> torch.Tensor:
    """For a tensor ``wd``: the decayed value where ``wd != 0``, else the value untouched."""
    if is_number(wd):
        return with_decay
    return torch.where(torch.as_tensor(wd) != 0, with_decay, without)


def _cast(x: Scalar, dtype: torch.dtype) -> Scalar:
    return x.to(dtype) if isinstance(x, torch.Tensor) else x


def _update_direction(m: torch.Tensor, v: torch.Tensor, s: AdamScalars, variant: AdamVariant) -> torch.Tensor:
    """``u = ((lr/bc1) * m) / (sqrt(v)/sqrt(bc2) + eps)``, the amount subtracted from ``p``.

    The operation order of ``addcdiv`` (``value * t1 / t2``), so that the inverse
    recomputes exactly the ``u`` the step subtracted.
    """
    step_size, bc2_sqrt = bias_corrections(s, variant)
    cd = m.dtype
    denom = (v.sqrt() / _cast(bc2_sqrt, cd)) + _cast(s.eps, cd)
    return (m * _cast(step_size, cd)) / denom


def _effective_grad(g: torch.Tensor, s: AdamScalars, cd: torch.dtype) -> torch.Tensor:
    g = g.to(cd)
    if is_number(s.grad_scale) and s.grad_scale == 1:
        return g
    return g * _cast(s.grad_scale, cd)


def _store(results: tuple[torch.Tensor, torch.Tensor, torch.Tensor], like: tuple[torch.Tensor, ...],
           out: Out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round results to the dtypes of ``like`` and write them into ``out`` if given (an ``out`` of another dtype
    gets the rounded value, as from the other backends: ``p'`` is in ``p``'s dtype)."""
    if out is None:
        return tuple(r.to(l.dtype) for r, l in zip(results, like))  # type: ignore[return-value]
    for r, o, l in zip(results, out, like):
        o.copy_(r if o.dtype == l.dtype else r.to(l.dtype))
    return out  # type: ignore[return-value]


def _step_math(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               s: AdamScalars, variant: AdamVariant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cd = compute_dtype(p)
    # Plain tensors: update freshly made temporaries in place (three outputs and one
    # temporary, as torch.optim). Under autograd or torch.func: out-of-place ops only.
    inplace = not any_traced((p, g, m, v, *s))
    p = p.to(cd)
    g = _effective_grad(g, s, cd)
    m = m.to(cd)
    v = v.to(cd)
    wd = _cast(s.weight_decay, cd)
    p_is_fresh = False
    if _has_decay(wd):
        if variant.decoupled:
            p = _wd_mask(wd, p * (1 - _cast(s.lr, cd) * wd), p)
            p_is_fresh = True
        else:
            g = _wd_mask(wd, _axpy(g, p, wd), g)
    one_minus_b1 = 1 - _cast(s.beta1, cd)
    m = m.lerp(g, one_minus_b1)
    b2 = _cast(s.beta2, cd)
    if is_number(b2):
        v = v.mul(b2)
        v = v.addcmul_(g, g, value=1 - b2) if inplace else v.addcmul(g, g, value=1 - b2)
    else:
        v = v * b2 + (1 - b2) * (g * g)
    step_size, bc2_sqrt = bias_corrections(s, variant)
    if is_number(step_size) and is_number(bc2_sqrt) and is_number(s.eps):
        # torch.optim's exact operations (addcdiv may fuse the multiply-add).
        if inplace:
            denom = v.sqrt().div_(bc2_sqrt).add_(s.eps)
            p = p.addcdiv_(m, denom, value=-step_size) if p_is_fresh else p.addcdiv(m, denom, value=-step_size)
        else:
            p = p.addcdiv(m, (v.sqrt() / bc2_sqrt).add(s.eps), value=-step_size)
    else:
        p = p - _update_direction(m, v, s, variant)
    return p, m, v


def step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, out: Out = None,
         p_copy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Adam step; returns ``(p', m', v')`` in the dtypes of ``p, m, v`` (``p_copy``: also ``p'``)."""
    c = StepCall(p, g, m, v, s, out, p_copy)
    s = _checked_step(c, variant, f"{NAME}.step")
    refuse_shared_memory([c], [f"{NAME}.step"])
    return _step_block(p, g, m, v, s, variant, out, p_copy)


def _step_block(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
                variant: AdamVariant, out: Out, p_copy: torch.Tensor | None) -> Triple:
    """:func:`step` of a block already checked (``s``: its checked scalars)."""
    results = _store(_step_math(p, g, m, v, s, variant), (p, m, v), out)
    write_param_copy(p_copy, results[0])
    return results


def _checked_step(c: StepCall, variant: AdamVariant, where: str) -> AdamScalars:
    """``c``'s tensors checked and its scalars checked (as ``variant`` steps: its step size) and concrete
    (``where`` names the call in errors)."""
    check_block_tensors(where, [("p", c.p), ("g", c.g), ("m", c.m), ("v", c.v), ("p_copy", c.p_copy)], c.p, c.out,
                        autograd=True)
    return concrete_scalars(c.s, where, compute_dtype(c.p) == torch.float64, variant.bias_correction)


def _checked_undo(c: UndoCall, variant: AdamVariant, where: str) -> AdamScalars:
    """``c``'s tensors and scalars checked (:func:`_checked_step`), the scalars also as an undo's."""
    check_block_tensors(where, [("p", c.p), ("g", c.g), ("m", c.m), ("v", c.v), ("p_old", c.p_old),
                                ("p_copy", c.p_copy)], c.p, c.out, autograd=True)
    s = concrete_scalars(c.s, where, compute_dtype(c.p) == torch.float64, variant.bias_correction)
    _check_invertible(s, variant, c.p_old is not None, where)
    return s


def _checked_undo_redo(c: UndoRedoCall, variant: AdamVariant, where: str) -> tuple[AdamScalars, AdamScalars]:
    """``c``'s tensors and both scalars checked, ``s_old`` as an undo's: ``(s_old, s_new)`` concrete."""
    check_block_tensors(where, [("p", c.p), ("m", c.m), ("v", c.v), ("g_old", c.g_old), ("g_new", c.g_new),
                                ("p_old", c.p_old), ("p_copy", c.p_copy)], c.p, c.out, autograd=True)
    float64 = compute_dtype(c.p) == torch.float64
    s_old = concrete_scalars(c.s_old, where, float64, variant.bias_correction)
    _check_invertible(s_old, variant, c.p_old is not None, where)
    return s_old, concrete_scalars(c.s_new, where, float64, variant.bias_correction)


def _check_invertible(s: AdamScalars, variant: AdamVariant, restoring_param: bool, where: str) -> None:
    """Refuse scalars whose step has no algebraic inverse (``restoring_param``: p comes from ``p_old``)."""
    for name in ("beta1", "beta2"):
        b = getattr(s, name)
        if is_number(b) and b == 0:
            raise UnsupportedError(f"{where}: algebraic undo is impossible with {name} == 0: the old moment leaves "
                                   "no trace")
    if variant.decoupled and not restoring_param and is_number(s.lr) and is_number(s.weight_decay):
        if s.lr * s.weight_decay == 1:
            raise UnsupportedError(f"{where}: algebraic undo is impossible with lr * weight_decay == 1 (decoupled "
                                   "decay)")


def concrete_checked(scalars: Sequence[AdamScalars | None], variant: AdamVariant | None = None,
                     restoring_param: Sequence[bool] | None = None,
                     where: Sequence[str] | None = None,
                     float64: Sequence[bool] | None = None,
                     bias_correction: bool = False) -> list[AdamScalars | None]:
    """:func:`concrete_scalars` of each of a list form's scalars (None stays None), once per object (a
    group's blocks share theirs); with ``variant``, each checked as an undo's (``restoring_param[i]``: block
    ``i`` restores p from ``p_old``). ``where[i]`` names block ``i`` in errors; ``float64[i]``: block ``i``
    is stepped in float64 (default: none is); ``bias_correction``: the variant's (the step size is checked:
    :func:`~sofx.kernels.base.check_step_size`)."""
    done: dict[tuple[int, bool, bool], AdamScalars] = {}
    out: list[AdamScalars | None] = []
    for i, s in enumerate(scalars):
        if s is None:
            out.append(None)
            continue
        restoring = restoring_param[i] if restoring_param is not None else False
        wide = float64[i] if float64 is not None else False
        key = (id(s), restoring, wide)  # the caller's list holds the objects
        if key not in done:
            done[key] = concrete_scalars(s, where[i] if where is not None else f"block {i}", wide, bias_correction)
            if variant is not None:
                _check_invertible(done[key], variant, restoring, where[i] if where is not None else f"block {i}")
        out.append(done[key])
    return out


def _undo_math(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
               variant: AdamVariant, p_old: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cd = compute_dtype(p)
    g = _effective_grad(g, s, cd)
    m = m.to(cd)
    v = v.to(cd)
    wd = _cast(s.weight_decay, cd)
    if p_old is not None:
        p0 = p_old.to(cd)
    else:
        p0 = p.to(cd) + _update_direction(m, v, s, variant)
        if variant.decoupled and _has_decay(wd):
            p0 = _wd_mask(wd, p0 / (1 - _cast(s.lr, cd) * wd), p0)
    gh = g
    if not variant.decoupled and _has_decay(wd):
        gh = _wd_mask(wd, _axpy(g, p0, wd), g)
    b1 = _cast(s.beta1, cd)
    b2 = _cast(s.beta2, cd)
    m0 = (m - (1 - b1) * gh) / b1
    # the step's own rounding of its (1 - b2) gh^2 term (addcmul's ((1 - b2) gh) gh; with tensor betas (1 - b2)
    # (gh gh)): moments that were exactly 0 come back exactly 0 (base.py's LOSSY_V_RATIO)
    term = ((1 - b2) * gh) * gh if is_number(b2) else (1 - b2) * (gh * gh)
    v0 = (v - term) / b2
    v0 = torch.where(v0 < 0, torch.zeros_like(v0), v0)  # clamp at 0, nan stays nan
    return p0, m0, v0


def undo(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
         variant: AdamVariant, *, p_old: torch.Tensor | None = None, out: Out = None,
         p_copy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`step` given the step's gradient ``g`` and scalars ``s``.

    Raises :class:`~sofx.errors.UnsupportedError` where the inverse does not
    exist (a beta of 0, decoupled ``lr*wd == 1`` without ``p_old``).
    """
    c = UndoCall(p, g, m, v, s, p_old, out, p_copy)
    s = _checked_undo(c, variant, f"{NAME}.undo")
    refuse_shared_memory([c], [f"{NAME}.undo"])
    return _undo_block(p, g, m, v, s, variant, p_old, out, p_copy)


def _undo_block(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars,
                variant: AdamVariant, p_old: torch.Tensor | None, out: Out, p_copy: torch.Tensor | None) -> Triple:
    """:func:`undo` of a block already checked (``s``: its checked scalars)."""
    results = _store(_undo_math(p, g, m, v, s, variant, p_old), (p, m, v), out)
    write_param_copy(p_copy, results[0])
    return results


def undo_redo(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g_old: torch.Tensor, s_old: AdamScalars,
              g_new: torch.Tensor, s_new: AdamScalars, variant: AdamVariant, *,
              p_old: torch.Tensor | None = None, out: Out = None,
              p_copy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Undo the step taken with ``(g_old, s_old)`` and redo it with ``(g_new, s_new)``.

    The intermediate (undone) values are rounded to the storage dtypes, as if
    ``undo`` and ``step`` had been called one after the other.
    """
    c = UndoRedoCall(p, m, v, g_old, s_old, g_new, s_new, p_old, out, p_copy)
    scalars = _checked_undo_redo(c, variant, f"{NAME}.undo_redo")
    refuse_shared_memory([c], [f"{NAME}.undo_redo"])
    return _undo_redo_block(c, *scalars, variant)


def _undo_redo_block(c: UndoRedoCall, s_old: AdamScalars, s_new: AdamScalars, variant: AdamVariant) -> Triple:
    """:func:`undo_redo` of a block already checked (``s_old``, ``s_new``: its checked scalars)."""
    p0, m0, v0 = _undo_block(c.p, c.g_old, c.m, c.v, s_old, variant, c.p_old, None, None)
    results = _store(_step_math(p0, c.g_new, m0, v0, s_new, variant), (c.p, c.m, c.v), c.out)
    write_param_copy(c.p_copy, results[0])
    return results


# The list forms: every block checked (tensors, scalars, inverses, the memory written) before any is computed,
# then the one-block math per block. No checked steps (skip).
def step_many(calls: Sequence[StepCall], variant: AdamVariant) -> list[Triple]:
    """:func:`step` for each block (the kernel contract's list form)."""
    refuse_checked_steps(calls, f"{NAME}.step_many")
    scalars = [_checked_step(c, variant, f"{NAME}.step_many[{i}]") for i, c in enumerate(calls)]
    refuse_shared_memory(calls, _names("step_many", calls))
    return [_step_block(c.p, c.g, c.m, c.v, s, variant, c.out, c.p_copy) for c, s in zip(calls, scalars)]


def undo_many(calls: Sequence[UndoCall], variant: AdamVariant) -> list[Triple]:
    """:func:`undo` for each block."""
    scalars = [_checked_undo(c, variant, f"{NAME}.undo_many[{i}]") for i, c in enumerate(calls)]
    refuse_shared_memory(calls, _names("undo_many", calls))
    return [_undo_block(c.p, c.g, c.m, c.v, s, variant, c.p_old, c.out, c.p_copy) for c, s in zip(calls, scalars)]


def undo_redo_many(calls: Sequence[UndoRedoCall], variant: AdamVariant) -> list[Triple]:
    """:func:`undo_redo` for each block."""
    refuse_checked_steps(calls, f"{NAME}.undo_redo_many")
    scalars = [_checked_undo_redo(c, variant, f"{NAME}.undo_redo_many[{i}]") for i, c in enumerate(calls)]
    refuse_shared_memory(calls, _names("undo_redo_many", calls))
    return [_undo_redo_block(c, *ss, variant) for c, ss in zip(calls, scalars)]


def _names(fn: str, calls: Sequence) -> list[str]:
    """How errors name each block of a list form: ``"reference.step_many[3]"``."""
    return [f"{NAME}.{fn}[{i}]" for i in range(len(calls))]
