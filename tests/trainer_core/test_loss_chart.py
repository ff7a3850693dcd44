"""The loss chart's geometry and drawing, against values worked out by hand."""

from __future__ import annotations

import numpy as np

from trainer_core.loss_chart import MARGIN, SMOOTH, chart_points, draw_loss_chart, moving_average


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
