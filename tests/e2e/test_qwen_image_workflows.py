"""The shipped Qwen-Image-Edit examples, queued over HTTP on a real ComfyUI server (issue 43
items 2, 4 and "done when"). The training example (`api/qwen_image_edit_2509_lora_training.json`:
two references per sample, previews whose positive and negative come from the stock
`TextEncodeQwenImageEditPlus` with the same two images) runs as shipped on both ComfyUIs, and
the inference example (`api/qwen_image_edit_2509_lora_inference.json`: the stock loaders, the
LoraLoaderModelOnly, the encoder node, KSampler) applies the LoRA it writes.

The model files are the tiny Qwen-Image-Edit's, in the forms ComfyUI distributes (e4m3 weights
as `qwen_image_edit_2509_fp8_e4m3fn`, bf16 with 2511's `__index_timestep_zero__` key, fp8mixed's
`_quantization_metadata`, 0.33's `comfy_quant`), loaded by the stock UNETLoader: the server's
detection reads the file's widths (`kt_testing.qwen_image.read_qwen_widths`: ComfyUI's fixes
them at Qwen-Image's), and does the rest as shipped (the form, 2511 by its key on 0.33). The
text encoder and VAE are stand-ins built by ComfyUI's own classes (`kt_test_nodes`).
The 2511 training example: on ComfyUI 0.33 it trains a 2511 (detected `default_ref_method`
`index_timestep_zero`; layout `auto` resolves to it and the LoRA names the model as musubi-tuner
does); on 0.3.75, which runs the file as a 2509, TrainLoRA refuses it naming the update.

The encoder node sizes every reference at about 1 MP, so each forward of the tiny model holds
two 4096-token references (about 1.5 s of the tiny model on one core) and each reference costs a
1 MP VAE encode (about 6 s): the dataset here has two samples (one held out), not the three the
other examples' tests write."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from kt_testing.datasets import write_one_folder
from kt_testing.dynamic_vram import comfyui_has_dynamic_vram, server_env
from kt_testing.examples import (
    PYTORCH_ATTENTION,
    inputs_of,
    only_id,
    saved_image,
    shipped,
    succeeded,
    write_training_inputs,
)
from kt_testing.paths import TEST_NODE_PACKS, comfyui_root
from kt_testing.quantized_files import forms_this_comfyui_loads
from kt_testing.qwen_image import QWEN_WIDTHS_ENV, tiny_qwen_image_file
from kt_testing.runs import progress_events
from kt_testing.server import ComfyServer
from kt_testing.tiny_models import NARROW_QWEN_IMAGE_CONFIG
from trainer_core.lora_file import load

TRAINING, INFERENCE = "qwen_image_edit_2509_lora_training.json", "qwen_image_edit_2509_lora_inference.json"
TRAINING_2511, INFERENCE_2511 = (name.replace("2509", "2511") for name in (TRAINING, INFERENCE))
TIMESTEP_ZERO_KEY = "__index_timestep_zero__"  # ComfyUI 0.33's detection of a 2511 file
STAND_INS = {
    "CLIPLoader": ("KTTest_TinyQwenImageTextEncoder", 2),
    "VAELoader": ("KTTest_SmallWanVAE", 1),
}


def runs_2511() -> bool:
    """The server's ComfyUI modulates references at timestep 0 (0.33 and newer)."""
    return "timestep_zero_index" in (comfyui_root() / "comfy/ldm/qwen_image/model.py").read_text()


def with_stand_ins(workflow: dict) -> dict:
    """The workflow with its text encoder and VAE loaders replaced by the tiny parts (same node
    ids); its UNETLoader is the stock one."""
    swapped = copy.deepcopy(workflow)
    for node_id, node in workflow.items():
        if node["class_type"] in STAND_INS:
            class_type, seed = STAND_INS[node["class_type"]]
            swapped[node_id] = {"class_type": class_type, "inputs": {"seed": seed}}
    return swapped


