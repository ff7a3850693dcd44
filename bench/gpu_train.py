"""GPU benchmark: seconds per training step and peak CUDA memory on the stock-loadable demo Flux
(hidden 3072, 1 double + 1 single block, loaded by the stock UNETLoader), next to the VRAM
estimate TrainLoRA shows for the same configuration (`comfy_adapter/model_family.vram_estimate`).

Configurations, each at every `--sizes` (target and one reference of that size):
  bf16        UNETLoader weight_dtype default (bf16 on a bf16 GPU)
  fp8         UNETLoader weight_dtype fp8_e4m3fn (e4m3 in memory, computed in bf16)
  fp8_scaled  the default-loaded model with fp8_mode=fp8_scaled
each with blocks_to_swap 0 .. all (2 on the demo Flux), and with the cast contract as the run
plans it (`planned`: only where ComfyUI may reuse cast memory) and, with `--contract planned
forced`, forced on every casting Linear (`forced`: its cost where reuse is possible, e.g.
under dynamic VRAM: one more cast of each weight per step). All with gradient checkpointing, rank
16 on every block linear (`all_linear`, what the estimate assumes), AdamW, batch 1.

Per configuration every model is unloaded and the allocator emptied, the peak counter reset,
then a TrainLoRA session (ComfyUI loads the model inside it) runs `--warmup` + `--steps`
steps: s/step is the median over the steps after the warm-up (each step ends synchronised),
peak is `torch.cuda.max_memory_allocated()` over the whole session (weights included; the
CUDA context and the allocator's cache are not counted, the estimate's overhead is).

    .venv/bin/python bench/gpu_train.py [--sizes 512 1024] [--steps 5] [--warmup 2] [--rank 16]
        [--contract planned forced]

Without CUDA it prints "needs CUDA: ..." and exits with 0, measuring nothing; `--allow-cpu`
runs the same code on the CPU (fp32, no memory figures) to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = ("bf16", "fp8", "fp8_scaled")
LOADER_DTYPE = {"bf16": "default", "fp8": "fp8_e4m3fn", "fp8_scaled": "default"}
GIB = 2**30


def inputs(flow_step, size: int, seed: int = 0):
    """One sample: a target and one reference latent of `size` px, CLIP-L-sized text."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    side = size // 8
    return flow_step.Sample(
        torch.randn(16, side, side, generator=gen),
        torch.randn(77, 768, generator=gen),
        torch.randn(768, generator=gen),
        [torch.randn(16, side, side, generator=gen)],
    )


def free_everything(cuda: bool) -> None:
    import comfy.model_management
    import torch

    comfy.model_management.unload_all_models()
    gc.collect()
    comfy.model_management.soft_empty_cache()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measure(mods, model, sample, config, warmup: int, cuda: bool, working_memory: int) -> dict:
    """One configuration: median s/step after the warm-up, peak allocated bytes, the losses.
    `working_memory`: what TrainLoRA tells ComfyUI's loader to leave free beside the weights."""
    import torch

    marks = []

    def on_step(info):
        if cuda:
            torch.cuda.synchronize()
        marks.append(time.perf_counter())

    free_everything(cuda)
    baseline = torch.cuda.memory_allocated() if cuda else 0
    training = mods.ft.lora_session(model, config, memory_required=working_memory)
    with torch.inference_mode(False), training as session:
        if cuda:
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        losses = mods.loop.train(
            config, session.lora.parameters(), lambda i: [sample], session.loss, on_step=on_step
        ).losses
    steps = [b - a for a, b in itertools.pairwise(marks)][warmup:]
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {"seconds": statistics.median(steps), "peak": peak, "baseline": baseline, "losses": losses}


def estimate(mods, model, config, size: int):
    """What TrainLoRA shows for this model and config (a dataset of `size` px, one reference)."""
    dataset = SimpleNamespace(settings=SimpleNamespace(resolution=size), reference_count=1)
    return mods.run.vram_estimate(model, dataset, config)


def table(rows: list[dict], cuda: bool) -> str:
    lines = [
        "| size | weights | stored as | blocks_to_swap | contract | s/step | peak allocated GiB | "
        "estimate GiB | estimate: weights / LoRA+opt / activations / overhead |",
        "|---:|---|---|---:|---|---:|---:|---:|---|",
    ]
    for row in rows:
        e = row["estimate"]
        peak = f"{row['peak'] / GIB:.2f}" if cuda else "n/a"
        parts = f"{e.weights:.2f} / {e.lora:.2f} / {e.activations:.2f} / {e.overhead:.1f}"
        lines.append(
            f"| {row['size']} | {row['weights']} | {row['stored']} | {row['swap']} | {row['contract']} | "
            f"{row['seconds']:.3f} | {peak} | {e.total:.2f} | {parts} |"
        )
    return "\n".join(lines)


