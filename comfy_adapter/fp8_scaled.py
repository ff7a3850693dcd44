"""fp8_scaled: for the length of a training run, the block linears (attention and MLP) hold
float8 e4m3 weights with one float32 scale per output channel; everything else (norms,
modulation, embeddings, the final layer) stays as loaded.

The row math and the choice of layers are `trainer_core.fp8_rows`; this module is the
ComfyUI side: weight wrappers, the stock LoRA's `LowVramPatch`, unloading and restoring.

The weights are quantised *before* ComfyUI loads the training clone, one layer at a time on
the compute device, so the GPU never holds the bf16 model: ComfyUI then loads (fully or
partially, by its own accounting) the fp8 sizes. A layer computes with
`weight_fp8.to(compute dtype) * scale[:, None]` through ComfyUI's own per-layer hook
(`weight_function`, registered as the clone's weight wrapper, run by
`comfy.ops.cast_bias_weight` after the cast), so ComfyUI's Linear still does the work. A
weight patch the MODEL carries for such a layer (a LoRA from the stock loader) is not folded
into the fp8 values, where rounding would blur it: it moves from the clone's weight patches
to the same hook, after the scale (ComfyUI's `LowVramPatch`, as a partial load applies
patches), so the user's LoRA is applied exactly on every load, full or partial. The original
weights stay where the loader put them and are put back, the same Parameter objects, when the
run ends and ComfyUI has unloaded the clone: the MODEL other workflows use is bit-identical
afterwards.
"""

from __future__ import annotations

import contextlib

import torch

from ..trainer_core.fp8_rows import ScaleRows, quantize_rows, scaled_layer_names

MODEL_DTYPE = "weight_comfy_model_dtype"  # ComfyUI 0.33 records each weight's model dtype here
NONE = object()


@contextlib.contextmanager
def fp8_scaled_weights(patcher, family):
    """Give the block linears of `patcher` (the training clone, not yet loaded) that its family
    names (`ModelFamily.fp8_layers`) scaled e4m3 weights inside the `with` block; on exit
    ComfyUI unloads the clone and the originals return."""
    from comfy.model_patcher import LowVramPatch

    from .comfy_loading import unload_through_comfyui

    unload_through_comfyui(patcher, every_clone=True)  # the module now holds unpatched weights
    diffusion_model = patcher.model.diffusion_model
    compute = patcher.load_device
    swapped = []
    try:
        for name in scaled_layer_names(diffusion_model, family.fp8_layers):
            layer = diffusion_model.get_submodule(name)
            key = f"diffusion_model.{name}.weight"
            original = layer.weight
            values, scale = quantize_rows(original.to(compute))  # one layer at a time
            own = vars(layer)
            swapped.append((layer, original, own.get("weight_function"), own.get(MODEL_DTYPE, NONE)))
            layer.weight = torch.nn.Parameter(values.to(original.device), requires_grad=False)
            # the layer's model dtype for the run: ComfyUI's dynamic VRAM sizes its vbar pages by
            # it, so the GPU holds fp8 pages (the bf16 one would make it hold bf16 casts)
            setattr(layer, MODEL_DTYPE, values.dtype)
            patcher.add_weight_wrapper(key, ScaleRows(scale))
            patches = patcher.patches.pop(key, None)
            if patches:  # after the scale: the delta is added to the real weight
                patcher.add_weight_wrapper(key, LowVramPatch(key, {key: patches}))
        patcher.size = 0  # ComfyUI caches the model's size: let it count the fp8 weights
        yield len(swapped)
    finally:
        unload_through_comfyui(patcher)
        for layer, original, own_functions, model_dtype in reversed(swapped):
            layer.weight = original
            if model_dtype is NONE:
                layer.__dict__.pop(MODEL_DTYPE, None)
            else:
                setattr(layer, MODEL_DTYPE, model_dtype)
            if own_functions is None:
                layer.__dict__.pop("weight_function", None)  # back to the class default
            else:
                layer.weight_function = own_functions
