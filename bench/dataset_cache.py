"""Dataset-cache benchmark: LoadKontextDataset on a cold cache vs a warm one.

Runs the node (validation, hashing, sizing, encoding, caching) on a synthetic dataset with
the test encoders (the small Flux-topology VAE and the one-layer CLIP of tests/kt_testing),
alternating an uncached pass (empty cache folder) and a cached pass (same inputs, warm
cache), and prints the median ratio. Goal: cached >= 3x faster. Not a test:
`.venv/bin/python bench/dataset_cache.py` after `make setup`.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--references", type=int, default=1)
    parser.add_argument("--size", type=int, default=384, help="image side in pixels before sizing")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts")]
    from kt_testing.comfy_runtime import boot
    from kt_testing.datasets import write_one_folder
    from kt_testing.tiny_models import small_flux_vae, tiny_clip

    with tempfile.TemporaryDirectory(prefix="kt-bench-") as scratch:
        scratch = Path(scratch)
        runtime = boot(scratch / "base")
        node = importlib.import_module(f"{runtime.pack_module.__name__}.nodes.load_kontext_dataset")
        root = write_one_folder(
            scratch / "set",
            [f"s{i:03d}" for i in range(args.samples)],
            args.references,
            (args.size, args.size),
        )
        vae, clip = small_flux_vae(seed=1), tiny_clip(seed=2)

        def run(cache: Path) -> tuple[float, str]:
            started = time.perf_counter()
            _, report = node.LoadKontextDataset.execute(
                vae,
                clip,
                node.USE_PATH,
                str(root),
                args.resolution,
                args.resolution,
                0,
                "white",
                0,
                0,
                str(cache),
            ).args
            return time.perf_counter() - started, report.splitlines()[2]

        times = {"uncached": [], "cached": []}
        for index in range(args.rounds):
            cache = scratch / f"cache{index}"
            cold, cold_report = run(cache)
            warm, warm_report = run(cache)
            times["uncached"].append(cold)
            times["cached"].append(warm)
            print(f"round {index + 1}: uncached {cold:6.2f} s ({cold_report})")
            print(f"         cached   {warm:6.2f} s ({warm_report})")
    ratio = statistics.median(times["uncached"]) / statistics.median(times["cached"])
    images = args.samples * (1 + args.references)
    print(f"\n{args.samples} samples, {images} images, {args.size}px -> {args.resolution}, x{args.rounds}:")
    print(f"  uncached / cached = {ratio:.2f}x  (goal >= 3x)")


if __name__ == "__main__":
    main()
