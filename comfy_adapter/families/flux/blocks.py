"""ComfyUI's own Flux blocks, trainable (the parts and the reasons: `trainable_blocks`).

A `DoubleStreamBlock` adds into its `img` / `txt` in place, a `SingleStreamBlock` into its `x`:
each gets copies. The norms that read those residual streams are `RESIDUAL_NORMS`. Blocks are
numbered in execution order: double blocks, then single blocks (`FluxFamily.blocks`).
"""

from __future__ import annotations

from ...trainable_blocks import TrainableBlock, call_time_kwargs, copy_norm_inputs, install_block_patches

# The norms of ComfyUI's Flux blocks whose input is a residual stream the block adds into.
RESIDUAL_NORMS = ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2", "pre_norm")


class DoubleBlockReplacement(TrainableBlock):
    """A `patches_replace["dit"][("double_block", i)]` entry running ComfyUI's block i."""

    def __call__(self, args, extra):
        # forward_orig keeps writing block_index into its options: freeze a copy for recompute
        options, kwargs = dict(args.get("transformer_options") or {}), call_time_kwargs(extra)

        def forward(img, txt, vec, pe, attn_mask):
            return self.block(
                img=img.clone(),
                txt=txt.clone(),
                vec=vec,
                pe=pe,
                attn_mask=attn_mask,
                transformer_options=options,
                **kwargs,
            )

        img, txt = self.run(forward, args["img"], args["txt"], args["vec"], args["pe"], args.get("attn_mask"))
        return {"img": img, "txt": txt}


class SingleBlockReplacement(TrainableBlock):
    """A `patches_replace["dit"][("single_block", i)]` entry running ComfyUI's block i."""

    def __call__(self, args, extra):
        options, kwargs = dict(args.get("transformer_options") or {}), call_time_kwargs(extra)

        def forward(x, vec, pe, attn_mask):
            return self.block(
                x.clone(), vec=vec, pe=pe, attn_mask=attn_mask, transformer_options=options, **kwargs
            )

        return {"img": self.run(forward, args["img"], args["vec"], args["pe"], args.get("attn_mask"))}


def install(patcher, checkpointing: bool, swapper=None, title: str = "Flux"):
    """Register a trainable replacement for every block of `patcher` (a clone) and the norm
    pre-hooks on the shared modules; returns the function that removes the hooks."""
    diffusion_model = patcher.model.diffusion_model
    doubles = len(diffusion_model.double_blocks)
    install_block_patches(
        patcher,
        [
            *(
                ("double_block", i, DoubleBlockReplacement(block, checkpointing, i, swapper))
                for i, block in enumerate(diffusion_model.double_blocks)
            ),
            *(
                ("single_block", i, SingleBlockReplacement(block, checkpointing, doubles + i, swapper))
                for i, block in enumerate(diffusion_model.single_blocks)
            ),
        ],
    )
    every_block = [*diffusion_model.double_blocks, *diffusion_model.single_blocks]
    return copy_norm_inputs(every_block, RESIDUAL_NORMS, title)
