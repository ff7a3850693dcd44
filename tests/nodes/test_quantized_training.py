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


def test_the_stored_bytes_and_formats_are_read_from_the_quantized_layers(pack_import):
    """The VRAM estimate reads the bytes per stored weight, the metadata the formats."""
    comfy_quantized = pack_import("nodes.comfy_quantized")
    quantized, plain = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    qkv = "double_blocks.0.img_attn.qkv"
    assert comfy_quantized.stored_weight_bytes(quantized.diffusion_model.get_submodule(qkv)) == 1
    assert comfy_quantized.stored_weight_bytes(plain.diffusion_model.get_submodule(qkv)) == 4
    assert qkv in comfy_quantized.quantized_layers(quantized.diffusion_model)
    assert not comfy_quantized.quantized_layers(plain.diffusion_model)
    blocks = len(block_linear_layers(plain.diffusion_model))
    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.diffusion_model.modules())
    formats = comfy_quantized.weight_formats(quantized.diffusion_model)
    assert formats == {"quantized": {"float8_e4m3fn": blocks}, "plain": {"float32": linears - blocks}}


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


# --- ComfyUI's fp8 matmul path (QuantLinearFunc), as on a GPU with fp8 compute --------------------


@pytest.fixture
def fp8_compute(monkeypatch):
    """ComfyUI 0.33 with fp8 compute forced (`--supports-fp8-compute`: its SUPPORT_FP8_OPS), so
    quantized layers run `QuantLinearFunc` (input quantized, fp8 matmul; comfy-kitchen's eager
    `_scaled_mm` runs on the CPU). Counts QuantLinearFunc's forwards and comfy-kitchen's
    dequantize fallbacks (an op it has no quantized kernel for)."""
    import comfy.model_management as mm
    import comfy.ops

    if not hasattr(mm, "training_fp8_bwd"):
        pytest.skip("ComfyUI 0.3.75 has no QuantLinearFunc (0.33+)")
    from comfy.quant_ops import QuantizedTensor

    counts = {"quant_linear": 0, "fallback": 0}
    forward, fallback = comfy.ops.QuantLinearFunc.forward, QuantizedTensor._dequant_and_fallback.__func__

    def counted_forward(ctx, *args):
        counts["quant_linear"] += 1
        return forward(ctx, *args)

    def counted_fallback(cls, func, args, kwargs):
        counts["fallback"] += 1
        return fallback(cls, func, args, kwargs)

    monkeypatch.setattr(mm, "SUPPORT_FP8_OPS", True)
    monkeypatch.setattr(comfy.ops.QuantLinearFunc, "forward", staticmethod(counted_forward))
    monkeypatch.setattr(QuantizedTensor, "_dequant_and_fallback", classmethod(counted_fallback))
    return counts


def with_input_quantization(reference, quantized, fmt):
    """Forward pre-hooks on the reference's quantized positions: the input goes through
    ComfyUI's own quantize-dequantize in the layer's layout (per-tensor scale, as
    QuantLinearFunc quantizes it), its gradient straight through (QuantLinearFunc's backward
    multiplies by the dequantized weight)."""
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor

    layout = QUANT_ALGOS[fmt]["comfy_tensor_layout"]

    def fake_quantize(module, args):
        x = args[0]
        flat = x.detach().flatten(0, -2)
        rounded = QuantizedTensor.from_float(flat, layout).dequantize().to(x.dtype).view_as(x)
        return (x + (rounded - x).detach(), *args[1:])

    names = block_linear_layers(reference.diffusion_model)
    for name in names:
        reference.diffusion_model.get_submodule(name).register_forward_pre_hook(fake_quantize)
    return reference


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_the_fp8_matmul_path_equals_a_reference_with_input_quantization(mods, fp8_compute, fmt):
    """Exact path (training_fp8_bwd off): fp8 x fp8 products are exact in float32 and both sides
    scale by the same per-tensor scales, so only the summation order differs: 1e-5 relative."""
    quantized, plain = quantized_flux_model(TINY_FLUX_CONFIG, seed=1, fmt=fmt)
    assert not quantized.diffusion_model.double_blocks[0].img_attn.qkv._full_precision_mm
    _, loss, ours = gradients(mods, quantized, "flux")
    assert fp8_compute["quant_linear"] > 0 and fp8_compute["fallback"] == 0
    reference = with_input_quantization(dequantized_reference(quantized, plain), quantized, fmt)
    _, ref_loss, expected = gradients(mods, reference, "flux")
    error = float((ours - expected).norm() / expected.norm())
    print(f"\n{fmt} fp8 matmuls: loss {float(loss):.6f} vs {float(ref_loss):.6f}, gradient error {error:.1e}")
    assert error <= 1e-5
    assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss))


