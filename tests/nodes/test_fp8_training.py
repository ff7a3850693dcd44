"""Training on fp8 base weights as the stock UNETLoader loads them (weight_dtype fp8_e4m3fn /
fp8_e5m2: weights stored in fp8, computed in fp32 on CPU through ComfyUI's manual-cast ops)."""

from __future__ import annotations

import importlib

import pytest
import torch

from kt_testing.tiny_models import tiny_flux_patcher


@pytest.fixture(scope="module")
def mods(pack):
    def load(name):
        return importlib.import_module(f"{pack.__name__}.{name}")

    return type(
        "Mods",
        (),
        {
            "ft": load("nodes.flux_training"),
            "loop": load("trainer_core.loop"),
            "flow_step": load("trainer_core.flow_step"),
            "vram": load("trainer_core.vram"),
        },
    )


def fp8_model(dtype, seed=1):
    return tiny_flux_patcher(seed=seed, dtype=dtype, manual_cast_dtype=torch.float32)


def apply(model, seed=0):
    import comfy.model_management

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 8, 8, generator=gen)
    cond = {
        "c_crossattn": torch.randn(1, 5, 48, generator=gen),
        "y": torch.randn(1, 32, generator=gen),
        "guidance": torch.tensor([1.0]),
    }
    comfy.model_management.load_models_gpu([model])
    with torch.no_grad():
        return model.model.apply_model(x, torch.tensor([0.5]), **cond)


def run(mods, model, steps=8):
    gen = torch.Generator().manual_seed(2)
    samples = [
        mods.flow_step.Sample(
            torch.randn(16, 8, 8, generator=gen),
            torch.randn(5, 48, generator=gen),
            torch.randn(32, generator=gen),
            [torch.randn(16, 8, 8, generator=gen)],
        )
        for _ in range(4)
    ]
    config = mods.ft.TrainConfig(steps=steps, rank=4, alpha=4.0, learning_rate=1e-3)
    with mods.ft.flux_lora_session(model, config) as session:
        assert {p.dtype for p in session.lora.parameters()} == {torch.float32}
        return mods.loop.train(
            config, session.lora.parameters(), lambda i: [samples[i % 4]], session.loss
        ).losses


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_weights_take_half_of_bf16(mods, dtype):
    stored = mods.vram.module_weight_bytes(fp8_model(dtype).model.diffusion_model)
    bf16 = mods.vram.module_weight_bytes(
        tiny_flux_patcher(seed=1, dtype=torch.bfloat16).model.diffusion_model
    )
    assert stored <= 0.52 * bf16


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float8_e4m3fn, 0.08), (torch.float8_e5m2, 0.15)])
def test_fp8_forward_is_close_to_full_precision(dtype, tolerance):
    """Relative RMS error of the model output; e4m3 keeps 3 mantissa bits (~6% per weight at
    worst), e5m2 2 bits, and errors partly cancel over a layer's sum."""
    full, quantised = apply(tiny_flux_patcher(seed=1)), apply(fp8_model(dtype))
    error = (quantised - full).pow(2).mean().sqrt() / full.pow(2).mean().sqrt()
    assert 0 < float(error) <= tolerance


def test_fp8_training_losses_follow_full_precision(mods):
    full = torch.tensor(run(mods, tiny_flux_patcher(seed=1)))
    fp8 = torch.tensor(run(mods, fp8_model(torch.float8_e4m3fn)))
    assert torch.isfinite(fp8).all()
    assert float(((fp8 - full).abs() / full).max()) <= 0.02


def test_fp8_model_is_untouched_by_training(mods):
    model = fp8_model(torch.float8_e4m3fn, seed=4)
    before = apply(model)
    run(mods, model, steps=2)
    assert torch.equal(apply(model), before)
    assert {p.dtype for p in model.model.diffusion_model.parameters()} == {torch.float8_e4m3fn}
