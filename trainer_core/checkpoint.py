"""Training checkpoints: everything an exact resume needs, as safetensors and json only.

A checkpoint is a folder `step_000120/` holding
  lora.safetensors       the LoRA at that step in float32 (kohya keys and metadata: loadable on
                         its own, and exact for the resume)
  optimizer.safetensors  the optimizer's tensor state, flattened to `state.<param>.<name>`
  rng.safetensors        torch's global RNG (CPU, and CUDA if present) and the objective's generator
  state.json             step, losses, held-out validation losses, the config, optimizer param
                         groups and scalar state
It is written into a temporary sibling folder and renamed into place, so a crash leaves the
previous checkpoint and never a half-written one. `prune` keeps the newest K of one run.
Checkpoints are never written where ComfyUI looks for LoRAs: the node puts them under
`output/kontext_trainer_checkpoints/` (see application/training_run.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .atomic import ensure_folder, fsync_file, new_temp_folder, special_kind
from .lora_file import LoraModule, from_state_dict, load, save_atomic
from .lora_metadata import write_lora

STEP_FOLDER = re.compile(r"^step_(\d{6,})$")


@dataclass
class Checkpoint:
    path: Path
    step: int
    losses: list[float]
    config: dict
    lora: dict[str, LoraModule]
    optimizer_state: dict  # ready for `optimizer.load_state_dict`
    rng: dict[str, torch.Tensor]
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss)


def step_folder_name(step: int) -> str:
    return f"step_{step:06d}"


def _flatten_optimizer(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for param_id, values in state_dict["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"state.{param_id}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{param_id}.{name}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], extra: dict) -> dict:
    state: dict[int, dict] = {}
    for key, tensor in tensors.items():
        _, param_id, name = key.split(".", 2)
        state.setdefault(int(param_id), {})[name] = tensor
    for key, value in extra["scalars"].items():
        param_id, name = key.split(".", 1)
        state.setdefault(int(param_id), {})[name] = value
    return {"state": state, "param_groups": extra["param_groups"]}


def save_checkpoint(
    folder: Path,
    step: int,
    lora: dict[str, LoraModule],
    optimizer: torch.optim.Optimizer,
    rng: dict[str, torch.Tensor],
    losses: list[float],
    config: dict,
    lora_metadata: dict[str, str] | None = None,
    validation: list[tuple[int, float]] = (),
) -> Path:
    folder = Path(folder)
    ensure_folder(folder)
    final = folder / step_folder_name(step)
    staging = new_temp_folder(final)
    try:
        optimizer_tensors, optimizer_extra = _flatten_optimizer(optimizer.state_dict())
        write_lora(staging / "lora.safetensors", lora, lora_metadata or {}, torch.float32, time.time())
        save_atomic(optimizer_tensors, staging / "optimizer.safetensors")
        save_atomic({k: v.contiguous().cpu() for k, v in rng.items()}, staging / "rng.safetensors")
        state = {
            "step": step,
            "losses": losses,
            "validation": [[int(s), float(v)] for s, v in validation],
            "config": config,
            "optimizer": optimizer_extra,
        }
        (staging / "state.json").write_text(json.dumps(state), encoding="utf-8")
        fsync_file(staging / "state.json")
        if final.exists():
            retired = final.with_name(final.name + ".old")
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(final, retired)
            os.replace(staging, final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


TENSOR_FILES = ("lora.safetensors", "optimizer.safetensors", "rng.safetensors")


def read_state(path: Path) -> dict:
    """A checkpoint's state.json (step, losses, config): enough to check a resume before
    anything heavy is loaded. Names the folder and what is missing when it is incomplete
    (FileNotFoundError), the file and what is wrong when one is damaged (ValueError)."""
    path = Path(path)
    special = [f"{n} is {k}" for n in (*TENSOR_FILES, "state.json") if (k := special_kind(path / n))]
    if special:
        raise ValueError(f"{path}: not a checkpoint: {', '.join(special)}, not a file")
    missing = [name for name in (*TENSOR_FILES, "state.json") if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: not a complete checkpoint (missing {', '.join(missing)})")
    state_file = path / "state.json"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(_damaged(state_file, f"it is not readable JSON ({error})")) from None
    wanted = {"step": int, "losses": list, "config": dict, "optimizer": dict}
    wrong = [
        key
        for key, kind in wanted.items()
        if not isinstance(state, dict) or not isinstance(state.get(key), kind)
    ]
    if wrong:
        raise ValueError(_damaged(state_file, f"it lacks {', '.join(wrong)}"))
    for name in TENSOR_FILES:  # their headers (offsets checked against the file's size)
        try:
            with safe_open(str(path / name), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # safetensors raises its own error types for damaged files
            raise ValueError(
                _damaged(path / name, f"it is not a readable safetensors file ({error})")
            ) from None
    return state


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed (a missing or damaged file, named), or
    None. Reads state.json and the tensor files' headers only."""
    try:
        read_state(path)
    except (FileNotFoundError, ValueError) as error:
        return str(error)
    return None


