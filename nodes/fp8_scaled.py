"""fp8_scaled: for the length of a training run, the block linears (attention and MLP) hold
float8 e4m3 weights with one float32 scale per output channel; everything else (norms,
modulation, embeddings, the final layer) stays as loaded.

A layer computes with `weight_fp8.to(compute dtype) * scale[:, None]` through ComfyUI's own
per-layer hook (`weight_function`, run by `comfy.ops.cast_bias_weight` after the cast), so
ComfyUI's Linear still does the work. The original weights wait on the offload device (the
CPU) and are put back, the same Parameter objects, when the run ends: the MODEL other
workflows use is bit-identical afterwards.
"""

from __future__ import annotations

import contextlib

import torch

from ..trainer_core.lora_targets import target_module_names

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per row) with weight ~= values * scale[:, None]."""
    scale = weight.detach().float().abs().amax(dim=1).clamp_min(1e-12) / E4M3_MAX
    return (weight.detach().float() / scale[:, None]).to(E4M3), scale


class ScaleRows:
    """A `weight_function`: the cast e4m3 weight times its per-row scale."""

    def __init__(self, scale: torch.Tensor):
        self.scale = scale

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.scale.to(weight.device, weight.dtype)[:, None]


def scaled_layer_names(diffusion_model) -> list[str]:
    """The block linears that get fp8 weights: attention and MLP (single blocks' fused ones)."""
    # a LoRA-wrapped layer shows its Linear as `<name>.base_layer`
    names = [
        n.removesuffix(".base_layer")
        for n, m in diffusion_model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    return target_module_names(list(dict.fromkeys(names)), "attention_mlp")


@contextlib.contextmanager
def fp8_scaled_blocks(diffusion_model, offload_device: torch.device):
    """Swap the block linears' weights for scaled e4m3 ones inside the `with` block."""
    swapped = []
    try:
        for name in scaled_layer_names(diffusion_model):
            layer = diffusion_model.get_submodule(name)
            layer = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
            original = layer.weight
            values, scale = quantize_rows(original)
            own_functions = layer.__dict__.get("weight_function")  # None: the class-level default
            home = original.device
            swapped.append((layer, original, own_functions, home))
            original.data = original.data.to(offload_device)
            layer.weight = torch.nn.Parameter(values, requires_grad=False)
            layer.weight_function = [*(own_functions or []), ScaleRows(scale.to(home))]
        yield len(swapped)
    finally:
        for layer, original, own_functions, home in reversed(swapped):
            original.data = original.data.to(home)
            layer.weight = original
            if own_functions is None:
                del layer.weight_function
            else:
                layer.weight_function = own_functions
