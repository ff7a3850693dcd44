"""The training config refuses bad values by name and writes the LoRA file's metadata."""

from __future__ import annotations

import json

import pytest

from trainer_core import __version__
from trainer_core.config import TrainConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("steps", 0, "steps"),
        ("rank", 0, "rank"),
        ("dropout", 1.0, "dropout"),
        ("loss_weighting", "huber", "loss weighting 'huber'"),
        ("targets", "everything", "target preset 'everything'"),
        ("layout", "grid", "reference layout 'grid'"),
        ("timestep_sampler", "beta", "timestep sampler 'beta'"),
    ],
)
def test_bad_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_defaults_follow_peers():
    config = TrainConfig()
    assert config.guidance == 1.0
    assert config.sigma_sampler().kind == "flux_shift"


def test_file_metadata_has_kohya_fields_and_ours():
    config = TrainConfig(
        rank=8, alpha=4.0, layout="dreamomni2", targets="attention", timestep_sampler="shift", shift=2.5
    )
    metadata = config.file_metadata(
        steps=120, resolution=512, base_model="flux1-kontext", dataset_hash="abc123"
    )
    assert metadata["ss_network_dim"] == "8"
    assert metadata["ss_network_alpha"] == "4.0"
    assert metadata["ss_base_model_version"] == "flux1-kontext"
    assert metadata["ss_steps"] == "120"
    assert metadata["ss_resolution"] == "(512, 512)"
    assert metadata["kontext_trainer.layout"] == "dreamomni2"
    assert metadata["kontext_trainer.targets"] == "attention"
    assert json.loads(metadata["kontext_trainer.sampler"]) == {
        "kind": "shift",
        "weighting": "none",
        "sigmoid_scale": 1.0,
        "shift": 2.5,
    }
    assert metadata["kontext_trainer.trainer_version"] == __version__
    assert metadata["kontext_trainer.dataset_hash"] == "abc123"
    assert json.loads(metadata["kontext_trainer.config"])["rank"] == 8
    assert all(isinstance(v, str) for v in metadata.values())
