"""The facade's constructor arguments side by side with ``torch.optim.AdamW``'s: what torch accepts is accepted,
stored as torch stores it and trains as torch trains; what torch refuses is refused, with an error naming the
argument."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import sofx.offload

from helpers import max_rel_err

STEPS = 5


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _train_torch(**kwargs) -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    """torch.optim.AdamW(**kwargs) over a tiny model for STEPS steps: the optimizer and the parameters."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return opt, [p.detach().clone() for p in model.parameters()]


def _train_facade(**kwargs) -> tuple[dict, list[torch.Tensor]]:
    """The facade, as :func:`_train_torch`: its first group (a copy) and the parameters."""
    model = _model()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", **kwargs) as opt:
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(step)
            opt.backward(((model(x) - y) ** 2).mean())
            opt.step()
        group = dict(opt.param_groups[0])
    return group, [p.detach().clone() for p in model.parameters()]


def _assert_same_values(got, want) -> None:
    """``got`` holds what ``want`` (torch's stored value) holds: the same types, tensor shapes and values."""
    assert type(got) is type(want)
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same_values(a, b)
    elif isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
    else:
        assert got == want


def _assert_same_trajectory(got: list[torch.Tensor], want: list[torch.Tensor], bitwise: bool) -> None:
    """Bitwise, or (torch computing with a float32 tensor hparam where the facade takes its value as a Python
    float) to float32 rounding, relative 1e-6 per step."""
    for a, b in zip(got, want):
        assert torch.equal(a, b) if bitwise else max_rel_err(a, b) <= 1e-6 * STEPS


@pytest.mark.parametrize("betas", [
    pytest.param(lambda: (torch.tensor([0.8]), torch.tensor([[0.99]])), id="1-element tensors"),
    pytest.param(lambda: torch.tensor([0.8, 0.99]), id="a 2-element tensor"),
    pytest.param(lambda: np.array([0.8, 0.99]), id="a float64 numpy array"),
    pytest.param(lambda: [np.float64(0.8), np.float64(0.99)], id="numpy float64s in a list"),
])
def test_betas_torch_accepts_are_stored_as_torch_stores_them_and_train_as_torch(betas):
    """torch.optim.AdamW takes ``betas`` as anything it can index twice whose items are both floats or both
    1-element tensors, and stores ``tuple(map(_to_scalar, betas))``: a 1-element tensor squeezed to 0-d. The
    facade kept 1-element tensors as given (``tensor([0.8])`` in the group where torch has ``tensor(0.8)``) and
    refused a 2-element tensor or numpy array, which torch takes as the pair."""
    torch_opt, want = _train_torch(lr=1e-2, betas=betas())
    group, got = _train_facade(lr=1e-2, betas=betas())
    _assert_same_values(group["betas"], torch_opt.param_groups[0]["betas"])
    _assert_same_trajectory(got, want, bitwise=not isinstance(group["betas"][0], torch.Tensor))


@pytest.mark.parametrize("kwargs", [
    pytest.param({"lr": torch.tensor(3e-3)}, id="lr"),
    pytest.param({"betas": (torch.tensor(0.8), torch.tensor(0.95))}, id="betas"),
])
def test_tensor_hparams_step_bitwise_as_torch_with_the_floats_they_hold(kwargs):
    """A tensor ``lr`` or tensor ``betas`` is read as the Python floats it holds: the facade's trajectory is
    torch.optim.AdamW's with those floats bit for bit (torch's own for-loop step with the tensors computes
    ``1 - beta``, the bias corrections and ``lr / bias_correction1`` in float32, ~1e-8 apart after a few steps)."""
    floats = {k: tuple(float(b) for b in v) if isinstance(v, tuple) else float(v) for k, v in kwargs.items()}
    _, want = _train_torch(foreach=False, **floats)
    _, got = _train_facade(**kwargs)
    _assert_same_trajectory(got, want, bitwise=True)


