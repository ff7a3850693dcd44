"""Where a run's files go, and the policy on files that exist: the LoRA folder, the checkpoint
folder, the resume_from and start_from_lora choices (and the checkpoints the pack wrote among
the LoRAs before 5263cc3, see CHANGELOG.md), and when an existing LoRA or snapshot may be
replaced. The TrainLoRA node and the headless CLI both use it, so a run finds and protects its
files the same way in both.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..trainer_core.atomic import folder_problem
from ..trainer_core.checkpoint import all_checkpoints, checkpoint_problem
from ..trainer_core.names import lora_stem
from ..trainer_core.run_files import LoraPaths, replaced_snapshots, snapshot_steps

NO_RESUME = "none"
NO_START = "none"
CHECKPOINTS_FOLDER = "kontext_trainer_checkpoints"  # under ComfyUI's output folder
LEGACY = "models/loras/"  # resume_from prefix of checkpoints kept among the LoRAs (before 5263cc3)
LOGGER = logging.getLogger("kontext_trainer")
_warned_damaged: set[str] = set()


def loras_dir() -> Path:
    import folder_paths

    return Path(folder_paths.get_folder_paths("loras")[0])


def checkpoints_root() -> Path:
    """Checkpoints live in the output folder, where ComfyUI's LoRA lists never look (their
    optimizer and RNG files are not LoRAs)."""
    import folder_paths

    return Path(folder_paths.get_output_directory()) / CHECKPOINTS_FOLDER


_warned_legacy = False


def legacy_checkpoints() -> list[str]:
    """Checkpoints an earlier version left in `models/loras/<name>_checkpoints/` (they fill the
    LoRA lists): still offered for resume, with a one-time hint to move them."""
    global _warned_legacy
    root = loras_dir()
    found = []
    for folder in sorted(root.glob("*_checkpoints")) if root.is_dir() else []:
        found += [LEGACY + p.relative_to(root).as_posix() for p in resumable(all_checkpoints(folder))]
    if found and not _warned_legacy:
        _warned_legacy = True
        LOGGER.warning(
            "Kontext Trainer: checkpoints in %s/*_checkpoints show up in LoRA lists; move each "
            "<name>_checkpoints folder to %s/<name> (see the README, 'Where files go')",
            root,
            checkpoints_root(),
        )
    return found


def resume_choices() -> list[str]:
    """Every checkpoint that can be resumed, as `<name>/<run>/step_NNNNNN` (plus any in the old
    folders); a damaged one is left out, and the log says which file is damaged."""
    root = checkpoints_root()
    found = []
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            found += [path.relative_to(root).as_posix() for path in resumable(all_checkpoints(folder))]
    return [NO_RESUME, *found, *legacy_checkpoints()]


def resumable(checkpoints: list[Path]) -> list[Path]:
    """The checkpoints without a damaged file; each damaged one is named in the log once."""
    kept = []
    for path in checkpoints:
        problem = checkpoint_problem(path)
        if problem is None:
            kept.append(path)
        elif str(path) not in _warned_damaged:
            _warned_damaged.add(str(path))
            LOGGER.warning("Kontext Trainer: not offered in resume_from: %s", problem)
    return kept


def start_choices() -> list[str]:
    import folder_paths

    return [NO_START, *folder_paths.get_filename_list("loras")]


def resolve_start(choice: str) -> Path | None:
    """The LoRA file `start_from_lora` names (in ComfyUI's LoRA folders), or None."""
    import folder_paths

    if choice in ("", NO_START):
        return None
    path = folder_paths.get_full_path("loras", choice)
    if path is None:
        raise ValueError(
            f"start_from_lora: '{choice}' is not in models/loras (any more); pick another or 'none'"
        )
    return Path(path)


def resolve_resume(choice: str) -> Path | None:
    if choice in ("", NO_RESUME):
        return None
    root, relative = (
        (loras_dir(), choice[len(LEGACY) :]) if choice.startswith(LEGACY) else (checkpoints_root(), choice)
    )
    root = root.resolve()
    path = (root / relative).resolve()
    if root not in path.parents:
        raise ValueError(f"resume_from: '{choice}' is not a checkpoint of Kontext Trainer ({root})")
    if not path.is_dir():
        raise ValueError(f"resume_from: there is no checkpoint '{choice}' (any more); pick another or 'none'")
    return path


def check_run_folders(paths: LoraPaths) -> None:
    """Before the first step: the folders the run will write exist (or can be made) and take a
    file, so a run never trains to find at its end that its LoRA has nowhere to go. The
    refusal names the folder and what is wrong with it."""
    folders = (
        ("the LoRA folder", paths.loras_dir, True),
        ("the snapshot folder", paths.snapshots, False),
        ("the checkpoint folder", paths.checkpoints_root, True),
        ("the checkpoint folder", paths.checkpoints, False),
    )
    for role, folder, create in folders:
        problem = folder_problem(folder, create)
        if problem is not None:
            raise ValueError(
                f"{role} cannot take this run's files: {problem}. Make {folder} a folder ComfyUI can "
                "write to (for models/loras: or point the loras path of extra_model_paths.yaml at "
                "one), then run it again; nothing was trained"
            )


def check_existing(paths: LoraPaths, overwrite: bool, resuming: bool = False) -> bool:
    """The overwrite policy: an existing LoRA is only replaced when `overwrite` is on (and then
    only once the new file is complete); per-step snapshots an earlier run of the name left
    (a cancelled one leaves no LoRA) likewise, unless this run resumes one (its snapshots go
    on). Returns whether a LoRA will be replaced."""
    if not paths.lora.exists():
        if (snapshot_steps(paths) or replaced_snapshots(paths)) and not overwrite and not resuming:
            raise ValueError(
                f"lora_name: {paths.snapshots} holds the per-step snapshots of an earlier run of this "
                "name. Choose another lora_name, resume that run (resume_from), or turn on overwrite "
                "to replace them"
            )
        return False
    if not overwrite:
        raise ValueError(
            f"lora_name: {paths.lora} already exists. Choose another lora_name, or turn on "
            "overwrite to replace it (the old file stays until the new one is saved)"
        )
    return True


def check_run_files(
    lora_name: str, overwrite: bool, resuming: bool, writer: bool = True
) -> tuple[LoraPaths, bool]:
    """A run's files under ComfyUI's folders, checked before anything loads: the folders take
    files (`check_run_folders`, by the process that writes them: `writer`) and the overwrite
    policy (`check_existing`). Returns the paths and whether a LoRA will be replaced."""
    paths = LoraPaths(loras_dir(), checkpoints_root(), lora_stem(lora_name))
    if writer:
        check_run_folders(paths)
    return paths, check_existing(paths, overwrite, resuming=resuming)


def temp_dir() -> Path:
    """ComfyUI's temp folder (previews)."""
    import folder_paths

    return Path(folder_paths.get_temp_directory())


# the command line's choices: as the node lists them, or absolute paths (another ComfyUI's files)


def resume_folder(choice: str) -> Path | None:
    """`[train] resume_from`: 'none', a checkpoint as TrainLoRA lists it (under the base
    directory's output/kontext_trainer_checkpoints), or the absolute path of a checkpoint
    folder (e.g. of another ComfyUI's run)."""
    path = Path(choice).expanduser()
    if path.is_absolute():
        if not path.is_dir():
            raise ValueError(
                f"[train] resume_from: {path} is not a checkpoint folder; give a step_NNNNNN folder"
            )
        return path
    return resolve_resume(choice)


def start_file(choice: str) -> Path | None:
    path = Path(choice).expanduser()
    if choice not in ("", NO_START) and path.is_absolute():
        if not path.is_file():
            raise ValueError(f"[train] start_from_lora: {path} does not exist; give a LoRA file")
        if path.suffix.lower() != ".safetensors":
            raise ValueError(
                f"[train] start_from_lora: {path} is not a .safetensors file; only safetensors LoRAs "
                "can start a run (pickled .ckpt / .pt files are not read)"
            )
        return path
    return resolve_start(choice)
