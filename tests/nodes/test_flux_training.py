"""Training a LoRA on ComfyUI's own (tiny) Flux: block forwards, gradients against finite
differences, the two forward paths, and reproducibility."""

from __future__ import annotations

import importlib

import pytest
import torch

from kt_testing.tiny_models import tiny_flux_patcher


@pytest.fixture(scope="module")
def ft(pack):
    return importlib.import_module(f"{pack.__name__}.nodes.flux_training")


@pytest.fixture(scope="module")
def Sample(pack):
    return importlib.import_module(f"{pack.__name__}.trainer_core.flow_step").Sample


def make_samples(Sample, count, reference_sizes, seed, dtype=torch.float32, target=(8, 8)):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return [
        Sample(randn(16, *target), randn(5, 48), randn(32), [randn(16, *size) for size in reference_sizes])
        for _ in range(count)
    ]


def comfy_forward(model, x, refs, context, y, sigma=0.6):
    """ComfyUI's own sampling-time call, through the patcher's options."""
    cond = {"c_crossattn": context, "y": y, "guidance": torch.tensor([1.0], dtype=x.dtype)}
    if refs:
        cond["ref_latents"] = refs
    options = {"transformer_options": model.model_options["transformer_options"]}
    with torch.no_grad():
        return model.model.apply_model(
            x, torch.tensor([sigma]), transformer_options=options["transformer_options"], **cond
        )


def test_out_of_place_blocks_reproduce_comfyui_blocks_exactly(ft, pack):
    flux_blocks = importlib.import_module(f"{pack.__name__}.nodes.flux_blocks")
    model = tiny_flux_patcher(seed=3)
    patched = model.clone()
    flux_blocks.install_trainable_blocks(patched, checkpointing=False)
    gen = torch.Generator().manual_seed(0)
    x, ref = torch.randn(2, 16, 8, 8, generator=gen), torch.randn(2, 16, 6, 8, generator=gen)
    context, y = torch.randn(2, 5, 48, generator=gen), torch.randn(2, 32, generator=gen)
    assert ("double_block", 1) in patched.model_options["transformer_options"]["patches_replace"]["dit"]
    assert torch.equal(
        comfy_forward(patched, x, [ref], context, y), comfy_forward(model, x, [ref], context, y)
    )


def _randomise_lora(session, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in session.lora.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * 0.05)


def _loss(session, samples):
    return session.loss(samples, torch.Generator().manual_seed(11))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("references", [0, 1, 2])
def test_lora_gradients_equal_finite_differences(ft, Sample, references, checkpointing):
    """Per LoRA layer, the derivative along that layer's own (normalised) gradient, which
    must equal the gradient's norm, against a fourth-order central difference (Richardson:
    (8 (f(h) - f(-h)) - (f(2h) - f(-2h))) / 12h). A wrong gradient points elsewhere and fails.

    The model is float64, but ComfyUI's rope rotates q and k in float32 whatever the model
    dtype, so the loss carries ~1e-9 relative rounding. h = 1e-2 keeps that rounding and the
    O(h^4) truncation far below the 1e-3 bound (measured worst case ~1e-4)."""
    model = tiny_flux_patcher(seed=5, dtype=torch.float64)
    samples = make_samples(Sample, 2, [(8, 6), (4, 8)][:references], seed=references, dtype=torch.float64)
    config = ft.TrainConfig(
        rank=3, alpha=1.5, targets="all_linear", gradient_checkpointing=checkpointing, seed=1
    )
    with ft.flux_lora_session(model, config) as session:
        _randomise_lora(session, seed=2)
        params = session.lora.parameters()
        assert {p.dtype for p in params} == {torch.float64}
        grads = torch.autograd.grad(_loss(session, samples), params)
        h, worst = 1e-2, 0.0
        for index in range(0, len(params), 2):  # (lora_A, lora_B) of one layer
            pair, pair_grads = params[index : index + 2], grads[index : index + 2]
            norm = float(torch.sqrt(sum((g * g).sum() for g in pair_grads)))
            assert norm > 1e-8  # every layer really receives a gradient
            directions = [g / norm for g in pair_grads]

            def shifted(step, pair=pair, directions=directions):
                with torch.no_grad():
                    for p, d in zip(pair, directions, strict=True):
                        p.add_(step * d)
                    value = float(_loss(session, samples))
                    for p, d in zip(pair, directions, strict=True):
                        p.sub_(step * d)
                return value

            numeric = (8 * (shifted(h) - shifted(-h)) - (shifted(2 * h) - shifted(-2 * h))) / (12 * h)
            worst = max(worst, abs(numeric - norm) / norm)
        assert worst <= 1e-3, f"relative error {worst:.2e}"


