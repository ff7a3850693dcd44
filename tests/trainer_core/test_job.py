"""The training job without ComfyUI: the progress it reports (bias-corrected smoothed loss, an
ETA that counts the previews and checkpoints to come: a user saw 34 s announced and waited
~100 s), the held-out validation points, and the wait that relays Cancel."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading

import pytest

from trainer_core.job import Progress, ProgressTracker, TrainingJob, wait_for
from trainer_core.loop import StepInfo


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(number, total, seconds=1.0, loss=1.0):
    return StepInfo(number, total, loss, 1e-4, seconds)


def test_eta_counts_the_previews_and_checkpoints_to_come():
    clock = FakeClock()
    tracker = ProgressTracker(10, clock=clock)
    tracker.recurring("preview", 3, at_end=True)  # previews after steps 3, 6, 9 and at the end
    tracker.recurring("checkpoint", 4, at_end=True)  # checkpoints after steps 4, 8 and at the end
    for number in (1, 2, 3):
        progress = tracker.update(step(number, 10))
    assert progress.eta_seconds == pytest.approx(7 * 1.0)  # no preview measured yet
    with tracker.timed("preview"):
        clock.now += 5.0
    # by hand: 7 steps of 1 s + previews at 6, 9 and the end (3 x 5 s); no checkpoint timed yet
    assert tracker.progress.eta_seconds == pytest.approx(7 + 15)
    progress = tracker.update(step(4, 10))
    with tracker.timed("checkpoint"):
        clock.now += 2.0
    # after step 4: 6 steps, previews at 6, 9, end (15 s), checkpoints at 8 and end (2 x 2 s)
    assert tracker.progress.eta_seconds == pytest.approx(6 + 15 + 4)
    for number in range(5, 11):
        progress = tracker.update(step(number, 10))
    assert progress.eta_seconds == pytest.approx(5.0 + 2.0)  # only the final preview and checkpoint
    with tracker.timed("checkpoint"):
        clock.now += 2.0
    with tracker.timed("preview"):
        clock.now += 5.0
    assert tracker.progress.eta_seconds == pytest.approx(0.0)


def test_due_counts_by_hand():
    tracker = ProgressTracker(100)
    tracker.recurring("preview", 25, at_end=True)
    tracker.recurring("other", 30, at_end=False)
    assert [tracker.due("preview", s) for s in (0, 24, 25, 74, 75, 99, 100)] == [4, 4, 3, 2, 1, 1, 1]
    assert [tracker.due("other", s) for s in (0, 29, 30, 90, 99)] == [3, 3, 2, 0, 0]


def test_smoothed_loss_is_the_bias_corrected_average():
    tracker = ProgressTracker(3)
    values = [4.0, 2.0, 1.0]
    smoothed = [tracker.update(step(i + 1, 3, loss=v)).smoothed_loss for i, v in enumerate(values)]
    # by hand: ema_k = 0.9 ema_{k-1} + 0.1 x_k from 0, divided by 1 - 0.9^k
    assert smoothed[0] == pytest.approx(4.0)
    assert smoothed[1] == pytest.approx((0.9 * 0.4 + 0.2) / (1 - 0.81))
    assert smoothed[2] == pytest.approx((0.9 * (0.9 * 0.4 + 0.2) + 0.1) / (1 - 0.729))


def test_progress_has_no_validation_until_one_is_recorded():
    progress = Progress()
    assert progress.validation_loss is None and progress.validation_step is None
    job = TrainingJob("kt", lambda job: None)
    tracker = ProgressTracker(4)
    job.report(tracker.update(step(1, 4)))
    assert job.snapshot().validation_step is None
    assert job.state()["validation"] == []


def test_tracker_keeps_validation_fields_on_later_steps():
    tracker = ProgressTracker(4)
    tracker.update(step(1, 4, loss=2.0))
    tracker.progress = dataclasses.replace(tracker.progress, validation_loss=0.5, validation_step=1)
    later = tracker.update(step(2, 4, loss=1.5))
    assert (later.step, later.loss, later.validation_step, later.validation_loss) == (2, 1.5, 1, 0.5)


def test_a_validation_point_rides_on_every_later_progress():
    """The training thread reports the tracker's progress after every step (which knows
    nothing of validation): the job's latest point stays on it until the next one."""
    job = TrainingJob("kt", lambda job: None)
    tracker = ProgressTracker(6)
    for number in (1, 2):
        job.record_loss(1.0)
        job.report(tracker.update(step(number, 6)))
    job.record_validation(2, 0.75)
    assert (job.snapshot().validation_step, job.snapshot().validation_loss) == (2, 0.75)
    assert job.snapshot().step == 2  # only the validation fields changed
    for number in (3, 4):
        job.report(tracker.update(step(number, 6)))
        assert (job.snapshot().step, job.snapshot().validation_step) == (number, 2)
    job.record_validation(4, 0.5)
    job.report(status="cancelled", message="stopped")  # a status report keeps it too
    final = job.snapshot()
    assert (final.status, final.step) == ("cancelled", 4)
    assert (final.validation_step, final.validation_loss) == (4, 0.5)
    assert job.validation == [(2, 0.75), (4, 0.5)]


