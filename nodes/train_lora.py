"""TrainLoRA: trains a LoRA on the MODEL with a LoadKontextDataset dataset, in a background
thread, with live progress, the stock Cancel, checkpoints and exact resume.

The widgets are generated from `TrainerOptions` and `TrainConfig` (defaults and limits) and the
widget schema (tooltips, order, advanced), so the node, the config and the run file cannot
drift apart.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
import weakref
from pathlib import Path

import numpy as np
import torch
from comfy_api.latest import io

from ..application.node_ids import node_id
from ..application.run_policy import (
    NO_START,
    resolve_resume,
    resolve_start,
    resume_choices,
    start_choices,
)
from ..application.run_service import RunRequest, prepare
from ..application.widget_schema import CHECKPOINT_CHOICES, LORA_CHOICES, TRAIN_LORA
from ..comfy_adapter.families import trained_models
from ..trainer_core.config import TrainConfig
from ..trainer_core.job import Progress
from ..trainer_core.names import lora_stem
from ..trainer_core.run_config import TrainerOptions
from .load_kontext_dataset import Dataset
from .preview_sampler import Preview
from .progress_events import MIN_INTERVAL_SECONDS, PROGRESS_EVENT, as_the_user_knows
from .widgets import widgets

LOGGER = logging.getLogger("kontext_trainer")
# {"loss": [...], "validation_step": [...], "validation_loss": [...]}: the type ComfyUI's own
# LossGraphNode reads (it draws "loss")
LossMap = io.Custom("LOSS_MAP")


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


class SavedLoras:
    """What TrainLoRA saved in this server, so ComfyUI's cache sees its output file
    (`fingerprint_inputs`): the fingerprint of a name stays the one its run was queued with
    while the file that run saved is there unchanged (an identical prompt is answered from the
    cache), and is new once the file is gone or replaced (the node runs again)."""

    def __init__(self):
        self.by_stem: dict[str, tuple[str, Path | None, tuple | None]] = {}  # token, file, its stat

    @staticmethod
    def _stat(path: Path) -> tuple | None:
        try:
            found = path.stat()
        except OSError:
            return None
        return found.st_size, found.st_mtime_ns, found.st_ino

    def fingerprint(self, stem: str) -> str:
        token, path, saved = self.by_stem.get(stem, (None, None, None))
        if token is not None and path is not None and self._stat(path) == saved:
            return token
        token = secrets.token_hex(8)  # no file of this run's, or not the one it saved: run again
        self.by_stem[stem] = (token, None, None)
        return token

    def saved(self, stem: str, path: Path) -> None:
        token = self.by_stem.get(stem, (secrets.token_hex(8),))[0]
        self.by_stem[stem] = (token, path, self._stat(path))


SAVED = SavedLoras()
# the MODEL's family entry and what the run trains on (its base weights' fingerprint) as the
# early check resolved them (`TrainLoRA.check_lazy_status`), taken by the run that follows on the
# same MODEL: a run resolves its entry and reads its weights once
EARLY_CHECKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# the loaders whose file a MODEL comes from: their file widget and its models folder
MODEL_FILE_WIDGETS = {"unet_name": "diffusion_models", "ckpt_name": "checkpoints"}


def model_file_of(prompt: dict | None, node: str) -> Path | None:
    """The file TrainLoRA `node`'s MODEL was loaded from (the LoRA's metadata names it, as
    sd-scripts does), followed back through the nodes that pass a MODEL on (a LoRA loader, a
    patch) to the loader; None where the graph does not say (a model built in the graph)."""
    import folder_paths

    link = ((prompt or {}).get(str(node), {}).get("inputs") or {}).get("model")
    for _ in range(64):  # a graph is acyclic; this bounds a malformed one
        if not (isinstance(link, list) and link):
            return None
        inputs = ((prompt or {}).get(str(link[0])) or {}).get("inputs") or {}
        for widget, folder in MODEL_FILE_WIDGETS.items():
            if isinstance(inputs.get(widget), str):
                found = folder_paths.get_full_path(folder, inputs[widget])
                return Path(found) if found else None
        link = inputs.get("model")
    return None


def _loader_widgets(prompt: dict | None, link, wanted) -> list[str]:
    """The file names in the widgets `wanted(name)` of the loader a link comes from, followed
    back through the nodes that pass the same input on (as `model_file_of`); [] where the graph
    does not say."""
    for _ in range(64):
        if not (isinstance(link, list) and link):
            return []
        node = (prompt or {}).get(str(link[0])) or {}
        inputs = node.get("inputs") or {}
        names = [value for key, value in sorted(inputs.items()) if wanted(key) and isinstance(value, str)]
        if names:
            return names
        link = next((value for key, value in inputs.items() if key in ("vae", "clip")), None)
    return []


def encoder_files_of(prompt: dict | None, node: str) -> tuple[str, str]:
    """The VAE's and the text encoders' file names of TrainLoRA `node`'s dataset (its
    LoadKontextDataset's VAE and CLIP loaders), "" where the graph does not say."""
    dataset = ((prompt or {}).get(str(node), {}).get("inputs") or {}).get("dataset")
    inputs = (
        ((prompt or {}).get(str(dataset[0])) or {}).get("inputs") or {} if isinstance(dataset, list) else {}
    )
    vae = _loader_widgets(prompt, inputs.get("vae"), lambda key: key in ("vae_name", "ckpt_name"))
    clip = _loader_widgets(
        prompt, inputs.get("clip"), lambda key: key.startswith("clip_name") or key == "ckpt_name"
    )
    return ", ".join(vae), ", ".join(clip)


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

    def __call__(self, progress: Progress) -> bool:
        """Sends `progress` if it is due; returns whether it was sent."""
        server = _prompt_server()
        if server is None:  # no server (ComfyUI used as a library): nothing to send to
            return False
        now = time.monotonic()
        changed_status = self._last is None or progress.status != self._last.status
        if progress == self._last or (not changed_status and now - self._sent_at < MIN_INTERVAL_SECONDS):
            return False
        self._last, self._sent_at = progress, now
        payload = {**self.base, **dataclasses.asdict(progress)}
        payload["message"] = as_the_user_knows(payload["message"])  # models/loras/..., not /home/...
        server.send_sync(PROGRESS_EVENT, payload)
        return True


