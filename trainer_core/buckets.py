"""Aspect-ratio buckets and batches drawn within a bucket.

A target's bucket is its size under the one size rule (`sizing.fit_to_area` at the chosen
area): aspect kept, area about resolution^2, sides multiples of 16. Every batch holds samples
of one bucket, so targets in a batch share a shape (references may still differ in size;
the token batch pads and masks them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from .sizing import fit_to_area


def assign_buckets(sizes: Sequence[tuple[int, int]], resolution: int) -> dict[tuple[int, int], list[int]]:
    """(width, height) per sample -> {bucket (width, height): sample indices}, buckets sorted."""
    buckets = defaultdict(list)
    for index, (width, height) in enumerate(sizes):
        buckets[fit_to_area(width, height, resolution)].append(index)
    return dict(sorted(buckets.items()))


def epoch_batches(
    buckets: dict[tuple[int, int], list[int]], batch_size: int, generator: torch.Generator
) -> list[list[int]]:
    """One epoch: each bucket shuffled and cut into batches of `batch_size` (the last one of a
    bucket may be smaller), then the batches shuffled across buckets. Every sample once."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    batches = []
    for indices in buckets.values():
        order = torch.randperm(len(indices), generator=generator).tolist()
        shuffled = [indices[i] for i in order]
        batches += [shuffled[i : i + batch_size] for i in range(0, len(shuffled), batch_size)]
    order = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in order]