@pytest.mark.parametrize("betas, found", [
    pytest.param((0, 0.99), "int, float", id="an int"),
    pytest.param((torch.tensor(0.8), 0.99), "Tensor, float", id="a tensor and a float"),
    pytest.param((np.float32(0.8), np.float32(0.99)), "float32, float32", id="numpy float32s"),
    pytest.param(np.array([0.8, 0.99], dtype=np.float32), "float32, float32", id="a float32 numpy array"),
])
def test_betas_torch_refuses_are_refused_naming_what_it_takes(betas, found):
    """torch.optim.AdamW's constructor refuses betas that are not both floats (a Python or numpy float64) nor
    both tensors -- an int, numpy's float32, a tensor beside a float -- with a ValueError; the facade took them,
    so code tried on it failed on torch. Refused before anything is made (the model's parameters keep no hooks)."""
    model = _model()
    with pytest.raises(ValueError):
        torch.optim.AdamW(model.parameters(), betas=betas)
    with pytest.raises(sofx.HParamError, match=rf"betas must be both floats or both tensors.*got {found}"):
        sofx.offload.SpeculativeAdamW(model.parameters(), betas=betas, executor="inline")
    _assert_left_working(model)


def _assert_left_working(model: torch.nn.Module) -> None:
    """A refused constructor left nothing behind: a new optimizer over ``model`` steps every parameter."""
    before = [p.detach().clone() for p in model.parameters()]
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
        x, y = _batch(0)
        opt.backward(((model(x) - y) ** 2).mean())
        assert not opt.step().skipped
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("kwargs, what", [
    pytest.param({"lr": torch.tensor(1e-2)}, r"\['lr'\]", id="lr"),
    pytest.param({"betas": (torch.tensor(0.8), torch.tensor(0.99))}, r"\['betas'\]\[0\]", id="betas"),
])
def test_a_tensor_hparam_with_foreach_and_without_capturable_is_refused_as_torch_refuses_it(kwargs, what):
    """torch.optim.AdamW refuses a tensor lr or beta with ``foreach=True`` and ``capturable=False`` ("not
    supported for capturable=False and foreach=True"): at construction, and at a step for a group set so later.
    The facade ignored foreach and took it. With foreach False or None both take it (and torch's constructor with
    ``capturable=True``, whose step takes no CPU parameters: see the capturable test below)."""
    model = _model()
    with pytest.raises(ValueError, match="foreach=True"):
        torch.optim.AdamW(model.parameters(), foreach=True, **kwargs)
    with pytest.raises(sofx.UnsupportedError, match=rf"defaults{what} is a tensor.*foreach=True.*capturable"):
        sofx.offload.SpeculativeAdamW(model.parameters(), foreach=True, executor="inline", **kwargs)
    with pytest.raises(sofx.UnsupportedError, match=rf"param_groups\[0\]{what} is a tensor.*foreach=True"):
        sofx.offload.SpeculativeAdamW([{"params": model.parameters(), "foreach": True, **kwargs}], executor="inline")
    _assert_left_working(model)
    for ok in ({"foreach": False}, {"foreach": None}):
        torch.optim.AdamW(model.parameters(), **ok, **kwargs)
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", **ok, **kwargs).close()


def test_a_group_set_to_foreach_with_a_tensor_lr_is_refused_at_the_next_step_before_anything_is_stepped():
    """torch.optim.AdamW's step refuses a group whose ``foreach`` is True (without capturable) and whose lr is a
    tensor, however it got so: the facade refuses it at the step's first block, every parameter as it was."""
    model = _model()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=torch.tensor(1e-2), executor="inline") as opt:
        opt.param_groups[0]["foreach"] = True
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(0)
        with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[0\]\['lr'\].*foreach=True"):
            opt.backward(((model(x) - y) ** 2).mean())
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_fused_and_foreach_together_are_refused_at_construction_as_torch_refuses_them():
    """torch.optim.AdamW(fused=True, foreach=True) raises ("`fused` and `foreach` cannot be `True` together");
    the facade ignored both and took them. Either alone is taken (and ignored), as a group's pair is (torch's
    step runs fused there)."""
    model = _model()
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        torch.optim.AdamW(model.parameters(), fused=True, foreach=True)
    with pytest.raises(sofx.UnsupportedError, match=r"fused=True and foreach=True.*cannot be set together"):
        sofx.offload.SpeculativeAdamW(model.parameters(), fused=True, foreach=True, executor="inline")
    _assert_left_working(model)
    for ok in ({"fused": True, "foreach": False}, {"fused": False, "foreach": True}, {"fused": None, "foreach": None}):
        torch.optim.AdamW(model.parameters(), **ok)
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", **ok).close()
    sofx.offload.SpeculativeAdamW([{"params": model.parameters(), "fused": True, "foreach": True}],
                                  executor="inline").close()


