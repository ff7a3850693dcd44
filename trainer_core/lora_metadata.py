"""The LoRA file's metadata: what kohya's sd-scripts writes for a Flux LoRA, so that the tools
that read kohya files (LoRA managers, model sites, web UIs) show this one too.

- `ss_*`: the training facts as sd-scripts records them (`train_network.py` and
  `flux_train_network.py`): every value a string, numbers as Python prints them, booleans as
  `True` / `False`, times as seconds since the epoch, `ss_network_args` as JSON;
- `sshs_model_hash` / `sshs_legacy_hash`: the hashes sd-scripts precomputes for the
  additional-networks extension, over the file as serialised with the `ss_*` metadata only;
- `modelspec.*`: the Stability AI model spec (architecture, implementation, title, date,
  resolution) that model browsers display;
- `kontext_trainer.*`: ours (layout, targets, sampler, trainer version, dataset hash, base model,
  the whole config as JSON), which the pack reads back.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import save as serialise

from . import __version__
from .config import TrainConfig
from .lora_file import LoraModule, save_atomic, to_state_dict
from .optimizers import optimizer_spec

MODELSPEC_VERSION = "1.0.1"  # what sd-scripts writes
# What names the base model (ss_base_model_version, ss_model_type, ss_network_module,
# modelspec.architecture and .implementation) comes from the model's family (`ModelNames`); which
# model of the family it is, ours says in kontext_trainer.base_model.

_HASH_BLOCK = 1 << 20  # sd-scripts hashes the data section in 1 MiB reads
_LEGACY_OFFSET, _LEGACY_LENGTH = 0x100000, 0x10000


@dataclass(frozen=True)
class ModelNames:
    """What a LoRA file's metadata calls its base model, as the model's family gives it."""

    base_model_version: str  # sd-scripts' ss_base_model_version
    architecture: str  # modelspec.architecture
    model_type: str  # sd-scripts' ss_model_type
    network_module: str  # sd-scripts' ss_network_module: the LoRA module its scripts use
    implementation: str  # modelspec.implementation: where the model's reference code lives


@dataclass(frozen=True)
class RunFacts:
    """What the metadata says about one run beyond its config."""

    output_name: str  # the LoRA's file name without .safetensors
    base_model: str  # ours: "flux1_dev" (no references), "flux1_kontext" or "flux2_dev"
    resolution: int
    train_images: int  # training samples (held-out ones not counted)
    batches_per_epoch: int  # micro-batches in one pass over them (`loop.DataOrder.per_epoch`)
    dataset_hash: str
    started_at: float  # time.time() when the run started
    session_id: int
    names: ModelNames  # what the metadata calls the base model (its family's names)
    # how the base model's Linear weights were stored: {"quantized": {format: layers} (a file in
    # ComfyUI's quantized formats), "plain": {dtype: layers}}; None: not recorded
    base_weights: dict | None = None
    # the dataset as sd-scripts describes one folder (ss_dataset_dirs, ss_tag_frequency,
    # ss_bucket_info): its folder's name, each comma-separated tag's count over the training
    # captions, the buckets ((width, height), samples) and their mean aspect-ratio error
    dataset_dir: str = ""
    tag_frequency: Mapping[str, int] = field(default_factory=dict)
    buckets: tuple = ()
    aspect_error: float = 0.0
    validation_images: int = 0  # held-out samples, and the seed that picked them
    validation_seed: int = 0
    processes: int = 1  # data-parallel processes (ss_total_batch_size counts them)
    mixed_precision: str = "no"  # the compute dtype as sd-scripts names it: "bf16", "fp16", "no"
    model_file: ModelFile | None = None  # the base model's file (its name and hashes), if known
    # the settings the model does not read (its family's `ignored_settings`): left out of the
    # ss_* keys (ss_guidance_scale) and listed in kontext_trainer.ignored
    ignored: tuple[str, ...] = ()
    # what the run trained on (`trained_on.TrainedOn.record`: the model entry, the base, VAE and
    # text encoder files and fingerprints, the base files of the steps before a resume on another)
    trained_on: dict | None = None


class ModelFile:
    """The base model's file as sd-scripts names it in a LoRA: its name (`ss_sd_model_name`),
    the legacy hash (`ss_sd_model_hash`: SHA-256 of 64 KiB at 1 MiB into the file, 8 hex
    digits) and the SHA-256 of the whole file (`ss_new_sd_model_hash`), computed in a thread
    of its own so a run of a 20 GB model does not wait for it (`full_hash`)."""

    WAIT_SECONDS = 120  # the final save waits this long for the whole file's hash at most

    _known: ClassVar[dict[tuple, ModelFile]] = {}  # one hash per file version, for later runs too

    def __new__(cls, path: Path):
        found = Path(path).stat()
        key = (str(Path(path).resolve()), found.st_size, found.st_mtime_ns)
        if key not in cls._known:
            cls._known[key] = super().__new__(cls)
            cls._known[key]._start(Path(path))
        return cls._known[key]

    def _start(self, path: Path) -> None:
        self.name = path.name
        with open(path, "rb") as handle:
            handle.seek(_LEGACY_OFFSET)
            self.legacy_hash = hashlib.sha256(handle.read(_LEGACY_LENGTH)).hexdigest()[:8]
        self._full: str | None = None
        self._thread = threading.Thread(target=self._hash, args=(path,), daemon=True)
        self._thread.start()

    def _hash(self, path: Path) -> None:
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as handle:
                while block := handle.read(_HASH_BLOCK * 8):
                    digest.update(block)
        except OSError:  # gone or unreadable meanwhile: the LoRA says nothing about it
            return
        self._full = digest.hexdigest()

    def full_hash(self, wait: bool = False) -> str | None:
        """The whole file's SHA-256; None while it is computed (`wait`: for up to WAIT_SECONDS;
        a slower disk leaves the key out rather than holding the run's end)."""
        if wait:
            self._thread.join(self.WAIT_SECONDS)
        return self._full


