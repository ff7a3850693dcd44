"""The training loop: `train(config, parameters, batches, loss_fn, on_step) -> TrainResult`.

Model-free: `loss_fn(batch, generator)` evaluates the objective (see `flow_step`), so the same
loop trains ComfyUI's Flux in the node and anything small in tests. `on_step` receives a
`StepInfo` after every optimizer step; returning False stops the run at that boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .config import TrainConfig


@dataclass(frozen=True)
class StepInfo:
    step: int  # 1-based index of the step just finished
    total: int
    loss: float
    learning_rate: float
    seconds: float  # wall time of this step


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    stopped_early: bool = False

    @property
    def steps(self) -> int:
        return len(self.losses)


def make_optimizer(config: TrainConfig, parameters: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # foreach=False: the per-tensor kernels give the same numbers on every run and platform.
    return torch.optim.AdamW(
        parameters, lr=config.learning_rate, weight_decay=config.weight_decay, foreach=False
    )


def train(
    config: TrainConfig,
    parameters: Sequence[torch.nn.Parameter],
    batches: Iterator,
    loss_fn: Callable[[object, torch.Generator], torch.Tensor],
    on_step: Callable[[StepInfo], bool | None] | None = None,
) -> TrainResult:
    parameters = list(parameters)
    optimizer = make_optimizer(config, parameters)
    generator = torch.Generator().manual_seed(config.seed)
    result = TrainResult()
    for step in range(1, config.steps + 1):
        started = time.perf_counter()
        # 1) objective on the next batch
        loss = loss_fn(next(batches), generator)
        # 2) gradients, clipped
        loss.backward()
        if config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm, foreach=False)
        # 3) update
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        result.losses.append(value)
        info = StepInfo(
            step, config.steps, value, optimizer.param_groups[0]["lr"], time.perf_counter() - started
        )
        if on_step is not None and on_step(info) is False:
            result.stopped_early = step < config.steps
            break
    return result
