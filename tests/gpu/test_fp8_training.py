"""fp8 on the GPU: base weights as the stock UNETLoader stores them for weight_dtype
fp8_e4m3fn (e4m3 in memory, computed in bf16), and fp8_mode=fp8_scaled on a bf16 model, each
against references computed on the CPU."""

from __future__ import annotations

from gpu.support import (
    cpu_patcher,
    loss_and_grads,
    model_output,
    randomise_lora,
    relative_error,
    relative_rms,
    tensor_bytes,
    unload_everything,
)

# Same stored e4m3 values on both sides: only the compute precision differs (bf16 on the GPU,
# fp32 on the CPU), so the bf16 tolerances of test_flux_training apply.
BF16_LOSS = 0.005
BF16_GRADIENTS = 0.05
# Eight steps against full-precision fp32 weights: the CPU layer bounds fp8 at 2% with fp32
# compute; the dry run (bf16 compute on the CPU) measured 2.1% for fp8 and 0.5% for fp8_scaled.
FP8_LOSSES = 0.04
# fp8_scaled's output against the fp32 model: the CPU layer bounds it at 5% with fp32 compute;
# the dry run measured 2.6%.
FP8_SCALED_OUTPUT = 0.06


def fp8_config(mods, **overrides):
    settings = {"steps": 8, "rank": 4, "alpha": 4.0, "learning_rate": 1e-3, "seed": 1}
    return mods.ft.TrainConfig(**{**settings, **overrides})


def train_losses(mods, model, config, samples):
    with mods.ft.lora_session(model, config) as session:
        return mods.loop.train(
            config, session.lora.parameters(), lambda i: [samples[i % len(samples)]], session.loss
        ).losses


def relative_losses(got, expected) -> float:
    return max(abs(g - e) / abs(e) for g, e in zip(got, expected, strict=True))


def test_fp8_base_weights_train_on_the_gpu_as_on_the_cpu(gpu, mods):
    """e4m3 weights with bf16 compute (the stock UNETLoader's fp8 on a bf16 GPU) against the
    same e4m3 weights computed in fp32 on the CPU; the weights stay e4m3 in GPU memory while
    training; eight steps follow the full-precision fp32 model; the MODEL is left as loaded."""
    import torch

    from kt_testing.probes import tiny_samples
    from kt_testing.tiny_models import tiny_flux_patcher

    e4m3 = torch.float8_e4m3fn
    samples = tiny_samples(mods.flow_step.Sample, 4, 2, [(8, 8)])
    config = fp8_config(mods)
    with mods.ft.lora_session(cpu_patcher(1, e4m3, torch.float32), config) as session:
        randomise_lora(session, seed=2)
        reference_loss, reference_grads = loss_and_grads(session, samples[:2])

    model = tiny_flux_patcher(seed=1, dtype=e4m3, manual_cast_dtype=torch.bfloat16)
    before = model_output(model)
    with mods.ft.lora_session(model, config) as session:
        lora_ids = {id(p) for p in session.lora.parameters()}
        base = [p for p in session.diffusion_model.parameters() if id(p) not in lora_ids]
        assert {(p.dtype, p.device) for p in base} == {(e4m3, gpu.device)}  # never upcast in memory
        randomise_lora(session, seed=2)
        loss, grads = loss_and_grads(session, samples[:2])
    loss_error = abs(float(loss) - float(reference_loss)) / float(reference_loss)
    gradient_error = relative_error(grads, reference_grads)

    fp8 = train_losses(mods, model, config, samples)
    full = train_losses(mods, cpu_patcher(seed=1), config, samples)
    print(f"\nfp8 on {gpu.device} vs fp8/fp32 on cpu: loss {loss_error:.2e}, gradients {gradient_error:.2e}")
    print(
        f"  8 steps vs full precision on cpu: worst relative loss difference {relative_losses(fp8, full):.2e}"
    )
    assert loss_error <= BF16_LOSS and gradient_error <= BF16_GRADIENTS
    assert all(torch.isfinite(torch.tensor(fp8))) and relative_losses(fp8, full) <= FP8_LOSSES
    assert {p.dtype for p in model.model.diffusion_model.parameters()} == {e4m3}
    assert torch.equal(model_output(model), before)


