"""The Flux families the pack trains, and what differs between them outside the model code.

ComfyUI detects the family from a checkpoint's keys and records it as
`unet_config["image_model"]`: `flux` for FLUX.1 (dev, Kontext, schnell) and `flux2` for
FLUX.2 [dev]. Both run the same `comfy/ldm/flux/model.py` class; the differences the trainer
sees come from the model's `FluxParams` (patch size, RoPE axes, the index layout's step:
`position_ids.TokenGrid`) and from this table (which reference layouts fit, and the names a
LoRA file's metadata gives the base model).
"""

from __future__ import annotations

from dataclasses import dataclass

from .position_ids import LAYOUTS, TIMESTEP_ZERO_LAYOUTS


@dataclass(frozen=True)
class FluxFamily:
    image_model: str  # ComfyUI's unet_config["image_model"]
    title: str  # what users call it
    layouts: tuple[str, ...]  # the reference layouts that make sense for it
    base_model_version: str  # metadata: ss_base_model_version
    architecture: str  # metadata: modelspec.architecture
    text_encoder: str  # what LoadKontextDataset's CLIP should be, for messages
    base_models: tuple[str, str]  # ours (kontext_trainer.base_model): without / with references

    def base_model(self, references: int) -> str:
        """Which model the LoRA is for."""
        return self.base_models[bool(references)]


FLUX1 = FluxFamily(
    "flux",
    "FLUX.1",
    # not index_timestep_zero: ComfyUI (0.33) runs it only with FLUX.2's model-wide modulation;
    # FLUX.1's per-block modulation fails on the doubled timestep batch
    tuple(layout for layout in LAYOUTS if layout not in TIMESTEP_ZERO_LAYOUTS),
    # sd-scripts' names for every FLUX.1 model (Kontext has FLUX.1 dev's weights and shapes)
    "flux1",
    "flux-1-dev/lora",
    "CLIP-L + T5-XXL (DualCLIPLoader, type flux)",
    ("flux1_dev", "flux1_kontext"),
)
FLUX2 = FluxFamily(
    "flux2",
    "FLUX.2",
    # ComfyUI computes offset / index / uxo for FLUX.2 exactly as for FLUX.1 (index is its
    # default, with steps of 10). DreamOmni2's ids were learnt by a FLUX.1 Kontext model.
    # index_timestep_zero (ComfyUI 0.33+): index ids, references modulated at timestep 0.
    ("index", "offset", "uxo", "index_timestep_zero"),
    "flux2",
    "Flux.2-dev/lora",  # musubi-tuner's model-spec name for FLUX.2 [dev] LoRAs
    "Mistral-3 (CLIPLoader, type flux2)",
    ("flux2_dev", "flux2_dev"),  # natively multi-reference: one model either way
)
FAMILIES = {family.image_model: family for family in (FLUX1, FLUX2)}


def family_named(image_model: str | None, what: str = "this MODEL") -> FluxFamily:
    """The family ComfyUI detected, or a clear refusal for a model the pack does not train."""
    family = FAMILIES.get(image_model or "")
    if family is None:
        raise ValueError(
            f"{what} is a {image_model or 'non-Flux'!s} model; Kontext Trainer handles FLUX.1 "
            "(dev, Kontext) and FLUX.2 [dev]. Load one of those with the stock loaders"
        )
    return family


# Models ComfyUI runs with the same Flux class (and `image_model`) that the pack does not train:
# their text ids, layers or text encoder differ, and training them is not proven. Told apart by
# what ComfyUI's detection reads from the weights (comfy/model_detection.py, 0.33).
FLUX2_KLEIN_CONTEXT = {7680: "FLUX.2 [klein] 4B", 12288: "FLUX.2 [klein] 9B"}  # Qwen3 4B / 8B, 3 layers


def unsupported_variant(
    image_model: str | None,
    context_in_dim: int,
    vec_in_dim: int | None,
    yak_mlp: bool = False,
    txt_ids_dims: tuple[int, ...] | list[int] = (),
) -> str | None:
    """The name of a model that shares a supported family's `image_model` but is not trained
    by the pack; None for FLUX.1 / FLUX.2 [dev]."""
    if image_model == "flux":
        if yak_mlp:
            return "Ovis-Image"
        if context_in_dim == 3584 and vec_in_dim is None:
            return "LongCat-Image"
        if txt_ids_dims:
            return f"a Flux-architecture model with text position ids on axes {list(txt_ids_dims)}"
    if image_model == "flux2":
        return FLUX2_KLEIN_CONTEXT.get(context_in_dim)
    return None


def refuse_variant(variant: str | None, what: str = "this MODEL") -> None:
    if variant is not None:
        raise ValueError(
            f"{what} is {variant}, which ComfyUI runs with its Flux code; Kontext Trainer trains "
            "FLUX.1 (dev, Kontext) and FLUX.2 [dev] only (its text ids, layers or text encoder "
            "differ, and training it is not proven). Load one of those with the stock loaders"
        )


def check_family_layout(family: FluxFamily, layout: str) -> str:
    if layout not in family.layouts:
        raise ValueError(
            f"layout {layout!r} does not fit a {family.title} model; choose one of "
            f"{', '.join(family.layouts)} ({family.layouts[0]} is its default)"
        )
    return layout
