"""Training-step benchmark: our step vs ComfyUI's native TrainLoraNode vs a bare step.

All three train the same stock-loaded Flux (the demo checkpoint: hidden 3072, 1 double +
1 single block, loaded by the stock UNETLoader), on the same latent and conditioning, with
the same rank, AdamW, fp32 compute on CPU and gradient checkpointing on:

  ours    `flux_lora_session` + `loop.train` (peft LoRA on the block linears, out-of-place
          block patches, the rectified-flow objective), exactly what TrainLoRA runs;
  native  `TrainLoraNode.execute` from comfy_extras/nodes_train.py (its own LoRA weight
          wrappers on every weight, its sampler-driven loop);
  bare    written here: the same peft LoRA and block patches, then per step only
          noise, ComfyUI's Flux call, MSE, backward, AdamW (no masks, no packing, no
          clipping, no bookkeeping).

Each run is a fresh worker process (so peak RSS is its own); runs alternate
ours/native/bare for `--rounds` rounds; the parent prints median ratios. Peak RSS is
reported two ways: the whole process, and the growth during training above the RSS right
before it (the model and inputs already in memory), which is what the trainers control.
Not a test: `python bench/train_step.py` after `make setup`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("ours", "native", "bare")


def _memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS


def _inputs(size: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(1, 16, size // 8, size // 8, generator=gen)
    context = torch.randn(1, 77, 768, generator=gen)
    pooled = torch.randn(1, 768, generator=gen)
    return latent, context, pooled


def _load_model(runtime, unet_name: str):
    (model,) = runtime.nodes.UNETLoader().load_unet(unet_name, "default")
    return model


def run_ours(runtime, model, args):
    import importlib

    import torch

    pack = runtime.pack_module.__name__
    ft = importlib.import_module(f"{pack}.nodes.flux_training")
    flow_step = importlib.import_module(f"{pack}.trainer_core.flow_step")
    loop = importlib.import_module(f"{pack}.trainer_core.loop")
    latent, context, pooled = _inputs(args.size)
    sample = flow_step.Sample(latent[0], context[0], pooled[0])
    config = ft.TrainConfig(
        steps=args.steps,
        rank=args.rank,
        alpha=float(args.rank),
        targets="all_linear",
        timestep_sampler="uniform",
        learning_rate=1e-4,
    )

    with torch.inference_mode(False), ft.flux_lora_session(model, config) as session:
        return loop.train(config, session.lora.parameters(), lambda i: [sample], session.loss).losses


def run_native(runtime, model, args):
    import comfy_extras.nodes_train as nodes_train

    latent, context, pooled = _inputs(args.size)
    positive = [[context, {"pooled_output": pooled, "guidance": 1.0}]]
    algorithm = next(iter(nodes_train.adapter_maps))
    # Two copies of the same latent: with a single LATENT input the node (0.3.75) takes a
    # code path that fails (`multi_res` unset); with batch_size 1 it trains on one per step.
    result = nodes_train.TrainLoraNode.execute(
        model=[model],
        latents=[{"samples": latent}, {"samples": latent}],
        positive=[positive],
        batch_size=[1],
        steps=[args.steps],
        grad_accumulation_steps=[1],
        learning_rate=[1e-4],
        rank=[args.rank],
        optimizer=["AdamW"],
        loss_function=["MSE"],
        seed=[0],
        training_dtype=["fp32"],
        lora_dtype=["fp32"],
        algorithm=[algorithm],
        gradient_checkpointing=[True],
        existing_lora=["[None]"],
    )
    return [float(x) for x in result.result[2]["loss"]]


def run_bare(runtime, model, args):
    """The reference step: nothing but noise, forward, loss, backward, AdamW."""
    import importlib

    import comfy.model_management
    import comfy.patcher_extension
    import torch

    pack = runtime.pack_module.__name__
    flux_blocks = importlib.import_module(f"{pack}.nodes.flux_blocks")
    lora_adapters = importlib.import_module(f"{pack}.trainer_core.lora_adapters")
    lora_targets = importlib.import_module(f"{pack}.trainer_core.lora_targets")
    latent, context, pooled = _inputs(args.size)
    with torch.inference_mode(False):
        torch.manual_seed(0)
        clone = model.clone()
        flux_blocks.install_trainable_blocks(clone, checkpointing=True)
        comfy.model_management.load_models_gpu([clone])
        flux = clone.model.diffusion_model
        linears = [n for n, m in flux.named_modules() if isinstance(m, torch.nn.Linear)]
        names = lora_targets.target_module_names(linears, "all_linear")
        lora = lora_adapters.attach_lora(flux, names, args.rank, float(args.rank))
        optimizer = torch.optim.AdamW(lora.parameters(), lr=1e-4, foreach=False)
        options = clone.model_options["transformer_options"]
        gen = torch.Generator().manual_seed(0)
        guidance = torch.ones(1)
        losses = []
        try:
            for _ in range(args.steps):
                sigma = torch.rand(1, generator=gen)
                noise = torch.randn(latent.shape, generator=gen)
                noisy = (1 - sigma) * latent + sigma * noise
                prediction = flux(noisy, sigma, context, pooled, guidance, transformer_options=dict(options))
                loss = torch.nn.functional.mse_loss(prediction.float(), noise - latent)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
        finally:
            lora.detach()
    return losses


def worker(args) -> None:
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts")]
    import demo_assets
    from kt_testing.comfy_runtime import boot
    from kt_testing.paths import asset_cache_dir

    runtime = boot(Path(args.base_dir))
    paths = demo_assets.ensure_assets(asset_cache_dir())
    demo_assets.link_into_models(paths, runtime.base_dir / "models")
    model = _load_model(runtime, paths["flux"].name)
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])  # weights resident before the clock starts
    base_rss = _memory_kib("VmRSS")
    _reset_peak_rss()
    started = time.perf_counter()
    losses = {"ours": run_ours, "native": run_native, "bare": run_bare}[args.worker](runtime, model, args)
    seconds = time.perf_counter() - started
    peak = _memory_kib("VmHWM")
    print(
        "RESULT "
        + json.dumps(
            {
                "variant": args.worker,
                "seconds": seconds,
                "peak_rss_kib": peak,
                "training_growth_kib": peak - base_rss,
                "losses": losses,
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three variants")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels (latent = size / 8)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--base-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    results = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="kt-bench-") as base_dir:
        for round_index in range(args.rounds):
            for variant in VARIANTS:
                command = [
                    sys.executable,
                    __file__,
                    "--worker",
                    variant,
                    "--base-dir",
                    base_dir,
                    "--steps",
                    str(args.steps),
                    "--size",
                    str(args.size),
                    "--rank",
                    str(args.rank),
                ]
                done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
                    raise SystemExit(f"{variant} run failed (exit {done.returncode})")
                result = json.loads(lines[-1][len("RESULT ") :])
                results[variant].append(result)
                print(
                    f"round {round_index + 1} {variant:6s} {result['seconds']:7.1f} s  "
                    f"peak RSS {result['peak_rss_kib'] / 2**20:5.2f} GiB  "
                    f"growth {result['training_growth_kib'] / 2**20:5.2f} GiB  "
                    f"losses {[round(x, 4) for x in result['losses']]}",
                    flush=True,
                )

    def ratio(key, other):
        ours = statistics.median(r[key] for r in results["ours"])
        return ours / statistics.median(r[key] for r in results[other])

    print(
        f"\n{args.steps} steps, {args.size}px, rank {args.rank}, {args.rounds} alternating rounds (medians):"
    )
    print(f"  time        ours / native = {ratio('seconds', 'native'):.3f}  (goal <= 0.7)")
    print(f"  peak RSS    ours / native = {ratio('peak_rss_kib', 'native'):.3f}  (whole process)")
    growth = ratio("training_growth_kib", "native")
    print(f"  RSS growth  ours / native = {growth:.3f}  (goal <= 0.7; training only)")
    print(f"  time        ours / bare   = {ratio('seconds', 'bare'):.3f}  (goal <= 1.03)")


if __name__ == "__main__":
    main()
