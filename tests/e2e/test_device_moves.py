"""TrainLoRA on a server whose loads move weights as onto a GPU (kt_testing.device_moves).

On the first GPU run every TrainLoRA run failed at step 1 with "Inference tensors do not track
version counter": ComfyUI moved the loader-made weights to CUDA from the training thread,
outside inference mode. On the CPU nothing moves; this server's ModelPatchers swap every
weight's `.data` on each load and unload, in the caller's inference mode, as the move to and
from a GPU does. The user flows that failed on the GPU run here: the demo workflow, previews
(after "Unload models", so the VAE loads again in the training thread), Cancel then resume,
and a stock LoRA before TrainLoRA."""

from __future__ import annotations

import math
import time

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.device_moves import DEVICE_MOVES_ENV, UNLOAD_MARK
from kt_testing.flux_widths import FLUX_WIDTHS_ENV
from kt_testing.graphs import demo_training, ksampler_inputs, training_graph
from kt_testing.paths import TEST_NODE_PACKS
from kt_testing.runs import losses_of, progress_events, run_and_interrupt
from kt_testing.server import ComfyServer
from trainer_core.lora_file import load

RECIPE = {"dropout": 0.1, "caption_dropout": 0.3, "ip_noise_gamma": 0.1, "seed": 11, "steps": 40}


@pytest.fixture(scope="module")
def moving(tmp_path_factory):
    base = tmp_path_factory.mktemp("device-moves")
    env = {DEVICE_MOVES_ENV: "1", FLUX_WIDTHS_ENV: "1"}  # (the narrow demo Flux on 0.3.75 too)
    with ComfyServer(base, extra_packs=TEST_NODE_PACKS, env=env) as running:
        yield running


@pytest.fixture(scope="module")
def dataset(moving):
    return write_one_folder(
        moving.base_dir / "input" / "kt_moves_set", ["a", "b", "c"], references=1, size=(64, 64)
    )


def loaders(graph: dict) -> dict:
    return {key: graph[key] for key in ("1", "2", "3")}


def succeeded(messages) -> None:
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")


def test_the_emulation_moves_weights(moving, dataset):
    """The server really runs the emulation: its log names it for every patcher class loaded."""
    _, messages = moving.run_prompt(training_graph(dataset, "kt_moves_probe", steps=1))
    succeeded(messages)
    assert "kt test: loads move weights as onto a GPU" in moving.log()


def test_previews_after_unload_models(moving, dataset):
    """A run with previews, "Unload models" (POST /free, what the button sends), then a second
    run: the loaders and the dataset come from the executor's cache, so the VAE's first load
    after the unload happens in the training thread, for the first preview."""
    graph = training_graph(dataset, "kt_moves_preview_a", preview_every=2, steps=4)
    prompt_id, messages = moving.run_prompt(graph)
    succeeded(messages)
    unloads = moving.log().count(UNLOAD_MARK)
    moving.post_json("/free", {"unload_models": True})
    deadline = time.monotonic() + 30  # the prompt worker unloads when it wakes for the flag
    while moving.log().count(UNLOAD_MARK) < unloads + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert moving.log().count(UNLOAD_MARK) >= unloads + 3  # the MODEL, the VAE and the CLIP
    graph["5"]["inputs"]["lora_name"] = "kt_moves_preview_b"
    again_id, again = moving.run_prompt(graph)
    succeeded(again)
    for run in (messages, again):  # rounds at step 2 and at the end, listed on the node
        assert [p["step"] for p in progress_events(run)[-1]["previews"]] == [2, 4]
    assert all(math.isfinite(loss) for loss in losses_of(moving, prompt_id))
    assert losses_of(moving, again_id) == losses_of(moving, prompt_id)  # same run, same losses


def test_cancel_then_resume_gives_the_uninterrupted_losses(moving, dataset):
    full_id, full = moving.run_prompt(training_graph(dataset, "kt_moves_full", **RECIPE))
    succeeded(full)
    uninterrupted = losses_of(moving, full_id)
    cut = run_and_interrupt(moving, training_graph(dataset, "kt_moves_cut", **RECIPE), at_step=3)
    assert cut[-1]["type"] == "execution_interrupted", cut[-1]
    choice = progress_events(cut)[-1]["message"].split("resume from ")[1]
    assert 3 <= int(choice.rsplit("_", 1)[1]) < RECIPE["steps"]
    resumed_id, resumed = moving.run_prompt(
        training_graph(dataset, "kt_moves_cut", resume_from=choice, **RECIPE)
    )
    succeeded(resumed)
    assert losses_of(moving, resumed_id) == uninterrupted