def fp8_base(base_weights: dict | None) -> bool:
    """True when any Linear of the base was stored in an 8-bit float (a quantized file, or
    weight_dtype fp8): sd-scripts' `ss_fp8_base`."""
    formats = {name for kind in (base_weights or {}).values() for name in kind}
    return any(name.startswith("float8") for name in formats)


def training_metadata(config: TrainConfig, facts: RunFacts, steps: int) -> dict[str, str]:
    """The metadata of the LoRA at `steps` (hashes and finish time come at save time:
    `finish_metadata`). An epoch is one pass over the training samples (`batches_per_epoch`
    micro-batches: batches never mix aspect buckets, so a bucket's last one may be short);
    `ss_epoch` counts the whole passes done."""
    # sd-scripts: the class's module and name, then the keyword arguments given to it
    optimizer = f"{optimizer_spec(config.optimizer).class_path}(weight_decay={config.weight_decay})"
    network_args = {"targets": config.targets, "dropout": config.dropout or None}
    samples_per_step = config.batch_size * facts.processes * config.gradient_accumulation
    per_epoch, accumulation = facts.batches_per_epoch, config.gradient_accumulation
    epochs = math.ceil(config.steps * accumulation / per_epoch)
    # sd-scripts: a step save records the whole passes done, the final save the epochs run
    epoch = epochs if steps >= config.steps else steps * accumulation // per_epoch
    family = facts.names
    kohya = {
        "ss_session_id": str(facts.session_id),
        "ss_training_started_at": str(facts.started_at),
        "ss_output_name": facts.output_name,
        "ss_learning_rate": str(config.learning_rate),
        "ss_unet_lr": str(config.learning_rate),
        "ss_text_encoder_lr": "None",  # the text encoders are not trained
        "ss_num_train_images": str(facts.train_images),
        "ss_num_reg_images": "0",
        "ss_num_batches_per_epoch": str(per_epoch),
        "ss_num_epochs": str(epochs),
        "ss_max_train_steps": str(config.steps),
        "ss_steps": str(steps),
        "ss_epoch": str(epoch),
        "ss_lr_warmup_steps": str(config.warmup_steps),
        "ss_lr_scheduler": str(config.schedule),
        "ss_optimizer": optimizer,
        "ss_max_grad_norm": str(config.max_grad_norm),
        "ss_seed": str(config.seed),
        "ss_batch_size_per_device": str(config.batch_size),
        "ss_total_batch_size": str(samples_per_step),
        "ss_gradient_accumulation_steps": str(config.gradient_accumulation),
        "ss_gradient_checkpointing": str(config.gradient_checkpointing),
        "ss_network_module": family.network_module,
        "ss_network_dim": str(config.rank),
        "ss_network_alpha": str(config.alpha),
        "ss_network_dropout": str(config.dropout),
        "ss_network_args": json.dumps(network_args),
        "ss_base_model_version": family.base_model_version,
        "ss_v2": "False",
        "ss_resolution": f"({facts.resolution}, {facts.resolution})",
        "ss_caption_dropout_rate": str(config.caption_dropout),
        "ss_ip_noise_gamma": str(config.ip_noise_gamma),
        "ss_fp8_base": str(config.fp8_mode == "fp8_scaled" or fp8_base(facts.base_weights)),
        "ss_model_type": family.model_type,
        # a model without a guidance embedding read none: no value (tools parse it as a number)
        **({} if "guidance" in facts.ignored else {"ss_guidance_scale": str(config.guidance)}),
        "ss_timestep_sampling": str(config.timestep_sampler),
        "ss_sigmoid_scale": str(config.sigmoid_scale),
        "ss_discrete_flow_shift": str(config.shift),
        "ss_logit_mean": str(config.logit_mean),
        "ss_logit_std": str(config.logit_std),
        "ss_weighting_scheme": str(config.loss_weighting),
        "ss_model_prediction_type": "raw",
        **_sd_scripts_defaults(config, facts),
        **_dataset_keys(facts),
        **_model_file_keys(facts.model_file, final=steps >= config.steps),
    }
    spec = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": family.architecture,
        "modelspec.implementation": family.implementation,
        "modelspec.implementation_version": f"kontext-trainer/{__version__}",
        "modelspec.title": facts.output_name,
        "modelspec.resolution": f"{facts.resolution}x{facts.resolution}",
    }
    sampler = {"kind": config.timestep_sampler, "weighting": config.loss_weighting}
    if config.timestep_sampler == "logit_normal":
        sampler.update(mean=config.logit_mean, std=config.logit_std)
    elif config.timestep_sampler != "uniform":
        sampler["sigmoid_scale"] = config.sigmoid_scale
    if config.timestep_sampler == "shift":
        sampler["shift"] = config.shift
    ours = {
        "layout": config.layout,
        "targets": config.targets,
        "sampler": sampler,
        "trainer_version": __version__,
        "dataset_hash": facts.dataset_hash,
        "base_model": facts.base_model,
        "base_weights": facts.base_weights or {},
        "config": asdict(config),
    }
    if facts.trained_on is not None:
        ours["trained_on"] = facts.trained_on
    if facts.ignored:  # the config above still holds what was given
        ours["ignored"] = list(facts.ignored)
    ours_text = {
        f"kontext_trainer.{key}": str(value) if isinstance(value, str) else json.dumps(value)
        for key, value in ours.items()
    }
    return {**kohya, **spec, **ours_text}


