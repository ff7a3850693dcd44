"""The demo: train a Kontext LoRA end to end through a real, headless ComfyUI; or, with `ui`,
start that ComfyUI on the demo's files for a browser (`make ui`).

1. generates (once, cached) the stock-loadable random-weight Flux, its VAE and a CLIP-L
   (`demo_assets`), and every input the shipped examples name whose models these stand in for
   (`demo_dataset`: the Kontext edit pairs, the FLUX.1-dev and DreamOmni2 datasets, the reference
   images), in `.cache/`;
2. starts ComfyUI (`main.py --cpu`) with the pack, on a free local port, base directory
   `.cache/demo/`;
3. queues `example_workflows/api/kontext_lora_training.json` over the HTTP API (stock
   UNETLoader / VAELoader / DualCLIPLoader -> LoadKontextDataset -> TrainLoRA, with
   PreviewSampler previews of the unseen reference `input/kontext_demo_reference.png`) on the
   demo's files (`demo_assets.on_demo_files`: the example names the real FLUX.1 Kontext files,
   and its DualCLIPLoader becomes a CLIPLoader of the demo's CLIP-L: a T5-XXL has no small
   stand-in) under the demo's own LoRA name (`DEMO_LORA`: the example's stays free) with
   `overwrite` on, and prints the dataset report and the live progress the websocket carries;
4. prints where the LoRA landed in models/loras, the loss at the start and the end, and the
   held-out validation loss (one of the eight samples is held out) at each point it was
   computed;
5. queues `example_workflows/api/kontext_lora_inference.json` on the demo's files in the same
   way, with that LoRA in its LoraLoader (and the reference it ships with), and prints where its
   image landed in output/: with random weights and a minute of training that image is coloured
   noise, not an edited circle; it shows the path runs.

Rerunning reuses the models, the datasets and the encoded-latent cache; training reruns and
replaces the demo LoRA. Run it with `make demo` (which sets everything up first).

`ui [--port N] [--base-directory DIR]`: the same preparation, then the chosen ComfyUI (0.3.75,
or KONTEXT_TRAINER_COMFYUI's) with the pack on the CPU, in the foreground, on the demo's base
directory with a sqlite database file in it; prints the address to open. Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from comfy_server import (
    REPO_ROOT,
    ComfyServer,
    asset_cache_dir,
    comfyui_root,
    comfyui_site,
    make_base_directory,
)
from demo_assets import ensure_assets, link_into_models, on_demo_files
from demo_dataset import KONTEXT_FOLDER, REFERENCE_IMAGE, write_example_inputs

WORKFLOW = REPO_ROOT / "example_workflows" / "api" / "kontext_lora_training.json"
INFERENCE = REPO_ROOT / "example_workflows" / "api" / "kontext_lora_inference.json"
DEMO_BASE = REPO_ROOT / ".cache" / "demo"
# The demo's LoRA: a name of its own, so the training example runs as shipped after the demo
# (overwrite off, it writes kontext_demo_lora) and the demo reruns without touching that file
DEMO_LORA = "kontext_trainer_demo"
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
        running = eta is not None and event["step"] < event["total"]
        parts.append(f"{event['seconds_per_step']:.1f} s/step" + (f", ETA {eta:.0f} s" if running else ""))
    return "  ".join(parts)


def printed_once(event: dict, last: tuple | None) -> tuple | None:
    """The (status, step) to print for `event`, or None where that line is out already: a
    preview or validation after a step sends the step again with a new ETA."""
    key = (event["status"], event["step"])
    return None if key == last else key


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
        last = None
        while time.monotonic() < deadline:
            raw = ws.recv()
            if not isinstance(raw, str):
                continue
            message = json.loads(raw)
            kind, data = message["type"], message.get("data", {})
            if kind == PROGRESS_EVENT and (key := printed_once(data, last)) is not None:
                last = key
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

    for path in filter(None, [comfyui_root(), comfyui_site()]):  # its own frontend packages first
        sys.path.insert(0, str(path))
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = comfy_args.cpu or not torch.cuda.is_available()
    return ensure_assets(asset_cache_dir())


def train(server: ComfyServer, base) -> str | None:
    """Queue the training example on the demo's files under the demo's own LoRA name with
    overwrite on (so the demo reruns); returns the LoRA's file name, or None if the run did not
    succeed."""
    workflow = on_demo_files(json.loads(WORKFLOW.read_text()))
    trainer, report = node_of(workflow, "KontextTrainer_TrainLoRA"), node_of(workflow, "PreviewAny")
    shipped = workflow[trainer]["inputs"]["lora_name"]
    workflow[trainer]["inputs"].update(lora_name=DEMO_LORA, overwrite=True)  # the example: its own, off
    previous = base / "models" / "loras" / f"{DEMO_LORA}.safetensors"
    existed = previous.is_file()
    example = WORKFLOW.relative_to(REPO_ROOT)
    say(f"queueing {example} on the demo's files, lora_name {DEMO_LORA} (its own: {shipped}), overwrite on")
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
    """Queue the inference example on the demo's files, as shipped but for its LoRA, the demo's
    `lora_name` in place of the training example's (it loads the reference the demo wrote)."""
    workflow = on_demo_files(json.loads(INFERENCE.read_text()))
    loader = node_of(workflow, "LoraLoaderModelOnly")
    workflow[loader]["inputs"]["lora_name"] = lora_name
    example = INFERENCE.relative_to(REPO_ROOT)
    say(f"queueing {example} on the demo's files with the demo's LoRA {lora_name} (on {REFERENCE_IMAGE})")
    outcome, prompt_id = run(server, workflow)
    if outcome != "execution_success":
        say(f"the inference run ended with {outcome}")
        return False
    images = server.history(prompt_id)["outputs"][node_of(workflow, "SaveImage")]["images"]
    for image in images:
        say(f"inference image saved: {base / 'output' / image['subfolder'] / image['filename']}")
    say(
        "expect coloured noise in it, not a blue circle: the demo's models have random weights and "
        "trained for a minute; it shows that training, saving and loading the LoRA work"
    )
    return True


