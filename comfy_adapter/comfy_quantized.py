"""ComfyUI's quantized Linear (`comfy.ops.mixed_precision_ops`), as training meets it: which
layers a MODEL holds that way and in which formats (for the VRAM estimate and the LoRA's
metadata), and ComfyUI's fp8 backward (`comfy.model_management.training_fp8_bwd`, 0.33+) for
`fp8_mode = fp8_backward`.

A quantized file (the older `scaled_fp8` form on 0.33, fp8mixed's `_quantization_metadata`,
0.33's per-layer `comfy_quant`) loads into that Linear: an `nn.Module`, not an `nn.Linear`,
whose weight is a `QuantizedTensor` (packed values in `_qdata` plus scales). The older form on
0.3.75 loads into `scaled_fp8_ops`, an `nn.Linear` with an fp8 weight: a plain fp8 layer here.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from .autograd_safe import is_packed
from .cast_contract import is_linear


def holds_quantized_weight(layer: torch.nn.Module) -> bool:
    """A ComfyUI Linear whose weight is a `QuantizedTensor` (a tensor subclass). On 0.3.75 every
    Linear of a quantized model is the quantized class, the unquantized ones holding a plain
    weight: the weight decides, not the class."""
    weight = getattr(layer, "weight", None)
    return isinstance(weight, torch.Tensor) and is_packed(weight)


def quantized_layers(module: torch.nn.Module) -> list[str]:
    """The names of the Linears in `module` that hold a quantized weight."""
    return [
        name for name, child in module.named_modules() if is_linear(child) and holds_quantized_weight(child)
    ]


def stored_weight_bytes(layer: torch.nn.Module) -> int:
    """Bytes per stored weight element: a quantized weight's packed values (`_qdata`, which
    ComfyUI 0.3.75 and comfy-kitchen both keep), otherwise the weight's own element size."""
    weight = layer.weight
    return getattr(weight, "_qdata", weight).element_size()


def quantized_format(layer: torch.nn.Module) -> str:
    """The layer's format as ComfyUI names it in files (`float8_e4m3fn`, `nvfp4`, ...): 0.33
    keeps it on the layer; 0.3.75 only its layout, which its format table maps back."""
    name = getattr(layer, "quant_format", None)
    if name:
        return name
    from comfy.quant_ops import QUANT_ALGOS

    layout = getattr(layer, "layout_type", None)
    return next((f for f, algo in QUANT_ALGOS.items() if algo["comfy_tensor_layout"] == layout), "unknown")


