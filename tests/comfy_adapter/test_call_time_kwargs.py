"""The keyword arguments ComfyUI hands a block in one forward only reach a block patch through the
`original_block` closure (issue 43 item 1: "a block patch must call `extra["original_block"]`",
or read what it holds). `trainable_blocks.call_time_kwargs` reads them under the names a family
gives; here against ComfyUI's own Qwen-Image transformer at tiny size (its text mask and, on
0.33, `timestep_zero_index` for references at timestep 0): a patch that calls the block itself
with what the helper read computes exactly what ComfyUI's own call computes. Without the names
(Flux's only), the block runs without the mask and the t = 0 modulation, and differs (0.33;
0.3.75 applies no text mask and has no t = 0 references)."""

from __future__ import annotations

import pytest
import torch

from kt_testing.comfy_runtime import LazyPackModule
from kt_testing.tiny_models import seeded_init_

blocks = LazyPackModule("comfy_adapter.trainable_blocks")
QWEN_NAMES = ("encoder_hidden_states_mask", "timestep_zero_index")
pytestmark = pytest.mark.usefixtures("comfy_runtime")


def tiny_qwen_image():
    """ComfyUI's Qwen-Image transformer, 2 blocks of one 16-wide head, text 16 wide."""
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=1,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
        dtype=torch.float32,
        operations=comfy.ops.disable_weight_init,
    )
    return seeded_init_(model, seed=4)


def forward_with(model, patch, method: str) -> torch.Tensor:
    """The model's forward on a 8 x 8 latent, one 8 x 6 reference under `method`, a text of 5
    tokens whose last 2 are padding (ComfyUI's mask), with `patch` on its first block."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 1, 8, 8, generator=gen)
    reference = torch.randn(1, 16, 1, 8, 6, generator=gen)
    context = torch.randn(1, 5, 16, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    options = {"patches_replace": {"dit": {("double_block", 0): patch}}}
    with torch.no_grad():
        return model(
            x,
            torch.tensor([0.6]),
            context,
            attention_mask=mask,
            ref_latents=[reference],
            ref_latents_method=method,
            transformer_options=options,
        )


def comfy_masks_qwen_text() -> bool:
    """ComfyUI 0.33 and newer: Qwen-Image applies the text mask and runs references at t = 0
    (0.3.75 does neither)."""
    import inspect

    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    return "timestep_zero_index" in inspect.getsource(QwenImageTransformer2DModel._forward)


@pytest.mark.parametrize("method", ["index", "index_timestep_zero"])
def test_a_patch_calling_the_block_with_what_the_helper_read_computes_comfyuis_call(method):
    if method == "index_timestep_zero" and not comfy_masks_qwen_text():
        pytest.skip("ComfyUI 0.3.75 has no timestep-zero references")
    model = tiny_qwen_image()
    block = model.transformer_blocks[0]

    def comfy_call(args, extra):
        return extra["original_block"](args)

    def patch_with(named):
        def patch(args, extra):
            kwargs = blocks.call_time_kwargs(extra, merged=(), named=named)
            patch.read = kwargs
            txt, img = block(
                hidden_states=args["img"],
                encoder_hidden_states=args["txt"],
                temb=args["vec"],
                image_rotary_emb=args["pe"],
                transformer_options=args["transformer_options"],
                **{"encoder_hidden_states_mask": None, **kwargs},
            )
            return {"img": img, "txt": txt}

        return patch

    expected = forward_with(model, comfy_call, method)
    ours = patch_with(QWEN_NAMES)
    assert torch.equal(forward_with(model, ours, method), expected)
    assert ours.read["encoder_hidden_states_mask"] is not None
    if method == "index_timestep_zero":
        assert ours.read["timestep_zero_index"] == 16  # the 8 x 8 target's 2 x 2 patches
    # reading Flux's names only misses them: the block computes something else (0.33: without
    # the mask; at t = 0 its output has the doubled batch of the timesteps and fits nothing)
    if method == "index_timestep_zero":
        with pytest.raises(RuntimeError):
            forward_with(model, patch_with(()), method)
    elif comfy_masks_qwen_text():
        assert not torch.equal(forward_with(model, patch_with(()), method), expected)
