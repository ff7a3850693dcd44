"""Every shared workflow in example_workflows/ loads in the real frontend with the pack."""

from __future__ import annotations

import json

import pytest

from kt_testing.paths import REPO_ROOT

WORKFLOWS = sorted((REPO_ROOT / "example_workflows").glob("*.json"))


def test_there_are_example_workflows():
    assert WORKFLOWS


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_loads_and_converts_to_a_prompt(comfy_page, server, path):
    workflow = json.loads(path.read_text())
    known = server.get_json("/object_info")
    missing = sorted({node["type"] for node in workflow["nodes"]} - set(known))
    assert not missing, f"{path.name} uses node types this ComfyUI lacks: {missing}"

    prompt = comfy_page.evaluate(
        """async (workflow) => {
            const app = window.comfyAPI.app.app;
            await app.loadGraphData(workflow);
            return (await app.graphToPrompt()).output;
        }""",
        workflow,
    )
    # Every node survives the round trip, with its type.
    saved_types = {str(node["id"]): node["type"] for node in workflow["nodes"]}
    assert {k: v["class_type"] for k, v in prompt.items()} == saved_types
    ours = {k: v for k, v in prompt.items() if v["class_type"].startswith("KontextTrainer_")}
    assert ours, f"{path.name} does not use a Kontext Trainer node"
    # A workflow generated from an API-format source (scripts/export_ui_workflows.py) must
    # still be exactly that source: what the demo queues is what users load.
    source = REPO_ROOT / "example_workflows" / "api" / path.name
    if source.is_file():
        expected = json.loads(source.read_text())
        assert {k: v["inputs"] for k, v in prompt.items()} == {k: v["inputs"] for k, v in expected.items()}
    # MultiImageConditioning keeps its layout and its MODEL output feeds a sampler.
    for node_id, node in ours.items():
        if node["class_type"] != "KontextTrainer_MultiImageConditioning":
            continue
        widgets = next(n["widgets_values"] for n in workflow["nodes"] if str(n["id"]) == node_id)
        assert node["inputs"]["layout"] in widgets
        consumers = [v for v in prompt.values() if any(link == [node_id, 0] for link in v["inputs"].values())]
        assert consumers, f"the MODEL output of node {node_id} is not used"


def prepare_names(server, paths):
    """Files under the names the workflows use (the demo assets, `paths`, stand in for the real
    models; validation checks names, not contents)."""
    from PIL import Image

    import demo_assets

    models = server.base_dir / "models"
    demo_assets.link_into_models(paths, models)
    stand_ins = {
        "diffusion_models/flux1-dev-kontext_fp8_scaled.safetensors": paths["flux"],
        "text_encoders/clip_l.safetensors": paths["clip"],
        "text_encoders/t5xxl_fp8_e4m3fn_scaled.safetensors": paths["clip"],
        "vae/ae.safetensors": paths["vae"],
    }
    for name, target in stand_ins.items():
        link = models / name
        if not link.exists():
            link.symlink_to(target.resolve())
    from safetensors.torch import save_file

    (models / "loras").mkdir(exist_ok=True)
    save_file({}, str(models / "loras" / "kontext_demo_lora.safetensors"))
    inputs = server.base_dir / "input"
    for folder in ("kontext_demo", "dreamomni2_demo", "flux_dev_demo"):
        (inputs / folder).mkdir(exist_ok=True)
    for image in ("person.png", "hat.png", "kontext_demo_reference.png"):
        Image.new("RGB", (64, 64), (200, 100, 50)).save(inputs / image)


@pytest.mark.slow
@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_validates_on_the_server(server, stock_assets, path):
    """ComfyUI accepts the workflow's prompt (its own validation of every node and value); the
    queued run is then withdrawn."""
    import time

    prepare_names(server, stock_assets)
    source = REPO_ROOT / "example_workflows" / "api" / path.name
    assert source.is_file(), f"{path.name} has no API-format source in example_workflows/api/"
    queued = server.post_json("/prompt", {"prompt": json.loads(source.read_text())})
    assert queued["node_errors"] == {}, queued
    server.post_json("/queue", {"delete": [queued["prompt_id"]]})
    server.post_json("/interrupt", {})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # leave an idle server to the next test
        queue = server.get_json("/queue")
        if not queue["queue_running"] and not queue["queue_pending"]:
            break
        server.post_json("/interrupt", {})
        time.sleep(0.2)
