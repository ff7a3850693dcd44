"""Each node's help page in the real frontend (1.32 with ComfyUI 0.3.75, 1.49 with 0.33), opened
as a user opens it: select the node on the canvas, press the selection toolbox's Info button.
1.32.9 shows the page in the node library's side panel, 1.49.6 in the right side panel's Info
tab. Both fetch `/extensions/<pack folder>/docs/<node id>/<locale>.md`, then
`/extensions/<pack folder>/docs/<node id>.md` (the pack ships the second: it serves every
locale), and show the node's description when neither answers (issue 64: they did)."""

from __future__ import annotations

import re

import pytest

from kt_testing.frontend import blank_canvas
from kt_testing.paths import PACK_DIR_NAME, REPO_ROOT

NODES = [
    "KontextTrainer_LoadKontextDataset",
    "KontextTrainer_MultiImageConditioning",
    "KontextTrainer_TrainLoRA",
    "KontextTrainer_PreviewSampler",
]
WINDOW = {"width": 1920, "height": 937}
LOCALE = "en"  # the frontends' locale in headless Chromium
NOT_FOUND = "console error: Failed to load resource: the server responded with a status of 404 (Not Found)"

# Put a node on the canvas at 100 %, its title at `at` on screen (below the menus and the
# frontend's banners, room for the toolbox above it), and select it as a click on it does: the
# selection toolbox shows above it.
ADD_AND_SELECT = """([type, at]) => {
    const app = window.comfyAPI.app.app;
    const node = LiteGraph.createNode(type);
    app.graph.add(node);
    const canvas = app.canvas;
    const rect = canvas.canvas.getBoundingClientRect();
    canvas.ds.scale = 1;
    canvas.ds.offset = [at[0] - rect.left - node.pos[0],
                        at[1] - rect.top + LiteGraph.NODE_TITLE_HEIGHT - node.pos[1]];
    canvas.selectNode(node);
    canvas.setDirty(true, true);
}"""
TITLE_AT = (700, 300)
# What the help panel shows: the page's headings, or the frontend's fallback (the node's
# description and its inputs) when no page answered; null while it loads, or while it still
# shows the node before (`title`: the node's display name, the page's first heading).
SHOWN = """(title) => {
    const panel = [...document.querySelectorAll('.node-help-content')].find((e) => e.offsetParent !== null);
    if (!panel) return null;
    const headings = [...panel.querySelectorAll('h1, h2')].map((h) => h.innerText.trim());
    const fallback = panel.querySelector('.fallback-content')?.innerText.slice(0, 300) ?? null;
    return headings[0] === title || fallback ? { headings, fallback } : null;
}"""


@pytest.fixture
def comfy_page(module_returning_users_page):
    """One page for the module (the tutorial done: no template browser over the canvas)."""
    return module_returning_users_page(WINDOW)


def page_headings(node_id: str) -> list[str]:
    """The headings of the node's help page, as its markdown writes them."""
    text = (REPO_ROOT / "web" / "docs" / f"{node_id}.md").read_text()
    return [match.group(1).strip() for match in re.finditer(r"^##? (.+)$", text, re.MULTILINE)]


@pytest.mark.parametrize("node_id", NODES)
def test_the_info_button_shows_the_nodes_help_page(comfy_page, server, node_id):
    blank_canvas(comfy_page)
    page_path = f"/extensions/{PACK_DIR_NAME}/docs/{node_id}"  # and the locale's: page_path/en.md
    docs = server.url + page_path
    title = server.get_json("/object_info")[node_id]["display_name"]
    asked: list[tuple[str, int]] = []

    def on_response(response):
        if response.url.startswith(docs):
            asked.append((response.url.removeprefix(server.url), response.status))

    comfy_page.on("response", on_response)
    try:
        comfy_page.evaluate(ADD_AND_SELECT, [node_id, TITLE_AT])
        info = comfy_page.locator("[data-testid='info-button']")
        info.wait_for(state="visible", timeout=10_000)
        with comfy_page.expect_response(f"{docs}.md", timeout=15_000):
            info.click()
        shown = comfy_page.wait_for_function(SHOWN, arg=title, timeout=15_000).json_value()
    finally:
        comfy_page.remove_listener("response", on_response)

    # the locale's page first (absent: the pack ships one page for every locale), then the node's
    assert asked == [(f"{page_path}/{LOCALE}.md", 404), (f"{page_path}.md", 200)], asked
    assert shown == {"headings": page_headings(node_id), "fallback": None}, shown
    assert shown["headings"][0] == title, shown
    # the frontend's probe for the locale's page is its own business; nothing else may fail
    problems = comfy_page.ui_problems()
    probe = f"HTTP 404: {docs}/{LOCALE}.md"
    assert probe in problems and NOT_FOUND in problems, problems
    problems.remove(probe)
    problems.remove(NOT_FOUND)
    assert not problems


@pytest.mark.version_independent
def test_multi_image_conditioning_sends_qwen_image_edit_to_its_encoder_node(server):
    """Issue 64: its description and `model` tooltip listed Qwen-Image-Edit, which it refuses."""
    node = "KontextTrainer_MultiImageConditioning"
    listed = server.get_json("/object_info")[node]
    tooltip = listed["input"]["required"]["model"][1]["tooltip"]
    help_page = server.get(f"/extensions/{PACK_DIR_NAME}/docs/{node}.md").decode()
    for text in (listed["description"], tooltip, help_page):
        assert "Qwen-Image-Edit" in text and "TextEncodeQwenImageEditPlus" in text, text
        assert "Qwen-Image-Edit 2509" not in text, text  # not among the models it conditions
