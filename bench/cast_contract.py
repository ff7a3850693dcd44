"""The cast contract's cost (comfy_adapter/cast_contract.py): step time and bytes saved for the
backward with the contract as it is (a plain cast Linear casts its weight again in the backward),
with every casting Linear recomputed in the backward instead (the per-layer recompute, which
ComfyUI's quantized Linear still takes; every casting Linear's on 419e28e), and the former step
that let autograd keep each cast weight, side by side in one run (configurations alternating).

"saved" is what autograd keeps from the forward for the backward (a saved-tensor hook; under
block checkpointing it sees the block inputs only, for both designs).

The model is the tiny test Flux widened to hidden 512 (2 double + 2 single blocks) with fp8
e4m3 weights computed in fp32 through ComfyUI's manual-cast ops: every block Linear casts per
forward, as under dynamic VRAM, partial loads or fp8 files. CPU only: on a GPU the recompute's
matmul is relatively cheaper against the transfer both designs pay. "ours" is the contract
forced on every casting Linear (`cast_contract.ALWAYS`), as where ComfyUI reuses cast memory;
"as planned here" is what a run on this machine does (`plan_for`: a CPU reuses nothing, so
autograd keeps the casts with block checkpointing, and the re-cast saves memory without).

Then the step's FLOPs at full FLUX.1 size (12B, `torch.utils.flop_counter`), the model built
from ComfyUI's own classes on the `meta` device (no memory, no compute), fp8 weights cast to
bf16 on every Linear (as dynamic VRAM streams them), one target and one reference at 512 and
1024 px with 512 text tokens, the pack's blocks (`install_blocks`) with and without
checkpointing; the latents and the text need a gradient (what the LoRA layers do in a run; the
LoRA's own small matmuls are left out). Designs: the casts kept, the per-layer recompute, ours.

    .venv/bin/python bench/cast_contract.py [--steps 4] [--rounds 3] [--size 32] [--flops-only]
"""

from __future__ import annotations

import argparse
import contextlib
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
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=32, help="latent side (tokens: (size/2)^2 per image)")
    parser.add_argument("--flops-only", action="store_true", help="only the full-size FLOP counts")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts")]

    from kt_testing.comfy_runtime import boot

    with tempfile.TemporaryDirectory(prefix="kt-bench-") as scratch:
        # PyTorch's attention: ComfyUI's default on a CPU asks the device for free memory
        pack = boot(Path(scratch), {"use_pytorch_cross_attention": True}).pack_module.__name__
        if not args.flops_only:
            timed(pack, args)
        full_size_flops(pack)


def timed(pack: str, args) -> None:
    import torch

    from kt_testing.contract import contract_as
    from kt_testing.probes import tiny_samples
    from kt_testing.tiny_models import tiny_flux_patcher

    ft = importlib.import_module(f"{pack}.comfy_adapter.lora_session")
    flow_step = importlib.import_module(f"{pack}.trainer_core.flow_step")
    samples = tiny_samples(
        flow_step.Sample, 1, 4, [(args.size, args.size)], target=(args.size, args.size)
    )
    wide = {"hidden_size": 512, "num_heads": 8, "axes_dim": [16, 24, 24]}
    cast_contract = importlib.import_module(f"{pack}.comfy_adapter.cast_contract")
    plain_cast = cast_contract.plain_cast_linear

    def run(design: str, checkpointing: bool) -> tuple[float, int]:
        model = tiny_flux_patcher(
            seed=1, dtype=torch.float8_e4m3fn, manual_cast_dtype=torch.float32, **wide
        )
        config = ft.TrainConfig(
            rank=16, alpha=16.0, targets="attention_mlp", gradient_checkpointing=checkpointing
        )
        # ours and the recompute on every casting Linear, as where casts are reused; former: none
        plans = {former: None, ours: cast_contract.ALWAYS, recompute: cast_contract.ALWAYS}
        forced = contract_as(ft, plans[design]) if design in plans else contextlib.nullcontext()
        if design == recompute:
            cast_contract.plain_cast_linear = lambda layer: False
        try:
            with (
                forced,
                torch.inference_mode(False),
                ft.lora_session(model, config) as session,
            ):
                params = session.lora.parameters()
                times, saved = [], []
                for i in range(args.steps):
                    kept = {}

                    def pack_saved(t, kept=kept):
                        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                        return t

                    start = time.perf_counter()
                    with torch.autograd.graph.saved_tensors_hooks(pack_saved, lambda t: t):
                        loss = session.loss(samples, torch.Generator().manual_seed(i))
                    torch.autograd.grad(loss, params)
                    times.append(time.perf_counter() - start)
                    saved.append(sum(kept.values()))
        finally:
            cast_contract.plain_cast_linear = plain_cast
        return statistics.median(times[1:] or times), max(saved)

    ours, recompute = "re-cast in backward (ours)", "recompute in backward (419e28e)"
    former, planned = "cast kept by autograd (70adb75)", "ours as planned here"
    print(
        f"{'block checkpointing':20s} {'design':34s} {'s/step':>8s} {'time':>6s} "
        f"{'saved MiB':>10s} {'saved':>6s}"
    )
    for checkpointing in (False, True):
        results = {ours: [], recompute: [], former: [], planned: []}
        for _ in range(args.rounds):
            for design in (former, recompute, ours, planned):
                results[design].append(run(design, checkpointing))
        base_time = statistics.median(t for t, _ in results[former])
        base_saved = statistics.median(s for _, s in results[former])
        for name, rows in results.items():
            t = statistics.median(r[0] for r in rows)
            s = statistics.median(r[1] for r in rows)
            print(
                f"{checkpointing!s:20s} {name:34s} {t:8.3f} {t / base_time:6.3f} "
                f"{s / 2**20:10.2f} {s / base_saved:6.3f}"
            )


