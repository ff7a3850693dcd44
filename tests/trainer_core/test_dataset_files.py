"""Both folder structures are found; every problem is reported at once, naming file and fix; the
folder fingerprint follows the files a dataset uses."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kt_testing.bad_files import write_huge_png
from kt_testing.datasets import color_image, write_one_folder, write_parallel
from trainer_core import dataset_files
from trainer_core.dataset_files import DatasetProblems, folder_fingerprint, scan_dataset
from trainer_core.image_files import read_image


def test_one_folder_structure(tmp_path):
    root = write_one_folder(tmp_path / "set", ["cat", "dog"], references=2)
    scan = scan_dataset(root)
    assert scan.folder_structure == "one_folder"
    assert [s.name for s in scan.samples] == ["cat", "dog"]
    cat = scan.samples[0]
    assert cat.target.name == "cat.png"
    assert [p.name for p in cat.references] == ["cat_control.png", "cat_control_1.png"]
    assert cat.caption.name == "cat.txt"
    assert scan.notices == []


def test_parallel_folders_structure(tmp_path):
    root = write_parallel(tmp_path / "set", ["cat", "dog"], references=2)
    scan = scan_dataset(root)
    assert scan.folder_structure == "parallel_folders"
    dog = scan.samples[1]
    assert dog.target == root / "images" / "dog.png"
    assert dog.references == [root / "control" / "dog.png", root / "control_1" / "dog.png"]
    assert dog.caption == root / "images" / "dog.txt"


def test_no_references_is_plain_flux_training(tmp_path):
    scan = scan_dataset(write_one_folder(tmp_path / "set", ["a", "b"], references=0))
    assert [s.references for s in scan.samples] == [[], []]


def test_every_problem_is_reported_together(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b", "c", "d", "e", "f"], references=1)
    (root / "b_control_2.png").write_bytes((root / "b_control.png").read_bytes())  # one more than the rest
    color_image(64, 48, seed=9).save(root / "ghost_control.png")  # orphan reference
    (root / "c.png").write_bytes(b"")  # zero bytes
    (root / "d_control.png").write_bytes(b"GIF89a not really")  # unreadable
    data = (root / "e.png").read_bytes()
    (root / "e.png").write_bytes(data[: len(data) // 2])  # truncated
    color_image(20, 12, seed=3).save(root / "f.png")  # too small
    color_image(64, 48, seed=3).save(root / "a.jpg")  # two images for 'a'
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root, min_size=32)
    message = str(caught.value)
    expected = [
        r"a\.jpg, a\.png are two images for 'a'; keep one of them",
        r"b_control_2\.png: b\.png has more references than most samples \(1\)",
        r"ghost_control\.png: a reference without a target image 'ghost",
        r"c\.png: the file is empty \(0 bytes\)",
        r"d_control\.png: not a readable image",
        r"e\.png: the image is truncated or corrupt",
        r"f\.png: 20x12 is below the minimum side of 32 px",
    ]
    for pattern in expected:
        assert re.search(pattern, message), pattern
    assert "nothing was encoded" in message
    assert len(caught.value.problems) == len(expected)


def test_parallel_missing_and_orphan_references(tmp_path):
    root = write_parallel(tmp_path / "set", ["a", "b"], references=2)
    (root / "control_1" / "b.png").unlink()
    color_image(64, 48, seed=5).save(root / "control" / "zzz.png")
    (root / "control_3").mkdir()
    color_image(64, 48, seed=5).save(root / "control_3" / "a.png")
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root)
    message = str(caught.value)
    assert "images/b.png: no reference control_1/b.png/.jpg/.webp" in message
    assert "control/zzz.png: a reference without a target images/zzz" in message
    assert "reference folders control/, control_1/, control_3/ skip a number" in message


def test_conversions_and_caption_warnings_are_notices(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b", "c"], references=0)
    rgba = np.zeros((48, 64, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(root / "a.png")
    (root / "b.txt").write_text("  \n", encoding="utf-8")
    (root / "c.txt").unlink()
    scan = scan_dataset(root)
    notes = "\n".join(scan.notices)
    assert "a.png: transparency flattened onto a white background" in notes
    assert "b.txt: the caption is empty" in notes
    assert "c.png: no caption file (c.txt)" in notes


def test_empty_or_missing_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetProblems, match="no target images"):
        scan_dataset(tmp_path / "empty")
    with pytest.raises(DatasetProblems, match="is not a folder"):
        scan_dataset(tmp_path / "nope")


def test_non_utf8_caption_is_a_problem(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a"], references=0)
    (root / "a.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DatasetProblems, match=r"a\.txt: the caption is not UTF-8"):
        scan_dataset(root)


def test_oversized_images_are_problems_before_any_encoding(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=0)
    color_image(4100, 16, seed=1).save(root / "b.png")
    with pytest.raises(DatasetProblems, match=r"b\.png: 4100x16 px is over the 4096 px limit on a side"):
        scan_dataset(root)


def test_a_decompression_bomb_is_one_more_named_problem_found_without_decoding(tmp_path, monkeypatch):
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1)
    write_huge_png(root / "big.png", 20000, 20000)  # PIL refuses to open it at all
    (root / "a.txt").write_bytes(b"caf\xe9")
    decoded = []
    monkeypatch.setattr(
        dataset_files, "read_image", lambda path: decoded.append(path.name) or read_image(path)
    )
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root)
    assert caught.value.problems == [
        f"{root / 'big_control.png'} (or .jpg / .webp) is missing: a.png has a_control.png, and every "
        "sample needs the same references; add it, or remove big.png",
        f"{root / 'a.txt'}: the caption is not UTF-8 text; save it as UTF-8",
        f"{root / 'big.png'}: 20000x20000 px is over the 4096 px limit on a side; downscale it",
    ]
    assert "big.png" not in decoded and "b.png" in decoded


def test_one_folder_names_the_missing_reference(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1)
    (root / "b_control.png").unlink()
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root)
    assert caught.value.problems == [
        f"{root / 'b_control.png'} (or .jpg / .webp) is missing: a.png has a_control.png, and every "
        "sample needs the same references; add it, or remove b.png"
    ]


def test_one_folder_follows_the_most_common_reference_count(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b", "c", "d"], references=2)
    (root / "a_control_1.png").unlink()  # a lacks its second reference
    color_image(64, 48, seed=7).save(root / "d_control_2.png")  # d has a third
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root)
    assert caught.value.problems == [
        f"{root / 'a_control_1.png'} (or .jpg / .webp) is missing: b.png has b_control_1.png, and every "
        "sample needs the same references; add it, or remove a.png",
        f"{root / 'd_control_2.png'}: d.png has more references than most samples (2); remove this one, "
        "or give every sample the same references",
    ]


def test_a_numbering_gap_in_every_sample_is_named(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a"], references=0)
    color_image(64, 48, seed=7).save(root / "a_control_1.png")  # no a_control
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root)
    assert caught.value.problems[0] == (
        f"{root / 'a_control.png'} (or .jpg / .webp) is missing: references are numbered _control, "
        "_control_1, _control_2, ... without gaps, and every sample needs the same references; add it, "
        "or remove a.png"
    )


def test_unreadable_captions_and_folders_are_named(tmp_path, monkeypatch):
    # tests run as root, which reads every file: the refusals are simulated
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=0)
    real_open = Path.open

    def path_open(path, *args, **kwargs):
        if path.name == "a.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    def iterdir(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "open", path_open)
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root)
    assert caught.value.problems == [
        f"{root / 'a.txt'}: the caption cannot be read (Permission denied); check that ComfyUI may "
        "read it, or remove it"
    ]
    monkeypatch.setattr(Path, "iterdir", iterdir)
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root)
    assert caught.value.problems == [
        f"{root}: cannot be read (Permission denied); check that ComfyUI may read it"
    ]


def test_fingerprint_changes_when_the_folder_changes(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a"], references=0)
    before = folder_fingerprint(root)
    assert folder_fingerprint(root) == before
    (root / "a.txt").write_text("something else entirely", encoding="utf-8")
    assert folder_fingerprint(root) != before
    shutil.rmtree(root)
    assert folder_fingerprint(root) != before


def test_fingerprint_reads_the_folder_and_its_subfolders_only(tmp_path):
    root = write_parallel(tmp_path / "set", ["a"], references=1)
    before = folder_fingerprint(root)
    deeper = root / "control" / "old"
    deeper.mkdir()
    (deeper / "a.png").write_bytes(b"not part of the dataset")  # a third level: not read
    assert folder_fingerprint(root) == before
    stat = (root / "control" / "a.png").stat()
    os.utime(root / "control" / "a.png", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # touched
    assert folder_fingerprint(root) != before


def test_fingerprint_survives_a_broken_link(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a"], references=0)
    (root / "gone.png").symlink_to(tmp_path / "nowhere.png")
    assert folder_fingerprint(root) == folder_fingerprint(root)


def test_named_pipes_among_the_files_are_named_for_what_they_are(tmp_path):
    """Issue 44: a FIFO caption was reported as "no caption file", a FIFO image as a missing
    target or reference, a FIFO state.json as "missing state.json": say what they are (reading
    one would block)."""
    from trainer_core.checkpoint import read_state

    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1, size=(64, 64))
    (root / "a.txt").unlink()
    os.mkfifo(root / "a.txt")
    (root / "b_control.png").unlink()
    os.mkfifo(root / "b_control.png")
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root)
    message = str(caught.value)
    assert f"{root / 'a.txt'}: is a named pipe (FIFO), not a caption file" in message
    assert f"{root / 'b_control.png'}: is a named pipe (FIFO), not an image file" in message

    checkpoint = tmp_path / "step_000001"
    checkpoint.mkdir()
    for name in ("lora.safetensors", "optimizer.safetensors", "rng.safetensors"):
        (checkpoint / name).write_bytes(b"")
    os.mkfifo(checkpoint / "state.json")
    with pytest.raises(ValueError, match=r"not a checkpoint: state.json is a named pipe \(FIFO\)"):
        read_state(checkpoint)
