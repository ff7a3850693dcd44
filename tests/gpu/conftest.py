"""The GPU layer: the tiny Flux and the demo workflow trained on CUDA, with ComfyUI booted on the
GPU (no --cpu). Run it with `make test-gpu` (KT_TEST_DEVICE=cuda).

- Any other run (plain `pytest`, `make test`, CI): every test here is skipped at collection,
  before any fixture runs: no torch import, no ComfyUI boot. (ComfyUI picks its device once per
  process, and the other layers boot it with --cpu.)
- KT_TEST_DEVICE=cuda without a usable GPU: the session stops with an error, not skips.
- KT_GPU_TESTS_ON_CPU=1: a dry run of the test bodies on the CPU, to check their code paths;
  tests that request `cuda_only` (timing, CUDA memory, out of memory) are skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gpu.support import CUDA, CUDA_ONLY_REASON, DRY_RUN, SKIP_REASON, GpuRun, run_mode

GPU_DIR = Path(__file__).resolve().parent
MODE = run_mode()
if MODE == CUDA:
    # cuBLAS is deterministic (when asked) only with a fixed workspace, read at its first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if GPU_DIR in item.path.resolve().parents]
    if not ours:
        return
    if MODE is None:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
    elif MODE == CUDA:
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(
                "KT_TEST_DEVICE=cuda asks for the GPU layer, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}): run it on a machine "
                "with an NVIDIA GPU and a CUDA build of torch, or unset KT_TEST_DEVICE"
            )
    elif MODE == DRY_RUN:
        for item in ours:
            if "cuda_only" in item.fixturenames:
                item.add_marker(pytest.mark.skip(reason=CUDA_ONLY_REASON))


@pytest.fixture(scope="session")
def gpu(comfy_runtime) -> GpuRun:
    """Where this run trains: the GPU ComfyUI picked, or the CPU in the dry run."""
    import comfy.model_management
    import torch

    device = torch.device(comfy.model_management.get_torch_device())
    if MODE == CUDA and device.type != "cuda":
        pytest.fail(f"ComfyUI was booted on {device}, not on the GPU (was it booted before KT_TEST_DEVICE?)")
    return GpuRun(device=device, dry_run=MODE == DRY_RUN)


@pytest.fixture
def cuda_only(gpu) -> GpuRun:
    """Request it to say the test needs CUDA itself: the dry run skips it at collection."""
    return gpu


@pytest.fixture
def deterministic():
    """Deterministic CUDA kernels for the test, so results can be compared bit for bit."""
    from gpu.support import deterministic_kernels

    with deterministic_kernels():
        yield


@pytest.fixture(scope="session")
def mods(pack_import):
    """The pack's modules as ComfyUI imported them."""
    names = {
        "ft": "comfy_adapter.lora_session",
        "node": "nodes.train_lora",
        "job": "trainer_core.job",
        "run": "application.training_run",
        "loop": "trainer_core.loop",
        "flow_step": "trainer_core.flow_step",
        "config": "trainer_core.config",
        "checkpoint": "trainer_core.checkpoint",
        "vram": "trainer_core.vram",
        "lora_targets": "comfy_adapter.families.flux.lora_targets",
    }
    return type("Mods", (), {key: pack_import(name) for key, name in names.items()})
