"""What the cast contract (comfy_adapter/cast_contract.py) costs a training step, counted: how
many times each block Linear's forward runs in one step, and the step's matmul FLOPs
(`torch.utils.flop_counter`), for every way ComfyUI loads the weights, with block
checkpointing on and off. One step (loss and gradients) of the tiny Flux.

The forwards are counted by wrapping the class `forward` of each block Linear (ComfyUI's, where
the class defines it) before training starts, so every run of it counts: the block's forward,
the block's recompute and a per-layer recompute alike. A re-cast in the backward runs no forward.

Expected, by hand: a block Linear runs its forward once per step, and once more with block
checkpointing (the block's recompute); the contract's re-cast adds no matmul, so the step's
FLOPs equal those of the plain model's step (same shapes; it casts nothing, so the contract
does nothing there).
The contract applies only where ComfyUI may reuse cast memory (issue 41 item 2: here, under
the cast replays); elsewhere the layers run as ComfyUI made them (fp8 weights, fp8_scaled, a
quantized file on the CPU), so the same holds for another reason.
Where a layer keeps the per-layer recompute (ComfyUI's quantized Linear, whose training
forward is `QuantLinearFunc`, under the dynamic VRAM replay), it runs one forward more, and the
FLOPs grow (counted: 1.27 x the plain model's with block checkpointing, 1.41 x without; before
item 2 the quantized file paid this without any reuse). On 419e28e (the per-layer
recompute for every casting Linear) each casting layer whose input needs a gradient ran 3
forwards with checkpointing and 2 without (18 of the 26 here; 14 under the cast replays, which
mark only layers over 16 KiB): the step's counted FLOPs 1.27 and 1.41 x the plain model's
with fp8 weights."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kt_testing import cast_replay
from kt_testing.probes import tiny_samples
from kt_testing.tiny_models import fp8_flux_patcher, tiny_flux_patcher

BLOCKS = ("double_blocks.", "single_blocks.")


@pytest.fixture(scope="module")
def ft(pack_import):
    return pack_import("comfy_adapter.lora_session")


@pytest.fixture(scope="module")
def cast_contract(pack_import):
    return pack_import("comfy_adapter.cast_contract")


@pytest.fixture(scope="module")
def samples(pack_import):
    return tiny_samples(pack_import("trainer_core.flow_step").Sample, 1, 4, [(8, 6)])


def quantized():
    from kt_testing.quantized_files import quantized_flux_patcher

    return quantized_flux_patcher(seed=6)


# mode: (the MODEL, the cast replay, TrainLoRA's fp8_mode)
MODES = {
    "plain": (lambda: tiny_flux_patcher(seed=6), None, "as_loaded"),
    "fp8_weights": (lambda: fp8_flux_patcher(seed=6), None, "as_loaded"),
    "fp8_scaled": (lambda: tiny_flux_patcher(seed=6), None, "fp8_scaled"),
    "quantized_file": (quantized, None, "as_loaded"),
    "quantized_dynamic_vram_buffers": (quantized, "dynamic", "as_loaded"),
    "dynamic_vram_buffers": (lambda: tiny_flux_patcher(seed=6), "dynamic", "as_loaded"),
    "stream_buffers": (lambda: tiny_flux_patcher(seed=6), "stream", "as_loaded"),
}


# where the plan keeps the per-layer recompute: ComfyUI's quantized Linears with their casts in
# reused memory (the dynamic VRAM replay; 0.33: 0.3.75 dequantizes each cast into fresh memory).
# With its fp8 backward they keep it too: test_quantized_training's bytes alive after the forward.
RECOMPUTED = ("quantized_dynamic_vram_buffers",)


def block_linears(cast_contract, diffusion_model) -> dict:
    return {
        name: layer
        for name, layer in diffusion_model.named_modules()
        if name.startswith(BLOCKS) and cast_contract.is_linear(layer) and hasattr(layer, "comfy_cast_weights")
    }


def step(ft, cast_contract, samples, mode: str, checkpointing: bool):
    """One step; returns (forward runs per block Linear, its input's rows, its (in, out)
    features, the step's FLOPs, the names of ComfyUI's quantized Linears among them)."""
    make, replay, fp8_mode = MODES[mode]
    model = make()
    layers = block_linears(cast_contract, model.model.diffusion_model)
    by_layer = {id(layer): name for name, layer in layers.items()}
    counts, rows = collections.Counter(), {}
    owners = {}
    for layer in layers.values():
        owner = next(cls for cls in type(layer).__mro__ if "forward" in vars(cls))
        owners.setdefault(owner, vars(owner)["forward"])

    def counting(original):
        def forward(self, x, *args, **kwargs):
            name = by_layer.get(id(self))
            if name is not None and counting.on:
                counts[name] += 1
                rows[name] = x.numel() // x.shape[-1]
            return original(self, x, *args, **kwargs)

        return forward

    counting.on = False
    config = ft.TrainConfig(
        rank=2, alpha=2.0, targets="attention", gradient_checkpointing=checkpointing, fp8_mode=fp8_mode
    )
    try:
        for owner, original in owners.items():
            owner.forward = counting(original)
        with torch.inference_mode(False), contextlib.ExitStack() as stack:
            if replay:
                memory = stack.enter_context(cast_replay.replay(replay))
                cast_replay.replay_for_patcher(model, memory)
            session = stack.enter_context(ft.lora_session(model, config))
            counting.on = True
            with FlopCounterMode(display=False) as flops:
                loss = session.loss(samples, torch.Generator().manual_seed(11))
                torch.autograd.grad(loss, list(session.lora.parameters()))
            counting.on = False
    finally:
        for owner, original in owners.items():
            owner.forward = original
    shapes = {name: (layer.in_features, layer.out_features) for name, layer in layers.items()}
    quantized_layers = {name for name, layer in layers.items() if not isinstance(layer, torch.nn.Linear)}
    return counts, rows, shapes, flops.get_total_flops(), quantized_layers


@pytest.fixture(scope="module")
def plain_flops(ft, cast_contract, samples):
    """The step's FLOPs on the plain model, which casts nothing (the contract does nothing
    there): every mode's matmuls have its shapes."""
    return {on: step(ft, cast_contract, samples, "plain", on)[3] for on in (True, False)}


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
@pytest.mark.parametrize("mode", [m for m in MODES if m != "plain"])
def test_block_linear_forwards_and_flops_of_a_step(
    ft, cast_contract, samples, plain_flops, mode, checkpointing
):
    import comfy.model_management

    if mode in RECOMPUTED and not hasattr(comfy.model_management, "training_fp8_bwd"):
        pytest.skip("ComfyUI 0.3.75 dequantizes every quantized cast into fresh memory")
    counts, rows, shapes, flops, quantized_layers = step(ft, cast_contract, samples, mode, checkpointing)
    once = 2 if checkpointing else 1
    histogram = dict(sorted(collections.Counter(counts.values()).items()))
    linear_flops = {name: 2 * rows[name] * shapes[name][0] * shapes[name][1] for name in counts}
    ran = sum(count * linear_flops[name] for name, count in counts.items())
    ideal = sum(once * f for f in linear_flops.values())
    print(
        f"\n{mode}, checkpointing {checkpointing}: forwards per block Linear {histogram} (forwards: "
        f"layers), block Linear FLOPs {ran / ideal:.3f} x {once} forwards each; the step's counted "
        f"FLOPs {flops / plain_flops[checkpointing]:.4f} x the plain model's"
    )
    assert set(counts) == set(shapes)  # every block Linear ran
    extra = {name: count - once for name, count in counts.items() if count != once}
    if mode in RECOMPUTED:  # the per-layer recompute: one forward more where it ran
        assert extra and set(extra.values()) == {1}, counts
        assert set(extra) <= quantized_layers  # those whose input needs a gradient
        assert flops > plain_flops[checkpointing]  # printed above: 1.27 and 1.41 x
    else:
        assert not extra, counts
        assert flops == plain_flops[checkpointing]
