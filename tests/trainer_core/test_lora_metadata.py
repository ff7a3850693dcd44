"""The LoRA file's metadata: kohya's `ss_*` fields as sd-scripts formats them, its `sshs_*`
hashes computed by hand, the model spec, and ours."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import struct

import torch
from safetensors.torch import save as serialise

from trainer_core import __version__
from trainer_core.config import TrainConfig
from trainer_core.lora_file import LoraModule, load
from trainer_core.lora_metadata import ModelNames, RunFacts, training_metadata, write_lora

STARTED = 1_763_900_000.25

FACTS = RunFacts(
    output_name="my_style",
    base_model="flux1_kontext",
    resolution=512,
    train_images=10,
    batches_per_epoch=6,  # e.g. buckets of 7 and 3 images, 2 per batch: 4 + 2 micro-batches
    dataset_hash="abc123",
    started_at=STARTED,
    session_id=77,
    names=ModelNames(
        "flux1", "flux-1-dev/lora", "flux", "networks.lora_flux", "https://github.com/black-forest-labs/flux"
    ),  # FLUX.1 (comfy_adapter/families/flux)
)

INTEGERS = [
    "ss_session_id",
    "ss_num_train_images",
    "ss_num_reg_images",
    "ss_num_batches_per_epoch",
    "ss_num_epochs",
    "ss_max_train_steps",
    "ss_steps",
    "ss_epoch",
    "ss_lr_warmup_steps",
    "ss_seed",
    "ss_batch_size_per_device",
    "ss_total_batch_size",
    "ss_gradient_accumulation_steps",
    "ss_network_dim",
]
FLOATS = [
    "ss_training_started_at",
    "ss_learning_rate",
    "ss_unet_lr",
    "ss_max_grad_norm",
    "ss_network_alpha",
    "ss_network_dropout",
    "ss_caption_dropout_rate",
    "ss_ip_noise_gamma",
    "ss_guidance_scale",
    "ss_sigmoid_scale",
    "ss_discrete_flow_shift",
    "ss_logit_mean",
    "ss_logit_std",
]
BOOLEANS = ["ss_gradient_checkpointing", "ss_v2", "ss_fp8_base"]


def config() -> TrainConfig:
    return TrainConfig(
        steps=7,
        batch_size=2,
        gradient_accumulation=2,
        rank=8,
        alpha=4.0,
        learning_rate=5e-5,
        schedule="cosine",
        layout="dreamomni2",
        targets="attention",
        timestep_sampler="shift",
        shift=2.5,
        seed=42,
        weight_decay=0.01,
    )


def test_kohya_fields_are_strings_in_sd_scripts_formats():
    metadata = training_metadata(config(), FACTS, steps=5)
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in metadata.items())
    for key in INTEGERS:
        assert str(int(metadata[key])) == metadata[key], key
    for key in FLOATS:
        float(metadata[key])  # raises on anything but a number
        assert "." in metadata[key] or "e" in metadata[key], (key, metadata[key])  # str(float), never "4"
    for key in BOOLEANS:
        assert metadata[key] in ("True", "False"), key
    assert metadata["ss_network_module"] == "networks.lora_flux"
    assert metadata["ss_base_model_version"] == "flux1"
    assert metadata["ss_output_name"] == "my_style"
    assert metadata["ss_network_dim"] == "8" and metadata["ss_network_alpha"] == "4.0"
    assert metadata["ss_learning_rate"] == "5e-05"
    assert metadata["ss_training_started_at"] == "1763900000.25"
    assert metadata["ss_resolution"] == "(512, 512)"
    assert metadata["ss_optimizer"] == "torch.optim.adamw.AdamW(weight_decay=0.01)"
    # sd-scripts' name: the class's module and name (each class's own, read here from torch)
    for name, cls in (("adamw", torch.optim.AdamW), ("adafactor", torch.optim.Adafactor)):
        other = dataclasses.replace(config(), optimizer=name, weight_decay=0.0)
        written = training_metadata(other, FACTS, 5)["ss_optimizer"]
        assert written == f"{cls.__module__}.{cls.__name__}(weight_decay=0.0)"
    assert metadata["ss_lr_scheduler"] == "cosine"
    assert metadata["ss_seed"] == "42" and metadata["ss_batch_size_per_device"] == "2"
    assert json.loads(metadata["ss_network_args"]) == {"targets": "attention", "dropout": None}
    assert (
        metadata["ss_text_encoder_lr"] == "None"
    )  # sd-scripts' value when the text encoders are not trained


def test_steps_and_epochs_by_hand():
    # 6 micro-batches per pass over the data, 2 micro-batches per step
    metadata = training_metadata(config(), FACTS, steps=5)
    assert metadata["ss_steps"] == "5" and metadata["ss_max_train_steps"] == "7"
    assert metadata["ss_total_batch_size"] == "4"  # 2 per batch, 2 batches per step
    assert metadata["ss_num_batches_per_epoch"] == "6"
    assert metadata["ss_epoch"] == "1"  # 5 steps = 10 micro-batches: one whole pass
    assert metadata["ss_num_epochs"] == "3"  # 7 steps = 14 micro-batches: into the third pass
    assert training_metadata(config(), FACTS, steps=6)["ss_epoch"] == "2"  # 12 micro-batches


def test_model_spec(tmp_path):
    _, metadata = load(_saved(tmp_path, 8, torch.float32))
    assert metadata["modelspec.sai_model_spec"] == "1.0.1"
    assert metadata["modelspec.architecture"] == "flux-1-dev/lora"
    assert metadata["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"
    assert metadata["modelspec.implementation_version"] == f"kontext-trainer/{__version__}"
    assert metadata["modelspec.title"] == "my_style"
    assert metadata["modelspec.resolution"] == "512x512"
    # the save's date: local time, whole seconds, no zone, as sd-scripts writes it
    date = datetime.datetime.fromisoformat(metadata["modelspec.date"])
    assert date.tzinfo is None and date.microsecond == 0
    assert date.timestamp() == 1.5e9


def test_ours_are_kept():
    metadata = training_metadata(config(), FACTS, steps=5)
    assert metadata["kontext_trainer.layout"] == "dreamomni2"
    assert metadata["kontext_trainer.targets"] == "attention"
    assert metadata["kontext_trainer.base_model"] == "flux1_kontext"
    assert json.loads(metadata["kontext_trainer.sampler"]) == {
        "kind": "shift",
        "weighting": "none",
        "sigmoid_scale": 1.0,
        "shift": 2.5,
    }
    assert metadata["kontext_trainer.trainer_version"] == __version__
    assert metadata["kontext_trainer.dataset_hash"] == "abc123"
    assert json.loads(metadata["kontext_trainer.config"])["rank"] == 8


def _modules(in_features: int) -> dict[str, LoraModule]:
    gen = torch.Generator().manual_seed(0)
    return {
        "single_blocks.0.linear2": LoraModule(
            torch.randn(4, in_features, generator=gen), torch.randn(64, 4, generator=gen), 2.0
        )
    }


def _saved(tmp_path, in_features: int, dtype: torch.dtype):
    """A LoRA file written at 1.5e9 s (2017-07-14) with the metadata of 5 steps of `config()`."""
    return write_lora(
        tmp_path / "x.safetensors", _modules(in_features), training_metadata(config(), FACTS, 5), dtype, 1.5e9
    )


def _data_section(raw: bytes) -> bytes:
    (header_length,) = struct.unpack("<Q", raw[:8])
    return raw[8 + header_length :]


def test_hashes_of_a_small_file_by_hand(tmp_path):
    path = _saved(tmp_path, 100, torch.bfloat16)
    raw = path.read_bytes()
    _, metadata = load(path)
    assert metadata["ss_training_finished_at"] == "1500000000.0"
    assert metadata["sshs_model_hash"] == hashlib.sha256(_data_section(raw)).hexdigest()
    # under 1 MiB: the legacy window (64 KiB at 1 MiB) is empty, and SHA-256 of nothing is e3b0c442...
    assert len(raw) < 0x100000 and metadata["sshs_legacy_hash"] == "e3b0c442"


def test_hashes_of_a_file_over_a_mebibyte_by_hand(tmp_path):
    path = _saved(tmp_path, 70_000, torch.float32)
    tensors, metadata = load(path)
    raw = path.read_bytes()
    assert len(raw) > 0x110000
    assert metadata["sshs_model_hash"] == hashlib.sha256(_data_section(raw)).hexdigest()
    # sd-scripts hashes the file as serialised with its ss_* metadata only (not modelspec, not ours)
    ss_only = {key: value for key, value in metadata.items() if key.startswith("ss_")}
    assert "modelspec.title" not in ss_only and "sshs_model_hash" not in ss_only and len(ss_only) > 30
    reference = serialise(tensors, ss_only)
    assert _data_section(reference) == _data_section(raw)
    window = reference[0x100000 : 0x100000 + 0x10000]
    assert len(window) == 0x10000
    assert metadata["sshs_legacy_hash"] == hashlib.sha256(window).hexdigest()[:8]


def test_the_base_weights_storage_is_recorded_and_fp8_bases_say_so():
    """`kontext_trainer.base_weights` records how the base's Linears were stored (issue 29's key);
    `ss_fp8_base` (sd-scripts: the base ran in fp8) is True for any fp8 storage."""
    cases = {
        "quantized file": ({"quantized": {"float8_e4m3fn": 38}, "plain": {"bfloat16": 6}}, "True"),
        "weight_dtype fp8": ({"quantized": {}, "plain": {"float8_e5m2": 44}}, "True"),
        "nvfp4": ({"quantized": {"nvfp4": 38}, "plain": {"bfloat16": 6}}, "False"),
        "bf16": ({"quantized": {}, "plain": {"bfloat16": 44}}, "False"),
    }
    for name, (weights, fp8) in cases.items():
        metadata = training_metadata(config(), dataclasses.replace(FACTS, base_weights=weights), 5)
        assert json.loads(metadata["kontext_trainer.base_weights"]) == weights, name
        assert metadata["ss_fp8_base"] == fp8, name
    unrecorded = training_metadata(config(), FACTS, 5)
    assert json.loads(unrecorded["kontext_trainer.base_weights"]) == {}
    assert unrecorded["ss_fp8_base"] == "False"
    scaled = training_metadata(dataclasses.replace(config(), fp8_mode="fp8_scaled"), FACTS, 5)
    assert scaled["ss_fp8_base"] == "True"


def test_every_value_is_plain_text_also_for_choices():
    """Choices are Enums whose members are strings; the file gets their plain text (what
    kohya's readers and safetensors' metadata take), never a member."""
    config = TrainConfig(optimizer="adafactor", schedule="cosine", timestep_sampler="logit_normal")
    metadata = training_metadata(config, FACTS, 1)
    assert {key: type(value) for key, value in metadata.items() if type(value) is not str} == {}
    assert metadata["ss_lr_scheduler"] == "cosine" and metadata["ss_timestep_sampling"] == "logit_normal"


def test_the_keys_sd_scripts_writes_for_one_folder_with_this_runs_values():
    """Issue 32: 43 ss_* keys where sd-scripts writes 84-97 for a Flux LoRA; ss_epoch "0" at
    the end of a run inside its first epoch; ss_total_batch_size without the processes."""
    from trainer_core.lora_metadata import tag_frequency

    facts = dataclasses.replace(
        FACTS,
        dataset_dir="my_set",
        tag_frequency=tag_frequency(["Red cube, on a table", "red cube,  blue sky ", ""]),
        buckets=(((512, 512), 7), ((640, 384), 3)),
        aspect_error=0.01,
        validation_images=2,
        validation_seed=5,
        processes=2,
        mixed_precision="bf16",
    )
    final = training_metadata(config(), facts, steps=7)
    assert len([k for k in final if k.startswith("ss_")]) >= 84
    assert json.loads(final["ss_tag_frequency"]) == {
        "my_set": {"red cube": 2, "on a table": 1, "blue sky": 1}
    }
    assert json.loads(final["ss_dataset_dirs"]) == {"my_set": {"n_repeats": 1, "img_count": 10}}
    assert json.loads(final["ss_bucket_info"]) == {
        "buckets": {"0": {"resolution": [512, 512], "count": 7}, "1": {"resolution": [640, 384], "count": 3}},
        "mean_img_ar_error": 0.01,
    }
    assert (final["ss_min_bucket_reso"], final["ss_max_bucket_reso"]) == ("384", "640")
    assert final["ss_total_batch_size"] == "8"  # 2 per batch x 2 processes x 2 accumulated
    assert final["ss_epoch"] == final["ss_num_epochs"] == "3"  # the final save: the epochs run
    assert training_metadata(config(), facts, steps=2)["ss_epoch"] == "0"  # a snapshot: passes done
    assert final["ss_mixed_precision"] == "bf16" and final["ss_cache_latents"] == "True"
    assert final["ss_num_validation_images"] == "2" and final["ss_validation_split"] == str(2 / 12)
    assert "ss_sd_model_name" not in final  # the MODEL's file is not known here


def test_the_base_models_file_is_named_and_hashed_as_sd_scripts_does(tmp_path):
    from trainer_core.lora_metadata import ModelFile

    path = tmp_path / "flux.safetensors"
    data = bytes(range(256)) * 8192  # 2 MiB
    path.write_bytes(data)
    model = ModelFile(path)
    assert model.full_hash(wait=True) == hashlib.sha256(data).hexdigest()
    assert model.legacy_hash == hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    metadata = training_metadata(config(), dataclasses.replace(FACTS, model_file=model), steps=7)
    assert metadata["ss_sd_model_name"] == "flux.safetensors"
    assert metadata["ss_new_sd_model_hash"] == hashlib.sha256(data).hexdigest()
