"""Atomic publishing flushes before it publishes (trainer_core/atomic.py, checkpoint.py): every
file is on disk (`os.fsync`) while it still has its temp name, so a power cut after the rename
leaves the whole new file, never a renamed empty one. Nothing else observes the fsync: without
these tests, dropping it passes the suite (issue 40, item 3)."""

from __future__ import annotations

import os

import torch

from trainer_core.atomic import write_atomic
from trainer_core.checkpoint import save_checkpoint
from trainer_core.lora_file import LoraModule


def record_fsyncs(monkeypatch, published) -> list[tuple[int, bytes, bool]]:
    """Patch `os.fsync` to note, for each call, the file's inode, its bytes and whether
    `published()` was already true then; the real fsync still runs."""
    seen, real = [], os.fsync

    def fsync(fd):
        size = os.fstat(fd).st_size
        seen.append((os.fstat(fd).st_ino, os.pread(fd, size, 0), published()))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_a_file_is_flushed_whole_under_its_temp_name_then_renamed(tmp_path, monkeypatch):
    target = tmp_path / "chart.png"
    target.write_bytes(b"old")
    seen = record_fsyncs(monkeypatch, lambda: target.read_bytes() != b"old")
    write_atomic(target, lambda tmp: tmp.write_bytes(b"new contents"))
    assert target.read_bytes() == b"new contents"
    # the rename keeps the inode: the file now named `target` was flushed, whole, before it got the name
    assert (target.stat().st_ino, b"new contents", False) in seen, seen


def test_every_checkpoint_file_is_flushed_before_the_folder_gets_its_name(tmp_path, monkeypatch):
    lora = {"double_blocks.0.img_attn.qkv": LoraModule(torch.randn(2, 4), torch.randn(6, 2), 2.0)}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, 4))], lr=0.1)
    final = tmp_path / "ckpt" / "step_000003"
    seen = record_fsyncs(monkeypatch, final.exists)
    path = save_checkpoint(tmp_path / "ckpt", 3, lora, optimizer, {"cpu": torch.get_rng_state()}, [1.0], {})
    assert path == final
    flushed = {inode: (data, published) for inode, data, published in seen}
    for file in sorted(final.iterdir()):
        assert file.stat().st_ino in flushed, f"{file.name} was never flushed (os.fsync)"
        data, published = flushed[file.stat().st_ino]
        assert data == file.read_bytes() and not published, f"{file.name} was flushed late or partly"
