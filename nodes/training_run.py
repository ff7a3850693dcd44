"""The body of one training job (runs in the job's thread): dataset batches -> LoRA session ->
loop, with checkpoints, the final LoRA file, and a clear outcome for every way it can end.

Files (all atomic): the LoRA at `models/loras/<name>.safetensors`; checkpoints (LoRA,
optimizer and RNG state: not LoRAs to load, so never under models/loras where ComfyUI's LoRA
lists look) in `output/kontext_trainer_checkpoints/<name>/<run date-time>/step_NNNNNN/`, one
folder per run. A resumed run starts a new run folder of its own name: it never deletes or
rewrites the checkpoints it resumed from, nor any other run's. Each run keeps its newest
`keep_last` checkpoints; a checkpoint is written every `save_every` steps, when a run is
cancelled, and at its last step (so a finished run can be continued with more steps).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..trainer_core.checkpoint import load_checkpoint, new_run_folder, prune, save_checkpoint
from ..trainer_core.config import TrainConfig
from ..trainer_core.dataset import KontextDataset
from ..trainer_core.loop import DataOrder, NonFiniteLoss, ResumeState, TrainResult, train
from ..trainer_core.names import LOSS_CHART_SUFFIX, SUFFIX
from ..trainer_core.vram import Estimate, FluxShape, estimate_vram, module_weight_bytes
from .flux_training import flux_lora_session
from .preview_sampler import PreviewSettings, sample_previews, save_previews
from .training_job import ProgressTracker, TrainingJob

# Must match between a checkpoint and the run resuming it (they shape the LoRA or its ids).
LOGGER = logging.getLogger("kontext_trainer")
RESUME_MUST_MATCH = (
    "rank",
    "alpha",
    "targets",
    "layout",
    "seed",
    "batch_size",
    "gradient_accumulation",
    "optimizer",
    "dataset_hash",
)


@dataclass(frozen=True)
class LoraPaths:
    loras_dir: Path  # models/loras: the LoRA file and its loss chart
    checkpoints_root: Path  # output/kontext_trainer_checkpoints: every name's checkpoints
    stem: str

    @property
    def lora(self) -> Path:
        return self.loras_dir / f"{self.stem}{SUFFIX}"

    @property
    def loss_chart(self) -> Path:
        return self.loras_dir / f"{self.stem}{LOSS_CHART_SUFFIX}"

    @property
    def checkpoints(self) -> Path:
        return self.checkpoints_root / self.stem


@dataclass
class TrainingOutcome:
    losses: list[float]
    lora_state: dict[str, torch.Tensor] = field(default_factory=dict)  # the saved file's tensors
    cancelled: bool = False
    checkpoint: Path | None = None
    previews: torch.Tensor | None = None  # the final preview images (B, H, W, 3)


def run_record(config: TrainConfig, dataset: KontextDataset) -> dict:
    """What a checkpoint remembers of its run (compared on resume)."""
    return {**dataclasses.asdict(config), "dataset_hash": dataset.content_hash}


def check_resume(state: dict, config: TrainConfig, dataset: KontextDataset) -> None:
    """Refuse a resume that could not continue the checkpoint's run exactly. `state`: the
    checkpoint's state.json (`checkpoint.read_state`)."""
    current, saved, step = run_record(config, dataset), state["config"], int(state["step"])
    for name in RESUME_MUST_MATCH:
        if saved.get(name) != current[name]:
            if name == "dataset_hash":
                raise ValueError(
                    "resume_from: the checkpoint was trained on another dataset (other files, captions, "
                    "sizes, hold-out or encoders); resume with the dataset it was trained on"
                )
            raise ValueError(
                f"resume_from: the checkpoint was trained with {name}={saved.get(name)!r} but "
                f"this run has {name}={current[name]!r}; set it back to resume"
            )
    if step >= config.steps:
        raise ValueError(
            f"resume_from: the checkpoint is at step {step} and steps is {config.steps}; "
            "raise steps to train further"
        )


def base_model_name(dataset: KontextDataset) -> str:
    return "flux1_kontext" if dataset.reference_count else "flux1_dev"


