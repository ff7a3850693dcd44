"""A real ComfyUI server with the pack in custom_nodes, over HTTP and websocket."""

from __future__ import annotations

import json

from kt_testing.comfy_runtime import pack_node_classes
from kt_testing.paths import PACK_DIR_NAME, REPO_ROOT


def test_pack_imports_without_failure(server):
    log = server.log()
    pack_lines = [
        line for line in log.splitlines() if line.rstrip().endswith(f"custom_nodes/{PACK_DIR_NAME}")
    ]
    assert pack_lines, f"the pack was not imported:\n{log[-3000:]}"
    assert not any("IMPORT FAILED" in line for line in pack_lines), pack_lines
    assert f"Cannot import {server.base_dir}/custom_nodes/{PACK_DIR_NAME}" not in log


def test_object_info_lists_exactly_the_packs_nodes(server, comfy_runtime):
    info = server.get_json("/object_info")
    served = {name for name, entry in info.items() if entry.get("python_module", "").endswith(PACK_DIR_NAME)}
    # The expected list comes from the extension itself, loaded in-process.
    expected = {n.GET_SCHEMA().node_id for n in pack_node_classes(comfy_runtime.pack_module)}
    assert served == expected
    assert "UNETLoader" in info and "ReferenceLatent" in info  # the stock nodes the pack builds on


def test_web_directory_is_served(server):
    listed = server.get_json("/extensions")
    ours = sorted(path for path in listed if path.startswith(f"/extensions/{PACK_DIR_NAME}/"))
    on_disk = sorted(
        f"/extensions/{PACK_DIR_NAME}/{p.relative_to(REPO_ROOT / 'web').as_posix()}"
        for p in (REPO_ROOT / "web").rglob("*.js")
    )
    assert ours == on_disk and ours
    for path in ours:
        local = REPO_ROOT / "web" / path.removeprefix(f"/extensions/{PACK_DIR_NAME}/")
        assert server.get(path) == local.read_bytes()


def test_websocket_reports_a_prompt_run(server):
    ws, client_id = server.websocket()
    try:
        first = json.loads(ws.recv())
    finally:
        ws.close()
    assert first["type"] == "status" and first["data"]["sid"] == client_id

    graph = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 32, "batch_size": 1, "color": 0}},
        "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    prompt_id, messages = server.run_prompt(graph)
    kinds = [m["type"] for m in messages]
    assert kinds[-1] == "execution_success", messages[-1]
    assert "execution_start" in kinds and "executed" in kinds
    assert server.history(prompt_id)["outputs"]["2"]["images"]


def test_multi_image_conditioning_is_described_for_the_frontend(server):
    entry = server.get_json("/object_info")["KontextTrainer_MultiImageConditioning"]
    assert entry["display_name"] == "Multi-Image Conditioning (Kontext Trainer)"
    layout = entry["input"]["required"]["layout"][1]
    assert layout["options"] == ["auto", "offset", "index", "uxo", "dreamomni2", "index_timestep_zero"]
    assert layout["default"] == "auto"  # the model's own (issue 42)
    assert set(entry["input"]["optional"]) == {"image_2", "image_3", "image_4"}
    assert entry["output"] == ["MODEL", "CONDITIONING"]


def test_node_search_tells_our_trainer_from_comfyuis_and_its_defaults_checkpoint(server):
    """Node search lists display names: ours must not read like core's "Train LoRA" (issue 33),
    its description must name every model it trains, and a fresh node must write checkpoints
    along the way (a crash near the end of a default run lost everything with save_every 0)."""
    info = server.get_json("/object_info")
    ours = info["KontextTrainer_TrainLoRA"]
    others = {
        (entry.get("display_name") or key).lower()
        for key, entry in info.items()
        if key != "KontextTrainer_TrainLoRA"
    }
    assert ours["display_name"].lower() not in others
    assert "kontext trainer" in ours["display_name"].lower()
    # a search for "train lora" finds both: the name must say which one is ours
    assert ours["display_name"].replace(" ", "").lower() != "trainlora"
    for model in ("FLUX.1", "Kontext", "DreamOmni2", "FLUX.2"):
        assert model in ours["description"], model
    required = ours["input"]["required"]
    steps, save_every = required["steps"][1]["default"], required["save_every"][1]["default"]
    assert 0 < save_every < steps
