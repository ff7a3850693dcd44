"""A real ComfyUI server subprocess on a free loopback port, with the pack installed; used by
the demo (`scripts/demo.py`) and by the end-to-end tests (`tests/kt_testing` re-exports it).

    with ComfyServer(base_dir) as server:
        server.get_json("/object_info")

It is started as `python main.py --cpu ...` from the ComfyUI root (without `--cpu` when
KT_TEST_DEVICE=cuda or `device="cuda"`: ComfyUI then picks the GPU as a user's would), logs to a
file in the base directory, and is stopped by its PID (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
COMFYUI_ENV = "KONTEXT_TRAINER_COMFYUI"
# The folder name the pack gets inside a test ComfyUI's custom_nodes.
PACK_DIR_NAME = "kontext-trainer"
# Which device test ComfyUIs (in-process and servers) run on: "cpu" (the default, `--cpu`) or
# "cuda" (no `--cpu`; the GPU layer, `make test-gpu`).
TEST_DEVICE_ENV = "KT_TEST_DEVICE"
COMFY_DEVICES = ("cpu", "cuda")
# The attention a ComfyUI on an NVIDIA GPU picks by itself (PyTorch's scaled_dot_product_attention
# for the model and the VAE), asked for on the CPU, where ComfyUI would otherwise chunk it in Python
# (sub-quadratic for the model, sliced for the VAE): test ComfyUIs run the users' attention, and
# faster (the headless Qwen-Image-Edit run: 62 core-s with the CPU default, 44 with this).
CPU_ATTENTION_FLAGS = ("--use-pytorch-cross-attention",)


def comfyui_root() -> Path:
    """The ComfyUI checkout named by KONTEXT_TRAINER_COMFYUI, else the bundled copy."""
    named = os.environ.get(COMFYUI_ENV)
    root = Path(named).resolve() if named else REPO_ROOT / ".comfyui"
    if not (root / "main.py").is_file():
        hint = f"{COMFYUI_ENV}={named}" if named else "the bundled .comfyui/"
        raise RuntimeError(f"no ComfyUI at {root} ({hint}); run `make setup` first")
    return root


# Set-up puts a ComfyUI's own frontend, templates and docs packages here when their pins
# differ from the venv's (ComfyUI 0.33 beside 0.3.75); they go first on that ComfyUI's path.
SITE_DIR_NAME = ".kontext-site"


def comfyui_site(root: Path | None = None) -> Path | None:
    site = (root or comfyui_root()) / SITE_DIR_NAME
    return site if site.is_dir() else None


def comfy_device() -> str:
    """The device test ComfyUIs run on: KT_TEST_DEVICE (cpu or cuda), "cpu" when unset."""
    device = os.environ.get(TEST_DEVICE_ENV, "").strip().lower() or "cpu"
    if device not in COMFY_DEVICES:
        raise RuntimeError(f"{TEST_DEVICE_ENV}={device!r}: use one of {', '.join(COMFY_DEVICES)}")
    return device


def asset_cache_dir() -> Path:
    """Generated model files live here, outside git, and survive between runs."""
    return Path(os.environ.get("KONTEXT_TRAINER_ASSET_CACHE", REPO_ROOT / ".cache" / "assets"))


def make_base_directory(base: Path, extra_packs: dict[str, Path] | None = None) -> Path:
    """A ComfyUI --base-directory with the pack installed the way a user installs it (a folder
    in custom_nodes), plus any `extra_packs` (name -> folder), e.g. the tests' own nodes."""
    for sub in ("custom_nodes", "models", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for name, target in {PACK_DIR_NAME: REPO_ROOT, **(extra_packs or {})}.items():
        link, target = base / "custom_nodes" / name, Path(target).resolve()
        if link.is_symlink() and link.resolve() != target:  # a moved or other checkout: this one
            link.unlink()
        if not link.is_symlink():
            if link.exists():
                raise RuntimeError(f"{link} exists and is not a link to {target}; remove it")
            link.symlink_to(target, target_is_directory=True)
    return base


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ComfyServer:
    def __init__(
        self,
        base_dir: Path,
        start_timeout: float = 180.0,
        extra_packs: dict[str, Path] | None = None,
        device: str | None = None,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
    ):
        """`device`: "cpu" starts ComfyUI with --cpu (and CPU_ATTENTION_FLAGS), "cuda" without
        them; None: `comfy_device()`.
        `env`: extra environment variables for the server process; `args`: more of ComfyUI's
        command-line options (e.g. --disable-dynamic-vram)."""
        self.device = device or comfy_device()
        if self.device not in COMFY_DEVICES:
            raise ValueError(f"device {self.device!r}: use one of {', '.join(COMFY_DEVICES)}")
        self.base_dir = make_base_directory(base_dir, extra_packs)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.base_dir / "server.log"
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None
        self._retries_left = 3
        self.env = dict(env or {})
        self.args = tuple(args)

    def __enter__(self) -> ComfyServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        cmd = [
            sys.executable,
            "main.py",
            *(["--cpu", *CPU_ATTENTION_FLAGS] if self.device == "cpu" else []),
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--base-directory",
            str(self.base_dir),
            "--disable-auto-launch",
            "--database-url",
            "sqlite:///:memory:",
            *self.args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        site = comfyui_site()
        if site is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            cmd,
            cwd=comfyui_root(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self.port_was_taken and self._retries_left > 0:  # by another process since free_port
                    self._retries_left -= 1
                    self._log.close()
                    self.port = free_port()
                    self.url = f"http://127.0.0.1:{self.port}"
                    return self.start()
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                self.get_json("/system_stats", timeout=2)
                if self.listening_line in self.log():  # our server answered, not one started beside
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {self.start_timeout} s:\n{self.log()[-4000:]}")

    @property
    def listening_line(self) -> str:
        """What ComfyUI logs once it listens on our port (0.3.75 and 0.33)."""
        return f"To see the GUI go to: http://127.0.0.1:{self.port}\n"

    @property
    def port_was_taken(self) -> bool:
        """The port `free_port` found was taken before ComfyUI bound it (another test run's server)."""
        return "address already in use" in self.log().lower()

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)
        self._log.close()
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server at once (no shutdown, no cleanup), as a crash or power cut would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, timeout: float = 30) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return response.read()

    def get_json(self, path: str, timeout: float = 30):
        return json.loads(self.get(path, timeout))

    def post_json(self, path: str, payload: dict, timeout: float = 30):
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def websocket(self, client_id: str | None = None):
        """A websocket-client connection to /ws, plus the client id it announced."""
        import websocket

        client_id = client_id or uuid.uuid4().hex
        ws = websocket.create_connection(f"ws://127.0.0.1:{self.port}/ws?clientId={client_id}", timeout=120)
        return ws, client_id

    def history(self, prompt_id: str, timeout: float = 30) -> dict:
        """The prompt's /history entry. ComfyUI writes it just after it sends
        execution_success, so poll for it briefly."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get_json(f"/history/{prompt_id}").get(prompt_id)
            if entry is not None:
                return entry
            time.sleep(0.1)
        raise TimeoutError(f"no history for prompt {prompt_id} after {timeout} s")

    def run_prompt(self, prompt: dict, timeout: float = 300) -> tuple[str, list[dict]]:
        """Queue an API-format graph and collect websocket messages until it finishes."""
        ws, client_id = self.websocket()
        try:
            queued = self.post_json("/prompt", {"prompt": prompt, "client_id": client_id})
            prompt_id = queued["prompt_id"]
            messages, deadline = [], time.monotonic() + timeout
            while time.monotonic() < deadline:
                raw = ws.recv()
                if not isinstance(raw, str):
                    continue  # binary preview frames
                message = json.loads(raw)
                messages.append(message)
                data = message.get("data", {})
                if data.get("prompt_id") == prompt_id and message["type"] in (
                    "execution_success",
                    "execution_error",
                    "execution_interrupted",
                ):
                    return prompt_id, messages
            raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s")
        finally:
            ws.close()
