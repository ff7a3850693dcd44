"""What a failed write says (issue 44): the system's reason, and the one thing to do for it;
only a full disk is told to make room."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("error", "fix"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "make room"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "make room"),
        (NotADirectoryError(errno.ENOTDIR, "/x/loras is a file"), "make /x/loras a folder again"),
        (OSError(errno.EACCES, "Permission denied"), "give ComfyUI permission to write in /x/loras"),
        (OSError(errno.EROFS, "Read-only file system"), "make /x/loras writable"),
        (OSError(errno.ENAMETOOLONG, "File name too long"), "choose a shorter lora_name"),
        (FileExistsError(errno.EEXIST, "taken"), "move or rename the files of that name in /x/loras"),
        # a library's own error raised while the system's was handled: the number from the chain
        (None, "make room"),
    ],
)
def test_a_failed_write_gets_the_fix_for_its_cause(pack_import, error, fix):
    reports = pack_import("application.run_reports")
    if error is None:
        try:
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("Error while serializing: I/O error (os error 28)")  # noqa: B904
        except RuntimeError as wrapped:
            error = wrapped
    failed = reports.failed_save("LoRA", Path("/x/loras"), 5, error, "x/run/step_000004")
    assert f"the newest complete checkpoint is x/run/step_000004; {fix}" in str(failed), str(failed)
    assert ("make room" in str(failed)) == (fix == "make room")
    assert str(failed).startswith("could not write the LoRA at step 5 to /x/loras: ")
    assert "os error" not in str(failed)  # the system's words, not a library's message

