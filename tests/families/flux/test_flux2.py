"""FLUX.2 [dev] on a tiny model built through ComfyUI's own classes (`comfy.supported_models.
Flux2`, as ComfyUI's detection configures it): our ids against the ids ComfyUI's FLUX.2
forward embeds, text ids included; our training forward against ComfyUI's forward and its
sampling call (the text padded to 512 tokens as `model_base.Flux2.extra_conds` does); stock
sampling through MultiImageConditioning's MODEL; refusals for what does not fit.

Gradients, the LoRA file through the stock loader, the shared MODEL after training and the
synthetic edit set run for both families in test_flux_training.py / test_lora_training_model.py.
"""

from __future__ import annotations

import contextlib
import importlib
import re

import pytest
import torch

from kt_testing.executor import run_node
from kt_testing.flux_ids import build_token_batch, flux2_grid, image_position_ids, text_position_ids
from kt_testing.graphs import ksampler_inputs
from kt_testing.probes import flux2_forward, flux2_inputs, tiny_samples
from kt_testing.tiny_models import small_flux2_vae, tiny_flux2_patcher, tiny_flux_patcher

pytestmark = pytest.mark.usefixtures("comfy_runtime")

# Latent (H, W) sizes of references of different sizes and aspect ratios (1x1 patches).
REFERENCE_SETS = {
    1: [(8, 12)],
    2: [(8, 8), (6, 10)],
    3: [(10, 6), (4, 8), (8, 8)],
}


@pytest.fixture(scope="module")
def flux2(comfy_runtime):
    return tiny_flux2_patcher(seed=3)


@contextlib.contextmanager
def captured_ids(diffusion_model):
    """Every (B, T + L, axes) id tensor Flux's RoPE embeds (`pe_embedder`'s input: text ids,
    then image ids, after any post_input patch)."""
    calls: list[torch.Tensor] = []
    handle = diffusion_model.pe_embedder.register_forward_pre_hook(
        lambda module, args: calls.append(args[0].detach().clone())
    )
    try:
        yield calls
    finally:
        handle.remove()


def test_comfyui_detects_the_tiny_model_as_flux2(flux2, pack):
    family = pack.comfy_adapter.model_family
    assert family.family_of(flux2).title == "FLUX.2"
    grid = family.family_of(flux2).token_grid(flux2.model.diffusion_model)  # the pack's own TokenGrid class
    assert (grid.patch_size, grid.axes, grid.ref_index_scale) == (1, 4, 10.0)
    assert type(flux2.model).__name__ == "Flux2" and flux2.model.diffusion_model.params.global_modulation


@pytest.mark.parametrize("count", sorted(REFERENCE_SETS))
@pytest.mark.parametrize("layout", ["index", "offset", "uxo"])
@torch.no_grad()
def test_ids_and_output_equal_comfyuis_own_flux2_forward(flux2, pack, layout, count):
    """ComfyUI's FLUX.2 forward (no patch of ours) builds 4-axis ids: text tokens count on the
    4th axis, image tokens carry (index, row, column, 0). Ours give the same values, and our
    padded-batch forward (per-sample ids, `forward_orig`) gives the same output."""
    flux = flux2.model.diffusion_model
    target, refs = (6, 8), REFERENCE_SETS[count]
    inputs = flux2_inputs(target, refs, seed=count)
    with captured_ids(flux) as calls:
        expected = flux2_forward(flux, inputs, layout)
    (theirs,) = calls
    ours = torch.cat([text_position_ids(1, 7, 4)[0], image_position_ids(target, refs, layout, flux2_grid())])
    assert theirs.shape == (1, 7 + 48 + sum(h * w for h, w in refs), 4)
    assert torch.equal(theirs[0], ours)

    batch = build_token_batch([inputs["x"][0]], [[r[0] for r in inputs["refs"]]], layout, flux2_grid())
    tokens = importlib.import_module(
        f"{pack.__name__}.comfy_adapter.families.flux.reference_ids"
    ).forward_token_batch(flux, batch, inputs["timestep"], inputs["context"], None, inputs["guidance"])
    (got,) = batch.target_latents(tokens)
    assert (got - expected[0]).abs().max() <= 1e-6


