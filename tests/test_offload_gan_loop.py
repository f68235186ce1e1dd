"""A GAN loop with two speculative optimizers against the same loop with ``torch.optim.AdamW``.

The generator's backward also gives the discriminator's parameters gradients; the discriminator's optimizer takes
them and speculates, and its next ``zero_grad()`` undoes those steps. README.md says what that costs: with the
discriminator frozen around the generator's backward the run is torch's bit for bit; without, within the undo's
error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sofx.offload import SpeculativeAdamW


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    g = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    d = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return g, d


def _train(make_opt, freeze: bool, iterations: int = 30) -> list[torch.Tensor]:
    g, d = _models()
    opt_g, opt_d = make_opt(g.parameters()), make_opt(d.parameters())
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(iterations):
            real, z = torch.randn(16, 8, generator=gen) + 2, torch.randn(16, 8, generator=gen)
            opt_d.zero_grad()
            d_loss = F.softplus(-d(real)).mean() + F.softplus(d(g(z).detach())).mean()
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            d.requires_grad_(not freeze)
            F.softplus(-d(g(z))).mean().backward()
            d.requires_grad_(True)
            opt_g.step()
    finally:
        for opt in (opt_g, opt_d):
            if hasattr(opt, "close"):
                opt.close()
    return [p.detach().clone() for p in (*g.parameters(), *d.parameters())]


def _torch(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _sofx(params):
    return SpeculativeAdamW(params, lr=1e-2)


def test_a_gan_loop_with_the_discriminator_frozen_in_the_generators_backward_is_torchs_bit_for_bit():
    want = _train(_torch, freeze=True)
    assert all(torch.equal(a, b) for a, b in zip(_train(_sofx, freeze=True), want, strict=True))


def test_a_gan_loop_whose_discriminator_speculates_in_the_generators_backward_stays_within_the_undos_error():
    want, got = _train(_torch, freeze=False), _train(_sofx, freeze=False)
    assert torch.equal(torch.cat([p.flatten() for p in _train(_torch, freeze=True)]),
                       torch.cat([p.flatten() for p in want]))  # freezing D there changes nothing in torch's run
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
