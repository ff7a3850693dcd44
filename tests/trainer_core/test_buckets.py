"""Aspect buckets by the one size rule, and batches that never mix buckets."""

from __future__ import annotations

import torch

from trainer_core.buckets import assign_buckets, epoch_batches


def test_buckets_by_hand():
    sizes = [(1024, 768), (768, 1024), (1000, 1000), (2000, 2000), (2048, 1536)]
    # 1024x768 at 512: scale = 512 / sqrt(1024 * 768) = 0.57735; 591.2 -> 592, 443.4 -> 448
    assert assign_buckets(sizes, 512) == {(448, 592): [1], (512, 512): [2, 3], (592, 448): [0, 4]}


def test_epoch_batches_cover_every_sample_once_within_buckets():
    buckets = {(512, 512): [0, 1, 2, 3, 4], (592, 448): [5, 6, 7]}
    batches = epoch_batches(buckets, 2, torch.Generator().manual_seed(0))
    assert sorted(i for batch in batches for i in batch) == list(range(8))
    for batch in batches:
        assert len(batch) <= 2
        assert set(batch) <= set(buckets[(512, 512)]) or set(batch) <= set(buckets[(592, 448)])
    assert len(batches) == 3 + 2
    again = epoch_batches(buckets, 2, torch.Generator().manual_seed(0))
    other = epoch_batches(buckets, 2, torch.Generator().manual_seed(1))
    assert batches == again and batches != other
