"""The training config refuses bad values by name."""

from __future__ import annotations

import dataclasses
import math

import pytest

from trainer_core.config import TrainConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("steps", 0, "steps"),
        ("rank", 0, "rank"),
        ("dropout", 1.0, "dropout"),
        # every choice: the field's name, the value, and the choices (written out here)
        ("loss_weighting", "huber", "unknown loss_weighting 'huber'; choose one of none, sigma_sqrt, cosmap"),
        ("targets", "everything", "targets 'everything'; choose one of attention, attention_mlp, all_linear"),
        (
            "layout",
            "grid",
            "'grid'; choose one of auto, offset, index, uxo, dreamomni2, index_timestep_zero$",
        ),
        ("timestep_sampler", "beta", "'beta'; choose one of uniform, logit_normal, sigmoid, shift, flux_"),
        ("save_precision", "fp8", "unknown save_precision 'fp8'; choose one of bf16, fp16, fp32$"),
        ("optimizer", "sgd", "unknown optimizer 'sgd'; choose one of adamw, adafactor$"),
        ("schedule", "step", "unknown schedule 'step'; choose one of constant, cosine, linear$"),
        ("fp8_mode", "fp4", "unknown fp8_mode 'fp4'; choose one of as_loaded, fp8_scaled, fp8_backward$"),
    ],
)
def test_bad_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_defaults_follow_peers():
    config = TrainConfig()
    assert config.guidance == 1.0
    assert config.sigma_sampler().kind == "flux_shift"


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


def test_a_choice_reads_as_the_text_the_user_wrote():
    """Messages format values with !r, str or f-strings; a choice shows as its string in all."""
    layout = TrainConfig(layout="dreamomni2").layout
    assert (repr(layout), str(layout), f"{layout}", f"{layout!r}") == (
        "'dreamomni2'",
        "dreamomni2",
        "dreamomni2",
        "'dreamomni2'",
    )
