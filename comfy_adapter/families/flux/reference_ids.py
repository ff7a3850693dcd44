"""The pack's reference ids in ComfyUI's Flux (`position_ids`).

`with_reference_ids(model)` returns a clone of a MODEL whose Flux image ids always come from
our one implementation, for every layout, at inference (stock KSampler) and in training:

1. a DIFFUSION_MODEL wrapper (ComfyUI's patcher mechanism, registered on the clone only) sees
   the target latent `x`, the `ref_latents` and the layout that the conditioning carries as
   `ref_latents_method`, and computes the ids with `image_position_ids`;
2. for that one call it adds a `post_input` patch that swaps ComfyUI's own ids for ours just
   before they enter `forward_orig` (the token count is the same in every layout, and is
   checked). ComfyUI still packs the latents and runs its own Flux.

Without the clone, ComfyUI would silently treat `dreamomni2` (a method name it does not know)
as `offset`. The MODEL itself is never modified.

`forward_token_batch` is the training path for batches whose samples differ in size: it
calls ComfyUI's `forward_orig` with per-sample ids and an attention mask.
"""

from __future__ import annotations

import torch

from .position_ids import TokenGrid, check_layout, image_position_ids, text_position_ids
from .token_batch import FluxTokenBatch, attention_bias

WRAPPER_KEY = "kontext_trainer.reference_ids"


def token_grid(diffusion_model) -> TokenGrid:
    """The patch size, RoPE axes and index step of ComfyUI's Flux (`FluxParams`), and the layout
    ComfyUI samples it with when none is set (`default_ref_method`: `offset` for FLUX.1, `index`
    for FLUX.2): what `auto` means for it."""
    params = diffusion_model.params
    own = getattr(params, "default_ref_method", "offset")
    return TokenGrid(params.patch_size, len(params.axes_dim), float(params.ref_index_scale), own)


def _layout_of(diffusion_model, kwargs) -> str:
    method = kwargs.get("ref_latents_method", diffusion_model.params.default_ref_method)
    return check_layout(method)


def reference_ids_for(diffusion_model, x: torch.Tensor, ref_latents, layout: str) -> torch.Tensor:
    """(B, L, axes) ids for a batch whose samples share the target and reference sizes."""
    ids = image_position_ids(
        tuple(x.shape[-2:]),
        [tuple(r.shape[-2:]) for r in ref_latents or []],
        layout,
        token_grid(diffusion_model),
    )
    return ids.to(x.device)[None].expand(x.shape[0], -1, -1)


def _reference_ids_wrapper(
    executor,
    x,
    timestep,
    context,
    y=None,
    guidance=None,
    ref_latents=None,
    control=None,
    transformer_options=None,
    **kwargs,
):
    diffusion_model = executor.class_obj
    transformer_options = transformer_options or {}
    if not ref_latents:
        return executor(
            x, timestep, context, y, guidance, ref_latents, control, transformer_options, **kwargs
        )
    ours = reference_ids_for(diffusion_model, x, ref_latents, _layout_of(diffusion_model, kwargs))

    def swap_ids(args: dict) -> dict:
        theirs = args["img_ids"]
        if theirs.shape != ours.shape:
            raise RuntimeError(
                f"Kontext Trainer: ComfyUI built {tuple(theirs.shape)} image ids but the "
                f"reference layout gives {tuple(ours.shape)}; is another node changing the "
                "image tokens?"
            )
        return {**args, "img_ids": ours.to(theirs.dtype)}

    patches = dict(transformer_options.get("patches", {}))
    patches["post_input"] = [*patches.get("post_input", []), swap_ids]
    options = {**transformer_options, "patches": patches}
    return executor(x, timestep, context, y, guidance, ref_latents, control, options, **kwargs)


def with_reference_ids(model):
    """A clone of `model` (a ModelPatcher) that feeds Flux our reference ids."""
    import comfy.patcher_extension

    clone = model.clone()
    clone.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    clone.add_wrapper_with_key(
        comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, _reference_ids_wrapper
    )
    return clone


def forward_token_batch(
    diffusion_model,
    batch: FluxTokenBatch,
    timesteps: torch.Tensor,
    context: torch.Tensor,
    y: torch.Tensor | None,
    guidance: torch.Tensor | None,
    transformer_options: dict | None = None,
) -> torch.Tensor:
    """ComfyUI's `forward_orig` on a packed (possibly padded) batch: (B, L, C*p*p) outputs.

    Inputs must already be in the model's dtype and device, as `apply_model` would hand them.
    Only the rows marked `batch.valid` are meaningful.
    """
    txt_ids = text_position_ids(context.shape[0], context.shape[1], batch.ids.shape[-1], context.device)
    mask = attention_bias(batch.valid, context.shape[1], dtype=batch.tokens.dtype)
    return diffusion_model.forward_orig(  # by keyword: ComfyUI 0.33 added a positional parameter
        img=batch.tokens,
        img_ids=batch.ids.to(context.device),
        txt=context,
        txt_ids=txt_ids,
        timesteps=timesteps,
        y=y,
        guidance=guidance,
        control=None,
        transformer_options=transformer_options or {},
        attn_mask=mask,
    )
