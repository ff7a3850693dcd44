"""Fixed, seeded inputs for the tiny Flux: training samples, and a MODEL's sampling-time
output on a fixed input (what ComfyUI's `apply_model` returns after a normal load)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def tiny_samples(
    Sample,
    count: int,
    seed: int,
    reference_sizes: Sequence[tuple[int, int]] = (),
    dtype: torch.dtype = torch.float32,
    target: tuple[int, int] = (8, 8),
    channels: int = 16,
    pooled: int = 32,
) -> list:
    """`count` samples for the tiny Flux (16 latent channels, 5x48 text, pooled 32; the tiny
    FLUX.2 takes channels=128, pooled=0); per sample the draws are target, context, pooled,
    then each reference."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return [
        Sample(
            randn(channels, *target),
            randn(5, 48),
            randn(pooled),
            [randn(channels, *size) for size in reference_sizes],
        )
        for _ in range(count)
    ]


def model_output(
    model,
    seed: int = 0,
    sigma: float = 0.5,
    references: Sequence[tuple[int, int]] = (),
    text: tuple[int, int] = (5, 48),
    pooled: int = 32,
    transformer_options: dict | None = None,
    channels: int = 16,
    frames: int | None = None,
) -> torch.Tensor:
    """Load `model` the normal way, then ComfyUI's `apply_model` on a fixed input (draws: the
    latent, each reference, the context, the pooled vector) with the patcher's options.
    FLUX.2: channels=128, pooled=0 (no pooled vector). Qwen-Image: frames=1 (5-D latents, no
    guidance input), pooled=0."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])
    gen = torch.Generator().manual_seed(seed)
    lead = (channels,) if frames is None else (channels, frames)
    x = torch.randn(1, *lead, 8, 8, generator=gen)
    refs = [torch.randn(1, *lead, *size, generator=gen) for size in references]
    cond = {"c_crossattn": torch.randn(1, *text, generator=gen)}
    if frames is None:
        cond["guidance"] = torch.tensor([1.0])
    if pooled:
        cond["y"] = torch.randn(1, pooled, generator=gen)
    if refs:
        cond["ref_latents"] = refs
    options = (
        transformer_options if transformer_options is not None else model.model_options["transformer_options"]
    )
    with torch.no_grad():
        return model.model.apply_model(x, torch.tensor([sigma]), transformer_options=options, **cond)


def output_on_its_device(model, seed: int = 0, sigma: float = 0.5) -> torch.Tensor:
    """`model_output` for any FLUX.1 (the tiny one, the demo's, a user's): the input sizes read
    off the model, the inputs on the model's load device (a GPU where it runs on one)."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])
    params = model.model.diffusion_model.params
    device = model.load_device
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, params.in_channels, 16, 16, generator=gen)
    cond = {
        "c_crossattn": torch.randn(1, 16, params.context_in_dim, generator=gen).to(device),
        "y": torch.randn(1, params.vec_in_dim, generator=gen).to(device),
        "guidance": torch.tensor([1.0], device=device),
    }
    options = model.model_options["transformer_options"]
    with torch.no_grad():
        out = model.model.apply_model(
            x.to(device), torch.tensor([sigma], device=device), transformer_options=options, **cond
        )
    return out.float().cpu()


def flux2_inputs(target, refs, seed=0, text=7) -> dict:
    """Seeded inputs for the tiny FLUX.2's own forward: a (1, 128, *target) latent, its
    references, timestep 0.6, a (1, text, 48) context and guidance 4."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(1, 128, *target, generator=gen),
        "refs": [torch.randn(1, 128, *r, generator=gen) for r in refs],
        "timestep": torch.full((1,), 0.6),
        "context": torch.randn(1, text, 48, generator=gen),
        "guidance": torch.full((1,), 4.0),
    }


def flux2_forward(flux, inputs: dict, layout: str, transformer_options: dict | None = None):
    """ComfyUI's FLUX.2 forward on `flux2_inputs`, the references in `layout`."""
    return flux(
        inputs["x"],
        inputs["timestep"],
        inputs["context"],
        None,
        inputs["guidance"],
        ref_latents=inputs["refs"],
        ref_latents_method=layout,
        transformer_options=transformer_options or {},
    )
