"""The Flux family's VRAM estimate (comfy_adapter/families/flux/vram.py) against hand-computed
sizes and the published fp8 ladder for FLUX.1 LoRA training at 1024 px (sd-scripts: 24 GB batch
2 without swap; 12 / 10 / 8 GB with 16 / 22 / 28 of its swap units, one unit being a double block
or two single blocks; and "> 26 GB" without fp8). The estimator's constants were fitted to this
same ladder, so these tests hold it to its fit (and to the hand-computed sizes); the comparison
with memory this code measures is tests/comfy_adapter/test_vram_measured.py."""

from __future__ import annotations

import pytest

from kt_testing.comfy_runtime import LazyPackModule

vram = LazyPackModule("comfy_adapter.families.flux.vram")  # the Flux family's estimate


def flux():
    """FLUX.1 dev's shape (the estimator's default)."""
    return vram.FluxShape()


pytestmark = pytest.mark.usefixtures("comfy_runtime")


def test_block_sizes_by_hand():
    h, m = 3072, 12288
    # per stream: modulation h->6h, qkv h->3h, proj h->h, mlp h->m->h; weights plus biases
    stream = (h * 6 * h + 6 * h) + (h * 3 * h + 3 * h) + (h * h + h) + (h * m + m) + (m * h + h)
    assert flux().double_block_weights() == 2 * stream
    # linear1 h->3h+m, linear2 h+m->h, modulation h->3h
    assert flux().single_block_weights() == (h * (3 * h + m) + 3 * h + m) + ((h + m) * h + h) + (
        h * 3 * h + 3 * h
    )
    total = 19 * flux().double_block_weights() + 38 * flux().single_block_weights() + flux().other_weights()
    assert total == pytest.approx(11.9e9, rel=0.01)  # FLUX.1 dev's published size


def test_single_blocks_are_swapped_first():
    assert vram.swap_split(10, flux()) == (10, 0)
    assert vram.swap_split(40, flux()) == (38, 2)
    assert vram.swap_split(1000, flux()) == (38, 19)
    assert vram.max_blocks_to_swap(flux()) == 57


def ladder_bytes(units: int) -> int:
    """Bytes the ladder's setting moves off the GPU (sd-scripts units)."""
    doubles = units // 2
    singles = (units - doubles) * 2
    return doubles * flux().double_block_weights() + singles * flux().single_block_weights()


def swapped_bytes(blocks: int) -> int:
    singles, doubles = vram.swap_split(blocks, flux())
    return singles * flux().single_block_weights() + doubles * flux().double_block_weights()


def test_24_gb_trains_batch_2_without_swap_in_fp8_but_not_in_bf16():
    assert vram.suggest_blocks_to_swap(24, batch=2, resolution=1024) == 0
    assert vram.estimate_vram(weight_format="bf16", resolution=1024).total > 24  # "> 26 GB" without fp8


@pytest.mark.parametrize(("budget", "ladder_units"), [(12, 16), (10, 22), (8, 28)])
def test_suggestions_match_the_ladder(budget, ladder_units):
    suggested = vram.suggest_blocks_to_swap(budget, resolution=1024, batch=1)
    assert suggested is not None
    # our suggestion moves about as many bytes off the GPU as the ladder's setting
    assert abs(swapped_bytes(suggested) - ladder_bytes(ladder_units)) / vram.GIB <= 0.75
    # one block fewer would not fit: the suggestion is the smallest
    assert vram.estimate_vram(resolution=1024, blocks_to_swap=suggested - 1).total > budget


def test_more_swap_less_memory_more_pixels_more_memory():
    totals = [vram.estimate_vram(blocks_to_swap=n).total for n in range(0, 58, 4)]
    assert totals == sorted(totals, reverse=True)
    assert vram.estimate_vram(resolution=1024, references=2).total > vram.estimate_vram(resolution=1024).total
    assert vram.estimate_vram(gradient_checkpointing=False).total > vram.estimate_vram().total + 10


def test_impossible_budget_and_bad_format():
    assert vram.suggest_blocks_to_swap(2.0) is None
    with pytest.raises(ValueError, match="weight format 'int4'"):
        vram.estimate_vram(weight_format="int4")


def test_shape_from_comfyui_params():
    class Params:
        hidden_size, mlp_ratio, depth, depth_single_blocks = 3072, 4.0, 19, 38
        in_channels, patch_size, context_in_dim, vec_in_dim = 16, 2, 4096, 768
        guidance_embed = True

    assert vram.FluxShape.of(Params) == flux()


def test_fp8_scaled_keeps_modulation_and_small_layers_as_loaded():
    """By hand: attention and MLP weights at 1 byte + a 4-byte scale per row, modulation and
    the embedders / final layer at the loaded bf16 size."""
    shape = vram.FluxShape()
    h, mlp = shape.hidden, shape.mlp
    double_scaled = 2 * sum(i * o + o for i, o in [(h, 3 * h), (h, h), (h, mlp), (mlp, h)])
    single_scaled = sum(i * o + o for i, o in [(h, 3 * h + mlp), (h + mlp, h)])
    double_mod, single_mod = 2 * (h * 6 * h + 6 * h), h * 3 * h + 3 * h
    scaled = shape.double_blocks * double_scaled + shape.single_blocks * single_scaled
    kept = shape.double_blocks * double_mod + shape.single_blocks * single_mod + shape.other_weights()
    expected = (scaled * (1 + 1 / 3072) + kept * 2) / 2**30
    estimate = vram.estimate_vram(shape, weight_format="fp8_scaled", base_format="bf16")
    assert abs(estimate.weights - expected) < 1e-9
    assert vram.estimate_vram(shape, weight_format="fp8").weights < estimate.weights
    assert estimate.weights < vram.estimate_vram(shape, weight_format="bf16").weights


def test_the_estimate_counts_the_optimizers_state():
    adamw = vram.estimate_vram(rank=16, optimizer="adamw")
    adafactor = vram.estimate_vram(rank=16, optimizer="adafactor")
    # fp32 weight + gradient (8 bytes) + the state: 16 bytes a value with AdamW, 8.25 with Adafactor
    assert adafactor.lora == pytest.approx(adamw.lora * (8 + 4 / 16) / 16)
    assert adamw.weights == adafactor.weights and adamw.activations == adafactor.activations


def test_each_releases_shape_adds_up_to_its_published_size(pack_import):
    """The full-size shapes the registry carries (what the estimate of a real file uses) against
    the sizes their releases are named by: FLUX.1 11.9B, FLUX.2 [dev] 32B, klein 4B and 9B
    (counted: 11.90, 32.22, 3.88, 9.08). A klein with [dev]'s block counts (8 + 48) counts 6.6B,
    one with a guidance embedder 10M more (the weight count of ComfyUI's own tiny klein catches
    that: tests/comfy_adapter/test_vram_measured.py)."""
    flux = pack_import("comfy_adapter.families.flux")
    published = {flux.FLUX1: 11.9e9, flux.FLUX2: 32e9, flux.KLEIN_4B: 4e9, flux.KLEIN_9B: 9e9}
    for entry, size in published.items():
        shape = entry.shape
        total = shape.double_blocks * shape.double_block_weights()
        total += shape.single_blocks * shape.single_block_weights() + shape.other_weights()
        assert total == pytest.approx(size, rel=0.04), entry.title
