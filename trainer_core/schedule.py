"""Learning-rate schedules as one pure function of the step."""

from __future__ import annotations

import math

from .choices import Schedule, choose

SCHEDULES = tuple(Schedule)


def lr_multiplier(step: int, total: int, warmup: int, schedule: str, floor: float = 0.0) -> float:
    """Multiplier of the base learning rate for 0-based `step` of `total`.

    1) warmup: rises linearly, (step + 1) / warmup, over the first `warmup` steps;
    2) then constant 1, or decays from 1 towards `floor` (linearly or along a half cosine)
       over the `total - warmup` steps after warmup;
    3) the floor is reached *after* the last step (as in transformers' and kohya's
       schedules), so every step, the last one included, still updates the weights.
    """
    schedule = choose(Schedule, schedule, "schedule")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
