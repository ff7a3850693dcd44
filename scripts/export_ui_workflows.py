"""Regenerate the UI-format workflows in example_workflows/ from their API-format sources in
example_workflows/api/, with the real frontend doing the conversion (`app.loadApiJson`, then
`app.graph.serialize()` through `JSON.stringify`, as the frontend saves a file: keys that are
`undefined` are left out, never written as `null`, which the frontend's zod schema refuses),
so the shared files are exactly what ComfyUI itself would save, and a `<name>.jpg` thumbnail
of each (a screenshot of the loaded graph) for ComfyUI's template browser.

Each written file is loaded back the way a user opens it (`app.loadGraphData`, which validates
it against the frontend's zod schema); any toast the frontend shows fails the export.
tests/e2e/test_example_workflows.py checks the two formats stay equivalent and opens each file
from the template browser.

    .venv/bin/python scripts/export_ui_workflows.py     (needs Debian chromium)
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

from PIL import Image

from comfy_server import REPO_ROOT, ComfyServer

API_DIR = REPO_ROOT / "example_workflows" / "api"
# Thumbnail look: readable node text at fit-view zoom, no minimap or canvas statistics.
SHOT_SETTINGS = {
    "Comfy.TutorialCompleted": True,  # no first-run dialog
    "Comfy.Minimap.Visible": False,
    "Comfy.Graph.CanvasInfo": False,
    "LiteGraph.Canvas.MinFontSizeForLOD": 1,
}
VISIBLE_TOASTS = """() => [...document.querySelectorAll('.p-toast-message')]
    .filter((t) => t.offsetParent !== null).map((t) => t.innerText.trim())"""


def main() -> int:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        print("Debian chromium is needed: apt-get install chromium", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as base, ComfyServer(Path(base)) as server, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1600, "height": 1068})
        for setting, value in SHOT_SETTINGS.items():
            server.post_json(f"/settings/{setting}", value)
        page.goto(server.url)
        sources = sorted(API_DIR.glob("*.json"))
        needed = sorted({n["class_type"] for s in sources for n in json.loads(s.read_text()).values()})
        # Node definitions are registered a moment after the app appears: wait for every type.
        page.wait_for_function(
            "(types) => types.every(t => window.LiteGraph?.registered_node_types?.[t])",
            arg=needed,
            timeout=60_000,
        )
        for source in sources:
            workflow = page.evaluate(
                """async ([prompt, name]) => {
                    const app = window.comfyAPI.app.app;
                    await app.loadApiJson(prompt, name);
                    return JSON.parse(JSON.stringify(app.graph.serialize()));
                }""",
                [json.loads(source.read_text()), source.name],
            )
            page.evaluate(
                "([workflow, name]) => window.comfyAPI.app.app.loadGraphData(workflow, true, true, name)",
                [workflow, source.stem],
            )
            page.wait_for_timeout(300)  # a validation alert renders on the next tick
            problems = page.evaluate(VISIBLE_TOASTS)
            if problems:
                print(f"{source.name}: the frontend refuses the result: {problems}", file=sys.stderr)
                return 1
            target = REPO_ROOT / "example_workflows" / source.name
            target.write_text(json.dumps(workflow, indent=2) + "\n")
            page.evaluate(
                "() => window.comfyAPI.app.app.extensionManager.command.execute('Comfy.Canvas.FitView')"
            )
            page.wait_for_timeout(500)
            thumbnail = target.with_suffix(".jpg")
            canvas_only = {"x": 64, "y": 96, "width": 1536, "height": 972}  # no menus or banners
            shot = Image.open(io.BytesIO(page.screenshot(clip=canvas_only))).convert("RGB")
            shot.resize((600, 380), Image.Resampling.LANCZOS).save(thumbnail, quality=85)
            print(f"wrote {target.relative_to(REPO_ROOT)} and {thumbnail.name}")
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
