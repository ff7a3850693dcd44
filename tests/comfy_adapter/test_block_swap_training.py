"""Block swap on ComfyUI's (tiny) Flux, on CPU: with the swapper in poison mode (an offloaded
block's weights read as NaN), the loss and every LoRA gradient must equal the run without
swapping, and the recorded transfers must follow the schedule."""

from __future__ import annotations

import pytest
import torch

from kt_testing.probes import tiny_samples
from kt_testing.tiny_models import TINY_FAMILIES, tiny_flux_patcher


@pytest.fixture(scope="module")
def mods(pack_import):
    return type(
        "Mods",
        (),
        {
            "ft": pack_import("comfy_adapter.lora_session"),
            "flow_step": pack_import("trainer_core.flow_step"),
        },
    )


def samples(mods, family="flux"):
    tiny = TINY_FAMILIES[family]
    return tiny_samples(mods.flow_step.Sample, 2, 3, [(8, 6)], channels=tiny.channels, pooled=tiny.pooled)


def loss_and_grads(mods, model, blocks_to_swap, record=None, family="flux"):
    config = mods.ft.TrainConfig(
        rank=2,
        alpha=2.0,
        targets="all_linear",
        blocks_to_swap=blocks_to_swap,
        seed=4,
        layout=TINY_FAMILIES[family].layout,
    )
    with mods.ft.lora_session(model, config, poison_swapped=True) as session:
        if record is not None and session.swapper is not None:
            resident_peak = [0]

            def on_transfer(kind, index):
                record.append((kind, index, torch._C._current_graph_task_id() != -1))
                resident_peak[0] = max(resident_peak[0], len(session.swapper.resident) + (kind == "in"))

            session.swapper.on_transfer = on_transfer
            record.append(("peak", resident_peak))
        loss = session.loss(samples(mods, family), torch.Generator().manual_seed(7))
        grads = torch.autograd.grad(loss, session.lora.parameters())
        if session.swapper is not None:
            session.swapper.on_transfer = None  # the restore on exit is not part of the step
    return loss.detach(), grads


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
@pytest.mark.parametrize("blocks_to_swap", [1, 2, 3, 4])
def test_swapping_changes_nothing_but_where_weights_wait(mods, blocks_to_swap, family):
    """FLUX.2 too: its model-wide modulation layers stay put; only block weights move."""
    model = TINY_FAMILIES[family].patcher(seed=9)
    reference_loss, reference_grads = loss_and_grads(mods, model, 0, family=family)
    loss, grads = loss_and_grads(mods, model, blocks_to_swap, family=family)
    assert torch.equal(loss, reference_loss)
    for got, expected in zip(grads, reference_grads, strict=True):
        assert torch.equal(got, expected)
    # afterwards every weight is back and finite: the MODEL is as it was
    assert all(torch.isfinite(p).all() for p in model.model.diffusion_model.parameters())


def test_transfers_follow_the_schedule(mods):
    record = []
    loss_and_grads(mods, tiny_flux_patcher(seed=9), 3, record)
    peak = record.pop(0)[1][0]
    # execution order: doubles 0, 1, singles 2, 3; three swapped: both singles, then double 1
    forward_in = [i for kind, i, backward in record if kind == "in" and not backward]
    backward_in = [i for kind, i, backward in record if kind == "in" and backward]
    assert forward_in == [1, 2, 3]
    assert backward_in == [3, 2, 1]
    assert peak <= 2


def test_swap_needs_checkpointing(mods):
    with pytest.raises(ValueError, match="blocks_to_swap needs gradient_checkpointing"):
        mods.ft.TrainConfig(blocks_to_swap=2, gradient_checkpointing=False)
    with pytest.raises(ValueError, match="only 4 blocks"):
        with mods.ft.lora_session(tiny_flux_patcher(seed=1), mods.ft.TrainConfig(blocks_to_swap=5)):
            pass
