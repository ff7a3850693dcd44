"""The trainer's core: torch / safetensors / peft code that imports no ComfyUI, even at run time
(`tests/test_layers.py` imports every module in a process that could import ComfyUI, and checks).

What it does know: Flux's shapes and LoRA module names, and ComfyUI's position-id layouts and
loader option names, as plain values (see ARCHITECTURE.md: moving them behind a model-family seam
is the next step). Everything that calls ComfyUI lives in `comfy_adapter/`; what is here is
unit-tested on its own (`tests/trainer_core/`). `__main__.py` is the command line's door, not
part of the core: it reaches `application/cli.py`.
"""

__version__ = "0.1.0"
