"""Qwen-Image-Edit 2509 / 2511, the model side (issue 43 item 2 and the model part of item 3),
on ComfyUI's own Qwen-Image transformer at tiny size (`supported_models.QwenImage`): the entries
are told apart from the MODEL, training's model call is sampling's (`apply_model`) for 1-3
references of different sizes under every method (2511's timestep zero on ComfyUI 0.33), batches
of mixed shapes go one sample per forward, gradients equal finite differences, and checkpointing
and block swap change nothing, and fp8 weights (the file users download, and fp8_scaled) train as
the same weights rounded by hand.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch

from kt_testing.gradients import randomise_lora, worst_directional_error
from kt_testing.tiny_models import TINY_QWEN_IMAGE_CONFIG, tiny_qwen_image_patcher

# latent (H, W) of the references, different sizes and aspect ratios (2x2 patches)
# (4: sides that are not whole patches, as the encoder node's 8 px multiples give them: packed
# padded as ComfyUI pads them, handed to the model unpadded)
REFERENCE_SETS = {1: [(8, 12)], 2: [(8, 8), (6, 10)], 3: [(10, 6), (4, 8), (8, 8)], 4: [(7, 9), (5, 6)]}
TEXT_WIDTH = TINY_QWEN_IMAGE_CONFIG["joint_attention_dim"]


def comfy_runs_timestep_zero() -> bool:
    from comfy.ldm.qwen_image.model import QwenImageTransformerBlock

    return "timestep_zero_index" in inspect.signature(QwenImageTransformerBlock.forward).parameters


needs_033 = pytest.mark.skipif(
    "not comfy_runs_timestep_zero()", reason="ComfyUI 0.3.75 runs no timestep-zero references (0.33+)"
)


def samples_of(Sample, seed, target, references, count=1, dtype=torch.float64, text=5):
    """`count` samples with Wan 2.1's 5-D latents (16, 1, h, w), a `text`-token caption."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return [
        Sample(
            randn(16, 1, *target),
            randn(text, TEXT_WIDTH),
            torch.zeros(0),
            [randn(16, 1, *s) for s in references],
        )
        for _ in range(count)
    ]


def comfy_velocity(pack, model, sample, sigma, method):
    """The velocity ComfyUI's own sampling call implies: `apply_model` with the caption as
    `c_crossattn`, the references and the method as the conditioning hands them (latents in
    model space), v = (x - denoised) / sigma."""
    x = sample.target[None]
    kwargs = {"c_crossattn": sample.context[None]}
    if sample.references:
        kwargs |= {"ref_latents": [r[None] for r in sample.references], "ref_latents_method": method}
    trainable = importlib.import_module(f"{pack.__name__}.comfy_adapter.trainable_blocks")
    with torch.no_grad(), trainable.comfy_training_mode():  # 0.33: ComfyUI's eager RoPE (float64)
        denoised = model.model.apply_model(x, sigma, **kwargs)
    return (x - denoised) / sigma


def test_the_entries_are_told_apart_from_the_model_and_layered_is_refused(pack, registered):
    family_of = pack.comfy_adapter.model_family.family_of
    model = tiny_qwen_image_patcher()
    assert family_of(model) is registered.EDIT_2509
    assert family_of(model).resolve_layout("auto", model.model.diffusion_model) == "index"
    if not comfy_runs_timestep_zero():
        return
    edit_2511 = tiny_qwen_image_patcher(release="2511")
    assert family_of(edit_2511) is registered.EDIT_2511
    assert (
        family_of(edit_2511).resolve_layout("auto", edit_2511.model.diffusion_model) == "index_timestep_zero"
    )
    import comfy.supported_models

    layered = {
        **TINY_QWEN_IMAGE_CONFIG,
        "use_additional_t_cond": True,
        "default_ref_method": "negative_index",
    }
    model = comfy.supported_models.QwenImage(layered).get_model({})
    with pytest.raises(
        ValueError, match="this MODEL is Qwen-Image-Layered, which ComfyUI runs with its Qwen"
    ):
        family_of(type("Patcher", (), {"model": model})())


@pytest.mark.parametrize("references", sorted(REFERENCE_SETS))
@pytest.mark.parametrize("method", ["index", "offset", pytest.param("index_timestep_zero", marks=needs_033)])
def test_training_prediction_is_comfyuis_sampling_call(pack, registered, ft, Sample, method, references):
    """session.predict (a fresh, zero LoRA) against the velocity ComfyUI's `apply_model`
    implies, float64 (its output is cast to float32: fp32 tolerance): two samples of one shape
    in one forward, then a batch of mixed shapes (one sample per forward)."""
    release = "2511" if method == "index_timestep_zero" else "2509"
    model = tiny_qwen_image_patcher(seed=3, dtype=torch.float64, release=release)
    sizes = REFERENCE_SETS[references]
    same = samples_of(Sample, 1, (6, 8), sizes, count=2)
    other = samples_of(Sample, 2, (8, 4), sizes[::-1])
    sigma = torch.tensor([0.45, 0.8], dtype=torch.float64)
    config = ft.TrainConfig(rank=2, alpha=2.0, layout=method)
    with ft.lora_session(model, config) as session, torch.no_grad():
        for batch_samples in (same, [same[0], other[0]]):
            batch = session.pack([s.target for s in batch_samples], [s.references for s in batch_samples])
            assert batch.is_uniform() == (batch_samples is same)
            context = torch.stack([s.context for s in batch_samples])
            got = session.predict(batch, sigma, context, None)
            for i, sample in enumerate(batch_samples):
                expected = comfy_velocity(pack, model, sample, sigma[i : i + 1], method)
                (ours,) = batch.rows([i]).target_latents(got[i : i + 1])
                torch.testing.assert_close(ours, expected[0], rtol=1e-5, atol=1e-6)


