"""FLUX.2 through the nodes, run by ComfyUI's executor (inference mode, prompt thread): a
dataset encoded with a FLUX.2-style VAE (128 latent channels at 1/16) and a text encoder
without pooled output, TrainLoRA with previews, its LoRA file and metadata, an exact resume;
a dataset of the other family refused by name; the cache never shared between families."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from kt_testing.datasets import write_one_folder
from kt_testing.executor import InGraph, run_node
from kt_testing.graphs import cache_name, dataset_inputs, preview_inputs
from kt_testing.probes import model_output
from kt_testing.tiny_models import (
    small_flux2_vae,
    small_flux_vae,
    tiny_clip,
    tiny_flux2_patcher,
    tiny_klein_patcher,
)

TRAIN = "KontextTrainer_TrainLoRA"
DATASET = "KontextTrainer_LoadKontextDataset"


@pytest.fixture(scope="module")
def mods(pack_import):
    names = {
        "node": "nodes.train_lora",
        "config": "trainer_core.config",
        "lora_file": "trainer_core.lora_file",
    }
    return type("Mods", (), {key: pack_import(name) for key, name in names.items()})


@pytest.fixture(scope="module")
def folder(tmp_path_factory, comfy_runtime):
    return write_one_folder(
        tmp_path_factory.mktemp("data") / "set", ["a", "b", "c"], references=2, size=(64, 64)
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cache_name(tmp_path_factory)


def load_dataset(folder, cache, vae, clip):
    return run_node(DATASET, dataset_inputs(InGraph(vae), InGraph(clip), folder, cache)).outputs


@pytest.fixture(scope="module")
def dataset(folder, cache):
    return load_dataset(
        folder, cache, lambda: small_flux2_vae(seed=1), lambda: tiny_clip(seed=2, pooled=False)
    )[0]


def settings(mods, **overrides):
    defaults = {f.name: f.default for f in dataclasses.fields(mods.config.TrainConfig)}
    defaults.update(steps=4, rank=2, alpha=2.0, learning_rate=1e-3, gradient_checkpointing=False)
    defaults.update({"layout": "index", **overrides})
    return defaults


def run_train(mods, dataset, name, resume="none", preview=None, model=tiny_flux2_patcher, **overrides):
    inputs = {
        "model": InGraph(lambda: model(seed=3)),
        "dataset": dataset,
        "lora_name": name,
        "overwrite": False,
        "resume_from": resume,
        "preview": preview,
        **settings(mods, **overrides),
    }
    return run_node(TRAIN, inputs, node_id="7")


def loras_dir() -> Path:
    import folder_paths

    return Path(folder_paths.get_folder_paths("loras")[0])


def test_the_dataset_holds_flux2_latents_and_text_without_pooled_output(dataset):
    sample = dataset.sample(dataset.entries[0])
    # 256 px targets and 64 px references (dataset_inputs), at 1/16 with 128 channels
    assert sample.target.shape == (128, 16, 16)
    assert [tuple(r.shape) for r in sample.references] == [(128, 4, 4), (128, 4, 4)]
    assert sample.context.shape == (77, 48) and sample.pooled.numel() == 0


def test_trains_flux2_with_previews_writes_its_lora_and_resumes_exactly(mods, dataset):
    clip = tiny_clip(seed=2, pooled=False)
    positive = clip.encode_from_tokens_scheduled(clip.tokenize("make it blue"))
    vae = InGraph(lambda: small_flux2_vae(seed=1))
    preview = run_node("KontextTrainer_PreviewSampler", preview_inputs(positive, vae, 2)).outputs[0]
    common = {"steps": 4, "save_every": 2, "dropout": 0.1, "seed": 5, "caption_dropout": 0.5}
    result = run_train(mods, dataset, "kt_flux2_run", preview=preview, **common)
    model, name, loss_map, images = result.outputs[:4]
    assert len(loss_map["loss"]) == 4 and all(loss == loss for loss in loss_map["loss"])
    assert images.shape == (2, 64, 64, 3) and torch.isfinite(images).all() and float(images.std()) > 0

    state, metadata = mods.lora_file.load(loras_dir() / name)
    assert state and all(key.startswith("lora_unet_") for key in state)
    assert metadata["ss_base_model_version"] == "flux_2_dev"
    assert metadata["modelspec.architecture"] == "Flux.2-dev/lora"
    assert metadata["kontext_trainer.base_model"] == "flux2_dev"
    # The output MODEL is the input with the saved file applied by the stock loader.
    stock = run_node(
        "LoraLoaderModelOnly",
        {"model": InGraph(lambda: tiny_flux2_patcher(seed=3)), "lora_name": name, "strength_model": 1.0},
    ).outputs[0]
    outputs = [model_output(m, text=(77, 48), pooled=0, channels=128) for m in (model, stock)]
    assert torch.equal(outputs[0], outputs[1])

    choices = [c for c in mods.node.resume_choices() if c.startswith("kt_flux2_run/")]
    assert [c.rsplit("/", 1)[1] for c in choices] == ["step_000002", "step_000004"]
    resumed = run_train(mods, dataset, "kt_flux2_resumed", resume=choices[0], **common).outputs[2]
    assert resumed["loss"] == loss_map["loss"]


def test_trains_klein_as_its_own_model_resolved_once_per_run(mods, dataset, pack_import, monkeypatch, caplog):
    """Issue 42 item 1: a FLUX.2 without guidance_in is FLUX.2 [klein] (4B at any width but
    9B's): TrainLoRA trains it in FLUX.2's index layout, its LoRA's metadata names klein 4B as
    musubi-tuner does (and the stock LoraLoader applies every key of it), the run's first line
    says that ComfyUI cannot tell Base from distilled, and the run resolves the model's entry
    once (the checks, the estimate, the session, the metadata all use it), where it was looked
    up six times before."""
    model_family = pack_import("comfy_adapter.model_family")
    entries, resolve = [], model_family.entry_for

    def counted(*args, **kwargs):
        entries.append(resolve(*args, **kwargs))
        return entries[-1]

    monkeypatch.setattr(model_family, "entry_for", counted)
    # with what FLUX.2 [dev] trains with: its blocks checkpointed, fp8_scaled, a swapped block
    common = {
        "model": tiny_klein_patcher,
        "layout": "auto",
        "steps": 2,
        "gradient_checkpointing": True,
        "fp8_mode": "fp8_scaled",
        "blocks_to_swap": 1,
        "save_every": 1,
    }
    result = run_train(mods, dataset, "kt_klein_run", **common)
    klein = pack_import("comfy_adapter.families.flux").KLEIN_4B
    assert entries == [klein]
    trained, name, loss_map = result.outputs[:3]
    assert len(loss_map["loss"]) == 2 and all(loss == loss for loss in loss_map["loss"])
    # and an exact resume from its first checkpoint
    (first, _) = [c for c in mods.node.resume_choices() if c.startswith("kt_klein_run/")]
    resumed = run_train(mods, dataset, "kt_klein_resumed", resume=first, **common)
    assert resumed.outputs[2]["loss"] == loss_map["loss"]
    _, metadata = mods.lora_file.load(loras_dir() / "kt_klein_run.safetensors")
    assert metadata["ss_base_model_version"] == "flux_2_klein_4b"
    assert metadata["modelspec.architecture"] == "Flux.2-klein-4b/lora"
    assert metadata["kontext_trainer.base_model"] == "flux2_klein_4b"
    assert metadata["kontext_trainer.layout"] == "index"
    # the stock LoraLoader consumes every key: the output MODEL is the base with the file applied
    with caplog.at_level(logging.WARNING):
        stock = run_node(
            "LoraLoaderModelOnly",
            {"model": InGraph(lambda: tiny_klein_patcher(seed=3)), "lora_name": name, "strength_model": 1.0},
        ).outputs[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    outputs = [model_output(m, text=(77, 48), pooled=0, channels=128) for m in (trained, stock)]
    assert torch.equal(outputs[0], outputs[1])
    diffusers_applies_klein_file(loras_dir() / name, caplog)
    start_from_reads_klein_files_of_other_tools(pack_import, mods, loras_dir() / name, trained)
    messages = [event["message"] for event in result.events("kontext_trainer.progress") if event["message"]]
    assert messages and messages[0].startswith(
        "FLUX.2 [klein] 4B: ComfyUI cannot tell a Base file from a distilled one; train on Base "
        "(flux-2-klein-base-4b.safetensors)"
    ), messages[0]


# Where diffusers' FLUX.2 model has each kohya layer of ComfyUI's (diffusers'
# `_convert_kohya_flux2_lora_to_diffusers`, read from its source): fused q/k/v split in three.
DIFFUSERS_FLUX2 = {
    "double_blocks.{i}.img_attn.qkv": ["transformer_blocks.{i}.attn.to_" + x for x in "qkv"],
    "double_blocks.{i}.img_attn.proj": ["transformer_blocks.{i}.attn.to_out.0"],
    "double_blocks.{i}.txt_attn.qkv": ["transformer_blocks.{i}.attn.add_" + x + "_proj" for x in "qkv"],
    "double_blocks.{i}.txt_attn.proj": ["transformer_blocks.{i}.attn.to_add_out"],
    "double_blocks.{i}.img_mlp.0": ["transformer_blocks.{i}.ff.linear_in"],
    "double_blocks.{i}.img_mlp.2": ["transformer_blocks.{i}.ff.linear_out"],
    "double_blocks.{i}.txt_mlp.0": ["transformer_blocks.{i}.ff_context.linear_in"],
    "double_blocks.{i}.txt_mlp.2": ["transformer_blocks.{i}.ff_context.linear_out"],
    "single_blocks.{i}.linear1": ["single_transformer_blocks.{i}.attn.to_qkv_mlp_proj"],
    "single_blocks.{i}.linear2": ["single_transformer_blocks.{i}.attn.to_out"],
}


def diffusers_applies_klein_file(path: Path, caplog) -> None:
    """diffusers 0.42.1's `Flux2KleinPipeline` reads the file (its kohya FLUX.2 converter) into a
    `Flux2Transformer2DModel` of the tiny klein's shape (1 head of 128, 2 + 2 blocks, 48-wide
    text, no guidance) with no key left over, and each of its LoRA layers adds exactly our
    (alpha / rank) up @ down, split as its converter splits fused q/k/v."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    from trainer_core.lora_file import load as load_lora

    transformer = Flux2Transformer2DModel(
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=128,
        num_attention_heads=1,
        joint_attention_dim=48,
        guidance_embeds=False,
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diffusers"):
        state = Flux2KleinPipeline.lora_state_dict(str(path))
        Flux2KleinPipeline.load_lora_into_transformer(state, transformer)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "diffusers" in r.name]
    modules = dict(transformer.named_modules())
    ours, _ = load_lora(path)
    kohya = {key.split(".")[0] for key in ours}
    checked = 0
    for pattern, places in DIFFUSERS_FLUX2.items():
        for i in range(2):
            name = pattern.format(i=i)
            key = "lora_unet_" + name.replace(".", "_")
            if key not in kohya:
                continue
            down, up = ours[f"{key}.lora_down.weight"].double(), ours[f"{key}.lora_up.weight"].double()
            expected = float(ours[f"{key}.alpha"]) / down.shape[0] * (up @ down)
            got = torch.cat([lora_delta(modules[place.format(i=i)]) for place in places])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
            kohya.discard(key)
            checked += 1
    assert checked and not kohya, sorted(kohya)  # every layer of the file, each where it belongs


