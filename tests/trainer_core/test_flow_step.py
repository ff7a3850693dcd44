"""One objective evaluation, checked against the rectified-flow formulas written out here.

The random draws follow the documented order (sigma normal + uniform per sample, noise for
the whole token batch, perturbation if ip_noise_gamma, caption-dropout uniform), so an
independent generator with the same seed reproduces them.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from trainer_core.config import TrainConfig
from trainer_core.flow_step import EmptyText, Sample, flow_matching_loss
from trainer_core.token_batch import pack_latent


def make_sample(gen, size=(4, 4), refs=((4, 2),), text=3):
    return Sample(
        target=torch.randn(16, *size, generator=gen),
        context=torch.randn(text, 8, generator=gen),
        pooled=torch.randn(5, generator=gen),
        references=[torch.randn(16, *r, generator=gen) for r in refs],
    )


class Recorder:
    """A predictor that remembers its inputs and answers a fixed velocity guess (zero)."""

    def __call__(self, batch, sigma, context, pooled):
        self.batch, self.sigma, self.context, self.pooled = batch, sigma, context, pooled
        return torch.zeros_like(batch.tokens)


def test_noisy_targets_clean_references_and_loss_by_hand():
    gen = torch.Generator().manual_seed(0)
    samples = [make_sample(gen), make_sample(gen, refs=((2, 4),))]
    config = TrainConfig(timestep_sampler="uniform", loss_weighting="none")
    recorder = Recorder()
    loss = flow_matching_loss(recorder, samples, config, torch.Generator().manual_seed(5))

    draws = torch.Generator().manual_seed(5)
    torch.randn(2, generator=draws)
    sigma = torch.rand(2, generator=draws)  # uniform sampler: sigma is the uniform draw
    length = 4 + 2  # 2x2 patches: 4 target tokens + 2 reference tokens per sample
    noise = torch.randn(2, length, 64, generator=draws)
    torch.testing.assert_close(recorder.sigma, sigma)
    expected_loss = 0.0
    for i, sample in enumerate(samples):
        x0 = pack_latent(sample.target[None])[0]
        ref = pack_latent(sample.references[0][None])[0]
        s = float(sigma[i])
        # target tokens: x_t = (1 - s) x0 + s noise; reference tokens: untouched
        torch.testing.assert_close(recorder.batch.tokens[i, :4], (1 - s) * x0 + s * noise[i, :4])
        assert torch.equal(recorder.batch.tokens[i, 4:], ref)
        # a zero prediction leaves |noise - x0|^2 averaged over the target tokens only
        expected_loss += float(((noise[i, :4] - x0) ** 2).mean()) / 2
    assert math.isclose(float(loss), expected_loss, rel_tol=1e-6)
    assert torch.equal(recorder.context, torch.stack([s.context for s in samples]))


def test_flux_shift_uses_each_samples_own_token_count():
    gen = torch.Generator().manual_seed(1)
    samples = [make_sample(gen, size=(4, 4), refs=()), make_sample(gen, size=(8, 8), refs=())]
    recorder = Recorder()
    flow_matching_loss(
        recorder, samples, TrainConfig(timestep_sampler="flux_shift"), torch.Generator().manual_seed(2)
    )
    normal = torch.randn(2, generator=torch.Generator().manual_seed(2))
    for i, tokens in enumerate((4, 16)):
        base = 1 / (1 + math.exp(-float(normal[i])))
        mu = 0.5 + (1.15 - 0.5) * (tokens - 256) / (4096 - 256)
        expected = math.exp(mu) / (math.exp(mu) + 1 / base - 1)
        assert math.isclose(float(recorder.sigma[i]), expected, rel_tol=1e-5)


def test_each_run_of_one_caption_length_seeds_lora_dropout_with_its_first_global_row():
    """LoRA dropout's masks belong to (micro-batch, global row) (`lora_dropout`): each forward
    starts torch's seed at its first row's place, so a row gets its mask whether the batch runs
    in one forward, in runs of one caption length, or spread over processes (`rows`)."""
    from trainer_core.lora_dropout import ROW_BITS, micro_batch_key

    gen = torch.Generator().manual_seed(9)
    samples = [make_sample(gen, refs=(), text=length) for length in (3, 3, 4)]
    config = TrainConfig(timestep_sampler="uniform", loss_weighting="none", dropout=0.1)
    key = micro_batch_key(torch.Generator().manual_seed(5))
    seeds = []

    def predict(batch, sigma, context, pooled):
        seeds.append(torch.initial_seed())
        return torch.zeros_like(batch.tokens)

    whole = flow_matching_loss(predict, samples, config, torch.Generator().manual_seed(5))
    assert seeds == [key << ROW_BITS | 0, key << ROW_BITS | 2]
    seeds.clear()
    parts = [
        flow_matching_loss(predict, samples, config, torch.Generator().manual_seed(5), rows=rows)
        for rows in (slice(0, 2), slice(2, 3))
    ]
    assert seeds == [key << ROW_BITS | 0, key << ROW_BITS | 2]
    assert math.isclose(float(sum(parts)), float(whole), rel_tol=1e-6)


def test_the_token_shift_is_the_one_given_for_the_model():
    """A family's own points (`ModelFamily.token_shift`; here Qwen-Image's, musubi-tuner's
    qwen_shift: 256 -> 0.5, 8192 -> 0.9) reach the sampler, written as musubi-tuner writes it:
    shift = e^mu, t' = shift t / (1 + (shift - 1) t)."""
    from trainer_core.objective import QWEN_TOKEN_SHIFT_POINTS

    gen = torch.Generator().manual_seed(1)
    samples = [make_sample(gen, size=(4, 4), refs=()), make_sample(gen, size=(8, 8), refs=())]
    config = TrainConfig(timestep_sampler="flux_shift")
    qwen, flux = Recorder(), Recorder()
    qwen_points = QWEN_TOKEN_SHIFT_POINTS
    flow_matching_loss(qwen, samples, config, torch.Generator().manual_seed(2), token_shift=qwen_points)
    flow_matching_loss(flux, samples, config, torch.Generator().manual_seed(2))
    normal = torch.randn(2, generator=torch.Generator().manual_seed(2))
    for i, tokens in enumerate((4, 16)):
        t = 1 / (1 + math.exp(-float(normal[i])))
        shift = math.exp(0.5 + (0.9 - 0.5) * (tokens - 256) / (8192 - 256))
        assert math.isclose(float(qwen.sigma[i]), shift * t / (1 + (shift - 1) * t), rel_tol=1e-5)
    assert not torch.allclose(qwen.sigma, flux.sigma)


