"""Peak host memory of one real training step (forward + backward through `lora_session`)
of the tiny Flux on the CPU, at several latent sizes: what `tests/comfy_adapter/test_vram_measured.py`
compares the VRAM estimator's activation term with.

Run as its own process (`python -m kt_testing.step_memory SIZE...`, with
MALLOC_MMAP_THRESHOLD_ set): glibc then serves every large block by mmap and unmaps it on
free, so the resident set follows the live tensors. Before each step the kernel's high-water
mark is reset (`/proc/self/clear_refs` 5) and the step's growth is VmHWM - VmRSS. Attention
is ComfyUI's `attention_pytorch` (torch SDPA, what ComfyUI uses on an NVIDIA GPU), through
ComfyUI's own per-model override: its CPU default, sub-quadratic attention, keeps every
chunk of the L x L scores for backward, which a GPU run never does.

`--family klein` measures the tiny FLUX.2 [klein] (`kt_testing.klein.KLEIN_CONFIG`: 128
latent channels, no pooled text; ComfyUI 0.33 builds it) instead of the tiny FLUX.1.

Prints one JSON object: {"<checkpointing>": {"<latent size>": bytes}}.
"""

from __future__ import annotations

import gc
import importlib
import json
import sys
import tempfile
from pathlib import Path


def _resident(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _load_pack(root: Path):
    """ComfyUI's modules and the pack through ComfyUI's own `load_custom_node`, without the
    built-in extra nodes (a full `comfy_runtime.boot` takes several times longer); ComfyUI's
    base directory in `root`."""
    from kt_testing.comfy_runtime import run_sync
    from kt_testing.paths import PACK_DIR_NAME, comfyui_root, make_base_directory

    sys.path.insert(0, str(comfyui_root()))
    base_dir = make_base_directory(root)
    from comfy.cli_args import args

    args.cpu, args.base_directory = True, str(base_dir)
    import folder_paths  # noqa: F401  (reads args.base_directory at import)

    importlib.import_module("utils.extra_config")  # before `nodes`, as main.py imports them
    import nodes as comfy_nodes

    pack_path = str(base_dir / "custom_nodes" / PACK_DIR_NAME)
    if not run_sync(comfy_nodes.load_custom_node(pack_path)):
        raise RuntimeError("the pack did not load")
    return sys.modules[pack_path.replace(".", "_x_")]


def measure(root: Path, sizes: list[int], family: str = "flux") -> dict[str, dict[str, int]]:
    pack = _load_pack(root)
    import comfy.ldm.modules.attention as attention
    import torch

    from kt_testing.klein import klein_patcher
    from kt_testing.probes import tiny_samples
    from kt_testing.tiny_models import tiny_flux_patcher

    models = {"flux": (tiny_flux_patcher, 16, 32), "klein": (klein_patcher, 128, 0)}
    patcher, channels, pooled = models[family]
    torch.set_num_threads(1)  # one thread: no per-thread scratch buffers in the figures
    ft = importlib.import_module(f"{pack.__name__}.comfy_adapter.lora_session")
    sample_type = importlib.import_module(f"{pack.__name__}.trainer_core.flow_step").Sample

    def sdpa(func, *args, **kwargs):
        return attention.attention_pytorch(*args, **kwargs)

    results = {}
    for checkpointing in (False, True):
        model = patcher(seed=1)
        model.model_options["transformer_options"]["optimized_attention_override"] = sdpa
        config = ft.TrainConfig(rank=4, alpha=4.0, gradient_checkpointing=checkpointing)
        grown = {}
        with ft.lora_session(model, config) as session:
            # the largest size first: small-block arenas reach their size once, outside the measurement
            for index, size in enumerate([max(sizes), *sizes]):
                samples = tiny_samples(
                    sample_type, 1, 4, [], target=(size, size), channels=channels, pooled=pooled
                )
                for param in session.lora.parameters():
                    param.grad = None
                gc.collect()
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
                before = _resident("VmRSS")
                session.loss(samples, torch.Generator().manual_seed(0)).backward()
                if index > 0:
                    grown[str(size)] = _resident("VmHWM") - before
        results[str(checkpointing)] = grown
    return results


if __name__ == "__main__":
    arguments = sys.argv[1:]
    chosen = "flux"
    if arguments[:1] == ["--family"]:
        chosen, arguments = arguments[1], arguments[2:]
    with tempfile.TemporaryDirectory(prefix="kt-step-memory-") as folder:
        print(json.dumps(measure(Path(folder), [int(s) for s in arguments], chosen)))
