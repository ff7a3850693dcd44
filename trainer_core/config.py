"""The one training configuration. Field comments are the documentation the TrainLoRA widgets
show as tooltips."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import __version__
from .lora_file import kohya_metadata
from .lora_targets import check_preset
from .objective import WEIGHTINGS, SigmaSampler
from .position_ids import check_layout
from .schedule import SCHEDULES

OPTIMIZERS = ("adamw", "adafactor")


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps to run
    learning_rate: float = 1e-4  # peak learning rate
    schedule: str = "constant"  # after warmup: constant, cosine or linear decay to zero
    warmup_steps: int = 0  # steps over which the learning rate rises linearly from ~0
    optimizer: str = "adamw"  # adamw, or adafactor (less optimizer memory)
    weight_decay: float = 0.01  # weight decay on the LoRA weights
    batch_size: int = 1  # samples per micro-batch, all from one aspect bucket
    gradient_accumulation: int = 1  # micro-batches per optimizer step
    max_grad_norm: float = 1.0  # clip the LoRA gradient norm to this; 0 disables clipping
    rank: int = 16  # LoRA rank: capacity of the adapter
    alpha: float = 16.0  # LoRA alpha: the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the LoRA input during training
    targets: str = "attention_mlp"  # which layers get a LoRA: attention, attention_mlp, all_linear
    layout: str = "offset"  # reference position-id layout; must match the one used at inference
    timestep_sampler: str = "flux_shift"  # uniform, logit_normal, sigmoid, shift, flux_shift
    logit_mean: float = 0.0  # logit_normal: mean
    logit_std: float = 1.0  # logit_normal: standard deviation
    sigmoid_scale: float = 1.0  # sigmoid / shift / flux_shift: sigmoid(scale * normal draw)
    shift: float = 3.0  # shift: fixed discrete-flow shift
    loss_weighting: str = "none"  # none, sigma_sqrt, cosmap
    guidance: float = 1.0  # guidance-embedding value for guidance-distilled models (Flux dev / Kontext)
    ip_noise_gamma: float = 0.0  # input-perturbation noise strength (0 = off)
    caption_dropout: float = 0.0  # probability of training a sample on the empty prompt
    gradient_checkpointing: bool = True  # recompute block activations in backward: less memory, ~30% slower
    seed: int = 0  # seeds LoRA init, data order, noise, timesteps, dropout: the same seed gives the same run
    save_every: int = 0  # write a resumable checkpoint every N steps (0: only when cancelled)
    keep_last: int = 3  # checkpoints kept (older ones are deleted); 0 keeps all

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError("steps must be at least 1")
        if self.rank < 1:
            raise ValueError("rank must be at least 1")
        if self.batch_size < 1 or self.gradient_accumulation < 1:
            raise ValueError("batch_size and gradient_accumulation must be at least 1")
        if self.warmup_steps < 0 or self.save_every < 0 or self.keep_last < 0:
            raise ValueError("warmup_steps, save_every and keep_last cannot be negative")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not 0.0 <= self.dropout < 1.0 or not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError("dropout and caption_dropout are probabilities in [0, 1)")
        if self.loss_weighting not in WEIGHTINGS:
            raise ValueError(
                f"unknown loss weighting {self.loss_weighting!r}; choose one of {', '.join(WEIGHTINGS)}"
            )
        check_preset(self.targets)
        check_layout(self.layout)
        self.sigma_sampler()

    def sigma_sampler(self) -> SigmaSampler:
        return SigmaSampler(
            self.timestep_sampler, self.logit_mean, self.logit_std, self.sigmoid_scale, self.shift
        )

    def file_metadata(
        self, steps: int, resolution: int, base_model: str, dataset_hash: str = ""
    ) -> dict[str, str]:
        """The LoRA file's metadata: kohya's `ss_*` fields plus ours (`kontext_trainer.*`):
        layout, targets, sampler, trainer version, dataset hash and the whole config."""
        sampler = {"kind": self.timestep_sampler, "weighting": self.loss_weighting}
        if self.timestep_sampler == "logit_normal":
            sampler.update(mean=self.logit_mean, std=self.logit_std)
        elif self.timestep_sampler != "uniform":
            sampler["sigmoid_scale"] = self.sigmoid_scale
        if self.timestep_sampler == "shift":
            sampler["shift"] = self.shift
        extra = {
            "layout": self.layout,
            "targets": self.targets,
            "sampler": sampler,
            "trainer_version": __version__,
            "dataset_hash": dataset_hash,
            "config": asdict(self),
        }
        return kohya_metadata(self.rank, self.alpha, base_model, steps, resolution, extra)
