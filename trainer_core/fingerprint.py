"""Cheap fingerprints of encoder weights and of weight patches, part of every encode-cache key.

A tensor is fingerprinted by its shape, dtype and a strided sample of at most 64 of its values
(hashing billions of T5 weights in full would take minutes). The two spellings below
(`weights_identity` and `feed_structure`) predate this module and are kept byte for byte: a
change would change every cache key and orphan the caches users already have.
"""

from __future__ import annotations

import hashlib

import torch

SAMPLED_VALUES = 64


def sampled_values(tensor: torch.Tensor) -> bytes:
    """At most 64 values, evenly strided over the flattened tensor, as float32 bytes. A tensor on
    `meta` has no values: it counts as zeros, what ComfyUI computes with. (ComfyUI 0.33 with
    dynamic VRAM builds its layers on `meta` and loads the file's weights into them; a weight the
    file lacks, e.g. the text projection many CLIP-L files leave out, stays on `meta` until its
    first forward makes it zeros: `comfy.ops.materialize_meta_param`.)"""
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLED_VALUES)
    sample = flat[::step][:SAMPLED_VALUES]
    if sample.device.type == "meta":
        sample = torch.zeros(sample.shape)
    return sample.float().cpu().numpy().tobytes()


def weights_identity(named_tensors, extra: object = "") -> str:
    """32 hex digits over `extra` and, per (name, tensor), the name, shape, dtype and sampled
    values: changes when an encoder's weights (or what `extra` names) change."""
    digest = hashlib.sha256(repr(extra).encode())
    for name, tensor in named_tensors:
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(sampled_values(tensor))
    return digest.hexdigest()[:32]


def feed_structure(value, digest) -> None:
    """Feed a patch structure (tuples, lists, dicts, tensors, adapter objects with `weights`)
    into `digest`: tensors by shape, dtype and sampled values; dicts in key order; plain
    scalars and strings by `repr`; any other object by its type only."""
    if torch.is_tensor(value):
        digest.update(f"{tuple(value.shape)}{value.dtype}".encode())
        digest.update(sampled_values(value))
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            feed_structure(value[key], digest)
    elif isinstance(value, (list, tuple)):
        for item in value:
            feed_structure(item, digest)
    elif hasattr(value, "weights"):  # e.g. comfy.weight_adapter adapters
        digest.update(type(value).__name__.encode())
        feed_structure(value.weights, digest)
    else:
        digest.update(
            repr(value if isinstance(value, (int, float, str, bool, type(None))) else type(value)).encode()
        )


def structure_digest(value) -> str:
    """The full sha256 hex digest of `feed_structure(value)`."""
    digest = hashlib.sha256()
    feed_structure(value, digest)
    return digest.hexdigest()
