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

import importlib

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
    names = {
        "ft": "comfy_adapter.lora_session",
        "loop": "trainer_core.loop",
        "flow_step": "trainer_core.flow_step",
    }
    return type("Mods", (), {key: pack_import(name) for key, name in names.items()})


def skip_unless_this_comfyui_has(fmt: str) -> None:
    from comfy.quant_ops import QUANT_ALGOS

    if fmt not in QUANT_ALGOS:
        pytest.skip(
            f"this ComfyUI has no {fmt} format (0.3.75: float8_e4m3fn only; mxfp8 needs comfy-kitchen's)"
        )


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
    with torch.inference_mode(False), mods.ft.lora_session(flux_patcher(model), config) as session:
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


# ComfyUI 0.33's formats on the CPU: fp8 layers computed in full precision (no fp8 compute),
# nvfp4 and mxfp8 dequantized (no kernels), int8_tensorwise through comfy-kitchen's int8 linear
# (each input row quantized to int8 with its own scale, products exact in int32, the gradient
# through the dequantized weight); 0.3.75 knows float8_e4m3fn only.
FORMATS = ["float8_e4m3fn", "float8_e5m2", "nvfp4", "mxfp8", "int8_tensorwise"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_gradients_through_comfyuis_quantized_linear_equal_the_dequantized_reference(
    mods, family, fmt, checkpointing
):
    skip_unless_this_comfyui_has(fmt)
    quantized, plain = quantized_flux_model(CONFIGS[family], seed=1, fmt=fmt)
    assert getattr(quantized.diffusion_model.double_blocks[0].img_attn.qkv, "quant_format", fmt) == fmt
    names, loss, ours = gradients(mods, quantized, family, checkpointing)
    reference_model = dequantized_reference(quantized, plain)
    if fmt == "int8_tensorwise":  # "weight-only" by name, yet its kernel quantizes each input row
        reference_model = with_input_quantization(reference_model, quantized, fmt)
    ref_names, ref_loss, reference = gradients(mods, reference_model, family, checkpointing)
    assert names == ref_names  # the same layers adapted, quantized or not
    assert any(".img_attn.qkv" in n for n in names) and any("linear1" in n for n in names)
    error = float((ours - reference).norm() / reference.norm())
    print(f"\n{fmt} {family}: loss {float(loss):.6f} vs {float(ref_loss):.6f}, gradient error {error:.1e}")
    assert float(reference.abs().max()) > 0
    assert error <= TOLERANCE.get(fmt, 1e-5)
    assert abs(float(loss - ref_loss)) <= TOLERANCE.get(fmt, 1e-5) * abs(float(ref_loss))


# Whole-model tolerances: 1e-5 where both sides compute the same float32 values in another
# order. int8 re-quantizes every layer's input: one int8 step is 1/127 (0.8%) of the row's
# largest value, and float32 differences of 1e-7 between the two sides move a few inputs across
# a rounding boundary, which the later blocks pass on (measured: loss 3e-4, gradients 7.7e-3
# FLUX.1, 1.4e-2 FLUX.2). The single-layer test below holds int8 to 1e-6.
TOLERANCE = {"int8_tensorwise": 2e-2}


def test_one_int8_layer_equals_row_quantized_input_times_the_dequantized_weight(mods):
    """comfy-kitchen's int8 linear under the cast contract: output and input gradient of one
    layer against the formula (each row of the input, and in the backward of the output
    gradient, rounded to int8 with scale max|row| / 127, times the dequantized weight), to
    float32 rounding: 1e-6."""
    skip_unless_this_comfyui_has("int8_tensorwise")
    from comfy_kitchen.backends.eager.quantization import quantize_int8_rowwise

    cast_contract = importlib.import_module(mods.ft.__name__.rsplit(".", 1)[0] + ".cast_contract")
    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1, fmt="int8_tensorwise")
    layer = quantized.diffusion_model.double_blocks[0].img_attn.qkv
    remove = cast_contract.recast_in_backward(torch.nn.Sequential(layer))
    try:
        with torch.inference_mode(False):
            weight = layer.weight.dequantize().float()
            x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
            out = layer(x)
            direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            (grad,) = torch.autograd.grad(out, x, direction)
            values, scale = quantize_int8_rowwise(x.detach())
            expected = torch.nn.functional.linear(values.float() * scale, weight, layer.bias.detach())
    finally:
        remove()
    assert float((out - expected).norm() / expected.norm()) <= 1e-6
    # the backward's matmul with the int8 weight is comfy-kitchen's int8 mm too: the output
    # gradient's rows are rounded to int8 the same way
    rows, row_scale = quantize_int8_rowwise(direction)
    expected_grad = (rows.float() * row_scale) @ weight
    assert float((grad - expected_grad).norm() / expected_grad.norm()) <= 1e-6


