"""Building a dataset: validated files -> sized images -> cached latents and text embeddings.

`build_dataset` runs every encoder call a dataset will ever need, once, up front (with a
progress callback); entries found in the cache are not decoded or encoded again. The
resulting `KontextDataset` only reads the cache: training never runs the VAE or the text
encoder. Position ids and reference offsets are not stored; they are rebuilt from the
latent shapes whenever a batch is packed (seed 001).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .buckets import assign_buckets
from .dataset_files import DatasetScan, read_caption
from .encode_cache import IMAGE_RULE_VERSION, EncodeCache, cache_key, file_digest
from .flow_step import EmptyText, Sample
from .image_files import WHITE, read_image, unreadable, upright_size
from .sizing import check_side_cap, fit_to_area, resize_exact


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


# (caption, the sample's reference images as read (H, W, 3) in [0, 1], whether to encode them as
# latents too) -> the text's (T, D) context and (D,) pooled, and the reference latents the
# conditioning carries (none when not asked)
SampleEncoder = Callable[[str, list[np.ndarray], bool], tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]


@dataclass
class Encoders:
    """The user's encoders, as plain callables (the node adapts ComfyUI's VAE and CLIP)."""

    encode_image: Callable[[np.ndarray], torch.Tensor]  # (H, W, 3) float in [0, 1] -> (C, [T,] h, w)
    encode_text: Callable[[str], tuple[torch.Tensor, torch.Tensor]]  # caption -> (T, D), (D,)
    image_identity: str  # changes when the VAE's weights change
    text_identity: str  # changes when the text encoder's weights change
    # The model family's encoding of a whole sample, where its text depends on the reference
    # images (Qwen-Image-Edit: ComfyUI's TextEncodeQwenImageEditPlus puts them into the text as
    # vision tokens and resizes them for the VAE itself). None: the caption alone, each reference
    # encoded as an image at `reference_resolution` (FLUX).
    encode_sample: SampleEncoder | None = None
    sample_identity: str = ""  # that encoding and the ComfyUI running it (part of its keys)
    sample_note: str = ""  # what a user should know of it (a notice of the dataset with references)


@dataclass(frozen=True)
class DatasetSettings:
    resolution: int = 1024  # targets: area about resolution^2 (aspect buckets)
    reference_resolution: int = 1024  # references: MultiImageConditioning's rule; 0 keeps size
    background: tuple[float, float, float] = WHITE  # under transparent pixels
    hold_out: int = 0  # samples kept out of training for validation
    seed: int = 0  # which samples are held out


@dataclass
class DatasetEntry:
    name: str
    caption: str
    target_key: str
    target_size: tuple[int, int]  # (width, height) in pixels after the size rule
    reference_keys: list[str]
    reference_sizes: list[tuple[int, int]]
    text_key: str
    aspect_error: float = 0.0  # |the image's aspect ratio - its size's| (sd-scripts' bucket AR error)
    empty_text_key: str = ""  # the sample's own empty prompt (`Encoders.encode_sample`); "": the dataset's


@dataclass
class KontextDataset:
    cache: EncodeCache
    settings: DatasetSettings
    entries: list[DatasetEntry]  # training samples
    held_out: list[DatasetEntry]  # validation samples
    empty_text_key: str
    folder_structure: str  # how the dataset folder is arranged ("one_folder" / "parallel_folders")
    notices: list[str] = field(default_factory=list)
    encoded_images: int = 0  # encoder calls made while building (0 on a fully cached pass)
    encoded_texts: int = 0
    text_tokens: int = 0  # the longest encoded caption's context length (the VRAM estimate's)
    source: str = ""  # the dataset folder it was built from
    # the fingerprints of the VAE and the text encoder that encoded it (`Encoders`): a checkpoint
    # records them (`trained_on`)
    encoder_identities: tuple[str, str] = ("", "")

    @property
    def reference_count(self) -> int:
        return len(self.entries[0].reference_keys) if self.entries else 0

    @property
    def content_hash(self) -> str:
        """Identifies files, captions, size rule and encoders (for the LoRA's metadata)."""
        return cache_key(
            [(e.name, e.target_key, e.reference_keys, e.text_key) for e in self.entries + self.held_out]
        )[:16]

    @property
    def held_out_hash(self) -> str:
        """Identifies which samples are held out: `content_hash` cannot (it hashes the training
        and held-out samples in one sequence, so holding out the last sample keeps it)."""
        return cache_key(["held out", *(e.name for e in self.held_out)])[:16]

    def buckets(self) -> dict[tuple[int, int], list[int]]:
        """Training entries grouped by target size (their aspect bucket)."""
        return assign_buckets([e.target_size for e in self.entries], resolution=0)

    def sample(
        self,
        entry: DatasetEntry,
        latent_in: Callable[[torch.Tensor], torch.Tensor] = _same,
        text_in: Callable[[torch.Tensor], torch.Tensor] = _same,
    ) -> Sample:
        """One training sample from the cache; `latent_in` maps VAE latents into the
        diffusion model's space (ComfyUI's `process_latent_in`), `text_in` a caption's
        embedding to the model's context (FLUX.2 pads it)."""
        text = self.cache.load("text", entry.text_key)

        def latent(key: str) -> torch.Tensor:  # `latent_in` takes a batch (Wan 2.1's per channel)
            return latent_in(self.cache.load("latents", key)["latent"][None])[0]

        return Sample(
            latent(entry.target_key),
            text_in(text["context"]),
            text["pooled"],
            [latent(key) for key in entry.reference_keys],
            self._empty(entry.empty_text_key, text_in) if entry.empty_text_key else None,
        )

    def _empty(self, key: str, text_in: Callable[[torch.Tensor], torch.Tensor]) -> EmptyText:
        text = self.cache.load("text", key)
        return EmptyText(text_in(text["context"]), text["pooled"])

    def empty_text(self, text_in: Callable[[torch.Tensor], torch.Tensor] = _same) -> EmptyText:
        return self._empty(self.empty_text_key, text_in)


def _image_key(path, size, settings, encoders) -> str:
    return cache_key(IMAGE_RULE_VERSION, _digest(path), size, settings.background, encoders.image_identity)


def _digest(path) -> str:
    """The file's digest (part of its cache keys); a file gone or unreadable since the dataset's
    scan named in the pack's line, as reading it would be."""
    try:
        return file_digest(path)
    except OSError as error:
        raise unreadable(path, error) from None


def check_hold_out(hold_out: int, samples: int) -> None:
    """At least one of the dataset's `samples` is left to train on, or the line naming hold_out
    and the fix (known from the files: the command line checks it before ComfyUI boots)."""
    if hold_out < 0:
        raise ValueError(f"hold_out: {hold_out} is below 0; set hold_out to 0 or more")
    if hold_out >= samples:
        raise ValueError(
            f"hold_out: {hold_out} leaves none of the dataset's {samples} sample(s) to train on; set "
            f"hold_out to at most {samples - 1}, or add samples"
        )


def _planned_size(path, resolution: int) -> tuple[int, int]:
    width, height = upright_size(path)
    check_side_cap(width, height, str(path))
    return fit_to_area(width, height, resolution)


def build_dataset(
    scan: DatasetScan,
    encoders: Encoders,
    cache: EncodeCache,
    settings: DatasetSettings,
    progress: Callable[[int, int], None] | None = None,
) -> KontextDataset:
    check_hold_out(settings.hold_out, len(scan.samples))
    captions = [read_caption(s.caption) for s in scan.samples]
    if encoders.encode_sample is None:
        total = sum(1 + len(s.references) for s in scan.samples) + len(set(captions)) + 1
    else:  # per sample: its target, its text with its references, its empty prompt
        total = 3 * len(scan.samples) + 1
    done = 0
    encoded = {"images": 0, "texts": 0}
    errors: dict = {}

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    def image(path, resolution) -> tuple[str, tuple[int, int]]:
        size = _planned_size(path, resolution)
        width, height = upright_size(path)
        errors[path] = abs(width / height - size[0] / size[1])
        key = _image_key(path, size, settings, encoders)
        if not cache.has("latents", key):
            pixels = resize_exact(read_image(path, settings.background).pixels, *size)
            latent = encoders.encode_image(pixels)
            cache.put("latents", key, {"latent": latent})
            encoded["images"] += 1
        tick()
        return key, size

    def text(caption: str) -> str:
        key = cache_key("text", caption, encoders.text_identity)
        if not cache.has("text", key):
            context, pooled = encoders.encode_text(caption)
            cache.put("text", key, {"context": context, "pooled": pooled})
            encoded["texts"] += 1
        tick()
        return key

    def with_references(files, caption: str) -> tuple[str, str, list[str]]:
        """The family's encoding of the sample (`Encoders.encode_sample`): its text and empty
        prompt with its reference images, and the references as its conditioning carries them.
        Each keyed by what it depends on: the reference files, the decoding rule, the encoding
        (ComfyUI's version included), and the caption and text encoder (texts) or the VAE
        (references)."""
        files_key = [IMAGE_RULE_VERSION, settings.background, encoders.sample_identity]
        files_key += [_digest(path) for path in files.references]
        text_key, empty_key = (
            cache_key("sample text", c, files_key, encoders.text_identity) for c in (caption, "")
        )
        ref_keys = [
            cache_key("sample reference", i, files_key, encoders.image_identity)
            for i in range(len(files.references))
        ]
        pixels = None

        def images() -> list[np.ndarray]:
            nonlocal pixels
            if pixels is None:
                for path in files.references:
                    check_side_cap(*upright_size(path), str(path))
                pixels = [read_image(path, settings.background).pixels for path in files.references]
            return pixels

        references = not all(cache.has("latents", key) for key in ref_keys)
        if references or not cache.has("text", text_key):  # the VAE runs only for missing latents
            context, pooled, latents = encoders.encode_sample(caption, images(), references)
            if not cache.has("text", text_key):
                cache.put("text", text_key, {"context": context, "pooled": pooled})
                encoded["texts"] += 1
            if references:
                for key, latent in zip(ref_keys, latents, strict=True):
                    cache.put("latents", key, {"latent": latent})
                encoded["images"] += len(latents)
        tick()
        if not cache.has("text", empty_key):  # the empty prompt keeps the images (not re-encoded)
            context, pooled, _ = encoders.encode_sample("", images(), False)
            cache.put("text", empty_key, {"context": context, "pooled": pooled})
            encoded["texts"] += 1
        tick()
        return text_key, empty_key, ref_keys

    per_sample = encoders.encode_sample is not None
    text_keys = {} if per_sample else {caption: text(caption) for caption in dict.fromkeys(captions)}
    empty_key = text("")
    entries = []
    for files, caption in zip(scan.samples, captions, strict=True):
        target_key, target_size = image(files.target, settings.resolution)
        if per_sample:
            text_key, own_empty, ref_keys = with_references(files, caption)
            # the size the family's encoding gave each reference, at the target's pixels per latent
            scale = target_size[0] / cache.shape("latents", target_key, "latent")[-1]
            shapes = [cache.shape("latents", key, "latent")[-2:] for key in ref_keys]
            refs = [
                (key, (round(w * scale), round(h * scale)))
                for key, (h, w) in zip(ref_keys, shapes, strict=True)
            ]
            text_keys[caption + "\0" + files.name] = text_key
        else:
            refs = [image(path, settings.reference_resolution) for path in files.references]
            text_key, own_empty = text_keys[caption], ""
        entries.append(
            DatasetEntry(
                files.name,
                caption,
                target_key,
                target_size,
                [key for key, _ in refs],
                [size for _, size in refs],
                text_key,
                errors[files.target],
                own_empty,
            )
        )
    held = set(
        torch.randperm(len(entries), generator=torch.Generator().manual_seed(settings.seed))[
            : settings.hold_out
        ].tolist()
    )
    notices = list(scan.notices)
    if per_sample and encoders.sample_note and any(files.references for files in scan.samples):
        notices.append(encoders.sample_note)
    return KontextDataset(
        cache,
        settings,
        [e for i, e in enumerate(entries) if i not in held],
        [e for i, e in enumerate(entries) if i in held],
        empty_key,
        scan.folder_structure,
        notices,
        encoded["images"],
        encoded["texts"],
        max(cache.shape("text", key, "context")[-2] for key in [*text_keys.values(), empty_key]),
        str(scan.root),
        (encoders.image_identity, encoders.text_identity),
    )
