"""Where things are: the repo, the ComfyUI root the tests run against, the asset cache."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
COMFYUI_ENV = "KONTEXT_TRAINER_COMFYUI"
# The folder name the pack gets inside a test ComfyUI's custom_nodes.
PACK_DIR_NAME = "kontext-trainer"


def comfyui_root() -> Path:
    """The ComfyUI checkout named by KONTEXT_TRAINER_COMFYUI, else the bundled copy."""
    named = os.environ.get(COMFYUI_ENV)
    root = Path(named).resolve() if named else REPO_ROOT / ".comfyui"
    if not (root / "main.py").is_file():
        hint = f"{COMFYUI_ENV}={named}" if named else "the bundled .comfyui/"
        raise RuntimeError(f"no ComfyUI at {root} ({hint}); run `make setup` first")
    return root


def asset_cache_dir() -> Path:
    """Generated model files live here, outside git, and survive between runs."""
    return Path(os.environ.get("KONTEXT_TRAINER_ASSET_CACHE", REPO_ROOT / ".cache" / "assets"))


def make_base_directory(base: Path) -> Path:
    """A ComfyUI --base-directory with the pack installed the way a user installs it."""
    for sub in ("custom_nodes", "models", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_DIR_NAME
    if not link.exists():
        link.symlink_to(REPO_ROOT, target_is_directory=True)
    return base