def test_state_holds_every_validation_point_as_json():
    job = TrainingJob("kt", lambda job: None, meta={"node": "5", "prompt_id": "p"})
    for loss in (3.0, 2.0, 1.0):
        job.record_loss(loss)
    # a resumed run records its earlier points again at the start, then its own
    for point in [(1, 2.5), (2, 1.75), (3, 1.25)]:
        job.record_validation(*point)
    state = json.loads(json.dumps(job.state()))  # what the route serves
    assert state["validation"] == [[1, 2.5], [2, 1.75], [3, 1.25]]
    assert state["validation_step"] == 3 and state["validation_loss"] == 1.25
    assert state["losses"] == [3.0, 2.0, 1.0] and state["node"] == "5"
    state["validation"].append([9, 9.0])  # a copy: the job's own list is untouched
    assert len(job.state()["validation"]) == 3


def test_record_validation_is_thread_safe():
    job = TrainingJob("kt", lambda job: None)
    per_thread, threads = 500, 4

    def record(offset):
        for i in range(per_thread):
            job.record_validation(offset + i, float(i))
            job.state()  # readers at the same time (the progress route)

    workers = [threading.Thread(target=record, args=(k * per_thread,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert sorted(s for s, _ in job.validation) == list(range(per_thread * threads))


def test_wait_for_relays_a_cancel_and_the_final_progress():
    """The host's interrupt check raises: the job is asked to stop, finishes its step, and the
    last progress (cancelled, with its validation point) still reaches on_poll."""
    started = threading.Event()

    def target(job):
        job.record_validation(1, 0.5)
        job.report(status="running", step=1, total=100)
        started.set()
        job.stop_requested.wait(30)
        job.report(status="cancelled")
        return "stopped"

    class Cancelled(Exception):
        pass

    def check_interrupt():
        if started.is_set():
            raise Cancelled

    seen: list[Progress] = []
    job = TrainingJob("kt", target)
    job.thread.start()
    with pytest.raises(Cancelled):
        wait_for(job, seen.append, check_interrupt, poll_seconds=0.01)
    assert not job.running and job.result == "stopped"
    assert (seen[-1].status, seen[-1].validation_step, seen[-1].validation_loss) == ("cancelled", 1, 0.5)


def test_wait_for_reraises_the_training_error():
    def target(job):
        raise ValueError("boom")

    job = TrainingJob("kt", target)
    job.thread.start()
    seen: list[Progress] = []
    with pytest.raises(ValueError, match="boom"):
        wait_for(job, seen.append, lambda: None, poll_seconds=0.01)
    assert seen[-1].status == "error" and seen[-1].message == "boom"


@pytest.mark.parametrize("fails", [False, True])
def test_a_finished_job_keeps_nothing_of_its_run(fails):
    """The manager keeps the last job until the next one starts: it must not keep what the run
    used (the MODEL, the dataset), through its target or an error's traceback."""
    import gc
    import weakref

    class Model:
        pass

    model = Model()
    alive = weakref.ref(model)

    def run(job, model=model):
        if fails:
            raise ValueError("bad sample")
        return "done"

    job = TrainingJob("kt", run)
    del run, model
    job.thread.start()
    if fails:
        with pytest.raises(ValueError, match="bad sample"):
            wait_for(job, lambda progress: None, lambda: None, poll_seconds=0.01)
    else:
        assert wait_for(job, lambda progress: None, lambda: None, poll_seconds=0.01) == "done"
    gc.collect()
    assert alive() is None


def test_a_resumed_runs_smoothed_loss_continues_the_uninterrupted_one():
    """Issue 33: after a resume the average restarted from the first new loss (1.6993 against
    1.8176 uninterrupted) while the chart's curve continued."""
    losses = [3.0, 2.5, 2.75, 1.5, 1.25, 2.0]
    whole = ProgressTracker(6)
    expected = [whole.update(step(i + 1, 6, loss=v)).smoothed_loss for i, v in enumerate(losses)]
    resumed = ProgressTracker(6, start_step=3, earlier_losses=losses[:3])
    got = [resumed.update(step(i + 1, 6, loss=v)).smoothed_loss for i, v in enumerate(losses) if i >= 3]
    assert got == pytest.approx(expected[3:], rel=1e-12)
    assert got[0] != pytest.approx(ProgressTracker(6).update(step(4, 6, loss=1.5)).smoothed_loss)


def test_the_eta_does_not_jump_when_the_first_preview_or_validation_is_timed():
    """Before a recurring task is measured, it counts as its forward passes at a third of a
    step each; a preview that takes just that leaves the ETA where it was."""
    clock = FakeClock()
    tracker = ProgressTracker(12, clock=clock)
    tracker.recurring("preview", 4, at_end=True, forwards=6)  # 6 forwards: 2 s at 1 s per step
    tracker.recurring("validation", 6, at_end=True, forwards=3)  # 1 s
    etas = []
    for number in range(1, 13):
        etas.append(tracker.update(step(number, 12)).eta_seconds)
        if number % 6 == 0:
            with tracker.timed("validation"):
                clock.now += 1.0
            etas.append(tracker.progress.eta_seconds)
        if number % 4 == 0:
            with tracker.timed("preview"):
                clock.now += 2.0
            etas.append(tracker.progress.eta_seconds)
    # by hand after step 1: 11 steps, previews after 4, 8 and the end (3 x 2 s), validation
    # after 6 and the end (2 x 1 s)
    assert etas[0] == pytest.approx(11 + 6 + 2)
    assert all(later <= earlier + 1e-9 for earlier, later in itertools.pairwise(etas)), etas
