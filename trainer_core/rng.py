"""Every random state a training step consumes, captured and restored in one place: the
objective's generator (noise, timesteps, dropout draws of the data) and torch's global RNGs
(CPU, and the current CUDA device's when there is one: LoRA dropout draws from them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RandomState:
    generator: torch.Tensor
    cpu: torch.Tensor
    cuda: torch.Tensor | None = None

    @classmethod
    def capture(cls, generator: torch.Generator) -> RandomState:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return cls(generator.get_state(), torch.get_rng_state(), cuda)

    def restore(self, generator: torch.Generator | None = None) -> None:
        """Put every state back (`generator`: the objective's; None leaves it alone). A CUDA
        state saved on a machine with a GPU is skipped where there is none."""
        if generator is not None:
            generator.set_state(self.generator)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.cuda)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """As a checkpoint's `rng.safetensors` holds it."""
        tensors = {"generator": self.generator, "cpu": self.cpu}
        if self.cuda is not None:
            tensors["cuda"] = self.cuda
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> RandomState:
        return cls(tensors["generator"], tensors["cpu"], tensors.get("cuda"))
