"""A LoRA's weight changes as ComfyUI's stock path applies it, against our modules' deltas."""

from __future__ import annotations

import torch


def stock_deltas(patcher, lora: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """Weight changes when ComfyUI's stock path applies `lora` at strength 1."""
    import comfy.sd

    model = patcher.model.diffusion_model
    before = {name: model.get_submodule(name).weight.detach().clone() for name in names}
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0.0)
    patched.patch_model(device_to=torch.device("cpu"))
    try:
        after = {name: model.get_submodule(name).weight.detach().clone() for name in names}
    finally:
        patched.unpatch_model(device_to=torch.device("cpu"))
    return {name: after[name] - before[name] for name in names if not torch.equal(after[name], before[name])}


def assert_same_deltas(ours, stock):
    assert set(ours) == set(stock)
    for name, module in ours.items():
        expected = stock[name]
        error = (module.delta() - expected).abs().max() / expected.abs().max()
        assert error <= 1e-6, (name, float(error))
