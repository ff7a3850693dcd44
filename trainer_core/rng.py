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
    def from_tensors(cls, tensors: dict[str, torch.Tensor], rank: int = 0) -> RandomState:
        """The states a checkpoint saved for process `rank` (0: the only one of a
        single-process run)."""
        if rank_key(rank, "cpu") not in tensors:
            raise ValueError(f"the checkpoint holds no random state for process {rank}")
        return cls(tensors["generator"], tensors[rank_key(rank, "cpu")], tensors.get(rank_key(rank, "cuda")))


PER_PROCESS = ("cpu", "cuda")  # the global RNGs each data-parallel process has its own of


def rank_key(rank: int, name: str) -> str:
    """Where a checkpoint keeps process `rank`'s `name` state ("cpu", "cuda"): rank 0 (or a
    single process) under the plain name, the others as `rank<r>.<name>` (the objective's
    generator is the same on every process and saved once)."""
    return name if rank == 0 else f"rank{rank}.{name}"
