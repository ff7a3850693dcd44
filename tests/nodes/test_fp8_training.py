"""Training on fp8 base weights as the stock UNETLoader loads them (weight_dtype fp8_e4m3fn /
fp8_e5m2: weights stored in fp8, computed in fp32 on CPU through ComfyUI's manual-cast ops)."""

from __future__ import annotations

import pytest
import torch

from kt_testing.probes import model_output, tiny_samples
from kt_testing.tiny_models import tiny_flux_patcher


@pytest.fixture(scope="module")
def mods(pack_import):
    names = {
        "ft": "nodes.flux_training",
        "loop": "trainer_core.loop",
        "flow_step": "trainer_core.flow_step",
        "vram": "trainer_core.vram",
        "fp8_scaled": "nodes.fp8_scaled",
    }
    return type("Mods", (), {key: pack_import(name) for key, name in names.items()})


def fp8_model(dtype, seed=1):
    return tiny_flux_patcher(seed=seed, dtype=dtype, manual_cast_dtype=torch.float32)


apply = model_output


def run(mods, model, steps=8, fp8_mode="as_loaded"):
    samples = tiny_samples(mods.flow_step.Sample, 4, 2, [(8, 8)])
    config = mods.ft.TrainConfig(steps=steps, rank=4, alpha=4.0, learning_rate=1e-3, fp8_mode=fp8_mode)
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


def session_output(mods, model, fp8_mode):
    """Sampling-time output inside a training session (LoRA still zero), and the weight dtype
    of an attention, a fused single-block and a modulation layer."""
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, fp8_mode=fp8_mode)
    with mods.ft.flux_lora_session(model, config) as session:
        out = model_output(session.patcher, transformer_options=session.transformer_options())
        names = ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear2", "double_blocks.0.img_mod.lin")
        layers = [session.diffusion_model.get_submodule(n) for n in names]
        dtypes = [getattr(layer, "base_layer", layer).weight.dtype for layer in layers]
    return out, dtypes


def test_fp8_scaled_is_closer_than_a_plain_fp8_cast_and_keeps_modulation(mods):
    full = apply(tiny_flux_patcher(seed=1))
    scaled, dtypes = session_output(mods, tiny_flux_patcher(seed=1), "fp8_scaled")
    assert dtypes == [torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32]  # modulation as loaded
    plain = apply(fp8_model(torch.float8_e4m3fn))

    def error(out):
        return float((out - full).pow(2).mean().sqrt() / full.pow(2).mean().sqrt())

    assert 0 < error(scaled) < error(plain) and error(scaled) <= 0.05


def test_fp8_scaled_training_follows_full_precision_and_restores_the_model(mods):
    model = tiny_flux_patcher(seed=1)
    before, parameters = apply(model), dict(model.model.diffusion_model.named_parameters())
    qkv = model.model.diffusion_model.double_blocks[0].img_attn.qkv
    hooks_before = list(qkv.__dict__.get("weight_function", ["class default"]))
    full = torch.tensor(run(mods, tiny_flux_patcher(seed=1)))
    scaled = torch.tensor(run(mods, model, fp8_mode="fp8_scaled"))
    assert float(((scaled - full).abs() / full).max()) <= 0.02
    assert torch.equal(apply(model), before)
    after = dict(model.model.diffusion_model.named_parameters())
    assert all(after[name] is parameter for name, parameter in parameters.items())  # the same objects
    assert (
        list(qkv.__dict__.get("weight_function", ["class default"])) == hooks_before
    )  # ComfyUI's hooks as they were


def test_fp8_scaled_storage(mods):
    fp8_scaled = mods.fp8_scaled
    weight = torch.randn(12, 3072, generator=torch.Generator().manual_seed(0))  # Flux in-features
    values, scale = fp8_scaled.quantize_rows(weight)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (12,)
    # by hand: each row's largest magnitude maps to e4m3's largest value, 448
    assert torch.equal(values.float().abs().amax(dim=1), torch.full((12,), 448.0))
    stored = values.numel() * values.element_size() + scale.numel() * scale.element_size()
    assert stored <= 0.52 * weight.numel() * 2  # against the same weight in bf16
    torch.testing.assert_close(values.float() * scale[:, None], weight, rtol=0.07, atol=1e-6)
