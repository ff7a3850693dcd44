"""A small synthetic Kontext edit dataset for the demo: coloured shapes (the references) and
the same shapes recoloured blue (the targets), with captions, in the one-folder structure; plus
one unseen reference image beside it in ComfyUI's input folder (`kontext_demo_reference.png`,
a red circle) that the example workflows' previews and the inference example load.

Deterministic; written once (a marker file records the version) and reused on later runs.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

VERSION = "demo-dataset-v1"
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (210, 40, 40), "green": (40, 160, 60), "yellow": (230, 200, 30), "orange": (240, 130, 20)}
BLUE = (40, 70, 220)
REFERENCE_IMAGE = "kontext_demo_reference.png"  # the name the example workflows' LoadImage uses


def _draw(size: tuple[int, int], shape: str, box: tuple[int, int, int, int], colour) -> Image.Image:
    image = Image.new("RGB", size, (235, 235, 230))
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        left, top, right, bottom = box
        draw.polygon([((left + right) // 2, top), (right, bottom), (left, bottom)], fill=colour)
    return image


def write_reference_image(input_dir: Path) -> Path:
    """The red circle the examples edit ("make the red circle blue"), in a size and position no
    training pair has, so the previews and the inference example show the LoRA generalise."""
    path = input_dir / REFERENCE_IMAGE
    if not path.is_file():
        input_dir.mkdir(parents=True, exist_ok=True)
        _draw((160, 160), "circle", (40, 52, 116, 128), COLOURS["red"]).save(path)
    return path


def write_demo_dataset(folder: Path, count: int = 8, seed: int = 0) -> Path:
    """The edit pairs in `folder` (e.g. input/kontext_demo), and `write_reference_image` into the
    folder's parent (input/), where LoadImage lists it."""
    write_reference_image(folder.parent)
    marker = folder / ".demo_dataset"
    if marker.is_file() and marker.read_text() == VERSION:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for index in range(count):
        size = (192, 192) if index % 2 == 0 else (224, 160)  # two aspect buckets
        shape = SHAPES[index % len(SHAPES)]
        colour_name = rng.choice(sorted(COLOURS))
        side = rng.randint(min(size) // 3, min(size) // 2)
        left, top = rng.randint(8, size[0] - side - 8), rng.randint(8, size[1] - side - 8)
        box = (left, top, left + side, top + side)
        name = f"{index:02d}_{colour_name}_{shape}"
        _draw(size, shape, box, COLOURS[colour_name]).save(folder / f"{name}_control.png")
        _draw(size, shape, box, BLUE).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"make the {colour_name} {shape} blue", encoding="utf-8")
    marker.write_text(VERSION)
    return folder
