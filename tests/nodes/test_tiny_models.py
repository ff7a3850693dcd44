"""The tiny-model fixtures: built by ComfyUI's own classes, seeded, and runnable."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_flux(comfy_runtime):
    from kt_testing.tiny_models import tiny_flux_patcher

    return tiny_flux_patcher(seed=0)


def _conditioning(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return {
        "c_crossattn": torch.randn(1, 5, 48, generator=gen),
        "y": torch.randn(1, 32, generator=gen),
        "guidance": torch.tensor([1.0]),
    }


def test_tiny_flux_is_comfyuis_flux_with_seeded_weights(comfy_runtime, tiny_flux):
    import comfy.model_base
    import comfy.model_patcher

    from kt_testing.tiny_models import tiny_flux_patcher

    assert isinstance(tiny_flux, comfy.model_patcher.ModelPatcher)
    assert isinstance(tiny_flux.model, comfy.model_base.Flux)
    same = tiny_flux_patcher(seed=0).model.state_dict()
    other = tiny_flux_patcher(seed=1).model.state_dict()
    for key, value in tiny_flux.model.state_dict().items():
        assert torch.isfinite(value).all(), key
        assert torch.equal(value, same[key]), key
    assert not torch.equal(
        tiny_flux.model.state_dict()["diffusion_model.img_in.weight"], other["diffusion_model.img_in.weight"]
    )


@torch.no_grad()
def test_tiny_flux_forward_with_one_reference_latent(tiny_flux):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 8, 8, generator=gen)
    ref = torch.randn(1, 16, 8, 12, generator=gen)  # a reference of another size than the target
    sigma = torch.tensor([0.7])
    cond = _conditioning(1)
    with_ref = tiny_flux.model.apply_model(x, sigma, ref_latents=[ref], **cond)
    without = tiny_flux.model.apply_model(x, sigma, **cond)
    assert with_ref.shape == x.shape and torch.isfinite(with_ref).all()
    # The reference tokens are attended to: they change the prediction of the target tokens.
    assert (with_ref - without).abs().max() > 1e-3
    # Deterministic: the same call gives the same output.
    assert torch.equal(with_ref, tiny_flux.model.apply_model(x, sigma, ref_latents=[ref], **cond))


@torch.no_grad()
def test_small_vae_round_trip_shapes(comfy_runtime):
    from kt_testing.tiny_models import small_flux_vae

    vae = small_flux_vae(seed=0)
    image = torch.rand(2, 64, 48, 3, generator=torch.Generator().manual_seed(0))
    latent = vae.encode(image)
    assert latent.shape == (2, 16, 8, 6)  # Flux: 16 channels, 8x downscale
    decoded = vae.decode(latent)
    assert decoded.shape == image.shape
    assert decoded.min() >= 0 and decoded.max() <= 1


def test_tiny_models_built_as_dynamic_vram_builds_them_match_the_eager_build(comfy_runtime, monkeypatch):
    """ComfyUI 0.33 under dynamic VRAM (the command line on an NVIDIA GPU) builds Linear layers
    with no weight until its loader assigns one: the tiny models must get every weight there too,
    the same values as an eager build, or the first forward stops in ComfyUI's cast (the GPU run
    of session 19: "'NoneType' object has no attribute 'device'" in the tiny CLIP)."""
    import comfy.ops

    from kt_testing.tiny_models import tiny_clip, tiny_flux_patcher

    if not hasattr(comfy.ops.disable_weight_init, "_lazy_load_from_state_dict"):
        pytest.skip("this ComfyUI builds every weight eagerly (0.3.75: no dynamic VRAM)")
    import comfy.memory_management

    eager_clip, eager_flux = tiny_clip(seed=2), tiny_flux_patcher(seed=3)
    monkeypatch.setattr(comfy.memory_management, "aimdo_enabled", True)
    lazy_clip, lazy_flux = tiny_clip(seed=2), tiny_flux_patcher(seed=3)
    lazy_layers = [m for m in lazy_clip.cond_stage_model.modules() if hasattr(m, "comfy_need_lazy_init_bias")]
    assert lazy_layers  # the lazy build happened
    pairs = ((eager_clip.cond_stage_model, lazy_clip.cond_stage_model), (eager_flux.model, lazy_flux.model))
    for eager, lazy in pairs:
        expected, got = eager.state_dict(), lazy.state_dict()
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
    tokens = lazy_clip.tokenize("a red cube")
    assert torch.equal(lazy_clip.encode_from_tokens(tokens), eager_clip.encode_from_tokens(tokens))
