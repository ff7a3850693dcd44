"""LoRA files: kohya's keys, save precision, reading every format we wrote, atomic writes."""

from __future__ import annotations

import pytest
import torch

from trainer_core.lora_file import (
    SAVE_PRECISIONS,
    LoraModule,
    from_state_dict,
    kohya_name,
    load,
    precision_dtype,
    save_atomic,
    to_state_dict,
)


def modules():
    gen = torch.Generator().manual_seed(0)
    return {
        "double_blocks.0.img_attn.qkv": LoraModule(
            torch.randn(4, 64, generator=gen), torch.randn(192, 4, generator=gen), 8.0
        ),
        "single_blocks.1.linear2": LoraModule(
            torch.randn(2, 320, generator=gen), torch.randn(64, 2, generator=gen), 2.0
        ),
    }


def test_kohya_keys_and_delta():
    state = to_state_dict(modules())
    assert set(state) == {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight",
        "lora_unet_double_blocks_0_img_attn_qkv.alpha",
        "lora_unet_single_blocks_1_linear2.lora_down.weight",
        "lora_unet_single_blocks_1_linear2.lora_up.weight",
        "lora_unet_single_blocks_1_linear2.alpha",
    }
    assert state["lora_unet_single_blocks_1_linear2.lora_down.weight"].shape == (2, 320)  # rank x in
    assert state["lora_unet_single_blocks_1_linear2.lora_up.weight"].shape == (64, 2)  # out x rank
    module = modules()["single_blocks.1.linear2"]
    # (alpha / rank) * B @ A = (2 / 2) * B @ A, written out element by element for one entry
    expected = sum(float(module.up[5, r]) * float(module.down[r, 7]) for r in range(2))
    assert float(module.delta()[5, 7]) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("precision", list(SAVE_PRECISIONS))
def test_save_precision_rounds_down_and_up_and_keeps_alpha_exact(precision):
    dtype = precision_dtype(precision)
    assert dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    state = to_state_dict(
        {"single_blocks.0.linear2": LoraModule(torch.full((3, 4), 1 / 3), torch.ones(5, 3), 1 / 3)}, dtype
    )
    down = state["lora_unet_single_blocks_0_linear2.lora_down.weight"]
    assert down.dtype == dtype and state["lora_unet_single_blocks_0_linear2.lora_up.weight"].dtype == dtype
    # the value 1/3 as each dtype rounds it (bf16 keeps 8 significant bits, fp16 11, fp32 24)
    bits = {"bf16": 8, "fp16": 11, "fp32": 24}[precision]
    assert float(down[0, 0]) == pytest.approx(1 / 3, abs=2.0**-bits)
    if precision != "fp32":
        assert float(down[0, 0]) != float(torch.tensor(1 / 3))
    alpha = state["lora_unet_single_blocks_0_linear2.alpha"]
    assert alpha.dtype == torch.float32 and alpha.dim() == 0 and float(alpha) == float(torch.tensor(1 / 3))


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match="save_precision 'int8'; choose one of bf16, fp16, fp32"):
        precision_dtype("int8")


@pytest.mark.parametrize(
    "name, kohya",
    [
        ("double_blocks.0.img_attn.qkv", "lora_unet_double_blocks_0_img_attn_qkv"),
        ("double_blocks.18.txt_mod.lin", "lora_unet_double_blocks_18_txt_mod_lin"),
        ("single_blocks.5.modulation.lin", "lora_unet_single_blocks_5_modulation_lin"),
        ("final_layer.adaLN_modulation.1", "lora_unet_final_layer_adaLN_modulation_1"),
        ("transformer_blocks.2.attn.to_out.0", "lora_unet_transformer_blocks_2_attn_to_out_0"),
    ],
)
def test_kohya_names_both_ways(name, kohya):
    """Underscores are ambiguous (`img_attn_qkv`): a name reads back through the model's layer
    names, and a name no layer has is not read."""
    assert kohya_name(name) == kohya
    state = {f"{kohya}.lora_down.weight": torch.zeros(1, 2), f"{kohya}.lora_up.weight": torch.zeros(2, 1)}
    assert list(from_state_dict(state, ["img_in", name])) == [name]
    assert from_state_dict(state, ["img_in"]) == {}


def test_round_trip_with_metadata(tmp_path):
    meta = {"ss_network_dim": "4", "kontext_trainer.layout": "dreamomni2"}
    path = save_atomic(to_state_dict(modules()), tmp_path / "loras" / "x.safetensors", meta)
    state, metadata = load(path)
    loaded = from_state_dict(state, list(modules()))
    assert set(loaded) == set(modules())
    for name, module in modules().items():
        assert torch.equal(loaded[name].down, module.down) and torch.equal(loaded[name].up, module.up)
        assert loaded[name].alpha == module.alpha
    assert metadata == meta
    assert [p.name for p in path.parent.iterdir()] == ["x.safetensors"]


def test_files_of_earlier_versions_still_read(tmp_path):
    """Earlier versions wrote `diffusion_model.<module>.lora_A/B.weight` and `.alpha`."""
    old = {}
    for name, module in modules().items():
        old[f"diffusion_model.{name}.lora_A.weight"] = module.down
        old[f"diffusion_model.{name}.lora_B.weight"] = module.up
        old[f"diffusion_model.{name}.alpha"] = torch.tensor(module.alpha)
    loaded = from_state_dict(old, [])  # their keys hold the layer's name
    for name, module in modules().items():
        assert torch.equal(loaded[name].delta(), module.delta())


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = save_atomic(to_state_dict(modules()), tmp_path / "x.safetensors")
    before = path.read_bytes()
    with pytest.raises(ValueError):
        save_atomic({"bad": "not a tensor"}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def test_reads_lora_down_up_and_kohya_keys():
    gen = torch.Generator().manual_seed(4)
    down, up = torch.randn(2, 6, generator=gen), torch.randn(9, 2, generator=gen)
    names = ["double_blocks.0.img_attn.qkv", "single_blocks.3.linear1"]
    state = {
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight": down,
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight": up,
        "lora_unet_single_blocks_3_linear1.lora_down.weight": down * 2,
        "lora_unet_single_blocks_3_linear1.lora_up.weight": up * 2,
        "lora_unet_single_blocks_3_linear1.alpha": torch.tensor(0.5),
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": down,  # not ours: ignored
    }
    modules = from_state_dict(state, names)
    assert set(modules) == set(names)
    qkv, linear1 = modules["double_blocks.0.img_attn.qkv"], modules["single_blocks.3.linear1"]
    assert torch.equal(qkv.down, down) and torch.equal(qkv.up, up) and qkv.alpha == 2.0  # alpha = rank
    assert torch.equal(linear1.down, down * 2) and linear1.alpha == 0.5


def test_half_a_pair_is_an_error():
    state = {"diffusion_model.single_blocks.0.linear2.lora_A.weight": torch.zeros(2, 4)}
    with pytest.raises(ValueError, match=r"no diffusion_model\.single_blocks\.0\.linear2\.lora_B\.weight"):
        from_state_dict(state, [])
    state = {"lora_unet_single_blocks_0_linear2.lora_down.weight": torch.zeros(2, 4)}
    with pytest.raises(ValueError, match=r"no lora_unet_single_blocks_0_linear2\.lora_up\.weight"):
        from_state_dict(state, ["single_blocks.0.linear2"])
