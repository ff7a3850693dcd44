"""Peak-VRAM estimate for LoRA training of a Flux model (the family's `vram_estimate`), and the
smallest block swap that fits a budget.

peak = resident transformer weights (all blocks minus the swapped ones, plus two swap slots
       in flight) + LoRA state (fp32 weight, gradient, the optimizer's state: `optimizers`)
       + activations (with gradient checkpointing: every block's input, plus one block's
       working set during recompute; without: every block's working set)
       + a fixed overhead (CUDA context, allocator slack, the model's small layers' buffers).

Block swap moves single blocks first, then double blocks (a single block is about 0.42 of a
double block). The two per-token constants and the overhead are calibrated on the published
fp8 ladder for FLUX.1 LoRA training at 1024 px (sd-scripts: 24 GB batch 2 with no swap;
12 GB with 16, 10 GB with 22, 8 GB with 28 of its swap units, where one unit is one double
block or two single blocks). They are fitted, not measured here: `tests/trainer_core/test_vram.py`
checks the estimate against the same ladder it was fitted to, so it guards against drift, not
error. What this code does measure is `tests/comfy_adapter/test_vram_measured.py`: the peak host memory
of a real CPU training step of the tiny Flux (torch SDPA attention, float32) grows with the
tokens as the activation term says (ratios within 1.2x), checkpointing saves what it says
(within 1.5x), and the bytes per token and channel are within 2x of BLOCK_WORKING_BYTES (x2 for
float32). None of this was measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....trainer_core.optimizers import optimizer_spec
from ....trainer_core.vram import GIB, WEIGHT_BYTES, Estimate

# BLOCK_INPUT_BYTES and OVERHEAD_GIB are fitted to the published ladder above.
BLOCK_INPUT_BYTES = 2.0  # a checkpointed block keeps its bf16 input: bytes per token per channel
# One block's forward+backward working set, per token per channel: measured on an H100 (full
# FLUX.1, bf16, no checkpointing, 512 px: 43.5 GiB peak, bench/vram_peaks.json) it is 44.4;
# fitted to the sd-scripts ladder it was 28, which left the estimate 16% under that peak.
BLOCK_WORKING_BYTES = 45.0
OVERHEAD_GIB = 1.6  # CUDA context, allocator slack, small layers, the optimizer step's temporaries
T5_TOKENS = 512


@dataclass(frozen=True)
class FluxShape:
    hidden: int = 3072
    mlp_ratio: float = 4.0
    double_blocks: int = 19
    single_blocks: int = 38
    patch_channels: int = 64  # 16 latent channels x 2 x 2 patches
    context_dim: int = 4096  # T5-XXL
    vec_dim: int | None = 768  # CLIP-L pooled (FLUX.2: none)
    # FLUX.2: SiLU-gated MLPs (their first layer twice as wide), no biases, and three model-wide
    # modulation layers instead of one per block
    gated_mlp: bool = False
    biases: bool = True
    global_modulation: bool = False
    guidance: bool = True  # a guidance embedder (FLUX.1, FLUX.2 [dev]; not FLUX.2 [klein])

    @classmethod
    def of(cls, params) -> FluxShape:
        """From ComfyUI's `FluxParams` (`diffusion_model.params`) or anything with its fields."""
        return cls(
            hidden=params.hidden_size,
            mlp_ratio=params.mlp_ratio,
            double_blocks=params.depth,
            single_blocks=params.depth_single_blocks,
            patch_channels=params.in_channels * params.patch_size**2,
            context_dim=params.context_in_dim,
            vec_dim=params.vec_in_dim,
            gated_mlp=getattr(params, "mlp_silu_act", False),
            biases=getattr(params, "ops_bias", True),
            global_modulation=getattr(params, "global_modulation", False),
            guidance=params.guidance_embed,
        )

    @property
    def mlp(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @property
    def mlp_in(self) -> int:
        return 2 * self.mlp if self.gated_mlp else self.mlp

    def double_block_linears(self) -> list[tuple[int, int]]:
        """(in, out) of every Linear in a double block (image and text streams)."""
        h = self.hidden
        modulation = [] if self.global_modulation else [(h, 6 * h)]
        stream = [*modulation, (h, 3 * h), (h, h), (h, self.mlp_in), (self.mlp, h)]
        return stream + stream

    def single_block_linears(self) -> list[tuple[int, int]]:
        h = self.hidden
        modulation = [] if self.global_modulation else [(h, 3 * h)]
        return [(h, 3 * h + self.mlp_in), (h + self.mlp, h), *modulation]

    def _weights(self, pairs) -> int:
        return sum(i * o + (o if self.biases else 0) for i, o in pairs)

    def double_block_modulation(self) -> int:
        """Weights of a double block's two modulation layers (kept as loaded by fp8_scaled)."""
        h = self.hidden
        return 0 if self.global_modulation else 2 * (h * 6 * h + 6 * h)

    def single_block_modulation(self) -> int:
        h = self.hidden
        return 0 if self.global_modulation else h * 3 * h + 3 * h

    def double_block_weights(self) -> int:
        return self._weights(self.double_block_linears())

    def single_block_weights(self) -> int:
        return self._weights(self.single_block_linears())

    def other_weights(self) -> int:
        """Embedders, the model-wide modulation (FLUX.2) and the final layer (never swapped)."""
        h = self.hidden
        pairs = [(self.patch_channels, h), (self.context_dim, h), (256, h), (h, h)]  # img, txt, time
        if self.vec_dim:
            pairs += [(self.vec_dim, h), (h, h)]
        if self.global_modulation:
            pairs += [(h, 6 * h), (h, 6 * h), (h, 3 * h)]
        if self.guidance:
            pairs += [(256, h), (h, h)]
        pairs += [(h, 2 * h), (h, self.patch_channels)]  # the final layer
        return self._weights(pairs)


def swap_split(blocks_to_swap: int, shape: FluxShape) -> tuple[int, int]:
    """(single, double) blocks swapped for `blocks_to_swap`: single blocks first."""
    if blocks_to_swap < 0:
        raise ValueError("blocks_to_swap cannot be negative")
    singles = min(blocks_to_swap, shape.single_blocks)
    doubles = min(blocks_to_swap - singles, shape.double_blocks)
    return singles, doubles


def max_blocks_to_swap(shape: FluxShape) -> int:
    return shape.single_blocks + shape.double_blocks


def image_tokens(resolution: int, references: int) -> int:
    return (resolution // 16) ** 2 * (1 + references)


def estimate_vram(
    shape: FluxShape = FluxShape(),
    resolution: int = 1024,
    references: int = 0,
    batch: int = 1,
    rank: int = 16,
    weight_format: str = "fp8",
    blocks_to_swap: int = 0,
    gradient_checkpointing: bool = True,
    text_tokens: int = T5_TOKENS,
    base_format: str = "bf16",
    optimizer: str = "adamw",
) -> Estimate:
    """`base_format`: how the loader stored the weights fp8_scaled does not convert."""
    if weight_format not in WEIGHT_BYTES or base_format not in WEIGHT_BYTES:
        raise ValueError(
            f"unknown weight format {weight_format!r} / {base_format!r}; "
            f"choose one of {', '.join(WEIGHT_BYTES)}"
        )
    per_weight = WEIGHT_BYTES[weight_format]
    singles, doubles = swap_split(blocks_to_swap, shape)
    resident_blocks = (shape.double_blocks - doubles) * shape.double_block_weights()
    resident_blocks += (shape.single_blocks - singles) * shape.single_block_weights()
    in_flight = 0
    if singles or doubles:  # two swap slots: the block computing and the one being prefetched
        in_flight = 2 * (shape.double_block_weights() if doubles else shape.single_block_weights())
    weights = (resident_blocks + in_flight + shape.other_weights()) * per_weight
    if weight_format == "fp8_scaled":  # modulation and the small layers stay as loaded
        resident_doubles = shape.double_blocks - doubles + (2 if doubles else 0)
        resident_singles = shape.single_blocks - singles + (2 if singles and not doubles else 0)
        kept = resident_doubles * shape.double_block_modulation()
        kept += resident_singles * shape.single_block_modulation() + shape.other_weights()
        weights += kept * (WEIGHT_BYTES[base_format] - per_weight)
    # LoRA on every block linear: fp32 weight + gradient + the optimizer's state per value
    lora_values = rank * (
        shape.double_blocks * sum(i + o for i, o in shape.double_block_linears())
        + shape.single_blocks * sum(i + o for i, o in shape.single_block_linears())
    )
    lora = (8.0 + optimizer_spec(optimizer).state_bytes(rank)) * lora_values
    tokens = batch * (image_tokens(resolution, references) + text_tokens)
    blocks = shape.double_blocks + shape.single_blocks
    per_block = tokens * shape.hidden
    if gradient_checkpointing:
        activations = blocks * per_block * BLOCK_INPUT_BYTES + per_block * BLOCK_WORKING_BYTES
    else:
        activations = blocks * per_block * BLOCK_WORKING_BYTES
    loading = 0.0
    if singles or doubles:  # the whole model as loaded, before the swap moves blocks off
        everything = shape.double_blocks * shape.double_block_weights()
        everything += shape.single_blocks * shape.single_block_weights() + shape.other_weights()
        loading = everything * WEIGHT_BYTES[base_format] / GIB + OVERHEAD_GIB
    return Estimate(weights / GIB, lora / GIB, activations / GIB, OVERHEAD_GIB, loading)


def suggest_blocks_to_swap(budget_gib: float, shape: FluxShape = FluxShape(), **settings) -> int | None:
    """The smallest blocks_to_swap whose estimate fits `budget_gib`; None if nothing does."""
    for blocks in range(max_blocks_to_swap(shape) + 1):
        if estimate_vram(shape, blocks_to_swap=blocks, **settings).total <= budget_gib:
            return blocks
    return None
