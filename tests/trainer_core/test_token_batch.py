"""Packing latents of any rank, padding and cutting mixed-size batches (the generic part; FLUX's
ids and attention mask: `tests/families/flux/test_flux_token_batch.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from trainer_core.token_batch import TokenBatch, build_token_batch, pack_latent, unpack_tokens


def test_pack_latent_puts_each_2x2_patch_in_one_token():
    latent = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(1, 2, 4, 6)
    tokens = pack_latent(latent)
    assert tokens.shape == (1, 6, 8)
    # token (row 1, col 2) = patch latent[:, 2:4, 4:6], channels outermost, then ph, pw
    expected = latent[0, :, 2:4, 4:6].reshape(-1)
    assert torch.equal(tokens[0, 1 * 3 + 2], expected)
    assert torch.equal(unpack_tokens(tokens, (2, 4, 6)), latent)


def test_a_video_latent_packs_frame_by_frame_as_comfyuis_qwen_image_does():
    """(B, C, T, H, W): the tokens of frame 0 in raster order, then frame 1's, each a 2x2 patch
    with channels outermost: ComfyUI's `QwenImageTransformer2DModel.process_img`, written out."""
    latent = torch.randn(2, 3, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    tokens = pack_latent(latent)
    assert tokens.shape == (2, 2 * 2 * 3, 3 * 4)
    for b in range(2):
        for t in range(2):
            for row in range(2):
                for col in range(3):
                    patch = latent[b, :, t, 2 * row : 2 * row + 2, 2 * col : 2 * col + 2].reshape(-1)
                    assert torch.equal(tokens[b, t * 6 + row * 3 + col], patch)
    assert torch.equal(unpack_tokens(tokens, (3, 2, 4, 6)), latent)
    # one frame: the same tokens as the 4-D latent
    assert torch.equal(pack_latent(latent[:, :, :1]), pack_latent(latent[:, :, 0]))


def test_pack_latent_refuses_odd_sizes():
    with pytest.raises(ValueError, match="multiples of 16 pixels"):
        pack_latent(torch.zeros(1, 16, 5, 4))


def test_build_token_batch_pads_and_marks_tokens():
    gen = torch.Generator().manual_seed(0)
    small = (torch.randn(16, 1, 4, 4, generator=gen), [torch.randn(16, 1, 2, 4, generator=gen)])
    large = (
        torch.randn(16, 1, 6, 4, generator=gen),
        [torch.randn(16, 1, 4, 4, generator=gen), torch.randn(16, 1, 2, 2, generator=gen)],
    )
    batch = build_token_batch([small[0], large[0]], [small[1], large[1]], pad_value=7.0)
    # small: 4 + 2 tokens; large: 6 + 4 + 1 tokens
    assert batch.tokens.shape == (2, 11, 64)
    assert batch.valid.sum(1).tolist() == [6, 11] and batch.target.sum(1).tolist() == [4, 6]
    assert (batch.tokens[0, 6:] == 7.0).all()
    assert batch.shapes[1] == [(16, 1, 6, 4), (16, 1, 4, 4), (16, 1, 2, 2)]
    assert batch.target_sizes == [(4, 4), (6, 4)] and batch.reference_sizes[1] == [(4, 4), (2, 2)]
    assert not batch.is_uniform()
    # target tokens come back as the original latents, rank kept
    for original, recovered in zip([small[0], large[0]], batch.target_latents(batch.tokens), strict=True):
        assert torch.equal(original, recovered)
    # a sample alone: its real tokens, unpadded, split into the latents a model takes
    alone = batch.sample(0)
    assert alone.tokens.shape == (1, 6, 64) and alone.is_uniform()
    target, references = alone.split_latents(alone.tokens)
    assert torch.equal(target[0], small[0]) and torch.equal(references[0][0], small[1][0])


@dataclass
class WithIds(TokenBatch):
    ids: torch.Tensor = field(kw_only=True)  # (B, L, 2): a family's own per-token field
    note: str = "kept"


def test_rows_and_sample_cut_a_familys_own_fields_with_the_tokens():
    gen = torch.Generator().manual_seed(1)
    targets = [torch.randn(4, 2, 2, generator=gen), torch.randn(4, 4, 2, generator=gen)]
    base = build_token_batch(targets, [[], []])
    ids = torch.arange(2 * 2 * 2, dtype=torch.float32).reshape(2, 2, 2)
    batch = WithIds(**{f: getattr(base, f) for f in base.__dataclass_fields__}, ids=ids)
    row = batch.rows([1])
    assert isinstance(row, WithIds) and row.note == "kept"
    assert torch.equal(row.ids, ids[1:2]) and torch.equal(row.tokens, batch.tokens[1:2])
    assert row.shapes == [batch.shapes[1]]
    assert row.is_uniform() is False  # rows of a padded batch stay padded
    first = batch.sample(0)  # 1 real token of 2
    assert torch.equal(first.ids, ids[:1, :1]) and first.tokens.shape[1] == 1 and first.is_uniform()
    # a tensor that is not per token cannot be cut with them
    with pytest.raises(TypeError, match=r"WithIds.ids is not \(batch, tokens, ...\)"):
        WithIds(**{f: getattr(base, f) for f in base.__dataclass_fields__}, ids=torch.zeros(2)).rows([0])
