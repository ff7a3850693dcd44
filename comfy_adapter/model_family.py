"""The family of a ComfyUI MODEL, read from ComfyUI's own detection (no widget to get wrong),
and the checks made with it before a run or a conditioning node uses the model.

`family_of(model)` is its `families.ModelFamily` (or a clear refusal); `token_grid(diffusion_model)`
the model's patch size, RoPE axes and index step; `text_in(base_model)` turns a cached caption
embedding into what sampling hands the model (ComfyUI's own `extra_conds`: FLUX.2 pads the text
to 512 tokens at the front), so training sees exactly the text inference sees.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ..trainer_core.position_ids import TIMESTEP_ZERO_LAYOUTS, TokenGrid
from ..trainer_core.vram import Estimate, FluxShape, estimate_vram
from .comfy_quantized import stored_weight_bytes
from .families import ModelFamily, family_named, refuse_variant


def image_model_of(model) -> str | None:
    """ComfyUI's `image_model` for a MODEL (ModelPatcher), None for a model without one."""
    config = getattr(getattr(model.model, "model_config", None), "unet_config", None) or {}
    return config.get("image_model")


def family_of(model, what: str = "this MODEL") -> ModelFamily:
    """The family, or a clear refusal for a model the pack does not train (also one that
    shares a family's `image_model`: LongCat-Image, Ovis-Image, FLUX.2 [klein])."""
    family = family_named(image_model_of(model), what)
    refuse_variant(family.variant(model.model.diffusion_model), what)
    return family


def comfy_runs_timestep_zero(diffusion_model) -> bool:
    """True where this ComfyUI's Flux can feed the references at timestep 0 (0.33 and later:
    `forward_orig` takes `timestep_zero_index`)."""
    forward_orig = getattr(type(diffusion_model), "forward_orig", None)
    return forward_orig is not None and "timestep_zero_index" in inspect.signature(forward_orig).parameters


def check_layout_fits(model, layout: str, what: str = "this MODEL") -> ModelFamily:
    """The MODEL's family, after checking that the layout fits it and that this ComfyUI runs it
    (an older ComfyUI would silently take an unknown method name for `offset`)."""
    family = family_of(model, what)
    family.check_layout(layout)
    if layout in TIMESTEP_ZERO_LAYOUTS and not comfy_runs_timestep_zero(model.model.diffusion_model):
        from .forward_guard import comfyui_version

        raise ValueError(
            f"layout {layout!r} needs ComfyUI 0.33 or newer (its Flux feeds the references at "
            f"timestep 0); this ComfyUI is {comfyui_version()}. Update ComfyUI, or choose "
            f"{family.layouts[0]}"
        )
    return family


def token_grid(diffusion_model) -> TokenGrid:
    params = diffusion_model.params
    return TokenGrid(params.patch_size, len(params.axes_dim), float(params.ref_index_scale))


def text_in(base_model) -> Callable[[torch.Tensor], torch.Tensor]:
    """(T, D) caption embedding -> the (T', D) context the model gets when sampling."""

    def apply(context: torch.Tensor) -> torch.Tensor:
        conds = base_model.extra_conds(cross_attn=context[None], pooled_output=None)
        return conds["c_crossattn"].cond[0]

    return apply


def check_model_fits(model, dataset, layout: str) -> ModelFamily:
    """The MODEL's family, after checking that the dataset was encoded for it (LoadKontextDataset
    takes the VAE and CLIP separately, so a FLUX.1 dataset can meet a FLUX.2 MODEL) and that
    the layout fits it. Reads one cached sample."""
    family = check_layout_fits(model, layout)
    if not dataset.entries:
        return family
    sample = dataset.sample(dataset.entries[0])
    params = model.model.diffusion_model.params
    channels, width = sample.target.shape[0], sample.context.shape[-1]
    if channels != params.in_channels:
        raise ValueError(
            f"the dataset's latents have {channels} channels but this {family.title} MODEL takes "
            f"{params.in_channels}: give LoadKontextDataset the {family.title} VAE"
        )
    if width != params.context_in_dim:
        raise ValueError(
            f"the dataset's caption embeddings are {width} wide but this {family.title} MODEL "
            f"takes {params.context_in_dim}: give LoadKontextDataset the {family.text_encoder}"
        )
    if params.vec_in_dim and sample.pooled.numel() < params.vec_in_dim:  # Flux reads the first ones
        raise ValueError(
            f"this {family.title} MODEL needs a pooled text embedding of {params.vec_in_dim} "
            f"values and the dataset's text encoder gave {sample.pooled.numel()}: give "
            f"LoadKontextDataset the {family.text_encoder}"
        )
    return family


def vram_estimate(model, dataset, config) -> Estimate:
    """The estimate for this model, dataset and config (shown before training starts)."""
    flux = model.model.diffusion_model
    itemsize = stored_weight_bytes(flux.double_blocks[0].img_attn.qkv)  # a quantized file: its fp8
    loaded = {1: "fp8", 2: "bf16"}.get(itemsize, "fp32")
    return estimate_vram(
        FluxShape.of(flux.params),
        resolution=dataset.settings.resolution,
        references=dataset.reference_count,
        batch=config.batch_size,
        rank=config.rank,
        weight_format="fp8_scaled" if config.fp8_mode == "fp8_scaled" else loaded,
        base_format=loaded,
        blocks_to_swap=config.blocks_to_swap,
        gradient_checkpointing=config.gradient_checkpointing,
        optimizer=config.optimizer,
    )
