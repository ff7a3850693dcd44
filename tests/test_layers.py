"""The pack's layers and the direction of every import (ARCHITECTURE.md):

    nodes/          the ComfyUI nodes (UI only)
    application/    one training run for the graph and the CLI, file policy, workflow <-> config
    comfy_adapter/  everything that touches ComfyUI's model code
    trainer_core/   torch / safetensors / peft code that imports no ComfyUI, even at run time

A module imports its own layer or the layers below it, never one above. Only `nodes/` and
`comfy_adapter/` import ComfyUI; `application/` reads ComfyUI's folder layout (`folder_paths`)
and nothing else of it. Imports are read from the source (module level and inside functions,
and `importlib.import_module` with a constant name), so a lazy import cannot hide.
"""

from __future__ import annotations

import ast
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

from kt_testing.paths import comfyui_root

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("nodes", "application", "comfy_adapter", "trainer_core")  # top to bottom
# what ComfyUI installs beside its own folder's modules (0.33's dynamic VRAM, its kernels)
COMFY_PACKAGES = {"comfy_aimdo", "comfy_kitchen", "comfyui_frontend_package", "comfyui_workflow_templates"}
APPLICATION_MAY_READ = {"folder_paths"}
# python -m trainer_core: the door to application/cli.py (it reaches the CLI by name, at run time)
DOORS = {"trainer_core/__main__.py"}


def comfy_names() -> set[str]:
    """Every top-level name ComfyUI's folder provides (comfy, comfy_api, nodes, server, ...)."""
    root = comfyui_root()
    names = {p.stem for p in root.glob("*.py")}
    names |= {p.name for p in root.iterdir() if (p / "__init__.py").is_file() or p.name.startswith("comfy")}
    return names | COMFY_PACKAGES


