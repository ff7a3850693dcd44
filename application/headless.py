"""The headless door: a TOML config (`trainer_core.run_config`) trained without the graph, by
the same code the nodes run (`application.cli` boots ComfyUI and calls `train_command`).

1. the model files load through ComfyUI's own loader nodes (UNETLoader, VAELoader, CLIPLoader /
   DualCLIPLoader), as in the graph;
2. the dataset loads and encodes as LoadKontextDataset does (`load_dataset`, the same cache);
   data parallel, the first process of each machine fills the cache while the others wait;
3. the run goes through the run service TrainLoRA uses (`run_service`): the same checks (name,
   overwrite, resume, start LoRA, model fit), the same background job, the same LoRA file,
   snapshots, checkpoints, and the loss chart beside the LoRA;
4. progress prints as a bar (step, loss, s/step, ETA); Ctrl-C (or torchrun's SIGTERM) stops
   after the current step with a checkpoint to resume from, as Cancel does in the graph.

Under torchrun every process runs all of this (see `trainer_core.distributed`); rank 0 prints
and writes the files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from ..comfy_adapter.comfy_loading import as_after_a_node
from ..comfy_adapter.model_view import load_device
from ..trainer_core import distributed
from ..trainer_core.atomic import write_atomic
from ..trainer_core.choices import JobStatus
from ..trainer_core.distributed import Collective, PeerLost
from ..trainer_core.job import Progress
from ..trainer_core.run_config import ModelFiles, RunConfig, dump_run_config
from .datasets import load_dataset
from .preflight import in_section, refusal
from .run_policy import resume_folder, start_file
from .run_service import PreparedRun, RunRequest, prepare
from .training_run import TrainingOutcome
from .widget_schema import RUN_FILE
from .workflow_config import config_from_workflow, node_class, workflow_from_config

LOGGER = logging.getLogger("kontext_trainer")
EXIT_STOPPED = 130  # stopped by Ctrl-C / SIGTERM, with a checkpoint to resume from
BAR_WIDTH = 24


def say(message: str, rank: int = 0) -> None:
    if rank == 0:
        print(f"[kontext-trainer] {message}", flush=True)


# --- 1) models, through ComfyUI's loader nodes ------------------------------------------------


def _model_file(value: str, folder: str, key: str) -> str:
    """A `[model]` entry as the name ComfyUI's loader takes: a name in the base directory's
    models/<folder> (or any folder ComfyUI lists for it), or an absolute path, whose folder is
    added to ComfyUI's list for the run."""
    import folder_paths

    path = Path(value).expanduser()
    if path.is_absolute():
        if not path.is_file():
            raise ValueError(f"[model] {key}: {path} does not exist; give the path of the file")
        folder_paths.add_model_folder_path(folder, str(path.parent), is_default=True)
        found = folder_paths.get_full_path(folder, path.name)
        if found is None or Path(found).resolve() != path.resolve():
            raise ValueError(
                f"[model] {key}: another {path.name} in ComfyUI's {folder} folders hides {path}; "
                "rename one of them"
            )
        return path.name
    if folder_paths.get_full_path(folder, value) is None:
        where = ", ".join(folder_paths.get_folder_paths(folder))
        raise ValueError(
            f"[model] {key}: '{value}' is not in ComfyUI's {folder} folders ({where}); put it there "
            "or give its absolute path"
        )
    return value


def load_models_stock(files: ModelFiles):
    """(MODEL, VAE, CLIP) exactly as UNETLoader, VAELoader and CLIPLoader / DualCLIPLoader load
    them in a workflow."""
    unet = _model_file(files.diffusion_model, "diffusion_models", "diffusion_model")
    with _loading("diffusion_model", files.diffusion_model, "UNETLoader"):
        (model,) = node_class("UNETLoader")().load_unet(unet, files.weight_dtype)
    with _loading("vae", files.vae, "VAELoader"):
        (vae,) = node_class("VAELoader")().load_vae(_model_file(files.vae, "vae", "vae"))
    encoders = [_model_file(name, "text_encoders", "text_encoders") for name in files.text_encoders]
    with _loading("text_encoders", ", ".join(files.text_encoders), "the CLIP loader"):
        if len(encoders) == 1:
            (clip,) = node_class("CLIPLoader")().load_clip(encoders[0], files.clip_type, files.clip_device)
        else:
            loader = node_class("DualCLIPLoader")()
            (clip,) = loader.load_clip(*encoders, files.clip_type, files.clip_device)
    return model, vae, clip


