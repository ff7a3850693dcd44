"""Position ids of the image tokens for Flux with reference images: one implementation for
every layout, used by training and by inference alike.

FLUX.1 gives each image token three RoPE coordinates: (domain index, row, column), rows and
columns in patch units (2x2 latent pixels). FLUX.2 has a fourth axis (zero on image tokens,
the token's position on text tokens) and 1x1 patches of its 128-channel latents; its index
layout steps by 10 (ComfyUI's `ref_index_scale`). A `TokenGrid` carries those three facts of
a model. The target image is domain 0 at the origin; the reference layouts differ in where
they place each reference:

- ``offset`` (ComfyUI's default for Kontext): every reference has index 1; each one goes to
  the right of, or below, the bounding box of the previous ones, whichever keeps the box
  more square.
- ``index``: reference i has index (i + 1) * ref_index_scale, no offsets.
- ``uxo``: index 0, references placed diagonally after the target.
- ``dreamomni2``: reference i has index i + 1, rows from 0, columns shifted by the summed
  patch widths of the references before it (DreamOmni2's pipeline).
- ``index_timestep_zero`` (ComfyUI 0.33+, FLUX.2): the ``index`` ids; ComfyUI's Flux then
  modulates the reference tokens with the embedding of timestep 0 instead of the sample's
  timestep (its `timestep_zero_index`). Only the ids are computed here.

With one reference, ``offset``, ``index`` and ``dreamomni2`` all give plain Kontext ids
(index 1, no offset). ``offset``/``index``/``uxo`` reproduce ComfyUI 0.3.75
(`comfy/ldm/flux/model.py`: `Flux._forward` and `process_img`) value for value, for FLUX.1
and FLUX.2; the tests check that against ComfyUI's own forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ....trainer_core.choices import Layout, choose

LAYOUTS = tuple(layout for layout in Layout if layout is not Layout.AUTO)  # the ids layouts
# Layouts every supported ComfyUI's Flux knows by name (its `ref_latents_method`), for FLUX.1
# and FLUX.2; others need our ids patched in (index_timestep_zero: ComfyUI 0.33+, FLUX.2 only).
COMFY_NATIVE_LAYOUTS = (Layout.OFFSET, Layout.INDEX, Layout.UXO)
# Layouts whose references ComfyUI modulates with timestep 0 (ComfyUI 0.33's Flux).
TIMESTEP_ZERO_LAYOUTS = (Layout.INDEX_TIMESTEP_ZERO,)

LatentSize = tuple[int, int]  # (height, width) of a latent, in latent pixels


@dataclass(frozen=True)
class TokenGrid:
    """How a model turns latents into tokens and ids (its family gives it:
    `FluxFamily.token_grid`). The default: 2x2 patches, three RoPE axes (index, row, column),
    index steps of 1."""

    patch_size: int = 2
    axes: int = 3  # RoPE axes: (index, row, column) [+ a text position axis, on some models]
    ref_index_scale: float = 1.0  # the index step of the `index` layout
    default_layout: str = "offset"  # the model's own layout (ComfyUI's default for it): `auto`


DEFAULT_GRID = TokenGrid()


def resolve_layout(layout: str, grid: TokenGrid = DEFAULT_GRID) -> str:
    """`auto` as the model's own layout (`grid.default_layout`); any other as it is."""
    return grid.default_layout if layout == Layout.AUTO else str(layout)


def check_layout(layout: str) -> Layout:
    """A layout ids can be computed for (`auto` must have been resolved first: `resolve_layout`)."""
    chosen = choose(Layout, layout, "layout")
    if chosen is Layout.AUTO:
        raise ValueError("layout 'auto' is the model's own layout: resolve it with the model first")
    return chosen


