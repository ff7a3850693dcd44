"""FLUX.2 [klein] for the tests: a tiny klein as ComfyUI 0.33's detection reads one (its weights
under the release files' key names), a tiny Qwen3 through ComfyUI's klein text encoder, and the
same Qwen3 as ComfyUI loads it as Z-Image's text encoder (0.3.75, or 0.33 with another
CLIPLoader type)."""

from __future__ import annotations

import importlib

import torch

from .tiny_models import TINY_FLUX2_CONFIG, build_flux_model, seeded_init_

# A klein as ComfyUI 0.33's detection reads one: axes 4 x 32, 128 channels per head, MLP ratio
# 3, no guidance_in; 1 head of 128, two blocks of each kind, text 3 x 16 wide (the tiny Qwen3's).
KLEIN_CONFIG = {
    **TINY_FLUX2_CONFIG,
    "hidden_size": 128,
    "num_heads": 1,
    "axes_dim": [32, 32, 32, 32],
    "context_in_dim": 48,
    "guidance_embed": False,
}
# Qwen3-4B's layout, narrow: ComfyUI's klein_te taps layers 9, 18 and 27 (so at least 28) and its
# head width is fixed at 128.
QWEN3_TINY = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 28,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
}


def comfy_has_klein() -> bool:
    return hasattr(importlib.import_module("comfy.text_encoders.flux"), "klein_te")


def klein_state(seed: int = 3) -> dict[str, torch.Tensor]:
    """The tiny klein's weights as the release files store them: the diffusion model's own key
    names, no prefix (ComfyUI's UNETLoader detects klein from them)."""
    model = build_flux_model(KLEIN_CONFIG, seed=seed)
    return {key: value.contiguous() for key, value in model.diffusion_model.state_dict().items()}


def qwen3_clip(seed: int = 2):
    """A tiny Qwen3 through ComfyUI's klein_te and KleinTokenizer, as `comfy.sd.load_clip` builds
    a Qwen3-4B for CLIPLoader type flux2 (its detection reads the width, 2560, so the narrow
    model is built by the same steps with `qwen3_4b_model_config`), from a file's key names."""
    import comfy.sd
    import comfy.supported_models_base
    import comfy.text_encoders.flux as flux_te

    def target():
        clip = flux_te.klein_te(dtype_llama=torch.float32, model_type="qwen3_4b")
        return comfy.supported_models_base.ClipTarget(flux_te.KleinTokenizer, clip)

    options = {"qwen3_4b_model_config": QWEN3_TINY}
    empty = comfy.sd.CLIP(target(), model_options=options)
    prefix = "qwen3_4b.transformer."
    weights = seeded_init_(empty.cond_stage_model, seed).state_dict()
    file_keys = {key[len(prefix) :]: value for key, value in weights.items() if key.startswith(prefix)}
    assert "model.layers.27.self_attn.q_norm.weight" in file_keys  # Qwen3's keys, 28 layers
    return comfy.sd.CLIP(target(), state_dict=[file_keys], model_options=options)


def z_image_clip():
    """A tiny Qwen3 as ComfyUI loads one as Z-Image's text encoder (0.3.75: every Qwen3-4B, for
    any CLIPLoader type; 0.33: for a type other than flux2)."""
    import comfy.sd
    import comfy.supported_models_base
    import comfy.text_encoders.z_image as z_image

    clip = z_image.te(dtype_llama=torch.float32)
    target = comfy.supported_models_base.ClipTarget(z_image.ZImageTokenizer, clip)
    return comfy.sd.CLIP(target, model_options={"qwen3_4b_model_config": QWEN3_TINY})


def klein_text_encoder(seed: int = 2):
    """What CLIPLoader type flux2 gives for a Qwen3-4B file on this ComfyUI: klein's text encoder
    on 0.33, Z-Image's on 0.3.75 (which has no klein encoder)."""
    return qwen3_clip(seed) if comfy_has_klein() else z_image_clip()


def klein_patcher(seed: int = 3, dtype: torch.dtype = torch.float32):
    """A MODEL around the tiny klein built with ComfyUI's classes (as the UNETLoader of 0.33
    loads its file; ComfyUI 0.3.75's own loader cannot build one), its weights in `dtype`."""
    from .tiny_models import flux_patcher

    return flux_patcher(build_flux_model(KLEIN_CONFIG, seed=seed, dtype=dtype))
