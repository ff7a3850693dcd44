"""The demo's generated files load through ComfyUI's stock loader nodes, with no key lost."""

from __future__ import annotations

import logging

import pytest
import torch

from kt_testing.executor import run_node

pytestmark = pytest.mark.slow


def _no_missing_keys(caplog):
    missing = [
        r.getMessage()[:200]
        for r in caplog.records
        if r.levelno >= logging.WARNING and ("missing" in r.getMessage().lower())
    ]
    assert not missing


def test_unet_loader_reads_the_demo_flux(comfy_runtime, stock_assets, caplog):
    caplog.set_level(logging.WARNING)
    (model,) = run_node(
        "UNETLoader", {"unet_name": stock_assets["flux"].name, "weight_dtype": "default"}
    ).outputs
    _no_missing_keys(caplog)
    config = model.model.model_config.unet_config
    assert config["hidden_size"] == 3072 and config["depth"] == 1 and config["depth_single_blocks"] == 1
    assert config["context_in_dim"] == 768 and config["vec_in_dim"] == 768 and config["guidance_embed"]
    # Weights are the seeded ones that were written (bf16 on disk), not a fresh init.
    from safetensors import safe_open

    with safe_open(str(stock_assets["flux"]), "pt") as f:
        on_disk = f.get_tensor("double_blocks.0.img_attn.qkv.weight")
    loaded = model.model.diffusion_model.double_blocks[0].img_attn.qkv.weight
    assert torch.equal(loaded.to(on_disk.dtype), on_disk)


def test_vae_loader_reads_the_ae_key_names(comfy_runtime, stock_assets, caplog):
    caplog.set_level(logging.WARNING)
    (vae,) = run_node("VAELoader", {"vae_name": stock_assets["vae"].name}).outputs
    _no_missing_keys(caplog)
    assert vae.latent_channels == 16
    with torch.no_grad():
        latent = vae.encode(torch.rand(1, 64, 32, 3))
    assert latent.shape == (1, 16, 8, 4) and torch.isfinite(latent).all()


def test_clip_loader_reads_the_clip_l_and_drives_the_demo_flux(comfy_runtime, stock_assets, caplog):
    caplog.set_level(logging.WARNING)
    (clip,) = run_node(
        "CLIPLoader", {"clip_name": stock_assets["clip"].name, "type": "stable_diffusion"}
    ).outputs
    _no_missing_keys(caplog)
    (cond,) = run_node("CLIPTextEncode", {"clip": clip, "text": "a red chair"}).outputs
    tokens, extras = cond[0]
    assert tokens.shape == (1, 77, 768) and extras["pooled_output"].shape == (1, 768)
    (other,) = run_node("CLIPTextEncode", {"clip": clip, "text": "a blue sofa"}).outputs
    assert not torch.equal(other[0][0], tokens)  # the weights are real, the prompt matters
    # The CLIP-L embeddings fit the demo Flux's txt_in / vector_in.
    (model,) = run_node(
        "UNETLoader", {"unet_name": stock_assets["flux"].name, "weight_dtype": "default"}
    ).outputs
    with torch.no_grad():
        out = model.model.apply_model(
            torch.randn(1, 16, 4, 4),
            torch.tensor([0.5]),
            c_crossattn=tokens,
            y=extras["pooled_output"],
            guidance=torch.tensor([1.0]),
            ref_latents=[torch.randn(1, 16, 4, 4)],
        )
    assert out.shape == (1, 16, 4, 4) and torch.isfinite(out).all()
