"""Issue 43 item 5: `start_from_lora` reads the Qwen-Image-Edit LoRA files other trainers write,
each exactly as ComfyUI's stock loader applies it: musubi-tuner (`lora_unet_<layer>` with
alphas), ai-toolkit (`diffusion_model.<layer>.lora_A`), DiffSynth (`<layer>.lora_A.default`,
no alpha) and diffusers (`transformer.<layer>.lora_A`, no alpha). Every file covers every
Linear layer of the tiny Qwen-Image's blocks; the expected weight changes are the stock
`load_lora_for_models` path's (`kt_testing.lora_deltas`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kt_testing.lora_deltas import assert_same_deltas, stock_deltas
from kt_testing.tiny_models import tiny_qwen_image_patcher
from trainer_core.seed_lora import read_seed_lora

pytestmark = pytest.mark.usefixtures("comfy_runtime")
RANK = 3
KOHYA = ("lora_down.weight", "lora_up.weight", "alpha")
# (down key, up key, alpha key or None) of each tool's file, for a layer `name`
FORMATS = {
    "musubi-tuner": lambda n: tuple(f"lora_unet_{n.replace('.', '_')}.{k}" for k in KOHYA),
    "ai-toolkit": lambda n: (
        f"diffusion_model.{n}.lora_A.weight",
        f"diffusion_model.{n}.lora_B.weight",
        None,
    ),
    "DiffSynth": lambda n: (f"{n}.lora_A.default.weight", f"{n}.lora_B.default.weight", None),
    "diffusers": lambda n: (f"transformer.{n}.lora_A.weight", f"transformer.{n}.lora_B.weight", None),
}


@pytest.mark.parametrize("tool", FORMATS)
def test_a_start_lora_of_each_trainer_is_what_the_stock_loader_applies(tool, tmp_path, registered):
    patcher = tiny_qwen_image_patcher(seed=5)
    model = patcher.model.diffusion_model
    shapes = {
        name: tuple(module.weight.shape)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks.")
    }
    gen = torch.Generator().manual_seed(7)
    lora = {}
    for name, (out, inp) in shapes.items():
        down, up, alpha = FORMATS[tool](name)
        lora[down] = torch.randn(RANK, inp, generator=gen)
        lora[up] = torch.randn(out, RANK, generator=gen)
        if alpha is not None:
            lora[alpha] = torch.rand((), generator=gen) * 8
    path = tmp_path / f"{tool}.safetensors"
    save_file(lora, str(path))
    places = registered.EDIT_2509.diffusers_places(list(shapes))
    ours = read_seed_lora(path, list(shapes), RANK, shapes, places)
    assert set(ours) == set(shapes) and len(shapes) == 2 * 14  # 14 Linears a block, 2 blocks
    assert_same_deltas(ours, stock_deltas(patcher, lora, shapes))


@pytest.mark.version_independent  # diffusers reading our file: once per `make test`
def test_diffusers_qwen_image_edit_plus_pipeline_reads_our_file_as_our_delta(tmp_path, registered, caplog):
    """Issue 43 item 5: diffusers 0.42's `QwenImageEditPlusPipeline` converts our kohya-named file
    (`lora_state_dict`) and attaches it to its own `QwenImageTransformer2DModel` (the tiny one's
    shape, diffusers' layer names) without a warning: a LoRA layer on every module of the file,
    each adding our (alpha / rank) * up @ down."""
    import logging

    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel

    from kt_testing.tiny_models import TINY_QWEN_IMAGE_CONFIG
    from trainer_core.config import TrainConfig
    from trainer_core.lora_file import SAVE_PRECISIONS, LoraModule
    from trainer_core.lora_metadata import RunFacts, training_metadata, write_lora

    tiny = TINY_QWEN_IMAGE_CONFIG
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=tiny["in_channels"],
        out_channels=tiny["in_channels"] // 4,
        num_layers=tiny["num_layers"],
        attention_head_dim=tiny["attention_head_dim"],
        num_attention_heads=tiny["num_attention_heads"],
        joint_attention_dim=tiny["joint_attention_dim"],
        axes_dims_rope=tiny["axes_dims_rope"],
    )
    linears = {n: m for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = registered.EDIT_2509.lora_targets(list(linears), "all_linear")
    gen, alpha = torch.Generator().manual_seed(3), 2.0
    modules = {
        name: LoraModule(
            torch.randn(RANK, linears[name].in_features, generator=gen),
            torch.randn(linears[name].out_features, RANK, generator=gen),
            alpha,
        )
        for name in targets
    }
    path = tmp_path / "ours.safetensors"
    config = TrainConfig(rank=RANK, alpha=alpha, save_precision="fp32")
    facts = RunFacts(
        path.stem, "qwen_image_edit_2509", 1024, 4, 4, "cafe", 1.7e9, 1, registered.EDIT_2509.names
    )
    write_lora(path, modules, training_metadata(config, facts, 10), SAVE_PRECISIONS["fp32"], 1.7e9)

    library = logging.getLogger("diffusers")  # (it does not propagate to caplog's root handler)
    library.addHandler(caplog.handler)
    try:
        # what the pipeline's load_lora_weights does for its transformer
        state, metadata = QwenImageEditPlusPipeline.lora_state_dict(str(path), return_lora_metadata=True)
        assert all("lora" in key for key in state)  # load_lora_weights' own check
        QwenImageEditPlusPipeline.load_lora_into_transformer(
            state, transformer=transformer, metadata=metadata
        )
    finally:
        library.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
    layers = {n: m for n, m in transformer.named_modules() if hasattr(m, "lora_A")}
    assert set(layers) == set(modules) and len(modules) == 2 * 14 - 4  # the last block's text output
    with torch.no_grad():
        for name, layer in layers.items():
            (adapter,) = layer.lora_A.keys()
            added = layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight * layer.scaling[adapter]
            torch.testing.assert_close(added, modules[name].delta(), rtol=1e-5, atol=1e-6)
