"""Preview sampling for a training run: the prompts, sizes and sampler a PreviewSampler node
describes (`PreviewSettings`), sampled with the LoRA as it is at a step through ComfyUI's own
sampler and the training clone (`sample_previews`), and saved to ComfyUI's temp folder
(`save_previews`). Sampling draws its noise from its own generator and restores torch's global
RNG, so previews never change the training run; it runs in eval mode (LoRA dropout off, as the
saved LoRA will be used) and puts the training mode back afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..trainer_core.atomic import ensure_folder
from ..trainer_core.loss_chart import save_png_atomic
from ..trainer_core.names import preview_name
from ..trainer_core.validation import evaluating
from .comfy_loading import as_the_executor_loads
from .trainable_blocks import comfy_training_mode

PREVIEW_FOLDER = "kontext_trainer_previews"


@dataclass
class PreviewSettings:
    positive: list  # ComfyUI CONDITIONING
    negative: list | None
    vae: object
    every_n_steps: int
    steps: int
    cfg: float
    guidance: float
    width: int
    height: int
    seed: int
    sampler_name: str
    scheduler: str


def _with(conditioning, values: dict):
    import node_helpers

    return node_helpers.conditioning_set_values(conditioning, values)


def empty_latent(latent_format, settings: PreviewSettings) -> torch.Tensor:
    """The empty latent of the model's family, as the stock KSampler shapes it
    (`comfy.sample.fix_empty_latent_channels`): FLUX.1 16 channels at 1/8, FLUX.2 128 at 1/16,
    Qwen-Image 16 at 1/8 with a frame axis, `(1, 16, 1, h, w)`."""
    scale = settings.vae.spacial_compression_encode()
    frames = (1,) * (getattr(latent_format, "latent_dimensions", 2) - 2)
    return torch.zeros(
        1, latent_format.latent_channels, *frames, settings.height // scale, settings.width // scale
    )


def sample_previews(session, settings: PreviewSettings, layout: str) -> torch.Tensor:
    """(B, H, W, 3) images for every prompt of `settings.positive`, sampled with the model
    as the session holds it (LoRA included)."""
    import comfy.model_management
    import comfy.sample

    positive = _with(settings.positive, {"guidance": settings.guidance, "reference_latents_method": layout})
    negative = settings.negative
    if negative is None:  # like ConditioningZeroOut: unused at cfg 1, plain unconditional otherwise
        negative = [
            [torch.zeros_like(c), {k: v for k, v in o.items() if k != "reference_latents"}]
            for c, o in settings.positive
        ]
    # a negative's references (Qwen-Image-Edit's encoder node puts them into both) in the run's layout
    negative = [
        [c, {**o, "reference_latents_method": layout} if "reference_latents" in o else o] for c, o in negative
    ]
    latent = empty_latent(session.patcher.model.latent_format, settings)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with (
        evaluating(session.diffusion_model),
        torch.random.fork_rng(devices=devices),
        comfy_training_mode(False),  # sampling as ComfyUI samples (its fused RoPE)
    ):
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(settings.seed))
        samples = comfy.sample.sample(
            session.patcher,
            noise,
            settings.steps,
            settings.cfg,
            settings.sampler_name,
            settings.scheduler,
            positive,
            negative,
            latent,
            disable_pbar=True,
            seed=settings.seed,
        )
        with as_the_executor_loads():  # decoding loads the VAE (from the training thread)
            images = settings.vae.decode(samples.to(comfy.model_management.intermediate_device()))
    return images.reshape(-1, *images.shape[-3:]).float().cpu()


def save_previews(images: torch.Tensor, temp_dir: Path, stem: str, step: int) -> list[dict]:
    """PNGs in ComfyUI's temp folder; returns the `/view` references ({filename, subfolder, type})."""
    folder = Path(temp_dir) / PREVIEW_FOLDER
    ensure_folder(folder)
    refs = []
    for index, image in enumerate(images):
        name = preview_name(stem, step, index)
        pixels = (image.clamp(0, 1).numpy() * 255).round().astype(np.uint8)
        save_png_atomic(Image.fromarray(pixels), folder / name)  # whole or not at all
        refs.append({"filename": name, "subfolder": PREVIEW_FOLDER, "type": "temp", "step": step})
    return refs
