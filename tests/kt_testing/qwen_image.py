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

    target = comfy.supported_models_base.ClipTarget(
        qwen_image.QwenImageTokenizer, qwen_image.te(dtype_llama=torch.float32)
    )
    clip = comfy.sd.CLIP(target, model_options={"qwen25_7b_model_config": QWEN25_TINY})
    language = clip.cond_stage_model.qwen25_7b.transformer
    language.visual = qwen_vl.Qwen2VLVisionTransformer(
        output_hidden_size=TEXT_WIDTH, dtype=torch.float32, ops=comfy.ops.disable_weight_init, **VISION_TINY
    )
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
