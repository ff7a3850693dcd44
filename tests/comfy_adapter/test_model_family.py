"""The family registry (comfy_adapter/families): which base model a LoRA names, and what each
family refuses."""

from __future__ import annotations

import re

import pytest


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
    family_named, FLUX1, FLUX2 = families.family_named, flux.FLUX1, flux.FLUX2
    assert family_named("flux") is FLUX1 and family_named("flux2") is FLUX2
    with pytest.raises(ValueError, match=r"this MODEL is a hidream model; Kontext Trainer handles"):
        family_named("hidream")
    with pytest.raises(ValueError, match=r"is a model of no type ComfyUI detects"):
        family_named(None)


def test_the_registry_holds_both_flux_families_and_messages_name_them_from_it(families, flux):
    FAMILIES, trained_models, FLUX1, FLUX2 = (
        families.FAMILIES,
        families.trained_models,
        flux.FLUX1,
        flux.FLUX2,
    )
    assert FAMILIES == {"flux": FLUX1, "flux2": FLUX2}
    assert trained_models() == "FLUX.1 (dev, Kontext) and FLUX.2 [dev]"


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
    "FLUX.2 [klein] 4B": ("flux2", 7680, None, False, [3]),
    "FLUX.2 [klein] 9B": ("flux2", 12288, None, False, [3]),
}


@pytest.mark.parametrize("name", DETECTED)
def test_models_sharing_a_familys_image_model_are_named_and_refused(name, families, flux):
    refuse_variant, unsupported_variant = families.refuse_variant, flux.unsupported_variant
    image_model, context, vec, yak, txt_ids = DETECTED[name]
    family = families.family_named(image_model)
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
