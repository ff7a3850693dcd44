"""LoRA dropout whose masks belong to the global sample, not to the batch or the process.

peft's LoRA layer drops inputs with `nn.Dropout`, which draws one mask for the whole batch
from torch's global random state: a row's mask then depends on the rows before it and on the
process that computes it, so `torchrun` with 2 processes x batch 1 drew other masks than one
process with batch 2 (issue 32). Here every row's mask comes from a generator of its own,
seeded from

- the micro-batch: a key from the run's data generator as the micro-batch starts (the same
  on every process: all of them make the global batch's draws), and
- the row's place in the global batch, and the layer.

The key and the first row's place travel in torch's global seed (`seed_rows`), which the
forwards then carry: a gradient-checkpointed block restores the global random state when it
recomputes in backward, so the recompute draws the same masks. The masks are drawn at the
shape the row has in the global batch; data-parallel processes compute their rows padded as
the global batch is (`flow_step`), so a row gets the same mask wherever it is computed.
"""

from __future__ import annotations

import hashlib

import torch

ROW_BITS = 20  # rows of a global batch: far more than any batch (the seed holds key | row)
_MASK64 = (1 << 64) - 1


def micro_batch_key(generator: torch.Generator) -> int:
    """40 bits of the data generator's state (read, nothing drawn: the run's other draws stay)."""
    digest = hashlib.blake2b(generator.get_state().numpy().tobytes(), digest_size=5).digest()
    return int.from_bytes(digest, "little")


def seed_rows(key: int, first_row: int) -> None:
    """The coming forward computes global rows `first_row`, `first_row + 1`, ... of the
    micro-batch `key`: say so in torch's global seed (read by `SampleDropout`)."""
    torch.manual_seed((key << ROW_BITS) | first_row)


def _mix(value: int) -> int:
    """splitmix64's finaliser: nearby seeds (row r, r + 1) give unrelated generators."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) >> 1  # 63 bits: what manual_seed takes everywhere


class SampleDropout(torch.nn.Module):
    """Dropout of probability `p` for LoRA layer number `layer`: row r of an input is zeroed
    (and the rest scaled by 1 / (1 - p), as `nn.Dropout` does) by a mask drawn from
    generator(global seed + r, layer). Off in eval mode."""

    def __init__(self, p: float, layer: int):
        super().__init__()
        self.p, self.layer = float(p), int(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        first = torch.initial_seed()
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)  # what backward keeps: 1 byte
        for row in range(x.shape[0]):
            generator = torch.Generator(device=x.device)
            generator.manual_seed(_mix(_mix(first + row) ^ self.layer))
            draw = torch.empty(x.shape[1:], dtype=torch.float32, device=x.device)
            keep[row] = draw.bernoulli_(1.0 - self.p, generator=generator).bool()
        return (x * (1.0 / (1.0 - self.p))).masked_fill(~keep, 0)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}"


def per_sample_dropout_(layers, p: float) -> None:
    """Put `SampleDropout` in place of peft's dropout in each LoRA layer of `layers` (in model
    order: a layer's number is its place)."""
    if p <= 0:
        return
    for index, layer in enumerate(layers):
        for adapter in list(layer.lora_dropout.keys()):
            layer.lora_dropout[adapter] = SampleDropout(p, index)
