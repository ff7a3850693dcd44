"""Packing latents into Flux's token sequence, and mixed-size batches with masks.

A sample is a target latent plus zero or more reference latents, each (C, H, W). Its tokens
are the target's 2x2 patches in raster order, then each reference's, exactly as ComfyUI's Flux
concatenates them; its ids come from `position_ids.image_position_ids`. Samples of different
sizes are padded to a common length; `valid` marks real tokens, `target` marks the tokens the
loss may use (target image only: never references, never padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from einops import rearrange

from .position_ids import DEFAULT_GRID, TokenGrid, image_position_ids


def pack_latent(latent: torch.Tensor, patch_size: int = 2) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, C*p*p), patches in raster order."""
    height, width = latent.shape[-2:]
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"latent size {height}x{width} is not a multiple of the patch size {patch_size}; "
            "image sides must be multiples of 16 pixels"
        )
    return rearrange(latent, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=patch_size, pw=patch_size)


def unpack_tokens(tokens: torch.Tensor, height: int, width: int, patch_size: int = 2) -> torch.Tensor:
    """(B, H/p * W/p, C*p*p) -> (B, C, H, W); the inverse of `pack_latent`."""
    return rearrange(
        tokens,
        "b (h w) (c ph pw) -> b c (h ph) (w pw)",
        h=height // patch_size,
        w=width // patch_size,
        ph=patch_size,
        pw=patch_size,
    )


@dataclass
class TokenBatch:
    tokens: torch.Tensor  # (B, L, C*p*p) image tokens, padded with pad_value
    ids: torch.Tensor  # (B, L, axes) position ids, zero on padding
    valid: torch.Tensor  # (B, L) bool: a real token (target or reference)
    target: torch.Tensor  # (B, L) bool: a target token (what the loss sees)
    target_sizes: list[tuple[int, int]]  # per-sample target latent (H, W)
    grid: TokenGrid = DEFAULT_GRID
    reference_sizes: list[list[tuple[int, int]]] = field(default_factory=list)  # per sample, (h, w) each
    uniform_as: bool | None = None  # rows of a larger batch: that batch's answer (`rows`)

    def is_uniform(self) -> bool:
        """Every sample has the same target size and the same reference sizes (no padding)."""
        if self.uniform_as is not None:
            return self.uniform_as
        return len(set(self.target_sizes)) == 1 and all(
            sizes == self.reference_sizes[0] for sizes in self.reference_sizes
        )

    def rows(self, indices: list[int]) -> TokenBatch:
        """Samples `indices` as they are in this batch: its padding, and its way through the
        model (a padded batch stays one even where these rows alone share their sizes)."""
        index = torch.tensor(indices, device=self.tokens.device)
        return TokenBatch(
            self.tokens[index],
            self.ids[index.to(self.ids.device)],
            self.valid[index.to(self.valid.device)],
            self.target[index.to(self.target.device)],
            [self.target_sizes[i] for i in indices],
            self.grid,
            [self.reference_sizes[i] for i in indices] if self.reference_sizes else [],
            self.is_uniform(),
        )

    def sample(self, index: int) -> TokenBatch:
        """Sample `index` alone, without padding (a uniform batch of one)."""
        length = int(self.valid[index].sum())  # real tokens come first, padding after
        return TokenBatch(
            self.tokens[index : index + 1, :length],
            self.ids[index : index + 1, :length],
            self.valid[index : index + 1, :length],
            self.target[index : index + 1, :length],
            [self.target_sizes[index]],
            self.grid,
            [self.reference_sizes[index]] if self.reference_sizes else [],
        )

    def split_latents(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """For a uniform batch: (B, L, D) tokens -> the (B, C, H, W) target and the list of
        (B, C, h, w) references, as ComfyUI's Flux takes them (`x`, `ref_latents`)."""
        if not self.is_uniform():
            raise ValueError("split_latents needs a batch whose samples share all sizes")
        pieces, start = [], 0
        for height, width in [self.target_sizes[0], *self.reference_sizes[0]]:
            patch = self.grid.patch_size
            count = (height // patch) * (width // patch)
            pieces.append(unpack_tokens(tokens[:, start : start + count], height, width, patch))
            start += count
        return pieces[0], pieces[1:]

    def target_latents(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Per sample, the target tokens of `tokens` (B, L, D) unpacked to (C, H, W)."""
        out = []
        for i, (height, width) in enumerate(self.target_sizes):
            rows = tokens[i, self.target[i]]
            out.append(unpack_tokens(rows[None], height, width, self.grid.patch_size)[0])
        return out


def build_token_batch(
    targets: Sequence[torch.Tensor],
    references: Sequence[Sequence[torch.Tensor]],
    layout: str,
    grid: TokenGrid = DEFAULT_GRID,
    pad_value: float = 0.0,
) -> TokenBatch:
    """Pack per-sample (C, H, W) targets and their references into one padded batch."""
    if len(targets) != len(references):
        raise ValueError(f"{len(targets)} targets but {len(references)} reference lists")
    if not targets:
        raise ValueError("an empty batch")
    token_rows, id_rows, target_lengths = [], [], []
    for target, refs in zip(targets, references, strict=True):
        pieces = [pack_latent(target[None], grid.patch_size)[0]] + [
            pack_latent(r[None], grid.patch_size)[0] for r in refs
        ]
        token_rows.append(torch.cat(pieces, dim=0))
        id_rows.append(
            image_position_ids(
                tuple(target.shape[-2:]),
                [tuple(r.shape[-2:]) for r in refs],
                layout,
                grid,
            )
        )
        target_lengths.append(pieces[0].shape[0])
    longest = max(rows.shape[0] for rows in token_rows)
    batch, dim = len(targets), token_rows[0].shape[1]
    tokens = torch.full(
        (batch, longest, dim), pad_value, dtype=token_rows[0].dtype, device=token_rows[0].device
    )
    ids = torch.zeros(batch, longest, grid.axes, dtype=torch.float32, device=tokens.device)
    valid = torch.zeros(batch, longest, dtype=torch.bool, device=tokens.device)
    target = torch.zeros_like(valid)
    for i, (rows, sample_ids, n_target) in enumerate(zip(token_rows, id_rows, target_lengths, strict=True)):
        tokens[i, : rows.shape[0]] = rows
        ids[i, : rows.shape[0]] = sample_ids.to(tokens.device)
        valid[i, : rows.shape[0]] = True
        target[i, :n_target] = True
    return TokenBatch(
        tokens,
        ids,
        valid,
        target,
        [tuple(t.shape[-2:]) for t in targets],
        grid,
        [[tuple(r.shape[-2:]) for r in refs] for refs in references],
    )


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
