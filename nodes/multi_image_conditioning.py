"""MultiImageConditioning: reference images -> conditioning (+ a MODEL that uses our ids).

The same conditioning drives a stock KSampler and TrainLoRA. The MODEL output is a clone whose
image ids are the pack's for every layout (the family's
`with_reference_ids`); for `dreamomni2`, a layout ComfyUI does not know, using that MODEL is
required. The model's family comes from the MODEL itself; a layout that does not fit it, or a
MODEL of another kind, is refused here rather than failing mid-sampling.
"""

from __future__ import annotations

import numpy as np
import torch
from comfy_api.latest import io

from ..application.node_ids import node_id
from ..comfy_adapter.families import layouts_by_family
from ..comfy_adapter.model_family import check_layout_fits, family_of
from ..comfy_adapter.model_view import diffusion_module
from ..trainer_core.choices import Layout, choose
from ..trainer_core.sizing import MAX_SIDE, check_side_cap, fit_to_area, resize_exact

MAX_REFERENCES = 4

LAYOUT_TOOLTIP = (
    "Where the reference tokens sit in the model's position grid. auto: the model's own "
    "(FLUX.1: offset, FLUX.2: index). offset: ComfyUI's Kontext "
    "default (all references index 1, packed side by side). index: reference i gets index i+1 "
    "(in the model's index steps). uxo: UXO/USO style, diagonal after the target. dreamomni2: "
    "index i+1 and columns shifted by the widths of the earlier references (DreamOmni2). "
    "index_timestep_zero (ComfyUI 0.33+): index ids, and the references are modulated as at "
    "timestep 0 (ComfyUI's Edit Model Reference Method). With one reference, offset, index and "
    "dreamomni2 are identical (plain Kontext). Train and sample with the same layout. "
    f"{layouts_by_family()}"
)


def encode_references(vae, images: list[torch.Tensor], resolution: int) -> list[torch.Tensor]:
    """Resize each reference with the shared size rule and VAE-encode it: raw latents. Every
    size is checked before the first encode, so a refused image costs no VAE time."""
    for number, image in enumerate(images, start=1):
        check_side_cap(image.shape[2], image.shape[1], f"image_{number}")
    latents = []
    for image in images:
        batch, height, width = image.shape[0], image.shape[1], image.shape[2]
        new_w, new_h = fit_to_area(width, height, resolution)
        pixels = image[..., :3].float().cpu().numpy()
        resized = np.stack([resize_exact(pixels[b], new_w, new_h) for b in range(batch)])
        latents.append(vae.encode(torch.from_numpy(resized)))
    return latents


def check_batch_sizes(images: list[torch.Tensor]) -> None:
    sizes = {f"image_{i}": image.shape[0] for i, image in enumerate(images, start=1)}
    distinct = set(sizes.values()) - {1}
    if len(distinct) > 1:
        listed = ", ".join(f"{name} has {size}" for name, size in sizes.items())
        raise ValueError(
            f"reference batch sizes disagree ({listed}); give each input one image, "
            "or the same number of images"
        )


def attach_references(conditioning, latents: list[torch.Tensor], layout: str):
    import node_helpers

    # Appended, like the stock ReferenceLatent node; the layout is set (not appended: a string).
    conditioning = node_helpers.conditioning_set_values(
        conditioning, {"reference_latents": latents}, append=True
    )
    return node_helpers.conditioning_set_values(conditioning, {"reference_latents_method": layout})


class MultiImageConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        images = [io.Image.Input("image_1", tooltip="The first reference image (required).")]
        images += [
            io.Image.Input(f"image_{i}", optional=True, tooltip=f"Reference image {i} (optional).")
            for i in range(2, MAX_REFERENCES + 1)
        ]
        schema = io.Schema(
            node_id=node_id("MultiImageConditioning"),
            display_name="Multi-Image Conditioning (Kontext Trainer)",
            category="Kontext Trainer",
            description="Adds 1 to 4 reference images to a prompt's conditioning, with a chosen "
            "position layout: to sample FLUX.1 Kontext, DreamOmni2, FLUX.2 [dev] and FLUX.2 [klein] "
            "with references, in a KSampler or as PreviewSampler's prompt while TrainLoRA trains. "
            "Qwen-Image-Edit does not use it: encode its prompt and references with ComfyUI's "
            "TextEncodeQwenImageEditPlus instead.",
            inputs=[
                io.Model.Input(
                    "model",
                    tooltip="The MODEL (FLUX.1 Kontext or dev, FLUX.2 [dev] or [klein]; for "
                    "Qwen-Image-Edit use TextEncodeQwenImageEditPlus instead); a clone comes out, the "
                    "input is untouched.",
                ),
                io.Conditioning.Input(
                    "conditioning", tooltip="The prompt conditioning (e.g. from CLIPTextEncode)."
                ),
                io.Vae.Input("vae", tooltip="The MODEL's VAE, which encodes the references."),
                io.Combo.Input(
                    "layout",
                    options=[layout.value for layout in Layout],
                    default="auto",
                    tooltip=LAYOUT_TOOLTIP,
                ),
                io.Int.Input(
                    "reference_resolution",
                    default=1024,
                    min=0,
                    max=MAX_SIDE,
                    step=16,
                    tooltip="References are scaled to about this many pixels squared, aspect kept, "
                    "sides multiples of 16 (the dataset loader uses the same rule). 0 keeps "
                    f"the size, cropping to multiples of 16. Inputs over {MAX_SIDE} px on a "
                    "side are refused.",
                ),
                *images,
            ],
            outputs=[
                io.Model.Output(
                    display_name="MODEL",
                    tooltip="Use this MODEL to sample: it feeds the model the "
                    "layout's position ids (required for dreamomni2).",
                ),
                io.Conditioning.Output(display_name="CONDITIONING"),
            ],
        )
        # the node search matches these too on ComfyUI 0.33+ (0.3.75's Schema has no such field)
        schema.search_aliases = ["reference images", "image edit", "multi reference", "flux2", "dreamomni2"]
        return schema

    @classmethod
    def execute(
        cls,
        model,
        conditioning,
        vae,
        layout,
        reference_resolution,
        image_1=None,
        image_2=None,
        image_3=None,
        image_4=None,
    ) -> io.NodeOutput:
        if layout != "auto":
            choose(Layout, layout, "layout")  # a name no layout has, before whether it fits the model
        family = family_of(model, "MultiImageConditioning's model")
        if family.conditioning_node:
            raise ValueError(
                f"MultiImageConditioning's model is {family.title}, whose references are part of its "
                f"text: encode the prompt and the reference images with ComfyUI's "
                f"{family.conditioning_node} node instead, and leave MultiImageConditioning out"
            )
        family = check_layout_fits(model, layout, "MultiImageConditioning's model", family=family)
        # auto: the model's own (ComfyUI's default for it), set on the conditioning by name
        layout = family.resolve_layout(layout, diffusion_module(model))
        images = [image for image in (image_1, image_2, image_3, image_4) if image is not None]
        if not images:
            raise ValueError("MultiImageConditioning needs at least one reference image on image_1")
        check_batch_sizes(images)
        latents = encode_references(vae, images, reference_resolution)
        conditioning = attach_references(conditioning, latents, layout)
        return io.NodeOutput(family.with_reference_ids(model), conditioning)
