"""check_number: the shared check every node's numbers go through."""

from __future__ import annotations

import math

import pytest

from trainer_core.limits import check_number


@pytest.mark.parametrize(
    ("value", "minimum", "maximum"), [(0.0, 0.0, 30.0), (1, 0.0, 30.0), (30.0, 0.0, 30.0), (31, 1.0, None)]
)
def test_numbers_within_the_limits_pass(value, minimum, maximum):
    check_number("cfg", value, minimum, maximum)


@pytest.mark.parametrize(
    ("value", "minimum", "maximum", "message"),
    [
        (math.nan, 1.0, 30.0, "cfg is nan; give a finite number from 1.0 to 30.0"),
        (math.inf, None, None, "cfg is inf; give a finite number"),
        (0.5, 1.0, 30.0, "cfg is 0.5; give a number from 1.0 to 30.0"),
        (-2.0, 0.0, None, "cfg is -2.0; give a number of at least 0.0"),
        (40.0, None, 30.0, "cfg is 40.0; give a number of at most 30.0"),
        (True, 0.0, 30.0, "cfg must be a number from 0.0 to 30.0; got True"),
        (None, 0.0, 30.0, "cfg must be a number from 0.0 to 30.0; got None"),
    ],
)
def test_bad_numbers_are_named(value, minimum, maximum, message):
    with pytest.raises(ValueError) as caught:
        check_number("cfg", value, minimum, maximum)
    assert str(caught.value) == message