def test_training_a_quantized_model_learns_and_leaves_it_untouched(mods):
    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    before = {k: v.clone() for k, v in quantized.diffusion_model.state_dict().items()}
    samples = tiny_samples(mods.flow_step.Sample, 4, 2, [(8, 8)])
    config = mods.ft.TrainConfig(steps=8, rank=4, alpha=4.0, learning_rate=1e-3)
    with torch.inference_mode(False), mods.ft.lora_session(flux_patcher(quantized), config) as session:
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


def assert_refused_in_one_line(mods, model, config, words: str) -> None:
    """The session refuses `model` with a one-line ValueError matching `words`, before any step."""
    with pytest.raises(ValueError, match=words) as refused:
        with torch.inference_mode(False), mods.ft.lora_session(flux_patcher(model), config):
            pass
    assert "\n" not in str(refused.value) and "no layers to train" not in str(refused.value)


def test_fp8_scaled_on_a_quantized_model_is_refused_in_one_line(mods):
    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    config = mods.ft.TrainConfig(fp8_mode="fp8_scaled")
    assert_refused_in_one_line(mods, quantized, config, r"already quantized .*Set fp8_mode to as_loaded")


def test_the_stored_bytes_and_formats_are_read_from_the_quantized_layers(pack_import):
    """The VRAM estimate reads the bytes per stored weight, the metadata the formats."""
    comfy_quantized = pack_import("comfy_adapter.comfy_quantized")
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
        mods.ft.lora_session(flux_patcher(quantized), mods.ft.TrainConfig()),
    ):
        assert qkv.weight is not loaded  # training computes with an autograd-usable copy
    # as loaded again (0.3.75), or what ComfyUI's own unload made of it (0.33 re-wraps quantized
    # weights whenever it moves them): either way the executor can read the state dict
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

    def rounded(x):
        if fmt == "int8_tensorwise":  # comfy-kitchen's int8 linear: int8 rows, one scale per row
            from comfy_kitchen.backends.eager.quantization import quantize_int8_rowwise

            values, scale = quantize_int8_rowwise(x)
            return values.float() * scale
        return QuantizedTensor.from_float(x.flatten(0, -2), layout).dequantize().view_as(x)

    def fake_quantize(module, args):
        x = args[0]
        return (x + (rounded(x.detach()).to(x.dtype) - x).detach(), *args[1:])

    def rounded_output_gradient(module, grad_output):  # int8's backward mm rounds its rows too
        return (rounded(grad_output[0]).to(grad_output[0].dtype),)

    names = block_linear_layers(reference.diffusion_model)
    for name in names:
        layer = reference.diffusion_model.get_submodule(name)
        layer.register_forward_pre_hook(fake_quantize)
        if fmt == "int8_tensorwise":
            layer.register_full_backward_pre_hook(rounded_output_gradient)
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
            mods.ft.lora_session(flux_patcher(quantized), config) as session,
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


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
def test_fp8_backwards_copies_of_the_inputs_do_not_outlive_the_forward(
    mods, fp8_compute, monkeypatch, checkpointing
):
    """fp8_mode fp8_backward keeps, for ComfyUI's fp8 backward, an fp8 copy of each quantized
    Linear's input on its `QuantLinearFunc` node (`ctx.q_input`): a checkpoint never frees it,
    as it is no saved tensor. Measured here: the bytes of those copies still alive when the
    step's forward has returned, at two sizes (latents 8x8 and 16x16: 4x the image tokens).
    Training keeps none (the layer's forward leaves no node; its backward makes the copy again
    and drops it). On 419e28e (a per-layer checkpoint) they were alive at both sizes, growing
    with the tokens: about 1.06 MiB per token at FLUX.1 size, 9 GiB at 1024 px with a
    reference, which no VRAM estimate counted."""
    import weakref

    import comfy.ops

    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    tiny = TINY_FAMILIES["flux"]
    forward, copies = comfy.ops.QuantLinearFunc.forward, []

    def keeping_count(ctx, *args):
        out = forward(ctx, *args)
        if getattr(ctx, "q_input", None) is not None:
            copies.append(weakref.ref(ctx.q_input))
        return out

    monkeypatch.setattr(comfy.ops.QuantLinearFunc, "forward", staticmethod(keeping_count))
    config = mods.ft.TrainConfig(
        rank=4, alpha=4.0, targets="all_linear", fp8_mode="fp8_backward", gradient_checkpointing=checkpointing
    )
    alive = {}
    for side in (8, 16):
        samples = tiny_samples(
            mods.flow_step.Sample, 1, 2, [(side, side)], channels=tiny.channels, pooled=tiny.pooled
        )
        with torch.inference_mode(False), mods.ft.lora_session(flux_patcher(quantized), config) as session:
            copies.clear()
            loss = session.loss(samples, torch.Generator().manual_seed(11))
            made = len(copies)
            alive[side] = sum(c()._qdata.nbytes for c in copies if c() is not None)
            grads = torch.autograd.grad(loss, session.lora.parameters())
        assert made > 0  # ComfyUI's fp8 backward path ran: it made its copies
        assert all(torch.isfinite(g).all() for g in grads)
    print(f"\nfp8 input copies alive after the forward (checkpointing {checkpointing}): {alive} bytes")
    assert alive == {8: 0, 16: 0}


