"""Training the tiny Flux on the GPU against independent references: one bf16 step against
the same step in fp32 on the CPU, and a partial ("lowvram") load, with and without a LoRA
the stock loader applied, against a full load of the same MODEL."""

from __future__ import annotations

import contextlib

import pytest
from gpu.support import (
    cpu_patcher,
    loss_and_grads,
    model_output,
    randomise_lora,
    relative_error,
    relative_rms,
    weights_budget,
)

from kt_testing.devices import offload_reserve

# bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 0.2% per weight and per op). The same
# test run in bf16 on the CPU (the dry run) measured relative errors of 5e-5 on the loss, 7e-4
# on the first step's loss and 1.4e-2 on the LoRA gradients; the bounds leave 3.5x or more:
BF16_LOSS = 0.005
BF16_GRADIENTS = 0.05


def bf16_config(mods, **overrides):
    settings = {
        "steps": 1,
        "rank": 4,
        "alpha": 4.0,
        "targets": "all_linear",
        "seed": 1,
        "learning_rate": 1e-3,
    }
    return mods.ft.TrainConfig(**{**settings, **overrides})


@pytest.mark.parametrize("family", ["flux", "flux2", "klein", "qwen_image"])
def test_one_bf16_step_follows_the_cpu_fp32_reference(gpu, mods, family):
    """The same LoRA values, samples and draws: loss, gradients and the first optimizer step's
    loss of a bf16 model on the GPU against the fp32 model on the CPU; then the step leaves a
    finite, changed LoRA on the GPU and the MODEL exactly as loaded. FLUX.2 too (its index
    layout, 128-channel latents, no pooled text), and FLUX.2 [klein] (issue 42: no guidance
    embedder, one head of 128; ComfyUI 0.33 or newer), and Qwen-Image-Edit 2509 (issue 43: 5-D
    latents, its text 64 wide in the tiny model, ComfyUI's ids and `index`)."""
    import dataclasses

    import torch

    from kt_testing.klein import comfy_has_klein, klein_patcher
    from kt_testing.probes import tiny_samples
    from kt_testing.tiny_models import TINY_FAMILIES

    if family == "qwen_image":
        samples, tiny = qwen_image_samples(mods), qwen_image_family()
    else:
        if family == "klein":
            if not comfy_has_klein():
                pytest.skip("ComfyUI 0.3.75 cannot build FLUX.2 [klein]")
            tiny = dataclasses.replace(TINY_FAMILIES["flux2"], patcher=klein_patcher)
        else:
            tiny = TINY_FAMILIES[family]
        samples = tiny_samples(
            mods.flow_step.Sample, 2, 3, [(8, 6)], channels=tiny.channels, pooled=tiny.pooled
        )
    config = bf16_config(mods, layout=tiny.layout)
    probe = {"channels": tiny.channels, "pooled": tiny.pooled}
    if family == "qwen_image":
        probe.update(text=(5, QWEN_TEXT_WIDTH), frames=1)

    def train_one_step(session):
        return mods.loop.train(config, session.lora.parameters(), lambda i: samples, session.loss).losses[0]

    with mods.ft.lora_session(cpu_patcher(seed=5, family=family), config) as session:
        randomise_lora(session, seed=2)
        reference_loss, reference_grads = loss_and_grads(session, samples)
        reference_step = train_one_step(session)

    model = tiny.patcher(seed=5, dtype=torch.bfloat16)
    before = model_output(model, **probe)
    with mods.ft.lora_session(model, config) as session:
        params = session.lora.parameters()
        assert {(p.device, p.dtype) for p in params} == {(gpu.device, torch.float32)}
        randomise_lora(session, seed=2)
        loss, grads = loss_and_grads(session, samples)
        start = [p.detach().clone() for p in params]
        step = train_one_step(session)
        assert all(torch.isfinite(p).all() for p in params)
        assert all(not torch.equal(p.detach(), s) for p, s in zip(params, start, strict=True))
        assert {p.device for p in params} == {gpu.device}

    loss_error = abs(float(loss) - float(reference_loss)) / abs(float(reference_loss))
    step_error = abs(step - reference_step) / abs(reference_step)
    gradient_error = relative_error(grads, reference_grads)
    print(f"\nbf16 on {gpu.device} vs fp32 on cpu: loss {float(loss):.6f} vs {float(reference_loss):.6f}")
    print(
        f"  relative error: loss {loss_error:.2e}, gradients {gradient_error:.2e}, step loss {step_error:.2e}"
    )
    assert loss_error <= BF16_LOSS and step_error <= BF16_LOSS
    assert gradient_error <= BF16_GRADIENTS
    assert {p.dtype for p in model.model.diffusion_model.parameters()} == {torch.bfloat16}
    assert torch.equal(model_output(model, **probe), before)


QWEN_TEXT_WIDTH = 64  # the tiny Qwen-Image's joint_attention_dim


def qwen_image_family():
    """The tiny Qwen-Image-Edit as the other families' `TinyFamily` (16 channels, no pooled text)."""
    from kt_testing.tiny_models import TinyFamily, tiny_qwen_image_patcher

    return TinyFamily("qwen_image", tiny_qwen_image_patcher, 16, 0, "index", None)


