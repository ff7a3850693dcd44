"""LoRA dropout whose masks belong to the global sample (issue 32: 2 processes x batch 1 drew
other masks than 1 process x batch 2, 6 x the learning rate apart)."""

from __future__ import annotations

import pytest
import torch

from trainer_core.lora_dropout import SampleDropout, micro_batch_key, seed_rows


def masks(dropout: SampleDropout, x: torch.Tensor) -> torch.Tensor:
    return dropout(x) != 0


def test_a_rows_mask_is_the_same_in_any_batch_and_on_any_process():
    dropout = SampleDropout(0.3, layer=4).train()
    x = torch.ones(3, 5, 8)
    key = micro_batch_key(torch.Generator().manual_seed(7))
    seed_rows(key, 0)
    together = masks(dropout, x)  # one process, the global batch of 3
    seed_rows(key, 1)
    second_process = masks(dropout, x[1:])  # a process given rows 1 and 2
    seed_rows(key, 2)
    alone = masks(dropout, x[2:])
    assert torch.equal(together[1:], second_process) and torch.equal(together[2:], alone)
    assert not torch.equal(together[0], together[1])  # rows are not alike
    other_layer = SampleDropout(0.3, layer=5).train()
    seed_rows(key, 0)
    assert not torch.equal(masks(other_layer, x), together)
    seed_rows(micro_batch_key(torch.Generator().manual_seed(8)), 0)  # the next micro-batch
    assert not torch.equal(masks(dropout, x), together)


def test_it_drops_and_scales_as_dropout_does_and_not_in_eval():
    dropout = SampleDropout(0.25, layer=0).train()
    seed_rows(123, 0)
    out = dropout(torch.full((4, 2000), 2.0))
    kept = out != 0
    assert float(kept.float().mean()) == pytest.approx(0.75, abs=0.02)
    assert torch.equal(out[kept], torch.full((int(kept.sum()),), 2.0 / 0.75))
    x = torch.randn(2, 7)
    assert torch.equal(dropout.eval()(x), x)


def test_a_checkpointed_recompute_draws_the_same_masks():
    """Gradient checkpointing restores torch's global random state for the recompute: the
    gradients equal those without checkpointing."""
    dropout = SampleDropout(0.5, layer=1).train()
    weight = torch.randn(6, 6, requires_grad=True)

    def block(x):
        return dropout(x @ weight).square().sum()

    x = torch.randn(2, 3, 6)
    grads = []
    for checkpointed in (False, True):
        seed_rows(99, 0)
        loss = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        seed_rows(5, 0)  # other draws between forward and backward (the next forwards)
        (grad,) = torch.autograd.grad(loss, weight)
        grads.append(grad)
    assert torch.equal(grads[0], grads[1]) and float(grads[0].abs().max()) > 0


def test_the_key_reads_the_generator_without_drawing():
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    assert micro_batch_key(generator) == micro_batch_key(generator) < 2**40
    assert torch.equal(generator.get_state(), state)
