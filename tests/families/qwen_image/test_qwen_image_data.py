"""Qwen-Image-Edit's data side (issue 43 item 1): a sample is encoded as sampling encodes it.
LoadKontextDataset, in ComfyUI's executor with the tiny Qwen2.5-VL text encoder and Wan 2.1 VAE
built by ComfyUI's classes (`kt_testing.qwen_image`), learns the family from its CLIP and runs
ComfyUI's `TextEncodeQwenImageEditPlus` on each caption with the sample's reference images: the
cached text (vision tokens included) and reference latents are exactly what that node gives in
a graph; the empty prompt keeps the images; a second pass encodes nothing; and the tiny
Qwen-Image trains a step on what was cached."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from kt_testing.datasets import write_one_folder
from kt_testing.executor import InGraph, run_node
from kt_testing.gradients import randomise_lora
from kt_testing.graphs import cache_name, dataset_inputs
from kt_testing.qwen_image import small_wan_vae, tiny_qwen_image_clip
from kt_testing.tiny_models import tiny_qwen_image_patcher

pytestmark = pytest.mark.usefixtures("comfy_runtime")


@pytest.fixture(scope="module")
def encoders():
    return tiny_qwen_image_clip(seed=2), small_wan_vae(seed=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_one_folder(tmp_path_factory.mktemp("qwen") / "set", ["a", "b"], references=1, size=(64, 48))


@pytest.fixture(scope="module")
def built(registered, encoders, folder, tmp_path_factory):
    clip, vae = encoders
    inputs = dataset_inputs(InGraph(lambda: vae), InGraph(lambda: clip), folder, cache_name(tmp_path_factory))
    first = run_node("KontextTrainer_LoadKontextDataset", inputs).outputs[0]
    again = run_node("KontextTrainer_LoadKontextDataset", inputs).outputs[0]
    return first, again


def load_image(path) -> torch.Tensor:
    """The IMAGE the stock LoadImage gives for an opaque RGB file."""
    with Image.open(path) as image:
        pixels = np.asarray(ImageOps.exif_transpose(image).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(pixels)[None]


def stock_encoding(clip, vae, prompt: str, reference) -> tuple:
    """ComfyUI's node in its executor: (context, reference latents)."""
    inputs = {
        "clip": InGraph(lambda: clip),
        "prompt": prompt,
        "image1": InGraph(lambda: load_image(reference)),
    }
    if vae is not None:
        inputs["vae"] = InGraph(lambda: vae)
    ((context, extras),) = run_node("TextEncodeQwenImageEditPlus", inputs).outputs[0]
    return context[0], [latent[0] for latent in extras.get("reference_latents", [])]


def test_each_sample_is_what_comfyuis_encoder_node_gives_in_a_graph(built, encoders, folder):
    clip, vae = encoders
    dataset, again = built
    assert dataset.encoded_texts == 2 * 2 + 1  # each sample's text and empty prompt, the dataset's empty
    assert dataset.encoded_images == 2 + 2  # the targets, and one reference each (by the node)
    assert again.encoded_texts == 0 and again.encoded_images == 0
    assert dataset.notices[-1].startswith(
        "each caption is encoded with its sample's reference images by ComfyUI's "
        "TextEncodeQwenImageEditPlus node"
    )
    for entry in dataset.entries[:1]:  # (each stock call encodes the reference at 1 MP again)
        reference = folder / f"{entry.name}_control.png"
        context, (latent,) = stock_encoding(clip, vae, entry.caption, reference)
        sample = dataset.sample(entry)
        assert torch.equal(sample.context, context)
        (ours,) = sample.references
        assert ours.shape == latent.shape and ours.shape[:2] == (16, 1)  # 5-D: Wan 2.1's, at about 1 MP
        assert torch.equal(ours, latent)
        # the empty prompt keeps the picture: the node with "" and the same image
        empty, _ = stock_encoding(clip, None, "", reference)
        assert torch.equal(sample.empty.context, empty)
        # the vision tokens are in the text: without the image the caption encodes shorter
        plain = clip.encode_from_tokens_scheduled(clip.tokenize(entry.caption))[0][0]
        assert context.shape[0] > plain.shape[1] + 20


