"""The run config file: its sections follow the dataclasses, it reads back what it writes, and
every mistake is named `[section] key` with its fix."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path

import pytest

from trainer_core.config import TrainConfig
from trainer_core.dataset_options import DatasetOptions
from trainer_core.run_config import (
    ModelFiles,
    RunConfig,
    TrainerOptions,
    dump_run_config,
    load_run_config,
    parse_run_config,
    toml_value,
)

MODEL = {
    "diffusion_model": "flux.safetensors",
    "vae": "ae.safetensors",
    "text_encoders": ["clip_l.safetensors"],
}


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def parse(data: dict, folder: Path = Path("/configs")) -> RunConfig:
    return parse_run_config({"model": MODEL, **data}, "run.toml", folder)


def problem(data: dict) -> str:
    with pytest.raises(ValueError) as caught:
        parse(data)
    return str(caught.value)


def other_value(config_field: dataclasses.Field):
    """A valid value for a knob that is not its default."""
    meta, default = config_field.metadata, config_field.default
    if "options" in meta:
        return next(o for o in reversed(meta["options"]) if o != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1 if default + 1 <= meta["max"] else default - 1
    if isinstance(default, float):  # a float with a long repr, strictly inside the limits
        value = meta["min"] + (meta["max"] - meta["min"]) / 3
        return value if value != default else meta["min"] + (meta["max"] - meta["min"]) / 7
    return default + "_other"


def non_default(cls, **fixed):
    return cls(**{f.name: other_value(f) for f in dataclasses.fields(cls) if f.name not in fixed}, **fixed)


def test_sections_hold_exactly_the_nodes_fields_in_widget_order(tmp_path):
    text = dump_run_config(parse({}, tmp_path))
    data = tomllib.loads(text)  # an independent TOML reader
    assert list(data) == ["comfyui", "model", "dataset", "train"]
    assert list(data["comfyui"]) == ["base_directory", "flags"]
    assert list(data["model"]) == names(ModelFiles)
    assert list(data["dataset"]) == names(DatasetOptions)
    # a knob added to TrainConfig is a [train] key with nothing else to change
    assert list(data["train"]) == names(TrainerOptions) + names(TrainConfig)


def test_omitted_keys_take_the_defaults_and_base_directory_is_the_files_folder(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[model]\ndiffusion_model = "f.safetensors"\nvae = "ae.safetensors"\ntext_encoders = ["c"]\n'
    )
    config = load_run_config(path)
    assert config.base_directory == tmp_path.resolve()
    assert config.dataset == DatasetOptions() and config.train == TrainConfig()
    assert config.trainer == TrainerOptions()
    assert config.model == ModelFiles(
        diffusion_model="f.safetensors", vae="ae.safetensors", text_encoders=["c"]
    )
    assert parse({"comfyui": {"base_directory": "../comfy"}}).base_directory == Path("/comfy")
    assert parse({"comfyui": {"base_directory": "/opt/ComfyUI"}}).base_directory == Path("/opt/ComfyUI")


def test_an_integer_is_a_fine_float():
    config = parse({"train": {"alpha": 8, "learning_rate": 1}})
    assert type(config.train.alpha) is float and config.train.alpha == 8.0
    assert type(config.train.learning_rate) is float


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "no_checkpointing"])
def test_dump_then_load_gives_the_same_config(tmp_path, swap):
    # blocks_to_swap needs gradient_checkpointing on: each gets its non-default in one case
    fixed = {"gradient_checkpointing": True} if swap else {"blocks_to_swap": 0}
    config = RunConfig(
        base_directory=tmp_path / "comfy base ü",
        model=ModelFiles(
            diffusion_model="/models/flux dev.safetensors",
            weight_dtype="fp8_e4m3fn",
            vae='sub\\dir/"ae".safetensors',
            text_encoders=["clip_l.safetensors", "t5 xxl.safetensors"],
            clip_type="hunyuan_video",
            clip_device="cpu",
        ),
        dataset=non_default(DatasetOptions, path='C:\\data\\"set"\t\n\x01 ü', cache_folder="/cache\x7f"),
        train=non_default(TrainConfig, learning_rate=3e-05, **fixed),
        trainer=TrainerOptions("my lora", "/ckpt/run/step_000010", True, "seed.safetensors"),
    )
    for options, defaults in ((config.dataset, DatasetOptions()), (config.train, TrainConfig())):
        differ = [n for n in names(type(options)) if getattr(options, n) != getattr(defaults, n)]
        assert len(differ) == len(names(type(options))) - (type(options) is TrainConfig)
    path = tmp_path / "run.toml"
    path.write_text(dump_run_config(config), encoding="utf-8")
    loaded = load_run_config(path)
    assert loaded == config
    assert [type(getattr(loaded.train, n)) for n in names(TrainConfig)] == [
        type(getattr(config.train, n)) for n in names(TrainConfig)
    ]
    assert dump_run_config(loaded) == dump_run_config(config)


def test_each_key_has_its_description_above_it_and_advanced_ones_are_marked(tmp_path):
    # the descriptions are the application's widget schema; here one made up per key
    from types import SimpleNamespace

    names = [f.name for f in dataclasses.fields(TrainConfig)]
    describe = {
        "train": {
            name: SimpleNamespace(tooltip=f"About {name}.", advanced=i % 2 == 0, note=None)
            for i, name in enumerate(names)
        }
    }
    lines = dump_run_config(parse({}, tmp_path), describe).splitlines()
    comment_above = {}
    for index, line in enumerate(lines):
        if " = " in line and not line.startswith("#"):
            block = []
            for above in reversed(lines[:index]):
                if not above.startswith("#"):
                    break
                block.insert(0, above[2:])
            comment_above[line.split(" = ")[0]] = " ".join(block)
    for i, name in enumerate(names):
        comment = comment_above[name]
        assert comment.startswith("(advanced) ") == (i % 2 == 0)
        assert f"About {name}." in comment
    assert "One of: bf16, fp16, fp32." in comment_above["save_precision"]
    assert "From 1 to 1000000." in comment_above["steps"]


@pytest.mark.parametrize(
    "value",
    [
        "",
        "plain",
        'q"uote',
        "back\\slash",
        "tab\tnew\nline\r",
        "\x00\x08\x0c\x1f\x7f",
        "ünï ✓ 🙂",
        "'single'",
    ],
)
def test_strings_are_escaped_so_a_toml_reader_gets_them_back(value):
    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, 0.1, 1 / 3, 1e-07, 3e-05, 1e16, 1.5e300, 5e-324, -2.5])
def test_floats_stay_floats_with_every_bit(value):
    read = tomllib.loads(f"v = {toml_value(value)}")["v"]
    assert type(read) is float and read == value and math.copysign(1, read) == math.copysign(1, value)


def test_other_values():
    assert tomllib.loads(f"v = {toml_value([True, 3, 'a'])}")["v"] == [True, 3, "a"]
    assert toml_value(2**40) == "1099511627776"


def test_unknown_sections_and_keys_suggest_the_closest_name():
    message = problem({"trian": {"steps": 5}})
    assert message.startswith("run.toml: [trian]: unknown section") and "did you mean [train]?" in message
    assert "[train] stesp: unknown key; did you mean steps?" in problem({"train": {"stesp": 5}})
    assert "[dataset] rank: not a key of [dataset]; move it to [train]" in problem({"dataset": {"rank": 4}})
    assert "steps: a key outside any section; put it under [train]" in problem({"steps": 4})
    assert "[train] zzz: unknown key; the keys of [train]: lora_name, resume_from" in problem(
        {"train": {"zzz": 1}}
    )


def test_wrong_types_are_named_with_the_fix():
    assert (
        "[train] steps: expected a whole number, got text; write it without quotes: steps = 100"
        in problem({"train": {"steps": "100"}})
    )
    # bool is an int in Python, never in the config
    assert "[train] rank: expected a whole number, got true; write it like rank = 16" in problem(
        {"train": {"rank": True}}
    )
    assert "[train] learning_rate: expected a number" in problem({"train": {"learning_rate": "fast"}})
    assert "[train] overwrite: expected true or false, got 1" in problem({"train": {"overwrite": 1}})
    assert (
        '[model] vae: expected text in "double quotes", got 3; write it like vae = "ae.safetensors"'
        in problem({"model": {**MODEL, "vae": 3}})
    )
    assert "[model] text_encoders: expected a list of text" in problem(
        {"model": {**MODEL, "text_encoders": "clip_l.safetensors"}}
    )


def test_bad_values_carry_the_classes_own_message_on_the_key():
    assert "[train] steps is 0; give a number from 1 to 1000000" in problem({"train": {"steps": 0}})
    assert "[train] optimizer: unknown optimizer 'sgd'; choose one of adamw, adafactor" in problem(
        {"train": {"optimizer": "sgd"}}
    )
    assert "[dataset] resolution is 64; give a number from 128 to 2048" in problem(
        {"dataset": {"resolution": 64}}
    )
    assert "[dataset] background: unknown background 'red'; choose one of white, black, gray" in problem(
        {"dataset": {"background": "red"}}
    )
    assert "[train] lora_name 'a/b' contains a path" in problem({"train": {"lora_name": "a/b"}})
    assert "[model] weight_dtype: unknown weight_dtype 'fp4'; choose one of default, fp8_e4m3fn" in problem(
        {"model": {**MODEL, "weight_dtype": "fp4"}}
    )
    assert "[model] text_encoders is" in problem({"model": {**MODEL, "text_encoders": ["a", "b", "c"]}})
    # a combination: put on the key the message names first
    assert "[train] blocks_to_swap needs gradient_checkpointing on" in problem(
        {"train": {"gradient_checkpointing": False, "blocks_to_swap": 4}}
    )


def test_missing_model_files_are_named_with_an_example():
    message = problem({"model": {"vae": "ae.safetensors"}})
    assert message.startswith("run.toml: 2 problems:")
    assert '[model] diffusion_model: missing; add it, e.g. diffusion_model = "' in message
    assert "[model] text_encoders: missing; add it, e.g. text_encoders = [" in message


def test_every_problem_is_in_one_message():
    message = problem({"train": {"steps": 0, "rank": "8", "optimizer": "sgd"}, "dataset": {"hold_out": -1}})
    assert message.startswith("run.toml: 4 problems:")
    for key in ("[train] steps", "[train] rank", "[train] optimizer", "[dataset] hold_out"):
        assert key in message


def test_toml_syntax_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('[train]\nsteps = 10\nlora_name = "unclosed\n')
    with pytest.raises(ValueError) as caught:
        load_run_config(path)
    assert str(caught.value).startswith(f"{path}: line 3, column") and "not valid TOML" in str(caught.value)
    with pytest.raises(ValueError, match="cannot read the run config"):
        load_run_config(tmp_path / "missing.toml")


def test_dataset_options_check_their_fields_like_the_node():
    with pytest.raises(ValueError, match=r"^min_size is -1; give a number from 0 to 4096$"):
        DatasetOptions(min_size=-1)
    with pytest.raises(ValueError, match="seed must be a whole number"):
        DatasetOptions(seed=1.5)
    with pytest.raises(ValueError, match="path must be text"):
        DatasetOptions(path=None)
