"""Tiny Flux-architecture models built through ComfyUI's own classes, with seeded weights.

ComfyUI builds its layers with `disable_weight_init` ops, so a fresh model holds whatever
memory `torch.empty` returned; `seeded_init_` gives every parameter a reproducible value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from demo_assets import for_this_comfyui

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

# FLUX.2 [dev] as ComfyUI detects it (comfy/model_detection.py, image_model flux2): global
# modulation, SiLU-gated MLPs, no biases, 4 RoPE axes, theta 2000, 1x1 patches of 128-channel
# latents, references in the index layout with steps of 10, no pooled text (vec_in_dim None);
# only the widths are tiny: hidden 128 (head dim 64 = 4 axes of 16), as wide as a token, so the
# tiny model can learn a per-token edit of all 128 channels.
TINY_FLUX2_CONFIG = {
    "image_model": "flux2",
    "in_channels": 128,
    "out_channels": 128,
    "vec_in_dim": None,
    "context_in_dim": 48,
    "hidden_size": 128,
    "mlp_ratio": 3.0,
    "num_heads": 2,
    "depth": 2,
    "depth_single_blocks": 2,
    "axes_dim": [16, 16, 16, 16],
    "theta": 2000,
    "patch_size": 1,
    "qkv_bias": False,
    "guidance_embed": True,
    "global_modulation": True,
    "mlp_silu_act": True,
    "ops_bias": False,
    "default_ref_method": "index",
    "ref_index_scale": 10.0,
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
    _declare_lazy_parameters(module)
    with torch.no_grad():
        for name, param in list(module.named_parameters()):
            values = seeded_values(name, param.shape, gen).to(param.dtype)
            if param.device.type == "meta":  # ComfyUI 0.33 under dynamic VRAM builds layers on
                # meta and assigns the file's tensors when it loads them: do as its loader does
                owner, _, attribute = name.rpartition(".")
                new = torch.nn.Parameter(values, requires_grad=param.requires_grad)
                setattr(module.get_submodule(owner) if owner else module, attribute, new)
            else:
                param.copy_(values)
    return module


def _declare_lazy_parameters(module: torch.nn.Module) -> None:
    """ComfyUI 0.33 under dynamic VRAM builds its Linear layers with no weight at all (`weight`
    and `bias` None until the loader's state dict assigns them, `comfy.ops` "lazy init"): give
    them `meta` Parameters of the shapes the loader would assign, weight then bias (the order an
    eager build registers them), so `seeded_init_` fills them like every other weight."""
    for layer in module.modules():
        if getattr(layer, "weight", 0) is not None or not hasattr(layer, "comfy_need_lazy_init_bias"):
            continue
        dtype = getattr(layer, "weight_comfy_model_dtype", None) or torch.float32
        shapes = {"weight": (layer.out_features, layer.in_features)}
        if layer.comfy_need_lazy_init_bias:
            shapes["bias"] = (layer.out_features,)
        for attribute, shape in shapes.items():
            empty = torch.empty(shape, device="meta", dtype=dtype)
            setattr(layer, attribute, torch.nn.Parameter(empty, requires_grad=False))


def build_flux_model(
    unet_config: dict,
    seed: int,
    dtype: torch.dtype = torch.float32,
    manual_cast_dtype: torch.dtype | None = None,
    init=seeded_init_,
):
    """A `comfy.model_base.Flux` (or `Flux2`) from ComfyUI's model config for
    `unet_config["image_model"]`, its weights filled by `init(module, seed)`. With
    `manual_cast_dtype`, weights are stored in `dtype` and computed in that one, as the stock
    UNETLoader does for weight_dtype fp8."""
    import comfy.supported_models

    family = {"flux": comfy.supported_models.Flux, "flux2": comfy.supported_models.Flux2}
    model_config = family[unet_config["image_model"]](for_this_comfyui(unet_config))
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


def fp8_flux_patcher(seed: int = 0, **overrides):
    """A tiny Flux stored in e4m3 and computed in fp32 (the stock UNETLoader's weight_dtype fp8):
    every Linear casts per forward."""
    return tiny_flux_patcher(seed, torch.float8_e4m3fn, torch.float32, **overrides)


def tiny_flux2_patcher(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    manual_cast_dtype: torch.dtype | None = None,
    **overrides,
):
    """A MODEL (ModelPatcher) around a tiny FLUX.2."""
    return flux_patcher(build_flux_model({**TINY_FLUX2_CONFIG, **overrides}, seed, dtype, manual_cast_dtype))


def tiny_klein_patcher(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A MODEL around a tiny FLUX.2 [klein]: the tiny FLUX.2 without guidance_in (what ComfyUI's
    detection tells klein by), so the pack takes it as klein 4B (any width but 9B's 4096)."""
    return tiny_flux2_patcher(seed, dtype, **{"guidance_embed": False, **overrides})


def small_flux2_vae(seed: int = 0):
    """A ComfyUI VAE with FLUX.2's latent rule but few channels: 32 z channels, then the 2x2
    pack and batch-norm of `batch_norm_latent` (comfy/ldm/models/autoencoder.py), so latents
    have 128 channels at 1/16 of the image size, as FLUX.2's VAE gives them."""
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    ddconfig = {**SMALL_VAE_DDCONFIG, "z_channels": 32, "batch_norm_latent": True}
    encoder_decoder = {"ddconfig": ddconfig, "embed_dim": 32}
    autoencoder = seeded_init_(AutoencoderKL(**encoder_decoder), seed)
    gen = torch.Generator().manual_seed(seed + 1)  # running statistics: not 0 / 1, so they matter
    autoencoder.bn.running_mean.copy_(0.1 * torch.randn(128, generator=gen))
    autoencoder.bn.running_var.copy_(0.5 + torch.rand(128, generator=gen))
    vae = comfy.sd.VAE(sd=autoencoder.state_dict(), config={"params": encoder_decoder})
    vae.latent_channels, vae.downscale_ratio, vae.upscale_ratio = 128, 16, 16
    return vae


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


def tiny_clip(seed: int = 0, pooled: bool = True):
    """A real ComfyUI CLIP object (CLIP-L tokenizer, `SD1ClipModel`) with a one-layer narrow
    text model and seeded weights. `pooled=False`: its model returns no pooled output, as
    FLUX.2's Mistral text encoder does (ComfyUI's `Flux2TEModel` passes the pooled value of
    its Llama-type model through, and that model has none)."""
    import functools

    import comfy.sd
    import comfy.sd1_clip

    class WithoutPooled(comfy.sd1_clip.SD1ClipModel):
        def encode_token_weights(self, token_weight_pairs):
            out, _pooled, *extra = super().encode_token_weights(token_weight_pairs)
            return (out, None, *extra)

    class Target:
        params: ClassVar[dict] = {}
        clip = functools.partial(
            comfy.sd1_clip.SD1ClipModel if pooled else WithoutPooled,
            clip_model=functools.partial(comfy.sd1_clip.SDClipModel, textmodel_json_config=TINY_CLIP_CONFIG),
        )
        tokenizer = comfy.sd1_clip.SD1Tokenizer

    clip = comfy.sd.CLIP(target=Target, model_options={"dtype": torch.float32})
    seeded_init_(clip.cond_stage_model, seed)
    return clip


@dataclass(frozen=True)
class TinyFamily:
    """What a test needs to run the same check on the tiny FLUX.1 and the tiny FLUX.2."""

    name: str  # ComfyUI's image_model
    patcher: Callable  # (seed=..., dtype=...) -> MODEL
    channels: int  # latent channels
    pooled: int  # pooled text width (0: none)
    layout: str  # the family's default reference layout
    vae: Callable  # (seed) -> a ComfyUI VAE for it


TINY_FAMILIES = {
    "flux": TinyFamily("flux", tiny_flux_patcher, 16, 32, "offset", small_flux_vae),
    "flux2": TinyFamily("flux2", tiny_flux2_patcher, 128, 0, "index", small_flux2_vae),
}


# ComfyUI's Qwen-Image transformer (`supported_models.QwenImage`) at small widths: 2 blocks of
# two 16-wide heads (RoPE axes 4 + 6 + 6), text 64 wide (the tiny Qwen2.5-VL's), Wan 2.1's 16
# latent channels in 2x2 patches (in_channels 64), as its detection would record them
TINY_QWEN_IMAGE_CONFIG = {
    "image_model": "qwen_image",
    "in_channels": 64,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 64,
    "axes_dims_rope": (4, 6, 6),
}


# The same at 128 wide (2 heads of 64, RoPE axes 8 + 28 + 28): its Linears hold over 16 KiB in
# bf16, so dynamic VRAM streams them (ModelPatcherDynamic keeps smaller modules resident)
NARROW_QWEN_IMAGE_CONFIG = {"attention_head_dim": 64, "axes_dims_rope": (8, 28, 28)}


def tiny_qwen_image_patcher(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    release: str = "2509",
    manual_cast_dtype: torch.dtype | None = None,
    config: dict | None = None,
):
    """A MODEL around a tiny Qwen-Image(-Edit) built by ComfyUI's own model config, as a loader
    hands it over (weights in `dtype`, computed in `manual_cast_dtype` if given, as UNETLoader's
    fp8 weight_dtype sets it); `release` 2511 records `default_ref_method`
    `index_timestep_zero`, as ComfyUI 0.33's detection does for a file with the
    `__index_timestep_zero__` key. `config`: other widths (e.g. `NARROW_QWEN_IMAGE_CONFIG`)."""
    import comfy.supported_models

    unet_config = {**TINY_QWEN_IMAGE_CONFIG, **(config or {})}
    if release == "2511":
        unet_config["default_ref_method"] = "index_timestep_zero"
    model_config = comfy.supported_models.QwenImage(unet_config)
    model_config.set_inference_dtype(dtype, manual_cast_dtype)
    model = model_config.get_model({})
    seeded_init_(model.diffusion_model, seed)
    return flux_patcher(model.eval())
