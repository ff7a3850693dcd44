"""A real small file system for the disk-full tests: a tmpfs mounted over a folder, so the
pack's writes there fail as they fail on a user's full disk (the kernel's ENOSPC, through
whatever library the pack writes with). Mounting needs root (or CAP_SYS_ADMIN): elsewhere the
test is skipped and says why."""

from __future__ import annotations

import errno
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(folder: Path, size: str = "1m") -> Iterator[Path]:
    """`folder` (made if missing; what it held is hidden while mounted) on a tmpfs of `size`
    bytes, unmounted afterwards."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("no mount command here: a real full file system cannot be made")
    made = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


FILLER = ".kt_test_filler"


def fill(folder: Path) -> None:
    """Leave no room on the file system of `folder` (a filler file, FILLER, in it)."""
    fill_up(Path(folder) / FILLER)


def fill_up(filler: Path) -> None:
    """Write `filler` until its file system has no room left (the error that ends it is the
    kernel's ENOSPC)."""
    chunk = b"\0" * 4096
    with open(filler, "ab", buffering=0) as handle:  # unbuffered: nothing left to flush at close
        try:
            while True:
                handle.write(chunk)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
