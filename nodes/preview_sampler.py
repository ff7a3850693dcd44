"""PreviewSampler: what TrainLoRA should sample while it trains.

The node only describes the previews (prompt conditioning, with reference images from
MultiImageConditioning if any; optional negative for true CFG; guidance; size; steps; every
N training steps) and hands them to TrainLoRA's `preview` input. The training run samples them
between optimizer steps with the LoRA as it is at that step (`comfy_adapter/previews.py`); they
are shown on the TrainLoRA node, and the last ones come out of TrainLoRA as IMAGE.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..application.node_ids import node_id
from ..comfy_adapter.previews import PreviewSettings
from ..trainer_core.limits import check_number

Preview = io.Custom("KONTEXT_PREVIEW")


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
                    tooltip="Guidance-embedding value, for models distilled with one (dev / Kontext); "
                    "models without a guidance embedding ignore it.",
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
