"""What a VRAM estimate is, and how weights are counted as stored: the parts every model
family's estimate gives (`Estimate`; a family computes them from its own shape, e.g.
`comfy_adapter/families/flux/vram.py`)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp8_scaled": 1.0 + 1 / 3072}  # per weight


@dataclass(frozen=True)
class Estimate:
    weights: float  # GiB
    lora: float
    activations: float
    overhead: float
    # Block swap: ComfyUI loads the whole model where the GPU has room for it, and the swap then
    # moves blocks off; that moment's peak is every weight as loaded plus the overhead (H100,
    # swap 20 at 512 px: 22.4 GiB measured, the full bf16 weights are 22.2). 0 without swap.
    loading: float = 0.0

    @property
    def total(self) -> float:
        """The training peak, what a GPU must hold (a smaller one loads the model partially)."""
        return self.weights + self.lora + self.activations + self.overhead

    @property
    def peak(self) -> float:
        """The highest the run goes on a GPU with room for the whole model."""
        return max(self.total, self.loading)

    def __str__(self) -> str:
        loading = (
            f"; ~{self.loading:.1f} GiB while loading where the whole model fits"
            if self.loading > self.total
            else ""
        )
        return (
            f"~{self.total:.1f} GiB peak (weights {self.weights:.1f}, LoRA + optimizer {self.lora:.2f}, "
            f"activations {self.activations:.1f}, overhead {self.overhead:.1f}{loading})"
        )


def module_weight_bytes(module) -> int:
    """Bytes of a module's parameters and buffers as they are stored (fp8 counts 1 byte; a
    quantized weight, a tensor subclass holding its packed values in `_qdata`, counts those)."""
    tensors = [getattr(t, "_qdata", t) for t in [*module.parameters(), *module.buffers()]]
    return sum(t.numel() * t.element_size() for t in tensors)