def test_the_method_reaches_comfyuis_model(pack, registered, ft, Sample):
    """A control for the test above: `index` and `offset` give different velocities with two
    references (ComfyUI places them differently), so a method that never reached the model
    would fail there."""
    model = tiny_qwen_image_patcher(seed=3, dtype=torch.float64)
    (sample,) = samples_of(Sample, 1, (6, 8), REFERENCE_SETS[2])
    sigma = torch.tensor([0.45], dtype=torch.float64)
    index, offset = (comfy_velocity(pack, model, sample, sigma, m) for m in ("index", "offset"))
    assert (index - offset).abs().max() > 1e-4


def _loss(session, samples):
    return session.loss(samples, torch.Generator().manual_seed(11))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_lora_gradients_equal_finite_differences(registered, ft, Sample, checkpointing):
    """autograd's directional derivatives against fourth-order central differences along random
    directions (`worst_directional_error`), all_linear, a batch of two with two references of
    different sizes, within 1e-3 of the gradient's norm (float64)."""
    model = tiny_qwen_image_patcher(seed=5, dtype=torch.float64)
    samples = samples_of(Sample, 4, (6, 8), REFERENCE_SETS[2], count=2)
    config = ft.TrainConfig(
        rank=3, alpha=1.5, targets="all_linear", gradient_checkpointing=checkpointing, seed=1
    )
    with ft.lora_session(model, config) as session:
        randomise_lora(session, seed=2)
        params = session.lora.parameters()
        assert len(params) == 2 * (14 + 10)  # A and B of 14 Linear layers of block 0, 10 of block 1
        worst = worst_directional_error(lambda: _loss(session, samples), params)
    assert worst <= 1e-3, f"error {worst:.2e} of the gradient's norm"


def test_checkpointing_and_block_swap_give_the_plain_gradients(registered, ft, Sample):
    """Mixed shapes (one sample per forward), checkpointed and with one block swapped: the
    gradients of the plain run, to rounding."""
    model = tiny_qwen_image_patcher(seed=6, dtype=torch.float64)
    samples = samples_of(Sample, 5, (6, 8), REFERENCE_SETS[1]) + samples_of(
        Sample, 6, (4, 4), REFERENCE_SETS[2]
    )
    grads = []
    for checkpointing, swap in ((False, 0), (True, 1)):
        config = ft.TrainConfig(rank=2, alpha=2.0, gradient_checkpointing=checkpointing, blocks_to_swap=swap)
        with ft.lora_session(model, config) as session:
            randomise_lora(session, seed=7)
            grads.append(torch.autograd.grad(_loss(session, samples), session.lora.parameters()))
    for plain, other in zip(*grads, strict=True):
        torch.testing.assert_close(plain, other, rtol=1e-10, atol=1e-13)


# the layers fp8_scaled stores scaled: every block's attention and MLP Linears (written out here)
SCALED_LAYER = re.compile(
    r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)|(img|txt)_mlp\.net\.(0\.proj|2))$"
)


