"""The models the pack trains: one `ModelFamily` entry per model, in one registry matched on what
ComfyUI's own detection records for a checkpoint (its `unet_config`: `image_model`, then the
entry's `detects`), as ComfyUI's `supported_models` match. Several entries can share one
`image_model` and one code path (FLUX.2 [dev] and [klein] 4B / 9B run ComfyUI's one FLUX.2
class); `entry_for` picks the one whose `detects` match, the most specific first.

A family lives in its own folder here (`flux/` registers FLUX.1, FLUX.2 [dev] and FLUX.2 [klein],
`qwen_image/` Qwen-Image-Edit 2509 and 2511)
and is a subclass of `ModelFamily` whose instances carry each model's facts (the fields) and
whose methods say what training does differently for it (the protocol below). A run resolves
its entry once (`model_family.family_of`) and carries it. Everything else, the run, the
LoRA layers, the loss, checkpoints, casts and loading, is the same for every family and reads
nothing of a family's model but through these methods. User-facing text names a family by its
`title`; "the pack trains ..." is built from the registry.

Adding a family: a folder with a subclass that implements the methods marked "required", and
`register(...)` of its instances in the folder's `__init__`, imported by `_all_named` below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...trainer_core.lora_metadata import ModelNames
from ...trainer_core.objective import TOKEN_SHIFT_POINTS, TokenShift
from ...trainer_core.token_batch import TokenBatch


@dataclass(frozen=True)
class ModelFamily:
    image_model: str  # ComfyUI's unet_config["image_model"]: the registry key
    title: str  # what users call it, in every message
    trains: str  # the models of the family the pack trains, for messages ("FLUX.1 (dev, Kontext)")
    layouts: tuple[str, ...]  # the reference layouts that fit it; the first is its default
    names: ModelNames  # what a LoRA's metadata calls the base model
    text_encoder: str  # what LoadKontextDataset's CLIP should be, for messages
    base_models: tuple[str, str]  # ours (kontext_trainer.base_model): without / with references
    # what ComfyUI's unet_config must hold beyond image_model (ComfyUI's supported_models match
    # the same way); among the entries that match, the one with the most items is the model
    detects: tuple[tuple[str, object], ...] = ()
    # releases ComfyUI cannot tell apart in this entry's files, and what to do about it: the
    # first line of a run's progress and of its log (empty: none)
    cannot_tell: str = ""
    # the flux_shift sampler's two (image tokens, mu) points: the model's own resolution-dependent
    # shift (FLUX's by default; Qwen-Image's is musubi-tuner's qwen_shift, `objective`)
    token_shift: TokenShift = TOKEN_SHIFT_POINTS
    # the ComfyUI node that puts this model's references into its conditioning where that is not
    # MultiImageConditioning's way (the references are part of its text); "": MultiImageConditioning
    conditioning_node: str = ""

    def matches(self, unet_config: dict) -> bool:
        """ComfyUI detected this model: its image_model and every item of `detects`."""
        if unet_config.get("image_model") != self.image_model:
            return False
        return all(unet_config.get(key, _ABSENT) == value for key, value in self.detects)

    def base_model(self, references: int) -> str:
        """Which model the LoRA is for."""
        return self.base_models[bool(references)]

    def resolve_layout(self, layout: str, diffusion_model) -> str:
        """`auto` as the model's own layout (`default_layout`: ComfyUI's default for it); any
        other layout as it is."""
        return self.default_layout(diffusion_model) if layout == "auto" else str(layout)

    def check_layout(self, layout: str, diffusion_model=None) -> str:
        """The layout, if it fits the family (and, given the model, this ComfyUI runs it);
        `auto`, given the model, as the model's own (without it, `auto` fits)."""
        if layout == "auto":
            if diffusion_model is None:
                return layout
            layout = self.resolve_layout(layout, diffusion_model)
        if layout not in self.layouts:
            raise ValueError(
                f"layout {layout!r} does not fit a {self.title} model; choose one of "
                f"{', '.join(self.layouts)} ({self.layouts[0]} is its default)"
            )
        return layout

    # -- the protocol: what training reads of a family's model ----------------------------
    def variant(self, diffusion_model) -> str | None:
        """The name of a model that shares this `image_model` but is not trained (its text ids,
        layers or text encoder differ), or None."""
        return None

    def check_sample(self, diffusion_model, sample) -> None:
        """Required. Raise ValueError naming the fix if a cached dataset sample (latent channels,
        caption width) was not encoded for this model."""
        raise NotImplementedError

    def default_layout(self, diffusion_model) -> str:
        """The layout ComfyUI samples the model with when the conditioning names none: what
        `auto` means for it (default: the family's first)."""
        return self.layouts[0]

    def pack(self, diffusion_model, layout: str, targets, references) -> TokenBatch:
        """Required. The samples' (C, [T,] H, W) target latents and their references as one
        `trainer_core.token_batch.TokenBatch` (or a subclass carrying what else the model takes
        with its tokens, such as FLUX's position ids in `layout`): the loss's tokens and
        `predict`'s input."""
        raise NotImplementedError

    def lora_targets(self, linear_names: list[str], preset: str) -> list[str]:
        """Required. The layers among the model's Linear layers that a target preset adapts."""
        raise NotImplementedError

    def diffusers_places(self, linear_names: list[str]) -> dict:
        """Where diffusers' layer names (the start LoRAs of diffusers, ai-toolkit, SimpleTuner)
        sit in the model: diffusers layer -> `trainer_core.seed_lora.Place` (default: none)."""
        return {}

    def fp8_layers(self, linear_names: list[str]) -> list[str]:
        """The layers fp8_scaled stores as scaled e4m3: its blocks' attention and MLP linears."""
        return self.lora_targets(linear_names, "attention_mlp")

    def blocks(self, diffusion_model) -> list[torch.nn.Module]:
        """Required. The transformer blocks in execution order (the block indices below)."""
        raise NotImplementedError

    def swap_order(self, diffusion_model) -> list[int]:
        """The blocks block swap takes, first one first (default: from the last block back)."""
        return list(range(len(self.blocks(diffusion_model))))[::-1]

    def install_blocks(self, patcher, checkpointing: bool, swapper=None):
        """Required. Register a `trainable_blocks.TrainableBlock` patch for every block on the
        training clone `patcher` (and any hooks on the shared modules); return the function
        that removes the hooks."""
        raise NotImplementedError

    def with_reference_ids(self, model):
        """A clone of the MODEL that samples and trains with the pack's reference ids (default:
        a plain clone, for a family whose ComfyUI ids the pack uses as they are)."""
        return model.clone()

    def probe(self, diffusion_model, device, dtype, layout: str | None) -> tuple[tuple, dict]:
        """Required. `(args, kwargs)` of a small seeded call of the model's forward (with one
        reference in `layout`, if given), for the guard (`forward_guard`)."""
        raise NotImplementedError

    def predict(self, session, batch, timestep, context, pooled) -> torch.Tensor:
        """Required. (B, L, D) velocity for every token of a `TokenBatch`, computed with the
        session's clone (`session.patcher`) as sampling calls the model; `timestep` is already
        the model's (ComfyUI's `model_sampling.timestep` of the noise level)."""
        raise NotImplementedError

    def predict_one_by_one(self, session, batch, timestep, context, pooled) -> torch.Tensor:
        """`predict` for each sample of `batch` alone, unpadded (a batch the model cannot take in
        one forward), padded back to the batch's length; with LoRA dropout, each call gets its
        row's masks (`trainer_core.lora_dropout`: the call's one row is row first + i)."""
        first, rows = torch.initial_seed(), []
        for i in range(batch.tokens.shape[0]):
            if session.config.dropout > 0:
                torch.manual_seed(first + i)
            own_pooled = pooled[i : i + 1] if pooled is not None else None
            rows.append(
                self.predict(session, batch.sample(i), timestep[i : i + 1], context[i : i + 1], own_pooled)
            )
        if session.config.dropout > 0:
            torch.manual_seed(first)
        length = batch.tokens.shape[1]
        return torch.cat([torch.nn.functional.pad(row, (0, 0, 0, length - row.shape[1])) for row in rows])

    def vram_estimate(self, diffusion_model, dataset, config):
        """Required. The `trainer_core.vram.Estimate` of a run, shown before training starts."""
        raise NotImplementedError

    def sample_encoder(self, vae, clip):
        """The family's encoding of a whole sample (`trainer_core.dataset.SampleEncoder`) where
        `clip` is its text encoder and its text depends on the reference images; None (the
        default) where the caption alone is the text and each reference an image."""
        return None

    def check_config(self, config) -> None:
        """Raise ValueError naming the fix for a setting the family cannot train with."""

    def ignored_settings(self, diffusion_model) -> dict[str, str]:
        """The training settings (`TrainConfig` fields) the model does not read, each with why
        ("FLUX.2 [klein] 4B has no guidance embedding"): a run told of one set away from its
        default, and the LoRA's metadata records them as ignored (none by default)."""
        return {}

    def check_model_file(self, path, diffusion_model) -> None:
        """Raise ValueError naming the fix where the MODEL's file (`path`, a safetensors file the
        graph or the run file names) says more than this ComfyUI read from it (none by default)."""

    def check_preview(self, preview) -> None:
        """Raise ValueError naming the fix for PreviewSampler settings (`previews.PreviewSettings`)
        the family cannot sample as the user's graph would (none by default)."""

    def file_notes(self, config) -> list[str]:
        """What a run with `config` should know about its LoRA file in other tools (shown on
        the node's progress line and logged); none by default."""
        return []