@contextlib.contextmanager
def _loading(key: str, value: str, loader: str):
    """A file ComfyUI's loader cannot load (not a model, damaged, another kind of model) in one
    line naming the key and the file, instead of the loader's traceback."""
    try:
        yield
    except (MemoryError, torch.OutOfMemoryError, KeyboardInterrupt):
        raise
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"[model] {key}: {loader} could not load {value} ({first}); is it the right kind of model "
            "file, and complete?"
        ) from None


# --- 2) the dataset -----------------------------------------------------------------------------


def prepare_dataset(vae, clip, config: RunConfig, collective: Collective | None, checked):
    """LoadKontextDataset's dataset (`checked`: `check_dataset`'s scan of it, made before the
    models loaded); data parallel, the first process of each machine encodes what the cache
    lacks while the others wait, then they read it (all cache hits), and all processes must see
    the same dataset."""
    first = collective is None or distributed.local_rank() == 0
    rank = distributed.rank_of(collective)
    dataset = report = None
    if first:
        dataset, report = load_dataset(
            vae, clip, config.dataset, progress=_encode_progress(rank), confined=False, checked=checked
        )
    if collective is not None:
        collective.barrier("waiting for the dataset cache")
        if not first:
            dataset, report = load_dataset(vae, clip, config.dataset, confined=False, checked=checked)
        digest = torch.frombuffer(bytearray(dataset.content_hash.encode("ascii")), dtype=torch.uint8)
        seen = {bytes(t.tolist()).decode("ascii") for t in collective.gather(digest, "comparing datasets")}
        if len(seen) > 1:
            raise ValueError(
                "[dataset]: the processes see different datasets (files, captions or encoders differ "
                "between machines); give every machine the same dataset folder and model files"
            )
    return dataset, report


def _encode_progress(rank: int):
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if rank == 0 and (done == total or now - last[0] > 2):
            last[0] = now
            say(f"dataset: {done}/{total} images and captions ready")

    return progress


# --- 3) the run ---------------------------------------------------------------------------------


def prepare_run(config: RunConfig, collective: Collective | None) -> PreparedRun:
    """TrainLoRA's checks that need no model (names, overwrite, the files to start from): made
    before anything loads; the rest (`check_fit`) once the model and the dataset are loaded."""
    trainer = config.trainer
    resume = resume_folder(trainer.resume_from)
    request = RunRequest(
        trainer.lora_name,
        config.train,
        trainer.overwrite,
        resume,
        start_file(trainer.start_from_lora) if resume is None else None,
        collective,
        model_file=_model_path(config.model.diffusion_model),
        encoder_files=(
            Path(config.model.vae).name,
            ", ".join(Path(name).name for name in config.model.text_encoders),
        ),
    )
    return prepare(request)


def _model_path(value: str) -> Path | None:
    """The diffusion model's file (for the LoRA's metadata), or None where it cannot be found
    (loading it says why)."""
    import folder_paths

    path = Path(value).expanduser()
    found = path if path.is_absolute() else folder_paths.get_full_path("diffusion_models", value)
    return Path(found) if found is not None and Path(found).is_file() else None


# --- 4) progress and stopping -------------------------------------------------------------------


