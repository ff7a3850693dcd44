"""What a checkpoint must share with the run that resumes it, and the check that refuses a
resume that could not continue it exactly."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from .choices import plain
from .config import TrainConfig

# The settings marked `must_match` on TrainConfig's fields (they shape the LoRA or its ids, or
# decide which random numbers each step draws: a resume with any of them changed could not give
# exactly the losses of the uninterrupted run), then what the run record adds.
RESUME_MUST_MATCH = (
    *(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["must_match"]),
    "dataset_hash",
    "held_out",  # which samples are held out (not in checkpoints written before it was recorded)
    "world_size",  # data-parallel processes: the global batch and the saved RNGs are per process
)
_DEFAULTS = {**{f.name: f.default for f in dataclasses.fields(TrainConfig)}, "world_size": 1}

# The settings a resume may change although the continuation then differs from the
# uninterrupted run's (the run says which changed, `continuation_notes`): the learning rate on
# purpose (lowering it to settle a run is a usual step), with what shapes it over the steps;
# the optimizer's other knobs; the training objective's (how timesteps are drawn and weighted,
# the guidance given); and how the base weights are held (fp8_mode, and the `base` record:
# a base loaded in another precision or quantized format, or under another loading mode, may
# be what the resuming machine can hold).
RESUME_REPORTS = (
    "learning_rate",
    "schedule",
    "warmup_steps",
    "lr_floor",
    "weight_decay",
    "max_grad_norm",
    "logit_mean",
    "logit_std",
    "sigmoid_scale",
    "shift",
    "loss_weighting",
    "guidance",
    "fp8_mode",
)
# The settings that leave every number of the continuation as it was (how the run is held in
# memory, what it writes and how often); `steps` only moves a decaying schedule (its own note).
RESUME_FREE = (
    "steps",
    "gradient_checkpointing",
    "blocks_to_swap",
    "save_every",
    "keep_last",
    "validate_every",
    "save_precision",
)
ON_PURPOSE = ("learning_rate",)


def run_record(
    config: TrainConfig,
    dataset_hash: str,
    world_size: int = 1,
    held_out: str | None = None,
    base: dict | None = None,
) -> dict:
    """What a checkpoint remembers of its run (compared on resume), as plain JSON values (a
    choice as its string). `held_out`: the dataset's `held_out_hash`; `base`: how the base
    weights were held (`comfy_adapter.comfy_quantized.base_record`)."""
    record = {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    record = {**record, "dataset_hash": dataset_hash, "held_out": held_out, "world_size": world_size}
    return record if base is None else {**record, "base": base}


def check_resume(
    state: dict, config: TrainConfig, dataset_hash: str, world_size: int = 1, held_out: str | None = None
) -> None:
    """Refuse a resume that could not continue the checkpoint's run exactly. `state`: the
    checkpoint's state.json (`checkpoint.read_state`). A setting a checkpoint predates counts
    as its default (what that run trained with). `world_size`: the data-parallel processes
    of this run (1 in the graph)."""
    current = run_record(config, dataset_hash, world_size, held_out)
    saved, step = state["config"], int(state["step"])
    for name in RESUME_MUST_MATCH:
        if name not in saved and name not in _DEFAULTS:  # recorded since; the checkpoint cannot say
            continue
        before = saved.get(name, _DEFAULTS.get(name))
        if before != current[name]:
            if name == "world_size":
                raise ValueError(
                    f"resume_from: the checkpoint was trained by {before} data-parallel process(es) "
                    f"and this run has {world_size}; resume it with {before} in all (torchrun "
                    f"--nnodes x --nproc_per_node = {before}; 1 is a plain run or the graph), as the "
                    "global batch and each process's random state belong to that number"
                )
            if name == "held_out":
                raise ValueError(
                    "resume_from: the checkpoint's run held out other samples for validation "
                    "(LoadKontextDataset's hold_out or seed changed); set them back to resume, as a "
                    "resumed run must train on the same samples"
                )
            if name == "dataset_hash":
                raise ValueError(
                    "resume_from: the checkpoint was trained on another dataset (other files, captions, "
                    "sizes, hold-out or encoders); resume with the dataset it was trained on"
                )
            raise ValueError(
                f"resume_from: the checkpoint was trained with {name}={before!r} but "
                f"this run has {name}={current[name]!r}; set it back to resume"
            )
    if step >= config.steps:
        raise ValueError(
            f"resume_from: the checkpoint is at step {step} and steps is {config.steps}; "
            "raise steps to train further"
        )


def continuation_notes(
    saved: dict, step: int, config: TrainConfig, base: dict | None = None, ignored: Collection[str] = ()
) -> list[str]:
    """What a resume from `step` of the run recorded as `saved` (a checkpoint's state.json
    "config") changes: one line naming each changed setting (RESUME_REPORTS, and the `base`
    record of how the base weights are held, when both runs recorded it) and saying that the
    continuation is no longer the uninterrupted run's, then the schedule's note; [] when it
    continues exactly. `ignored`: settings the model does not read (klein's guidance): their
    change changes nothing."""
    current = {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    changed = []
    for name in RESUME_REPORTS:
        if name in ignored:
            continue
        before = saved.get(name, _DEFAULTS[name])
        before = plain(before)
        if before != current[name]:
            why = " (accepted on purpose)" if name in ON_PURPOSE else ""
            changed.append(f"{name} {before!r} -> {current[name]!r}{why}")
    if base is not None and saved.get("base") not in (None, base):
        changed.append(f"base weights {describe_base(saved['base'])} -> {describe_base(base)}")
    notes = []
    if changed:
        notes.append(
            f"resumed from step {step} with changed settings: {', '.join(changed)}; the continuation "
            "is no longer exactly the uninterrupted run's"
        )
    if note := schedule_note(saved, step, config):
        notes.append(note)
    return notes


def describe_base(base: dict) -> str:
    """A `base` record (how the base weights are held) as one phrase."""
    formats = [
        *(f"quantized {name} x{count}" for name, count in sorted(base.get("quantized", {}).items())),
        *(f"{name} x{count}" for name, count in sorted(base.get("plain", {}).items())),
    ]
    held = ", ".join(formats) or "no Linear layers"
    return f"[{held}{'; dynamic VRAM' if base.get('dynamic_vram') else ''}]"


def schedule_note(saved_config: dict, step: int, config: TrainConfig) -> str:
    """What a resume from `step` of a run with `saved_config` does to a decaying schedule when
    `steps` changed ('' when nothing changes): the rate follows the schedule of a run of the
    new length from that step on."""
    saved_steps = saved_config.get("steps")
    if config.schedule == "constant" or saved_steps in (None, config.steps):
        return ""
    return (
        f"steps changed from {saved_steps} to {config.steps}: the {config.schedule} schedule continues as "
        f"that of a {config.steps}-step run from step {step}"
    )
