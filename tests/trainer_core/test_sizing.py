"""The shared image size rule, against hand-computed sizes."""

from __future__ import annotations

import numpy as np
import pytest

from trainer_core.sizing import MAX_SIDE, check_side_cap, fit_to_area, resize_exact


@pytest.mark.parametrize(
    "size,resolution,expected",
    [
        ((1024, 1024), 1024, (1024, 1024)),
        # 1920x1080 at 1024^2: scale sqrt(1048576 / 2073600) = 0.71111; 1365.3 -> 85.3 * 16 -> 1360,
        # 768.0 -> 48 * 16 -> 768
        ((1920, 1080), 1024, (1360, 768)),
        # 500x300 at 512^2: scale sqrt(262144 / 150000) = 1.32198; 661.0 / 16 = 41.31 -> 656;
        # 396.6 / 16 = 24.79 -> 400
        ((500, 300), 512, (656, 400)),
        # keep (0): only crop down to multiples of 16
        ((1000, 750), 0, (992, 736)),
        ((10, 40), 0, (16, 32)),
    ],
)
def test_fit_to_area(size, resolution, expected):
    assert fit_to_area(*size, resolution) == expected


def test_side_cap_names_the_input_and_the_cap():
    check_side_cap(MAX_SIDE, 10, "image_1")
    with pytest.raises(ValueError, match=f"image_2 is {MAX_SIDE + 1}x10; the cap is {MAX_SIDE}"):
        check_side_cap(MAX_SIDE + 1, 10, "image_2")


def test_resize_exact_shape_and_constant_colour():
    pixels = np.full((30, 50, 3), 0.25, dtype=np.float32)
    out = resize_exact(pixels, 32, 16)
    assert out.shape == (16, 32, 3) and out.dtype == np.float32
    assert np.allclose(out, 0.25, atol=1e-5)


def test_resize_exact_center_crops_to_the_target_aspect():
    # Left half black, right half white, 40 wide; cropping to a square keeps the middle 20
    # columns, so the result is still half black, half white.
    pixels = np.zeros((20, 40, 3), dtype=np.float32)
    pixels[:, 20:] = 1.0
    out = resize_exact(pixels, 16, 16)
    assert out[:, :6].max() < 0.1 and out[:, 10:].min() > 0.9
