"""Where one LoRA name's files go, and the leftovers a crash can leave there.

The LoRA at `<loras>/<stem>.safetensors` with its loss chart beside it; its checkpoints under
`<checkpoints root>/<stem>/<run date-time>/step_NNNNNN/` (see `checkpoint`).
"""

from __future__ import annotations

import glob
import shutil
from dataclasses import dataclass
from pathlib import Path

from .names import LOSS_CHART_SUFFIX, SUFFIX


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
        for name in (paths.lora.name, paths.loss_chart.name)
        for p in paths.loras_dir.glob(f".{glob.escape(name)}.*.partial")
    ]
    if paths.checkpoints.is_dir():
        folders = [paths.checkpoints, *(p for p in paths.checkpoints.iterdir() if p.is_dir())]
        stale += [p for f in folders for p in f.iterdir() if p.name.endswith((".partial", ".old"))]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return stale
