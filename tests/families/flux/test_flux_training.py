"""Training a LoRA on ComfyUI's own (tiny) Flux: block forwards, gradients against finite
differences, the two forward paths, and reproducibility."""

from __future__ import annotations

import functools
import importlib
import re

import pytest
import torch

from kt_testing.gradients import randomise_lora, worst_directional_error
from kt_testing.probes import tiny_samples
from kt_testing.tiny_models import TINY_FAMILIES, tiny_flux_patcher


def comfy_forward(model, x, refs, context, y, sigma=0.6):
    """ComfyUI's own sampling-time call, through the patcher's options."""
    cond = {"c_crossattn": context, "y": y, "guidance": torch.tensor([1.0], dtype=x.dtype)}
    if refs:
        cond["ref_latents"] = refs
    options = {"transformer_options": model.model_options["transformer_options"]}
    with torch.no_grad():
        return model.model.apply_model(
            x, torch.tensor([sigma]), transformer_options=options["transformer_options"], **cond
        )


def test_the_trainable_blocks_reproduce_comfyui_blocks_exactly(ft, pack):
    """ComfyUI's own blocks through the block patches and norm pre-hooks: bit-equal outputs."""
    flux_blocks = importlib.import_module(f"{pack.__name__}.comfy_adapter.families.flux.blocks")
    model = tiny_flux_patcher(seed=3)
    patched = model.clone()
    remove = flux_blocks.install(patched, checkpointing=False)
    gen = torch.Generator().manual_seed(0)
    x, ref = torch.randn(2, 16, 8, 8, generator=gen), torch.randn(2, 16, 6, 8, generator=gen)
    context, y = torch.randn(2, 5, 48, generator=gen), torch.randn(2, 32, generator=gen)
    assert ("double_block", 1) in patched.model_options["transformer_options"]["patches_replace"]["dit"]
    try:
        ours = comfy_forward(patched, x, [ref], context, y)
    finally:
        remove()
    assert torch.equal(ours, comfy_forward(model, x, [ref], context, y))


def session_gradients(ft, model, samples, checkpointing: bool, copied: bool = False, seed: int = 7):
    """Loss and LoRA gradients of one step; `copied`: through the pack's former out-of-place
    copy of ComfyUI 0.3.75's block code (tests/kt_testing/copied_blocks.py) instead."""
    from kt_testing import copied_blocks

    config = ft.TrainConfig(rank=2, alpha=2.0, targets="all_linear", gradient_checkpointing=checkpointing)
    flux = importlib.import_module(ft.__name__.rsplit(".", 1)[0] + ".families.flux")
    install = flux.FluxFamily.install_blocks
    if copied:
        copied_install = functools.partial(copied_blocks.install_copied_blocks, flux.blocks)
        flux.FluxFamily.install_blocks = lambda family, *args, **kwargs: copied_install(*args, **kwargs)
    try:
        with ft.lora_session(model, config) as session:
            randomise_lora(session, seed=seed)
            loss = _loss(session, samples)
            return loss.detach(), torch.autograd.grad(loss, session.lora.parameters())
    finally:
        flux.FluxFamily.install_blocks = install


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_comfyuis_own_blocks_give_the_former_copys_gradients_bit_for_bit(ft, Sample, checkpointing):
    """ComfyUI 0.3.75 (the copy's code matches its blocks only): fp32 loss and every LoRA
    gradient through ComfyUI's own blocks equal the out-of-place copy's exactly."""
    import comfy.ldm.flux.layers

    if not hasattr(
        comfy.ldm.flux.layers.DoubleStreamBlock(8, 2, 2.0, operations=comfy.ops.disable_weight_init),
        "flipped_img_txt",
    ):
        pytest.skip("the former copy reads flipped_img_txt, which this ComfyUI's blocks no longer have")
    samples = tiny_samples(Sample, 2, 4, [(8, 6)])
    ours = session_gradients(ft, tiny_flux_patcher(seed=6), samples, checkpointing)
    copy = session_gradients(ft, tiny_flux_patcher(seed=6), samples, checkpointing, copied=True)
    assert torch.equal(ours[0], copy[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], copy[1], strict=True))