def qwen_image_samples(mods):
    """Two samples with Wan 2.1's 5-D latents and one reference each."""
    import torch

    gen = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    return [
        mods.flow_step.Sample(
            randn(16, 1, 8, 6), randn(5, QWEN_TEXT_WIDTH), torch.zeros(0), [randn(16, 1, 6, 8)]
        )
        for _ in range(2)
    ]


def lora_on_every_block_linear(mods, model, seed: int = 21, rank: int = 2):
    """`model` with a random LoRA on every block linear, applied the way the stock
    LoraLoaderModelOnly applies one; returns the patched MODEL and the patched layers."""
    import torch

    from kt_testing.devices import stock_lora

    flux = model.model.diffusion_model
    linears = [n for n, m in flux.named_modules() if isinstance(m, torch.nn.Linear)]
    layers = mods.lora_targets.target_module_names(linears, "all_linear")
    return stock_lora(model, layers, seed, rank, scale=0.1), layers


@pytest.mark.parametrize("with_lora", [False, True], ids=["plain", "stock-lora"])
def test_a_partial_load_trains_like_a_full_load(gpu, mods, deterministic, with_lora):
    """ComfyUI decides to load partially when its free-memory query reports room for a quarter
    of the weights beside its offload reserve (`weights_budget`, `offload_reserve`): the layers
    left behind wait on the CPU and are cast per use, a stock LoRA's delta applied per use
    (`LowVramPatch`). The loss and the LoRA gradients must be those of a full load of the same
    MODEL, within what ComfyUI's own forward differs between the two loads (1e-5 where it does
    not differ); with the LoRA they must differ from the MODEL without it (the partial path
    really applies it)."""
    import torch

    from kt_testing.probes import tiny_samples
    from kt_testing.tiny_models import tiny_flux_patcher

    samples = tiny_samples(mods.flow_step.Sample, 2, 4, [(8, 8)])
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, targets="all_linear", seed=4)

    def run(partial: bool, lora: bool):
        model = tiny_flux_patcher(seed=9)  # fresh each time: a loaded model stays loaded
        if lora:
            model, layers = lora_on_every_block_linear(mods, model)
            assert len(model.patches) == len(layers)  # every LoRA key found its weight
        # a quarter of the weights, plus what ComfyUI keeps free for its offload buffer (on
        # NVIDIA 3x the largest layer, a LoRA-patched one with its patch estimate: with half the
        # weights alone it left every layer behind, see tests/comfy_adapter/test_device_paths.py)
        budget = model.model_size() // 4 + offload_reserve(model)
        limit = weights_budget(budget, gpu.dry_run) if partial else contextlib.nullcontext()
        with limit, mods.ft.lora_session(model, config) as session:
            flux = session.patcher.model
            left_behind = [m for m in flux.diffusion_model.modules() if hasattr(m, "prev_comfy_cast_weights")]
            lora_ids = {id(p) for p in session.lora.parameters()}
            devices = {p.device for p in flux.diffusion_model.parameters() if id(p) not in lora_ids}
            placement = (flux.model_lowvram, len(left_behind), devices, flux.lowvram_patch_counter)
            assert {p.device for p in session.lora.parameters()} == {gpu.device}
            randomise_lora(session, seed=3)
            return loss_and_grads(session, samples), placement

    def stock_output(partial: bool) -> torch.Tensor:
        """ComfyUI's own forward of the same MODEL (no training), loaded fully or partially."""
        model = tiny_flux_patcher(seed=9)
        if with_lora:
            model, _ = lora_on_every_block_linear(mods, model)
        budget = model.model_size() // 4 + offload_reserve(model)
        with weights_budget(budget, gpu.dry_run) if partial else contextlib.nullcontext():
            return model_output(model)

    # ComfyUI itself may compute a layer left behind in other arithmetic than a loaded one (0.33
    # applies a stock LoRA per use to the weight cast in the compute dtype): the training may
    # differ between the two loads by what ComfyUI's own forward does, never more. Measured on
    # an H200 with 0.33 (session 19): the training's loss 5.9e-5 relative, with 1e-5 allowed.
    stock = relative_rms(stock_output(partial=True), stock_output(partial=False))
    tolerance = max(1e-5, 4 * stock)
    print(f"\nComfyUI's own forward, partial against full load: {stock:.2e} relative (rms)")
    (full_loss, full_grads), (lowvram, _, devices, _) = run(partial=False, lora=with_lora)
    assert not lowvram and devices == {gpu.device}
    (loss, grads), (lowvram, left_behind, devices, lowvram_patches) = run(partial=True, lora=with_lora)
    where = sorted(map(str, devices))
    print(f"\npartial load on {gpu.device}: {left_behind} layers left behind, weights on {where}")
    assert lowvram and left_behind > 0
    if gpu.cuda:
        assert devices == {gpu.device, torch.device("cpu")}  # some layers loaded, some not
    if with_lora:
        assert lowvram_patches > 0  # the stock LoRA is applied per use on layers left behind
    print(f"training, partial against full load: loss {abs(float(loss / full_loss) - 1):.2e} relative")
    torch.testing.assert_close(loss, full_loss, rtol=tolerance, atol=1e-7)
    assert relative_error(grads, full_grads) <= 4 * tolerance  # gradients: a difference of losses
    if with_lora:
        (_, plain_grads), _ = run(partial=False, lora=False)
        assert relative_error(full_grads, plain_grads) > 1e-2
