"""Running the headless command (`tests/kt_testing/headless_tiny.py`: `python -m trainer_core`
with the tiny test models) as a user runs it: a config file, a subprocess, its output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r"^\[[#.]+\] \d+/\d+  loss ")  # a progress bar line of the command
TINY_COMMAND = REPO / "tests" / "kt_testing" / "headless_tiny.py"
# small and quick; every value is a TrainLoRA / LoadKontextDataset one
TRAIN = {"steps": 6, "rank": 2, "alpha": 2.0, "learning_rate": 1e-3, "gradient_checkpointing": False}
DATASET = {"resolution": 128, "reference_resolution": 128, "min_size": 0}
# what the command prints once ComfyUI's runtime is up (comfy_boot.loading_mode), before any model
BOOT_LINE = "[kontext-trainer] dynamic VRAM "


def refused_before_the_boot(result) -> bool:
    """The command ended before ComfyUI's runtime booted, so before any model loaded (a refusal
    there takes 2-3 s with the tiny models on 0.33; after the boot it took 8-10 s, and after the
    model load minutes for a real Flux)."""
    return BOOT_LINE not in result.stdout and "loading the model files" not in result.stdout


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for what these tests write
    return repr(value)


def write_config(
    path: Path,
    base: Path,
    dataset: Path,
    cache: Path,
    train: dict,
    create_base=True,
    comfyui: dict | None = None,
    **dataset_changes,
) -> Path:
    """A run config written by hand (not by the code under test), for the ComfyUI base directory
    `base` (made here, as a user's exists, unless `create_base` is off); `comfyui`: more keys
    of its [comfyui] section."""
    if create_base:
        Path(base).mkdir(parents=True, exist_ok=True)
    sections = {
        "comfyui": {"base_directory": str(base), **(comfyui or {})},
        "model": {
            "diffusion_model": "tiny.safetensors",
            "vae": "tiny.safetensors",
            "text_encoders": ["tiny"],
        },
        "dataset": {"path": str(dataset), "cache_folder": str(cache), **DATASET, **dataset_changes},
        "train": {**TRAIN, **train},
    }
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            text = (
                "[" + ", ".join(map(toml_value, value)) + "]"
                if isinstance(value, list)
                else toml_value(value)
            )
            lines.append(f"{key} = {text}")
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def environment() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, str(TINY_COMMAND), "train", "--config", str(config), "--cpu", *extra]


def torchrun(config: Path, nproc: int, *launcher: str) -> list[str]:
    """torchrun starting `nproc` processes of the command; `launcher`: its rendezvous options
    (e.g. --standalone, or --nnodes/--node_rank/--master_addr/--master_port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        *launcher,
        str(TINY_COMMAND),
        "train",
        "--config",
        str(config),
        "--cpu",
    ]


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=timeout, check=False
    )


def checkpoints(base: Path, name: str) -> list[Path]:
    """Every checkpoint of `name` under the base directory, oldest run and step first."""
    root = base / "output" / "kontext_trainer_checkpoints" / name
    return sorted(root.glob("*/step_*"))


def final_state(checkpoint: Path) -> tuple[list[float], dict]:
    """(losses, LoRA tensors in float32) of a checkpoint."""
    state = json.loads((checkpoint / "state.json").read_text())
    return state["losses"], load_file(str(checkpoint / "lora.safetensors"))
