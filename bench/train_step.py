"""Training-step benchmark: ours vs ComfyUI's TrainLoraNode, a bare step and diffusers + peft.

Every variant trains the stock-loadable demo Flux (hidden 3072, 1 double + 1 single block) on
one Kontext-style sample, a target latent plus one reference latent of the same size and
CLIP-L-sized text, at rank `--rank`, with AdamW, fp32 compute on the CPU and gradient
checkpointing on:

  ours       `lora_session` + `loop.train` with TrainConfig's defaults (targets=
             attention_mlp), exactly what TrainLoRA runs;
  ours_all   the same with targets=all_linear, the most layers ours can adapt;
  native     `TrainLoraNode.execute` (comfy_extras/nodes_train.py) with its defaults except rank
             and dtype (fp32), the reference added by the stock ReferenceLatent node;
  bare       our default LoRA and block patches, then per step only noise, ComfyUI's Flux
             call, MSE, backward, AdamW;
  diffusers  diffusers' FluxTransformer2DModel on the same file converted by diffusers' own
             converter, peft LoRA on the same layers, the same tokens (what ai-toolkit and
             SimpleTuner run).

Each run is a fresh worker process (its peak RSS is its own). Runs alternate variant by variant
within a round, the order rotating from round to round. A worker times its set-up (start to the
first transformer call), then every step (optimizer step to optimizer step); the first
`--warmup` steps are left out of the steady-state median. Peak RSS is the whole process's
(VmHWM) and its growth above the RSS just before the variant started (model already loaded).
The parent prints medians and median ratios. Not a test: run it after `make setup`.
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
VARIANTS = ("ours", "ours_all", "native", "bare", "diffusers")
# (numerator, denominator, goal on step time at 512 px, goal on peak RSS growth at 512 px)
RATIOS = (
    ("ours", "native", 0.5, 0.6),
    ("ours_all", "native", None, None),
    ("ours", "bare", 1.03, None),
    ("ours", "diffusers", None, None),
)
GOAL_SIZE = 512


# --- measurement inside a worker -------------------------------------------------------------


def _memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS


class Clock:
    """Set-up and per-step times: the transformer class's `forward` is wrapped (its first
    training call ends the set-up) and a global optimizer step post-hook marks each step's
    end. By class, not by instance: ComfyUI 0.33's TrainLoraNode trains a fresh copy of the
    model (`clone(force_deepcopy=True)` loads it again). Calls with fewer tokens than the
    sample's text (the forward guard's probe before ours trains) are not training calls."""

    def __init__(self, transformer, min_tokens: int = 0):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.first_call: float | None = None
        self.tokens: int | None = None  # tokens of the first transformer call (image + text)
        self.step_ends: list[float] = []
        self.step_cpu_ends: list[float] = []  # process CPU time: steadier while others share the CPU
        self.min_tokens = min_tokens
        self.kind = type(transformer)
        self.forward = self.kind.forward
        clock, forward = self, self.forward

        def watched(module, *args, **kwargs):
            clock._on_call(module, args, kwargs)
            return forward(module, *args, **kwargs)

        self.kind.forward = watched
        self._handles = [register_optimizer_step_post_hook(self._on_step)]
        self.started = time.perf_counter()

    def _on_call(self, module, args, kwargs):
        if self.first_call is None and _token_count(args, kwargs) >= self.min_tokens:
            self.first_call = time.perf_counter()
            self.tokens = _token_count(args, kwargs)
            self.first_call_cpu = time.process_time()

    def _on_step(self, optimizer, args, kwargs):
        self.step_ends.append(time.perf_counter())
        self.step_cpu_ends.append(time.process_time())

    def close(self) -> None:
        self.kind.forward = self.forward
        for handle in self._handles:
            handle.remove()

    def step_seconds(self, cpu: bool = False) -> list[float]:
        ends = self.step_cpu_ends if cpu else self.step_ends
        starts = [self.first_call_cpu if cpu else self.first_call, *ends[:-1]]
        return [end - start for start, end in zip(starts, ends, strict=True)]


def _token_count(args, kwargs) -> int:
    """Tokens the transformer sees: ComfyUI's Flux (x, ref_latents, context) or diffusers'
    (hidden_states, encoder_hidden_states)."""
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"].shape[1] + kwargs["encoder_hidden_states"].shape[1]
    x = args[0]
    context = kwargs["context"] if "context" in kwargs else args[2]
    latents = [x, *(kwargs.get("ref_latents") or [])]
    return sum(latent.shape[-2] * latent.shape[-1] // 4 for latent in latents) + context.shape[1]


def _load(variant: str, args):
    """(the model the variant trains, its transformer module, the variants module)."""
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts"), str(REPO / "bench")]
    import train_step_variants as variants

    import demo_assets
    from kt_testing.paths import asset_cache_dir

    flux_path = asset_cache_dir() / demo_assets.ASSET_VERSION / Path(*demo_assets.FLUX_FILE)
    if variant == "diffusers":  # no ComfyUI in this process: what a diffusers trainer loads
        transformer = variants.load_diffusers_flux(flux_path)
        return transformer, transformer, variants
    from kt_testing.comfy_runtime import boot

    dynamic = getattr(args, "loading", "plain") == "dynamic"
    if dynamic:  # ComfyUI 0.33's dynamic VRAM, emulated on the CPU (kt_testing/dynamic_vram.py)
        import comfy_aimdo.control  # before ComfyUI imports aimdo's submodules, as main.py

        comfy_aimdo.control.init()
    # ComfyUI picks its attention at start-up: on the CPU sub-quadratic by default, PyTorch's
    # SDPA on NVIDIA GPUs (and with --use-pytorch-cross-attention).
    runtime = boot(Path(args.base_dir), {"use_pytorch_cross_attention": args.attention == "pytorch"})
    variants.PACK["name"] = runtime.pack_module.__name__
    paths = demo_assets.ensure_assets(asset_cache_dir())
    demo_assets.link_into_models(paths, runtime.base_dir / "models")
    import comfy.model_management

    if dynamic:
        import torch

        from kt_testing.dynamic_vram import emulate

        emulate()
        # as in ComfyUI's executor: the file's read-only mapped weights, as inference tensors
        with torch.inference_mode():
            (model,) = runtime.nodes.UNETLoader().load_unet(paths["flux"].name, "default")
            comfy.model_management.load_models_gpu([model])
        return model, model.model.diffusion_model, variants
    # Loaded outside inference mode, unlike in ComfyUI's executor: the native node cannot train
    # on inference-tensor weights (Flux's QK-norm `scale` is saved for backward and raises).
    (model,) = runtime.nodes.UNETLoader().load_unet(paths["flux"].name, "default")
    comfy.model_management.load_models_gpu([model])  # weights resident before the clock starts
    return model, model.model.diffusion_model, variants


def worker(args) -> None:
    model, transformer, variants = _load(args.worker, args)
    if args.worker == "prepare":
        return
    from kt_testing.dynamic_vram import AnonymousPeak

    inputs = variants.make_inputs(args.size)
    base_rss = _memory_kib("VmRSS")
    _reset_peak_rss()
    anonymous = AnonymousPeak()  # RssAnon: a mapped model's pages are file memory, a copy is not
    clock = Clock(transformer, min_tokens=inputs.context.shape[1])
    trained = variants.VARIANTS[args.worker](model, inputs, args)
    clock.close()
    peak = _memory_kib("VmHWM")
    anonymous_seen = anonymous.reset()
    steps = clock.step_seconds()
    if len(steps) != args.warmup + args.steps:
        raise RuntimeError(f"timed {len(steps)} optimizer steps, expected {args.warmup + args.steps}")
    result = {
        "variant": args.worker,
        "size": args.size,
        "attention": args.attention,
        "setup_s": clock.first_call - clock.started,
        "step_s": steps,
        "steady_s": statistics.median(steps[args.warmup :]),
        "steady_cpu_s": statistics.median(clock.step_seconds(cpu=True)[args.warmup :]),
        "tokens": clock.tokens,
        "base_rss_kib": base_rss,
        "peak_rss_kib": peak,
        "growth_kib": peak - base_rss,
        "anon_growth_kib": anonymous_seen["peak_kib"] - anonymous_seen["base_kib"],
        "loading": getattr(args, "loading", "plain"),
        "fp8_mode": getattr(args, "fp8_mode", "as_loaded"),
        "layers": trained.layers,
        "adapted": trained.adapted,
        "trainable": trained.trainable,
        "losses": trained.losses,
    }
    print("RESULT " + json.dumps(result), flush=True)


# --- the parent: rounds, workers, table ------------------------------------------------------


def _run_worker(variant: str, size: int, base_dir: str, args) -> dict | None:
    command = [sys.executable, __file__, "--worker", variant, "--base-dir", base_dir]
    command += ["--size", str(size), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--rank", str(args.rank), "--attention", args.attention]
    command += ["--loading", getattr(args, "loading", "plain")]
    command += ["--fp8-mode", getattr(args, "fp8_mode", "as_loaded")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or (variant != "prepare" and not lines):
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise SystemExit(f"{variant} at {size} px failed (exit {done.returncode})")
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


def _gib(kib: float) -> str:
    return f"{kib / 2**20:.2f}"


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def print_table(results: dict, args) -> None:
    print(
        f"\nmedians over {args.rounds} round(s); {args.steps} timed steps after {args.warmup} warm-up "
        f"step(s) per run; rank {args.rank}; one reference image; ComfyUI attention: {args.attention}"
    )
    for size in args.resolutions:
        runs = {variant: results[size, variant] for variant in args.variants if results.get((size, variant))}
        tokens = next(iter(runs.values()))[0]["tokens"]
        print(f"\n### {size} px ({tokens} tokens per Flux call: target + reference + text)\n")
        print(
            "| variant | s/step | CPU s/step | set-up s | peak RSS GiB | growth GiB | adapted "
            "| trainable params |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for variant, vruns in runs.items():
            print(
                f"| {variant} | {_median(vruns, 'steady_s'):.2f} | {_median(vruns, 'steady_cpu_s'):.2f} "
                f"| {_median(vruns, 'setup_s'):.2f} "
                f"| {_gib(_median(vruns, 'peak_rss_kib'))} | {_gib(_median(vruns, 'growth_kib'))} "
                f"| {vruns[0]['adapted']} | {vruns[0]['trainable']:,} |"
            )
        print("\n| ratio (medians) | step time | step CPU time | RSS growth | whole-process peak RSS |")
        print("|---|---:|---:|---:|---:|")
        for numerator, denominator, time_goal, rss_goal in RATIOS:
            if numerator not in runs or denominator not in runs:
                continue
            cells = []
            keys = ("steady_s", "steady_cpu_s", "growth_kib", "peak_rss_kib")
            for key, goal in zip(keys, (time_goal, None, rss_goal, None), strict=True):
                ratio = _median(runs[numerator], key) / _median(runs[denominator], key)
                verdict = ""
                if goal is not None and size == GOAL_SIZE:
                    verdict = f" (goal <= {goal}: {'met' if ratio <= goal else 'MISSED'})"
                cells.append(f"{ratio:.3f}{verdict}")
            print(f"| {numerator} / {denominator} | " + " | ".join(cells) + " |")
    print("\nwhat each variant trains:")
    for variant in args.variants:
        run = next(results[size, variant][0] for size in args.resolutions if results.get((size, variant)))
        print(f"  {variant:9s} {run['layers']}; {run['trainable']:,} trainable parameters")


def print_saved(args) -> None:
    """The table from `--save` files (e.g. resolutions measured in separate invocations)."""
    runs = [json.loads(line) for path in args.table_from for line in path.read_text().splitlines() if line]
    args.resolutions = sorted({run["size"] for run in runs})
    args.variants = [v for v in VARIANTS if any(run["variant"] == v for run in runs)]
    args.rounds = max(run["round"] for run in runs)
    args.attention = runs[0].get("attention", "default")  # runs saved before the option: default
    results = {(size, variant): [] for size in args.resolutions for variant in args.variants}
    for run in runs:
        results[run["size"], run["variant"]].append(run)
    print_table(results, args)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of all variants")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per run before the timed ones")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[256, 512], help="image sides in px")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every variant")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="a subset")
    parser.add_argument("--save", type=Path, help="append every run's result to this JSON-lines file")
    parser.add_argument(
        "--attention",
        choices=("default", "pytorch"),
        default="default",
        help="ComfyUI's attention: its default for the device (sub-quadratic on the CPU) or PyTorch's "
        "SDPA (--use-pytorch-cross-attention; what ComfyUI uses on NVIDIA GPUs). diffusers always uses SDPA",
    )
    parser.add_argument(
        "--table-from", type=Path, nargs="+", help="print the table from saved result files; run nothing"
    )
    parser.add_argument("--worker", choices=(*VARIANTS, "prepare"), help=argparse.SUPPRESS)
    parser.add_argument("--loading", choices=("plain", "dynamic"), default="plain", help=argparse.SUPPRESS)
    parser.add_argument(
        "--fp8-mode", choices=("as_loaded", "fp8_scaled"), default="as_loaded", help=argparse.SUPPRESS
    )
    parser.add_argument("--base-dir", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    if args.table_from:
        print_saved(args)
        return

    variants = tuple(v for v in VARIANTS if v in args.variants)
    results = {(size, variant): [] for size in args.resolutions for variant in variants}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kt-bench-") as base_dir:
        _run_worker("prepare", args.resolutions[0], base_dir, args)  # demo assets exist from here on
        for round_index in range(args.rounds):
            shift = round_index % len(variants)
            order = variants[shift:] + variants[:shift]
            for size in args.resolutions:
                for variant in order:
                    result = _run_worker(variant, size, base_dir, args)
                    results[size, variant].append(result)
                    if args.save:
                        with args.save.open("a") as saved:
                            saved.write(json.dumps({**result, "round": round_index + 1}) + "\n")
                    print(
                        f"round {round_index + 1} {size:4d}px {variant:9s} "
                        f"step {result['steady_s']:6.2f} s (CPU {result['steady_cpu_s']:6.2f} s)  "
                        f"set-up {result['setup_s']:5.2f} s  peak RSS {_gib(result['peak_rss_kib'])} GiB  "
                        f"growth {_gib(result['growth_kib'])} GiB  "
                        f"tokens {result['tokens']}  losses {[round(x, 4) for x in result['losses']]}",
                        flush=True,
                    )
    print_table(results, args)
    print(f"\nwall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
