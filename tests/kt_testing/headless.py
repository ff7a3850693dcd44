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

from comfy_server import CPU_ATTENTION_FLAGS

REPO = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r"^\[[#.]+\] \d+/\d+  loss ")  # a progress bar line of the command
TINY_COMMAND = REPO / "tests" / "kt_testing" / "headless_tiny.py"
# small and quick; every value is a TrainLoRA / LoadKontextDataset one
TRAIN = {"steps": 6, "rank": 2, "alpha": 2.0, "learning_rate": 1e-3, "gradient_checkpointing": False}
DATASET = {"resolution": 128, "reference_resolution": 128, "min_size": 0}
# Every random draw a step makes belongs to the global sample (issue 32: with LoRA dropout on, 2
# processes x batch 1 and 1 process x batch 2 differed by 6 x the learning rate): LoRA dropout's
# masks, caption and reference dropout, input-noise gamma, besides each sample's timestep and noise
DRAWS = {"dropout": 0.1, "caption_dropout": 0.3, "reference_dropout": 0.3, "ip_noise_gamma": 0.1}
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


def with_cpu_attention(extra: tuple[str, ...] | list[str]) -> list[str]:
    """The command's arguments `extra` with ComfyUI's NVIDIA attention among the flags it hands
    ComfyUI (after `--`; scripts/comfy_server.py CPU_ATTENTION_FLAGS says why)."""
    extra = list(extra)
    if "--" not in extra:
        return [*extra, "--", *CPU_ATTENTION_FLAGS]
    at = extra.index("--") + 1
    return [*extra[:at], *CPU_ATTENTION_FLAGS, *extra[at:]]


def command(config: Path, *extra: str, cpu_attention: bool = True) -> list[str]:
    """The command on `config` with `extra` arguments; `cpu_attention` off: without
    CPU_ATTENTION_FLAGS (a test of the flags the command is given)."""
    return [
        sys.executable,
        str(TINY_COMMAND),
        "train",
        "--config",
        str(config),
        "--cpu",
        *(with_cpu_attention(extra) if cpu_attention else extra),
    ]


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
        *with_cpu_attention([]),
    ]


def run(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`args` run to the end; `env`: variables beside `environment()`'s."""
    return subprocess.run(
        args,
        cwd=REPO,
        env={**environment(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def checkpoints(base: Path, name: str) -> list[Path]:
    """Every checkpoint of `name` under the base directory, oldest run and step first."""
    root = base / "output" / "kontext_trainer_checkpoints" / name
    return sorted(root.glob("*/step_*"))


def final_state(checkpoint: Path) -> tuple[list[float], dict]:
    """(losses, LoRA tensors in float32) of a checkpoint."""
    state = json.loads((checkpoint / "state.json").read_text())
    return state["losses"], load_file(str(checkpoint / "lora.safetensors"))


def assert_same_run(base: Path, name: str, single: tuple[list[float], dict], steps: int) -> None:
    """The last checkpoint of run `name` holds `single`'s losses and LoRA (`final_state` of the
    one-process run), to float32 rounding, after `steps` steps that changed the LoRA."""
    import pytest
    import torch

    losses, lora = final_state(checkpoints(base, name)[-1])
    expected_losses, expected_lora = single
    assert len(losses) == steps
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert lora.keys() == expected_lora.keys()
    for key, value in expected_lora.items():
        torch.testing.assert_close(lora[key], value, rtol=1e-4, atol=1e-5)
    # the update did something: the trained up-projections are no longer zero
    assert any(float(v.abs().max()) > 0 for k, v in lora.items() if k.endswith("lora_up.weight"))


def global_batch_run(files, env: dict, name: str = "single", batch_size: int = 2):
    """One process training the global batch (`files.config(name, batch_size=...)`, the
    command with `env`), to compare a torchrun run with: its output and final state."""
    result = run(command(files.config(name, batch_size=batch_size)), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, final_state(checkpoints(files.base, name)[-1])
