"""LoRA names: what the user types becomes one safe file name inside models/loras, or a
message saying why not."""

from __future__ import annotations

import re

SUFFIX = ".safetensors"
MAX_LENGTH = 120
# Names Windows reserves for devices, with or without an extension.
RESERVED = {
    "con",
    "prn",
    "aux",
    "nul",
    *(f"com{i}" for i in range(1, 10)),
    *(f"lpt{i}" for i in range(1, 10)),
}
FORBIDDEN = re.compile(r'[<>:"|?*\x00-\x1f]')


def lora_stem(name: str) -> str:
    """The file stem for a LoRA name (`.safetensors` added by the caller). Refuses separators,
    `..`, absolute paths, reserved device names, characters other systems forbid, hidden
    files and overlong names, each with a message."""
    stem = name.strip()
    if stem.lower().endswith(SUFFIX):
        stem = stem[: -len(SUFFIX)]
    if not stem:
        raise ValueError("lora_name is empty; give the LoRA a name such as my_edit_lora")
    if "/" in stem or "\\" in stem or stem.startswith("~"):
        raise ValueError(
            f"lora_name '{name}' contains a path; give a plain name: LoRAs are always saved in models/loras"
        )
    if ".." in stem:
        raise ValueError(f"lora_name '{name}' contains '..'; give a plain name")
    if FORBIDDEN.search(stem):
        raise ValueError(f"lora_name '{name}' contains one of < > : \" | ? * or a control character")
    if stem.startswith(".") or stem.endswith((".", " ")):
        raise ValueError(f"lora_name '{name}' starts with a dot or ends with a dot or space; rename it")
    if stem.split(".")[0].lower() in RESERVED:
        raise ValueError(f"lora_name '{name}' is a reserved device name on Windows; choose another")
    if len(stem) > MAX_LENGTH:
        raise ValueError(f"lora_name is {len(stem)} characters; keep it under {MAX_LENGTH}")
    return stem
