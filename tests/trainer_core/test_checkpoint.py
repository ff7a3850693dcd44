"""Checkpoints round-trip every piece of state; writes are all-or-nothing; pruning keeps K."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from PIL import Image

from trainer_core.checkpoint import (
    all_checkpoints,
    checkpoint_problem,
    list_checkpoints,
    load_checkpoint,
    new_run_folder,
    prune,
    read_state,
    save_checkpoint,
)
from trainer_core.lora_file import LoraModule, load, save_atomic
from trainer_core.loss_chart import save_png_atomic


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
    loaded = load_checkpoint(path, list(lora))
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


def test_the_checkpoint_lora_is_a_full_precision_kohya_file_and_old_ones_still_load(tmp_path):
    lora, optimizer, rng = state()
    path = save_checkpoint(tmp_path / "ckpt", 3, lora, optimizer, rng, [1.0], {}, {"ss_steps": "3"})
    tensors, metadata = load(path / "lora.safetensors")
    down = tensors["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"]
    assert down.dtype == torch.float32 and torch.equal(down, lora["double_blocks.0.img_attn.qkv"].down)
    assert metadata["ss_steps"] == "3" and len(metadata["sshs_model_hash"]) == 64
    # a checkpoint written by an earlier version: `diffusion_model.<module>.lora_A/B` keys
    module = lora["double_blocks.0.img_attn.qkv"]
    old = {
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": module.down,
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": module.up,
        "diffusion_model.double_blocks.0.img_attn.qkv.alpha": torch.tensor(module.alpha),
    }
    save_atomic(old, path / "lora.safetensors")
    loaded = load_checkpoint(path, list(lora)).lora["double_blocks.0.img_attn.qkv"]
    assert torch.equal(loaded.down, module.down) and torch.equal(loaded.up, module.up)
    assert loaded.alpha == module.alpha


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
        load_checkpoint(tmp_path / "step_000001", [])


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


def test_run_folders_are_listed_run_by_run(tmp_path):
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


def test_a_checkpoint_loaded_in_inference_mode_can_be_updated_in_place(tmp_path):
    """ComfyUI runs nodes under torch.inference_mode(): whatever they load there must still
    be usable by an optimizer that updates its state in place in the training thread."""
    lora, optimizer, rng = state()
    path = save_checkpoint(tmp_path, 1, lora, optimizer, rng, [1.0], {})
    with torch.inference_mode():
        loaded = load_checkpoint(path, list(lora))
    tensors = [*rng_values(loaded), *optimizer_values(loaded)]
    assert tensors and not any(t.is_inference() for t in tensors)
    for tensor in tensors:
        tensor.add_(0)  # raises for an inference tensor outside inference mode
    with torch.inference_mode():
        raw = load(path / "optimizer.safetensors")[0]
    with pytest.raises(RuntimeError, match=r"[Ii]nference tensor"):
        next(iter(raw.values())).add_(0)  # the failure the conversion prevents


def rng_values(checkpoint):
    return list(checkpoint.rng.values())


def optimizer_values(checkpoint):
    return [
        v
        for values in checkpoint.optimizer_state["state"].values()
        for v in values.values()
        if torch.is_tensor(v)
    ] + [m.down for m in checkpoint.lora.values()]


def test_files_follow_the_umask(tmp_path):
    lora, optimizer, rng = state()
    previous = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path / "run", 1, lora, optimizer, rng, [1.0], {})
        chart = save_png_atomic(Image.new("RGB", (4, 4)), tmp_path / "chart.png")
        os.umask(0o027)
        strict = save_atomic({"x": torch.zeros(1)}, tmp_path / "strict.safetensors")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    for name in ("lora.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"):
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o644, name
    assert stat.S_IMODE(chart.stat().st_mode) == 0o644
    assert stat.S_IMODE(strict.stat().st_mode) == 0o640


def saved(tmp_path, nan_in_optimizer=False):
    lora, optimizer, rng = state()
    if nan_in_optimizer:
        next(iter(optimizer.state.values()))["exp_avg"][0, 0] = float("nan")
    return save_checkpoint(tmp_path / "ckpt", 3, lora, optimizer, rng, [1.0, 0.5, 0.25], {"rank": 2}), lora


@pytest.mark.parametrize(
    ("file", "damage", "says"),
    [
        ("state.json", b"", "it is not readable JSON"),
        ("state.json", b'{"step": 3, "loss', "it is not readable JSON"),
        ("state.json", b'{"step": 3}', "it lacks losses, config, optimizer"),
        ("lora.safetensors", None, "it is not a readable safetensors file"),
        ("optimizer.safetensors", None, "it is not a readable safetensors file"),
        ("rng.safetensors", None, "it is not a readable safetensors file"),
    ],
    ids=["empty-state", "truncated-state", "state-without-keys", "lora", "optimizer", "rng"],
)
def test_a_damaged_checkpoint_names_its_broken_file(tmp_path, file, damage, says):
    path, lora = saved(tmp_path)
    assert checkpoint_problem(path) is None
    target = path / file
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2] if damage is None else damage)  # truncated by a crash
    expected = f"{target}: {says}"
    assert checkpoint_problem(path).startswith(expected)
    for read in (read_state, lambda p: load_checkpoint(p, list(lora))):
        with pytest.raises(ValueError) as error:
            read(path)
        assert str(error.value).startswith(expected) and "resume another one" in str(error.value)


def test_a_checkpoint_with_non_finite_optimizer_state_is_refused_when_loaded(tmp_path):
    path, lora = saved(tmp_path, nan_in_optimizer=True)
    message = r"optimizer\.safetensors: state\.\d+\.exp_avg holds NaN or infinite"
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path, list(lora))
