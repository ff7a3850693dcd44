"""Reading one image file into float RGB, converting what can be converted (with a notice)
and describing what cannot (with the file name and a fix).

Converted, never refused: EXIF orientation (applied), transparency (RGBA / LA / P with a
transparent colour: composited onto the background, white unless told otherwise), palette,
grayscale, bilevel, CMYK, 16-bit grayscale (scaled, not truncated to 8 bits).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .sizing import MAX_SIDE

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
WHITE = (1.0, 1.0, 1.0)


class FileProblem(ValueError):
    """A file that cannot be used; the message names it and says what to do."""


@dataclass
class LoadedImage:
    pixels: np.ndarray  # float32 (H, W, 3) in [0, 1], upright
    notices: list[str] = field(default_factory=list)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)"""
        return self.pixels.shape[1], self.pixels.shape[0]


@contextmanager
def _named_problems(path: Path) -> Iterator[None]:
    """Turn every way reading `path` can fail into a FileProblem that names it and the fix."""
    try:
        if path.stat().st_size == 0:
            raise FileProblem(f"{path}: the file is empty (0 bytes); export it again or remove it")
        yield
    except FileProblem:
        raise
    except UnidentifiedImageError:
        raise FileProblem(f"{path}: not a readable image; save it as PNG, JPEG or WebP") from None
    except Image.DecompressionBombError as error:
        raise FileProblem(_too_large(path, error)) from None
    except OSError as error:
        if error.errno is not None:  # from the operating system (permissions, gone), not a decoder
            raise unreadable(path, error) from None
        raise FileProblem(f"{path}: the image is truncated or corrupt ({error}); export it again") from None
    except (SyntaxError, ValueError) as error:
        raise FileProblem(f"{path}: the image is truncated or corrupt ({error}); export it again") from None


def gone(path: Path) -> FileProblem:
    """A dataset file that was there when the folder was checked and is not any more (deleted or
    moved while the dataset encoded, or while the command line loaded its models)."""
    return FileProblem(
        f"{path} is gone: it was moved or deleted after the dataset was checked. Put it back, or take "
        "its sample out of the dataset, and run again"
    )


def unreadable(path: Path, error: OSError) -> FileProblem:
    """The operating system's refusal to read `path` (`error`) as the pack's line naming it."""
    if isinstance(error, FileNotFoundError):
        return gone(path)
    return FileProblem(
        f"{path}: cannot be read ({error.strerror or error}); check that the file exists and that "
        "ComfyUI may read it, or remove it"
    )


def _too_large(path: Path, error: Exception) -> str:
    try:
        width, height = _declared_size(path)
    except Exception:  # the header was readable a moment ago; still name the file and the fix
        return f"{path}: too large to open ({error}); downscale it to at most {MAX_SIDE} px a side"
    return too_large_message(path, width, height)


def too_large_message(path: Path, width: int, height: int) -> str:
    return f"{path}: {width}x{height} px is over the {MAX_SIDE} px limit on a side; downscale it"


def _declared_size(path: Path) -> tuple[int, int]:
    """(width, height) from the header, through PIL's own format plugins but without the
    decompression-bomb check of `Image.open`, which refuses images over ~179 megapixels
    before telling their size. Nothing is decoded."""
    Image.preinit()
    with open(path, "rb") as handle:
        prefix = handle.read(16)
        for format_id in Image.ID:
            factory, accept = Image.OPEN[format_id]
            accepted = accept is None or accept(prefix)
            if accepted and not isinstance(accepted, str):  # a str is PIL's "plugin missing" note
                handle.seek(0)
                return factory(handle, str(path)).size
    raise UnidentifiedImageError(str(path))


def _open(path: Path) -> Image.Image:
    with _named_problems(path):
        image = Image.open(path)
        image.load()
    return image


def upright_size(path: Path) -> tuple[int, int]:
    """(width, height) after EXIF orientation, read from the header only (no decoding). An
    image too large for PIL to open still gives its size, so the caller can refuse it by name."""
    path = Path(path)
    with _named_problems(path):
        try:
            with Image.open(path) as image:
                width, height = image.size
                orientation = image.getexif().get(0x0112, 1)
        except Image.DecompressionBombError:
            return _declared_size(path)
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def _flatten(rgba: np.ndarray, background: tuple[float, float, float]) -> np.ndarray:
    alpha = rgba[..., 3:4]
    return rgba[..., :3] * alpha + np.asarray(background, dtype=np.float32) * (1 - alpha)


def read_image(path: Path, background: tuple[float, float, float] = WHITE) -> LoadedImage:
    """Decode `path` fully into upright float RGB; raise FileProblem if it cannot be used."""
    path = Path(path)
    image = _open(path)
    notices = []
    if image.getexif().get(0x0112, 1) != 1:
        image = ImageOps.exif_transpose(image)
        notices.append(f"{path.name}: rotated upright as its EXIF orientation says")
    mode = image.mode
    if mode == "P":
        has_alpha = "transparency" in image.info
        image = image.convert("RGBA" if has_alpha else "RGB")
        mode = image.mode
        if not has_alpha:
            notices.append(f"{path.name}: palette image converted to RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = np.asarray(image.convert("RGBA"), dtype=np.float32) / 255.0
        notices.append(f"{path.name}: transparency flattened onto a {_name(background)} background")
        return LoadedImage(_flatten(rgba, background).astype(np.float32), notices)
    if mode in ("I;16", "I;16B", "I;16L", "I"):
        # PIL reads 16-bit grayscale PNG / TIFF as I;16 or I; values span 0..65535.
        gray = np.clip(np.asarray(image, dtype=np.float32) / 65535.0, 0.0, 1.0)
        notices.append(f"{path.name}: 16-bit grayscale scaled to [0, 1] (not truncated to 8 bits)")
        return LoadedImage(np.repeat(gray[..., None], 3, axis=-1), notices)
    if mode == "F":
        gray = np.clip(np.asarray(image, dtype=np.float32), 0.0, 1.0)
        notices.append(f"{path.name}: floating-point grayscale clipped to [0, 1]")
        return LoadedImage(np.repeat(gray[..., None], 3, axis=-1), notices)
    if mode != "RGB":
        notices.append(f"{path.name}: {_MODE_NAMES.get(mode, mode)} converted to RGB")
        image = image.convert("RGB")
    return LoadedImage(np.asarray(image, dtype=np.float32) / 255.0, notices)


_MODE_NAMES = {"L": "grayscale", "1": "black-and-white", "CMYK": "CMYK", "YCbCr": "YCbCr", "LAB": "Lab"}


def _name(background: tuple[float, float, float]) -> str:
    if tuple(background) == WHITE:
        return "white"
    if tuple(background) == (0.0, 0.0, 0.0):
        return "black"
    return "rgb(" + ", ".join(f"{round(c * 255)}" for c in background) + ")"
