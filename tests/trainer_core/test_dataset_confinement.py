"""A dataset picked in ComfyUI's input directory reads nothing outside it
(`scan_dataset(confined_to=...)`, trainer_core/dataset_files.py): a file there that is a link
leading out is a named problem and is never read. Before this file only an e2e test
(tests/e2e/test_bad_input.py, a server) saw it: this one is the quick check (issue 40, item 3)."""

from __future__ import annotations

import pytest

from kt_testing.datasets import write_one_folder
from trainer_core.dataset_files import DatasetProblems, scan_dataset


def test_files_linked_out_of_the_input_directory_are_refused_by_name(tmp_path):
    input_dir = tmp_path / "input"
    root = write_one_folder(input_dir / "set", ["a", "b", "c"], size=(64, 64))
    elsewhere = write_one_folder(tmp_path / "elsewhere", ["x"], size=(64, 64))
    (root / "a.txt").unlink()
    (root / "a.txt").symlink_to(elsewhere / "x.txt")  # a caption from outside
    (root / "b.png").unlink()
    (root / "b.png").symlink_to(elsewhere / "x.png")  # an image from outside
    shared = input_dir / "shared_caption.txt"
    shared.write_text("a shared caption", encoding="utf-8")
    (root / "c.txt").unlink()
    (root / "c.txt").symlink_to(shared)  # a link that stays inside input/ is fine

    assert [s.name for s in scan_dataset(root).samples] == ["a", "b", "c"]  # unconfined: an absolute path
    with pytest.raises(DatasetProblems) as caught:
        scan_dataset(root, confined_to=input_dir)
    assert caught.value.problems == [
        f"{root / name}: a link to {elsewhere / target}, outside ComfyUI's input directory; links out "
        "of it are not followed: copy the file into the dataset, or give the dataset's location in path"
        for name, target in (("a.txt", "x.txt"), ("b.png", "x.png"))
    ]
