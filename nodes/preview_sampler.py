"""PreviewSampler: what TrainLoRA should sample while it trains, and the sampling itself.

The node only describes the previews (prompt conditioning, with reference images from
MultiImageConditioning if any; optional negative for true CFG; guidance; size; steps; every
N training steps) and hands them to TrainLoRA's `preview` input. TrainLoRA's training thread
calls `sample_previews` between optimizer steps, with the LoRA as it is at that step, through
ComfyUI's own KSampler and the training clone (same reference layout as training). Images
are saved to ComfyUI's temp folder, shown on the TrainLoRA node, and the last ones come out
of TrainLoRA as IMAGE. Sampling draws its noise from its own generator and restores torch's
global RNG, so previews never change the training run; it runs in eval mode (LoRA dropout
off, as the saved LoRA will be used) and puts the training mode back afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from comfy_api.latest import io
from PIL import Image

from ..trainer_core.limits import check_number
from ..trainer_core.names import preview_name
from ..trainer_core.validation import evaluating
from .comfy_loading import as_the_executor_loads
from .extension_ids import node_id
from .flux_blocks import comfy_training_mode

Preview = io.Custom("KONTEXT_PREVIEW")
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
    # the empty latent of the model's family (FLUX.1: 16 channels at 1/8, FLUX.2: 128 at 1/16)
    channels = session.patcher.model.latent_format.latent_channels
    scale = settings.vae.spacial_compression_encode()
    latent = torch.zeros(1, channels, settings.height // scale, settings.width // scale)
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
    folder.mkdir(parents=True, exist_ok=True)
    refs = []
    for index, image in enumerate(images):
        name = preview_name(stem, step, index)
        pixels = (image.clamp(0, 1).numpy() * 255).round().astype(np.uint8)
        Image.fromarray(pixels).save(folder / name)
        refs.append({"filename": name, "subfolder": PREVIEW_FOLDER, "type": "temp", "step": step})
    return refs


class PreviewSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import comfy.samplers

        return io.Schema(
            node_id=node_id("PreviewSampler"),
            display_name="PreviewSampler",
            category="Kontext Trainer",
            description="Previews for TrainLoRA: samples these prompts (with their reference images) with "
            "the LoRA being trained, every N steps and at the end, using ComfyUI's own sampler.",
            inputs=[
                io.Conditioning.Input(
                    "positive",
                    tooltip="Preview prompt(s): CLIPTextEncode, or MultiImageConditioning for references.",
                ),
                io.Vae.Input("vae", tooltip="Decodes the previews."),
                io.Int.Input(
                    "every_n_steps", default=100, min=1, max=100_000, tooltip="Sample every N training steps."
                ),
                io.Int.Input("steps", default=20, min=1, max=200, tooltip="Sampling steps per preview."),
                io.Float.Input(
                    "cfg",
                    default=1.0,
                    min=1.0,
                    max=30.0,
                    step=0.1,
                    tooltip="1 for guidance-distilled models; above 1 runs true CFG with `negative`.",
                ),
                io.Float.Input(
                    "guidance",
                    default=3.5,
                    min=0.0,
                    max=100.0,
                    step=0.1,
                    tooltip="Flux guidance-embedding value for distilled models (dev / Kontext).",
                ),
                io.Int.Input("width", default=1024, min=64, max=4096, step=16),
                io.Int.Input("height", default=1024, min=64, max=4096, step=16),
                io.Int.Input(
                    "seed",
                    default=0,
                    min=0,
                    max=2**31 - 1,
                    control_after_generate=False,
                    tooltip="Same seed every time, so previews show how the LoRA changes.",
                ),
                io.Combo.Input(
                    "sampler_name", options=list(comfy.samplers.KSampler.SAMPLERS), default="euler"
                ),
                io.Combo.Input(
                    "scheduler", options=list(comfy.samplers.KSampler.SCHEDULERS), default="simple"
                ),
                io.Conditioning.Input(
                    "negative", optional=True, tooltip="For true CFG (cfg > 1); zero if absent."
                ),
            ],
            outputs=[Preview.Output(display_name="preview")],
        )

    @classmethod
    def execute(cls, negative=None, **inputs) -> io.NodeOutput:
        # the inputs are PreviewSettings' fields, by name; NaN passes ComfyUI's min / max check
        check_number("cfg", inputs["cfg"], 1.0, 30.0)
        check_number("guidance", inputs["guidance"], 0.0, 100.0)
        return io.NodeOutput(PreviewSettings(negative=negative, **inputs))
