"""One background training per process, its progress, and the wait that keeps a host informed.

The training runs in its own thread (a new thread starts outside any inference mode). The
host's thread waits in `wait_for`: every poll it reports progress and calls the host's
interrupt check, so a host's Cancel asks the training to stop at the next step boundary; the
wait then lets it write its checkpoint before the interrupt propagates. An exception in the
thread is re-raised in the waiting thread. Nothing here knows ComfyUI: the node passes its
ProgressBar / websocket update as `on_poll` and ComfyUI's interrupt check as `check_interrupt`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .choices import JobStatus
from .loop import StepInfo


@dataclass(frozen=True)
class Progress:
    status: JobStatus = JobStatus.QUEUED
    step: int = 0
    total: int = 0
    loss: float | None = None
    smoothed_loss: float | None = None
    lr: float | None = None
    seconds_per_step: float | None = None
    eta_seconds: float | None = None
    message: str = ""
    previews: tuple = ()  # the latest preview images: ({filename, subfolder, type, step}, ...)
    validation_loss: float | None = None  # the latest held-out loss (TrainingJob.record_validation)
    validation_step: int | None = None  # the optimizer step after which it was computed
    # keep_last pruned the checkpoint this run resumed from: the choice that takes its place in
    # resume_from (the run's newest checkpoint, or "none"); "" otherwise
    resume_next: str = ""


class ProgressTracker:
    """Turns StepInfos into Progress: EMA-smoothed loss, recent speed, ETA. Fields it does not
    compute (message, previews, validation) stay as they are from step to step.

    The ETA counts what will still run beside the steps: recurring work (previews every N
    steps, checkpoints every M steps, each also at the end) registered with `recurring` and
    timed with `timed`, at its mean measured duration times the number of times it is due."""

    def __init__(
        self,
        total: int,
        start_step: int = 0,
        beta: float = 0.9,
        window: int = 10,
        clock: Callable[[], float] = time.perf_counter,
        earlier_losses: Sequence[float] = (),
    ):
        self.total, self.beta, self._clock = total, beta, clock
        self._ema, self._count = 0.0, 0
        # a resumed run's average continues from the losses before it, as its chart does
        for loss in earlier_losses:
            self._count += 1
            self._ema = beta * self._ema + (1 - beta) * loss
        self._times: deque[float] = deque(maxlen=window)
        self._recurring: dict[str, tuple[int, bool]] = {}
        self._durations: dict[str, list[float]] = {}
        self._done_at_end: set[str] = set()
        self._forwards: dict[str, float] = {}
        self.progress = Progress(status=JobStatus.RUNNING, step=start_step, total=total)

    def recurring(self, kind: str, every: int, at_end: bool, forwards: float = 0.0) -> None:
        """`kind` runs every `every` steps (and after the last step if `at_end`). Until it has
        been timed once, each run counts as `forwards` model forward passes at a third of a
        training step each (forward, backward: about two more), so the ETA does not jump when
        the first one is measured."""
        self._recurring[kind] = (every, at_end)
        self._forwards[kind] = forwards

    @contextlib.contextmanager
    def timed(self, kind: str):
        started = self._clock()
        try:
            yield
        finally:
            self._durations.setdefault(kind, []).append(self._clock() - started)
            if self.progress.step >= self.total:
                self._done_at_end.add(kind)
            self.progress = replace(self.progress, eta_seconds=self.eta(self.progress.step))

    def due(self, kind: str, after_step: int) -> int:
        """How often `kind` still runs after step `after_step`: at the multiples of `every`
        below the total, plus once after the last step (unless that one has run)."""
        every, at_end = self._recurring[kind]
        count = max((self.total - 1) // every - after_step // every, 0)
        return count + (1 if at_end and kind not in self._done_at_end else 0)

    def eta(self, step: int) -> float | None:
        if not self._times:
            return None
        per_step = sum(self._times) / len(self._times)
        extra = 0.0
        for kind in self._recurring:
            durations = self._durations.get(kind)
            each = sum(durations) / len(durations) if durations else self._forwards[kind] * per_step / 3
            extra += each * self.due(kind, step)
        return per_step * (self.total - step) + extra

    def update(self, info: StepInfo) -> Progress:
        self._count += 1
        self._ema = self.beta * self._ema + (1 - self.beta) * info.loss
        self._times.append(info.seconds)
        self.progress = replace(
            self.progress,
            step=info.step,
            loss=info.loss,
            smoothed_loss=self._ema / (1 - self.beta**self._count),  # bias-corrected
            lr=info.learning_rate,
            seconds_per_step=sum(self._times) / len(self._times),
            eta_seconds=self.eta(info.step),
        )
        return self.progress


class TrainingJob:
    """A training thread and what it has reported. Everything is read and written under one
    lock: the training thread reports, the host's thread and the progress route read."""

    def __init__(self, name: str, target: Callable[[TrainingJob], object], meta: dict | None = None):
        self.name = name
        self.meta = dict(meta or {})  # node id, prompt id, LoRA file name: for the progress route
        self.losses: list[float] = []  # every finished step's loss (a resumed run's earlier ones too)
        # (step, loss) of every held-out evaluation, in the order recorded (a resumed run's too)
        self.validation: list[tuple[int, float]] = []
        self.stop_requested = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._progress = Progress()
        self._target = target
        self.thread = threading.Thread(target=self._run, name=f"kontext-trainer:{name}", daemon=True)

    def _run(self) -> None:
        try:
            self.result = self._target(self)
        except BaseException as error:  # re-raised in the waiting thread by wait_for
            self.error = error
            self.report(status=JobStatus.ERROR, message=str(error))
        finally:
            # The target's closure holds the run's MODEL and dataset; the finished job stays
            # the manager's `current` until the next run, and must not keep them in memory.
            self._target = None

    def report(self, progress: Progress | None = None, **fields) -> None:
        """Replace the current progress (`progress`, else the current one, with `fields`).
        The latest validation point is the job's own: it stays on every later progress, so a
        ProgressTracker's step progress need not know about it."""
        with self._lock:
            updated = replace(progress or self._progress, **fields)
            if self.validation:
                step, loss = self.validation[-1]
                updated = replace(updated, validation_step=step, validation_loss=loss)
            self._progress = updated

    def snapshot(self) -> Progress:
        with self._lock:
            return self._progress

    def record_loss(self, loss: float) -> None:
        with self._lock:
            self.losses.append(loss)

    def record_validation(self, step: int, loss: float) -> None:
        """A held-out loss computed after optimizer step `step` (1-based). The next progress
        (and every later one) carries it as validation_step / validation_loss."""
        point = (int(step), float(loss))
        with self._lock:
            self.validation.append(point)
            self._progress = replace(self._progress, validation_step=point[0], validation_loss=point[1])

    def state(self) -> dict:
        """Everything a page needs to redraw the job after a reload: the progress fields, every
        step's loss and every validation point as [step, loss]."""
        with self._lock:
            return {
                **self.meta,
                **dataclasses.asdict(self._progress),
                "losses": list(self.losses),
                "validation": [[step, loss] for step, loss in self.validation],
            }

    @property
    def running(self) -> bool:
        return self.thread.is_alive()


