"""What the application and the nodes read of a ComfyUI MODEL (a `ModelPatcher`), and the one
place that reads it: its layers, how they are stored, the dtype ComfyUI computes it in, its load
device, and its latent format's scaling. `application/` and `nodes/` go through these (issue 43
item 1: a family whose MODEL is built otherwise changes this module, not them;
`tests/test_layers.py` checks that they do not reach into the MODEL themselves).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..trainer_core.fingerprint import structure_digest, weights_identity
from ..trainer_core.vram import module_weight_bytes
from .cast_contract import linear_names
from .comfy_quantized import weight_formats


def base_model(model):
    """ComfyUI's model object inside the MODEL (`comfy.model_base.BaseModel`): what its sampling
    calls, and what `model_family.text_in` reads the text format from."""
    return model.model


def diffusion_module(model) -> torch.nn.Module:
    """ComfyUI's diffusion model inside the MODEL (the module the LoRA's layers are in)."""
    return model.model.diffusion_model


def layer_names(model) -> list[str]:
    """Every Linear of the diffusion model a LoRA can adapt, by its module name."""
    return linear_names(diffusion_module(model))


def layer_shapes(model) -> dict[str, tuple[int, int]]:
    """(out, in) features of each of `layer_names`."""
    modules = dict(diffusion_module(model).named_modules())
    return {name: (modules[name].out_features, modules[name].in_features) for name in layer_names(model)}


def stored_formats(model) -> dict[str, dict[str, int]]:
    """How the loader stored the layers' weights (`comfy_quantized.weight_formats`)."""
    return weight_formats(diffusion_module(model))


def stored_bytes(model) -> int:
    """The bytes the diffusion model's weights take as stored."""
    return module_weight_bytes(diffusion_module(model))


def compute_dtype(model) -> torch.dtype:
    """The dtype ComfyUI computes the model in: its manual-cast dtype, else its weights'."""
    base = model.model
    return getattr(base, "manual_cast_dtype", None) or base.get_dtype()


def load_device(model) -> torch.device:
    """Where ComfyUI loads the model to run it."""
    return model.load_device


def latent_in(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's latent format going in (ComfyUI's `process_latent_in`): what sampling does to
    a VAE latent before the model sees it."""
    return model.model.process_latent_in


def base_fingerprint(model) -> str:
    """A cheap fingerprint of the base weights as loaded (`trainer_core.fingerprint`: names,
    shapes, dtypes and at most 64 sampled values per tensor): two files of one architecture
    (another seed, another release, another precision) differ. Weights ComfyUI patched in place
    count as their originals (the patcher's backup), its patches by their own fingerprint; a
    tensor whose values cannot be sampled here (a quantized tensor subclass) counts by name,
    shape and dtype (its scales are sampled)."""
    backup = getattr(model, "backup", None) or {}

    def tensors():
        for name, tensor in diffusion_module(model).state_dict(keep_vars=True).items():
            kept = backup.get(f"diffusion_model.{name}")
            tensor = kept.weight if kept is not None else tensor
            if type(tensor) in (torch.Tensor, torch.nn.Parameter):
                yield name, tensor
            else:
                yield name, torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")

    with torch.no_grad():  # a LoRA the graph applies to the MODEL is part of the base it trains on
        return weights_identity(
            tensors(), extra=("base model", structure_digest(getattr(model, "patches", {})))
        )
