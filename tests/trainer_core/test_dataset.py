"""Building a dataset: sizes, the cache (hits, misses, each invalidation) and counted encoder
calls: a second pass never runs the encoders."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kt_testing.datasets import CountingEncoders, SampleEncoders, color_image, write_one_folder
from trainer_core.dataset import DatasetSettings, build_dataset
from trainer_core.dataset_files import scan_dataset
from trainer_core.encode_cache import EncodeCache


def build(root, cache_root, encoders, **settings):
    return build_dataset(
        scan_dataset(root), encoders.bundle(), EncodeCache(cache_root), DatasetSettings(**settings)
    )


@pytest.fixture
def folder(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b", "c"], references=2, size=(96, 64))
    (root / "c.txt").write_text("make a blue", encoding="utf-8")  # same caption as a
    return root


def test_first_pass_encodes_everything_once_second_pass_nothing(folder, tmp_path):
    first_encoders = CountingEncoders()
    first = build(folder, tmp_path / "cache", first_encoders, resolution=64, reference_resolution=32)
    assert first_encoders.image_calls == 9  # 3 targets + 6 references
    assert first_encoders.text_calls == 3  # 2 distinct captions + the empty prompt
    assert (first.encoded_images, first.encoded_texts) == (9, 3)

    second_encoders = CountingEncoders()
    second = build(folder, tmp_path / "cache", second_encoders, resolution=64, reference_resolution=32)
    assert (second_encoders.image_calls, second_encoders.text_calls) == (0, 0)
    assert second.cache.hits == 12 and second.cache.misses == 0
    assert second.content_hash == first.content_hash
    for a, b in zip(first.entries, second.entries, strict=True):
        sa, sb = first.sample(a), second.sample(b)
        assert torch.equal(sa.target, sb.target) and torch.equal(sa.context, sb.context)


def test_sizes_follow_the_size_rule(folder, tmp_path):
    dataset = build(folder, tmp_path / "cache", CountingEncoders(), resolution=64, reference_resolution=32)
    entry = dataset.entries[0]
    # 96x64 at 64: scale = 64 / sqrt(96 * 64) = 0.8165; 78.4 -> 80, 52.3 -> 48
    assert entry.target_size == (80, 48)
    # at 32: scale = 32 / sqrt(96 * 64) = 0.40825; 39.2 / 16 = 2.45 -> 32, 26.1 / 16 = 1.63 -> 32
    assert entry.reference_sizes == [(32, 32), (32, 32)]
    sample = dataset.sample(entry)
    assert sample.target.shape == (16, 48 // 8, 80 // 8)
    assert [r.shape for r in sample.references] == [(16, 4, 4), (16, 4, 4)]
    assert dataset.buckets() == {(80, 48): [0, 1, 2]}
    doubled = dataset.sample(entry, latent_in=lambda x: 2 * x)
    assert torch.equal(doubled.target, 2 * sample.target)


def test_each_change_invalidates_exactly_its_entries(folder, tmp_path):
    cache = tmp_path / "cache"
    build(folder, cache, CountingEncoders(), resolution=64, reference_resolution=32)

    # 1) one image's bytes change: that image only
    color_image(96, 64, seed=77).save(folder / "b_control_1.png")
    encoders = CountingEncoders()
    build(folder, cache, encoders, resolution=64, reference_resolution=32)
    assert (encoders.image_calls, encoders.text_calls) == (1, 0)

    # 2) one caption changes: that caption only
    (folder / "b.txt").write_text("make b red", encoding="utf-8")
    encoders = CountingEncoders()
    build(folder, cache, encoders, resolution=64, reference_resolution=32)
    assert (encoders.image_calls, encoders.text_calls) == (0, 1)

    # 3) the target size rule changes: the targets only (references keep their rule)
    encoders = CountingEncoders()
    build(folder, cache, encoders, resolution=128, reference_resolution=32)
    assert (encoders.image_calls, encoders.text_calls) == (3, 0)

    # 4) another VAE: every image, no text
    encoders = CountingEncoders(image_identity="vae-b")
    build(folder, cache, encoders, resolution=64, reference_resolution=32)
    assert (encoders.image_calls, encoders.text_calls) == (9, 0)

    # 5) another text encoder: every caption and the empty prompt, no image
    encoders = CountingEncoders(text_identity="text-b")
    build(folder, cache, encoders, resolution=64, reference_resolution=32)
    assert (encoders.image_calls, encoders.text_calls) == (0, 3)

    # 6) the transparency background (part of the pixels): every image
    encoders = CountingEncoders()
    build(folder, cache, encoders, resolution=64, reference_resolution=32, background=(0.0, 0.0, 0.0))
    assert encoders.image_calls == 9


def test_hold_out_is_seeded_and_bounded(folder, tmp_path):
    dataset = build(folder, tmp_path / "cache", CountingEncoders(), resolution=64, hold_out=1, seed=3)
    assert len(dataset.entries) == 2 and len(dataset.held_out) == 1
    again = build(folder, tmp_path / "cache", CountingEncoders(), resolution=64, hold_out=1, seed=3)
    assert [e.name for e in again.held_out] == [e.name for e in dataset.held_out]
    with pytest.raises(ValueError, match=r"^hold_out: 3 leaves none of the dataset's 3 sample\(s\) to train"):
        build(folder, tmp_path / "cache", CountingEncoders(), resolution=64, hold_out=3)


def test_empty_prompt_embedding_is_cached(folder, tmp_path):
    encoders = CountingEncoders()
    dataset = build(folder, tmp_path / "cache", encoders, resolution=64)
    expected_context, expected_pooled = CountingEncoders().encode_text("")
    empty = dataset.empty_text()
    assert torch.equal(empty.context, expected_context) and torch.equal(empty.pooled, expected_pooled)


def test_progress_reaches_the_total(folder, tmp_path):
    seen = []
    build_dataset(
        scan_dataset(folder),
        CountingEncoders().bundle(),
        EncodeCache(tmp_path / "cache"),
        dataclasses.replace(DatasetSettings(), resolution=64),
        progress=lambda done, total: seen.append((done, total)),
    )
    assert seen[-1] == (12, 12) and [d for d, _ in seen] == list(range(1, 13))


def test_a_familys_whole_sample_encoding_is_cached_per_sample_with_its_own_empty_prompt(folder, tmp_path):
    """`Encoders.encode_sample` (Qwen-Image-Edit's encoder node): each sample's text with its
    references, and its empty prompt with the same images but no latents; the references are the
    encoding's own latents (5-D here). Texts are keyed by the reference files, the caption and the
    text encoder, references by the files and the VAE, both by the encoding: each change
    re-encodes exactly what depends on it, and the VAE runs only for missing references."""
    cache = tmp_path / "cache"
    encoders = SampleEncoders()
    dataset = build(folder, cache, encoders, resolution=64, reference_resolution=32)
    captions = ["make a blue", "make b blue", "make a blue"]  # a and c share a caption, not their images
    with_images = sorted([(c, 2, True) for c in captions])
    texts_only, empties = sorted([(c, 2, False) for c in captions]), [("", 2, False)] * 3
    assert sorted(encoders.sample_calls) == sorted(with_images + empties)
    assert (encoders.image_calls, encoders.text_calls) == (3, 1)  # the targets; the dataset's empty prompt
    assert (dataset.encoded_images, dataset.encoded_texts) == (3 + 6, 6 + 1)
    a, b = (dataset.sample(e) for e in dataset.entries[:2])
    assert a.references[0].shape == (16, 1, 8, 12)  # the encoding's own, at the file's 96 x 64
    assert dataset.entries[0].reference_sizes == [(96, 64), (96, 64)]
    assert a.context.shape == (4 + 2, 8) and not torch.equal(a.empty.context, b.empty.context)
    assert torch.equal(a.empty.context[:4], CountingEncoders().encode_text("")[0])  # "" with a's images
    assert torch.equal(a.empty.context[4:], a.context[4:])

    def rebuild(**changes):
        encoders = SampleEncoders(**changes)
        build(folder, cache, encoders, resolution=64, reference_resolution=32)
        return sorted(encoders.sample_calls), encoders.image_calls

    assert rebuild() == ([], 0)
    color_image(96, 64, seed=77).save(folder / "b_control_1.png")  # b's text, empty prompt, references
    assert rebuild() == ([("", 2, False), ("make b blue", 2, True)], 0)
    (folder / "b.txt").write_text("make b red", encoding="utf-8")  # b's text only: no VAE
    assert rebuild() == ([("make b red", 2, False)], 0)
    captions[1] = "make b red"
    with_images = sorted([(c, 2, True) for c in captions])
    texts_only = sorted([(c, 2, False) for c in captions])
    assert rebuild(sample_identity="another ComfyUI") == (sorted(with_images + empties), 0)
    assert rebuild(text_identity="text-b") == (sorted(texts_only + empties), 0)
    assert rebuild(image_identity="vae-b") == (with_images, 3)  # the references and the targets