@torch.no_grad()
def test_mixed_size_flux2_batch_matches_each_sample_alone(flux2, pack):
    flux = flux2.model.diffusion_model
    samples = [((6, 8), [(8, 8), (6, 10)]), ((8, 4), [(4, 4), (10, 6)]), ((4, 4), [(8, 12), (2, 2)])]
    singles = [flux2_inputs(t, r, seed=10 + i) for i, (t, r) in enumerate(samples)]
    for single in singles[1:]:
        single["context"] = singles[0]["context"]
    batch = build_token_batch(
        [s["x"][0] for s in singles], [[r[0] for r in s["refs"]] for s in singles], "index", flux2_grid()
    )
    assert not batch.valid.all(), "the samples must really differ in length"
    tokens = importlib.import_module(
        f"{pack.__name__}.comfy_adapter.families.flux.reference_ids"
    ).forward_token_batch(
        flux,
        batch,
        torch.full((3,), 0.6),
        singles[0]["context"].expand(3, -1, -1),
        None,
        torch.full((3,), 4.0),
    )
    for i, single in enumerate(singles):
        expected = flux2_forward(flux, single, "index")[0]
        assert (batch.target_latents(tokens)[i] - expected).abs().max() <= 1e-5, i


def test_training_prediction_is_comfyuis_sampling_call_with_its_text(ft, pack):
    """session.predict on a sample prepared as training prepares it (`SampleCache`: the
    caption through `model_family.text_in`) gives the velocity ComfyUI's `apply_model` implies
    for the conditioning sampling builds (`model_base.Flux2.extra_conds`: text padded to 512
    tokens at the front, references, guidance), float64."""
    Sample = importlib.import_module(f"{pack.__name__}.trainer_core.flow_step").Sample
    model = tiny_flux2_patcher(seed=15, dtype=torch.float64)
    (sample,) = tiny_samples(Sample, 1, 16, [(8, 6), (6, 8)], torch.float64, channels=128, pooled=0)
    sigma = torch.tensor([0.45], dtype=torch.float64)
    refs = [r[None] for r in sample.references]
    conds = model.model.extra_conds(
        cross_attn=sample.context[None], pooled_output=None, reference_latents=refs, guidance=4.0
    )
    kwargs = {name: cond.cond for name, cond in conds.items()}
    assert kwargs["c_crossattn"].shape == (1, 512, 48) and "y" not in kwargs
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])
    # float64: comfy-kitchen's fused RoPE (ComfyUI 0.33's sampling) has no float64 kernel, so the
    # reference takes ComfyUI's eager RoPE, the one training uses (no-op on 0.3.75)
    with torch.no_grad(), comfy_training_mode(pack):
        denoised = model.model.apply_model(sample.target[None], sigma, **kwargs)
    expected = (sample.target[None] - denoised) / sigma
    context = pack.comfy_adapter.model_family.text_in(model.model)(sample.context)
    config = ft.TrainConfig(rank=2, alpha=2.0, guidance=4.0, layout="index")
    with ft.lora_session(model, config) as session, torch.no_grad():
        batch = build_token_batch([sample.target], [sample.references], "index", flux2_grid())
        got = session.predict(batch, sigma, context[None], sample.pooled[None])
        unpadded = session.predict(batch, sigma, sample.context[None], sample.pooled[None])
    rows = expected.shape[-2] * expected.shape[-1]
    expected_tokens = expected.flatten(2).transpose(1, 2)  # 1x1 patches: a token per latent pixel
    # apply_model casts the model output to float32 before forming `denoised`: fp32 tolerance.
    torch.testing.assert_close(got[:, :rows], expected_tokens, rtol=1e-5, atol=1e-6)
    assert (unpadded[:, :rows] - expected_tokens).abs().max() > 1e-4  # the padding matters


def image(height, width, seed=0):
    return torch.rand(1, height, width, 3, generator=torch.Generator().manual_seed(seed))


def ksampler(model, conditioning, latent_hw=(4, 4)):
    """A stock KSampler, 2 euler steps at cfg 1, through ComfyUI's executor: (latent, ids)."""
    latent = {"samples": torch.zeros(1, 128, *latent_hw)}
    inputs = ksampler_inputs(model, conditioning, latent)
    with captured_ids(model.model.diffusion_model) as calls:
        (out,) = run_node("KSampler", inputs).outputs
    assert torch.isfinite(out["samples"]).all()
    return out["samples"], calls


