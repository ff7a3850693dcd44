"""JS snippets the browser tests evaluate in the ComfyUI frontend (1.32 with ComfyUI 0.3.75,
1.49 with 0.33), and the steps they take there as a user does: reload the page, open a workflow,
press Queue."""

from __future__ import annotations

import json
import uuid

TRAIN_LORA = "KontextTrainer_TrainLoRA"


def extension_registered(name: str, and_also: str = "true") -> str:
    """JS: has the frontend registered extension `name` (and is the expression `and_also` true)?
    (Frontend 1.49's `app.extensions` reads a store that throws until the app has mounted;
    1.32's is a plain list.)"""
    return (
        "() => { try { return !!window.comfyAPI?.app?.app?.extensions"
        f"?.some(e => e.name === '{name}') && ({and_also}) }} catch {{ return false }} }}"
    )


RUN_SHOWN = """(node) => {
    const run = window.KontextTrainer?.runShown?.(node);
    return run ? {prompt: run.promptId, status: run.status, step: run.progress.step ?? 0,
                  points: run.losses.length, workflow: run.workflowId, message: run.progress.message ?? ''}
               : null;
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


TUTORIAL = "Comfy.TutorialCompleted"  # unset on a first start: the frontend then opens its templates
FRONTEND_VERSION_JS = "() => window.__COMFYUI_FRONTEND_VERSION__ ?? ''"
# On a first start 1.32.9 (ComfyUI 0.3.75) opens its template browser about a second after the
# node types register; offline, its thumbnail placeholders animate for as long as it is open:
# Chromium at 1.0-1.2 cores while the page waits, 0.17 once it is closed (measured from /proc on
# one page, 8 s each; 1.49.6: 0.10-0.17 either way, so its first-start pages are left as they are).
FIRST_START_BROWSER_ANIMATES = "1.32."


def is_first_start(server) -> bool:
    """Whether the next page the server serves is a first start (asked before it loads: the
    frontend marks the tutorial done as it opens the template browser)."""
    return not server.get_json("/settings").get(TUTORIAL)


def close_first_start_templates(page, first_start: bool) -> None:
    """On a first start (`is_first_start` before the page loaded) with frontend 1.32, close the
    template browser it opened, with its close button, as a user does."""
    if not first_start or not page.evaluate(FRONTEND_VERSION_JS).startswith(FIRST_START_BROWSER_ANIMATES):
        return
    dialog = page.locator(".p-dialog").filter(has=page.locator('[data-testid^="template-workflow-"]'))
    try:
        dialog.wait_for(state="visible", timeout=20_000)
    except Exception as error:
        raise AssertionError("a first start on frontend 1.32 did not open the template browser") from error
    dialog.locator("button:has(i.pi-times)").click()
    dialog.wait_for(state="detached", timeout=10_000)


def ui_format_converter(chromium, server):
    """API graph -> the frontend's own workflow format, converted by the frontend in a page of
    its own (loading an API graph opens a tab for it, and that graph has the zero uuid). Returns
    the converter and the page to close."""
    first_start = is_first_start(server)
    page = chromium.new_page()
    page.goto(server.url)
    page.wait_for_function(
        f"() => !!window.LiteGraph?.registered_node_types?.['{TRAIN_LORA}']", timeout=60_000
    )
    close_first_start_templates(page, first_start)
    return (lambda graph: json.loads(page.evaluate(TO_UI_FORMAT, graph))), page


def blank_canvas(page) -> None:
    """A new blank workflow on the canvas (Workflow -> New), as a user starts one."""
    page.evaluate("() => window.comfyAPI.app.app.extensionManager.command.execute('Comfy.NewBlankWorkflow')")
    page.wait_for_function("() => window.comfyAPI.app.app.graph.nodes.length === 0", timeout=30_000)


def reload(page):
    """Reload the page, as a user presses F5. What happens while it starts is the fixture's
    business (ComfyUI's own 404s for user.css and user data that does not exist yet): the
    problems are watched from then on."""
    page.reload()
    page.wait_for_function(
        extension_registered(
            "KontextTrainer.TrainingPanel", "!!window.LiteGraph?.registered_node_types?.['KTTest_TinyCLIP']"
        ),
        timeout=60_000,
    )
    page.forget_problems()  # after the start-up requests (settings, user data, release notes)


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


def queue_from_page(page, node: str = "5") -> str:
    """Press Queue (the frontend sends the workflow, with its id); returns the run's prompt id."""
    before = (page.evaluate(RUN_SHOWN, node) or {}).get("prompt")
    page.evaluate("async () => { await window.comfyAPI.app.app.queuePrompt(0, 1); }")
    page.wait_for_function(
        "([node, before]) => (window.KontextTrainer.runShown(node)?.promptId ?? before) !== before",
        arg=[node, before],
        timeout=60_000,
    )
    return page.evaluate(RUN_SHOWN, node)["prompt"]
