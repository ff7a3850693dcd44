"""The family table: which base model a LoRA names, and what each family refuses."""

from __future__ import annotations

import pytest

from trainer_core.model_family import FLUX1, FLUX2, check_family_layout, family_named


def test_base_model_names_follow_the_family_and_the_references():
    assert (FLUX1.base_model(0), FLUX1.base_model(1), FLUX1.base_model(3)) == (
        "flux1_dev",
        "flux1_kontext",
        "flux1_kontext",
    )
    assert (FLUX2.base_model(0), FLUX2.base_model(2)) == ("flux2_dev", "flux2_dev")


def test_comfyuis_image_model_names_pick_the_family_and_others_are_refused():
    assert family_named("flux") is FLUX1 and family_named("flux2") is FLUX2
    with pytest.raises(ValueError, match=r"this MODEL is a hidream model; Kontext Trainer handles"):
        family_named("hidream")
    with pytest.raises(ValueError, match=r"is a non-Flux model"):
        family_named(None)


def test_dreamomni2_is_a_flux1_layout():
    assert check_family_layout(FLUX1, "dreamomni2") == "dreamomni2"
    for layout in ("index", "offset", "uxo"):
        assert check_family_layout(FLUX2, layout) == layout
    with pytest.raises(ValueError, match=r"'dreamomni2' does not fit a FLUX\.2 model.*index is its default"):
        check_family_layout(FLUX2, "dreamomni2")
