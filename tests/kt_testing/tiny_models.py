"""Tiny Flux-architecture models built through ComfyUI's own classes, with seeded weights.

ComfyUI builds its layers with `disable_weight_init` ops, so a fresh model holds whatever
memory `torch.empty` returned; `seeded_init_` gives every parameter a reproducible value.
"""

from __future__ import annotations

from typing import ClassVar

import torch

# Hidden 64 with 2 heads: head dim 32 = sum(axes_dim). Text 48 / pooled 32 keep it tiny.
TINY_FLUX_CONFIG = {
    "image_model": "flux",
    "in_channels": 16,
    "out_channels": 16,
    "vec_in_dim": 32,
    "context_in_dim": 48,
    "hidden_size": 64,
    "mlp_ratio": 4.0,
    "num_heads": 2,
    "depth": 2,
    "depth_single_blocks": 2,
    "axes_dim": [8, 12, 12],
    "theta": 10000,
    "patch_size": 2,
    "qkv_bias": True,
    "guidance_embed": True,
}

# A Flux VAE with the real topology (4 levels, 8x downscale, 16 latent channels) but narrow.
SMALL_VAE_DDCONFIG = {
    "double_z": True,
    "z_channels": 16,
    "resolution": 256,
    "in_channels": 3,
    "out_ch": 3,
    "ch": 32,
    "ch_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "attn_resolutions": [],
    "dropout": 0.0,
}


def seeded_init_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill every parameter deterministically (the demo assets' rule, `seeded_values`), in
    `named_parameters` order: the same architecture and seed always give the same weights."""
    from demo_assets import seeded_values

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(seeded_values(name, param.shape, gen).to(param.dtype))
    return module


def build_flux_model(
    unet_config: dict,
    seed: int,
    dtype: torch.dtype = torch.float32,
    manual_cast_dtype: torch.dtype | None = None,
    init=seeded_init_,
):
    """A `comfy.model_base.Flux` from `comfy.supported_models.Flux(unet_config)`, its weights
    filled by `init(module, seed)`. With `manual_cast_dtype`, weights are stored in `dtype` and
    computed in that one, as the stock UNETLoader does for weight_dtype fp8."""
    import comfy.supported_models

    model_config = comfy.supported_models.Flux(dict(unet_config))
    model_config.set_inference_dtype(dtype, manual_cast_dtype)
    model = model_config.get_model({})
    init(model.diffusion_model, seed)
    return model.eval()


def flux_patcher(model):
    """A MODEL (ModelPatcher) around a `comfy.model_base.Flux`, as a stock loader hands it over."""
    import comfy.model_management
    import comfy.model_patcher

    return comfy.model_patcher.ModelPatcher(
        model,
        load_device=comfy.model_management.get_torch_device(),
        offload_device=comfy.model_management.unet_offload_device(),
    )


def tiny_flux_patcher(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    manual_cast_dtype: torch.dtype | None = None,
    **overrides,
):
    """A MODEL (ModelPatcher) around a tiny Flux, as a stock loader would hand it over."""
    return flux_patcher(build_flux_model({**TINY_FLUX_CONFIG, **overrides}, seed, dtype, manual_cast_dtype))


def small_flux_vae(seed: int = 0):
    """A ComfyUI VAE object with Flux's topology (16 latent channels, 8x) but few channels."""
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    encoder_decoder = {"ddconfig": SMALL_VAE_DDCONFIG, "embed_dim": 16}
    # Seed the weights on the autoencoder class ComfyUI's VAE builds for this config, then load
    # them through the normal VAE path.
    state = seeded_init_(AutoencoderKL(**encoder_decoder), seed).state_dict()
    vae = comfy.sd.VAE(sd=state, config={"params": encoder_decoder})
    vae.latent_channels = 16
    return vae


# A CLIP-L-shaped text encoder, narrow: its context (48) and pooled output (32) match the tiny
# Flux's context_in_dim and vec_in_dim, so conditioning from it drives the tiny Flux.
TINY_CLIP_CONFIG = {
    "architectures": ["CLIPTextModel"],
    "hidden_act": "quick_gelu",
    "hidden_size": 48,
    "intermediate_size": 96,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "projection_dim": 32,
    "vocab_size": 49408,
    "eos_token_id": 49407,
    "pad_token_id": 1,
    "bos_token_id": 0,
}


def tiny_clip(seed: int = 0):
    """A real ComfyUI CLIP object (CLIP-L tokenizer, `SD1ClipModel`) with a one-layer narrow
    text model and seeded weights."""
    import functools

    import comfy.sd
    import comfy.sd1_clip

    class Target:
        params: ClassVar[dict] = {}
        clip = functools.partial(
            comfy.sd1_clip.SD1ClipModel,
            clip_model=functools.partial(comfy.sd1_clip.SDClipModel, textmodel_json_config=TINY_CLIP_CONFIG),
        )
        tokenizer = comfy.sd1_clip.SD1Tokenizer

    clip = comfy.sd.CLIP(target=Target, model_options={"dtype": torch.float32})
    seeded_init_(clip.cond_stage_model, seed)
    return clip
