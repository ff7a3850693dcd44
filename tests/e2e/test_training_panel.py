"""The TrainLoRA progress panel in the real frontend (headless Debian Chromium): it follows a
run live (queued from the page, as a user does), restarts its chart for the next run, keeps a
step-labelled preview history, shows a run only in the workflow that queued it, survives a
page reload, and its smoothing and long-run chart match the Python side."""

from __future__ import annotations

import json
import random
import uuid
from urllib.parse import urlparse

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.graphs import training_graph
from kt_testing.paths import REPO_ROOT

ARTIFACTS = REPO_ROOT / ".cache" / "test-artifacts"
REGISTRY_HOSTS = {"api.comfy.org"}  # asked for node-registry data and release notes
UNRESOLVED = "console error: Failed to load resource: net::ERR_NAME_NOT_RESOLVED"

RUN_SHOWN = """(node) => {
    const run = window.KontextTrainer?.runShown?.(node);
    return run ? {prompt: run.promptId, status: run.status, step: run.progress.step ?? 0,
                  points: run.losses.length, workflow: run.workflowId} : null;
}"""

PANEL = """(node) => {
    const graph = window.comfyAPI.app.app.graph;
    const element = (graph.getNodeById(Number(node)) ?? graph.getNodeById(node))?.ktTrainingPanel;
    if (!element) return null;
    return {
        status: element.querySelector('.kt-status').textContent,
        text: element.innerText,
        bar: element.querySelector('.kt-bar-fill').style.width,
        previews: [...element.querySelectorAll('.kt-preview figcaption')].map(c => c.textContent),
        images: [...element.querySelectorAll('.kt-preview img')].map(i => i.complete ? i.naturalWidth : -1),
    };
}"""

# Put a workflow on the canvas as a user opens a saved one: a UI-format workflow with its own id.
OPEN_WORKFLOW = """async ([workflow, name]) => {
    await window.comfyAPI.app.app.loadGraphData(workflow, true, true, name);
}"""

TO_UI_FORMAT = """async (graph) => {
    const app = window.comfyAPI.app.app;
    app.loadApiJson(graph, 'converted.json');
    for (let i = 0; i < 200 && !app.graph.getNodeById(5)?.ktTrainingPanel; i++) {
        await new Promise((resolve) => setTimeout(resolve, 50));
    }
    return JSON.stringify(app.graph.serialize()); // as the frontend saves: no undefined keys
}"""


@pytest.fixture(scope="module")
def dataset(server):
    return write_one_folder(
        server.base_dir / "input" / "kt_panel_set", ["a", "b"], references=1, size=(64, 64)
    )


@pytest.fixture(scope="module")
def to_ui_format(chromium, server):
    """API graph -> the frontend's own workflow format, converted by the frontend in a page of
    its own (loading an API graph opens a tab for it, and that graph has the zero uuid)."""
    page = chromium.new_page()
    page.goto(server.url)
    page.wait_for_function(
        "() => !!window.LiteGraph?.registered_node_types?.['KontextTrainer_TrainLoRA']", timeout=60_000
    )
    yield lambda graph: json.loads(page.evaluate(TO_UI_FORMAT, graph))
    page.close()


def prepare(page, server):
    page.set_viewport_size({"width": 1400, "height": 1900})  # TrainLoRA is tall: show its panel
    server.post_json("/settings/Comfy.TutorialCompleted", True)  # no template browser on top
    page.unresolved_hosts = set()
    page.on(
        "requestfailed",
        lambda request: (
            page.unresolved_hosts.add(urlparse(request.url).hostname)
            if "ERR_NAME_NOT_RESOLVED" in (request.failure or "")
            else None
        ),
    )
    reload(page)


