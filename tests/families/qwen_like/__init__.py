"""A dummy third model family, shaped like ComfyUI's Qwen-Image (`comfy/ldm/qwen_image/model.py`)
and not like Flux: its blocks are `transformer_blocks`, it has no `.params` and no
`forward_orig`, and its block is called as
`block(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
image_rotary_emb, transformer_options) -> (encoder_hidden_states, hidden_states)`, with the
same `patches_replace["dit"][("double_block", i)]` protocol ComfyUI's Qwen loop offers.

Unlike ComfyUI's Qwen block (out of place in 0.3.75), this block adds its residuals in place,
as Flux's do, so the family needs the norm hooks and input copies of `trainable_blocks`, and the
guard's backward check would catch a family that forgot them.

Everything a family changes is here: the model (a `comfy.model_base.BaseModel` around
`QwenLikeModel`, built with ComfyUI's own operations) and `family_for(pack)`, the pack's
`ModelFamily` subclass with this model's answers. The test registers it with the pack's
registry and edits nothing else of the pack.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

IMAGE_MODEL = "qwen_like_test"
CONFIG = {
    "image_model": IMAGE_MODEL,
    "in_channels": 16,
    "patch_size": 2,
    "dim": 32,
    "depth": 3,
    "context_dim": 48,
}
NORMS = ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2")  # they read the residual streams


def _embedding(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of `values` (any shape) -> (..., dim)."""
    freqs = torch.exp(-math.log(1000.0) * torch.arange(dim // 2, device=values.device) / (dim // 2))
    angles = values.float()[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class QwenLikeAttention(nn.Module):
    def __init__(self, dim, operations, device=None, dtype=None):
        super().__init__()
        linear = lambda: operations.Linear(dim, dim, device=device, dtype=dtype)  # noqa: E731
        self.to_q, self.to_k, self.to_v, self.to_out = linear(), linear(), linear(), nn.ModuleList([linear()])
        self.add_q_proj, self.add_k_proj, self.add_v_proj, self.to_add_out = (
            linear(),
            linear(),
            linear(),
            linear(),
        )

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, image_rotary_emb):
        txt, img = encoder_hidden_states, hidden_states
        q = torch.cat([self.add_q_proj(txt), self.to_q(img)], dim=1) + image_rotary_emb
        k = torch.cat([self.add_k_proj(txt), self.to_k(img)], dim=1) + image_rotary_emb
        v = torch.cat([self.add_v_proj(txt), self.to_v(img)], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        return self.to_out[0](out[:, txt.shape[1] :]), self.to_add_out(out[:, : txt.shape[1]])


class QwenLikeBlock(nn.Module):
    def __init__(self, dim, operations, device=None, dtype=None):
        super().__init__()
        ops = {"device": device, "dtype": dtype}
        self.img_mod = nn.Sequential(nn.SiLU(), operations.Linear(dim, 4 * dim, **ops))
        self.txt_mod = nn.Sequential(nn.SiLU(), operations.Linear(dim, 4 * dim, **ops))
        for name in NORMS:
            setattr(self, name, operations.LayerNorm(dim, elementwise_affine=False, eps=1e-6, **ops))
        self.attn = QwenLikeAttention(dim, operations, **ops)
        self.img_mlp = nn.Sequential(
            operations.Linear(dim, 2 * dim, **ops), nn.GELU(), operations.Linear(2 * dim, dim, **ops)
        )
        self.txt_mlp = nn.Sequential(
            operations.Linear(dim, 2 * dim, **ops), nn.GELU(), operations.Linear(2 * dim, dim, **ops)
        )

    def forward(
        self,
        hidden_states,
        encoder_hidden_states,
        encoder_hidden_states_mask,
        temb,
        image_rotary_emb=None,
        transformer_options={},  # noqa: B006 (ComfyUI's signature)
    ):
        img_scale1, img_gate1, img_scale2, img_gate2 = self.img_mod(temb)[:, None].chunk(4, dim=-1)
        txt_scale1, txt_gate1, txt_scale2, txt_gate2 = self.txt_mod(temb)[:, None].chunk(4, dim=-1)
        img_attn, txt_attn = self.attn(
            self.img_norm1(hidden_states) * (1 + img_scale1),
            self.txt_norm1(encoder_hidden_states) * (1 + txt_scale1),
            encoder_hidden_states_mask,
            image_rotary_emb,
        )
        hidden_states += img_gate1 * img_attn  # in place, as Flux's blocks add
        encoder_hidden_states += txt_gate1 * txt_attn
        hidden_states += img_gate2 * self.img_mlp(self.img_norm2(hidden_states) * (1 + img_scale2))
        encoder_hidden_states += txt_gate2 * self.txt_mlp(
            self.txt_norm2(encoder_hidden_states) * (1 + txt_scale2)
        )
        return encoder_hidden_states, hidden_states


class QwenLikeModel(nn.Module):
    """The diffusion model: patchify the target and the references, text and image streams
    through `transformer_blocks` (each one replaceable by a `("double_block", i)` patch, as in
    ComfyUI's Qwen loop), the target's tokens back to a latent."""

    def __init__(
        self,
        image_model,
        in_channels,
        patch_size,
        dim,
        depth,
        context_dim,
        device=None,
        dtype=None,
        operations=None,
        **_unused,  # what else ComfyUI's BASE puts in the unet config
    ):
        super().__init__()
        ops = {"device": device, "dtype": dtype}
        self.in_channels, self.patch_size, self.dim, self.dtype = in_channels, patch_size, dim, dtype
        self.img_in = operations.Linear(in_channels * patch_size**2, dim, **ops)
        self.txt_in = operations.Linear(context_dim, dim, **ops)
        self.time_in = nn.Sequential(
            operations.Linear(dim, dim, **ops), nn.SiLU(), operations.Linear(dim, dim, **ops)
        )
        self.transformer_blocks = nn.ModuleList([QwenLikeBlock(dim, operations, **ops) for _ in range(depth)])
        self.norm_out = operations.LayerNorm(dim, elementwise_affine=False, eps=1e-6, **ops)
        self.proj_out = operations.Linear(dim, in_channels * patch_size**2, **ops)

    def _tokens(self, latent):
        p = self.patch_size
        b, c, h, w = latent.shape
        tokens = (
            latent.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        )
        rows, cols = torch.meshgrid(torch.arange(h // p), torch.arange(w // p), indexing="ij")
        return tokens, torch.stack([rows.flatten(), cols.flatten()], dim=-1).to(latent.device)

    def forward(
        self,
        x,
        timestep,
        context,
        attention_mask=None,
        ref_latents=None,
        transformer_options={},  # noqa: B006 (ComfyUI's signature)
        **kwargs,
    ):
        h, w = x.shape[-2:]
        parts = [self._tokens(latent) for latent in [x, *(ref_latents or [])]]
        hidden_states = self.img_in(torch.cat([tokens for tokens, _ in parts], dim=1))
        positions = torch.cat(
            [torch.cat([grid.new_full((len(grid), 1), i), grid], dim=-1) for i, (_, grid) in enumerate(parts)]
        )
        image_pe = sum(_embedding(positions[:, axis] * (axis + 1), self.dim) for axis in range(3))
        pe = torch.cat([image_pe.new_zeros(context.shape[1], self.dim), image_pe])[None].to(
            hidden_states.dtype
        )
        encoder_hidden_states = self.txt_in(context)
        temb = self.time_in(_embedding(timestep, self.dim).to(hidden_states.dtype))
        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.transformer_blocks):
            if ("double_block", i) in blocks_replace:

                def block_wrap(args, block=block):
                    out = {}
                    out["txt"], out["img"] = block(
                        hidden_states=args["img"],
                        encoder_hidden_states=args["txt"],
                        encoder_hidden_states_mask=attention_mask,
                        temb=args["vec"],
                        image_rotary_emb=args["pe"],
                        transformer_options=args["transformer_options"],
                    )
                    return out

                args = {"img": hidden_states, "txt": encoder_hidden_states, "vec": temb, "pe": pe}
                out = blocks_replace[("double_block", i)](
                    {**args, "transformer_options": transformer_options}, {"original_block": block_wrap}
                )
                hidden_states, encoder_hidden_states = out["img"], out["txt"]
            else:
                encoder_hidden_states, hidden_states = block(
                    hidden_states, encoder_hidden_states, attention_mask, temb, pe, transformer_options
                )
        out = self.proj_out(self.norm_out(hidden_states[:, : parts[0][0].shape[1]]))
        p, c = self.patch_size, self.in_channels
        out = out.reshape(x.shape[0], h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(x.shape[0], c, h, w)


def build_patcher(seed: int = 0):
    """A MODEL (ModelPatcher) around a `comfy.model_base.BaseModel` of `QwenLikeModel`, built
    with ComfyUI's operations and sampled as a discrete-flow model (ComfyUI's `ModelType.FLOW`,
    as its Qwen-Image is, here with SD3's timestep multiplier 1000)."""
    import comfy.latent_formats
    import comfy.model_base
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models_base

    class QwenLikeConfig(comfy.supported_models_base.BASE):
        unet_config = {"image_model": IMAGE_MODEL}  # noqa: RUF012 (ComfyUI's class attributes)
        # a discrete-flow model as ComfyUI samples SD3: its timestep is sigma x 1000
        sampling_settings = {"multiplier": 1000.0, "shift": 1.0}  # noqa: RUF012
        latent_format = comfy.latent_formats.Flux
        supported_inference_dtypes = [torch.float32]  # noqa: RUF012

    config = QwenLikeConfig(dict(CONFIG))
    config.set_inference_dtype(torch.float32, None)
    model = comfy.model_base.BaseModel(config, comfy.model_base.ModelType.FLOW, unet_model=QwenLikeModel)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.diffusion_model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return comfy.model_patcher.ModelPatcher(
        model.eval(),
        load_device=comfy.model_management.get_torch_device(),
        offload_device=comfy.model_management.unet_offload_device(),
    )


# preset -> the layers of a block it adapts
TARGETS = {
    "attention": ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"),
    "attention_mlp": ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.0", "img_mlp.2"),
    "all_linear": (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "img_mlp.0",
        "img_mlp.2",
        "img_mod.1",
    ),
}


def family_for(pack):
    """The family as a subclass of the pack's `ModelFamily` (the pack as ComfyUI loaded it)."""
    import importlib
    from dataclasses import dataclass

    def of_the_pack(name: str):
        return importlib.import_module(f"{pack.__name__}.{name}")

    families = of_the_pack("comfy_adapter.families")
    trainable = of_the_pack("comfy_adapter.trainable_blocks")
    token_batch = of_the_pack("trainer_core.token_batch")
    Estimate = of_the_pack("trainer_core.vram").Estimate
    ModelNames = of_the_pack("trainer_core.lora_metadata").ModelNames

    class QwenLikeBlockPatch(trainable.TrainableBlock):
        def __call__(self, args, extra):
            options = dict(args.get("transformer_options") or {})

            def forward(img, txt, vec, pe):
                txt, img = self.block(img.clone(), txt.clone(), None, vec, pe, options)
                return img, txt

            img, txt = self.run(forward, args["img"], args["txt"], args["vec"], args["pe"])
            return {"img": img, "txt": txt}

    @dataclass(frozen=True)
    class QwenLikeFamily(families.ModelFamily):
        def check_sample(self, diffusion_model, sample):
            if sample.target.shape[0] != diffusion_model.in_channels:
                raise ValueError(f"the dataset's latents do not fit this {self.title} MODEL")

        def pack(self, diffusion_model, layout, targets, references):
            return token_batch.build_token_batch(targets, references, diffusion_model.patch_size)

        def lora_targets(self, linear_names, preset):
            layers = "|".join(map(re.escape, TARGETS[preset]))
            return [
                name for name in linear_names if re.fullmatch(rf"transformer_blocks\.\d+\.({layers})", name)
            ]

        def blocks(self, diffusion_model):
            return list(diffusion_model.transformer_blocks)

        def install_blocks(self, patcher, checkpointing, swapper=None):
            blocks = self.blocks(patcher.model.diffusion_model)
            trainable.install_block_patches(
                patcher,
                [
                    ("double_block", i, QwenLikeBlockPatch(b, checkpointing, i, swapper))
                    for i, b in enumerate(blocks)
                ],
            )
            return trainable.copy_norm_inputs(blocks, NORMS, self.title)

        def probe(self, diffusion_model, device, dtype, layout):
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(1, diffusion_model.in_channels, 4, 4, generator=gen).to(device, dtype)
            context = torch.randn(1, 3, CONFIG["context_dim"], generator=gen).to(device, dtype)
            refs = [torch.randn(1, diffusion_model.in_channels, 4, 4, generator=gen).to(device, dtype)]
            return (x, torch.full((1,), 0.5, device=device)), {"context": context, "ref_latents": refs}

        def predict(self, session, batch, timestep, context, pooled):
            device = session.patcher.load_device
            tokens = batch.tokens.to(device, torch.float32)
            x, references = batch.split_latents(tokens)
            out = session.diffusion_model(
                x,
                timestep.to(device),
                context.to(device, torch.float32),
                ref_latents=references or None,
                transformer_options=session.transformer_options(),
            )
            packed = token_batch.pack_latent(out, batch.patch_size)
            return torch.nn.functional.pad(packed, (0, 0, 0, tokens.shape[1] - packed.shape[1]))

        def vram_estimate(self, diffusion_model, dataset, config):
            weights = sum(p.numel() * p.element_size() for p in diffusion_model.parameters()) / 2**30
            return Estimate(weights, 0.001, 0.001, 0.0)

    return QwenLikeFamily(
        image_model=IMAGE_MODEL,
        title="Qwen-like test model",
        trains="the Qwen-like test model",
        layouts=("index",),
        names=ModelNames(
            "qwen_like_test", "qwen-like-test/lora", "qwen_like", "networks.lora_qwen_like", "tests/"
        ),
        text_encoder="the tiny test CLIP",
        base_models=("qwen_like_test", "qwen_like_test_edit"),
    )