@pytest.mark.parametrize("fp8_mode", ["as_loaded", "fp8_scaled"])
def test_fp8_weights_train_as_the_same_weights_rounded_by_hand(registered, ft, Sample, fp8_mode):
    """Issue 43 item 2: the file users download (`qwen_image_edit_2509_fp8_e4m3fn`: weights
    stored in e4m3, computed through ComfyUI's manual cast, as UNETLoader loads it) and
    fp8_scaled (the family's attention and MLP Linears quantised with a scale per row inside the
    session) train, all_linear: their LoRA gradients equal, to float32 rounding, the fp32
    model's with the same weights rounded by hand (as loaded: the file's stored values; scaled:
    each row over amax / 448, to e4m3 and back), and differ from the unrounded model's."""
    samples = samples_of(Sample, 8, (6, 8), REFERENCE_SETS[2], count=2, dtype=torch.float32)

    def gradients(model, mode):
        config = ft.TrainConfig(
            rank=2, alpha=2.0, fp8_mode=mode, targets="all_linear", gradient_checkpointing=False
        )
        with ft.lora_session(model, config) as session:
            randomise_lora(session, seed=9)
            grads = torch.autograd.grad(_loss(session, samples), session.lora.parameters())
        return torch.cat([g.flatten() for g in grads])

    by_hand = tiny_qwen_image_patcher(seed=8)
    weights = by_hand.model.diffusion_model
    if fp8_mode == "as_loaded":
        fp8 = tiny_qwen_image_patcher(seed=8, dtype=torch.float8_e4m3fn, manual_cast_dtype=torch.float32)
        stored = fp8.model.diffusion_model.state_dict()
        assert stored["transformer_blocks.0.attn.to_q.weight"].dtype == torch.float8_e4m3fn
        weights.load_state_dict({key: value.float() for key, value in stored.items()})
    else:
        fp8 = tiny_qwen_image_patcher(seed=8)
        with torch.no_grad():
            for name in (n for n, _ in weights.named_modules() if SCALED_LAYER.search(n)):
                weight = weights.get_submodule(name).weight
                scale = weight.abs().amax(dim=1, keepdim=True) / 448.0
                weight.copy_((weight / scale).to(torch.float8_e4m3fn).float() * scale)
    ours, reference = gradients(fp8, fp8_mode), gradients(by_hand, "as_loaded")
    full = gradients(tiny_qwen_image_patcher(seed=8), "as_loaded")
    # measured: bit-equal (0) both ways; fp8_scaled on only the to_q layers (a scratch copy): 0.036
    assert float((ours - reference).norm()) <= 1e-5 * float(reference.norm())
    # measured: 0.085 as loaded, 0.037 fp8_scaled
    assert float((full - reference).norm()) >= 1e-3 * float(reference.norm())  # the rounding happened


def test_the_presets_adapt_the_layers_they_name_but_the_last_blocks_text_output(registered):
    """ComfyUI's model drops the last block's text stream: the layers only its text output
    depends on would get no gradient (the finite-difference test above fails on each of them:
    "not used in the graph", or a zero gradient for the text queries)."""
    blocks = [
        [f"transformer_blocks.{i}.{layer}" for layer in registered.TARGETS["all_linear"]] for i in (0, 1)
    ]
    names = [
        *blocks[0],
        *blocks[1],
        "img_in",
        "txt_in",
        "proj_out",
        "time_text_embed.timestep_embedder.linear_1",
    ]
    family = registered.EDIT_2509
    assert len(family.lora_targets(names, "attention")) == 8 + 6
    assert len(family.lora_targets(names, "attention_mlp")) == 12 + 8
    last = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    assert family.lora_targets(names, "all_linear") == [
        *blocks[0],
        *(name for name in blocks[1] if not name.endswith(last)),
    ]


def test_comfyui_0375_refuses_timestep_zero_references_in_one_line(registered, ft):
    """0.3.75 would take the method name for `offset` (and runs 2511 as 2509): refused, naming
    the fix, before anything is trained."""
    if comfy_runs_timestep_zero():
        pytest.skip("this ComfyUI runs timestep-zero references (tested above)")
    config = ft.TrainConfig(rank=2, alpha=2.0, layout="index_timestep_zero")
    message = (
        r"layout 'index_timestep_zero' \(Qwen-Image-Edit 2511's\) needs ComfyUI 0\.33 or newer; this ComfyUI"
    )
    with pytest.raises(ValueError, match=message), ft.lora_session(tiny_qwen_image_patcher(), config):
        pass


def test_the_vram_estimates_shape_counts_the_models_linear_weights(pack):
    """`QwenShape.of` the tiny model against ComfyUI's own model: the Linear weights it counts are
    the model's, every one; the full size is Qwen-Image's published 20B."""
    vram = importlib.import_module(f"{pack.__name__}.comfy_adapter.families.qwen_image.vram")
    diffusion_model = tiny_qwen_image_patcher().model.diffusion_model
    shape = vram.QwenShape.of(diffusion_model)
    linears = [m for m in diffusion_model.modules() if isinstance(m, torch.nn.Linear)]
    assert shape.blocks * shape.block_weights() + shape.other_weights() == sum(
        p.numel() for m in linears for p in m.parameters()
    )
    full = vram.QwenShape()
    assert abs((full.blocks * full.block_weights() + full.other_weights()) / 1e9 - 20.4) < 0.1


def test_multiimageconditioning_refuses_qwen_image_edit_naming_its_encoder_node(registered):
    from kt_testing.executor import InGraph, run_node
    from kt_testing.qwen_image import small_wan_vae

    inputs = {
        "model": InGraph(tiny_qwen_image_patcher),
        "conditioning": InGraph(lambda: [[torch.zeros(1, 5, TEXT_WIDTH), {}]]),
        "vae": InGraph(small_wan_vae),
        "layout": "auto",
        "reference_resolution": 64,
        "image_1": InGraph(lambda: torch.rand(1, 32, 32, 3)),
    }
    with pytest.raises(
        ValueError, match="Qwen-Image-Edit 2509, whose references are part of its text: encode the"
    ):
        run_node("KontextTrainer_MultiImageConditioning", inputs)