def _saved_bytes(ft, model, samples, checkpointing: bool) -> tuple[int, int]:
    """Bytes autograd keeps for backward over one step (the saved-tensor hook sees what the
    graph holds after the forward: with non-reentrant checkpointing only block inputs), and
    how many block forwards ran during the backward (recomputation)."""
    config = ft.TrainConfig(rank=2, alpha=2.0, gradient_checkpointing=checkpointing)
    kept, in_backward = [], []
    with ft.lora_session(model, config) as session:
        blocks = [*session.diffusion_model.double_blocks, *session.diffusion_model.single_blocks]
        hooks = [
            b.register_forward_pre_hook(
                lambda *a: in_backward.append(torch._C._current_graph_task_id() != -1)
            )
            for b in blocks
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
                loss = _loss(session, samples)
            loss.backward()
        finally:
            for hook in hooks:
                hook.remove()
    unique = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept if t.device.type != "meta"
    }
    return sum(unique.values()), sum(in_backward)


def test_checkpointing_keeps_less_and_recomputes_the_blocks(ft, Sample):
    model = tiny_flux_patcher(seed=6)
    samples = tiny_samples(Sample, 1, 4, [(16, 16)], target=(16, 16))
    plain, plain_recomputed = _saved_bytes(ft, model, samples, checkpointing=False)
    checkpointed, recomputed = _saved_bytes(ft, model, samples, checkpointing=True)
    blocks = len(model.model.diffusion_model.double_blocks) + len(model.model.diffusion_model.single_blocks)
    print(f"\nsaved for backward: {plain / 2**20:.2f} MiB plain, {checkpointed / 2**20:.2f} MiB checkpointed")
    assert plain_recomputed == 0 and recomputed == blocks  # every block ran again in backward
    assert checkpointed < plain / 2, (checkpointed, plain)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_an_in_place_change_comfyui_might_add_stops_the_run_before_any_step(
    ft, Sample, monkeypatch, checkpointing
):
    """A later ComfyUI that modifies, in place, a tensor autograd saved (here: the input of the
    attention's qkv layer, which its LoRA saved) must stop the run, not train on wrong
    gradients. First without the guard's backward: without checkpointing autograd's version
    check makes the step raise; under non-reentrant checkpointing autograd hands saved tensors
    to checkpoint's hooks, the check never runs and the step trains on, silently (the case the
    guard is for). Then with it: both runs are refused before any step, naming the ComfyUI
    version."""
    import comfyui_version

    model = tiny_flux_patcher(seed=6)
    samples = tiny_samples(Sample, 1, 4, [(8, 6)])
    config = ft.TrainConfig(rank=2, alpha=2.0, gradient_checkpointing=checkpointing)
    hooks = _in_place_change_after_attach(ft, monkeypatch)
    real = ft.check_training_backward
    try:
        monkeypatch.setattr(ft, "check_training_backward", lambda *args, **kwargs: None)
        with ft.lora_session(model, config) as session:
            if checkpointing:
                _loss(session, samples).backward()  # silently
            else:
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    _loss(session, samples).backward()
        monkeypatch.setattr(ft, "check_training_backward", real)
        message = (
            rf"cannot train on this ComfyUI \({re.escape(comfyui_version.__version__)}\): a step "
            r"of its FLUX.1 forward modifies, in place, a tensor the backward needs"
        )
        with pytest.raises(RuntimeError, match=message):
            with ft.lora_session(model, config):
                pytest.fail("the session must not start")
    finally:
        for hook in hooks:
            hook.remove()


# ComfyUI's Flux blocks' norms that read a residual stream the block then adds into in place
# (comfy/ldm/flux/layers.py: DoubleStreamBlock, SingleStreamBlock)
STREAM_NORMS = {
    "double_blocks": ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2"),
    "single_blocks": ("pre_norm",),
}


