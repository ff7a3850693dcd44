"""Qwen-Image-Edit 2509 and 2511 (`image_model` "qwen_image"): ComfyUI's
`comfy/ldm/qwen_image/model.py`, trained through its own blocks.

What the family changes, all read from the MODEL:

- latents are Wan 2.1's, 5-D `(B, 16, 1, h, w)`, references too; the model packs 2x2 patches of
  each (`process_img`), exactly the generic packing (`trainer_core.token_batch`);
- ComfyUI computes the ids itself: each image centred on its own grid, reference i at index i
  (`index`, `index_timestep_zero`) or beside the previous ones (any other method: `offset`),
  text after the target's grid on all three axes. The pack adds none (`with_reference_ids` is a
  plain clone), so training and sampling share ComfyUI's one implementation;
- 2511 is told from 2509 by its `__index_timestep_zero__` key (0.33's detection:
  `default_ref_method` `index_timestep_zero`: reference tokens modulated at t = 0); Qwen-Image-
  Layered, which 0.33 loads under the same `image_model`, is refused by name;
- blocks are `transformer_blocks`, called with the text mask and `timestep_zero_index` of the
  forward (`blocks`);
- the flux_shift sampler takes musubi-tuner's qwen_shift points.

A sample is encoded as sampling encodes it, by ComfyUI's `TextEncodeQwenImageEditPlus`
(`encoding`): vision tokens in the text, the node's own reference latents.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

from ....trainer_core.lora_metadata import ModelNames
from ....trainer_core.objective import QWEN_TOKEN_SHIFT_POINTS
from ....trainer_core.seed_lora import Place
from ....trainer_core.token_batch import TokenBatch, build_token_batch, pack_latent
from ...model_view import compute_dtype
from .. import ModelFamily, register
from . import blocks, encoding, vram

IMAGE_MODEL = "qwen_image"
TIMESTEP_ZERO = "index_timestep_zero"
TIMESTEP_ZERO_KEY = "__index_timestep_zero__"  # the key ComfyUI 0.33 knows a 2511 file by

# The Linear layers of one `QwenImageTransformerBlock` each target preset adapts (both streams).
ATTENTION = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
MLP = ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
MODULATION = ("img_mod.1", "txt_mod.1")
# what only a block's text output depends on (the text queries, the text attention output and
# MLP): unused in the last block, whose text stream ComfyUI's model drops
TEXT_OUTPUT = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
TARGETS = {
    "attention": ATTENTION,
    "attention_mlp": ATTENTION + MLP,
    "all_linear": ATTENTION + MLP + MODULATION,
}


def comfy_runs_timestep_zero(diffusion_model) -> bool:
    """True where this ComfyUI's Qwen-Image modulates references at t = 0 (0.33 and later)."""
    return (
        "timestep_zero_index"
        in inspect.signature(type(diffusion_model.transformer_blocks[0]).forward).parameters
    )


