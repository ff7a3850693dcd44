"""Issue 62 item 4 on the command line: what the run file alone decides is refused before
ComfyUI boots (`hold_out` against the dataset's samples), what the model decides before the
dataset encodes (klein's layouts): the command prints no "dataset:" line before the refusal."""

from __future__ import annotations

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.headless import command, refused_before_the_boot, run, write_config
from kt_testing.headless_tiny import TINY_MODELS_ENV
from kt_testing.klein import comfy_has_klein


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("refuse-early")
    dataset = write_one_folder(root / "data", ["a", "b", "c"], references=1, size=(64, 64))
    return type(
        "Files", (), {"root": root, "dataset": dataset, "cache": root / "cache", "base": root / "base"}
    )


@pytest.mark.version_independent
def test_a_hold_out_that_leaves_nothing_to_train_is_refused_before_the_boot(files):
    """On main it was refused after the boot and the model load (minutes for a real model)."""
    config = write_config(
        files.root / "hold.toml", files.base, files.dataset, files.cache, {"lora_name": "hold"}, hold_out=3
    )
    result = run(command(config))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"[kontext-trainer] error: {config}: [dataset] hold_out: 3 leaves none of the dataset's 3 "
        "sample(s) to train on; set hold_out to at most 2, or add samples"
    ), result.stderr
    assert refused_before_the_boot(result), result.stdout


def test_a_layout_klein_cannot_train_is_refused_before_the_dataset_encodes(files, comfy_runtime):
    """On main the dataset encoded first ("dataset: 1/8 images and captions ready", ...)."""
    if not comfy_has_klein():
        pytest.skip("ComfyUI 0.3.75 cannot build FLUX.2 [klein]")
    settings = {"lora_name": "klein_layout", "layout": "dreamomni2"}
    config = write_config(files.root / "klein.toml", files.base, files.dataset, files.cache, settings)
    result = run(command(config), env={TINY_MODELS_ENV: "klein"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"[kontext-trainer] error: {config}: [model] layout 'dreamomni2' does not fit a FLUX.2 [klein] "
        "4B model; choose one of index, offset, uxo, index_timestep_zero (index is its default)"
    ), result.stderr
    assert "loading the model files" in result.stdout and "dataset:" not in result.stdout, result.stdout