def describe(progress: Progress) -> str:
    total = max(progress.total, 1)
    filled = round(BAR_WIDTH * progress.step / total)
    parts = [f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {progress.step}/{progress.total}"]
    if progress.loss is not None:
        parts.append(f"loss {progress.loss:.4f} (avg {progress.smoothed_loss:.4f})")
    if progress.validation_loss is not None:
        parts.append(f"val {progress.validation_loss:.4f}@{progress.validation_step}")
    if progress.seconds_per_step:
        parts.append(f"{progress.seconds_per_step:.2f} s/step")
    if progress.eta_seconds is not None and progress.step < progress.total:
        minutes, seconds = divmod(int(progress.eta_seconds), 60)
        parts.append(f"ETA {minutes // 60}:{minutes % 60:02d}:{seconds:02d}")
    return "  ".join(parts)


class ProgressPrinter:
    """The bar on rank 0: redrawn in place on a terminal, else a line per step at most every
    `interval` seconds (logs stay short)."""

    def __init__(self, rank: int, stream=None, interval: float = 1.0):
        self.rank, self.stream, self.interval = rank, stream or sys.stdout, interval
        self.tty = self.stream.isatty()
        self._last = ""
        self._printed_at = 0.0
        self._printed_step = -1  # a log gets one line per step: a preview's new ETA waits for the next

    def __call__(self, progress: Progress) -> None:
        if self.rank != 0 or progress.status == JobStatus.QUEUED or progress.loss is None:
            return
        line, now, final = describe(progress), time.monotonic(), progress.status != JobStatus.RUNNING
        if line == self._last:
            return
        if (
            not final
            and not self.tty
            and (now - self._printed_at < self.interval or progress.step <= self._printed_step)
        ):
            return
        self._last, self._printed_at, self._printed_step = line, now, progress.step
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


class StopOnSignal:
    """SIGINT (Ctrl-C) and SIGTERM ask the run to stop after the current step and write a
    checkpoint, as Cancel does; a second one at least `again_after` seconds later quits at
    once. Under torchrun a Ctrl-C reaches each process twice within moments (from the terminal,
    then forwarded by torchrun, which kills them 30 s later): that is still one request."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, rank: int, again_after: float = 2.0):
        self.rank, self.again_after, self.requested = rank, again_after, threading.Event()
        self._first_at: float | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for kind in self.SIGNALS:
                self._previous[kind] = signal.signal(kind, self._handle)
        return self

    def __exit__(self, *exc):
        for kind, previous in self._previous.items():
            signal.signal(kind, previous)

    def _handle(self, number, frame) -> None:
        now = time.monotonic()
        if self._first_at is not None:
            if now - self._first_at >= self.again_after:
                os._exit(EXIT_STOPPED)
            return
        self._first_at = now
        self.requested.set()
        say(
            "stopping after this step and writing a checkpoint (press Ctrl-C again to quit at once)",
            self.rank,
        )


# --- the command --------------------------------------------------------------------------------


def train(
    config: RunConfig, checked, load_models=None, timeout_minutes: float = 30.0, use_cuda: bool = False
) -> int:
    """`checked`: the dataset's scan (`check_dataset`), which the command line made before
    ComfyUI booted (`preflight.check_run`)."""
    collective = distributed.start(use_cuda, timeout_seconds=timeout_minutes * 60)
    rank = distributed.rank_of(collective)
    try:
        return _train(config, load_models or load_models_stock, collective, checked)
    except PeerLost as error:
        print(f"[kontext-trainer] error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        distributed.stop(collective)
        if rank == 0:
            sys.stdout.flush()


def _train(config: RunConfig, load_models, collective: Collective | None, checked) -> int:
    rank, world = distributed.rank_of(collective), distributed.world_size_of(collective)
    if world > 1:
        say(f"data parallel: {world} processes, global batch {world} x {config.train.batch_size}", rank)
    with StopOnSignal(rank) as stop:
        prepared = in_section("train", lambda: prepare_run(config, collective))
        say("loading the model files with ComfyUI's loaders", rank)
        model, vae, clip = load_models(config.model)
        as_after_a_node()  # the loaders' nodes end here in a workflow
        say(f"training on {load_device(model)}", rank)
        # what the model alone decides, before the dataset is encoded
        in_section("train", lambda: prepared.check_trained_on(model))  # a resume: the same model
        in_section("model", lambda: prepared.resolve_layout(model))  # `auto`: the model's own
        in_section("train", lambda: prepared.check_config(model))
        dataset, report = in_section(
            "dataset", lambda: prepare_dataset(vae, clip, config, collective, checked)
        )
        as_after_a_node()  # and LoadKontextDataset's here
        say("dataset:\n  " + report.replace("\n", "\n  "), rank)
        in_section("train", lambda: prepared.check_resume(dataset))
        in_section("model", lambda: prepared.check_model(model, dataset))
        if prepared.run.resume is not None:
            say(f"resuming {prepared.run.resume}", rank)
        printer = ProgressPrinter(rank)

        def on_poll(progress: Progress) -> None:
            printer(progress)
            if stop.requested.is_set():
                prepared.job.stop_requested.set()

        outcome = prepared.run_to_end(model, dataset, on_poll)
    return _finish(prepared, outcome, rank, config.trainer.resume_from)


def _finish(prepared: PreparedRun, outcome: TrainingOutcome, rank: int, resume_from: str) -> int:
    """The run's end in a few lines; `resume_from`: the run file's, as the user wrote it."""
    paths = prepared.paths
    if outcome.cancelled:
        if rank == 0 and outcome.checkpoint is not None:
            say(f"stopped after step {len(outcome.losses)}; checkpoint {outcome.checkpoint}")
            say(f'to resume, set resume_from = "{paths.checkpoint_choice(outcome.checkpoint)}" in [train]')
        return EXIT_STOPPED
    prepared.finish(outcome)
    paths = outcome.paths or paths
    if rank == 0:
        if outcome.note:
            say(outcome.note)
        say(f"LoRA saved: {paths.lora}")
        say(f"loss chart: {paths.loss_chart}")
        if outcome.losses:
            say(f"loss at the start {outcome.losses[0]:.4f}, at the end {outcome.losses[-1]:.4f}")
        resume_next = prepared.job.snapshot().resume_next  # as the graph moves its resume_from
        if resume_next:
            say(
                f"keep_last pruned the checkpoint resume_from names ({resume_from}); to go on from this "
                f'run, set resume_from = "{resume_next}" in [train]'
            )
    return 0


def train_command(options, config: RunConfig, checked, load_models=None) -> int:
    """`config` and `checked`: the config and the dataset's scan, which the command line read and
    checked before the boot (`preflight`)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kontext_trainer.cast_contract").setLevel(logging.INFO)  # the run's plan
    try:
        return train(
            config,
            checked,
            load_models,
            options.timeout_minutes,
            use_cuda=options.use_cuda,  # decided before ComfyUI booted (application.cli)
        )
    except (ValueError, OSError) as error:  # OSError: e.g. an incomplete checkpoint folder
        print(refusal(options.config, error), file=sys.stderr, flush=True)
        return 2


def convert_command(options, config: RunConfig | None, workflow: dict | None = None) -> int:
    """`config`: the `workflow` command's config, `workflow`: the `config` command's workflow
    (`workflow_config.read_workflow`), each read before the boot (application.cli)."""
    try:
        if options.command == "config":
            import folder_paths

            base = Path(folder_paths.base_path)
            text = dump_run_config(config_from_workflow(workflow, base, options.node), RUN_FILE)
        else:
            text = json.dumps(workflow_from_config(config), indent=2) + "\n"
    except (OSError, ValueError) as error:
        given = options.from_workflow if options.command == "config" else options.config
        print(refusal(given, error), file=sys.stderr, flush=True)
        return 2
    if options.output is None:
        sys.stdout.write(text)
    else:
        write_atomic(Path(options.output), lambda path: path.write_text(text, encoding="utf-8"))
        say(f"wrote {options.output}")
    return 0
