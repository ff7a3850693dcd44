"""Data parallel training with torchrun on CPU (gloo), through the headless command with the
tiny test models (`kt_testing/headless_tiny.py`).

- 2 processes x batch 1 train exactly what 1 process with batch 2 trains (losses and LoRA,
  fp32 tolerance): the dataset's 5 training samples make every epoch end on a global batch of
  one, where the second process has no rows; a held-out sample is validated on both;
- the same with two single-process torchrun launchers joined over a loopback rendezvous
  (`--nnodes 2`), standing in for two machines;
- killing one process stops the other within a bounded time, with a message;
- a checkpoint of 2 processes is not resumed by 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from comfy_server import free_port
from kt_testing.datasets import write_one_folder
from kt_testing.headless import (
    DRAWS,
    PROGRESS,
    assert_same_run,
    checkpoints,
    command,
    environment,
    final_state,
    run,
    torchrun,
    write_config,
)
from kt_testing.paths import REPO_ROOT

pytestmark = pytest.mark.version_independent  # runs on ComfyUI 0.33 only in `make test`

STEPS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    dataset = write_one_folder(root / "data", list("abcdef"), references=1, size=(64, 64))

    def config(name: str, batch_size: int = 1, **train):
        settings = {
            "lora_name": name,
            "steps": STEPS,
            "batch_size": batch_size,
            "save_every": 3,
            **DRAWS,
            **train,
        }
        return write_config(
            root / f"{name}.toml", root / "base", dataset, root / "cache", settings, hold_out=1
        )

    return type("Files", (), {"root": root, "base": root / "base", "config": staticmethod(config)})


@pytest.fixture(scope="module")
def single(files):
    """One process, the global batch (2)."""
    result = run(command(files.config("single", batch_size=2)))
    assert result.returncode == 0, result.stdout + result.stderr
    return final_state(checkpoints(files.base, "single")[-1])


def test_two_processes_train_what_one_trains_with_twice_the_batch(files, single):
    result = run(torchrun(files.config("ranks2"), 2, "--standalone"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "data parallel: 2 processes, global batch 2 x 1" in result.stdout
    assert result.stdout.count("LoRA saved:") == 1  # rank 0 writes and prints
    assert_same_run(files.base, "ranks2", single, STEPS)
    rng = checkpoints(files.base, "ranks2")[-1] / "rng.safetensors"
    from safetensors.torch import load_file

    assert {"generator", "cpu", "rank1.cpu"} <= set(load_file(str(rng)))  # every process's RNG


def launch_two_machines(config, port: int) -> list[subprocess.Popen]:
    launchers = []
    for node in (0, 1):
        rendezvous = ("--nnodes=2", f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}")
        launchers.append(
            subprocess.Popen(
                torchrun(config, 1, *rendezvous),
                cwd=REPO_ROOT,
                env=environment(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return launchers


def test_two_machines_over_a_loopback_rendezvous(files, single):
    launchers = launch_two_machines(files.config("nodes2"), free_port())
    outputs = [launcher.communicate(timeout=300)[0] for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], "\n".join(outputs)
    assert "data parallel: 2 processes" in outputs[0]
    assert_same_run(files.base, "nodes2", single, STEPS)


def test_a_dead_process_stops_the_other_with_a_message(files):
    launchers = launch_two_machines(files.config("dies", steps=100_000), free_port())
    try:
        output = []
        for line in launchers[0].stdout:
            output.append(line)
            if PROGRESS.match(line):  # both train: kill the second machine's process
                break
        (worker,) = psutil.Process(launchers[1].pid).children(recursive=True)
        worker.kill()
        killed = time.monotonic()
        output += launchers[0].stdout.readlines()
        launchers[0].wait(timeout=120)
        stopped_within = time.monotonic() - killed
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
            launcher.wait(timeout=30)
    text = "".join(output)
    assert launchers[0].returncode != 0
    assert "rank 0 of 2: summing the gradients with the other ranks failed" in text or (
        "rank 0 of 2:" in text and "Another rank has stopped" in text
    ), text
    # legitimate 2.6 s (measured: gloo's socket closes, the next collective raises PeerLost); a
    # collective that waited instead stops at the process group's timeout, 1800 s (from the code:
    # --timeout-minutes, default 30, not set here), and the 120 s wait above fails first
    assert stopped_within < 60, f"the other process needed {stopped_within:.0f} s to stop"


def test_a_checkpoint_of_two_processes_is_not_resumed_by_one(files):
    if not checkpoints(files.base, "ranks2"):
        pytest.skip("needs the two-process run's checkpoints")
    choice = checkpoints(files.base, "ranks2")[0]
    result = run(command(files.config("resume1", resume_from=str(choice), steps=STEPS + 2)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "trained by 2 data-parallel process(es) and this run has 1" in result.stderr


def test_ctrl_c_under_torchrun_checkpoints_on_rank_0(files):
    """A terminal's Ctrl-C reaches torchrun and its processes (one process group), and torchrun
    forwards it again: the run still stops after one step, with a checkpoint."""
    launcher = subprocess.Popen(
        # no save_every checkpoints: the only one is the stop's
        torchrun(files.config("ctrl_c", steps=100_000, save_every=0), 2, "--standalone"),
        cwd=REPO_ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives it
    )
    try:
        output = []
        for line in launcher.stdout:
            output.append(line)
            if PROGRESS.match(line):
                os.killpg(launcher.pid, signal.SIGINT)
                break
        output += launcher.stdout.readlines()
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    text = "".join(output)
    assert "to resume, set resume_from" in text, text
    (checkpoint,) = checkpoints(files.base, "ctrl_c")
    losses, _ = final_state(checkpoint)
    assert int(checkpoint.name.split("_")[1]) == len(losses) < 100_000
