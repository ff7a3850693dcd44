"""Where diffusers-named LoRA layers land in ComfyUI's Flux (comfy_adapter/families/flux/lora_names)."""

from __future__ import annotations


def test_flux2_diffusers_names_land_on_the_same_layers(pack_import):
    """FLUX.2's diffusers model names some layers differently (ComfyUI 0.33's key map reads
    both): a single block's fused `attn.to_qkv_mlp_proj` and `attn.to_out`, a double block's
    gated MLP `ff.linear_in` / `ff.linear_out`."""
    names = [
        "single_blocks.0.linear1",
        "single_blocks.0.linear2",
        "double_blocks.1.img_mlp.0",
        "double_blocks.1.txt_mlp.2",
    ]
    places = pack_import("comfy_adapter.families.flux.lora_names").diffusers_places(names)
    Place = pack_import("trainer_core.seed_lora").Place
    assert places["single_transformer_blocks.0.attn.to_qkv_mlp_proj"] == Place("single_blocks.0.linear1")
    assert places["single_transformer_blocks.0.attn.to_out"] == Place("single_blocks.0.linear2")
    assert places["transformer_blocks.1.ff.linear_in"] == Place("double_blocks.1.img_mlp.0")
    assert places["transformer_blocks.1.ff_context.linear_out"] == Place("double_blocks.1.txt_mlp.2")
