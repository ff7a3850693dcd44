"""Both folder layouts are found; every problem is reported at once, naming file and fix."""

from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image

from kt_testing.datasets import color_image, write_one_folder, write_parallel
from trainer_core.dataset_files import DatasetProblems, scan_dataset


def test_one_folder_layout(tmp_path):
    root = write_one_folder(tmp_path / "set", ["cat", "dog"], references=2)
    scan = scan_dataset(root)
    assert scan.layout == "one_folder"
    assert [s.name for s in scan.samples] == ["cat", "dog"]
    cat = scan.samples[0]
    assert cat.target.name == "cat.png"
    assert [p.name for p in cat.references] == ["cat_control.png", "cat_control_1.png"]
    assert cat.caption.name == "cat.txt"
    assert scan.notices == []


def test_parallel_folders_layout(tmp_path):
    root = write_parallel(tmp_path / "set", ["cat", "dog"], references=2)
    scan = scan_dataset(root)
    assert scan.layout == "parallel_folders"
    dog = scan.samples[1]
    assert dog.target == root / "images" / "dog.png"
    assert dog.references == [root / "control" / "dog.png", root / "control_1" / "dog.png"]
    assert dog.caption == root / "images" / "dog.txt"


def test_no_references_is_plain_flux_training(tmp_path):
    scan = scan_dataset(write_one_folder(tmp_path / "set", ["a", "b"], references=0))
    assert [s.references for s in scan.samples] == [[], []]


def test_every_problem_is_reported_together(tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b", "c", "d", "e", "f"], references=1)
    (root / "b_control_2.png").write_bytes((root / "b_control.png").read_bytes())  # gap: no _control_1
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
        r"'b' has control, control_2 but no control_1",
        r"ghost_control\.png: a reference without a target image 'ghost",
        r"c\.png: the file is empty \(0 bytes\)",
        r"d_control\.png: not a readable image",
        r"e\.png: the image is truncated or corrupt",
        r"f\.png: 20x12 is below the minimum side of 32 px",
        r"samples have different numbers of references: .* with 1 .*; .* with 2 \(b\)",
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
    with pytest.raises(DatasetProblems, match=r"b\.png: 4100x16 is over the 4096 px cap on a side"):
        scan_dataset(root)
