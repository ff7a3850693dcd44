"""Memory benchmark: resident transformer weight bytes and step time for the weights as the
stock UNETLoader stores them (weight_dtype default, or fp8_e4m3fn), for fp8_mode fp8_scaled,
and for blocks_to_swap = 0 / half / all, on the stock-loadable demo Flux (hidden 3072, 1
double + 1 single block).

Ratios are measured side by side in one run, configurations alternating, against the
fp32-on-CPU (default) model without swapping. On a CPU-only machine both swap devices are the
CPU: the scheduler runs but nothing moves, so the swap rows show its bookkeeping overhead and
the bytes it would keep off a GPU; CUDA speed is not measured here.

    .venv/bin/python bench/memory.py [--steps 3] [--rounds 2] [--size 128]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts")]
    import torch

    import demo_assets
    from kt_testing.comfy_runtime import boot
    from kt_testing.paths import asset_cache_dir

    with tempfile.TemporaryDirectory(prefix="kt-bench-") as scratch:
        runtime = boot(Path(scratch))
        pack = runtime.pack_module.__name__
        ft = importlib.import_module(f"{pack}.comfy_adapter.lora_session")
        loop = importlib.import_module(f"{pack}.trainer_core.loop")
        flow_step = importlib.import_module(f"{pack}.trainer_core.flow_step")
        vram = importlib.import_module(f"{pack}.trainer_core.vram")
        paths = demo_assets.ensure_assets(asset_cache_dir())
        demo_assets.link_into_models(paths, runtime.base_dir / "models")
        loader = runtime.nodes.UNETLoader()
        models = {
            "default": loader.load_unet(paths["flux"].name, "default")[0],
            "fp8": loader.load_unet(paths["flux"].name, "fp8_e4m3fn")[0],
        }
        gen = torch.Generator().manual_seed(0)
        side = args.size // 8
        sample = flow_step.Sample(
            torch.randn(16, side, side, generator=gen),
            torch.randn(77, 768, generator=gen),
            torch.randn(768, generator=gen),
            [torch.randn(16, side, side, generator=gen)],
        )
        blocks = 2  # 1 double + 1 single
        configs = [
            (weights, swap)
            for weights in ("default", "fp8", "fp8_scaled")
            for swap in (0, blocks // 2, blocks)
        ]
        times = {c: [] for c in configs}
        resident = {}
        for _ in range(args.rounds):
            for weights, swap in configs:
                model = models["default" if weights == "fp8_scaled" else weights]
                config = ft.TrainConfig(
                    steps=args.steps,
                    rank=16,
                    alpha=16.0,
                    blocks_to_swap=swap,
                    seed=0,
                    fp8_mode="fp8_scaled" if weights == "fp8_scaled" else "as_loaded",
                )
                with torch.inference_mode(False), ft.lora_session(model, config) as session:
                    flux = session.diffusion_model
                    swapped = 0
                    if session.swapper is not None:
                        swapped = sum(
                            t.numel() * t.element_size()
                            for i in session.swapper.swapped
                            for t in session.swapper._frozen[i]
                        )
                    resident[(weights, swap)] = vram.module_weight_bytes(flux) - swapped
                    steps = []
                    loop.train(
                        config,
                        session.lora.parameters(),
                        lambda i: [sample],
                        session.loss,
                        on_step=lambda info, steps=steps: steps.append(info.seconds),
                    )
                times[(weights, swap)].append(statistics.median(steps[1:] or steps))
        base = statistics.median(times[("default", 0)])
        bf16_bytes = sum(p.numel() * 2 for p in models["default"].model.diffusion_model.parameters())
        print(f"{args.steps} steps, {args.size}px + 1 reference, rank 16, {args.rounds} alternating rounds")
        print("weights  blocks_to_swap  resident bytes / bf16  step time / (default, 0)")
        for weights, swap in configs:
            ratio = statistics.median(times[(weights, swap)]) / base
            print(f"{weights:8s} {swap:14d}  {resident[(weights, swap)] / bf16_bytes:21.3f}  {ratio:26.3f}")


if __name__ == "__main__":
    main()
