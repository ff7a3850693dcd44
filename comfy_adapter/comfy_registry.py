"""ComfyUI's node registry: the node classes ComfyUI has registered, the stock ones and the
pack's (the server registers the pack's when it loads it; the CLI's boot does the same)."""

from __future__ import annotations

import importlib


def _comfy_nodes():
    # ComfyUI's own top-level `nodes` module, by name: the pack's `nodes` is reached relatively
    return importlib.import_module("nodes")


def node_class(class_type: str, extras_file: str | None = None) -> type:
    """The registered class of `class_type`. A node of ComfyUI's own `comfy_extras/extras_file`
    that is not registered yet (the command line boots ComfyUI without its extra nodes: the
    server loads them at start) is loaded first, by ComfyUI's own loader, as the server loads it."""
    comfy_nodes = _comfy_nodes()
    if class_type not in comfy_nodes.NODE_CLASS_MAPPINGS and extras_file is not None:
        import asyncio
        import os

        folder = os.path.join(os.path.dirname(os.path.realpath(comfy_nodes.__file__)), "comfy_extras")
        path = os.path.join(folder, extras_file)
        asyncio.run(comfy_nodes.load_custom_node(path, module_parent="comfy_extras"))
    if class_type not in comfy_nodes.NODE_CLASS_MAPPINGS:
        raise ValueError(f"the node type {class_type} is not installed in this ComfyUI")
    return comfy_nodes.NODE_CLASS_MAPPINGS[class_type]


def register_nodes(node_classes: list) -> None:
    """V3 node classes registered under their ids and display names, as ComfyUI's loader
    registers a custom node pack's."""
    comfy_nodes = _comfy_nodes()
    for node_cls in node_classes:
        schema = node_cls.GET_SCHEMA()
        comfy_nodes.NODE_CLASS_MAPPINGS[schema.node_id] = node_cls
        if schema.display_name is not None:
            comfy_nodes.NODE_DISPLAY_NAME_MAPPINGS[schema.node_id] = schema.display_name
