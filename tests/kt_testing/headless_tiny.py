"""`python -m trainer_core` for the tests: the same command (`application/cli.py`'s `main`: boot,
config, dataset, data parallel, training, files, progress, signals), with the stock loaders
replaced by the tiny models the test nodes build (KTTest_TinyFluxModel seed 3,
KTTest_SmallFluxVAE seed 1, KTTest_TinyCLIP seed 2): no stock loader detects a Flux that small.

    python tests/kt_testing/headless_tiny.py train --config run.toml --cpu
    python -m torch.distributed.run --nproc_per_node 2 tests/kt_testing/headless_tiny.py train ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT, ROOT / "tests", ROOT / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from trainer_core.__main__ import pack_cli  # noqa: E402

RESETS_MARK = "kt test: ComfyUI's cast buffers reset"  # printed at exit with the count
# "klein": the tiny FLUX.2 [klein] (KTTest_TinyKleinModel seed 3), FLUX.2's VAE stand-in (seed 1)
# and a tiny Qwen3 through ComfyUI's klein text encoder (seed 2); ComfyUI 0.33 or newer.
# "qwen_image": the tiny Qwen-Image-Edit 2509 (seed 3), the narrow Wan 2.1 VAE (seed 1) and the
# tiny Qwen2.5-VL (seed 2), as the e2e tests' tiny file and stand-ins hold them
TINY_MODELS_ENV = "KT_TEST_TINY_MODELS"
MODEL_SEED_ENV = "KT_TEST_MODEL_SEED"  # another seed for the diffusion model (3 by default)


def load_tiny_models(files):
    """(MODEL, VAE, CLIP) as the test nodes make them (the tiny Flux's, or klein's or Qwen-Image's
    where `TINY_MODELS_ENV` says so); `files` (the config's [model]) unused.
    With `KT_TEST_DYNAMIC_VRAM=1` (and `dynamic_vram.server_env()`'s PYTHONPATH), ComfyUI's
    dynamic VRAM is emulated once they are built (`dynamic_vram.emulate`: they stay plain
    patchers), and the command's calls of ComfyUI's `reset_cast_buffers` are counted and
    printed at exit (`RESETS_MARK`)."""
    from kt_testing.dynamic_vram import DYNAMIC_VRAM_ENV, emulate
    from kt_testing.tiny_models import small_flux_vae, tiny_clip, tiny_flux_patcher

    seed = int(os.environ.get(MODEL_SEED_ENV, "3"))
    if os.environ.get(TINY_MODELS_ENV) == "klein":
        from kt_testing.klein import klein_patcher, qwen3_clip
        from kt_testing.tiny_models import small_flux2_vae

        models = klein_patcher(seed=seed), small_flux2_vae(seed=1), qwen3_clip(seed=2)
    elif os.environ.get(TINY_MODELS_ENV) == "qwen_image":
        from kt_testing.qwen_image import small_wan_vae, tiny_qwen_image_clip
        from kt_testing.tiny_models import tiny_qwen_image_patcher

        models = tiny_qwen_image_patcher(seed=seed), small_wan_vae(seed=1), tiny_qwen_image_clip(seed=2)
    else:
        models = tiny_flux_patcher(seed=seed), small_flux_vae(seed=1), tiny_clip(seed=2)
    if os.environ.get(DYNAMIC_VRAM_ENV) == "1":  # after the builds: each stays a plain patcher
        import atexit

        import comfy.model_management

        emulate()
        reset, calls = comfy.model_management.reset_cast_buffers, []

        def counted():
            calls.append(1)
            return reset()

        comfy.model_management.reset_cast_buffers = counted
        atexit.register(lambda: print(f"{RESETS_MARK}: {len(calls)}", flush=True))
    return models


def load_tiny_models_breaking_a_folder(files):
    """`load_tiny_models`, and `KT_TEST_BREAK_FOLDER` ("<after_writes>:<kind>") armed on the run's
    models/loras (`kt_testing.bad_files.break_folder_after_writes`)."""
    import folder_paths

    from kt_testing.bad_files import BREAK_FOLDER_ENV, break_folder_after_writes

    after_writes, kind = os.environ[BREAK_FOLDER_ENV].split(":", 1)
    (lora_file,) = [m for name, m in sys.modules.items() if name.endswith("trainer_core.lora_file")]
    loras = Path(folder_paths.get_folder_paths("loras")[0])
    break_folder_after_writes(lora_file, loras, int(after_writes), kind)
    return load_tiny_models(files)


if __name__ == "__main__":
    loader = load_tiny_models_breaking_a_folder if "KT_TEST_BREAK_FOLDER" in os.environ else load_tiny_models
    sys.exit(pack_cli().main(load_models=loader))