def _sd_scripts_defaults(config: TrainConfig, facts: RunFacts) -> dict[str, str]:
    """The keys sd-scripts writes for options this trainer has not got, with the value that
    describes what it did (no noise offset, an L2 loss, latents cached, ...), and the ones
    that follow from its settings."""
    fp8 = str(config.fp8_mode == "fp8_scaled" or fp8_base(facts.base_weights))
    held = facts.validation_images
    return {
        "ss_mixed_precision": facts.mixed_precision,
        "ss_full_fp16": "False",
        "ss_lowram": "False",
        "ss_cache_latents": "True",  # every run trains on cached latents and text embeddings
        "ss_fp8_base_unet": fp8,
        "ss_apply_t5_attn_mask": "False",  # ComfyUI's Flux attends to the whole T5 context
        "ss_mode_scale": "1.29",  # sd-scripts' default; its "mode" weighting is not offered
        "ss_noise_offset": "None",
        "ss_noise_offset_random_strength": "False",
        "ss_multires_noise_iterations": "None",
        "ss_multires_noise_discount": "0.3",
        "ss_adaptive_noise_scale": "None",
        "ss_ip_noise_gamma_random_strength": "False",
        "ss_zero_terminal_snr": "False",
        "ss_debiased_estimation": "False",
        "ss_min_snr_gamma": "None",
        "ss_scale_weight_norms": "None",
        "ss_loss_type": "l2",
        "ss_huber_schedule": "snr",
        "ss_huber_c": "0.1",
        "ss_huber_scale": "1.0",
        "ss_prior_loss_weight": "1.0",
        "ss_caption_dropout_every_n_epochs": "0",
        "ss_caption_tag_dropout_rate": "0.0",
        "ss_clip_skip": "None",
        "ss_max_token_length": "None",
        "ss_face_crop_aug_range": "None",
        "ss_training_comment": "None",
        "ss_resize_interpolation": "lanczos",
        "ss_num_validation_images": str(held),
        "ss_validation_seed": str(facts.validation_seed) if held else "None",
        "ss_validation_split": str(held / (held + facts.train_images)) if held else "0.0",
        "ss_validate_every_n_steps": str(config.validate_every or config.steps) if held else "None",
        "ss_validate_every_n_epochs": "None",
        "ss_max_validation_steps": "None",
    }


