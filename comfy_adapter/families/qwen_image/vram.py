"""Peak-VRAM estimate for LoRA training of Qwen-Image-Edit (the family's `vram_estimate`).

The same terms as FLUX's (`families/flux/vram.py`: resident weights, LoRA state, activations,
overhead) on Qwen-Image's shape: 60 blocks of one kind (two streams, as a FLUX double block), and
its tokens as the encoder node makes them: the target's 2x2 patches at 1/8, each reference at
about 1024 x 1024 px whatever the dataset's size (4096 tokens; the node resizes them itself),
and the text with each reference's vision tokens (the dataset's longest encoded text). The
per-token constants are FLUX's, calibrated on FLUX.1 (a Qwen-Image block has a FLUX double
block's parts); nothing here was measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....trainer_core.optimizers import optimizer_spec
from ....trainer_core.vram import GIB, WEIGHT_BYTES, Estimate
from ..flux.vram import BLOCK_INPUT_BYTES, BLOCK_WORKING_BYTES, OVERHEAD_GIB

REFERENCE_TOKENS = (1024 // 16) ** 2  # the encoder node's ~1 MP reference, 2x2 patches at 1/8


@dataclass(frozen=True)
class QwenShape:
    hidden: int = 3072
    blocks: int = 60
    patch_channels: int = 64  # 16 latent channels x 2 x 2
    context_dim: int = 3584  # Qwen2.5-VL 7B

    @classmethod
    def of(cls, diffusion_model) -> QwenShape:
        """From ComfyUI's `QwenImageTransformer2DModel`."""
        return cls(
            hidden=diffusion_model.inner_dim,
            blocks=len(diffusion_model.transformer_blocks),
            patch_channels=diffusion_model.in_channels,
            context_dim=diffusion_model.txt_in.in_features,
        )

    def block_linears(self) -> list[tuple[int, int]]:
        """(in, out) of every Linear in a block: both streams' attention, MLP and modulation."""
        h = self.hidden
        attention = [(h, h)] * 8
        return attention + [(h, 4 * h), (4 * h, h)] * 2 + [(h, 6 * h)] * 2

    def block_weights(self) -> int:
        return sum(i * o + o for i, o in self.block_linears())

    def other_weights(self) -> int:
        h = self.hidden
        pairs = [(self.patch_channels, h), (self.context_dim, h), (256, h), (h, h), (h, 2 * h), (h, 16 * 4)]
        return sum(i * o + o for i, o in pairs)


def estimate_vram(
    shape: QwenShape,
    resolution: int,
    references: int,
    text_tokens: int,
    batch: int = 1,
    rank: int = 16,
    weight_format: str = "bf16",
    blocks_to_swap: int = 0,
    gradient_checkpointing: bool = True,
    optimizer: str = "adamw",
) -> Estimate:
    per_weight = WEIGHT_BYTES[weight_format]
    swapped = min(blocks_to_swap, shape.blocks)
    resident = (shape.blocks - swapped + (2 if swapped else 0)) * shape.block_weights()
    weights = (resident + shape.other_weights()) * per_weight
    lora = (
        (8.0 + optimizer_spec(optimizer).state_bytes(rank))
        * rank
        * shape.blocks
        * sum(i + o for i, o in shape.block_linears())
    )
    tokens = batch * ((resolution // 16) ** 2 + references * REFERENCE_TOKENS + text_tokens)
    per_block = tokens * shape.hidden
    if gradient_checkpointing:
        activations = shape.blocks * per_block * BLOCK_INPUT_BYTES + per_block * BLOCK_WORKING_BYTES
    else:
        activations = shape.blocks * per_block * BLOCK_WORKING_BYTES
    loading = 0.0
    if swapped:  # the whole model as loaded, before the swap moves blocks off
        loading = (shape.blocks * shape.block_weights() + shape.other_weights()) * per_weight / GIB
        loading += OVERHEAD_GIB
    return Estimate(weights / GIB, lora / GIB, activations / GIB, OVERHEAD_GIB, loading)