def reload(page):
    """Reload the page, as a user presses F5. What happens while it starts is the fixture's
    business (ComfyUI's own 404s for user.css and user data that does not exist yet): the
    problems are watched from then on."""
    page.reload()
    page.wait_for_function(
        "() => window.comfyAPI?.app?.app?.extensions?.some(e => e.name === 'KontextTrainer.TrainingPanel')"
        " && !!window.LiteGraph?.registered_node_types?.['KTTest_TinyCLIP']",
        timeout=60_000,
    )
    page.wait_for_timeout(1500)  # start-up requests (settings, user data, release notes) end
    page.page_errors.clear()


def problems(page) -> list[str]:
    """`ui_problems()`, less the console errors of the frontend's registry look-ups, which an
    offline machine cannot resolve (only while every unresolved request went to such a host)."""
    found = page.ui_problems()
    if page.unresolved_hosts <= REGISTRY_HOSTS:
        found = [p for p in found if p != UNRESOLVED]
    return found


def open_workflow(page, to_ui_format, graph, name) -> str:
    """Open `graph` in a new workflow tab with a fresh id; returns the id. The frontend restores
    its start-up workflow asynchronously, which can replace a graph opened too early: open it
    until it stays."""
    workflow = {**to_ui_format(graph), "id": str(uuid.uuid4())}
    for _ in range(10):
        page.evaluate(OPEN_WORKFLOW, [workflow, name])
        page.wait_for_timeout(500)
        shown = page.evaluate(
            "() => { const graph = window.comfyAPI.app.app.graph;"
            " return [graph.id, !!graph.getNodeById(5)?.ktTrainingPanel]; }"
        )
        if shown == [workflow["id"], True]:
            return workflow["id"]
    raise AssertionError("the workflow did not stay on the canvas")


def queue_from_page(page) -> str:
    """Press Queue (the frontend sends the workflow, with its id); returns the run's prompt id."""
    before = (page.evaluate(RUN_SHOWN, "5") or {}).get("prompt")
    page.evaluate("async () => { await window.comfyAPI.app.app.queuePrompt(0, 1); }")
    page.wait_for_function(
        "(before) => (window.KontextTrainer.runShown('5')?.promptId ?? before) !== before",
        arg=before,
        timeout=60_000,
    )
    return page.evaluate(RUN_SHOWN, "5")["prompt"]


def wait_until_finished(page, server, prompt_id, steps):
    entry = server.history(prompt_id, timeout=300)
    assert entry["status"]["status_str"] == "success", entry["status"]
    page.wait_for_function(
        f"""() => {{ const run = window.KontextTrainer.runShown('5');
                    return run?.promptId === '{prompt_id}' && run.status === 'finished'
                        && run.losses.length === {steps}; }}""",
        timeout=60_000,
    )
    return entry


def record_panel(page):
    """Record what the panel shows (run, status, chart points) every 20 ms, from now on."""
    page.evaluate(
        """() => {
            window.ktSeen = [];
            window.ktRecorder = setInterval(() => {
                const run = window.KontextTrainer.runShown('5');
                const graph = window.comfyAPI.app.app.graph;
                const status = graph.getNodeById(5)?.ktTrainingPanel?.querySelector('.kt-status').textContent;
                const seen = {prompt: run?.promptId ?? null, status, points: run?.losses.length ?? 0,
                              step: run?.progress.step ?? 0};
                const last = window.ktSeen.at(-1);
                if (!last || JSON.stringify(last) !== JSON.stringify(seen)) window.ktSeen.push(seen);
            }, 20);
        }"""
    )


def in_order(values, expected):
    remaining = iter(values)
    return all(any(v == e for v in remaining) for e in expected)


