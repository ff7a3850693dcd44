"""Boot ComfyUI's runtime in this process without its server, for the command line
(`trainer_core/cli.py` loads this file by path, before the pack's package can be imported:
ComfyUI reads its options, e.g. the base directory, when its modules are first imported).
No relative imports here."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


def boot(
    root: Path, pack_root: Path, package: str, base_directory: Path | None, use_cuda: bool
) -> ModuleType:
    """ComfyUI (at `root`) in this process, set as `main.py` sets it (`--cpu` unless
    `use_cuda`, `--base-directory`), then the pack (at `pack_root`) imported as `package`."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import torch
    from comfy.cli_args import args  # defaults: ComfyUI parses no command line unless main.py asks

    args.cpu = not use_cuda
    args.disable_auto_launch = True
    if base_directory is not None:
        args.base_directory = str(base_directory)
    if use_cuda:  # this process's GPU (torchrun: LOCAL_RANK), before ComfyUI picks its device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import comfy.model_management  # noqa: F401  (device selection reads args)
    import folder_paths

    if base_directory is not None and Path(folder_paths.base_path).resolve() != base_directory.resolve():
        raise RuntimeError(f"ComfyUI's folders were set before boot: {folder_paths.base_path}")
    # main.py's import order: ComfyUI's `utils` package before `nodes` (which puts comfy/ first
    # on sys.path, where comfy/utils.py would shadow it)
    for module in ("utils.extra_config", "execution", "server", "nodes"):
        importlib.import_module(module)
    return import_pack(pack_root, package)


def import_pack(pack_root: Path, package: str) -> ModuleType:
    if package in sys.modules:
        return sys.modules[package]
    spec = importlib.util.spec_from_file_location(
        package, pack_root / "__init__.py", submodule_search_locations=[str(pack_root)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    return module
