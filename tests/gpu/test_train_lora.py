"""TrainLoRA on the GPU through ComfyUI's own executor (inference mode, prompt thread, the
training thread): previews, Cancel then resume with exactly the uninterrupted losses, and the
out-of-memory message for a batch far too large."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
from gpu.support import model_output, unload_everything

from kt_testing.graphs import cache_name

TRAIN = "KontextTrainer_TrainLoRA"


def settings(mods, **overrides):
    defaults = {f.name: f.default for f in dataclasses.fields(mods.config.TrainConfig)}
    defaults.update(steps=4, rank=2, alpha=2.0, learning_rate=1e-3, gradient_checkpointing=False)
    defaults.update(overrides)
    return defaults


def tiny_model():
    from kt_testing.executor import InGraph
    from kt_testing.tiny_models import tiny_flux_patcher

    return InGraph(lambda: tiny_flux_patcher(seed=3))


def run_train(mods, dataset, name, model=None, resume="none", preview=None, **overrides):
    """TrainLoRA through ComfyUI's executor, on a tiny Flux built inside it (like a loader's),
    on ComfyUI's device: the GPU here."""
    from kt_testing.executor import run_node

    inputs = {
        "model": model or tiny_model(),
        "dataset": dataset,
        "lora_name": name,
        "overwrite": True,
        "resume_from": resume,
        "preview": preview,
        **settings(mods, **overrides),
    }
    return run_node(TRAIN, inputs, node_id="7")


def write_dataset(folder: Path, count: int, size: int, resolution: int, cache: Path):
    """LoadKontextDataset (through the executor) on `count` generated pairs, encoded by the
    small Flux VAE and the tiny CLIP on ComfyUI's device."""
    from kt_testing.datasets import write_one_folder
    from kt_testing.executor import InGraph, run_node
    from kt_testing.graphs import dataset_inputs
    from kt_testing.tiny_models import small_flux_vae, tiny_clip

    names = [f"s{i:02d}" for i in range(count)]
    root = write_one_folder(folder, names, references=1, size=(size, size))
    vae, clip = InGraph(lambda: small_flux_vae(seed=1)), InGraph(lambda: tiny_clip(seed=2))
    inputs = {**dataset_inputs(vae, clip, root, str(cache)), "resolution": resolution}
    return run_node("KontextTrainer_LoadKontextDataset", inputs).outputs[0]


@pytest.fixture(scope="module")
def dataset(gpu, tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "set", 3, 64, 256, cache_name(tmp_path_factory))


def test_previews_on_the_gpu_leave_the_losses_unchanged(gpu, mods, dataset, deterministic):
    """Previews sampled between steps (ComfyUI's KSampler on the training clone, on the GPU)
    come out as images and leave the training losses exactly as without previews."""
    import torch

    from kt_testing.executor import InGraph, run_node
    from kt_testing.graphs import preview_inputs
    from kt_testing.tiny_models import small_flux_vae, tiny_clip

    positive = run_node(
        "CLIPTextEncode", {"clip": InGraph(lambda: tiny_clip(seed=2)), "text": "make it blue"}
    )
    vae = InGraph(lambda: small_flux_vae(seed=1))
    preview = run_node("KontextTrainer_PreviewSampler", preview_inputs(positive.outputs[0], vae, 2)).outputs[
        0
    ]
    common = {"steps": 4, "dropout": 0.1, "seed": 3}
    plain = run_train(mods, dataset, "kt_gpu_no_preview", **common).outputs
    with_previews = run_train(mods, dataset, "kt_gpu_preview", preview=preview, **common).outputs
    assert with_previews[2]["loss"] == plain[2]["loss"]
    images = with_previews[3]  # the rounds at step 2 and at the end
    assert images.shape == (2, 64, 64, 3) and torch.isfinite(images).all() and float(images.std()) > 0
    assert [p["step"] for p in mods.job.MANAGER.current.snapshot().previews] == [2, 4]


def press_cancel(mods, name: str, at_step: int) -> threading.Thread:
    """Press Cancel (ComfyUI's interrupt, what POST /interrupt does) once job `name` reports
    `at_step`."""
    import comfy.model_management

    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            job = mods.job.MANAGER.current
            if job is not None and job.name == name and job.snapshot().step >= at_step:
                comfy.model_management.interrupt_current_processing(True)
                return
            time.sleep(0.005)

    presser = threading.Thread(target=watch)
    presser.start()
    return presser


