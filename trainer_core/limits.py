"""Numbers a node receives must be finite and within their widget's limits.

ComfyUI checks `min` / `max` before running a node, but a NaN sent through the API passes
(every comparison with NaN is false), and Python callers skip the check altogether. A NaN
learning rate, clip norm or guidance then fails late and misleadingly ("lower the learning
rate") or silently changes the run (a NaN `max_grad_norm` disables clipping). Nodes call
`check_number` on each number before using it.
"""

from __future__ import annotations

import math
from numbers import Real


def check_number(name: str, value, minimum: float | None = None, maximum: float | None = None) -> None:
    """Raise ValueError naming `name` unless `value` is a finite real number in [minimum, maximum]."""
    span = _span(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number{span}; got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} is {value}; give a finite number{span}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} is {value}; give a number{span}")


def _span(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" from {minimum} to {maximum}"
    if minimum is not None:
        return f" of at least {minimum}"
    if maximum is not None:
        return f" of at most {maximum}"
    return ""