def tag_frequency(captions) -> dict[str, int]:
    """sd-scripts' tag count: each caption split at commas, each tag stripped and lowercased."""
    counts: dict[str, int] = {}
    for caption in captions:
        for tag in caption.split(","):
            if tag := tag.strip().lower():
                counts[tag] = counts.get(tag, 0) + 1
    return counts


def _dataset_keys(facts: RunFacts) -> dict[str, str]:
    """One folder, as sd-scripts writes a dataset given without a config file: no repeats, no
    regularisation images, buckets by exact size (no augmentation, nothing shuffled)."""
    folder = facts.dataset_dir or "dataset"
    sides = [side for (size, _) in facts.buckets for side in size]
    buckets = {
        str(index): {"resolution": list(size), "count": count}
        for index, (size, count) in enumerate(facts.buckets)
    }
    return {
        "ss_dataset_dirs": json.dumps({folder: {"n_repeats": 1, "img_count": facts.train_images}}),
        "ss_reg_dataset_dirs": json.dumps({}),
        "ss_tag_frequency": json.dumps({folder: dict(facts.tag_frequency)}),
        "ss_bucket_info": json.dumps({"buckets": buckets, "mean_img_ar_error": facts.aspect_error}),
        "ss_enable_bucket": "True",
        "ss_min_bucket_reso": str(min(sides)) if sides else "None",
        "ss_max_bucket_reso": str(max(sides)) if sides else "None",
        "ss_bucket_no_upscale": "False",
        "ss_color_aug": "False",
        "ss_flip_aug": "False",
        "ss_random_crop": "False",
        "ss_shuffle_caption": "False",
        "ss_keep_tokens": "0",
    }


def _model_file_keys(model_file: ModelFile | None, final: bool) -> dict[str, str]:
    """sd-scripts' base-model name and hashes (only when the MODEL's file is known; the whole
    file's hash in a snapshot only once computed, in the final LoRA always)."""
    if model_file is None:
        return {}
    keys = {"ss_sd_model_name": model_file.name, "ss_sd_model_hash": model_file.legacy_hash}
    if (full := model_file.full_hash(wait=final)) is not None:
        keys["ss_new_sd_model_hash"] = full
    return keys


def kohya_hashes(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[str, str]:
    """(sshs_model_hash, sshs_legacy_hash) as sd-scripts computes them: the file serialised with
    only the `ss_*` metadata; the model hash is the SHA-256 of everything after the header, the
    legacy hash the first 8 hex digits of the SHA-256 of the 64 KiB at 1 MiB into the file."""
    data = serialise(dict(state), {k: v for k, v in metadata.items() if k.startswith("ss_")})
    header_end = 8 + int.from_bytes(data[:8], "little")
    model = hashlib.sha256()
    for start in range(header_end, len(data), _HASH_BLOCK):
        model.update(data[start : start + _HASH_BLOCK])
    legacy = hashlib.sha256(data[_LEGACY_OFFSET : _LEGACY_OFFSET + _LEGACY_LENGTH]).hexdigest()[:8]
    return model.hexdigest(), legacy


def finish_metadata(
    state: Mapping[str, torch.Tensor], metadata: Mapping[str, str], finished_at: float
) -> dict[str, str]:
    """`metadata` plus what only the saved tensors and the save time decide."""
    done = {**metadata, "ss_training_finished_at": str(finished_at)}
    # local time, whole seconds, no zone: as sd-scripts dates a save
    done["modelspec.date"] = datetime.datetime.fromtimestamp(int(finished_at)).isoformat()
    done["sshs_model_hash"], done["sshs_legacy_hash"] = kohya_hashes(state, done)
    return done


def write_lora(
    path: Path,
    modules: Mapping[str, LoraModule],
    metadata: Mapping[str, str],
    dtype: torch.dtype,
    finished_at: float,
    replace: bool = True,
) -> Path:
    """The LoRA file (kohya keys, lora_down / lora_up in `dtype`, the whole metadata), atomically
    (`replace` off: never over an existing file, `lora_file.save_atomic`)."""
    state = to_state_dict(modules, dtype)
    return save_atomic(state, path, finish_metadata(state, metadata, finished_at), replace)