def _damaged(file: Path, what: str) -> str:
    return f"{file}: {what}; the checkpoint is damaged: resume another one (or none)"


def _finite(file: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors`, or a ValueError naming the file and a tensor with NaN or infinite values (a
    run that diverged before it was saved must not go on from there)."""
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(_damaged(file, f"{key} holds NaN or infinite values"))
    return tensors


def _ordinary(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as ordinary (non-inference) tensors. ComfyUI runs nodes under
    `torch.inference_mode()`, where everything loaded is an inference tensor; an optimizer
    later updates its state in place outside that mode, which inference tensors refuse."""
    with torch.inference_mode(False):
        return {key: value.clone() if value.is_inference() else value for key, value in tensors.items()}


def load_checkpoint(path: Path, module_names: Sequence[str]) -> Checkpoint:
    """Everything a resume needs, as ordinary tensors whatever mode the caller is in.
    `module_names`: the model's Linear layers, whose kohya names the LoRA file holds."""
    path = Path(path)
    state = read_state(path)
    lora_tensors, optimizer_tensors, rng = (_read_tensors(path / name) for name in TENSOR_FILES)
    _finite(path / "lora.safetensors", lora_tensors)
    _finite(path / "optimizer.safetensors", optimizer_tensors)
    return Checkpoint(
        path,
        int(state["step"]),
        [float(x) for x in state["losses"]],
        state["config"],
        from_state_dict(_ordinary(lora_tensors), module_names),
        _unflatten_optimizer(_ordinary(optimizer_tensors), state["optimizer"]),
        _ordinary(rng),
        [(int(s), float(v)) for s, v in state.get("validation", [])],
    )


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load(file)[0]
    except Exception as error:  # a file damaged after its header was read
        raise ValueError(_damaged(file, f"it is not a readable safetensors file ({error})")) from None


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoint folders under `folder`, oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := STEP_FOLDER.match(p.name))
    ]
    return [p for _, p in sorted(found) if (p / "state.json").is_file()]


def new_run_folder(root: Path) -> Path:
    """A fresh folder for one training run's checkpoints, `root/<date-time>` (never reused, so
    unrelated runs under the same LoRA name never prune each other's checkpoints; a resumed
    run prunes those of the run it continues: `prune`)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    ensure_folder(root)
    candidate, n = Path(root) / stamp, 1
    while candidate.exists():
        candidate, n = Path(root) / f"{stamp}-{n}", n + 1
    candidate.mkdir(parents=True)
    return candidate


def all_checkpoints(root: Path) -> list[Path]:
    """Every complete checkpoint of every run under `root`, run by run, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    runs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [path for run in runs for path in list_checkpoints(run)]


def step_of(checkpoint: Path) -> int:
    return int(STEP_FOLDER.match(Path(checkpoint).name).group(1))


def lineage(checkpoint: Path | None, within: Path) -> list[Path]:
    """The checkpoints a resume from `checkpoint` continues, oldest first: those of its run
    folder up to it, then (a run folder that itself resumed one: its state.json names the
    checkpoint in "resumed_from") those before them, and so on; only folders under `within`
    (one LoRA name's checkpoints: a resume under another name leaves its origin alone)."""
    found: list[Path] = []
    within, seen = Path(within).resolve(), set()
    while checkpoint is not None:
        checkpoint = Path(checkpoint).resolve()
        run = checkpoint.parent
        if within not in run.parents or run in seen or not STEP_FOLDER.match(checkpoint.name):
            break
        seen.add(run)
        step = step_of(checkpoint)
        found[:0] = [c for c in list_checkpoints(run) if step_of(c) <= step]
        try:
            earlier = read_state(checkpoint)["config"].get("resumed_from") if checkpoint.is_dir() else None
        except (ValueError, OSError):  # damaged or gone: the chain stops here
            earlier = None
        checkpoint = Path(earlier) if earlier else None
    return found


def prune(folder: Path, keep_last: int, continues: Sequence[Path] = ()) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all) of the logical run:
    `folder`'s and those it `continues` (its resume's `lineage`; so a resumed checkpoint goes
    only once `keep_last` newer ones exist). A run folder left empty goes too. Returns what
    went."""
    if keep_last <= 0:
        return []
    doomed = [*(c for c in continues if c.is_dir()), *list_checkpoints(folder)][:-keep_last]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)  # another run may have pruned it already
        run = path.parent
        if run != Path(folder) and run.is_dir() and not any(run.iterdir()):
            with contextlib.suppress(OSError):
                run.rmdir()
    return doomed