@pytest.mark.parametrize("blocks_to_swap", [0, 2], ids=["no-swap", "swap-2"])
def test_cancel_then_resume_gives_the_uninterrupted_losses(gpu, mods, dataset, deterministic, blocks_to_swap):
    """Cancel mid-run (every random part on: LoRA dropout on the GPU's RNG, caption dropout,
    ip_noise_gamma; with and without block swap), then resume from the checkpoint Cancel wrote:
    the losses are exactly those of an uninterrupted run. After the Cancel the MODEL holds the
    weights it was loaded with, where ComfyUI loaded them."""
    import comfy.model_management
    import torch

    from kt_testing.executor import InGraph
    from kt_testing.tiny_models import tiny_flux_patcher

    recipe = {
        "dropout": 0.1,
        "caption_dropout": 0.3,
        "ip_noise_gamma": 0.1,
        "seed": 11,
        "gradient_checkpointing": True,
        "blocks_to_swap": blocks_to_swap,
    }
    name = f"kt_gpu_cut_{blocks_to_swap}"
    built = []

    def loaded_model():  # built in the graph like a loader's output, kept to inspect it after Cancel
        built.append(tiny_flux_patcher(seed=3))
        return built[-1]

    presser = press_cancel(mods, name, at_step=3)
    # a long run, so Cancel always comes first (the constant schedule does not depend on steps)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        run_train(mods, dataset, name, model=InGraph(loaded_model), steps=100_000, **recipe)
    presser.join()
    status = mods.job.MANAGER.current.snapshot()
    assert status.status == "cancelled", status
    choice = status.message.split("resume from ")[1]
    stopped_at = int(choice.rsplit("_", 1)[1])
    assert stopped_at >= 3
    assert torch.equal(model_output(built[0]), model_output(tiny_flux_patcher(seed=3)))

    total = stopped_at + 3
    uninterrupted = run_train(mods, dataset, f"{name}_full", steps=total, **recipe).outputs[2]["loss"]
    resumed = run_train(mods, dataset, f"{name}_resumed", resume=choice, steps=total, **recipe).outputs[2]
    print(f"\ncancelled at step {stopped_at} (blocks_to_swap {blocks_to_swap}); uninterrupted, resumed:")
    for step, (a, b) in enumerate(zip(uninterrupted, resumed["loss"], strict=True), 1):
        print(f"  {step:3d}  {a:.6f}  {b:.6f}{'  <- resumed' if step == stopped_at + 1 else ''}")
    assert resumed["loss"] == uninterrupted


@pytest.fixture(scope="module")
def large_dataset(gpu, tmp_path_factory):
    """16 pairs at 1024 px (4096 tokens a sample): a batch of 16 needs 16x the activations of
    one."""
    root = tmp_path_factory.mktemp("large")
    return write_dataset(root / "set", 16, 1024, 1024, cache_name(tmp_path_factory))


def test_a_huge_batch_runs_out_of_memory_with_advice(cuda_only, mods, large_dataset):
    """Measure the reserved GPU memory of one step at batch 1, allow this process twice that
    (`torch.cuda.set_per_process_memory_fraction`, so the figure holds on any GPU size), then
    train at batch 16: TrainLoRA raises torch.OutOfMemoryError whose message starts "out of GPU
    memory while training" and says what to change, and no LoRA is written."""
    import comfy.model_management
    import folder_paths
    import torch

    device = cuda_only.device
    unload_everything()
    torch.cuda.reset_peak_memory_stats(device)
    run_train(mods, large_dataset, "kt_gpu_batch_one", steps=1, batch_size=1)
    one = torch.cuda.max_memory_reserved(device)
    unload_everything()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 2 * one / total), device)
    try:
        with pytest.raises(torch.OutOfMemoryError) as caught:
            run_train(mods, large_dataset, "kt_gpu_huge_batch", steps=1, batch_size=16)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        comfy.model_management.soft_empty_cache()
    message = str(caught.value)
    print(
        f"\nbatch 1 reserved {one / 2**20:.0f} MiB; allowed {2 * one / 2**20:.0f} MiB; batch 16:\n  {message}"
    )
    assert message.startswith("out of GPU memory while training")
    assert "blocks_to_swap" in message and "GiB peak" in message  # the advice and the estimate
    assert not (Path(folder_paths.get_folder_paths("loras")[0]) / "kt_gpu_huge_batch.safetensors").exists()