@dataclass(frozen=True)
class QwenImageFamily(ModelFamily):
    token_shift: tuple = QWEN_TOKEN_SHIFT_POINTS

    def variant(self, diffusion_model) -> str | None:
        if hasattr(diffusion_model.time_text_embed, "addition_t_embedding"):
            return "Qwen-Image-Layered"
        return None

    def default_layout(self, diffusion_model) -> str:
        """ComfyUI's `default_ref_method` for the model (0.33; 0.3.75 has none: `index`)."""
        return getattr(diffusion_model, "default_ref_method", "index")

    def check_layout(self, layout: str, diffusion_model=None) -> str:
        """Also: references at timestep 0 need a ComfyUI that runs them (0.3.75 would take the
        method name for `offset`, and runs 2511 as 2509)."""
        layout = super().check_layout(layout, diffusion_model)
        if (
            diffusion_model is not None
            and layout == TIMESTEP_ZERO
            and not comfy_runs_timestep_zero(diffusion_model)
        ):
            from ...forward_guard import comfyui_version

            raise ValueError(
                f"layout {TIMESTEP_ZERO!r} (Qwen-Image-Edit 2511's) needs ComfyUI 0.33 or newer; this "
                f"ComfyUI is {comfyui_version()}. Update ComfyUI"
            )
        return layout

    def check_model_file(self, path, diffusion_model) -> None:
        """A 2511 file on a ComfyUI that ignores its `__index_timestep_zero__` key (0.3.75 loads it
        as a 2509, its references at the target's timestep): refused, naming the update."""
        if comfy_runs_timestep_zero(diffusion_model) or not str(path).endswith(".safetensors"):
            return
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as handle:  # the header only
                keys = list(handle.keys())
        except Exception:  # a file safetensors cannot read: ComfyUI loaded it, not ours to judge
            return
        if any(key.endswith(TIMESTEP_ZERO_KEY) for key in keys):
            from ...forward_guard import comfyui_version

            raise ValueError(
                f"{path.name} is Qwen-Image-Edit 2511 (its {TIMESTEP_ZERO_KEY} key), which this "
                f"ComfyUI ({comfyui_version()}) runs as 2509: its references would train at the "
                "target's timestep, not at 0 as 2511 samples them. Update ComfyUI to 0.33 or newer"
            )

    def check_sample(self, diffusion_model, sample) -> None:
        channels = diffusion_model.in_channels // diffusion_model.patch_size**2
        if sample.target.dim() != 4 or sample.target.shape[0] != channels:
            raise ValueError(
                f"the dataset's latents are {tuple(sample.target.shape)} but this {self.title} MODEL "
                f"takes ({channels}, 1, h, w): give LoadKontextDataset the Qwen-Image VAE (Wan 2.1)"
            )
        width = diffusion_model.txt_in.in_features
        if sample.context.shape[-1] != width:
            raise ValueError(
                f"the dataset's caption embeddings are {sample.context.shape[-1]} wide but this "
                f"{self.title} MODEL takes {width}: give LoadKontextDataset the {self.text_encoder}"
            )

    def sample_encoder(self, vae, clip):
        return encoding.sample_encoder(vae, clip) if encoding.encodes_for_qwen_image(clip) else None

    def check_config(self, config) -> None:
        if config.reference_dropout > 0:
            raise ValueError(
                f"reference_dropout does not fit {self.title} yet: its text holds the reference "
                "images (vision tokens), so a sample without them needs a text of its own. Set "
                "reference_dropout to 0"
            )

    def ignored_settings(self, diffusion_model) -> dict[str, str]:
        """Qwen-Image has no guidance embedding: ComfyUI's forward takes none (it samples with
        true CFG)."""
        return {"guidance": f"{self.title} has no guidance embedding (it samples with true CFG)"}

    def check_preview(self, preview) -> None:
        """True CFG needs the negative sampling uses: its text holds the reference images, so
        the pack cannot make one from the positive (a zeroed text is no empty prompt)."""
        if preview.cfg > 1 and preview.negative is None:
            raise ValueError(
                f"PreviewSampler's cfg is {preview.cfg:g} but it has no negative: for {self.title} "
                f"connect a {encoding.NODE} with an empty prompt, the same images and the VAE to its "
                "negative (as for sampling), or set cfg to 1"
            )

    def pack(self, diffusion_model, layout: str, targets, references) -> TokenBatch:
        """The generic packing; a latent whose sides are not whole patches (the encoder node sizes
        references in multiples of 8 px) padded as ComfyUI's `process_img` pads it for the
        tokens, and handed to the model as it is (`split_latents` cuts the padding off)."""
        import comfy.ldm.common_dit

        patch = diffusion_model.patch_size

        def pad(latent):
            return comfy.ldm.common_dit.pad_to_patch_size(latent, (1, patch, patch))

        return build_token_batch(targets, references, patch, pad=pad)

    def lora_targets(self, linear_names: list[str], preset: str) -> list[str]:
        """The preset's layers of every block, but those only the last block's text output depends
        on (`TEXT_OUTPUT`): ComfyUI's model drops that stream, so they would never train."""
        layers = "|".join(map(re.escape, TARGETS[preset]))
        chosen = [
            name for name in linear_names if re.fullmatch(rf"transformer_blocks\.\d+\.({layers})", name)
        ]
        last = max((int(name.split(".")[1]) for name in chosen), default=0)
        unused = {f"transformer_blocks.{last}.{layer}" for layer in TEXT_OUTPUT}
        return [name for name in chosen if name not in unused]

    def diffusers_places(self, linear_names: list[str]) -> dict:
        """ComfyUI's Qwen-Image names its layers as diffusers does: each layer is its own place."""
        return {name: Place(name) for name in linear_names}

    def blocks(self, diffusion_model) -> list[torch.nn.Module]:
        return list(diffusion_model.transformer_blocks)

    def install_blocks(self, patcher, checkpointing: bool, swapper=None):
        return blocks.install(patcher, checkpointing, swapper)

    def probe(self, diffusion_model, device, dtype, layout: str | None) -> tuple[tuple, dict]:
        """A 2 x 2 token target with 4 text tokens, seeded, in the model's compute dtype; with a
        `layout`, also one 2 x 2 token reference in that layout."""
        gen = torch.Generator().manual_seed(0)
        channels, side = diffusion_model.in_channels // 4, 2 * diffusion_model.patch_size
        inputs = {"context": torch.randn(1, 4, diffusion_model.txt_in.in_features, generator=gen)}
        x = torch.randn(1, channels, 1, side, side, generator=gen)
        if layout is not None:
            inputs["ref_latents"] = [torch.randn(1, channels, 1, side, side, generator=gen).to(device, dtype)]
            inputs["ref_latents_method"] = layout
        inputs["context"] = inputs["context"].to(device, dtype)
        return (x.to(device, dtype), torch.full((1,), 0.5, device=device)), inputs

    def predict(self, session, batch: TokenBatch, timestep, context, pooled) -> torch.Tensor:
        """For a batch whose samples share their shapes, exactly the call `BaseModel._apply_model`
        makes (ComfyUI's Qwen-Image `forward` with `ref_latents` and `ref_latents_method`,
        through its wrappers and patches); a batch of mixed shapes, one sample per forward
        (ComfyUI's Qwen-Image computes its ids from the latents' shapes and masks no image
        token)."""
        if not batch.is_uniform():
            return self.predict_one_by_one(session, batch, timestep, context, pooled)
        patcher = session.patcher
        dtype, device = compute_dtype(patcher), patcher.load_device
        tokens = batch.tokens.to(device, dtype)
        x, references = batch.split_latents(tokens)
        out = patcher.model.diffusion_model(
            x,
            timestep.to(device, torch.float32),
            context.to(device, dtype),
            ref_latents=references or None,
            transformer_options=session.transformer_options(),
            ref_latents_method=session.config.layout,
        )
        packed = pack_latent(out, batch.patch_size)
        return torch.nn.functional.pad(packed, (0, 0, 0, tokens.shape[1] - packed.shape[1]))

    def vram_estimate(self, diffusion_model, dataset, config):
        from ...comfy_quantized import stored_weight_bytes

        itemsize = stored_weight_bytes(diffusion_model.transformer_blocks[0].attn.to_q)
        loaded = {1: "fp8", 2: "bf16"}.get(itemsize, "fp32")
        return vram.estimate_vram(
            vram.QwenShape.of(diffusion_model),
            resolution=dataset.settings.resolution,
            references=dataset.reference_count,
            text_tokens=dataset.text_tokens,
            batch=config.batch_size,
            rank=config.rank,
            weight_format="fp8_scaled" if config.fp8_mode == "fp8_scaled" else loaded,
            blocks_to_swap=config.blocks_to_swap,
            gradient_checkpointing=config.gradient_checkpointing,
            optimizer=config.optimizer,
        )


