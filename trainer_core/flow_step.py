"""One rectified-flow loss evaluation on a batch of samples, independent of the model.

The model enters as `predict(noisy: TokenBatch, sigma, context, pooled) -> (B, L, D)`, the
velocity for every token (only target tokens are used), and its family's packing as
`pack(targets, references) -> TokenBatch` (`token_batch.Pack`: the tokens, and whatever else
the family's model takes with them, such as FLUX's position ids). Random draws come from one explicit
generator in a fixed order, so a seed fixes the whole step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from .config import TrainConfig
from .lora_dropout import micro_batch_key, seed_rows
from .objective import (
    TOKEN_SHIFT_POINTS,
    NoiseScaling,
    TokenShift,
    apply_caption_dropout,
    caption_dropout_mask,
    loss_weights,
    masked_flow_loss,
    noisy_input,
    sample_sigmas,
)
from .token_batch import Pack, TokenBatch, build_token_batch


@dataclass
class EmptyText:
    """The cached empty-prompt embedding that caption dropout swaps in."""

    context: torch.Tensor  # (T, D)
    pooled: torch.Tensor  # (D,)


@dataclass
class Sample:
    """One training example. Latents are in the diffusion model's space, i.e. VAE latents
    after ComfyUI's `model.process_latent_in` (Flux: (z - shift) * scale), as sampling sees
    them."""

    target: torch.Tensor  # (C, [T,] H, W) clean target latent, of the model's latent rank
    context: torch.Tensor  # (T, D) text embedding of the caption
    pooled: torch.Tensor  # (D,) pooled text embedding
    references: list[torch.Tensor] = field(default_factory=list)  # clean reference latents, same rank
    # the sample's own empty prompt for caption dropout (a family whose empty prompt keeps the
    # sample's images: Qwen-Image-Edit's); None: the dataset's one empty prompt
    empty: EmptyText | None = None


Predict = Callable[[TokenBatch, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _stack_text(texts) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = sorted({context.shape[0] for context, _ in texts})
    if len(lengths) > 1:  # `flow_matching_loss` gives each forward one caption length
        raise RuntimeError(f"Kontext Trainer: one forward got captions of {lengths} tokens")
    return torch.stack([c for c, _ in texts]), torch.stack([p for _, p in texts])


def drop_references(samples: Sequence[Sample], rate: float, generator: torch.Generator) -> list[Sample]:
    """Reference dropout: each sample loses all its references with probability `rate` and
    trains as plain text-to-image. One draw per sample from the run's generator (none at rate
    0, so runs without it keep their random sequence), so a resumed run drops the same ones."""
    if rate <= 0:
        return list(samples)
    dropped = (torch.rand(len(samples), generator=generator) < rate).tolist()
    return [replace(s, references=[]) if drop else s for s, drop in zip(samples, dropped, strict=True)]


def flow_matching_loss(
    predict: Predict,
    samples: Sequence[Sample],
    config: TrainConfig,
    generator: torch.Generator,
    empty_text: EmptyText | None = None,
    pack: Pack = build_token_batch,
    rows: slice | None = None,
    noise_scaling: NoiseScaling | None = None,
    token_shift: TokenShift = TOKEN_SHIFT_POINTS,
) -> torch.Tensor:
    """The batch's mean weighted loss, on the tokens `pack` makes of the samples (the model
    family's; by default plain 2x2 patches). `noise_scaling`: the model's, see `noisy_input`;
    `token_shift`: the model family's points for the flux_shift sampler. `rows` (data
    parallel, see `distributed`): `samples` is the global batch and this process trains
    only these rows. Every random draw is still made
    for the whole global batch (so each sample gets the draws it gets in one process) and the
    result is the rows' share of the global mean: their sum / the global batch size (a zero
    tensor without gradient when no rows fall to this process)."""
    # 0) LoRA dropout's masks belong to (micro-batch, global row): the key before any draw
    dropout_key = micro_batch_key(generator) if config.dropout > 0 else None
    # 1) pack targets and references (after reference dropout) into one token batch; references
    # stay clean
    samples = drop_references(samples, config.reference_dropout, generator)
    clean = pack([s.target for s in samples], [s.references for s in samples])
    batch, device = len(samples), clean.tokens.device
    # 2) one sigma per sample (the token shift depends on each sample's own target token count)
    sampler = config.sigma_sampler(token_shift)
    sigma = sample_sigmas(sampler, batch, generator, clean.target.sum(dim=1).cpu())
    # 3) noise only the target tokens: x_t = (1 - s) x0 + s (noise + gamma * perturbation)
    noise = torch.randn(clean.tokens.shape, generator=generator).to(device, clean.tokens.dtype)
    perturbation = None
    if config.ip_noise_gamma:
        perturbation = torch.randn(clean.tokens.shape, generator=generator).to(device, clean.tokens.dtype)
    # 4) text, with the empty prompt swapped in for dropped captions
    texts = [(s.context, s.pooled) for s in samples]
    drop_draw = torch.rand(batch, generator=generator)
    if config.caption_dropout > 0:
        empties = [s.empty or empty_text for s in samples]
        if any(empty is None for empty in empties):
            raise ValueError("caption dropout needs the cached empty-prompt embedding")
        empties = [(e.context.to(t[0]), e.pooled.to(t[1])) for e, t in zip(empties, texts, strict=True)]
        texts = apply_caption_dropout(texts, empties, caption_dropout_mask(drop_draw, config.caption_dropout))
    weights = loss_weights(sigma, config.loss_weighting)
    # 5) the rows this process trains (data parallel: its share of the global batch), in runs of
    # consecutive rows whose captions encoded to one length (a model without a text mask takes
    # one length per forward: ComfyUI's T5 keeps captions over 256 tokens longer)
    if dropout_key is not None:
        seed_rows(dropout_key, rows.start if rows is not None else 0)
    chosen = list(range(batch))[rows] if rows is not None else list(range(batch))
    if not chosen:
        return torch.zeros((), dtype=torch.float32)
    runs = _runs_of_one_text_length(chosen, texts)
    if rows is None and len(runs) == 1:  # the whole batch in one forward
        return _loss_at(
            predict, clean, sigma, noise, texts, weights, perturbation, config.ip_noise_gamma, noise_scaling
        )
    # each run padded as the global batch is, taking its path through the model (every layer
    # sees a row at the shape one forward of the whole batch gives it), its share of the mean
    loss = None
    for run in runs:
        if dropout_key is not None and run is not runs[0]:
            seed_rows(dropout_key, run[0])
        mine = clean.rows(run)
        index, length = torch.tensor(run), mine.tokens.shape[1]
        part = _loss_at(
            predict,
            mine,
            sigma[index],
            noise[index.to(noise.device), :length],
            [texts[i] for i in run],
            weights[index],
            perturbation[index.to(noise.device), :length] if perturbation is not None else None,
            config.ip_noise_gamma,
            noise_scaling,
        ) * (len(run) / batch)
        loss = part if loss is None else loss + part
    return loss


def _runs_of_one_text_length(rows: list[int], texts) -> list[list[int]]:
    """`rows` cut where the caption's encoded length changes."""
    runs = [[rows[0]]]
    for row in rows[1:]:
        if texts[row][0].shape[0] == texts[runs[-1][-1]][0].shape[0]:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def fixed_noise_loss(
    predict: Predict,
    sample: Sample,
    pack: Pack,
    sigma: float,
    noise_seed: int,
    noise_scaling: NoiseScaling | None = None,
) -> torch.Tensor:
    """The unweighted flow loss of one sample at noise level `sigma` with the noise drawn from
    its own generator seeded by `noise_seed`: the same value for the same model, and no draw
    from any other random state (held-out validation)."""
    clean = pack([sample.target], [sample.references])
    noise = torch.randn(clean.tokens.shape, generator=torch.Generator().manual_seed(noise_seed))
    sigmas = torch.tensor([float(sigma)])
    texts = [(sample.context, sample.pooled)]
    return _loss_at(
        predict, clean, sigmas, noise.to(clean.tokens), texts, torch.ones(1), noise_scaling=noise_scaling
    )


def _loss_at(
    predict: Predict,
    clean: TokenBatch,
    sigma: torch.Tensor,
    noise: torch.Tensor,
    texts,
    weights: torch.Tensor,
    perturbation: torch.Tensor | None = None,
    ip_noise_gamma: float = 0.0,
    noise_scaling: NoiseScaling | None = None,
) -> torch.Tensor:
    """Noise the target tokens, predict, and compare on target tokens only, on the device the
    model computed on (the samples may wait on the CPU while the model runs on a GPU)."""
    device = clean.tokens.device
    mixed, velocity = noisy_input(
        clean.tokens, noise, sigma.to(device), perturbation, ip_noise_gamma, noise_scaling
    )
    noisy_tokens = torch.where(clean.target[..., None], mixed, clean.tokens)
    context, pooled = _stack_text(texts)
    prediction = predict(replace(clean, tokens=noisy_tokens), sigma.to(device), context, pooled)
    on = prediction.device
    return masked_flow_loss(prediction, velocity.to(on), clean.target.to(on), weights.to(on))
