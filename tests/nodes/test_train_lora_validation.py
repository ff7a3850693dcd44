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


def test_a_batch_larger_than_the_dataset_is_lowered_unless_a_checkpoint_trained_it_as_given(pack_import):
    """Issue 44: `fit_batch` lowers batch_size to the training samples (with a note shown beside
    the estimate); a resume continues its checkpoint's batch: a run that was lowered stays
    lowered, and a checkpoint from before the rule (batch 8 on 2 samples, as given) resumes as
    it trained, so its resume check still passes."""
    service = pack_import("application.run_service")
    training = pack_import("application.training_run")
    config = pack_import("trainer_core.config").TrainConfig(batch_size=8)
    dataset = type("Dataset", (), {"entries": [object(), object()]})()

    def fitted(state):
        request = service.RunRequest("x", config)
        paths = pack_import("trainer_core.run_files").LoraPaths(Path("loras"), Path("checkpoints"), "x")
        prepared = service.PreparedRun(request, training.Run(paths), state)
        prepared.fit_batch(dataset)
        return prepared.config.batch_size, prepared.run.notes

    batch, notes = fitted(None)
    assert batch == 2
    note = "batch_size 8 is more than the dataset's 2 training sample(s): training with batch_size 2"
    assert notes == [note]
    assert fitted({"config": {"batch_size": 2}}) == (2, notes)  # the lowered run, resumed
    assert fitted({"config": {"batch_size": 8}}) == (8, [])  # a checkpoint from before the rule


def test_every_folder_a_run_writes_is_checked_before_it_starts(pack_import, tmp_path):
    """Issue 44: with output/kontext_trainer_checkpoints a plain file and save_every 12, a run
    trained 12 steps, then stopped with "Not a directory ... make room". Each folder a run
    writes is checked first, and the refusal names it."""
    policy = pack_import("application.run_policy")
    paths = pack_import("trainer_core.run_files").LoraPaths(tmp_path / "loras", tmp_path / "checkpoints", "x")
    policy.check_run_folders(paths)  # missing folders are made: nothing to refuse
    assert paths.loras_dir.is_dir() and paths.checkpoints_root.is_dir()
    assert not paths.snapshots.exists() and not paths.checkpoints.exists()  # made when written
    for blocked, role in (
        (paths.checkpoints_root, "the checkpoint folder"),
        (paths.checkpoints, "the checkpoint folder"),
        (paths.snapshots, "the snapshot folder"),
        (paths.loras_dir, "the LoRA folder"),
    ):
        kept = blocked.with_name(blocked.name + ".kept")
        if blocked.exists():
            blocked.rename(kept)
        blocked.write_text("a file")
        with pytest.raises(ValueError) as caught:
            policy.check_run_folders(paths)
        assert str(caught.value).startswith(
            f"{role} cannot take this run's files: {blocked} is a file, not a folder. Make {blocked} a folder"
        )
        blocked.unlink()
        if kept.exists():
            kept.rename(blocked)