def test_the_norm_pre_hooks_are_on_while_training_and_taken_off_when_it_ends(ft):
    """Each norm reading a residual stream gets a pre-hook copying its input, on the shared
    MODEL's own modules: one while the session runs, none after it (a hook left behind copies
    those inputs in every later sampling, one more per run; outputs stay equal, so no output
    comparison sees it)."""
    model = tiny_flux_patcher(seed=6)
    diffusion_model = model.model.diffusion_model
    norms = [
        f"{kind}.{i}.{norm}"
        for kind, names in STREAM_NORMS.items()
        for i in range(len(getattr(diffusion_model, kind)))
        for norm in names
    ]

    def pre_hooks() -> dict[str, int]:
        return {name: len(module._forward_pre_hooks) for name, module in diffusion_model.named_modules()}

    before = pre_hooks()
    with ft.lora_session(model, ft.TrainConfig(rank=2, alpha=2.0)):
        during = pre_hooks()
    assert [during[name] - before[name] for name in norms] == [1] * len(norms)
    assert pre_hooks() == before


def test_blocks_whose_stream_norms_were_renamed_are_refused_before_any_step(ft):
    """A ComfyUI release that renamed every norm the pre-hooks go on would leave nothing copied:
    the session is refused naming the norms, before any forward runs."""
    model = tiny_flux_patcher(seed=6)
    diffusion_model = model.model.diffusion_model
    for kind, names in STREAM_NORMS.items():
        for block in getattr(diffusion_model, kind):
            for name in names:
                block._modules[f"{name}_renamed"] = block._modules.pop(name)
    message = (
        r"this ComfyUI's FLUX.1 blocks have none of the norms img_norm1, .*pre_norm; training them "
        "is not supported with this ComfyUI version"
    )
    with pytest.raises(RuntimeError, match=message):
        with ft.lora_session(model, ft.TrainConfig(rank=2, alpha=2.0)):
            pytest.fail("the session must not start")


def _in_place_change_after_attach(ft, monkeypatch) -> list:
    """From the LoRA's attachment on (so also in the guard), every forward of double block 0's
    qkv layer (its LoRA saved the input) scales its input in place by 1: the output stays as
    computed, the saved input's version moves on."""
    hooks, real_attach = [], ft.attach_lora

    def attach_then_change(diffusion_model, *args, **kwargs):
        lora = real_attach(diffusion_model, *args, **kwargs)
        qkv = diffusion_model.double_blocks[0].img_attn.qkv
        hooks.append(qkv.register_forward_hook(_scale_input_in_place))
        return lora

    monkeypatch.setattr(ft, "attach_lora", attach_then_change)
    return hooks


def _scale_input_in_place(module, args, out) -> None:
    args[0].mul_(1.0)  # returns None: the output stays as computed


def _loss(session, samples):
    return session.loss(samples, torch.Generator().manual_seed(11))


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
@pytest.mark.parametrize("references", [0, 1, 2])
def test_lora_gradients_equal_finite_differences(ft, Sample, references, family):
    """autograd's directional derivative <grad, d> against a fourth-order central difference
    of the loss (Richardson: (8 (f(h) - f(-h)) - (f(2h) - f(-2h))) / 12h) along random unit
    directions d: one per adapted layer (its lora_A and lora_B moved together, every other
    parameter fixed) and one through all LoRA parameters at once. A random direction sees
    every part of the gradient: a dropped lora_A gradient, a flipped sign or a wrongly scaled
    layer changes <grad, d> by about |that part| / sqrt(its size), far above the bound
    (zeroing lora_A's gradient by hand failed every case, worst errors 0.12 - 0.15 against
    3e-5 as is). The derivative along the gradient's own direction could not see a missing
    part: it equals the norm of whatever gradient is left.

    The model is float64, but ComfyUI's rope rotates q and k in float32 whatever the model
    dtype, so the loss carries ~1e-9 relative rounding. h = 1e-2 keeps that rounding and the
    O(h^4) truncation far below the bound, 1e-3 of the gradient's norm (|<grad, d>| <= |grad|).
    FLUX.2: all_linear includes its three model-wide modulation layers; its references sit
    in its index layout. Gradient checkpointing gives these gradients to the last bit
    (test_checkpointing_gives_the_same_gradients, each family with references): the finite
    differences run without it (with it too, they cost 64 s of CPU of the suite's two runs)."""
    tiny = TINY_FAMILIES[family]
    model = tiny.patcher(seed=5, dtype=torch.float64)
    sizes = [(8, 6), (4, 8)][:references]
    samples = tiny_samples(
        Sample, 2, references, sizes, dtype=torch.float64, channels=tiny.channels, pooled=tiny.pooled
    )
    config = ft.TrainConfig(
        rank=3,
        alpha=1.5,
        targets="all_linear",
        seed=1,
        layout=tiny.layout,
    )
    with ft.lora_session(model, config) as session:
        randomise_lora(session, seed=2)
        params = session.lora.parameters()
        assert {p.dtype for p in params} == {torch.float64}
        worst = worst_directional_error(lambda: _loss(session, samples), params)
        assert worst <= 1e-3, f"error {worst:.2e} of the gradient's norm"


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_checkpointing_gives_the_same_gradients(ft, Sample, family):
    """Every LoRA parameter's gradient, to the last bit, with and without checkpointing: each
    family, every layer a LoRA (all_linear), two references of different sizes."""
    tiny = TINY_FAMILIES[family]
    model = tiny.patcher(seed=6, dtype=torch.float64)
    samples = tiny_samples(
        Sample, 2, 4, [(8, 6), (4, 8)], dtype=torch.float64, channels=tiny.channels, pooled=tiny.pooled
    )
    grads = []
    for checkpointing in (False, True):
        config = ft.TrainConfig(
            rank=2,
            alpha=2.0,
            targets="all_linear",
            gradient_checkpointing=checkpointing,
            layout=tiny.layout,
        )
        with ft.lora_session(model, config) as session:
            randomise_lora(session, seed=7)
            grads.append(torch.autograd.grad(_loss(session, samples), session.lora.parameters()))
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(plain, checkpointed, rtol=1e-12, atol=1e-14)


