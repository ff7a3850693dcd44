"""PreviewSampler: what TrainLoRA should sample while it trains.

The node only describes the previews (prompt conditioning, with reference images from
MultiImageConditioning if any; optional negative for true CFG; guidance; size; steps; every
N training steps) and hands them to TrainLoRA's `preview` input. The training run samples them
between optimizer steps with the LoRA as it is at that step (`comfy_adapter/previews.py`); they
are shown on the TrainLoRA node, and the last ones come out of TrainLoRA as IMAGE.
"""

from __future__ import annotations

import dataclasses

from comfy_api.latest import io

from ..application.node_ids import node_id
from ..application.widget_schema import PREVIEW_SAMPLER, SAMPLERS, SCHEDULERS
from ..comfy_adapter.previews import PreviewSettings
from ..trainer_core.preview_options import PreviewOptions
from .widgets import widgets

Preview = io.Custom("KONTEXT_PREVIEW")


class PreviewSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import comfy.samplers

        schema = io.Schema(
            node_id=node_id("PreviewSampler"),
            display_name="Preview Sampler (Kontext Trainer)",
            category="Kontext Trainer",
            description="Previews for TrainLoRA: samples these prompts (with their reference images) with "
            "the LoRA being trained, every N steps and at the end, using ComfyUI's own sampler.",
            inputs=[
                io.Conditioning.Input(
                    "positive",
                    tooltip="Preview prompt(s): CLIPTextEncode, or MultiImageConditioning for references.",
                ),
                io.Vae.Input("vae", tooltip="Decodes the previews."),
                *widgets(
                    PREVIEW_SAMPLER,
                    [PreviewOptions],
                    {
                        SAMPLERS: lambda: list(comfy.samplers.KSampler.SAMPLERS),
                        SCHEDULERS: lambda: list(comfy.samplers.KSampler.SCHEDULERS),
                    },
                ),
                io.Conditioning.Input(
                    "negative", optional=True, tooltip="For true CFG (cfg > 1); zero if absent."
                ),
            ],
            outputs=[Preview.Output(display_name="preview")],
        )
        # the node search matches these too on ComfyUI 0.33+ (0.3.75's Schema has no such field)
        schema.search_aliases = ["lora preview", "training preview", "qwen image edit", "flux"]
        return schema

    @classmethod
    def execute(cls, positive, vae, negative=None, **widgets) -> io.NodeOutput:
        options = PreviewOptions(**widgets)  # checks every number (NaN passes ComfyUI's min / max)
        return io.NodeOutput(PreviewSettings(positive, negative, vae, **dataclasses.asdict(options)))
