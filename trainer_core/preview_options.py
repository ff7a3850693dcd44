"""What PreviewSampler holds beside its prompt and VAE: how often, how many sampling steps, the
size, seed and ComfyUI's sampler, each with its default and limits (the node's widgets are
built from these fields; their tooltips and order: `application/widget_schema.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from .config import check_limits, knob


@dataclass
class PreviewOptions:
    every_n_steps: int = knob(100, min=1, max=100_000)
    steps: int = knob(20, min=1, max=200)
    cfg: float = knob(1.0, min=1.0, max=30.0, step=0.1)
    guidance: float = knob(3.5, min=0.0, max=100.0, step=0.1)
    width: int = knob(1024, min=64, max=4096, step=16)
    height: int = knob(1024, min=64, max=4096, step=16)
    seed: int = knob(0, min=0, max=2**31 - 1)
    sampler_name: str = knob("euler")  # one of ComfyUI's samplers (the node lists them)
    scheduler: str = knob("simple")  # one of ComfyUI's schedulers

    def __post_init__(self):
        check_limits(self)  # NaN passes ComfyUI's min / max check
