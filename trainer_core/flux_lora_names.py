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
from dataclasses import dataclass

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

FUSED_PARTS = {**_DOUBLE_FUSED, **_SINGLE_FUSED}  # fused layer suffix -> its parts, in row order


@dataclass(frozen=True)
class Place:
    """A diffusers layer's place in Flux: the Flux layer `target`; for a fused target the index
    of its row slice (`part`, in `FUSED_PARTS` order); `swap_halves` when the two halves of the
    output rows come in the opposite order."""

    target: str
    part: int | None = None
    swap_halves: bool = False


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
        for part, diffusers_layer in enumerate(fused.get(layer, ())):
            places[f"{block}.{diffusers_layer}"] = Place(name, part)
    return places


def fused_parts(target: str) -> tuple[str, ...]:
    """The diffusers parts (in row order) that the Flux layer `target` fuses; () if none."""
    if not re.match(r"(double|single)_blocks\.\d+\.", target):
        return ()
    return FUSED_PARTS.get(target.split(".", 2)[2], ())


# Every Linear layer name inside a Flux.1 block, and outside the blocks
_BLOCK_LAYERS = (*_DOUBLE, *_DOUBLE_FUSED, *_SINGLE, *_SINGLE_FUSED)
KOHYA_PREFIX = "lora_unet_"
_KOHYA_BLOCK = re.compile(r"(double_blocks|single_blocks)_(\d+)_(.+)")
_KOHYA_LAYERS = {layer.replace(".", "_"): layer for layer in _BLOCK_LAYERS}
_KOHYA_TOP = {layer.replace(".", "_"): layer for layer in _TOP}


def kohya_name(flux_name: str) -> str:
    """kohya's (sd-scripts `networks/lora_flux.py`) name for a Flux layer: `lora_unet_` and the
    module path with `_` for `.` (`double_blocks.0.img_attn.qkv` ->
    `lora_unet_double_blocks_0_img_attn_qkv`). ComfyUI, diffusers and Forge read it."""
    return KOHYA_PREFIX + flux_name.replace(".", "_")


def flux_name_from_kohya(stem: str) -> str | None:
    """The Flux layer a kohya name stands for (the inverse of `kohya_name` on Flux.1's Linear
    layers), or None for a name that is not one of them (e.g. a text encoder's `lora_te1_*`)."""
    if not stem.startswith(KOHYA_PREFIX):
        return None
    rest = stem[len(KOHYA_PREFIX) :]
    match = _KOHYA_BLOCK.fullmatch(rest)
    if match is not None:
        kind, index, layer = match.groups()
        return f"{kind}.{index}.{_KOHYA_LAYERS[layer]}" if layer in _KOHYA_LAYERS else None
    return _KOHYA_TOP.get(rest)
