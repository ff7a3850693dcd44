"""The demo's inputs: every dataset folder and image the shipped examples name
(`write_example_inputs`), synthetic and deterministic.

- `kontext_demo/`: a Kontext edit dataset: coloured shapes (the references) and the same shapes
  recoloured blue (the targets), with captions, in the one-folder structure; beside it the unseen
  reference `kontext_demo_reference.png` (a red circle) that the Kontext examples load;
- `flux_dev_demo/`: a FLUX.1-dev dataset (no references): coloured shapes on light grey, captioned
  "a <colour> <shape> on a light grey background";
- `dreamomni2_demo/`: two references per sample: a figure (`_control`) and a hat (`_control_1`);
  the target is the figure wearing the hat; beside it `person.png` and `hat.png`, the references
  of the DreamOmni2 and FLUX.2 examples' previews and inference; the same samples in
  `flux2_demo/` for the FLUX.2 examples and in `qwen_edit_demo/` for the Qwen-Image-Edit ones
  (whose model files the demo cannot make).

Each dataset is written once (a marker file records the version) and reused on later runs.
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
# The dataset folders (in input/) and images the examples name.
KONTEXT_FOLDER, FLUX_DEV_FOLDER, DREAMOMNI2_FOLDER = "kontext_demo", "flux_dev_demo", "dreamomni2_demo"
FLUX2_FOLDER = "flux2_demo"  # the FLUX.2 examples' dataset: the DreamOmni2 one (two references)
QWEN_EDIT_FOLDER = "qwen_edit_demo"  # the Qwen-Image-Edit examples': the same
PERSON_IMAGE, HAT_IMAGE = "person.png", "hat.png"
BACKGROUND = (235, 235, 230)


def _draw(size: tuple[int, int], shape: str, box: tuple[int, int, int, int], colour) -> Image.Image:
    image = Image.new("RGB", size, BACKGROUND)
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
    if _written(folder):
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
    (folder / ".demo_dataset").write_text(VERSION)
    return folder


def _written(folder: Path) -> bool:
    marker = folder / ".demo_dataset"
    return marker.is_file() and marker.read_text() == VERSION


def write_flux_dev_dataset(folder: Path, count: int = 8, seed: int = 1) -> Path:
    """Targets without references: a coloured shape on light grey, captioned as the
    flux_dev example's preview prompt is ("a blue circle on a light grey background")."""
    if _written(folder):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    colours = {**COLOURS, "blue": BLUE}
    for index in range(count):
        size = (192, 192) if index % 2 == 0 else (224, 160)
        shape, colour_name = SHAPES[index % len(SHAPES)], rng.choice(sorted(colours))
        side = rng.randint(min(size) // 3, min(size) // 2)
        left, top = rng.randint(8, size[0] - side - 8), rng.randint(8, size[1] - side - 8)
        name = f"{index:02d}_{colour_name}_{shape}"
        _draw(size, shape, (left, top, left + side, top + side), colours[colour_name]).save(
            folder / f"{name}.png"
        )
        (folder / f"{name}.txt").write_text(
            f"a {colour_name} {shape} on a light grey background", encoding="utf-8"
        )
    (folder / ".demo_dataset").write_text(VERSION)
    return folder


def _person(image: Image.Image, centre_x: int, colour) -> tuple[int, int]:
    """A figure (head and body) standing at `centre_x`; returns the top centre of its head."""
    draw = ImageDraw.Draw(image)
    height = image.size[1]
    head = height // 6
    top = height // 3
    draw.ellipse((centre_x - head // 2, top, centre_x + head // 2, top + head), fill=(225, 180, 150))
    draw.rounded_rectangle(
        (centre_x - head, top + head + 4, centre_x + head, height - 8), radius=8, fill=colour
    )
    return centre_x, top


def _hat(image: Image.Image, centre_x: int, bottom: int, colour) -> None:
    """A top hat whose brim rests at `bottom`."""
    draw = ImageDraw.Draw(image)
    brim = image.size[1] // 6
    draw.rectangle((centre_x - brim, bottom - 6, centre_x + brim, bottom), fill=colour)
    draw.rectangle((centre_x - brim // 2, bottom - 6 - brim, centre_x + brim // 2, bottom - 6), fill=colour)


def write_person_and_hat(input_dir: Path) -> tuple[Path, Path]:
    """`person.png` (a figure in a green shirt) and `hat.png` (a red top hat), the preview and
    inference references of the DreamOmni2 and FLUX.2 examples, in a pairing no sample has."""
    person, hat = input_dir / PERSON_IMAGE, input_dir / HAT_IMAGE
    input_dir.mkdir(parents=True, exist_ok=True)
    if not person.is_file():
        image = Image.new("RGB", (160, 160), BACKGROUND)
        _person(image, 80, COLOURS["green"])
        image.save(person)
    if not hat.is_file():
        image = Image.new("RGB", (160, 160), BACKGROUND)
        _hat(image, 80, 100, COLOURS["red"])
        image.save(hat)
    return person, hat


def write_dreamomni2_dataset(folder: Path, count: int = 8, seed: int = 2) -> Path:
    """Two references per sample (`name_control.png` a figure, `name_control_1.png` a hat) and
    the target, the figure wearing the hat, captioned as the example's prompt is."""
    write_person_and_hat(folder.parent)
    if _written(folder):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for index in range(count):
        size = (192, 192) if index % 2 == 0 else (224, 160)
        shirt, hat = rng.sample(sorted(COLOURS), 2)
        centre = rng.randint(size[0] // 3, 2 * size[0] // 3)
        person = Image.new("RGB", size, BACKGROUND)
        _person(person, centre, COLOURS[shirt])
        hat_image = Image.new("RGB", size, BACKGROUND)
        _hat(hat_image, size[0] // 2, size[1] // 2, COLOURS[hat])
        target = person.copy()
        _hat(target, *_person(target, centre, COLOURS[shirt]), COLOURS[hat])
        name = f"{index:02d}_{shirt}_{hat}"
        person.save(folder / f"{name}_control.png")
        hat_image.save(folder / f"{name}_control_1.png")
        target.save(folder / f"{name}.png")
        caption = f"put the {hat} hat from the second image on the person in the first image"
        (folder / f"{name}.txt").write_text(caption, encoding="utf-8")
    (folder / ".demo_dataset").write_text(VERSION)
    return folder


def write_example_inputs(input_dir: Path) -> dict[str, Path]:
    """Every dataset folder and image the shipped examples name, in a ComfyUI input/ folder;
    returns them by name."""
    return {
        KONTEXT_FOLDER: write_demo_dataset(input_dir / KONTEXT_FOLDER),
        REFERENCE_IMAGE: input_dir / REFERENCE_IMAGE,
        FLUX_DEV_FOLDER: write_flux_dev_dataset(input_dir / FLUX_DEV_FOLDER),
        DREAMOMNI2_FOLDER: write_dreamomni2_dataset(input_dir / DREAMOMNI2_FOLDER),
        FLUX2_FOLDER: write_dreamomni2_dataset(input_dir / FLUX2_FOLDER),
        QWEN_EDIT_FOLDER: write_dreamomni2_dataset(input_dir / QWEN_EDIT_FOLDER),
        PERSON_IMAGE: input_dir / PERSON_IMAGE,
        HAT_IMAGE: input_dir / HAT_IMAGE,
    }
