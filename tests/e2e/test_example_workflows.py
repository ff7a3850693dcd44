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
