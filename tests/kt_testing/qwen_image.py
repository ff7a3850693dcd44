"""Tiny Qwen-Image-Edit parts built by ComfyUI's own classes (issue 43 item 3): the text encoder
(`QwenImageTEModel`, a narrow Qwen2.5-VL language model through `qwen25_7b_model_config` and a
small `qwen_vl.Qwen2VLVisionTransformer` of 8 layers in place of the 1280-wide tower: its block 7
is full attention, the others windowed) and a narrow Wan 2.1 VAE through `comfy.sd.VAE`."""

from __future__ import annotations

import torch

from .tiny_models import seeded_init_

# Qwen2.5-VL's language model, narrow: ComfyUI's config fixes the head width (128) and the rope
# sections, so one head of 128 on a 64-wide stream; its vocabulary stays (the tokenizer's ids)
QWEN25_TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
}
# the vision tower: 8 blocks (fullatt_block_indexes: 7 of them windowed, block 7 full), 2 heads of 16
VISION_TINY = {"hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "num_layers": 8}
TEXT_WIDTH = QWEN25_TINY["hidden_size"]


def tiny_qwen_image_clip(seed: int = 2):
    """A CLIP as CLIPLoader type qwen_image builds it (`comfy.text_encoders.qwen_image.te`, its
    tokenizer with the Qwen2.5 vocabulary and chat templates), narrow, seeded."""
    import comfy.sd
    import comfy.supported_models_base
    import comfy.text_encoders.qwen_image as qwen_image
    import comfy.text_encoders.qwen_vl as qwen_vl

    model_class = qwen_image.te(dtype_llama=torch.float32)

    def with_small_vision_tower(**params):
        """ComfyUI's text encoder model, its vision tower swapped before `comfy.sd.CLIP` makes
        (and loads) its patcher, so the patcher knows only the small tower's weights (under
        dynamic VRAM it restores what it loaded)."""
        model = model_class(**params)
        model.qwen25_7b.transformer.visual = qwen_vl.Qwen2VLVisionTransformer(
            output_hidden_size=TEXT_WIDTH,
            dtype=torch.float32,
            ops=comfy.ops.disable_weight_init,
            **VISION_TINY,
        )
        return model

    target = comfy.supported_models_base.ClipTarget(qwen_image.QwenImageTokenizer, with_small_vision_tower)
    clip = comfy.sd.CLIP(target, model_options={"qwen25_7b_model_config": QWEN25_TINY})
    seeded_init_(clip.cond_stage_model, seed)
    return clip


def small_wan_vae(seed: int = 1):
    """A ComfyUI VAE with Wan 2.1's topology (16 latent channels, 8x, 5-D latents) 8 wide: ComfyUI
    reads the width from `decoder.head.0.gamma` and builds the rest as for the real file."""
    import comfy.ldm.wan.vae
    import comfy.sd

    config = {
        "dim": 4,
        "z_dim": 16,
        "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 2,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "dropout": 0.0,
    }
    state = seeded_init_(comfy.ldm.wan.vae.WanVAE(**config), seed).state_dict()
    return comfy.sd.VAE(sd=state)


# A server whose stock UNETLoader reads a Qwen-Image file's widths (the test pack does it where
# this variable is "1"): ComfyUI's detection fixes them (3072 wide, 24 heads of 128, text 3584),
# so the tiny model's files cannot load through the stock loader otherwise. Everything after the
# widths is ComfyUI's own: the file's form (fp8, `_quantization_metadata`, `comfy_quant`), the
# model config its detection picks (2511 by its key, on 0.33), ModelPatcherDynamic and mapped
# weights under dynamic VRAM.
QWEN_WIDTHS_ENV = "KT_TEST_QWEN_WIDTHS"
# RoPE's axes are no tensor of the file: the tiny model's, or Qwen-Image's for its head width
_ROPE_AXES = {16: (4, 6, 6), 64: (8, 28, 28), 128: (16, 56, 56)}


def read_qwen_widths() -> None:
    """For a Qwen-Image file, the widths its tensors hold (head width from `norm_q`, stream width
    from `img_in`, text width from `txt_norm`) over what ComfyUI detected
    (`kt_testing.flux_widths.read_widths`)."""
    from .flux_widths import read_widths

    def widths(state_dict, key_prefix, detected):
        head = state_dict[f"{key_prefix}transformer_blocks.0.attn.norm_q.weight"].shape[0]
        inner = state_dict[f"{key_prefix}img_in.weight"].shape[0]
        return {
            "attention_head_dim": head,
            "num_attention_heads": inner // head,
            "joint_attention_dim": state_dict[f"{key_prefix}txt_norm.weight"].shape[0],
            "axes_dims_rope": _ROPE_AXES[head],
        }

    read_widths("qwen_image", widths)


def tiny_qwen_image_file(
    path, seed: int = 3, release: str = "2509", form: str = "plain", config: dict | None = None
):
    """The tiny Qwen-Image-Edit's diffusion-model file as ComfyUI distributes the real one: `form`
    "plain" (bf16), "fp8_e4m3fn" (every weight of the blocks stored in e4m3, as
    `qwen_image_edit_2509_fp8_e4m3fn`), or a quantized form of `kt_testing.quantized_files`
    (the block Linears quantized by ComfyUI's own code: `quantization_metadata` is fp8mixed's);
    2511's file holds the `__index_timestep_zero__` key; `config`: other widths (the tiny
    model's by default)."""
    from pathlib import Path

    from safetensors.torch import save_file

    from .quantized_files import FORMS, write_quantized_file
    from .tiny_models import tiny_qwen_image_patcher

    model = tiny_qwen_image_patcher(seed=seed, config=config).model.diffusion_model
    state = {key: value.to(torch.bfloat16) for key, value in model.state_dict().items()}
    if release == "2511":
        state["__index_timestep_zero__"] = torch.zeros(0)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if form in FORMS:
        return write_quantized_file(path, state, form)
    if form == "fp8_e4m3fn":
        state = {
            k: v.to(torch.float8_e4m3fn) if k.startswith("transformer_blocks.") and v.ndim == 2 else v
            for k, v in state.items()
        }
    elif form != "plain":
        raise ValueError(f"unknown form {form!r}")
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path