def start_from_reads_klein_files_of_other_tools(pack_import, mods, path: Path, model) -> None:
    """`start_from_lora` (`seed_lora`) reads the klein file in the other tools' key formats with
    the same change on every layer: musubi-tuner's (kohya's, ours), diffusers' (the file as
    diffusers' own converter gives it: `transformer.` names, q/k/v apart, alpha folded in) and
    ai-toolkit's (its FLUX.2 models are BFL's own classes, saved as `diffusion_model.<BFL
    module>.lora_A / lora_B` without alpha: `convert_lora_weights_before_save` in its
    flux2_model.py)."""
    from diffusers import Flux2KleinPipeline
    from safetensors.torch import save_file

    seed_lora = pack_import("application.training_run").seed_lora
    config = mods.config.TrainConfig(rank=2)
    modules = seed_lora(path, model, config)
    ours = {name: module.delta() for name, module in modules.items()}
    assert len(ours) == 20  # attention_mlp on 2 double and 2 single blocks
    diffusers = Flux2KleinPipeline.lora_state_dict(str(path))
    assert all(key.startswith("transformer.") for key in diffusers)
    ai_toolkit = {}
    for name, module in modules.items():
        ai_toolkit[f"diffusion_model.{name}.lora_A.weight"] = module.down
        ai_toolkit[f"diffusion_model.{name}.lora_B.weight"] = module.up * (module.alpha / module.rank)
    formats = {"diffusers": diffusers, "ai-toolkit": ai_toolkit}
    for tool, state in formats.items():
        other = path.with_name(f"{path.stem}_{tool}.safetensors")
        save_file({k: v.clone() for k, v in state.items()}, str(other))  # q, k, v share lora_A
        try:
            read = seed_lora(other, model, config)
        finally:
            other.unlink()
        assert set(read) == set(ours), tool
        for name, module in read.items():
            torch.testing.assert_close(module.delta(), ours[name], rtol=1e-5, atol=1e-7, msg=f"{tool} {name}")