# Not "TrainLoRA": node search lists it beside ComfyUI core's "Train LoRA". The pack's four
# nodes read "<what it is> (Kontext Trainer)"; starting with "LoRA" ranks it among the names
# that start with the query when a user searches "lora" (5th on frontend 1.32.9, 7th on 1.49.6,
# on screen without scrolling; "Train Edit LoRA ..." was 11th / 14th), and its node id keeps it
# 2nd for "train". The node id stays KontextTrainer_TrainLoRA, so saved workflows keep loading.
DISPLAY_NAME = "LoRA Trainer (Kontext Trainer)"


class TrainLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        schema = io.Schema(
            node_id=node_id("TrainLoRA"),
            display_name=DISPLAY_NAME,
            category="Kontext Trainer",
            description=f"Kontext Trainer's trainer for image-edit LoRAs: {trained_models()}, with "
            "reference images (Kontext, DreamOmni2, FLUX.2 multi-reference) or without. Trains on "
            "the MODEL of the stock loader in a background thread with a live panel (progress, "
            "loss, ETA, previews); writes models/loras/<lora_name>.safetensors for the stock "
            "LoraLoader; Cancel stops at a step boundary and writes a checkpoint that resume_from "
            "continues exactly. (ComfyUI's own \"Train LoRA\" is a different node.)",
            is_output_node=True,
            not_idempotent=True,
            hidden=[io.Hidden.unique_id, io.Hidden.prompt, io.Hidden.extra_pnginfo],
            inputs=[
                io.Model.Input("model", tooltip="The MODEL from the stock loader (a clone is trained)."),
                # lazy: asked for once the settings and the MODEL pass (`check_lazy_status`)
                Dataset.Input("dataset", tooltip="From LoadKontextDataset.", lazy=True),
                *widgets(
                    TRAIN_LORA,
                    [TrainerOptions, TrainConfig],
                    {CHECKPOINT_CHOICES: resume_choices, LORA_CHOICES: start_choices},
                ),
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
        # the node search matches these too on ComfyUI 0.33+ (0.3.75's Schema has no such field)
        schema.search_aliases = ["train lora", "image edit lora", "qwen image edit", "flux", "finetune"]
        return schema

    @classmethod
    def fingerprint_inputs(cls, lora_name=None, **_):
        """A run whose LoRA file was deleted (or replaced) since is not answered from the cache."""
        stem = _stem_or_none(lora_name) if isinstance(lora_name, str) else None
        return SAVED.fingerprint(stem) if stem is not None else lora_name

    @classmethod
    def check_lazy_status(
        cls,
        model,
        lora_name,
        overwrite,
        resume_from,
        dataset=None,
        start_from_lora=NO_START,
        preview=None,
        **settings,
    ) -> list[str]:
        """The dataset (ComfyUI then runs LoadKontextDataset) is asked for only once what the
        settings and the MODEL decide has passed: a run they refuse encodes nothing."""
        if dataset is not None:
            return []
        prepared = cls.prepare_run(lora_name, overwrite, resume_from, start_from_lora, settings)
        prepared.check_model_alone(model)
        EARLY_CHECKS[model] = (cls.this_run(), prepared.run.family, prepared.run.trained_on)
        return ["dataset"]

    @classmethod
    def this_run(cls) -> tuple:
        """This node in this prompt (the early check's results are for it alone)."""
        return getattr(_prompt_server(), "last_prompt_id", None), str(cls.hidden.unique_id)

    @classmethod
    def prepare_run(cls, lora_name, overwrite, resume_from, start_from_lora, settings: dict):
        """The run's request, checked as far as its files go (`run_service.prepare`)."""
        stem = lora_stem(lora_name)
        node = str(cls.hidden.unique_id)
        check_name_unique_in_prompt(cls.hidden.prompt, node, stem)
        config = TrainConfig(**settings)
        resume = resolve_resume(resume_from)
        start = resolve_start(start_from_lora) if resume is None else None
        model_file = model_file_of(cls.hidden.prompt, node)
        encoder_files = encoder_files_of(cls.hidden.prompt, node)
        request = RunRequest(
            lora_name, config, overwrite, resume, start, model_file=model_file, encoder_files=encoder_files
        )
        return prepare(request)

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

        stem = lora_stem(lora_name)
        node = str(cls.hidden.unique_id)
        prepared = cls.prepare_run(lora_name, overwrite, resume_from, start_from_lora, settings)
        run, family, trained_on = EARLY_CHECKS.pop(model, (None, None, None))
        if run == cls.this_run():  # this prompt's own early check (not one a failed prompt left)
            prepared.run.family, prepared.run.trained_on = family, trained_on
        config = prepared.config
        prepared.check_fit(model, dataset)
        prepared.check_preview(preview)
        bar = comfy.utils.ProgressBar(config.steps)
        server = _prompt_server()
        prompt_id = getattr(server, "last_prompt_id", None)
        send = EventSender(node, prompt_id, workflow_id(cls.hidden.extra_pnginfo), prepared.paths.lora.name)

        def on_poll(progress: Progress) -> None:
            # ComfyUI's own bar on the node moves with the panel, as often as its events: each
            # update is a websocket message and a redraw of every open page, and ComfyUI 0.3.75
            # sends one per call (10 a second: the poll). Cancel is checked on every poll
            # (`wait_for`), not through the bar's hook.
            if send(progress):
                bar.update_absolute(progress.step, config.steps)

        interrupted = comfy.model_management.throw_exception_if_processing_interrupted
        outcome = prepared.run_to_end(model, dataset, on_poll, interrupted, preview, meta=send.base)
        comfy.model_management.soft_empty_cache()
        if outcome.cancelled:  # the usual Cancel path: ComfyUI's ops raised the interrupt inside the
            # training thread (clearing the flag wait_for checks); end the prompt as cancelled
            raise comfy.model_management.InterruptProcessingException()
        chart = prepared.finish(outcome)
        trained, _ = comfy.sd.load_lora_for_models(model, None, outcome.lora_state, 1.0, 0)
        image = torch.from_numpy(np.asarray(chart, dtype=np.float32) / 255.0)[None]
        loss_map = {
            "loss": outcome.losses,
            "validation_step": [step for step, _ in outcome.validation],
            "validation_loss": [loss for _, loss in outcome.validation],
        }
        saved = (outcome.paths or prepared.paths).lora
        SAVED.saved(stem, saved)
        name = saved.name
        ui = {"lora_name": [name], **loss_map}  # in /history, for scripts and the UI
        previews = outcome.previews if outcome.previews is not None else torch.zeros(1, 64, 64, 3)
        return io.NodeOutput(trained, name, loss_map, previews, image, ui=ui)
