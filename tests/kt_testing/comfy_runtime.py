"""Boot the real ComfyUI runtime in this process, the way `main.py --cpu` would.

`boot(base_dir)` puts ComfyUI on sys.path, sets the CLI options ComfyUI reads at import
time (CPU only, the given base directory), loads ComfyUI's built-in extra nodes and then
the pack through ComfyUI's own `nodes.load_custom_node`. It runs once per process.
With KT_TEST_DEVICE=cuda (the GPU layer) `--cpu` is left off, as `main.py` without it:
ComfyUI picks the GPU itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from comfy_server import comfy_device

from .paths import PACK_DIR_NAME, comfyui_root, comfyui_site, make_base_directory


@dataclass
class ComfyRuntime:
    root: Path
    base_dir: Path
    nodes: ModuleType  # ComfyUI's own top-level `nodes` module
    pack_loaded: bool
    pack_module_name: str

    @property
    def pack_module(self) -> ModuleType:
        return sys.modules[self.pack_module_name]


_RUNTIME: ComfyRuntime | None = None


def run_sync(coroutine):
    """Run a coroutine to completion on a fresh event loop in a worker thread, so it also works
    while another loop is running in this thread (Playwright's sync API keeps one)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def pack_node_classes(pack_module) -> list:
    """The node classes the pack's V3 extension hands ComfyUI."""
    extension = run_sync(pack_module.comfy_entrypoint())
    return run_sync(extension.get_node_list())


def from_the_pack(name: str) -> ModuleType:
    """One of the pack's modules as ComfyUI loaded it (`from_the_pack("trainer_core.config")`),
    for helpers outside a test's fixtures; ComfyUI must be booted (the `comfy_runtime` fixture)."""
    import importlib

    if _RUNTIME is None:
        raise RuntimeError("boot ComfyUI first: use the comfy_runtime fixture")
    return importlib.import_module(f"{_RUNTIME.pack_module_name}.{name}")


class LazyPackModule:
    """One of the pack's modules, looked up when a test uses it (ComfyUI is booted by then):
    for module-level names of test files collected before the boot."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute):
        return getattr(from_the_pack(self._name), attribute)


def boot(base_dir: Path, options: dict | None = None) -> ComfyRuntime:
    """`options`: more of ComfyUI's command-line options (`comfy.cli_args.args` attributes,
    e.g. `use_pytorch_cross_attention`), set before anything reads them."""
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    root = comfyui_root()
    for path in filter(None, [root, comfyui_site(root)]):  # the site first
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    base_dir = make_base_directory(base_dir)

    from comfy.cli_args import args  # parsed with defaults: ComfyUI's arg parsing is off here

    args.cpu = comfy_device() == "cpu"
    args.base_directory = str(base_dir)
    args.disable_auto_launch = True
    for name, value in (options or {}).items():
        if not hasattr(args, name):
            raise ValueError(f"ComfyUI has no option {name!r}")
        setattr(args, name, value)

    import folder_paths  # reads args.base_directory at import

    if Path(folder_paths.base_path) != base_dir.resolve():
        raise RuntimeError(f"folder_paths was imported before boot(): base {folder_paths.base_path}")
    import comfy.model_management  # noqa: F401  (device selection honours args.cpu)

    # main.py's import order, kept explicit (an import sorter must not reorder it): ComfyUI's
    # `utils` package first, because importing `nodes` puts comfy/ first on sys.path, where
    # comfy/utils.py would shadow that package; then the executor and the server.
    for module in ("utils.extra_config", "execution", "server"):
        importlib.import_module(module)
    import nodes as comfy_nodes

    run_sync(comfy_nodes.init_builtin_extra_nodes())
    pack_path = str(base_dir / "custom_nodes" / PACK_DIR_NAME)
    loaded = run_sync(comfy_nodes.load_custom_node(pack_path))
    _RUNTIME = ComfyRuntime(
        root=root,
        base_dir=base_dir,
        nodes=comfy_nodes,
        pack_loaded=loaded,
        pack_module_name=pack_path.replace(".", "_x_"),
    )
    return _RUNTIME
