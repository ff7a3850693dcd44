"""Kontext Trainer: train LoRAs for image-edit models inside the ComfyUI graph: FLUX.1-dev,
FLUX.1 Kontext (one or more references, DreamOmni2), FLUX.2 [dev], FLUX.2 [klein] 4B / 9B and
Qwen-Image-Edit 2509 / 2511.

ComfyUI imports this file as a package and calls `comfy_entrypoint` (the V3 extension API).
The import guard below keeps the package importable without ComfyUI, so tools and the
pure tests can use `trainer_core` on its own.
"""

WEB_DIRECTORY = "./web"

try:
    from comfy_api.latest import ComfyExtension as _ComfyExtension
except ImportError:  # not running inside ComfyUI
    _ComfyExtension = None

if _ComfyExtension is not None:
    from .nodes.extension import comfy_entrypoint  # noqa: F401

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"] if _ComfyExtension is not None else ["WEB_DIRECTORY"]
