"""The Qwen-Image-Edit family's module, as the built-in registry lists it."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def qwen(pack):
    return importlib.import_module(f"{pack.__name__}.comfy_adapter.families.qwen_image")


@pytest.fixture(scope="module")
def registered(pack, qwen):
    """The family's module, its entries among the families every run resolves."""
    listed = pack.comfy_adapter.families._all()
    assert all(entry in listed for entry in qwen.ENTRIES)
    return qwen
