"""LoRA names: what the user types becomes one safe file name inside models/loras, or a
message saying why not."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from .atomic import temp_sibling

SUFFIX = ".safetensors"
LOSS_CHART_SUFFIX = "_loss.png"
SNAPSHOT_FOLDER_SUFFIX = "_steps"
MAX_LENGTH = 120  # characters: keeps names readable and paths short on Windows
# Bytes per file or folder name on Linux / macOS file systems (ext4, btrfs, xfs, APFS, ...).
MAX_NAME_BYTES = 255
# The longest preview name: the step is at most 1,000,000 (TrainConfig.steps) and three
# digits of image index are plenty.
LONGEST_PREVIEW = (1_000_000, 999)
# Names Windows reserves for devices, with or without an extension.
RESERVED = {
    "con",
    "prn",
    "aux",
    "nul",
    *(f"com{i}" for i in range(1, 10)),
    *(f"lpt{i}" for i in range(1, 10)),
}
FORBIDDEN = re.compile(r'[<>:"|?*]')
MAX_PATH_BYTES = 4096  # Linux's PATH_MAX: the longest path a folder may have


def invisible(text: str) -> str | None:
    """The first control or format character of `text` ("U+202E"), or None: control characters
    (category Cc: NUL, newline, DEL, ...) break files and logs; format characters (Cf: the
    right-to-left override U+202E, zero-width spaces) make a name show as another in lists."""
    found = next((c for c in text if unicodedata.category(c) in ("Cc", "Cf")), None)
    return None if found is None else f"U+{ord(found):04X}"


def check_name_part(field: str, part: str, typed: str) -> None:
    """The rule every file or folder name the user types must pass (lora_name, each folder of
    cache_folder), with `field` and the value as `typed` in the message: no control or format
    character, none of < > : " | ? *, no surrounding spaces (a name is used as typed or
    refused), no trailing dot, no name Windows reserves. The caller checks the length in bytes
    (a LoRA's stem with the longest name the trainer writes from it)."""
    code = invisible(part)
    if code is not None:
        raise ValueError(
            f"{field} {typed!r} contains an invisible control or format character ({code}); retype it"
        )
    if FORBIDDEN.search(part):
        raise ValueError(f"{field} '{typed}' contains one of < > : \" | ? *; remove it")
    if part != part.strip():
        raise ValueError(f"{field} '{typed}' starts or ends with a space; remove the space")
    if part.endswith("."):
        raise ValueError(f"{field} '{typed}' has a name ending in a dot ('{part}'); rename it")
    if part.split(".")[0].lower() in RESERVED:
        raise ValueError(
            f"{field} '{typed}' uses '{part}', a reserved device name on Windows; choose another"
        )


def check_folder_path(field: str, typed: str) -> None:
    """A folder the user types (cache_folder): every name in it passes `check_name_part` (the
    rule lora_name passes), and the whole path fits a file system's path limit, checked
    before anything is written."""
    if len(typed.encode("utf-8")) > MAX_PATH_BYTES:
        raise ValueError(
            f"{field} is {len(typed.encode('utf-8'))} bytes long; paths may have {MAX_PATH_BYTES}; shorten it"
        )
    if not typed.strip():
        raise ValueError(f"{field} is only spaces; leave it empty for the default folder, or give a name")
    for part in Path(typed).parts:
        if part in ("/", ".", "..") or part.startswith("~"):
            continue
        check_name_part(field, part, typed)
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise ValueError(
                f"{field}: the name '{part[:40]}...' is {len(part.encode('utf-8'))} bytes in UTF-8; file "
                f"systems allow {MAX_NAME_BYTES} per name; shorten it"
            )


def preview_name(stem: str, step: int, index: int) -> str:
    """A preview image in ComfyUI's temp folder."""
    return f"{stem}_step{step:06d}_{index}.png"


def snapshot_folder_name(stem: str) -> str:
    """The folder in models/loras that holds a LoRA's per-step snapshots."""
    return f"{stem}{SNAPSHOT_FOLDER_SUFFIX}"


def snapshot_name(stem: str, step: int) -> str:
    """The LoRA as it was at `step` (kohya's `<name>-step<8 digits>` pattern)."""
    return f"{stem}-step{step:08d}{SUFFIX}"


def written_names(stem: str) -> list[str]:
    """Every file or folder name the pack writes for a LoRA stem: the LoRA and its loss chart
    in models/loras, its snapshot folder and the longest snapshot name, their atomic temp
    siblings, the checkpoint folder (output/kontext_trainer_checkpoints/<stem>/) and the
    longest preview image name."""
    finals = [f"{stem}{SUFFIX}", f"{stem}{LOSS_CHART_SUFFIX}", snapshot_name(stem, LONGEST_PREVIEW[0])]
    return [
        *finals,
        *(temp_sibling(Path(name)).name for name in finals),
        stem,
        snapshot_folder_name(stem),
        preview_name(stem, *LONGEST_PREVIEW),
    ]


def _check_name_bytes(stem: str) -> None:
    stem_bytes = len(stem.encode("utf-8"))
    longest = max(written_names(stem), key=lambda n: len(n.encode("utf-8")))
    size = len(longest.encode("utf-8"))
    if size > MAX_NAME_BYTES:
        pattern = longest.replace(stem, "<name>", 1)
        raise ValueError(
            f"lora_name is {stem_bytes} bytes in UTF-8 ({len(stem)} characters); the trainer would "
            f"write '{pattern}', {size} bytes, and file systems allow {MAX_NAME_BYTES} bytes per "
            f"file name. Use a shorter lora_name: at most {MAX_NAME_BYTES - size + stem_bytes} bytes "
            "(ASCII letters are 1 byte each, most CJK characters 3)"
        )


def lora_stem(name: str) -> str:
    """The file stem for a LoRA name (`.safetensors` added by the caller). Refuses separators,
    `..`, absolute paths, reserved device names, characters other systems forbid, hidden
    files and overlong names (in characters, and in bytes of every name written), each with
    a message."""
    stem = name
    if stem.lower().endswith(SUFFIX):
        stem = stem[: -len(SUFFIX)]
    if not stem.strip():
        raise ValueError("lora_name is empty; give the LoRA a name such as my_edit_lora")
    if "/" in stem or "\\" in stem or stem.startswith("~"):
        raise ValueError(
            f"lora_name '{name}' contains a path; give a plain name: LoRAs are always saved in models/loras"
        )
    if ".." in stem:
        raise ValueError(f"lora_name '{name}' contains '..'; give a plain name")
    if stem.startswith("."):
        raise ValueError(f"lora_name '{name}' starts with a dot (a hidden file); rename it")
    check_name_part("lora_name", stem, name)
    if len(stem) > MAX_LENGTH:
        raise ValueError(f"lora_name is {len(stem)} characters; keep it under {MAX_LENGTH}")
    _check_name_bytes(stem)
    return stem
