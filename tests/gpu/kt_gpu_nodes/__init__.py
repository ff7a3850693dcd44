"""A test-only custom-node pack for the GPU layer's server test (installed only into that test's
ComfyUI, never shipped): a probe of what a LoRA loader did to a MODEL, on any Flux (its input
sizes are read off the model) and on the model's own load device."""

from __future__ import annotations

import torch


def flux_output(model, seed: int = 0, sigma: float = 0.5) -> torch.Tensor:
    """ComfyUI's `apply_model` on a fixed input, after loading the MODEL the normal way."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])
    params = model.model.diffusion_model.params
    device = model.load_device
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, params.in_channels, 16, 16, generator=gen)
    cond = {
        "c_crossattn": torch.randn(1, 16, params.context_in_dim, generator=gen).to(device),
        "y": torch.randn(1, params.vec_in_dim, generator=gen).to(device),
        "guidance": torch.tensor([1.0], device=device),
    }
    options = model.model_options["transformer_options"]
    with torch.no_grad():
        out = model.model.apply_model(
            x.to(device), torch.tensor([sigma], device=device), transformer_options=options, **cond
        )
    return out.float().cpu()


class LoraPatches:
    """How many weight keys `model` has patched beyond `base`, the largest difference of their
    outputs, and the device the model ran on (UI output)."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ()
    FUNCTION = "compare"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "base": ("MODEL",)}}

    def compare(self, model, base):
        added = set(model.patches) - set(base.patches)
        with_lora, without = flux_output(model), flux_output(base)
        return {
            "ui": {
                "patched_keys": [len(added)],
                "difference": [float((with_lora - without).abs().max())],
                "device": [str(model.load_device)],
            }
        }


NODE_CLASS_MAPPINGS = {"KTTest_GPULoraPatches": LoraPatches}
