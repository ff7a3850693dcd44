"""The run config file: one TOML file holding what a training workflow holds, for headless runs.

    [comfyui]  base_directory: a ComfyUI base directory (models/, input/, output/, temp/ under it);
               flags: ComfyUI's own command-line flags (e.g. ["--reserve-vram", "2"])
    [model]    the files the stock loaders load (`ModelFiles`)
    [dataset]  LoadKontextDataset's widgets (`DatasetOptions`)
    [train]    TrainLoRA's widgets: `TrainerOptions`, then `TrainConfig`

Sections and keys are generated from these dataclasses' fields, as the nodes' widgets are, so a
new knob is a new key with no change here. Keys left out take their defaults (the model files
have none). A bad file gives one ValueError naming the file, each `[section] key`, what is
wrong and the fix; `dump_run_config` writes a file `load_run_config` reads back unchanged.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .choices import Choice
from .config import TrainConfig, knob
from .dataset_options import DatasetOptions
from .names import lora_stem

WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")  # UNETLoader's
CLIP_DEVICES = ("default", "cpu")  # CLIPLoader's and DualCLIPLoader's
NONE = "none"  # resume_from / start_from_lora: fresh weights
CHECKPOINTS = "output/kontext_trainer_checkpoints"


def required(example) -> dict:
    """The metadata of a field the file must give; `example` shows how when it is missing."""
    return {"example": example}


@dataclass(kw_only=True)
class ModelFiles:
    """The stock loaders of a training workflow: UNETLoader, VAELoader, and CLIPLoader (one text
    encoder file) or DualCLIPLoader (two)."""

    diffusion_model: str = field(metadata=required("flux1-dev-kontext_fp8_scaled.safetensors"))
    weight_dtype: str = knob("default", options=WEIGHT_DTYPES)
    vae: str = field(metadata=required("ae.safetensors"))
    text_encoders: list[str] = field(
        metadata=required(["clip_l.safetensors", "t5xxl_fp8_e4m3fn_scaled.safetensors"])
    )
    clip_type: str = knob("flux")
    clip_device: str = knob("default", options=CLIP_DEVICES)

    def __post_init__(self):
        for name in ("diffusion_model", "vae", "clip_type"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                example = _field(ModelFiles, name).metadata.get("example", _field(ModelFiles, name).default)
                raise ValueError(f"{name} is empty; give it, e.g. {name} = {toml_value(example)}")
        encoders = self.text_encoders
        if not isinstance(encoders, list) or not 1 <= len(encoders) <= 2 or not all(encoders):
            raise ValueError(
                f"text_encoders is {self.text_encoders!r}; give one file (CLIPLoader) or two, clip_l and "
                "t5xxl (DualCLIPLoader)"
            )
        for name, choices in (("weight_dtype", WEIGHT_DTYPES), ("clip_device", CLIP_DEVICES)):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(choices)}"
                )


@dataclass
class TrainerOptions:
    """TrainLoRA's widgets that are not TrainConfig: where the run saves and what it starts from."""

    lora_name: str = knob("kontext_lora")
    resume_from: str = knob(NONE)
    overwrite: bool = knob(False)
    start_from_lora: str = knob(NONE)

    def __post_init__(self):
        for name in ("lora_name", "resume_from", "start_from_lora"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be text; got {getattr(self, name)!r}")
        lora_stem(self.lora_name)


@dataclass
class ComfyUISection:
    base_directory: str = knob(".")
    # ComfyUI's own command-line flags, as main.py takes them (the command line reads them before
    # ComfyUI boots: application/cli.py); `-- FLAGS` after the command adds more
    flags: list[str] = field(default_factory=list, metadata={"example": ["--cpu"]})


@dataclass(kw_only=True)
class RunConfig:
    base_directory: Path = Path(".")  # absolute once read from a file
    comfyui_flags: list[str] = field(default_factory=list)  # [comfyui] flags
    model: ModelFiles
    dataset: DatasetOptions = field(default_factory=DatasetOptions)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerOptions = field(default_factory=TrainerOptions)


# section -> the dataclasses whose fields are its keys, in file order
SECTIONS: dict[str, tuple[type, ...]] = {
    "comfyui": (ComfyUISection,),
    "model": (ModelFiles,),
    "dataset": (DatasetOptions,),
    "train": (TrainerOptions, TrainConfig),
}


def section_keys(section: str) -> list[str]:
    return [f.name for cls in SECTIONS[section] for f in fields(cls)]


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """Read a run config file; relative base directories resolve against its folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise ValueError(f"{path}: cannot read the run config ({reason})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        found = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", str(error), re.DOTALL)
        where, what = (f"line {found[2]}, column {found[3]}", found[1]) if found else ("", str(error))
        raise ValueError(
            f"{path}: {where + ': ' if where else ''}not valid TOML ({what}); fix the syntax there "
            '(each setting is key = value, text in "double quotes", sections as [train])'
        ) from None
    return parse_run_config(data, str(path), path.resolve().parent)


def parse_run_config(data: dict, source: str, folder: Path) -> RunConfig:
    """A RunConfig from parsed TOML `data`; `source` names the file in messages, `folder` is
    where a relative base_directory starts."""
    problems: list[str] = []
    for name, value in data.items():
        if name in SECTIONS and isinstance(value, dict):
            continue
        if name in SECTIONS:
            problems.append(f"[{name}]: must be a section ([{name}] on a line of its own, keys below it)")
        elif not isinstance(value, dict):
            home = next((s for s in SECTIONS if name in section_keys(s)), None)
            fix = (
                f"put it under [{home}]" if home else f"keys go under {', '.join(f'[{s}]' for s in SECTIONS)}"
            )
            problems.append(f"{name}: a key outside any section; {fix}")
        else:
            problems.append(f"[{name}]: unknown section{_did_you_mean(name, list(SECTIONS), '[{}]')}")
    built = {}
    for section, classes in SECTIONS.items():
        table = data.get(section, {}) if isinstance(data.get(section, {}), dict) else {}
        for key in table:
            if key not in section_keys(section):
                problems.append(_unknown_key(section, key))
        for cls in classes:
            built[cls] = _build(
                cls, section, {k: v for k, v in table.items() if _has_field(cls, k)}, problems
            )
    if problems:
        listed = (
            problems[0]
            if len(problems) == 1
            else f"{len(problems)} problems:" + "".join(f"\n  {p}" for p in problems)
        )
        raise ValueError(f"{source}: {listed}")
    base = Path(built[ComfyUISection].base_directory).expanduser()
    return RunConfig(
        base_directory=Path(os.path.normpath(base if base.is_absolute() else folder / base)),
        comfyui_flags=built[ComfyUISection].flags,
        model=built[ModelFiles],
        dataset=built[DatasetOptions],
        train=built[TrainConfig],
        trainer=built[TrainerOptions],
    )


def _build(cls: type, section: str, table: dict, problems: list[str]):
    """`cls` from one section's keys, or None with the problems appended."""
    hints, values, before = typing.get_type_hints(cls), {}, len(problems)
    # 1) each value of the field's type; required fields given
    for key, value in table.items():
        converted = _convert(hints[key], value)
        if converted is _WRONG:
            problems.append(_wrong_type(section, _field(cls, key), hints[key], value))
        else:
            values[key] = converted
    for missing in (f for f in fields(cls) if _required(f) and f.name not in table):
        problems.append(
            f"[{section}] {missing.name}: missing; add it, e.g. {missing.name} = "
            f"{toml_value(missing.metadata['example'])}"
        )
    # 2) each value on its own against the defaults: the class's own check finds every bad one
    if not any(_required(f) for f in fields(cls)):
        for key, value in values.items():
            try:
                cls(**{key: value})
            except ValueError as error:
                problems.append(_invalid(section, key, error))
    if len(problems) > before:
        return None
    # 3) all together (combinations), the message put on the key it names first
    try:
        return cls(**values)
    except ValueError as error:
        found = [(m.start(), f.name) for f in fields(cls) if (m := re.search(rf"\b{f.name}\b", str(error)))]
        problems.append(_invalid(section, min(found)[1], error) if found else f"[{section}]: {error}")
        return None


_WRONG = object()


def _convert(hint, value):
    """`value` as a field of type `hint` holds it (an integer is a fine float), else _WRONG."""
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return _WRONG
    if isinstance(hint, type) and issubclass(hint, Choice):  # text; the class checks the choice
        hint = str
    if hint in (int, float, str, bool):
        exact = type(value) is hint or (hint is str and isinstance(value, str))
        return value if exact else _WRONG
    if hint == list[str]:
        return list(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else _WRONG
    raise TypeError(f"no TOML form for {hint}")


KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: 'text in "double quotes"'}


def _wrong_type(section: str, config_field: dataclasses.Field, hint, value) -> str:
    if isinstance(hint, type) and issubclass(hint, Choice):
        hint = str
    name, kind = config_field.name, KINDS.get(hint, "a list of text")
    example = config_field.metadata.get("example", config_field.default)  # the shown fix
    if isinstance(value, str) and hint is not str and "\n" not in value:  # a number in quotes?
        try:
            unquoted = _convert(hint, tomllib.loads(f"v = {value}")["v"])
        except tomllib.TOMLDecodeError:
            unquoted = _WRONG
        if unquoted is not _WRONG:
            return f"[{section}] {name}: expected {kind}, got text; write it without quotes: {name} = {value}"
    return (
        f"[{section}] {name}: expected {kind}, got {_shown(value)}; write it like "
        f"{name} = {toml_value(example)}"
    )


def _shown(value) -> str:
    if isinstance(value, dict):
        return "a table"
    try:
        return toml_value(value)
    except TypeError:  # a date...
        return repr(value)


def _invalid(section: str, key: str, error: ValueError) -> str:
    """The dataclass's own message, on the key: 'steps is 0; ...' -> '[train] steps is 0; ...'."""
    message = str(error)
    if message.startswith(f"{key} ") or message.startswith(f"{key}:"):
        return f"[{section}] {message}"
    return f"[{section}] {key}: {message}"


def _unknown_key(section: str, key: str) -> str:
    home = next((s for s in SECTIONS if s != section and key in section_keys(s)), None)
    if home is not None:
        return f"[{section}] {key}: not a key of [{section}]; move it to [{home}]"
    keys = section_keys(section)
    hint = _did_you_mean(key, keys, "{}") or f"; the keys of [{section}]: {', '.join(keys)}"
    return f"[{section}] {key}: unknown key{hint}"


def _did_you_mean(name: str, known: list[str], form: str) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {form.format(close[0])}?" if close else ""


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in fields(cls) if f.name == name)


