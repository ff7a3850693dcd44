"""ComfyUI 0.33's dynamic VRAM (its default on NVIDIA), on the CPU (issue 30; ARCHITECTURE.md,
"ComfyUI facts": dynamic VRAM).

On NVIDIA, 0.33's `main.py` initialises comfy-aimdo, sets `memory_management.aimdo_enabled` and
makes `ModelPatcherDynamic` the `CoreModelPatcher` the stock loaders build. The loader then
builds every weight with `torch.frombuffer` over a read-only memory map of the file and assigns
it to the model without a copy (`assign=is_dynamic()`), under the executor's inference mode:
read-only, memory-mapped inference Parameters. `--cpu` turns all of this off, and
`ModelPatcherDynamic.__new__` hands a CPU load device to a plain ModelPatcher, so no CPU run
sees it. Here a CPU server does:

- `dynamic_site/sitecustomize.py` (on the server's PYTHONPATH) runs `comfy_aimdo.control.init()`
  before anything imports ComfyUI, as `main.py` does;
- `emulate()` (the test node pack calls it at load time, before any prompt) sets
  `aimdo_enabled` and installs `DynamicOnCpu`, a real `ModelPatcherDynamic` built past its
  CPU reroute, as `CoreModelPatcher`: the stock UNETLoader builds it and loads the file's
  mapped weights in place. Its `load` is ComfyUI's own (no vbar on a CPU: modules over 16 KiB
  keep their mapped weight and cast per forward, the smaller ones are force-loaded), and every
  node's end calls its `reset_cast_buffers` machinery as on a GPU; only its `partially_unload`
  is adapted (ComfyUI asserts a GPU load device there, for the vbar a CPU lacks), and each
  load records the dtype each streamed weight's vbar pages would have (`GEOMETRY`);
- a weight patch (a LoRA from the stock loader) reaches such a layer as its
  `weight_lowvram_function`, which only the vbar branch of `comfy.ops.cast_bias_weight` applies
  (a CPU has no vbar): `emulate()` wraps the cast to apply it the way that branch does (the
  cast in the compute dtype, then the patch).

`mapped_weights(model)` says how the MODEL holds its weights, so a test first shows it runs on
mapped weights. `AnonymousPeak` samples the process's anonymous memory (RssAnon: the memory map
is file memory, so a copy of the model shows here and the mapped model does not)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

DYNAMIC_VRAM_ENV = "KT_TEST_DYNAMIC_VRAM"
SITE_DIR = Path(__file__).resolve().parent / "dynamic_site"
EMULATION_MARK = "kt test: dynamic VRAM emulated"
GEOMETRY: list[list[str]] = []  # per dynamic load: the geometry dtype of each streamed weight


def server_env() -> dict[str, str]:
    """The environment of a test server with dynamic VRAM emulated (`ComfyServer(env=...)`)."""
    return {DYNAMIC_VRAM_ENV: "1", "PYTHONPATH": str(SITE_DIR)}


def emulate() -> type:
    """Make the stock loaders build dynamic patchers on the CPU; returns the patcher class."""
    import comfy.memory_management
    import comfy.model_patcher

    class DynamicOnCpu(comfy.model_patcher.ModelPatcherDynamic):
        """ComfyUI's `ModelPatcherDynamic`, also for a CPU load device."""

        def __new__(cls, *args, **kwargs):
            return object.__new__(cls)

        def load(self, *args, **kwargs):
            """ComfyUI's load, then a record of the geometry dtype it gave each streamed
            weight (`_model_dtype`: what the vbar pages would hold on a GPU)."""
            result = super().load(*args, **kwargs)
            modules = self.model.modules()
            streamed = [getattr(m, "weight", None) for m in modules if hasattr(m, "comfy_cast_weights")]
            GEOMETRY.append(sorted(str(w._model_dtype) for w in streamed if hasattr(w, "_model_dtype")))
            return result

        def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
            """ComfyUI's, less its assert of a GPU load device: with no vbar (a CPU has none)
            what it frees is the force-loaded weights' backups, as on a GPU once the vbar
            has freed what it could."""
            assert not force_patch_weights
            return self.restore_loaded_backups() if memory_to_free > 0 else 0

    comfy.model_patcher.CoreModelPatcher = DynamicOnCpu
    comfy.memory_management.aimdo_enabled = True
    _apply_patches_as_the_vbar_does()
    return DynamicOnCpu


