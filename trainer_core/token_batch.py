"""Latents in a model's token space, and mixed-size batches with masks, for any model family.

A sample is a target latent plus zero or more reference latents of one rank: (C, H, W) for an
image model such as FLUX, (C, T, H, W) for a video-latent one such as Qwen-Image (T = 1). Its
tokens are the target's p x p patches of the last two axes in raster order (leading axes
outermost), then each reference's, as ComfyUI's transformers concatenate them. Samples of
different sizes are padded to a common length; `valid` marks real tokens, `target` marks the
tokens the loss may use (target image only: never references, never padding).

What a model adds to the tokens (FLUX's position ids) is its family's: a family packs with
`build_token_batch` and returns a subclass carrying its own fields (`families/flux/`). The loss
(`flow_step`) reads only what is here and gets the packing as a `Pack`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from einops import rearrange

LatentShape = tuple[int, ...]  # a latent's shape without the batch axis: (C, [T,] H, W)


def pack_latent(latent: torch.Tensor, patch_size: int = 2) -> torch.Tensor:
    """(B, C, *lead, H, W) -> (B, prod(lead) * H/p * W/p, C*p*p): p x p patches of the last
    two axes in raster order, leading axes (a video latent's frames) outermost."""
    height, width = latent.shape[-2:]
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"latent size {height}x{width} is not a multiple of the patch size {patch_size}; "
            "image sides must be multiples of 16 pixels"
        )
    flat = latent.reshape(*latent.shape[:2], -1, height, width)  # leading axes as one
    return rearrange(flat, "b c t (h ph) (w pw) -> b (t h w) (c ph pw)", ph=patch_size, pw=patch_size)


def unpack_tokens(tokens: torch.Tensor, shape: LatentShape, patch_size: int = 2) -> torch.Tensor:
    """(B, prod(lead) * H/p * W/p, C*p*p) -> (B, *shape); the inverse of `pack_latent` for
    latents of `shape` (C, *lead, H, W)."""
    channels, *lead, height, width = shape
    flat = rearrange(
        tokens,
        "b (t h w) (c ph pw) -> b c t (h ph) (w pw)",
        t=math.prod(lead),
        h=height // patch_size,
        w=width // patch_size,
        ph=patch_size,
        pw=patch_size,
    )
    return flat.reshape(tokens.shape[0], channels, *lead, height, width)


