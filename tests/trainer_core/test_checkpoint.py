"""Checkpoints round-trip every piece of state; writes are all-or-nothing; pruning keeps K."""

from __future__ import annotations

import json

import pytest
import torch

from trainer_core.checkpoint import (
    all_checkpoints,
    drop_after,
    list_checkpoints,
    load_checkpoint,
    new_run_folder,
    prune,
    save_checkpoint,
)
from trainer_core.lora_file import LoraModule


def state(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lora = {
        "double_blocks.0.img_attn.qkv": LoraModule(
            torch.randn(2, 4, generator=gen), torch.randn(6, 2, generator=gen), 2.0
        )
    }
    params = [torch.nn.Parameter(lora["double_blocks.0.img_attn.qkv"].down.clone())]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    params[0].grad = torch.ones_like(params[0])
    optimizer.step()
    rng = {"generator": torch.Generator().manual_seed(7).get_state(), "cpu": torch.get_rng_state()}
    return lora, optimizer, rng


def test_round_trip(tmp_path):
    lora, optimizer, rng = state()
    path = save_checkpoint(tmp_path / "ckpt", 12, lora, optimizer, rng, [1.0, 0.5], {"rank": 2})
    assert path.name == "step_000012"
    loaded = load_checkpoint(path)
    assert loaded.step == 12 and loaded.losses == [1.0, 0.5] and loaded.config == {"rank": 2}
    module = loaded.lora["double_blocks.0.img_attn.qkv"]
    assert torch.equal(module.down, lora["double_blocks.0.img_attn.qkv"].down) and module.alpha == 2.0
    assert torch.equal(loaded.rng["generator"], rng["generator"])
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 4))], lr=0.1)
    fresh.load_state_dict(loaded.optimizer_state)
    original = optimizer.state_dict()
    for name in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(fresh.state_dict()["state"][0][name], original["state"][0][name])
    assert sorted(p.name for p in path.iterdir()) == [
        "lora.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "state.json",
    ]
    assert json.loads((path / "state.json").read_text())["step"] == 12


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    lora, optimizer, rng = state()
    folder = tmp_path / "ckpt"
    save_checkpoint(folder, 5, lora, optimizer, rng, [1.0], {})
    before = (folder / "step_000005" / "lora.safetensors").read_bytes()

    import trainer_core.checkpoint as checkpoint

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_atomic", broken)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(folder, 5, lora, optimizer, rng, [2.0], {})
    assert (folder / "step_000005" / "lora.safetensors").read_bytes() == before
    assert [p.name for p in folder.iterdir()] == ["step_000005"]  # no staging folder left


def test_incomplete_folder_is_refused(tmp_path):
    (tmp_path / "step_000001").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_000001")


def test_prune_keeps_the_newest(tmp_path):
    lora, optimizer, rng = state()
    for step in (3, 10, 7, 100):
        save_checkpoint(tmp_path, step, lora, optimizer, rng, [], {})
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_000003",
        "step_000007",
        "step_000010",
        "step_000100",
    ]
    prune(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000010", "step_000100"]
    assert prune(tmp_path, 0) == []


def test_run_folders_and_dropping_later_steps(tmp_path):
    lora, optimizer, rng = state()
    first, second = new_run_folder(tmp_path), new_run_folder(tmp_path)
    assert first != second and first.parent == tmp_path
    for step in (1, 2, 3):
        save_checkpoint(first, step, lora, optimizer, rng, [], {})
    save_checkpoint(second, 1, lora, optimizer, rng, [], {})
    assert [p.relative_to(tmp_path).as_posix() for p in all_checkpoints(tmp_path)] == [
        f"{first.name}/step_000001",
        f"{first.name}/step_000002",
        f"{first.name}/step_000003",
        f"{second.name}/step_000001",
    ]
    assert [p.name for p in drop_after(first, 1)] == ["step_000002", "step_000003"]
    assert [p.name for p in list_checkpoints(first)] == ["step_000001"]
