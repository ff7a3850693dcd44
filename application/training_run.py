"""The body of one training job (runs in the job's thread): dataset batches -> LoRA session ->
loop, with held-out validation, previews, checkpoints, the final LoRA file, and a clear
outcome for every way it can end.

Files (all atomic; see `trainer_core.run_files`): the LoRA at `models/loras/<name>.safetensors`;
checkpoints (LoRA, optimizer and RNG state: not LoRAs to load, so never under models/loras
where ComfyUI's LoRA lists look) in `output/kontext_trainer_checkpoints/<name>/<run
date-time>/step_NNNNNN/`, one folder per run. A resumed run starts a new run folder of its
own name: it never deletes or rewrites the checkpoints it resumed from, nor any other run's.
Each run keeps its newest `keep_last` checkpoints; a checkpoint is written every `save_every`
steps, when a run is cancelled, and at its last step (so a finished run can be continued
with more steps).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..comfy_adapter.comfy_loading import interrupted_error
from ..comfy_adapter.comfy_quantized import base_record
from ..comfy_adapter.families import ModelFamily
from ..comfy_adapter.lora_session import LoraSession, lora_session
from ..comfy_adapter.model_family import family_of, text_in
from ..comfy_adapter.model_view import (
    base_model,
    compute_dtype,
    diffusion_module,
    latent_in,
    layer_names,
    layer_shapes,
    stored_formats,
)
from ..comfy_adapter.previews import PreviewSettings
from ..trainer_core.atomic import NameTaken
from ..trainer_core.checkpoint import load_checkpoint
from ..trainer_core.choices import JobStatus
from ..trainer_core.config import TrainConfig
from ..trainer_core.dataset import KontextDataset
from ..trainer_core.distributed import Collective, rank_of, world_size_of
from ..trainer_core.flow_step import Sample
from ..trainer_core.job import TrainingJob
from ..trainer_core.loop import DataOrder, NonFiniteLoss, ResumeState, StepInfo, TrainResult, train
from ..trainer_core.lora_file import LoraModule
from ..trainer_core.lora_metadata import ModelFile, RunFacts, tag_frequency, training_metadata
from ..trainer_core.resume import continuation_notes, run_record
from ..trainer_core.rng import RandomState
from ..trainer_core.run_files import LoraPaths, remove_stale_partials
from ..trainer_core.seed_lora import read_seed_lora
from ..trainer_core.trained_on import TrainedOn
from ..trainer_core.validation import evaluating, held_out_loss
from ..trainer_core.write_errors import remedy
from .run_reports import (
    WRITE_ERRORS,
    CheckpointWriter,
    PreviewRounds,
    SaveFailed,
    announce_estimate,
    failed_save,
    out_of_memory,
    start_tracking,
)

LOGGER = logging.getLogger("kontext_trainer")
CONTRACT_LOGGER = logging.getLogger("kontext_trainer.cast_contract")  # where the contract applies
FREE_NAME_TRIES = 99  # <name>_2 ... _100: a LoRA saved under the name while the run trained


@dataclass
class Run:
    """Where one training run writes, what it starts from, and what it says when it ends."""

    paths: LoraPaths
    resume: Path | None = None  # the checkpoint folder to continue from
    replaces: bool = False  # the LoRA file exists and the user allowed overwriting it
    temp_dir: Path | None = None  # ComfyUI's temp folder, for previews
    start_from: Path | None = None  # a LoRA file whose weights seed a new run
    # data parallel (headless under torchrun): this process's place; rank 0 writes every file
    collective: Collective | None = None
    overwrite: bool = False  # the user allows replacing the LoRA file (checked again at its rename)
    model_file: Path | None = None  # the base model's file, when known (for the LoRA's metadata)
    notes: list[str] = field(default_factory=list)  # what the checks changed (shown with the estimate)
    # the model's `families.ModelFamily` entry, resolved once for the run (`PreparedRun.family_for`)
    family: ModelFamily | None = None
    # what it trains on (the checkpoints record it: `trainer_core.trained_on`), and what a resume
    # says about it (shown first on the panel and by the command)
    trained_on: TrainedOn | None = None
    resume_notes: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return rank_of(self.collective)

    @property
    def world_size(self) -> int:
        return world_size_of(self.collective)


@dataclass
class TrainingOutcome:
    losses: list[float]
    lora_state: dict[str, torch.Tensor] = field(default_factory=dict)  # the saved file's tensors
    cancelled: bool = False
    checkpoint: Path | None = None
    previews: torch.Tensor | None = None  # the final preview images (B, H, W, 3)
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss)
    # where the LoRA and its chart went: another name when one of this name appeared while
    # training (overwrite off), with `note` saying so; None: the run's own paths
    paths: LoraPaths | None = None
    note: str = ""


def seed_lora(
    path: Path, model, config: TrainConfig, family: ModelFamily | None = None
) -> dict[str, LoraModule]:
    """The modules of a LoRA file a new run starts from (`start_from_lora`), checked against
    this model's layers and the rank widget (`family`: the model's entry, when resolved)."""
    names, shapes = layer_names(model), layer_shapes(model)
    places = (family or family_of(model)).diffusers_places(names)
    return read_seed_lora(path, names, config.rank, shapes, places)


class SampleCache:
    """Samples read from the dataset's cache once, in the diffusion model's latent space and
    with the text as sampling hands it to the model (`model_family.text_in`)."""

    def __init__(self, dataset: KontextDataset, model):
        self.dataset, self.latent_in = dataset, latent_in(model)
        self.text_in = text_in(base_model(model))
        self._training: dict[int, Sample] = {}

    def _sample(self, entry) -> Sample:
        return self.dataset.sample(entry, latent_in=self.latent_in, text_in=self.text_in)

    def training(self, index: int) -> Sample:
        if index not in self._training:
            self._training[index] = self._sample(self.dataset.entries[index])
        return self._training[index]

    def held_out(self) -> list[Sample]:
        return [self._sample(entry) for entry in self.dataset.held_out]

    def empty_text(self):
        return self.dataset.empty_text(self.text_in)


def run_training(
    job: TrainingJob,
    model,
    dataset: KontextDataset,
    config: TrainConfig,
    run: Run,
    preview: PreviewSettings | None = None,
) -> TrainingOutcome:
    """The job's body (runs in the job's thread, outside inference mode), phase by phase."""
    training = TrainingRun(job, model, dataset, config, run, preview)
    training.start()
    training.plan()
    return training.train()


class TrainingRun:
    """One run's phases: `start` (what it starts from), `plan` (what it reports and writes),
    `train` (the LoRA session and the loop), which ends in `stopped` (a checkpoint to resume
    from) or `finished` (a checkpoint, the LoRA, the last previews)."""

    def __init__(self, job, model, dataset, config, run, preview):
        self.job, self.model, self.dataset, self.config, self.run = job, model, dataset, config, run
        self.preview = preview
        self.interrupted = interrupted_error()
        self.paths, self.collective, self.writes = run.paths, run.collective, run.rank == 0
        self.family = run.family or family_of(model)  # resolved once for the run
        self.final_checkpoint: Path | None = None  # the finished run's last checkpoint
        self.preview_note = ""  # the last previews could not be written (the LoRA was saved)

    # 1) what the run starts from (loaded here, in the training thread: outside inference mode)
    def start(self) -> None:
        config, run, paths = self.config, self.run, self.paths
        if not self.dataset.entries:
            raise ValueError("the dataset has no training samples (all held out?)")
        if self.writes:
            remove_stale_partials(paths)
        layers = layer_names(self.model)
        self.resume = resume = load_checkpoint(run.resume, layers) if run.resume is not None else None
        seeded = seed_lora(run.start_from, self.model, config, self.family) if run.start_from else None
        self.initial = resume.lora if resume else seeded
        self.base = base_record(self.model)  # as loaded (before fp8_mode converts anything)
        self.ignored = tuple(self.family.ignored_settings(diffusion_module(self.model)))
        # what a resume changes first (shown first, and again with the run's last message)
        self.resume_notes = run.resume_notes + (
            continuation_notes(resume.config, resume.step, config, self.base, self.ignored) if resume else []
        )
        self.notes = list(self.resume_notes)
        self.notes += self.family.file_notes(config) + run.notes
        if self.family.cannot_tell:  # what ComfyUI cannot tell about the model: after the resume's
            self.notes.insert(len(self.resume_notes), self.family.cannot_tell)
        for note in self.notes:
            LOGGER.warning("TrainLoRA %s: %s", paths.stem, note)

    # 2) what it reports and writes
    def plan(self) -> None:
        job, model, dataset, config, run, resume = (
            self.job,
            self.model,
            self.dataset,
            self.config,
            self.run,
            self.resume,
        )
        self.samples = SampleCache(dataset, model)
        self.held_out = self.samples.held_out()
        self.tracker = start_tracking(job, config, resume, self.preview, held_out=len(self.held_out or ()))
        self.estimate = announce_estimate(
            job, self.tracker, model, dataset, config, self.paths, resume_notes=self.notes, family=self.family
        )
        record = run_record(
            config, dataset.content_hash, run.world_size, dataset.held_out_hash, base=self.base
        )
        if resume is not None:
            record["resumed_from"] = str(resume.path)
        trained = run.trained_on.record() if run.trained_on is not None else None
        if trained is not None:
            record["trained_on"] = trained
        # data parallel: global batches of world_size x batch_size, each process trains its rows
        self.order = DataOrder(dataset.buckets(), config.batch_size * run.world_size, config.seed)
        family = self.family
        self.facts = RunFacts(
            output_name=self.paths.stem,
            base_model=family.base_model(dataset.reference_count),
            resolution=dataset.settings.resolution,
            train_images=len(dataset.entries),
            batches_per_epoch=self.order.per_epoch,
            dataset_hash=dataset.content_hash,
            started_at=time.time(),
            session_id=secrets.randbits(31),
            names=family.names,
            base_weights=stored_formats(model),
            **dataset_facts(dataset),
            processes=run.world_size,
            mixed_precision=mixed_precision(model),
            model_file=ModelFile(run.model_file) if run.model_file is not None and self.writes else None,
            ignored=self.ignored,
            trained_on=trained,
        )
        self.checkpoints = CheckpointWriter(
            self.paths,
            config,
            record,
            self.facts,
            self.tracker,
            resumed_from=resume.path if resume is not None else None,
            collective=self.collective,
        )
        self.previews = (
            PreviewRounds(self.preview, run, job, self.tracker, self.checkpoints)
            if self.preview is not None
            else None
        )
        self.empty_text = self.samples.empty_text() if config.caption_dropout > 0 else None

    # 3) train
    def train(self) -> TrainingOutcome:
        config, estimate = self.config, self.estimate
        # what ComfyUI's loader must leave room for beside the weights
        working_memory = int((estimate.activations + estimate.lora + estimate.overhead) * 2**30)
        with lora_session(
            self.model,
            config,
            self.initial,
            self.empty_text,
            memory_required=working_memory,
            family=self.family,
        ) as session:
            CONTRACT_LOGGER.info("TrainLoRA %s: %s", self.paths.stem, session.contract.describe())
            self._join_processes(session)
            try:
                result = train(
                    config,
                    session.lora.parameters(),
                    lambda index: [self.samples.training(i) for i in self.order(index)],
                    lambda batch, generator: self._loss(session, batch, generator),
                    lambda info: self._on_step(session, info),
                    self._resume_state(),
                    on_checkpoint=lambda step, result: self.checkpoints.save(
                        session, step, result, snapshot=True
                    ),
                    # data parallel: stops only at step boundaries, agreed by all processes
                    stop_on=(self.interrupted,) if self.collective is None else (),
                    validate=(lambda: self._validate(session)) if self.held_out else None,
                    collective=self.collective,
                )
                if result.stopped_early:
                    return self.stopped(session, result)
                if not self.writes:
                    return self.finished_elsewhere(session, result)
                lora_state = self.finished(session, result)
            except NonFiniteLoss as error:
                self.job.report(status=JobStatus.ERROR, message=str(error))
                raise
            except SaveFailed as error:  # the step it failed at had finished: the progress says so
                self.job.report(step=error.step, status=JobStatus.ERROR, message=str(error))
                raise
            except torch.OutOfMemoryError as error:
                raise out_of_memory(error, estimate) from None
        replaced = " (replaced the previous file, overwrite is on)" if self.run.replaces else ""
        message = (self.conflict or f"saved {self.paths.lora}{replaced}") + self.preview_note
        message = "; ".join([*self.resume_notes, message])  # what the resume changed stays first
        resume_next, pruned = self.resume_moved(self.final_checkpoint)
        self.job.report(status=JobStatus.FINISHED, message=message + pruned, resume_next=resume_next)
        final_previews = self.previews.images() if self.previews is not None else None
        return TrainingOutcome(
            result.losses,
            lora_state,
            previews=final_previews,
            validation=result.validation,
            paths=self.saved_paths,
            note=self.conflict,
        )

    def _join_processes(self, session: LoraSession) -> None:
        """Data parallel: one start, whatever each device drew (LoRA dropout's masks belong to
        the global sample: `trainer_core.lora_dropout`)."""
        if self.collective is not None:
            self.collective.broadcast_(session.lora.parameters())

    def _resume_state(self) -> ResumeState | None:
        resume = self.resume
        if resume is None:
            return None
        rng = RandomState.from_tensors(resume.rng, self.run.rank)
        rng.restore()  # the global RNG (dropout) continues exactly where it stopped
        return ResumeState(
            resume.step, resume.losses, resume.optimizer_state, rng.generator, resume.validation
        )

    def _loss(self, session: LoraSession, batch, generator: torch.Generator) -> torch.Tensor:
        if self.collective is None:
            return session.loss(batch, generator)
        return session.loss(batch, generator, self.collective.rows(len(batch), self.config.batch_size))

    def _validate(self, session: LoraSession) -> float:
        config = self.config
        with self.tracker.timed("validation"), evaluating(session.diffusion_model):
            return held_out_loss(
                session.predict,
                self.held_out,
                session.pack,
                config.seed,
                noise_scaling=session.noise_scaling,
            )

    def _on_step(self, session: LoraSession, info: StepInfo) -> bool:
        job, previews = self.job, self.previews
        job.record_loss(info.loss)
        if info.validation_loss is not None:
            job.record_validation(info.step, info.validation_loss)
        job.report(self.tracker.update(info))
        if (
            previews is not None
            and info.step % self.preview.every_n_steps == 0
            and info.step < self.config.steps
        ):
            try:
                previews.sample(session, info.step)
            except self.interrupted:
                job.stop_requested.set()  # Cancel pressed while sampling: stop here, cleanly
        return not job.stop_requested.is_set()

    # 4) a cancelled run ends with a checkpoint to resume from
    def stopped(self, session: LoraSession, result: TrainResult) -> TrainingOutcome:
        checkpoint = self.checkpoints.save(session, result.steps, result)
        where = self.paths.checkpoint_choice(checkpoint) if checkpoint is not None else "rank 0's checkpoint"
        kept = aside_note(self.checkpoints.aside)
        resume_next, pruned = self.resume_moved(checkpoint)
        self.job.report(
            status=JobStatus.CANCELLED,
            message="; ".join(
                [*self.resume_notes, f"stopped at step {result.steps}{kept}; resume from {where}{pruned}"]
            ),
            resume_next=resume_next,
        )
        return TrainingOutcome(
            result.losses, cancelled=True, checkpoint=checkpoint, validation=result.validation
        )

    def resume_moved(self, newest: Path | None) -> tuple[str, str]:
        """Where keep_last pruned the checkpoint this run resumed from (the policy counts the
        runs a resume continues): the choice that takes its place in resume_from (the run's
        newest checkpoint `newest`, or "none") and the end of the run's message saying so;
        ("", "") otherwise. Without it, the node kept the pruned choice and the next Run was
        refused by ComfyUI ("Value not in list")."""
        resumed = self.run.resume
        if resumed is None or resumed.exists() or not self.writes:
            return "", ""
        choice = self.paths.checkpoint_choice(newest) if newest is not None and newest.is_dir() else "none"
        return choice, f"; keep_last pruned the checkpoint this run resumed from: resume_from is now {choice}"

    # 5) a finished one: a checkpoint (to continue with more steps), the LoRA, the last previews
    def finished(self, session: LoraSession, result: TrainResult) -> dict[str, torch.Tensor]:
        config = self.config
        final = self.final_checkpoint = self.checkpoints.save(session, config.steps, result)
        try:
            saved = self.save_lora(session, training_metadata(config, self.facts, config.steps))
        except WRITE_ERRORS as error:
            kept = (
                f"the trained LoRA is complete in the final checkpoint, {final / 'lora.safetensors'} "
                f"(float32): {remedy(error, self.paths.loras_dir)}, then copy it into models/loras, or "
                "resume that checkpoint with more steps"
            )
            raise failed_save("LoRA", self.paths.loras_dir, config.steps, error, None, kept) from None
        if self.saved_paths == self.paths:  # this run replaces the name's earlier run now
            self.checkpoints.drop_replaced_snapshots()
        lora_state = _read_back(saved)
        if self.previews is not None:  # after the LoRA is safe: a Cancel here only skips this round
            try:
                self.previews.sample(session, config.steps, saved_lora=saved)
            except self.interrupted:
                LOGGER.info("TrainLoRA %s: final previews skipped (cancelled)", self.paths.stem)
            except SaveFailed as error:  # the LoRA is saved: the run succeeded, the message says it
                LOGGER.warning("TrainLoRA %s: %s", self.paths.stem, error)
                self.preview_note = f"; {error}"
        return lora_state

    def save_lora(self, session: LoraSession, metadata: dict[str, str]) -> Path:
        """The LoRA under its name; with overwrite off, never over a file of that name that
        appeared while this run trained (another run, or the command line, saved it): then
        under the first free `<name>_N`, and the run says so (`conflict`)."""
        paths = self.paths
        self.saved_paths, self.conflict = paths, ""
        try:
            return session.save(paths.lora, metadata, replace=self.run.overwrite)
        except NameTaken:  # only a real clash; a folder that cannot take the file is its error
            pass
        for n in range(2, 2 + FREE_NAME_TRIES):
            other = dataclasses.replace(paths, stem=f"{paths.stem}_{n}")
            if other.loss_chart.exists():
                continue
            try:
                saved = session.save(other.lora, metadata, replace=False)
            except NameTaken:
                continue
            self.saved_paths = other
            self.conflict = (
                f"saved {other.lora}: {paths.lora.name} appeared while this run trained (another run "
                "saved it) and overwrite is off, so this run's LoRA took the next free name"
            )
            LOGGER.warning("TrainLoRA %s: %s", paths.stem, self.conflict)
            return saved
        raise NameTaken(
            errno.EEXIST,
            f"{paths.lora.name} and {FREE_NAME_TRIES} names after it ({paths.stem}_2 ... "
            f"{paths.stem}_{1 + FREE_NAME_TRIES}) are taken",
            str(paths.lora),
        )

    def finished_elsewhere(self, session: LoraSession, result: TrainResult) -> TrainingOutcome:
        """Data parallel, a process other than rank 0: its part of the last checkpoint only."""
        self.checkpoints.save(session, self.config.steps, result)
        self.job.report(
            status=JobStatus.FINISHED, message=f"rank {self.run.rank}: done (rank 0 saved the LoRA)"
        )
        return TrainingOutcome(result.losses, validation=result.validation)


def dataset_facts(dataset: KontextDataset) -> dict:
    """What the LoRA's metadata says of the dataset, as sd-scripts describes one folder."""
    entries = dataset.entries
    return {
        "dataset_dir": Path(dataset.source).name if getattr(dataset, "source", "") else "",
        "tag_frequency": tag_frequency(e.caption for e in entries),
        "buckets": tuple((size, len(indices)) for size, indices in dataset.buckets().items()),
        "aspect_error": sum(getattr(e, "aspect_error", 0.0) for e in entries) / max(len(entries), 1),
        "validation_images": len(dataset.held_out),
        "validation_seed": dataset.settings.seed,
    }


def mixed_precision(model) -> str:
    """The dtype ComfyUI computes the model in, as sd-scripts' ss_mixed_precision names it."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute_dtype(model), "no")


def aside_note(aside: Path | None) -> str:
    if aside is None:
        return ""
    return (
        f" (the replaced run's snapshots are kept in {aside.parent.name}/{aside.name} until a run of "
        "this name finishes)"
    )


def _read_back(path: Path) -> dict[str, torch.Tensor]:
    from ..trainer_core.lora_file import load

    return load(path)[0]
