"""Where a diffusers-named Flux LoRA layer lands in ComfyUI's Flux (BFL key names).

diffusers (and ai-toolkit, SimpleTuner, OneTrainer, which save in its names) splits layers that
ComfyUI's Flux keeps fused: a double block's `attn.to_q/to_k/to_v` are row slices of
`img_attn.qkv`, `attn.add_q_proj/add_k_proj/add_v_proj` of `txt_attn.qkv`, and a single block's
`attn.to_q/to_k/to_v` plus `proj_mlp` of `linear1`. The table follows ComfyUI's own key map
(`comfy/utils.py: flux_to_diffusers`, used by `comfy/lora.py: model_lora_keys_unet`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ....trainer_core.seed_lora import Place

# Flux layer (inside a double block) -> diffusers layer (inside `transformer_blocks.N`)
_DOUBLE = {
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
}
# fused Flux layer -> its diffusers parts, in row order
_DOUBLE_FUSED = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
# the same inside a single block (`single_transformer_blocks.N`)
_SINGLE = {"linear2": "proj_out", "modulation.lin": "norm.linear"}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
# FLUX.2's diffusers names (Flux2Transformer2DModel) for the same layers, unfused where ComfyUI
# keeps them fused: ComfyUI 0.33's key map reads them for every Flux
_DOUBLE_ALIASES = {
    "img_mlp.0": "ff.linear_in",
    "img_mlp.2": "ff.linear_out",
    "txt_mlp.0": "ff_context.linear_in",
    "txt_mlp.2": "ff_context.linear_out",
}
_SINGLE_ALIASES = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}
# layers outside the blocks
_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
}
# diffusers' norm_out.linear outputs (scale, shift); Flux's adaLN_modulation.1 (shift, scale)
_SWAPPED_HALVES = {"final_layer.adaLN_modulation.1"}


def diffusers_places(flux_names: Iterable[str]) -> dict[str, Place]:
    """diffusers layer name (e.g. `transformer_blocks.0.attn.to_q`) -> its `Place`, for the
    layers among `flux_names` (the model's Linear module names) only."""
    places = {}
    for name in flux_names:
        match = re.fullmatch(r"(double|single)_blocks\.(\d+)\.(.+)", name)
        if match is None:
            if name in _TOP:
                places[_TOP[name]] = Place(name, swap_halves=name in _SWAPPED_HALVES)
            continue
        kind, index, layer = match.groups()
        block = f"transformer_blocks.{index}" if kind == "double" else f"single_transformer_blocks.{index}"
        plain, fused, aliases = (
            (_DOUBLE, _DOUBLE_FUSED, _DOUBLE_ALIASES)
            if kind == "double"
            else (_SINGLE, _SINGLE_FUSED, _SINGLE_ALIASES)
        )
        if layer in plain:
            places[f"{block}.{plain[layer]}"] = Place(name)
        if layer in aliases:
            places[f"{block}.{aliases[layer]}"] = Place(name)
        parts = fused.get(layer, ())
        for part, diffusers_layer in enumerate(parts):
            places[f"{block}.{diffusers_layer}"] = Place(name, part, parts=len(parts))
    return places
