"""The loss chart: per-step loss (thin, light), its moving average (thick) and, when there is
one, the held-out validation loss (its own colour, a square at each point) on the same step and
loss axes, drawn with PIL, for TrainLoRA's IMAGE output and the PNG saved beside the LoRA."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .atomic import write_atomic

BACKGROUND = (24, 24, 27)
GRID = (60, 60, 66)
RAW = (110, 140, 190)
SMOOTH = (255, 170, 60)
VALIDATION = (90, 215, 120)
MARGIN = 40
MARKER = 3  # a validation point's square reaches this many pixels to each side
LEGEND_Y = 20  # the legend's row, between the header and the plot


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last `window` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def chart_points(
    values: Sequence[float], width: int, height: int, low: float, high: float
) -> list[tuple[float, float]]:
    """Pixel positions: step i at x = MARGIN + i / (n - 1) * plot width; loss `low` on the plot's
    bottom edge, `high` on its top edge."""
    n = len(values)
    plot_w, plot_h = width - 2 * MARGIN, height - 2 * MARGIN
    span = (high - low) or 1.0
    return [
        (MARGIN + (i / max(n - 1, 1)) * plot_w, MARGIN + (1 - (v - low) / span) * plot_h)
        for i, v in enumerate(values)
    ]


def validation_points(
    validation: Sequence[tuple[int, float]], steps: int, width: int, height: int, low: float, high: float
) -> list[tuple[float, float]]:
    """Pixel positions of (step, loss) points on the training curve's axes: step s (1-based)
    where chart_points puts the loss of step s, i.e. index s - 1 of `steps` losses."""
    plot_w, plot_h = width - 2 * MARGIN, height - 2 * MARGIN
    span = (high - low) or 1.0
    return [
        (MARGIN + ((step - 1) / max(steps - 1, 1)) * plot_w, MARGIN + (1 - (v - low) / span) * plot_h)
        for step, v in validation
    ]


def save_png_atomic(image: Image.Image, path: Path) -> Path:
    """Write a PNG whole or not at all (temp file in the same folder, then rename)."""
    return write_atomic(path, lambda tmp: image.save(tmp, format="PNG"))


def draw_loss_chart(
    losses: Sequence[float],
    validation: Sequence[tuple[int, float]] = (),
    width: int = 512,
    height: int = 256,
    window: int = 10,
) -> Image.Image:
    """`validation`: (step, loss) pairs, step 1-based like the losses' positions; points beyond
    the steps drawn are left out. The y range covers the losses and the validation points."""
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for k in range(5):  # horizontal grid lines at 0, 25, ..., 100 % of the range
        y = MARGIN + k * (height - 2 * MARGIN) / 4
        draw.line([(MARGIN, y), (width - MARGIN, y)], fill=GRID)
    if not losses:
        draw.text((MARGIN, height / 2), "no steps yet", fill=RAW)
        return image
    held_out = sorted((int(s), float(v)) for s, v in validation if 1 <= s <= len(losses))
    values = [*losses, *(v for _, v in held_out)]
    low, high = float(np.min(values)), float(np.max(values))
    smooth = moving_average(list(losses), window)
    if len(losses) > 1:
        draw.line(chart_points(losses, width, height, low, high), fill=RAW, width=1)
        draw.line(chart_points(smooth, width, height, low, high), fill=SMOOTH, width=3)
    if held_out:
        points = validation_points(held_out, len(losses), width, height, low, high)
        if len(points) > 1:
            draw.line(points, fill=VALIDATION, width=2)
        for x, y in points:
            draw.rectangle([x - MARKER, y - MARKER, x + MARKER, y + MARKER], fill=VALIDATION)
        draw_legend(draw, width, [("train", RAW), ("smoothed", SMOOTH), ("validation", VALIDATION)])
    draw.text(
        (4, 4), f"loss {losses[0]:.4f} -> {losses[-1]:.4f}  ({len(losses)} steps)", fill=(230, 230, 230)
    )
    draw.text((4, height - 16), f"min {low:.4f}  max {high:.4f}", fill=(180, 180, 180))
    return image


def draw_legend(draw: ImageDraw.ImageDraw, width: int, entries: list[tuple[str, tuple]]) -> None:
    """A short line in each curve's colour and its name, right-aligned with the plot."""
    x = width - MARGIN
    for name, color in reversed(entries):
        x -= draw.textlength(name)
        draw.text((x, LEGEND_Y), name, fill=color)
        x -= 16
        draw.line([(x, LEGEND_Y + 5), (x + 12, LEGEND_Y + 5)], fill=color, width=2)
        x -= 10
