"""Data parallelism in the trainer core: N gloo processes, each training its rows of every
global batch and summing gradients with `distributed.Collective`, take exactly the steps of
one process training the global batch (the headless command's torchrun tests check the same
through the whole trainer; see tests/application/test_headless_parallel.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

from comfy_server import free_port
from kt_testing import toy_parallel
from kt_testing.toy_parallel import read_result, run, toy_buckets, toy_config, toy_samples
from trainer_core.distributed import Collective, _buckets
from trainer_core.flow_step import EmptyText, flow_matching_loss
from trainer_core.loop import DataOrder


@pytest.mark.parametrize(("world", "batch_size"), [(2, 1), (2, 2), (3, 1)])
def test_n_processes_equal_one_process_with_the_global_batch(tmp_path, world, batch_size):
    mp.spawn(toy_parallel.worker, args=(world, free_port(), str(tmp_path), batch_size), nprocs=world)
    single_losses, single_weights = run(toy_config(batch_size * world))
    for rank in range(world):
        losses, weights = read_result(tmp_path, rank)
        assert losses == pytest.approx(single_losses, rel=1e-5, abs=1e-7)
        for name, expected in single_weights.items():
            torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6)
    # and the steps did move the weights (an untrained model would also be "equal")
    untouched = toy_parallel.ToyVelocity().state_dict()
    assert not torch.allclose(single_weights["tokens"], untouched["tokens"])


def test_the_toy_run_has_short_and_empty_shards():
    """The case the sums must get right: a bucket's last global batch leaves a process fewer
    rows than batch_size, or none."""
    order = DataOrder(toy_buckets(toy_samples()), 2, seed=7)
    sizes = {len(order(i)) for i in range(order.per_epoch)}
    assert sizes == {1, 2}
    collective = Collective(1, 2, torch.device("cpu"))
    assert collective.rows(1, 1) == slice(1, 1)  # rank 1 gets nothing of a one-sample batch
    assert collective.rows(3, 2) == slice(2, 3)


def test_rows_share_the_global_draws_and_sum_to_the_global_loss():
    """Each process's loss is its rows' part of the global mean, with the random draws the
    global batch gets: the parts add up to the one-process loss of the whole batch."""
    samples = toy_samples()[:3]
    config = dataclasses.replace(toy_config(3), loss_weighting="sigma_sqrt")
    model = toy_parallel.ToyVelocity()
    empty = EmptyText(torch.zeros(3, 8), torch.zeros(8))

    def loss(rows):
        generator = torch.Generator().manual_seed(5)
        return flow_matching_loss(model, samples, config, generator, empty, toy_parallel.toy_pack, rows)

    whole = loss(None)
    parts = [loss(slice(0, 2)), loss(slice(2, 3)), loss(slice(3, 3))]
    assert sum(float(p.detach()) for p in parts) == pytest.approx(float(whole.detach()), rel=1e-6)
    assert not parts[2].requires_grad and float(parts[2]) == 0.0
    grads = torch.autograd.grad(whole, model.tokens)[0]
    summed = sum(torch.autograd.grad(p, model.tokens)[0] for p in parts[:2])
    torch.testing.assert_close(summed, grads, rtol=1e-5, atol=1e-7)


def test_buckets_split_by_size_and_dtype():
    params = [
        torch.nn.Parameter(torch.zeros(10)),
        torch.nn.Parameter(torch.zeros(10)),
        torch.nn.Parameter(torch.zeros(30)),
        torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)),
    ]
    groups = _buckets(params, limit=80)  # 20 float32 fit, the 30 get their own
    assert [[p.numel() for p in group] for group in groups] == [[10, 10], [30], [4]]
