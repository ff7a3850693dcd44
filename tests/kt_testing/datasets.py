"""Small image datasets written to disk for tests and benches, plus counting fake encoders."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def color_image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A reproducible image: a colour gradient plus noise, converted to `mode`."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = rng.uniform(0, 255, size=3)
    pixels = (base + 60 * np.stack([x / width, y / height, (x + y) / (width + height)], -1)) % 255
    pixels = np.clip(pixels + rng.normal(0, 8, pixels.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB").convert(mode)


def write_one_folder(root: Path, names, references: int = 1, size=(64, 48), captions=True) -> Path:
    """`name.png` targets, `name_control[_N].png` references, `name.txt` captions."""
    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        color_image(*size, seed=i).save(root / f"{name}.png")
        for slot in range(references):
            suffix = "_control" if slot == 0 else f"_control_{slot}"
            color_image(*size, seed=1000 * (slot + 1) + i).save(root / f"{name}{suffix}.png")
        if captions:
            (root / f"{name}.txt").write_text(f"make {name} blue", encoding="utf-8")
    return root


def write_parallel(root: Path, names, references: int = 1, size=(64, 48)) -> Path:
    """images/name.png + images/name.txt, control/name.png, control_1/name.png, ..."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        color_image(*size, seed=i).save(root / "images" / f"{name}.png")
        (root / "images" / f"{name}.txt").write_text(f"make {name} blue", encoding="utf-8")
        for slot in range(references):
            folder = root / ("control" if slot == 0 else f"control_{slot}")
            folder.mkdir(exist_ok=True)
            color_image(*size, seed=1000 * (slot + 1) + i).save(folder / f"{name}.png")
    return root


class CountingEncoders:
    """Deterministic stand-ins for a VAE and a text encoder that count their calls.

    Image: 8x8 average pooling of the pixels, tiled to 16 channels (shape of a Flux latent).
    Text: a fixed pseudo-random embedding per caption, seeded by its hash."""

    def __init__(self, image_identity: str = "vae-a", text_identity: str = "text-a"):
        self.image_calls = 0
        self.text_calls = 0
        self.image_identity, self.text_identity = image_identity, text_identity

    def encode_image(self, pixels: np.ndarray) -> torch.Tensor:
        self.image_calls += 1
        tensor = torch.from_numpy(pixels).permute(2, 0, 1)[None]
        pooled = torch.nn.functional.avg_pool2d(tensor, 8)[0]
        return pooled.repeat(6, 1, 1)[:16]

    def encode_text(self, caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        self.text_calls += 1
        seed = int(hashlib.sha256(caption.encode()).hexdigest()[:8], 16)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(4, 8, generator=gen), torch.randn(8, generator=gen)

    def bundle(self):
        from trainer_core.dataset import Encoders

        return Encoders(self.encode_image, self.encode_text, self.image_identity, self.text_identity)


class SampleEncoders(CountingEncoders):
    """`CountingEncoders` with a family's whole-sample encoding (`Encoders.encode_sample`, as
    Qwen-Image-Edit's): the text is the caption's embedding followed by one token per reference
    image (its mean colour), and each reference comes back as a 5-D latent (16, 1, h/8, w/8).
    Its calls are recorded apart (`sample_calls`; `image_calls` and `text_calls` count only
    `encode_image` and `encode_text`)."""

    def __init__(self, *args, sample_identity: str = "sample-a", **kwargs):
        super().__init__(*args, **kwargs)
        self.sample_calls: list[tuple[str, int, bool]] = []  # (caption, images, with references)
        self.sample_identity = sample_identity

    def encode_sample(self, caption: str, images: list[np.ndarray], with_references: bool):
        self.sample_calls.append((caption, len(images), with_references))
        seed = int(hashlib.sha256(caption.encode()).hexdigest()[:8], 16)
        gen = torch.Generator().manual_seed(seed)
        context, pooled = torch.randn(4, 8, generator=gen), torch.randn(8, generator=gen)
        tokens = [torch.from_numpy(image.mean(axis=(0, 1))).float().repeat(3)[:8] for image in images]
        latents = [pooled_latent(image)[:, None] for image in images] if with_references else []
        return torch.cat([context, *(t[None] for t in tokens)]), pooled, latents

    def bundle(self):
        encoders = super().bundle()
        encoders.encode_sample, encoders.sample_identity = self.encode_sample, self.sample_identity
        return encoders


def pooled_latent(pixels: np.ndarray) -> torch.Tensor:
    """`CountingEncoders.encode_image` without the count: 8x8 pooling, 16 channels."""
    tensor = torch.from_numpy(pixels).permute(2, 0, 1)[None]
    return torch.nn.functional.avg_pool2d(tensor, 8)[0].repeat(6, 1, 1)[:16]
