"""The training job lives in `trainer_core.job` (it needs no ComfyUI); re-exported here for the
node modules that import it from `nodes`."""

from __future__ import annotations

from ..trainer_core.job import MANAGER, JobManager, Progress, ProgressTracker, TrainingJob, wait_for

__all__ = ["MANAGER", "JobManager", "Progress", "ProgressTracker", "TrainingJob", "wait_for"]
