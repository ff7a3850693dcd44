"""Files that break naive loaders, made cheaply for tests."""

from __future__ import annotations

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
