"""Shared fixtures. Layers are marked by folder: tests/nodes, tests/application,
tests/comfy_adapter and tests/families (ComfyUI in this process) -> `nodes`, tests/e2e -> `e2e`,
tests/gpu -> `gpu`.

`tests/trainer_core` never touches ComfyUI; the fixtures that boot it are only used by the
other two layers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS_DIR).parts
        in_process = {"families": "nodes", "application": "nodes", "comfy_adapter": "nodes"}
        layer = in_process.get(parts[0], parts[0])
        if layer in ("nodes", "e2e", "gpu"):
            item.add_marker(getattr(pytest.mark, layer))
    # `make test` runs these once (scripts/test.sh sets this for its 0.3.75 runs): their subject
    # (our files, names, settings, processes) is the same on every ComfyUI. They run on 0.33, but
    # for the files named in KT_VERSION_INDEPENDENT_HERE, which a 0.3.75 run takes over to even
    # out the runs' ends.
    if os.environ.get("KT_VERSION_INDEPENDENT_ELSEWHERE") == "1":
        names = os.environ.get("KT_VERSION_INDEPENDENT_HERE", "").split()
        here = {(TESTS_DIR.parent / name).resolve() for name in names}
        elsewhere = [
            item
            for item in items
            if item.get_closest_marker("version_independent") and Path(str(item.fspath)).resolve() not in here
        ]
        if elsewhere:
            config.hook.pytest_deselected(items=elsewhere)
            dropped = set(map(id, elsewhere))
            items[:] = [item for item in items if id(item) not in dropped]


def cpu_seconds() -> float:
    """CPU time of this process and everything under it: its threads, the children it reaped
    (RUSAGE_CHILDREN), and the live ones (a server, a browser, a command) with what they reaped."""
    import resource

    import psutil

    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # ended since the listing
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


_CPU_AT_SETUP = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_SETUP] = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's CPU seconds (setup, call and teardown, its servers' and commands' included)
    as the JUnit property `cpu_s`: on 2 shared cores a test's time says how busy the machine
    was, its CPU what it costs (scripts/durations.py sums both per file)."""
    if call.when == "teardown" and _CPU_AT_SETUP in item.stash:
        item.user_properties.append(("cpu_s", round(cpu_seconds() - item.stash[_CPU_AT_SETUP], 2)))
    yield


@pytest.fixture(scope="session")
def comfy_runtime(tmp_path_factory):
    """ComfyUI booted in this process (CPU) with the pack loaded as a custom node, on the CPU
    with the attention ComfyUI picks on an NVIDIA GPU (scripts/comfy_server.py CPU_ATTENTION_FLAGS)."""
    from kt_testing.comfy_runtime import boot
    from kt_testing.server import comfy_device

    options = {"use_pytorch_cross_attention": True} if comfy_device() == "cpu" else {}
    return boot(tmp_path_factory.mktemp("comfy-base"), options)


@pytest.fixture(scope="session")
def pack(comfy_runtime):
    """The pack's package exactly as ComfyUI imported it (e.g. `pack.comfy_adapter.model_family`)."""
    return comfy_runtime.pack_module


@pytest.fixture(scope="session")
def pack_import(pack):
    """Import one of the pack's modules as ComfyUI loaded it: `pack_import("nodes.train_lora")`."""
    import importlib

    return lambda name: importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="session")
def stock_assets(comfy_runtime):
    """The demo's stock-loadable files (cached outside git), linked into models/."""
    import demo_assets
    from kt_testing.paths import asset_cache_dir

    paths = demo_assets.ensure_assets(asset_cache_dir())
    demo_assets.link_into_models(paths, comfy_runtime.base_dir / "models")
    return paths
