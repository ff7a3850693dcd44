"""The training loop: `train(config, parameters, batch_at, loss_fn, on_step) -> TrainResult`.

Model-free: `loss_fn(batch, generator)` evaluates the objective (see `flow_step`) and
`batch_at(i)` returns micro-batch i, so the same loop trains ComfyUI's Flux in the node and
anything small in tests. `on_step` receives a `StepInfo` after every optimizer step;
returning False stops the run at that step boundary. Everything random comes from the one
generator (plus torch's global RNG for dropout, which the caller owns), so a run resumed from
a checkpoint continues with exactly the losses of an uninterrupted one. `validate()` (the
held-out loss, see `validation`) runs every `validate_every` steps and after the last one,
between steps, with every random state put back afterwards: training is the same with or
without it.

The learning rate of step k is the schedule of a run of `config.steps` at k. Continuing a
finished run with a larger `steps` therefore continues along the longer run's schedule from
k (with cosine / linear the rate goes back up to where that schedule is at k).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .buckets import epoch_batches
from .config import TrainConfig
from .distributed import Collective
from .optimizers import optimizer_spec
from .rng import RandomState
from .schedule import lr_multiplier


class NonFiniteLoss(RuntimeError):
    def __init__(self, step: int, value: float, what: str = "loss"):
        self.step, self.value = step, value
        super().__init__(
            f"the {what} became {value} at step {step}; training stopped before the update, so the "
            "weights and the last checkpoint are intact. Lower the learning rate or check the dataset "
            "for broken images."
        )


@dataclass(frozen=True)
class StepInfo:
    step: int  # 1-based index of the step just finished
    total: int
    loss: float
    learning_rate: float
    seconds: float  # wall time of this step (validation excluded)
    validation_loss: float | None = None  # computed after this step, if it was due


@dataclass
class ResumeState:
    """Where a checkpoint left off (see `checkpoint.load_checkpoint`)."""

    step: int
    losses: list[float]
    optimizer_state: dict
    generator_state: torch.Tensor
    validation: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss)
    stopped_early: bool = False
    optimizer: torch.optim.Optimizer | None = None
    generator: torch.Generator | None = None

    @property
    def steps(self) -> int:
        return len(self.losses)


class DataOrder:
    """Micro-batch i of the run: epochs of `epoch_batches`, each epoch's order seeded by
    (seed, epoch), so any index can be recomputed on resume without replaying the run."""

    def __init__(self, buckets: dict[tuple[int, int], list[int]], batch_size: int, seed: int):
        self.buckets, self.batch_size, self.seed = buckets, batch_size, seed
        self.per_epoch = sum(math.ceil(len(v) / batch_size) for v in buckets.values())
        if self.per_epoch == 0:
            raise ValueError("the dataset has no training samples")
        self._epoch, self._order = -1, []

    def __call__(self, index: int) -> list[int]:
        epoch, within = divmod(index, self.per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, epoch_batches(self.buckets, self.batch_size, generator)
        return self._order[within]


def make_optimizer(config: TrainConfig, parameters: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return optimizer_spec(config.optimizer).make(parameters, config.learning_rate, config.weight_decay)


def train(
    config: TrainConfig,
    parameters: Sequence[torch.nn.Parameter],
    batch_at: Callable[[int], object],
    loss_fn: Callable[[object, torch.Generator], torch.Tensor],
    on_step: Callable[[StepInfo], bool | None] | None = None,
    resume: ResumeState | None = None,
    on_checkpoint: Callable[[int, TrainResult], None] | None = None,
    stop_on: tuple[type[BaseException], ...] = (),
    validate: Callable[[], float] | None = None,
    collective: Collective | None = None,
) -> TrainResult:
    """`stop_on`: exceptions that mean "stop now" when raised inside a step (ComfyUI's
    interrupt, raised by its ops during compute). The step is abandoned: its gradients are
    dropped and every random state goes back to the step's start, so the result is exactly
    that of stopping at the previous step boundary.

    `collective` (data parallel, see `distributed`): each process's `loss_fn` returns its
    rows' share of the global batch loss; the gradients and the loss are summed over the
    processes before clipping, and a stop asked for on any process (`on_step` returning False)
    stops all of them after the same step. `stop_on` must then stay empty: a step abandoned
    on one process alone would leave the others waiting."""
    if collective is not None and stop_on:
        raise ValueError("stop_on cannot be used with a collective (see train's docstring)")
    parameters = list(parameters)
    result = TrainResult(optimizer=make_optimizer(config, parameters), generator=torch.Generator())
    optimizer, generator = result.optimizer, result.generator
    generator.manual_seed(config.seed)
    start = 0
    if resume is not None:
        optimizer.load_state_dict(resume.optimizer_state)
        for group in optimizer.param_groups:  # the saved groups carry the old run's settings
            group["weight_decay"] = config.weight_decay
        generator.set_state(resume.generator_state)
        start, result.losses = resume.step, list(resume.losses)
        result.validation = list(resume.validation)
    accumulation = config.gradient_accumulation
    for step in range(start, config.steps):
        started = time.perf_counter()
        boundary = RandomState.capture(generator)
        # 1) learning rate for this step
        multiplier = lr_multiplier(step, config.steps, config.warmup_steps, config.schedule, config.lr_floor)
        lr = config.learning_rate * multiplier
        for group in optimizer.param_groups:
            group["lr"] = lr
        # 2) gradients of the mean loss over the accumulated micro-batches
        total = 0.0
        try:
            for micro in range(accumulation):
                loss = loss_fn(batch_at(step * accumulation + micro), generator) / accumulation
                if loss.requires_grad:  # a data-parallel process may have no rows this time
                    loss.backward()
                total += float(loss.detach())
        except stop_on:
            optimizer.zero_grad(set_to_none=True)
            boundary.restore(generator)
            result.stopped_early = True
            break
        if collective is not None:
            total = collective.sum_gradients(parameters, total)
        if not math.isfinite(total):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLoss(step + 1, total)
        # 3) clip (an infinite max norm only measures) and update, never with a non-finite gradient
        limit = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(parameters, limit, foreach=False))
        if not math.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLoss(step + 1, norm, "gradient norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(total)
        done = step + 1
        # the step's own time (a checkpoint written below is timed apart by the caller)
        seconds = time.perf_counter() - started
        # 4) the held-out loss, if due (before the checkpoint, which keeps it)
        validation = None
        if validate is not None and (
            done == config.steps or (config.validate_every and done % config.validate_every == 0)
        ):
            around = RandomState.capture(generator)
            try:
                validation = float(validate())
            except stop_on:  # Cancel while validating: the step is done, stop after it
                result.stopped_early = done < config.steps
                break
            finally:
                around.restore(generator)
            result.validation.append((done, validation))
        info = StepInfo(done, config.steps, total, lr, seconds, validation)
        if (
            on_checkpoint is not None
            and config.save_every
            and done % config.save_every == 0
            and done < config.steps
        ):
            on_checkpoint(done, result)
        stop = on_step is not None and on_step(info) is False
        if collective is not None and done < config.steps:
            stop = collective.any(stop)
        if stop:
            result.stopped_early = done < config.steps
            break
    return result