def write_model_file(server, name: str, release: str = "2509", form: str = "plain", config=None):
    """The tiny Qwen-Image-Edit as `name` in the server's diffusion_models/ (seed 3 throughout;
    `config`: other widths)."""
    path = server.base_dir / "models" / "diffusion_models" / name
    if not path.exists():
        tiny_qwen_image_file(path, seed=3, release=release, form=form, config=config)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, comfy_runtime):
    with ComfyServer(
        tmp_path_factory.mktemp("qwen"),
        extra_packs=TEST_NODE_PACKS,
        args=PYTORCH_ATTENTION,
        env={QWEN_WIDTHS_ENV: "1"},
    ) as running:
        # the file the examples name: e4m3 weights, as ComfyUI distributes 2509
        write_model_file(running, inputs_of(shipped(TRAINING), "UNETLoader")["unet_name"], form="fp8_e4m3fn")
        yield running


@pytest.fixture(scope="module")
def trained(server):
    workflow = with_stand_ins(shipped(TRAINING))
    write_training_inputs(server, workflow, samples=("a", "b"))
    prompt_id, messages = server.run_prompt(workflow, timeout=900)
    return workflow, prompt_id, messages


def test_the_training_example_writes_a_qwen_image_edit_lora_with_previews(server, trained):
    workflow, prompt_id, messages = trained
    succeeded(messages)
    train = inputs_of(workflow, "KontextTrainer_TrainLoRA")
    lora = server.base_dir / "models" / "loras" / "qwen_image_edit_2509_lora.safetensors"
    outputs = server.history(prompt_id)["outputs"][only_id(workflow, "KontextTrainer_TrainLoRA")]
    assert outputs["lora_name"] == [lora.name]
    assert len(outputs["loss"]) == train["steps"]
    tensors, metadata = load(lora)
    # musubi-tuner's names, ComfyUI's layer names (kohya form)
    assert "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight" in tensors
    assert "lora_unet_transformer_blocks_0_img_mlp_net_0_proj.lora_up.weight" in tensors
    assert metadata["ss_base_model_version"] == "qwen_image_edit_plus"
    assert metadata["modelspec.architecture"] == "Qwen-Image-Edit-Plus/lora"
    assert metadata["kontext_trainer.layout"] == "index"  # auto: 2509's own
    events = progress_events(messages)
    every = inputs_of(workflow, "KontextTrainer_PreviewSampler")["every_n_steps"]
    previews = events[-1]["previews"]
    assert [ref["step"] for ref in previews] == [*range(every, train["steps"], every), train["steps"]]
    report = server.history(prompt_id)["outputs"][only_id(workflow, "PreviewAny")]
    assert "TextEncodeQwenImageEditPlus node" in str(report)  # the dataset says how it encoded


def run_inference(server, strength: float) -> np.ndarray:
    """The inference example with its LoRA at `strength`, cut to 2 of its 20 steps at 256 x 256
    (as shipped, 1024 x 1024: each CFG pair of forwards would hold 4096 target tokens beside the
    two references); every other value as shipped. The saved image."""
    workflow = with_stand_ins(shipped(INFERENCE))
    inputs_of(workflow, "LoraLoaderModelOnly")["strength_model"] = strength
    inputs_of(workflow, "KSampler")["steps"] = 2
    inputs_of(workflow, "EmptySD3LatentImage").update(width=256, height=256)
    return saved_image(server, workflow)


def test_the_inference_example_applies_the_trained_lora(server, trained):
    succeeded(trained[2])
    lora = inputs_of(shipped(INFERENCE), "LoraLoaderModelOnly")
    assert lora["lora_name"] == "qwen_image_edit_2509_lora.safetensors"  # what the training example writes
    with_lora = run_inference(server, lora["strength_model"])
    assert with_lora.shape == (256, 256, 3)
    assert np.abs(with_lora - run_inference(server, 0.0)).max() > 0  # the LoRA changes the image


