"""A dataset folder -> an encoded KontextDataset, with ComfyUI's folders and encoders: where the
dataset and its cache live (ComfyUI's input and output directories, or absolute paths), and
`load_dataset`, which LoadKontextDataset and headless runs both call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from ..comfy_adapter.comfy_encoders import comfy_encoders
from ..trainer_core.atomic import folder_problem
from ..trainer_core.dataset import DatasetSettings, KontextDataset, build_dataset, check_hold_out
from ..trainer_core.dataset_files import scan_dataset, within
from ..trainer_core.dataset_options import BACKGROUNDS, CACHE_FOLDER_NAME, USE_PATH, DatasetOptions
from ..trainer_core.encode_cache import EncodeCache
from ..trainer_core.names import check_folder_path

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


def resolve_cache_folder(
    cache_folder: str, output_dir: Path, confined_to: tuple[Path, ...] | None = None
) -> Path:
    """The cache folder: empty is output/kontext_trainer_cache, a relative name a folder of the
    output directory (in the node and the command line alike). `confined_to` (the graph's
    node: ComfyUI's output and temp folders): the folder must lie inside one of them, as
    SaveImage's folders must; None (the command line's run file, which names what it wants):
    any folder."""
    if not cache_folder:
        return Path(output_dir) / CACHE_FOLDER_NAME
    check_folder_path("cache_folder", cache_folder)
    chosen = Path(cache_folder).expanduser()
    chosen = chosen if chosen.is_absolute() else Path(output_dir) / chosen
    if confined_to is not None and not any(within(folder, chosen) for folder in confined_to):
        raise ValueError(
            f"cache_folder: '{cache_folder}' is outside ComfyUI's output and temp folders, where "
            "this node may write; give a folder name (made in the output folder), a path inside "
            f"them, or leave it empty for output/{CACHE_FOLDER_NAME} (a run file of the command "
            "line may name any folder)"
        )
    return chosen


def prepare_cache_folder(cache_root: Path) -> None:
    """The cache folder exists (made if missing) and takes files, before anything is encoded (a
    failure halfway through would waste the encoding done so far), or a message naming the
    field and the fix."""
    problem = folder_problem(cache_root)
    if problem is not None:
        raise ValueError(
            f"cache_folder: cannot create or write to {cache_root} ({problem}); give a folder ComfyUI "
            f"may create and write to, or leave cache_folder empty to use output/{CACHE_FOLDER_NAME}"
        )


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


def check_dataset(options: DatasetOptions, confined: bool = True):
    """The dataset folder `options` name, validated without an encoder (every problem in one
    ValueError, nothing written; then `hold_out` against its samples): its scan, and the cache
    folder it will use. Folders resolve
    against ComfyUI's input and output directories. `confined` off (the command line): the cache
    may be any absolute folder. The command line calls it before the models load."""
    import folder_paths

    input_dir, output_dir = (
        Path(folder_paths.get_input_directory()),
        Path(folder_paths.get_output_directory()),
    )
    root = resolve_dataset_folder(options.folder, options.path, input_dir)
    writable = (output_dir, Path(folder_paths.get_temp_directory())) if confined else None
    cache_root = resolve_cache_folder(options.cache_folder, output_dir, writable)
    # a dataset picked in the input directory reads nothing outside it: a file there linking out
    # is refused by name, as a linked folder is
    inside = input_dir if not options.path.strip() else None
    scan = scan_dataset(root, min_size=options.min_size, confined_to=inside)
    check_hold_out(options.hold_out, len(scan.samples))
    return scan, cache_root


def load_dataset(
    vae,
    clip,
    options: DatasetOptions,
    progress: Callable[[int, int], None] | None = None,
    confined: bool = True,
    checked=None,
) -> tuple[KontextDataset, str]:
    """The dataset `options` describe (`check_dataset`, or `checked`: what it returned),
    encoded with `vae` and `clip` (ComfyUI's VAE and CLIP), and its report; `progress(done,
    total)` follows the encoding."""
    scan, cache_root = checked or check_dataset(options, confined)
    root = scan.root
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
