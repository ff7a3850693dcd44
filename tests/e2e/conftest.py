"""e2e fixtures: one ComfyUI server per session, and a headless Debian Chromium."""

from __future__ import annotations

import os
import shutil
from urllib.parse import urlparse

import pytest

from kt_testing.frontend import (
    TUTORIAL,
    close_first_start_templates,
    extension_registered,
    is_first_start,
    ui_format_converter,
)
from kt_testing.paths import TEST_NODE_PACKS
from kt_testing.server import ComfyServer

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One server per session, with the pack and the tests' own tiny-model nodes."""
    with ComfyServer(tmp_path_factory.mktemp("server-base"), extra_packs=TEST_NODE_PACKS) as running:
        yield running


@pytest.fixture(scope="session")
def chromium():
    """Playwright driving the system's Chromium (playwright's own browser download is never
    used). Missing Chromium fails in CI, where set-up installs it, and skips elsewhere."""
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; scripts/setup.sh installs it with apt-get")
        pytest.skip("Debian chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


TOASTS_JS = """() => [...document.querySelectorAll('.p-toast-message')]
    .filter((t) => t.offsetParent !== null).map((t) => t.innerText.trim())"""
# Offline machines cannot resolve the hosts the frontend asks for release notes and node-registry
# data, nor the two it probes to pick a download mirror (1.49's `isInChina`: google, then
# baidu), nor the one its default workflow's model files are on (1.49 asks huggingface.co for
# them about 4.5 s after a first start, z_image_turbo's; measured); each such request logs
# this console error. It is dropped only while every unresolved request went to one of these
# hosts (any other unresolved host keeps it a problem).
REGISTRY_HOSTS = {"api.comfy.org", "www.google.com", "www.baidu.com", "huggingface.co"}
UNRESOLVED = "console error: Failed to load resource: net::ERR_NAME_NOT_RESOLVED"


def watch_for_problems(page) -> None:
    """Record everything a user would see as a problem: uncaught page errors, console errors,
    alert / confirm / prompt dialogs (dismissed); `page.ui_problems()` adds visible toasts and
    leaves out the offline registry look-ups (above). `page.forget_problems()` drops what was
    recorded so far, once the page's start-up requests (settings, user data, release notes) have
    ended: what happens while the page starts is the fixture's business."""
    problems: list[str] = []
    unresolved_hosts: set[str] = set()
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))

    def on_console(message):
        if message.type == "error":
            problems.append(f"console error: {message.text}")

    page.on("console", on_console)

    def on_dialog(dialog):
        problems.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    page.on("dialog", on_dialog)

    def on_request_failed(request):
        if "ERR_NAME_NOT_RESOLVED" in (request.failure or ""):
            unresolved_hosts.add(urlparse(request.url).hostname)

    page.on("requestfailed", on_request_failed)
    # the console's "Failed to load resource" names no address: record the addresses too
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))

    def ui_problems() -> list[str]:
        found = [*problems, *(f"toast: {t}" for t in page.evaluate(TOASTS_JS))]
        if unresolved_hosts <= REGISTRY_HOSTS:
            found = [p for p in found if p != UNRESOLVED]
        else:
            others = sorted(unresolved_hosts - REGISTRY_HOSTS)
            found.append(f"unresolved hosts besides the registry's: {others}")
        return found

    def forget_problems(settle_ms: int = 1500) -> None:
        page.wait_for_timeout(settle_ms)
        problems.clear()
        unresolved_hosts.clear()

    page.page_errors = problems  # kept under its old name too
    page.unresolved_hosts = unresolved_hosts
    page.ui_problems = ui_problems
    page.forget_problems = forget_problems


def open_comfy_page(chromium, server, viewport: dict | None = None):
    """A new page with the real ComfyUI frontend loaded and the pack's extensions and every node
    type registered, its problems watched (`watch_for_problems`); `viewport`: its size, else
    Playwright's default."""
    first_start = is_first_start(server)
    page = chromium.new_page(viewport=viewport) if viewport else chromium.new_page()
    watch_for_problems(page)
    page.goto(server.url)
    # The pack's extensions register after the core ones: wait for ours.
    page.wait_for_function(
        extension_registered("KontextTrainer.About"),
        timeout=60_000,
    )
    # Node definitions are registered a moment later: wait until every node type is known.
    node_types = sorted(server.get_json("/object_info"))
    page.wait_for_function(
        "(types) => types.every(t => window.LiteGraph?.registered_node_types?.[t])",
        arg=node_types,
        timeout=60_000,
    )
    close_first_start_templates(page, first_start)
    return page


