"""The demo: train a Kontext LoRA end to end through a real, headless ComfyUI.

1. generates (once, cached) the stock-loadable random-weight Flux, its VAE and a CLIP-L
   (`demo_assets`) and a small synthetic edit dataset (`demo_dataset`: shapes and their
   blue-recoloured edits, with captions), in `.cache/`;
2. starts ComfyUI (`main.py --cpu`) with the pack, on a free local port, base directory
   `.cache/demo/`;
3. queues `example_workflows/api/kontext_lora_training.json` over the HTTP API (stock
   UNETLoader / VAELoader / CLIPLoader -> LoadKontextDataset -> TrainLoRA, with PreviewSampler
   previews of the unseen reference `input/kontext_demo_reference.png`) with `overwrite` on,
   and prints the dataset report and the live progress the websocket carries;
4. prints where the LoRA landed in models/loras, the loss at the start and the end, and the
   held-out validation loss (one of the eight samples is held out) at each point it was
   computed;
5. queues `example_workflows/api/kontext_lora_inference.json` as shipped (it loads that LoRA
   and that reference) and prints where the edited image landed in output/.

Rerunning reuses the models, the dataset and the encoded-latent cache; training reruns and
replaces the demo LoRA. Run it with `make demo` (which sets everything up first).
"""

from __future__ import annotations

import json
import sys
import time

from comfy_server import REPO_ROOT, ComfyServer, asset_cache_dir, comfyui_root, make_base_directory
from demo_assets import ensure_assets, link_into_models
from demo_dataset import REFERENCE_IMAGE, write_demo_dataset

WORKFLOW = REPO_ROOT / "example_workflows" / "api" / "kontext_lora_training.json"
INFERENCE = REPO_ROOT / "example_workflows" / "api" / "kontext_lora_inference.json"
DEMO_BASE = REPO_ROOT / ".cache" / "demo"
PROGRESS_EVENT = "kontext_trainer.progress"
TIMEOUT_SECONDS = 15 * 60


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def describe(event: dict) -> str:
    eta = event.get("eta_seconds")
    parts = [f"{event['status']:9s} step {event['step']:3d}/{event['total']}"]
    if event.get("loss") is not None:
        parts.append(f"loss {event['loss']:.4f} (smoothed {event['smoothed_loss']:.4f})")
    if event.get("validation_loss") is not None:
        parts.append(f"validation {event['validation_loss']:.4f} (step {event['validation_step']})")
    if event.get("seconds_per_step"):
        parts.append(f"{event['seconds_per_step']:.1f} s/step, ETA {eta:.0f} s")
    return "  ".join(parts)


def node_of(workflow: dict, class_type: str) -> str:
    """The id of the workflow's only node of `class_type`."""
    (found,) = [key for key, node in workflow.items() if node["class_type"] == class_type]
    return found


def run(server: ComfyServer, workflow: dict) -> tuple[str, str]:
    """Queue `workflow`, print its progress; returns (how it ended, prompt id)."""
    ws, client_id = server.websocket()
    ws.settimeout(600)
    try:
        prompt_id = server.post_json("/prompt", {"prompt": workflow, "client_id": client_id})["prompt_id"]
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            raw = ws.recv()
            if not isinstance(raw, str):
                continue
            message = json.loads(raw)
            kind, data = message["type"], message.get("data", {})
            if kind == PROGRESS_EVENT:
                say(describe(data))
                if data["status"] in ("finished", "failed", "cancelled") and data.get("message"):
                    say(f"TrainLoRA: {data['message']}")
            elif kind == "executing" and data.get("node") is not None:
                node = workflow[data["node"]]["class_type"]
                say(f"running {node}")
            elif data.get("prompt_id") == prompt_id and kind == "execution_error":
                raise SystemExit(
                    f"[demo] the workflow failed in {data['node_type']}: {data['exception_message']}"
                )
            elif data.get("prompt_id") == prompt_id and kind in (
                "execution_success",
                "execution_interrupted",
            ):
                return kind, prompt_id
        raise SystemExit(f"[demo] no result after {TIMEOUT_SECONDS} s; see {server.log_path}")
    finally:
        ws.close()


