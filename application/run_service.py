"""One training run, as the TrainLoRA node and the command line both run it.

    request = RunRequest(lora_name, config, overwrite, resume, start_from)
    prepared = prepare(request)                  # files: names, overwrite, what the run starts from
    prepared.check_fit(model, dataset)           # the resume matches, the model can train this
                                                 # (check_resume + check_model)
    outcome = prepared.run(model, dataset, ...)  # the job thread, polled until it ends
    chart = prepared.finish(outcome)             # the loss chart beside the LoRA (None: stopped)

`prepare` makes the checks that need no model, so a front end can make them before it loads
anything (the CLI does); `check_fit` those that need the model and the dataset. Both raise
ValueError with the field and the fix. What differs between the front ends stays in them: how a
`resume_from` / `start_from_lora` choice becomes a path (`run_policy`), how progress is shown,
and how a stop is asked for (Cancel, Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..comfy_adapter.comfy_quantized import check_quantized_model
from ..comfy_adapter.model_family import check_model_fits, family_of
from ..comfy_adapter.model_view import diffusion_module
from ..comfy_adapter.previews import PreviewSettings
from ..trainer_core.checkpoint import read_state
from ..trainer_core.config import TrainConfig
from ..trainer_core.distributed import Collective
from ..trainer_core.job import MANAGER, Progress, TrainingJob, wait_for
from ..trainer_core.loss_chart import draw_loss_chart, save_png_atomic
from ..trainer_core.resume import check_resume
from ..trainer_core.run_files import LoraPaths
from .run_policy import check_run_files, temp_dir
from .run_reports import write_problem
from .training_run import Run, TrainingOutcome, run_training

LOGGER = logging.getLogger("kontext_trainer")


@dataclass(frozen=True)
class RunRequest:
    """What a front end asks for, with its choices already resolved to files."""

    lora_name: str
    config: TrainConfig
    overwrite: bool = False
    resume: Path | None = None  # a checkpoint folder to continue exactly
    start_from: Path | None = None  # a LoRA file whose weights seed a new run (unused on resume)
    collective: Collective | None = None  # data parallel (the CLI under torchrun)
    model_file: Path | None = None  # the base model's file, when known (the LoRA's metadata names it)


@dataclass
class PreparedRun:
    request: RunRequest
    run: Run
    state: dict | None = None  # the resumed checkpoint's state.json
    job: TrainingJob | None = field(default=None, repr=False)

    @property
    def config(self) -> TrainConfig:
        return self.request.config

    @property
    def paths(self) -> LoraPaths:
        return self.run.paths

    def check_fit(self, model, dataset) -> None:
        """The model's entry and layout resolved, then both checks below (the node makes them
        together)."""
        self.resolve_layout(model)
        self.check_resume(dataset)
        self.check_model(model, dataset)

    def check_preview(self, preview: PreviewSettings | None) -> None:
        """The previews can be sampled for the run's model (after `check_fit`)."""
        if preview is not None:
            self.run.family.check_preview(preview)

    def family_for(self, model):
        """The model's `families.ModelFamily` entry, resolved on the first call (it refuses a
        model the pack does not train) and carried by the run from then on (`Run.family`)."""
        if self.run.family is None:
            self.run.family = family_of(model)
        return self.run.family

    def resolve_layout(self, model) -> None:
        """The model's entry resolved (`family_for`), and layout `auto` becomes the model's own
        (ComfyUI's default for it: FLUX.1 `offset`, FLUX.2 `index`) before anything reads it:
        the resume check, the run, the LoRA's metadata."""
        family = self.family_for(model)
        if self.config.layout == "auto":
            layout = family.resolve_layout("auto", diffusion_module(model))
            self.request = dataclasses.replace(
                self.request, config=dataclasses.replace(self.config, layout=layout)
            )

    def check_resume(self, dataset) -> None:
        """A resume continues this run exactly: same settings, dataset and processes (the
        batch as `fit_batch` lowers it, as the run it continues lowered it)."""
        self.fit_batch(dataset)
        if self.state is not None:
            check_resume(
                self.state, self.config, dataset.content_hash, self.run.world_size, dataset.held_out_hash
            )

    def fit_batch(self, dataset) -> None:
        """A batch larger than the dataset is lowered to it, with a line saying so: the run, its
        LoRA's metadata and the VRAM estimate then all use the batch that runs (a batch never
        holds a sample twice, so 8 on 3 samples trains 3 at a time anyway)."""
        config, world = self.config, self.run.world_size
        samples = len(dataset.entries)
        fits = max(1, samples // world)
        if config.batch_size <= fits:
            return
        if self.state is not None and self.state["config"].get("batch_size") == config.batch_size:
            return  # a checkpoint from before this rule trained with the batch as given: continue it
        lowered = dataclasses.replace(config, batch_size=fits)
        self.request = dataclasses.replace(self.request, config=lowered)
        each = f" per process ({world} processes)" if world > 1 else ""
        note = (
            f"batch_size {config.batch_size} is more than the dataset's {samples} training sample(s): "
            f"training with batch_size {fits}{each}"
        )
        if note not in self.run.notes:
            self.run.notes.append(note)
        LOGGER.warning("TrainLoRA %s: %s", self.paths.stem, note)

    def check_config(self, model) -> None:
        """The model's family can train with these settings (the model alone decides: the
        command line checks it before the dataset is encoded)."""
        self.family_for(model).check_config(self.config)

    def check_model(self, model, dataset) -> None:
        """The model can train this dataset with this config (family, layout, quantization)."""
        check_model_fits(model, dataset, self.config.layout, self.family_for(model))
        self.check_config(model)
        if self.request.model_file is not None:
            self.family_for(model).check_model_file(self.request.model_file, diffusion_module(model))
        check_quantized_model(model, self.config.fp8_mode)

    def run_to_end(
        self,
        model,
        dataset,
        on_poll: Callable[[Progress], None],
        raise_if_interrupted: Callable[[], None] = lambda: None,
        preview: PreviewSettings | None = None,
        meta: dict | None = None,
    ) -> TrainingOutcome:
        """Train in the job's thread; `on_poll(progress)` runs on this thread while it waits
        (it may ask the job to stop, or raise to cancel it)."""
        run, config = self.run, self.config
        self.job = MANAGER.start(
            self.paths.stem, lambda job: run_training(job, model, dataset, config, run, preview), meta=meta
        )
        return wait_for(self.job, on_poll, raise_if_interrupted)

    def finish(self, outcome: TrainingOutcome):
        """The loss chart of a finished run, saved beside the LoRA (by the process that writes
        files) and returned as an image; None for a stopped run."""
        if outcome.cancelled:
            return None
        chart = draw_loss_chart(outcome.losses, validation=outcome.validation)
        paths = outcome.paths or self.paths
        if self.run.rank == 0:
            try:
                save_png_atomic(chart, paths.loss_chart)
            except OSError as error:  # the LoRA is saved: the run succeeded, without its chart file
                LOGGER.warning(
                    "TrainLoRA %s: could not write the loss chart to %s: %s; the LoRA itself is saved, %s",
                    paths.stem,
                    paths.loss_chart,
                    write_problem(error),
                    paths.lora,
                )
        return chart


def prepare(request: RunRequest) -> PreparedRun:
    """The checks that need no model: the LoRA's name, the overwrite policy, a complete
    checkpoint to resume (its state.json read here), and what the run starts from."""
    resuming = request.resume is not None
    writer = request.collective is None or request.collective.rank == 0  # the process that writes
    paths, replaces = check_run_files(request.lora_name, request.overwrite, resuming, writer)
    state = read_state(request.resume) if resuming else None  # or a message naming what is missing
    start = None if resuming else request.start_from
    run = Run(
        paths,
        request.resume,
        replaces,
        temp_dir(),
        start,
        request.collective,
        request.overwrite,
        request.model_file,
    )
    return PreparedRun(request, run, state)
