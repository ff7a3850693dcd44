"""The TrainLoRA progress panel in the real frontend (headless Debian Chromium): it follows a
run live (queued from the page, as a user does), restarts its chart for the next run, keeps a
step-labelled preview history, shows a run only in the workflow that queued it, survives a
page reload, its smoothing and long-run chart match the Python side, and it draws the held-out validation
curve from events and from the progress route."""

from __future__ import annotations

import json
import random
import re
from urllib.parse import parse_qs, urlparse

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.frontend import RUN_SHOWN, open_workflow, queue_from_page, reload
from kt_testing.graphs import training_graph
from kt_testing.paths import REPO_ROOT

ARTIFACTS = REPO_ROOT / ".cache" / "test-artifacts"

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


@pytest.fixture(scope="module")
def dataset(server):
    return write_one_folder(
        server.base_dir / "input" / "kt_panel_set", ["a", "b"], references=1, size=(64, 64)
    )


@pytest.fixture
def comfy_page(returning_users_page):
    """A page of its own for each test (TrainLoRA is tall: a window that shows its panel). Not
    one page for the module: a page keeps every run it has seen, and a run queued through the
    bare API before it (another module's, restored from the progress route when the page
    loaded) is shown on any workflow without runs of its own, which a second tab must not be
    here (seen in a full run with a shared page)."""
    return returning_users_page({"width": 1400, "height": 1900})


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
    """Record what the panel shows (run, status, chart points) from now on: after each progress
    event the page receives (the panel's own listener, registered first, has drawn it), and
    every 20 ms between them. A run of a few tiny steps can be "running" for less than the
    sampling gap when the renderer is busy (seen: a sampler alone recorded queued, finished)."""
    page.evaluate(
        """() => {
            window.ktSeen = [];
            window.ktRecord = () => {
                const run = window.KontextTrainer.runShown('5');
                const graph = window.comfyAPI.app.app.graph;
                const status = graph.getNodeById(5)?.ktTrainingPanel?.querySelector('.kt-status').textContent;
                const seen = {prompt: run?.promptId ?? null, status, points: run?.losses.length ?? 0,
                              step: run?.progress.step ?? 0};
                const last = window.ktSeen.at(-1);
                if (!last || JSON.stringify(last) !== JSON.stringify(seen)) window.ktSeen.push(seen);
            };
            window.comfyAPI.api.api.addEventListener('kontext_trainer.progress', window.ktRecord);
            window.ktRecorder = setInterval(window.ktRecord, 20);
        }"""
    )


def recorded(page) -> list[dict]:
    """What `record_panel` recorded; recording stops."""
    return page.evaluate(
        """() => { clearInterval(window.ktRecorder);
                   window.comfyAPI.api.api.removeEventListener('kontext_trainer.progress', window.ktRecord);
                   return window.ktSeen; }"""
    )


def prompt_inputs(entry) -> dict:
    """Each node's inputs in a /history entry's prompt (its third item)."""
    return {node: spec["inputs"] for node, spec in entry["prompt"][2].items()}


def in_order(values, expected):
    remaining = iter(values)
    return all(any(v == e for v in remaining) for e in expected)


