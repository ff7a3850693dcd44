"""A third family, defined only in this folder, trains through the pack's run service.

The dummy Qwen-shaped model (`__init__.py`: `transformer_blocks`, no `.params`, no
`forward_orig`, its own block signature) is registered with the pack's family registry, and
nothing else of the pack is edited. Then LoadKontextDataset and TrainLoRA run in ComfyUI's
executor (inference mode, as the server runs them) for one step, with the forward guard (both
probes), gradient checkpointing and block swap, and the LoRA lands in models/loras; a resumed
run continues it exactly.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from families.qwen_like import CONFIG, IMAGE_MODEL, QwenLikeBlock, QwenLikeModel, build_patcher, family_for
from kt_testing.datasets import write_one_folder
from kt_testing.executor import InGraph, run_node
from kt_testing.graphs import cache_name, dataset_inputs
from kt_testing.tiny_models import small_flux_vae, tiny_clip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, comfy_runtime):
    folder = write_one_folder(
        tmp_path_factory.mktemp("data") / "set", ["a", "b"], references=1, size=(64, 64)
    )
    cache = cache_name(tmp_path_factory)
    # the tiny VAE's 16 latent channels and the tiny CLIP's 48-wide text fit the dummy model
    vae, clip = InGraph(lambda: small_flux_vae(seed=1)), InGraph(lambda: tiny_clip(seed=2, pooled=False))
    return run_node("KontextTrainer_LoadKontextDataset", dataset_inputs(vae, clip, folder, cache)).outputs[0]


@pytest.fixture
def registered(pack):
    families = pack.comfy_adapter.families
    family = family_for(pack)
    families.register(family)
    yield family
    families.unregister(family)


def train(pack, dataset, name: str, resume_from: str = "none", **overrides):
    config = pack.trainer_core.config.TrainConfig
    settings = {f.name: f.default for f in dataclasses.fields(config)}
    settings.update(steps=1, rank=2, alpha=2.0, learning_rate=1e-2, layout="index", targets="attention_mlp")
    settings.update(gradient_checkpointing=True, blocks_to_swap=1, **overrides)
    inputs = {
        "model": InGraph(lambda: build_patcher(seed=3)),
        "dataset": dataset,
        "lora_name": name,
        "overwrite": False,
        "resume_from": resume_from,
        **settings,
    }
    return run_node("KontextTrainer_TrainLoRA", inputs, node_id="5")


def test_the_pack_refuses_the_model_until_its_family_is_registered(pack, dataset):
    with pytest.raises(match=rf"this MODEL is a {IMAGE_MODEL} model; Kontext Trainer handles FLUX"):
        train(pack, dataset, "unregistered")


def test_a_family_in_its_own_folder_trains_one_step_with_guard_checkpointing_and_swap(
    pack, dataset, registered, monkeypatch
):
    family_type, swapper_type = type(registered), pack.trainer_core.block_swap.BlockSwapper
    probes, transfers, blocks_run = [], [], []
    real_probe, real_move = family_type.probe, swapper_type._move

    def probe(family, *args):
        probes.append(args[-1])  # the layout
        return real_probe(family, *args)

    def move(swapper, index, direction):
        transfers.append((direction, index))
        return real_move(swapper, index, direction)

    model_type, block_type, timesteps = QwenLikeModel, QwenLikeBlock, []
    real_forward, real_model_forward = block_type.forward, model_type.forward

    def model_forward(model, x, timestep, *args, **kwargs):
        timesteps.append(float(timestep.max()))
        return real_model_forward(model, x, timestep, *args, **kwargs)

    def forward(block, *args, **kwargs):
        blocks_run.append(torch._C._current_graph_task_id() != -1)  # True: recomputed in backward
        return real_forward(block, *args, **kwargs)

    monkeypatch.setattr(family_type, "probe", probe)
    monkeypatch.setattr(swapper_type, "_move", move)
    monkeypatch.setattr(block_type, "forward", forward)
    monkeypatch.setattr(model_type, "forward", model_forward)
    import comfy.model_sampling

    mixed, real_scaling = [], comfy.model_sampling.CONST.noise_scaling

    def noise_scaling(sampling, sigma, noise, latent, *args, **kwargs):
        mixed.append(sigma.flatten().tolist())
        return real_scaling(sampling, sigma, noise, latent, *args, **kwargs)

    monkeypatch.setattr(comfy.model_sampling.CONST, "noise_scaling", noise_scaling)
    result = train(pack, dataset, "qwen_like_one_step")

    (loss,) = result.ui["loss"]
    assert math.isfinite(loss)
    # the guard: the forward comparison and the backward check, each on the family's probe
    assert probes == ["index", "index"]
    # the step's model call got ComfyUI's timestep for its sigma (x 1000 for this model), the
    # probes' their own 0.5
    assert timesteps[:3] == [0.5, 0.5, 0.5] and 1.0 < timesteps[-1] < 1000.0, timesteps
    # and its noisy input was mixed by the model's own model_sampling, at that noise level
    assert len(mixed) == 1 and timesteps[-1] == pytest.approx(1000 * mixed[0][0], rel=1e-6)
    # block swap: the family's order takes the last block; it leaves at the start, and visits
    # the compute device for the step's forward and for its recompute in backward
    depth = CONFIG["depth"]
    assert transfers[0] == ("out", depth - 1) and transfers.count(("in", depth - 1)) >= 2
    assert {index for _, index in transfers} == {depth - 1}
    # checkpointing: after the guard's forwards (3 of ComfyUI's own forward and the patched
    # one, 3 of the backward check), the step runs every block forward, then again in backward
    step = blocks_run[-2 * depth :]
    assert step == [False] * depth + [True] * depth, blocks_run

    import folder_paths

    lora = Path(folder_paths.get_folder_paths("loras")[0]) / "qwen_like_one_step.safetensors"
    with safe_open(lora, "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
        ups = [f.get_tensor(k) for k in keys if k.endswith("lora_up.weight")]
    assert "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight" in keys
    assert "lora_unet_transformer_blocks_2_img_mlp_2.alpha" in keys
    assert len(keys) == 3 * depth * 6  # attention_mlp: 6 layers a block, 3 tensors a layer
    assert any(up.abs().sum() > 0 for up in ups)  # the one step trained (up starts at zero)
    assert metadata["ss_base_model_version"] == "qwen_like_test"
    assert metadata["kontext_trainer.base_model"] == "qwen_like_test_edit"


def test_a_resumed_run_of_the_family_continues_exactly(pack, dataset, registered):
    """Its checkpoint's LoRA (kohya names of its own layers) reads back into its layers, and
    the resumed run's losses are the uninterrupted run's, with checkpointing and block swap."""
    node = pack.nodes.train_lora
    common = {"steps": 3, "save_every": 1, "seed": 4}
    uninterrupted = train(pack, dataset, "qwen_like_full", **common).ui["loss"]
    choices = [c for c in node.resume_choices() if c.startswith("qwen_like_full/")]
    assert [c.rsplit("/", 1)[1] for c in choices] == ["step_000001", "step_000002", "step_000003"]
    resumed = train(pack, dataset, "qwen_like_resumed", resume_from=choices[0], **common).ui["loss"]
    assert len(uninterrupted) == 3 and resumed == uninterrupted


def test_fp8_scaled_stores_the_layers_the_family_names(pack, dataset, registered, monkeypatch):
    family_type, chosen = type(registered), []
    real = family_type.fp8_layers

    def fp8_layers(family, names):
        chosen.append(real(family, names))
        return chosen[-1]

    monkeypatch.setattr(family_type, "fp8_layers", fp8_layers)
    (loss,) = train(pack, dataset, "qwen_like_fp8", fp8_mode="fp8_scaled").ui["loss"]
    assert math.isfinite(loss)
    layers = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.0", "img_mlp.2")
    blocks = range(CONFIG["depth"])
    assert chosen[0] == [f"transformer_blocks.{i}.{layer}" for i in blocks for layer in layers]
