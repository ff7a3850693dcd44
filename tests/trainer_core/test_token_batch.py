"""Packing, padding and masks for mixed-size batches."""

from __future__ import annotations

import pytest
import torch

from trainer_core.position_ids import image_position_ids
from trainer_core.token_batch import attention_bias, build_token_batch, pack_latent, unpack_tokens


def test_pack_latent_puts_each_2x2_patch_in_one_token():
    latent = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(1, 2, 4, 6)
    tokens = pack_latent(latent)
    assert tokens.shape == (1, 6, 8)
    # token (row 1, col 2) = patch latent[:, 2:4, 4:6], channels outermost, then ph, pw
    expected = latent[0, :, 2:4, 4:6].reshape(-1)
    assert torch.equal(tokens[0, 1 * 3 + 2], expected)
    assert torch.equal(unpack_tokens(tokens, 4, 6), latent)


def test_pack_latent_refuses_odd_sizes():
    with pytest.raises(ValueError, match="multiples of 16 pixels"):
        pack_latent(torch.zeros(1, 16, 5, 4))


def test_build_token_batch_pads_and_marks_tokens():
    gen = torch.Generator().manual_seed(0)
    small = (torch.randn(16, 4, 4, generator=gen), [torch.randn(16, 2, 4, generator=gen)])
    large = (
        torch.randn(16, 6, 4, generator=gen),
        [torch.randn(16, 4, 4, generator=gen), torch.randn(16, 2, 2, generator=gen)],
    )
    batch = build_token_batch([small[0], large[0]], [small[1], large[1]], "dreamomni2", pad_value=7.0)
    # small: 4 + 2 tokens; large: 6 + 4 + 1 tokens
    assert batch.tokens.shape == (2, 11, 64)
    assert batch.valid.sum(1).tolist() == [6, 11] and batch.target.sum(1).tolist() == [4, 6]
    assert (batch.tokens[0, 6:] == 7.0).all() and (batch.ids[0, 6:] == 0).all()
    assert torch.equal(batch.ids[1], image_position_ids((6, 4), [(4, 4), (2, 2)], "dreamomni2"))
    # target tokens come back as the original latents
    for original, recovered in zip([small[0], large[0]], batch.target_latents(batch.tokens), strict=True):
        assert torch.equal(original, recovered)


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