def test_padded_mixed_size_batch_equals_comfyui_call_per_sample(ft, Sample, pack):
    """The padded path (forward_orig + mask) must give each sample what ComfyUI's own Flux
    call gives it alone."""
    token_batch = importlib.import_module(f"{pack.__name__}.comfy_adapter.families.flux.token_batch")
    model = tiny_flux_patcher(seed=8, dtype=torch.float64)
    first = tiny_samples(Sample, 1, 5, [(8, 6)], dtype=torch.float64)
    second = tiny_samples(Sample, 1, 6, [(4, 8), (2, 2)], dtype=torch.float64)
    config = ft.TrainConfig(rank=2, alpha=2.0, layout="dreamomni2")
    sigma = torch.tensor([0.3, 0.8], dtype=torch.float64)

    def predict(session, samples, sigma):
        batch = token_batch.build_token_batch(
            [s.target for s in samples], [s.references for s in samples], config.layout
        )
        context = torch.stack([s.context for s in samples])
        pooled = torch.stack([s.pooled for s in samples])
        return batch, session.predict(batch, sigma, context, pooled)

    with ft.lora_session(model, config) as session:
        randomise_lora(session, seed=9)
        with torch.no_grad():
            mixed, together = predict(session, first + second, sigma)
            assert not mixed.is_uniform()
            for i, sample in enumerate([first, second]):
                alone_batch, alone = predict(session, sample, sigma[i : i + 1])
                assert alone_batch.is_uniform()
                n = int(mixed.target[i].sum())
                torch.testing.assert_close(together[i, :n], alone[0, :n], rtol=1e-9, atol=1e-10)


def test_same_seed_same_losses_and_another_seed_differs(ft, Sample, pack):
    loop = importlib.import_module(f"{pack.__name__}.trainer_core.loop")
    flow_step = importlib.import_module(f"{pack.__name__}.trainer_core.flow_step")
    samples = tiny_samples(Sample, 4, 10, [(8, 8)])
    empty = flow_step.EmptyText(torch.zeros(5, 48), torch.zeros(32))

    def run(seed):
        model = tiny_flux_patcher(seed=11)
        config = ft.TrainConfig(
            steps=4,
            rank=4,
            alpha=4.0,
            dropout=0.1,
            caption_dropout=0.3,
            ip_noise_gamma=0.1,
            seed=seed,
            learning_rate=1e-3,
        )
        batches = [samples[:2], samples[2:]] * 2
        with ft.lora_session(model, config, empty_text=empty) as session:
            return loop.train(config, session.lora.parameters(), batches.__getitem__, session.loss).losses

    first = run(0)
    assert first == run(0)
    assert first != run(1)


