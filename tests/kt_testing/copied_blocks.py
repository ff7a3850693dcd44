"""The pack's former out-of-place copy of ComfyUI 0.3.75's Flux block forwards, kept only as a
test reference: `tests/nodes/test_flux_training.py` proves that training ComfyUI's own blocks
(`nodes/flux_blocks.py`) gives exactly its gradients on 0.3.75. It reads `flipped_img_txt`,
which ComfyUI 0.33's blocks no longer have (why the pack no longer copies model code).

Original description:
Flux block forwards that autograd can differentiate, installed as ModelPatcher patches.

ComfyUI's `DoubleStreamBlock` / `SingleStreamBlock` add their residuals in place
(`img += ...`). The layer norm before that add saved `img` for backward, so a plain backward
fails ("modified by an inplace operation") and checkpointed backward silently computes wrong
gradients (measured in COMFYUI_NOTES). The forwards below run the block's own submodules and
ComfyUI's own `attention` in the same order, with every residual added out of place.

They are registered per block with `ModelPatcher.set_model_patch_replace(fn, "dit",
"double_block" | "single_block", i)` on a clone (ComfyUI's patch mechanism, no monkeypatching):
`forward_orig` then calls them instead of the block. Each can run under
`torch.utils.checkpoint` so only block inputs are kept between forward and backward.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint


def _modulated(norm, x, mod):
    """LayerNorm then `(1 + scale) * x + shift` (ComfyUI's `apply_mod` without dims)."""
    return torch.addcmul(mod.shift, norm(x), 1 + mod.scale)


def _heads(qkv, num_heads):
    """(B, L, 3*H*D) -> q, k, v each (B, H, L, D)."""
    return qkv.view(qkv.shape[0], qkv.shape[1], 3, num_heads, -1).permute(2, 0, 3, 1, 4)


def double_block_forward(block, img, txt, vec, pe, attn_mask, transformer_options):
    """`DoubleStreamBlock.forward` with out-of-place residuals; returns (img, txt)."""
    from comfy.ldm.flux.math import attention

    if block.modulation:
        img_mod1, img_mod2 = block.img_mod(vec)
        txt_mod1, txt_mod2 = block.txt_mod(vec)
    else:
        (img_mod1, img_mod2), (txt_mod1, txt_mod2) = vec

    img_q, img_k, img_v = _heads(
        block.img_attn.qkv(_modulated(block.img_norm1, img, img_mod1)), block.num_heads
    )
    img_q, img_k = block.img_attn.norm(img_q, img_k, img_v)
    txt_q, txt_k, txt_v = _heads(
        block.txt_attn.qkv(_modulated(block.txt_norm1, txt, txt_mod1)), block.num_heads
    )
    txt_q, txt_k = block.txt_attn.norm(txt_q, txt_k, txt_v)

    first, second = ((img_q, img_k, img_v), (txt_q, txt_k, txt_v))
    if not block.flipped_img_txt:
        first, second = second, first
    q, k, v = (torch.cat((a, b), dim=2) for a, b in zip(first, second, strict=True))
    attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
    if block.flipped_img_txt:
        img_attn, txt_attn = attn[:, : img.shape[1]], attn[:, img.shape[1] :]
    else:
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]

    img = img + img_mod1.gate * block.img_attn.proj(img_attn)
    img = img + img_mod2.gate * block.img_mlp(_modulated(block.img_norm2, img, img_mod2))
    txt = txt + txt_mod1.gate * block.txt_attn.proj(txt_attn)
    txt = txt + txt_mod2.gate * block.txt_mlp(_modulated(block.txt_norm2, txt, txt_mod2))
    if txt.dtype == torch.float16:
        txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
    return img, txt


def single_block_forward(block, x, vec, pe, attn_mask, transformer_options):
    """`SingleStreamBlock.forward` with an out-of-place residual."""
    from comfy.ldm.flux.math import attention

    mod = block.modulation(vec)[0] if block.modulation else vec
    qkv, mlp = torch.split(
        block.linear1(_modulated(block.pre_norm, x, mod)),
        [3 * block.hidden_size, block.mlp_hidden_dim_first],
        dim=-1,
    )
    q, k, v = _heads(qkv, block.num_heads)
    q, k = block.norm(q, k, v)
    attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
    x = x + mod.gate * block.linear2(torch.cat((attn, block.mlp_act(mlp)), 2))
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x


def _run(function, checkpointing, *args):
    if checkpointing and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    return function(*args)


class _Swapped:
    """Calls the block swapper (if any) around a block's forward: inside the checkpointed
    function, so the recomputation in backward is scheduled too."""

    def __init__(self, block, checkpointing: bool, index: int, swapper=None):
        self.block, self.checkpointing, self.index, self.swapper = block, checkpointing, index, swapper

    def _around(self, forward, *args):
        if self.swapper is None:
            return forward(*args)
        self.swapper.before(self.index)
        try:
            return forward(*args)
        finally:
            self.swapper.after(self.index)


class DoubleBlockReplacement(_Swapped):
    """A `patches_replace["dit"][("double_block", i)]` entry running `double_block_forward`."""

    def __call__(self, args, extra):
        # forward_orig keeps writing block_index into its options: freeze a copy for recompute.
        options = dict(args.get("transformer_options") or {})

        def run(img, txt, vec, pe, attn_mask):
            return self._around(double_block_forward, self.block, img, txt, vec, pe, attn_mask, options)

        img, txt = _run(
            run, self.checkpointing, args["img"], args["txt"], args["vec"], args["pe"], args.get("attn_mask")
        )
        return {"img": img, "txt": txt}


class SingleBlockReplacement(_Swapped):
    """A `patches_replace["dit"][("single_block", i)]` entry running `single_block_forward`."""

    def __call__(self, args, extra):
        options = dict(args.get("transformer_options") or {})

        def run(img, vec, pe, attn_mask):
            return self._around(single_block_forward, self.block, img, vec, pe, attn_mask, options)

        return {
            "img": _run(run, self.checkpointing, args["img"], args["vec"], args["pe"], args.get("attn_mask"))
        }


def install_trainable_blocks(patcher, checkpointing: bool, swapper=None) -> None:
    """Register the out-of-place forwards for every block of `patcher` (a clone; the patch
    lives in its model_options only). Blocks are numbered in execution order (double blocks,
    then single blocks) for the optional `trainer_core.block_swap.BlockSwapper`."""
    diffusion_model = patcher.model.diffusion_model
    doubles = len(diffusion_model.double_blocks)
    for i, block in enumerate(diffusion_model.double_blocks):
        replacement = DoubleBlockReplacement(block, checkpointing, i, swapper)
        patcher.set_model_patch_replace(replacement, "dit", "double_block", i)
    for i, block in enumerate(diffusion_model.single_blocks):
        replacement = SingleBlockReplacement(block, checkpointing, doubles + i, swapper)
        patcher.set_model_patch_replace(replacement, "dit", "single_block", i)
