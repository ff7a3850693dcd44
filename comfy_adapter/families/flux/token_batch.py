"""FLUX's token batch: the generic padded batch (`trainer_core.token_batch`) with each token's
position ids (`position_ids.image_position_ids`) in the sample's reference layout, and the
attention mask of a padded batch. ComfyUI's Flux packs 2x2 patches (FLUX.1) or 1x1 patches of
its 128-channel latents (FLUX.2) exactly as the generic packing does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ....trainer_core.token_batch import TokenBatch
from ....trainer_core.token_batch import build_token_batch as build_tokens
from .position_ids import DEFAULT_GRID, TokenGrid, image_position_ids


@dataclass
class FluxTokenBatch(TokenBatch):
    ids: torch.Tensor = field(kw_only=True)  # (B, L, axes) position ids, zero on padding
    grid: TokenGrid = DEFAULT_GRID


def build_token_batch(
    targets: Sequence[torch.Tensor],
    references: Sequence[Sequence[torch.Tensor]],
    layout: str,
    grid: TokenGrid = DEFAULT_GRID,
    pad_value: float = 0.0,
) -> FluxTokenBatch:
    """Pack per-sample (C, H, W) targets and their references into one padded batch with the
    ids of `layout`."""
    tokens = build_tokens(targets, references, grid.patch_size, pad_value)
    ids = torch.zeros(*tokens.valid.shape, grid.axes, dtype=torch.float32, device=tokens.tokens.device)
    for i, (target, refs) in enumerate(zip(targets, references, strict=True)):
        sizes = [tuple(r.shape[-2:]) for r in refs]
        sample_ids = image_position_ids(tuple(target.shape[-2:]), sizes, layout, grid)
        ids[i, : sample_ids.shape[0]] = sample_ids.to(ids.device)
    return FluxTokenBatch(**{f: getattr(tokens, f) for f in tokens.__dataclass_fields__}, ids=ids, grid=grid)


def attention_bias(
    valid: torch.Tensor, text_tokens: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """Additive attention mask (B, T+L, T+L) for the sequence [text, image] of Flux blocks.

    A real token attends to text and real image tokens only; nothing attends to padding.
    A padded token attends to itself alone, which keeps its softmax finite (a fully masked
    row would be NaN and leak through later layers); its output is discarded. Returns None
    when nothing is padded, so an unpadded batch takes the unmasked attention path.
    """
    if bool(valid.all()):
        return None
    batch, length = valid.shape
    keys = torch.cat([torch.ones(batch, text_tokens, dtype=torch.bool, device=valid.device), valid], dim=1)
    allowed = keys[:, None, :] & keys[:, :, None]
    allowed |= torch.eye(text_tokens + length, dtype=torch.bool, device=valid.device)[None]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    return bias.masked_fill_(~allowed, -torch.finfo(dtype).max)
