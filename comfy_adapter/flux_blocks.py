"""Training ComfyUI's own Flux blocks, installed as ModelPatcher block patches.

ComfyUI's `DoubleStreamBlock` / `SingleStreamBlock` add their residuals in place
(`img += ...`). A plain backward through them fails ("modified by an inplace operation")
and a checkpointed one can silently compute wrong gradients (ARCHITECTURE.md, "ComfyUI
facts"). The pack keeps no copy of their code (a copy broke on ComfyUI 0.33, whose blocks lost
`flipped_img_txt`); three things make the blocks themselves trainable:

1. **Norm pre-hooks** (`residual_safe_norms`): every norm that reads a residual stream
   (`RESIDUAL_NORMS`) gets a copy of its input, so the block's later `+=` cannot change what
   the norm saved for backward. Autograd's own version check stays on: an in-place op a later
   ComfyUI adds to a tensor autograd saved raises instead of computing wrong gradients.
2. **A copy of the residual inputs**: the block adds into its `img` / `txt` (double) or `x`
   (single) in place; it gets copies, so a checkpoint recomputes from the inputs as they were.
3. **Bound at forward time**: the block module is the one this patch was made for, and the
   extra keyword arguments ComfyUI passes blocks in this call (0.33: `modulation_dims_img` /
   `modulation_dims` for references at timestep 0) are read when the forward runs. ComfyUI's
   `original_block` is a closure over `forward_orig`'s loop variable, so calling it later (a
   checkpoint's recompute) would run another block.

Patches are registered per block with `ModelPatcher.set_model_patch_replace(fn, "dit",
"double_block" | "single_block", i)` on the training clone; each block can run under
non-reentrant `torch.utils.checkpoint`, so only block inputs are kept between forward and
backward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

# The norms of ComfyUI's Flux blocks whose input is a residual stream the block adds into.
RESIDUAL_NORMS = ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2", "pre_norm")


@contextlib.contextmanager
def comfy_training_mode(on: bool = True):
    """`comfy.model_management.in_training` set to `on` inside, the previous value back after.

    ComfyUI 0.33 runs Flux RoPE through comfy-kitchen's fused op unless this flag is True, and
    autograd cannot differentiate that op ("no autograd formula"); its own trainer sets the flag
    around its loop. Training keeps it on from the forward through the backward (a checkpoint
    recomputes RoPE); previews turn it off again. ComfyUI versions without the flag: no-op."""
    import comfy.model_management as mm

    if not hasattr(mm, "in_training"):
        yield
        return
    previous = mm.in_training
    mm.in_training = on
    try:
        yield
    finally:
        mm.in_training = previous


def _copy_of_input(module, args):
    return (args[0].clone(), *args[1:])


def residual_safe_norms(diffusion_model):
    """Register the norm pre-hooks on every block of `diffusion_model`; returns a function that
    removes them (the MODEL is shared: call it when training ends)."""
    handles = []
    for block in [*diffusion_model.double_blocks, *diffusion_model.single_blocks]:
        for name in RESIDUAL_NORMS:
            norm = getattr(block, name, None)
            if isinstance(norm, torch.nn.Module):
                handles.append(norm.register_forward_pre_hook(_copy_of_input))
    if not handles:
        raise RuntimeError(
            "Kontext Trainer: this ComfyUI's Flux blocks have none of the norms "
            f"{', '.join(RESIDUAL_NORMS)}; training them is not supported with this ComfyUI version"
        )

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def call_time_kwargs(extra: dict) -> dict:
    """The extra keyword arguments ComfyUI gives the block in this forward (a copy), read from
    its `original_block` closure; none in ComfyUI versions that pass none."""
    original = extra.get("original_block")
    code = getattr(original, "__code__", None)
    if code is None or "extra_kwargs" not in code.co_freevars:
        return {}
    cell = original.__closure__[code.co_freevars.index("extra_kwargs")]
    return dict(cell.cell_contents)


def _run(function, checkpointing, *args):
    if checkpointing and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    return function(*args)


class _Block:
    """Calls the block swapper (if any) around a block's forward: inside the checkpointed
    function, so the recomputation in backward is scheduled too."""

    def __init__(self, block, checkpointing: bool, index: int, swapper=None):
        self.block, self.checkpointing, self.index, self.swapper = block, checkpointing, index, swapper

    def _around(self, forward):
        if self.swapper is None:
            return forward()
        self.swapper.before(self.index)
        try:
            return forward()
        finally:
            self.swapper.after(self.index)


class DoubleBlockReplacement(_Block):
    """A `patches_replace["dit"][("double_block", i)]` entry running ComfyUI's block i."""

    def __call__(self, args, extra):
        # forward_orig keeps writing block_index into its options: freeze a copy for recompute
        options, kwargs = dict(args.get("transformer_options") or {}), call_time_kwargs(extra)

        def run(img, txt, vec, pe, attn_mask):
            return self._around(
                lambda: self.block(
                    img=img.clone(),
                    txt=txt.clone(),
                    vec=vec,
                    pe=pe,
                    attn_mask=attn_mask,
                    transformer_options=options,
                    **kwargs,
                )
            )

        img, txt = _run(
            run, self.checkpointing, args["img"], args["txt"], args["vec"], args["pe"], args.get("attn_mask")
        )
        return {"img": img, "txt": txt}


class SingleBlockReplacement(_Block):
    """A `patches_replace["dit"][("single_block", i)]` entry running ComfyUI's block i."""

    def __call__(self, args, extra):
        options, kwargs = dict(args.get("transformer_options") or {}), call_time_kwargs(extra)

        def run(x, vec, pe, attn_mask):
            return self._around(
                lambda: self.block(
                    x.clone(), vec=vec, pe=pe, attn_mask=attn_mask, transformer_options=options, **kwargs
                )
            )

        return {
            "img": _run(run, self.checkpointing, args["img"], args["vec"], args["pe"], args.get("attn_mask"))
        }


def install_trainable_blocks(patcher, checkpointing: bool, swapper=None):
    """Register a trainable replacement for every block of `patcher` (a clone; the patch lives
    in its model_options only) and the norm pre-hooks on the shared modules; returns the
    function that removes the hooks. Blocks are numbered in execution order (double blocks,
    then single blocks) for the optional `trainer_core.block_swap.BlockSwapper`."""
    diffusion_model = patcher.model.diffusion_model
    doubles = len(diffusion_model.double_blocks)
    for i, block in enumerate(diffusion_model.double_blocks):
        replacement = DoubleBlockReplacement(block, checkpointing, i, swapper)
        patcher.set_model_patch_replace(replacement, "dit", "double_block", i)
    for i, block in enumerate(diffusion_model.single_blocks):
        replacement = SingleBlockReplacement(block, checkpointing, doubles + i, swapper)
        patcher.set_model_patch_replace(replacement, "dit", "single_block", i)
    return residual_safe_norms(diffusion_model)