def test_fp8_backward_is_refused_in_one_line_where_it_cannot_run(mods):
    import comfy.model_management as mm

    quantized, plain = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    config = mods.ft.TrainConfig(fp8_mode="fp8_backward")
    cases = [(plain, "needs ComfyUI 0.33" if not hasattr(mm, "training_fp8_bwd") else "this MODEL has none")]
    if hasattr(mm, "training_fp8_bwd"):  # this CPU has no fp8 compute: ComfyUI computes in full precision
        cases.append((quantized, "in full precision on this device"))
    for model, words in cases:
        assert_refused_in_one_line(mods, model, config, words)


def test_the_stored_size_counts_the_packed_values(pack_import):
    vram = pack_import("trainer_core.vram")
    quantized, plain = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    layers = block_linear_layers(plain.diffusion_model)
    block_weights = sum(plain.diffusion_model.get_submodule(n).weight.numel() for n in layers)
    # fp32 -> fp8 for the block Linear weights: 3 bytes less per value, the rest as it was
    expected = vram.module_weight_bytes(plain.diffusion_model) - 3 * block_weights
    assert vram.module_weight_bytes(quantized.diffusion_model) == expected


# --- around the run: the LoRA file, start_from_lora, block swap --------------------------------------


def trained_file(mods, tmp_path, model, steps=3):
    samples = tiny_samples(mods.flow_step.Sample, 4, 2, [(8, 8)])
    config = mods.ft.TrainConfig(steps=steps, rank=4, alpha=4.0, learning_rate=1e-2, targets="all_linear")
    with torch.inference_mode(False), mods.ft.lora_session(flux_patcher(model), config) as session:
        mods.loop.train(config, session.lora.parameters(), lambda i: [samples[i % 4]], session.loss)
        return session.save(tmp_path / "quantized.safetensors", {}), session.lora.modules()


def test_a_lora_trained_on_a_quantized_file_applies_to_the_full_precision_model(mods, tmp_path, caplog):
    """Stock loading (`comfy.sd.load_lora_for_models`, what LoraLoader calls) puts every key of
    the file on the full-precision model, and each layer changes by the trained delta."""
    import comfy.sd
    from safetensors.torch import load_file

    quantized, plain = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    path, modules = trained_file(mods, tmp_path, quantized)
    patcher = flux_patcher(plain)
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, load_file(str(path)), 1.0, 0.0)
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    patched.patch_model()
    try:
        for name in (
            "double_blocks.0.img_attn.qkv",
            "single_blocks.1.linear2",
            "double_blocks.1.img_mod.lin",
        ):
            module = modules[name]
            delta = module.up.float() @ module.down.float() * (module.alpha / module.rank)
            layer = plain.diffusion_model.get_submodule(name)
            before = patcher.backup[f"diffusion_model.{name}.weight"].weight
            change = layer.weight.detach().float() - before.float()
            assert float(delta.abs().max()) > 0
            assert torch.allclose(change, delta, rtol=1e-2, atol=1e-3)  # the file is bf16
    finally:
        patched.unpatch_model()