class JobManager:
    """Allows one training at a time in this process."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current: TrainingJob | None = None

    def start(
        self, name: str, target: Callable[[TrainingJob], object], meta: dict | None = None
    ) -> TrainingJob:
        with self._lock:
            if self.current is not None and self.current.running:
                busy = self.current.snapshot()
                raise RuntimeError(
                    f"a training is already running (LoRA '{self.current.name}', "
                    f"step {busy.step}/{busy.total}); wait for it to finish or press Cancel, "
                    "then queue this one again"
                )
            self.current = TrainingJob(name, target, meta)
            self.current.thread.start()
            return self.current


MANAGER = JobManager()


def wait_for(
    job: TrainingJob,
    on_poll: Callable[[Progress], None],
    check_interrupt: Callable[[], None],
    poll_seconds: float = 0.1,
):
    """Block until `job` ends; see the module docstring. Returns the job's result."""
    while job.running:
        job.thread.join(poll_seconds)
        try:
            on_poll(job.snapshot())
            check_interrupt()
        except BaseException:
            job.stop_requested.set()  # stop at the next step boundary, checkpoint, then re-raise
            job.thread.join()
            with contextlib.suppress(Exception):
                on_poll(job.snapshot())  # the final status (cancelled) still reaches the UI
            raise
    on_poll(job.snapshot())
    # handed over, not kept: an error's traceback holds the training frames (model, dataset)
    error, result = job.error, job.result
    job.error = job.result = None
    if error is not None:
        raise error
    return result