_ABSENT = object()

FAMILIES: dict[str, ModelFamily] = {}  # title -> entry, in the order registered


def register(family: ModelFamily) -> ModelFamily:
    FAMILIES[family.title] = family
    return family


def unregister(family: ModelFamily) -> None:
    FAMILIES.pop(family.title, None)


def trained_models() -> str:
    """What the pack trains, for messages: "FLUX.1 (dev, Kontext), FLUX.2 [dev], ..."."""
    names = [family.trains for family in _all()]
    return " and ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


def layouts_by_family() -> str:
    """Which layouts fit which family, for the layout widget's tooltip: one line for the entries
    of one `image_model` that share their layouts, named by the first."""
    groups: dict[tuple, ModelFamily] = {}
    for family in _all():
        groups.setdefault((family.image_model, family.layouts), family)
    fits = [f"{f.title}: {', '.join(f.layouts)} (auto: {f.layouts[0]})." for f in groups.values()]
    return " ".join(fits)


def entry_for(unet_config: dict, what: str = "this MODEL") -> ModelFamily:
    """The model ComfyUI detected (`unet_config`: its model config's), or a clear refusal for a
    model the pack does not train."""
    image_model = unet_config.get("image_model")
    entries = [family for family in _all() if family.image_model == (image_model or "")]
    if not entries:
        kind = f"a {image_model} model" if image_model else "a model of no type ComfyUI detects"
        raise ValueError(
            f"{what} is {kind}; Kontext Trainer handles {trained_models()}. Load one of those with "
            "the stock loaders"
        )
    matching = [family for family in entries if family.matches(unet_config)]
    if not matching:
        raise ValueError(
            f"{what} is a {image_model} model that is none of {', '.join(f.trains for f in entries)} "
            f"as ComfyUI detected it; Kontext Trainer handles {trained_models()}. Load one of those "
            "with the stock loaders"
        )
    return max(matching, key=lambda family: len(family.detects))  # the first of the most specific


def sample_encoder_for(vae, clip):
    """(the encoder, its family) of the first family that encodes whole samples with `clip`
    (`ModelFamily.sample_encoder`), or None: LoadKontextDataset learns the family from its CLIP,
    as it has no MODEL."""
    for family in _all():
        encoder = family.sample_encoder(vae, clip)
        if encoder is not None:
            return encoder, family
    return None


def refuse_variant(family: ModelFamily, variant: str | None, what: str = "this MODEL") -> None:
    if variant is not None:
        raise ValueError(
            f"{what} is {variant}, which ComfyUI runs with its {family.title} code; Kontext Trainer "
            f"trains {trained_models()} only (its text ids, layers or text encoder differ, and "
            "training it is not proven). Load one of those with the stock loaders"
        )


def _all_named() -> dict[str, ModelFamily]:
    from . import flux, qwen_image  # noqa: F401  (registers the built-in families)

    return FAMILIES


def _all() -> list[ModelFamily]:
    return list(_all_named().values())