def test_the_2511_training_example_trains_at_timestep_zero_or_names_comfyui_033(server, trained):
    """`api/qwen_image_edit_2511_lora_training.json` (cut to 2 steps without previews, snapshots or
    a held-out loss; the dataset the 2509 run cached) with its model file in
    models/diffusion_models: the tiny 2511 in bf16, holding 2511's `__index_timestep_zero__` key.
    ComfyUI 0.33's detection makes a 2511 of it: layout `auto` resolves to its
    `index_timestep_zero` and the LoRA names the model as musubi-tuner does. ComfyUI 0.3.75
    ignores the key and runs the file as a 2509: TrainLoRA refuses, naming the update."""
    workflow = with_stand_ins(shipped(TRAINING_2511))
    unet = inputs_of(shipped(TRAINING_2511), "UNETLoader")["unet_name"]
    write_model_file(server, unet, release="2511")
    train = inputs_of(workflow, "KontextTrainer_TrainLoRA")
    train.update(steps=2, save_every=0, validate_every=0)
    del train["preview"]
    _, messages = server.run_prompt(workflow, timeout=600)
    lora = server.base_dir / "models" / "loras" / f"{train['lora_name']}.safetensors"
    if not runs_2511():
        error = messages[-1]
        assert error["type"] == "execution_error", error
        assert error["data"]["node_type"] == "KontextTrainer_TrainLoRA"
        message = error["data"]["exception_message"]
        assert f"{unet} is Qwen-Image-Edit 2511 (its {TIMESTEP_ZERO_KEY} key), which this ComfyUI" in message
        assert "runs as 2509" in message, message
        assert message.rstrip().endswith("Update ComfyUI to 0.33 or newer"), message
        assert not lora.exists()
        return
    succeeded(messages)
    tensors, metadata = load(lora)
    assert metadata["ss_base_model_version"] == "qwen_image_edit_2511"
    assert metadata["modelspec.architecture"] == "Qwen-Image-Edit-2511/lora"
    assert metadata["kontext_trainer.layout"] == "index_timestep_zero"
    assert metadata["ss_sd_model_name"] == unet
    assert any(float(v.abs().max()) > 0 for k, v in tensors.items() if k.endswith("lora_up.weight"))


def test_the_2511_examples_are_the_2509_ones_with_2511s_files():
    """Each 2511 example is its tested 2509 counterpart with 2511's model file and LoRA name."""
    for pair in ((TRAINING, TRAINING_2511), (INFERENCE, INFERENCE_2511)):
        old, new = (json.dumps(shipped(name)) for name in pair)
        assert "2511" not in old
        swapped = old.replace("qwen_image_edit_2509_fp8_e4m3fn", "qwen_image_edit_2511_bf16")
        assert new == swapped.replace("2509", "2511")


@pytest.mark.parametrize("form", ["quantization_metadata", "comfy_quant"])
def test_the_training_example_trains_on_comfyuis_quantized_qwen_files(server, trained, form):
    """Issue 43 item 2: the 2509 training example (cut to 2 steps without previews, snapshots or
    a held-out loss) on a file whose block Linears ComfyUI's own code quantized, in the forms this
    ComfyUI reads: fp8mixed's `_quantization_metadata` (both), per-layer `comfy_quant` (0.33). The
    stock UNETLoader loads them into ComfyUI's quantized Linear; the LoRA lands on those layers
    and the file records the quantized base as sd-scripts does."""
    if form not in forms_this_comfyui_loads():
        pytest.skip(f"this ComfyUI does not read the {form} form (0.33 does)")
    succeeded(trained[2])
    name = f"kt-tiny-qwen-{form}.safetensors"
    write_model_file(server, name, form=form)
    workflow = with_stand_ins(shipped(TRAINING))
    inputs_of(workflow, "UNETLoader")["unet_name"] = name
    train = inputs_of(workflow, "KontextTrainer_TrainLoRA")
    train.update(steps=2, save_every=0, validate_every=0, lora_name=f"kt_qwen_{form}")
    del train["preview"]
    _, messages = server.run_prompt(workflow, timeout=600)
    succeeded(messages)
    tensors, metadata = load(server.base_dir / "models" / "loras" / f"kt_qwen_{form}.safetensors")
    assert "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight" in tensors
    assert any(float(v.abs().max()) > 0 for k, v in tensors.items() if k.endswith("lora_up.weight"))
    base = json.loads(metadata["kontext_trainer.base_weights"])
    print(f"\n{form}: base weights {base}")
    assert base["quantized"].get("float8_e4m3fn", 0) > 0, base  # the block Linears, as ComfyUI loaded them
    assert metadata["ss_sd_model_name"] == name and metadata["ss_fp8_base"] == "True"
    assert "Using mixed precision operations" in server.log()


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory, comfy_runtime):
    """A server with ComfyUI 0.33's dynamic VRAM emulated (kt_testing/dynamic_vram.py: the stock
    UNETLoader builds ModelPatcherDynamic over the file's memory-mapped weights)."""
    if not comfyui_has_dynamic_vram():
        pytest.skip("ComfyUI 0.3.75 has no dynamic VRAM (ModelPatcherDynamic)")
    with ComfyServer(
        tmp_path_factory.mktemp("qwen-dynamic"),
        extra_packs=TEST_NODE_PACKS,
        args=PYTORCH_ATTENTION,
        env={**server_env(), QWEN_WIDTHS_ENV: "1"},
    ) as running:
        yield running


