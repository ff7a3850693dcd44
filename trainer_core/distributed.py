"""Data parallelism on PyTorch's own engine (`torch.distributed`: NCCL between GPUs, gloo on
CPU), for processes launched by `torchrun` (which sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous).

How a step is shared (see `loop.train` and `flow_step.flow_matching_loss`):
- every rank walks the same global data order, whose batches hold `world_size x batch_size`
  samples of one bucket; rank r trains rows [r*b, (r+1)*b) of each (`Collective.rows`), so
  every sample is seen once per epoch across the ranks and all ranks share a bucket per step;
- every rank draws the random numbers of the whole global batch from the one generator (same
  seed, same state everywhere) and keeps its rows' draws, so a sample gets the noise, noise
  level and dropout draws it would get in one process training the global batch;
- each rank's loss is its rows' share of the global batch mean (sum over its rows / global
  rows), and after backward the LoRA gradients are summed across ranks (`sum_gradients`): the
  gradient of the global batch mean, even when the last batch of a bucket leaves a rank fewer
  rows or none. Every rank then takes the same optimizer step on the same weights.

Why an explicit bucketed all-reduce and not `DistributedDataParallel`: DDP averages by the
number of ranks (wrong for a bucket's short last batch), needs the forward to go through its
wrapper (ours is ComfyUI's own Flux call with its wrappers and patches) and every rank to run
a backward every step (a rank with no rows this step has none). The all-reduce runs once per
optimizer step, after the gradient-accumulation micro-batches, in buckets of at most
`bucket_bytes`; it is not overlapped with backward (LoRA gradients are small next to the
model's compute; overlapping is left for later).

A rank that dies or loses its connection makes the next collective on every other rank fail
(gloo: at once, the socket closes; NCCL: at the process group's timeout): they raise
`PeerLost`, which names what happened, instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_SECONDS = 600
# how many processes, which one, which GPU of its machine (set by torchrun)
WORLD_ENV, RANK_ENV, LOCAL_RANK_ENV = "WORLD_SIZE", "RANK", "LOCAL_RANK"


class PeerLost(RuntimeError):
    """A collective with the other ranks failed: one of them stopped or lost its connection."""


def launched_world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    try:
        return max(int(os.environ.get(WORLD_ENV, "1")), 1)
    except ValueError:
        raise ValueError(f"{WORLD_ENV}={os.environ.get(WORLD_ENV)!r} is not a number of processes") from None


def local_rank() -> int:
    return int(os.environ.get(LOCAL_RANK_ENV, "0"))


@dataclass
class Collective:
    rank: int
    world_size: int
    device: torch.device  # where the collectives' tensors travel from (NCCL: this rank's GPU)
    bucket_bytes: int = 25 * 2**20

    @contextlib.contextmanager
    def _guard(self, what: str):
        try:
            yield
        except (RuntimeError, dist.DistError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise PeerLost(
                f"rank {self.rank} of {self.world_size}: {what} with the other ranks failed ({first}). "
                "Another rank has stopped or lost its connection, so this one stops too; the newest "
                "checkpoint (written by rank 0) resumes the run with the same number of processes."
            ) from error

    def rows(self, batch: int, per_rank: int) -> slice:
        """This rank's rows of a global batch of `batch` samples (possibly none at a bucket's
        short last batch)."""
        return slice(min(self.rank * per_rank, batch), min((self.rank + 1) * per_rank, batch))

    def sum_gradients(self, parameters: Sequence[torch.nn.Parameter], loss: float) -> float:
        """Sum every parameter's gradient and the step's loss over all ranks, in place; a
        parameter without a gradient on this rank (no rows this step) contributes zeros."""
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        with self._guard("summing the gradients"):
            for bucket in _buckets(parameters, self.bucket_bytes):
                flat = torch.cat([p.grad.reshape(-1) for p in bucket]).to(self.device)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                offset = 0
                for parameter in bucket:
                    count = parameter.grad.numel()
                    parameter.grad.copy_(flat[offset : offset + count].view_as(parameter.grad))
                    offset += count
            total = torch.tensor([loss], dtype=torch.float64, device=self.device)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total.item())

    def any(self, flag: bool, what: str = "agreeing whether to stop") -> bool:
        """True on every rank when `flag` is true on any of them."""
        with self._guard(what):
            value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def broadcast_(self, tensors: Iterable[torch.Tensor]) -> None:
        """Give every rank rank 0's values of `tensors` (in place)."""
        with self._guard("sharing the initial LoRA weights"), torch.no_grad():
            for tensor in tensors:
                moved = tensor.detach().to(self.device)
                dist.broadcast(moved, src=0)
                tensor.copy_(moved)

    def gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on all), on every rank, on the CPU."""
        with self._guard(what):
            local = tensor.to(self.device)
            pieces = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(pieces, local)
        return [piece.cpu() for piece in pieces]

    def barrier(self, what: str) -> None:
        with self._guard(what):
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def _buckets(parameters: Sequence[torch.nn.Parameter], limit: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device, at most `limit` bytes each (a larger
    parameter gets a bucket of its own)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size, key = 0, None
    for parameter in parameters:
        nbytes = parameter.numel() * parameter.element_size()
        this_key = (parameter.dtype, parameter.device)
        if not buckets or this_key != key or size + nbytes > limit:
            buckets.append([])
            size, key = 0, this_key
        buckets[-1].append(parameter)
        size += nbytes
    return buckets


def rank_of(collective: Collective | None) -> int:
    return collective.rank if collective is not None else 0


def world_size_of(collective: Collective | None) -> int:
    return collective.world_size if collective is not None else 1


def start(use_cuda: bool, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> Collective | None:
    """Join torchrun's process group (None when launched without torchrun or with one
    process): NCCL when this rank trains on a GPU, gloo otherwise."""
    world = launched_world_size()
    if world <= 1:
        return None
    if use_cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if use_cuda else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_seconds), **kwargs)
    return Collective(dist.get_rank(), dist.get_world_size(), device)


def stop(collective: Collective | None) -> None:
    if collective is not None and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
