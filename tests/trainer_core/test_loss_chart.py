"""The loss chart's geometry and drawing, against values worked out by hand."""

from __future__ import annotations

import numpy as np

from trainer_core.loss_chart import (
    BACKGROUND,
    GRID,
    MARGIN,
    MARKER,
    RAW,
    SMOOTH,
    VALIDATION,
    chart_points,
    draw_loss_chart,
    moving_average,
    validation_points,
)


def test_moving_average_by_hand():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_points_span_the_plot():
    # 512 x 256: plot 432 x 176 inside a 40 px margin; the highest loss at the top edge
    points = chart_points([2.0, 1.0, 0.0], 512, 256, 0.0, 2.0)
    assert points == [(40.0, 40.0), (256.0, 128.0), (472.0, 216.0)]


def test_the_smoothed_line_is_drawn_where_the_points_say():
    losses = [4.0, 4.0, 4.0, 0.0, 0.0, 0.0]
    image = np.asarray(draw_loss_chart(losses, window=1))
    assert image.shape == (256, 512, 3)
    # window 1: the smooth line is the losses; the first point (loss 4, the max) is top left
    x, y = chart_points(losses, 512, 256, 0.0, 4.0)[1]
    assert tuple(image[int(y), int(x)]) == SMOOTH
    assert tuple(image[256 - MARGIN, 512 - MARGIN - 1]) == SMOOTH  # last point: bottom right


def test_empty_history_still_draws():
    assert draw_loss_chart([]).size == (512, 256)


def is_color(image, color):
    return np.all(image == np.array(color, dtype=np.uint8), axis=-1)


NINE_STEPS = [4.0, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.25, 0.0]  # losses of steps 1..9, range [0, 4]


def test_validation_points_by_hand():
    # 9 steps over the 432 px plot: 54 px a step; step s at x = 40 + 54 (s - 1)
    points = validation_points([(3, 5.0), (7, 0.0)], 9, 512, 256, 0.0, 5.0)
    assert points == [(148.0, 40.0), (364.0, 216.0)]


def test_validation_squares_sit_at_their_steps_and_widen_the_range():
    """Two held-out losses of 5.0 (above every training loss) after steps 3 and 7: the range
    becomes [0, 5], so both squares sit on the plot's top edge (y 40) at x 148 and 364, joined
    by a line; nothing else in the plot has the validation colour."""
    image = np.asarray(draw_loss_chart(NINE_STEPS, [(3, 5.0), (7, 5.0)], window=1))
    plot = is_color(image, VALIDATION)
    plot[: MARGIN - MARKER] = False  # the legend's row (checked below)
    rows, columns = np.nonzero(plot)
    assert (columns.min(), columns.max()) == (148 - MARKER, 364 + MARKER)
    assert (rows.min(), rows.max()) == (40 - MARKER, 40 + MARKER)
    # the squares' bottom row (below the 2 px line) holds exactly the two squares
    bottom = np.nonzero(plot[40 + MARKER])[0].tolist()
    assert bottom == [*range(145, 152), *range(361, 368)]
    # the training curve was rescaled to [0, 5]: step 1 (loss 4) at y = 40 + (1 - 4/5) * 176
    # (75.2), not on the top edge where the range [0, 4] of the losses alone would put it
    assert tuple(image[75, 41]) == SMOOTH and tuple(image[40, 41]) == GRID
    # the legend names the three curves, a line of each colour in its row
    legend = image[MARGIN - 24 : MARGIN - MARKER - 1]
    for color in (RAW, SMOOTH, VALIDATION):
        assert is_color(legend, color).any(), color


def test_validation_below_the_losses_reaches_the_bottom_corner():
    image = np.asarray(draw_loss_chart(NINE_STEPS, [(1, 4.0), (9, -1.0)], window=1))
    # range [-1, 4]: step 1 / loss 4 top left (40, 40), step 9 / loss -1 bottom right (472, 216)
    for x, y in [(40, 40), (472, 216)]:
        for dx, dy in [(-MARKER, -MARKER), (MARKER, -MARKER), (-MARKER, MARKER), (MARKER, MARKER)]:
            assert tuple(image[y + dy, x + dx]) == VALIDATION, (x + dx, y + dy)
    assert tuple(image[216 + MARKER + 1, 472]) != VALIDATION
    assert tuple(image[216, 472 + MARKER + 1]) != VALIDATION


def test_without_validation_nothing_changes():
    """No validation colour, no legend; points beyond the last step are left out, so they do
    not change the chart either."""
    plain = np.asarray(draw_loss_chart(NINE_STEPS))
    assert not is_color(plain, VALIDATION).any()
    legend_row = plain[MARGIN - 24 : MARGIN - MARKER - 1, 300 : 512 - MARGIN]
    assert (is_color(legend_row, BACKGROUND) | is_color(legend_row, GRID)).all()
    beyond = np.asarray(draw_loss_chart(NINE_STEPS, [(10, 9.0), (0, 9.0)]))
    assert np.array_equal(beyond, plain)
    assert np.array_equal(np.asarray(draw_loss_chart(NINE_STEPS, ())), plain)