def prepare_assets() -> dict:
    """The demo model files, generated with ComfyUI's own classes on the first run."""
    import torch

    sys.path.insert(0, str(comfyui_root()))
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = comfy_args.cpu or not torch.cuda.is_available()
    return ensure_assets(asset_cache_dir())


def train(server: ComfyServer, base) -> str | None:
    """Queue the training example with overwrite on (so the demo reruns); returns the LoRA's
    file name, or None if the run did not succeed."""
    workflow = json.loads(WORKFLOW.read_text())
    trainer, report = node_of(workflow, "KontextTrainer_TrainLoRA"), node_of(workflow, "PreviewAny")
    workflow[trainer]["inputs"]["overwrite"] = True  # the example ships with it off
    previous = base / "models" / "loras" / f"{workflow[trainer]['inputs']['lora_name']}.safetensors"
    existed = previous.is_file()
    say(f"queueing {WORKFLOW.relative_to(REPO_ROOT)} (overwrite on)")
    outcome, prompt_id = run(server, workflow)
    if outcome != "execution_success":
        say(f"the training run ended with {outcome}")
        return None
    outputs = server.history(prompt_id)["outputs"]
    say("LoadKontextDataset report:\n  " + outputs[report]["text"][0].replace("\n", "\n  "))
    result = outputs[trainer]  # TrainLoRA's UI output
    lora_name, losses = result["lora_name"][0], result["loss"]
    lora = base / "models" / "loras" / lora_name
    if existed:
        say(f"replaced the previous demo LoRA {lora} (overwrite is on in the demo)")
    say(f"LoRA saved: {lora}")
    say(f"loss at the start {losses[0]:.4f}, at the end {losses[-1]:.4f} ({len(losses)} steps)")
    points = zip(result.get("validation_step", []), result.get("validation_loss", []), strict=True)
    curve = ", ".join(f"step {step}: {loss:.4f}" for step, loss in points)
    if curve:
        say(f"held-out validation loss (fixed noise levels and noise): {curve}")
    return lora_name


def sample(server: ComfyServer, base, lora_name: str) -> bool:
    """Queue the inference example exactly as shipped: it loads `lora_name` and the reference."""
    workflow = json.loads(INFERENCE.read_text())
    loader = node_of(workflow, "LoraLoaderModelOnly")
    if workflow[loader]["inputs"]["lora_name"] != lora_name:
        raise SystemExit(f"[demo] {INFERENCE.name} loads another LoRA than the demo trains ({lora_name})")
    say(f"queueing {INFERENCE.relative_to(REPO_ROOT)} as shipped (the LoRA on {REFERENCE_IMAGE})")
    outcome, prompt_id = run(server, workflow)
    if outcome != "execution_success":
        say(f"the inference run ended with {outcome}")
        return False
    images = server.history(prompt_id)["outputs"][node_of(workflow, "SaveImage")]["images"]
    for image in images:
        say(f"edited image saved: {base / 'output' / image['subfolder'] / image['filename']}")
    return True


def main() -> int:
    started = time.monotonic()
    say("preparing the random-weight Flux, VAE and CLIP-L (generated once, cached in .cache/assets)")
    assets = prepare_assets()
    base = make_base_directory(DEMO_BASE)
    link_into_models(assets, base / "models")
    dataset = write_demo_dataset(base / "input" / "kontext_demo")
    say(f"dataset: {len(list(dataset.glob('*_control.png')))} edit pairs in {dataset}")
    say(f"reference for previews and inference: {base / 'input' / REFERENCE_IMAGE}")
    with ComfyServer(base) as server:
        say(f"ComfyUI is up at {server.url} (log: {server.log_path})")
        lora_name = train(server, base)
        if lora_name is None or not sample(server, base, lora_name):
            return 1
    say(f"done in {time.monotonic() - started:.0f} s; load it with LoraLoaderModelOnly as '{lora_name}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