def test_two_runs_in_a_row_restart_the_chart_and_keep_the_previews(comfy_page, server, dataset, to_ui_format):
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
    seen = recorded(comfy_page)
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

    # Run again with nothing changed (issue 64): ComfyUI answers from its cache and the panel
    # says so, keeping the last run's chart (on c1ab39f it showed the old run without a word).
    # The test nodes' seeds back as the last run had them, and fixed: the frontend "randomizes"
    # a widget named seed after each Run, where a user's loaders have none
    seeds = {node: inputs["seed"] for node, inputs in prompt_inputs(entry).items() if "seed" in inputs}
    comfy_page.evaluate(
        """(seeds) => {
            for (const node of window.comfyAPI.app.app.graph.nodes) for (const w of node.widgets ?? []) {
                if (w.name === 'control_after_generate') w.value = 'fixed';
                if (w.name === 'seed' && String(node.id) in seeds) w.value = seeds[String(node.id)];
            } }""",
        seeds,
    )
    comfy_page.evaluate("async () => { await window.comfyAPI.app.app.queuePrompt(0, 1); }")
    comfy_page.wait_for_function("() => window.KontextTrainer.runShown('5')?.cachedNote", timeout=60_000)
    panel = comfy_page.evaluate(PANEL, "5")
    assert (
        "nothing changed since the last run: the LoRA is models/loras/kt_panel_run.safetensors"
        in (panel["text"])
    ), panel["text"]
    assert comfy_page.evaluate("() => window.KontextTrainer.runShown('5')").get("promptId") == second
    assert "saved models/loras/kt_panel_run.safetensors" in panel["text"]  # the path as the user knows it
    assert not comfy_page.ui_problems()


def test_a_second_workflow_tab_shows_only_its_own_runs(comfy_page, server, dataset, to_ui_format):
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
    assert not comfy_page.ui_problems()


def python_smoothing(losses, beta=0.9):
    """The reference: ProgressTracker's bias-corrected EMA, written out independently."""
    ema, out = 0.0, []
    for k, x in enumerate(losses, start=1):
        ema = beta * ema + (1 - beta) * x
        out.append(ema / (1 - beta**k))
    return out


