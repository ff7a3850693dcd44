"""The pack's packaging promises: requirements, pyproject, imports, web version."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACK_DIRS = ("nodes", "trainer_core")


def _requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_requirements_never_name_the_torch_family():
    names = {_name(r) for r in _requirement_lines(REPO / "requirements.txt")}
    assert names and not names & {"torch", "torchvision", "torchaudio"}


def test_pyproject_dependencies_match_requirements():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert sorted(project["dependencies"]) == sorted(_requirement_lines(REPO / "requirements.txt"))


def test_pyproject_registry_fields():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    project, comfy = data["project"], data["tool"]["comfy"]
    assert "comfyui" not in project["name"].lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert comfy["DisplayName"] == "Kontext Trainer" and comfy["PublisherId"]
    assert re.fullmatch(r">=\s*\d+\.\d+\.\d+", comfy["requires-comfyui"])


def test_pack_never_imports_nodes_absolutely():
    """ComfyUI owns the top-level `nodes`; inside the pack only relative imports reach ours."""
    files = [REPO / "__init__.py"] + [f for d in PACK_DIRS for f in sorted((REPO / d).rglob("*.py"))]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            absolute = (
                isinstance(node, ast.Import)
                and any(a.name.split(".")[0] in ("nodes", "trainer_core") for a in node.names)
            ) or (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").split(".")[0] in ("nodes", "trainer_core")
            )
            if absolute:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders


def test_web_badge_version_matches_pyproject():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    js = (REPO / "web" / "js" / "about.js").read_text()
    assert re.search(r'PACK_VERSION = "([^"]+)"', js).group(1) == version
