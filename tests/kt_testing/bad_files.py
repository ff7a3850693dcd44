"""Files that break naive loaders, made cheaply for tests."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_huge_png(path: Path, width: int, height: int) -> Path:
    """A valid black-and-white PNG of `width` x `height` pixels, all black, a few KB on disk:
    what a decompression bomb looks like (PIL refuses to open one over ~179 megapixels)."""
    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + 1 bit per pixel
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit grayscale
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")
    )
    return path


BREAK_FOLDER_ENV = "KT_TEST_BREAK_FOLDER"  # "<after_writes>:<file|dangling link>" for the command
BREAK_KINDS = ("file", "dangling link")


def break_folder(folder: Path, kind: str) -> Path:
    """Move `folder` aside (to `<folder>.kt_moved`, returned) and put a plain file, or a link to a
    missing place, where it was: a folder that went away as a drive that is not mounted does."""
    folder = Path(folder)
    aside = folder.with_name(folder.name + ".kt_moved")
    folder.rename(aside)
    if kind == "file":
        folder.write_text("a file where the folder was\n", encoding="utf-8")
    elif kind == "dangling link":
        folder.symlink_to(folder.with_name("kt_unmounted_drive") / folder.name)
    else:
        raise ValueError(f"kind: one of {BREAK_KINDS}; got {kind!r}")
    return aside


def restore_folder(folder: Path) -> None:
    """Undo `break_folder` (nothing to do where it did not run)."""
    folder = Path(folder)
    aside = folder.with_name(folder.name + ".kt_moved")
    if aside.is_dir():
        if os.path.lexists(folder):
            folder.unlink()
        aside.rename(folder)


def break_folder_after_writes(lora_file, folder: Path, after_writes: int, kind: str) -> None:
    """Once the pack has written `after_writes` more safetensors files through `lora_file` (its
    `trainer_core.lora_file` module: LoRAs, snapshots, checkpoint parts), `break_folder(folder)`,
    once; 0 breaks it now. The hook removes itself when it has acted."""
    if after_writes <= 0:
        break_folder(folder, kind)
        return
    original = lora_file.write_atomic  # what save_atomic writes its bytes with
    writes = []

    def write_atomic(*args, **kwargs):
        result = original(*args, **kwargs)
        writes.append(1)
        if len(writes) == after_writes:
            lora_file.write_atomic = original
            break_folder(folder, kind)
        return result

    lora_file.write_atomic = write_atomic
