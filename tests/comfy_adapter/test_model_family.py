"""The family registry (comfy_adapter/families): which base model a LoRA names, and what each
family refuses."""

from __future__ import annotations

import re

import pytest

from demo_assets import for_this_comfyui


@pytest.fixture(scope="module")
def families(pack_import):
    return pack_import("comfy_adapter.families")


@pytest.fixture(scope="module")
def flux(families, pack_import):  # registered in `families` as it is imported
    return pack_import("comfy_adapter.families.flux")


def test_base_model_names_follow_the_family_and_the_references(flux):
    FLUX1, FLUX2 = flux.FLUX1, flux.FLUX2
    assert (FLUX1.base_model(0), FLUX1.base_model(1), FLUX1.base_model(3)) == (
        "flux1_dev",
        "flux1_kontext",
        "flux1_kontext",
    )
    assert (FLUX2.base_model(0), FLUX2.base_model(2)) == ("flux2_dev", "flux2_dev")


def test_comfyuis_image_model_names_pick_the_family_and_others_are_refused(families, flux):
    entry_for, FLUX1, FLUX2 = families.entry_for, flux.FLUX1, flux.FLUX2
    assert entry_for({"image_model": "flux"}) is FLUX1
    assert entry_for({"image_model": "flux2", "guidance_embed": True}) is FLUX2
    with pytest.raises(ValueError, match=r"this MODEL is a hidream model; Kontext Trainer handles"):
        entry_for({"image_model": "hidream"})
    with pytest.raises(ValueError, match=r"is a model of no type ComfyUI detects"):
        entry_for({})
    none_of = r"is a flux2 model that is none of FLUX\.2 \[dev\], FLUX\.2 \[klein\] 4B"
    with pytest.raises(ValueError, match=none_of):
        entry_for({"image_model": "flux2"})  # no guidance_embed: ComfyUI always records it


def test_the_registry_holds_every_model_and_messages_name_them_from_it(families, flux):
    import importlib

    qwen = importlib.import_module(f"{families.__name__}.qwen_image")
    FAMILIES, trained_models = families.FAMILIES, families.trained_models
    expected = [flux.FLUX1, flux.FLUX2, flux.KLEIN_4B, flux.KLEIN_9B, qwen.EDIT_2509, qwen.EDIT_2511]
    assert list(FAMILIES.values()) == expected
    assert trained_models() == (
        "FLUX.1 (dev, Kontext), FLUX.2 [dev], FLUX.2 [klein] 4B, FLUX.2 [klein] 9B, "
        "Qwen-Image-Edit 2509 and Qwen-Image-Edit 2511"
    )
    # the entries of one image_model with the same layouts share one line of the layout tooltip
    assert families.layouts_by_family() == (
        "FLUX.1: offset, index, uxo, dreamomni2 (auto: offset). "
        "FLUX.2: index, offset, uxo, index_timestep_zero (auto: index). "
        "Qwen-Image-Edit 2509: index, offset, index_timestep_zero (auto: index). "
        "Qwen-Image-Edit 2511: index_timestep_zero, index, offset (auto: index_timestep_zero)."
    )


# The releases as published (hidden width, double / single blocks, text width: T5-XXL's, or
# Mistral-3's / Qwen3's three tapped layers), guidance_in where the release is guidance-distilled.
RELEASES = {
    "FLUX.1 (dev, Kontext)": ("flux", 3072, 19, 38, 4096, True),
    "FLUX.2 [dev]": ("flux2", 6144, 8, 48, 3 * 5120, True),
    "FLUX.2 [klein] 4B": ("flux2", 3072, 5, 20, 3 * 2560, False),
    "FLUX.2 [klein] 9B": ("flux2", 4096, 8, 24, 3 * 4096, False),
}


def release_state_dict(image_model, hidden, doubles, singles, context, guidance) -> dict:
    """The release's weights on `meta` under their real key names: ComfyUI's own Flux class
    built with the release's published shape (128 channels per head)."""
    flux2 = image_model == "flux2"
    config = {
        "image_model": image_model,
        "in_channels": 128 if flux2 else 16,
        "out_channels": 128 if flux2 else 16,
        "vec_in_dim": None if flux2 else 768,
        "context_in_dim": context,
        "hidden_size": hidden,
        "mlp_ratio": 3.0 if flux2 else 4.0,
        "num_heads": hidden // 128,
        "depth": doubles,
        "depth_single_blocks": singles,
        "axes_dim": [32, 32, 32, 32] if flux2 else [16, 56, 56],
        "theta": 2000 if flux2 else 10000,
        "patch_size": 1 if flux2 else 2,
        "qkv_bias": not flux2,
        "guidance_embed": guidance,
    }
    if flux2:
        config.update(global_modulation=True, mlp_silu_act=True, ops_bias=False)
    return meta_flux(for_this_comfyui(config)).state_dict()


