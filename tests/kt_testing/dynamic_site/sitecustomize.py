"""Started on PYTHONPATH by the dynamic-VRAM test servers (`kt_testing.dynamic_vram`): aimdo's
control must be initialised before ComfyUI, or aimdo's submodules, are imported, as ComfyUI
0.33's `main.py` does on NVIDIA. Does nothing unless KT_TEST_DYNAMIC_VRAM=1."""

import os

if os.environ.get("KT_TEST_DYNAMIC_VRAM") == "1":
    import comfy_aimdo.control

    if not comfy_aimdo.control.init():
        raise RuntimeError("kt test: comfy_aimdo.control.init() failed: no dynamic VRAM emulation")
