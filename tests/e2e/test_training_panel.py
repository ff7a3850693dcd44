"""The TrainLoRA progress panel in the real frontend (headless Debian Chromium): it follows a
run live, draws its loss chart, and comes back after a page reload from the progress route."""

from __future__ import annotations

import json

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.graphs import training_graph
from kt_testing.paths import REPO_ROOT

ARTIFACTS = REPO_ROOT / ".cache" / "test-artifacts"


@pytest.fixture(scope="module")
def dataset(server):
    return write_one_folder(
        server.base_dir / "input" / "kt_panel_set", ["a", "b"], references=1, size=(64, 64)
    )


def show_graph(page, graph):
    """Put the API graph on the canvas (node ids kept), as if the user had opened it. The
    frontend restores its start-up workflow asynchronously, which can replace a graph loaded
    too early: load until the TrainLoRA node stays."""
    load = "async (graph) => { await window.comfyAPI.app.app.loadApiJson(graph, 'panel.json'); }"
    for _ in range(10):
        page.evaluate(load, graph)
        page.wait_for_timeout(500)
        if page.evaluate("() => !!window.comfyAPI.app.app.graph.getNodeById(5)?.ktTrainingPanel"):
            return
    raise AssertionError("the graph did not stay on the canvas")


def panel_state(page, node="5"):
    return page.evaluate(
        """(node) => {
            const state = window.KontextTrainer?.panels?.[node];
            const graph = window.comfyAPI.app.app.graph;
            const element = (graph.getNodeById(Number(node)) ?? graph.getNodeById(node))?.ktTrainingPanel;
            return {
                status: state?.progress?.status ?? null,
                step: state?.progress?.step ?? 0,
                points: state?.losses?.length ?? 0,
                text: element?.innerText ?? "",
                bar: element?.querySelector('.kt-bar-fill')?.style.width ?? "",
            };
        }""",
        node,
    )


def test_panel_follows_a_run_and_draws_the_chart(comfy_page, server, dataset):
    graph = training_graph(dataset, "kt_panel_run", steps=8, preview_every=4)
    comfy_page.set_viewport_size({"width": 1400, "height": 1900})  # TrainLoRA is tall: show its panel
    # no first-run template browser over the canvas (for the screenshot)
    server.post_json("/settings/Comfy.TutorialCompleted", True)
    comfy_page.reload()
    comfy_page.wait_for_function(
        "() => !!window.LiteGraph?.registered_node_types?.['KTTest_TinyCLIP']", timeout=60_000
    )
    show_graph(comfy_page, graph)
    # (a node with this id may still show an earlier run: the route restores the last job)
    prompt_id, messages = server.run_prompt(graph)
    assert messages[-1]["type"] == "execution_success"
    comfy_page.wait_for_function(
        "() => window.KontextTrainer?.panels?.['5']?.progress?.status === 'finished'"
        " && window.KontextTrainer.panels['5'].losses.length === 8",
        timeout=60_000,
    )
    state = panel_state(comfy_page)
    assert state["points"] == 8  # live points, completed from the route when the run ended
    assert "kt_panel_run.safetensors" in state["text"]  # this run's result, not an earlier one
    # PreviewSampler's images (sampled at step 4 and at the end) are on the node and served
    comfy_page.wait_for_function(
        "() => [...document.querySelectorAll('.kt-previews img')]"
        ".some(i => i.complete && i.naturalWidth === 64)",
        timeout=30_000,
    )
    route = server.get_json("/kontext_trainer/progress")
    assert [p["step"] for p in route["previews"]] == [8]
    image = server.get(
        f"/view?filename={route['previews'][0]['filename']}&subfolder=kontext_trainer_previews&type=temp"
    )
    assert image[:8] == b"\x89PNG\r\n\x1a\n"
    outputs = server.history(prompt_id)["outputs"]["5"]
    assert outputs["lora_name"] == ["kt_panel_run.safetensors"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    comfy_page.evaluate(
        "() => window.comfyAPI.app.app.extensionManager.command.execute('Comfy.Canvas.FitView')"
    )
    comfy_page.wait_for_timeout(500)
    comfy_page.screenshot(path=str(ARTIFACTS / "training_panel.png"))
    panel = comfy_page.locator(".kt-training-panel").first
    if panel.is_visible():
        panel.screenshot(path=str(ARTIFACTS / "training_panel_widget.png"))
    assert state["bar"] == "100%" and "step 8 / 8" in state["text"] and "finished" in state["text"]
    assert not comfy_page.page_errors, comfy_page.page_errors
    assert prompt_id


def test_panel_is_restored_after_a_reload_and_follows_in_a_second_tab(comfy_page, chromium, server, dataset):
    graph = training_graph(dataset, "kt_panel_reload", steps=100_000)
    show_graph(comfy_page, graph)
    queued = server.post_json("/prompt", {"prompt": graph})
    try:
        comfy_page.wait_for_function(
            "() => (window.KontextTrainer?.panels?.['5']?.progress?.step ?? 0) >= 3", timeout=120_000
        )
        comfy_page.reload()
        comfy_page.wait_for_function(
            "() => window.comfyAPI?.app?.app?.extensions"
            "?.some(e => e.name === 'KontextTrainer.TrainingPanel')",
            timeout=60_000,
        )
        comfy_page.wait_for_function(
            "() => (window.KontextTrainer?.panels?.['5']?.losses?.length ?? 0) >= 3", timeout=60_000
        )
        route = server.get_json("/kontext_trainer/progress")
        assert route["lora_name"] == "kt_panel_reload.safetensors" and route["status"] == "running"
        assert len(route["losses"]) >= 3 and route["node"] == "5"
        restored = panel_state(comfy_page)
        assert restored["points"] >= 3
        # a second tab, opened mid-run, follows the same run live (events go to every client)
        second = chromium.new_page()
        try:
            second.goto(server.url)
            second.wait_for_function(
                "() => (window.KontextTrainer?.panels?.['5']?.progress?.step ?? 0) > 0", timeout=60_000
            )
            seen = second.evaluate("() => window.KontextTrainer.panels['5'].progress.step")
            second.wait_for_function(
                f"() => window.KontextTrainer.panels['5'].progress.step > {seen}", timeout=60_000
            )
        finally:
            second.close()
    finally:
        server.post_json("/interrupt", {})
        server.history(queued["prompt_id"], timeout=120)
    assert json.dumps(server.get_json("/kontext_trainer/progress"))  # still answers after the run
