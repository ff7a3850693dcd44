"""The websocket event TrainLoRA sends while it trains. Names and fields are constants shared
with the web extension (`web/js/training_events.js` holds the same values; a test compares
them), so every Python event has exactly one JS listener with the same name."""

from __future__ import annotations

from ..trainer_core.choices import JobStatus

PROGRESS_EVENT = "kontext_trainer.progress"
STATUSES = tuple(status.value for status in JobStatus)
PAYLOAD_FIELDS = (
    "node",  # the TrainLoRA node's id in the graph
    "prompt_id",  # the run: a new prompt id is a new run (the panel starts a new chart)
    "workflow_id",  # the frontend workflow that queued it (null for API prompts)
    "lora_name",
    "status",  # one of STATUSES
    "step",  # optimizer steps done
    "total",
    "loss",  # this step's loss
    "smoothed_loss",  # bias-corrected exponential moving average (0.9)
    "lr",
    "seconds_per_step",  # mean of the recent steps
    "eta_seconds",
    "message",  # why it stopped (errors, cancel), else ""
    "previews",  # the recent preview images (up to 24, oldest first), /view references + step
    "validation_loss",  # the latest held-out loss, else null (every point: the progress route)
    "validation_step",  # the optimizer step after which it was computed, else null
    "resume_next",  # keep_last pruned the checkpoint the run resumed from: resume_from's new choice
)
MIN_INTERVAL_SECONDS = 0.25  # at most four progress events a second


def as_the_user_knows(text: str) -> str:
    """`text` with every path inside ComfyUI's base directory written from there
    (`models/loras/x.safetensors`, `output/kontext_trainer_checkpoints/...`), as a user knows
    their ComfyUI's folders; paths elsewhere (an extra models folder) stay whole."""
    import os

    import folder_paths

    base = os.path.realpath(folder_paths.base_path)
    for root in dict.fromkeys((folder_paths.base_path, base)):  # as given, and resolved
        text = text.replace(os.path.join(root, ""), "")
    return text
