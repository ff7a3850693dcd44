"""A small data-parallel training problem for `tests/trainer_core/test_data_parallel.py`: the
real loop (`loop.train`), objective (`flow_step.flow_matching_loss`) and collective
(`distributed.Collective`) around a toy velocity model, run by N gloo processes or by one.

The samples come in two target sizes (two buckets, 5 and 3 samples: short last batches, so
some processes get fewer rows or none) with references of two sizes (padded batches), and the
config turns on every per-sample draw (caption and reference dropout, input perturbation).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from trainer_core.config import TrainConfig
from trainer_core.distributed import Collective
from trainer_core.flow_step import EmptyText, Sample, flow_matching_loss
from trainer_core.loop import DataOrder, train
from trainer_core.token_batch import TokenBatch, build_token_batch

CHANNELS, PATCH, TEXT_DIM, TEXT_TOKENS = 4, 2, 8, 3
TOKEN_DIM = CHANNELS * PATCH * PATCH


def toy_config(batch_size: int, **changes) -> TrainConfig:
    settings = {
        "steps": 5,
        "learning_rate": 0.02,
        "batch_size": batch_size,
        "gradient_accumulation": 2,
        "caption_dropout": 0.3,
        "reference_dropout": 0.3,
        "ip_noise_gamma": 0.1,
        "timestep_sampler": "flux_shift",
        "loss_weighting": "cosmap",
        "seed": 7,
        **changes,
    }
    return TrainConfig(**settings)


def toy_samples() -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for index in range(8):
        height, width = (4, 8) if index < 5 else (8, 4)
        reference_side = 4 if index % 2 else 8
        samples.append(
            Sample(
                torch.randn(CHANNELS, height, width, generator=generator),
                torch.randn(TEXT_TOKENS, TEXT_DIM, generator=generator),
                torch.randn(TEXT_DIM, generator=generator),
                [torch.randn(CHANNELS, reference_side, reference_side, generator=generator)],
            )
        )
    return samples


@dataclass
class ToyTokens(TokenBatch):
    """A family's own token batch: each token's (image, row, column), which `rows` must cut
    with the tokens."""

    ids: torch.Tensor = field(kw_only=True)  # (B, L, 3)


def toy_pack(targets, references) -> ToyTokens:
    batch = build_token_batch(targets, references, PATCH)
    ids = torch.zeros(*batch.valid.shape, 3)
    for i, shapes in enumerate(batch.shapes):
        start = 0
        for image, (_, height, width) in enumerate(shapes):
            rows, cols = torch.meshgrid(
                torch.arange(height // PATCH), torch.arange(width // PATCH), indexing="ij"
            )
            grid = torch.stack([torch.full_like(rows, image), rows, cols], dim=-1).reshape(-1, 3)
            ids[i, start : start + len(grid)] = grid.float()
            start += len(grid)
    return ToyTokens(**{f: getattr(batch, f) for f in batch.__dataclass_fields__}, ids=ids)


class ToyVelocity(torch.nn.Module):
    """Velocity from the tokens, the noise level, the caption and the position ids."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.nn.Parameter(torch.randn(TOKEN_DIM, TOKEN_DIM, generator=generator) * 0.1)
        self.text = torch.nn.Parameter(torch.randn(TEXT_DIM, TOKEN_DIM, generator=generator) * 0.1)
        self.ids = torch.nn.Parameter(torch.randn(3, TOKEN_DIM, generator=generator) * 0.1)
        self.sigma = torch.nn.Parameter(torch.zeros(TOKEN_DIM))

    def forward(self, batch, sigma, context, pooled):
        text = (context.mean(dim=1) + pooled) @ self.text
        return (
            batch.tokens @ self.tokens
            + text[:, None, :]
            + batch.ids @ self.ids
            + sigma[:, None, None] * self.sigma
        )


def toy_buckets(samples: list[Sample]) -> dict[tuple[int, int], list[int]]:
    """Samples grouped by target latent size (what `KontextDataset.buckets` does in pixels)."""
    buckets: dict[tuple[int, int], list[int]] = {}
    for index, sample in enumerate(samples):
        buckets.setdefault(tuple(sample.target.shape[-2:]), []).append(index)
    return buckets


def run(config: TrainConfig, collective: Collective | None = None) -> tuple[list[float], dict]:
    samples = toy_samples()
    buckets = toy_buckets(samples)
    world = collective.world_size if collective is not None else 1
    order = DataOrder(buckets, config.batch_size * world, config.seed)
    model = ToyVelocity()
    empty = EmptyText(torch.zeros(TEXT_TOKENS, TEXT_DIM), torch.zeros(TEXT_DIM))

    def loss_fn(batch, generator):
        rows = collective.rows(len(batch), config.batch_size) if collective is not None else None
        return flow_matching_loss(model, batch, config, generator, empty, toy_pack, rows)

    result = train(
        config,
        list(model.parameters()),
        lambda index: [samples[i] for i in order(index)],
        loss_fn,
        collective=collective,
    )
    return result.losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def worker(rank: int, world: int, port: int, out: str, batch_size: int) -> None:
    """One gloo process (`torch.multiprocessing.spawn` target): trains and writes its result."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        losses, weights = run(toy_config(batch_size), Collective(rank, world, torch.device("cpu")))
    finally:
        dist.destroy_process_group()
    save_file(weights, str(Path(out) / f"rank{rank}.safetensors"))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(losses))
    # A spawned child that left through the interpreter's teardown aborted now and then, after
    # its results were written (SIGABRT, "terminate called without an active exception", about
    # one run in ten): leave without the teardown.
    os._exit(0)


def read_result(out: Path, rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return json.loads((out / f"rank{rank}.json").read_text()), load_file(str(out / f"rank{rank}.safetensors"))
