"""The `index_timestep_zero` reference layout (ComfyUI 0.33's "Edit Model Reference Method"):
FLUX.2 references get the `index` ids and ComfyUI's Flux modulates them with the embedding of
timestep 0, in place on the normalised activations (`apply_mod` with `modulation_dims`).

On ComfyUI 0.33: our ids and MODEL against ComfyUI's own forward, the training prediction
against ComfyUI's sampling call (also for batches of several and of mixed sizes, which
ComfyUI's own forward cannot take), and LoRA gradients, model-wide modulation layers
included, against finite differences. On ComfyUI 0.3.75 (no timestep-zero references) and
for FLUX.1 (ComfyUI runs them only with FLUX.2's model-wide modulation) the layout is refused
by name, before anything runs.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch

from kt_testing.executor import run_node
from kt_testing.flux_ids import flux2_grid, image_position_ids, text_position_ids
from kt_testing.gradients import randomise_lora, worst_directional_error
from kt_testing.probes import flux2_forward, flux2_inputs, tiny_samples
from kt_testing.tiny_models import small_flux2_vae, tiny_flux2_patcher, tiny_flux_patcher

pytestmark = pytest.mark.usefixtures("comfy_runtime")

LAYOUT = "index_timestep_zero"


def comfy_has_timestep_zero() -> bool:
    from comfy.ldm.flux.model import Flux

    return "timestep_zero_index" in inspect.signature(Flux.forward_orig).parameters


@pytest.fixture(scope="module")
def on_033(comfy_runtime):
    if not comfy_has_timestep_zero():
        pytest.skip("ComfyUI 0.3.75 has no timestep-zero references (0.33+); its refusal is tested")


def comfy_training_mode(pack):
    return importlib.import_module(f"{pack.__name__}.comfy_adapter.trainable_blocks").comfy_training_mode(
        True
    )


def image(height, width, seed=0):
    return torch.rand(1, height, width, 3, generator=torch.Generator().manual_seed(seed))


def multi_image(pack, model, layout, *images):
    gen = torch.Generator().manual_seed(5)
    inputs = {
        "model": model,
        "conditioning": [[torch.randn(1, 7, 48, generator=gen), {"pooled_output": None}]],
        "vae": small_flux2_vae(seed=1),
        "layout": layout,
        "reference_resolution": 0,
        **{f"image_{i}": img for i, img in enumerate(images, start=1)},
    }
    node = pack.nodes.multi_image_conditioning.MultiImageConditioning
    return run_node(node, inputs).outputs


@torch.no_grad()
def test_multi_image_conditioning_model_computes_comfyuis_own_timestep_zero_forward(on_033, pack):
    """MultiImageConditioning's MODEL (our ids) against the MODEL as loaded, on ComfyUI's own
    forward with the method the conditioning carries: the same ids (index layout, steps of 10)
    and bit-equal outputs; and the outputs differ from `index` (the references really are
    modulated at timestep 0)."""
    flux2 = tiny_flux2_patcher(seed=3)
    model, cond = multi_image(pack, flux2, LAYOUT, image(64, 64), image(48, 96, seed=1))
    assert cond[0][1]["reference_latents_method"] == LAYOUT
    flux = flux2.model.diffusion_model
    inputs = flux2_inputs((6, 8), [(8, 8), (6, 10)], seed=1)
    seen = []
    hook = flux.pe_embedder.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    try:
        theirs = flux2_forward(flux, inputs, LAYOUT)
        ours = flux2_forward(flux, inputs, LAYOUT, {"wrappers": model.wrappers})  # the clone's wrapper
    finally:
        hook.remove()
    expected_ids = torch.cat(
        [text_position_ids(1, 7, 4)[0], image_position_ids((6, 8), [(8, 8), (6, 10)], "index", flux2_grid())]
    )
    assert len(seen) == 2 and torch.equal(seen[0][0], expected_ids) and torch.equal(seen[1][0], expected_ids)
    assert torch.equal(ours, theirs)
    assert (theirs - flux2_forward(flux, inputs, "index")).abs().max() > 1e-3


def test_training_prediction_is_comfyuis_timestep_zero_sampling_call(on_033, ft, Sample, pack):
    """session.predict against the velocity ComfyUI's `apply_model` implies with the method in
    the conditioning (float64, fp32 tolerance as apply_model casts its output): one sample
    alone, and a batch of two of mixed sizes, which ComfyUI's forward could not run together
    (its doubled timestep batch meets one guidance value per sample), one sample per forward."""
    import comfy.model_management

    token_batch = importlib.import_module(f"{pack.__name__}.comfy_adapter.families.flux.token_batch")
    model = tiny_flux2_patcher(seed=15, dtype=torch.float64)
    first = tiny_samples(Sample, 1, 16, [(8, 6), (6, 8)], torch.float64, channels=128, pooled=0)
    second = tiny_samples(Sample, 1, 17, [(4, 4), (6, 6)], torch.float64, (6, 4), channels=128, pooled=0)
    sigma = torch.tensor([0.45, 0.8], dtype=torch.float64)
    comfy.model_management.load_models_gpu([model])

    def expected(sample, s):
        refs = [r[None] for r in sample.references]
        conds = model.model.extra_conds(
            cross_attn=sample.context[None], pooled_output=None, reference_latents=refs, guidance=4.0
        )
        kwargs = {name: cond.cond for name, cond in conds.items()}
        with torch.no_grad(), comfy_training_mode(pack):
            denoised = model.model.apply_model(sample.target[None], s, ref_latents_method=LAYOUT, **kwargs)
        velocity = (sample.target[None] - denoised) / s
        return velocity.flatten(2).transpose(1, 2)[0]  # 1x1 patches: a token per latent pixel

    text_in = pack.comfy_adapter.model_family.text_in(model.model)
    config = ft.TrainConfig(rank=2, alpha=2.0, guidance=4.0, layout=LAYOUT)
    with ft.lora_session(model, config) as session, torch.no_grad():
        randomise_lora(session, seed=4)
        wanted = [expected(first[0], sigma[:1]), expected(second[0], sigma[1:])]
        samples = first + second
        batch = token_batch.build_token_batch(
            [s.target for s in samples], [s.references for s in samples], LAYOUT, flux2_grid()
        )
        assert not batch.is_uniform()
        context = torch.stack([text_in(s.context) for s in samples])
        pooled = torch.stack([s.pooled for s in samples])
        together = session.predict(batch, sigma, context, pooled)
        alone = session.predict(batch.sample(0), sigma[:1], context[:1], pooled[:1])
        session.config = ft.TrainConfig(rank=2, alpha=2.0, guidance=4.0, layout="index")
        as_index = session.predict(batch.sample(0), sigma[:1], context[:1], pooled[:1])
    for i, want in enumerate(wanted):
        torch.testing.assert_close(together[i, : want.shape[0]], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alone[0, : wanted[0].shape[0]], wanted[0], rtol=1e-5, atol=1e-6)
    assert (as_index[0, : wanted[0].shape[0]] - wanted[0]).abs().max() > 1e-3


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_lora_gradients_with_timestep_zero_equal_finite_differences(on_033, ft, Sample, checkpointing):
    """With timestep-zero references ComfyUI modulates slices of the normalised activations in
    place (`apply_mod` with `modulation_dims`), with the model-wide modulation layers' outputs
    for both timesteps. all_linear puts a LoRA on those layers: every LoRA factor's gradient
    against a fourth-order central difference (see test_flux_training's finite-difference
    test for the method and the 1e-3 bound), a batch of two (one forward per sample)."""
    model = tiny_flux2_patcher(seed=5, dtype=torch.float64)
    samples = tiny_samples(Sample, 2, 2, [(8, 6), (4, 8)], torch.float64, channels=128, pooled=0)
    config = ft.TrainConfig(
        rank=3, alpha=1.5, targets="all_linear", gradient_checkpointing=checkpointing, seed=1, layout=LAYOUT
    )
    with ft.lora_session(model, config) as session:
        randomise_lora(session, seed=2)
        names = [name for name, _ in session.lora.layers()]
        assert {"double_stream_modulation_img.lin", "single_stream_modulation.lin"} <= set(names)
        worst = worst_directional_error(
            lambda: session.loss(samples, torch.Generator().manual_seed(11)), session.lora.parameters()
        )
        print(f"\nindex_timestep_zero, checkpointing {checkpointing}: worst error {worst:.2e} of the norm")
        assert worst <= 1e-3, f"error {worst:.2e} of the gradient's norm"


def test_flux1_is_refused_the_timestep_zero_layout(comfy_runtime, pack, ft):
    """ComfyUI runs timestep-zero references only with FLUX.2's model-wide modulation (FLUX.1's
    per-block modulation fails on the doubled timestep batch in its own forward): refused by
    MultiImageConditioning and by a run, naming the layouts that fit."""
    flux1 = tiny_flux_patcher(seed=0)
    message = r"layout 'index_timestep_zero' does not fit a FLUX\.1 model; choose one of offset"
    with pytest.raises(ValueError, match=message):
        pack.comfy_adapter.model_family.check_layout_fits(flux1, LAYOUT, "MultiImageConditioning's model")
    with pytest.raises(ValueError, match=message):
        with ft.lora_session(flux1, ft.TrainConfig(rank=2, alpha=2.0, layout=LAYOUT)):
            pass


def test_comfyui_without_timestep_zero_refuses_the_layout_by_version(comfy_runtime, pack, ft):
    """ComfyUI 0.3.75 would take the unknown method name for `offset` and train silently wrong:
    MultiImageConditioning (in the executor) and a run refuse it, naming this ComfyUI's version."""
    if comfy_has_timestep_zero():
        pytest.skip("this ComfyUI runs timestep-zero references (tested above)")
    import comfyui_version

    flux2 = tiny_flux2_patcher(seed=3)
    message = (
        r"layout 'index_timestep_zero' needs ComfyUI 0\.33 or newer .*this ComfyUI is "
        + re.escape(comfyui_version.__version__)
        + r"\. Update ComfyUI, or choose index"
    )
    with pytest.raises(Exception, match=message):
        multi_image(pack, flux2, LAYOUT, image(64, 64))
    with pytest.raises(ValueError, match=message):
        with ft.lora_session(flux2, ft.TrainConfig(rank=2, alpha=2.0, layout=LAYOUT)):
            pass