def lora_delta(layer) -> torch.Tensor:
    """What a peft LoRA layer adds to its base weight (adapter "default_0", diffusers' name)."""
    (adapter,) = layer.lora_A.keys()
    a, b = layer.lora_A[adapter].weight.double(), layer.lora_B[adapter].weight.double()
    return layer.scaling[adapter] * (b @ a)


def test_layout_auto_is_flux2s_own_index_and_resumes_a_run_that_named_it(mods, dataset):
    """Issue 42 item 2: TrainLoRA's layout `auto` (its default now) is the model's own, ComfyUI's
    `default_ref_method` for it: `index` for FLUX.2. A run with `auto` trains exactly as one
    with `index` (equal losses) and records `index` in its LoRA; a checkpoint of the `index` run
    resumes under `auto` (the resume check compares the resolved layout); `offset` (the old
    default for every model) trains otherwise with these two references."""
    assert mods.config.TrainConfig().layout == "auto"
    common = {"steps": 2, "save_every": 1, "seed": 5}
    named = run_train(mods, dataset, "kt_flux2_index", layout="index", **common).outputs[2]["loss"]
    auto = run_train(mods, dataset, "kt_flux2_auto", layout="auto", **common).outputs[2]["loss"]
    assert auto == named
    _, metadata = mods.lora_file.load(loras_dir() / "kt_flux2_auto.safetensors")
    assert metadata["kontext_trainer.layout"] == "index"
    (first, _) = [c for c in mods.node.resume_choices() if c.startswith("kt_flux2_index/")]
    resumed = run_train(mods, dataset, "kt_flux2_auto_resumed", resume=first, layout="auto", **common)
    assert resumed.outputs[2]["loss"] == named
    offset = run_train(mods, dataset, "kt_flux2_offset", layout="offset", **common).outputs[2]["loss"]
    assert offset != named


