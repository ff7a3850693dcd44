"""One training step on an fp8 file as ComfyUI 0.33 loads it on an NVIDIA GPU in three ways
(issue 41 item 6), each in a fresh process booted as the command line boots
(`comfy_adapter/comfy_boot.py`: ComfyUI's own flags first, then `cuda_malloc`, torch, and dynamic
VRAM set up as `main.py` sets it up):

  dynamic    ComfyUI's default on NVIDIA: weights mapped from the file, streamed per forward
  disabled   --disable-dynamic-vram: the weights loaded into VRAM as before 0.33
  evicting   dynamic VRAM with --reserve-vram leaving only `--leave-gib` GiB of the card, so
             ComfyUI evicts and streams layers again within the step

The file is the stock demo Flux (hidden 3072, 1 double + 1 single block) with every block Linear
quantized to e4m3 by ComfyUI's own code (`kt_testing/quantized_files.py`, the form the files
users download take), loaded by the stock UNETLoader. Each process trains rank 16 on every
block Linear (LoRA factors set to the same random values), gradient checkpointing on, one target
and one reference at `--size` px, and reports: the LoRA gradients of one step (compared with
the dynamic process's: relative error over all factors), peak allocated CUDA memory, the
growth of its anonymous memory from before the load (RssAnon, of it ComfyUI's pinned host
buffers), and the median
step time with the cast contract as the run plans it and forced on every casting Linear (its
cost where it applies). Reading: the three gradients agree to within the GPU's kernel
differences (a contract failure would give another layer's weight: errors of order 1).

    .venv/bin/python bench/gpu_loading_modes.py [--size 1024] [--steps 3] [--leave-gib 3]

Without CUDA it says so and exits 0; `--allow-cpu` runs the same processes on the CPU (the
modes then load alike, so the gradients must agree exactly) to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FP8_FILE = "kt-demo-flux-e4m3.safetensors"
MODES = {"dynamic": [], "disabled": ["--disable-dynamic-vram"], "evicting": None}  # None: --reserve-vram
RESULT = "RESULT "


def total_gib() -> float | None:
    """The first GPU's memory (nvidia-smi; the parent process never starts CUDA)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return float(out.split()[0]) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=1024, help="target and reference px")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contract setting")
    parser.add_argument("--leave-gib", type=float, default=3.0, help="evicting: GiB of the card left")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU to check the script")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args, flags = parser.parse_known_args()
    if args.worker:
        return worker(args, [f for f in flags if f != "--"])
    card = total_gib()
    if card is None and not args.allow_cpu:
        print("needs CUDA: no NVIDIA GPU (nvidia-smi); nothing measured. Run it on a machine with one.")
        return 0
    with tempfile.TemporaryDirectory(prefix="kt-loading-modes-") as scratch:
        scratch = Path(scratch)
        results = {}
        for mode, mode_flags in MODES.items():
            if mode_flags is None:  # leave --leave-gib GiB: ComfyUI must evict within the step
                mode_flags = ["--reserve-vram", f"{max((card or 0) - args.leave_gib, 0):.1f}"]
            command = [sys.executable, __file__, "--worker", mode, "--scratch", str(scratch)]
            command += ["--size", str(args.size), "--steps", str(args.steps)]
            command += ["--allow-cpu"] * args.allow_cpu + ["--", *mode_flags]
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
            if done.returncode != 0 or not lines:
                print(f"{mode}: failed ({done.returncode})\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
                return 1
            results[mode] = json.loads(lines[-1].removeprefix(RESULT))
            results[mode]["flags"] = " ".join(mode_flags) or "(none)"
            results[mode]["wall"] = time.perf_counter() - started
        report(results, scratch)
    return 0


def report(results: dict, scratch: Path) -> None:
    from safetensors.torch import load_file

    reference = load_file(str(scratch / "dynamic.safetensors"))
    print(f"{results['dynamic']['device']}; one step at {results['dynamic']['size']} px with a reference")
    print(
        "| mode | ComfyUI flags | gradient error vs dynamic | peak CUDA GiB | anonymous MiB (pinned) | "
        "s/step contract planned | forced | loading |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for mode, row in results.items():
        grads = load_file(str(scratch / f"{mode}.safetensors"))
        num = sum(float((grads[k].double() - reference[k].double()).square().sum()) for k in reference)
        den = sum(float(reference[k].double().square().sum()) for k in reference)
        error = (num / den) ** 0.5 if den else float("nan")
        peak = f"{row['peak_cuda'] / 2**30:.2f}" if row["peak_cuda"] is not None else "n/a"
        print(
            f"| {mode} | {row['flags']} | {error:.2e} | {peak} | {row['anon_growth'] >> 20} "
            f"({row['pinned'] >> 20}) | {row['seconds']['planned']:.3f} | {row['seconds']['forced']:.3f} | "
            f"{row['loading']} |"
        )


def worker(args, flags: list[str]) -> int:
    """One mode in this fresh process: boot as the command line does, load the fp8 file with
    the stock UNETLoader, one step's gradients, then the timed steps."""
    for folder in (REPO, REPO / "tests", REPO / "scripts"):
        sys.path.insert(0, str(folder))
    from trainer_core.__main__ import pack_cli

    cli = pack_cli()
    boot = sys.modules["kontext_trainer.comfy_adapter.comfy_boot"]
    boot.apply_flags(cli.comfyui_root(), flags, f"bench {args.worker}")
    use_cuda = cli.wants_cuda(force_cpu=args.allow_cpu)
    base = args.scratch / f"base-{args.worker}"
    (base / "models" / "diffusion_models").mkdir(parents=True, exist_ok=True)
    cli.boot(base, use_cuda)
    import importlib

    import torch

    from kt_testing.dynamic_vram import AnonymousPeak

    fp8_file = args.scratch / FP8_FILE
    if not fp8_file.exists():
        write_fp8_file(fp8_file)
    (base / "models" / "diffusion_models" / FP8_FILE).symlink_to(fp8_file)
    pack = "kontext_trainer"
    ft = importlib.import_module(f"{pack}.comfy_adapter.lora_session")
    flow_step = importlib.import_module(f"{pack}.trainer_core.flow_step")
    cast_contract = importlib.import_module(f"{pack}.comfy_adapter.cast_contract")
    import nodes
    from kt_testing.contract import contract_as
    from kt_testing.gradients import randomise_lora

    anon = AnonymousPeak()
    with torch.inference_mode():  # as the executor runs a loader node
        (model,) = nodes.UNETLoader().load_unet(FP8_FILE, "default")
    side = args.size // 8
    gen = torch.Generator().manual_seed(0)
    sample = flow_step.Sample(
        torch.randn(16, side, side, generator=gen),
        torch.randn(77, 768, generator=gen),
        torch.randn(768, generator=gen),
        [torch.randn(16, side, side, generator=gen)],
    )
    config = ft.TrainConfig(rank=16, alpha=16.0, targets="all_linear", gradient_checkpointing=True, seed=0)
    seconds, grads, loading = {}, None, ""
    for setting in ("planned", "forced"):
        forced = contract_as(ft, cast_contract.ALWAYS) if setting == "forced" else contextlib.nullcontext()
        with forced, torch.inference_mode(False), ft.lora_session(model, config) as session:
            loading = session.contract.describe() if setting == "planned" else loading
            randomise_lora(session, seed=2)
            params = list(session.lora.parameters())
            times = []
            for _ in range(1 + args.steps):
                start = time.perf_counter()
                loss = session.loss([sample], torch.Generator().manual_seed(11))
                step_grads = torch.autograd.grad(loss, params)
                if use_cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                if grads is None:  # the first step of the planned run: the compared gradients
                    names = [f"lora.{i}" for i in range(len(params))]
                    pairs = zip(names, step_grads, strict=True)
                    grads = {n: g.detach().float().cpu().contiguous() for n, g in pairs}
            seconds[setting] = statistics.median(times[1:])
    from safetensors.torch import save_file

    save_file(grads, str(args.scratch / f"{args.worker}.safetensors"))
    seen = anon.reset()
    result = {
        "device": torch.cuda.get_device_name() if use_cuda else "CPU (--allow-cpu)",
        "size": args.size,
        "seconds": seconds,
        "peak_cuda": torch.cuda.max_memory_allocated() if use_cuda else None,
        "anon_growth": (seen["peak_kib"] - seen["base_kib"]) * 1024,
        "pinned": seen["pinned_bytes"],
        "loading": loading.split(" (")[0].split(";")[0],  # on / in part / off, and why
    }
    print(RESULT + json.dumps(result), flush=True)
    return 0


def write_fp8_file(path: Path) -> None:
    """The demo Flux with its block Linears quantized to e4m3 by ComfyUI's code, in the form
    this ComfyUI reads (`comfy_quant` on 0.33)."""
    from safetensors.torch import load_file

    import demo_assets
    from kt_testing.paths import asset_cache_dir
    from kt_testing.quantized_files import forms_this_comfyui_loads, write_quantized_file

    flux = demo_assets.ensure_assets(asset_cache_dir())["flux"]
    partial = path.with_suffix(".partial")
    write_quantized_file(partial, load_file(str(flux)), forms_this_comfyui_loads()[-1])
    shutil.move(partial, path)
    os.sync()


if __name__ == "__main__":
    sys.exit(main())
