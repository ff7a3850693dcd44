"""Where one LoRA name's files go, and the leftovers a crash can leave there.

The LoRA at `<loras>/<stem>.safetensors` with its loss chart beside it; its per-step snapshots
(the LoRA at each `save_every` step, in the save precision) in `<loras>/<stem>_steps/`; its
checkpoints under `<checkpoints root>/<stem>/<run date-time>/step_NNNNNN/` (see `checkpoint`).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .atomic import PROBE_NAME
from .names import LOSS_CHART_SUFFIX, SUFFIX, snapshot_folder_name, snapshot_name


@dataclass(frozen=True)
class LoraPaths:
    loras_dir: Path  # models/loras: the LoRA file and its loss chart
    checkpoints_root: Path  # output/kontext_trainer_checkpoints: every name's checkpoints
    stem: str

    @property
    def lora(self) -> Path:
        return self.loras_dir / f"{self.stem}{SUFFIX}"

    @property
    def loss_chart(self) -> Path:
        return self.loras_dir / f"{self.stem}{LOSS_CHART_SUFFIX}"

    @property
    def snapshots(self) -> Path:
        return self.loras_dir / snapshot_folder_name(self.stem)

    def snapshot(self, step: int) -> Path:
        return self.snapshots / snapshot_name(self.stem, step)

    @property
    def checkpoints(self) -> Path:
        return self.checkpoints_root / self.stem

    def checkpoint_choice(self, checkpoint: Path) -> str:
        """How a checkpoint appears in TrainLoRA's resume_from list."""
        return checkpoint.relative_to(self.checkpoints_root).as_posix()


def remove_stale_partials(paths: LoraPaths) -> list[Path]:
    """Temp files, staging folders and replaced checkpoints a crash left behind for this LoRA
    name (never visible under a real name, but they take space)."""
    stale = [
        p
        for name in (paths.lora.name, paths.loss_chart.name, PROBE_NAME)  # also a killed folder probe
        for p in paths.loras_dir.glob(f".{glob.escape(name)}.*.partial")
    ]
    if paths.snapshots.is_dir():
        stale += list(paths.snapshots.glob(".*.partial"))
    if paths.checkpoints.is_dir():
        folders = [paths.checkpoints, *(p for p in paths.checkpoints.iterdir() if p.is_dir())]
        stale += [p for f in folders for p in f.iterdir() if p.name.endswith((".partial", ".old"))]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return stale


REPLACED = "replaced_"  # <name>_steps/replaced_<date-time>/: an earlier run's snapshots, set aside


def set_aside_snapshots(paths: LoraPaths, before: float | None = None) -> Path | None:
    """Move the snapshots an earlier run of the name left in `<name>_steps/` into a folder of
    their own there, `replaced_<date-time>/` (a new run replacing that run starts writing
    its own): they stay until the new run has saved the LoRA that replaces them
    (`drop_replaced_snapshots`), so a failed or cancelled run loses none. `before`: only
    snapshots written before that time (a run of the name training meanwhile keeps its own).
    None: nothing to set aside."""
    earlier = {
        step: path
        for step, path in snapshot_steps(paths).items()
        if before is None or path.stat().st_mtime < before
    }
    if not earlier:
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    aside = paths.snapshots / f"{REPLACED}{stamp}"
    while aside.exists():
        aside, n = paths.snapshots / f"{REPLACED}{stamp}-{n}", n + 1
    aside.mkdir()
    for path in earlier.values():
        os.replace(path, aside / path.name)
    return aside


def replaced_snapshots(paths: LoraPaths) -> list[Path]:
    """The folders of snapshots set aside for this name (`set_aside_snapshots`)."""
    if not paths.snapshots.is_dir():
        return []
    return sorted(p for p in paths.snapshots.iterdir() if p.is_dir() and p.name.startswith(REPLACED))


def drop_replaced_snapshots(
    paths: LoraPaths, before: float | None = None, own: Path | None = None
) -> list[Path]:
    """Delete the snapshots set aside for this name: a run of it has saved its LoRA. `before`:
    only those set aside before that time (the run's start), and `own` (what the run set
    aside itself): a run of the name started meanwhile keeps what it set aside."""
    folders = [
        f
        for f in replaced_snapshots(paths)
        if before is None or f.stat().st_mtime < before or (own is not None and f == own)
    ]
    for folder in folders:
        shutil.rmtree(folder)
    return folders


def snapshot_steps(paths: LoraPaths) -> dict[int, Path]:
    """The per-step snapshots written for this LoRA name: step -> file."""
    if not paths.snapshots.is_dir():
        return {}
    pattern = re.compile(re.escape(paths.stem) + r"-step(\d{8,})" + re.escape(SUFFIX))
    found = (pattern.fullmatch(p.name) for p in paths.snapshots.iterdir() if p.is_file())
    return {int(m.group(1)): paths.snapshots / m.group(0) for m in found if m}
