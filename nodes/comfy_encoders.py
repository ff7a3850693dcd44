"""ComfyUI's VAE and CLIP as `trainer_core.dataset.Encoders`.

Identities (part of every cache key) fingerprint what determines the encoder's output: the
weights (names, shapes, dtypes, a strided sample of values), the compute dtype, and for the
text encoder any patches (e.g. a LoRA on CLIP) with their strengths.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..trainer_core.dataset import Encoders, identity_of


def _patch_fingerprint(value, digest) -> None:
    """Feed a patch structure (tuples, lists, dicts, tensors, adapter objects) into `digest`."""
    if torch.is_tensor(value):
        flat = value.detach().reshape(-1)
        digest.update(f"{tuple(value.shape)}{value.dtype}".encode())
        digest.update(flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _patch_fingerprint(value[key], digest)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _patch_fingerprint(item, digest)
    elif hasattr(value, "weights"):  # comfy.weight_adapter adapters
        digest.update(type(value).__name__.encode())
        _patch_fingerprint(value.weights, digest)
    else:
        digest.update(
            repr(value if isinstance(value, (int, float, str, bool, type(None))) else type(value)).encode()
        )


def vae_identity(vae) -> str:
    return identity_of(vae.first_stage_model.state_dict().items(), extra=("vae", str(vae.vae_dtype)))


def clip_identity(clip) -> str:
    digest = hashlib.sha256()
    _patch_fingerprint(getattr(clip.patcher, "patches", {}), digest)
    return identity_of(clip.cond_stage_model.state_dict().items(), extra=("clip", digest.hexdigest()))


def comfy_encoders(vae, clip) -> Encoders:
    def encode_image(pixels: np.ndarray) -> torch.Tensor:
        return vae.encode(torch.from_numpy(np.ascontiguousarray(pixels))[None])[0].cpu()

    def encode_text(caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        conditioning = clip.encode_from_tokens_scheduled(clip.tokenize(caption))
        context, extras = conditioning[0]
        pooled = extras.get("pooled_output")
        if pooled is None:
            raise ValueError("this text encoder gives no pooled output; Flux needs one (CLIP-L)")
        return context[0].cpu(), pooled[0].cpu()

    return Encoders(encode_image, encode_text, vae_identity(vae), clip_identity(clip))