def test_start_from_lora_on_a_quantized_model(mods, tmp_path, pack_import):
    training_run = pack_import("application.training_run")
    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    path, _ = trained_file(mods, tmp_path, quantized, steps=1)
    config = mods.ft.TrainConfig(rank=4, alpha=4.0, targets="all_linear")
    seed = training_run.seed_lora(path, flux_patcher(quantized), config)
    assert "double_blocks.0.img_attn.qkv" in seed
    with (
        torch.inference_mode(False),
        mods.ft.lora_session(flux_patcher(quantized), config, seed) as session,
    ):
        started = session.lora.modules()
    assert started.keys() == seed.keys()
    assert all(torch.equal(started[n].up, seed[n].up.float()) for n in seed)


def test_block_swap_on_a_quantized_model_gives_the_same_gradients(mods):
    """blocks_to_swap moves the quantized weights with their blocks (on the CPU both devices
    are the CPU, with the swapped blocks poisoned while away: a use of an absent block would
    show as NaN)."""
    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    samples = tiny_samples(mods.flow_step.Sample, 2, 2, [(8, 8)])
    results = []
    for swap in (0, 3):
        config = mods.ft.TrainConfig(rank=4, alpha=4.0, blocks_to_swap=swap, gradient_checkpointing=True)
        session_context = mods.ft.lora_session(
            flux_patcher(quantized), config, poison_swapped=bool(swap)
        )
        with torch.inference_mode(False), session_context as session:
            randomise_lora(session, seed=3)
            loss = session.loss(samples, torch.Generator().manual_seed(11))
            results.append(
                torch.cat([g.flatten() for g in torch.autograd.grad(loss, session.lora.parameters())])
            )
    assert torch.isfinite(results[1]).all()
    assert torch.equal(results[0], results[1])


def test_a_format_no_test_has_trained_is_refused_naming_it(mods, pack_import, monkeypatch):
    comfy_quantized = pack_import("comfy_adapter.comfy_quantized")
    monkeypatch.setattr(comfy_quantized, "TRAINED_FORMATS", ("nvfp4",))  # as if e4m3 were untried
    quantized, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1)
    words = r"in ComfyUI's float8_e4m3fn format, .* load this model's fp8"
    assert_refused_in_one_line(mods, quantized, mods.ft.TrainConfig(), words)


def test_fp8_scaled_on_comfyui_0375s_scaled_fp8_model_is_refused(mods):
    """0.3.75 loads the older scaled_fp8 form into `nn.Linear`s holding fp8 values and a
    `scale_weight`: re-quantizing those values without their scale would train another model."""
    import comfy.supported_models

    from kt_testing.quantized_files import comfy_reads_comfy_quant, in_form, quantized_tensors
    from kt_testing.tiny_models import build_flux_model, for_this_comfyui

    if comfy_reads_comfy_quant():
        pytest.skip("ComfyUI 0.33 converts the scaled_fp8 form to its quantized Linear (tested above)")
    plain = build_flux_model(TINY_FLUX_CONFIG, 1)
    state = plain.diffusion_model.state_dict()
    tensors, _ = in_form(
        *quantized_tensors(state, block_linear_layers(plain.diffusion_model), "float8_e4m3fn"), "scaled_fp8"
    )
    model_config = comfy.supported_models.Flux(for_this_comfyui(TINY_FLUX_CONFIG))
    model_config.scaled_fp8 = torch.float8_e4m3fn
    model_config.set_inference_dtype(torch.float8_e4m3fn, torch.float32)
    with torch.inference_mode():
        model = model_config.get_model({})
        tensors.pop("scaled_fp8")
        model.diffusion_model.load_state_dict(tensors, strict=False)
    qkv = model.diffusion_model.double_blocks[0].img_attn.qkv
    assert isinstance(qkv, torch.nn.Linear) and qkv.weight.dtype == torch.float8_e4m3fn
    config = mods.ft.TrainConfig(fp8_mode="fp8_scaled")
    assert_refused_in_one_line(mods, model, config, r"already quantized .*Set fp8_mode to as_loaded")
