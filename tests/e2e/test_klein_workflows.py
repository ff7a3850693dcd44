"""The shipped FLUX.2 [klein] examples, queued over HTTP on a real ComfyUI server (issue 42 items
4 and 6). On ComfyUI 0.33 the training example (`api/flux2_klein_lora_training.json`) runs as
shipped with the stock UNETLoader reading a tiny klein file written under the real key names as
`flux-2-klein-base-4b.safetensors`; only the text encoder (a tiny Qwen3 through ComfyUI's klein
encoder: ComfyUI's CLIPLoader detects a Qwen3-4B by its 2560 width) and the VAE are stand-ins.
It writes a klein LoRA with previews, and the inference example
(`api/flux2_klein_lora_inference.json`) applies it. On ComfyUI 0.3.75, whose own UNETLoader cannot
build a klein, the model is a stand-in too, the text encoder is what 0.3.75 loads a Qwen3 as
(Z-Image's), and the run stops at LoadKontextDataset naming ComfyUI 0.33.

Issue 42 item 3, on ComfyUI 0.33 with its dynamic VRAM (its default on NVIDIA, emulated on the
CPU: kt_testing/dynamic_vram.py): a second server trains the example (cut to 3 steps) on the
stock UNETLoader's memory-mapped klein weights and writes the plain server's LoRA bit for bit,
the MODEL still holding the file's memory afterwards; and it trains on a klein fp8 file, every
block Linear quantized by ComfyUI's own code in its per-layer `comfy_quant` form
(kt_testing/quantized_files.py)."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from safetensors.torch import save_file

from kt_testing.dynamic_vram import EMULATION_MARK, comfyui_has_dynamic_vram, server_env
from kt_testing.examples import (
    PYTORCH_ATTENTION,
    inputs_of,
    only_id,
    saved_image,
    shipped,
    succeeded,
    write_training_inputs,
)
from kt_testing.klein import klein_state
from kt_testing.paths import TEST_NODE_PACKS, comfyui_root
from kt_testing.runs import progress_events, run_and_interrupt
from kt_testing.server import ComfyServer
from trainer_core.lora_file import load

TRAINING, INFERENCE = "flux2_klein_lora_training.json", "flux2_klein_lora_inference.json"
QUANTIZED = "flux-2-klein-base-4b-fp8.safetensors"  # the tiny klein, its block Linears in fp8
PROBES = itertools.count(1)


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
    return saved_image(server, workflow)


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


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory, comfy_runtime):
    """A server with ComfyUI's dynamic VRAM emulated, the tiny klein file under its shipped name
    and in ComfyUI's fp8 form beside it (0.33; 0.3.75 has neither dynamic VRAM nor klein)."""
    from kt_testing.quantized_files import write_quantized_file

    if not (runs_klein() and comfyui_has_dynamic_vram()):
        pytest.skip("ComfyUI 0.3.75 has no dynamic VRAM and cannot load FLUX.2 [klein]")
    base = tmp_path_factory.mktemp("klein-dynamic")
    models = base / "models" / "diffusion_models"
    models.mkdir(parents=True)
    state = klein_state(seed=3)
    save_file(state, str(models / inputs_of(shipped(TRAINING), "UNETLoader")["unet_name"]))
    write_quantized_file(models / QUANTIZED, state, "comfy_quant")
    env = server_env()
    with ComfyServer(base, extra_packs=TEST_NODE_PACKS, args=PYTORCH_ATTENTION, env=env) as running:
        assert EMULATION_MARK in running.log()
        yield running


def short_workflow(server, lora_name: str, steps: int, unet_name: str | None = None, **settings) -> dict:
    """The training example cut to `steps` steps without previews, snapshots or a held-out
    loss (TrainLoRA's other `settings` changed), its TrainLoRA's MODEL probed afterwards
    (KTTest_MappedWeights, output "kt_mapped"); its inputs written into the server's input/."""
    workflow = with_stand_ins(shipped(TRAINING))
    train_id = only_id(workflow, "KontextTrainer_TrainLoRA")
    train = workflow[train_id]["inputs"]
    train.update(lora_name=lora_name, steps=steps, save_every=0, validate_every=0, **settings)
    del train["preview"]
    if unet_name is not None:
        inputs_of(workflow, "UNETLoader")["unet_name"] = unet_name
    probe = {"model": [train_id, 0], "nonce": next(PROBES)}  # a fresh probe each run
    workflow["kt_mapped"] = {"class_type": "KTTest_MappedWeights", "inputs": probe}
    write_training_inputs(server, workflow)
    return workflow


