"""The Qwen-Image-Edit family, registered for a test (the registry does not list it yet)."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def qwen(pack):
    return importlib.import_module(f"{pack.__name__}.comfy_adapter.families.qwen_image")


@pytest.fixture(scope="module")
def registered(pack, qwen):
    families = pack.comfy_adapter.families
    for entry in qwen.ENTRIES:
        families.register(entry)
    yield qwen
    for entry in qwen.ENTRIES:
        families.unregister(entry)
