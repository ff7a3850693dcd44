"""The progress the node reports: bias-corrected smoothed loss and an ETA that counts the
previews and checkpoints still to come (a user saw 34 s announced and waited ~100 s)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def job(pack_import):
    return pack_import("nodes.training_job")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(job, number, total, seconds=1.0, loss=1.0):
    from trainer_core.loop import StepInfo

    return StepInfo(number, total, loss, 1e-4, seconds)


def test_eta_counts_the_previews_and_checkpoints_to_come(job):
    clock = FakeClock()
    tracker = job.ProgressTracker(10, clock=clock)
    tracker.recurring("preview", 3, at_end=True)  # previews after steps 3, 6, 9 and at the end
    tracker.recurring("checkpoint", 4, at_end=True)  # checkpoints after steps 4, 8 and at the end
    for number in (1, 2, 3):
        progress = tracker.update(step(job, number, 10))
    assert progress.eta_seconds == pytest.approx(7 * 1.0)  # no preview measured yet
    with tracker.timed("preview"):
        clock.now += 5.0
    # by hand: 7 steps of 1 s + previews at 6, 9 and the end (3 x 5 s); no checkpoint timed yet
    assert tracker.progress.eta_seconds == pytest.approx(7 + 15)
    progress = tracker.update(step(job, 4, 10))
    with tracker.timed("checkpoint"):
        clock.now += 2.0
    # after step 4: 6 steps, previews at 6, 9, end (15 s), checkpoints at 8 and end (2 x 2 s)
    assert tracker.progress.eta_seconds == pytest.approx(6 + 15 + 4)
    for number in range(5, 11):
        progress = tracker.update(step(job, number, 10))
    assert progress.eta_seconds == pytest.approx(5.0 + 2.0)  # only the final preview and checkpoint
    with tracker.timed("checkpoint"):
        clock.now += 2.0
    with tracker.timed("preview"):
        clock.now += 5.0
    assert tracker.progress.eta_seconds == pytest.approx(0.0)


def test_due_counts_by_hand(job):
    tracker = job.ProgressTracker(100)
    tracker.recurring("preview", 25, at_end=True)
    tracker.recurring("other", 30, at_end=False)
    assert [tracker.due("preview", s) for s in (0, 24, 25, 74, 75, 99, 100)] == [4, 4, 3, 2, 1, 1, 1]
    assert [tracker.due("other", s) for s in (0, 29, 30, 90, 99)] == [3, 3, 2, 0, 0]


def test_smoothed_loss_is_the_bias_corrected_average(job):
    tracker = job.ProgressTracker(3)
    values = [4.0, 2.0, 1.0]
    smoothed = [tracker.update(step(job, i + 1, 3, loss=v)).smoothed_loss for i, v in enumerate(values)]
    # by hand: ema_k = 0.9 ema_{k-1} + 0.1 x_k from 0, divided by 1 - 0.9^k
    assert smoothed[0] == pytest.approx(4.0)
    assert smoothed[1] == pytest.approx((0.9 * 0.4 + 0.2) / (1 - 0.81))
    assert smoothed[2] == pytest.approx((0.9 * (0.9 * 0.4 + 0.2) + 0.1) / (1 - 0.729))
