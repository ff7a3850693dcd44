"""LoRA file round trip, metadata and atomic writes."""

from __future__ import annotations

import pytest
import torch

from trainer_core.lora_file import (
    LoraModule,
    from_state_dict,
    kohya_metadata,
    load,
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


def test_keys_and_delta():
    state = to_state_dict(modules())
    assert set(state) == {
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight",
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight",
        "diffusion_model.double_blocks.0.img_attn.qkv.alpha",
        "diffusion_model.single_blocks.1.linear2.lora_A.weight",
        "diffusion_model.single_blocks.1.linear2.lora_B.weight",
        "diffusion_model.single_blocks.1.linear2.alpha",
    }
    module = modules()["single_blocks.1.linear2"]
    # (alpha / rank) * B @ A = (2 / 2) * B @ A, written out element by element for one entry
    expected = sum(float(module.up[5, r]) * float(module.down[r, 7]) for r in range(2))
    assert float(module.delta()[5, 7]) == pytest.approx(expected, rel=1e-5)


def test_round_trip_with_metadata(tmp_path):
    meta = kohya_metadata(4, 8.0, "flux1-kontext", 100, 1024, {"layout": "dreamomni2", "targets": ["qkv"]})
    path = save_atomic(to_state_dict(modules()), tmp_path / "loras" / "x.safetensors", meta)
    state, metadata = load(path)
    loaded = from_state_dict(state)
    for name, module in modules().items():
        assert torch.equal(loaded[name].down, module.down) and torch.equal(loaded[name].up, module.up)
        assert loaded[name].alpha == module.alpha
    assert metadata["ss_network_dim"] == "4" and metadata["ss_network_alpha"] == "8.0"
    assert metadata["ss_resolution"] == "(1024, 1024)" and metadata["kontext_trainer.layout"] == "dreamomni2"
    assert metadata["kontext_trainer.targets"] == '["qkv"]'
    assert [p.name for p in path.parent.iterdir()] == ["x.safetensors"]


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
        from_state_dict(state)