def test_two_runs_in_a_row_restart_the_chart_and_keep_the_previews(comfy_page, server, dataset, to_ui_format):
    prepare(comfy_page, server)
    graph = training_graph(dataset, "kt_panel_run", steps=8, preview_every=4, overwrite=True)
    open_workflow(comfy_page, to_ui_format, graph, "panel_runs.json")

    first = queue_from_page(comfy_page)
    wait_until_finished(comfy_page, server, first, 8)
    panel = comfy_page.evaluate(PANEL, "5")
    assert panel["previews"] == ["step 8", "step 4"]  # both preview rounds, newest first

    # the second run: 6 steps (the user changes the widget), same name (overwrite is on)
    comfy_page.evaluate(
        "() => { const node = window.comfyAPI.app.app.graph.getNodeById(5);"
        " node.widgets.find(w => w.name === 'steps').value = 6; }"
    )
    record_panel(comfy_page)
    second = queue_from_page(comfy_page)
    entry = wait_until_finished(comfy_page, server, second, 6)
    seen = comfy_page.evaluate("() => { clearInterval(window.ktRecorder); return window.ktSeen; }")
    mine = [s for s in seen if s["prompt"] == second]
    statuses = [s["status"] for s in mine]
    assert statuses[0] == "queued", seen  # as soon as it is queued, not the last run's "finished"
    assert in_order(statuses, ["queued", "running", "finished"]), statuses
    assert "finished" not in statuses[: statuses.index("running")]
    # the chart restarted: never more points than this run's steps, never the first run's curve
    assert all(s["points"] <= 6 for s in mine), mine  # (a fetch may run ahead of the last event)
    losses = comfy_page.evaluate("() => window.KontextTrainer.runShown('5').losses")
    assert losses == pytest.approx(entry["outputs"]["5"]["loss"], rel=1e-6)  # every step, in order

    comfy_page.wait_for_function(
        "() => [...document.querySelectorAll('.kt-preview img')]"
        ".every(i => i.complete && i.naturalWidth === 64)",
        timeout=30_000,
    )
    panel = comfy_page.evaluate(PANEL, "5")
    assert panel["previews"] == ["step 6", "step 4"] and panel["images"] == [64, 64]
    assert panel["status"] == "finished" and panel["bar"] == "100%"
    assert "step 6 / 6" in panel["text"] and "kt_panel_run.safetensors" in panel["text"]
    route = server.get_json("/kontext_trainer/progress?since=4")
    assert route["prompt_id"] == second and route["losses_from"] == 4
    assert route["losses"] == pytest.approx(losses[4:], rel=1e-9)
    image = server.get(
        f"/view?filename={route['previews'][0]['filename']}&subfolder=kontext_trainer_previews&type=temp"
    )
    assert image[:8] == b"\x89PNG\r\n\x1a\n"

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    comfy_page.evaluate(
        "() => window.comfyAPI.app.app.extensionManager.command.execute('Comfy.Canvas.FitView')"
    )
    comfy_page.wait_for_timeout(500)
    comfy_page.screenshot(path=str(ARTIFACTS / "training_panel.png"))
    comfy_page.evaluate(  # the node at 100 % for a close-up of its panel
        """() => { const canvas = window.comfyAPI.app.app.canvas;
                   canvas.ds.scale = 1;
                   canvas.centerOnNode(canvas.graph.getNodeById(5));
                   canvas.setDirty(true, true); }"""
    )
    comfy_page.wait_for_timeout(500)
    widget = comfy_page.locator(".kt-training-panel").first
    widget.screenshot(path=str(ARTIFACTS / "training_panel_widget.png"))
    # a click opens a preview large; Escape closes it
    comfy_page.locator(".kt-preview").first.click()
    comfy_page.locator(".kt-preview-large img").wait_for(state="visible", timeout=10_000)
    assert "step 6" in comfy_page.locator(".kt-preview-large").inner_text()
    comfy_page.screenshot(path=str(ARTIFACTS / "training_panel_preview_large.png"))
    comfy_page.keyboard.press("Escape")
    comfy_page.locator(".kt-preview-large").wait_for(state="detached", timeout=10_000)
    assert not problems(comfy_page)


