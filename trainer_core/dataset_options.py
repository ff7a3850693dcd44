"""What LoadKontextDataset holds: one field per widget, with its type, default and limits
(`dataclasses.fields(DatasetOptions)[i].metadata`). The node and the run config file's [dataset]
are both built from this class (their tooltips and order: `application/widget_schema.py`)."""

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


@dataclass
class DatasetOptions:
    folder: str = knob(USE_PATH)
    path: str = knob("")
    resolution: int = knob(1024, min=128, max=2048, step=64)
    reference_resolution: int = knob(1024, min=0, max=MAX_SIDE, step=16)
    min_size: int = knob(256, min=0, max=MAX_SIDE)
    background: Background = knob(Background.WHITE, choices=Background)
    hold_out: int = knob(0, min=0, max=10000)
    seed: int = knob(0, min=0, max=2**31 - 1)
    cache_folder: str = knob("")

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
