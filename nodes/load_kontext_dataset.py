"""LoadKontextDataset: a folder of targets, references and captions -> a cached dataset.

The node validates the whole folder first (every problem in one message, nothing written
on failure), then encodes what the cache does not already hold with the user's VAE and
CLIP, showing progress, and outputs a KONTEXT_DATASET for TrainLoRA and PreviewSampler.
Its widgets are generated from `DatasetOptions` and the widget schema;
`application/datasets.load_dataset` does the work (the node and headless runs call it).
"""

from __future__ import annotations

from pathlib import Path

from comfy_api.latest import io

from ..application.datasets import load_dataset, resolve_dataset_folder
from ..application.node_ids import node_id
from ..application.widget_schema import INPUT_SUBFOLDERS, LOAD_KONTEXT_DATASET
from ..trainer_core.dataset_files import folder_fingerprint
from ..trainer_core.dataset_options import USE_PATH, DatasetOptions
from .widgets import widgets

Dataset = io.Custom("KONTEXT_DATASET")


def dataset_widgets() -> list:
    """DatasetOptions' widgets; `folder` offers the input directory's subfolders of the moment."""
    import folder_paths

    dynamic = {INPUT_SUBFOLDERS: lambda: [USE_PATH, *folder_paths.get_input_subfolders()]}
    return widgets(LOAD_KONTEXT_DATASET, [DatasetOptions], dynamic)


class LoadKontextDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        schema = io.Schema(
            node_id=node_id("LoadKontextDataset"),
            display_name="Edit Dataset (Kontext Trainer)",
            category="Kontext Trainer",
            description="Loads a folder of training samples for TrainLoRA: per sample a target "
            "(name.png), its references (name_control.png, name_control_1.png, ...; none for text to "
            "image) and a caption (name.txt), or the same in parallel folders images/, control/, "
            "control_1/. Checks every file first, then caches VAE latents and text embeddings. The "
            "node's help page shows both layouts.",
            inputs=[
                io.Vae.Input("vae", tooltip="The trained model's VAE; latents are cached per image and VAE."),
                io.Clip.Input(
                    "clip", tooltip="The trained model's text encoder; embeddings are cached per caption."
                ),
                *dataset_widgets(),
            ],
            outputs=[
                Dataset.Output(display_name="dataset"),
                io.String.Output(display_name="report", tooltip="Samples, buckets, cache use and notices."),
            ],
        )
        # the node search matches these too on ComfyUI 0.33+ (0.3.75's Schema has no such field)
        schema.search_aliases = ["lora training dataset", "image edit pairs", "qwen image edit", "flux"]
        return schema

    @classmethod
    def fingerprint_inputs(cls, folder, path, **kwargs):
        import folder_paths

        try:
            root = resolve_dataset_folder(folder, path, Path(folder_paths.get_input_directory()))
        except ValueError:
            return ""
        return folder_fingerprint(root)

    @classmethod
    def execute(cls, vae, clip, **options) -> io.NodeOutput:
        import comfy.utils

        options = DatasetOptions(**options)
        bar = comfy.utils.ProgressBar(1)
        dataset, report = load_dataset(
            vae, clip, options, progress=lambda done, total: bar.update_absolute(done, total)
        )
        return io.NodeOutput(dataset, report)
