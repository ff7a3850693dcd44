"""How every setting is presented: tooltips, which widgets are advanced, and the widgets' order.

The settings themselves (types, defaults, limits, the choices' Enums) are the dataclasses of
`trainer_core` (`TrainConfig`, `TrainerOptions`, `DatasetOptions`, `PreviewOptions`, the run
file's `ModelFiles`); this table says how a user meets them, once, for both front ends:

- the nodes build every widget from it (`nodes/widgets.py`), in this order: a saved workflow
  stores its widget values by position, so the order is the workflows' format, and a widget
  added later goes after the older ones (and is an optional input, so API prompts written
  before it run on its default);
- the run file of the command line carries the same tooltips as comments (`RUN_FILE`).

It sits in the application layer, next to the nodes, because the command line (which must not
import a node) writes the same text. A test checks that each table names every field of its
dataclasses exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comfy_adapter.families import layouts_by_family
from ..trainer_core.dataset_options import CACHE_FOLDER_NAME
from ..trainer_core.run_config import CHECKPOINTS

# `options_from`: choices only ComfyUI knows when the node is listed; the node fills them in
CHECKPOINT_CHOICES = "checkpoints"  # resume_from: the checkpoints of the moment
LORA_CHOICES = "loras"  # start_from_lora: the LoRA files of the moment
INPUT_SUBFOLDERS = "input_subfolders"  # LoadKontextDataset's folder
SAMPLERS, SCHEDULERS = "samplers", "schedulers"  # ComfyUI's KSampler lists


@dataclass(frozen=True)
class Widget:
    name: str  # the dataclass field it shows
    tooltip: str
    advanced: bool = False  # hidden until the node's "Show Advanced"; its value still saves and runs
    optional: bool = False  # added after the node's first release
    options_from: str | None = None
    control_after_generate: bool | None = None  # False: a seed the UI never randomises
    note: str | None = None  # what the run file takes beyond the widget's values


TRAIN_LORA: tuple[Widget, ...] = (
    Widget(
        "lora_name",
        (
            "Saved as models/loras/<name>.safetensors; checkpoints go to "
            "output/kontext_trainer_checkpoints/<name>/."
        ),
    ),
    Widget(
        "resume_from",
        (
            "Continue a checkpoint exactly where it stopped (same rank, targets, seed...); it is "
            "read, never changed: the continued run writes its own checkpoints."
        ),
        note=f"none, a checkpoint as TrainLoRA lists it (<name>/<run>/step_NNNNNN in {CHECKPOINTS}), "
        "or an absolute path to a checkpoint folder.",
        options_from=CHECKPOINT_CHOICES,
    ),
    Widget(
        "steps",
        "Optimizer steps to run. Typical: 1000-3000 for an edit LoRA of 20-50 pairs (about 50-100 "
        "per pair); the examples' 12-24 only show that a run works.",
    ),
    Widget(
        "learning_rate",
        "Peak learning rate. Typical with AdamW: 1e-4 (up to 5e-4 for a short run or a low rank); "
        "lower it if the loss chart jumps or the previews break up.",
    ),
    Widget(
        "schedule",
        (
            "After warmup: keep the rate, or decay it (cosine / linear) to lr_floor x the rate, "
            "reached just after the last step."
        ),
        advanced=True,
    ),
    Widget("warmup_steps", "Steps over which the learning rate rises linearly from ~0.", advanced=True),
    Widget("optimizer", "AdamW, or Adafactor (less optimizer memory).", advanced=True),
    Widget("weight_decay", "Weight decay on the LoRA weights.", advanced=True),
    Widget("batch_size", "Samples per micro-batch, all from one aspect bucket."),
    Widget("gradient_accumulation", "Micro-batches per optimizer step.", advanced=True),
    Widget("max_grad_norm", "Clip the LoRA gradient norm to this; 0 disables clipping.", advanced=True),
    Widget(
        "rank",
        "LoRA rank: the adapter's capacity, and the file's size grows with it. Typical: 16 for one "
        "edit or style, 32-64 for several concepts.",
    ),
    Widget("alpha", "LoRA alpha: updates are scaled by alpha / rank."),
    Widget("dropout", "Dropout on the LoRA input during training.", advanced=True),
    Widget(
        "targets",
        "Layers that get a LoRA. attention: the attention projections only (the smallest file, a "
        "light touch); attention_mlp: attention and the MLPs (the usual choice for an edit); "
        "all_linear: every Linear of the blocks, modulation included (the most capacity). FLUX's "
        "single blocks always adapt their fused attention + MLP layers.",
    ),
    Widget(
        "layout",
        "Reference position-id layout; auto is the model's own (the LoRA records the one it "
        "resolved to); sample with the same one (MultiImageConditioning's "
        f"tooltip says what each one is). {layouts_by_family()} index_timestep_zero needs ComfyUI "
        "0.33+ (references modulated at timestep 0).",
        advanced=True,
    ),
    Widget(
        "timestep_sampler",
        "How noise levels are drawn; flux_shift shifts them by the image's token count "
        "(resolution-dependent), as the model's own scheduler does (FLUX: 256 tokens -> mu 0.5, "
        "4096 -> 1.15, musubi-tuner's flux_shift).",
        advanced=True,
    ),
    Widget("logit_mean", "logit_normal: mean.", advanced=True),
    Widget("logit_std", "logit_normal: standard deviation.", advanced=True),
    Widget("sigmoid_scale", "sigmoid / shift / flux_shift: sigmoid(scale x normal draw).", advanced=True),
    Widget("shift", "shift: the fixed discrete-flow shift.", advanced=True),
    Widget("loss_weighting", "Per-sample loss weight by noise level.", advanced=True),
    Widget(
        "guidance",
        "Guidance-embedding value, for models distilled with one (dev / Kontext dev); peers train "
        "with 1.0; models without a guidance embedding ignore it.",
        advanced=True,
    ),
    Widget("ip_noise_gamma", "Input-perturbation noise strength (0 = off).", advanced=True),
    Widget("caption_dropout", "Probability of training a sample on the empty prompt.", advanced=True),
    Widget(
        "gradient_checkpointing",
        "Recompute block activations in backward: much less memory, about a third slower.",
        advanced=True,
    ),
    Widget(
        "fp8_mode",
        (
            "as_loaded: train on the weights as the loader stored them (UNETLoader weight_dtype "
            "fp8_e4m3fn gives fp8). fp8_scaled: for this run, store the block attention and MLP "
            "weights as e4m3 with a scale per output channel (norms, modulation, embeddings, final "
            "layer stay as loaded). fp8_backward: as_loaded, and the layers of a quantized file (e.g."
            " *_fp8mixed) also run their backward matmuls in fp8 (ComfyUI 0.33+ with fp8 compute: "
            "faster, rounder gradients)."
        ),
    ),
    Widget(
        "blocks_to_swap",
        (
            "Blocks whose weights wait in CPU memory and visit the GPU only while they run (single "
            "blocks first, then double blocks): much less VRAM, some speed. Needs gradient "
            "checkpointing."
        ),
    ),
    Widget(
        "seed",
        "Seeds LoRA init, data order, noise, timesteps and dropout: same seed, same run.",
        advanced=True,
        control_after_generate=False,
    ),
    Widget(
        "save_every",
        (
            "Write a resumable checkpoint every N steps (0: none along the way). One is always "
            "written when a run is cancelled and at its last step, so it can be resumed or continued."
        ),
    ),
    Widget("keep_last", "Checkpoints kept; older ones are deleted (0 keeps all).", advanced=True),
    # added later: after the older widgets (saved workflows keep their values in place) and
    # optional inputs (API prompts written before them run on their defaults)
    Widget(
        "overwrite",
        (
            "If models/loras/<name>.safetensors already exists: off refuses to start (pick another "
            "name), on replaces it once the new LoRA is saved."
        ),
    ),
    Widget(
        "validate_every",
        (
            "Every N steps and at the end, the flow loss of the dataset's held-out samples (hold_out)"
            " at fixed noise levels and noise: its own curve on the chart. 0: only at the end."
        ),
        advanced=True,
        optional=True,
    ),
    Widget(
        "reference_dropout",
        "Probability of training a sample without its reference images (as plain text-to-image).",
        advanced=True,
        optional=True,
    ),
    Widget(
        "lr_floor",
        "cosine / linear: the fraction of the learning rate the decay ends at.",
        advanced=True,
        optional=True,
    ),
    Widget(
        "start_from_lora",
        (
            "Start a new run from this LoRA's weights (ours, kohya, diffusers / ai-toolkit files): "
            "its layers are trained, with its rank and alpha (rank must match). Unlike resume_from, "
            "the optimizer, schedule and data order start fresh."
        ),
        optional=True,
        note="none, a file name in models/loras, or an absolute path.",
        options_from=LORA_CHOICES,
    ),
    Widget(
        "save_precision",
        (
            "The dtype of the LoRA file and of the per-step snapshots: bf16 (half the size of fp32, "
            "as every peer saves), fp16 or fp32. Checkpoints always keep full precision for an exact "
            "resume."
        ),
        advanced=True,
        optional=True,
    ),
)

LOAD_KONTEXT_DATASET: tuple[Widget, ...] = (
    Widget(
        "folder",
        "A folder of ComfyUI's input directory holding the dataset (name.png, name_control.png, "
        "name.txt per sample).",
        options_from=INPUT_SUBFOLDERS,
    ),
    Widget("path", "Or an absolute path to the dataset folder (wins if set)."),
    Widget(
        "resolution",
        (
            "Targets are scaled to about this many pixels squared, aspect kept, sides multiples of "
            "16; each distinct size is a bucket and batches never mix buckets."
        ),
    ),
    Widget(
        "reference_resolution",
        (
            "References are sized exactly as MultiImageConditioning sizes them at inference (same "
            "rule, same number); 0 keeps their size, cropped to multiples of 16."
        ),
    ),
    Widget("min_size", "Images whose shorter side is below this many pixels are reported as problems."),
    Widget("background", "Transparent pixels are composited onto this colour."),
    Widget("hold_out", "Samples kept out of training for validation."),
    Widget("seed", "Chooses the held-out samples.", control_after_generate=False),
    Widget(
        "cache_folder",
        (
            f"Where latents and embeddings are cached; empty = output/{CACHE_FOLDER_NAME}, a name = a "
            "folder of output/. In the graph it must lie in ComfyUI's output or temp folder; a run "
            "file of the command line may name any folder."
        ),
    ),
)

PREVIEW_SAMPLER: tuple[Widget, ...] = (
    Widget("every_n_steps", "Sample every N training steps."),
    Widget("steps", "Sampling steps per preview."),
    Widget("cfg", "1 for guidance-distilled models; above 1 runs true CFG with `negative`."),
    Widget(
        "guidance",
        "Guidance-embedding value, for models distilled with one (dev / Kontext); models without a "
        "guidance embedding ignore it.",
    ),
    Widget("width", "Preview width in pixels."),
    Widget("height", "Preview height in pixels."),
    Widget(
        "seed",
        "Same seed every time, so previews show how the LoRA changes.",
        control_after_generate=False,
    ),
    Widget("sampler_name", "ComfyUI's sampler.", options_from=SAMPLERS),
    Widget("scheduler", "ComfyUI's scheduler.", options_from=SCHEDULERS),
)

# The run file's own sections (no node shows them)
MODEL_FILES: tuple[Widget, ...] = (
    Widget(
        "diffusion_model",
        "The diffusion model (UNETLoader): a file name in models/diffusion_models, or an absolute path.",
    ),
    Widget("weight_dtype", "UNETLoader's weight_dtype (fp8_e4m3fn: fp8 weights, half the memory)."),
    Widget("vae", "The VAE (VAELoader): a file name in models/vae, or an absolute path."),
    Widget(
        "text_encoders",
        "The text encoders: one file (CLIPLoader) or two, clip_l and t5xxl (DualCLIPLoader); file "
        "names in models/text_encoders, or absolute paths.",
    ),
    Widget(
        "clip_type",
        "The loader's type: flux for two encoders (DualCLIPLoader), or CLIPLoader's type (e.g. flux2).",
    ),
    Widget("clip_device", "Where the text encoders run."),
)
COMFYUI: tuple[Widget, ...] = (
    Widget(
        "base_directory",
        "A ComfyUI base directory (models/, input/, output/, temp/ under it); a relative one is "
        "relative to this file's folder.",
    ),
    Widget(
        "flags",
        "ComfyUI's own command-line flags, as you start ComfyUI with them (python main.py --help "
        'lists them), e.g. ["--reserve-vram", "2", "--extra-model-paths-config", "/path/paths.yaml"]; '
        "flags after -- on the command line come after these.",
    ),
)

# section of the run file -> its keys' presentation
RUN_FILE: dict[str, dict[str, Widget]] = {
    "comfyui": {w.name: w for w in COMFYUI},
    "model": {w.name: w for w in MODEL_FILES},
    "dataset": {w.name: w for w in LOAD_KONTEXT_DATASET},
    "train": {w.name: w for w in TRAIN_LORA},
}
