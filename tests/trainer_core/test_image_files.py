"""Image decoding: conversions computed by hand, and unusable files named with a fix."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from kt_testing.bad_files import write_huge_png
from trainer_core.image_files import FileProblem, read_image, upright_size


def test_rgb_is_scaled_to_unit_range(tmp_path):
    pixels = np.array([[[0, 128, 255], [10, 20, 30]]], dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(tmp_path / "a.png")
    loaded = read_image(tmp_path / "a.png")
    np.testing.assert_allclose(loaded.pixels, pixels / 255.0, atol=1e-7)
    assert loaded.notices == [] and loaded.pixels.dtype == np.float32


def test_transparency_is_flattened_onto_the_background(tmp_path):
    rgba = np.array([[[200, 100, 0, 255], [200, 100, 0, 0], [0, 0, 255, 51]]], dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    white = read_image(tmp_path / "a.png").pixels
    # by hand: colour * alpha + background * (1 - alpha), alpha = A / 255
    np.testing.assert_allclose(white[0, 0], [200 / 255, 100 / 255, 0], atol=1e-6)
    np.testing.assert_allclose(white[0, 1], [1, 1, 1], atol=1e-6)
    np.testing.assert_allclose(white[0, 2], [0.8, 0.8, 0.2 + 0.8], atol=1e-6)
    black = read_image(tmp_path / "a.png", background=(0.0, 0.0, 0.0))
    np.testing.assert_allclose(black.pixels[0, 2], [0, 0, 0.2], atol=1e-6)
    assert "transparency flattened onto a black background" in black.notices[0]


def test_gray_alpha_and_palette_with_transparency(tmp_path):
    la = np.array([[[100, 255], [100, 0]]], dtype=np.uint8)
    Image.fromarray(la, "LA").save(tmp_path / "la.png")
    np.testing.assert_allclose(
        read_image(tmp_path / "la.png").pixels[0], [[100 / 255] * 3, [1, 1, 1]], atol=1e-6
    )

    palette = Image.new("P", (2, 1))
    palette.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    palette.putpixel((0, 0), 0)
    palette.putpixel((1, 0), 1)
    palette.save(tmp_path / "p.png", transparency=1)
    loaded = read_image(tmp_path / "p.png")
    np.testing.assert_allclose(loaded.pixels[0], [[1, 0, 0], [1, 1, 1]], atol=1e-6)

    palette.save(tmp_path / "opaque.png")
    loaded = read_image(tmp_path / "opaque.png")
    np.testing.assert_allclose(loaded.pixels[0], [[1, 0, 0], [0, 1, 0]], atol=1e-6)
    assert "palette image converted to RGB" in loaded.notices[0]


def test_cmyk_and_grayscale_become_rgb(tmp_path):
    cmyk = np.array([[[0, 0, 0, 0], [0, 0, 0, 255], [255, 0, 0, 0]]], dtype=np.uint8)
    Image.fromarray(cmyk, "CMYK").save(tmp_path / "c.jpg", quality=100)
    Image.fromarray(cmyk, "CMYK").save(tmp_path / "c.tif")  # lossless, for exact values
    loaded = read_image(tmp_path / "c.tif")
    np.testing.assert_allclose(loaded.pixels[0], [[1, 1, 1], [0, 0, 0], [0, 1, 1]], atol=1e-6)
    assert "CMYK converted to RGB" in loaded.notices[0]
    Image.fromarray(np.array([[7, 250]], dtype=np.uint8), "L").save(tmp_path / "g.png")
    np.testing.assert_allclose(
        read_image(tmp_path / "g.png").pixels[0], [[7 / 255] * 3, [250 / 255] * 3], atol=1e-6
    )


def test_16_bit_grayscale_keeps_its_precision(tmp_path):
    values = np.array([[0, 1000, 65535]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "deep.png")  # uint16 -> a 16-bit grayscale PNG
    loaded = read_image(tmp_path / "deep.png")
    np.testing.assert_allclose(loaded.pixels[0, :, 0], values[0] / 65535.0, rtol=1e-6)
    assert loaded.pixels[0, 1, 0] != round(1000 / 257) / 255  # not truncated to 8 bits
    assert "16-bit" in loaded.notices[0]


def test_exif_orientation_is_applied(tmp_path):
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[0, 0] = [255, 0, 0]  # stored top-left
    image = Image.fromarray(pixels, "RGB")
    exif = image.getexif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    image.save(tmp_path / "rot.jpg", exif=exif, quality=100)
    assert upright_size(tmp_path / "rot.jpg") == (20, 40)
    loaded = read_image(tmp_path / "rot.jpg")
    assert loaded.size == (20, 40)
    expected = np.rot90(pixels, k=-1)  # clockwise, by numpy
    assert np.unravel_index(loaded.pixels[..., 0].argmax(), (40, 20)) == np.unravel_index(
        expected[..., 0].argmax(), (40, 20)
    )
    assert "EXIF" in loaded.notices[0]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "the file is empty \\(0 bytes\\)"),
        (b"this is not an image at all", "not a readable image"),
    ],
)
def test_unusable_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.png"
    path.write_bytes(content)
    with pytest.raises(FileProblem, match=f"^{path}: {message}"):
        read_image(path)


def test_truncated_file_is_named(tmp_path):
    from kt_testing.datasets import color_image

    color_image(64, 64, seed=1).save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(FileProblem, match=r"cut\.png: the image is truncated or corrupt"):
        read_image(tmp_path / "cut.png")


def test_an_image_too_large_for_pil_is_named_with_its_size(tmp_path):
    path = write_huge_png(tmp_path / "big.png", 20000, 20000)  # 400 MP: PIL's Image.open refuses it
    assert upright_size(path) == (20000, 20000)  # from the header, nothing decoded
    with pytest.raises(FileProblem) as caught:
        read_image(path)
    assert str(caught.value) == f"{path}: 20000x20000 px is over the 4096 px limit on a side; downscale it"


def test_files_the_system_cannot_read_are_named(tmp_path):
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(FileProblem, match=r"folder\.png: cannot be read \(Is a directory\)"):
        read_image(tmp_path / "folder.png")
    with pytest.raises(FileProblem, match=r"gone\.png is gone: it was moved or deleted after the dataset"):
        upright_size(tmp_path / "gone.png")
