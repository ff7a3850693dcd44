"""Data-parallel scaling: steady-state step time of 2 torchrun processes vs 1, on this machine.

Three runs of the headless command on one dataset, measured in the same invocation:

  one      1 process, batch b (the baseline)
  one_2b   1 process, batch 2b (the same samples per step as two processes)
  two      `torchrun --nproc_per_node 2`, batch b each (global batch 2b): gloo on CPU, NCCL on GPUs

Each run trains `--steps` steps; its steady-state s/step is the mean of the last 10 steps
(the command's own progress line). Printed: the scaling efficiency t(one) / t(two) (1.0: two
processes do twice the samples per second of one), and t(one_2b) / t(two) (> 1: two processes
beat one process with the same global batch). On CPU every process gets its share of the cores
(1 process: all threads; 2: half each), so the figure says what the all-reduce and the split
cost, not what a second device would add.

  .venv/bin/python bench/data_parallel.py                    # tiny Flux (quick)
  .venv/bin/python bench/data_parallel.py --model demo       # the stock-loadable 3072-wide Flux
  .venv/bin/python bench/data_parallel.py --gpu              # on a machine with 2+ GPUs (NCCL)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for folder in (REPO / "tests", REPO / "scripts"):
    sys.path.insert(0, str(folder))

from kt_testing.datasets import write_one_folder  # noqa: E402
from kt_testing.headless import TINY_COMMAND, write_config  # noqa: E402

SPEED = re.compile(r"\] (\d+)/(\d+)  loss .*?  ([\d.]+) s/step")


def run(args: list[str], threads: int) -> float:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    speeds = [float(m.group(3)) for m in SPEED.finditer(result.stdout) if m.group(1) == m.group(2)]
    if not speeds:
        raise SystemExit(f"no final progress line in:\n{result.stdout[-2000:]}")
    return speeds[-1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("tiny", "demo"), default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--gpu", action="store_true", help="train on GPUs (needs 2)")
    options = parser.parse_args()
    cores = os.cpu_count() or 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dataset = write_one_folder(root / "data", [f"s{i}" for i in range(16)], references=1, size=(256, 256))
        base = root / "base"
        entry = [str(TINY_COMMAND)]
        if options.model == "demo":
            from demo_assets import ensure_assets, link_into_models
            from kt_testing.paths import asset_cache_dir

            link_into_models(ensure_assets(asset_cache_dir()), base / "models")
            entry = ["-m", "trainer_core"]

        def config(name: str, batch: int) -> Path:
            train = {"lora_name": name, "steps": options.steps, "batch_size": batch, "validate_every": 0}
            path = write_config(
                root / f"{name}.toml",
                base,
                dataset,
                root / "cache",
                train,
                resolution=options.resolution,
                reference_resolution=options.resolution,
            )
            if options.model == "demo":
                text = path.read_text().replace(
                    '"tiny.safetensors"', '"kontext-trainer-demo-flux.safetensors"', 1
                )
                text = text.replace('vae = "tiny.safetensors"', 'vae = "kontext-trainer-demo-ae.safetensors"')
                text = text.replace('["tiny"]', '["kontext-trainer-demo-clip-l.safetensors"]')
                path.write_text(text.replace("[model]\n", '[model]\nclip_type = "stable_diffusion"\n'))
            return path

        device = [] if options.gpu else ["--cpu"]
        single = [sys.executable, *entry, "train", "--config"]
        b = options.batch
        run([*single, str(config("warm", b)), *device], cores)  # fills the encode cache
        one = run([*single, str(config("one", b)), *device], cores)
        one_2b = run([*single, str(config("one_2b", 2 * b)), *device], cores)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        two = run(
            [*launcher, *entry, "train", "--config", str(config("two", b)), *device], max(cores // 2, 1)
        )
    print(
        f"model {options.model}, {options.resolution} px, batch {b} per process, {options.steps} steps, "
        f"{'GPU' if options.gpu else f'CPU ({cores} cores)'}"
    )
    print(f"s/step (mean of the last 10): one {one:.3f}  one_2b {one_2b:.3f}  two {two:.3f}")
    print(f"scaling efficiency t(one)/t(two) = {one / two:.2f}  (1.00 = twice the samples per second)")
    print(f"two processes vs one with the same global batch: t(one_2b)/t(two) = {one_2b / two:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