@pytest.mark.parametrize("betas", [
    pytest.param(lambda: torch.tensor([0.8, 0.99]), id="a 2-element tensor"),
    pytest.param(lambda: np.array([0.8, 0.99], dtype=np.float32), id="a float32 numpy array"),
    pytest.param(lambda: (np.float32(0.8), 0.99), id="a numpy float32 and a float"),
])
def test_a_groups_betas_torch_unpacks_are_stepped_as_torch_steps_them(betas):
    """torch.optim.AdamW's step reads a group's betas as ``beta1, beta2 = group["betas"]``: a 2-element tensor
    or numpy array is a pair there, and any two numbers are (its constructor's checks are for its ``betas``
    argument only). The facade refused the array and the tensor ("must be a pair")."""
    want_model, got_model = _model(), _model()
    ref = torch.optim.AdamW([{"params": want_model.parameters(), "betas": betas()}], lr=1e-2, foreach=False)
    with sofx.offload.SpeculativeAdamW([{"params": got_model.parameters(), "betas": betas()}], lr=1e-2,
                                       executor="inline") as opt:
        for step in range(STEPS):
            x, y = _batch(step)
            for o, m in ((ref, want_model), (opt, got_model)):
                o.zero_grad()
                ((m(x) - y) ** 2).mean().backward() if o is ref else o.backward(((m(x) - y) ** 2).mean())
                o.step()
    _assert_same_trajectory([p.detach() for p in got_model.parameters()],
                            [p.detach() for p in want_model.parameters()], bitwise=False)


def test_a_parameter_twice_in_a_group_is_refused_at_construction_naming_both_places():
    """torch.optim warns that a group holding a parameter twice "will cause an error" in future and steps it twice
    per step. The facade took it and refused every step, saying the group had "2 parameters, this optimizer was
    made with 1" (as if one had been added): refused at construction now, naming both places, nothing made."""
    model = _model()
    with pytest.warns(UserWarning, match="duplicate parameters"):
        torch.optim.AdamW([model[0].weight, model[0].bias, model[0].weight])
    groups = [{"params": [model[2].weight]}, {"params": [model[0].weight, model[0].bias, model[0].weight]}]
    with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[1\]\['params'\]\[2\] is "
                                                    r"param_groups\[1\]\['params'\]\[0\] again \(shape \(3, 4\)\)"), \
            pytest.warns(UserWarning, match="duplicate parameters"):  # (torch.optim.Optimizer's, as it adds the group)
        sofx.offload.SpeculativeAdamW(groups, executor="inline")
    _assert_left_working(model)


def test_a_tensor_lr_that_requires_grad_is_its_value_as_in_torch_optim():
    """torch.optim reads a group's hparams in its step (under no_grad): ``lr=torch.tensor(1e-2,
    requires_grad=True)`` trains as ``lr=1e-2`` would. The facade refused it at construction and in
    load_state_dict ("whose value cannot be read here (traced)"), and took it when set between steps."""
    lr = lambda: torch.tensor(1e-2, requires_grad=True)  # noqa: E731
    _, want = _train_torch(lr=lr(), foreach=False)
    group, got = _train_facade(lr=lr())
    assert group["lr"].requires_grad
    _assert_same_trajectory(got, want, bitwise=False)
    model = _model()
    with sofx.offload.SpeculativeAdamW(model.parameters(), lr=lr(), executor="inline") as opt:
        saved = opt.state_dict()
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"].requires_grad


def test_a_groups_betas_given_as_one_tensor_with_foreach_is_refused_as_torch_refuses_it():
    """A group's ``betas=torch.tensor([0.8, 0.99])`` unpacks to two tensors in torch's step, which its foreach
    implementation refuses without capturable, as it refuses a pair of tensors."""
    model, ref = _model(), _model()
    torch_opt = torch.optim.AdamW([{"params": ref.parameters(), "betas": torch.tensor([0.8, 0.99])}], foreach=True)
    x, y = _batch(0)
    ((ref(x) - y) ** 2).mean().backward()
    with pytest.raises(ValueError, match="foreach=True"):
        torch_opt.step()
    with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[0\]\['betas'\] is a tensor.*foreach=True"):
        sofx.offload.SpeculativeAdamW([{"params": model.parameters(), "betas": torch.tensor([0.8, 0.99])}],
                                      foreach=True, executor="inline")
    _assert_left_working(model)


