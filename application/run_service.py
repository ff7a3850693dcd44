"""One training run, as the TrainLoRA node and the command line both run it.

    request = RunRequest(lora_name, config, overwrite, resume, start_from)
    prepared = prepare(request)                  # files: names, overwrite, what the run starts from
    prepared.check_model_alone(model)            # what the settings and the MODEL decide (before
                                                 # the dataset encodes: resolve_layout + check_config)
    prepared.check_fit(model, dataset)           # the resume matches, the model can train this
                                                 # (check_resume + check_model)
    outcome = prepared.run(model, dataset, ...)  # the job thread, polled until it ends
    chart = prepared.finish(outcome)             # the loss chart beside the LoRA (None: stopped)

`prepare` makes the checks that need no model, so a front end can make them before it loads
anything (the CLI does); `check_model_alone` those the model decides, before the dataset is
encoded (the node asks for its dataset after them); `check_fit` those that need the model and
the dataset. All raise
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
from ..comfy_adapter.model_family import check_layout_fits, check_model_fits, family_of
from ..comfy_adapter.model_view import base_fingerprint, diffusion_module
from ..comfy_adapter.previews import PreviewSettings
from ..trainer_core.checkpoint import read_state
from ..trainer_core.config import TrainConfig
from ..trainer_core.distributed import Collective
from ..trainer_core.job import MANAGER, Progress, TrainingJob, wait_for
from ..trainer_core.loss_chart import draw_loss_chart, save_png_atomic
from ..trainer_core.resume import check_resume
from ..trainer_core.run_files import LoraPaths
from ..trainer_core.trained_on import TrainedOn, Weights, check_encoders, check_model, resume_notes
from ..trainer_core.write_errors import write_problem
from .run_policy import check_run_files, temp_dir
from .training_run import Run, TrainingOutcome, run_training

LOGGER = logging.getLogger("kontext_trainer")
DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


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
    # the VAE's and the text encoders' file names, where the graph or the run file names them
    encoder_files: tuple[str, str] = ("", "")


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
        self.check_trained_on(model)
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

    def check_model_alone(self, model) -> None:
        """What the settings and the MODEL decide, before the dataset is encoded (the node asks
        for its dataset after this; the command line makes the same calls): a resume on another
        model entry first, then the layout and the settings."""
        self.check_trained_on(model)
        self.resolve_layout(model)
        self.check_config(model)

    def resolve_layout(self, model) -> None:
        """The model's entry resolved (`family_for`), its file read as what it is, layout `auto`
        the model's own (ComfyUI's default for it: FLUX.1 `offset`, FLUX.2 `index`) before anything
        reads it (the resume check, the run, the LoRA's metadata), and the layout checked: it
        fits the model and this ComfyUI runs it."""
        family = self.family_for(model)
        self.check_model_file(model)  # a 2511 file read as 2509 would resolve 2509's layout
        layout = family.resolve_layout(self.config.layout, diffusion_module(model))
        check_layout_fits(model, layout, family=family)
        if layout != self.config.layout:
            self.request = dataclasses.replace(
                self.request, config=dataclasses.replace(self.config, layout=layout)
            )

    def check_trained_on(self, model) -> None:
        """What the run trains on (`Run.trained_on`: the model entry, the base weights); a resume
        on another model entry is refused here, naming both, before any setting is compared
        (the MODEL alone decides: the command line checks it before the dataset is encoded)."""
        if self.run.trained_on is not None:  # checked already (`check_model_alone`)
            return
        family = self.family_for(model)
        name = self.request.model_file.name if self.request.model_file is not None else ""
        base = Weights(name, base_fingerprint(model))
        self.run.trained_on = TrainedOn(family.title, base)
        if self.state is not None:
            check_model(self.state["config"], self.run.trained_on)

    def check_resume(self, dataset) -> None:
        """A resume continues this run exactly: same settings, dataset and processes (the
        batch as `fit_batch` lowers it, as the run it continues lowered it), the dataset
        encoded by the same VAE and text encoder; another base file of the same model resumes
        with a note shown first on the panel and by the command."""
        self.fit_batch(dataset)
        if self.run.trained_on is not None:
            vae, text = self.request.encoder_files
            image_id, text_id = dataset.encoder_identities
            self.run.trained_on = dataclasses.replace(
                self.run.trained_on,
                vae=Weights(vae, image_id),
                text_encoder=Weights(text, text_id),
            )
        if self.state is not None and self.run.trained_on is not None:
            check_encoders(self.state["config"], self.run.trained_on)
        if self.state is not None:
            check_resume(
                self.state, self.config, dataset.content_hash, self.run.world_size, dataset.held_out_hash
            )
            if self.run.trained_on is not None:
                notes, self.run.trained_on = resume_notes(
                    self.state["config"], int(self.state["step"]), self.run.trained_on
                )
                self.run.resume_notes = notes

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
        """The model's family can train with these settings, and fp8_mode fits the MODEL's
        weights (the model alone decides: checked before the dataset is encoded); a setting the
        model ignores, set away from its default, is told once (`ignored_notes`)."""
        self.family_for(model).check_config(self.config)
        check_quantized_model(model, self.config.fp8_mode)
        for note in self.ignored_notes(model):
            if note not in self.run.notes:
                self.run.notes.append(note)

    def ignored_notes(self, model) -> list[str]:
        """One line per setting the model does not read (`ModelFamily.ignored_settings`) that was
        set away from its default: the run's notes, shown with the estimate and logged."""
        ignored = self.family_for(model).ignored_settings(diffusion_module(model))
        return [
            f"{name}: {why}, so {name} {getattr(self.config, name)} changes nothing; the LoRA's "
            "metadata records it as ignored"
            for name, why in ignored.items()
            if getattr(self.config, name) != DEFAULTS[name]
        ]

    def check_model_file(self, model) -> None:
        """The MODEL's file (where known) says no more than this ComfyUI read from it."""
        if self.request.model_file is not None:
            self.family_for(model).check_model_file(self.request.model_file, diffusion_module(model))

    def check_model(self, model, dataset) -> None:
        """The model can train this dataset with this config (family, layout, its file,
        quantization)."""
        check_model_fits(model, dataset, self.config.layout, self.family_for(model))
        self.check_config(model)
        self.check_model_file(model)

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