def test_checkpointing_gives_the_same_gradients(ft, Sample):
    model = tiny_flux_patcher(seed=6, dtype=torch.float64)
    samples = make_samples(Sample, 2, [(8, 6)], seed=4, dtype=torch.float64)
    grads = []
    for checkpointing in (False, True):
        config = ft.TrainConfig(rank=2, alpha=2.0, gradient_checkpointing=checkpointing)
        with ft.flux_lora_session(model, config) as session:
            _randomise_lora(session, seed=7)
            grads.append(torch.autograd.grad(_loss(session, samples), session.lora.parameters()))
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(plain, checkpointed, rtol=1e-12, atol=1e-14)


def test_padded_mixed_size_batch_equals_comfyui_call_per_sample(ft, Sample, pack):
    """The padded path (forward_orig + mask) must give each sample what ComfyUI's own Flux
    call gives it alone."""
    token_batch = importlib.import_module(f"{pack.__name__}.trainer_core.token_batch")
    model = tiny_flux_patcher(seed=8, dtype=torch.float64)
    first = make_samples(Sample, 1, [(8, 6)], seed=5, dtype=torch.float64)
    second = make_samples(Sample, 1, [(4, 8), (2, 2)], seed=6, dtype=torch.float64)
    config = ft.TrainConfig(rank=2, alpha=2.0, layout="dreamomni2")
    sigma = torch.tensor([0.3, 0.8], dtype=torch.float64)

    def predict(session, samples, sigma):
        batch = token_batch.build_token_batch(
            [s.target for s in samples], [s.references for s in samples], config.layout
        )
        context = torch.stack([s.context for s in samples])
        pooled = torch.stack([s.pooled for s in samples])
        return batch, session.predict(batch, sigma, context, pooled)

    with ft.flux_lora_session(model, config) as session:
        _randomise_lora(session, seed=9)
        with torch.no_grad():
            mixed, together = predict(session, first + second, sigma)
            assert not mixed.is_uniform()
            for i, sample in enumerate([first, second]):
                alone_batch, alone = predict(session, sample, sigma[i : i + 1])
                assert alone_batch.is_uniform()
                n = int(mixed.target[i].sum())
                torch.testing.assert_close(together[i, :n], alone[0, :n], rtol=1e-9, atol=1e-10)


def test_same_seed_same_losses_and_another_seed_differs(ft, Sample, pack):
    loop = importlib.import_module(f"{pack.__name__}.trainer_core.loop")
    flow_step = importlib.import_module(f"{pack.__name__}.trainer_core.flow_step")
    samples = make_samples(Sample, 4, [(8, 8)], seed=10)
    empty = flow_step.EmptyText(torch.zeros(5, 48), torch.zeros(32))

    def run(seed):
        model = tiny_flux_patcher(seed=11)
        config = ft.TrainConfig(
            steps=4,
            rank=4,
            alpha=4.0,
            dropout=0.1,
            caption_dropout=0.3,
            ip_noise_gamma=0.1,
            seed=seed,
            learning_rate=1e-3,
        )
        batches = iter([samples[:2], samples[2:]] * 2)
        with ft.flux_lora_session(model, config, empty_text=empty) as session:
            return loop.train(config, session.lora.parameters(), batches, session.loss).losses

    first = run(0)
    assert first == run(0)
    assert first != run(1)