def test_no_full_size_weight_is_materialised(ft, Sample):
    """Every weight-shaped 2-D tensor autograd keeps for backward is one of the model's own
    parameters (same storage): W + delta is never formed."""
    model = tiny_flux_patcher(seed=12)
    samples = tiny_samples(Sample, 1, 13, [(8, 8)])
    config = ft.TrainConfig(rank=4, alpha=4.0, targets="all_linear", gradient_checkpointing=False)
    saved = []
    with ft.lora_session(model, config) as session:
        randomise_lora(session, seed=14)
        base = {
            layer.get_base_layer().weight.data_ptr(): tuple(layer.get_base_layer().weight.shape)
            for _, layer in session.lora.layers()
        }
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            _loss(session, samples).backward()
    full_shapes = set(base.values())
    parameters = {p.data_ptr() for p in model.model.diffusion_model.parameters()}
    checked = 0
    for tensor in saved:
        if tensor.dim() == 2 and tuple(tensor.shape) in full_shapes:
            assert tensor.data_ptr() in parameters, (
                f"a new {tuple(tensor.shape)} weight-sized tensor was saved"
            )
            checked += tensor.data_ptr() in base
    # Base weights are saved where the layer input needs a gradient (not e.g. the modulation
    # layers fed by the frozen time embedding): seeing them proves the hook watched the step.
    assert checked >= len(base) // 3


def test_training_prediction_is_comfyuis_sampling_call(ft, Sample, pack):
    """session.predict (zero-initialised LoRA) gives the velocity ComfyUI's own `apply_model`
    implies for the same input, references and guidance value: v = (x - denoised) / sigma."""
    token_batch = importlib.import_module(f"{pack.__name__}.comfy_adapter.families.flux.token_batch")
    model = tiny_flux_patcher(seed=15, dtype=torch.float64)
    (sample,) = tiny_samples(Sample, 1, 16, [(8, 6), (6, 8)], dtype=torch.float64)
    config = ft.TrainConfig(rank=2, alpha=2.0, guidance=3.5, layout="index")
    sigma = torch.tensor([0.45], dtype=torch.float64)
    x, refs = sample.target[None], [r[None] for r in sample.references]
    # What sampling hands apply_model after `Flux.extra_conds` (latents already in model space).
    kwargs = {
        "c_crossattn": sample.context[None],
        "y": sample.pooled[None],
        "guidance": torch.tensor([3.5], dtype=torch.float64),
        "ref_latents": refs,
        "ref_latents_method": "index",
    }
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])
    # float64: comfy-kitchen's fused RoPE (ComfyUI 0.33's sampling) has no float64 kernel, so the
    # reference takes ComfyUI's eager RoPE, the one training uses (no-op on 0.3.75)
    with torch.no_grad(), comfy_training_mode(pack):
        denoised = model.model.apply_model(x, sigma, **kwargs)
    expected = (x - denoised) / sigma
    with ft.lora_session(model, config) as session, torch.no_grad():
        batch = token_batch.build_token_batch([sample.target], [sample.references], config.layout)
        got = session.predict(batch, sigma, sample.context[None], sample.pooled[None])
        other_guidance = ft.TrainConfig(rank=2, alpha=2.0, guidance=1.0, layout="index")
        session.config = other_guidance
        different = session.predict(batch, sigma, sample.context[None], sample.pooled[None])
    target_tokens = importlib.import_module(f"{pack.__name__}.trainer_core.token_batch").pack_latent(expected)
    # apply_model casts the model output to float32 before forming `denoised`: fp32 tolerance.
    torch.testing.assert_close(got[:, : target_tokens.shape[1]], target_tokens, rtol=1e-5, atol=1e-6)
    assert (different[:, : target_tokens.shape[1]] - target_tokens).abs().max() > 1e-4  # guidance matters


def comfy_training_mode(pack):
    return importlib.import_module(f"{pack.__name__}.comfy_adapter.trainable_blocks").comfy_training_mode(
        True
    )