def test_fp8_scaled_on_the_gpu_follows_full_precision_and_restores_the_model(gpu, mods):
    """fp8_scaled on a bf16 model: block attention / MLP weights e4m3 on the GPU, modulation as
    loaded; the output and eight steps follow the fp32 model on the CPU; afterwards the scaled
    layers hold their original Parameter objects, every weight its values, and the MODEL gives
    the same output as before. (Other Parameters may be new objects over the same values: the
    GPU move made under inference mode leaves tensors with no version counter, which
    `make_autograd_safe_` replaces as ComfyUI's weight patching does; the first H200 run saw
    that, the CPU dry run cannot, where nothing moves.)"""
    import torch

    from kt_testing.probes import tiny_samples
    from kt_testing.tiny_models import tiny_flux_patcher

    samples = tiny_samples(mods.flow_step.Sample, 4, 2, [(8, 8)])
    config = fp8_config(mods, fp8_mode="fp8_scaled")
    full_output = model_output(cpu_patcher(seed=1))
    full = train_losses(mods, cpu_patcher(seed=1), fp8_config(mods), samples)

    model = tiny_flux_patcher(seed=1, dtype=torch.bfloat16)
    before, parameters = model_output(model), dict(model.model.diffusion_model.named_parameters())
    values = {name: parameter.detach().cpu().clone() for name, parameter in parameters.items()}
    with mods.ft.lora_session(model, config) as session:
        names = ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear2", "double_blocks.0.img_mod.lin")
        layers = [session.diffusion_model.get_submodule(n) for n in names]
        weights = [getattr(layer, "base_layer", layer).weight for layer in layers]
        # read here: on exit ComfyUI unloads the clone, which moves these same Parameters to
        # the CPU (the first GPU run read them after the exit and saw "cpu")
        placement = [(w.dtype, w.device) for w in weights]
        scaled_output = model_output(
            session.patcher, transformer_options=session.transformer_options(), load=False
        )
        losses = mods.loop.train(
            config, session.lora.parameters(), lambda i: [samples[i % 4]], session.loss
        ).losses
    assert placement == [
        (torch.float8_e4m3fn, gpu.device),
        (torch.float8_e4m3fn, gpu.device),
        (torch.bfloat16, gpu.device),  # modulation stays as loaded
    ]
    output_error, loss_error = relative_rms(scaled_output, full_output), relative_losses(losses, full)
    print(
        f"\nfp8_scaled on {gpu.device} vs fp32 on cpu: output {output_error:.2e}, 8 losses {loss_error:.2e}"
    )
    assert 0 < output_error <= FP8_SCALED_OUTPUT
    assert loss_error <= FP8_LOSSES
    after = dict(model.model.diffusion_model.named_parameters())
    scaled = [f"{name}.weight" for name in names[:2]]
    assert all(after[name] is parameters[name] for name in scaled)
    renewed = sorted(name for name in parameters if after[name] is not parameters[name])
    print(f"Parameters renewed over the same values: {len(renewed)} of {len(parameters)}")
    assert all(torch.equal(after[name].detach().cpu(), value) for name, value in values.items())
    assert torch.equal(model_output(model), before)


WIDE = {"hidden_size": 1024, "num_heads": 8, "axes_dim": [16, 56, 56]}  # head dim 128, like Flux


def test_fp8_scaled_never_puts_the_bf16_block_weights_on_the_gpu(cuda_only, mods):
    """From a MODEL not yet on the GPU, what the GPU holds once a fp8_scaled session has started
    is below the bf16 weights minus a third of the scaled layers' bf16 bytes (e4m3 halves them),
    and its peak meanwhile is below the bf16 weights: the block attention / MLP weights reach the
    GPU only as e4m3, one layer at a time. H200, first run: bf16 weights 215.6 MiB (scaled
    layers 144.0), resident 151.3 MiB (bound 165.2), peak 182.1 MiB: the resident weights plus
    the start's guard forward, which casts the largest layer (linear1, 1024 x 7168) to bf16 and
    scales it in float32 (~28 MiB). The regression, bf16 block weights on the GPU, holds all
    215.6 MiB at once, so its resident and its peak both exceed their bounds."""
    import torch

    from kt_testing.tiny_models import tiny_flux_patcher

    model = tiny_flux_patcher(seed=1, dtype=torch.bfloat16, **WIDE)
    flux = model.model.diffusion_model
    linears = [n for n, m in flux.named_modules() if isinstance(m, torch.nn.Linear)]
    scaled = mods.lora_targets.target_module_names(linears, "attention_mlp")
    scaled_bytes = tensor_bytes(flux.get_submodule(n).weight for n in scaled)
    bf16_bytes = mods.vram.module_weight_bytes(flux)
    unload_everything()
    torch.cuda.reset_peak_memory_stats(cuda_only.device)
    base = torch.cuda.memory_allocated(cuda_only.device)
    config = fp8_config(mods, fp8_mode="fp8_scaled", rank=4)
    with mods.ft.lora_session(model, config):
        resident = torch.cuda.memory_allocated(cuda_only.device) - base
        peak = torch.cuda.max_memory_allocated(cuda_only.device) - base
    bound = bf16_bytes - 0.35 * scaled_bytes
    mib = 2**20
    print(
        f"\nfp8_scaled start: bf16 weights {bf16_bytes / mib:.1f} MiB (scaled layers "
        f"{scaled_bytes / mib:.1f}); GPU resident {resident / mib:.1f} MiB, peak {peak / mib:.1f} MiB, "
        f"bound {bound / mib:.1f} MiB"
    )
    assert resident <= bound and peak < bf16_bytes
