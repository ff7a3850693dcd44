"""LoRA gradients against finite differences, for any training session (FLUX.1 or FLUX.2)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def randomise_lora(session, seed: int, scale: float = 0.05) -> None:
    """Non-zero LoRA factors, so every factor gets a gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in session.lora.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * scale)


def unit_direction(tensors, generator: torch.Generator) -> list[torch.Tensor]:
    """A random direction through `tensors`: one Gaussian draw of each shape, unit length over all."""
    draws = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in tensors]
    norm = torch.sqrt(sum((d * d).sum() for d in draws))
    return [d / norm for d in draws]


def central_derivative(loss: Callable[[], torch.Tensor], tensors, directions, h: float = 1e-2) -> float:
    """Fourth-order central difference of `loss` along `directions` (Richardson:
    (8 (f(h) - f(-h)) - (f(2h) - f(-2h))) / 12h), the tensors restored after each shift."""

    def shifted(step: float) -> float:
        with torch.no_grad():
            for p, d in zip(tensors, directions, strict=True):
                p.add_(step * d)
            value = float(loss())
            for p, d in zip(tensors, directions, strict=True):
                p.sub_(step * d)
        return value

    return (8 * (shifted(h) - shifted(-h)) - (shifted(2 * h) - shifted(-2 * h))) / (12 * h)


def worst_directional_error(loss: Callable[[], torch.Tensor], params, seed: int = 3) -> float:
    """autograd's directional derivative <grad, d> against `central_derivative` along random
    unit directions d: one per adapted layer (its lora_A and lora_B, consecutive in `params`,
    moved together) and one through all parameters at once. Returns the worst error relative
    to the norm of the gradient part concerned. Also checks that both factors of every layer
    receive a gradient."""
    grads = torch.autograd.grad(loss(), params)
    for index in range(0, len(params), 2):
        assert all(float(g.abs().max()) > 1e-8 for g in grads[index : index + 2]), index
    pairs = [slice(i, i + 2) for i in range(0, len(params), 2)]
    generator, worst = torch.Generator().manual_seed(seed), 0.0
    for part in [*pairs, slice(None)]:
        directions = unit_direction(params[part], generator)
        analytic = float(sum((g * d).sum() for g, d in zip(grads[part], directions, strict=True)))
        norm = float(torch.sqrt(sum((g * g).sum() for g in grads[part])))
        worst = max(worst, abs(central_derivative(loss, params[part], directions) - analytic) / norm)
    return worst
