"""ComfyUI 0.33 on a GPU, as users run it: a server without --cpu (dynamic VRAM on, its default
on NVIDIA) and one with --disable-dynamic-vram, each training the demo workflow. Both train with
finite losses to close LoRAs (GPU kernels differ by mode: not bit for bit); the dynamic server
says it trained on the streamed weights, and its anonymous memory grows by less than a copy of
the model beyond what ComfyUI's own sampling of the same file grows. Needs a GPU and ComfyUI
0.33 (`scripts/gpu-carry-033.sh` carries it to the GPU machine); the CPU dry run and ComfyUI
0.3.75 skip it with the reason."""

from __future__ import annotations

import json
import math

import pytest

from kt_testing.dynamic_vram import comfyui_has_dynamic_vram
from kt_testing.paths import REPO_ROOT, TEST_NODE_PACKS

pytestmark = pytest.mark.skipif(
    not comfyui_has_dynamic_vram(), reason="ComfyUI 0.3.75 has no dynamic VRAM (ModelPatcherDynamic)"
)


def trained(server, workflow: dict):
    prompt_id, messages = server.run_prompt(workflow, timeout=900)
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")
    return server.history(prompt_id)["outputs"]["5"], messages


def anonymous_memory(server) -> dict:
    probe = {"1": {"class_type": "KTTest_AnonymousMemory", "inputs": {"nonce": 0}}}
    prompt_id, messages = server.run_prompt(probe)
    assert messages[-1]["type"] == "execution_success"
    return {k: v[0] for k, v in server.history(prompt_id)["outputs"]["1"].items()}


def stock_sampling(workflow: dict) -> dict:
    """The inference example's stock part: the demo Flux sampled by the stock KSampler (no LoRA,
    no reference), on the same files."""
    keep = {"1", "3", "4", "5", "9", "10", "11", "12"}
    graph = {k: v for k, v in json.loads(json.dumps(workflow)).items() if k in keep}
    graph["8"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["5", 0]}}
    graph["10"]["inputs"].update(model=["1", 0], positive=["5", 0], negative=["8", 0], steps=4)
    return graph


@pytest.mark.slow
def test_the_demo_trains_with_and_without_dynamic_vram(cuda_only, stock_assets, tmp_path):
    import demo_assets
    import demo_dataset
    from demo_assets import on_demo_files
    from kt_testing.runs import progress_events
    from kt_testing.server import ComfyServer
    from trainer_core.lora_file import load

    workflow = on_demo_files(
        json.loads((REPO_ROOT / "example_workflows/api/kontext_lora_training.json").read_text())
    )
    workflow["5"]["inputs"].update(steps=4, save_every=0)
    inference = on_demo_files(
        json.loads((REPO_ROOT / "example_workflows/api/kontext_lora_inference.json").read_text())
    )
    loras, growth, where, pinned = {}, {}, {}, {}
    for mode, args in (("sampling", ()), ("dynamic", ()), ("disabled", ("--disable-dynamic-vram",))):
        base = tmp_path / mode
        server = ComfyServer(base, extra_packs=TEST_NODE_PACKS, device="cuda", start_timeout=300, args=args)
        with server:
            demo_assets.link_into_models(stock_assets, server.base_dir / "models")
            demo_dataset.write_demo_dataset(server.base_dir / "input" / "kontext_demo", count=2)
            assert ("DynamicVRAM support detected and enabled" in server.log()) == (mode != "disabled")
            anonymous_memory(server)
            if mode == "sampling":  # ComfyUI's own use of the model, for comparison
                _, messages = server.run_prompt(stock_sampling(inference), timeout=900)
                assert messages[-1]["type"] == "execution_success", messages[-1]["data"]
                seen = anonymous_memory(server)
                growth[mode], where[mode] = (seen["peak_kib"] - seen["base_kib"]) * 1024, seen["peak_where"]
                pinned[mode] = seen["pinned_bytes"]
                continue
            output, messages = trained(server, workflow)
            seen = anonymous_memory(server)
            growth[mode], where[mode] = (seen["peak_kib"] - seen["base_kib"]) * 1024, seen["peak_where"]
            pinned[mode] = seen["pinned_bytes"]
            assert all(math.isfinite(x) for x in output["loss"])
            first = progress_events(messages)[0]["message"]
            assert ("ComfyUI's dynamic VRAM: training streams" in first) == (mode == "dynamic"), first
            loras[mode], _ = load(server.base_dir / "models" / "loras" / output["lora_name"][0])
    model = stock_assets["flux"].stat().st_size
    print(
        f"\nanonymous memory growth: training {growth['dynamic'] >> 20} MiB (dynamic VRAM), "
        f"{growth['disabled'] >> 20} MiB (disabled); ComfyUI's own sampling {growth['sampling'] >> 20} "
        f"MiB (dynamic VRAM); model file {model >> 20} MiB; of it ComfyUI's pinned host buffers: "
        + ", ".join(f"{mode} {pinned[mode] >> 20} MiB" for mode in growth)
    )
    for mode, frames in where.items():
        print(f"peak ({mode}) seen at:\n{frames}")
    assert loras["dynamic"].keys() == loras["disabled"].keys()
    for key, value in loras["dynamic"].items():
        other = loras["disabled"][key].float()
        # the same training in other kernels: close, not equal (4 steps from the same start)
        assert float((value.float() - other).norm()) <= 0.1 * float(other.norm()) + 1e-6, key
    # Under dynamic VRAM ComfyUI itself stages weights in pinned host buffers
    # (`comfy_aimdo.host_buffer`, sized from the model), so the process grows while it samples
    # too: training may grow as much as ComfyUI's own sampling of the same file, and a copy of
    # the weights (+ the model file) never fits. Session 19, H200: training grew 2568 MiB
    # where the old bound (half the model, 510 MiB) assumed no staging at all.
    assert growth["dynamic"] < growth["sampling"] + 0.5 * model
    # split (issue 41 item 6): ComfyUI's pinned host buffers (`TOTAL_PINNED_MEMORY`, at the end
    # of the run: pins live as long as the loaded model) are its own; what is left is ours, and
    # a copy of the weights would be at least the whole model
    ours = growth["dynamic"] - pinned["dynamic"]
    print(f"dynamic VRAM training: ours {ours >> 20} MiB, ComfyUI's pinned {pinned['dynamic'] >> 20} MiB")
    assert ours < 0.5 * model
