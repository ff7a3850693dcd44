"""Reaching the GPU code paths on a CPU-only machine (ARCHITECTURE.md, "ComfyUI facts").

- `meta_as_gpu`: the MODEL loads onto the `meta` device through ComfyUI's own
  `load_models_gpu`, as onto a GPU with the given free memory (so ComfyUI decides between a
  full and a partial load itself). `meta` runs forward, backward and AdamW and raises on any
  op that mixes it with a CPU tensor: a device-discipline check with no values.
- `cpu_as_small_gpu`: ComfyUI's `load_models_gpu` treats the CPU like a GPU with
  `weight_budget` bytes left for weights, so it loads the model *partially* ("lowvram": the
  layers that do not fit stay behind and are cast per use, with `LowVramPatch` for weight
  patches), on the CPU, where values can be compared with a full load.
- `stock_lora`: a random LoRA applied by ComfyUI's own LoRA code (`load_lora_for_models`).
"""

from __future__ import annotations

import contextlib

import torch

META = torch.device("meta")


def meta_as_gpu(monkeypatch, patcher, free_bytes: int = 2**40):
    import comfy.model_management as mm

    real = mm.get_free_memory

    def get_free_memory(dev=None, torch_free_too=False):
        if dev is not None and torch.device(dev).type == "meta":
            return (free_bytes, free_bytes) if torch_free_too else free_bytes
        return real(dev, torch_free_too)

    monkeypatch.setattr(mm, "get_free_memory", get_free_memory)
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NORMAL_VRAM)
    # ComfyUI 0.33 rounds a patched fp8 weight stochastically with a generator on the weight's
    # device, which `meta` cannot have; meta holds no values, so a plain cast is the same
    import comfy.float

    rounding = comfy.float.stochastic_rounding

    def stochastic_rounding(value, dtype, seed=0):
        if value.device.type == "meta":
            return value.to(dtype)
        return rounding(value, dtype, seed=seed)

    monkeypatch.setattr(comfy.float, "stochastic_rounding", stochastic_rounding)
    patcher.load_device = META
    return patcher


def cpu_as_small_gpu(monkeypatch, weight_budget: int) -> None:
    """Inside `load_models_gpu` only: the CPU is not a CPU (so ComfyUI may load partially) and
    has ComfyUI's minimum inference memory plus `weight_budget` bytes free."""
    import comfy.model_management as mm

    real_load, real_free, real_is_cpu = mm.load_models_gpu, mm.get_free_memory, mm.is_device_cpu

    def get_free_memory(dev=None, torch_free_too=False):
        free = int(mm.minimum_inference_memory()) + weight_budget
        return (free, free) if torch_free_too else free

    def load_models_gpu(models, memory_required=0, **kwargs):
        with contextlib.ExitStack() as undo:
            undo.callback(setattr, mm, "get_free_memory", real_free)
            undo.callback(setattr, mm, "is_device_cpu", real_is_cpu)
            mm.get_free_memory, mm.is_device_cpu = get_free_memory, lambda device: False
            return real_load(models, memory_required=memory_required, **kwargs)

    monkeypatch.setattr(mm, "load_models_gpu", load_models_gpu)
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NORMAL_VRAM)


def lora_state(model, layers, seed: int, rank: int = 2, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """A random LoRA for `layers` in ComfyUI's key format (lora_down, lora_up, alpha = rank),
    factors drawn from N(0, scale^2)."""
    flux = model.model.diffusion_model
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for layer in layers:
        out_features, in_features = flux.get_submodule(layer).weight.shape
        state[f"diffusion_model.{layer}.lora_down.weight"] = (
            torch.randn(rank, in_features, generator=gen) * scale
        )
        state[f"diffusion_model.{layer}.lora_up.weight"] = (
            torch.randn(out_features, rank, generator=gen) * scale
        )
        state[f"diffusion_model.{layer}.alpha"] = torch.tensor(float(rank))
    return state


def stock_lora(model, layers, seed: int, rank: int = 2, strength: float = 1.0, scale: float = 0.3):
    """`model` with `lora_state(...)` applied the way the stock LoraLoaderModelOnly applies a
    LoRA (`comfy.sd.load_lora_for_models`)."""
    import comfy.sd

    patched, _ = comfy.sd.load_lora_for_models(
        model, None, lora_state(model, layers, seed, rank), strength, 0
    )
    if len(patched.patches) != len(layers):
        raise AssertionError(f"ComfyUI applied {len(patched.patches)} of {len(layers)} LoRA layers")
    return patched


def lowvram_layers(diffusion_model) -> list[str]:
    """The layers a partial load left behind (ComfyUI marks them `prev_comfy_cast_weights`)."""
    marked = [n for n, m in diffusion_model.named_modules() if hasattr(m, "prev_comfy_cast_weights")]
    return [name.removesuffix(".base_layer") for name in marked]  # as named before a LoRA wrapped it


def offload_reserve(patcher) -> int:
    """The bytes ComfyUI's partial load keeps free beside the weights it loads, by its own
    accounting (`ModelPatcher.load` in 0.3.75): the largest layer it may leave behind, counted
    with a weight patch's `LowVramPatch` estimate (a stock LoRA's layers count several times
    their size), times NUM_STREAMS + 1 (2 streams on NVIDIA, where it offloads asynchronously;
    0 on the CPU). A weights budget below this loads no layer at all."""
    import comfy.model_management as mm

    largest = max(entry[0] for entry in patcher._load_list() if hasattr(entry[3], "comfy_cast_weights"))
    return int(largest * (mm.NUM_STREAMS + 1))
