"""Qwen-Image-Edit 2509 without the graph (issue 43 item 6): the headless command and torchrun
with the tiny Qwen-Image parts (`kt_testing/headless_tiny.py` with KT_TEST_TINY_MODELS=qwen_image:
the tiny Qwen-Image-Edit, the narrow Wan 2.1 VAE, the tiny Qwen2.5-VL).

- a setting the family refuses (reference_dropout) is named before the dataset is encoded;
- one process, batch 2: the dataset is encoded as LoadKontextDataset encodes it (each caption
  with its sample's reference by ComfyUI's TextEncodeQwenImageEditPlus), the layout resolved
  from the model, a LoRA under musubi-tuner's names;
- torchrun, 2 processes x batch 1, trains exactly that run (losses and LoRA to float32
  rounding), every random draw a step makes included (`DRAWS`), a held-out sample validated on
  both processes.

Each reference costs a 1 MP VAE encode (the encoder node's size): 3 samples of one reference (2
train, 1 held out), encoded once (the processes share the cache), 3 steps. The command's path
does not depend on ComfyUI's version (the in-process and e2e tests run the family on both): it
runs once per `make test` (scripts/test.sh).
"""

from __future__ import annotations

import pytest
from safetensors import safe_open

from kt_testing.datasets import write_one_folder
from kt_testing.headless import (
    DRAWS,
    assert_same_run,
    command,
    global_batch_run,
    run,
    torchrun,
    write_config,
)
from kt_testing.headless_tiny import TINY_MODELS_ENV

pytestmark = pytest.mark.version_independent
STEPS = 3
QWEN = {TINY_MODELS_ENV: "qwen_image"}


@pytest.fixture(scope="module")
def files(tmp_path_factory, comfy_runtime):
    root = tmp_path_factory.mktemp("qwen-headless")
    dataset = write_one_folder(root / "data", list("abc"), references=1, size=(64, 64))

    def config(name: str, batch_size: int = 1, **changes):
        settings = {"lora_name": name, "steps": STEPS, "batch_size": batch_size, "save_every": 2}
        settings.update({**DRAWS, "reference_dropout": 0.0, **changes})  # (refused for Qwen: below)
        path = root / f"{name}.toml"
        return write_config(path, root / "base", dataset, root / "cache", settings, hold_out=1)

    return type("Files", (), {"base": root / "base", "config": staticmethod(config)})


def test_a_setting_qwen_cannot_train_with_is_refused_before_the_dataset_is_encoded(files):
    """reference_dropout (Qwen's text holds the references): named in [train], in one line,
    before any reference costs its 1 MP encode (that check came after the dataset: 70 s here)."""
    result = run(command(files.config("refused", reference_dropout=0.3)), env=QWEN)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[train] reference_dropout does not fit Qwen-Image-Edit 2509 yet" in result.stderr, result.stderr
    assert "Set reference_dropout to 0" in result.stderr
    assert "dataset:" not in result.stdout and not (files.base.parent / "cache").exists(), result.stdout


@pytest.fixture(scope="module")
def single(files):
    """One process, the global batch (2): its output and final state."""
    return global_batch_run(files, QWEN)


def test_the_command_trains_qwen_image_edit_under_musubi_tuners_names(files, single):
    result, _ = single
    assert "TextEncodeQwenImageEditPlus node" in result.stdout + result.stderr  # how it encoded
    lora = files.base / "models" / "loras" / "single.safetensors"
    assert f"LoRA saved: {lora}" in result.stdout
    with safe_open(str(lora), "pt") as handle:
        metadata = handle.metadata()
        keys = set(handle.keys())
    assert metadata["ss_base_model_version"] == "qwen_image_edit_plus"
    assert metadata["modelspec.architecture"] == "Qwen-Image-Edit-Plus/lora"
    assert metadata["kontext_trainer.base_model"] == "qwen_image_edit_2509"
    assert metadata["kontext_trainer.layout"] == "index"  # auto: 2509's own
    assert "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight" in keys


def test_torchrun_trains_qwen_image_edit_as_one_process_with_twice_the_batch(files, single):
    result = run(torchrun(files.config("ranks2"), 2, "--standalone"), env=QWEN)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "data parallel: 2 processes, global batch 2 x 1" in result.stdout
    assert_same_run(files.base, "ranks2", single[1], STEPS)
