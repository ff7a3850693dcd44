"""Atomic writes: whole or nothing, and (replace off) never over a file that appeared since."""

from __future__ import annotations

import os

import pytest

from trainer_core.atomic import write_atomic


def test_replace_off_never_replaces_a_file_that_appeared_and_leaves_no_temp(tmp_path):
    target = tmp_path / "lora.safetensors"
    write_atomic(target, lambda tmp: tmp.write_bytes(b"first"), replace=False)
    assert target.read_bytes() == b"first"

    def write_while_another_saves(tmp):  # the other writer's rename lands between our checks
        tmp.write_bytes(b"second")
        target.write_bytes(b"other")

    target.unlink()
    with pytest.raises(FileExistsError):
        write_atomic(target, write_while_another_saves, replace=False)
    assert target.read_bytes() == b"other" and os.listdir(tmp_path) == ["lora.safetensors"]
    write_atomic(target, lambda tmp: tmp.write_bytes(b"third"))  # replace on (the default)
    assert target.read_bytes() == b"third" and os.listdir(tmp_path) == ["lora.safetensors"]


def test_a_failed_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "chart.png"
    target.write_bytes(b"old")

    def fail(tmp):
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(target, fail)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["chart.png"]
