"""The training config refuses bad values by name and writes the LoRA file's metadata."""

from __future__ import annotations

import dataclasses
import json
import math

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


FLOAT_FIELDS = [f.name for f in dataclasses.fields(TrainConfig) if type(f.default) is float]


def test_every_float_setting_has_limits():
    assert FLOAT_FIELDS == [
        "learning_rate",
        "weight_decay",
        "max_grad_norm",
        "alpha",
        "dropout",
        "logit_mean",
        "logit_std",
        "sigmoid_scale",
        "shift",
        "guidance",
        "ip_noise_gamma",
        "caption_dropout",
        "reference_dropout",
        "lr_floor",
    ]
    for f in dataclasses.fields(TrainConfig):
        if f.name in FLOAT_FIELDS:
            assert {"min", "max"} <= set(f.metadata), f.name


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_floats_are_refused_by_name(field, value):
    limits = TrainConfig.__dataclass_fields__[field].metadata
    with pytest.raises(ValueError) as caught:
        TrainConfig(**{field: value})
    assert str(caught.value) == (
        f"{field} is {value}; give a finite number from {limits['min']} to {limits['max']}"
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_grad_norm", -1.0, "max_grad_norm is -1.0; give a number from 0.0 to 100.0"),
        ("alpha", 0.0, "alpha is 0.0; give a number from 0.01 to 1024.0"),
        ("guidance", 101.0, "guidance is 101.0; give a number from 0.0 to 100.0"),
        ("shift", "3", "shift must be a number from 0.01 to 100.0; got '3'"),
        ("steps", 0, "steps is 0; give a number from 1 to 1000000"),
        ("seed", -1, "seed is -1; give a number from 0 to 2147483647"),
    ],
)
def test_out_of_range_settings_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError) as caught:
        TrainConfig(**{field: value})
    assert str(caught.value) == message