@pytest.mark.parametrize("given, pattern", [
    ("module", r"^params is a Sequential \(a module\): pass model\.parameters\(\), model\.named_parameters\(\) or "
               r"a list of param-group dicts$"),
    ("a dict of named parameters", r"^params is a dict of 4 entries \(keys '0\.weight', '0\.bias', \.\.\.\): "
                                   r"pass model\.parameters\(\), model\.named_parameters\(\) or a list of "
                                   r"param-group dicts; a dict of named parameters: its \.items\(\)$"),
    ("one group", r"^params is a dict of 1 entry \(key 'params'\): .*; one param group: a list of it, \[group\]$")])
def test_a_module_or_a_dict_as_params_is_refused_saying_what_to_pass(given, pattern):
    """torch refuses these with a TypeError that does not say what to pass ("optimizer can only optimize Tensors,
    but one of the params is str" for a dict, whose keys it iterates): the facade names what it got and what it
    takes; what it suggests trains (named parameters, a list of one group), and so does a ParameterList."""
    model = _model()
    params = {"module": model, "a dict of named parameters": dict(model.named_parameters()),
              "one group": {"params": list(model.parameters())}}[given]
    with pytest.raises(TypeError):
        torch.optim.AdamW(params)
    with pytest.raises(sofx.SofxError, match=pattern):
        sofx.offload.SpeculativeAdamW(params)
    for ok in (dict(model.named_parameters()).items(), [{"params": list(model.parameters())}],
               torch.nn.ParameterList(model.parameters())):  # (a module torch iterates as its parameters)
        with sofx.offload.SpeculativeAdamW(ok, executor="inline") as opt:
            x, y = _batch(0)
            opt.backward(((model(x) - y) ** 2).mean())
            assert opt.step().blocks == 1


def test_a_state_dtype_given_as_a_string_is_refused_saying_a_torch_dtype_is_taken():
    """``SpeculativeAdamW(..., state_dtype="bfloat16")`` was refused with "state_dtype=bfloat16; expected
    torch.float32, bfloat16 or float16", which reads as if bfloat16 were taken: the refusal now quotes what was
    given and names the torch dtypes."""
    with pytest.raises(sofx.SofxError, match=r"^state_dtype='bfloat16' \(a str\); expected torch\.float32, "
                                             r"torch\.bfloat16 or torch\.float16 \(a torch\.dtype\)$"):
        sofx.offload.SpeculativeAdamW(_model().parameters(), state_dtype="bfloat16")
    with pytest.raises(sofx.SofxError, match=r"^state_dtype=torch\.float64 \(a dtype\); expected"):
        sofx.offload.SpeculativeAdamW(_model().parameters(), state_dtype=torch.float64)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_shm_dir_that_is_not_a_path_is_refused_at_construction(executor):
    """``shm_dir=None`` (read as "the default") raised a bare TypeError from ``shutil.disk_usage`` ("statvfs: path
    should be string, bytes, os.PathLike or integer, not NoneType") under the process executor: refused now, with
    any executor, naming the default."""
    with pytest.raises(sofx.SofxError, match=r"^shm_dir must be a directory path \(a str or os\.PathLike; the "
                                             r"default is '/dev/shm'\), got None$"):
        sofx.offload.SpeculativeAdamW(_model().parameters(), executor=executor, shm_dir=None)


def test_a_groups_max_grad_norm_is_refused_naming_the_constructors_where_it_was_ignored():
    """``max_grad_norm`` is the optimizer's (one norm over every parameter, as ``clip_grad_norm_`` takes it), set at
    construction; the groups' hparams are read at every step, but a group's ``max_grad_norm`` was not: given in a
    group dict, or set on one mid-run (as a scheduler sets ``lr``), it was ignored without a word, the gradients
    clipped by the constructor's (or not at all). Refused, naming the group and the constructor's argument, at
    construction (nothing made) and at the next step (nothing stepped; the optimizer works again without it)."""
    model = _model()
    params = list(model.parameters())
    with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[1\]\['max_grad_norm'\] = 0\.5: .*"
                                                    r"SpeculativeAdamW\(\.\.\., max_grad_norm=\.\.\.\)"):
        sofx.offload.SpeculativeAdamW([{"params": params[:2]}, {"params": params[2:], "max_grad_norm": 0.5}],
                                      executor="inline")
    _assert_left_working(model)
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", max_grad_norm=1.0) as opt:
        opt.param_groups[0]["max_grad_norm"] = 1e-3
        x, y = _batch(1)
        with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[0\]\['max_grad_norm'\] = 0\.001"):
            opt.backward(((model(x) - y) ** 2).mean())
            opt.step()
        opt.zero_grad()
        assert [int(opt.state[p]["step"]) for p in params] == [0] * len(params)
        del opt.param_groups[0]["max_grad_norm"]
        opt.backward(((model(x) - y) ** 2).mean())
        assert not opt.step().skipped


