"""The Flux families: FLUX.1 (dev, Kontext; `image_model` "flux") and FLUX.2 [dev] ("flux2").

Both run the same `comfy/ldm/flux/model.py` class; what differs for training comes from the
model's `FluxParams` (patch size, RoPE axes, the index layout's step) and from these entries
(the reference layouts that fit, the names a LoRA file's metadata gives the base model).
"""

from __future__ import annotations

from ...trainer_core.lora_metadata import ModelNames
from ...trainer_core.position_ids import LAYOUTS, TIMESTEP_ZERO_LAYOUTS
from . import ModelFamily, register

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
    """The name of a model that shares a Flux family's `image_model` but is not trained by the
    pack; None for FLUX.1 / FLUX.2 [dev]."""
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


def _variant_of(image_model: str):
    def variant(diffusion_model) -> str | None:
        params = diffusion_model.params
        return unsupported_variant(
            image_model,
            params.context_in_dim,
            params.vec_in_dim,
            yak_mlp=getattr(params, "yak_mlp", False),
            txt_ids_dims=tuple(getattr(params, "txt_ids_dims", None) or ()),
        )

    return variant


FLUX1 = register(
    ModelFamily(
        image_model="flux",
        title="FLUX.1",
        trains="FLUX.1 (dev, Kontext)",
        # not index_timestep_zero: ComfyUI (0.33) runs it only with FLUX.2's model-wide
        # modulation; FLUX.1's per-block modulation fails on the doubled timestep batch
        layouts=tuple(layout for layout in LAYOUTS if layout not in TIMESTEP_ZERO_LAYOUTS),
        # sd-scripts' names for every FLUX.1 model (Kontext has FLUX.1 dev's weights and shapes)
        names=ModelNames("flux1", "flux-1-dev/lora"),
        text_encoder="CLIP-L + T5-XXL (DualCLIPLoader, type flux)",
        base_models=("flux1_dev", "flux1_kontext"),
        variant=_variant_of("flux"),
    )
)
FLUX2 = register(
    ModelFamily(
        image_model="flux2",
        title="FLUX.2",
        trains="FLUX.2 [dev]",
        # ComfyUI computes offset / index / uxo for FLUX.2 exactly as for FLUX.1 (index is its
        # default, with steps of 10). DreamOmni2's ids were learnt by a FLUX.1 Kontext model.
        # index_timestep_zero (ComfyUI 0.33+): index ids, references modulated at timestep 0.
        layouts=("index", "offset", "uxo", "index_timestep_zero"),
        names=ModelNames("flux2", "Flux.2-dev/lora"),  # musubi-tuner's model-spec name for FLUX.2 [dev]
        text_encoder="Mistral-3 (CLIPLoader, type flux2)",
        base_models=("flux2_dev", "flux2_dev"),  # natively multi-reference: one model either way
        variant=_variant_of("flux2"),
    )
)