def _apply_patches_as_the_vbar_does() -> None:
    import functools

    import comfy.ops

    cast = comfy.ops.cast_bias_weight

    @functools.wraps(cast)
    def cast_bias_weight(s, input=None, dtype=None, device=None, bias_dtype=None, *args, **kwargs):
        result = cast(s, input, dtype, device, bias_dtype, *args, **kwargs)
        functions = [getattr(s, f"{key}_lowvram_function", None) for key in ("weight", "bias")]
        if not any(functions):
            return result
        weight, bias, *rest = result
        compute = kwargs.get("compute_dtype") or weight.dtype
        if functions[0] is not None:
            weight = functions[0](weight.to(compute, copy=True))  # the patch may add in place
        if functions[1] is not None and bias is not None:
            bias = functions[1](bias.to(compute, copy=True))
        return (weight, bias, *rest)

    comfy.ops.cast_bias_weight = cast_bias_weight


def is_mapped(tensor: torch.Tensor) -> bool:
    """A tensor over the loader's read-only memory map of the file (0.33's `load_safetensors`
    tags the storage with its file slice)."""
    return hasattr(tensor.untyped_storage(), "_comfy_tensor_file_slice")


def mapped_weights(model) -> dict:
    """How the MODEL's diffusion model holds the weights of its layers over 16 KiB: how many
    there are, how many are mapped, how many of those are inference Parameters, and the patcher."""
    large = [
        module.weight
        for module in model.model.diffusion_model.modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.numel() * module.weight.element_size() > 16 * 1024
    ]
    mapped = [w for w in large if is_mapped(w)]
    return {
        "patcher": type(model).__name__,
        "dynamic": bool(model.is_dynamic()),
        "large": len(large),
        "mapped": len(mapped),
        "mapped_inference_parameters": sum(
            isinstance(w, torch.nn.Parameter) and w.is_inference() for w in mapped
        ),
        "mapped_bytes": sum(w.numel() * w.element_size() for w in mapped),
    }


def anonymous_kib() -> int:
    """This process's RssAnon (KiB)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


class AnonymousPeak:
    """The highest RssAnon seen since the last `reset`, sampled every `interval` s by a daemon
    thread (a short training run's peak is missed by a single reading at its end), with where
    the other threads were when it was seen (so that a failed bound says what held the memory)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.lock = interval, threading.Lock()
        self.base = self.peak = anonymous_kib()
        self.where = ""
        threading.Thread(target=self._sample, daemon=True, name="kt-anon-peak").start()

    def _sample(self) -> None:
        while True:
            now = anonymous_kib()
            with self.lock:
                if now > self.peak:
                    self.peak, self.where = now, busy_frames()
            time.sleep(self.interval)

    def reset(self) -> dict:
        """The base and peak since the last reset (KiB) and where the peak was seen, then start
        again from now. Also the bytes ComfyUI holds in pinned host buffers now
        (`model_management.TOTAL_PINNED_MEMORY`, 0.33: weights it stages for transfers on a
        GPU; none on a CPU), part of the anonymous memory that is ComfyUI's, not ours."""
        import sys

        management = sys.modules.get("comfy.model_management")
        with self.lock:
            now = anonymous_kib()
            if now > self.peak:
                self.peak, self.where = now, "at the reading"
            seen = {"base_kib": self.base, "peak_kib": self.peak, "peak_where": self.where}
            seen["pinned_bytes"] = int(getattr(management, "TOTAL_PINNED_MEMORY", 0))
            self.base = self.peak = anonymous_kib()
            self.where = ""
        return seen


def busy_frames(depth: int = 6) -> str:
    """Where each busy thread of this process is: its innermost frames in ComfyUI's or the
    pack's code, after the library function it is in if any (`file:line function`, innermost
    first), one line per thread."""
    import sys
    import traceback

    me = threading.get_ident()
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stack = traceback.extract_stack(frame)
        frames = [f for f in stack if "site-packages" not in f.filename]
        if not frames or stack[-1].name in ("wait", "select", "_worker", "run_forever", "_sample"):
            continue
        if frames[-1] is not stack[-1]:  # in a library (torch's checkpoint, autograd): name it
            frames.append(stack[-1])
        shown = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-depth:])]
        lines.append(" < ".join(shown))
    return "\n".join(lines)


def comfyui_has_dynamic_vram() -> bool:
    """The ComfyUI under test has dynamic VRAM (0.33 does; 0.3.75 predates it)."""
    from .paths import comfyui_root

    return "class ModelPatcherDynamic" in (comfyui_root() / "comfy" / "model_patcher.py").read_text()
