"""The family of a ComfyUI MODEL, read from ComfyUI's own detection (no widget to get wrong),
and the checks made with it before a run or a conditioning node uses the model.

`family_of(model)` is its `families.ModelFamily` (or a clear refusal); `text_in(base_model)`
turns a cached caption embedding into what sampling hands the model (ComfyUI's own
`extra_conds`: FLUX.2 pads the text to 512 tokens at the front), so training sees exactly the
text inference sees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..trainer_core.vram import Estimate
from .families import ModelFamily, family_named, refuse_variant


def image_model_of(model) -> str | None:
    """ComfyUI's `image_model` for a MODEL (ModelPatcher), None for a model without one."""
    config = getattr(getattr(model.model, "model_config", None), "unet_config", None) or {}
    return config.get("image_model")


def family_of(model, what: str = "this MODEL") -> ModelFamily:
    """The family, or a clear refusal for a model the pack does not train (also one that
    shares a family's `image_model`: LongCat-Image, Ovis-Image, FLUX.2 [klein])."""
    family = family_named(image_model_of(model), what)
    refuse_variant(family, family.variant(model.model.diffusion_model), what)
    return family


def check_layout_fits(model, layout: str, what: str = "this MODEL") -> ModelFamily:
    """The MODEL's family, after checking that the layout fits it and that this ComfyUI runs it."""
    family = family_of(model, what)
    family.check_layout(layout, model.model.diffusion_model)
    return family


def text_in(base_model) -> Callable[[torch.Tensor], torch.Tensor]:
    """(T, D) caption embedding -> the (T', D) context the model gets when sampling."""

    def apply(context: torch.Tensor) -> torch.Tensor:
        conds = base_model.extra_conds(cross_attn=context[None], pooled_output=None)
        return conds["c_crossattn"].cond[0]

    return apply


def check_model_fits(model, dataset, layout: str) -> ModelFamily:
    """The MODEL's family, after checking that the dataset was encoded for it (LoadKontextDataset
    takes the VAE and CLIP separately, so a dataset of one family can meet a MODEL of another)
    and that the layout fits it. Reads one cached sample."""
    family = check_layout_fits(model, layout)
    if dataset.entries:
        family.check_sample(model.model.diffusion_model, dataset.sample(dataset.entries[0]))
    return family


def vram_estimate(model, dataset, config) -> Estimate:
    """The estimate for this model, dataset and config (shown before training starts)."""
    return family_of(model).vram_estimate(model.model.diffusion_model, dataset, config)
