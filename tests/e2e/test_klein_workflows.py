"""The shipped FLUX.2 [klein] examples, queued over HTTP on a real ComfyUI server (issue 42 items
4 and 6). On ComfyUI 0.33 the training example (`api/flux2_klein_lora_training.json`) runs as
shipped with the stock UNETLoader reading a tiny klein file written under the real key names as
`flux-2-klein-base-4b.safetensors`; only the text encoder (a tiny Qwen3 through ComfyUI's klein
encoder: ComfyUI's CLIPLoader detects a Qwen3-4B by its 2560 width) and the VAE are stand-ins.
It writes a klein LoRA with previews, and the inference example
(`api/flux2_klein_lora_inference.json`) applies it. On ComfyUI 0.3.75, whose own UNETLoader cannot
build a klein, the model is a stand-in too, the text encoder is what 0.3.75 loads a Qwen3 as
(Z-Image's), and the run stops at LoadKontextDataset naming ComfyUI 0.33."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import save_file

from kt_testing.examples import (
    PYTORCH_ATTENTION,
    inputs_of,
    only_id,
    shipped,
    succeeded,
    write_training_inputs,
)
from kt_testing.klein import klein_state
from kt_testing.paths import TEST_NODE_PACKS, comfyui_root
from kt_testing.runs import progress_events
from kt_testing.server import ComfyServer
from trainer_core.lora_file import load

TRAINING, INFERENCE = "flux2_klein_lora_training.json", "flux2_klein_lora_inference.json"


def runs_klein() -> bool:
    """The server's ComfyUI has a klein text encoder (0.33 and newer)."""
    return "def klein_te" in (comfyui_root() / "comfy/text_encoders/flux.py").read_text()


def with_stand_ins(workflow: dict) -> dict:
    """The workflow with its VAE and text encoder loaders replaced (same node ids), and on a
    ComfyUI that cannot build klein its UNETLoader too."""
    stand_ins = {"VAELoader": ("KTTest_SmallFlux2VAE", 1), "CLIPLoader": ("KTTest_TinyKleinTextEncoder", 2)}
    if not runs_klein():
        stand_ins["UNETLoader"] = ("KTTest_TinyKleinModel", 3)
    swapped = copy.deepcopy(workflow)
    for node_id, node in workflow.items():
        if node["class_type"] in stand_ins:
            class_type, seed = stand_ins[node["class_type"]]
            swapped[node_id] = {"class_type": class_type, "inputs": {"seed": seed}}
    return swapped


@pytest.fixture(scope="module")
def server(tmp_path_factory, comfy_runtime):
    """A server of its own with the tiny klein file where the example's UNETLoader looks for its
    model (under the name it ships with; built with the ComfyUI booted in this process)."""
    base = tmp_path_factory.mktemp("klein-base")
    unet = inputs_of(shipped(TRAINING), "UNETLoader")["unet_name"]
    (base / "models" / "diffusion_models").mkdir(parents=True)
    save_file(klein_state(seed=3), str(base / "models" / "diffusion_models" / unet))
    with ComfyServer(base, extra_packs=TEST_NODE_PACKS, args=PYTORCH_ATTENTION) as running:
        yield running


@pytest.fixture(scope="module")
def trained(server):
    workflow = with_stand_ins(shipped(TRAINING))
    assert workflow[only_id(workflow, "UNETLoader" if runs_klein() else "KTTest_TinyKleinModel")]
    write_training_inputs(server, workflow)
    prompt_id, messages = server.run_prompt(workflow, timeout=600)
    return workflow, prompt_id, messages


def test_the_klein_training_example_writes_a_klein_lora_or_names_comfyui_033(server, trained):
    workflow, prompt_id, messages = trained
    lora = server.base_dir / "models" / "loras" / "flux2_klein_lora.safetensors"
    if not runs_klein():  # ComfyUI 0.3.75
        error = messages[-1]
        assert error["type"] == "execution_error", error
        assert error["data"]["node_type"] == "KontextTrainer_LoadKontextDataset"
        message = error["data"]["exception_message"]
        assert "FLUX.2 [klein]'s text encoder needs ComfyUI 0.33 or newer" in message, message
        assert not lora.exists()
        return
    succeeded(messages)
    train = inputs_of(workflow, "KontextTrainer_TrainLoRA")
    outputs = server.history(prompt_id)["outputs"]
    assert outputs[only_id(workflow, "KontextTrainer_TrainLoRA")]["lora_name"] == [lora.name]
    assert len(outputs[only_id(workflow, "KontextTrainer_TrainLoRA")]["loss"]) == train["steps"]
    tensors, metadata = load(lora)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in tensors
    assert metadata["ss_base_model_version"] == "flux_2_klein_4b"
    assert metadata["modelspec.architecture"] == "Flux.2-klein-4b/lora"
    assert metadata["kontext_trainer.layout"] == "index"  # auto, resolved from the model
    events = progress_events(messages)
    first = next(e["message"] for e in events if e["message"])
    assert first.startswith("FLUX.2 [klein] 4B: ComfyUI cannot tell a Base file from a distilled one"), first
    preview = inputs_of(workflow, "KontextTrainer_PreviewSampler")
    every, steps = preview["every_n_steps"], [ref["step"] for ref in events[-1]["previews"]]
    assert steps == [*range(every, train["steps"], every), train["steps"]]


def run_inference(server, strength: float) -> np.ndarray:
    """The inference example with its LoRA at `strength`, cut to 2 of its 28 steps (each a CFG
    pair of forwards at 512 x 512: as shipped the two runs took 75 s of the suite's time);
    every other value as shipped. The saved image."""
    workflow = with_stand_ins(shipped(INFERENCE))
    inputs_of(workflow, "LoraLoaderModelOnly")["strength_model"] = strength
    inputs_of(workflow, "KSampler")["steps"] = 2
    prompt_id, messages = server.run_prompt(workflow, timeout=600)
    succeeded(messages)
    (saved,) = server.history(prompt_id)["outputs"][only_id(workflow, "SaveImage")]["images"]
    path = server.base_dir / "output" / saved["subfolder"] / saved["filename"]
    return np.asarray(Image.open(path)).astype(int)


def test_the_klein_inference_example_applies_the_trained_lora(server, trained):
    if not runs_klein():
        pytest.skip("ComfyUI 0.3.75 cannot load FLUX.2 [klein] (the training test shows the refusal)")
    succeeded(trained[2])
    lora = inputs_of(shipped(INFERENCE), "LoraLoaderModelOnly")
    assert lora["lora_name"] == "flux2_klein_lora.safetensors"  # what the training example writes
    with_lora = run_inference(server, lora["strength_model"])
    latent = inputs_of(shipped(INFERENCE), "EmptyFlux2LatentImage")
    assert with_lora.shape == (latent["height"], latent["width"], 3)
    assert np.abs(with_lora - run_inference(server, 0.0)).max() > 0  # the LoRA changes the image
