"""Reading an existing Flux LoRA file (any tool's key names) as the seed of a new run
(`trainer_core.seed_lora` with the Flux family's diffusers names).

The model is described by hand: hidden size 8, MLP 32, 2 double and 2 single blocks, so every
row range below (q = rows 0:8, k = 8:16, v = 16:24, MLP input = 24:56) is written out literally.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import save_file

from kt_testing.comfy_runtime import from_the_pack
from trainer_core.lora_file import LoraModule, save_atomic, to_state_dict

pytestmark = pytest.mark.usefixtures("comfy_runtime")

H, MLP = 8, 32
SHAPES = {}
for _i in range(2):
    for _stream in ("img", "txt"):
        SHAPES[f"double_blocks.{_i}.{_stream}_mod.lin"] = (6 * H, H)
        SHAPES[f"double_blocks.{_i}.{_stream}_attn.qkv"] = (3 * H, H)
        SHAPES[f"double_blocks.{_i}.{_stream}_attn.proj"] = (H, H)
        SHAPES[f"double_blocks.{_i}.{_stream}_mlp.0"] = (MLP, H)
        SHAPES[f"double_blocks.{_i}.{_stream}_mlp.2"] = (H, MLP)
for _i in range(2):
    SHAPES[f"single_blocks.{_i}.linear1"] = (3 * H + MLP, H)
    SHAPES[f"single_blocks.{_i}.linear2"] = (H, H + MLP)
    SHAPES[f"single_blocks.{_i}.modulation.lin"] = (3 * H, H)
SHAPES.update(
    {
        "img_in": (H, 64),
        "txt_in": (H, 12),
        "time_in.in_layer": (H, 256),
        "time_in.out_layer": (H, H),
        "vector_in.in_layer": (H, 6),
        "vector_in.out_layer": (H, H),
        "final_layer.linear": (64, H),
        "final_layer.adaLN_modulation.1": (2 * H, H),
    }
)
NAMES = list(SHAPES)
GEN = torch.Generator().manual_seed(0)


def factors(out: int, inp: int, rank: int = 2):
    return torch.randn(rank, inp, generator=GEN), torch.randn(out, rank, generator=GEN)


def write(tmp_path, state, metadata=None, name="seed.safetensors"):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    return path


def read(path, rank=2, shapes=SHAPES):
    places = from_the_pack("comfy_adapter.families.flux.lora_names").diffusers_places(NAMES)
    return from_the_pack("trainer_core.seed_lora").read_seed_lora(path, NAMES, rank, shapes, places)


# --- formats ------------------------------------------------------------------------------------


def test_our_format_round_trips(tmp_path):
    ours = {
        "double_blocks.1.img_attn.qkv": LoraModule(*factors(3 * H, H), alpha=1.5),
        "single_blocks.0.linear2": LoraModule(*factors(H, H + MLP), alpha=2.0),
    }
    path = save_atomic(to_state_dict(ours), tmp_path / "ours.safetensors")
    got = read(path)
    assert list(got) == ["double_blocks.1.img_attn.qkv", "single_blocks.0.linear2"]
    for name, module in ours.items():
        assert torch.equal(got[name].down, module.down) and torch.equal(got[name].up, module.up)
        assert got[name].alpha == module.alpha and got[name].down.dtype == torch.float32


@pytest.mark.parametrize("prefix", ["diffusion_model.", ""])
def test_comfy_lora_down_up_with_or_without_prefix(tmp_path, prefix):
    down, up = factors(H, MLP)
    state = {
        f"{prefix}double_blocks.0.txt_mlp.2.lora_down.weight": down.half(),
        f"{prefix}double_blocks.0.txt_mlp.2.lora_up.weight": up.half(),
        f"{prefix}double_blocks.0.txt_mlp.2.alpha": torch.tensor(4.0),
    }
    got = read(write(tmp_path, state))["double_blocks.0.txt_mlp.2"]
    assert torch.equal(got.down, down.half().float()) and torch.equal(got.up, up.half().float())
    assert got.alpha == 4.0 and got.down.dtype == torch.float32


def test_kohya_format(tmp_path):
    qkv, mod = factors(3 * H, H), factors(3 * H, H)
    state = {
        "lora_unet_double_blocks_1_txt_attn_qkv.lora_down.weight": qkv[0],
        "lora_unet_double_blocks_1_txt_attn_qkv.lora_up.weight": qkv[1],
        "lora_unet_double_blocks_1_txt_attn_qkv.alpha": torch.tensor(1.0),
        "lora_unet_single_blocks_1_modulation_lin.lora_down.weight": mod[0],
        "lora_unet_single_blocks_1_modulation_lin.lora_up.weight": mod[1],
        # text encoder parts of the same file are not ours to seed: ignored
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(2, 4),
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(4, 2),
    }
    got = read(write(tmp_path, state))
    assert list(got) == ["double_blocks.1.txt_attn.qkv", "single_blocks.1.modulation.lin"]
    assert torch.equal(got["double_blocks.1.txt_attn.qkv"].up, qkv[1])
    assert got["double_blocks.1.txt_attn.qkv"].alpha == 1.0
    assert got["single_blocks.1.modulation.lin"].alpha == 2.0  # no alpha key: alpha = rank


def test_diffusers_qkv_is_fused_exactly(tmp_path):
    q, k, v = factors(H, H), factors(H, H), factors(H, H)
    base = "transformer.transformer_blocks.1.attn."
    state = {}
    for part, (down, up) in zip(("to_q", "to_k", "to_v"), (q, k, v), strict=True):
        state[f"{base}{part}.lora_A.weight"], state[f"{base}{part}.lora_B.weight"] = down, up
    state[f"{base}to_k.alpha"] = torch.tensor(0.5)  # k scaled by 0.5 / 2; q and v by 1
    got = read(write(tmp_path, state))["double_blocks.1.img_attn.qkv"]

    expected = torch.zeros(24, 8)
    expected[0:8] = q[1] @ q[0]
    expected[8:16] = 0.25 * (k[1] @ k[0])
    expected[16:24] = v[1] @ v[0]
    assert torch.allclose(got.delta(), expected, rtol=1e-6, atol=1e-6)
    assert got.rank == 6 and got.alpha == 6.0
    assert torch.equal(got.down, torch.cat([q[0], k[0], v[0]]))
    # block-diagonal: q's rows only use q's columns
    assert torch.count_nonzero(got.up[0:8, 2:6]) == 0 and torch.count_nonzero(got.up[8:16, 0:2]) == 0


def test_diffusers_text_stream_with_a_missing_part(tmp_path):
    q, v = factors(H, H), factors(H, H)
    base = "transformer.transformer_blocks.0.attn."
    state = {
        f"{base}add_q_proj.lora_A.weight": q[0],
        f"{base}add_q_proj.lora_B.weight": q[1],
        f"{base}add_v_proj.lora_A.weight": v[0],
        f"{base}add_v_proj.lora_B.weight": v[1],
    }
    got = read(write(tmp_path, state))["double_blocks.0.txt_attn.qkv"]
    expected = torch.zeros(24, 8)
    expected[0:8] = q[1] @ q[0]
    expected[16:24] = v[1] @ v[0]  # k's rows 8:16 stay zero
    assert torch.allclose(got.delta(), expected, rtol=1e-6, atol=1e-6)
    assert got.rank == 4


def test_diffusers_single_block_linear1_with_mlp(tmp_path):
    parts = {"attn.to_q": factors(H, H), "attn.to_k": factors(H, H), "attn.to_v": factors(H, H)}
    parts["proj_mlp"] = factors(MLP, H)
    state = {}
    for part, (down, up) in parts.items():
        state[f"transformer.single_transformer_blocks.1.{part}.lora_A.weight"] = down
        state[f"transformer.single_transformer_blocks.1.{part}.lora_B.weight"] = up
    got = read(write(tmp_path, state))["single_blocks.1.linear1"]
    expected = torch.zeros(56, 8)
    for (down, up), rows in zip(
        parts.values(), (slice(0, 8), slice(8, 16), slice(16, 24), slice(24, 56)), strict=True
    ):
        expected[rows] = up @ down
    assert torch.allclose(got.delta(), expected, rtol=1e-6, atol=1e-6)
    assert got.rank == 8 and got.alpha == 8.0


def test_diffusers_plain_layers_and_the_swapped_final_modulation(tmp_path):
    proj, norm_out, linear2 = factors(H, H), factors(2 * H, H), factors(H, H + MLP)
    state = {
        "transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight": proj[0],
        "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight": proj[1],
        "transformer.norm_out.linear.lora_A.weight": norm_out[0],
        "transformer.norm_out.linear.lora_B.weight": norm_out[1],
        "transformer.single_transformer_blocks.0.proj_out.lora_A.weight": linear2[0],
        "transformer.single_transformer_blocks.0.proj_out.lora_B.weight": linear2[1],
    }
    got = read(write(tmp_path, state))
    assert list(got) == [
        "double_blocks.0.img_attn.proj",
        "single_blocks.0.linear2",
        "final_layer.adaLN_modulation.1",
    ]
    assert torch.equal(got["single_blocks.0.linear2"].down, linear2[0])
    assert torch.equal(got["double_blocks.0.img_attn.proj"].up, proj[1])
    assert got["double_blocks.0.img_attn.proj"].alpha == 2.0  # peft file, no alpha: alpha = rank
    # diffusers stores (scale, shift) rows, Flux (shift, scale): the halves trade places
    delta = norm_out[1] @ norm_out[0]
    assert torch.allclose(got["final_layer.adaLN_modulation.1"].delta()[0:8], delta[8:16])
    assert torch.allclose(got["final_layer.adaLN_modulation.1"].delta()[8:16], delta[0:8])


def test_diffusers_alpha_from_adapter_metadata(tmp_path):
    proj, mlp = factors(H, H), factors(MLP, H)
    state = {
        "transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight": proj[0],
        "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight": proj[1],
        "transformer.transformer_blocks.0.ff.net.0.proj.lora_A.weight": mlp[0],
        "transformer.transformer_blocks.0.ff.net.0.proj.lora_B.weight": mlp[1],
    }
    # what diffusers' save_lora_weights writes (keys prefixed with the component)
    config = {
        "transformer.r": 2,
        "transformer.lora_alpha": 4,
        "transformer.alpha_pattern": {"ff.net.0.proj": 1},
    }
    got = read(write(tmp_path, state, {"lora_adapter_metadata": json.dumps(config)}))
    assert got["double_blocks.0.img_attn.proj"].alpha == 4.0
    assert got["double_blocks.0.img_mlp.0"].alpha == 1.0

    config["transformer.use_rslora"] = True  # scale alpha / sqrt(r) = alpha' / r
    got = read(write(tmp_path, state, {"lora_adapter_metadata": json.dumps(config)}, "rs.safetensors"))
    assert got["double_blocks.0.img_attn.proj"].alpha == pytest.approx(4.0 * math.sqrt(2))


def test_onetrainer_underscored_diffusers_names(tmp_path):
    q = factors(H, H)
    state = {
        "lora_transformer_single_transformer_blocks_0_attn_to_q.lora_down.weight": q[0],
        "lora_transformer_single_transformer_blocks_0_attn_to_q.lora_up.weight": q[1],
        "lora_transformer_single_transformer_blocks_0_attn_to_q.alpha": torch.tensor(1.0),
    }
    got = read(write(tmp_path, state))["single_blocks.0.linear1"]
    expected = torch.zeros(56, 8)
    expected[0:8] = 0.5 * (q[1] @ q[0])
    assert torch.allclose(got.delta(), expected, rtol=1e-6, atol=1e-6)


def test_peft_prefix_on_flux_or_diffusers_names(tmp_path):
    qkv, k = factors(3 * H, H), factors(H, H)
    state = {
        "base_model.model.double_blocks.0.img_attn.qkv.lora_A.weight": qkv[0],
        "base_model.model.double_blocks.0.img_attn.qkv.lora_B.weight": qkv[1],
        "base_model.model.transformer_blocks.1.attn.to_k.lora_A.weight": k[0],
        "base_model.model.transformer_blocks.1.attn.to_k.lora_B.weight": k[1],
    }
    got = read(write(tmp_path, state))
    assert torch.equal(got["double_blocks.0.img_attn.qkv"].up, qkv[1])
    expected = torch.zeros(24, 8)
    expected[8:16] = k[1] @ k[0]
    assert torch.allclose(got["double_blocks.1.img_attn.qkv"].delta(), expected, rtol=1e-6, atol=1e-6)


# --- errors -------------------------------------------------------------------------------------


def pair(stem, out, inp, rank=2, down=".lora_A.weight", up=".lora_B.weight"):
    d, u = factors(out, inp, rank)
    return {stem + down: d, stem + up: u}


def test_no_flux_keys(tmp_path):
    state = pair(
        "lora_te1_text_model_encoder_layers_0_mlp_fc1", 4, 4, down=".lora_down.weight", up=".lora_up.weight"
    )
    with pytest.raises(ValueError) as error:
        read(write(tmp_path, state))
    message = str(error.value)
    assert "seed.safetensors has no LoRA weights for this model's diffusion model" in message
    assert "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight" in message
    # examples of the keys it should have: the model's own layers, and the family's diffusers names
    assert "diffusion_model.double_blocks.0.img_mod.lin.lora_A.weight" in message
    assert "lora_unet_double_blocks_0_img_mod_lin.lora_down.weight" in message
    assert "transformer.transformer_blocks.0.norm1.linear.lora_A.weight" in message


@pytest.mark.parametrize(
    "stem",
    [
        "transformer.transformer_blocks.5.attn.to_q",  # more blocks than this model
        "diffusion_model.double_blocks.7.img_attn.proj",
        "lora_unet_down_blocks_0_attentions_0_proj_in",  # an SD / SDXL UNet LoRA
        "transformer.transformer_blocks.0.attn.to_qkv_mlp_proj",  # FLUX.2 naming
    ],
)
def test_layers_this_model_does_not_have(tmp_path, stem):
    with pytest.raises(ValueError) as error:
        read(write(tmp_path, pair(stem, H, H)))
    message = str(error.value)
    assert "seed.safetensors" in message and stem in message
    assert "does not fit this model" in message


def test_shape_that_does_not_fit(tmp_path):
    state = pair(
        "lora_unet_double_blocks_0_img_attn_qkv", 30, H, down=".lora_down.weight", up=".lora_up.weight"
    )
    path = write(tmp_path, state)
    with pytest.raises(ValueError, match=r"double_blocks\.0\.img_attn\.qkv is a 30x8 LoRA .* layer is 24x8"):
        read(path)
    assert read(path, shapes=None)["double_blocks.0.img_attn.qkv"].up.shape == (30, 2)  # unchecked


def test_part_shape_that_does_not_fit(tmp_path):
    state = pair("transformer.transformer_blocks.0.attn.to_k", H, 12)  # in 12, the model has 8
    with pytest.raises(
        ValueError, match=r"attn\.to_k is a 8x12 LoRA but the model's slice of double_blocks\.0"
    ):
        read(write(tmp_path, state))


def test_rank_mismatch_says_which_rank_to_set(tmp_path):
    path = write(tmp_path, pair("diffusion_model.single_blocks.0.linear2", H, H + MLP, rank=2))
    with pytest.raises(ValueError) as error:
        read(path, rank=4)
    assert str(error.value) == (
        f"{path}: the LoRA file has rank 2 but rank is set to 4; set rank to 2 to start from it"
    )


def test_diffusers_rank_is_the_parts_rank(tmp_path):
    state = {**pair("transformer.transformer_blocks.0.attn.to_q", H, H, rank=3)}
    path = write(tmp_path, state)
    assert read(path, rank=3)["double_blocks.0.img_attn.qkv"].rank == 3
    with pytest.raises(ValueError, match="has rank 3 but rank is set to 9; set rank to 3"):
        read(path, rank=9)


def test_mixed_ranks(tmp_path):
    state = {**pair("diffusion_model.img_in", H, 64, rank=2), **pair("diffusion_model.txt_in", H, 12, rank=4)}
    with pytest.raises(ValueError, match="mixes ranks"):
        read(write(tmp_path, state))


def test_non_lora_weights(tmp_path):
    state = {
        "lora_unet_double_blocks_0_img_attn_qkv.lokr_w1": torch.zeros(2, 2),
        "lora_unet_double_blocks_0_img_attn_qkv.lokr_w2": torch.zeros(12, 4),
    }
    with pytest.raises(ValueError, match=r"lokr_w1 is not a plain LoRA weight"):
        read(write(tmp_path, state))


def test_half_a_pair(tmp_path):
    state = {"diffusion_model.img_in.lora_B.weight": torch.zeros(H, 2)}
    with pytest.raises(
        ValueError, match=r"img_in\.lora_B\.weight has no matching diffusion_model\.img_in\.lora_A"
    ):
        read(write(tmp_path, state))


def test_the_same_layer_twice(tmp_path):
    state = {
        **pair("diffusion_model.double_blocks.0.img_attn.qkv", 3 * H, H),
        **pair("transformer.transformer_blocks.0.attn.to_q", H, H),
    }
    with pytest.raises(ValueError, match=r"double_blocks\.0\.img_attn\.qkv is given twice"):
        read(write(tmp_path, state))


def test_dora_metadata(tmp_path):
    meta = {"lora_adapter_metadata": json.dumps({"transformer.use_dora": True, "transformer.lora_alpha": 2})}
    with pytest.raises(ValueError, match="DoRA"):
        read(write(tmp_path, pair("transformer.transformer_blocks.0.attn.to_q", H, H), meta))


def test_not_safetensors_or_damaged(tmp_path):
    pickle = tmp_path / "old.ckpt"
    pickle.write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match=r"old\.ckpt: only \.safetensors LoRA files"):
        read(pickle)
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"damaged\.safetensors could not be read as a safetensors file"):
        read(damaged)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("nan", r"lora_unet_double_blocks_0_img_attn_proj\.lora_down\.weight holds NaN or infinite values"),
        ("inf", r"lora_unet_double_blocks_0_img_attn_proj\.lora_up\.weight holds NaN or infinite values"),
        ("alpha_nan", r"lora_unet_double_blocks_0_img_attn_proj\.alpha is nan; an alpha must be a finite"),
        ("alpha_0", r"lora_unet_double_blocks_0_img_attn_proj\.alpha is 0, so the LoRA's scale"),
    ],
)
def test_a_start_lora_with_bad_values_is_refused_naming_the_file_and_key(tmp_path, bad, says):
    """Not a ComfyUI problem (the guard would blame ComfyUI), and not a silent run that changes
    nothing (alpha 0): the file and its key are named."""
    stem = "lora_unet_double_blocks_0_img_attn_proj"
    state = pair(stem, H, H, down=".lora_down.weight", up=".lora_up.weight")
    state[f"{stem}.alpha"] = torch.tensor(2.0)
    if bad == "nan":
        state[f"{stem}.lora_down.weight"][0, 0] = float("nan")
    elif bad == "inf":
        state[f"{stem}.lora_up.weight"][1, 1] = float("inf")
    else:
        state[f"{stem}.alpha"] = torch.tensor(float("nan") if bad == "alpha_nan" else 0.0)
    path = write(tmp_path, state)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {says}"):
        read(path)
