"""The optimizers a run can use, in one registry that the loop (the factory), the LoRA metadata
(`ss_optimizer`: the class path sd-scripts writes) and the VRAM estimate (optimizer state per
trained value) all read. Adding an optimizer is a member of `choices.Optimizer` and one entry
here (`tests/trainer_core/test_optimizers.py` measures each entry's state against torch's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .choices import Optimizer, choose


@dataclass(frozen=True)
class OptimizerSpec:
    # (parameters, learning rate, weight decay) -> the optimizer. foreach=False: the per-tensor
    # kernels give the same numbers on every run.
    make: Callable[[Sequence[torch.nn.Parameter], float, float], torch.optim.Optimizer]
    class_path: str  # sd-scripts' ss_optimizer names the class by its module path
    # bytes of optimizer state per trained LoRA value, at a LoRA rank (fp32 LoRA weights)
    state_bytes: Callable[[int], float]


def _adamw(parameters, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, foreach=False)


def _adafactor(parameters, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(parameters, lr=lr, weight_decay=weight_decay, foreach=False)


OPTIMIZERS: dict[Optimizer, OptimizerSpec] = {
    # two fp32 moments per value
    Optimizer.ADAMW: OptimizerSpec(_adamw, "torch.optim.adamw.AdamW", lambda rank: 8.0),
    # factored second moment: one fp32 per row and per column of each (rank x n) matrix, about
    # 4 / rank bytes per value (the 4 / n of the long side is under 0.2% of that for Flux)
    Optimizer.ADAFACTOR: OptimizerSpec(_adafactor, "torch.optim.Adafactor", lambda rank: 4.0 / rank),
}


def optimizer_spec(name: str) -> OptimizerSpec:
    return OPTIMIZERS[choose(Optimizer, name, "optimizer")]
