"""FLUX's position ids and token batch as ComfyUI loaded the pack (`comfy_adapter/families/flux/`:
`position_ids`, `token_batch`), looked up when a test calls them (ComfyUI is booted by then: a
test using these needs the `comfy_runtime` fixture)."""

from __future__ import annotations

from kt_testing.comfy_runtime import LazyPackModule

position_ids = LazyPackModule("comfy_adapter.families.flux.position_ids")
token_batch = LazyPackModule("comfy_adapter.families.flux.token_batch")

# the layouts ComfyUI's Flux knows by name (its `ref_latents_method`) in every supported version
COMFY_NATIVE_LAYOUTS = ("offset", "index", "uxo")


def TokenGrid(*args, **kwargs):  # the pack's class
    return position_ids.TokenGrid(*args, **kwargs)


def flux2_grid():
    """FLUX.2's grid as ComfyUI's detection gives it: 1x1 patches, 4 axes, index steps of 10."""
    return TokenGrid(patch_size=1, axes=4, ref_index_scale=10.0)


def image_position_ids(*args, **kwargs):
    return position_ids.image_position_ids(*args, **kwargs)


def text_position_ids(*args, **kwargs):
    return position_ids.text_position_ids(*args, **kwargs)


def build_token_batch(*args, **kwargs):
    return token_batch.build_token_batch(*args, **kwargs)


def attention_bias(*args, **kwargs):
    return token_batch.attention_bias(*args, **kwargs)
