"""Learning-rate multipliers against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from trainer_core.schedule import lr_multiplier


def test_warmup_rises_linearly_then_constant():
    assert [lr_multiplier(s, 10, 4, "constant") for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decays_to_the_floor_on_the_last_step():
    # total 6, warmup 2: decay over steps 2..5 (3 intervals): 1, 2/3, 1/3, 0
    values = [lr_multiplier(s, 6, 2, "linear") for s in range(6)]
    assert values[:2] == [0.5, 1.0]
    assert values[2:] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])


def test_cosine_by_hand():
    # no warmup, total 5: progress 0, 1/4, 1/2, 3/4, 1 -> 0.5 (1 + cos(pi p))
    expected = [0.5 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75, 1)]
    assert [lr_multiplier(s, 5, 0, "cosine") for s in range(5)] == pytest.approx(expected)
    assert lr_multiplier(4, 5, 0, "cosine", floor=0.1) == pytest.approx(0.1)


def test_unknown_schedule():
    with pytest.raises(ValueError, match=r"'step'.*constant, cosine, linear"):
        lr_multiplier(0, 10, 0, "step")
