"""ComfyUI's own Qwen-Image blocks, trainable (the parts and the reasons: `trainable_blocks`).

ComfyUI's `QwenImageTransformerBlock` adds its residuals out of place (0.3.75 and 0.33), so its
streams need no copies and its norms no hooks: autograd's version check stays on and would stop
a later ComfyUI that adds in place. What a block patch must do is call the block with what
ComfyUI's loop gives it in this forward only: the text mask (`encoder_hidden_states_mask`) and,
on 0.33, `timestep_zero_index` (references modulated at t = 0). Both reach a patch only through
the `original_block` closure (`trainable_blocks.call_time_kwargs`).
"""

from __future__ import annotations

from ...trainable_blocks import TrainableBlock, call_time_kwargs, install_block_patches

# what ComfyUI's Qwen-Image loop passes its blocks per forward, by name (`block_wrap`'s closure)
CALL_TIME_NAMES = ("encoder_hidden_states_mask", "timestep_zero_index")


class QwenBlockReplacement(TrainableBlock):
    """A `patches_replace["dit"][("double_block", i)]` entry running ComfyUI's block i."""

    def __call__(self, args, extra):
        # the loop keeps writing block_index into its options: freeze a copy for recompute
        options = dict(args.get("transformer_options") or {})
        kwargs = call_time_kwargs(extra, merged=(), named=CALL_TIME_NAMES)

        def forward(img, txt, vec, pe):
            txt, img = self.block(
                hidden_states=img,
                encoder_hidden_states=txt,
                temb=vec,
                image_rotary_emb=pe,
                transformer_options=options,
                **{"encoder_hidden_states_mask": None, **kwargs},
            )
            return img, txt

        img, txt = self.run(forward, args["img"], args["txt"], args["vec"], args["pe"])
        return {"img": img, "txt": txt}


def install(patcher, checkpointing: bool, swapper=None):
    """Register a trainable replacement for every block of `patcher` (a clone); returns the
    function that removes its hooks (none: the blocks add out of place)."""
    blocks = patcher.model.diffusion_model.transformer_blocks
    install_block_patches(
        patcher,
        [
            ("double_block", i, QwenBlockReplacement(block, checkpointing, i, swapper))
            for i, block in enumerate(blocks)
        ],
    )
    return lambda: None