def test_smoothing_matches_python_and_a_million_steps_draw_fast(comfy_page, server, dataset, to_ui_format):
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
            const proto = CanvasRenderingContext2D.prototype, lineTo = proto.lineTo;
            let lines = 0;
            proto.lineTo = function (...args) { lines++; return lineTo.apply(this, args); };
            const started = performance.now();
            try {
                redraw();
            } finally {
                proto.lineTo = lineTo;
            }
            const ms = performance.now() - started;
            const pixels = [...document.querySelectorAll('.kt-training-panel canvas')]
                .reduce((sum, canvas) => sum + canvas.width, 0);
            return {ms, lines, pixels, points: run.losses.length};
        }""",
        workflow,
    )
    assert timing["points"] == 1_000_000
    assert "step 1,000,000 / 1,000,000" in comfy_page.evaluate(PANEL, "5")["text"]
    # The redraw took 34 to 69 ms on an idle machine, 144 to 242 ms beside another test run
    # (measured, 8 runs); drawing every point, without chartEnvelope's per-column envelope,
    # 330 and 473 ms idle, 2005 ms beside another run (measured with the chart's columns set to
    # the number of losses in a scratch copy). No time bound separates the two on a shared CPU,
    # so the time is reported and the mechanism asserted: the path has a few vertices per pixel
    # column of the panel's canvases (the envelope's top and bottom, the smoothed line: 2520
    # for 864 px, measured), where drawing every point has two per loss (2,000,000, measured
    # with the break above; the assertion fails).
    print(
        f"\nredraw of 1,000,000 losses: {timing['ms']:.0f} ms, {timing['lines']} lineTo calls, "
        f"{timing['pixels']} px of canvas"
    )
    assert 0 < timing["lines"] <= 4 * timing["pixels"], timing
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    comfy_page.locator(".kt-training-panel").first.screenshot(path=str(ARTIFACTS / "training_panel_long.png"))
    assert not comfy_page.ui_problems()


def test_panel_is_restored_after_a_reload_and_follows_in_a_second_tab(
    comfy_page, chromium, server, dataset, to_ui_format
):
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
    assert not comfy_page.ui_problems()


# The panel's chart (web/js/training_chart.js): padding in CSS pixels, drawn at 2 canvas pixels
# per CSS pixel; a validation point is a square of 2 x 2.5 CSS pixels in rgb(90, 215, 120).
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM, RESOLUTION, MARKER = 6, 6, 16, 14, 2, 2.5
VALIDATION_RGB = (90, 215, 120)
LEGEND_ROWS = int(RESOLUTION * (PAD_TOP - MARKER)) - 1  # canvas rows above the highest square

# Where the panel's canvas has the validation colour: exactly (the curve and its squares) and,
# in the legend's rows, nearly (antialiased text and its line).
VALIDATION_PIXELS = """([node, rgb, legendRows]) => {
    window.KontextTrainer.redraw();
    const graph = window.comfyAPI.app.app.graph;
    const canvas = (graph.getNodeById(Number(node)) ?? graph.getNodeById(node)).ktTrainingPanel
        .querySelector('canvas');
    const { data, width, height } = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height);
    const exact = [];
    let legend = 0;
    for (let i = 0; i < data.length; i += 4) {
        const x = (i / 4) % width, y = Math.floor(i / 4 / width);
        const d = [0, 1, 2].map((c) => Math.abs(data[i + c] - rgb[c]));
        if (d.every((v) => v === 0) && y >= legendRows) exact.push([x, y]);
        if (d.every((v) => v <= 40) && y < legendRows) legend++;
    }
    return { width, height, exact, legend };
}"""

LOSSES = [2.0, 1.6, 1.3, 1.1, 1.0, 0.9, 0.85, 0.8]  # steps 1..8 of the synthetic run


def run_state(step, validation, status="running"):
    """What the progress route serves for the synthetic run after `step` steps."""
    return {
        "node": "5",
        "prompt_id": "kt-validation-run",
        "workflow_id": None,  # queued through the API: shown on node 5 of any workflow
        "lora_name": "kt_panel_heldout.safetensors",
        "status": status,
        "step": step,
        "total": len(LOSSES),
        "loss": LOSSES[step - 1],
        "smoothed_loss": LOSSES[step - 1],
        "lr": 1e-4,
        "seconds_per_step": 0.5,
        "eta_seconds": 0.5 * (len(LOSSES) - step),
        "message": "",
        "previews": [],
        "validation_loss": validation[-1][1] if validation else None,
        "validation_step": validation[-1][0] if validation else None,
        "losses": LOSSES[:step],
        "validation": [list(point) for point in validation],
    }


def expected_squares(pixels, steps, points, low, high):
    """Canvas pixel of each point's centre, by the chart's geometry (computed here by hand)."""
    width, height = pixels["width"] / RESOLUTION, pixels["height"] / RESOLUTION
    plot_w, plot_h = width - PAD_LEFT - PAD_RIGHT, height - PAD_TOP - PAD_BOTTOM
    return [
        (
            RESOLUTION * (PAD_LEFT + (step - 1) / (steps - 1) * plot_w),
            RESOLUTION * (PAD_TOP + (1 - (loss - low) / (high - low)) * plot_h),
        )
        for step, loss in points
    ]


def assert_validation_drawn(pixels, steps, points, low, high):
    exact = {tuple(p) for p in pixels["exact"]}
    centres = expected_squares(pixels, steps, points, low, high)
    half = RESOLUTION * MARKER
    for x, y in centres:  # a square: its centre and all four corners (a line covers two at most)
        for dx, dy in [(0, 0), (-half + 1, -half + 1), (half - 1, -half + 1), (-half + 1, half - 1)]:
            assert (int(x + dx), int(y + dy)) in exact, ((x, y), (dx, dy), sorted(exact)[:20])
        assert (int(x + half - 1), int(y + half - 1)) in exact
    # nothing in that colour left of the first square or right of the last one
    columns = [x for x, _ in exact]
    assert abs(min(columns) - (centres[0][0] - half)) <= 1, (min(columns), centres[0])
    assert abs(max(columns) - (centres[-1][0] + half)) <= 1, (max(columns), centres[-1])
    assert pixels["legend"] > 0  # "validation" in the legend


def test_validation_curve_from_events_and_after_a_reload(comfy_page, server, dataset, to_ui_format):
    """Synthetic progress events (as TrainLoRA sends them, throttled: steps 2, 3 and the point
    after step 2 never come as events) and a progress route served by the test: the panel
    fetches the missing points, draws each at its step on the training loss's axes, and after
    a reload redraws them from the route alone."""
    served = {"state": run_state(1, [])}

    def progress_route(route):
        since = int(parse_qs(urlparse(route.request.url).query).get("since", ["0"])[0])
        state = dict(served["state"])
        since = min(since, len(state["losses"]))
        state.update(losses=state["losses"][since:], losses_from=since)
        route.fulfill(status=200, content_type="application/json", body=json.dumps(state))

    comfy_page.route(re.compile(r"/kontext_trainer/progress(\?|$)"), progress_route)
    graph = training_graph(dataset, "kt_panel_heldout", steps=len(LOSSES))
    open_workflow(comfy_page, to_ui_format, graph, "panel_heldout.json")
    run = "window.KontextTrainer.runs.get('kt-validation-run', '5')"

    def send(state):
        served["state"] = state
        event = {k: v for k, v in state.items() if k not in ("losses", "validation")}
        comfy_page.evaluate(
            "(event) => window.comfyAPI.api.api.dispatchCustomEvent('kontext_trainer.progress', event)", event
        )

    send(run_state(1, []))
    send(run_state(2, []))  # two points: a chart, no validation yet
    comfy_page.wait_for_function(f"() => {run}?.losses.length === 2")
    pixels = comfy_page.evaluate(VALIDATION_PIXELS, ["5", VALIDATION_RGB, LEGEND_ROWS])
    assert pixels["exact"] == [] and pixels["legend"] == 0
    assert "validation" not in comfy_page.evaluate(PANEL, "5")["text"]

    # step 4's event carries the point after step 4; the one after step 2 is only in the route
    send(run_state(4, [(2, 2.4), (4, 1.5)]))
    comfy_page.wait_for_function(f"() => {run}.validation.length === 2 && {run}.losses.length === 4")
    assert comfy_page.evaluate(f"() => {run}.validation") == [[2, 2.4], [4, 1.5]]
    pixels = comfy_page.evaluate(VALIDATION_PIXELS, ["5", VALIDATION_RGB, LEGEND_ROWS])
    # 4 steps; range [1.1, 2.4]: the point after step 2 (2.4, above every loss) on the top edge
    assert_validation_drawn(pixels, 4, [(2, 2.4), (4, 1.5)], 1.1, 2.4)
    assert "validation 1.5000" in comfy_page.evaluate(PANEL, "5")["text"]

    final = [(2, 2.4), (4, 1.5), (6, 1.2), (8, 0.7)]  # 0.7: below every loss, the bottom edge
    send(run_state(8, final, status="finished"))
    comfy_page.wait_for_function(f"() => {run}.validation.length === 4 && {run}.losses.length === 8")
    pixels = comfy_page.evaluate(VALIDATION_PIXELS, ["5", VALIDATION_RGB, LEGEND_ROWS])
    assert_validation_drawn(pixels, 8, final, 0.7, 2.4)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    comfy_page.locator(".kt-training-panel canvas").first.screenshot(
        path=str(ARTIFACTS / "training_panel_validation.png")
    )

    reload(comfy_page)  # the route (still the test's) is all the page has
    open_workflow(comfy_page, to_ui_format, graph, "panel_heldout_again.json")
    comfy_page.wait_for_function(f"() => {run}?.validation.length === 4 && {run}.losses.length === 8")
    assert comfy_page.evaluate(f"() => {run}.validation") == [list(p) for p in final]
    pixels = comfy_page.evaluate(VALIDATION_PIXELS, ["5", VALIDATION_RGB, LEGEND_ROWS])
    assert_validation_drawn(pixels, 8, final, 0.7, 2.4)
    assert "validation 0.7000" in comfy_page.evaluate(PANEL, "5")["text"]
    assert not comfy_page.ui_problems()