FLUX1 = {  # FLUX.1 [dev] as ComfyUI detects it (comfy/model_detection.py)
    "image_model": "flux",
    "in_channels": 16,
    "out_channels": 16,
    "vec_in_dim": 768,
    "context_in_dim": 4096,
    "hidden_size": 3072,
    "mlp_ratio": 4.0,
    "num_heads": 24,
    "depth": 19,
    "depth_single_blocks": 38,
    "axes_dim": [16, 56, 56],
    "theta": 10000,
    "patch_size": 2,
    "qkv_bias": True,
    "guidance_embed": True,
}


def full_size_flops(pack: str) -> None:
    import comfy.model_patcher
    import comfy.supported_models
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from kt_testing.tiny_models import for_this_comfyui

    cast_contract = importlib.import_module(f"{pack}.comfy_adapter.cast_contract")
    family_of = importlib.import_module(f"{pack}.comfy_adapter.model_family").family_of
    sampling_options = importlib.import_module(f"{pack}.comfy_adapter.lora_session").sampling_options
    config = comfy.supported_models.Flux(for_this_comfyui(FLUX1))
    config.set_inference_dtype(torch.float8_e4m3fn, torch.bfloat16)
    model = config.get_model({}, device="meta")
    diffusion_model = model.diffusion_model.requires_grad_(False)  # the frozen base
    for layer in diffusion_model.modules():
        if cast_contract.is_linear(layer) and hasattr(layer, "comfy_cast_weights"):
            layer.comfy_cast_weights = True  # cast per forward, as dynamic VRAM streams them
    meta = torch.device("meta")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=meta, offload_device=meta)
    family = family_of(patcher)

    def step(design: str, checkpointing: bool, pixels: int) -> int:
        plain_cast = cast_contract.plain_cast_linear
        if design == "recompute":
            cast_contract.plain_cast_linear = lambda layer: False
        remove = cast_contract.recast_in_backward(diffusion_model) if design != "kept" else (lambda: None)
        cast_contract.plain_cast_linear = plain_cast
        unhook = family.install_blocks(patcher, checkpointing)
        try:
            side = pixels // 8

            def meta_tensor(*shape, grad=False):
                return torch.empty(*shape, device=meta, dtype=torch.bfloat16, requires_grad=grad)

            x, reference = meta_tensor(1, 16, side, side, grad=True), meta_tensor(1, 16, side, side)
            context, pooled = meta_tensor(1, 512, 4096, grad=True), meta_tensor(1, 768)
            timestep, guidance = meta_tensor(1), meta_tensor(1)
            options = sampling_options(patcher)
            with FlopCounterMode(display=False) as counter:
                out = diffusion_model(
                    x, timestep, context, pooled, guidance, ref_latents=[reference],
                    transformer_options=options,
                )
                out.sum().backward()
            return counter.get_total_flops()
        finally:
            unhook()
            remove()

    print(f"\nFLUX.1 full size ({sum(p.numel() for p in diffusion_model.parameters()) / 1e9:.1f}B), one step")
    print(f"{'pixels':>6s} {'block checkpointing':20s} {'kept (TFLOP)':>13s} {'recompute':>10s} {'ours':>6s}")
    for pixels in (512, 1024):
        for checkpointing in (True, False):
            flops = {d: step(d, checkpointing, pixels) for d in ("kept", "recompute", "ours")}
            print(
                f"{pixels:6d} {checkpointing!s:20s} {flops['kept'] / 1e12:13.1f} "
                f"{flops['recompute'] / flops['kept']:10.3f} {flops['ours'] / flops['kept']:6.3f}"
            )


if __name__ == "__main__":
    main()