def patch_grid(size: LatentSize, patch_size: int = 2) -> tuple[int, int]:
    """Rows and columns of patches for a latent; a ragged edge is padded, as ComfyUI does."""
    height, width = size
    return (height + patch_size // 2) // patch_size, (width + patch_size // 2) // patch_size


def grid_ids(
    size: LatentSize,
    index: float,
    row_offset: float,
    col_offset: float,
    patch_size: int = 2,
    axes: int = 3,
) -> torch.Tensor:
    """Ids of one image's tokens in raster order, shape (rows * cols, axes); offsets in
    patches; any axis after the column (FLUX.2's fourth) is zero on image tokens."""
    rows, cols = patch_grid(size, patch_size)
    ids = torch.zeros(rows, cols, axes, dtype=torch.float32)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(rows, dtype=torch.float32)[:, None] + row_offset
    ids[..., 2] = torch.arange(cols, dtype=torch.float32)[None, :] + col_offset
    return ids.reshape(rows * cols, axes)


def text_position_ids(batch: int, length: int, axes: int = 3, device=None) -> torch.Tensor:
    """(batch, length, axes) ids of the text tokens: zero on FLUX.1; on FLUX.2 the fourth axis
    counts the tokens 0 .. length - 1 (ComfyUI's `Flux._forward` for 4 axes)."""
    ids = torch.zeros(batch, length, axes, dtype=torch.float32, device=device)
    if axes == 4:
        ids[..., 3] = torch.arange(length, dtype=torch.float32, device=device)
    return ids


def _latent_to_patches(offset: int, patch_size: int) -> int:
    # ComfyUI keeps the running offsets in latent pixels and rounds them to patches like this.
    return (offset + patch_size // 2) // patch_size


def reference_placements(
    target: LatentSize,
    references: Sequence[LatentSize],
    layout: str,
    grid: TokenGrid = DEFAULT_GRID,
) -> list[tuple[float, int, int]]:
    """(index, row offset, column offset) of each reference, offsets in patch units."""
    layout = str(check_layout(resolve_layout(layout, grid)))
    patch_size = grid.patch_size
    target_rows, target_cols = patch_grid(target, patch_size)
    placements = []
    box_h = box_w = 0  # running extents in latent pixels (offset and uxo layouts)
    index = 0.0
    dreamomni2_cols = 0
    for ref_h, ref_w in references:
        if layout == "offset":
            # 1) go right if stacking below would make the box taller than wide, else go below
            h_off = w_off = 0
            if ref_h + box_h > ref_w + box_w:
                w_off = box_w
            else:
                h_off = box_h
            # 2) the bounding box grows to hold the new reference
            box_h, box_w = max(box_h, ref_h + h_off), max(box_w, ref_w + w_off)
            placements.append(
                (1.0, _latent_to_patches(h_off, patch_size), _latent_to_patches(w_off, patch_size))
            )
        elif layout in ("index", "index_timestep_zero"):
            index += grid.ref_index_scale
            placements.append((index, 0, 0))
        elif layout == "uxo":
            h_off = target_rows * patch_size + box_h
            w_off = target_cols * patch_size + box_w
            box_h, box_w = box_h + ref_h, box_w + ref_w
            placements.append(
                (0.0, _latent_to_patches(h_off, patch_size), _latent_to_patches(w_off, patch_size))
            )
        else:  # dreamomni2
            placements.append((float(len(placements) + 1), 0, dreamomni2_cols))
            dreamomni2_cols += patch_grid((ref_h, ref_w), patch_size)[1]
    return placements


def image_position_ids(
    target: LatentSize,
    references: Sequence[LatentSize],
    layout: str,
    grid: TokenGrid = DEFAULT_GRID,
) -> torch.Tensor:
    """Ids of one sample's image tokens: target first, then each reference. Shape (L, axes)."""
    parts = [grid_ids(target, 0.0, 0, 0, grid.patch_size, grid.axes)]
    for size, (index, row_off, col_off) in zip(
        references, reference_placements(target, references, layout, grid), strict=True
    ):
        parts.append(grid_ids(size, index, row_off, col_off, grid.patch_size, grid.axes))
    return torch.cat(parts, dim=0)
