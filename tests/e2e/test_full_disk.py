"""A full disk through a real server, on a real small file system (issue 62): a tmpfs mounted
over the folder the pack writes to (`kt_testing.small_disk`; skipped where this machine cannot
mount one), filled before the run or, by the test node KTTest_DiskFull, after the pack wrote
so many files. Every write the pack makes (snapshot, checkpoint, the LoRA, the dataset's cache)
ends in one line: what, where, the system's reason, what is safe, what to do; nothing partial
and no empty folder is left, and the panel keeps the step that finished. On c1ab39f each was
the raw `SafetensorError: ... I/O error: No space left on device (os error 28)`."""

from __future__ import annotations

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.graphs import dataset_inputs, training_graph
from kt_testing.runs import checkpoints_root, error_of
from kt_testing.small_disk import FILLER, fill, small_disk
from trainer_core.lora_file import load

pytestmark = pytest.mark.version_independent

FULL = "No space left on device"


@pytest.fixture(scope="module")
def dataset(server):
    return write_one_folder(
        server.base_dir / "input" / "kt_disk_set", ["a", "b"], references=1, size=(64, 64)
    )


def loras(server):
    return server.base_dir / "models" / "loras"


def succeeded(messages) -> None:
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")


def one_line(message: str) -> str:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    assert "SafetensorError" not in message and "os error" not in message, message
    return message


def full_after(graph: dict, writes: int, folder) -> dict:
    """`graph` with KTTest_DiskFull between the model and TrainLoRA: `writes` more files, then
    the file system of `folder` is full (-1: room again)."""
    graph["9"] = {
        "class_type": "KTTest_DiskFull",
        "inputs": {"model": ["1", 0], "after_writes": writes, "folder": str(folder), "after": ["4", 0]},
    }
    graph["5"]["inputs"]["model"] = ["9", 0]
    return graph


def checkpoint_choices(server, name: str) -> list[str]:
    spec = server.get_json("/object_info/KontextTrainer_TrainLoRA")["KontextTrainer_TrainLoRA"]
    options = spec["input"]["required"]["resume_from"]
    options = options[0] if isinstance(options[0], list) else options[1]["options"]
    return [c for c in options if c.startswith(f"{name}/")]


def test_a_full_lora_folder_names_what_is_safe_and_the_run_resumes(server, dataset):
    """models/loras on a 1 MiB tmpfs: a snapshot that no longer fits names the newest complete
    checkpoint; a first snapshot that does not fit leaves no empty <name>_steps/; the final
    LoRA that does not fit names the final checkpoint that holds it, which loads; with room
    again the named checkpoint resumes and finishes."""
    settings = {"steps": 6, "save_every": 2, "keep_last": 0, "seed": 12}
    with small_disk(loras(server)) as folder:
        # step 2's snapshot and checkpoint (LoRA, optimizer, random state) fit; step 4's snapshot does not
        graph = full_after(training_graph(dataset, "kt_full_disk", **settings), 4, folder)
        _, failed = server.run_prompt(graph)
        message = one_line(error_of(failed))
        (first,) = checkpoint_choices(server, "kt_full_disk")
        assert message.startswith(
            f"could not write the snapshot at step 4 to {folder / 'kt_full_disk_steps'}: {FULL}; "
        ), message
        assert f"the newest complete checkpoint is {first}; make room and resume from it" in message
        status = server.get_json("/kontext_trainer/progress")
        assert (status["status"], status["step"]) == ("error", 4), status
        assert not (folder / "kt_full_disk.safetensors").exists()
        assert not [p for p in folder.rglob("*.partial")]  # nothing half-written

        # the first snapshot of a run does not fit: no empty <name>_steps/ is left
        _, no_room = server.run_prompt(training_graph(dataset, "kt_no_room", steps=2, save_every=1))
        message = one_line(error_of(no_room))
        assert message.startswith(
            f"could not write the snapshot at step 1 to {folder / 'kt_no_room_steps'}: {FULL}"
        )
        assert "no checkpoint of this run was complete yet; make room and start it again" in message
        assert not (folder / "kt_no_room_steps").exists()
        assert server.get_json("/kontext_trainer/progress")["step"] == 1

        # the final LoRA does not fit: the final checkpoint holds it
        _, no_lora = server.run_prompt(training_graph(dataset, "kt_no_lora", steps=2, save_every=0))
        message = one_line(error_of(no_lora))
        (final,) = checkpoint_choices(server, "kt_no_lora")
        kept = checkpoints_root(server) / final / "lora.safetensors"
        assert message.startswith(f"could not write the LoRA at step 2 to {folder}: {FULL}; "), message
        assert f"the trained LoRA is complete in the final checkpoint, {kept} (float32): make room" in message
        assert load(kept)[0]  # the LoRA is there, whole
        assert server.get_json("/kontext_trainer/progress")["step"] == 2

        # room again: the named checkpoint resumes and finishes
        (folder / FILLER).unlink()
        graph = full_after(training_graph(dataset, "kt_full_disk", resume_from=first, **settings), -1, folder)
        _, resumed = server.run_prompt(graph)
        succeeded(resumed)
        assert load(folder / "kt_full_disk.safetensors")[0]


def test_a_full_checkpoint_or_cache_folder_is_one_line_and_leaves_nothing(server, dataset):
    """The checkpoint folder full at the first checkpoint: no run folder is left; the dataset's
    cache folder full: the dataset node says so, before any step."""
    with small_disk(checkpoints_root(server) / "kt_no_checkpoint") as folder:
        fill(folder)
        _, failed = server.run_prompt(training_graph(dataset, "kt_no_checkpoint", steps=2, save_every=1))
        message = one_line(error_of(failed))
        assert message.startswith(f"could not write the checkpoint at step 1 to {folder}: {FULL}; "), message
        assert "no checkpoint of this run was complete yet; make room and start it again" in message
        assert [p.name for p in folder.iterdir()] == [FILLER]  # no run folder, no temp folder

    cache = server.base_dir / "output" / "kt_test_caches" / "kt_full_cache"
    with small_disk(cache) as folder:
        fill(folder)
        graph = training_graph(dataset, "kt_no_cache", steps=2)
        graph["4"]["inputs"] |= dataset_inputs(["2", 0], ["3", 0], dataset, "kt_test_caches/kt_full_cache")
        _, failed = server.run_prompt(graph)
        message = one_line(error_of(failed))
        assert message.startswith(f"could not write the dataset's encodings to {folder}: {FULL}; "), message
        assert (
            "nothing was trained yet" in message and "make room (or choose another cache_folder)" in message
        )
        assert not [p for p in folder.rglob("*") if p.is_file() and p.name != FILLER]
