"""Boot ComfyUI's runtime in this process without its server, for the command line
(`application/cli.py` calls it before anything of the pack that imports ComfyUI: ComfyUI reads
its options, e.g. the base directory, when its modules are first imported). Nothing here
imports ComfyUI at module level."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import itertools
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

FLAGS_SET_HERE = {  # ComfyUI flags the command sets from elsewhere: flag -> where instead
    "base_directory": "[comfyui] base_directory in the run file",
}
# ComfyUI flags that import a package of their own, which a plain install lacks: the option ->
# (the module ComfyUI imports, its pip name)
FLAG_PACKAGES = {
    "directml": ("torch_directml", "torch-directml"),
    "use_sage_attention": ("sageattention", "sageattention"),
    "use_flash_attention": ("flash_attn", "flash-attn"),
}
APPLIED: list[str] = []  # the ComfyUI flags this process was started with (`apply_flags`)
_PATHS_APPLIED = False  # `apply_custom_paths` ran


def apply_flags(root: Path, flags: list[str], source: str) -> dict:
    """ComfyUI's own command-line flags (`flags`, from `source`: the words a refusal names), read
    by ComfyUI's parser as `main.py` has it read its command line: `comfy.options`' argument
    parsing on and `sys.argv` set to main.py's with the flags while `comfy.cli_args` is first
    imported, so ComfyUI's checks and its derived options (`--fast`, `--force-fp16`, ...) are
    its own. Then what `main.py` does with them before torch (`--cuda-device`,
    `--deterministic`). Must run before anything imports `comfy.cli_args`: ComfyUI's
    `cuda_malloc` and torch read these options. A flag ComfyUI refuses, or one the command
    sets from the run file, or one whose package is missing, is a ValueError in one line;
    `--help` prints ComfyUI's help and exits (SystemExit 0), as `main.py --help` does. Returns
    what the command itself acts on: {"cpu": --cpu given, "disable_dynamic_vram":
    --disable-dynamic-vram given}."""
    if not flags:
        return {"cpu": False, "disable_dynamic_vram": False}
    if "comfy.cli_args" in sys.modules:
        raise RuntimeError("ComfyUI read its options already: its flags must come first")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import comfy.options

    argv, said = sys.argv, io.StringIO()
    sys.argv = [str(root / "main.py"), *flags]
    comfy.options.enable_args_parsing()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            importlib.import_module("comfy.cli_args")  # parses sys.argv, as under main.py
    except SystemExit as stop:  # argparse's error or help: the module is not left half-imported
        if not stop.code:  # --help: ComfyUI's own, and nothing trains
            print("[kontext-trainer] ComfyUI's flags, for [comfyui] flags in the run file or after --:")
            sys.stdout.write(said.getvalue())
            sys.stdout.flush()
            raise
        words = [line for line in said.getvalue().splitlines() if "error:" in line]
        why = words[-1].split("error:", 1)[1].strip() if words else "ComfyUI's parser stopped"
        raise ValueError(f"{source}: ComfyUI does not take the flags {' '.join(flags)} ({why})") from None
    finally:
        sys.argv = argv
        comfy.options.enable_args_parsing(False)
    sys.stderr.write(said.getvalue())  # anything ComfyUI said while it parsed, as it said it
    from comfy.cli_args import args, parser

    given = vars(parser.parse_args(flags))
    for dest, instead in FLAGS_SET_HERE.items():
        if given.get(dest) != parser.get_default(dest):
            raise ValueError(f"{source}: --{dest.replace('_', '-')} is set by {instead}, not as a flag")
    for dest, (module, package) in FLAG_PACKAGES.items():
        if getattr(args, dest, None) not in (None, False) and importlib.util.find_spec(module) is None:
            flag = f"--{dest.replace('_', '-')}"
            raise ValueError(
                f"{source}: {flag} needs the Python package {module}, which is not installed; install "
                f"it in ComfyUI's Python (pip install {package}), or leave out {flag}"
            )
    # main.py's environment from its flags, before torch is imported
    if args.cuda_device not in (None, "all"):
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.cuda_device)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    APPLIED[:] = flags
    return {"cpu": bool(args.cpu), "disable_dynamic_vram": bool(getattr(args, "disable_dynamic_vram", False))}


def flags_applied() -> str:
    """The options ComfyUI took from `apply_flags`' flags, as its `args` holds them now
    (`name=value`), for the command's log; empty without flags."""
    if not APPLIED:
        return ""
    from comfy.cli_args import args, parser

    given, default = vars(parser.parse_args(APPLIED)), vars(parser.parse_args([]))
    return ", ".join(f"{dest}={getattr(args, dest)!r}" for dest in given if given[dest] != default[dest])


