"""Helpers of the GPU layer (tests/gpu): the run mode, models on a device, probes that run on
the device, deterministic kernels, a memory-limited load, step timing and copy bandwidth.

Nothing heavy is imported at module level: where the layer is skipped (every run except
`make test-gpu` and the CPU dry run), pytest collects it without importing torch or booting
ComfyUI.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from comfy_server import TEST_DEVICE_ENV, comfy_device

if TYPE_CHECKING:
    import torch

DRY_RUN_ENV = "KT_GPU_TESTS_ON_CPU"
CUDA, DRY_RUN = "cuda", "cpu-dry-run"
SKIP_REASON = (
    f"GPU layer: needs CUDA and ComfyUI booted on it; run `make test-gpu` ({TEST_DEVICE_ENV}=cuda), "
    f"or {DRY_RUN_ENV}=1 for a dry run of the test bodies on the CPU"
)
CUDA_ONLY_REASON = "needs CUDA itself (timing, CUDA memory or out-of-memory): skipped in the CPU dry run"


def run_mode() -> str | None:
    """CUDA (KT_TEST_DEVICE=cuda: ComfyUI boots on the GPU), DRY_RUN (KT_GPU_TESTS_ON_CPU=1:
    the bodies run on the CPU), or None: the layer is skipped."""
    if comfy_device() == "cuda":
        return CUDA
    if os.environ.get(DRY_RUN_ENV, "") not in ("", "0"):
        return DRY_RUN
    return None


@dataclass(frozen=True)
class GpuRun:
    device: torch.device  # where ComfyUI loads models: the GPU, or the CPU in the dry run
    dry_run: bool

    @property
    def cuda(self) -> bool:
        return not self.dry_run

    def synchronize(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)


# -- models and probes ------------------------------------------------------------------------
def cpu_patcher(seed: int, dtype=None, manual_cast_dtype=None, family: str = "flux", **overrides):
    """A tiny Flux (`family`: flux, flux2 or klein) or Qwen-Image (qwen_image) MODEL that ComfyUI
    loads onto the CPU whatever device it runs on: the reference computation (fp32 on the CPU, as
    the CPU layers test it)."""
    import comfy.model_patcher
    import torch

    from kt_testing.klein import KLEIN_CONFIG
    from kt_testing.tiny_models import TINY_FLUX2_CONFIG, TINY_FLUX_CONFIG, build_flux_model

    if family == "qwen_image":
        from kt_testing.tiny_models import tiny_qwen_image_patcher

        model = tiny_qwen_image_patcher(
            seed, dtype or torch.float32, manual_cast_dtype=manual_cast_dtype
        ).model
    else:
        config = {"flux": TINY_FLUX_CONFIG, "flux2": TINY_FLUX2_CONFIG, "klein": KLEIN_CONFIG}[family]
        model = build_flux_model({**config, **overrides}, seed, dtype or torch.float32, manual_cast_dtype)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def model_output(
    patcher,
    seed=0,
    sigma=0.5,
    text=(5, 48),
    pooled=32,
    transformer_options=None,
    load=True,
    channels=16,
    frames=None,
):
    """`kt_testing.probes.model_output` with the inputs on the patcher's load device: load the
    MODEL the normal way (`load=False` inside a training session, which holds its clone
    loaded), then ComfyUI's `apply_model` on a fixed input (same draws). FLUX.2: channels=128,
    pooled=0. Qwen-Image: frames=1 (5-D latents, no guidance input), pooled=0."""
    import comfy.model_management
    import torch

    if load:
        comfy.model_management.load_models_gpu([patcher])
    device = patcher.load_device
    gen = torch.Generator().manual_seed(seed)
    lead = (channels,) if frames is None else (channels, frames)
    x = torch.randn(1, *lead, 8, 8, generator=gen)
    cond = {"c_crossattn": torch.randn(1, *text, generator=gen).to(device)}
    if frames is None:
        cond["guidance"] = torch.tensor([1.0], device=device)
    if pooled:
        cond["y"] = torch.randn(1, pooled, generator=gen).to(device)
    if transformer_options is None:
        transformer_options = patcher.model_options["transformer_options"]
    with torch.no_grad():
        out = patcher.model.apply_model(
            x.to(device),
            torch.tensor([sigma], device=device),
            transformer_options=transformer_options,
            **cond,
        )
    return out.float().cpu()


def relative_rms(got, expected) -> float:
    return float((got - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())


# -- LoRA sessions ------------------------------------------------------------------------------
def randomise_lora(session, seed: int, scale: float = 0.05) -> None:
    """Give the session's LoRA the same random values on every device (drawn on the CPU), so
    lora_A gets a gradient too and two devices start from one point."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in session.lora.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * scale)