def weight_formats(diffusion_model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """How the Linear weights are stored, counted: {"quantized": {format: layers}, "plain":
    {dtype: layers}} (the LoRA metadata's `kontext_trainer.base_weights`)."""
    quantized, plain = Counter(), Counter()
    for _, layer in diffusion_model.named_modules():
        if not is_linear(layer) or getattr(layer, "weight", None) is None:
            continue
        if holds_quantized_weight(layer):
            quantized[quantized_format(layer)] += 1
        else:
            plain[str(layer.weight.dtype).removeprefix("torch.")] += 1
    return {"quantized": dict(sorted(quantized.items())), "plain": dict(sorted(plain.items()))}


def base_record(model) -> dict:
    """How a MODEL holds its base weights, as a checkpoint records it (a resume that holds
    them otherwise says so, `trainer_core.resume.continuation_notes`): the Linear weights'
    formats counted, and whether ComfyUI's dynamic VRAM streams them."""
    from .comfy_loading import is_dynamic

    return {**weight_formats(model.model.diffusion_model), "dynamic_vram": is_dynamic(model)}


# The formats training has been proved on (tests/comfy_adapter/test_quantized_training.py): gradients
# through ComfyUI's own layer against a dequantized reference.
TRAINED_FORMATS = ("float8_e4m3fn", "float8_e5m2", "nvfp4", "mxfp8", "int8_tensorwise")


def check_trainable_formats(model) -> None:
    """One line, before anything loads, for a MODEL holding layers in a quantized format no test
    has trained through (ComfyUI's 4-bit integer formats, or one newer than this pack): it names
    the format and what to load instead."""
    formats = weight_formats(model.model.diffusion_model)["quantized"]
    untried = sorted(set(formats) - set(TRAINED_FORMATS))
    if untried:
        raise ValueError(
            f"this MODEL holds {sum(formats[f] for f in untried)} layers in ComfyUI's {', '.join(untried)} "
            f"format, which Kontext Trainer does not train on yet (it trains {', '.join(TRAINED_FORMATS)}); "
            "load this model's fp8 (e.g. *_fp8mixed, *_fp8_scaled) or bf16 file with UNETLoader instead"
        )


def check_fp8_backward(model) -> None:
    """One line, before anything loads, where `fp8_mode = fp8_backward` cannot run: a ComfyUI
    without `training_fp8_bwd` (older than 0.33), a MODEL without quantized layers, or layers
    this ComfyUI computes in full precision on this device (no fp8 compute: no fp8 matmul)."""
    import comfy.model_management as mm

    from .forward_guard import comfyui_version

    if not hasattr(mm, "training_fp8_bwd"):
        raise ValueError(
            f"fp8_mode 'fp8_backward' needs ComfyUI 0.33 or newer (its training_fp8_bwd); this ComfyUI "
            f"is {comfyui_version()}. Update ComfyUI, or choose as_loaded"
        )
    diffusion_model = model.model.diffusion_model
    quantized = quantized_layers(diffusion_model)
    if not quantized:
        raise ValueError(
            "fp8_mode 'fp8_backward' runs the backward of a quantized file's layers in fp8, but this "
            "MODEL has none (load a quantized file such as *_fp8mixed with UNETLoader), or choose as_loaded"
        )
    if all(diffusion_model.get_submodule(name)._full_precision_mm for name in quantized):
        raise ValueError(
            "fp8_mode 'fp8_backward' needs fp8 matmuls, but ComfyUI computes this MODEL's quantized layers "
            "in full precision on this device (no fp8 compute, or the file asks for it); choose as_loaded"
        )


def check_quantized_model(model, fp8_mode: str) -> None:
    """Every quantized-model refusal, each one line, before anything loads (TrainLoRA's first
    check, the headless CLI, the training session): an untried format, fp8_scaled on a model
    that is already quantized, fp8_backward where it cannot run."""
    check_trainable_formats(model)
    diffusion_model = model.model.diffusion_model
    quantized = quantized_layers(diffusion_model) + [
        # ComfyUI 0.3.75 loads the older scaled_fp8 form as fp8 `nn.Linear`s with a `scale_weight`
        name
        for name, layer in diffusion_model.named_modules()
        if isinstance(layer, torch.nn.Linear)
        and isinstance(getattr(layer, "scale_weight", None), torch.Tensor)
    ]
    if fp8_mode == "fp8_scaled" and quantized:
        raise ValueError(
            f"fp8_mode 'fp8_scaled' re-quantizes full-precision weights, but this MODEL is already "
            f"quantized ({len(quantized)} layers in ComfyUI's quantized format, e.g. {quantized[0]}: "
            "a file such as *_fp8_scaled or *_fp8mixed). Set fp8_mode to as_loaded: training then "
            "computes with the file's own fp8 weights."
        )
    if fp8_mode == "fp8_backward":
        check_fp8_backward(model)


@contextlib.contextmanager
def fp8_backward(on: bool = True):
    """ComfyUI's `training_fp8_bwd` set to `on` inside (its `QuantLinearFunc` reads it at each
    forward), the previous value back after."""
    import comfy.model_management as mm

    previous = mm.training_fp8_bwd
    mm.training_fp8_bwd = on
    try:
        yield
    finally:
        mm.training_fp8_bwd = previous
