"""Encoder fingerprints are cache keys: the shared implementation must give byte for byte the
digests of the two it replaced (`dataset.identity_of` and `comfy_encoders._patch_fingerprint`,
re-typed below from the code before the merge), or every existing encode cache would miss."""

from __future__ import annotations

import hashlib

import torch

from trainer_core.fingerprint import feed_structure, sampled_values, structure_digest, weights_identity


def old_identity_of(named_tensors, extra=""):
    digest = hashlib.sha256(repr(extra).encode())
    for name, tensor in named_tensors:
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 64)
        sample = flat[::step][:64].float().cpu().numpy().tobytes()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(sample)
    return digest.hexdigest()[:32]


def old_patch_fingerprint(value, digest):
    if torch.is_tensor(value):
        flat = value.detach().reshape(-1)
        digest.update(f"{tuple(value.shape)}{value.dtype}".encode())
        digest.update(flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            old_patch_fingerprint(value[key], digest)
    elif isinstance(value, (list, tuple)):
        for item in value:
            old_patch_fingerprint(item, digest)
    elif hasattr(value, "weights"):
        digest.update(type(value).__name__.encode())
        old_patch_fingerprint(value.weights, digest)
    else:
        digest.update(
            repr(value if isinstance(value, (int, float, str, bool, type(None))) else type(value)).encode()
        )


def old_clip_extra(patches) -> tuple[str, str]:
    digest = hashlib.sha256()
    old_patch_fingerprint(patches, digest)
    return ("clip", digest.hexdigest())


class LoRAAdapter:  # the shape of a comfy.weight_adapter adapter: a `weights` tuple
    def __init__(self, weights):
        self.weights = weights


def named_tensors():
    return [
        ("a.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),  # fewer than 64 values
        ("b.bias", torch.linspace(-1, 1, 200).to(torch.bfloat16)),  # strided: every 3rd, first 64
        ("c.count", torch.tensor(7)),  # 0-d, integer
        ("d.fp8", torch.linspace(-4, 4, 1000).to(torch.float8_e4m3fn).reshape(10, 100)),
        ("e.empty", torch.zeros(0, 3, dtype=torch.float16)),
    ]


def patches():
    """A CLIP patcher's `patches`: key -> list of (strength, adapter or tensors, ...) tuples."""
    return {
        "k2.weight": [(1.0, torch.ones(2, 3)), "x", None, True, 3],
        "k1.weight": [(0.5, LoRAAdapter((torch.arange(100.0).reshape(10, 10), 0.5)), object())],
        ("tuple", "key"): {"nested": torch.full((70,), 2.0, dtype=torch.float16)},
    }


def test_weights_identity_is_the_old_identity_of():
    extra = ("vae", "torch.bfloat16")
    assert weights_identity(named_tensors(), extra) == old_identity_of(named_tensors(), extra)
    assert weights_identity(named_tensors()) == old_identity_of(named_tensors())
    assert weights_identity([]) == old_identity_of([])


def test_structure_digest_is_the_old_patch_fingerprint():
    digest = hashlib.sha256()
    old_patch_fingerprint(patches(), digest)
    assert structure_digest(patches()) == digest.hexdigest()
    assert structure_digest({}) == hashlib.sha256().hexdigest()  # no patches: nothing fed


def test_clip_identity_composition_is_unchanged():
    """comfy_adapter.comfy_encoders.clip_identity: the weights' identity with the patches' digest."""
    ours = weights_identity(named_tensors(), extra=("clip", structure_digest(patches())))
    assert ours == old_identity_of(named_tensors(), extra=old_clip_extra(patches()))


def test_digests_pinned_before_the_merge():
    """Computed once with the code before the merge (git bdaeb6e): guards against this test's
    re-typed copies drifting along with the implementation."""
    small = named_tensors()[:3]
    assert weights_identity(small, extra=("vae", "torch.bfloat16")) == "444d74fceaf6dff43ed4b8de4e3f5d1b"
    structure = {
        "k2": [(1.0, torch.ones(2, 3)), "x", None, True, 3],
        "k1": (LoRAAdapter((torch.arange(100.0).reshape(10, 10), 0.5)), object()),
    }
    assert structure_digest(structure) == "837309b2caaa2a98927cb24a0276e21890c34fe4f73ca751127ca22b355ebd5b"


def test_the_sample_is_at_most_64_strided_values_as_float32():
    values = torch.arange(200, dtype=torch.int32)
    assert sampled_values(values) == torch.arange(0, 192, 3, dtype=torch.float32).numpy().tobytes()
    assert sampled_values(torch.tensor([1.5, 2.5], dtype=torch.bfloat16)) == (
        torch.tensor([1.5, 2.5]).numpy().tobytes()
    )


def test_fingerprints_follow_values_names_dtypes_and_strengths():
    base = weights_identity(named_tensors())
    changed = named_tensors()
    changed[1] = ("b.bias", changed[1][1] + 1)
    assert weights_identity(changed) != base
    assert (
        weights_identity([("renamed", t) if n == "a.weight" else (n, t) for n, t in named_tensors()]) != base
    )
    assert weights_identity([(n, t.double()) for n, t in named_tensors()[:2]]) != weights_identity(
        named_tensors()[:2]
    )
    stronger = patches()
    stronger["k2.weight"][0] = (2.0, torch.ones(2, 3))
    assert structure_digest(stronger) != structure_digest(patches())


def test_feed_structure_feeds_the_given_digest():
    digest = hashlib.sha256(b"prefix")
    feed_structure([1, "a"], digest)
    expected = hashlib.sha256(b"prefix")
    expected.update(b"1")
    expected.update(b"'a'")
    assert digest.hexdigest() == expected.hexdigest()


def test_a_weight_on_meta_counts_as_the_zeros_comfyui_computes_with():
    """ComfyUI 0.33 under dynamic VRAM leaves a weight its file lacks on `meta` (values made
    zeros at first use); the first H200 run of the command stopped on it ("Cannot copy out of
    meta tensor"). Its fingerprint is that of the zeros, whatever the shape's stride."""
    for shape in [(3,), (7, 5), (1000, 77)]:
        meta = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        zeros = torch.zeros(shape, dtype=torch.bfloat16)
        assert sampled_values(meta) == sampled_values(zeros)
        assert weights_identity([("w", meta)]) == weights_identity([("w", zeros)])
    ones = weights_identity([("w", torch.ones(4, 4))])
    assert weights_identity([("w", torch.empty(4, 4, device="meta"))]) != ones
