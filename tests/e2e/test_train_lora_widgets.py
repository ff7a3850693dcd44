"""TrainLoRA's widgets in the real frontend: the essentials show, the rest wait behind the
node's own "Show Advanced", and workflows saved before widgets were added (before 2bc8e02: the
widgets added after `overwrite`; before 7255115: `save_precision`; CHANGELOG.md) load with every
value where it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
TRAIN = "KontextTrainer_TrainLoRA"

WIDGETS_JS = """(type) => {
    const node = window.comfyAPI.app.app.graph.nodes.find(n => n.type === type);
    const show = () => Object.fromEntries(node.widgets.map(w => [w.name, node.isWidgetVisible(w)]));
    const hidden = show();
    node.toggleAdvanced();
    const shown = show();
    node.toggleAdvanced();
    return {
        values: Object.fromEntries(node.widgets.map(w => [w.name, w.value])),
        advanced: node.widgets.filter(w => w.advanced).map(w => w.name),
        hidden, shown, size: node.size,
    };
}"""


def load(page, server, workflow) -> dict:
    """Open `workflow` as a user would (`loadGraphData`) once the frontend has finished opening
    its own start-up workflow (which replaces a graph loaded before it is done)."""
    import demo_dataset

    demo_dataset.write_reference_image(server.base_dir / "input")  # the LoadImage's file
    present = "(type) => window.comfyAPI.app.app.graph.nodes.some(n => n.type === type)"
    for _ in range(5):
        page.evaluate("async (wf) => { await window.comfyAPI.app.app.loadGraphData(wf); }", workflow)
        page.wait_for_timeout(3000)
        if page.evaluate(present, TRAIN):
            break
    return page.evaluate(WIDGETS_JS, TRAIN)


# (saved before commit, the widgets it did not have yet)
SAVED_BEFORE = [
    (
        "before_2bc8e02",
        (
            "validate_every",
            "reference_dropout",
            "lr_floor",
            "start_from_lora",
            "save_precision",
        ),
    ),
    ("before_7255115", ("save_precision",)),
]


@pytest.mark.parametrize("version, newer", SAVED_BEFORE, ids=[v for v, _ in SAVED_BEFORE])
def test_a_workflow_saved_before_keeps_its_values_and_advanced_widgets_wait(
    comfy_page, server, version, newer
):
    spec = server.get_json("/object_info")[TRAIN]["input"]
    declared = {**spec["required"], **spec.get("optional", {})}
    advanced = sorted(name for name, (_, options, *_) in declared.items() if options.get("advanced"))
    assert "learning_rate" not in advanced and "optimizer" in advanced and "reference_dropout" in advanced
    comfy_page.forget_problems()
    node = load(comfy_page, server, json.loads((DATA / f"kontext_lora_training_{version}.json").read_text()))
    # every value the old version saved is back on its own widget (checked against the API
    # form of the same workflow, which names each input)
    old_inputs = next(
        n["inputs"]
        for n in json.loads((DATA / f"kontext_lora_training_{version}_api.json").read_text()).values()
        if n["class_type"] == TRAIN
    )
    for name, value in old_inputs.items():
        if not isinstance(value, list):  # links are not widgets
            assert node["values"][name] == value, name
    # widgets it did not have start at their defaults
    for name in newer:
        assert node["values"][name] == declared[name][1]["default"], name
    # the frontend's own grouping: advanced widgets hidden until "Show Advanced", then shown
    assert sorted(node["advanced"]) == advanced
    assert [n for n, visible in node["hidden"].items() if not visible] == [
        n for n in node["hidden"] if n in advanced
    ]
    assert all(node["shown"].values())
    assert not comfy_page.ui_problems()
