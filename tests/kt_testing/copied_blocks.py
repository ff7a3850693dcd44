"""The pack's former out-of-place copy of ComfyUI 0.3.75's Flux block forwards, kept only as a
test reference: `tests/families/flux/test_flux_training.py` proves that training ComfyUI's own blocks
(`comfy_adapter/families/flux/blocks.py`) gives exactly this copy's gradients on 0.3.75. The forwards run the
block's own submodules and ComfyUI's own `attention` in the block's order, with every residual
added out of place. They read `flipped_img_txt`, which ComfyUI 0.33's blocks no longer have:
the reason the pack no longer copies model code. `install_copied_blocks` runs them inside the
pack's own block patches.
"""

from __future__ import annotations

import torch


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


class _CopiedDouble:
    """Stands in for a double block inside the pack's own block patch: runs the copy."""

    def __init__(self, block):
        self.block = block

    def __call__(self, img, txt, vec, pe, attn_mask=None, transformer_options=None, **_):
        return double_block_forward(self.block, img, txt, vec, pe, attn_mask, transformer_options or {})


class _CopiedSingle:
    def __init__(self, block):
        self.block = block

    def __call__(self, x, vec, pe, attn_mask=None, transformer_options=None, **_):
        return single_block_forward(self.block, x, vec, pe, attn_mask, transformer_options or {})


def install_copied_blocks(flux_blocks, patcher, checkpointing: bool, swapper=None):
    """The pack's Flux block patches (`flux_blocks`: its module as ComfyUI loaded the pack) running
    this copy instead of ComfyUI's blocks, without the norm pre-hooks the copy does not need;
    returns a no-op remover, like `FluxFamily.install_blocks`."""
    diffusion_model = patcher.model.diffusion_model
    doubles = len(diffusion_model.double_blocks)
    for i, block in enumerate(diffusion_model.double_blocks):
        replacement = flux_blocks.DoubleBlockReplacement(_CopiedDouble(block), checkpointing, i, swapper)
        patcher.set_model_patch_replace(replacement, "dit", "double_block", i)
    for i, block in enumerate(diffusion_model.single_blocks):
        replacement = flux_blocks.SingleBlockReplacement(
            _CopiedSingle(block), checkpointing, doubles + i, swapper
        )
        patcher.set_model_patch_replace(replacement, "dit", "single_block", i)
    return lambda: None
