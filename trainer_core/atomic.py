"""Atomic writes that respect the user's umask.

A file is written to a hidden temp sibling (`.<name>.<random>.partial`), flushed and renamed
over its destination, so a crash leaves either the old file or the new one, never half of one.
`tempfile.mkstemp` / `mkdtemp` would create the temp with mode 0600 / 0700 whatever the umask;
here files are created with 0666 and folders with 0777 and the kernel applies the umask, so
the results get the same permissions as ComfyUI's own outputs (0644 / 0755 under umask 022).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL = ".partial"


def temp_sibling(path: Path) -> Path:
    """An unused hidden temp name beside `path` (never visible under a real name)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}{PARTIAL}")


def new_temp_file(path: Path) -> Path:
    """Create (exclusively) an empty temp file beside `path`, mode 0666 minus the umask."""
    while True:
        candidate = temp_sibling(path)
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return candidate
        except FileExistsError:
            continue


def new_temp_folder(path: Path) -> Path:
    """Create an empty temp folder beside `path`, mode 0777 minus the umask."""
    while True:
        candidate = temp_sibling(path)
        try:
            candidate.mkdir(mode=0o777)
            return candidate
        except FileExistsError:
            continue


def fsync_file(path: Path) -> None:
    # opened for writing: Windows' FlushFileBuffers refuses a read-only handle
    fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_new(tmp: Path, path: Path) -> None:
    """Give `tmp` the name `path` only if no file has it, atomically (a hard link fails on an
    existing name: no check-then-rename race); FileExistsError otherwise. A file system
    without hard links gets the check and the rename."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some network and FAT file systems)
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


@contextmanager
def replacing(path: Path, replace: bool = True) -> Iterator[Path]:
    """`with replacing(dest) as tmp: write(tmp)`: on success `tmp` is flushed and renamed over
    `dest` (with `replace` off: only if `dest` does not exist by then, else FileExistsError);
    on any error it is removed and `dest` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_file(path)
    mode = stat.S_IMODE(tmp.stat().st_mode)  # 0666 minus the umask, as the kernel made it
    try:
        yield tmp
        os.chmod(tmp, mode)  # some writers (safetensors) replace the file with a 0600 one
        fsync_file(tmp)
        if replace:
            os.replace(tmp, path)
        else:
            publish_new(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, write: Callable[[Path], object], replace: bool = True) -> Path:
    """Write `path` whole or not at all with `write(temp_path)` (`replace`: see `replacing`)."""
    with replacing(path, replace) as tmp:
        write(tmp)
    return Path(path)
