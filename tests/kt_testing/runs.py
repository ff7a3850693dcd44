"""Training runs driven through a real ComfyUI server the way a user drives them: queue, watch
the progress events, press Cancel (/interrupt), read the outputs from /history."""

from __future__ import annotations

import json
import time
from pathlib import Path

PROGRESS_EVENT = "kontext_trainer.progress"
ENDINGS = ("execution_success", "execution_error", "execution_interrupted")


def progress_events(messages: list[dict]) -> list[dict]:
    return [m["data"] for m in messages if m["type"] == PROGRESS_EVENT]


def run_and_interrupt(server, graph: dict, at_step: int, timeout: float = 300) -> list[dict]:
    """Queue `graph` and press Cancel once a progress event reports `at_step`; returns every
    websocket message up to the prompt's end."""
    return run_and_act(server, graph, at_step, lambda: server.post_json("/interrupt", {}), timeout)


def run_and_act(server, graph: dict, at_step: int, action, timeout: float = 300) -> list[dict]:
    """Queue `graph` and call `action()` once, when a progress event reports `at_step`;
    returns every websocket message up to the prompt's end."""
    ws, client_id = server.websocket()
    try:
        queued = server.post_json("/prompt", {"prompt": graph, "client_id": client_id})
        messages, pressed, deadline = [], False, time.monotonic() + timeout
        while time.monotonic() < deadline:
            raw = ws.recv()
            if not isinstance(raw, str):
                continue
            message = json.loads(raw)
            messages.append(message)
            data = message.get("data", {})
            if message["type"] == PROGRESS_EVENT and data.get("step", 0) >= at_step and not pressed:
                pressed = True
                action()
            if data.get("prompt_id") == queued["prompt_id"] and message["type"] in ENDINGS:
                return messages
        raise TimeoutError(f"prompt {queued['prompt_id']} did not end in {timeout} s")
    finally:
        ws.close()


def losses_of(server, prompt_id: str, node: str = "5") -> list[float]:
    """TrainLoRA's loss per step (every step of the run, a resumed run's earlier ones too)."""
    return server.history(prompt_id)["outputs"][node]["loss"]


def error_of(messages: list[dict]) -> str:
    last = messages[-1]
    assert last["type"] == "execution_error", last
    return last["data"]["exception_message"]


def checkpoints_root(server) -> Path:
    return server.base_dir / "output" / "kontext_trainer_checkpoints"


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (to prove a folder was left untouched)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }
