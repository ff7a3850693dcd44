"""A user without the model files opens each example and is offered a download for every file
its loaders need (issue 64): each loader node carries its files' links and folders
(`properties.models`, [{name, url, directory}], as ComfyUI's own templates carry them; written
by scripts/export_ui_workflows.py), which the frontend reads as a workflow opens. Frontend 1.32.9
(ComfyUI 0.3.75) shows them in its Missing Models dialog, a "Download" button per file whose
title is the link; 1.49.6 (0.33) in the Errors tab of its right side panel ("View details" on
its "N errors found" overlay), a "Download <file>" button per file, which opens the link. Without
the property 1.49 offers only "Copy model name", 1.32.9 nothing. On the session's server, before
any module puts files under these names (test_example_workflows.py's stand-ins); one page for
every example, nothing run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from kt_testing.examples import loaded_models
from kt_testing.frontend import TUTORIAL, blank_canvas
from kt_testing.paths import REPO_ROOT

EXAMPLES = REPO_ROOT / "example_workflows"
WORKFLOWS = sorted(EXAMPLES.glob("*.json"))
PAGE_SIZE = {"width": 1920, "height": 937}
PANEL_OPEN = "Comfy.RightSidePanel.IsOpen"  # 1.49 keeps the side panel's state as a setting
OPEN_JS = """async ([workflow, name]) => {
    await window.comfyAPI.app.app.loadGraphData(workflow, true, true, name);
}"""
# 1.49's Download button opens its link as a new tab through an <a target="_blank" download=name>:
# recorded here instead (offline, the tab would only show an error)
RECORD_OPENED_LINKS_JS = """() => {
    window.__ktOpened = [];
    if (window.__ktOpenedClick) return;
    window.__ktOpenedClick = HTMLAnchorElement.prototype.click;
    HTMLAnchorElement.prototype.click = function () {
        if (this.target !== "_blank") return window.__ktOpenedClick.call(this);
        window.__ktOpened.push([this.download, this.href]);
    };
}"""


def downloads_1_32(page) -> dict[str, str]:
    """1.32.9's Missing Models dialog: `directory / name` -> the link of its Download button
    (enabled); the dialog closed after."""
    dialog = page.locator(".p-dialog").filter(has=page.locator(".comfy-missing-models"))
    dialog.wait_for(state="visible", timeout=20_000)
    offered = {}
    for row in dialog.locator(".comfy-missing-models li").all():
        label = row.locator("span[title]").first.inner_text().strip()
        button = row.get_by_role("button", name=re.compile(r"^Download"))
        if button.count() and button.is_enabled():
            offered[label] = button.get_attribute("title")
    dialog.get_by_role("button", name="Close").click()
    dialog.wait_for(state="detached", timeout=10_000)
    return offered


def downloads_1_49(page) -> dict[str, str]:
    """1.49.6's Errors tab: `directory / name` -> the link its Download button opens; each row
    names its folder under its file. The side panel closed after."""
    page.get_by_role("button", name="View details").click()
    buttons = page.locator('[data-testid="missing-model-download"]')
    buttons.first.wait_for(state="visible", timeout=20_000)
    page.evaluate(RECORD_OPENED_LINKS_JS)
    folders = {}
    for button in buttons.all():
        name = button.get_attribute("aria-label").removeprefix("Download ")
        row = page.locator("div").filter(has=button).filter(has_text=name).last
        folders[name] = row.inner_text().split(name, 1)[1].split()[0]
        button.click()
    opened = dict(page.evaluate("() => window.__ktOpened"))
    page.evaluate(f"() => window.comfyAPI.app.app.extensionManager.setting.set('{PANEL_OPEN}', false)")
    return {f"{folders[name]} / {name}": opened.get(name) for name in folders}


@pytest.fixture(scope="module")
def user_page(module_returning_users_page, server):
    """One returning user's page for every example (a page start costs Chromium 6-7 s of CPU);
    after, the tutorial setting (later modules open first-start pages) and 1.49's side panel as
    they were."""
    before = {key: server.get_json("/settings").get(key) for key in (TUTORIAL, PANEL_OPEN)}
    yield module_returning_users_page(PAGE_SIZE)
    for key, value in before.items():
        server.post_json(f"/settings/{key}", bool(value))


def comfyui_template_links(names: set[str]) -> tuple[dict[str, set[tuple[str, str]]], bool]:
    """(file name -> every (directory, url) ComfyUI's own templates give it, for `names`;
    whether the templates of ComfyUI 0.33 are among those read): the comfyui-workflow-templates
    packages on this run's path (0.33's, set-up's `.kontext-site`, first on its runs)."""
    folders = {
        folder for entry in sys.path for folder in Path(entry).glob("comfyui_workflow_templates*/templates")
    }
    links: dict[str, set[tuple[str, str]]] = {}
    for path in sorted(file for folder in folders for file in folder.glob("*.json")):
        text = path.read_text(encoding="utf-8")
        if not any(name in text for name in names):
            continue
        workflow = json.loads(text)
        graphs = [workflow, *workflow.get("definitions", {}).get("subgraphs", [])]
        for node in (node for graph in graphs for node in graph.get("nodes", [])):
            for model in (node.get("properties") or {}).get("models") or []:
                if model.get("name") in names:
                    links.setdefault(model["name"], set()).add((model["directory"], model["url"]))
    newest = any(folder.parent.name == "comfyui_workflow_templates_json" for folder in folders)
    return links, newest


@pytest.mark.version_independent
def test_every_download_is_the_one_comfyuis_own_templates_give():
    """Each file's link and folder, as a loader of the examples carries it, is one ComfyUI's own
    templates carry for that file (Comfy-Org's repackaged releases). The templates that ComfyUI
    0.3.75 installs predate FLUX.2 [klein] and Qwen-Image-Edit 2511: their files are checked
    against 0.33's (this test runs there, in `make test`)."""
    carried = {
        (model["name"], model["directory"], model["url"])
        for path in WORKFLOWS
        for node in json.loads(path.read_text())["nodes"]
        for model in node.get("properties", {}).get("models", [])
    }
    assert carried, "no loader of the examples carries a download"
    links, newest = comfyui_template_links({name for name, _, _ in carried})
    unknown = sorted({name for name, _, _ in carried} - set(links))
    if unknown and not newest:
        pytest.skip(f"ComfyUI's templates installed here predate {unknown} (0.33's have them)")
    assert not unknown, f"no template of ComfyUI's names {unknown}"
    wrong = [(name, folder, url) for name, folder, url in carried if (folder, url) not in links[name]]
    assert not wrong, [(name, sorted(links[name])) for name, _, _ in wrong]


def test_the_server_lacks_every_model_file_the_examples_name(server):
    """What the tests below stand on: a user who has none of the files."""
    present = {
        f"{folder}/{name}"
        for path in WORKFLOWS
        for folder, name in loaded_models(json.loads((EXAMPLES / "api" / path.name).read_text()))
        if name in server.get_json(f"/models/{folder}")
    }
    assert not present, f"a test before this module put {sorted(present)} on the session's server"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_each_missing_model_has_a_download(user_page, server, path):
    """Opened as the template browser opens it, without the files: a download for exactly the
    files its loaders name (the API source's loader widgets), each in its folder under models/,
    with the link the loader carries."""
    workflow = json.loads(path.read_text())
    source = json.loads((EXAMPLES / "api" / path.name).read_text())
    expected = {f"{folder} / {name}" for folder, name in loaded_models(source)}
    carried = {
        f"{model['directory']} / {model['name']}": model["url"]
        for node in workflow["nodes"]
        for model in node.get("properties", {}).get("models", [])
    }
    blank_canvas(user_page)
    user_page.evaluate(OPEN_JS, [workflow, path.stem])
    frontend = user_page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__ ?? ''")
    offered = downloads_1_32(user_page) if frontend.startswith("1.32.") else downloads_1_49(user_page)
    print(f"\n{path.stem} on frontend {frontend}: {sorted(offered)}")
    assert set(offered) == expected, (sorted(offered), sorted(expected))
    assert offered == {label: carried[label] for label in expected}, offered
    assert all(url.startswith("https://huggingface.co/") for url in offered.values()), offered
