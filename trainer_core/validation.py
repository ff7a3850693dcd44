"""Held-out validation: the flow loss of the samples kept out of training (`hold_out`), at a
fixed set of noise levels with fixed noise, so successive values measure the model alone
(no timestep or noise lottery) and computing them moves no training random state.

Evaluated in eval mode (LoRA dropout off) without gradients; the loss is unweighted (whatever
the run's `loss_weighting`), one sample at a time (held-out samples need not share a size).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from .flow_step import Predict, Sample, fixed_noise_loss
from .token_batch import Pack

# Spread over the range training draws from; the same for every run, so curves compare.
VALIDATION_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)


@contextlib.contextmanager
def evaluating(module: torch.nn.Module):
    """Eval mode (dropout off) and no gradients inside; every submodule's own training flag
    is put back afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield module
    finally:
        for submodule, training in modes:
            submodule.training = training


def noise_seed(seed: int, sample_index: int, sigma_index: int) -> int:
    """The noise of held-out sample i at sigma j: fixed by the run's seed, never drawn from
    the training generator."""
    return (seed * 1_000_003 + sample_index * 1_009 + sigma_index) % 2**63


def held_out_loss(
    predict: Predict,
    samples: Sequence[Sample],
    pack: Pack,
    seed: int,
    sigmas: Sequence[float] = VALIDATION_SIGMAS,
    noise_scaling=None,
) -> float:
    """Mean flow loss over every held-out sample and every sigma in `sigmas`, on the tokens
    `pack` (the model family's) makes of each (`noise_scaling`:
    the model's, see `objective.noisy_input`)."""
    if not samples:
        raise ValueError("validation needs held-out samples (LoadKontextDataset's hold_out)")
    total = 0.0
    for i, sample in enumerate(samples):
        for j, sigma in enumerate(sigmas):
            total += float(
                fixed_noise_loss(predict, sample, pack, sigma, noise_seed(seed, i, j), noise_scaling)
            )
    return total / (len(samples) * len(sigmas))