def test_fp8_backward_rounds_the_gradients_within_e5m2s_bound(mods, fp8_compute):
    """fp8_mode fp8_backward: ComfyUI's QuantLinearFunc multiplies the output gradient, rounded
    to e5m2 (2 mantissa bits: at most 2^-3 = 12.5% relative per element), in fp8. The LoRA
    gradients stay within that bound of the exact path's and differ from it (the fp8 backward
    ran); the flag is ComfyUI's again after the run."""
    import comfy.model_management as mm

    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    tiny = TINY_FAMILIES["flux"]
    samples = tiny_samples(mods.flow_step.Sample, 2, 2, [(8, 8)], channels=tiny.channels, pooled=tiny.pooled)
    results = {}
    for mode in ("as_loaded", "fp8_backward"):
        config = mods.ft.TrainConfig(rank=4, alpha=4.0, targets="all_linear", fp8_mode=mode)
        with (
            torch.inference_mode(False),
            mods.ft.flux_lora_session(flux_patcher(quantized), config) as session,
        ):
            assert mm.training_fp8_bwd is (mode == "fp8_backward")
            randomise_lora(session, seed=3)
            loss = session.loss(samples, torch.Generator().manual_seed(11))
            grads = torch.autograd.grad(loss, session.lora.parameters())
        results[mode] = torch.cat([g.flatten() for g in grads])
    assert mm.training_fp8_bwd is False
    assert fp8_compute["fallback"] == 0
    error = float((results["fp8_backward"] - results["as_loaded"]).norm() / results["as_loaded"].norm())
    print(f"\nfp8 backward: LoRA gradient {error:.2e} relative to the exact path's")
    assert 1e-4 < error <= 0.125


def test_fp8_backward_is_refused_in_one_line_where_it_cannot_run(mods):
    import comfy.model_management as mm

    quantized, plain = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    config = mods.ft.TrainConfig(fp8_mode="fp8_backward")
    cases = [(plain, "needs ComfyUI 0.33" if not hasattr(mm, "training_fp8_bwd") else "this MODEL has none")]
    if hasattr(mm, "training_fp8_bwd"):  # this CPU has no fp8 compute: ComfyUI computes in full precision
        cases.append((quantized, "in full precision on this device"))
    for model, words in cases:
        with pytest.raises(ValueError, match=words) as refused:
            with torch.inference_mode(False), mods.ft.flux_lora_session(flux_patcher(model), config):
                pass
        assert "\n" not in str(refused.value)


def test_the_stored_size_counts_the_packed_values(pack_import):
    vram = pack_import("trainer_core.vram")
    quantized, plain = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    layers = block_linear_layers(plain.diffusion_model)
    block_weights = sum(plain.diffusion_model.get_submodule(n).weight.numel() for n in layers)
    # fp32 -> fp8 for the block Linear weights: 3 bytes less per value, the rest as it was
    expected = vram.module_weight_bytes(plain.diffusion_model) - 3 * block_weights
    assert vram.module_weight_bytes(quantized.diffusion_model) == expected
