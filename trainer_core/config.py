"""The one training configuration: each field's type, default and limits
(`dataclasses.fields(TrainConfig)[i].metadata`). TrainLoRA's widgets and the run file's [train]
keys are built from these fields; their tooltips, order and advanced flags are
`application/widget_schema.py`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .choices import (
    Choice,
    Fp8Mode,
    Layout,
    LossWeighting,
    Optimizer,
    SavePrecision,
    Schedule,
    TargetPreset,
    TimestepSampler,
    choose,
)
from .limits import check_number
from .objective import TOKEN_SHIFT_POINTS, SigmaSampler, TokenShift


def knob(default, choices: type[Choice] | None = None, must_match: bool = False, **limits):
    """A config field with its default and limits (`min`, `max`, `step`, `options`): what a
    value may be, which every front end enforces (how it is shown is `application/widget_schema`).
    `choices`: the field's Enum (`choices.py`); its members are the allowed values, and
    `check_choices` turns the value given into a member. `must_match`: a resume must have the
    value of the checkpoint it continues (`resume.RESUME_MUST_MATCH`): the field shapes the
    LoRA or its ids, or decides which random numbers each step draws."""
    if choices is not None:
        limits = {**limits, "choices": choices, "options": tuple(member.value for member in choices)}
    return field(default=default, metadata={"must_match": must_match, **limits})


def check_limits(config) -> None:
    """Every number of a dataclass instance finite and within its field's limits (NaN passes
    ComfyUI's min / max check), or a ValueError naming the field."""
    for config_field in fields(config):
        limits = config_field.metadata
        if "min" in limits or "max" in limits:
            value = getattr(config, config_field.name)
            check_number(config_field.name, value, limits.get("min"), limits.get("max"))


def check_choices(config) -> None:
    """Every field made with `knob(choices=...)` of a dataclass instance, as a member of its
    Enum (a stored string becomes its member), or a ValueError naming the field."""
    for config_field in fields(config):
        kind = config_field.metadata.get("choices")
        if kind is not None:
            value = choose(kind, getattr(config, config_field.name), config_field.name)
            object.__setattr__(config, config_field.name, value)


@dataclass
class TrainConfig:
    steps: int = knob(1000, min=1, max=1_000_000)
    learning_rate: float = knob(1e-4, min=1e-7, max=1.0, step=1e-6)
    schedule: Schedule = knob(Schedule.CONSTANT, choices=Schedule)
    warmup_steps: int = knob(0, min=0, max=100_000)
    optimizer: Optimizer = knob(Optimizer.ADAMW, choices=Optimizer, must_match=True)
    weight_decay: float = knob(0.01, min=0.0, max=1.0, step=0.001)
    batch_size: int = knob(1, min=1, max=64, must_match=True)
    gradient_accumulation: int = knob(1, min=1, max=256, must_match=True)
    max_grad_norm: float = knob(1.0, min=0.0, max=100.0, step=0.1)
    rank: int = knob(16, min=1, max=256, must_match=True)
    alpha: float = knob(16.0, min=0.01, max=1024.0, step=0.5, must_match=True)
    dropout: float = knob(0.0, min=0.0, max=0.9, step=0.01, must_match=True)
    targets: TargetPreset = knob(TargetPreset.ATTENTION_MLP, choices=TargetPreset, must_match=True)
    layout: Layout = knob(Layout.AUTO, choices=Layout, must_match=True)  # auto: the model's own
    timestep_sampler: TimestepSampler = knob(
        TimestepSampler.TOKEN_SHIFT, choices=TimestepSampler, must_match=True
    )
    logit_mean: float = knob(0.0, min=-5.0, max=5.0, step=0.05)
    logit_std: float = knob(1.0, min=0.01, max=5.0, step=0.05)
    sigmoid_scale: float = knob(1.0, min=0.01, max=10.0, step=0.05)
    shift: float = knob(3.0, min=0.01, max=100.0, step=0.1)
    loss_weighting: LossWeighting = knob(LossWeighting.NONE, choices=LossWeighting)
    guidance: float = knob(1.0, min=0.0, max=100.0, step=0.1)
    ip_noise_gamma: float = knob(0.0, min=0.0, max=1.0, step=0.01, must_match=True)
    caption_dropout: float = knob(0.0, min=0.0, max=1.0, step=0.01, must_match=True)
    gradient_checkpointing: bool = knob(True)
    fp8_mode: Fp8Mode = knob(Fp8Mode.AS_LOADED, choices=Fp8Mode)
    blocks_to_swap: int = knob(0, min=0, max=200)
    seed: int = knob(0, min=0, max=2**31 - 1, must_match=True)
    save_every: int = knob(100, min=0, max=1_000_000)
    keep_last: int = knob(3, min=0, max=1000)
    # Added later (their widgets come after the older ones: application/widget_schema.py)
    validate_every: int = knob(100, min=0, max=1_000_000)
    reference_dropout: float = knob(0.0, min=0.0, max=1.0, step=0.01, must_match=True)
    lr_floor: float = knob(0.0, min=0.0, max=1.0, step=0.01)
    save_precision: SavePrecision = knob(SavePrecision.BF16, choices=SavePrecision)

    def __post_init__(self):
        # 1) every number finite and within its limits, 2) choices, then combinations
        check_limits(self)
        check_choices(self)
        if self.blocks_to_swap and not self.gradient_checkpointing:
            raise ValueError(
                "blocks_to_swap needs gradient_checkpointing on (otherwise every block's weights "
                "stay referenced until backward and nothing would be saved)"
            )
        self.sigma_sampler()

    def sigma_sampler(self, token_shift: TokenShift = TOKEN_SHIFT_POINTS) -> SigmaSampler:
        """The timestep sampler; `token_shift`: the model family's points for flux_shift."""
        settings = (self.timestep_sampler, self.logit_mean, self.logit_std, self.sigmoid_scale, self.shift)
        return SigmaSampler(*settings, token_shift)
