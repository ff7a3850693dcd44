"""TrainLoRA: trains a LoRA on the MODEL with a LoadKontextDataset dataset, in a background
thread, with live progress, the stock Cancel, checkpoints and exact resume.

The widgets are generated from `TrainConfig` (one widget per field, its tooltip and limits
from the field's metadata), so the node and the config cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch
from comfy_api.latest import io

from ..trainer_core.checkpoint import all_checkpoints, read_state
from ..trainer_core.config import AFTER_OVERWRITE, AFTER_START_FROM, ORIGINAL, TrainConfig
from ..trainer_core.job import MANAGER, Progress, wait_for
from ..trainer_core.loss_chart import draw_loss_chart, save_png_atomic
from ..trainer_core.names import lora_stem
from ..trainer_core.resume import check_resume
from ..trainer_core.run_files import LoraPaths, snapshot_steps
from .comfy_quantized import check_quantized_model
from .extension_ids import node_id
from .load_kontext_dataset import Dataset
from .model_family import check_model_fits
from .preview_sampler import Preview
from .progress_events import MIN_INTERVAL_SECONDS, PROGRESS_EVENT
from .training_run import Run, run_training
from .widgets import config_widget

NO_RESUME = "none"
NO_START = "none"
CHECKPOINTS_FOLDER = "kontext_trainer_checkpoints"  # under ComfyUI's output folder
LEGACY = "models/loras/"  # resume_from prefix of checkpoints where versions before 0.2 kept them
LOGGER = logging.getLogger("kontext_trainer")
# {"loss": [...], "validation_step": [...], "validation_loss": [...]}: the type ComfyUI's own
# LossGraphNode reads (it draws "loss")
LossMap = io.Custom("LOSS_MAP")


def config_widgets(appended: int) -> list:
    """TrainConfig's widgets added at one time (`config.ORIGINAL`, `AFTER_OVERWRITE`,
    `AFTER_START_FROM`)."""
    return [config_widget(f) for f in dataclasses.fields(TrainConfig) if f.metadata["appended"] == appended]


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
        found += [LEGACY + p.relative_to(root).as_posix() for p in all_checkpoints(folder)]
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
    """Every checkpoint, as `<name>/<run>/step_NNNNNN` (plus any in the old folders)."""
    root = checkpoints_root()
    found = []
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            found += [path.relative_to(root).as_posix() for path in all_checkpoints(folder)]
    return [NO_RESUME, *found, *legacy_checkpoints()]


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


def check_name_unique_in_prompt(prompt: dict | None, node: str, stem: str) -> None:
    """Two TrainLoRA nodes of one prompt saving under one name would overwrite each other."""
    others = []
    for other_id, other in (prompt or {}).items():
        name = other.get("inputs", {}).get("lora_name")
        if str(other_id) == str(node) or other.get("class_type") != node_id("TrainLoRA"):
            continue
        # casefold: Windows and macOS file systems see "Foo" and "foo" as one file
        if isinstance(name, str) and (_stem_or_none(name) or "").casefold() == stem.casefold():
            others.append(str(other_id))
    if others:
        raise ValueError(
            f"lora_name: TrainLoRA nodes {', '.join(sorted([str(node), *others]))} of this workflow all "
            f"save as '{stem}.safetensors'; give each its own lora_name"
        )


def _stem_or_none(name: str) -> str | None:
    try:
        return lora_stem(name)
    except ValueError:
        return None


def check_existing(paths: LoraPaths, overwrite: bool, resuming: bool = False) -> bool:
    """The overwrite policy: an existing LoRA is only replaced when `overwrite` is on (and then
    only once the new file is complete); per-step snapshots an earlier run of the name left
    (a cancelled one leaves no LoRA) likewise, unless this run resumes one (its snapshots go
    on). Returns whether a LoRA will be replaced."""
    if not paths.lora.exists():
        if snapshot_steps(paths) and not overwrite and not resuming:
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


def workflow_id(extra_pnginfo) -> str | None:
    """The id of the frontend workflow that queued this prompt (None for API prompts)."""
    workflow = (extra_pnginfo or {}).get("workflow") if isinstance(extra_pnginfo, dict) else None
    return str(workflow["id"]) if isinstance(workflow, dict) and workflow.get("id") else None


def _prompt_server():
    from server import PromptServer

    return getattr(PromptServer, "instance", None)


class EventSender:
    """Sends PROGRESS_EVENT to every client when something changed, at most every
    MIN_INTERVAL_SECONDS except for status changes."""

    def __init__(self, node: str, prompt_id: str | None, workflow: str | None, lora_name: str):
        self.base = {
            "node": node,
            "prompt_id": prompt_id,
            "workflow_id": workflow,
            "lora_name": lora_name,
        }
        self._last: Progress | None = None
        self._sent_at = 0.0

    def __call__(self, progress: Progress) -> None:
        server = _prompt_server()
        if server is None:  # no server (ComfyUI used as a library): nothing to send to
            return
        now = time.monotonic()
        changed_status = self._last is None or progress.status != self._last.status
        if progress == self._last or (not changed_status and now - self._sent_at < MIN_INTERVAL_SECONDS):
            return
        self._last, self._sent_at = progress, now
        server.send_sync(PROGRESS_EVENT, {**self.base, **dataclasses.asdict(progress)})


class TrainLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=node_id("TrainLoRA"),
            display_name="TrainLoRA",
            category="Kontext Trainer",
            description="Trains a LoRA for FLUX.1 / Kontext / DreamOmni2 on the MODEL in a background "
            "thread; Cancel stops at a step boundary and writes a checkpoint to resume from.",
            is_output_node=True,
            not_idempotent=True,
            hidden=[io.Hidden.unique_id, io.Hidden.prompt, io.Hidden.extra_pnginfo],
            inputs=[
                io.Model.Input("model", tooltip="The MODEL from the stock loader (a clone is trained)."),
                Dataset.Input("dataset", tooltip="From LoadKontextDataset."),
                io.String.Input(
                    "lora_name",
                    default="kontext_lora",
                    tooltip="Saved as models/loras/<name>.safetensors; checkpoints go to "
                    "output/kontext_trainer_checkpoints/<name>/.",
                ),
                io.Combo.Input(
                    "resume_from",
                    options=resume_choices(),
                    default=NO_RESUME,
                    tooltip="Continue a checkpoint exactly where it stopped (same rank, targets, seed...); "
                    "it is read, never changed: the continued run writes its own checkpoints.",
                ),
                *config_widgets(ORIGINAL),
                # from here on, widgets added later: after the older ones, so workflows saved
                # before they existed keep their widget values in place
                io.Boolean.Input(
                    "overwrite",
                    default=False,
                    tooltip="If models/loras/<name>.safetensors already exists: off refuses to start "
                    "(pick another name), on replaces it once the new LoRA is saved.",
                ),
                *config_widgets(AFTER_OVERWRITE),
                io.Combo.Input(
                    "start_from_lora",
                    options=start_choices(),
                    default=NO_START,
                    optional=True,
                    tooltip="Start a new run from this LoRA's weights (ours, kohya, diffusers / ai-toolkit "
                    "files): its layers are trained, with its rank and alpha (rank must match). Unlike "
                    "resume_from, the optimizer, schedule and data order start fresh.",
                ),
                *config_widgets(AFTER_START_FROM),
                Preview.Input(
                    "preview",
                    optional=True,
                    tooltip="From PreviewSampler: sample with the LoRA while it trains.",
                ),
            ],
            outputs=[
                io.Model.Output(
                    display_name="MODEL", tooltip="The MODEL with the trained LoRA applied (a clone)."
                ),
                io.String.Output(display_name="lora_name", tooltip="The file name in models/loras."),
                LossMap.Output(
                    display_name="loss_map",
                    tooltip="Loss per step, and the held-out validation loss with the steps it was "
                    "computed at.",
                ),
                io.Image.Output(
                    display_name="previews",
                    tooltip="The last previews (from PreviewSampler); a black 64x64 image without one.",
                ),
                io.Image.Output(
                    display_name="loss_chart",
                    tooltip="Loss per step, its moving average and the validation loss (also saved as "
                    "<name>_loss.png).",
                ),
            ],
        )

    @classmethod
    def execute(
        cls,
        model,
        dataset,
        lora_name,
        overwrite,
        resume_from,
        start_from_lora=NO_START,
        preview=None,
        **settings,
    ) -> io.NodeOutput:
        import comfy.model_management
        import comfy.sd
        import comfy.utils
        import folder_paths

        paths = LoraPaths(loras_dir(), checkpoints_root(), lora_stem(lora_name))
        node = str(cls.hidden.unique_id)
        check_name_unique_in_prompt(cls.hidden.prompt, node, paths.stem)
        config = TrainConfig(**settings)
        resume_path = resolve_resume(resume_from)
        replaces = check_existing(paths, overwrite, resuming=resume_path is not None)
        if resume_path is not None:  # only its state.json here: tensors load in the training thread
            check_resume(read_state(resume_path), config, dataset.content_hash)
        start_path = resolve_start(start_from_lora) if resume_path is None else None
        check_model_fits(model, dataset, config.layout)
        check_quantized_model(model, config.fp8_mode)
        bar = comfy.utils.ProgressBar(config.steps)
        server = _prompt_server()
        prompt_id = getattr(server, "last_prompt_id", None)
        send = EventSender(node, prompt_id, workflow_id(cls.hidden.extra_pnginfo), paths.lora.name)

        def on_poll(progress: Progress) -> None:
            send(progress)
            bar.update_absolute(progress.step, config.steps)  # also raises on Cancel

        run = Run(paths, resume_path, replaces, Path(folder_paths.get_temp_directory()), start_path)
        job = MANAGER.start(
            paths.stem, lambda job: run_training(job, model, dataset, config, run, preview), meta=send.base
        )
        outcome = wait_for(job, on_poll, comfy.model_management.throw_exception_if_processing_interrupted)
        comfy.model_management.soft_empty_cache()
        if outcome.cancelled:  # the usual Cancel path: ComfyUI's ops raised the interrupt inside the
            # training thread (clearing the flag wait_for checks); end the prompt as cancelled
            raise comfy.model_management.InterruptProcessingException()
        trained, _ = comfy.sd.load_lora_for_models(model, None, outcome.lora_state, 1.0, 0)
        chart = draw_loss_chart(outcome.losses, validation=outcome.validation)
        save_png_atomic(chart, paths.loss_chart)
        image = torch.from_numpy(np.asarray(chart, dtype=np.float32) / 255.0)[None]
        loss_map = {
            "loss": outcome.losses,
            "validation_step": [step for step, _ in outcome.validation],
            "validation_loss": [loss for _, loss in outcome.validation],
        }
        ui = {"lora_name": [paths.lora.name], **loss_map}  # in /history, for scripts and the UI
        previews = outcome.previews if outcome.previews is not None else torch.zeros(1, 64, 64, 3)
        return io.NodeOutput(trained, paths.lora.name, loss_map, previews, image, ui=ui)
