"""Our reference ids and training path against ComfyUI's own Flux forward (tiny Flux)."""

from __future__ import annotations

import importlib

import pytest
import torch

from kt_testing.capture import captured_image_ids
from kt_testing.flux_ids import COMFY_NATIVE_LAYOUTS, TokenGrid, build_token_batch, image_position_ids

pytestmark = pytest.mark.usefixtures("comfy_runtime")

# Latent (H, W) sizes; references of different sizes and aspect ratios.
REFERENCE_SETS = {
    1: [(8, 12)],
    2: [(8, 8), (6, 10)],
    3: [(10, 6), (4, 8), (8, 8)],
}


@pytest.fixture(scope="module")
def flux(comfy_runtime):
    from kt_testing.tiny_models import tiny_flux_patcher

    return tiny_flux_patcher(seed=3).model.diffusion_model


def make_inputs(target, refs, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, 16, *target, generator=gen),
        "refs": [torch.randn(batch, 16, *r, generator=gen) for r in refs],
        "timestep": torch.full((batch,), 0.6),
        "context": torch.randn(batch, 7, 48, generator=gen),
        "y": torch.randn(batch, 32, generator=gen),
        "guidance": torch.full((batch,), 1.0),
    }


def comfy_forward(flux, inputs, layout):
    return flux(
        inputs["x"],
        inputs["timestep"],
        inputs["context"],
        inputs["y"],
        inputs["guidance"],
        ref_latents=inputs["refs"],
        ref_latents_method=layout,
    )


@pytest.mark.parametrize("count", sorted(REFERENCE_SETS))
@pytest.mark.parametrize("layout", COMFY_NATIVE_LAYOUTS)
@torch.no_grad()
def test_native_layouts_equal_comfyuis_ids_and_output(flux, pack, layout, count):
    target, refs = (6, 8), REFERENCE_SETS[count]
    inputs = make_inputs(target, refs, seed=count)
    with captured_image_ids(flux) as calls:
        expected_out = comfy_forward(flux, inputs, layout)
    (comfy_ids,) = calls
    grid = TokenGrid(flux.params.patch_size, 3, flux.params.ref_index_scale)
    ours = image_position_ids(target, refs, layout, grid)
    assert torch.equal(comfy_ids[0], ours)

    batch = build_token_batch([inputs["x"][0]], [[r[0] for r in inputs["refs"]]], layout)
    tokens = importlib.import_module(
        f"{pack.__name__}.comfy_adapter.families.flux.reference_ids"
    ).forward_token_batch(flux, batch, inputs["timestep"], inputs["context"], inputs["y"], inputs["guidance"])
    (ours_out,) = batch.target_latents(tokens)
    assert (ours_out - expected_out[0]).abs().max() <= 1e-6


@pytest.mark.parametrize("layout", ["offset", "index"])
@torch.no_grad()
def test_mixed_size_batch_matches_each_sample_alone(flux, pack, layout):
    samples = [((6, 8), [(8, 8), (6, 10)]), ((8, 4), [(4, 4), (10, 6)]), ((4, 4), [(8, 12), (2, 2)])]
    singles = [make_inputs(t, r, seed=10 + i) for i, (t, r) in enumerate(samples)]
    shared_text = singles[0]["context"], singles[0]["y"]
    for single in singles:
        single["context"], single["y"] = shared_text
    outputs = {}
    for pad_value in (0.0, 123.0):
        batch = build_token_batch(
            [s["x"][0] for s in singles],
            [[r[0] for r in s["refs"]] for s in singles],
            layout,
            pad_value=pad_value,
        )
        assert not batch.valid.all(), "the samples must really differ in length"
        tokens = importlib.import_module(
            f"{pack.__name__}.comfy_adapter.families.flux.reference_ids"
        ).forward_token_batch(
            flux,
            batch,
            torch.full((3,), 0.6),
            shared_text[0].expand(3, -1, -1),
            shared_text[1].expand(3, -1),
            torch.full((3,), 1.0),
        )
        outputs[pad_value] = (batch, tokens)
    batch, tokens = outputs[0.0]
    for i, single in enumerate(singles):
        expected = comfy_forward(flux, single, layout)[0]
        got = batch.target_latents(tokens)[i]
        assert (got - expected).abs().max() <= 1e-5, i
        # every valid token (references too) is independent of what fills the padding
        other_batch, other_tokens = outputs[123.0]
        assert torch.equal(tokens[i, batch.valid[i]], other_tokens[i, other_batch.valid[i]])
