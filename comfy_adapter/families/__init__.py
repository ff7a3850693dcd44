"""The model families the pack trains, in one registry keyed by what ComfyUI's own detection
records for a checkpoint (`unet_config["image_model"]`), as ComfyUI's `supported_models` are.

A family is one `ModelFamily` entry, registered by its own module (`flux.py` registers FLUX.1
and FLUX.2). User-facing text names a family by its entry's `title`; "the pack trains ..." is
built from the registry. What a family changes in the training code itself (its blocks, ids,
guard probes, `predict`) is still read from ComfyUI's Flux in the adapter's Flux modules
(ARCHITECTURE.md: the next step of the seam).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...trainer_core.lora_metadata import ModelNames


@dataclass(frozen=True)
class ModelFamily:
    image_model: str  # ComfyUI's unet_config["image_model"]: the registry key
    title: str  # what users call it, in every message
    trains: str  # the models of the family the pack trains, for messages ("FLUX.1 (dev, Kontext)")
    layouts: tuple[str, ...]  # the reference layouts that fit it; the first is its default
    names: ModelNames  # what a LoRA's metadata calls the base model
    text_encoder: str  # what LoadKontextDataset's CLIP should be, for messages
    base_models: tuple[str, str]  # ours (kontext_trainer.base_model): without / with references
    # (diffusion model) -> the name of a model that shares this image_model but is not trained
    # (its text ids, layers or text encoder differ), or None
    variant: Callable[[object], str | None] = field(default=lambda diffusion_model: None, compare=False)

    def base_model(self, references: int) -> str:
        """Which model the LoRA is for."""
        return self.base_models[bool(references)]

    def check_layout(self, layout: str) -> str:
        if layout not in self.layouts:
            raise ValueError(
                f"layout {layout!r} does not fit a {self.title} model; choose one of "
                f"{', '.join(self.layouts)} ({self.layouts[0]} is its default)"
            )
        return layout


FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    FAMILIES[family.image_model] = family
    return family


def trained_models() -> str:
    """What the pack trains, for messages: e.g. "FLUX.1 (dev, Kontext) and FLUX.2 [dev]"."""
    names = [family.trains for family in _all()]
    return " and ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


def family_named(image_model: str | None, what: str = "this MODEL") -> ModelFamily:
    """The family ComfyUI detected, or a clear refusal for a model the pack does not train."""
    family = _all_named().get(image_model or "")
    if family is None:
        kind = f"a {image_model} model" if image_model else "a model of no type ComfyUI detects"
        raise ValueError(
            f"{what} is {kind}; Kontext Trainer handles {trained_models()}. Load one of those with "
            "the stock loaders"
        )
    return family


def refuse_variant(variant: str | None, what: str = "this MODEL") -> None:
    if variant is not None:
        raise ValueError(
            f"{what} is {variant}, which ComfyUI runs with its Flux code; Kontext Trainer trains "
            f"{trained_models()} only (its text ids, layers or text encoder differ, and training it "
            "is not proven). Load one of those with the stock loaders"
        )


def _all_named() -> dict[str, ModelFamily]:
    from . import flux  # noqa: F401  (registers the built-in families)

    return FAMILIES


def _all() -> list[ModelFamily]:
    return list(_all_named().values())
