"""The Flux families: FLUX.1 (dev, Kontext; `image_model` "flux"), FLUX.2 [dev] and FLUX.2 [klein]
4B / 9B (all three "flux2").

All run the same `comfy/ldm/flux/model.py` class, so one `FluxFamily` serves them; what differs
for training comes from the model's `FluxParams` (patch size, RoPE axes, the index layout's step,
guidance, widths) and from the entries (what ComfyUI's detection tells them by, the reference
layouts that fit, the names a LoRA file's metadata gives the base model, the text encoder, the
release's full-size shape). `blocks.py`: the block patches; `position_ids.py`: every layout's
ids and the FLUX.1 / FLUX.2 grids; `token_batch.py`: the token batch with those ids and a padded
batch's attention mask; `reference_ids.py`: our ids in ComfyUI's Flux and the padded batch's
forward.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import torch

from ....trainer_core.lora_metadata import ModelNames
from ....trainer_core.token_batch import pack_latent
from ...comfy_quantized import stored_weight_bytes
from ...model_view import compute_dtype
from .. import ModelFamily, register
from . import blocks, lora_names, reference_ids
from .lora_targets import target_module_names
from .position_ids import LAYOUTS, TIMESTEP_ZERO_LAYOUTS, TokenGrid
from .token_batch import FluxTokenBatch, build_token_batch
from .vram import T5_TOKENS, FluxShape, estimate_vram

# Models ComfyUI runs with the same Flux class (and `image_model`) that the pack does not train
# (their text ids, layers or text encoder differ, and training them is not proven) are told apart
# by what ComfyUI's detection reads from the weights (comfy/model_detection.py, 0.33).


def unsupported_variant(
    image_model: str | None,
    context_in_dim: int,
    vec_in_dim: int | None,
    yak_mlp: bool = False,
    txt_ids_dims: tuple[int, ...] | list[int] = (),
) -> str | None:
    """The name of a model that shares a Flux family's `image_model` but is not trained by the
    pack; None for FLUX.1 / FLUX.2 [dev]."""
    if image_model == "flux":
        if yak_mlp:
            return "Ovis-Image"
        if context_in_dim == 3584 and vec_in_dim is None:
            return "LongCat-Image"
        if txt_ids_dims:
            return f"a Flux-architecture model with text position ids on axes {list(txt_ids_dims)}"
    return None


def flux2_shape(
    hidden: int, double_blocks: int, single_blocks: int, context_dim: int, guidance: bool = True
) -> FluxShape:
    """A FLUX.2 release's shape: 128 latent channels, SiLU-gated MLPs of ratio 3, no biases, no
    pooled text, model-wide modulation (comfy/model_detection.py, 0.33); klein has no guidance
    embedder."""
    return FluxShape(
        hidden=hidden,
        mlp_ratio=3.0,
        double_blocks=double_blocks,
        single_blocks=single_blocks,
        patch_channels=128,
        context_dim=context_dim,
        vec_dim=None,
        gated_mlp=True,
        biases=False,
        global_modulation=True,
        guidance=guidance,
    )


def comfy_runs_timestep_zero(diffusion_model) -> bool:
    """True where this ComfyUI's Flux can feed the references at timestep 0 (0.33 and later:
    `forward_orig` takes `timestep_zero_index`)."""
    forward_orig = getattr(type(diffusion_model), "forward_orig", None)
    return forward_orig is not None and "timestep_zero_index" in inspect.signature(forward_orig).parameters


# ss_model_type, ss_network_module (sd-scripts' Flux LoRA module), modelspec.implementation
SD_SCRIPTS_FLUX = ("flux", "networks.lora_flux", "https://github.com/black-forest-labs/flux")


@dataclass(frozen=True)
class FluxFamily(ModelFamily):
    # the release's full-size shape (FluxShape.of its FluxParams): what the VRAM table and the
    # benches estimate for it; a run estimates from the loaded model's own params
    shape: FluxShape = field(default_factory=FluxShape)

    def variant(self, diffusion_model) -> str | None:
        params = diffusion_model.params
        return unsupported_variant(
            self.image_model,
            params.context_in_dim,
            params.vec_in_dim,
            yak_mlp=getattr(params, "yak_mlp", False),
            txt_ids_dims=tuple(getattr(params, "txt_ids_dims", None) or ()),
        )

    def check_layout(self, layout: str, diffusion_model=None) -> str:
        """Also: a timestep-zero layout needs a ComfyUI that runs it (an older one would
        silently take an unknown method name for `offset`)."""
        layout = super().check_layout(layout)
        if (
            diffusion_model is not None
            and layout in TIMESTEP_ZERO_LAYOUTS
            and not comfy_runs_timestep_zero(diffusion_model)
        ):
            from ...forward_guard import comfyui_version

            raise ValueError(
                f"layout {layout!r} needs ComfyUI 0.33 or newer (its {self.title} feeds the "
                f"references at timestep 0); this ComfyUI is {comfyui_version()}. Update ComfyUI, "
                f"or choose {self.layouts[0]}"
            )
        return layout

    def check_sample(self, diffusion_model, sample) -> None:
        params = diffusion_model.params
        channels, width = sample.target.shape[0], sample.context.shape[-1]
        if channels != params.in_channels:
            raise ValueError(
                f"the dataset's latents have {channels} channels but this {self.title} MODEL takes "
                f"{params.in_channels}: give LoadKontextDataset the {self.title} VAE"
            )
        if width != params.context_in_dim:
            raise ValueError(
                f"the dataset's caption embeddings are {width} wide but this {self.title} MODEL "
                f"takes {params.context_in_dim}: give LoadKontextDataset the {self.text_encoder}"
            )
        if params.vec_in_dim and sample.pooled.numel() < params.vec_in_dim:  # it reads the first ones
            raise ValueError(
                f"this {self.title} MODEL needs a pooled text embedding of {params.vec_in_dim} "
                f"values and the dataset's text encoder gave {sample.pooled.numel()}: give "
                f"LoadKontextDataset the {self.text_encoder}"
            )

    def token_grid(self, diffusion_model) -> TokenGrid:
        """The patch size, RoPE axes and index step of the model (its `FluxParams`)."""
        return reference_ids.token_grid(diffusion_model)

    def default_layout(self, diffusion_model) -> str:
        return self.token_grid(diffusion_model).default_layout

    def pack(self, diffusion_model, layout: str, targets, references) -> FluxTokenBatch:
        return build_token_batch(targets, references, layout, self.token_grid(diffusion_model))

    def lora_targets(self, linear_names: list[str], preset: str) -> list[str]:
        return target_module_names(linear_names, preset)

    def diffusers_places(self, linear_names: list[str]) -> dict:
        return lora_names.diffusers_places(linear_names)

    def blocks(self, diffusion_model) -> list[torch.nn.Module]:
        return [*diffusion_model.double_blocks, *diffusion_model.single_blocks]

    def swap_order(self, diffusion_model) -> list[int]:
        """Single blocks first (one costs about 0.42 of a double block: less transfer per byte
        saved), from the end of their stack, then double blocks from the end of theirs."""
        doubles, singles = len(diffusion_model.double_blocks), len(diffusion_model.single_blocks)
        return [*range(doubles + singles - 1, doubles - 1, -1), *range(doubles - 1, -1, -1)]

    def install_blocks(self, patcher, checkpointing: bool, swapper=None):
        return blocks.install(patcher, checkpointing, swapper, self.title)

    def with_reference_ids(self, model):
        return reference_ids.with_reference_ids(model)

    def probe(self, diffusion_model, device, dtype, layout: str | None) -> tuple[tuple, dict]:
        """A 2 x 2 token target with 4 text tokens, seeded, in the model's compute dtype; with a
        `layout`, also one 2 x 2 token reference in that layout."""
        params = diffusion_model.params
        gen = torch.Generator().manual_seed(0)
        side = 2 * params.patch_size
        inputs = {
            "x": torch.randn(1, params.in_channels, side, side, generator=gen),
            "context": torch.randn(1, 4, params.context_in_dim, generator=gen),
            "y": torch.randn(1, params.vec_in_dim, generator=gen) if params.vec_in_dim else None,
            "guidance": torch.ones(1) if params.guidance_embed else None,
        }
        inputs = {k: v.to(device, dtype) if v is not None else None for k, v in inputs.items()}
        if layout is not None:
            reference = torch.randn(1, params.in_channels, side, side, generator=gen)
            inputs["ref_latents"] = [reference.to(device, dtype)]
            inputs["ref_latents_method"] = layout
        x = inputs.pop("x")
        return (x, torch.full((1,), 0.5, device=device)), inputs

    def predict(self, session, batch: FluxTokenBatch, timestep, context, pooled) -> torch.Tensor:
        """For a batch whose samples share their sizes, exactly the call `BaseModel._apply_model`
        makes (ComfyUI's Flux `forward` with `ref_latents` and `ref_latents_method`, through its
        wrappers and patches; inputs cast the same way); a padded mixed-size batch goes through
        `forward_orig` with per-sample ids and an attention mask. With timestep-zero references
        (ComfyUI 0.33's `index_timestep_zero`) every sample gets ComfyUI's own call alone."""
        config, patcher = session.config, session.patcher
        # (also one padded row: a data-parallel process's rows keep the global batch's padding)
        # Timestep-zero references, one sample per forward: ComfyUI's Flux (0.33) doubles the
        # timestep batch for them, which a batch of several meets with one guidance value per
        # sample and fails, and it takes one reference range for the whole batch, which padded
        # samples do not share. Each sample gets exactly ComfyUI's own call.
        if config.layout in TIMESTEP_ZERO_LAYOUTS and (batch.tokens.shape[0] > 1 or not batch.is_uniform()):
            return self.predict_one_by_one(session, batch, timestep, context, pooled)
        diffusion_model = patcher.model.diffusion_model
        dtype, device = compute_dtype(patcher), patcher.load_device
        tokens = batch.tokens.to(device, dtype)
        timestep = timestep.to(device, torch.float32)
        context = context.to(device, dtype)
        pooled = pooled.to(device, dtype)
        guidance = None
        if diffusion_model.params.guidance_embed:
            guidance = torch.full((tokens.shape[0],), config.guidance, device=device, dtype=dtype)
        options = session.transformer_options()
        if not batch.is_uniform():
            moved = dataclasses.replace(
                batch,
                tokens=tokens,
                ids=batch.ids.to(device),
                valid=batch.valid.to(device),
                target=batch.target.to(device),
                uniform_as=None,
            )
            return reference_ids.forward_token_batch(
                diffusion_model, moved, timestep, context, pooled, guidance, options
            )
        x, references = batch.split_latents(tokens)
        out = diffusion_model(
            x,
            timestep,
            context=context,
            y=pooled,
            guidance=guidance,
            ref_latents=references or None,
            control=None,
            transformer_options=options,
            ref_latents_method=config.layout,
        )
        packed = pack_latent(out, batch.patch_size)
        rest = tokens.shape[1] - packed.shape[1]
        return torch.cat([packed, packed.new_zeros(packed.shape[0], rest, packed.shape[2])], dim=1)

    def ignored_settings(self, diffusion_model) -> dict[str, str]:
        """guidance, where the model has no guidance embedder (FLUX.2 [klein], FLUX.1 [schnell]):
        `predict` hands it none. FLUX.1 dev, Kontext and FLUX.2 [dev] are guidance-distilled."""
        if diffusion_model.params.guidance_embed:
            return {}
        return {"guidance": f"{self.title} has no guidance embedding (it is not guidance-distilled)"}

    def file_notes(self, config) -> list[str]:
        if self.image_model == "flux2" and config.targets == "all_linear":
            return [
                "all_linear on FLUX.2: ComfyUI applies the whole LoRA, but diffusers' kohya converter "
                "drops its three model-wide modulation layers (double_stream_modulation_img / _txt, "
                "single_stream_modulation); attention_mlp files load whole in both"
            ]
        return []

    def vram_estimate(self, diffusion_model, dataset, config):
        itemsize = stored_weight_bytes(diffusion_model.double_blocks[0].img_attn.qkv)  # a quantized file: fp8
        loaded = {1: "fp8", 2: "bf16"}.get(itemsize, "fp32")
        return estimate_vram(
            FluxShape.of(diffusion_model.params),
            resolution=dataset.settings.resolution,
            references=dataset.reference_count,
            batch=config.batch_size,
            rank=config.rank,
            weight_format="fp8_scaled" if config.fp8_mode == "fp8_scaled" else loaded,
            base_format=loaded,
            blocks_to_swap=config.blocks_to_swap,
            gradient_checkpointing=config.gradient_checkpointing,
            optimizer=config.optimizer,
            # the real context (ComfyUI's T5 tokenizer pads to 256 and cuts nothing); a dataset
            # built before this was recorded counts as T5_TOKENS
            text_tokens=max(T5_TOKENS, getattr(dataset, "text_tokens", 0)),
        )


FLUX1 = register(
    FluxFamily(
        image_model="flux",
        title="FLUX.1",
        trains="FLUX.1 (dev, Kontext)",
        # not index_timestep_zero: ComfyUI (0.33) runs it only with FLUX.2's model-wide
        # modulation; FLUX.1's per-block modulation fails on the doubled timestep batch
        layouts=tuple(layout for layout in LAYOUTS if layout not in TIMESTEP_ZERO_LAYOUTS),
        shape=FluxShape(),  # FLUX.1 dev and Kontext
        # sd-scripts' names for every FLUX.1 model (Kontext has FLUX.1 dev's weights and shapes)
        # (the model spec has no Kontext architecture: Kontext has FLUX.1 dev's weights and shapes)
        names=ModelNames("flux1", "flux-1-dev/lora", *SD_SCRIPTS_FLUX),
        text_encoder="CLIP-L + T5-XXL (DualCLIPLoader, type flux)",
        base_models=("flux1_dev", "flux1_kontext"),
    )
)
FLUX2 = register(
    FluxFamily(
        image_model="flux2",
        title="FLUX.2",
        trains="FLUX.2 [dev]",
        # ComfyUI computes offset / index / uxo for FLUX.2 exactly as for FLUX.1 (index is its
        # default, with steps of 10). DreamOmni2's ids were learnt by a FLUX.1 Kontext model.
        # index_timestep_zero (ComfyUI 0.33+): index ids, references modulated at timestep 0.
        layouts=("index", "offset", "uxo", "index_timestep_zero"),
        # musubi-tuner's model-spec name for FLUX.2 [dev]
        # musubi-tuner's names for FLUX.2 [dev] (flux_2_train_network.py, networks.lora_flux_2);
        # sd-scripts has none, and ss_model_type is ours (musubi writes none)
        names=ModelNames(
            "flux_2_dev",
            "Flux.2-dev/lora",
            "flux2",
            "networks.lora_flux_2",
            "https://github.com/black-forest-labs/flux2",
        ),
        text_encoder="Mistral-3 (CLIPLoader, type flux2)",
        base_models=("flux2_dev", "flux2_dev"),  # natively multi-reference: one model either way
        detects=(("guidance_embed", True),),  # [dev] is guidance-distilled: it has guidance_in
        shape=flux2_shape(6144, 8, 48, context_dim=15360),  # Mistral-3: layers 10, 20, 30, 3 x 5120
    )
)

# FLUX.2 [klein]: ComfyUI's FLUX.2 class without guidance_in, 4B 3072 wide (Qwen3-4B text: layers
# 9, 18 and 27, 3 x 2560), 9B 4096 wide (Qwen3-8B: 3 x 4096). A klein of any other width (the
# tests' tiny ones) is taken as 4B. Base and distilled files share one layout; only Base trains
# well (a LoRA trained on the distilled file comes out weak).
KLEIN_BASE_OR_DISTILLED = (
    "{title}: ComfyUI cannot tell a Base file from a distilled one; train on Base ({file}): a LoRA "
    "trained on the distilled file comes out weak"
)


def klein(size: str, hidden: int, blocks: tuple[int, int], text: tuple[str, int], file: str, detects=()):
    """A klein entry: `text` is its Qwen3 and that one's width (ComfyUI's klein_te taps 3 layers)."""
    title = f"FLUX.2 [klein] {size}"
    return FluxFamily(
        image_model="flux2",
        title=title,
        trains=title,
        layouts=FLUX2.layouts,
        # musubi-tuner's names (flux_2_train_network.py --model_version klein-base-4b / -9b)
        names=ModelNames(
            f"flux_2_klein_{size.lower()}",
            f"Flux.2-klein-{size.lower()}/lora",
            "flux2",
            "networks.lora_flux_2",
            "https://github.com/black-forest-labs/flux2",
        ),
        text_encoder=f"{text[0]} (CLIPLoader, type flux2)",
        base_models=(f"flux2_klein_{size.lower()}",) * 2,
        detects=(("guidance_embed", False), *detects),
        cannot_tell=KLEIN_BASE_OR_DISTILLED.format(title=title, file=file),
        shape=flux2_shape(hidden, *blocks, context_dim=3 * text[1], guidance=False),
    )


KLEIN_4B = register(klein("4B", 3072, (5, 20), ("Qwen3-4B", 2560), "flux-2-klein-base-4b.safetensors"))
KLEIN_9B = register(
    klein(
        "9B", 4096, (8, 24), ("Qwen3-8B", 4096), "flux-2-klein-base-9b.safetensors", (("hidden_size", 4096),)
    )
)
