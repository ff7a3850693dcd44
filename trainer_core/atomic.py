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
TRIES = 100  # fresh random temp names to try (a clash of 48 random bits is already rare)


class NameTaken(FileExistsError):
    """`publish_new`: a file took the name first (the one error that means "try another name")."""


def ensure_folder(folder: Path) -> None:
    """`folder` exists as a folder (made with its parents if missing). Where a file, or a link
    to a missing place, stands in its way: NotADirectoryError naming it (mkdir's own
    FileExistsError would read as "the name is taken")."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        blocker = blocking_path(folder) or folder
        raise NotADirectoryError(errno.ENOTDIR, f"{blocker} {what_is_there(blocker)}", str(folder)) from None


def blocking_path(folder: Path) -> Path | None:
    """The first of `folder` and its parents that is there but no folder (a file, a link to a
    missing place, a pipe), or None."""
    return next((p for p in (folder, *folder.parents) if os.path.lexists(p) and not p.is_dir()), None)


def what_is_there(path: Path) -> str:
    """What stands at `path` where a folder should be, in words."""
    if path.is_symlink() and not path.exists():
        return f"is a link to a missing place ({os.readlink(path)})"
    if path.is_file():
        return "is a file, not a folder"
    return f"is {special_kind(path) or 'not a folder'}"


PROBE_NAME = "write_test"  # folder_problem's probe: `.write_test.<hex>.partial` while it exists


def folder_problem(folder: Path, create: bool = True) -> str | None:
    """None where `folder` is a folder that takes a file (made first if missing and `create`;
    without `create` its nearest existing parent must take one); else what is wrong, in
    words naming the path ("/x/models/loras is a file, not a folder"). The probe is a temp
    file, removed at once."""
    folder = Path(folder)
    blocker = blocking_path(folder)
    if blocker is not None:
        return f"{blocker} {what_is_there(blocker)}"
    probe_in = folder
    if not folder.is_dir():
        if create:
            try:
                ensure_folder(folder)
            except OSError as error:
                return f"{folder} cannot be made: {error.strerror or error}"
        else:
            probe_in = next(p for p in folder.parents if p.is_dir())
    try:
        # (missing_ok: a starting run tidies probes a killed process left: `PROBE_NAME`)
        new_temp_file(probe_in / PROBE_NAME).unlink(missing_ok=True)
    except OSError as error:
        return f"{probe_in} does not take files: {error.strerror or error}"
    return None


def special_kind(path: Path) -> str | None:
    """'a named pipe (FIFO)', 'a device file', 'a socket', or None for files, folders and
    missing paths."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def temp_sibling(path: Path) -> Path:
    """An unused hidden temp name beside `path` (never visible under a real name)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}{PARTIAL}")


def new_temp_file(path: Path) -> Path:
    """Create (exclusively) an empty temp file beside `path`, mode 0666 minus the umask."""
    for _ in range(TRIES):
        candidate = temp_sibling(path)
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temp name beside it after {TRIES} tries", str(path))


def new_temp_folder(path: Path) -> Path:
    """Create an empty temp folder beside `path`, mode 0777 minus the umask."""
    for _ in range(TRIES):
        candidate = temp_sibling(path)
        try:
            candidate.mkdir(mode=0o777)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temp name beside it after {TRIES} tries", str(path))


def fsync_file(path: Path) -> None:
    # opened for writing: Windows' FlushFileBuffers refuses a read-only handle
    fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_new(tmp: Path, path: Path) -> None:
    """Give `tmp` the name `path` only if no file has it, atomically (a hard link fails on an
    existing name: no check-then-rename race); NameTaken otherwise. A file system without hard
    links gets the check and the rename."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise NameTaken(errno.EEXIST, "a file has this name", str(path)) from None
    except OSError:  # no hard links here (some network and FAT file systems)
        if os.path.lexists(path):
            raise NameTaken(errno.EEXIST, "a file has this name", str(path)) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


@contextmanager
def replacing(path: Path, replace: bool = True) -> Iterator[Path]:
    """`with replacing(dest) as tmp: write(tmp)`: on success `tmp` is flushed and renamed over
    `dest` (with `replace` off: only if `dest` does not exist by then, else NameTaken); on any
    error it is removed and `dest` is left as it was. A file or a dangling link where the
    folder should be is NotADirectoryError, never a name clash."""
    path = Path(path)
    ensure_folder(path.parent)
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