def whole_patches(shape: LatentShape, patch_size: int) -> LatentShape:
    """`shape` with its last two sides rounded up to whole patches (a padded latent's shape)."""
    *lead, height, width = shape
    return (*lead, -(-height // patch_size) * patch_size, -(-width // patch_size) * patch_size)


def token_count(shape: LatentShape, patch_size: int) -> int:
    """How many tokens a latent of `shape` (C, *lead, H, W) packs into (padded to whole patches)."""
    *_, height, width = whole_patches(shape, patch_size)
    return math.prod(shape[1:-2]) * (height // patch_size) * (width // patch_size)


def _unpack(tokens: torch.Tensor, shape: LatentShape, patch_size: int) -> torch.Tensor:
    """`unpack_tokens` for a latent of `shape` that may have been padded to whole patches: the
    padding cut off again."""
    height, width = shape[-2:]
    return unpack_tokens(tokens, whole_patches(shape, patch_size), patch_size)[..., :height, :width]


@dataclass
class TokenBatch:
    """Every tensor field is (B, L, ...) over the batch's padded tokens, and every list field
    has one entry per sample: `rows` and `sample` cut a subclass's own fields the same way."""

    tokens: torch.Tensor  # (B, L, C*p*p) image tokens, padded with pad_value
    valid: torch.Tensor  # (B, L) bool: a real token (target or reference)
    target: torch.Tensor  # (B, L) bool: a target token (what the loss sees)
    shapes: list[list[LatentShape]]  # per sample: the target's latent shape, then each reference's
    # (as given: a side that is not whole patches was padded by the family's `pad` to pack it)
    patch_size: int = 2
    uniform_as: bool | None = None  # rows of a larger batch: that batch's answer (`rows`)

    @property
    def target_sizes(self) -> list[tuple[int, int]]:
        """Per sample, the target latent's (H, W)."""
        return [tuple(shapes[0][-2:]) for shapes in self.shapes]

    @property
    def reference_sizes(self) -> list[list[tuple[int, int]]]:
        """Per sample, each reference latent's (H, W)."""
        return [[tuple(shape[-2:]) for shape in shapes[1:]] for shapes in self.shapes]

    def is_uniform(self) -> bool:
        """Every sample has the same target shape and the same reference shapes (no padding)."""
        if self.uniform_as is not None:
            return self.uniform_as
        return all(shapes == self.shapes[0] for shapes in self.shapes)

    def _cut(self, index: torch.Tensor, samples: list[int], length: int | None, **changes) -> TokenBatch:
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                if value.shape[:2] != self.valid.shape:
                    raise TypeError(f"{type(self).__name__}.{f.name} is not (batch, tokens, ...)")
                value = value[index.to(value.device)]
                value = value[:, :length] if length is not None else value
            elif isinstance(value, list):
                value = [value[i] for i in samples]
            fields[f.name] = value
        return dataclasses.replace(self, **{**fields, **changes})

    def rows(self, indices: list[int]) -> TokenBatch:
        """Samples `indices` as they are in this batch: its padding, and its way through the
        model (a padded batch stays one even where these rows alone share their shapes)."""
        return self._cut(torch.tensor(indices), indices, None, uniform_as=self.is_uniform())

    def sample(self, index: int) -> TokenBatch:
        """Sample `index` alone, without padding (a uniform batch of one)."""
        length = int(self.valid[index].sum())  # real tokens come first, padding after
        return self._cut(torch.tensor([index]), [index], length, uniform_as=None)

    def split_latents(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """For a uniform batch: (B, L, D) tokens -> the (B, *shape) target and the list of
        (B, *shape) references, as ComfyUI's transformers take them (`x`, `ref_latents`)."""
        if not self.is_uniform():
            raise ValueError("split_latents needs a batch whose samples share all shapes")
        pieces, start = [], 0
        for shape in self.shapes[0]:
            count = token_count(shape, self.patch_size)
            pieces.append(_unpack(tokens[:, start : start + count], shape, self.patch_size))
            start += count
        return pieces[0], pieces[1:]

    def target_latents(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Per sample, the target tokens of `tokens` (B, L, D) unpacked to the target's shape."""
        return [
            _unpack(tokens[i, self.target[i]][None], shapes[0], self.patch_size)[0]
            for i, shapes in enumerate(self.shapes)
        ]


# (targets, their references) -> the family's token batch: how a run packs its samples
Pack = Callable[[Sequence[torch.Tensor], Sequence[Sequence[torch.Tensor]]], TokenBatch]


def build_token_batch(
    targets: Sequence[torch.Tensor],
    references: Sequence[Sequence[torch.Tensor]],
    patch_size: int = 2,
    pad_value: float = 0.0,
    pad: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> TokenBatch:
    """Pack per-sample (C, *lead, H, W) targets and their references into one padded batch.
    `pad`: the model's own padding of a (1, C, *lead, H, W) latent whose sides are not whole
    patches (ComfyUI's `pad_to_patch_size`); without it such a latent is refused."""
    if len(targets) != len(references):
        raise ValueError(f"{len(targets)} targets but {len(references)} reference lists")
    if not targets:
        raise ValueError("an empty batch")
    token_rows, target_lengths = [], []
    for target, refs in zip(targets, references, strict=True):
        pieces = [
            pack_latent(latent[None] if pad is None else pad(latent[None]), patch_size)[0]
            for latent in (target, *refs)
        ]
        token_rows.append(torch.cat(pieces, dim=0))
        target_lengths.append(pieces[0].shape[0])
    longest = max(rows.shape[0] for rows in token_rows)
    batch, dim = len(targets), token_rows[0].shape[1]
    tokens = torch.full(
        (batch, longest, dim), pad_value, dtype=token_rows[0].dtype, device=token_rows[0].device
    )
    valid = torch.zeros(batch, longest, dtype=torch.bool, device=tokens.device)
    target = torch.zeros_like(valid)
    for i, (rows, n_target) in enumerate(zip(token_rows, target_lengths, strict=True)):
        tokens[i, : rows.shape[0]] = rows
        valid[i, : rows.shape[0]] = True
        target[i, :n_target] = True
    shapes = [
        [tuple(latent.shape) for latent in (t, *refs)] for t, refs in zip(targets, references, strict=True)
    ]
    return TokenBatch(tokens, valid, target, shapes, patch_size)
