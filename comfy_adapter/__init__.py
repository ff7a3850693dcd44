"""The ComfyUI adapter: everything that touches ComfyUI's model code. Booting ComfyUI for the
command line, its loading (quantized layers, cast handling, dynamic VRAM, the executor's
loading context), the Flux family (which of ComfyUI's blocks are wrapped for checkpointing
and swap, reference ids, the guard's probes, the training session), its encoders, and preview
sampling through ComfyUI's sampler.

It uses the core (`trainer_core`), never the application or a node (see ARCHITECTURE.md;
`tests/test_layers.py` enforces the direction). No module imports ComfyUI at import time of
this package's `__init__`.
"""
