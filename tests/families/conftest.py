"""What the family tests share: the pack's training session and sample type, as ComfyUI loaded
the pack."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def ft(pack):
    return importlib.import_module(f"{pack.__name__}.comfy_adapter.lora_session")


@pytest.fixture(scope="module")
def Sample(pack):
    return importlib.import_module(f"{pack.__name__}.trainer_core.flow_step").Sample
