"""The objective's pure functions against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.objective import (
    SigmaSampler,
    apply_caption_dropout,
    caption_dropout_mask,
    loss_weights,
    masked_flow_loss,
    noisy_input,
    sample_sigmas,
    shift_sigma,
    sigmas_from_draws,
    time_shift,
    token_count_mu,
)

NORMAL = torch.tensor([0.0, 1.0, -2.0])
UNIFORM = torch.tensor([0.25, 0.5, 0.9])


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_uniform_returns_the_uniform_draws():
    assert torch.equal(sigmas_from_draws(SigmaSampler("uniform"), NORMAL, UNIFORM, 1024), UNIFORM)


def test_logit_normal():
    sampler = SigmaSampler("logit_normal", logit_mean=0.5, logit_std=2.0)
    # sigmoid(0.5 + 2 n): n = 0 -> sigmoid(0.5) = 0.622459; n = 1 -> sigmoid(2.5) = 0.924142;
    # n = -2 -> sigmoid(-3.5) = 0.029312
    expected = torch.tensor([0.622459, 0.924142, 0.029312])
    assert torch.allclose(sigmas_from_draws(sampler, NORMAL, UNIFORM, 1024), expected, atol=1e-6)


def test_sigmoid_with_scale():
    got = sigmas_from_draws(SigmaSampler("sigmoid", sigmoid_scale=0.5), NORMAL, UNIFORM, 1024)
    assert torch.allclose(got, torch.tensor([0.5, sig(0.5), sig(-1.0)]), atol=1e-6)


def test_fixed_shift():
    # shift 3 on s = 0.5: 1.5 / (1 + 2 * 0.5) = 0.75; on sigmoid(1) = 0.731059:
    # 2.193176 / 2.462117 = 0.890768
    assert torch.allclose(
        shift_sigma(torch.tensor([0.5, 0.731059]), 3.0), torch.tensor([0.75, 0.890768]), atol=1e-6
    )
    got = sigmas_from_draws(SigmaSampler("shift", shift=3.0), NORMAL[:2], UNIFORM[:2], 1024)
    assert torch.allclose(got, torch.tensor([0.75, 0.890768]), atol=1e-6)


def test_flux_resolution_shift():
    # mu: 256 tokens -> 0.5, 4096 -> 1.15, 1024 (a 512x512 image) -> 0.5 + 0.65 * 768 / 3840 = 0.63
    assert token_count_mu(256) == pytest.approx(0.5) and token_count_mu(4096) == pytest.approx(1.15)
    assert token_count_mu(1024) == pytest.approx(0.63)
    # s = 0.5 -> e^mu / (e^mu + 1): mu 1.15 -> 3.158193 / 4.158193 = 0.759510
    assert float(time_shift(torch.tensor(0.5), 1.15)) == pytest.approx(0.759510, abs=1e-6)
    got = sigmas_from_draws(SigmaSampler("flux_shift"), torch.tensor([0.0]), torch.tensor([0.3]), 4096)
    assert float(got[0]) == pytest.approx(0.759510, abs=1e-6)
    # more tokens -> more noise
    low = sigmas_from_draws(SigmaSampler("flux_shift"), NORMAL, UNIFORM, 256)
    high = sigmas_from_draws(SigmaSampler("flux_shift"), NORMAL, UNIFORM, 4096)
    assert (high > low).all()


@pytest.mark.parametrize("tokens", [256, 1024, 4096, 6889])
def test_flux_and_qwen_shift_are_musubi_tuners(tokens):
    """musubi-tuner's flux_shift and qwen_shift (hv_train_network.py) written out: mu linear in
    the image tokens, shift = e^mu, t' = shift t / (1 + (shift - 1) t) with t = sigmoid(scale x
    normal). 6889 tokens: a 1328 x 1328 Qwen-Image, whose qwen_shift is about 2.3 (musubi's
    documentation: "typically around 2.2 for 1328x1328 images")."""
    from trainer_core.objective import QWEN_TOKEN_SHIFT_POINTS

    for points, (x2, y2) in ((None, (4096, 1.15)), (QWEN_TOKEN_SHIFT_POINTS, (8192, 0.9))):
        sampler = SigmaSampler("flux_shift", sigmoid_scale=1.3, **({"token_shift": points} if points else {}))
        got = sigmas_from_draws(sampler, NORMAL, UNIFORM, tokens)
        shift = math.exp(0.5 + (y2 - 0.5) * (tokens - 256) / (x2 - 256))
        t = torch.sigmoid(1.3 * NORMAL)
        torch.testing.assert_close(got, shift * t / (1 + (shift - 1) * t))
    qwen_1328 = math.exp(token_count_mu(6889, QWEN_TOKEN_SHIFT_POINTS))
    assert 2.2 < qwen_1328 < 2.4


def test_sample_sigmas_is_seeded_and_in_range():
    sampler = SigmaSampler("logit_normal")
    a = sample_sigmas(sampler, 64, torch.Generator().manual_seed(1), 1024)
    b = sample_sigmas(sampler, 64, torch.Generator().manual_seed(1), 1024)
    c = sample_sigmas(sampler, 64, torch.Generator().manual_seed(2), 1024)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a > 0).all() and (a < 1).all()


def test_unknown_sampler_names_the_choices():
    with pytest.raises(ValueError, match="unknown timestep_sampler 'cosine'"):
        SigmaSampler("cosine")


def test_noisy_input_and_target():
    x0, noise = torch.ones(2, 1, 2), torch.full((2, 1, 2), 3.0)
    sigma = torch.tensor([0.25, 1.0])
    x_t, target = noisy_input(x0, noise, sigma)
    # 0.75 * 1 + 0.25 * 3 = 1.5; at sigma 1 the input is pure noise
    assert torch.equal(x_t[0], torch.full((1, 2), 1.5)) and torch.equal(x_t[1], noise[1])
    assert torch.equal(target, torch.full((2, 1, 2), 2.0))
    # input perturbation: 0.75 * 1 + 0.25 * (3 + 0.5 * 1) = 1.625; the target does not move
    x_t, target = noisy_input(x0, noise, sigma, perturbation=torch.ones(2, 1, 2), ip_noise_gamma=0.5)
    assert torch.allclose(x_t[0], torch.full((1, 2), 1.625)) and torch.equal(
        target, torch.full((2, 1, 2), 2.0)
    )


def test_loss_weights():
    sigma = torch.tensor([0.5, 0.25])
    assert torch.equal(loss_weights(sigma, "none"), torch.ones(2))
    assert torch.allclose(loss_weights(sigma, "sigma_sqrt"), torch.tensor([4.0, 16.0]))
    # cosmap: s = 0.5 -> 2 / (pi * 0.5) = 1.273240; s = 0.25 -> 2 / (pi * 0.625) = 1.018592
    assert torch.allclose(loss_weights(sigma, "cosmap"), torch.tensor([1.273240, 1.018592]), atol=1e-6)
    with pytest.raises(ValueError, match="unknown loss_weighting 'snr'"):
        loss_weights(sigma, "snr")


def test_masked_loss_sees_only_target_tokens():
    # sample 0: tokens 0-1 target (errors 1 and 3 -> squares 1, 9 -> mean 5), token 2 a reference
    # with a huge error; sample 1: token 0 target (error 2 -> 4), tokens 1-2 padding.
    prediction = torch.tensor([[[1.0], [3.0], [100.0]], [[2.0], [-50.0], [70.0]]])
    target = torch.zeros_like(prediction)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss = masked_flow_loss(prediction, target, mask, torch.tensor([1.0, 0.5]))
    assert float(loss) == pytest.approx((5.0 * 1.0 + 4.0 * 0.5) / 2)


def test_caption_dropout():
    drop = caption_dropout_mask(torch.tensor([0.1, 0.5, 0.9]), 0.5)
    assert drop.tolist() == [True, False, False]
    texts = [("a", 1), ("b", 2), ("c", 3)]
    assert apply_caption_dropout(texts, ("", 0), drop) == [("", 0), ("b", 2), ("c", 3)]


def test_the_models_own_noise_scaling_mixes_the_input():
    """A model's mixing (ComfyUI's model_sampling.noise_scaling) builds x_t; the target stays
    noise - x0. The flow models' formula gives exactly the built-in one."""
    gen = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(2, 4, 3, generator=gen), torch.randn(2, 4, 3, generator=gen)
    sigma = torch.tensor([0.25, 0.75])

    def flow(s, n, x):  # ComfyUI's CONST.noise_scaling
        s = s.view(-1, 1, 1)
        return s * n + (1.0 - s) * x

    ours, target = noisy_input(x0, noise, sigma)
    theirs, same_target = noisy_input(x0, noise, sigma, noise_scaling=flow)
    assert torch.equal(ours, theirs) and torch.equal(target, same_target)
    doubled, _ = noisy_input(x0, noise, sigma, noise_scaling=lambda s, n, x: 2 * flow(s, n, x))
    assert torch.equal(doubled, 2 * ours)  # what the model gives is what is used
