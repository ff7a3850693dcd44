"""TrainLoRA's widgets in the real frontend: the essentials show, the rest wait behind the
node's own "Show Advanced", and workflows saved before widgets were added (before 2bc8e02: the
widgets added after `overwrite`; before 7255115: `save_precision`; CHANGELOG.md) load with every
value where it was; hovering a setting's label shows that setting's tooltip (issue 45 item 2).
The tests share one page (a returning user's: no Templates dialog on top), each opening its
workflow over the last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
EXAMPLE = Path(__file__).parents[2] / "example_workflows" / "kontext_lora_training.json"
TRAIN = "KontextTrainer_TrainLoRA"
VIEWPORT = {"width": 1920, "height": 1080}

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


@pytest.fixture(scope="module", autouse=True)
def model_files(server):
    """The examples' model files (empty stand-ins) in the server's models/: the pages here open
    the shipped example as a user who has the files (1.32.9 shows a Missing Models dialog
    otherwise, over the labels these tests hover)."""
    from kt_testing.examples import write_model_stand_ins

    write_model_stand_ins(server.base_dir)


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
    module_returning_users_page, server, version, newer
):
    comfy_page = module_returning_users_page(VIEWPORT)
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


# Where the frontend's tooltip looks when the pointer rests on a node (its `onIdle`: an input
# slot under the pointer first, `isOverNodeInput`, which `node.getInputOnPos` runs; then the
# widget): along each shown row's label, from the node's left edge, hidden and shown advanced.
LABEL_HITS_JS = """(type) => {
    const canvas = window.comfyAPI.app.app.canvas;
    const node = canvas.graph.nodes.find(n => n.type === type);
    const half = window.LiteGraph.NODE_WIDGET_HEIGHT / 2;
    canvas.ds.scale = 1;
    canvas.ds.offset = [40 - node.pos[0], 60 - node.pos[1]];
    const check = () => {
        canvas.draw(true, true); // lays the node out, slots included, as each frame does
        const wrong = [];
        for (const w of node.widgets) {
            if (!node.isWidgetVisible(w)) continue;
            for (const dx of [2, 10, 30, 60]) {
                const input = node.getInputOnPos([node.pos[0] + dx, node.pos[1] + w.y + half]);
                if (input && input.name !== w.name) wrong.push(`${w.name} at +${dx} px: ${input.name}`);
            }
        }
        return wrong;
    };
    const hidden = check();
    node.toggleAdvanced();
    const shown = check();
    node.toggleAdvanced();
    canvas.draw(true, true);
    return {hidden, shown, rows: node.widgets.filter(w => node.isWidgetVisible(w)).length};
}"""
# the page point of the `name` row's label, the view moved so that the node is on screen at 100 %
LABEL_POINT_JS = """([type, name]) => {
    const app = window.comfyAPI.app.app;
    const node = app.graph.nodes.find(n => n.type === type);
    const canvas = app.canvas;
    canvas.ds.scale = 1;
    canvas.ds.offset = [40 - node.pos[0], 60 - node.pos[1]];
    canvas.draw(true, true);
    const w = node.widgets.find(w => w.name === name);
    const [x, y] = canvas.ds.convertOffsetToCanvas([node.pos[0] + 30, node.pos[1] + w.y + 10]);
    const box = canvas.canvas.getBoundingClientRect();
    return [box.left + x, box.top + y];
}"""


def test_each_labels_tooltip_is_its_own_settings(module_returning_users_page, server):
    """Issue 45 item 2: with the advanced settings hidden, the label of `rank` showed "Micro-batches
    per optimizer step." (gradient_accumulation's), fp8_mode the timestep sampler's, and
    start_from_lora reference_dropout's: the hidden widgets' input slots still sat on those rows.
    Every shown row's label, across its width, finds no other setting's slot, hidden and shown;
    and the tooltip the frontend shows for `rank`'s label is rank's own."""
    module_page = module_returning_users_page(VIEWPORT)
    load(module_page, server, json.loads(EXAMPLE.read_text()))
    hits = module_page.evaluate(LABEL_HITS_JS, TRAIN)
    assert hits["rows"] >= 10 and hits["hidden"] == [] and hits["shown"] == [], hits
    tooltips = {
        name: spec[1].get("tooltip", "")
        for section in server.get_json("/object_info")[TRAIN]["input"].values()
        for name, spec in section.items()
        if len(spec) > 1
    }
    x, y = module_page.evaluate(LABEL_POINT_JS, [TRAIN, "rank"])
    module_page.mouse.move(x - 5, y)
    module_page.mouse.move(x, y)
    tooltip = module_page.wait_for_selector(".node-tooltip", state="visible", timeout=10_000)
    assert tooltip.inner_text().strip() == tooltips["rank"].strip()
    module_page.mouse.move(0, 0)
    assert not module_page.ui_problems()
