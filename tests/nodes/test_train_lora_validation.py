"""TrainLoRA's held-out validation through ComfyUI's executor (under inference mode, as the
server runs it): the LOSS_MAP, the ui, the events, the checkpoint and a resume carry the
validation points, and training is the same whether they are computed or not."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.executor import InGraph, run_node
from kt_testing.graphs import cache_name, dataset_inputs
from kt_testing.tiny_models import small_flux_vae, tiny_clip, tiny_flux_patcher

TRAIN = "KontextTrainer_TrainLoRA"


@pytest.fixture(scope="module")
def mods(pack_import):
    names = {"node": "nodes.train_lora", "events": "nodes.progress_events", "config": "trainer_core.config"}
    return type("Mods", (), {key: pack_import(name) for key, name in names.items()})


@pytest.fixture(scope="module")
def held_out_dataset(mods, tmp_path_factory):
    root = write_one_folder(
        tmp_path_factory.mktemp("data") / "set", ["a", "b", "c", "d"], references=1, size=(64, 64)
    )
    vae, clip = InGraph(lambda: small_flux_vae(seed=1)), InGraph(lambda: tiny_clip(seed=2))
    inputs = {**dataset_inputs(vae, clip, root, cache_name(tmp_path_factory)), "hold_out": 1}
    return run_node("KontextTrainer_LoadKontextDataset", inputs).outputs[0]


def run_train(mods, dataset, name, resume="none", **overrides):
    settings = {f.name: f.default for f in dataclasses.fields(mods.config.TrainConfig)}
    settings.update(steps=4, rank=2, alpha=2.0, learning_rate=1e-3, gradient_checkpointing=False)
    settings.update(overrides)
    inputs = {
        "model": InGraph(lambda: tiny_flux_patcher(seed=3)),
        "dataset": dataset,
        "lora_name": name,
        "overwrite": True,
        "resume_from": resume,
        "start_from_lora": "none",
        **settings,
    }
    return run_node(TRAIN, inputs, node_id="7")


def test_validation_points_reach_every_output_and_a_resume(mods, held_out_dataset):
    assert len(held_out_dataset.held_out) == 1
    result = run_train(mods, held_out_dataset, "kt_val", steps=4, validate_every=3, dropout=0.2, save_every=2)
    loss_map = result.outputs[2]
    assert loss_map["validation_step"] == [3, 4]
    assert all(v > 0 for v in loss_map["validation_loss"])
    assert result.ui["validation_loss"] == loss_map["validation_loss"]
    events = [e for e in result.events(mods.events.PROGRESS_EVENT) if e.get("validation_step")]
    assert {e["validation_step"] for e in events} <= {3, 4} and events[-1]["validation_step"] == 4
    assert events[-1]["validation_loss"] == loss_map["validation_loss"][-1]
    # the checkpoints keep them, and a resume continues the curve exactly
    choices = [c for c in mods.node.resume_choices() if c.startswith("kt_val/")]
    assert [c.rsplit("/", 1)[1] for c in choices] == ["step_000002", "step_000004"]
    state = json.loads((checkpoint_folder(choices[-1]) / "state.json").read_text())
    assert state["validation"] == [[s, v] for s, v in zip([3, 4], loss_map["validation_loss"], strict=True)]
    resumed = run_train(
        mods, held_out_dataset, "kt_val_resumed", choices[0], steps=4, validate_every=3, dropout=0.2
    )
    assert resumed.outputs[2] == loss_map  # losses and validation points alike


def test_training_is_the_same_with_validation_every_step_or_only_at_the_end(mods, held_out_dataset):
    often = run_train(mods, held_out_dataset, "kt_val_often", steps=3, validate_every=1, dropout=0.2)
    once = run_train(mods, held_out_dataset, "kt_val_once", steps=3, validate_every=0, dropout=0.2)
    assert often.outputs[2]["loss"] == once.outputs[2]["loss"]
    assert often.outputs[2]["validation_step"] == [1, 2, 3] and once.outputs[2]["validation_step"] == [3]
    # fixed noise and sigmas: the last point is the same number in both runs
    assert often.outputs[2]["validation_loss"][-1] == once.outputs[2]["validation_loss"][-1]


def test_no_held_out_samples_no_validation(mods, pack_import, tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1, size=(64, 64))
    vae, clip = InGraph(lambda: small_flux_vae(seed=1)), InGraph(lambda: tiny_clip(seed=2))
    dataset = run_node(
        "KontextTrainer_LoadKontextDataset",
        dataset_inputs(vae, clip, root, f"kt_test_caches/{tmp_path.name}"),
    )
    result = run_train(mods, dataset.outputs[0], "kt_val_none", steps=1, validate_every=1)
    assert result.outputs[2]["validation_step"] == [] and len(result.outputs[2]["loss"]) == 1


def checkpoint_folder(choice: str) -> Path:
    import folder_paths

    return Path(folder_paths.get_output_directory()) / "kontext_trainer_checkpoints" / choice