def test_a_stock_lora_before_train_lora(moving, dataset):
    """LoraLoaderModelOnly (a LoRA this pack trained) -> TrainLoRA: the run trains the patched
    model (its first loss differs from the plain model's with the same seed)."""
    plain_id, plain = moving.run_prompt(training_graph(dataset, "kt_moves_base", steps=2, seed=5))
    succeeded(plain)
    graph = training_graph(dataset, "kt_moves_on_lora", steps=2, seed=5)
    graph["9"] = {
        "class_type": "LoraLoaderModelOnly",
        "inputs": {"model": ["1", 0], "lora_name": "kt_moves_base.safetensors", "strength_model": 1.0},
    }
    graph["5"]["inputs"]["model"] = ["9", 0]
    patched_id, patched = moving.run_prompt(graph)
    succeeded(patched)
    assert "lora key not loaded" not in moving.log()
    assert losses_of(moving, patched_id)[0] != losses_of(moving, plain_id)[0]


@pytest.mark.slow
def test_the_demo_workflow(moving, stock_assets, tmp_path):
    """example_workflows/api/kontext_lora_training.json on the stock loaders and the demo's
    files, the Flux at 1/12 of its width (`demo_assets.NARROW_FLUX_CONFIG`, through the same
    stock UNETLoader: the moves are tested, not the size; the stock-size Flux cost 50 core-s on
    0.3.75 and 21 on 0.33 in a fresh clone of c0afdd7), cut to two steps with a preview at the
    end (no held-out loss)."""
    import demo_assets
    import demo_dataset

    narrow = demo_assets.write_narrow_flux(tmp_path / "kt-moves-narrow-flux.safetensors")
    demo_assets.link_into_models(stock_assets, moving.base_dir / "models")
    (moving.base_dir / "models" / "diffusion_models" / narrow.name).symlink_to(narrow)
    demo_dataset.write_demo_dataset(moving.base_dir / "input" / "kontext_demo", count=2)
    graph = demo_training("kt_moves_demo")
    graph["1"]["inputs"]["unet_name"] = narrow.name
    prompt_id, messages = moving.run_prompt(graph, timeout=600)
    succeeded(messages)
    result = moving.history(prompt_id)["outputs"]["5"]
    assert len(result["loss"]) == 2 and all(math.isfinite(x) for x in result["loss"])
    assert [p["step"] for p in progress_events(messages)[-1]["previews"]] == [2]
    tensors, _ = load(moving.base_dir / "models" / "loras" / "kt_moves_demo.safetensors")
    assert tensors


def test_the_model_samples_after_an_fp8_scaled_run(moving, dataset):
    """fp8_scaled unloads the MODEL from the training thread and gives its original weights
    back afterwards: a stock KSampler on the same (cached) MODEL in the next prompt still
    samples, and its latent equals the one sampled before the run."""
    graph = training_graph(dataset, "kt_moves_fp8_scaled", steps=2, fp8_mode="fp8_scaled")
    sampling = {
        "10": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["3", 0], "text": "make it blue"}},
        "11": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "12": {"class_type": "KSampler", "inputs": ksampler_inputs(["1", 0], ["10", 0], ["11", 0])},
        "13": {"class_type": "KTTest_LatentDigest", "inputs": {"samples": ["12", 0]}},
    }
    before_id, before = moving.run_prompt(loaders(graph) | sampling)
    succeeded(before)
    _, trained = moving.run_prompt(graph)
    succeeded(trained)
    sampling["12"]["inputs"]["seed"] = 8  # a new KSampler run on the same cached MODEL
    _, after = moving.run_prompt(loaders(graph) | sampling)
    succeeded(after)
    sampling["12"]["inputs"]["seed"] = 7
    again_id, again = moving.run_prompt(loaders(graph) | sampling)
    succeeded(again)
    digest = [moving.history(pid)["outputs"]["13"]["digest"] for pid in (before_id, again_id)]
    assert digest[0] == digest[1]
