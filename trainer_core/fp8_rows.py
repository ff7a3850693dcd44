"""Row-scaled float8: a weight stored as e4m3 values with one float32 scale per output channel
(row), the storage of `fp8_mode = fp8_scaled`.

1) scale: each row's largest magnitude maps to e4m3's largest finite value, 448
   (an all-zero row gets a tiny positive scale, so nothing divides by zero);
2) quantise: weight / scale, rounded to e4m3 (round to nearest even);
3) dequantise: values (cast to the compute dtype) * scale.

Which layers are stored this way is `scaled_layer_names`: the block attention and MLP linears
the model's family names; modulation, embeddings, norms and the final layer stay as loaded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """float32 scale per row: the row's largest magnitude / 448 (at least 1e-12 / 448)."""
    return weight.detach().float().abs().amax(dim=1).clamp_min(1e-12) / E4M3_MAX


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per row) with weight ~= values * scale[:, None]."""
    scale = row_scales(weight)
    return (weight.detach().float() / scale[:, None]).to(E4M3), scale


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`values` already cast to the compute dtype, times each row's scale in that dtype and on
    that device (the product is computed in the compute dtype, as the layer computes)."""
    return values * scale.to(values.device, values.dtype)[:, None]


class ScaleRows:
    """`dequantize_rows` with the scale bound: a per-layer weight hook (ComfyUI's
    `weight_function`, which receives the weight after its cast to the compute dtype)."""

    def __init__(self, scale: torch.Tensor):
        self.scale = scale

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(weight, self.scale)


def scaled_layer_names(
    diffusion_model: torch.nn.Module, select: Callable[[list[str]], list[str]]
) -> list[str]:
    """The block linears that get fp8 weights, in the model's order: those `select` (the model
    family's choice: its blocks' attention and MLP linears) takes among the model's Linear
    layers; a LoRA-wrapped layer counts once, under its own name."""
    # peft shows a wrapped layer's Linear as `<name>.base_layer`
    # and its factors as `<name>.lora_A.<adapter>` / `.lora_B.`: not layers of the model
    names = [
        n.removesuffix(".base_layer")
        for n, m in diffusion_model.named_modules()
        if isinstance(m, torch.nn.Linear) and not {"lora_A", "lora_B"} & set(n.split("."))
    ]
    return select(list(dict.fromkeys(names)))
