"""A node's widgets from the widget schema: each `application.widget_schema.Widget` row becomes
the ComfyUI input for its dataclass field, in the table's order, with the row's tooltip and
advanced flag and the field's default and limits, so a node, its config class and the run file
cannot drift apart."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from comfy_api.latest import io

from ..application.widget_schema import Widget

NUMBER_LIMITS = ("min", "max", "step")


def widgets(
    rows: Sequence[Widget],
    owners: Sequence[type],
    dynamic_options: Mapping[str, Callable[[], list[str]]] | None = None,
) -> list:
    """The inputs for `rows`, each the field of that name in one of the dataclasses `owners`."""
    by_name = {f.name: f for owner in owners for f in dataclasses.fields(owner)}
    return [config_widget(by_name[row.name], row, dynamic_options or {}) for row in rows]


def config_widget(config_field: dataclasses.Field, row: Widget, dynamic_options: Mapping[str, Callable]):
    """The widget for one field: a combo for the row's `options_from` (choices only ComfyUI
    knows, listed when the node is) or the field's `options`, else by the default's type a
    boolean, text, integer or float. Advanced ones are hidden until the node's "Show Advanced"
    (right-click menu; the frontend's own grouping): their values still save and run."""
    meta, default, name = config_field.metadata, config_field.default, config_field.name
    common = {"default": default, "tooltip": row.tooltip, "optional": row.optional}
    if row.options_from is not None:
        widget = io.Combo.Input(name, options=list(dynamic_options[row.options_from]()), **common)
    elif "options" in meta:
        widget = io.Combo.Input(name, options=list(meta["options"]), **common)
    elif isinstance(default, bool):
        widget = io.Boolean.Input(name, **common)
    elif isinstance(default, str):
        widget = io.String.Input(name, **common)
    else:
        limits = {k: meta[k] for k in NUMBER_LIMITS if k in meta}
        if row.control_after_generate is not None:
            limits["control_after_generate"] = row.control_after_generate
        kind = io.Int if isinstance(default, int) else io.Float
        widget = kind.Input(name, **common, **limits)
    if row.advanced:  # these Input classes take no extra_dict argument; as_dict reads it
        widget.extra_dict = {"advanced": True}
    return widget