def _has_field(cls: type, name: str) -> bool:
    return any(f.name == name for f in fields(cls))


def _required(config_field) -> bool:
    return config_field.default is MISSING and config_field.default_factory is MISSING


# --- writing ---------------------------------------------------------------------------------


def dump_run_config(config: RunConfig, describe: Mapping[str, Mapping[str, object]] | None = None) -> str:
    """TOML text for `config` that `load_run_config` reads back equal; each key has its choices or
    limits as a comment above it, after its description in `describe` (section -> key -> an
    object with `tooltip`, `advanced` and `note`: the application's widget schema), if given."""
    objects = {
        "comfyui": (ComfyUISection(str(config.base_directory), list(config.comfyui_flags)),),
        "model": (config.model,),
        "dataset": (config.dataset,),
        "train": (config.trainer, config.train),
    }
    lines = [
        "# Kontext Trainer run config: the model files, LoadKontextDataset's and TrainLoRA's settings.",
        "# Keys left out take their defaults; (advanced) marks what TrainLoRA hides until Show Advanced.",
    ]
    for section, owners in objects.items():
        lines += ["", f"[{section}]"]
        for owner in owners:
            for config_field in fields(owner):
                lines += _comment(config_field, (describe or {}).get(section, {}).get(config_field.name))
                lines.append(f"{config_field.name} = {toml_value(getattr(owner, config_field.name))}")
    return "\n".join(lines) + "\n"


def _comment(config_field: dataclasses.Field, description) -> list[str]:
    meta, text = config_field.metadata, ""
    if description is not None:
        text = ("(advanced) " if description.advanced else "") + description.tooltip
    if "options" in meta:
        text += f" One of: {', '.join(meta['options'])}."
    elif "min" in meta:
        text += f" From {meta['min']} to {meta['max']}."
    if description is not None and description.note:
        text += f" Here: {description.note}"
    text = text.strip()
    return textwrap.wrap(text, width=98, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)


def toml_value(value) -> str:
    """`value` (bool, int, float, str, list of those) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return repr(value)  # always has a '.' or an exponent: reads back as the same float
    if isinstance(value, str):
        return '"' + "".join(_ESCAPES.get(c, _escape_control(c)) for c in value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _escape_control(char: str) -> str:
    return f"\\u{ord(char):04X}" if ord(char) < 0x20 or ord(char) == 0x7F else char
