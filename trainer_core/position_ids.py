"""Position ids of the image tokens for Flux with reference images: one implementation for
every layout, used by training and by inference alike.

Flux gives each image token three RoPE coordinates: (domain index, row, column), rows and
columns in patch units. The target image is domain 0 at the origin; the reference layouts
differ in where they place each reference:

- ``offset`` (ComfyUI's default for Kontext): every reference has index 1; each one goes to
  the right of, or below, the bounding box of the previous ones, whichever keeps the box
  more square.
- ``index``: reference i has index (i + 1) * ref_index_scale, no offsets.
- ``uxo``: index 0, references placed diagonally after the target.
- ``dreamomni2``: reference i has index i + 1, rows from 0, columns shifted by the summed
  patch widths of the references before it (DreamOmni2's pipeline).

With one reference, ``offset``, ``index`` and ``dreamomni2`` all give plain Kontext ids
(index 1, no offset). ``offset``/``index``/``uxo`` reproduce ComfyUI 0.3.75
(`comfy/ldm/flux/model.py`: `Flux._forward` and `process_img`) value for value; the tests
check that against ComfyUI's own forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUTS = ("offset", "index", "uxo", "dreamomni2")
# Layouts ComfyUI's Flux knows by name (its `ref_latents_method`); others need our ids patched in.
COMFY_NATIVE_LAYOUTS = ("offset", "index", "uxo")

LatentSize = tuple[int, int]  # (height, width) of a latent, in latent pixels


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown reference layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def patch_grid(size: LatentSize, patch_size: int = 2) -> tuple[int, int]:
    """Rows and columns of patches for a latent; a ragged edge is padded, as ComfyUI does."""
    height, width = size
    return (height + patch_size // 2) // patch_size, (width + patch_size // 2) // patch_size


def grid_ids(
    size: LatentSize, index: float, row_offset: float, col_offset: float, patch_size: int = 2
) -> torch.Tensor:
    """Ids of one image's tokens in raster order, shape (rows * cols, 3); offsets in patches."""
    rows, cols = patch_grid(size, patch_size)
    ids = torch.zeros(rows, cols, 3, dtype=torch.float32)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(rows, dtype=torch.float32)[:, None] + row_offset
    ids[..., 2] = torch.arange(cols, dtype=torch.float32)[None, :] + col_offset
    return ids.reshape(rows * cols, 3)


def _latent_to_patches(offset: int, patch_size: int) -> int:
    # ComfyUI keeps the running offsets in latent pixels and rounds them to patches like this.
    return (offset + patch_size // 2) // patch_size


def reference_placements(
    target: LatentSize,
    references: Sequence[LatentSize],
    layout: str,
    patch_size: int = 2,
    ref_index_scale: float = 1.0,
) -> list[tuple[float, int, int]]:
    """(index, row offset, column offset) of each reference, offsets in patch units."""
    check_layout(layout)
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
        elif layout == "index":
            index += ref_index_scale
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
    patch_size: int = 2,
    ref_index_scale: float = 1.0,
) -> torch.Tensor:
    """Ids of one sample's image tokens: target first, then each reference. Shape (L, 3)."""
    parts = [grid_ids(target, 0.0, 0, 0, patch_size)]
    for size, (index, row_off, col_off) in zip(
        references, reference_placements(target, references, layout, patch_size, ref_index_scale), strict=True
    ):
        parts.append(grid_ids(size, index, row_off, col_off, patch_size))
    return torch.cat(parts, dim=0)
