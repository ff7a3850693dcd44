"""The demo workflow on a real ComfyUI server started on the GPU (no --cpu): the training example
(`example_workflows/api/kontext_lora_training.json`, what `make demo` queues) on the
stock-loadable demo Flux, then the stock LoraLoaderModelOnly on the LoRA it wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from demo_assets import on_demo_files

TRAINING = Path("example_workflows") / "api" / "kontext_lora_training.json"
INFERENCE = Path("example_workflows") / "api" / "kontext_lora_inference.json"


def node_of(workflow: dict, class_type: str) -> str:
    (found,) = [key for key, node in workflow.items() if node["class_type"] == class_type]
    return found


def succeeded(messages) -> None:
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")


@pytest.mark.slow
def test_the_demo_workflow_trains_on_a_gpu_server(gpu, stock_assets, tmp_path):
    """Cut to four steps; the LoRA keeps the example's name, so the inference example loads it
    exactly as shipped. The stock loader must patch one weight per LoRA module in the file and
    change the model's output."""
    import demo_assets
    import demo_dataset
    from kt_testing.paths import REPO_ROOT, TEST_NODE_PACKS
    from kt_testing.runs import progress_events
    from kt_testing.server import ComfyServer
    from trainer_core.lora_file import load

    device = "cuda" if gpu.cuda else "cpu"
    server = ComfyServer(tmp_path / "base", extra_packs=TEST_NODE_PACKS, device=device, start_timeout=300)
    with server:
        assert server.get_json("/system_stats")["devices"][0]["type"] == device
        demo_assets.link_into_models(stock_assets, server.base_dir / "models")
        demo_dataset.write_demo_dataset(server.base_dir / "input" / "kontext_demo")
        workflow = on_demo_files(json.loads((REPO_ROOT / TRAINING).read_text()))
        trainer = node_of(workflow, "KontextTrainer_TrainLoRA")
        workflow[trainer]["inputs"].update(steps=4, save_every=0)
        lora_name = f"{workflow[trainer]['inputs']['lora_name']}.safetensors"
        prompt_id, messages = server.run_prompt(workflow, timeout=900)
        succeeded(messages)
        result = server.history(prompt_id)["outputs"][trainer]
        assert result["lora_name"] == [lora_name] and len(result["loss"]) == 4
        assert all(math.isfinite(loss) for loss in result["loss"])
        # (under dynamic VRAM the estimate follows the mode's note)
        assert any("estimated VRAM ~" in e["message"] for e in progress_events(messages))
        tensors, metadata = load(server.base_dir / "models" / "loras" / lora_name)
        assert metadata["ss_base_model_version"] == "flux1"
        assert metadata["kontext_trainer.base_model"] == "flux1_kontext"
        modules = [key for key in tensors if key.endswith(".lora_down.weight")]

        unet = workflow[node_of(workflow, "UNETLoader")]
        probe = {
            "1": {"class_type": "UNETLoader", "inputs": dict(unet["inputs"])},
            "2": {
                "class_type": "LoraLoaderModelOnly",
                "inputs": {"model": ["1", 0], "lora_name": lora_name, "strength_model": 1.0},
            },
            "3": {"class_type": "KTTest_LoraPatches", "inputs": {"model": ["2", 0], "base": ["1", 0]}},
        }
        probe_id, probe_messages = server.run_prompt(probe, timeout=300)
        succeeded(probe_messages)
        report = server.history(probe_id)["outputs"]["3"]
        print(
            f"\nstock LoraLoaderModelOnly on {report['device'][0]}: {report['patched_keys'][0]} keys patched"
        )
        assert report["patched_keys"] == [len(modules)] and report["difference"][0] > 0
        assert report["device"][0].startswith(device)

        inference = on_demo_files(
            json.loads((REPO_ROOT / INFERENCE).read_text())
        )  # as shipped: it loads lora_name
        inference_id, inference_messages = server.run_prompt(inference, timeout=600)
        succeeded(inference_messages)
        images = server.history(inference_id)["outputs"][node_of(inference, "SaveImage")]["images"]
        assert len(images) == 1
        assert "lora key not loaded" not in server.log()