@pytest.fixture(scope="module")
def conditioning(comfy_runtime):
    gen = torch.Generator().manual_seed(5)
    # FLUX.2: ComfyUI's text encoders give pooled_output None (its Mistral has no pooled output)
    return [[torch.randn(1, 7, 48, generator=gen), {"pooled_output": None}]]


def multi_image(pack, model, conditioning, layout, *images, validate=True):
    inputs = {
        "model": model,
        "conditioning": conditioning,
        "vae": small_flux2_vae(seed=1),
        "layout": layout,
        "reference_resolution": 0,
        **{f"image_{i}": img for i, img in enumerate(images, start=1)},
    }
    node = pack.nodes.multi_image_conditioning.MultiImageConditioning
    return run_node(node, inputs, validate=validate).outputs


def hand_ids(rows, cols, index):
    return torch.tensor([[index, r, c, 0.0] for r in range(rows) for c in range(cols)])


@pytest.mark.parametrize("layout", ["index", "offset"])
def test_multi_image_conditioning_samples_flux2_like_comfyuis_own_model(flux2, pack, conditioning, layout):
    """The crash of the issue: a stock KSampler on MultiImageConditioning's MODEL with a FLUX.2
    model. It now samples exactly what ComfyUI's own MODEL samples from the same conditioning,
    with FLUX.2's ids: 512 padded text tokens counted on the 4th axis, then the target and the
    references (64x64 -> 4x4 latent tokens, 48x96 -> 3x6; index layout: 10 and 20)."""
    model, cond = multi_image(pack, flux2, conditioning, layout, image(64, 64), image(48, 96, seed=1))
    assert [tuple(t.shape) for t in cond[0][1]["reference_latents"]] == [(1, 128, 4, 4), (1, 128, 3, 6)]
    ours, calls = ksampler(model, cond)
    theirs, stock_calls = ksampler(flux2, cond)
    assert torch.equal(ours, theirs)
    assert len(calls) == 2 and all(torch.equal(a, b) for a, b in zip(calls, stock_calls, strict=True))
    text = text_position_ids(1, 512, 4)[0]
    if layout == "index":
        expected = torch.cat([text, hand_ids(4, 4, 0.0), hand_ids(4, 4, 10.0), hand_ids(3, 6, 20.0)])
        assert torch.equal(calls[0][0], expected)


def test_what_does_not_fit_flux2_is_refused_before_sampling(flux2, pack, conditioning):
    fits = r"layout 'dreamomni2' does not fit a FLUX\.2 model; choose one of index"
    with pytest.raises(ValueError, match=fits):
        multi_image(pack, flux2, conditioning, "dreamomni2", image(64, 64))
    other = tiny_flux_patcher(seed=0)
    other.model.model_config.unet_config = {**other.model.model_config.unet_config, "image_model": "chroma"}
    family = r"MultiImageConditioning's model is a chroma model; Kontext Trainer"
    with pytest.raises(ValueError, match=family):
        multi_image(pack, other, conditioning, "offset", image(64, 64))


# Tiny models with the detection's tell-tales (comfy/model_detection.py in 0.33): LongCat-Image
# runs as "flux" with a 3584-wide text input and no pooled vector. Everything else is the tiny
# model's own.
VARIANTS = {
    "LongCat-Image": lambda: tiny_flux_patcher(seed=0, context_in_dim=3584, vec_in_dim=None),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_models_that_share_a_familys_image_model_are_refused_by_name(pack, conditioning, name):
    """MultiImageConditioning (in the executor) and TrainLoRA's first check on the MODEL
    (`check_model_fits`, before any training) refuse them, naming the model."""
    from types import SimpleNamespace

    model = VARIANTS[name]()
    message = rf"is {re.escape(name)}, which ComfyUI runs with its FLUX\.\d code; Kontext Trainer trains"
    layout = "offset"
    with pytest.raises(ValueError, match=message):
        multi_image(pack, model, conditioning, layout, image(64, 64))
    model_family = importlib.import_module(f"{pack.__name__}.comfy_adapter.model_family")
    with pytest.raises(ValueError, match=message):
        model_family.check_model_fits(model, SimpleNamespace(entries=[]), layout)


def comfy_training_mode(pack):
    return importlib.import_module(f"{pack.__name__}.comfy_adapter.trainable_blocks").comfy_training_mode(
        True
    )