def test_weighting_multiplies_each_samples_error():
    gen = torch.Generator().manual_seed(3)
    samples = [make_sample(gen)]
    plain = flow_matching_loss(
        Recorder(), samples, TrainConfig(loss_weighting="none"), torch.Generator().manual_seed(4)
    )
    recorder = Recorder()
    weighted = flow_matching_loss(
        recorder, samples, TrainConfig(loss_weighting="cosmap"), torch.Generator().manual_seed(4)
    )
    s = float(recorder.sigma[0])
    assert math.isclose(float(weighted), float(plain) * 2 / (math.pi * (1 - 2 * s + 2 * s * s)), rel_tol=1e-5)


def test_ip_noise_gamma_perturbs_the_input_but_not_the_target():
    gen = torch.Generator().manual_seed(6)
    samples = [make_sample(gen, refs=())]
    recorder = Recorder()
    config = TrainConfig(timestep_sampler="uniform", ip_noise_gamma=0.5)
    loss = flow_matching_loss(recorder, samples, config, torch.Generator().manual_seed(7))
    draws = torch.Generator().manual_seed(7)
    torch.randn(1, generator=draws)
    s = float(torch.rand(1, generator=draws))
    noise = torch.randn(1, 4, 64, generator=draws)
    perturbation = torch.randn(1, 4, 64, generator=draws)
    x0 = pack_latent(samples[0].target[None])
    torch.testing.assert_close(recorder.batch.tokens, (1 - s) * x0 + s * (noise + 0.5 * perturbation))
    assert math.isclose(float(loss), float(((noise - x0) ** 2).mean()), rel_tol=1e-6)


def test_caption_dropout_swaps_in_the_empty_prompt():
    gen = torch.Generator().manual_seed(8)
    samples = [make_sample(gen), make_sample(gen)]
    empty = EmptyText(torch.full((3, 8), 7.0), torch.full((5,), -7.0))
    recorder = Recorder()
    flow_matching_loss(
        recorder, samples, TrainConfig(caption_dropout=1.0), torch.Generator().manual_seed(0), empty
    )
    assert torch.equal(recorder.context, torch.full((2, 3, 8), 7.0))
    assert torch.equal(recorder.pooled, torch.full((2, 5), -7.0))
    with pytest.raises(ValueError, match="empty-prompt embedding"):
        flow_matching_loss(Recorder(), samples, TrainConfig(caption_dropout=0.5), torch.Generator())


class Calls:
    """A predictor that remembers every call's inputs and answers zero."""

    def __init__(self):
        self.calls = []

    def __call__(self, batch, sigma, context, pooled):
        self.calls.append((batch, sigma, context))
        return torch.zeros_like(batch.tokens)