def loss_and_grads(session, samples, seed: int = 7):
    """The objective and every LoRA gradient on one batch, as float32 CPU tensors."""
    import torch

    loss = session.loss(samples, torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(loss, session.lora.parameters())
    return loss.detach().float().cpu(), [g.detach().float().cpu() for g in grads]


def relative_error(got: list, expected: list) -> float:
    """||got - expected|| / ||expected|| over all tensors together."""
    import torch

    diff = torch.sqrt(sum(((g - e) ** 2).sum() for g, e in zip(got, expected, strict=True)))
    return float(diff / torch.sqrt(sum((e**2).sum() for e in expected)))


@contextlib.contextmanager
def deterministic_kernels():
    """Deterministic CUDA kernels (attention backward, cuBLAS with the fixed workspace the
    conftest sets), so two runs of one computation can be compared bit for bit."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


@contextlib.contextmanager
def weights_budget(budget: int, dry_run: bool):
    """Inside, ComfyUI's `load_models_gpu` sees the load device with its minimum inference
    memory plus `budget` bytes free, so ComfyUI itself decides to load partially ("lowvram":
    the layers that do not fit wait on the CPU and are cast per use, a weight patch through
    `LowVramPatch`). In the dry run it is also told the CPU is no CPU (ComfyUI never loads
    partially onto the CPU). Only the free-memory query inside `load_models_gpu` changes."""
    import comfy.model_management as mm

    real_load, real_free, real_is_cpu, real_state = (
        mm.load_models_gpu,
        mm.get_free_memory,
        mm.is_device_cpu,
        mm.vram_state,
    )

    def get_free_memory(dev=None, torch_free_too=False):
        free = int(mm.minimum_inference_memory()) + budget
        return (free, free) if torch_free_too else free

    def load_models_gpu(models, *args, **kwargs):
        mm.get_free_memory = get_free_memory
        if dry_run:
            mm.is_device_cpu = lambda device: False
        try:
            return real_load(models, *args, **kwargs)
        finally:
            mm.get_free_memory, mm.is_device_cpu = real_free, real_is_cpu

    mm.load_models_gpu = load_models_gpu
    if dry_run:
        mm.vram_state = mm.VRAMState.NORMAL_VRAM
    try:
        yield
    finally:
        mm.load_models_gpu, mm.vram_state = real_load, real_state


def unload_everything() -> None:
    """Every model off the GPU and the allocator's cache emptied (before measuring memory)."""
    import gc

    import comfy.model_management
    import torch

    comfy.model_management.unload_all_models()
    gc.collect()
    comfy.model_management.soft_empty_cache()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- blocks, timing, copies -----------------------------------------------------------------------
def flux_blocks(diffusion_model) -> list:
    """The transformer blocks in execution order: double blocks, then single blocks."""
    return [*diffusion_model.double_blocks, *diffusion_model.single_blocks]


def frozen_tensors(block) -> list:
    """A block's tensors that do not train (its base weights and buffers)."""
    return [p for p in block.parameters() if not p.requires_grad] + list(block.buffers())


def expected_swapped(double_count: int, single_count: int, blocks_to_swap: int) -> set[int]:
    """The README's rule, written out independently: single blocks first, from the end of the
    single stack, then double blocks from the end of theirs (execution-order indices)."""
    singles = min(blocks_to_swap, single_count)
    doubles = blocks_to_swap - singles
    last_single = double_count + single_count - 1
    return {last_single - i for i in range(singles)} | {double_count - 1 - i for i in range(doubles)}


def blocks_away_from(diffusion_model, device) -> set[int]:
    """Indices of the blocks none of whose base weights is on `device`."""
    away = set()
    for index, block in enumerate(flux_blocks(diffusion_model)):
        if all(t.device != device for t in frozen_tensors(block)):
            away.add(index)
    return away


def median_step_seconds(gpu: GpuRun, session, samples, steps: int = 3, warmup: int = 1) -> float:
    """Median wall time of forward + backward (the part block swap touches), synchronised."""
    import torch

    times = []
    for index in range(warmup + steps):
        gpu.synchronize()
        started = time.perf_counter()
        session.loss(samples, torch.Generator().manual_seed(index)).backward()
        gpu.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - started)
        for param in session.lora.parameters():
            param.grad = None
    return statistics.median(times)


def host_to_device_seconds(tensors: list, device, repeats: int = 5) -> float:
    """Median time to copy `tensors` one after another from pinned host memory to `device`:
    what swapping them in costs when nothing overlaps."""
    import torch

    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    arrived = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors]
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for source, target in zip(host, arrived, strict=True):
            target.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
