"""The family of a ComfyUI MODEL, read from ComfyUI's own detection (no widget to get wrong),
and the checks made with it before a run or a conditioning node uses the model.

`family_of(model)` is its `families.ModelFamily` entry (or a clear refusal), the one lookup a run
makes: the run carries what it returns (`PreparedRun.family_for`, `Run.family`); `text_in(base_model)`
turns a cached caption embedding into what sampling hands the model (ComfyUI's own
`extra_conds`: FLUX.2 pads the text to 512 tokens at the front), so training sees exactly the
text inference sees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..trainer_core.vram import Estimate
from .families import ModelFamily, entry_for, refuse_variant


def unet_config_of(model) -> dict:
    """What ComfyUI's detection recorded for a MODEL (ModelPatcher): its model config's
    `unet_config` (empty for a model without one)."""
    return getattr(getattr(model.model, "model_config", None), "unet_config", None) or {}


def family_of(model, what: str = "this MODEL") -> ModelFamily:
    """The model's entry (FLUX.1, FLUX.2 [dev], FLUX.2 [klein] 4B / 9B), or a clear refusal for
    a model the pack does not train (also one that shares an entry's `image_model`: LongCat-Image,
    Ovis-Image)."""
    family = entry_for(unet_config_of(model), what)
    diffusion_model = model.model.diffusion_model
    refuse_variant(family, family.variant(diffusion_model), what)
    return family


def check_layout_fits(model, layout: str, what: str = "this MODEL", family: ModelFamily | None = None):
    """The MODEL's family (`family`: already resolved for it), after checking that the layout
    fits it and that this ComfyUI runs it."""
    family = family or family_of(model, what)
    family.check_layout(layout, model.model.diffusion_model)
    return family


def text_in(base_model) -> Callable[[torch.Tensor], torch.Tensor]:
    """(T, D) caption embedding -> the (T', D) context the model gets when sampling."""

    def apply(context: torch.Tensor) -> torch.Tensor:
        conds = base_model.extra_conds(cross_attn=context[None], pooled_output=None)
        return conds["c_crossattn"].cond[0]

    return apply


def check_model_fits(model, dataset, layout: str, family: ModelFamily | None = None) -> ModelFamily:
    """The MODEL's family, after checking that the dataset was encoded for it (LoadKontextDataset
    takes the VAE and CLIP separately, so a dataset of one family can meet a MODEL of another)
    and that the layout fits it. Reads one cached sample."""
    family = check_layout_fits(model, layout, family=family)
    if dataset.entries:
        family.check_sample(model.model.diffusion_model, dataset.sample(dataset.entries[0]))
    return family


def vram_estimate(model, dataset, config, family: ModelFamily | None = None) -> Estimate:
    """The estimate for this model, dataset and config (shown before training starts)."""
    return (family or family_of(model)).vram_estimate(model.model.diffusion_model, dataset, config)
