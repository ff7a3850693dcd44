"""Learning-rate multipliers against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from trainer_core.schedule import lr_multiplier


def test_warmup_rises_linearly_then_constant():
    assert [lr_multiplier(s, 10, 4, "constant") for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_reaches_the_floor_after_the_last_step():
    # total 6, warmup 2: decay over the 4 steps 2..5, progress 0, 1/4, 2/4, 3/4 (4/4 would be
    # the step after the last)
    values = [lr_multiplier(s, 6, 2, "linear") for s in range(6)]
    assert values[:2] == [0.5, 1.0]
    assert values[2:] == pytest.approx([1.0, 0.75, 0.5, 0.25])
    assert lr_multiplier(6, 6, 2, "linear") == 0.0  # where it would be one step later


def test_cosine_by_hand():
    # no warmup, total 4: progress 0, 1/4, 1/2, 3/4 -> 0.5 (1 + cos(pi p)); the last step is not 0
    expected = [0.5 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75)]
    assert [lr_multiplier(s, 4, 0, "cosine") for s in range(4)] == pytest.approx(expected)
    assert lr_multiplier(3, 4, 0, "cosine") > 0.1


def test_floor_by_hand():
    # floor 0.1, total 4: linear 1 - 0.9 p; cosine 0.1 + 0.9 * 0.5 (1 + cos(pi p))
    assert [lr_multiplier(s, 4, 0, "linear", 0.1) for s in range(4)] == pytest.approx(
        [1.0, 0.775, 0.55, 0.325]
    )
    cosine = [0.1 + 0.45 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75)]
    assert [lr_multiplier(s, 4, 0, "cosine", 0.1) for s in range(4)] == pytest.approx(cosine)
    assert lr_multiplier(4, 4, 0, "cosine", 0.1) == pytest.approx(0.1)


def test_a_one_step_run_trains():
    for schedule in ("linear", "cosine"):
        assert lr_multiplier(0, 1, 0, schedule) == 1.0


def test_unknown_schedule():
    with pytest.raises(ValueError, match=r"'step'.*constant, cosine, linear"):
        lr_multiplier(0, 10, 0, "step")
