"""Spies for tests: what reaches ComfyUI's Flux, read off the model instance."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def captured_image_ids(diffusion_model):
    """Collect the image ids Flux really embeds, one (B, L_img, 3) tensor per model call.

    `pe_embedder` receives cat(txt_ids, img_ids) inside `forward_orig`, after any post_input
    patch; the text length comes from the input of `txt_in`, which runs just before.
    """
    calls: list[torch.Tensor] = []
    text_length = []

    def remember_text_length(module, args):
        text_length.append(args[0].shape[1])

    def record(module, args):
        calls.append(args[0][:, text_length[-1] :].detach().clone())

    handles = [
        diffusion_model.txt_in.register_forward_pre_hook(remember_text_length),
        diffusion_model.pe_embedder.register_forward_pre_hook(record),
    ]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
