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


@pytest.mark.parametrize("kind", ["file", "dangling link"])
def test_a_folder_blocked_by_a_file_or_a_dangling_link_is_no_name_clash(tmp_path, kind):
    """Issue 44: `replacing()` let mkdir's FileExistsError out where the folder was a file or a
    link to a missing place, and the LoRA save read it as "the name is taken" and tried
    `<name>_2`, `_3`, ... for ever. Now it is NotADirectoryError naming what stands there, and
    only a real clash at the rename is NameTaken."""
    from kt_testing.bad_files import break_folder
    from trainer_core.atomic import NameTaken, folder_problem

    folder = tmp_path / "loras"
    folder.mkdir()
    write_atomic(folder / "taken.safetensors", lambda p: p.write_bytes(b"old"))
    with pytest.raises(NameTaken):  # the clash the next-free-name loop is for
        write_atomic(folder / "taken.safetensors", lambda p: p.write_bytes(b"new"), replace=False)
    assert folder_problem(folder) is None and folder_problem(folder / "taken_steps", create=False) is None

    break_folder(folder, kind)
    what = "is a file, not a folder" if kind == "file" else "is a link to a missing place"
    with pytest.raises(NotADirectoryError) as caught:
        write_atomic(folder / "lora.safetensors", lambda p: p.write_bytes(b"x"), replace=False)
    assert not isinstance(caught.value, FileExistsError)
    assert caught.value.strerror.startswith(f"{folder} {what}")
    assert folder_problem(folder).startswith(f"{folder} {what}")
    assert folder_problem(folder / "lora_steps", create=False).startswith(f"{folder} {what}")
    assert not list(tmp_path.glob("kt_unmounted_drive*"))  # nothing made where the link points


def test_a_folder_that_is_missing_is_made_and_probed_without_leaving_a_file(tmp_path):
    from trainer_core.atomic import folder_problem

    root = tmp_path / "output" / "kontext_trainer_checkpoints"
    assert folder_problem(root) is None and root.is_dir() and not list(root.iterdir())
    assert folder_problem(root / "name", create=False) is None and not (root / "name").exists()
    if os.geteuid() != 0:  # root writes anywhere
        root.chmod(0o555)
        try:
            assert folder_problem(root) == f"{root} does not take files: Permission denied"
        finally:
            root.chmod(0o755)


def test_a_named_pipe_is_said_to_be_one(tmp_path):
    from trainer_core.atomic import folder_problem, special_kind

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert special_kind(pipe) == "a named pipe (FIFO)"
    assert folder_problem(pipe) == f"{pipe} is a named pipe (FIFO)"
    assert special_kind(tmp_path) is None and special_kind(tmp_path / "missing") is None
