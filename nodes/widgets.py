"""Widgets from dataclass fields: a field made with `trainer_core.config.knob` becomes the ComfyUI
input that shows its tooltip and enforces its limits, so a node and its config class cannot
drift apart (TrainLoRA from `TrainConfig`, LoadKontextDataset from `DatasetOptions`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from comfy_api.latest import io

from ..trainer_core.config import ORIGINAL

NUMBER_LIMITS = ("min", "max", "step", "control_after_generate")


def config_widget(
    config_field: dataclasses.Field, dynamic_options: Mapping[str, Callable[[], list[str]]] | None = None
):
    """The widget for one config field: a combo for `options` (or `options_from`, a key of
    `dynamic_options`, for choices only ComfyUI knows), else by the default's type a boolean,
    text, integer or float. Advanced ones are hidden until the node's "Show Advanced"
    (right-click menu; the frontend's own grouping): their values still save and run."""
    meta, default = config_field.metadata, config_field.default
    name, tooltip = config_field.name, meta["tooltip"]
    # added later: optional, so API prompts written before they existed still run (on defaults)
    common = {"default": default, "tooltip": tooltip, "optional": meta["appended"] != ORIGINAL}
    if "options_from" in meta:
        widget = io.Combo.Input(name, options=list(dynamic_options[meta["options_from"]]()), **common)
    elif "options" in meta:
        widget = io.Combo.Input(name, options=list(meta["options"]), **common)
    elif isinstance(default, bool):
        widget = io.Boolean.Input(name, **common)
    elif isinstance(default, str):
        widget = io.String.Input(name, **common)
    else:
        limits = {k: meta[k] for k in NUMBER_LIMITS if k in meta}
        kind = io.Int if isinstance(default, int) else io.Float
        widget = kind.Input(name, **common, **limits)
    if meta["advanced"]:  # these Input classes take no extra_dict argument; as_dict reads it
        widget.extra_dict = {"advanced": True}
    return widget
