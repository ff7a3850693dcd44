"""FLUX.2 [klein] without the graph (issue 42 item 3): the headless command and torchrun with the
tiny klein (`kt_testing/headless_tiny.py` with KT_TEST_TINY_MODELS=klein: the tiny klein, a tiny
Qwen3 through ComfyUI's klein text encoder, FLUX.2's VAE stand-in), ComfyUI 0.33 or newer.

- one process, batch 2: the command says first what ComfyUI cannot tell of klein (Base or
  distilled), resolves the layout from the model and writes a LoRA under klein's names;
- torchrun, 2 processes x batch 1, trains exactly that run (losses and LoRA to float32
  rounding), every random draw a step makes included (`DRAWS`), a held-out sample validated on
  both processes.
"""

from __future__ import annotations

import pytest
from safetensors import safe_open

from kt_testing.datasets import write_one_folder
from kt_testing.headless import (
    DRAWS,
    assert_same_run,
    global_batch_run,
    run,
    torchrun,
    write_config,
)
from kt_testing.headless_tiny import TINY_MODELS_ENV
from kt_testing.klein import comfy_has_klein

STEPS = 4
KLEIN = {TINY_MODELS_ENV: "klein"}


@pytest.fixture(scope="module")
def files(tmp_path_factory, comfy_runtime):
    if not comfy_has_klein():
        pytest.skip("ComfyUI 0.3.75 cannot build FLUX.2 [klein] (the refusal: e2e/test_klein_workflows.py)")
    root = tmp_path_factory.mktemp("klein-headless")
    dataset = write_one_folder(root / "data", list("abcdef"), references=1, size=(64, 64))

    def config(name: str, batch_size: int = 1):
        settings = {"lora_name": name, "steps": STEPS, "batch_size": batch_size, "save_every": 2, **DRAWS}
        path = root / f"{name}.toml"
        return write_config(path, root / "base", dataset, root / "cache", settings, hold_out=1)

    return type("Files", (), {"base": root / "base", "config": staticmethod(config)})


@pytest.fixture(scope="module")
def single(files):
    """One process, the global batch (2): its output and final state."""
    return global_batch_run(files, KLEIN)


def test_the_command_trains_klein_under_its_own_names(files, single):
    result, _ = single
    # the run's notes are logged as TrainLoRA's are in ComfyUI's console: the first one is what
    # ComfyUI cannot tell about klein
    notes = [line for line in result.stderr.splitlines() if line.startswith("WARNING:kontext_trainer:")]
    assert notes and notes[0].startswith(
        "WARNING:kontext_trainer:TrainLoRA single: FLUX.2 [klein] 4B: ComfyUI cannot tell a Base file "
        "from a distilled one; train on Base (flux-2-klein-base-4b.safetensors)"
    ), result.stderr
    lora = files.base / "models" / "loras" / "single.safetensors"
    assert f"LoRA saved: {lora}" in result.stdout
    with safe_open(str(lora), "pt") as handle:
        metadata = handle.metadata()
        keys = set(handle.keys())
    assert metadata["ss_base_model_version"] == "flux_2_klein_4b"
    assert metadata["modelspec.architecture"] == "Flux.2-klein-4b/lora"
    assert metadata["kontext_trainer.base_model"] == "flux2_klein_4b"
    assert metadata["kontext_trainer.layout"] == "index"  # auto: FLUX.2's own
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in keys


def test_torchrun_trains_klein_as_one_process_with_twice_the_batch(files, single):
    result = run(torchrun(files.config("ranks2"), 2, "--standalone"), env=KLEIN)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "data parallel: 2 processes, global batch 2 x 1" in result.stdout
    assert "TrainLoRA ranks2: FLUX.2 [klein] 4B: ComfyUI cannot tell" in result.stderr
    assert_same_run(files.base, "ranks2", single[1], STEPS)
