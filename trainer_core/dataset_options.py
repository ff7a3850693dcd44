"""What LoadKontextDataset holds: one field per widget, in widget order, with its tooltip and
limits (`dataclasses.fields(DatasetOptions)[i].metadata`). The node and the run config file are
both built from this class."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .choices import Background
from .config import check_choices, knob
from .limits import check_number
from .sizing import MAX_SIDE

USE_PATH = "(absolute path below)"  # the `folder` choice that defers to `path`
CACHE_FOLDER_NAME = "kontext_trainer_cache"  # under ComfyUI's output folder
BACKGROUNDS = {
    Background.WHITE: (1.0, 1.0, 1.0),
    Background.BLACK: (0.0, 0.0, 0.0),
    Background.GRAY: (0.5, 0.5, 0.5),
}
# `knob(options_from=...)`: choices only ComfyUI knows (its input folders); the node fills them in
INPUT_SUBFOLDERS = "input_subfolders"


@dataclass
class DatasetOptions:
    folder: str = knob(
        USE_PATH, "A folder of ComfyUI's input directory holding the dataset.", options_from=INPUT_SUBFOLDERS
    )
    path: str = knob("", "Or an absolute path to the dataset folder (wins if set).")
    resolution: int = knob(
        1024,
        "Targets are scaled to about this many pixels squared, aspect kept, sides multiples of 16; each "
        "distinct size is a bucket and batches never mix buckets.",
        min=128,
        max=2048,
        step=64,
    )
    reference_resolution: int = knob(
        1024,
        "References are sized exactly as MultiImageConditioning sizes them at inference (same rule, same "
        "number); 0 keeps their size, cropped to multiples of 16.",
        min=0,
        max=MAX_SIDE,
        step=16,
    )
    min_size: int = knob(
        256,
        "Images whose shorter side is below this many pixels are reported as problems.",
        min=0,
        max=MAX_SIDE,
    )
    background: Background = knob(
        Background.WHITE, "Transparent pixels are composited onto this colour.", choices=Background
    )
    hold_out: int = knob(0, "Samples kept out of training for validation.", min=0, max=10000)
    seed: int = knob(
        0,
        "Chooses the held-out samples.",
        min=0,
        max=2**31 - 1,
        control_after_generate=False,  # a dataset split must not change between runs
    )
    cache_folder: str = knob(
        "", f"Where latents and embeddings are cached; empty = output/{CACHE_FOLDER_NAME}."
    )

    def __post_init__(self):
        # 1) text where text belongs (folders are resolved later, where ComfyUI's folders are known)
        for name in ("folder", "path", "cache_folder"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be text; got {getattr(self, name)!r}")
        # 2) every number an integer within its widget's limits
        for option in fields(self):
            if "min" in option.metadata:
                value = getattr(self, option.name)
                check_number(option.name, value, option.metadata["min"], option.metadata.get("max"))
                if not isinstance(value, int):
                    raise ValueError(f"{option.name} must be a whole number; got {value!r}")
        # 3) choices
        check_choices(self)
