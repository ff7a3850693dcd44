"""One rectified-flow loss evaluation on a batch of samples, independent of the model.

The model enters as `predict(noisy: TokenBatch, sigma, context, pooled) -> (B, L, D)`, the
velocity for every token (only target tokens are used). Random draws come from one explicit
generator in a fixed order, so a seed fixes the whole step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from .config import TrainConfig
from .objective import (
    apply_caption_dropout,
    caption_dropout_mask,
    loss_weights,
    masked_flow_loss,
    noisy_input,
    sample_sigmas,
)
from .token_batch import TokenBatch, build_token_batch


@dataclass
class Sample:
    """One training example. Latents are in the diffusion model's space, i.e. VAE latents
    after ComfyUI's `model.process_latent_in` (Flux: (z - shift) * scale), as sampling sees
    them."""

    target: torch.Tensor  # (C, H, W) clean target latent
    context: torch.Tensor  # (T, D) text embedding of the caption
    pooled: torch.Tensor  # (D,) pooled text embedding
    references: list[torch.Tensor] = field(default_factory=list)  # (C, h, w) clean reference latents


@dataclass
class EmptyText:
    """The cached empty-prompt embedding that caption dropout swaps in."""

    context: torch.Tensor  # (T, D)
    pooled: torch.Tensor  # (D,)


Predict = Callable[[TokenBatch, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _stack_text(texts) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = sorted({context.shape[0] for context, _ in texts})
    if len(lengths) > 1:
        raise ValueError(
            f"one batch holds captions encoded to {lengths} tokens; ComfyUI's T5 keeps captions over "
            "256 tokens longer than the others. Shorten the long captions or use batch_size 1"
        )
    return torch.stack([c for c, _ in texts]), torch.stack([p for _, p in texts])


def flow_matching_loss(
    predict: Predict,
    samples: Sequence[Sample],
    config: TrainConfig,
    generator: torch.Generator,
    empty_text: EmptyText | None = None,
    patch_size: int = 2,
) -> torch.Tensor:
    # 1) pack targets and references into one token batch (references stay clean)
    clean = build_token_batch(
        [s.target for s in samples], [s.references for s in samples], config.layout, patch_size
    )
    batch, device = len(samples), clean.tokens.device
    # 2) one sigma per sample (Flux's shift depends on each sample's own target token count)
    sigma = sample_sigmas(config.sigma_sampler(), batch, generator, clean.target.sum(dim=1).cpu())
    # 3) noise only the target tokens: x_t = (1 - s) x0 + s (noise + gamma * perturbation)
    noise = torch.randn(clean.tokens.shape, generator=generator).to(device, clean.tokens.dtype)
    perturbation = None
    if config.ip_noise_gamma:
        perturbation = torch.randn(clean.tokens.shape, generator=generator).to(device, clean.tokens.dtype)
    mixed, velocity = noisy_input(clean.tokens, noise, sigma.to(device), perturbation, config.ip_noise_gamma)
    noisy_tokens = torch.where(clean.target[..., None], mixed, clean.tokens)
    # 4) text, with the empty prompt swapped in for dropped captions
    texts = [(s.context, s.pooled) for s in samples]
    drop_draw = torch.rand(batch, generator=generator)
    if config.caption_dropout > 0:
        if empty_text is None:
            raise ValueError("caption dropout needs the cached empty-prompt embedding")
        empty = (empty_text.context.to(texts[0][0]), empty_text.pooled.to(texts[0][1]))
        texts = apply_caption_dropout(texts, empty, caption_dropout_mask(drop_draw, config.caption_dropout))
    context, pooled = _stack_text(texts)
    # 5) predict and compare on target tokens only, on the device the model computed on (the
    # samples may wait on the CPU while the model runs on a GPU)
    prediction = predict(replace(clean, tokens=noisy_tokens), sigma.to(device), context, pooled)
    on = prediction.device
    weights = loss_weights(sigma, config.loss_weighting)
    return masked_flow_loss(prediction, velocity.to(on), clean.target.to(on), weights.to(on))
