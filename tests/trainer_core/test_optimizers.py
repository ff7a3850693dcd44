"""The optimizer registry: every choice has an entry, its factory builds the class its metadata
names, and its state size (what the VRAM estimate counts) is what torch really keeps."""

from __future__ import annotations

import importlib

import pytest
import torch

from trainer_core.choices import Optimizer
from trainer_core.config import TrainConfig
from trainer_core.loop import make_optimizer
from trainer_core.lora_metadata import ModelNames, RunFacts, training_metadata
from trainer_core.optimizers import OPTIMIZERS

# FLUX.1's names (comfy_adapter/families/flux)
FLUX1_NAMES = ModelNames(
    "flux1", "flux-1-dev/lora", "flux", "networks.lora_flux", "https://github.com/black-forest-labs/flux"
)


def lora_pair(rank: int, n_in: int, n_out: int) -> list[torch.nn.Parameter]:
    """A LoRA's down (rank x in) and up (out x rank) matrices, fp32."""
    return [torch.nn.Parameter(torch.randn(rank, n_in)), torch.nn.Parameter(torch.randn(n_out, rank))]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors the optimizer keeps per parameter, after one step (scalars such as
    the step count are not per-value state)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.numel() > 1
    )


def test_every_choice_has_an_entry():
    assert set(OPTIMIZERS) == set(Optimizer)


@pytest.mark.parametrize("name", list(Optimizer))
def test_the_factory_builds_the_class_the_metadata_names(name):
    config = TrainConfig(optimizer=name, learning_rate=3e-4, weight_decay=0.02)
    optimizer = make_optimizer(config, lora_pair(4, 8, 8))
    module, _, cls = OPTIMIZERS[name].class_path.rpartition(".")
    assert type(optimizer) is getattr(importlib.import_module(module), cls)
    assert optimizer.defaults["lr"] == 3e-4 and optimizer.defaults["weight_decay"] == 0.02
    facts = RunFacts("x", "flux1_dev", 512, 1, 1, "abc", 0.0, 1, FLUX1_NAMES)
    metadata = training_metadata(config, facts, steps=1)
    assert metadata["ss_optimizer"] == f"{OPTIMIZERS[name].class_path}(weight_decay=0.02)"


@pytest.mark.parametrize("name", list(Optimizer))
@pytest.mark.parametrize("rank", [4, 16])
def test_the_state_size_is_what_torch_keeps(name, rank):
    """One step on a LoRA pair the size of a FLUX.1 attention projection (3072 -> 3072)."""
    parameters = lora_pair(rank, 3072, 3072)
    optimizer = OPTIMIZERS[name].make(parameters, 1e-4, 0.0)
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    values = sum(p.numel() for p in parameters)
    measured = state_bytes(optimizer) / values
    assert measured == pytest.approx(OPTIMIZERS[name].state_bytes(rank), rel=0.01)
