"""The trainer's core: pure torch / safetensors / peft code that never imports ComfyUI.

Everything ComfyUI-specific lives under `nodes/`; what is here is unit-tested on its own.
"""

__version__ = "0.1.0"
