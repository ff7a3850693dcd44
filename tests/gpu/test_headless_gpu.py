"""The headless command on GPUs (tiny test models, `kt_testing/headless_tiny.py`, no `--cpu`):
one GPU, and data parallel over NCCL with two GPUs equal to one GPU with twice the batch.
Needs CUDA itself (skipped in the CPU dry run); the NCCL test needs two GPUs."""

from __future__ import annotations

import sys

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.headless import TINY_COMMAND, checkpoints, final_state, run, write_config


def train_args(config, *launcher: str) -> list[str]:
    prefix = [sys.executable, "-m", "torch.distributed.run", *launcher] if launcher else [sys.executable]
    return [*prefix, str(TINY_COMMAND), "train", "--config", str(config)]


@pytest.fixture
def files(tmp_path):
    dataset = write_one_folder(tmp_path / "data", list("abcde"), references=1, size=(64, 64))

    def config(name: str, batch_size: int = 1):
        train = {"lora_name": name, "steps": 6, "batch_size": batch_size, "save_every": 3}
        return write_config(tmp_path / f"{name}.toml", tmp_path / "base", dataset, tmp_path / "cache", train)

    return type("Files", (), {"base": tmp_path / "base", "config": staticmethod(config)})


def test_the_command_trains_on_the_gpu(cuda_only, files):
    result = run(train_args(files.config("gpu1")))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "training on cuda" in result.stdout
    assert len(final_state(checkpoints(files.base, "gpu1")[-1])[0]) == 6


def test_two_gpus_over_nccl_equal_one_with_twice_the_batch(cuda_only, files):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    single = run(train_args(files.config("one", batch_size=2)))
    assert single.returncode == 0, single.stdout + single.stderr
    pair = run(train_args(files.config("two"), "--standalone", "--nproc_per_node=2"))
    assert pair.returncode == 0, pair.stdout + pair.stderr
    expected, expected_lora = final_state(checkpoints(files.base, "one")[-1])
    losses, lora = final_state(checkpoints(files.base, "two")[-1])
    assert losses == pytest.approx(expected, rel=1e-3)
    for key, value in expected_lora.items():
        torch.testing.assert_close(lora[key], value, rtol=1e-3, atol=1e-4)
