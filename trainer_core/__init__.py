"""The trainer's core: torch / safetensors / peft code that imports no ComfyUI, even at run time
(`tests/test_layers.py` imports every module in a process that could import ComfyUI, and checks).

What it still knows of model families: the names of the reference layouts (`choices.Layout`)
and the loader option names of the run file (see ARCHITECTURE.md). A family's tokens beyond the
generic patches (FLUX's position ids), its LoRA targets and key names, and everything it changes
in training, are the family's (`comfy_adapter/families/`).
Everything that calls ComfyUI lives in `comfy_adapter/`; what is here is unit-tested on its own
(`tests/trainer_core/`). `__main__.py` is the command line's door, not
part of the core: it reaches `application/cli.py`.
"""

__version__ = "0.1.0"
