"""What a training run reports and writes beside its steps: the progress tracker (with what
recurs: validation, previews, checkpoints), the VRAM estimate it announces (and names when the
GPU runs out), its checkpoints and per-step snapshots (`CheckpointWriter`), and its preview
rounds (`PreviewRounds`). `training_run.TrainingRun` uses them in its phases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..comfy_adapter.dynamic_vram import dynamic_vram_notes
from ..comfy_adapter.lora_session import LoraSession
from ..comfy_adapter.model_family import vram_estimate
from ..comfy_adapter.model_view import stored_bytes
from ..comfy_adapter.previews import PREVIEW_FOLDER, PreviewSettings, sample_previews, save_previews
from ..trainer_core.atomic import ensure_folder
from ..trainer_core.checkpoint import Checkpoint, lineage, new_run_folder, prune, save_checkpoint, step_of
from ..trainer_core.config import TrainConfig
from ..trainer_core.distributed import Collective
from ..trainer_core.job import ProgressTracker, TrainingJob
from ..trainer_core.loop import TrainResult
from ..trainer_core.lora_metadata import RunFacts, training_metadata
from ..trainer_core.rng import PER_PROCESS, RandomState, rank_key
from ..trainer_core.run_files import (
    LoraPaths,
    drop_replaced_snapshots,
    set_aside_snapshots,
    snapshot_steps,
)
from ..trainer_core.validation import VALIDATION_SIGMAS
from ..trainer_core.vram import Estimate
from ..trainer_core.write_errors import WriteFailed, failure_line, os_error, remedy

if TYPE_CHECKING:  # training_run imports this module
    from .training_run import Run

LOGGER = logging.getLogger("kontext_trainer")
PREVIEW_HISTORY = 24  # preview images listed on the node (older ones stay in the temp folder)
PREVIEW_ROUNDS_OUT = 4  # preview rounds (each: one image per prompt) in the `previews` output


class SaveFailed(WriteFailed):
    """A file of the run could not be written (a full disk, a folder gone read-only): one line
    naming what, where, why, and the newest complete checkpoint to resume from; `step`: the step
    that had finished."""

    def __init__(self, message: str, step: int, cause: OSError | None = None):
        super().__init__(message, cause)
        self.step = step


def failed_save(
    what: str, where: Path, step: int, error: BaseException, newest: str | None, resume: str = ""
) -> SaveFailed:
    """The one line for a write that failed (an OSError: every write goes through Python's own
    file objects, `trainer_core.atomic`); `resume` (where the trained weights are, and what to
    do), else the newest complete checkpoint."""
    fix = remedy(error, where)
    resume = resume or (
        f"nothing saved before is lost: the newest complete checkpoint is {newest}; {fix} and "
        "resume from it (resume_from)"
        if newest
        else f"no checkpoint of this run was complete yet; {fix} and start it again"
    )
    return SaveFailed(failure_line(f"the {what} at step {step}", where, error, resume), step, os_error(error))


WRITE_ERRORS = (OSError,)  # a SafetensorError (a tensor it cannot store) is a bug: seen as it is


class CheckpointWriter:
    """This run's checkpoints: a folder of its own (made at the first save, so a run that
    fails early leaves none), at most one per step, the newest `keep_last` kept. Data
    parallel: every process calls `save` (each one's random state goes into the checkpoint);
    rank 0 writes, the others get None."""

    def __init__(
        self,
        paths: LoraPaths,
        config: TrainConfig,
        record: dict,
        facts: RunFacts,
        tracker,
        resumed_from: Path | None = None,
        collective: Collective | None = None,
    ):
        self.paths, self.config, self.record, self.facts = paths, config, record, facts
        self.tracker, self.collective = tracker, collective
        self.resuming, self.resumed_from = resumed_from is not None, resumed_from
        self.folder: Path | None = None
        self.saved: dict[int, Path] = {}
        # keep_last counts the logical run across resumes: the checkpoints this one continues
        # (of its LoRA name), and its snapshots up to the step it resumed from
        self.lineage = lineage(resumed_from, paths.checkpoints) if resumed_from else []
        self.snapshots: list[Path] = []  # oldest first
        self.aside: Path | None = None  # an earlier run's snapshots, set aside by this run
        if self.lineage:
            resumed_step = step_of(self.lineage[-1])
            self.snapshots = [p for s, p in sorted(snapshot_steps(paths).items()) if s <= resumed_step]

    def random_states(self, result: TrainResult) -> dict[str, torch.Tensor]:
        """Every process's random states (a collective: all processes call it together)."""
        tensors = RandomState.capture(result.generator).to_tensors()
        if self.collective is None:
            return tensors
        for name in PER_PROCESS:  # the same names on every process (CUDA on all or on none)
            if name in tensors:
                gathered = self.collective.gather(tensors[name], "saving every process's random state")
                tensors |= {rank_key(rank, name): value for rank, value in enumerate(gathered) if rank}
        return tensors

    def save(
        self, session: LoraSession, step: int, result: TrainResult, snapshot: bool = False
    ) -> Path | None:
        """The checkpoint at `step`; with `snapshot` (the `save_every` steps) also the LoRA at
        that step in models/loras/<name>_steps/, in the save precision."""
        if step in self.saved:  # e.g. Cancel right after a save_every checkpoint
            return self.saved[step]
        rng = self.random_states(result)
        if self.collective is not None and self.collective.rank != 0:
            self.saved[step] = None
            return None
        modules, metadata = session.lora.modules(), training_metadata(self.config, self.facts, step)
        with self.tracker.timed("checkpoint"):
            if snapshot:
                try:
                    self.save_snapshot(session, step, modules, metadata)
                except WRITE_ERRORS as error:
                    raise failed_save("snapshot", self.paths.snapshots, step, error, self.newest()) from None
            try:
                path = self._save_checkpoint(step, modules, result, rng, metadata)
            except WRITE_ERRORS as error:
                if self.folder is not None and not any(self.folder.iterdir()):  # none written in it
                    self.folder.rmdir()
                    self.folder = None
                where = self.folder or self.paths.checkpoints
                raise failed_save("checkpoint", where, step, error, self.newest()) from None
            gone = prune(self.folder, self.config.keep_last, self.lineage)
            self.lineage = [c for c in self.lineage if c not in gone]
        self.saved[step] = path
        return path

    def newest(self) -> str | None:
        """The newest complete checkpoint of this logical run, as resume_from lists it."""
        saved = [path for path in self.saved.values() if path is not None and path.is_dir()]
        newest = saved[-1] if saved else (self.lineage[-1] if self.lineage else self.resumed_from)
        if newest is None:
            return None
        for root in (self.paths.checkpoints_root, self.paths.checkpoints_root.resolve()):
            with contextlib.suppress(ValueError):
                return Path(newest).relative_to(root).as_posix()
        return str(newest)  # outside this base directory (the command line's absolute path)

    def _save_checkpoint(self, step, modules, result, rng, metadata) -> Path:
        if self.folder is None:  # a new folder per run (a resume prunes its origin's: `lineage`)
            self.folder = new_run_folder(self.paths.checkpoints)
        return save_checkpoint(
            self.folder,
            step,
            modules,
            result.optimizer,
            rng,
            result.losses,
            self.record,
            metadata,
            validation=result.validation,
        )

    def drop_replaced_snapshots(self) -> None:
        """This run's LoRA replaced the name's earlier one: the snapshots set aside go too."""
        # what was set aside before this run started (by the run it resumes) and by itself
        for folder in drop_replaced_snapshots(self.paths, before=self.facts.started_at, own=self.aside):
            LOGGER.info("TrainLoRA %s: removed the replaced run's snapshots %s", self.paths.stem, folder)

    def save_snapshot(self, session: LoraSession, step: int, modules: dict, metadata: dict) -> None:
        """The LoRA at `step` in models/loras/<name>_steps/. A new run's first one clears what an
        earlier run of the name left there (TrainLoRA allowed it: overwrite on), so runs never
        mix (set aside: `drop_replaced_snapshots` once this run's LoRA is saved); a resumed run
        continues its run's snapshots. Only this run's (and its origin's) are pruned."""
        if not self.snapshots and not self.resuming:  # kept aside until this run's LoRA is saved
            self.aside = set_aside_snapshots(self.paths, before=self.facts.started_at)
        made = not self.paths.snapshots.is_dir()
        ensure_folder(self.paths.snapshots)
        try:
            path = session.save(self.paths.snapshot(step), metadata, modules)
        except BaseException:
            if made and not any(self.paths.snapshots.iterdir()):  # leave no empty <name>_steps/
                self.paths.snapshots.rmdir()
            raise
        self.snapshots.append(path)
        if self.config.keep_last > 0:
            for old in self.snapshots[: -self.config.keep_last]:
                old.unlink(missing_ok=True)
            del self.snapshots[: -self.config.keep_last]


class PreviewRounds:
    """Preview images sampled during the run: the latest listed on the node, the last few
    rounds kept for the `previews` output."""

    def __init__(
        self, settings: PreviewSettings, run: Run, job: TrainingJob, tracker, checkpoints: CheckpointWriter
    ):
        self.settings, self.run, self.job, self.tracker = settings, run, job, tracker
        self.checkpoints = checkpoints
        self.refs: list[dict] = []
        self.rounds: list[torch.Tensor] = []

    def sample(self, session: LoraSession, step: int, saved_lora: Path | None = None) -> None:
        """One round at `step`; `saved_lora`: the LoRA is saved already (the last round), so a
        failed write says so."""
        with self.tracker.timed("preview"):
            images = sample_previews(session, self.settings, session.config.layout)
            try:
                self.refs.extend(save_previews(images, self.run.temp_dir, self.run.paths.stem, step))
            except OSError as error:
                where = self.run.temp_dir / PREVIEW_FOLDER
                saved = f"the LoRA is saved, {saved_lora}; {remedy(error, where)} to see the previews"
                newest = self.checkpoints.newest()
                raise failed_save(
                    "preview images", where, step, error, newest, saved if saved_lora else ""
                ) from None
        del self.refs[:-PREVIEW_HISTORY]
        self.rounds.append(images)
        del self.rounds[:-PREVIEW_ROUNDS_OUT]
        # on the tracker's progress, so every later step's report keeps the history
        self.tracker.progress = dataclasses.replace(self.tracker.progress, previews=tuple(self.refs))
        self.job.report(self.tracker.progress)

    def images(self) -> torch.Tensor | None:
        return torch.cat(self.rounds) if self.rounds else None


def start_tracking(
    job: TrainingJob, config: TrainConfig, resume: Checkpoint | None, preview, held_out: int
) -> ProgressTracker:
    """The progress tracker, with what recurs beside the steps, and the earlier points of a
    resumed run on the job (its chart continues)."""
    tracker = ProgressTracker(
        config.steps, resume.step if resume else 0, earlier_losses=resume.losses if resume else ()
    )
    if preview is not None:  # a sampling step is a forward (two with cfg), one per preview image
        forwards = preview.steps * (2 if preview.cfg > 1.0 else 1) * max(len(preview.positive), 1)
        tracker.recurring("preview", preview.every_n_steps, at_end=True, forwards=forwards)
    tracker.recurring("checkpoint", config.save_every or config.steps, at_end=True)
    if held_out:  # one forward per held-out sample and noise level
        forwards = held_out * len(VALIDATION_SIGMAS)
        tracker.recurring("validation", config.validate_every or config.steps, at_end=True, forwards=forwards)
    for loss in resume.losses if resume else []:
        job.record_loss(loss)
    for step, loss in resume.validation if resume else []:
        job.record_validation(step, loss)
    return tracker


def announce_estimate(
    job, tracker, model, dataset, config, paths: LoraPaths, resume_notes: list[str] = (), family=None
) -> Estimate:
    """The VRAM estimate, logged and kept on every step's progress message, after `resume_notes`
    (what a resume changed: already logged) and before what dynamic VRAM changes."""
    estimate = vram_estimate(model, dataset, config, family)
    weights = stored_bytes(model)
    LOGGER.info(
        "TrainLoRA %s: %s; transformer weights %.2f GiB as stored", paths.stem, estimate, weights / 2**30
    )
    notes = dynamic_vram_notes(model, config.blocks_to_swap, config.fp8_mode, family)
    for note in notes:
        LOGGER.warning("TrainLoRA %s: %s", paths.stem, note)
    message = f"estimated VRAM {estimate}"
    if notes:  # the weights stream: what the GPU needs is the rest
        beside = f"beside them training needs ~{estimate.total - estimate.weights:.1f} GiB of VRAM"
        message = "; ".join([notes[0], f"{beside} ({message})", *notes[1:]])
    # kept on every step's progress (the panel shows it while training; an event always has it)
    message = "; ".join([*resume_notes, message])
    tracker.progress = dataclasses.replace(tracker.progress, message=message)
    job.report(tracker.progress)
    return estimate


def out_of_memory(error: torch.OutOfMemoryError, estimate: Estimate) -> torch.OutOfMemoryError:
    """Kept an OutOfMemoryError, so ComfyUI's own out-of-memory handling still runs."""
    first_line = str(error).splitlines()[0] if str(error) else ""
    return torch.OutOfMemoryError(
        "out of GPU memory while training; try fp8 base weights (UNETLoader weight_dtype "
        "fp8_e4m3fn), blocks_to_swap, a smaller resolution or batch size, or gradient "
        f"checkpointing ({estimate}; {first_line})"
    )