def meta_flux(unet_config: dict):
    """ComfyUI's Flux class built from `unet_config`, on `meta`."""
    import comfy.ldm.flux.model
    import comfy.ops

    return comfy.ldm.flux.model.Flux(**unet_config, device="meta", operations=comfy.ops.disable_weight_init)


@pytest.mark.parametrize("release", RELEASES)
def test_each_release_is_told_apart_by_what_comfyuis_detection_reads(release, families, pack_import):
    """ComfyUI's own detection on each release's keys and shapes picks its entry (FLUX.2 [dev] by
    its guidance_in, klein 4B / 9B by their width), and the entry's full-size shape is the one
    ComfyUI builds from that detection. ComfyUI 0.3.75 fixes FLUX.2's heads at 48, so its own
    Flux class refuses to build a klein (the stock UNETLoader fails before the pack sees it)."""
    from types import SimpleNamespace

    import comfy.model_detection

    vram = pack_import("comfy_adapter.families.flux.vram")
    model_family = pack_import("comfy_adapter.model_family")
    state = release_state_dict(*RELEASES[release])
    unet_config = comfy.model_detection.detect_unet_config(state, "")
    entry = families.entry_for(unet_config)
    assert entry.trains == release

    if unet_config["num_heads"] * sum(unet_config["axes_dim"]) != unet_config["hidden_size"]:
        assert release.startswith("FLUX.2 [klein]")  # ComfyUI 0.3.75
        with pytest.raises(ValueError, match=r"must be divisible by num_heads|expected positional dim"):
            meta_flux(unet_config)
        return
    built = meta_flux(unet_config)
    assert vram.FluxShape.of(built.params) == entry.shape
    model_config = comfy.model_detection.model_config_from_unet_config(unet_config, state)
    patcher = SimpleNamespace(model=SimpleNamespace(model_config=model_config, diffusion_model=built))
    assert model_family.family_of(patcher) is entry


def test_dreamomni2_is_a_flux1_layout(flux):
    FLUX1, FLUX2 = flux.FLUX1, flux.FLUX2
    assert FLUX1.check_layout("dreamomni2") == "dreamomni2"
    for layout in ("index", "offset", "uxo"):
        assert FLUX2.check_layout(layout) == layout
    with pytest.raises(ValueError, match=r"'dreamomni2' does not fit a FLUX\.2 model.*index is its default"):
        FLUX2.check_layout("dreamomni2")


# What ComfyUI 0.33's detection gives each model (comfy/model_detection.py): image_model,
# context_in_dim, vec_in_dim, yak_mlp, txt_ids_dims.
DETECTED = {
    "FLUX.1 dev / Kontext": ("flux", 4096, 768, False, []),
    "FLUX.2 [dev]": ("flux2", 15360, None, False, [3]),
    "LongCat-Image": ("flux", 3584, None, False, [1, 2]),
    "Ovis-Image": ("flux", 2048, None, True, [1, 2]),
}


@pytest.mark.parametrize("name", DETECTED)
def test_models_sharing_a_familys_image_model_are_named_and_refused(name, families, flux):
    refuse_variant, unsupported_variant = families.refuse_variant, flux.unsupported_variant
    image_model, context, vec, yak, txt_ids = DETECTED[name]
    family = families.entry_for({"image_model": image_model, "guidance_embed": True})
    variant = unsupported_variant(image_model, context, vec, yak_mlp=yak, txt_ids_dims=txt_ids)
    if name.startswith(("FLUX.1", "FLUX.2 [dev]")):
        assert variant is None
        refuse_variant(family, variant)  # nothing to refuse
        return
    assert variant == name
    with pytest.raises(ValueError, match=rf"this MODEL is {re.escape(name)}, which ComfyUI runs"):
        refuse_variant(family, variant)


def test_flux_swaps_single_blocks_first_from_the_end(families, flux):
    """A single block is about 0.42 of a double block: less transfer per byte saved."""
    from types import SimpleNamespace

    from trainer_core.block_swap import first_swapped

    model = SimpleNamespace(double_blocks=["d0", "d1"], single_blocks=["s0", "s1", "s2"])
    order = flux.FLUX1.swap_order(model)  # execution order: doubles 0, 1 then singles 2, 3, 4
    assert flux.FLUX1.blocks(model) == ["d0", "d1", "s0", "s1", "s2"]
    assert [first_swapped(order, n) for n in range(6)] == [
        [],
        [4],
        [3, 4],
        [2, 3, 4],
        [1, 2, 3, 4],
        [0, 1, 2, 3, 4],
    ]
