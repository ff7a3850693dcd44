"""Training under ComfyUI 0.33's dynamic VRAM without a second copy of the model: anonymous-memory
growth and step time of ours (full precision and fp8_scaled) and of ComfyUI's own TrainLoraNode,
each under plain loading and under emulated dynamic loading (the file's read-only mapped
weights, `ModelPatcherDynamic`: tests/kt_testing/dynamic_vram.py), side by side in one run.

It runs `train_step.py`'s workers (a fresh process per run; the demo Flux from the stock
UNETLoader, one target + one reference latent, rank 16, AdamW, gradient checkpointing, fp32 on
the CPU) with a loading mode and an fp8 mode, and prints per run: the step time, the growth of
the process's anonymous memory (RssAnon, sampled every 20 ms from the variant's start: a mapped
model's pages are file memory, a copy of it is anonymous) and the model file's size.

Goal (issue 30): under dynamic loading, ours' anonymous growth <= 0.2 x the model's size and
<= 0.25 x the native node's, at a step no slower than the native node's. The growth here
includes what any training step needs on a CPU (activations, the LoRA and its optimizer state,
and each layer's fp32 cast, which on a GPU would be in VRAM).

    .venv/bin/python bench/dynamic_vram.py [--size 256] [--steps 1] [--warmup 1] [--rounds 1]

Needs ComfyUI 0.33 (KONTEXT_TRAINER_COMFYUI=$PWD/.comfyui-0.33, PYTHONPATH with its
.kontext-site), as `make setup` prepares it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = (  # (variant, fp8 mode)
    ("ours", "as_loaded"),
    ("ours", "fp8_scaled"),
    ("native", "as_loaded"),
)
LOADINGS = ("plain", "dynamic")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--size", type=int, default=256, help="image side in px")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per run, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    options = parser.parse_args()
    sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests"), str(REPO / "scripts")]
    import train_step

    import demo_assets
    from kt_testing.paths import asset_cache_dir

    model_file = asset_cache_dir() / demo_assets.ASSET_VERSION / Path(*demo_assets.FLUX_FILE)
    results: dict[tuple[str, str, str], list[dict]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kt-bench-") as base_dir:
        for round_index in range(options.rounds):
            for loading in LOADINGS:
                for variant, fp8_mode in RUNS:
                    args = argparse.Namespace(
                        steps=options.steps,
                        warmup=options.warmup,
                        rank=options.rank,
                        attention="default",
                        loading=loading,
                        fp8_mode=fp8_mode,
                    )
                    result = train_step._run_worker(variant, options.size, base_dir, args)
                    results.setdefault((variant, fp8_mode, loading), []).append(result)
                    print(
                        f"round {round_index + 1} {loading:7s} {variant:6s} {fp8_mode:10s} "
                        f"step {result['steady_s']:6.2f} s  "
                        f"anonymous +{result['anon_growth_kib'] >> 10} MiB  "
                        f"losses {[round(x, 4) for x in result['losses']]}",
                        flush=True,
                    )
    model_mib = model_file.stat().st_size >> 20
    print(f"\n{options.size} px, demo Flux file {model_mib} MiB (bf16), {options.rounds} round(s), medians\n")
    print("| loading | run | s/step | anonymous growth MiB | growth / model | growth / native's |")
    print("|---|---|---:|---:|---:|---:|")
    for loading in LOADINGS:
        natives = results["native", "as_loaded", loading]
        native = statistics.median(r["anon_growth_kib"] for r in natives) / 1024
        for variant, fp8_mode in RUNS:
            runs = results[variant, fp8_mode, loading]
            step = statistics.median(r["steady_s"] for r in runs)
            growth = statistics.median(r["anon_growth_kib"] for r in runs) / 1024
            name = variant if fp8_mode == "as_loaded" else f"{variant} {fp8_mode}"
            print(
                f"| {loading} | {name} | {step:.2f} | {growth:.0f} | {growth / model_mib:.2f} | "
                f"{growth / native:.2f} |"
            )
    print(f"\nwall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