def test_a_dataset_of_the_other_family_is_refused_by_name(mods, folder, cache):
    flux1_latents = load_dataset(folder, cache, lambda: small_flux_vae(seed=1), lambda: tiny_clip(seed=2))[0]
    with pytest.raises(ValueError, match=r"latents have 16 channels but this FLUX\.2 MODEL takes 128: give"):
        run_train(mods, flux1_latents, "kt_flux2_wrong")
    with pytest.raises(ValueError, match=r"layout 'dreamomni2' does not fit a FLUX\.2 model"):
        run_train(mods, flux1_latents, "kt_flux2_wrong", layout="dreamomni2")


def test_a_cache_filled_for_one_family_is_never_read_for_the_other(folder, tmp_path):
    """The same folder and text encoder, one cache: the FLUX.2 pass encodes every image again
    (its keys differ: another VAE and latent format), the FLUX.1 pass again hits only its own."""
    cache = f"kt_test_caches/{tmp_path.name}_shared"
    text = lambda: tiny_clip(seed=2)  # noqa: E731  (the same text encoder for both)
    first = load_dataset(folder, cache, lambda: small_flux_vae(seed=1), text)[0]
    second = load_dataset(folder, cache, lambda: small_flux2_vae(seed=1), text)[0]
    again = load_dataset(folder, cache, lambda: small_flux_vae(seed=1), text)[0]
    images = len(first.entries) * 3  # a target and two references each
    assert (first.encoded_images, second.encoded_images, again.encoded_images) == (images, images, 0)
    assert second.sample(second.entries[0]).target.shape[0] == 128
    assert first.content_hash != second.content_hash


def test_encoder_identities_name_the_latent_space_and_the_text_encoder(pack_import):
    """Same weights, another family's side: the VAE's latent space and the text encoder's
    class are part of the identity (and so of every cache key)."""
    identity = pack_import("comfy_adapter.comfy_encoders")
    vae, relabelled = small_flux_vae(seed=1), small_flux_vae(seed=1)
    assert identity.vae_identity(vae) == identity.vae_identity(relabelled)
    relabelled.latent_channels, relabelled.downscale_ratio = 128, 16
    assert identity.vae_identity(vae) != identity.vae_identity(relabelled)
    with_pooled, without = tiny_clip(seed=2), tiny_clip(seed=2, pooled=False)
    assert identity.clip_identity(with_pooled) != identity.clip_identity(without)
