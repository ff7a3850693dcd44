"""Held-out validation: fixed sigmas and noise (by hand), eval mode, and a loop whose training
is the same with validation on and off."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_core.config import TrainConfig
from trainer_core.flow_step import Sample
from trainer_core.loop import ResumeState, train
from trainer_core.token_batch import build_token_batch, pack_latent
from trainer_core.validation import VALIDATION_SIGMAS, evaluating, held_out_loss, noise_seed


def make_sample(gen, size=(4, 4)):
    return Sample(
        torch.randn(16, *size, generator=gen),
        torch.randn(3, 8, generator=gen),
        torch.randn(5, generator=gen),
        [torch.randn(16, 2, 2, generator=gen)],
    )


class Scaled:
    """A predictor: the velocity guess 0.5 x the noisy tokens (remembers the sigmas it saw)."""

    def __init__(self):
        self.sigmas = []

    def __call__(self, batch, sigma, context, pooled):
        self.sigmas.append(float(sigma[0]))
        return 0.5 * batch.tokens


def test_held_out_loss_by_hand():
    gen = torch.Generator().manual_seed(0)
    samples = [make_sample(gen), make_sample(gen, size=(2, 4))]
    predict = Scaled()
    value = held_out_loss(predict, samples, build_token_batch, seed=7)
    expected = 0.0
    for i, sample in enumerate(samples):
        x0 = pack_latent(sample.target[None])[0]
        tokens = x0.shape[0] + 1  # one reference token (2x2 patch) after the target's
        for j, sigma in enumerate(VALIDATION_SIGMAS):
            noise = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(noise_seed(7, i, j)))
            x_t = (1 - sigma) * x0 + sigma * noise[: x0.shape[0]]
            expected += float(((0.5 * x_t - (noise[: x0.shape[0]] - x0)) ** 2).mean())
    expected /= len(samples) * len(VALIDATION_SIGMAS)
    assert math.isclose(value, expected, rel_tol=1e-6)
    assert predict.sigmas == pytest.approx(list(VALIDATION_SIGMAS) * 2)
    # the same again (fixed noise) and no global random state used
    before = torch.get_rng_state()
    assert held_out_loss(Scaled(), samples, build_token_batch, seed=7) == value
    assert torch.equal(torch.get_rng_state(), before)
    # the seed picks the noise
    assert held_out_loss(Scaled(), samples, build_token_batch, seed=8) != value


def test_held_out_loss_needs_samples():
    with pytest.raises(ValueError, match="hold_out"):
        held_out_loss(Scaled(), [], build_token_batch, seed=0)


def test_evaluating_turns_dropout_off_and_restores_each_modules_mode():
    model = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    model.train()
    model[2].eval()  # a submodule with its own mode
    x = torch.ones(8, 4)
    with evaluating(model):
        assert not any(m.training for m in model.modules())
        assert torch.equal(model(x), model(x))  # no dropout
        assert not model(x).requires_grad
    assert [m.training for m in model.modules()] == [True, True, True, False]


def dropout_problem():
    """A loss that draws from the objective's generator and from the global RNG (dropout)."""
    target = torch.tensor([1.0, -2.0, 3.0, 0.5])
    weight = torch.nn.Parameter(torch.zeros(4))
    dropout = torch.nn.Dropout(0.3)

    def loss_fn(batch, generator):
        noise = torch.randn(4, generator=generator) * 0.1
        return ((dropout(weight) - target - noise) ** 2).sum() * batch

    def validate():
        torch.rand(5)  # validation that touches the global RNG must not change training
        with torch.no_grad():
            return float(((weight - target) ** 2).sum())

    return weight, loss_fn, validate


def test_training_is_identical_with_validation_on_and_off():
    config = TrainConfig(steps=7, learning_rate=0.1, validate_every=3, seed=4)
    runs = []
    for with_validation in (False, True):
        torch.manual_seed(0)
        weight, loss_fn, validate = dropout_problem()
        seen: list = []
        result = train(
            config,
            [weight],
            lambda i: 1.0,
            loss_fn,
            lambda info, seen=seen: seen.append(info.validation_loss),
            validate=validate if with_validation else None,
        )
        runs.append((result, weight.detach().clone(), seen))
    (off, off_weight, _), (on, on_weight, seen) = runs
    assert on.losses == off.losses and torch.equal(on_weight, off_weight)
    # every validate_every steps and after the last one, reported on that step's StepInfo
    assert [step for step, _ in on.validation] == [3, 6, 7]
    assert [v is not None for v in seen] == [False, False, True, False, False, True, True]
    assert on.validation[-1][1] == pytest.approx(
        float(((on_weight - torch.tensor([1.0, -2, 3, 0.5])) ** 2).sum())
    )
    assert on.validation[0][1] > on.validation[-1][1]  # the held-out error falls as it trains
    assert off.validation == []


def test_validate_every_zero_validates_only_at_the_end():
    weight, loss_fn, validate = dropout_problem()
    result = train(
        TrainConfig(steps=4, validate_every=0), [weight], lambda i: 1.0, loss_fn, validate=validate
    )
    assert [step for step, _ in result.validation] == [4]


def test_a_resumed_run_keeps_the_earlier_validation_points():
    config = TrainConfig(steps=6, learning_rate=0.1, validate_every=2, seed=1)
    torch.manual_seed(0)
    weight, loss_fn, validate = dropout_problem()
    stopped = train(config, [weight], lambda i: 1.0, loss_fn, lambda info: info.step < 3, validate=validate)
    assert [s for s, _ in stopped.validation] == [2]
    resume = ResumeState(
        3, stopped.losses, stopped.optimizer.state_dict(), stopped.generator.get_state(), stopped.validation
    )
    resumed = train(config, [weight], lambda i: 1.0, loss_fn, resume=resume, validate=validate)
    assert [s for s, _ in resumed.validation] == [2, 4, 6]
    assert resumed.validation[0] == stopped.validation[0]


class Interrupt(Exception):
    pass


def test_a_cancel_during_validation_stops_after_the_finished_step():
    weight, loss_fn, _ = dropout_problem()

    def validate():
        raise Interrupt

    state = torch.get_rng_state()
    result = train(
        TrainConfig(steps=5, validate_every=2),
        [weight],
        lambda i: 1.0,
        loss_fn,
        stop_on=(Interrupt,),
        validate=validate,
    )
    assert result.steps == 2 and result.stopped_early and result.validation == []
    assert not torch.equal(torch.get_rng_state(), state)  # (dropout drew) but validation restored its own
