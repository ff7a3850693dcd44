"""The machine's test lanes (`scripts/lanes.sh`, sourced by `scripts/test.sh`): a second copy of
the suite waits for a lane instead of running the machine out of memory. Each test sources the
script in bash, with lanes of its own (its own TMPDIR, so a suite running around it holds none
of them)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bash(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), **env}
    return subprocess.run(
        ["bash", "-c", f"source {REPO / 'scripts' / 'lanes.sh'}\n{script}"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_three_runs_on_two_lanes_never_overlap_three_deep(tmp_path):
    """Each run records when it started and ended; at no moment do three overlap, and the one
    that found both lanes busy said so (its label and the count)."""
    script = """
        run() { date +%s.%N > "$TMPDIR/$1.start"; sleep 1.5; date +%s.%N > "$TMPDIR/$1.end"; }
        with_lane first run a & with_lane second run b & with_lane third run c &
        wait
    """
    result = bash(script, tmp_path, KT_TEST_LANES="2")
    assert result.returncode == 0, result.stderr
    spans = [
        (float((tmp_path / f"{n}.start").read_text()), float((tmp_path / f"{n}.end").read_text()))
        for n in "abc"
    ]
    deepest = max(sum(start <= moment < end for start, end in spans) for moment, _ in spans)
    assert deepest == 2, spans
    assert "waits for a lane: all 2 of this machine's are busy" in result.stdout
    assert "came free after" in result.stdout


def test_a_lane_is_held_while_a_process_the_run_started_lives(tmp_path):
    """A run that leaves a process behind with the lane's descriptor (a shell's background job)
    keeps its lane until that process ends: its memory is still in use. One lane: the second run
    starts after it."""
    script = """
        with_lane first bash -c 'sleep 2 & exit 0'
        date +%s.%N > "$TMPDIR/first-returned"
        with_lane second bash -c 'date +%s.%N > "$TMPDIR/second-started"'
    """
    started = time.time()
    result = bash(script, tmp_path, KT_TEST_LANES="1")
    assert result.returncode == 0, result.stderr
    returned = float((tmp_path / "first-returned").read_text())
    second = float((tmp_path / "second-started").read_text())
    assert returned - started < 1.5  # the first run itself returned at once
    assert second - started >= 2.0, (returned - started, second - started)
    assert "second waits for a lane: all 1 of this machine's are busy" in result.stdout


def test_the_default_count_is_the_memory_in_lanes_of_five_and_a_half_gib(tmp_path):
    kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    result = bash("lane_count", tmp_path)
    assert int(result.stdout) == max(1, kib // (5632 * 1024))
    assert bash("lane_count", tmp_path, KT_TEST_LANES="7").stdout.strip() == "7"
