"""What the command line checks before ComfyUI's runtime boots (`application.cli`): the run's
files (the LoRA's name and folders, overwrite, the checkpoint to resume or the LoRA to start
from) and the dataset folder with every file in it. A refusal then comes in about two seconds
instead of after the boot (ten here, more with a GPU) and the model load (minutes for a real
Flux). The same checks run again after the boot (`run_service.prepare`, as for the node);
the dataset's scan is made once and handed on.

Nothing here imports ComfyUI but `folder_paths`, which `comfy_boot.boot_folders` has set up.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..trainer_core.checkpoint import read_state
from ..trainer_core.run_config import RunConfig
from .datasets import check_dataset
from .run_policy import check_run_files, resume_folder, start_file


def in_section(section: str, action):
    """Run `action`; a ValueError it raises names the config section (`[train] lora_name: ...`)
    unless it already does."""
    try:
        return action()
    except ValueError as error:
        message = str(error)
        if message.startswith("["):
            raise
        raise ValueError(f"[{section}] {message}") from None


def refusal(config_path: Path, error: Exception) -> str:
    """The one line the command prints for a refused run: the config file, then the problem."""
    message = str(error)
    if not message.startswith(str(config_path)):  # the config's own errors name it already
        message = f"{config_path}: {message}"
    return f"[kontext-trainer] error: {message}"


def check_run(config: RunConfig):
    """The checks that need neither a model nor ComfyUI's runtime; returns the dataset's scan
    (`datasets.check_dataset`). Under torchrun every process checks, and the first (RANK 0,
    the one that writes) also checks that the folders take files. Raises ValueError naming the
    section, or OSError (e.g. a checkpoint folder missing a file)."""
    trainer = config.trainer
    writer = int(os.environ.get("RANK", "0")) == 0
    resume = in_section("train", lambda: resume_folder(trainer.resume_from))
    resuming = resume is not None
    in_section("train", lambda: check_run_files(trainer.lora_name, trainer.overwrite, resuming, writer))
    if resuming:
        in_section("train", lambda: read_state(resume))
    else:
        in_section("train", lambda: start_file(trainer.start_from_lora))
    return in_section("dataset", lambda: check_dataset(config.dataset, confined=False))