def open_returning_users_page(chromium, server, viewport: dict):
    """A page as a returning user opens it: the tutorial done (the template browser does not
    open on top), at `viewport`, its start-up problems forgotten once it has settled. One page
    load: a page start costs Chromium 6-7 s of CPU on 0.33 (measured), and the tests that
    reloaded a fresh page to apply the setting and the size paid two."""
    server.post_json(f"/settings/{TUTORIAL}", True)
    page = open_comfy_page(chromium, server, viewport)
    page.forget_problems()  # the start-up requests (settings, user data, release notes)
    return page


@pytest.fixture
def comfy_page(chromium, server):
    """The real ComfyUI frontend, loaded, with the pack's extensions registered. Tests end
    with `assert not comfy_page.ui_problems()` (errors, dialogs and toasts the user would see)
    after `comfy_page.forget_problems()` once the page has settled."""
    page = open_comfy_page(chromium, server)
    yield page
    page.close()


@pytest.fixture
def returning_users_page(chromium, server):
    """Opens `open_returning_users_page(chromium, server, viewport)`: call it with the viewport;
    the pages close after the test."""
    pages = []

    def open_page(viewport: dict):
        pages.append(open_returning_users_page(chromium, server, viewport))
        return pages[-1]

    yield open_page
    for page in pages:
        page.close()


@pytest.fixture(scope="module")
def module_returning_users_page(chromium, server):
    """`returning_users_page` shared by the tests of one module (a page start costs Chromium
    6-7 s of CPU): call it with the viewport; the first call opens the page, later calls return
    it with what happened before forgotten; it closes at the module's end. For tests that each
    start on a blank canvas and run nothing: the page keeps every run it has seen (see
    tests/README.md)."""
    page = None

    def open_page(viewport: dict):
        nonlocal page
        if page is None:
            page = open_returning_users_page(chromium, server, viewport)
        else:
            if page.viewport_size != viewport:
                page.set_viewport_size(viewport)
            page.forget_problems()
        return page

    yield open_page
    if page is not None:
        page.close()


@pytest.fixture(scope="module")
def module_page(chromium, server):
    """`comfy_page` shared by the tests of one module, for tests that each open a workflow in a
    tab of their own (a page start costs 5-8 s on 2 cores; opening a workflow well under one).
    Each test starts with `forget_problems()` and `kt_testing.frontend.blank_canvas` where it needs the canvas
    empty, and takes off any listener it adds. The page closes after the module's last test
    that uses it (`pytest_runtest_teardown` below), not at the module's end."""
    page = open_comfy_page(chromium, server)
    yield page
    if not page.is_closed():
        page.close()


_LAST_PAGE_USERS = pytest.StashKey[set]()


def pytest_collection_finish(session):
    """The last test of each module, in the order they run, that uses `module_page`."""
    last = {}
    for item in session.items:
        if "module_page" in getattr(item, "fixturenames", ()):
            last[item.module] = item
    session.stash[_LAST_PAGE_USERS] = {id(item) for item in last.values()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Closes `module_page` after its last user: an open ComfyUI page costs Chromium about 0.12
    of a core while it only waits (0.33's frontend at 1920x1080 with an example open, measured),
    and the slow tests of test_example_workflows.py ran 150 to 160 s after the last one that
    needed it."""
    last = id(item) in item.session.stash.get(_LAST_PAGE_USERS, set())
    page = (getattr(item, "funcargs", None) or {}).get("module_page") if last else None
    yield
    if page is not None and not page.is_closed():
        page.close()


@pytest.fixture(scope="module")
def to_ui_format(chromium, server):
    """Converts an API-format graph to the frontend's workflow format, in a page of its own."""
    convert, page = ui_format_converter(chromium, server)
    yield convert
    page.close()
