"""A failed write in the user's words: the operating system's reason and the one thing to do.

The pack writes every file through Python's own file objects (`atomic.write_atomic`; a
safetensors file is serialized to bytes first, `lora_file.save_atomic`), so a failed write is an
OSError carrying the system's error number, whatever a library's message says. The number
decides the advice; no message is parsed.
"""

from __future__ import annotations

import errno
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)


class WriteFailed(OSError):
    """A file of the pack could not be written: one line naming what, where, why, what is safe
    and what to do (`failure_line`). Keeps the system's error number (`errno`) of the write that
    failed."""

    def __init__(self, message: str, cause: OSError | None = None):
        super().__init__(cause.errno if cause is not None else None, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def os_error(error: BaseException) -> OSError | None:
    """The OSError with a system error number in `error`'s chain (itself, its cause or the error
    it happened in), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error
        error = error.__cause__ or error.__context__
    return None


def write_errno(error: BaseException) -> int | None:
    """The system's error number of a failed write, or None."""
    found = os_error(error)
    return found.errno if found is not None else None


def write_problem(error: BaseException) -> str:
    """Why a write failed, in the operating system's words ("No space left on device")."""
    found = os_error(error)
    if found is not None and found.strerror:
        return found.strerror
    return str(error) or type(error).__name__


def remedy(error: BaseException, where: Path) -> str:
    """The one thing to do about a failed write, by its cause: only a full disk is "make room"."""
    code = write_errno(error)
    if code in FULL:
        return "make room"
    if code == errno.ENOTDIR:
        return f"make {where} a folder again (or point ComfyUI at one)"
    if code == errno.EEXIST:  # every free name taken (`save_lora`)
        return f"move or rename the files of that name in {where}"
    if code in (errno.EACCES, errno.EPERM):
        return f"give ComfyUI permission to write in {where}"
    if code == errno.EROFS:
        return f"make {where} writable (it is on a read-only file system)"
    if code == errno.ENAMETOOLONG:
        return "choose a shorter lora_name"
    if code == errno.ENOENT:
        return f"make {where} again"
    if code == errno.EIO:
        return f"check the disk of {where} (it reported an input/output error)"
    return "fix that"


def failure_line(what: str, where: Path, error: BaseException, safe: str) -> str:
    """The one line for a write of `what` into `where` that failed with `error`: the system's
    reason, then `safe` (what is kept and how to go on, with `remedy`'s advice in it)."""
    return f"could not write {what} to {where}: {write_problem(error)}; {safe}"