def test_a_second_workflow_tab_shows_only_its_own_runs(comfy_page, server, dataset, to_ui_format):
    prepare(comfy_page, server)
    graph_a = training_graph(dataset, "kt_panel_tab_a", steps=4, overwrite=True)
    workflow_a = open_workflow(comfy_page, to_ui_format, graph_a, "panel_a.json")
    prompt_a = queue_from_page(comfy_page)
    wait_until_finished(comfy_page, server, prompt_a, 4)
    assert comfy_page.evaluate(RUN_SHOWN, "5")["workflow"] == workflow_a  # the id the page sent

    # a new tab with a TrainLoRA of the same node id that never ran
    comfy_page.evaluate(
        "() => window.comfyAPI.app.app.extensionManager.command.execute('Comfy.NewBlankWorkflow')"
    )
    graph_b = training_graph(dataset, "kt_panel_tab_b", steps=4)
    open_workflow(comfy_page, to_ui_format, graph_b, "panel_b.json")
    idle = comfy_page.evaluate(PANEL, "5")
    assert comfy_page.evaluate(RUN_SHOWN, "5") is None
    assert idle["status"] == "idle" and float(idle["bar"].rstrip("%")) == 0 and not idle["previews"], idle
    assert "kt_panel_tab_a" not in idle["text"] and "step" not in idle["text"].replace("steps", "")

    comfy_page.locator(".workflow-tab", has_text="panel_a").click()  # back to the first tab
    comfy_page.wait_for_function(
        f"() => window.comfyAPI.app.app.graph.id === '{workflow_a}'"
        " && window.comfyAPI.app.app.graph.getNodeById(5)?.ktTrainingPanel?.querySelector('.kt-status')"
        ".textContent === 'finished'",
        timeout=30_000,
    )
    shown = comfy_page.evaluate(PANEL, "5")
    assert "kt_panel_tab_a.safetensors" in shown["text"] and "step 4 / 4" in shown["text"]
    assert comfy_page.evaluate(RUN_SHOWN, "5")["prompt"] == prompt_a

    comfy_page.locator(".workflow-tab", has_text="panel_b").click()  # and forth: idle again
    comfy_page.wait_for_function(
        "() => window.comfyAPI.app.app.graph.getNodeById(5)?.ktTrainingPanel?.querySelector('.kt-status')"
        ".textContent === 'idle'",
        timeout=30_000,
    )
    assert not problems(comfy_page)


def python_smoothing(losses, beta=0.9):
    """The reference: ProgressTracker's bias-corrected EMA, written out independently."""
    ema, out = 0.0, []
    for k, x in enumerate(losses, start=1):
        ema = beta * ema + (1 - beta) * x
        out.append(ema / (1 - beta**k))
    return out


