"""Content-addressed cache of encoder outputs (VAE latents, text embeddings) as safetensors.

A key is a hash of everything that determines the output: for an image, the file's bytes,
the size rule's result and the VAE's identity; for a caption, its text and the text
encoder's identity. Changing any of them changes the key, so exactly the affected entries
miss; nothing is ever invalidated by time stamps. Writes are atomic.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open

from .lora_file import load, save_atomic
from .write_errors import WriteFailed, failure_line, os_error, remedy

# Bump when the image pipeline (decode, conversions, resize) changes what is encoded.
IMAGE_RULE_VERSION = "image-v1"
KINDS = ("latents", "text")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_key(*parts: object) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


class EncodeCache:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.hits = 0
        self.misses = 0

    def path(self, kind: str, key: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"unknown cache kind {kind!r}")
        return self.root / kind / key[:2] / f"{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        """Whether the entry exists; counted as a hit or a miss."""
        found = self.path(kind, key).is_file()
        if found:
            self.hits += 1
        else:
            self.misses += 1
        return found

    def put(self, kind: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        state = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
        try:
            save_atomic(state, self.path(kind, key))
        except OSError as error:  # whole entries only: the ones written stay valid
            safe = (
                f"nothing was trained yet and the encodings written so far are kept; "
                f"{remedy(error, self.root)} (or choose another cache_folder), then run again"
            )
            line = failure_line("the dataset's encodings", self.root, error, safe)
            raise WriteFailed(line, os_error(error)) from None

    def shape(self, kind: str, key: str, name: str) -> tuple[int, ...]:
        """A cached tensor's shape, from the file's header (nothing loaded)."""
        with safe_open(str(self.path(kind, key)), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def load(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        """An entry that must exist (the dataset was built); a clear error if it was deleted."""
        path = self.path(kind, key)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: a cached encoding is gone (was the cache folder cleared?); change any input of "
                "LoadKontextDataset or touch a file of the dataset so ComfyUI runs it again and re-encodes"
            )
        return load(path)[0]
