"""FLUX's token batch: the generic padded batch with each sample's position ids, and the
attention mask of a padded batch."""

from __future__ import annotations

import pytest
import torch

from kt_testing.flux_ids import attention_bias, build_token_batch, image_position_ids

pytestmark = pytest.mark.usefixtures("comfy_runtime")


def test_each_sample_gets_its_layouts_ids_and_padding_gets_zero():
    gen = torch.Generator().manual_seed(0)
    small = (torch.randn(16, 4, 4, generator=gen), [torch.randn(16, 2, 4, generator=gen)])
    large = (
        torch.randn(16, 6, 4, generator=gen),
        [torch.randn(16, 4, 4, generator=gen), torch.randn(16, 2, 2, generator=gen)],
    )
    batch = build_token_batch([small[0], large[0]], [small[1], large[1]], "dreamomni2", pad_value=7.0)
    assert batch.tokens.shape == (2, 11, 64) and (batch.tokens[0, 6:] == 7.0).all()
    assert torch.equal(batch.ids[0, :6], image_position_ids((4, 4), [(2, 4)], "dreamomni2"))
    assert (batch.ids[0, 6:] == 0).all()
    assert torch.equal(batch.ids[1], image_position_ids((6, 4), [(4, 4), (2, 2)], "dreamomni2"))
    # a data-parallel process's rows keep their ids
    assert torch.equal(batch.rows([1]).ids, batch.ids[1:2])


def test_attention_bias_blocks_padding_both_ways():
    valid = torch.tensor([[True, True, False], [True, True, True]])
    bias = attention_bias(valid, text_tokens=2)
    blocked = bias < -1e30
    assert bias.shape == (2, 5, 5)
    # sample 0: image token 2 (sequence position 4) is padding
    assert blocked[0, :4, 4].all(), "nothing real attends to padding"
    assert blocked[0, 4, :4].all() and not blocked[0, 4, 4], "padding attends only to itself"
    assert not blocked[0, :4, :4].any()
    assert not blocked[1].any()
    assert attention_bias(torch.ones(2, 3, dtype=torch.bool), text_tokens=2) is None
