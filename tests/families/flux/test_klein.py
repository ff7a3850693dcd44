"""FLUX.2 [klein] on the user's path (issue 42 item 4), ComfyUI 0.33: a tiny klein file under
the real key names loaded by the stock UNETLoader (ComfyUI's detection: FLUX.2 without
guidance_in, heads from the width), a tiny Qwen3 through ComfyUI's `klein_te` (28 narrow
layers, so its taps 9, 18 and 27 exist) encoded by the stock CLIPTextEncode; the training
prediction against ComfyUI's sampling call with 1-3 references of different sizes, our ids
against the ids its forward embeds, and LoRA gradients against finite differences. On ComfyUI
0.3.75, which has no klein text encoder, LoadKontextDataset refuses the Qwen3 naming 0.33."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kt_testing.executor import InGraph, run_node
from kt_testing.flux_ids import build_token_batch, flux2_grid, image_position_ids, text_position_ids
from kt_testing.gradients import randomise_lora, worst_directional_error
from kt_testing.klein import comfy_has_klein, klein_state, qwen3_clip, z_image_clip
from kt_testing.probes import tiny_samples

pytestmark = pytest.mark.usefixtures("comfy_runtime")

REFERENCE_SETS = {1: [(8, 12)], 2: [(8, 8), (6, 10)], 3: [(10, 6), (4, 8), (8, 8)]}


@pytest.fixture(scope="module")
def klein_file(comfy_runtime, tmp_path_factory):
    """The tiny klein's weights as the release files store them (the diffusion model's own key
    names, no prefix), in ComfyUI's diffusion_models folder."""
    import folder_paths

    if not comfy_has_klein():
        pytest.skip("ComfyUI 0.3.75 cannot build a klein (its detection fixes FLUX.2 at 48 heads)")
    state = klein_state(seed=3)
    assert "guidance_in.in_layer.weight" not in state and "double_stream_modulation_img.lin.weight" in state
    path = tmp_path_factory.mktemp("models") / "kt_tiny_klein.safetensors"
    save_file(state, str(path))
    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    link = Path(folder) / path.name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.write_bytes(path.read_bytes())
    yield link.name
    link.unlink()


@pytest.fixture(scope="module")
def klein(klein_file):
    return run_node("UNETLoader", {"unet_name": klein_file, "weight_dtype": "default"}).outputs[0]


def test_the_stock_loaders_give_klein_4b_and_its_text(klein, pack_import):
    family = pack_import("comfy_adapter.model_family").family_of(klein)
    assert family is pack_import("comfy_adapter.families.flux").KLEIN_4B
    params = klein.model.diffusion_model.params
    assert (params.num_heads, params.guidance_embed, params.context_in_dim) == (1, False, 48)
    clip = qwen3_clip()
    encode = {"clip": InGraph(lambda: clip), "text": "a red cube"}
    (conditioning,) = run_node("CLIPTextEncode", encode).outputs
    context = conditioning[0][0]
    assert context.shape == (1, 512, 48)  # KleinTokenizer pads to 512; three taps of 16
    assert conditioning[0][1].get("pooled_output") is None


