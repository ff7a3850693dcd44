"""The ComfyUI adapter: everything that touches ComfyUI's model code. Booting ComfyUI for the
command line, its loading (quantized layers, cast handling, dynamic VRAM, the executor's
loading context), the model families (`families/`: one folder each, what a family changes:
its blocks, reference ids, the guard's probe, its forward call), the training session and the
guard that are the same for every family, ComfyUI's encoders, and preview sampling through
ComfyUI's sampler.

It uses the core (`trainer_core`), never the application or a node (see ARCHITECTURE.md;
`tests/test_layers.py` enforces the direction). No module imports ComfyUI at import time of
this package's `__init__`.
"""
