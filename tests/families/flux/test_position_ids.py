"""Reference position ids, against values written out by hand."""

from __future__ import annotations

import pytest
import torch

from kt_testing.flux_ids import TokenGrid, flux2_grid, image_position_ids, text_position_ids

pytestmark = pytest.mark.usefixtures("comfy_runtime")



def hand_ids(rows: int, cols: int, index: float, row_off: int = 0, col_off: int = 0) -> torch.Tensor:
    """Raster-order [index, row, col] triples, built with plain loops."""
    return torch.tensor(
        [[index, r + row_off, c + col_off] for r in range(rows) for c in range(cols)], dtype=torch.float32
    )


def test_target_alone_is_domain_zero_at_the_origin():
    ids = image_position_ids((6, 10), [], "offset")
    assert torch.equal(ids, hand_ids(3, 5, 0.0))


@pytest.mark.parametrize(
    "refs,expected_parts",
    [
        # latent sizes (H, W); 2x2 patches. (8, 8) x 2: 4x4 patches each, index 1 and 2,
        # the second shifted right by the first's 4 patch columns.
        ([(8, 8), (8, 8)], [(4, 4, 1, 0, 0), (4, 4, 2, 0, 4)]),
        # (8, 12) then (6, 8): 4x6 then 3x4 patches; the second starts at column 6, row 0.
        ([(8, 12), (6, 8)], [(4, 6, 1, 0, 0), (3, 4, 2, 0, 6)]),
        # three references: offsets accumulate 4 + 6.
        ([(8, 8), (8, 12), (4, 4)], [(4, 4, 1, 0, 0), (4, 6, 2, 0, 4), (2, 2, 3, 0, 10)]),
    ],
)
def test_dreamomni2_by_hand(refs, expected_parts):
    target = (8, 8)
    expected = torch.cat(
        [hand_ids(4, 4, 0.0)] + [hand_ids(r, c, i, ro, co) for r, c, i, ro, co in expected_parts]
    )
    assert torch.equal(image_position_ids(target, refs, "dreamomni2"), expected)


def test_offset_by_hand_goes_below_then_right():
    # Two 8x8 references: the first at the origin; stacking the second below (box 16x8) vs
    # right (box 8x16): ComfyUI's test `ref_h + h > ref_w + w` is 16 > 16, false -> below.
    # A third 8x8: 8 + 16 > 8 + 8 -> right of the 16x8 box, at column 8 latent = 4 patches.
    ids = image_position_ids((4, 4), [(8, 8), (8, 8), (8, 8)], "offset")
    expected = torch.cat(
        [
            hand_ids(2, 2, 0.0),
            hand_ids(4, 4, 1.0),
            hand_ids(4, 4, 1.0, row_off=4),
            hand_ids(4, 4, 1.0, col_off=4),
        ]
    )
    assert torch.equal(ids, expected)


def test_uxo_by_hand_places_references_diagonally_after_the_target():
    # target 6x4 latent = 3x2 patches; uxo offsets start at the target's extent (6, 4 latent)
    # and grow by each reference's latent size.
    ids = image_position_ids((6, 4), [(4, 4), (2, 6)], "uxo")
    expected = torch.cat(
        [
            hand_ids(3, 2, 0.0),
            hand_ids(2, 2, 0.0, row_off=3, col_off=2),
            hand_ids(1, 3, 0.0, row_off=5, col_off=4),
        ]
    )
    assert torch.equal(ids, expected)


def test_index_layout_counts_up_with_the_scale():
    ids = image_position_ids((2, 2), [(2, 2), (2, 2)], "index", TokenGrid(ref_index_scale=10.0))
    expected = torch.cat([hand_ids(1, 1, 0.0), hand_ids(1, 1, 10.0), hand_ids(1, 1, 20.0)])
    assert torch.equal(ids, expected)


@pytest.mark.parametrize("ref", [(8, 8), (6, 12), (12, 4)])
def test_single_reference_is_plain_kontext_in_every_layout_that_should_coincide(ref):
    """Seed 000: a multi-reference rewrite broke single-reference ids. One reference must give
    index 1 at the origin in offset, index and dreamomni2 alike."""
    plain = torch.cat([hand_ids(4, 4, 0.0), hand_ids(ref[0] // 2, ref[1] // 2, 1.0)])
    for layout in ("offset", "index", "dreamomni2"):
        assert torch.equal(image_position_ids((8, 8), [ref], layout), plain), layout
    assert not torch.equal(image_position_ids((8, 8), [ref], "uxo"), plain)


def test_unknown_layout_is_refused_with_the_choices():
    with pytest.raises(
        ValueError, match=r"unknown layout 'diagonal'.*offset, index, uxo, dreamomni2"
    ):
        image_position_ids((8, 8), [(8, 8)], "diagonal")




def hand_ids4(rows: int, cols: int, index: float, row_off: int = 0, col_off: int = 0) -> torch.Tensor:
    """FLUX.2's [index, row, col, 0] quadruples, built with plain loops (1x1 patches)."""
    return torch.tensor(
        [[index, r + row_off, c + col_off, 0.0] for r in range(rows) for c in range(cols)],
        dtype=torch.float32,
    )


def test_flux2_index_layout_by_hand():
    # 1x1 patches: a latent of 3x4 is 3x4 tokens; references count up in steps of 10.
    ids = image_position_ids((3, 4), [(2, 2), (1, 3)], "index", flux2_grid())
    expected = torch.cat([hand_ids4(3, 4, 0.0), hand_ids4(2, 2, 10.0), hand_ids4(1, 3, 20.0)])
    assert torch.equal(ids, expected)


def test_flux2_offset_layout_by_hand_counts_offsets_in_latent_pixels():
    # Two 2x2 references: the first at the origin, the second below (2 + 2 > 2 + 2 is false).
    ids = image_position_ids((2, 2), [(2, 2), (2, 2)], "offset", flux2_grid())
    expected = torch.cat([hand_ids4(2, 2, 0.0), hand_ids4(2, 2, 1.0), hand_ids4(2, 2, 1.0, row_off=2)])
    assert torch.equal(ids, expected)


def test_text_ids_count_on_the_fourth_axis_only_for_flux2():
    assert torch.equal(text_position_ids(2, 3, 3), torch.zeros(2, 3, 3))
    expected = torch.tensor([[0.0, 0.0, 0.0, t] for t in range(3)])
    assert torch.equal(text_position_ids(2, 3, 4), expected.expand(2, 3, 4))
