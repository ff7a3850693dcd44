"""LoadKontextDataset: a folder of targets, references and captions -> a cached dataset.

The node validates the whole folder first (every problem in one message, nothing written
on failure), then encodes what the cache does not already hold with the user's VAE and
CLIP, showing progress, and outputs a KONTEXT_DATASET for TrainLoRA and PreviewSampler.
Its widgets are generated from `DatasetOptions`; `load_dataset` does the work (the node and
headless runs call it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path

from comfy_api.latest import io

from ..trainer_core.dataset import DatasetSettings, KontextDataset, build_dataset
from ..trainer_core.dataset_files import folder_fingerprint, scan_dataset
from ..trainer_core.dataset_options import (  # USE_PATH etc. stay importable from here
    BACKGROUNDS,
    CACHE_FOLDER_NAME,
    INPUT_SUBFOLDERS,
    USE_PATH,
    DatasetOptions,
)
from ..trainer_core.encode_cache import EncodeCache
from .comfy_encoders import comfy_encoders
from .extension_ids import node_id
from .widgets import config_widget

Dataset = io.Custom("KONTEXT_DATASET")
LOGGER = logging.getLogger("kontext_trainer")


def resolve_dataset_folder(folder: str, path: str, input_dir: Path) -> Path:
    """The dataset folder: `path` if given (absolute), else `folder` under the input directory."""
    if path.strip():
        chosen = Path(path.strip()).expanduser()
        if not chosen.is_absolute():
            raise ValueError(
                f"path: '{path}' is not absolute; give a full path such as /data/my_set, "
                "or leave it empty and pick a folder of ComfyUI's input directory"
            )
        return chosen
    if folder in ("", USE_PATH):
        raise ValueError("folder: pick a folder of ComfyUI's input directory, or give an absolute path")
    input_dir = input_dir.resolve()
    chosen = (input_dir / folder).resolve()
    if chosen != input_dir and input_dir not in chosen.parents:
        spelled = Path(os.path.normpath(input_dir / folder))
        if spelled == input_dir or input_dir in spelled.parents:  # inside by name: a link leads out
            raise ValueError(
                f"folder: '{folder}' is a link to {chosen}, outside ComfyUI's input directory, and "
                f"links out of it are not followed; give the folder's real location in path: {chosen}"
            )
        raise ValueError(
            f"folder: '{folder}' points outside ComfyUI's input directory; pick a folder inside it, "
            "or give an absolute path in path"
        )
    return chosen


def resolve_cache_folder(cache_folder: str, output_dir: Path) -> Path:
    if not cache_folder.strip():
        return Path(output_dir) / CACHE_FOLDER_NAME
    chosen = Path(cache_folder.strip()).expanduser()
    if not chosen.is_absolute():
        raise ValueError(
            f"cache_folder: '{cache_folder}' is not absolute; give a full path or leave it empty"
        )
    return chosen


def prepare_cache_folder(cache_root: Path) -> None:
    """The cache folder exists and takes files, or a message naming the field and the fix."""
    try:
        EncodeCache(cache_root).prepare()
    except OSError as error:
        existing = next((p for p in (cache_root, *cache_root.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            reason = f"{existing} is a file, not a folder"
        else:
            reason = error.strerror or str(error)
        raise ValueError(
            f"cache_folder: cannot create or write to {cache_root} ({reason}); give a folder ComfyUI "
            f"may create and write to, or leave cache_folder empty to use output/{CACHE_FOLDER_NAME}"
        ) from None


def summary(dataset: KontextDataset) -> str:
    buckets = ", ".join(f"{w}x{h}: {len(idx)}" for (w, h), idx in dataset.buckets().items())
    lines = [
        f"{len(dataset.entries)} training + {len(dataset.held_out)} held-out samples "
        f"({dataset.folder_structure.replace('_', ' ')}), {dataset.reference_count} reference(s) each",
        f"buckets {buckets}",
        f"encoded {dataset.encoded_images} image(s) and {dataset.encoded_texts} caption(s); "
        f"{dataset.cache.hits} cache hit(s); cache {dataset.cache.root}",
        *dataset.notices,
    ]
    return "\n".join(lines)


def dataset_widgets() -> list:
    """DatasetOptions' widgets; `folder` offers the input directory's subfolders of the moment."""
    import folder_paths

    dynamic = {INPUT_SUBFOLDERS: lambda: [USE_PATH, *folder_paths.get_input_subfolders()]}
    return [config_widget(option, dynamic) for option in dataclasses.fields(DatasetOptions)]


def load_dataset(
    vae, clip, options: DatasetOptions, progress: Callable[[int, int], None] | None = None
) -> tuple[KontextDataset, str]:
    """The dataset `options` describe, encoded with `vae` and `clip` (ComfyUI's VAE and CLIP),
    and its report. Folders resolve against ComfyUI's input and output directories. The whole
    folder is validated first (every problem in one ValueError, nothing written); `progress(done,
    total)` follows the encoding."""
    import folder_paths

    root = resolve_dataset_folder(options.folder, options.path, Path(folder_paths.get_input_directory()))
    cache_root = resolve_cache_folder(options.cache_folder, Path(folder_paths.get_output_directory()))
    scan = scan_dataset(root, min_size=options.min_size)  # raises with every problem; nothing written
    prepare_cache_folder(cache_root)
    settings = DatasetSettings(
        options.resolution,
        options.reference_resolution,
        BACKGROUNDS[options.background],
        options.hold_out,
        options.seed,
    )
    dataset = build_dataset(
        scan, comfy_encoders(vae, clip), EncodeCache(cache_root), settings, progress=progress
    )
    report = summary(dataset)
    LOGGER.info("LoadKontextDataset %s:\n%s", root, report)
    return dataset, report


class LoadKontextDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=node_id("LoadKontextDataset"),
            display_name="LoadKontextDataset",
            category="Kontext Trainer",
            description="Loads targets, reference images and captions from a folder (two folder "
            "structures, see the README), validates them, and caches VAE latents and text embeddings.",
            inputs=[
                io.Vae.Input("vae", tooltip="The Flux VAE; latents are cached per image and VAE."),
                io.Clip.Input("clip", tooltip="The Flux text encoder; embeddings are cached per caption."),
                *dataset_widgets(),
            ],
            outputs=[
                Dataset.Output(display_name="dataset"),
                io.String.Output(display_name="report", tooltip="Samples, buckets, cache use and notices."),
            ],
        )

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
