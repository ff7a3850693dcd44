"""The one training configuration. Each field carries the tooltip and limits of its TrainLoRA
widget (`dataclasses.fields(TrainConfig)[i].metadata`): the node is built from this class."""

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
from .objective import SigmaSampler

# `knob(appended=...)`: when the widget was added. The frontend stores widget values by
# position, so a widget added later goes after every older one and workflows saved before keep
# their values in place.
ORIGINAL = 0  # the first release's widgets (up to `overwrite`)
AFTER_OVERWRITE = 1  # added after `overwrite` (before the node's `start_from_lora`)
AFTER_START_FROM = 2  # added after `start_from_lora`


def knob(
    default,
    tooltip: str,
    advanced: bool = False,
    appended: int = ORIGINAL,
    choices: type[Choice] | None = None,
    must_match: bool = False,
    **limits,
):
    """A config field with the tooltip and limits its TrainLoRA widget shows. `advanced`:
    hidden until the node's "Show Advanced" (right-click menu) is on. `appended`: when the
    widget was added (`ORIGINAL`, `AFTER_OVERWRITE`, `AFTER_START_FROM`); later ones are
    optional inputs, so API prompts written before them still run on their defaults.
    `choices`: the field's Enum (`choices.py`); its members are the widget's options, and
    `check_choices` turns the value given into a member. `must_match`: a resume must have the
    value of the checkpoint it continues (`resume.RESUME_MUST_MATCH`): the field shapes the
    LoRA or its ids, or decides which random numbers each step draws."""
    if choices is not None:
        limits = {**limits, "choices": choices, "options": tuple(member.value for member in choices)}
    return field(
        default=default,
        metadata={
            "tooltip": tooltip,
            "advanced": advanced,
            "appended": appended,
            "must_match": must_match,
            **limits,
        },
    )


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
    steps: int = knob(1000, "Optimizer steps to run.", min=1, max=1_000_000)
    learning_rate: float = knob(1e-4, "Peak learning rate.", min=1e-7, max=1.0, step=1e-6)
    schedule: Schedule = knob(
        Schedule.CONSTANT,
        "After warmup: keep the rate, or decay it (cosine / linear) to lr_floor x the rate, reached just "
        "after the last step.",
        choices=Schedule,
        advanced=True,
    )
    warmup_steps: int = knob(
        0, "Steps over which the learning rate rises linearly from ~0.", min=0, max=100_000, advanced=True
    )
    optimizer: Optimizer = knob(
        Optimizer.ADAMW,
        "AdamW, or Adafactor (less optimizer memory).",
        choices=Optimizer,
        advanced=True,
        must_match=True,
    )
    weight_decay: float = knob(
        0.01, "Weight decay on the LoRA weights.", min=0.0, max=1.0, step=0.001, advanced=True
    )
    batch_size: int = knob(
        1, "Samples per micro-batch, all from one aspect bucket.", min=1, max=64, must_match=True
    )
    gradient_accumulation: int = knob(
        1, "Micro-batches per optimizer step.", min=1, max=256, advanced=True, must_match=True
    )
    max_grad_norm: float = knob(
        1.0,
        "Clip the LoRA gradient norm to this; 0 disables clipping.",
        min=0.0,
        max=100.0,
        step=0.1,
        advanced=True,
    )
    rank: int = knob(16, "LoRA rank: the adapter's capacity.", min=1, max=256, must_match=True)
    alpha: float = knob(
        16.0,
        "LoRA alpha: updates are scaled by alpha / rank.",
        min=0.01,
        max=1024.0,
        step=0.5,
        must_match=True,
    )
    dropout: float = knob(
        0.0,
        "Dropout on the LoRA input during training.",
        min=0.0,
        max=0.9,
        step=0.01,
        advanced=True,
        must_match=True,
    )
    targets: TargetPreset = knob(
        TargetPreset.ATTENTION_MLP,
        "Layers that get a LoRA (single blocks always adapt their fused attention + MLP layers).",
        choices=TargetPreset,
        must_match=True,
    )
    layout: Layout = knob(
        Layout.OFFSET,
        "Reference position-id layout; sample with the same one. FLUX.2: index (its own), offset, "
        "uxo, or index_timestep_zero (ComfyUI 0.33+: references modulated at timestep 0).",
        choices=Layout,
        must_match=True,
    )
    timestep_sampler: TimestepSampler = knob(
        TimestepSampler.FLUX_SHIFT,
        "How noise levels are drawn; flux_shift follows FLUX.1's resolution-dependent schedule.",
        choices=TimestepSampler,
        advanced=True,
        must_match=True,
    )
    logit_mean: float = knob(0.0, "logit_normal: mean.", min=-5.0, max=5.0, step=0.05, advanced=True)
    logit_std: float = knob(
        1.0, "logit_normal: standard deviation.", min=0.01, max=5.0, step=0.05, advanced=True
    )
    sigmoid_scale: float = knob(
        1.0,
        "sigmoid / shift / flux_shift: sigmoid(scale x normal draw).",
        min=0.01,
        max=10.0,
        step=0.05,
        advanced=True,
    )
    shift: float = knob(
        3.0, "shift: the fixed discrete-flow shift.", min=0.01, max=100.0, step=0.1, advanced=True
    )
    loss_weighting: LossWeighting = knob(
        LossWeighting.NONE, "Per-sample loss weight by noise level.", choices=LossWeighting, advanced=True
    )
    guidance: float = knob(
        1.0,
        "Guidance-embedding value for guidance-distilled models (FLUX.1 dev / "
        "Kontext dev); peers train with 1.0.",
        min=0.0,
        max=100.0,
        step=0.1,
        advanced=True,
    )
    ip_noise_gamma: float = knob(
        0.0,
        "Input-perturbation noise strength (0 = off).",
        min=0.0,
        max=1.0,
        step=0.01,
        advanced=True,
        must_match=True,
    )
    caption_dropout: float = knob(
        0.0,
        "Probability of training a sample on the empty prompt.",
        min=0.0,
        max=1.0,
        step=0.01,
        advanced=True,
        must_match=True,
    )
    gradient_checkpointing: bool = knob(
        True,
        "Recompute block activations in backward: much less memory, about a third slower.",
        advanced=True,
    )
    fp8_mode: Fp8Mode = knob(
        Fp8Mode.AS_LOADED,
        "as_loaded: train on the weights as the loader stored them (UNETLoader weight_dtype fp8_e4m3fn "
        "gives fp8). fp8_scaled: for this run, store the block attention and MLP weights as e4m3 with a "
        "scale per output channel (norms, modulation, embeddings, final layer stay as loaded). "
        "fp8_backward: as_loaded, and the layers of a quantized file (e.g. *_fp8mixed) also run their "
        "backward matmuls in fp8 (ComfyUI 0.33+ with fp8 compute: faster, rounder gradients).",
        choices=Fp8Mode,
    )
    blocks_to_swap: int = knob(
        0,
        "Blocks whose weights wait in CPU memory and visit the GPU only while they run (single "
        "blocks first, then double blocks): much less VRAM, some speed. Needs gradient checkpointing.",
        min=0,
        max=200,
    )
    seed: int = knob(
        0,
        "Seeds LoRA init, data order, noise, timesteps and dropout: same seed, same run.",
        min=0,
        max=2**31 - 1,
        control_after_generate=False,  # never randomised by the UI: runs must be repeatable,
        must_match=True,
    )
    save_every: int = knob(
        0,
        "Write a resumable checkpoint every N steps (0: none along the way). One is always written "
        "when a run is cancelled and at its last step, so it can be resumed or continued.",
        min=0,
        max=1_000_000,
    )
    keep_last: int = knob(
        3, "Checkpoints kept; older ones are deleted (0 keeps all).", min=0, max=1000, advanced=True
    )
    # Added after `overwrite`: their widgets come after it (see `knob`'s `appended`).
    validate_every: int = knob(
        100,
        "Every N steps and at the end, the flow loss of the dataset's held-out samples (hold_out) at "
        "fixed noise levels and noise: its own curve on the chart. 0: only at the end.",
        min=0,
        max=1_000_000,
        appended=AFTER_OVERWRITE,
    )
    reference_dropout: float = knob(
        0.0,
        "Probability of training a sample without its reference images (as plain text-to-image).",
        min=0.0,
        max=1.0,
        step=0.01,
        advanced=True,
        appended=AFTER_OVERWRITE,
        must_match=True,
    )
    lr_floor: float = knob(
        0.0,
        "cosine / linear: the fraction of the learning rate the decay ends at.",
        min=0.0,
        max=1.0,
        step=0.01,
        advanced=True,
        appended=AFTER_OVERWRITE,
    )
    save_precision: SavePrecision = knob(
        SavePrecision.BF16,
        "The dtype of the LoRA file and of the per-step snapshots: bf16 (half the size of fp32, as "
        "every peer saves), fp16 or fp32. Checkpoints always keep full precision for an exact resume.",
        choices=SavePrecision,
        advanced=True,
        appended=AFTER_START_FROM,
    )

    def __post_init__(self):
        # 1) every number finite and within its widget's limits (NaN passes ComfyUI's min/max)
        for config_field in fields(self):
            limits = config_field.metadata
            if "min" in limits or "max" in limits:
                value = getattr(self, config_field.name)
                check_number(config_field.name, value, limits.get("min"), limits.get("max"))
        # 2) choices, then combinations
        check_choices(self)
        if self.blocks_to_swap and not self.gradient_checkpointing:
            raise ValueError(
                "blocks_to_swap needs gradient_checkpointing on (otherwise every block's weights "
                "stay referenced until backward and nothing would be saved)"
            )
        self.sigma_sampler()

    def sigma_sampler(self) -> SigmaSampler:
        return SigmaSampler(
            self.timestep_sampler, self.logit_mean, self.logit_std, self.sigmoid_scale, self.shift
        )
