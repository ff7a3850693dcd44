"""trainer_core stays pure: importable with no ComfyUI anywhere on the path."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {"comfy", "comfy_api", "comfy_extras", "folder_paths", "server", "nodes", "execution"}


def _isolated(code: str) -> subprocess.CompletedProcess:
    """Run code in an isolated interpreter (-I: no PYTHONPATH, no user site) whose only
    extra path entry is the repo root, the way `python -c "import trainer_core"` sees it."""
    return subprocess.run(
        [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, '.')\n" + code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_imports_without_comfyui_on_the_path():
    # Precondition: ComfyUI really is unreachable in that interpreter.
    probe = _isolated("import comfy")
    assert probe.returncode != 0 and "No module named 'comfy'" in probe.stderr
    result = _isolated(
        "import trainer_core\n"
        f"leaked = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r})\n"
        "assert not leaked, leaked\n"
    )
    assert result.returncode == 0, result.stderr


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_module_of_trainer_core_imports_comfyui():
    files = sorted((REPO / "trainer_core").rglob("*.py"))
    assert files, "trainer_core has no modules"
    offenders = {str(f.relative_to(REPO)): sorted(_imported_roots(f) & FORBIDDEN) for f in files}
    assert not {k: v for k, v in offenders.items() if v}


def test_version_matches_pyproject():
    import trainer_core

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert trainer_core.__version__ == project["version"]