def contract(mods, mode: str):
    """The session's cast contract as planned, or forced on every casting Linear (`ALWAYS`)."""
    from kt_testing.contract import contract_as

    return contract_as(mods.ft, mods.cast_contract.ALWAYS) if mode == "forced" else contextlib.nullcontext()


def run_config(
    mods, model, sample, weights: str, size: int, swap: int, args, cuda: bool, mode: str = "planned"
) -> dict:
    config = mods.ft.TrainConfig(
        steps=args.warmup + args.steps,
        rank=args.rank,
        alpha=float(args.rank),
        targets="all_linear",
        gradient_checkpointing=True,
        blocks_to_swap=swap,
        fp8_mode="fp8_scaled" if weights == "fp8_scaled" else "as_loaded",
        learning_rate=1e-4,
        seed=0,
    )
    expected = estimate(mods, model, config, size)
    working = int((expected.activations + expected.lora + expected.overhead) * GIB)
    stored = model.model.diffusion_model.double_blocks[0].img_attn.qkv.weight.dtype
    row = {"size": size, "weights": weights, "stored": str(stored).removeprefix("torch."), "swap": swap}
    with contract(mods, mode):
        row.update(estimate=expected, **measure(mods, model, sample, config, args.warmup, cuda, working))
    row["contract"] = mode
    return row


def describe(row: dict, cuda: bool) -> str:
    peak = f"{row['peak'] / GIB:.2f} GiB (before: {row['baseline'] / GIB:.2f})" if cuda else "n/a"
    losses = [round(x, 4) for x in row["losses"]]
    return (
        f"  {row['size']}px {row['weights']:10s} swap {row['swap']} contract {row['contract']}: "
        f"{row['seconds']:.3f} s/step, "
        f"peak {peak}, estimate {row['estimate'].total:.2f} GiB, losses {losses}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="target and reference px")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS))
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU to check the script")
    parser.add_argument(
        "--contract", nargs="+", choices=("planned", "forced"), default=["planned"],
        help="the cast contract as the run plans it, and/or forced on every casting Linear",
    )
    args = parser.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(
            f"needs CUDA: torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}); nothing measured. Run it on a machine with an NVIDIA GPU."
        )
        return 0
    os.environ["KT_TEST_DEVICE"] = "cuda" if cuda else "cpu"  # ComfyUI boots on the GPU (no --cpu)
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts")]
    import demo_assets
    from kt_testing.comfy_runtime import boot
    from kt_testing.paths import asset_cache_dir

    with tempfile.TemporaryDirectory(prefix="kt-gpu-bench-") as scratch:
        runtime = boot(Path(scratch))
        pack = runtime.pack_module.__name__
        names = {
            "ft": "comfy_adapter.lora_session",
            "run": "comfy_adapter.model_family",
            "loop": "trainer_core.loop",
            "flow_step": "trainer_core.flow_step",
            "cast_contract": "comfy_adapter.cast_contract",
        }
        mods = SimpleNamespace(**{k: importlib.import_module(f"{pack}.{v}") for k, v in names.items()})
        paths = demo_assets.ensure_assets(asset_cache_dir())
        demo_assets.link_into_models(paths, runtime.base_dir / "models")
        loader = runtime.nodes.UNETLoader()
        loaded = {
            d: loader.load_unet(paths["flux"].name, d)[0] for d in {LOADER_DTYPE[w] for w in args.weights}
        }
        models = {w: loaded[LOADER_DTYPE[w]] for w in args.weights}
        flux = next(iter(models.values())).model.diffusion_model
        all_blocks = len(flux.double_blocks) + len(flux.single_blocks)
        name = torch.cuda.get_device_name() if cuda else "CPU (--allow-cpu: no memory figures)"
        print(f"{name}; torch {torch.__version__}; demo Flux {all_blocks} blocks; rank {args.rank}")
        rows = []
        for size in args.sizes:
            sample = inputs(mods.flow_step, size)
            for weights in args.weights:
                for swap, mode in itertools.product(range(all_blocks + 1), args.contract):
                    model = models[weights]
                    rows.append(run_config(mods, model, sample, weights, size, swap, args, cuda, mode))
                    print(describe(rows[-1], cuda), flush=True)
        print()
        print(table(rows, cuda))
    return 0


if __name__ == "__main__":
    sys.exit(main())