def prepare(base: Path) -> Path:
    """The demo's model files and every input of the examples they serve, in base directory `base`."""
    say("preparing the random-weight Flux, VAE and CLIP-L (generated once, cached in .cache/assets)")
    assets = prepare_assets()
    base = make_base_directory(base)
    link_into_models(assets, base / "models")
    inputs = write_example_inputs(base / "input")
    pairs = len(list(inputs[KONTEXT_FOLDER].glob("*_control.png")))
    say(f"dataset: {pairs} edit pairs in {inputs[KONTEXT_FOLDER]}")
    say(f"reference for previews and inference: {inputs[REFERENCE_IMAGE]}")
    others = ", ".join(name for name in inputs if name not in (KONTEXT_FOLDER, REFERENCE_IMAGE))
    say(f"the other examples' inputs, also in {base / 'input'}: {others}")
    return base


def demo() -> int:
    started = time.monotonic()
    base = prepare(DEMO_BASE)
    with ComfyServer(base) as server:
        say(f"ComfyUI is up at {server.url} (log: {server.log_path})")
        lora_name = train(server, base)
        if lora_name is None or not sample(server, base, lora_name):
            return 1
    say(f"done in {time.monotonic() - started:.0f} s; load it with LoraLoaderModelOnly as '{lora_name}'")
    say("the examples in a browser: make ui (they load the real model files and offer the missing ones)")
    return 0


def ui_command(base: Path, port: int) -> list[str]:
    """ComfyUI with the pack on the CPU, on `base`, with a sqlite file there (ComfyUI 0.33 cannot
    open its default database path on a base directory and says so at start)."""
    return [
        sys.executable,
        "main.py",
        "--cpu",
        "--listen",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-directory",
        str(base),
        "--database-url",
        f"sqlite:///{base / 'user' / 'comfyui.db'}",
        "--disable-auto-launch",
    ]


def ui(port: int, base: Path) -> int:
    """Prepare the demo's files, start ComfyUI in the foreground, print its address."""
    base = prepare(base)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    site = comfyui_site()
    if site is not None:  # this ComfyUI's own frontend packages (0.33) before the venv's
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    process = subprocess.Popen(ui_command(base, port), cwd=comfyui_root(), env=env)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    url = f"http://127.0.0.1:{port}"
    try:
        while process.poll() is None:
            try:
                urllib.request.urlopen(f"{url}/system_stats", timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        else:
            return process.returncode
        say(f"ComfyUI ({comfyui_root().name}) with the pack, on the demo's files in {base}")
        say(f"open {url} in a browser; the examples are under Templates -> Extensions. Ctrl-C stops it.")
        return process.wait()
    except KeyboardInterrupt:
        return process.wait()  # Ctrl-C reached ComfyUI too: it stops by itself
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    browser = commands.add_parser("ui", help="start ComfyUI with the pack on the demo's files")
    browser.add_argument("--port", type=int, default=8188)
    browser.add_argument("--base-directory", type=Path, default=DEMO_BASE)
    args = parser.parse_args(argv)
    if args.command == "ui":
        return ui(args.port, args.base_directory.resolve())
    return demo()


if __name__ == "__main__":
    sys.exit(main())