@pytest.mark.parametrize("count", sorted(REFERENCE_SETS))
def test_training_prediction_and_ids_equal_comfyuis_sampling_call(klein, pack, count):
    """session.predict on a sample as training prepares it (the caption through `text_in`)
    gives the velocity ComfyUI's `apply_model` implies for the conditioning sampling builds
    (`model_base.Flux2.extra_conds`: the text padded to 512 tokens, the references), and the
    ids its forward embeds are ours in FLUX.2's index layout (auto, resolved from the model)."""
    import comfy.model_management

    ft = importlib.import_module(f"{pack.__name__}.comfy_adapter.lora_session")
    Sample = importlib.import_module(f"{pack.__name__}.trainer_core.flow_step").Sample
    (sample,) = tiny_samples(Sample, 1, 12, REFERENCE_SETS[count], torch.float32, channels=128, pooled=0)
    sigma = torch.tensor([0.45])
    refs = [r[None] for r in sample.references]
    conds = klein.model.extra_conds(
        cross_attn=sample.context[None], pooled_output=None, reference_latents=refs
    )
    kwargs = {name: cond.cond for name, cond in conds.items()}
    assert kwargs["c_crossattn"].shape[1] == 512  # (its guidance: unused, klein has no guidance_in)
    comfy.model_management.load_models_gpu([klein])
    calls = []
    hook = klein.model.diffusion_model.pe_embedder.register_forward_pre_hook(
        lambda module, args: calls.append(args[0].detach().clone())
    )
    try:
        with torch.no_grad():
            denoised = klein.model.apply_model(sample.target[None], sigma, **kwargs)
    finally:
        hook.remove()
    expected = ((sample.target[None] - denoised) / sigma).flatten(2).transpose(1, 2)
    target = tuple(sample.target.shape[-2:])
    sizes = [tuple(r.shape[-2:]) for r in sample.references]
    ours = torch.cat(
        [text_position_ids(1, 512, 4)[0], image_position_ids(target, sizes, "index", flux2_grid())]
    )
    assert torch.equal(calls[0][0], ours)

    context = pack.comfy_adapter.model_family.text_in(klein.model)(sample.context)
    config = ft.TrainConfig(rank=2, alpha=2.0, layout="auto")
    with ft.lora_session(klein, config) as session, torch.no_grad():
        assert session.config.layout == "index"
        batch = build_token_batch([sample.target], [sample.references], "index", flux2_grid())
        got = session.predict(batch, sigma, context[None], sample.pooled[None])
    torch.testing.assert_close(got[:, : expected.shape[1]], expected, rtol=1e-4, atol=1e-5)


def test_lora_gradients_on_klein_equal_finite_differences(klein_file, pack):
    """The klein file through the stock loader's own steps (`comfy.sd.load_diffusion_model`) in
    float64 (as test_flux_training does for FLUX.1 and FLUX.2 [dev]), all_linear, two references:
    autograd's directional derivatives against fourth-order central differences along random
    directions, within 1e-3 of the gradient's norm."""
    import comfy.sd
    import folder_paths

    ft = importlib.import_module(f"{pack.__name__}.comfy_adapter.lora_session")
    Sample = importlib.import_module(f"{pack.__name__}.trainer_core.flow_step").Sample
    path = folder_paths.get_full_path_or_raise("diffusion_models", klein_file)
    model = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float64})
    assert model.model.diffusion_model.img_in.weight.dtype == torch.float64
    samples = tiny_samples(Sample, 2, 2, [(8, 6), (4, 8)], dtype=torch.float64, channels=128, pooled=0)
    config = ft.TrainConfig(rank=3, alpha=1.5, targets="all_linear", seed=1, layout="auto")
    with ft.lora_session(model, config) as session:
        randomise_lora(session, seed=2)
        params = session.lora.parameters()
        worst = worst_directional_error(
            lambda: session.loss(samples, torch.Generator().manual_seed(11)), params
        )
    assert worst < 1e-3, worst


def test_a_qwen3_loaded_as_z_images_encoder_is_refused_naming_the_fix(comfy_runtime, tmp_path):
    """LoadKontextDataset (in the executor) refuses it before encoding anything: on ComfyUI 0.3.75,
    which has no klein encoder, naming 0.33 as the fix; on 0.33, naming CLIPLoader type flux2."""
    from kt_testing.datasets import write_one_folder
    from kt_testing.graphs import dataset_inputs
    from kt_testing.tiny_models import small_flux2_vae

    folder = write_one_folder(tmp_path / "set", ["a"], references=1, size=(64, 64))
    inputs = dataset_inputs(InGraph(lambda: small_flux2_vae(seed=1)), InGraph(z_image_clip), folder)
    fix = r"type flux2" if comfy_has_klein() else r"needs ComfyUI 0\.33 or newer\. Update ComfyUI"
    with pytest.raises(ValueError, match=rf"the CLIP is .*Z-Image's text encoder.*{fix}"):
        run_node("KontextTrainer_LoadKontextDataset", inputs)