NARROW = "kt-narrow-qwen-image-edit.safetensors"


def narrow_run(server, name: str) -> tuple[dict, dict]:
    """Two steps of the 2509 training example's TrainLoRA on the narrow Qwen-Image-Edit (128 wide:
    its block Linears over 16 KiB, so dynamic VRAM streams them) in bf16, from 64 px samples
    without references (text to image: no 1 MP reference encodes), no preview, snapshot or
    held-out loss. (How the MODEL holds its weights after the run, the LoRA)."""
    write_model_file(server, NARROW, config=NARROW_QWEN_IMAGE_CONFIG)
    write_one_folder(server.base_dir / "input" / "qwen_plain", ["a", "b"], references=0, size=(64, 64))
    workflow = with_stand_ins(shipped(TRAINING))
    inputs_of(workflow, "UNETLoader")["unet_name"] = NARROW
    inputs_of(workflow, "KontextTrainer_LoadKontextDataset").update(folder="qwen_plain", hold_out=0)
    train = inputs_of(workflow, "KontextTrainer_TrainLoRA")
    train.update(steps=2, save_every=0, validate_every=0, lora_name=name, targets="all_linear")
    del train["preview"]
    graph = {
        node_id: node
        for node_id, node in workflow.items()
        if node["class_type"] in ("UNETLoader", *(c for c, _ in STAND_INS.values()))
        or node["class_type"].startswith("KontextTrainer_Load")
        or node["class_type"] == "KontextTrainer_TrainLoRA"
    }
    train_id = only_id(graph, "KontextTrainer_TrainLoRA")
    graph["probe"] = {"class_type": "KTTest_MappedWeights", "inputs": {"model": [train_id, 0], "nonce": 1}}
    prompt_id, messages = server.run_prompt(graph, timeout=600)
    succeeded(messages)
    held = {key: value[0] for key, value in server.history(prompt_id)["outputs"]["probe"].items()}
    tensors, _ = load(server.base_dir / "models" / "loras" / f"{name}.safetensors")
    return held, tensors


def test_dynamic_vram_trains_qwen_image_edit_on_the_mapped_file_as_the_plain_server(server, dynamic):
    """Issue 43 item 2: under dynamic VRAM the stock UNETLoader maps the Qwen file's weights and
    TrainLoRA trains on them without a copy (a copy leaves the probe seeing `mapped` below
    `large`, as 70adb75 to ecd75f4 did for FLUX); the LoRA equals the plain server's bit for bit."""
    held, ours = narrow_run(dynamic, "qwen_dynamic")
    print(f"\ndynamic: {held}")
    assert held["dynamic"] and held["large"] > 0 and held["mapped"] == held["large"], held
    assert "cast contract on: ComfyUI's dynamic VRAM casts streamed layers" in dynamic.log()
    plain, reference = narrow_run(server, "qwen_dynamic")
    assert not plain["dynamic"] and plain["mapped"] == 0, plain
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    assert any(float(v.abs().max()) > 0 for k, v in ours.items() if k.endswith("lora_up.weight"))
