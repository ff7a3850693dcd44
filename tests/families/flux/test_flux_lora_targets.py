"""Target presets pick exactly the Flux block layers they are documented to pick
(comfy_adapter/families/flux/lora_targets.py)."""

from __future__ import annotations

import pytest

from kt_testing.comfy_runtime import from_the_pack

pytestmark = pytest.mark.usefixtures("comfy_runtime")

# The Linear layers of a Flux with one double and one single block, listed by hand from
# comfy/ldm/flux/layers.py and model.py.
FLUX_LINEARS = [
    "img_in",
    "time_in.in_layer",
    "time_in.out_layer",
    "vector_in.in_layer",
    "txt_in",
    "double_blocks.0.img_mod.lin",
    "double_blocks.0.img_attn.qkv",
    "double_blocks.0.img_attn.proj",
    "double_blocks.0.img_mlp.0",
    "double_blocks.0.img_mlp.2",
    "double_blocks.0.txt_mod.lin",
    "double_blocks.0.txt_attn.qkv",
    "double_blocks.0.txt_attn.proj",
    "double_blocks.0.txt_mlp.0",
    "double_blocks.0.txt_mlp.2",
    "single_blocks.0.linear1",
    "single_blocks.0.linear2",
    "single_blocks.0.modulation.lin",
    "final_layer.linear",
    "final_layer.adaLN_modulation.1",
]

ATTENTION = [
    "double_blocks.0.img_attn.qkv",
    "double_blocks.0.img_attn.proj",
    "double_blocks.0.txt_attn.qkv",
    "double_blocks.0.txt_attn.proj",
    "single_blocks.0.linear1",
    "single_blocks.0.linear2",
]
MLP = [
    "double_blocks.0.img_mlp.0",
    "double_blocks.0.img_mlp.2",
    "double_blocks.0.txt_mlp.0",
    "double_blocks.0.txt_mlp.2",
]
MODULATION = ["double_blocks.0.img_mod.lin", "double_blocks.0.txt_mod.lin", "single_blocks.0.modulation.lin"]


def target_module_names(linear_names, preset):
    """The Flux family's target presets (the pack's module, as ComfyUI loaded it)."""
    return from_the_pack("comfy_adapter.families.flux.lora_targets").target_module_names(linear_names, preset)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("attention", ATTENTION),
        ("attention_mlp", ATTENTION + MLP),
        ("all_linear", ATTENTION + MLP + MODULATION),
    ],
)
def test_presets(preset, expected):
    got = target_module_names(FLUX_LINEARS, preset)
    assert sorted(got) == sorted(expected)
    assert got == [n for n in FLUX_LINEARS if n in expected]  # model order kept


def test_no_preset_touches_embeddings_or_final_layer():
    chosen = set(target_module_names(FLUX_LINEARS, "all_linear"))
    assert not chosen & {n for n in FLUX_LINEARS if "blocks" not in n}


def test_block_numbers_beyond_nine():
    names = ["double_blocks.18.img_attn.qkv", "single_blocks.37.linear2", "single_blocks.37.norm"]
    assert target_module_names(names, "attention") == names[:2]


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match=r"'mlp_only'.*attention, attention_mlp, all_linear"):
        target_module_names(FLUX_LINEARS, "mlp_only")


# FLUX.2 with one double and one single block, listed by hand from comfy/ldm/flux/model.py with
# global_modulation and no vector_in: no per-block modulation, three model-wide layers.
FLUX2_LINEARS = [
    "img_in",
    "time_in.in_layer",
    "time_in.out_layer",
    "guidance_in.in_layer",
    "guidance_in.out_layer",
    "txt_in",
    "double_blocks.0.img_attn.qkv",
    "double_blocks.0.img_attn.proj",
    "double_blocks.0.img_mlp.0",
    "double_blocks.0.img_mlp.2",
    "double_blocks.0.txt_attn.qkv",
    "double_blocks.0.txt_attn.proj",
    "double_blocks.0.txt_mlp.0",
    "double_blocks.0.txt_mlp.2",
    "single_blocks.0.linear1",
    "single_blocks.0.linear2",
    "final_layer.linear",
    "final_layer.adaLN_modulation.1",
    "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.lin",
    "single_stream_modulation.lin",
]


def test_flux2_presets_pick_its_block_layers_and_all_linear_its_global_modulation():
    blocks = FLUX2_LINEARS[6:16]
    attention = [n for n in blocks if "attn" in n or "linear" in n]
    assert target_module_names(FLUX2_LINEARS, "attention") == attention
    assert target_module_names(FLUX2_LINEARS, "attention_mlp") == blocks
    assert target_module_names(FLUX2_LINEARS, "all_linear") == blocks + FLUX2_LINEARS[-3:]
