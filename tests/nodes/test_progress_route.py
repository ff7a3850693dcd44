"""The progress route as ComfyUI loaded the pack: the node modules share trainer_core's one job
manager, and the state a reloaded page reads holds the losses after `since` and every
validation point."""

from __future__ import annotations

import json
import threading


def test_the_run_service_and_the_route_share_the_core_job_manager(pack_import):
    core = pack_import("trainer_core.job")
    assert pack_import("application.run_service").MANAGER is core.MANAGER
    assert pack_import("nodes.progress_route").MANAGER is core.MANAGER


def test_state_after_a_reload_has_the_validation_points(pack_import):
    route = pack_import("nodes.progress_route")
    manager = pack_import("trainer_core.job").MANAGER
    release = threading.Event()

    def target(job):
        for loss in (4.0, 3.0, 2.0, 1.0):
            job.record_loss(loss)
        job.record_validation(2, 2.5)
        job.record_validation(4, 1.5)
        job.report(status="running", step=4, total=10)
        release.wait(30)

    job = manager.start("kt_route", target, meta={"node": "5", "prompt_id": "p1"})
    try:
        while job.running and job.snapshot().step < 4:
            job.thread.join(0.01)
        state = json.loads(json.dumps(route.progress_state(since=3)))
        assert state["losses"] == [1.0] and state["losses_from"] == 3
        assert state["validation"] == [[2, 2.5], [4, 1.5]]  # all of them, whatever `since`
        assert (state["validation_step"], state["validation_loss"]) == (4, 1.5)
        assert (state["node"], state["prompt_id"], state["status"]) == ("5", "p1", "running")
    finally:
        release.set()
        job.thread.join()