def test_the_tiny_qwen_image_trains_a_step_on_the_cached_samples(built, registered, pack):
    """What the dataset cached, through ComfyUI's latent format, is what the model takes: one
    step of the loss with every caption dropped (each sample's own empty prompt reaches the
    model) and a gradient."""
    ft = importlib.import_module(f"{pack.__name__}.comfy_adapter.lora_session")
    training_run = importlib.import_module(f"{pack.__name__}.comfy_adapter.model_view")
    dataset, _ = built
    model = tiny_qwen_image_patcher(seed=3)
    samples = [dataset.sample(e, latent_in=training_run.latent_in(model)) for e in dataset.entries]
    config = ft.TrainConfig(rank=2, alpha=2.0, caption_dropout=1.0, batch_size=2)
    contexts = []
    with ft.lora_session(model, config) as session:
        predict = session.predict

        def recorded(batch, sigma, context, pooled):
            contexts.extend(context)
            return predict(batch, sigma, context, pooled)

        session.predict = recorded
        randomise_lora(session, seed=1)
        loss = session.loss(samples, torch.Generator().manual_seed(0))
        grads = torch.autograd.grad(loss, session.lora.parameters())
    assert len(contexts) == 2
    for context, sample in zip(contexts, samples, strict=True):
        assert torch.equal(context, sample.empty.context)
        assert sample.empty.context.shape[0] < sample.context.shape[0]  # the caption's tokens
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_trainlora_trains_qwen_image_edit_and_the_stock_loader_applies_every_key(
    built, registered, pack, caplog
):
    """The user's node in ComfyUI's executor: TrainLoRA on the Qwen dataset and the tiny
    Qwen-Image (layout auto: 2509's `index`; checkpointed, a block swapped, caption dropout), two
    steps; the LoRA's metadata names the model as musubi-tuner does; the stock
    LoraLoaderModelOnly applies every key of it (its output is the trained MODEL's)."""
    import dataclasses
    import logging
    from pathlib import Path

    import folder_paths

    from kt_testing.probes import model_output

    config = importlib.import_module(f"{pack.__name__}.trainer_core.config").TrainConfig
    lora_file = importlib.import_module(f"{pack.__name__}.trainer_core.lora_file")
    settings = {f.name: f.default for f in dataclasses.fields(config)}
    settings.update(steps=2, rank=2, alpha=2.0, learning_rate=1e-3, layout="auto", caption_dropout=0.5)
    settings.update(gradient_checkpointing=True, blocks_to_swap=1, targets="all_linear")
    inputs = {
        "model": InGraph(lambda: tiny_qwen_image_patcher(seed=3)),
        "dataset": built[0],
        "lora_name": "kt_qwen_edit",
        "overwrite": False,
        "resume_from": "none",
        **settings,
    }
    trained, name, losses = run_node("KontextTrainer_TrainLoRA", inputs, node_id="9").outputs[:3]
    assert len(losses["loss"]) == 2 and all(loss == loss for loss in losses["loss"])
    tensors, metadata = lora_file.load(Path(folder_paths.get_folder_paths("loras")[0]) / name)
    assert metadata["ss_base_model_version"] == "qwen_image_edit_plus"
    assert metadata["modelspec.architecture"] == "Qwen-Image-Edit-Plus/lora"
    assert metadata["kontext_trainer.layout"] == "index"
    assert len([k for k in tensors if k.endswith(".lora_down.weight")]) == 14 + 10
    with caplog.at_level(logging.WARNING):
        stock = run_node(
            "LoraLoaderModelOnly",
            {
                "model": InGraph(lambda: tiny_qwen_image_patcher(seed=3)),
                "lora_name": name,
                "strength_model": 1.0,
            },
        ).outputs[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    outputs = [model_output(m, text=(5, 64), pooled=0, channels=16, frames=1) for m in (trained, stock)]
    assert torch.equal(outputs[0], outputs[1])
