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
matmul is relatively cheaper against the transfer both designs pay.

    .venv/bin/python bench/cast_contract.py [--steps 4] [--rounds 3] [--size 32]
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
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=32, help="latent side (tokens: (size/2)^2 per image)")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts")]
    import torch

    from kt_testing.comfy_runtime import boot
    from kt_testing.probes import tiny_samples
    from kt_testing.tiny_models import tiny_flux_patcher

    with tempfile.TemporaryDirectory(prefix="kt-bench-") as scratch:
        pack = boot(Path(scratch)).pack_module.__name__
        ft = importlib.import_module(f"{pack}.comfy_adapter.lora_session")
        flow_step = importlib.import_module(f"{pack}.trainer_core.flow_step")
        samples = tiny_samples(
            flow_step.Sample, 1, 4, [(args.size, args.size)], target=(args.size, args.size)
        )
        wide = {"hidden_size": 512, "num_heads": 8, "axes_dim": [16, 24, 24]}
        install = ft.recast_in_backward
        cast_contract = importlib.import_module(f"{pack}.comfy_adapter.cast_contract")
        plain_cast = cast_contract.plain_cast_linear

        def run(design: str, checkpointing: bool) -> tuple[float, int]:
            model = tiny_flux_patcher(
                seed=1, dtype=torch.float8_e4m3fn, manual_cast_dtype=torch.float32, **wide
            )
            config = ft.TrainConfig(
                rank=16, alpha=16.0, targets="attention_mlp", gradient_checkpointing=checkpointing
            )
            if design == former:
                ft.recast_in_backward = lambda module: lambda: None
            if design == recompute:
                cast_contract.plain_cast_linear = lambda layer: False
            try:
                with torch.inference_mode(False), ft.lora_session(model, config) as session:
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
                ft.recast_in_backward = install
                cast_contract.plain_cast_linear = plain_cast
            return statistics.median(times[1:] or times), max(saved)

        ours, recompute = "re-cast in backward (ours)", "recompute in backward (419e28e)"
        former = "cast kept by autograd (70adb75)"
        print(
            f"{'block checkpointing':20s} {'design':34s} {'s/step':>8s} {'time':>6s} "
            f"{'saved MiB':>10s} {'saved':>6s}"
        )
        for checkpointing in (False, True):
            results = {ours: [], recompute: [], former: []}
            for _ in range(args.rounds):
                for design in (former, recompute, ours):
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


if __name__ == "__main__":
    main()
