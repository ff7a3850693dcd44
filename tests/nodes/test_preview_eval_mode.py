"""Previews sample the LoRA as it will be used: in eval mode (LoRA dropout off), with the
training mode put back for the next step."""

from __future__ import annotations

import importlib

import torch

from kt_testing.executor import InGraph, run_node
from kt_testing.graphs import preview_inputs
from kt_testing.tiny_models import small_flux_vae, tiny_clip, tiny_flux_patcher


def test_previews_sample_without_lora_dropout_and_restore_train_mode(pack):
    ft = importlib.import_module(f"{pack.__name__}.comfy_adapter.lora_session")
    previews = importlib.import_module(f"{pack.__name__}.comfy_adapter.previews")
    lora_file = importlib.import_module(f"{pack.__name__}.trainer_core.lora_file")
    clip = tiny_clip(seed=2)
    positive = clip.encode_from_tokens_scheduled(clip.tokenize("make it blue"))
    vae = InGraph(lambda: small_flux_vae(seed=1))
    settings = run_node("KontextTrainer_PreviewSampler", preview_inputs(positive, vae, 1)).outputs[0]
    model = tiny_flux_patcher(seed=3)
    # a LoRA with a visible effect (peft's own init has lora_B = 0, where dropout changes nothing)
    gen = torch.Generator().manual_seed(0)
    flux = model.model.diffusion_model
    initial = {}
    for name in ("double_blocks.0.img_attn.qkv", "single_blocks.0.linear1"):
        weight = flux.get_submodule(name).weight
        initial[name] = lora_file.LoraModule(
            torch.randn(2, weight.shape[1], generator=gen),
            torch.randn(weight.shape[0], 2, generator=gen),
            2.0,
        )
    images = {}
    for dropout in (0.0, 0.5):
        config = ft.TrainConfig(rank=2, alpha=2.0, dropout=dropout, gradient_checkpointing=False)
        with ft.lora_session(model, config, initial) as session:
            modes = [m.training for m in session.diffusion_model.modules()]
            images[dropout] = previews.sample_previews(session, settings, "offset")
            assert [m.training for m in session.diffusion_model.modules()] == modes
            assert session.diffusion_model.training == (dropout > 0)
    assert float(images[0.0].std()) > 0
    # dropout 0.5 in train mode would drop half of every LoRA input: a different image
    assert torch.equal(images[0.5], images[0.0])
