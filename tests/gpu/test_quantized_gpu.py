"""ComfyUI's quantized Linear on the GPU (issue 29): a tiny Flux whose block Linears hold e4m3
weights quantized by ComfyUI's own code, trained on CUDA (bf16 compute; on a GPU with fp8
compute, ComfyUI 0.33 runs QuantLinearFunc: input quantized, fp8 matmul), against the same
quantized model computed on the CPU in fp32 (ComfyUI dequantizes there). Then fp8_mode
fp8_backward (0.33 with fp8 compute), whose e5m2 output gradients stay within e5m2's bound.

Tolerances: bf16 compute against fp32 as in test_fp8_training (loss 0.005, gradients 0.05);
the GPU's fp8 matmul also rounds the input to e4m3 (3 mantissa bits: up to 6% per value,
averaging out over a layer's sum), so the gradients get 0.1."""

from __future__ import annotations

from gpu.support import loss_and_grads, randomise_lora, relative_error

BF16_LOSS = 0.005
FP8_MATMUL_GRADIENTS = 0.1
E5M2_BOUND = 0.125  # 2 mantissa bits: at most 2^-3 relative per rounded value


def cpu_quantized_patcher(model):
    import comfy.model_patcher
    import torch

    return comfy.model_patcher.ModelPatcher(
        model, load_device=torch.device("cpu"), offload_device=torch.device("cpu")
    )


def test_a_quantized_model_trains_on_the_gpu_as_on_the_cpu(gpu, mods):
    import torch

    from kt_testing.probes import tiny_samples
    from kt_testing.quantized_files import quantized_flux_model
    from kt_testing.tiny_models import TINY_FLUX_CONFIG, flux_patcher

    samples = tiny_samples(mods.flow_step.Sample, 2, 2, [(8, 8)])
    config = mods.ft.TrainConfig(rank=4, alpha=4.0, targets="all_linear", seed=1)
    reference_model, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1, compute=torch.float32)
    with mods.ft.lora_session(cpu_quantized_patcher(reference_model), config) as session:
        randomise_lora(session, seed=2)
        reference_loss, reference_grads = loss_and_grads(session, samples)

    model, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1, compute=torch.bfloat16)
    with mods.ft.lora_session(flux_patcher(model), config) as session:
        qkv = session.diffusion_model.double_blocks[0].img_attn.qkv.get_base_layer()
        assert type(qkv.weight).__name__ == "QuantizedTensor" and qkv.weight.device.type == gpu.device.type
        randomise_lora(session, seed=2)
        loss, grads = loss_and_grads(session, samples)
    loss_error = abs(float(loss) - float(reference_loss)) / float(reference_loss)
    gradient_error = relative_error(grads, reference_grads)
    print(
        f"\nquantized e4m3 on {gpu.device} vs the CPU: loss {loss_error:.2e}, gradients {gradient_error:.2e}"
    )
    assert loss_error <= BF16_LOSS and gradient_error <= FP8_MATMUL_GRADIENTS


def test_fp8_backward_on_the_gpu(gpu, mods):
    import comfy.model_management as mm
    import pytest
    import torch

    from kt_testing.probes import tiny_samples
    from kt_testing.quantized_files import quantized_flux_model
    from kt_testing.tiny_models import TINY_FLUX_CONFIG, flux_patcher

    if not hasattr(mm, "training_fp8_bwd") or not mm.supports_fp8_compute(gpu.device):
        pytest.skip("fp8_backward needs ComfyUI 0.33+ and a device with fp8 compute")
    samples = tiny_samples(mods.flow_step.Sample, 2, 2, [(8, 8)])
    model, _ = quantized_flux_model(TINY_FLUX_CONFIG, seed=1, compute=torch.bfloat16)
    grads = {}
    for mode in ("as_loaded", "fp8_backward"):
        config = mods.ft.TrainConfig(rank=4, alpha=4.0, targets="all_linear", seed=1, fp8_mode=mode)
        with mods.ft.lora_session(flux_patcher(model), config) as session:
            randomise_lora(session, seed=2)
            _, grads[mode] = loss_and_grads(session, samples)
    error = relative_error(grads["fp8_backward"], grads["as_loaded"])
    print(f"\nfp8 backward on {gpu.device}: LoRA gradients {error:.2e} from the exact backward's")
    assert 0 < error <= E5M2_BOUND