def vram_estimate(model, dataset: KontextDataset, config: TrainConfig) -> Estimate:
    """The estimate for this model, dataset and config (shown before training starts)."""
    flux = model.model.diffusion_model
    itemsize = flux.double_blocks[0].img_attn.qkv.weight.element_size()
    loaded = {1: "fp8", 2: "bf16"}.get(itemsize, "fp32")
    return estimate_vram(
        FluxShape.of(flux.params),
        resolution=dataset.settings.resolution,
        references=dataset.reference_count,
        batch=config.batch_size,
        rank=config.rank,
        weight_format="fp8_scaled" if config.fp8_mode == "fp8_scaled" else loaded,
        base_format=loaded,
        blocks_to_swap=config.blocks_to_swap,
        gradient_checkpointing=config.gradient_checkpointing,
    )


def _rng_state(generator: torch.Generator) -> dict[str, torch.Tensor]:
    state = {"generator": generator.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_global_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def remove_stale_partials(paths: LoraPaths) -> list[Path]:
    """Temp files, staging folders and replaced checkpoints a crash left behind for this LoRA
    name (never visible under a real name, but they take space)."""
    stale = [
        p
        for name in (paths.lora.name, paths.loss_chart.name)
        for p in paths.loras_dir.glob(f".{glob.escape(name)}.*.partial")
    ]
    if paths.checkpoints.is_dir():
        folders = [paths.checkpoints, *(p for p in paths.checkpoints.iterdir() if p.is_dir())]
        stale += [p for f in folders for p in f.iterdir() if p.name.endswith((".partial", ".old"))]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return stale


PREVIEW_HISTORY = 24  # preview images listed on the node (older ones stay in the temp folder)
PREVIEW_ROUNDS_OUT = 4  # preview rounds (each: one image per prompt) in the `previews` output


@dataclass
class Run:
    """Where one training run writes, and what it says when it ends."""

    paths: LoraPaths
    resume: Path | None = None  # the checkpoint folder to continue from
    replaces: bool = False  # the LoRA file exists and the user allowed overwriting it
    temp_dir: Path | None = None  # ComfyUI's temp folder, for previews


def run_training(
    job: TrainingJob,
    model,
    dataset: KontextDataset,
    config: TrainConfig,
    run: Run,
    preview: PreviewSettings | None = None,
) -> TrainingOutcome:
    import comfy.model_management

    paths = run.paths
    if not dataset.entries:
        raise ValueError("the dataset has no training samples (all held out?)")
    samples = {}

    def sample(index: int):
        if index not in samples:  # read each sample from the cache once
            samples[index] = dataset.sample(dataset.entries[index], latent_in=model.model.process_latent_in)
        return samples[index]

    remove_stale_partials(paths)
    # Loaded here, in the training thread (outside ComfyUI's inference mode).
    resume = load_checkpoint(run.resume) if run.resume is not None else None
    saved: dict[int, Path] = {}  # step -> checkpoint written by this run
    run_folder: list[Path] = []  # made at the first save, so a run that fails early leaves none
    record = run_record(config, dataset)
    if resume is not None:
        record["resumed_from"] = str(resume.path)
    order = DataOrder(dataset.buckets(), config.batch_size, config.seed)
    metadata = config.file_metadata(
        config.steps, dataset.settings.resolution, base_model_name(dataset), dataset.content_hash
    )
    empty_text = dataset.empty_text() if config.caption_dropout > 0 else None
    tracker = ProgressTracker(config.steps, resume.step if resume else 0)
    if preview is not None:
        tracker.recurring("preview", preview.every_n_steps, at_end=True)
    tracker.recurring("checkpoint", config.save_every or config.steps, at_end=True)
    for loss in resume.losses if resume else []:
        job.record_loss(loss)
    estimate = vram_estimate(model, dataset, config)
    weights = module_weight_bytes(model.model.diffusion_model)
    LOGGER.info(
        "TrainLoRA %s: %s; transformer weights %.2f GiB as stored", paths.stem, estimate, weights / 2**30
    )
    # kept on every step's progress (the panel shows it while training; an event always has it)
    tracker.progress = dataclasses.replace(tracker.progress, message=f"estimated VRAM {estimate}")
    job.report(tracker.progress)
    preview_refs: list[dict] = []
    preview_rounds: list[torch.Tensor] = []

    # Tell ComfyUI's loader what training needs beside the weights, so it leaves room for it.
    working_memory = int((estimate.activations + estimate.lora + estimate.overhead) * 2**30)
    with flux_lora_session(
        model, config, resume.lora if resume else None, empty_text, memory_required=working_memory
    ) as session:
        resume_state = None
        if resume is not None:
            _restore_global_rng(resume.rng)  # dropout continues exactly where it stopped
            resume_state = ResumeState(
                resume.step, resume.losses, resume.optimizer_state, resume.rng["generator"]
            )

        def save(step: int, result: TrainResult) -> Path:
            if step in saved:  # e.g. Cancel right after a save_every checkpoint
                return saved[step]
            if not run_folder:  # a new folder per run: a resume never touches the run it came from
                run_folder.append(new_run_folder(paths.checkpoints))
            with tracker.timed("checkpoint"):
                path = save_checkpoint(
                    run_folder[0],
                    step,
                    session.lora.modules(),
                    result.optimizer,
                    _rng_state(result.generator),
                    result.losses,
                    record,
                    {**metadata, "ss_steps": str(step)},
                )
                prune(run_folder[0], config.keep_last)
            saved[step] = path
            return path

        def previews(step: int) -> torch.Tensor:
            with tracker.timed("preview"):
                images = sample_previews(session, preview, config.layout)
                preview_refs.extend(save_previews(images, run.temp_dir, paths.stem, step))
            del preview_refs[:-PREVIEW_HISTORY]
            preview_rounds.append(images)
            del preview_rounds[:-PREVIEW_ROUNDS_OUT]
            # on the tracker's progress, so every later step's report keeps the history
            tracker.progress = dataclasses.replace(tracker.progress, previews=tuple(preview_refs))
            job.report(tracker.progress)
            return images

        def on_step(info) -> bool:
            job.record_loss(info.loss)
            job.report(tracker.update(info))
            if preview is not None and info.step % preview.every_n_steps == 0 and info.step < config.steps:
                try:
                    previews(info.step)
                except comfy.model_management.InterruptProcessingException:
                    job.stop_requested.set()  # Cancel pressed while sampling: stop here, cleanly
            return not job.stop_requested.is_set()

        try:
            result = train(
                config,
                session.lora.parameters(),
                lambda index: [sample(i) for i in order(index)],
                session.loss,
                on_step,
                resume_state,
                on_checkpoint=save,
                stop_on=(comfy.model_management.InterruptProcessingException,),
            )
        except NonFiniteLoss as error:
            job.report(status="error", message=str(error))
            raise
        except torch.OutOfMemoryError as error:
            # Kept an OutOfMemoryError, so ComfyUI's own out-of-memory handling still runs.
            raise torch.OutOfMemoryError(
                "out of GPU memory while training; try fp8 base weights (UNETLoader weight_dtype "
                "fp8_e4m3fn), blocks_to_swap, a smaller resolution or batch size, or gradient "
                f"checkpointing ({estimate}; {str(error).splitlines()[0] if str(error) else ''})"
            ) from None
        if result.stopped_early:
            checkpoint = save(result.steps, result)
            job.report(
                status="cancelled",
                message=f"stopped at step {result.steps}; resume from {checkpoint_choice(paths, checkpoint)}",
            )
            return TrainingOutcome(result.losses, cancelled=True, checkpoint=checkpoint)
        save(config.steps, result)  # the final step too: a finished run can be continued
        state = session.save(
            paths.lora,
            config.steps,
            dataset.settings.resolution,
            base_model_name(dataset),
            dataset.content_hash,
        )
        lora_state = _read_back(state)
        if preview is not None:  # after the LoRA is safe: a Cancel here only skips this round
            try:
                previews(config.steps)
            except comfy.model_management.InterruptProcessingException:
                LOGGER.info("TrainLoRA %s: final previews skipped (cancelled)", paths.stem)
    replaced = " (replaced the previous file, overwrite is on)" if run.replaces else ""
    job.report(status="finished", message=f"saved {paths.lora}{replaced}")
    final_previews = torch.cat(preview_rounds) if preview_rounds else None
    return TrainingOutcome(result.losses, lora_state, previews=final_previews)


def checkpoint_choice(paths: LoraPaths, checkpoint: Path) -> str:
    """How a checkpoint appears in TrainLoRA's resume_from list."""
    return checkpoint.relative_to(paths.checkpoints_root).as_posix()


def _read_back(path: Path) -> dict[str, torch.Tensor]:
    from ..trainer_core.lora_file import load

    return load(path)[0]
