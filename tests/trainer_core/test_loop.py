"""The loop: AdamW steps equal torch's own, stops on request, and is reproducible."""

from __future__ import annotations

import itertools

import torch

from trainer_core.config import TrainConfig
from trainer_core.loop import train


def quadratic_problem():
    target = torch.tensor([1.0, -2.0, 3.0])
    weight = torch.nn.Parameter(torch.zeros(3))

    def loss_fn(batch, generator):
        noise = torch.randn(3, generator=generator) * 0.01
        return ((weight - target - noise) ** 2).sum() * batch

    return weight, loss_fn


def test_steps_equal_a_plain_adamw_run():
    weight, loss_fn = quadratic_problem()
    config = TrainConfig(steps=5, learning_rate=0.1, weight_decay=0.0, max_grad_norm=0.0, seed=3)
    result = train(config, [weight], itertools.repeat(1.0), loss_fn)

    # Independent reference: the same problem with torch.optim.AdamW driven by hand.
    reference, reference_loss_fn = quadratic_problem()
    optimizer = torch.optim.AdamW([reference], lr=0.1, weight_decay=0.0)
    generator = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(5):
        loss = reference_loss_fn(1.0, generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    torch.testing.assert_close(weight.detach(), reference.detach())
    assert result.losses == losses
    assert result.losses[-1] < result.losses[0]


def test_on_step_reports_and_can_stop():
    weight, loss_fn = quadratic_problem()
    seen = []

    def on_step(info):
        seen.append((info.step, info.total, info.learning_rate))
        return info.step < 3

    result = train(
        TrainConfig(steps=10, learning_rate=0.05), [weight], itertools.repeat(1.0), loss_fn, on_step
    )
    assert seen == [(1, 10, 0.05), (2, 10, 0.05), (3, 10, 0.05)]
    assert result.steps == 3 and result.stopped_early


def test_seed_fixes_the_loss_sequence():
    def run(seed):
        weight, loss_fn = quadratic_problem()
        return train(TrainConfig(steps=4, seed=seed), [weight], itertools.repeat(1.0), loss_fn).losses

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_gradient_clipping_matches_clipping_by_hand():
    # A huge gradient then a small one: Adam's second update depends on how much of the
    # first gradient survived the clip, so an unclipped run would differ.
    weight, loss_fn = quadratic_problem()
    config = TrainConfig(steps=2, learning_rate=0.1, weight_decay=0.0, max_grad_norm=0.5, seed=4)
    train(config, [weight], iter([100.0, 0.01]), loss_fn)

    reference, reference_loss_fn = quadratic_problem()
    optimizer = torch.optim.AdamW([reference], lr=0.1, weight_decay=0.0)
    generator = torch.Generator().manual_seed(4)
    for scale in (100.0, 0.01):
        reference_loss_fn(scale, generator).backward()
        norm = reference.grad.norm()
        if norm > 0.5:
            reference.grad.mul_(0.5 / (norm + 1e-6))
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(weight.detach(), reference.detach())

    unclipped, unclipped_loss_fn = quadratic_problem()
    train(
        TrainConfig(steps=2, learning_rate=0.1, weight_decay=0.0, max_grad_norm=0.0, seed=4),
        [unclipped],
        iter([100.0, 0.01]),
        unclipped_loss_fn,
    )
    assert not torch.allclose(unclipped.detach(), reference.detach())
