"""A LoRA file we write is applied by ComfyUI's stock LoraLoaderModelOnly exactly as
W + (alpha / rank) * B @ A on every named module."""

from __future__ import annotations

import torch

from kt_testing.executor import run_node
from trainer_core.lora_file import LoraModule, save_atomic, to_state_dict


def test_stock_lora_loader_applies_our_file(comfy_runtime):
    import folder_paths

    from kt_testing.tiny_models import tiny_flux_patcher

    model = tiny_flux_patcher(seed=7)
    flux = model.model.diffusion_model
    gen = torch.Generator().manual_seed(3)
    targets = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.0", "single_blocks.0.linear1"]
    modules = {}
    for name in targets:
        weight = flux.get_submodule(name).weight
        rank = 4
        modules[name] = LoraModule(
            torch.randn(rank, weight.shape[1], generator=gen) * 0.1,
            torch.randn(weight.shape[0], rank, generator=gen) * 0.1,
            alpha=2.0,
        )
    loras_dir = folder_paths.get_folder_paths("loras")[0]
    save_atomic(to_state_dict(modules), f"{loras_dir}/kt_test_lora.safetensors")

    (patched,) = run_node(
        "LoraLoaderModelOnly",
        {"model": model, "lora_name": "kt_test_lora.safetensors", "strength_model": 1.0},
    ).outputs

    # Independent expectation: the same tiny Flux with the deltas added to its weights by hand.
    reference = tiny_flux_patcher(seed=7)
    with torch.no_grad():
        for name, module in modules.items():
            layer = reference.model.diffusion_model.get_submodule(name)
            layer.weight += (module.alpha / 4) * module.up @ module.down

    import comfy.model_management

    comfy.model_management.load_models_gpu([patched])
    x, ref = torch.randn(1, 16, 8, 8, generator=gen), torch.randn(1, 16, 8, 8, generator=gen)
    cond = {
        "c_crossattn": torch.randn(1, 5, 48, generator=gen),
        "y": torch.randn(1, 32, generator=gen),
        "guidance": torch.tensor([1.0]),
        "ref_latents": [ref],
    }
    with torch.no_grad():
        got = patched.model.apply_model(x, torch.tensor([0.4]), **cond)
        expected = reference.model.apply_model(x, torch.tensor([0.4]), **cond)
        unpatched = tiny_flux_patcher(seed=7).model.apply_model(x, torch.tensor([0.4]), **cond)
    assert (got - expected).abs().max() <= 1e-5
    assert (got - unpatched).abs().max() > 1e-3  # the LoRA really changed the output