def test_captions_of_different_lengths_train_one_length_per_forward():
    """ComfyUI's T5 keeps a caption over 256 tokens longer than the others, and FLUX has no text
    mask: the batch's rows go through the model in runs of one caption length (here 3, 3, 4:
    two forwards), each row with its own draws of the whole batch, and the loss is the whole
    batch's mean (by hand, as above). On 5417af8 such a batch stopped the run."""
    gen = torch.Generator().manual_seed(9)
    samples = [make_sample(gen, refs=(), text=length) for length in (3, 3, 4)]
    calls = Calls()
    config = TrainConfig(timestep_sampler="uniform", loss_weighting="none")
    loss = flow_matching_loss(calls, samples, config, torch.Generator().manual_seed(5))
    assert [tuple(c[2].shape[:2]) for c in calls.calls] == [(2, 3), (1, 4)]
    draws = torch.Generator().manual_seed(5)
    torch.randn(3, generator=draws)
    sigma = torch.rand(3, generator=draws)
    noise = torch.randn(3, 4, 64, generator=draws)
    torch.testing.assert_close(torch.cat([c[1] for c in calls.calls]), sigma)
    errors = [(noise[i] - pack_latent(sample.target[None])[0]) ** 2 for i, sample in enumerate(samples)]
    expected = sum(float(error.mean()) for error in errors) / 3
    assert math.isclose(float(loss), expected, rel_tol=1e-6)


def test_caption_dropout_works_when_the_empty_prompt_has_another_length():
    gen = torch.Generator().manual_seed(10)
    long_caption = [make_sample(gen, text=6)]  # a caption T5 encoded longer than the empty prompt
    empty = EmptyText(torch.full((3, 8), 7.0), torch.full((5,), -7.0))
    recorder = Recorder()
    flow_matching_loss(recorder, long_caption, TrainConfig(caption_dropout=1.0), torch.Generator(), empty)
    assert recorder.context.shape == (1, 3, 8)


def test_a_dropped_caption_takes_the_samples_own_empty_prompt_where_it_has_one():
    """Qwen-Image-Edit's empty prompt keeps the sample's images: each sample's own, and the
    dataset's one for a sample without."""
    gen = torch.Generator().manual_seed(12)
    samples = [make_sample(gen), make_sample(gen)]
    samples[0] = dataclasses.replace(
        samples[0], empty=EmptyText(torch.full((3, 8), 1.0), torch.full((5,), 2.0))
    )
    shared = EmptyText(torch.full((3, 8), 3.0), torch.full((5,), 4.0))
    recorder = Recorder()
    flow_matching_loss(recorder, samples, TrainConfig(caption_dropout=1.0), torch.Generator(), shared)
    assert recorder.context[0].eq(1.0).all() and recorder.context[1].eq(3.0).all()
    with pytest.raises(ValueError, match="caption dropout needs the cached empty-prompt embedding"):
        flow_matching_loss(Recorder(), samples, TrainConfig(caption_dropout=1.0), torch.Generator())


def test_reference_dropout_draws_first_and_drops_whole_samples_references():
    gen = torch.Generator().manual_seed(11)
    samples = [make_sample(gen, refs=((4, 2), (2, 2))) for _ in range(6)]
    config = TrainConfig(timestep_sampler="uniform", reference_dropout=0.5)
    recorder = Recorder()
    flow_matching_loss(recorder, samples, config, torch.Generator().manual_seed(1))
    # the first draw of the step: one uniform per sample, dropped where it is below the rate
    dropped = (torch.rand(6, generator=torch.Generator().manual_seed(1)) < 0.5).tolist()
    assert 0 < sum(dropped) < 6  # this seed drops some and keeps some
    for i, drop in enumerate(dropped):
        # 4 target tokens; kept references add 2 + 1 tokens (padded batch: invalid rows follow)
        valid = int(recorder.batch.valid[i].sum())
        assert valid == (4 if drop else 7)
        assert int(recorder.batch.target[i].sum()) == 4


def test_reference_dropout_one_trains_as_text_to_image_and_zero_draws_nothing():
    gen = torch.Generator().manual_seed(12)
    samples = [make_sample(gen)]
    plain = Sample(samples[0].target, samples[0].context, samples[0].pooled, [])
    for rate, reference in ((1.0, None), (0.0, samples[0])):
        recorder = Recorder()
        generator = torch.Generator().manual_seed(4)
        loss = flow_matching_loss(recorder, samples, TrainConfig(reference_dropout=rate), generator)
        # the same step as the sample without references (rate 1) or as before the feature
        # existed (rate 0: no extra draw, so the same noise and sigma)
        expected_recorder = Recorder()
        expected_generator = torch.Generator().manual_seed(4)
        if reference is None:
            torch.rand(1, generator=expected_generator)  # rate 1 still draws its uniform
        expected = flow_matching_loss(
            expected_recorder, [plain if reference is None else reference], TrainConfig(), expected_generator
        )
        assert torch.equal(recorder.batch.tokens, expected_recorder.batch.tokens)
        assert float(loss) == float(expected)
        assert torch.equal(generator.get_state(), expected_generator.get_state())
