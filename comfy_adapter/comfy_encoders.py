"""ComfyUI's VAE and CLIP as `trainer_core.dataset.Encoders`.

Identities (part of every cache key) fingerprint what determines the encoder's output
(`trainer_core.fingerprint`): the weights (names, shapes, dtypes, a strided sample of
values), the compute dtype, and for the text encoder any patches (e.g. a LoRA on CLIP) with
their strengths. They also name the model family's side of it outright: the VAE's latent
space (channels and scale: FLUX.1 16 at 1/8, FLUX.2 128 at 1/16) and the text encoder's class
(CLIP-L + T5, FLUX.2's Mistral or klein's Qwen3), so a cache filled for one family is never read
for another. `check_text_encoder` refuses a text encoder that fits no model the pack trains.
"""

from __future__ import annotations

import numpy as np
import torch

from ..trainer_core.dataset import Encoders
from ..trainer_core.fingerprint import structure_digest, weights_identity
from .families import sample_encoder_for


def vae_identity(vae) -> str:
    latent_space = (vae.latent_channels, vae.spacial_compression_encode())
    extra = ("vae", str(vae.vae_dtype), latent_space)
    return weights_identity(vae.first_stage_model.state_dict().items(), extra=extra)


def clip_identity(clip) -> str:
    patches = structure_digest(getattr(clip.patcher, "patches", {}))
    kind = type(clip.cond_stage_model).__name__
    return weights_identity(clip.cond_stage_model.state_dict().items(), extra=("clip", kind, patches))


def check_text_encoder(clip) -> None:
    """Refuse a Qwen3 loaded as Z-Image's text encoder: it encodes for no model the pack trains.
    ComfyUI before 0.33 loads every Qwen3-4B so, whatever CLIPLoader's type (it has no FLUX.2
    [klein] encoder); 0.33 does for a type other than flux2."""
    if not type(clip.cond_stage_model).__module__.endswith("text_encoders.z_image"):
        return
    import comfy.text_encoders.flux

    if not hasattr(comfy.text_encoders.flux, "klein_te"):
        from .forward_guard import comfyui_version

        raise ValueError(
            f"the CLIP is a Qwen3, which this ComfyUI ({comfyui_version()}) loads as Z-Image's text "
            "encoder: FLUX.2 [klein]'s text encoder needs ComfyUI 0.33 or newer. Update ComfyUI, then "
            "load the Qwen3 with CLIPLoader type flux2"
        )
    raise ValueError(
        "the CLIP is Z-Image's text encoder (a Qwen3 loaded with a CLIPLoader type other than "
        "flux2): for FLUX.2 [klein], load the Qwen3 with CLIPLoader type flux2"
    )


def comfy_encoders(vae, clip) -> Encoders:
    check_text_encoder(clip)

    def encode_image(pixels: np.ndarray) -> torch.Tensor:
        return vae.encode(torch.from_numpy(np.ascontiguousarray(pixels))[None])[0].cpu()

    def encode_text(caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        conditioning = clip.encode_from_tokens_scheduled(clip.tokenize(caption))
        context, extras = conditioning[0]
        pooled = extras.get("pooled_output")
        if pooled is None:  # FLUX.2's Mistral gives none (its model takes none); FLUX.1 is
            # checked for one when it trains (model_family.check_model_fits)
            return context[0].cpu(), torch.zeros(0)
        return context[0].cpu(), pooled[0].cpu()

    encoders = Encoders(encode_image, encode_text, vae_identity(vae), clip_identity(clip))
    found = sample_encoder_for(vae, clip)
    if found is not None:  # the family encodes whole samples (its text holds the images)
        from .forward_guard import comfyui_version

        encoders.encode_sample, family = found
        # named by the family's model type and node, not an entry (2509 and 2511 encode alike)
        node = family.conditioning_node or "its encoder"
        encoders.sample_identity = f"{family.image_model}: {node}, ComfyUI {comfyui_version()}"
        encoders.sample_note = (
            f"each caption is encoded with its sample's reference images by ComfyUI's {node} node, "
            "which sizes the references itself (about 1024 x 1024 px): reference_resolution does "
            "not apply"
        )
    return encoders
