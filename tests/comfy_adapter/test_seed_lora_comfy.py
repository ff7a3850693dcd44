"""A seed LoRA read by `read_seed_lora` is the LoRA ComfyUI's stock loader applies.

Files in kohya and diffusers (ai-toolkit, SimpleTuner) names are generated from ComfyUI's own key
maps (`comfy.lora.model_lora_keys_unet`, `comfy.utils.flux_to_diffusers`), so the name mapping
under test is checked against an independent one; each file is applied through
`comfy.sd.load_lora_for_models` and ModelPatcher.patch_model, and every weight's change must equal
the `delta()` of our module for that layer.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from kt_testing.comfy_runtime import from_the_pack
from kt_testing.lora_deltas import assert_same_deltas, stock_deltas
from trainer_core.seed_lora import read_seed_lora

RANK = 4


def diffusers_places(names):
    """The Flux family's diffusers names (the pack's module, as ComfyUI loaded it)."""
    return from_the_pack("comfy_adapter.families.flux.lora_names").diffusers_places(names)


def linear_shapes(flux) -> dict[str, tuple[int, int]]:
    return {name: tuple(m.weight.shape) for name, m in flux.named_modules() if isinstance(m, torch.nn.Linear)}


def test_kohya_file_matches_the_stock_loader(comfy_runtime, tmp_path):
    import comfy.lora

    from kt_testing.tiny_models import tiny_flux_patcher

    patcher = tiny_flux_patcher(seed=11)
    shapes = linear_shapes(patcher.model.diffusion_model)
    gen = torch.Generator().manual_seed(5)
    lora = {}
    # ComfyUI's own kohya names: key_map entries `lora_unet_*` -> `diffusion_model.<layer>.weight`
    for key, target in comfy.lora.model_lora_keys_unet(patcher.model, {}).items():
        name = target[len("diffusion_model.") : -len(".weight")] if isinstance(target, str) else None
        if not key.startswith("lora_unet_") or name not in shapes:
            continue
        out, inp = shapes[name]
        lora[f"{key}.lora_down.weight"] = torch.randn(RANK, inp, generator=gen)
        lora[f"{key}.lora_up.weight"] = torch.randn(out, RANK, generator=gen)
        lora[f"{key}.alpha"] = torch.rand((), generator=gen) * 8
    path = tmp_path / "kohya.safetensors"
    save_file(lora, str(path))

    ours = read_seed_lora(path, list(shapes), RANK, shapes, diffusers_places(list(shapes)))
    assert set(ours) == set(shapes)  # every Linear layer of the tiny Flux
    assert_same_deltas(ours, stock_deltas(patcher, lora, shapes))


# FLUX.2's diffusers names for layers FLUX.1's names already cover (ComfyUI 0.33's key map)
FLUX2_ALIASES = ("attn.to_qkv_mlp_proj.weight", "attn.to_out.weight", "linear_in.weight", "linear_out.weight")


def test_diffusers_file_matches_the_stock_loader(comfy_runtime, tmp_path):
    import comfy.utils

    from kt_testing.tiny_models import tiny_flux_patcher

    patcher = tiny_flux_patcher(seed=12)
    shapes = linear_shapes(patcher.model.diffusion_model)
    gen = torch.Generator().manual_seed(6)
    unet_config = patcher.model.model_config.unet_config
    lora = {}
    for i, (key, target) in enumerate(sorted(comfy.utils.flux_to_diffusers(unet_config).items())):
        if not key.endswith(".weight") or key.endswith(FLUX2_ALIASES):
            continue  # ComfyUI 0.33 also maps FLUX.2's diffusers names: one name per layer here
        # target: "<layer>.weight", or (that, (dim, offset, size)) for a slice, or (that, None, fn)
        weight_key, slice_ = (target, None) if isinstance(target, str) else (target[0], target[1])
        name = weight_key[: -len(".weight")]
        if name not in shapes:
            continue  # a norm scale, not a Linear layer
        out, inp = shapes[name] if slice_ is None else (slice_[2], shapes[name][1])
        stem = "transformer." + key[: -len(".weight")]
        lora[f"{stem}.lora_A.weight"] = torch.randn(RANK, inp, generator=gen)
        lora[f"{stem}.lora_B.weight"] = torch.randn(out, RANK, generator=gen)
        if i % 2:  # peft files usually carry no alpha; some converters add one
            lora[f"{stem}.alpha"] = torch.rand((), generator=gen) * 8
    assert "transformer.transformer_blocks.0.attn.add_k_proj.lora_A.weight" in lora
    assert "transformer.single_transformer_blocks.1.proj_mlp.lora_A.weight" in lora
    assert "transformer.norm_out.linear.lora_A.weight" in lora
    path = tmp_path / "diffusers.safetensors"
    save_file(lora, str(path))

    ours = read_seed_lora(path, list(shapes), RANK, shapes, diffusers_places(list(shapes)))
    assert set(ours) == set(shapes)
    assert ours["double_blocks.0.img_attn.qkv"].rank == 3 * RANK
    assert ours["single_blocks.0.linear1"].rank == 4 * RANK
    assert_same_deltas(ours, stock_deltas(patcher, lora, shapes))
