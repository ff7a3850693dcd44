"""A full disk under the headless command (issue 62), on a real small file system: the folder a
write goes to is a full tmpfs (`kt_testing.small_disk`; skipped where this machine cannot mount
one). The command ends with exit code 2 and one line (what, where, the system's reason, what is
safe, what to do), never a traceback; on c1ab39f each place gave a 46-65-line traceback ending in
`SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)`."""

from __future__ import annotations

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.headless import checkpoints, command, run, write_config
from kt_testing.small_disk import fill, small_disk

pytestmark = pytest.mark.version_independent

FULL = "No space left on device"


@pytest.mark.parametrize("place", ["LoRA", "snapshot", "checkpoint", "cache"])
def test_a_full_disk_ends_the_command_in_one_line(tmp_path, place):
    base, cache = tmp_path / "base", tmp_path / "cache"
    dataset = write_one_folder(tmp_path / "data", ["a", "b"], references=1, size=(64, 64))
    name = f"full_{place}"
    folder = {
        "LoRA": base / "models" / "loras",
        "snapshot": base / "models" / "loras",
        "checkpoint": base / "output" / "kontext_trainer_checkpoints" / name,
        "cache": cache,
    }[place]
    train = {"lora_name": name, "steps": 2, "save_every": 1 if place in ("snapshot", "checkpoint") else 0}
    config = write_config(tmp_path / "run.toml", base, dataset, cache, train)
    with small_disk(folder):
        fill(folder)
        result = run(command(config), timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "os error" not in result.stderr, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if "error" in x.lower()]
    if place == "cache":
        assert f"could not write the dataset's encodings to {cache}: {FULL}; nothing was trained yet" in line
        return
    step = 2 if place == "LoRA" else 1
    where = folder / f"{name}_steps" if place == "snapshot" else folder
    assert f"could not write the {place} at step {step} to {where}: {FULL}; " in line, line
    if place == "LoRA":
        (final,) = checkpoints(base, name)
        assert f"the trained LoRA is complete in the final checkpoint, {final / 'lora.safetensors'}" in line
    else:
        assert "no checkpoint of this run was complete yet; make room and start it again" in line
