"""The command line: the trainer without a browser, on one GPU or data parallel under torchrun.

    python -m trainer_core train --config run.toml [--cpu] [-- COMFYUI FLAGS, e.g. --reserve-vram 2]
    torchrun --nproc_per_node 4 -m trainer_core train --config run.toml
    python -m trainer_core config --from-workflow my_workflow.json -o run.toml
    python -m trainer_core workflow --config run.toml -o run_api.json

(run from the pack's folder, e.g. ComfyUI/custom_nodes/kontext-trainer, with ComfyUI's Python.)

`trainer_core/__main__.py` is the door: it sets the pack up as one package (`kontext_trainer`)
and calls `main`. This module parses the command and finds ComfyUI (KONTEXT_TRAINER_COMFYUI,
else the ComfyUI this pack is installed in, else the bundled `.comfyui/`);
`comfy_adapter/comfy_boot.py` sets the options ComfyUI reads at import (the config's base
directory, CPU or this process's GPU) as `main.py` would, runs the pack's entry point and
registers its nodes as ComfyUI's loader does; `application/headless.py` then loads the models
with ComfyUI's own loaders and trains through the same run as the TrainLoRA node.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import ModuleType

from ..comfy_adapter import comfy_boot

PACK_ROOT = Path(__file__).resolve().parents[1]
COMFYUI_ENV = "KONTEXT_TRAINER_COMFYUI"


def comfyui_root() -> Path:
    named = os.environ.get(COMFYUI_ENV)
    candidates = [Path(named)] if named else [PACK_ROOT.parents[1], PACK_ROOT / ".comfyui"]
    for root in candidates:
        if (root / "main.py").is_file() and (root / "comfy").is_dir():
            return root.resolve()
    if named:
        raise SystemExit(
            f"error: {COMFYUI_ENV}={named} is not a ComfyUI folder (no main.py and comfy/ there)"
        )
    raise SystemExit(
        f"error: no ComfyUI found: install the pack in ComfyUI/custom_nodes/, set {COMFYUI_ENV} to "
        "your ComfyUI folder, or run `make setup` in the pack for the bundled one"
    )


def boot(base_directory: Path | None, use_cuda: bool, dynamic_vram: bool = True) -> ModuleType:
    """ComfyUI's runtime in this process, then the pack's entry point run and its nodes
    registered (`comfy_adapter/comfy_boot.py`); returns the pack's package."""
    pack = sys.modules[__package__.rpartition(".")[0]]
    return comfy_boot.boot(comfyui_root(), pack, base_directory, use_cuda, dynamic_vram)


def wants_cuda(force_cpu: bool) -> bool:
    """Whether to train on the GPU. Before torch is first imported, ComfyUI's `cuda_malloc` picks
    the allocator, as `main.py` does: PyTorch reads PYTORCH_CUDA_ALLOC_CONF when it is imported
    and again when CUDA starts, and refuses to start CUDA when the two differ (torch 2.11:
    "Allocator backend parsed at runtime != allocator backend parsed at load time")."""
    if force_cpu:
        return False
    comfy_boot.choose_allocator(comfyui_root())
    import torch

    return torch.cuda.is_available()


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m trainer_core", description="Kontext Trainer without the graph."
    )
    commands = top.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train the run a config describes (under torchrun: data parallel)",
        description="Ctrl-C stops after the current step and writes a checkpoint to resume from "
        "(a second Ctrl-C quits at once).",
    )
    train.epilog = (
        "ComfyUI's own flags (python main.py --help) go after --, e.g. `train --config run.toml -- "
        "--reserve-vram 2`, or in the run file as [comfyui] flags = [...]; the command line's come last."
    )
    train.add_argument("--config", required=True, type=Path, help="the run's TOML config")
    train.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is there")
    train.add_argument(
        "--disable-dynamic-vram",
        action="store_true",
        help="load the model as ComfyUI's --disable-dynamic-vram does (default: as ComfyUI's server "
        "on this machine; on NVIDIA with ComfyUI 0.33 that is dynamic VRAM)",
    )
    train.add_argument(
        "--timeout-minutes",
        type=float,
        default=30.0,
        help="data parallel: how long a process waits for the others (encoding the dataset on the "
        "first, a lost machine under NCCL) before it gives up (default: 30)",
    )
    config = commands.add_parser(
        "config",
        help="write the config of a workflow's TrainLoRA",
        description="Reads a UI or API workflow with UNETLoader, VAELoader, CLIPLoader or DualCLIPLoader, "
        "LoadKontextDataset and TrainLoRA, and writes their values as a run config (TOML). "
        "Previews are not part of it (headless runs sample none).",
    )
    config.add_argument("--from-workflow", required=True, type=Path, help="a UI or API workflow JSON")
    config.add_argument("--node", help="the TrainLoRA node's id, if the workflow has several")
    config.add_argument(
        "--base-directory",
        type=Path,
        default=None,
        help="the ComfyUI base directory the config names: models/, input/, output/ under it "
        "(default: the ComfyUI the pack found)",
    )
    config.add_argument("-o", "--output", type=Path, help="the TOML file to write (default: print it)")
    workflow = commands.add_parser(
        "workflow",
        help="write the API workflow that trains a config's run",
        description="Writes the API workflow (loaders, LoadKontextDataset, TrainLoRA) that trains the "
        "config's run in the graph; queue it, or open it in ComfyUI.",
    )
    workflow.add_argument("--config", required=True, type=Path, help="the run's TOML config")
    workflow.add_argument("-o", "--output", type=Path, help="the JSON file to write (default: print it)")
    return top