def test_smoothing_matches_python_and_a_million_steps_draw_fast(comfy_page, server, dataset, to_ui_format):
    prepare(comfy_page, server)
    rng = random.Random(7)
    series = [rng.uniform(0.05, 2.0) for _ in range(300)]
    smoothed = comfy_page.evaluate("(xs) => Array.from(window.KontextTrainer.smoothLosses(xs))", series)
    assert smoothed == pytest.approx(python_smoothing(series), rel=1e-12)
    assert smoothed[0] == pytest.approx(series[0], rel=1e-12)  # bias-corrected: no pull to 0

    # 10 steps over 4 columns: steps [0, 2), [2, 5), [5, 7), [7, 10) (floor(c * 10 / 4))
    values = [5, 1, 2, 9, 3, 4, 0, 6, 8, 7]
    envelope = comfy_page.evaluate(
        """(xs) => { const e = window.KontextTrainer.chartEnvelope(xs, xs, 4);
                     return {low: Array.from(e.low), high: Array.from(e.high), smooth: Array.from(e.smooth),
                             at: Array.from(e.at)}; }""",
        values,
    )
    assert envelope["low"] == [1, 2, 0, 6] and envelope["high"] == [5, 9, 4, 8]
    assert envelope["smooth"] == [1, 3, 0, 7]  # the value at each column's last step
    assert envelope["at"] == pytest.approx([1 / 9, 4 / 9, 6 / 9, 1])

    # a million steps on a real panel: no stack overflow, drawn in well under a second or two
    workflow = open_workflow(
        comfy_page, to_ui_format, training_graph(dataset, "kt_panel_long", steps=1_000_000), "long.json"
    )
    timing = comfy_page.evaluate(
        """(workflow) => {
            const { runs, redraw, smoothLosses } = window.KontextTrainer;
            const losses = new Array(1_000_000);
            let seed = 1;
            for (let i = 0; i < losses.length; i++) {
                seed = (seed * 16807) % 2147483647;
                losses[i] = 0.2 + 1.5 * Math.exp(-i / 150_000) + 0.3 * (seed / 2147483647);
            }
            const run = runs.applyProgress({node: '5', prompt_id: 'long-run', workflow_id: workflow,
                lora_name: 'kt_panel_long.safetensors', status: 'running', step: 1_000_000, total: 1_000_000,
                loss: losses.at(-1), smoothed_loss: smoothLosses(losses).at(-1), lr: 1e-4,
                seconds_per_step: 0.5, eta_seconds: 0, message: '', previews: []});
            runs.setLosses(run, 0, losses);
            const started = performance.now();
            redraw();
            return {ms: performance.now() - started, points: run.losses.length};
        }""",
        workflow,
    )
    assert timing["points"] == 1_000_000
    assert "step 1,000,000 / 1,000,000" in comfy_page.evaluate(PANEL, "5")["text"]
    assert timing["ms"] < 2_000, timing
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    comfy_page.locator(".kt-training-panel").first.screenshot(path=str(ARTIFACTS / "training_panel_long.png"))
    assert not problems(comfy_page)


def test_panel_is_restored_after_a_reload_and_follows_in_a_second_tab(
    comfy_page, chromium, server, dataset, to_ui_format
):
    prepare(comfy_page, server)
    graph = training_graph(dataset, "kt_panel_reload", steps=100_000)
    open_workflow(comfy_page, to_ui_format, graph, "panel_reload.json")
    # queued through the bare HTTP API (no workflow): shown on node 5 of a workflow without runs
    queued = server.post_json("/prompt", {"prompt": graph})
    prompt_id = queued["prompt_id"]
    run = f"window.KontextTrainer?.runs?.get('{prompt_id}', '5')"
    try:
        comfy_page.wait_for_function(f"() => ({run}?.progress.step ?? 0) >= 3", timeout=120_000)
        assert comfy_page.evaluate(RUN_SHOWN, "5")["prompt"] == prompt_id
        assert comfy_page.evaluate(PANEL, "5")["status"] == "running"
        reload(comfy_page)
        # restored from the route, then every step filled in between the throttled events
        comfy_page.wait_for_function(
            f"() => {run}?.losses.length >= 3 && {run}.losses.length >= {run}.progress.step", timeout=60_000
        )
        route = server.get_json("/kontext_trainer/progress")
        assert route["lora_name"] == "kt_panel_reload.safetensors" and route["status"] == "running"
        assert len(route["losses"]) >= 3 and route["node"] == "5" and route["workflow_id"] is None
        # a second tab, opened mid-run, follows the same run live (events go to every client)
        second = chromium.new_page()
        try:
            second.goto(server.url)
            second.wait_for_function(f"() => ({run}?.progress.step ?? 0) > 0", timeout=60_000)
            seen = second.evaluate(f"() => {run}.progress.step")
            second.wait_for_function(f"() => {run}.progress.step > {seen}", timeout=60_000)
        finally:
            second.close()
    finally:
        server.post_json("/interrupt", {})
        server.history(prompt_id, timeout=120)
    comfy_page.wait_for_function(f"() => {run}?.status === 'cancelled'", timeout=60_000)
    route = server.get_json("/kontext_trainer/progress")
    comfy_page.wait_for_function(f"() => {run}.losses.length === {len(route['losses'])}", timeout=30_000)
    assert comfy_page.evaluate(f"() => {run}.losses") == pytest.approx(route["losses"], rel=1e-9)
    assert not problems(comfy_page)
