"""The trainer's core: torch / safetensors / peft code that imports no ComfyUI, even at run time
(`tests/test_layers.py` imports every module in a process that could import ComfyUI, and checks).

What it still knows of one model family: the position-id layouts ComfyUI's Flux defines and
its token grids (`position_ids`), and the loader option names of the run file (see
ARCHITECTURE.md). The LoRA targets and key names of a
family, and everything it changes in training, are the family's (`comfy_adapter/families/`).
Everything that calls ComfyUI lives in `comfy_adapter/`; what is here is unit-tested on its own
(`tests/trainer_core/`). `__main__.py` is the command line's door, not
part of the core: it reaches `application/cli.py`.
"""

__version__ = "0.1.0"
