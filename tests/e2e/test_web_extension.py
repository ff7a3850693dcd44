"""The pack's web extension in the real ComfyUI frontend, in headless Chromium."""

from __future__ import annotations

import tomllib

from kt_testing.paths import PACK_DIR_NAME, REPO_ROOT


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



def test_a_first_start_shows_no_problem_and_the_template_browser_lists_the_examples(first_start_page):
    """A new user's first page (the tutorial not done; every other browser test opens a
    returning user's, see `open_comfy_page`): no problem once it has started, and
    the template browser both frontends open on a first start lists the pack's examples."""
    page = first_start_page
    page.forget_problems()  # the start-up requests (ComfyUI's own 404s: user.css, ...)
    browser = page.locator('[aria-labelledby="global-workflow-template-selector"]')
    browser.wait_for(state="visible")  # about a second after the page loads
    browser.get_by_role("button", name=PACK_DIR_NAME, exact=True).click()
    browser.locator('[data-testid="template-workflow-kontext_lora_training"]').wait_for(state="visible")
    page.wait_for_timeout(1_000)
    assert not page.ui_problems(), page.ui_problems()