def apply_custom_paths(root: Path) -> None:
    """`main.py`'s `apply_custom_paths` (which only `main.py` itself can run): the model folders of
    ComfyUI's `extra_model_paths.yaml` beside `main.py` and of each `--extra-model-paths-config`,
    through ComfyUI's `utils.extra_config`; `--output-directory`, `--input-directory` and
    `--user-directory`; and the output folder's model subfolders ComfyUI lists as model
    folders. Imports no torch."""
    import folder_paths
    import utils.extra_config
    from comfy.cli_args import args

    yaml_beside = root / "extra_model_paths.yaml"
    files = [("ComfyUI's model paths", yaml_beside)] if yaml_beside.is_file() else []
    flag = "--extra-model-paths-config"
    files += [(flag, Path(p)) for p in itertools.chain(*(args.extra_model_paths_config or []))]
    for where, config_path in files:
        check_model_paths_file(config_path, where)
        utils.extra_config.load_extra_path_config(str(config_path))
    for name, setter in (("output", "set_output_directory"), ("input", "set_input_directory"),
                         ("user", "set_user_directory")):
        folder = getattr(args, f"{name}_directory", None)
        if folder and hasattr(folder_paths, setter):
            getattr(folder_paths, setter)(os.path.abspath(folder))
    output = folder_paths.get_output_directory()
    for kind in ("checkpoints", "clip", "vae", "diffusion_models", "loras"):
        folder_paths.add_model_folder_path(kind, os.path.join(output, kind))
    logging.getLogger(__name__).debug("model folders: %s", folder_paths.folder_names_and_paths)


def check_model_paths_file(path: Path, where: str) -> None:
    """`path` as ComfyUI's `load_extra_path_config` reads it: a YAML mapping of names to model
    kinds and their folders. Else a ValueError in one line naming `where` (the flag) and the
    file, what is wrong and the fix; ComfyUI's own reader would end in a traceback."""
    import yaml

    form = (
        "write it as in ComfyUI's extra_model_paths.yaml.example: a name (shared:), then indented "
        "lines of a model kind and its folder (vae: models/vae)"
    )
    if path.is_dir():
        raise ValueError(f"{where}: {path} is a folder, not a YAML file; give the path of the file in it")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{where}: {path} does not exist; give the path of a YAML file of model folders"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise ValueError(f"{where}: {path}: cannot read it ({reason}); give a readable YAML file") from None
    except yaml.YAMLError as error:  # a MarkedYAMLError says where, and what it was reading there
        mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        opened = getattr(error, "context_mark", None)
        if problem and opened is not None and getattr(error, "context", None):
            problem = f"{error.context} from line {opened.line + 1}: {problem}"
        raise ValueError(
            f"{where}: {path}: {at}not valid YAML{f' ({problem})' if problem else ''}; fix the syntax there"
        ) from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else {list: "a list", str: "text"}.get(type(data))
        raise ValueError(
            f"{where}: {path}: its top level must be a mapping of names to folders, not "
            f"{got or 'a ' + type(data).__name__}; {form}"
        )
    for name, folders in data.items():
        if folders is not None and not isinstance(folders, dict):
            raise ValueError(f"{where}: {path}: {name}: must hold model kinds and their folders; {form}")
        for kind, folder in (folders or {}).items():
            if kind != "is_default" and not isinstance(folder, str):
                raise ValueError(f"{where}: {path}: {name}: {kind}: its folder must be text; {form}")


