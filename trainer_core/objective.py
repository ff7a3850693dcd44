"""The rectified-flow objective: timestep (sigma) samplers, noisy inputs, loss weighting,
the masked loss and caption dropout. Small pure functions; `tests/trainer_core/
test_objective.py` checks each against hand-computed values.

Conventions: sigma in (0, 1) is the noise level, x_t = (1 - sigma) * x0 + sigma * noise,
the model predicts the velocity noise - x0 (Flux's flow-matching target).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .choices import LossWeighting, TimestepSampler, choose

SAMPLERS = tuple(TimestepSampler)
WEIGHTINGS = tuple(LossWeighting)

# The resolution-dependent shift (the `flux_shift` sampler): mu grows linearly with the image
# token count through two points, each model family's own (`ModelFamily.token_shift`). FLUX's,
# as its own scheduler and musubi-tuner's flux_shift: 256 tokens -> 0.5, 4096 -> 1.15; Qwen-Image's
# (musubi-tuner's qwen_shift): 256 -> 0.5, 8192 -> 0.9.
TokenShift = tuple[tuple[int, float], tuple[int, float]]
TOKEN_SHIFT_POINTS: TokenShift = ((256, 0.5), (4096, 1.15))
QWEN_TOKEN_SHIFT_POINTS: TokenShift = ((256, 0.5), (8192, 0.9))
NoiseScaling = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (sigma, noise, x0) -> x_t


@dataclass(frozen=True)
class SigmaSampler:
    kind: TimestepSampler = TimestepSampler.SIGMOID
    logit_mean: float = 0.0  # logit_normal: mean of the normal before the sigmoid
    logit_std: float = 1.0  # logit_normal: its standard deviation
    sigmoid_scale: float = 1.0  # sigmoid / shift / flux_shift: sigmoid(scale * normal)
    shift: float = 3.0  # shift: the fixed discrete-flow shift
    token_shift: TokenShift = TOKEN_SHIFT_POINTS  # flux_shift: the model family's two points

    def __post_init__(self):
        object.__setattr__(self, "kind", choose(TimestepSampler, self.kind, "timestep_sampler"))


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """Fixed shift: s' = shift * s / (1 + (shift - 1) * s); shift > 1 moves mass to noise."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def token_count_mu(
    image_tokens: int | torch.Tensor, points: TokenShift = TOKEN_SHIFT_POINTS
) -> float | torch.Tensor:
    """The shift exponent for an image of `image_tokens` tokens: linear in the count through
    the two `points` (FLUX's by default)."""
    (x1, y1), (x2, y2) = points
    return y1 + (y2 - y1) * (image_tokens - x1) / (x2 - x1)


def time_shift(sigma: torch.Tensor, mu: float | torch.Tensor) -> torch.Tensor:
    """s' = e^mu / (e^mu + (1/s - 1)): the shift Flux applies for a given mu (per sample if
    `mu` is a tensor)."""
    exp_mu = torch.exp(torch.as_tensor(mu, dtype=sigma.dtype))
    return exp_mu / (exp_mu + (1 / sigma - 1))


def sigmas_from_draws(
    sampler: SigmaSampler, normal: torch.Tensor, uniform: torch.Tensor, image_tokens: int | torch.Tensor
) -> torch.Tensor:
    """Map standard-normal and uniform draws to sigmas; deterministic given the draws.
    `image_tokens` (per sample or shared) only matters to flux_shift."""
    if sampler.kind == "uniform":
        return uniform
    if sampler.kind == "logit_normal":
        return torch.sigmoid(sampler.logit_mean + sampler.logit_std * normal)
    base = torch.sigmoid(sampler.sigmoid_scale * normal)
    if sampler.kind == "sigmoid":
        return base
    if sampler.kind == "shift":
        return shift_sigma(base, sampler.shift)
    if torch.is_tensor(image_tokens):
        image_tokens = image_tokens.to(base.dtype)
    return time_shift(base, token_count_mu(image_tokens, sampler.token_shift))  # flux_shift


def sample_sigmas(
    sampler: SigmaSampler, batch: int, generator: torch.Generator, image_tokens: int | torch.Tensor
) -> torch.Tensor:
    """One sigma per sample, drawn from `generator` (always both draws, so the random stream
    does not depend on the sampler kind), clamped away from 0 and 1."""
    normal = torch.randn(batch, generator=generator)
    uniform = torch.rand(batch, generator=generator)
    return sigmas_from_draws(sampler, normal, uniform, image_tokens).clamp(1e-5, 1 - 1e-5)


def noisy_input(
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    perturbation: torch.Tensor | None = None,
    ip_noise_gamma: float = 0.0,
    noise_scaling: NoiseScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, target). Input perturbation (ip_noise_gamma) adds gamma * perturbation to the noise
    that builds x_t only; the target stays noise - x0, so the model learns to be robust to it.
    `noise_scaling(sigma, noise, x0)`: the model's own mixing (ComfyUI's
    `model_sampling.noise_scaling`, s * noise + (1 - s) * x0 for flow models); without it, that
    formula here."""
    input_noise = (
        noise if perturbation is None or ip_noise_gamma == 0 else noise + ip_noise_gamma * perturbation
    )
    if noise_scaling is not None:
        return noise_scaling(sigma.to(x0.dtype), input_noise, x0), noise - x0
    s = sigma.reshape(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * input_noise, noise - x0


def loss_weights(sigma: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-sample loss weight: none -> 1; sigma_sqrt -> sigma^-2; cosmap -> 2 / (pi (1 - 2s + 2s^2))."""
    weighting = choose(LossWeighting, weighting, "loss_weighting")
    if weighting == LossWeighting.NONE:
        return torch.ones_like(sigma)
    if weighting == LossWeighting.SIGMA_SQRT:
        return sigma.pow(-2.0)
    return 2.0 / (math.pi * (1 - 2 * sigma + 2 * sigma * sigma))  # cosmap


def masked_flow_loss(
    prediction: torch.Tensor, target: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted MSE over the target tokens only. prediction/target (B, L, D), token_mask (B, L)
    bool (reference tokens and padding are False), weights (B,). Each sample's error is the
    mean over its own target tokens, so a larger image does not outweigh a smaller one."""
    dtype = torch.promote_types(prediction.dtype, torch.float32)  # at least fp32 for the sum
    mask = token_mask.to(dtype)
    squared = (prediction.to(dtype) - target.to(dtype)).pow(2).mean(dim=-1) * mask
    per_sample = squared.sum(dim=1) / mask.sum(dim=1).clamp_min(1)
    return (per_sample * weights.to(per_sample.dtype)).mean()


def caption_dropout_mask(uniform: torch.Tensor, probability: float) -> torch.Tensor:
    """Which samples train on the empty prompt this step: uniform draw < probability."""
    return uniform < probability


def apply_caption_dropout(texts: list, empty, drop: torch.Tensor) -> list:
    """Per sample, the empty-prompt embedding where `drop` is True, else its own (context,
    pooled). `empty`: one for every sample, or a list of each sample's own (a family whose empty
    prompt keeps the sample's reference images: Qwen-Image-Edit's). Per sample, not per batch
    tensor: ComfyUI's T5 keeps captions over 256 tokens longer than the empty prompt, and a
    batch of one must still work."""
    empties = empty if isinstance(empty, list) else [empty] * len(texts)
    return [e if dropped else text for text, e, dropped in zip(texts, empties, drop.tolist(), strict=True)]