def imports_of(path: Path) -> list[tuple[int, str, int]]:
    """(line, module, level) for every import in a file: level 0 is absolute; a relative import's
    module is its dotted tail ("" for `from .. import x`, whose names are then modules)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.module is None:  # from .. import a, b
                found += [(node.lineno, alias.name, node.level) for alias in node.names]
            else:
                found.append((node.lineno, node.module, node.level))
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value, 0))
    return found


def pack_target(relative: Path, module: str, level: int) -> str | None:
    """The layer a relative import in the file at `relative` (to the pack's root) reaches (None:
    outside the pack's layers)."""
    here = relative.parent.parts  # e.g. ("application",)
    base = here[: len(here) - (level - 1)]
    parts = [*base, *module.split(".")] if module else list(base)
    return parts[0] if parts and parts[0] in LAYERS else None


def layer_files(root: Path) -> list[tuple[str, Path]]:
    return [(layer, f) for layer in LAYERS for f in sorted((root / layer).rglob("*.py"))]


def violations(root: Path = REPO) -> list[str]:
    comfy = comfy_names()
    found = []
    for layer, path in layer_files(root):
        name = path.relative_to(root).as_posix()
        rank = LAYERS.index(layer)
        for line, module, level in imports_of(path):
            top = module.split(".")[0]
            where = f"{name}:{line} imports {'.' * level}{module}"
            if level:
                target = pack_target(path.relative_to(root), module, level)
                if target is not None and LAYERS.index(target) < rank:
                    found.append(f"{where}: {layer} may not import {target} (a layer above it)")
            elif top in LAYERS and top != "nodes":  # absolute `nodes` is ComfyUI's own module
                found.append(f"{where}: the pack imports itself only relatively")
            elif top in comfy:
                if layer == "trainer_core" or (layer == "application" and top not in APPLICATION_MAY_READ):
                    found.append(f"{where}: {layer} does not import ComfyUI")
    return found


def reported_files(checker, root: Path, files: dict[str, str]) -> list[str]:
    """The files of a small tree (`files`: path -> source, written under `root`) that `checker`
    reports."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return sorted({line.split(":")[0] for line in checker(root)})


def test_the_rules_catch_what_they_forbid(tmp_path):
    """The checker on a small tree: each forbidden import is reported, each allowed one not."""
    files = {
        "trainer_core/lazy.py": "def f():\n    import comfy.model_management\n",
        "trainer_core/up.py": "from ..application import run_policy\n",
        "trainer_core/fine.py": "from .config import TrainConfig\nimport torch\n",
        "comfy_adapter/up.py": "from ..application.training_run import Run\n",
        "comfy_adapter/fine.py": "import comfy.ops\nfrom ..trainer_core import lora_file\n",
        "application/model.py": "import importlib\nimportlib.import_module('comfy.sd')\n",
        "application/up.py": "from ..nodes.train_lora import TrainLoRA\n",
        "application/fine.py": "import folder_paths\nfrom ..comfy_adapter.previews import x\n",
        "application/absolute.py": "from trainer_core.config import TrainConfig\n",
        "nodes/fine.py": "import nodes\nfrom ..application import datasets\nimport comfy_api.latest\n",
    }
    forbidden = sorted(name for name in files if not name.endswith("fine.py"))
    assert reported_files(violations, tmp_path, files) == forbidden


def test_every_import_points_down_and_only_the_adapter_and_nodes_touch_comfyui():
    assert violations() == []


# What only ComfyUI's MODEL (ModelPatcher, BaseModel) has: `nodes/` and `application/` read these
# through `comfy_adapter/model_view.py` (issue 43 item 1), never themselves.
MODEL_INTERNALS = {
    "process_latent_in",
    "manual_cast_dtype",
    "get_dtype",
    "load_device",
    "offload_device",
    "model_options",
    "model_sampling",
    "latent_format",
    "model_config",
}


def model_reads(root: Path = REPO) -> list[str]:
    """Each place in nodes/ and application/ that reads a MODEL's internals: a name of
    MODEL_INTERNALS, or `<patcher>.model.diffusion_model` (a run config's `config.model`, the
    [model] section, is no MODEL)."""
    found = []
    for layer in ("nodes", "application"):
        for path in sorted((root / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Attribute):
                    continue
                inner = node.value
                reaches = node.attr == "diffusion_model" and isinstance(inner, ast.Attribute)
                reaches = reaches and inner.attr == "model" and ast.unparse(inner.value) != "config"
                if node.attr in MODEL_INTERNALS or reaches:
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} reads .{node.attr}")
    return found


def test_the_application_and_the_nodes_read_a_model_only_through_the_adapter(tmp_path):
    files = {
        "application/reads.py": "def f(model):\n    return model.model.diffusion_model\n",
        "nodes/device.py": "def f(model):\n    return model.load_device\n",
        "application/fine.py": "def f(config, r):\n    return config.model.diffusion_model, r.load\n",
    }
    assert reported_files(model_reads, tmp_path, files) == ["application/reads.py", "nodes/device.py"]
    assert model_reads() == []


def test_trainer_core_imports_no_comfyui_at_run_time():
    """Every trainer_core module imported in a fresh interpreter that could import ComfyUI:
    afterwards no module of ComfyUI is loaded."""
    modules = [
        "trainer_core." + p.relative_to(REPO / "trainer_core").with_suffix("").as_posix().replace("/", ".")
        for p in sorted((REPO / "trainer_core").rglob("*.py"))
        if p.name not in ("__init__.py", "__main__.py")
    ]
    script = (
        "import importlib, json, sys\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(comfyui_root())!r}]\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert len([m for m in loaded if m.startswith("trainer_core.")]) >= len(modules)
    comfy = comfy_names()
    assert [m for m in loaded if m.split(".")[0] in comfy] == []


def test_the_command_line_loads_every_module_of_the_pack_once(tmp_path):
    """`python -m trainer_core` boots ComfyUI and imports the whole run (headless, the run
    service, the adapter, the nodes through the pack's entry point); no file of the pack is
    loaded as two module objects (before, 16 trainer_core modules existed twice)."""
    config = tmp_path / "run.toml"
    (tmp_path / "base").mkdir()  # a ComfyUI base directory exists (a missing one is refused)
    config.write_text(
        "[comfyui]\nbase_directory = " + json.dumps(str(tmp_path / "base")) + "\n"
        '[model]\ndiffusion_model = "m.safetensors"\nvae = "v.safetensors"\n'
        'text_encoders = ["clip_l.safetensors", "t5.safetensors"]\n'
        '[dataset]\npath = "/data/set"\n[train]\nlora_name = "x"\n',
        encoding="utf-8",
    )
    script = (
        "import collections, json, os, runpy, sys\n"
        f"sys.argv = ['trainer_core', 'workflow', '--config', {str(config)!r}, "
        f"'-o', {str(tmp_path / 'w.json')!r}]\n"
        "try:\n    runpy.run_module('trainer_core', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as stop:\n    assert not stop.code, stop.code\n"
        "import kontext_trainer.application.headless  # the whole training path, as `train` loads it\n"
        f"root = {str(REPO)!r}\n"
        "files = collections.defaultdict(list)\n"
        "for name, module in list(sys.modules.items()):\n"
        "    path = os.path.realpath(getattr(module, '__file__', None) or '')\n"
        "    if path.startswith(root + os.sep) and os.sep + '.' not in path[len(root):]:\n"
        "        files[path].append(id(module))\n"
        "print(json.dumps(files))\n"
    )
    env = {**os.environ, "KONTEXT_TRAINER_COMFYUI": str(comfyui_root())}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "w.json").is_file()
    files = json.loads(result.stdout.splitlines()[-1])
    loaded = collections.Counter(Path(p).relative_to(REPO).parts[0] for p in files)
    assert all(loaded[layer] for layer in LAYERS), loaded
    assert {p: ids for p, ids in files.items() if len(set(ids)) > 1} == {}
