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
from kt_testing.graphs import cache_name, dataset_inputs, preview_inputs
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


def test_previews_sample_as_the_stock_ksampler_with_the_encoder_nodes_conditioning(built, registered, pack):
    """Issue 43 item 4: a preview of a Qwen-Image-Edit run is what the stock KSampler and
    VAEDecode give in a graph for the same conditioning (the encoder node's text and reference
    latents, a negative holding the references, cfg 2.5), the same seed and size, with the run's
    layout on both (`offset` here, not the model's `index`): its empty latent is Wan 2.1's 5-D
    one. The LoRA starts at zero (peft's init), so the session's model is the base model."""
    ft = importlib.import_module(f"{pack.__name__}.comfy_adapter.lora_session")
    previews = importlib.import_module(f"{pack.__name__}.comfy_adapter.previews")
    dataset, _ = built
    sample = dataset.sample(dataset.entries[0])
    (reference,) = sample.references
    # the reference twice, cut to 16 x 12 latent pixels (the node's 1 MP costs time, not proof):
    # with one, `offset` and `index` place it alike
    reference = reference[..., :12, :16]
    references = [reference[None], reference.flip(-1)[None]]
    positive = [[sample.context[None], {"reference_latents": references}]]
    negative = [[torch.zeros_like(sample.context[None]), {"reference_latents": references}]]
    vae = small_wan_vae(seed=1)
    widgets = {**preview_inputs(None, None, 1), "cfg": 2.5, "steps": 2, "width": 80, "height": 64}
    del widgets["positive"], widgets["vae"]
    settings = run_node(
        "KontextTrainer_PreviewSampler",
        {
            **widgets,
            "positive": InGraph(lambda: positive),
            "negative": InGraph(lambda: negative),
            "vae": InGraph(lambda: vae),
        },
    ).outputs[0]
    model = tiny_qwen_image_patcher(seed=3)
    config = ft.TrainConfig(rank=2, alpha=2.0, gradient_checkpointing=False, layout="offset")
    with ft.lora_session(model, config) as session:
        ours = previews.sample_previews(session, settings, "offset")

    def stock_graph(conditioning):
        return [[c, {**o, "reference_latents_method": "offset"}] for c, o in conditioning]

    latent = run_node("EmptySD3LatentImage", {"width": 80, "height": 64, "batch_size": 1}).outputs[0]
    sampled = run_node(
        "KSampler",
        {
            "model": InGraph(lambda: tiny_qwen_image_patcher(seed=3)),
            "seed": 0,
            "steps": 2,
            "cfg": 2.5,
            "sampler_name": "euler",
            "scheduler": "simple",
            "positive": InGraph(lambda: stock_graph(positive)),
            "negative": InGraph(lambda: stock_graph(negative)),
            "latent_image": InGraph(lambda: latent),
            "denoise": 1.0,
        },
    ).outputs[0]
    (stock,) = run_node(
        "VAEDecode", {"samples": InGraph(lambda: sampled), "vae": InGraph(lambda: vae)}
    ).outputs
    stock = stock.reshape(-1, *stock.shape[-3:]).float()
    assert ours.shape == stock.shape == (1, 64, 80, 3)
    assert float(ours.std()) > 0
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-5)


def test_previews_with_true_cfg_and_no_negative_are_refused_naming_the_encoder_node(built, registered, pack):
    """The pack cannot make Qwen-Image-Edit's negative (its text holds the images): TrainLoRA
    refuses before training, naming the node to connect; at cfg 1 the negative is unused."""
    import dataclasses

    config = importlib.import_module(f"{pack.__name__}.trainer_core.config").TrainConfig
    settings = {f.name: f.default for f in dataclasses.fields(config)}
    settings.update(steps=1, rank=2, alpha=2.0, gradient_checkpointing=False, save_every=0, validate_every=0)
    vae = small_wan_vae(seed=1)
    dataset, _ = built
    positive = [[dataset.sample(dataset.entries[0]).context[None], {}]]
    for cfg, name in ((2.5, "kt_qwen_no_negative"), (1.0, "kt_qwen_cfg_one")):
        widgets = {**preview_inputs(None, None, 1), "cfg": cfg, "steps": 1}
        widgets.update(positive=InGraph(lambda: positive), vae=InGraph(lambda: vae))
        preview = run_node("KontextTrainer_PreviewSampler", widgets).outputs[0]
        inputs = {
            "model": InGraph(lambda: tiny_qwen_image_patcher(seed=3)),
            "dataset": dataset,
            "lora_name": name,
            "overwrite": False,
            "resume_from": "none",
            "preview": InGraph(lambda preview=preview: preview),
            **settings,
        }
        if cfg > 1:
            fix = "connect a TextEncodeQwenImageEditPlus with an empty prompt, the same images and the VAE"
            with pytest.raises(ValueError, match=f"cfg is 2.5 but it has no negative: .*{fix}"):
                run_node("KontextTrainer_TrainLoRA", inputs, node_id="9")
        else:
            losses = run_node("KontextTrainer_TrainLoRA", inputs, node_id="9").outputs[2]
            assert len(losses["loss"]) == 1
