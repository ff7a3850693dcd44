"""MultiImageConditioning in the real runtime: stock KSampler sampling, layouts, errors."""

from __future__ import annotations

import pytest
import torch

from kt_testing.capture import captured_image_ids
from kt_testing.executor import run_node
from kt_testing.graphs import ksampler_inputs


def hand_ids(rows: int, cols: int, index: float, row_off: int = 0, col_off: int = 0) -> torch.Tensor:
    return torch.tensor(
        [[index, r + row_off, c + col_off] for r in range(rows) for c in range(cols)], dtype=torch.float32
    )


@pytest.fixture(scope="module")
def setup(comfy_runtime, pack):
    from kt_testing.tiny_models import small_flux_vae, tiny_flux_patcher

    gen = torch.Generator().manual_seed(5)
    conditioning = [
        [torch.randn(1, 7, 48, generator=gen), {"pooled_output": torch.randn(1, 32, generator=gen)}]
    ]
    return {
        "model": tiny_flux_patcher(seed=4),
        "vae": small_flux_vae(seed=1),
        "conditioning": conditioning,
        "node": pack.nodes.multi_image_conditioning.MultiImageConditioning,
        "nodes": comfy_runtime.nodes,
    }


def image(height, width, seed=0, batch=1):
    return torch.rand(batch, height, width, 3, generator=torch.Generator().manual_seed(seed))


def sample_with_ksampler(setup, model, conditioning, latent_hw=(8, 8)):
    """A stock KSampler, 2 euler steps at cfg 1; returns the ids of every model call."""
    latent = {"samples": torch.zeros(1, 16, *latent_hw)}
    sampler = ksampler_inputs(model, conditioning, latent)
    with captured_image_ids(model.model.diffusion_model) as calls:
        (out,) = run_node("KSampler", sampler).outputs
    assert out["samples"].shape == latent["samples"].shape and torch.isfinite(out["samples"]).all()
    return calls


def conditioning_node(setup, layout, *images, resolution=0, validate=True):
    """MultiImageConditioning through ComfyUI's executor: (MODEL, CONDITIONING)."""
    inputs = {
        "model": setup["model"],
        "conditioning": setup["conditioning"],
        "vae": setup["vae"],
        "layout": layout,
        "reference_resolution": resolution,
        **{f"image_{i}": img for i, img in enumerate(images, start=1)},
    }
    return run_node(setup["node"], inputs, validate=validate).outputs


@pytest.mark.parametrize(
    "sizes,expected_refs",
    [
        # image pixels (H, W) -> latent /8 -> patches /2
        # 64x64, 64x64: 4x4 patches each; the second shifted right by 4 columns, index 2.
        ([(64, 64), (64, 64)], [(4, 4, 1.0, 0, 0), (4, 4, 2.0, 0, 4)]),
        # 64x96 then 48x64: 4x6 then 3x4 patches; the second at column 6.
        ([(64, 96), (48, 64)], [(4, 6, 1.0, 0, 0), (3, 4, 2.0, 0, 6)]),
    ],
)
def test_dreamomni2_reaches_flux_through_a_stock_ksampler(setup, sizes, expected_refs):
    images = [image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    model, conditioning = conditioning_node(setup, "dreamomni2", *images)
    calls = sample_with_ksampler(setup, model, conditioning)
    expected = torch.cat([hand_ids(4, 4, 0.0)] + [hand_ids(*ref) for ref in expected_refs])
    assert len(calls) == 2  # one call per step at cfg 1
    for ids in calls:
        assert torch.equal(ids[0], expected)
    # Without our MODEL, ComfyUI silently falls back to `offset`: different ids.
    stock_calls = sample_with_ksampler(setup, setup["model"], conditioning)
    assert not torch.equal(stock_calls[0][0], expected)


def test_single_reference_gives_plain_kontext_ids_in_offset_index_and_dreamomni2(setup):
    ref = image(48, 80, seed=3)
    plain = torch.cat([hand_ids(4, 4, 0.0), hand_ids(3, 5, 1.0)])
    for layout in ("offset", "index", "dreamomni2"):
        model, conditioning = conditioning_node(setup, layout, ref)
        calls = sample_with_ksampler(setup, model, conditioning)
        assert torch.equal(calls[0][0], plain), layout


def test_conditioning_carries_latents_and_layout_and_the_input_model_is_untouched(setup):
    import comfy.patcher_extension

    model, conditioning = conditioning_node(setup, "uxo", image(64, 32), image(32, 64, seed=1), resolution=64)
    extras = conditioning[0][1]
    assert extras["reference_latents_method"] == "uxo"
    # resolution 64: 64x32 -> area 4096 -> 96x48 (sqrt 2 scale, rounded to 16) -> latent 12x6
    assert [tuple(t.shape) for t in extras["reference_latents"]] == [(1, 16, 12, 6), (1, 16, 6, 12)]
    assert "reference_latents" not in setup["conditioning"][0][1]
    dm_wrappers = comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL
    assert model.wrappers.get(dm_wrappers) and not setup["model"].wrappers.get(dm_wrappers)


def test_bad_input_gets_a_clear_error(setup):
    with pytest.raises(ValueError, match="at least one reference image on image_1"):
        conditioning_node(setup, "offset", validate=False)  # ComfyUI refuses it first; scripts may not
    with pytest.raises(ValueError, match=r"batch sizes disagree.*image_1 has 2, image_2 has 3"):
        conditioning_node(setup, "offset", image(32, 32, batch=2), image(32, 32, batch=3))
    with pytest.raises(ValueError, match="unknown layout 'sideways'"):
        conditioning_node(setup, "sideways", image(32, 32), validate=False)  # as a script could send
    with pytest.raises(ValueError, match="image_2 is 16x4100; the cap is 4096"):
        conditioning_node(setup, "offset", image(32, 32), image(4100, 16))


def test_an_oversized_reference_is_refused_by_input_name_before_any_encoding(setup):
    from kt_testing.tiny_models import small_flux_vae

    vae = small_flux_vae(seed=1)
    encoded = []
    inner = vae.encode
    vae.encode = lambda pixels: encoded.append(pixels.shape) or inner(pixels)
    inputs = {
        "model": setup["model"],
        "conditioning": setup["conditioning"],
        "vae": vae,
        "layout": "offset",
        "reference_resolution": 0,
        "image_1": image(32, 32),
        "image_2": image(16, 4100),
    }
    with pytest.raises(ValueError) as caught:
        run_node(setup["node"], inputs)
    assert str(caught.value) == (
        "image_2 is 4100x16; the cap is 4096 pixels on a side. Downscale it before loading."
    )
    assert encoded == []  # image_1 was not encoded for nothing


def test_layout_auto_is_the_models_own(setup):
    """Issue 42 item 2: `auto` (the node's default) sets the model's own layout on the
    conditioning, by name: ComfyUI's `default_ref_method` for it (`offset` for FLUX.1; FLUX.2's
    `index`: tests/e2e/test_flux2_workflows.py), so ComfyUI samples with what it would choose."""
    assert setup["model"].model.diffusion_model.params.default_ref_method == "offset"
    _, conditioning = conditioning_node(setup, "auto", image(32, 32), image(16, 24))
    methods = {c[1].get("reference_latents_method") for c in conditioning}
    assert methods == {"offset"}

