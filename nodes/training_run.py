"""The body of one training job (runs in the job's thread): dataset batches -> LoRA session ->
loop, with checkpoints, the final LoRA file, and a clear outcome for every way it can end.

Files (all atomic): the LoRA at `models/loras/<name>.safetensors`; checkpoints in the sibling
folder `models/loras/<name>_checkpoints/<run date-time>/step_NNNNNN/`, one folder per run
(a resumed run continues in its checkpoint's folder), the newest `keep_last` kept, and the
final step always saved so a finished run can be continued with more steps.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..trainer_core.checkpoint import Checkpoint, drop_after, new_run_folder, prune, save_checkpoint
from ..trainer_core.config import TrainConfig
from ..trainer_core.dataset import KontextDataset
from ..trainer_core.loop import DataOrder, NonFiniteLoss, ResumeState, TrainResult, train
from ..trainer_core.names import SUFFIX
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
    loras_dir: Path
    stem: str

    @property
    def lora(self) -> Path:
        return self.loras_dir / f"{self.stem}{SUFFIX}"

    @property
    def checkpoints(self) -> Path:
        return self.loras_dir / f"{self.stem}_checkpoints"


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


def check_resume(checkpoint: Checkpoint, config: TrainConfig, dataset: KontextDataset) -> None:
    current = run_record(config, dataset)
    for name in RESUME_MUST_MATCH:
        if checkpoint.config.get(name) != current[name]:
            if name == "dataset_hash":
                raise ValueError(
                    "resume_from: the checkpoint was trained on another dataset (other files, captions, "
                    "sizes, hold-out or encoders); resume with the dataset it was trained on"
                )
            raise ValueError(
                f"resume_from: the checkpoint was trained with {name}={checkpoint.config.get(name)!r} but "
                f"this run has {name}={current[name]!r}; set it back to resume"
            )
    if checkpoint.step >= config.steps:
        raise ValueError(
            f"resume_from: the checkpoint is at step {checkpoint.step} and steps is {config.steps}; "
            "raise steps to train further"
        )


def base_model_name(dataset: KontextDataset) -> str:
    return "flux1_kontext" if dataset.reference_count else "flux1_dev"


def vram_estimate(model, dataset: KontextDataset, config: TrainConfig) -> Estimate:
    """The estimate for this model, dataset and config (shown before training starts)."""
    flux = model.model.diffusion_model
    itemsize = flux.double_blocks[0].img_attn.qkv.weight.element_size()
    return estimate_vram(
        FluxShape.of(flux.params),
        resolution=dataset.settings.resolution,
        references=dataset.reference_count,
        batch=config.batch_size,
        rank=config.rank,
        weight_format="fp8_scaled"
        if config.fp8_mode == "fp8_scaled"
        else {1: "fp8", 2: "bf16"}.get(itemsize, "fp32"),
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
    stale = [*paths.loras_dir.glob(f".{glob.escape(paths.lora.name)}.*.partial")]
    if paths.checkpoints.is_dir():
        folders = [paths.checkpoints, *(p for p in paths.checkpoints.iterdir() if p.is_dir())]
        stale += [p for f in folders for p in f.iterdir() if p.name.endswith((".partial", ".old"))]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return stale


def run_training(
    job: TrainingJob,
    model,
    dataset: KontextDataset,
    config: TrainConfig,
    paths: LoraPaths,
    resume: Checkpoint | None = None,
    preview: PreviewSettings | None = None,
    temp_dir: Path | None = None,
) -> TrainingOutcome:
    import comfy.model_management

    if not dataset.entries:
        raise ValueError("the dataset has no training samples (all held out?)")
    samples = {}

    def sample(index: int):
        if index not in samples:  # read each sample from the cache once
            samples[index] = dataset.sample(dataset.entries[index], latent_in=model.model.process_latent_in)
        return samples[index]

    remove_stale_partials(paths)
    if resume is not None:  # continue in the checkpoint's run folder, replacing its later steps
        run_folder = resume.path.parent
        drop_after(run_folder, resume.step)
    else:
        run_folder = new_run_folder(paths.checkpoints)
    order = DataOrder(dataset.buckets(), config.batch_size, config.seed)
    metadata = config.file_metadata(
        config.steps, dataset.settings.resolution, base_model_name(dataset), dataset.content_hash
    )
    empty_text = dataset.empty_text() if config.caption_dropout > 0 else None
    tracker = ProgressTracker(config.steps, resume.step if resume else 0)
    for loss in resume.losses if resume else []:
        job.record_loss(loss)
    estimate = vram_estimate(model, dataset, config)
    weights = module_weight_bytes(model.model.diffusion_model)
    LOGGER.info(
        "TrainLoRA %s: %s; transformer weights %.2f GiB as stored", paths.stem, estimate, weights / 2**30
    )
    job.report(tracker.progress, message=f"estimated VRAM {estimate}")

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
            path = save_checkpoint(
                run_folder,
                step,
                session.lora.modules(),
                result.optimizer,
                _rng_state(result.generator),
                result.losses,
                run_record(config, dataset),
                {**metadata, "ss_steps": str(step)},
            )
            prune(run_folder, config.keep_last)
            return path

        def previews(step: int) -> torch.Tensor | None:
            images = sample_previews(session, preview, config.layout)
            job.report(previews=tuple(save_previews(images, temp_dir, paths.stem, step)))
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
            job.report(status="cancelled", message=f"stopped at step {result.steps}; checkpoint {checkpoint}")
            return TrainingOutcome(result.losses, cancelled=True, checkpoint=checkpoint)
        save(config.steps, result)  # the final step too: a finished run can be continued
        final_previews = previews(config.steps) if preview is not None else None
        state = session.save(
            paths.lora,
            config.steps,
            dataset.settings.resolution,
            base_model_name(dataset),
            dataset.content_hash,
        )
        lora_state = _read_back(state)
    job.report(status="finished", message=str(paths.lora))
    return TrainingOutcome(result.losses, lora_state, previews=final_previews)


def _read_back(path: Path) -> dict[str, torch.Tensor]:
    from ..trainer_core.lora_file import load

    return load(path)[0]
