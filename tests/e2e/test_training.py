"""TrainLoRA on a real ComfyUI server, driven over HTTP and the websocket: live progress
events, the stock Cancel (/interrupt), the stock LoraLoaderModelOnly on the result, a NaN
stopping the run, and a server killed mid-save leaving every file whole."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.graphs import training_graph
from kt_testing.paths import TEST_NODE_PACKS
from kt_testing.runs import progress_events, run_and_interrupt
from kt_testing.server import ComfyServer
from trainer_core.checkpoint import all_checkpoints, load_checkpoint
from trainer_core.lora_file import load


@pytest.fixture(scope="module")
def dataset(server):
    return write_one_folder(
        server.base_dir / "input" / "kt_e2e_set", ["a", "b", "c"], references=1, size=(64, 64)
    )


def loras(server) -> Path:
    return server.base_dir / "models" / "loras"


def checkpoints(server, name: str) -> Path:
    return server.base_dir / "output" / "kontext_trainer_checkpoints" / name


def test_progress_events_then_the_stock_loader_reads_the_lora(server, dataset):
    prompt_id, messages = server.run_prompt(training_graph(dataset, "kt_e2e_events", steps=6))
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")
    events = progress_events(messages)
    steps = [e["step"] for e in events]
    assert events[-1]["status"] == "finished" and events[-1]["step"] == 6 and events[-1]["total"] == 6
    assert steps == sorted(steps) and len(set(steps)) >= 2  # live: several steps reported
    assert all(set(e) >= {"loss", "smoothed_loss", "lr", "eta_seconds", "node", "prompt_id"} for e in events)
    assert events[-1]["node"] == "5" and events[-1]["prompt_id"] == prompt_id
    assert any(e["message"].startswith("estimated VRAM ~") for e in events)  # shown before training
    assert any(m["type"] == "progress" and m["data"]["node"] == "5" for m in messages)  # ComfyUI's own bar
    # What the node publishes in /history (its `ui`): the file name and one loss per step, the
    # same losses the websocket reported while it ran.
    published = server.history(prompt_id)["outputs"]["5"]
    assert published["lora_name"] == ["kt_e2e_events.safetensors"]
    losses = published["loss"]
    assert len(losses) == 6 and all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in losses)
    reported = {e["step"]: e["loss"] for e in events if e["step"] >= 1 and e["loss"] is not None}
    assert reported and all(
        loss == pytest.approx(losses[step - 1], rel=1e-6) for step, loss in reported.items()
    )
    tensors, metadata = load(loras(server) / "kt_e2e_events.safetensors")
    assert metadata["ss_steps"] == "6" and metadata["ss_network_dim"] == "2"  # the graph's steps and rank
    assert any(float(t.abs().max()) > 0 for k, t in tensors.items() if k.endswith(".lora_up.weight"))

    probe = {
        "1": {"class_type": "KTTest_TinyFluxModel", "inputs": {"seed": 3}},
        "2": {
            "class_type": "LoraLoaderModelOnly",
            "inputs": {"model": ["1", 0], "lora_name": "kt_e2e_events.safetensors", "strength_model": 1.0},
        },
        "3": {"class_type": "KTTest_ModelDifference", "inputs": {"model_a": ["2", 0], "model_b": ["1", 0]}},
    }
    probe_id, probe_messages = server.run_prompt(probe)
    assert probe_messages[-1]["type"] == "execution_success", probe_messages[-1]
    assert server.history(probe_id)["outputs"]["3"]["difference"][0] > 0  # the LoRA changes the model


def test_held_out_validation_through_the_server(server, dataset):
    """One of the three samples held out: its loss every 2 steps and after the last, in the
    websocket events, /history and the chart PNG beside the LoRA."""
    graph = training_graph(dataset, "kt_e2e_validation", steps=5, validate_every=2, hold_out=1, dropout=0.1)
    prompt_id, messages = server.run_prompt(graph)
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")
    published = server.history(prompt_id)["outputs"]["5"]
    assert published["validation_step"] == [2, 4, 5] and len(published["loss"]) == 5
    assert all(math.isfinite(v) and v > 0 for v in published["validation_loss"])
    events = [e for e in progress_events(messages) if e.get("validation_step") is not None]
    assert events and {e["validation_step"] for e in events} <= {2, 4, 5}
    final = events[-1]
    assert final["validation_step"] == 5 and final["validation_loss"] == published["validation_loss"][-1]
    # the same run without validation points trains exactly the same (every 2 -> at the end only)
    graph_once = training_graph(
        dataset, "kt_e2e_validation_once", steps=5, validate_every=0, hold_out=1, dropout=0.1
    )
    once_id, once_messages = server.run_prompt(graph_once)
    assert once_messages[-1]["type"] == "execution_success"
    once = server.history(once_id)["outputs"]["5"]
    assert once["loss"] == published["loss"] and once["validation_step"] == [5]
    assert once["validation_loss"] == published["validation_loss"][-1:]
    assert (loras(server) / "kt_e2e_validation_loss.png").is_file()


def test_interrupt_stops_with_a_checkpoint_and_the_next_prompt_runs(server, dataset):
    messages = run_and_interrupt(server, training_graph(dataset, "kt_e2e_cancel", steps=100_000), at_step=2)
    assert messages[-1]["type"] == "execution_interrupted", messages[-1]
    saved = all_checkpoints(checkpoints(server, "kt_e2e_cancel"))
    assert len(saved) == 1 and load_checkpoint(saved[0], []).step >= 2
    assert progress_events(messages)[-1]["status"] == "cancelled"
    assert not (loras(server) / "kt_e2e_cancel.safetensors").exists()
    _, after = server.run_prompt(training_graph(dataset, "kt_e2e_after_cancel", steps=2))
    assert after[-1]["type"] == "execution_success", after[-1]


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(server, dataset):
    _, messages = server.run_prompt(
        training_graph(dataset, "kt_e2e_nan", poison=True, steps=30, save_every=1)
    )
    assert messages[-1]["type"] == "execution_error", messages[-1]
    assert "the loss became nan" in messages[-1]["data"]["exception_message"]
    for path in all_checkpoints(checkpoints(server, "kt_e2e_nan")):
        checkpoint = load_checkpoint(path, [])  # its steps and losses
        assert all(loss == loss for loss in checkpoint.losses)  # no NaN ever saved
    assert not (loras(server) / "kt_e2e_nan.safetensors").exists()


@pytest.mark.parametrize("name", ["../outside", "CON"])
def test_bad_names_are_refused(server, dataset, name):
    _, messages = server.run_prompt(training_graph(dataset, name, steps=1))
    assert messages[-1]["type"] == "execution_error"
    assert "lora_name" in messages[-1]["data"]["exception_message"]


@pytest.mark.version_independent
def test_a_kill_during_a_save_leaves_every_file_whole(tmp_path):
    """SIGKILL the server the moment a save is under way (a staging folder or temp file
    exists); the previous LoRA and every checkpoint must still load."""
    with ComfyServer(tmp_path / "base", extra_packs=TEST_NODE_PACKS) as server:
        data = write_one_folder(server.base_dir / "input" / "set", ["a", "b"], references=1, size=(64, 64))
        _, first = server.run_prompt(training_graph(data, "kt_atomic", steps=2))
        assert first[-1]["type"] == "execution_success"
        lora = loras(server) / "kt_atomic.safetensors"
        previous = lora.read_bytes()
        server.post_json(
            "/prompt",
            {
                "prompt": training_graph(
                    data, "kt_atomic", overwrite=True, steps=400, save_every=1, rank=64, alpha=64.0, seed=1
                )
            },
        )
        saved = checkpoints(server, "kt_atomic")
        deadline, caught = time.monotonic() + 240, None
        while time.monotonic() < deadline and caught is None:
            runs = [p for p in saved.iterdir() if p.is_dir()] if saved.is_dir() else []
            for folder in (*runs, loras(server)):
                caught = next((p for p in folder.iterdir() if p.name.endswith(".partial")), None)
                if caught is not None:
                    server.kill()
                    break
        assert caught is not None, "no save was seen in progress"
    assert lora.read_bytes() == previous
    assert load(lora)[0]  # still a valid safetensors file
    for path in all_checkpoints(saved):
        load_checkpoint(path, [])  # every visible checkpoint is complete

    with ComfyServer(tmp_path / "base", extra_packs=TEST_NODE_PACKS) as server:  # the next run tidies up
        _, again = server.run_prompt(training_graph(data, "kt_atomic", overwrite=True, steps=1))
        assert again[-1]["type"] == "execution_success"
    assert not [p for p in saved.rglob("*") if p.name.endswith((".partial", ".old"))]
    assert not list(loras(server).glob(".*.partial"))