def test_capturable_with_cpu_parameters_is_refused_as_torch_refuses_its_step():
    """torch.optim.AdamW(capturable=True) over CPU parameters is made, and its first step with a gradient raises
    ("params and state_steps must be on supported devices"; ``fused=True`` steps them). The facade took it and
    trained, ignoring it: refused at construction (nothing made) and, for a group set so later, at the next step
    (nothing stepped), naming the group and a CPU parameter; with ``fused=True`` it is taken, as torch steps it."""
    model = _model()
    torch_opt = torch.optim.AdamW(model.parameters(), capturable=True)
    x, y = _batch(0)
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(AssertionError, match="supported devices"):
        torch_opt.step()
    for groups in (model.parameters(), [{"params": model.parameters()}]):
        with pytest.raises(sofx.UnsupportedError, match=r"^param_groups\[0\]\['capturable'\] = True with CPU "
                                                        r"parameters \(param_groups\[0\]\['params'\]\[0\], shape "
                                                        r"\(3, 4\)\):.*fused=True"):
            sofx.offload.SpeculativeAdamW(groups, executor="inline", capturable=True)
    _assert_left_working(model)
    torch.optim.AdamW(model.parameters(), capturable=True, fused=True).step()
    sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", capturable=True, fused=True).close()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
        opt.param_groups[0]["capturable"] = True
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(sofx.UnsupportedError, match=r"param_groups\[0\]\['capturable'\] = True with CPU"):
            opt.backward(((model(x) - y) ** 2).mean())
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("kwargs, what, name", [
    pytest.param({"lr": np.float16(1e-3)}, r"\['lr'\]", "lr", id="lr"),
    pytest.param({"betas": (torch.tensor(0.5, dtype=torch.float16), torch.tensor(0.75, dtype=torch.float16))},
                 r"\['betas'\]\[0\]", "beta1", id="betas"),
    pytest.param({"weight_decay": torch.tensor(0.25, dtype=torch.bfloat16)}, r"\['weight_decay'\]", "weight_decay",
                 id="weight_decay"),
])
def test_half_precision_hparams_are_refused_as_sofx_adam_refuses_them(kwargs, what, name):
    """torch.optim.AdamW's for-loop step computes with a float16 lr, beta or weight decay in float16 (numpy keeps
    a float16's precision, NEP 50; a tensor its dtype): the facade read it as the Python float it holds and
    trained otherwise, where :func:`sofx.adam` refuses it. Refused as sofx.adam refuses it (one wording), at
    construction and -- a LambdaLR whose lambda returns a numpy float16 makes the group's lr one -- at the next
    step, nothing stepped; a float16 eps (only added, as a double, by torch) is taken."""
    model = _model()
    pattern = rf"is a (b?float16) number: torch.optim's for-loop and foreach AdamW compute with it in \1"
    with pytest.raises(sofx.HParamError, match=rf"^defaults{what} = .* {pattern}"):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", **kwargs)
    with pytest.raises(sofx.HParamError, match=rf"^param_groups\[0\]{what} = .* {pattern}"):
        sofx.offload.SpeculativeAdamW([{"params": model.parameters(), **kwargs}], executor="inline")
    _assert_left_working(model)
    sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", eps=np.float16(1e-3)).close()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
        torch.optim.lr_scheduler.LambdaLR(opt, lambda t: np.float16(0.5))
        assert type(opt.param_groups[0]["lr"]) is np.float16
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(0)
        with pytest.raises(sofx.HParamError, match=rf"^param_groups\[0\]\['lr'\] = .* {pattern}"):
            opt.backward(((model(x) - y) ** 2).mean())
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.skipif(np.finfo(np.longdouble).eps == np.finfo(np.float64).eps, reason="longdouble is a double here")
def test_a_longdouble_hparam_no_float_holds_is_refused_as_sofx_adam_refuses_it():
    """A numpy longdouble lr or eps with more digits than a float (1/3 in x86's 80 bits; a LambdaLR's arithmetic in
    it makes a group's lr one) was read by the facade as float() of it, rounded without a word, where sofx.adam's
    update and the checkpoint imports refuse it. Refused naming the group's entry, at construction and at the next
    step, nothing stepped; a longdouble a float holds exactly (0.5) is taken."""
    model = _model()
    third = np.longdouble(1) / np.longdouble(3)
    why = r" is invalid: a numpy\.longdouble that no Python float \(a float64\) holds exactly"
    with pytest.raises(sofx.HParamError, match=rf"^defaults\['lr'\] = .*{why}"):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", lr=third * 1e-3)
    with pytest.raises(sofx.HParamError, match=rf"^param_groups\[0\]\['eps'\] = .*{why}"):
        sofx.offload.SpeculativeAdamW([{"params": model.parameters(), "eps": third * 2 ** -26}], executor="inline")
    _assert_left_working(model)
    sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline", lr=np.longdouble(0.5)).close()
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
        torch.optim.lr_scheduler.LambdaLR(opt, lambda t: third)
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(0)
        with pytest.raises(sofx.HParamError, match=rf"^param_groups\[0\]\['lr'\] = .*{why}"):
            opt.backward(((model(x) - y) ** 2).mean())
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_lazy_modules_uninitialized_parameter_is_refused_at_construction_naming_it():
    """A model with a lazy module before its first forward: torch.optim.AdamW takes its UninitializedParameter (it
    fails at the step); the facade, which packs the parameters into blocks at construction, raised torch's
    ValueError ('Attempted to use an uninitialized parameter in <method 'numel' ...>') naming no parameter: a
    LeafError naming it and saying to run a forward pass first; after one, it trains."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LazyLinear(2))
    with pytest.raises(sofx.LeafError, match=r"^param_groups\[0\]\['params'\]\[2\] is an uninitialized parameter "
                                             r"\(a lazy module's, before its first forward\).*run a forward pass"):
        sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline")
    x, y = _batch(0)
    model(x)
    with sofx.offload.SpeculativeAdamW(model.parameters(), executor="inline") as opt:
        opt.backward(((model(x) - y) ** 2).mean())
        assert opt.step().blocks == 1


# torch.optim's on/off options given values that are no flag (torch takes each by its truth: "False" as on; its
# step hands differentiable to set_grad_enabled, a TypeError for any but a bool)
_NO_FLAGS = [("decoupled_weight_decay", "False"), ("decoupled_weight_decay", "True"), ("amsgrad", "False"),
             ("maximize", 2), ("foreach", "False"), ("fused", "False"), ("capturable", 0.0),
             ("differentiable", None), ("differentiable", 0), ("differentiable", np.bool_(False)),
             ("amsgrad", torch.tensor(False))]


@pytest.mark.parametrize("cls", [sofx.offload.SpeculativeAdam, sofx.offload.SpeculativeAdamW],
                         ids=["Adam", "AdamW"])
@pytest.mark.parametrize("key, value", _NO_FLAGS, ids=[f"{k}={v!r}" for k, v in _NO_FLAGS])
def test_a_torch_option_that_is_no_flag_is_refused_naming_it(cls, key, value):
    """The facade read torch.optim's flags by their truth: SpeculativeAdam(decoupled_weight_decay="False") was refused
    as 'a SpeculativeAdam has L2 weight decay; use SpeculativeAdamW', SpeculativeAdamW's "False" taken as its own
    decay, foreach="False" or fused="False" as set, and capturable=0.0, differentiable=None or 0 (torch's step
    raises a TypeError for it) taken as off without a word. Each is refused naming the option and the value, in
    the constructor's arguments and in a group; bools (numpy's too), 0, 1 and None are taken as torch takes them,
    but for differentiable, a Python bool only (torch.set_grad_enabled(np.False_) is a TypeError at torch's
    step)."""
    model = torch.nn.Linear(2, 2)
    want = "True or False" if key == "differentiable" else "True, False or None"  # (None: torch picks)
    pattern = rf"\['{key}'\] = {re.escape(repr(value))} is no flag; expected {want}$"
    with pytest.raises(sofx.UnsupportedError, match=rf"^defaults{pattern}"):
        cls(model.parameters(), executor="inline", **{key: value})
    with pytest.raises(sofx.UnsupportedError, match=rf"^param_groups\[0\]{pattern}"):
        cls([{"params": list(model.parameters()), key: value}], executor="inline")
    decoupled = cls is sofx.offload.SpeculativeAdamW
    taken = {"decoupled_weight_decay": np.bool_(decoupled), "amsgrad": 0, "maximize": np.bool_(False),
             "foreach": 1, "fused": None, "capturable": False, "differentiable": False}[key]
    with cls(model.parameters(), executor="inline", **{key: taken}) as opt:
        assert opt.param_groups[0][key] is taken
