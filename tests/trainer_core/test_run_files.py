"""Where a LoRA name's files go: the per-step snapshots beside the LoRA, and the leftovers a
crash can leave."""

from __future__ import annotations

from trainer_core.run_files import LoraPaths, remove_stale_partials, snapshot_steps


def paths(tmp_path) -> LoraPaths:
    return LoraPaths(tmp_path / "loras", tmp_path / "output" / "kontext_trainer_checkpoints", "my.lora")


def test_snapshots_live_in_a_folder_of_their_own_beside_the_lora(tmp_path):
    p = paths(tmp_path)
    assert p.lora == tmp_path / "loras" / "my.lora.safetensors"
    assert p.snapshot(120) == tmp_path / "loras" / "my.lora_steps" / "my.lora-step00000120.safetensors"


def test_the_snapshots_of_a_name_are_found_by_step(tmp_path):
    p = paths(tmp_path)
    p.snapshots.mkdir(parents=True)
    for step in (10, 2, 30, 20):
        p.snapshot(step).write_bytes(b"x")
    others = [p.snapshots / "myXlora-step00000001.safetensors", p.snapshots / "notes.txt"]
    for other in others:  # another stem (the dot is not a wildcard) and a user's file: never touched
        other.write_bytes(b"y")
    assert snapshot_steps(p) == {step: p.snapshot(step) for step in (2, 10, 20, 30)}
    assert snapshot_steps(paths(tmp_path / "none")) == {}


def test_a_crash_mid_snapshot_leaves_a_temp_file_the_next_run_removes(tmp_path):
    p = paths(tmp_path)
    p.snapshots.mkdir(parents=True)
    p.snapshot(4).write_bytes(b"x")
    partial = p.snapshots / ".my.lora-step00000008.safetensors.0123456789ab.partial"
    partial.write_bytes(b"half")
    assert remove_stale_partials(p) == [partial]
    assert not partial.exists() and p.snapshot(4).exists()


def test_a_kill_during_the_folder_probe_leaves_a_probe_the_next_run_removes(tmp_path):
    """folder_problem's probe (`.write_test.<hex>.partial`, alive for microseconds) outlived a
    server killed while it existed (tests/e2e/test_training.py caught one, session 27); the next
    run of any LoRA name removes it, and a probe removed by another run is no error."""
    from trainer_core.atomic import folder_problem, temp_sibling

    p = paths(tmp_path)
    p.loras_dir.mkdir(parents=True, exist_ok=True)
    probe = temp_sibling(p.loras_dir / "write_test")
    probe.write_bytes(b"")
    assert probe.name.startswith(".write_test.") and probe.name.endswith(".partial")
    assert remove_stale_partials(p) == [probe]
    assert not probe.exists()
    assert folder_problem(p.loras_dir) is None
