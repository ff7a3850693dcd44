"""The shipped FLUX.2 examples, queued over HTTP on a real ComfyUI server: training
(`api/flux2_lora_training.json`) writes a FLUX.2 LoRA with previews, and inference
(`api/flux2_lora_inference.json`) applies it. Real FLUX.2 files cannot be loaded here, so the
three stock loaders, and nothing else, are swapped for test-only nodes that build a tiny FLUX.2,
a VAE with FLUX.2's latents and a text encoder without pooled output. With those, both
examples run as shipped (settings, steps and sizes included) in seconds."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
from PIL import Image

from kt_testing.examples import (
    inputs_of,
    only_id,
    saved_image,
    shipped,
    succeeded,
    write_training_inputs,
)
from kt_testing.paths import comfyui_root
from kt_testing.runs import progress_events
from trainer_core.lora_file import load

# Each stock loader of the examples -> the test-only node (and seed) that builds its tiny part.
TINY_STAND_INS = {
    "UNETLoader": ("KTTest_TinyFlux2Model", 3),
    "VAELoader": ("KTTest_SmallFlux2VAE", 1),
    "CLIPLoader": ("KTTest_TinyFlux2TextEncoder", 2),
}


def with_tiny_loaders(workflow: dict) -> dict:
    """The workflow with exactly its three stock loaders replaced (same node ids, so every link
    stays as shipped)."""
    swapped = copy.deepcopy(workflow)
    replaced = []
    for node_id, node in workflow.items():
        if node["class_type"] in TINY_STAND_INS:
            class_type, seed = TINY_STAND_INS[node["class_type"]]
            swapped[node_id] = {"class_type": class_type, "inputs": {"seed": seed}}
            replaced.append(node["class_type"])
    assert sorted(replaced) == sorted(TINY_STAND_INS), replaced  # one of each, no more
    return swapped


@pytest.fixture(scope="module")
def server(server):
    """The session's server (which attends with PyTorch's SDPA, as ComfyUI does on an NVIDIA GPU),
    with the shipped lora_name free (overwrite off): the stand-in LoRA the examples' tests leave
    under that name is removed (a server of its own cost a boot, 8-9 s of CPU)."""
    lora = inputs_of(shipped("flux2_lora_training.json"), "KontextTrainer_TrainLoRA")["lora_name"]
    (server.base_dir / "models" / "loras" / f"{lora}.safetensors").unlink(missing_ok=True)
    return server


@pytest.fixture(scope="module")
def trained(server):
    """The training example as shipped, loaders swapped, on a dataset of three 64 px samples
    with two references each, in the folder it names; the reference images its previews load
    are in input/ too. Returns (workflow, prompt id, websocket messages)."""
    workflow = with_tiny_loaders(shipped("flux2_lora_training.json"))
    write_training_inputs(server, workflow)
    prompt_id, messages = server.run_prompt(workflow, timeout=600)
    return workflow, prompt_id, messages


def test_the_training_example_writes_a_flux2_lora_with_previews(server, trained):
    workflow, prompt_id, messages = trained
    succeeded(messages)
    train = inputs_of(workflow, "KontextTrainer_TrainLoRA")
    outputs = server.history(prompt_id)["outputs"]
    assert outputs[only_id(workflow, "KontextTrainer_TrainLoRA")]["lora_name"] == ["flux2_lora.safetensors"]
    assert len(outputs[only_id(workflow, "KontextTrainer_TrainLoRA")]["loss"]) == train["steps"]
    assert "held-out samples" in outputs[only_id(workflow, "PreviewAny")]["text"][0]  # the report

    tensors, metadata = load(server.base_dir / "models" / "loras" / "flux2_lora.safetensors")
    assert tensors and all(key.startswith("lora_unet_") for key in tensors)  # kohya names
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in tensors
    assert any(float(t.abs().max()) > 0 for k, t in tensors.items() if k.endswith(".lora_up.weight"))
    assert metadata["ss_base_model_version"] == "flux_2_dev"
    assert metadata["modelspec.architecture"] == "Flux.2-dev/lora"
    assert metadata["kontext_trainer.layout"] == "index"
    assert metadata["ss_steps"] == str(train["steps"])

    # Previews: one image (one prompt) every `every_n_steps` and at the end, of the preview's
    # size, served by /view.
    preview = inputs_of(workflow, "KontextTrainer_PreviewSampler")
    refs = progress_events(messages)[-1]["previews"]
    every = preview["every_n_steps"]
    assert [ref["step"] for ref in refs] == [*range(every, train["steps"], every), train["steps"]]
    for ref in refs:
        png = server.get(f"/view?filename={ref['filename']}&subfolder={ref['subfolder']}&type=temp")
        image = Image.open(io.BytesIO(png))
        assert image.size == (preview["width"], preview["height"])
        assert np.asarray(image).std() > 0  # a picture, not a blank


def run_inference(
    server, strength: float, lora_name: str | None = None, layout: str | None = None
) -> tuple[dict, np.ndarray]:
    """The inference example, loaders swapped, its LoRA (or `lora_name`) at `strength`, its
    MultiImageConditioning in `layout` if given, cut to 2 of its 20 sampler steps (every other
    value as shipped; as shipped, the inference test's three runs took 55 / 46 CPU seconds on
    ComfyUI 0.3.75 / 0.33, 16 s of wall time for the whole test cut): (workflow, saved image)."""
    workflow = with_tiny_loaders(shipped("flux2_lora_inference.json"))
    inputs_of(workflow, "LoraLoaderModelOnly")["strength_model"] = strength
    inputs_of(workflow, "KSampler")["steps"] = 2
    if lora_name is not None:
        inputs_of(workflow, "LoraLoaderModelOnly")["lora_name"] = lora_name
    if layout is not None:
        inputs_of(workflow, "KontextTrainer_MultiImageConditioning")["layout"] = layout
    return workflow, saved_image(server, workflow)


def test_the_inference_example_applies_the_trained_lora(server, trained):
    succeeded(trained[2])  # the LoRA it loads is the one the training example wrote
    lora = inputs_of(shipped("flux2_lora_inference.json"), "LoraLoaderModelOnly")
    assert lora["lora_name"] == "flux2_lora.safetensors"
    workflow, with_lora = run_inference(server, lora["strength_model"])
    latent = inputs_of(workflow, "EmptyFlux2LatentImage")
    assert with_lora.shape == (latent["height"], latent["width"], 3)
    # The same graph with the LoRA at strength 0 (the base model) samples another image.
    _, without_lora = run_inference(server, 0.0)
    assert without_lora.shape == with_lora.shape
    assert np.abs(with_lora - without_lora).max() > 0
    # Issue 42 item 2: MultiImageConditioning's `auto` (its default now) samples exactly what the
    # example's named `index` samples: FLUX.2's own layout (ComfyUI's `default_ref_method`);
    # that `offset`, the old default, differs is tests/families/flux/test_flux2_train_lora.py's
    _, auto = run_inference(server, lora["strength_model"], layout="auto")
    assert np.array_equal(auto, with_lora)


TIMESTEP_ZERO = "index_timestep_zero"


def with_layout(workflow: dict, layout: str) -> dict:
    for node in workflow.values():
        if node["class_type"] in ("KontextTrainer_TrainLoRA", "KontextTrainer_MultiImageConditioning"):
            node["inputs"]["layout"] = layout
    return workflow


def test_timestep_zero_references_train_and_sample_or_are_refused_by_version(server):
    """ComfyUI 0.33's "Edit Model Reference Method" index_timestep_zero, chosen on TrainLoRA and
    MultiImageConditioning of the shipped FLUX.2 examples (4 steps): on 0.33 the run trains,
    previews and validates with it, records it in the LoRA, and the inference example samples
    with it (another image than with index); on a ComfyUI without it the run stops at once
    with one message naming the version."""
    root = comfyui_root()  # the server's ComfyUI
    version = (root / "comfyui_version.py").read_text().split('"')[1]
    knows_timestep_zero = "timestep_zero_index" in (root / "comfy/ldm/flux/model.py").read_text()
    workflow = with_layout(with_tiny_loaders(shipped("flux2_lora_training.json")), TIMESTEP_ZERO)
    train = inputs_of(workflow, "KontextTrainer_TrainLoRA")
    train.update(lora_name="flux2_timestep_zero", steps=4, save_every=4, validate_every=2)
    inputs_of(workflow, "KontextTrainer_PreviewSampler")["every_n_steps"] = 2
    write_training_inputs(server, workflow)
    _, messages = server.run_prompt(workflow, timeout=600)
    if not knows_timestep_zero:
        error = messages[-1]
        assert error["type"] == "execution_error", error
        assert (
            f"layout 'index_timestep_zero' needs ComfyUI 0.33 or newer (its FLUX.2 feeds the "
            f"references at timestep 0); this ComfyUI is {version}"
        ) in error["data"]["exception_message"]
        assert not (server.base_dir / "models" / "loras" / "flux2_timestep_zero.safetensors").exists()
        return
    succeeded(messages)
    assert len(progress_events(messages)[-1]["previews"]) == 2
    _, metadata = load(server.base_dir / "models" / "loras" / "flux2_timestep_zero.safetensors")
    assert metadata["kontext_trainer.layout"] == TIMESTEP_ZERO

    images = {
        layout: run_inference(server, 1.0, "flux2_timestep_zero.safetensors", layout)[1]
        for layout in (TIMESTEP_ZERO, "index")
    }
    assert np.abs(images[TIMESTEP_ZERO] - images["index"]).max() > 0


def test_all_linear_on_flux2_says_what_diffusers_drops(server, trained):
    """Issue 32: diffusers' FLUX.2 kohya converter drops the three modulation LoRAs that
    all_linear trains; the node says so (the shipped attention_mlp run does not need to)."""
    workflow, _, messages = trained
    assert not [e for e in progress_events(messages) if "diffusers' kohya converter" in e["message"]]
    graph = copy.deepcopy(workflow)
    train = graph[only_id(graph, "KontextTrainer_TrainLoRA")]["inputs"]
    train.update(targets="all_linear", steps=1, lora_name="flux2_all_linear", save_every=0)
    _, ran = server.run_prompt(graph, timeout=600)
    succeeded(ran)
    message = progress_events(ran)[0]["message"]
    assert (
        "all_linear on FLUX.2: ComfyUI applies the whole LoRA, but diffusers' kohya converter drops"
        in message
    )
    tensors, metadata = load(server.base_dir / "models" / "loras" / "flux2_all_linear.safetensors")
    assert any("single_stream_modulation" in key for key in tensors)  # written: ComfyUI applies them
    assert metadata["ss_network_module"] == "networks.lora_flux_2"
    assert metadata["modelspec.implementation"] == "https://github.com/black-forest-labs/flux2"