# musubi-tuner's names (qwen_image_train_network.py --model_version edit-2509 / edit-2511)
def _names(architecture: str, version: str) -> ModelNames:
    return ModelNames(
        version,
        architecture,
        "qwen_image",
        "networks.lora_qwen_image",
        "https://github.com/QwenLM/Qwen-Image",
    )


def edit(release: str, layouts: tuple[str, ...], names: ModelNames, detects=()) -> QwenImageFamily:
    title = f"Qwen-Image-Edit {release}"
    return QwenImageFamily(
        image_model=IMAGE_MODEL,
        title=title,
        trains=title,
        layouts=layouts,
        names=names,
        text_encoder="Qwen2.5-VL 7B (CLIPLoader, type qwen_image)",
        base_models=(f"qwen_image_edit_{release}",) * 2,
        detects=detects,
        conditioning_node=encoding.NODE,
    )


EDIT_2509 = register(
    edit(
        "2509",
        ("index", "offset", TIMESTEP_ZERO),
        _names("Qwen-Image-Edit-Plus/lora", "qwen_image_edit_plus"),
    )
)
EDIT_2511 = register(
    edit(
        "2511",
        (TIMESTEP_ZERO, "index", "offset"),
        _names("Qwen-Image-Edit-2511/lora", "qwen_image_edit_2511"),
        detects=(("default_ref_method", TIMESTEP_ZERO),),
    )
)
ENTRIES = (EDIT_2509, EDIT_2511)
