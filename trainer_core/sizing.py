"""The one size rule for reference (and, later, dataset) images, so that training and
inference see the same shapes.

Rule: keep the aspect ratio, scale to about `resolution` x `resolution` pixels of area, round
each side to a multiple of 16 (8x VAE downscale times Flux's 2x2 patches), then center-crop
the few pixels the rounding changes and resize with Lanczos. `resolution = 0` keeps the size
and only crops each side down to a multiple of 16. Inputs larger than MAX_SIDE on a side are
refused: they would cost minutes of VAE time and gigabytes of memory for no gain.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

MULTIPLE = 16
MAX_SIDE = 4096  # pixels, either side, before resizing
MIN_SIDE = MULTIPLE


def fit_to_area(width: int, height: int, resolution: int, multiple: int = MULTIPLE) -> tuple[int, int]:
    """Target (width, height) for an image: aspect kept, area ~ resolution**2, sides % multiple == 0."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if resolution == 0:  # keep: only ever crop down to a multiple, never stretch up
        return max(multiple, width // multiple * multiple), max(multiple, height // multiple * multiple)
    # 1) the scale that brings the area to resolution**2
    scale = math.sqrt(resolution * resolution / (width * height))
    # 2) round each side to the nearest multiple, never below one multiple
    return (
        max(multiple, round(width * scale / multiple) * multiple),
        max(multiple, round(height * scale / multiple) * multiple),
    )


def check_side_cap(width: int, height: int, what: str) -> None:
    if max(width, height) > MAX_SIDE:
        raise ValueError(
            f"{what} is {width}x{height}; the cap is {MAX_SIDE} pixels on a side. "
            f"Downscale it before loading."
        )


def resize_exact(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """Center-crop to the target aspect ratio, then Lanczos-resize. float32 HWC in [0, 1]."""
    src_h, src_w = pixels.shape[:2]
    if (src_w, src_h) == (width, height):
        return pixels.astype(np.float32, copy=False)
    # 1) crop the source to the target aspect ratio, centred
    target_aspect = width / height
    if src_w / src_h > target_aspect:
        crop_w, crop_h = max(1, round(src_h * target_aspect)), src_h
    else:
        crop_w, crop_h = src_w, max(1, round(src_w / target_aspect))
    left, top = (src_w - crop_w) // 2, (src_h - crop_h) // 2
    cropped = pixels[top : top + crop_h, left : left + crop_w]
    # 2) resize each channel as a float image (no 8-bit rounding)
    channels = [
        Image.fromarray(np.ascontiguousarray(cropped[..., c], dtype=np.float32), mode="F").resize(
            (width, height), Image.Resampling.LANCZOS
        )
        for c in range(cropped.shape[2])
    ]
    return np.clip(np.stack([np.asarray(ch) for ch in channels], axis=-1), 0.0, 1.0).astype(np.float32)
