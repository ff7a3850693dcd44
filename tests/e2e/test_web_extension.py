"""The pack's web extension in the real ComfyUI frontend, in headless Chromium."""

from __future__ import annotations

import tomllib

from kt_testing.paths import REPO_ROOT


def test_about_badge_names_the_installed_version(comfy_page, server):
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    comfy_page.evaluate(
        "() => window.comfyAPI.app.app.extensionManager.command.execute('Comfy.Help.AboutComfyUI')"
    )
    badge = comfy_page.get_by_text(f"Kontext Trainer v{version}")
    badge.wait_for(timeout=30_000)
    href = badge.evaluate("element => element.closest('a').href")
    # The link resolves on the server to the web extension's README.
    assert server.get(href.removeprefix(server.url)) == (REPO_ROOT / "web" / "README.md").read_bytes()
    assert not [e for e in comfy_page.page_errors if "kontext" in e.lower()]
