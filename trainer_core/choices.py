"""Every setting a user picks by name, as a string-valued Enum, and the job's status.

A member is equal to its string, hashes as it and prints as it (`Choice`): configs,
checkpoints, saved workflows and LoRA metadata store the plain strings, so what was written
before these Enums existed reads back unchanged (`tests/nodes/test_old_checkpoint.py`).
`choose` turns a stored string into a member, or a ValueError that names the field and the
choices; a config field whose type is one of these Enums is checked by it, with no hand-written
"choose one of" anywhere else.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar


class Choice(str, Enum):
    """A string-valued Enum whose members print as their strings (3.11's StrEnum, also on the
    Python 3.10 ComfyUI still runs on), in messages' `!r` too: a message shows what the user
    wrote, 'dreamomni2', never the Enum's name."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Optimizer(Choice):
    ADAMW = "adamw"
    ADAFACTOR = "adafactor"


class Schedule(Choice):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


class TimestepSampler(Choice):
    UNIFORM = "uniform"
    LOGIT_NORMAL = "logit_normal"
    SIGMOID = "sigmoid"
    SHIFT = "shift"
    TOKEN_SHIFT = "flux_shift"  # the stored name (saved workflows and checkpoints hold it)


class LossWeighting(Choice):
    NONE = "none"
    SIGMA_SQRT = "sigma_sqrt"
    COSMAP = "cosmap"


class TargetPreset(Choice):
    ATTENTION = "attention"
    ATTENTION_MLP = "attention_mlp"
    ALL_LINEAR = "all_linear"


class Layout(Choice):
    """Reference layouts: where a model's references sit in its position grid (each family says
    which fit it: FLUX's ids are `families/flux/position_ids`); `auto` is the model's own (the
    one ComfyUI samples it with by default: FLUX.1 `offset`, FLUX.2 `index`), resolved where the
    model is known (`ModelFamily.resolve_layout`)."""

    AUTO = "auto"
    OFFSET = "offset"
    INDEX = "index"
    UXO = "uxo"
    DREAMOMNI2 = "dreamomni2"
    INDEX_TIMESTEP_ZERO = "index_timestep_zero"


class Fp8Mode(Choice):
    AS_LOADED = "as_loaded"
    FP8_SCALED = "fp8_scaled"
    FP8_BACKWARD = "fp8_backward"


class SavePrecision(Choice):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class Background(Choice):
    """What fills the letterbox of a reference image fitted to its bucket."""

    WHITE = "white"
    BLACK = "black"
    GRAY = "gray"


class JobStatus(Choice):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLED = "cancelled"
    FINISHED = "finished"
    ERROR = "error"


E = TypeVar("E", bound=Choice)


def choose(kind: type[E], value, field: str) -> E:
    """`value` as a member of `kind`, or a ValueError naming `field` and the choices."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(
            f"unknown {field} {value!r}; choose one of {', '.join(member.value for member in kind)}"
        ) from None


def plain(value):
    """A member as its plain string (what JSON, TOML and file metadata hold); anything else as is."""
    return value.value if isinstance(value, Choice) else value
