"""Training on ComfyUI's quantized Linear (`mixed_precision_ops`: an `nn.Module`, not an
`nn.Linear`, holding a `QuantizedTensor`), the layer every quantized file loads into on
ComfyUI 0.33 (fp8_scaled, fp8mixed, comfy_quant) and fp8mixed files on 0.3.75. On 70adb75
such a MODEL failed with "no layers to train".

Reference: the plain tiny model with each quantized layer's weight replaced by ComfyUI's own
dequantization of it (`QuantizedTensor.dequantize`). On the CPU ComfyUI computes fp8 layers
in full precision (no fp8 matmul here: its `full_precision_mm` path dequantizes and runs
`F.linear`), so the quantized model's gradients must equal the reference's to float32
rounding: 1e-5 relative (the dequantization is exact in float32; only the summation order of
a few ops may differ)."""

from __future__ import annotations

import pytest
import torch

from kt_testing.gradients import randomise_lora
from kt_testing.probes import tiny_samples
from kt_testing.quantized_files import block_linear_layers, quantized_flux_model
from kt_testing.tiny_models import TINY_FAMILIES, TINY_FLUX2_CONFIG, TINY_FLUX_CONFIG, flux_patcher

CONFIGS = {"flux": TINY_FLUX_CONFIG, "flux2": TINY_FLUX2_CONFIG}
pytestmark = pytest.mark.usefixtures("comfy_runtime")


@pytest.fixture(scope="module")
def mods(pack_import):
    names = {"ft": "nodes.flux_training", "loop": "trainer_core.loop", "flow_step": "trainer_core.flow_step"}
    return type("Mods", (), {key: pack_import(name) for key, name in names.items()})


def skip_unless_this_comfyui_has(fmt: str) -> None:
    from comfy.quant_ops import QUANT_ALGOS

    if fmt not in QUANT_ALGOS:
        pytest.skip(f"this ComfyUI has no {fmt} format (0.3.75: float8_e4m3fn only)")


def dequantized_reference(quantized, plain):
    """The plain model (modified) with every quantized layer's weight as ComfyUI dequantizes it."""
    reference = plain
    layers = dict(quantized.diffusion_model.named_modules())
    with torch.no_grad():
        for name in block_linear_layers(plain.diffusion_model):
            weight = layers[name].weight
            reference.diffusion_model.get_submodule(name).weight.copy_(weight.dequantize().float())
    return reference


def gradients(mods, model, family, checkpointing=True):
    tiny = TINY_FAMILIES[family]
    samples = tiny_samples(mods.flow_step.Sample, 2, 2, [(8, 8)], channels=tiny.channels, pooled=tiny.pooled)
    config = mods.ft.TrainConfig(
        rank=4, alpha=4.0, targets="all_linear", layout=tiny.layout, gradient_checkpointing=checkpointing
    )
    with torch.inference_mode(False), mods.ft.flux_lora_session(flux_patcher(model), config) as session:
        randomise_lora(session, seed=3)
        names = list(session.lora.names)
        loss = session.loss(samples, torch.Generator().manual_seed(11))
        grads = torch.autograd.grad(loss, session.lora.parameters())
    return names, loss.detach(), torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_quantized_layers_are_comfyuis_and_not_linear(family):
    quantized, _ = quantized_flux_model(CONFIGS[family], seed=1)
    layer = quantized.diffusion_model.double_blocks[0].img_attn.qkv
    assert not isinstance(layer, torch.nn.Linear)  # the case 70adb75 missed
    assert type(layer.weight).__name__ == "QuantizedTensor"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_gradients_through_comfyuis_quantized_linear_equal_the_dequantized_reference(
    mods, family, fmt, checkpointing
):
    skip_unless_this_comfyui_has(fmt)
    quantized, plain = quantized_flux_model(CONFIGS[family], seed=1, fmt=fmt)
    names, loss, ours = gradients(mods, quantized, family, checkpointing)
    ref_names, ref_loss, reference = gradients(
        mods, dequantized_reference(quantized, plain), family, checkpointing
    )
    assert names == ref_names  # the same layers adapted, quantized or not
    assert any(".img_attn.qkv" in n for n in names) and any("linear1" in n for n in names)
    error = float((ours - reference).norm() / reference.norm())
    print(f"\n{fmt} {family}: loss {float(loss):.6f} vs {float(ref_loss):.6f}, gradient error {error:.1e}")
    assert float(reference.abs().max()) > 0
    assert error <= 1e-5
    assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss))


def test_training_a_quantized_model_learns_and_leaves_it_untouched(mods):
    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    before = {k: v.clone() for k, v in quantized.diffusion_model.state_dict().items()}
    samples = tiny_samples(mods.flow_step.Sample, 4, 2, [(8, 8)])
    config = mods.ft.TrainConfig(steps=8, rank=4, alpha=4.0, learning_rate=1e-3)
    with torch.inference_mode(False), mods.ft.flux_lora_session(flux_patcher(quantized), config) as session:
        losses = mods.loop.train(
            config, session.lora.parameters(), lambda i: [samples[i % 4]], session.loss
        ).losses
    assert all(torch.isfinite(torch.tensor(losses)))
    after = quantized.diffusion_model.state_dict()
    assert before.keys() == after.keys()  # no LoRA keys left behind, the layers are ComfyUI's again
    assert all(
        torch.equal(
            before[k].view(torch.uint8) if before[k].dtype.itemsize == 1 else before[k],
            after[k].view(torch.uint8) if after[k].dtype.itemsize == 1 else after[k],
        )
        for k in before
    )


def test_fp8_scaled_on_a_quantized_model_is_refused_in_one_line(mods):
    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    config = mods.ft.TrainConfig(fp8_mode="fp8_scaled")
    with pytest.raises(ValueError, match=r"already quantized .*Set fp8_mode to as_loaded") as refused:
        with torch.inference_mode(False), mods.ft.flux_lora_session(flux_patcher(quantized), config):
            pass
    assert "\n" not in str(refused.value)


def test_the_vram_estimate_counts_the_stored_fp8_bytes(pack_import):
    cast_contract = pack_import("nodes.cast_contract")
    quantized, plain = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    qkv = "double_blocks.0.img_attn.qkv"
    assert cast_contract.stored_weight_bytes(quantized.diffusion_model.get_submodule(qkv)) == 1
    assert cast_contract.stored_weight_bytes(plain.diffusion_model.get_submodule(qkv)) == 4
    assert qkv in cast_contract.quantized_layers(quantized.diffusion_model)
    assert not cast_contract.quantized_layers(plain.diffusion_model)


def test_after_training_the_model_gives_its_state_dict_in_the_executor(mods):
    """The stock LoraLoader (and TrainLoRA's output MODEL) reads the model's state dict under
    inference mode; on ComfyUI 0.3.75 that failed ("Cannot set version_counter for inference
    tensor") once training had swapped the loaded quantized weights for normal copies: they go
    back as loaded when the run ends."""
    with torch.inference_mode():  # the stock loader builds it in the executor
        quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    qkv = quantized.diffusion_model.double_blocks[0].img_attn.qkv
    loaded = qkv.weight
    with (
        torch.inference_mode(False),
        mods.ft.flux_lora_session(flux_patcher(quantized), mods.ft.TrainConfig()),
    ):
        assert qkv.weight is not loaded  # training computes with an autograd-usable copy
    assert qkv.weight is loaded
    with torch.inference_mode():
        assert "double_blocks.0.img_attn.qkv.weight" in quantized.diffusion_model.state_dict()
