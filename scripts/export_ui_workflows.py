"""Regenerate the UI-format workflows in example_workflows/ from their API-format sources in
example_workflows/api/, with the real frontend doing the conversion (`app.loadApiJson`, then
`app.graph.serialize()`), so the shared files are exactly what ComfyUI itself would save, and
a `<name>.jpg` thumbnail of each (a screenshot of the loaded graph) for ComfyUI's template
browser. tests/e2e/test_example_workflows.py checks the two formats stay equivalent.

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


def main() -> int:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        print("Debian chromium is needed: apt-get install chromium", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as base, ComfyServer(Path(base)) as server, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 760})
        server.post_json("/settings/Comfy.TutorialCompleted", True)  # no first-run dialog in shots
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
                    return app.graph.serialize();
                }""",
                [json.loads(source.read_text()), source.name],
            )
            target = REPO_ROOT / "example_workflows" / source.name
            target.write_text(json.dumps(workflow, indent=2) + "\n")
            page.evaluate(
                "() => window.comfyAPI.app.app.extensionManager.command.execute('Comfy.Canvas.FitView')"
            )
            page.wait_for_timeout(500)
            thumbnail = target.with_suffix(".jpg")
            canvas_only = {"x": 64, "y": 96, "width": 1136, "height": 664}  # no menus or banners
            shot = Image.open(io.BytesIO(page.screenshot(clip=canvas_only))).convert("RGB")
            shot.resize((600, 380), Image.Resampling.LANCZOS).save(thumbnail, quality=85)
            print(f"wrote {target.relative_to(REPO_ROOT)} and {thumbnail.name}")
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