def short_run(server, lora_name: str, steps: int, unet_name=None, **settings) -> tuple[dict, list]:
    """`short_workflow` run to its end: the probe's report and the run's messages."""
    workflow = short_workflow(server, lora_name, steps, unet_name, **settings)
    prompt_id, messages = server.run_prompt(workflow, timeout=600)
    succeeded(messages)
    held = server.history(prompt_id)["outputs"]["kt_mapped"]
    return {key: value[0] for key, value in held.items()}, messages


def lora_of(server, name: str) -> dict:
    return load(server.base_dir / "models" / "loras" / f"{name}.safetensors")[0]


def same_lora(ours: dict, reference: dict) -> bool:
    return ours.keys() == reference.keys() and all(
        np.array_equal(ours[key].float().numpy(), reference[key].float().numpy()) for key in ours
    )


def test_dynamic_vram_trains_klein_on_the_mapped_file_as_the_plain_server(server, dynamic):
    """A run that copied the mapped weights (70adb75 to ecd75f4, issue 30) leaves the probe
    seeing the copy (`mapped` below `large`)."""
    held, _ = short_run(dynamic, "klein_dynamic", steps=3)
    assert held["dynamic"] and held["large"] > 0 and held["mapped"] == held["large"], held
    assert "cast contract on: ComfyUI's dynamic VRAM casts streamed layers" in dynamic.log()
    plain, _ = short_run(server, "klein_dynamic", steps=3)
    assert not plain["dynamic"] and plain["mapped"] == 0, plain
    ours = lora_of(dynamic, "klein_dynamic")
    assert same_lora(ours, lora_of(server, "klein_dynamic"))
    assert any(float(value.abs().max()) > 0 for key, value in ours.items() if key.endswith("lora_up.weight"))


def test_klein_trains_on_its_quantized_file_under_dynamic_vram(dynamic):
    """The fp8 file through the stock UNETLoader: ComfyUI's quantized Linear in every block (on
    70adb75 such a MODEL had "no layers to train"), klein resolved from it, the LoRA on the
    quantized layers and the base recorded as fp8, as sd-scripts records it."""
    _, messages = short_run(dynamic, "klein_fp8", steps=2, unet_name=QUANTIZED)
    first = next(e["message"] for e in progress_events(messages) if e["message"])
    assert first.startswith("FLUX.2 [klein] 4B: ComfyUI cannot tell a Base file"), first
    tensors, metadata = load(dynamic.base_dir / "models" / "loras" / "klein_fp8.safetensors")
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in tensors
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in tensors
    assert metadata["ss_base_model_version"] == "flux_2_klein_4b"
    assert metadata["ss_sd_model_name"] == QUANTIZED and metadata["ss_fp8_base"] == "True"


def test_klein_in_fp8_scaled_with_a_swapped_block_resumes_exactly_after_cancel(server):
    """Cancel at step 2 of 5, then Run again resuming from the checkpoint Cancel wrote: the LoRA
    of the uninterrupted run, bit for bit, with fp8_scaled block weights, one block swapped
    (single blocks first) and every Linear of the blocks adapted."""
    if not runs_klein():
        pytest.skip("ComfyUI 0.3.75 cannot load FLUX.2 [klein] (the training test shows the refusal)")
    recipe = {"fp8_mode": "fp8_scaled", "blocks_to_swap": 1, "targets": "all_linear", "seed": 7}
    short_run(server, "klein_whole", steps=5, **recipe)
    cut = run_and_interrupt(server, short_workflow(server, "klein_cut", steps=5, **recipe), at_step=2)
    assert cut[-1]["type"] == "execution_interrupted", cut[-1]
    choice = progress_events(cut)[-1]["message"].split("resume from ")[1]
    stopped_at = int(choice.rsplit("_", 1)[1])
    assert 2 <= stopped_at < 5, choice
    _, messages = short_run(server, "klein_cut", steps=5, resume_from=choice, **recipe)
    # (not the queued job's event, step 0: it reaches the page or not depending on how soon the
    # job starts, as progress events are at most four a second but for a change of status)
    steps = sorted({event["step"] for event in progress_events(messages) if event["status"] != "queued"})
    assert steps[0] == stopped_at and steps[-1] == 5, steps  # it went on from the checkpoint
    whole = lora_of(server, "klein_whole")
    assert "lora_unet_single_blocks_1_linear2.lora_down.weight" in whole  # the swapped block's too
    assert same_lora(lora_of(server, "klein_cut"), whole)