def boot_folders(root: Path, base_directory: Path | None, use_cuda: bool, dynamic_vram: bool = True) -> None:
    """The first half of `boot`: ComfyUI's options set as `main.py` sets them (`--cpu` unless
    `use_cuda`, `--base-directory`, `--disable-dynamic-vram` unless `dynamic_vram`) and its folder
    layout (`folder_paths`) imported, which reads them. Neither imports torch or ComfyUI's model
    code (a second or so less than the whole boot, which takes ten): the command line checks the
    run's files and dataset here, so a refusal comes before the boot."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from comfy.cli_args import args  # defaults: ComfyUI parses no command line unless main.py asks

    args.cpu = not use_cuda
    args.disable_auto_launch = True
    if base_directory is not None:
        args.base_directory = str(base_directory)
    if hasattr(args, "disable_dynamic_vram") and not dynamic_vram:
        args.disable_dynamic_vram = True
    import folder_paths

    if base_directory is not None and Path(folder_paths.base_path).resolve() != base_directory.resolve():
        raise RuntimeError(f"ComfyUI's folders were set before boot: {folder_paths.base_path}")
    global _PATHS_APPLIED
    if not _PATHS_APPLIED:  # once per process, as main.py
        apply_custom_paths(root)
        _PATHS_APPLIED = True


def boot(
    root: Path,
    pack: ModuleType,
    base_directory: Path | None,
    use_cuda: bool,
    dynamic_vram: bool = True,
) -> ModuleType:
    """ComfyUI (at `root`) in this process, set as `main.py` sets it (`boot_folders`; the caller
    may have made it first, and a second changes nothing), then the pack's `__init__.py` run in
    `pack` (its package, set up by `trainer_core/__main__.py`) and its nodes registered as
    ComfyUI's loader does.

        On a GPU it loads models the way the server does on the same machine: the caller has let
        ComfyUI's `cuda_malloc` pick the allocator before importing torch (`choose_allocator`,
        called by the CLI's `wants_cuda`), and on a ComfyUI with dynamic VRAM (0.33) comfy-aimdo is
        set up as `main.py` sets it up, unless `dynamic_vram` is False (the CLI's
        --disable-dynamic-vram). The mode chosen, and why, is printed (`loading_mode`)."""
    boot_folders(root, base_directory, use_cuda, dynamic_vram)
    import torch
    from comfy.cli_args import args

    has_dynamic_vram = hasattr(args, "disable_dynamic_vram")
    aimdo = None
    if use_cuda:
        if has_dynamic_vram and _enables_dynamic_vram():
            aimdo = _init_aimdo(args)  # before comfy imports aimdo's submodules, as main.py
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # torchrun: this process's GPU
    import comfy.model_management  # noqa: F401  (device selection reads args)

    # main.py's import order: ComfyUI's `utils` package before `nodes` (which puts comfy/ first
    # on sys.path, where comfy/utils.py would shadow it)
    for module in ("utils.extra_config", "execution", "server", "nodes"):
        importlib.import_module(module)
    on = aimdo is not None and _enable_dynamic_vram(aimdo)
    print(f"[kontext-trainer] {loading_mode(use_cuda, has_dynamic_vram, dynamic_vram, on)}", flush=True)
    if APPLIED:
        print(f"[kontext-trainer] ComfyUI's options from its flags: {flags_applied()}", flush=True)
    start_pack(pack)
    return pack


def choose_allocator(root: Path) -> None:
    """ComfyUI's `cuda_malloc` (at `root`): the allocator `main.py` would choose
    (cudaMallocAsync on most NVIDIA setups), written to PYTORCH_CUDA_ALLOC_CONF. It must run
    before torch is imported: PyTorch reads that variable at import and again when CUDA starts,
    and a process whose two readings differ cannot start CUDA. Where torch is already imported
    (the CLI called from Python), the variable is left as torch read it: PyTorch's allocator."""
    if "cuda_malloc" in sys.modules or "torch" in sys.modules:
        return
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    importlib.import_module("cuda_malloc")  # imports comfy.cli_args, not torch


def loading_mode(use_cuda: bool, has_dynamic_vram: bool, wanted: bool, on: bool) -> str:
    """One line: how this process loads models, and why."""
    if on:
        return (
            "dynamic VRAM on (comfy-aimdo), as ComfyUI's server on this GPU: weights stay mapped from "
            "the file and stream to the GPU (--disable-dynamic-vram turns it off)"
        )
    if not use_cuda:
        return "dynamic VRAM off: training on the CPU"
    if not has_dynamic_vram:
        return "dynamic VRAM off: this ComfyUI predates it (0.33 has it)"
    if not wanted:
        return "dynamic VRAM off (--disable-dynamic-vram): weights load into RAM, then the GPU"
    return "dynamic VRAM off: ComfyUI does not support it on this GPU or PyTorch (as its server)"


def _enables_dynamic_vram() -> bool:
    from comfy.cli_args import enables_dynamic_vram

    return enables_dynamic_vram()


def _init_aimdo(args):
    """comfy-aimdo's control, initialised with `main.py`'s settings; None without it."""
    try:
        import comfy_aimdo.control
    except ImportError:
        return None
    headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024**3)
    pressure = not getattr(args, "disable_nvml_pressure", False)
    newest = {"simple_vram_headroom": headroom, "nvml_pressure": pressure}
    protocols = (newest, {"simple_vram_headroom": headroom}, {})
    for options in protocols:  # comfy-aimdo's protocols, newest first, as main.py tries them
        try:
            comfy_aimdo.control.init(**options)
            return comfy_aimdo.control
        except TypeError:
            continue
    return None


def _enable_dynamic_vram(control) -> bool:
    """`main.py`'s switch to dynamic VRAM, where it would make it: NVIDIA (or ROCm >= 7.14) with
    PyTorch >= 2.8 and aimdo's devices up."""
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher

    supported = mm.is_nvidia() or (mm.is_amd() and getattr(mm, "rocm_version", (0, 0)) >= (7, 14))
    if not supported or mm.torch_version_numeric < (2, 8):
        return False
    from comfy.cli_args import args

    devices = mm.get_all_torch_devices()
    try:
        ready = control.init_devices((d.index, int(args.vram_headroom * 1024**3)) for d in devices)
    except TypeError:
        ready = control.init_devices(d.index for d in devices)
    if ready:
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
    return bool(ready)


def start_pack(pack: ModuleType) -> None:
    """Run the pack's `__init__.py` (once) and register its nodes in ComfyUI's registry, as
    ComfyUI's custom-node loader does for a V3 entry point: the CLI then finds the pack's nodes
    (e.g. to read a workflow's widgets) where it finds the stock ones."""
    import asyncio

    from .comfy_registry import register_nodes

    if not hasattr(pack, "WEB_DIRECTORY"):
        pack.__spec__.loader.exec_module(pack)

    async def node_list():
        extension = await pack.comfy_entrypoint()
        return await extension.get_node_list()

    register_nodes(asyncio.run(node_list()))
