"""Learning-rate schedules as one pure function of the step."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_multiplier(step: int, total: int, warmup: int, schedule: str, floor: float = 0.0) -> float:
    """Multiplier of the base learning rate for 0-based `step` of `total`.

    1) warmup: rises linearly, (step + 1) / warmup, over the first `warmup` steps;
    2) then constant 1, or decays to `floor` by the last step (linearly or along a half cosine).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    decay_steps = total - warmup - 1
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup) / decay_steps)
    if schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