def main(argv: list[str] | None = None, load_models=None) -> int:
    """`load_models`: replaces the stock loaders (tests train tiny models that no stock loader
    can detect); everything else runs as in production."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    options = parser().parse_args(ours)
    if theirs and options.command != "train":
        parser().error("ComfyUI's flags after -- are for the train command")
    if options.command == "train":  # ComfyUI's own flags first: cuda_malloc and torch read them
        flags = _comfyui_flags(options.config)
        try:
            source = _flags_source(options.config, flags, theirs)
            said = comfy_boot.apply_flags(comfyui_root(), flags + theirs, source)
        except ValueError as error:
            return _refused(error)
        options.cpu = options.cpu or said["cpu"]  # ComfyUI's --cpu, as this command's
        options.disable_dynamic_vram = options.disable_dynamic_vram or said["disable_dynamic_vram"]
    options.use_cuda = options.command == "train" and wants_cuda(options.cpu)
    dynamic_vram = not getattr(options, "disable_dynamic_vram", False)
    config = checked = workflow = None
    try:  # what the command is given, read before ComfyUI's folders are fixed at import
        if options.command == "config":
            base = options.base_directory.resolve() if options.base_directory else None
            from .workflow_config import read_workflow  # imports none of ComfyUI until it converts

            workflow = read_workflow(options.from_workflow)
        else:
            config = _read_config(options.config)
            base = config.base_directory
        # ComfyUI's folders (its model paths files read): a bad one is refused before the boot
        comfy_boot.boot_folders(comfyui_root(), base, options.use_cuda, dynamic_vram)
    except ValueError as error:
        return _refused(error)
    if options.command == "train":
        # the run's files and the dataset, before the boot and the model load
        from . import preflight

        try:
            checked = preflight.check_run(config)
        except (OSError, ValueError) as error:
            print(preflight.refusal(options.config, error), file=sys.stderr, flush=True)
            return 2
    boot(base, options.use_cuda, dynamic_vram)
    from . import headless  # after the boot: it imports ComfyUI

    if options.command == "train":
        return headless.train_command(options, config, checked, load_models)
    return headless.convert_command(options, config, workflow)


def _comfyui_flags(path: Path) -> list[str]:
    """`[comfyui] flags` of the run file, read on its own before ComfyUI and torch are imported
    (`_read_config` checks the whole file after); [] where the file or the key is unreadable,
    which `_read_config` then reports."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        flags = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("comfyui", {}).get("flags", [])
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError):
        return []
    return flags if isinstance(flags, list) and all(isinstance(f, str) for f in flags) else []


def _flags_source(config: Path, flags: list[str], theirs: list[str]) -> str:
    where = [f"{config} [comfyui] flags"] if flags else []
    return " and ".join(where + (["the flags after --"] if theirs else []))


def _refused(error: Exception) -> int:
    """A refusal of what the command was given, in one line; the command's exit status."""
    print(f"[kontext-trainer] error: {error}", file=sys.stderr, flush=True)
    return 2


def _read_config(path: Path):
    """The config, read before ComfyUI boots (its folders are fixed at import by the base
    directory); a bad one is a ValueError naming the file."""
    from ..trainer_core.run_config import load_run_config

    config = load_run_config(path)
    base = config.base_directory
    if not base.is_dir():  # before the boot, which would create ComfyUI's folders in it
        raise ValueError(
            f"{path}: [comfyui] base_directory: {base} does not exist; give your ComfyUI base "
            "directory (the folder with models/, input/ and output/)"
        )
    return config
